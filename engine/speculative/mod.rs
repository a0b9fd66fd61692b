//! The speculative core: requests, proposers, acceptance, KV accounting, the
//! scheduler, the synchronous step engine, and the actor shells around them.
//!
//! Split (after mistral.rs's speculative/{proposer,verifier,driver,policy}):
//! - `proposer`: the host-side `Proposer` trait and the `Drafter` that owns
//!   proposers, isolates their failures and batches their calls.
//! - `accept`: pure acceptance rules (greedy and rejection sampling).
//! - `kv_manager`: the block budget for every cache (plain struct).
//! - `scheduler`: sequence states, admission, batching, preemption, stops.
//! - `fairness`: which request is admitted, preempted and prefilled next
//!   (fair across requests, by priority).
//! - `engine`: one synchronous step (draft -> verify -> accept -> commit)
//!   over the plain structs; tests drive it directly.
//! - `actors`: actix shells that move the same structs onto their own
//!   threads and exchange one message per stage per step.

pub mod accept;
pub mod actors;
mod admission;
pub mod compose;
pub mod drafter;
pub mod driver;
pub mod fairness;
pub mod forced;
pub mod hidden;
pub mod kv_manager;
pub mod pipeline;
mod plan;
pub mod policy;
pub mod prefix_cache;
pub mod proposer;
pub mod scheduler;
pub mod sequence;
pub mod verify;

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
    /// Tokens that end the sequence as end of sequence does (not emitted;
    /// `ignore_eos` does not keep them): vLLM's `stop_token_ids`.
    pub stop_token_ids: Vec<u32>,
    /// Hold back the tokens that would end the output (end of sequence
    /// unless `ignore_eos`, and `stop_token_ids`) until this many tokens
    /// are generated (vLLM's `min_tokens`): they get probability 0, in
    /// the target law speculative acceptance tests drafts against too.
    /// Stop strings, as in vLLM, end the output only when a token after
    /// the `min_tokens`-th completes one. 0: off.
    pub min_tokens: usize,
    /// Proposer name; `None` uses the engine default, `Some("none")` plain.
    pub proposer: Option<String>,
    /// Cap on drafted tokens per step (the proposer's own cap still applies).
    pub max_draft: Option<usize>,
    /// A/B arm this request belongs to (metrics label; default: the proposer).
    pub arm: Option<String>,
    /// Report each generated token's log-probability under the target
    /// model (its raw softmax, before the request's sampling transforms)
    /// with this many most likely alternatives (at most `MAX_TOP_LOGPROBS`).
    pub logprobs: Option<usize>,
    /// Another choice of the same prompt (`n > 1`): once that request has
    /// prefilled, this one starts from a copy-on-write copy of its prompt
    /// KV instead of computing it again (when its proposer reads no hidden
    /// states; otherwise, or if that request is gone, it prefills).
    pub fork_of: Option<SeqId>,
    /// Also report the prompt tokens' log-probabilities (from the second
    /// token on) with this many alternatives (`echo` with `logprobs`).
    pub prompt_logprobs: Option<usize>,
    /// Scheduling priority: lower runs first (vLLM's convention); 0 is
    /// the default. A better priority is admitted, given prefill budget
    /// and kept in its slot before any worse one.
    pub priority: i32,
    /// The API request this sequence belongs to (its prompts and choices
    /// share one): the unit fair scheduling shares slots and prefill
    /// budget between. `None`: a group of its own.
    pub group: Option<SeqId>,
    /// Structured output: every token comes from the constrained law (see
    /// `structured`), drafted tokens included.
    pub constraint: Option<crate::structured::Constraint>,
    /// Draft the tokens the constraint forces (q = 1) before the
    /// proposer's own draft; on by default for constrained requests.
    pub forced_drafts: bool,
}

/// Most alternatives a request may ask for per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

impl Request {
    /// Check the request against a context limit before any work is done
    /// (the scheduler and plain `generate` both call this).
    pub fn validate(&self, max_seq_len: usize) -> crate::error::Result<()> {
        use crate::error::SpecdError;
        self.params.validate()?;
        if self.prompt.is_empty() {
            return Err(SpecdError::InvalidField {
                field: "prompt",
                msg: "prompt is empty".into(),
            });
        }
        if self.max_tokens == 0 {
            return Err(SpecdError::InvalidField {
                field: "max_tokens",
                msg: "max_tokens must be at least 1".into(),
            });
        }
        if self
            .logprobs
            .or(self.prompt_logprobs)
            .is_some_and(|k| k > MAX_TOP_LOGPROBS)
        {
            return Err(SpecdError::invalid_field(
                "top_logprobs",
                format!("at most {MAX_TOP_LOGPROBS} alternatives per token"),
            ));
        }
        if self.min_tokens > self.max_tokens {
            return Err(SpecdError::invalid_field(
                "min_tokens",
                format!(
                    "min_tokens ({}) is more than max_tokens ({})",
                    self.min_tokens, self.max_tokens
                ),
            ));
        }
        if self.min_tokens > 0 && self.constraint.is_some() {
            // A grammar that has ended allows only end of sequence, which
            // min_tokens would forbid: no token would be left.
            return Err(SpecdError::invalid_field(
                "min_tokens",
                "min_tokens cannot be combined with structured output (response_format, tools or a grammar)",
            ));
        }
        let needed = self.prompt.len().saturating_add(self.max_tokens);
        if needed > max_seq_len {
            return Err(SpecdError::ContextOverflow {
                needed,
                limit: max_seq_len,
            });
        }
        Ok(())
    }

