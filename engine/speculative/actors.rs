//! Actix shells around the stage structs: the actor driver of the step
//! defined in `pipeline`. Compute actors (draft, verify, sample) run on their
//! own threads (`SyncArbiter`), so no forward ever blocks the async reactor;
//! the scheduler and KV manager are async actors. Each stage gets one
//! message per step, carrying the whole batch and the step's tracing span
//! (which follows from every request's span).
//!
//! Invariants:
//! - The actors hold no logic of their own beyond message plumbing: every
//!   stage message is a `pipeline` request answered by the same `handle_*`
//!   method `SyncDriver` calls, and the scheduler advances the same `Step`.
//! - One step is in flight at a time; aborts that arrive while it awaits a
//!   stage are deferred by the scheduler until the step commits.
//! - Supervision: a stage that fails for some sequences fails only those
//!   (the handlers catch panics). A stage that is gone (its mailbox closed)
//!   or a panic in the scheduler's own bookkeeping cannot be recovered from:
//!   every live request ends with an error event, `EngineHealth` records the
//!   failure (so `/health` and `/ready` answer 503) and the daemon exits
//!   non-zero for its supervisor to restart it.
//! - A reload (`Reload`) is applied between steps: the scheduler renames the
//!   sequences whose proposer is replaced to the old instance's retired key
//!   and updates its capability map, then sends `Swap` to the draft actor,
//!   whose mailbox orders it before the next step's draft request.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::accept::Acceptor;
use super::drafter::{Drafter, ProposerListing, ProposerSet};
use super::driver::EngineConfig;
use super::kv_manager::Grant;
use super::kv_manager::{KvManager, Pool, PoolUsage, WindowCost};
use super::pipeline::{
    AcceptRequest, AcceptResponse, CommitLens, DraftRequest, DraftResponse, GrantRequest, Step,
    VerifyRequest, VerifyResponse,
};
use super::proposer::Capabilities;
use super::scheduler::{Scheduler, SchedulerConfig};
use super::verify::Verifier;
use super::{Event, Request, SeqId};
use crate::error::{panic_message, Result, SpecdError};
use crate::model::Model;
use crate::tokenizer::Tokenizer;

/// A pipeline request with the step's tracing span.
pub struct Staged<R> {
    pub req: R,
    pub span: tracing::Span,
}

impl Message for Staged<DraftRequest> {
    type Result = DraftResponse;
}
impl Message for Staged<VerifyRequest> {
    type Result = VerifyResponse;
}
impl Message for Staged<AcceptRequest> {
    type Result = AcceptResponse;
}
impl Message for GrantRequest {
    type Result = Grant;
}
impl Message for CommitLens {
    type Result = ();
}

// ------------------------------------------------------------ verify

pub struct VerifyActor {
    verifier: Verifier,
    /// Fault injection for supervision tests (see `failpoint`).
    die_at: Option<u64>,
    calls: u64,
}

impl Actor for VerifyActor {
    type Context = SyncContext<Self>;
}

impl Handler<Staged<VerifyRequest>> for VerifyActor {
    type Result = MessageResult<Staged<VerifyRequest>>;
    fn handle(&mut self, msg: Staged<VerifyRequest>, _: &mut Self::Context) -> Self::Result {
        let _e = msg.span.enter();
        self.calls += 1;
        if self.die_at == Some(self.calls) {
            // Outside every guard: the stage thread dies, as an escaped bug
            // or a crashed thread would.
            panic!(
                "failpoint verify-thread-panic reached at call {}",
                self.calls
            );
        }
        MessageResult(self.verifier.handle(msg.req))
    }
}

/// `SPECD_FAILPOINT=verify-thread-panic:N` makes the verify stage's thread
/// die on its N-th batch, so tests can check that an unrecoverable engine
/// fails its requests, answers 503 and exits non-zero. Unset in production.
fn failpoint() -> Option<u64> {
    std::env::var("SPECD_FAILPOINT")
        .ok()?
        .strip_prefix("verify-thread-panic:")?
        .parse()
        .ok()
}

// ------------------------------------------------------------ draft

pub struct DraftActor {
    drafter: Drafter,
}

impl Actor for DraftActor {
    type Context = SyncContext<Self>;
}

impl Handler<Staged<DraftRequest>> for DraftActor {
    type Result = MessageResult<Staged<DraftRequest>>;
    fn handle(&mut self, msg: Staged<DraftRequest>, _: &mut Self::Context) -> Self::Result {
        let _e = msg.span.enter();
        MessageResult(self.drafter.handle(msg.req))
    }
}

