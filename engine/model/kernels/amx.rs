//! Intel AMX (`TDPBSUD`) kernel on the row-tile layout, for products of
//! a dozen activation rows or more (prefill, verifies of 12+ tokens:
//! `MIN_ROWS`). Fewer rows stay on VNNI, where unpacking the codes costs
//! about what VNNI's whole product does.
//!
//! The row-tile layout is already AMX's "VNNI" B-operand layout: a 64-byte
//! step holds 4 consecutive elements of each of 16 weight rows, so the 8
//! steps of a 32-element block are the 8 rows of a B tile (K = 32, N = 16
//! weight rows). Per (weight tile, block) the block's codes are unpacked to
//! unsigned bytes (Q8_0's stored `q + 128` are used as they are), up to 16
//! activation rows' 32 signed codes form the A tile, and one `TDPBSUD`
//! gives every (activation row, weight row) block dot product as an exact
//! int32 — the same integer the VNNI chain ends with. The offset correction
//! is added in integers and the float epilogue is the VNNI kernel's, per
//! lane and in the same order, so every row gets the same bits as on every
//! other path whatever the number of rows (the kernels' batch invariance).
//! Four weight tiles share each A tile (`rows16_wide`); Q6_K's two
//! 16-element halves are two products with K = 16, one weight tile at a
//! time (`tile_q6k`).
//!
//! Linux grants the tile state to a process only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); `available`
//! asks once and falls back to VNNI if it is refused. `SPECD_NO_AMX=1`
//! turns the path off. The tile instructions are written as inline
//! assembly (Rust's AMX intrinsics are not stable); a thread's tiles are
//! configured on its first call (again only when the row count changes)
//! and kept.

#![cfg(target_arch = "x86_64")]

use std::arch::asm;
use std::arch::x86_64::*;

use super::kquant::{Q4K_D, Q4K_DMIN, Q4K_M, Q4K_SC, Q5K_HI, Q6K_D, Q6K_HI, Q6K_SC, SUBS};
use super::layout::{
    check_tiles, drive_tiles, tile_record_bytes, PlainActs, QuantKind, QuantWeights, Q5_HIGH, QK,
    TILE,
};
use super::simd::vnni::with_fifth_bits;
use super::simd_k::with_q6_high_bits;

/// Most activation rows one tile product serves (an A tile's rows).
pub const MAX_ROWS: usize = 16;

/// Fewest activation rows a product goes to this kernel with (callers
/// route fewer to VNNI). Measured single-threaded per call (in-process,
/// the matmul bench's shapes), Q4_1 576x1536 against VNNI: 1 row 38 us
/// (12), 4 rows 46 (36), 8 rows 60 (58), 12 rows 74 (92), 16 rows 88
/// (116), 32 rows 182 (237). Unpacking the codes into B tiles costs about
/// what VNNI's whole one-row product does, so below about 10 rows VNNI
/// wins.
pub const MIN_ROWS: usize = 12;

/// How far ahead (bytes) the kernel prefetches the record stream.
const PREFETCH: usize = 8192;

/// Whether the AMX path runs here: AVX-512 VNNI is on (the epilogue and
/// the unpacking use it), `SPECD_NO_AMX` is unset, the CPU reports
/// AMX-TILE and AMX-INT8, and the OS granted the tile state (asked once
/// per process).
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        super::simd::vnni::available()
            && std::env::var_os("SPECD_NO_AMX").is_none()
            && cpu_has_amx_int8()
            && request_tile_permission()
            && self_check()
    })
}

/// Whether AMX beats VNNI here, where both run: `SPECD_AMX=1` says yes
/// without measuring; otherwise, once per process, one 576x1536 Q4_1
/// product of 64 activation rows (a prefill's shape, SmolLM2's FFN down
/// projection) is timed on one thread both ways, alternately, five times
/// each, and AMX must take under 90% of VNNI's median time. The tile unit
/// is shared and its speed varies with the machine and its load (measured
/// on the same Xeon model: 0.7x VNNI's prefill on one day, 1.2-1.5x on
/// another), so a constant cannot decide it. Both paths give the same
/// bits, so the choice changes speed only. `calibration` reports the
/// timings.
pub fn pays() -> bool {
    calibration()
        .map(|c| c.amx_us < 0.9 * c.vnni_us)
        .unwrap_or(true)
}

/// `pays`'s measurement: median microseconds of one product each way
/// (`None` where `SPECD_AMX=1` skipped it or AMX is unavailable).
#[derive(Debug, Clone, Copy)]
pub struct Calibration {
    pub amx_us: f64,
    pub vnni_us: f64,
}

/// The measurement `pays` decides on (run on first use).
pub fn calibration() -> Option<Calibration> {
    static CAL: std::sync::OnceLock<Option<Calibration>> = std::sync::OnceLock::new();
    *CAL.get_or_init(|| {
        if !available() || std::env::var_os("SPECD_AMX").is_some_and(|v| v == "1") {
            return None;
        }
        Some(measure())
    })
}

