//! `specd distill eagle`: train an EAGLE-3 draft head for a target on CPU
//! (candle autograd), and write it in the public EAGLE-3 checkpoint layout.
//!
//! 1. Data: the target's responses to the training prompts (parent module),
//!    then one batched forward per group of samples that records the
//!    features the head reads (the residual stream entering target layers
//!    2, L/2 and L-3: our hidden indices 1, L/2-1 and L-4), the
//!    final-normed hidden state (the target's distribution, recomputed on
//!    the draft vocabulary during training) and the target's argmax.
//!    Cached in `<out>/train/features.safetensors`.
//! 2. Draft vocabulary: the `draft_vocab` most frequent response tokens
//!    (EOS always included); `d2t[i] = target_id - i`.
//! 3. Model (EAGLE-3): `g = fc(cat[F_low, F_mid, F_high])`;
//!    `u = cat[input_layernorm(embed(x)), hidden_norm(g)]`;
//!    `a = g + o(Attn(u))` (with `normed_residual`, a specd extension:
//!    `a = hidden_norm(g) + o(Attn(u))`); `y = a + MLP(post_attention_layernorm(a))`;
//!    logits `lm_head(norm(y))` over the draft vocabulary. The target's
//!    embedding is frozen and not part of the head.
//! 4. Training-time test: the head is unrolled `ttt_steps` times; step k
//!    feeds row p its own step k-1 output `y` with token x_{p+1+k} at
//!    position p+k, attends to the step-0 keys of rows 0..=p plus its own
//!    keys of steps 1..=k (what a chain draft sees at inference), and learns
//!    the target's distribution at position p+1+k (soft cross-entropy on
//!    the draft vocabulary, step weight 0.8^k), on response positions only.
//! 5. AdamW (own implementation so its moments are checkpointed and a
//!    resume continues exactly), linear warm-up and cosine decay, global
//!    gradient-norm clipping; checkpoints in `<out>/train/`; validation
//!    acceptance@1 (head argmax = target argmax) on held-out samples.
//! 6. Output: `<out>/config.json` + `<out>/model.safetensors` (F16, with
//!    `d2t` I64 and `t2d` BOOL), loadable by the `eagle` proposer plugin
//!    and by anything that reads EAGLE-3 heads.
//!
//! Invariant: tensor names, shapes and dtypes of the output are exactly
//! the EAGLE-3 layout (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
//! `t2d`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var, D};

use super::fused::{RmsNorm, Rope, SoftCrossEntropy, TttAttention};
use super::train::{
    cosine_lr, plan_batches, prepare, target_head_rows, tensor_vec, var, AdamW, Checkpoint,
    DraftVocab, Features, InitHead, Prepared, Schedule,
};
use super::{DataConfig, Sample};
use crate::error::{Result, SpecdError};
use crate::model::eagle::feature_layers;
use crate::model::tensor_file::{self, TensorData, TensorFile};
use crate::model::Model;
use crate::sampler::Rng;
use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EagleConfig {
    /// Rows of the head's output layer (most frequent response tokens).
    pub draft_vocab: usize,
    /// MLP width of the head's decoder layer.
    pub intermediate: usize,
    /// Unrolled steps of training-time test.
    pub ttt_steps: usize,
    /// Samples are cut to this many tokens.
    pub max_len: usize,
    /// Padded tokens per training batch (batch x longest sample).
    pub batch_tokens: usize,
    /// Passes over the training samples.
    pub epochs: f64,
    pub lr: f64,
    pub warmup: usize,
    pub clip: f64,
    pub checkpoint_every: usize,
    /// Held-out fraction of samples for validation acceptance.
    pub val_fraction: f64,
    pub gen_tokens: usize,
    pub gen_max_tokens: usize,
    /// Temperature of the sampled share of responses.
    pub temperature: f32,
    pub sampled_fraction: f32,
    pub concurrency: usize,
    pub seed: u64,
    /// Stop after this many steps even if the schedule is longer (for
    /// tests of resume; 0: no limit).
    #[serde(default)]
    pub stop_after: usize,
    /// Start `fc` as the identity on the highest feature layer (step 0
    /// then starts as a logit lens) instead of small random weights.
    #[serde(default = "default_true")]
    pub fc_identity: bool,
    /// Scale `fc`'s start so the fused state has unit RMS on the training
    /// features (the raw residual stream is far larger, which leaves the
    /// layer's own updates negligible beside it).
    #[serde(default = "default_true")]
    pub fc_unit: bool,
    /// Standard deviation of the start of the layer's output projections
    /// (`o_proj`, `down_proj`).
    #[serde(default = "default_out_std")]
    pub out_std: f32,
    /// Leave out of the loss the positions whose target token is outside
    /// the draft vocabulary (EAGLE-3's reference does).
    #[serde(default = "default_true")]
    pub drop_oov: bool,
    /// Start the attention focused on each row's own key (0: off): q and
    /// k read the token-embedding half through one shared random
    /// projection times this gain, so a row's score for its own key (the
    /// token it is fed) stands out; in EAGLE-3 that token reaches the
    /// output only through attention.
    #[serde(default = "default_self_attn")]
    pub self_attn_init: f32,
    /// Our hidden indices of the layers the head reads (empty: EAGLE-3's
    /// `feature_layers`; the target's layer count names its final-normed
    /// state).
    #[serde(default)]
    pub feature_layers: Vec<usize>,
    /// EAGLE-3 with the layer's residual stream starting from the
    /// normalised state (`hidden_norm(g)`) instead of `g` itself, at every
    /// TTT step, as an MTP module re-normalises the state it is given (a
    /// specd extension: written as `specd_normed_residual` in config.json).
    #[serde(default)]
    pub normed_residual: bool,
    /// Train a multi-token-prediction module (`model::mtp`) instead of an
    /// EAGLE-3 head: `eh_proj(cat[enorm(e), hnorm(f)])` on the final-normed
    /// state, a pre-norm decoder layer, `shared_head.norm` and a head over
    /// the draft vocabulary; written as a target's MTP layer.
    #[serde(default)]
    pub mtp: bool,
    #[serde(skip)]
    pub prompt_ids: Vec<Vec<u32>>,
    /// Which text prompts the target answers (`templated`: the data of the
    /// shipped heads).
    #[serde(default)]
    pub prompts: crate::distill::prompts::PromptMix,
    /// Train on this `specd distill corpus` directory instead of
    /// generating text (`DataConfig::corpus`).
    #[serde(default)]
    pub corpus: Option<std::path::PathBuf>,
    /// Only these shards of `corpus` (`DataConfig::corpus_shards`).
    #[serde(default)]
    pub corpus_shards: Option<std::ops::Range<usize>>,
    /// Start from the head (or MTP module) this directory holds, as
    /// `export` wrote it, instead of the fresh start: its weights and its
    /// draft vocabulary (`d2t`), so training continues it on new data (a
    /// checkpoint in the run's own train/ still takes precedence).
    #[serde(default)]
    pub init: Option<std::path::PathBuf>,
}

impl EagleConfig {
    /// The data pipeline's settings of this run (what its train/ caches).
    pub(super) fn data_config(&self) -> DataConfig {
        DataConfig {
            gen_tokens: self.gen_tokens,
            gen_max_tokens: self.gen_max_tokens,
            temperature: self.temperature,
            sampled_fraction: self.sampled_fraction,
            concurrency: self.concurrency,
            seed: self.seed,
            prompt_ids: self.prompt_ids.clone(),
            mix: self.prompts,
            corpus: self.corpus.clone(),
            corpus_shards: self.corpus_shards.clone(),
        }
    }
}

