//! x86-64 K-quant kernels (Q4_K, Q5_K, Q6_K) on the super-block records of
//! `kquant`: AVX2 (a tile as two 8-row halves, `vpmaddubsw`) and AVX-512
//! VNNI (16 rows per vector, `vpdpbusd`). Each runs the per-lane sequence
//! of `kquant`'s module comment, so both give the portable kernel's bits;
//! every activation row keeps its own accumulators, so results are
//! batch-invariant.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::kquant::{Q4K_D, Q4K_DMIN, Q4K_M, Q4K_SC, Q5K_HI, Q6K_D, Q6K_HI, Q6K_SC, SUBS};
use super::layout::{drive_tiles, tile_record_bytes, PlainActs, QuantKind, QuantWeights, QK, TILE};
use super::simd::fifth_bits_avx2;
use super::simd::vnni::with_fifth_bits;

/// Const-generic stand-ins for the K kinds.
const Q4K: u8 = 0;
const Q6K: u8 = 1;
const Q5K: u8 = 2;

/// How far ahead (bytes) the kernels prefetch the record stream.
const PREFETCH: usize = 8192;

/// Most activation rows one AVX2 pass over a tile half serves.
const AVX2_MAX_ROWS: usize = 4;
/// Most activation rows one VNNI pass over a tile serves.
const VNNI_MAX_ROWS: usize = 8;

/// Rows `r0..r1` of K-quant weights against every activation row (AVX2),
/// activation-row-major.
pub fn rows16_avx2(w: &QuantWeights, x: &PlainActs<'_>, r0: usize, r1: usize, out: &mut [f32]) {
    assert!(super::simd::available() && w.kind.is_k());
    drive_tiles(w, x, r0, r1, out, AVX2_MAX_ROWS, |t, i0, rr, put| {
        // SAFETY: `available()` confirmed AVX2, FMA and F16C; `drive_tiles`
        // checked that tile t and activation rows i0..i0 + rr exist.
        unsafe {
            match w.kind {
                QuantKind::Q4K => avx2_go::<Q4K>(w, x, t, i0, rr, put),
                QuantKind::Q5K => avx2_go::<Q5K>(w, x, t, i0, rr, put),
                _ => avx2_go::<Q6K>(w, x, t, i0, rr, put),
            }
        }
    });
}

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

/// 4 activation bytes of step `s` of block `xb`, as an i32.
///
/// Block `xb`'s entry of one of `x`'s per-block arrays, read without a
/// bounds check (the kernels' inner loops).
///
/// # Safety
/// Block `xb` exists in `x`, as `drive_tiles` checks.
#[inline]
pub(crate) unsafe fn meta<T: Copy>(v: &[T], xb: usize) -> T {
    debug_assert!(xb < v.len());
    // SAFETY: the caller's guarantee.
    unsafe { *v.get_unchecked(xb) }
}

/// # Safety
/// Block `xb` exists in `x` (as `drive_tiles` checks) and `s < 8`.
#[inline]
unsafe fn act4(x: &PlainActs<'_>, xb: usize, s: usize) -> i32 {
    // SAFETY: the caller's guarantee: bytes 4s..4s + 4 of block xb.
    unsafe { (x.qs.as_ptr().add(xb * QK + 4 * s) as *const i32).read_unaligned() }
}

