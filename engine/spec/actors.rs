//! Actix shells around the stage structs. Compute actors (draft, verify,
//! sample) run on their own threads (`SyncArbiter`), so no forward ever
//! blocks the async reactor; the scheduler and KV manager are async actors.
//! Each stage gets one message per step, carrying the whole batch and the
//! step's tracing span (which follows from every request's span).
//!
//! Invariant: the actors hold no logic of their own beyond message plumbing;
//! everything they do is a call into the structs that `EngineCore` tests.

use std::collections::HashMap;
use std::sync::Arc;

use actix::prelude::*;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::accept::Accepted;
use super::engine::{self, AcceptItem, SamplerCore, StepReport, Verifier, VerifyItem, VerifyOut};
use super::kv_manager::{KvManager, Pool, PoolUsage};
use super::proposer::{Draft, Drafter, ProposeInput};
use super::scheduler::{self, Grant, Scheduler, SchedulerConfig, Want, Work};
use super::{Event, Request, SeqId};
use crate::error::{Result, SpecdError};
use crate::model::Model;
use crate::sampler::SamplingParams;
use crate::tokenizer::Tokenizer;

// ------------------------------------------------------------ verify

pub struct VerifyActor {
    verifier: Verifier,
}

impl Actor for VerifyActor {
    type Context = SyncContext<Self>;
}

#[derive(Message)]
#[rtype(result = "Result<Vec<VerifyOut>>")]
pub struct VerifyBatch {
    /// Proposer label for this step's timing metrics.
    pub label: String,
    pub release: Vec<SeqId>,
    pub items: Vec<VerifyItem>,
    pub span: tracing::Span,
}

impl Handler<VerifyBatch> for VerifyActor {
    type Result = Result<Vec<VerifyOut>>;
    fn handle(&mut self, msg: VerifyBatch, _: &mut Self::Context) -> Self::Result {
        let _e = msg.span.enter();
        let t = std::time::Instant::now();
        self.verifier.release(&msg.release);
        let r = self.verifier.run(&msg.items);
        metrics::histogram!("specd_verify_seconds", "proposer" => msg.label)
            .record(t.elapsed().as_secs_f64());
        r
    }
}

// ------------------------------------------------------------ draft

pub struct DraftActor {
    drafter: Drafter,
}

impl Actor for DraftActor {
    type Context = SyncContext<Self>;
}

/// One sequence's owned draft input.
#[derive(Debug, Clone)]
pub struct DraftInput {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
    pub max_draft: usize,
    pub params: SamplingParams,
    pub hidden: Vec<(usize, Vec<f32>)>,
}

#[derive(Message)]
#[rtype(result = "(Vec<Draft>, HashMap<SeqId, Vec<usize>>)")]
pub struct DraftBatch {
    /// Proposer label for this step's timing metrics.
    pub label: String,
    pub finish: Vec<SeqId>,
    pub start: Vec<(SeqId, String, Vec<u32>)>,
    pub observe: Vec<(SeqId, Vec<u32>)>,
    pub inputs: Vec<DraftInput>,
    pub span: tracing::Span,
}

impl Handler<DraftBatch> for DraftActor {
    type Result = MessageResult<DraftBatch>;
    fn handle(&mut self, msg: DraftBatch, _: &mut Self::Context) -> Self::Result {
        let _e = msg.span.enter();
        let t = std::time::Instant::now();
        // Observations from the last commit first (a finished sequence's
        // last tokens arrive with its release), then starts, then releases
        // (a sequence admitted and preempted in one step ends up finished).
        for (id, toks) in &msg.observe {
            self.drafter.observe(*id, toks);
        }
        for (id, name, tokens) in &msg.start {
            self.drafter.start(*id, name, tokens);
        }
        for id in &msg.finish {
            self.drafter.finish(*id);
        }
        let inputs: Vec<ProposeInput<'_>> = msg
            .inputs
            .iter()
            .map(|i| ProposeInput {
                seq: i.seq,
                tokens: &i.tokens,
                max_draft: i.max_draft,
                params: &i.params,
                hidden: &i.hidden,
            })
            .collect();
        let drafts = self.drafter.propose(&inputs);
        let hidden = msg
            .inputs
            .iter()
            .map(|i| (i.seq, self.drafter.hidden_layers(i.seq).to_vec()))
            .collect();
        metrics::histogram!("specd_draft_seconds", "proposer" => msg.label)
            .record(t.elapsed().as_secs_f64());
        MessageResult((drafts, hidden))
    }
}

