//! KV memory accounting in fixed-size blocks of the target cache, with one
//! reserve / commit / free vocabulary.
//!
//! Invariants:
//! - `used <= capacity` for every pool, always.
//! - A sequence holds exactly `blocks_for(reserved_len)` blocks per pool;
//!   with sliding-window layers (`with_window`) that counts their part of
//!   a block only for the blocks a cache keeps (`KvLayout::
//!   local_blocks_held`), in whole-block units rounded up, so a long
//!   sequence of such a model costs about its global layers' share;
//!   `reserve` raises that length before a step, `commit` lowers it to the
//!   committed length after (rollback of rejected positions), `free`
//!   returns everything.
//! - A sequence whose proposer keeps its own per-sequence cache (a draft
//!   model's KV: `Capabilities::kv_bytes_per_token`) is charged that
//!   cache's bytes for the same length on top, in blocks of the target's
//!   size (`with_block_bytes`) rounded up: one budget holds both caches.
//! - Nothing here touches tensors: the owners of the caches apply the same
//!   lengths (`KvCache::truncate`), so accounting and memory agree.

use std::collections::HashMap;

use super::SeqId;

/// Which cache a reservation is for: the target's (a proposer's own cache
/// is charged to it, per sequence).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pool {
    Target,
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
    /// Bytes per token of a sequence's proposer cache, where not 0.
    charges: HashMap<SeqId, usize>,
    /// Bytes of one block (0: charges count nothing).
    block_bytes: usize,
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

    /// Blocks of `len` tokens with a proposer cache of `charge` bytes a
    /// token on top.
    fn charged(&self, len: usize, charge: usize) -> usize {
        let extra = if charge == 0 || self.block_bytes == 0 {
            0
        } else {
            let b = (len as u128 * charge as u128).div_ceil(self.block_bytes as u128);
            usize::try_from(b).unwrap_or(usize::MAX)
        };
        self.blocks(len).saturating_add(extra)
    }

    fn charge(&self, seq: SeqId) -> usize {
        self.charges.get(&seq).copied().unwrap_or(0)
    }

    fn held(&self, seq: SeqId) -> usize {
        self.charged(self.lens.get(&seq).copied().unwrap_or(0), self.charge(seq))
    }
}

#[derive(Debug)]
pub struct KvManager {
    pools: HashMap<Pool, PoolState>,
}

impl KvManager {
    /// A manager for the target cache.
    pub fn new(block_size: usize, capacity_blocks: usize) -> Self {
        let mut pools = HashMap::new();
        pools.insert(
            Pool::Target,
            PoolState {
                block_size,
                capacity: capacity_blocks,
                used: 0,
                lens: HashMap::new(),
                charges: HashMap::new(),
                block_bytes: 0,
                window: None,
            },
        );
        Self { pools }
    }

