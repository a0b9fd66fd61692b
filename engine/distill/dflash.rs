//! `specd distill dflash`: train a DFlash block drafter (`model::dflash`)
//! for a target from the target's own outputs, written in z-lab's layout
//! with a draft vocabulary (`lm_head`, `d2t`) and a learned mask row
//! (`mask_embedding`).
//!
//! The objective (DFlash's, as SpecForge and Model-Optimizer train it):
//! random anchors `p` in each sample's response; the block `[x_p, mask,
//! ..., mask]` at positions `p..p+B-1` attends to the fused target features
//! of positions `0..p` (strictly before the anchor, as at inference) and
//! to all of its own rows; slot `k >= 1` learns the target's distribution
//! of the token at `p + k` (its logits at `p + k - 1`, on the draft
//! vocabulary: logit distillation), weighted `exp(-(k - 1) / gamma)`. Every
//! anchor of a sample shares one pass over its context.
//!
//! Invariants: the graph is `Dflash::block` over `Dflash::context` (a test
//! compares their logits on an exported drafter); checkpoints resume the
//! same step sequence (`train::Checkpoint`, `train::Schedule`); anchors
//! are drawn from a seed of the step, so a resumed run sees the same
//! batches.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var, D};

use super::eagle::{embedding_table, lin, rms, rope_tables, EPS};
use super::fused::{Rope, SoftCrossEntropy};
use super::train::{
    cosine_lr, plan_batches, prepare, target_head_rows, tensor_vec, var, AdamW, Checkpoint,
    DraftVocab, Features, InitHead, Prepared, Schedule,
};
use super::{DataConfig, Sample};
use crate::error::{Result, SpecdError};
use crate::model::eagle::feature_layers;
use crate::model::tensor_file::{self, TensorData};
use crate::model::Model;
use crate::sampler::Rng;
use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct DflashTrainConfig {
    /// Draft layers.
    pub layers: usize,
    /// MLP width of each draft layer.
    pub intermediate: usize,
    /// Rows of a block (the anchor token and `block_size - 1` masks).
    pub block_size: usize,
    /// 0-based target layers whose outputs are fused (empty: those EAGLE-3
    /// reads, so a `distill eagle` run's recorded features serve).
    pub target_layer_ids: Vec<usize>,
    /// Rows of the output layer (most frequent response tokens).
    pub draft_vocab: usize,
    /// Anchors per sample and step.
    pub anchors: usize,
    /// Decay of the loss weight over block slots, `exp(-(k - 1) / gamma)`.
    pub gamma: f64,
    pub max_len: usize,
    pub batch_tokens: usize,
    pub epochs: f64,
    pub lr: f64,
    pub warmup: usize,
    pub clip: f64,
    pub checkpoint_every: usize,
    pub val_fraction: f64,
    pub gen_tokens: usize,
    pub gen_max_tokens: usize,
    pub temperature: f32,
    pub sampled_fraction: f32,
    pub concurrency: usize,
    pub seed: u64,
    #[serde(default)]
    pub stop_after: usize,
    #[serde(skip)]
    pub prompt_ids: Vec<Vec<u32>>,
    #[serde(default)]
    pub prompts: crate::distill::prompts::PromptMix,
    #[serde(default)]
    pub corpus: Option<PathBuf>,
    /// Only these shards of `corpus` (`DataConfig::corpus_shards`).
    #[serde(default)]
    pub corpus_shards: Option<std::ops::Range<usize>>,
    /// Start from the drafter this directory holds, as `export` wrote it
    /// (its weights and its draft vocabulary `d2t`), instead of a fresh
    /// start, so training continues it on new data (a checkpoint in the
    /// run's own train/ resumes only a run with the same `init`).
    #[serde(default)]
    pub init: Option<PathBuf>,
}

impl Default for DflashTrainConfig {
    fn default() -> Self {
        Self {
            layers: 2,
            intermediate: 1024,
            block_size: 8,
            target_layer_ids: Vec::new(),
            draft_vocab: 4096,
            anchors: 24,
            gamma: 4.0,
            // The EAGLE trainer's, so its recorded features serve.
            max_len: 448,
            batch_tokens: 2048,
            epochs: 2.0,
            lr: 6e-4,
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
            prompt_ids: Vec::new(),
            prompts: Default::default(),
            corpus: None,
            corpus_shards: None,
            init: None,
        }
    }
}

