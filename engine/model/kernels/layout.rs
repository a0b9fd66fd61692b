//! The row-tile weight layout and the view of quantized activations every
//! kernel reads, and `drive_tiles`, the loop all quantized paths share.
//!
//! Weights (Q4_0, Q4_1, Q5_0, Q8_0) are repacked at load into tiles of 16
//! rows: one record per (tile, block) holds 8 steps of 64 bytes in which
//! 4-byte lane `l` carries 4 elements of row `l` (Q5_0: the low 4 bits,
//! then a 64-byte plane of fifth bits), then the 16 rows' f16 scales (and
//! Q4_1 minimums). K-quants (Q4_K, Q6_K) keep one record per (tile,
//! 256-element super-block): eight 32-element sub-blocks of codes in the
//! same steps, then the super-block scales and the sub-block scales, as
//! `kquant` lays them out. The SIMD paths (`simd`) depend on this module,
//! never the reverse.

use half::f16;

/// Elements per quantization block.
pub const QK: usize = 32;

/// Weight storage formats the kernels compute on directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    /// ggml Q4_K: 256-element super-blocks of 4-bit codes, 8 sub-blocks
    /// with 6-bit scales and minimums.
    Q4K,
    /// ggml Q5_K: as Q4_K with 5-bit codes.
    Q5K,
    /// ggml Q6_K: 256-element super-blocks of 6-bit codes, 16 sub-blocks
    /// with 8-bit signed scales.
    Q6K,
}

/// The quantized formats, as the integer kernels see them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    /// 4-bit codes minus 8, scale only.
    Q4_0,
    /// 4-bit codes, scale and minimum.
    Q4_1,
    /// 5-bit codes minus 16, scale only.
    Q5_0,
    /// 5-bit codes, scale and minimum.
    Q5_1,
    /// Signed bytes, scale only.
    Q8_0,
    /// 4-bit codes; per super-block a scale and a minimum scale, per
    /// 32-element sub-block 6-bit multiples of each.
    Q4K,
    /// As Q4K with a fifth code bit.
    Q5K,
    /// 6-bit codes minus 32; per super-block a scale, per 16 elements a
    /// signed 8-bit multiple of it.
    Q6K,
}

impl QuantKind {
    /// Packed code bytes per 32-element block of one row.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantKind::Q4_0 | QuantKind::Q4_1 | QuantKind::Q4K => 16,
            QuantKind::Q5_0 | QuantKind::Q5_1 | QuantKind::Q5K => 20,
            QuantKind::Q6K => 24,
            QuantKind::Q8_0 => 32,
        }
    }

    /// 32-element blocks per record: 8 (a 256-element super-block) for
    /// K-quants, else 1.
    pub fn record_blocks(self) -> usize {
        if self.is_k() {
            8
        } else {
            1
        }
    }

    /// Whether blocks carry a minimum (Q4_1, Q5_1).
    pub fn has_min(self) -> bool {
        matches!(self, QuantKind::Q4_1 | QuantKind::Q5_1)
    }

    /// Whether codes have a fifth bit in a plane (Q5_0, Q5_1).
    pub fn has_fifth_plane(self) -> bool {
        matches!(self, QuantKind::Q5_0 | QuantKind::Q5_1)
    }

    /// Whether this is a K-quant (records are super-blocks).
    pub fn is_k(self) -> bool {
        matches!(self, QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K)
    }

    /// Bytes of one raw ggml block (32 elements; 256 for K-quants).
    pub fn ggml_block_bytes(self) -> usize {
        match self {
            QuantKind::Q4_0 => 18,
            QuantKind::Q4_1 => 20,
            QuantKind::Q5_0 => 22,
            QuantKind::Q5_1 => 24,
            QuantKind::Q8_0 => 34,
            QuantKind::Q4K => 144,
            QuantKind::Q5K => 176,
            QuantKind::Q6K => 210,
        }
    }
}

// ---------------------------------------------------------------------------
// The row-tile layout.
//
// Rows are taken 16 at a time (a tile; the last one padded with zero rows).
// For each tile and block, one record holds the codes, then the 16 rows'
// scales (f16), then for Q4_1 / Q5_1 their minimums: the codes are 8 steps of 64
// bytes in which 4-byte lane `l` holds elements `4s..4s + 4` of row `l`'s
// block (Q4: two steps share 64 packed bytes, low nibbles the even step;
// Q8_0 codes are stored as `q + 128`). One AVX-512 `vpdpbusd` of a step
// against the activation's 4 bytes broadcast adds 4 products to each of the
// 16 rows (AVX2 takes the step as two 32-byte halves); after the block's 8
// steps every lane holds one row's block dot product, which one multiply by
// the 16 row scales finishes. The lanes are output rows, so a result needs
// no horizontal sum and every block costs the same however wide the row.
// Q5_0 keeps its low 4 bits as Q4 does and the fifth bits in 64 more
// bytes: byte `4l + k` holds, at bit `s`, the fifth bit of element
// `4s + k` of row `l`. All paths (portable, AVX2, VNNI) read this layout
// and run the same operation sequence per (row, activation row), so they
// agree bit for bit.
// ---------------------------------------------------------------------------

