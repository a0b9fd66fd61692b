//! `specd distill draft`: train a small Llama draft for a target by
//! self-distillation on CPU (candle autograd). Two kinds:
//!
//! - *Compact* (`draft_vocab > 0`, the CLI default): the target's frozen
//!   embedding through a learned projection (`model.embed_proj.weight`),
//!   `layers` Llama blocks and a head over the `draft_vocab` most frequent
//!   response tokens (`lm_head.weight`, `d2t`). Data: the target's answers
//!   to the training prompts and its final-normed state at every position
//!   (`<out>/train/`, the layout `distill eagle` writes, so that cache can
//!   be shared); the draft learns the target's distribution on the draft
//!   vocabulary (soft cross-entropy; prompt positions weighted
//!   `prompt_weight`). Output: F16 `model.safetensors` + `config.json`
//!   recording the target's hidden width and vocabulary fingerprint, which
//!   the `draft` plugin loads (the embedding is rebuilt from the host's).
//! - *Plain* (`draft_vocab = 0`): its own tied embedding (initialised from
//!   the target's, projected to the draft width), next-token cross-entropy
//!   on the sampled streams (`<out>/samples.json`); the output directory is
//!   a safetensors model (config.json, tokenizer.json) any loader reads.
//!
//! Checkpoints (`state.json` beside them) are written every
//! `checkpoint_every` steps and training resumes from them.
//!
//! Invariant: parameter names are Hugging Face Llama names (plus
//! `model.embed_proj.weight` and `d2t` for compact drafts), so the engine's
//! loader reads a checkpoint as it reads any safetensors model.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{Optimizer, VarBuilder, VarMap};

use crate::error::{Result, SpecdError};
use crate::model::Model;
use crate::sampler::Rng;
use crate::tokenizer::{vocab_fingerprint, Tokenizer};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct DistillConfig {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub seq_len: usize,
    pub batch: usize,
    pub steps: usize,
    pub lr: f64,
    /// Target-generated tokens to train on.
    pub gen_tokens: usize,
    /// Tokens per generated sample.
    pub gen_max_tokens: usize,
    pub temperature: f32,
    pub checkpoint_every: usize,
    pub seed: u64,
    /// Prompts as token ids (used instead of the text prompt set when
    /// non-empty; e.g. for targets without a text tokenizer).
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
    /// Rows of a reduced-vocabulary output head (the most frequent
    /// response tokens); 0: the full vocabulary, tied to the embedding.
    /// With a draft vocabulary the draft is *compact*: its input embedding
    /// is the target's, through a learned projection (`embed_proj`), so
    /// neither table ships, and it learns the target's distribution (soft
    /// cross-entropy on the draft vocabulary) rather than sampled tokens.
    #[serde(default)]
    pub draft_vocab: usize,
    /// Compact drafts: tokens per sample kept (as `distill eagle`, so the
    /// two can share a train/ directory).
    #[serde(default = "default_max_len")]
    pub max_len: usize,
    /// Compact drafts: loss weight of positions that predict a prompt
    /// token (response positions weigh 1).
    #[serde(default = "default_prompt_weight")]
    pub prompt_weight: f32,
    /// Fraction of the training responses sampled at `temperature` (the
    /// rest greedy).
    #[serde(default = "default_sampled_fraction")]
    pub sampled_fraction: f32,
    /// Requests decoded together while generating the data.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Compact drafts: PARD-style parallel drafting, the most tokens one
    /// forward drafts (the last real token and `parallel - 1` mask
    /// positions); 0 or 1: autoregressive only. The draft learns a mask
    /// embedding (`model.mask_embedding`) and, beside the usual next-token
    /// objective, to predict the token `d + 1` ahead from a mask at depth
    /// `d`, every depth of every position in one forward (attention masks
    /// as PARD's training).
    #[serde(default)]
    pub parallel: usize,
    /// Compact drafts: start from this compact draft's weights and draft
    /// vocabulary (a directory `distill draft` wrote, e.g. the shipped
    /// one) instead of from scratch; its shape must match.
    #[serde(default)]
    pub init: Option<PathBuf>,
}

fn default_sampled_fraction() -> f32 {
    1.0
}

fn default_concurrency() -> usize {
    8
}

fn default_max_len() -> usize {
    448
}

fn default_prompt_weight() -> f32 {
    0.5
}

impl Default for DistillConfig {
    fn default() -> Self {
        Self {
            layers: 2,
            hidden: 256,
            heads: 4,
            intermediate: 768,
            seq_len: 128,
            batch: 8,
            steps: 400,
            lr: 2e-3,
            gen_tokens: 60_000,
            gen_max_tokens: 192,
            temperature: 0.0,
            checkpoint_every: 50,
            seed: 0,
            prompt_ids: Vec::new(),
            prompts: Default::default(),
            corpus: None,
            corpus_shards: None,
            draft_vocab: 0,
            max_len: default_max_len(),
            prompt_weight: default_prompt_weight(),
            sampled_fraction: default_sampled_fraction(),
            concurrency: default_concurrency(),
            parallel: 0,
            init: None,
        }
    }
}

