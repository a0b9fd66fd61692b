//! `specd distill medusa`: Medusa-1 heads for a frozen target, trained on
//! the target's own responses (the [`super::training_data`] pipeline
//! shared with `distill eagle`, and its cached final-normed states).
//!
//! Head `k` (0-based) reads the final-normed state `h_p` and learns the
//! target's next-token distribution at position `p + k + 1` (so it
//! predicts `x_{p+k+2}`), restricted to a draft vocabulary of the most
//! frequent response tokens: cross-entropy against the target's softmax
//! there (self-distillation), weighted 0.8^k as in Medusa. Each head is
//! `layers` residual blocks `y + SiLU(W y + b)`, started at zero (each
//! head then begins as the target's own next-token head); the output is
//! the target's head rows of the draft vocabulary, frozen, so the written
//! file holds only the blocks (`"medusa_output": "target"`).
//!
//! Invariant: as every `distill` trainer, no evaluation prompt is trained
//! on (see `super::prompt_set`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{Device, Tensor, Var, D};

use super::train::{
    cosine_lr, plan_batches, prepare, tensor_vec, var, AdamW, Checkpoint, DraftVocab, Features,
    Prepared, Schedule,
};
use super::{DataConfig, Sample};
use crate::error::{Result, SpecdError};
use crate::model::tensor_file::{self, TensorData, TensorFile};
use crate::model::Model;
use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct MedusaTrainConfig {
    pub heads: usize,
    /// Residual blocks per head.
    pub layers: usize,
    /// Rows of the output (most frequent response tokens).
    pub draft_vocab: usize,
    /// Samples are cut to this many tokens.
    pub max_len: usize,
    /// Tokens per training batch (whole samples, no padding).
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
    /// Stop after this many steps (tests of resume; 0: no limit).
    #[serde(default)]
    pub stop_after: usize,
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
}

impl Default for MedusaTrainConfig {
    fn default() -> Self {
        // The data settings are `distill eagle`'s, so one cached corpus
        // (samples.json, features.safetensors) serves both.
        Self {
            heads: 4,
            layers: 1,
            draft_vocab: 4096,
            max_len: 448,
            batch_tokens: 4096,
            epochs: 3.0,
            lr: 2e-3,
            warmup: 20,
            clip: 1.0,
            checkpoint_every: 25,
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
        }
    }
}

fn cerr(e: candle_core::Error) -> SpecdError {
    SpecdError::InvalidRequest(format!("distill medusa: {e}"))
}

fn serr(e: String) -> SpecdError {
    SpecdError::InvalidRequest(format!("distill medusa: {e}"))
}

/// Names and shapes of the trainable tensors, in the public Medusa layout.
fn param_shapes(h: usize, heads: usize, layers: usize) -> Vec<(String, Vec<usize>)> {
    let mut v = Vec::new();
    for k in 0..heads {
        for j in 0..layers {
            v.push((format!("{k}.{j}.linear.weight"), vec![h, h]));
            v.push((format!("{k}.{j}.linear.bias"), vec![h]));
        }
    }
    v
}

/// The heads plus the frozen output rows.
struct Net {
    p: HashMap<String, Var>,
    /// Target output head rows of the draft vocabulary, `dv x h`.
    th: Tensor,
    heads: usize,
    layers: usize,
}

/// One batch: rows of whole samples, and per head the (input row, label
/// row) pairs it is trained on.
struct Batch {
    x: Vec<f32>,
    rows: usize,
    /// Per head: input rows, label rows, target argmax (draft id or -1).
    pairs: Vec<(Vec<u32>, Vec<u32>, Vec<i64>)>,
}

impl Net {
    fn w(&self, name: &str) -> &Tensor {
        self.p[name].as_tensor()
    }

    /// Head `k`'s output state for `x` (`n x h`).
    fn state(&self, k: usize, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut y = x.clone();
        for j in 0..self.layers {
            let z = y
                .matmul(&self.w(&format!("{k}.{j}.linear.weight")).t()?)?
                .broadcast_add(self.w(&format!("{k}.{j}.linear.bias")))?;
            y = (y + z.silu()?)?;
        }
        Ok(y)
    }

