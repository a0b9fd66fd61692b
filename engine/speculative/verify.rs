//! The verify stage's struct, `Verifier`: the target model's caches and
//! one batched forward per step.
//!
//! Invariants:
//! - Each cache is truncated to the scheduler's `cache_len` before a
//!   forward, so rejected positions are rolled back before anything can
//!   read them; a cache shorter than the scheduler thinks fails that
//!   sequence (an error, never a silent mismatch).
//! - A forward error fails every item of the forward, and no cache has
//!   advanced.
//! - With a prefix cache, a prefill chunk first takes the cached full
//!   blocks that follow its sequence's prefix (exact token match) and the
//!   forward computes only the rest; the chunk's full blocks are then
//!   offered to the cache. Only chunks that want no hidden states and at
//!   most their last row's logits (a prefill's last chunk without drafts,
//!   whose last token is always computed) take part (a proposer fed hidden states must see every
//!   position computed), and a sequence stops taking part at its first
//!   other step. The KV of a position is the same bits however it was
//!   batched, so outputs do not depend on hits.

use std::collections::HashMap;
use std::sync::Arc;

use super::hidden::HiddenRows;
use super::prefix_cache::{PrefixCache, PrefixProbe};
use super::SeqId;
use crate::model::{ForwardInput, KvCache, Logits, Model, TreeMask};

/// A sequence's walk along the prefix cache.
#[derive(Debug, Default)]
struct Chain {
    /// Id of the entry for the last full block walked (0: none yet).
    parent: u64,
    /// Full blocks walked (cached or inserted).
    blocks: usize,
    /// Tokens of the block being filled.
    partial: Vec<u32>,
    /// Whether the sequence still takes part (prefill chunks only).
    live: bool,
}

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
    /// A new cache starts as a copy-on-write copy of this sequence's.
    pub fork_from: Option<SeqId>,
    /// Prefill with prompt logprobs: (alternatives, the token each fed
    /// position predicts); the forward then keeps every row's logits and
    /// the runner reduces them to log-probabilities.
    pub prompt_logprobs: Option<(usize, Vec<u32>)>,
    /// Keep the sliding-window entries a query at this position reads,
    /// whatever the cache's length (a forked choice will copy it there).
    pub keep_window_from: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct VerifyOut {
    pub seq: SeqId,
    pub logits: Vec<f32>,
    pub rows: usize,
    pub hidden: HiddenRows,
    /// Log-probabilities of the tokens a prefill's positions predict.
    pub prompt_logprobs: Vec<super::TokenLogprob>,
}

/// Stage 4 output: one result per verified item, or why it failed.
#[derive(Debug, Clone, Default)]
pub struct VerifyResponse {
    pub outs: Vec<VerifyOut>,
    /// Sequences the verifier could not run, and why.
    pub failed: Vec<(SeqId, String)>,
    /// Wall time of the stage (the scheduler's cost model learns from it).
    pub seconds: f64,
}

/// The verify stage's struct: owns the target model's per-sequence caches
/// and runs every target forward of a step in one batch (prefill chunks
/// and draft verification alike).
#[derive(Debug)]
pub struct Verifier {
    model: Arc<Model>,
    caches: HashMap<SeqId, KvCache>,
    prefix: Option<PrefixCache>,
    chains: HashMap<SeqId, Chain>,
    /// Prefill tokens that could use the prefix cache, and those it covered.
    prefix_query: u64,
    prefix_hit: u64,
    /// Tokens fed through target forwards so far.
    forwarded: u64,
    /// Blocks' sliding-window parts released so far.
    window_released: u64,
}

