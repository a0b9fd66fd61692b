//! One engine step, defined once: plan -> grant -> draft -> verify ->
//! accept -> commit.
//!
//! A [`Step`] is the scheduler's side of the step: each of its transitions
//! takes the previous stage's response and returns the next stage's request.
//! The requests are the messages the actors exchange, and each stage struct
//! answers its request with one `handle_*` method defined here. Both drivers
//! execute exactly this sequence: `SyncDriver::step` calls the handlers
//! directly on one thread, the `SchedulerActor` sends the same requests to
//! the stage actors, whose handlers call the same methods.
//!
//! Invariants:
//! - Between `Step::plan` and `Step::commit` (or `Step::abandon`) the
//!   scheduler defers aborts, so nothing a step planned disappears under it;
//!   aborts are applied when the step ends.
//! - Stage outputs are matched to plan items by sequence id, never by
//!   position; a missing output fails (or skips) only its own sequence.
//! - Nothing here panics on a state a client can cause: a stage that fails
//!   for some sequences reports them in `failed`, and those requests end
//!   with an error event while the others continue.
//! - A stage handler catches panics of the work it runs (the model forward,
//!   acceptance), so a bug there fails the affected sequences, not the
//!   engine.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use super::accept::Accepted;
use super::accept::{AcceptItem, Acceptor};
pub use super::verify::VerifyResponse;
use super::verify::{Verifier, VerifyItem, VerifyOut};

use super::drafter::{DraftSpent, Drafter};
use super::hidden::HiddenRows;
use super::kv_manager::{self, Grant, KvManager, Pool, Want};
use super::proposer::{Capabilities, Draft, ProposeInput};
use super::scheduler::{DecodeResult, Observed, PlanItem, PrefillResult, Scheduler, Work};
use super::{Completion, SeqId};
use crate::error::{panic_message, SpecdError};
use crate::model::{Logits, TreeMask};
use crate::sampler::SamplingParams;

// ------------------------------------------------------------ messages

/// Stage 2 input: free `release`, then reserve `wants` (highest priority
/// first), evicting lower-priority holders when blocks run out.
#[derive(Debug, Clone, Default)]
pub struct GrantRequest {
    pub release: Vec<SeqId>,
    pub wants: Vec<Want>,
    /// Running sequences without a want this step that hold blocks:
    /// evicted only when nothing else frees enough (`kv_manager::grant`).
    pub idle: Vec<(SeqId, i32)>,
}

/// One sequence's owned draft input.
#[derive(Debug, Clone)]
pub struct DraftInput {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
    pub max_draft: usize,
    pub params: SamplingParams,
    /// Hidden states (declaration order) of positions `hidden_start..`.
    pub hidden: HiddenRows,
    pub hidden_start: usize,
}

/// Stage 3 input: lifecycle news for the proposers, then the batch to draft.
#[derive(Debug, Clone, Default)]
pub struct DraftRequest {
    /// Proposer label for this step's timing metrics.
    pub label: String,
    /// Tokens committed by the previous step, with the accepted path (a
    /// finished sequence's last tokens arrive with its release).
    pub observe: Vec<Observed>,
    pub start: Vec<(SeqId, String, Vec<u32>)>,
    pub finish: Vec<SeqId>,
    pub inputs: Vec<DraftInput>,
}

#[derive(Debug, Clone, Default)]
pub struct DraftResponse {
    pub drafts: Vec<(SeqId, Draft)>,
    /// What each proposer's call cost (the scheduler prices drafting by it).
    pub spent: Vec<DraftSpent>,
}

/// Stage 4 input: drop the caches of `release`, then one forward.
#[derive(Debug, Clone, Default)]
pub struct VerifyRequest {
    pub label: String,
    pub release: Vec<SeqId>,
    pub items: Vec<VerifyItem>,
}

/// Stage 5 input: forget the RNGs of `ended`, then accept every item.
#[derive(Debug, Clone, Default)]
pub struct AcceptRequest {
    pub label: String,
    pub ended: Vec<SeqId>,
    pub items: Vec<AcceptItem>,
}

