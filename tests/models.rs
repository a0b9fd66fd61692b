//! The architectures users bring, each against an independent reference:
//! tiny random checkpoints written by the tests (safetensors in Hugging
//! Face layout and GGUF in llama.cpp's, holding the same weights) for
//! Llama 3 (llama3 rope scaling), Qwen3, Gemma 3 (sliding windows,
//! post-norms, GeGLU, softcapping) and Phi-3 (fused matrices, partial
//! rotary), compared position by position with candle-transformers'
//! implementations; the sliding window's exactness under batching,
//! rollback and trees; and the loader's errors.

use specd_test_kit as common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use common::{lcg_vec, max_abs_diff, TempDir};
use specd::model::{load_model, ForwardInput, KvCache, KvDtype, Logits, Model, TreeMask};

/// A tiny checkpoint of one architecture.
#[derive(Clone, Copy)]
struct Arch {
    name: &'static str,
    vocab: usize,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    max_seq: usize,
    /// Rotating dimensions of a head (Phi-3's partial rotary).
    rotary: usize,
    /// Sliding window of the local layers (Gemma 3).
    window: Option<usize>,
}

impl Arch {
    fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
    fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

const LLAMA3: Arch = Arch {
    name: "llama",
    vocab: 96,
    hidden: 64,
    intermediate: 128,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    head_dim: 16,
    max_seq: 256,
    rotary: 16,
    window: None,
};

/// head_dim 32 with 4 heads: q rows (128) wider than the hidden size (64).
const QWEN3: Arch = Arch {
    name: "qwen3",
    head_dim: 32,
    ..LLAMA3
};

/// Layers 0, 1 and 3 slide over 6 positions; layer 2 is global.
const GEMMA3: Arch = Arch {
    name: "gemma3",
    layers: 4,
    head_dim: 32,
    rotary: 32,
    window: Some(6),
    kv_heads: 1,
    ..LLAMA3
};

/// Half of each head rotates.
const PHI3: Arch = Arch {
    name: "phi3",
    rotary: 8,
    kv_heads: 4,
    ..LLAMA3
};

const SLIDING_PATTERN: usize = 3;
const SOFTCAP: f32 = 20.0;

/// Llama 3.1-style scaling over a 32-position original context, so that
/// the tiny model's frequencies fall in all three bands.
const ROPE_FACTOR: f32 = 8.0;
const LOW_FREQ: f32 = 1.0;
const HIGH_FREQ: f32 = 4.0;
const ORIGINAL_MAX: usize = 32;

type Named = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Random weights in Hugging Face names and layout (`[out, in]`).
fn hf_weights(a: &Arch, seed: u64) -> Named {
    let mut seed = seed;
    let mut w: Named = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n = shape.iter().product();
        let mut v = lcg_vec(&mut seed, n, scale);
        v.iter_mut().for_each(|x| *x += offset);
        w.push((name, shape, v));
    };
    // Gemma stores norm weights as offsets from 1.
    let one = if a.name == "gemma3" { 0.0 } else { 1.0 };
    let (h, qd, kvd, ff) = (a.hidden, a.q_dim(), a.kv_dim(), a.intermediate);
    push(
        "model.embed_tokens.weight".into(),
        vec![a.vocab, h],
        1.0,
        0.0,
    );
    for l in 0..a.layers {
        let p = format!("model.layers.{l}");
        if a.name == "phi3" {
            push(
                format!("{p}.self_attn.qkv_proj.weight"),
                vec![qd + 2 * kvd, h],
                0.2,
                0.0,
            );
            push(
                format!("{p}.mlp.gate_up_proj.weight"),
                vec![2 * ff, h],
                0.2,
                0.0,
            );
        } else {
            push(
                format!("{p}.self_attn.q_proj.weight"),
                vec![qd, h],
                0.2,
                0.0,
            );
            push(
                format!("{p}.self_attn.k_proj.weight"),
                vec![kvd, h],
                0.2,
                0.0,
            );
            push(
                format!("{p}.self_attn.v_proj.weight"),
                vec![kvd, h],
                0.2,
                0.0,
            );
            push(format!("{p}.mlp.gate_proj.weight"), vec![ff, h], 0.2, 0.0);
            push(format!("{p}.mlp.up_proj.weight"), vec![ff, h], 0.2, 0.0);
        }
        push(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, qd],
            0.2,
            0.0,
        );
        push(format!("{p}.mlp.down_proj.weight"), vec![h, ff], 0.2, 0.0);
        push(format!("{p}.input_layernorm.weight"), vec![h], 0.1, one);
        push(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            0.1,
            one,
        );
        if a.name == "gemma3" {
            push(
                format!("{p}.pre_feedforward_layernorm.weight"),
                vec![h],
                0.1,
                one,
            );
            push(
                format!("{p}.post_feedforward_layernorm.weight"),
                vec![h],
                0.1,
                one,
            );
        }
        if matches!(a.name, "qwen3" | "gemma3") {
            push(
                format!("{p}.self_attn.q_norm.weight"),
                vec![a.head_dim],
                0.1,
                one,
            );
            push(
                format!("{p}.self_attn.k_norm.weight"),
                vec![a.head_dim],
                0.1,
                one,
            );
        }
    }
    push("model.norm.weight".into(), vec![h], 0.1, one);
    if a.name != "gemma3" {
        push("lm_head.weight".into(), vec![a.vocab, h], 0.5, 0.0);
    }
    w
}

fn tensor(shape: &[usize], data: &[f32]) -> Tensor {
    Tensor::from_slice(data, shape, &Device::Cpu).unwrap()
}

/// The Hugging Face config.json of `a` (what our loader reads).
fn hf_config(a: &Arch) -> serde_json::Value {
    let mut c = serde_json::json!({
        "model_type": a.name,
        "vocab_size": a.vocab,
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": a.max_seq,
        "tie_word_embeddings": a.name == "gemma3",
        "attention_bias": false,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
    });
    let m = c.as_object_mut().unwrap();
    match a.name {
        "llama" => {
            m.insert(
                "rope_scaling".into(),
                serde_json::json!({
                    "factor": ROPE_FACTOR,
                    "low_freq_factor": LOW_FREQ,
                    "high_freq_factor": HIGH_FREQ,
                    "original_max_position_embeddings": ORIGINAL_MAX,
                    "rope_type": "llama3"
                }),
            );
        }
        "qwen3" => {
            m.insert("rope_theta".into(), serde_json::json!(1_000_000.0));
            m.insert("sliding_window".into(), serde_json::Value::Null);
            m.insert("max_window_layers".into(), serde_json::json!(a.layers));
            m.insert("use_sliding_window".into(), serde_json::json!(false));
        }
        "gemma3" => {
            m.insert("model_type".into(), serde_json::json!("gemma3_text"));
            m.insert("rope_theta".into(), serde_json::json!(1_000_000.0));
            m.insert("rope_local_base_freq".into(), serde_json::json!(10_000.0));
            m.insert(
                "hidden_activation".into(),
                serde_json::json!("gelu_pytorch_tanh"),
            );
            m.insert(
                "query_pre_attn_scalar".into(),
                serde_json::json!(a.head_dim),
            );
            m.insert("sliding_window".into(), serde_json::json!(a.window));
            m.insert(
                "sliding_window_pattern".into(),
                serde_json::json!(SLIDING_PATTERN),
            );
            m.insert("final_logit_softcapping".into(), serde_json::json!(SOFTCAP));
            m.insert("attn_logit_softcapping".into(), serde_json::Value::Null);
        }
        "phi3" => {
            m.insert(
                "partial_rotary_factor".into(),
                serde_json::json!(a.rotary as f64 / a.head_dim as f64),
            );
            m.insert("rope_scaling".into(), serde_json::Value::Null);
        }
        _ => {}
    }
    c
}