impl Verifier {
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            model,
            caches: HashMap::new(),
            prefix: None,
            chains: HashMap::new(),
            prefix_query: 0,
            prefix_hit: 0,
            forwarded: 0,
            window_released: 0,
        }
    }

    /// Reuse prompt blocks across sequences, keeping at most `blocks`
    /// cached blocks (0: no prefix cache).
    pub fn with_prefix_cache(mut self, blocks: usize) -> Self {
        self.prefix = (blocks > 0).then(|| PrefixCache::new(blocks));
        self
    }

    /// The prefix cache's view for the scheduler (`None`: no cache).
    pub fn prefix_probe(&self) -> Option<PrefixProbe> {
        self.prefix.as_ref().map(PrefixCache::probe)
    }

    /// Blocks in the prefix cache (in use or idle).
    pub fn prefix_cached_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixCache::len)
    }

    /// Blocks' sliding-window parts released so far (memory a model with
    /// sliding-window layers gives back as its sequences grow).
    pub fn window_released_blocks(&self) -> u64 {
        self.window_released
    }

    /// Tokens fed through target forwards so far (prefill and verify).
    pub fn forwarded_tokens(&self) -> u64 {
        self.forwarded
    }

    /// (prefill tokens that looked in the prefix cache, tokens it covered).
    pub fn prefix_stats(&self) -> (u64, u64) {
        (self.prefix_query, self.prefix_hit)
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Drop the caches of these sequences (and trim the prefix cache).
    pub fn release(&mut self, ids: &[SeqId]) {
        self.release_caches(ids);
        self.trim_prefix();
    }

    /// Drop the caches of these sequences, leaving the prefix cache's
    /// entries they held in place until `trim_prefix`.
    pub(super) fn release_caches(&mut self, ids: &[SeqId]) {
        for id in ids {
            self.caches.remove(id);
            self.chains.remove(id);
        }
    }

    /// Back within the prefix cache's capacity where entries no cache
    /// holds allow it. A step trims after its forward: blocks the step
    /// was planned to take from the cache, whose only holders it released,
    /// are taken first (evicted before, they would be computed again,
    /// over the step's prefill budget).
    pub(super) fn trim_prefix(&mut self) {
        if let Some(p) = &mut self.prefix {
            p.trim();
            metrics::gauge!("specd_prefix_cache_blocks").set(p.len() as f64);
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
            if !self.caches.contains_key(&it.seq) {
                // A forked choice starts from its parent's cache (blocks
                // shared, copy-on-write); the truncation below drops what
                // the parent has past the prompt.
                let c = it
                    .fork_from
                    .and_then(|p| self.caches.get(&p).cloned())
                    .unwrap_or_else(|| self.model.new_cache());
                self.caches.insert(it.seq, c);
            }
            let Some(c) = self.caches.get_mut(&it.seq) else {
                continue;
            };
            if let Err(e) = c.compact(&it.moves).and_then(|_| c.truncate(it.cache_len)) {
                resp.failed
                    .push((it.seq, format!("sequence {}: {e}", it.seq)));
                self.caches.remove(&it.seq);
                continue;
            }
            run.push(it);
        }
        // Prefix cache: cached blocks instead of computing them.
        let skips: Vec<usize> = run.iter().map(|it| self.take_cached(it)).collect();
        // Sliding-window entries no query from here on reads (or a fork
        // still to copy) go.
        for it in &run {
            if let Some(c) = self.caches.get_mut(&it.seq) {
                let from = it.keep_window_from.unwrap_or(usize::MAX).min(c.len());
                self.window_released += c.release_window(from) as u64;
            }
        }
        // Take the caches out so the forward can borrow them mutably at once
        // (items the cache covered entirely need no forward).
        let fwd: Vec<(&VerifyItem, usize)> = run
            .iter()
            .zip(&skips)
            .filter(|(it, &k)| k < it.tokens.len())
            .map(|(it, &k)| (*it, k))
            .collect();
        let mut taken: Vec<(SeqId, KvCache)> = fwd
            .iter()
            .filter_map(|(it, _)| self.caches.remove(&it.seq).map(|c| (it.seq, c)))
            .collect();
        // A tree whose prefix came from the cache: the mask of the rest.
        let trees: Vec<Option<std::borrow::Cow<'_, TreeMask>>> = fwd
            .iter()
            .map(|(it, k)| {
                it.tree.as_ref().map(|t| {
                    if *k == 0 {
                        std::borrow::Cow::Borrowed(t)
                    } else {
                        std::borrow::Cow::Owned(t.after_prefix(*k))
                    }
                })
            })
            .collect();
        let result = {
            let mut inputs: Vec<ForwardInput<'_>> = taken
                .iter_mut()
                .zip(&fwd)
                .zip(&trees)
                .map(|(((_, c), (it, k)), tree)| ForwardInput {
                    cache: c,
                    tokens: &it.tokens[*k..],
                    logits: it.logits,
                    tree: tree.as_deref(),
                })
                .collect();
            self.forwarded += inputs.iter().map(|i| i.tokens.len() as u64).sum::<u64>();
            if inputs.is_empty() {
                Ok(Vec::new())
            } else {
                self.model.forward(&mut inputs, &layers)
            }
        };
        for (id, c) in taken {
            self.caches.insert(id, c);
        }
        let result = result.map(|outs| {
            let mut outs = outs.into_iter();
            run.iter()
                .zip(&skips)
                .map(|(it, &k)| {
                    if k < it.tokens.len() {
                        outs.next().unwrap_or_default()
                    } else {
                        crate::model::ForwardOutput::default()
                    }
                })
                .collect::<Vec<_>>()
        });
        match &result {
            Ok(_) => {
                for (it, &k) in run.iter().zip(&skips) {
                    self.offer_blocks(it, k);
                }
            }
            Err(_) => {
                for it in &run {
                    if let Some(ch) = self.chains.get_mut(&it.seq) {
                        ch.live = false;
                    }
                }
            }
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
                        let mut logits = o.logits;
                        let prompt_logprobs = match &it.prompt_logprobs {
                            // The first `next.len()` rows (a chunk may
                            // run past the prompt after a preemption).
                            Some((k, next)) if o.rows >= next.len() && o.rows > 0 => {
                                let v = logits.len() / o.rows;
                                let lps = next
                                    .iter()
                                    .enumerate()
                                    .map(|(r, &t)| {
                                        super::TokenLogprob::of(&logits[r * v..(r + 1) * v], t, *k)
                                    })
                                    .collect();
                                logits = Vec::new();
                                lps
                            }
                            _ => Vec::new(),
                        };
                        VerifyOut {
                            seq: it.seq,
                            logits,
                            rows: o.rows,
                            hidden,
                            prompt_logprobs,
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

    /// Whether `it` may use the prefix cache: a prefill chunk of a
    /// sequence that has done nothing else, or the chain step that ends
    /// its prefill (`Logits::Tail`: the rest of the prompt, its last token
    /// and drafts; it ends the chain).
    fn chain_for(&mut self, it: &VerifyItem) -> Option<&mut Chain> {
        self.prefix.as_ref()?;
        let eligible = matches!(it.logits, Logits::None | Logits::Last | Logits::Tail(_))
            && it.hidden_layers.is_empty()
            && (it.tree.is_none() || matches!(it.logits, Logits::Tail(_)))
            && it.moves.is_empty();
        let ch = self.chains.entry(it.seq).or_default();
        if it.cache_len == 0 {
            // A fresh start (or a recompute after preemption).
            *ch = Chain {
                live: true,
                ..Chain::default()
            };
        }
        if !eligible {
            ch.live = false;
        }
        ch.live.then_some(ch)
    }

    /// Put the cached blocks that continue `it`'s prefix into its cache;
    /// returns how many of its tokens they cover.
    fn take_cached(&mut self, it: &VerifyItem) -> usize {
        let bs = crate::model::DEFAULT_BLOCK_SIZE;
        let Some(ch) = self.chain_for(it) else {
            return 0;
        };
        if !ch.partial.is_empty() || ch.blocks * bs != it.cache_len {
            return 0;
        }
        let (mut parent, mut blocks) = (ch.parent, ch.blocks);
        let (Some(prefix), Some(c)) = (self.prefix.as_mut(), self.caches.get_mut(&it.seq)) else {
            return 0;
        };
        if c.len() != it.cache_len {
            return 0;
        }
        let mut skip = 0;
        // The rows whose logits are wanted are computed.
        let keep = it.logits.rows_at_end(it.tokens.len());
        while skip + bs + keep <= it.tokens.len()
            && it.tree.as_ref().is_none_or(|t| t.skippable(skip + bs))
        {
            let Some((id, block)) = prefix.lookup(parent, &it.tokens[skip..skip + bs]) else {
                break;
            };
            if c.push_shared(&block).is_err() {
                break;
            }
            parent = id;
            blocks += 1;
            skip += bs;
        }
        metrics::counter!("specd_prefix_cache_query_tokens_total")
            .increment(it.tokens.len() as u64);
        metrics::counter!("specd_prefix_cache_hit_tokens_total").increment(skip as u64);
        self.prefix_query += it.tokens.len() as u64;
        self.prefix_hit += skip as u64;
        metrics::gauge!("specd_prefix_cache_hit_rate")
            .set(self.prefix_hit as f64 / self.prefix_query.max(1) as f64);
        if let Some(ch) = self.chains.get_mut(&it.seq) {
            ch.parent = parent;
            ch.blocks = blocks;
        }
        skip
    }

    /// After a successful forward: offer `it`'s newly completed full
    /// blocks (its tokens past the `skip` cached ones) to the prefix cache.
    fn offer_blocks(&mut self, it: &VerifyItem, skip: usize) {
        let bs = crate::model::DEFAULT_BLOCK_SIZE;
        let Some(ch) = self.chains.get_mut(&it.seq).filter(|c| c.live) else {
            return;
        };
        let (Some(prefix), Some(c)) = (self.prefix.as_mut(), self.caches.get(&it.seq)) else {
            return;
        };
        // A chain step commits its prefix and root whatever is accepted
        // of its drafts; nothing after it is a prefill chunk.
        let (end, ends_chain) = match it.logits {
            Logits::Tail(n) => (it.tokens.len().saturating_sub(n.saturating_sub(1)), true),
            _ => (it.tokens.len(), false),
        };
        ch.partial.extend_from_slice(&it.tokens[skip.min(end)..end]);
        if ends_chain {
            ch.live = false;
        }
        while ch.partial.len() >= bs {
            let Some(block) = c.share_block(ch.blocks) else {
                ch.live = false;
                return;
            };
            let tokens: Vec<u32> = ch.partial.drain(..bs).collect();
            ch.parent = prefix.insert(ch.parent, tokens, block);
            ch.blocks += 1;
        }
        metrics::gauge!("specd_prefix_cache_blocks").set(prefix.len() as f64);
    }
}
