//! CPU numeric kernels for the model runner.
//!
//! Invariant (batch invariance): every output element is a function of one
//! activation row and one weight row only, computed in an order that does not
//! depend on how many rows share the call. A position's logits are therefore
//! bit-identical whether it is computed alone or with other positions or
//! sequences; greedy speculation relies on this for exact losslessness.
//!
//! Quantized weights (Q4_0, Q4_1, Q8_0) multiply activations quantized to
//! 8-bit blocks of 32 (as ggml does): the integer part of each block dot
//! product is exact, and per-block scales are accumulated in block order.

use half::f16;
use rayon::prelude::*;

/// Elements per quantization block.
pub const QK: usize = 32;

/// Weight storage formats the kernels compute on directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    Q4_0,
    Q4_1,
    Q8_0,
}

/// The quantized formats, as the integer kernels see them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    /// 4-bit codes minus 8, scale only.
    Q4_0,
    /// 4-bit codes, scale and minimum.
    Q4_1,
    /// Signed bytes, scale only.
    Q8_0,
}

impl QuantKind {
    /// Packed bytes per 32-element block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantKind::Q4_0 | QuantKind::Q4_1 => 16,
            QuantKind::Q8_0 => 32,
        }
    }
}

// ---------------------------------------------------------------------------
// The row-tile layout.
//
// Rows are taken 16 at a time (a tile; the last one padded with zero rows).
// For each tile and block, one record holds the codes, then the 16 rows'
// scales (f16), then for Q4_1 their minimums: the codes are 8 steps of 64
// bytes in which 4-byte lane `l` holds elements `4s..4s + 4` of row `l`'s
// block (Q4: two steps share 64 packed bytes, low nibbles the even step;
// Q8_0 codes are stored as `q + 128`). One AVX-512 `vpdpbusd` of a step
// against the activation's 4 bytes broadcast adds 4 products to each of the
// 16 rows (AVX2 takes the step as two 32-byte halves); after the block's 8
// steps every lane holds one row's block dot product, which one multiply by
// the 16 row scales finishes. The lanes are output rows, so a result needs
// no horizontal sum and every block costs the same however wide the row.
// All paths (portable, AVX2, VNNI) read this layout and run the same
// operation sequence per (row, activation row), so they agree bit for bit.
// ---------------------------------------------------------------------------

/// Rows per tile of the row-tile layout.
pub const TILE: usize = 16;

/// Bytes of one (tile, block) record of the row-tile layout.
pub fn tile_record_bytes(kind: QuantKind) -> usize {
    TILE * kind.block_bytes() + 2 * TILE * if kind == QuantKind::Q4_1 { 2 } else { 1 }
}

/// Where element `e` of a row in lane `l` sits in a (tile, block) record:
/// (byte, high nibble). Q8_0: step `e / 4`, byte `e % 4` of the lane; Q4:
/// steps 2t and 2t + 1 share the 64 packed bytes at 64t.
#[inline]
fn tile_code_at(kind: QuantKind, l: usize, e: usize) -> (usize, bool) {
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
fn huge_page_vec(n: usize) -> Vec<u8> {
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
                }
                dst[cb + 2 * l..cb + 2 * l + 2].copy_from_slice(&db.to_le_bytes());
                if kind == QuantKind::Q4_1 {
                    let mo = cb + 2 * TILE + 2 * l;
                    dst[mo..mo + 2].copy_from_slice(&mb.to_le_bytes());
                }
            }
        }
        Self { kind, rows, nb, qs }
    }

    /// Codes of row `r` in element order, as signed weights (Q4_0 codes
    /// minus 8; Q4_1 codes 0..=15; Q8_0 signed): `nb * 32` values.
    pub fn row_codes(&self, r: usize, out: &mut [i8]) {
        assert!(out.len() >= self.nb * QK);
        let offset: i16 = match self.kind {
            QuantKind::Q4_0 => 8,
            QuantKind::Q4_1 => 0,
            QuantKind::Q8_0 => 128,
        };
        let rec = tile_record_bytes(self.kind);
        for b in 0..self.nb {
            let o = ((r / TILE) * self.nb + b) * rec;
            for e in 0..QK {
                let (i, hi) = tile_code_at(self.kind, r % TILE, e);
                let v = match self.kind {
                    QuantKind::Q8_0 => self.qs[o + i],
                    _ => (self.qs[o + i] >> if hi { 4 } else { 0 }) & 15,
                };
                out[b * QK + e] = (v as i16 - offset) as i8;
            }
        }
    }

    /// Scale of block `b` of row `r`.
    fn scale(&self, r: usize, b: usize) -> f32 {
        f16::from_bits(self.meta(r, b, 0)).to_f32()
    }

    /// Minimum of block `b` of row `r` (Q4_1).
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
    data: WeightData,
}

