//! The `specd` command line.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use specd::generate::{generate, GenerateRequest};
use specd::model::{self, Model};
use specd::sampler::SamplingParams;
use specd::tokenizer::{ChatMessage, Tokenizer};

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
    /// Fetch the default model into $SPECD_HOME (default ~/.cache/specd);
    /// a cached copy whose SHA-256 matches is kept.
    FetchModel {
        /// Download again even if a verified copy is cached.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Args)]
struct ModelArgs {
    /// GGUF file or safetensors directory; default: the embedded SmolLM2-135M-Instruct.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Compute threads (default: available cores).
    #[arg(long)]
    threads: Option<usize>,
}

impl ModelArgs {
    fn path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => Ok(specd::fetch::ensure_default_model()?),
        }
    }

    fn load(&self) -> Result<(PathBuf, Model)> {
        let path = self.path()?;
        let threads = self.threads.unwrap_or_else(model::llama::default_threads);
        let m = model::load_model(&path, threads)
            .with_context(|| format!("loading {}", path.display()))?;
        Ok((path, m))
    }
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    #[arg(long)]
    ignore_eos: bool,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 512)]
    prefill: usize,
    #[arg(long, default_value_t = 128)]
    decode: usize,
    #[arg(long, default_value_t = 256)]
    context: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,5,6,8")]
    ks: Vec<usize>,
    #[arg(long, default_value_t = 15)]
    reps: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::FetchModel { force } => {
            let cached = specd::fetch::default_model_path();
            let p = if !force
                && cached.exists()
                && specd::fetch::sha256_file(&cached)? == specd::fetch::SHA256
            {
                eprintln!("specd: {} is cached and verified", cached.display());
                cached
            } else {
                specd::fetch::fetch_default_model()?
            };
            println!("{}", p.display());
            Ok(())
        }
        Cmd::Generate(a) => cmd_generate(a),
        Cmd::BenchModel(a) => cmd_bench(a),
    }
}

fn cmd_generate(a: GenerateArgs) -> Result<()> {
    let (path, model) = a.model.load()?;
    let tok = Tokenizer::for_model(&path)?;
    let text = if a.chat {
        tok.apply_chat_template(&[ChatMessage::user(a.prompt.clone())], true)?
    } else {
        a.prompt.clone()
    };
    let prompt = tok.encode(&text, !a.chat)?;
    let req = GenerateRequest {
        prompt,
        params: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repetition_penalty: a.repetition_penalty,
            presence_penalty: a.presence_penalty,
            frequency_penalty: a.frequency_penalty,
            seed: a.seed,
        },
        max_tokens: a.max_tokens,
        stop: a.stop,
        ignore_eos: a.ignore_eos,
    };
    let stdout = std::io::stdout();
    let out = generate(&model, Some(&tok), &req, |t| {
        let mut s = stdout.lock();
        let _ = s.write_all(t.as_bytes());
        let _ = s.flush();
    })?;
    println!();
    eprintln!(
        "prompt tokens: {}  generated tokens: {}  finish: {:?}  time to first token: {:.1} ms  decode: {:.1} tok/s",
        out.prompt_tokens,
        out.tokens.len(),
        out.finish,
        out.time_to_first_token.as_secs_f64() * 1e3,
        out.decode_tok_per_s()
    );
    Ok(())
}

fn cmd_bench(a: BenchArgs) -> Result<()> {
    let (path, model) = a.model.load()?;
    let b = specd::bench::bench_model(&model, a.prefill, a.decode, a.context, &a.ks, a.reps)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&b)?);
        return Ok(());
    }
    println!(
        "model: {}  threads: {}  kernels: {}",
        path.display(),
        b.threads,
        b.kernel
    );
    println!(
        "prefill ({} tokens): {:.1} tok/s",
        b.prefill_tokens, b.prefill_tok_s
    );
    println!(
        "decode  ({} tokens): {:.1} tok/s",
        b.decode_tokens, b.decode_tok_s
    );
    println!(
        "verify cost at context {} (all-position logits):",
        b.context
    );
    println!("  {:>3}  {:>9}  {:>6}", "k", "ms", "x k=1");
    for (k, ms, r) in &b.verify {
        println!("  {k:>3}  {ms:>9.2}  {r:>6.2}");
    }
    Ok(())
}
