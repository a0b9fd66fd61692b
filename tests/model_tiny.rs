//! Model-runner tests on a tiny random Llama: agreement with candle's
//! reference implementations, rollback, batching, trees, hidden states.

use specd_test_kit as common;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use common::{max_abs_diff, TempDir, TINY};
use specd::model::{load_model, ForwardInput, KvDtype, Logits, Model, TreeMask};

const PROMPT: [u32; 7] = [5, 17, 42, 3, 88, 9, 61];
const NEXT: [u32; 3] = [12, 77, 30];

/// Our last-position logits after the prompt, then after each NEXT token.
fn ours(model: &Model) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let mut out = vec![
        model
            .forward_one(&mut cache, &PROMPT, Logits::Last)
            .unwrap()
            .logits,
    ];
    for t in NEXT {
        out.push(
            model
                .forward_one(&mut cache, &[t], Logits::Last)
                .unwrap()
                .logits,
        );
    }
    out
}

#[test]
fn safetensors_matches_candle_llama() {
    let dir = TempDir::new("st");
    common::write_tiny_safetensors(&dir.0, &TINY, 1);
    // Full-precision cache: the references keep K/V in f32.
    let mut model = load_model(&dir.0, 2).unwrap();
    model.set_kv_dtype(KvDtype::F32);
    let cfg: candle_transformers::models::llama::LlamaConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.0.join("config.json")).unwrap()).unwrap();
    let cfg = cfg.into_config(false);
    let files = vec![dir.0.join("model.safetensors")];
    // SAFETY: test-only reference loader; the file was just written by this test.
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu).unwrap()
    };
    let reference = candle_transformers::models::llama::Llama::load(vb, &cfg).unwrap();
    let mut cache =
        candle_transformers::models::llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu)
            .unwrap();
    let mut want = Vec::new();
    let x = Tensor::new(&PROMPT[..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    want.push(
        reference
            .forward(&x, 0, &mut cache)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
    );
    for (i, t) in NEXT.iter().enumerate() {
        let x = Tensor::new(&[*t], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        want.push(
            reference
                .forward(&x, PROMPT.len() + i, &mut cache)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
        );
    }
    for (g, w) in ours(&model).iter().zip(&want) {
        let d = max_abs_diff(g, w);
        assert!(d < 1e-4, "max |dlogit| {d}");
    }
}

/// candle's quantized_llama on a GGUF file: last-position logits after
/// `prompt`, then after each of `next`.
fn candle_gguf_logits(path: &std::path::Path, prompt: &[u32], next: &[u32]) -> Vec<Vec<f32>> {
    let mut f = std::fs::File::open(path).unwrap();
    let ct = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    let mut reference = candle_transformers::models::quantized_llama::ModelWeights::from_gguf(
        ct,
        &mut f,
        &Device::Cpu,
    )
    .unwrap();
    let mut run = |ids: &[u32], pos: usize| {
        let x = Tensor::new(ids, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        reference
            .forward(&x, pos)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let mut want = vec![run(prompt, 0)];
    for (i, t) in next.iter().enumerate() {
        want.push(run(&[*t], prompt.len() + i));
    }
    want
}

fn check_gguf_against_quantized_llama(dtype: GgmlDType, tol: f32) {
    check_spec_against_quantized_llama(&TINY, dtype, tol);
}

/// Our logits on a GGUF of `spec` in `dtype` against candle's
/// quantized_llama on the same file; returns the model and the file size.
fn check_spec_against_quantized_llama(
    spec: &common::TinySpec,
    dtype: GgmlDType,
    tol: f32,
) -> (Model, u64) {
    let dir = TempDir::new(&format!("gguf-{dtype:?}"));
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, spec, 2, dtype, "llama");
    let mut model = load_model(&path, 2).unwrap();
    model.set_kv_dtype(KvDtype::F32);
    let want = candle_gguf_logits(&path, &PROMPT, &NEXT);
    for (g, w) in ours(&model).iter().zip(&want) {
        let d = max_abs_diff(g, w);
        assert!(d < tol, "{dtype:?}: max |dlogit| {d}");
    }
    let size = std::fs::metadata(&path).unwrap().len();
    (model, size)
}

/// A tiny model whose rows are whole K-quant super-blocks (256 elements).
const TINY_K: common::TinySpec = common::TinySpec {
    vocab: 96,
    hidden: 256,
    intermediate: 512,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    max_seq: 256,
};

/// Q4_K and Q6_K files load without dequantizing (weights in memory within
/// 10% of the file, under a byte per weight) and compute what the file
/// holds: logits near those of an F32 twin holding the exact dequantized
/// weights (candle's decoder), and near candle's quantized_llama, which runs
/// ggml's own K-quant kernels. Both differ from us by activation
/// quantization only (ours: 8-bit blocks of 32; ggml's: of 256, which is
/// further from the twin); on this random model logits reach +-15, so the
/// bounds are relative.
#[test]
fn gguf_k_quants_load_natively_and_match_their_f32_twin_and_candle() {
    use candle_core::quantized::{gguf_file, QTensor};
    let s = &TINY_K;
    for dtype in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
        let dir = TempDir::new(&format!("gguf-k-{dtype:?}"));
        let path = dir.0.join("tiny.gguf");
        common::write_tiny_gguf(&path, s, 2, dtype, "llama");
        // The F32 twin: every tensor dequantized by candle.
        let twin = dir.0.join("twin.gguf");
        {
            let mut f = std::fs::File::open(&path).unwrap();
            let ct = gguf_file::Content::read(&mut f).unwrap();
            let ts: Vec<(String, QTensor)> = ct
                .tensor_infos
                .keys()
                .map(|n| {
                    let q = ct.tensor(&mut f, n, &Device::Cpu).unwrap();
                    let t = q.dequantize(&Device::Cpu).unwrap();
                    (n.clone(), QTensor::quantize(&t, GgmlDType::F32).unwrap())
                })
                .collect();
            let md: Vec<(&str, &gguf_file::Value)> =
                ct.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
            let tr: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
            gguf_file::write(&mut std::fs::File::create(&twin).unwrap(), &md, &tr).unwrap();
        }
        let load = |p: &std::path::Path| {
            let mut m = load_model(p, 2).unwrap();
            m.set_kv_dtype(KvDtype::F32);
            m
        };
        let model = load(&path);
        let got = ours(&model);
        let exact = ours(&load(&twin));
        let candle = candle_gguf_logits(&path, &PROMPT, &NEXT);
        for ((g, e), c) in got.iter().zip(&exact).zip(&candle) {
            let scale = e.iter().fold(0f32, |a, v| a.max(v.abs()));
            let (de, dc) = (max_abs_diff(g, e), max_abs_diff(g, c));
            assert!(
                de < 0.08 * scale,
                "{dtype:?}: max |dlogit| vs F32 twin {de}, scale {scale}"
            );
            // candle itself is up to 5% of the scale off the twin here.
            assert!(
                dc < 0.12 * scale,
                "{dtype:?}: max |dlogit| vs candle {dc}, scale {scale}"
            );
        }
        let w = model.weight_bytes() as f64;
        let file = std::fs::metadata(&path).unwrap().len() as f64;
        assert!(
            w <= file * 1.10,
            "{dtype:?}: {w} bytes in memory, file {file}"
        );
        let kv = s.hidden / s.heads * s.kv_heads;
        let params = 2 * s.vocab * s.hidden
            + s.layers
                * (2 * s.hidden * s.hidden + 2 * s.hidden * kv + 3 * s.hidden * s.intermediate);
        // Q4_K 0.58 and Q6_K 0.82 bytes per weight; F32 would be 4.
        assert!(w < params as f64, "{dtype:?} was dequantized: {w} bytes");
    }
}

#[test]
fn gguf_f32_matches_candle_quantized_llama() {
    check_gguf_against_quantized_llama(GgmlDType::F32, 1e-4);
}

#[test]
fn gguf_q8_0_matches_candle_quantized_llama() {
    check_gguf_against_quantized_llama(GgmlDType::Q8_0, 0.05);
}

#[test]
fn gguf_q4_1_matches_candle_quantized_llama() {
    check_gguf_against_quantized_llama(GgmlDType::Q4_1, 0.1);
}

#[test]
fn gguf_q5_0_matches_candle_quantized_llama() {
    check_gguf_against_quantized_llama(GgmlDType::Q5_0, 0.1);
}

#[test]
fn gguf_q5_1_matches_candle_quantized_llama() {
    // Both quantize activations to 8-bit blocks with f16 sums; the few
    // rounding differences reach 0.103 on this model (logits up to +-15).
    check_gguf_against_quantized_llama(GgmlDType::Q5_1, 0.15);
}

#[test]
fn gguf_q4_0_loads_and_agrees() {
    check_gguf_against_quantized_llama(GgmlDType::Q4_0, 0.1);
}

/// The default f16 cache stays close to the f32 one (K/V rounded to 11
/// significant bits), and both are deterministic.
#[test]
fn f16_kv_cache_is_close_to_f32() {
    let dir = TempDir::new("kvdtype");
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, &TINY, 2, GgmlDType::F32, "llama");
    let mut model = load_model(&path, 2).unwrap();
    assert_eq!(model.kv_dtype(), KvDtype::F16);
    let half = ours(&model);
    assert_eq!(half, ours(&model));
    model.set_kv_dtype(KvDtype::F32);
    let full = ours(&model);
    let mut worst = 0f32;
    for (h, f) in half.iter().zip(&full) {
        worst = worst.max(max_abs_diff(h, f));
    }
    assert!(worst > 0.0, "the caches should differ in rounding");
    assert!(worst < 0.02, "f16 cache moved logits by {worst}");
}

fn tiny_q() -> (TempDir, Model) {
    let dir = TempDir::new("tinyq");
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, &TINY, 3, GgmlDType::Q4_1, "llama");
    let m = load_model(&path, 2).unwrap();
    (dir, m)
}

