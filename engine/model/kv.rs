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
//! - Sliding-window layers (`KvLayout::sliding`) keep their entries in a
//!   second part of each block. `release_window(pos)` drops the parts no
//!   query at `pos` or later reads (attention reads whole slot ranges from
//!   the one holding a window's first slot: `first_local_block`), so a
//!   sequence holds its sliding layers' entries for about a window, not
//!   its context. Nothing ever reads a released part: a rollback to a
//!   length whose window needs one is refused, a released block is never
//!   shared, and a shared block always carries both parts.

use std::sync::Arc;

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

impl Block {
    fn zeros(dtype: KvDtype, n: usize) -> Arc<Block> {
        Arc::new(match dtype {
            KvDtype::F16 => Block::F16(vec![f16::ZERO; n].into_boxed_slice()),
            KvDtype::F32 => Block::F32(vec![0f32; n].into_boxed_slice()),
        })
    }
}

/// A full block held outside any cache (the prefix cache's entries): the
/// global layers' part and, where the model has sliding layers, theirs.
#[derive(Debug, Clone)]
pub struct SharedBlock {
    global: Arc<Block>,
    local: Option<Arc<Block>>,
}

impl SharedBlock {
    /// Holders of this block besides this handle's own reference
    /// (caches, other handles).
    pub fn other_holders(&self) -> usize {
        Arc::strong_count(&self.global) - 1
    }
}

/// A borrowed run of cache entries.
#[derive(Debug, Clone, Copy)]
pub(crate) enum KvSlice<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
}

impl<'a> KvSlice<'a> {
    /// Start bringing the entries into the CPU's L2 cache (a hint).
    pub(crate) fn prefetch(self) {
        match self {
            KvSlice::F16(s) => super::kernels::prefetch(s),
            KvSlice::F32(s) => super::kernels::prefetch(s),
        }
    }

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
    /// Sliding-window layers: bit `l` set when layer `l` attends within
    /// `window` positions (layers past 127 are kept as global ones).
    pub sliding: u128,
    /// Their window in positions (0: no sliding layers).
    pub window: usize,
}

impl KvLayout {
    /// A layout without sliding-window layers.
    pub fn dense(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        dtype: KvDtype,
    ) -> Self {
        Self {
            layers,
            kv_heads,
            head_dim,
            block_size,
            dtype,
            sliding: 0,
            window: 0,
        }
    }

    fn sliding_mask(&self) -> u128 {
        if self.window == 0 {
            return 0;
        }
        let all = if self.layers >= 128 {
            u128::MAX
        } else {
            (1u128 << self.layers) - 1
        };
        self.sliding & all
    }

    /// Sliding-window layers (stored in each block's second part).
    pub fn local_layers(&self) -> usize {
        self.sliding_mask().count_ones() as usize
    }

    /// Which part of a block holds `layer` (true: the sliding part), and
    /// the layer's index within it.
    #[inline]
    fn part(&self, layer: usize) -> (bool, usize) {
        let mask = self.sliding_mask();
        if layer >= 128 || mask == 0 {
            return (false, layer - (mask.count_ones() as usize).min(layer));
        }
        let below = (mask & ((1u128 << layer) - 1)).count_ones() as usize;
        if mask >> layer & 1 == 1 {
            (true, below)
        } else {
            (false, layer - below)
        }
    }

    fn part_elems(&self, local: bool) -> usize {
        let n = if local {
            self.local_layers()
        } else {
            self.layers - self.local_layers()
        };
        n * 2 * self.kv_heads * self.block_size * self.head_dim
    }

    /// Entries in one block (both parts).
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

    /// The first block whose sliding-layer entries a query at position
    /// `pos` or later can read: attention reads whole slot ranges, from
    /// the one holding the first slot of the window.
    pub fn first_local_block(&self, pos: usize) -> usize {
        if self.local_layers() == 0 {
            return 0;
        }
        let range = super::attention::ATTN_BLOCKS_PER_RANGE * self.block_size;
        (pos + 1).saturating_sub(self.window) / range * range / self.block_size
    }

    /// The most blocks' sliding parts a cache of committed length `c`
    /// holds once released, with up to a block of positions past `c`
    /// (what the KV budget counts for them).
    pub fn local_blocks_held(&self) -> usize {
        let range = super::attention::ATTN_BLOCKS_PER_RANGE * self.block_size;
        (self.window + range).div_ceil(self.block_size) + 2
    }

