//! K-quants (ggml Q4_K, Q5_K and Q6_K) in the row-tile layout: repacking from
//! raw ggml super-blocks, row dequantization, and the portable kernel.
//!
//! One record holds one 256-element super-block of a 16-row tile:
//!
//! - Q4_K: codes of the 8 sub-blocks (256 bytes each), then `d` and `dmin`
//!   (16 x f16 each), then the 6-bit sub-block scales and minimums (8 x 16
//!   bytes each): 2,368 bytes, 148 per row and super-block (ggml: 144).
//! - Q5_K: the Q4_K record (low 4 bits in the codes), then each
//!   sub-block's fifth bits in 64 bytes (as Q5_0's plane: bit `s` of lane
//!   byte `4l + k` for step `s`): 2,880 bytes, 180 per row and super-block
//!   (ggml: 176).
//! - Q6_K: low nibbles of the 8 sub-blocks (256 bytes each), their high 2
//!   bits (128 bytes each), `d` (16 x f16), the 16 signed 8-bit scales of
//!   the 16-element groups (16 x 16 bytes): 3,360 bytes, 210 per row and
//!   super-block (ggml: 210).
//!
//! A sub-block's codes sit exactly as a Q4 block record's codes (see
//! `layout`): 8 steps of 64 bytes in which 4-byte lane `l` carries 4
//! elements of row `l`, steps 2u and 2u + 1 sharing the 64 bytes at 64u as
//! low and high nibbles. Q6_K's high bits of steps 4c..4c + 4 share the 64
//! bytes at 64c of the sub-block's 128, step 4c + k at bits 2k..2k + 2.
//! Scales are sub-block-major and lane-minor: one 16-byte load gives the
//! 16 rows' scales of one sub-block.
//!
//! Per 32-element block (ggml sub-block j of a super-block) and activation
//! row, lane `l` computes, with the activation block's scale `dx`, code
//! sum `sx` and first-half sum `hx`:
//!
//! - Q4_K and Q5_K: `ip = sum(q * x)`; `acc = fma(f32(sc) * f32(ip), d * dx, acc)`;
//!   `acc = fnmadd(f32(m) * f32(sx), dmin * dx, acc)`.
//! - Q6_K: `lo = sum_{e<16}(q * x) - 32 hx`, `hi = sum_{e>=16}(q * x) -
//!   32 (sx - hx)`; `acc = fma(fma(f32(sc_hi), f32(hi), f32(sc_lo) *
//!   f32(lo)), d * dx, acc)`.
//!
//! Every integer above is below 2^24 in magnitude (Q4_K: 63 * 15 * 127 *
//! 32; Q5_K: 63 * 31 * 127 * 32; Q6_K: 2 * 128 * 32 * 127 * 16), so its products and sums in f32 are
//! exact and every path (portable, AVX2, VNNI) gets the same bits.

use half::f16;

use super::layout::{
    drive_tiles, f16_bits_at, huge_page_vec, q5_high_at, tile_code_at, PlainActs, QuantKind,
    QuantWeights, QK, TILE,
};

/// Elements per super-block.
pub const QK_K: usize = 256;
/// 32-element sub-blocks per super-block.
pub(crate) const SUBS: usize = QK_K / QK;

/// Q4_K record offsets: per-row `d`, `dmin`, then sub-block scales and
/// minimums (16 bytes per sub-block).
pub(crate) const Q4K_D: usize = SUBS * 256;
pub(crate) const Q4K_DMIN: usize = Q4K_D + 2 * TILE;
pub(crate) const Q4K_SC: usize = Q4K_DMIN + 2 * TILE;
pub(crate) const Q4K_M: usize = Q4K_SC + SUBS * TILE;
/// Q5_K: the Q4_K record, then the fifth-bit planes (64 bytes per
/// sub-block).
pub(crate) const Q5K_HI: usize = Q4K_M + SUBS * TILE;
/// Q6_K record offsets: high bits (128 bytes per sub-block), per-row `d`,
/// the 16-element groups' scales (16 bytes per group).
pub(crate) const Q6K_HI: usize = SUBS * 256;
pub(crate) const Q6K_D: usize = Q6K_HI + SUBS * 128;
pub(crate) const Q6K_SC: usize = Q6K_D + 2 * TILE;

