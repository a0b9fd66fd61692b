//! `specd ab`: A/B runs of proposers on Spec-Bench, HumanEval or a JSONL.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;

use specd::config::Config;

#[derive(Args)]
pub struct AbArgs {
    /// TOML config with an [ab] section (see configs/ab/).
    #[arg(long)]
    pub config: PathBuf,
    /// Override [ab] dataset: spec_bench, humaneval, structured or jsonl.
    #[arg(long)]
    pub dataset: Option<String>,
    /// Dataset file (Spec-Bench question.jsonl, HumanEval .jsonl(.gz), or a JSONL of prompts).
    #[arg(long)]
    pub path: Option<PathBuf>,
    #[arg(long)]
    pub limit_per_category: Option<usize>,
    #[arg(long)]
    pub max_tokens: Option<usize>,
    #[arg(long)]
    pub repeats: Option<usize>,
    /// Override [ab.sampling] temperature (0: greedy).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Output directory for results.json, summary.md, report.html.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// A concurrency sweep instead of one request at a time: aggregate
    /// tok/s of every arm at each of these (e.g. 1,4,16,64), each on a
    /// fresh engine (overrides [ab] concurrency).
    #[arg(long, value_delimiter = ',')]
    pub concurrency: Option<Vec<usize>>,
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long)]
    pub threads: Option<usize>,
}

pub fn run(a: AbArgs) -> Result<()> {
    use specd::ab;
    let mut cfg = Config::load(&a.config)?;
    let mut s = cfg
        .ab
        .clone()
        .with_context(|| format!("{}: no [ab] section", a.config.display()))?;
    if let Some(d) = a.dataset {
        s.dataset = d;
    }
    if let Some(p) = a.path {
        s.path = Some(p);
    } else if let Some(p) = &s.path {
        s.path = Some(cfg.resolve(p));
    }
    if let Some(n) = a.limit_per_category {
        s.limit_per_category = n;
    }
    if let Some(n) = a.max_tokens {
        s.max_tokens = n;
    }
    if let Some(n) = a.repeats {
        s.repeats = n.max(1);
    }
    if let Some(t) = a.temperature {
        s.sampling.temperature = t;
    }
    if let Some(o) = a.out {
        s.out_dir = o;
    }
    if let Some(c) = a.concurrency {
        s.concurrency = c;
    }
    let prompts = match s.dataset.as_str() {
        "spec_bench" => ab::load_spec_bench(s.path.as_deref())?,
        "humaneval" => ab::load_humaneval(s.path.as_deref())?,
        "structured" => ab::load_structured()?,
        "jsonl" => ab::load_jsonl(s.path.as_deref().context("dataset `jsonl` needs a path")?)?,
        other => {
            anyhow::bail!("unknown dataset `{other}` (spec_bench, humaneval, structured, jsonl)")
        }
    };
    let prompts = ab::limit_per_category(prompts, s.limit_per_category);
    anyhow::ensure!(!prompts.is_empty(), "the dataset has no prompts");
    let chat = s.chat.unwrap_or(s.dataset != "humaneval");
    if let Some(m) = a.model {
        // A path given on the command line is relative to the working
        // directory, not to the config file.
        cfg.model.path = Some(specd::fetch::cli_model_path(&m)?);
    }
    if let Some(t) = a.threads {
        cfg.model.threads = Some(t);
    }
    let (model_path, model) = cfg.load_target()?;
    let model = Arc::new(model);
    let tok = Arc::new(cfg.tokenizer(&model_path)?);
    eprintln!(
        "specd ab: {} prompts from {}, {} arm(s) + plain, {} repeat(s), max_tokens {}",
        prompts.len(),
        s.dataset,
        s.arm.iter().filter(|x| x.proposer != "none").count(),
        s.repeats,
        s.max_tokens
    );
    if !s.concurrency.is_empty() {
        let report = ab::sweep(&cfg, &s, model, tok, &prompts, chat, &s.concurrency)?;
        let files = ab::write_sweep(&report, &s.out_dir)?;
        return finish(ab::sweep_markdown(&report), files, report.mismatches.len());
    }
    let report = ab::run(&cfg, &s, model, tok, &prompts, chat)?;
    let files = ab::write_outputs(&report, &s.out_dir)?;
    finish(ab::markdown(&report), files, report.mismatches.len())
}

/// Print the summary and the files written; fail on any mismatch with
/// plain decoding (`ab::run::compared_arms`).
fn finish(summary: String, files: Vec<PathBuf>, mismatches: usize) -> Result<()> {
    print!("{summary}");
    for f in files {
        eprintln!("wrote {}", f.display());
    }
    if mismatches > 0 {
        anyhow::bail!(
            "{mismatches} losslessness failure(s): output differs from plain decoding's (greedy, sampled with one-hot drafts, or batched)"
        );
    }
    Ok(())
}
