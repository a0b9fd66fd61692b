//! The DFlash block drafter (Chen et al. 2026, z-lab/dflash): one forward of
//! a few Qwen3-style layers turns a block `[bonus, mask, ..., mask]` of
//! `block_size` rows into draft distributions for every mask slot at once.
//!
//! The target's hidden states of `target_layer_ids` (the outputs of those
//! 0-based decoder layers, concatenated in list order) are fused once per
//! committed position, `c = hidden_norm(fc(features))`, and injected into
//! every layer as keys and values: layer `l` caches
//! `k = rope(k_norm(k_proj_l(c)))` and `v = v_proj_l(c)` at the position's
//! own index. A block row `j` (position `start + j`, `start` the bonus
//! token's) runs the pre-norm layer `h += o(Attn(input_layernorm(h)))`,
//! `h += mlp(post_attention_layernorm(h))` with QK-norm and rope, attending
//! to every cached context row and to all rows of its own block (no causal
//! mask inside the block). `norm(h)` at slot `j >= 1` goes through the
//! output head (the target's, or a draft-vocabulary `lm_head` with `d2t`)
//! to predict the token at position `start + j`.
//!
//! Checkpoints: z-lab's Hugging Face layout (config.json with
//! `block_size` at the top or in `dflash_config`, `dflash_config.
//! mask_token_id` and `target_layer_ids`; tensors `fc.weight`,
//! `hidden_norm.weight`, `layers.{i}.{input_layernorm, post_attention_
//! layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,
//! down}_proj}.weight`, `norm.weight`), with or without vLLM's `model.`
//! prefix (NVIDIA Model-Optimizer exports the same names). Two optional
//! tensors beside them: `lm_head.weight` over `draft_vocab_size` rows with
//! `d2t` (EAGLE-3's draft-vocabulary convention, as vLLM and llama.cpp
//! accept), and `mask_embedding` (the block's mask row; vLLM reads it from
//! `mask_embedding.pt`; without it the target's embedding of
//! `mask_token_id` is used).
//!
//! Invariants: every load error names the file, the tensor and the expected
//! shape; a drafter whose hidden size, vocabulary or layers do not fit the
//! target, or that needs what is not implemented (sliding-window layers,
//! attention biases), is refused; a row's outputs do not depend on the other blocks of
//! the same call (each block attends only to its own context and rows).

use std::path::Path;

use super::eagle::{
    cfg_usize, checkpoint_from_bytes, dot, head_rope_scaling, read_checkpoint, read_d2t, KvStore,
    Tensors,
};
use super::kernels::{matmul_many, rms_norm, silu_mul, wants_q8, Activations, KernelPath};
use super::{QMatrix, RopeScaling};

#[derive(Debug, Clone)]
pub struct DflashConfig {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    /// Rows of a block: the bonus token and `block_size - 1` masks.
    pub block_size: usize,
    pub mask_token: u32,
    /// The checkpoint's `target_layer_ids` (0-based decoder layers whose
    /// outputs are read).
    pub target_layer_ids: Vec<usize>,
    /// The same as specd hidden indices (the residual stream entering
    /// layer `id + 1`), what the plugin asks the host for.
    pub feature_layers: Vec<usize>,
    /// Rows of the output layer: the draft vocabulary with `lm_head`, else
    /// the target's.
    pub draft_vocab: usize,
}

