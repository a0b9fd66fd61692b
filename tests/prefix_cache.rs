//! Automatic prefix caching: requests sharing a prompt prefix reuse its KV
//! blocks, and nothing they produce depends on it.

use specd_test_kit as common;

use std::sync::Arc;

use specd::config::Config;
use specd::model::{load_model, Model};
use specd::speculative::driver::{EngineConfig, SyncDriver};
use specd::speculative::kv_manager::Pool;
use specd::speculative::{Completion, Request};
use specd::tokenizer::{ChatMessage, Tokenizer};

fn engine(
    model: &Arc<Model>,
    tok: &Arc<Tokenizer>,
    prefix_blocks: usize,
    running: usize,
) -> SyncDriver {
    engine_with_kv(model, tok, prefix_blocks, running, None)
}

/// `engine` with a KV budget of `kv_blocks` (default: roomy).
fn engine_with_kv(
    model: &Arc<Model>,
    tok: &Arc<Tokenizer>,
    prefix_blocks: usize,
    running: usize,
    kv_blocks: Option<usize>,
) -> SyncDriver {
    let drafter = Config::builtin()
        .build_drafter(model, Some(tok.clone()))
        .unwrap();
    let mut ec = EngineConfig::for_model(model);
    ec.scheduler.max_running = running;
    ec.scheduler.max_waiting = usize::MAX;
    ec.prefix_cache_blocks = prefix_blocks;
    // Draft lengths from each sequence's acceptance alone (not from timed
    // verify costs), so sampled runs that should match token for token
    // draft the same.
    ec.scheduler.measured_pricing = false;
    if let Some(b) = kv_blocks {
        ec.kv_blocks = b;
    }
    SyncDriver::new(model.clone(), Some(tok.clone()), ec, drafter)
}

fn run_all(e: &mut SyncDriver, reqs: Vec<Request>) -> Vec<Completion> {
    let ids: Vec<u64> = reqs.into_iter().map(|r| e.add(r, None).unwrap()).collect();
    let mut done = e.run_to_completion().unwrap();
    done.sort_by_key(|c| ids.iter().position(|&i| i == c.id).unwrap());
    done
}

/// A chat with a long shared system prompt and its own question.
fn chat(tok: &Tokenizer, system: &str, question: &str) -> Vec<u32> {
    let msgs = [
        ChatMessage::new("system", system),
        ChatMessage::user(question),
    ];
    tok.encode_chat(&msgs, true, false).unwrap()
}

fn system_prompt() -> String {
    let rules = [
        "Answer in plain English and keep every answer short.",
        "When a question is about code, reply with a Python function and one sentence about it.",
        "Never invent facts; say that you do not know when you do not know.",
        "Use metric units, ISO dates and the 24-hour clock.",
        "Prefer lists over long paragraphs when listing more than two things.",
    ];
    let mut s = String::from("You are a careful assistant for a small engineering team.\n");
    for round in 0..4 {
        for (i, r) in rules.iter().enumerate() {
            s.push_str(&format!("Rule {}.{}: {r}\n", round + 1, i + 1));
        }
    }
    s
}

