//! The real Gemma 3 270M (Q4_K_M, fetched into the cache by
//! `specd fetch-model --model gemma3-270m`, as CI does): logits against
//! candle-transformers' Gemma 3 on the file's own weights, its tokenizer
//! against llama.cpp's, and lossless speculation (greedy identity with
//! ngram and suffix, a sampled distribution through the chi-square
//! harness with a lossy control).

use specd_test_kit as common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use specd::config::Config;
use specd::model::{load_model, KvDtype, Logits, Model};
use specd::sampler::SamplingParams;
use specd::speculative::accept::Acceptance;
use specd::speculative::Request;
use specd::tokenizer::Tokenizer;

fn gemma_path() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        specd::fetch::GEMMA3_270M
            .ensure()
            .unwrap_or_else(|e| panic!("gemma3-270m unavailable: {e}"))
    })
    .clone()
}

fn gemma() -> (Arc<Model>, Arc<Tokenizer>) {
    let p = gemma_path();
    (
        Arc::new(load_model(&p, 2).unwrap()),
        Arc::new(Tokenizer::for_model(&p).unwrap()),
    )
}

/// The GGUF's weights dequantized to F32 in Hugging Face's names and
/// conventions (llama.cpp's folded `1 + w` norms unfolded), and the
/// matching `config.json`.
fn hf_twin(path: &std::path::Path) -> (HashMap<String, Tensor>, serde_json::Value) {
    let mut f = std::fs::File::open(path).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut map: HashMap<String, Tensor> = HashMap::new();
    let names: Vec<String> = ct.tensor_infos.keys().cloned().collect();
    for name in names {
        let t = ct
            .tensor(&mut f, &name, &Device::Cpu)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap();
        let hf = name
            .replace("token_embd.weight", "model.embed_tokens.weight")
            .replace("output_norm.weight", "model.norm.weight")
            .replace("blk.", "model.layers.")
            .replace("attn_q_norm", "self_attn.q_norm")
            .replace("attn_k_norm", "self_attn.k_norm")
            .replace("attn_q.", "self_attn.q_proj.")
            .replace("attn_k.", "self_attn.k_proj.")
            .replace("attn_v.", "self_attn.v_proj.")
            .replace("attn_output", "self_attn.o_proj")
            .replace("attn_norm", "input_layernorm")
            .replace("post_attention_norm", "post_attention_layernorm")
            .replace("ffn_norm", "pre_feedforward_layernorm")
            .replace("post_ffw_norm", "post_feedforward_layernorm")
            .replace("ffn_gate", "mlp.gate_proj")
            .replace("ffn_up", "mlp.up_proj")
            .replace("ffn_down", "mlp.down_proj");
        let t = if hf.ends_with("norm.weight") {
            (t - 1.0).unwrap()
        } else {
            t
        };
        map.insert(hf, t);
    }
    let md = |k: &str| ct.metadata[k].to_u32().unwrap() as usize;
    let cfg = serde_json::json!({
        "model_type": "gemma3_text",
        "tie_word_embeddings": true,
        "attention_bias": false,
        "head_dim": md("gemma3.attention.key_length"),
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": md("gemma3.embedding_length"),
        "intermediate_size": md("gemma3.feed_forward_length"),
        "num_attention_heads": md("gemma3.attention.head_count"),
        "num_hidden_layers": md("gemma3.block_count"),
        "num_key_value_heads": md("gemma3.attention.head_count_kv"),
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "vocab_size": 262_144,
        "final_logit_softcapping": null,
        "attn_logit_softcapping": null,
        "query_pre_attn_scalar": md("gemma3.attention.key_length"),
        // candle's window is one wider than llama.cpp's (see tests/models.rs);
        // the prompts here are shorter than either.
        "sliding_window": md("gemma3.attention.sliding_window") - 1,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 1024
    });
    (map, cfg)
}

/// candle's Gemma 3 over the twin.
fn candle_gemma3(
    map: &HashMap<String, Tensor>,
    cfg: &serde_json::Value,
) -> candle_transformers::models::gemma3::Model {
    let cfg: candle_transformers::models::gemma3::Config =
        serde_json::from_value(cfg.clone()).unwrap();
    let vb = candle_nn::VarBuilder::from_tensors(map.clone(), DType::F32, &Device::Cpu);
    candle_transformers::models::gemma3::Model::new(false, &cfg, vb).unwrap()
}

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes,",
];

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0
}