impl DflashTrainConfig {
    fn data_config(&self) -> DataConfig {
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

    /// The target layers read: as configured, else EAGLE-3's.
    pub fn layer_ids(&self, target_layers: usize) -> Vec<usize> {
        if self.target_layer_ids.is_empty() {
            feature_layers(target_layers)
                .into_iter()
                .map(|l| l.saturating_sub(1))
                .collect()
        } else {
            self.target_layer_ids.clone()
        }
    }
}

fn cerr(e: candle_core::Error) -> SpecdError {
    SpecdError::InvalidRequest(format!("distill dflash: {e}"))
}

fn serr(e: String) -> SpecdError {
    SpecdError::InvalidRequest(format!("distill dflash: {e}"))
}

/// The mask token of drafters this trainer writes (its row is learned, so
/// which id it names does not matter; 0 exists in every vocabulary).
const MASK_TOKEN: u32 = 0;

/// Parameter names and shapes, in z-lab's names.
fn param_shapes(
    h: usize,
    (nh, nkv, hd): (usize, usize, usize),
    cfg: &DflashTrainConfig,
    nf: usize,
    dv: usize,
) -> Vec<(String, Vec<usize>)> {
    let mut s = vec![
        ("fc.weight".to_string(), vec![h, nf * h]),
        ("hidden_norm.weight".into(), vec![h]),
        ("mask_embedding".into(), vec![h]),
    ];
    for i in 0..cfg.layers {
        let p = |n: &str| format!("layers.{i}.{n}");
        let f = cfg.intermediate;
        s.extend([
            (p("input_layernorm.weight"), vec![h]),
            (p("post_attention_layernorm.weight"), vec![h]),
            (p("self_attn.q_norm.weight"), vec![hd]),
            (p("self_attn.k_norm.weight"), vec![hd]),
            (p("self_attn.q_proj.weight"), vec![nh * hd, h]),
            (p("self_attn.k_proj.weight"), vec![nkv * hd, h]),
            (p("self_attn.v_proj.weight"), vec![nkv * hd, h]),
            (p("self_attn.o_proj.weight"), vec![h, nh * hd]),
            (p("mlp.gate_proj.weight"), vec![f, h]),
            (p("mlp.up_proj.weight"), vec![f, h]),
            (p("mlp.down_proj.weight"), vec![h, f]),
        ]);
    }
    s.push(("norm.weight".into(), vec![h]));
    s.push(("lm_head.weight".into(), vec![dv, h]));
    s
}

/// The trainable drafter plus the frozen target pieces it needs.
struct Net {
    p: HashMap<String, Var>,
    embed: Tensor,
    /// Target output head rows of the draft vocabulary (frozen).
    target_head: Tensor,
    cos: Arc<Vec<f32>>,
    sin: Arc<Vec<f32>>,
    h: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    layers: usize,
}

/// One batch as host arrays.
struct Batch {
    b: usize,
    /// Context rows per sample (padded).
    t: usize,
    /// Block rows per sample (`anchors * block_size`).
    rows: usize,
    feats: Vec<f32>,
    /// Token of every block row (the anchor's at slot 0; unused for masks).
    ids: Vec<u32>,
    /// 1 at slot 0, 0 at the masks (`b * rows`).
    bonus: Vec<f32>,
    /// Position of every block row.
    pos: Vec<u32>,
    /// Additive attention mask, `b x rows x (t + rows)`.
    mask: Vec<f32>,
    /// Rows in the loss: (block row `bi * rows + r`, slot, loss weight,
    /// the target's state that predicts its token (`fin` rows), the
    /// target's argmax as a draft id, -1 outside).
    labels: Vec<(u32, usize, f32, Vec<f32>, i64)>,
}

struct Corpus<'a> {
    samples: &'a [Sample],
    f: &'a Features,
    layers: Vec<usize>,
    fin: usize,
    t2d: Vec<i64>,
    h: usize,
    block: usize,
    anchors: usize,
    gamma: f64,
}