fn measure() -> Calibration {
    use super::activations::Activations;
    use super::layout::{QMatrix, WeightData, WeightFormat};
    use super::path::KernelPath;
    let (rows, cols, n) = (1536usize, 576usize, 64usize);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    // Q4_1 blocks: f16 scale 1/64, f16 minimum -1/8, 16 code bytes.
    let mut raw = Vec::with_capacity(rows * cols / QK * 20);
    for _ in 0..rows * cols / QK {
        raw.extend_from_slice(&0x2400u16.to_le_bytes());
        raw.extend_from_slice(&0xb000u16.to_le_bytes());
        raw.extend((0..16).map(|_| next() as u8));
    }
    let qm = QMatrix::from_ggml_blocks(WeightFormat::Q4_1, rows, cols, &raw)
        .expect("a well-formed Q4_1 matrix");
    let WeightData::Quant(q) = &qm.data else {
        unreachable!("Q4_1 is quantized")
    };
    let x: Vec<f32> = (0..n * cols)
        .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let mut a = Activations::new(KernelPath::Amx);
    a.prepare(&x, n, cols, true);
    let plain = a.plain();
    let mut out = vec![0f32; n * rows];
    let mut time = |amx: bool| {
        let t = std::time::Instant::now();
        if amx {
            rows16(q, &plain, 0, rows, &mut out);
        } else {
            super::simd::vnni::rows16(q, &plain, 0, rows, &mut out);
        }
        t.elapsed().as_secs_f64() * 1e6
    };
    // One untimed call each warms the caches and the tile configuration.
    time(true);
    time(false);
    let (mut am, mut vn) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        am.push(time(true));
        vn.push(time(false));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Calibration {
        amx_us: median(&mut am),
        vnni_us: median(&mut vn),
    }
}

/// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25).
fn cpu_has_amx_int8() -> bool {
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

/// Ask Linux for the AMX tile data state for this process (every thread,
/// present and future). Other systems: no AMX.
fn request_tile_permission() -> bool {
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) only changes which
        // extended states this process may use; it touches no memory of ours.
        let r = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        r == 0
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// One tile product against a scalar reference, so a CPU or hypervisor
/// that reports AMX but computes it wrongly never reaches the model.
fn self_check() -> bool {
    let mut a = [0i8; 2 * QK];
    let mut b = Aligned([0u8; 512]);
    for (i, v) in a.iter_mut().enumerate() {
        *v = (i as i32 * 37 % 255 - 127) as i8;
    }
    for (i, v) in b.0.iter_mut().enumerate() {
        *v = (i * 91 % 256) as u8;
    }
    let mut c = Aligned([0i32; 2 * TILE]);
    let cfg = TileConfig::new(2, false);
    // SAFETY: `available` established the CPU features and the OS
    // permission before calling this; the config describes A as 2 x 32
    // bytes (`a`), B as 8 x 64 (`b`) and C as 2 x 64 (`c`), which those
    // buffers hold at the strides given.
    unsafe {
        cfg.load();
        asm!(
            "tilezero tmm4",
            "tileloadd tmm0, [{a} + {sa}*1]",
            "tileloadd tmm2, [{b} + {sb}*1]",
            "tdpbsud tmm4, tmm0, tmm2",
            "tilestored [{c} + {sc}*1], tmm4",
            a = in(reg) a.as_ptr(),
            sa = in(reg) QK,
            b = in(reg) b.0.as_ptr(),
            sb = in(reg) 64usize,
            c = in(reg) c.0.as_mut_ptr(),
            sc = in(reg) 64usize,
            options(nostack),
        );
        release();
    }
    (0..2).all(|m| {
        (0..TILE).all(|n| {
            let want: i32 = (0..QK)
                .map(|k| a[m * QK + k] as i32 * b.0[(k / 4) * 64 + 4 * n + k % 4] as i32)
                .sum();
            c.0[m * TILE + n] == want
        })
    })
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Aligned<T>(T);

/// A palette-1 tile configuration (64 bytes, as `LDTILECFG` reads it):
/// tmm0/tmm1 A tiles (rows x 32 bytes; Q6_K: x 16), tmm2/tmm3 B tiles
/// (8 x 64; Q6_K: 4 x 64), tmm4-tmm7 C tiles (rows x 16 int32).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new(rows: usize, halves: bool) -> Self {
        debug_assert!((1..=MAX_ROWS).contains(&rows));
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut set = |i: usize, r: usize, colsb: usize| {
            c[16 + 2 * i..18 + 2 * i].copy_from_slice(&(colsb as u16).to_le_bytes());
            c[48 + i] = r as u8;
        };
        let (ka, kb) = if halves { (16, 4) } else { (32, 8) };
        set(0, rows, ka);
        set(1, rows, ka);
        set(2, kb, 64);
        set(3, kb, 64);
        for i in 4..8 {
            set(i, rows, 64);
        }
        Self(c)
    }

    /// Load this configuration into the calling thread's tile state.
    ///
    /// # Safety
    /// `available()` holds (AMX present and permitted).
    unsafe fn load(&self) {
        // SAFETY: the caller's guarantee; `self` is a 64-byte palette-1
        // configuration whose every tile fits the palette's limits.
        unsafe { asm!("ldtilecfg [{}]", in(reg) self.0.as_ptr(), options(nostack, readonly)) };
    }
}

