//! `specd distill draft` on a tiny target: training, checkpoints, resume,
//! and the result loading as a draft model.

use specd_test_kit as common;

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::{TempDir, TINY};
use specd::config::Config;
use specd::distill::{distill, State};
use specd::model::{load_model, Model};
use specd::plain::generate;
use specd::speculative::driver::{EngineConfig, SyncDriver};
use specd::speculative::Request;
use specd::tokenizer::Tokenizer;

/// An engine on `target` with the draft in `draft` as proposer `draft`
/// (always drafting its cap of 4).
fn draft_engine(target: &std::path::Path, draft: &std::path::Path) -> (Arc<Model>, SyncDriver) {
    let model = Arc::new(load_model(target, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(target).unwrap());
    let pc = Config::parse(
        &format!("[[proposer]]\nname = \"draft\"\nplugin = \"draft\"\nmax_draft = 4\n[proposer.options]\nmodel = \"{}\"\n", draft.display()),
        None,
    )
    .unwrap();
    let drafter = pc.build_drafter(&model, Some(tok.clone())).unwrap();
    let mut ec = EngineConfig::for_model(&model);
    ec.scheduler.adaptive_draft = false;
    (
        model.clone(),
        SyncDriver::new(model, Some(tok), ec, drafter),
    )
}

#[test]
fn distill_trains_checkpoints_resumes_and_yields_a_usable_draft() {
    let dir = TempDir::new("distill");
    let target = dir.0.join("target.gguf");
    common::write_tiny_gguf(&target, &TINY, 4, GgmlDType::Q8_0, "llama");
    let out = dir.0.join("draft");
    let mut cfg = common::tiny_distill_config(30, 0);
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
    let (model, mut e) = draft_engine(&target, &out);
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
    use specd::distill::prompts::{word_ngrams, NGRAM};
    let eval = specd::datasets::evaluation_texts();
    // Spec-Bench's 480 questions (both turns of the multi-turn ones) and
    // HumanEval's 164 prompts.
    assert!(eval.len() >= 480 + 164, "{}", eval.len());
    let grams: std::collections::HashSet<String> =
        eval.iter().flat_map(|t| word_ngrams(t, NGRAM)).collect();
    let set = specd::distill::prompt_set(100_000);
    assert!(set.len() >= 2000, "{} prompts", set.len());
    assert!(set.iter().any(|(_, chat)| *chat) && set.iter().any(|(_, chat)| !*chat));
    let varied = specd::distill::varied_prompt_set(100_000);
    assert!(varied.len() > set.len(), "{} varied prompts", varied.len());
    // Passages are the target's own text, which could echo an evaluation
    // question: tasks over passages cut from evaluation texts are dropped,
    // tasks over other passages kept.
    let clean: Vec<String> = set
        .iter()
        .take(40)
        .map(|(t, _)| format!("{t} {t}"))
        .collect();
    let echoes: Vec<String> = eval
        .iter()
        .filter(|t| t.split_whitespace().count() >= 30)
        .take(40)
        .cloned()
        .collect();
    let passages: Vec<String> = clean.iter().chain(&echoes).cloned().collect();
    let tasks = specd::distill::passage_prompt_set(&passages, 400, 0);
    assert!(tasks.len() >= 100, "{} passage tasks", tasks.len());
    for (text, _) in set.iter().chain(&varied).chain(&tasks) {
        let shared: Vec<_> = word_ngrams(text, NGRAM)
            .into_iter()
            .filter(|g| grams.contains(g))
            .collect();
        assert!(shared.is_empty(), "{text:?} shares {shared:?}");
        assert!(!eval.contains(text));
    }
}

/// The `varied` mix on the default target: a first stage of prompts, then
/// tasks over passages cut from what the target answered in it; the
/// budget is met and every sample is a real prompt and response.
#[test]
fn the_varied_mix_builds_its_second_stage_from_the_targets_own_answers() {
    use specd::distill::prompts::PromptMix;
    use specd::distill::{training_data, DataConfig};
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    let dir = TempDir::new("distill-varied");
    let cfg = DataConfig {
        gen_tokens: 1200,
        gen_max_tokens: 40,
        temperature: 0.8,
        sampled_fraction: 0.5,
        concurrency: 8,
        seed: 3,
        prompt_ids: Vec::new(),
        mix: PromptMix::Varied,
        corpus: None,
        corpus_shards: None,
    };
    let data = training_data(&model, &tok, &cfg, &dir.0).unwrap();
    let response =
        |s: &specd::distill::Sample| tok.decode(&s.tokens[s.prompt_len..], true).unwrap();
    let total: usize = data.iter().map(|s| s.tokens.len() - s.prompt_len).sum();
    assert!(total >= 1200, "{total} response tokens");
    assert!(data
        .iter()
        .all(|s| s.prompt_len > 0 && s.tokens.len() > s.prompt_len));
    // A second-stage prompt quotes (a run of 8 words) the answer to an
    // earlier prompt; the second stage comes last.
    let answers: Vec<std::collections::HashSet<String>> = data
        .iter()
        .map(|s| {
            specd::distill::prompts::word_ngrams(&response(s), 8)
                .into_iter()
                .collect()
        })
        .collect();
    let quotes_earlier: Vec<bool> = data
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let prompt = tok.decode(&s.tokens[..s.prompt_len], true).unwrap();
            specd::distill::prompts::word_ngrams(&prompt, 8)
                .iter()
                .any(|g| answers[..i].iter().any(|a| a.contains(g)))
        })
        .collect();
    let n = quotes_earlier.iter().filter(|&&q| q).count();
    assert!(
        n >= 3,
        "{n} of {} prompts quote an earlier answer",
        data.len()
    );
    assert!(
        quotes_earlier[data.len() - 1],
        "the last sample is a second-stage task"
    );
    // A rerun reuses the cached samples.
    assert_eq!(training_data(&model, &tok, &cfg, &dir.0).unwrap(), data);
}