/// Rows per tile of the row-tile layout.
pub const TILE: usize = 16;

/// Bytes of one (tile, record) of the row-tile layout: a block, or for
/// K-quants a super-block (`kquant` gives its layout).
pub fn tile_record_bytes(kind: QuantKind) -> usize {
    match kind {
        QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => super::kquant::record_bytes(kind),
        _ => TILE * kind.block_bytes() + 2 * TILE * if kind.has_min() { 2 } else { 1 },
    }
}

/// Where element `e` of a row in lane `l` sits in a (tile, block) record:
/// (byte, high nibble). Q8_0: step `e / 4`, byte `e % 4` of the lane; Q4
/// (and Q5_0's low bits): steps 2t and 2t + 1 share the 64 packed bytes at
/// 64t.
#[inline]
pub(crate) fn tile_code_at(kind: QuantKind, l: usize, e: usize) -> (usize, bool) {
    let (s, k) = (e / 4, e % 4);
    match kind {
        QuantKind::Q8_0 => (64 * s + 4 * l + k, false),
        _ => (64 * (s / 2) + 4 * l + k, s % 2 == 1),
    }
}

/// A zeroed buffer of `n` bytes whose pages the kernel is asked to back
/// with transparent huge pages before they are first touched (Linux; THP
/// in `madvise` mode): weights are streamed in full every forward, and 2 MiB
/// pages spare the TLB walks and let the prefetchers run across 4 KiB
/// boundaries. Elsewhere, or if the kernel says no, a plain buffer.
pub(crate) fn huge_page_vec(n: usize) -> Vec<u8> {
    let mut v: Vec<u8> = Vec::with_capacity(n);
    #[cfg(target_os = "linux")]
    if n >= 4 << 20 {
        const HUGE: usize = 2 << 20;
        let start = v.as_ptr() as usize;
        let lo = start.div_ceil(HUGE) * HUGE;
        let hi = (start + n) / HUGE * HUGE;
        if hi > lo {
            // SAFETY: madvise is an OS ABI call that only changes the paging
            // policy of [lo, hi), which lies inside this allocation (owned,
            // not yet touched); it never moves or invalidates memory.
            unsafe {
                libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE);
            }
        }
    }
    v.resize(n, 0);
    v
}

/// Q5_0's fifth-bit plane: where the fifth bit of element `e` of lane `l`
/// sits, (byte from the plane's start, bit).
#[inline]
pub(crate) fn q5_high_at(l: usize, e: usize) -> (usize, u32) {
    (4 * l + e % 4, (e / 4) as u32)
}

/// Offset of Q5_0's fifth-bit plane in a record.
pub(crate) const Q5_HIGH: usize = TILE * 16;

/// Quantized weights in the row-tile layout.
#[derive(Debug, Clone)]
pub struct QuantWeights {
    pub kind: QuantKind,
    pub rows: usize,
    /// Blocks per row.
    pub nb: usize,
    /// `tiles * nb` records (`tile_record_bytes`), tile-major.
    pub qs: Vec<u8>,
}