impl Corpus<'_> {
    /// The batch of samples `idx`; anchors drawn from `seed`.
    fn batch(&self, idx: &[usize], max_len: usize, seed: u64) -> Result<Batch> {
        let (h, nl, bs) = (self.h, self.layers.len(), self.block);
        let t = idx
            .iter()
            .map(|&i| self.samples[i].tokens.len().min(max_len))
            .max()
            .unwrap_or(1);
        let b = idx.len();
        let rows = self.anchors * bs;
        let keys = t + rows;
        let mut feats = vec![0f32; b * t * nl * h];
        let mut ids = vec![0u32; b * rows];
        let mut bonus = vec![0f32; b * rows];
        let mut pos = vec![0u32; b * rows];
        let mut mask = vec![f32::NEG_INFINITY; b * rows * keys];
        let mut labels = Vec::new();
        let (mut src, mut fin) = (Vec::new(), Vec::new());
        for (bi, &si) in idx.iter().enumerate() {
            let s = &self.samples[si];
            let len = s.tokens.len().min(max_len);
            let o = self.f.offsets[si];
            for (li, &l) in self.layers.iter().enumerate() {
                src.clear();
                self.f.extend(l, o, len, &mut src)?;
                for r in 0..len {
                    let dst = (bi * t + r) * nl * h + li * h;
                    feats[dst..dst + h].copy_from_slice(&src[r * h..(r + 1) * h]);
                }
            }
            fin.clear();
            self.f.extend(self.fin, o, len, &mut fin)?;
            // Anchors: response positions with at least one token after
            // them (the block's first mask predicts a response token), a
            // context of at least one position; distinct, drawn without
            // replacement.
            let lo = s.prompt_len.saturating_sub(1).max(1);
            let mut cand: Vec<usize> = (lo..len.saturating_sub(1)).collect();
            let mut rng = Rng::new(seed ^ (si as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let n = self.anchors.min(cand.len());
            for i in 0..n {
                let j = i + (rng.next_u64() % (cand.len() - i) as u64) as usize;
                cand.swap(i, j);
            }
            cand.truncate(n);
            cand.sort_unstable();
            for a in 0..self.anchors {
                let base = bi * rows + a * bs;
                // Every row sees its own block (padding blocks too, so no
                // row's softmax is empty).
                for r in 0..bs {
                    let m = &mut mask[(base + r) * keys..(base + r + 1) * keys];
                    m[t + a * bs..t + (a + 1) * bs].fill(0.0);
                }
                let Some(&p) = cand.get(a) else { continue };
                ids[base] = s.tokens[p];
                bonus[base] = 1.0;
                for r in 0..bs {
                    pos[base + r] = (p + r) as u32;
                    let m = &mut mask[(base + r) * keys..(base + r + 1) * keys];
                    m[..p].fill(0.0);
                }
                for k in 1..bs {
                    let q = p + k;
                    if q >= len {
                        break;
                    }
                    let w = (-((k - 1) as f64) / self.gamma).exp() as f32;
                    let am = self.t2d[self.f.argmax[o + q - 1] as usize];
                    let row = fin[(q - 1) * h..q * h].to_vec();
                    labels.push(((base + k) as u32, k, w, row, am));
                }
            }
        }
        Ok(Batch {
            b,
            t,
            rows,
            feats,
            ids,
            bonus,
            pos,
            mask,
            labels,
        })
    }
}

impl Net {
    fn w(&self, name: &str) -> &Tensor {
        self.p[name].as_tensor()
    }

    fn rope(&self, x: &Tensor, pos: Option<&Arc<Vec<u32>>>) -> candle_core::Result<Tensor> {
        x.contiguous()?.apply_op1(Rope {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            offset: 0,
            pos: pos.cloned(),
        })
    }

    /// (b, t, n*hd) -> (b, n, t, hd).
    fn heads(&self, x: &Tensor, n: usize) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        x.reshape((b, t, n, self.hd))?.transpose(1, 2)?.contiguous()
    }

    /// (b, nkv, t, hd) -> (b, nh, t, hd), each kv head shared by its group.
    fn rep(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, n, t, hd) = x.dims4()?;
        let g = self.nh / n;
        x.unsqueeze(2)?
            .expand((b, n, g, t, hd))?
            .reshape((b, self.nh, t, hd))
    }

    /// Final-normed outputs of every block row, `(b * rows, h)`.
    fn blocks(&self, batch: &Batch) -> candle_core::Result<Tensor> {
        let dev = Device::Cpu;
        let (b, t, rows, h) = (batch.b, batch.t, batch.rows, self.h);
        let nl = batch.feats.len() / (b * t * h);
        let feats = Tensor::from_slice(&batch.feats, (b, t, nl * h), &dev)?;
        let c = rms(
            &lin(&feats, self.w("fc.weight"))?,
            self.w("hidden_norm.weight"),
        )?;
        let ids = Tensor::from_slice(&batch.ids, b * rows, &dev)?;
        let e = self.embed.index_select(&ids, 0)?.reshape((b, rows, h))?;
        let is_b = Tensor::from_slice(&batch.bonus, (b, rows, 1), &dev)?;
        let m = self.w("mask_embedding").reshape((1, 1, h))?;
        let mut x = (e.broadcast_mul(&is_b)? + m.broadcast_mul(&(1.0 - &is_b)?)?)?;
        let pos = Arc::new(batch.pos.clone());
        let mask = Tensor::from_slice(&batch.mask, (b, 1, rows, t + rows), &dev)?;
        let scale = 1.0 / (self.hd as f64).sqrt();
        for i in 0..self.layers {
            let w = |n: &str| self.w(&format!("layers.{i}.{n}"));
            let xn = rms(&x, w("input_layernorm.weight"))?;
            let q = rms(
                &self.heads(&lin(&xn, w("self_attn.q_proj.weight"))?, self.nh)?,
                w("self_attn.q_norm.weight"),
            )?;
            let q = self.rope(&q, Some(&pos))?;
            let kproj = |src: &Tensor| -> candle_core::Result<Tensor> {
                rms(
                    &self.heads(&lin(src, w("self_attn.k_proj.weight"))?, self.nkv)?,
                    w("self_attn.k_norm.weight"),
                )
            };
            let kb = self.rope(&kproj(&xn)?, Some(&pos))?;
            let kc = self.rope(&kproj(&c)?, None)?;
            let vb = self.heads(&lin(&xn, w("self_attn.v_proj.weight"))?, self.nkv)?;
            let vc = self.heads(&lin(&c, w("self_attn.v_proj.weight"))?, self.nkv)?;
            let k = self.rep(&Tensor::cat(&[&kc, &kb], 2)?)?;
            let v = self.rep(&Tensor::cat(&[&vc, &vb], 2)?)?;
            let s = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?;
            // `softmax` (not `softmax_last_dim`, which has no backward pass).
            let a = candle_nn::ops::softmax(&s, D::Minus1)?;
            let o = a
                .matmul(&v)?
                .transpose(1, 2)?
                .reshape((b, rows, self.nh * self.hd))?;
            x = (&x + lin(&o, w("self_attn.o_proj.weight"))?)?;
            let xn = rms(&x, w("post_attention_layernorm.weight"))?;
            let g = lin(&xn, w("mlp.gate_proj.weight"))?.silu()?;
            let u = lin(&xn, w("mlp.up_proj.weight"))?;
            x = (&x + lin(&(g * u)?, w("mlp.down_proj.weight"))?)?;
        }
        rms(&x, self.w("norm.weight"))?.reshape((b * rows, h))
    }

    /// The weighted loss; per slot (hits, counted).
    fn forward(
        &self,
        batch: &Batch,
        slots: usize,
    ) -> candle_core::Result<(Tensor, Vec<(f64, f64)>)> {
        let dev = Device::Cpu;
        let mut stats = vec![(0.0, 0.0); slots];
        if batch.labels.is_empty() {
            return Ok((Tensor::zeros((), DType::F32, &dev)?, stats));
        }
        let y = self.blocks(batch)?;
        let sel: Vec<u32> = batch.labels.iter().map(|l| l.0).collect();
        let n = sel.len();
        let y = y.index_select(&Tensor::from_slice(&sel, n, &dev)?, 0)?;
        let logits = y.matmul(&self.w("lm_head.weight").t()?)?;
        let fin: Vec<f32> = batch
            .labels
            .iter()
            .flat_map(|l| l.3.iter().copied())
            .collect();
        let target = Tensor::from_vec(fin, (n, self.h), &dev)?.matmul(&self.target_head.t()?)?;
        let total: f32 = batch.labels.iter().map(|l| l.2).sum();
        let weights = batch.labels.iter().map(|l| l.2 / total).collect();
        let loss = logits.apply_op2(&target, SoftCrossEntropy::new(weights))?;
        let pred = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
        for (l, &p) in batch.labels.iter().zip(&pred) {
            let st = &mut stats[l.1 - 1];
            st.1 += 1.0;
            if i64::from(p) == l.4 {
                st.0 += 1.0;
            }
        }
        Ok((loss, stats))
    }
}

