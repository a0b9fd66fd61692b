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
use super::{Activation, ModelConfig, RopeScaling, RopeStyle};
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

/// Longest context a model may declare: its RoPE tables are computed
/// for every position up front (a few hundred MiB at this length).
const MAX_CONTEXT: usize = 1 << 20;

/// Largest GGUF header (metadata, vocabulary, tensor index) read: real
/// ones are a few MiB to a few tens (a 256k-token vocabulary).
const MAX_GGUF_HEADER: usize = 128 << 20;

/// Read the GGUF header (metadata and tensor index) of `path`.
pub fn read_gguf_header(path: &Path) -> Result<Content> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| SpecdError::bad_model(path, e))?;
    // The header is hundreds of thousands of small fields (the tokenizer's
    // vocabulary and merges), read with a position query each: parsed from
    // memory, a prefix of the file that grows until the header fits, not
    // from the file (two system calls a field, a third of a second).
    let mut head = Vec::new();
    let mut want = 8usize << 20;
    loop {
        let have = head.len();
        (&mut f)
            .take((want - have) as u64)
            .read_to_end(&mut head)
            .map_err(|e| SpecdError::bad_model(path, e))?;
        let complete = head.len() < want;
        match Content::read(&mut std::io::Cursor::new(&head)) {
            Ok(c) => return Ok(c),
            // Not a GGUF at all: no need to read further.
            Err(e) if !head.starts_with(b"GGUF") => {
                return Err(SpecdError::bad_model(
                    path,
                    format!("not a valid GGUF file ({e})"),
                ))
            }
            // A tensor type candle does not know (IQ*, TQ*, MXFP4) fails
            // however much of the file is read: say so now, not after
            // reading a multi-gigabyte file into memory.
            Err(e) if e.to_string().contains("unknown dtype") => {
                return Err(SpecdError::bad_model(
                    path,
                    format!(
                        "a tensor type this build does not support ({e}); supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q8_K"
                    ),
                ))
            }
            // A header the prefix cuts short fails in several ways (an
            // end of input, an array longer than what remains): more of
            // the file, until it is all read, up to a header size no
            // real file has.
            Err(_) if !complete && want < MAX_GGUF_HEADER => want *= 4,
            Err(e) if !complete => {
                return Err(SpecdError::bad_model(
                    path,
                    format!(
                        "the GGUF header does not parse within its first {} MiB ({e})",
                        MAX_GGUF_HEADER >> 20
                    ),
                ))
            }
            Err(e) => {
                return Err(SpecdError::bad_model(
                    path,
                    format!("not a valid GGUF file ({e})"),
                ))
            }
        }
    }
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

/// LongRoPE's default attention factor for a context of `max` positions
/// over an original one of `orig` (Hugging Face's).
fn longrope_attention(max: usize, orig: usize) -> f32 {
    let factor = max as f32 / orig as f32;
    if factor <= 1.0 {
        1.0
    } else {
        (1.0 + factor.ln() / (orig as f32).ln()).sqrt()
    }
}

