//! Fair scheduling on the engine's own driver: a request arriving behind a
//! large batch reaches its first token within a few steps (first come,
//! first served, the control, takes tens), a better priority goes first,
//! and the preemptions fairness adds change no output (greedy with
//! speculation, seeded sampling).

use specd_test_kit as common;

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::{OracleProposer, TempDir, TINY};
use specd::model::{load_model, Model};
use specd::plain::generate;
use specd::sampler::SamplingParams;
use specd::speculative::drafter::Drafter;
use specd::speculative::driver::{EngineConfig, SyncDriver};
use specd::speculative::fairness::Scheduling;
use specd::speculative::kv_manager::Pool;
use specd::speculative::proposer::Proposer;
use specd::speculative::{Completion, Event, Request, SeqId};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

fn tiny_model() -> (TempDir, Arc<Model>) {
    let dir = TempDir::new("fairness");
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, &TINY, 11, GgmlDType::Q4_1, "llama");
    let m = Arc::new(load_model(&path, 2).unwrap());
    (dir, m)
}

/// Four slots, 64 tokens a step: a 200-token prompt takes four steps of
/// the whole budget.
fn engine(
    model: &Arc<Model>,
    scheduling: Scheduling,
    proposers: Vec<Box<dyn Proposer>>,
) -> SyncDriver {
    let mut cfg = EngineConfig::for_model(model);
    cfg.scheduler.max_running = 4;
    cfg.scheduler.max_batch_tokens = 64;
    cfg.scheduler.max_draft = 4;
    cfg.scheduler.max_waiting = usize::MAX;
    cfg.scheduler.adaptive_draft = false;
    cfg.scheduler.scheduling = scheduling;
    let mut d = Drafter::new();
    for p in proposers {
        d.add(p);
    }
    SyncDriver::new(model.clone(), None, cfg, d)
}

fn prompt(seed: u64, len: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|i| 3 + ((i * 31 + seed * 17 + i * i * seed) % 90) as u32)
        .collect()
}

/// A large request: 12 prompts of 200 tokens in one group.
fn big_batch(e: &mut SyncDriver, proto: &Request) -> Vec<(SeqId, UnboundedReceiver<Event>)> {
    let mut out = Vec::new();
    let mut group = None;
    for i in 0..12 {
        let (tx, rx) = unbounded_channel();
        let r = Request {
            group,
            ..Request {
                prompt: prompt(i, 200),
                ..proto.clone()
            }
        };
        let id = e.add(r, Some(tx)).unwrap();
        group.get_or_insert(id);
        out.push((id, rx));
    }
    out
}

fn first_token(rx: &mut UnboundedReceiver<Event>) -> bool {
    while let Ok(ev) = rx.try_recv() {
        if matches!(ev, Event::Tokens { ref ids, .. } if !ids.is_empty()) {
            return true;
        }
    }
    false
}

/// Steps until the small request (added after two steps of the big batch)
/// has its first token, and every completion (by id).
fn small_behind_big(
    model: &Arc<Model>,
    scheduling: Scheduling,
    proto: &Request,
    small_priority: i32,
    proposers: Vec<Box<dyn Proposer>>,
) -> (usize, Vec<Completion>, SeqId) {
    let mut e = engine(model, scheduling, proposers);
    let _big = big_batch(&mut e, proto);
    let mut done = Vec::new();
    for _ in 0..2 {
        done.extend(e.step().unwrap().finished);
    }
    let (tx, mut rx) = unbounded_channel();
    let small = Request {
        prompt: prompt(99, 6),
        priority: small_priority,
        ..proto.clone()
    };
    let id = e.add(small, Some(tx)).unwrap();
    let mut steps = 0;
    loop {
        done.extend(e.step().unwrap().finished);
        steps += 1;
        if first_token(&mut rx) || steps > 500 {
            break;
        }
    }
    done.extend(e.run_to_completion().unwrap());
    assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
    done.sort_by_key(|c| c.id);
    (steps, done, id)
}

fn greedy(max_tokens: usize) -> Request {
    Request {
        ignore_eos: true,
        ..Request::greedy(Vec::new(), max_tokens)
    }
}

