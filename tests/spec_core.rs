//! The speculative core: losslessness (greedy exactness, sampled
//! distributions), stops inside accepted runs, cancellation, preemption,
//! failing proposers, and the actor pipeline.

use specd_test_kit as common;

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::{
    LyingProposer, OracleProposer, PanickyProposer, RandomProposer, TempDir, TinySpec, TINY,
};
use specd::model::{load_model, Model};
use specd::plain::generate;
use specd::sampler::{FinishReason, SamplingParams};
use specd::speculative::accept::Acceptance;
use specd::speculative::drafter::Drafter;
use specd::speculative::driver::{EngineConfig, SyncDriver};
use specd::speculative::fairness::Scheduling;
use specd::speculative::kv_manager::Pool;
use specd::speculative::proposer::Proposer;
use specd::speculative::{Completion, Request};
use specd::tokenizer::Tokenizer;

/// Tests whose assertions read measured step times (prices learned from
/// them) run with the CPU to themselves: each takes this lock for
/// writing, every other test for reading, so no test of this binary loads
/// the machine while they time steps (cargo runs test binaries one at a
/// time). A panicking test's poison is ignored.
static CPU: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    CPU.read().unwrap_or_else(|e| e.into_inner())
}

fn alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    CPU.write().unwrap_or_else(|e| e.into_inner())
}

fn tiny_model(spec: &TinySpec, seed: u64) -> (TempDir, Arc<Model>) {
    let dir = TempDir::new(&format!("spec-{seed}-{}", spec.vocab));
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, spec, seed, GgmlDType::Q4_1, "llama");
    let m = Arc::new(load_model(&path, 2).unwrap());
    (dir, m)
}

fn engine(
    model: &Arc<Model>,
    tok: Option<Arc<Tokenizer>>,
    proposers: Vec<Box<dyn Proposer>>,
    max_running: usize,
    kv_blocks: Option<usize>,
) -> SyncDriver {
    let mut cfg = EngineConfig::for_model(model);
    cfg.scheduler.max_running = max_running;
    cfg.scheduler.max_draft = 8;
    cfg.scheduler.max_waiting = usize::MAX;
    // These tests exercise drafting itself: always draft the cap.
    cfg.scheduler.adaptive_draft = false;
    if let Some(b) = kv_blocks {
        cfg.kv_blocks = b;
    }
    let mut d = Drafter::new();
    for p in proposers {
        d.add(p);
    }
    SyncDriver::new(model.clone(), tok, cfg, d)
}

fn plain(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    generate(model, None, &Request::greedy(prompt.to_vec(), n), |_| {})
        .unwrap()
        .tokens
}

fn plain_no_eos(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut r = Request::greedy(prompt.to_vec(), n);
    r.ignore_eos = true;
    generate(model, None, &r, |_| {}).unwrap().tokens
}

fn run_all(e: &mut SyncDriver, reqs: Vec<Request>) -> Vec<Completion> {
    let ids: Vec<u64> = reqs.into_iter().map(|r| e.add(r, None).unwrap()).collect();
    let mut done = e.run_to_completion().unwrap();
    done.sort_by_key(|c| ids.iter().position(|&i| i == c.id).unwrap());
    done
}

fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    vec![
        vec![5, 9, 13, 21, 34],
        vec![7 % vocab, 7 % vocab, 8, 9, 10, 11, 12, 13, 14, 3],
        vec![40 % vocab, 41 % vocab, 42 % vocab],
        (0..70).map(|i| (i * 7 % (vocab - 4)) + 3).collect(),
    ]
}

#[test]
fn greedy_oracle_is_lossless_on_the_tiny_model_in_a_concurrent_batch() {
    let _cpu = shared();
    let (_d, model) = tiny_model(&TINY, 5);
    let n = 40;
    let ps = prompts(TINY.vocab as u32);
    let want: Vec<Vec<u32>> = ps.iter().map(|p| plain(&model, p, n)).collect();
    let answers: Vec<(Vec<u32>, Vec<u32>)> = ps.iter().cloned().zip(want.iter().cloned()).collect();
    let mut mals = Vec::new();
    for rate in [0.0, 0.3, 1.0] {
        let oracle = OracleProposer::new(answers.clone(), rate, 6, TINY.vocab as u32);
        let mut e = engine(&model, None, vec![Box::new(oracle)], 4, None);
        let reqs = oracle_requests(&ps, n);
        let done = run_all(&mut e, reqs);
        for (c, w) in done.iter().zip(&want) {
            assert_eq!(
                &c.tokens, w,
                "error rate {rate}: speculative output differs from plain decoding"
            );
        }
        let steps: u64 = done.iter().map(|c| c.stats.verify_steps).sum();
        let acc: u64 = done.iter().map(|c| c.stats.accepted).sum();
        mals.push((acc + steps) as f64 / steps as f64);
        assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
        assert_eq!(e.verifier.num_caches(), 0);
    }
    // Perfect drafts are accepted in long runs; always-wrong drafts never.
    assert!(mals[0] > 4.0, "{mals:?}");
    assert!(mals[0] > mals[1] && mals[1] > mals[2], "{mals:?}");
    assert!((mals[2] - 1.0).abs() < 1e-9, "{mals:?}");
}

/// `stop_token_ids` end a sequence where plain decoding ends it, also
/// inside a run of accepted drafts (perfect oracle drafts), without the
/// stop token, with finish `stop`; `ignore_eos` does not keep them.
#[test]
fn stop_token_ids_end_speculative_and_plain_decoding_alike() {
    let _cpu = shared();
    let (_d, model) = tiny_model(&TINY, 5);
    let n = 40;
    let ps = prompts(TINY.vocab as u32);
    let want: Vec<Vec<u32>> = ps.iter().map(|p| plain_no_eos(&model, p, n)).collect();
    let answers: Vec<(Vec<u32>, Vec<u32>)> = ps.iter().cloned().zip(want.iter().cloned()).collect();
    let oracle = OracleProposer::new(answers, 0.0, 6, TINY.vocab as u32);
    let mut e = engine(&model, None, vec![Box::new(oracle)], 4, None);
    // Each request stops at the token its output has at position 12.
    let stops: Vec<u32> = want.iter().map(|w| w[12]).collect();
    let reqs: Vec<Request> = oracle_requests(&ps, n)
        .into_iter()
        .zip(&stops)
        .map(|(r, &t)| Request {
            ignore_eos: true,
            stop_token_ids: vec![t],
            ..r
        })
        .collect();
    let done = run_all(&mut e, reqs.clone());
    for ((c, r), w) in done.iter().zip(&reqs).zip(&want) {
        let at = w.iter().position(|&t| t == r.stop_token_ids[0]).unwrap();
        assert!(at <= 12);
        assert_eq!(c.tokens, w[..at], "speculative");
        assert_eq!(c.finish, FinishReason::Stop);
        let g = generate(&model, None, r, |_| {}).unwrap();
        assert_eq!(g.tokens, w[..at], "plain");
        assert_eq!(g.finish, FinishReason::Stop);
    }
    let accepted: u64 = done.iter().map(|c| c.stats.accepted).sum();
    assert!(
        accepted > 0,
        "no drafts were accepted: nothing ran inside a run"
    );
}

/// Greedy requests of `n` tokens for `ps`, drafted by the oracle.
fn oracle_requests(ps: &[Vec<u32>], n: usize) -> Vec<Request> {
    ps.iter()
        .map(|p| Request {
            proposer: Some("oracle".into()),
            ..Request::greedy(p.clone(), n)
        })
        .collect()
}

/// SmolLM2 and its tokenizer.
fn smollm() -> (Arc<Model>, Arc<Tokenizer>) {
    let path = common::smollm_path();
    (
        Arc::new(load_model(&path, 2).unwrap()),
        Arc::new(Tokenizer::for_model(&path).unwrap()),
    )
}

/// SmolLM2, its tokenizer, `texts` encoded, their `n`-token plain greedy
/// continuations, and (prompt, continuation) pairs for an oracle.
#[allow(clippy::type_complexity)]
fn smollm_answers(
    texts: &[&str],
    n: usize,
) -> (
    Arc<Model>,
    Arc<Tokenizer>,
    Vec<Vec<u32>>,
    Vec<Vec<u32>>,
    Vec<(Vec<u32>, Vec<u32>)>,
) {
    let (model, tok) = smollm();
    let ps: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tok.encode(t, false).unwrap())
        .collect();
    let want: Vec<Vec<u32>> = ps.iter().map(|p| plain(&model, p, n)).collect();
    let answers = ps.iter().cloned().zip(want.iter().cloned()).collect();
    (model, tok, ps, want, answers)
}