/// Training progress, next to each checkpoint.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct DflashState {
    pub step: usize,
    pub steps: usize,
    pub loss: f32,
    pub first_loss: f32,
    /// (step, validation acceptance per block slot 1..B-1: the drafter's
    /// argmax equals the target's).
    pub val: Vec<(usize, Vec<f64>)>,
    pub coverage: f64,
    pub config: DflashTrainConfig,
}

fn export(
    out: &Path,
    net: &Net,
    shapes: &[(String, Vec<usize>)],
    vocab_ids: &[u32],
    target: &Model,
    cfg: &DflashTrainConfig,
    ids: &[usize],
) -> Result<()> {
    let tc = &target.config;
    let mut tensors = Vec::new();
    for (name, shape) in shapes {
        tensors.push((
            name.clone(),
            shape.clone(),
            TensorData::F16(tensor_vec(net.w(name))?),
        ));
    }
    let d2t: Vec<i64> = vocab_ids
        .iter()
        .enumerate()
        .map(|(i, &t)| i64::from(t) - i as i64)
        .collect();
    tensors.push(("d2t".into(), vec![vocab_ids.len()], TensorData::I64(d2t)));
    tensor_file::write(&out.join("model.safetensors"), &tensors).map_err(serr)?;
    let config = serde_json::json!({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": tc.hidden,
        "num_attention_heads": net.nh,
        "num_key_value_heads": net.nkv,
        "head_dim": net.hd,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "hidden_act": "silu",
        "rms_norm_eps": EPS,
        "rope_theta": tc.rope_theta,
        "rope_scaling": null,
        "attention_bias": false,
        "vocab_size": tc.vocab_size,
        "draft_vocab_size": vocab_ids.len(),
        "max_position_embeddings": tc.max_seq_len,
        "tie_word_embeddings": false,
        "block_size": cfg.block_size,
        "num_target_layers": tc.layers,
        "torch_dtype": "float16",
        "dflash_config": {"mask_token_id": MASK_TOKEN, "target_layer_ids": ids},
    });
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap_or_default(),
    )?;
    Ok(())
}