    /// Loss and per-head (correct, counted) at acceptance@1.
    fn forward(&self, b: &Batch) -> candle_core::Result<(Tensor, Vec<(f64, f64)>)> {
        let dev = Device::Cpu;
        let h = self.th.dim(1)?;
        let x = Tensor::from_slice(&b.x, (b.rows, h), &dev)?;
        // The target's distribution at every row (labels), once.
        let p_all = candle_nn::ops::softmax_last_dim(&x.matmul(&self.th.t()?)?)?.detach();
        let mut total: Option<Tensor> = None;
        let mut stats = Vec::new();
        for k in 0..self.heads {
            let (src, lab, argmax) = &b.pairs[k];
            if src.is_empty() {
                stats.push((0.0, 0.0));
                continue;
            }
            let n = src.len();
            let xi = x.index_select(&Tensor::from_slice(src, n, &dev)?, 0)?;
            let p = p_all.index_select(&Tensor::from_slice(lab, n, &dev)?, 0)?;
            let logits = self.state(k, &xi)?.matmul(&self.th.t()?)?;
            let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
            let ce = (p * logp)?.sum_all()?.neg()?;
            let l = (ce * (0.8f64.powi(k as i32) / n as f64))?;
            total = Some(match total {
                None => l,
                Some(t) => (t + l)?,
            });
            let pred = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
            let hit = pred
                .iter()
                .zip(argmax)
                .filter(|(p, a)| i64::from(**p) == **a)
                .count();
            stats.push((hit as f64, n as f64));
        }
        let total = total.ok_or_else(|| candle_core::Error::Msg("an empty batch".into()))?;
        Ok((total, stats))
    }
}

/// Rows of `idx`'s samples, and each head's training pairs among them.
fn make_batch(
    samples: &[Sample],
    f: &Features,
    fin: usize,
    t2d: &[i64],
    heads: usize,
    idx: &[usize],
) -> Result<Batch> {
    let mut x = Vec::new();
    let mut pairs: Vec<(Vec<u32>, Vec<u32>, Vec<i64>)> = vec![Default::default(); heads];
    let mut base = 0usize;
    for &si in idx {
        let s = &samples[si];
        let (o, len) = (f.offsets[si], s.tokens.len());
        f.extend(fin, o, len, &mut x)?;
        for (k, (src, lab, am)) in pairs.iter_mut().enumerate() {
            for p in 0..len {
                // Head k at row p learns the distribution at q = p + k + 1
                // (the token after q is what it predicts); only where that
                // token is part of the response.
                let q = p + k + 1;
                if q >= len {
                    break;
                }
                if q + 1 < s.prompt_len {
                    continue;
                }
                src.push((base + p) as u32);
                lab.push((base + q) as u32);
                am.push(t2d[f.argmax[o + q] as usize]);
            }
        }
        base += len;
    }
    Ok(Batch {
        x,
        rows: base,
        pairs,
    })
}

/// Training progress, next to each checkpoint.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct MedusaState {
    pub step: usize,
    pub steps: usize,
    pub loss: f32,
    pub first_loss: f32,
    /// (step, validation acceptance@1 of each head, validation loss).
    pub val: Vec<(usize, Vec<f64>, f64)>,
    /// Draft vocabulary coverage of response tokens.
    pub coverage: f64,
    pub config: MedusaTrainConfig,
}

/// Write the heads: blocks in F16, `d2t`, and config.json.
fn export(
    out: &Path,
    net: &Net,
    shapes: &[(String, Vec<usize>)],
    vocab_ids: &[u32],
    target: &Model,
) -> Result<PathBuf> {
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
    std::fs::create_dir_all(out)?;
    let weights = out.join("model.safetensors");
    tensor_file::write(&weights, &tensors).map_err(serr)?;
    let config = serde_json::json!({
        "architectures": ["MedusaModel"],
        "medusa_num_heads": net.heads,
        "medusa_num_layers": net.layers,
        "hidden_size": tc.hidden,
        "vocab_size": tc.vocab_size,
        "draft_vocab_size": vocab_ids.len(),
        "medusa_output": "target",
        "torch_dtype": "float16",
    });
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap_or_default(),
    )?;
    Ok(weights)
}