#[derive(Debug, Clone)]
enum WeightData {
    F32(Vec<f32>),
    Quant(QuantWeights),
}

fn f16_bits_at(b: &[u8], i: usize) -> u16 {
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
            WeightFormat::Q8_0 => QuantKind::Q8_0,
        };
        if !cols.is_multiple_of(QK) {
            return Err(format!("row length {cols} is not a multiple of {QK}"));
        }
        let nb = rows * cols / QK;
        let bsize = match kind {
            QuantKind::Q4_0 => 18,
            QuantKind::Q4_1 => 20,
            QuantKind::Q8_0 => 34,
        };
        if raw.len() != nb * bsize {
            return Err(format!(
                "{format:?} tensor has {} bytes, expected {}",
                raw.len(),
                nb * bsize
            ));
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
                QuantKind::Q8_0 => {
                    vals.copy_from_slice(&b[2..34]);
                    (f16_bits_at(b, 0), 0)
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
                QuantKind::Q8_0 => WeightFormat::Q8_0,
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
            WeightData::Quant(q) => {
                let mut codes = vec![0i8; q.nb * QK];
                q.row_codes(r, &mut codes);
                for b in 0..q.nb {
                    let d = q.scale(r, b);
                    let m = if q.kind == QuantKind::Q4_1 {
                        q.min(r, b)
                    } else {
                        0.0
                    };
                    for e in 0..QK {
                        out[b * QK + e] = codes[b * QK + e] as f32 * d + m;
                    }
                }
            }
        }
    }
}

/// Which implementation of the quantized block dot products runs. Chosen
/// once per process (`best`); tests drive each one explicitly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelPath {
    #[default]
    Portable,
    /// AVX2 + FMA + F16C: a tile as two 8-row halves, `vpmaddubsw`.
    Avx2,
    /// AVX-512 VNNI on the row-tile layout: 16 rows per vector, one
    /// `vpdpbusd` per 4-byte step of a block.
    Vnni,
}

impl KernelPath {
    /// The fastest path this CPU supports (`SPECD_NO_SIMD` / `SPECD_NO_AVX512`
    /// turn the SIMD paths off).
    pub fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if super::simd::vnni::available() {
                return Self::Vnni;
            }
            if super::simd::available() {
                return Self::Avx2;
            }
        }
        Self::Portable
    }

    /// Every path usable on this CPU.
    pub fn supported() -> Vec<Self> {
        let mut v = vec![Self::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if super::simd::available() {
                v.push(Self::Avx2);
            }
            if super::simd::vnni::available() {
                v.push(Self::Vnni);
            }
        }
        v
    }
}

/// Activation rows prepared for one or more matmuls sharing the same input.
#[derive(Debug, Default)]
pub struct Activations {
    pub path: KernelPath,
    pub rows: usize,
    pub cols: usize,
    f32: Vec<f32>,
    /// Q8 blocks: scale per block, sum(q) * scale per block, quants.
    qd: Vec<f32>,
    qsum: Vec<f32>,
    qs: Vec<i8>,
    /// sum(q) per block (exact).
    isum: Vec<i32>,
    quantized: bool,
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
}

impl Activations {
    pub fn new(path: KernelPath) -> Self {
        Self {
            path,
            ..Default::default()
        }
    }

    /// Prepare `x` (rows x cols, row-major); `quantize` when the weights
    /// it will meet are quantized.
    pub fn prepare(&mut self, x: &[f32], rows: usize, cols: usize, quantize: bool) {
        assert_eq!(x.len(), rows * cols);
        self.rows = rows;
        self.cols = cols;
        self.quantized = quantize && cols.is_multiple_of(QK);
        // The f32 copy only feeds F32 weights.
        self.f32.clear();
        if !self.quantized {
            self.f32.extend_from_slice(x);
        }
        if self.quantized {
            let nb = rows * cols / QK;
            self.qd.resize(nb, 0.0);
            self.qsum.resize(nb, 0.0);
            self.isum.resize(nb, 0);
            self.qs.resize(rows * cols, 0);
            let out = (
                &mut self.qd[..],
                &mut self.qsum[..],
                &mut self.isum[..],
                &mut self.qs[..],
            );
            match self.path {
                #[cfg(target_arch = "x86_64")]
                KernelPath::Avx2 | KernelPath::Vnni => super::simd::quantize_blocks(x, out),
                _ => quantize_q8(x, out),
            }
        }
    }