#[derive(Debug, Clone, Default)]
pub struct AcceptResponse {
    /// (sequence, accepted tokens, the path's node indices).
    pub accepted: Vec<(SeqId, Accepted, Vec<usize>)>,
    pub failed: Vec<(SeqId, String)>,
    /// Failed through the request's own fields (its constraint).
    pub rejected: Vec<(SeqId, String)>,
}

/// Stage 6 output for the KV manager: committed lengths (rollback of
/// rejected positions) and sequences that finished.
#[derive(Debug, Clone, Default)]
pub struct CommitLens {
    pub lens: Vec<(SeqId, usize)>,
    pub free: Vec<SeqId>,
}

/// What one step did.
#[derive(Debug, Default)]
pub struct StepReport {
    pub batch_tokens: usize,
    pub decode_seqs: usize,
    pub prefill_seqs: usize,
    pub finished: Vec<Completion>,
}

// ------------------------------------------------------------ the step

/// The scheduler's side of one step in flight.
#[derive(Debug)]
pub struct Step {
    pub n: u64,
    items: Vec<PlanItem>,
    /// Released before this step (finished, aborted, failed) or by its
    /// grant (preempted, too big): their caches and proposer state go.
    release: Vec<SeqId>,
    ended: Vec<SeqId>,
    /// Sequences to start in the drafter (admitted by this plan).
    starts: Vec<(SeqId, String, Vec<u32>)>,
    label: String,
    span: tracing::Span,
    drafts: HashMap<SeqId, Draft>,
    /// What the proposers' calls cost this step.
    spent: Vec<DraftSpent>,
    /// Each decode item's deepest drafted node.
    depths: HashMap<SeqId, usize>,
    /// Each decode item's drafting member (composed proposers).
    sources: HashMap<SeqId, String>,
    /// Tokens each constrained decode item's constraint forces (drafted
    /// first), then how many of its draft's nodes they took.
    forced: HashMap<SeqId, Vec<u32>>,
    forced_len: HashMap<SeqId, usize>,
    outs: HashMap<SeqId, VerifyOut>,
    /// Forked choices whose parent went away in this step's grant.
    unforked: Vec<SeqId>,
    report: StepReport,
}

/// Proposer label for a step's timings.
pub fn step_label<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let mut label: Option<&str> = None;
    for n in names {
        match label {
            None => label = Some(n),
            Some(l) if l != n => return "mixed".into(),
            _ => {}
        }
    }
    label.unwrap_or("none").to_string()
}

