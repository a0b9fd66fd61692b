//! x86-64 kernels on the row-tile layout (see `kernels`), selected at run
//! time: AVX-512 VNNI and AVX2, the activation quantizer, and the attention
//! inner loops.
//!
//! Both matmul kernels unpack a tile's weights once per step and apply them
//! to a chunk of activation rows. Every activation row keeps its own
//! accumulator and sees the same operation sequence whatever the number of
//! rows in the call, so results are batch-invariant; the sequence per lane
//! is the portable kernel's, so all paths give the same bits.
//!
//! Offsets are removed exactly in integers: Q4_0 codes are kept as unsigned
//! nibbles and corrected with `8 * sum(x)`, Q5_0 codes (nibbles with their
//! fifth bits merged in) with `16 * sum(x)`; Q8_0 codes are stored unsigned
//! (+128) and corrected with `128 * sum(x)` (VNNI), or turned back to signed
//! with the sign folded into the activations (AVX2).

#![cfg(target_arch = "x86_64")]

use super::layout::{
    drive_tiles, tile_record_bytes, PlainActs, QuantKind, QuantWeights, Q5_HIGH, QK, TILE,
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

/// Quantize to Q8 blocks exactly as `kernels::quantize_q8` (round half to
/// even, f16-rounded scale and sum): (scale, d * sum(q), sum(q), sum of the
/// first 16 codes) per block and the codes, in element order. With
/// AVX-512 (the VNNI path's switch), 16 blocks at a time: their maxima
/// first, then one vector division for their scales (two divisions a block
/// were a third of the scalar loop's time), then the codes; the rest one
/// block at a time in AVX2. For finite inputs every value is the same IEEE
/// operation as the portable loop's, so all give the same bits; the
/// codes' sums add the saturated codes in both x86 versions, so where a
/// code would pass 127 (a scale near the subnormals, inf or NaN inputs)
/// they still agree with each other whatever the grouping.
pub fn quantize_blocks(x: &[f32], (qd, qsum, isum, hsum, qs): super::activations::QuantOut<'_>) {
    assert!(available());
    let nb = x.len() / QK;
    assert!(qs.len() >= nb * QK && qd.len() >= nb && qsum.len() >= nb);
    assert!(isum.len() >= nb && hsum.len() >= nb);
    let mut b = 0;
    if vnni::available() {
        const G: usize = 16;
        while b + G <= nb {
            let at = |i: usize| i * QK;
            // SAFETY: `vnni::available()` confirmed AVX-512F/BW/VL (and,
            // through `available()`, AVX2, FMA and F16C).
            unsafe {
                quantize16_avx512(
                    x[at(b)..at(b + G)].try_into().expect("16 blocks"),
                    (&mut qs[at(b)..at(b + G)]).try_into().expect("16 blocks"),
                    (&mut qd[b..b + G]).try_into().expect("16 scales"),
                    (&mut qsum[b..b + G]).try_into().expect("16 sums"),
                    (&mut isum[b..b + G]).try_into().expect("16 sums"),
                    (&mut hsum[b..b + G]).try_into().expect("16 sums"),
                )
            };
            b += G;
        }
    }
    for (b, xs) in x.chunks_exact(QK).enumerate().skip(b) {
        let dst = &mut qs[b * QK..(b + 1) * QK];
        // SAFETY: `available()` confirmed AVX2, FMA and F16C on this CPU.
        let (d, sm, total) = unsafe { quantize_block_avx2(xs, dst) };
        qd[b] = d;
        qsum[b] = sm;
        isum[b] = total;
        hsum[b] = dst[..QK / 2].iter().map(|&v| i32::from(v)).sum();
    }
}

/// Sixteen blocks of 32 floats to Q8 (see `quantize_blocks`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn quantize16_avx512(
    xs: &[f32; 16 * QK],
    q: &mut [i8; 16 * QK],
    d_out: &mut [f32; 16],
    sm_out: &mut [f32; 16],
    is_out: &mut [i32; 16],
    hs_out: &mut [i32; 16],
) {
    // Every load and store below stays inside its array: `xs` and `q` hold
    // 16 blocks of QK = 32 elements (element 32j + 16h + 15 < 512 for
    // j < 16, h < 2); the per-block arrays hold 16 elements.
    let half = |j: usize, h: usize| {
        // SAFETY: 16 floats at 32j + 16h lie inside `xs` (above).
        unsafe { _mm512_loadu_ps(xs.as_ptr().add(QK * j + 16 * h)) }
    };
    // Maxima of |x| per block (max is exact, so the order of the
    // reduction does not matter).
    let mut amax = [0f32; 16];
    for (j, m) in amax.iter_mut().enumerate() {
        *m = _mm512_reduce_max_ps(_mm512_max_ps(
            _mm512_abs_ps(half(j, 0)),
            _mm512_abs_ps(half(j, 1)),
        ));
    }
    // SAFETY: as above.
    let am = unsafe { _mm512_loadu_ps(amax.as_ptr()) };
    let d = _mm512_div_ps(am, _mm512_set1_ps(127.0));
    // id = 1 / d where d != 0 (unordered counts as different, as `!=`
    // does for NaN), else 0.
    let nz = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(d, _mm512_setzero_ps());
    let id = _mm512_maskz_div_ps(nz, _mm512_set1_ps(1.0), d);
    let mut ids = [0f32; 16];
    // SAFETY: as above.
    unsafe { _mm512_storeu_ps(ids.as_mut_ptr(), id) };
    let mut tot = [0i32; 16];
    let mut first = [0i32; 16];
    // Codes clamped as the stored bytes saturate, so the sums below add
    // exactly the codes stored (as the AVX2 block function's do).
    let (lo, hi) = (_mm512_set1_epi32(-128), _mm512_set1_epi32(127));
    let sat = |v: __m512i| _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
    for j in 0..16 {
        let s = _mm512_set1_ps(ids[j]);
        let q0 = sat(_mm512_cvtps_epi32(_mm512_mul_ps(half(j, 0), s)));
        let q1 = sat(_mm512_cvtps_epi32(_mm512_mul_ps(half(j, 1), s)));
        // SAFETY: as above (16 bytes each at 32j and 32j + 16).
        unsafe {
            let dst = q.as_mut_ptr().add(QK * j);
            _mm_storeu_si128(dst as *mut __m128i, _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128(dst.add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(q1));
        }
        first[j] = _mm512_reduce_add_epi32(q0);
        tot[j] = first[j] + _mm512_reduce_add_epi32(q1);
    }
    // Round to f16 and back, to nearest even (as `half`'s conversion).
    const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let d16 = _mm512_cvtph_ps(_mm512_cvtps_ph::<RNE>(d));
    // SAFETY: as above.
    let t = unsafe { _mm512_loadu_si512(tot.as_ptr() as *const _) };
    let sm = _mm512_mul_ps(_mm512_cvtepi32_ps(t), d16);
    let sm16 = _mm512_cvtph_ps(_mm512_cvtps_ph::<RNE>(sm));
    // SAFETY: as above.
    unsafe {
        _mm512_storeu_ps(d_out.as_mut_ptr(), d16);
        _mm512_storeu_ps(sm_out.as_mut_ptr(), sm16);
    }
    *is_out = tot;
    *hs_out = first;
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

/// Const-generic stand-ins for `QuantKind` in the kernels.
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;
const Q5_0: u8 = 3;
const Q5_1: u8 = 4;

/// Most activation rows one AVX2 pass over a tile half serves (16 vector
/// registers: a float and a 16-bit accumulator per row, plus the steps).
const AVX2_MAX_ROWS: usize = 4;

/// Rows `r0..r1` of `w` (row tiles) against every activation row (AVX2),
/// written activation-row-major: `out[i * (r1 - r0) + (r - r0)]`.
pub fn rows16(w: &QuantWeights, x: &PlainActs<'_>, r0: usize, r1: usize, out: &mut [f32]) {
    assert!(available());
    if w.kind.is_k() {
        return super::simd_k::rows16_avx2(w, x, r0, r1, out);
    }
    drive_tiles(w, x, r0, r1, out, AVX2_MAX_ROWS, |t, i0, rr, put| {
        // SAFETY: `available()` confirmed AVX2, FMA and F16C; `drive_tiles`
        // checked that tile t and activation rows i0..i0 + rr exist.
        unsafe {
            match w.kind {
                QuantKind::Q4_0 => avx2_go::<Q4_0>(w, x, t, i0, rr, put),
                QuantKind::Q5_0 => avx2_go::<Q5_0>(w, x, t, i0, rr, put),
                QuantKind::Q5_1 => avx2_go::<Q5_1>(w, x, t, i0, rr, put),
                QuantKind::Q4_1 => avx2_go::<Q4_1>(w, x, t, i0, rr, put),
                QuantKind::Q8_0 => avx2_go::<Q8_0>(w, x, t, i0, rr, put),
                QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => {
                    unreachable!("K-quants go to simd_k")
                }
            }
        }
    });
}

/// Tile `t` against activation rows `i0..i0 + rr` (`1 <= rr <=
/// AVX2_MAX_ROWS`), handed to `put`.
///
/// # Safety
/// As `avx2_tile`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_go<const K: u8>(
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
            1 => put(&avx2_tile::<1, K>(w, x, t, i0)),
            2 => put(&avx2_tile::<2, K>(w, x, t, i0)),
            3 => put(&avx2_tile::<3, K>(w, x, t, i0)),
            _ => put(&avx2_tile::<4, K>(w, x, t, i0)),
        }
    }
}