impl QuantWeights {
    /// Lay out `rows` rows of `cols` elements; `block(global_block, values)`
    /// fills the block's 32 codes in element order (Q4: 0..=15, Q8: i8 bits)
    /// and returns its (scale, minimum) as f16 bits.
    fn build(
        kind: QuantKind,
        rows: usize,
        cols: usize,
        mut block: impl FnMut(usize, &mut [u8; QK]) -> (u16, u16),
    ) -> Self {
        let nb = cols / QK;
        let rec = tile_record_bytes(kind);
        let cb = TILE * kind.block_bytes();
        let mut qs = huge_page_vec(rows.div_ceil(TILE) * nb * rec);
        let mut vals = [0u8; QK];
        for r in 0..rows {
            let l = r % TILE;
            for b in 0..nb {
                let (db, mb) = block(r * nb + b, &mut vals);
                let o = ((r / TILE) * nb + b) * rec;
                let dst = &mut qs[o..o + rec];
                for (e, &v) in vals.iter().enumerate() {
                    let (i, hi) = tile_code_at(kind, l, e);
                    match kind {
                        // Q8_0 codes are stored offset to unsigned (q + 128),
                        // the operand `vpdpbusd` wants; kernels remove it.
                        QuantKind::Q8_0 => dst[i] = v ^ 0x80,
                        _ => dst[i] |= (v & 15) << if hi { 4 } else { 0 },
                    }
                    if kind.has_fifth_plane() {
                        let (hb, bit) = q5_high_at(l, e);
                        dst[Q5_HIGH + hb] |= ((v >> 4) & 1) << bit;
                    }
                }
                dst[cb + 2 * l..cb + 2 * l + 2].copy_from_slice(&db.to_le_bytes());
                if kind.has_min() {
                    let mo = cb + 2 * TILE + 2 * l;
                    dst[mo..mo + 2].copy_from_slice(&mb.to_le_bytes());
                }
            }
        }
        Self { kind, rows, nb, qs }
    }

    /// Codes of row `r` in element order, as signed weights (Q4_0 codes
    /// minus 8; Q4_1 codes 0..=15; Q5_0 codes minus 16; Q8_0 signed):
    /// `nb * 32` values.
    pub fn row_codes(&self, r: usize, out: &mut [i8]) {
        assert!(!self.kind.is_k(), "K-quant codes are read through kquant");
        assert!(out.len() >= self.nb * QK);
        let offset: i16 = match self.kind {
            QuantKind::Q4_0 => 8,
            QuantKind::Q5_0 => 16,
            QuantKind::Q4_1
            | QuantKind::Q5_1
            | QuantKind::Q4K
            | QuantKind::Q5K
            | QuantKind::Q6K => 0,
            QuantKind::Q8_0 => 128,
        };
        let rec = tile_record_bytes(self.kind);
        for b in 0..self.nb {
            let o = ((r / TILE) * self.nb + b) * rec;
            for e in 0..QK {
                let (i, hi) = tile_code_at(self.kind, r % TILE, e);
                let mut v = match self.kind {
                    QuantKind::Q8_0 => self.qs[o + i],
                    _ => (self.qs[o + i] >> if hi { 4 } else { 0 }) & 15,
                };
                if self.kind.has_fifth_plane() {
                    let (hb, bit) = q5_high_at(r % TILE, e);
                    v |= ((self.qs[o + Q5_HIGH + hb] >> bit) & 1) << 4;
                }
                out[b * QK + e] = (v as i16 - offset) as i8;
            }
        }
    }

    /// Scale of block `b` of row `r`.
    fn scale(&self, r: usize, b: usize) -> f32 {
        f16::from_bits(self.meta(r, b, 0)).to_f32()
    }

    /// Minimum of block `b` of row `r` (Q4_1, Q5_1).
    fn min(&self, r: usize, b: usize) -> f32 {
        f16::from_bits(self.meta(r, b, 1)).to_f32()
    }

    /// f16 bits of the scale (`which == 0`) or minimum of block `b` of row `r`.
    fn meta(&self, r: usize, b: usize, which: usize) -> u16 {
        let o = ((r / TILE) * self.nb + b) * tile_record_bytes(self.kind)
            + TILE * self.kind.block_bytes()
            + 2 * TILE * which
            + 2 * (r % TILE);
        u16::from_le_bytes([self.qs[o], self.qs[o + 1]])
    }
}

/// A row-major weight matrix: `rows` output features of `cols` inputs each,
/// repacked at load time.
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub(crate) data: WeightData,
}

#[derive(Debug, Clone)]
pub(crate) enum WeightData {
    F32(Vec<f32>),
    Quant(QuantWeights),
}

pub(crate) fn f16_bits_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

