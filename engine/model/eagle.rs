//! The EAGLE draft head: its configuration, its weights as the engine's
//! kernels want them, loading from the public checkpoint layouts, and one
//! batched forward over rows of (feature, token embedding) pairs with a
//! per-sequence KV cache.
//!
//! EAGLE-3 (Li et al. 2025): `g = fc(cat[F_low, F_mid, F_high])` on target
//! features (or the previous step's output); `u = cat[input_layernorm(e),
//! hidden_norm(g)]` (2h wide, embedding first); `a = g + o(Attn(u))`
//! (`specd_normed_residual`, a specd extension: `a = hidden_norm(g) +
//! o(Attn(u))`); `y = a + MLP(post_attention_layernorm(a))`; logits over the draft
//! vocabulary `lm_head(norm(y))`; `y` feeds the next step; draft id `i` is
//! target id `i + d2t[i]`.
//!
//! EAGLE-1 (Li et al. 2024): `x = fc(cat[e, f])` (+ bias) on the target's
//! final-normed hidden state `f`; layer 0 without an input norm:
//! `a = x + Attn(x)`, `y = a + MLP(post_attention_layernorm(a))`; logits are
//! the target's output head on `y`.
//!
//! Invariant: every load error names the file, the tensor and the expected
//! shape; a head whose hidden size or vocabulary does not match the target
//! is refused.

use std::path::Path;

use super::kernels::{matmul_many, rms_norm, silu_mul, wants_q8, Activations, KernelPath};
use super::tensor_file::TensorFile;
use super::{QMatrix, RopeScaling};

/// Which published head layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    Eagle1,
    Eagle3,
    /// A DeepSeek-V3-style multi-token-prediction module (`model::mtp`):
    /// `x = eh_proj(cat[enorm(e), hnorm(f)])` on the final-normed state,
    /// one standard pre-norm decoder layer, then its own norm and output
    /// head (or the target's).
    Mtp,
}

#[derive(Debug, Clone)]
pub struct HeadConfig {
    pub variant: Variant,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// Rotary scaling from the head's `rope_scaling` (public Llama 3.1
    /// heads carry the target's `llama3` scaling; `linear` too).
    pub rope_scaling: RopeScaling,
    /// The target's hidden size (features are `features x target_hidden`).
    pub target_hidden: usize,
    /// Target layers whose features the head reads (EAGLE-3: three; EAGLE-1:
    /// the final-normed state).
    pub feature_layers: Vec<usize>,
    /// Rows of the draft vocabulary (the target's for EAGLE-1).
    pub draft_vocab: usize,
    /// EAGLE-3 with the layer's residual stream starting from
    /// `hidden_norm(g)` instead of `g` (a specd extension, config.json's
    /// `specd_normed_residual`; `specd distill eagle --normed-residual`).
    pub normed_residual: bool,
}

impl HeadConfig {
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Width of the attention input (2h for EAGLE-3, h for EAGLE-1).
    pub fn attn_in(&self) -> usize {
        match self.variant {
            Variant::Eagle3 => 2 * self.hidden,
            Variant::Eagle1 | Variant::Mtp => self.hidden,
        }
    }
}

/// The head's weights.
#[derive(Debug)]
pub struct Head {
    pub cfg: HeadConfig,
    pub fc: QMatrix,
    pub fc_bias: Option<Vec<f32>>,
    pub input_norm: Option<Vec<f32>>,
    pub hidden_norm: Option<Vec<f32>>,
    pub post_norm: Vec<f32>,
    pub norm: Option<Vec<f32>>,
    pub wq: QMatrix,
    pub wk: QMatrix,
    pub wv: QMatrix,
    pub wo: QMatrix,
    pub gate: QMatrix,
    pub up: QMatrix,
    pub down: QMatrix,
    /// Over the draft vocabulary (EAGLE-3); `None`: the target's head.
    pub lm_head: Option<QMatrix>,
    /// Draft id -> target id.
    pub d2t: Vec<u32>,
    /// MTP's `enorm` and `hnorm`.
    pub mtp_norms: Option<(Vec<f32>, Vec<f32>)>,
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
    path: KernelPath,
}

/// Our hidden indices of the EAGLE-3 feature layers of an `l`-layer target
/// (the residual stream entering layers 2, l/2 and l-3).
pub fn feature_layers(l: usize) -> Vec<usize> {
    vec![1, (l / 2).saturating_sub(1), l.saturating_sub(4)]
}

