//! AVX2/FMA block-dot kernels, selected at run time (`kernels` falls back to
//! portable code elsewhere).
//!
//! Each weight block is loaded and unpacked once and applied to up to four
//! activation rows. Every activation row keeps its own accumulator and sees
//! the same instruction sequence whatever the number of rows, so results are
//! batch-invariant, as in the portable path.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

/// Whether this CPU has AVX2 and FMA (checked once).
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::env::var_os("SPECD_NO_SIMD").is_none()
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
    })
}

/// The weight formats these kernels handle.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// nibbles minus 8, scale only
    Q4_0,
    /// nibbles, scale and minimum
    Q4_1,
    /// signed bytes, scale only
    Q8_0,
}

/// Borrowed views of one weight matrix and one batch of Q8 activations.
pub struct Operands<'a> {
    pub kind: Kind,
    pub w_qs: &'a [u8],
    pub w_d: &'a [f32],
    pub w_m: &'a [f32],
    pub x_qs: &'a [i8],
    pub x_d: &'a [f32],
    pub x_s: &'a [f32],
    /// Blocks per row.
    pub nb: usize,
    /// Activation rows.
    pub n: usize,
}

impl Operands<'_> {
    fn check(&self, r1: usize) {
        let wbytes = match self.kind {
            Kind::Q4_0 | Kind::Q4_1 => 16,
            Kind::Q8_0 => 32,
        };
        assert!(self.w_qs.len() >= r1 * self.nb * wbytes);
        assert!(self.w_d.len() >= r1 * self.nb);
        if self.kind == Kind::Q4_1 {
            assert!(self.w_m.len() >= r1 * self.nb);
            assert!(self.x_s.len() >= self.n * self.nb);
        }
        assert!(self.x_qs.len() >= self.n * self.nb * 32);
        assert!(self.x_d.len() >= self.n * self.nb);
    }
}

/// Rows `r0..r1` of the weights against every activation row, written
/// weight-row-major: `out[(r - r0) * n + i]`.
pub fn rows(op: &Operands<'_>, r0: usize, r1: usize, out: &mut [f32]) {
    assert!(available());
    op.check(r1);
    assert!(out.len() >= (r1 - r0) * op.n);
    // SAFETY: `available()` confirmed AVX2 and FMA on this CPU, and
    // `check` confirmed every slice covers the blocks the kernel reads.
    unsafe { rows_avx2(op, r0, r1, out) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2(op: &Operands<'_>, r0: usize, r1: usize, out: &mut [f32]) {
    let n = op.n;
    for r in r0..r1 {
        let o = &mut out[(r - r0) * n..(r - r0 + 1) * n];
        let mut i = 0;
        while i < n {
            match n - i {
                1 => row_group::<1>(op, r, i, o),
                2 => row_group::<2>(op, r, i, o),
                3 => row_group::<3>(op, r, i, o),
                _ => row_group::<4>(op, r, i, o),
            }
            i += 4.min(n - i);
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// Weight row `r` against activation rows `i0..i0 + R`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn row_group<const R: usize>(op: &Operands<'_>, r: usize, i0: usize, o: &mut [f32]) {
    let nb = op.nb;
    let mask = _mm_set1_epi8(0x0f);
    let eight = _mm256_set1_epi8(8);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut accm = [0f32; R];
    for b in 0..nb {
        let gb = r * nb + b;
        // Unsigned weight bytes and, where the weights are signed, their
        // signs folded into the activations (maddubs takes u8 x i8).
        let (w_abs, w_sgn) = match op.kind {
            Kind::Q4_0 | Kind::Q4_1 => {
                // SAFETY: `check` guarantees 16 bytes at gb * 16.
                let raw =
                    unsafe { _mm_loadu_si128(op.w_qs.as_ptr().add(gb * 16) as *const __m128i) };
                let lo = _mm_and_si128(raw, mask);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), mask);
                let w = _mm256_set_m128i(hi, lo);
                if op.kind == Kind::Q4_0 {
                    let ws = _mm256_sub_epi8(w, eight);
                    (_mm256_sign_epi8(ws, ws), Some(ws))
                } else {
                    (w, None)
                }
            }
            Kind::Q8_0 => {
                // SAFETY: `check` guarantees 32 bytes at gb * 32.
                let ws =
                    unsafe { _mm256_loadu_si256(op.w_qs.as_ptr().add(gb * 32) as *const __m256i) };
                (_mm256_sign_epi8(ws, ws), Some(ws))
            }
        };
        let wd = op.w_d[gb];
        for j in 0..R {
            let xb = (i0 + j) * nb + b;
            // SAFETY: `check` guarantees 32 activation bytes at xb * 32.
            let x = unsafe { _mm256_loadu_si256(op.x_qs.as_ptr().add(xb * 32) as *const __m256i) };
            let x = match w_sgn {
                Some(ws) => _mm256_sign_epi8(x, ws),
                None => x,
            };
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, x), ones);
            let scale = _mm256_set1_ps(wd * op.x_d[xb]);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[j]);
            if op.kind == Kind::Q4_1 {
                accm[j] = op.w_m[gb].mul_add(op.x_s[xb], accm[j]);
            }
        }
    }
    for j in 0..R {
        o[i0 + j] = hsum(acc[j]) + accm[j];
    }
}

