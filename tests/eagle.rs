//! EAGLE: checkpoint layouts (EAGLE-1 and EAGLE-3) and their load errors,
//! `distill eagle` on tiny targets (loss falls, resume continues, the
//! output is the EAGLE-3 layout), the plugin's inference path against the
//! training graph, and the `eagle` plugin's losslessness: greedy identity
//! (chains and trees, batched with other proposers and plain sequences)
//! and the sampled distribution (chi-square, with a lossy control).

use specd_test_kit as common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use candle_core::quantized::GgmlDType;
use common::{TempDir, TinySpec, TINY};
use specd::config::Config;
use specd::distill::eagle::{distill_eagle, reference_logits, EagleConfig, EagleState};
use specd::model::eagle::{feature_layers, Head, Src, Variant};
use specd::model::load_model;
use specd::model::tensor_file::{self, TensorData, TensorFile};
use specd::plain::generate;
use specd::sampler::SamplingParams;
use specd::speculative::{Completion, Request};
use specd::tokenizer::Tokenizer;

// ------------------------------------------------------------ layouts

struct Shape {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    inter: usize,
    vocab: usize,
    draft_vocab: usize,
}

const S: Shape = Shape {
    hidden: 64,
    heads: 4,
    kv_heads: 2,
    inter: 96,
    vocab: 96,
    draft_vocab: 40,
};

fn rand(n: usize, seed: &mut u64, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
        })
        .collect()
}