/// Greedy outputs are the same with the prefix cache on and off, for plain
/// and speculative decoding, sequentially and in one batch; later requests
/// find the shared prefix cached, and the cached blocks stay intact while
/// sequences that hold them roll back rejected drafts.
#[test]
fn outputs_do_not_depend_on_the_prefix_cache() {
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    let system = system_prompt();
    let questions = [
        "What is a hash map?",
        "Write a function that reverses a list.",
        "How far is 10 miles in kilometres?",
        "List three prime numbers.",
    ];
    let prompts: Vec<Vec<u32>> = questions.iter().map(|q| chat(&tok, &system, q)).collect();
    assert!(
        prompts[0].len() > 4 * 64,
        "the shared prefix spans several blocks"
    );
    let reqs = |proposer: &str| -> Vec<Request> {
        prompts
            .iter()
            .map(|p| Request {
                proposer: Some(proposer.to_string()),
                ..Request::greedy(p.clone(), 24)
            })
            .collect()
    };
    let mut cold = engine(&model, &tok, 0, 4);
    let want = run_all(&mut cold, reqs("none"));
    assert_eq!(cold.verifier.prefix_stats(), (0, 0));

    // One request at a time: every request after the first hits.
    let mut warm = engine(&model, &tok, 64, 4);
    for (i, r) in reqs("none").into_iter().enumerate() {
        let got = run_all(&mut warm, vec![r]);
        assert_eq!(got[0].tokens, want[i].tokens, "request {i}");
    }
    let (query, hit) = warm.verifier.prefix_stats();
    let shared = (prompts[0].len() - 16) / 64 * 64;
    eprintln!("sequential: {hit} of {query} prefill tokens from the cache");
    assert!(hit >= 3 * shared as u64 - 3 * 64, "{hit} {query}");
    // Speculative decoding over cached blocks: rollbacks of rejected
    // drafts never touch them (the next plain request still matches).
    for proposer in ["ngram", "suffix"] {
        let got = run_all(&mut warm, reqs(proposer));
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.tokens, w.tokens, "{proposer}");
        }
    }
    let again = run_all(&mut warm, reqs("none"));
    for (g, w) in again.iter().zip(&want) {
        assert_eq!(g.tokens, w.tokens, "after speculative requests");
    }
    // Everything finished: only the cache holds blocks, within its budget.
    assert!(warm.verifier.prefix_cached_blocks() <= 64);
    assert_eq!(warm.verifier.num_caches(), 0);
}

/// A cache of two blocks under prompts of several: least recently used
/// blocks are evicted, nothing breaks, outputs stay the same.
#[test]
fn eviction_under_a_small_budget_keeps_outputs() {
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    let system = system_prompt();
    let prompts: Vec<Vec<u32>> = ["Name a colour.", "Name a fruit.", "Name a planet."]
        .iter()
        .map(|q| chat(&tok, &format!("{q} {system}"), q))
        .collect();
    let mut cold = engine(&model, &tok, 0, 1);
    let mut tiny = engine(&model, &tok, 2, 1);
    for round in 0..2 {
        for p in &prompts {
            let want = run_all(&mut cold, vec![Request::greedy(p.clone(), 12)]);
            let got = run_all(&mut tiny, vec![Request::greedy(p.clone(), 12)]);
            assert_eq!(got[0].tokens, want[0].tokens, "round {round}");
            assert!(tiny.verifier.prefix_cached_blocks() <= 2);
        }
    }
}

/// `n > 1`: later choices start from a copy-on-write copy of the first
/// choice's prompt KV (no second prefill), and give exactly what they give
/// when they prefill on their own, greedy and sampled, plain and ngram.
#[test]
fn forked_choices_share_the_prompt_and_decode_as_if_alone() {
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    let prompt = chat(&tok, &system_prompt(), "Write a haiku about rivers.");
    let n = 20;
    let choices = |fork: bool, proposer: &str, e: &mut SyncDriver| -> Vec<Vec<u32>> {
        let mut ids = Vec::new();
        for i in 0..3u64 {
            let req = Request {
                proposer: Some(proposer.into()),
                params: specd::sampler::SamplingParams {
                    temperature: if i == 0 { 0.0 } else { 0.8 },
                    seed: 7 + i,
                    ..Default::default()
                },
                fork_of: if fork && i > 0 {
                    ids.first().copied()
                } else {
                    None
                },
                ..Request::greedy(prompt.clone(), n)
            };
            ids.push(e.add(req, None).unwrap());
        }
        let mut done = e.run_to_completion().unwrap();
        done.sort_by_key(|c| ids.iter().position(|&i| i == c.id).unwrap());
        done.into_iter().map(|c| c.tokens).collect()
    };
    for proposer in ["none", "ngram"] {
        let mut alone = engine(&model, &tok, 0, 4);
        let want = choices(false, proposer, &mut alone);
        let mut forked = engine(&model, &tok, 0, 4);
        let got = choices(true, proposer, &mut forked);
        assert_eq!(got, want, "{proposer}");
        let saved = alone.verifier.forwarded_tokens() - forked.verifier.forwarded_tokens();
        eprintln!(
            "{proposer}: {} tokens forwarded alone, {} forked",
            alone.verifier.forwarded_tokens(),
            forked.verifier.forwarded_tokens()
        );
        if proposer == "none" {
            // Exactly the two prompts the forks did not prefill.
            assert_eq!(saved, 2 * (prompt.len() as u64 - 1));
        } else {
            assert!(saved >= 2 * (prompt.len() as u64 - 1) - 2 * n as u64);
        }
        assert_eq!(forked.verifier.num_caches(), 0);
    }
}