/// Shadow proposers' scores.
#[derive(Message)]
#[rtype(result = "Vec<(String, super::SpecStats)>")]
pub struct GetShadowStats;

impl Handler<GetShadowStats> for DraftActor {
    type Result = MessageResult<GetShadowStats>;
    fn handle(&mut self, _: GetShadowStats, _: &mut Self::Context) -> Self::Result {
        MessageResult(self.drafter.shadow_stats())
    }
}

/// Replace the proposer set (see `Drafter::swap`).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Swap {
    pub set: ProposerSet,
    pub retire: Vec<(SeqId, String)>,
}

impl Handler<Swap> for DraftActor {
    type Result = ();
    fn handle(&mut self, msg: Swap, _: &mut Self::Context) {
        self.drafter.swap(msg.set, &msg.retire);
    }
}

/// Every proposer, for `GET /v1/admin/proposers`.
#[derive(Message)]
#[rtype(result = "Vec<ProposerListing>")]
pub struct ListProposers;

impl Handler<ListProposers> for DraftActor {
    type Result = MessageResult<ListProposers>;
    fn handle(&mut self, _: ListProposers, _: &mut Self::Context) -> Self::Result {
        MessageResult(self.drafter.list())
    }
}

// ------------------------------------------------------------ sample

pub struct AcceptActor {
    core: Acceptor,
}

impl Actor for AcceptActor {
    type Context = SyncContext<Self>;
}

impl Handler<Staged<AcceptRequest>> for AcceptActor {
    type Result = MessageResult<Staged<AcceptRequest>>;
    fn handle(&mut self, msg: Staged<AcceptRequest>, ctx: &mut Self::Context) -> Self::Result {
        let _e = msg.span.enter();
        let resp = self.core.handle(msg.req);
        // Queued before the reply goes out, so it runs while the next
        // step drafts and verifies, ahead of that step's acceptance.
        if self.core.wants_prefetch() {
            ctx.address().do_send(Prefetch);
        }
        MessageResult(resp)
    }
}

/// Compute the next masks of sampled constrained sequences off the
/// critical path (`Acceptor::prefetch`).
#[derive(Message)]
#[rtype(result = "()")]
struct Prefetch;

impl Handler<Prefetch> for AcceptActor {
    type Result = ();
    fn handle(&mut self, _: Prefetch, _: &mut Self::Context) {
        self.core.prefetch();
    }
}

// ------------------------------------------------------------ KV manager

pub struct KvManagerActor {
    kv: KvManager,
}

impl Actor for KvManagerActor {
    type Context = Context<Self>;
}

impl Handler<GrantRequest> for KvManagerActor {
    type Result = MessageResult<GrantRequest>;
    fn handle(&mut self, msg: GrantRequest, _: &mut Self::Context) -> Self::Result {
        MessageResult(self.kv.handle_grant(msg))
    }
}

impl Handler<CommitLens> for KvManagerActor {
    type Result = ();
    fn handle(&mut self, msg: CommitLens, _: &mut Self::Context) {
        self.kv.handle_commit(msg);
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

// ------------------------------------------------------------ health

/// Whether the engine can still serve; set once, when it cannot.
#[derive(Debug, Default)]
pub struct EngineHealth {
    failure: OnceLock<String>,
}

impl EngineHealth {
    /// Why the engine stopped serving, if it did.
    pub fn failure(&self) -> Option<&str> {
        self.failure.get().map(String::as_str)
    }

    fn fail(&self, why: &str) {
        if self.failure.set(why.to_string()).is_ok() {
            tracing::error!(reason = why, "engine failed; it cannot recover");
            metrics::gauge!("specd_engine_failed").set(1.0);
        }
    }
}

// ------------------------------------------------------------ scheduler

pub struct SchedulerActor {
    scheduler: Scheduler,
    /// Proposer name -> capabilities (known proposers).
    caps: HashMap<String, Capabilities>,
    kv: Addr<KvManagerActor>,
    draft: Addr<DraftActor>,
    verify: Addr<VerifyActor>,
    acceptor: Addr<AcceptActor>,
    /// The step in flight, between its stage messages.
    step: Option<Step>,
    steps: u64,
    health: Arc<EngineHealth>,
    /// Names a reload removed: requests already routed to one decode
    /// plainly instead of failing.
    removed: std::collections::HashSet<String>,
    /// Reloads applied so far (the retired keys' suffix).
    generation: u64,
    /// A reload that arrived during a step, applied when it commits.
    pending_reload: Vec<(Reload, tokio::sync::oneshot::Sender<ReloadOutcome>)>,
}

/// Swap in a new proposer set between steps.
#[derive(Message)]
#[rtype(result = "std::result::Result<ReloadOutcome, String>")]
pub struct Reload {
    pub set: ProposerSet,
    /// Every routable name after the reload.
    pub names: Vec<String>,
}

/// What a reload did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReloadOutcome {
    pub generation: u64,
    /// Running sequences that keep a replaced instance until they end.
    pub retired_sequences: usize,
    /// Running sequences whose proposer was removed (now plain).
    pub orphaned_sequences: usize,
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
#[rtype(result = "std::collections::BTreeMap<String, super::SpecStats>")]
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
        if self.health.failure().is_some() {
            return Err(SpecdError::EngineStopped);
        }
        let (caps, removed) = (&self.caps, &self.removed);
        let id = self.scheduler.add(msg.req, Some(msg.sink), |n| {
            (caps.contains_key(n) && !n.contains('@')) || removed.contains(n)
        })?;
        self.kick(ctx);
        Ok(id)
    }
}