/// Release this thread's tile state.
///
/// # Safety
/// `available()` holds.
unsafe fn release() {
    // SAFETY: the caller's guarantee; `tilerelease` only returns the tile
    // state to its initial (unconfigured) state.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Const-generic stand-ins for `QuantKind` in the kernel.
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;
const Q5_0: u8 = 3;
const Q5_1: u8 = 4;
const Q4K: u8 = 5;
const Q5K: u8 = 6;
const Q6K: u8 = 7;

/// Rows `r0..r1` of `w` (row tiles, any quantized kind) against every
/// activation row, written activation-row-major: `out[i * (r1 - r0) + (r -
/// r0)]`. Up to 16 activation rows share each tile product.
pub fn rows16(w: &QuantWeights, x: &PlainActs<'_>, r0: usize, r1: usize, out: &mut [f32]) {
    assert!(available());
    if w.kind != QuantKind::Q6K {
        return rows16_wide(w, x, r0, r1, out);
    }
    // Q6_K: two half-block products per block, one weight tile at a time.
    let mut scratch = Scratch::new(w.nb);
    drive_tiles(w, x, r0, r1, out, MAX_ROWS, |t, i0, rr, put| {
        configure(rr, true);
        // A tile's B operands are unpacked once, for all its row chunks.
        let fresh = scratch.tile != Some(t);
        scratch.tile = Some(t);
        // SAFETY: AMX and AVX-512 VNNI are available and this thread's
        // tiles are configured for `rr` rows (above); `drive_tiles` checked
        // that tile t and activation rows i0..i0 + rr exist.
        unsafe { tile_q6k(w, x, t, i0, rr, put, &mut scratch, fresh) }
    });
}

/// `rows16` for every kind but Q6_K: weight tiles in groups of `WIDE`
/// (unpacked once per group), each group against every balanced chunk of
/// at most 16 activation rows.
fn rows16_wide(w: &QuantWeights, x: &PlainActs<'_>, r0: usize, r1: usize, out: &mut [f32]) {
    check_tiles(w, x, r0, r1, out);
    let (n, nb) = (x.n, w.nb);
    // This thread's buffers, reused across calls: allocating and zeroing
    // them per call cost as much as the products at a few rows.
    thread_local! {
        static BUFFERS: std::cell::RefCell<Option<Box<WideBuffers>>> =
            const { std::cell::RefCell::new(None) };
    }
    let mut bufs = BUFFERS.with(|b| b.borrow_mut().take()).unwrap_or_else(|| {
        Box::new(WideBuffers {
            bt: Vec::new(),
            ct: [Aligned([[[0; TILE]; MAX_ROWS]; GROUP]); 2],
            res: [[[0.0; TILE]; MAX_ROWS]; WIDE],
        })
    });
    // One row chunk: each block's codes are unpacked just before their
    // products into a ring that stays in L1; several chunks: a group's
    // codes are unpacked once for all of them.
    let jit = n <= MAX_ROWS;
    let need = match (w.kind, jit) {
        (QuantKind::Q8_0, _) => 0,
        (_, true) => 2 * WIDE,
        (_, false) => WIDE * nb,
    };
    if bufs.bt.len() < need {
        bufs.bt.resize(need, Aligned([0; 512]));
    }
    // SAFETY: `available()` holds (asserted by the caller); `check_tiles`
    // checked `w`, `x`, the rows and `out`; `bufs.bt` holds what `jit`
    // needs.
    unsafe {
        match w.kind {
            QuantKind::Q4_0 => groups::<Q4_0>(w, x, r0, r1, out, jit, &mut bufs),
            QuantKind::Q4_1 => groups::<Q4_1>(w, x, r0, r1, out, jit, &mut bufs),
            QuantKind::Q5_0 => groups::<Q5_0>(w, x, r0, r1, out, jit, &mut bufs),
            QuantKind::Q5_1 => groups::<Q5_1>(w, x, r0, r1, out, jit, &mut bufs),
            QuantKind::Q8_0 => groups::<Q8_0>(w, x, r0, r1, out, jit, &mut bufs),
            QuantKind::Q4K => groups::<Q4K>(w, x, r0, r1, out, jit, &mut bufs),
            QuantKind::Q5K => groups::<Q5K>(w, x, r0, r1, out, jit, &mut bufs),
            QuantKind::Q6K => unreachable!("Q6_K runs per tile"),
        }
    }
    BUFFERS.with(|b| *b.borrow_mut() = Some(bufs));
}

/// `rows16_wide` for kind `K`: weight tiles in groups of `WIDE`, each
/// group against every balanced chunk of at most 16 activation rows.
///
/// # Safety
/// `available()` holds; `K` is `w.kind` and not Q6_K; `w`, `x`, `r0..r1`
/// and `out` passed `check_tiles`; `bufs.bt` holds `2 * WIDE` tiles if
/// `jit` (one chunk), else `WIDE * w.nb` (Q8_0: none).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn groups<const K: u8>(
    w: &QuantWeights,
    x: &PlainActs<'_>,
    r0: usize,
    r1: usize,
    out: &mut [f32],
    jit: bool,
    bufs: &mut WideBuffers,
) {
    let WideBuffers { bt, ct, res } = bufs;
    let (n, nb, nr) = (x.n, w.nb, r1 - r0);
    let per = n.div_ceil(n.div_ceil(MAX_ROWS).max(1));
    let t_end = r1.div_ceil(TILE);
    let mut t0 = r0 / TILE;
    while t0 < t_end {
        let nt = (t_end - t0).min(WIDE);
        if K != Q8_0 && !jit {
            for j in 0..nt {
                // SAFETY: tile t0 + j exists; the slice holds nb tiles.
                unsafe { unpack_tile::<K>(w, t0 + j, &mut bt[j * nb..(j + 1) * nb]) };
            }
        }
        let mut i0 = 0;
        while i0 < n {
            let rr = (n - i0).min(per);
            configure(rr, false);
            // SAFETY: AMX and AVX-512 VNNI are available, tiles configured
            // for rr rows (above); tiles t0..t0 + nt and rows i0..i0 + rr
            // exist; `bt` holds the group unpacked, or room for the ring.
            unsafe { wide::<K>(w, x, t0, nt, i0, rr, bt, jit, ct, res) };
            for j in 0..nt {
                let t = t0 + j;
                let live = (r1 - t * TILE).min(TILE);
                for r in 0..rr {
                    let o = (i0 + r) * nr + t * TILE - r0;
                    out[o..o + live].copy_from_slice(&res[j][r][..live]);
                }
            }
            i0 += rr;
        }
        t0 += nt;
    }
}