#[test]
fn greedy_oracle_is_lossless_on_smollm2_in_a_concurrent_batch() {
    let _cpu = shared();
    let n = 32;
    let (model, tok, ps, want, answers) = smollm_answers(
        &[
            "def fibonacci(n):",
            "The three primary colors are",
            "<|im_start|>user\nList three fruits.<|im_end|>\n<|im_start|>assistant\n",
        ],
        n,
    );
    for rate in [0.0, 0.3, 1.0] {
        let oracle = OracleProposer::new(answers.clone(), rate, 5, model.config.vocab_size as u32);
        let mut e = engine(&model, Some(tok.clone()), vec![Box::new(oracle)], 3, None);
        let reqs = oracle_requests(&ps, n);
        let done = run_all(&mut e, reqs);
        for (c, w) in done.iter().zip(&want) {
            assert_eq!(&c.tokens, w, "error rate {rate}");
            assert_eq!(c.text, tok.decode(w, false).unwrap());
        }
    }
}

/// Drafts priced from measured verify times (`draft_pricing =
/// "measured"`, the daemon's default): draft lengths now depend on timing,
/// outputs must not. A concurrent batch with the adaptive policy on stays
/// token for token equal to plain decoding, and the scheduler has learned
/// a finite, non-negative price.
#[test]
fn measured_draft_pricing_keeps_a_concurrent_batch_lossless() {
    let _cpu = shared();
    let n = 48;
    let (model, tok, ps, want, answers) = smollm_answers(
        &[
            "def fibonacci(n):",
            "The three primary colors are",
            "List: 1, 2, 3, 1, 2, 3, 1, 2, 3,",
            "Once upon a time",
        ],
        n,
    );
    let oracle = OracleProposer::new(answers, 0.3, 5, model.config.vocab_size as u32);
    let mut e = engine(&model, Some(tok.clone()), vec![Box::new(oracle)], 4, None);
    e.scheduler.config.adaptive_draft = true;
    e.scheduler.config.measured_pricing = true;
    let reqs = oracle_requests(&ps, n);
    let done = run_all(&mut e, reqs);
    for (c, w) in done.iter().zip(&want) {
        assert_eq!(&c.tokens, w);
    }
    assert!(done.iter().map(|c| c.stats.drafted).sum::<u64>() > 0);
    let price = e.scheduler.mean_draft_price().unwrap();
    assert!(price.is_finite() && price >= 0.0, "{price}");
}

/// A greedy request decoding alone is priced from measured verify times
/// too (its tokens are the argmax path however it is drafted): with a
/// prior price at which constants only probe (1.0 a drafted token against
/// drafts right 70% of the time), the measured price (a few tenths of a
/// forward on any machine) takes over once one- and two-token steps have
/// been seen, and the drafts run on. A sampled request alone drafting from
/// its proposer's own q keeps the constant at every step (a seeded one's
/// tokens must not depend on timing). Output is plain decoding's either
/// way.
#[test]
fn a_greedy_request_alone_drafts_at_measured_prices() {
    let _cpu = alone();
    let n = 64;
    let prior = 1.0;
    let (model, tok, ps, want, answers) = smollm_answers(
        &[
            "def fibonacci(n):",
            "The three primary colors are",
            "Once upon a time",
        ],
        n,
    );
    let engine_at = |measured: bool| {
        let oracle = OracleProposer::new(answers.clone(), 0.3, 4, model.config.vocab_size as u32);
        // One sequence at a time.
        let mut e = engine(&model, Some(tok.clone()), vec![Box::new(oracle)], 1, None);
        e.scheduler.config.adaptive_draft = true;
        e.scheduler.config.measured_pricing = measured;
        e.scheduler.config.draft_cost = prior;
        e
    };
    let run = |measured: bool| {
        let mut e = engine_at(measured);
        let done = run_all(&mut e, oracle_requests(&ps, n));
        for (c, w) in done.iter().zip(&want) {
            assert_eq!(&c.tokens, w, "measured pricing {measured}");
        }
        (
            done.iter().map(|c| c.stats.drafted).sum::<u64>(),
            e.scheduler.mean_draft_price().unwrap(),
        )
    };
    let ((fixed, fixed_price), (measured, measured_price)) = (run(false), run(true));
    assert_eq!(fixed_price, prior);
    assert!(
        measured_price < prior,
        "the measured price must replace the prior: {measured_price}"
    );
    assert!(
        measured >= 2 * fixed.max(10),
        "measured prices must let 70% drafts run: {measured} vs {fixed} at constants"
    );
    // Sampled and seeded, alone, measured pricing on, drafts drawn from a
    // real q (their rejections decide tokens): the prior at every step,
    // however many steps have been timed.
    let random = RandomProposer::new(model.config.vocab_size, 4, 5);
    let mut e = engine(&model, Some(tok.clone()), vec![Box::new(random)], 1, None);
    e.scheduler.config.adaptive_draft = true;
    e.scheduler.config.measured_pricing = true;
    e.scheduler.config.draft_cost = 0.05;
    let reqs: Vec<Request> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            params: SamplingParams {
                temperature: 1.0,
                seed: 11 + i as u64,
                ..SamplingParams::default()
            },
            proposer: Some("random".into()),
            ignore_eos: true,
            ..Request::greedy(p.clone(), n)
        })
        .collect();
    let done = run_all(&mut e, reqs);
    assert!(done.iter().all(|c| c.tokens.len() == n));
    assert!(done.iter().map(|c| c.stats.drafted).sum::<u64>() > 0);
    let price = e.scheduler.mean_draft_price().unwrap();
    assert!(
        (price - 0.05).abs() < 1e-9,
        "the prior at every step: {price}"
    );
}

/// One-hot drafts are verified by coupling (each position's token is p's
/// inverse CDF at that position's uniform, as plain decoding draws it), so
/// a seeded sampled request gives plain decoding's tokens for its seed
/// whatever is drafted: alone and in a batch, with drafts right 70% of the
/// time at lengths measured prices pick. Alone it now drafts at measured
/// prices too: its price falls below a prior at which constants only
/// probe.
#[test]
fn a_seeded_sampled_request_with_one_hot_drafts_gives_plain_decodings_tokens() {
    let _cpu = alone();
    let n = 48;
    let prior = 1.0;
    let (model, tok) = smollm();
    let ps: Vec<Vec<u32>> = [
        "def fibonacci(n):",
        "The three primary colors are",
        "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n",
    ]
    .iter()
    .map(|t| tok.encode(t, false).unwrap())
    .collect();
    let sampled = |p: &Vec<u32>, i: usize| Request {
        params: SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            seed: 7 + i as u64,
            ..SamplingParams::default()
        },
        ignore_eos: true,
        ..Request::greedy(p.clone(), n)
    };
    // Plain decoding, seeded: the tokens every run below must give.
    let want: Vec<Vec<u32>> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            generate(&model, None, &sampled(p, i), |_| {})
                .unwrap()
                .tokens
        })
        .collect();
    let answers: Vec<(Vec<u32>, Vec<u32>)> = ps.iter().cloned().zip(want.clone()).collect();
    for running in [1, 3] {
        let oracle = OracleProposer::new(answers.clone(), 0.3, 4, model.config.vocab_size as u32);
        let mut e = engine(
            &model,
            Some(tok.clone()),
            vec![Box::new(oracle)],
            running,
            None,
        );
        e.scheduler.config.adaptive_draft = true;
        e.scheduler.config.measured_pricing = true;
        e.scheduler.config.draft_cost = prior;
        let reqs: Vec<Request> = ps
            .iter()
            .enumerate()
            .map(|(i, p)| Request {
                proposer: Some("oracle".into()),
                ..sampled(p, i)
            })
            .collect();
        let done = run_all(&mut e, reqs);
        for (c, w) in done.iter().zip(&want) {
            assert_eq!(&c.tokens, w, "{running} running");
        }
        let drafted: u64 = done.iter().map(|c| c.stats.drafted).sum();
        let accepted: u64 = done.iter().map(|c| c.stats.accepted).sum();
        assert!(
            drafted > 0 && accepted > 0,
            "{drafted} drafted, {accepted} accepted"
        );
        if running == 1 {
            let price = e.scheduler.mean_draft_price().unwrap();
            assert!(
                price < prior,
                "alone, the measured price must replace the prior: {price}"
            );
        }
    }
}