#[test]
fn compact_distill_learns_the_target_and_its_draft_is_lossless() {
    let dir = TempDir::new("distill-compact");
    let target = dir.0.join("target.gguf");
    common::write_tiny_gguf(&target, &TINY, 4, GgmlDType::Q8_0, "llama");
    let out = dir.0.join("draft");
    let st = common::train_tiny_compact(&target, &out, 48, 40);
    assert_eq!(st.step, 40);
    assert!(
        st.loss < st.first_loss,
        "training must lower the loss: {} -> {}",
        st.first_loss,
        st.loss
    );
    // Resume continues from the checkpoint and keeps the history.
    let st2 = common::train_tiny_compact(&target, &out, 48, 50);
    assert_eq!((st2.step, st2.first_loss), (50, st.first_loss));
    // The compact layout: no embedding table, a 48-row head, d2t mapping
    // each row to a distinct target id; the config says how to read it.
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["embed_from_target"], true);
    assert_eq!(cfg["draft_vocab_size"], 48);
    assert_eq!(cfg["vocab_size"], TINY.vocab);
    assert_eq!(cfg["target_hidden_size"], TINY.hidden);
    let f = specd::model::tensor_file::TensorFile::read(&out.join("model.safetensors")).unwrap();
    assert!(!f.has("model.embed_tokens.weight"));
    assert_eq!(f.shape("lm_head.weight"), Some(&[48, 32][..]));
    assert_eq!(
        f.shape("model.embed_proj.weight"),
        Some(&[32, TINY.hidden][..])
    );
    let ids: std::collections::HashSet<i64> = f
        .i64("d2t")
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, d)| i as i64 + d)
        .collect();
    assert_eq!(ids.len(), 48);
    assert!(ids.iter().all(|&t| (0..TINY.vocab as i64).contains(&t)));
    // Through the draft plugin: greedy output is plain decoding's, batched
    // with plain requests, and the trained draft is accepted.
    let (model, mut e) = draft_engine(&target, &out);
    let prompts = [vec![5u32, 9, 3], vec![4, 1, 2, 3], vec![11, 40, 2]];
    for p in &prompts {
        for name in ["draft", "none"] {
            e.add(
                Request {
                    proposer: Some(name.into()),
                    ..Request::greedy(p.clone(), 24)
                },
                None,
            )
            .unwrap();
        }
    }
    let mut done = e.run_to_completion().unwrap();
    done.sort_by_key(|c| c.id);
    let (mut drafted, mut accepted) = (0, 0);
    for (i, p) in prompts.iter().enumerate() {
        let want = generate(&model, None, &Request::greedy(p.clone(), 24), |_| {})
            .unwrap()
            .tokens;
        assert_eq!(done[2 * i].tokens, want, "draft arm, prompt {i}");
        assert_eq!(done[2 * i + 1].tokens, want, "plain arm, prompt {i}");
        drafted += done[2 * i].stats.drafted;
        accepted += done[2 * i].stats.accepted;
    }
    assert!(drafted > 0 && accepted > 0, "{accepted}/{drafted}");
}