/// Read `dir`'s drafter for `--init`: written by this trainer (or in its
/// layout) for the target layers `ids`, with `cfg`'s block size and layer
/// count, over a target of `vocab` tokens. The tensors' shapes are
/// checked by the caller; what no shape tells is checked here.
fn read_init(dir: &Path, cfg: &DflashTrainConfig, ids: &[usize], vocab: usize) -> Result<InitHead> {
    let init = InitHead::read(dir, "dflash", String::new(), vocab)?;
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| {
        serr(format!(
            "{}: {e} (the drafter's config)",
            cfg_path.display()
        ))
    })?;
    let saved: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| serr(format!("{}: not JSON: {e}", cfg_path.display())))?;
    let field = |v: &serde_json::Value| serde_json::from_value::<Vec<usize>>(v.clone()).ok();
    match field(&saved["dflash_config"]["target_layer_ids"]) {
        Some(s) if s.as_slice() == ids => {}
        Some(s) => {
            return Err(serr(format!(
                "{}: the drafter reads target layers {s:?}, this run {ids:?} (--target-layer-ids)",
                cfg_path.display()
            )))
        }
        None => {
            return Err(serr(format!(
                "{}: no dflash_config.target_layer_ids (the layers the drafter reads), so it cannot be continued safely",
                cfg_path.display()
            )))
        }
    }
    for (key, want, flag) in [
        ("block_size", cfg.block_size, "--block-size"),
        ("num_hidden_layers", cfg.layers, "--layers"),
    ] {
        let got = saved[key].as_u64();
        if got != Some(want as u64) {
            return Err(serr(format!(
                "{}: {key} is {}, this run's is {want} ({flag})",
                cfg_path.display(),
                got.map_or("missing".to_string(), |g| g.to_string())
            )));
        }
    }
    Ok(init)
}