/// Shadow proposers' scores.
#[derive(Message)]
#[rtype(result = "Vec<(String, super::ScoreCard)>")]
pub struct GetShadowStats;

impl Handler<GetShadowStats> for DraftActor {
    type Result = MessageResult<GetShadowStats>;
    fn handle(&mut self, _: GetShadowStats, _: &mut Self::Context) -> Self::Result {
        MessageResult(self.drafter.shadow_stats())
    }
}

// ------------------------------------------------------------ sample

pub struct SamplerActor {
    core: SamplerCore,
}

impl Actor for SamplerActor {
    type Context = SyncContext<Self>;
}

#[derive(Message)]
#[rtype(result = "Vec<(SeqId, Accepted)>")]
pub struct AcceptBatch {
    /// Proposer label for this step's timing metrics.
    pub label: String,
    pub ended: Vec<SeqId>,
    pub items: Vec<AcceptItem>,
    pub span: tracing::Span,
}

impl Handler<AcceptBatch> for SamplerActor {
    type Result = MessageResult<AcceptBatch>;
    fn handle(&mut self, msg: AcceptBatch, _: &mut Self::Context) -> Self::Result {
        let _e = msg.span.enter();
        let t = std::time::Instant::now();
        self.core.end(&msg.ended);
        let r = self.core.run(&msg.items);
        metrics::histogram!("specd_sample_seconds", "proposer" => msg.label)
            .record(t.elapsed().as_secs_f64());
        MessageResult(r)
    }
}

// ------------------------------------------------------------ KV manager

pub struct KvManagerActor {
    kv: KvManager,
}

impl Actor for KvManagerActor {
    type Context = Context<Self>;
}

/// Free `release`, then grant `wants` (evicting lower-priority holders).
#[derive(Message)]
#[rtype(result = "Grant")]
pub struct GrantWants {
    pub release: Vec<SeqId>,
    pub wants: Vec<Want>,
}

impl Handler<GrantWants> for KvManagerActor {
    type Result = MessageResult<GrantWants>;
    fn handle(&mut self, msg: GrantWants, _: &mut Self::Context) -> Self::Result {
        for id in &msg.release {
            self.kv.free(*id);
        }
        MessageResult(scheduler::grant(&mut self.kv, &msg.wants))
    }
}

/// Committed lengths after a step; finished sequences are freed.
#[derive(Message)]
#[rtype(result = "()")]
pub struct CommitLens {
    pub lens: Vec<(SeqId, usize)>,
    pub free: Vec<SeqId>,
}

impl Handler<CommitLens> for KvManagerActor {
    type Result = ();
    fn handle(&mut self, msg: CommitLens, _: &mut Self::Context) {
        for (id, len) in msg.lens {
            self.kv.commit(id, Pool::Target, len);
        }
        for id in msg.free {
            self.kv.free(id);
        }
        if let Some(u) = self.kv.usage(Pool::Target) {
            metrics::gauge!("specd_kv_used_blocks").set(u.used_blocks as f64);
            metrics::gauge!("specd_kv_capacity_blocks").set(u.capacity_blocks as f64);
        }
    }
}

#[derive(Message)]
#[rtype(result = "Option<PoolUsage>")]
pub struct KvUsage;

impl Handler<KvUsage> for KvManagerActor {
    type Result = MessageResult<KvUsage>;
    fn handle(&mut self, _: KvUsage, _: &mut Self::Context) -> Self::Result {
        MessageResult(self.kv.usage(Pool::Target))
    }
}

