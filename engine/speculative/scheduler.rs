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
//! - Tokens are committed one at a time: EOS, a stop token id, a stop string or max_tokens
//!   ends the sequence and every later token of the accepted run is dropped,
//!   never emitted.
//! - Every step's batch costs at most `max_batch_tokens` tokens, and decode
//!   steps of running sequences come before new prefill work; while a
//!   prompt is prefilling, drafts leave it an eighth of the budget (at
//!   most `max_prefill_tokens`).
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
use super::fairness::Scheduling;
use super::hidden::HiddenRows;
pub use super::hidden::MAX_HIDDEN_ROWS;

use super::policy::{SeqPolicy, VerifyCostModel};
use super::prefix_cache::PrefixProbe;
use super::proposer::Capabilities;
pub use super::sequence::{SeqContext, SeqStatus, Sequence};
use super::{Completion, Event, Request, SeqId, SpecStats};
use crate::error::{Result, SpecdError};
use crate::sampler::{FinishReason, StopBuffer};
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
    /// price with `measured_pricing` off, of a sampled sequence decoding
    /// alone whose proposer drafts from a q of its own, and until the cost
    /// model has seen enough steps.
    pub draft_cost: f64,
    /// Price drafted tokens from verify times measured on this machine at
    /// the step's batch size (`VerifyCostModel`), not one constant, when
    /// two or more sequences decode, or one whose tokens do not depend on
    /// its draft lengths (greedy, or sampled with a proposer declaring
    /// one-hot q: plain decoding's draws, `accept`'s coupling). Draft
    /// lengths then depend on timing: a seeded sampled request in a batch
    /// drafting from a q of its proposer's own may draw different (equally
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

/// A proposer that drafts from the tokens it is given alone.
pub(super) fn is_lookup(c: &Capabilities) -> bool {
    c.hidden_layers.is_empty() && c.q_kind == super::proposer::QKind::OneHot
}

/// Most forced tokens one step drafts.
pub const MAX_FORCED_DRAFT: usize = 32;