/// Train (or resume training) a DFlash drafter for `target_path` into
/// `out`. Returns the final state.
pub fn distill_dflash(
    target_path: &Path,
    out: &Path,
    cfg: &DflashTrainConfig,
    threads: usize,
) -> Result<DflashState> {
    super::train::keep_freed_memory();
    if cfg.block_size < 2 || cfg.layers == 0 || cfg.anchors == 0 {
        return Err(serr(
            "block_size must be at least 2, layers and anchors at least 1".into(),
        ));
    }
    let train_dir = out.join("train");
    std::fs::create_dir_all(&train_dir)?;
    let target = Arc::new(crate::model::load_model(target_path, threads)?);
    let tok = Arc::new(Tokenizer::for_model(target_path)?);
    let tc = target.config.clone();
    let (h, vocab) = (tc.hidden, tc.vocab_size);
    let ids = cfg.layer_ids(tc.layers);
    if let Some(l) = ids.iter().find(|&&l| l >= tc.layers) {
        return Err(serr(format!(
            "target layer {l}: outputs of layers 0 to {} can be read",
            tc.layers.saturating_sub(1)
        )));
    }
    let layers: Vec<usize> = ids.iter().map(|&l| l + 1).collect();
    let nf = layers.len();
    let mut recorded = layers.clone();
    recorded.push(tc.layers);
    recorded.dedup();
    let (nh, nkv, hd) = (tc.heads, tc.kv_heads, tc.head_dim);
    // A start from a written drafter: read and checked before the data,
    // so a wrong directory fails before any features are recorded.
    let init = match &cfg.init {
        Some(dir) => {
            let i = read_init(dir, cfg, &ids, vocab)?;
            i.check(&param_shapes(h, (nh, nkv, hd), cfg, nf, i.ids.len()))?;
            Some(i)
        }
        None => None,
    };
    // A checkpoint resumes only the run that wrote it: on other data or
    // from another start its weights would continue on what they were not
    // trained for.
    let ckpt = Checkpoint::new(&train_dir);
    let resumed: Option<(DflashState, _)> = ckpt.resume()?;
    if let Some((st, _)) = &resumed {
        let c = &st.config;
        super::train::check_resume(
            "dflash",
            &train_dir,
            (&c.corpus, &c.corpus_shards, &c.init),
            (&cfg.corpus, &cfg.corpus_shards, &cfg.init),
            init.as_ref(),
        )?;
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
    // the drafter's draft vocabulary size, whatever --draft-vocab asked.
    let mut effective = cfg.clone();
    effective.draft_vocab = dv;
    let cfg = &effective;
    let dev = Device::Cpu;
    let emb = embedding_table(&target);
    let th = target_head_rows(&target, &vocab_ids);
    let shapes = param_shapes(h, (nh, nkv, hd), cfg, nf, dv);
    let (cos, sin) = rope_tables(cfg.max_len + cfg.block_size + 1, hd, tc.rope_theta)?;
    let mut rng = Rng::new(cfg.seed ^ 0xDF1A5);
    let mut gauss = |n: usize, std: f32| super::train::gauss(&mut rng, n, std);
    let mut p = HashMap::new();
    let mut opt = AdamW::new();
    let out_std = 0.02 / (2.0 * cfg.layers as f32).sqrt();
    for (name, shape) in &shapes {
        let n: usize = shape.iter().product();
        let init: Vec<f32> = if let Some((_, f)) = &resumed {
            ckpt.restore(f, name, shape, &mut opt)?
        } else if let Some(i) = &init {
            i.tensor(name, shape)?
        } else if name == "lm_head.weight" {
            // A logit lens start: the target's own head rows.
            th.clone()
        } else if name == "norm.weight" {
            target.weights.norm.clone()
        } else if name == "mask_embedding" {
            emb[MASK_TOKEN as usize * h..(MASK_TOKEN as usize + 1) * h].to_vec()
        } else if name.ends_with("norm.weight") {
            vec![1.0; n]
        } else if name == "fc.weight" {
            gauss(n, (1.0 / (nf * h) as f64).sqrt() as f32)
        } else if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
            gauss(n, out_std)
        } else {
            gauss(n, 0.02)
        };
        p.insert(name.clone(), var(init, shape)?);
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
        layers: cfg.layers,
    };
    let corpus = Corpus {
        samples: &samples,
        f: &features,
        layers: layers.clone(),
        fin: tc.layers,
        t2d,
        h,
        block: cfg.block_size,
        anchors: cfg.anchors,
        gamma: cfg.gamma,
    };
    let slots = cfg.block_size - 1;
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
            DflashState {
                steps,
                coverage,
                config: cfg.clone(),
                ..st
            }
        }
        None => DflashState {
            step: 0,
            steps,
            loss: f32::NAN,
            first_loss: f32::NAN,
            val: Vec::new(),
            coverage,
            config: cfg.clone(),
        },
    };
    let validate = |net: &Net| -> Result<Vec<f64>> {
        let mut acc = vec![(0.0, 0.0); slots];
        for (i, b) in plan_batches(&samples, &val_idx, cfg.batch_tokens, cfg.max_len, 1)
            .iter()
            .enumerate()
        {
            let (_, st) = net
                .forward(&corpus.batch(b, cfg.max_len, 0xA11 + i as u64)?, slots)
                .map_err(cerr)?;
            for (a, s) in acc.iter_mut().zip(st) {
                a.0 += s.0;
                a.1 += s.1;
            }
        }
        Ok(acc.iter().map(|a| a.0 / f64::max(a.1, 1.0)).collect())
    };
    let save = |net: &Net, opt: &AdamW, state: &DflashState| -> Result<()> {
        ckpt.save(&shapes, |n| net.w(n), opt, state)?;
        export(out, net, &shapes, &vocab_ids, &target, cfg, &ids)
    };
    let show = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.3}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    if state.val.is_empty() && !val_idx.is_empty() {
        let v = validate(&net)?;
        eprintln!(
            "specd distill: before training, validation acceptance by slot {}",
            show(&v)
        );
        state.val.push((0, v));
    }
    let (mut hits, mut counted) = (0.0, 0.0);
    while state.step < sched.limit {
        let step = state.step;
        let seed = cfg.seed ^ (step as u64).wrapping_mul(0x2545_F491_4F6C_DD1D);
        let batch = corpus.batch(sched.batch(step), cfg.max_len, seed)?;
        let (loss, st) = net.forward(&batch, slots).map_err(cerr)?;
        if !batch.labels.is_empty() {
            let grads = loss.backward().map_err(cerr)?;
            opt.step(
                net.p.iter().map(|(k, v)| (k.as_str(), v)),
                &grads,
                cosine_lr(cfg.lr, cfg.warmup, step, steps),
                cfg.clip,
            )
            .map_err(cerr)?;
        }
        let l = loss.to_scalar::<f32>().map_err(cerr)?;
        if state.first_loss.is_nan() {
            state.first_loss = l;
        }
        state.loss = l;
        state.step += 1;
        hits = 0.9 * hits + st[0].0;
        counted = 0.9 * counted + st[0].1;
        let val = state.val.last().map_or(0.0, |v| v.1[0]);
        let msg = format!(
            "loss {l:.3}  train acc@1 {:.3}  val acc@1 {val:.3}",
            hits / f64::max(counted, 1.0)
        );
        if sched.done(state.step, cfg.checkpoint_every, msg) {
            if !val_idx.is_empty() {
                let v = validate(&net)?;
                state.val.push((state.step, v));
            }
            save(&net, &opt, &state)?;
        }
    }
    sched.finish(state.step);
    if !out.join("model.safetensors").exists() {
        save(&net, &opt, &state)?;
    }
    let sha = crate::fetch::sha256_file(&out.join("model.safetensors"))?;
    let last = state.val.last().map(|v| show(&v.1)).unwrap_or_default();
    eprintln!(
        "specd distill: {}/{} steps, loss {:.3} (first {:.3}), validation acceptance by slot {last}; drafter in {} (model.safetensors sha256 {sha})",
        state.step, steps, state.loss, state.first_loss, out.display()
    );
    Ok(state)
}

