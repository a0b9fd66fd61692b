//! Per-sequence KV cache, preallocated in fixed-size blocks.
//!
//! Invariants:
//! - `len` positions are written; slots at `len..` are free for the next
//!   forward. Growth allocates whole blocks, never concatenates per token.
//! - `truncate(n)` rolls back to any `n <= len` and releases blocks past the
//!   last one still needed, so a rejected draft leaves no stale entries:
//!   the next forward overwrites slots from `n` on and attention never reads
//!   past the current length.
//! - A block holds `block_size` token slots for every layer, laid out
//!   `[layer][k|v][kv_head][..]`: keys transposed (`[head_dim][slot]`) so the
//!   scores of a whole block are plain vector FMAs with no horizontal sums,
//!   values as `[slot][head_dim]` so the weighted sum is too.
//! - Entries are stored as f16 by default (as llama.cpp's cache): half the
//!   memory of f32; attention widens a block at a time. The rounding is a
//!   function of the written value only, so it cannot break batch
//!   invariance. `KvDtype::F32` keeps full precision (reference checks).
//! - One released block is kept as a spare, so a verify that crosses a block
//!   boundary and is rolled back does not allocate and zero a block per step.
//! - Blocks are reference-counted so full blocks of a shared prefix can be
//!   held by several caches and the prefix cache at once (`share_block`,
//!   `push_shared`). Every write goes through copy-on-write: a cache never
//!   changes a block another holder sees, and a rollback only drops its
//!   references.

use crate::error::{Result, SpecdError};
use half::f16;

/// Element type of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    #[default]
    F16,
    F32,
}

impl KvDtype {
    pub fn size(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

/// One block's storage.
#[derive(Debug, Clone)]
enum Block {
    F16(Box<[f16]>),
    F32(Box<[f32]>),
}

/// A full block held outside any cache (the prefix cache's entries).
#[derive(Debug, Clone)]
pub struct SharedBlock(std::sync::Arc<Block>);

impl SharedBlock {
    /// Holders of this block besides this handle's own reference
    /// (caches, other handles).
    pub fn other_holders(&self) -> usize {
        std::sync::Arc::strong_count(&self.0) - 1
    }
}

/// A borrowed run of cache entries.
#[derive(Debug, Clone, Copy)]
pub(crate) enum KvSlice<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
}

impl<'a> KvSlice<'a> {
    /// The entries as f32: borrowed when stored as f32, else widened into
    /// `buf`.
    pub(crate) fn widen<'b>(self, buf: &'b mut Vec<f32>) -> &'b [f32]
    where
        'a: 'b,
    {
        use half::slice::HalfFloatSliceExt;
        match self {
            KvSlice::F32(s) => s,
            KvSlice::F16(s) => {
                buf.resize(s.len(), 0.0);
                #[cfg(target_arch = "x86_64")]
                if super::kernels::simd::attn::available() {
                    super::kernels::simd::attn::widen(s, buf);
                    return buf;
                }
                s.convert_to_f32_slice(buf);
                buf
            }
        }
    }
}

/// Shape of a cache block, fixed per model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub dtype: KvDtype,
}

impl KvLayout {
    /// Entries in one block.
    pub fn block_elems(&self) -> usize {
        self.layers * 2 * self.kv_heads * self.block_size * self.head_dim
    }

    pub fn block_bytes(&self) -> usize {
        self.block_elems() * self.dtype.size()
    }

    /// Blocks needed for `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Start of one head's keys (kind 0) or values (kind 1) in a block.
    #[inline]
    fn offset(&self, layer: usize, kind: usize, head: usize) -> usize {
        ((layer * 2 + kind) * self.kv_heads + head) * self.block_size * self.head_dim
    }
}

#[derive(Debug, Clone)]
pub struct KvCache {
    layout: KvLayout,
    blocks: Vec<std::sync::Arc<Block>>,
    spare: Option<std::sync::Arc<Block>>,
    len: usize,
    max_len: usize,
}