    /// The quantized rows as plain Q8 blocks.
    pub fn plain(&self) -> PlainActs<'_> {
        PlainActs {
            n: self.rows,
            nb: self.cols / QK,
            qs: &self.qs,
            qd: &self.qd,
            qsum: &self.qsum,
            isum: &self.isum,
        }
    }
}

/// Quantize to Q8 blocks (ggml `quantize_row_q8_1`, as its x86 SIMD code
/// rounds): d = amax / 127 rounded to f16, q = round-half-even(x / d),
/// sum = d * sum(q) rounded to f16. Written so the compiler vectorizes it.
/// Output: (scale, d * sum(q), sum(q)) per block and the codes.
pub fn quantize_q8(
    x: &[f32],
    (d_out, sum_out, isum_out, q_out): (&mut [f32], &mut [f32], &mut [i32], &mut [i8]),
) {
    for (b, xs) in x.chunks_exact(QK).enumerate() {
        let xs: &[f32; QK] = xs.try_into().expect("whole block");
        let mut m = [0f32; 16];
        for c in xs.chunks_exact(16) {
            for l in 0..16 {
                m[l] = m[l].max(c[l].abs());
            }
        }
        let amax = m.iter().fold(0f32, |a, &v| a.max(v));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q: &mut [i8; QK] = (&mut q_out[b * QK..(b + 1) * QK])
            .try_into()
            .expect("whole block");
        let mut sums = [0i32; 16];
        for c in 0..2 {
            for l in 0..16 {
                let v = (xs[c * 16 + l] * id).round_ties_even() as i32;
                q[c * 16 + l] = v as i8;
                sums[l] += v;
            }
        }
        let sum: i32 = sums.iter().sum();
        isum_out[b] = sum;
        let d16 = f16::from_f32(d).to_f32();
        d_out[b] = d16;
        // ggml stores s = d * sum(q) as f16; keep that rounding so Q4_1
        // results track llama.cpp's.
        sum_out[b] = f16::from_f32(sum as f32 * d16).to_f32();
    }
}

#[inline]
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent lanes, folded in a fixed order: vectorizes well and
    // gives the same result whatever the caller's batch shape.
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s = x.mul_add(*y, s);
    }
    s
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
    assert_eq!(
        w.nb, x.nb,
        "weights and activations disagree on blocks per row"
    );
    assert!(r0.is_multiple_of(TILE) && r0 <= r1 && r1 <= w.rows);
    assert!(w.qs.len() >= w.rows.div_ceil(TILE) * w.nb * tile_record_bytes(w.kind));
    let (n, nb) = (x.n, x.nb);
    assert!(x.qs.len() >= n * nb * QK);
    assert!(x.qd.len() >= n * nb && x.qsum.len() >= n * nb && x.isum.len() >= n * nb);
    let nr = r1 - r0;
    assert!(out.len() >= nr * n);
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

/// Most activation rows one portable pass over a tile serves.
const PORTABLE_MAX_ROWS: usize = 4;

