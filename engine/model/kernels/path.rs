//! Which kernel path this CPU runs, chosen once at run time.

/// Which implementation of the quantized block dot products runs. Chosen
/// once per process (`best`); tests drive each one explicitly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelPath {
    #[default]
    Portable,
    /// AVX2 + FMA + F16C: a tile as two 8-row halves, `vpmaddubsw`.
    Avx2,
    /// AVX-512 VNNI on the row-tile layout: 16 rows per vector, one
    /// `vpdpbusd` per 4-byte step of a block.
    Vnni,
}

impl KernelPath {
    /// The fastest path this CPU supports (`SPECD_NO_SIMD` / `SPECD_NO_AVX512`
    /// turn the SIMD paths off).
    pub fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if super::simd::vnni::available() {
                return Self::Vnni;
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
            if super::simd::vnni::available() {
                v.push(Self::Vnni);
            }
        }
        v
    }
}
