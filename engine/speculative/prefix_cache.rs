//! `PrefixCache`: full KV blocks of prompts already computed, found again
//! by the tokens that produced them, so a request sharing a prefix (a
//! system prompt, few-shot examples, chat history) skips its prefill.
//!
//! An entry is keyed by its parent entry's id (0: the start of a prompt)
//! and the exact tokens of its block, so a hit means the same tokens at the
//! same positions after the same prefix: exact, no hash collisions. The
//! runner walks a prompt block by block from the start.
//!
//! Invariants:
//! - Only full blocks of committed prompt positions are inserted; they are
//!   never written again (writes are copy-on-write, see `model::kv`), so a
//!   speculative rollback or a diverging sequence never changes what
//!   another holder reads.
//! - Beyond `capacity` entries, the least recently used entries that no
//!   cache holds are evicted; an entry in use is never evicted. Using an
//!   entry uses its ancestors too (a prefix is only reachable through
//!   them), and among equally recent entries the deepest goes first, so a
//!   parent never goes before its children and a long prompt is trimmed
//!   from its end.
//! - `PrefixProbe` mirrors the entries' keys (parent id, a hash of the
//!   tokens) -> id; it changes only with `map`, under the same calls. The
//!   scheduler reads it to plan cached blocks as free (a hint: the runner's
//!   exact lookup decides, and a block evicted in between is computed).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, RwLock};

use crate::model::SharedBlock;

/// (parent entry id, the block's tokens).
type Key = (u64, Vec<u32>);

#[derive(Debug)]
struct Entry {
    id: u64,
    parent: u64,
    depth: u32,
    block: SharedBlock,
    used: u64,
}

/// What the scheduler sees of a `PrefixCache`: which blocks of a prompt
/// it holds, read without touching the cache (no recency, no lock on it).
#[derive(Debug, Clone, Default)]
pub struct PrefixProbe(Arc<RwLock<HashMap<(u64, u64), u64>>>);

fn tokens_hash(tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    tokens.hash(&mut h);
    h.finish()
}

impl PrefixProbe {
    /// How many full `block_size` blocks of `tokens` after the first
    /// `from` blocks the cache holds in a row, following the prompt's chain
    /// from its start (0 where the first `from` blocks are not all there).
    pub fn cached_blocks(&self, tokens: &[u32], from: usize, block_size: usize) -> usize {
        let Ok(index) = self.0.read() else {
            return 0;
        };
        let mut parent = 0;
        let mut found = 0;
        for (b, block) in tokens.chunks_exact(block_size).enumerate() {
            match index.get(&(parent, tokens_hash(block))) {
                Some(&id) => parent = id,
                None => return found,
            }
            if b >= from {
                found += 1;
            }
        }
        found
    }

    fn set(&self, parent: u64, tokens: &[u32], id: u64) {
        let mut index = self.0.write().unwrap_or_else(|e| e.into_inner());
        index.insert((parent, tokens_hash(tokens)), id);
    }

    fn forget(&self, parent: u64, tokens: &[u32], id: u64) {
        let mut index = self.0.write().unwrap_or_else(|e| e.into_inner());
        let key = (parent, tokens_hash(tokens));
        // Only this entry's (another's may share the hash).
        if index.get(&key) == Some(&id) {
            index.remove(&key);
        }
    }
}

#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    probe: PrefixProbe,
    map: HashMap<(u64, Vec<u32>), Entry>,
    /// Entry id -> its key.
    keys: HashMap<u64, (u64, Vec<u32>)>,
    next_id: u64,
    tick: u64,
}

impl PrefixCache {
    /// A cache of at most `capacity` blocks (beyond those in use).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            probe: PrefixProbe::default(),
            map: HashMap::new(),
            keys: HashMap::new(),
            next_id: 1,
            tick: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// A view of this cache's keys for the scheduler (see `PrefixProbe`).
    pub fn probe(&self) -> PrefixProbe {
        self.probe.clone()
    }