fn write_safetensors(dir: &Path, a: &Arch, w: &Named, config: &serde_json::Value) {
    std::fs::create_dir_all(dir).unwrap();
    let map: HashMap<String, Tensor> = w
        .iter()
        .map(|(n, sh, d)| (n.clone(), tensor(sh, d)))
        .collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let _ = a;
}

/// llama.cpp's converter permutation of Llama q/k rows (half-split pairs
/// to adjacent pairs), per head.
fn permute_rows(v: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = v.len() / cols;
    let hd = rows / heads;
    let mut out = vec![0f32; v.len()];
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..hd / 2 {
                let src = h * hd + j * hd / 2 + i;
                let dst = h * hd + 2 * i + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&v[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Llama 3.1's frequency divisors as llama.cpp's converter writes them
/// (`rope_freqs.weight`).
fn llama3_factors(a: &Arch) -> Vec<f32> {
    let old = ORIGINAL_MAX as f32;
    (0..a.rotary / 2)
        .map(|i| {
            let freq = 1.0 / 10000f32.powf((2 * i) as f32 / a.rotary as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < old / HIGH_FREQ {
                1.0
            } else if wavelen > old / LOW_FREQ {
                ROPE_FACTOR
            } else {
                let smooth = (old / wavelen - LOW_FREQ) / (HIGH_FREQ - LOW_FREQ);
                1.0 / ((1.0 - smooth) / ROPE_FACTOR + smooth)
            }
        })
        .collect()
}

/// The same weights as a GGUF file in llama.cpp's names and conventions.
fn write_gguf(path: &Path, a: &Arch, w: &Named, dtype: GgmlDType, extra_md: Vec<(String, Value)>) {
    let gemma = a.name == "gemma3";
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (n, sh, d) in w {
        let mut d = d.clone();
        if gemma && n.ends_with("norm.weight") {
            // llama.cpp's converter folds Gemma's (1 + w).
            d.iter_mut().for_each(|x| *x += 1.0);
        }
        if a.name == "llama" && n.ends_with("q_proj.weight") {
            d = permute_rows(&d, a.heads, sh[1]);
        }
        if a.name == "llama" && n.ends_with("k_proj.weight") {
            d = permute_rows(&d, a.kv_heads, sh[1]);
        }
        let ffn_norm = if gemma {
            "pre_feedforward_layernorm"
        } else {
            "post_attention_layernorm"
        };
        let mut g = n
            .replace("model.embed_tokens.weight", "token_embd.weight")
            .replace("model.norm.weight", "output_norm.weight")
            .replace("lm_head.weight", "output.weight")
            .replace("model.layers.", "blk.")
            .replace("self_attn.qkv_proj", "attn_qkv")
            .replace("self_attn.q_proj", "attn_q")
            .replace("self_attn.k_proj", "attn_k")
            .replace("self_attn.v_proj", "attn_v")
            .replace("self_attn.o_proj", "attn_output")
            .replace("self_attn.q_norm", "attn_q_norm")
            .replace("self_attn.k_norm", "attn_k_norm")
            .replace("mlp.gate_up_proj", "ffn_up")
            .replace("mlp.gate_proj", "ffn_gate")
            .replace("mlp.up_proj", "ffn_up")
            .replace("mlp.down_proj", "ffn_down")
            .replace("input_layernorm", "attn_norm")
            .replace(ffn_norm, "ffn_norm");
        if gemma {
            g = g
                .replace("post_attention_layernorm", "post_attention_norm")
                .replace("post_feedforward_layernorm", "post_ffw_norm");
        }
        tensors.push((g, sh.clone(), d));
    }
    if a.name == "llama" {
        let f = llama3_factors(a);
        tensors.push(("rope_freqs.weight".into(), vec![f.len()], f));
    }
    let qt: Vec<(String, QTensor)> = tensors
        .iter()
        .map(|(n, sh, d)| {
            let dt = if sh.len() == 2 { dtype } else { GgmlDType::F32 };
            (n.clone(), QTensor::quantize(&tensor(sh, d), dt).unwrap())
        })
        .collect();
    let arch = a.name;
    let u = |k: &str, v: usize| (format!("{arch}.{k}"), Value::U32(v as u32));
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        u("block_count", a.layers),
        u("context_length", a.max_seq),
        u("embedding_length", a.hidden),
        u("feed_forward_length", a.intermediate),
        u("attention.head_count", a.heads),
        u("attention.head_count_kv", a.kv_heads),
        u("rope.dimension_count", a.rotary),
        (
            format!("{arch}.rope.freq_base"),
            Value::F32(if matches!(arch, "qwen3" | "gemma3") {
                1_000_000.0
            } else {
                10_000.0
            }),
        ),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        ),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(
                (0..a.vocab)
                    .map(|i| Value::String(format!("t{i}")))
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
    ];
    if matches!(arch, "qwen3" | "gemma3") {
        md.push(u("attention.key_length", a.head_dim));
        md.push(u("attention.value_length", a.head_dim));
    }
    if gemma {
        md.push(u("attention.sliding_window", a.window.unwrap()));
        md.push(u("attention.sliding_window_pattern", SLIDING_PATTERN));
        md.push((
            format!("{arch}.final_logit_softcapping"),
            Value::F32(SOFTCAP),
        ));
    }
    for (k, v) in extra_md {
        md.retain(|(key, _)| *key != k);
        md.push((k, v));
    }
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qt.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
}

/// The test's token sequence (longer than Gemma's window).
fn tokens(a: &Arch, n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 37 + 11) % a.vocab) as u32).collect()
}

/// Our logits at every position of one forward (f32 KV, as the
/// references keep theirs).
fn ours_all(model: &mut Model, toks: &[u32]) -> Vec<Vec<f32>> {
    model.set_kv_dtype(KvDtype::F32);
    let mut cache = model.new_cache();
    let out = model.forward_one(&mut cache, toks, Logits::All).unwrap();
    (0..out.rows).map(|r| out.row(r).to_vec()).collect()
}

/// A reference's logits at every position: a fresh prefill of each prefix
/// (the references mask only multi-token forwards).
fn reference_all(toks: &[u32], mut last: impl FnMut(&[u32]) -> Vec<f32>) -> Vec<Vec<f32>> {
    (1..=toks.len()).map(|n| last(&toks[..n])).collect()
}

fn input(toks: &[u32]) -> Tensor {
    Tensor::new(toks, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
}

/// Last-position logits out of whatever shape a reference returns.
fn last_row(t: Tensor) -> Vec<f32> {
    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let vocab = *t.dims().last().unwrap();
    v[v.len() - vocab..].to_vec()
}

/// Top-1 agreement at every position and the largest logit difference
/// under `tol`.
fn assert_agree(what: &str, got: &[Vec<f32>], want: &[Vec<f32>], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: positions");
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
            .unwrap()
    };
    let mut worst = 0f32;
    for (p, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: vocabulary at position {p}");
        assert_eq!(
            argmax(g),
            argmax(w),
            "{what}: top-1 differs at position {p}"
        );
        worst = worst.max(max_abs_diff(g, w));
    }
    assert!(worst < tol, "{what}: max |dlogit| {worst} (bound {tol})");
}

fn varbuilder(dir: &Path) -> candle_nn::VarBuilder<'static> {
    let files = vec![dir.join("model.safetensors")];
    // SAFETY: test-only reference loader over a file this test just wrote
    // and does not change while mapped.
    unsafe { candle_nn::VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu) }
        .unwrap()
}

/// Writes `a` both ways; returns (dir, safetensors dir, gguf path).
fn write_both(a: &Arch, tag: &str) -> (TempDir, std::path::PathBuf, std::path::PathBuf) {
    let dir = TempDir::new(tag);
    let w = hf_weights(a, 7);
    let st = dir.0.join("st");
    write_safetensors(&st, a, &w, &hf_config(a));
    let gguf = dir.0.join("model.gguf");
    write_gguf(&gguf, a, &w, GgmlDType::F32, Vec::new());
    (dir, st, gguf)
}

