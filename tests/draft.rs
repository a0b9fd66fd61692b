//! The standalone draft-model proposer plugin.

use specd_test_kit as common;

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::{TempDir, TinySpec, TINY};
use specd::config::Config;
use specd::model::{load_model, Model};
use specd::plain::generate;
use specd::sampler::SamplingParams;
use specd::speculative::accept::Acceptance;
use specd::speculative::driver::{EngineConfig, SyncDriver};
use specd::speculative::{Completion, Request};
use specd::tokenizer::Tokenizer;

fn draft_config(model: &std::path::Path, max_draft: usize) -> Config {
    draft_config_with(model, max_draft, "")
}

fn draft_config_with(model: &std::path::Path, max_draft: usize, extra: &str) -> Config {
    Config::parse(
        &format!(
            "[[proposer]]\nname = \"draft\"\nplugin = \"draft\"\nmax_draft = {max_draft}\n[proposer.options]\nmodel = \"{}\"\nthreads = 2\n{extra}\n",
            model.display()
        ),
        None,
    )
    .unwrap()
}

fn engine(model: &Arc<Model>, tok: Arc<Tokenizer>, cfg: &Config, max_running: usize) -> SyncDriver {
    let drafter = cfg.build_drafter(model, Some(tok.clone())).unwrap();
    let mut ec = EngineConfig::for_model(model);
    ec.scheduler.max_running = max_running;
    ec.scheduler.max_draft = 8;
    ec.scheduler.max_waiting = usize::MAX;
    ec.scheduler.adaptive_draft = false;
    SyncDriver::new(model.clone(), Some(tok), ec, drafter)
}

fn run(e: &mut SyncDriver, reqs: Vec<Request>) -> Vec<Completion> {
    let ids: Vec<u64> = reqs.into_iter().map(|r| e.add(r, None).unwrap()).collect();
    let mut done = e.run_to_completion().unwrap();
    done.sort_by_key(|c| ids.iter().position(|&i| i == c.id).unwrap());
    done
}

#[test]
fn greedy_with_a_draft_model_is_lossless_on_smollm2() {
    self_drafting_on_smollm2("", true);
}

/// Catch-ups cut to a window of 4 tokens (shorter than every prompt and
/// than most steps' accepted tokens): the draft sees the first tokens and
/// the newest 4 only, so it no longer always agrees with the target, and
/// the output must still be plain decoding.
#[test]
fn a_draft_model_with_a_short_window_is_still_lossless() {
    self_drafting_on_smollm2("window = 4", false);
}

fn self_drafting_on_smollm2(options: &str, full_context: bool) {
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    // The target as its own draft: with its whole context every draft
    // must be accepted (batch invariance makes the draft's argmax the
    // target's), and output must equal plain decoding.
    let cfg = draft_config_with(&path, 4, options);
    let mut e = engine(&model, tok.clone(), &cfg, 3);
    // The draft's cache (the target's layout here) and its cached token,
    // per position: what the KV budget charges its sequences.
    assert_eq!(
        e.drafter.capabilities("draft").unwrap().kv_bytes_per_token,
        model.kv_bytes_per_token() + 4
    );
    // Prompts longer than the windowed variant's first 4 + newest 4
    // tokens, so its first catch-up is cut.
    let texts = [
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"",
        "The three primary colors of paint, as taught in most schools, are",
        "Once upon a time, in a small village at the edge of a great forest,",
    ];
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tok.encode(t, false).unwrap())
        .collect();
    let n = 24;
    let done = run(
        &mut e,
        ["draft", "none"]
            .iter()
            .flat_map(|name| {
                prompts.iter().map(move |p| Request {
                    proposer: Some(name.to_string()),
                    logprobs: Some(3),
                    ..Request::greedy(p.clone(), n)
                })
            })
            .collect(),
    );
    let (done, plain) = done.split_at(prompts.len());
    for (c, p) in plain.iter().zip(done) {
        // The target's logprobs, bit for bit, whoever drafted.
        assert_eq!(c.logprobs.len(), n);
        assert_eq!(c.logprobs, p.logprobs);
    }
    for (c, p) in done.iter().zip(&prompts) {
        let want = generate(&model, None, &Request::greedy(p.clone(), n), |_| {})
            .unwrap()
            .tokens;
        assert_eq!(c.tokens, want);
        assert!(c.stats.drafted > 0);
        if full_context {
            assert_eq!(
                c.stats.accepted, c.stats.drafted,
                "self-drafting must be fully accepted: {:?}",
                c.stats
            );
        }
    }
    if !full_context {
        // A window of 4 changes what the draft sees: some drafts miss.
        let (a, d) = done.iter().fold((0, 0), |(a, d), c| {
            (a + c.stats.accepted, d + c.stats.drafted)
        });
        eprintln!("window 4: {a}/{d} drafted tokens accepted");
        assert!(
            a < d,
            "a windowed self-draft agreed everywhere: the window had no effect"
        );
    }
    assert!(e.drafter.poisoned("draft").is_none());
}

