//! The verifier and sampler stage structs, the engine's sizing, and
//! `EngineCore`: the synchronous driver of the step defined in `pipeline`.
//!
//! Invariants:
//! - The verifier truncates each cache to the scheduler's `cache_len` before
//!   a forward, so rejected positions are rolled back before anything can
//!   read them; a cache shorter than the scheduler thinks is an error for
//!   that sequence, never a silent mismatch.
//! - Every stage sees one batched call per step.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use super::accept::{self, Acceptance, Accepted};
use super::kv_manager::KvManager;
use super::pipeline::{Step, StepReport, VerifyResponse};
use super::proposer::{Draft, Drafter};
use super::scheduler::{Scheduler, SchedulerConfig};
use super::{Completion, Event, Request, SeqId};
use crate::error::Result;
use crate::model::{KvCache, Logits, Model, SeqInput};
use crate::sampler::{Rng, SamplingParams};
use crate::tokenizer::Tokenizer;

/// One sequence's share of a verify forward.
#[derive(Debug, Clone)]
pub struct VerifyItem {
    pub seq: SeqId,
    /// The cache is truncated to this length first (rollback).
    pub cache_len: usize,
    pub tokens: Vec<u32>,
    pub logits: Logits,
    pub hidden_layers: Vec<usize>,
}

#[derive(Debug, Clone)]
pub struct VerifyOut {
    pub seq: SeqId,
    pub logits: Vec<f32>,
    pub rows: usize,
    pub hidden: Vec<(usize, Vec<f32>)>,
}

/// Owns the target model's per-sequence caches; one batched forward a step.
#[derive(Debug)]
pub struct Verifier {
    model: Arc<Model>,
    caches: HashMap<SeqId, KvCache>,
}

impl Verifier {
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            model,
            caches: HashMap::new(),
        }
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Drop the caches of these sequences.
    pub fn release(&mut self, ids: &[SeqId]) {
        for id in ids {
            self.caches.remove(id);
        }
    }

    /// Caches currently held (for tests and metrics).
    pub fn num_caches(&self) -> usize {
        self.caches.len()
    }

    pub fn cache_len(&self, id: SeqId) -> Option<usize> {
        self.caches.get(&id).map(|c| c.len())
    }

    /// One forward over `items`. An item whose cache cannot be rolled back
    /// to its `cache_len` (or that feeds no tokens) fails alone; a forward
    /// error fails every item of the forward (and no cache has advanced).
    pub fn run(&mut self, items: &[VerifyItem]) -> VerifyResponse {
        let mut resp = VerifyResponse::default();
        let mut layers: Vec<usize> = items
            .iter()
            .flat_map(|i| i.hidden_layers.iter().copied())
            .collect();
        layers.sort_unstable();
        layers.dedup();
        let mut seen = std::collections::HashSet::new();
        let mut run: Vec<&VerifyItem> = Vec::with_capacity(items.len());
        for it in items {
            if !seen.insert(it.seq) {
                resp.failed.push((
                    it.seq,
                    format!("sequence {} planned twice in one step", it.seq),
                ));
                continue;
            }
            if it.tokens.is_empty() {
                resp.failed
                    .push((it.seq, format!("sequence {}: nothing to verify", it.seq)));
                continue;
            }
            let model = &self.model;
            let c = self
                .caches
                .entry(it.seq)
                .or_insert_with(|| model.new_cache());
            if let Err(e) = c.truncate(it.cache_len) {
                resp.failed
                    .push((it.seq, format!("sequence {}: {e}", it.seq)));
                self.caches.remove(&it.seq);
                continue;
            }
            run.push(it);
        }
        // Take the caches out so the forward can borrow them mutably at once.
        let mut taken: Vec<(SeqId, KvCache)> = run
            .iter()
            .filter_map(|it| self.caches.remove(&it.seq).map(|c| (it.seq, c)))
            .collect();
        let result = {
            let mut inputs: Vec<SeqInput<'_>> = taken
                .iter_mut()
                .zip(&run)
                .map(|((_, c), it)| SeqInput {
                    cache: c,
                    tokens: &it.tokens,
                    logits: it.logits,
                    tree: None,
                })
                .collect();
            self.model.forward(&mut inputs, &layers)
        };
        for (id, c) in taken {
            self.caches.insert(id, c);
        }
        match result {
            Ok(outs) => {
                resp.outs = outs
                    .into_iter()
                    .zip(&run)
                    .map(|(o, it)| VerifyOut {
                        seq: it.seq,
                        logits: o.logits,
                        rows: o.rows,
                        hidden: o
                            .hidden
                            .into_iter()
                            .filter(|(l, _)| it.hidden_layers.contains(l))
                            .collect(),
                    })
                    .collect();
            }
            Err(e) => {
                let why = format!("forward failed: {e}");
                resp.failed
                    .extend(run.iter().map(|it| (it.seq, why.clone())));
            }
        }
        resp
    }
}

/// One sequence's acceptance input.
#[derive(Debug, Clone)]
pub struct AcceptItem {
    pub seq: SeqId,
    /// `(draft.len() + 1) x vocab` logits.
    pub rows: Vec<f32>,
    pub draft: Draft,
    pub params: SamplingParams,
    /// Committed tokens (prompt and output) for penalties.
    pub context: Vec<u32>,
    pub prompt_len: usize,
}

/// Turns logits into accepted tokens; owns each request's RNG.
#[derive(Debug)]
pub struct SamplerCore {
    vocab: usize,
    rngs: HashMap<SeqId, Rng>,
    pub acceptance: Acceptance,
}

impl SamplerCore {
    pub fn new(vocab: usize) -> Self {
        Self {
            vocab,
            rngs: HashMap::new(),
            acceptance: Acceptance::Exact,
        }
    }

    pub fn end(&mut self, ids: &[SeqId]) {
        for id in ids {
            self.rngs.remove(id);
        }
    }

    /// Accept one item's drafts with its request's RNG.
    pub fn accept_one(&mut self, it: &AcceptItem) -> Result<Accepted> {
        let rng = self
            .rngs
            .entry(it.seq)
            .or_insert_with(|| Rng::new(it.params.seed));
        accept::accept(
            &it.rows,
            self.vocab,
            &it.draft,
            &it.context,
            &it.context[it.prompt_len.min(it.context.len())..],
            &it.params,
            rng,
            self.acceptance,
        )
    }
}

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

/// The whole engine on one thread: every stage struct, stepped in order.
#[derive(Debug)]
pub struct EngineCore {
    pub scheduler: Scheduler,
    pub kv: KvManager,
    pub drafter: Drafter,
    pub verifier: Verifier,
    pub sampler: SamplerCore,
    steps: u64,
}

impl EngineCore {
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
            verifier: Verifier::new(model),
            sampler: SamplerCore::new(vocab),
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
        let (mut step, grant_req) = Step::plan(
            &mut self.scheduler,
            |n| drafter.capabilities(n).map(|c| c.max_draft),
            self.steps,
        );
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