/// The member label the constraint's forced drafts are scored under
/// (`SpecStats::members`, the `member` label of the draft metrics).
pub const FORCED_MEMBER: &str = "grammar";

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
    /// Keep the sliding-window entries a query at this position reads
    /// (a choice still to fork copies this cache there).
    pub keep_window_from: Option<usize>,
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
    /// Hidden states of every fed row (the prefix's rows, the root's,
    /// then one per node).
    pub hidden: HiddenRows,
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
    pub hidden: HiddenRows,
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
    pub(super) tokenizer: Option<Arc<Tokenizer>>,
    pub(super) seqs: HashMap<SeqId, Sequence>,
    pub(super) waiting: VecDeque<SeqId>,
    /// Running sequences in admission order (earliest first).
    pub(super) running: Vec<SeqId>,
    pub(super) next_id: SeqId,
    pub(super) lifecycle: Lifecycle,
    /// Tokens committed by the last step, for the drafter's next call.
    pub(super) pending_observe: Vec<Observed>,
    /// A step is between plan and commit: aborts wait in `deferred_aborts`.
    pub(super) in_step: bool,
    pub(super) deferred_aborts: Vec<SeqId>,
    /// Live totals per A/B arm.
    pub(super) arms: std::collections::BTreeMap<String, super::SpecStats>,
    /// Verify time by tokens fed, learned from decode steps.
    pub(super) cost: VerifyCostModel,
    /// Tokens drafted in the last decode-only step (the next one's
    /// estimate).
    /// Sum and count of the draft prices of planned steps.
    pub(super) prices: (f64, u64),
    /// Consecutive quiet steps (`fairness::prefill_cap`).
    pub(super) quiet_steps: u32,
    /// The last planned step gave some request its whole prefill (its
    /// first token): the next may not starve long prompts
    /// (`fairness::prefill_shares`).
    pub(super) first_token_step: bool,
    /// Per proposer without a configured `token_cost`: seconds its calls
    /// took and tokens they drafted, each call's weight decaying by
    /// `OWN_DECAY` per later call (see `own_cost`).
    pub(super) own: HashMap<String, (f64, f64)>,
    /// The verifier's prefix cache, read to plan cached prompt blocks as
    /// free (`None`: no prefix cache).
    pub(super) prefix: Option<PrefixProbe>,
    /// The target has sliding-window layers whose entries the verifier
    /// releases (forks then need the parent's window kept).
    pub(super) windowed: bool,
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
            prices: (0.0, 0),
            quiet_steps: 0,
            first_token_step: false,
            own: HashMap::new(),
            prefix: None,
            windowed: false,
            config,
        }
    }

    /// Plan prefill chunks with the prefix cache `probe` looks into: its
    /// blocks cost no budget, so a prompt takes all it finds cached in one
    /// step, however the budget is shared.
    pub fn set_prefix_probe(&mut self, probe: Option<PrefixProbe>) {
        self.prefix = probe;
    }

    /// The target's caches release sliding-window entries (a choice then
    /// forks only from a parent that kept its window at the prompt's end).
    pub fn set_windowed(&mut self, windowed: bool) {
        self.windowed = windowed;
    }

    /// A verify forward fed `tokens` tokens to sequences holding `ctx`
    /// positions on average in `seconds`; `decode_only`: no prefill chunk shared it
    /// (every fed position computed logits), so it calibrates the model.
    pub fn record_verify(&mut self, tokens: usize, ctx: f64, seconds: f64, decode_only: bool) {
        if decode_only {
            self.cost.record(tokens, ctx, seconds);
        }
    }

    /// A call's weight in `own` after each later call.
    const OWN_DECAY: f64 = 0.9;

    /// The proposers' calls of a step (`Drafter::take_spent`): a call
    /// teaches `own_cost` when every sequence it drafted for had drafted
    /// on its previous decode step too. After a pause a call also catches
    /// the proposer up on every token committed meanwhile (a head's or
    /// draft model's forward over them), work that belongs to the steps
    /// that did not draft; counting it per drafted token would price a
    /// paused proposer higher the longer it pauses, and keep it paused.
    pub fn record_drafting(&mut self, spent: &[super::drafter::DraftSpent]) {
        for sp in spent {
            if sp.drafted == 0 || !sp.seconds.is_finite() || sp.seconds < 0.0 {
                continue;
            }
            let steady = sp.seqs.iter().all(|id| {
                self.seqs
                    .get(id)
                    .is_some_and(|s| s.policy.tested > 0.0 && s.policy.steps_without_draft == 0)
            });
            if !steady {
                continue;
            }
            let e = self.own.entry(sp.proposer.clone()).or_insert((0.0, 0.0));
            e.0 = e.0 * Self::OWN_DECAY + sp.seconds;
            e.1 = e.1 * Self::OWN_DECAY + sp.drafted as f64;
        }
    }

    /// What drafting one token costs `proposer` itself, measured from its
    /// steady calls, relative to a sequence's share of a step of `batch`
    /// decoding sequences (the unit `draft_price` uses; at batch 1 a
    /// one-token forward), from the verify cost model's measured step;
    /// `None` before both are measured.
    pub fn own_cost(&self, proposer: &str, batch: usize) -> Option<f64> {
        let &(secs, toks) = self.own.get(proposer)?;
        let b = batch.max(1);
        // A sequence that drafts on every step never measures a step of
        // `b` tokens: the step line, else the nearest size measured,
        // stands in.
        let share = self
            .cost
            .line_time(b, self.decoding_ctx())
            .or_else(|| self.cost.time_or_nearest(b))?
            / b as f64;
        (toks > 0.0 && share > 0.0).then(|| secs / toks / share)
    }

    /// Mean price of a drafted token over the steps planned so far.
    pub fn mean_draft_price(&self) -> Option<f64> {
        (self.prices.1 > 0).then(|| self.prices.0 / self.prices.1 as f64)
    }

    /// The verify cost of a drafted token in a step of `batch` decoding
    /// sequences, relative to a sequence's share of the step: measured
    /// (see `VerifyCostModel::draft_cost`) or the configured constant.
    ///
    /// A sequence decoding alone whose tokens depend on its draft lengths
    /// (sampled, drafts drawn from a q of their own, whose rejections
    /// decide tokens) is priced at the constant: its draft lengths then
    /// depend only on its own acceptance, so a seeded request gives the
    /// same tokens run after run (measured times vary). One whose tokens do
    /// not (`timing_free`: greedy, the target's argmax path; or sampled
    /// with one-hot drafts, verified by coupling to plain decoding's draws,
    /// `accept`) is priced from the machine's own steps
    /// (`VerifyCostModel::alone_draft_cost`) once they are measured.
    ///
    /// Until the step line is fitted, a batch's drafts are priced at
    /// `draft_cost` per sequence in the batch, at most 1: verification
    /// turns compute-bound as the batch grows, where a drafted token costs
    /// about what a sequence's own token does (erring high only delays
    /// drafting until the line is measured; erring low, as a price of zero
    /// from a few noisy sizes did, made a busy server draft at a loss).
    pub fn draft_price(&self, batch: usize, timing_free: bool) -> f64 {
        if !self.measured_price(batch, timing_free) {
            return self.config.draft_cost;
        }
        if batch < 2 {
            return self
                .cost
                .alone_draft_cost(self.decoding_ctx())
                .unwrap_or(self.config.draft_cost);
        }
        self.cost
            .draft_cost(batch, self.decoding_ctx())
            .unwrap_or((self.config.draft_cost * batch as f64).min(1.0))
    }

    /// Whether a step of `batch` decoding sequences prices drafts (and
    /// proposers' own costs) from measured times: with measured pricing
    /// on, in a batch, or alone when `timing_free` (see `draft_price`).
    pub fn measured_price(&self, batch: usize, timing_free: bool) -> bool {
        self.config.measured_pricing && (batch >= 2 || (batch == 1 && timing_free))
    }

    /// Mean cached positions of the decoding sequences (0 with none).
    pub(super) fn decoding_ctx(&self) -> f64 {
        let (sum, n) = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .filter(|s| s.status == SeqStatus::Decoding)
            .fold((0usize, 0usize), |(a, n), s| (a + s.cached, n + 1));
        if n == 0 {
            0.0
        } else {
            sum as f64 / n as f64
        }
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
            policy: SeqPolicy::default(),
            proposer,
            stop: StopBuffer::new(req.stop.clone()),
            detok: StreamDecoder::new(),
            sink,
            hidden: HiddenRows::default(),
            hidden_start: 0,
            pending_moves: Vec::new(),
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
            window_past_prompt: false,
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
    pub fn take_hidden(&mut self, id: SeqId) -> (HiddenRows, usize) {
        match self.seqs.get_mut(&id) {
            Some(s) => (std::mem::take(&mut s.hidden), s.hidden_start),
            None => (HiddenRows::default(), 0),
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
        self.end_with(id, Event::Error(why.to_string()));
    }

    /// Fail a request through its own fields (`Event::Rejected`: a
    /// constraint no token can continue), as `fail` does.
    pub fn reject(&mut self, id: SeqId, why: &str) {
        self.end_with(id, Event::Rejected(why.to_string()));
    }

    fn end_with(&mut self, id: SeqId, event: Event) {
        if let Some(s) = self.seqs.remove(&id) {
            s.send(event);
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

    /// What `min_tokens` holds back at the sequence's next positions.
    pub fn end_ban(&self, id: SeqId) -> Option<super::accept::EndBan> {
        let s = self.seqs.get(&id)?;
        s.req
            .end_ban(&self.config.eos_token_ids, s.generated().len())
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
        for r in decoded {
            let Some(s) = self.seqs.get_mut(&r.seq) else {
                continue;
            };
            // The arm's live totals count every drafted node.
            let card = self.arms.entry(s.stats.arm.clone()).or_default();
            card.record_tree(r.drafted, r.depth, r.accepted.accepted);
            let path = r.path.clone();
            let new_ids = s.commit_decode(
                r,
                &self.config.eos_token_ids,
                self.tokenizer.as_deref(),
                self.config.max_hidden_rows,
            );
            if let Some(card) = self.arms.get_mut(&s.stats.arm) {
                card.tokens += new_ids.len() as u64;
                if s.finish.is_some() {
                    card.requests += 1;
                }
            }
            // Proposers see every committed token, the last run included.
            self.pending_observe.push(Observed {
                seq: s.id,
                tokens: new_ids,
                path,
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
pub(super) fn record_step_metrics(
    proposer: &str,
    arm: &str,
    member: &str,
    drafted: usize,
    accepted: usize,
) {
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