pub use super::train::target_head_rows;

/// The training graph's logits of an exported head for final-normed
/// states `x` (`rows x h`): `heads x rows x draft_vocab`. The reference
/// the plugin's inference path is tested against.
pub fn reference_logits(head_dir: &Path, target: &Model, x: &[f32]) -> Result<Vec<f32>> {
    let f = TensorFile::read(&head_dir.join("model.safetensors")).map_err(serr)?;
    let cj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(head_dir.join("config.json"))?)
            .map_err(|e| serr(e.to_string()))?;
    let get = |k: &str| cj.get(k).and_then(|v| v.as_u64()).unwrap_or(0) as usize;
    let (heads, layers) = (get("medusa_num_heads"), get("medusa_num_layers"));
    let h = target.config.hidden;
    let dev = Device::Cpu;
    let off = f.i64("d2t").map_err(serr)?;
    let ids: Vec<u32> = off
        .iter()
        .enumerate()
        .map(|(i, o)| (i as i64 + o) as u32)
        .collect();
    let mut p = HashMap::new();
    for (name, shape) in param_shapes(h, heads, layers) {
        let t = Tensor::from_vec(f.f32(&name).map_err(serr)?, shape, &dev).map_err(cerr)?;
        p.insert(name, Var::from_tensor(&t).map_err(cerr)?);
    }
    let net = Net {
        p,
        th: Tensor::from_vec(target_head_rows(target, &ids), (ids.len(), h), &dev).map_err(cerr)?,
        heads,
        layers,
    };
    let rows = x.len() / h;
    let xt = Tensor::from_slice(x, (rows, h), &dev).map_err(cerr)?;
    let mut out = Vec::new();
    for k in 0..heads {
        let l = net
            .state(k, &xt)
            .and_then(|y| y.matmul(&net.th.t()?))
            .and_then(|l| l.flatten_all()?.to_vec1::<f32>())
            .map_err(cerr)?;
        out.extend(l);
    }
    Ok(out)
}

