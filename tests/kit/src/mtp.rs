//! A multi-token-prediction layer for the tiny models (DeepSeek-V3's
//! tensors, Hugging Face or llama.cpp names), for the MTP plugin's tests
//! and any test that needs a target with a trained-proposer layer.

use super::*;

/// The MTP layer's tensors, Hugging Face names after `model.layers.{N}.`.
pub fn mtp_weights(s: &TinySpec, seed: u64, own_head: bool) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut sd = seed;
    let (h, hd) = (s.hidden, s.hidden / s.heads);
    let (q, kv, f) = (s.heads * hd, s.kv_heads * hd, s.intermediate);
    let mut w = Vec::new();
    let norm = |sd: &mut u64| -> Vec<f32> { lcg_vec(sd, h, 0.1).iter().map(|x| 1.0 + x).collect() };
    for n in ["enorm.weight", "hnorm.weight", "input_layernorm.weight"] {
        let v = norm(&mut sd);
        w.push((n.to_string(), vec![h], v));
    }
    for (n, shape, scale) in [
        ("eh_proj.weight", vec![h, 2 * h], 0.15),
        ("self_attn.q_proj.weight", vec![q, h], 0.2),
        ("self_attn.k_proj.weight", vec![kv, h], 0.2),
        ("self_attn.v_proj.weight", vec![kv, h], 0.2),
        ("self_attn.o_proj.weight", vec![h, q], 0.2),
        ("mlp.gate_proj.weight", vec![f, h], 0.2),
        ("mlp.up_proj.weight", vec![f, h], 0.2),
        ("mlp.down_proj.weight", vec![h, f], 0.2),
    ] {
        let n_el = shape.iter().product();
        w.push((n.to_string(), shape, lcg_vec(&mut sd, n_el, scale)));
    }
    for n in ["post_attention_layernorm.weight", "shared_head.norm.weight"] {
        let v = norm(&mut sd);
        w.push((n.to_string(), vec![h], v));
    }
    if own_head {
        w.push((
            "shared_head.head.weight".into(),
            vec![s.vocab, h],
            lcg_vec(&mut sd, s.vocab * h, 0.5),
        ));
    }
    w
}

/// llama.cpp's query/key row permutation (HF halves -> interleaved pairs).
pub fn permute(w: &[f32], rows: usize, cols: usize, hd: usize) -> Vec<f32> {
    let mut out = vec![0f32; w.len()];
    for h in 0..rows / hd {
        for i in 0..hd / 2 {
            for (src, dst) in [(i, 2 * i), (hd / 2 + i, 2 * i + 1)] {
                let (a, b) = ((h * hd + src) * cols, (h * hd + dst) * cols);
                out[b..b + cols].copy_from_slice(&w[a..a + cols]);
            }
        }
    }
    out
}

/// A tiny GGUF target (base weights from seed 3, the MTP layer's from
/// `mtp_weights`' seed 9) with the MTP layer as llama.cpp writes it: block
/// count including it, `nextn_predict_layers`, `blk.{N}.nextn.*`.
pub fn mtp_gguf_target(path: &Path, s: &TinySpec, own_head: bool, dtype: GgmlDType) -> PathBuf {
    mtp_gguf_target_with(path, s, own_head, dtype, Vec::new())
}

/// `mtp_gguf_target` with more metadata (a vocabulary's tokens, say).
pub fn mtp_gguf_target_with(
    path: &Path,
    s: &TinySpec,
    own_head: bool,
    dtype: GgmlDType,
    extra_md: Vec<(String, Value)>,
) -> PathBuf {
    let n = s.layers;
    let hd = s.hidden / s.heads;
    let extra = mtp_weights(s, 9, own_head)
        .into_iter()
        .map(|(name, sh, d)| {
            let gg = match name.as_str() {
                "enorm.weight" | "hnorm.weight" | "eh_proj.weight" => format!("nextn.{name}"),
                "shared_head.norm.weight" => "nextn.shared_head_norm.weight".into(),
                "shared_head.head.weight" => "nextn.shared_head_head.weight".into(),
                "input_layernorm.weight" => "attn_norm.weight".into(),
                "post_attention_layernorm.weight" => "ffn_norm.weight".into(),
                "self_attn.q_proj.weight" => "attn_q.weight".into(),
                "self_attn.k_proj.weight" => "attn_k.weight".into(),
                "self_attn.v_proj.weight" => "attn_v.weight".into(),
                "self_attn.o_proj.weight" => "attn_output.weight".into(),
                "mlp.gate_proj.weight" => "ffn_gate.weight".into(),
                "mlp.up_proj.weight" => "ffn_up.weight".into(),
                "mlp.down_proj.weight" => "ffn_down.weight".into(),
                other => panic!("{other}"),
            };
            let d = if gg == "attn_q.weight" || gg == "attn_k.weight" {
                permute(&d, sh[0], sh[1], hd)
            } else {
                d
            };
            (format!("blk.{n}.{gg}"), sh, d)
        })
        .collect();
    write_tiny_gguf_with(
        path,
        s,
        3,
        dtype,
        "llama",
        "t",
        extra,
        [
            ("llama.block_count".into(), Value::U32(n as u32 + 1)),
            ("llama.nextn_predict_layers".into(), Value::U32(1)),
        ]
        .into_iter()
        .chain(extra_md)
        .collect(),
    );
    path.to_path_buf()
}