/// Bytes of one (tile, super-block) record.
pub(crate) fn record_bytes(kind: QuantKind) -> usize {
    match kind {
        QuantKind::Q4K => Q4K_M + SUBS * TILE,
        QuantKind::Q5K => Q5K_HI + SUBS * 64,
        QuantKind::Q6K => Q6K_SC + 2 * SUBS * TILE,
        _ => unreachable!("not a K-quant: {kind:?}"),
    }
}

/// Where the high 2 bits of Q6_K element `e` (of a sub-block) of lane `l`
/// sit in the sub-block's 128 high-bit bytes: (byte, shift).
#[inline]
pub(crate) fn q6_high_at(l: usize, e: usize) -> (usize, u32) {
    let (s, k) = (e / 4, e % 4);
    (64 * (s / 4) + 4 * l + k, 2 * (s % 4) as u32)
}

/// One raw super-block, decoded: codes in element order (Q4_K 0..=15,
/// Q5_K 0..=31, Q6_K 0..=63), `d` and `dmin` as f16 bits, sub-block scales (Q4_K: 8
/// unsigned 6-bit; Q6_K: 16 signed, as bits) and Q4_K minimums.
struct Super {
    codes: [u8; QK_K],
    d: u16,
    dmin: u16,
    sc: [u8; 16],
    m: [u8; SUBS],
}