/// The case in small: one request with 12 long prompts holds every
/// slot; a small request arriving after it gets a slot at the next step
/// (one of the large request's sequences is preempted), and its whole
/// prompt and first token in that step: one step. First come, first
/// served makes it wait for all twelve prefills. Outputs are the same
/// either way, and equal to plain decoding.
#[test]
fn a_small_request_behind_a_large_batch_gets_its_first_token_in_one_step() {
    let (_d, model) = tiny_model();
    let proto = greedy(8);
    let (fair_steps, fair, small) = small_behind_big(&model, Scheduling::Fair, &proto, 0, vec![]);
    let (fcfs_steps, fcfs, _) = small_behind_big(&model, Scheduling::Fcfs, &proto, 0, vec![]);
    eprintln!("first token of the small request: fair {fair_steps} steps, fcfs {fcfs_steps}");
    assert_eq!(fair_steps, 1, "fair: {fair_steps} steps");
    // The control: 12 x 200 prompt tokens at 64 a step come first.
    assert!(fcfs_steps >= 30, "fcfs: {fcfs_steps} steps");
    let preempted: u32 = fair.iter().map(|c| c.preemptions).sum();
    assert!(preempted >= 1, "the small request took a slot");
    assert_eq!(fcfs.iter().map(|c| c.preemptions).sum::<u32>(), 0);
    assert_eq!(fair.len(), 13);
    for (a, b) in fair.iter().zip(&fcfs) {
        assert_eq!(a.tokens, b.tokens, "sequence {}", a.id);
        let p = if a.id == small {
            prompt(99, 6)
        } else {
            prompt(a.id - 1, 200)
        };
        let plain = generate(
            &model,
            None,
            &Request {
                prompt: p,
                ..greedy(8)
            },
            |_| {},
        )
        .unwrap()
        .tokens;
        assert_eq!(a.tokens, plain, "sequence {}", a.id);
    }
}

/// Under speculation (an oracle proposer that drafts right 70% of the
/// time), the preempted and recomputed sequences still give plain
/// decoding's greedy tokens.
#[test]
fn fairness_preemption_keeps_greedy_speculation_exact() {
    let (_d, model) = tiny_model();
    let mut answers = Vec::new();
    for p in (0..12).map(|i| prompt(i, 200)).chain([prompt(99, 6)]) {
        let a = generate(
            &model,
            None,
            &Request {
                prompt: p.clone(),
                ..greedy(24)
            },
            |_| {},
        )
        .unwrap()
        .tokens;
        answers.push((p, a));
    }
    let oracle = Box::new(OracleProposer::new(
        answers.clone(),
        0.3,
        4,
        TINY.vocab as u32,
    ));
    let proto = Request {
        proposer: Some("oracle".into()),
        ..greedy(24)
    };
    let (steps, done, small) = small_behind_big(&model, Scheduling::Fair, &proto, 0, vec![oracle]);
    assert_eq!(steps, 1, "{steps} steps");
    assert!(done.iter().map(|c| c.preemptions).sum::<u32>() >= 1);
    assert!(done.iter().map(|c| c.stats.drafted).sum::<u64>() > 0);
    for c in &done {
        let i = if c.id == small {
            12
        } else {
            (c.id - 1) as usize
        };
        assert_eq!(c.tokens, answers[i].1, "sequence {}", c.id);
    }
}

/// Seeded sampling: each sequence's random stream survives its preemption
/// (the sampler state stays; the cache is recomputed), so fair scheduling
/// draws exactly the tokens first come, first served draws.
#[test]
fn fairness_preemption_keeps_seeded_sampling_identical() {
    let (_d, model) = tiny_model();
    let proto = Request {
        params: SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed: 1234,
            ..Default::default()
        },
        ignore_eos: true,
        ..Request::greedy(Vec::new(), 16)
    };
    let (_, fair, _) = small_behind_big(&model, Scheduling::Fair, &proto, 0, vec![]);
    let (_, fcfs, _) = small_behind_big(&model, Scheduling::Fcfs, &proto, 0, vec![]);
    assert!(fair.iter().map(|c| c.preemptions).sum::<u32>() >= 1);
    for (a, b) in fair.iter().zip(&fcfs) {
        assert_eq!(a.tokens, b.tokens, "sequence {}", a.id);
    }
    // Not a constant stream: the sequences differ from each other.
    assert!(fair.windows(2).any(|w| w[0].tokens != w[1].tokens));
}