#[test]
fn rollback_equals_fresh_forward_exactly() {
    let (_d, model) = tiny_q();
    let a = [
        4u32, 8, 15, 16, 23, 42, 7, 9, 11, 64, 65, 66, 67, 68, 69, 70, 71,
    ];
    let b = [90u32, 91, 92, 93, 94];
    let c = [10u32, 20, 30];
    // forward(A + B), truncate to A, forward(C)
    let mut cache = model.new_cache();
    model.forward_one(&mut cache, &a, Logits::None).unwrap();
    model.forward_one(&mut cache, &b, Logits::All).unwrap();
    cache.truncate(a.len()).unwrap();
    let rolled = model.forward_one(&mut cache, &c, Logits::All).unwrap();
    // forward(A + C) from scratch, in one chunk
    let mut fresh = model.new_cache();
    let ac: Vec<u32> = a.iter().chain(&c).copied().collect();
    let full = model.forward_one(&mut fresh, &ac, Logits::All).unwrap();
    for i in 0..c.len() {
        assert_eq!(
            rolled.row(i),
            full.row(a.len() + i),
            "position {i} differs after rollback"
        );
    }
    assert_eq!(cache.len(), fresh.len());
    // Rolling back across a block boundary (block size 64) as well.
    let long: Vec<u32> = (0..70).map(|i| (i * 7 % 90) as u32 + 3).collect();
    let mut c1 = model.new_cache();
    model.forward_one(&mut c1, &long, Logits::None).unwrap();
    c1.truncate(60).unwrap();
    let r1 = model.forward_one(&mut c1, &c, Logits::All).unwrap();
    let mut c2 = model.new_cache();
    let l2: Vec<u32> = long[..60].iter().chain(&c).copied().collect();
    let r2 = model.forward_one(&mut c2, &l2, Logits::All).unwrap();
    for i in 0..c.len() {
        assert_eq!(r1.row(i), r2.row(60 + i));
    }
}

