//! x86-64 kernels, selected at run time: AVX2 on the group layout and
//! AVX-512 VNNI on the row-tile layout (see `kernels`).
//!
//! Both unpack weights once per step and apply them to a chunk of
//! activation rows. Every activation row keeps its own accumulator and sees
//! the same instruction sequence whatever the number of rows in the call,
//! so results are batch-invariant, as in the portable path.
//!
//! Offsets are removed exactly in integers: Q4_0 codes are kept as unsigned
//! nibbles and corrected with `8 * sum(x)`; Q8_0 codes are made unsigned
//! with +128 (VNNI) and corrected with `128 * sum(x)`, or kept signed with
//! the sign folded into the activations (AVX2).

#![cfg(target_arch = "x86_64")]

use super::kernels::{
    tile_record_bytes, GroupedActs, Layout, PlainActs, QuantKind, QuantWeights, QK, TILE,
};
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
/// into `(scales, d * sums, sums, codes)` in element order and, when `g` is
/// given, also in the group layout.
pub fn quantize_grouped(
    x: &[f32],
    n: usize,
    nb: usize,
    (qd, qsum, isum, qs): (&mut [f32], &mut [f32], &mut [i32], &mut [i8]),
    g: Option<&mut GroupedActs>,
) {
    assert!(available());
    assert!(x.len() >= n * nb * QK && qs.len() >= n * nb * QK);
    assert!(qd.len() >= n * nb && qsum.len() >= n * nb && isum.len() >= n * nb);
    let mut none = GroupedActs::default();
    let (g, plan) = match g {
        Some(g) => {
            let plan = g.reset(n, nb);
            (g, plan)
        }
        None => (&mut none, Vec::new()),
    };
    // SAFETY: `available()` confirmed AVX2, FMA and F16C on this CPU.
    unsafe { quantize_grouped_avx2(x, n, nb, qd, qsum, isum, qs, g, &plan) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn quantize_grouped_avx2(
    x: &[f32],
    n: usize,
    nb: usize,
    qd: &mut [f32],
    qsum: &mut [f32],
    isum: &mut [i32],
    qs: &mut [i8],
    g: &mut GroupedActs,
    plan: &[(usize, usize)],
) {
    if plan.is_empty() {
        // Element order only.
        for xb in 0..n * nb {
            let (d, sm, total) =
                quantize_block_avx2(&x[xb * QK..(xb + 1) * QK], &mut qs[xb * QK..(xb + 1) * QK]);
            qd[xb] = d;
            qsum[xb] = sm;
            isum[xb] = total;
        }
        return;
    }
    let (nbp, ng) = (g.nbp, g.ngroups);
    for row in 0..n {
        for (gi, &(b0, gs)) in plan.iter().enumerate() {
            let lanes = 16 / gs;
            let base = (row * nbp + b0) * QK;
            let meta = (row * ng + gi) * 16;
            for b in 0..gs.min(nb.saturating_sub(b0)) {
                let xb = row * nb + b0 + b;
                let dst = &mut qs[xb * QK..(xb + 1) * QK];
                let (d16, sm, total) = quantize_block_avx2(&x[xb * QK..(xb + 1) * QK], dst);
                qd[xb] = d16;
                qsum[xb] = sm;
                isum[xb] = total;
                for c in 0..8 {
                    let (s, u) = (c / lanes, c % lanes);
                    let l = b * lanes + u;
                    let o = base + s * 64 + l * 4;
                    let chunk = &dst[c * 4..c * 4 + 4];
                    g.xs[o..o + 4].copy_from_slice(chunk);
                    g.lsum[meta + l] += chunk.iter().map(|&v| v as i32).sum::<i32>();
                }
                g.dx[meta + b * lanes..meta + (b + 1) * lanes].fill(d16);
                g.smin[meta + b * lanes] = sm;
            }
        }
    }
}

/// One block of 32 floats to Q8 codes in `dst`: (f16-rounded scale,
/// f16-rounded d * sum(q), sum(q)).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_block_avx2(xs: &[f32], dst: &mut [i8]) -> (f32, f32, i32) {
    let (xs, dst) = (&xs[..QK], &mut dst[..QK]);
    let absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
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
    let q: [__m256i; 4] = core::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id)));
    let p01 = _mm256_packs_epi32(q[0], q[1]);
    let p23 = _mm256_packs_epi32(q[2], q[3]);
    let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order);
    // SAFETY: `dst` holds exactly 32 bytes.
    unsafe { _mm256_storeu_si256(dst.as_mut_ptr() as *mut __m256i, bytes) };
    // Sum of the signed bytes (times one, in 16 then 32 bits: exact).
    let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, bytes), ones16);
    let s4 = _mm_add_epi32(
        _mm256_castsi256_si128(sums),
        _mm256_extracti128_si256::<1>(sums),
    );
    let s2 = _mm_add_epi32(s4, _mm_shuffle_epi32::<0b01_00_11_10>(s4));
    let total = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32::<0b10_11_00_01>(s2)));
    let d16 = half::f16::from_f32(d).to_f32();
    let sm = half::f16::from_f32(total as f32 * d16).to_f32();
    (d16, sm, total)
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