/// An EAGLE-3 checkpoint exactly as published heads store it: BF16
/// weights, `d2t` I64, `t2d` BOOL, `config.json` with `draft_vocab_size`
/// and the aux layer ids. `edit` may change a tensor before writing.
fn write_eagle3(dir: &Path, seed: u64, edit: impl Fn(&mut Vec<(String, Vec<usize>, TensorData)>)) {
    let mut sd = seed;
    let (h, hd) = (S.hidden, S.hidden / S.heads);
    let (qd, kvd) = (S.heads * hd, S.kv_heads * hd);
    let mut t: Vec<(String, Vec<usize>, TensorData)> = Vec::new();
    let mut w = |name: &str, shape: Vec<usize>, scale: f32| {
        let n = shape.iter().product();
        t.push((
            name.into(),
            shape,
            TensorData::BF16(rand(n, &mut sd, scale)),
        ));
    };
    w("fc.weight", vec![h, 3 * h], 0.05);
    w("midlayer.self_attn.q_proj.weight", vec![qd, 2 * h], 0.1);
    w("midlayer.self_attn.k_proj.weight", vec![kvd, 2 * h], 0.1);
    w("midlayer.self_attn.v_proj.weight", vec![kvd, 2 * h], 0.1);
    w("midlayer.self_attn.o_proj.weight", vec![h, qd], 0.1);
    w("midlayer.mlp.gate_proj.weight", vec![S.inter, h], 0.1);
    w("midlayer.mlp.up_proj.weight", vec![S.inter, h], 0.1);
    w("midlayer.mlp.down_proj.weight", vec![h, S.inter], 0.1);
    w("lm_head.weight", vec![S.draft_vocab, h], 0.2);
    for n in [
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        "norm.weight",
    ] {
        t.push((n.into(), vec![h], TensorData::BF16(vec![1.0; h])));
    }
    // Draft ids map to every other target id, from 3 on.
    let ids: Vec<i64> = (0..S.draft_vocab as i64).map(|i| 3 + 2 * i).collect();
    t.push((
        "d2t".into(),
        vec![S.draft_vocab],
        TensorData::I64(ids.iter().enumerate().map(|(i, &x)| x - i as i64).collect()),
    ));
    let mut t2d = vec![false; S.vocab];
    for &x in &ids {
        t2d[x as usize] = true;
    }
    t.push(("t2d".into(), vec![S.vocab], TensorData::Bool(t2d)));
    edit(&mut t);
    std::fs::create_dir_all(dir).unwrap();
    tensor_file::write(&dir.join("model.safetensors"), &t).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": S.hidden,
        "num_attention_heads": S.heads,
        "num_key_value_heads": S.kv_heads,
        "intermediate_size": S.inter,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": S.vocab,
        "draft_vocab_size": S.draft_vocab,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 7]},
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// An EAGLE-1 checkpoint: `fc` (2h -> h, with bias) and `layers.0.*`
/// without an input norm, F16.
fn write_eagle1(dir: &Path, seed: u64) {
    let mut sd = seed;
    let (h, hd) = (S.hidden, S.hidden / S.heads);
    let (qd, kvd) = (S.heads * hd, S.kv_heads * hd);
    let mut t: Vec<(String, Vec<usize>, TensorData)> = Vec::new();
    let mut w = |name: &str, shape: Vec<usize>, scale: f32| {
        let n = shape.iter().product();
        t.push((name.into(), shape, TensorData::F16(rand(n, &mut sd, scale))));
    };
    w("fc.weight", vec![h, 2 * h], 0.05);
    w("fc.bias", vec![h], 0.05);
    w("layers.0.self_attn.q_proj.weight", vec![qd, h], 0.1);
    w("layers.0.self_attn.k_proj.weight", vec![kvd, h], 0.1);
    w("layers.0.self_attn.v_proj.weight", vec![kvd, h], 0.1);
    w("layers.0.self_attn.o_proj.weight", vec![h, qd], 0.1);
    w("layers.0.mlp.gate_proj.weight", vec![S.inter, h], 0.1);
    w("layers.0.mlp.up_proj.weight", vec![S.inter, h], 0.1);
    w("layers.0.mlp.down_proj.weight", vec![h, S.inter], 0.1);
    t.push((
        "layers.0.post_attention_layernorm.weight".into(),
        vec![h],
        TensorData::F16(vec![1.0; h]),
    ));
    std::fs::create_dir_all(dir).unwrap();
    tensor_file::write(&dir.join("model.safetensors"), &t).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": S.hidden,
        "num_attention_heads": S.heads,
        "num_key_value_heads": S.kv_heads,
        "intermediate_size": S.inter,
        "rms_norm_eps": 1e-6,
        "vocab_size": S.vocab,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

fn load_err(dir: &Path, hidden: usize, vocab: usize, layers: usize) -> String {
    Head::load(dir, hidden, vocab, layers).unwrap_err()
}

#[test]
fn checkpoint_layouts_load_and_name_their_errors() {
    let tmp = TempDir::new("eagle-layouts");
    let d3 = tmp.0.join("e3");
    write_eagle3(&d3, 1, |_| {});
    let h = Head::load(&d3, S.hidden, S.vocab, 8).unwrap();
    assert_eq!(h.cfg.variant, Variant::Eagle3);
    assert_eq!(h.cfg.draft_vocab, S.draft_vocab);
    // SpecForge/SGLang's ids (in `eagle_config`) name the layer whose
    // output is read: our hidden index itself.
    assert_eq!(h.cfg.feature_layers, vec![2, 4, 7]);
    // vLLM speculators' (top level) name the layer whose input is read:
    // ours is one less.
    let dv = tmp.0.join("speculators");
    write_eagle3(&dv, 1, |_| {});
    let mut cj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dv.join("config.json")).unwrap()).unwrap();
    cj.as_object_mut().unwrap().remove("eagle_config");
    cj["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([2, 4, 7]);
    std::fs::write(dv.join("config.json"), cj.to_string()).unwrap();
    let hv = Head::load(&dv, S.hidden, S.vocab, 8).unwrap();
    assert_eq!(hv.cfg.feature_layers, vec![1, 3, 6]);
    cj["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([0, 4, 7]);
    std::fs::write(dv.join("config.json"), cj.to_string()).unwrap();
    let e = load_err(&dv, S.hidden, S.vocab, 8);
    assert!(e.contains("layer ids >= 1"), "{e}");
    assert_eq!(h.d2t[0], 3);
    assert_eq!(h.d2t[S.draft_vocab - 1], 3 + 2 * (S.draft_vocab as u32 - 1));
    assert_eq!(h.cfg.kv_heads, S.kv_heads);
    let d1 = tmp.0.join("e1");
    write_eagle1(&d1, 2);
    let h1 = Head::load(&d1, S.hidden, S.vocab, 8).unwrap();
    assert_eq!(h1.cfg.variant, Variant::Eagle1);
    assert_eq!(h1.cfg.feature_layers, vec![8], "the final-normed state");
    assert!(h1.fc_bias.is_some() && h1.input_norm.is_none());

    // Errors name the file, the tensor and the expected shape.
    let e = load_err(&d3, 32, S.vocab, 8);
    assert!(
        e.contains("config.json") && e.contains("hidden_size 64") && e.contains("32"),
        "{e}"
    );
    let e = load_err(&d3, S.hidden, 100, 8);
    assert!(e.contains("vocab_size 96") && e.contains("100"), "{e}");
    let e = load_err(&d3, S.hidden, S.vocab, 4);
    assert!(
        e.contains("feature layers") && e.contains("4 layers"),
        "{e}"
    );
    let bad = tmp.0.join("bad-shape");
    write_eagle3(&bad, 1, |t| {
        let q = t
            .iter_mut()
            .find(|x| x.0 == "midlayer.self_attn.q_proj.weight")
            .unwrap();
        q.1 = vec![S.hidden, S.hidden];
        q.2 = TensorData::BF16(vec![0.0; S.hidden * S.hidden]);
    });
    let e = load_err(&bad, S.hidden, S.vocab, 8);
    assert!(
        e.contains("model.safetensors")
            && e.contains("`midlayer.self_attn.q_proj.weight`")
            && e.contains("[64, 64]")
            && e.contains("[64, 128]"),
        "{e}"
    );
    let missing = tmp.0.join("missing");
    write_eagle3(&missing, 1, |t| t.retain(|x| x.0 != "lm_head.weight"));
    let e = load_err(&missing, S.hidden, S.vocab, 8);
    assert!(
        e.contains("missing tensor `lm_head.weight`") && e.contains("[40, 64]"),
        "{e}"
    );
    let far = tmp.0.join("d2t");
    write_eagle3(&far, 1, |t| {
        let d = t.iter_mut().find(|x| x.0 == "d2t").unwrap();
        d.2 = TensorData::I64(vec![1000; S.draft_vocab]);
    });
    let e = load_err(&far, S.hidden, S.vocab, 8);
    assert!(
        e.contains("`d2t`") && e.contains("outside the target's vocabulary"),
        "{e}"
    );
    let dtype = tmp.0.join("dtype");
    write_eagle3(&dtype, 1, |t| {
        let d = t.iter_mut().find(|x| x.0 == "norm.weight").unwrap();
        d.2 = TensorData::I64(vec![1; S.hidden]);
    });
    let e = load_err(&dtype, S.hidden, S.vocab, 8);
    assert!(e.contains("`norm.weight`") && e.contains("I64"), "{e}");
    let e = load_err(&tmp.0.join("nowhere"), S.hidden, S.vocab, 8);
    assert!(e.contains("nowhere") && e.contains("config.json"), "{e}");
    // specd's normed-residual extension: read from config.json, checked.
    let nr = tmp.0.join("normed");
    write_eagle3(&nr, 1, |_| {});
    assert!(!h.cfg.normed_residual, "absent: a standard EAGLE-3 head");
    let edit = |v: serde_json::Value| {
        let mut cj: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(nr.join("config.json")).unwrap())
                .unwrap();
        cj["specd_normed_residual"] = v;
        std::fs::write(nr.join("config.json"), cj.to_string()).unwrap();
    };
    edit(serde_json::json!(true));
    let hn = Head::load(&nr, S.hidden, S.vocab, 8).unwrap();
    assert!(hn.cfg.normed_residual);
    edit(serde_json::json!("yes"));
    let e = load_err(&nr, S.hidden, S.vocab, 8);
    assert!(
        e.contains("config.json") && e.contains("`specd_normed_residual` must be true or false"),
        "{e}"
    );
    let mut cj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d1.join("config.json")).unwrap()).unwrap();
    cj["specd_normed_residual"] = serde_json::json!(true);
    std::fs::write(d1.join("config.json"), cj.to_string()).unwrap();
    let e = load_err(&d1, S.hidden, S.vocab, 8);
    assert!(
        e.contains("is for EAGLE-3 heads") && e.contains("Eagle1"),
        "{e}"
    );
}