/// The gap between the best and the second-best logit.
fn margin(v: &[f32]) -> f32 {
    let b = argmax(v);
    let second = v
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != b)
        .fold(f32::NEG_INFINITY, |m, (_, &x)| m.max(x));
    v[b] - second
}

/// Every position's logits against candle's Gemma 3 on the file's own
/// weights. specd on an F32 twin of the weights (its float path) agrees
/// tightly, which pins the architecture; specd on the Q4_K_M file (8-bit
/// activations on its integer kernels, as llama.cpp's) stays within a
/// bound and picks the reference's top-1 wherever the reference's margin
/// exceeds that noise.
#[test]
fn gemma3_270m_logits_match_candle_gemma3() {
    let p = gemma_path();
    let tok = Tokenizer::for_model(&p).unwrap();
    let mut quant = load_model(&p, 2).unwrap();
    quant.set_kv_dtype(KvDtype::F32);
    let (map, cfg) = hf_twin(&p);
    let mut twin =
        specd::model::load::model_from_tensors(&p, &cfg.to_string(), map.clone(), 2).unwrap();
    twin.set_kv_dtype(KvDtype::F32);
    let mut reference = candle_gemma3(&map, &cfg);
    let (mut worst_q, mut worst_f, mut decided, mut positions) = (0f32, 0f32, 0, 0);
    for text in PROMPTS {
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids[0], 2, "Gemma prompts start with <bos>");
        let q = quant
            .forward_one(&mut quant.new_cache(), &ids, Logits::All)
            .unwrap();
        let f = twin
            .forward_one(&mut twin.new_cache(), &ids, Logits::All)
            .unwrap();
        for n in 1..=ids.len() {
            reference.clear_kv_cache();
            let x = Tensor::new(&ids[..n], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let want = reference
                .forward(&x, 0)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let (gq, gf) = (q.row(n - 1), f.row(n - 1));
            positions += 1;
            assert_eq!(
                argmax(gf),
                argmax(&want),
                "F32 twin: top-1 at {n} of {text:?}"
            );
            worst_f = worst_f.max(common::max_abs_diff(gf, &want));
            worst_q = worst_q.max(common::max_abs_diff(gq, &want));
            if margin(&want) > 0.5 {
                decided += 1;
                assert_eq!(
                    argmax(gq),
                    argmax(&want),
                    "Q4_K_M: top-1 at {n} of {text:?}"
                );
            }
        }
    }
    eprintln!(
        "gemma3-270m vs candle over {positions} positions: F32 twin max |dlogit| {worst_f}, \
         Q4_K_M max |dlogit| {worst_q} (top-1 equal at the {decided} with a margin over 0.5)"
    );
    assert!(worst_f < 0.05, "F32 twin: max |dlogit| {worst_f}");
    assert!(worst_q < 2.5, "Q4_K_M: max |dlogit| {worst_q}");
    assert!(
        decided * 10 >= positions * 6,
        "too few decided positions: {decided}/{positions}"
    );
}

/// Gemma's SentencePiece vocabulary without the dummy prefix: ids as
/// llama.cpp's `llama-tokenize` gives them for the same file.
#[test]
fn gemma3_270m_tokenizer_matches_llama_cpp() {
    let tok = Tokenizer::for_model(&gemma_path()).unwrap();
    for (text, want) in GEMMA_TOKENS {
        let got = tok.encode(text, true).unwrap();
        assert_eq!(&got, want, "{text:?}");
        assert_eq!(tok.decode(&got[1..], false).unwrap(), *text);
    }
}