/// The loop shared by the row-tile kernels: checks that `w` (row tiles)
/// and `x` fit, then for every tile of rows `r0..r1` and every chunk of at
/// most `max_rows` activation rows (balanced, tile-outer so a tile's records
/// stay in L1 across chunks) calls `run(tile, i0, rows, put)`, whose
/// kernel hands its `rows x 16` results to `put`.
pub(crate) fn drive_tiles(
    w: &QuantWeights,
    x: &PlainActs<'_>,
    r0: usize,
    r1: usize,
    out: &mut [f32],
    max_rows: usize,
    mut run: impl FnMut(usize, usize, usize, &mut dyn FnMut(&[[f32; TILE]])),
) {
    assert_eq!(w.layout, Layout::Rows16);
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

/// Most activation rows one AVX2 pass over a tile half serves (16 vector
/// registers: a float and a 16-bit accumulator per row, plus the steps).
const AVX2_MAX_ROWS: usize = 4;

/// Rows `r0..r1` of `w` (row tiles) against every activation row (AVX2),
/// written activation-row-major: `out[i * (r1 - r0) + (r - r0)]`.
pub fn rows16(w: &QuantWeights, x: &PlainActs<'_>, r0: usize, r1: usize, out: &mut [f32]) {
    assert!(available());
    drive_tiles(w, x, r0, r1, out, AVX2_MAX_ROWS, |t, i0, rr, put| {
        // SAFETY: `available()` confirmed AVX2, FMA and F16C; `drive_tiles`
        // checked that tile t and activation rows i0..i0 + rr exist.
        unsafe {
            match (kind_code(w.kind), rr) {
                (Q4_0, 1) => put(&avx2_tile::<1, Q4_0>(w, x, t, i0)),
                (Q4_0, 2) => put(&avx2_tile::<2, Q4_0>(w, x, t, i0)),
                (Q4_0, 3) => put(&avx2_tile::<3, Q4_0>(w, x, t, i0)),
                (Q4_0, _) => put(&avx2_tile::<4, Q4_0>(w, x, t, i0)),
                (Q4_1, 1) => put(&avx2_tile::<1, Q4_1>(w, x, t, i0)),
                (Q4_1, 2) => put(&avx2_tile::<2, Q4_1>(w, x, t, i0)),
                (Q4_1, 3) => put(&avx2_tile::<3, Q4_1>(w, x, t, i0)),
                (Q4_1, _) => put(&avx2_tile::<4, Q4_1>(w, x, t, i0)),
                (_, 1) => put(&avx2_tile::<1, Q8_0>(w, x, t, i0)),
                (_, 2) => put(&avx2_tile::<2, Q8_0>(w, x, t, i0)),
                (_, 3) => put(&avx2_tile::<3, Q8_0>(w, x, t, i0)),
                (_, _) => put(&avx2_tile::<4, Q8_0>(w, x, t, i0)),
            }
        }
    });
}

/// The 16 rows of tile `t` against activation rows `i0..i0 + R`, as two
/// halves of 8 rows (the 32-byte halves of every 64-byte step).
///
/// Per block and half: Q4 steps meet each activation row's 4 bytes
/// broadcast in `vpmaddubsw` (pairs of products of a 4-bit and an 8-bit
/// code, at most 2 * 15 * 127), summed over the block's 8 steps exactly in
/// 16 bits (at most 30480), then widened once; Q8_0 codes are turned back
/// to signed (stored + 128), their sign moved onto the activations so
/// `vpmaddubsw` sees magnitudes, and each step widened. The chains start
/// from the offset correction (Q4_0: 8 times the block's activation sum),
/// then one scaled float accumulate (two for Q4_1) per activation row.
/// Lane l of half h is row 16t + 8h + l; the operation sequence per
/// (row, activation row) is the same for every R.
///
/// # Safety
/// AVX2, FMA and F16C are available; tile `t` and activation rows
/// `i0..i0 + R` exist (as `drive_tiles` checks).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_tile<const R: usize, const K: u8>(
    w: &QuantWeights,
    x: &PlainActs<'_>,
    t: usize,
    i0: usize,
) -> [[f32; TILE]; R] {
    let nb = w.nb;
    let rec = tile_record_bytes(w.kind);
    let cb = TILE * w.kind.block_bytes();
    let base = w.qs.as_ptr().wrapping_add(t * nb * rec);
    let mask4 = _mm256_set1_epi8(0x0f);
    let flip = _mm256_set1_epi8(-128);
    let ones = _mm256_set1_epi16(1);
    let mut o = [[0f32; TILE]; R];
    for h in 0..2 {
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let blk = base.wrapping_add(b * rec);
            if h == 0 {
                for off in (0..rec).step_by(64) {
                    // A prefetch never faults, whatever the address.
                    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH16 + off) as *const i8);
                }
            }
            let xb: [usize; R] = core::array::from_fn(|j| (i0 + j) * nb + b);
            // 4 activation bytes of step s of row j, broadcast.
            let xs = |j: usize, s: usize| {
                // SAFETY: bytes 4s..4s + 4 of activation block xb[j].
                let v = unsafe {
                    (x.qs.as_ptr().add(xb[j] * QK + 4 * s) as *const i32).read_unaligned()
                };
                _mm256_set1_epi32(v)
            };
            let mut ip: [__m256i; R] = core::array::from_fn(|j| {
                let s = x.isum[xb[j]];
                match K {
                    Q4_0 => _mm256_set1_epi32(-(s << 3)),
                    _ => _mm256_setzero_si256(),
                }
            });
            if K == Q8_0 {
                for s in 0..8 {
                    // SAFETY: half h of step s lies in the record's codes.
                    let u =
                        unsafe { _mm256_loadu_si256(blk.add(64 * s + 32 * h) as *const __m256i) };
                    let q = _mm256_xor_si256(u, flip);
                    let mag = _mm256_abs_epi8(q);
                    for j in 0..R {
                        let p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(xs(j, s), q));
                        ip[j] = _mm256_add_epi32(ip[j], _mm256_madd_epi16(p, ones));
                    }
                }
            } else {
                let mut p16 = [_mm256_setzero_si256(); R];
                for u in 0..4 {
                    // SAFETY: half h of packed steps 2u, 2u + 1 lies in the
                    // record's codes.
                    let raw =
                        unsafe { _mm256_loadu_si256(blk.add(64 * u + 32 * h) as *const __m256i) };
                    let we = _mm256_and_si256(raw, mask4);
                    let wo = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask4);
                    for j in 0..R {
                        let e = _mm256_maddubs_epi16(we, xs(j, 2 * u));
                        let d = _mm256_maddubs_epi16(wo, xs(j, 2 * u + 1));
                        p16[j] = _mm256_add_epi16(p16[j], _mm256_add_epi16(e, d));
                    }
                }
                for j in 0..R {
                    ip[j] = _mm256_add_epi32(ip[j], _mm256_madd_epi16(p16[j], ones));
                }
            }
            // SAFETY: the record's 16 scales follow its codes; half h is
            // 8 of them.
            let dw =
                unsafe { _mm256_cvtph_ps(_mm_loadu_si128(blk.add(cb + 16 * h) as *const __m128i)) };
            let mw = if K == Q4_1 {
                // SAFETY: Q4_1 records end with the 16 minimums.
                unsafe {
                    _mm256_cvtph_ps(_mm_loadu_si128(blk.add(cb + 32 + 16 * h) as *const __m128i))
                }
            } else {
                _mm256_setzero_ps()
            };
            for j in 0..R {
                let sc = _mm256_mul_ps(dw, _mm256_set1_ps(x.qd[xb[j]]));
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ip[j]), sc, acc[j]);
                if K == Q4_1 {
                    acc[j] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.qsum[xb[j]]), acc[j]);
                }
            }
        }
        for j in 0..R {
            // SAFETY: 8 floats at lanes 8h..8h + 8 of `o[j]`.
            unsafe { _mm256_storeu_ps(o[j].as_mut_ptr().add(8 * h), acc[j]) };
        }
    }
    o
}

