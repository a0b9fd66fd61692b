//! One sequence: its request, committed tokens, cache length, stop and
//! detokenisation state, hidden rows for its proposer, and the commit of
//! one verify step's result.
//!
//! Invariants:
//! - Tokens are committed one at a time: EOS, a stop token id, a stop string or
//!   `max_tokens` ends the sequence and every later token of the accepted
//!   run is dropped, never emitted.
//! - After a decode commit the cache holds `[prefix, last, accepted
//!   drafts]`; a tree's accepted nodes are moved down to their depth by
//!   `pending_moves` before the next forward, and the hidden rows kept are
//!   exactly the accepted path's.

use tokio::sync::mpsc::UnboundedSender;

use super::fairness;
use super::hidden::HiddenRows;
use super::policy::SeqPolicy;
use super::scheduler::{record_step_metrics, DecodeResult, FORCED_MEMBER};
use super::{Event, Request, SeqId, SpecStats};
use crate::sampler::{FinishReason, SamplingParams, StopBuffer};
use crate::tokenizer::{StreamDecoder, Tokenizer};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    Prefill,
    Decoding,
    Finished,
    Aborted,
}

#[derive(Debug)]
pub struct Sequence {
    pub id: SeqId,
    pub req: Request,
    pub status: SeqStatus,
    /// Committed tokens: prompt then output.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens in the target cache.
    pub cached: usize,
    pub text: String,
    pub stats: SpecStats,
    pub preemptions: u32,
    /// Log-probabilities of the generated tokens (when requested).
    pub logprobs: Vec<super::TokenLogprob>,
    /// Log-probabilities of the prompt tokens (when requested), filled as
    /// the prefill goes; restarted when a preemption restarts it.
    pub prompt_logprobs: Vec<super::TokenLogprob>,
    /// What the drafting policy tracks for this sequence.
    pub policy: SeqPolicy,
    /// Proposer in use (`None`: plain decoding).
    pub proposer: Option<String>,
    pub(super) stop: StopBuffer,
    pub(super) detok: StreamDecoder,
    pub(super) sink: Option<UnboundedSender<Event>>,
    /// Hidden states of the proposer's declared layers (declaration
    /// order) for committed positions the proposer has not seen yet:
    /// positions `hidden_start..`, rows appended by every prefill chunk and
    /// verify, handed over at the next step that drafts.
    pub hidden: HiddenRows,
    pub hidden_start: usize,
    /// Slot moves that pack the last tree verify's accepted path right
    /// after the committed prefix; applied before the next forward.
    pub pending_moves: Vec<(usize, usize)>,
    /// The sequence whose prompt KV this one copies at its first step
    /// (a forked choice); cleared once that step commits.
    pub fork_from: Option<SeqId>,
    /// Tokens the request's constraint forces next: the next step drafts
    /// them with q = 1 (`Request::forced_drafts`).
    pub forced: Vec<u32>,
    pub(super) finish: Option<FinishReason>,
    /// The request's tracing span (each step's span follows from it).
    pub span: tracing::Span,
    /// The API request it belongs to (`Request::group`, else its own id).
    pub group: u64,
    /// When `add` queued it, for queue-wait and time-to-first-token.
    pub(super) arrived: std::time::Instant,
    /// Whether its queue wait and first token were recorded (once each,
    /// not again after a preemption).
    pub(super) admitted_once: bool,
    /// A step past the prompt ran without keeping the window at the
    /// prompt's end: the verifier may have released sliding-window
    /// entries a forked choice would need, so none forks from it now.
    pub(super) window_past_prompt: bool,
    pub(super) first_token_seen: bool,
}

impl Sequence {
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    pub(super) fn prefill_target(&self) -> usize {
        self.tokens.len().saturating_sub(1)
    }

    /// Append `rows` rows per layer of hidden states for the positions right
    /// after those already buffered (at `cached` when the buffer is empty).
    /// At most `max` rows (plus a quarter, see below) are kept: the oldest
    /// go first.
    pub(super) fn append_hidden(&mut self, hidden: HiddenRows, rows: usize, max: usize) {
        if hidden.is_empty() || rows == 0 {
            return;
        }
        // Rows held after this append, counted in the first layer.
        let width = hidden[0].1.len() / rows;
        if self.hidden.is_empty() {
            self.hidden_start = self.cached;
        }
        self.hidden.extend(hidden);
        let held = self.hidden.rows(width);
        // Trimmed back to `max` only past a quarter more, so a buffer at
        // the cap is not moved at every step.
        let max = max.max(1);
        if held > max + max / 4 {
            self.hidden.trim(&mut self.hidden_start, held, max);
        }
    }

    /// Forget everything its target cache held (admission or
    /// preemption), leaving it in `status`.
    pub(super) fn drop_cache(&mut self, status: SeqStatus) {
        self.status = status;
        self.cached = 0;
        self.fork_from = None;
        self.window_past_prompt = false;
        self.hidden = HiddenRows::default();
        self.hidden_start = 0;
        self.pending_moves.clear();
    }

    pub(super) fn send(&self, ev: Event) {
        if let Some(s) = &self.sink {
            let _ = s.send(ev);
        }
    }

