//! Compact drafts: a small Llama that reads the target's embedding through
//! a learned projection and predicts over a reduced draft vocabulary
//! (written by `specd distill draft` with `--draft-vocab`).
//!
//! Files: `config.json` (Llama keys, `vocab_size` = the target's, plus
//! `draft_vocab_size`, `embed_from_target`, `target_hidden_size`,
//! `target_vocab_fingerprint`) and `model.safetensors` (the blocks,
//! `model.norm.weight`, `model.embed_proj.weight` `hidden x H`,
//! `lm_head.weight` `draft_vocab_size x hidden`, `d2t` I64). A draft
//! trained for parallel drafting (`--parallel K`) also has
//! `parallel_draft` = K in its config and `model.mask_embedding`
//! (`hidden`), loaded as one more embedding row after the target's
//! vocabulary: the mask token.
//!
//! Invariant: a loaded compact draft is paired with a target of the same
//! vocabulary (fingerprint of every token string) and hidden width; every
//! `d2t` entry maps to a distinct target id.

use std::collections::HashMap;
use std::path::Path;

use specd_model::Model;
use specd_plugin_sdk::Host;

use candle_core::{self as candle, DType, Device, Tensor};

/// The output head of a compact draft.
pub struct Head {
    /// `rows x hidden`, row-major.
    w: Vec<f32>,
    hidden: usize,
    /// Target id of each row.
    ids: Vec<u32>,
    /// Parallel drafting (PARD): the most tokens one forward drafts (the
    /// config's `parallel_draft`), and the model's token id of the mask
    /// position (an extra embedding row); `None` without a mask embedding.
    parallel: Option<(usize, u32)>,
}

impl Head {
    /// Rows of the head (the draft vocabulary).
    pub fn rows(&self) -> usize {
        self.ids.len()
    }

    /// Logits over the draft vocabulary for one final-normed state.
    pub fn logits(&self, x: &[f32]) -> Vec<f32> {
        self.w
            .chunks_exact(self.hidden)
            .map(|row| dot(row, x))
            .collect()
    }

    /// Parallel drafting: the most tokens one forward drafts and the mask
    /// token's id in the draft model (one past the target's vocabulary).
    pub fn parallel(&self) -> Option<(usize, u32)> {
        self.parallel
    }

    /// The target id of draft row `i`.
    pub fn target_id(&self, i: u32) -> u32 {
        self.ids[i as usize]
    }