#[test]
fn batched_forward_equals_each_sequence_alone() {
    let (_d, model) = tiny_q();
    let s1 = [1u32, 2, 3, 4, 5, 6, 7, 8, 9];
    let s2 = [50u32, 40, 30];
    let alone = |t: &[u32], extra: &[u32]| {
        let mut c = model.new_cache();
        model.forward_one(&mut c, t, Logits::None).unwrap();
        model.forward_one(&mut c, extra, Logits::All).unwrap()
    };
    let a1 = alone(&s1, &[11, 12]);
    let a2 = alone(&s2, &[13, 14, 15]);
    // Prefill both ragged prompts in one forward, then verify-style chunks.
    let (mut c1, mut c2) = (model.new_cache(), model.new_cache());
    model
        .forward(
            &mut [
                ForwardInput {
                    cache: &mut c1,
                    tokens: &s1,
                    logits: Logits::Last,
                    tree: None,
                },
                ForwardInput {
                    cache: &mut c2,
                    tokens: &s2,
                    logits: Logits::Last,
                    tree: None,
                },
            ],
            &[],
        )
        .unwrap();
    let out = model
        .forward(
            &mut [
                ForwardInput {
                    cache: &mut c1,
                    tokens: &[11, 12],
                    logits: Logits::All,
                    tree: None,
                },
                ForwardInput {
                    cache: &mut c2,
                    tokens: &[13, 14, 15],
                    logits: Logits::All,
                    tree: None,
                },
            ],
            &[],
        )
        .unwrap();
    assert_eq!(out[0].logits, a1.logits);
    assert_eq!(out[1].logits, a2.logits);
    assert_eq!(out[1].rows, 3);
}