/// `rows16_wide`'s per-thread buffers; every element is written before it
/// is read.
struct WideBuffers {
    bt: Vec<Aligned<[u8; 512]>>,
    ct: [Aligned<[[[i32; TILE]; MAX_ROWS]; GROUP]>; 2],
    res: [[[f32; TILE]; MAX_ROWS]; WIDE],
}

/// Configure this thread's tiles for `rows` activation rows (Q6_K: half
/// blocks), unless they already are. The configuration is kept between
/// calls: loading it (and releasing the tiles) costs about as much as a
/// small tile product, and a forward makes thousands of calls. Nothing
/// else on a thread uses the tiles.
fn configure(rows: usize, halves: bool) {
    CONFIGURED.with(|c| {
        if c.get() != (rows, halves) {
            assert!(available() && (1..=MAX_ROWS).contains(&rows));
            // SAFETY: `available()` holds (asserted).
            unsafe { TileConfig::new(rows, halves).load() };
            c.set((rows, halves));
        }
    });
}

thread_local! {
    /// The (rows, halves) this thread's tiles are configured for; (0, _)
    /// when unknown (never configured, or another tile user ran since).
    static CONFIGURED: std::cell::Cell<(usize, bool)> = const { std::cell::Cell::new((0, false)) };
}

/// Tell `configure` that this thread's tile configuration was replaced
/// (the bf16 GEMM loads its own), so its next call loads it again.
pub(super) fn forget_config() {
    CONFIGURED.with(|c| c.set((0, false)));
}

/// Whether the bf16 tile products (`TDPBF16PS`) run here: `available()`
/// (so the tile state was granted, and `SPECD_NO_AMX` is unset) and the
/// CPU reports AMX-BF16 (CPUID leaf 7, EDX bit 22).
pub fn bf16_available() -> bool {
    available() && __cpuid_count(7, 0).edx & (1 << 22) != 0
}

/// C tiles per group of products (tmm4-tmm7).
const GROUP: usize = 4;

/// Four tile products in one sequence. Product `p` multiplies A from
/// `a[p]` (row stride `sa`) by B from `b[p]` (stride 64) into C tile
/// `4 + p`, stored to `c + p` (stride 64). C tiles are zeroed first, each
/// product's A and B go to alternating registers (tmm0/tmm2, tmm1/tmm3),
/// and the stores come after every product: a tile store waits for its
/// product, so storing each product before the next would cost a
/// product's whole latency each time instead of running them back to back.
///
/// # Safety
/// This thread's tiles are configured; for each product `p`, `a[p]`,
/// `b[p]` and `c + p` hold the tiles the configuration describes at those
/// strides.
#[inline(always)]
unsafe fn products(
    a: &[*const i8; GROUP],
    b: &[*const u8; GROUP],
    c: *mut [[i32; TILE]; MAX_ROWS],
    sa: usize,
) {
    let c = c as *mut u8;
    // SAFETY: the caller's guarantee.
    unsafe {
        asm!(
            "tilezero tmm4",
            "tilezero tmm5",
            "tilezero tmm6",
            "tilezero tmm7",
            "tileloadd tmm0, [{a0} + {sa}*1]",
            "tileloadd tmm2, [{b0} + {s64}*1]",
            "tdpbsud tmm4, tmm0, tmm2",
            "tileloadd tmm1, [{a1} + {sa}*1]",
            "tileloadd tmm3, [{b1} + {s64}*1]",
            "tdpbsud tmm5, tmm1, tmm3",
            "tileloadd tmm0, [{a2} + {sa}*1]",
            "tileloadd tmm2, [{b2} + {s64}*1]",
            "tdpbsud tmm6, tmm0, tmm2",
            "tileloadd tmm1, [{a3} + {sa}*1]",
            "tileloadd tmm3, [{b3} + {s64}*1]",
            "tdpbsud tmm7, tmm1, tmm3",
            "tilestored [{c} + {s64}*1], tmm4",
            "tilestored [{c} + {s64}*1 + 1024], tmm5",
            "tilestored [{c} + {s64}*1 + 2048], tmm6",
            "tilestored [{c} + {s64}*1 + 3072], tmm7",
            a0 = in(reg) a[0], b0 = in(reg) b[0],
            a1 = in(reg) a[1], b1 = in(reg) b[1],
            a2 = in(reg) a[2], b2 = in(reg) b[2],
            a3 = in(reg) a[3], b3 = in(reg) b[3], c = in(reg) c,
            sa = in(reg) sa, s64 = in(reg) 64usize,
            options(nostack),
        );
    }
}