impl QMatrix {
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols, "weight size mismatch");
        Self {
            rows,
            cols,
            data: WeightData::F32(data),
        }
    }

    /// Repack raw ggml blocks (as stored in GGUF) of a quantized format.
    pub fn from_ggml_blocks(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        raw: &[u8],
    ) -> Result<Self, String> {
        let kind = match format {
            WeightFormat::F32 => {
                if raw.len() != rows * cols * 4 {
                    return Err(format!(
                        "F32 tensor has {} bytes, expected {}",
                        raw.len(),
                        rows * cols * 4
                    ));
                }
                let v = raw
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                return Ok(Self::from_f32(rows, cols, v));
            }
            WeightFormat::Q4_0 => QuantKind::Q4_0,
            WeightFormat::Q4_1 => QuantKind::Q4_1,
            WeightFormat::Q5_0 => QuantKind::Q5_0,
            WeightFormat::Q5_1 => QuantKind::Q5_1,
            WeightFormat::Q8_0 => QuantKind::Q8_0,
            WeightFormat::Q4K => QuantKind::Q4K,
            WeightFormat::Q5K => QuantKind::Q5K,
            WeightFormat::Q6K => QuantKind::Q6K,
        };
        let unit = QK * kind.record_blocks();
        if !cols.is_multiple_of(unit) {
            return Err(format!("row length {cols} is not a multiple of {unit}"));
        }
        let nb = rows * cols / unit;
        let bsize = kind.ggml_block_bytes();
        if raw.len() != nb * bsize {
            return Err(format!(
                "{format:?} tensor has {} bytes, expected {}",
                raw.len(),
                nb * bsize
            ));
        }
        if kind.is_k() {
            return Ok(Self {
                rows,
                cols,
                data: WeightData::Quant(super::kquant::build(kind, rows, cols, raw)),
            });
        }
        let q = QuantWeights::build(kind, rows, cols, |gb, vals| {
            let b = &raw[gb * bsize..(gb + 1) * bsize];
            match kind {
                QuantKind::Q4_0 | QuantKind::Q4_1 => {
                    let qs = &b[bsize - 16..];
                    for j in 0..16 {
                        vals[j] = qs[j] & 15;
                        vals[j + 16] = qs[j] >> 4;
                    }
                    let m = if kind == QuantKind::Q4_1 {
                        f16_bits_at(b, 2)
                    } else {
                        0
                    };
                    (f16_bits_at(b, 0), m)
                }
                QuantKind::Q5_0 | QuantKind::Q5_1 => {
                    // Q5_1 has its minimum between the scale and `qh`.
                    let o = if kind == QuantKind::Q5_1 { 4 } else { 2 };
                    let qh = u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
                    for j in 0..16 {
                        let hi = |e: usize| (((qh >> e) & 1) as u8) << 4;
                        vals[j] = (b[o + 4 + j] & 15) | hi(j);
                        vals[j + 16] = (b[o + 4 + j] >> 4) | hi(j + 16);
                    }
                    let m = if kind == QuantKind::Q5_1 {
                        f16_bits_at(b, 2)
                    } else {
                        0
                    };
                    (f16_bits_at(b, 0), m)
                }
                QuantKind::Q8_0 => {
                    vals.copy_from_slice(&b[2..34]);
                    (f16_bits_at(b, 0), 0)
                }
                QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => {
                    unreachable!("K-quants are built above")
                }
            }
        });
        Ok(Self {
            rows,
            cols,
            data: WeightData::Quant(q),
        })
    }

    pub fn format(&self) -> WeightFormat {
        match &self.data {
            WeightData::F32(_) => WeightFormat::F32,
            WeightData::Quant(q) => match q.kind {
                QuantKind::Q4_0 => WeightFormat::Q4_0,
                QuantKind::Q4_1 => WeightFormat::Q4_1,
                QuantKind::Q5_0 => WeightFormat::Q5_0,
                QuantKind::Q5_1 => WeightFormat::Q5_1,
                QuantKind::Q8_0 => WeightFormat::Q8_0,
                QuantKind::Q4K => WeightFormat::Q4K,
                QuantKind::Q5K => WeightFormat::Q5K,
                QuantKind::Q6K => WeightFormat::Q6K,
            },
        }
    }

    /// Bytes held by this matrix.
    pub fn size_bytes(&self) -> usize {
        match &self.data {
            WeightData::F32(v) => v.len() * 4,
            WeightData::Quant(q) => q.qs.len(),
        }
    }

    /// Drop this matrix from the CPU caches (see
    /// [`super::evict_from_caches`]).
    pub fn evict_from_caches(&self) -> bool {
        match &self.data {
            WeightData::F32(v) => super::evict_from_caches(v),
            WeightData::Quant(q) => super::evict_from_caches(&q.qs),
        }
    }

    /// This matrix quantized to Q8_0 (ggml rounding: per-block scale
    /// amax / 127 stored as f16), if it is F32 with rows of whole blocks.
    pub fn to_q8_0(&self) -> Option<QMatrix> {
        let WeightData::F32(v) = &self.data else {
            return None;
        };
        if !self.cols.is_multiple_of(QK) {
            return None;
        }
        let q = QuantWeights::build(QuantKind::Q8_0, self.rows, self.cols, |gb, vals| {
            let block = &v[gb * QK..(gb + 1) * QK];
            let amax = block.iter().fold(0f32, |a, &x| a.max(x.abs()));
            let scale = amax / 127.0;
            let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            for (o, &x) in vals.iter_mut().zip(block) {
                *o = (x * inv).round().clamp(-127.0, 127.0) as i8 as u8;
            }
            (f16::from_f32(scale).to_bits(), 0)
        });
        Some(QMatrix {
            rows: self.rows,
            cols: self.cols,
            data: WeightData::Quant(q),
        })
    }

    /// Dequantize one row into `out` (used for embedding lookups).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let k = self.cols;
        assert_eq!(out.len(), k);
        match &self.data {
            WeightData::F32(v) => out.copy_from_slice(&v[r * k..(r + 1) * k]),
            WeightData::Quant(q) if q.kind.is_k() => super::kquant::dequantize_row(q, r, out),
            WeightData::Quant(q) => {
                let mut codes = vec![0i8; q.nb * QK];
                q.row_codes(r, &mut codes);
                for b in 0..q.nb {
                    let d = q.scale(r, b);
                    let m = if q.kind.has_min() { q.min(r, b) } else { 0.0 };
                    for e in 0..QK {
                        out[b * QK + e] = codes[b * QK + e] as f32 * d + m;
                    }
                }
            }
        }
    }
}