/// Portable quantized rows on row tiles, written so the compiler
/// vectorizes them for any target: per block the 8 steps are unpacked once
/// to unsigned codes and met by every activation row in 16 integer lanes
/// (one per output row), starting from the offset correction; then per lane
/// `acc = fma(float(sum), d_w * d_x, acc)` (and `fma(m_w, s_x, acc)` for
/// Q4_1): the SIMD paths' sequence, so all paths agree bit for bit.
fn quant_rows_portable(q: &QuantWeights, x: &PlainActs<'_>, r0: usize, r1: usize, out: &mut [f32]) {
    let (nb, kind) = (q.nb, q.kind);
    let rec = tile_record_bytes(kind);
    let cb = TILE * kind.block_bytes();
    let offset: i32 = match kind {
        QuantKind::Q4_0 => 8,
        QuantKind::Q4_1 => 0,
        QuantKind::Q8_0 => 128,
    };
    let f16_at = |b: &[u8], i: usize| f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32();
    drive_tiles(q, x, r0, r1, out, PORTABLE_MAX_ROWS, |t, i0, rr, put| {
        let mut acc = [[0f32; TILE]; PORTABLE_MAX_ROWS];
        let mut codes = [[0u8; 64]; 8];
        for b in 0..nb {
            let o = (t * nb + b) * rec;
            let r = &q.qs[o..o + rec];
            if kind == QuantKind::Q8_0 {
                for (s, step) in codes.iter_mut().enumerate() {
                    step.copy_from_slice(&r[64 * s..64 * s + 64]);
                }
            } else {
                for t in 0..4 {
                    let (lo, hi) = codes[2 * t..2 * t + 2].split_at_mut(1);
                    for (i, &v) in r[64 * t..64 * t + 64].iter().enumerate() {
                        lo[0][i] = v & 15;
                        hi[0][i] = v >> 4;
                    }
                }
            }
            let dw: [f32; TILE] = core::array::from_fn(|l| f16_at(r, cb + 2 * l));
            let mw: [f32; TILE] = core::array::from_fn(|l| {
                if kind == QuantKind::Q4_1 {
                    f16_at(r, cb + 2 * TILE + 2 * l)
                } else {
                    0.0
                }
            });
            for (j, acc) in acc.iter_mut().enumerate().take(rr) {
                let xb = (i0 + j) * nb + b;
                let xs = &x.qs[xb * QK..(xb + 1) * QK];
                let mut ip = [-offset * x.isum[xb]; TILE];
                for (s, step) in codes.iter().enumerate() {
                    let xq: &[i8; 4] = xs[4 * s..4 * s + 4].try_into().expect("4 bytes");
                    for l in 0..TILE {
                        let w: &[u8; 4] = step[4 * l..4 * l + 4].try_into().expect("4 bytes");
                        ip[l] += (w[0] as i32 * xq[0] as i32 + w[1] as i32 * xq[1] as i32)
                            + (w[2] as i32 * xq[2] as i32 + w[3] as i32 * xq[3] as i32);
                    }
                }
                for l in 0..TILE {
                    acc[l] = (ip[l] as f32).mul_add(dw[l] * x.qd[xb], acc[l]);
                    if kind == QuantKind::Q4_1 {
                        acc[l] = mw[l].mul_add(x.qsum[xb], acc[l]);
                    }
                }
            }
        }
        put(&acc[..rr]);
    });
}

/// Compute rows `r0..r1` of `w` against every activation row; result is
/// laid out activation-row-major: `out[i * (r1 - r0) + (r - r0)]`.
fn matmul_rows(a: &Activations, w: &QMatrix, r0: usize, r1: usize, out: &mut [f32]) {
    let n = a.rows;
    let k = a.cols;
    match &w.data {
        WeightData::F32(v) => {
            for r in r0..r1 {
                let wr = &v[r * k..(r + 1) * k];
                for i in 0..n {
                    out[i * (r1 - r0) + (r - r0)] = dot_f32(wr, &a.f32[i * k..(i + 1) * k]);
                }
            }
        }
        WeightData::Quant(q) if a.quantized => match a.path {
            #[cfg(target_arch = "x86_64")]
            KernelPath::Vnni => super::simd::vnni::rows16(q, &a.plain(), r0, r1, out),
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 => super::simd::rows16(q, &a.plain(), r0, r1, out),
            _ => quant_rows_portable(q, &a.plain(), r0, r1, out),
        },
        WeightData::Quant(_) => {
            // Quantized weights against unquantized activations (only
            // reachable if a caller skipped quantization): dequantize.
            let mut row = vec![0f32; k];
            for r in r0..r1 {
                w.dequantize_row(r, &mut row);
                for i in 0..n {
                    out[i * (r1 - r0) + (r - r0)] = dot_f32(&row, &a.f32[i * k..(i + 1) * k]);
                }
            }
        }
    }
}

/// Rows of weights per parallel task.
const ROWS_PER_TASK: usize = 64;

/// Row ranges of `ROWS_PER_TASK` weight rows over `m` rows, and for each
/// range its segment of every one of the `n` output rows of `out` (row-major
/// `n x m`), split so parallel tasks can write them directly.
#[allow(clippy::type_complexity)]
fn task_segments(
    out: &mut [f32],
    m: usize,
    n: usize,
) -> (Vec<(usize, usize)>, Vec<Vec<&mut [f32]>>) {
    let bounds: Vec<(usize, usize)> = (0..m)
        .step_by(ROWS_PER_TASK)
        .map(|r| (r, (r + ROWS_PER_TASK).min(m)))
        .collect();
    let mut segs: Vec<Vec<&mut [f32]>> = bounds.iter().map(|_| Vec::with_capacity(n)).collect();
    for row in out.chunks_mut(m) {
        let mut rest = row;
        for (ti, &(r0, r1)) in bounds.iter().enumerate() {
            let (seg, tail) = rest.split_at_mut(r1 - r0);
            segs[ti].push(seg);
            rest = tail;
        }
    }
    (bounds, segs)
}

/// A parallel task: weight `wi`, its rows `r0..r1`, and the `n` output
/// segments (one per activation row) those rows fill.
type Job<'a> = (usize, usize, usize, Vec<&'a mut [f32]>);