// ------------------------------------------------------------ scheduler

pub struct SchedulerActor {
    scheduler: Scheduler,
    /// Proposer name -> max draft (known proposers).
    caps: HashMap<String, usize>,
    kv: Addr<KvManagerActor>,
    draft: Addr<DraftActor>,
    verify: Addr<VerifyActor>,
    sampler: Addr<SamplerActor>,
    stepping: bool,
    steps: u64,
    spans: HashMap<SeqId, tracing::Span>,
    pending_observe: Vec<(SeqId, Vec<u32>)>,
}

impl Actor for SchedulerActor {
    type Context = Context<Self>;
}

#[derive(Message)]
#[rtype(result = "Result<SeqId>")]
pub struct Submit {
    pub req: Request,
    pub sink: UnboundedSender<Event>,
}

#[derive(Message)]
#[rtype(result = "bool")]
pub struct Abort(pub SeqId);

/// Counts for health and metrics endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerStats {
    pub waiting: usize,
    pub running: usize,
    pub steps: u64,
}

#[derive(Message)]
#[rtype(result = "SchedulerStats")]
pub struct GetStats;

/// Live totals per A/B arm.
#[derive(Message)]
#[rtype(result = "std::collections::BTreeMap<String, super::ScoreCard>")]
pub struct GetArmStats;

impl Handler<GetArmStats> for SchedulerActor {
    type Result = MessageResult<GetArmStats>;
    fn handle(&mut self, _: GetArmStats, _: &mut Self::Context) -> Self::Result {
        MessageResult(self.scheduler.arm_stats().clone())
    }
}

impl Handler<Submit> for SchedulerActor {
    type Result = Result<SeqId>;
    fn handle(&mut self, msg: Submit, ctx: &mut Self::Context) -> Self::Result {
        let caps = &self.caps;
        let id = self
            .scheduler
            .add(msg.req, Some(msg.sink), |n| caps.contains_key(n))?;
        self.spans.insert(id, tracing::info_span!("request", id));
        self.kick(ctx);
        Ok(id)
    }
}

impl Handler<Abort> for SchedulerActor {
    type Result = bool;
    fn handle(&mut self, msg: Abort, ctx: &mut Self::Context) -> bool {
        let ok = self.scheduler.abort(msg.0);
        self.spans.remove(&msg.0);
        self.kick(ctx);
        ok
    }
}

impl Handler<GetStats> for SchedulerActor {
    type Result = MessageResult<GetStats>;
    fn handle(&mut self, _: GetStats, _: &mut Self::Context) -> Self::Result {
        MessageResult(SchedulerStats {
            waiting: self.scheduler.num_waiting(),
            running: self.scheduler.num_running(),
            steps: self.steps,
        })
    }
}

fn fail_all(sched: &mut Scheduler, ids: &[SeqId], why: &str) {
    for &id in ids {
        sched.fail(id, why);
    }
}

impl SchedulerActor {
    fn step_span(&self, ids: &[SeqId]) -> tracing::Span {
        let span = tracing::debug_span!("step", n = self.steps, seqs = ids.len());
        for id in ids {
            if let Some(s) = self.spans.get(id) {
                span.follows_from(s);
            }
        }
        span
    }

