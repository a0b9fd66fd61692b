//! x86-64 kernels on the group layout (see `kernels`), selected at run time.
//!
//! Both paths unpack a group of weight blocks once and apply it to a chunk
//! of activation rows. Every activation row keeps its own accumulator and
//! sees the same instruction sequence whatever the number of rows in the
//! call, so results are batch-invariant, as in the portable path.
//!
//! Offsets are removed exactly in integers: Q4_0 codes are kept as unsigned
//! nibbles and corrected with `8 * sum(x)` per lane; Q8_0 codes are made
//! unsigned with +128 (VNNI) and corrected with `128 * sum(x)`, or kept
//! signed with the sign folded into the activations (AVX2).

#![cfg(target_arch = "x86_64")]

use super::kernels::{GroupedActs, QuantKind, QuantWeights, QK};
use std::arch::x86_64::*;

/// Whether this CPU has AVX2, FMA and F16C (checked once).
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::env::var_os("SPECD_NO_SIMD").is_none()
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// Quantize `n` rows of `nb` blocks to Q8 (exactly as
/// `kernels::quantize_q8`: round half to even, f16-rounded scale and sum)
/// and write them both in element order and in the group layout.
#[allow(clippy::too_many_arguments)]
pub fn quantize_grouped(
    x: &[f32],
    n: usize,
    nb: usize,
    qd: &mut [f32],
    qsum: &mut [f32],
    qs: &mut [i8],
    g: &mut GroupedActs,
) {
    assert!(available());
    assert!(x.len() >= n * nb * QK && qs.len() >= n * nb * QK);
    assert!(qd.len() >= n * nb && qsum.len() >= n * nb);
    let plan = g.reset(n, nb);
    // SAFETY: `available()` confirmed AVX2, FMA and F16C on this CPU.
    unsafe { quantize_grouped_avx2(x, n, nb, qd, qsum, qs, g, &plan) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn quantize_grouped_avx2(
    x: &[f32],
    n: usize,
    nb: usize,
    qd: &mut [f32],
    qsum: &mut [f32],
    qs: &mut [i8],
    g: &mut GroupedActs,
    plan: &[(usize, usize)],
) {
    let (nbp, ng) = (g.nbp, g.ngroups);
    let absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    for row in 0..n {
        for (gi, &(b0, gs)) in plan.iter().enumerate() {
            let lanes = 16 / gs;
            let base = (row * nbp + b0) * QK;
            let meta = (row * ng + gi) * 16;
            for b in 0..gs.min(nb.saturating_sub(b0)) {
                let xb = row * nb + b0 + b;
                let xs = &x[xb * QK..(xb + 1) * QK];
                let v: [__m256; 4] = core::array::from_fn(|i| {
                    let c = &xs[8 * i..8 * i + 8];
                    // SAFETY: `c` holds exactly 8 floats.
                    unsafe { _mm256_loadu_ps(c.as_ptr()) }
                });
                let m = _mm256_max_ps(
                    _mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                    _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)),
                );
                let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
                let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
                let d = amax / 127.0;
                let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
                let q: [__m256i; 4] =
                    core::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id)));
                let p01 = _mm256_packs_epi32(q[0], q[1]);
                let p23 = _mm256_packs_epi32(q[2], q[3]);
                let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order);
                let dst = &mut qs[xb * QK..(xb + 1) * QK];
                // SAFETY: `dst` holds exactly 32 bytes.
                unsafe { _mm256_storeu_si256(dst.as_mut_ptr() as *mut __m256i, bytes) };
                // Sums of each 4-byte chunk (signed bytes times one).
                let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, bytes), ones16);
                let mut cs = [0i32; 8];
                let mut words = [0u32; 8];
                // SAFETY: both arrays are exactly 32 bytes.
                unsafe {
                    _mm256_storeu_si256(cs.as_mut_ptr() as *mut __m256i, sums);
                    _mm256_storeu_si256(words.as_mut_ptr() as *mut __m256i, bytes);
                }
                let total: i32 = cs.iter().sum();
                let d16 = half::f16::from_f32(d).to_f32();
                qd[xb] = d16;
                let sm = half::f16::from_f32(total as f32 * d16).to_f32();
                qsum[xb] = sm;
                for c in 0..8 {
                    let (s, u) = (c / lanes, c % lanes);
                    let l = b * lanes + u;
                    let o = base + s * 64 + l * 4;
                    g.xs[o..o + 4]
                        .copy_from_slice(&(words[c] as i32).to_le_bytes().map(|v| v as i8));
                    g.lsum[meta + l] += cs[c];
                }
                g.dx[meta + b * lanes..meta + (b + 1) * lanes].fill(d16);
                g.smin[meta + b * lanes] = sm;
            }
        }
    }
}

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

