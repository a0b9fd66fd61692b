//! The cached default model, a tiny random Llama written as GGUF and as
//! safetensors, temporary directories.

use super::*;

/// The cached SmolLM2 GGUF, fetched on first use (the only download tests
/// ever make; `.ci/run` fetches it before the tests).
pub fn smollm_path() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        specd::fetch::ensure_default_model()
            .unwrap_or_else(|e| panic!("default model unavailable: {e}"))
    })
    .clone()
}

pub struct TinySpec {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub max_seq: usize,
}

pub const TINY: TinySpec = TinySpec {
    vocab: 96,
    hidden: 64,
    intermediate: 128,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    max_seq: 256,
};

/// Seeded uniform values in [-scale, scale).
pub fn lcg_vec(seed: &mut u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Random weights in Hugging Face naming, `[out, in]` layout.
pub fn tiny_weights(s: &TinySpec, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut seed = seed;
    let hd = s.hidden / s.heads;
    let mut w = Vec::new();
    let push = |w: &mut Vec<_>, name: String, shape: Vec<usize>, scale: f32, seed: &mut u64| {
        let n = shape.iter().product();
        w.push((name, shape, lcg_vec(seed, n, scale)));
    };
    push(
        &mut w,
        "model.embed_tokens.weight".into(),
        vec![s.vocab, s.hidden],
        1.0,
        &mut seed,
    );
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        push(
            &mut w,
            format!("{p}.self_attn.q_proj.weight"),
            vec![s.heads * hd, s.hidden],
            0.2,
            &mut seed,
        );
        push(
            &mut w,
            format!("{p}.self_attn.k_proj.weight"),
            vec![s.kv_heads * hd, s.hidden],
            0.2,
            &mut seed,
        );
        push(
            &mut w,
            format!("{p}.self_attn.v_proj.weight"),
            vec![s.kv_heads * hd, s.hidden],
            0.2,
            &mut seed,
        );
        push(
            &mut w,
            format!("{p}.self_attn.o_proj.weight"),
            vec![s.hidden, s.heads * hd],
            0.2,
            &mut seed,
        );
        push(
            &mut w,
            format!("{p}.mlp.gate_proj.weight"),
            vec![s.intermediate, s.hidden],
            0.2,
            &mut seed,
        );
        push(
            &mut w,
            format!("{p}.mlp.up_proj.weight"),
            vec![s.intermediate, s.hidden],
            0.2,
            &mut seed,
        );
        push(
            &mut w,
            format!("{p}.mlp.down_proj.weight"),
            vec![s.hidden, s.intermediate],
            0.2,
            &mut seed,
        );
        let mut n1 = lcg_vec(&mut seed, s.hidden, 0.1);
        n1.iter_mut().for_each(|x| *x += 1.0);
        w.push((format!("{p}.input_layernorm.weight"), vec![s.hidden], n1));
        let mut n2 = lcg_vec(&mut seed, s.hidden, 0.1);
        n2.iter_mut().for_each(|x| *x += 1.0);
        w.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![s.hidden],
            n2,
        ));
    }
    w.push((
        "model.norm.weight".into(),
        vec![s.hidden],
        vec![1.0; s.hidden],
    ));
    push(
        &mut w,
        "lm_head.weight".into(),
        vec![s.vocab, s.hidden],
        0.5,
        &mut seed,
    );
    w
}

fn tensor(shape: &[usize], data: &[f32]) -> Tensor {
    Tensor::from_slice(data, shape, &Device::Cpu).unwrap()
}

/// Write the tiny model as a safetensors directory (config.json included).
pub fn write_tiny_safetensors(dir: &Path, s: &TinySpec, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
    let map: std::collections::HashMap<String, Tensor> = tiny_weights(s, seed)
        .into_iter()
        .map(|(n, sh, d)| (n, tensor(&sh, &d)))
        .collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    let cfg = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": s.max_seq,
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": 2
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

/// Write the tiny model as GGUF with matrices in `dtype` (norms stay F32).
/// `arch` lets tests write an unsupported architecture name.
pub fn write_tiny_gguf(path: &Path, s: &TinySpec, seed: u64, dtype: GgmlDType, arch: &str) {
    write_tiny_gguf_tokens(path, s, seed, dtype, arch, "t")
}

/// As `write_tiny_gguf`, with token strings `{prefix}{id}`.
pub fn write_tiny_gguf_tokens(
    path: &Path,
    s: &TinySpec,
    seed: u64,
    dtype: GgmlDType,
    arch: &str,
    prefix: &str,
) {
    write_tiny_gguf_with(path, s, seed, dtype, arch, prefix, Vec::new(), Vec::new())
}

/// As `write_tiny_gguf_tokens`, plus `extra` tensors (GGUF names, written
/// as given: matrices in `dtype`) and metadata (`extra_md` replaces keys).
#[allow(clippy::too_many_arguments)]
pub fn write_tiny_gguf_with(
    path: &Path,
    s: &TinySpec,
    seed: u64,
    dtype: GgmlDType,
    arch: &str,
    prefix: &str,
    extra: Vec<(String, Vec<usize>, Vec<f32>)>,
    extra_md: Vec<(String, Value)>,
) {
    let hf = tiny_weights(s, seed);
    let rename = |n: &str| -> String {
        n.replace("model.embed_tokens.weight", "token_embd.weight")
            .replace("model.norm.weight", "output_norm.weight")
            .replace("lm_head.weight", "output.weight")
            .replace("model.layers.", "blk.")
            .replace("self_attn.q_proj", "attn_q")
            .replace("self_attn.k_proj", "attn_k")
            .replace("self_attn.v_proj", "attn_v")
            .replace("self_attn.o_proj", "attn_output")
            .replace("mlp.gate_proj", "ffn_gate")
            .replace("mlp.up_proj", "ffn_up")
            .replace("mlp.down_proj", "ffn_down")
            .replace("input_layernorm", "attn_norm")
            .replace("post_attention_layernorm", "ffn_norm")
    };
    let qt: Vec<(String, QTensor)> = hf
        .iter()
        .map(|(n, sh, d)| (rename(n), sh, d))
        .chain(extra.iter().map(|(n, sh, d)| (n.clone(), sh, d)))
        .map(|(n, sh, d)| {
            let t = tensor(sh, d);
            let dt = if sh.len() == 2 { dtype } else { GgmlDType::F32 };
            (n, QTensor::quantize(&t, dt).unwrap())
        })
        .collect();
    let hd = (s.hidden / s.heads) as u32;
    let md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (format!("{arch}.block_count"), Value::U32(s.layers as u32)),
        (
            format!("{arch}.context_length"),
            Value::U32(s.max_seq as u32),
        ),
        (
            format!("{arch}.embedding_length"),
            Value::U32(s.hidden as u32),
        ),
        (
            format!("{arch}.feed_forward_length"),
            Value::U32(s.intermediate as u32),
        ),
        (
            format!("{arch}.attention.head_count"),
            Value::U32(s.heads as u32),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            Value::U32(s.kv_heads as u32),
        ),
        (format!("{arch}.rope.dimension_count"), Value::U32(hd)),
        (format!("{arch}.rope.freq_base"), Value::F32(10000.0)),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        ),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(
                (0..s.vocab)
                    .map(|i| Value::String(format!("{prefix}{i}")))
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
    ];
    let mut md = md;
    for (k, v) in extra_md {
        md.retain(|(key, _)| *key != k);
        md.push((k, v));
    }
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qt.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
}

/// A fresh temporary directory under the target dir (removed on drop).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "specd-test-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