/// `--parallel`: the compact draft learns a mask embedding and every mask
/// depth (its config and tensors say so); `--init` warm-starts from
/// another compact draft (its weights and draft vocabulary), refusing one
/// of another shape.
#[test]
fn parallel_distill_warm_starts_and_writes_the_mask_embedding() {
    let dir = TempDir::new("distill-pard");
    let target = dir.0.join("target.gguf");
    common::write_tiny_gguf(&target, &TINY, 4, GgmlDType::Q8_0, "llama");
    let base = dir.0.join("base");
    let st0 = common::train_tiny_compact(&target, &base, 48, 40);
    let out = dir.0.join("pard");
    let cfg = specd::distill::DistillConfig {
        parallel: 3,
        init: Some(base.clone()),
        ..common::tiny_distill_config(30, 48)
    };
    specd::distill::distill(&target, &out, &cfg, 2).unwrap();
    let st: specd::distill::State =
        serde_json::from_str(&std::fs::read_to_string(out.join("state.json")).unwrap()).unwrap();
    assert_eq!(st.step, 30);
    assert!(st.loss < st.first_loss, "{} -> {}", st.first_loss, st.loss);
    // Warm: the first loss of the parallel run (which averages the mask
    // depths, harder than next-token) starts below the base's from
    // scratch.
    assert!(
        st.first_loss < st0.first_loss,
        "a warm start must begin below a cold one: {} vs {}",
        st.first_loss,
        st0.first_loss
    );
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(c["parallel_draft"], 3);
    let f = specd::model::tensor_file::TensorFile::read(&out.join("model.safetensors")).unwrap();
    assert_eq!(f.shape("model.mask_embedding"), Some(&[32][..]));
    // The draft vocabulary is the base's.
    let b = specd::model::tensor_file::TensorFile::read(&base.join("model.safetensors")).unwrap();
    assert_eq!(f.i64("d2t").unwrap(), b.i64("d2t").unwrap());
    // Another shape is refused, naming the key.
    let e = specd::distill::distill(
        &target,
        &dir.0.join("wide"),
        &specd::distill::DistillConfig {
            hidden: 64,
            ..cfg.clone()
        },
        2,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--init") && e.contains("hidden_size") && e.contains("64"),
        "{e}"
    );
}