fn cerr(e: candle_core::Error) -> SpecdError {
    SpecdError::InvalidRequest(format!("distill: {e}"))
}

/// The trainable draft network (Hugging Face Llama layout, tied head).
struct Net {
    cfg: DistillConfig,
    /// Input embedding: the draft's own table (tied to the output), or
    /// the target's frozen table and a learned projection (compact).
    input: Input,
    /// Compact: the output head over the draft vocabulary.
    head: Option<Tensor>,
    layers: Vec<[Tensor; 9]>,
    norm: Tensor,
    /// Parallel drafting: the mask position's input embedding.
    mask: Option<Tensor>,
    cos: Tensor,
    sin: Tensor,
}

const EPS: f64 = 1e-5;

fn rms(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + EPS)?.sqrt()?)?.broadcast_mul(w)
}

enum Input {
    Tied(Tensor),
    /// (target table `vocab x H`, projection `h x H`).
    Projected(Tensor, Tensor),
}

impl Net {
    /// `compact`: (the target's embedding table `vocab x H`, draft vocab).
    fn new(
        vb: &VarBuilder,
        cfg: &DistillConfig,
        vocab: usize,
        compact: Option<(Tensor, usize)>,
    ) -> candle_core::Result<Self> {
        let (h, f) = (cfg.hidden, cfg.intermediate);
        let init = candle_nn::init::DEFAULT_KAIMING_NORMAL;
        let is_compact = compact.is_some();
        let (input, head) = match compact {
            None => (
                Input::Tied(vb.get_with_hints((vocab, h), "model.embed_tokens.weight", init)?),
                None,
            ),
            Some((table, dv)) => {
                let th = table.dim(1)?;
                let proj = vb.get_with_hints((h, th), "model.embed_proj.weight", init)?;
                let head = vb.get_with_hints((dv, h), "lm_head.weight", init)?;
                (Input::Projected(table, proj), Some(head))
            }
        };
        let mut layers = Vec::new();
        for l in 0..cfg.layers {
            let p = vb.pp(format!("model.layers.{l}"));
            let ones = candle_nn::Init::Const(1.0);
            layers.push([
                p.get_with_hints(h, "input_layernorm.weight", ones)?,
                p.get_with_hints((h, h), "self_attn.q_proj.weight", init)?,
                p.get_with_hints((h, h), "self_attn.k_proj.weight", init)?,
                p.get_with_hints((h, h), "self_attn.v_proj.weight", init)?,
                p.get_with_hints((h, h), "self_attn.o_proj.weight", init)?,
                p.get_with_hints(h, "post_attention_layernorm.weight", ones)?,
                p.get_with_hints((f, h), "mlp.gate_proj.weight", init)?,
                p.get_with_hints((f, h), "mlp.up_proj.weight", init)?,
                p.get_with_hints((h, f), "mlp.down_proj.weight", init)?,
            ]);
        }
        let norm = vb.get_with_hints(h, "model.norm.weight", candle_nn::Init::Const(1.0))?;
        let mask = if cfg.parallel > 1 && is_compact {
            Some(vb.get_with_hints(
                h,
                "model.mask_embedding",
                candle_nn::Init::Randn {
                    mean: 0.0,
                    stdev: 0.02,
                },
            )?)
        } else {
            None
        };
        let hd = h / cfg.heads;
        let theta: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / hd as f32))
            .collect();
        let t = cfg.seq_len;
        let ang: Vec<f32> = (0..t)
            .flat_map(|p| theta.iter().map(move |th| p as f32 * th))
            .collect();
        let ang = Tensor::from_vec(ang, (t, hd / 2), &Device::Cpu)?;
        let ang = Tensor::cat(&[&ang, &ang], 1)?;
        Ok(Self {
            cfg: cfg.clone(),
            input,
            head,
            layers,
            norm,
            mask,
            cos: ang.cos()?,
            sin: ang.sin()?,
        })
    }

    fn rope(&self, x: &Tensor, pos: &Tensor) -> candle_core::Result<Tensor> {
        // x: (b, heads, t, hd); NeoX pairing (i, i + hd/2) as HF Llama.
        let (_, _, _, hd) = x.dims4()?;
        let x1 = x.narrow(D::Minus1, 0, hd / 2)?;
        let x2 = x.narrow(D::Minus1, hd / 2, hd / 2)?;
        let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        let cos = self.cos.index_select(pos, 0)?;
        let sin = self.sin.index_select(pos, 0)?;
        x.broadcast_mul(&cos)? + rot.broadcast_mul(&sin)?
    }

    /// The input embedding of token ids (b, t): (b, t, hidden).
    fn embed(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let flat = ids.flatten_all()?;
        match &self.input {
            Input::Tied(e) => e.index_select(&flat, 0)?,
            Input::Projected(table, proj) => table.index_select(&flat, 0)?.matmul(&proj.t()?)?,
        }
        .reshape((b, t, self.cfg.hidden))
    }

    /// Logits (b * t, vocab) for token ids (b, t), causal.
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let t = ids.dim(1)?;
        let pos = Tensor::arange(0u32, t as u32, &Device::Cpu)?;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?;
        self.run(self.embed(ids)?, &pos, &mask)
    }

    /// PARD's training forward: token ids (b, t) followed by `k - 1`
    /// segments of t mask positions; the mask of segment d at position i
    /// stands where the draft, having seen the real tokens up to i - d,
    /// drafts position i + 1 (see `parallel_mask`). Logits (b * k * t,
    /// vocab), segment by segment within each sequence.
    fn forward_parallel(&self, ids: &Tensor, k: usize) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let mask_emb = self
            .mask
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("parallel drafting needs a mask".into()))?;
        let x0 = self.embed(ids)?;
        let m = mask_emb.reshape((1, 1, self.cfg.hidden))?.broadcast_as((
            b,
            t * (k - 1),
            self.cfg.hidden,
        ))?;
        let x = Tensor::cat(&[&x0, &m], 1)?;
        let pos: Vec<u32> = (0..k).flat_map(|_| 0..t as u32).collect();
        let pos = Tensor::from_vec(pos, k * t, &Device::Cpu)?;
        let mask = Tensor::from_vec(parallel_mask(t, k), (k * t, k * t), &Device::Cpu)?;
        self.run(x, &pos, &mask)
    }

    /// The blocks, the final norm and the head over input embeddings
    /// (b, n, hidden) at positions `pos` (n) under the additive mask (n, n).
    fn run(&self, mut x: Tensor, pos: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, nh) = (self.cfg.hidden, self.cfg.heads);
        let hd = h / nh;
        for [an, wq, wk, wv, wo, fnorm, wg, wu, wd] in &self.layers {
            let hn = rms(&x, an)?;
            let split = |w: &Tensor| -> candle_core::Result<Tensor> {
                hn.broadcast_matmul(&w.t()?)?
                    .reshape((b, t, nh, hd))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let q = self.rope(&split(wq)?, pos)?;
            let k = self.rope(&split(wk)?, pos)?;
            let v = split(wv)?;
            let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(mask)?;
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            let o = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, h))?;
            x = (x + o.broadcast_matmul(&wo.t()?)?)?;
            let hn = rms(&x, fnorm)?;
            let g = hn.broadcast_matmul(&wg.t()?)?.silu()?;
            let u = hn.broadcast_matmul(&wu.t()?)?;
            x = (x + (g * u)?.broadcast_matmul(&wd.t()?)?)?;
        }
        let x = rms(&x, &self.norm)?.reshape((b * t, h))?;
        match (&self.head, &self.input) {
            (Some(w), _) | (None, Input::Tied(w)) => x.matmul(&w.t()?),
            (None, Input::Projected(..)) => Err(candle_core::Error::Msg(
                "a projected input needs its own head".into(),
            )),
        }
    }
}

