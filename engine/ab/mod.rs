//! `specd ab`: A/B runs of proposer strategies on the same prompts.
//!
//! Invariants:
//! - Every arm sees the same prompts, sampling parameters and repeats; the
//!   arm order rotates prompt by prompt, so machine drift spreads evenly.
//! - Requests run one at a time, so each latency is the arm's own.
//! - Each repeat starts from fresh proposer instances: state a proposer
//!   learns across requests (the suffix tree) never carries the identical
//!   output of an earlier repeat into a later one.
//! - Greedy arms, and in a sampled run the arms whose proposer declares
//!   one-hot q (`run::compared_arms`), are compared token for token with
//!   the plain arm; any mismatch is a losslessness failure reported with
//!   the prompt id.
//!
//! - A concurrency sweep (`sweep`) runs every (point, arm) on a fresh
//!   engine and compares the same arms' outputs, and plain's at every
//!   point, with plain decoding at the first point.
//!
//! Rooms: `datasets` (loaders), `run` (the run loop), `stats` (summaries
//! and the losslessness check), `report` (JSON, Markdown, HTML), `sweep`
//! (aggregate throughput at several concurrencies).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::sampler::SamplingParams;
use crate::speculative::SpecStats;

mod report;
mod run;
mod stats;
mod sweep;

pub use crate::datasets::{
    evaluation_texts, limit_per_category, load_humaneval, load_jsonl, load_spec_bench,
    load_structured, Prompt, HUMANEVAL_PATH, SPEC_BENCH_PATH, STRUCTURED_PATH,
};
pub use report::{html, markdown, write_outputs};
pub use run::run;
pub use stats::{summarize, token_mismatches};
pub use sweep::{sweep, sweep_markdown, write_sweep, SweepReport, SweepRow};

/// One request's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub prompt_id: String,
    pub category: String,
    pub arm: String,
    pub repeat: usize,
    pub prompt_tokens: usize,
    pub tokens: usize,
    #[serde(skip)]
    pub token_ids: Vec<u32>,
    pub wall_s: f64,
    pub ttft_s: f64,
    pub tpot_s: f64,
    pub verify_steps: u64,
    pub target_forwards: u64,
    pub drafted: u64,
    pub accepted: u64,
    pub drafted_by_pos: Vec<u64>,
    pub accepted_by_pos: Vec<u64>,
    /// Seconds spent drafting and verifying (all steps of the request).
    #[serde(default)]
    pub draft_s: f64,
    #[serde(default)]
    pub verify_s: f64,
    /// Decode steps by tokens fed to their verify forward: (tokens, steps,
    /// verify seconds, draft seconds).
    #[serde(default)]
    pub steps_by_tokens: Vec<(usize, u64, f64, f64)>,
    /// Composed proposers: (member, steps, drafted, accepted); the
    /// constraint's forced drafts are the member `grammar`.
    #[serde(default)]
    pub members: Vec<(String, u64, u64, u64)>,
    /// Ended by end of sequence, a stop string or the constraint.
    #[serde(default)]
    pub finish_stop: bool,
    /// Prompts with a schema: the output is complete (ended by the
    /// constraint) and parses as JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub complete: Option<bool>,
}

impl Record {
    /// The request's drafting counts.
    pub fn spec(&self) -> SpecStats {
        SpecStats {
            arm: self.arm.clone(),
            requests: 1,
            tokens: self.tokens as u64,
            verify_steps: self.verify_steps,
            drafted: self.drafted,
            accepted: self.accepted,
            drafted_by_pos: self.drafted_by_pos.clone(),
            accepted_by_pos: self.accepted_by_pos.clone(),
            ..Default::default()
        }
    }
}

/// Per-arm figures (over all prompts or one category).
#[derive(Debug, Clone, Serialize)]
pub struct ArmSummary {
    pub arm: String,
    pub requests: usize,
    pub tokens: usize,
    pub tok_per_s: f64,
    pub speedup: f64,
    pub speedup_ci95: (f64, f64),
    pub mean_accepted_length: f64,
    pub acceptance_rate: f64,
    pub acceptance_by_position: Vec<f64>,
    pub ttft_p50_ms: f64,
    pub ttft_p95_ms: f64,
    pub tpot_p50_ms: f64,
    pub tpot_p95_ms: f64,
    pub forwards_per_token: f64,
    /// Mean drafting time per decode step, in one-token target forwards
    /// (the plain arm's mean decode step on the same prompt).
    pub draft_cost_per_step: f64,
    /// Mean verify time by tokens fed, in one-token target forwards (the
    /// plain arm's mean decode step on the same prompt): (tokens, steps,
    /// cost).
    pub verify_cost_by_tokens: Vec<(usize, u64, f64)>,
    /// Composed proposers: share of drafting steps and acceptance per
    /// member: (member, steps, drafted, accepted).
    pub members: Vec<(String, u64, u64, u64)>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Mismatch {
    pub prompt_id: String,
    pub arm: String,
    pub repeat: usize,
    /// First differing output position.
    pub position: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct AbReport {
    pub dataset: String,
    pub prompts: usize,
    pub prompts_per_category: BTreeMap<String, usize>,
    pub repeats: usize,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub threads: usize,
    pub overall: Vec<ArmSummary>,
    pub by_category: BTreeMap<String, Vec<ArmSummary>>,
    pub mismatches: Vec<Mismatch>,
    /// The arms compared with plain decoding token for token, plain itself
    /// left out (a sweep's `compared` keeps it: plain at every point is
    /// compared with plain at the first): every arm when greedy; when
    /// sampled (one seed per prompt, the same for every arm), those whose
    /// drafts are one-hot, which give plain decoding's draws
    /// (`speculative::accept`'s coupling).
    pub compared: Vec<String>,
    pub records: Vec<Record>,
}