/// The 16 rows of tile `t` against activation rows `i0..i0 + R`, as two
/// halves of 8 rows (the 32-byte halves of every 64-byte step).
///
/// Per block and half: Q4 steps meet each activation row's 4 bytes
/// broadcast in `vpmaddubsw` (pairs of products of a 4-bit and an 8-bit
/// code, at most 2 * 15 * 127), summed over the block's 8 steps exactly in
/// 16 bits (at most 30480), then widened once (Q5_0, 5-bit codes: every
/// two step pairs, at most 31496); Q8_0 codes are turned back
/// to signed (stored + 128), their sign moved onto the activations so
/// `vpmaddubsw` sees magnitudes, and each step widened. The offset
/// correction (Q4_0: 8, Q5_0: 16 times the block's activation sum) is added
/// to the widened sum (integers: the order of the adds changes no bit),
/// then one scaled float accumulate (two for Q4_1 and Q5_1) per activation
/// row. Activation data is read through raw pointers (no bounds checks in
/// the inner loop), and no per-row integer accumulator lives across the
/// Q4 steps, so four rows fit the 16 vector registers without spills.
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
    // Activation rows i0..i0 + R: their first block's codes and metadata.
    // Raw pointers, so the inner loops carry no bounds checks: the caller
    // guarantees (as `drive_tiles` asserts) `nb` blocks for every row.
    let xq: [*const i8; R] =
        core::array::from_fn(|j| x.qs.as_ptr().wrapping_add((i0 + j) * nb * QK));
    let xm = (i0 * nb) as isize;
    let (qd, qsum, isum) = (
        x.qd.as_ptr().wrapping_offset(xm),
        x.qsum.as_ptr().wrapping_offset(xm),
        x.isum.as_ptr().wrapping_offset(xm),
    );
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
            // 4 activation bytes of step s of row j, broadcast.
            let xs = |j: usize, s: usize| {
                // SAFETY: bytes 4s..4s + 4 of block b of activation row
                // i0 + j, which exists (the caller's guarantee).
                let v = unsafe { (xq[j].add(b * QK + 4 * s) as *const i32).read_unaligned() };
                _mm256_set1_epi32(v)
            };
            // The block's exact integer dot products, per row: the offset
            // correction (Q4_0: 8, Q5_0: 16 times the activation sum) plus
            // the code products. Integer sums are exact, so the order in
            // which they are added does not change a bit.
            let mut ip = [_mm256_setzero_si256(); R];
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
                let five = K == Q5_0 || K == Q5_1;
                let plane = if five {
                    // SAFETY: half h of the fifth-bit plane, which follows
                    // the record's nibbles.
                    unsafe { _mm256_loadu_si256(blk.add(Q5_HIGH + 32 * h) as *const __m256i) }
                } else {
                    _mm256_setzero_si256()
                };
                // Q4: the 8 steps' pair sums stay within 16 bits (at most
                // 8 * 2 * 15 * 127 = 30480) and are widened once; Q5 pairs
                // reach 4 * 31 * 127 per step pair: widen every 2 pairs.
                for g in 0..(if five { 2 } else { 1 }) {
                    let us = if five { 2 * g..2 * g + 2 } else { 0..4 };
                    let mut p16 = [_mm256_setzero_si256(); R];
                    for u in us {
                        // SAFETY: half h of packed steps 2u, 2u + 1 lies in
                        // the record's codes.
                        let raw = unsafe {
                            _mm256_loadu_si256(blk.add(64 * u + 32 * h) as *const __m256i)
                        };
                        let mut we = _mm256_and_si256(raw, mask4);
                        let mut wo = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask4);
                        if five {
                            we = _mm256_or_si256(we, fifth_bits_avx2(plane, 2 * u));
                            wo = _mm256_or_si256(wo, fifth_bits_avx2(plane, 2 * u + 1));
                        }
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
            }
            if K == Q4_0 || K == Q5_0 {
                for j in 0..R {
                    // SAFETY: block b of activation row i0 + j exists.
                    let s = unsafe { *isum.add(j * nb + b) };
                    let corr = if K == Q4_0 { -(s << 3) } else { -(s << 4) };
                    ip[j] = _mm256_add_epi32(ip[j], _mm256_set1_epi32(corr));
                }
            }
            // SAFETY: `blk` is block b's record of tile t; rows i0..i0 + R
            // and their block b exist (the caller's guarantee).
            unsafe { block_epilogue_avx2::<R, K>(blk, cb, h, &ip, qd, qsum, nb, b, &mut acc) };
        }
        for j in 0..R {
            // SAFETY: 8 floats at lanes 8h..8h + 8 of `o[j]`.
            unsafe { _mm256_storeu_ps(o[j].as_mut_ptr().add(8 * h), acc[j]) };
        }
    }
    o
}