/// A better priority (lower number) takes a slot from the worst running
/// sequence and its prompt's prefill goes first, even from a request that
/// already holds slots; a worse one waits its turn.
#[test]
fn a_better_priority_goes_first_and_a_worse_one_waits() {
    let (_d, model) = tiny_model();
    let proto = Request {
        priority: 3,
        ..greedy(8)
    };
    let (urgent, done, _) = small_behind_big(&model, Scheduling::Fair, &proto, -1, vec![]);
    assert_eq!(urgent, 1, "priority -1 behind priority 3: {urgent} steps");
    assert!(done.iter().map(|c| c.preemptions).sum::<u32>() >= 1);
    // The same request at a worse priority than the batch waits for it.
    let proto = Request {
        priority: -1,
        ..greedy(8)
    };
    let (patient, done, _) = small_behind_big(&model, Scheduling::Fair, &proto, 3, vec![]);
    assert!(
        patient >= 30,
        "priority 3 behind priority -1: {patient} steps"
    );
    assert_eq!(done.iter().map(|c| c.preemptions).sum::<u32>(), 0);
}

/// Two large requests side by side share the slots and the prefill budget
/// instead of the first taking everything: the second's first prompt
/// finishes its prefill long before the first request's last one.
#[test]
fn two_large_requests_share_slots_and_prefill() {
    let (_d, model) = tiny_model();
    let mut e = engine(&model, Scheduling::Fair, vec![]);
    let proto = greedy(4);
    let a = big_batch(&mut e, &proto);
    let b = big_batch(&mut e, &proto);
    let (mut first_a, mut first_b) = (None, None);
    let (mut rxa, mut rxb): (Vec<_>, Vec<_>) = (
        a.into_iter().map(|x| x.1).collect(),
        b.into_iter().map(|x| x.1).collect(),
    );
    let mut step = 0usize;
    while !e.scheduler.is_idle() {
        e.step().unwrap();
        step += 1;
        if first_a.is_none() && rxa.iter_mut().any(first_token) {
            first_a = Some(step);
        }
        if first_b.is_none() && rxb.iter_mut().any(first_token) {
            first_b = Some(step);
        }
    }
    let (fa, fb) = (first_a.unwrap(), first_b.unwrap());
    eprintln!("first tokens: request A at step {fa}, request B at step {fb}, all done at {step}");
    // Both get two of the four slots and half the budget: their first
    // prompts finish within a step of each other.
    assert!(fa.abs_diff(fb) <= 1, "A {fa}, B {fb}");
    assert!(fb < step / 3, "B {fb} of {step}");
}