// ------------------------------------------------------------ training

fn tiny_target(dir: &Path, spec: &TinySpec, seed: u64) -> PathBuf {
    let p = dir.join("target.gguf");
    common::write_tiny_gguf(&p, spec, seed, GgmlDType::Q8_0, "llama");
    p
}

const DEEP: TinySpec = TinySpec { layers: 8, ..TINY };

fn tiny_cfg(prompts: Vec<Vec<u32>>, draft_vocab: usize) -> EagleConfig {
    EagleConfig {
        draft_vocab,
        intermediate: 96,
        ttt_steps: 3,
        max_len: 96,
        batch_tokens: 384,
        epochs: 6.0,
        lr: 3e-3,
        warmup: 5,
        checkpoint_every: 10,
        val_fraction: 0.1,
        gen_tokens: 2400,
        gen_max_tokens: 48,
        concurrency: 8,
        prompt_ids: prompts,
        ..Default::default()
    }
}

fn prompts(vocab: u32, n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            rand(5, &mut s, 1.0)
                .into_iter()
                .map(|x| ((x + 1.0) * 0.5 * (vocab - 1) as f32) as u32)
                .collect()
        })
        .collect()
}

fn state(out: &Path) -> EagleState {
    serde_json::from_str(&std::fs::read_to_string(out.join("train/state.json")).unwrap()).unwrap()
}