/// Recorded with `llama-tokenize -m gemma-3-270m-q4_k_m.gguf -p TEXT --ids`
/// (llama.cpp from llama-cpp-python 0.3.36's sources).
const GEMMA_TOKENS: &[(&str, &[u32])] = &[
    ("The capital of France is", &[2, 818, 5279, 529, 7001, 563]),
    (
        "def fibonacci(n):\n    if n < 2:\n        return n",
        &[
            2, 2063, 10779, 78113, 236769, 236749, 1473, 107, 140, 584, 538, 655, 236743, 236778,
            236787, 107, 144, 2060, 538,
        ],
    ),
    (
        "  Hello   world! \u{dc}n\u{ef}c\u{f6}d\u{e9} 123456 \u{1f642}",
        &[
            2, 138, 9259, 139, 12392, 236888, 15356, 236749, 238527, 236755, 55515, 236859, 236743,
            236770, 236778, 236800, 236812, 236810, 236825, 57235,
        ],
    ),
    (
        "<start_of_turn>user\nHi<end_of_turn>",
        &[2, 105, 2364, 107, 10979, 106],
    ),
];

fn engine(model: &Arc<Model>, tok: &Arc<Tokenizer>) -> specd::speculative::driver::SyncDriver {
    common::plugin_engine(model, Some(tok.clone()), &Config::builtin(), 16, 6)
}

/// Greedy ngram and suffix speculation on Gemma 3 equal plain decoding in
/// tokens and logprobs, and they draft and get accepted.
#[test]
fn gemma3_270m_greedy_speculation_equals_plain_decoding() {
    let (model, tok) = gemma();
    let mut e = engine(&model, &tok);
    let prompts: Vec<Vec<u32>> = [
        "One, two, three. One, two, three. One, two,",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
        "The capital of France is",
    ]
    .iter()
    .map(|t| tok.encode(t, true).unwrap())
    .collect();
    let n = 40;
    let names = ["ngram", "suffix", "none"];
    let reqs: Vec<Request> = names
        .iter()
        .flat_map(|name| {
            prompts.iter().map(move |p| Request {
                proposer: Some(name.to_string()),
                ignore_eos: true,
                logprobs: Some(2),
                ..Request::greedy(p.clone(), n)
            })
        })
        .collect();
    let done = common::run_all(&mut e, reqs);
    let plain = &done[2 * prompts.len()..];
    for (i, c) in done.iter().enumerate() {
        let want = &plain[i % prompts.len()];
        assert_eq!(c.tokens, want.tokens, "{} differs", c.stats.proposer);
        assert_eq!(c.logprobs, want.logprobs, "{}", c.stats.proposer);
    }
    for name in ["ngram", "suffix"] {
        let accepted: u64 = done
            .iter()
            .filter(|c| c.stats.proposer == name)
            .map(|c| c.stats.accepted)
            .sum();
        assert!(accepted > 20, "{name} accepted only {accepted} tokens");
        assert!(e.drafter.poisoned(name).is_none(), "{name} poisoned");
    }
}

