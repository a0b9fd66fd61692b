//! Medusa-1 heads (Cai et al. 2024): `K` heads on the target's last
//! (final-normed) hidden state `h_t`; head `k` (0-based) predicts the
//! token `k + 2` positions ahead (`x_{t+k+2}`: the target's own head
//! gives `x_{t+1}`, which the engine has already sampled when the heads
//! run). Head `k` is `L` residual blocks `y <- y + SiLU(W y + b)` and an
//! output projection.
//!
//! Layouts:
//! - public (`medusa_lm_head.safetensors`): `{k}.{j}.linear.weight`
//!   `[h, h]`, `{k}.{j}.linear.bias` `[h]` for `j < L`, and the output
//!   `{k}.{L}.weight` `[vocab, h]`; `config.json` gives
//!   `medusa_num_heads` and `medusa_num_layers` (exports of the whole
//!   model prefix the names with `medusa_head.`).
//! - specd extensions in `config.json`: `draft_vocab_size` with a `d2t`
//!   tensor (a reduced output vocabulary, as EAGLE-3 heads have), and
//!   `"medusa_output": "target"`: no `{k}.{L}.weight`; every head is read
//!   out through the target's own output head restricted to the draft
//!   vocabulary (`attach_target_output`). Heads trained by `specd distill
//!   medusa` use it: their files hold only the residual blocks.
//!
//! Invariant: every load error names the file, the tensor and the
//! expected shape; a head whose hidden size or vocabulary does not match
//! the target is refused.

use std::path::Path;

use super::eagle::{cfg_usize, find_weights, read_d2t, Tensors};
use super::kernels::{matmul_many, wants_q8, Activations, KernelPath};
use super::tensor_file::TensorFile;
use super::QMatrix;

/// Where a head's logits come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// The head's own projection (`{k}.{L}.weight`).
    Own,
    /// The target's output head, rows of the draft vocabulary.
    Target,
}

#[derive(Debug, Clone)]
pub struct MedusaConfig {
    pub heads: usize,
    /// Residual blocks per head.
    pub layers: usize,
    pub hidden: usize,
    /// Rows of each head's output (the target's vocabulary unless `d2t`).
    pub draft_vocab: usize,
    pub output: Output,
}

#[derive(Debug)]
struct ResBlock {
    w: QMatrix,
    b: Vec<f32>,
}

/// Medusa heads' weights, as the engine's kernels want them.
#[derive(Debug)]
pub struct MedusaHead {
    pub cfg: MedusaConfig,
    blocks: Vec<Vec<ResBlock>>,
    /// `Own`: one per head; `Target`: one shared, once attached.
    out: Vec<QMatrix>,
    /// Draft id -> target id.
    pub d2t: Vec<u32>,
    quantize: bool,
    path: KernelPath,
}

/// Tensor names of head `k`'s block `j` (`"weight"` or `"bias"`), and of
/// its output projection at `j = L`.
fn names(k: usize, j: usize, what: &str) -> [String; 2] {
    [
        format!("{k}.{j}.{what}"),
        format!("medusa_head.{k}.{j}.{what}"),
    ]
}