/// One tree forward of `tokens` after `ctx`, every row's logits.
fn tree_forward(
    model: &Model,
    ctx: &[u32],
    tokens: &[u32],
    tree: &TreeMask,
) -> specd::model::ForwardOutput {
    let mut c = model.new_cache();
    model.forward_one(&mut c, ctx, Logits::None).unwrap();
    model
        .forward(
            &mut [ForwardInput {
                cache: &mut c,
                tokens,
                logits: Logits::All,
                tree: Some(tree),
            }],
            &[],
        )
        .unwrap()
        .remove(0)
}

/// Asserts that row `node` of `got` (a tree forward of `tokens` with
/// `parents` after `ctx`) equals the last row of plain decoding of the
/// node's path after `ctx`, bit for bit, for each of `nodes`.
fn assert_rows_are_their_paths(
    model: &Model,
    ctx: &[u32],
    tokens: &[u32],
    parents: &[Option<usize>],
    got: &specd::model::ForwardOutput,
    nodes: impl Iterator<Item = usize>,
) {
    for node in nodes {
        let mut path = vec![node];
        while let Some(p) = parents[*path.last().unwrap()] {
            path.push(p);
        }
        path.reverse();
        let ids: Vec<u32> = path.iter().map(|&i| tokens[i]).collect();
        let mut c = model.new_cache();
        model.forward_one(&mut c, ctx, Logits::None).unwrap();
        let lin = model.forward_one(&mut c, &ids, Logits::All).unwrap();
        assert_eq!(
            got.row(node),
            lin.row(ids.len() - 1),
            "node {node} after {}",
            ctx.len()
        );
    }
}

#[test]
fn tree_mask_branches_equal_their_linear_paths() {
    let (_d, model) = tiny_q();
    let ctx = [6u32, 7, 8, 9, 10];
    // Tree: root 20 with children 21 and 31; 21 has child 22.
    // nodes: 0=20, 1=21, 2=31, 3=22
    let tree = TreeMask {
        parents: vec![None, Some(0), Some(0), Some(1)],
    };
    let out = tree_forward(&model, &ctx, &[20, 21, 31, 22], &tree);
    let linear = |path: &[u32]| {
        let mut c = model.new_cache();
        model.forward_one(&mut c, &ctx, Logits::None).unwrap();
        model.forward_one(&mut c, path, Logits::All).unwrap()
    };
    let p1 = linear(&[20, 21, 22]);
    let p2 = linear(&[20, 31]);
    assert_eq!(out.row(0), p1.row(0));
    assert_eq!(out.row(1), p1.row(1));
    assert_eq!(out.row(3), p1.row(2));
    assert_eq!(out.row(2), p2.row(1));
    // A chain mask is the same as no mask.
    let mut c = model.new_cache();
    model.forward_one(&mut c, &ctx, Logits::None).unwrap();
    let chain = TreeMask::chain(3);
    let o = model
        .forward(
            &mut [ForwardInput {
                cache: &mut c,
                tokens: &[20, 21, 22],
                logits: Logits::All,
                tree: Some(&chain),
            }],
            &[],
        )
        .unwrap();
    assert_eq!(o[0].logits, p1.logits);
}

/// A bushy tree after a long context (past a 128-slot attention range,
/// its nodes across a block boundary), split over several attention
/// tasks: every node's logits are its linear path's, bit for bit.
#[test]
fn a_large_tree_after_a_long_context_equals_its_linear_paths() {
    let (_d, model) = tiny_q();
    let ctx: Vec<u32> = (0..190u32).map(|i| 3 + (i * 7 + i * i) % 60).collect();
    // A ternary heap of 25 tokens (the root and 24 nodes), depth 3.
    let parents: Vec<Option<usize>> = (0..25usize)
        .map(|i| i.checked_sub(1).map(|j| j / 3))
        .collect();
    let tokens: Vec<u32> = (0..25u32).map(|i| 5 + (i * 11) % 50).collect();
    let tree = TreeMask {
        parents: parents.clone(),
    };
    let out = tree_forward(&model, &ctx, &tokens, &tree);
    assert_rows_are_their_paths(&model, &ctx, &tokens, &parents, &out, 0..tokens.len());
}