/// Prompt blocks the prefix cache holds cost no prefill budget. Three
/// requests sharing a three-block prefix with one that ran before arrive
/// together: each takes the cached blocks in its first step and reaches
/// its first token within three steps, however the 64-token budget is
/// shared among them (pieces of a shared budget are shorter than a block,
/// and the cache used to be found only a block at a time from a chunk's
/// own tokens, so it never hit here). Outputs equal those without the
/// cache, which needs about four times the steps.
#[test]
fn cached_prompt_blocks_are_taken_whole_under_a_shared_prefill_budget() {
    let (_d, model) = tiny_model();
    let shared = prompt(5, 192);
    let with_tail = |seed: u64| {
        let mut p = shared.clone();
        p.extend(prompt(seed, 30));
        p
    };
    let run = |prefix_blocks: usize| {
        let mut cfg = EngineConfig::for_model(&model);
        cfg.scheduler.max_running = 4;
        cfg.scheduler.max_batch_tokens = 64;
        cfg.scheduler.max_waiting = usize::MAX;
        cfg.prefix_cache_blocks = prefix_blocks;
        let mut e = SyncDriver::new(model.clone(), None, cfg, Drafter::new());
        // The first request puts the shared blocks in the cache.
        e.add(
            Request {
                prompt: with_tail(1),
                ..greedy(8)
            },
            None,
        )
        .unwrap();
        e.run_to_completion().unwrap();
        let mut rxs = Vec::new();
        for seed in 2..5 {
            let (tx, rx) = unbounded_channel();
            let r = Request {
                prompt: with_tail(seed),
                ..greedy(8)
            };
            e.add(r, Some(tx)).unwrap();
            rxs.push(rx);
        }
        let mut first = [None; 3];
        let mut done = Vec::new();
        let mut steps = 0;
        while first.iter().any(Option::is_none) && steps < 200 {
            done.extend(e.step().unwrap().finished);
            steps += 1;
            for (f, rx) in first.iter_mut().zip(&mut rxs) {
                if f.is_none() && first_token(rx) {
                    *f = Some(steps);
                }
            }
        }
        done.extend(e.run_to_completion().unwrap());
        done.sort_by_key(|c| c.id);
        let tokens: Vec<Vec<u32>> = done.into_iter().map(|c| c.tokens).collect();
        let first: Vec<usize> = first.iter().map(|f| f.unwrap()).collect();
        (first, tokens, e.verifier.prefix_stats().1)
    };
    let (cold_first, cold, cold_hit) = run(0);
    let (warm_first, warm, warm_hit) = run(64);
    eprintln!(
        "first tokens at steps {warm_first:?} with the cache ({warm_hit} tokens from it), \
         {cold_first:?} without"
    );
    assert_eq!(warm, cold, "the cache changes no output");
    assert_eq!(cold_hit, 0);
    assert!(
        warm_hit >= 3 * 192,
        "each request found the three shared blocks"
    );
    assert!(warm_first.iter().all(|&s| s <= 3), "{warm_first:?}");
    assert!(cold_first.iter().all(|&s| s >= 8), "{cold_first:?}");
}

/// A request whose prompt the prefix cache holds up to its last 30 tokens
/// takes the cached blocks, computes the rest and feeds its last token in
/// one step: its first token comes from its first step (it used to come a
/// step later). With a chain proposer and a tree proposer drafting in that
/// step too, outputs are plain decoding's, and each follower found the
/// three shared blocks.
#[test]
fn a_cache_hit_brings_the_first_token_in_the_same_step() {
    let (_d, model) = tiny_model();
    let shared = prompt(5, 192);
    let with_tail = |seed: u64| {
        let mut p = shared.clone();
        p.extend(prompt(seed, 30));
        p
    };
    let answers: Vec<(Vec<u32>, Vec<u32>)> = (1..5)
        .map(|seed| {
            let p = with_tail(seed);
            let a = generate(
                &model,
                None,
                &Request {
                    prompt: p.clone(),
                    ..greedy(12)
                },
                |_| {},
            )
            .unwrap()
            .tokens;
            (p, a)
        })
        .collect();
    for proposer in ["none", "oracle", "tree"] {
        let mut cfg = EngineConfig::for_model(&model);
        cfg.scheduler.max_batch_tokens = 64;
        cfg.scheduler.max_draft = 4;
        cfg.scheduler.adaptive_draft = false;
        cfg.prefix_cache_blocks = 64;
        let mut d = Drafter::new();
        d.add(Box::new(OracleProposer::new(
            answers.clone(),
            0.3,
            4,
            TINY.vocab as u32,
        )));
        d.add(Box::new(common::TreeProposer::new(
            "tree",
            TINY.vocab,
            8,
            specd::speculative::proposer::SiblingMode::WithoutReplacement,
            common::TreeMode::Oracle {
                answers: answers.iter().cloned().collect(),
                error: 0.3,
            },
            3,
        )));
        let mut e = SyncDriver::new(model.clone(), None, cfg, d);
        let req = |i: usize| Request {
            prompt: answers[i].0.clone(),
            proposer: (proposer != "none").then(|| proposer.to_string()),
            ..greedy(12)
        };
        // The first request puts the shared blocks in the cache.
        e.add(req(0), None).unwrap();
        let mut done = e.run_to_completion().unwrap();
        for i in 1..4 {
            let (_, hit0) = e.verifier.prefix_stats();
            let (tx, mut rx) = unbounded_channel();
            e.add(req(i), Some(tx)).unwrap();
            done.extend(e.step().unwrap().finished);
            assert!(first_token(&mut rx), "{proposer}: follower {i}");
            done.extend(e.run_to_completion().unwrap());
            let (_, hit) = e.verifier.prefix_stats();
            assert!(
                hit - hit0 >= 192,
                "{proposer}: follower {i} hit {}",
                hit - hit0
            );
        }
        done.sort_by_key(|c| c.id);
        for (c, (_, a)) in done.iter().zip(&answers) {
            assert_eq!(&c.tokens, a, "{proposer}: request {}", c.id);
        }
        if proposer != "none" {
            assert!(done.iter().map(|c| c.stats.drafted).sum::<u64>() > 0);
        }
        assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
    }
}