/// A head's `rope_scaling`: none, `linear` or `llama3` (what public heads
/// carry, copied from their target's config); any other kind is refused
/// by name rather than drafted with the wrong rotation.
pub(crate) fn head_rope_scaling(
    cfg: &serde_json::Value,
    file: &Path,
) -> Result<RopeScaling, String> {
    let Some(rs) = cfg.get("rope_scaling").filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let kind = rs
        .get("rope_type")
        .or_else(|| rs.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let num = |k: &str| {
        rs.get(k)
            .and_then(|v| v.as_f64())
            .map(|v| v as f32)
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| {
                format!(
                    "{}: rope_scaling.{k}: missing or not a positive number for '{kind}'",
                    file.display()
                )
            })
    };
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => {
            let (low, high) = (num("low_freq_factor")?, num("high_freq_factor")?);
            if high <= low {
                return Err(format!(
                    "{}: rope_scaling: high_freq_factor {high} must exceed low_freq_factor {low}",
                    file.display()
                ));
            }
            RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position: num("original_max_position_embeddings")? as usize,
            }
        }
        other => {
            return Err(format!(
                "{}: rope_scaling '{other}' is not supported for draft heads (supported: default, linear, llama3)",
                file.display()
            ))
        }
    })
}

/// A head config's `specd_normed_residual` (absent: false; not a bool: an
/// error naming `file`): the specd extension `distill eagle
/// --normed-residual` writes.
pub fn normed_residual_of(cfg: &serde_json::Value, file: &Path) -> Result<bool, String> {
    match cfg.get("specd_normed_residual") {
        None => Ok(false),
        Some(serde_json::Value::Bool(b)) => Ok(*b),
        Some(v) => Err(format!(
            "{}: `specd_normed_residual` must be true or false, got {v}",
            file.display()
        )),
    }
}

pub(crate) fn cfg_usize(cfg: &serde_json::Value, key: &str, file: &Path) -> Result<usize, String> {
    cfg.get(key)
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .ok_or_else(|| format!("{}: missing integer `{key}`", file.display()))
}

/// Tensors of a safetensors file, by name, with errors that name the
/// file, the tensor and the expected shape.
pub(crate) struct Tensors {
    pub(crate) file: TensorFile,
    /// Matrices to Q8_0 (the fast path) or kept in f32 (exact reference).
    pub(crate) quantize: bool,
}

impl Tensors {
    pub(crate) fn load(file: &Path, quantize: bool) -> Result<Self, String> {
        Ok(Self {
            file: TensorFile::read(file)?,
            quantize,
        })
    }

    pub(crate) fn find<'a>(&self, names: &[&'a str]) -> Option<&'a str> {
        names.iter().copied().find(|n| self.file.has(n))
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.file.has(name)
    }

    pub(crate) fn path(&self) -> String {
        self.file.path.display().to_string()
    }

    /// A float tensor of exactly `shape`, as f32.
    pub(crate) fn get(&self, names: &[&str], shape: &[usize]) -> Result<Vec<f32>, String> {
        let name = self.find(names).ok_or_else(|| {
            format!(
                "{}: missing tensor `{}` (expected shape {shape:?})",
                self.path(),
                names[0]
            )
        })?;
        let dims = self.file.shape(name).unwrap_or(&[]);
        if dims != shape {
            return Err(format!(
                "{}: tensor `{name}` has shape {dims:?}, expected {shape:?}",
                self.path()
            ));
        }
        self.file.f32(name)
    }

    pub(crate) fn matrix(
        &self,
        names: &[&str],
        rows: usize,
        cols: usize,
    ) -> Result<QMatrix, String> {
        let v = self.get(names, &[rows, cols])?;
        let m = QMatrix::from_f32(rows, cols, v);
        if !self.quantize {
            return Ok(m);
        }
        // Q8_0 for the kernels' integer path when the width allows.
        Ok(m.to_q8_0().unwrap_or(m))
    }
}

/// The head's weights file in `dir`: the first of `preferred` present,
/// else any `*.safetensors`.
pub(crate) fn find_weights(dir: &Path, preferred: &[&str]) -> Result<std::path::PathBuf, String> {
    preferred
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
        .or_else(|| {
            let mut all: Vec<_> = std::fs::read_dir(dir)
                .ok()?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            all.sort();
            all.into_iter().next()
        })
        .ok_or_else(|| format!("{}: no *.safetensors file", dir.display()))
}

/// A draft checkpoint's parts: its parsed config.json, the config's and
/// the weights' paths (for errors) and the weights.
pub(crate) type Parts = (
    serde_json::Value,
    std::path::PathBuf,
    std::path::PathBuf,
    Tensors,
);

/// A draft checkpoint from `dir`: config.json and the first of
/// `preferred` present (else any `*.safetensors`); `quantize` as
/// `Tensors::quantize`.
pub(crate) fn read_checkpoint(
    dir: &Path,
    preferred: &[&str],
    quantize: bool,
) -> Result<Parts, String> {
    let cfg_path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&cfg_path).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    let cj: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    let weights = find_weights(dir, preferred)?;
    let t = Tensors::load(&weights, quantize)?;
    Ok((cj, cfg_path, weights, t))
}