impl DflashConfig {
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// One draft layer's weights.
#[derive(Debug)]
pub struct Layer {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub wq: QMatrix,
    pub wk: QMatrix,
    pub wv: QMatrix,
    pub wo: QMatrix,
    pub gate: QMatrix,
    pub up: QMatrix,
    pub down: QMatrix,
}

/// A DFlash drafter.
#[derive(Debug)]
pub struct Dflash {
    pub cfg: DflashConfig,
    pub fc: QMatrix,
    pub hidden_norm: Vec<f32>,
    pub layers: Vec<Layer>,
    pub norm: Vec<f32>,
    /// Over the draft vocabulary; `None`: the target's output head.
    pub lm_head: Option<QMatrix>,
    /// Draft id -> target id.
    pub d2t: Vec<u32>,
    /// The mask rows' input (`None`: the target's embedding of
    /// `mask_token`).
    pub mask_embedding: Option<Vec<f32>>,
    freqs: Vec<f32>,
    mscale: f32,
    path: KernelPath,
}

/// z-lab's `build_target_layer_ids`: the layers a drafter of `draft_layers`
/// layers reads from an `n`-layer target when its config does not say.
pub fn default_target_layer_ids(n: usize, draft_layers: usize) -> Vec<usize> {
    if draft_layers <= 1 {
        return vec![n / 2];
    }
    let (start, end) = (1.0f64, n as f64 - 3.0);
    (0..draft_layers)
        .map(|i| {
            (start + i as f64 * (end - start) / (draft_layers - 1) as f64).round_ties_even()
                as usize
        })
        .collect()
}

/// The names a tensor may carry: z-lab's, vLLM's (`model.`) and
/// Model-Optimizer's in-training one (`dflash_module.`).
fn names(n: &str) -> [String; 3] {
    [
        n.to_string(),
        format!("model.{n}"),
        format!("dflash_module.{n}"),
    ]
}

impl Dflash {
    /// Load a drafter from `dir` (config.json and one safetensors file) for
    /// a target with `target_hidden`, `target_vocab` and `target_layers`.
    pub fn load(
        dir: &Path,
        target_hidden: usize,
        target_vocab: usize,
        target_layers: usize,
    ) -> Result<Dflash, String> {
        Self::load_with(dir, target_hidden, target_vocab, target_layers, true)
    }

    /// As `load`; `quantize: false` keeps every matrix in f32.
    pub fn load_with(
        dir: &Path,
        target_hidden: usize,
        target_vocab: usize,
        target_layers: usize,
        quantize: bool,
    ) -> Result<Dflash, String> {
        let (cj, cfg_path, weights, t) = read_checkpoint(dir, &["model.safetensors"], quantize)?;
        Self::build(
            &cj,
            &cfg_path,
            &weights,
            &t,
            target_hidden,
            target_vocab,
            target_layers,
        )
    }

    /// A drafter from in-memory config text and safetensors bytes (`label`
    /// names them in errors).
    pub fn from_bytes(
        label: &str,
        config: &str,
        weights: &[u8],
        target_hidden: usize,
        target_vocab: usize,
        target_layers: usize,
    ) -> Result<Dflash, String> {
        let (cj, cfg_path, wpath, t) = checkpoint_from_bytes(label, config, weights)?;
        Self::build(
            &cj,
            &cfg_path,
            &wpath,
            &t,
            target_hidden,
            target_vocab,
            target_layers,
        )
    }

