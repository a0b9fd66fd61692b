//! The standalone draft-model proposer plugin.

mod common;

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::{TempDir, TinySpec, TINY};
use specd::config::Config;
use specd::generate::generate;
use specd::model::{load_model, Model};
use specd::sampler::SamplingParams;
use specd::speculative::accept::Acceptance;
use specd::speculative::driver::{EngineConfig, SyncDriver};
use specd::speculative::{Completion, Request};
use specd::tokenizer::Tokenizer;

fn draft_config(model: &std::path::Path, max_draft: usize) -> Config {
    Config::parse(
        &format!(
            "[[proposer]]\nname = \"draft\"\nplugin = \"draft\"\nmax_draft = {max_draft}\n[proposer.options]\nmodel = \"{}\"\nthreads = 2\n",
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
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    // The target as its own draft: every draft must be accepted (batch
    // invariance makes the draft's argmax the target's), and output must
    // equal plain decoding.
    let cfg = draft_config(&path, 4);
    let mut e = engine(&model, tok.clone(), &cfg, 3);
    let texts = [
        "def fibonacci(n):",
        "The three primary colors are",
        "Once upon a time",
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
        assert_eq!(
            c.stats.accepted, c.stats.drafted,
            "self-drafting must be fully accepted: {:?}",
            c.stats
        );
    }
    assert!(e.drafter.poisoned("draft").is_none());
}

fn tiny(dir: &TempDir, name: &str, spec: &TinySpec, seed: u64, prefix: &str) -> std::path::PathBuf {
    let p = dir.0.join(name);
    common::write_tiny_gguf_tokens(&p, spec, seed, GgmlDType::Q8_0, "llama", prefix);
    p
}

#[test]
fn sampling_with_a_draft_model_is_lossless() {
    let spec = TinySpec { vocab: 12, ..TINY };
    let dir = TempDir::new("draft-stat");
    let target_path = tiny(&dir, "target.gguf", &spec, 8, "t");
    let draft_path = tiny(&dir, "draft.gguf", &spec, 31, "t");
    let model = Arc::new(load_model(&target_path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&target_path).unwrap());
    let cfg = draft_config(&draft_path, 3);
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let prompt = [3u32, 7, 1, 9];
    let exact = common::exact_first_two(&model, &prompt, &params);
    let n = 8000;
    let sample = |acceptance: Acceptance| {
        let mut e = engine(&model, tok.clone(), &cfg, 64);
        e.sampler.acceptance = acceptance;
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
        let v = spec.vocab;
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
    eprintln!("draft model, T=1: chi2 {stat:.1} (df {df}, 0.1% critical {crit:.1})");
    assert!(
        stat < crit,
        "sampled distribution differs from the target: {stat} > {crit}"
    );
    let (bad, bdf) = common::chi_square(&sample(Acceptance::ResidualFromP), &exact);
    eprintln!("draft model, residual from p: chi2 {bad:.1} (df {bdf})");
    assert!(
        bad > 2.0 * common::chi2_crit_999(bdf),
        "the test must detect a lossy residual: {bad}"
    );
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
        .build_drafter(&model, Some(tok))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("vocabulary mismatch at token 0")
            && e.contains("\"t0\"")
            && e.contains("\"x0\""),
        "{e}"
    );
    let e = Config::parse("[[proposer]]\nname = \"draft\"\n", None)
        .unwrap()
        .build_drafter(&model, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("option `model`"), "{e}");
}