/// The float accumulate of one block and tile half, shared by the AVX2 and
/// AVX-VNNI kernels (so both give a row the same bits): per activation row
/// j, `acc[j] += float(ip[j]) * (d_w * d_x)`, then for Q4_1 and Q5_1
/// `acc[j] += m_w * s_x`, in that order.
///
/// # Safety
/// AVX2, FMA and F16C are available; `blk` is a row-tile block record of
/// `K` whose scales (and minimums) start at `cb`; `qd` and `qsum` hold
/// block `b` of `R` activation rows of `nb` blocks each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_epilogue_avx2<const R: usize, const K: u8>(
    blk: *const u8,
    cb: usize,
    h: usize,
    ip: &[__m256i; R],
    qd: *const f32,
    qsum: *const f32,
    nb: usize,
    b: usize,
    acc: &mut [__m256; R],
) {
    // SAFETY: the record's 16 scales follow its codes; half h is 8 of them.
    let dw = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(blk.add(cb + 16 * h) as *const __m128i)) };
    let mw = if K == Q4_1 || K == Q5_1 {
        // SAFETY: Q4_1 and Q5_1 records end with the 16 minimums.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(blk.add(cb + 32 + 16 * h) as *const __m128i)) }
    } else {
        _mm256_setzero_ps()
    };
    for j in 0..R {
        // SAFETY: block b of activation row j exists (the caller's
        // guarantee).
        let (d, m) = unsafe { (*qd.add(j * nb + b), *qsum.add(j * nb + b)) };
        let sc = _mm256_mul_ps(dw, _mm256_set1_ps(d));
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ip[j]), sc, acc[j]);
        if K == Q4_1 || K == Q5_1 {
            acc[j] = _mm256_fmadd_ps(mw, _mm256_set1_ps(m), acc[j]);
        }
    }
}