/// A proposer's own drafting cost (`[[proposer]] token_cost`) joins the
/// verify price: the same drafts at 0.3 acceptance pay when drafting is
/// free, and stop (bar the policy's rare probes) when each drafted token
/// costs the proposer 0.4 of a target forward. Output is plain decoding's
/// either way.
#[test]
fn a_costly_proposer_stops_drafting_where_its_acceptance_does_not_pay() {
    let _cpu = shared();
    let n = 48;
    let (model, tok, ps, want, answers) =
        smollm_answers(&["def fibonacci(n):", "The three primary colors are"], n);
    let drafted = |token_cost: f64| {
        let oracle = OracleProposer::new(answers.clone(), 0.7, 4, model.config.vocab_size as u32);
        let p: Box<dyn Proposer> = Box::new(specd::speculative::proposer::Configured {
            inner: Box::new(oracle),
            token_cost: Some(token_cost),
            trust_q: true,
        });
        // One sequence at a time: the verify price is the configured 0.10.
        let mut e = engine(&model, Some(tok.clone()), vec![p], 1, None);
        e.scheduler.config.adaptive_draft = true;
        e.scheduler.config.draft_cost = 0.10;
        let done = run_all(&mut e, oracle_requests(&ps, n));
        for (c, w) in done.iter().zip(&want) {
            assert_eq!(&c.tokens, w);
        }
        done.iter().map(|c| c.stats.drafted).sum::<u64>()
    };
    let (free, costly) = (drafted(0.0), drafted(0.4));
    assert!(free >= 20, "free drafts must pay at 0.3 acceptance: {free}");
    assert!(
        costly * 4 <= free,
        "a costly proposer must mostly stop drafting: {costly} vs {free}"
    );
}

/// A proposer without a configured `token_cost` is priced by its measured
/// calls in a batch (`draft_pricing = "measured"`): the same drafts,
/// accepted 70% of the time, keep paying from a fast proposer and stop
/// (bar the first calls, which measure it, and rare probes) when every call
/// takes 100 ms, many target forwards. Output is plain decoding's either
/// way.
#[test]
fn a_slow_proposer_is_priced_by_its_measured_calls() {
    let _cpu = alone();
    let n = 48;
    let (model, tok, ps, want, answers) =
        smollm_answers(&["def fibonacci(n):", "The three primary colors are"], n);
    let drafted = |delay_ms: u64| {
        let oracle = OracleProposer::new(answers.clone(), 0.3, 4, model.config.vocab_size as u32)
            .with_delay(std::time::Duration::from_millis(delay_ms));
        // Both prompts decode together: a batch, whose prices are measured.
        let mut e = engine(&model, Some(tok.clone()), vec![Box::new(oracle)], 2, None);
        e.scheduler.config.adaptive_draft = true;
        e.scheduler.config.measured_pricing = true;
        e.scheduler.config.draft_cost = 0.10;
        let done = run_all(&mut e, oracle_requests(&ps, n));
        for (c, w) in done.iter().zip(&want) {
            assert_eq!(&c.tokens, w);
        }
        let own = e.scheduler.own_cost("oracle", 2).expect("measured");
        (done.iter().map(|c| c.stats.drafted).sum::<u64>(), own)
    };
    let ((fast, fast_cost), (slow, slow_cost)) = (drafted(0), drafted(100));
    assert!(
        fast_cost < 0.2,
        "a lookup costs next to nothing: {fast_cost}"
    );
    assert!(
        slow_cost > 1.0,
        "100 ms a call is many forwards: {slow_cost}"
    );
    assert!(fast >= 40, "free drafts at 0.7 acceptance pay: {fast}");
    assert!(
        slow * 4 <= fast,
        "a slow proposer must mostly stop drafting: {slow} vs {fast}"
    );
}

/// A costly proposer that is never right: once its acceptance estimate
/// has fallen, the policy only probes, and each rejected probe doubles the
/// wait before the next, so 96 more tokens cost it only a handful of drafts
/// (without the back-off, 11: one every 8 steps).
#[test]
fn rejected_probes_of_a_costly_proposer_back_off() {
    let _cpu = shared();
    let (model, tok, ps, _, answers) = smollm_answers(&["Once upon a time"], 160);
    let drafted = |n: usize| {
        let oracle = OracleProposer::new(answers.clone(), 1.0, 4, model.config.vocab_size as u32);
        // A small own cost: the probe interval stays the configured 8
        // steps (cost / draft_cost rounds to 1), only the back-off differs.
        let p: Box<dyn Proposer> = Box::new(specd::speculative::proposer::Configured {
            inner: Box::new(oracle),
            token_cost: Some(0.001),
            trust_q: true,
        });
        let mut e = engine(&model, Some(tok.clone()), vec![p], 1, None);
        e.scheduler.config.adaptive_draft = true;
        e.scheduler.config.draft_cost = 0.10;
        let mut reqs = oracle_requests(&ps, n);
        reqs[0].ignore_eos = true;
        let done = run_all(&mut e, reqs);
        assert_eq!(done[0].stats.accepted, 0);
        done[0].stats.drafted
    };
    let (early, late) = (drafted(64), drafted(160));
    assert!(early > 0, "the policy starts out drafting");
    assert!(
        late - early <= 5,
        "probes must back off: {} drafts in the last 96 tokens",
        late - early
    );
}

/// Counts of the first two tokens of `n` sampled requests (`shape` sets
/// their other fields); a second token that ended the output as a stop
/// token id is counted as that token.
fn sampled_pairs_of(
    model: &Arc<Model>,
    prompt: &[u32],
    params: &SamplingParams,
    n: usize,
    acceptance: Acceptance,
    shape: impl Fn(Request) -> Request,
) -> Vec<u64> {
    let v = model.config.vocab_size;
    let random = Box::new(RandomProposer::new(v, 3, 17));
    sampled_pairs_with(model, prompt, params, n, acceptance, random, shape)
}

/// `sampled_pairs_of` with `proposer` drafting.
fn sampled_pairs_with(
    model: &Arc<Model>,
    prompt: &[u32],
    params: &SamplingParams,
    n: usize,
    acceptance: Acceptance,
    proposer: Box<dyn Proposer>,
    shape: impl Fn(Request) -> Request,
) -> Vec<u64> {
    let v = model.config.vocab_size;
    let name = proposer.name().to_string();
    let mut e = engine(model, None, vec![proposer], 64, None);
    e.acceptor.acceptance = acceptance;
    let reqs: Vec<Request> = (0..n)
        .map(|i| {
            shape(Request {
                params: SamplingParams {
                    seed: 1000 + i as u64,
                    ..params.clone()
                },
                proposer: Some(name.clone()),
                ignore_eos: true,
                ..Request::greedy(prompt.to_vec(), 3)
            })
        })
        .collect();
    let stop_ids = reqs[0].stop_token_ids.clone();
    let done = run_all(&mut e, reqs);
    let mut counts = vec![0u64; v * v];
    let mut drafted = 0;
    for c in &done {
        let second = match (c.tokens.len(), c.finish) {
            (1, FinishReason::Stop) if stop_ids.len() == 1 => stop_ids[0],
            _ => c.tokens[1],
        };
        counts[c.tokens[0] as usize * v + second as usize] += 1;
        drafted += c.stats.drafted;
    }
    assert!(
        drafted > n as u64,
        "the random proposer must actually draft"
    );
    counts
}

fn check_sampling_lossless(params: SamplingParams) {
    check_sampling_lossless_against(params, Acceptance::ResidualFromP);
}

/// The chi-square test of the first two sampled tokens against the exact
/// distribution, then the same test on a deliberately lossy `control`,
/// which it must reject.
fn check_sampling_lossless_against(params: SamplingParams, control: Acceptance) {
    let spec = TinySpec { vocab: 12, ..TINY };
    let (_d, model) = tiny_model(&spec, 8);
    let prompt = [3u32, 7, 1, 9];
    let exact = common::exact_first_two(&model, &prompt, &params);
    // Stale penalties differ from the target only where a draft was
    // accepted in the same step as the token after it: more samples.
    let n = if control == Acceptance::StalePenalties {
        20000
    } else {
        12000
    };
    assert_pairs_follow(&model, &prompt, &params, &exact, n, control, |r| r);
}

/// The chi-square test of the first two tokens of `n` sampled requests
/// (`shape` sets their fields) against `exact`, then of the same requests
/// under the lossy `control`, which it must reject.
#[allow(clippy::too_many_arguments)]
fn assert_pairs_follow(
    model: &Arc<Model>,
    prompt: &[u32],
    params: &SamplingParams,
    exact: &[f64],
    n: usize,
    control: Acceptance,
    shape: impl Fn(Request) -> Request + Copy,
) {
    let good = sampled_pairs_of(model, prompt, params, n, Acceptance::Exact, shape);
    let (stat, df) = common::chi_square(&good, exact);
    let crit = common::chi2_crit_999(df);
    eprintln!("{params:?}: correct residual chi2 {stat:.1} (df {df}, 0.1% critical {crit:.1})");
    assert!(
        stat < crit,
        "sampled distribution differs from the target: chi2 {stat} > {crit}"
    );
    // The same test rejects the lossy control.
    let bad = sampled_pairs_of(model, prompt, params, n, control, shape);
    let (bstat, bdf) = common::chi_square(&bad, exact);
    eprintln!(
        "{params:?}: {control:?} chi2 {bstat:.1} (df {bdf}, 0.1% critical {:.1})",
        common::chi2_crit_999(bdf)
    );
    assert!(
        bstat > 3.0 * common::chi2_crit_999(bdf),
        "the test cannot tell {control:?} apart: {bstat}"
    );
}