fn md_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Option<&'a str> {
    match md.get(key) {
        Some(Value::String(s)) => Some(s.as_str()),
        _ => None,
    }
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
    if !super::SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
        return Err(SpecdError::UnsupportedArchitecture {
            path: path.to_path_buf(),
            arch,
        });
    }
    let key = |k: &str| format!("{arch}.{k}");
    let need = |k: &str| -> Result<u32> {
        md_u32(md, &key(k))
            .ok_or_else(|| SpecdError::bad_model(path, format!("GGUF metadata lacks {}", key(k))))
    };
    let refuse = |k: &str, why: &str| Err(SpecdError::bad_model(path, format!("{k}: {why}")));
    for moe in ["expert_count", "expert_used_count"] {
        if md_u32(md, &key(moe)).is_some_and(|n| n > 0) {
            return refuse(&key(moe), "mixture-of-experts layers are not supported");
        }
    }
    let hidden = need("embedding_length")? as usize;
    let heads = need("attention.head_count")? as usize;
    let kv_heads = md_u32(md, &key("attention.head_count_kv")).unwrap_or(heads as u32) as usize;
    let rope_dims = md_u32(md, &key("rope.dimension_count")).map(|x| x as usize);
    // Head width: the key length where stated (Gemma 3, Qwen3), else the
    // rotary width (Llama's converter), else hidden / heads.
    let head_dim = md_u32(md, &key("attention.key_length"))
        .map(|x| x as usize)
        .or(if arch == "phi3" { None } else { rope_dims })
        .unwrap_or(hidden.checked_div(heads).unwrap_or(0));
    if let Some(vl) = md_u32(md, &key("attention.value_length")) {
        if vl as usize != head_dim {
            return refuse(
                &key("attention.value_length"),
                &format!("value heads of {vl} differ from key heads of {head_dim}"),
            );
        }
    }
    let embed = ct
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| SpecdError::bad_model(path, "missing tensor token_embd.weight"))?;
    let vocab_size = match embed.shape.dims() {
        [rows, _] => *rows,
        d => {
            return Err(SpecdError::bad_model(
                path,
                format!("tensor token_embd.weight has shape {d:?}, expected 2 dimensions"),
            ))
        }
    };
    let eos = md_u32(md, "tokenizer.ggml.eos_token_id");
    let mut eos_token_ids: Vec<u32> = eos.into_iter().collect();
    for k in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = md_u32(md, k) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
    }
    // llama.cpp counts multi-token-prediction layers (`model::mtp`) in the
    // block count; the main model stops before them.
    let layers = need("block_count")?
        .saturating_sub(md_u32(md, &key("nextn_predict_layers")).unwrap_or(0))
        as usize;
    let mut c = ModelConfig::llama_like(
        &arch,
        vocab_size,
        hidden,
        need("feed_forward_length")? as usize,
        layers,
        heads,
        kv_heads,
        head_dim,
    );
    c.rope_theta = md_f32(md, &key("rope.freq_base")).unwrap_or(10_000.0);
    c.rms_eps = md_f32(md, &key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5);
    c.max_seq_len = need("context_length")? as usize;
    c.bos_token_id = md_u32(md, "tokenizer.ggml.bos_token_id");
    c.eos_token_ids = eos_token_ids;
    // llama.cpp's converter permutes Llama/Mistral q and k into adjacent
    // pairs; every other architecture here rotates half-split pairs.
    c.rope_style = if matches!(arch.as_str(), "llama" | "mistral") {
        RopeStyle::Interleaved
    } else {
        RopeStyle::Neox
    };
    // Rope scaling: `rope_freqs.weight` (Llama 3.1's factors, precomputed
    // by the converter) or the scaling keys.
    let scaling_type = md_str(md, &key("rope.scaling.type"));
    let factor = md_f32(md, &key("rope.scaling.factor"));
    c.rope_scaling = if ct.tensor_infos.contains_key("rope_freqs.weight") {
        RopeScaling::Factors(Vec::new()) // read with the tensors
    } else {
        match scaling_type {
            None | Some("none") => RopeScaling::None,
            Some("linear") => match factor {
                Some(f) if f > 0.0 => RopeScaling::Linear { factor: f },
                _ => return refuse(&key("rope.scaling.factor"), "linear scaling needs a factor"),
            },
            Some("yarn") => {
                if md_f32(md, &key("rope.scaling.yarn_log_multiplier")).is_some_and(|m| m != 0.0) {
                    return refuse(
                        &key("rope.scaling.yarn_log_multiplier"),
                        "DeepSeek's YaRN attention scaling is not supported",
                    );
                }
                RopeScaling::Yarn {
                    factor: match factor {
                        Some(f) if f > 0.0 => f,
                        _ => return refuse(&key("rope.scaling.factor"), "yarn scaling needs a factor"),
                    },
                    original_max_position: md_u32(md, &key("rope.scaling.original_context_length"))
                        .ok_or_else(|| {
                            SpecdError::bad_model(
                                path,
                                format!("GGUF metadata lacks {} (yarn scaling)", key("rope.scaling.original_context_length")),
                            )
                        })? as usize,
                    beta_fast: md_f32(md, &key("rope.scaling.yarn_beta_fast")).unwrap_or(32.0),
                    beta_slow: md_f32(md, &key("rope.scaling.yarn_beta_slow")).unwrap_or(1.0),
                    attention_factor: md_f32(md, &key("rope.scaling.attn_factor")),
                }
            }
            Some(other) => {
                return refuse(
                    &key("rope.scaling.type"),
                    &format!("rope scaling '{other}' is not supported (supported: none, linear, yarn, llama3 factors)"),
                )
            }
        }
    };
    match arch.as_str() {
        "qwen3" => c.qk_norm = true,
        "gemma3" => {
            c.qk_norm = true;
            c.post_norms = true;
            c.activation = Activation::GeluTanh;
            c.embed_scale = Some((hidden as f32).sqrt());
            c.sliding_window = md_u32(md, &key("attention.sliding_window")).map(|w| w as usize);
            c.sliding_pattern = Some(
                md_u32(md, &key("attention.sliding_window_pattern"))
                    .or(md_u32(md, &key("attention.sliding_window_type")))
                    .unwrap_or(6) as usize,
            );
            c.local_rope_theta = Some(md_f32(md, &key("rope.local_freq_base")).unwrap_or(10_000.0));
            // GGUF does not carry `query_pre_attn_scalar`; llama.cpp takes
            // hidden / heads for the 27B (62 layers) and head_dim otherwise.
            let qpas = if layers == 62 {
                hidden.checked_div(heads).unwrap_or(0)
            } else {
                head_dim
            };
            c.attn_scale = 1.0 / (qpas as f32).sqrt();
            c.final_logit_softcap = md_f32(md, &key("final_logit_softcapping"));
            if md_f32(md, &key("attn_logit_softcapping")).is_some() {
                return refuse(
                    &key("attn_logit_softcapping"),
                    "attention softcapping is not supported",
                );
            }
        }
        "phi3" => {
            if ct.tensor_infos.contains_key("rope_factors_short.weight") {
                // LongRoPE: the short factors (read with the tensors) up
                // to the original context, which caps the context.
                let orig = need("rope.scaling.original_context_length")? as usize;
                let attention_factor = md_f32(md, &key("rope.scaling.attn_factor"))
                    .unwrap_or_else(|| longrope_attention(c.max_seq_len, orig));
                c.max_seq_len = c.max_seq_len.min(orig);
                c.rope_scaling = RopeScaling::LongRope {
                    factors: Vec::new(),
                    attention_factor,
                };
            }
            c.rotary_dim = rope_dims.unwrap_or(head_dim);
            c.sliding_window = md_u32(md, &key("attention.sliding_window"))
                .map(|w| w as usize)
                .filter(|&w| w < c.max_seq_len);
        }
        _ => {}
    }
    if c.rotary_dim > head_dim || !c.rotary_dim.is_multiple_of(2) {
        return refuse(
            &key("rope.dimension_count"),
            &format!(
                "rotary width {} does not fit heads of {head_dim}",
                c.rotary_dim
            ),
        );
    }
    Ok(c)
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
        let dt = info.ggml_dtype;
        // Sizes from the header, checked: a header's dimensions can
        // multiply past usize (candle's own count wraps).
        let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let cols = dims.last().copied().unwrap_or(1);
        let Some(n) = n else {
            return Err(SpecdError::bad_model(
                self.path,
                format!("tensor {name}: dimensions {dims:?} are too large"),
            ));
        };
        if cols % dt.block_size() != 0 {
            return Err(SpecdError::bad_model(
                self.path,
                format!(
                    "tensor {name}: rows of {cols} are not whole blocks of {} ({dt:?})",
                    dt.block_size()
                ),
            ));
        }
        let bytes = (n / dt.block_size()).checked_mul(dt.type_size());
        let start = self.ct.tensor_data_offset.checked_add(info.offset);
        let len = self.file.metadata()?.len();
        let (Some(bytes), Some(start)) = (bytes, start) else {
            return Err(SpecdError::bad_model(
                self.path,
                format!("tensor {name}: size or offset too large"),
            ));
        };
        if start.checked_add(bytes as u64).is_none_or(|end| end > len) {
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
        Ok(self.matrix_split(name, &[])?.remove(0))
    }

    /// A matrix cut into consecutive row blocks of `rows` (the rest is the
    /// last block; `&[]`: one block), e.g. Phi-3's fused `attn_qkv`.
    fn matrix_split(&mut self, name: &str, rows_each: &[usize]) -> Result<Vec<QMatrix>> {
        let (dt, dims, raw) = self.raw(name)?;
        if dims.len() != 2 {
            return Err(SpecdError::bad_model(
                self.path,
                format!("tensor {name}: expected 2 dims, got {dims:?}"),
            ));
        }
        let (rows, cols) = (dims[0], dims[1]);
        let mut blocks: Vec<usize> = rows_each.to_vec();
        let taken: usize = blocks.iter().sum();
        if taken > rows || (!blocks.is_empty() && taken == rows) {
            return Err(SpecdError::bad_model(
                self.path,
                format!(
                    "tensor {name}: {rows} rows, expected more than {taken} ({rows_each:?} and the rest)"
                ),
            ));
        }
        blocks.push(rows - taken);
        let row_bytes = cols / dt.block_size() * dt.type_size();
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
        let mut out = Vec::with_capacity(blocks.len());
        let mut r0 = 0;
        for n in blocks {
            let part = &raw[r0 * row_bytes..(r0 + n) * row_bytes];
            out.push(match direct {
                Some(f) => QMatrix::from_ggml_blocks(f, n, cols, part)
                    .map_err(|e| SpecdError::bad_model(self.path, format!("tensor {name}: {e}")))?,
                None => {
                    let v = dequantize(self.path, name, dt, &[n, cols], part)?;
                    QMatrix::from_f32(n, cols, v)
                }
            });
            r0 += n;
        }
        Ok(out)
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
    let mut config = gguf_config(path, &ct)?;
    let file = std::fs::File::open(path)?;
    let mut r = GgufReader {
        path,
        ct: &ct,
        file,
    };
    let factors = match &mut config.rope_scaling {
        RopeScaling::Factors(f) => Some((f, "rope_freqs.weight")),
        RopeScaling::LongRope { factors, .. } => Some((factors, "rope_factors_short.weight")),
        _ => None,
    };
    if let Some((f, name)) = factors {
        *f = r.vector(name)?;
        if f.len() != config.rotary_dim / 2 {
            return Err(SpecdError::bad_model(
                path,
                format!(
                    "tensor {name}: {} values, expected {} (rotary width / 2)",
                    f.len(),
                    config.rotary_dim / 2
                ),
            ));
        }
    }
    let embed = r.matrix("token_embd.weight")?;
    let c = &config;
    let (qd, kvd) = (c.q_dim(), c.kv_heads * c.head_dim);
    let mut layers = Vec::with_capacity(c.layers);
    for i in 0..c.layers {
        let p = format!("blk.{i}");
        let opt = |r: &mut GgufReader, n: &str| -> Result<Option<Vec<f32>>> {
            let name = format!("{p}.{n}");
            if r.has(&name) {
                r.vector(&name).map(Some)
            } else {
                Ok(None)
            }
        };
        let (wq, wk, wv) = if c.arch == "phi3" {
            let mut m = r.matrix_split(&format!("{p}.attn_qkv.weight"), &[qd, kvd])?;
            let wv = m.pop().expect("three blocks");
            let wk = m.pop().expect("three blocks");
            (m.pop().expect("three blocks"), wk, wv)
        } else {
            (
                r.matrix(&format!("{p}.attn_q.weight"))?,
                r.matrix(&format!("{p}.attn_k.weight"))?,
                r.matrix(&format!("{p}.attn_v.weight"))?,
            )
        };
        let (w_gate, w_up) = if c.arch == "phi3" {
            let mut m = r.matrix_split(&format!("{p}.ffn_up.weight"), &[c.intermediate])?;
            let up = m.pop().expect("two blocks");
            (m.pop().expect("two blocks"), up)
        } else {
            (
                r.matrix(&format!("{p}.ffn_gate.weight"))?,
                r.matrix(&format!("{p}.ffn_up.weight"))?,
            )
        };
        let mut l = LayerWeights::llama(
            r.vector(&format!("{p}.attn_norm.weight"))?,
            [wq, wk, wv, r.matrix(&format!("{p}.attn_output.weight"))?],
            [
                opt(&mut r, "attn_q.bias")?,
                opt(&mut r, "attn_k.bias")?,
                opt(&mut r, "attn_v.bias")?,
            ],
            r.vector(&format!("{p}.ffn_norm.weight"))?,
            [w_gate, w_up, r.matrix(&format!("{p}.ffn_down.weight"))?],
        );
        if c.qk_norm {
            l.q_norm = Some(r.vector(&format!("{p}.attn_q_norm.weight"))?);
            l.k_norm = Some(r.vector(&format!("{p}.attn_k_norm.weight"))?);
        }
        if c.post_norms {
            l.post_attn_norm = Some(r.vector(&format!("{p}.post_attention_norm.weight"))?);
            l.post_ffn_norm = Some(r.vector(&format!("{p}.post_ffw_norm.weight"))?);
        }
        layers.push(l);
    }
    let norm = r.vector("output_norm.weight")?;
    let output = if r.has("output.weight") {
        Some(r.matrix("output.weight")?)
    } else {
        None
    };
    let names = TensorNames::gguf();
    check_shapes(
        path,
        &config,
        &embed,
        &layers,
        &norm,
        output.as_ref(),
        &names,
    )?;
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

/// How a checkpoint format names a layer's tensors, for shape errors.
struct TensorNames {
    layer: fn(usize, &str) -> String,
}

impl TensorNames {
    fn gguf() -> Self {
        Self {
            layer: |i, part| {
                let n = match part {
                    "q" => "attn_q",
                    "k" => "attn_k",
                    "v" => "attn_v",
                    "o" => "attn_output",
                    "gate" => "ffn_gate",
                    "up" => "ffn_up",
                    "down" => "ffn_down",
                    "attn_norm" => "attn_norm",
                    "ffn_norm" => "ffn_norm",
                    "q_norm" => "attn_q_norm",
                    "k_norm" => "attn_k_norm",
                    "post_attn_norm" => "post_attention_norm",
                    "post_ffn_norm" => "post_ffw_norm",
                    other => other,
                };
                format!("blk.{i}.{n}.weight")
            },
        }
    }

    fn hf() -> Self {
        Self {
            layer: |i, part| {
                let n = match part {
                    "q" => "self_attn.q_proj",
                    "k" => "self_attn.k_proj",
                    "v" => "self_attn.v_proj",
                    "o" => "self_attn.o_proj",
                    "gate" => "mlp.gate_proj",
                    "up" => "mlp.up_proj",
                    "down" => "mlp.down_proj",
                    "attn_norm" => "input_layernorm",
                    "ffn_norm" => "post_attention_layernorm",
                    "q_norm" => "self_attn.q_norm",
                    "k_norm" => "self_attn.k_norm",
                    "post_attn_norm" => "post_attention_layernorm",
                    "post_ffn_norm" => "post_feedforward_layernorm",
                    other => other,
                };
                format!("model.layers.{i}.{n}.weight")
            },
        }
    }
}

fn check_shapes(
    path: &Path,
    c: &ModelConfig,
    embed: &QMatrix,
    layers: &[LayerWeights],
    norm: &[f32],
    output: Option<&QMatrix>,
    names: &TensorNames,
) -> Result<()> {
    let bad = |what: String| Err(SpecdError::bad_model(path, what));
    if c.max_seq_len == 0 || c.max_seq_len > MAX_CONTEXT {
        return bad(format!(
            "context length {} (context_length / max_position_embeddings): this build takes 1 to {MAX_CONTEXT}",
            c.max_seq_len
        ));
    }
    if embed.rows != c.vocab_size {
        return bad(format!(
            "token embedding of {} rows, but the vocabulary has {} tokens (vocab_size)",
            embed.rows, c.vocab_size
        ));
    }
    if norm.len() != c.hidden {
        return bad(format!(
            "final norm of {} values, expected the hidden size {}",
            norm.len(),
            c.hidden
        ));
    }
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
    let (qd, kvd) = (c.q_dim(), c.kv_heads * c.head_dim);
    for (i, l) in layers.iter().enumerate() {
        let want = [
            ("q", &l.wq, qd, c.hidden),
            ("k", &l.wk, kvd, c.hidden),
            ("v", &l.wv, kvd, c.hidden),
            ("o", &l.wo, c.hidden, qd),
            ("gate", &l.w_gate, c.intermediate, c.hidden),
            ("up", &l.w_up, c.intermediate, c.hidden),
            ("down", &l.w_down, c.hidden, c.intermediate),
        ];
        for (part, m, r, k) in want {
            if (m.rows, m.cols) != (r, k) {
                return bad(format!(
                    "tensor {}: shape {}x{}, expected {r}x{k}",
                    (names.layer)(i, part),
                    m.rows,
                    m.cols
                ));
            }
        }
        let vecs = [
            ("attn_norm", Some(&l.attn_norm), c.hidden),
            ("ffn_norm", Some(&l.ffn_norm), c.hidden),
            ("q_norm", l.q_norm.as_ref(), c.head_dim),
            ("k_norm", l.k_norm.as_ref(), c.head_dim),
            ("post_attn_norm", l.post_attn_norm.as_ref(), c.hidden),
            ("post_ffn_norm", l.post_ffn_norm.as_ref(), c.hidden),
        ];
        for (part, v, n) in vecs {
            if let Some(v) = v {
                if v.len() != n {
                    return bad(format!(
                        "tensor {}: {} values, expected {n}",
                        (names.layer)(i, part),
                        v.len()
                    ));
                }
            }
        }
        for (b, n, part) in [(&l.bq, qd, "q"), (&l.bk, kvd, "k"), (&l.bv, kvd, "v")] {
            if let Some(b) = b {
                if b.len() != n {
                    return bad(format!(
                        "bias of {}: {} values, expected {n}",
                        (names.layer)(i, part),
                        b.len()
                    ));
                }
            }
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
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    /// Transformers v5's place for `rope_theta` and the scaling.
    #[serde(default)]
    rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    quantization_config: Option<serde_json::Value>,
    partial_rotary_factor: Option<f32>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    sliding_window_pattern: Option<usize>,
    layer_types: Option<Vec<String>>,
    rope_local_base_freq: Option<f32>,
    query_pre_attn_scalar: Option<f32>,
    final_logit_softcapping: Option<f32>,
    attn_logit_softcapping: Option<f32>,
    hidden_activation: Option<String>,
    hidden_act: Option<String>,
    original_max_position_embeddings: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts: Option<usize>,
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
    let raw: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| SpecdError::bad_model(&cfg_path, e))?;
    let (raw, multimodal) = text_config(raw);
    let mut hf: HfConfig =
        serde_json::from_value(raw).map_err(|e| SpecdError::bad_model(&cfg_path, e))?;
    normalize_hf(&cfg_path, &mut hf)?;
    let arch = hf_arch(&cfg_path, &hf)?;
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
        if multimodal {
            // The language model's tensors under their text-only names;
            // the vision tower and projector are not loaded.
            tensors.extend(t.into_iter().filter_map(|(name, t)| {
                let text = name
                    .strip_prefix("language_model.")
                    .map(str::to_string)
                    .or_else(|| {
                        name.strip_prefix("model.language_model.")
                            .map(|r| format!("model.{r}"))
                    })
                    .or_else(|| (name == "lm_head.weight").then(|| name.clone()))?;
                Some((text, t))
            }));
        } else {
            tensors.extend(t);
        }
    }
    safetensors_weights(dir, hf, arch, tensors)
}

/// The text model's config: a multimodal Gemma 3 checkpoint
/// (`Gemma3ForConditionalGeneration`, `model_type: "gemma3"`) nests it in
/// `text_config`, with Hugging Face's `Gemma3TextConfig` defaults for the
/// keys it leaves out. Returns the config and whether it was nested.
fn text_config(raw: serde_json::Value) -> (serde_json::Value, bool) {
    let nested = raw["model_type"] == "gemma3" && raw["text_config"].is_object();
    let mut cfg = if nested {
        let mut t = raw["text_config"].clone();
        // Token ids and the tied head may sit at the top level.
        for k in ["bos_token_id", "eos_token_id", "tie_word_embeddings"] {
            if t.get(k).is_none() && !raw[k].is_null() {
                t[k] = raw[k].clone();
            }
        }
        t["model_type"] = serde_json::json!("gemma3_text");
        t
    } else {
        raw
    };
    if cfg["model_type"] == "gemma3_text" {
        let defaults = serde_json::json!({
            "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "sliding_window_pattern": 6, "tie_word_embeddings": true,
            "bos_token_id": 2, "eos_token_id": 1
        });
        // Transformers v5 gives the thetas in `rope_parameters`.
        let v5_rope = cfg.get("rope_parameters").is_some_and(|x| !x.is_null());
        for (k, v) in defaults.as_object().into_iter().flatten() {
            if v5_rope && k.starts_with("rope_") {
                continue;
            }
            if cfg.get(k).is_none_or(|x| x.is_null()) {
                cfg[k] = v.clone();
            }
        }
    }
    (cfg, nested)
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
    let mut hf: HfConfig =
        serde_json::from_str(config_json).map_err(|e| SpecdError::bad_model(origin, e))?;
    normalize_hf(origin, &mut hf)?;
    let arch = hf_arch(origin, &hf)?;
    let (config, weights) = safetensors_weights(origin, hf, arch, tensors)?;
    Model::new(config, weights, threads)
}

/// What every Hugging Face config goes through before use: Transformers
/// v5's `rope_parameters` (one object, or one per layer type) read as the
/// older `rope_theta`, `rope_scaling` and `rope_local_base_freq` (ignored, a Qwen3 would run at theta 10,000 and a Llama
/// 3.1 without its scaling), and checkpoints this loader cannot compute
/// refused (quantized ones: their scales would be dropped).
fn normalize_hf(path: &Path, hf: &mut HfConfig) -> Result<()> {
    if let Some(q) = hf.quantization_config.as_ref().filter(|v| !v.is_null()) {
        let method = q
            .get("quant_method")
            .and_then(|m| m.as_str())
            .unwrap_or("unknown");
        return Err(SpecdError::bad_model(
            path,
            format!(
                "quantization_config ({method}): quantized safetensors checkpoints are not supported (their scales would be ignored); use the unquantized checkpoint or a GGUF"
            ),
        ));
    }
    let Some(rp) = hf.rope_parameters.clone().filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let Some(obj) = rp.as_object() else {
        return Err(SpecdError::bad_model(
            path,
            "rope_parameters: not an object",
        ));
    };
    if obj.contains_key("rope_theta") || !obj.values().any(|v| v.is_object()) {
        return global_rope(hf, &rp);
    }
    // Per layer type (Gemma 3 in v5): the global layers' theta and
    // scaling, and the sliding layers' theta (which run unscaled).
    for (kind, params) in obj {
        let kind_of = |p: &serde_json::Value| {
            p.get("rope_type")
                .or_else(|| p.get("type"))
                .and_then(|v| v.as_str())
                .unwrap_or("default")
                .to_string()
        };
        match kind.as_str() {
            "full_attention" => global_rope(hf, params)?,
            "sliding_attention" if kind_of(params) == "default" => {
                if hf.rope_local_base_freq.is_none() {
                    hf.rope_local_base_freq = params
                        .get("rope_theta")
                        .and_then(|v| v.as_f64())
                        .map(|v| v as f32);
                }
            }
            "sliding_attention" => {
                return Err(SpecdError::bad_model(
                    path,
                    format!(
                        "rope_parameters.sliding_attention: scaling '{}' of the sliding-window layers is not supported",
                        kind_of(params)
                    ),
                ))
            }
            other => {
                return Err(SpecdError::bad_model(
                    path,
                    format!("rope_parameters.{other}: a layer type specd does not know"),
                ))
            }
        }
    }
    Ok(())
}

/// One `rope_parameters` object (theta and scaling) as v4's `rope_theta`
/// and `rope_scaling`, where those are not given.
fn global_rope(hf: &mut HfConfig, rp: &serde_json::Value) -> Result<()> {
    if hf.rope_theta.is_none() {
        hf.rope_theta = rp
            .get("rope_theta")
            .and_then(|v| v.as_f64())
            .map(|v| v as f32);
    }
    let kind = rp
        .get("rope_type")
        .or_else(|| rp.get("type"))
        .and_then(|v| v.as_str());
    if hf.rope_scaling.as_ref().is_none_or(|v| v.is_null()) && kind.is_some_and(|k| k != "default")
    {
        hf.rope_scaling = Some(rp.clone());
    }
    Ok(())
}

fn hf_arch(path: &Path, hf: &HfConfig) -> Result<String> {
    let arch = hf
        .model_type
        .clone()
        .or_else(|| hf.architectures.first().map(|a| a.to_lowercase()))
        .unwrap_or_default();
    Ok(match arch.as_str() {
        "llama" | "mistral" | "qwen2" | "qwen3" | "phi3" => arch,
        "gemma3_text" => "gemma3".into(),
        a if a.starts_with("llama") => "llama".into(),
        a if a.starts_with("mistral") => "mistral".into(),
        a if a.starts_with("qwen2") && !a.contains("moe") => "qwen2".into(),
        _ => {
            return Err(SpecdError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                arch,
            })
        }
    })
}