/// PARD's attention mask (additive, `k t x k t`) over a window of `t` real
/// tokens (segment 0) and `k - 1` segments of mask positions: segment 0
/// is causal; the mask of segment d at position i sees the real tokens up
/// to i - d and the masks of segments 1..=d at positions i - d + 1..=i
/// (the masks an inference forward puts before it), so every depth of
/// every position trains in one forward exactly as it drafts.
pub fn parallel_mask(t: usize, k: usize) -> Vec<f32> {
    let n = k * t;
    let mut m = vec![f32::NEG_INFINITY; n * n];
    for d in 0..k {
        for i in 0..t {
            let row = (d * t + i) * n;
            let Some(last_real) = i.checked_sub(d) else {
                // No real token before it: attend to itself only (the row
                // carries no loss; this keeps its softmax finite).
                m[row + d * t + i] = 0.0;
                continue;
            };
            for c in 0..=last_real {
                m[row + c] = 0.0;
            }
            for e in 1..=d {
                m[row + e * t + last_real + e] = 0.0;
            }
        }
    }
    m
}

/// Training progress, next to each checkpoint.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct State {
    pub step: usize,
    pub loss: f32,
    /// Loss of the first step of the run that started from scratch.
    pub first_loss: f32,
    pub config: DistillConfig,
}

fn write_config(out: &Path, cfg: &DistillConfig, vocab: usize, target: &Model) -> Result<()> {
    let c = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.heads,
        "rms_norm_eps": EPS,
        "rope_theta": 10000.0,
        "max_position_embeddings": target.config.max_seq_len,
        "tie_word_embeddings": true,
        "bos_token_id": target.config.bos_token_id,
        "eos_token_id": target.config.eos_token_ids.first(),
    });
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&c).unwrap_or_default(),
    )?;
    Ok(())
}