#[test]
fn a_request_longer_than_the_whole_kv_budget_is_refused_when_added() {
    let _cpu = shared();
    // Built from an `EngineConfig` directly (not through a TOML config),
    // a 3-block budget (192 tokens) must still refuse a request that could
    // only fail after its prefill, evicting the running ones on the way.
    let (_d, model) = tiny_model(&TINY, 12);
    let mut e = engine(&model, None, vec![], 2, Some(3));
    let running = e.add(Request::greedy(vec![1, 2, 3], 8), None).unwrap();
    let long: Vec<u32> = (0..190).map(|i| 1 + i % 7).collect();
    let err = e.add(Request::greedy(long.clone(), 8), None).unwrap_err();
    assert!(err.to_string().contains("192"), "the limit named: {err}");
    // What fits is served, and the running request completes untouched.
    e.add(Request::greedy(long[..120].to_vec(), 8), None)
        .unwrap();
    let done = e.run_to_completion().unwrap();
    assert_eq!(done.len(), 2);
    let first = done.iter().find(|c| c.id == running).unwrap();
    assert_eq!(first.preemptions, 0);
}

#[test]
fn an_untrusted_q_is_not_used_so_a_lying_proposer_stays_lossless() {
    let _cpu = shared();
    // A proposer that reports one q and drafts another token (its q's
    // argmax): trusting its q biases the output (the control, which the
    // test rejects); `trust_q = false` verifies each drafted
    // token as a point mass, exact whatever was drafted.
    let spec = TinySpec { vocab: 12, ..TINY };
    let (_d, model) = tiny_model(&spec, 8);
    let prompt = [3u32, 7, 1, 9];
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let exact = common::exact_first_two(&model, &prompt, &params);
    let liar = || LyingProposer(RandomProposer::new(spec.vocab, 3, 17));
    let n = 12000;
    let ignored = Box::new(specd::speculative::proposer::Configured {
        inner: Box::new(liar()),
        token_cost: None,
        trust_q: false,
    });
    let good = sampled_pairs_with(
        &model,
        &prompt,
        &params,
        n,
        Acceptance::Exact,
        ignored,
        |r| r,
    );
    let (stat, df) = common::chi_square(&good, &exact);
    let crit = common::chi2_crit_999(df);
    eprintln!("q ignored: chi2 {stat:.1} (df {df}, 0.1% critical {crit:.1})");
    assert!(stat < crit, "q ignored: chi2 {stat} > {crit}");
    let trusted = Box::new(liar());
    let bad = sampled_pairs_with(
        &model,
        &prompt,
        &params,
        n,
        Acceptance::Exact,
        trusted,
        |r| r,
    );
    let (bstat, bdf) = common::chi_square(&bad, &exact);
    eprintln!("q trusted: chi2 {bstat:.1} (df {bdf})");
    assert!(
        bstat > 3.0 * common::chi2_crit_999(bdf),
        "the test cannot tell a trusted lying q apart: {bstat}"
    );
}

#[test]
fn sampling_is_lossless_at_temperature_one() {
    let _cpu = shared();
    check_sampling_lossless(SamplingParams {
        temperature: 1.0,
        ..Default::default()
    });
}

#[test]
fn sampling_is_lossless_with_top_k_and_top_p() {
    let _cpu = shared();
    check_sampling_lossless(SamplingParams {
        temperature: 0.8,
        top_k: 8,
        top_p: 0.9,
        ..Default::default()
    });
}

#[test]
fn sampling_is_lossless_with_penalties() {
    let _cpu = shared();
    // Penalties must see the drafts accepted earlier in the same step; the
    // control forgets them.
    check_sampling_lossless_against(
        SamplingParams {
            temperature: 1.0,
            repetition_penalty: 1.3,
            presence_penalty: 0.8,
            frequency_penalty: 0.6,
            ..Default::default()
        },
        Acceptance::StalePenalties,
    );
}

#[test]
fn sampling_is_lossless_with_min_p() {
    let _cpu = shared();
    // p must be filtered exactly as plain sampling filters it; the control
    // accepts against the unfiltered softmax.
    check_sampling_lossless_against(
        SamplingParams {
            temperature: 1.0,
            min_p: 0.15,
            ..Default::default()
        },
        Acceptance::UnfilteredTarget,
    );
}

#[test]
fn sampling_is_lossless_with_logit_bias() {
    let _cpu = shared();
    // p must carry the request's logit bias; the control drops it.
    check_sampling_lossless_against(
        SamplingParams {
            temperature: 1.0,
            logit_bias: vec![(2, 2.5), (5, -3.0), (9, 1.0)],
            ..Default::default()
        },
        Acceptance::UnbiasedTarget,
    );
}

/// `min_tokens` holds the stop token back at the first position only:
/// p there has it at 0, and at the second position, verified in the same
/// step when the first draft is accepted, it is allowed again. The
/// control holds it back at every row of the step.
#[test]
fn sampling_is_lossless_with_min_tokens() {
    let _cpu = shared();
    let spec = TinySpec { vocab: 12, ..TINY };
    let (_d, model) = tiny_model(&spec, 8);
    let v = spec.vocab;
    let prompt = [3u32, 7, 1, 9];
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    // The stop token: the likeliest second token, so holding it back
    // where it is allowed shows.
    let free = common::exact_first_two(&model, &prompt, &params);
    let stop = (0..v)
        .max_by(|&a, &b| {
            let m = |t: usize| (0..v).map(|f| free[f * v + t]).sum::<f64>();
            m(a).total_cmp(&m(b))
        })
        .unwrap() as u32;
    let exact = common::exact_first_two_shaped(&model, &prompt, &params, |out, l| {
        if out.is_empty() {
            l[stop as usize] = f32::NEG_INFINITY;
        }
    });
    assert!(
        (0..v).all(|t| exact[stop as usize * v + t] == 0.0),
        "the first token is never the stop token"
    );
    assert_pairs_follow(
        &model,
        &prompt,
        &params,
        &exact,
        12000,
        Acceptance::StaleEndBan,
        |r| Request {
            min_tokens: 1,
            stop_token_ids: vec![stop],
            ..r
        },
    );
}

/// `min_tokens` holds back the stop token ids (and end of sequence) where
/// plain decoding does, inside a run of accepted drafts too: drafts that
/// propose the held-back token are rejected, and once enough tokens
/// exist it ends the output again.
#[test]
fn min_tokens_holds_back_the_end_in_speculative_and_plain_decoding_alike() {
    let _cpu = shared();
    let (_d, model) = tiny_model(&TINY, 5);
    let (n, min) = (40, 20);
    let ps = prompts(TINY.vocab as u32);
    let free: Vec<Vec<u32>> = ps.iter().map(|p| plain_no_eos(&model, p, n)).collect();
    // Each request's stop token is its free output's token at position
    // 12, which min_tokens holds back there.
    let reqs: Vec<Request> = oracle_requests(&ps, n)
        .into_iter()
        .zip(&free)
        .map(|(r, w)| Request {
            ignore_eos: true,
            stop_token_ids: vec![w[12]],
            min_tokens: min,
            ..r
        })
        .collect();
    let want: Vec<_> = reqs
        .iter()
        .map(|r| generate(&model, None, r, |_| {}).unwrap())
        .collect();
    for (g, r) in want.iter().zip(&reqs) {
        let s = r.stop_token_ids[0];
        assert!(g.tokens.len() >= min, "{} tokens", g.tokens.len());
        assert!(!g.tokens.contains(&s));
        if g.tokens.len() < n {
            assert_eq!(g.finish, FinishReason::Stop);
        }
    }
    assert!(
        want.iter().any(|g| g.tokens.len() < n),
        "some output ends on its stop token after min_tokens"
    );
    // Drafts of the free outputs (the held-back token at 12), then of the
    // held-back outputs themselves (runs across position 20).
    for answers in [&free, &want.iter().map(|g| g.tokens.clone()).collect()] {
        let answers: Vec<(Vec<u32>, Vec<u32>)> =
            ps.iter().cloned().zip(answers.iter().cloned()).collect();
        let oracle = OracleProposer::new(answers, 0.0, 6, TINY.vocab as u32);
        let mut e = engine(&model, None, vec![Box::new(oracle)], 4, None);
        let done = run_all(&mut e, reqs.clone());
        for (c, g) in done.iter().zip(&want) {
            assert_eq!(c.tokens, g.tokens, "speculative");
            assert_eq!(c.finish, g.finish);
        }
        let accepted: u64 = done.iter().map(|c| c.stats.accepted).sum();
        assert!(accepted > 0, "no drafts were accepted");
    }
}

