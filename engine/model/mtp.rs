//! Multi-token-prediction (MTP) modules as DeepSeek-V3 and GLM-4.5 ship
//! them inside the target: for each draft depth, `x = eh_proj(cat[
//! enorm(embedding of the next token), hnorm(previous state)])`, one
//! decoder layer, then `shared_head.norm` and the output head
//! (`shared_head.head`, or the target's own when absent). One module
//! chains for several draft tokens (its output is the next depth's
//! state), as EAGLE-1 does; the drafting machinery is `model::eagle`'s
//! (`Variant::Mtp`).
//!
//! Sources:
//! - a safetensors directory (a target that carries MTP layers, or a module
//!   `distill` wrote): `config.json` (`num_hidden_layers`,
//!   `num_nextn_predict_layers`, the target's dimensions) and
//!   `model.layers.{N}.{enorm,hnorm,eh_proj,input_layernorm,self_attn.*,
//!   post_attention_layernorm,mlp.*,shared_head.norm,shared_head.head}`
//!   across any number of `*.safetensors` shards; `N` is the first layer
//!   past the main model's unless given.
//! - a GGUF file: `blk.{N}.nextn.{enorm,hnorm,eh_proj,shared_head_norm,
//!   shared_head_head}` and the block's `attn_*` / `ffn_*` tensors, `N` =
//!   `block_count - nextn_predict_layers` (llama.cpp's convention: the
//!   block count includes the MTP layers). Query and key rows of
//!   llama-family GGUFs are stored permuted for interleaved rope and are
//!   put back in the Hugging Face order the module's rope uses.
//!
//! Only dense (Llama-style) MTP blocks are supported: an MoE block is
//! refused with the tensor it lacks.
//!
//! Invariant: every load error names the file, the tensor (as the source
//! names it) and the expected shape.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value;

use super::eagle::{Head, Tensors};
use super::tensor_file::TensorFile;

/// The module's tensors: (our name, the source's suffix after the layer
/// prefix in safetensors, in GGUF, expected shape by (h, q, kv, f, vocab)).
type Shape = fn(usize, usize, usize, usize, usize) -> Vec<usize>;

const TENSORS: [(&str, &str, &str, Shape); 14] = [
    (
        "enorm.weight",
        "enorm.weight",
        "nextn.enorm.weight",
        |h, _, _, _, _| vec![h],
    ),
    (
        "hnorm.weight",
        "hnorm.weight",
        "nextn.hnorm.weight",
        |h, _, _, _, _| vec![h],
    ),
    (
        "fc.weight",
        "eh_proj.weight",
        "nextn.eh_proj.weight",
        |h, _, _, _, _| vec![h, 2 * h],
    ),
    (
        "layers.0.input_layernorm.weight",
        "input_layernorm.weight",
        "attn_norm.weight",
        |h, _, _, _, _| vec![h],
    ),
    (
        "layers.0.self_attn.q_proj.weight",
        "self_attn.q_proj.weight",
        "attn_q.weight",
        |h, q, _, _, _| vec![q, h],
    ),
    (
        "layers.0.self_attn.k_proj.weight",
        "self_attn.k_proj.weight",
        "attn_k.weight",
        |h, _, kv, _, _| vec![kv, h],
    ),
    (
        "layers.0.self_attn.v_proj.weight",
        "self_attn.v_proj.weight",
        "attn_v.weight",
        |h, _, kv, _, _| vec![kv, h],
    ),
    (
        "layers.0.self_attn.o_proj.weight",
        "self_attn.o_proj.weight",
        "attn_output.weight",
        |h, q, _, _, _| vec![h, q],
    ),
    (
        "layers.0.post_attention_layernorm.weight",
        "post_attention_layernorm.weight",
        "ffn_norm.weight",
        |h, _, _, _, _| vec![h],
    ),
    (
        "layers.0.mlp.gate_proj.weight",
        "mlp.gate_proj.weight",
        "ffn_gate.weight",
        |h, _, _, f, _| vec![f, h],
    ),
    (
        "layers.0.mlp.up_proj.weight",
        "mlp.up_proj.weight",
        "ffn_up.weight",
        |h, _, _, f, _| vec![f, h],
    ),
    (
        "layers.0.mlp.down_proj.weight",
        "mlp.down_proj.weight",
        "ffn_down.weight",
        |h, _, _, f, _| vec![h, f],
    ),
    (
        "norm.weight",
        "shared_head.norm.weight",
        "nextn.shared_head_norm.weight",
        |h, _, _, _, _| vec![h],
    ),
    (
        "lm_head.weight",
        "shared_head.head.weight",
        "nextn.shared_head_head.weight",
        |h, _, _, _, v| vec![v, h],
    ),
];