/// How far ahead (bytes) the row-tile kernels prefetch the tile stream.
const PREFETCH16: usize = 8192;

/// AVX-512 VNNI kernel on row tiles: one 512-bit `vpdpbusd` per 4-byte
/// step of a block adds to 16 output rows at once; up to 8 activation rows
/// per pass over a tile.
pub mod vnni {
    use super::super::kernels::{tile_record_bytes, PlainActs, TILE};
    use super::{QuantKind, QuantWeights, Q4_0, Q4_1, Q8_0, QK};
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

    /// Most activation rows one pass over a tile serves: one integer and
    /// one float accumulator per row, plus the unpacked steps, fit the 32
    /// vector registers.
    const MAX_ROWS: usize = 8;

    /// How far ahead (in weight bytes) the kernel prefetches: the stream
    /// comes from DRAM (the model is larger than the caches).
    const PREFETCH_BYTES: usize = 8192;

    /// Rows `r0..r1` of `w` (row tiles) against every activation row,
    /// written activation-row-major: `out[i * (r1 - r0) + (r - r0)]`.
    pub fn rows16(w: &QuantWeights, x: &PlainActs<'_>, r0: usize, r1: usize, out: &mut [f32]) {
        assert!(available());
        super::drive_tiles(w, x, r0, r1, out, MAX_ROWS, |t, i0, rr, put| {
            // SAFETY: `available()` confirmed AVX-512F/BW/VL/VNNI and F16C;
            // `drive_tiles` checked that tile t and activation rows
            // i0..i0 + rr exist.
            unsafe {
                match w.kind {
                    QuantKind::Q4_0 => go::<Q4_0>(w, x, t, i0, rr, put),
                    QuantKind::Q4_1 => go::<Q4_1>(w, x, t, i0, rr, put),
                    QuantKind::Q8_0 => go::<Q8_0>(w, x, t, i0, rr, put),
                }
            }
        });
    }