#[test]
fn stop_string_inside_an_accepted_run() {
    let _cpu = shared();
    let (model, tok) = smollm();
    let prompt = tok.encode("def fibonacci(n):", false).unwrap();
    let want = plain(&model, &prompt, 40);
    let text = tok.decode(&want, false).unwrap();
    // A stop string that starts mid-way through the output.
    let at = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[at..].chars().take(5).collect();
    let cut = text.find(&stop).unwrap();
    let oracle = OracleProposer::new(
        vec![(prompt.clone(), want.clone())],
        0.0,
        8,
        model.config.vocab_size as u32,
    );
    let mut e = engine(&model, Some(tok.clone()), vec![Box::new(oracle)], 1, None);
    let req = Request {
        stop: vec![stop.clone()],
        proposer: Some("oracle".into()),
        ..Request::greedy(prompt, 40)
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    e.add(req, Some(tx)).unwrap();
    let done = e.run_to_completion().unwrap();
    let c = &done[0];
    assert_eq!(c.finish, FinishReason::Stop);
    assert_eq!(c.text, text[..cut]);
    // Tokens end with the one that completed the stop string; nothing after.
    assert!(want.starts_with(&c.tokens));
    let upto = tok.decode(&c.tokens, false).unwrap();
    assert!(
        upto.contains(&stop)
            && !tok
                .decode(&c.tokens[..c.tokens.len() - 1], false)
                .unwrap()
                .contains(&stop)
    );
    assert!(c.tokens.len() < want.len());
    // Streamed text equals the final text, and the stop string never streamed.
    let mut streamed = String::new();
    while let Ok(ev) = rx.try_recv() {
        if let specd::speculative::Event::Tokens { text, .. } = ev {
            streamed += &text;
        }
    }
    assert_eq!(streamed, c.text);
    assert!(
        c.stats.mean_accepted_len() > 2.0,
        "drafts were accepted in runs"
    );
}

/// `min_tokens` holds stop strings back as vLLM (v1) does: a stop string
/// completed by one of the first `min_tokens` tokens does not end the
/// output, one completed by a later token does (the boundary probed both
/// ways); speculative decoding (drafts accepted in runs across both)
/// gives plain decoding's tokens, text and finish.
#[test]
fn min_tokens_holds_back_stop_strings_in_speculative_and_plain_decoding_alike() {
    let _cpu = shared();
    let (model, tok) = smollm();
    let prompt = tok.encode("def fibonacci(n):", false).unwrap();
    let n = 48;
    let free = plain_no_eos(&model, &prompt, n);
    let text = tok.decode(&free, false).unwrap();
    // The token count at which `end` bytes of text exist.
    let end_token = |end: usize| {
        (1..=free.len())
            .find(|&k| tok.decode(&free[..k], false).unwrap().len() >= end)
            .unwrap()
    };
    // The stop string: the first early token's text (trimmed, 2+ bytes)
    // that occurs completed by one of the first 20 tokens and again by a
    // later one.
    let ends = |stop: &str| -> Vec<(usize, usize)> {
        text.match_indices(stop)
            .map(|(i, _)| (i, end_token(i + stop.len())))
            .collect()
    };
    let stop = (0..16)
        .map(|i| {
            tok.decode(&free[i..i + 1], false)
                .unwrap()
                .trim()
                .to_string()
        })
        .find(|p| {
            let e = ends(p);
            p.len() >= 2 && e.first().is_some_and(|f| f.1 <= 20) && e.iter().any(|x| x.1 > 20)
        })
        .expect("a token text recurring across token 20");
    let first = text.find(&stop).unwrap();
    let base = Request {
        stop: vec![stop.clone()],
        ignore_eos: true,
        ..Request::greedy(prompt.clone(), n)
    };
    let run = |min_tokens: usize| {
        let req = Request {
            min_tokens,
            ..base.clone()
        };
        let want = generate(&model, Some(&tok), &req, |_| {}).unwrap();
        let oracle = OracleProposer::new(
            vec![(prompt.clone(), free.clone())],
            0.0,
            8,
            model.config.vocab_size as u32,
        );
        let mut e = engine(&model, Some(tok.clone()), vec![Box::new(oracle)], 1, None);
        e.add(
            Request {
                proposer: Some("oracle".into()),
                ..req
            },
            None,
        )
        .unwrap();
        let done = e.run_to_completion().unwrap();
        let c = &done[0];
        assert_eq!(c.tokens, want.tokens, "min_tokens {min_tokens}: tokens");
        assert_eq!(c.text, want.text, "min_tokens {min_tokens}: text");
        assert_eq!(c.finish, want.finish, "min_tokens {min_tokens}: finish");
        assert!(c.stats.accepted > 0);
        want
    };
    // The output ends at the first occurrence completed after the
    // `min_tokens`-th token (all of them here), or runs to max_tokens.
    let check = |min: usize| {
        let g = run(min);
        assert!(g.tokens.len() >= min, "{} tokens", g.tokens.len());
        match ends(&stop).into_iter().find(|e| e.1 > min) {
            Some((at, _)) => {
                assert_eq!(g.finish, FinishReason::Stop, "min_tokens {min}");
                assert_eq!(g.text, text[..at], "min_tokens {min}");
            }
            None => assert_eq!((g.finish, g.tokens.len()), (FinishReason::Length, n)),
        }
        g
    };
    // Without min_tokens: the first occurrence, completed by token k0.
    let k0 = ends(&stop)[0].1;
    assert_eq!(check(0).text, text[..first]);
    // The boundary: held back exactly when k0 is within min_tokens.
    assert_eq!(check(k0 - 1).text, text[..first]);
    assert!(check(k0).text.len() > first + stop.len());
    // Held back past it, the output runs on, the stop string in its text.
    let g = check(20);
    assert!(g.text.contains(&stop), "{:?}", g.text);
    assert_eq!(g.finish, FinishReason::Stop);
}

/// A proposer that keeps a cache as big as the target's per token is
/// charged as many blocks again: after every step the budget in use is
/// twice the blocks of the sequences' committed lengths; in a budget that
/// holds both only uncharged at their ends the peak stays within it, and
/// the output stays plain decoding's.
#[test]
fn a_proposer_cache_is_charged_to_the_kv_budget() {
    let _cpu = shared();
    let (_d, model) = tiny_model(&TINY, 5);
    let n = 60;
    let ps = prompts(TINY.vocab as u32);
    let ps = vec![ps[3].clone(), ps[0].clone()];
    let want: Vec<Vec<u32>> = ps.iter().map(|p| plain_no_eos(&model, p, n)).collect();
    let answers: Vec<(Vec<u32>, Vec<u32>)> = ps.iter().cloned().zip(want.iter().cloned()).collect();
    let per_token = model.kv_bytes_per_token();
    let bs = specd::model::DEFAULT_BLOCK_SIZE;
    for kv_blocks in [None, Some(6)] {
        let oracle = OracleProposer::new(answers.clone(), 0.3, 4, TINY.vocab as u32)
            .with_cache_bytes(per_token);
        let mut e = engine(&model, None, vec![Box::new(oracle)], 2, kv_blocks);
        let ids: Vec<u64> = oracle_requests(&ps, n)
            .into_iter()
            .map(|mut r| {
                r.ignore_eos = true;
                e.add(r, None).unwrap()
            })
            .collect();
        let mut done = Vec::new();
        let mut peak = 0;
        while done.len() < ids.len() {
            done.extend(e.step().unwrap().finished);
            // A finished sequence's cache goes with the next step.
            let held: usize = ids
                .iter()
                .filter(|&&id| !done.iter().any(|c: &Completion| c.id == id))
                .filter_map(|&id| e.verifier.cache_len(id))
                .map(|len| 2 * len.div_ceil(bs))
                .sum();
            let used = e.kv.usage(Pool::Target).unwrap().used_blocks;
            assert_eq!(used, held, "budget {kv_blocks:?}: charged blocks");
            peak = peak.max(used);
        }
        // 70 + 60 and 5 + 60 tokens: at most 3 and 2 blocks, doubled; 6
        // blocks hold the first alone at its end.
        assert!(peak >= 6, "peak {peak}");
        if let Some(b) = kv_blocks {
            assert!(peak <= b, "peak {peak} over the budget {b}");
        }
        done.sort_by_key(|c| ids.iter().position(|&i| i == c.id).unwrap());
        for (c, w) in done.iter().zip(&want) {
            assert_eq!(&c.tokens, w, "budget {kv_blocks:?}");
        }
        assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
    }
}

#[test]
fn cancellation_frees_kv() {
    let _cpu = shared();
    let (_d, model) = tiny_model(&TINY, 6);
    let mut e = engine(&model, None, vec![], 2, None);
    let a = e
        .add(Request::greedy(prompts(96)[3].clone(), 100), None)
        .unwrap();
    let b = e
        .add(Request::greedy(prompts(96)[0].clone(), 20), None)
        .unwrap();
    for _ in 0..5 {
        e.step().unwrap();
    }
    let held = e.kv.usage(Pool::Target).unwrap().used_blocks;
    assert!(held >= 2, "both sequences hold blocks: {held}");
    assert!(e.abort(a));
    assert!(!e.abort(a), "aborting twice is a no-op");
    e.step().unwrap();
    assert_eq!(e.verifier.cache_len(a), None, "aborted cache released");
    assert!(e.kv.usage(Pool::Target).unwrap().used_blocks < held);
    let done = e.run_to_completion().unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].id, b);
    assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
    assert_eq!(e.verifier.num_caches(), 0);
}