/// The module's dimensions (the target's).
#[derive(Debug, Clone)]
struct Dims {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    rms_eps: f64,
    rope_theta: f64,
}

impl Dims {
    fn shape(&self, f: Shape, vocab: usize) -> Vec<usize> {
        f(
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
            vocab,
        )
    }
}

/// Load the MTP module (layer `layer`, default the first past the main
/// model) from a safetensors directory or a GGUF file, for a target with
/// `target_hidden`, `target_vocab` and `target_layers`. `quantize`:
/// matrices in Q8_0 (the fast path) or f32 (exact references).
pub fn load_mtp(
    src: &Path,
    layer: Option<usize>,
    target_hidden: usize,
    target_vocab: usize,
    target_layers: usize,
    quantize: bool,
) -> Result<Head, String> {
    let (file, dims, label) = if src.is_dir() {
        let cfg_path = src.join("config.json");
        let text = std::fs::read_to_string(&cfg_path)
            .map_err(|e| format!("{}: {e}", cfg_path.display()))?;
        let mut shards: Vec<PathBuf> = std::fs::read_dir(src)
            .map_err(|e| format!("{}: {e}", src.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        shards.sort();
        let shards = shards.iter().map(|p| (p.clone(), None)).collect();
        from_safetensors(src, &text, shards, layer, target_vocab)?
    } else {
        from_gguf(src, layer, target_vocab)?
    };
    build(
        file,
        dims,
        label,
        target_hidden,
        target_vocab,
        target_layers,
        quantize,
    )
}

/// As `load_mtp` for a module held in memory: config.json text and one
/// safetensors file's bytes (`label` names them in errors), matrices in
/// Q8_0. For modules compiled into a plugin.
pub fn load_mtp_bytes(
    label: &str,
    config: &str,
    weights: &[u8],
    target_hidden: usize,
    target_vocab: usize,
    target_layers: usize,
) -> Result<Head, String> {
    let dir = Path::new(label);
    let shard = dir.join("model.safetensors");
    let (file, dims, label) = from_safetensors(
        dir,
        config,
        vec![(shard, Some(weights))],
        None,
        target_vocab,
    )?;
    build(
        file,
        dims,
        label,
        target_hidden,
        target_vocab,
        target_layers,
        true,
    )
}

fn build(
    mut file: TensorFile,
    dims: Dims,
    label: String,
    target_hidden: usize,
    target_vocab: usize,
    target_layers: usize,
    quantize: bool,
) -> Result<Head, String> {
    let draft_vocab = if file.has("d2t") {
        file.shape("d2t").map_or(0, |s| s.iter().product())
    } else {
        target_vocab
    };
    if dims.hidden != target_hidden {
        return Err(format!(
            "{label}: hidden size {} does not match the target's {target_hidden}",
            dims.hidden
        ));
    }
    file.path = PathBuf::from(&label);
    let config = serde_json::json!({
        "hidden_size": dims.hidden,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "intermediate_size": dims.intermediate,
        "rms_norm_eps": dims.rms_eps,
        "rope_theta": dims.rope_theta,
        "vocab_size": target_vocab,
        "draft_vocab_size": draft_vocab,
    });
    let t = Tensors { file, quantize };
    let path = PathBuf::from(&label);
    Head::build(
        &config,
        &path.join("config.json"),
        &path,
        &t,
        target_hidden,
        target_vocab,
        target_layers,
    )
}

fn cfg_num(cj: &serde_json::Value, key: &str) -> Option<f64> {
    cj.get(key).and_then(|v| v.as_f64())
}

/// The module's tensors from config.json text and safetensors shards (a
/// path, and the bytes when they are in memory already).
fn from_safetensors(
    dir: &Path,
    text: &str,
    shards: Vec<(PathBuf, Option<&[u8]>)>,
    layer: Option<usize>,
    target_vocab: usize,
) -> Result<(TensorFile, Dims, String), String> {
    let cfg_path = dir.join("config.json");
    let cj: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    let need = |key: &str| -> Result<usize, String> {
        cfg_num(&cj, key)
            .map(|v| v as usize)
            .ok_or_else(|| format!("{}: missing integer `{key}`", cfg_path.display()))
    };
    let hidden = need("hidden_size")?;
    let heads = need("num_attention_heads")?;
    let main_layers = need("num_hidden_layers")?;
    let nextn = cfg_num(&cj, "num_nextn_predict_layers").unwrap_or(0.0) as usize;
    let n = match layer {
        Some(n) => n,
        None if nextn > 0 => main_layers,
        None => {
            return Err(format!(
                "{}: the model has no MTP layers (num_nextn_predict_layers is {nextn}); name one with the `layer` option",
                cfg_path.display()
            ))
        }
    };
    if let Some(v) = cfg_num(&cj, "vocab_size") {
        if v as usize != target_vocab {
            return Err(format!(
                "{}: vocab_size {v} does not match the target's {target_vocab}",
                cfg_path.display()
            ));
        }
    }
    let dims = Dims {
        hidden,
        heads,
        kv_heads: cfg_num(&cj, "num_key_value_heads").map_or(heads, |v| v as usize),
        head_dim: cfg_num(&cj, "head_dim").map_or(hidden / heads.max(1), |v| v as usize),
        intermediate: need("intermediate_size")?,
        rms_eps: cfg_num(&cj, "rms_norm_eps").unwrap_or(1e-6),
        rope_theta: cfg_num(&cj, "rope_theta").unwrap_or(10000.0),
    };
    if shards.is_empty() {
        return Err(format!("{}: no *.safetensors file", dir.display()));
    }
    // A specd extension (modules `distill mtp` writes): the output head
    // over a draft vocabulary, with `d2t` as EAGLE-3 heads have it.
    let out_rows = cfg_num(&cj, "draft_vocab_size").map_or(target_vocab, |v| v as usize);
    let prefix = format!("model.layers.{n}.");
    let mut out = TensorFile::empty(dir);
    let mut found: Vec<Option<PathBuf>> = vec![None; TENSORS.len()];
    for (shard, bytes) in &shards {
        let mut f = match bytes {
            Some(b) => TensorFile::from_bytes(shard, b)?,
            None => TensorFile::read(shard)?,
        };
        if f.has("d2t") {
            out.take_from(&mut f, "d2t", "d2t");
        }
        if !f.names().any(|x| x.starts_with(&prefix)) {
            continue;
        }
        for (i, (ours, theirs, _, _)) in TENSORS.iter().enumerate() {
            let name = format!("{prefix}{theirs}");
            if let Some(shape) = f.shape(&name).map(<[usize]>::to_vec) {
                let want = dims.shape(TENSORS[i].3, out_rows);
                if shape != want {
                    return Err(format!(
                        "{}: tensor `{name}` has shape {shape:?}, expected {want:?}",
                        shard.display()
                    ));
                }
                out.take_from(&mut f, &name, ours);
                found[i] = Some(shard.clone());
            }
        }
    }
    if out_rows != target_vocab && !out.has("d2t") {
        return Err(format!(
            "{}: missing tensor `d2t` (expected shape [{out_rows}]; config.json gives draft_vocab_size {out_rows})",
            dir.display()
        ));
    }
    // Everything but the own output head is required.
    for (i, (_, theirs, _, shape)) in TENSORS.iter().enumerate() {
        if found[i].is_none() && *theirs != "shared_head.head.weight" {
            return Err(format!(
                "{}: missing tensor `{prefix}{theirs}` (expected shape {:?}){}",
                dir.display(),
                dims.shape(*shape, out_rows),
                if i == 0 {
                    format!(
                        " in any of {} safetensors file(s): no MTP layer {n}",
                        shards.len()
                    )
                } else {
                    String::new()
                }
            ));
        }
    }
    Ok((out, dims, dir.display().to_string()))
}

fn md_u64(md: &std::collections::HashMap<String, Value>, key: &str) -> Option<u64> {
    match md.get(key)? {
        Value::U32(v) => Some(u64::from(*v)),
        Value::U64(v) => Some(*v),
        Value::I32(v) => u64::try_from(*v).ok(),
        Value::I64(v) => u64::try_from(*v).ok(),
        _ => None,
    }
}

fn md_f64(md: &std::collections::HashMap<String, Value>, key: &str) -> Option<f64> {
    match md.get(key)? {
        Value::F32(v) => Some(f64::from(*v)),
        Value::F64(v) => Some(*v),
        _ => None,
    }
}

/// Undo llama.cpp's query/key row permutation (interleaved rope pairs
/// back to the Hugging Face halves) for `rows x cols` in heads of `hd`.
fn unpermute(w: &[f32], rows: usize, cols: usize, hd: usize) -> Vec<f32> {
    let mut out = vec![0f32; w.len()];
    let half = hd / 2;
    for head in 0..rows / hd {
        for i in 0..half {
            for (dst, src) in [(i, 2 * i), (half + i, 2 * i + 1)] {
                let (d, s) = ((head * hd + dst) * cols, (head * hd + src) * cols);
                out[d..d + cols].copy_from_slice(&w[s..s + cols]);
            }
        }
    }
    out
}

fn from_gguf(
    path: &Path,
    layer: Option<usize>,
    target_vocab: usize,
) -> Result<(TensorFile, Dims, String), String> {
    let label = path.display().to_string();
    let ct = super::load::read_gguf_header(path).map_err(|e| format!("{label}: {e}"))?;
    let md = &ct.metadata;
    let arch = match md.get("general.architecture") {
        Some(Value::String(s)) => s.clone(),
        _ => return Err(format!("{label}: GGUF metadata lacks general.architecture")),
    };
    let need = |key: &str| -> Result<usize, String> {
        md_u64(md, &format!("{arch}.{key}"))
            .map(|v| v as usize)
            .ok_or_else(|| format!("{label}: GGUF metadata lacks {arch}.{key}"))
    };
    let blocks = need("block_count")?;
    let nextn = md_u64(md, &format!("{arch}.nextn_predict_layers")).unwrap_or(0) as usize;
    let n = match layer {
        Some(n) => n,
        None if nextn > 0 => blocks - nextn,
        None => {
            return Err(format!(
                "{label}: the model has no MTP layers ({arch}.nextn_predict_layers is {nextn}); name one with the `layer` option"
            ))
        }
    };
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let dims = Dims {
        hidden,
        heads,
        kv_heads: md_u64(md, &format!("{arch}.attention.head_count_kv"))
            .map_or(heads, |v| v as usize),
        head_dim: md_u64(md, &format!("{arch}.rope.dimension_count"))
            .map_or(hidden / heads.max(1), |v| v as usize),
        intermediate: need("feed_forward_length")?,
        rms_eps: md_f64(md, &format!("{arch}.attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
        rope_theta: md_f64(md, &format!("{arch}.rope.freq_base")).unwrap_or(10000.0),
    };
    // Llama-family GGUFs store q/k permuted for interleaved rope.
    let permuted = matches!(arch.as_str(), "llama" | "mistral");
    let mut file = std::fs::File::open(path).map_err(|e| format!("{label}: {e}"))?;
    let mut out = TensorFile::empty(path);
    for (ours, _, theirs, shape) in TENSORS {
        let name = format!("blk.{n}.{theirs}");
        let want = dims.shape(shape, target_vocab);
        let Some(info) = ct.tensor_infos.get(&name) else {
            if ours == "lm_head.weight" {
                continue;
            }
            return Err(format!(
                "{label}: missing tensor `{name}` (expected shape {want:?}){}",
                if ours == "enorm.weight" {
                    format!(": no MTP layer {n}")
                } else {
                    String::new()
                }
            ));
        };
        let dims_got = info.shape.dims().to_vec();
        if dims_got != want {
            return Err(format!(
                "{label}: tensor `{name}` has shape {dims_got:?}, expected {want:?}"
            ));
        }
        let q = info
            .read(&mut file, ct.tensor_data_offset, &candle_core::Device::Cpu)
            .and_then(|q| q.dequantize(&candle_core::Device::Cpu))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| format!("{label}: tensor `{name}`: {e}"))?;
        let v = if permuted && (theirs == "attn_q.weight" || theirs == "attn_k.weight") {
            unpermute(&q, want[0], want[1], dims.head_dim)
        } else {
            q
        };
        out.insert_f32(ours, want, &v);
    }
    Ok((out, dims, label))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // llama.cpp: row (head, i) of the HF halves goes to 2i (first half)
        // or 2i+1 (second half).
        let (hd, heads, cols) = (4, 2, 3);
        let rows = hd * heads;
        let hf: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
        let mut perm = vec![0f32; hf.len()];
        for h in 0..heads {
            for i in 0..hd / 2 {
                for (src, dst) in [(i, 2 * i), (hd / 2 + i, 2 * i + 1)] {
                    let (s, d) = ((h * hd + src) * cols, (h * hd + dst) * cols);
                    perm[d..d + cols].copy_from_slice(&hf[s..s + cols]);
                }
            }
        }
        assert_eq!(unpermute(&perm, rows, cols, hd), hf);
    }
}