/// The training graph's logits for one block of an exported drafter:
/// the block at `anchor` of `tokens` (context: `feats` rows `0..anchor`,
/// `tokens.len() x (layers * h)` in `target_layer_ids` order), slots
/// `1..block_size` over the draft vocabulary, `(block_size - 1) x dv`.
/// What the inference path (`Dflash::context`, `Dflash::block`) must
/// reproduce.
pub fn training_logits(
    dir: &Path,
    target: &Model,
    tokens: &[u32],
    feats: &[f32],
    anchor: usize,
) -> Result<Vec<f32>> {
    let tc = &target.config;
    let f = crate::model::tensor_file::TensorFile::read(&dir.join("model.safetensors"))
        .map_err(serr)?;
    let cj: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("config.json"))
            .map_err(|e| serr(format!("{}: {e}", dir.display())))?,
    )
    .map_err(|e| serr(e.to_string()))?;
    let get = |k: &str| cj.get(k).and_then(|v| v.as_u64()).unwrap_or(0) as usize;
    let (bs, nl) = (get("block_size"), get("num_hidden_layers"));
    let dev = Device::Cpu;
    let mut p = HashMap::new();
    for name in f.names() {
        if name == "d2t" {
            continue;
        }
        let shape = f.shape(name).unwrap_or(&[]).to_vec();
        let t = Tensor::from_vec(f.f32(name).map_err(serr)?, shape, &dev).map_err(cerr)?;
        p.insert(name.to_string(), Var::from_tensor(&t).map_err(cerr)?);
    }
    let h = tc.hidden;
    let (cos, sin) = rope_tables(tokens.len() + bs + 1, tc.head_dim, tc.rope_theta)?;
    let net = Net {
        p,
        embed: Tensor::from_vec(embedding_table(target), (tc.vocab_size, h), &dev).map_err(cerr)?,
        target_head: Tensor::zeros((1, h), DType::F32, &dev).map_err(cerr)?,
        cos,
        sin,
        h,
        nh: tc.heads,
        nkv: tc.kv_heads,
        hd: tc.head_dim,
        layers: nl,
    };
    let t = tokens.len();
    let keys = t + bs;
    let mut mask = vec![f32::NEG_INFINITY; bs * keys];
    for r in 0..bs {
        mask[r * keys..r * keys + anchor].fill(0.0);
        mask[r * keys + t..(r + 1) * keys].fill(0.0);
    }
    let mut ids = vec![0u32; bs];
    ids[0] = tokens[anchor];
    let mut bonus = vec![0f32; bs];
    bonus[0] = 1.0;
    let batch = Batch {
        b: 1,
        t,
        rows: bs,
        feats: feats.to_vec(),
        ids,
        bonus,
        pos: (anchor..anchor + bs).map(|p| p as u32).collect(),
        mask,
        labels: Vec::new(),
    };
    let y = net.blocks(&batch).map_err(cerr)?;
    let logits = y
        .narrow(0, 1, bs - 1)
        .and_then(|y| y.matmul(&net.w("lm_head.weight").t()?))
        .map_err(cerr)?;
    tensor_vec(&logits)
}