/// Unpack a 32-element block (or K-quant sub-block) whose packed code
/// bytes start at `lo` into 8 steps of 64 unsigned codes in `dst` (the B
/// tile): low and high nibbles, plus Q5's fifth bits from `plane` or
/// Q6_K's high bits from `hi6`.
///
/// # Safety
/// AVX-512F/BW are available; `lo` has 256 readable bytes, `plane` 64
/// (Q5 kinds), `hi6` 128 (Q6_K).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack<const K: u8>(
    lo: *const u8,
    plane: *const u8,
    hi6: *const u8,
    dst: &mut [u8; 512],
) {
    let mask4 = _mm512_set1_epi8(0x0f);
    let five = matches!(K, Q5_0 | Q5_1 | Q5K);
    let pl = if five {
        // SAFETY: the caller's guarantee: 64 readable bytes at `plane`.
        unsafe { _mm512_loadu_si512(plane.cast()) }
    } else {
        _mm512_setzero_si512()
    };
    let hr = if K == Q6K {
        // SAFETY: the caller's guarantee: 128 readable bytes at `hi6`.
        unsafe {
            [
                _mm512_loadu_si512(hi6.cast()),
                _mm512_loadu_si512(hi6.add(64).cast()),
            ]
        }
    } else {
        [_mm512_setzero_si512(); 2]
    };
    for u in 0..4 {
        // SAFETY: packed steps 2u, 2u + 1 are 64 of the block's 256 bytes.
        let raw = unsafe { _mm512_loadu_si512(lo.add(64 * u).cast()) };
        let mut we = _mm512_and_si512(raw, mask4);
        let mut wo = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask4);
        if five {
            we = with_fifth_bits(we, pl, 2 * u);
            wo = with_fifth_bits(wo, pl, 2 * u + 1);
        }
        if K == Q6K {
            (we, wo) = with_q6_high_bits(we, wo, &hr, u);
        }
        // SAFETY: steps 2u and 2u + 1 are bytes 128u..128u + 128 of `dst`.
        unsafe {
            _mm512_storeu_si512(dst.as_mut_ptr().add(128 * u).cast(), we);
            _mm512_storeu_si512(dst.as_mut_ptr().add(128 * u + 64).cast(), wo);
        }
    }
}

/// Per-call buffers of `tile_q6k`: every unpacked B tile of the current
/// weight tile, and two groups of stored C tiles. Every byte is written
/// before it is read.
struct Scratch {
    tile: Option<usize>,
    bt: Vec<Aligned<[u8; 512]>>,
    ct: [Aligned<[[[i32; TILE]; MAX_ROWS]; GROUP]>; 2],
}

impl Scratch {
    fn new(nb: usize) -> Box<Self> {
        Box::new(Self {
            tile: None,
            bt: vec![Aligned([0; 512]); nb],
            ct: [Aligned([[[0; TILE]; MAX_ROWS]; GROUP]); 2],
        })
    }
}

/// The 16 rows of Q6_K tile `t` against activation rows `i0..i0 + rr`,
/// handed to `put`: per sub-block, the exact int32 dot products of its two
/// 16-element halves from two tile products, then per activation row the
/// VNNI kernel's epilogue. When `fresh`, the tile's sub-blocks are first
/// unpacked into `scratch`; later row chunks of the same tile reuse them.
/// Products go in groups of two sub-blocks (four products), and a group's
/// epilogue runs after the next group's products are issued.
///
/// # Safety
/// AMX (configured for `rr` rows and half blocks) and AVX-512 VNNI/F16C
/// are available; `w` is Q6_K; tile `t` and activation rows `i0..i0 + rr`
/// exist (as `drive_tiles` checks); `1 <= rr <= MAX_ROWS`; `scratch` was
/// made for `w.nb` blocks, and if not `fresh` holds tile `t` unpacked.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_q6k(
    w: &QuantWeights,
    x: &PlainActs<'_>,
    t: usize,
    i0: usize,
    rr: usize,
    put: &mut dyn FnMut(&[[f32; TILE]]),
    scratch: &mut Scratch,
    fresh: bool,
) {
    let nb = w.nb;
    let rec = tile_record_bytes(w.kind);
    assert!(w.kind == QuantKind::Q6K && nb.is_multiple_of(SUBS) && scratch.bt.len() >= nb);
    let base = w.qs.as_ptr().wrapping_add(t * (nb / SUBS) * rec);
    // Activation row stride in bytes, and row i0's first code.
    let sa = nb * QK;
    let xa = x.qs.as_ptr().wrapping_add(i0 * sa);
    // Two sub-blocks (four half products) per group; nb is a multiple of 8.
    let ng = nb / 2;
    if fresh {
        // SAFETY: tile t exists (the caller's guarantee) and `scratch`
        // holds `nb` blocks.
        unsafe { unpack_tile::<Q6K>(w, t, &mut scratch.bt[..nb]) };
    }
    let mut acc = [_mm512_setzero_ps(); MAX_ROWS];
    for it in 0..ng + 1 {
        if it < ng {
            let g = it;
            let mut pa = [core::ptr::null::<i8>(); GROUP];
            let mut pb = [core::ptr::null::<u8>(); GROUP];
            for k in 0..2 {
                let b = 2 * g + k;
                let a = xa.wrapping_add(b * QK);
                let bp = scratch.bt[b].0.as_ptr();
                (pa[2 * k], pb[2 * k]) = (a, bp);
                (pa[2 * k + 1], pb[2 * k + 1]) = (a.wrapping_add(16), bp.wrapping_add(256));
            }
            // SAFETY: the tiles are configured for rr rows and half blocks;
            // product p's A is rr rows of 16 bytes of an activation block
            // at the row stride, which exist; its B 256 unpacked bytes in
            // `scratch`; its C rr rows of 64 bytes in group slot p.
            unsafe { products(&pa, &pb, scratch.ct[g % 2].0.as_mut_ptr(), sa) };
        }
        if it >= 1 {
            let g = it - 1;
            let c = &scratch.ct[g % 2].0;
            for k in 0..2 {
                let b = 2 * g + k;
                let blk = base.wrapping_add((b / SUBS) * rec);
                // SAFETY: block b is sub-block b % 8 of record `blk`; the
                // slot holds its two half products for rr rows; activation
                // rows i0..i0 + rr exist.
                unsafe {
                    epilogue::<Q6K>(
                        blk,
                        b % SUBS,
                        0,
                        &c[2 * k],
                        &c[2 * k + 1],
                        x,
                        i0 * nb + b,
                        nb,
                        rr,
                        &mut acc,
                    )
                };
            }
        }
    }
    let mut o = [[0f32; TILE]; MAX_ROWS];
    for r in 0..rr {
        // SAFETY: `o[r]` is exactly 16 floats.
        unsafe { _mm512_storeu_ps(o[r].as_mut_ptr(), acc[r]) };
    }
    put(&o[..rr]);
}