/// A prompt's last chunk with a tree drafted after it (the step that
/// ends a prefill): 70 rows forming a chain off a 130-token context, then
/// a ternary tree hanging off the last of them. The chain rows take the
/// plain attention path, the tree rows the tree path; every row's logits
/// equal plain decoding of its path, bit for bit.
#[test]
fn a_prompt_chunk_with_a_tree_after_it_equals_its_linear_paths() {
    let (_d, model) = tiny_q();
    let ctx: Vec<u32> = (0..130u32).map(|i| 3 + (i * 5 + i * i) % 60).collect();
    let chain = 70usize;
    let parents: Vec<Option<usize>> = (0..chain + 13)
        .map(|i| {
            if i < chain {
                i.checked_sub(1)
            } else {
                // A ternary heap below the chain's last row.
                let k = i - chain;
                Some(if k == 0 {
                    chain - 1
                } else {
                    chain + (k - 1) / 3
                })
            }
        })
        .collect();
    let tokens: Vec<u32> = (0..parents.len() as u32)
        .map(|i| 4 + (i * 13) % 55)
        .collect();
    let tree = TreeMask {
        parents: parents.clone(),
    };
    let out = tree_forward(&model, &ctx, &tokens, &tree);
    let nodes = (0..tokens.len()).filter(|&i| i % 9 == 0 || i >= chain - 1);
    assert_rows_are_their_paths(&model, &ctx, &tokens, &parents, &out, nodes);
}

/// Trees batched with each other and with a chain: a deep, wide tree
/// after a context of three 128-slot ranges (its rows split over several
/// tail tasks, the context read once for all of them), a small tree after
/// a short context, and a plain verify chain. Every row's logits equal
/// plain decoding of its path alone, bit for bit.
#[test]
fn batched_trees_and_a_chain_equal_their_linear_paths() {
    let spec = common::TinySpec {
        max_seq: 512,
        ..TINY
    };
    let dir = TempDir::new("batchtrees");
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, &spec, 3, GgmlDType::Q4_1, "llama");
    let model = load_model(&path, 2).unwrap();
    let ctx_a: Vec<u32> = (0..300u32).map(|i| 3 + (i * 7 + i * i) % 60).collect();
    let ctx_b: Vec<u32> = (0..40u32).map(|i| 5 + (i * 3) % 50).collect();
    let ctx_c: Vec<u32> = (0..170u32).map(|i| 4 + (i * 11) % 57).collect();
    // A: a ternary heap of 40 tokens (depth 3); B: root, two branches of
    // two; C: a chain of 5.
    let pa: Vec<Option<usize>> = (0..40usize)
        .map(|i| i.checked_sub(1).map(|j| j / 3))
        .collect();
    let pb = vec![None, Some(0), Some(1), Some(0), Some(3)];
    let ta: Vec<u32> = (0..40u32).map(|i| 6 + (i * 13) % 53).collect();
    let tb: Vec<u32> = vec![21, 22, 23, 31, 32];
    let tc: Vec<u32> = vec![41, 42, 43, 44, 45];
    let (tree_a, tree_b) = (
        TreeMask {
            parents: pa.clone(),
        },
        TreeMask {
            parents: pb.clone(),
        },
    );
    let mut caches: Vec<_> = [&ctx_a, &ctx_b, &ctx_c]
        .iter()
        .map(|ctx| {
            let mut c = model.new_cache();
            model.forward_one(&mut c, ctx, Logits::None).unwrap();
            c
        })
        .collect();
    let mut it = caches.iter_mut();
    let (ca, cb, cc) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let out = model
        .forward(
            &mut [
                ForwardInput {
                    cache: ca,
                    tokens: &ta,
                    logits: Logits::All,
                    tree: Some(&tree_a),
                },
                ForwardInput {
                    cache: cc,
                    tokens: &tc,
                    logits: Logits::All,
                    tree: None,
                },
                ForwardInput {
                    cache: cb,
                    tokens: &tb,
                    logits: Logits::All,
                    tree: Some(&tree_b),
                },
            ],
            &[],
        )
        .unwrap();
    let all = |t: &[u32]| 0..t.len();
    assert_rows_are_their_paths(&model, &ctx_a, &ta, &pa, &out[0], all(&ta));
    let pc: Vec<Option<usize>> = (0..5usize).map(|i| i.checked_sub(1)).collect();
    assert_rows_are_their_paths(&model, &ctx_c, &tc, &pc, &out[1], all(&tc));
    assert_rows_are_their_paths(&model, &ctx_b, &tb, &pb, &out[2], all(&tb));
}