fn kind_code(k: QuantKind) -> u8 {
    match k {
        QuantKind::Q4_0 => Q4_0,
        QuantKind::Q4_1 => Q4_1,
        QuantKind::Q8_0 => Q8_0,
    }
}

/// The checks every kernel entry makes before its unchecked loads: each
/// slice covers the rows it will read.
fn check(w: &QuantWeights, x: &GroupedActs, r1: usize, r0: usize, out: &[f32]) {
    assert_eq!(
        w.nbp, x.nbp,
        "weights and activations disagree on blocks per row"
    );
    assert_eq!(w.plan.len(), x.ngroups);
    assert!(w.qs.len() >= r1 * w.nbp * w.kind.block_bytes());
    assert!(w.d.len() >= r1 * w.nbp);
    if w.kind == QuantKind::Q4_1 {
        assert!(w.m.len() >= r1 * w.nbp);
    }
    let meta = x.n * x.ngroups * 16;
    assert!(x.xs.len() >= x.n * x.nbp * QK);
    assert!(x.dx.len() >= meta && x.lsum.len() >= meta && x.smin.len() >= meta);
    assert!(out.len() >= (r1 - r0) * x.n);
}

/// Rows `r0..r1` of `w` against every activation row (AVX2), written
/// activation-row-major: `out[i * (r1 - r0) + (r - r0)]`.
pub fn rows(w: &QuantWeights, x: &GroupedActs, r0: usize, r1: usize, out: &mut [f32]) {
    assert!(available());
    check(w, x, r1, r0, out);
    // SAFETY: `available()` confirmed AVX2, FMA and F16C on this CPU.
    unsafe {
        match kind_code(w.kind) {
            Q4_0 => avx2_rows::<Q4_0>(w, x, r0, r1, out),
            Q4_1 => avx2_rows::<Q4_1>(w, x, r0, r1, out),
            _ => avx2_rows::<Q8_0>(w, x, r0, r1, out),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn avx2_rows<const K: u8>(
    w: &QuantWeights,
    x: &GroupedActs,
    r0: usize,
    r1: usize,
    out: &mut [f32],
) {
    let n = x.n;
    let mut i0 = 0;
    while i0 < n {
        let rr = (n - i0).min(4);
        for r in r0..r1 {
            let nr = r1 - r0;
            let mut put = |v: &[f32]| {
                for (j, &x) in v.iter().enumerate() {
                    out[(i0 + j) * nr + (r - r0)] = x;
                }
            };
            match rr {
                1 => put(&avx2_row::<1, K>(w, x, r, i0)),
                2 => put(&avx2_row::<2, K>(w, x, r, i0)),
                3 => put(&avx2_row::<3, K>(w, x, r, i0)),
                _ => put(&avx2_row::<4, K>(w, x, r, i0)),
            }
        }
        i0 += rr;
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum256(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// 32 bytes from `s[off..]` (bounds-checked).
#[inline]
#[target_feature(enable = "avx2")]
fn ld256<T>(s: &[T], off: usize) -> __m256i {
    let s = &s[off..off + 32 / size_of::<T>()];
    // SAFETY: `s` now holds exactly 32 bytes.
    unsafe { _mm256_loadu_si256(s.as_ptr() as *const __m256i) }
}

/// 8 floats from `s[off..]` (bounds-checked).
#[inline]
#[target_feature(enable = "avx2")]
fn ld256ps(s: &[f32], off: usize) -> __m256 {
    let s = &s[off..off + 8];
    // SAFETY: `s` now holds exactly 8 floats.
    unsafe { _mm256_loadu_ps(s.as_ptr()) }
}

/// Weight row `r` against activation rows `i0..i0 + R` (AVX2).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn avx2_row<const R: usize, const K: u8>(
    w: &QuantWeights,
    x: &GroupedActs,
    r: usize,
    i0: usize,
) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    for (gi, &(b0, g)) in w.plan.iter().enumerate() {
        match g {
            16 => avx2_group::<R, K, 8>(w, x, r, i0, gi, b0, &mut acc),
            8 => avx2_group::<R, K, 4>(w, x, r, i0, gi, b0, &mut acc),
            4 => avx2_group::<R, K, 2>(w, x, r, i0, gi, b0, &mut acc),
            _ => avx2_group::<R, K, 1>(w, x, r, i0, gi, b0, &mut acc),
        }
    }
    let mut o = [0f32; R];
    for j in 0..R {
        o[j] = hsum256(acc[j]);
    }
    o
}

/// One group of `2 * S` blocks, as two 8-lane halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn avx2_group<const R: usize, const K: u8, const S: usize>(
    w: &QuantWeights,
    x: &GroupedActs,
    r: usize,
    i0: usize,
    gi: usize,
    b0: usize,
    acc: &mut [__m256; R],
) {
    let g = 2 * S;
    let lanes = 16 / g;
    let (nbp, bb) = (w.nbp, w.kind.block_bytes());
    let wsl = &w.qs[(r * nbp + b0) * bb..(r * nbp + b0 + g) * bb];
    let ds = &w.d[r * nbp + b0..r * nbp + b0 + g];
    let ms = if K == Q4_1 {
        &w.m[r * nbp + b0..r * nbp + b0 + g]
    } else {
        &[][..]
    };
    let mask = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    for h in 0..2 {
        let mut wv = [_mm256_setzero_si256(); S];
        if K == Q8_0 {
            // Stored as q + 128; back to signed for the sign trick.
            let flip = _mm256_set1_epi8(-128);
            for s in 0..S {
                wv[s] = _mm256_xor_si256(ld256(wsl, 64 * s + 32 * h), flip);
            }
        } else if S == 1 {
            let raw = ld256(wsl, 0);
            wv[0] = if h == 0 {
                _mm256_and_si256(raw, mask)
            } else {
                _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask)
            };
        } else {
            for j in 0..S / 2 {
                let raw = ld256(wsl, 64 * j + 32 * h);
                wv[2 * j] = _mm256_and_si256(raw, mask);
                wv[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
            }
        }
        // Per-lane scales of this half: lane t is zmm lane 8h + t.
        let mut dl = [0u16; 8];
        let mut ml = [0u16; 8];
        for t in 0..8 {
            dl[t] = ds[(8 * h + t) / lanes];
            if K == Q4_1 {
                ml[t] = ms[(8 * h + t) / lanes];
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128_arr(&dl));
        let mw = _mm256_cvtph_ps(_mm_loadu_si128_arr(&ml));
        let mut wabs = wv;
        if K == Q8_0 {
            for s in 0..S {
                wabs[s] = _mm256_sign_epi8(wv[s], wv[s]);
            }
        }
        for j in 0..R {
            let row = i0 + j;
            let xo = (row * nbp + b0) * QK;
            let xsl = &x.xs[xo..xo + g * QK];
            let mo = (row * x.ngroups + gi) * 16 + 8 * h;
            let mut ip = _mm256_setzero_si256();
            if K == Q8_0 {
                for s in 0..S {
                    let xv = ld256(xsl, 64 * s + 32 * h);
                    let p = _mm256_maddubs_epi16(wabs[s], _mm256_sign_epi8(xv, wv[s]));
                    ip = _mm256_add_epi32(ip, _mm256_madd_epi16(p, ones));
                }
            } else {
                // 4-bit codes: each 16-bit pair sum is at most 2 * 15 * 127
                // = 3810, so up to 8 steps add exactly in 16 bits (30480)
                // before one widening multiply-add.
                let mut p16 = _mm256_setzero_si256();
                for s in 0..S {
                    let xv = ld256(xsl, 64 * s + 32 * h);
                    p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(wv[s], xv));
                }
                ip = _mm256_madd_epi16(p16, ones);
            }
            if K == Q4_0 {
                ip = _mm256_sub_epi32(ip, _mm256_slli_epi32::<3>(ld256(&x.lsum, mo)));
            }
            let sc = _mm256_mul_ps(dw, ld256ps(&x.dx, mo));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ip), sc, acc[j]);
            if K == Q4_1 {
                acc[j] = _mm256_fmadd_ps(mw, ld256ps(&x.smin, mo), acc[j]);
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2")]
fn _mm_loadu_si128_arr(a: &[u16; 8]) -> __m128i {
    // SAFETY: `a` is exactly 16 bytes.
    unsafe { _mm_loadu_si128(a.as_ptr() as *const __m128i) }
}

/// AVX-512 VNNI kernels: one 512-bit `vpdpbusd` per 64-byte step, 16
/// lanes, up to 12 activation rows per unpacked weight group.
pub mod vnni {
    use super::{check, kind_code, GroupedActs, QuantWeights, Q4_0, Q4_1, Q8_0, QK};
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            super::available()
                && std::env::var_os("SPECD_NO_AVX512").is_none()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
        })
    }

    /// Most activation rows one weight-group unpack serves: two weight rows
    /// run together, with two integer and two float accumulators per
    /// activation row, which with the unpacked steps fit 32 registers.
    const MAX_ROWS: usize = 6;

    /// Rows `r0..r1` of `w` against every activation row, written
    /// activation-row-major: `out[i * (r1 - r0) + (r - r0)]`.
    pub fn rows(w: &QuantWeights, x: &GroupedActs, r0: usize, r1: usize, out: &mut [f32]) {
        assert!(available());
        check(w, x, r1, r0, out);
        // SAFETY: `available()` confirmed AVX-512F/BW/VL/VNNI, AVX2, FMA
        // and F16C on this CPU.
        unsafe {
            match kind_code(w.kind) {
                Q4_0 => vnni_rows::<Q4_0>(w, x, r0, r1, out),
                Q4_1 => vnni_rows::<Q4_1>(w, x, r0, r1, out),
                _ => vnni_rows::<Q8_0>(w, x, r0, r1, out),
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn vnni_rows<const K: u8>(
        w: &QuantWeights,
        x: &GroupedActs,
        r0: usize,
        r1: usize,
        out: &mut [f32],
    ) {
        let n = x.n;
        // Balanced chunks of at most MAX_ROWS activation rows; the chunk is
        // the outer loop so its activations stay in L1 across weight rows.
        let chunks = n.div_ceil(MAX_ROWS);
        let per = n.div_ceil(chunks.max(1));
        // Software prefetch of the weight row a few rows ahead: the stream
        // comes from DRAM (the model is larger than the caches) and the
        // hardware prefetcher restarts at every page.
        let row_bytes = w.nbp * w.kind.block_bytes();
        let total_rows = w.qs.len() / row_bytes.max(1);
        let ahead = (PREFETCH_BYTES / row_bytes.max(1)).max(1);
        let nr = r1 - r0;
        if n > per && n <= 2 * per {
            // Two chunks (7 to 12 rows): each weight row pair is read once
            // and met by both chunks while it sits in L1.
            let mut r = r0;
            while r < r1 {
                let pair = r + 1 < r1;
                for p in r..r + 1 + usize::from(pair) {
                    if p + ahead < total_rows {
                        prefetch_row::<PREFETCH_HINT>(w, p + ahead, row_bytes);
                    }
                }
                pass::<K>(w, x, r, pair, 0, per, r0, nr, out);
                pass::<K>(w, x, r, pair, per, n - per, r0, nr, out);
                r += 1 + usize::from(pair);
            }
            return;
        }
        // Otherwise the chunk is the outer loop: its activations stay in L1
        // across the task's weight rows.
        let mut i0 = 0;
        while i0 < n {
            let rr = (n - i0).min(per);
            let mut r = r0;
            while r < r1 {
                let pair = r + 1 < r1;
                for p in r..r + 1 + usize::from(pair) {
                    if p + ahead < total_rows {
                        prefetch_row::<PREFETCH_HINT>(w, p + ahead, row_bytes);
                    }
                }
                pass::<K>(w, x, r, pair, i0, rr, r0, nr, out);
                r += 1 + usize::from(pair);
            }
            i0 += rr;
        }
    }

    /// Weight row `r` (and `r + 1` when `pair`) against activation rows
    /// `i0..i0 + rr`, written to `out[i * nr + (row - r0)]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn pass<const K: u8>(
        w: &QuantWeights,
        x: &GroupedActs,
        r: usize,
        pair: bool,
        i0: usize,
        rr: usize,
        r0: usize,
        nr: usize,
        out: &mut [f32],
    ) {
        assert!(r + usize::from(pair) < w.qs.len() / (w.nbp * w.kind.block_bytes()).max(1));
        assert!(i0 + rr <= x.n && (1..=MAX_ROWS).contains(&rr));
        let mut put = |p: usize, v: &[f32]| {
            for (j, &val) in v.iter().enumerate() {
                out[(i0 + j) * nr + (r + p - r0)] = val;
            }
        };
        // SAFETY: `check` (called by `rows`) bounded the weight rows below
        // `r1` and the activation rows below `x.n`; the asserts above keep
        // this tile inside them.
        unsafe {
            macro_rules! go {
                ($p:literal) => {
                    match rr {
                        1 => tile::<$p, 1, K>(w, x, r, i0)
                            .iter()
                            .enumerate()
                            .for_each(|(p, v)| put(p, v)),
                        2 => tile::<$p, 2, K>(w, x, r, i0)
                            .iter()
                            .enumerate()
                            .for_each(|(p, v)| put(p, v)),
                        3 => tile::<$p, 3, K>(w, x, r, i0)
                            .iter()
                            .enumerate()
                            .for_each(|(p, v)| put(p, v)),
                        4 => tile::<$p, 4, K>(w, x, r, i0)
                            .iter()
                            .enumerate()
                            .for_each(|(p, v)| put(p, v)),
                        5 => tile::<$p, 5, K>(w, x, r, i0)
                            .iter()
                            .enumerate()
                            .for_each(|(p, v)| put(p, v)),
                        _ => tile::<$p, 6, K>(w, x, r, i0)
                            .iter()
                            .enumerate()
                            .for_each(|(p, v)| put(p, v)),
                    }
                };
            }
            if pair {
                go!(2)
            } else {
                go!(1)
            }
        }
    }

    /// Weight rows `r..r + P` against activation rows `i0..i0 + R`.
    ///
    /// Per group: each 64-byte step of each weight row is unpacked once and
    /// met by all R activation rows (every activation load feeds all P
    /// rows' `vpdpbusd`); with few chains, even and odd steps use separate
    /// accumulators, summed exactly in integers. Then per (weight row,
    /// activation row) the offset correction and one scaled float
    /// accumulate (two for Q4_1). A result is the same sequence of
    /// operations for every P and R (integer sums are exact, the float
    /// steps and the final reduction tree fixed per accumulator), so tiling
    /// changes no bit.
    ///
    /// # Safety
    /// AVX-512F/BW/VL/VNNI, FMA and F16C are available; weight rows
    /// `r..r + P` and activation rows `i0..i0 + R` exist in `w` and `x`,
    /// whose shapes `check` has validated.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const P: usize, const R: usize, const K: u8>(
        w: &QuantWeights,
        x: &GroupedActs,
        r: usize,
        i0: usize,
    ) -> [[f32; R]; P] {
        let split = P * R <= 4;
        let (nbp, bb, ng) = (w.nbp, w.kind.block_bytes(), x.ngroups);
        // Row starts; every load below reads inside the rows the caller
        // guarantees (`b0 + g <= nbp` for every group of the plan).
        let wq: [*const u8; P] =
            core::array::from_fn(|p| w.qs.as_ptr().wrapping_add((r + p) * nbp * bb));
        let wd: [*const u16; P] =
            core::array::from_fn(|p| w.d.as_ptr().wrapping_add((r + p) * nbp));
        let wm: [*const u16; P] =
            core::array::from_fn(|p| w.m.as_ptr().wrapping_add((r + p) * nbp));
        let xq: [*const i8; R] =
            core::array::from_fn(|j| x.xs.as_ptr().wrapping_add((i0 + j) * nbp * QK));
        let meta = |j: usize, gi: usize| ((i0 + j) * ng + gi) * 16;
        let zero = _mm512_setzero_si512();
        let mask4 = _mm512_set1_epi8(0x0f);
        let mut acc = [[_mm512_setzero_ps(); R]; P];
        for (gi, &(b0, g)) in w.plan.iter().enumerate() {
            // The chains start from minus the weights' offset times the
            // lane's activation sum (Q4_0: 8, Q8_0: 128; Q4_1 has none),
            // which removes the offset exactly.
            let start: [__m512i; R] = core::array::from_fn(|j| {
                if K == Q4_1 {
                    return zero;
                }
                // SAFETY: activation row i0 + j exists, so its 16 lane sums
                // of group gi are inside `x.lsum` (checked by `check`).
                let ls = unsafe { ldi(x.lsum.as_ptr().add(meta(j, gi)) as *const u8) };
                if K == Q4_0 {
                    _mm512_sub_epi32(zero, _mm512_slli_epi32::<3>(ls))
                } else {
                    _mm512_sub_epi32(zero, _mm512_slli_epi32::<7>(ls))
                }
            });
            let mut ia = [start; P];
            let mut ib = [[zero; R]; P];
            let wg: [*const u8; P] = core::array::from_fn(|p| wq[p].wrapping_add(b0 * bb));
            let xg: [*const u8; R] =
                core::array::from_fn(|j| xq[j].wrapping_add(b0 * QK) as *const u8);
            if g == 2 {
                // One 64-byte step: Q8 codes as stored, Q4 nibbles of 32
                // bytes (low then high half).
                let wv: [__m512i; P] = core::array::from_fn(|p| {
                    if K == Q8_0 {
                        // SAFETY: a 2-block Q8_0 group is 64 bytes of row r + p.
                        unsafe { ldi(wg[p]) }
                    } else {
                        // SAFETY: a 2-block Q4 group is 32 bytes of row r + p.
                        let raw = unsafe { _mm256_loadu_si256(wg[p] as *const __m256i) };
                        let m = _mm256_set1_epi8(0x0f);
                        let lo = _mm256_and_si256(raw, m);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m);
                        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
                    }
                });
                for j in 0..R {
                    // SAFETY: the group's 64 activation bytes of row i0 + j.
                    let xv = unsafe { ldi(xg[j]) };
                    for p in 0..P {
                        ia[p][j] = _mm512_dpbusd_epi32(ia[p][j], wv[p], xv);
                    }
                }
            } else {
                // Steps in pairs (2s, 2s + 1).
                for s in 0..g / 4 {
                    let (we, wo): ([__m512i; P], [__m512i; P]) = if K == Q8_0 {
                        (
                            // SAFETY: steps 2s and 2s + 1 of the group lie in
                            // its `64 * g / 2` bytes since s < g / 4.
                            core::array::from_fn(|p| unsafe { ldi(wg[p].add(128 * s)) }),
                            // SAFETY: as above.
                            core::array::from_fn(|p| unsafe { ldi(wg[p].add(128 * s + 64)) }),
                        )
                    } else {
                        // SAFETY: the packed pair of steps is 64 bytes at
                        // 64 * s of the group's `16 * g` bytes.
                        let raw: [__m512i; P] =
                            core::array::from_fn(|p| unsafe { ldi(wg[p].add(64 * s)) });
                        (
                            core::array::from_fn(|p| _mm512_and_si512(raw[p], mask4)),
                            core::array::from_fn(|p| {
                                _mm512_and_si512(_mm512_srli_epi16::<4>(raw[p]), mask4)
                            }),
                        )
                    };
                    for j in 0..R {
                        // SAFETY: the group's activations are `32 * g` bytes
                        // and 128 * s + 128 <= 32 * g.
                        let xe = unsafe { ldi(xg[j].add(128 * s)) };
                        for p in 0..P {
                            ia[p][j] = _mm512_dpbusd_epi32(ia[p][j], we[p], xe);
                        }
                    }
                    for j in 0..R {
                        // SAFETY: as above.
                        let xd = unsafe { ldi(xg[j].add(128 * s + 64)) };
                        for p in 0..P {
                            if split {
                                ib[p][j] = _mm512_dpbusd_epi32(ib[p][j], wo[p], xd);
                            } else {
                                ia[p][j] = _mm512_dpbusd_epi32(ia[p][j], wo[p], xd);
                            }
                        }
                    }
                }
            }
            // SAFETY: the group's `g` scales of row r + p.
            let dw: [__m512; P] = core::array::from_fn(|p| unsafe { expand(wd[p].add(b0), g) });
            let mw: [__m512; P] = core::array::from_fn(|p| {
                if K == Q4_1 {
                    // SAFETY: as above, for the minimums (Q4_1 has them).
                    unsafe { expand(wm[p].add(b0), g) }
                } else {
                    _mm512_setzero_ps()
                }
            });
            for j in 0..R {
                let mo = meta(j, gi);
                // SAFETY: the 16 lane scales of group gi of row i0 + j.
                let dx = unsafe { _mm512_loadu_ps(x.dx.as_ptr().add(mo)) };
                let sm = if K == Q4_1 {
                    // SAFETY: as above, for the minimum terms.
                    unsafe { _mm512_loadu_ps(x.smin.as_ptr().add(mo)) }
                } else {
                    _mm512_setzero_ps()
                };
                for p in 0..P {
                    let ip = if split {
                        _mm512_add_epi32(ia[p][j], ib[p][j])
                    } else {
                        ia[p][j]
                    };
                    acc[p][j] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(ip),
                        _mm512_mul_ps(dw[p], dx),
                        acc[p][j],
                    );
                    if K == Q4_1 {
                        acc[p][j] = _mm512_fmadd_ps(mw[p], sm, acc[p][j]);
                    }
                }
            }
        }
        let mut o = [[0f32; R]; P];
        for p in 0..P {
            hsum_many(&acc[p], &mut o[p]);
        }
        o
    }

    /// 64 bytes at `p`.
    ///
    /// # Safety
    /// 64 readable bytes at `p`; AVX-512F is available.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn ldi(p: *const u8) -> __m512i {
        // SAFETY: the caller's guarantee.
        unsafe { _mm512_loadu_si512(p as *const __m512i) }
    }

    /// Horizontal sums of up to 8 vectors at a time through one shuffle
    /// tree; each vector's 16 lanes are added in the same fixed order
    /// whatever shares the tree: e + (e + 8), then ((e + 4) + (e + 12))
    /// added, then (e0 + e2) + (e1 + e3).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn hsum_many<const N: usize>(v: &[__m512; N], out: &mut [f32; N]) {
        for c0 in (0..N).step_by(8) {
            let z = _mm512_setzero_ps();
            let a: [__m512; 8] = core::array::from_fn(|i| if c0 + i < N { v[c0 + i] } else { z });
            // lanes l + (l + 8): pairs of vectors share one result.
            let u: [__m512; 4] = core::array::from_fn(|i| {
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0x44>(a[2 * i], a[2 * i + 1]),
                    _mm512_shuffle_f32x4::<0xEE>(a[2 * i], a[2 * i + 1]),
                )
            });
            // then + (l + 4): one 128-bit lane per vector.
            let t: [__m512; 2] = core::array::from_fn(|i| {
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0x88>(u[2 * i], u[2 * i + 1]),
                    _mm512_shuffle_f32x4::<0xDD>(u[2 * i], u[2 * i + 1]),
                )
            });
            // then (e0 + e2) + (e1 + e3) inside each 128-bit lane.
            let s = _mm512_add_ps(
                _mm512_unpacklo_ps(t[0], t[1]),
                _mm512_unpackhi_ps(t[0], t[1]),
            );
            let f = _mm512_add_ps(s, _mm512_permute_ps::<0x4E>(s));
            let mut lanes = [0f32; 16];
            // SAFETY: `lanes` is exactly 16 floats.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), f) };
            // t[0] holds vectors 0-3 and t[1] vectors 4-7, one per 128-bit
            // lane; vector i ends in lane i % 4, element i / 4.
            for i in 0..8.min(N - c0) {
                out[c0 + i] = lanes[HSUM_SLOT[i]];
            }
        }
    }

    /// Where `hsum_many` leaves vector i (0..8) of a chunk.
    const HSUM_SLOT: [usize; 8] = [0, 4, 8, 12, 1, 5, 9, 13];

    /// How far ahead (in weight bytes) `vnni_rows` prefetches.
    const PREFETCH_BYTES: usize = 8192;
    const PREFETCH_HINT: i32 = _MM_HINT_T0;

    /// Prefetch weight row `r` (codes, scales, minimums) into L1.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn prefetch_row<const H: i32>(w: &QuantWeights, r: usize, row_bytes: usize) {
        let q = &w.qs[r * row_bytes..(r + 1) * row_bytes];
        for off in (0..row_bytes).step_by(64) {
            // SAFETY: `off < q.len()`, so the address is inside `q`; a
            // prefetch never faults or changes memory.
            unsafe { _mm_prefetch::<H>(q.as_ptr().add(off) as *const i8) };
        }
        let d = &w.d[r * w.nbp..(r + 1) * w.nbp];
        _mm_prefetch::<H>(d.as_ptr() as *const i8);
        if !w.m.is_empty() {
            let m = &w.m[r * w.nbp..(r + 1) * w.nbp];
            _mm_prefetch::<H>(m.as_ptr() as *const i8);
        }
    }

    /// `g` f16 scales from `s` expanded to 16 lanes (lane l gets scale
    /// l / (16 / g)).
    ///
    /// # Safety
    /// `s` points at `g` readable u16 and AVX-512F/BW/VL are available.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn expand(s: *const u16, g: usize) -> __m512 {
        if g == 16 {
            // SAFETY: 16 u16 = 32 bytes from `s` (the caller's guarantee).
            let v = unsafe { _mm256_loadu_si256(s as *const __m256i) };
            return _mm512_cvtph_ps(v);
        }
        let mask: __mmask16 = (1u16 << g) - 1;
        // SAFETY: the mask limits the load to the `g` elements at `s`.
        let v = unsafe { _mm256_maskz_loadu_epi16(mask, s as *const i16) };
        // Lane l takes scale l / (16 / g).
        const IDX: [[i32; 16]; 3] = [
            [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3],
            [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7],
        ];
        let t = &IDX[(g.trailing_zeros() as usize).saturating_sub(1).min(2)];
        // SAFETY: `t` is exactly 16 i32.
        let idx = unsafe { _mm512_loadu_si512(t.as_ptr() as *const __m512i) };
        _mm512_permutexvar_ps(idx, _mm512_cvtph_ps(v))
    }
}

