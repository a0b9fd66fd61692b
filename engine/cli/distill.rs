//! `specd distill`: train proposers for a target by self-distillation.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};

use specd::model;

#[derive(Subcommand)]
pub enum DistillCmd {
    /// Train a small draft model for a target by self-distillation.
    Draft(DistillArgs),
}

#[derive(Args)]
pub struct DistillArgs {
    /// Target model (default: the embedded SmolLM2).
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// Output directory (checkpoints, model.safetensors, config.json,
    /// tokenizer.json); training resumes from a checkpoint found there.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long, default_value_t = 768)]
    pub intermediate: usize,
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    #[arg(long, default_value_t = 400)]
    pub steps: usize,
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    /// Target-generated tokens to train on.
    #[arg(long, default_value_t = 60000)]
    pub gen_tokens: usize,
    #[arg(long, default_value_t = 50)]
    pub checkpoint_every: usize,
    #[arg(long)]
    pub threads: Option<usize>,
}

pub fn run(what: DistillCmd) -> Result<()> {
    match what {
        DistillCmd::Draft(a) => {
            let target = match a.target {
                Some(t) => t,
                None => specd::fetch::ensure_default_model()?,
            };
            let cfg = specd::distill::DistillConfig {
                layers: a.layers,
                hidden: a.hidden,
                heads: a.heads,
                intermediate: a.intermediate,
                seq_len: a.seq_len,
                batch: a.batch,
                steps: a.steps,
                lr: a.lr,
                gen_tokens: a.gen_tokens,
                checkpoint_every: a.checkpoint_every,
                ..Default::default()
            };
            let threads = a.threads.unwrap_or_else(model::llama::default_threads);
            let out = specd::distill::distill(&target, &a.out, &cfg, threads)?;
            println!("{}", out.display());
            Ok(())
        }
    }
}