#[test]
fn responses_that_overlap_an_evaluation_text_are_not_trained_on() {
    // The target's greedy answer to a prompt, made an "evaluation text":
    // a fresh run keeps no sample with that answer (only the other
    // prompt's), and a cache reused later is checked again.
    use specd::distill::{training_data, training_data_excluding, DataConfig};
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    let dir = TempDir::new("distill-exclude");
    let prompt = |t: &str| {
        tok.encode(
            &tok.apply_chat_template(&[specd::tokenizer::ChatMessage::user(t)], true)
                .unwrap(),
            false,
        )
        .unwrap()
    };
    let cfg = DataConfig {
        gen_tokens: 80,
        gen_max_tokens: 24,
        temperature: 0.0,
        sampled_fraction: 0.0,
        concurrency: 4,
        seed: 1,
        prompt_ids: vec![
            prompt("Describe a lighthouse keeper's morning routine."),
            prompt("List three uses of copper wire."),
        ],
        mix: specd::distill::prompts::PromptMix::Templated,
        corpus: None,
        corpus_shards: None,
    };
    let response = |s: &specd::distill::Sample| s.tokens[s.prompt_len..].to_vec();
    let all = training_data(&model, &tok, &cfg, &dir.0.join("a")).unwrap();
    let first = all
        .iter()
        .find(|s| s.tokens[..s.prompt_len] == cfg.prompt_ids[0][..])
        .map(response)
        .unwrap();
    let text = tok.decode(&first, true).unwrap();
    assert!(specd::distill::prompts::words(&text).len() >= 8, "{text}");
    let kept = training_data_excluding(
        &model,
        &tok,
        &cfg,
        &dir.0.join("b"),
        std::slice::from_ref(&text),
    )
    .unwrap();
    assert!(!kept.is_empty());
    assert!(
        kept.iter().all(|s| response(s) != first),
        "an overlapping answer was kept"
    );
    // Reusing the first cache under the exclusion drops the same samples
    // (and, short of the budget then, generates anew without them).
    let again = training_data_excluding(&model, &tok, &cfg, &dir.0.join("a"), &[text]).unwrap();
    assert!(again.iter().all(|s| response(s) != first));
}

