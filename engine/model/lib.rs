//! Model runner: decoder-only transformer weights (Llama, Mistral, Qwen2,
//! Qwen3, Gemma 3, Phi-3), loading (GGUF and safetensors), and the batched,
//! rollback-able forward pass.
//!
//! Invariants:
//! - Weights are immutable after load; a `Model` is shared read-only.
//! - A forward appends its tokens to each sequence's `KvCache`; callers roll
//!   back with `KvCache::truncate`. Nothing else mutates a cache.
//! - Logits of a position are bit-identical however many positions or
//!   sequences share the forward (see `kernels`).

mod attention;
pub mod dflash;
pub mod eagle;
pub mod error;
pub mod kernels;
pub mod kv;
pub mod llama;
pub mod load;
pub mod medusa;
pub mod mtp;
pub mod requant;
pub mod sampler;
pub mod tensor_file;
pub mod tokenizer;

pub use error::{Result, SpecdError};
pub use kernels::{QMatrix, WeightFormat};
pub use kv::{KvCache, KvDtype, KvLayout, SharedBlock};
pub use llama::{ForwardInput, ForwardOutput, Logits, Model, TreeMask};
pub use load::load_model;

/// Architectures the loaders accept (GGUF `general.architecture`; Hugging
/// Face `model_type`, with `gemma3_text` for Gemma 3).
pub const SUPPORTED_ARCHITECTURES: &[&str] =
    &["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"];

/// Which rotary embedding pairing the checkpoint's Q/K weights expect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): GGUF Llama/Mistral (weights permuted by the
    /// converter).
    Interleaved,
    /// Half-split pairs (i, i + d/2): Hugging Face checkpoints, Qwen2 GGUF.
    Neox,
}

/// How the rotary frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (every frequency over `factor`).
    Linear {
        factor: f32,
    },
    /// Llama 3.1's piecewise rescaling: long wavelengths over `factor`,
    /// short ones kept, a smooth blend between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: usize,
    },
    /// Per-frequency divisors as stored (GGUF `rope_freqs.weight`, which
    /// llama.cpp's converter writes for Llama 3.1 scaling).
    Factors(Vec<f32>),
    /// LongRoPE (Phi-3.5, Phi-4-mini): frequencies divided by per-frequency
    /// factors (the short ones: specd caps the context at the original
    /// length, where Hugging Face uses them too) and cos/sin scaled by
    /// `attention_factor`.
    LongRope {
        factors: Vec<f32>,
        attention_factor: f32,
    },
    /// YaRN (Qwen's long contexts): frequencies blended between
    /// extrapolation (short wavelengths) and interpolation by `factor`
    /// (long ones) over a ramp set by `beta_fast` / `beta_slow` rotations in
    /// the original context, and cos/sin scaled by `attention_factor`
    /// (default `0.1 ln(factor) + 1`), as Hugging Face and llama.cpp do.
    Yarn {
        factor: f32,
        original_max_position: usize,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: Option<f32>,
    },
}

/// The feed-forward gate's nonlinearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (Llama, Qwen, Mistral, Phi-3).
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma).
    GeluTanh,
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
    /// Rotary scaling of the global layers.
    pub rope_scaling: RopeScaling,
    /// Leading dimensions of each head that rotate (`head_dim` unless the
    /// model uses partial rotary embeddings).
    pub rotary_dim: usize,
    /// Sliding-window layers' RoPE base, where it differs (Gemma 3).
    pub local_rope_theta: Option<f32>,
    /// Attention window in positions (a token sees itself and the
    /// `window - 1` before it) of the sliding-window layers.
    pub sliding_window: Option<usize>,
    /// Every `n`-th layer (1-based) is global, the rest slide (Gemma 3: 6);
    /// `None` with a window set: every layer slides (Mistral).
    pub sliding_pattern: Option<usize>,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// RMSNorm of the attention and feed-forward outputs before the
    /// residual add (Gemma 3).
    pub post_norms: bool,
    pub activation: Activation,
    /// Token embeddings multiplied by this (Gemma: sqrt(hidden)).
    pub embed_scale: Option<f32>,
    /// Softmax scale of attention scores (usually `1/sqrt(head_dim)`).
    pub attn_scale: f32,
    /// `logits = cap * tanh(logits / cap)` where set.
    pub final_logit_softcap: Option<f32>,
}

impl ModelConfig {
    /// A Llama-style config: full rotary, no windows, SwiGLU, plain norms.
    /// Loaders start from it and switch on what the architecture has.
    #[allow(clippy::too_many_arguments)]
    pub fn llama_like(
        arch: &str,
        vocab_size: usize,
        hidden: usize,
        intermediate: usize,
        layers: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        Self {
            arch: arch.to_string(),
            vocab_size,
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            head_dim,
            rope_theta: 10_000.0,
            rope_style: RopeStyle::Neox,
            rms_eps: 1e-5,
            max_seq_len: 4096,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            rope_scaling: RopeScaling::None,
            rotary_dim: head_dim,
            local_rope_theta: None,
            sliding_window: None,
            sliding_pattern: None,
            qk_norm: false,
            post_norms: false,
            activation: Activation::Silu,
            embed_scale: None,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            final_logit_softcap: None,
        }
    }

    /// Width of a query row (`heads * head_dim`; not always `hidden`).
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// The attention window of layer `li`, or `None` for a global layer.
    pub fn layer_window(&self, li: usize) -> Option<usize> {
        let w = self.sliding_window?;
        match self.sliding_pattern {
            Some(n) if n > 0 && (li + 1).is_multiple_of(n) => None,
            _ => Some(w),
        }
    }

    /// The RoPE base and scaling of layer `li` (sliding layers of Gemma 3
    /// use their own base and no scaling).
    pub fn layer_rope(&self, li: usize) -> (f32, &RopeScaling) {
        match (self.layer_window(li), self.local_rope_theta) {
            (Some(_), Some(t)) => (t, &RopeScaling::None),
            _ => (self.rope_theta, &self.rope_scaling),
        }
    }

    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        let mut sliding = 0u128;
        for li in 0..self.layers.min(128) {
            if self.layer_window(li).is_some() {
                sliding |= 1 << li;
            }
        }
        KvLayout {
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size,
            dtype: KvDtype::default(),
            sliding,
            window: self.sliding_window.unwrap_or(0),
        }
    }
}

/// Default KV block size in token slots.
pub const DEFAULT_BLOCK_SIZE: usize = 64;