fn refs(v: &[String; 2]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

impl MedusaHead {
    /// Load heads from `dir` (config.json and one safetensors file, e.g.
    /// `medusa_lm_head.safetensors`) for a target with `target_hidden` and
    /// `target_vocab`; matrices in Q8_0 for the fast kernels.
    pub fn load(dir: &Path, target_hidden: usize, target_vocab: usize) -> Result<Self, String> {
        Self::load_with(dir, target_hidden, target_vocab, true)
    }

    /// As `load`; `quantize: false` keeps every matrix in f32 (the exact
    /// reference the tests compare training against).
    pub fn load_with(
        dir: &Path,
        target_hidden: usize,
        target_vocab: usize,
        quantize: bool,
    ) -> Result<Self, String> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path)
            .map_err(|e| format!("{}: {e}", cfg_path.display()))?;
        let weights = find_weights(dir, &["medusa_lm_head.safetensors", "model.safetensors"])?;
        let t = Tensors::load(&weights, quantize)?;
        Self::build(&text, &cfg_path, &weights, &t, target_hidden, target_vocab)
    }

    /// Heads from in-memory config text and safetensors bytes (`label`
    /// names them in errors).
    pub fn from_bytes(
        label: &str,
        config: &str,
        weights: &[u8],
        target_hidden: usize,
        target_vocab: usize,
    ) -> Result<Self, String> {
        let cfg_path = Path::new(label).join("config.json");
        let wpath = Path::new(label).join("model.safetensors");
        let t = Tensors {
            file: TensorFile::from_bytes(&wpath, weights)?,
            quantize: true,
        };
        Self::build(config, &cfg_path, &wpath, &t, target_hidden, target_vocab)
    }

    fn build(
        config: &str,
        cfg_path: &Path,
        weights: &Path,
        t: &Tensors,
        target_hidden: usize,
        target_vocab: usize,
    ) -> Result<Self, String> {
        let cj: serde_json::Value =
            serde_json::from_str(config).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
        let heads = cfg_usize(&cj, "medusa_num_heads", cfg_path)?;
        let layers = cj
            .get("medusa_num_layers")
            .and_then(|v| v.as_u64())
            .unwrap_or(1) as usize;
        if heads == 0 {
            return Err(format!(
                "{}: medusa_num_heads must be at least 1",
                cfg_path.display()
            ));
        }
        let h = target_hidden;
        for (key, want) in [("hidden_size", target_hidden), ("vocab_size", target_vocab)] {
            if let Some(v) = cj.get(key).and_then(|v| v.as_u64()) {
                if v as usize != want {
                    return Err(format!(
                        "{}: {key} {v} does not match the target's {want}",
                        cfg_path.display()
                    ));
                }
            }
        }
        let output = match cj.get("medusa_output").and_then(|v| v.as_str()) {
            None | Some("own") => Output::Own,
            Some("target") => Output::Target,
            Some(o) => {
                return Err(format!(
                    "{}: medusa_output \"{o}\": expected \"own\" or \"target\"",
                    cfg_path.display()
                ))
            }
        };
        let draft_vocab = cj
            .get("draft_vocab_size")
            .and_then(|v| v.as_u64())
            .map_or(target_vocab, |v| v as usize);
        let d2t = read_d2t(t, weights, draft_vocab, target_vocab)?;
        let mut blocks = Vec::with_capacity(heads);
        let mut out = Vec::new();
        for k in 0..heads {
            let mut bs = Vec::with_capacity(layers);
            for j in 0..layers {
                let w = t.matrix(&refs(&names(k, j, "linear.weight")), h, h)?;
                let b = t.get(&refs(&names(k, j, "linear.bias")), &[h])?;
                bs.push(ResBlock { w, b });
            }
            blocks.push(bs);
            if output == Output::Own {
                out.push(t.matrix(&refs(&names(k, layers, "weight")), draft_vocab, h)?);
            }
        }
        Ok(Self {
            cfg: MedusaConfig {
                heads,
                layers,
                hidden: h,
                draft_vocab,
                output,
            },
            blocks,
            out,
            d2t,
            quantize: t.quantize,
            path: KernelPath::best(),
        })
    }

    /// Whether the heads wait for the target's output rows.
    pub fn needs_target_output(&self) -> bool {
        self.cfg.output == Output::Target && self.out.is_empty()
    }

    /// The target's output head rows of the draft vocabulary (`d2t`
    /// order), `draft_vocab x hidden`, for `"medusa_output": "target"`.
    pub fn attach_target_output(&mut self, rows: Vec<f32>) -> Result<(), String> {
        let (dv, h) = (self.cfg.draft_vocab, self.cfg.hidden);
        if rows.len() != dv * h {
            return Err(format!(
                "the target's output rows are {} values, expected {dv} x {h}",
                rows.len()
            ));
        }
        let m = QMatrix::from_f32(dv, h, rows);
        let m = if self.quantize {
            m.to_q8_0().unwrap_or(m)
        } else {
            m
        };
        self.out = vec![m];
        Ok(())
    }

    /// Bytes of weights one drafting pass reads.
    pub fn step_bytes(&self) -> usize {
        self.blocks
            .iter()
            .flatten()
            .map(|b| b.w.size_bytes() + 4 * b.b.len())
            .sum::<usize>()
            + self.out.iter().map(QMatrix::size_bytes).sum::<usize>()
    }

    fn matmul(&self, x: &[f32], rows: usize, w: &QMatrix) -> Vec<f32> {
        let mut act = Activations::new(self.path);
        act.prepare(x, rows, w.cols, wants_q8(w));
        let mut out = Vec::new();
        matmul_many(&act, &[w], &mut [&mut out]);
        out
    }

    /// Every head's output state for `rows` hidden states `x` (`rows x h`):
    /// `heads x rows x h`.
    pub fn states(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let h = self.cfg.hidden;
        let mut all = Vec::with_capacity(self.cfg.heads * rows * h);
        if rows == 0 {
            return all;
        }
        // The heads' first blocks share their input: one pass.
        let first: Vec<&QMatrix> = self.blocks.iter().map(|b| &b[0].w).collect();
        let mut act = Activations::new(self.path);
        act.prepare(x, rows, h, first.iter().any(|w| wants_q8(w)));
        let mut outs: Vec<Vec<f32>> = vec![Vec::new(); first.len()];
        {
            let mut refs: Vec<&mut Vec<f32>> = outs.iter_mut().collect();
            matmul_many(&act, &first, &mut refs);
        }
        for (k, bs) in self.blocks.iter().enumerate() {
            let mut y = x.to_vec();
            let mut z = std::mem::take(&mut outs[k]);
            for (j, b) in bs.iter().enumerate() {
                if j > 0 {
                    z = self.matmul(&y, rows, &b.w);
                }
                for (yr, zr) in y.chunks_exact_mut(h).zip(z.chunks_exact(h)) {
                    for ((yv, &zv), &bv) in yr.iter_mut().zip(zr).zip(&b.b) {
                        let a = zv + bv;
                        *yv += a / (1.0 + (-a).exp());
                    }
                }
            }
            all.extend_from_slice(&y);
        }
        all
    }

    /// Every head's draft-vocabulary logits for `rows` hidden states:
    /// `heads x rows x draft_vocab`. Errors when the heads read out
    /// through the target's head and it was not attached.
    pub fn logits(&self, x: &[f32], rows: usize) -> Result<Vec<f32>, String> {
        if self.needs_target_output() {
            return Err("the Medusa heads read out through the target's output head, which was not attached".into());
        }
        let (h, k) = (self.cfg.hidden, self.cfg.heads);
        let y = self.states(x, rows);
        if rows == 0 {
            return Ok(Vec::new());
        }
        match self.cfg.output {
            Output::Target => Ok(self.matmul(&y, k * rows, &self.out[0])),
            Output::Own => {
                let mut all = Vec::with_capacity(k * rows * self.cfg.draft_vocab);
                for (i, w) in self.out.iter().enumerate() {
                    all.extend(self.matmul(&y[i * rows * h..(i + 1) * rows * h], rows, w));
                }
                Ok(all)
            }
        }
    }
}