/// The first two sampled tokens (temperature 1, top-k 3) through ngram
/// follow the target's exact distribution; resampling rejections from p
/// (a lossy residual) is caught by the same test.
#[test]
fn gemma3_270m_sampled_ngram_keeps_the_distribution() {
    let (model, tok) = gemma();
    let prompt = tok
        .encode(
            "red green blue red green blue red green blue red green",
            true,
        )
        .unwrap();
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 3,
        ..Default::default()
    };
    // The exact joint law over the top-3 x top-3 pairs.
    let v = model.config.vocab_size;
    let mut c = model.new_cache();
    let l1 = model
        .forward_one(&mut c, &prompt, Logits::Last)
        .unwrap()
        .logits;
    let p1 = specd::sampler::distribution(&l1, &params).dense(v);
    let mut cells: Vec<((u32, u32), f64)> = Vec::new();
    for t1 in (0..v).filter(|&t| p1[t] > 0.0) {
        let mut c2 = c.clone();
        let l2 = model
            .forward_one(&mut c2, &[t1 as u32], Logits::Last)
            .unwrap()
            .logits;
        let p2 = specd::sampler::distribution(&l2, &params).dense(v);
        for t2 in (0..v).filter(|&t| p2[t] > 0.0) {
            cells.push(((t1 as u32, t2 as u32), p1[t1] as f64 * p2[t2] as f64));
        }
    }
    assert_eq!(cells.len(), 9);
    let probs: Vec<f64> = cells.iter().map(|c| c.1).chain([0.0]).collect();
    let n = 1_500u64;
    let sample = |acceptance: Acceptance| {
        let mut e = engine(&model, &tok);
        e.acceptor.acceptance = acceptance;
        let reqs = (0..n)
            .map(|i| Request {
                params: SamplingParams {
                    seed: 5_000 + i,
                    ..params.clone()
                },
                proposer: Some("ngram".into()),
                ignore_eos: true,
                ..Request::greedy(prompt.clone(), 3)
            })
            .collect();
        let done = common::run_all(&mut e, reqs);
        let drafted: u64 = done.iter().map(|c| c.stats.drafted).sum();
        assert!(drafted > n, "ngram must draft: {drafted}");
        // The last cell takes any pair outside the support.
        let mut counts = vec![0u64; cells.len() + 1];
        for c in &done {
            let pair = (c.tokens[0], c.tokens[1]);
            let i = cells
                .iter()
                .position(|(p, _)| *p == pair)
                .unwrap_or(cells.len());
            counts[i] += 1;
        }
        counts
    };
    let (stat, df) = common::chi_square(&sample(Acceptance::Exact), &probs);
    let crit = common::chi2_crit_999(df);
    eprintln!("gemma3 ngram sampled: chi2 {stat:.1} (df {df}, 0.1% critical {crit:.1})");
    assert!(stat < crit, "sampled distribution differs: {stat} > {crit}");
    let (bad, bdf) = common::chi_square(&sample(Acceptance::ResidualFromP), &probs);
    eprintln!("lossy control: chi2 {bad:.1} (df {bdf})");
    assert!(
        bad > common::chi2_crit_999(bdf),
        "the lossy control passed: {bad}"
    );
}

/// The shipped trained proposers (trained on SmolLM2) refuse Gemma 3 at
/// load, naming the mismatch; ngram and suffix load.
#[test]
fn gemma3_270m_refuses_heads_trained_for_another_target() {
    let (model, tok) = gemma();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for (config, want) in [
        (
            "configs/eagle.toml",
            "hidden_size 576 does not match the target's 640",
        ),
        (
            "configs/medusa.toml",
            "hidden_size 576 does not match the target's 640",
        ),
        (
            "configs/mtp.toml",
            "vocab_size 49152 does not match the target's 262144",
        ),
        (
            "configs/dflash.toml",
            "hidden_size 576 does not match the target's 640",
        ),
        ("configs/draft.toml", "vocabulary mismatch"),
    ] {
        let cfg = Config::load(&root.join(config)).unwrap();
        let err = match cfg.build_drafter(&model, Some(tok.clone())) {
            Ok(_) => panic!("{config}: a SmolLM2 head loaded on Gemma 3"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(want), "{config}: {err}");
    }
    assert!(Config::builtin()
        .build_drafter(&model, Some(tok.clone()))
        .is_ok());
}

/// `serve` with `[model] path = "gemma3-270m"` (a catalogued name) serves
/// Gemma under its name, streamed and not, speculating losslessly.
#[test]
fn gemma3_270m_serves_completions_by_its_catalogued_name() {
    gemma_path();
    let d = common::Daemon::start(
        "[model]\npath = \"gemma3-270m\"\n[engine]\ndefault_proposer = \"suffix\"\n\
         [[proposer]]\nname = \"suffix\"\nplugin = \"suffix\"\n",
        &[],
    );
    let body = serde_json::json!({
        "prompt": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
        "max_tokens": 24,
        "temperature": 0,
    });
    let spec = d.post("/v1/completions", &body).json();
    assert_eq!(spec["model"], "gemma3-270m", "{spec}");
    let mut plain_body = body.clone();
    plain_body["speculation"] = serde_json::json!({"proposer": "none"});
    let plain = d.post("/v1/completions", &plain_body).json();
    assert_eq!(spec["choices"][0]["text"], plain["choices"][0]["text"]);
    assert!(
        spec["usage"]["speculation"]["accepted_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{spec}"
    );
    let mut stream_body = body.clone();
    stream_body["stream"] = serde_json::json!(true);
    let events = d.post("/v1/completions", &stream_body).sse();
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(serde_json::json!(text), plain["choices"][0]["text"]);
}