fn tiny(dir: &TempDir, name: &str, spec: &TinySpec, seed: u64, prefix: &str) -> std::path::PathBuf {
    let p = dir.0.join(name);
    common::write_tiny_gguf_tokens(&p, spec, seed, GgmlDType::Q8_0, "llama", prefix);
    p
}

/// Draws `n` two-token continuations of one prompt at T=1 through the
/// draft `draft` (exact acceptance, then the lossy residual-from-p
/// control) and checks the joint law of the first two tokens against the
/// target's by chi-square: exact passes, the control is caught.
fn assert_sampling_is_lossless(
    target_path: &std::path::Path,
    draft: &std::path::Path,
    label: &str,
) {
    assert_sampling_is_lossless_with(target_path, draft, label, "");
}

/// `assert_sampling_is_lossless` with `extra` plugin options.
fn assert_sampling_is_lossless_with(
    target_path: &std::path::Path,
    draft: &std::path::Path,
    label: &str,
    extra: &str,
) {
    let model = Arc::new(load_model(target_path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(target_path).unwrap());
    let cfg = draft_config_with(draft, 3, extra);
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let prompt = [3u32, 7, 1, 9];
    let exact = common::exact_first_two(&model, &prompt, &params);
    let n = 8000;
    let v = model.config.vocab_size;
    let sample = |acceptance: Acceptance| {
        let mut e = engine(&model, tok.clone(), &cfg, 64);
        e.acceptor.acceptance = acceptance;
        let reqs = (0..n)
            .map(|i| Request {
                params: SamplingParams {
                    seed: 5000 + i as u64,
                    ..params.clone()
                },
                proposer: Some("draft".into()),
                ignore_eos: true,
                ..Request::greedy(prompt.to_vec(), 3)
            })
            .collect();
        let done = run(&mut e, reqs);
        let mut counts = vec![0u64; v * v];
        let (mut drafted, mut accepted) = (0, 0);
        for c in &done {
            counts[c.tokens[0] as usize * v + c.tokens[1] as usize] += 1;
            drafted += c.stats.drafted;
            accepted += c.stats.accepted;
        }
        assert!(
            drafted > n as u64 && accepted > 0 && accepted < drafted,
            "{drafted} {accepted}"
        );
        counts
    };
    let (stat, df) = common::chi_square(&sample(Acceptance::Exact), &exact);
    let crit = common::chi2_crit_999(df);
    eprintln!("{label}, T=1: chi2 {stat:.1} (df {df}, 0.1% critical {crit:.1})");
    assert!(
        stat < crit,
        "{label}: sampled distribution differs from the target: {stat} > {crit}"
    );
    let (bad, bdf) = common::chi_square(&sample(Acceptance::ResidualFromP), &exact);
    eprintln!("{label}, residual from p: chi2 {bad:.1} (df {bdf})");
    assert!(
        bad > 2.0 * common::chi2_crit_999(bdf),
        "{label}: the test must detect a lossy residual: {bad}"
    );
}

#[test]
fn sampling_with_a_draft_model_is_lossless() {
    let spec = TinySpec { vocab: 12, ..TINY };
    let dir = TempDir::new("draft-stat");
    let target_path = tiny(&dir, "target.gguf", &spec, 8, "t");
    let draft_path = tiny(&dir, "draft.gguf", &spec, 31, "t");
    assert_sampling_is_lossless(&target_path, &draft_path, "draft model");
}

#[test]
fn vocabulary_mismatch_is_a_clear_error() {
    let dir = TempDir::new("draft-vocab");
    let target_path = tiny(&dir, "target.gguf", &TINY, 1, "t");
    let model = Arc::new(load_model(&target_path, 1).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&target_path).unwrap());
    let bigger = tiny(
        &dir,
        "bigger.gguf",
        &TinySpec { vocab: 128, ..TINY },
        2,
        "t",
    );
    let e = draft_config(&bigger, 3)
        .build_drafter(&model, Some(tok.clone()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("vocabulary mismatch: the draft model has 128 tokens, the target 96"),
        "{e}"
    );
    let renamed = tiny(&dir, "renamed.gguf", &TINY, 2, "x");
    let e = draft_config(&renamed, 3)
        .build_drafter(&model, Some(tok.clone()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("vocabulary mismatch at token 0")
            && e.contains("\"t0\"")
            && e.contains("\"x0\""),
        "{e}"
    );
    // No `model`: the built-in draft, made for SmolLM2, does not fit this
    // target (a build without it asks for the option).
    let e = Config::parse("[[proposer]]\nname = \"draft\"\n", None)
        .unwrap()
        .build_drafter(&model, Some(tok))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("option `model`")
            || e.contains("builtin:smollm2-135m-instruct: vocabulary mismatch: the draft was trained for a target of 49152 tokens, this target has 96"),
        "{e}"
    );
}

fn compact_error(target: &Arc<Model>, tok: &Arc<Tokenizer>, dir: &std::path::Path) -> String {
    match draft_config(dir, 3).build_drafter(target, Some(tok.clone())) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn compact_draft_load_errors_name_file_tensor_and_shape() {
    use specd::model::tensor_file::TensorData;
    let dir = TempDir::new("draft-compact-errors");
    let target_path = tiny(&dir, "target.gguf", &TINY, 4, "t");
    let good = dir.0.join("good");
    common::train_tiny_compact(&target_path, &good, 40, 10);
    let model = Arc::new(load_model(&target_path, 1).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&target_path).unwrap());
    draft_config(&good, 3)
        .build_drafter(&model, Some(tok.clone()))
        .unwrap();
    let variant = |name: &str| {
        let d = dir.0.join(name);
        std::fs::create_dir_all(&d).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(good.join(f), d.join(f)).unwrap();
        }
        d
    };
    let file = |d: &std::path::Path| d.join("model.safetensors").display().to_string();
    // A missing tensor.
    let d = variant("no-head");
    common::rewrite_safetensors(&d.join("model.safetensors"), |t| {
        t.retain(|(n, _, _)| n != "lm_head.weight")
    });
    let e = compact_error(&model, &tok, &d);
    assert!(
        e.contains(&file(&d))
            && e.contains("missing tensor lm_head.weight (expected shape [40, 32])"),
        "{e}"
    );
    // A wrong shape.
    let d = variant("bad-proj");
    common::rewrite_safetensors(&d.join("model.safetensors"), |t| {
        for (n, shape, data) in t.iter_mut() {
            if n == "model.embed_proj.weight" {
                *shape = vec![16, 2 * TINY.hidden];
            }
            let _ = data;
        }
    });
    let e = compact_error(&model, &tok, &d);
    assert!(
        e.contains(&file(&d))
            && e.contains("tensor model.embed_proj.weight has shape [16, 128], expected [32, 64]"),
        "{e}"
    );
    // A d2t entry past the vocabulary.
    let d = variant("bad-d2t");
    common::rewrite_safetensors(&d.join("model.safetensors"), |t| {
        for (n, _, data) in t.iter_mut() {
            if n == "d2t" {
                if let TensorData::I64(v) = data {
                    v[3] = 500;
                }
            }
        }
    });
    let e = compact_error(&model, &tok, &d);
    assert!(
        e.contains("tensor d2t: row 3 maps to 503, not a distinct id below 96"),
        "{e}"
    );
    // Another target: a different vocabulary size, other token strings,
    // another hidden width.
    let other = Arc::new(
        load_model(
            &tiny(&dir, "big.gguf", &TinySpec { vocab: 128, ..TINY }, 2, "t"),
            1,
        )
        .unwrap(),
    );
    let other_tok = Arc::new(Tokenizer::for_model(&dir.0.join("big.gguf")).unwrap());
    let e = compact_error(&other, &other_tok, &good);
    assert!(
        e.contains("vocabulary mismatch: the draft was trained for a target of 96 tokens, this target has 128"),
        "{e}"
    );
    let renamed = tiny(&dir, "renamed.gguf", &TINY, 4, "x");
    let (rm, rt) = (
        Arc::new(load_model(&renamed, 1).unwrap()),
        Arc::new(Tokenizer::for_model(&renamed).unwrap()),
    );
    let e = compact_error(&rm, &rt, &good);
    assert!(
        e.contains("vocabulary mismatch: the draft was trained for another tokenizer"),
        "{e}"
    );
    let wide = tiny(
        &dir,
        "wide.gguf",
        &TinySpec {
            hidden: 128,
            ..TINY
        },
        4,
        "t",
    );
    let (wm, wt) = (
        Arc::new(load_model(&wide, 1).unwrap()),
        Arc::new(Tokenizer::for_model(&wide).unwrap()),
    );
    let e = compact_error(&wm, &wt, &good);
    assert!(
        e.contains("the draft reads a target embedding of width 64, this target's is 128"),
        "{e}"
    );
}