/// The model options of a Hugging Face config beyond the shapes.
fn hf_options(path: &Path, hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    let refuse = |k: &str, why: String| Err(SpecdError::bad_model(path, format!("{k}: {why}")));
    for (k, v) in [
        ("num_local_experts", hf.num_local_experts),
        ("num_experts", hf.num_experts),
    ] {
        if v.is_some_and(|n| n > 0) {
            return refuse(k, "mixture-of-experts layers are not supported".into());
        }
    }
    if let Some(f) = hf.partial_rotary_factor {
        c.rotary_dim = ((c.head_dim as f32 * f) as usize) & !1;
    }
    if let Some(rs) = hf.rope_scaling.as_ref().filter(|v| !v.is_null()) {
        let kind = rs
            .get("rope_type")
            .or_else(|| rs.get("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let num = |k: &str| rs.get(k).and_then(|v| v.as_f64()).map(|v| v as f32);
        let need = |k: &str| {
            num(k).ok_or_else(|| {
                SpecdError::bad_model(path, format!("rope_scaling.{k}: missing for '{kind}'"))
            })
        };
        c.rope_scaling = match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: need("factor")?,
            },
            "yarn" => {
                let factor = need("factor")?;
                // DeepSeek's form: a ratio of two mscales.
                let mscale = |m: f32| 0.1 * m * factor.ln() + 1.0;
                let attention_factor =
                    num("attention_factor").or(match (num("mscale"), num("mscale_all_dim")) {
                        (Some(a), Some(b)) if a != 0.0 && b != 0.0 => Some(mscale(a) / mscale(b)),
                        _ => None,
                    });
                RopeScaling::Yarn {
                    factor,
                    original_max_position: num("original_max_position_embeddings")
                        .map_or(c.max_seq_len, |v| v as usize),
                    beta_fast: num("beta_fast").unwrap_or(32.0),
                    beta_slow: num("beta_slow").unwrap_or(1.0),
                    attention_factor,
                }
            }
            "longrope" => {
                let orig = hf
                    .original_max_position_embeddings
                    .or(num("original_max_position_embeddings").map(|v| v as usize))
                    .unwrap_or(c.max_seq_len);
                let short: Vec<f32> = rs
                    .get("short_factor")
                    .and_then(|v| v.as_array())
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x.as_f64())
                            .map(|x| x as f32)
                            .collect()
                    })
                    .ok_or_else(|| {
                        SpecdError::bad_model(
                            path,
                            "rope_scaling.short_factor: missing for 'longrope'",
                        )
                    })?;
                if short.len() != c.rotary_dim / 2 {
                    return refuse(
                        "rope_scaling.short_factor",
                        format!(
                            "{} values, expected {} (rotary width / 2)",
                            short.len(),
                            c.rotary_dim / 2
                        ),
                    );
                }
                let attention_factor = num("attention_factor")
                    .unwrap_or_else(|| longrope_attention(c.max_seq_len, orig));
                c.max_seq_len = c.max_seq_len.min(orig);
                RopeScaling::LongRope {
                    factors: short,
                    attention_factor,
                }
            }
            "llama3" => RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position: need("original_max_position_embeddings")? as usize,
            },
            other => {
                return refuse(
                    "rope_scaling.rope_type",
                    format!(
                        "'{other}' is not supported (supported: default, linear, llama3, yarn)"
                    ),
                )
            }
        };
    }
    let act = hf.hidden_activation.as_deref().or(hf.hidden_act.as_deref());
    let window = hf.sliding_window.filter(|&w| w > 0 && w < c.max_seq_len);
    match c.arch.as_str() {
        "qwen2" | "qwen3" if hf.use_sliding_window == Some(true) => {
            return refuse(
                "use_sliding_window",
                "Qwen's mixed sliding-window layers are not supported".into(),
            );
        }
        "qwen3" => c.qk_norm = true,
        "mistral" => c.sliding_window = window,
        "phi3" => c.sliding_window = window,
        "gemma3" => {
            c.qk_norm = true;
            c.post_norms = true;
            c.embed_scale = Some((c.hidden as f32).sqrt());
            c.sliding_window = hf.sliding_window;
            let pattern = hf.sliding_window_pattern.unwrap_or(6);
            if pattern == 0 {
                return refuse(
                    "sliding_window_pattern",
                    "0 (every n-th layer is global: n >= 1)".into(),
                );
            }
            if let Some(types) = &hf.layer_types {
                let want: Vec<&str> = (0..c.layers)
                    .map(|i| {
                        if (i + 1) % pattern == 0 {
                            "full_attention"
                        } else {
                            "sliding_attention"
                        }
                    })
                    .collect();
                if types.iter().map(String::as_str).ne(want.iter().copied()) {
                    return refuse(
                        "layer_types",
                        format!("only every {pattern}th layer global is supported"),
                    );
                }
            }
            c.sliding_pattern = Some(pattern);
            c.local_rope_theta = Some(hf.rope_local_base_freq.unwrap_or(10_000.0));
            c.attn_scale = 1.0 / hf.query_pre_attn_scalar.unwrap_or(c.head_dim as f32).sqrt();
            c.final_logit_softcap = hf.final_logit_softcapping;
            if hf.attn_logit_softcapping.is_some() {
                return refuse(
                    "attn_logit_softcapping",
                    "attention softcapping is not supported".into(),
                );
            }
        }
        _ => {}
    }
    c.activation = match act {
        None | Some("silu") => {
            if c.arch == "gemma3" {
                Activation::GeluTanh
            } else {
                Activation::Silu
            }
        }
        Some("gelu_pytorch_tanh") | Some("gelu_tanh") => Activation::GeluTanh,
        Some(other) => {
            return refuse(
                "hidden_activation",
                format!("'{other}' is not supported (supported: silu, gelu_pytorch_tanh)"),
            )
        }
    };
    if c.rotary_dim == 0 || c.rotary_dim > c.head_dim {
        return refuse(
            "partial_rotary_factor",
            format!(
                "rotary width {} does not fit heads of {}",
                c.rotary_dim, c.head_dim
            ),
        );
    }
    Ok(())
}