/// Decode raw block `b` of `kind` (ggml's `block_q4_K`, `block_q5_K`,
/// `block_q6_K`).
fn decode(kind: QuantKind, b: &[u8], s: &mut Super) {
    match kind {
        QuantKind::Q4K | QuantKind::Q5K => {
            s.d = f16_bits_at(b, 0);
            s.dmin = f16_bits_at(b, 2);
            let q = &b[4..16];
            for j in 0..SUBS {
                let (sc, m) = if j < 4 {
                    (q[j] & 63, q[j + 4] & 63)
                } else {
                    (
                        (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
                        (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
                    )
                };
                s.sc[j] = sc;
                s.m[j] = m;
            }
            // Q5_K: 32 bytes of fifth bits before the nibbles; element
            // 64j + l takes bit 2j of byte l (bit 2j + 1 for l >= 32).
            let (qh, qs) = if kind == QuantKind::Q5K {
                (&b[16..48], &b[48..176])
            } else {
                (&b[16..16], &b[16..144])
            };
            for (e, c) in s.codes.iter_mut().enumerate() {
                let (j, l) = (e / 64, e % 64);
                *c = if l < 32 {
                    qs[32 * j + l] & 15
                } else {
                    qs[32 * j + l - 32] >> 4
                };
                if kind == QuantKind::Q5K {
                    let bit = 2 * j + usize::from(l >= 32);
                    *c |= ((qh[l % 32] >> bit) & 1) << 4;
                }
            }
        }
        QuantKind::Q6K => {
            let (ql, qh) = (&b[..128], &b[128..192]);
            s.sc.copy_from_slice(&b[192..208]);
            s.d = f16_bits_at(b, 208);
            s.dmin = 0;
            for (e, c) in s.codes.iter_mut().enumerate() {
                let (n, g, l) = (e / 128, (e % 128) / 32, e % 32);
                let lo = (ql[64 * n + l + 32 * (g % 2)] >> (4 * (g / 2))) & 15;
                let hi = (qh[32 * n + l] >> (2 * g)) & 3;
                *c = lo | (hi << 4);
            }
        }
        _ => unreachable!("not a K-quant: {kind:?}"),
    }
}

/// Repack raw ggml K-quant blocks (`rows x cols`, `cols` a multiple of 256,
/// `raw` of the right length: the caller checks both).
pub(crate) fn build(kind: QuantKind, rows: usize, cols: usize, raw: &[u8]) -> QuantWeights {
    let nsb = cols / QK_K;
    let rec = record_bytes(kind);
    let bsize = kind.ggml_block_bytes();
    let mut qs = huge_page_vec(rows.div_ceil(TILE) * nsb * rec);
    let mut s = Super {
        codes: [0; QK_K],
        d: 0,
        dmin: 0,
        sc: [0; 16],
        m: [0; SUBS],
    };
    for r in 0..rows {
        let l = r % TILE;
        for sb in 0..nsb {
            let gb = r * nsb + sb;
            decode(kind, &raw[gb * bsize..(gb + 1) * bsize], &mut s);
            let o = ((r / TILE) * nsb + sb) * rec;
            let dst = &mut qs[o..o + rec];
            for (e, &c) in s.codes.iter().enumerate() {
                let (j, ee) = (e / QK, e % QK);
                let (i, hi) = tile_code_at(QuantKind::Q4_0, l, ee);
                dst[256 * j + i] |= (c & 15) << if hi { 4 } else { 0 };
                if kind == QuantKind::Q6K {
                    let (hb, sh) = q6_high_at(l, ee);
                    dst[Q6K_HI + 128 * j + hb] |= (c >> 4) << sh;
                }
                if kind == QuantKind::Q5K {
                    let (hb, bit) = q5_high_at(l, ee);
                    dst[Q5K_HI + 64 * j + hb] |= ((c >> 4) & 1) << bit;
                }
            }
            match kind {
                QuantKind::Q4K | QuantKind::Q5K => {
                    dst[Q4K_D + 2 * l..Q4K_D + 2 * l + 2].copy_from_slice(&s.d.to_le_bytes());
                    dst[Q4K_DMIN + 2 * l..Q4K_DMIN + 2 * l + 2]
                        .copy_from_slice(&s.dmin.to_le_bytes());
                    for j in 0..SUBS {
                        dst[Q4K_SC + TILE * j + l] = s.sc[j];
                        dst[Q4K_M + TILE * j + l] = s.m[j];
                    }
                }
                _ => {
                    dst[Q6K_D + 2 * l..Q6K_D + 2 * l + 2].copy_from_slice(&s.d.to_le_bytes());
                    for (g, &v) in s.sc.iter().enumerate() {
                        dst[Q6K_SC + TILE * g + l] = v;
                    }
                }
            }
        }
    }
    QuantWeights {
        kind,
        rows,
        nb: cols / QK,
        qs,
    }
}

/// The codes of sub-block `j` of a record, unpacked to 8 steps of 64
/// bytes (lane l's 4 bytes are 4 elements of row l), Q5_K and Q6_K with
/// their high bits: what every path multiplies.
#[inline]
fn unpack_steps(kind: QuantKind, rec: &[u8], j: usize, steps: &mut [[u8; 64]; 8]) {
    let lo = &rec[256 * j..256 * j + 256];
    for u in 0..4 {
        let (a, b) = steps[2 * u..2 * u + 2].split_at_mut(1);
        for (i, &v) in lo[64 * u..64 * u + 64].iter().enumerate() {
            a[0][i] = v & 15;
            b[0][i] = v >> 4;
        }
    }
    if kind == QuantKind::Q5K {
        let plane = &rec[Q5K_HI + 64 * j..Q5K_HI + 64 * j + 64];
        for (s, step) in steps.iter_mut().enumerate() {
            for (v, &h) in step.iter_mut().zip(plane) {
                *v |= ((h >> s) & 1) << 4;
            }
        }
    }
    if kind == QuantKind::Q6K {
        let hi = &rec[Q6K_HI + 128 * j..Q6K_HI + 128 * j + 128];
        for (s, step) in steps.iter_mut().enumerate() {
            let (c, k) = (s / 4, s % 4);
            for (i, v) in step.iter_mut().enumerate() {
                *v |= ((hi[64 * c + i] >> (2 * k)) & 3) << 4;
            }
        }
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(f16_bits_at(b, i)).to_f32()
}

/// Dequantize row `r` of K-quant weights into `out` (ggml's arithmetic:
/// Q4_K and Q5_K `(d * sc) * q - dmin * m`, Q6_K `(d * sc) * (q - 32)`).
pub(crate) fn dequantize_row(w: &QuantWeights, r: usize, out: &mut [f32]) {
    let (kind, l) = (w.kind, r % TILE);
    let rec = record_bytes(kind);
    let nsb = w.nb / SUBS;
    let mut steps = [[0u8; 64]; 8];
    for sb in 0..nsb {
        let o = ((r / TILE) * nsb + sb) * rec;
        let rb = &w.qs[o..o + rec];
        for j in 0..SUBS {
            unpack_steps(kind, rb, j, &mut steps);
            for e in 0..QK {
                let q = steps[e / 4][4 * l + e % 4];
                let y = &mut out[sb * QK_K + j * QK + e];
                *y = match kind {
                    QuantKind::Q4K | QuantKind::Q5K => {
                        let d1 = f16_at(rb, Q4K_D + 2 * l) * rb[Q4K_SC + TILE * j + l] as f32;
                        let m1 = f16_at(rb, Q4K_DMIN + 2 * l) * rb[Q4K_M + TILE * j + l] as f32;
                        d1 * q as f32 - m1
                    }
                    _ => {
                        let sc = rb[Q6K_SC + TILE * (2 * j + e / 16) + l] as i8;
                        f16_at(rb, Q6K_D + 2 * l) * sc as f32 * (q as i32 - 32) as f32
                    }
                };
            }
        }
    }
}

/// Most activation rows one portable pass over a tile serves.
const PORTABLE_MAX_ROWS: usize = 4;

/// The portable K-quant kernel (the sequence in the module comment), rows
/// `r0..r1` against every activation row, activation-row-major.
pub(crate) fn rows_portable(
    w: &QuantWeights,
    x: &PlainActs<'_>,
    r0: usize,
    r1: usize,
    out: &mut [f32],
) {
    let (kind, nb) = (w.kind, w.nb);
    let rec = record_bytes(kind);
    let nsb = nb / SUBS;
    drive_tiles(w, x, r0, r1, out, PORTABLE_MAX_ROWS, |t, i0, rr, put| {
        let mut acc = [[0f32; TILE]; PORTABLE_MAX_ROWS];
        let mut steps = [[0u8; 64]; 8];
        for sb in 0..nsb {
            let o = (t * nsb + sb) * rec;
            let rb = &w.qs[o..o + rec];
            let q4 = kind != QuantKind::Q6K;
            let dofs = if q4 { Q4K_D } else { Q6K_D };
            let d: [f32; TILE] = core::array::from_fn(|l| f16_at(rb, dofs + 2 * l));
            let dmin: [f32; TILE] = core::array::from_fn(|l| {
                if q4 {
                    f16_at(rb, Q4K_DMIN + 2 * l)
                } else {
                    0.0
                }
            });
            for j in 0..SUBS {
                unpack_steps(kind, rb, j, &mut steps);
                let b = sb * SUBS + j;
                for (jr, acc) in acc.iter_mut().enumerate().take(rr) {
                    let xb = (i0 + jr) * nb + b;
                    let xs = &x.qs[xb * QK..(xb + 1) * QK];
                    let dx = x.qd[xb];
                    // Integer dot products of the two halves of the block.
                    let (h0, h1) = if kind == QuantKind::Q6K {
                        let hx = x.hsum[xb];
                        (-32 * hx, -32 * (x.isum[xb] - hx))
                    } else {
                        (0, 0)
                    };
                    let mut ip = [[h0; TILE], [h1; TILE]];
                    for (s, step) in steps.iter().enumerate() {
                        let xq: &[i8; 4] = xs[4 * s..4 * s + 4].try_into().expect("4 bytes");
                        let half = &mut ip[s / 4];
                        for l in 0..TILE {
                            let q: &[u8; 4] = step[4 * l..4 * l + 4].try_into().expect("4 bytes");
                            half[l] += (q[0] as i32 * xq[0] as i32 + q[1] as i32 * xq[1] as i32)
                                + (q[2] as i32 * xq[2] as i32 + q[3] as i32 * xq[3] as i32);
                        }
                    }
                    for l in 0..TILE {
                        if q4 {
                            let sc = rb[Q4K_SC + TILE * j + l] as f32;
                            let m = rb[Q4K_M + TILE * j + l] as f32;
                            let ipl = (ip[0][l] + ip[1][l]) as f32;
                            acc[l] = (sc * ipl).mul_add(d[l] * dx, acc[l]);
                            acc[l] = (m * x.isum[xb] as f32).mul_add(-(dmin[l] * dx), acc[l]);
                        } else {
                            let slo = rb[Q6K_SC + TILE * (2 * j) + l] as i8 as f32;
                            let shi = rb[Q6K_SC + TILE * (2 * j + 1) + l] as i8 as f32;
                            let isc = shi.mul_add(ip[1][l] as f32, slo * ip[0][l] as f32);
                            acc[l] = isc.mul_add(d[l] * dx, acc[l]);
                        }
                    }
                }
            }
        }
        put(&acc[..rr]);
    });
}
