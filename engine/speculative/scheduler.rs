//! Sequence states, admission, continuous batching under a token budget,
//! preemption by recompute, and token-by-token stop handling.
//!
//! Invariants:
//! - A running sequence's target cache holds every committed token but the
//!   last (`cached == tokens.len() - 1` while decoding); a decode step feeds
//!   `[last, drafts..]` and commits `cached + 1 + accepted`.
//! - Prefill covers `tokens[..len - 1]` in chunks; the first generated token
//!   comes from the first verify step, so fresh and preempted-then-resumed
//!   sequences take the same path (and batch invariance makes their greedy
//!   output identical). When a step's budget holds a sequence's whole
//!   remaining prefill plus its last token, that first verify step is the
//!   prefill's last chunk: a `Decode` with a `prefix` (the rest of the
//!   prompt) before the root and its drafts, logits from the root on (one
//!   step sooner to the first token; the same rows, by batch invariance).
//!   Fresh prompts only, and not for proposers fed hidden states: a
//!   recompute after a preemption prefills without its last token and
//!   then decodes as it would have, so its seeded stream continues. No first token
//!   is drafted for, however its prompt got into the cache (this way,
//!   forked, or prefilled without its last token), so a seeded sampled
//!   request draws the same tokens however it was scheduled; a recompute
//!   after a preemption prefills without its last token, then decodes as
//!   it would have.
//! - A step prefills at most `max_prefill_tokens` prompt tokens (chunked
//!   prefill), so a long prompt's chunks do not stretch every running
//!   sequence's time per output token, nor a new request's wait.
//! - Tokens are committed one at a time: EOS, a stop string or max_tokens
//!   ends the sequence and every later token of the accepted run is dropped,
//!   never emitted.
//! - Every step's batch costs at most `max_batch_tokens` tokens, and decode
//!   steps of running sequences come before new prefill work.
//! - With `Scheduling::Fair` (the default), `running` is ordered by
//!   priority (then admission), and admission, slot preemption and the
//!   prefill budget follow `fairness`; with `Fcfs`, by sequence id.
//! - A preempted sequence (for KV, a better priority or a starved
//!   request) goes back to waiting with its cache released and is
//!   recomputed from its committed tokens: greedy output is unchanged and
//!   its sampler state (kept) continues the same random stream.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use super::accept::Accepted;
use super::fairness::{self, Scheduling, Slot};
use super::kv_manager::{Grant, Want};
use super::policy::{choose_draft_len, VerifyCostModel};
use super::proposer::Capabilities;
use super::{Completion, Event, Request, SeqId, SpecStats};
use crate::error::{Result, SpecdError};
use crate::sampler::{FinishReason, SamplingParams, StopBuffer};
use crate::tokenizer::{StreamDecoder, Tokenizer};

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Tokens one step may feed the target (prefill chunks plus verifies).
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    pub max_running: usize,
    /// Draft cap per step when neither request nor proposer says less.
    pub max_draft: usize,
    /// Proposer for requests that name none (`None`: plain decoding).
    pub default_proposer: Option<String>,
    /// Longest context the model takes.
    pub max_seq_len: usize,
    pub eos_token_ids: Vec<u32>,
    /// Waiting requests beyond which `add` refuses new ones.
    pub max_waiting: usize,
    /// Adapt each sequence's draft length to its recent acceptance (see
    /// `choose_draft_len`); off: always draft the cap.
    pub adaptive_draft: bool,
    /// Verify cost of one extra drafted token, relative to a one-token
    /// forward (`specd bench-model` measures it: (cost(k+1) - 1) / k): the
    /// price with `measured_pricing` off, and until the cost model has
    /// seen enough steps.
    pub draft_cost: f64,
    /// Price drafted tokens from verify times measured on this machine at
    /// the step's batch size (`VerifyCostModel`), not one constant, when
    /// two or more sequences decode. Draft lengths then depend on timing:
    /// a seeded sampled request in a batch may draw different (equally
    /// distributed) tokens run to run; off, they depend on acceptance only.
    pub measured_pricing: bool,
    /// Rows of hidden states a sequence buffers for its proposer between
    /// two drafting steps: the newest this many are always kept, and
    /// never more than a quarter more (see `MAX_HIDDEN_ROWS`, the
    /// default).
    pub max_hidden_rows: usize,
    /// Fair across requests by priority, or first come first served.
    pub scheduling: Scheduling,
    /// Most prompt tokens one step prefills (within `max_batch_tokens`):
    /// the step's time is every running sequence's time per output token
    /// and a new request's wait before its prefill starts.
    pub max_prefill_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batch_tokens: 512,
            max_running: 16,
            max_draft: 4,
            default_proposer: None,
            max_seq_len: 2048,
            eos_token_ids: Vec::new(),
            max_waiting: 1024,
            adaptive_draft: true,
            draft_cost: 0.10,
            measured_pricing: false,
            max_hidden_rows: MAX_HIDDEN_ROWS,
            scheduling: Scheduling::Fair,
            max_prefill_tokens: 64,
        }
    }
}

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
    /// Running estimate of this sequence's per-draft acceptance rate.
    pub acceptance_ema: f64,
    /// Decode steps since the last draft (for probing when drafting paused).
    pub steps_without_draft: u32,
    /// Consecutive probes (drafts after a pause) of which nothing was
    /// accepted: for a proposer with its own cost (`token_cost`), each
    /// doubles the wait before the next (up to 16x).
    pub probe_misses: u32,
    /// Proposer in use (`None`: plain decoding).
    pub proposer: Option<String>,
    stop: StopBuffer,
    detok: StreamDecoder,
    sink: Option<UnboundedSender<Event>>,
    /// Hidden states of the proposer's declared layers (declaration
    /// order) for committed positions the proposer has not seen yet:
    /// positions `hidden_start..`, rows appended by every prefill chunk and
    /// verify, handed over at the next step that drafts.
    pub hidden: Vec<(usize, Vec<f32>)>,
    pub hidden_start: usize,
    /// Slot moves that pack the last tree verify's accepted path right
    /// after the committed prefix; applied before the next forward.
    pub pending_moves: Vec<(usize, usize)>,
    /// Tree size policy (tree proposers only).
    pub tree_policy: Option<super::policy::TreePolicy>,
    /// The sequence whose prompt KV this one copies at its first step
    /// (a forked choice); cleared once that step commits.
    pub fork_from: Option<SeqId>,
    /// Tokens the request's constraint forces next: the next step drafts
    /// them with q = 1 (`Request::forced_drafts`).
    pub forced: Vec<u32>,
    finish: Option<FinishReason>,
    /// The request's tracing span (each step's span follows from it).
    pub span: tracing::Span,
    /// The API request it belongs to (`Request::group`, else its own id).
    pub group: u64,
    /// When `add` queued it, for queue-wait and time-to-first-token.
    arrived: std::time::Instant,
    /// Whether its queue wait and first token were recorded (once each,
    /// not again after a preemption).
    admitted_once: bool,
    first_token_seen: bool,
}