/// Ours from safetensors and from GGUF against `reference`, and the two
/// loads against each other.
fn check_arch(
    a: &Arch,
    tag: &str,
    n: usize,
    reference: impl Fn(&Path, &Path, &[u32]) -> Vec<Vec<f32>>,
) {
    let (_dir, st, gguf) = write_both(a, tag);
    let toks = tokens(a, n);
    let from_st = ours_all(&mut load_model(&st, 2).unwrap(), &toks);
    let from_gguf = ours_all(&mut load_model(&gguf, 2).unwrap(), &toks);
    let want = reference(&st, &gguf, &toks);
    assert_agree(
        &format!("{tag} safetensors vs candle"),
        &from_st,
        &want,
        2e-3,
    );
    assert_agree(&format!("{tag} GGUF vs candle"), &from_gguf, &want, 2e-3);
    assert_agree(
        &format!("{tag} GGUF vs safetensors"),
        &from_gguf,
        &from_st,
        2e-3,
    );
}

#[test]
fn llama3_rope_scaling_matches_candle_llama() {
    // 40 positions: past the 32-position original context.
    check_arch(&LLAMA3, "llama3", 40, |st, _, toks| {
        let cfg: candle_transformers::models::llama::LlamaConfig =
            serde_json::from_str(&std::fs::read_to_string(st.join("config.json")).unwrap())
                .unwrap();
        let cfg = cfg.into_config(false);
        let model = candle_transformers::models::llama::Llama::load(varbuilder(st), &cfg).unwrap();
        reference_all(toks, |p| {
            let mut cache = candle_transformers::models::llama::Cache::new(
                true,
                DType::F32,
                &cfg,
                &Device::Cpu,
            )
            .unwrap();
            last_row(model.forward(&input(p), 0, &mut cache).unwrap())
        })
    });
}

/// Without its scaling the same checkpoint gives other logits: the test
/// above can fail.
#[test]
fn llama3_rope_scaling_changes_the_logits() {
    let a = LLAMA3;
    let dir = TempDir::new("llama3-off");
    let w = hf_weights(&a, 7);
    let mut cfg = hf_config(&a);
    write_safetensors(&dir.0.join("on"), &a, &w, &cfg);
    cfg.as_object_mut().unwrap().remove("rope_scaling");
    write_safetensors(&dir.0.join("off"), &a, &w, &cfg);
    let toks = tokens(&a, 40);
    let on = ours_all(&mut load_model(&dir.0.join("on"), 1).unwrap(), &toks);
    let off = ours_all(&mut load_model(&dir.0.join("off"), 1).unwrap(), &toks);
    let d = on
        .iter()
        .zip(&off)
        .map(|(x, y)| max_abs_diff(x, y))
        .fold(0f32, f32::max);
    assert!(d > 0.05, "scaling changed the logits by only {d}");
    // Transformers v5 writes theta and the scaling as `rope_parameters`:
    // the same model, the same logits (read as v4's fields).
    let v4 = hf_config(&a);
    let mut v5 = v4.clone();
    let o = v5.as_object_mut().unwrap();
    let mut rp = o.remove("rope_scaling").unwrap();
    rp["rope_theta"] = o.remove("rope_theta").unwrap();
    o.insert("rope_parameters".into(), rp);
    write_safetensors(&dir.0.join("v5"), &a, &w, &v5);
    let v5 = ours_all(&mut load_model(&dir.0.join("v5"), 1).unwrap(), &toks);
    assert_eq!(v5, on, "v5's rope_parameters read as v4's fields");
}

#[test]
fn linear_rope_scaling_gguf_and_safetensors_agree() {
    let a = Arch {
        name: "qwen3",
        ..QWEN3
    };
    let dir = TempDir::new("linear");
    let w = hf_weights(&a, 3);
    let mut cfg = hf_config(&a);
    cfg.as_object_mut().unwrap().insert(
        "rope_scaling".into(),
        serde_json::json!({"rope_type": "linear", "factor": 4.0}),
    );
    write_safetensors(&dir.0.join("st"), &a, &w, &cfg);
    let gguf = dir.0.join("m.gguf");
    write_gguf(
        &gguf,
        &a,
        &w,
        GgmlDType::F32,
        vec![
            (
                "qwen3.rope.scaling.type".into(),
                Value::String("linear".into()),
            ),
            ("qwen3.rope.scaling.factor".into(), Value::F32(4.0)),
        ],
    );
    let toks = tokens(&a, 24);
    let st = ours_all(&mut load_model(&dir.0.join("st"), 1).unwrap(), &toks);
    let gg = ours_all(&mut load_model(&gguf, 1).unwrap(), &toks);
    assert_agree("linear scaling GGUF vs safetensors", &gg, &st, 2e-3);
    // And the scaling is applied: unscaled logits differ.
    let plain = dir.0.join("plain.gguf");
    write_gguf(&plain, &a, &w, GgmlDType::F32, Vec::new());
    let pl = ours_all(&mut load_model(&plain, 1).unwrap(), &toks);
    let d = pl
        .iter()
        .zip(&gg)
        .map(|(x, y)| max_abs_diff(x, y))
        .fold(0f32, f32::max);
    assert!(d > 0.05, "linear scaling changed the logits by only {d}");
}

#[test]
fn qwen3_matches_candle_qwen3_and_quantized_qwen3() {
    check_arch(&QWEN3, "qwen3", 24, |st, gguf, toks| {
        let cfg: candle_transformers::models::qwen3::Config =
            serde_json::from_str(&std::fs::read_to_string(st.join("config.json")).unwrap())
                .unwrap();
        let mut m = candle_transformers::models::qwen3::ModelForCausalLM::new(&cfg, varbuilder(st))
            .unwrap();
        let want = reference_all(toks, |p| {
            m.clear_kv_cache();
            last_row(m.forward(&input(p), 0).unwrap())
        });
        // candle's GGUF Qwen3 on our GGUF file agrees with its safetensors one.
        let mut f = std::fs::File::open(gguf).unwrap();
        let ct = gguf_file::Content::read(&mut f).unwrap();
        let mut q = candle_transformers::models::quantized_qwen3::ModelWeights::from_gguf(
            ct,
            &mut f,
            &Device::Cpu,
        )
        .unwrap();
        let from_q = reference_all(toks, |p| {
            q.clear_kv_cache();
            last_row(q.forward(&input(p), 0).unwrap())
        });
        assert_agree("candle quantized_qwen3 vs qwen3", &from_q, &want, 1e-2);
        want
    });
}

#[test]
fn gemma3_matches_candle_gemma3() {
    // 20 positions over a 6-position window: the local layers forget.
    check_arch(&GEMMA3, "gemma3", 20, |st, _, toks| {
        let mut cfg = hf_config(&GEMMA3);
        // candle's mask lets a token see `sliding_window` earlier positions
        // (window + 1 in all); Hugging Face's and llama.cpp's, which specd
        // follows, `sliding_window - 1`.
        cfg["sliding_window"] = serde_json::json!(GEMMA3.window.unwrap() - 1);
        let cfg: candle_transformers::models::gemma3::Config = serde_json::from_value(cfg).unwrap();
        let mut m =
            candle_transformers::models::gemma3::Model::new(false, &cfg, varbuilder(st)).unwrap();
        reference_all(toks, |p| {
            m.clear_kv_cache();
            last_row(m.forward(&input(p), 0).unwrap())
        })
    });
}