fn default_true() -> bool {
    true
}

fn default_out_std() -> f32 {
    0.002
}

fn default_self_attn() -> f32 {
    1.0
}

impl Default for EagleConfig {
    fn default() -> Self {
        Self {
            draft_vocab: 4096,
            intermediate: 1024,
            ttt_steps: 4,
            max_len: 448,
            batch_tokens: 2048,
            epochs: 2.0,
            lr: 1e-3,
            warmup: 40,
            clip: 1.0,
            checkpoint_every: 50,
            val_fraction: 0.03,
            gen_tokens: 240_000,
            gen_max_tokens: 256,
            temperature: 0.8,
            sampled_fraction: 0.5,
            concurrency: 32,
            seed: 0,
            stop_after: 0,
            fc_identity: true,
            fc_unit: true,
            out_std: default_out_std(),
            drop_oov: true,
            self_attn_init: default_self_attn(),
            feature_layers: Vec::new(),
            normed_residual: false,
            mtp: false,
            prompt_ids: Vec::new(),
            prompts: Default::default(),
            corpus: None,
            corpus_shards: None,
            init: None,
        }
    }
}

fn cerr(e: candle_core::Error) -> SpecdError {
    SpecdError::InvalidRequest(format!("distill eagle: {e}"))
}

fn serr(e: String) -> SpecdError {
    SpecdError::InvalidRequest(format!("distill eagle: {e}"))
}

/// The head's trainable tensors, in EAGLE-3 names.
const PARAM_NAMES: [&str; 13] = [
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
];

/// Shapes of the head's trainable tensors, in EAGLE-3 names.
fn param_shapes(
    h: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    f: usize,
    nl: usize,
    dv: usize,
) -> Vec<(&'static str, Vec<usize>)> {
    vec![
        ("fc.weight", vec![h, nl * h]),
        ("midlayer.input_layernorm.weight", vec![h]),
        ("midlayer.hidden_norm.weight", vec![h]),
        ("midlayer.self_attn.q_proj.weight", vec![nh * hd, 2 * h]),
        ("midlayer.self_attn.k_proj.weight", vec![nkv * hd, 2 * h]),
        ("midlayer.self_attn.v_proj.weight", vec![nkv * hd, 2 * h]),
        ("midlayer.self_attn.o_proj.weight", vec![h, nh * hd]),
        ("midlayer.post_attention_layernorm.weight", vec![h]),
        ("midlayer.mlp.gate_proj.weight", vec![f, h]),
        ("midlayer.mlp.up_proj.weight", vec![f, h]),
        ("midlayer.mlp.down_proj.weight", vec![h, f]),
        ("norm.weight", vec![h]),
        ("lm_head.weight", vec![dv, h]),
    ]
}

/// The MTP module's trainable tensors (the names after
/// `model.layers.{N}.`; `shared_head.head` over the draft vocabulary).
const MTP_PARAM_NAMES: [&str; 14] = [
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
];

fn mtp_param_shapes(
    h: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    f: usize,
    dv: usize,
) -> Vec<(&'static str, Vec<usize>)> {
    MTP_PARAM_NAMES
        .iter()
        .map(|&n| {
            let shape = match n {
                "eh_proj.weight" => vec![h, 2 * h],
                "self_attn.q_proj.weight" => vec![nh * hd, h],
                "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![nkv * hd, h],
                "self_attn.o_proj.weight" => vec![h, nh * hd],
                "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![f, h],
                "mlp.down_proj.weight" => vec![h, f],
                "shared_head.head.weight" => vec![dv, h],
                _ => vec![h],
            };
            (n, shape)
        })
        .collect()
}

pub(super) const EPS: f64 = 1e-5;

pub(super) fn rms(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op2(w, RmsNorm { eps: EPS as f32 })
}

/// `x W^T` over the last dimension of `x` (`(b, t, in)` or `(rows, in)`),
/// as one 2-D matmul over every row: in bf16 tile products with f32 sums
/// where the CPU has AMX-BF16 and the product is large (`bf16_products`),
/// else candle's f32 matmul.
pub(super) fn lin(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let dims = x.dims();
    let (last, rows) = (
        dims[dims.len() - 1],
        x.elem_count() / dims[dims.len() - 1].max(1),
    );
    let mut out = dims.to_vec();
    *out.last_mut().unwrap_or(&mut 0) = w.dim(0)?;
    let x2 = x.reshape((rows, last))?;
    let y = if bf16_products(rows, last, w.dim(0)?) {
        x2.apply_op2(w, super::fused::MatmulWt)?
    } else {
        x2.matmul(&w.t()?)?
    };
    y.reshape(out)
}

/// Whether a training product of `m x k` by `k x n` runs in bf16 on AMX
/// tiles: the CPU has them (`SPECD_NO_AMX=1` turns them off, and with
/// them every training product is f32), `SPECD_TRAIN_F32` is unset, and
/// the product has at least 2^20 multiply-adds (smaller ones cost more to
/// pack than they save).
pub(super) fn bf16_products(m: usize, k: usize, n: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| {
        crate::model::kernels::bf16::available() && std::env::var_os("SPECD_TRAIN_F32").is_none()
    });
    on && m * k * n >= 1 << 20
}

/// The TTT attention composed from candle ops, with its weights: `keys`
/// are each step's `(k, v)` as `(b, nkv, t, hd)`. What `probe` reads, and
/// the reference `fused::TttAttention` is tested against.
pub(super) fn composed_attention(
    q: &Tensor,
    keys: &[(Tensor, Tensor)],
    nh: usize,
    scale: f64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let t = q.dim(2)?;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    let causal = Tensor::from_vec(mask, (t, t), q.device())?;
    let rep = |x: &Tensor| -> candle_core::Result<Tensor> {
        let (b, n, t, hd) = x.dims4()?;
        let g = nh / n;
        x.unsqueeze(2)?
            .expand((b, n, g, t, hd))?
            .reshape((b, nh, t, hd))
    };
    let keys = keys
        .iter()
        .map(|(k, v)| Ok((rep(k)?, rep(v)?)))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let (k0, v0) = &keys[0];
    let mut parts = vec![(q.matmul(&k0.t()?)? * scale)?.broadcast_add(&causal)?];
    for (kj, _) in &keys[1..] {
        parts.push(((q * kj)?.sum_keepdim(D::Minus1)? * scale)?);
    }
    // `softmax` (not `softmax_last_dim`, which has no backward pass).
    let att = candle_nn::ops::softmax(&Tensor::cat(&parts, D::Minus1)?, D::Minus1)?;
    let mut o = att.narrow(D::Minus1, 0, t)?.matmul(v0)?;
    for (j, (_, vj)) in keys.iter().enumerate().skip(1) {
        o = (o + att.narrow(D::Minus1, t + j - 1, 1)?.broadcast_mul(vj)?)?;
    }
    Ok((o, att))
}

/// The trainable head plus the frozen target pieces it needs.
pub(super) struct Net {
    p: HashMap<&'static str, Var>,
    /// Target embedding, `vocab x h` (frozen).
    embed: Tensor,
    /// Target output head rows of the draft vocabulary, `dv x h` (frozen).
    target_head: Tensor,
    /// `(positions, hd/2)` rotary tables.
    cos: Arc<Vec<f32>>,
    sin: Arc<Vec<f32>>,
    h: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    /// The MTP module's graph (`MTP_PARAM_NAMES`) instead of EAGLE-3's.
    mtp: bool,
    /// EAGLE-3's residual starts from `hidden_norm(g)` (`EagleConfig::
    /// normed_residual`).
    normed_residual: bool,
}