impl Sequence {
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    fn prefill_target(&self) -> usize {
        self.tokens.len().saturating_sub(1)
    }

    /// Append `rows` rows per layer of hidden states for the positions right
    /// after those already buffered (at `cached` when the buffer is empty).
    /// At most `max` rows (plus a quarter, see below) are kept: the oldest
    /// go first.
    fn append_hidden(&mut self, hidden: Vec<(usize, Vec<f32>)>, rows: usize, max: usize) {
        if hidden.is_empty() || rows == 0 {
            return;
        }
        // Rows held after this append, counted in the first layer.
        let width = hidden[0].1.len() / rows;
        if self.hidden.is_empty() {
            self.hidden_start = self.cached;
            self.hidden = hidden;
        } else {
            for ((have_l, have), (l, new)) in self.hidden.iter_mut().zip(hidden) {
                if *have_l == l {
                    have.extend_from_slice(&new);
                }
            }
        }
        let held = self.hidden[0].1.len().checked_div(width).unwrap_or(0);
        // Trimmed back to `max` only past a quarter more, so a buffer at
        // the cap is not moved at every step.
        let max = max.max(1);
        if held > max + max / 4 {
            trim_hidden(&mut self.hidden, &mut self.hidden_start, held, max);
        }
    }

    /// Forget everything its target cache held (admission or
    /// preemption), leaving it in `status`.
    fn drop_cache(&mut self, status: SeqStatus) {
        self.status = status;
        self.cached = 0;
        self.fork_from = None;
        self.hidden.clear();
        self.hidden_start = 0;
        self.pending_moves.clear();
    }

    fn send(&self, ev: Event) {
        if let Some(s) = &self.sink {
            let _ = s.send(ev);
        }
    }
}

/// Most rows of hidden states a sequence buffers for its proposer between
/// two drafting steps. A sequence whose proposer is paused (the policy
/// stopped drafting) or that has a long prompt would otherwise hold every
/// position's features (7 KB per position for an EAGLE-3 head on the
/// default model); the proposers' catch-ups read at most their `window`
/// (256 by default) of the newest anyway. A buffer past a quarter more
/// than the cap is cut back to the newest `max_hidden_rows`. Plugins see
/// where the rows start (`hidden_start`), which then skips the dropped
/// positions.
pub const MAX_HIDDEN_ROWS: usize = 4096;

/// A proposer that drafts from the tokens it is given alone.
fn is_lookup(c: &Capabilities) -> bool {
    c.hidden_layers.is_empty() && c.q_kind == super::proposer::QKind::OneHot
}

/// Most forced tokens one step drafts.
pub const MAX_FORCED_DRAFT: usize = 32;

/// The member label the constraint's forced drafts are scored under
/// (`SpecStats::members`, the `member` label of the draft metrics).
pub const FORCED_MEMBER: &str = "grammar";