/// The window matters: the same checkpoint with global attention in every
/// layer gives other logits past the window.
#[test]
fn gemma3_window_changes_logits_only_past_the_window() {
    let a = GEMMA3;
    let dir = TempDir::new("gemma3-global");
    let w = hf_weights(&a, 7);
    let cfg = hf_config(&a);
    write_safetensors(&dir.0.join("win"), &a, &w, &cfg);
    let mut global = cfg.clone();
    global["sliding_window"] = serde_json::json!(a.max_seq * 4);
    write_safetensors(&dir.0.join("global"), &a, &w, &global);
    let toks = tokens(&a, 16);
    let win = ours_all(&mut load_model(&dir.0.join("win"), 1).unwrap(), &toks);
    let glob = ours_all(&mut load_model(&dir.0.join("global"), 1).unwrap(), &toks);
    let window = a.window.unwrap();
    for p in 0..toks.len() {
        let d = max_abs_diff(&win[p], &glob[p]);
        if p < window {
            assert_eq!(d, 0.0, "position {p} is inside the window");
        } else {
            assert!(
                d > 1e-3,
                "position {p} is past the window but unchanged ({d})"
            );
        }
    }
}

fn candle_phi3(st: &Path, toks: &[u32]) -> Vec<Vec<f32>> {
    let cfg: candle_transformers::models::phi3::Config =
        serde_json::from_str(&std::fs::read_to_string(st.join("config.json")).unwrap()).unwrap();
    let mut m = candle_transformers::models::phi3::Model::new(&cfg, varbuilder(st)).unwrap();
    reference_all(toks, |p| {
        m.clear_kv_cache();
        last_row(m.forward(&input(p), 0).unwrap())
    })
}