/// The 16 rows of K-quant tile `t` against activation rows `i0..i0 + R`,
/// as two halves of 8 rows. Per sub-block: Q4_K steps in pairs through
/// `vpmaddubsw` summed exactly in 16 bits (at most 8 * 2 * 15 * 127), Q6_K
/// step pairs (at most 2 * 2 * 63 * 127) widened into the half block they
/// belong to; then the scaled float accumulates of `kquant`.
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
    let nsb = nb / SUBS;
    let rec = tile_record_bytes(w.kind);
    let base = w.qs.as_ptr().wrapping_add(t * nsb * rec);
    let mask4 = _mm256_set1_epi8(0x0f);
    let mhi = _mm256_set1_epi8(0x30);
    let ones = _mm256_set1_epi16(1);
    let zero = _mm256_setzero_si256();
    let mut o = [[0f32; TILE]; R];
    for h in 0..2 {
        let mut acc = [_mm256_setzero_ps(); R];
        for sb in 0..nsb {
            let blk = base.wrapping_add(sb * rec);
            if h == 0 {
                for off in (0..rec).step_by(64) {
                    // A prefetch never faults, whatever the address.
                    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH + off) as *const i8);
                }
            }
            let dofs = if K != Q6K { Q4K_D } else { Q6K_D };
            // SAFETY: the record's 16 `d` (and Q4_K `dmin`) follow its
            // codes; half h is 8 of them.
            let (d, dmin) = unsafe {
                (
                    _mm256_cvtph_ps(_mm_loadu_si128(blk.add(dofs + 16 * h) as *const __m128i)),
                    if K != Q6K {
                        _mm256_cvtph_ps(_mm_loadu_si128(
                            blk.add(Q4K_DMIN + 16 * h) as *const __m128i
                        ))
                    } else {
                        _mm256_setzero_ps()
                    },
                )
            };
            for j in 0..SUBS {
                let xb: [usize; R] = core::array::from_fn(|r| (i0 + r) * nb + sb * SUBS + j);
                // SAFETY: blocks xb exist; steps are below 8.
                let xs = |r: usize, s: usize| _mm256_set1_epi32(unsafe { act4(x, xb[r], s) });
                let lo = blk.wrapping_add(256 * j);
                let mut ipa: [__m256i; R] = core::array::from_fn(|r| {
                    if K == Q6K {
                        _mm256_set1_epi32(-32 * x.hsum[xb[r]])
                    } else {
                        zero
                    }
                });
                let mut ipb: [__m256i; R] = core::array::from_fn(|r| {
                    if K == Q6K {
                        _mm256_set1_epi32(-32 * (x.isum[xb[r]] - x.hsum[xb[r]]))
                    } else {
                        zero
                    }
                });
                if K != Q6K {
                    let plane = if K == Q5K {
                        // SAFETY: half h of sub-block j's fifth-bit plane
                        // in the Q5_K record.
                        unsafe { _mm256_loadu_si256(blk.add(Q5K_HI + 64 * j + 32 * h).cast()) }
                    } else {
                        zero
                    };
                    let mut p16 = [zero; R];
                    for u in 0..4 {
                        // SAFETY: half h of packed steps 2u, 2u + 1 of
                        // sub-block j lies in the record's codes.
                        let raw = unsafe { _mm256_loadu_si256(lo.add(64 * u + 32 * h).cast()) };
                        let mut we = _mm256_and_si256(raw, mask4);
                        let mut wo = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask4);
                        if K == Q5K {
                            we = _mm256_or_si256(we, fifth_bits_avx2(plane, 2 * u));
                            wo = _mm256_or_si256(wo, fifth_bits_avx2(plane, 2 * u + 1));
                        }
                        for r in 0..R {
                            let e = _mm256_maddubs_epi16(we, xs(r, 2 * u));
                            let d = _mm256_maddubs_epi16(wo, xs(r, 2 * u + 1));
                            p16[r] = _mm256_add_epi16(p16[r], _mm256_add_epi16(e, d));
                        }
                        // 5-bit codes: widen every two step pairs.
                        if u == 3 || (K == Q5K && u == 1) {
                            for r in 0..R {
                                ipa[r] = _mm256_add_epi32(ipa[r], _mm256_madd_epi16(p16[r], ones));
                                p16[r] = zero;
                            }
                        }
                    }
                } else {
                    let hi = blk.wrapping_add(Q6K_HI + 128 * j);
                    for c in 0..2 {
                        // SAFETY: half h of the high bits of steps
                        // 4c..4c + 4 of sub-block j.
                        let hr = unsafe { _mm256_loadu_si256(hi.add(64 * c + 32 * h).cast()) };
                        let hk = [
                            _mm256_and_si256(_mm256_slli_epi16::<4>(hr), mhi),
                            _mm256_and_si256(_mm256_slli_epi16::<2>(hr), mhi),
                            _mm256_and_si256(hr, mhi),
                            _mm256_and_si256(_mm256_srli_epi16::<2>(hr), mhi),
                        ];
                        for v in 0..2 {
                            let u = 2 * c + v;
                            // SAFETY: as for Q4_K above.
                            let raw = unsafe { _mm256_loadu_si256(lo.add(64 * u + 32 * h).cast()) };
                            let we = _mm256_or_si256(_mm256_and_si256(raw, mask4), hk[2 * v]);
                            let wo = _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask4),
                                hk[2 * v + 1],
                            );
                            for r in 0..R {
                                let p = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(we, xs(r, 2 * u)),
                                    _mm256_maddubs_epi16(wo, xs(r, 2 * u + 1)),
                                );
                                let p = _mm256_madd_epi16(p, ones);
                                if c == 0 {
                                    ipa[r] = _mm256_add_epi32(ipa[r], p);
                                } else {
                                    ipb[r] = _mm256_add_epi32(ipb[r], p);
                                }
                            }
                        }
                    }
                }
                let scales = |off: usize, signed: bool| {
                    // SAFETY: 8 scale bytes of half h of a sub-block's 16.
                    let v = unsafe { _mm_loadl_epi64(blk.add(off + 8 * h).cast()) };
                    _mm256_cvtepi32_ps(if signed {
                        _mm256_cvtepi8_epi32(v)
                    } else {
                        _mm256_cvtepu8_epi32(v)
                    })
                };
                if K != Q6K {
                    let sc = scales(Q4K_SC + TILE * j, false);
                    let m = scales(Q4K_M + TILE * j, false);
                    for r in 0..R {
                        let dx = _mm256_set1_ps(x.qd[xb[r]]);
                        let sx = _mm256_set1_ps(x.isum[xb[r]] as f32);
                        let ip = _mm256_mul_ps(sc, _mm256_cvtepi32_ps(ipa[r]));
                        acc[r] = _mm256_fmadd_ps(ip, _mm256_mul_ps(d, dx), acc[r]);
                        acc[r] =
                            _mm256_fnmadd_ps(_mm256_mul_ps(m, sx), _mm256_mul_ps(dmin, dx), acc[r]);
                    }
                } else {
                    let slo = scales(Q6K_SC + TILE * (2 * j), true);
                    let shi = scales(Q6K_SC + TILE * (2 * j + 1), true);
                    for r in 0..R {
                        let dx = _mm256_set1_ps(x.qd[xb[r]]);
                        let isc = _mm256_fmadd_ps(
                            shi,
                            _mm256_cvtepi32_ps(ipb[r]),
                            _mm256_mul_ps(slo, _mm256_cvtepi32_ps(ipa[r])),
                        );
                        acc[r] = _mm256_fmadd_ps(isc, _mm256_mul_ps(d, dx), acc[r]);
                    }
                }
            }
        }
        for r in 0..R {
            // SAFETY: 8 floats at lanes 8h..8h + 8 of `o[r]`.
            unsafe { _mm256_storeu_ps(o[r].as_mut_ptr().add(8 * h), acc[r]) };
        }
    }
    o
}

