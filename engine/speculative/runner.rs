//! The verify stage's struct, `TargetRunner`: the target model's caches and
//! one batched forward per step.
//!
//! Invariants:
//! - Each cache is truncated to the scheduler's `cache_len` before a
//!   forward, so rejected positions are rolled back before anything can
//!   read them; a cache shorter than the scheduler thinks fails that
//!   sequence (an error, never a silent mismatch).
//! - A forward error fails every item of the forward, and no cache has
//!   advanced.

use std::collections::HashMap;
use std::sync::Arc;

use super::SeqId;
use crate::model::{ForwardInput, KvCache, Logits, Model, TreeMask};

/// One sequence's share of a verify forward.
#[derive(Debug, Clone)]
pub struct VerifyItem {
    pub seq: SeqId,
    /// The cache is truncated to this length first (rollback).
    pub cache_len: usize,
    pub tokens: Vec<u32>,
    pub logits: Logits,
    /// Hidden-state layers to return, in this order.
    pub hidden_layers: Vec<usize>,
    /// Attention among `tokens` for a tree draft (`None`: causal).
    pub tree: Option<TreeMask>,
    /// Slot moves applied before the truncation: the previous tree
    /// verify's accepted path, packed after the committed prefix.
    pub moves: Vec<(usize, usize)>,
}

#[derive(Debug, Clone)]
pub struct VerifyOut {
    pub seq: SeqId,
    pub logits: Vec<f32>,
    pub rows: usize,
    pub hidden: Vec<(usize, Vec<f32>)>,
}

/// Stage 4 output: one result per verified item, or why it failed.
#[derive(Debug, Clone, Default)]
pub struct VerifyResponse {
    pub outs: Vec<VerifyOut>,
    /// Sequences the verifier could not run, and why.
    pub failed: Vec<(SeqId, String)>,
}

/// The verify stage's struct: owns the target model's per-sequence caches
/// and runs every target forward of a step in one batch (prefill chunks
/// and draft verification alike).
#[derive(Debug)]
pub struct TargetRunner {
    model: Arc<Model>,
    caches: HashMap<SeqId, KvCache>,
}

impl TargetRunner {
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
            if let Err(e) = c.compact(&it.moves).and_then(|_| c.truncate(it.cache_len)) {
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
            let mut inputs: Vec<ForwardInput<'_>> = taken
                .iter_mut()
                .zip(&run)
                .map(|((_, c), it)| ForwardInput {
                    cache: c,
                    tokens: &it.tokens,
                    logits: it.logits,
                    tree: it.tree.as_ref(),
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
                    .map(|(o, it)| {
                        // The item's layers, in the order it asked for them.
                        let mut hidden = o.hidden;
                        let hidden = it
                            .hidden_layers
                            .iter()
                            .filter_map(|l| {
                                let k = hidden.iter().position(|(hl, _)| hl == l)?;
                                Some(hidden.swap_remove(k))
                            })
                            .collect();
                        VerifyOut {
                            seq: it.seq,
                            logits: o.logits,
                            rows: o.rows,
                            hidden,
                        }
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
