//! f32 matrix products computed with bf16 inputs and f32 sums on Intel
//! AMX tiles (`TDPBF16PS`), for training, where bf16 products are the
//! usual precision and the f32 GEMM was most of a step. Not used by
//! inference: its products are not bit-identical to the integer paths.
//!
//! `gemm` computes `C[i][j] = sum_k A(i, k) B(j, k)` for strided f32
//! operands (so `x W^T` and both products of its backward read their
//! inputs in place, transposed or not). Both operands are rounded to bf16
//! (to nearest, ties to even) and packed: A as rows of 32-element K
//! chunks, B as AMX B tiles (16 rows of `B(j, k)` pairs for 16 `j`). Each
//! task multiplies a 32 x 32 block of C as four 16 x 16 f32 tiles held in
//! tile registers over the whole K loop (two A and two B tiles a step).
//! Accumulation order differs from the f32 GEMM, so results agree to
//! bf16's precision, not bit for bit.

use rayon::prelude::*;

/// A 2-D f32 operand: element `(i, k)` is `data[i * rs + k * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct Strided<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl Strided<'_> {
    fn at(&self, i: usize, k: usize) -> f32 {
        self.data[i * self.rs + k * self.cs]
    }
}

/// Whether `gemm` can run here (x86-64 with AMX-BF16, the tile state
/// granted, `SPECD_NO_AMX` unset).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::amx::bf16_available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// f32 to bf16 bits, rounding to nearest, ties to even (NaN stays NaN).
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// Rows and columns of C one block of tile products computes.
const BLOCK: usize = 32;
/// Elements of K per tile step (a 64-byte row of bf16).
const KC: usize = 32;

/// `out[i * n + j] = sum_k a(i, k) b(j, k)` for `i < m`, `j < n`, `k <
/// k`, in bf16 products with f32 sums. Panics unless `available()`.
pub fn gemm(m: usize, n: usize, k: usize, a: Strided<'_>, b: Strided<'_>, out: &mut [f32]) {
    assert!(available(), "bf16 tile products are not available here");
    assert!(out.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k > 0 {
        let last = |s: &Strided<'_>, rows: usize| (rows - 1) * s.rs + (k - 1) * s.cs;
        assert!(last(&a, m) < a.data.len() && last(&b, n) < b.data.len());
    }
    let kp = k.div_ceil(KC).max(1) * KC;
    let (mp, np) = (m.div_ceil(BLOCK) * BLOCK, n.div_ceil(BLOCK) * BLOCK);
    let pa = pack_rows(&a, m, mp, k, kp);
    let pb = pack_tiles(&b, n, np, k, kp);
    let chunks = kp / KC;
    let tile = 16 * KC;
    // One task per 32 rows of C: its A rows stay in cache across every
    // column block.
    out[..m * n]
        .par_chunks_mut(BLOCK * n)
        .enumerate()
        .for_each(|(ib, rows)| {
            let a0 = &pa[ib * BLOCK * kp..(ib * BLOCK + BLOCK) * kp];
            let mut c = [[0f32; BLOCK]; BLOCK];
            #[cfg(target_arch = "x86_64")]
            configure();
            for jb in 0..np / BLOCK {
                let b0 = &pb[(2 * jb) * chunks * tile..(2 * jb + 2) * chunks * tile];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `gemm` asserted `available()` and this thread's
                // tiles were just configured (`configure`); `a0` holds 32
                // rows of `kp` bf16 and `b0` two tile columns of `chunks`
                // B tiles; `c` is 32 x 32 f32.
                unsafe {
                    block(a0, b0, kp, chunks, &mut c)
                };
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("gemm asserts available(), false off x86-64 ({b0:p})");
                let j0 = jb * BLOCK;
                let live = (n - j0).min(BLOCK);
                for (r, row) in rows.chunks_mut(n).enumerate() {
                    row[j0..j0 + live].copy_from_slice(&c[r][..live]);
                }
            }
        });
}

/// A's rows as bf16, `mp` rows of `kp` (zero padded), 16 rows per task
/// with K outermost, so a transposed A (`cs > rs`) is read 16 contiguous
/// elements at a time.
fn pack_rows(a: &Strided<'_>, m: usize, mp: usize, k: usize, kp: usize) -> Vec<u16> {
    let mut v = vec![0u16; mp * kp];
    v.par_chunks_mut(16 * kp).enumerate().for_each(|(g, rows)| {
        let live = m.saturating_sub(16 * g).min(16);
        for kk in 0..k {
            for ii in 0..live {
                rows[ii * kp + kk] = to_bf16(a.at(16 * g + ii, kk));
            }
        }
    });
    v
}

/// B as AMX B tiles: for each 16 rows `j` of B (a tile column of C) and
/// each K chunk, 16 rows of 32 bf16 where row `r` holds `(B(j, c + 2r),
/// B(j, c + 2r + 1))` for the 16 `j` in order. `np` rows (zero padded).
fn pack_tiles(b: &Strided<'_>, n: usize, np: usize, k: usize, kp: usize) -> Vec<u16> {
    let chunks = kp / KC;
    let tile = 16 * KC;
    let mut v = vec![0u16; np / 16 * chunks * tile];
    v.par_chunks_mut(chunks * tile)
        .enumerate()
        .for_each(|(jt, tiles)| {
            let live = n.saturating_sub(16 * jt).min(16);
            for kk in 0..k {
                let (c, w) = (kk / KC, kk % KC);
                let row = &mut tiles[c * tile + (w / 2) * 32 + w % 2..];
                for jj in 0..live {
                    row[2 * jj] = to_bf16(b.at(16 * jt + jj, kk));
                }
            }
        });
    v
}

/// A palette-1 configuration: tmm0-tmm7 all 16 rows of 64 bytes.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct Config([u8; 64]);

/// Load this module's tile configuration on the calling thread (and tell
/// the int8 kernel its own is gone).
#[cfg(target_arch = "x86_64")]
fn configure() {
    assert!(available());
    let mut cfg = Config([0; 64]);
    cfg.0[0] = 1;
    for t in 0..8 {
        cfg.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
        cfg.0[48 + t] = 16;
    }
    // SAFETY: AMX is available and permitted (asserted); the
    // configuration is palette 1 with every tile 16 x 64 bytes, within
    // its limits.
    unsafe {
        std::arch::asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly))
    };
    super::amx::forget_config();
}

