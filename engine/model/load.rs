//! Loading Llama-family checkpoints: GGUF (any ggml type; Q4_0, Q4_1, Q5_0,
//! Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and F32 are kept as is, the rest dequantized to F32) and Hugging Face
//! safetensors directories (config.json + *.safetensors).

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};

use super::kernels::{QMatrix, WeightFormat, QK_K};
use super::llama::{LayerWeights, Model, Weights};
use super::{ModelConfig, RopeStyle};
use crate::error::{Result, SpecdError};

/// Load a model from a GGUF file or a safetensors directory.
pub fn load_model(path: &Path, threads: usize) -> Result<Model> {
    if !path.exists() {
        return Err(SpecdError::ModelNotFound(path.to_path_buf()));
    }
    let (config, weights) = if path.is_dir() {
        load_safetensors(path)?
    } else {
        load_gguf(path)?
    };
    Model::new(config, weights, threads)
}

// ---------------------------------------------------------------- GGUF

/// Read the GGUF header (metadata and tensor index) of `path`.
pub fn read_gguf_header(path: &Path) -> Result<Content> {
    let mut f = std::fs::File::open(path).map_err(|e| SpecdError::bad_model(path, e))?;
    Content::read(&mut f)
        .map_err(|e| SpecdError::bad_model(path, format!("not a valid GGUF file ({e})")))
}

fn md_u32(md: &HashMap<String, Value>, key: &str) -> Option<u32> {
    md.get(key).and_then(|v| match v {
        Value::U8(x) => Some(*x as u32),
        Value::U16(x) => Some(*x as u32),
        Value::U32(x) => Some(*x),
        Value::I32(x) => u32::try_from(*x).ok(),
        Value::U64(x) => u32::try_from(*x).ok(),
        Value::I64(x) => u32::try_from(*x).ok(),
        _ => None,
    })
}

fn md_f32(md: &HashMap<String, Value>, key: &str) -> Option<f32> {
    md.get(key).and_then(|v| match v {
        Value::F32(x) => Some(*x),
        Value::F64(x) => Some(*x as f32),
        _ => None,
    })
}

fn gguf_config(path: &Path, ct: &Content) -> Result<ModelConfig> {
    let md = &ct.metadata;
    let arch = match md.get("general.architecture") {
        Some(Value::String(s)) => s.clone(),
        _ => {
            return Err(SpecdError::bad_model(
                path,
                "GGUF metadata lacks general.architecture",
            ))
        }
    };
    if !matches!(arch.as_str(), "llama" | "mistral" | "qwen2") {
        return Err(SpecdError::UnsupportedArchitecture(arch));
    }
    let need = |key: &str| -> Result<u32> {
        md_u32(md, &format!("{arch}.{key}"))
            .ok_or_else(|| SpecdError::bad_model(path, format!("GGUF metadata lacks {arch}.{key}")))
    };
    let hidden = need("embedding_length")? as usize;
    let heads = need("attention.head_count")? as usize;
    let kv_heads =
        md_u32(md, &format!("{arch}.attention.head_count_kv")).unwrap_or(heads as u32) as usize;
    let head_dim = md_u32(md, &format!("{arch}.rope.dimension_count"))
        .map(|x| x as usize)
        .unwrap_or(hidden / heads);
    let embed = ct
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| SpecdError::bad_model(path, "missing tensor token_embd.weight"))?;
    let vocab_size = embed.shape.dims()[0];
    let eos = md_u32(md, "tokenizer.ggml.eos_token_id");
    let mut eos_token_ids: Vec<u32> = eos.into_iter().collect();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = md_u32(md, key) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
    }
    Ok(ModelConfig {
        vocab_size,
        hidden,
        intermediate: need("feed_forward_length")? as usize,
        // llama.cpp counts multi-token-prediction layers (`model::mtp`) in
        // the block count; the main model stops before them.
        layers: need("block_count")?
            .saturating_sub(md_u32(md, &format!("{arch}.nextn_predict_layers")).unwrap_or(0))
            as usize,
        heads,
        kv_heads,
        head_dim,
        rope_theta: md_f32(md, &format!("{arch}.rope.freq_base")).unwrap_or(10_000.0),
        rope_style: if arch == "qwen2" {
            RopeStyle::Neox
        } else {
            RopeStyle::Interleaved
        },
        rms_eps: md_f32(md, &format!("{arch}.attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
        max_seq_len: need("context_length")? as usize,
        bos_token_id: md_u32(md, "tokenizer.ggml.bos_token_id"),
        eos_token_ids,
        arch,
    })
}

struct GgufReader<'a> {
    path: &'a Path,
    ct: &'a Content,
    file: std::fs::File,
}