    /// Start a step if there is work and none is running.
    fn kick(&mut self, ctx: &mut Context<Self>) {
        if self.stepping || self.scheduler.is_idle() {
            return;
        }
        self.stepping = true;
        self.steps += 1;
        let caps = self.caps.clone();
        let (items, wants) = self.scheduler.wants(|n| caps.get(n).copied());
        // Finished and aborted sequences (and admissions) known before the
        // grant: their blocks are freed first.
        let early = self.scheduler.take_lifecycle();
        let fut = self
            .kv
            .send(GrantWants {
                release: early.released.clone(),
                wants,
            })
            .into_actor(self)
            .then(move |grant, act, _ctx| {
                let grant = grant.unwrap_or_default();
                let items = act.scheduler.apply_grant(items, &grant);
                let lc = act.scheduler.take_lifecycle();
                let mut release = early.released;
                release.extend(lc.released.iter().copied());
                let mut ended = early.ended;
                ended.extend(lc.ended.iter().copied());
                let mut starts = early.starts;
                starts.extend(lc.starts);
                let ids: Vec<SeqId> = items.iter().map(|i| i.seq).collect();
                let span = act.step_span(&ids);
                let label = engine::step_label(
                    items
                        .iter()
                        .filter(|i| matches!(i.work, Work::Decode { .. }))
                        .filter_map(|i| act.scheduler.get(i.seq))
                        .map(|s| s.stats.proposer.as_str()),
                );
                let inputs: Vec<DraftInput> = engine::draft_inputs(&act.scheduler, &items)
                    .into_iter()
                    .map(|p| DraftInput {
                        seq: p.seq,
                        tokens: p.tokens.to_vec(),
                        max_draft: p.max_draft,
                        params: p.params.clone(),
                        hidden: p.hidden.to_vec(),
                    })
                    .collect();
                let msg = DraftBatch {
                    finish: release.clone(),
                    start: starts,
                    observe: std::mem::take(&mut act.pending_observe),
                    inputs,
                    span: span.clone(),
                    label: label.clone(),
                };
                act.draft
                    .send(msg)
                    .into_actor(act)
                    .map(move |drafts, _act, _ctx| (drafts, items, release, ended, span, label))
            })
            .then(|(drafts, items, release, ended, span, label), act, _ctx| {
                let (drafts, hidden) = drafts.unwrap_or_else(|_| {
                    let n = items
                        .iter()
                        .filter(|i| matches!(i.work, Work::Decode { .. }))
                        .count();
                    (vec![Draft::default(); n], HashMap::new())
                });
                let vitems = engine::verify_items(&items, &drafts, |s| {
                    hidden.get(&s).cloned().unwrap_or_default()
                });
                act.verify
                    .send(VerifyBatch {
                        release,
                        items: vitems,
                        span: span.clone(),
                        label: label.clone(),
                    })
                    .into_actor(act)
                    .map(move |outs, _act, _ctx| (outs, drafts, items, ended, span, label))
            })
            .then(|(outs, drafts, items, ended, span, label), act, _ctx| {
                let ids: Vec<SeqId> = items.iter().map(|i| i.seq).collect();
                let outs = match outs {
                    Ok(Ok(o)) => o,
                    Ok(Err(e)) => {
                        fail_all(&mut act.scheduler, &ids, &e.to_string());
                        Vec::new()
                    }
                    Err(e) => {
                        fail_all(&mut act.scheduler, &ids, &e.to_string());
                        Vec::new()
                    }
                };
                let ok = !outs.is_empty() || items.is_empty();
                let mut outs = outs;
                let drafted = engine::drafted_lengths(&items, &drafts);
                let aitems = if ok {
                    engine::accept_items(&act.scheduler, &items, drafts, &mut outs)
                } else {
                    Vec::new()
                };
                act.sampler
                    .send(AcceptBatch {
                        ended,
                        items: aitems,
                        span,
                        label,
                    })
                    .into_actor(act)
                    .map(move |acc, _act, _ctx| (acc, outs, items, drafted, ok))
            })
            .map(|(acc, outs, items, drafted, ok), act, ctx| {
                if ok {
                    let accepted = acc.unwrap_or_default();
                    let (prefilled, decoded) =
                        engine::commit_inputs(&items, outs, accepted, &drafted);
                    let report = StepReport {
                        batch_tokens: 0,
                        decode_seqs: decoded.len(),
                        prefill_seqs: prefilled.len(),
                        finished: Vec::new(),
                    };
                    let committed = act.scheduler.commit(&prefilled, decoded);
                    let free: Vec<SeqId> = committed.finished.iter().map(|c| c.id).collect();
                    for id in &free {
                        act.spans.remove(id);
                    }
                    act.kv.do_send(CommitLens {
                        lens: committed.lens,
                        free,
                    });
                    act.pending_observe.extend(committed.observed);
                    metrics::histogram!("specd_batch_sequences", "proposer" => "all")
                        .record((report.decode_seqs + report.prefill_seqs) as f64);
                    metrics::gauge!("specd_running_sequences")
                        .set(act.scheduler.num_running() as f64);
                }
                act.stepping = false;
                act.kick(ctx);
            });
        ctx.spawn(fut);
    }
}