/// Q5_0's fifth bits of step `s` from (half of) its bit plane, at bit 4
/// of each byte (16-bit shifts; the mask drops what crosses a byte).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn fifth_bits_avx2(plane: __m256i, s: usize) -> __m256i {
    let v = match s {
        0 => _mm256_slli_epi16::<4>(plane),
        1 => _mm256_slli_epi16::<3>(plane),
        2 => _mm256_slli_epi16::<2>(plane),
        3 => _mm256_slli_epi16::<1>(plane),
        4 => plane,
        5 => _mm256_srli_epi16::<1>(plane),
        6 => _mm256_srli_epi16::<2>(plane),
        _ => _mm256_srli_epi16::<3>(plane),
    };
    _mm256_and_si256(v, _mm256_set1_epi8(0x10))
}

/// How far ahead (bytes) the row-tile kernels prefetch the tile stream.
const PREFETCH16: usize = 8192;

/// AVX-VNNI kernel on row tiles (256-bit `vpdpbusd`, VEX-encoded: Intel
/// Alder Lake and later client CPUs have it without AVX-512): the AVX2
/// kernel's two 8-row halves, with each 32-byte step half met by every
/// activation row's 4 bytes broadcast in one `vpdpbusd` into exact int32
/// sums, where AVX2 needs `vpmaddubsw`, `vpmaddwd` and an add. Offsets are
/// removed as the AVX-512 VNNI kernel removes them (each row's chain
/// starts from minus the weights' offset times the block's activation
/// sum; Q8_0 codes stay stored + 128), and the float epilogue is the
/// AVX2 kernel's, per lane and in the same order, so every path gives a
/// row the same bits.
pub mod avxvnni {
    use super::super::layout::{tile_record_bytes, PlainActs, TILE};
    use super::{
        drive_tiles, fifth_bits_avx2, QuantKind, QuantWeights, Q4_0, Q4_1, Q5_0, Q5_1, Q5_HIGH,
        Q8_0, QK,
    };
    use std::arch::x86_64::*;