impl Handler<Reload> for SchedulerActor {
    type Result = ResponseFuture<std::result::Result<ReloadOutcome, String>>;
    fn handle(&mut self, msg: Reload, ctx: &mut Self::Context) -> Self::Result {
        if self.health.failure().is_some() {
            return Box::pin(async { Err("the engine has failed".to_string()) });
        }
        if self.step.is_none() {
            let out = self.apply_reload(msg);
            self.kick(ctx);
            return Box::pin(async move { Ok(out) });
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.pending_reload.push((msg, tx));
        Box::pin(async move {
            rx.await
                .map_err(|_| "the engine stopped before the reload".to_string())
        })
    }
}

impl Handler<Abort> for SchedulerActor {
    type Result = bool;
    fn handle(&mut self, msg: Abort, ctx: &mut Self::Context) -> bool {
        // Deferred by the scheduler while a step is in flight.
        let ok = self.scheduler.abort(msg.0);
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

/// Run a scheduler-side transition, turning a panic into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    catch_unwind(AssertUnwindSafe(f))
        .map_err(|p| format!("scheduler {what} panicked: {}", panic_message(&*p)))
}

impl SchedulerActor {
    /// Apply a reload now (no step in flight).
    fn apply_reload(&mut self, msg: Reload) -> ReloadOutcome {
        self.generation += 1;
        let gen = self.generation;
        let Reload { set, names } = msg;
        let replaced: std::collections::HashSet<String> =
            set.proposers.iter().map(|p| p.name().to_string()).collect();
        let mut out = ReloadOutcome {
            generation: gen,
            ..Default::default()
        };
        let mut retire = Vec::new();
        for (seq, key) in self.scheduler.running_proposers() {
            if replaced.contains(&key) && self.caps.contains_key(&key) {
                let to = format!("{key}@{gen}");
                if let Some(c) = self.caps.get(&key).cloned() {
                    self.caps.insert(to.clone(), c);
                }
                self.scheduler.retire(seq, &to);
                retire.push((seq, to));
                out.retired_sequences += 1;
            } else if !names.contains(&key) && !key.contains('@') {
                out.orphaned_sequences += 1;
            }
        }
        for n in self.caps.keys() {
            if !n.contains('@') && !names.contains(n) {
                self.removed.insert(n.clone());
            }
        }
        for n in &names {
            self.removed.remove(n);
        }
        // Capabilities: kept names as they were, new instances', retired.
        let mut caps: HashMap<String, Capabilities> = self
            .caps
            .iter()
            .filter(|(k, _)| (set.keep.contains(k) && !replaced.contains(*k)) || k.contains('@'))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for p in &set.proposers {
            caps.insert(p.name().to_string(), p.capabilities());
        }
        // Retired keys nobody drafts with any more.
        let in_use: std::collections::HashSet<String> = self
            .scheduler
            .running_proposers()
            .into_iter()
            .map(|(_, k)| k)
            .collect();
        caps.retain(|k, _| !k.contains('@') || in_use.contains(k));
        self.caps = caps;
        self.draft.do_send(Swap { set, retire });
        out
    }