/// Diagnostics of one TTT step, per row (row = b * t + p).
pub(super) struct ProbeStep {
    /// `||y - g|| / ||g||`: how far the layer moves the state it was given.
    pub(super) rel: Vec<f32>,
    /// Attention weight the row gives its own key (mean over heads).
    pub(super) own_att: Vec<f32>,
}

/// One batch, as host arrays (row = b * t + p).
pub(super) struct Batch {
    pub(super) b: usize,
    pub(super) t: usize,
    /// `b*t x 3h`.
    feats: Vec<f32>,
    /// `b*t x h`: the target's final-normed state at every position (its
    /// distribution, recomputed on the draft vocabulary once per batch).
    fin: Vec<f32>,
    /// Per TTT step: token ids of the embedding input, the row of `fin`
    /// whose distribution each row learns, the loss mask, and the
    /// target's argmax as a draft id (-1: outside the draft vocabulary).
    pub(super) steps: Vec<StepData>,
}

pub(super) struct StepData {
    pub(super) ids: Vec<u32>,
    fin_row: Vec<u32>,
    pub(super) mask: Vec<f32>,
    pub(super) argmax: Vec<i64>,
}

impl Net {
    fn w(&self, name: &str) -> &Tensor {
        self.p[name].as_tensor()
    }

    fn rope(&self, x: &Tensor, offset: usize) -> candle_core::Result<Tensor> {
        // x: (b, heads, t, hd); NeoX pairing (i, i + hd/2) as HF Llama.
        x.contiguous()?.apply_op1(Rope {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            offset,
            pos: None,
        })
    }

    /// (b, t, n*hd) -> (b, n, t, hd).
    fn heads(&self, x: &Tensor, n: usize) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        x.reshape((b, t, n, self.hd))?.transpose(1, 2)?.contiguous()
    }

    /// The head unrolled over the batch's TTT steps: per step, the final-
    /// normed state of every row, `(b*t, h)` (`logits` makes them logits).
    /// With `probe`, each step's diagnostics are recorded too.
    fn unroll(
        &self,
        batch: &Batch,
        mut probe: Option<&mut Vec<ProbeStep>>,
    ) -> candle_core::Result<Vec<Tensor>> {
        let dev = Device::Cpu;
        let (b, t, h) = (batch.b, batch.t, self.h);
        let nl = batch.feats.len() / (b * t * h);
        let feats = Tensor::from_slice(&batch.feats, (b, t, nl * h), &dev)?;
        // EAGLE-3: g = fc(features), fed its own output at later steps.
        // MTP: the state f (the target's, then the module's own output).
        let mut g = if self.mtp {
            feats
        } else {
            lin(&feats, self.w("fc.weight"))?
        };
        let scale = 1.0 / (self.hd as f64).sqrt();
        let mut keys: Vec<(Tensor, Tensor)> = Vec::new();
        let mut out = Vec::new();
        for (k, sd) in batch.steps.iter().enumerate() {
            let ids = Tensor::from_slice(&sd.ids, b * t, &dev)?;
            let e = self.embed.index_select(&ids, 0)?.reshape((b, t, h))?;
            let (x, u) = if self.mtp {
                let cat = Tensor::cat(
                    &[
                        &rms(&e, self.w("enorm.weight"))?,
                        &rms(&g, self.w("hnorm.weight"))?,
                    ],
                    D::Minus1,
                )?;
                let x = lin(&cat, self.w("eh_proj.weight"))?;
                let u = rms(&x, self.w("input_layernorm.weight"))?;
                (x, u)
            } else {
                let gn = rms(&g, self.w("midlayer.hidden_norm.weight"))?;
                let u = Tensor::cat(
                    &[&rms(&e, self.w("midlayer.input_layernorm.weight"))?, &gn],
                    D::Minus1,
                )?;
                let x = if self.normed_residual { gn } else { g.clone() };
                (x, u)
            };
            let pre = if self.mtp { "" } else { "midlayer." };
            let wn = |n: &str| self.w(&format!("{pre}{n}"));
            let proj = |name: &str, n: usize| -> candle_core::Result<Tensor> {
                self.heads(&lin(&u, wn(name))?, n)
            };
            let q = self.rope(&proj("self_attn.q_proj.weight", self.nh)?, k)?;
            let kk = self.rope(&proj("self_attn.k_proj.weight", self.nkv)?, k)?;
            let vv = proj("self_attn.v_proj.weight", self.nkv)?;
            keys.push((kk, vv));
            let (o, own_att) = if probe.is_some() {
                let (o, att) = composed_attention(&q, &keys, self.nh, scale)?;
                // The weight each row gives its own key (step 0: the
                // diagonal; step k: its own step-k key), mean over heads.
                let own = if k == 0 {
                    let eye = Tensor::eye(t, DType::F32, &dev)?;
                    att.narrow(D::Minus1, 0, t)?
                        .broadcast_mul(&eye)?
                        .sum(D::Minus1)?
                } else {
                    att.narrow(D::Minus1, t + k - 1, 1)?.squeeze(D::Minus1)?
                };
                (o, Some(own.mean(1)?.flatten_all()?.to_vec1::<f32>()?))
            } else {
                let cat = |i: usize| -> candle_core::Result<Tensor> {
                    let xs: Vec<&Tensor> = keys
                        .iter()
                        .map(|kv| if i == 0 { &kv.0 } else { &kv.1 })
                        .collect();
                    Tensor::cat(&xs, 2)
                };
                let o = q.apply_op3(&cat(0)?, &cat(1)?, TttAttention::new(k))?;
                (o, None)
            };
            let o = o.transpose(1, 2)?.reshape((b, t, self.nh * self.hd))?;
            let a = (&x + lin(&o, wn("self_attn.o_proj.weight"))?)?;
            let an = rms(&a, wn("post_attention_layernorm.weight"))?;
            let gate = lin(&an, wn("mlp.gate_proj.weight"))?.silu()?;
            let up = lin(&an, wn("mlp.up_proj.weight"))?;
            let y = (&a + lin(&(gate * up)?, wn("mlp.down_proj.weight"))?)?;
            let norm = if self.mtp {
                "shared_head.norm.weight"
            } else {
                "norm.weight"
            };
            out.push(rms(&y, self.w(norm))?.reshape((b * t, h))?);
            if let (Some(pr), Some(own_att)) = (probe.as_deref_mut(), own_att) {
                let norm = |x: &Tensor| -> candle_core::Result<Vec<f32>> {
                    x.sqr()?
                        .sum(D::Minus1)?
                        .sqrt()?
                        .flatten_all()?
                        .to_vec1::<f32>()
                };
                let (d, g0) = (norm(&(&y - &g)?)?, norm(&g)?);
                pr.push(ProbeStep {
                    rel: d.iter().zip(&g0).map(|(a, b)| a / b.max(1e-12)).collect(),
                    own_att,
                });
            }
            g = y;
        }
        Ok(out)
    }

    /// The head's output layer: draft-vocabulary logits of normed states.
    fn logits(&self, normed: &Tensor) -> candle_core::Result<Tensor> {
        let head = if self.mtp {
            "shared_head.head.weight"
        } else {
            "lm_head.weight"
        };
        lin(normed, self.w(head))
    }

    /// The TTT-unrolled loss; returns (loss, per-step (correct, counted)).
    /// Only the rows in the loss go through the output layers.
    fn forward(&self, batch: &Batch) -> candle_core::Result<(Tensor, Vec<(f64, f64)>)> {
        let dev = Device::Cpu;
        let (b, t, h) = (batch.b, batch.t, self.h);
        // The target's logits at every position, once; step k's rows learn
        // those of positions k + 1 further on.
        let fin = Tensor::from_slice(&batch.fin, (b * t, h), &dev)?;
        let target = lin(&fin, &self.target_head)?;
        let mut total: Option<Tensor> = None;
        let mut stats = Vec::new();
        for (k, (sd, normed)) in batch
            .steps
            .iter()
            .zip(self.unroll(batch, None)?)
            .enumerate()
        {
            let rows: Vec<u32> = (0..b * t)
                .filter(|&r| sd.mask[r] > 0.0)
                .map(|r| r as u32)
                .collect();
            if rows.is_empty() {
                stats.push((0.0, 0.0));
                continue;
            }
            let sel = Tensor::from_slice(&rows, rows.len(), &dev)?;
            let logits = self.logits(&normed.index_select(&sel, 0)?)?;
            let src: Vec<u32> = rows.iter().map(|&r| sd.fin_row[r as usize]).collect();
            let tk = target.index_select(&Tensor::from_slice(&src, src.len(), &dev)?, 0)?;
            // Soft cross-entropy against the target's distribution on the
            // draft vocabulary (no gradient), step weight 0.8^k.
            let n = rows.iter().map(|&r| sd.mask[r as usize]).sum::<f32>();
            let wk = 0.8f32.powi(k as i32) / n;
            let weights = rows.iter().map(|&r| sd.mask[r as usize] * wk).collect();
            let step_loss = logits.apply_op2(&tk, SoftCrossEntropy::new(weights))?;
            total = Some(match total {
                None => step_loss,
                Some(t) => (t + step_loss)?,
            });
            // Acceptance@1 of this step: head argmax = target argmax.
            let pred = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
            let hit = rows
                .iter()
                .zip(&pred)
                .filter(|(&r, &p)| i64::from(p) == sd.argmax[r as usize])
                .count();
            stats.push((hit as f64, f64::from(n)));
        }
        // A batch without a row in the loss (prompts cut at max_len) adds
        // nothing.
        let total = match total {
            Some(t) => t,
            None => Tensor::zeros((), DType::F32, &dev)?,
        };
        Ok((total, stats))
    }
}