// ------------------------------------------------------------ handle

/// Everything needed to start the engine's actors.
pub struct EngineParts {
    pub model: Arc<Model>,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub config: engine::EngineConfig,
    pub drafter: Drafter,
}

/// Scores by arm or proposer name.
pub type ScoreMap = std::collections::BTreeMap<String, super::ScoreCard>;

/// A cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    pub scheduler: Addr<SchedulerActor>,
    pub kv: Addr<KvManagerActor>,
    pub draft: Addr<DraftActor>,
}

impl EngineHandle {
    /// Start the actors on the current actix system.
    pub fn start(parts: EngineParts) -> Self {
        let EngineParts {
            model,
            tokenizer,
            config,
            drafter,
        } = parts;
        let caps: HashMap<String, usize> = drafter
            .names()
            .into_iter()
            .filter_map(|n| drafter.capabilities(&n).map(|c| (n.clone(), c.max_draft)))
            .collect();
        let vocab = model.config.vocab_size;
        let verifier = std::sync::Mutex::new(Some(Verifier::new(model)));
        let verify = SyncArbiter::start(1, move || VerifyActor {
            verifier: verifier
                .lock()
                .expect("once")
                .take()
                .expect("one verify actor"),
        });
        let drafter = std::sync::Mutex::new(Some(drafter));
        let draft = SyncArbiter::start(1, move || DraftActor {
            drafter: drafter
                .lock()
                .expect("once")
                .take()
                .expect("one draft actor"),
        });
        let sampler = SyncArbiter::start(1, move || SamplerActor {
            core: SamplerCore::new(vocab),
        });
        let kv = KvManagerActor {
            kv: KvManager::new(crate::model::DEFAULT_BLOCK_SIZE, config.kv_blocks),
        }
        .start();
        let scheduler = SchedulerActor {
            scheduler: Scheduler::new(config.scheduler, tokenizer),
            caps,
            kv: kv.clone(),
            draft: draft.clone(),
            verify,
            sampler,
            stepping: false,
            steps: 0,
            spans: HashMap::new(),
            pending_observe: Vec::new(),
        }
        .start();
        Self {
            scheduler,
            kv,
            draft,
        }
    }

    /// Live per-arm totals and shadow proposers' scores.
    pub async fn spec_stats(&self) -> Option<(ScoreMap, ScoreMap)> {
        let arms = self.scheduler.send(GetArmStats).await.ok()?;
        let shadows = self.draft.send(GetShadowStats).await.ok()?;
        Some((arms, shadows.into_iter().collect()))
    }

    /// Queue a request; its events arrive on the returned receiver.
    pub async fn submit(&self, req: Request) -> Result<(SeqId, UnboundedReceiver<Event>)> {
        let (tx, rx) = unbounded_channel();
        let id = self
            .scheduler
            .send(Submit { req, sink: tx })
            .await
            .map_err(|_| SpecdError::EngineStopped)??;
        Ok((id, rx))
    }

    pub async fn abort(&self, id: SeqId) -> bool {
        self.scheduler.send(Abort(id)).await.unwrap_or(false)
    }

    pub async fn stats(&self) -> Option<SchedulerStats> {
        self.scheduler.send(GetStats).await.ok()
    }

    pub async fn kv_usage(&self) -> Option<PoolUsage> {
        self.kv.send(KvUsage).await.ok().flatten()
    }
}

/// Scheduler settings shared by callers that build an engine.
pub fn scheduler_config_for(model: &Model) -> SchedulerConfig {
    engine::EngineConfig::for_model(model).scheduler
}
