//! `specd quantize`: requantize a GGUF model (e.g. to Q4_K_M) with
//! candle's quantizer.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use specd::model::requant::{self, Scheme};

#[derive(Args)]
pub struct QuantizeArgs {
    /// Source GGUF; default: the embedded SmolLM2-135M-Instruct.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// q4_k_m or q5_k_m (llama.cpp's mixes), q4_k, q6_k, q8_0 or q4_1.
    #[arg(long = "type", value_parser = Scheme::parse, default_value = "q4_k_m")]
    pub scheme: Scheme,
    /// Output GGUF file.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(a: QuantizeArgs) -> Result<()> {
    let src = match a.model {
        Some(p) => specd::fetch::resolve_model(&p)?,
        None => specd::fetch::ensure_default_model()?,
    };
    let s = requant::requantize(&src, &a.out, a.scheme)
        .with_context(|| format!("requantizing {}", src.display()))?;
    let mib = |b: f64| b / (1 << 20) as f64;
    println!(
        "wrote {} ({:.1} MiB; source {:.1} MiB)",
        a.out.display(),
        mib(s.bytes_out as f64),
        mib(s.bytes_in as f64)
    );
    for (ty, n, bytes) in &s.types {
        println!("  {ty:>5}: {n:>3} tensors, {:.1} MiB", mib(*bytes as f64));
    }
    if s.fallbacks > 0 {
        println!(
            "  {} matrices have rows that are not whole 256-element super-blocks and took the fallback type (Q6_K -> Q8_0, Q4_K -> Q5_0, Q5_K -> Q5_1, as llama.cpp does)",
            s.fallbacks
        );
    }
    Ok(())
}
