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

/// A row-major weight matrix: `rows` output features of `cols` inputs each,
/// repacked at load time into plain arrays (scales apart from quants).
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    data: WeightData,
}

#[derive(Debug, Clone)]
enum WeightData {
    F32(Vec<f32>),
    /// 16 bytes of nibbles per block: low nibble = element j, high = j + 16.
    Q4_0 {
        d: Vec<f32>,
        qs: Vec<u8>,
    },
    Q4_1 {
        d: Vec<f32>,
        m: Vec<f32>,
        qs: Vec<u8>,
    },
    /// Signed bytes, stored as raw `u8` (reinterpret with `as i8`).
    Q8_0 {
        d: Vec<f32>,
        qs: Vec<u8>,
    },
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
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
        if format == WeightFormat::F32 {
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
        if !cols.is_multiple_of(QK) {
            return Err(format!("row length {cols} is not a multiple of {QK}"));
        }
        let nb = rows * cols / QK;
        let bsize = match format {
            WeightFormat::Q4_0 => 18,
            WeightFormat::Q4_1 => 20,
            WeightFormat::Q8_0 => 34,
            WeightFormat::F32 => unreachable!(),
        };
        if raw.len() != nb * bsize {
            return Err(format!(
                "{format:?} tensor has {} bytes, expected {}",
                raw.len(),
                nb * bsize
            ));
        }
        let blocks = raw.chunks_exact(bsize);
        let data = match format {
            WeightFormat::Q4_0 => {
                let mut d = Vec::with_capacity(nb);
                let mut qs = Vec::with_capacity(nb * 16);
                for b in blocks {
                    d.push(f16_at(b, 0));
                    qs.extend_from_slice(&b[2..18]);
                }
                WeightData::Q4_0 { d, qs }
            }
            WeightFormat::Q4_1 => {
                let mut d = Vec::with_capacity(nb);
                let mut m = Vec::with_capacity(nb);
                let mut qs = Vec::with_capacity(nb * 16);
                for b in blocks {
                    d.push(f16_at(b, 0));
                    m.push(f16_at(b, 2));
                    qs.extend_from_slice(&b[4..20]);
                }
                WeightData::Q4_1 { d, m, qs }
            }
            WeightFormat::Q8_0 => {
                let mut d = Vec::with_capacity(nb);
                let mut qs = Vec::with_capacity(nb * 32);
                for b in blocks {
                    d.push(f16_at(b, 0));
                    qs.extend_from_slice(&b[2..34]);
                }
                WeightData::Q8_0 { d, qs }
            }
            WeightFormat::F32 => unreachable!(),
        };
        Ok(Self { rows, cols, data })
    }

    pub fn format(&self) -> WeightFormat {
        match &self.data {
            WeightData::F32(_) => WeightFormat::F32,
            WeightData::Q4_0 { .. } => WeightFormat::Q4_0,
            WeightData::Q4_1 { .. } => WeightFormat::Q4_1,
            WeightData::Q8_0 { .. } => WeightFormat::Q8_0,
        }
    }

