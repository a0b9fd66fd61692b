//! Which kernel path this CPU runs, chosen once at run time.

/// Which implementation of the quantized block dot products runs. Chosen
/// once per process (`best`); tests drive each one explicitly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelPath {
    #[default]
    Portable,
    /// AVX2 + FMA + F16C: a tile as two 8-row halves, `vpmaddubsw`.
    Avx2,
    /// AVX2 with AVX-VNNI (256-bit `vpdpbusd`, Intel client CPUs from
    /// Alder Lake on, which have no AVX-512): the AVX2 layout, one
    /// instruction per step half instead of three. K-quants run AVX2's.
    AvxVnni,
    /// AVX-512 VNNI on the row-tile layout: 16 rows per vector, one
    /// `vpdpbusd` per 4-byte step of a block.
    Vnni,
    /// Intel AMX for products of `amx::MIN_ROWS` or more activation rows
    /// (one `tdpbsud` per block serves up to 16 of them), VNNI for fewer.
    Amx,
}

impl KernelPath {
    /// The fastest path this CPU supports (`SPECD_NO_SIMD` /
    /// `SPECD_NO_AVX512` / `SPECD_NO_AVXVNNI` / `SPECD_NO_AMX` turn the
    /// SIMD paths off). AMX runs only where it measures faster than VNNI
    /// on this machine (`amx::pays`).
    pub fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if super::amx::available() && super::amx::pays() {
                return Self::Amx;
            }
            if super::simd::vnni::available() {
                return Self::Vnni;
            }
            if super::simd::avxvnni::available() {
                return Self::AvxVnni;
            }
            if super::simd::available() {
                return Self::Avx2;
            }
        }
        Self::Portable
    }

    /// Every path usable on this CPU.
    pub fn supported() -> Vec<Self> {
        let mut v = vec![Self::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if super::simd::available() {
                v.push(Self::Avx2);
            }
            if super::simd::avxvnni::available() {
                v.push(Self::AvxVnni);
            }
            if super::simd::vnni::available() {
                v.push(Self::Vnni);
            }
            if super::amx::available() {
                v.push(Self::Amx);
            }
        }
        v
    }
}

/// The timing `KernelPath::best` decided AMX on: median microseconds of
/// one 64-row product on AMX and on VNNI (`amx::pays`), where it was
/// measured (AMX present, permitted and not forced by `SPECD_AMX=1`).
pub fn amx_calibration() -> Option<(f64, f64)> {
    #[cfg(target_arch = "x86_64")]
    {
        super::amx::calibration().map(|c| (c.amx_us, c.vnni_us))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Ask the CPU to bring `data` into its L2 cache now (`prefetcht1` per
/// line), so a loop that reads it next finds it there instead of waiting
/// on memory line by line. A hint: no value changes, nothing faults, and
/// elsewhere than x86-64 nothing happens.
pub fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let p = data.as_ptr() as usize;
        let end = p + std::mem::size_of_val(data);
        // From the line holding the first byte, so the last line is
        // reached whatever the alignment.
        let mut a = if end == p { end } else { p & !63 };
        while a < end {
            // SAFETY: `prefetch` is SSE (part of every x86-64 CPU) and a
            // hint: it never faults (whatever the address) and changes no
            // value.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(a as *const i8) };
            a += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// Write back and drop every cache line holding part of `data` from every
/// level of this CPU's caches (`clflush`), so the next read comes from
/// memory. Benchmarks use it, on a machine whose caches would hold the
/// weights, to time forwards that stream them from memory, as on a
/// machine whose last-level cache is far smaller than the model. Returns
/// whether this CPU could do it (x86-64 only; elsewhere nothing happens).
pub fn evict_from_caches<T>(data: &[T]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_clflush, _mm_mfence};
        let p = data.as_ptr() as *const u8;
        let len = std::mem::size_of_val(data);
        // An empty slice's pointer may be dangling: touch nothing.
        let end = p as usize + len;
        let mut a = if len == 0 { end } else { (p as usize) & !63 };
        while a < end {
            // SAFETY: `clflush` is SSE2 (part of every x86-64 CPU); the
            // line at `a` holds at least one byte of the non-empty `data`,
            // which is borrowed and so mapped; flushing changes no value.
            unsafe { _mm_clflush(a as *const u8) };
            a += 64;
        }
        // SAFETY: `mfence` is SSE2; it only orders the flushes before
        // later loads.
        unsafe { _mm_mfence() };
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = data;
        false
    }
}
