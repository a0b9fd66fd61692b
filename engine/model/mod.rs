//! Model runner: Llama-family weights, loading (GGUF and safetensors), and the
//! batched, rollback-able forward pass.
//!
//! Invariants:
//! - Weights are immutable after load; a `Model` is shared read-only.
//! - A forward appends its tokens to each sequence's `KvCache`; callers roll
//!   back with `KvCache::truncate`. Nothing else mutates a cache.
//! - Logits of a position are bit-identical however many positions or
//!   sequences share the forward (see `kernels`).

mod attention;
pub mod eagle;
pub mod kernels;
pub mod kv;
pub mod llama;
pub mod load;
pub mod medusa;
pub mod mtp;
pub mod requant;
pub mod tensor_file;

pub use kernels::{QMatrix, WeightFormat};
pub use kv::{KvCache, KvDtype, KvLayout, SharedBlock};
pub use llama::{ForwardInput, ForwardOutput, Logits, Model, TreeMask};
pub use load::load_model;

/// Which rotary embedding pairing the checkpoint's Q/K weights expect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): GGUF Llama/Mistral (weights permuted by the
    /// converter).
    Interleaved,
    /// Half-split pairs (i, i + d/2): Hugging Face checkpoints, Qwen2 GGUF.
    Neox,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: String,
    pub vocab_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
    pub max_seq_len: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        KvLayout {
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size,
            dtype: KvDtype::default(),
        }
    }
}

/// Default KV block size in token slots.
pub const DEFAULT_BLOCK_SIZE: usize = 64;