/// Blocks a step plans to take from the prefix cache are not evicted
/// under it. The cache is over its capacity (1 entry) while a request
/// holds its three prompt blocks; it finishes in the step before another
/// request sharing two of them arrives. The step that plans the newcomer
/// with the two blocks free also releases the first request, the only
/// holder: the cache used to trim there, before the newcomer took them,
/// evicting one, which it then computed again over the step's budget.
#[test]
fn planned_cache_blocks_survive_their_last_holder_ending_in_that_step() {
    let (_d, model) = tiny_model();
    let shared = prompt(5, 128);
    let with_tail = |seed: u64| {
        let mut p = shared.clone();
        p.extend(prompt(seed, 70));
        p
    };
    let mut cfg = EngineConfig::for_model(&model);
    cfg.scheduler.max_batch_tokens = 64;
    cfg.prefix_cache_blocks = 1;
    let mut e = SyncDriver::new(model.clone(), None, cfg, Drafter::new());
    e.add(
        Request {
            prompt: with_tail(1),
            ..greedy(4)
        },
        None,
    )
    .unwrap();
    let mut steps = 0;
    while e.step().unwrap().finished.is_empty() {
        steps += 1;
        assert!(steps < 100);
    }
    assert!(
        e.verifier.prefix_cached_blocks() > 2,
        "over capacity while held"
    );
    let (_, hit0) = e.verifier.prefix_stats();
    let b = with_tail(2);
    e.add(
        Request {
            prompt: b.clone(),
            ..greedy(4)
        },
        None,
    )
    .unwrap();
    e.step().unwrap();
    let (_, hit) = e.verifier.prefix_stats();
    assert_eq!(hit - hit0, 128, "the two planned blocks were taken");
    let done = e.run_to_completion().unwrap();
    let want = generate(
        &model,
        None,
        &Request {
            prompt: b,
            ..greedy(4)
        },
        |_| {},
    )
    .unwrap()
    .tokens;
    assert_eq!(done[0].tokens, want);
    // Trimmed once nothing holds the blocks.
    assert!(e.verifier.prefix_cached_blocks() <= 1);
    assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
}