/// AVX-512 inner loops of attention. Each computes exactly what its
/// portable twin in `llama` computes, in the same order (one FMA per
/// element per step), so the two give identical bits.
pub mod attn {
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        super::vnni::available()
    }

    /// For each of up to 4 queries, 64 dot products `q . kt[d][c..c + 64]`
    /// accumulated over `d` in order; the queries share the loads of `kt`.
    pub fn scores64(
        qs: &[&[f32]],
        kt: &[f32],
        stride: usize,
        c: usize,
        out: &mut [[[f32; 16]; 4]; 4],
    ) {
        assert!(available());
        assert!(!qs.is_empty() && qs.len() <= 4);
        let hd = qs[0].len();
        assert!(qs.iter().all(|q| q.len() == hd));
        assert!(c + 64 <= stride && hd.saturating_sub(1) * stride + c + 64 <= kt.len());
        // SAFETY: AVX-512F is available; the asserts bound every load.
        unsafe {
            match qs.len() {
                1 => scores64_n::<1>(qs, kt, stride, c, out),
                2 => scores64_n::<2>(qs, kt, stride, c, out),
                3 => scores64_n::<3>(qs, kt, stride, c, out),
                _ => scores64_n::<4>(qs, kt, stride, c, out),
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    fn scores64_n<const Q: usize>(
        qs: &[&[f32]],
        kt: &[f32],
        stride: usize,
        c: usize,
        out: &mut [[[f32; 16]; 4]; 4],
    ) {
        let hd = qs[0].len();
        let mut a = [[_mm512_setzero_ps(); 4]; Q];
        for d in 0..hd {
            let row = &kt[d * stride + c..d * stride + c + 64];
            let mut kv = [_mm512_setzero_ps(); 4];
            for (k, v) in kv.iter_mut().enumerate() {
                // SAFETY: `row` holds 64 floats; lane block k is inside it.
                *v = unsafe { _mm512_loadu_ps(row.as_ptr().add(16 * k)) };
            }
            for i in 0..Q {
                let qv = _mm512_set1_ps(qs[i][d]);
                for k in 0..4 {
                    a[i][k] = _mm512_fmadd_ps(qv, kv[k], a[i][k]);
                }
            }
        }
        for i in 0..Q {
            for k in 0..4 {
                // SAFETY: `out[i][k]` is exactly 16 floats.
                unsafe { _mm512_storeu_ps(out[i][k].as_mut_ptr(), a[i][k]) };
            }
        }
    }

    /// For each of up to 4 queries: `acc[i][k][l] += ps[i][j] * v[j][c +
    /// 16k + l]` for slots `j` in order; the queries share the loads of `v`.
    pub fn pv64(ps: &[&[f32]], v: &[f32], hd: usize, c: usize, acc: &mut [[[f32; 16]; 4]; 4]) {
        assert!(available());
        assert!(!ps.is_empty() && ps.len() <= 4);
        let n = ps[0].len();
        assert!(ps.iter().all(|p| p.len() == n));
        assert!(c + 64 <= hd && n * hd <= v.len());
        // SAFETY: AVX-512F is available; the asserts bound every load.
        unsafe {
            match ps.len() {
                1 => pv64_n::<1>(ps, v, hd, c, acc),
                2 => pv64_n::<2>(ps, v, hd, c, acc),
                3 => pv64_n::<3>(ps, v, hd, c, acc),
                _ => pv64_n::<4>(ps, v, hd, c, acc),
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    fn pv64_n<const Q: usize>(
        ps: &[&[f32]],
        v: &[f32],
        hd: usize,
        c: usize,
        acc: &mut [[[f32; 16]; 4]; 4],
    ) {
        let mut a = [[_mm512_setzero_ps(); 4]; Q];
        for i in 0..Q {
            for k in 0..4 {
                // SAFETY: `acc[i][k]` is exactly 16 floats.
                a[i][k] = unsafe { _mm512_loadu_ps(acc[i][k].as_ptr()) };
            }
        }
        for j in 0..ps[0].len() {
            let row = &v[j * hd + c..j * hd + c + 64];
            let mut vv = [_mm512_setzero_ps(); 4];
            for (k, x) in vv.iter_mut().enumerate() {
                // SAFETY: `row` holds 64 floats; lane block k is inside it.
                *x = unsafe { _mm512_loadu_ps(row.as_ptr().add(16 * k)) };
            }
            for i in 0..Q {
                let pv = _mm512_set1_ps(ps[i][j]);
                for k in 0..4 {
                    a[i][k] = _mm512_fmadd_ps(pv, vv[k], a[i][k]);
                }
            }
        }
        for i in 0..Q {
            for k in 0..4 {
                // SAFETY: `acc[i][k]` is exactly 16 floats.
                unsafe { _mm512_storeu_ps(acc[i][k].as_mut_ptr(), a[i][k]) };
            }
        }
    }

    /// Widen f16 to f32 (exact).
    pub fn widen(src: &[half::f16], dst: &mut [f32]) {
        assert!(available());
        assert_eq!(src.len(), dst.len());
        // SAFETY: AVX-512F is available; the loop bounds every access.
        unsafe { widen_avx512(src, dst) }
    }

    #[target_feature(enable = "avx512f")]
    fn widen_avx512(src: &[half::f16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        while i + 16 <= n {
            let s = &src[i..i + 16];
            let d = &mut dst[i..i + 16];
            // SAFETY: `s` is 16 f16 (32 bytes) and `d` 16 floats.
            unsafe {
                let h = _mm256_loadu_si256(s.as_ptr() as *const __m256i);
                _mm512_storeu_ps(d.as_mut_ptr(), _mm512_cvtph_ps(h));
            }
            i += 16;
        }
        for j in i..n {
            dst[j] = src[j].to_f32();
        }
    }
}