/// The training graph's logits for one sample, from an exported head:
/// per TTT step, `tokens.len() x draft_vocab` (row p at step k is fed the
/// true token x_{p+1+k}; rows past the end are padding). `feats` holds the
/// target features, `tokens.len() x (layers * hidden)`. The reference the
/// plugin's inference path is tested against.
pub fn reference_logits(
    head_dir: &Path,
    target: &Model,
    tokens: &[u32],
    feats: &[f32],
    ttt: usize,
) -> Result<Vec<Vec<f32>>> {
    let net = Net::from_head(head_dir, target, tokens.len() + ttt + 1)?;
    let t = tokens.len();
    let steps = (0..ttt)
        .map(|k| StepData {
            ids: (0..t)
                .map(|p| tokens.get(p + 1 + k).copied().unwrap_or(0))
                .collect(),
            fin_row: Vec::new(),
            mask: Vec::new(),
            argmax: Vec::new(),
        })
        .collect();
    let batch = Batch {
        b: 1,
        t,
        feats: feats.to_vec(),
        fin: Vec::new(),
        steps,
    };
    net.unroll(&batch, None)
        .and_then(|ls| {
            ls.iter()
                .map(|l| net.logits(l)?.flatten_all()?.to_vec1::<f32>())
                .collect()
        })
        .map_err(cerr)
}

impl Net {
    /// The training graph of an exported head (EAGLE-3 or an MTP module),
    /// positions up to `max_pos`.
    pub(super) fn from_head(head_dir: &Path, target: &Model, max_pos: usize) -> Result<Net> {
        let tc = &target.config;
        let f = TensorFile::read(&head_dir.join("model.safetensors")).map_err(serr)?;
        let dev = Device::Cpu;
        let (h, vocab) = (tc.hidden, tc.vocab_size);
        // An MTP module (`distill mtp`) stores its tensors as the target's
        // layer `num_hidden_layers`.
        let mtp = f.names().any(|n| n.ends_with(".eh_proj.weight"));
        let (names, prefix): (&[&'static str], String) = if mtp {
            (&MTP_PARAM_NAMES, format!("model.layers.{}.", tc.layers))
        } else {
            (&PARAM_NAMES, String::new())
        };
        let mut p = HashMap::new();
        for &name in names {
            let full = format!("{prefix}{name}");
            let shape = f
                .shape(&full)
                .ok_or_else(|| serr(format!("missing tensor `{full}`")))?
                .to_vec();
            let v = f.f32(&full).map_err(serr)?;
            let t = Tensor::from_vec(v, shape, &dev).map_err(cerr)?;
            p.insert(name, Var::from_tensor(&t).map_err(cerr)?);
        }
        let emb = embedding_table(target);
        let hd = tc.head_dim;
        let (cos, sin) = rope_tables(max_pos, hd, tc.rope_theta)?;
        let normed_residual = !mtp && saved_normed_residual(head_dir)?;
        Ok(Net {
            p,
            embed: Tensor::from_vec(emb, (vocab, h), &dev).map_err(cerr)?,
            target_head: Tensor::zeros((1, h), DType::F32, &dev).map_err(cerr)?,
            cos,
            sin,
            h,
            nh: tc.heads,
            nkv: tc.kv_heads,
            hd,
            mtp,
            normed_residual,
        })
    }

    pub(super) fn is_mtp(&self) -> bool {
        self.mtp
    }

    /// Per TTT step: the head's argmax (draft ids) per row, and the
    /// step's diagnostics.
    pub(super) fn probe(&self, batch: &Batch) -> Result<(Vec<Vec<u32>>, Vec<ProbeStep>)> {
        let mut pr = Vec::new();
        let normed = self.unroll(batch, Some(&mut pr)).map_err(cerr)?;
        let am = normed
            .iter()
            .map(|l| {
                self.logits(l)?
                    .argmax(D::Minus1)
                    .and_then(|a| a.to_vec1::<u32>())
            })
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(cerr)?;
        Ok((am, pr))
    }
}

/// RMS of the recorded states of `layers` over (a spread of) the rows of
/// samples `idx`.
fn feature_rms(f: &Features, layers: &[usize], idx: &[usize], samples: &[Sample]) -> Result<f32> {
    let (mut sq, mut n) = (0f64, 0usize);
    let stride = (idx.len() / 200).max(1);
    let mut rows = Vec::new();
    for &i in idx.iter().step_by(stride) {
        let (o, len) = (f.offsets[i], samples[i].tokens.len());
        for &l in layers {
            rows.clear();
            f.extend(l, o, len, &mut rows)?;
            for &x in &rows {
                sq += f64::from(x) * f64::from(x);
                n += 1;
            }
        }
    }
    Ok(((sq / n.max(1) as f64).sqrt() as f32).max(1e-6))
}

/// The target's token embeddings, `vocab x hidden` f32 (frozen).
pub(super) fn embedding_table(target: &Model) -> Vec<f32> {
    let (vocab, h) = (target.config.vocab_size, target.config.hidden);
    let mut emb = vec![0f32; vocab * h];
    for r in 0..vocab {
        target
            .weights
            .embed
            .dequantize_row(r, &mut emb[r * h..(r + 1) * h]);
    }
    emb
}

#[allow(clippy::type_complexity)]
pub(super) fn rope_tables(
    max_pos: usize,
    hd: usize,
    theta: f32,
) -> Result<(Arc<Vec<f32>>, Arc<Vec<f32>>)> {
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f32 / hd as f32))
        .collect();
    let ang: Vec<f32> = (0..max_pos)
        .flat_map(|p| inv.iter().map(move |th| p as f32 * th))
        .collect();
    Ok((
        Arc::new(ang.iter().map(|a| a.cos()).collect()),
        Arc::new(ang.iter().map(|a| a.sin()).collect()),
    ))
}