    /// Whether this path runs here: the AVX2 path is on, the CPU has
    /// AVX-VNNI, and `SPECD_NO_AVXVNNI` is unset.
    pub fn available() -> bool {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            super::available()
                && std::env::var_os("SPECD_NO_AVXVNNI").is_none()
                && is_x86_feature_detected!("avxvnni")
        })
    }

    /// Most activation rows one pass over a tile half serves: an integer
    /// and a float accumulator per row, plus the unpacked step, fit the 16
    /// vector registers.
    const MAX_ROWS: usize = 4;

    /// Rows `r0..r1` of `w` (row tiles) against every activation row,
    /// written activation-row-major: `out[i * (r1 - r0) + (r - r0)]`.
    /// K-quants run the AVX2 kernel (the same bits).
    pub fn rows16(w: &QuantWeights, x: &PlainActs<'_>, r0: usize, r1: usize, out: &mut [f32]) {
        assert!(available());
        if w.kind.is_k() {
            return super::super::simd_k::rows16_avx2(w, x, r0, r1, out);
        }
        drive_tiles(w, x, r0, r1, out, MAX_ROWS, |t, i0, rr, put| {
            // SAFETY: `available()` confirmed AVX2, FMA, F16C and
            // AVX-VNNI; `drive_tiles` checked that tile t and activation
            // rows i0..i0 + rr exist.
            unsafe {
                match w.kind {
                    QuantKind::Q4_0 => go::<Q4_0>(w, x, t, i0, rr, put),
                    QuantKind::Q5_0 => go::<Q5_0>(w, x, t, i0, rr, put),
                    QuantKind::Q5_1 => go::<Q5_1>(w, x, t, i0, rr, put),
                    QuantKind::Q4_1 => go::<Q4_1>(w, x, t, i0, rr, put),
                    QuantKind::Q8_0 => go::<Q8_0>(w, x, t, i0, rr, put),
                    QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => {
                        unreachable!("K-quants go to simd_k")
                    }
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
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
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
                _ => put(&tile::<4, K>(w, x, t, i0)),
            }
        }
    }

    /// The 16 rows of tile `t` against activation rows `i0..i0 + R`, as
    /// two halves of 8 rows (the 32-byte halves of every 64-byte step);
    /// lane l of half h is row 16t + 8h + l.
    ///
    /// # Safety
    /// AVX2, FMA, F16C and AVX-VNNI are available; tile `t` and activation
    /// rows `i0..i0 + R` exist (as `drive_tiles` checks).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn tile<const R: usize, const K: u8>(
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
        // Activation rows i0..i0 + R through raw pointers: the caller
        // guarantees `nb` blocks for every row.
        let xm = i0 * nb;
        let (xq, qd, qsum, isum) = (
            x.qs.as_ptr().wrapping_add(xm * QK),
            x.qd.as_ptr().wrapping_add(xm),
            x.qsum.as_ptr().wrapping_add(xm),
            x.isum.as_ptr().wrapping_add(xm),
        );
        let mut o = [[0f32; TILE]; R];
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                let blk = base.wrapping_add(b * rec);
                if h == 0 {
                    for off in (0..rec).step_by(64) {
                        // A prefetch never faults, whatever the address.
                        _mm_prefetch::<_MM_HINT_T0>(
                            blk.wrapping_add(super::PREFETCH16 + off) as *const i8
                        );
                    }
                }
                // 4 activation bytes of step s of row j, broadcast.
                let xs = |j: usize, s: usize| {
                    // SAFETY: bytes 4s..4s + 4 of block b of activation row
                    // i0 + j, which exists (the caller's guarantee).
                    let v = unsafe {
                        (xq.add((j * nb + b) * QK + 4 * s) as *const i32).read_unaligned()
                    };
                    _mm256_set1_epi32(v)
                };
                // Each row's chain starts from the offset correction.
                let mut ia: [__m256i; R] = core::array::from_fn(|j| {
                    // SAFETY: block b of activation row i0 + j exists.
                    let s = unsafe { *isum.add(j * nb + b) };
                    match K {
                        Q4_0 => _mm256_set1_epi32(-(s << 3)),
                        Q5_0 => _mm256_set1_epi32(-(s << 4)),
                        Q8_0 => _mm256_set1_epi32(-(s << 7)),
                        _ => _mm256_setzero_si256(),
                    }
                });
                let mut ib = [_mm256_setzero_si256(); R];
                let plane = if K == Q5_0 || K == Q5_1 {
                    // SAFETY: half h of the fifth-bit plane, which follows
                    // the record's nibbles.
                    unsafe { _mm256_loadu_si256(blk.add(Q5_HIGH + 32 * h) as *const __m256i) }
                } else {
                    _mm256_setzero_si256()
                };
                for u in 0..4 {
                    let (we, wo) = if K == Q8_0 {
                        // SAFETY: half h of steps 2u and 2u + 1 lies in the
                        // record's 512 code bytes.
                        unsafe {
                            (
                                _mm256_loadu_si256(blk.add(128 * u + 32 * h) as *const __m256i),
                                _mm256_loadu_si256(blk.add(128 * u + 64 + 32 * h) as *const __m256i),
                            )
                        }
                    } else {
                        // SAFETY: half h of packed steps 2u, 2u + 1 lies in
                        // the record's codes.
                        let raw = unsafe {
                            _mm256_loadu_si256(blk.add(64 * u + 32 * h) as *const __m256i)
                        };
                        let mut we = _mm256_and_si256(raw, mask4);
                        let mut wo = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask4);
                        if K == Q5_0 || K == Q5_1 {
                            we = _mm256_or_si256(we, fifth_bits_avx2(plane, 2 * u));
                            wo = _mm256_or_si256(wo, fifth_bits_avx2(plane, 2 * u + 1));
                        }
                        (we, wo)
                    };
                    for j in 0..R {
                        ia[j] = _mm256_dpbusd_avx_epi32(ia[j], we, xs(j, 2 * u));
                        ib[j] = _mm256_dpbusd_avx_epi32(ib[j], wo, xs(j, 2 * u + 1));
                    }
                }
                let ip: [__m256i; R] = core::array::from_fn(|j| _mm256_add_epi32(ia[j], ib[j]));
                // SAFETY: `blk` is block b's record of tile t; rows i0..i0 +
                // R and their block b exist (the caller's guarantee).
                unsafe {
                    super::block_epilogue_avx2::<R, K>(blk, cb, h, &ip, qd, qsum, nb, b, &mut acc)
                };
            }
            for j in 0..R {
                // SAFETY: 8 floats at lanes 8h..8h + 8 of `o[j]`.
                unsafe { _mm256_storeu_ps(o[j].as_mut_ptr().add(8 * h), acc[j]) };
            }
        }
        o
    }
}