    /// Bytes a cache of `len` positions holds once its sliding parts
    /// outside the window are released (every layer's without sliding
    /// layers).
    pub fn bytes_at(&self, len: usize) -> usize {
        let b = self.blocks_for(len);
        let local = if self.local_layers() > 0 {
            b - self.first_local_block(len).min(b)
        } else {
            0
        };
        (b * self.part_elems(false) + local * self.part_elems(true)) * self.dtype.size()
    }

    /// Start of one head's keys (kind 0) or values (kind 1) in its part
    /// of a block.
    #[inline]
    fn offset(&self, layer: usize, kind: usize, head: usize) -> usize {
        let (_, l) = self.part(layer);
        ((l * 2 + kind) * self.kv_heads + head) * self.block_size * self.head_dim
    }
}

#[derive(Debug, Clone)]
pub struct KvCache {
    layout: KvLayout,
    /// The global layers' part of each block.
    blocks: Vec<Arc<Block>>,
    /// The sliding layers' part of each block (`None`: released, or the
    /// model has none); as long as `blocks` when it has some, else empty.
    local: Vec<Option<Arc<Block>>>,
    /// Blocks below this have no sliding part any more.
    local_from: usize,
    spare: Option<(Arc<Block>, Option<Arc<Block>>)>,
    len: usize,
    max_len: usize,
}