    /// Commit one verify step's result: scores (stats, policy, metrics),
    /// then the accepted tokens one at a time (EOS, a stop token id, a stop string or
    /// `max_tokens` ends the sequence and drops every later token), their
    /// text and logprobs sent as one event, and the accepted path's cache
    /// moves and hidden rows. Returns the tokens committed.
    pub(super) fn commit_decode(
        &mut self,
        mut r: DecodeResult,
        eos: &[u32],
        tokenizer: Option<&Tokenizer>,
        max_hidden_rows: usize,
    ) -> Vec<u32> {
        self.fork_from = None;
        self.forced = std::mem::take(&mut r.accepted.forced);
        let st = &mut self.stats;
        st.record_tree(r.drafted, r.depth, r.accepted.accepted);
        // The constraint's forced chain is scored as its own member;
        // the proposer's policy learns from its own part alone.
        let forced_ok = r.accepted.accepted.min(r.forced);
        if r.forced > 0 {
            st.record_member(FORCED_MEMBER, r.forced, forced_ok);
            record_step_metrics(&st.proposer, &st.arm, FORCED_MEMBER, r.forced, forced_ok);
        }
        let (drafted, depth, accepted) = if forced_ok == r.forced {
            (
                r.drafted - r.forced,
                r.depth.saturating_sub(r.forced),
                r.accepted.accepted - r.forced,
            )
        } else {
            (0, 0, 0)
        };
        if let Some(src) = r.source.as_ref().filter(|_| r.forced == 0 || drafted > 0) {
            st.record_member(src, drafted, accepted);
        }
        self.policy.record(drafted, depth, accepted, r.forced > 0);
        let member = r.source.as_deref().unwrap_or(&st.proposer);
        if r.forced == 0 || drafted > 0 {
            record_step_metrics(&st.proposer, &st.arm, member, depth, accepted);
        }
        let mut new_ids = Vec::new();
        let mut new_text = String::new();
        let mut new_lps = Vec::new();
        for (i, &t) in r.accepted.tokens.iter().enumerate() {
            if self.req.ends_at(eos, t) {
                self.finish = Some(FinishReason::Stop);
                break;
            }
            self.tokens.push(t);
            new_ids.push(t);
            if let Some(lp) = r.accepted.logprobs.get(i) {
                new_lps.push(lp.clone());
            }
            if let Some(tok) = tokenizer {
                let piece = self.detok.push(tok, t).unwrap_or_default();
                // vLLM's: stop strings count from the token after the
                // `min_tokens`-th (where end of sequence may come first).
                let check = self.generated().len() > self.req.min_tokens;
                let emit = self.stop.push_checked(&piece, check);
                new_text.push_str(&emit);
                if self.stop.stopped() {
                    self.finish = Some(FinishReason::Stop);
                    break;
                }
            }
            // The token that completes a constraint is the accepted run's
            // last; it ends with `stop` even at `max_tokens`, as in plain
            // decoding.
            if r.accepted.done && i + 1 == r.accepted.tokens.len() {
                self.finish = Some(FinishReason::Stop);
                break;
            }
            if self.generated().len() >= self.req.max_tokens {
                self.finish = Some(FinishReason::Length);
                break;
            }
        }
        // A constraint that has ended (end of sequence consumed, kept
        // by `ignore_eos`) ends the sequence.
        if r.accepted.done && self.finish.is_none() {
            self.finish = Some(FinishReason::Stop);
        }
        if self.finish.is_some() {
            if let Some(tok) = tokenizer {
                if !self.stop.stopped() {
                    let rest = self.detok.flush(tok).unwrap_or_default();
                    new_text.push_str(&self.stop.push(&rest));
                    if !self.stop.stopped() {
                        new_text.push_str(&self.stop.finish());
                    }
                }
            }
        }
        self.text.push_str(&new_text);
        metrics::counter!("specd_generated_tokens_total", "proposer" => self.stats.proposer.clone(), "arm" => self.stats.arm.clone())
            .increment(new_ids.len() as u64);
        self.stats.tokens += new_ids.len() as u64;
        if !new_ids.is_empty() && !self.first_token_seen {
            self.first_token_seen = true;
            metrics::histogram!("specd_time_to_first_token_seconds", "priority" => fairness::priority_label(self.req.priority))
                .record(self.arrived.elapsed().as_secs_f64());
        }
        if !new_ids.is_empty() || !new_text.is_empty() {
            self.logprobs.extend_from_slice(&new_lps);
            self.send(Event::Tokens {
                ids: new_ids.clone(),
                text: new_text,
                logprobs: new_lps,
            });
        }
        // Cache keeps [prefix, last, accepted drafts]; the newest
        // token is fed next. A tree's accepted nodes move down to
        // their depth.
        let base = self.cached + r.prefix;
        self.pending_moves = r
            .path
            .iter()
            .enumerate()
            .map(|(i, &a)| (base + 1 + a, base + 1 + i))
            .filter(|(from, to)| from != to)
            .collect();
        let rows: Vec<usize> = (0..=r.prefix)
            .chain(r.path.iter().map(|&a| r.prefix + a + 1))
            .collect();
        let fed = r.prefix + r.drafted + 1;
        let picked = r.hidden.pick(&rows, fed);
        self.append_hidden(picked, rows.len(), max_hidden_rows);
        self.cached += rows.len();
        new_ids
    }
}

/// Borrowed view of a sequence for the draft and accept stages.
#[derive(Debug, Clone, Copy)]
pub struct SeqContext<'a> {
    pub tokens: &'a [u32],
    pub params: &'a SamplingParams,
    pub logprobs: Option<usize>,
    pub constraint: Option<&'a crate::structured::Constraint>,
    pub forced_drafts: bool,
    /// Tokens the constraint forces next.
    pub forced: &'a [u32],
}