#[test]
fn hidden_states_of_requested_layers() {
    let (_d, model) = tiny_q();
    let mut c = model.new_cache();
    let layers = model.config.layers;
    let out = model
        .forward(
            &mut [ForwardInput {
                cache: &mut c,
                tokens: &[3, 4, 5],
                logits: Logits::Last,
                tree: None,
            }],
            &[0, layers],
        )
        .unwrap();
    let h = &out[0].hidden;
    assert_eq!(h.len(), 2);
    assert_eq!(h[0].0, 0);
    assert_eq!(h[0].1.len(), 3 * model.config.hidden);
    assert_eq!(h[1].0, layers);
    // The final-normed state through the output head reproduces the logits.
    let last = &h[1].1[2 * model.config.hidden..];
    let head = model.weights.output.as_ref().unwrap();
    let mut row = vec![0f32; model.config.hidden];
    head.dequantize_row(0, &mut row);
    let approx: f32 = row.iter().zip(last).map(|(a, b)| a * b).sum();
    assert!((approx - out[0].logits[0]).abs() < 0.05 * (1.0 + approx.abs()));
    let err = model
        .forward(
            &mut [ForwardInput {
                cache: &mut c,
                tokens: &[3],
                logits: Logits::Last,
                tree: None,
            }],
            &[layers + 1],
        )
        .unwrap_err();
    assert!(err.to_string().contains("layer"));
}

/// Contexts longer than one attention slot range (128 slots) are split
/// into several tasks whose partial softmax sums are merged: the result
/// still matches candle (f32 cache), is bit-identical alone or batched with
/// another sequence, and survives rollback exactly.
#[test]
fn long_context_split_attention_matches_reference_and_is_batch_invariant() {
    let spec = common::TinySpec {
        max_seq: 1400,
        ..TINY
    };
    let dir = TempDir::new("longctx");
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, &spec, 4, GgmlDType::F32, "llama");
    let mut model = load_model(&path, 2).unwrap();
    model.set_kv_dtype(KvDtype::F32);
    let prompt: Vec<u32> = (0..1100u32).map(|i| (i * 37 + 11) % 96).collect();
    let next = [7u32, 19, 64];

    // Ours: the prompt in 512-token chunks, then the next tokens one by one.
    let mut cache = model.new_cache();
    for c in prompt.chunks(512) {
        model.forward_one(&mut cache, c, Logits::None).unwrap();
    }
    let mut got = Vec::new();
    for t in next {
        got.push(
            model
                .forward_one(&mut cache, &[t], Logits::Last)
                .unwrap()
                .logits,
        );
    }

    // candle's quantized_llama on the same file.
    let want = candle_gguf_logits(&path, &prompt, &next);
    for (i, (g, w)) in got.iter().zip(&want[1..]).enumerate() {
        let d = max_abs_diff(g, w);
        assert!(d < 1e-3, "step {i}: max |dlogit| {d}");
    }

    // Verify-style forward of 3 tokens at 1100 context: alone, batched with a
    // short sequence, and after a rollback: bit-identical.
    model.set_kv_dtype(KvDtype::F16);
    let mut long = model.new_cache();
    for c in prompt.chunks(512) {
        model.forward_one(&mut long, c, Logits::None).unwrap();
    }
    let alone = model
        .forward_one(&mut long, &next, Logits::All)
        .unwrap()
        .logits;
    long.truncate(prompt.len()).unwrap();
    let mut short = model.new_cache();
    model
        .forward_one(&mut short, &[1, 2, 3], Logits::None)
        .unwrap();
    let out = model
        .forward(
            &mut [
                ForwardInput {
                    cache: &mut short,
                    tokens: &[4, 5],
                    logits: Logits::All,
                    tree: None,
                },
                ForwardInput {
                    cache: &mut long,
                    tokens: &next,
                    logits: Logits::All,
                    tree: None,
                },
            ],
            &[],
        )
        .unwrap();
    assert_eq!(out[1].logits, alone, "batched differs from alone");
    long.truncate(prompt.len()).unwrap();
    let again = model
        .forward_one(&mut long, &next, Logits::All)
        .unwrap()
        .logits;
    assert_eq!(again, alone, "rollback differs");

    // Greedy losslessness at long context: a 12-token verify forward (whose
    // attention tasks walk their slot ranges in turn) equals decoding the
    // same tokens one at a time (one task per slot range, merged after).
    let run: Vec<u32> = (0..12u32).map(|i| (i * 13 + 5) % 96).collect();
    long.truncate(prompt.len()).unwrap();
    let verify = model
        .forward_one(&mut long, &run, Logits::All)
        .unwrap()
        .logits;
    long.truncate(prompt.len()).unwrap();
    let mut stepwise = Vec::new();
    for &t in &run {
        stepwise.extend(
            model
                .forward_one(&mut long, &[t], Logits::Last)
                .unwrap()
                .logits,
        );
    }
    assert_eq!(
        verify, stepwise,
        "verify forward differs from step-by-step decoding"
    );
}