/// Rows `r0..r1` of K-quant weights against every activation row (AVX-512
/// VNNI), activation-row-major.
pub fn rows16_vnni(w: &QuantWeights, x: &PlainActs<'_>, r0: usize, r1: usize, out: &mut [f32]) {
    assert!(super::simd::vnni::available() && w.kind.is_k());
    drive_tiles(w, x, r0, r1, out, VNNI_MAX_ROWS, |t, i0, rr, put| {
        // SAFETY: `available()` confirmed AVX-512F/BW/VL/VNNI and F16C;
        // `drive_tiles` checked that tile t and activation rows
        // i0..i0 + rr exist.
        unsafe {
            match w.kind {
                QuantKind::Q4K => vnni_go::<Q4K>(w, x, t, i0, rr, put),
                QuantKind::Q5K => vnni_go::<Q5K>(w, x, t, i0, rr, put),
                _ => vnni_go::<Q6K>(w, x, t, i0, rr, put),
            }
        }
    });
}

/// # Safety
/// As `vnni_tile`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn vnni_go<const K: u8>(
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
            1 => put(&vnni_tile::<1, K>(w, x, t, i0)),
            2 => put(&vnni_tile::<2, K>(w, x, t, i0)),
            3 => put(&vnni_tile::<3, K>(w, x, t, i0)),
            4 => put(&vnni_tile::<4, K>(w, x, t, i0)),
            5 => put(&vnni_tile::<5, K>(w, x, t, i0)),
            6 => put(&vnni_tile::<6, K>(w, x, t, i0)),
            7 => put(&vnni_tile::<7, K>(w, x, t, i0)),
            _ => put(&vnni_tile::<8, K>(w, x, t, i0)),
        }
    }
}