    /// Whether token `t` ends the output (not emitted): end of sequence
    /// (`eos`: the model's ids) unless `ignore_eos`, or a stop token id.
    pub fn ends_at(&self, eos: &[u32], t: u32) -> bool {
        (!self.ignore_eos && eos.contains(&t)) || self.stop_token_ids.contains(&t)
    }

    /// The tokens `min_tokens` holds back at the next generated positions
    /// once `generated` tokens exist (`eos`: the model's end-of-sequence
    /// ids), or `None` when nothing is held back any more.
    pub fn end_ban(&self, eos: &[u32], generated: usize) -> Option<accept::EndBan> {
        let rows = self.min_tokens.checked_sub(generated).filter(|&r| r > 0)?;
        let mut ids: Vec<u32> = self.stop_token_ids.clone();
        if !self.ignore_eos {
            ids.extend_from_slice(eos);
        }
        ids.sort_unstable();
        ids.dedup();
        (!ids.is_empty()).then_some(accept::EndBan { rows, ids })
    }

    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            params: SamplingParams::greedy(),
            max_tokens,
            stop: Vec::new(),
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            min_tokens: 0,
            proposer: None,
            max_draft: None,
            arm: None,
            logprobs: None,
            fork_of: None,
            prompt_logprobs: None,
            priority: 0,
            group: None,
            constraint: None,
            forced_drafts: true,
        }
    }
}

/// Drafting outcomes: one request's (in its `Completion`), or totals over
/// many (a live A/B arm, a shadow proposer).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecStats {
    pub proposer: String,
    /// A/B arm (the proposer's name unless a traffic split chose an arm).
    pub arm: String,
    /// Requests counted (finished ones, for totals).
    pub requests: u64,
    /// Tokens committed.
    pub tokens: u64,
    /// Target forwards that verified drafts (decode steps), or shadow
    /// proposals scored.
    pub verify_steps: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// accepted_by_pos[i]: drafts accepted at draft position i.
    pub accepted_by_pos: Vec<u64>,
    /// drafted_by_pos[i]: drafts proposed at draft position i.
    pub drafted_by_pos: Vec<u64>,
    /// Composed proposers: (steps, drafted, accepted) by drafting member.
    #[serde(default)]
    pub members: std::collections::BTreeMap<String, [u64; 3]>,
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