/// While no other request decodes, a batch request's prompts take ever
/// larger chunks (the prefill cap doubles each quiet step up to the whole
/// batch budget); once a chat decodes beside it, every step is back at
/// `max_prefill_tokens`, so the chat's time per output token stays bounded.
/// Outputs are plain decoding's either way.
#[test]
fn the_prefill_cap_opens_while_no_other_request_decodes() {
    let (_d, model) = tiny_model();
    let mut e = engine(&model, Scheduling::Fair, vec![]);
    e.scheduler.config.max_batch_tokens = 256;
    e.scheduler.config.max_prefill_tokens = 32;
    // Short answers: batch prompts keep arriving in the slots.
    let proto = greedy(2);
    let _big = big_batch(&mut e, &proto);
    // Prompt tokens per step (no proposer: a decoding sequence feeds one).
    let prefilled = |r: &specd::speculative::pipeline::StepReport| r.batch_tokens - r.decode_seqs;
    let mut alone = Vec::new();
    let mut done = Vec::new();
    for _ in 0..4 {
        let r = e.step().unwrap();
        alone.push(prefilled(&r));
        done.extend(r.finished);
    }
    // Each step's cap, less a token per sequence whose last prompt token
    // rode as its first decode (a prompt that ends in the step).
    for (n, cap) in alone.iter().zip([32, 64, 128, 256]) {
        assert!(
            *n <= cap && *n + 4 >= cap,
            "chunks of the batch alone: {alone:?}"
        );
    }
    let (tx, mut rx) = unbounded_channel();
    let chat = e
        .add(
            Request {
                prompt: prompt(99, 6),
                ..greedy(48)
            },
            Some(tx),
        )
        .unwrap();
    let mut steps = 0;
    while !first_token(&mut rx) {
        done.extend(e.step().unwrap().finished);
        steps += 1;
        assert!(steps < 10, "the chat never started");
    }
    // The chat decodes: the batch's chunks are back at the cap.
    let mut beside = Vec::new();
    for _ in 0..20 {
        let r = e.step().unwrap();
        beside.push(prefilled(&r));
        done.extend(r.finished);
    }
    assert!(beside.iter().all(|&n| n <= 32), "{beside:?}");
    assert!(beside.iter().any(|&n| n > 0), "{beside:?}");
    done.extend(e.run_to_completion().unwrap());
    assert_eq!(done.len(), 13);
    for c in &done {
        let p = if c.id == chat {
            prompt(99, 6)
        } else {
            prompt(c.id - 1, 200)
        };
        let plain = generate(
            &model,
            None,
            &Request {
                prompt: p,
                ..greedy(if c.id == chat { 48 } else { 2 })
            },
            |_| {},
        )
        .unwrap()
        .tokens;
        assert_eq!(c.tokens, plain, "sequence {}", c.id);
    }
}

/// Under KV pressure the worse priority gives its blocks up: a sequence
/// of priority 3 decodes, holding two of the three blocks, when one of
/// priority -1 arrives whose prompt needs two; the better priority's
/// prefill is granted first and the worse sequence is evicted (it used to
/// be granted after every decode: deferred, then evicted itself when the
/// worse one grew), it is never preempted and finishes first, and both
/// outputs equal plain decoding.
#[test]
fn kv_pressure_preempts_the_worse_priority_first() {
    let (_d, model) = tiny_model();
    let mut cfg = EngineConfig::for_model(&model);
    cfg.scheduler.max_running = 4;
    cfg.scheduler.max_batch_tokens = 64;
    cfg.scheduler.max_waiting = usize::MAX;
    cfg.scheduler.scheduling = Scheduling::Fair;
    // Blocks of 64 tokens: the worse sequence grows to 140 tokens (three
    // blocks), the better one needs two.
    cfg.kv_blocks = 3;
    cfg.prefix_cache_blocks = 0;
    let mut e = SyncDriver::new(model.clone(), None, cfg, Drafter::new());
    let req = |seed: u64, len: usize, max: usize, priority: i32| Request {
        priority,
        ..Request {
            prompt: prompt(seed, len),
            ..greedy(max)
        }
    };
    let (a, b) = (req(1, 20, 120, 3), req(2, 100, 20, -1));
    let worse = e.add(a.clone(), None).unwrap();
    for _ in 0..50 {
        e.step().unwrap();
    }
    let better = e.add(b.clone(), None).unwrap();
    let mut done = Vec::new();
    while !e.scheduler.is_idle() {
        done.extend(e.step().unwrap().finished);
    }
    let by = |id: SeqId| done.iter().find(|c| c.id == id).unwrap();
    assert_eq!(by(better).preemptions, 0, "the better priority was evicted");
    assert!(by(worse).preemptions >= 1, "the worse one kept its blocks");
    assert_eq!(
        done[0].id, better,
        "the better priority waited for the worse one's blocks"
    );
    for (id, r) in [(worse, a), (better, b)] {
        let want = generate(&model, None, &r, |_| {}).unwrap();
        assert_eq!(by(id).tokens, want.tokens);
    }
    assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
}

