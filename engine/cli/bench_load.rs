//! `specd bench-load`: interactive chats beside long-prompt batches; time
//! to first token and per output token of the chats, unloaded and loaded
//! under fair and first-come-first-served scheduling.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use clap::Args;

use specd::bench_load::{self, LoadSpec, Setting};
use specd::speculative::fairness::Scheduling;

use super::ModelArgs;

#[derive(Args)]
pub struct BenchLoadArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Engine and proposer settings (default: the built-in configuration).
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// Interactive chat requests, one every --interval-ms.
    #[arg(long, default_value_t = 24)]
    pub interactive: usize,
    #[arg(long, default_value_t = 250)]
    pub interval_ms: u64,
    /// Tokens each chat generates.
    #[arg(long, default_value_t = 32)]
    pub interactive_tokens: usize,
    /// Background requests, all sent at the start.
    #[arg(long, default_value_t = 2)]
    pub background_requests: usize,
    /// Prompts per background request (one `/v1/completions` batch each).
    #[arg(long, default_value_t = 16)]
    pub background_prompts: usize,
    /// Tokens per background prompt.
    #[arg(long, default_value_t = 1000)]
    pub background_len: usize,
    #[arg(long, default_value_t = 16)]
    pub background_tokens: usize,
    /// Proposer of every request (`none`: plain decoding).
    #[arg(long, default_value = "none")]
    pub proposer: String,
    /// Scheduling policies of the loaded runs (fcfs: the scheduler before
    /// fair scheduling, prefill chunks up to max_batch_tokens).
    #[arg(long, value_delimiter = ',', default_value = "fcfs,fair", value_parser = parse_policy)]
    pub scheduling: Vec<Scheduling>,
    /// One fair run per value of `[engine] max_prefill_tokens` (default:
    /// the config's).
    #[arg(long, value_delimiter = ',')]
    pub max_prefill_tokens: Vec<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn parse_policy(s: &str) -> std::result::Result<Scheduling, String> {
    match s {
        "fair" => Ok(Scheduling::Fair),
        "fcfs" => Ok(Scheduling::Fcfs),
        other => Err(format!("unknown scheduling {other:?} (use fair or fcfs)")),
    }
}

pub fn run(a: BenchLoadArgs) -> Result<()> {
    let (path, model) = a.model.load()?;
    let model = Arc::new(model);
    let cfg = super::load_config(&a.config)?;
    let tok = Arc::new(specd::tokenizer::Tokenizer::for_model(&path)?);
    let spec = LoadSpec {
        chats: bench_load::chat_prompts(&tok)?,
        interactive: a.interactive,
        interval: Duration::from_millis(a.interval_ms),
        interactive_tokens: a.interactive_tokens,
        background_requests: a.background_requests,
        background_prompts: a.background_prompts,
        background_len: a.background_len,
        background_tokens: a.background_tokens,
        proposer: a.proposer.clone(),
    };
    let vocab = model.config.vocab_size;
    let mut settings = Vec::new();
    for &p in &a.scheduling {
        let caps: Vec<Option<usize>> = match p {
            Scheduling::Fair if !a.max_prefill_tokens.is_empty() => a
                .max_prefill_tokens
                .iter()
                .map(|&n| Some(n.max(1)))
                .collect(),
            _ => vec![None],
        };
        settings.extend(caps.into_iter().map(|c| Setting {
            scheduling: p,
            max_prefill_tokens: c,
        }));
    }
    let make = |s| bench_load::driver(&model, Some(tok.clone()), &cfg, s);
    let runs = bench_load::bench_load(&spec, &settings, &make, vocab)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&runs)?);
        return Ok(());
    }
    let ec = cfg.engine_config(&model);
    println!(
        "{} chats ({} tokens each, one every {} ms) beside {} background requests of {} x {}-token prompts ({} tokens each); max_running {}, max_batch_tokens {}, max_prefill_tokens {} (fair/N: N), proposer {}",
        a.interactive,
        a.interactive_tokens,
        a.interval_ms,
        a.background_requests,
        a.background_prompts,
        a.background_len,
        a.background_tokens,
        ec.scheduler.max_running,
        ec.scheduler.max_batch_tokens,
        ec.scheduler.max_prefill_tokens,
        a.proposer
    );
    println!(
        "  {:<10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>12} {:>8} {:>9} {:>6}",
        "run",
        "ttft p50",
        "p95",
        "p99",
        "tpot p50",
        "p95",
        "p95 x",
        "tok/s",
        "preempt",
        "computed",
        "steps"
    );
    let base = runs.first().map(|r| r.ttft_p95_ms).unwrap_or(0.0);
    for r in &runs {
        println!(
            "  {:<10} {:>8.0}ms {:>8.0}ms {:>8.0}ms {:>8.1}ms {:>8.1}ms {:>9.1} {:>12.0} {:>8} {:>9} {:>6}",
            r.name,
            r.ttft_p50_ms,
            r.ttft_p95_ms,
            r.ttft_p99_ms,
            r.tpot_p50_ms,
            r.tpot_p95_ms,
            r.ttft_p95_ms / base.max(1e-9),
            r.throughput_tok_s,
            r.preemptions,
            r.computed_tokens,
            r.steps
        );
    }
    if let Some(fcfs) = runs.iter().find(|r| r.name == "fcfs") {
        for fair in runs.iter().filter(|r| r.name.starts_with("fair")) {
            println!(
                "{} vs fcfs: interactive p95 time to first token {:.2}x, aggregate throughput {:.3}x",
                fair.name,
                fair.ttft_p95_ms / fcfs.ttft_p95_ms.max(1e-9),
                fair.throughput_tok_s / fcfs.throughput_tok_s.max(1e-9)
            );
        }
    }
    Ok(())
}
