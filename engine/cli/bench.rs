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
    #[arg(long, default_value_t = 15)]
    pub reps: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: BenchArgs) -> Result<()> {
    let (path, model) = a.model.load()?;
    let b = specd::bench::bench_model(
        &model, a.prefill, a.decode, a.context, &a.ks, &a.trees, a.reps,
    )?;
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
    if !b.tree_verify.is_empty() {
        println!("tree verify cost (nodes + root, ternary tree, tree mask):");
        println!("  {:>5}  {:>9}  {:>6}", "nodes", "ms", "x k=1");
        for (n, ms, r) in &b.tree_verify {
            println!("  {n:>5}  {ms:>9.2}  {r:>6.2}");
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
    Ok(())
}