/// One block's epilogue for rows `0..rr` of a chunk: the VNNI kernel's
/// per-lane sequence (integer offset correction, then its float
/// accumulates in its order) on the stored int32 products `c0` (Q6_K: the
/// two half blocks `c0`, `c1`) of block `xb0 - i0 * nb` (sub-block `j` of
/// record `blk`), into `acc`.
///
/// # Safety
/// AVX-512F/BW and F16C are available; `blk` is the block's record of
/// `K` (with `cb` its code bytes); activation blocks `xb0 + r * nb` exist
/// for `r < rr <= MAX_ROWS`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn epilogue<const K: u8>(
    blk: *const u8,
    j: usize,
    cb: usize,
    c0: &[[i32; TILE]; MAX_ROWS],
    c1: &[[i32; TILE]; MAX_ROWS],
    x: &PlainActs<'_>,
    xb0: usize,
    nb: usize,
    rr: usize,
    acc: &mut [__m512; MAX_ROWS],
) {
    match K {
        Q4K | Q5K => {
            // SAFETY: the record's 16 `d` and `dmin` follow its codes.
            let (dk, dmin) = unsafe {
                (
                    _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(Q4K_D).cast())),
                    _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(Q4K_DMIN).cast())),
                )
            };
            let scales = |off: usize| {
                // SAFETY: a sub-block's 16 scale bytes in the record.
                let v = unsafe { _mm_loadu_si128(blk.add(off).cast()) };
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v))
            };
            let sc = scales(Q4K_SC + TILE * j);
            let m = scales(Q4K_M + TILE * j);
            for r in 0..rr {
                let xb = xb0 + r * nb;
                let dx = _mm512_set1_ps(x.qd[xb]);
                let sx = _mm512_set1_ps(x.isum[xb] as f32);
                // SAFETY: row r of the stored C tile.
                let ci = unsafe { _mm512_load_si512(c0[r].as_ptr().cast()) };
                let ip = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(ci));
                acc[r] = _mm512_fmadd_ps(ip, _mm512_mul_ps(dk, dx), acc[r]);
                acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(m, sx), _mm512_mul_ps(dmin, dx), acc[r]);
            }
        }
        Q6K => {
            // SAFETY: the record's 16 `d` follow its codes.
            let dk = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(Q6K_D).cast())) };
            let scales = |off: usize| {
                // SAFETY: a 16-element group's 16 scale bytes.
                let v = unsafe { _mm_loadu_si128(blk.add(off).cast()) };
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))
            };
            let slo = scales(Q6K_SC + TILE * (2 * j));
            let shi = scales(Q6K_SC + TILE * (2 * j + 1));
            for r in 0..rr {
                let xb = xb0 + r * nb;
                let dx = _mm512_set1_ps(x.qd[xb]);
                let (h, s) = (x.hsum[xb], x.isum[xb]);
                // SAFETY: row r of the slot's two stored C tiles.
                let (cl, chh) = unsafe {
                    (
                        _mm512_load_si512(c0[r].as_ptr().cast()),
                        _mm512_load_si512(c1[r].as_ptr().cast()),
                    )
                };
                let ia = _mm512_add_epi32(cl, _mm512_set1_epi32(-32 * h));
                let ib = _mm512_add_epi32(chh, _mm512_set1_epi32(-32 * (s - h)));
                let isc = _mm512_fmadd_ps(
                    shi,
                    _mm512_cvtepi32_ps(ib),
                    _mm512_mul_ps(slo, _mm512_cvtepi32_ps(ia)),
                );
                acc[r] = _mm512_fmadd_ps(isc, _mm512_mul_ps(dk, dx), acc[r]);
            }
        }
        _ => {
            // SAFETY: the record's 16 scales follow its codes.
            let dw = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(cb).cast())) };
            let mw = if K == Q4_1 || K == Q5_1 {
                // SAFETY: Q4_1 and Q5_1 records end with the 16 minimums.
                unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(cb + 32).cast())) }
            } else {
                _mm512_setzero_ps()
            };
            for r in 0..rr {
                let xb = xb0 + r * nb;
                // SAFETY: row r of the stored C tile.
                let mut ip = unsafe { _mm512_load_si512(c0[r].as_ptr().cast()) };
                let s = x.isum[xb];
                let corr = match K {
                    Q4_0 => -(s << 3),
                    Q5_0 => -(s << 4),
                    Q8_0 => -(s << 7),
                    _ => 0,
                };
                ip = _mm512_add_epi32(ip, _mm512_set1_epi32(corr));
                let sc = _mm512_mul_ps(dw, _mm512_set1_ps(x.qd[xb]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ip), sc, acc[r]);
                if K == Q4_1 || K == Q5_1 {
                    acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.qsum[xb]), acc[r]);
                }
            }
        }
    }
}