/// Keep only the newest `max` of the `held` rows of every layer in
/// `hidden` (rows from position `*start`), moving `*start` past the
/// dropped ones.
pub fn trim_hidden(hidden: &mut [(usize, Vec<f32>)], start: &mut usize, held: usize, max: usize) {
    if held <= max {
        return;
    }
    let drop = held - max;
    for (_, v) in hidden.iter_mut() {
        let width = v.len() / held;
        v.drain(..(drop * width).min(v.len()));
    }
    *start += drop;
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

/// Whether a waiting forked choice can start from its parent's KV.
enum Fork {
    /// The parent is still prefilling: wait for it.
    Wait,
    /// Copy the parent's cache; this many positions are then cached.
    From(SeqId, usize),
    /// Prefill as any request does.
    No,
}

/// What one planned sequence does this step.
#[derive(Debug, Clone, PartialEq)]
pub enum Work {
    /// Feed these prompt tokens; no logits.
    Prefill(Vec<u32>),
    /// Feed the last committed token plus up to `max_draft` drafts.
    /// With a `prefix` (the rest of a prefill, fed before `last`): no
    /// drafts, and only `last`'s row computes logits.
    Decode {
        last: u32,
        max_draft: usize,
        prefix: Vec<u32>,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct PlanItem {
    pub seq: SeqId,
    /// Cache length before this step (the verifier truncates to it).
    pub cache_len: usize,
    pub work: Work,
    /// Hidden-state layers the sequence's proposer wants, in its order.
    pub hidden_layers: Vec<usize>,
    /// Slot moves to apply before truncating (tree compaction).
    pub moves: Vec<(usize, usize)>,
    /// How the proposer draws siblings (tree drafts).
    pub siblings: super::proposer::SiblingMode,
    /// Its proposer drafts from the tokens it is given alone (one-hot q,
    /// no hidden states): forced tokens can extend its context.
    pub lookup: bool,
    /// Start this sequence's cache as a copy-on-write copy of that
    /// sequence's (a forked choice's first step).
    pub fork_from: Option<SeqId>,
    /// Prefill: report the log-probabilities of these tokens (the ones
    /// each fed position predicts) with this many alternatives.
    pub prompt_logprobs: Option<(usize, Vec<u32>)>,
}

/// Bookkeeping the other stages need at the start of a step.
#[derive(Debug, Default)]
pub struct Lifecycle {
    /// (seq, proposer, committed tokens) to start in the drafter.
    pub starts: Vec<(SeqId, String, Vec<u32>)>,
    /// Sequences whose target cache and proposer state go away (finished,
    /// aborted or preempted).
    pub released: Vec<SeqId>,
    /// Sequences that are gone for good (their sampler state goes too).
    pub ended: Vec<SeqId>,
}

/// A decode result handed back to the scheduler.
#[derive(Debug)]
pub struct DecodeResult {
    pub seq: SeqId,
    /// Drafted tokens (tree nodes).
    pub drafted: usize,
    /// Deepest drafted node (chains: `drafted`).
    pub depth: usize,
    /// The member of a composed proposer that drafted.
    pub source: Option<String>,
    pub accepted: Accepted,
    /// The accepted drafts' node indices, root first.
    pub path: Vec<usize>,
    /// Prompt positions fed before the root (a prefill's last chunk).
    pub prefix: usize,
    /// Leading drafted tokens the constraint forced (a chain before the
    /// proposer's own draft).
    pub forced: usize,
    /// Hidden states of every fed row (`(layer, rows x hidden)`: the
    /// prefix's rows, the root's, then one per node).
    pub hidden: Vec<(usize, Vec<f32>)>,
}

/// Tokens a step committed for one sequence, for its proposer.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
    /// The accepted drafts' node indices, root first.
    pub path: Vec<usize>,
}

/// A prefill chunk's result handed back to the scheduler.
#[derive(Debug)]
pub struct PrefillResult {
    pub seq: SeqId,
    pub tokens: usize,
    /// Log-probabilities of the tokens these positions predict, if asked.
    pub logprobs: Vec<super::TokenLogprob>,
    /// Hidden states of every prefilled row.
    pub hidden: Vec<(usize, Vec<f32>)>,
}

/// What commit tells the other stages.
#[derive(Debug, Default)]
pub struct Committed {
    /// (seq, committed target cache length).
    pub lens: Vec<(SeqId, usize)>,
    pub finished: Vec<Completion>,
}

#[derive(Debug)]
pub struct Scheduler {
    pub config: SchedulerConfig,
    tokenizer: Option<Arc<Tokenizer>>,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    /// Running sequences in admission order (earliest first).
    running: Vec<SeqId>,
    next_id: SeqId,
    lifecycle: Lifecycle,
    /// Tokens committed by the last step, for the drafter's next call.
    pending_observe: Vec<Observed>,
    /// A step is between plan and commit: aborts wait in `deferred_aborts`.
    in_step: bool,
    deferred_aborts: Vec<SeqId>,
    /// Live totals per A/B arm.
    arms: std::collections::BTreeMap<String, super::SpecStats>,
    /// Verify time by tokens fed, learned from decode steps.
    cost: VerifyCostModel,
    /// Tokens drafted in the last decode-only step (the next one's
    /// estimate).
    last_extra: usize,
    /// Sum and count of the draft prices of planned steps.
    prices: (f64, u64),
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, tokenizer: Option<Arc<Tokenizer>>) -> Self {
        Self {
            tokenizer,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 1,
            lifecycle: Lifecycle::default(),
            pending_observe: Vec::new(),
            in_step: false,
            deferred_aborts: Vec::new(),
            arms: Default::default(),
            cost: VerifyCostModel::new(config.max_batch_tokens),
            last_extra: 0,
            prices: (0.0, 0),
            config,
        }
    }

    /// A verify forward fed `tokens` tokens for `decodes` decoding
    /// sequences in `seconds`; `decode_only`: no prefill chunk shared it
    /// (every fed position computed logits), so it calibrates the model.
    pub fn record_verify(
        &mut self,
        tokens: usize,
        decodes: usize,
        seconds: f64,
        decode_only: bool,
    ) {
        if decode_only {
            self.cost.record(tokens, seconds);
            self.last_extra = tokens.saturating_sub(decodes);
        }
    }

    /// Mean price of a drafted token over the steps planned so far.
    pub fn mean_draft_price(&self) -> Option<f64> {
        (self.prices.1 > 0).then(|| self.prices.0 / self.prices.1 as f64)
    }

    /// The verify cost of a drafted token in a step of `batch` decoding
    /// sequences, relative to a sequence's share of the step: measured
    /// (see `VerifyCostModel::draft_cost`) or the configured constant.
    ///
    /// A sequence decoding alone is priced at the constant: its draft
    /// lengths then depend only on its own acceptance, so a seeded sampled
    /// request gives the same tokens run after run (measured times vary).
    pub fn draft_price(&self, batch: usize) -> f64 {
        if !self.config.measured_pricing || batch < 2 {
            return self.config.draft_cost;
        }
        self.cost
            .draft_cost(batch, self.last_extra.max(1))
            .unwrap_or(self.config.draft_cost)
    }

    /// Validate and queue a request. `known` tells whether a proposer name
    /// exists.
    pub fn add(
        &mut self,
        mut req: Request,
        sink: Option<UnboundedSender<Event>>,
        known: impl Fn(&str) -> bool,
    ) -> Result<SeqId> {
        req.validate(self.config.max_seq_len)?;
        req.params = req.params.normalized();
        if !req.stop.is_empty() && self.tokenizer.is_none() {
            return Err(SpecdError::InvalidField {
                field: "stop",
                msg: "stop strings need a tokenizer".into(),
            });
        }
        if self.waiting.len() >= self.config.max_waiting {
            return Err(SpecdError::Overloaded(self.waiting.len()));
        }
        let proposer = match req.proposer.as_deref() {
            Some("none") => None,
            Some(name) => {
                if !known(name) {
                    return Err(SpecdError::InvalidField {
                        field: "proposer",
                        msg: format!("unknown proposer '{name}'"),
                    });
                }
                Some(name.to_string())
            }
            None => self.config.default_proposer.clone().filter(|n| known(n)),
        };
        let id = self.next_id;
        self.next_id += 1;
        let seq = Sequence {
            id,
            tokens: req.prompt.clone(),
            prompt_len: req.prompt.len(),
            status: SeqStatus::Waiting,
            cached: 0,
            text: String::new(),
            stats: SpecStats {
                proposer: proposer.clone().unwrap_or_else(|| "none".into()),
                arm: req
                    .arm
                    .clone()
                    .unwrap_or_else(|| proposer.clone().unwrap_or_else(|| "none".into())),
                ..Default::default()
            },
            preemptions: 0,
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            acceptance_ema: 0.5,
            steps_without_draft: 0,
            probe_misses: 0,
            proposer,
            stop: StopBuffer::new(req.stop.clone()),
            detok: StreamDecoder::new(),
            sink,
            hidden: Vec::new(),
            hidden_start: 0,
            pending_moves: Vec::new(),
            tree_policy: None,
            fork_from: None,
            forced: req
                .constraint
                .as_ref()
                .filter(|_| req.forced_drafts)
                .map(|c| c.initial_forced().to_vec())
                .unwrap_or_default(),
            finish: None,
            span: tracing::info_span!("request", id),
            group: req.group.unwrap_or(id),
            arrived: std::time::Instant::now(),
            admitted_once: false,
            first_token_seen: false,
            req,
        };
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        // Every accepted request ends exactly once in specd_requests_total.
        metrics::counter!("specd_requests_accepted_total").increment(1);
        metrics::gauge!("specd_queue_length").set(self.waiting.len() as f64);
        Ok(id)
    }

    /// Live totals per A/B arm.
    pub fn arm_stats(&self) -> &std::collections::BTreeMap<String, super::SpecStats> {
        &self.arms
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Running sequences and the proposer key each drafts with.
    pub fn running_proposers(&self) -> Vec<(SeqId, String)> {
        self.running
            .iter()
            .filter_map(|id| {
                let s = self.seqs.get(id)?;
                Some((*id, s.proposer.clone()?))
            })
            .collect()
    }

    /// A reload replaced `seq`'s proposer: the sequence keeps drafting with
    /// the old instance, now under `key`, until it ends or is preempted (a
    /// restart is admitted with the proposer it asked for).
    pub fn retire(&mut self, seq: SeqId, key: &str) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.proposer = Some(key.to_string());
        }
    }

    /// Nothing to run and nothing left for the other stages to hear about.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty()
            && self.running.is_empty()
            && self.lifecycle.released.is_empty()
            && self.lifecycle.ended.is_empty()
            && self.lifecycle.starts.is_empty()
            && self.pending_observe.is_empty()
            && self.deferred_aborts.is_empty()
    }

    /// A step starts: until `end_step`, aborts are deferred so that nothing
    /// the step planned disappears under it.
    /// Sequences whose receiver is gone (a client that hung up before the
    /// server guarded its request) are aborted first: nobody reads them.
    pub fn begin_step(&mut self) {
        let gone: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.sink.as_ref().is_some_and(|t| t.is_closed()))
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.abort(id);
        }
        self.in_step = true;
    }

    /// The step is committed (or abandoned): apply the aborts that arrived
    /// meanwhile.
    pub fn end_step(&mut self) {
        self.in_step = false;
        for id in std::mem::take(&mut self.deferred_aborts) {
            self.abort(id);
        }
    }

    /// Whether a step is between plan and commit.
    pub fn in_step(&self) -> bool {
        self.in_step
    }

    /// Fail every live request (the engine cannot go on).
    pub fn fail_all(&mut self, why: &str) {
        let mut ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            self.fail(id, why);
        }
        self.deferred_aborts.clear();
    }

    /// Tokens committed since the drafter last heard, taken for its next call.
    pub fn take_observed(&mut self) -> Vec<Observed> {
        std::mem::take(&mut self.pending_observe)
    }

    /// Hidden states not yet handed to `id`'s proposer (declaration order)
    /// and the position of their first row; the sequence's buffer empties.
    pub fn take_hidden(&mut self, id: SeqId) -> (Vec<(usize, Vec<f32>)>, usize) {
        match self.seqs.get_mut(&id) {
            Some(s) => (std::mem::take(&mut s.hidden), s.hidden_start),
            None => (Vec::new(), 0),
        }
    }

    /// Ids of every live (waiting or running) request.
    pub fn live(&self) -> Vec<SeqId> {
        self.seqs.keys().copied().collect()
    }

    /// Abort a request: it finishes with `Aborted` and its resources are
    /// released at the next step. Unknown or finished ids are ignored. While
    /// a step is in flight the abort waits for its commit (`end_step`).
    pub fn abort(&mut self, id: SeqId) -> bool {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return false;
        };
        if matches!(seq.status, SeqStatus::Finished | SeqStatus::Aborted) {
            return false;
        }
        if self.in_step {
            if !self.deferred_aborts.contains(&id) {
                self.deferred_aborts.push(id);
            }
            return true;
        }
        seq.status = SeqStatus::Aborted;
        seq.finish = Some(FinishReason::Aborted);
        self.waiting.retain(|&w| w != id);
        if self.running.contains(&id) {
            self.running.retain(|&r| r != id);
        }
        self.lifecycle.released.push(id);
        self.lifecycle.ended.push(id);
        let c = self.completion(id);
        if let Some(s) = self.seqs.get(&id) {
            s.send(Event::Finished(c));
        }
        self.seqs.remove(&id);
        metrics::counter!("specd_requests_total", "finish" => "aborted").increment(1);
        true
    }

    /// Fail a request (e.g. its forward errored): the client gets the error
    /// and its resources are released at the next step.
    pub fn fail(&mut self, id: SeqId, why: &str) {
        if let Some(s) = self.seqs.remove(&id) {
            s.send(Event::Error(why.to_string()));
            self.waiting.retain(|&w| w != id);
            self.running.retain(|&r| r != id);
            self.lifecycle.released.push(id);
            self.lifecycle.ended.push(id);
            metrics::counter!("specd_requests_total", "finish" => "error").increment(1);
        }
    }

    fn completion(&self, id: SeqId) -> Completion {
        let Some(s) = self.seqs.get(&id) else {
            return Completion {
                id,
                tokens: Vec::new(),
                text: String::new(),
                finish: FinishReason::Aborted,
                prompt_tokens: 0,
                stats: SpecStats::default(),
                preemptions: 0,
                logprobs: Vec::new(),
                prompt_logprobs: Vec::new(),
            };
        };
        Completion {
            id,
            tokens: s.generated().to_vec(),
            text: s.text.clone(),
            finish: s.finish.unwrap_or(FinishReason::Length),
            prompt_tokens: s.prompt_len,
            stats: SpecStats {
                requests: 1,
                ..s.stats.clone()
            },
            preemptions: s.preemptions,
            logprobs: s.logprobs.clone(),
            prompt_logprobs: s.prompt_logprobs.clone(),
        }
    }

    fn max_draft_for(&self, s: &Sequence, proposer_cap: Option<usize>) -> usize {
        if s.proposer.is_none() {
            return 0;
        }
        let mut k = self.config.max_draft;
        if let Some(m) = s.req.max_draft {
            k = k.min(m);
        }
        if let Some(c) = proposer_cap {
            k = k.min(c);
        }
        // No drafts past max_tokens or the context.
        let left = s.req.max_tokens.saturating_sub(s.generated().len());
        k = k.min(left.saturating_sub(1));
        k.min(self.config.max_seq_len.saturating_sub(s.cached + 1))
    }

    /// Admission first come, first served by sequence.
    fn admit_fcfs<'c>(&mut self, caps: &impl Fn(&str) -> Option<&'c Capabilities>) {
        let mut deferred = Vec::new();
        while self.running.len() < self.config.max_running {
            let Some(id) = self.waiting.pop_front() else {
                break;
            };
            match self.fork_source(id, caps) {
                Fork::Wait => deferred.push(id),
                fork => self.start(id, fork, caps),
            }
        }
        for id in deferred.into_iter().rev() {
            self.waiting.push_front(id);
        }
    }

    /// Fair admission (see `fairness`): the best waiting sequence takes a
    /// free slot, or one a worse priority or a request holding several
    /// gives up (preempted by recompute).
    fn admit_fair<'c>(&mut self, caps: &impl Fn(&str) -> Option<&'c Capabilities>) {
        let mut deferred: Vec<SeqId> = Vec::new();
        let mut admitted: Vec<SeqId> = Vec::new();
        loop {
            let cands: Vec<Slot> = self
                .waiting
                .iter()
                .filter(|id| !deferred.contains(id))
                .filter_map(|&id| self.slot(id, false))
                .collect();
            // Forks tie a parent to its choices: neither is preempted
            // while a copy is pending.
            let parents: Vec<SeqId> = self
                .running
                .iter()
                .filter_map(|id| self.seqs.get(id)?.fork_from)
                .collect();
            let running: Vec<Slot> = self
                .running
                .iter()
                .filter_map(|&id| {
                    let pinned = admitted.contains(&id) || parents.contains(&id);
                    self.slot(id, pinned)
                })
                .collect();
            let counts = fairness::group_counts(&running);
            let Some(i) = fairness::next_admission(&cands, &counts) else {
                break;
            };
            let cand = cands[i];
            let fork = self.fork_source(cand.id, caps);
            if matches!(fork, Fork::Wait) {
                deferred.push(cand.id);
                continue;
            }
            if self.running.len() >= self.config.max_running {
                let Some(v) = fairness::victim(&cand, &running, &counts) else {
                    break;
                };
                let worse = self
                    .seqs
                    .get(&v)
                    .is_some_and(|s| s.req.priority > cand.priority);
                self.requeue(v, if worse { "priority" } else { "fairness" });
            }
            self.waiting.retain(|&w| w != cand.id);
            self.start(cand.id, fork, caps);
            admitted.push(cand.id);
        }
    }

    /// What the fairness policy sees of sequence `id`.
    fn slot(&self, id: SeqId, pinned: bool) -> Option<Slot> {
        let s = self.seqs.get(&id)?;
        Some(Slot {
            id,
            group: s.group,
            priority: s.req.priority,
            cached: s.cached,
            pinned: pinned || s.fork_from.is_some(),
        })
    }

    /// Move waiting sequence `id` (already out of `waiting`) into a
    /// running slot: fair scheduling keeps `running` ordered by priority.
    fn start<'c>(
        &mut self,
        id: SeqId,
        fork: Fork,
        caps: &impl Fn(&str) -> Option<&'c Capabilities>,
    ) {
        let fork = match fork {
            Fork::From(p, cached) => Some((p, cached)),
            _ => None,
        };
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        s.drop_cache(SeqStatus::Prefill);
        s.prompt_logprobs.clear();
        if let Some((p, cached)) = fork {
            s.cached = cached;
            s.fork_from = Some(p);
            s.status = SeqStatus::Decoding;
        }
        if !s.admitted_once {
            s.admitted_once = true;
            metrics::histogram!("specd_queue_wait_seconds", "priority" => fairness::priority_label(s.req.priority))
                .record(s.arrived.elapsed().as_secs_f64());
        }
        // Every sequence starts in the drafter (plain ones too: shadow
        // proposers score all traffic), with the proposer it asked for
        // (not a retired instance it drafted with before a preemption).
        if s.proposer.is_some() {
            s.proposer = Some(s.stats.proposer.clone());
        }
        let name = s.proposer.clone().unwrap_or_else(|| "none".into());
        s.tree_policy = caps(&name)
            .filter(|c| c.tree)
            .map(|c| super::policy::TreePolicy::new(c.max_draft));
        self.lifecycle.starts.push((id, name, s.tokens.clone()));
        let at = match self.config.scheduling {
            Scheduling::Fcfs => self.running.len(),
            Scheduling::Fair => {
                let p = s.req.priority;
                let seqs = &self.seqs;
                self.running
                    .iter()
                    .position(|r| seqs.get(r).is_some_and(|o| o.req.priority > p))
                    .unwrap_or(self.running.len())
            }
        };
        self.running.insert(at, id);
    }

    /// Preempt running sequence `id`: its cache and proposer state are
    /// released, and it waits at the front of the queue to be recomputed
    /// from its committed tokens (its sampler state stays).
    fn requeue(&mut self, id: SeqId, reason: &'static str) {
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        s.drop_cache(SeqStatus::Waiting);
        s.preemptions += 1;
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
        self.lifecycle.released.push(id);
        metrics::counter!("specd_preemptions_total", "reason" => reason).increment(1);
    }

    /// Tokens `s` drafts this step, at most `room`: the cap (request,
    /// proposer, max_tokens, context), then what recent acceptance pays
    /// for at `price` a drafted token, with a probe now and then.
    fn draft_len(
        &self,
        s: &Sequence,
        pcaps: Option<&Capabilities>,
        price: f64,
        room: usize,
    ) -> usize {
        let mut k = self
            .max_draft_for(s, pcaps.map(|c| c.max_draft))
            .min(room)
            .min(self.config.max_seq_len.saturating_sub(s.tokens.len()));
        if self.config.adaptive_draft && k > 0 {
            // A drafted token costs its share of the verify plus what
            // the proposer spends drafting it.
            let own = pcaps.map_or(0.0, |c| c.token_cost);
            let cost = price + own;
            k = match (&s.tree_policy, pcaps) {
                // Trees: the node budget whose measured accepted length
                // pays best for its verify cost.
                (Some(tp), Some(c)) if c.tree => tp.choose(k, cost),
                _ => choose_draft_len(s.acceptance_ema, k, cost),
            };
            // Keep learning while paused: probe with one draft now and
            // then, less often as drafts get dearer (under load, or a
            // costly proposer). A proposer with its own cost also
            // backs off after each probe that missed (a lookup's probe
            // costs only its verify, and its matches come and go).
            let backoff = if own > 0.0 { s.probe_misses.min(4) } else { 0 };
            let every = (8.0 * (cost / self.config.draft_cost.max(1e-3)).max(1.0)).min(128.0)
                * f64::from(1u32 << backoff);
            if k == 0 && s.steps_without_draft as f64 >= every {
                k = 1;
            }
        }
        // The constraint's forced tokens are drafted whatever the policy
        // says: they cost verification only and are accepted unless the
        // target's masked choice tokenises the same bytes differently.
        let forced = s.forced.len().min(MAX_FORCED_DRAFT);
        if forced > k {
            k = forced
                .min(room)
                .min(self.config.max_seq_len.saturating_sub(s.tokens.len()));
        }
        k
    }

    /// Step 1: admit waiting requests and list what each running sequence
    /// wants this step, in priority order (decodes in admission order, then
    /// prefills). `cap(name)` is a proposer's max draft.
    pub fn wants<'c>(
        &mut self,
        caps: impl Fn(&str) -> Option<&'c Capabilities>,
    ) -> (Vec<PlanItem>, Vec<Want>) {
        // Admission: new sequences start prefilling; a forked choice waits
        // for its parent's prefill, then starts from its prompt KV.
        match self.config.scheduling {
            Scheduling::Fcfs => self.admit_fcfs(&caps),
            Scheduling::Fair => self.admit_fair(&caps),
        }
        metrics::gauge!("specd_queue_length").set(self.waiting.len() as f64);
        let mut budget = self.config.max_batch_tokens;
        let mut items = Vec::new();
        let mut wants = Vec::new();
        // Sequences whose prefill is done decode this step.
        // A running id without a sequence would be a bookkeeping bug; such
        // ids are dropped here rather than trusted.
        let seqs = &self.seqs;
        self.running.retain(|id| seqs.contains_key(id));
        for &id in &self.running {
            if let Some(s) = self.seqs.get_mut(&id) {
                if s.status == SeqStatus::Prefill && s.cached >= s.prefill_target() {
                    s.status = SeqStatus::Decoding;
                }
            }
        }
        let decoding = self
            .running
            .iter()
            .filter(|id| {
                self.seqs
                    .get(id)
                    .is_some_and(|s| s.status == SeqStatus::Decoding)
            })
            .count();
        let price = self.draft_price(decoding);
        if self.config.adaptive_draft && decoding > 0 {
            metrics::gauge!("specd_draft_token_price").set(price);
            self.prices.0 += price;
            self.prices.1 += 1;
        }
        for &id in &self.running {
            let Some(s) = self.seqs.get(&id) else {
                continue;
            };
            if s.status != SeqStatus::Decoding || budget == 0 {
                continue;
            }
            let Some(&last) = s.tokens.last() else {
                continue;
            };
            let pcaps = s.proposer.as_deref().and_then(&caps);
            let k = self.draft_len(s, pcaps, price, budget - 1);
            budget -= 1 + k;
            items.push(PlanItem {
                seq: id,
                cache_len: s.cached,
                work: Work::Decode {
                    last,
                    max_draft: k,
                    prefix: Vec::new(),
                },
                hidden_layers: pcaps.map(|c| c.hidden_layers.clone()).unwrap_or_default(),
                moves: s.pending_moves.clone(),
                siblings: pcaps.map(|c| c.siblings).unwrap_or_default(),
                lookup: pcaps.is_some_and(is_lookup),
                fork_from: s.fork_from,
                prompt_logprobs: None,
            });
            wants.push(Want {
                seq: id,
                len: s.cached + 1 + k,
            });
        }
        // Prefill chunks from what the decodes left (at most
        // `max_prefill_tokens`): in admission order (FCFS), or shared
        // fairly across requests (`fairness`). A sequence that can also feed its last
        // token this step asks for it: its first token then comes from
        // this step (`Work::Decode` with a prefix).
        let mut batch_left = budget;
        budget = budget.min(self.config.max_prefill_tokens.max(1));
        let prefilling: Vec<(Slot, usize, bool)> = self
            .running
            .iter()
            .filter_map(|&id| {
                let s = self.seqs.get(&id)?;
                let need = s.prefill_target().saturating_sub(s.cached);
                // Fresh prompts only (a recompute after a preemption ends
                // with the decode step it would have had anyway), and not
                // for a proposer that drafts from the prompt's hidden
                // states (this forward computes the last of them).
                let hidden = s
                    .proposer
                    .as_deref()
                    .and_then(&caps)
                    .is_some_and(|c| !c.hidden_layers.is_empty());
                let last = s.req.prompt_logprobs.is_none()
                    && s.fork_from.is_none()
                    && s.generated().is_empty()
                    && !hidden;
                (s.status == SeqStatus::Prefill && need > 0).then_some((
                    self.slot(id, false)?,
                    need + usize::from(last),
                    last,
                ))
            })
            .collect();
        let needs: Vec<(Slot, usize)> = prefilling.iter().map(|(s, n, _)| (*s, *n)).collect();
        let shares = match self.config.scheduling {
            Scheduling::Fair => fairness::prefill_shares(budget, &needs),
            Scheduling::Fcfs => needs
                .iter()
                .map(|(_, need)| {
                    let n = (*need).min(budget);
                    budget -= n;
                    n
                })
                .collect(),
        };
        batch_left = batch_left.saturating_sub(shares.iter().sum::<usize>());
        for ((slot, need, last), n) in prefilling.into_iter().zip(shares) {
            let Some(s) = self.seqs.get(&slot.id) else {
                continue;
            };
            let id = slot.id;
            if last && n == need {
                // The whole rest of the prompt, its last token and drafts
                // from what is left of the batch budget.
                let Some((&tok, prefix)) = s.tokens[s.cached..].split_last() else {
                    continue;
                };
                let pcaps = s.proposer.as_deref().and_then(&caps);
                let k = self.draft_len(s, pcaps, price, batch_left);
                batch_left -= k;
                items.push(PlanItem {
                    seq: id,
                    cache_len: s.cached,
                    work: Work::Decode {
                        last: tok,
                        max_draft: k,
                        prefix: prefix.to_vec(),
                    },
                    hidden_layers: pcaps.map(|c| c.hidden_layers.clone()).unwrap_or_default(),
                    moves: s.pending_moves.clone(),
                    siblings: pcaps.map(|c| c.siblings).unwrap_or_default(),
                    lookup: pcaps.is_some_and(is_lookup),
                    fork_from: None,
                    prompt_logprobs: None,
                });
                wants.push(Want {
                    seq: id,
                    len: s.tokens.len() + k,
                });
                continue;
            }
            // Without the last token (it waits for the next step).
            let n = n.min(need - usize::from(last));
            if n == 0 {
                continue;
            }
            let pcaps = s.proposer.as_deref().and_then(&caps);
            items.push(PlanItem {
                seq: id,
                cache_len: s.cached,
                work: Work::Prefill(s.tokens[s.cached..s.cached + n].to_vec()),
                hidden_layers: pcaps.map(|c| c.hidden_layers.clone()).unwrap_or_default(),
                moves: Vec::new(),
                siblings: Default::default(),
                lookup: false,
                fork_from: None,
                // Positions before the prompt's last predict prompt
                // tokens; a recompute after a preemption also feeds the
                // generated ones, whose log-probabilities are not asked.
                prompt_logprobs: s.req.prompt_logprobs.and_then(|k| {
                    let end = (s.cached + n).min(s.prompt_len.saturating_sub(1));
                    (end > s.cached).then(|| (k, s.tokens[s.cached + 1..end + 1].to_vec()))
                }),
            });
            wants.push(Want {
                seq: id,
                len: s.cached + n,
            });
        }
        (items, wants)
    }

    /// Running sequences that hold KV but want nothing this step (the
    /// token budget ran out before them), in admission order: the grant's
    /// last-resort victims. A forked choice before its first step holds
    /// nothing yet.
    pub fn idle_holders(&self, wants: &[super::kv_manager::Want]) -> Vec<SeqId> {
        self.running
            .iter()
            .copied()
            .filter(|id| !wants.iter().any(|w| w.seq == *id))
            .filter(|id| {
                self.seqs.get(id).is_some_and(|s| {
                    s.cached > 0
                        && s.fork_from.is_none()
                        && matches!(s.status, SeqStatus::Decoding | SeqStatus::Prefill)
                })
            })
            .collect()
    }

    /// Step 2: apply the KV manager's grant. Preempted sequences go back to
    /// the front of the queue to be recomputed; deferred ones sit out this
    /// step; sequences that can never fit fail.
    pub fn apply_grant(&mut self, items: Vec<PlanItem>, grant: &Grant) -> Vec<PlanItem> {
        // A forked choice whose parent goes away before the copy (preempted
        // or too big now, or ended in an earlier step while the choice sat
        // out for budget or KV: its cache is released before this step
        // runs) prefills its prompt itself (from the next step).
        let gone: Vec<SeqId> = self
            .seqs
            .values()
            .filter_map(|s| s.fork_from)
            .filter(|p| !self.seqs.contains_key(p))
            .collect();
        let mut unforked = Vec::new();
        for s in self.seqs.values_mut() {
            if s.fork_from.is_some_and(|p| {
                grant.preempted.contains(&p) || grant.too_big.contains(&p) || gone.contains(&p)
            }) {
                s.fork_from = None;
                s.cached = 0;
                s.status = SeqStatus::Prefill;
                unforked.push(s.id);
            }
        }
        for &id in grant.preempted.iter().rev() {
            self.requeue(id, "kv");
        }
        for &id in &grant.too_big {
            if let Some(s) = self.seqs.get(&id) {
                s.send(Event::Error(format!(
                    "request needs more KV cache than the whole budget ({} tokens)",
                    s.prompt_len.saturating_add(s.req.max_tokens)
                )));
            }
            self.running.retain(|&r| r != id);
            self.lifecycle.released.push(id);
            self.lifecycle.ended.push(id);
            if self.seqs.remove(&id).is_some() {
                metrics::counter!("specd_requests_total", "finish" => "error").increment(1);
            }
        }
        items
            .into_iter()
            .filter(|it| grant.granted.contains(&it.seq) && !unforked.contains(&it.seq))
            .collect()
    }

    /// Whether waiting sequence `id` may start from its parent's prompt KV.
    fn fork_source<'c>(&self, id: SeqId, caps: &impl Fn(&str) -> Option<&'c Capabilities>) -> Fork {
        let Some(s) = self.seqs.get(&id) else {
            return Fork::No;
        };
        let Some(p) = s.req.fork_of else {
            return Fork::No;
        };
        // Recomputed after a preemption, or a proposer that must see the
        // prompt's hidden states: a prefill of its own.
        let name = s.proposer.as_deref().unwrap_or("none");
        if s.preemptions > 0
            || s.req.prompt_logprobs.is_some()
            || caps(name).is_some_and(|c| !c.hidden_layers.is_empty())
        {
            return Fork::No;
        }
        let Some(parent) = self.seqs.get(&p) else {
            return Fork::No;
        };
        if parent.prompt_len != s.prompt_len
            || parent.tokens[..parent.prompt_len] != s.tokens[..s.prompt_len]
        {
            return Fork::No;
        }
        match parent.status {
            SeqStatus::Waiting | SeqStatus::Prefill => Fork::Wait,
            SeqStatus::Decoding
                if parent.cached >= parent.prefill_target() && parent.fork_from.is_none() =>
            {
                Fork::From(p, s.prefill_target())
            }
            SeqStatus::Decoding => Fork::Wait,
            _ => Fork::No,
        }
    }

    /// Lifecycle work the other stages must apply before this step runs.
    pub fn take_lifecycle(&mut self) -> Lifecycle {
        std::mem::take(&mut self.lifecycle)
    }

    /// Committed tokens and params the drafter and sampler need for `id`.
    pub fn seq_context(&self, id: SeqId) -> Option<SeqContext<'_>> {
        self.seqs.get(&id).map(|s| SeqContext {
            tokens: &s.tokens,
            params: &s.req.params,
            logprobs: s.req.logprobs,
            constraint: s.req.constraint.as_ref(),
            forced_drafts: s.req.forced_drafts,
            forced: &s.forced,
        })
    }

    pub fn prompt_len(&self, id: SeqId) -> usize {
        self.seqs.get(&id).map(|s| s.prompt_len).unwrap_or(0)
    }

    /// Step 3: commit a step's results, token by token.
    pub fn commit(
        &mut self,
        prefilled: Vec<PrefillResult>,
        decoded: Vec<DecodeResult>,
    ) -> Committed {
        let mut out = Committed::default();
        for r in prefilled {
            if let Some(s) = self.seqs.get_mut(&r.seq) {
                s.prompt_logprobs.extend(r.logprobs);
                s.append_hidden(r.hidden, r.tokens, self.config.max_hidden_rows);
                s.cached += r.tokens;
                out.lens.push((r.seq, s.cached));
            }
        }
        for mut r in decoded {
            let Some(s) = self.seqs.get_mut(&r.seq) else {
                continue;
            };
            s.fork_from = None;
            s.forced = std::mem::take(&mut r.accepted.forced);
            let st = &mut s.stats;
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
            if drafted > 0 {
                // Acceptance per drafted depth (a chain's depth is its length).
                let rate = accepted as f64 / depth.max(1) as f64;
                s.acceptance_ema = 0.7 * s.acceptance_ema + 0.3 * rate;
                if s.steps_without_draft > 0 {
                    // A draft after a pause: a probe.
                    s.probe_misses = if accepted == 0 {
                        s.probe_misses.saturating_add(1)
                    } else {
                        0
                    };
                }
                s.steps_without_draft = 0;
                if let Some(tp) = &mut s.tree_policy {
                    tp.record(drafted, accepted);
                }
            } else if r.forced == 0 {
                s.steps_without_draft += 1;
            }
            let member = r.source.as_deref().unwrap_or(&st.proposer);
            if r.forced == 0 || drafted > 0 {
                record_step_metrics(&st.proposer, &st.arm, member, depth, accepted);
            }
            let card = self.arms.entry(st.arm.clone()).or_default();
            card.record_tree(r.drafted, r.depth, r.accepted.accepted);
            let mut new_ids = Vec::new();
            let mut new_text = String::new();
            let mut new_lps = Vec::new();
            for (i, &t) in r.accepted.tokens.iter().enumerate() {
                if !s.req.ignore_eos && self.config.eos_token_ids.contains(&t) {
                    s.finish = Some(FinishReason::Stop);
                    break;
                }
                s.tokens.push(t);
                new_ids.push(t);
                if let Some(lp) = r.accepted.logprobs.get(i) {
                    new_lps.push(lp.clone());
                }
                if let Some(tok) = &self.tokenizer {
                    let piece = s.detok.push(tok, t).unwrap_or_default();
                    let emit = s.stop.push(&piece);
                    new_text.push_str(&emit);
                    if s.stop.stopped() {
                        s.finish = Some(FinishReason::Stop);
                        break;
                    }
                }
                if s.generated().len() >= s.req.max_tokens {
                    s.finish = Some(FinishReason::Length);
                    break;
                }
            }
            // A constraint that has ended (end of sequence consumed, kept
            // by `ignore_eos`) ends the sequence.
            if r.accepted.done && s.finish.is_none() {
                s.finish = Some(FinishReason::Stop);
            }
            if s.finish.is_some() {
                if let Some(tok) = &self.tokenizer {
                    if !s.stop.stopped() {
                        let rest = s.detok.flush(tok).unwrap_or_default();
                        new_text.push_str(&s.stop.push(&rest));
                        if !s.stop.stopped() {
                            new_text.push_str(&s.stop.finish());
                        }
                    }
                }
            }
            s.text.push_str(&new_text);
            metrics::counter!("specd_generated_tokens_total", "proposer" => s.stats.proposer.clone(), "arm" => s.stats.arm.clone())
                .increment(new_ids.len() as u64);
            s.stats.tokens += new_ids.len() as u64;
            if let Some(card) = self.arms.get_mut(&s.stats.arm) {
                card.tokens += new_ids.len() as u64;
                if s.finish.is_some() {
                    card.requests += 1;
                }
            }
            if !new_ids.is_empty() && !s.first_token_seen {
                s.first_token_seen = true;
                metrics::histogram!("specd_time_to_first_token_seconds", "priority" => fairness::priority_label(s.req.priority))
                    .record(s.arrived.elapsed().as_secs_f64());
            }
            if !new_ids.is_empty() || !new_text.is_empty() {
                s.logprobs.extend_from_slice(&new_lps);
                s.send(Event::Tokens {
                    ids: new_ids.clone(),
                    text: new_text,
                    logprobs: new_lps,
                });
            }
            // Cache keeps [prefix, last, accepted drafts]; the newest
            // token is fed next. A tree's accepted nodes move down to
            // their depth.
            let base = s.cached + r.prefix;
            s.pending_moves = r
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
            let picked = r
                .hidden
                .into_iter()
                .map(|(l, h)| {
                    let width = h.len() / fed;
                    let mut v = Vec::with_capacity(width * rows.len());
                    for &row in &rows {
                        if let Some(x) = h.get(row * width..(row + 1) * width) {
                            v.extend_from_slice(x);
                        }
                    }
                    (l, v)
                })
                .collect();
            s.append_hidden(picked, rows.len(), self.config.max_hidden_rows);
            s.cached += rows.len();
            // Proposers see every committed token, the last run included.
            self.pending_observe.push(Observed {
                seq: s.id,
                tokens: new_ids,
                path: r.path,
            });
            if s.finish.is_some() {
                s.status = SeqStatus::Finished;
                let id = s.id;
                self.running.retain(|&x| x != id);
                self.lifecycle.released.push(id);
                self.lifecycle.ended.push(id);
                let c = self.completion(id);
                let reason = match c.finish {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                    FinishReason::Aborted => "aborted",
                };
                metrics::counter!("specd_requests_total", "finish" => reason).increment(1);
                if let Some(s) = self.seqs.get(&id) {
                    s.send(Event::Finished(c.clone()));
                }
                self.seqs.remove(&id);
                out.finished.push(c);
            } else {
                out.lens.push((s.id, s.cached));
            }
        }
        out
    }
}

