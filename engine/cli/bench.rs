//! `specd bench-model`: prefill, decode and k-token verify cost.

use anyhow::Result;
use clap::Args;

use super::ModelArgs;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value_t = 512)]
    pub prefill: usize,
    #[arg(long, default_value_t = 128)]
    pub decode: usize,
    #[arg(long, default_value_t = 256)]
    pub context: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,5,6,8")]
    pub ks: Vec<usize>,
    /// Tree sizes (drafted nodes) whose verify cost is measured too.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32,64")]
    pub trees: Vec<usize>,
    #[arg(long, default_value_t = 15, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub reps: usize,
    /// Also time decoding through the engine at this temperature (alone,
    /// and with --top-p) beside greedy, for each of --proposers.
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long, default_value_t = 0.9)]
    pub top_p: f32,
    /// Proposers for the sampled-decode table (from --config, default: the
    /// built-in configuration's).
    #[arg(long, value_delimiter = ',', default_value = "none,ngram,suffix")]
    pub proposers: Vec<String>,
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// Tokens per run and runs per setting of the sampled-decode table.
    #[arg(long, default_value_t = 128)]
    pub sample_tokens: usize,
    #[arg(long, default_value_t = 3)]
    pub sample_reps: usize,
    /// Also time the first token of a request after another sharing a
    /// prefix of this many tokens (prefix cache: cold vs warm).
    #[arg(long)]
    pub prefix_cache: Option<usize>,
    /// Evict the weights from the CPU caches before every timed decode and
    /// verify forward, so each streams them from memory: what a machine
    /// whose last-level cache is far smaller than the model sees, measured
    /// on one whose cache could hold them (x86-64).
    #[arg(long)]
    pub cold: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: BenchArgs) -> Result<()> {
    let (path, model) = a.model.load()?;
    let b = specd::bench_model::bench_model(
        &model, a.prefill, a.decode, a.context, &a.ks, &a.trees, a.reps, a.cold,
    )?;
    let model = std::sync::Arc::new(model);
    let prefix = match a.prefix_cache {
        Some(n) => Some(specd::bench_model::bench_prefix_cache(&model, n, 5)?),
        None => None,
    };
    let sampled = match a.temperature {
        Some(t) => Some(sampled_decode(&a, &path, model, t)?),
        None => None,
    };
    if a.json {
        let v = serde_json::json!({"model": b, "sampled_decode": sampled, "prefix_cache_ttft_ms": prefix});
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print_model(&path, &b);
    if let (Some((cold, warm, four)), Some(n)) = (prefix, a.prefix_cache) {
        println!(
            "time to first token, {n}-token shared prefix + 16 tokens (median of 5): cold {cold:.1} ms, warm {warm:.1} ms ({:.1}% of cold), four warm at once {four:.1} ms each on average",
            100.0 * warm / cold
        );
    }
    if let Some(rows) = sampled {
        println!(
            "decode through the engine ({} tokens, median of {} runs, settings interleaved):",
            a.sample_tokens, a.sample_reps
        );
        println!(
            "  {:<10} {:<26} {:>8} {:>9} {:>13} {:>11}",
            "proposer", "sampling", "tok/s", "x greedy", "accept stage", "tok/step"
        );
        for r in rows {
            println!(
                "  {:<10} {:<26} {:>8.1} {:>9.3} {:>12.1}% {:>11.2}",
                r.proposer,
                r.mode,
                r.tok_s,
                r.vs_greedy,
                100.0 * r.accept_share,
                r.tokens_per_step
            );
        }
    }
    Ok(())
}

/// The sampled-decode table: a chat prompt (pseudo-text ids when the model
/// has no tokenizer), each proposer greedy and sampled.
fn sampled_decode(
    a: &BenchArgs,
    path: &std::path::Path,
    model: std::sync::Arc<specd::model::Model>,
    temperature: f32,
) -> Result<Vec<specd::bench_model::SamplingBench>> {
    let cfg = super::load_config(&a.config)?;
    let tok = specd::tokenizer::Tokenizer::for_model(path).ok();
    let text = "Write a Python function that returns the n-th Fibonacci number, then explain how it works step by step.";
    let prompt = match &tok {
        Some(t) => super::encode_prompt(t, text, true)?,
        None => specd::bench_model::tokens(24, model.config.vocab_size, 5),
    };
    let tok = tok.map(std::sync::Arc::new);
    let make = || cfg.build_drafter(&model, tok.clone());
    Ok(specd::bench_model::bench_sampling(
        &model,
        &make,
        &a.proposers,
        &prompt,
        a.sample_tokens,
        a.sample_reps,
        temperature,
        a.top_p,
    )?)
}

fn print_model(path: &std::path::Path, b: &specd::bench_model::ModelBench) {
    println!(
        "model: {}  threads: {}  kernels: {}",
        path.display(),
        b.threads,
        b.kernel
    );
    println!(
        "prefill ({} tokens): {:.1} tok/s (median of {}; {:.0}-{:.0})",
        b.prefill_tokens, b.prefill_tok_s, b.prefill_runs, b.prefill_range.0, b.prefill_range.1
    );
    let (read, how) = if b.cold {
        println!("weights evicted from the CPU caches before every timed decode and verify forward (--cold)");
        (
            "streaming",
            format!(
                "from memory once per token ({:.1} GB/s streaming 512 MiB with {} threads)",
                b.read_gb_s, b.threads
            ),
        )
    } else {
        (
            "reading",
            format!(
                "once per token ({:.1} GB/s re-reading a buffer that size with {} threads; {:.1} GB/s streaming 512 MiB)",
                b.weights_read_gb_s, b.threads, b.read_gb_s
            ),
        )
    };
    println!(
        "decode  ({} tokens): {:.1} tok/s, {:.0}% of the {:.1} tok/s limit of {read} the {:.1} MiB of weights {how}",
        b.decode_tokens,
        b.decode_tok_s,
        100.0 * b.decode_tok_s / b.decode_limit_tok_s.max(1e-9),
        b.decode_limit_tok_s,
        b.weight_bytes as f64 / (1 << 20) as f64,
    );
    println!(
        "verify cost at context {} (all-position logits):",
        b.context
    );
    println!("  {:>3}  {:>9}  {:>6}", "k", "ms", "x k=1");
    for (k, ms, r) in &b.verify {
        println!("  {k:>3}  {ms:>9.2}  {r:>6.2}");
    }
    if !b.tree_verify.is_empty() {
        println!("tree verify cost (nodes + root, ternary tree, tree mask; chain: as many tokens, timed alternately):");
        println!(
            "  {:>5}  {:>9}  {:>6}  {:>9}  {:>8}",
            "nodes", "ms", "x k=1", "chain ms", "x chain"
        );
        for ((n, ms, r), (_, cms, x)) in b.tree_verify.iter().zip(&b.tree_vs_chain) {
            println!("  {n:>5}  {ms:>9.2}  {r:>6.2}  {cms:>9.2}  {x:>8.2}");
        }
    }
    let mb = |b: usize| b as f64 / (1024.0 * 1024.0);
    println!(
        "memory: weights {:.1} MiB, KV cache at context {} {:.1} MiB, peak RSS {}",
        mb(b.weight_bytes),
        b.context,
        mb(b.kv_bytes),
        b.peak_rss_bytes
            .map(|r| format!("{:.1} MiB", mb(r)))
            .unwrap_or_else(|| "unknown".into())
    );
    let (n, kept, every) = b.kv_full_context;
    if kept < every {
        println!(
            "KV of one sequence at the full context ({n} positions): {:.1} MiB, the sliding-window layers' entries outside the window released ({:.1} MiB with every layer's)",
            mb(kept),
            mb(every)
        );
    }
}
