//! `specd distill draft` on a tiny target: training, checkpoints, resume,
//! and the result loading as a draft model.

mod common;

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::{TempDir, TINY};
use specd::config::Config;
use specd::distill::{distill, DistillConfig, State};
use specd::generate::generate;
use specd::model::load_model;
use specd::speculative::driver::{EngineConfig, SyncDriver};
use specd::speculative::Request;
use specd::tokenizer::Tokenizer;

#[test]
fn distill_trains_checkpoints_resumes_and_yields_a_usable_draft() {
    let dir = TempDir::new("distill");
    let target = dir.0.join("target.gguf");
    common::write_tiny_gguf(&target, &TINY, 4, GgmlDType::Q8_0, "llama");
    let out = dir.0.join("draft");
    let mut cfg = DistillConfig {
        layers: 1,
        hidden: 32,
        heads: 2,
        intermediate: 64,
        seq_len: 16,
        batch: 4,
        steps: 30,
        lr: 1e-2,
        gen_tokens: 400,
        gen_max_tokens: 40,
        checkpoint_every: 10,
        prompt_ids: vec![vec![5, 9, 13], vec![40, 41, 42, 43], vec![7, 7, 8]],
        ..Default::default()
    };
    distill(&target, &out, &cfg, 2).unwrap();
    for f in [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "state.json",
        "samples.json",
    ] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let st: State =
        serde_json::from_str(&std::fs::read_to_string(out.join("state.json")).unwrap()).unwrap();
    assert_eq!(st.step, 30);
    assert!(
        st.loss < st.first_loss,
        "training must lower the loss: {} -> {}",
        st.first_loss,
        st.loss
    );
    // Resume: more steps continue from the checkpoint.
    cfg.steps = 40;
    distill(&target, &out, &cfg, 2).unwrap();
    let st2: State =
        serde_json::from_str(&std::fs::read_to_string(out.join("state.json")).unwrap()).unwrap();
    assert_eq!(st2.step, 40);
    assert_eq!(
        st2.first_loss, st.first_loss,
        "a resumed run keeps its history"
    );
    // The output is a safetensors model the engine loads, and a draft the
    // plugin accepts (same vocabulary), and speculation with it is lossless.
    let draft = load_model(&out, 1).unwrap();
    assert_eq!(draft.config.vocab_size, TINY.vocab);
    assert!(draft.weights.output.is_none(), "tied embeddings");
    let model = Arc::new(load_model(&target, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&target).unwrap());
    let pc = Config::parse(
        &format!("[[proposer]]\nname = \"draft\"\nplugin = \"draft\"\n[proposer.options]\nmodel = \"{}\"\n", out.display()),
        None,
    )
    .unwrap();
    let drafter = pc.build_drafter(&model, Some(tok.clone())).unwrap();
    let mut ec = EngineConfig::for_model(&model);
    ec.scheduler.adaptive_draft = false;
    let mut e = SyncDriver::new(model.clone(), Some(tok), ec, drafter);
    let prompt = vec![5u32, 9, 13];
    e.add(
        Request {
            proposer: Some("draft".into()),
            ..Request::greedy(prompt.clone(), 24)
        },
        None,
    )
    .unwrap();
    let done = e.run_to_completion().unwrap();
    let want = generate(&model, None, &Request::greedy(prompt, 24), |_| {})
        .unwrap()
        .tokens;
    assert_eq!(done[0].tokens, want);
    assert!(done[0].stats.drafted > 0);
}

#[test]
fn training_prompts_share_no_8gram_with_any_evaluation_set() {
    use specd::prompts::{word_ngrams, NGRAM};
    let eval = specd::ab::evaluation_texts();
    // Spec-Bench's 480 questions (both turns of the multi-turn ones) and
    // HumanEval's 164 prompts.
    assert!(eval.len() >= 480 + 164, "{}", eval.len());
    let grams: std::collections::HashSet<String> =
        eval.iter().flat_map(|t| word_ngrams(t, NGRAM)).collect();
    let set = specd::distill::prompt_set(100_000);
    assert!(set.len() >= 2000, "{} prompts", set.len());
    assert!(set.iter().any(|(_, chat)| *chat) && set.iter().any(|(_, chat)| !*chat));
    for (text, _) in &set {
        let shared: Vec<_> = word_ngrams(text, NGRAM)
            .into_iter()
            .filter(|g| grams.contains(g))
            .collect();
        assert!(shared.is_empty(), "{text:?} shares {shared:?}");
        assert!(!eval.contains(text));
    }
}