impl GgufReader<'_> {
    fn has(&self, name: &str) -> bool {
        self.ct.tensor_infos.contains_key(name)
    }

    fn raw(&mut self, name: &str) -> Result<(GgmlDType, Vec<usize>, Vec<u8>)> {
        let info =
            self.ct.tensor_infos.get(name).ok_or_else(|| {
                SpecdError::bad_model(self.path, format!("missing tensor {name}"))
            })?;
        let dims = info.shape.dims().to_vec();
        let n = info.shape.elem_count();
        let dt = info.ggml_dtype;
        if n % dt.block_size() != 0 {
            return Err(SpecdError::bad_model(
                self.path,
                format!("tensor {name}: bad element count"),
            ));
        }
        let bytes = n / dt.block_size() * dt.type_size();
        let start = self.ct.tensor_data_offset + info.offset;
        let len = self.file.metadata()?.len();
        if start + bytes as u64 > len {
            return Err(SpecdError::bad_model(
                self.path,
                format!("tensor {name} runs past the end of the file (truncated download?)"),
            ));
        }
        let mut buf = vec![0u8; bytes];
        self.file.seek(SeekFrom::Start(start))?;
        self.file.read_exact(&mut buf)?;
        Ok((dt, dims, buf))
    }

    fn vector(&mut self, name: &str) -> Result<Vec<f32>> {
        let (dt, dims, raw) = self.raw(name)?;
        let n: usize = dims.iter().product();
        dequantize(self.path, name, dt, &[n], &raw)
    }

    fn matrix(&mut self, name: &str) -> Result<QMatrix> {
        let (dt, dims, raw) = self.raw(name)?;
        if dims.len() != 2 {
            return Err(SpecdError::bad_model(
                self.path,
                format!("tensor {name}: expected 2 dims, got {dims:?}"),
            ));
        }
        let (rows, cols) = (dims[0], dims[1]);
        let direct = match dt {
            GgmlDType::F32 => Some(WeightFormat::F32),
            GgmlDType::Q4_0 => Some(WeightFormat::Q4_0),
            GgmlDType::Q4_1 => Some(WeightFormat::Q4_1),
            GgmlDType::Q5_0 => Some(WeightFormat::Q5_0),
            GgmlDType::Q5_1 => Some(WeightFormat::Q5_1),
            GgmlDType::Q8_0 => Some(WeightFormat::Q8_0),
            // K-quants keep their super-blocks when rows are whole ones.
            GgmlDType::Q4K if cols.is_multiple_of(QK_K) => Some(WeightFormat::Q4K),
            GgmlDType::Q5K if cols.is_multiple_of(QK_K) => Some(WeightFormat::Q5K),
            GgmlDType::Q6K if cols.is_multiple_of(QK_K) => Some(WeightFormat::Q6K),
            _ => None,
        };
        match direct {
            Some(f) => QMatrix::from_ggml_blocks(f, rows, cols, &raw)
                .map_err(|e| SpecdError::bad_model(self.path, format!("tensor {name}: {e}"))),
            None => {
                let v = dequantize(self.path, name, dt, &dims, &raw)?;
                Ok(QMatrix::from_f32(rows, cols, v))
            }
        }
    }
}

fn dequantize(
    path: &Path,
    name: &str,
    dt: GgmlDType,
    dims: &[usize],
    raw: &[u8],
) -> Result<Vec<f32>> {
    let err = |e: candle_core::Error| SpecdError::bad_model(path, format!("tensor {name}: {e}"));
    let q =
        candle_core::quantized::ggml_file::qtensor_from_ggml(dt, raw, dims.to_vec(), &Device::Cpu)
            .map_err(err)?;
    q.dequantize(&Device::Cpu)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(err)
}

fn load_gguf(path: &Path) -> Result<(ModelConfig, Weights)> {
    let ct = read_gguf_header(path)?;
    let config = gguf_config(path, &ct)?;
    let file = std::fs::File::open(path)?;
    let mut r = GgufReader {
        path,
        ct: &ct,
        file,
    };
    let embed = r.matrix("token_embd.weight")?;
    let mut layers = Vec::with_capacity(config.layers);
    for i in 0..config.layers {
        let p = format!("blk.{i}");
        let opt_bias = |r: &mut GgufReader, n: &str| -> Result<Option<Vec<f32>>> {
            let name = format!("{p}.{n}.bias");
            if r.has(&name) {
                r.vector(&name).map(Some)
            } else {
                Ok(None)
            }
        };
        layers.push(LayerWeights {
            attn_norm: r.vector(&format!("{p}.attn_norm.weight"))?,
            wq: r.matrix(&format!("{p}.attn_q.weight"))?,
            wk: r.matrix(&format!("{p}.attn_k.weight"))?,
            wv: r.matrix(&format!("{p}.attn_v.weight"))?,
            bq: opt_bias(&mut r, "attn_q")?,
            bk: opt_bias(&mut r, "attn_k")?,
            bv: opt_bias(&mut r, "attn_v")?,
            wo: r.matrix(&format!("{p}.attn_output.weight"))?,
            ffn_norm: r.vector(&format!("{p}.ffn_norm.weight"))?,
            w_gate: r.matrix(&format!("{p}.ffn_gate.weight"))?,
            w_up: r.matrix(&format!("{p}.ffn_up.weight"))?,
            w_down: r.matrix(&format!("{p}.ffn_down.weight"))?,
        });
    }
    let norm = r.vector("output_norm.weight")?;
    let output = if r.has("output.weight") {
        Some(r.matrix("output.weight")?)
    } else {
        None
    };
    check_shapes(path, &config, &embed, &layers, output.as_ref())?;
    Ok((
        config,
        Weights {
            embed,
            layers,
            norm,
            output,
        },
    ))
}