/// A draft checkpoint from in-memory config text and safetensors bytes
/// (`label` names them in errors), quantised.
pub(crate) fn checkpoint_from_bytes(
    label: &str,
    config: &str,
    weights: &[u8],
) -> Result<Parts, String> {
    let cfg_path = Path::new(label).join("config.json");
    let wpath = Path::new(label).join("model.safetensors");
    let cj: serde_json::Value =
        serde_json::from_str(config).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    let t = Tensors {
        file: TensorFile::from_bytes(&wpath, weights)?,
        quantize: true,
    };
    Ok((cj, cfg_path, wpath, t))
}

/// Draft id -> target id from the `d2t` tensor (offsets: draft id `i` is
/// target id `i + d2t[i]`); the identity when the draft vocabulary is the
/// target's and the file has no `d2t`.
pub(crate) fn read_d2t(
    t: &Tensors,
    weights: &Path,
    draft_vocab: usize,
    target_vocab: usize,
) -> Result<Vec<u32>, String> {
    if draft_vocab == target_vocab && !t.has("d2t") {
        return Ok((0..target_vocab as u32).collect());
    }
    if !t.has("d2t") {
        return Err(format!(
            "{}: missing tensor `d2t` (expected shape [{draft_vocab}])",
            weights.display()
        ));
    }
    let dims = t.file.shape("d2t").unwrap_or(&[]);
    if dims != [draft_vocab] {
        return Err(format!(
            "{}: tensor `d2t` has shape {dims:?}, expected [{draft_vocab}]",
            weights.display()
        ));
    }
    let off = t.file.i64("d2t")?;
    let mut ids = Vec::with_capacity(draft_vocab);
    for (i, o) in off.iter().enumerate() {
        let id = i as i64 + o;
        if id < 0 || id as usize >= target_vocab {
            return Err(format!(
                "{}: tensor `d2t` maps draft id {i} to {id}, outside the target's vocabulary of {target_vocab}",
                weights.display()
            ));
        }
        ids.push(id as u32);
    }
    Ok(ids)
}

impl Head {
    /// Load a head from `dir` (config.json and one safetensors file), for
    /// a target with `target_hidden`, `target_vocab` and `target_layers`.
    pub fn load(
        dir: &Path,
        target_hidden: usize,
        target_vocab: usize,
        target_layers: usize,
    ) -> Result<Head, String> {
        Self::load_with(dir, target_hidden, target_vocab, target_layers, true)
    }

