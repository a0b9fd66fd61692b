//! Activation rows prepared for the matmuls: an f32 copy for F32 weights,
//! or 8-bit blocks quantized as ggml does (round half to even, f16 scale and
//! block sum, plus the exact integer sum that removes the weights' offsets).

use half::f16;

use super::layout::{PlainActs, QK};
use super::path::KernelPath;

/// Values from which `Activations::prepare` quantizes on every thread.
const PARALLEL_MIN_VALUES: usize = 1 << 15;

/// One quantizer call's outputs: scales, scaled sums, sums, half sums, codes.
pub(crate) type QuantOut<'a> = (
    &'a mut [f32],
    &'a mut [f32],
    &'a mut [i32],
    &'a mut [i32],
    &'a mut [i8],
);

/// Activation rows prepared for one or more matmuls sharing the same input.
#[derive(Debug, Default)]
pub struct Activations {
    pub path: KernelPath,
    pub rows: usize,
    pub cols: usize,
    pub(crate) f32: Vec<f32>,
    /// Q8 blocks: scale per block, sum(q) * scale per block, quants.
    pub(crate) qd: Vec<f32>,
    pub(crate) qsum: Vec<f32>,
    pub(crate) qs: Vec<i8>,
    /// sum(q) per block (exact).
    pub(crate) isum: Vec<i32>,
    /// sum(q) of each block's first 16 codes (exact; Q6_K's half blocks).
    pub(crate) hsum: Vec<i32>,
    pub(crate) quantized: bool,
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
            self.hsum.resize(nb, 0);
            self.qs.resize(rows * cols, 0);
            let path = self.path;
            let one = |x: &[f32], (d, s, i, h, q): QuantOut<'_>| match path {
                #[cfg(target_arch = "x86_64")]
                KernelPath::Avx2 | KernelPath::AvxVnni | KernelPath::Vnni | KernelPath::Amx => {
                    super::simd::quantize_blocks(x, (d, s, i, h, q))
                }
                _ => {
                    quantize_q8(x, (d, s, i, q));
                    half_sums(q, h);
                }
            };
            let out = (
                &mut self.qd[..],
                &mut self.qsum[..],
                &mut self.isum[..],
                &mut self.hsum[..],
                &mut self.qs[..],
            );
            // A prefill chunk's rows (hundreds of thousands of values, about
            // 5% of a 512-token prefill when one thread quantized them while
            // the other waited) are split over the threads; blocks are
            // independent, so the split changes no bit. A verify's few
            // rows stay on the calling thread (a hand-off costs more).
            let threads = rayon::current_num_threads();
            if nb * QK < PARALLEL_MIN_VALUES || threads < 2 {
                return one(x, out);
            }
            let per = nb.div_ceil(2 * threads).next_multiple_of(16);
            let (d, s, i, h, q) = out;
            let parts: Vec<_> = x
                .chunks(per * QK)
                .zip(d.chunks_mut(per))
                .zip(s.chunks_mut(per))
                .zip(i.chunks_mut(per))
                .zip(h.chunks_mut(per))
                .zip(q.chunks_mut(per * QK))
                .collect();
            super::team::for_each(parts, |(((((x, d), s), i), h), q)| one(x, (d, s, i, h, q)));
        }
    }

    /// The quantized rows as plain Q8 blocks.
    pub fn plain(&self) -> PlainActs<'_> {
        self.plain_rows(0..self.rows)
    }

    /// Quantized rows `rows` as plain Q8 blocks (a task of a prefill's
    /// products takes a range of activation rows against every weight row).
    pub(crate) fn plain_rows(&self, rows: std::ops::Range<usize>) -> PlainActs<'_> {
        let nb = self.cols / QK;
        let b = rows.start * nb..rows.end * nb;
        PlainActs {
            n: rows.len(),
            nb,
            qs: &self.qs[b.start * QK..b.end * QK],
            qd: &self.qd[b.clone()],
            qsum: &self.qsum[b.clone()],
            isum: &self.isum[b.clone()],
            hsum: &self.hsum[b],
        }
    }
}

/// Sum of the first 16 codes of every 32-code block (exact, in i32).
pub(crate) fn half_sums(qs: &[i8], out: &mut [i32]) {
    for (o, b) in out.iter_mut().zip(qs.chunks_exact(QK)) {
        *o = b[..QK / 2].iter().map(|&v| v as i32).sum();
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