/// One 32 x 32 block of C: A rows 0-15 and 16-31 of `a0` (row stride `kp`
/// bf16) against the two tile columns of `b0`, four C tiles held in
/// tmm4-tmm7 over the K loop, stored to `c`.
///
/// # Safety
/// AMX-BF16 is available and this thread's tiles are configured by
/// `configure`; `a0` holds 32 rows of `kp` bf16; `b0` holds `2 * chunks`
/// B tiles of 512 bf16; `kp = chunks * KC`.
#[cfg(target_arch = "x86_64")]
unsafe fn block(a0: &[u16], b0: &[u16], kp: usize, chunks: usize, c: &mut [[f32; BLOCK]; BLOCK]) {
    use std::arch::asm;
    assert!(a0.len() >= BLOCK * kp && b0.len() >= 2 * chunks * 16 * KC && kp == chunks * KC);
    let tile = 16 * KC;
    let sa = kp * 2;
    // SAFETY: the caller's guarantee (tiles configured as 16 x 64 bytes);
    // every load reads 16 rows of 64 bytes inside `a0` (rows 0-15 or
    // 16-31 at stride `sa`, columns 32ch..32ch + 32) or one 1,024-byte B
    // tile inside `b0`; the stores write 16 rows of 64 bytes at stride 128
    // inside `c` (32 rows of 128 bytes). The tile registers hold the sums
    // between the asm blocks: nothing else on this thread uses them here.
    unsafe {
        asm!(
            "tilezero tmm4",
            "tilezero tmm5",
            "tilezero tmm6",
            "tilezero tmm7",
            options(nostack, nomem)
        );
        for ch in 0..chunks {
            let a_lo = a0.as_ptr().add(ch * KC);
            let a_hi = a_lo.add(16 * kp);
            let b_l = b0.as_ptr().add(ch * tile);
            let b_r = b0.as_ptr().add((chunks + ch) * tile);
            asm!(
                "tileloadd tmm0, [{a_lo} + {sa}*1]",
                "tileloadd tmm2, [{b_l} + {s64}*1]",
                "tdpbf16ps tmm4, tmm0, tmm2",
                "tileloadd tmm3, [{b_r} + {s64}*1]",
                "tdpbf16ps tmm5, tmm0, tmm3",
                "tileloadd tmm1, [{a_hi} + {sa}*1]",
                "tdpbf16ps tmm6, tmm1, tmm2",
                "tdpbf16ps tmm7, tmm1, tmm3",
                a_lo = in(reg) a_lo,
                a_hi = in(reg) a_hi,
                b_l = in(reg) b_l,
                b_r = in(reg) b_r,
                sa = in(reg) sa,
                s64 = in(reg) 64usize,
                options(nostack, readonly),
            );
        }
        let p = c.as_mut_ptr() as *mut u8;
        asm!(
            "tilestored [{p} + {s}*1], tmm4",
            "tilestored [{p} + {s}*1 + 64], tmm5",
            "tilestored [{p} + {s}*1 + 2048], tmm6",
            "tilestored [{p} + {s}*1 + 2112], tmm7",
            p = in(reg) p,
            s = in(reg) 128usize,
            options(nostack),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 bits to f32 (exact).
    fn from_bf16(h: u16) -> f32 {
        f32::from_bits((h as u32) << 16)
    }

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even.
        assert_eq!(to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(from_bf16(to_bf16(-2.5)), -2.5);
        assert!(from_bf16(to_bf16(f32::NAN)).is_nan());
    }

    /// The tile GEMM equals the same products of bf16-rounded inputs
    /// summed in f64 (to f32 summation error), for strided and
    /// transposed operands and shapes off every tile edge.
    #[test]
    fn gemm_equals_bf16_rounded_products() {
        if !available() {
            eprintln!("SKIPPED gemm_equals_bf16_rounded_products: no AMX-BF16 here");
            return;
        }
        let mut seed = 3u64;
        for &(m, n, k) in &[
            (1, 1, 1),
            (5, 17, 31),
            (33, 47, 65),
            (64, 96, 576),
            (70, 20, 300),
        ] {
            let av: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let bv: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed)).collect();
            // A row-major (m x k); B given transposed in memory (k x n).
            let bt: Vec<f32> = (0..k * n).map(|i| bv[(i % n) * k + i / n]).collect();
            let a = Strided {
                data: &av,
                rs: k,
                cs: 1,
            };
            let b = Strided {
                data: &bt,
                rs: 1,
                cs: n,
            };
            let mut out = vec![f32::NAN; m * n];
            gemm(m, n, k, a, b, &mut out);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|kk| {
                            from_bf16(to_bf16(av[i * k + kk])) as f64
                                * from_bf16(to_bf16(bv[j * k + kk])) as f64
                        })
                        .sum();
                    let scale: f64 = (0..k)
                        .map(|kk| (av[i * k + kk] * bv[j * k + kk]).abs() as f64)
                        .sum();
                    let got = out[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * scale + 1e-6,
                        "({m}, {n}, {k}) at ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
    }
}
