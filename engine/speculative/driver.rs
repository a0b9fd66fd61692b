//! The engine's sizing (`EngineConfig`) and `SyncDriver`, the synchronous
//! driver of the step defined in `pipeline` (the actor driver is in
//! `actors`).

use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use super::accept::Acceptor;
use super::drafter::Drafter;
use super::kv_manager::KvManager;
use super::pipeline::{Step, StepReport};
use super::runner::TargetRunner;
use super::scheduler::{Scheduler, SchedulerConfig};
use super::{Completion, Event, Request, SeqId};
use crate::error::Result;
use crate::model::Model;
use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// Target KV budget in blocks of `block_size` tokens.
    pub kv_blocks: usize,
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

    /// Defaults sized for `model`: KV for `max_running` full contexts of
    /// 2048 tokens (or the model's limit, if smaller).
    pub fn for_model(model: &Model) -> Self {
        let sched = SchedulerConfig {
            max_seq_len: model.config.max_seq_len,
            eos_token_ids: model.config.eos_token_ids.clone(),
            ..Default::default()
        };
        Self {
            kv_blocks: Self::kv_blocks_for(model, sched.max_running, 2048),
            scheduler: sched,
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
    pub verifier: TargetRunner,
    pub sampler: Acceptor,
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
        Self {
            steps: 0,
            scheduler: Scheduler::new(config.scheduler, tokenizer),
            kv: KvManager::new(crate::model::DEFAULT_BLOCK_SIZE, config.kv_blocks),
            drafter,
            verifier: TargetRunner::new(model),
            sampler: Acceptor::new(vocab),
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
        let draft_resp = self.drafter.handle(draft_req);
        let verify_req = step.drafted(draft_resp);
        let verify_resp = self.verifier.handle(verify_req);
        let accept_req = step.verified(&mut self.scheduler, verify_resp);
        let accept_resp = self.sampler.handle(accept_req);
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
