//! KV memory accounting in fixed-size blocks, for the target cache and any
//! draft cache, with one reserve / commit / free vocabulary for all of them.
//!
//! Invariants:
//! - `used <= capacity` for every pool, always.
//! - A sequence holds exactly `blocks_for(reserved_len)` blocks per pool;
//!   with sliding-window layers (`with_window`) that counts their part of
//!   a block only for the blocks a cache keeps (`KvLayout::
//!   local_blocks_held`), in whole-block units rounded up, so a long
//!   sequence of such a model costs about its global layers' share;
//!   `reserve` raises that length before a step (all-or-nothing across
//!   pools), `commit` lowers it to the committed length after (rollback of
//!   rejected positions), `free` returns everything.
//! - Nothing here touches tensors: the owners of the caches apply the same
//!   lengths (`KvCache::truncate`), so accounting and memory agree.

use std::collections::HashMap;

use super::SeqId;

/// Which cache a reservation is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pool {
    Target,
    Draft,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolUsage {
    pub used_blocks: usize,
    pub capacity_blocks: usize,
    pub block_size: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("KV cache full: {pool:?} pool needs {needed} more blocks, {free} free")]
pub struct OutOfBlocks {
    pub pool: Pool,
    pub needed: usize,
    pub free: usize,
}

/// How a pool counts a model with sliding-window layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowCost {
    pub layers: usize,
    pub local_layers: usize,
    /// Blocks whose sliding part a cache keeps at most.
    pub local_blocks: usize,
}

impl WindowCost {
    /// The cost of caches of `layout` (`None`: no sliding layers).
    pub fn of(layout: &crate::model::KvLayout) -> Option<Self> {
        (layout.local_layers() > 0).then(|| Self {
            layers: layout.layers,
            local_layers: layout.local_layers(),
            local_blocks: layout.local_blocks_held(),
        })
    }
}

#[derive(Debug)]
struct PoolState {
    block_size: usize,
    capacity: usize,
    used: usize,
    /// Reserved token length per sequence.
    lens: HashMap<SeqId, usize>,
    window: Option<WindowCost>,
}

impl PoolState {
    fn blocks(&self, len: usize) -> usize {
        let b = len.div_ceil(self.block_size);
        match self.window {
            None => b,
            Some(w) => ((w.layers - w.local_layers) * b + w.local_layers * b.min(w.local_blocks))
                .div_ceil(w.layers.max(1)),
        }
    }

    fn held(&self, seq: SeqId) -> usize {
        self.blocks(self.lens.get(&seq).copied().unwrap_or(0))
    }
}

#[derive(Debug)]
pub struct KvManager {
    pools: HashMap<Pool, PoolState>,
}

impl KvManager {
    /// A manager for the target cache only.
    pub fn new(block_size: usize, capacity_blocks: usize) -> Self {
        let mut pools = HashMap::new();
        pools.insert(
            Pool::Target,
            PoolState {
                block_size,
                capacity: capacity_blocks,
                used: 0,
                lens: HashMap::new(),
                window: None,
            },
        );
        Self { pools }
    }

    /// Add (or resize) the draft pool.
    pub fn with_draft_pool(mut self, block_size: usize, capacity_blocks: usize) -> Self {
        self.pools.insert(
            Pool::Draft,
            PoolState {
                block_size,
                capacity: capacity_blocks,
                used: 0,
                lens: HashMap::new(),
                window: None,
            },
        );
        self
    }

    /// Count `pool`'s sequences as caches with sliding-window layers do
    /// (`None`: every layer holds every position). Before any reservation.
    pub fn with_window(mut self, pool: Pool, window: Option<WindowCost>) -> Self {
        if let Some(p) = self.pools.get_mut(&pool) {
            debug_assert!(p.lens.is_empty());
            p.window = window;
        }
        self
    }

    pub fn usage(&self, pool: Pool) -> Option<PoolUsage> {
        self.pools.get(&pool).map(|p| PoolUsage {
            used_blocks: p.used,
            capacity_blocks: p.capacity,
            block_size: p.block_size,
        })
    }