    /// Tile `t` against activation rows `i0..i0 + rr` (`1 <= rr <=
    /// MAX_ROWS`), handed to `put`.
    ///
    /// # Safety
    /// As `tile`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn go<const K: u8>(
        w: &QuantWeights,
        x: &PlainActs<'_>,
        t: usize,
        i0: usize,
        rr: usize,
        put: &mut dyn FnMut(&[[f32; TILE]]),
    ) {
        // SAFETY: the caller's guarantee.
        unsafe {
            match rr {
                1 => put(&tile::<1, K>(w, x, t, i0)),
                2 => put(&tile::<2, K>(w, x, t, i0)),
                3 => put(&tile::<3, K>(w, x, t, i0)),
                4 => put(&tile::<4, K>(w, x, t, i0)),
                5 => put(&tile::<5, K>(w, x, t, i0)),
                6 => put(&tile::<6, K>(w, x, t, i0)),
                7 => put(&tile::<7, K>(w, x, t, i0)),
                _ => put(&tile::<8, K>(w, x, t, i0)),
            }
        }
    }

    /// The 16 rows of tile `t` against activation rows `i0..i0 + R`.
    ///
    /// Per block: each 64-byte step is unpacked once and met by all R
    /// activation rows (their 4 bytes broadcast); each row's integer chain
    /// starts from minus the weights' offset times the block's activation
    /// sum (Q4_0: 8, Q8_0: 128), so it ends holding the exact block dot
    /// product of all 16 rows; then one scaled float accumulate (two for
    /// Q4_1) per activation row. Lane l is row 16t + l throughout, and its
    /// result is the same chain of operations for every R.
    ///
    /// # Safety
    /// AVX-512F/BW/VL/VNNI and F16C are available; tile `t` and activation
    /// rows `i0..i0 + R` exist (as `rows16` asserts).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const K: u8>(
        w: &QuantWeights,
        x: &PlainActs<'_>,
        t: usize,
        i0: usize,
    ) -> [[f32; TILE]; R] {
        let nb = w.nb;
        let rec = tile_record_bytes(w.kind);
        let cb = TILE * w.kind.block_bytes();
        let split = R <= 2;
        let base = w.qs.as_ptr().wrapping_add(t * nb * rec);
        let mask4 = _mm512_set1_epi8(0x0f);
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let blk = base.wrapping_add(b * rec);
            for off in (0..rec).step_by(64) {
                // A prefetch never faults, whatever the address.
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH_BYTES + off) as *const i8);
            }
            let xb: [usize; R] = core::array::from_fn(|j| (i0 + j) * nb + b);
            let mut ia: [__m512i; R] = core::array::from_fn(|j| {
                let s = x.isum[xb[j]];
                match K {
                    Q4_0 => _mm512_set1_epi32(-(s << 3)),
                    Q8_0 => _mm512_set1_epi32(-(s << 7)),
                    _ => zero,
                }
            });
            let mut ib = [zero; R];
            // Steps in pairs (2u, 2u + 1).
            for u in 0..4 {
                let (we, wo) = if K == Q8_0 {
                    // SAFETY: steps 2u and 2u + 1 are inside the record's
                    // 512 code bytes.
                    unsafe { (ld(blk.add(128 * u)), ld(blk.add(128 * u + 64))) }
                } else {
                    // SAFETY: packed steps 2u, 2u + 1 are 64 of the record's
                    // 256 code bytes.
                    let raw = unsafe { ld(blk.add(64 * u)) };
                    (
                        _mm512_and_si512(raw, mask4),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask4),
                    )
                };
                for j in 0..R {
                    // SAFETY: bytes 8u..8u + 8 of activation block xb[j].
                    let (e, o) = unsafe {
                        let p = x.qs.as_ptr().add(xb[j] * QK + 8 * u);
                        (
                            (p as *const i32).read_unaligned(),
                            (p.add(4) as *const i32).read_unaligned(),
                        )
                    };
                    ia[j] = _mm512_dpbusd_epi32(ia[j], we, _mm512_set1_epi32(e));
                    if split {
                        ib[j] = _mm512_dpbusd_epi32(ib[j], wo, _mm512_set1_epi32(o));
                    } else {
                        ia[j] = _mm512_dpbusd_epi32(ia[j], wo, _mm512_set1_epi32(o));
                    }
                }
            }
            // SAFETY: the record's 16 scales follow its codes.
            let dw = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(cb) as *const __m256i)) };
            let mw = if K == Q4_1 {
                // SAFETY: Q4_1 records end with the 16 minimums.
                unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(cb + 32) as *const __m256i)) }
            } else {
                _mm512_setzero_ps()
            };
            for j in 0..R {
                let ip = if split {
                    _mm512_add_epi32(ia[j], ib[j])
                } else {
                    ia[j]
                };
                let sc = _mm512_mul_ps(dw, _mm512_set1_ps(x.qd[xb[j]]));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ip), sc, acc[j]);
                if K == Q4_1 {
                    acc[j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.qsum[xb[j]]), acc[j]);
                }
            }
        }
        let mut o = [[0f32; TILE]; R];
        for j in 0..R {
            // SAFETY: `o[j]` is exactly 16 floats.
            unsafe { _mm512_storeu_ps(o[j].as_mut_ptr(), acc[j]) };
        }
        o
    }

    /// 64 bytes at `p`.
    ///
    /// # Safety
    /// 64 readable bytes at `p`; AVX-512F is available.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn ld(p: *const u8) -> __m512i {
        // SAFETY: the caller's guarantee.
        unsafe { _mm512_loadu_si512(p as *const __m512i) }
    }
}

