//! CPU numeric kernels for the model runner.
//!
//! Invariant (batch invariance): every output element is a function of one
//! activation row and one weight row only, computed in an order that does not
//! depend on how many rows share the call. A position's logits are therefore
//! bit-identical whether it is computed alone or with other positions or
//! sequences; greedy speculation relies on this for exact losslessness.
//!
//! Quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the K-quants Q4_K, Q5_K
//! and Q6_K) multiply activations quantized to 8-bit blocks of 32 (as ggml
//! does): the integer part of each block dot product is exact, and
//! per-block scales are accumulated in block order.

//!
//! Rooms: `layout` (the row-tile weight layout, the activation view, the
//! shared tile loop), `kquant` (the K-quant super-block records and their
//! portable kernel), `activations` (activation quantization), `matmul`
//! (the portable kernel and the parallel split), `team` (a forward's
//! fork-join executor), `path` (which path runs), `elementwise` (norms, exp, SiLU),
//! `simd` and `simd_k` (the x86-64 paths, which depend on `layout` and
//! `kquant`'s record offsets only), `amx` (Intel AMX tile products for
//! many activation rows, on the same layout and epilogue), `bf16` (AMX
//! bf16 GEMMs for training, not bit-identical: never on inference).

mod activations;
#[cfg(target_arch = "x86_64")]
mod amx;
pub mod bf16;
mod elementwise;
mod kquant;
mod layout;
mod matmul;
mod path;
#[cfg(target_arch = "x86_64")]
pub(crate) mod simd;
#[cfg(target_arch = "x86_64")]
mod simd_k;
pub(crate) mod team;
#[cfg(test)]
mod tests;

pub use activations::{quantize_q8, Activations};
pub use elementwise::{exp_f32, exp_shifted, fold16, gelu_tanh_mul, rms_norm, silu_mul};
pub use kquant::QK_K;
pub use layout::{
    tile_record_bytes, PlainActs, QMatrix, QuantKind, QuantWeights, WeightFormat, QK, TILE,
};
pub use matmul::{dot_f32, matmul_glu, matmul_many, matmul_swiglu, wants_q8};
pub use path::{amx_calibration, evict_from_caches, prefetch, KernelPath};