    /// Blocks a sequence would need for `len` tokens in `pool`, beyond what
    /// it holds.
    pub fn extra_blocks(&self, pool: Pool, seq: SeqId, len: usize) -> usize {
        self.pools
            .get(&pool)
            .map(|p| p.blocks(len).saturating_sub(p.held(seq)))
            .unwrap_or(0)
    }

    /// Blocks `len` tokens occupy in `pool`.
    pub fn blocks_for(&self, pool: Pool, len: usize) -> usize {
        self.pools.get(&pool).map(|p| p.blocks(len)).unwrap_or(0)
    }

    pub fn free_blocks(&self, pool: Pool) -> usize {
        self.pools
            .get(&pool)
            .map(|p| p.capacity - p.used)
            .unwrap_or(0)
    }

    /// Raise `seq`'s reserved lengths (never lowers). All-or-nothing.
    pub fn reserve(&mut self, seq: SeqId, wants: &[(Pool, usize)]) -> Result<(), OutOfBlocks> {
        for &(pool, len) in wants {
            let Some(p) = self.pools.get(&pool) else {
                continue;
            };
            let extra = p.blocks(len).saturating_sub(p.held(seq));
            if extra > p.capacity - p.used {
                return Err(OutOfBlocks {
                    pool,
                    needed: extra,
                    free: p.capacity - p.used,
                });
            }
        }
        for &(pool, len) in wants {
            let Some(p) = self.pools.get_mut(&pool) else {
                continue;
            };
            let cur = p.lens.get(&seq).copied().unwrap_or(0);
            if len > cur {
                let extra = p.blocks(len) - p.blocks(cur);
                p.used += extra;
                p.lens.insert(seq, len);
            }
        }
        Ok(())
    }

    /// Set `seq`'s length in `pool` to the committed `len` (rollback of
    /// rejected positions releases their blocks).
    pub fn commit(&mut self, seq: SeqId, pool: Pool, len: usize) {
        let Some(p) = self.pools.get_mut(&pool) else {
            return;
        };
        let cur = p.lens.get(&seq).copied().unwrap_or(0);
        let (old_b, new_b) = (p.blocks(cur), p.blocks(len));
        if new_b > old_b {
            // Committing more than was reserved is a caller bug; account
            // for it rather than let `used` drift.
            p.used += new_b - old_b;
        } else {
            p.used -= old_b - new_b;
        }
        p.lens.insert(seq, len);
    }

    /// Release every block `seq` holds.
    pub fn free(&mut self, seq: SeqId) {
        for p in self.pools.values_mut() {
            if let Some(len) = p.lens.remove(&seq) {
                p.used -= p.blocks(len);
            }
        }
    }

    /// Blocks `seq` holds in `pool`.
    pub fn held_blocks(&self, pool: Pool, seq: SeqId) -> usize {
        self.pools.get(&pool).map(|p| p.held(seq)).unwrap_or(0)
    }

    /// Sequences holding blocks.
    pub fn holders(&self) -> usize {
        self.pools
            .get(&Pool::Target)
            .map(|p| p.lens.len())
            .unwrap_or(0)
    }
}

/// Reservation a plan item needs: tokens in the target cache after the step.
#[derive(Debug, Clone, PartialEq)]
pub struct Want {
    pub seq: SeqId,
    pub len: usize,
    /// Scheduling priority (lower runs first; all 0 where priorities are
    /// ignored): no want evicts a sequence of a better one.
    pub priority: i32,
}

/// The KV manager's answer to a step's wants.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Grant {
    pub granted: Vec<SeqId>,
    /// Evicted to make room; recompute later.
    pub preempted: Vec<SeqId>,
    /// Did not fit this step; keep their blocks and wait.
    pub deferred: Vec<SeqId>,
    /// Cannot fit even with the cache to themselves.
    pub too_big: Vec<SeqId>,
}