/// A head trained on the 8-layer tiny target, shared by the tests below.
fn trained() -> &'static (PathBuf, PathBuf) {
    static T: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    T.get_or_init(|| {
        let dir =
            std::env::temp_dir().join(format!("specd-test-eagle-trained-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let target = tiny_target(&dir, &DEEP, 11);
        let out = dir.join("head");
        let mut cfg = tiny_cfg(prompts(DEEP.vocab as u32, 60, 3), 64);
        distill_eagle(&target, &out, &cfg, 2).unwrap();
        let _ = &mut cfg;
        (target, out)
    })
}

/// A head with the normed residual (`--normed-residual`), a few steps on
/// the same tiny target (`trained`'s).
fn trained_normed() -> &'static PathBuf {
    static T: OnceLock<PathBuf> = OnceLock::new();
    T.get_or_init(|| {
        let (target, first) = trained();
        let out = first.parent().unwrap().join("head-normed");
        let mut cfg = tiny_cfg(prompts(DEEP.vocab as u32, 60, 3), 64);
        cfg.normed_residual = true;
        cfg.stop_after = 20;
        distill_eagle(target, &out, &cfg, 2).unwrap();
        out
    })
}

#[test]
fn distill_eagle_trains_resumes_and_writes_the_eagle3_layout() {
    let tmp = TempDir::new("eagle-distill");
    let target = tiny_target(&tmp.0, &DEEP, 5);
    let out = tmp.0.join("head");
    let mut cfg = tiny_cfg(prompts(DEEP.vocab as u32, 40, 9), 48);
    cfg.epochs = 3.0;
    cfg.stop_after = 10;
    let first = distill_eagle(&target, &out, &cfg, 2).unwrap();
    assert_eq!(first.step, 10);
    assert!(
        first.steps > 10,
        "the schedule runs past the stop: {}",
        first.steps
    );
    assert!(
        first.loss < first.first_loss,
        "training must lower the loss: {} -> {}",
        first.first_loss,
        first.loss
    );
    for f in [
        "config.json",
        "model.safetensors",
        "train/samples.json",
        "train/features.safetensors",
        "train/checkpoint.safetensors",
    ] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    // Resume: the run continues from step 10 with its history.
    cfg.stop_after = 0;
    let done = distill_eagle(&target, &out, &cfg, 2).unwrap();
    assert_eq!(done.step, done.steps);
    assert_eq!(
        done.first_loss, first.first_loss,
        "a resumed run keeps its history"
    );
    assert_eq!(state(&out).step, done.steps);
    assert!(done.val.len() >= 2 && done.val.iter().all(|v| (0.0..=1.0).contains(&v.1)));
    // The public EAGLE-3 layout: names, shapes and dtypes.
    let f = TensorFile::read(&out.join("model.safetensors")).unwrap();
    let h = DEEP.hidden;
    for (name, shape) in [
        ("fc.weight", vec![h, 3 * h]),
        ("midlayer.self_attn.q_proj.weight", vec![h, 2 * h]),
        (
            "midlayer.self_attn.k_proj.weight",
            vec![DEEP.kv_heads * h / DEEP.heads, 2 * h],
        ),
        ("midlayer.hidden_norm.weight", vec![h]),
        ("midlayer.input_layernorm.weight", vec![h]),
        ("midlayer.mlp.down_proj.weight", vec![h, 96]),
        ("norm.weight", vec![h]),
        ("lm_head.weight", vec![48, h]),
        ("d2t", vec![48]),
        ("t2d", vec![DEEP.vocab]),
    ] {
        assert_eq!(f.shape(name), Some(shape.as_slice()), "{name}");
    }
    assert!(f.f32("fc.weight").is_ok());
    assert!(f.bool("t2d").unwrap().iter().filter(|&&x| x).count() == 48);
    assert!(f.i64("d2t").is_ok());
    let cj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cj["draft_vocab_size"], 48);
    let head = Head::load(&out, h, DEEP.vocab, DEEP.layers).unwrap();
    assert_eq!(head.cfg.feature_layers, feature_layers(DEEP.layers));
}

