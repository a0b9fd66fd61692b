//! Requantizing a GGUF file with candle's quantizer (ggml's block code):
//! `specd quantize` writes e.g. a Q4_K_M copy of a model, tensor types
//! chosen as llama.cpp's `llama-quantize` chooses them.
//!
//! Invariants: metadata is copied unchanged (plus `general.file_type`);
//! 1-D tensors (norms, biases) keep their type; every matrix is dequantized
//! to F32 and quantized once to its new type; tensors keep their order.

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

use super::kernels::QK_K;
use crate::error::{Result, SpecdError};

/// A requantization recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// llama.cpp's Q4_K_M: Q4_K, with Q6_K for the output head and for
    /// `attn_v` and `ffn_down` in the layers `use_more_bits` picks.
    Q4KM,
    /// llama.cpp's Q5_K_M: as Q4_K_M with Q5_K in place of Q4_K.
    Q5KM,
    /// Every matrix Q4_K (rows that are not whole super-blocks: Q5_0).
    Q4K,
    /// Every matrix Q6_K (rows that are not whole super-blocks: Q8_0).
    Q6K,
    /// Every matrix Q8_0.
    Q8_0,
    /// Every matrix Q4_1.
    Q4_1,
}

impl Scheme {
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "q4_k_m" => Scheme::Q4KM,
            "q5_k_m" => Scheme::Q5KM,
            "q4_k" => Scheme::Q4K,
            "q6_k" => Scheme::Q6K,
            "q8_0" => Scheme::Q8_0,
            "q4_1" => Scheme::Q4_1,
            other => {
                return Err(format!(
                    "unknown quantization {other:?} (use q4_k_m, q5_k_m, q4_k, q6_k, q8_0 or q4_1)"
                ))
            }
        })
    }

    /// ggml's `general.file_type` code for the scheme.
    fn file_type(self) -> u32 {
        match self {
            Scheme::Q4KM => 15,
            Scheme::Q5KM => 17,
            Scheme::Q4K => 14,
            Scheme::Q6K => 18,
            Scheme::Q8_0 => 7,
            Scheme::Q4_1 => 3,
        }
    }
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers
/// and every third one between.
fn use_more_bits(layer: usize, layers: usize) -> bool {
    layer < layers / 8
        || layer >= 7 * layers / 8
        || (layer as isize - (layers / 8) as isize) % 3 == 2
}

/// The type `scheme` gives the matrix `name` with rows of `cols` elements
/// in a model of `layers` layers, and whether it is a fallback. K-quants
/// need rows of whole 256-element super-blocks; other rows fall back as
/// llama.cpp falls back them: Q6_K to Q8_0, Q4_K to Q5_0, Q5_K to Q5_1.
pub fn tensor_type(scheme: Scheme, name: &str, cols: usize, layers: usize) -> (GgmlDType, bool) {
    let layer = name
        .strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse::<usize>().ok());
    let want = match scheme {
        Scheme::Q4KM | Scheme::Q5KM => {
            let more = layer.is_some_and(|l| use_more_bits(l, layers));
            if name == "output.weight"
                || (more && (name.contains(".attn_v.") || name.contains(".ffn_down.")))
            {
                GgmlDType::Q6K
            } else if scheme == Scheme::Q5KM {
                GgmlDType::Q5K
            } else {
                GgmlDType::Q4K
            }
        }
        Scheme::Q4K => GgmlDType::Q4K,
        Scheme::Q6K => GgmlDType::Q6K,
        Scheme::Q8_0 => return (GgmlDType::Q8_0, false),
        Scheme::Q4_1 => return (GgmlDType::Q4_1, false),
    };
    if cols.is_multiple_of(QK_K) {
        (want, false)
    } else {
        let fallback = match want {
            GgmlDType::Q6K => GgmlDType::Q8_0,
            GgmlDType::Q5K => GgmlDType::Q5_1,
            _ => GgmlDType::Q5_0,
        };
        (fallback, true)
    }
}