/// Everything the batches are cut from.
pub(super) struct Corpus<'a> {
    pub(super) samples: &'a [Sample],
    pub(super) f: &'a Features,
    /// The head's feature layers, and the final-normed state's index.
    pub(super) feature_layers: Vec<usize>,
    pub(super) fin: usize,
    /// Target id -> draft id (-1: not in the draft vocabulary).
    pub(super) t2d: Vec<i64>,
    pub(super) h: usize,
    pub(super) nl: usize,
    /// Positions whose target token is outside the draft vocabulary are
    /// left out of the loss.
    pub(super) drop_oov: bool,
}

impl Corpus<'_> {
    pub(super) fn batch(&self, idx: &[usize], ttt: usize, max_len: usize) -> Result<Batch> {
        let (h, nl) = (self.h, self.nl);
        let t = idx
            .iter()
            .map(|&i| self.samples[i].tokens.len().min(max_len))
            .max()
            .unwrap_or(1);
        let b = idx.len();
        let mut feats = vec![0f32; b * t * nl * h];
        let mut fin_all = vec![0f32; b * t * h];
        let mut steps: Vec<StepData> = (0..ttt)
            .map(|_| StepData {
                ids: vec![0; b * t],
                fin_row: (0..(b * t) as u32).collect(),
                mask: vec![0.0; b * t],
                argmax: vec![-1; b * t],
            })
            .collect();
        let mut src = Vec::new();
        for (bi, &si) in idx.iter().enumerate() {
            let s = &self.samples[si];
            let len = s.tokens.len().min(max_len);
            let o = self.f.offsets[si];
            let r0 = bi * t;
            for (li, &l) in self.feature_layers.iter().enumerate() {
                src.clear();
                self.f.extend(l, o, len, &mut src)?;
                for r in 0..len {
                    let dst = (r0 + r) * nl * h + li * h;
                    feats[dst..dst + h].copy_from_slice(&src[r * h..(r + 1) * h]);
                }
            }
            self.f
                .rows(self.fin, o, &mut fin_all[r0 * h..(r0 + len) * h])?;
            for (k, sd) in steps.iter_mut().enumerate() {
                for p in 0..len {
                    // Row p at step k: token x_{p+1+k}; learns the target's
                    // distribution at position q = p+1+k (next token q+1).
                    let q = p + 1 + k;
                    if q >= len {
                        break;
                    }
                    sd.ids[r0 + p] = s.tokens[q];
                    sd.fin_row[r0 + p] = (r0 + q) as u32;
                    let am = self.t2d[self.f.argmax[o + q] as usize];
                    if q + 1 >= s.prompt_len && (am >= 0 || !self.drop_oov) {
                        sd.mask[r0 + p] = 1.0;
                        sd.argmax[r0 + p] = am;
                    }
                }
            }
        }
        Ok(Batch {
            b,
            t,
            feats,
            fin: fin_all,
            steps,
        })
    }
}

/// Training progress, next to each checkpoint.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EagleState {
    pub step: usize,
    pub steps: usize,
    pub loss: f32,
    /// Loss of this run's first step (a resumed run keeps its start's; a
    /// run from `--init` starts where that head stands).
    pub first_loss: f32,
    /// (step, validation acceptance@1 of TTT step 0, of the last step).
    pub val: Vec<(usize, f64, f64)>,
    /// Draft vocabulary coverage of response tokens.
    pub coverage: f64,
    pub config: EagleConfig,
}

fn lr_at(cfg: &EagleConfig, step: usize, steps: usize) -> f64 {
    cosine_lr(cfg.lr, cfg.warmup, step, steps)
}