/// Under a KV budget too small for the batch (preemptions, recomputes),
/// with the prefix cache at its default share of that budget: greedy
/// outputs are those of a roomy engine without a cache.
#[test]
fn a_small_kv_budget_preempts_and_evicts_without_changing_outputs() {
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    let system = system_prompt();
    let prompts: Vec<Vec<u32>> = ["Name a colour.", "Name a fruit.", "Name a planet."]
        .iter()
        .map(|q| chat(&tok, &system, q))
        .collect();
    let reqs = || -> Vec<Request> {
        prompts
            .iter()
            .map(|p| Request::greedy(p.clone(), 24))
            .collect()
    };
    let mut roomy = engine(&model, &tok, 0, 3);
    let want = run_all(&mut roomy, reqs());
    let blocks = prompts[0].len().div_ceil(64) + 1;
    // Room for one and a half sequences; the cache gets its default share.
    let kv = blocks * 3 / 2;
    let mut small = engine_with_kv(&model, &tok, (kv / 4).max(1), 3, Some(kv));
    for round in 0..2 {
        let got = run_all(&mut small, reqs());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.tokens, w.tokens, "round {round}");
        }
    }
    let preempted: u32 = run_all(&mut small, reqs())
        .iter()
        .map(|c| c.preemptions)
        .sum();
    eprintln!(
        "small budget: {kv} blocks, {preempted} preemptions in the last round, prefix cache {:?}",
        small.verifier.prefix_stats()
    );
    assert!(small.verifier.prefix_cached_blocks() <= (kv / 4).max(1));
}

/// Forked choices under a KV budget that preempts (choices are evicted
/// and recomputed, then prefill themselves): every choice still gives
/// what it gives alone.
#[test]
fn forked_choices_survive_preemption() {
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    let prompt = chat(&tok, &system_prompt(), "Name three rivers.");
    let reqs = || -> Vec<Request> {
        (0..4u64)
            .map(|i| Request {
                params: specd::sampler::SamplingParams {
                    temperature: 0.9,
                    seed: 11 + i,
                    ..Default::default()
                },
                ..Request::greedy(prompt.clone(), 40)
            })
            .collect()
    };
    let mut roomy = engine(&model, &tok, 0, 4);
    let want: Vec<Vec<u32>> = run_all(&mut roomy, reqs())
        .into_iter()
        .map(|c| c.tokens)
        .collect();
    // One block short of two choices' worth, so choices holding blocks
    // are evicted as others grow (choices that hold nothing yet are
    // never evicted: that frees nothing; at two choices' worth nothing
    // else is, 0 preemptions).
    let kv = prompt.len().div_ceil(64) * 2 - 1;
    let mut small = engine_with_kv(&model, &tok, 0, 4, Some(kv));
    let mut ids = Vec::new();
    for r in reqs() {
        // Choices after the first fork the first one's prompt.
        let r = Request {
            fork_of: ids.first().copied(),
            ..r
        };
        ids.push(small.add(r, None).unwrap());
    }
    // After every step no choice holds more blocks than its committed
    // cache needs (a forked one may hold fewer: its prompt's blocks are
    // its parent's): nothing reserved for a copy it did not make (a
    // choice whose parent was evicted in the grant that reserved its
    // fork) stays held.
    let mut done = Vec::new();
    while !small.scheduler.is_idle() {
        done.extend(small.step().unwrap().finished);
        for &id in &ids {
            let cached = small.verifier.cache_len(id).unwrap_or(0);
            let held = small.kv.held_blocks(Pool::Target, id);
            assert!(
                held <= cached.div_ceil(64),
                "choice {id}: {held} blocks held for a committed cache of {cached} tokens"
            );
        }
    }
    done.sort_by_key(|c| ids.iter().position(|&i| i == c.id).unwrap());
    let preempted: u32 = done.iter().map(|c| c.preemptions).sum();
    eprintln!("{kv} blocks: {preempted} preemptions");
    let got: Vec<Vec<u32>> = done.into_iter().map(|c| c.tokens).collect();
    assert_eq!(got, want);
    assert!(preempted > 0, "the budget must force preemptions");
}