impl Step {
    /// Stage 1 (scheduler): admit, plan the batch and ask for its KV.
    /// `caps(name)` is a proposer's capabilities. Aborts are deferred from
    /// here until the step ends.
    pub fn plan<'c>(
        sched: &mut Scheduler,
        caps: impl Fn(&str) -> Option<&'c Capabilities>,
        n: u64,
    ) -> (Step, GrantRequest) {
        sched.begin_step();
        let (items, wants) = sched.wants(caps);
        let idle = sched.idle_holders(&wants);
        // Finished, aborted or failed sequences (and this plan's
        // admissions) known before the grant: their blocks are freed first.
        let early = sched.take_lifecycle();
        let step = Step {
            n,
            items,
            release: early.released.clone(),
            ended: early.ended,
            starts: early.starts,
            label: String::new(),
            span: tracing::Span::none(),
            drafts: HashMap::new(),
            spent: Vec::new(),
            depths: HashMap::new(),
            sources: HashMap::new(),
            forced: HashMap::new(),
            forced_len: HashMap::new(),
            outs: HashMap::new(),
            unforked: Vec::new(),
            report: StepReport::default(),
        };
        (
            step,
            GrantRequest {
                release: early.released,
                wants,
                idle,
            },
        )
    }

    /// Stage 2 result (KV manager): keep what was granted, then ask the
    /// drafter for drafts.
    pub fn granted(&mut self, sched: &mut Scheduler, grant: Grant) -> DraftRequest {
        let (items, unforked) = sched.apply_grant(std::mem::take(&mut self.items), &grant);
        self.items = items;
        self.unforked = unforked;
        let lc = sched.take_lifecycle();
        self.release.extend(lc.released.iter().copied());
        self.ended.extend(lc.ended.iter().copied());
        let span = tracing::debug_span!("step", n = self.n, seqs = self.items.len());
        for it in &self.items {
            if let Some(s) = sched.get(it.seq) {
                span.follows_from(&s.span);
            }
        }
        self.span = span;
        self.label = step_label(
            self.items
                .iter()
                .filter(|i| matches!(i.work, Work::Decode { .. }))
                .filter_map(|i| sched.get(i.seq))
                .map(|s| s.stats.proposer.as_str()),
        );
        let mut inputs = Vec::new();
        for it in &self.items {
            let Work::Decode { max_draft, .. } = it.work else {
                continue;
            };
            // Hidden states wait in the scheduler until a step drafts.
            let (hidden, hidden_start) = if max_draft > 0 {
                sched.take_hidden(it.seq)
            } else {
                (HiddenRows::default(), 0)
            };
            let Some(v) = sched.seq_context(it.seq) else {
                continue;
            };
            let mut tokens = v.tokens.to_vec();
            let mut room = max_draft;
            if !v.forced.is_empty() && max_draft > 0 {
                self.forced.insert(it.seq, v.forced.to_vec());
                // A lookup proposer drafts on from the forced tokens; any
                // other drafts from what is committed (`forced::with_forced`).
                if it.lookup {
                    tokens.extend_from_slice(v.forced);
                    room = max_draft.saturating_sub(v.forced.len());
                }
            }
            inputs.push(DraftInput {
                seq: it.seq,
                tokens,
                max_draft: room,
                params: v.params.clone(),
                hidden,
                hidden_start,
            });
        }
        let mut start = std::mem::take(&mut self.starts);
        start.extend(lc.starts);
        DraftRequest {
            label: self.label.clone(),
            observe: sched.take_observed(),
            start,
            finish: self.release.clone(),
            inputs,
        }
    }

    /// The step's tracing span (follows from every request's span).
    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// A decode-only step: every item feeds a committed token and its
    /// drafts, no prompt tokens, so every fed position computes logits.
    /// What its verify forward takes is the price of a forward of that
    /// many tokens (the scheduler's cost model learns it; the sync
    /// driver's `StageTimes::by_tokens` reports it). The one definition.
    pub fn decode_only(&self) -> bool {
        !self.items.is_empty()
            && self
                .items
                .iter()
                .all(|i| matches!(&i.work, Work::Decode { prefix, .. } if prefix.is_empty()))
    }

    /// Stage 3 result (drafter): the verify batch, each decode item's drafts
    /// appended to its last token.
    pub fn drafted(&mut self, resp: DraftResponse) -> VerifyRequest {
        self.drafts = resp.drafts.into_iter().collect();
        self.spent = resp.spent;
        let items: Vec<VerifyItem> = self
            .items
            .iter()
            .map(|it| match &it.work {
                Work::Prefill(tokens) => VerifyItem {
                    seq: it.seq,
                    cache_len: it.cache_len,
                    tokens: tokens.clone(),
                    logits: if it.prompt_logprobs.is_some() {
                        Logits::All
                    } else {
                        Logits::None
                    },
                    hidden_layers: it.hidden_layers.clone(),
                    tree: None,
                    moves: Vec::new(),
                    fork_from: None,
                    prompt_logprobs: it.prompt_logprobs.clone(),
                    keep_window_from: it.keep_window_from,
                },
                Work::Decode {
                    last,
                    prefix,
                    max_draft,
                } => {
                    let draft = self.drafts.entry(it.seq).or_default();
                    if let Some(f) = self.forced.remove(&it.seq) {
                        // A lookup proposer drafted after the forced tokens.
                        let merge = if it.lookup {
                            super::forced::prepend_forced
                        } else {
                            super::forced::with_forced
                        };
                        let (d, n) = merge(&f, std::mem::take(draft), *max_draft);
                        *draft = d;
                        self.forced_len.insert(it.seq, n);
                    }
                    let mut tokens = Vec::with_capacity(prefix.len() + 1 + draft.tokens.len());
                    tokens.extend_from_slice(prefix);
                    tokens.push(*last);
                    tokens.extend_from_slice(&draft.tokens);
                    // The root (the last committed token) is new token 0;
                    // node i is new token i + 1. A tree that is a chain
                    // (every node the child of the one before; empty
                    // included) is verified as one: the causal mask is its
                    // tree mask, and chains take the cheaper attention.
                    let linear = draft
                        .parents
                        .as_ref()
                        .is_none_or(|p| p.iter().enumerate().all(|(i, &x)| x == i as i32 - 1));
                    // A prefill's last chunk: the prompt's rest is a chain
                    // before the root.
                    let p = prefix.len();
                    let tree = (!linear).then(|| TreeMask {
                        parents: (0..p)
                            .map(|i| i.checked_sub(1))
                            .chain(std::iter::once(p.checked_sub(1)))
                            .chain(
                                (0..draft.tokens.len())
                                    .map(|i| Some(draft.parent(i).map_or(p, |q| p + q + 1))),
                            )
                            .collect(),
                    });
                    VerifyItem {
                        seq: it.seq,
                        cache_len: it.cache_len,
                        tokens,
                        // Rows from the root on.
                        logits: if prefix.is_empty() {
                            Logits::All
                        } else {
                            Logits::Tail(1 + draft.tokens.len())
                        },
                        hidden_layers: it.hidden_layers.clone(),
                        tree,
                        moves: it.moves.clone(),
                        fork_from: it.fork_from,
                        prompt_logprobs: None,
                        keep_window_from: it.keep_window_from,
                    }
                }
            })
            .collect();
        self.report.batch_tokens = items.iter().map(|v| v.tokens.len()).sum();
        VerifyRequest {
            label: self.label.clone(),
            release: self.release.clone(),
            items,
        }
    }

    /// Stage 4 result (verifier): fail what could not be verified, then ask
    /// the sampler to accept each decode item's drafts.
    pub fn verified(&mut self, sched: &mut Scheduler, resp: VerifyResponse) -> AcceptRequest {
        for (id, why) in &resp.failed {
            sched.fail(*id, why);
        }
        // Decode-only steps teach the scheduler what a forward of this
        // many tokens costs here.
        let (ctx, decodes) = self
            .items
            .iter()
            .filter(|i| matches!(&i.work, Work::Decode { prefix, .. } if prefix.is_empty()))
            .fold((0usize, 0usize), |(c, n), i| (c + i.cache_len, n + 1));
        let ctx = ctx as f64 / decodes.max(1) as f64;
        let decode_only = self.decode_only() && resp.failed.is_empty();
        sched.record_verify(self.report.batch_tokens, ctx, resp.seconds, decode_only);
        sched.record_drafting(&self.spent);
        self.outs = resp.outs.into_iter().map(|o| (o.seq, o)).collect();
        let mut items = Vec::new();
        for it in &self.items {
            if !matches!(it.work, Work::Decode { .. }) {
                continue;
            }
            let (Some(out), Some(view)) = (self.outs.get_mut(&it.seq), sched.seq_context(it.seq))
            else {
                continue;
            };
            let draft = self.drafts.remove(&it.seq).unwrap_or_default();
            self.depths
                .insert(it.seq, draft.depths().into_iter().max().unwrap_or(0));
            if let Some(src) = &draft.source {
                self.sources.insert(it.seq, src.clone());
            }
            items.push(AcceptItem {
                seq: it.seq,
                rows: std::mem::take(&mut out.logits),
                draft,
                siblings: it.siblings,
                params: view.params.clone(),
                // Only penalties read the history; skip the copy otherwise.
                context: if view.params.has_penalties() {
                    view.tokens.to_vec()
                } else {
                    Vec::new()
                },
                prompt_len: sched.prompt_len(it.seq),
                logprobs: view.logprobs,
                constraint: view.constraint.cloned(),
                forced_drafts: view.forced_drafts,
                ban: sched.end_ban(it.seq),
            });
        }
        AcceptRequest {
            label: self.label.clone(),
            ended: std::mem::take(&mut self.ended),
            items,
        }
    }

    /// Stage 5 result (sampler) and stage 6 (commit): tokens are committed
    /// one at a time, the deferred aborts applied, and the KV manager told
    /// the committed lengths.
    pub fn commit(
        mut self,
        sched: &mut Scheduler,
        resp: AcceptResponse,
    ) -> (CommitLens, StepReport) {
        for (id, why) in &resp.failed {
            sched.fail(*id, why);
        }
        for (id, why) in &resp.rejected {
            sched.reject(*id, why);
        }
        let mut accepted: HashMap<SeqId, (Accepted, Vec<usize>)> = resp
            .accepted
            .into_iter()
            .map(|(id, a, path)| (id, (a, path)))
            .collect();
        let mut prefilled = Vec::new();
        let mut decoded = Vec::new();
        for it in &self.items {
            match &it.work {
                Work::Prefill(t) => {
                    // A prefill whose forward failed was failed above.
                    if let Some(out) = self.outs.remove(&it.seq) {
                        prefilled.push(PrefillResult {
                            seq: it.seq,
                            tokens: t.len(),
                            logprobs: out.prompt_logprobs,
                            hidden: out.hidden,
                        });
                    }
                }
                Work::Decode { prefix, .. } => {
                    let (Some((a, path)), Some(out)) =
                        (accepted.remove(&it.seq), self.outs.remove(&it.seq))
                    else {
                        continue;
                    };
                    decoded.push(DecodeResult {
                        seq: it.seq,
                        drafted: out.rows.saturating_sub(1),
                        depth: self.depths.get(&it.seq).copied().unwrap_or(0),
                        source: self.sources.remove(&it.seq),
                        accepted: a,
                        path,
                        prefix: prefix.len(),
                        forced: self.forced_len.get(&it.seq).copied().unwrap_or(0),
                        hidden: out.hidden,
                    });
                }
            }
        }
        self.report.decode_seqs = decoded.len();
        self.report.prefill_seqs = prefilled.len();
        let committed = sched.commit(prefilled, decoded);
        sched.end_step();
        let free: Vec<SeqId> = committed.finished.iter().map(|c| c.id).collect();
        self.report.finished = committed.finished;
        metrics::histogram!("specd_batch_sequences", "proposer" => self.label.clone())
            .record((self.report.decode_seqs + self.report.prefill_seqs) as f64);
        metrics::histogram!("specd_batch_tokens", "proposer" => self.label)
            .record(self.report.batch_tokens as f64);
        metrics::gauge!("specd_running_sequences").set(sched.num_running() as f64);
        metrics::gauge!("specd_queue_length").set(sched.num_waiting() as f64);
        // Choices un-forked by this step's grant ran nothing: they hold
        // no cache, so whatever was reserved for their copy goes back.
        let mut lens = committed.lens;
        lens.extend(self.unforked.iter().map(|&id| (id, 0)));
        (CommitLens { lens, free }, self.report)
    }

    /// The step cannot complete (a stage is gone): its sequences fail and
    /// the deferred aborts apply.
    pub fn abandon(self, sched: &mut Scheduler, why: &str) {
        for it in &self.items {
            sched.fail(it.seq, why);
        }
        sched.end_step();
    }
}