/// Train (or resume training) a draft for `target_path` into `out`.
pub fn distill(
    target_path: &Path,
    out: &Path,
    cfg: &DistillConfig,
    threads: usize,
) -> Result<PathBuf> {
    super::train::keep_freed_memory();
    std::fs::create_dir_all(out)?;
    let target = Arc::new(crate::model::load_model(target_path, threads)?);
    let tok = Arc::new(Tokenizer::for_model(target_path)?);
    let vocab = target.config.vocab_size;
    if cfg.heads == 0
        || !cfg.hidden.is_multiple_of(cfg.heads)
        || !(cfg.hidden / cfg.heads).is_multiple_of(2)
    {
        return Err(SpecdError::InvalidRequest(
            "distill: hidden / heads must be an even integer".into(),
        ));
    }
    if cfg.draft_vocab == 0 && (cfg.parallel > 1 || cfg.init.is_some()) {
        return Err(SpecdError::InvalidRequest(
            "distill: --parallel and --init need a compact draft (--draft-vocab > 0)".into(),
        ));
    }
    if cfg.parallel > cfg.seq_len {
        return Err(SpecdError::InvalidRequest(format!(
            "distill: --parallel {} exceeds the training window ({} tokens)",
            cfg.parallel, cfg.seq_len
        )));
    }
    if cfg.draft_vocab > 0 {
        return distill_compact(&target, &tok, out, cfg);
    }
    let data_cfg = super::DataConfig {
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
    let data = super::training_data(&target, &tok, &data_cfg, out)?;
    let stream: Vec<u32> = data.iter().flat_map(|s| s.tokens.iter().copied()).collect();
    if stream.len() < cfg.seq_len + 2 {
        return Err(SpecdError::InvalidRequest(
            "distill: not enough training text".into(),
        ));
    }
    tok.save(&out.join("tokenizer.json"))?;
    write_config(out, cfg, vocab, &target)?;

    let mut varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let net = Net::new(&vb, cfg, vocab, None).map_err(cerr)?;
    let ckpt = out.join("model.safetensors");
    let state_path = out.join("state.json");
    let mut start = 0;
    let mut first_loss = f32::NAN;
    if let Some(st) = resume(&mut varmap, &ckpt, &state_path)? {
        start = st.step;
        first_loss = st.first_loss;
    } else {
        // Tied embeddings start from the target's, projected to the draft
        // width by a fixed random Gaussian map (norms roughly preserved).
        let th = target.config.hidden;
        let mut e = vec![0f32; vocab * th];
        for r in 0..vocab {
            target
                .weights
                .embed
                .dequantize_row(r, &mut e[r * th..(r + 1) * th]);
        }
        let mut rng = Rng::new(cfg.seed ^ 0xE11B);
        let proj: Vec<f32> = (0..th * cfg.hidden)
            .map(|_| {
                let (u1, u2) = (rng.next_f64().max(1e-12), rng.next_f64());
                ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
                    / (cfg.hidden as f64).sqrt()) as f32
            })
            .collect();
        let e = Tensor::from_vec(e, (vocab, th), &Device::Cpu).map_err(cerr)?;
        let p = Tensor::from_vec(proj, (th, cfg.hidden), &Device::Cpu).map_err(cerr)?;
        let init = e.matmul(&p).map_err(cerr)?;
        let data = varmap.data().lock().unwrap_or_else(|x| x.into_inner());
        let var: &Var = data
            .get("model.embed_tokens.weight")
            .expect("created above");
        var.set(&init).map_err(cerr)?;
    }
    let (mut opt, bar) = optimizer(&varmap, cfg, start)?;
    let mut rng = Rng::new(cfg.seed.wrapping_add(start as u64));
    let mut last = f32::NAN;
    let t = cfg.seq_len;
    for step in start..cfg.steps {
        let mut inp = Vec::with_capacity(cfg.batch * t);
        let mut tgt = Vec::with_capacity(cfg.batch * t);
        for _ in 0..cfg.batch {
            let o = (rng.next_u64() % (stream.len() - t - 1) as u64) as usize;
            inp.extend_from_slice(&stream[o..o + t]);
            tgt.extend_from_slice(&stream[o + 1..o + t + 1]);
        }
        let ids = Tensor::from_vec(inp, (cfg.batch, t), &Device::Cpu).map_err(cerr)?;
        let targets = Tensor::from_vec(tgt, cfg.batch * t, &Device::Cpu).map_err(cerr)?;
        opt.set_learning_rate(lr_at(cfg, step));
        let logits = net.forward(&ids).map_err(cerr)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &targets).map_err(cerr)?;
        opt.backward_step(&loss).map_err(cerr)?;
        last = loss.to_scalar::<f32>().map_err(cerr)?;
        if first_loss.is_nan() {
            first_loss = last;
        }
        bar.set_message(format!("loss {last:.3}"));
        bar.inc(1);
        let done = step + 1;
        if done % cfg.checkpoint_every.max(1) == 0 || done == cfg.steps {
            checkpoint(&varmap, &ckpt, &state_path, cfg, done, last, first_loss)?;
        }
    }
    bar.finish_and_clear();
    if start >= cfg.steps && !ckpt.exists() {
        varmap.save(&ckpt).map_err(cerr)?;
    }
    eprintln!(
        "specd distill: {} steps, final loss {last:.3}, draft in {} ({} layers, hidden {}, {} params)",
        cfg.steps,
        out.display(),
        cfg.layers,
        cfg.hidden,
        varmap.all_vars().iter().map(|v| v.elem_count()).sum::<usize>()
    );
    Ok(out.to_path_buf())
}