/// Unpack every block of weight tile `t` into `dst` (one B tile per
/// block; Q8_0 needs none).
///
/// # Safety
/// AVX-512F/BW are available; tile `t` exists in `w`; `dst` holds `w.nb`
/// tiles.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_tile<const K: u8>(w: &QuantWeights, t: usize, dst: &mut [Aligned<[u8; 512]>]) {
    assert!(dst.len() >= w.nb);
    for (b, d) in dst[..w.nb].iter_mut().enumerate() {
        // SAFETY: the caller's guarantee; b < nb.
        unsafe { unpack_block::<K>(w, t, b, d) };
    }
}

/// Unpack block `b` of weight tile `t` into the B tile `d` (prefetching
/// the record stream ahead at each record's first block).
///
/// # Safety
/// AVX-512F/BW are available; tile `t` exists in `w`; `b < w.nb`; `K` is
/// `w.kind` and not Q8_0.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_block<const K: u8>(
    w: &QuantWeights,
    t: usize,
    b: usize,
    d: &mut Aligned<[u8; 512]>,
) {
    let nb = w.nb;
    let is_k = matches!(K, Q4K | Q5K | Q6K);
    let subs = if is_k { SUBS } else { 1 };
    let rec = tile_record_bytes(w.kind);
    assert!(b < nb && K != Q8_0);
    let base = w.qs.as_ptr().wrapping_add(t * (nb / subs) * rec);
    let (blk, j) = (base.wrapping_add((b / subs) * rec), b % subs);
    if j == 0 {
        for off in (0..rec).step_by(64) {
            // A prefetch never faults, whatever the address.
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH + off) as *const i8);
        }
    }
    if K == Q6K {
        let lo = blk.wrapping_add(256 * j);
        let hi6 = blk.wrapping_add(Q6K_HI + 128 * j);
        // SAFETY: sub-block j's 256 code bytes and 128 high-bit bytes lie
        // in the Q6_K record of tile t, which exists.
        unsafe { unpack::<K>(lo, lo, hi6, &mut d.0) };
    } else {
        let (lo, plane) = if is_k {
            (blk.wrapping_add(256 * j), blk.wrapping_add(Q5K_HI + 64 * j))
        } else {
            (blk, blk.wrapping_add(Q5_HIGH))
        };
        // SAFETY: the block's 256 packed code bytes (and Q5's 64-byte
        // plane) lie in the record of tile t, which exists.
        unsafe { unpack::<K>(lo, plane, lo, &mut d.0) };
    }
}

/// Weight tiles one pass of `wide` serves together, sharing each A tile
/// (one C tile each: tmm4-tmm7).
const WIDE: usize = GROUP;

/// One block's products for `WIDE` weight tiles: the block's A tile
/// (tmm0, or tmm1 when `odd`, so the next block's A load need not wait for
/// this block's products) against B tiles `b[j]` into C tile `4 + j`,
/// stored to `c + j` after all four are issued.
///
/// # Safety
/// This thread's tiles are configured (A tiles `rr x 32`, B `8 x 64`, C `rr
/// x 64`); `a` (row stride `sa`), every `b[j]` and `c + j` hold those tiles.
#[inline(always)]
unsafe fn products_wide(
    odd: bool,
    a: *const i8,
    sa: usize,
    b: &[*const u8; WIDE],
    c: *mut [[i32; TILE]; MAX_ROWS],
) {
    let c = c as *mut u8;
    macro_rules! wide {
        ($a:literal) => {
            asm!(
                "tilezero tmm4",
                "tilezero tmm5",
                "tilezero tmm6",
                "tilezero tmm7",
                concat!("tileloadd ", $a, ", [{a} + {sa}*1]"),
                "tileloadd tmm2, [{b0} + {s64}*1]",
                concat!("tdpbsud tmm4, ", $a, ", tmm2"),
                "tileloadd tmm3, [{b1} + {s64}*1]",
                concat!("tdpbsud tmm5, ", $a, ", tmm3"),
                "tileloadd tmm2, [{b2} + {s64}*1]",
                concat!("tdpbsud tmm6, ", $a, ", tmm2"),
                "tileloadd tmm3, [{b3} + {s64}*1]",
                concat!("tdpbsud tmm7, ", $a, ", tmm3"),
                "tilestored [{c} + {s64}*1], tmm4",
                "tilestored [{c} + {s64}*1 + 1024], tmm5",
                "tilestored [{c} + {s64}*1 + 2048], tmm6",
                "tilestored [{c} + {s64}*1 + 3072], tmm7",
                a = in(reg) a, sa = in(reg) sa,
                b0 = in(reg) b[0], b1 = in(reg) b[1], b2 = in(reg) b[2], b3 = in(reg) b[3],
                c = in(reg) c, s64 = in(reg) 64usize,
                options(nostack),
            )
        };
    }
    // SAFETY: the caller's guarantee.
    unsafe {
        if odd {
            wide!("tmm1")
        } else {
            wide!("tmm0")
        }
    }
}