    /// Bytes held by this matrix.
    pub fn size_bytes(&self) -> usize {
        match &self.data {
            WeightData::F32(v) => v.len() * 4,
            WeightData::Q4_0 { d, qs } => d.len() * 4 + qs.len(),
            WeightData::Q4_1 { d, m, qs } => (d.len() + m.len()) * 4 + qs.len(),
            WeightData::Q8_0 { d, qs } => d.len() * 4 + qs.len(),
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
        let nb = v.len() / QK;
        let mut d = Vec::with_capacity(nb);
        let mut qs = Vec::with_capacity(v.len());
        for block in v.chunks_exact(QK) {
            let amax = block.iter().fold(0f32, |a, &x| a.max(x.abs()));
            let scale = amax / 127.0;
            let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            d.push(f16::from_f32(scale).to_f32());
            qs.extend(
                block
                    .iter()
                    .map(|&x| (x * inv).round().clamp(-127.0, 127.0) as i8 as u8),
            );
        }
        Some(QMatrix {
            rows: self.rows,
            cols: self.cols,
            data: WeightData::Q8_0 { d, qs },
        })
    }

    /// Dequantize one row into `out` (used for embedding lookups).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let k = self.cols;
        assert_eq!(out.len(), k);
        let nb = k / QK;
        match &self.data {
            WeightData::F32(v) => out.copy_from_slice(&v[r * k..(r + 1) * k]),
            WeightData::Q4_0 { d, qs } => {
                for b in 0..nb {
                    let gb = r * nb + b;
                    let q = &qs[gb * 16..gb * 16 + 16];
                    for j in 0..16 {
                        out[b * QK + j] = ((q[j] & 15) as i32 - 8) as f32 * d[gb];
                        out[b * QK + j + 16] = ((q[j] >> 4) as i32 - 8) as f32 * d[gb];
                    }
                }
            }
            WeightData::Q4_1 { d, m, qs } => {
                for b in 0..nb {
                    let gb = r * nb + b;
                    let q = &qs[gb * 16..gb * 16 + 16];
                    for j in 0..16 {
                        out[b * QK + j] = (q[j] & 15) as f32 * d[gb] + m[gb];
                        out[b * QK + j + 16] = (q[j] >> 4) as f32 * d[gb] + m[gb];
                    }
                }
            }
            WeightData::Q8_0 { d, qs } => {
                for b in 0..nb {
                    let gb = r * nb + b;
                    for j in 0..QK {
                        out[b * QK + j] = qs[gb * QK + j] as i8 as f32 * d[gb];
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
    /// AVX2 + FMA, one block per `vpmaddubsw`.
    Avx2,
    /// AVX-512 VNNI, two blocks per `vpdpbusd` (rows with an even number
    /// of blocks; others use AVX2).
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
    quantized: bool,
    /// The same quants in the AVX-512 pair layout, when that path is used.
    #[cfg(target_arch = "x86_64")]
    pairs: super::simd::vnni::PairActs,
    #[cfg(target_arch = "x86_64")]
    use_pairs: bool,
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
        self.f32.clear();
        self.f32.extend_from_slice(x);
        self.quantized = quantize && cols.is_multiple_of(QK);
        if self.quantized {
            let nb = rows * cols / QK;
            self.qd.resize(nb, 0.0);
            self.qsum.resize(nb, 0.0);
            self.qs.resize(rows * cols, 0);
            quantize_q8(x, &mut self.qd, &mut self.qsum, &mut self.qs);
            #[cfg(target_arch = "x86_64")]
            {
                let nb = cols / QK;
                self.use_pairs = nb.is_multiple_of(2) && self.path == KernelPath::Vnni;
                if self.use_pairs {
                    self.pairs.prepare(&self.qs, &self.qd, rows, nb);
                }
            }
        }
    }
}

/// Quantize to Q8 blocks (ggml `quantize_row_q8_1`): d = amax / 127 rounded
/// to f16, q = round(x / d), sum = d * sum(q) rounded to f16.
pub fn quantize_q8(x: &[f32], d_out: &mut [f32], sum_out: &mut [f32], q_out: &mut [i8]) {
    for (b, xs) in x.chunks_exact(QK).enumerate() {
        let amax = xs.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        let q = &mut q_out[b * QK..(b + 1) * QK];
        for (qi, &xi) in q.iter_mut().zip(xs) {
            let v = (xi * id).round() as i8;
            *qi = v;
            sum += v as i32;
        }
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

#[inline]
fn sumi_q4(q: &[u8], x: &[i8], offset: i32) -> i32 {
    let mut lo = 0i32;
    let mut hi = 0i32;
    for j in 0..16 {
        lo += ((q[j] & 15) as i32 - offset) * x[j] as i32;
        hi += ((q[j] >> 4) as i32 - offset) * x[j + 16] as i32;
    }
    lo + hi
}

#[inline]
fn sumi_q8(q: &[u8], x: &[i8]) -> i32 {
    let mut s = 0i32;
    for j in 0..QK {
        s += q[j] as i8 as i32 * x[j] as i32;
    }
    s
}

/// Compute rows `r0..r1` of `w` against every activation row; result is
/// laid out weight-row-major: `out[(r - r0) * n + i]`.
fn matmul_rows(a: &Activations, w: &QMatrix, r0: usize, r1: usize, out: &mut [f32]) {
    let n = a.rows;
    let k = a.cols;
    let nb = k / QK;
    #[cfg(target_arch = "x86_64")]
    if a.quantized && a.use_pairs {
        use super::simd::{vnni, Kind};
        let wv = match &w.data {
            WeightData::Q4_0 { d, qs } => Some((Kind::Q4_0, d, &[][..], qs)),
            WeightData::Q4_1 { d, m, qs } => Some((Kind::Q4_1, d, m.as_slice(), qs)),
            WeightData::Q8_0 { d, qs } => Some((Kind::Q8_0, d, &[][..], qs)),
            WeightData::F32(_) => None,
        };
        if let Some((kind, d, m, qs)) = wv {
            let wts = vnni::Weights { kind, qs, d, m };
            vnni::rows(&wts, &a.pairs, &a.qsum, r0, r1, out);
            return;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if a.quantized && a.path != KernelPath::Portable {
        use super::simd::{Kind, Operands};
        let op = match &w.data {
            WeightData::Q4_0 { d, qs } => Some((Kind::Q4_0, d, None, qs)),
            WeightData::Q4_1 { d, m, qs } => Some((Kind::Q4_1, d, Some(m), qs)),
            WeightData::Q8_0 { d, qs } => Some((Kind::Q8_0, d, None, qs)),
            WeightData::F32(_) => None,
        };
        if let Some((kind, d, m, qs)) = op {
            let op = Operands {
                kind,
                w_qs: qs,
                w_d: d,
                w_m: m.map(|m| m.as_slice()).unwrap_or(&[]),
                x_qs: &a.qs,
                x_d: &a.qd,
                x_s: &a.qsum,
                nb,
                n,
            };
            super::simd::rows(&op, r0, r1, out);
            return;
        }
    }
    for r in r0..r1 {
        let o = &mut out[(r - r0) * n..(r - r0 + 1) * n];
        match &w.data {
            WeightData::F32(v) => {
                let wr = &v[r * k..(r + 1) * k];
                for (i, oi) in o.iter_mut().enumerate() {
                    *oi = dot_f32(wr, &a.f32[i * k..(i + 1) * k]);
                }
            }
            WeightData::Q4_0 { d, qs } | WeightData::Q4_1 { d, qs, .. } if a.quantized => {
                let (offset, m) = match &w.data {
                    WeightData::Q4_1 { m, .. } => (0, Some(m)),
                    _ => (8, None),
                };
                for (i, oi) in o.iter_mut().enumerate() {
                    let mut acc = 0f32;
                    for b in 0..nb {
                        let gb = r * nb + b;
                        let xb = i * nb + b;
                        let s = sumi_q4(
                            &qs[gb * 16..gb * 16 + 16],
                            &a.qs[xb * QK..xb * QK + QK],
                            offset,
                        );
                        acc += s as f32 * (d[gb] * a.qd[xb]);
                        if let Some(m) = m {
                            acc += m[gb] * a.qsum[xb];
                        }
                    }
                    *oi = acc;
                }
            }
            WeightData::Q8_0 { d, qs } if a.quantized => {
                for (i, oi) in o.iter_mut().enumerate() {
                    let mut acc = 0f32;
                    for b in 0..nb {
                        let gb = r * nb + b;
                        let xb = i * nb + b;
                        let s = sumi_q8(&qs[gb * QK..gb * QK + QK], &a.qs[xb * QK..xb * QK + QK]);
                        acc += s as f32 * (d[gb] * a.qd[xb]);
                    }
                    *oi = acc;
                }
            }
            _ => {
                // Quantized weights against unquantized activations (only
                // reachable if a caller skipped quantization): dequantize.
                let mut row = vec![0f32; k];
                w.dequantize_row(r, &mut row);
                for (i, oi) in o.iter_mut().enumerate() {
                    *oi = dot_f32(&row, &a.f32[i * k..(i + 1) * k]);
                }
            }
        }
    }
}

/// Rows of weights per parallel task.
const ROWS_PER_TASK: usize = 64;

/// `outs[j] = a @ ws[j]^T` for several weights sharing one input, in one
/// parallel pass. Each `outs[j]` is `a.rows x ws[j].rows`, row-major.
pub fn matmul_many(a: &Activations, ws: &[&QMatrix], outs: &mut [&mut Vec<f32>]) {
    assert_eq!(ws.len(), outs.len());
    let n = a.rows;
    let mut tasks = Vec::new();
    for (wi, w) in ws.iter().enumerate() {
        assert_eq!(w.cols, a.cols, "matmul inner dimension mismatch");
        let mut r = 0;
        while r < w.rows {
            let r1 = (r + ROWS_PER_TASK).min(w.rows);
            tasks.push((wi, r, r1));
            r = r1;
        }
    }
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(wi, r0, r1)| {
            let mut buf = vec![0f32; (r1 - r0) * n];
            matmul_rows(a, ws[wi], r0, r1, &mut buf);
            buf
        })
        .collect();
    for (w, out) in ws.iter().zip(outs.iter_mut()) {
        out.clear();
        out.resize(n * w.rows, 0.0);
    }
    for (&(wi, r0, r1), buf) in tasks.iter().zip(&results) {
        let m = ws[wi].rows;
        let out = &mut outs[wi];
        for r in r0..r1 {
            for i in 0..n {
                out[i * m + r] = buf[(r - r0) * n + i];
            }
        }
    }
}

/// Whether matmuls against `w` want quantized activations.
pub fn wants_q8(w: &QMatrix) -> bool {
    w.format() != WeightFormat::F32
}

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let k = w.len();
    for (xr, or) in x.chunks_exact(k).zip(out.chunks_exact_mut(k)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / k as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(w) {
            *o = xv * scale * wv;
        }
    }
}

pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    for (gv, &uv) in g.iter_mut().zip(u) {
        *gv = *gv / (1.0 + (-*gv).exp()) * uv;
    }
}

/// In-place softmax over `x`; returns nothing, `x` sums to 1.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_f32(a, b)
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

    fn pack(format: WeightFormat, w: &[f32], rows: usize, cols: usize) -> QMatrix {
        use candle_core::quantized::{GgmlDType, QTensor};
        let t =
            candle_core::Tensor::from_slice(w, (rows, cols), &candle_core::Device::Cpu).unwrap();
        let dt = match format {
            WeightFormat::Q4_0 => GgmlDType::Q4_0,
            WeightFormat::Q4_1 => GgmlDType::Q4_1,
            WeightFormat::Q8_0 => GgmlDType::Q8_0,
            WeightFormat::F32 => return QMatrix::from_f32(rows, cols, w.to_vec()),
        };
        let q = QTensor::quantize(&t, dt).unwrap();
        QMatrix::from_ggml_blocks(format, rows, cols, &q.data().unwrap()).unwrap()
    }

    /// Scalar reference, in f64 from the definitions: dequantized weights
    /// times dequantized activations; for Q4_1 the block minimum multiplies
    /// the activation block's stored sum (d * sum(q), kept as f16 like ggml).
    fn reference(a: &[f32], n: usize, w: &QMatrix) -> Vec<f32> {
        let k = w.cols;
        let nb = n * k / QK;
        let (mut d, mut s, mut q) = (vec![0.0; nb], vec![0.0; nb], vec![0i8; n * k]);
        quantize_q8(a, &mut d, &mut s, &mut q);
        let mut out = vec![0f32; n * w.rows];
        let mut row = vec![0f32; k];
        for r in 0..w.rows {
            w.dequantize_row(r, &mut row);
            for i in 0..n {
                let mut acc = 0f64;
                match &w.data {
                    WeightData::F32(_) => {
                        for j in 0..k {
                            acc += row[j] as f64 * a[i * k + j] as f64;
                        }
                    }
                    WeightData::Q4_1 { d: wd, m, .. } => {
                        for b in 0..k / QK {
                            let (gb, xb) = (r * k / QK + b, i * k / QK + b);
                            let mut sumi = 0f64;
                            for j in 0..QK {
                                let wq = ((row[b * QK + j] - m[gb]) / wd[gb]).round() as f64;
                                sumi += wq * q[xb * QK + j] as f64;
                            }
                            acc +=
                                sumi * wd[gb] as f64 * d[xb] as f64 + m[gb] as f64 * s[xb] as f64;
                        }
                    }
                    _ => {
                        for j in 0..k {
                            acc +=
                                row[j] as f64 * (q[i * k + j] as f32 * d[(i * k + j) / QK]) as f64;
                        }
                    }
                }
                out[i * w.rows + r] = acc as f32;
            }
        }
        out
    }

    #[test]
    fn matmul_matches_scalar_reference_every_format() {
        let mut seed = 7u64;
        for format in [
            WeightFormat::F32,
            WeightFormat::Q4_0,
            WeightFormat::Q4_1,
            WeightFormat::Q8_0,
        ] {
            for &(rows, cols, n) in &[(70usize, 64usize, 1usize), (33, 96, 3), (130, 128, 8)] {
                let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
                let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed)).collect();
                let qm = pack(format, &w, rows, cols);
                let mut a = Activations::default();
                a.prepare(&x, n, cols, wants_q8(&qm));
                let mut out = Vec::new();
                matmul_many(&a, &[&qm], &mut [&mut out]);
                let want = reference(&x, n, &qm);
                for (g, r) in out.iter().zip(&want) {
                    assert!(
                        (g - r).abs() <= 1e-3 * (1.0 + r.abs()),
                        "{format:?} {g} vs {r}"
                    );
                }
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
        let (rows, cols) = (100, 128);
        for path in KernelPath::supported() {
            for format in [
                WeightFormat::F32,
                WeightFormat::Q4_0,
                WeightFormat::Q4_1,
                WeightFormat::Q8_0,
            ] {
                let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
                let qm = pack(format, &w, rows, cols);
                let x: Vec<f32> = (0..16 * cols).map(|_| lcg(&mut seed)).collect();
                let mut a = Activations::new(path);
                a.prepare(&x, 16, cols, wants_q8(&qm));
                let mut all = Vec::new();
                matmul_many(&a, &[&qm], &mut [&mut all]);
                for n in [1usize, 2, 5, 7] {
                    for start in [0usize, 3, 16 - n] {
                        let mut b = Activations::new(path);
                        b.prepare(&x[start * cols..(start + n) * cols], n, cols, wants_q8(&qm));
                        let mut part = Vec::new();
                        matmul_many(&b, &[&qm], &mut [&mut part]);
                        assert_eq!(
                            part[..],
                            all[start * rows..(start + n) * rows],
                            "{path:?} {format:?} n={n} start={start}"
                        );
                    }
                }
            }
        }
    }
}