/// Load the checkpoint and state of an interrupted run, if there are both.
fn resume(varmap: &mut VarMap, ckpt: &Path, state_path: &Path) -> Result<Option<State>> {
    let (true, Ok(s)) = (ckpt.exists(), std::fs::read_to_string(state_path)) else {
        return Ok(None);
    };
    let st: State = serde_json::from_str(&s)
        .map_err(|e| SpecdError::InvalidRequest(format!("{}: {e}", state_path.display())))?;
    varmap.load(ckpt).map_err(cerr)?;
    eprintln!(
        "specd distill: resuming at step {} (loss {:.3})",
        st.step, st.loss
    );
    Ok(Some(st))
}

/// Save the variables and, beside them, the state of a run `done` steps
/// in (the state last, so a resume never sees a state without its
/// checkpoint).
fn checkpoint(
    varmap: &VarMap,
    ckpt: &Path,
    state_path: &Path,
    cfg: &DistillConfig,
    done: usize,
    loss: f32,
    first_loss: f32,
) -> Result<()> {
    varmap.save(ckpt).map_err(cerr)?;
    let st = State {
        step: done,
        loss,
        first_loss,
        config: cfg.clone(),
    };
    std::fs::write(
        state_path,
        serde_json::to_string_pretty(&st).unwrap_or_default(),
    )?;
    Ok(())
}

/// AdamW over every variable, and the progress bar of a run from `start`.
fn optimizer(
    varmap: &VarMap,
    cfg: &DistillConfig,
    start: usize,
) -> Result<(candle_nn::AdamW, indicatif::ProgressBar)> {
    let opt = candle_nn::AdamW::new(
        varmap.all_vars(),
        candle_nn::ParamsAdamW {
            lr: cfg.lr,
            weight_decay: 0.0,
            ..Default::default()
        },
    )
    .map_err(cerr)?;
    let bar = indicatif::ProgressBar::new(cfg.steps as u64);
    bar.set_position(start as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} step {pos}/{len}  {msg}  {elapsed} elapsed, ~{eta} left",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Ok((opt, bar))
}

/// Learning rate at `step`: linear warm-up, then cosine decay to a tenth.
fn lr_at(cfg: &DistillConfig, step: usize) -> f64 {
    let warm = 20.min(cfg.steps / 10).max(1);
    if step < warm {
        cfg.lr * (step + 1) as f64 / warm as f64
    } else {
        let p = (step - warm) as f64 / (cfg.steps - warm).max(1) as f64;
        cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * p).cos()))
    }
}

/// Write a compact draft: `config.json` (Llama keys plus
/// `draft_vocab_size`, `embed_from_target`, `target_hidden_size`,
/// `target_vocab_fingerprint`) and `model.safetensors` (F16 weights and
/// `d2t` I64 with `d2t[i] = target_id - i`, EAGLE-3's convention).
fn write_compact(
    out: &Path,
    cfg: &DistillConfig,
    varmap: &VarMap,
    vocab_ids: &[u32],
    target: &Model,
    fingerprint: &str,
) -> Result<()> {
    use crate::model::tensor_file::{self, TensorData};
    let data = varmap.data().lock().unwrap_or_else(|x| x.into_inner());
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut tensors = Vec::new();
    for n in names {
        let t = data[n].as_tensor();
        let v = t
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(cerr)?;
        tensors.push((n.clone(), t.dims().to_vec(), TensorData::F16(v)));
    }
    drop(data);
    let d2t: Vec<i64> = vocab_ids
        .iter()
        .enumerate()
        .map(|(i, &t)| i64::from(t) - i as i64)
        .collect();
    tensors.push(("d2t".into(), vec![vocab_ids.len()], TensorData::I64(d2t)));
    tensor_file::write(&out.join("model.safetensors"), &tensors)
        .map_err(|e| SpecdError::InvalidRequest(format!("distill: {e}")))?;
    let c = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": target.config.vocab_size,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.heads,
        "rms_norm_eps": EPS,
        "rope_theta": 10000.0,
        "max_position_embeddings": target.config.max_seq_len,
        "tie_word_embeddings": false,
        "bos_token_id": target.config.bos_token_id,
        "eos_token_id": target.config.eos_token_ids.first(),
        "draft_vocab_size": vocab_ids.len(),
        "embed_from_target": true,
        "target_hidden_size": target.config.hidden,
        "target_vocab_fingerprint": fingerprint,
    });
    let mut c = c;
    if cfg.parallel > 1 {
        c["parallel_draft"] = serde_json::json!(cfg.parallel);
    }
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&c).unwrap_or_default(),
    )?;
    Ok(())
}