/// Grant `wants` (highest priority first) from `kv`, evicting the lowest
/// priority holders when blocks run out, and as a last resort `idle`
/// holders (running sequences that sit this step out: the step's token
/// budget ran out before them; with their priorities), worst priority
/// then newest first. Without that, a want that only an idle holder's
/// blocks could satisfy would wait for ever when the same wants come first
/// every step. No want evicts a sequence of a better priority than its
/// own: it waits instead.
pub fn grant(kv: &mut KvManager, wants: &[Want], idle: &[(SeqId, i32)]) -> Grant {
    let mut g = Grant::default();
    let capacity = kv
        .usage(Pool::Target)
        .map(|u| u.capacity_blocks)
        .unwrap_or(0);
    // Eviction candidates, taken from the end: idle holders (best
    // priority first, so the worst go first), then the wants (in their
    // order: those after the one being granted, of no better priority).
    let mut idle: Vec<(SeqId, i32)> = idle
        .iter()
        .copied()
        .filter(|(s, _)| !wants.iter().any(|w| w.seq == *s))
        .collect();
    idle.sort_by_key(|&(_, p)| p);
    let mut evictable: Vec<(SeqId, i32)> = idle
        .into_iter()
        .chain(wants.iter().map(|w| (w.seq, w.priority)))
        .collect();
    for w in wants {
        if g.preempted.contains(&w.seq) {
            continue;
        }
        evictable.retain(|&(s, _)| s != w.seq);
        if kv.blocks_for(Pool::Target, w.len) > capacity {
            kv.free(w.seq);
            g.too_big.push(w.seq);
            continue;
        }
        loop {
            if kv.reserve(w.seq, &[(Pool::Target, w.len)]).is_ok() {
                g.granted.push(w.seq);
                break;
            }
            let victim = evictable
                .iter()
                .rposition(|&(_, p)| p >= w.priority)
                .map(|i| evictable.remove(i).0);
            match victim {
                // Evicting a want that holds nothing (a prompt not yet
                // prefilled, a choice not yet forked) frees nothing: it
                // would only throw its turn away and count a preemption.
                Some(victim) if kv.held_blocks(Pool::Target, victim) == 0 => {}
                Some(victim) => {
                    kv.free(victim);
                    g.preempted.push(victim);
                }
                None => {
                    g.deferred.push(w.seq);
                    break;
                }
            }
        }
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A want of priority 0.
    fn want(seq: SeqId, len: usize) -> Want {
        Want {
            seq,
            len,
            priority: 0,
        }
    }

    #[test]
    fn idle_holders_are_evicted_only_when_nothing_else_frees_enough() {
        // 4 blocks of 16: A holds 2 and wants a 3rd; B (a prefill want)
        // holds 1; C sits the step out holding 1.
        let setup = || {
            let mut kv = KvManager::new(16, 4);
            kv.reserve(1, &[(Pool::Target, 32)]).unwrap();
            kv.reserve(2, &[(Pool::Target, 16)]).unwrap();
            kv.reserve(3, &[(Pool::Target, 16)]).unwrap();
            kv
        };
        let a = want(1, 40);
        let b = want(2, 16);
        // The want below A goes first.
        let g = grant(&mut setup(), &[a.clone(), b], &[(3, 0)]);
        assert_eq!((g.granted, g.preempted), (vec![1], vec![2]));
        // With no other want, the idle holder goes rather than A waiting
        // for ever.
        let g = grant(&mut setup(), std::slice::from_ref(&a), &[(3, 0)]);
        assert_eq!(
            (g.granted, g.preempted, g.deferred),
            (vec![1], vec![3], vec![])
        );
        // Without idle holders, A waits (the old behaviour).
        let g = grant(&mut setup(), std::slice::from_ref(&a), &[]);
        assert_eq!((g.granted, g.deferred), (vec![], vec![1]));
        // A want below A that holds no blocks yet (D, a prompt to prefill)
        // is not evicted for A: that frees nothing. B below it is.
        let d = want(4, 16);
        let b = want(2, 16);
        let g = grant(&mut setup(), &[a.clone(), b, d.clone()], &[]);
        assert!(g.deferred.contains(&4), "{g:?}");
        assert_eq!((g.granted, g.preempted), (vec![1], vec![2]));
        let g = grant(&mut setup(), &[a, d], &[]);
        assert_eq!(
            (g.granted, g.preempted, g.deferred),
            (vec![], vec![], vec![1, 4])
        );
    }

    #[test]
    fn no_want_evicts_a_better_priority() {
        // A cache of `blocks` blocks of 16 with `held` (sequence, tokens).
        let cache = |blocks: usize, held: &[(SeqId, usize)]| {
            let mut kv = KvManager::new(16, blocks);
            for &(s, n) in held {
                kv.reserve(s, &[(Pool::Target, n)]).unwrap();
            }
            kv
        };
        // W (priority 3) holds 2 blocks and wants a 3rd; P (priority -1)
        // sits the step out holding 2, Q (priority 5) holding 1.
        let w = Want {
            seq: 1,
            len: 40,
            priority: 3,
        };
        // Q (worse) goes, not P, though P is the newer holder.
        let mut kv = cache(5, &[(1, 32), (2, 32), (3, 16)]);
        let g = grant(&mut kv, std::slice::from_ref(&w), &[(3, 5), (2, -1)]);
        assert_eq!((g.granted, g.preempted), (vec![1], vec![3]));
        // With only P to take from, W waits; a want of a better priority,
        // or the same, takes P's blocks.
        for (p, preempted) in [(3, vec![]), (-2, vec![2]), (-1, vec![2])] {
            let mut kv = cache(4, &[(1, 32), (2, 32)]);
            let want = Want {
                priority: p,
                ..w.clone()
            };
            let g = grant(&mut kv, std::slice::from_ref(&want), &[(2, -1)]);
            assert_eq!(g.preempted, preempted, "priority {p}");
            assert_eq!(g.granted.is_empty(), preempted.is_empty(), "priority {p}");
        }
    }

    #[test]
    fn reserve_commit_free_keep_usage_exact() {
        let mut kv = KvManager::new(16, 10).with_draft_pool(16, 4);
        kv.reserve(1, &[(Pool::Target, 40), (Pool::Draft, 20)])
            .unwrap();
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 3);
        assert_eq!(kv.usage(Pool::Draft).unwrap().used_blocks, 2);
        // Verify wrote 8 speculative slots; only 2 were accepted.
        kv.reserve(1, &[(Pool::Target, 48)]).unwrap();
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 3);
        kv.reserve(1, &[(Pool::Target, 50)]).unwrap();
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 4);
        kv.commit(1, Pool::Target, 42);
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 3);
        kv.free(1);
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 0);
        assert_eq!(kv.usage(Pool::Draft).unwrap().used_blocks, 0);
        assert_eq!(kv.holders(), 0);
    }

    /// Five of six layers slide: a long sequence costs its global layer's
    /// blocks and the few the sliding ones keep.
    #[test]
    fn sliding_window_layers_count_only_the_blocks_a_cache_keeps() {
        let w = WindowCost {
            layers: 6,
            local_layers: 5,
            local_blocks: 4,
        };
        let mut kv = KvManager::new(64, 100).with_window(Pool::Target, Some(w));
        assert_eq!(kv.blocks_for(Pool::Target, 128), 2);
        // (64 + 5 x 4) / 6, rounded up.
        assert_eq!(kv.blocks_for(Pool::Target, 64 * 64), 14);
        kv.reserve(1, &[(Pool::Target, 64 * 64)]).unwrap();
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 14);
        kv.commit(1, Pool::Target, 100);
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 2);
        kv.free(1);
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 0);
        // Without the window the same sequence needs 64.
        let dense = KvManager::new(64, 100);
        assert_eq!(dense.blocks_for(Pool::Target, 64 * 64), 64);
    }

    #[test]
    fn reserve_is_all_or_nothing() {
        let mut kv = KvManager::new(16, 4).with_draft_pool(16, 1);
        let err = kv
            .reserve(7, &[(Pool::Target, 32), (Pool::Draft, 40)])
            .unwrap_err();
        assert_eq!(err.pool, Pool::Draft);
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 0);
        let err = kv.reserve(7, &[(Pool::Target, 100)]).unwrap_err();
        assert_eq!((err.needed, err.free), (7, 4));
        assert!(err.to_string().contains("KV cache full"));
    }
}