    /// Reloads that waited for the step to commit.
    fn apply_pending_reloads(&mut self) {
        for (msg, tx) in std::mem::take(&mut self.pending_reload) {
            let out = self.apply_reload(msg);
            let _ = tx.send(out);
        }
    }

    /// The engine cannot go on: fail everything and record why.
    fn fatal(&mut self, why: String) {
        self.step = None;
        // Waiting reloads hear that the engine stopped.
        self.pending_reload.clear();
        self.health.fail(&why);
        let msg = format!("engine failed: {why}");
        let _ = catch_unwind(AssertUnwindSafe(|| self.scheduler.fail_all(&msg)));
    }

    /// A stage's reply, or the engine's end if the stage is gone.
    fn reply<T>(
        &mut self,
        stage: &str,
        r: std::result::Result<T, MailboxError>,
    ) -> Option<(Step, T)> {
        let step = self.step.take()?;
        match r {
            Ok(v) => Some((step, v)),
            Err(e) => {
                self.fatal(format!("the {stage} stage is gone ({e})"));
                None
            }
        }
    }

    /// Start a step if there is work and none is running.
    fn kick(&mut self, ctx: &mut Context<Self>) {
        if self.step.is_some() || self.health.failure().is_some() || self.scheduler.is_idle() {
            return;
        }
        self.steps += 1;
        let (caps, n) = (&self.caps, self.steps);
        let sched = &mut self.scheduler;
        let planned = guarded("plan", || Step::plan(sched, |p| caps.get(p), n));
        let (step, req) = match planned {
            Ok(x) => x,
            Err(why) => return self.fatal(why),
        };
        self.step = Some(step);
        ctx.spawn(
            self.kv
                .send(req)
                .into_actor(self)
                .map(|r, act, ctx| act.on_granted(r, ctx)),
        );
    }

    fn on_granted(&mut self, r: std::result::Result<Grant, MailboxError>, ctx: &mut Context<Self>) {
        let Some((mut step, grant)) = self.reply("KV manager", r) else {
            return;
        };
        let sched = &mut self.scheduler;
        let req = match guarded("grant", || step.granted(sched, grant)) {
            Ok(r) => r,
            Err(why) => return self.fatal(why),
        };
        let span = step.span().clone();
        self.step = Some(step);
        ctx.spawn(
            self.draft
                .send(Staged { req, span })
                .into_actor(self)
                .map(|r, act, ctx| act.on_drafted(r, ctx)),
        );
    }

    fn on_drafted(
        &mut self,
        r: std::result::Result<DraftResponse, MailboxError>,
        ctx: &mut Context<Self>,
    ) {
        let Some((mut step, resp)) = self.reply("draft", r) else {
            return;
        };
        let req = match guarded("draft result", || step.drafted(resp)) {
            Ok(r) => r,
            Err(why) => return self.fatal(why),
        };
        let span = step.span().clone();
        self.step = Some(step);
        ctx.spawn(
            self.verify
                .send(Staged { req, span })
                .into_actor(self)
                .map(|r, act, ctx| act.on_verified(r, ctx)),
        );
    }

    fn on_verified(
        &mut self,
        r: std::result::Result<VerifyResponse, MailboxError>,
        ctx: &mut Context<Self>,
    ) {
        let Some((mut step, resp)) = self.reply("verify", r) else {
            return;
        };
        let sched = &mut self.scheduler;
        let req = match guarded("verify result", || step.verified(sched, resp)) {
            Ok(r) => r,
            Err(why) => return self.fatal(why),
        };
        let span = step.span().clone();
        self.step = Some(step);
        ctx.spawn(
            self.acceptor
                .send(Staged { req, span })
                .into_actor(self)
                .map(|r, act, ctx| act.on_accepted(r, ctx)),
        );
    }