/// Target features of `tokens` (`rows x 3h`, layers side by side).
#[test]
fn the_plugin_head_computes_what_training_optimised() {
    let (target, out) = trained();
    inference_matches_the_training_graph(target, out);
}

/// The same with the normed residual: the trainer records it in the
/// head's config and the inference path follows it (with the residual
/// of a standard head, `g`, the logits differ).
#[test]
fn a_normed_residual_head_computes_what_training_optimised() {
    let (target, _) = trained();
    let out = trained_normed();
    let cj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cj["specd_normed_residual"], true);
    assert_eq!(
        cj["architectures"][0], "SpecdEagle3NormedResidual",
        "no other runtime may take it for a standard EAGLE-3 head"
    );
    inference_matches_the_training_graph(target, out);
    // Its checkpoint resumes only with the flag.
    let mut plain = tiny_cfg(prompts(DEEP.vocab as u32, 60, 3), 64);
    plain.stop_after = 20;
    let e = distill_eagle(target, out, &plain, 2)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("with --normed-residual") && e.contains("without it"),
        "{e}"
    );
    // Continuing it without the flag (or a standard head with it) is
    // refused by name.
    let mut cfg = tiny_cfg(prompts(DEEP.vocab as u32, 60, 3), 64);
    cfg.init = Some(out.clone());
    let e = distill_eagle(target, &out.parent().unwrap().join("cont"), &cfg, 2)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("normed residual") && e.contains("config.json"),
        "{e}"
    );
}

/// Head logits through the plugin's inference path (f32 weights) against
/// the training graph's, at TTT steps 0 and 1.
fn inference_matches_the_training_graph(target: &Path, out: &Path) {
    let model = load_model(target, 2).unwrap();
    let (h, v) = (model.config.hidden, model.config.vocab_size);
    let head = Head::load_with(out, h, v, model.config.layers, false).unwrap();
    let tokens: Vec<u32> = (0..20).map(|i| (i * 7 + 3) % v as u32).collect();
    let f = common::target_features(&model, &tokens, &feature_layers(model.config.layers));
    let reference = reference_logits(out, &model, &tokens, &f, 2).unwrap();
    let dv = head.cfg.draft_vocab;
    let embed = |ts: &[u32]| -> Vec<f32> {
        let mut e = vec![0f32; ts.len() * h];
        for (i, &t) in ts.iter().enumerate() {
            model
                .weights
                .embed
                .dequantize_row(t as usize, &mut e[i * h..(i + 1) * h]);
        }
        e
    };
    // Step 0: pairs (features of p, token p+1) at position p, causal.
    let n = tokens.len() - 1;
    let g = head.fuse(&f[..n * 3 * h], n);
    let e = embed(&tokens[1..]);
    let pos: Vec<usize> = (0..n).collect();
    let sees: Vec<Vec<Src>> = (0..n).map(|r| (0..r).map(Src::Own).collect()).collect();
    let (y0, keys) = head.step(&[], &g, &e, &pos, &sees);
    let l0 = head.logits(&y0, n).unwrap();
    let diff0 = common::max_abs_diff(&l0, &reference[0][..n * dv]);
    // Step 1: row p fed its own output and token p+2 at position p+1, over
    // the step-0 keys of rows 0..=p (a chain draft's first extension).
    let m = n - 1;
    let e1 = embed(&tokens[2..]);
    let pos1: Vec<usize> = (1..=m).collect();
    let sees1: Vec<Vec<Src>> = (0..m)
        .map(|p| {
            vec![Src::Range {
                store: 0,
                start: 0,
                end: p + 1,
            }]
        })
        .collect();
    let (y1, _) = head.step(&[&keys], &y0[..m * h], &e1, &pos1, &sees1);
    let l1 = head.logits(&y1, m).unwrap();
    let diff1 = common::max_abs_diff(&l1, &reference[1][..m * dv]);
    let scale = l0.iter().fold(0f32, |a, x| a.max(x.abs()));
    eprintln!("inference vs training graph: step 0 {diff0:.2e}, step 1 {diff1:.2e} (logits up to {scale:.2})");
    assert!(
        diff0 < 2e-3 * scale.max(1.0) && diff1 < 2e-3 * scale.max(1.0),
        "{diff0} {diff1}"
    );
}