impl SpecStats {
    /// One verify step (or shadow proposal) that drafted `drafted` tokens,
    /// of which the first `accepted` were (or would have been) accepted.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.record_tree(drafted, drafted, accepted);
    }

    /// One verify step of a tree of `nodes` nodes, `depth` deep, whose
    /// accepted path is `accepted` long (chains: `nodes == depth`).
    /// Positions are depths: position i counts the steps that drafted a
    /// node at depth i + 1, and those that accepted one.
    pub fn record_tree(&mut self, nodes: usize, depth: usize, accepted: usize) {
        self.verify_steps += 1;
        self.drafted += nodes as u64;
        self.accepted += accepted as u64;
        if self.drafted_by_pos.len() < depth {
            self.drafted_by_pos.resize(depth, 0);
            self.accepted_by_pos.resize(depth, 0);
        }
        for i in 0..depth {
            self.drafted_by_pos[i] += 1;
            if i < accepted {
                self.accepted_by_pos[i] += 1;
            }
        }
    }

    /// A step drafted by member `member` of a composed proposer.
    pub fn record_member(&mut self, member: &str, drafted: usize, accepted: usize) {
        let e = self.members.entry(member.to_string()).or_default();
        e[0] += 1;
        e[1] += drafted as u64;
        e[2] += accepted as u64;
    }

    /// Add another set of counts (same proposer or not) to these.
    pub fn add(&mut self, o: &SpecStats) {
        for (k, v) in &o.members {
            let e = self.members.entry(k.clone()).or_default();
            for (a, b) in e.iter_mut().zip(v) {
                *a += b;
            }
        }
        self.requests += o.requests;
        self.tokens += o.tokens;
        self.verify_steps += o.verify_steps;
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        for (mine, theirs) in [
            (&mut self.drafted_by_pos, &o.drafted_by_pos),
            (&mut self.accepted_by_pos, &o.accepted_by_pos),
        ] {
            if mine.len() < theirs.len() {
                mine.resize(theirs.len(), 0);
            }
            for (m, t) in mine.iter_mut().zip(theirs) {
                *m += t;
            }
        }
    }

    /// Tokens emitted per verify step, bonus/correction included (Spec-Bench
    /// convention: plain decoding is 1.00). The one definition of the
    /// figure: reports, metrics and the API all call this.
    pub fn mean_accepted_len(&self) -> f64 {
        ratio(self.accepted + self.verify_steps, self.verify_steps)
    }

    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.accepted, self.drafted)
    }

    /// Acceptance rate at each draft position.
    pub fn acceptance_by_position(&self) -> Vec<f64> {
        self.drafted_by_pos
            .iter()
            .zip(&self.accepted_by_pos)
            .map(|(&d, &a)| ratio(a, d))
            .collect()
    }

    /// Derived figures for reports and the stats endpoint.
    pub fn summary(&self) -> serde_json::Value {
        serde_json::json!({
            "requests": self.requests,
            "tokens": self.tokens,
            "steps": self.verify_steps,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.acceptance_rate(),
            "mean_accepted_length": self.mean_accepted_len(),
            "acceptance_by_position": self.acceptance_by_position(),
        })
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
    /// One per generated token when the request asked for logprobs.
    pub logprobs: Vec<TokenLogprob>,
    /// One per prompt token after the first, when the request asked.
    pub prompt_logprobs: Vec<TokenLogprob>,
}

/// A generated token's log-probability under the target model's raw
/// softmax (before temperature, penalties, bias and truncation), with the
/// most likely alternatives (descending, ties by id).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// Log-softmax of `row` at `token`, with the `top` best alternatives.
    pub fn of(row: &[f32], token: u32, top: usize) -> Self {
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let sum: f64 = row.iter().map(|&l| f64::from(l - max).exp()).sum();
        let lse = f64::from(max) + sum.ln();
        let lp = |t: u32| (f64::from(row[t as usize]) - lse) as f32;
        let k = top.min(row.len());
        let mut best: Vec<u32> = if k == 0 {
            Vec::new()
        } else {
            (0..row.len() as u32).collect()
        };
        let by = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
        if k > 0 && k < best.len() {
            best.select_nth_unstable_by(k - 1, by);
        }
        best.truncate(k);
        best.sort_unstable_by(by);
        Self {
            token,
            logprob: if (token as usize) < row.len() {
                lp(token)
            } else {
                f32::NEG_INFINITY
            },
            top: best.into_iter().map(|t| (t, lp(t))).collect(),
        }
    }
}

/// Streamed to a request's client.
// `Finished` is the large variant and is sent once per request; boxing it
// would cost an allocation for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Newly committed tokens and the text they completed (may be empty
    /// while a stop string or a UTF-8 character is pending).
    Tokens {
        ids: Vec<u32>,
        text: String,
        /// One per id when the request asked for logprobs, else empty.
        logprobs: Vec<TokenLogprob>,
    },
    Finished(Completion),
    /// The request failed in the engine; nothing more follows.
    Error(String),
    /// The request failed through its own fields (a constraint no token
    /// can continue); nothing more follows.
    Rejected(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_tokens_holds_back_end_of_sequence_and_stop_ids_until_reached() {
        let r = Request {
            min_tokens: 5,
            stop_token_ids: vec![9, 2],
            ..Request::greedy(vec![1], 8)
        };
        let ban = r.end_ban(&[2, 0], 3).unwrap();
        assert_eq!(ban.rows, 2);
        assert_eq!(ban.ids, vec![0, 2, 9]);
        assert_eq!(r.end_ban(&[0], 5), None);
        assert_eq!(r.end_ban(&[0], 7), None);
        // ignore_eos keeps end of sequence out of the ban (it does not
        // end the output); nothing left to hold back: no ban.
        let ig = Request {
            ignore_eos: true,
            ..r.clone()
        };
        assert_eq!(ig.end_ban(&[0], 0).unwrap().ids, vec![2, 9]);
        let none = Request {
            stop_token_ids: Vec::new(),
            ..ig
        };
        assert_eq!(none.end_ban(&[0], 0), None);
        assert!(r.validate(100).is_ok());
        let over = Request {
            min_tokens: 9,
            ..r.clone()
        };
        assert!(over
            .validate(100)
            .unwrap_err()
            .to_string()
            .contains("min_tokens (9) is more than max_tokens (8)"));
    }
}