#[test]
fn a_request_whose_receiver_is_gone_is_aborted_at_the_next_step() {
    let _cpu = shared();
    // A client that hangs up between submitting and being guarded leaves
    // a sequence nobody reads: the next step aborts it and frees its KV.
    let (_d, model) = tiny_model(&TINY, 6);
    let mut e = engine(&model, None, vec![], 2, None);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let gone = e
        .add(Request::greedy(prompts(96)[3].clone(), 100), Some(tx))
        .unwrap();
    let (tx, mut kept_rx) = tokio::sync::mpsc::unbounded_channel();
    let kept = e
        .add(Request::greedy(prompts(96)[0].clone(), 20), Some(tx))
        .unwrap();
    // The short prompt's first token comes first (a light step); the
    // long one starts in the step after.
    e.step().unwrap();
    e.step().unwrap();
    assert!(e.verifier.cache_len(gone).is_some(), "both run at first");
    drop(rx);
    e.step().unwrap();
    assert_eq!(e.verifier.cache_len(gone), None, "abandoned cache released");
    let done = e.run_to_completion().unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].id, kept);
    assert_eq!(done[0].tokens, plain(&model, &prompts(96)[0], 20));
    let mut finished = false;
    while let Ok(ev) = kept_rx.try_recv() {
        finished |= matches!(ev, specd::speculative::Event::Finished(_));
    }
    assert!(finished, "the request still read got its completion");
    assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
}

#[test]
fn a_forked_choice_outlives_a_parent_that_ends_while_it_waits() {
    let _cpu = shared();
    // With one token of budget per step, the child (forked from its
    // parent's prompt cache) sits out while the parent decodes its last
    // token and ends; the child must then prefill by itself, not copy a
    // released cache.
    let (_d, model) = tiny_model(&TINY, 9);
    let prompt = prompts(TINY.vocab as u32)[3].clone();
    let mut cfg = EngineConfig::for_model(&model);
    cfg.scheduler.max_batch_tokens = 1;
    cfg.scheduler.max_waiting = usize::MAX;
    let mut e = SyncDriver::new(model.clone(), None, cfg, Drafter::new());
    let mut parent = Request::greedy(prompt.clone(), 2);
    parent.ignore_eos = true;
    let p = e.add(parent, None).unwrap();
    let mut child = Request::greedy(prompt.clone(), 6);
    child.ignore_eos = true;
    child.fork_of = Some(p);
    let c = e.add(child, None).unwrap();
    let mut done = e.run_to_completion().unwrap();
    done.sort_by_key(|x| x.id);
    let want = plain_no_eos(&model, &prompt, 6);
    assert_eq!(done.len(), 2);
    assert_eq!((done[0].id, &done[0].tokens[..]), (p, &want[..2]));
    assert_eq!((done[1].id, &done[1].tokens[..]), (c, &want[..]));
    assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
}

#[test]
fn a_sequence_the_budget_leaves_idle_cannot_starve_the_kv_for_ever() {
    let _cpu = shared();
    // A 9-token budget and 8-token drafts: the first decode takes the
    // whole budget every step, so the other sequence never gets a want.
    // When the first needs a block that only the idle one holds, the idle
    // one is evicted (and recomputed later) instead of the first waiting
    // for ever.
    let (_d, model) = tiny_model(&TINY, 10);
    let ps = prompts(TINY.vocab as u32);
    let (pa, pb) = (ps[3].clone(), ps[0].clone());
    let want_a = plain_no_eos(&model, &pa, 100);
    let want_b = plain_no_eos(&model, &pb, 20);
    let oracle = || {
        OracleProposer::new(
            vec![(pa.clone(), want_a.clone()), (pb.clone(), want_b.clone())],
            0.3,
            8,
            TINY.vocab as u32,
        )
    };
    // First come, first served leaves the short prompt's prefill idle
    // behind the long one's; fair scheduling gives it a share of the
    // first step's budget, so it decodes first and nobody starves either.
    for scheduling in [Scheduling::Fcfs, Scheduling::Fair] {
        let mut e = engine(&model, None, vec![Box::new(oracle())], 2, Some(3));
        e.scheduler.config.max_batch_tokens = 9;
        e.scheduler.config.scheduling = scheduling;
        let req = |p: &Vec<u32>, n| Request {
            proposer: Some("oracle".into()),
            ignore_eos: true,
            ..Request::greedy(p.clone(), n)
        };
        let a = e.add(req(&pa, 100), None).unwrap();
        let b = e.add(req(&pb, 20), None).unwrap();
        let mut done = Vec::new();
        for _ in 0..3000 {
            done.extend(e.step().unwrap().finished);
            if done.len() == 2 {
                break;
            }
        }
        assert_eq!(
            done.len(),
            2,
            "{scheduling:?}: a sequence starved: {:?}",
            done.iter().map(|c| c.id).collect::<Vec<_>>()
        );
        done.sort_by_key(|c| c.id);
        assert_eq!((done[0].id, &done[0].tokens), (a, &want_a));
        assert_eq!((done[1].id, &done[1].tokens), (b, &want_b));
        if scheduling == Scheduling::Fcfs {
            assert!(done[1].preemptions > 0, "the idle holder was evicted");
        }
        assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
    }
}

#[test]
fn temperatures_too_small_for_floats_decode_greedily_with_every_transform() {
    let _cpu = shared();
    // 1 / 1e-40 is not a finite f32: such requests are greedy (as is
    // anything under 1e-5), never a NaN distribution that hangs top-p or
    // panics an empty support. With a drafting proposer, through the
    // engine's step.
    let (_d, model) = tiny_model(&TINY, 8);
    let ps = prompts(TINY.vocab as u32);
    for (i, temperature) in [1e-40f32, 3e-39, 1e-6].into_iter().enumerate() {
        for (top_p, min_p) in [(1.0, 0.0), (0.9, 0.0), (1.0, 0.1)] {
            let want = plain_no_eos(&model, &ps[i], 24);
            // Right most of the time, wrong now and then: both paths.
            let oracle = OracleProposer::new(
                vec![(ps[i].clone(), want.clone())],
                0.3,
                4,
                TINY.vocab as u32,
            );
            let mut e = engine(&model, None, vec![Box::new(oracle)], 2, None);
            let mut r = Request::greedy(ps[i].clone(), 24);
            r.ignore_eos = true;
            r.proposer = Some("oracle".into());
            r.params = SamplingParams {
                temperature,
                top_p,
                min_p,
                seed: 3,
                ..SamplingParams::greedy()
            };
            let done = run_all(&mut e, vec![r]);
            assert_eq!(
                done[0].tokens, want,
                "temperature {temperature}, top_p {top_p}, min_p {min_p}"
            );
        }
    }
}