fn safetensors_weights(
    dir: &Path,
    hf: HfConfig,
    arch: String,
    mut tensors: HashMap<String, Tensor>,
) -> Result<(ModelConfig, Weights)> {
    let heads = hf.num_attention_heads;
    let mut config = ModelConfig::llama_like(
        &arch,
        hf.vocab_size,
        hf.hidden_size,
        hf.intermediate_size,
        hf.num_hidden_layers,
        heads,
        hf.num_key_value_heads.unwrap_or(heads),
        hf.head_dim
            .unwrap_or(hf.hidden_size.checked_div(heads).unwrap_or(0)),
    );
    config.rope_theta = hf.rope_theta.unwrap_or(10_000.0);
    config.rms_eps = hf.rms_norm_eps.unwrap_or(1e-5);
    config.max_seq_len = hf.max_position_embeddings.unwrap_or(4096);
    config.bos_token_id = ids(&hf.bos_token_id).first().copied();
    config.eos_token_ids = ids(&hf.eos_token_id);
    hf_options(dir, &hf, &mut config)?;
    let c = &config;
    // Gemma's RMSNorm multiplies by (1 + w); folded here, as llama.cpp's
    // converter folds it into GGUF files.
    let norm_offset = if arch == "gemma3" { 1.0 } else { 0.0 };
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
    // Rows r0..r0 + n of a fused matrix.
    let rows = |t: &Tensor, r0: usize, n: usize, name: &str| -> Result<QMatrix> {
        let part = t.narrow(0, r0, n).map_err(|e| {
            SpecdError::bad_model(
                dir,
                format!(
                    "tensor {name}: rows {r0}..{} of {:?}: {e}",
                    r0 + n,
                    t.dims()
                ),
            )
        })?;
        mat(part, name)
    };
    let embed = mat(
        take("model.embed_tokens.weight")?,
        "model.embed_tokens.weight",
    )?;
    let bias = hf.attention_bias.unwrap_or(arch == "qwen2");
    let (qd, kvd) = (c.q_dim(), c.kv_heads * c.head_dim);
    let mut layers = Vec::with_capacity(c.layers);
    for i in 0..c.layers {
        let p = format!("model.layers.{i}");
        let fused = if arch == "phi3" {
            let name = format!("{p}.self_attn.qkv_proj.weight");
            let qkv = take(&name)?;
            let (wq, wk, wv) = (
                rows(&qkv, 0, qd, &name)?,
                rows(&qkv, qd, kvd, &name)?,
                rows(&qkv, qd + kvd, kvd, &name)?,
            );
            let name = format!("{p}.mlp.gate_up_proj.weight");
            let gu = take(&name)?;
            let ff = c.intermediate;
            Some((
                wq,
                wk,
                wv,
                rows(&gu, 0, ff, &name)?,
                rows(&gu, ff, ff, &name)?,
            ))
        } else {
            None
        };
        let mut m = |n: &str| -> Result<QMatrix> {
            let name = format!("{p}.{n}");
            let t = take(&name)?;
            mat(t, &name)
        };
        let (wq, wk, wv, w_gate, w_up) = match fused {
            Some(f) => f,
            None => (
                m("self_attn.q_proj.weight")?,
                m("self_attn.k_proj.weight")?,
                m("self_attn.v_proj.weight")?,
                m("mlp.gate_proj.weight")?,
                m("mlp.up_proj.weight")?,
            ),
        };
        let wo = m("self_attn.o_proj.weight")?;
        let w_down = m("mlp.down_proj.weight")?;
        let mut v = |n: &str| -> Result<Vec<f32>> {
            let name = format!("{p}.{n}");
            let t = take(&name)?;
            f32v(t, &name)
        };
        let mut norm = |n: &str| -> Result<Vec<f32>> {
            Ok(v(n)?.into_iter().map(|w| w + norm_offset).collect())
        };
        let attn_norm = norm("input_layernorm.weight")?;
        let (ffn_norm, post_attn_norm, post_ffn_norm) = if c.post_norms {
            (
                norm("pre_feedforward_layernorm.weight")?,
                Some(norm("post_attention_layernorm.weight")?),
                Some(norm("post_feedforward_layernorm.weight")?),
            )
        } else {
            (norm("post_attention_layernorm.weight")?, None, None)
        };
        let (q_norm, k_norm) = if c.qk_norm {
            (
                Some(norm("self_attn.q_norm.weight")?),
                Some(norm("self_attn.k_norm.weight")?),
            )
        } else {
            (None, None)
        };
        let (bq, bk, bv) = if bias {
            (
                Some(v("self_attn.q_proj.bias")?),
                Some(v("self_attn.k_proj.bias")?),
                Some(v("self_attn.v_proj.bias")?),
            )
        } else {
            (None, None, None)
        };
        let mut l = LayerWeights::llama(
            attn_norm,
            [wq, wk, wv, wo],
            [bq, bk, bv],
            ffn_norm,
            [w_gate, w_up, w_down],
        );
        (l.q_norm, l.k_norm) = (q_norm, k_norm);
        (l.post_attn_norm, l.post_ffn_norm) = (post_attn_norm, post_ffn_norm);
        layers.push(l);
    }
    let norm: Vec<f32> = f32v(take("model.norm.weight")?, "model.norm.weight")?
        .into_iter()
        .map(|w| w + norm_offset)
        .collect();
    let output = match (
        take("lm_head.weight"),
        hf.tie_word_embeddings.unwrap_or(arch == "gemma3"),
    ) {
        (Ok(t), _) => Some(mat(t, "lm_head.weight")?),
        (Err(_), true) => None,
        (Err(e), false) => return Err(e),
    };
    check_shapes(
        dir,
        &config,
        &embed,
        &layers,
        &norm,
        output.as_ref(),
        &TensorNames::hf(),
    )?;
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