    /// As `load`; `quantize: false` keeps every matrix in f32.
    pub fn load_with(
        dir: &Path,
        target_hidden: usize,
        target_vocab: usize,
        target_layers: usize,
        quantize: bool,
    ) -> Result<Head, String> {
        let (cj, cfg_path, weights, t) = read_checkpoint(
            dir,
            &["model.safetensors", "pytorch_model.safetensors"],
            quantize,
        )?;
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

    /// A head from in-memory config text and safetensors bytes (`label`
    /// names them in errors).
    pub fn from_bytes(
        label: &str,
        config: &str,
        weights: &[u8],
        target_hidden: usize,
        target_vocab: usize,
        target_layers: usize,
    ) -> Result<Head, String> {
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

    pub(crate) fn build(
        cj: &serde_json::Value,
        cfg_path: &Path,
        weights: &Path,
        t: &Tensors,
        target_hidden: usize,
        target_vocab: usize,
        target_layers: usize,
    ) -> Result<Head, String> {
        let cj = cj.clone();
        let cfg_path = cfg_path.to_path_buf();
        let hidden = cfg_usize(&cj, "hidden_size", &cfg_path)?;
        let heads = cfg_usize(&cj, "num_attention_heads", &cfg_path)?;
        let kv_heads = cj
            .get("num_key_value_heads")
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .unwrap_or(heads);
        let head_dim = cj
            .get("head_dim")
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .unwrap_or(hidden / heads.max(1));
        let intermediate = cfg_usize(&cj, "intermediate_size", &cfg_path)?;
        let rms_eps = cj
            .get("rms_norm_eps")
            .and_then(|v| v.as_f64())
            .unwrap_or(1e-5) as f32;
        let rope_theta = cj
            .get("rope_theta")
            .and_then(|v| v.as_f64())
            .unwrap_or(10000.0) as f32;
        let rope_scaling = head_rope_scaling(&cj, &cfg_path)?;
        if hidden != target_hidden {
            return Err(format!(
                "{}: hidden_size {hidden} does not match the target's {target_hidden}",
                cfg_path.display()
            ));
        }
        let variant = if t.has("enorm.weight") {
            Variant::Mtp
        } else if t.has("midlayer.self_attn.q_proj.weight") || t.has("layers.0.hidden_norm.weight")
        {
            Variant::Eagle3
        } else {
            Variant::Eagle1
        };
        // The decoder layer's tensors: `midlayer.*` (EAGLE-3; some EAGLE-3
        // exports say `layers.0.*`) or `layers.0.*` (EAGLE-1).
        let p = |n: &str| -> [String; 2] {
            match variant {
                Variant::Eagle3 => [format!("midlayer.{n}"), format!("layers.0.{n}")],
                Variant::Eagle1 | Variant::Mtp => {
                    [format!("layers.0.{n}"), format!("layers.0.{n}")]
                }
            }
        };
        fn names(v: &[String; 2]) -> Vec<&str> {
            v.iter().map(String::as_str).collect()
        }
        // Two public conventions name the layers read. SGLang's (what
        // SpecForge writes, and specd): `eagle_config.
        // eagle_aux_hidden_state_layer_ids` holds the layers whose *output*
        // is read, our hidden index itself. vLLM's speculators format: a
        // top-level `eagle_aux_hidden_state_layer_ids` holding the layers
        // whose *input* is read, our index plus one. (Our index L, the
        // final-normed state, is a specd extension.)
        let aux = |v: &serde_json::Value, input: bool| -> Result<Vec<usize>, String> {
            let ids: Option<Vec<u64>> = v
                .as_array()
                .map(|a| a.iter().map(|x| x.as_u64()).collect())
                .unwrap_or(None);
            let min = u64::from(input);
            match ids {
                Some(ids) if !ids.is_empty() && ids.iter().all(|&i| i >= min) => Ok(ids
                    .into_iter()
                    .map(|i| (i - min) as usize)
                    .collect()),
                _ => Err(format!(
                    "{}: `eagle_aux_hidden_state_layer_ids` must be a list of layer ids >= {min}, got {v}",
                    cfg_path.display()
                )),
            }
        };
        let cfg_feature_layers: Option<Vec<usize>> = match (
            cj.get("eagle_config")
                .and_then(|e| e.get("eagle_aux_hidden_state_layer_ids")),
            cj.get("eagle_aux_hidden_state_layer_ids"),
        ) {
            (Some(v), _) => Some(aux(v, false)?),
            (None, Some(v)) => Some(aux(v, true)?),
            (None, None) => None,
        };
        let (feature_layers, draft_vocab) = match variant {
            Variant::Eagle3 => {
                // The residual stream entering layers 2, L/2 and L-3 (the
                // output of the layer before each: our hidden index).
                let l = target_layers;
                let fl = cfg_feature_layers.unwrap_or_else(|| feature_layers(l));
                let dv = cj
                    .get("draft_vocab_size")
                    .and_then(|v| v.as_u64())
                    .map(|v| v as usize)
                    .unwrap_or(target_vocab);
                (fl, dv)
            }
            Variant::Eagle1 => (vec![target_layers], target_vocab),
            // A specd extension: an MTP head over a draft vocabulary.
            Variant::Mtp => (
                vec![target_layers],
                cj.get("draft_vocab_size")
                    .and_then(|v| v.as_u64())
                    .map_or(target_vocab, |v| v as usize),
            ),
        };
        if let Some(v) = cj.get("vocab_size").and_then(|v| v.as_u64()) {
            if v as usize != target_vocab {
                return Err(format!(
                    "{}: vocab_size {v} does not match the target's {target_vocab}",
                    cfg_path.display()
                ));
            }
        }
        if variant == Variant::Eagle3 && feature_layers.iter().any(|&l| l > target_layers) {
            return Err(format!(
                "{}: feature layers {feature_layers:?} are past the target's {target_layers} layers",
                cfg_path.display()
            ));
        }
        let normed_residual = normed_residual_of(&cj, &cfg_path)?;
        if normed_residual && variant != Variant::Eagle3 {
            return Err(format!(
                "{}: `specd_normed_residual` is for EAGLE-3 heads, this is {variant:?}",
                cfg_path.display()
            ));
        }
        let cfg = HeadConfig {
            variant,
            hidden,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            rms_eps,
            rope_theta,
            rope_scaling,
            target_hidden,
            feature_layers,
            draft_vocab,
            normed_residual,
        };
        let (qd, kvd, ai) = (heads * head_dim, cfg.kv_dim(), cfg.attn_in());
        let fc_in = match variant {
            Variant::Eagle3 => cfg.feature_layers.len() * target_hidden,
            Variant::Eagle1 | Variant::Mtp => 2 * hidden,
        };
        let fc = t.matrix(&["fc.weight"], hidden, fc_in)?;
        let fc_bias = if t.has("fc.bias") {
            Some(t.get(&["fc.bias"], &[hidden])?)
        } else {
            None
        };
        let vec_opt = |n: &str| -> Result<Option<Vec<f32>>, String> {
            let name = p(n);
            if name.iter().any(|n| t.has(n)) {
                t.get(&names(&name), &[hidden]).map(Some)
            } else {
                Ok(None)
            }
        };
        let input_norm = vec_opt("input_layernorm.weight")?;
        if variant == Variant::Mtp && input_norm.is_none() {
            return Err(format!(
                "{}: missing tensor `layers.0.input_layernorm.weight` (expected shape [{hidden}])",
                weights.display()
            ));
        }
        let hidden_norm = vec_opt("hidden_norm.weight")?;
        if variant == Variant::Eagle3 && (input_norm.is_none() || hidden_norm.is_none()) {
            return Err(format!(
                "{}: missing tensor `midlayer.input_layernorm.weight` or `midlayer.hidden_norm.weight` (expected shape [{hidden}])",
                weights.display()
            ));
        }
        let post_norm = t.get(&names(&p("post_attention_layernorm.weight")), &[hidden])?;
        let mat = |n: &str, rows: usize, cols: usize| t.matrix(&names(&p(n)), rows, cols);
        let wq = mat("self_attn.q_proj.weight", qd, ai)?;
        let wk = mat("self_attn.k_proj.weight", kvd, ai)?;
        let wv = mat("self_attn.v_proj.weight", kvd, ai)?;
        let wo = mat("self_attn.o_proj.weight", hidden, qd)?;
        let gate = mat("mlp.gate_proj.weight", intermediate, hidden)?;
        let up = mat("mlp.up_proj.weight", intermediate, hidden)?;
        let down = mat("mlp.down_proj.weight", hidden, intermediate)?;
        let (norm, lm_head, d2t) = match variant {
            Variant::Eagle3 => {
                let norm = t.get(&["norm.weight"], &[hidden])?;
                let lm_head = t.matrix(&["lm_head.weight"], draft_vocab, hidden)?;
                let d2t = read_d2t(t, weights, draft_vocab, target_vocab)?;
                (Some(norm), Some(lm_head), d2t)
            }
            Variant::Eagle1 => (None, None, (0..target_vocab as u32).collect()),
            Variant::Mtp => {
                let norm = t.get(&["norm.weight"], &[hidden])?;
                let lm_head = if t.has("lm_head.weight") {
                    Some(t.matrix(&["lm_head.weight"], draft_vocab, hidden)?)
                } else {
                    None
                };
                let d2t = read_d2t(t, weights, draft_vocab, target_vocab)?;
                (Some(norm), lm_head, d2t)
            }
        };
        let mtp_norms = if variant == Variant::Mtp {
            Some((
                t.get(&["enorm.weight"], &[hidden])?,
                t.get(&["hnorm.weight"], &[hidden])?,
            ))
        } else {
            None
        };
        Ok(Head::new(
            cfg,
            fc,
            fc_bias,
            input_norm,
            hidden_norm,
            post_norm,
            norm,
            [wq, wk, wv, wo],
            [gate, up, down],
            lm_head,
            d2t,
        )
        .with_mtp_norms(mtp_norms))
    }

    /// The MTP module's input norms (`enorm`, `hnorm`).
    pub fn with_mtp_norms(mut self, norms: Option<(Vec<f32>, Vec<f32>)>) -> Self {
        self.mtp_norms = norms;
        self
    }

    /// The fused hidden input of rows with embeddings `e` and states `x`
    /// (both `rows x h`) for EAGLE-1 (`fc(cat[e, x]) + bias`) and MTP
    /// (`eh_proj(cat[enorm(e), hnorm(x)])`).
    pub fn fuse_pair(&self, e: &[f32], x: &[f32], rows: usize) -> Vec<f32> {
        let h = self.cfg.hidden;
        let (e, x) = match &self.mtp_norms {
            Some((en, hn)) => {
                let (mut a, mut b) = (vec![0f32; e.len()], vec![0f32; x.len()]);
                rms_norm(e, en, self.cfg.rms_eps, &mut a);
                rms_norm(x, hn, self.cfg.rms_eps, &mut b);
                (std::borrow::Cow::Owned(a), std::borrow::Cow::Owned(b))
            }
            None => (std::borrow::Cow::Borrowed(e), std::borrow::Cow::Borrowed(x)),
        };
        let mut cat = vec![0f32; rows * 2 * h];
        for r in 0..rows {
            cat[r * 2 * h..r * 2 * h + h].copy_from_slice(&e[r * h..(r + 1) * h]);
            cat[r * 2 * h + h..(r + 1) * 2 * h].copy_from_slice(&x[r * h..(r + 1) * h]);
        }
        self.fuse(&cat, rows)
    }

    /// What the target's output head reads when the head has none of its
    /// own: MTP's own final norm of `y`; EAGLE-1's `y` itself.
    pub fn for_target_head(&self, y: &[f32]) -> Vec<f32> {
        match &self.norm {
            Some(n) if self.lm_head.is_none() => {
                let mut out = vec![0f32; y.len()];
                rms_norm(y, n, self.cfg.rms_eps, &mut out);
                out
            }
            _ => y.to_vec(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: HeadConfig,
        fc: QMatrix,
        fc_bias: Option<Vec<f32>>,
        input_norm: Option<Vec<f32>>,
        hidden_norm: Option<Vec<f32>>,
        post_norm: Vec<f32>,
        norm: Option<Vec<f32>>,
        [wq, wk, wv, wo]: [QMatrix; 4],
        [gate, up, down]: [QMatrix; 3],
        lm_head: Option<QMatrix>,
        d2t: Vec<u32>,
    ) -> Head {
        let half = cfg.head_dim / 2;
        let max_pos = 1 << 15;
        // `head_rope_scaling` admits only kinds that cannot fail here.
        let (freqs, mscale) =
            super::llama::rope_frequencies(cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling)
                .unwrap_or_else(|_| {
                    super::llama::rope_frequencies(cfg.head_dim, cfg.rope_theta, &RopeScaling::None)
                        .unwrap_or_default()
                });
        let mut rope_cos = Vec::with_capacity(max_pos * half);
        let mut rope_sin = Vec::with_capacity(max_pos * half);
        for pos in 0..max_pos {
            for &f in &freqs {
                let a = pos as f32 * f;
                rope_cos.push(a.cos() * mscale);
                rope_sin.push(a.sin() * mscale);
            }
        }
        Head {
            cfg,
            fc,
            fc_bias,
            input_norm,
            hidden_norm,
            post_norm,
            norm,
            wq,
            wk,
            wv,
            wo,
            gate,
            up,
            down,
            lm_head,
            d2t,
            mtp_norms: None,
            rope_cos,
            rope_sin,
            path: KernelPath::best(),
        }
    }

    /// Bytes of weights read by one draft step (fc excluded).
    pub fn step_bytes(&self) -> usize {
        [
            &self.wq, &self.wk, &self.wv, &self.wo, &self.gate, &self.up, &self.down,
        ]
        .iter()
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

    /// `fc` over target features (`rows x fc.cols`): the first hidden input.
    pub fn fuse(&self, features: &[f32], rows: usize) -> Vec<f32> {
        let mut g = self.matmul(features, rows, &self.fc);
        if let Some(b) = &self.fc_bias {
            for r in g.chunks_exact_mut(self.cfg.hidden) {
                for (v, bv) in r.iter_mut().zip(b) {
                    *v += bv;
                }
            }
        }
        g
    }

    /// The cos and sin the head rotates position `pos` by (one per
    /// frequency, `head_dim / 2`).
    pub fn rotation(&self, pos: usize) -> (&[f32], &[f32]) {
        let half = self.cfg.head_dim / 2;
        let pos = pos.min(self.rope_cos.len() / half.max(1) - 1);
        (
            &self.rope_cos[pos * half..(pos + 1) * half],
            &self.rope_sin[pos * half..(pos + 1) * half],
        )
    }

    fn rope(&self, x: &mut [f32], pos: usize) {
        let (hd, half) = (self.cfg.head_dim, self.cfg.head_dim / 2);
        let pos = pos.min(self.rope_cos.len() / half.max(1) - 1);
        let cos = &self.rope_cos[pos * half..(pos + 1) * half];
        let sin = &self.rope_sin[pos * half..(pos + 1) * half];
        // Hugging Face layout: pairs (i, i + d/2).
        for head in x.chunks_exact_mut(hd) {
            for i in 0..half {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos[i] - b * sin[i];
                head[i + half] = b * cos[i] + a * sin[i];
            }
        }
    }

    /// The keys and values `step` would cache for these rows, without the
    /// rest of the layer: for rows of the history whose outputs nobody
    /// reads (only the cache entries are needed). Same bits as `step`'s.
    pub fn kv_rows(&self, g: &[f32], e: &[f32], pos: &[usize]) -> KvStore {
        let c = &self.cfg;
        let rows = pos.len();
        let u = self.attn_input(g, e, rows);
        let mut act = Activations::new(self.path);
        act.prepare(&u, rows, c.attn_in(), wants_q8(&self.wk));
        let (mut k, mut v) = (Vec::new(), Vec::new());
        matmul_many(&act, &[&self.wk, &self.wv], &mut [&mut k, &mut v]);
        let kvd = c.kv_dim();
        for r in 0..rows {
            self.rope(&mut k[r * kvd..(r + 1) * kvd], pos[r]);
        }
        KvStore { k, v, dim: kvd }
    }

    /// The attention input of each row: EAGLE-3 `[norm(e); norm(g)]`,
    /// EAGLE-1 `g` itself.
    fn attn_input(&self, g: &[f32], e: &[f32], rows: usize) -> Vec<f32> {
        let c = &self.cfg;
        let h = c.hidden;
        let ai = c.attn_in();
        let mut u = vec![0f32; rows * ai];
        match c.variant {
            Variant::Eagle3 => {
                let mut en = vec![0f32; rows * h];
                let mut gn = vec![0f32; rows * h];
                rms_norm(
                    e,
                    self.input_norm.as_deref().unwrap_or(&[]),
                    c.rms_eps,
                    &mut en,
                );
                rms_norm(
                    g,
                    self.hidden_norm.as_deref().unwrap_or(&[]),
                    c.rms_eps,
                    &mut gn,
                );
                for r in 0..rows {
                    u[r * ai..r * ai + h].copy_from_slice(&en[r * h..(r + 1) * h]);
                    u[r * ai + h..(r + 1) * ai].copy_from_slice(&gn[r * h..(r + 1) * h]);
                }
            }
            Variant::Eagle1 => u.copy_from_slice(g),
            Variant::Mtp => rms_norm(
                g,
                self.input_norm.as_deref().unwrap_or(&[]),
                c.rms_eps,
                &mut u,
            ),
        }
        u
    }

    /// One layer step over `pos.len()` rows (of any sequences). Row r has
    /// hidden input `g[r]` (h wide; for EAGLE-1 the fused `fc(cat[e, f])`),
    /// token embedding `e[r]` (EAGLE-3 only) and position `pos[r]`; it
    /// attends to the entries `sees[r]` names, in order, then to itself.
    /// Returns the outputs `y` (pre-norm) and the rows' own keys and values
    /// (to keep in a cache or throw away).
    pub fn step(
        &self,
        stores: &[&KvStore],
        g: &[f32],
        e: &[f32],
        pos: &[usize],
        sees: &[Vec<Src>],
    ) -> (Vec<f32>, KvStore) {
        let c = &self.cfg;
        let (h, rows) = (c.hidden, pos.len());
        let ai = c.attn_in();
        let u = self.attn_input(g, e, rows);
        let mut act = Activations::new(self.path);
        act.prepare(&u, rows, ai, wants_q8(&self.wq));
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        matmul_many(
            &act,
            &[&self.wq, &self.wk, &self.wv],
            &mut [&mut q, &mut k, &mut v],
        );
        let (qd, kvd, hd) = (c.heads * c.head_dim, c.kv_dim(), c.head_dim);
        for r in 0..rows {
            self.rope(&mut q[r * qd..(r + 1) * qd], pos[r]);
            self.rope(&mut k[r * kvd..(r + 1) * kvd], pos[r]);
        }
        let own = KvStore { k, v, dim: kvd };
        // Attention: scores over the entries the row sees and itself;
        // softmax; weighted values.
        let group = c.heads / c.kv_heads.max(1);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut attn = vec![0f32; rows * qd];
        let mut scores: Vec<f32> = Vec::new();
        let mut keys: Vec<(&KvStore, usize)> = Vec::new();
        for r in 0..rows {
            keys.clear();
            for s in &sees[r] {
                match *s {
                    Src::Range { store, start, end } => {
                        keys.extend((start..end).map(|i| (stores[store], i)));
                    }
                    Src::Row { store, row } => keys.push((stores[store], row)),
                    Src::Own(j) => keys.push((&own, j)),
                }
            }
            keys.push((&own, r));
            for head in 0..c.heads {
                let kvh = head / group.max(1);
                let qv = &q[r * qd + head * hd..r * qd + (head + 1) * hd];
                scores.clear();
                scores.extend(
                    keys.iter()
                        .map(|(s, i)| dot(qv, s.key(*i, kvh, hd)) * scale),
                );
                let (_, sum) = super::kernels::exp_shifted(&mut scores);
                let inv = 1.0 / sum;
                let out = &mut attn[r * qd + head * hd..r * qd + (head + 1) * hd];
                for ((s, i), &p) in keys.iter().zip(&scores) {
                    let vv = s.value(*i, kvh, hd);
                    let w = p * inv;
                    for (o, &x) in out.iter_mut().zip(vv) {
                        *o = w.mul_add(x, *o);
                    }
                }
            }
        }
        let o = self.matmul(&attn, rows, &self.wo);
        // Residual: the hidden input (EAGLE-3: g, un-normed, or
        // hidden_norm(g) with `normed_residual`; EAGLE-1: x).
        let normed;
        let base = if c.normed_residual {
            let mut gn = vec![0f32; rows * h];
            rms_norm(
                g,
                self.hidden_norm.as_deref().unwrap_or(&[]),
                c.rms_eps,
                &mut gn,
            );
            normed = gn;
            &normed[..]
        } else {
            g
        };
        let mut a: Vec<f32> = base.iter().zip(&o).map(|(x, y)| x + y).collect();
        let mut an = vec![0f32; rows * h];
        rms_norm(&a, &self.post_norm, c.rms_eps, &mut an);
        let mut act = Activations::new(self.path);
        act.prepare(&an, rows, h, wants_q8(&self.gate));
        let (mut gt, mut upv) = (Vec::new(), Vec::new());
        matmul_many(&act, &[&self.gate, &self.up], &mut [&mut gt, &mut upv]);
        silu_mul(&mut gt, &upv);
        let d = self.matmul(&gt, rows, &self.down);
        for (x, y) in a.iter_mut().zip(&d) {
            *x += y;
        }
        (a, own)
    }

    /// Draft-vocabulary logits of outputs `y` (own norm and head: EAGLE-3,
    /// MTP with `shared_head.head`). `None` when the logits come from the
    /// target's head (EAGLE-1; MTP without a head of its own, after
    /// `for_target_head`).
    pub fn logits(&self, y: &[f32], rows: usize) -> Option<Vec<f32>> {
        let head = self.lm_head.as_ref()?;
        let mut yn = vec![0f32; y.len()];
        rms_norm(
            y,
            self.norm.as_deref().unwrap_or(&[]),
            self.cfg.rms_eps,
            &mut yn,
        );
        Some(self.matmul(&yn, rows, head))
    }
}

#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s = x.mul_add(*y, s);
    }
    s
}

/// Entries a row attends to (before itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Src {
    /// Rows `start..end` of `stores[store]`.
    Range {
        store: usize,
        start: usize,
        end: usize,
    },
    /// Row `row` of `stores[store]`.
    Row { store: usize, row: usize },
    /// Row `j` of this call (an earlier row).
    Own(usize),
}

/// Keys and values of the head's one layer, one row per position (or
/// node): `dim = kv_heads * head_dim` each.
#[derive(Debug, Clone, Default)]
pub struct KvStore {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub dim: usize,
}

impl KvStore {
    pub fn new(dim: usize) -> Self {
        Self {
            k: Vec::new(),
            v: Vec::new(),
            dim,
        }
    }

    pub fn len(&self) -> usize {
        self.k.len().checked_div(self.dim).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn truncate(&mut self, n: usize) {
        self.k.truncate(n * self.dim);
        self.v.truncate(n * self.dim);
    }

    /// Append rows `rows` of `other`.
    pub fn extend_rows(&mut self, other: &KvStore, rows: std::ops::Range<usize>) {
        let d = self.dim;
        self.k
            .extend_from_slice(&other.k[rows.start * d..rows.end * d]);
        self.v
            .extend_from_slice(&other.v[rows.start * d..rows.end * d]);
    }

    pub(crate) fn key(&self, i: usize, kvh: usize, hd: usize) -> &[f32] {
        let o = i * self.dim + kvh * hd;
        &self.k[o..o + hd]
    }

    pub(crate) fn value(&self, i: usize, kvh: usize, hd: usize) -> &[f32] {
        let o = i * self.dim + kvh * hd;
        &self.v[o..o + hd]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hugging Face's `_compute_llama3_parameters`, in f64.
    fn hf_llama3(dim: usize, base: f64, factor: f64, low: f64, high: f64, old: f64) -> Vec<f64> {
        (0..dim / 2)
            .map(|i| {
                let f = 1.0 / base.powf((2 * i) as f64 / dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < old / high {
                    f
                } else if wavelen > old / low {
                    f / factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * f / factor + smooth * f
                }
            })
            .collect()
    }

    /// A head whose config carries Llama 3.1's `rope_scaling` rotates as
    /// Hugging Face's formula says (the shipped head's weights, head_dim 64
    /// and base 1e5, with an original context of 32 so every band is hit);
    /// without it the rotation differs; unknown kinds and bad fields are
    /// refused naming the file and the key.
    #[test]
    fn heads_follow_their_configs_rope_scaling() {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../proposers/eagle/heads/smollm2-135m-instruct"
        );
        let weights = std::fs::read(format!("{dir}/model.safetensors")).unwrap();
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{dir}/config.json")).unwrap())
                .unwrap();
        let head = |scaling: serde_json::Value| {
            let mut c = config.clone();
            c["rope_scaling"] = scaling;
            Head::from_bytes("head", &c.to_string(), &weights, 576, 49152, 30)
        };
        let scaled = head(serde_json::json!({
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32
        }))
        .unwrap();
        let plain = head(serde_json::Value::Null).unwrap();
        let want = hf_llama3(64, 1e5, 8.0, 1.0, 4.0, 32.0);
        let mut moved = 0f32;
        for pos in [1usize, 100, 1000] {
            let (cos, sin) = scaled.rotation(pos);
            for (i, f) in want.iter().enumerate() {
                let a = pos as f64 * f;
                assert!(
                    (cos[i] as f64 - a.cos()).abs() < 1e-3,
                    "cos, pos {pos}, frequency {i}"
                );
                assert!(
                    (sin[i] as f64 - a.sin()).abs() < 1e-3,
                    "sin, pos {pos}, frequency {i}"
                );
            }
            let (pc, _) = plain.rotation(pos);
            moved = moved.max(
                cos.iter()
                    .zip(pc)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max),
            );
        }
        assert!(moved > 0.1, "the scaling changes the rotation ({moved})");
        // Linear, under the older `type` key.
        let linear = head(serde_json::json!({"type": "linear", "factor": 2.0})).unwrap();
        let f1 = 1.0 / 1e5f64.powf(2.0 / 64.0);
        assert!((linear.rotation(10).0[1] as f64 - (10.0 * f1 / 2.0).cos()).abs() < 1e-4);
        for (scaling, want) in [
            (
                serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
                "rope_scaling 'yarn' is not supported",
            ),
            (
                serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
                "rope_scaling.original_max_position_embeddings",
            ),
            (
                serde_json::json!({"rope_type": "linear", "factor": -1.0}),
                "rope_scaling.factor",
            ),
        ] {
            let err = head(scaling).unwrap_err();
            assert!(
                err.contains(want) && err.contains("head/config.json"),
                "{err}"
            );
        }
    }
}