    /// A distribution over the draft vocabulary as one over the target's
    /// `vocab` ids (zero elsewhere).
    pub fn scatter(&self, q: &[f32], vocab: usize) -> Vec<f32> {
        let mut out = vec![0f32; vocab];
        for (&id, &p) in self.ids.iter().zip(q) {
            out[id as usize] = p;
        }
        out
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Whether `path` is a compact draft's directory.
pub fn is_compact(path: &Path) -> bool {
    std::fs::read_to_string(path.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|c| c.get("embed_from_target").and_then(|v| v.as_bool()))
        .unwrap_or(false)
}

/// Load a compact draft from its directory.
pub fn load_dir(dir: &Path, host: &Host, threads: usize) -> Result<(Model, Head), String> {
    let cfg_path = dir.join("config.json");
    let config = std::fs::read_to_string(&cfg_path)
        .map_err(|e| format!("draft model {}: {e}", cfg_path.display()))?;
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).map_err(|e| format!("draft model {}: {e}", file.display()))?;
    load(&file.display().to_string(), &config, &bytes, host, threads)
}

#[cfg(feature = "builtin-model")]
mod builtin {
    pub const CONFIG: &str = include_str!("../models/smollm2-135m-instruct/config.json");
    pub const WEIGHTS: &[u8] = include_bytes!("../models/smollm2-135m-instruct/model.safetensors");
}

/// The compact draft trained for SmolLM2-135M-Instruct, compiled in.
pub fn builtin(host: &Host, threads: usize) -> Result<(Model, Head), String> {
    #[cfg(feature = "builtin-model")]
    {
        load(
            "builtin:smollm2-135m-instruct",
            builtin::CONFIG,
            builtin::WEIGHTS,
            host,
            threads,
        )
    }
    #[cfg(not(feature = "builtin-model"))]
    {
        let _ = (host, threads);
        Err(
            "option `model`: the draft model's path is required (this build has no built-in draft)"
                .into(),
        )
    }
}

fn usize_key(c: &serde_json::Value, key: &str, origin: &str) -> Result<usize, String> {
    c.get(key)
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .ok_or_else(|| format!("draft model {origin}: config.json lacks `{key}`"))
}

/// Load a compact draft from its config text and safetensors bytes;
/// `origin` names the weights in errors.
pub fn load(
    origin: &str,
    config: &str,
    bytes: &[u8],
    host: &Host,
    threads: usize,
) -> Result<(Model, Head), String> {
    let mut c: serde_json::Value = serde_json::from_str(config)
        .map_err(|e| format!("draft model {origin}: config.json: {e}"))?;
    let vocab = usize_key(&c, "vocab_size", origin)?;
    let hidden = usize_key(&c, "hidden_size", origin)?;
    let dv = usize_key(&c, "draft_vocab_size", origin)?;
    let th = usize_key(&c, "target_hidden_size", origin)?;
    if vocab != host.vocab_size() {
        return Err(format!(
            "draft model {origin}: vocabulary mismatch: the draft was trained for a target of {vocab} tokens, this target has {}",
            host.vocab_size()
        ));
    }
    if th != host.hidden_size() {
        return Err(format!(
            "draft model {origin}: the draft reads a target embedding of width {th}, this target's is {}",
            host.hidden_size()
        ));
    }
    let want = c
        .get("target_vocab_fingerprint")
        .and_then(|v| v.as_str())
        .ok_or_else(|| {
            format!("draft model {origin}: config.json lacks `target_vocab_fingerprint`")
        })?
        .to_string();
    if host.token_text(0).is_none() {
        return Err(
            "cannot check the vocabulary: the host offers no token strings (no target tokenizer)"
                .into(),
        );
    }
    let got =
        specd_model::tokenizer::vocab_fingerprint((0..vocab as u32).map(|i| host.token_text(i)));
    if got != want {
        return Err(format!(
            "draft model {origin}: vocabulary mismatch: the draft was trained for another tokenizer (fingerprint {want}, this target's {got})"
        ));
    }
    let mut tensors: HashMap<String, Tensor> =
        candle::safetensors::load_buffer(bytes, &Device::Cpu)
            .map_err(|e| format!("draft model {origin}: {e}"))?;
    let mut take = |name: &str, shape: &[usize]| -> Result<Tensor, String> {
        let t = tensors.remove(name).ok_or_else(|| {
            format!("draft model {origin}: missing tensor {name} (expected shape {shape:?})")
        })?;
        if t.dims() != shape {
            return Err(format!(
                "draft model {origin}: tensor {name} has shape {:?}, expected {shape:?}",
                t.dims()
            ));
        }
        Ok(t)
    };
    let f32s = |t: Tensor, name: &str| -> Result<Vec<f32>, String> {
        t.to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| format!("draft model {origin}: tensor {name}: {e}"))
    };
    let proj = take("model.embed_proj.weight", &[hidden, th])?;
    let head = f32s(take("lm_head.weight", &[dv, hidden])?, "lm_head.weight")?;
    let d2t = take("d2t", &[dv])?
        .to_dtype(DType::I64)
        .and_then(|t| t.to_vec1::<i64>())
        .map_err(|e| format!("draft model {origin}: tensor d2t: {e}"))?;
    let mut seen = vec![false; vocab];
    let mut ids = Vec::with_capacity(dv);
    for (i, off) in d2t.iter().enumerate() {
        let id = i as i64 + off;
        if id < 0 || id as usize >= vocab || seen[id as usize] {
            return Err(format!(
                "draft model {origin}: tensor d2t: row {i} maps to {id}, not a distinct id below {vocab}"
            ));
        }
        seen[id as usize] = true;
        ids.push(id as u32);
    }
    // The draft's embedding: the target's rows through the projection.
    let proj_t = proj
        .to_dtype(DType::F32)
        .and_then(|p| p.t())
        .map_err(|e| format!("draft model {origin}: {e}"))?;
    let mut embed = Vec::with_capacity(vocab * hidden);
    for start in (0..vocab).step_by(4096) {
        let ids: Vec<u32> = (start as u32..(start + 4096).min(vocab) as u32).collect();
        let rows = host
            .embed(&ids)
            .ok_or("the host cannot embed tokens (ABI 2 or later needed)")?;
        let part = Tensor::from_vec(rows, (ids.len(), th), &Device::Cpu)
            .and_then(|e| e.matmul(&proj_t))
            .and_then(|e| e.flatten_all())
            .and_then(|e| e.to_vec1::<f32>())
            .map_err(|e| format!("draft model {origin}: {e}"))?;
        embed.extend(part);
    }
    // Parallel drafting: the mask embedding becomes one more row, the
    // token id `vocab` (never a target token).
    let parallel = match c.get("parallel_draft").and_then(|v| v.as_u64()) {
        Some(k) if k > 1 => {
            let m = f32s(
                take("model.mask_embedding", &[hidden])?,
                "model.mask_embedding",
            )?;
            embed.extend(m);
            Some((k as usize, vocab as u32))
        }
        _ => {
            tensors.remove("model.mask_embedding");
            None
        }
    };
    let rows = vocab + usize::from(parallel.is_some());
    let embed = Tensor::from_vec(embed, (rows, hidden), &Device::Cpu)
        .map_err(|e| format!("draft model {origin}: {e}"))?;
    tensors.insert("model.embed_tokens.weight".into(), embed);
    // The model itself: a plain Llama whose (tied) output is never used.
    c["tie_word_embeddings"] = serde_json::Value::Bool(true);
    c["vocab_size"] = serde_json::json!(rows);
    let model =
        specd_model::load::model_from_tensors(Path::new(origin), &c.to_string(), tensors, threads)
            .map_err(|e| format!("draft model: {e}"))?;
    Ok((
        model,
        Head {
            w: head,
            hidden,
            ids,
            parallel,
        },
    ))
}