    fn remove(&mut self, k: &Key) {
        if let Some(e) = self.map.remove(k) {
            self.keys.remove(&e.id);
            self.probe.forget(k.0, &k.1, e.id);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The block that follows entry `parent` with exactly `tokens`, and its
    /// id (the parent of the next block).
    pub fn lookup(&mut self, parent: u64, tokens: &[u32]) -> Option<(u64, SharedBlock)> {
        self.tick += 1;
        let e = self.map.get(&(parent, tokens.to_vec()))?;
        let found = (e.id, e.block.clone());
        self.used(found.0);
        Some(found)
    }

    /// Mark entry `id` and its ancestors used now.
    fn used(&mut self, mut id: u64) {
        let tick = self.tick;
        while let Some(key) = self.keys.get(&id) {
            let Some(e) = self.map.get_mut(key) else {
                break;
            };
            if e.used >= tick {
                break;
            }
            e.used = tick;
            id = e.parent;
        }
    }

    /// Remember `block` as the one after `parent` with `tokens`; returns
    /// its id (the existing entry's if one is there already).
    pub fn insert(&mut self, parent: u64, tokens: Vec<u32>, block: SharedBlock) -> u64 {
        self.tick += 1;
        if let Some(id) = self.map.get(&(parent, tokens.clone())).map(|e| e.id) {
            self.used(id);
            return id;
        }
        let id = self.next_id;
        self.next_id += 1;
        if parent != 0 && !self.keys.contains_key(&parent) {
            // The parent was evicted: nothing could reach this block.
            return id;
        }
        let depth = self
            .keys
            .get(&parent)
            .and_then(|k| self.map.get(k))
            .map_or(0, |p| p.depth + 1);
        self.keys.insert(id, (parent, tokens.clone()));
        self.probe.set(parent, &tokens, id);
        self.map.insert(
            (parent, tokens),
            Entry {
                id,
                parent,
                depth,
                block,
                used: 0,
            },
        );
        self.used(id);
        if self.map.len() > self.capacity {
            self.evict();
        }
        id
    }

    /// Back within capacity if blocks that were in use (and so could not
    /// be evicted) have been released since.
    pub fn trim(&mut self) {
        if self.map.len() > self.capacity {
            self.evict();
        }
    }

    /// Drop least recently used entries no cache holds until the cache is
    /// back to 7/8 of its capacity (or nothing more can go).
    fn evict(&mut self) {
        let target = self.capacity - self.capacity / 8;
        let mut free: Vec<(u64, std::cmp::Reverse<u32>, Key)> = self
            .map
            .iter()
            .filter(|(_, e)| e.block.other_holders() == 0)
            .map(|(k, e)| (e.used, std::cmp::Reverse(e.depth), k.clone()))
            .collect();
        free.sort_unstable_by_key(|a| (a.0, a.1));
        for (_, _, k) in free {
            if self.map.len() <= target {
                break;
            }
            self.remove(&k);
        }
        // Entries whose parent went are unreachable: drop them too.
        loop {
            let orphans: Vec<(u64, Vec<u32>)> = self
                .map
                .iter()
                .filter(|(_, e)| e.parent != 0 && !self.keys.contains_key(&e.parent))
                .map(|(k, _)| k.clone())
                .collect();
            if orphans.is_empty() {
                break;
            }
            for k in orphans {
                self.remove(&k);
            }
        }
    }

    /// Entries no cache holds (memory the prefix cache alone keeps).
    pub fn idle(&self) -> usize {
        self.map
            .values()
            .filter(|e| e.block.other_holders() == 0)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{KvCache, KvDtype, KvLayout};

    fn cache_with_blocks(n: usize) -> KvCache {
        let layout = KvLayout::dense(1, 1, 2, 2, KvDtype::F32);
        let mut c = KvCache::new(layout, 64);
        c.reserve(2 * n).unwrap();
        c.advance(2 * n);
        c
    }

    #[test]
    fn hits_need_the_same_parent_and_tokens() {
        let c = cache_with_blocks(2);
        let mut p = PrefixCache::new(8);
        let a = p.insert(0, vec![1, 2], c.share_block(0).unwrap());
        let b = p.insert(a, vec![3, 4], c.share_block(1).unwrap());
        assert_eq!(p.lookup(0, &[1, 2]).map(|x| x.0), Some(a));
        assert_eq!(p.lookup(a, &[3, 4]).map(|x| x.0), Some(b));
        // Same tokens after another prefix, or other tokens: misses.
        assert!(p.lookup(0, &[3, 4]).is_none());
        assert!(p.lookup(a, &[3, 5]).is_none());
        // Inserting the same block again keeps one entry.
        assert_eq!(p.insert(0, vec![1, 2], c.share_block(0).unwrap()), a);
        assert_eq!(p.len(), 2);
    }

    /// The probe follows a prompt's chain from its start, counts the
    /// blocks after the first `from`, and forgets evicted entries.
    #[test]
    fn the_probe_sees_chains_from_the_start_and_forgets_evictions() {
        let c = cache_with_blocks(3);
        let mut p = PrefixCache::new(8);
        let probe = p.probe();
        let a = p.insert(0, vec![1, 2], c.share_block(0).unwrap());
        let b = p.insert(a, vec![3, 4], c.share_block(1).unwrap());
        p.insert(b, vec![5, 6], c.share_block(2).unwrap());
        let prompt = [1, 2, 3, 4, 5, 6, 7];
        assert_eq!(probe.cached_blocks(&prompt, 0, 2), 3);
        assert_eq!(probe.cached_blocks(&prompt, 1, 2), 2);
        assert_eq!(probe.cached_blocks(&prompt, 3, 2), 0);
        // Another first block: nothing after it counts.
        assert_eq!(probe.cached_blocks(&[9, 9, 3, 4], 1, 2), 0);
        assert_eq!(probe.cached_blocks(&[1, 2, 3, 9], 0, 2), 1);
        // Evicted (once no cache holds them): gone from the probe too.
        drop(c);
        p.capacity = 0;
        p.trim();
        assert!(p.is_empty());
        assert_eq!(probe.cached_blocks(&prompt, 0, 2), 0);
    }

    /// A chain inserted block by block is trimmed from its end: its root
    /// is as recent as its leaf, and deeper blocks go first.
    #[test]
    fn a_prefix_is_trimmed_from_its_end() {
        let mut p = PrefixCache::new(4);
        let mut parent = 0;
        // Each block is in use (by its cache) while it goes in, as in the
        // runner.
        for t in 0..6u32 {
            let c = cache_with_blocks(1);
            parent = p.insert(parent, vec![t, t], c.share_block(0).unwrap());
        }
        assert!(p.len() <= 4);
        // The first blocks are still reachable from the start.
        let mut at = 0;
        for t in 0..3u32 {
            at = p
                .lookup(at, &[t, t])
                .map(|x| x.0)
                .unwrap_or_else(|| panic!("block {t} evicted"));
        }
    }

    #[test]
    fn eviction_takes_the_least_recently_used_idle_entries_only() {
        let mut p = PrefixCache::new(4);
        let held = cache_with_blocks(1);
        let mut ids = Vec::new();
        // Entry 0 is still held by a cache; the others only by the prefix
        // cache (their caches are gone).
        ids.push(p.insert(0, vec![0, 0], held.share_block(0).unwrap()));
        for t in 1..4u32 {
            let c = cache_with_blocks(1);
            ids.push(p.insert(0, vec![t, t], c.share_block(0).unwrap()));
        }
        assert_eq!((p.len(), p.idle()), (4, 3));
        // Touch entry 1 so entry 2 is the least recently used idle one.
        assert!(p.lookup(0, &[1, 1]).is_some());
        let c = cache_with_blocks(1);
        p.insert(0, vec![9, 9], c.share_block(0).unwrap());
        drop(c);
        // Over capacity: down to 7/8 of 4 = 4 (rounded up): one eviction.
        assert_eq!(p.len(), 4);
        assert!(p.lookup(0, &[2, 2]).is_none(), "the LRU idle entry went");
        assert!(p.lookup(0, &[0, 0]).is_some(), "an entry in use stays");
        assert!(p.lookup(0, &[1, 1]).is_some());
        drop(held);
        assert_eq!(p.idle(), 4);
    }
}