/// Train (or resume training) Medusa heads for `target_path` into `out`.
pub fn distill_medusa(
    target_path: &Path,
    out: &Path,
    cfg: &MedusaTrainConfig,
    threads: usize,
) -> Result<MedusaState> {
    super::train::keep_freed_memory();
    if cfg.heads == 0 || cfg.layers == 0 {
        return Err(serr("heads and layers must be at least 1".into()));
    }
    let train_dir = out.join("train");
    std::fs::create_dir_all(&train_dir)?;
    let target = Arc::new(crate::model::load_model(target_path, threads)?);
    let tok = Arc::new(Tokenizer::for_model(target_path)?);
    let tc = target.config.clone();
    let h = tc.hidden;
    let data_cfg = DataConfig {
        gen_tokens: cfg.gen_tokens,
        gen_max_tokens: cfg.gen_max_tokens,
        temperature: cfg.temperature,
        sampled_fraction: cfg.sampled_fraction,
        concurrency: cfg.concurrency,
        seed: cfg.seed,
        prompt_ids: cfg.prompt_ids.clone(),
        mix: cfg.prompts,
        corpus: cfg.corpus.clone(),
        corpus_shards: cfg.corpus_shards.clone(),
    };
    let fin = tc.layers;
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
        &data_cfg,
        &train_dir,
        cfg.max_len,
        &[fin],
        (cfg.draft_vocab, None, cfg.seed, cfg.val_fraction),
    )?;
    let dv = vocab_ids.len();

    let dev = Device::Cpu;
    let shapes = param_shapes(h, cfg.heads, cfg.layers);
    let ckpt = Checkpoint::new(&train_dir);
    let resumed: Option<(MedusaState, TensorFile)> = ckpt.resume()?;
    let mut opt = AdamW::new();
    let mut p = HashMap::new();
    for (name, shape) in &shapes {
        let n: usize = shape.iter().product();
        let init = if let Some((_, f)) = &resumed {
            ckpt.restore(f, name, shape, &mut opt)?
        } else {
            // Zero: every head starts as the target's own next-token head.
            vec![0.0; n]
        };
        p.insert(name.clone(), var(init, shape)?);
    }
    let net = Net {
        p,
        th: Tensor::from_vec(target_head_rows(&target, &vocab_ids), (dv, h), &dev).map_err(cerr)?,
        heads: cfg.heads,
        layers: cfg.layers,
    };
    let batch_of = |idx: &[usize]| make_batch(&samples, &features, fin, &t2d, cfg.heads, idx);
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
            MedusaState {
                steps,
                coverage,
                config: cfg.clone(),
                ..st
            }
        }
        None => MedusaState {
            step: 0,
            steps,
            loss: f32::NAN,
            first_loss: f32::NAN,
            val: Vec::new(),
            coverage,
            config: cfg.clone(),
        },
    };
    let validate = |net: &Net| -> Result<(Vec<f64>, f64)> {
        let mut acc = vec![(0.0, 0.0); cfg.heads];
        let (mut loss, mut batches) = (0.0, 0.0);
        for b in plan_batches(&samples, &val_idx, cfg.batch_tokens, cfg.max_len, 1) {
            let (l, st) = net.forward(&batch_of(&b)?).map_err(cerr)?;
            loss += f64::from(l.to_scalar::<f32>().map_err(cerr)?);
            batches += 1.0;
            for (a, s) in acc.iter_mut().zip(st) {
                a.0 += s.0;
                a.1 += s.1;
            }
        }
        Ok((
            acc.iter().map(|(h, n)| h / f64::max(*n, 1.0)).collect(),
            loss / f64::max(batches, 1.0),
        ))
    };
    let save = |net: &Net, opt: &AdamW, state: &MedusaState| -> Result<()> {
        ckpt.save(&shapes, |n| net.w(n), opt, state)?;
        export(out, net, &shapes, &vocab_ids, &target)?;
        Ok(())
    };
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|a| format!("{a:.3}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    if state.val.is_empty() && !val_idx.is_empty() {
        let (a, l) = validate(&net)?;
        eprintln!(
            "specd distill: before training, validation acceptance@1 per head {} (loss {l:.3})",
            fmt(&a)
        );
        state.val.push((0, a, l));
    }
    while state.step < sched.limit {
        let step = state.step;
        let batch = batch_of(sched.batch(step))?;
        let (loss, _) = net.forward(&batch).map_err(cerr)?;
        let grads = loss.backward().map_err(cerr)?;
        opt.step(
            net.p.iter().map(|(k, v)| (k.as_str(), v)),
            &grads,
            cosine_lr(cfg.lr, cfg.warmup, step, steps),
            cfg.clip,
        )
        .map_err(cerr)?;
        let l = loss.to_scalar::<f32>().map_err(cerr)?;
        if state.first_loss.is_nan() {
            state.first_loss = l;
        }
        state.loss = l;
        state.step += 1;
        let val = state.val.last().map(|v| fmt(&v.1)).unwrap_or_default();
        let msg = format!("loss {l:.3}  val acc@1 per head {val}");
        if sched.done(state.step, cfg.checkpoint_every, msg) {
            if !val_idx.is_empty() {
                let (a, l) = validate(&net)?;
                state.val.push((state.step, a, l));
            }
            save(&net, &opt, &state)?;
        }
    }
    sched.finish(state.step);
    if !out.join("model.safetensors").exists() {
        save(&net, &opt, &state)?;
    }
    let sha = crate::fetch::sha256_file(&out.join("model.safetensors"))?;
    let last = state.val.last().map(|v| fmt(&v.1)).unwrap_or_default();
    eprintln!(
        "specd distill: {}/{} steps, loss {:.3} (first {:.3}), validation acceptance@1 per head {last}; heads in {} (model.safetensors sha256 {sha})",
        state.step,
        steps,
        state.loss,
        state.first_loss,
        out.display()
    );
    Ok(state)
}