impl KvCache {
    pub fn new(layout: KvLayout, max_len: usize) -> Self {
        Self {
            layout,
            blocks: Vec::new(),
            local: Vec::new(),
            local_from: 0,
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

    /// Blocks whose sliding-layer part is still held.
    pub fn num_local_blocks(&self) -> usize {
        self.local.iter().filter(|b| b.is_some()).count()
    }

    /// Bytes of entries this cache references (shared blocks included).
    pub fn bytes(&self) -> usize {
        let l = self.layout;
        let size = l.dtype.size();
        self.blocks.len() * l.part_elems(false) * size
            + self.num_local_blocks() * l.part_elems(true) * size
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
        let sliding = self.layout.local_layers() > 0;
        while self.blocks.len() < blocks {
            let (global, local) = self.spare.take().unwrap_or_else(|| {
                let l = self.layout;
                (
                    Block::zeros(l.dtype, l.part_elems(false)),
                    sliding.then(|| Block::zeros(l.dtype, l.part_elems(true))),
                )
            });
            self.blocks.push(global);
            if sliding {
                self.local.push(local);
            }
        }
        Ok(())
    }

    /// Roll back to `len` positions (`len == len()` is a no-op). A length
    /// past the end is an error: the caller's bookkeeping disagrees with
    /// what the cache holds; so is one whose window reaches entries
    /// already released.
    pub fn truncate(&mut self, len: usize) -> crate::error::Result<()> {
        if len > self.len {
            return Err(crate::error::SpecdError::CacheRollback {
                have: self.len,
                want: len,
            });
        }
        // A query at `len` reads the sliding parts from its window's range
        // up to `len`'s block (none when nothing is kept).
        let first = self.layout.first_local_block(len);
        if first < self.local_from.min(self.layout.blocks_for(len)) {
            return Err(SpecdError::InvalidRequest(format!(
                "KV cache: a rollback to {len} positions needs sliding-window entries released \
                 (kept from position {})",
                self.local_from * self.layout.block_size
            )));
        }
        self.len = len;
        let keep = self.layout.blocks_for(self.len);
        while self.blocks.len() > keep {
            let b = self.blocks.pop();
            let lb = self.local.pop().flatten();
            // Only a block no one else holds can be reused in place.
            let sole = |b: &Arc<Block>| Arc::strong_count(b) == 1;
            if self.spare.is_none()
                && b.as_ref().is_some_and(sole)
                && (self.layout.local_layers() == 0 || lb.as_ref().is_some_and(sole))
            {
                self.spare = b.map(|b| (b, lb));
            }
        }
        self.local_from = self.local_from.min(self.blocks.len());
        Ok(())
    }

    /// Drop the sliding layers' entries no query at position `pos` or
    /// later reads (`pos` at most the length: the next forward's first
    /// position, or below it to keep more). Returns the blocks released.
    pub fn release_window(&mut self, pos: usize) -> usize {
        let upto = self
            .layout
            .first_local_block(pos.min(self.len))
            .min(self.local.len());
        let mut n = 0;
        for b in self.local_from..upto {
            n += usize::from(self.local[b].take().is_some());
        }
        self.local_from = self.local_from.max(upto);
        n
    }

    /// Another reference to full block `b` (for the prefix cache), if it
    /// still holds every layer.
    pub fn share_block(&self, b: usize) -> Option<SharedBlock> {
        if b >= self.layout.blocks_for(self.len) || (b + 1) * self.layout.block_size > self.len {
            return None;
        }
        let local = match self.local.get(b) {
            Some(Some(l)) => Some(l.clone()),
            Some(None) => return None,
            None => None,
        };
        Some(SharedBlock {
            global: self.blocks[b].clone(),
            local,
        })
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
        let sliding = self.layout.local_layers() > 0;
        if sliding != block.local.is_some() {
            return Err(SpecdError::InvalidRequest(
                "KV cache: a shared block of another layout".into(),
            ));
        }
        self.blocks.push(block.global.clone());
        if sliding {
            self.local.push(block.local.clone());
        }
        self.len += bs;
        Ok(())
    }

    /// Mark `n` more positions as written (after a forward filled them;
    /// public for tests that build caches without a model).
    pub fn advance(&mut self, n: usize) {
        debug_assert!(self.len + n <= self.blocks.len() * self.layout.block_size);
        self.len += n;
    }

    /// The part of block `b` that holds `layer`, to write.
    fn part_mut(&mut self, layer: usize, b: usize) -> &mut Block {
        let (local, _) = self.layout.part(layer);
        let part = if local {
            self.local[b]
                .as_mut()
                .expect("writes land at or after the cache's length, inside the window")
        } else {
            &mut self.blocks[b]
        };
        Arc::make_mut(part)
    }

    /// Write K and V rows (`kv_heads * head_dim` each) at absolute `slot`.
    pub(crate) fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let l = self.layout;
        let (b, s) = (slot / l.block_size, slot % l.block_size);
        let block = self.part_mut(layer, b);
        for h in 0..l.kv_heads {
            let src = h * l.head_dim..(h + 1) * l.head_dim;
            let ko = l.offset(layer, 0, h);
            let vo = l.offset(layer, 1, h) + s * l.head_dim;
            match &mut *block {
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
    /// depth, which is their new position). Every slot must be below `len`
    /// (and in the window); the moves must not overwrite a later move's
    /// source (moving each node down to its depth, in path order, never
    /// does).
    pub fn compact(&mut self, moves: &[(usize, usize)]) -> Result<()> {
        let bs = self.layout.block_size;
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
            if !self.local.is_empty() && to / bs < self.local_from {
                return Err(SpecdError::InvalidRequest(format!(
                    "KV compaction: slot {to} is outside the sliding window"
                )));
            }
        }
        let l = self.layout;
        // Layers of one part, by their index within it.
        let parts: Vec<(bool, usize)> = [false, true]
            .into_iter()
            .map(|local| {
                let n = if local {
                    l.local_layers()
                } else {
                    l.layers - l.local_layers()
                };
                (local, n)
            })
            .filter(|&(_, n)| n > 0)
            .collect();
        // (source index, target index) within a part, for every layer of
        // it and kv head: the key column (transposed) and the value row.
        let pairs = |n: usize, fs: usize, ts: usize| {
            (0..n).flat_map(move |li| {
                (0..l.kv_heads).flat_map(move |h| {
                    let ko = ((li * 2) * l.kv_heads + h) * l.block_size * l.head_dim;
                    let vo = ((li * 2 + 1) * l.kv_heads + h) * l.block_size * l.head_dim;
                    (0..l.head_dim)
                        .map(move |d| (ko + d * l.block_size + fs, ko + d * l.block_size + ts))
                        .chain(
                            (0..l.head_dim)
                                .map(move |d| (vo + fs * l.head_dim + d, vo + ts * l.head_dim + d)),
                        )
                })
            })
        };
        let released = || {
            SpecdError::InvalidRequest("KV compaction: a sliding-window part was released".into())
        };
        for &(from, to) in moves {
            if from == to {
                continue;
            }
            let (fb, fs) = (from / l.block_size, from % l.block_size);
            let (tb, ts) = (to / l.block_size, to % l.block_size);
            for &(local, n) in &parts {
                // The source by another reference (a count, not a copy),
                // so the target can be written copy-on-write.
                let src = if local {
                    self.local[fb].clone().ok_or_else(released)?
                } else {
                    self.blocks[fb].clone()
                };
                let dst = if local {
                    self.local[tb].as_mut().ok_or_else(released)?
                } else {
                    &mut self.blocks[tb]
                };
                if fb == tb {
                    drop(src);
                    match Arc::make_mut(dst) {
                        Block::F16(b) => pairs(n, fs, ts).for_each(|(i, j)| b[j] = b[i]),
                        Block::F32(b) => pairs(n, fs, ts).for_each(|(i, j)| b[j] = b[i]),
                    }
                    continue;
                }
                match (&*src, Arc::make_mut(dst)) {
                    (Block::F16(src), Block::F16(dst)) => {
                        pairs(n, fs, ts).for_each(|(i, j)| dst[j] = src[i])
                    }
                    (Block::F32(src), Block::F32(dst)) => {
                        pairs(n, fs, ts).for_each(|(i, j)| dst[j] = src[i])
                    }
                    _ => unreachable!("one cache holds one element type"),
                }
            }
        }
        Ok(())
    }

    fn run(&self, layer: usize, b: usize, o: usize) -> KvSlice<'_> {
        let n = self.layout.block_size * self.layout.head_dim;
        let (local, _) = self.layout.part(layer);
        let part = if local {
            self.local[b]
                .as_deref()
                .expect("attention reads sliding-window parts only inside the window")
        } else {
            &*self.blocks[b]
        };
        match part {
            Block::F16(x) => KvSlice::F16(&x[o..o + n]),
            Block::F32(x) => KvSlice::F32(&x[o..o + n]),
        }
    }

    /// Keys of one head in block `b`, transposed: `[head_dim][block_size]`.
    #[inline]
    pub(crate) fn keys_t(&self, layer: usize, head: usize, b: usize) -> KvSlice<'_> {
        self.run(layer, b, self.layout.offset(layer, 0, head))
    }

    /// Values of one head in block `b`: `[block_size][head_dim]`.
    #[inline]
    pub(crate) fn values(&self, layer: usize, head: usize, b: usize) -> KvSlice<'_> {
        self.run(layer, b, self.layout.offset(layer, 1, head))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout::dense(2, 2, 4, 4, KvDtype::F16)
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

    /// Layer 1 slides over `window` positions (its entries in the
    /// blocks' second part).
    fn sliding(window: usize) -> KvLayout {
        KvLayout {
            sliding: 0b10,
            window,
            ..layout()
        }
    }

    #[test]
    fn compact_moves_every_layer_and_head_across_blocks() {
        for (dtype, base) in [
            (KvDtype::F16, layout()),
            (KvDtype::F32, layout()),
            (KvDtype::F16, sliding(100)),
        ] {
            let mut c = KvCache::new(KvLayout { dtype, ..base }, 32);
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

    /// Slots 0-39 of a 6-position window read in ranges of 8 slots (2
    /// blocks): blocks 0-7 of the sliding layer go, the global layer keeps
    /// all; what stays reads back; rollbacks into released entries, and
    /// sharing a released block, are refused; a shared block carries both
    /// parts.
    #[test]
    fn sliding_parts_outside_the_window_are_released() {
        let mut c = KvCache::new(sliding(6), 64);
        c.reserve(40).unwrap();
        for slot in 0..40 {
            for layer in 0..2 {
                let k = vec![(100 * layer + slot) as f32; 8];
                c.write(layer, slot, &k, &k);
            }
        }
        c.advance(40);
        let full = c.bytes();
        assert_eq!(c.release_window(20), 2, "a query at 20 reads from slot 8");
        assert_eq!(c.release_window(40), 6);
        assert_eq!(c.release_window(40), 0);
        assert_eq!((c.num_blocks(), c.num_local_blocks()), (10, 2));
        assert_eq!(c.bytes() * 20, full * 12, "10 + 2 of 20 half-blocks");
        assert_eq!(c.bytes(), c.layout().bytes_at(40));
        assert_eq!(full, layout().bytes_at(40));
        let mut buf = Vec::new();
        for (layer, b) in [(0, 0), (0, 9), (1, 8), (1, 9)] {
            let kt = c.keys_t(layer, 0, b).widen(&mut buf).to_vec();
            assert_eq!(
                kt[0],
                (100 * layer + 4 * b) as f32,
                "layer {layer} block {b}"
            );
        }
        assert!(c.share_block(7).is_none());
        let shared = c.share_block(8).unwrap();
        assert!(c.truncate(33).is_err(), "a query at 33 reads from slot 24");
        assert_eq!(c.len(), 40);
        c.truncate(37).unwrap();
        assert_eq!((c.len(), c.num_local_blocks()), (37, 2));
        // A fresh cache takes blocks only whole: both parts come along.
        let mut d = KvCache::new(sliding(6), 64);
        assert!(d.push_shared(&shared).is_ok());
        assert_eq!(d.num_local_blocks(), 1);
        let mut dense = KvCache::new(layout(), 64);
        assert!(dense.push_shared(&shared).is_err(), "another layout");
        assert!(d.compact(&[(3, 2)]).is_ok());
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