/// Forwards run from several threads at once on one model (one compute
/// pool) all finish, and each gives the bits it gives alone: the pool's
/// helpers (threads that spin for a forward's tasks) never wait on a
/// forward that waits on them.
#[test]
fn concurrent_forwards_on_one_model_finish_and_match_sequential() {
    // Large enough that every parallel region has several tasks to steal.
    const SPEC: common::TinySpec = common::TinySpec {
        vocab: 1024,
        hidden: 256,
        intermediate: 1024,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        max_seq: 256,
    };
    let dir = TempDir::new("concurrent");
    let path = dir.0.join("m.gguf");
    common::write_tiny_gguf(&path, &SPEC, 5, GgmlDType::Q4_1, "llama");
    let model = std::sync::Arc::new(load_model(&path, 2).unwrap());
    fn run(m: &Model, s: usize) -> Vec<f32> {
        let toks: Vec<u32> = (0..12 + 9 * s)
            .map(|i| ((i * 13 + s * 7) % 1000) as u32 + 3)
            .collect();
        let mut c = m.new_cache();
        let (head, tail) = toks.split_at(toks.len() - 3);
        m.forward_one(&mut c, head, Logits::None).unwrap();
        m.forward_one(&mut c, tail, Logits::All).unwrap().logits
    }
    let alone: Vec<Vec<f32>> = (0..6).map(|s| run(&model, s)).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    for t in 0..4 {
        let (m, tx) = (model.clone(), tx.clone());
        std::thread::spawn(move || {
            let got: Vec<Vec<f32>> = (0..30).map(|i| run(&m, (t + i) % 6)).collect();
            tx.send((t, got)).unwrap();
        });
    }
    drop(tx);
    for _ in 0..4 {
        let (t, got) = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .expect("concurrent forwards did not finish");
        for (i, logits) in got.iter().enumerate() {
            let s = (t + i) % 6;
            assert!(
                logits
                    .iter()
                    .zip(&alone[s])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "thread {t}, sequence {s}"
            );
        }
    }
}

/// A model set to run on its caller's pool (the draft plugin's) computes
/// what it computes on its own, on a pool the calling thread joined at the
/// model's width; a thread whose pool has another width uses the model's.
#[test]
fn a_model_on_its_callers_pool_computes_the_same() {
    let (_d, model) = tiny_q();
    let (_d2, mut on_caller) = tiny_q();
    on_caller.run_on_caller_pool();
    let toks = [4u32, 8, 15, 16, 23, 42, 7, 9];
    let logits = |m: &Model| {
        let mut c = m.new_cache();
        m.forward_one(&mut c, &toks, Logits::All).unwrap().logits
    };
    let want = logits(&model);
    std::thread::scope(|s| {
        s.spawn(|| {
            assert_eq!(rayon::current_thread_index(), None);
            assert_eq!(logits(&on_caller), want);
            assert_eq!(
                rayon::current_thread_index(),
                Some(0),
                "the forward joined a pool"
            );
            assert!(
                specd::model::llama::join_caller_pool(on_caller.threads()),
                "the forward made this thread worker 0 of a pool of the model's width"
            );
        });
        s.spawn(|| {
            // This thread's own pool is another width: the model's is used.
            assert!(specd::model::llama::join_caller_pool(
                on_caller.threads() + 1
            ));
            assert_eq!(logits(&on_caller), want);
            assert!(!specd::model::llama::join_caller_pool(on_caller.threads()));
        });
    });
}