/// Step counters, labelled by proposer, A/B arm and drafting member (the
/// proposer itself unless it is composed).
fn record_step_metrics(proposer: &str, arm: &str, member: &str, drafted: usize, accepted: usize) {
    let (p, a, m) = (proposer.to_string(), arm.to_string(), member.to_string());
    metrics::counter!("specd_verify_steps_total", "proposer" => p.clone(), "arm" => a.clone(), "member" => m.clone())
        .increment(1);
    metrics::counter!("specd_drafted_tokens_total", "proposer" => p.clone(), "arm" => a.clone(), "member" => m.clone())
        .increment(drafted as u64);
    metrics::counter!("specd_accepted_tokens_total", "proposer" => p.clone(), "arm" => a.clone(), "member" => m)
        .increment(accepted as u64);
    metrics::histogram!("specd_accepted_length", "proposer" => p.clone(), "arm" => a.clone())
        .record((accepted + 1) as f64);
    for i in 0..accepted {
        metrics::counter!("specd_accepted_tokens_by_position_total", "proposer" => p.clone(), "arm" => a.clone(), "position" => i.to_string())
            .increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::trim_hidden;

    #[test]
    fn buffered_hidden_rows_keep_the_newest_and_move_their_start() {
        // Two layers of width 2, rows for positions 10..16.
        let rows = |r: std::ops::Range<usize>, l: f32| -> Vec<f32> {
            r.flat_map(|p| [l + p as f32, l + p as f32 + 0.5]).collect()
        };
        let mut h = vec![(3, rows(10..16, 0.0)), (7, rows(10..16, 100.0))];
        let mut start = 10;
        trim_hidden(&mut h, &mut start, 6, 8);
        assert_eq!((start, h[0].1.len()), (10, 12), "under the cap: untouched");
        trim_hidden(&mut h, &mut start, 6, 4);
        assert_eq!(start, 12);
        assert_eq!(h[0], (3, rows(12..16, 0.0)));
        assert_eq!(h[1], (7, rows(12..16, 100.0)));
    }
}