/// `distill diagnose`: the training graph over the validation split
/// agrees with the trainer's own validation, and greedy chains through the
/// plugin's inference path (f32, no window) accept exactly where the
/// training graph's steps are right given the earlier ones.
#[test]
fn diagnose_agrees_with_training_and_with_the_inference_path() {
    use specd::distill::diagnose::{diagnose, DiagnoseConfig};
    let (target, out) = trained();
    let cfg = DiagnoseConfig {
        ttt: 3,
        train_samples: 20,
        chain_samples: 1000,
        train: tiny_cfg(prompts(DEEP.vocab as u32, 60, 3), 64),
        ..Default::default()
    };
    let r = diagnose(target, out, &out.join("train"), &cfg, 2).unwrap();
    eprintln!("{}", r.markdown());
    let st = state(out);
    let (_, val0, val_last) = *st.val.last().unwrap();
    // The exported head is F16; the trainer validated its f32 weights.
    assert!(
        (r.val[0].acc - val0).abs() < 0.03,
        "{} vs {val0}",
        r.val[0].acc
    );
    assert!(
        (r.val[2].acc - val_last).abs() < 0.03,
        "{} vs {val_last}",
        r.val[2].acc
    );
    for (split, graph) in [("train", &r.train), ("val", &r.val)] {
        let chain = r
            .chains
            .iter()
            .find(|c| c.split == split && !c.quantized && c.window == 0)
            .unwrap();
        assert_eq!(chain.roots, graph[0].rows);
        for d in 0..3 {
            let (a, b) = (chain.cond_acc[d], graph[d].cond_acc);
            assert!(
                (a - b).abs() < 0.03,
                "{split} depth {d}: chain {a} vs graph {b}"
            );
        }
    }
    assert!(r.train[2].cond_rows > 20, "{:?}", r.train);
    for s in r.val.iter().chain(&r.train) {
        assert!(s.own_attention > 0.0 && s.own_attention <= 1.0);
        assert!(s.rel_update > 0.0 && s.rel_update.is_finite());
    }
}

/// `--self-attn-init`: a head started with it gives its own key (the
/// token it is fed) most of its attention; one started without it spreads
/// attention over the whole prefix (what left the first shipped head blind
/// to its token).
#[test]
fn the_self_focused_start_attends_to_the_fed_token() {
    use specd::distill::diagnose::{diagnose, DiagnoseConfig};
    let tmp = TempDir::new("eagle-self-attn");
    let target = tiny_target(&tmp.0, &DEEP, 5);
    let mut own = Vec::new();
    for gain in [1.0f32, 0.0] {
        let out = tmp.0.join(format!("head-{gain}"));
        let cfg = EagleConfig {
            self_attn_init: gain,
            stop_after: 1,
            lr: 1e-6,
            ..tiny_cfg(prompts(DEEP.vocab as u32, 30, 9), 64)
        };
        distill_eagle(&target, &out, &cfg, 2).unwrap();
        let d = DiagnoseConfig {
            ttt: 2,
            train_samples: 10,
            chain_samples: 0,
            train: cfg,
            ..Default::default()
        };
        let r = diagnose(&target, &out, &out.join("train"), &d, 2).unwrap();
        own.push(r.train[0].own_attention);
    }
    eprintln!(
        "own-key attention at the start: with {:.3}, without {:.3}",
        own[0], own[1]
    );
    assert!(
        own[0] > 0.3 && own[1] < 0.15 && own[0] > 3.0 * own[1],
        "{own:?}"
    );
}

// ------------------------------------------------------------ the plugin

fn eagle_config(head: &Path, tree_nodes: usize, extra: &str, hybrid: &str) -> Config {
    Config::parse(
        &format!(
            "[[proposer]]\nname = \"eagle-tree\"\nplugin = \"eagle\"\n[proposer.options]\nhead = \"{0}\"\nmode = \"tree\"\nmax_draft = {tree_nodes}\ntop_k = 3\ndepth = 5\n{extra}\n\
             [[proposer]]\nname = \"eagle-chain\"\nplugin = \"eagle\"\n[proposer.options]\nhead = \"{0}\"\nmode = \"chain\"\ndepth = 4\n{extra}\n\
             [[proposer]]\nname = \"ngram\"\nplugin = \"ngram\"\n\
             [[proposer]]\nname = \"hybrid\"\ncompose = [\"ngram\", \"eagle-chain\"]\n[proposer.options]\n{hybrid}\n",
            head.display()
        ),
        None,
    )
    .unwrap()
}