// ------------------------------------------------------------ stage handlers

impl KvManager {
    /// Stage 2: free, then grant.
    pub fn handle_grant(&mut self, req: GrantRequest) -> Grant {
        for id in &req.release {
            self.free(*id);
        }
        kv_manager::grant(self, &req.wants, &req.idle)
    }

    /// After commit: lower each sequence to its committed length and free
    /// the finished ones.
    pub fn handle_commit(&mut self, msg: CommitLens) {
        for (id, len) in msg.lens {
            self.commit(id, Pool::Target, len);
        }
        for id in msg.free {
            self.free(id);
        }
        if let Some(u) = self.usage(Pool::Target) {
            metrics::gauge!("specd_kv_used_blocks").set(u.used_blocks as f64);
            metrics::gauge!("specd_kv_capacity_blocks").set(u.capacity_blocks as f64);
        }
    }
}

impl Drafter {
    /// Stage 3: observations, starts and releases first (in that order: a
    /// sequence admitted and preempted in one step ends up finished), then
    /// one propose call per proposer.
    pub fn handle(&mut self, req: DraftRequest) -> DraftResponse {
        let t = Instant::now();
        for o in &req.observe {
            self.observe(o.seq, &o.tokens, &o.path);
        }
        for (id, name, tokens) in &req.start {
            self.start(*id, name, tokens);
        }
        for id in &req.finish {
            self.finish(*id);
        }
        let inputs: Vec<ProposeInput<'_>> = req
            .inputs
            .iter()
            .map(|i| ProposeInput {
                seq: i.seq,
                tokens: &i.tokens,
                max_draft: i.max_draft,
                params: &i.params,
                hidden: &i.hidden,
                hidden_start: i.hidden_start,
            })
            .collect();
        // `propose` isolates each proposer; this guard only catches a bug of
        // the drafter itself, which then drafts nothing this step.
        let drafts = match catch_unwind(AssertUnwindSafe(|| self.propose(&inputs))) {
            Ok(d) => d,
            Err(p) => {
                tracing::error!(reason = %panic_message(&*p), "drafter panicked; this step decodes plainly");
                vec![Draft::default(); inputs.len()]
            }
        };
        let resp = DraftResponse {
            drafts: req.inputs.iter().map(|i| i.seq).zip(drafts).collect(),
            spent: self.take_spent(),
        };
        metrics::histogram!("specd_draft_seconds", "proposer" => req.label)
            .record(t.elapsed().as_secs_f64());
        resp
    }
}