fn export(
    out: &Path,
    net: &Net,
    shapes: &[(&'static str, Vec<usize>)],
    vocab_ids: &[u32],
    target: &Model,
    cfg: &EagleConfig,
    layers: &[usize],
) -> Result<PathBuf> {
    let tc = &target.config;
    // MTP: the module as the target's layer `num_hidden_layers`.
    let prefix = if cfg.mtp {
        format!("model.layers.{}.", tc.layers)
    } else {
        String::new()
    };
    let mut tensors = Vec::new();
    for (name, shape) in shapes {
        tensors.push((
            format!("{prefix}{name}"),
            shape.clone(),
            TensorData::F16(tensor_vec(net.w(name))?),
        ));
    }
    let d2t: Vec<i64> = vocab_ids
        .iter()
        .enumerate()
        .map(|(i, &t)| i64::from(t) - i as i64)
        .collect();
    let mut t2d = vec![false; tc.vocab_size];
    for &t in vocab_ids {
        t2d[t as usize] = true;
    }
    tensors.push(("d2t".into(), vec![vocab_ids.len()], TensorData::I64(d2t)));
    if !cfg.mtp {
        tensors.push(("t2d".into(), vec![tc.vocab_size], TensorData::Bool(t2d)));
    }
    let weights = out.join("model.safetensors");
    tensor_file::write(&weights, &tensors).map_err(serr)?;
    let config = if cfg.mtp {
        serde_json::json!({
            "architectures": ["SpecdMtpModule"],
            "hidden_size": tc.hidden,
            "num_attention_heads": net.nh,
            "num_key_value_heads": net.nkv,
            "head_dim": net.hd,
            "intermediate_size": cfg.intermediate,
            // The module is the layer after the target's last.
            "num_hidden_layers": tc.layers,
            "num_nextn_predict_layers": 1,
            "rms_norm_eps": EPS,
            "rope_theta": tc.rope_theta,
            "vocab_size": tc.vocab_size,
            "draft_vocab_size": vocab_ids.len(),
            "torch_dtype": "float16",
        })
    } else {
        serde_json::json!({
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": tc.hidden,
        "num_attention_heads": net.nh,
        "num_key_value_heads": net.nkv,
        "head_dim": net.hd,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": tc.rope_theta,
        "vocab_size": tc.vocab_size,
        "draft_vocab_size": vocab_ids.len(),
        "max_position_embeddings": tc.max_seq_len,
        "torch_dtype": "float16",
        // SGLang's convention (as SpecForge writes it): the layers whose
        // output is read, our hidden indices.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers},
        })
    };
    let mut config = config;
    if net.normed_residual {
        // Only where set: a standard EAGLE-3 head's config stays standard.
        // Such a head is specd's own: an architecture name no other
        // runtime knows, so none loads it as a standard head and drafts
        // with the wrong residual.
        config["specd_normed_residual"] = serde_json::Value::Bool(true);
        config["architectures"] = serde_json::json!(["SpecdEagle3NormedResidual"]);
    }
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap_or_default(),
    )?;
    Ok(weights)
}

/// Whether the head in `dir` was trained with `normed_residual` (its
/// config.json's `specd_normed_residual`; absent: no; not a bool: an error
/// naming the file, as `model::eagle::Head` refuses it).
fn saved_normed_residual(dir: &Path) -> Result<bool> {
    let path = dir.join("config.json");
    let Some(v) = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    else {
        return Ok(false);
    };
    crate::model::eagle::normed_residual_of(&v, &path).map_err(serr)
}

/// Read `dir`'s head for `--init`: an MTP module (`mtp`, names under the
/// target's next layer) or an EAGLE-3 head reading `layers`, for a target
/// shaped as `tc`.
fn read_init(
    dir: &Path,
    mtp: bool,
    normed_residual: bool,
    layers: &[usize],
    tc: &crate::model::ModelConfig,
) -> Result<InitHead> {
    let kind = if mtp { "mtp" } else { "eagle" };
    let prefix = if mtp {
        format!("model.layers.{}.", tc.layers)
    } else {
        String::new()
    };
    let init = InitHead::read(dir, kind, prefix, tc.vocab_size)?;
    if !mtp && saved_normed_residual(dir)? != normed_residual {
        return Err(serr(format!(
            "{}: the head was trained with{} the normed residual, this run {} (--normed-residual)",
            dir.join("config.json").display(),
            if normed_residual { "out" } else { "" },
            if normed_residual {
                "asks for it"
            } else {
                "does not"
            },
        )));
    }
    if !mtp {
        // The layers a head reads are in its config; another set would
        // train fc against the wrong features without any shape telling.
        let cfg_path = dir.join("config.json");
        let saved: Option<Vec<usize>> = std::fs::read_to_string(&cfg_path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| {
                serde_json::from_value(
                    v["eagle_config"]["eagle_aux_hidden_state_layer_ids"].clone(),
                )
                .ok()
            });
        match saved {
            Some(saved) if saved.as_slice() == layers => {}
            Some(saved) => {
                return Err(serr(format!(
                    "{}: the head reads layers {saved:?}, this run {layers:?} (--feature-layers)",
                    cfg_path.display()
                )))
            }
            None => {
                return Err(serr(format!(
                    "{}: no eagle_config.eagle_aux_hidden_state_layer_ids (the layers the head reads), so it cannot be continued safely",
                    cfg_path.display()
                )))
            }
        }
    }
    Ok(init)
}

/// Train (or resume training) an EAGLE-3 head for `target_path` into
/// `out`. Returns the final state.
pub fn distill_eagle(
    target_path: &Path,
    out: &Path,
    cfg: &EagleConfig,
    threads: usize,
) -> Result<EagleState> {
    super::train::keep_freed_memory();
    let train_dir = out.join("train");
    std::fs::create_dir_all(&train_dir)?;
    let target = Arc::new(crate::model::load_model(target_path, threads)?);
    let tok = Arc::new(Tokenizer::for_model(target_path)?);
    let tc = target.config.clone();
    let (h, vocab) = (tc.hidden, tc.vocab_size);
    let layers = if cfg.mtp {
        vec![tc.layers]
    } else if cfg.feature_layers.is_empty() {
        feature_layers(tc.layers)
    } else {
        cfg.feature_layers.clone()
    };
    if let Some(l) = layers.iter().find(|&&l| l > tc.layers) {
        return Err(serr(format!(
            "feature layer {l} is past the target's final state ({})",
            tc.layers
        )));
    }
    let nl = layers.len();
    // Recorded: the feature layers and the final-normed state.
    let mut recorded = layers.clone();
    if !recorded.contains(&tc.layers) {
        recorded.push(tc.layers);
    }
    // A start from a written head: read before the data, so a wrong
    // directory fails before the features are recorded.
    let init = match &cfg.init {
        Some(dir) => {
            let i = read_init(dir, cfg.mtp, cfg.normed_residual, &layers, &tc)?;
            // Every tensor this run trains, at this run's shapes (with
            // the head's draft vocabulary), before any data is made.
            let (dv, f) = (i.ids.len(), cfg.intermediate);
            let (nh, nkv, hd) = (tc.heads, tc.kv_heads, tc.head_dim);
            let shapes = if cfg.mtp {
                mtp_param_shapes(h, nh, nkv, hd, f, dv)
            } else {
                param_shapes(h, nh, nkv, hd, f, layers.len(), dv)
            };
            i.check(&shapes)?;
            Some(i)
        }
        None => None,
    };
    // A checkpoint resumes only the run that wrote it: on other data or
    // from another start its weights (and their draft vocabulary) would
    // continue on what they were not trained for.
    let ckpt = Checkpoint::new(&train_dir);
    let resumed: Option<(EagleState, TensorFile)> = ckpt.resume()?;
    if let Some((st, _)) = &resumed {
        let c = &st.config;
        super::train::check_resume(
            if cfg.mtp { "mtp" } else { "eagle" },
            &train_dir,
            (&c.corpus, &c.corpus_shards, &c.init),
            (&cfg.corpus, &cfg.corpus_shards, &cfg.init),
            init.as_ref(),
        )?;
        if c.normed_residual != cfg.normed_residual {
            let with = |b: bool| if b { "with" } else { "without" };
            return Err(serr(format!(
                "{} holds the checkpoint of a run {} --normed-residual, this run is {} it; give the same to resume it, or delete the directory to start over",
                train_dir.display(),
                with(c.normed_residual),
                with(cfg.normed_residual)
            )));
        }
    }
    let Prepared {
        samples,
        features,
        vocab:
            DraftVocab {
                ids: vocab_ids,
                t2d,
                coverage,
            },
        train_idx,
        val_idx,
    } = prepare(
        &target,
        &tok,
        &cfg.data_config(),
        &train_dir,
        cfg.max_len,
        &recorded,
        (cfg.draft_vocab, init.as_ref(), cfg.seed, cfg.val_fraction),
    )?;
    let dv = vocab_ids.len();
    // What this run trains with, as its state records it: under --init,
    // the head's draft vocabulary size, whatever --draft-vocab asked.
    let mut effective = cfg.clone();
    effective.draft_vocab = dv;
    let cfg = &effective;

    // Frozen target tensors.
    let dev = Device::Cpu;
    let emb = embedding_table(&target);
    let th = target_head_rows(&target, &vocab_ids);
    let (nh, nkv, hd) = (tc.heads, tc.kv_heads, tc.head_dim);
    let shapes = if cfg.mtp {
        mtp_param_shapes(h, nh, nkv, hd, cfg.intermediate, dv)
    } else {
        param_shapes(h, nh, nkv, hd, cfg.intermediate, nl, dv)
    };
    let (cos, sin) = rope_tables(cfg.max_len + cfg.ttt_steps + 1, hd, tc.rope_theta)?;

    // Parameters: fresh (fc reads the high layer as identity, lm_head and
    // norm start as the target's, so step 0 starts as a logit lens), or
    // from the checkpoint.
    let mut rng = Rng::new(cfg.seed ^ 0x5EED);
    let mut gauss = |n: usize, std: f32| super::train::gauss(&mut rng, n, std);
    // RMS of the features (all layers, the highest alone) for fc's unit
    // start; 1 where the start is not scaled.
    let (rms_all, rms_top) = if cfg.fc_unit && !cfg.mtp && init.is_none() && resumed.is_none() {
        let r = (
            feature_rms(&features, &layers, &train_idx, &samples)?,
            feature_rms(&features, &layers[nl - 1..], &train_idx, &samples)?,
        );
        eprintln!(
            "specd distill: feature RMS {:.3} (highest layer {:.3}); fc starts scaled to unit RMS",
            r.0, r.1
        );
        r
    } else {
        (1.0, 1.0)
    };
    // The shared projection of the self-focused attention start (kv rows
    // x h, entries of variance 1/h, times the gain).
    let self_proj: Vec<f32> = if cfg.self_attn_init > 0.0 && !cfg.mtp {
        gauss(nkv * hd * h, cfg.self_attn_init / (h as f32).sqrt())
    } else {
        Vec::new()
    };
    let mut p = HashMap::new();
    let mut opt = AdamW::new();
    for (name, shape) in &shapes {
        let n: usize = shape.iter().product();
        let init: Vec<f32> = if let Some((_, f)) = &resumed {
            ckpt.restore(f, name, shape, &mut opt)?
        } else if let Some(i) = &init {
            i.tensor(name, shape)?
        } else {
            match *name {
                // MTP: x = hnorm(f) at first (identity on the state's
                // half), so step 0 starts as a logit lens.
                "eh_proj.weight" if cfg.fc_identity => {
                    let mut w = gauss(n, 0.0005);
                    for r in 0..h {
                        w[r * 2 * h + h + r] += 1.0;
                    }
                    w
                }
                "eh_proj.weight" => gauss(n, (1.0 / (2 * h) as f64).sqrt() as f32),
                "shared_head.head.weight" => th.clone(),
                "self_attn.o_proj.weight" | "mlp.down_proj.weight" => gauss(n, cfg.out_std),
                "fc.weight" if cfg.fc_identity => {
                    let s = 1.0 / rms_top;
                    let mut w = gauss(n, 0.0005 * s);
                    // Identity on the last (highest) feature layer.
                    for r in 0..h {
                        w[r * nl * h + (nl - 1) * h + r] += s;
                    }
                    w
                }
                "fc.weight" => {
                    let s = 1.0 / rms_all;
                    gauss(n, (1.0 / (nl * h) as f64).sqrt() as f32 * s)
                }
                "lm_head.weight" => th.clone(),
                "norm.weight" => target.weights.norm.clone(),
                n2 if n2.ends_with("norm.weight") => vec![1.0; n],
                "midlayer.self_attn.o_proj.weight" | "midlayer.mlp.down_proj.weight" => {
                    gauss(n, cfg.out_std)
                }
                // Rows of q head i read the projection of its kv head
                // (i / group); columns 0..h are the token embedding's.
                "midlayer.self_attn.q_proj.weight" | "midlayer.self_attn.k_proj.weight"
                    if !self_proj.is_empty() =>
                {
                    let mut w = gauss(n, 0.02);
                    let rows = shape[0];
                    let group = if rows == nkv * hd { 1 } else { nh / nkv.max(1) };
                    for r in 0..rows {
                        let (head, i) = (r / hd, r % hd);
                        let src = ((head / group) * hd + i) * h;
                        w[r * 2 * h..r * 2 * h + h].copy_from_slice(&self_proj[src..src + h]);
                    }
                    w
                }
                _ => gauss(n, 0.02),
            }
        };
        p.insert(*name, var(init, shape)?);
    }
    let net = Net {
        p,
        embed: Tensor::from_vec(emb, (vocab, h), &dev).map_err(cerr)?,
        target_head: Tensor::from_vec(th, (dv, h), &dev).map_err(cerr)?,
        cos,
        sin,
        h,
        nh,
        nkv,
        hd,
        mtp: cfg.mtp,
        normed_residual: cfg.normed_residual && !cfg.mtp,
    };
    let corpus = Corpus {
        samples: &samples,
        f: &features,
        feature_layers: layers.clone(),
        fin: tc.layers,
        t2d: t2d.clone(),
        h,
        nl,
        drop_oov: cfg.drop_oov,
    };
    // Validation counts every response position, whatever the recipe.
    let val_corpus = Corpus {
        samples: &samples,
        f: &features,
        feature_layers: layers.clone(),
        fin: tc.layers,
        t2d,
        h,
        nl,
        drop_oov: false,
    };
    let mut sched = Schedule::new(
        &samples,
        &train_idx,
        cfg.batch_tokens,
        cfg.max_len,
        cfg.seed,
        cfg.epochs,
        cfg.stop_after,
    );
    let steps = sched.steps;
    let mut state = match resumed {
        Some((st, _)) => {
            opt.t = st.step;
            eprintln!(
                "specd distill: resuming at step {} of {steps} (loss {:.3})",
                st.step, st.loss
            );
            EagleState {
                steps,
                coverage,
                config: cfg.clone(),
                ..st
            }
        }
        None => EagleState {
            step: 0,
            steps,
            loss: f32::NAN,
            first_loss: f32::NAN,
            val: Vec::new(),
            coverage,
            config: cfg.clone(),
        },
    };
    let validate = |net: &Net| -> Result<(f64, f64)> {
        let (mut first, mut last) = ((0.0, 0.0), (0.0, 0.0));
        for b in plan_batches(&samples, &val_idx, cfg.batch_tokens, cfg.max_len, 1) {
            let (_, st) = net
                .forward(&val_corpus.batch(&b, cfg.ttt_steps, cfg.max_len)?)
                .map_err(cerr)?;
            first.0 += st[0].0;
            first.1 += st[0].1;
            if let Some(l) = st.last() {
                last.0 += l.0;
                last.1 += l.1;
            }
        }
        Ok((
            first.0 / f64::max(first.1, 1.0),
            last.0 / f64::max(last.1, 1.0),
        ))
    };
    let save = |net: &Net, opt: &AdamW, state: &EagleState| -> Result<()> {
        ckpt.save(&shapes, |n| net.w(n), opt, state)?;
        export(out, net, &shapes, &vocab_ids, &target, cfg, &layers)?;
        Ok(())
    };
    if state.val.is_empty() && !val_idx.is_empty() {
        let (a0, ak) = validate(&net)?;
        eprintln!("specd distill: before training, validation acceptance@1 {a0:.3} (TTT step {}: {ak:.3})", cfg.ttt_steps - 1);
        state.val.push((0, a0, ak));
    }
    let (mut hits, mut counted) = (0.0, 0.0);
    while state.step < sched.limit {
        let step = state.step;
        let batch = corpus.batch(sched.batch(step), cfg.ttt_steps, cfg.max_len)?;
        let (loss, st) = net.forward(&batch).map_err(cerr)?;
        let grads = loss.backward().map_err(cerr)?;
        opt.step(
            net.p.iter().map(|(k, v)| (*k, v)),
            &grads,
            lr_at(cfg, step, steps),
            cfg.clip,
        )
        .map_err(cerr)?;
        let l = loss.to_scalar::<f32>().map_err(cerr)?;
        if state.first_loss.is_nan() {
            state.first_loss = l;
        }
        state.loss = l;
        state.step += 1;
        hits = 0.9 * hits + st[0].0;
        counted = 0.9 * counted + st[0].1;
        let val = state.val.last().map_or(0.0, |v| v.1);
        let msg = format!(
            "loss {l:.3}  train acc@1 {:.3}  val acc@1 {val:.3}",
            hits / f64::max(counted, 1.0)
        );
        if sched.done(state.step, cfg.checkpoint_every, msg) {
            if !val_idx.is_empty() {
                let (a0, ak) = validate(&net)?;
                state.val.push((state.step, a0, ak));
            }
            save(&net, &opt, &state)?;
        }
    }
    sched.finish(state.step);
    if !out.join("model.safetensors").exists() {
        save(&net, &opt, &state)?;
    }
    let sha = crate::fetch::sha256_file(&out.join("model.safetensors"))?;
    let last = state.val.last().copied().unwrap_or((0, f64::NAN, f64::NAN));
    eprintln!(
        "specd distill: {}/{} steps, loss {:.3} (first {:.3}), validation acceptance@1 {:.3} (TTT step {}: {:.3}); head in {} (model.safetensors sha256 {sha})",
        state.step, steps, state.loss, state.first_loss, last.1, cfg.ttt_steps - 1, last.2, out.display()
    );
    Ok(state)
}

/// One measurement of the trainer's step (`benches/train_step.rs`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepBench {
    /// Rows per step (`b * t`) times TTT steps.
    pub token_steps: usize,
    /// Median seconds of one training step (forward, backward, AdamW).
    pub seconds: f64,
    /// Token-steps per second.
    pub rate: f64,
    /// Matmul work of a step (forward 2, backward 4 FLOPs per trainable
    /// weight and row, the frozen target head's 2) over its time, GFLOP/s.
    pub gflops: f64,
    /// The loss of each timed step, so a faster graph can be checked to
    /// train alike.
    pub losses: Vec<f32>,
}