/// `specd distill corpus`: shards alternate instructions and conversations
/// over the target's own answers, each with its provenance and digest; a
/// rerun keeps intact shards and extends the stream where it stopped, an
/// altered shard is made again with those after it, other settings are
/// refused, and a trainer reads the corpus instead of generating.
#[test]
fn a_corpus_builds_in_resumable_checked_shards_that_trainers_read() {
    use specd::distill::corpus::{
        build, load, load_shards, CorpusConfig, CorpusSettings, FOLLOW_UPS, SOURCES,
    };
    use specd::distill::{training_data, DataConfig};
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    let dir = TempDir::new("corpus");
    let settings = CorpusSettings {
        shard_tokens: 400,
        gen_max_tokens: 32,
        temperature: 0.8,
        seed: 5,
    };
    let cfg = |shards: usize| CorpusConfig {
        out: dir.0.clone(),
        shards,
        concurrency: 8,
        settings: settings.clone(),
        target_name: "smol".into(),
        command: "specd distill corpus --shards N".into(),
    };
    let man = build(&model, &tok, &cfg(2)).unwrap();
    assert_eq!(man.shards.len(), 2);
    assert_eq!(man.command, "specd distill corpus --shards 2");
    assert_eq!(
        (man.shards[0].kind.as_str(), man.shards[1].kind.as_str()),
        ("instructions", "conversations")
    );
    let (m2, all) = load(&dir.0, &tok).unwrap();
    assert_eq!(m2, man);
    assert_eq!(all.len(), man.shards[0].samples + man.shards[1].samples);
    for e in &man.shards {
        assert!(e.response_tokens >= 400, "{e:?}");
    }
    let (first, second) = all.split_at(man.shards[0].samples);
    let src = |c: &specd::distill::corpus::CorpusSample| SOURCES[c.source as usize];
    assert!(first
        .iter()
        .all(|c| !["passage", "follow-up"].contains(&src(c))
            && (c.index as usize) < man.shards[0].prompts[1]));
    // Half of the first pass is greedy, the rest sampled.
    assert!(first.iter().any(|c| c.temperature == 0.0));
    assert!(first.iter().any(|c| c.temperature == 0.8));
    assert!(second
        .iter()
        .all(|c| ["passage", "follow-up"].contains(&src(c))));
    // A follow-up is a second turn after one of the target's answers.
    let follow = second
        .iter()
        .find(|c| src(c) == "follow-up")
        .expect("a follow-up sample");
    let prompt = tok
        .decode(&follow.sample.tokens[..follow.sample.prompt_len], false)
        .unwrap();
    assert!(FOLLOW_UPS.iter().any(|q| prompt.contains(q)), "{prompt}");
    let answered = first
        .iter()
        .find(|c| c.index == follow.index)
        .expect("the chat it follows");
    let answer = tok
        .decode(&answered.sample.tokens[answered.sample.prompt_len..], true)
        .unwrap();
    assert!(prompt.contains(answer.trim()), "{prompt}");
    // Extending keeps what is there and takes the stream up where it stopped.
    let shard0 = dir.0.join(&man.shards[0].file);
    let before = std::fs::read(&shard0).unwrap();
    let man3 = build(&model, &tok, &cfg(3)).unwrap();
    assert_eq!(man3.shards[..2], man.shards[..]);
    assert_eq!(std::fs::read(&shard0).unwrap(), before);
    assert_eq!(man3.shards[2].prompts[0], man.shards[0].prompts[1]);
    // An altered shard is caught on load and made again (with the next).
    let shard1 = dir.0.join(&man.shards[1].file);
    let mut bytes = std::fs::read(&shard1).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 0x55;
    std::fs::write(&shard1, &bytes).unwrap();
    let err = load(&dir.0, &tok).unwrap_err().to_string();
    assert!(err.contains("SHA-256"), "{err}");
    let again = build(&model, &tok, &cfg(3)).unwrap();
    assert_eq!(again.shards.len(), 3);
    assert_eq!(again.shards[0], man.shards[0]);
    assert!(load(&dir.0, &tok).is_ok());
    // Other settings do not extend this corpus.
    let mut other = cfg(4);
    other.settings.gen_max_tokens = 64;
    let err = build(&model, &tok, &other).unwrap_err().to_string();
    assert!(err.contains("other settings"), "{err}");
    // A trainer's data: the corpus's samples in order, up to the budget.
    let data_cfg = DataConfig {
        gen_tokens: 500,
        gen_max_tokens: 32,
        temperature: 0.0,
        sampled_fraction: 0.0,
        concurrency: 4,
        seed: 1,
        prompt_ids: Vec::new(),
        mix: specd::distill::prompts::PromptMix::Templated,
        corpus: Some(dir.0.clone()),
        corpus_shards: None,
    };
    let data = training_data(&model, &tok, &data_cfg, &dir.0.join("train")).unwrap();
    let (man, all) = load(&dir.0, &tok).unwrap();
    let got: usize = data.iter().map(|s| s.tokens.len() - s.prompt_len).sum();
    assert!(
        got >= 500 && data.len() < all.len(),
        "{got} tokens, {} samples",
        data.len()
    );
    assert!(data.iter().zip(&all).all(|(d, c)| *d == c.sample));
    // Only shard 1 (e.g. shards a shipped head has not seen): exactly its
    // samples, none of shard 0's.
    let n = man.shards.len();
    let shards: Vec<_> = (0..n)
        .map(|k| load_shards(&dir.0, &tok, Some(k..k + 1)).unwrap().1)
        .collect();
    assert_eq!(shards.iter().map(Vec::len).sum::<usize>(), all.len());
    let (first, second) = (&shards[0], &shards[1]);
    let shard1 = DataConfig {
        gen_tokens: 0,
        corpus_shards: Some(1..2),
        ..data_cfg.clone()
    };
    let data = training_data(&model, &tok, &shard1, &dir.0.join("train1")).unwrap();
    let want: Vec<_> = second.iter().map(|c| c.sample.clone()).collect();
    assert_eq!(data, want);
    assert!(first.iter().all(|c| !data.contains(&c.sample)));
    // A range past the corpus is refused, naming both.
    let past = DataConfig {
        corpus_shards: Some(1..n + 1),
        ..shard1
    };
    let err = training_data(&model, &tok, &past, &dir.0.join("train2"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("shards 1..{} asked for", n + 1))
            && err.contains(&format!("holds shards 0..{n}")),
        "{err}"
    );
}