/// A compact draft to start from (`cfg.init`): its draft vocabulary (target
/// ids, from `d2t`) and its tensors, after checking that its shape is the
/// one `cfg` trains.
fn read_init(
    dir: &Path,
    cfg: &DistillConfig,
    vocab: usize,
) -> Result<(Vec<u32>, std::collections::HashMap<String, Tensor>)> {
    let bad = |what: String| {
        SpecdError::InvalidRequest(format!("distill: --init {}: {what}", dir.display()))
    };
    let text = std::fs::read_to_string(dir.join("config.json"))
        .map_err(|e| bad(format!("config.json: {e}")))?;
    let c: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("config.json: {e}")))?;
    for (key, want) in [
        ("num_hidden_layers", cfg.layers),
        ("hidden_size", cfg.hidden),
        ("num_attention_heads", cfg.heads),
        ("intermediate_size", cfg.intermediate),
    ] {
        let got = c.get(key).and_then(|v| v.as_u64());
        if got != Some(want as u64) {
            return Err(bad(format!(
                "config.json has {key} {got:?}, this run trains {want}"
            )));
        }
    }
    if c.get("embed_from_target").and_then(|v| v.as_bool()) != Some(true) {
        return Err(bad("not a compact draft (no `embed_from_target`)".into()));
    }
    let file = dir.join("model.safetensors");
    let tensors = candle_core::safetensors::load(&file, &Device::Cpu)
        .map_err(|e| bad(format!("model.safetensors: {e}")))?;
    let d2t = tensors
        .get("d2t")
        .ok_or_else(|| bad("model.safetensors lacks d2t".into()))?
        .to_dtype(DType::I64)
        .and_then(|t| t.to_vec1::<i64>())
        .map_err(cerr)?;
    let mut seen = vec![false; vocab];
    let mut ids = Vec::with_capacity(d2t.len());
    for (i, d) in d2t.iter().enumerate() {
        let id = i as i64 + d;
        if id < 0 || id as usize >= vocab || seen[id as usize] {
            return Err(bad(format!(
                "d2t row {i} maps to {id}, not a distinct id below {vocab}"
            )));
        }
        seen[id as usize] = true;
        ids.push(id as u32);
    }
    Ok((ids, tensors))
}