/// `outs[j] = a @ ws[j]^T` for several weights sharing one input, in one
/// parallel pass. Each `outs[j]` is `a.rows x ws[j].rows`, row-major. Every
/// task writes its own disjoint segments of the outputs directly (no
/// full-size staging copy).
pub fn matmul_many(a: &Activations, ws: &[&QMatrix], outs: &mut [&mut Vec<f32>]) {
    assert_eq!(ws.len(), outs.len());
    let n = a.rows;
    let mut jobs: Vec<Job<'_>> = Vec::new();
    for (wi, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
        assert_eq!(w.cols, a.cols, "matmul inner dimension mismatch");
        out.clear();
        out.resize(n * w.rows, 0.0);
        if w.rows == 0 {
            continue;
        }
        let (bounds, segs) = task_segments(out, w.rows, n);
        for (&(r0, r1), s) in bounds.iter().zip(segs) {
            jobs.push((wi, r0, r1, s));
        }
    }
    jobs.into_par_iter().for_each(|(wi, r0, r1, mut segs)| {
        let nr = r1 - r0;
        let mut buf = vec![0f32; nr * n];
        matmul_rows(a, ws[wi], r0, r1, &mut buf);
        for (i, seg) in segs.iter_mut().enumerate() {
            seg.copy_from_slice(&buf[i * nr..(i + 1) * nr]);
        }
    });
}

/// SwiGLU feed-forward input: `out = silu(a @ gate^T) * (a @ up^T)`, one
/// task per row range computing both projections and combining them, so
/// there is no separate pass (or buffer) for the up projection. Each
/// element is the same arithmetic as `matmul_many` followed by `silu_mul`.
pub fn matmul_swiglu(a: &Activations, gate: &QMatrix, up: &QMatrix, out: &mut Vec<f32>) {
    assert_eq!(gate.cols, a.cols, "matmul inner dimension mismatch");
    assert_eq!(
        (gate.rows, gate.cols),
        (up.rows, up.cols),
        "gate and up shapes differ"
    );
    let (n, m) = (a.rows, gate.rows);
    out.clear();
    out.resize(n * m, 0.0);
    if m == 0 {
        return;
    }
    let (bounds, segs) = task_segments(out, m, n);
    bounds
        .into_par_iter()
        .zip(segs)
        .for_each(|((r0, r1), mut segs)| {
            let nr = r1 - r0;
            let mut g = vec![0f32; nr * n];
            let mut u = vec![0f32; nr * n];
            matmul_rows(a, gate, r0, r1, &mut g);
            matmul_rows(a, up, r0, r1, &mut u);
            silu_mul(&mut g, &u);
            for (i, seg) in segs.iter_mut().enumerate() {
                seg.copy_from_slice(&g[i * nr..(i + 1) * nr]);
            }
        });
}

/// Whether matmuls against `w` want quantized activations.
pub fn wants_q8(w: &QMatrix) -> bool {
    w.format() != WeightFormat::F32
}

/// Sum of 16 lanes folded pairwise in a fixed order.
#[inline]
pub fn fold16(mut v: [f32; 16]) -> f32 {
    let mut w = 16;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            v[l] += v[l + w];
        }
    }
    v[0]
}

/// Sum of squares in 16 fixed lanes folded in a fixed order (vectorizes;
/// the same result for a row whatever the batch).
#[inline]
fn sum_sq(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..16 {
            acc[l] = c[l].mul_add(c[l], acc[l]);
        }
    }
    rem.iter().fold(fold16(acc), |s, &v| v.mul_add(v, s))
}

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let k = w.len();
    for (xr, or) in x.chunks_exact(k).zip(out.chunks_exact_mut(k)) {
        let ss = sum_sq(xr) / k as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(w) {
            *o = xv * scale * wv;
        }
    }
}

/// `e^x` in f32 (Cephes' range reduction and degree-6 polynomial, within
/// 2 ulp), branch-free so loops over it vectorize. Exactly 0 below -87.3
/// (so -inf masks give exact zeros), +inf above 88.7.
#[inline]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // n = round-half-even(x * log2 e) by the 1.5 * 2^23 trick, which also
    // leaves n as an integer in the low mantissa bits (no float-to-int
    // conversion, so loops over this vectorize).
    const MAGIC: f32 = 12_582_912.0;
    let xc = x.clamp(-87.3, 88.3);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let r = n.mul_add(-C2, n.mul_add(-C1, xc));
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_2e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 0.166_666_65);
    p = p.mul_add(r, 0.5);
    let e = p.mul_add(r * r, r + 1.0);
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    let v = e * scale;
    if x < -87.3 {
        0.0
    } else if x > 88.7 {
        f32::INFINITY
    } else {
        v
    }
}

pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    for (gv, &uv) in g.iter_mut().zip(u) {
        *gv = *gv / (1.0 + exp_f32(-*gv)) * uv;
    }
}

/// In place, `x[i] = e^(x[i] - max)`; returns `(max, sum)`, summed in 16
/// fixed lanes folded in a fixed order. All -inf gives `(-inf, 0)` and
/// zeros; -inf entries become exact 0.
pub fn exp_shifted(x: &mut [f32]) -> (f32, f32) {
    let mut m = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..16 {
            m[l] = m[l].max(c[l]);
        }
    }
    let max = rem
        .iter()
        .chain(&m)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    if max == f32::NEG_INFINITY {
        x.fill(0.0);
        return (max, 0.0);
    }
    for v in x.iter_mut() {
        *v = exp_f32(*v - max);
    }
    let mut acc = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..16 {
            acc[l] += c[l];
        }
    }
    (max, rem.iter().fold(fold16(acc), |s, &v| s + v))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Quantize with candle (ggml's own block code), returning the raw
    /// blocks too, so references never read our repacked layout.
    fn pack(format: WeightFormat, w: &[f32], rows: usize, cols: usize) -> (QMatrix, Vec<u8>) {
        use candle_core::quantized::{GgmlDType, QTensor};
        let t =
            candle_core::Tensor::from_slice(w, (rows, cols), &candle_core::Device::Cpu).unwrap();
        let dt = match format {
            WeightFormat::Q4_0 => GgmlDType::Q4_0,
            WeightFormat::Q4_1 => GgmlDType::Q4_1,
            WeightFormat::Q8_0 => GgmlDType::Q8_0,
            WeightFormat::F32 => return (QMatrix::from_f32(rows, cols, w.to_vec()), Vec::new()),
        };
        let raw = QTensor::quantize(&t, dt).unwrap().data().unwrap().to_vec();
        let m = QMatrix::from_ggml_blocks(format, rows, cols, &raw).unwrap();
        (m, raw)
    }

    /// Block `gb` of raw ggml data: (scale, minimum, signed codes).
    fn ggml_block(format: WeightFormat, raw: &[u8], gb: usize) -> (f64, f64, [i32; QK]) {
        let f = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f64();
        let mut c = [0i32; QK];
        match format {
            WeightFormat::Q4_0 | WeightFormat::Q4_1 => {
                let size = if format == WeightFormat::Q4_0 { 18 } else { 20 };
                let b = &raw[gb * size..(gb + 1) * size];
                let off = if format == WeightFormat::Q4_0 { 8 } else { 0 };
                for j in 0..16 {
                    c[j] = (b[size - 16 + j] & 15) as i32 - off;
                    c[j + 16] = (b[size - 16 + j] >> 4) as i32 - off;
                }
                let m = if format == WeightFormat::Q4_1 {
                    f(b, 2)
                } else {
                    0.0
                };
                (f(b, 0), m, c)
            }
            WeightFormat::Q8_0 => {
                let b = &raw[gb * 34..(gb + 1) * 34];
                for j in 0..QK {
                    c[j] = b[2 + j] as i8 as i32;
                }
                (f(b, 0), 0.0, c)
            }
            WeightFormat::F32 => unreachable!(),
        }
    }

    /// Scalar reference in f64 from the ggml definitions (raw blocks, not our
    /// layout): weights times Q8-quantized activations; for Q4_1 the block
    /// minimum multiplies the activation block's stored sum (d * sum(q), kept
    /// as f16 like ggml).
    fn reference(
        x: &[f32],
        n: usize,
        format: WeightFormat,
        w: &[f32],
        raw: &[u8],
        rows: usize,
    ) -> Vec<f32> {
        let k = x.len() / n;
        let nb = k / QK;
        let (mut d, mut s, mut q) = (vec![0.0; n * nb], vec![0.0; n * nb], vec![0i8; n * k]);
        if format != WeightFormat::F32 {
            quantize_q8(x, (&mut d, &mut s, &mut vec![0; n * nb], &mut q));
        }
        let mut out = vec![0f32; n * rows];
        for r in 0..rows {
            for i in 0..n {
                let mut acc = 0f64;
                if format == WeightFormat::F32 {
                    for j in 0..k {
                        acc += w[r * k + j] as f64 * x[i * k + j] as f64;
                    }
                } else {
                    for b in 0..nb {
                        let (wd, wm, c) = ggml_block(format, raw, r * nb + b);
                        let xb = i * nb + b;
                        let sumi: i64 = (0..QK).map(|e| c[e] as i64 * q[xb * QK + e] as i64).sum();
                        acc += sumi as f64 * wd * d[xb] as f64 + wm * s[xb] as f64;
                    }
                }
                out[i * rows + r] = acc as f32;
            }
        }
        out
    }

    const FORMATS: [WeightFormat; 4] = [
        WeightFormat::F32,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q8_0,
    ];

    #[test]
    fn row_tile_layout_is_a_bijection() {
        for kind in [QuantKind::Q4_0, QuantKind::Q4_1, QuantKind::Q8_0] {
            let code_bytes = TILE * kind.block_bytes();
            let mut seen = vec![0u8; code_bytes * 2];
            for l in 0..TILE {
                for e in 0..QK {
                    let (i, hi) = tile_code_at(kind, l, e);
                    assert!(i < code_bytes, "{kind:?} l={l} e={e}");
                    // The byte lies in lane l of its 64-byte step.
                    assert_eq!((i % 64) / 4, l);
                    seen[2 * i + usize::from(hi)] += 1;
                }
            }
            let want = if kind == QuantKind::Q8_0 {
                [1, 0]
            } else {
                [1, 1]
            };
            for pair in seen.chunks_exact(2) {
                assert_eq!(pair, want, "{kind:?}");
            }
        }
        assert_eq!(tile_record_bytes(QuantKind::Q4_1), 16 * 16 + 64);
        assert_eq!(tile_record_bytes(QuantKind::Q8_0), 16 * 32 + 32);
    }

    #[test]
    fn repacked_rows_dequantize_exactly_like_ggml() {
        let mut seed = 3u64;
        for format in FORMATS[1..].iter().copied() {
            for &(rows, cols) in &[(3usize, 96usize), (2, 576), (2, 800), (1, 1536), (19, 64)] {
                let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
                let (qm, raw) = pack(format, &w, rows, cols);
                let mut row = vec![0f32; cols];
                for r in 0..rows {
                    qm.dequantize_row(r, &mut row);
                    for b in 0..cols / QK {
                        let (d, m, c) = ggml_block(format, &raw, r * cols / QK + b);
                        for e in 0..QK {
                            let want = (c[e] as f32) * d as f32 + m as f32;
                            assert_eq!(
                                row[b * QK + e],
                                want,
                                "{format:?} {rows}x{cols} r={r} b={b} e={e}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn matmul_matches_scalar_reference_every_format_path_and_shape() {
        let mut seed = 7u64;
        // Shape classes: 1 to 50 blocks per row (odd and even); SmolLM2's
        // 576 and 1536; 1 to 17 activation rows (one to five row chunks);
        // row counts that end in a partial 16-row tile, within one task and
        // across tasks of 64. Every path must also give the portable path's
        // bits.
        let shapes = [
            (70usize, 64usize, 1usize),
            (33, 96, 3),
            (130, 128, 8),
            (9, 256, 2),
            (65, 576, 5),
            (17, 800, 13),
            (8, 1536, 17),
            (5, 32, 4),
            (16, 1600, 9),
        ];
        for format in FORMATS {
            for &(rows, cols, n) in &shapes {
                let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
                let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed) * 3.0).collect();
                let (qm, raw) = pack(format, &w, rows, cols);
                let want = reference(&x, n, format, &w, &raw, rows);
                let mut first: Option<Vec<f32>> = None;
                for path in KernelPath::supported() {
                    let mut a = Activations::new(path);
                    a.prepare(&x, n, cols, wants_q8(&qm));
                    let mut out = Vec::new();
                    matmul_many(&a, &[&qm], &mut [&mut out]);
                    for (g, r) in out.iter().zip(&want) {
                        assert!(
                            (g - r).abs() <= 2e-5 * (1.0 + r.abs()) * (cols as f32).sqrt(),
                            "{path:?} {format:?} {rows}x{cols} n={n}: {g} vs {r}"
                        );
                    }
                    match &first {
                        None => first = Some(out),
                        Some(f) => assert!(
                            f.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{path:?} {format:?} {rows}x{cols} n={n}: bits differ from portable"
                        ),
                    }
                }
            }
        }
    }

    #[test]
    fn simd_quantizer_matches_the_reference_bit_for_bit() {
        let mut seed = 9u64;
        for path in KernelPath::supported() {
            for &(n, cols) in &[(1usize, 64usize), (3, 96), (5, 576), (2, 800), (4, 1536)] {
                let mut x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed) * 4.0).collect();
                x[7] = 0.0;
                x[n * cols - 32..].fill(0.0); // an all-zero block (scale 0)
                let nb = n * cols / QK;
                let (mut d, mut sm, mut q) = (vec![0.0; nb], vec![0.0; nb], vec![0i8; n * cols]);
                let mut si = vec![0i32; nb];
                quantize_q8(&x, (&mut d, &mut sm, &mut si, &mut q));
                let mut a = Activations::new(path);
                a.prepare(&x, n, cols, true);
                assert_eq!(
                    (a.qd.clone(), a.qsum.clone(), a.isum.clone(), a.qs.clone()),
                    (d, sm, si, q),
                    "{path:?} {n}x{cols}"
                );
            }
        }
    }

    #[test]
    fn exp_f32_is_within_a_few_ulp_of_libm() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp_f32(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 4.0 * f32::EPSILON as f64, "relative error {worst}");
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
    }

    #[test]
    fn exp_shifted_normalizes_to_softmax_and_zeroes_masked_entries() {
        let mut seed = 4u64;
        for len in [1usize, 5, 16, 17, 300] {
            let mut x: Vec<f32> = (0..len).map(|_| lcg(&mut seed) * 20.0).collect();
            if len > 2 {
                x[1] = f32::NEG_INFINITY;
            }
            let want: Vec<f64> = {
                let m = x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
                let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
                let s: f64 = e.iter().sum();
                e.iter().map(|v| v / s).collect()
            };
            let (_, sum) = exp_shifted(&mut x);
            x.iter_mut().for_each(|v| *v /= sum);
            for (g, w) in x.iter().zip(&want) {
                assert!((*g as f64 - w).abs() < 1e-6, "{g} vs {w}");
            }
            if len > 2 {
                assert_eq!(x[1], 0.0);
            }
        }
    }

    #[test]
    fn fused_swiglu_equals_matmul_then_silu() {
        let mut seed = 21u64;
        let (rows, cols, n) = (150usize, 96usize, 5usize);
        for path in KernelPath::supported() {
            for format in FORMATS {
                let wg: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
                let wu: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
                let (g, _) = pack(format, &wg, rows, cols);
                let (u, _) = pack(format, &wu, rows, cols);
                let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed)).collect();
                let mut a = Activations::new(path);
                a.prepare(&x, n, cols, wants_q8(&g));
                let (mut go, mut uo, mut fused) = (Vec::new(), Vec::new(), Vec::new());
                matmul_many(&a, &[&g, &u], &mut [&mut go, &mut uo]);
                silu_mul(&mut go, &uo);
                matmul_swiglu(&a, &g, &u, &mut fused);
                assert_eq!(fused, go, "{path:?} {format:?}");
            }
        }
    }

    #[test]
    fn q8_0_requantization_is_close_to_f32() {
        let mut seed = 5u64;
        let w: Vec<f32> = (0..64 * 96).map(|_| lcg(&mut seed)).collect();
        let f = QMatrix::from_f32(64, 96, w.clone());
        let q = f.to_q8_0().unwrap();
        assert_eq!(q.format(), WeightFormat::Q8_0);
        let mut row = vec![0f32; 96];
        for r in 0..64 {
            q.dequantize_row(r, &mut row);
            for (a, b) in row.iter().zip(&w[r * 96..(r + 1) * 96]) {
                assert!((a - b).abs() <= 1.0 / 127.0 + 1e-3, "{a} vs {b}");
            }
        }
        assert!(QMatrix::from_f32(2, 33, vec![0.0; 66]).to_q8_0().is_none());
    }

    #[test]
    fn matmul_is_batch_invariant() {
        let mut seed = 11u64;
        for &(rows, cols) in &[(100usize, 128usize), (40, 576), (24, 96)] {
            for path in KernelPath::supported() {
                for format in FORMATS {
                    let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
                    let (qm, _) = pack(format, &w, rows, cols);
                    let total = 20;
                    let x: Vec<f32> = (0..total * cols).map(|_| lcg(&mut seed)).collect();
                    let mut a = Activations::new(path);
                    a.prepare(&x, total, cols, wants_q8(&qm));
                    let mut all = Vec::new();
                    matmul_many(&a, &[&qm], &mut [&mut all]);
                    for n in [1usize, 2, 5, 7, 12, 13] {
                        for start in [0usize, 3, total - n] {
                            let mut b = Activations::new(path);
                            b.prepare(&x[start * cols..(start + n) * cols], n, cols, wants_q8(&qm));
                            let mut part = Vec::new();
                            matmul_many(&b, &[&qm], &mut [&mut part]);
                            assert_eq!(
                                part[..],
                                all[start * rows..(start + n) * rows],
                                "{path:?} {format:?} {rows}x{cols} n={n} start={start}"
                            );
                        }
                    }
                }
            }
        }
    }
}