/// A new prompt waits for KV rather than evict an older prompt of its
/// priority whose prefill is under way: with a decoder holding one of four
/// blocks, a 180-token prompt prefilling 16 tokens a step comes to hold
/// the other three; a short prompt that arrives then fits whole, so it is
/// planned before the long one, and used to evict it (the long prompt
/// started again from nothing, and would again at each such arrival). It
/// now waits; nothing is preempted and every output equals plain decoding.
#[test]
fn a_new_prompt_does_not_evict_an_older_prompts_prefill() {
    let (_d, model) = tiny_model();
    let mut cfg = EngineConfig::for_model(&model);
    cfg.scheduler.max_running = 4;
    cfg.scheduler.max_batch_tokens = 64;
    cfg.scheduler.max_prefill_tokens = 16;
    cfg.scheduler.max_waiting = usize::MAX;
    cfg.scheduler.scheduling = Scheduling::Fair;
    cfg.kv_blocks = 4;
    cfg.prefix_cache_blocks = 0;
    let mut e = SyncDriver::new(model.clone(), None, cfg, Drafter::new());
    let decoder = Request {
        prompt: prompt(1, 8),
        ..greedy(50)
    };
    let long = Request {
        prompt: prompt(2, 180),
        ..greedy(4)
    };
    let short = Request {
        prompt: prompt(3, 8),
        ..greedy(4)
    };
    let d = e.add(decoder.clone(), None).unwrap();
    e.step().unwrap();
    let l = e.add(long.clone(), None).unwrap();
    let mut done = Vec::new();
    let mut steps = 0;
    while e.kv.held_blocks(Pool::Target, l) < 3 {
        done.extend(e.step().unwrap().finished);
        steps += 1;
        assert!(steps < 40, "the long prompt never held three blocks");
    }
    assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 4);
    let s = e.add(short.clone(), None).unwrap();
    while !e.scheduler.is_idle() {
        done.extend(e.step().unwrap().finished);
    }
    let by = |id: SeqId| done.iter().find(|c| c.id == id).unwrap();
    assert_eq!(by(l).preemptions, 0, "the new prompt evicted the older one");
    for (id, r) in [(d, decoder), (l, long), (s, short)] {
        assert_eq!(by(id).preemptions, 0, "sequence {id}");
        let want = generate(&model, None, &r, |_| {}).unwrap();
        assert_eq!(by(id).tokens, want.tokens, "sequence {id}");
    }
    assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
}

#[test]
fn drafting_decoders_leave_a_prefilling_prompt_a_floor_of_the_budget() {
    // Seven decoders drafting 8 tokens each fill 63 of a 64-token step;
    // decodes are planned first, so a new prompt would get one token a
    // step. Drafts leave it an eighth of the budget while it prefills.
    let (_d, model) = tiny_model();
    let mut cfg = EngineConfig::for_model(&model);
    cfg.scheduler.max_running = 8;
    cfg.scheduler.max_batch_tokens = 64;
    cfg.scheduler.max_draft = 8;
    cfg.scheduler.max_waiting = usize::MAX;
    cfg.scheduler.adaptive_draft = false;
    let mut d = Drafter::new();
    d.add(Box::new(common::RandomProposer::new(TINY.vocab, 8, 3)));
    let mut e = SyncDriver::new(model.clone(), None, cfg, d);
    for i in 0..7 {
        let r = Request {
            proposer: Some("random".into()),
            ignore_eos: true,
            ..Request::greedy(prompt(i, 8), 200)
        };
        e.add(r, None).unwrap();
    }
    // Every decoder past its prefill and drafting.
    for _ in 0..4 {
        e.step().unwrap();
    }
    let (tx, mut rx) = unbounded_channel();
    let late = Request {
        prompt: prompt(99, 96),
        ..greedy(4)
    };
    e.add(late, Some(tx)).unwrap();
    let mut steps = 0;
    while !first_token(&mut rx) {
        e.step().unwrap();
        steps += 1;
        assert!(
            steps <= 20,
            "the prompt's first token took over {steps} steps"
        );
    }
}