/// Q8 activation blocks in element order.
#[derive(Debug, Clone, Copy)]
pub struct PlainActs<'a> {
    pub n: usize,
    pub nb: usize,
    pub qs: &'a [i8],
    /// Scale per block.
    pub qd: &'a [f32],
    /// d * sum(q) per block, f16-rounded (Q4_1's minimum term).
    pub qsum: &'a [f32],
    /// sum(q) per block.
    pub isum: &'a [i32],
    /// sum(q) of the first 16 elements per block (Q6_K's half blocks).
    pub hsum: &'a [i32],
}

/// The loop shared by the row-tile kernels: checks that `w` and `x` fit,
/// then for every tile of rows `r0..r1` and every chunk of at most
/// `max_rows` activation rows (balanced; tile-outer, so a tile's records
/// stay in L1 across chunks) calls `run(tile, i0, rows, put)`, whose kernel
/// hands its `rows x 16` results to `put`.
pub(crate) fn drive_tiles(
    w: &QuantWeights,
    x: &PlainActs<'_>,
    r0: usize,
    r1: usize,
    out: &mut [f32],
    max_rows: usize,
    mut run: impl FnMut(usize, usize, usize, &mut dyn FnMut(&[[f32; TILE]])),
) {
    check_tiles(w, x, r0, r1, out);
    let (n, nr) = (x.n, r1 - r0);
    let chunks = n.div_ceil(max_rows);
    let per = n.div_ceil(chunks.max(1));
    for t in r0 / TILE..r1.div_ceil(TILE) {
        let live = (r1 - t * TILE).min(TILE);
        let mut i0 = 0;
        while i0 < n {
            let rr = (n - i0).min(per);
            let mut put = |v: &[[f32; TILE]]| {
                for (j, lanes) in v.iter().enumerate() {
                    let o = (i0 + j) * nr + t * TILE - r0;
                    out[o..o + live].copy_from_slice(&lanes[..live]);
                }
            };
            run(t, i0, rr, &mut put);
            i0 += rr;
        }
    }
}

/// The checks every row-tile kernel relies on: `w` and `x` agree on
/// blocks per row and hold what their sizes say, `r0..r1` starts on a tile
/// and lies in `w`, and `out` holds `(r1 - r0) x n` results.
pub(crate) fn check_tiles(w: &QuantWeights, x: &PlainActs<'_>, r0: usize, r1: usize, out: &[f32]) {
    assert_eq!(
        w.nb, x.nb,
        "weights and activations disagree on blocks per row"
    );
    assert!(r0.is_multiple_of(TILE) && r0 <= r1 && r1 <= w.rows);
    assert!(w.nb.is_multiple_of(w.kind.record_blocks()));
    assert!(
        w.qs.len()
            >= w.rows.div_ceil(TILE) * (w.nb / w.kind.record_blocks()) * tile_record_bytes(w.kind)
    );
    let (n, nb) = (x.n, x.nb);
    assert!(x.qs.len() >= n * nb * QK);
    assert!(x.qd.len() >= n * nb && x.qsum.len() >= n * nb && x.isum.len() >= n * nb);
    assert!(x.hsum.len() >= n * nb);
    assert!(out.len() >= (r1 - r0) * n);
}