#[test]
fn eagle_greedy_is_plain_decoding_batched_with_other_proposers() {
    let (target, out) = trained();
    let model = Arc::new(load_model(target, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(target).unwrap());
    let cfg = eagle_config(out, 12, "", "costs = { eagle-chain = 0.2 }");
    let mut e = common::plugin_engine(&model, Some(tok), &cfg, 16, 16);
    // Prompts the head never saw.
    let ps = prompts(DEEP.vocab as u32, 4, 77);
    let want: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| {
            let mut r = Request::greedy(p.clone(), 40);
            r.ignore_eos = true;
            generate(&model, None, &r, |_| {}).unwrap().tokens
        })
        .collect();
    let reqs: Vec<Request> = ["eagle-tree", "eagle-chain", "ngram", "hybrid", "none"]
        .iter()
        .flat_map(|name| {
            ps.iter().map(move |p| Request {
                proposer: Some(name.to_string()),
                ignore_eos: true,
                ..Request::greedy(p.clone(), 40)
            })
        })
        .collect();
    let done = common::run_all(&mut e, reqs);
    for (i, c) in done.iter().enumerate() {
        assert_eq!(
            c.tokens,
            want[i % ps.len()],
            "{} differs from plain decoding",
            c.stats.proposer
        );
    }
    // The head's per-position cache is charged to the KV budget; a
    // compose of ngram (none) and eagle-chain keeps eagle-chain's.
    let bytes = |n: &str| e.drafter.capabilities(n).unwrap().kv_bytes_per_token;
    assert!(bytes("eagle-chain") > 0);
    assert_eq!(bytes("eagle-tree"), bytes("eagle-chain"));
    assert_eq!(bytes("ngram"), 0);
    assert_eq!(bytes("hybrid"), bytes("eagle-chain"));
    for name in ["eagle-tree", "eagle-chain"] {
        let runs: Vec<&Completion> = done.iter().filter(|c| c.stats.proposer == name).collect();
        let drafted: u64 = runs.iter().map(|c| c.stats.drafted).sum();
        let accepted: u64 = runs.iter().map(|c| c.stats.accepted).sum();
        let steps: u64 = runs.iter().map(|c| c.stats.verify_steps).sum();
        eprintln!(
            "{name}: {accepted}/{drafted} drafted tokens accepted, {:.2} tokens per verify step",
            160.0 / steps as f64
        );
        assert!(
            drafted > 0 && accepted > 0,
            "{name}: the head drafts and is accepted"
        );
        assert!(e.drafter.poisoned(name).is_none(), "{name} poisoned");
    }
    // The composed proposer labels every step with the member that drafted.
    let hybrid: Vec<&Completion> = done
        .iter()
        .filter(|c| c.stats.proposer == "hybrid")
        .collect();
    let mut by_member = std::collections::BTreeMap::new();
    for c in &hybrid {
        for (m, v) in &c.stats.members {
            *by_member.entry(m.clone()).or_insert(0) += v[0];
        }
        assert_eq!(
            c.stats.members.values().map(|v| v[1]).sum::<u64>(),
            c.stats.drafted
        );
    }
    eprintln!("hybrid steps by member: {by_member:?}");
    assert!(by_member.contains_key("eagle-chain"), "{by_member:?}");
    assert!(e.drafter.poisoned("hybrid").is_none());
}

#[test]
fn eagle1_heads_draft_losslessly_through_the_target_output_head() {
    let tmp = TempDir::new("eagle1-run");
    let spec = TinySpec {
        hidden: S.hidden,
        vocab: S.vocab,
        heads: S.heads,
        kv_heads: S.kv_heads,
        ..DEEP
    };
    let target = tiny_target(&tmp.0, &spec, 21);
    let head = tmp.0.join("e1");
    write_eagle1(&head, 4);
    let model = Arc::new(load_model(&target, 2).unwrap());
    let cfg = Config::parse(
        &format!(
            "[[proposer]]\nname = \"e1\"\nplugin = \"eagle\"\n[proposer.options]\nhead = \"{}\"\nmode = \"tree\"\nmax_draft = 8\n",
            head.display()
        ),
        None,
    )
    .unwrap();
    let mut e = common::plugin_engine(&model, None, &cfg, 4, 16);
    let p = vec![5u32, 9, 13, 2];
    let mut r = Request::greedy(p.clone(), 30);
    r.ignore_eos = true;
    let want = generate(&model, None, &r, |_| {}).unwrap().tokens;
    let done = common::run_all(
        &mut e,
        vec![Request {
            proposer: Some("e1".into()),
            ..r
        }],
    );
    assert_eq!(done[0].tokens, want);
    assert!(done[0].stats.drafted > 0);
    assert!(e.drafter.poisoned("e1").is_none());
}