/// The compact draft (`cfg.draft_vocab > 0`): the target's embedding
/// through a learned projection, `cfg.layers` Llama blocks, and a head over
/// the draft vocabulary, trained on the target's own distribution at every
/// position of its responses (and, weighted `prompt_weight`, of the
/// prompts). Data and final-normed target states live in `<out>/train/`
/// (the layout `distill eagle` writes, so its cache can be reused).
fn distill_compact(
    target: &Arc<Model>,
    tok: &Arc<Tokenizer>,
    out: &Path,
    cfg: &DistillConfig,
) -> Result<PathBuf> {
    let train_dir = out.join("train");
    std::fs::create_dir_all(&train_dir)?;
    let tc = target.config.clone();
    let (th, vocab) = (tc.hidden, tc.vocab_size);
    let data_cfg = super::DataConfig {
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
    let mut samples = super::training_data(target, tok, &data_cfg, &train_dir)?;
    super::train::truncate(&mut samples, cfg.max_len);
    let feats = super::train::extract_features(
        target,
        &samples,
        &[tc.layers],
        &train_dir.join("features.safetensors"),
    )?;
    let init = cfg
        .init
        .as_deref()
        .map(|d| read_init(d, cfg, vocab))
        .transpose()?;
    let vocab_ids = match &init {
        Some((ids, _)) => ids.clone(),
        None => {
            super::train::choose_draft_vocab(&samples, cfg.draft_vocab, vocab, &tc.eos_token_ids)
        }
    };
    let dv = vocab_ids.len();
    // The stream of every sample, and each row's loss weight: the row at
    // position p learns the target's distribution there (which predicts
    // p + 1); a sample's last row would predict across into the next.
    let mut stream = Vec::new();
    let mut weight = Vec::new();
    for s in &samples {
        let n = s.tokens.len();
        stream.extend_from_slice(&s.tokens);
        weight.extend((0..n).map(|p| {
            if p + 1 >= n {
                0.0
            } else if p + 1 >= s.prompt_len {
                1.0
            } else {
                cfg.prompt_weight
            }
        }));
    }
    let t = cfg.seq_len;
    if stream.len() < t + 2 || feats.argmax.len() != stream.len() || !feats.has(tc.layers) {
        return Err(SpecdError::InvalidRequest(
            "distill: not enough training text".into(),
        ));
    }
    let fingerprint = vocab_fingerprint((0..vocab as u32).map(|i| tok.id_to_token(i)));
    let dev = Device::Cpu;
    let table =
        Tensor::from_vec(super::eagle::embedding_table(target), (vocab, th), &dev).map_err(cerr)?;
    let rows = super::medusa::target_head_rows(target, &vocab_ids);
    let target_head = Tensor::from_vec(rows, (dv, th), &dev).map_err(cerr)?;

    let mut varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let net = Net::new(&vb, cfg, vocab, Some((table, dv))).map_err(cerr)?;
    let ckpt = train_dir.join("draft-checkpoint.safetensors");
    let state_path = out.join("state.json");
    let mut start = 0;
    let mut first_loss = f32::NAN;
    if let Some(st) = resume(&mut varmap, &ckpt, &state_path)? {
        start = st.step;
        first_loss = st.first_loss;
    } else if let Some((_, weights)) = &init {
        // A warm start: every tensor the initial draft has (the mask
        // embedding of a first parallel run starts fresh).
        let data = varmap.data().lock().unwrap_or_else(|x| x.into_inner());
        for (name, var) in data.iter() {
            if let Some(t) = weights.get(name) {
                if t.dims() != var.dims() {
                    return Err(SpecdError::InvalidRequest(format!(
                        "distill: --init tensor {name} has shape {:?}, this draft's is {:?}",
                        t.dims(),
                        var.dims()
                    )));
                }
                var.set(&t.to_dtype(DType::F32).map_err(cerr)?)
                    .map_err(cerr)?;
            } else if name != "model.mask_embedding" {
                return Err(SpecdError::InvalidRequest(format!(
                    "distill: --init lacks tensor {name}"
                )));
            }
        }
    } else {
        // The projection starts as a fixed random Gaussian map (norms
        // roughly preserved) and the head as the target's head rows seen
        // through it, so step 0 starts near a projected logit lens.
        let mut rng = Rng::new(cfg.seed ^ 0xE11B);
        let proj: Vec<f32> = (0..cfg.hidden * th)
            .map(|_| {
                let (u1, u2) = (rng.next_f64().max(1e-12), rng.next_f64());
                ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
                    / (cfg.hidden as f64).sqrt()) as f32
            })
            .collect();
        let p = Tensor::from_vec(proj, (cfg.hidden, th), &dev).map_err(cerr)?;
        let head0 = target_head.matmul(&p.t().map_err(cerr)?).map_err(cerr)?;
        let data = varmap.data().lock().unwrap_or_else(|x| x.into_inner());
        for (name, value) in [("model.embed_proj.weight", &p), ("lm_head.weight", &head0)] {
            data.get(name)
                .expect("created above")
                .set(value)
                .map_err(cerr)?;
        }
    }
    let params: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
    eprintln!(
        "specd distill: compact draft, {} layers, hidden {}, draft vocabulary {dv}, {params} parameters, {} training rows",
        cfg.layers,
        cfg.hidden,
        stream.len()
    );
    let (mut opt, bar) = optimizer(&varmap, cfg, start)?;
    let mut rng = Rng::new(cfg.seed.wrapping_add(start as u64));
    let mut last = f32::NAN;
    // Segments per window: the real tokens, then one per mask depth.
    let k = if net.mask.is_some() { cfg.parallel } else { 1 };
    // Top-1 agreement with the target on response rows, by depth.
    let mut agree = vec![(0usize, 0usize); k];
    for step in start..cfg.steps {
        let n = cfg.batch * t;
        let mut inp = Vec::with_capacity(n);
        let mut w = Vec::with_capacity(n);
        let mut f = Vec::with_capacity(n * th);
        for _ in 0..cfg.batch {
            let o = (rng.next_u64() % (stream.len() - t) as u64) as usize;
            inp.extend_from_slice(&stream[o..o + t]);
            w.extend_from_slice(&weight[o..o + t]);
            feats.extend(tc.layers, o, t, &mut f)?;
        }
        let wsum: f32 = w.iter().sum();
        if wsum <= 0.0 {
            continue;
        }
        let ids = Tensor::from_vec(inp, (cfg.batch, t), &dev).map_err(cerr)?;
        let f = Tensor::from_vec(f, (n, th), &dev).map_err(cerr)?;
        // The target's distribution on the draft vocabulary (renormalised).
        let p = candle_nn::ops::softmax(
            &f.matmul(&target_head.t().map_err(cerr)?).map_err(cerr)?,
            D::Minus1,
        )
        .map_err(cerr)?;
        // Every segment learns the distribution at its position; the mask
        // of depth d at position i only where a real token precedes it.
        let (p, w, wsum) = if k > 1 {
            let p = p
                .reshape((cfg.batch, 1, t, dv))
                .and_then(|p| p.broadcast_as((cfg.batch, k, t, dv)))
                .and_then(|p| p.contiguous())
                .and_then(|p| p.reshape((cfg.batch * k * t, dv)))
                .map_err(cerr)?;
            let mut wk = Vec::with_capacity(n * k);
            for b in 0..cfg.batch {
                for d in 0..k {
                    wk.extend((0..t).map(|i| if i >= d { w[b * t + i] } else { 0.0 }));
                }
            }
            let wsum: f32 = wk.iter().sum();
            (p, wk, wsum)
        } else {
            (p, w, wsum)
        };
        let wt = Tensor::from_vec(w.clone(), (w.len(), 1), &dev).map_err(cerr)?;
        opt.set_learning_rate(lr_at(cfg, step));
        let logits = if k > 1 {
            net.forward_parallel(&ids, k)
        } else {
            net.forward(&ids)
        }
        .map_err(cerr)?;
        let lsm = candle_nn::ops::log_softmax(&logits, D::Minus1).map_err(cerr)?;
        let loss = ((p.clone() * lsm)
            .map_err(cerr)?
            .sum_keepdim(D::Minus1)
            .map_err(cerr)?
            * wt)
            .map_err(cerr)?
            .sum_all()
            .map_err(cerr)?
            .affine(-1.0 / f64::from(wsum), 0.0)
            .map_err(cerr)?;
        opt.backward_step(&loss).map_err(cerr)?;
        last = loss.to_scalar::<f32>().map_err(cerr)?;
        // Top-1 agreement with the target on response rows (a running
        // estimate of acceptance@1 on the training stream).
        let (a, b) = (
            logits
                .argmax(D::Minus1)
                .and_then(|x| x.to_vec1::<u32>())
                .map_err(cerr)?,
            p.argmax(D::Minus1)
                .and_then(|x| x.to_vec1::<u32>())
                .map_err(cerr)?,
        );
        for r in 0..w.len() {
            if w[r] >= 1.0 {
                let d = (r / t) % k;
                agree[d].1 += 1;
                agree[d].0 += usize::from(a[r] == b[r]);
            }
        }
        if first_loss.is_nan() {
            first_loss = last;
        }
        let by_depth = agree
            .iter()
            .map(|(a, n)| format!("{:.3}", *a as f64 / (*n).max(1) as f64))
            .collect::<Vec<_>>()
            .join(" / ");
        bar.set_message(format!("loss {last:.3}, top-1 agreement {by_depth}"));
        bar.inc(1);
        let done = step + 1;
        if done % cfg.checkpoint_every.max(1) == 0 || done == cfg.steps {
            eprintln!(
                "specd distill: step {done}: loss {last:.3}, top-1 agreement since the last checkpoint (by mask depth) {by_depth}"
            );
            agree.iter_mut().for_each(|a| *a = (0, 0));
            write_compact(out, cfg, &varmap, &vocab_ids, target, &fingerprint)?;
            checkpoint(&varmap, &ckpt, &state_path, cfg, done, last, first_loss)?;
        }
    }
    bar.finish_and_clear();
    if !out.join("model.safetensors").exists() {
        write_compact(out, cfg, &varmap, &vocab_ids, target, &fingerprint)?;
    }
    eprintln!(
        "specd distill: {} steps, final loss {last:.3}, compact draft in {} ({} layers, hidden {}, draft vocabulary {dv}, {params} parameters)",
        cfg.steps,
        out.display(),
        cfg.layers,
        cfg.hidden,
    );
    Ok(out.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::parallel_mask;

    /// The rows an inference forward sees: real tokens up to `i - d`, then
    /// the masks of depths 1..=d, each at its own position.
    #[test]
    fn the_parallel_mask_sees_what_an_inference_forward_sees() {
        let (t, k) = (4, 3);
        let m = parallel_mask(t, k);
        let n = t * k;
        let sees = |d: usize, i: usize| -> Vec<(usize, usize)> {
            (0..n)
                .filter(|c| m[(d * t + i) * n + c] == 0.0)
                .map(|c| (c / t, c % t))
                .collect()
        };
        // Segment 0 is causal.
        assert_eq!(sees(0, 2), vec![(0, 0), (0, 1), (0, 2)]);
        // Depth 1 at position 2: real 0..=1, then itself.
        assert_eq!(sees(1, 2), vec![(0, 0), (0, 1), (1, 2)]);
        // Depth 2 at position 3: real 0..=1, the depth-1 mask at 2, itself.
        assert_eq!(sees(2, 3), vec![(0, 0), (0, 1), (1, 2), (2, 3)]);
        // A depth with no real token before it sees only itself.
        assert_eq!(sees(2, 1), vec![(2, 1)]);
        // No row sees a later position or another row's future.
        for d in 0..k {
            for i in 0..t {
                assert!(sees(d, i).iter().all(|&(_, c)| c <= i));
            }
        }
    }
}