impl KvCache {
    pub fn new(layout: KvLayout, max_len: usize) -> Self {
        Self {
            layout,
            blocks: Vec::new(),
            spare: None,
            len: 0,
            max_len,
        }
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Committed (written) positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Blocks currently allocated.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Make room for `extra` positions past `len`.
    pub fn reserve(&mut self, extra: usize) -> Result<()> {
        let need = self.len + extra;
        if need > self.max_len {
            return Err(SpecdError::ContextOverflow {
                needed: need,
                limit: self.max_len,
            });
        }
        let blocks = self.layout.blocks_for(need);
        while self.blocks.len() < blocks {
            let n = self.layout.block_elems();
            let block = self.spare.take().unwrap_or_else(|| {
                std::sync::Arc::new(match self.layout.dtype {
                    KvDtype::F16 => Block::F16(vec![f16::ZERO; n].into_boxed_slice()),
                    KvDtype::F32 => Block::F32(vec![0f32; n].into_boxed_slice()),
                })
            });
            self.blocks.push(block);
        }
        Ok(())
    }

    /// Roll back to `len` positions (`len == len()` is a no-op). A length
    /// past the end is an error: the caller's bookkeeping disagrees with
    /// what the cache holds.
    pub fn truncate(&mut self, len: usize) -> crate::error::Result<()> {
        if len > self.len {
            return Err(crate::error::SpecdError::CacheRollback {
                have: self.len,
                want: len,
            });
        }
        self.len = len;
        let keep = self.layout.blocks_for(self.len);
        while self.blocks.len() > keep {
            let b = self.blocks.pop();
            // Only a block no one else holds can be reused in place.
            if self.spare.is_none()
                && b.as_ref()
                    .is_some_and(|b| std::sync::Arc::strong_count(b) == 1)
            {
                self.spare = b;
            }
        }
        Ok(())
    }

    /// Another reference to full block `b` (for the prefix cache).
    pub fn share_block(&self, b: usize) -> Option<SharedBlock> {
        (b < self.layout.blocks_for(self.len) && (b + 1) * self.layout.block_size <= self.len)
            .then(|| SharedBlock(self.blocks[b].clone()))
    }

    /// Append a full block computed by another cache for the same tokens
    /// at the same positions: `len` must sit on a block boundary, and
    /// grows by one block.
    pub fn push_shared(&mut self, block: &SharedBlock) -> Result<()> {
        let bs = self.layout.block_size;
        if !self.len.is_multiple_of(bs) || self.blocks.len() != self.len / bs {
            return Err(SpecdError::InvalidRequest(format!(
                "KV cache: a shared block can only follow whole blocks ({} positions in {} blocks)",
                self.len,
                self.blocks.len()
            )));
        }
        if self.len + bs > self.max_len {
            return Err(SpecdError::ContextOverflow {
                needed: self.len + bs,
                limit: self.max_len,
            });
        }
        self.blocks.push(block.0.clone());
        self.len += bs;
        Ok(())
    }

    /// Mark `n` more positions as written (after a forward filled them;
    /// public for tests that build caches without a model).
    pub fn advance(&mut self, n: usize) {
        debug_assert!(self.len + n <= self.blocks.len() * self.layout.block_size);
        self.len += n;
    }

    /// Write K and V rows (`kv_heads * head_dim` each) at absolute `slot`.
    pub(crate) fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let l = self.layout;
        let (b, s) = (slot / l.block_size, slot % l.block_size);
        for h in 0..l.kv_heads {
            let src = h * l.head_dim..(h + 1) * l.head_dim;
            let ko = l.offset(layer, 0, h);
            let vo = l.offset(layer, 1, h) + s * l.head_dim;
            match std::sync::Arc::make_mut(&mut self.blocks[b]) {
                Block::F16(block) => {
                    for (d, &kv) in k[src.clone()].iter().enumerate() {
                        block[ko + d * l.block_size + s] = f16::from_f32(kv);
                    }
                    for (o, &x) in block[vo..vo + l.head_dim].iter_mut().zip(&v[src]) {
                        *o = f16::from_f32(x);
                    }
                }
                Block::F32(block) => {
                    for (d, &kv) in k[src.clone()].iter().enumerate() {
                        block[ko + d * l.block_size + s] = kv;
                    }
                    block[vo..vo + l.head_dim].copy_from_slice(&v[src]);
                }
            }
        }
    }

