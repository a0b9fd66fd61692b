//! Kernel results for every path and format against f64 references built
//! from the raw ggml blocks, bit-identity across paths, batch invariance.

use half::f16;

use super::activations::*;
use super::elementwise::*;
use super::kquant::QK_K;
use super::layout::*;
use super::matmul::*;
use super::path::*;

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
    let t = candle_core::Tensor::from_slice(w, (rows, cols), &candle_core::Device::Cpu).unwrap();
    let dt = match format {
        WeightFormat::Q4_0 => GgmlDType::Q4_0,
        WeightFormat::Q4_1 => GgmlDType::Q4_1,
        WeightFormat::Q5_0 => GgmlDType::Q5_0,
        WeightFormat::Q5_1 => GgmlDType::Q5_1,
        WeightFormat::Q8_0 => GgmlDType::Q8_0,
        WeightFormat::Q4K => GgmlDType::Q4K,
        WeightFormat::Q5K => GgmlDType::Q5K,
        WeightFormat::Q6K => GgmlDType::Q6K,
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
        WeightFormat::Q5_0 | WeightFormat::Q5_1 => {
            // Q5_0: d, qh, qs; Q5_1: d, m, qh, qs (codes not offset).
            let q51 = format == WeightFormat::Q5_1;
            let (size, o, off) = if q51 { (24, 4, 0) } else { (22, 2, 16) };
            let b = &raw[gb * size..(gb + 1) * size];
            let qh = u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
            for j in 0..16 {
                let hi = |e: usize| (((qh >> e) & 1) << 4) as i32;
                c[j] = (b[o + 4 + j] & 15) as i32 + hi(j) - off;
                c[j + 16] = (b[o + 4 + j] >> 4) as i32 + hi(j + 16) - off;
            }
            (f(b, 0), if q51 { f(b, 2) } else { 0.0 }, c)
        }
        WeightFormat::Q8_0 => {
            let b = &raw[gb * 34..(gb + 1) * 34];
            for j in 0..QK {
                c[j] = b[2 + j] as i8 as i32;
            }
            (f(b, 0), 0.0, c)
        }
        _ => unreachable!("{format:?} has no 32-element ggml blocks"),
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

/// `qm` times the `n` rows of `x` on every supported path: within
/// `2e-5 * (scale + |r|) * sqrt(cols)` of the reference `want`, and every
/// path bit-identical to the portable one.
fn assert_every_path(qm: &QMatrix, x: &[f32], n: usize, want: &[f32], scale: f32, what: &str) {
    let (rows, cols) = (qm.rows, qm.cols);
    let mut first: Option<Vec<f32>> = None;
    for path in KernelPath::supported() {
        let mut a = Activations::new(path);
        a.prepare(x, n, cols, wants_q8(qm));
        let mut out = Vec::new();
        matmul_many(&a, &[qm], &mut [&mut out]);
        for (g, r) in out.iter().zip(want) {
            assert!(
                (g - r).abs() <= 2e-5 * (scale + r.abs()) * (cols as f32).sqrt(),
                "{path:?} {what} {rows}x{cols} n={n}: {g} vs {r}"
            );
        }
        match &first {
            None => first = Some(out),
            Some(f) => assert!(
                f.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{path:?} {what} {rows}x{cols} n={n}: bits differ from portable"
            ),
        }
    }
}

const FORMATS: [WeightFormat; 6] = [
    WeightFormat::F32,
    WeightFormat::Q4_0,
    WeightFormat::Q4_1,
    WeightFormat::Q5_0,
    WeightFormat::Q5_1,
    WeightFormat::Q8_0,
];

#[test]
fn row_tile_layout_is_a_bijection() {
    for kind in [
        QuantKind::Q4_0,
        QuantKind::Q4_1,
        QuantKind::Q5_0,
        QuantKind::Q5_1,
        QuantKind::Q8_0,
    ] {
        // Code bytes (Q5_0: its low nibbles; the fifth bits are below).
        let code_bytes = TILE * if kind == QuantKind::Q8_0 { 32 } else { 16 };
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
    // Q5_0's fifth bits: one bit per (lane, element), in lane l's 4 bytes.
    let mut seen = [0u8; 64];
    for l in 0..TILE {
        for e in 0..QK {
            let (b, bit) = q5_high_at(l, e);
            assert_eq!(b / 4, l);
            assert_eq!(seen[b] & (1 << bit), 0, "l={l} e={e}");
            seen[b] |= 1 << bit;
        }
    }
    assert!(seen.iter().all(|&v| v == 0xff));
    assert_eq!(tile_record_bytes(QuantKind::Q4_1), 16 * 16 + 64);
    assert_eq!(tile_record_bytes(QuantKind::Q5_0), 16 * 22);
    assert_eq!(tile_record_bytes(QuantKind::Q5_1), 16 * 24);
    assert_eq!(tile_record_bytes(QuantKind::Q8_0), 16 * 32 + 32);
}

#[test]
fn repacked_rows_dequantize_exactly_like_ggml() {
    let mut seed = 3u64;
    for format in FORMATS[1..].iter().copied() {
        for &(rows, cols) in &[(3usize, 96usize), (2, 576), (2, 800), (1, 1536), (19, 64)] {
            let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
            let (qm, raw) = pack(format, &w, rows, cols);
            // ggml's own decoder (through candle) agrees bit for bit too.
            let candle = candle_dequantize(format, &raw, rows, cols);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                qm.dequantize_row(r, &mut row);
                assert_eq!(
                    row[..],
                    candle[r * cols..(r + 1) * cols],
                    "{format:?} r={r}"
                );
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
            assert_every_path(&qm, &x, n, &want, 1.0, &format!("{format:?}"));
        }
    }
}

#[test]
fn simd_quantizer_matches_the_reference_bit_for_bit() {
    let mut seed = 9u64;
    for path in KernelPath::supported() {
        // Up to 16 blocks, several groups of 16 with a remainder, and rows
        // enough to be split over threads.
        let shapes = [
            (1usize, 64usize),
            (3, 96),
            (5, 576),
            (2, 800),
            (4, 1536),
            (17, 608),
            (40, 1536),
        ];
        for &(n, cols) in &shapes {
            let mut x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed) * 4.0).collect();
            x[7] = 0.0;
            x[n * cols - 32..].fill(0.0); // an all-zero block (scale 0)
            x[32..64].fill(0.0); // and one among the first 16
            let nb = n * cols / QK;
            let (mut d, mut sm, mut q) = (vec![0.0; nb], vec![0.0; nb], vec![0i8; n * cols]);
            let mut si = vec![0i32; nb];
            quantize_q8(&x, (&mut d, &mut sm, &mut si, &mut q));
            let hs: Vec<i32> = q
                .chunks_exact(QK)
                .map(|b| b[..QK / 2].iter().map(|&v| i32::from(v)).sum())
                .collect();
            let mut a = Activations::new(path);
            a.prepare(&x, n, cols, true);
            assert_eq!(
                (a.qd.clone(), a.qsum.clone(), a.isum.clone(), a.qs.clone()),
                (d, sm, si, q),
                "{path:?} {n}x{cols}"
            );
            assert_eq!(a.hsum, hs, "{path:?} {n}x{cols}: half sums");
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

/// A version of `exp_shifted`; `None` where it cannot run here.
type ExpShifted = dyn Fn(&mut [f32]) -> Option<(f32, f32)>;

#[test]
fn exp_shifted_gives_the_portable_bits_on_every_length_and_mask() {
    // The dispatching version (16-lane AVX-512 where it runs) against the
    // portable loop: prefill, verify and decode attention must agree bit
    // for bit whatever path a row takes.
    let mut seed = 9u64;
    for len in (0usize..70).chain([127, 128, 129, 300, 1024]) {
        for pattern in 0..4 {
            let mut x: Vec<f32> = (0..len)
                .map(|i| match (pattern, i % 7) {
                    (1, 3) => f32::NEG_INFINITY,
                    (2, _) => f32::NEG_INFINITY,
                    (3, 0) => lcg(&mut seed) * 300.0,
                    _ => lcg(&mut seed) * 40.0,
                })
                .collect();
            if pattern == 2 && len > 5 {
                x[len / 2] = lcg(&mut seed);
            }
            let mut want = x.clone();
            let w = exp_shifted_portable(&mut want);
            let wb: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
            let check = |f: &ExpShifted, path: &str| {
                let mut x = x.clone();
                let Some(g) = f(&mut x) else {
                    return;
                };
                assert_eq!(
                    (g.0.to_bits(), g.1.to_bits()),
                    (w.0.to_bits(), w.1.to_bits()),
                    "{path}: len {len} pattern {pattern}"
                );
                let gb: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
                assert_eq!(gb, wb, "{path}: len {len} pattern {pattern}");
            };
            check(&|x| Some(exp_shifted(x)), "dispatched");
            // The 8-lane version too, which this CPU's dispatch may skip.
            #[cfg(target_arch = "x86_64")]
            check(&super::simd::attn::exp_shifted_avx2, "avx2");
        }
    }
}

#[test]
fn fused_swiglu_equals_matmul_then_silu() {
    let mut seed = 21u64;
    let (rows, cols) = (150usize, 96usize);
    // 5 rows split by weight rows, 130 by activation rows (a prefill's,
    // on two threads).
    for (path, n) in KernelPath::supported()
        .into_iter()
        .flat_map(|p| [(p, 5), (p, 130)])
    {
        for format in FORMATS {
            let wg: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
            let wu: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
            let (g, _) = pack(format, &wg, rows, cols);
            let (u, _) = pack(format, &wu, rows, cols);
            let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed)).collect();
            let mut a = Activations::new(path);
            a.prepare(&x, n, cols, wants_q8(&g));
            let (mut go, mut uo) = (Vec::new(), Vec::new());
            // A stale output buffer: nothing of it may survive.
            let mut fused = vec![f32::NAN; n * rows];
            two_threads().install(|| {
                matmul_many(&a, &[&g, &u], &mut [&mut go, &mut uo]);
                silu_mul(&mut go, &uo);
                matmul_swiglu(&a, &g, &u, &mut fused);
            });
            assert_eq!(fused, go, "{path:?} {format:?} n={n}");
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
                batch_invariant(&qm, path, &mut seed, &format!("{format:?}"));
            }
        }
    }
}

