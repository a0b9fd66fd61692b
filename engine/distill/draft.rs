//! `specd distill draft`: train a small Llama draft for a target by
//! self-distillation on CPU (candle autograd).
//!
//! 1. The target answers the training prompts (see the parent module);
//!    the samples are cached in `<out>/samples.json`.
//! 2. A small Llama with the target's tokenizer and tied embeddings
//!    (initialised from the target's, projected to the draft width) learns
//!    next-token cross-entropy on those streams with AdamW.
//! 3. Checkpoints (`<out>/model.safetensors` + `state.json`) are written
//!    every `checkpoint_every` steps and training resumes from them; the
//!    output directory is loadable as a safetensors model (config.json,
//!    tokenizer.json) and by the `draft` proposer plugin.
//!
//! Invariant: parameter names are Hugging Face Llama names, so the engine's
//! loader reads a checkpoint as it reads any safetensors model.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{Optimizer, VarBuilder, VarMap};

use crate::error::{Result, SpecdError};
use crate::model::Model;
use crate::sampler::Rng;
use crate::tokenizer::Tokenizer;

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
        }
    }
}

fn cerr(e: candle_core::Error) -> SpecdError {
    SpecdError::InvalidRequest(format!("distill: {e}"))
}

/// The trainable draft network (Hugging Face Llama layout, tied head).
struct Net {
    cfg: DistillConfig,
    embed: Tensor,
    layers: Vec<[Tensor; 9]>,
    norm: Tensor,
    cos: Tensor,
    sin: Tensor,
}

const EPS: f64 = 1e-5;

fn rms(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + EPS)?.sqrt()?)?.broadcast_mul(w)
}

impl Net {
    fn new(vb: &VarBuilder, cfg: &DistillConfig, vocab: usize) -> candle_core::Result<Self> {
        let (h, f) = (cfg.hidden, cfg.intermediate);
        let init = candle_nn::init::DEFAULT_KAIMING_NORMAL;
        let embed = vb.get_with_hints((vocab, h), "model.embed_tokens.weight", init)?;
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
            embed,
            layers,
            norm,
            cos: ang.cos()?,
            sin: ang.sin()?,
        })
    }

    fn rope(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // x: (b, heads, t, hd); NeoX pairing (i, i + hd/2) as HF Llama.
        let (_, _, t, hd) = x.dims4()?;
        let x1 = x.narrow(D::Minus1, 0, hd / 2)?;
        let x2 = x.narrow(D::Minus1, hd / 2, hd / 2)?;
        let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        let cos = self.cos.narrow(0, 0, t)?;
        let sin = self.sin.narrow(0, 0, t)?;
        x.broadcast_mul(&cos)? + rot.broadcast_mul(&sin)?
    }

    /// Logits (b * t, vocab) for token ids (b, t).
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let (h, nh) = (self.cfg.hidden, self.cfg.heads);
        let hd = h / nh;
        let mut x = self
            .embed
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, h))?;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?;
        for [an, wq, wk, wv, wo, fnorm, wg, wu, wd] in &self.layers {
            let hn = rms(&x, an)?;
            let split = |w: &Tensor| -> candle_core::Result<Tensor> {
                hn.broadcast_matmul(&w.t()?)?
                    .reshape((b, t, nh, hd))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let q = self.rope(&split(wq)?)?;
            let k = self.rope(&split(wk)?)?;
            let v = split(wv)?;
            let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(&mask)?;
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            let o = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, h))?;
            x = (x + o.broadcast_matmul(&wo.t()?)?)?;
            let hn = rms(&x, fnorm)?;
            let g = hn.broadcast_matmul(&wg.t()?)?.silu()?;
            let u = hn.broadcast_matmul(&wu.t()?)?;
            x = (x + (g * u)?.broadcast_matmul(&wd.t()?)?)?;
        }
        let x = rms(&x, &self.norm)?.reshape((b * t, h))?;
        x.matmul(&self.embed.t()?)
    }
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
    let data_cfg = super::DataConfig {
        gen_tokens: cfg.gen_tokens,
        gen_max_tokens: cfg.gen_max_tokens,
        temperature: cfg.temperature,
        sampled_fraction: 1.0,
        concurrency: 8,
        seed: cfg.seed,
        prompt_ids: cfg.prompt_ids.clone(),
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
    let net = Net::new(&vb, cfg, vocab).map_err(cerr)?;
    let ckpt = out.join("model.safetensors");
    let state_path = out.join("state.json");
    let mut start = 0;
    let mut first_loss = f32::NAN;
    if let (true, Ok(s)) = (ckpt.exists(), std::fs::read_to_string(&state_path)) {
        let st: State = serde_json::from_str(&s)
            .map_err(|e| SpecdError::InvalidRequest(format!("{}: {e}", state_path.display())))?;
        varmap.load(&ckpt).map_err(cerr)?;
        start = st.step;
        first_loss = st.first_loss;
        eprintln!(
            "specd distill: resuming at step {start} (loss {:.3})",
            st.loss
        );
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
    let mut opt = candle_nn::AdamW::new(
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
        // Cosine decay after a short warm-up.
        let warm = 20.min(cfg.steps / 10).max(1);
        let lr = if step < warm {
            cfg.lr * (step + 1) as f64 / warm as f64
        } else {
            let p = (step - warm) as f64 / (cfg.steps - warm).max(1) as f64;
            cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * p).cos()))
        };
        opt.set_learning_rate(lr);
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
            varmap.save(&ckpt).map_err(cerr)?;
            let st = State {
                step: done,
                loss: last,
                first_loss,
                config: cfg.clone(),
            };
            std::fs::write(
                &state_path,
                serde_json::to_string_pretty(&st).unwrap_or_default(),
            )?;
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