    /// Move the entries of slot `from` to slot `to`, for every layer and kv
    /// head, for each `(from, to)` in order: after tree verification the
    /// accepted path's nodes are not contiguous, and this packs them right
    /// after the committed prefix (their keys were already rotated for their
    /// depth, which is their new position). Every slot must be below `len`;
    /// the moves must not overwrite a later move's source (moving each node
    /// down to its depth, in path order, never does).
    pub fn compact(&mut self, moves: &[(usize, usize)]) -> Result<()> {
        for (i, &(from, to)) in moves.iter().enumerate() {
            if from >= self.len || to >= self.len {
                return Err(SpecdError::CacheRollback {
                    have: self.len,
                    want: from.max(to) + 1,
                });
            }
            if to > from || moves[i + 1..].iter().any(|&(f, _)| f == to) {
                return Err(SpecdError::InvalidRequest(format!(
                    "KV compaction: moving slot {from} to {to} would overwrite an entry still to be moved"
                )));
            }
        }
        let l = self.layout;
        // (source index, target index) within a block, for every layer and
        // kv head: the key column (transposed) and the value row.
        let pairs = |fs: usize, ts: usize| {
            (0..l.layers).flat_map(move |layer| {
                (0..l.kv_heads).flat_map(move |h| {
                    let ko = l.offset(layer, 0, h);
                    let vo = l.offset(layer, 1, h);
                    (0..l.head_dim)
                        .map(move |d| (ko + d * l.block_size + fs, ko + d * l.block_size + ts))
                        .chain(
                            (0..l.head_dim)
                                .map(move |d| (vo + fs * l.head_dim + d, vo + ts * l.head_dim + d)),
                        )
                })
            })
        };
        for &(from, to) in moves {
            if from == to {
                continue;
            }
            let (fb, fs) = (from / l.block_size, from % l.block_size);
            let (tb, ts) = (to / l.block_size, to % l.block_size);
            if fb == tb {
                match std::sync::Arc::make_mut(&mut self.blocks[fb]) {
                    Block::F16(b) => pairs(fs, ts).for_each(|(i, j)| b[j] = b[i]),
                    Block::F32(b) => pairs(fs, ts).for_each(|(i, j)| b[j] = b[i]),
                }
                continue;
            }
            // Sources lie at or after targets (nodes move down to their depth).
            let (lo, hi) = self.blocks.split_at_mut(fb);
            match (&*hi[0], std::sync::Arc::make_mut(&mut lo[tb])) {
                (Block::F16(src), Block::F16(dst)) => {
                    pairs(fs, ts).for_each(|(i, j)| dst[j] = src[i])
                }
                (Block::F32(src), Block::F32(dst)) => {
                    pairs(fs, ts).for_each(|(i, j)| dst[j] = src[i])
                }
                _ => unreachable!("one cache holds one element type"),
            }
        }
        Ok(())
    }