fn check_shapes(
    path: &Path,
    c: &ModelConfig,
    embed: &QMatrix,
    layers: &[LayerWeights],
    output: Option<&QMatrix>,
) -> Result<()> {
    let bad = |what: String| Err(SpecdError::bad_model(path, what));
    if c.heads == 0
        || c.kv_heads == 0
        || !c.heads.is_multiple_of(c.kv_heads)
        || !c.head_dim.is_multiple_of(2)
    {
        return bad(format!(
            "inconsistent heads: {} heads, {} kv heads, head_dim {}",
            c.heads, c.kv_heads, c.head_dim
        ));
    }
    if embed.cols != c.hidden {
        return bad(format!(
            "token embedding width {} != hidden size {}",
            embed.cols, c.hidden
        ));
    }
    for (i, l) in layers.iter().enumerate() {
        let want = [
            ("attn_q", &l.wq, c.heads * c.head_dim, c.hidden),
            ("attn_k", &l.wk, c.kv_heads * c.head_dim, c.hidden),
            ("attn_v", &l.wv, c.kv_heads * c.head_dim, c.hidden),
            ("attn_output", &l.wo, c.hidden, c.heads * c.head_dim),
            ("ffn_gate", &l.w_gate, c.intermediate, c.hidden),
            ("ffn_up", &l.w_up, c.intermediate, c.hidden),
            ("ffn_down", &l.w_down, c.hidden, c.intermediate),
        ];
        for (name, m, r, k) in want {
            if (m.rows, m.cols) != (r, k) {
                return bad(format!(
                    "layer {i} {name}: shape {}x{}, expected {r}x{k}",
                    m.rows, m.cols
                ));
            }
        }
        if l.attn_norm.len() != c.hidden || l.ffn_norm.len() != c.hidden {
            return bad(format!("layer {i}: norm width mismatch"));
        }
    }
    if let Some(o) = output {
        if o.cols != c.hidden || o.rows != c.vocab_size {
            return bad(format!(
                "output head {}x{}, expected {}x{}",
                o.rows, o.cols, c.vocab_size, c.hidden
            ));
        }
    }
    if c.heads * c.head_dim != c.hidden {
        return bad(format!(
            "heads x head_dim {} != hidden {}",
            c.heads * c.head_dim,
            c.hidden
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------- safetensors

#[derive(serde::Deserialize)]
struct HfConfig {
    #[serde(default)]
    model_type: Option<String>,
    #[serde(default)]
    architectures: Vec<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rope_theta: Option<f32>,
    rms_norm_eps: Option<f32>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
}

fn ids(v: &Option<serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        _ => vec![],
    }
}

fn load_safetensors(dir: &Path) -> Result<(ModelConfig, Weights)> {
    let cfg_path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&cfg_path).map_err(|e| SpecdError::bad_model(&cfg_path, e))?;
    let hf: HfConfig =
        serde_json::from_str(&text).map_err(|e| SpecdError::bad_model(&cfg_path, e))?;
    let arch = hf_arch(&hf)?;
    let mut files: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(SpecdError::bad_model(
            dir,
            "no *.safetensors files in the directory",
        ));
    }
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for f in &files {
        let t = candle_core::safetensors::load(f, &Device::Cpu)
            .map_err(|e| SpecdError::bad_model(f, e))?;
        tensors.extend(t);
    }
    safetensors_weights(dir, hf, arch, tensors)
}

/// A Llama-family model from a Hugging Face `config.json` text and its
/// tensors already in memory (e.g. a compact draft whose embedding the
/// caller computed); `origin` names the source in errors.
pub fn model_from_tensors(
    origin: &Path,
    config_json: &str,
    tensors: HashMap<String, Tensor>,
    threads: usize,
) -> Result<Model> {
    let hf: HfConfig =
        serde_json::from_str(config_json).map_err(|e| SpecdError::bad_model(origin, e))?;
    let arch = hf_arch(&hf)?;
    let (config, weights) = safetensors_weights(origin, hf, arch, tensors)?;
    Model::new(config, weights, threads)
}

fn hf_arch(hf: &HfConfig) -> Result<String> {
    let arch = hf
        .model_type
        .clone()
        .or_else(|| hf.architectures.first().map(|a| a.to_lowercase()))
        .unwrap_or_default();
    Ok(match arch.as_str() {
        "llama" | "mistral" | "qwen2" => arch,
        a if a.starts_with("llama") => "llama".into(),
        a if a.starts_with("mistral") => "mistral".into(),
        a if a.starts_with("qwen2") => "qwen2".into(),
        _ => return Err(SpecdError::UnsupportedArchitecture(arch)),
    })
}

fn safetensors_weights(
    dir: &Path,
    hf: HfConfig,
    arch: String,
    mut tensors: HashMap<String, Tensor>,
) -> Result<(ModelConfig, Weights)> {
    let heads = hf.num_attention_heads;
    let config = ModelConfig {
        vocab_size: hf.vocab_size,
        hidden: hf.hidden_size,
        intermediate: hf.intermediate_size,
        layers: hf.num_hidden_layers,
        heads,
        kv_heads: hf.num_key_value_heads.unwrap_or(heads),
        head_dim: hf.head_dim.unwrap_or(hf.hidden_size / heads),
        rope_theta: hf.rope_theta.unwrap_or(10_000.0),
        rope_style: RopeStyle::Neox,
        rms_eps: hf.rms_norm_eps.unwrap_or(1e-5),
        max_seq_len: hf.max_position_embeddings.unwrap_or(4096),
        bos_token_id: ids(&hf.bos_token_id).first().copied(),
        eos_token_ids: ids(&hf.eos_token_id),
        arch: arch.clone(),
    };
    let mut take = |name: &str| -> Result<Tensor> {
        tensors
            .remove(name)
            .ok_or_else(|| SpecdError::bad_model(dir, format!("missing tensor {name}")))
    };
    let f32v = |t: Tensor, name: &str| -> Result<Vec<f32>> {
        t.to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| SpecdError::bad_model(dir, format!("tensor {name}: {e}")))
    };
    let mat = |t: Tensor, name: &str| -> Result<QMatrix> {
        let dims = t.dims().to_vec();
        if dims.len() != 2 {
            return Err(SpecdError::bad_model(
                dir,
                format!("tensor {name}: expected 2 dims, got {dims:?}"),
            ));
        }
        Ok(QMatrix::from_f32(dims[0], dims[1], f32v(t, name)?))
    };
    let embed = mat(
        take("model.embed_tokens.weight")?,
        "model.embed_tokens.weight",
    )?;
    let bias = hf.attention_bias.unwrap_or(arch == "qwen2");
    let mut layers = Vec::with_capacity(config.layers);
    for i in 0..config.layers {
        let p = format!("model.layers.{i}");
        let mut m = |n: &str| -> Result<QMatrix> {
            let name = format!("{p}.{n}");
            let t = take(&name)?;
            mat(t, &name)
        };
        let (wq, wk, wv, wo) = (
            m("self_attn.q_proj.weight")?,
            m("self_attn.k_proj.weight")?,
            m("self_attn.v_proj.weight")?,
            m("self_attn.o_proj.weight")?,
        );
        let (w_gate, w_up, w_down) = (
            m("mlp.gate_proj.weight")?,
            m("mlp.up_proj.weight")?,
            m("mlp.down_proj.weight")?,
        );
        let mut v = |n: &str| -> Result<Vec<f32>> {
            let name = format!("{p}.{n}");
            let t = take(&name)?;
            f32v(t, &name)
        };
        let attn_norm = v("input_layernorm.weight")?;
        let ffn_norm = v("post_attention_layernorm.weight")?;
        let (bq, bk, bv) = if bias {
            (
                Some(v("self_attn.q_proj.bias")?),
                Some(v("self_attn.k_proj.bias")?),
                Some(v("self_attn.v_proj.bias")?),
            )
        } else {
            (None, None, None)
        };
        layers.push(LayerWeights {
            attn_norm,
            wq,
            wk,
            wv,
            bq,
            bk,
            bv,
            wo,
            ffn_norm,
            w_gate,
            w_up,
            w_down,
        });
    }
    let norm = f32v(take("model.norm.weight")?, "model.norm.weight")?;
    let output = match (
        take("lm_head.weight"),
        hf.tie_word_embeddings.unwrap_or(false),
    ) {
        (Ok(t), _) => Some(mat(t, "lm_head.weight")?),
        (Err(_), true) => None,
        (Err(e), false) => return Err(e),
    };
    check_shapes(dir, &config, &embed, &layers, output.as_ref())?;
    Ok((
        config,
        Weights {
            embed,
            layers,
            norm,
            output,
        },
    ))
}