#[test]
fn preemption_and_resume_give_the_same_greedy_output() {
    let _cpu = shared();
    let (_d, model) = tiny_model(&TINY, 7);
    let ps = prompts(TINY.vocab as u32);
    let n = 100;
    let want: Vec<Vec<u32>> = ps.iter().map(|p| plain_no_eos(&model, p, n)).collect();
    let answers: Vec<(Vec<u32>, Vec<u32>)> = ps.iter().cloned().zip(want.iter().cloned()).collect();
    let oracle = || {
        Box::new(OracleProposer::new(
            answers.clone(),
            0.3,
            4,
            TINY.vocab as u32,
        ))
    };
    // Four sequences that grow from 5 to 9 blocks of 64 slots, in 6 blocks:
    // the later ones are evicted mid-decode and recomputed.
    let mut e = engine(&model, None, vec![oracle()], 4, Some(6));
    // Prompt log-probabilities too (echo): a recompute must report the
    // prompt's, once, not the generated tokens it also feeds.
    let reqs = || -> Vec<Request> {
        ps.iter()
            .map(|p| Request {
                proposer: Some("oracle".into()),
                ignore_eos: true,
                prompt_logprobs: Some(1),
                ..Request::greedy(p.clone(), n)
            })
            .collect()
    };
    let done = run_all(&mut e, reqs());
    let mut roomy = engine(&model, None, vec![oracle()], 4, None);
    let unpreempted = run_all(&mut roomy, reqs());
    assert!(unpreempted.iter().all(|c| c.preemptions == 0));
    for ((c, u), p) in done.iter().zip(&unpreempted).zip(&ps) {
        assert_eq!(
            c.prompt_logprobs.len(),
            p.len() - 1,
            "preemptions {}",
            c.preemptions
        );
        assert_eq!(c.prompt_logprobs, u.prompt_logprobs);
    }
    let preempted: u32 = done.iter().map(|c| c.preemptions).sum();
    let lens: Vec<usize> = want.iter().map(|w| w.len()).collect();
    assert!(
        preempted > 0,
        "the budget must force preemption (output lengths {lens:?})"
    );
    for (c, w) in done.iter().zip(&want) {
        assert_eq!(&c.tokens, w);
    }
    assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
}

#[test]
fn a_panicking_proposer_degrades_to_plain_decoding() {
    let _cpu = shared();
    let (_d, model) = tiny_model(&TINY, 9);
    let p = prompts(TINY.vocab as u32)[0].clone();
    let want = plain(&model, &p, 30);
    let mut e = engine(
        &model,
        None,
        vec![Box::new(PanickyProposer::new())],
        1,
        None,
    );
    let done = run_all(
        &mut e,
        vec![Request {
            proposer: Some("panicky".into()),
            ..Request::greedy(p, 30)
        }],
    );
    assert_eq!(done[0].tokens, want);
    assert!(e
        .drafter
        .poisoned("panicky")
        .unwrap()
        .contains("deliberate test panic"));
}

#[test]
fn bad_requests_are_refused_with_the_field_named() {
    let _cpu = shared();
    let (_d, model) = tiny_model(&TINY, 10);
    let mut e = engine(&model, None, vec![], 1, None);
    let err = e
        .add(
            Request {
                proposer: Some("nope".into()),
                ..Request::greedy(vec![1, 2], 4)
            },
            None,
        )
        .unwrap_err();
    assert!(err.to_string().contains("unknown proposer 'nope'"), "{err}");
    let err = e.add(Request::greedy(vec![1; 300], 4), None).unwrap_err();
    assert!(err.to_string().contains("context holds 256"), "{err}");
    let mut r = Request::greedy(vec![1, 2], 4);
    r.params.top_p = 0.0;
    assert!(e.add(r, None).unwrap_err().to_string().contains("top_p"));
    assert!(e.scheduler.is_idle());
}

#[test]
fn actors_run_concurrent_requests_losslessly_and_free_kv() {
    let _cpu = shared();
    let (_d, model) = tiny_model(&TINY, 11);
    let ps = prompts(TINY.vocab as u32);
    let n = 30;
    let want: Vec<Vec<u32>> = ps.iter().map(|p| plain(&model, p, n)).collect();
    let answers: Vec<(Vec<u32>, Vec<u32>)> = ps.iter().cloned().zip(want.iter().cloned()).collect();
    let model2 = model.clone();
    actix_rt::System::new().block_on(async move {
        let mut cfg = EngineConfig::for_model(&model2);
        cfg.scheduler.max_running = 3;
        let mut d = Drafter::new();
        d.add(Box::new(OracleProposer::new(
            answers,
            0.3,
            4,
            TINY.vocab as u32,
        )));
        let h = specd::speculative::actors::EngineHandle::start(
            specd::speculative::actors::EngineParts {
                model: model2,
                tokenizer: None,
                config: cfg,
                drafter: d,
            },
        );
        let mut rxs = Vec::new();
        for p in &ps {
            let req = Request {
                proposer: Some("oracle".into()),
                ..Request::greedy(p.clone(), n)
            };
            rxs.push(h.submit(req).await.unwrap());
        }
        // One more request, aborted after its first tokens.
        let (victim, mut vrx) = h.submit(Request::greedy(ps[3].clone(), 150)).await.unwrap();
        let mut outs = Vec::new();
        for (_, rx) in rxs.iter_mut() {
            let mut toks = Vec::new();
            loop {
                match rx.recv().await.unwrap() {
                    specd::speculative::Event::Tokens { ids, .. } => toks.extend(ids),
                    specd::speculative::Event::Finished(c) => {
                        assert_eq!(c.tokens, toks);
                        break;
                    }
                    specd::speculative::Event::Error(e)
                    | specd::speculative::Event::Rejected(e) => panic!("{e}"),
                }
            }
            outs.push(toks);
        }
        assert_eq!(outs, want);
        let _ = vrx.recv().await;
        assert!(h.abort(victim).await);
        loop {
            match vrx.recv().await {
                Some(specd::speculative::Event::Finished(c)) => {
                    assert_eq!(c.finish, FinishReason::Aborted);
                    break;
                }
                Some(_) => {}
                None => panic!("stream closed without a final event"),
            }
        }
        // The release is applied at the next step; give the loop a moment.
        for _ in 0..100 {
            if h.kv_usage().await.unwrap().used_blocks == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(h.kv_usage().await.unwrap().used_blocks, 0);
    });
}

#[test]
fn shadow_proposers_are_scored_without_touching_live_traffic() {
    let _cpu = shared();
    let (_d, model) = tiny_model(&TINY, 12);
    let ps = prompts(TINY.vocab as u32);
    let n = 30;
    let want: Vec<Vec<u32>> = ps.iter().map(|p| plain_no_eos(&model, p, n)).collect();
    let answers: Vec<(Vec<u32>, Vec<u32>)> = ps.iter().cloned().zip(want.iter().cloned()).collect();
    for (rate, check) in [(0.0, "perfect"), (1.0, "useless")] {
        let mut e = engine(&model, None, vec![], 4, None);
        e.drafter.add_shadow(
            Box::new(OracleProposer::new(
                answers.clone(),
                rate,
                4,
                TINY.vocab as u32,
            )),
            4,
        );
        let reqs = ps
            .iter()
            .map(|p| Request {
                ignore_eos: true,
                ..Request::greedy(p.clone(), n)
            })
            .collect();
        let done = run_all(&mut e, reqs);
        for (c, w) in done.iter().zip(&want) {
            assert_eq!(&c.tokens, w, "live output changed by a shadow");
            assert_eq!(
                c.stats.verify_steps as usize, n,
                "a shadow must cost no target forwards"
            );
        }
        let stats = e.drafter.shadow_stats();
        let (name, s) = &stats[0];
        assert_eq!(name, "oracle");
        assert_eq!(s.requests, 4);
        assert_eq!(s.tokens, 4 * n as u64);
        assert!(s.verify_steps > 0 && s.drafted > 0);
        match check {
            // Every draft matches what was emitted, except drafts running
            // past the end of the output.
            "perfect" => assert!(s.accepted as f64 / s.drafted as f64 > 0.85, "{s:?}"),
            _ => assert_eq!(s.accepted, 0, "{s:?}"),
        }
    }
}

#[test]
fn aborts_during_a_step_wait_for_its_commit_and_free_everything() {
    let _cpu = shared();
    use specd::speculative::pipeline::Step;
    let (_d, model) = tiny_model(&TINY, 13);
    let ps = prompts(TINY.vocab as u32);
    let want = plain_no_eos(&model, &ps[0], 80);
    let answers = vec![(ps[0].clone(), want.clone())];
    let oracle = OracleProposer::new(answers, 0.0, 4, TINY.vocab as u32);
    let mut e = engine(&model, None, vec![Box::new(oracle)], 4, None);
    let keep = e
        .add(
            Request {
                proposer: Some("oracle".into()),
                ignore_eos: true,
                ..Request::greedy(ps[0].clone(), 80)
            },
            None,
        )
        .unwrap();
    // Decoding first, then abort it mid-step: every stage of the step must
    // still find it, and its blocks go after the commit.
    e.step().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let victim = e.add(Request::greedy(ps[3].clone(), 50), Some(tx)).unwrap();
    for abort_at in 0..5 {
        let drafter = &e.drafter;
        let (mut step, grant_req) = Step::plan(
            &mut e.scheduler,
            |n| drafter.capabilities(n),
            100 + abort_at,
        );
        // Round r aborts the victim (prefilling) before stage r; later
        // rounds find it gone.
        let abort = |e: &mut SyncDriver, at: u64| {
            if at == abort_at {
                assert!(e.abort(victim) || abort_at > 0);
            }
        };
        abort(&mut e, 0);
        let grant = e.kv.handle_grant(grant_req);
        abort(&mut e, 1);
        let dreq = step.granted(&mut e.scheduler, grant);
        abort(&mut e, 2);
        let vreq = step.drafted(e.drafter.handle(dreq));
        let vresp = e.verifier.handle(vreq);
        abort(&mut e, 3);
        let areq = step.verified(&mut e.scheduler, vresp);
        let aresp = e.acceptor.handle(areq);
        abort(&mut e, 4);
        let (lens, _) = step.commit(&mut e.scheduler, aresp);
        e.kv.handle_commit(lens);
        if abort_at == 0 {
            assert!(e.scheduler.get(victim).is_none(), "applied at commit");
        }
    }
    let mut aborted = false;
    while let Ok(ev) = rx.try_recv() {
        if let specd::speculative::Event::Finished(c) = ev {
            aborted = c.finish == FinishReason::Aborted;
        }
    }
    assert!(aborted, "the victim ends with an aborted completion");
    let done = e.run_to_completion().unwrap();
    let all: Vec<_> = done.iter().filter(|c| c.id == keep).collect();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].tokens, want, "the survivor is still lossless");
    assert_eq!(e.kv.usage(Pool::Target).unwrap().used_blocks, 0);
    assert_eq!(e.verifier.num_caches(), 0);
}