    fn on_accepted(
        &mut self,
        r: std::result::Result<AcceptResponse, MailboxError>,
        ctx: &mut Context<Self>,
    ) {
        let Some((step, resp)) = self.reply("accept", r) else {
            return;
        };
        let sched = &mut self.scheduler;
        let lens = match guarded("commit", || step.commit(sched, resp)) {
            Ok((lens, _report)) => lens,
            Err(why) => return self.fatal(why),
        };
        // Ordered before the next step's grant (same sender, same mailbox).
        self.kv.do_send(lens);
        self.apply_pending_reloads();
        self.kick(ctx);
    }
}

// ------------------------------------------------------------ handle

/// Everything needed to start the engine's actors.
pub struct EngineParts {
    pub model: Arc<Model>,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub config: EngineConfig,
    pub drafter: Drafter,
}

/// Scores by arm or proposer name.
pub type ScoreMap = std::collections::BTreeMap<String, super::SpecStats>;

/// A cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    pub scheduler: Addr<SchedulerActor>,
    pub kv: Addr<KvManagerActor>,
    pub draft: Addr<DraftActor>,
    pub health: Arc<EngineHealth>,
}

impl EngineHandle {
    /// Start the actors on the current actix system.
    pub fn start(parts: EngineParts) -> Self {
        let EngineParts {
            model,
            tokenizer,
            config,
            mut drafter,
        } = parts;
        let caps: HashMap<String, Capabilities> = drafter
            .names()
            .into_iter()
            .filter_map(|n| drafter.capabilities(&n).map(|c| (n.clone(), c.clone())))
            .collect();
        let vocab = model.config.vocab_size;
        drafter.set_vocab(vocab);
        // Each SyncArbiter factory runs once (one thread per stage).
        let window = WindowCost::of(&model.config.kv_layout(crate::model::DEFAULT_BLOCK_SIZE));
        let kv_manager = KvManager::for_model(&model, config.kv_blocks);
        let prefix_blocks = config.prefix_cache_blocks;
        let verifier = Verifier::new(model.clone()).with_prefix_cache(prefix_blocks);
        let prefix_probe = verifier.prefix_probe();
        let verifier = std::sync::Mutex::new(Some(verifier));
        let die_at = failpoint();
        let verify = SyncArbiter::start(1, move || VerifyActor {
            verifier: verifier
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .unwrap_or_else(|| Verifier::new(model.clone()).with_prefix_cache(prefix_blocks)),
            die_at,
            calls: 0,
        });
        let drafter = std::sync::Mutex::new(Some(drafter));
        let draft = SyncArbiter::start(1, move || DraftActor {
            drafter: drafter
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .unwrap_or_default(),
        });
        let acceptor = SyncArbiter::start(1, move || AcceptActor {
            core: Acceptor::new(vocab),
        });
        let kv = KvManagerActor { kv: kv_manager }.start();
        let health = Arc::new(EngineHealth::default());
        let mut config = config;
        config.scheduler.max_seq_len = config.served_max_seq_len();
        let mut sched = Scheduler::new(config.scheduler, tokenizer);
        sched.set_prefix_probe(prefix_probe);
        sched.set_windowed(window.is_some());
        let scheduler = SchedulerActor {
            scheduler: sched,
            caps,
            kv: kv.clone(),
            draft: draft.clone(),
            verify,
            acceptor,
            step: None,
            steps: 0,
            health: health.clone(),
            removed: Default::default(),
            generation: 0,
            pending_reload: Vec::new(),
        }
        .start();
        Self {
            scheduler,
            kv,
            draft,
            health,
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

    /// Whether the engine answers within `timeout` and has not failed:
    /// `Err` says why not.
    pub async fn ping(&self, timeout: Duration) -> std::result::Result<SchedulerStats, String> {
        if let Some(why) = self.health.failure() {
            return Err(why.to_string());
        }
        match tokio::time::timeout(timeout, self.scheduler.send(GetStats)).await {
            Ok(Ok(s)) => match self.health.failure() {
                Some(why) => Err(why.to_string()),
                None => Ok(s),
            },
            Ok(Err(e)) => Err(format!("the scheduler is gone ({e})")),
            Err(_) => Err(format!("the scheduler did not answer within {timeout:?}")),
        }
    }

    /// Swap in a new proposer set between steps (see `Reload`).
    pub async fn reload(
        &self,
        set: ProposerSet,
        names: Vec<String>,
    ) -> std::result::Result<ReloadOutcome, String> {
        self.scheduler
            .send(Reload { set, names })
            .await
            .map_err(|e| format!("the scheduler is gone ({e})"))?
    }

    /// Every proposer the draft stage holds.
    pub async fn proposers(&self) -> Option<Vec<ProposerListing>> {
        self.draft.send(ListProposers).await.ok()
    }

    pub async fn kv_usage(&self) -> Option<PoolUsage> {
        self.kv.send(KvUsage).await.ok().flatten()
    }
}

/// Scheduler settings shared by callers that build an engine.
pub fn scheduler_config_for(model: &Model) -> SchedulerConfig {
    EngineConfig::for_model(model).scheduler
}
