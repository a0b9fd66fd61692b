//! Matrix products on the row-tile layout: the kernel path chosen at run
//! time, the portable quantized kernel, and the rayon split of weight rows
//! into tasks (`matmul_many`, `matmul_swiglu`).
//!
//! Invariant (batch invariance): every output element is computed from one
//! activation row and one weight row by an operation sequence that does not
//! depend on how many rows share the call; every path runs the same
//! sequence per lane, so the portable, AVX2, VNNI and AMX paths agree bit
//! for bit.

use half::f16;

use super::activations::Activations;
use super::elementwise::{gelu_tanh_mul, silu_mul};
use super::layout::{
    drive_tiles, tile_record_bytes, PlainActs, QMatrix, QuantKind, QuantWeights, WeightData,
    WeightFormat, Q5_HIGH, QK, TILE,
};
use super::path::KernelPath;

#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
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

/// Most activation rows one portable pass over a tile serves.
const PORTABLE_MAX_ROWS: usize = 4;

/// Portable quantized rows on row tiles, written so the compiler
/// vectorizes them for any target: per block the 8 steps are unpacked once
/// to unsigned codes and met by every activation row in 16 integer lanes
/// (one per output row), starting from the offset correction; then per lane
/// `acc = fma(float(sum), d_w * d_x, acc)` (and `fma(m_w, s_x, acc)` for
/// Q4_1 and Q5_1): the SIMD paths' sequence, so all paths agree bit for bit.
pub(crate) fn quant_rows_portable(
    q: &QuantWeights,
    x: &PlainActs<'_>,
    r0: usize,
    r1: usize,
    out: &mut [f32],
) {
    let (nb, kind) = (q.nb, q.kind);
    let rec = tile_record_bytes(kind);
    let cb = TILE * kind.block_bytes();
    let offset: i32 = match kind {
        QuantKind::Q4_0 => 8,
        QuantKind::Q5_0 => 16,
        QuantKind::Q5_1 => 0,
        QuantKind::Q4_1 => 0,
        QuantKind::Q8_0 => 128,
        QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => {
            return super::kquant::rows_portable(q, x, r0, r1, out)
        }
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
                if kind.has_fifth_plane() {
                    let plane = &r[Q5_HIGH..Q5_HIGH + 64];
                    for (s, step) in codes.iter_mut().enumerate() {
                        for (c, &h) in step.iter_mut().zip(plane) {
                            *c |= ((h >> s) & 1) << 4;
                        }
                    }
                }
            }
            let dw: [f32; TILE] = core::array::from_fn(|l| f16_at(r, cb + 2 * l));
            let mw: [f32; TILE] = core::array::from_fn(|l| {
                if kind.has_min() {
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
                    if kind.has_min() {
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
pub(crate) fn matmul_rows(a: &Activations, w: &QMatrix, r0: usize, r1: usize, out: &mut [f32]) {
    matmul_block(a, 0..a.rows, w, r0, r1, out)
}

/// `matmul_rows` for activation rows `ar` only: `out[(i - ar.start) *
/// (r1 - r0) + (r - r0)]`. Each element is the same arithmetic whichever
/// rows share the call (the batch invariance above).
pub(crate) fn matmul_block(
    a: &Activations,
    ar: std::ops::Range<usize>,
    w: &QMatrix,
    r0: usize,
    r1: usize,
    out: &mut [f32],
) {
    let n = ar.len();
    let k = a.cols;
    let f32_rows = if a.quantized {
        &[][..]
    } else {
        &a.f32[ar.start * k..ar.end * k]
    };
    match &w.data {
        WeightData::F32(v) => {
            for r in r0..r1 {
                let wr = &v[r * k..(r + 1) * k];
                for i in 0..n {
                    out[i * (r1 - r0) + (r - r0)] = dot_f32(wr, &f32_rows[i * k..(i + 1) * k]);
                }
            }
        }
        WeightData::Quant(q) if a.quantized => match a.path {
            // Tile products pay only over full 16-row chunks; fewer rows
            // (decode, verify, trees) run faster on VNNI (the `amx` module
            // comment has the figures). Every path gives a row the same
            // bits, so the switch changes no result.
            #[cfg(target_arch = "x86_64")]
            KernelPath::Amx if n >= super::amx::MIN_ROWS => {
                super::amx::rows16(q, &a.plain_rows(ar.clone()), r0, r1, out)
            }
            #[cfg(target_arch = "x86_64")]
            KernelPath::Vnni | KernelPath::Amx => {
                super::simd::vnni::rows16(q, &a.plain_rows(ar.clone()), r0, r1, out)
            }
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 => super::simd::rows16(q, &a.plain_rows(ar.clone()), r0, r1, out),
            #[cfg(target_arch = "x86_64")]
            KernelPath::AvxVnni => {
                super::simd::avxvnni::rows16(q, &a.plain_rows(ar.clone()), r0, r1, out)
            }
            _ => quant_rows_portable(q, &a.plain_rows(ar.clone()), r0, r1, out),
        },
        WeightData::Quant(_) => {
            // Quantized weights against unquantized activations (only
            // reachable if a caller skipped quantization): dequantize.
            let mut row = vec![0f32; k];
            for r in r0..r1 {
                w.dequantize_row(r, &mut row);
                for i in 0..n {
                    out[i * (r1 - r0) + (r - r0)] = dot_f32(&row, &f32_rows[i * k..(i + 1) * k]);
                }
            }
        }
    }
}

/// Rows of weights per parallel task.
const ROWS_PER_TASK: usize = 64;

/// Products of at least this many activation rows (prefill chunks) over
/// weights of at most `ROW_SPLIT_MAX_BYTES` together split by activation
/// rows instead, `ACT_ROWS_PER_TASK` a task against every weight row: each
/// task's outputs are whole rows of the result, written in place, where a
/// split by weight rows staged each task's columns and copied them out
/// (memory copies were 3-4% of a 512-token prefill). Each task reads all
/// the weights, so only weights the caches hold (a layer's matrices, not
/// an LM head, nor a large model's layers) are split this way, and only
/// when the rows give every thread several tasks (not a batch of 64
/// decoding sequences on many threads). The split changes no bit (batch
/// invariance).
const ROW_SPLIT_MIN: usize = 128;
const ROW_SPLIT_MAX_BYTES: usize = 8 << 20;
const ACT_ROWS_PER_TASK: usize = 32;

fn split_by_activation_rows(n: usize, ws: &[&QMatrix]) -> bool {
    n >= ROW_SPLIT_MIN
        && n / ACT_ROWS_PER_TASK >= 2 * rayon::current_num_threads()
        && ws.iter().map(|w| w.size_bytes()).sum::<usize>() <= ROW_SPLIT_MAX_BYTES
}

/// Row ranges of `ROWS_PER_TASK` weight rows over `m` rows, and for each
/// range its segment of every one of the `n` output rows of `out` (row-major
/// `n x m`), split so parallel tasks can write them directly.
#[allow(clippy::type_complexity)]
pub(crate) fn task_segments(
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

/// Run `f` on two `len`-float scratch buffers of this thread, reused
/// across tasks (a forward runs thousands of tasks; allocating and zeroing
/// their buffers cost about 5% of a decode step). Their contents are stale:
/// `matmul_rows` writes every element it is given before anything reads it.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32], &mut [f32]) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
            const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    // Taken out of the cell, so a nested use (none today) would get fresh
    // buffers rather than a borrow panic.
    let (mut a, mut b) = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    if a.len() < len {
        a.resize(len, 0.0);
        b.resize(len, 0.0);
    }
    let r = f(&mut a[..len], &mut b[..len]);
    SCRATCH.with(|s| *s.borrow_mut() = (a, b));
    r
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
    if split_by_activation_rows(n, ws) {
        // A prefill chunk: each task takes a block of activation rows
        // against all of a weight's rows, writing its rows of the output
        // in place (no staging, no copy).
        let mut jobs = Vec::new();
        for (wi, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
            assert_eq!(w.cols, a.cols, "matmul inner dimension mismatch");
            out.resize(n * w.rows, 0.0);
            if w.rows == 0 {
                continue;
            }
            for (bi, chunk) in out.chunks_mut(ACT_ROWS_PER_TASK * w.rows).enumerate() {
                let i0 = bi * ACT_ROWS_PER_TASK;
                jobs.push((wi, i0..i0 + chunk.len() / w.rows, chunk));
            }
        }
        super::team::for_each(jobs, |(wi, ar, chunk)| {
            matmul_block(a, ar, ws[wi], 0, ws[wi].rows, chunk)
        });
        return;
    }
    let mut jobs: Vec<Job<'_>> = Vec::new();
    for (wi, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
        assert_eq!(w.cols, a.cols, "matmul inner dimension mismatch");
        // The tasks write every element (`task_segments` covers the
        // output), so what the buffer held is not cleared first: a
        // forward's layers reuse their buffers, and zeroing them was 2% of
        // a prefill.
        out.resize(n * w.rows, 0.0);
        if w.rows == 0 {
            continue;
        }
        let (bounds, segs) = task_segments(out, w.rows, n);
        for (&(r0, r1), s) in bounds.iter().zip(segs) {
            jobs.push((wi, r0, r1, s));
        }
    }
    super::team::for_each(jobs, |(wi, r0, r1, mut segs)| {
        let nr = r1 - r0;
        with_scratch(nr * n, |buf, _| {
            matmul_rows(a, ws[wi], r0, r1, buf);
            for (i, seg) in segs.iter_mut().enumerate() {
                seg.copy_from_slice(&buf[i * nr..(i + 1) * nr]);
            }
        });
    });
}

/// SwiGLU feed-forward input: `out = silu(a @ gate^T) * (a @ up^T)`, one
/// task per row range computing both projections and combining them, so
/// there is no separate pass (or buffer) for the up projection. Each
/// element is the same arithmetic as `matmul_many` followed by `silu_mul`.
pub fn matmul_swiglu(a: &Activations, gate: &QMatrix, up: &QMatrix, out: &mut Vec<f32>) {
    matmul_glu(a, gate, up, crate::Activation::Silu, out)
}

/// Gated feed-forward input with either gate nonlinearity:
/// `out = act(a @ gate^T) * (a @ up^T)` (SwiGLU or GeGLU), fused as
/// `matmul_swiglu` describes.
pub fn matmul_glu(
    a: &Activations,
    gate: &QMatrix,
    up: &QMatrix,
    activation: crate::Activation,
    out: &mut Vec<f32>,
) {
    assert_eq!(gate.cols, a.cols, "matmul inner dimension mismatch");
    assert_eq!(
        (gate.rows, gate.cols),
        (up.rows, up.cols),
        "gate and up shapes differ"
    );
    let (n, m) = (a.rows, gate.rows);
    // Every element is written below (as in `matmul_many`).
    out.resize(n * m, 0.0);
    if m == 0 {
        return;
    }
    let glu = |g: &mut [f32], u: &mut [f32]| match activation {
        crate::Activation::Silu => silu_mul(g, u),
        crate::Activation::GeluTanh => gelu_tanh_mul(g, u),
    };
    if split_by_activation_rows(n, &[gate, up]) {
        // A prefill chunk, split by activation rows as in `matmul_many`:
        // the gate lands in place, the up projection in scratch.
        let jobs: Vec<_> = out.chunks_mut(ACT_ROWS_PER_TASK * m).enumerate().collect();
        super::team::for_each(jobs, |(bi, g)| {
            let i0 = bi * ACT_ROWS_PER_TASK;
            let ar = i0..i0 + g.len() / m;
            with_scratch(g.len(), |u, _| {
                matmul_block(a, ar.clone(), gate, 0, m, g);
                matmul_block(a, ar, up, 0, m, u);
                glu(g, u);
            });
        });
        return;
    }
    let (bounds, segs) = task_segments(out, m, n);
    let jobs: Vec<_> = bounds.into_iter().zip(segs).collect();
    super::team::for_each(jobs, |((r0, r1), mut segs)| {
        let nr = r1 - r0;
        with_scratch(nr * n, |g, u| {
            matmul_rows(a, gate, r0, r1, g);
            matmul_rows(a, up, r0, r1, u);
            glu(g, u);
            for (i, seg) in segs.iter_mut().enumerate() {
                seg.copy_from_slice(&g[i * nr..(i + 1) * nr]);
            }
        });
    });
}

/// Whether matmuls against `w` want quantized activations.
pub fn wants_q8(w: &QMatrix) -> bool {
    w.format() != WeightFormat::F32
}