    /// The manager for `model`'s target cache: `capacity_blocks` blocks of
    /// `DEFAULT_BLOCK_SIZE` tokens, its sliding-window layers counted as
    /// its caches keep them, proposer caches charged in its block bytes.
    pub fn for_model(model: &crate::model::Model, capacity_blocks: usize) -> Self {
        let mut layout = model.config.kv_layout(crate::model::DEFAULT_BLOCK_SIZE);
        layout.dtype = model.kv_dtype();
        Self::new(crate::model::DEFAULT_BLOCK_SIZE, capacity_blocks)
            .with_window(Pool::Target, WindowCost::of(&layout))
            .with_block_bytes(Pool::Target, layout.block_bytes())
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

    /// The bytes of one of `pool`'s blocks, what a proposer's per-token
    /// cache bytes are charged in (0, the default: not charged). Before
    /// any reservation.
    pub fn with_block_bytes(mut self, pool: Pool, bytes: usize) -> Self {
        if let Some(p) = self.pools.get_mut(&pool) {
            debug_assert!(p.lens.is_empty());
            p.block_bytes = bytes;
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
            .map(|p| p.charged(len, p.charge(seq)).saturating_sub(p.held(seq)))
            .unwrap_or(0)
    }

    /// Blocks `len` tokens occupy in `pool`.
    pub fn blocks_for(&self, pool: Pool, len: usize) -> usize {
        self.pools.get(&pool).map(|p| p.blocks(len)).unwrap_or(0)
    }

    /// Blocks `len` tokens occupy in `pool` with a proposer cache of
    /// `charge` bytes a token.
    pub fn charged_blocks_for(&self, pool: Pool, len: usize, charge: usize) -> usize {
        self.pools
            .get(&pool)
            .map(|p| p.charged(len, charge))
            .unwrap_or(0)
    }

    pub fn free_blocks(&self, pool: Pool) -> usize {
        self.pools
            .get(&pool)
            .map(|p| p.capacity - p.used)
            .unwrap_or(0)
    }

    /// Raise `seq`'s reserved lengths (never lowers). All-or-nothing.
    pub fn reserve(&mut self, seq: SeqId, wants: &[(Pool, usize)]) -> Result<(), OutOfBlocks> {
        let charged: Vec<(Pool, usize, usize)> = wants
            .iter()
            .filter_map(|&(pool, len)| Some((pool, len, self.pools.get(&pool)?.charge(seq))))
            .collect();
        self.reserve_charged(seq, &charged)
    }

    /// `reserve` with the bytes a token of `seq`'s proposer cache takes
    /// (`(pool, len, charge)`): a changed charge is applied with the
    /// length (a lower one frees blocks). All-or-nothing.
    pub fn reserve_charged(
        &mut self,
        seq: SeqId,
        wants: &[(Pool, usize, usize)],
    ) -> Result<(), OutOfBlocks> {
        let target = |p: &PoolState, len: usize, charge: usize| {
            let cur = p.lens.get(&seq).copied().unwrap_or(0);
            p.charged(len.max(cur), charge)
        };
        for &(pool, len, charge) in wants {
            let Some(p) = self.pools.get(&pool) else {
                continue;
            };
            let extra = target(p, len, charge).saturating_sub(p.held(seq));
            if extra > p.capacity - p.used {
                return Err(OutOfBlocks {
                    pool,
                    needed: extra,
                    free: p.capacity - p.used,
                });
            }
        }
        for &(pool, len, charge) in wants {
            let Some(p) = self.pools.get_mut(&pool) else {
                continue;
            };
            let (old, new) = (p.held(seq), target(p, len, charge));
            p.used = p.used + new - old;
            let cur = p.lens.get(&seq).copied().unwrap_or(0);
            if len > cur {
                p.lens.insert(seq, len);
            }
            if charge == 0 {
                p.charges.remove(&seq);
            } else {
                p.charges.insert(seq, charge);
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
        let charge = p.charge(seq);
        let cur = p.lens.get(&seq).copied().unwrap_or(0);
        let (old_b, new_b) = (p.charged(cur, charge), p.charged(len, charge));
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
            let held = p.held(seq);
            if p.lens.remove(&seq).is_some() {
                p.used -= held;
            }
            p.charges.remove(&seq);
        }
    }

    /// The bytes a token of `seq`'s proposer cache is charged in `pool`.
    pub fn charge(&self, pool: Pool, seq: SeqId) -> usize {
        self.pools.get(&pool).map_or(0, |p| p.charge(seq))
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
    /// Bytes a token of the sequence's proposer cache takes (0: none),
    /// charged with its blocks.
    pub charge: usize,
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

/// Whether want `w` may evict sequence `seq` of priority `priority`: one
/// of a worse priority, or of the same and newer (a larger id: ids follow
/// arrival). A want never throws away the cache of a sequence that
/// arrived before it at its priority: a new prompt (planned before an
/// older, longer one whose prefill is under way, as prompts that fit
/// whole are) waits for blocks instead of evicting the older prompt's
/// work, which would start it again from nothing, and could again after
/// each new arrival. The oldest want of the best priority may evict every
/// other holder below it, so some want always progresses.
fn may_evict(w: &Want, seq: SeqId, priority: i32) -> bool {
    priority > w.priority || (priority == w.priority && seq > w.seq)
}

/// Grant `wants` (highest priority first) from `kv`, evicting the lowest
/// priority holders when blocks run out, and as a last resort `idle`
/// holders (running sequences that sit this step out: the step's token
/// budget ran out before them; with their priorities), worst priority
/// then newest first. Without that, a want that only an idle holder's
/// blocks could satisfy would wait for ever when the same wants come first
/// every step. No want evicts a sequence of a better priority than its
/// own, or an older one of the same (`may_evict`): it waits instead.
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
        // A sequence the budget holds only without its proposer's cache
        // still runs (a budget that small is the operator's choice; the
        // request is not failed for the proposer's sake): uncharged, and it
        // stays so while it holds blocks (its draft length moving around
        // the line must not switch the charge on and off, evicting others
        // each time it comes back on).
        let dropped =
            kv.held_blocks(Pool::Target, w.seq) > 0 && kv.charge(Pool::Target, w.seq) == 0;
        let charge = if dropped || kv.charged_blocks_for(Pool::Target, w.len, w.charge) > capacity {
            0
        } else {
            w.charge
        };
        loop {
            if kv
                .reserve_charged(w.seq, &[(Pool::Target, w.len, charge)])
                .is_ok()
            {
                g.granted.push(w.seq);
                break;
            }
            let victim = evictable
                .iter()
                .rposition(|&(s, p)| may_evict(w, s, p))
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
            charge: 0,
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
            charge: 0,
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

    /// A want evicts only worse priorities and newer sequences of its own:
    /// a new prompt planned first (it fits whole) waits rather than throw
    /// away an older prompt's prefill under way, which, planned after it,
    /// then grows; the older one, planned first, evicts the newer.
    #[test]
    fn no_want_evicts_an_older_sequence_of_its_priority() {
        // 3 blocks of 16: the old prompt (1) holds all of them mid-prefill.
        let setup = || {
            let mut kv = KvManager::new(16, 3);
            kv.reserve(1, &[(Pool::Target, 40)]).unwrap();
            kv
        };
        let (old, new) = (want(1, 44), want(2, 8));
        let g = grant(&mut setup(), &[new.clone(), old.clone()], &[]);
        assert_eq!(
            (g.granted, g.preempted, g.deferred),
            (vec![1], vec![], vec![2])
        );
        // Nor as an idle holder.
        let g = grant(&mut setup(), std::slice::from_ref(&new), &[(1, 0)]);
        assert_eq!((g.preempted, g.deferred), (vec![], vec![2]));
        // A want of a better priority does evict it, and an older want of
        // the same a newer holder.
        let better = Want {
            priority: -1,
            ..new.clone()
        };
        let g = grant(&mut setup(), &[better], &[(1, 0)]);
        assert_eq!((g.granted, g.preempted), (vec![2], vec![1]));
        let mut kv = KvManager::new(16, 3);
        kv.reserve(2, &[(Pool::Target, 40)]).unwrap();
        let g = grant(&mut kv, &[want(1, 8), want(2, 44)], &[]);
        assert_eq!((g.granted, g.preempted), (vec![1], vec![2]));
    }

    #[test]
    fn reserve_commit_free_keep_usage_exact() {
        let mut kv = KvManager::new(16, 10);
        kv.reserve(1, &[(Pool::Target, 40)]).unwrap();
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 3);
        // Verify wrote 8 speculative slots; only 2 were accepted.
        kv.reserve(1, &[(Pool::Target, 48)]).unwrap();
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 3);
        kv.reserve(1, &[(Pool::Target, 50)]).unwrap();
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 4);
        kv.commit(1, Pool::Target, 42);
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 3);
        kv.free(1);
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 0);
        assert_eq!(kv.holders(), 0);
    }