/// AVX-512 inner loops of attention. Each computes exactly what its
/// portable twin in `llama` computes, in the same order (one FMA per
/// element per step), so the two give identical bits.
pub mod attn {
    use std::arch::x86_64::*;

    /// Whether these loops run here: AVX-512 where the VNNI path is on,
    /// else AVX2 + FMA + F16C.
    pub fn available() -> bool {
        super::available()
    }

    /// Whether the AVX-512 versions run (else the AVX2 ones).
    fn wide() -> bool {
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
        if !wide() {
            return scores64_avx2(qs, kt, stride, c, out);
        }
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
        if !wide() {
            return pv64_avx2(ps, v, hd, c, acc);
        }
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
        if wide() {
            // SAFETY: AVX-512F is available; the loop bounds every access.
            unsafe { widen_avx512(src, dst) }
        } else {
            // SAFETY: F16C and AVX are available; the loop bounds every
            // access.
            unsafe { widen_f16c(src, dst) }
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    fn widen_f16c(src: &[half::f16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        while i + 8 <= n {
            let s = &src[i..i + 8];
            let d = &mut dst[i..i + 8];
            // SAFETY: `s` is 8 f16 (16 bytes) and `d` 8 floats.
            unsafe {
                let h = _mm_loadu_si128(s.as_ptr() as *const __m128i);
                _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for j in i..n {
            dst[j] = src[j].to_f32();
        }
    }

    /// `scores64` with 8-lane vectors: one query at a time, its 64 sums in
    /// eight registers (same per-lane FMA chains, so the same bits).
    pub fn scores64_avx2(
        qs: &[&[f32]],
        kt: &[f32],
        stride: usize,
        c: usize,
        out: &mut [[[f32; 16]; 4]; 4],
    ) {
        assert!(available() && qs.len() <= 4);
        for (q, o) in qs.iter().zip(out.iter_mut()) {
            let hd = q.len();
            assert!(c + 64 <= stride && hd.saturating_sub(1) * stride + c + 64 <= kt.len());
            // SAFETY: AVX2 and FMA are available; the assert bounds every
            // load.
            unsafe { scores64_one_avx2(q, kt, stride, c, o) }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn scores64_one_avx2(q: &[f32], kt: &[f32], stride: usize, c: usize, o: &mut [[f32; 16]; 4]) {
        let mut a = [_mm256_setzero_ps(); 8];
        for (d, &qd) in q.iter().enumerate() {
            let row = &kt[d * stride + c..d * stride + c + 64];
            let qv = _mm256_set1_ps(qd);
            for (k, acc) in a.iter_mut().enumerate() {
                // SAFETY: `row` holds 64 floats; lanes 8k..8k + 8 are inside.
                let kv = unsafe { _mm256_loadu_ps(row.as_ptr().add(8 * k)) };
                *acc = _mm256_fmadd_ps(qv, kv, *acc);
            }
        }
        for (k, acc) in a.iter().enumerate() {
            // SAFETY: lanes 8(k % 2).. of `o[k / 2]` are 8 floats.
            unsafe { _mm256_storeu_ps(o[k / 2].as_mut_ptr().add(8 * (k % 2)), *acc) };
        }
    }

    /// `pv64` with 8-lane vectors, one query at a time (same bits).
    pub fn pv64_avx2(ps: &[&[f32]], v: &[f32], hd: usize, c: usize, acc: &mut [[[f32; 16]; 4]; 4]) {
        assert!(available() && ps.len() <= 4);
        for (p, a) in ps.iter().zip(acc.iter_mut()) {
            assert!(c + 64 <= hd && p.len() * hd <= v.len());
            // SAFETY: AVX2 and FMA are available; the assert bounds every
            // load.
            unsafe { pv64_one_avx2(p, v, hd, c, a) }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn pv64_one_avx2(p: &[f32], v: &[f32], hd: usize, c: usize, o: &mut [[f32; 16]; 4]) {
        let mut a = [_mm256_setzero_ps(); 8];
        for (k, acc) in a.iter_mut().enumerate() {
            // SAFETY: lanes 8(k % 2).. of `o[k / 2]` are 8 floats.
            *acc = unsafe { _mm256_loadu_ps(o[k / 2].as_ptr().add(8 * (k % 2))) };
        }
        for (j, &pj) in p.iter().enumerate() {
            let row = &v[j * hd + c..j * hd + c + 64];
            let pv = _mm256_set1_ps(pj);
            for (k, acc) in a.iter_mut().enumerate() {
                // SAFETY: `row` holds 64 floats; lanes 8k..8k + 8 are inside.
                let x = unsafe { _mm256_loadu_ps(row.as_ptr().add(8 * k)) };
                *acc = _mm256_fmadd_ps(pv, x, *acc);
            }
        }
        for (k, acc) in a.iter().enumerate() {
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(o[k / 2].as_mut_ptr().add(8 * (k % 2)), *acc) };
        }
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