/// Transformers v5 writes Gemma 3's rope per layer type (`rope_parameters`
/// with `full_attention`, scaled, and `sliding_attention`): the same
/// logits as v4's `rope_theta`, `rope_scaling` and `rope_local_base_freq`,
/// which differ from the unscaled ones (the test can fail); a scaled
/// sliding layer or an unknown layer type is refused by name.
#[test]
fn gemma3_rope_parameters_per_layer_type_read_as_v4s_fields() {
    let a = GEMMA3;
    let dir = TempDir::new("gemma3-v5");
    let w = hf_weights(&a, 7);
    let mut v4 = hf_config(&a);
    v4["rope_theta"] = serde_json::json!(50_000.0);
    v4["rope_local_base_freq"] = serde_json::json!(500.0);
    v4["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 8.0});
    let mut v5 = v4.clone();
    let o = v5.as_object_mut().unwrap();
    for k in ["rope_theta", "rope_local_base_freq", "rope_scaling"] {
        o.remove(k);
    }
    o.insert(
        "rope_parameters".into(),
        serde_json::json!({
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 50_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}
        }),
    );
    let mut unscaled = v4.clone();
    unscaled["rope_scaling"] = serde_json::Value::Null;
    let toks = tokens(&a, 16);
    let run = |tag: &str, cfg: &serde_json::Value| {
        write_safetensors(&dir.0.join(tag), &a, &w, cfg);
        ours_all(&mut load_model(&dir.0.join(tag), 1).unwrap(), &toks)
    };
    let (l4, l5, off) = (run("v4", &v4), run("v5", &v5), run("off", &unscaled));
    assert!(
        l5 == l4,
        "v5's per-layer rope_parameters read as v4's fields"
    );
    let d = l4
        .iter()
        .zip(&off)
        .map(|(x, y)| max_abs_diff(x, y))
        .fold(0f32, f32::max);
    assert!(d > 1e-3, "the scaling changed the logits by only {d}");
    for (edit, want) in [
        (
            (
                "sliding_attention",
                serde_json::json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
            ),
            "sliding_attention: scaling 'linear'",
        ),
        (
            (
                "chunked_attention",
                serde_json::json!({"rope_theta": 500.0}),
            ),
            "rope_parameters.chunked_attention",
        ),
    ] {
        let mut bad = v5.clone();
        bad["rope_parameters"][edit.0] = edit.1;
        write_safetensors(&dir.0.join("bad"), &a, &w, &bad);
        let err = load_model(&dir.0.join("bad"), 1).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
}

/// Partial rotary (half of each head): candle's Phi-3 decoder.
#[test]
fn phi3_partial_rotary_matches_candle_phi3() {
    check_arch(&PHI3, "phi3", 24, |st, _, toks| candle_phi3(st, toks));
}

/// Full rotary: candle's Phi-3 decoder, and its GGUF Phi-3 (which has no
/// partial rotary) on our GGUF file.
#[test]
fn phi3_matches_candle_phi3_and_quantized_phi3() {
    let full = Arch {
        rotary: PHI3.head_dim,
        ..PHI3
    };
    check_arch(&full, "phi3-full", 24, |st, gguf, toks| {
        let want = candle_phi3(st, toks);
        let from_q = reference_all(toks, |p| {
            let mut f = std::fs::File::open(gguf).unwrap();
            let ct = gguf_file::Content::read(&mut f).unwrap();
            let mut q = candle_transformers::models::quantized_phi3::ModelWeights::from_gguf(
                false,
                ct,
                &mut f,
                &Device::Cpu,
            )
            .unwrap();
            last_row(q.forward(&input(p), 0).unwrap())
        });
        assert_agree("candle quantized_phi3 vs phi3", &from_q, &want, 1e-2);
        want
    });
}

/// Quantized GGUF files of the new architectures run on the integer
/// kernels and stay near their F32 twins.
#[test]
fn quantized_files_of_every_architecture_stay_near_f32() {
    for a in [LLAMA3, QWEN3, GEMMA3, PHI3] {
        let dir = TempDir::new(&format!("q-{}", a.name));
        let w = hf_weights(&a, 11);
        let toks = tokens(&a, 20);
        let f32p = dir.0.join("f32.gguf");
        write_gguf(&f32p, &a, &w, GgmlDType::F32, Vec::new());
        let want = ours_all(&mut load_model(&f32p, 1).unwrap(), &toks);
        let q8 = dir.0.join("q8.gguf");
        write_gguf(&q8, &a, &w, GgmlDType::Q8_0, Vec::new());
        let got = ours_all(&mut load_model(&q8, 1).unwrap(), &toks);
        let d = got
            .iter()
            .zip(&want)
            .map(|(x, y)| max_abs_diff(x, y))
            .fold(0f32, f32::max);
        assert!(d < 0.3, "{}: Q8_0 vs F32 max |dlogit| {d}", a.name);
    }
}

// ---------------------------------------------------------------- exactness

/// A Gemma-style model whose windows span several attention ranges
/// (128 slots each): 300 positions, a 40-position window.
const GEMMA3_LONG: Arch = Arch {
    window: Some(40),
    max_seq: 512,
    ..GEMMA3
};

fn long_gemma(tag: &str) -> (TempDir, Model) {
    let dir = TempDir::new(tag);
    let w = hf_weights(&GEMMA3_LONG, 5);
    let p = dir.0.join("m.gguf");
    write_gguf(&p, &GEMMA3_LONG, &w, GgmlDType::Q8_0, Vec::new());
    let m = load_model(&p, 2).unwrap();
    (dir, m)
}

/// Decoding token by token, prefilling in chunks, and batching with
/// another sequence give a windowed model's logits bit for bit.
#[test]
fn sliding_window_logits_do_not_depend_on_batch_or_chunking() {
    let (_d, m) = long_gemma("win-batch");
    let toks = tokens(&GEMMA3_LONG, 300);
    let mut c = m.new_cache();
    let all = m.forward_one(&mut c, &toks, Logits::All).unwrap();
    // Chunks of 7, with another sequence in the same forward.
    let mut c1 = m.new_cache();
    let mut c2 = m.new_cache();
    let other = tokens(&GEMMA3_LONG, 301);
    let mut got: Vec<Vec<f32>> = Vec::new();
    for (i, chunk) in toks.chunks(7).enumerate() {
        let o = &other[i * 3..i * 3 + 3];
        let out = m
            .forward(
                &mut [
                    ForwardInput {
                        cache: &mut c2,
                        tokens: o,
                        logits: Logits::Last,
                        tree: None,
                    },
                    ForwardInput {
                        cache: &mut c1,
                        tokens: chunk,
                        logits: Logits::All,
                        tree: None,
                    },
                ],
                &[],
            )
            .unwrap();
        got.extend((0..out[1].rows).map(|r| out[1].row(r).to_vec()));
    }
    for (p, g) in got.iter().enumerate() {
        assert_eq!(g.as_slice(), all.row(p), "position {p}");
    }
    // Chunks of 24 (two attention tasks of 12 tokens, one per slot range)
    // and of 40 (tasks of 14, 14 and 12 tokens walking their ranges).
    for size in [24, 40] {
        let mut c4 = m.new_cache();
        let mut p = 0;
        for chunk in toks.chunks(size) {
            let out = m.forward_one(&mut c4, chunk, Logits::All).unwrap();
            for r in 0..out.rows {
                assert_eq!(out.row(r), all.row(p), "chunks of {size}, position {p}");
                p += 1;
            }
        }
    }
    // One at a time from position 250.
    let mut c3 = m.new_cache();
    m.forward_one(&mut c3, &toks[..250], Logits::None).unwrap();
    for (p, &t) in toks.iter().enumerate().skip(250) {
        let o = m.forward_one(&mut c3, &[t], Logits::Last).unwrap();
        assert_eq!(o.row(0), all.row(p), "decode at {p}");
    }
}

/// Rolling back past a window's edge and decoding again gives what a
/// fresh cache gives; a tree's branches equal their chains.
#[test]
fn sliding_window_rollback_and_trees_are_exact() {
    let (_d, m) = long_gemma("win-tree");
    let toks = tokens(&GEMMA3_LONG, 260);
    let mut c = m.new_cache();
    m.forward_one(&mut c, &toks[..250], Logits::None).unwrap();
    m.forward_one(&mut c, &[1, 2, 3, 4, 5], Logits::All)
        .unwrap();
    c.truncate(250).unwrap();
    let after = m.forward_one(&mut c, &toks[250..], Logits::All).unwrap();
    let mut fresh = m.new_cache();
    let want = m.forward_one(&mut fresh, &toks, Logits::All).unwrap();
    for r in 0..after.rows {
        assert_eq!(after.row(r), want.row(250 + r), "row {r} after rollback");
    }
    // A tree of two branches, [a, b] and [c, d], after 250 tokens.
    let mut ct = m.new_cache();
    m.forward_one(&mut ct, &toks[..250], Logits::None).unwrap();
    tree_equals_its_chains(&m, &mut ct, &toks[..250], &[None, Some(0), None, Some(2)]);
}

/// A tree over `cache` (which holds `context`) of nodes 7, 8, ... with
/// `parents`: every node's logits equal those of its path fed as a chain
/// after `context` on a fresh cache.
fn tree_equals_its_chains(
    m: &Model,
    cache: &mut KvCache,
    context: &[u32],
    parents: &[Option<usize>],
) {
    let tree = TreeMask {
        parents: parents.to_vec(),
    };
    let nodes: Vec<u32> = (7..7 + parents.len() as u32).collect();
    let out = m
        .forward(
            &mut [ForwardInput {
                cache,
                tokens: &nodes,
                logits: Logits::All,
                tree: Some(&tree),
            }],
            &[],
        )
        .unwrap()
        .remove(0);
    for r in 0..nodes.len() {
        let mut path = vec![r];
        while let Some(p) = parents[*path.last().unwrap()] {
            path.push(p);
        }
        path.reverse();
        let branch: Vec<u32> = path.iter().map(|&i| nodes[i]).collect();
        let mut cc = m.new_cache();
        m.forward_one(&mut cc, context, Logits::None).unwrap();
        let chain = m.forward_one(&mut cc, &branch, Logits::All).unwrap();
        assert_eq!(
            out.row(r),
            chain.row(path.len() - 1),
            "tree node {r} vs its chain"
        );
    }
}

/// A windowed cache gives back its sliding layers' parts of the blocks no
/// later query reads, and nothing changes: chunked prefill and decoding
/// with releases before every forward give the logits of a cache that
/// keeps everything, bit for bit, as do a rollback and a tree after a
/// release; a rollback into released entries is refused, and a released
/// block is never shared.
#[test]
fn sliding_window_entries_outside_the_window_are_released_exactly() {
    let (_d, m) = long_gemma("win-release");
    let toks = tokens(&GEMMA3_LONG, 300);
    let mut keep = m.new_cache();
    let all = m.forward_one(&mut keep, &toks, Logits::All).unwrap();
    let mut c = m.new_cache();
    let mut released = 0;
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let mut at = 0;
    // Chunks of 29, then tokens one at a time.
    while at < toks.len() {
        let n = if at < 250 { 29.min(250 - at) } else { 1 };
        released += c.release_window(c.len());
        let out = m
            .forward_one(&mut c, &toks[at..at + n], Logits::All)
            .unwrap();
        rows.extend((0..out.rows).map(|r| out.row(r).to_vec()));
        at += n;
    }
    for (p, r) in rows.iter().enumerate() {
        assert_eq!(r.as_slice(), all.row(p), "position {p}");
    }
    released += c.release_window(c.len());
    // 300 positions, a 40-position window read in ranges of 128 slots:
    // blocks 0-3 (256 positions) go; the global layer keeps them all.
    let layout = c.layout();
    assert_eq!(layout.local_layers(), 3);
    assert_eq!(released, 4);
    assert_eq!((c.num_blocks(), c.num_local_blocks()), (5, 1));
    assert!(c.num_local_blocks() <= layout.local_blocks_held());
    assert_eq!(
        c.bytes() * 20,
        keep.bytes() * 8,
        "5 blocks of the global layer and 1 of the 3 sliding ones: 8 of 20 layer-blocks"
    );
    assert!(c.share_block(0).is_none(), "a released block is not shared");
    assert!(c.share_block(4).is_none(), "block 4 is not full");
    // Rollback within what the window kept, then a tree: exact. A query at
    // 290 reads from block 2 on (released): refused.
    c.truncate(297).unwrap();
    let err = c.truncate(290).unwrap_err();
    assert!(err.to_string().contains("sliding-window"), "{err}");
    assert_eq!(c.len(), 297);
    tree_equals_its_chains(&m, &mut c, &toks[..297], &[None, Some(0), None]);
}

/// Through the engine a windowed model's sequences give their sliding
/// layers' blocks back as they grow, and no output changes: greedy plain
/// decoding, ngram and suffix speculation (chains and trees), a request
/// taking another's blocks from the prefix cache, and forked choices, one
/// of which waits for a slot until its parent has decoded past the
/// window's next range (the parent keeps its window where the choice
/// copies it) all give plain decoding's tokens.
#[test]
fn sliding_window_kv_is_released_through_the_engine_without_changing_outputs() {
    use specd::config::Config;
    use specd::plain::generate;
    use specd::speculative::driver::{EngineConfig, SyncDriver};
    use specd::speculative::Request;
    use std::sync::Arc;

    let (_d, m) = long_gemma("win-engine");
    let m = Arc::new(m);
    let prompt = tokens(&GEMMA3_LONG, 200);
    let req = |proposer: &str, n: usize| Request {
        proposer: Some(proposer.into()),
        ignore_eos: true,
        ..Request::greedy(prompt.clone(), n)
    };
    let want = generate(&m, None, &req("none", 250), |_| {})
        .unwrap()
        .tokens;
    for proposer in ["none", "ngram", "suffix", "suffix-tree"] {
        let engine = |running: usize| {
            let drafter = Config::builtin().build_drafter(&m, None).unwrap();
            let mut ec = EngineConfig::for_model(&m);
            ec.scheduler.max_running = running;
            SyncDriver::new(m.clone(), None, ec, drafter)
        };
        // Alone, then again (its prompt's blocks from the cache).
        let mut e = engine(4);
        for round in 0..2 {
            e.add(req(proposer, 100), None).unwrap();
            let done = e.run_to_completion().unwrap();
            assert_eq!(done[0].tokens, want[..100], "{proposer}, round {round}");
        }
        let (_, hit) = e.verifier.prefix_stats();
        assert!(
            hit >= 192,
            "{proposer}: the prompt's blocks came from the cache ({hit})"
        );
        let released = e.verifier.window_released_blocks();
        assert!(released >= 4, "{proposer}: {released} blocks released");
        // Two slots: the parent (250 tokens) and its first choice (120)
        // run; the second choice (60) starts when the first ends, the
        // parent then past position 295, where its window's range moves on.
        let mut e = engine(2);
        let parent = e.add(req(proposer, 250), None).unwrap();
        for n in [120, 60] {
            let r = Request {
                fork_of: Some(parent),
                ..req(proposer, n)
            };
            e.add(r, None).unwrap();
        }
        let mut done = e.run_to_completion().unwrap();
        done.sort_by_key(|c| c.id);
        let lens: Vec<usize> = done.iter().map(|c| c.tokens.len()).collect();
        assert_eq!(lens, [250, 120, 60], "{proposer}");
        for c in &done {
            assert_eq!(
                c.tokens,
                want[..c.tokens.len()],
                "{proposer}: choice {}",
                c.id
            );
        }
        assert!(e.verifier.window_released_blocks() >= 4, "{proposer}");
        // A choice added once its parent has decoded past its window's
        // range prefills on its own (the parent's window at the prompt's
        // end is gone), and gives the same tokens.
        let mut e = engine(4);
        let parent = e.add(req(proposer, 250), None).unwrap();
        let mut steps = 0;
        while e.verifier.cache_len(parent).is_none_or(|l| l < 320) && steps < 1000 {
            e.step().unwrap();
            steps += 1;
        }
        let late = e
            .add(
                Request {
                    fork_of: Some(parent),
                    ..req(proposer, 40)
                },
                None,
            )
            .unwrap();
        let done = e.run_to_completion().unwrap();
        let got = |id| done.iter().find(|c| c.id == id).map(|c| c.tokens.clone());
        assert_eq!(
            got(parent).as_deref(),
            Some(&want[..]),
            "{proposer}: late parent"
        );
        assert_eq!(
            got(late).as_deref(),
            Some(&want[..40]),
            "{proposer}: late choice"
        );
    }
}

// ---------------------------------------------------------------- errors

#[test]
fn loader_errors_name_the_file_the_tensor_and_the_shape() {
    let dir = TempDir::new("models-errors");
    let w = hf_weights(&QWEN3, 1);
    // A missing q-norm tensor.
    let p = dir.0.join("no-qnorm.gguf");
    let without: Named = w
        .iter()
        .filter(|(n, _, _)| n != "model.layers.1.self_attn.q_norm.weight")
        .cloned()
        .collect();
    write_gguf(&p, &QWEN3, &without, GgmlDType::F32, Vec::new());
    let err = load_model(&p, 1).unwrap_err().to_string();
    assert!(
        err.contains("no-qnorm.gguf") && err.contains("blk.1.attn_q_norm.weight"),
        "{err}"
    );
    // A wrong shape: k_norm of the wrong width.
    let p = dir.0.join("bad-shape.gguf");
    let mut bad = w.clone();
    for (n, sh, d) in bad.iter_mut() {
        if n == "model.layers.0.self_attn.k_norm.weight" {
            *sh = vec![8];
            d.truncate(8);
        }
    }
    write_gguf(&p, &QWEN3, &bad, GgmlDType::F32, Vec::new());
    let err = load_model(&p, 1).unwrap_err().to_string();
    assert!(
        err.contains("bad-shape.gguf")
            && err.contains("blk.0.attn_k_norm.weight")
            && err.contains("expected 32"),
        "{err}"
    );
    // Safetensors: a q_proj of the wrong shape names the HF tensor.
    let st = dir.0.join("st");
    let mut bad = w.clone();
    for (n, sh, d) in bad.iter_mut() {
        if n == "model.layers.1.self_attn.q_proj.weight" {
            *sh = vec![64, 64];
            d.truncate(64 * 64);
        }
    }
    write_safetensors(&st, &QWEN3, &bad, &hf_config(&QWEN3));
    let err = load_model(&st, 1).unwrap_err().to_string();
    assert!(
        err.contains("model.layers.1.self_attn.q_proj.weight") && err.contains("expected 128x64"),
        "{err}"
    );
}

#[test]
fn unsupported_architectures_and_options_are_refused_by_name() {
    let dir = TempDir::new("models-refuse");
    let w = hf_weights(&LLAMA3, 1);
    // An architecture specd does not run: named, with the list.
    let p = dir.0.join("falcon.gguf");
    let a = Arch {
        name: "falcon",
        ..LLAMA3
    };
    write_gguf(&p, &a, &w, GgmlDType::F32, Vec::new());
    let err = load_model(&p, 1).unwrap_err().to_string();
    for want in [
        "falcon.gguf",
        "'falcon'",
        "llama",
        "qwen3",
        "gemma3",
        "phi3",
    ] {
        assert!(err.contains(want), "{err} lacks {want}");
    }
    // Mixture of experts under a supported name.
    let p = dir.0.join("moe.gguf");
    write_gguf(
        &p,
        &LLAMA3,
        &w,
        GgmlDType::F32,
        vec![("llama.expert_count".into(), Value::U32(8))],
    );
    let err = load_model(&p, 1).unwrap_err().to_string();
    assert!(err.contains("llama.expert_count"), "{err}");
    // A tensor type candle does not read (20: an IQ quant) in a file past
    // the first 8 MiB read: refused by name at once, not after reading
    // the whole file in search of a header end.
    let p = dir.0.join("iq.gguf");
    let mut f = b"GGUF".to_vec();
    f.extend(3u32.to_le_bytes());
    f.extend(1u64.to_le_bytes()); // tensors
    f.extend(0u64.to_le_bytes()); // metadata
    f.extend(4u64.to_le_bytes());
    f.extend(b"t.w0");
    f.extend(1u32.to_le_bytes());
    f.extend(256u64.to_le_bytes());
    f.extend(20u32.to_le_bytes());
    f.extend(0u64.to_le_bytes());
    f.resize(9 << 20, 0);
    std::fs::write(&p, &f).unwrap();
    let err = load_model(&p, 1).unwrap_err().to_string();
    assert!(
        err.contains("iq.gguf") && err.contains("tensor type this build does not support"),
        "{err}"
    );
    // Tensor dimensions whose sizes overflow (the element count past
    // usize; the byte count past it): refused by name, not wrapped to a
    // small read.
    for (dims, tag) in [([1u64 << 40, 1 << 40], "count"), ([1 << 62, 2], "bytes")] {
        let p = dir.0.join(format!("huge-{tag}.gguf"));
        write_gguf(&p, &LLAMA3, &w, GgmlDType::F32, Vec::new());
        let mut f = std::fs::read(&p).unwrap();
        let name = b"token_embd.weight";
        let at = f.windows(name.len()).position(|x| x == name).unwrap() + name.len();
        assert_eq!(u32::from_le_bytes(f[at..at + 4].try_into().unwrap()), 2);
        for (i, d) in dims.iter().enumerate() {
            let o = at + 4 + 8 * i;
            f[o..o + 8].copy_from_slice(&d.to_le_bytes());
        }
        std::fs::write(&p, &f).unwrap();
        let err = load_model(&p, 1).unwrap_err().to_string();
        assert!(
            err.contains("token_embd.weight") && err.contains("too large"),
            "{tag}: {err}"
        );
    }
    // A quantized safetensors checkpoint (its scales would be ignored),
    // a config without heads, a context of none: refused, not computed.
    for (tag, edit, want) in [
        (
            "fp8",
            (
                "quantization_config",
                serde_json::json!({"quant_method": "fp8"}),
            ),
            "quantization_config (fp8)",
        ),
        (
            "no-heads",
            ("num_attention_heads", serde_json::json!(0)),
            "inconsistent heads",
        ),
        (
            "no-context",
            ("max_position_embeddings", serde_json::json!(0)),
            "context length 0",
        ),
    ] {
        let mut cfg = hf_config(&LLAMA3);
        cfg[edit.0] = edit.1;
        let d = dir.0.join(tag);
        write_safetensors(&d, &LLAMA3, &w, &cfg);
        let err = load_model(&d, 1).unwrap_err().to_string();
        assert!(err.contains(want), "{tag}: {err}");
    }
    // An unknown rope scaling type, in either format.
    let p = dir.0.join("longrope.gguf");
    let nofreqs: Named = w.clone();
    write_gguf(
        &p,
        &Arch {
            name: "qwen3",
            ..QWEN3
        },
        &hf_weights(&QWEN3, 1),
        GgmlDType::F32,
        vec![(
            "qwen3.rope.scaling.type".into(),
            Value::String("longrope".into()),
        )],
    );
    let err = load_model(&p, 1).unwrap_err().to_string();
    assert!(
        err.contains("qwen3.rope.scaling.type") && err.contains("longrope"),
        "{err}"
    );
    let st = dir.0.join("st");
    let mut cfg = hf_config(&LLAMA3);
    cfg["rope_scaling"] = serde_json::json!({"rope_type": "dynamic", "factor": 2.0});
    write_safetensors(&st, &LLAMA3, &nofreqs, &cfg);
    let err = load_model(&st, 1).unwrap_err().to_string();
    assert!(
        err.contains("rope_scaling") && err.contains("dynamic"),
        "{err}"
    );
    // A pre-tokenizer specd does not implement (its splits would differ).
    let p = dir.0.join("tekken.gguf");
    write_gguf(
        &p,
        &LLAMA3,
        &w,
        GgmlDType::F32,
        vec![("tokenizer.ggml.pre".into(), Value::String("tekken".into()))],
    );
    let err = specd::tokenizer::Tokenizer::for_model(&p)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokenizer.ggml.pre") && err.contains("tekken"),
        "{err}"
    );
    // An unknown Hugging Face model type.
    let mut cfg = hf_config(&LLAMA3);
    cfg["model_type"] = serde_json::json!("mamba");
    write_safetensors(&st, &LLAMA3, &nofreqs, &cfg);
    let err = load_model(&st, 1).unwrap_err().to_string();
    assert!(err.contains("'mamba'") && err.contains("gemma3"), "{err}");
}