/// AVX-512 VNNI kernels: two 32-element blocks per 512-bit `vpdpbusd`.
///
/// Activations are prepared in a pair-interleaved layout so that a pair of
/// consecutive Q4 weight blocks needs no shuffling: for blocks (b0, b1) the
/// 64 activation bytes are `[b0 x0..16, b1 x0..16, b0 x16..32, b1 x16..32]`,
/// matching `[lo nibbles of b0|b1, hi nibbles of b0|b1]`. Q8_0 weights are
/// permuted into the same order in registers (one lane shuffle per pair) and
/// made unsigned with +128; signed offsets (-8 for Q4_0, -128 for Q8_0) are
/// removed exactly in integers with a per-pair activation sum vector.
pub mod vnni {
    use super::Kind;
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

    /// Activations in the pair layout (rows of `nb` blocks, `nb` even),
    /// pair-major across rows.
    #[derive(Debug, Default)]
    pub struct PairActs {
        pub nb: usize,
        pub n: usize,
        /// `n * nb * 32` bytes, pair-interleaved.
        pub qs: Vec<i8>,
        /// Per pair: `[d0; 4] ++ [d1; 4]`.
        pub dv: Vec<f32>,
        /// Per pair: 8 lane sums of the activation bytes (after folding).
        pub sums: Vec<i32>,
    }

    impl PairActs {
        /// Re-lay plain Q8 blocks (`qs`, `d` per block) into the pair layout.
        pub fn prepare(&mut self, qs: &[i8], d: &[f32], n: usize, nb: usize) {
            debug_assert!(nb.is_multiple_of(2));
            self.nb = nb;
            self.n = n;
            let pairs = n * nb / 2;
            self.qs.resize(n * nb * 32, 0);
            self.dv.resize(pairs * 8, 0.0);
            self.sums.resize(pairs * 8, 0);
            // Pair-major: slot (q, row) = q * n + row, so the rows a kernel
            // group reads for one weight pair sit next to each other.
            let per_row = nb / 2;
            for row in 0..n {
                for q in 0..per_row {
                    let (b0, b1) = (row * nb + 2 * q, row * nb + 2 * q + 1);
                    let slot = q * n + row;
                    let src0 = &qs[b0 * 32..b0 * 32 + 32];
                    let src1 = &qs[b1 * 32..b1 * 32 + 32];
                    let dst = &mut self.qs[slot * 64..slot * 64 + 64];
                    dst[0..16].copy_from_slice(&src0[0..16]);
                    dst[16..32].copy_from_slice(&src1[0..16]);
                    dst[32..48].copy_from_slice(&src0[16..32]);
                    dst[48..64].copy_from_slice(&src1[16..32]);
                    for l in 0..8 {
                        let s: i32 = dst[4 * l..4 * l + 4].iter().map(|&v| v as i32).sum::<i32>()
                            + dst[32 + 4 * l..32 + 4 * l + 4]
                                .iter()
                                .map(|&v| v as i32)
                                .sum::<i32>();
                        self.sums[slot * 8 + l] = s;
                    }
                    self.dv[slot * 8..slot * 8 + 4].fill(d[b0]);
                    self.dv[slot * 8 + 4..slot * 8 + 8].fill(d[b1]);
                }
            }
        }
    }

