//! The engine's sizing (`EngineConfig`) and `SyncDriver`, the synchronous
//! driver of the step defined in `pipeline` (the actor driver is in
//! `actors`).

use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use super::accept::Acceptor;
use super::drafter::Drafter;
use super::kv_manager::{KvManager, WindowCost};
use super::pipeline::{Step, StepReport};
use super::scheduler::{Scheduler, SchedulerConfig};
use super::verify::Verifier;
use super::{Completion, Event, Request, SeqId};
use crate::error::Result;
use crate::model::Model;
use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// Target KV budget in blocks of `block_size` tokens.
    pub kv_blocks: usize,
    /// Most prompt blocks kept for reuse across requests (0: no prefix
    /// cache). Blocks in use count against `kv_blocks` through their
    /// sequences; idle cached blocks are memory beyond it.
    pub prefix_cache_blocks: usize,
}

impl EngineConfig {
    /// KV blocks for `running` sequences of up to `context` tokens each
    /// (capped at the model's context).
    pub fn kv_blocks_for(model: &Model, running: usize, context: usize) -> usize {
        model
            .config
            .max_seq_len
            .min(context)
            .div_ceil(crate::model::DEFAULT_BLOCK_SIZE)
            * running
    }

    /// The longest sequence this engine serves: the scheduler's limit,
    /// capped at what the whole KV budget holds (a longer request could
    /// only fail after its prefill, having evicted every other on the
    /// way). Both drivers apply it, so every way of building an engine
    /// refuses such a request when it is added.
    pub fn served_max_seq_len(&self) -> usize {
        self.scheduler.max_seq_len.min(
            self.kv_blocks
                .saturating_mul(crate::model::DEFAULT_BLOCK_SIZE),
        )
    }

    /// Defaults sized for `model`: KV for `max_running` full contexts of
    /// 2048 tokens (or the model's limit, if smaller).
    pub fn for_model(model: &Model) -> Self {
        let sched = SchedulerConfig {
            max_seq_len: model.config.max_seq_len,
            eos_token_ids: model.config.eos_token_ids.clone(),
            ..Default::default()
        };
        let kv_blocks = Self::kv_blocks_for(model, sched.max_running, 2048);
        Self {
            kv_blocks,
            prefix_cache_blocks: kv_blocks / 4,
            scheduler: sched,
        }
    }
}

/// Wall time spent in each stage, for cost reports (`specd ab`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageTimes {
    pub steps: u64,
    pub draft_s: f64,
    pub verify_s: f64,
    pub accept_s: f64,
    /// Decode-only steps (`Step::decode_only`) by the tokens their verify
    /// forward fed:
    /// tokens -> (steps, verify seconds, draft seconds).
    pub by_tokens: std::collections::BTreeMap<usize, (u64, f64, f64)>,
}

impl StageTimes {
    /// What was spent since `earlier` (a snapshot of the same driver).
    pub fn since(&self, earlier: &StageTimes) -> StageTimes {
        let mut by_tokens = self.by_tokens.clone();
        for (k, (n, v, d)) in &earlier.by_tokens {
            if let Some(e) = by_tokens.get_mut(k) {
                e.0 -= n;
                e.1 -= v;
                e.2 -= d;
            }
        }
        by_tokens.retain(|_, e| e.0 > 0);
        StageTimes {
            steps: self.steps - earlier.steps,
            draft_s: self.draft_s - earlier.draft_s,
            verify_s: self.verify_s - earlier.verify_s,
            accept_s: self.accept_s - earlier.accept_s,
            by_tokens,
        }
    }
}

/// The synchronous driver: every stage struct on one thread, the
/// pipeline's stages called in order (tests, `specd ab`, batch runs).
#[derive(Debug)]
pub struct SyncDriver {
    pub scheduler: Scheduler,
    pub kv: KvManager,
    pub drafter: Drafter,
    pub verifier: Verifier,
    pub acceptor: Acceptor,
    /// Time per stage since the driver was made.
    pub times: StageTimes,
    steps: u64,
}

impl SyncDriver {
    pub fn new(
        model: Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
        config: EngineConfig,
        drafter: Drafter,
    ) -> Self {
        let vocab = model.config.vocab_size;
        let mut drafter = drafter;
        drafter.set_vocab(vocab);
        let window = WindowCost::of(&model.config.kv_layout(crate::model::DEFAULT_BLOCK_SIZE));
        let kv = KvManager::for_model(&model, config.kv_blocks);
        let verifier = Verifier::new(model).with_prefix_cache(config.prefix_cache_blocks);
        let mut config = config;
        config.scheduler.max_seq_len = config.served_max_seq_len();
        let mut scheduler = Scheduler::new(config.scheduler, tokenizer);
        scheduler.set_prefix_probe(verifier.prefix_probe());
        scheduler.set_windowed(window.is_some());
        Self {
            steps: 0,
            times: StageTimes::default(),
            scheduler,
            kv,
            drafter,
            verifier,
            acceptor: Acceptor::new(vocab),
        }
    }

    pub fn add(&mut self, req: Request, sink: Option<UnboundedSender<Event>>) -> Result<SeqId> {
        let drafter = &self.drafter;
        self.scheduler.add(req, sink, |n| drafter.has(n))
    }

    pub fn abort(&mut self, id: SeqId) -> bool {
        self.scheduler.abort(id)
    }

    /// One step: the pipeline's stages called in order on this thread.
    pub fn step(&mut self) -> Result<StepReport> {
        self.steps += 1;
        let drafter = &self.drafter;
        let (mut step, grant_req) =
            Step::plan(&mut self.scheduler, |n| drafter.capabilities(n), self.steps);
        let grant = self.kv.handle_grant(grant_req);
        let draft_req = step.granted(&mut self.scheduler, grant);
        let _span = step.span().clone().entered();
        let t = std::time::Instant::now();
        let draft_resp = self.drafter.handle(draft_req);
        let draft_s = t.elapsed().as_secs_f64();
        let decode_only = step.decode_only();
        let verify_req = step.drafted(draft_resp);
        let fed: usize = verify_req.items.iter().map(|i| i.tokens.len()).sum();
        let t = std::time::Instant::now();
        let verify_resp = self.verifier.handle(verify_req);
        let verify_s = t.elapsed().as_secs_f64();
        let accept_req = step.verified(&mut self.scheduler, verify_resp);
        let t = std::time::Instant::now();
        let accept_resp = self.acceptor.handle(accept_req);
        let tm = &mut self.times;
        tm.steps += 1;
        tm.draft_s += draft_s;
        tm.verify_s += verify_s;
        tm.accept_s += t.elapsed().as_secs_f64();
        if decode_only {
            let e = tm.by_tokens.entry(fed).or_default();
            e.0 += 1;
            e.1 += verify_s;
            e.2 += draft_s;
        }
        let (lens, report) = step.commit(&mut self.scheduler, accept_resp);
        self.kv.handle_commit(lens);
        Ok(report)
    }

    /// Step until every queued request has finished and every stage has
    /// heard about it.
    pub fn run_to_completion(&mut self) -> Result<Vec<Completion>> {
        let mut done = Vec::new();
        while !self.scheduler.is_idle() {
            done.extend(self.step()?.finished);
        }
        Ok(done)
    }
}