#[test]
fn sampling_with_a_compact_draft_is_lossless() {
    // A draft vocabulary of 8 of the 12 tokens: the other 4 have q = 0 and
    // are never drafted, which rejection sampling must still make exact.
    let spec = TinySpec { vocab: 12, ..TINY };
    let dir = TempDir::new("draft-compact-stat");
    let target_path = tiny(&dir, "target.gguf", &spec, 8, "t");
    let out = dir.0.join("compact");
    common::train_tiny_compact(&target_path, &out, 8, 20);
    assert_sampling_is_lossless(&target_path, &out, "compact draft");
}

/// A compact draft trained for parallel drafting (`--parallel 3`) on the
/// tiny target.
fn tiny_parallel(
    dir: &TempDir,
    spec: &TinySpec,
    dv: usize,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let target_path = tiny(dir, "target.gguf", spec, 8, "t");
    let out = dir.0.join("pard");
    let cfg = specd::distill::DistillConfig {
        parallel: 3,
        ..common::tiny_distill_config(30, dv)
    };
    specd::distill::distill(&target_path, &out, &cfg, 2).unwrap();
    (target_path, out)
}

/// PARD mode: greedy output is plain decoding's, batched with the same
/// draft in chain mode and with plain requests, and the draft drafts
/// whole blocks (up to 3 tokens per step from one forward).
#[test]
fn a_parallel_draft_is_lossless_under_greedy_batched_with_chain_mode() {
    let dir = TempDir::new("draft-pard-greedy");
    let (target_path, out) = tiny_parallel(&dir, &TINY, 48);
    let model = Arc::new(load_model(&target_path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&target_path).unwrap());
    let cfg = Config::parse(
        &format!(
            "[[proposer]]\nname = \"draft\"\nplugin = \"draft\"\nmax_draft = 3\n[proposer.options]\nmodel = \"{0}\"\n\n[[proposer]]\nname = \"pard\"\nplugin = \"draft\"\nmax_draft = 3\n[proposer.options]\nmodel = \"{0}\"\nmode = \"parallel\"\n",
            out.display()
        ),
        None,
    )
    .unwrap();
    let mut e = engine(&model, tok, &cfg, 16);
    let prompts = [vec![5u32, 9, 3], vec![4, 1, 2, 3], vec![11, 40, 2], vec![7]];
    let mut reqs = Vec::new();
    for p in &prompts {
        for name in ["pard", "draft", "none"] {
            reqs.push(Request {
                proposer: Some(name.into()),
                ignore_eos: true,
                ..Request::greedy(p.clone(), 30)
            });
        }
    }
    let done = run(&mut e, reqs);
    let (mut drafted, mut accepted, mut steps) = (0, 0, 0);
    for (i, p) in prompts.iter().enumerate() {
        let want = generate(
            &model,
            None,
            &Request {
                ignore_eos: true,
                ..Request::greedy(p.clone(), 30)
            },
            |_| {},
        )
        .unwrap()
        .tokens;
        for (j, name) in ["pard", "draft", "none"].iter().enumerate() {
            assert_eq!(done[3 * i + j].tokens, want, "{name}, prompt {i}");
        }
        drafted += done[3 * i].stats.drafted;
        accepted += done[3 * i].stats.accepted;
        steps += done[3 * i].stats.verify_steps;
    }
    assert!(e.drafter.poisoned("pard").is_none());
    // Every step drafts a block of 3 (minus the tail of a request).
    assert!(drafted >= 2 * steps, "{drafted} drafted in {steps} steps");
    assert!(accepted > 0, "{accepted}/{drafted}");
}