/// `qm`'s products of 164 activation rows at once (a prefill's split by
/// activation rows, 32 a task and a remainder of 4, on two threads) give
/// each row the bits of products of 1 to 13 and 70 rows (decode and
/// verify's split by weight rows), and of 130 rows starting anywhere
/// (split by activation rows).
fn batch_invariant(qm: &QMatrix, path: KernelPath, seed: &mut u64, what: &str) {
    two_threads().install(|| batch_invariant_here(qm, path, seed, what))
}

/// A pool of two threads: whether a product splits by activation rows
/// depends on the threads (two tasks a thread at least).
fn two_threads() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("a pool of two threads")
}

fn batch_invariant_here(qm: &QMatrix, path: KernelPath, seed: &mut u64, what: &str) {
    let (rows, cols) = (qm.rows, qm.cols);
    let total = 164;
    let x: Vec<f32> = (0..total * cols).map(|_| lcg(seed)).collect();
    let mut a = Activations::new(path);
    a.prepare(&x, total, cols, wants_q8(qm));
    let mut all = Vec::new();
    matmul_many(&a, &[qm], &mut [&mut all]);
    // One output buffer for every call, stale (NaN at first, then the
    // last call's), longer, shorter and as long as each result: nothing
    // of it may survive a call.
    let mut part = vec![f32::NAN; 9 * rows];
    for n in [1usize, 2, 5, 7, 12, 13, 70, 130] {
        for start in [0usize, 3, total - n] {
            let mut b = Activations::new(path);
            b.prepare(&x[start * cols..(start + n) * cols], n, cols, wants_q8(qm));
            matmul_many(&b, &[qm], &mut [&mut part]);
            assert_eq!(
                part[..],
                all[start * rows..(start + n) * rows],
                "{path:?} {what} {rows}x{cols} n={n} start={start}"
            );
        }
    }
}