#[test]
fn actors_survive_aborts_at_every_moment_and_free_kv() {
    let _cpu = shared();
    let (_d, model) = tiny_model(&TINY, 14);
    let ps = prompts(TINY.vocab as u32);
    let n = 24;
    let want: Vec<Vec<u32>> = ps.iter().map(|p| plain(&model, p, n)).collect();
    let answers: Vec<(Vec<u32>, Vec<u32>)> = ps.iter().cloned().zip(want.iter().cloned()).collect();
    let model2 = model.clone();
    actix_rt::System::new().block_on(async move {
        let mut cfg = EngineConfig::for_model(&model2);
        cfg.scheduler.max_running = 4;
        let mut d = Drafter::new();
        d.add(Box::new(OracleProposer::new(
            answers,
            0.3,
            4,
            TINY.vocab as u32,
        )));
        let h = specd::speculative::actors::EngineHandle::start(
            specd::speculative::actors::EngineParts {
                model: model2,
                tokenizer: None,
                config: cfg,
                drafter: d,
            },
        );
        let mut kept = Vec::new();
        let mut victims = Vec::new();
        for round in 0..60u64 {
            let p = &ps[(round % 4) as usize];
            let req = Request {
                proposer: Some("oracle".into()),
                ..Request::greedy(p.clone(), n)
            };
            let (id, rx) = h.submit(req).await.unwrap();
            if round % 3 == 0 {
                kept.push(((round % 4) as usize, rx));
            } else {
                victims.push(id);
                // Abort right away, after a yield, or a little later.
                match round % 3 {
                    1 => {
                        h.abort(id).await;
                    }
                    _ => {
                        tokio::time::sleep(std::time::Duration::from_micros(300 * (round % 7)))
                            .await;
                        h.abort(id).await;
                    }
                }
            }
        }
        for (i, mut rx) in kept {
            let mut toks = Vec::new();
            loop {
                match rx.recv().await {
                    Some(specd::speculative::Event::Tokens { ids, .. }) => toks.extend(ids),
                    Some(specd::speculative::Event::Finished(_)) => break,
                    Some(
                        specd::speculative::Event::Error(e)
                        | specd::speculative::Event::Rejected(e),
                    ) => panic!("{e}"),
                    None => panic!("stream closed without a final event"),
                }
            }
            assert_eq!(toks, want[i]);
        }
        for _ in 0..300 {
            let st = h.stats().await.unwrap();
            if st.running == 0 && st.waiting == 0 && h.kv_usage().await.unwrap().used_blocks == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(h.kv_usage().await.unwrap().used_blocks, 0);
        assert!(h.ping(std::time::Duration::from_secs(5)).await.is_ok());
    });
}

/// Breaks one rule of the draft contract on every propose call.
struct BadProposer {
    kind: specd::speculative::proposer::QKind,
    fault: &'static str,
    vocab: usize,
}

impl Proposer for BadProposer {
    fn name(&self) -> &str {
        "bad"
    }
    fn capabilities(&self) -> specd::speculative::proposer::Capabilities {
        specd::speculative::proposer::Capabilities {
            q_kind: self.kind,
            max_draft: 3,
            ..Default::default()
        }
    }
    fn start(&mut self, _: u64, _: &[u32]) -> Result<(), String> {
        Ok(())
    }
    fn propose(
        &mut self,
        batch: &[specd::speculative::proposer::ProposeInput<'_>],
    ) -> Result<Vec<specd::speculative::proposer::Draft>, String> {
        use specd::sampler::Distribution;
        use specd::speculative::proposer::{Draft, DraftQ};
        let v = self.vocab;
        let uniform = vec![1.0 / v as f32; v];
        Ok(batch
            .iter()
            .map(|_| {
                let (tokens, q) = match self.fault {
                    "id out of range" => (vec![v as u32 + 3], vec![DraftQ::OneHot]),
                    "sparse declared, full returned" => {
                        (vec![1], vec![DraftQ::Full(uniform.clone().into())])
                    }
                    "NaN" => {
                        let mut q = uniform.clone();
                        q[2] = f32::NAN;
                        (vec![1], vec![DraftQ::Full(q.into())])
                    }
                    "q(draft) = 0" => {
                        let mut q = vec![0.0; v];
                        q[2] = 1.0;
                        (vec![1], vec![DraftQ::Full(q.into())])
                    }
                    "sum != 1" => (vec![1], vec![DraftQ::Full(vec![0.5 / v as f32; v].into())]),
                    "negative" => (
                        vec![1],
                        vec![DraftQ::Sparse(Distribution {
                            ids: vec![1, 2],
                            probs: vec![1.5, -0.5],
                        })],
                    ),
                    "missing q" => (vec![1, 2], vec![DraftQ::OneHot]),
                    other => panic!("unknown fault {other}"),
                };
                Draft {
                    tokens,
                    q,
                    parents: None,
                    source: None,
                }
            })
            .collect())
    }
    fn observe(&mut self, _: u64, _: &[u32], _: &[usize]) -> Result<(), String> {
        Ok(())
    }
    fn finish(&mut self, _: u64) {}
}

#[test]
fn invalid_drafts_poison_their_proposer_before_they_reach_the_verifier() {
    let _cpu = shared();
    use specd::speculative::proposer::QKind;
    let (_d, model) = tiny_model(&TINY, 15);
    let v = TINY.vocab;
    let prompt = prompts(v as u32)[1].clone();
    let params = SamplingParams {
        temperature: 1.0,
        seed: 42,
        ..Default::default()
    };
    let sampled = |p: &str| Request {
        params: params.clone(),
        proposer: Some(p.into()),
        ignore_eos: true,
        ..Request::greedy(prompt.clone(), 12)
    };
    let mut e = engine(&model, None, vec![], 1, None);
    let reference = run_all(&mut e, vec![sampled("none")])[0].tokens.clone();
    let cases = [
        (QKind::OneHot, "id out of range", "outside the vocabulary"),
        (
            QKind::Sparse,
            "sparse declared, full returned",
            "declared Sparse q but returned full q",
        ),
        (QKind::Full, "NaN", "q has an entry NaN"),
        (QKind::Full, "q(draft) = 0", "has q = 0"),
        (QKind::Full, "sum != 1", "sums to 0.5"),
        (QKind::Sparse, "negative", "q has an entry -0.5"),
        (
            QKind::OneHot,
            "missing q",
            "2 drafted tokens but 1 q entries",
        ),
    ];
    for (kind, fault, needle) in cases {
        let bad = BadProposer {
            kind,
            fault,
            vocab: v,
        };
        let mut e = engine(&model, None, vec![Box::new(bad)], 1, None);
        let done = run_all(&mut e, vec![sampled("bad")]);
        let why = e
            .drafter
            .poisoned("bad")
            .unwrap_or_else(|| panic!("{fault}: not poisoned"));
        assert!(why.contains(needle), "{fault}: {why}");
        assert_eq!(done[0].stats.accepted, 0, "{fault}");
        // Refused before verification: the request decoded exactly as a
        // plain one with the same seed.
        assert_eq!(done[0].tokens, reference, "{fault}");
    }
}