    fn run(&self, b: usize, o: usize) -> KvSlice<'_> {
        let n = self.layout.block_size * self.layout.head_dim;
        match &*self.blocks[b] {
            Block::F16(x) => KvSlice::F16(&x[o..o + n]),
            Block::F32(x) => KvSlice::F32(&x[o..o + n]),
        }
    }

    /// Keys of one head in block `b`, transposed: `[head_dim][block_size]`.
    #[inline]
    pub(crate) fn keys_t(&self, layer: usize, head: usize, b: usize) -> KvSlice<'_> {
        self.run(b, self.layout.offset(layer, 0, head))
    }

    /// Values of one head in block `b`: `[block_size][head_dim]`.
    #[inline]
    pub(crate) fn values(&self, layer: usize, head: usize, b: usize) -> KvSlice<'_> {
        self.run(b, self.layout.offset(layer, 1, head))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 4,
            block_size: 4,
            dtype: KvDtype::F16,
        }
    }

    #[test]
    fn grows_in_whole_blocks_and_truncates() {
        let mut c = KvCache::new(layout(), 32);
        c.reserve(5).unwrap();
        assert_eq!(c.num_blocks(), 2);
        c.advance(5);
        c.reserve(3).unwrap();
        assert_eq!(c.num_blocks(), 2);
        c.advance(3);
        c.truncate(4).unwrap();
        assert_eq!((c.len(), c.num_blocks()), (4, 1));
        let err = c.truncate(5).unwrap_err();
        assert!(err.to_string().contains("holds 4"), "{err}");
        assert_eq!(c.len(), 4);
        c.truncate(0).unwrap();
        assert_eq!((c.len(), c.num_blocks()), (0, 0));
    }

    #[test]
    fn compact_moves_every_layer_and_head_across_blocks() {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let mut c = KvCache::new(KvLayout { dtype, ..layout() }, 32);
            c.reserve(11).unwrap();
            // Slot s of layer l holds keys 100 l + 10 s + i, values negated.
            for slot in 0..11 {
                for layer in 0..2 {
                    let k: Vec<f32> = (0..8)
                        .map(|i| (100 * layer + 10 * slot + i) as f32)
                        .collect();
                    let v: Vec<f32> = k.iter().map(|x| -x).collect();
                    c.write(layer, slot, &k, &v);
                }
            }
            c.advance(11);
            // Path nodes at slots 6 and 9 move down to 3 and 4 (block 1 to
            // block 0 and 2 to 1); slot 5 stays.
            c.compact(&[(6, 3), (9, 4), (5, 5)]).unwrap();
            let mut buf = Vec::new();
            for (slot, was) in [(3usize, 6usize), (4, 9), (5, 5), (2, 2)] {
                let (b, s) = (slot / 4, slot % 4);
                for layer in 0..2 {
                    for h in 0..2 {
                        let kt = c.keys_t(layer, h, b).widen(&mut buf).to_vec();
                        let vs = c.values(layer, h, b).widen(&mut buf).to_vec();
                        for d in 0..4 {
                            let want = (100 * layer + 10 * was + 4 * h + d) as f32;
                            assert_eq!(kt[d * 4 + s], want, "{dtype:?} key slot {slot}");
                            assert_eq!(vs[s * 4 + d], -want, "{dtype:?} value slot {slot}");
                        }
                    }
                }
            }
            // A move upwards, or past the end, is refused.
            assert!(c.compact(&[(3, 6)]).is_err());
            assert!(c.compact(&[(11, 3)]).is_err());
        }
    }

    #[test]
    fn refuses_to_grow_past_max_len() {
        let mut c = KvCache::new(layout(), 8);
        c.reserve(8).unwrap();
        let err = c.reserve(9).unwrap_err();
        assert!(err.to_string().contains("9"), "{err}");
    }

    #[test]
    fn write_lands_in_the_documented_layout() {
        let mut c = KvCache::new(layout(), 8);
        c.reserve(6).unwrap();
        let k: Vec<f32> = (0..8).map(|x| x as f32).collect();
        let v: Vec<f32> = (0..8).map(|x| 100.0 + x as f32).collect();
        c.write(1, 5, &k, &v);
        // slot 5 = block 1, slot 1; head 1 holds k[4..8], transposed.
        let mut buf = Vec::new();
        let kt = c.keys_t(1, 1, 1).widen(&mut buf).to_vec();
        let col: Vec<f32> = (0..4).map(|d| kt[d * 4 + 1]).collect();
        assert_eq!(col, vec![4.0, 5.0, 6.0, 7.0]);
        let vb = c.values(1, 0, 1).widen(&mut buf);
        assert_eq!(&vb[4..8], &[100.0, 101.0, 102.0, 103.0]);
    }
}