/// PARD mode under sampling: each position's q is its own row's, and the
/// joint law of the first two tokens is the target's (with the lossy
/// control caught).
#[test]
fn sampling_with_a_parallel_draft_is_lossless() {
    let spec = TinySpec { vocab: 12, ..TINY };
    let dir = TempDir::new("draft-pard-stat");
    let (target_path, out) = tiny_parallel(&dir, &spec, 8);
    assert_sampling_is_lossless_with(&target_path, &out, "parallel draft", "mode = \"parallel\"");
}

#[test]
fn parallel_mode_needs_a_draft_trained_for_it() {
    let dir = TempDir::new("draft-pard-errors");
    let target_path = tiny(&dir, "target.gguf", &TINY, 4, "t");
    let plain = dir.0.join("compact");
    common::train_tiny_compact(&target_path, &plain, 40, 10);
    let model = Arc::new(load_model(&target_path, 1).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&target_path).unwrap());
    let err = |draft: &std::path::Path, extra: &str| match draft_config_with(draft, 3, extra)
        .build_drafter(&model, Some(tok.clone()))
    {
        Ok(_) => panic!("{extra} loaded"),
        Err(e) => e.to_string(),
    };
    let e = err(&plain, "mode = \"parallel\"");
    assert!(
        e.contains("was not trained for parallel drafting") && e.contains("--parallel"),
        "{e}"
    );
    let e = err(&plain, "mode = \"blocks\"");
    assert!(
        e.contains("option `mode`") && e.contains("\"blocks\""),
        "{e}"
    );
    // A plain (non-compact) draft has no mask embedding either.
    let gguf = tiny(&dir, "draft.gguf", &TINY, 9, "t");
    let e = err(&gguf, "mode = \"parallel\"");
    assert!(e.contains("was not trained for parallel drafting"), "{e}");
}

/// The compact draft shipped for SmolLM2 (built into the plugin, loaded
/// through configs/draft.toml with no path), in chain and in parallel
/// mode: tokens and logprobs equal plain decoding, and its drafts are
/// accepted well above chance (a draft that is not loaded, or fed the
/// wrong embedding, stays near 1.0).
#[test]
fn the_shipped_compact_draft_is_lossless_and_accepted_on_smollm2() {
    common::shipped_is_lossless_and_accepted(
        "configs/draft.toml",
        &["draft", "draft-parallel", "hybrid"],
        4,
        |name| {
            if name == "hybrid" {
                1.05
            } else {
                1.15
            }
        },
    );
}