    /// A proposer cache of a quarter of the target's bytes per token is
    /// charged a quarter block per block of length, rounded up, through
    /// reserve, commit, a lowered charge and free.
    #[test]
    fn a_proposer_cache_is_charged_beside_the_target_blocks() {
        // Blocks of 16 tokens of 1,024 bytes: 64 bytes a token.
        let mut kv = KvManager::new(16, 10).with_block_bytes(Pool::Target, 1024);
        kv.reserve_charged(1, &[(Pool::Target, 40, 16)]).unwrap();
        // 3 blocks for 40 tokens, and 40 x 16 = 640 bytes: 1 more.
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 4);
        assert_eq!(kv.held_blocks(Pool::Target, 1), 4);
        // Later reservations keep the charge.
        kv.reserve(1, &[(Pool::Target, 80)]).unwrap();
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 5 + 2);
        assert_eq!(kv.extra_blocks(Pool::Target, 1, 100), 7 + 2 - 7);
        kv.commit(1, Pool::Target, 33);
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 3 + 1);
        // Another sequence without a proposer cache.
        kv.reserve(2, &[(Pool::Target, 64)]).unwrap();
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 8);
        // 2 free: a charged want of 3 more blocks fails, all or nothing.
        let err = kv
            .reserve_charged(1, &[(Pool::Target, 80, 16)])
            .unwrap_err();
        assert_eq!((err.needed, err.free), (3, 2));
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 8);
        // The proposer dropped its cache: the charge goes, length kept.
        kv.reserve_charged(1, &[(Pool::Target, 33, 0)]).unwrap();
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 3 + 4);
        kv.free(1);
        kv.free(2);
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 0);
        // Without block bytes a charge counts nothing.
        let mut plain = KvManager::new(16, 10);
        plain.reserve_charged(1, &[(Pool::Target, 40, 16)]).unwrap();
        assert_eq!(plain.usage(Pool::Target).unwrap().used_blocks, 3);
    }

    /// The grant charges a want's proposer cache, evicting for it like for
    /// its own blocks; a want that fits only uncharged runs uncharged.
    #[test]
    fn the_grant_charges_the_proposer_cache() {
        let charged = |seq, len, charge| Want {
            charge,
            ..want(seq, len)
        };
        // 6 blocks of 16 tokens, 64 bytes a token; B holds 2.
        let setup = || {
            let mut kv = KvManager::new(16, 6).with_block_bytes(Pool::Target, 1024);
            kv.reserve(2, &[(Pool::Target, 32)]).unwrap();
            kv
        };
        // A: 48 tokens, 3 blocks, and a cache as big as the target's per
        // token (3 more): B is evicted for the charge.
        let mut kv = setup();
        let g = grant(&mut kv, &[charged(1, 48, 64)], &[(2, 0)]);
        assert_eq!((g.granted, g.preempted), (vec![1], vec![2]));
        assert_eq!(kv.held_blocks(Pool::Target, 1), 6);
        // Uncharged, A fits beside B.
        let mut kv = setup();
        let g = grant(&mut kv, &[charged(1, 48, 0)], &[(2, 0)]);
        assert_eq!((g.granted, g.preempted), (vec![1], vec![]));
        // 80 tokens fit the 6 blocks only without the charge: granted
        // uncharged, B evicted; 112 tokens do not fit at all.
        let mut kv = setup();
        let g = grant(&mut kv, &[charged(1, 80, 64)], &[(2, 0)]);
        assert_eq!((g.granted, g.preempted), (vec![1], vec![2]));
        assert_eq!(kv.held_blocks(Pool::Target, 1), 5);
        // Dropped once, the charge stays off while A holds blocks, though
        // a shorter want (fewer drafts) would fit charged; freed and
        // started again, A is charged.
        let g = grant(&mut kv, &[charged(1, 48, 64)], &[]);
        assert_eq!(g.granted, vec![1]);
        assert_eq!(kv.held_blocks(Pool::Target, 1), 5);
        kv.free(1);
        let g = grant(&mut kv, &[charged(1, 48, 64)], &[]);
        assert_eq!(g.granted, vec![1]);
        assert_eq!(kv.held_blocks(Pool::Target, 1), 6);
        let g = grant(&mut setup(), &[charged(1, 112, 64)], &[(2, 0)]);
        assert_eq!(g.too_big, vec![1]);
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
        let mut kv = KvManager::new(16, 4);
        kv.reserve(7, &[(Pool::Target, 32)]).unwrap();
        let err = kv.reserve(7, &[(Pool::Target, 100)]).unwrap_err();
        assert_eq!((err.needed, err.free), (5, 2));
        assert!(err.to_string().contains("KV cache full"));
        assert_eq!(kv.usage(Pool::Target).unwrap().used_blocks, 2);
    }
}