#[test]
fn k_quant_matmul_is_batch_invariant() {
    let mut seed = 19u64;
    for format in K_FORMATS {
        let (rows, cols) = (40, 512);
        let raw = random_k_blocks(format, rows, cols, &mut seed);
        let qm = QMatrix::from_ggml_blocks(format, rows, cols, &raw).unwrap();
        for path in KernelPath::supported() {
            batch_invariant(&qm, path, &mut seed, &format!("{format:?}"));
        }
    }
}

// ---------------------------------------------------------------- K-quants

const K_FORMATS: [WeightFormat; 3] = [WeightFormat::Q4K, WeightFormat::Q5K, WeightFormat::Q6K];

/// Raw ggml blocks dequantized by candle (ggml's own decoder, not ours):
/// the reference weights.
fn candle_dequantize(format: WeightFormat, raw: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
    let dt = match format {
        WeightFormat::Q4_0 => GgmlDType::Q4_0,
        WeightFormat::Q4_1 => GgmlDType::Q4_1,
        WeightFormat::Q5_0 => GgmlDType::Q5_0,
        WeightFormat::Q5_1 => GgmlDType::Q5_1,
        WeightFormat::Q8_0 => GgmlDType::Q8_0,
        WeightFormat::Q4K => GgmlDType::Q4K,
        WeightFormat::Q5K => GgmlDType::Q5K,
        WeightFormat::Q6K => GgmlDType::Q6K,
        WeightFormat::F32 => unreachable!(),
    };
    let q = qtensor_from_ggml(dt, raw, vec![rows, cols], &candle_core::Device::Cpu).unwrap();
    q.dequantize(&candle_core::Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Random raw K-quant blocks: every code, scale and minimum bit pattern is
/// reachable (Q6_K scales down to -128, 6-bit Q4_K scales up to 63); the
/// f16 super-block scales are drawn from a sane range.
fn random_k_blocks(format: WeightFormat, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
    let mut byte = || ((lcg(seed) + 1.0) * 128.0) as u8;
    let n = rows * cols / QK_K;
    let mut raw = Vec::new();
    for _ in 0..n {
        match format {
            WeightFormat::Q4K | WeightFormat::Q5K => {
                let d = f16::from_f32(0.001 + 0.01 * (byte() as f32 / 255.0));
                let dmin = f16::from_f32(0.02 * (byte() as f32 / 255.0));
                raw.extend(d.to_le_bytes());
                raw.extend(dmin.to_le_bytes());
                let rest = if format == WeightFormat::Q4K {
                    140
                } else {
                    172
                };
                raw.extend((0..rest).map(|_| byte()));
            }
            _ => {
                raw.extend((0..208).map(|_| byte()));
                raw.extend(f16::from_f32(0.0005 + 0.002 * (byte() as f32 / 255.0)).to_le_bytes());
            }
        }
    }
    raw
}

/// f64 reference of a K-quant matmul: candle's dequantized weights times
/// the Q8-quantized activations, block by block.
fn reference_k(x: &[f32], n: usize, wq: &[f32], rows: usize) -> Vec<f32> {
    let k = x.len() / n;
    let nb = k / QK;
    let (mut d, mut s, mut q) = (vec![0.0; n * nb], vec![0.0; n * nb], vec![0i8; n * k]);
    quantize_q8(x, (&mut d, &mut s, &mut vec![0; n * nb], &mut q));
    let mut out = vec![0f32; n * rows];
    for r in 0..rows {
        for i in 0..n {
            let mut acc = 0f64;
            for b in 0..nb {
                let xb = i * nb + b;
                let dot: f64 = (0..QK)
                    .map(|e| wq[r * k + b * QK + e] as f64 * q[xb * QK + e] as f64)
                    .sum();
                acc += dot * d[xb] as f64;
            }
            out[i * rows + r] = acc as f32;
        }
    }
    out
}

#[test]
fn k_quant_records_have_the_documented_size() {
    // Within 3% of ggml's bytes per super-block row: Q4_K 148 vs 144,
    // Q5_K 180 vs 176, Q6_K 210 vs 210.
    assert_eq!(tile_record_bytes(QuantKind::Q4K), 16 * 148);
    assert_eq!(tile_record_bytes(QuantKind::Q5K), 16 * 180);
    assert_eq!(tile_record_bytes(QuantKind::Q6K), 16 * 210);
    let mut seed = 1u64;
    for format in K_FORMATS {
        let (rows, cols) = (48, 1536);
        let raw = random_k_blocks(format, rows, cols, &mut seed);
        let m = QMatrix::from_ggml_blocks(format, rows, cols, &raw).unwrap();
        assert_eq!(m.format(), format);
        assert!(
            m.size_bytes() as f64 <= raw.len() as f64 * 1.03,
            "{format:?}"
        );
        // Rows that are not whole super-blocks, and short data, are refused.
        let err = QMatrix::from_ggml_blocks(format, 2, 576, &raw[..2 * 576]).unwrap_err();
        assert!(err.contains("multiple of 256"), "{err}");
        let err = QMatrix::from_ggml_blocks(format, rows, cols, &raw[1..]).unwrap_err();
        assert!(err.contains("bytes, expected"), "{err}");
    }
}

#[test]
fn k_quant_rows_dequantize_exactly_like_ggml() {
    let mut seed = 13u64;
    for format in K_FORMATS {
        for &(rows, cols) in &[(3usize, 256usize), (17, 512), (2, 1536)] {
            // Blocks from ggml's quantizer, and random raw blocks.
            let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
            let (_, quantized) = pack(format, &w, rows, cols);
            for raw in [quantized, random_k_blocks(format, rows, cols, &mut seed)] {
                let want = candle_dequantize(format, &raw, rows, cols);
                let m = QMatrix::from_ggml_blocks(format, rows, cols, &raw).unwrap();
                let mut row = vec![0f32; cols];
                for r in 0..rows {
                    m.dequantize_row(r, &mut row);
                    for (e, (g, w)) in row.iter().zip(&want[r * cols..]).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{format:?} {rows}x{cols} r={r} e={e}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn k_quant_matmul_matches_reference_and_is_identical_on_every_path() {
    let mut seed = 17u64;
    // 1 to 10 super-blocks per row, 1 to 17 activation rows, partial tiles
    // and row ranges across tasks of 64.
    let shapes = [
        (70usize, 256usize, 1usize),
        (33, 512, 3),
        (130, 256, 8),
        (17, 768, 13),
        (8, 1536, 17),
        (65, 1536, 5),
        (16, 2560, 9),
    ];
    for format in K_FORMATS {
        for &(rows, cols, n) in &shapes {
            let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed) * 3.0).collect();
            let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
            let (_, quantized) = pack(format, &w, rows, cols);
            for (what, raw) in [
                ("quantized", quantized),
                ("random", random_k_blocks(format, rows, cols, &mut seed)),
            ] {
                let qm = QMatrix::from_ggml_blocks(format, rows, cols, &raw).unwrap();
                let wq = candle_dequantize(format, &raw, rows, cols);
                let want = reference_k(&x, n, &wq, rows);
                let scale = wq.iter().fold(0f32, |a, v| a.max(v.abs()));
                assert_every_path(&qm, &x, n, &want, scale, &format!("{format:?} {what}"));
            }
        }
    }
}

#[test]
fn k_quant_matmul_is_batch_invariant_and_fuses_swiglu() {
    let mut seed = 19u64;
    for format in K_FORMATS {
        for &(rows, cols) in &[(100usize, 256usize), (40, 768)] {
            let raw = random_k_blocks(format, rows, cols, &mut seed);
            let qm = QMatrix::from_ggml_blocks(format, rows, cols, &raw).unwrap();
            let up = QMatrix::from_ggml_blocks(
                format,
                rows,
                cols,
                &random_k_blocks(format, rows, cols, &mut seed),
            )
            .unwrap();
            let total = 20;
            let x: Vec<f32> = (0..total * cols).map(|_| lcg(&mut seed)).collect();
            for path in KernelPath::supported() {
                let mut a = Activations::new(path);
                a.prepare(&x, total, cols, true);
                let mut all = Vec::new();
                matmul_many(&a, &[&qm], &mut [&mut all]);
                for n in [1usize, 2, 5, 7, 12, 13] {
                    for start in [0usize, 3, total - n] {
                        let mut b = Activations::new(path);
                        b.prepare(&x[start * cols..(start + n) * cols], n, cols, true);
                        let mut part = Vec::new();
                        matmul_many(&b, &[&qm], &mut [&mut part]);
                        assert_eq!(
                            part[..],
                            all[start * rows..(start + n) * rows],
                            "{path:?} {format:?} {rows}x{cols} n={n} start={start}"
                        );
                    }
                }
                let (mut go, mut uo, mut fused) = (Vec::new(), Vec::new(), Vec::new());
                matmul_many(&a, &[&qm, &up], &mut [&mut go, &mut uo]);
                silu_mul(&mut go, &uo);
                matmul_swiglu(&a, &qm, &up, &mut fused);
                assert_eq!(fused, go, "{path:?} {format:?}");
            }
        }
    }
}

#[test]
fn half_block_sums_match_every_quantizer() {
    let mut seed = 23u64;
    for path in KernelPath::supported() {
        let x: Vec<f32> = (0..3 * 256).map(|_| lcg(&mut seed) * 2.0).collect();
        let mut a = Activations::new(path);
        a.prepare(&x, 3, 256, true);
        for (b, &h) in a.hsum.iter().enumerate() {
            let want: i32 = a.qs[b * QK..b * QK + 16].iter().map(|&v| v as i32).sum();
            assert_eq!(h, want, "{path:?} block {b}");
        }
    }
}

/// Every code at its largest, against activations all at +127 or -127:
/// the 16-bit partial sums of the AVX2 paths must not overflow (Q5_0 and
/// Q5_K pairs of steps reach 4 * 31 * 127, Q6_K 4 * 63 * 127).
#[test]
fn extreme_codes_do_not_overflow_any_path() {
    let (rows, cols) = (32usize, 512usize);
    let d = f16::from_f32(0.01).to_le_bytes();
    for format in [
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q8_0,
        WeightFormat::Q4K,
        WeightFormat::Q5K,
        WeightFormat::Q6K,
    ] {
        let mut raw = Vec::new();
        let blocks = rows * cols
            / if K_FORMATS.contains(&format) {
                QK_K
            } else {
                QK
            };
        for _ in 0..blocks {
            match format {
                WeightFormat::Q8_0 => {
                    raw.extend(d);
                    raw.extend([0x7f; 32]);
                }
                WeightFormat::Q6K => {
                    raw.extend([0xff; 192]);
                    raw.extend([0x80; 16]); // scales -128
                    raw.extend(d);
                }
                WeightFormat::Q4K | WeightFormat::Q5K => {
                    raw.extend(d);
                    raw.extend(d);
                    let rest = if format == WeightFormat::Q4K {
                        140
                    } else {
                        172
                    };
                    raw.extend(std::iter::repeat_n(0xff, rest));
                }
                WeightFormat::Q4_1 => {
                    raw.extend(d);
                    raw.extend(d); // the minimum
                    raw.extend([0xff; 16]);
                }
                WeightFormat::Q5_0 => {
                    raw.extend(d);
                    raw.extend([0xff; 20]);
                }
                WeightFormat::Q5_1 => {
                    raw.extend(d);
                    raw.extend(d); // the minimum
                    raw.extend([0xff; 20]);
                }
                _ => {
                    raw.extend(d);
                    raw.extend([0xff; 16]);
                }
            }
        }
        let qm = QMatrix::from_ggml_blocks(format, rows, cols, &raw).unwrap();
        for sign in [1.0f32, -1.0] {
            let n = 5;
            let x = vec![sign; n * cols];
            let want = if K_FORMATS.contains(&format) {
                reference_k(&x, n, &candle_dequantize(format, &raw, rows, cols), rows)
            } else {
                reference(&x, n, format, &[], &raw, rows)
            };
            let scale = want.iter().fold(1f32, |a, v| a.max(v.abs()));
            assert_every_path(&qm, &x, n, &want, scale, &format!("{format:?} x={sign}"));
        }
    }
}

/// Evicting weights from the caches (`bench-model --cold`) leaves every
/// byte as it was: a matmul after eviction gives the same bits, on every
/// path, for a whole matrix, an unaligned slice and an empty one.
#[test]
fn evicting_weights_from_the_caches_changes_no_result() {
    let mut seed = 11u64;
    let (rows, cols) = (48, 96);
    let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
    let x: Vec<f32> = (0..3 * cols).map(|_| lcg(&mut seed)).collect();
    let on_x86 = cfg!(target_arch = "x86_64");
    for path in KernelPath::supported() {
        for format in [WeightFormat::Q4_1, WeightFormat::Q8_0, WeightFormat::F32] {
            let m = match format {
                WeightFormat::F32 => QMatrix::from_f32(rows, cols, w.clone()),
                f => pack(f, &w, rows, cols).0,
            };
            let mut a = Activations::new(path);
            a.prepare(&x, 3, cols, wants_q8(&m));
            let run = || {
                let mut out = Vec::new();
                matmul_many(&a, &[&m], &mut [&mut out]);
                out
            };
            let before = run();
            assert_eq!(m.evict_from_caches(), on_x86);
            assert_eq!(evict_from_caches(&x[1..x.len() - 1]), on_x86);
            assert_eq!(evict_from_caches::<f32>(&[]), on_x86);
            let after = run();
            assert!(
                before
                    .iter()
                    .zip(&after)
                    .all(|(p, q)| p.to_bits() == q.to_bits()),
                "{path:?} {format:?}"
            );
        }
    }
}

#[test]
fn amx_gives_every_path_the_same_bits_for_1_to_64_rows() {
    if !KernelPath::supported().contains(&KernelPath::Amx) {
        // A visible skip: this CPU (or SPECD_NO_AMX, or the OS) leaves the
        // AMX path off, so there is nothing of it to compare.
        eprintln!("SKIPPED amx_gives_every_path_the_same_bits_for_1_to_64_rows: no AMX here");
        return;
    }
    let mut seed = 29u64;
    let all = [
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q8_0,
        WeightFormat::Q4K,
        WeightFormat::Q5K,
        WeightFormat::Q6K,
    ];
    // 72 rows: a task of 64 and a partial tile; 512 columns: 16 blocks,
    // two K-quant super-blocks; 544: 17 blocks, an odd count (K-quants
    // need whole 256-element super-blocks, so 512 only).
    let (rows, total) = (72usize, 64usize);
    let shapes = all.iter().flat_map(|&f| {
        let k = matches!(f, WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K);
        let odd = (!k).then_some((f, 544usize));
        std::iter::once((f, 512usize)).chain(odd)
    });
    for (format, cols) in shapes {
        let x: Vec<f32> = (0..total * cols).map(|_| lcg(&mut seed) * 3.0).collect();
        let raw = if matches!(
            format,
            WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K
        ) {
            random_k_blocks(format, rows, cols, &mut seed)
        } else {
            let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
            pack(format, &w, rows, cols).1
        };
        let qm = QMatrix::from_ggml_blocks(format, rows, cols, &raw).unwrap();
        // Every row alone on VNNI: the bits each row must have.
        let mut want = vec![0f32; total * rows];
        for i in 0..total {
            let mut a = Activations::new(KernelPath::Vnni);
            a.prepare(&x[i * cols..(i + 1) * cols], 1, cols, true);
            let mut o = Vec::new();
            matmul_many(&a, &[&qm], &mut [&mut o]);
            want[i * rows..(i + 1) * rows].copy_from_slice(&o);
        }
        let WeightData::Quant(q) = &qm.data else {
            unreachable!("quantized")
        };
        for n in 1..=total {
            let start = (n * 7) % (total - n + 1);
            // The AMX kernel itself at every row count (the matmul routes
            // fewer than `amx::MIN_ROWS` rows to VNNI).
            let mut a = Activations::new(KernelPath::Amx);
            a.prepare(&x[start * cols..(start + n) * cols], n, cols, true);
            let mut o = vec![0f32; n * rows];
            super::amx::rows16(q, &a.plain(), 0, rows, &mut o);
            let w = &want[start * rows..(start + n) * rows];
            assert!(
                o.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                "AMX kernel {format:?} n={n}: bits differ from one row alone"
            );
            for path in [KernelPath::Amx, KernelPath::Vnni, KernelPath::Portable] {
                if path == KernelPath::Portable && n % 8 != 1 {
                    continue; // the slow path at a few sizes
                }
                let mut a = Activations::new(path);
                a.prepare(&x[start * cols..(start + n) * cols], n, cols, true);
                let mut o = Vec::new();
                matmul_many(&a, &[&qm], &mut [&mut o]);
                let w = &want[start * rows..(start + n) * rows];
                assert!(
                    o.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{path:?} {format:?} n={n}: bits differ from one row alone"
                );
            }
        }
    }
}

#[test]
fn amx_runs_only_where_it_measured_faster_than_vnni() {
    if !KernelPath::supported().contains(&KernelPath::Amx) {
        eprintln!("SKIPPED amx_runs_only_where_it_measured_faster_than_vnni: no AMX here");
        return;
    }
    if std::env::var_os("SPECD_AMX").is_some_and(|v| v == "1") {
        eprintln!("SKIPPED amx_runs_only_where_it_measured_faster_than_vnni: SPECD_AMX forces it");
        return;
    }
    let (amx, vnni) = super::amx_calibration().expect("AMX is present, so it was timed");
    assert!(amx.is_finite() && vnni.is_finite() && amx > 0.0 && vnni > 0.0);
    assert_eq!(
        KernelPath::best() == KernelPath::Amx,
        amx < 0.9 * vnni,
        "AMX {amx} us, VNNI {vnni} us"
    );
}