// ---------------------------------------------------------------- templates

/// A template in the style of Qwen3's: a namespace updated in a reversed
/// loop, Python string methods (`startswith`, `endswith`, `split`,
/// `lstrip`, `rstrip`, `strip`), `tojson`, `is string`, `is defined`.
const QWEN3_STYLE: &str = r#"{%- set ns = namespace(last_user=messages|length - 1) %}
{%- for m in messages[::-1] %}{%- set i = (messages|length - 1) - loop.index0 %}
{%- if m.role == "user" and m.content is string and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) and ns.last_user == messages|length - 1 %}{%- set ns.last_user = i %}{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- if m.role == "assistant" and '</think>' in m.content %}
{%- set reasoning = m.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + m.content.split('</think>')[-1].lstrip('\n') + '<|im_end|>\n' }}
{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}
{%- endfor %}
{%- if tools is defined and tools %}{{- tools[0] | tojson }}{%- endif %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"#;

/// A template in the style of Gemma 3's: `bos_token`, a system turn
/// folded into the first user turn, roles that must alternate
/// (`raise_exception`), `assistant` renamed `model`, `trim`.
const GEMMA3_STYLE: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}{%- set first = messages[0]['content'] + '\n\n' -%}{%- set rest = messages[1:] -%}
{%- else -%}{%- set first = "" -%}{%- set rest = messages -%}{%- endif -%}
{%- for message in rest -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}{%- endif -%}
{%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\n' + (first if loop.first else "") }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"#;

#[test]
fn chat_templates_in_the_styles_of_qwen3_and_gemma3_render() {
    use specd::tokenizer::{ChatMessage, Tokenizer};
    let dir = TempDir::new("templates");
    let p = dir.0.join("t.gguf");
    write_gguf(
        &p,
        &QWEN3,
        &hf_weights(&QWEN3, 1),
        GgmlDType::F32,
        Vec::new(),
    );
    let base = Tokenizer::for_model(&p).unwrap();
    let msg = |role: &str, content: &str| ChatMessage::new(role, content);
    let qwen = base.clone().with_chat_template(QWEN3_STYLE);
    let out = qwen
        .apply_chat_template(
            &[
                msg("user", "Hi"),
                msg("assistant", "<think>\nhmm\n</think>\n\nHello!"),
                msg("user", "Bye"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
    let gemma = base.with_chat_template(GEMMA3_STYLE);
    let out = gemma
        .apply_chat_template(
            &[
                msg("system", "Be brief."),
                msg("user", " Hi "),
                msg("assistant", "Hello"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(
        out,
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>model\n"
    );
    // Roles that do not alternate: the template's own error, as the
    // request's fault.
    let err = gemma
        .apply_chat_template(&[msg("user", "a"), msg("user", "b")], true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("roles must alternate"), "{err}");
}

// ---------------------------------------------------------------- yarn

/// Hugging Face's `_compute_yarn_parameters`, transcribed in f64: the
/// inverse frequencies and the attention factor.
fn hf_yarn(dim: usize, base: f64, factor: f64, orig: f64) -> (Vec<f64>, f64) {
    let corr = |rot: f64| {
        dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let low = corr(32.0).floor().max(0.0);
    let mut high = corr(1.0).ceil().min(dim as f64 - 1.0);
    if high == low {
        high += 0.001;
    }
    let inv: Vec<f64> = (0..dim / 2)
        .map(|i| {
            let pos_freq = base.powf((2 * i) as f64 / dim as f64);
            let (extra, inter) = (1.0 / pos_freq, 1.0 / (factor * pos_freq));
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation = 1.0 - ramp;
            inter * (1.0 - extrapolation) + extra * extrapolation
        })
        .collect();
    (inv, 0.1 * factor.ln() + 1.0)
}

/// YaRN from either format: the rotary tables are Hugging Face's, the two
/// formats agree, and the scaling changes the logits.
#[test]
fn yarn_rope_scaling_follows_hugging_face_in_both_formats() {
    let a = Arch {
        head_dim: 64,
        rotary: 64,
        max_seq: 512,
        ..QWEN3
    };
    let dir = TempDir::new("yarn");
    let w = hf_weights(&a, 4);
    let mut cfg = hf_config(&a);
    cfg["rope_scaling"] = serde_json::json!({
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128
    });
    write_safetensors(&dir.0.join("st"), &a, &w, &cfg);
    let gguf = dir.0.join("m.gguf");
    write_gguf(
        &gguf,
        &a,
        &w,
        GgmlDType::F32,
        vec![
            (
                "qwen3.rope.scaling.type".into(),
                Value::String("yarn".into()),
            ),
            ("qwen3.rope.scaling.factor".into(), Value::F32(4.0)),
            (
                "qwen3.rope.scaling.original_context_length".into(),
                Value::U32(128),
            ),
        ],
    );
    let mut st = load_model(&dir.0.join("st"), 1).unwrap();
    let mut gg = load_model(&gguf, 1).unwrap();
    let (inv, attn) = hf_yarn(a.rotary, 1_000_000.0, 4.0, 128.0);
    for m in [&st, &gg] {
        for pos in [0usize, 1, 37, 300, 511] {
            let (cos, sin) = m.rope_at(0, pos);
            for (i, f) in inv.iter().enumerate() {
                let ang = pos as f64 * f;
                assert!(
                    (cos[i] as f64 - ang.cos() * attn).abs() < 1e-3,
                    "cos at {pos}, {i}"
                );
                assert!(
                    (sin[i] as f64 - ang.sin() * attn).abs() < 1e-3,
                    "sin at {pos}, {i}"
                );
            }
        }
    }
    // The ramp (pairs 0 to 7 here) reaches both ends: the fastest
    // frequency kept, the slowest divided by the factor.
    assert!((inv[0] - 1.0).abs() < 1e-12);
    assert!((inv[31] * 4.0 - 1.0 / 1_000_000f64.powf(62.0 / 64.0)).abs() < 1e-12);
    let toks = tokens(&a, 24);
    let s = ours_all(&mut st, &toks);
    let g = ours_all(&mut gg, &toks);
    assert_agree("yarn GGUF vs safetensors", &g, &s, 2e-3);
    let none = dir.0.join("none.gguf");
    write_gguf(&none, &a, &w, GgmlDType::F32, Vec::new());
    let n = ours_all(&mut load_model(&none, 1).unwrap(), &toks);
    let d = n
        .iter()
        .zip(&g)
        .map(|(x, y)| max_abs_diff(x, y))
        .fold(0f32, f32::max);
    assert!(d > 0.05, "yarn changed the logits by only {d}");
}

/// LongRoPE (Phi-3.5 / Phi-4-mini) from either format: the short factors
/// and Hugging Face's attention factor in every table, the context capped
/// at the original length, and the two formats agree.
#[test]
fn longrope_follows_hugging_face_up_to_the_original_context() {
    let a = PHI3; // 8 of 16 dimensions rotate: 4 frequencies
    let short = [1.0f32, 1.3, 2.1, 3.7];
    let long = [1.0f32, 2.0, 4.0, 8.0];
    let orig = 64usize;
    let dir = TempDir::new("longrope");
    let mut w = hf_weights(&a, 6);
    let mut cfg = hf_config(&a);
    cfg["original_max_position_embeddings"] = serde_json::json!(orig);
    cfg["rope_scaling"] = serde_json::json!({
        "type": "longrope", "short_factor": short, "long_factor": long
    });
    write_safetensors(&dir.0.join("st"), &a, &w, &cfg);
    w.push(("rope_factors_short.weight".into(), vec![4], short.to_vec()));
    w.push(("rope_factors_long.weight".into(), vec![4], long.to_vec()));
    let gguf = dir.0.join("m.gguf");
    write_gguf(
        &gguf,
        &a,
        &w,
        GgmlDType::F32,
        vec![(
            "phi3.rope.scaling.original_context_length".into(),
            Value::U32(orig as u32),
        )],
    );
    let mut st = load_model(&dir.0.join("st"), 1).unwrap();
    let mut gg = load_model(&gguf, 1).unwrap();
    let scale = (a.max_seq as f64 / orig as f64).ln() / (orig as f64).ln();
    let attn = (1.0 + scale).sqrt();
    for m in [&st, &gg] {
        assert_eq!(
            m.config.max_seq_len, orig,
            "the context stops at the original length"
        );
        for pos in [0usize, 5, 63] {
            let (cos, sin) = m.rope_at(1, pos);
            for (i, f) in short.iter().enumerate() {
                let inv = 1.0 / (*f as f64 * 10_000f64.powf((2 * i) as f64 / 8.0));
                let ang = pos as f64 * inv;
                assert!(
                    (cos[i] as f64 - ang.cos() * attn).abs() < 1e-4,
                    "cos {pos} {i}"
                );
                assert!(
                    (sin[i] as f64 - ang.sin() * attn).abs() < 1e-4,
                    "sin {pos} {i}"
                );
            }
        }
    }
    let toks = tokens(&a, 24);
    let s = ours_all(&mut st, &toks);
    let g = ours_all(&mut gg, &toks);
    assert_agree("longrope GGUF vs safetensors", &g, &s, 2e-3);
}

/// A multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`:
/// the text config nested, the language model under `language_model.` or
/// `model.language_model.`, a vision tower beside it) loads its language
/// model, equal to the text-only checkpoint.
#[test]
fn multimodal_gemma3_checkpoints_load_their_language_model() {
    let a = GEMMA3;
    let dir = TempDir::new("gemma3-mm");
    let w = hf_weights(&a, 7);
    let text = hf_config(&a);
    write_safetensors(&dir.0.join("text"), &a, &w, &text);
    let toks = tokens(&a, 12);
    let want = ours_all(&mut load_model(&dir.0.join("text"), 1).unwrap(), &toks);
    for (tag, prefix) in [
        ("old", "language_model.model."),
        ("new", "model.language_model."),
    ] {
        let mut mm: Named = w
            .iter()
            .map(|(n, sh, d)| (n.replacen("model.", prefix, 1), sh.clone(), d.clone()))
            .collect();
        mm.push((
            "vision_tower.patch_embed.weight".into(),
            vec![4, 4],
            vec![0.5; 16],
        ));
        mm.push((
            "multi_modal_projector.w.weight".into(),
            vec![2, 2],
            vec![0.1; 4],
        ));
        let mut text_cfg = text.clone();
        // Keys the released configs leave to Gemma3TextConfig's defaults.
        for k in ["rope_local_base_freq", "hidden_activation"] {
            text_cfg.as_object_mut().unwrap().remove(k);
        }
        let cfg = serde_json::json!({
            "model_type": "gemma3",
            "architectures": ["Gemma3ForConditionalGeneration"],
            "text_config": text_cfg,
            "vision_config": {"model_type": "siglip_vision_model"},
            "eos_token_id": [1, 106],
        });
        let d = dir.0.join(tag);
        write_safetensors(&d, &a, &mm, &cfg);
        let m = load_model(&d, 1).unwrap();
        assert_eq!(m.config.arch, "gemma3");
        let got = ours_all(&mut load_model(&d, 1).unwrap(), &toks);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g, w, "{tag}: the language model differs");
        }
    }
}

/// `[model] chat_template` replaces the file's template (a base model has
/// none): a file beside the config, or the text inline; a path that names
/// nothing is an error naming it.
#[test]
fn a_configured_chat_template_replaces_the_models() {
    use specd::tokenizer::ChatMessage;
    let dir = TempDir::new("cfg-template");
    let p = dir.0.join("t.gguf");
    write_gguf(
        &p,
        &QWEN3,
        &hf_weights(&QWEN3, 1),
        GgmlDType::F32,
        Vec::new(),
    );
    std::fs::write(dir.0.join("turns.jinja"), GEMMA3_STYLE).unwrap();
    let msgs = [ChatMessage::user("Hi")];
    let want = "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n";
    for value in [
        "turns.jinja".to_string(),
        GEMMA3_STYLE.replace('"', "\\\"").replace('\n', "\\n"),
    ] {
        let cfg_path = dir.0.join("specd.toml");
        std::fs::write(&cfg_path, format!("[model]\nchat_template = \"{value}\"\n")).unwrap();
        let cfg = specd::config::Config::load(&cfg_path).unwrap();
        let tok = cfg.tokenizer(&p).unwrap();
        assert_eq!(
            tok.apply_chat_template(&msgs, true).unwrap(),
            want,
            "{value}"
        );
    }
    let cfg_path = dir.0.join("specd.toml");
    std::fs::write(&cfg_path, "[model]\nchat_template = \"missing.jinja\"\n").unwrap();
    let cfg = specd::config::Config::load(&cfg_path).unwrap();
    let err = cfg.tokenizer(&p).unwrap_err().to_string();
    assert!(
        err.contains("missing.jinja") && err.contains("chat_template"),
        "{err}"
    );
}