/// Shapes of a randomly initialised head (`bench_train_step`, tests).
#[derive(Clone, Copy)]
struct RandomDims {
    h: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    f: usize,
    dv: usize,
    vocab: usize,
    ttt: usize,
    mtp: bool,
}

/// A head on seeded random weights and a batch of `b` random rows of `t`
/// tokens, every row in the loss.
#[allow(clippy::type_complexity)]
fn random_net(
    d: &RandomDims,
    b: usize,
    t: usize,
) -> Result<(Net, Batch, Vec<(&'static str, Vec<usize>)>)> {
    let RandomDims {
        h,
        nh,
        nkv,
        hd,
        f,
        dv,
        vocab,
        ttt,
        mtp,
    } = *d;
    let nl = if mtp { 1 } else { 3 };
    let dev = Device::Cpu;
    let mut rng = Rng::new(11);
    let mut gauss = |n: usize, std: f32| super::train::gauss(&mut rng, n, std);
    let shapes = if mtp {
        mtp_param_shapes(h, nh, nkv, hd, f, dv)
    } else {
        param_shapes(h, nh, nkv, hd, f, nl, dv)
    };
    let mut p = HashMap::new();
    for (name, shape) in &shapes {
        let n: usize = shape.iter().product();
        let init = if name.ends_with("norm.weight") {
            vec![1.0; n]
        } else {
            gauss(n, 0.05)
        };
        p.insert(*name, var(init, shape)?);
    }
    let (cos, sin) = rope_tables(t + ttt + 1, hd, 10_000.0)?;
    let net = Net {
        p,
        embed: Tensor::from_vec(gauss(vocab * h, 0.05), (vocab, h), &dev).map_err(cerr)?,
        target_head: Tensor::from_vec(gauss(dv * h, 0.05), (dv, h), &dev).map_err(cerr)?,
        cos,
        sin,
        h,
        nh,
        nkv,
        hd,
        mtp,
        normed_residual: false,
    };
    let mut tok_rng = Rng::new(12);
    // Every row in the loss, learning the distribution k + 1 positions on
    // (the last k + 1 rows of each sequence learn their own).
    let batch = Batch {
        b,
        t,
        feats: gauss(b * t * nl * h, 1.0),
        fin: gauss(b * t * h, 1.0),
        steps: (0..ttt)
            .map(|k| StepData {
                ids: (0..b * t)
                    .map(|_| (tok_rng.next_f64() * vocab as f64) as u32 % vocab as u32)
                    .collect(),
                fin_row: (0..b * t)
                    .map(|r| if r % t + 1 + k < t { r + 1 + k } else { r } as u32)
                    .collect(),
                mask: vec![1.0; b * t],
                argmax: (0..b * t)
                    .map(|_| (tok_rng.next_f64() * dv as f64) as i64 % dv as i64)
                    .collect(),
            })
            .collect(),
    };
    Ok((net, batch, shapes))
}

/// Times `steps` training steps (after one warm-up) of a head with
/// SmolLM2-135M's shapes (hidden 576, 9 heads, 3 kv heads, vocabulary
/// 49,152) and the default recipe's (draft vocabulary 4,096, MLP 1,024,
/// TTT 4), on seeded random weights, features and tokens: `b` rows of `t`
/// tokens, every position in the loss. The same seed gives the same
/// numbers, so two builds' losses can be compared step for step.
pub fn bench_train_step(mtp: bool, b: usize, t: usize, steps: usize) -> Result<StepBench> {
    super::train::keep_freed_memory();
    let dims = RandomDims {
        h: 576,
        nh: 9,
        nkv: 3,
        hd: 64,
        f: 1024,
        dv: 4096,
        vocab: 49_152,
        ttt: 4,
        mtp,
    };
    let (h, dv, ttt) = (dims.h, dims.dv, dims.ttt);
    let (net, batch, shapes) = random_net(&dims, b, t)?;
    let mut opt = AdamW::new();
    let mut times = Vec::new();
    let mut losses = Vec::new();
    for i in 0..=steps {
        let t0 = std::time::Instant::now();
        let (loss, _) = net.forward(&batch).map_err(cerr)?;
        let grads = loss.backward().map_err(cerr)?;
        opt.step(net.p.iter().map(|(k, v)| (*k, v)), &grads, 1e-3, 1.0)
            .map_err(cerr)?;
        let l = loss.to_scalar::<f32>().map_err(cerr)?;
        if i > 0 {
            times.push(t0.elapsed().as_secs_f64());
            losses.push(l);
        }
    }
    times.sort_by(f64::total_cmp);
    let seconds = times[times.len() / 2];
    let weights: usize = shapes
        .iter()
        .filter(|(n, _)| !n.ends_with("norm.weight"))
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let rows = b * t * ttt;
    // fc runs once per batch, the target's head once per position.
    let fc = if mtp { 0 } else { 3 * h * h };
    let flops = rows as f64 * 6.0 * (weights - fc) as f64
        + (b * t) as f64 * (6.0 * fc as f64 + 2.0 * (dv * h) as f64);
    Ok(StepBench {
        token_steps: rows,
        seconds,
        rate: rows as f64 / seconds,
        gflops: flops / seconds / 1e9,
        losses,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every trainable tensor of both graphs gets a gradient from the loss
    /// (the attention's query and key projections had none while the
    /// attention softmax was an op without a backward pass), and one
    /// AdamW step lowers the loss on the same batch.
    #[test]
    fn every_parameter_learns_from_the_unrolled_loss() {
        for mtp in [false, true] {
            let dims = RandomDims {
                h: 32,
                nh: 4,
                nkv: 2,
                hd: 8,
                f: 48,
                dv: 64,
                vocab: 300,
                ttt: 3,
                mtp,
            };
            let (net, batch, shapes) = random_net(&dims, 2, 9).unwrap();
            let (loss, _) = net.forward(&batch).unwrap();
            let grads = loss.backward().unwrap();
            for (name, _) in &shapes {
                let g = grads
                    .get(net.w(name))
                    .unwrap_or_else(|| panic!("mtp {mtp}: no gradient for {name}"));
                let norm = g
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(norm > 0.0, "mtp {mtp}: zero gradient for {name}");
            }
            let mut opt = AdamW::new();
            opt.step(net.p.iter().map(|(k, v)| (*k, v)), &grads, 1e-3, 1.0)
                .unwrap();
            let (after, _) = net.forward(&batch).unwrap();
            let (l0, l1) = (
                loss.to_scalar::<f32>().unwrap(),
                after.to_scalar::<f32>().unwrap(),
            );
            assert!(l1 < l0, "mtp {mtp}: loss {l0} -> {l1}");
        }
    }
}