/// AVX-512 VNNI kernel on row tiles: one 512-bit `vpdpbusd` per 4-byte
/// step of a block adds to 16 output rows at once; up to 8 activation rows
/// per pass over a tile.
pub mod vnni {
    use super::super::layout::{tile_record_bytes, PlainActs, TILE};
    use super::{drive_tiles, QuantKind, QuantWeights, Q4_0, Q4_1, Q5_0, Q5_1, Q5_HIGH, Q8_0, QK};
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

    /// Up to this many rows a pass keeps two integer chains per row.
    const SPLIT_ROWS: usize = 8;

    /// How far ahead (in weight bytes) the kernel prefetches: the stream
    /// comes from DRAM (the model is larger than the caches).
    const PREFETCH_BYTES: usize = 8192;

    /// Rows `r0..r1` of `w` (row tiles) against every activation row,
    /// written activation-row-major: `out[i * (r1 - r0) + (r - r0)]`.
    pub fn rows16(w: &QuantWeights, x: &PlainActs<'_>, r0: usize, r1: usize, out: &mut [f32]) {
        assert!(available());
        if w.kind.is_k() {
            return super::super::simd_k::rows16_vnni(w, x, r0, r1, out);
        }
        drive_tiles(w, x, r0, r1, out, MAX_ROWS, |t, i0, rr, put| {
            // SAFETY: `available()` confirmed AVX-512F/BW/VL/VNNI and F16C;
            // `drive_tiles` checked that tile t and activation rows
            // i0..i0 + rr exist.
            unsafe {
                match w.kind {
                    QuantKind::Q4_0 => go::<Q4_0>(w, x, t, i0, rr, put),
                    QuantKind::Q5_0 => go::<Q5_0>(w, x, t, i0, rr, put),
                    QuantKind::Q5_1 => go::<Q5_1>(w, x, t, i0, rr, put),
                    QuantKind::Q4_1 => go::<Q4_1>(w, x, t, i0, rr, put),
                    QuantKind::Q8_0 => go::<Q8_0>(w, x, t, i0, rr, put),
                    QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => {
                        unreachable!("K-quants go to simd_k")
                    }
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
    /// sum (Q4_0: 8, Q5_0: 16, Q8_0: 128), so it ends holding the exact block dot
    /// product of all 16 rows; then one scaled float accumulate (two for
    /// Q4_1 and Q5_1) per activation row. Lane l is row 16t + l throughout, and its
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
        let split = R <= SPLIT_ROWS;
        let base = w.qs.as_ptr().wrapping_add(t * nb * rec);
        let mask4 = _mm512_set1_epi8(0x0f);
        let zero = _mm512_setzero_si512();
        // Activation rows i0..i0 + R through raw pointers, so the block
        // loop carries no bounds checks (and no index array spilled to the
        // stack): the caller guarantees `nb` blocks for every row, as
        // `drive_tiles` asserts.
        let xm = i0 * nb;
        let (xq, qd, qsum, isum) = (
            x.qs.as_ptr().wrapping_add(xm * QK),
            x.qd.as_ptr().wrapping_add(xm),
            x.qsum.as_ptr().wrapping_add(xm),
            x.isum.as_ptr().wrapping_add(xm),
        );
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let blk = base.wrapping_add(b * rec);
            for off in (0..rec).step_by(64) {
                // A prefetch never faults, whatever the address.
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH_BYTES + off) as *const i8);
            }
            let mut ia: [__m512i; R] = core::array::from_fn(|j| {
                // SAFETY: block b of activation row i0 + j exists.
                let s = unsafe { *isum.add(j * nb + b) };
                match K {
                    Q4_0 => _mm512_set1_epi32(-(s << 3)),
                    Q5_0 => _mm512_set1_epi32(-(s << 4)),
                    Q8_0 => _mm512_set1_epi32(-(s << 7)),
                    _ => zero,
                }
            });
            let mut ib = [zero; R];
            let plane = if K == Q5_0 || K == Q5_1 {
                // SAFETY: Q5_0's 64-byte fifth-bit plane follows its nibbles.
                unsafe { ld(blk.add(Q5_HIGH)) }
            } else {
                zero
            };
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
                    let (we, wo) = (
                        _mm512_and_si512(raw, mask4),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask4),
                    );
                    if K == Q5_0 || K == Q5_1 {
                        (
                            with_fifth_bits(we, plane, 2 * u),
                            with_fifth_bits(wo, plane, 2 * u + 1),
                        )
                    } else {
                        (we, wo)
                    }
                };
                for j in 0..R {
                    // SAFETY: bytes 8u..8u + 8 of block b of activation
                    // row i0 + j.
                    let (e, o) = unsafe {
                        let p = xq.add((j * nb + b) * QK + 8 * u);
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
            let mw = if K == Q4_1 || K == Q5_1 {
                // SAFETY: Q4_1 and Q5_1 records end with the 16 minimums.
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
                // SAFETY: block b of activation row i0 + j exists.
                let (d, m) = unsafe { (*qd.add(j * nb + b), *qsum.add(j * nb + b)) };
                let sc = _mm512_mul_ps(dw, _mm512_set1_ps(d));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ip), sc, acc[j]);
                if K == Q4_1 || K == Q5_1 {
                    acc[j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(m), acc[j]);
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

    /// `nibbles` (codes 0..=15) with Q5_0's fifth bits of step `s` from
    /// its bit plane set at bit 4 of each byte: a 16-bit shift brings bit
    /// `s` to bit 4, one ternary-logic op (`a | (b & c)`) masks it in.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(crate) fn with_fifth_bits(nibbles: __m512i, plane: __m512i, s: usize) -> __m512i {
        let v = match s {
            0 => _mm512_slli_epi16::<4>(plane),
            1 => _mm512_slli_epi16::<3>(plane),
            2 => _mm512_slli_epi16::<2>(plane),
            3 => _mm512_slli_epi16::<1>(plane),
            4 => plane,
            5 => _mm512_srli_epi16::<1>(plane),
            6 => _mm512_srli_epi16::<2>(plane),
            _ => _mm512_srli_epi16::<3>(plane),
        };
        _mm512_ternarylogic_epi32::<0xF8>(nibbles, v, _mm512_set1_epi8(0x10))
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
            return unsafe { widen_avx512(src, dst) };
        }
        // SAFETY: F16C and AVX are available; the loop bounds every access.
        unsafe { widen_f16c(src, dst) }
    }

    #[target_feature(enable = "avx512f,avx2,f16c")]
    fn widen_avx512(src: &[half::f16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `src[i..]` holds 16 f16 (32 bytes), `dst[i..]` 16
            // floats.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
            }
            i += 16;
        }
        for j in i..n {
            dst[j] = src[j].to_f32();
        }
    }