    fn build(
        cj: &serde_json::Value,
        cfg_path: &Path,
        weights: &Path,
        t: &Tensors,
        target_hidden: usize,
        target_vocab: usize,
        target_layers: usize,
    ) -> Result<Dflash, String> {
        let file = cfg_path.display();
        let hidden = cfg_usize(cj, "hidden_size", cfg_path)?;
        let heads = cfg_usize(cj, "num_attention_heads", cfg_path)?;
        let layers = cfg_usize(cj, "num_hidden_layers", cfg_path)?;
        let kv_heads = cj
            .get("num_key_value_heads")
            .and_then(|v| v.as_u64())
            .map_or(heads, |v| v as usize);
        let head_dim = cj
            .get("head_dim")
            .and_then(|v| v.as_u64())
            .map_or(hidden / heads.max(1), |v| v as usize);
        let intermediate = cfg_usize(cj, "intermediate_size", cfg_path)?;
        if heads == 0
            || kv_heads == 0
            || !heads.is_multiple_of(kv_heads)
            || !head_dim.is_multiple_of(2)
        {
            return Err(format!(
                "{file}: {heads} attention heads over {kv_heads} key-value heads of width {head_dim}: \
                 heads must be a multiple of key-value heads and the width even"
            ));
        }
        if layers == 0 {
            return Err(format!("{file}: num_hidden_layers must be at least 1"));
        }
        if hidden != target_hidden {
            return Err(format!(
                "{file}: hidden_size {hidden} does not match the target's {target_hidden}"
            ));
        }
        if let Some(kinds) = cj.get("layer_types").and_then(|v| v.as_array()) {
            if let Some(k) = kinds.iter().find(|k| k.as_str() != Some("full_attention")) {
                return Err(format!(
                    "{file}: layer_types: {k} layers are not supported (only full_attention)"
                ));
            }
        }
        if cj.get("attention_bias").and_then(|v| v.as_bool()) == Some(true) {
            return Err(format!(
                "{file}: attention_bias: drafters with attention biases are not supported"
            ));
        }
        let dc = cj.get("dflash_config");
        let field = |k: &str| dc.and_then(|d| d.get(k)).or_else(|| cj.get(k));
        let block_size = field("block_size")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| format!("{file}: missing integer `block_size`"))?
            as usize;
        if !(2..=64).contains(&block_size) {
            return Err(format!(
                "{file}: block_size {block_size}: expected 2 to 64 (the bonus token and at least one mask)"
            ));
        }
        let mask_token = field("mask_token_id")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| format!("{file}: missing integer `dflash_config.mask_token_id`"))?
            as usize;
        if mask_token >= target_vocab {
            return Err(format!(
                "{file}: mask_token_id {mask_token} is outside the target's vocabulary of {target_vocab}"
            ));
        }
        let target_layer_ids: Vec<usize> = match field("target_layer_ids") {
            Some(v) => v
                .as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|x| x.as_u64().map(|x| x as usize))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| {
                    format!("{file}: `target_layer_ids` must be a list of layer indices")
                })?,
            None => default_target_layer_ids(
                cj.get("num_target_layers")
                    .and_then(|v| v.as_u64())
                    .map_or(target_layers, |v| v as usize),
                layers,
            ),
        };
        if target_layer_ids.is_empty() {
            return Err(format!("{file}: `target_layer_ids` is empty"));
        }
        // Our hidden index `l` is the residual stream entering layer `l`
        // (the output of layer `l - 1`); index L, the last layer's output,
        // is the final-normed state, as Hugging Face's last hidden state.
        for &id in &target_layer_ids {
            if id >= target_layers {
                return Err(format!(
                    "{file}: target_layer_ids: layer {id} is not available from a {target_layers}-layer target \
                     (outputs of layers 0 to {} can be read)",
                    target_layers.saturating_sub(1)
                ));
            }
        }
        let feature_layers: Vec<usize> = target_layer_ids.iter().map(|&i| i + 1).collect();
        let rms_eps = cj
            .get("rms_norm_eps")
            .and_then(|v| v.as_f64())
            .unwrap_or(1e-6) as f32;
        let rope_theta = cj.get("rope_theta").and_then(|v| v.as_f64()).unwrap_or(1e6) as f32;
        let rope_scaling = head_rope_scaling(cj, cfg_path)?;
        let (qd, kvd) = (heads * head_dim, kv_heads * head_dim);
        let n = |s: &str| names(s);
        let get = |s: &str, shape: &[usize]| -> Result<Vec<f32>, String> {
            let v = n(s);
            t.get(&[&v[0], &v[1], &v[2]], shape)
        };
        let mat = |s: &str, rows: usize, cols: usize| -> Result<QMatrix, String> {
            let v = n(s);
            t.matrix(&[&v[0], &v[1], &v[2]], rows, cols)
        };
        let nf = target_layer_ids.len();
        let fc = mat("fc.weight", hidden, nf * target_hidden)?;
        let hidden_norm = get("hidden_norm.weight", &[hidden])?;
        let mut ls = Vec::with_capacity(layers);
        for i in 0..layers {
            let p = |s: &str| format!("layers.{i}.{s}");
            ls.push(Layer {
                input_norm: get(&p("input_layernorm.weight"), &[hidden])?,
                post_norm: get(&p("post_attention_layernorm.weight"), &[hidden])?,
                q_norm: get(&p("self_attn.q_norm.weight"), &[head_dim])?,
                k_norm: get(&p("self_attn.k_norm.weight"), &[head_dim])?,
                wq: mat(&p("self_attn.q_proj.weight"), qd, hidden)?,
                wk: mat(&p("self_attn.k_proj.weight"), kvd, hidden)?,
                wv: mat(&p("self_attn.v_proj.weight"), kvd, hidden)?,
                wo: mat(&p("self_attn.o_proj.weight"), hidden, qd)?,
                gate: mat(&p("mlp.gate_proj.weight"), intermediate, hidden)?,
                up: mat(&p("mlp.up_proj.weight"), intermediate, hidden)?,
                down: mat(&p("mlp.down_proj.weight"), hidden, intermediate)?,
            });
        }
        let norm = get("norm.weight", &[hidden])?;
        let has = |s: &str| n(s).iter().any(|x| t.has(x));
        let (lm_head, draft_vocab) = if has("lm_head.weight") {
            let dv = cj
                .get("draft_vocab_size")
                .and_then(|v| v.as_u64())
                .map_or(target_vocab, |v| v as usize);
            (Some(mat("lm_head.weight", dv, hidden)?), dv)
        } else {
            (None, target_vocab)
        };
        let d2t = read_d2t(t, weights, draft_vocab, target_vocab)?;
        let mask_embedding = if has("mask_embedding") {
            Some(get("mask_embedding", &[hidden])?)
        } else {
            None
        };
        let cfg = DflashConfig {
            hidden,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            layers,
            rms_eps,
            rope_theta,
            rope_scaling,
            block_size,
            mask_token: mask_token as u32,
            target_layer_ids,
            feature_layers,
            draft_vocab,
        };
        Ok(Self::new(
            cfg,
            fc,
            hidden_norm,
            ls,
            norm,
            lm_head,
            d2t,
            mask_embedding,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: DflashConfig,
        fc: QMatrix,
        hidden_norm: Vec<f32>,
        layers: Vec<Layer>,
        norm: Vec<f32>,
        lm_head: Option<QMatrix>,
        d2t: Vec<u32>,
        mask_embedding: Option<Vec<f32>>,
    ) -> Dflash {
        // `head_rope_scaling` admits only kinds that cannot fail here.
        let (freqs, mscale) =
            super::llama::rope_frequencies(cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling)
                .unwrap_or_else(|_| {
                    super::llama::rope_frequencies(cfg.head_dim, cfg.rope_theta, &RopeScaling::None)
                        .unwrap_or_default()
                });
        Dflash {
            cfg,
            fc,
            hidden_norm,
            layers,
            norm,
            lm_head,
            d2t,
            mask_embedding,
            freqs,
            mscale,
            path: KernelPath::best(),
        }
    }

    /// Bytes of weights one block forward reads (the context fusion and
    /// the target's head excluded).
    pub fn step_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down])
            .map(|m| m.size_bytes())
            .sum::<usize>()
            + self.lm_head.as_ref().map_or(0, |m| m.size_bytes())
    }

    fn matmul(&self, x: &[f32], rows: usize, w: &QMatrix) -> Vec<f32> {
        let mut act = Activations::new(self.path);
        act.prepare(x, rows, w.cols, wants_q8(w));
        let mut out = Vec::new();
        matmul_many(&act, &[w], &mut [&mut out]);
        out
    }

    /// Rotate every head of `x` (one row) to position `pos` (Hugging Face
    /// pairing `(i, i + d/2)`).
    fn rope(&self, x: &mut [f32], pos: usize) {
        let half = self.cfg.head_dim / 2;
        let (sin, cos): (Vec<f32>, Vec<f32>) = self.freqs[..half]
            .iter()
            .map(|f| {
                let (s, c) = (pos as f32 * f).sin_cos();
                (s * self.mscale, c * self.mscale)
            })
            .unzip();
        for head in x.chunks_exact_mut(self.cfg.head_dim) {
            for i in 0..half {
                let (c, s) = (cos[i], sin[i]);
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c - b * s;
                head[i + half] = b * c + a * s;
            }
        }
    }

    /// QK-norm: RMS norm over each head of `x` with weight `w`.
    fn head_norm(&self, x: &mut [f32], w: &[f32]) {
        let mut out = vec![0f32; x.len()];
        rms_norm(x, w, self.cfg.rms_eps, &mut out);
        x.copy_from_slice(&out);
    }

    /// The fused context rows of target features (`rows x (layers * h)`,
    /// in `target_layer_ids` order): `hidden_norm(fc(features))`.
    pub fn fuse(&self, features: &[f32], rows: usize) -> Vec<f32> {
        let g = self.matmul(features, rows, &self.fc);
        let mut c = vec![0f32; g.len()];
        rms_norm(&g, &self.hidden_norm, self.cfg.rms_eps, &mut c);
        c
    }

    /// Each layer's cache rows (keys and values) for committed positions
    /// `pos` with target `features`: one store per layer.
    pub fn context(&self, features: &[f32], pos: &[usize]) -> Vec<KvStore> {
        let rows = pos.len();
        let kvd = self.cfg.kv_dim();
        if rows == 0 {
            return (0..self.layers.len()).map(|_| KvStore::new(kvd)).collect();
        }
        let c = self.fuse(features, rows);
        let mut act = Activations::new(self.path);
        let mut out = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            act.prepare(&c, rows, self.cfg.hidden, wants_q8(&l.wk));
            let (mut k, mut v) = (Vec::new(), Vec::new());
            matmul_many(&act, &[&l.wk, &l.wv], &mut [&mut k, &mut v]);
            self.head_norm(&mut k, &l.k_norm);
            for r in 0..rows {
                self.rope(&mut k[r * kvd..(r + 1) * kvd], pos[r]);
            }
            out.push(KvStore { k, v, dim: kvd });
        }
        out
    }

    /// The block forward over `starts.len()` blocks of `block_size` rows
    /// each (`e`: their input rows, the bonus token's embedding then the
    /// mask rows); block `b` sits at positions `starts[b]..` and attends to
    /// every row of `ctx[b]` (its per-layer context stores) and of itself.
    /// Returns the final-normed outputs, `starts.len() * block_size x h`.
    pub fn block(&self, ctx: &[&[KvStore]], e: &[f32], starts: &[usize]) -> Vec<f32> {
        let c = &self.cfg;
        let (h, bs, hd) = (c.hidden, c.block_size, c.head_dim);
        let rows = starts.len() * bs;
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let group = c.heads / c.kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut x = e.to_vec();
        let mut xn = vec![0f32; rows * h];
        let mut scores: Vec<f32> = Vec::new();
        for (li, l) in self.layers.iter().enumerate() {
            rms_norm(&x, &l.input_norm, c.rms_eps, &mut xn);
            let mut act = Activations::new(self.path);
            act.prepare(&xn, rows, h, wants_q8(&l.wq));
            let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
            matmul_many(&act, &[&l.wq, &l.wk, &l.wv], &mut [&mut q, &mut k, &mut v]);
            self.head_norm(&mut q, &l.q_norm);
            self.head_norm(&mut k, &l.k_norm);
            for r in 0..rows {
                let pos = starts[r / bs] + r % bs;
                self.rope(&mut q[r * qd..(r + 1) * qd], pos);
                self.rope(&mut k[r * kvd..(r + 1) * kvd], pos);
            }
            let own = KvStore { k, v, dim: kvd };
            let mut attn = vec![0f32; rows * qd];
            for (b, store) in ctx.iter().enumerate() {
                let cs = &store[li];
                let n_ctx = cs.len();
                for j in 0..bs {
                    let r = b * bs + j;
                    for head in 0..c.heads {
                        let kvh = head / group;
                        let qv = &q[r * qd + head * hd..r * qd + (head + 1) * hd];
                        scores.clear();
                        scores.extend((0..n_ctx).map(|i| dot(qv, cs.key(i, kvh, hd)) * scale));
                        scores.extend(
                            (b * bs..(b + 1) * bs).map(|i| dot(qv, own.key(i, kvh, hd)) * scale),
                        );
                        let (_, sum) = super::kernels::exp_shifted(&mut scores);
                        let inv = 1.0 / sum;
                        let out = &mut attn[r * qd + head * hd..r * qd + (head + 1) * hd];
                        let vals = (0..n_ctx)
                            .map(|i| cs.value(i, kvh, hd))
                            .chain((b * bs..(b + 1) * bs).map(|i| own.value(i, kvh, hd)));
                        for (vv, &p) in vals.zip(&scores) {
                            let w = p * inv;
                            for (o, &xv) in out.iter_mut().zip(vv) {
                                *o = w.mul_add(xv, *o);
                            }
                        }
                    }
                }
            }
            let o = self.matmul(&attn, rows, &l.wo);
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            rms_norm(&x, &l.post_norm, c.rms_eps, &mut xn);
            let mut act = Activations::new(self.path);
            act.prepare(&xn, rows, h, wants_q8(&l.gate));
            let (mut gt, mut up) = (Vec::new(), Vec::new());
            matmul_many(&act, &[&l.gate, &l.up], &mut [&mut gt, &mut up]);
            silu_mul(&mut gt, &up);
            let d = self.matmul(&gt, rows, &l.down);
            for (a, b) in x.iter_mut().zip(&d) {
                *a += b;
            }
        }
        rms_norm(&x, &self.norm, c.rms_eps, &mut xn);
        xn
    }

    /// Draft-vocabulary logits of final-normed rows (`None`: the drafter has
    /// no head of its own; the target's reads the rows).
    pub fn logits(&self, yn: &[f32], rows: usize) -> Option<Vec<f32>> {
        let head = self.lm_head.as_ref()?;
        Some(self.matmul(yn, rows, head))
    }

    /// Draft id -> target id.
    pub fn to_target(&self, id: u32) -> u32 {
        self.d2t.get(id as usize).copied().unwrap_or(id)
    }
}