    pub struct Weights<'a> {
        pub kind: Kind,
        pub qs: &'a [u8],
        pub d: &'a [f32],
        pub m: &'a [f32],
    }

    /// Rows `r0..r1` of `w` against all activation rows; `xs` holds the
    /// plain per-block `d * sum(q)` (Q4_1's minimum term).
    pub fn rows(w: &Weights<'_>, a: &PairActs, xs: &[f32], r0: usize, r1: usize, out: &mut [f32]) {
        assert!(available());
        let (nb, n) = (a.nb, a.n);
        assert!(nb.is_multiple_of(2));
        let wbytes = if w.kind == Kind::Q8_0 { 32 } else { 16 };
        assert!(w.qs.len() >= r1 * nb * wbytes && w.d.len() >= r1 * nb);
        if w.kind == Kind::Q4_1 {
            assert!(w.m.len() >= r1 * nb && xs.len() >= n * nb);
        }
        assert!(
            a.qs.len() >= n * nb * 32 && a.dv.len() >= n * nb * 4 && a.sums.len() >= n * nb * 4
        );
        assert!(out.len() >= (r1 - r0) * n);
        // SAFETY: `available()` confirmed AVX-512F/BW/VL/VNNI, and the
        // asserts above confirm every slice covers what the kernel reads.
        unsafe { rows_vnni(w, a, xs, r0, r1, out) }
    }

    const Q4_0: u8 = 0;
    const Q4_1: u8 = 1;
    const Q8_0: u8 = 2;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn rows_vnni(
        w: &Weights<'_>,
        a: &PairActs,
        xs: &[f32],
        r0: usize,
        r1: usize,
        out: &mut [f32],
    ) {
        match w.kind {
            Kind::Q4_0 => rows_k::<Q4_0>(w, a, xs, r0, r1, out),
            Kind::Q4_1 => rows_k::<Q4_1>(w, a, xs, r0, r1, out),
            Kind::Q8_0 => rows_k::<Q8_0>(w, a, xs, r0, r1, out),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    fn rows_k<const K: u8>(
        w: &Weights<'_>,
        a: &PairActs,
        xs: &[f32],
        r0: usize,
        r1: usize,
        out: &mut [f32],
    ) {
        let n = a.n;
        for r in r0..r1 {
            let o = &mut out[(r - r0) * n..(r - r0 + 1) * n];
            let mut i = 0;
            while i < n {
                // Up to 8 activation rows share one unpacked weight pair
                // (32 vector registers hold 8 accumulators with room to
                // spare), so a verify of up to 8 tokens reads and unpacks
                // each weight block once.
                match n - i {
                    1 => group::<1, K>(w, a, xs, r, i, o),
                    2 => group::<2, K>(w, a, xs, r, i, o),
                    3 => group::<3, K>(w, a, xs, r, i, o),
                    4 => group::<4, K>(w, a, xs, r, i, o),
                    5 => group::<5, K>(w, a, xs, r, i, o),
                    6 => group::<6, K>(w, a, xs, r, i, o),
                    7 => group::<7, K>(w, a, xs, r, i, o),
                    _ => group::<8, K>(w, a, xs, r, i, o),
                }
                i += 8.min(n - i);
            }
        }
    }

    /// Sequential-order dot of two f32 slices of equal length (16 lanes).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    fn dot16(x: &[f32], y: &[f32]) -> f32 {
        let len = x.len().min(y.len());
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < len {
            let rem = (len - i).min(16);
            let mask: __mmask16 = if rem == 16 { 0xffff } else { (1u16 << rem) - 1 };
            // SAFETY: the mask limits the loads to `rem` elements inside both slices.
            let (xv, yv) = unsafe {
                (
                    _mm512_maskz_loadu_ps(mask, x.as_ptr().add(i)),
                    _mm512_maskz_loadu_ps(mask, y.as_ptr().add(i)),
                )
            };
            acc = _mm512_fmadd_ps(xv, yv, acc);
            i += 16;
        }
        _mm512_reduce_add_ps(acc)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    fn group<const R: usize, const K: u8>(
        w: &Weights<'_>,
        a: &PairActs,
        xs: &[f32],
        r: usize,
        i0: usize,
        o: &mut [f32],
    ) {
        let nb = a.nb;
        let pairs = nb / 2;
        let mask = _mm256_set1_epi8(0x0f);
        let flip = _mm512_set1_epi8(-128);
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm256_setzero_ps(); R];
        for p in 0..pairs {
            let gb = r * nb + 2 * p;
            let wv = match K {
                Q4_0 | Q4_1 => {
                    // SAFETY: `rows` checked 16 bytes per block for blocks gb, gb + 1.
                    let raw =
                        unsafe { _mm256_loadu_si256(w.qs.as_ptr().add(gb * 16) as *const __m256i) };
                    let lo = _mm256_and_si256(raw, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
                }
                _ => {
                    // SAFETY: `rows` checked 32 bytes per block for blocks gb, gb + 1.
                    let raw =
                        unsafe { _mm512_loadu_si512(w.qs.as_ptr().add(gb * 32) as *const __m512i) };
                    // [b0 lo, b0 hi, b1 lo, b1 hi] -> [b0 lo, b1 lo, b0 hi, b1 hi], then +128.
                    _mm512_xor_si512(_mm512_shuffle_i64x2::<0b11_01_10_00>(raw, raw), flip)
                }
            };
            let dw = _mm256_set_m128(_mm_set1_ps(w.d[gb + 1]), _mm_set1_ps(w.d[gb]));
            for j in 0..R {
                let xp = p * a.n + i0 + j;
                // SAFETY: `rows` checked 64 activation bytes and 8 scale and
                // sum lanes per pair for every row.
                let (x, dx, sums) = unsafe {
                    (
                        _mm512_loadu_si512(a.qs.as_ptr().add(xp * 64) as *const __m512i),
                        _mm256_loadu_ps(a.dv.as_ptr().add(xp * 8)),
                        _mm256_loadu_si256(a.sums.as_ptr().add(xp * 8) as *const __m256i),
                    )
                };
                let prod = _mm512_dpbusd_epi32(zero, wv, x);
                let mut p8 = _mm256_add_epi32(
                    _mm512_castsi512_si256(prod),
                    _mm512_extracti64x4_epi64::<1>(prod),
                );
                match K {
                    Q4_0 => p8 = _mm256_sub_epi32(p8, _mm256_slli_epi32::<3>(sums)),
                    Q8_0 => p8 = _mm256_sub_epi32(p8, _mm256_slli_epi32::<7>(sums)),
                    _ => {}
                }
                let scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(p8), dw);
                acc[j] = _mm256_fmadd_ps(scaled, dx, acc[j]);
            }
        }
        for j in 0..R {
            let mut v = super::hsum(acc[j]);
            if K == Q4_1 {
                let i = i0 + j;
                v += dot16(&w.m[r * nb..(r + 1) * nb], &xs[i * nb..(i + 1) * nb]);
            }
            o[i0 + j] = v;
        }
    }
}