    /// `kernels::exp_shifted` in 16-lane vectors where AVX-512 runs: the
    /// same operations per element as `exp_f32` (no contraction the scalar
    /// code does not make), the same 16 lane sums folded in the same
    /// order, the exponentials and their sum in one pass; the AVX2 version
    /// where AVX-512 is off, `None` where neither runs (the portable loop
    /// then does).
    pub fn exp_shifted(x: &mut [f32]) -> Option<(f32, f32)> {
        if !wide() {
            return exp_shifted_avx2(x);
        }
        // SAFETY: AVX-512F is available; every access is bounded by the
        // loops inside.
        Some(unsafe { exp_shifted_avx512(x) })
    }

    /// `exp_shifted` in 8-lane vectors where AVX2 and FMA run: the 16
    /// portable lanes kept as two registers (lanes 0-7 and 8-15), the
    /// exponentials operation for operation `exp_f32`'s, so the same bits
    /// as the portable loop. `None` without AVX2 and FMA.
    pub fn exp_shifted_avx2(x: &mut [f32]) -> Option<(f32, f32)> {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return None;
        }
        // SAFETY: AVX2 and FMA are available; every access is bounded by
        // the loops inside.
        Some(unsafe { exp_shifted_avx2_impl(x) })
    }

    #[target_feature(enable = "avx2,fma")]
    fn exp_shifted_avx2_impl(x: &mut [f32]) -> (f32, f32) {
        let n = x.len();
        let full = n / 16 * 16;
        let mut m0 = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut m1 = m0;
        let mut i = 0;
        while i < full {
            // SAFETY: `i + 16 <= n`.
            unsafe {
                m0 = _mm256_max_ps(_mm256_loadu_ps(x.as_ptr().add(i)), m0);
                m1 = _mm256_max_ps(_mm256_loadu_ps(x.as_ptr().add(i + 8)), m1);
            }
            i += 16;
        }
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` is 16 floats.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), m0);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), m1);
        }
        let max = x[full..]
            .iter()
            .chain(&lanes)
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        if max == f32::NEG_INFINITY {
            x.fill(0.0);
            return (max, 0.0);
        }
        let mx = _mm256_set1_ps(max);
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i < full {
            // SAFETY: `i + 16 <= n`.
            unsafe {
                let p = x.as_mut_ptr().add(i);
                let e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(p), mx));
                let e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(8)), mx));
                _mm256_storeu_ps(p, e0);
                _mm256_storeu_ps(p.add(8), e1);
                a0 = _mm256_add_ps(a0, e0);
                a1 = _mm256_add_ps(a1, e1);
            }
            i += 16;
        }
        // The tail (under 16) a masked vector at a time, summed in order
        // below as the portable loop sums it.
        while i < n {
            let r = (n - i).min(8);
            let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(r as i32), idx);
            // SAFETY: the mask enables lanes `i..i + r`, all below `n`;
            // disabled lanes are neither read nor written.
            unsafe {
                let p = x.as_mut_ptr().add(i);
                let e = exp8(_mm256_sub_ps(_mm256_maskload_ps(p, mask), mx));
                _mm256_maskstore_ps(p, mask, e);
            }
            i += r;
        }
        // SAFETY: `lanes` is 16 floats.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), a0);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), a1);
        }
        let sum = x[full..]
            .iter()
            .fold(crate::kernels::fold16(lanes), |s, &v| s + v);
        (max, sum)
    }

    /// `exp_f32` on 8 lanes, operation for operation (as `exp16`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        const LOG2E: f32 = std::f32::consts::LOG2_E;
        const C1: f32 = 0.693_359_4;
        const C2: f32 = -2.121_944_4e-4;
        const MAGIC: f32 = 12_582_912.0;
        // max/min return their second operand for a NaN: x second keeps a
        // NaN a NaN, as `clamp` does.
        let xc = _mm256_min_ps(
            _mm256_set1_ps(88.3),
            _mm256_max_ps(_mm256_set1_ps(-87.3), x),
        );
        let t = _mm256_add_ps(
            _mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)),
            _mm256_set1_ps(MAGIC),
        );
        let nf = _mm256_sub_ps(t, _mm256_set1_ps(MAGIC));
        let ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B40_0000));
        let r = _mm256_fmadd_ps(
            nf,
            _mm256_set1_ps(-C2),
            _mm256_fmadd_ps(nf, _mm256_set1_ps(-C1), xc),
        );
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.398_2e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.333_452e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_579_6e-2));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.166_666_65));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
        let e = _mm256_fmadd_ps(
            p,
            _mm256_mul_ps(r, r),
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            ni,
            _mm256_set1_epi32(127),
        )));
        let v = _mm256_mul_ps(e, scale);
        let low = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.3));
        let high = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(88.7));
        let v = _mm256_blendv_ps(v, _mm256_set1_ps(f32::INFINITY), high);
        _mm256_blendv_ps(v, _mm256_setzero_ps(), low)
    }

    #[target_feature(enable = "avx512f")]
    fn exp_shifted_avx512(x: &mut [f32]) -> (f32, f32) {
        let n = x.len();
        let full = n / 16 * 16;
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i < full {
            // SAFETY: `i + 16 <= n`.
            let v = unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) };
            m = _mm512_max_ps(v, m);
            i += 16;
        }
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` is 16 floats.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), m) };
        let max = x[full..]
            .iter()
            .chain(&lanes)
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        if max == f32::NEG_INFINITY {
            x.fill(0.0);
            return (max, 0.0);
        }
        let mx = _mm512_set1_ps(max);
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < full {
            // SAFETY: `i + 16 <= n`.
            unsafe {
                let p = x.as_mut_ptr().add(i);
                let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p), mx));
                _mm512_storeu_ps(p, e);
                acc = _mm512_add_ps(acc, e);
            }
            i += 16;
        }
        if full < n {
            // The tail in one masked vector (summed in order below, as the
            // portable loop sums it).
            let k: __mmask16 = ((1u32 << (n - full)) - 1) as u16;
            // SAFETY: the mask enables lanes `full..n` only; disabled
            // lanes are neither read nor written.
            unsafe {
                let p = x.as_mut_ptr().add(full);
                let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p), mx));
                _mm512_mask_storeu_ps(p, k, e);
            }
        }
        // SAFETY: `lanes` is 16 floats.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        let sum = x[full..]
            .iter()
            .fold(crate::kernels::fold16(lanes), |s, &v| s + v);
        (max, sum)
    }

    /// `exp_f32` on 16 lanes, operation for operation.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        const LOG2E: f32 = std::f32::consts::LOG2_E;
        const C1: f32 = 0.693_359_4;
        const C2: f32 = -2.121_944_4e-4;
        const MAGIC: f32 = 12_582_912.0;
        // max/min return their second operand for a NaN: put x second so
        // a NaN stays NaN, as `clamp` keeps it.
        let xc = _mm512_min_ps(
            _mm512_set1_ps(88.3),
            _mm512_max_ps(_mm512_set1_ps(-87.3), x),
        );
        let t = _mm512_add_ps(
            _mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
            _mm512_set1_ps(MAGIC),
        );
        let nf = _mm512_sub_ps(t, _mm512_set1_ps(MAGIC));
        let ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B40_0000));
        let r = _mm512_fmadd_ps(
            nf,
            _mm512_set1_ps(-C2),
            _mm512_fmadd_ps(nf, _mm512_set1_ps(-C1), xc),
        );
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.398_2e-3));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.333_452e-3));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166_579_6e-2));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.166_666_65));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5));
        let e = _mm512_fmadd_ps(
            p,
            _mm512_mul_ps(r, r),
            _mm512_add_ps(r, _mm512_set1_ps(1.0)),
        );
        let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
            ni,
            _mm512_set1_epi32(127),
        )));
        let v = _mm512_mul_ps(e, scale);
        let low = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-87.3));
        let high = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(88.7));
        let v = _mm512_mask_mov_ps(v, high, _mm512_set1_ps(f32::INFINITY));
        _mm512_mask_mov_ps(v, low, _mm512_setzero_ps())
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
}