/// The 16 rows of K-quant tile `t` against activation rows `i0..i0 + R`:
/// per sub-block, each 64-byte step pair is unpacked once (Q6_K with its
/// high bits) and met by every row's 4 activation bytes broadcast in
/// `vpdpbusd`, into two integer chains (Q6_K: the two half blocks, each
/// started from its offset correction; Q4_K and Q5_K: even and odd steps,
/// which halves each chain's latency); then `kquant`'s float accumulates.
///
/// # Safety
/// AVX-512F/BW/VL/VNNI and F16C are available; tile `t` and activation
/// rows `i0..i0 + R` exist (as `drive_tiles` checks).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn vnni_tile<const R: usize, const K: u8>(
    w: &QuantWeights,
    x: &PlainActs<'_>,
    t: usize,
    i0: usize,
) -> [[f32; TILE]; R] {
    let nb = w.nb;
    let nsb = nb / SUBS;
    let rec = tile_record_bytes(w.kind);
    let base = w.qs.as_ptr().wrapping_add(t * nsb * rec);
    let mask4 = _mm512_set1_epi8(0x0f);
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); R];
    for sb in 0..nsb {
        let blk = base.wrapping_add(sb * rec);
        for off in (0..rec).step_by(64) {
            // A prefetch never faults, whatever the address.
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH + off) as *const i8);
        }
        let dofs = if K != Q6K { Q4K_D } else { Q6K_D };
        // SAFETY: the record's 16 `d` (and Q4_K `dmin`) follow its codes.
        let (d, dmin) = unsafe {
            (
                _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(dofs).cast())),
                if K != Q6K {
                    _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(Q4K_DMIN).cast()))
                } else {
                    _mm512_setzero_ps()
                },
            )
        };
        for j in 0..SUBS {
            let xb: [usize; R] = core::array::from_fn(|r| (i0 + r) * nb + sb * SUBS + j);
            let lo = blk.wrapping_add(256 * j);
            let mut ia: [__m512i; R] = core::array::from_fn(|r| {
                if K == Q6K {
                    // SAFETY: block xb[r] exists (the caller's guarantee).
                    _mm512_set1_epi32(-32 * unsafe { meta(x.hsum, xb[r]) })
                } else {
                    zero
                }
            });
            let mut ib: [__m512i; R] = core::array::from_fn(|r| {
                if K == Q6K {
                    // SAFETY: block xb[r] exists (the caller's guarantee).
                    _mm512_set1_epi32(-32 * unsafe { meta(x.isum, xb[r]) - meta(x.hsum, xb[r]) })
                } else {
                    zero
                }
            });
            // Q6_K's high bits of sub-block j (Q4_K has none).
            let hr: [__m512i; 2] = if K == Q6K {
                let hi = blk.wrapping_add(Q6K_HI + 128 * j);
                // SAFETY: the 128 high-bit bytes of sub-block j lie in the
                // Q6_K record.
                unsafe {
                    [
                        _mm512_loadu_si512(hi.cast()),
                        _mm512_loadu_si512(hi.add(64).cast()),
                    ]
                }
            } else {
                [zero; 2]
            };
            let plane5 = if K == Q5K {
                // SAFETY: sub-block j's 64-byte fifth-bit plane in the
                // Q5_K record.
                unsafe { _mm512_loadu_si512(blk.add(Q5K_HI + 64 * j).cast()) }
            } else {
                zero
            };
            for u in 0..4 {
                // SAFETY: packed steps 2u, 2u + 1 are 64 of sub-block j's
                // 256 code bytes.
                let raw = unsafe { _mm512_loadu_si512(lo.add(64 * u).cast()) };
                let mut we = _mm512_and_si512(raw, mask4);
                let mut wo = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask4);
                if K == Q5K {
                    we = with_fifth_bits(we, plane5, 2 * u);
                    wo = with_fifth_bits(wo, plane5, 2 * u + 1);
                }
                if K == Q6K {
                    (we, wo) = with_q6_high_bits(we, wo, &hr, u);
                }
                for r in 0..R {
                    // SAFETY: blocks xb exist; steps 2u, 2u + 1 are below 8.
                    let (e, o) = unsafe { (act4(x, xb[r], 2 * u), act4(x, xb[r], 2 * u + 1)) };
                    let (e, o) = (_mm512_set1_epi32(e), _mm512_set1_epi32(o));
                    if K == Q6K {
                        if u < 2 {
                            ia[r] = _mm512_dpbusd_epi32(ia[r], we, e);
                            ia[r] = _mm512_dpbusd_epi32(ia[r], wo, o);
                        } else {
                            ib[r] = _mm512_dpbusd_epi32(ib[r], we, e);
                            ib[r] = _mm512_dpbusd_epi32(ib[r], wo, o);
                        }
                    } else {
                        ia[r] = _mm512_dpbusd_epi32(ia[r], we, e);
                        ib[r] = _mm512_dpbusd_epi32(ib[r], wo, o);
                    }
                }
            }
            let scales = |off: usize, signed: bool| {
                // SAFETY: a sub-block's 16 scale bytes.
                let v = unsafe { _mm_loadu_si128(blk.add(off).cast()) };
                _mm512_cvtepi32_ps(if signed {
                    _mm512_cvtepi8_epi32(v)
                } else {
                    _mm512_cvtepu8_epi32(v)
                })
            };
            if K != Q6K {
                let sc = scales(Q4K_SC + TILE * j, false);
                let m = scales(Q4K_M + TILE * j, false);
                for r in 0..R {
                    // SAFETY: block xb[r] exists (the caller's guarantee).
                    let (dq, sq) = unsafe { (meta(x.qd, xb[r]), meta(x.isum, xb[r])) };
                    let dx = _mm512_set1_ps(dq);
                    let sx = _mm512_set1_ps(sq as f32);
                    let ip = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(_mm512_add_epi32(ia[r], ib[r])));
                    acc[r] = _mm512_fmadd_ps(ip, _mm512_mul_ps(d, dx), acc[r]);
                    acc[r] =
                        _mm512_fnmadd_ps(_mm512_mul_ps(m, sx), _mm512_mul_ps(dmin, dx), acc[r]);
                }
            } else {
                let slo = scales(Q6K_SC + TILE * (2 * j), true);
                let shi = scales(Q6K_SC + TILE * (2 * j + 1), true);
                for r in 0..R {
                    // SAFETY: block xb[r] exists (the caller's guarantee).
                    let dx = _mm512_set1_ps(unsafe { meta(x.qd, xb[r]) });
                    let isc = _mm512_fmadd_ps(
                        shi,
                        _mm512_cvtepi32_ps(ib[r]),
                        _mm512_mul_ps(slo, _mm512_cvtepi32_ps(ia[r])),
                    );
                    acc[r] = _mm512_fmadd_ps(isc, _mm512_mul_ps(d, dx), acc[r]);
                }
            }
        }
    }
    let mut o = [[0f32; TILE]; R];
    for r in 0..R {
        // SAFETY: `o[r]` is exactly 16 floats.
        unsafe { _mm512_storeu_ps(o[r].as_mut_ptr(), acc[r]) };
    }
    o
}

/// Q6_K's unpacked low nibbles of steps 2u (`we`) and 2u + 1 (`wo`) with
/// their top two bits merged in at bits 4-5, from the sub-block's two
/// 64-byte high-bit planes `hr` (steps 4c..4c + 4 in plane c, step 4c + k
/// at bits 2k..2k + 2; 16-bit shifts, then a 0x30 mask).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) fn with_q6_high_bits(
    we: __m512i,
    wo: __m512i,
    hr: &[__m512i; 2],
    u: usize,
) -> (__m512i, __m512i) {
    let mhi = _mm512_set1_epi8(0x30);
    let h = hr[u / 2];
    let (he, ho) = if u.is_multiple_of(2) {
        (_mm512_slli_epi16::<4>(h), _mm512_slli_epi16::<2>(h))
    } else {
        (h, _mm512_srli_epi16::<2>(h))
    };
    (
        _mm512_or_si512(we, _mm512_and_si512(he, mhi)),
        _mm512_or_si512(wo, _mm512_and_si512(ho, mhi)),
    )
}
