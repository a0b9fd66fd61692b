//! One engine step over the plain stage structs: draft -> verify -> accept ->
//! commit. `EngineCore` runs it synchronously (tests, batch runs); the
//! actors in `actors` run the same stage structs on their own threads.
//!
//! Invariants:
//! - The verifier truncates each cache to the scheduler's `cache_len` before
//!   a forward, so rejected positions are rolled back before anything can
//!   read them.
//! - Every stage sees one batched call per step.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use super::accept::{self, Accepted, Residual};
use super::kv_manager::{KvManager, Pool};
use super::proposer::{Draft, Drafter, ProposeInput};
use super::scheduler::{self, DecodeResult, Grant, PlanItem, Scheduler, SchedulerConfig, Work};
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

    pub fn run(&mut self, items: &[VerifyItem]) -> Result<Vec<VerifyOut>> {
        let mut layers: Vec<usize> = items
            .iter()
            .flat_map(|i| i.hidden_layers.iter().copied())
            .collect();
        layers.sort_unstable();
        layers.dedup();
        for it in items {
            let model = &self.model;
            let c = self
                .caches
                .entry(it.seq)
                .or_insert_with(|| model.new_cache());
            c.truncate(it.cache_len);
            debug_assert_eq!(
                c.len(),
                it.cache_len,
                "cache shorter than the scheduler thinks"
            );
        }
        // Take the caches out so the forward can borrow them mutably at once.
        let mut taken: Vec<(SeqId, KvCache)> = items
            .iter()
            .map(|it| (it.seq, self.caches.remove(&it.seq).expect("inserted above")))
            .collect();
        let result = {
            let mut inputs: Vec<SeqInput<'_>> = taken
                .iter_mut()
                .zip(items)
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
        let outs = result?;
        Ok(outs
            .into_iter()
            .zip(items)
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
            .collect())
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
    pub residual: Residual,
}

impl SamplerCore {
    pub fn new(vocab: usize) -> Self {
        Self {
            vocab,
            rngs: HashMap::new(),
            residual: Residual::Correct,
        }
    }

    pub fn end(&mut self, ids: &[SeqId]) {
        for id in ids {
            self.rngs.remove(id);
        }
    }

    pub fn run(&mut self, items: &[AcceptItem]) -> Vec<(SeqId, Accepted)> {
        items
            .iter()
            .map(|it| {
                let rng = self
                    .rngs
                    .entry(it.seq)
                    .or_insert_with(|| Rng::new(it.params.seed));
                let a = accept::accept(
                    &it.rows,
                    self.vocab,
                    &it.draft,
                    &it.context,
                    &it.context[it.prompt_len.min(it.context.len())..],
                    &it.params,
                    rng,
                    self.residual,
                );
                (it.seq, a)
            })
            .collect()
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

/// What one step did.
#[derive(Debug, Default)]
pub struct StepReport {
    pub batch_tokens: usize,
    pub decode_seqs: usize,
    pub prefill_seqs: usize,
    pub finished: Vec<Completion>,
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

/// Draft inputs for the decode items of a plan.
pub fn draft_inputs<'a>(sched: &'a Scheduler, items: &[PlanItem]) -> Vec<ProposeInput<'a>> {
    items
        .iter()
        .filter_map(|it| match &it.work {
            Work::Decode { max_draft, .. } => {
                let v = sched.seq_view(it.seq)?;
                Some(ProposeInput {
                    seq: it.seq,
                    tokens: v.tokens,
                    max_draft: *max_draft,
                    params: v.params,
                    hidden: v.hidden,
                })
            }
            Work::Prefill(_) => None,
        })
        .collect()
}

/// Verify items for a plan, with each decode item's drafts appended.
/// Tokens drafted for each decoding item (drafts align with the decode
/// items of the plan, in order).
pub fn drafted_lengths(items: &[PlanItem], drafts: &[Draft]) -> HashMap<SeqId, usize> {
    items
        .iter()
        .filter(|i| matches!(i.work, Work::Decode { .. }))
        .zip(drafts)
        .map(|(i, d)| (i.seq, d.tokens.len()))
        .collect()
}

pub fn verify_items(
    items: &[PlanItem],
    drafts: &[Draft],
    hidden: impl Fn(SeqId) -> Vec<usize>,
) -> Vec<VerifyItem> {
    let mut d = drafts.iter();
    items
        .iter()
        .map(|it| match &it.work {
            Work::Prefill(tokens) => VerifyItem {
                seq: it.seq,
                cache_len: it.cache_len,
                tokens: tokens.clone(),
                logits: Logits::None,
                hidden_layers: Vec::new(),
            },
            Work::Decode { last, .. } => {
                let draft = d.next().expect("one draft per decode item");
                let mut tokens = Vec::with_capacity(1 + draft.tokens.len());
                tokens.push(*last);
                tokens.extend_from_slice(&draft.tokens);
                VerifyItem {
                    seq: it.seq,
                    cache_len: it.cache_len,
                    tokens,
                    logits: Logits::All,
                    hidden_layers: hidden(it.seq),
                }
            }
        })
        .collect()
}

/// Acceptance inputs from verify outputs (decode items only).
pub fn accept_items(
    sched: &Scheduler,
    items: &[PlanItem],
    drafts: Vec<Draft>,
    outs: &mut [VerifyOut],
) -> Vec<AcceptItem> {
    let mut d = drafts.into_iter();
    let mut v = Vec::new();
    for (it, out) in items.iter().zip(outs.iter_mut()) {
        if let Work::Decode { .. } = it.work {
            let draft = d.next().expect("one draft per decode item");
            let Some(view) = sched.seq_view(it.seq) else {
                continue;
            };
            v.push(AcceptItem {
                seq: it.seq,
                rows: std::mem::take(&mut out.logits),
                draft,
                params: view.params.clone(),
                // Only penalties read the history; skip the copy otherwise.
                context: if view.params.has_penalties() {
                    view.tokens.to_vec()
                } else {
                    Vec::new()
                },
                prompt_len: sched.prompt_len(it.seq),
            });
        }
    }
    v
}

/// Split verify outputs and acceptances into the scheduler's commit input.
pub fn commit_inputs(
    items: &[PlanItem],
    outs: Vec<VerifyOut>,
    accepted: Vec<(SeqId, Accepted)>,
    drafted: &HashMap<SeqId, usize>,
) -> (Vec<(SeqId, usize)>, Vec<DecodeResult>) {
    let mut prefilled = Vec::new();
    let mut acc: HashMap<SeqId, Accepted> = accepted.into_iter().collect();
    let mut decoded = Vec::new();
    for (it, out) in items.iter().zip(outs) {
        match &it.work {
            Work::Prefill(t) => prefilled.push((it.seq, t.len())),
            Work::Decode { .. } => {
                if let Some(a) = acc.remove(&it.seq) {
                    decoded.push(DecodeResult {
                        seq: it.seq,
                        drafted: drafted.get(&it.seq).copied().unwrap_or(0),
                        accepted: a,
                        hidden: out.hidden,
                    });
                }
            }
        }
    }
    (prefilled, decoded)
}

/// The whole engine on one thread: every stage struct, stepped in order.
#[derive(Debug)]
pub struct EngineCore {
    pub scheduler: Scheduler,
    pub kv: KvManager,
    pub drafter: Drafter,
    pub verifier: Verifier,
    pub sampler: SamplerCore,
}

impl EngineCore {
    pub fn new(
        model: Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
        config: EngineConfig,
        drafter: Drafter,
    ) -> Self {
        let vocab = model.config.vocab_size;
        Self {
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

    /// Apply lifecycle changes (starts, then releases) to the stage structs.
    fn apply_lifecycle(&mut self) {
        let lc = self.scheduler.take_lifecycle();
        for (id, name, tokens) in lc.starts {
            self.drafter.start(id, &name, &tokens);
        }
        self.verifier.release(&lc.released);
        for &id in &lc.released {
            self.drafter.finish(id);
            self.kv.free(id);
        }
        self.sampler.end(&lc.ended);
    }

    pub fn step(&mut self) -> Result<StepReport> {
        // Free what finished or was aborted since the last step first.
        self.apply_lifecycle();
        let drafter = &self.drafter;
        let (items, wants) = self
            .scheduler
            .wants(|n| drafter.capabilities(n).map(|c| c.max_draft));
        let g: Grant = scheduler::grant(&mut self.kv, &wants);
        let items = self.scheduler.apply_grant(items, &g);
        self.apply_lifecycle();
        let mut report = StepReport::default();
        if items.is_empty() {
            return Ok(report);
        }
        let label = step_label(
            items
                .iter()
                .filter(|i| matches!(i.work, Work::Decode { .. }))
                .filter_map(|i| self.scheduler.get(i.seq))
                .map(|s| s.stats.proposer.as_str()),
        );
        let t0 = Instant::now();
        let inputs = draft_inputs(&self.scheduler, &items);
        let drafts = self.drafter.propose(&inputs);
        drop(inputs);
        let t1 = Instant::now();
        let drafted = drafted_lengths(&items, &drafts);
        let drafter = &self.drafter;
        let vitems = verify_items(&items, &drafts, |s| drafter.hidden_layers(s).to_vec());
        report.batch_tokens = vitems.iter().map(|v| v.tokens.len()).sum();
        let mut outs = match self.verifier.run(&vitems) {
            Ok(o) => o,
            Err(e) => {
                for it in &items {
                    self.scheduler.fail(it.seq, &e.to_string());
                }
                return Err(e);
            }
        };
        let t2 = Instant::now();
        let aitems = accept_items(&self.scheduler, &items, drafts, &mut outs);
        report.decode_seqs = aitems.len();
        report.prefill_seqs = items.len() - aitems.len();
        let accepted = self.sampler.run(&aitems);
        let t3 = Instant::now();
        let (prefilled, decoded) = commit_inputs(&items, outs, accepted, &drafted);
        let committed = self.scheduler.commit(&prefilled, decoded);
        for &(id, len) in &committed.lens {
            self.kv.commit(id, Pool::Target, len);
        }
        for (id, toks) in &committed.observed {
            self.drafter.observe(*id, toks);
        }
        record_stage_metrics(
            &label,
            t1 - t0,
            t2 - t1,
            t3 - t2,
            &report,
            &self.kv,
            &self.scheduler,
        );
        report.finished = committed.finished;
        Ok(report)
    }

    /// Step until every queued request has finished.
    pub fn run_to_completion(&mut self) -> Result<Vec<Completion>> {
        let mut done = Vec::new();
        while !self.scheduler.is_idle() {
            done.extend(self.step()?.finished);
        }
        // Release the last finished sequences' resources.
        self.apply_lifecycle();
        Ok(done)
    }
}

pub fn record_stage_metrics(
    label: &str,
    draft: std::time::Duration,
    verify: std::time::Duration,
    sample: std::time::Duration,
    report: &StepReport,
    kv: &KvManager,
    sched: &Scheduler,
) {
    let l = label.to_string();
    metrics::histogram!("specd_draft_seconds", "proposer" => l.clone()).record(draft.as_secs_f64());
    metrics::histogram!("specd_verify_seconds", "proposer" => l.clone())
        .record(verify.as_secs_f64());
    metrics::histogram!("specd_sample_seconds", "proposer" => l.clone())
        .record(sample.as_secs_f64());
    metrics::histogram!("specd_batch_sequences", "proposer" => l.clone())
        .record((report.decode_seqs + report.prefill_seqs) as f64);
    metrics::histogram!("specd_batch_tokens", "proposer" => l).record(report.batch_tokens as f64);
    if let Some(u) = kv.usage(Pool::Target) {
        metrics::gauge!("specd_kv_used_blocks").set(u.used_blocks as f64);
        metrics::gauge!("specd_kv_capacity_blocks").set(u.capacity_blocks as f64);
    }
    metrics::gauge!("specd_running_sequences").set(sched.num_running() as f64);
    metrics::gauge!("specd_queue_length").set(sched.num_waiting() as f64);
}