impl Verifier {
    /// Stage 4: release, then one forward over every item, then trim the
    /// prefix cache (after the items took the cached blocks they were
    /// planned with); a forward that fails or panics fails its items
    /// (their caches are dropped).
    pub fn handle(&mut self, req: VerifyRequest) -> VerifyResponse {
        let t = Instant::now();
        self.release_caches(&req.release);
        let resp = match catch_unwind(AssertUnwindSafe(|| self.run(&req.items))) {
            Ok(r) => r,
            Err(p) => {
                let why = format!("verify panicked: {}", panic_message(&*p));
                tracing::error!("{why}");
                let ids: Vec<SeqId> = req.items.iter().map(|i| i.seq).collect();
                self.release(&ids);
                VerifyResponse {
                    outs: Vec::new(),
                    failed: ids.into_iter().map(|id| (id, why.clone())).collect(),
                    seconds: 0.0,
                }
            }
        };
        self.trim_prefix();
        let mut resp = resp;
        resp.seconds = t.elapsed().as_secs_f64();
        metrics::histogram!("specd_verify_seconds", "proposer" => req.label).record(resp.seconds);
        resp
    }
}

impl Acceptor {
    /// Stage 5: forget ended sequences, then accept each item on its own
    /// (a failure or panic fails that sequence only).
    pub fn handle(&mut self, req: AcceptRequest) -> AcceptResponse {
        let t = Instant::now();
        self.end(&req.ended);
        let mut resp = AcceptResponse::default();
        for it in &req.items {
            match catch_unwind(AssertUnwindSafe(|| self.accept_one(it))) {
                Ok(Ok((a, path))) => resp.accepted.push((it.seq, a, path)),
                // A constraint that no token can continue is the request's
                // own doing (a 400, not a server error).
                Ok(Err(e @ (SpecdError::InvalidRequest(_) | SpecdError::InvalidField { .. }))) => {
                    resp.rejected.push((it.seq, e.to_string()))
                }
                Ok(Err(e)) => resp.failed.push((it.seq, e.to_string())),
                Err(p) => resp.failed.push((
                    it.seq,
                    format!("acceptance panicked: {}", panic_message(&*p)),
                )),
            }
        }
        metrics::histogram!("specd_accept_seconds", "proposer" => req.label)
            .record(t.elapsed().as_secs_f64());
        resp
    }
}