#[test]
fn eagle_sampling_keeps_the_target_distribution() {
    let tmp = TempDir::new("eagle-chi2");
    let spec = TinySpec { vocab: 12, ..DEEP };
    let target = tiny_target(&tmp.0, &spec, 8);
    let out = tmp.0.join("head");
    // A draft vocabulary smaller than the target's: q has no mass on some
    // tokens the target can sample.
    let mut cfg = tiny_cfg(prompts(12, 40, 4), 9);
    cfg.epochs = 4.0;
    distill_eagle(&target, &out, &cfg, 2).unwrap();
    let model = Arc::new(load_model(&target, 2).unwrap());
    let prompt = [3u32, 7, 1, 9];
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let s = common::Sampled::new(&model, &prompt, &params);
    let n: usize = std::env::var("EAGLE_CHI_N")
        .ok()
        .and_then(|x| x.parse().ok())
        .unwrap_or(12000);
    let good = eagle_config(
        &out,
        12,
        "",
        "costs = { eagle-chain = 0.0 }\nverify_cost = 0.0",
    );
    for name in ["eagle-tree", "eagle-chain", "hybrid"] {
        s.assert_lossless(&good, name, n, 9000, 0.3);
    }
    // The control: pruning sampled trees by their own probabilities (what
    // EAGLE-2 does under greedy decoding) is lossy, and the test sees it.
    let lossy = eagle_config(&out, 3, "test_control = \"rerank_sampled\"", "");
    s.assert_caught(&lossy, "eagle-tree", n, 9000, "the lossy rerank");
}

// ------------------------------------------------------------ SmolLM2

/// The shipped head on the default target, through `configs/eagle.toml`
/// (the head built into the plugin): chains, trees and the hybrid batched
/// with plain sequences reproduce plain decoding token for token, and the
/// head's drafts are accepted often (it was trained for this target).
#[test]
fn the_shipped_head_is_lossless_and_accepted_on_smollm2() {
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    let cfg =
        Config::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/eagle.toml")).unwrap();
    let mut e = common::plugin_engine(&model, Some(tok.clone()), &cfg, 12, 16);
    let texts = [
        "Explain why the sky is blue in two sentences.",
        "Write a Python function that checks whether a string is a palindrome.",
        "List four uses of copper.",
    ];
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| {
            let chat = tok
                .apply_chat_template(&[specd::tokenizer::ChatMessage::user(t.to_string())], true)
                .unwrap();
            tok.encode(&chat, false).unwrap()
        })
        .collect();
    let n = 48;
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut r = Request::greedy(p.clone(), n);
            r.ignore_eos = true;
            generate(&model, None, &r, |_| {}).unwrap().tokens
        })
        .collect();
    let names = ["eagle", "eagle-tree", "hybrid", "none"];
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
    let plain = &done[3 * prompts.len()..];
    for (i, c) in done.iter().enumerate() {
        assert_eq!(
            c.tokens,
            want[i % prompts.len()],
            "{} differs from plain decoding",
            c.stats.proposer
        );
        // The target's logprobs, bit for bit, whoever drafted.
        assert_eq!(c.logprobs.len(), n);
        assert_eq!(
            c.logprobs,
            plain[i % prompts.len()].logprobs,
            "{}",
            c.stats.proposer
        );
    }
    for name in ["eagle", "eagle-tree", "hybrid"] {
        let mut s = specd::speculative::SpecStats::default();
        for c in done.iter().filter(|c| c.stats.proposer == name) {
            s.add(&c.stats);
        }
        eprintln!(
            "{name}: mean accepted length {:.2}, {}/{} drafted tokens accepted, members {:?}",
            s.mean_accepted_len(),
            s.accepted,
            s.drafted,
            s.members
        );
        assert!(e.drafter.poisoned(name).is_none(), "{name} poisoned");
        // The head's validation acceptance@1 is 0.30 (see its README); a
        // head that is not loaded, or fed the wrong features, stays near 0.
        // The hybrid drafts with suffix where it matches, whose drafts are
        // mostly rejected on these prompts.
        let floor = if name == "hybrid" { 1.05 } else { 1.15 };
        assert!(
            s.mean_accepted_len() > floor,
            "{name}: the shipped head must be accepted: {:.2}",
            s.mean_accepted_len()
        );
    }
}
