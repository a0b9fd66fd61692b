//! Elementwise kernels: RMSNorm, SiLU-gating, a vectorizable `exp` and the
//! max-shifted exponentials behind softmax and the attention partials.

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
pub(crate) fn sum_sq(x: &[f32]) -> f32 {
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

/// `g = gelu(g) * u` with GELU's tanh approximation,
/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (Gemma's GeGLU);
/// tanh as `1 - 2 / (e^(2z) + 1)` on `exp_f32`, so the loop vectorizes.
pub fn gelu_tanh_mul(g: &mut [f32], u: &[f32]) {
    const K: f32 = 0.797_884_6; // sqrt(2 / pi)
    for (gv, &uv) in g.iter_mut().zip(u) {
        let x = *gv;
        let z = K * x.mul_add(0.044_715 * x * x, x);
        let t = 1.0 - 2.0 / (exp_f32(2.0 * z) + 1.0);
        *gv = 0.5 * x * (1.0 + t) * uv;
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
    #[cfg(target_arch = "x86_64")]
    if super::simd::attn::available() {
        if let Some(r) = super::simd::attn::exp_shifted(x) {
            return r;
        }
    }
    exp_shifted_portable(x)
}

/// `exp_shifted` in portable code (the reference every SIMD path equals
/// bit for bit).
pub fn exp_shifted_portable(x: &mut [f32]) -> (f32, f32) {
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