/// Up to `WIDE` weight tiles `t0..t0 + nt` against activation rows
/// `i0..i0 + rr`: per block one A tile load serves every tile's product,
/// then the block's epilogues (a block behind the products). Writes the
/// rows' results per tile to `res`.
///
/// # Safety
/// AMX (configured for `rr` rows, whole blocks) and AVX-512 VNNI/F16C are
/// available; `K` is not Q6_K; tiles `t0..t0 + nt` (`1 <= nt <= WIDE`) and
/// activation rows `i0..i0 + rr` exist; `1 <= rr <= MAX_ROWS`; unless `K`
/// is Q8_0, `bt[j * nb..]` holds tile `t0 + j` unpacked.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn wide<const K: u8>(
    w: &QuantWeights,
    x: &PlainActs<'_>,
    t0: usize,
    nt: usize,
    i0: usize,
    rr: usize,
    bt: &mut [Aligned<[u8; 512]>],
    jit: bool,
    ct: &mut [Aligned<[[[i32; TILE]; MAX_ROWS]; GROUP]>; 2],
    res: &mut [[[f32; TILE]; MAX_ROWS]; WIDE],
) {
    let nb = w.nb;
    let is_k = matches!(K, Q4K | Q5K);
    let subs = if is_k { SUBS } else { 1 };
    let rec = tile_record_bytes(w.kind);
    let cb = TILE * w.kind.block_bytes();
    let record = |t: usize, b: usize| {
        (
            w.qs.as_ptr()
                .wrapping_add((t * (nb / subs) + b / subs) * rec),
            b % subs,
        )
    };
    let sa = nb * QK;
    let xa = x.qs.as_ptr().wrapping_add(i0 * sa);
    assert!((1..=WIDE).contains(&nt));
    assert!(K == Q8_0 || bt.len() >= if jit { 2 * WIDE } else { nt * nb });
    let mut acc = [[_mm512_setzero_ps(); MAX_ROWS]; WIDE];
    // Three stages a block apart: unpack (`jit` only: into a 2-block ring
    // that stays in L1), products, epilogue.
    for it in 0..nb + 2 {
        if jit && K != Q8_0 && it < nb {
            for j in 0..nt {
                // SAFETY: tile t0 + j exists, it < nb, K is not Q8_0.
                unsafe { unpack_block::<K>(w, t0 + j, it, &mut bt[(it % 2) * WIDE + j]) };
            }
        }
        if (1..=nb).contains(&it) {
            let b = it - 1;
            // Tiles past `nt` repeat tile 0's product; their results are
            // never read.
            let pb: [*const u8; WIDE] = core::array::from_fn(|j| {
                let j = if j < nt { j } else { 0 };
                if K == Q8_0 {
                    record(t0 + j, b).0
                } else if jit {
                    bt[(b % 2) * WIDE + j].0.as_ptr()
                } else {
                    bt[j * nb + b].0.as_ptr()
                }
            });
            // SAFETY: the tiles are configured for rr rows; A is rr rows of
            // activation block b at the row stride, which exist; each B is
            // a tile's 512 unpacked bytes (Q8_0: its record's codes); each C
            // is rr rows of 64 bytes in slot b % 2.
            unsafe {
                products_wide(
                    b % 2 == 1,
                    xa.wrapping_add(b * QK),
                    sa,
                    &pb,
                    ct[b % 2].0.as_mut_ptr(),
                )
            };
        }
        if it >= 2 {
            let b = it - 2;
            let c = &ct[b % 2].0;
            for j in 0..nt {
                let (blk, jj) = record(t0 + j, b);
                // SAFETY: block b of tile t0 + j lies in record `blk`; slot
                // j holds its stored products for rr rows; activation rows
                // i0..i0 + rr exist.
                unsafe {
                    epilogue::<K>(
                        blk,
                        jj,
                        cb,
                        &c[j],
                        &c[j],
                        x,
                        i0 * nb + b,
                        nb,
                        rr,
                        &mut acc[j],
                    )
                };
            }
        }
    }
    for j in 0..nt {
        for r in 0..rr {
            // SAFETY: `res[j][r]` is exactly 16 floats.
            unsafe { _mm512_storeu_ps(res[j][r].as_mut_ptr(), acc[j][r]) };
        }
    }
}
