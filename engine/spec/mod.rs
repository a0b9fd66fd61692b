//! The speculative core: requests, proposers, acceptance, KV accounting, the
//! scheduler, the synchronous step engine, and the actor shells around them.
//!
//! Split (after mistral.rs's speculative/{proposer,verifier,driver,policy}):
//! - `proposer`: the host-side `Proposer` trait and the `Drafter` that owns
//!   proposers, isolates their failures and batches their calls.
//! - `accept`: pure acceptance rules (greedy and rejection sampling).
//! - `kv_manager`: the block budget for every cache (plain struct).
//! - `scheduler`: sequence states, admission, batching, preemption, stops.
//! - `engine`: one synchronous step (draft -> verify -> accept -> commit)
//!   over the plain structs; tests drive it directly.
//! - `actors`: actix shells that move the same structs onto their own
//!   threads and exchange one message per stage per step.

pub mod accept;
pub mod actors;
pub mod engine;
pub mod kv_manager;
pub mod proposer;
pub mod scheduler;

use serde::{Deserialize, Serialize};

use crate::sampler::{FinishReason, SamplingParams};

/// Engine-wide sequence id.
pub type SeqId = u64;

/// One generation request as the engine sees it (already tokenized).
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Proposer name; `None` uses the engine default, `Some("none")` plain.
    pub proposer: Option<String>,
    /// Cap on drafted tokens per step (the proposer's own cap still applies).
    pub max_draft: Option<usize>,
}

impl Request {
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            params: SamplingParams::greedy(),
            max_tokens,
            stop: Vec::new(),
            ignore_eos: false,
            proposer: None,
            max_draft: None,
        }
    }
}

/// Speculation statistics of one request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecStats {
    pub proposer: String,
    /// Target forwards that verified drafts (decode steps).
    pub verify_steps: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// accepted_by_pos[i]: drafts accepted at draft position i.
    pub accepted_by_pos: Vec<u64>,
    /// drafted_by_pos[i]: drafts proposed at draft position i.
    pub drafted_by_pos: Vec<u64>,
}

impl SpecStats {
    /// Tokens emitted per verify step, bonus/correction included (Spec-Bench
    /// convention: plain decoding is 1.00).
    pub fn mean_accepted_len(&self) -> f64 {
        if self.verify_steps == 0 {
            return 0.0;
        }
        (self.accepted + self.verify_steps) as f64 / self.verify_steps as f64
    }

    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// What a request produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub id: SeqId,
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub stats: SpecStats,
    /// Times the request was preempted (KV evicted, then recomputed).
    pub preemptions: u32,
}

/// Streamed to a request's client.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Newly committed tokens and the text they completed (may be empty
    /// while a stop string or a UTF-8 character is pending).
    Tokens {
        ids: Vec<u32>,
        text: String,
    },
    Finished(Completion),
    /// The request failed; nothing more follows.
    Error(String),
}