/// What `requantize` wrote.
#[derive(Debug, Default)]
pub struct Summary {
    /// (type name, tensors, bytes) per written type, sorted by name.
    pub types: Vec<(String, usize, usize)>,
    /// Matrices that took a fallback type (rows not whole super-blocks).
    pub fallbacks: usize,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// Write `src` (GGUF) to `dst` requantized with `scheme`.
pub fn requantize(src: &Path, dst: &Path, scheme: Scheme) -> Result<Summary> {
    let bad = |e: String| SpecdError::bad_model(src, e);
    let mut f = std::fs::File::open(src).map_err(|e| SpecdError::bad_model(src, e))?;
    let ct = gguf_file::Content::read(&mut f)
        .map_err(|e| bad(format!("not a valid GGUF file ({e})")))?;
    let arch = match ct.metadata.get("general.architecture") {
        Some(Value::String(s)) => s.clone(),
        _ => return Err(bad("GGUF metadata lacks general.architecture".into())),
    };
    let layers = ct
        .metadata
        .get(&format!("{arch}.block_count"))
        .and_then(|v| v.to_u32().ok())
        .unwrap_or(0) as usize;
    let mut names: Vec<(&String, u64)> =
        ct.tensor_infos.iter().map(|(n, i)| (n, i.offset)).collect();
    names.sort_by_key(|&(_, o)| o);
    let mut summary = Summary {
        bytes_in: std::fs::metadata(src)?.len(),
        ..Default::default()
    };
    let mut tensors: Vec<(String, QTensor)> = Vec::with_capacity(names.len());
    for (name, _) in names {
        let q = ct
            .tensor(&mut f, name, &Device::Cpu)
            .map_err(|e| bad(format!("tensor {name}: {e}")))?;
        let dims = q.shape().dims().to_vec();
        let q = if dims.len() == 2 {
            let (dt, fell_back) = tensor_type(scheme, name, dims[1], layers);
            summary.fallbacks += usize::from(fell_back);
            let t = q
                .dequantize(&Device::Cpu)
                .and_then(|t| QTensor::quantize(&t, dt))
                .map_err(|e| bad(format!("tensor {name}: quantizing to {dt:?}: {e}")))?;
            t
        } else {
            q
        };
        let ty = format!("{:?}", q.dtype());
        let size = q.storage_size_in_bytes();
        match summary.types.iter_mut().find(|(n, _, _)| *n == ty) {
            Some(e) => {
                e.1 += 1;
                e.2 += size;
            }
            None => summary.types.push((ty, 1, size)),
        }
        tensors.push((name.clone(), q));
    }
    summary.types.sort();
    let mut md: Vec<(String, Value)> = ct
        .metadata
        .iter()
        .filter(|(k, _)| k.as_str() != "general.file_type")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    md.push(("general.file_type".into(), Value::U32(scheme.file_type())));
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tmp = dst.with_extension("gguf.partial");
    {
        let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        gguf_file::write(&mut out, &md_refs, &t_refs)
            .map_err(|e| SpecdError::bad_model(dst, format!("writing GGUF: {e}")))?;
        std::io::Write::flush(&mut out)?;
    }
    std::fs::rename(&tmp, dst)?;
    summary.bytes_out = std::fs::metadata(dst)?.len();
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_m_picks_types_as_llama_cpp_does() {
        // 30 layers (SmolLM2-135M): more bits in layers 0-2, 26-29 and
        // every third from 5.
        let more: Vec<usize> = (0..30).filter(|&l| use_more_bits(l, 30)).collect();
        assert_eq!(more, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]);
        let t = |name: &str, cols| tensor_type(Scheme::Q4KM, name, cols, 30);
        assert_eq!(t("blk.5.ffn_down.weight", 1536), (GgmlDType::Q6K, false));
        assert_eq!(t("blk.6.ffn_down.weight", 1536), (GgmlDType::Q4K, false));
        assert_eq!(t("blk.5.attn_v.weight", 2048), (GgmlDType::Q6K, false));
        assert_eq!(t("blk.5.attn_q.weight", 2048), (GgmlDType::Q4K, false));
        assert_eq!(t("output.weight", 4096), (GgmlDType::Q6K, false));
        // Rows that are not whole super-blocks fall back.
        assert_eq!(t("blk.5.attn_v.weight", 576), (GgmlDType::Q8_0, true));
        assert_eq!(t("blk.6.attn_q.weight", 576), (GgmlDType::Q5_0, true));
        let t5 = |name: &str, cols| tensor_type(Scheme::Q5KM, name, cols, 30);
        assert_eq!(t5("blk.6.ffn_down.weight", 1536), (GgmlDType::Q5K, false));
        assert_eq!(t5("blk.5.ffn_down.weight", 1536), (GgmlDType::Q6K, false));
        assert_eq!(t5("blk.6.attn_q.weight", 576), (GgmlDType::Q5_1, true));
        assert!(Scheme::parse("Q4_K_M").is_ok());
        assert!(Scheme::parse("q3_k").unwrap_err().contains("q3_k"));
    }
}
