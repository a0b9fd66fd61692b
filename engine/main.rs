//! The `specd` command line (one file per command in `cli/`).

use anyhow::Result;
use clap::{Parser, Subcommand};

mod cli;

use cli::ab::AbArgs;
use cli::bench::BenchArgs;
use cli::bench_load::BenchLoadArgs;
use cli::distill::DistillCmd;
use cli::generate::GenerateArgs;
use cli::quantize::QuantizeArgs;
use cli::serve::ServeArgs;

#[derive(Parser)]
#[command(
    name = "specd",
    version,
    about = "Speculative-decoding inference engine"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text for one prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// Measure prefill, decode and k-token verify cost of a model.
    BenchModel(BenchArgs),
    /// Interactive chats beside long-prompt batches: time to first token
    /// under fair and FCFS scheduling.
    BenchLoad(BenchLoadArgs),
    /// A/B-compare proposer strategies on Spec-Bench, HumanEval or a JSONL.
    Ab(AbArgs),
    /// Train models for speculation.
    Distill {
        #[command(subcommand)]
        what: DistillCmd,
    },
    /// Serve the OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Requantize a GGUF model (e.g. to Q4_K_M) with candle's quantizer.
    Quantize(QuantizeArgs),
    /// The child process of a proposer with `isolation = "process"`
    /// (started by the daemon; not for direct use).
    #[command(hide = true)]
    PluginHost {
        /// The daemon's Unix socket.
        #[arg(long)]
        socket: std::path::PathBuf,
    },
    /// Fetch a catalogued model (the default unless --model) into
    /// $SPECD_HOME (default ~/.cache/specd);
    /// a cached copy whose SHA-256 matches is kept.
    FetchModel {
        /// Download again even if a verified copy is cached.
        #[arg(long)]
        force: bool,
        /// A catalogued model: smollm2-135m (the default) or gemma3-270m.
        #[arg(long, default_value = "smollm2-135m")]
        model: String,
    },
}

fn main() {
    tracing_subscriber::fmt()
        // Warnings (a poisoned proposer, a plugin host that died) show
        // unless RUST_LOG says otherwise.
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::FetchModel { force, model } => cli::fetch::run(&model, force),
        Cmd::Generate(a) => cli::generate::run(a),
        Cmd::Serve(a) => cli::serve::run(a),
        Cmd::Quantize(a) => cli::quantize::run(a),
        Cmd::Ab(a) => cli::ab::run(a),
        Cmd::Distill { what } => cli::distill::run(what),
        Cmd::BenchModel(a) => cli::bench::run(a),
        Cmd::BenchLoad(a) => cli::bench_load::run(a),
        Cmd::PluginHost { socket } => Ok(specd::plugins::host::serve(&socket)?),
    }
}
