//! Token-tree verification: greedy identity with plain decoding (trees
//! batched with chains and plain sequences), the sampled distribution with
//! tree drafts in both sibling modes (and lossy controls), KV compaction
//! after a non-first branch, and hidden states delivered through the ABI.

use specd_test_kit as common;

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::{OracleProposer, TempDir, TinySpec, TreeMode, TreeProposer, TINY};
use specd::model::{load_model, ForwardInput, Logits, Model, TreeMask};
use specd::plain::generate;
use specd::sampler::SamplingParams;
use specd::speculative::accept::Acceptance;
use specd::speculative::drafter::Drafter;
use specd::speculative::driver::{EngineConfig, SyncDriver};
use specd::speculative::proposer::{Proposer, SiblingMode};
use specd::speculative::{Completion, Request};
use specd::tokenizer::Tokenizer;

fn tiny_model(spec: &TinySpec, seed: u64) -> (TempDir, Arc<Model>) {
    let dir = TempDir::new(&format!("tree-{seed}-{}", spec.vocab));
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, spec, seed, GgmlDType::Q4_1, "llama");
    let m = Arc::new(load_model(&path, 2).unwrap());
    (dir, m)
}

fn engine(
    model: &Arc<Model>,
    tok: Option<Arc<Tokenizer>>,
    proposers: Vec<Box<dyn Proposer>>,
    running: usize,
) -> SyncDriver {
    let mut cfg = EngineConfig::for_model(model);
    cfg.scheduler.max_running = running;
    cfg.scheduler.max_draft = 64;
    cfg.scheduler.max_waiting = usize::MAX;
    cfg.scheduler.adaptive_draft = false;
    let mut d = Drafter::new();
    for p in proposers {
        d.add(p);
    }
    SyncDriver::new(model.clone(), tok, cfg, d)
}

fn plain(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
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

/// Trees (reordered for verification, some decisions deferred) beside
/// chains and plain sequences in one batch: every output equals plain
/// decoding.
fn check_greedy_mix(
    model: &Arc<Model>,
    tok: Option<Arc<Tokenizer>>,
    prompts: &[Vec<u32>],
    n: usize,
    nodes: usize,
) {
    let v = model.config.vocab_size;
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| plain(model, p, n)).collect();
    let answers: Vec<(Vec<u32>, Vec<u32>)> =
        prompts.iter().cloned().zip(want.iter().cloned()).collect();
    for error in [0.0, 0.3] {
        let tree = TreeProposer::new(
            "tree",
            v,
            nodes,
            SiblingMode::WithoutReplacement,
            TreeMode::Oracle {
                answers: answers.iter().cloned().collect(),
                error,
            },
            7,
        );
        let chain = OracleProposer::new(answers.clone(), 0.3, 4, v as u32);
        let mut e = engine(
            model,
            tok.clone(),
            vec![Box::new(tree), Box::new(chain)],
            3 * prompts.len(),
        );
        let reqs: Vec<Request> = ["tree", "oracle", "none"]
            .iter()
            .flat_map(|p| {
                prompts.iter().map(move |pr| Request {
                    proposer: Some(p.to_string()),
                    ignore_eos: true,
                    ..Request::greedy(pr.clone(), n)
                })
            })
            .collect();
        let done = run_all(&mut e, reqs);
        for (i, c) in done.iter().enumerate() {
            assert_eq!(
                c.tokens,
                want[i % prompts.len()],
                "error {error}: {} output differs from plain decoding",
                c.stats.proposer
            );
        }
        let trees: Vec<&Completion> = done.iter().filter(|c| c.stats.proposer == "tree").collect();
        let mal: f64 = trees
            .iter()
            .map(|c| c.stats.mean_accepted_len())
            .sum::<f64>()
            / trees.len() as f64;
        eprintln!("trees of {nodes} nodes, error {error}: mean accepted length {mal:.2}");
        assert!(trees.iter().all(|c| c.stats.drafted > 0));
        if error == 0.0 {
            assert!(mal > 3.0, "the true branch is found: {mal}");
        }
        assert!(e.drafter.poisoned("tree").is_none());
        assert_eq!(e.verifier.num_caches(), 0);
    }
}

#[test]
fn greedy_trees_are_lossless_batched_with_chains_and_plain_on_the_tiny_model() {
    let (_d, model) = tiny_model(&TINY, 31);
    let prompts: Vec<Vec<u32>> = vec![
        vec![5, 9, 13, 21, 34],
        vec![7, 7, 8, 9, 10, 11, 12, 13, 14, 3],
        (0..70).map(|i| (i * 7 % 90) + 3).collect(),
    ];
    check_greedy_mix(&model, None, &prompts, 40, 24);
    // Trees of 64 nodes, verified across KV block boundaries.
    check_greedy_mix(&model, None, &prompts[..2], 24, 64);
}

#[test]
fn greedy_trees_are_lossless_batched_with_chains_and_plain_on_smollm2() {
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    let prompts: Vec<Vec<u32>> = [
        "def fibonacci(n):",
        "<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n",
    ]
    .iter()
    .map(|t| tok.encode(t, false).unwrap())
    .collect();
    check_greedy_mix(&model, Some(tok), &prompts, 32, 16);
}

/// Counts of the first two sampled tokens with random tree drafts.
fn tree_pairs(
    model: &Arc<Model>,
    prompt: &[u32],
    params: &SamplingParams,
    siblings: SiblingMode,
    (width, peak): (usize, i32),
    acceptance: Acceptance,
    n: usize,
) -> (Vec<u64>, f64) {
    let mode = TreeMode::Random {
        width,
        depth: 3,
        peak,
    };
    tree_pairs_with(model, prompt, params, siblings, mode, acceptance, (n, 3))
}

fn tree_pairs_with(
    model: &Arc<Model>,
    prompt: &[u32],
    params: &SamplingParams,
    siblings: SiblingMode,
    mode: TreeMode,
    acceptance: Acceptance,
    (n, max_tokens): (usize, usize),
) -> (Vec<u64>, f64) {
    let v = model.config.vocab_size;
    let tree = TreeProposer::new("tree", v, 16, siblings, mode, 23);
    let mut e = engine(model, None, vec![Box::new(tree)], 64);
    e.acceptor.acceptance = acceptance;
    let reqs = (0..n)
        .map(|i| Request {
            params: SamplingParams {
                seed: 5000 + i as u64,
                ..params.clone()
            },
            proposer: Some("tree".into()),
            ignore_eos: true,
            ..Request::greedy(prompt.to_vec(), max_tokens)
        })
        .collect();
    let done = run_all(&mut e, reqs);
    let mut counts = vec![0u64; v * v];
    for c in &done {
        counts[c.tokens[0] as usize * v + c.tokens[1] as usize] += 1;
    }
    let accepted: u64 = done.iter().map(|c| c.stats.accepted).sum();
    assert!(e.drafter.poisoned("tree").is_none());
    (counts, accepted as f64 / n as f64)
}

#[test]
fn tree_sampling_keeps_the_target_distribution_in_both_sibling_modes() {
    let spec = TinySpec { vocab: 12, ..TINY };
    let (_d, model) = tiny_model(&spec, 8);
    let prompt = [3u32, 7, 1, 9];
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let exact = common::exact_first_two(&model, &prompt, &params);
    let n = 12000;
    // Wide sibling lists make the q update after a rejection matter.
    for (siblings, shape, control) in [
        (SiblingMode::Iid, (3, 3), Acceptance::ResidualFromP),
        (
            SiblingMode::WithoutReplacement,
            (3, 3),
            Acceptance::ResidualFromP,
        ),
        (
            SiblingMode::WithoutReplacement,
            (8, 0),
            Acceptance::StaleSiblingQ,
        ),
    ] {
        let width = shape.0;
        let (good, acc) = tree_pairs(
            &model,
            &prompt,
            &params,
            siblings,
            shape,
            Acceptance::Exact,
            n,
        );
        let (stat, df) = common::chi_square(&good, &exact);
        let crit = common::chi2_crit_999(df);
        eprintln!("{siblings:?}, width {width}: chi2 {stat:.1} (df {df}, 0.1% critical {crit:.1}), {acc:.2} drafts accepted per request");
        assert!(
            stat < crit,
            "{siblings:?}: tree sampling is biased: chi2 {stat} > {crit}"
        );
        assert!(
            acc > 0.3,
            "{siblings:?}: the trees must be accepted often enough to matter: {acc}"
        );
        // A stale sibling q shows only after a rejected sibling: more
        // samples for that control.
        let n_bad = if control == Acceptance::StaleSiblingQ {
            20000
        } else {
            n
        };
        let (bad, _) = tree_pairs(&model, &prompt, &params, siblings, shape, control, n_bad);
        let (bstat, bdf) = common::chi_square(&bad, &exact);
        eprintln!("{siblings:?}, width {width}, with {control:?}: chi2 {bstat:.1} (df {bdf})");
        // Seeds are fixed: 1.5 times the 0.1% point is far in the tail
        // (chi2 150 on 59 degrees of freedom: p < 1e-9).
        assert!(
            bstat > 1.5 * common::chi2_crit_999(bdf),
            "{siblings:?}: the test cannot tell {control:?} apart: {bstat}"
        );
    }
}

#[test]
fn one_hot_tree_sampling_tries_every_sibling_and_keeps_the_target_distribution() {
    // A one-hot proposer's siblings are deterministic candidates: each is
    // tried against the residual in turn (not only the first), and the
    // emitted tokens keep exactly p.
    let spec = TinySpec { vocab: 12, ..TINY };
    let (_d, model) = tiny_model(&spec, 8);
    let prompt = [3u32, 7, 1, 9];
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let exact = common::exact_first_two(&model, &prompt, &params);
    let n = 12000;
    let mode = || TreeMode::RandomOneHot { width: 4, depth: 3 };
    let sib = SiblingMode::WithoutReplacement;
    let (good, acc) = tree_pairs_with(
        &model,
        &prompt,
        &params,
        sib,
        mode(),
        Acceptance::Exact,
        (n, 3),
    );
    let (stat, df) = common::chi_square(&good, &exact);
    let crit = common::chi2_crit_999(df);
    eprintln!("one-hot trees: chi2 {stat:.1} (df {df}, 0.1% critical {crit:.1}), {acc:.2} drafts accepted per request");
    assert!(
        stat < crit,
        "one-hot tree sampling is biased: chi2 {stat} > {crit}"
    );
    // One level of up to 4 distinct candidates against one candidate: if
    // only the first sibling could be accepted the two would accept alike.
    let level = |width| TreeMode::RandomOneHot { width, depth: 1 };
    let exact_only = Acceptance::Exact;
    let one = tree_pairs_with(
        &model,
        &prompt,
        &params,
        sib,
        level(1),
        exact_only,
        (1000, 24),
    );
    let four = tree_pairs_with(
        &model,
        &prompt,
        &params,
        sib,
        level(4),
        exact_only,
        (1000, 24),
    );
    eprintln!(
        "accepted per request: 1 candidate {:.3}, up to 4: {:.3}",
        one.1, four.1
    );
    assert!(
        four.1 > 1.6 * one.1,
        "later siblings must be accepted too: {:.3} vs {:.3}",
        four.1,
        one.1
    );
    let control = Acceptance::ResidualFromP;
    let (bad, _) = tree_pairs_with(&model, &prompt, &params, sib, level(4), control, (n, 8));
    let (bstat, bdf) = common::chi_square(&bad, &exact);
    eprintln!("one-hot trees with {control:?}: chi2 {bstat:.1} (df {bdf})");
    assert!(
        bstat > 1.5 * common::chi2_crit_999(bdf),
        "the test cannot tell {control:?} apart: {bstat}"
    );
}

/// Random tree of `n` nodes in level order (the way EAGLE-style drafters
/// emit them), as verify-forward parents (root = new token 0).
fn level_order_tree(n: usize, seed: &mut u64) -> Vec<Option<usize>> {
    let mut parents = vec![None];
    for i in 1..=n {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // Mostly attach to one of the last few nodes: deep and bushy.
        let back = ((*seed >> 40) % 4) as usize + 1;
        parents.push(Some(i.saturating_sub(back)));
    }
    parents
}

fn depth_of(parents: &[Option<usize>], mut i: usize) -> usize {
    let mut d = 0;
    while let Some(p) = parents[i] {
        d += 1;
        i = p;
    }
    d
}

#[test]
fn compaction_after_a_non_first_branch_matches_plain_decoding_bit_for_bit() {
    // Base 49: 64 nodes span slots 50..114, across the block boundary at 64.
    for (name, model) in [
        ("tiny", tiny_model(&TINY, 41).1),
        (
            "smollm2",
            Arc::new(load_model(&common::smollm_path(), 2).unwrap()),
        ),
    ] {
        let v = model.config.vocab_size as u32;
        let committed: Vec<u32> = (0..50).map(|i| (i * 37 + 11) % v).collect();
        let mut seed = 9u64;
        let parents = level_order_tree(64, &mut seed);
        let tokens: Vec<u32> = (0..65u32)
            .map(|i| (i * 53 + 7) % v)
            .map(|t| if t == 0 { 1 } else { t })
            .collect();
        // The accepted path: the deepest node's ancestors, off the first-child line.
        let leaf = (1..=64).max_by_key(|&i| depth_of(&parents, i)).unwrap();
        let mut path = vec![leaf];
        while let Some(p) = parents[*path.last().unwrap()] {
            if p == 0 {
                break;
            }
            path.push(p);
        }
        path.reverse();
        assert!(
            path.iter().enumerate().any(|(k, &i)| i != k + 1),
            "a non-first branch"
        );
        assert!(path.len() >= 8, "a deep path: {path:?}");
        let mut tree_cache = model.new_cache();
        model
            .forward_one(&mut tree_cache, &committed[..49], Logits::None)
            .unwrap();
        let mask = TreeMask {
            parents: parents.clone(),
        };
        let out = model
            .forward(
                &mut [ForwardInput {
                    cache: &mut tree_cache,
                    tokens: &tokens,
                    logits: Logits::All,
                    tree: Some(&mask),
                }],
                &[],
            )
            .unwrap()
            .remove(0);
        // Plain decoding of the same tokens, one at a time.
        let mut plain_cache = model.new_cache();
        model
            .forward_one(&mut plain_cache, &committed[..49], Logits::None)
            .unwrap();
        let mut plain_rows = vec![
            model
                .forward_one(&mut plain_cache, &tokens[..1], Logits::Last)
                .unwrap()
                .logits,
        ];
        for &i in &path {
            plain_rows.push(
                model
                    .forward_one(&mut plain_cache, &[tokens[i]], Logits::Last)
                    .unwrap()
                    .logits,
            );
        }
        // Every node attends in the layout plain decoding uses: its row is
        // bit-identical, off the first-child line too.
        assert_eq!(out.row(0), &plain_rows[0][..], "{name}: root row");
        for (k, &i) in path.iter().enumerate() {
            assert_eq!(
                out.row(i),
                &plain_rows[k + 1][..],
                "{name}: node {i} at depth {}",
                k + 1
            );
        }
        // Compact the accepted path after the root, truncate, and decode
        // one more token: bit-identical to plain decoding.
        let base = 49;
        let moves: Vec<(usize, usize)> = path
            .iter()
            .enumerate()
            .map(|(k, &i)| (base + i, base + 1 + k))
            .collect();
        tree_cache.compact(&moves).unwrap();
        tree_cache.truncate(base + 1 + path.len()).unwrap();
        let next = [(v / 2) + 1];
        let a = model
            .forward_one(&mut tree_cache, &next, Logits::Last)
            .unwrap()
            .logits;
        let b = model
            .forward_one(&mut plain_cache, &next, Logits::Last)
            .unwrap()
            .logits;
        assert_eq!(
            a, b,
            "{name}: logits after compaction differ from plain decoding"
        );
    }
}

/// The `hidden-probe` fixture plugin, built.
fn hidden_probe_lib() -> std::path::PathBuf {
    common::build_fixture_plugins().join(format!(
        "{}specd_fixture_hidden_probe{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ))
}

#[test]
fn a_plugin_declaring_layers_the_target_lacks_is_refused_when_created() {
    // A layer past the target would fail every forward carrying one of the
    // plugin's sequences, other requests' included: refused up front, in
    // process and in a plugin-host child alike, naming the layer.
    let lib = hidden_probe_lib();
    let (_dir, model) = tiny_model(&TINY, 52);
    let n = model.config.layers;
    for isolation in ["none", "process"] {
        for (layers, needle) in [
            (
                format!("0,{}", n + 1),
                format!(
                    "hidden layer {} declared, but the target has {n} layers",
                    n + 1
                ),
            ),
            (
                "1,0,1".to_string(),
                "hidden layer 1 declared twice".to_string(),
            ),
        ] {
            let cfg = specd::config::Config::parse(
                &format!(
                    "[[proposer]]\nname = \"probe\"\npath = \"{}\"\nisolation = \"{isolation}\"\n[proposer.options]\nlayers = \"{layers}\"\ndump = \"/dev/null\"\n",
                    lib.display(),
                ),
                None,
            )
            .unwrap();
            let e = cfg
                .build_drafter(&model, None)
                .err()
                .unwrap_or_else(|| panic!("{isolation}: layers {layers} accepted"))
                .to_string();
            assert!(
                e.contains(&needle) && e.contains("probe"),
                "{isolation}: {e}"
            );
        }
    }
}

#[test]
fn a_plugin_gets_every_declared_layer_in_its_order_from_prefill_on() {
    let lib = hidden_probe_lib();
    let (dir, model) = tiny_model(&TINY, 51);
    let dump = dir.0.join("hidden.txt");
    let cfg = specd::config::Config::parse(
        &format!(
            "[[proposer]]\nname = \"probe\"\npath = \"{}\"\n[proposer.options]\nlayers = \"2,0\"\ndump = \"{}\"\n",
            lib.display(),
            dump.display()
        ),
        None,
    )
    .unwrap();
    let drafter = cfg.build_drafter(&model, None).unwrap();
    let mut ec = EngineConfig::for_model(&model);
    ec.scheduler.adaptive_draft = false;
    // Prefill in chunks of 16 tokens.
    ec.scheduler.max_batch_tokens = 16;
    let mut e = SyncDriver::new(model.clone(), None, ec, drafter);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 5 + 3) % 90).collect();
    let done = run_all(
        &mut e,
        vec![Request {
            proposer: Some("probe".into()),
            ignore_eos: true,
            ..Request::greedy(prompt.clone(), 12)
        }],
    );
    assert!(
        e.drafter.poisoned("probe").is_none(),
        "{:?}",
        e.drafter.poisoned("probe")
    );
    // Reference: one forward over everything committed, the layers as the
    // model returns them.
    let all: Vec<u32> = prompt.iter().chain(&done[0].tokens).copied().collect();
    let mut c = model.new_cache();
    let r = model
        .forward(
            &mut [ForwardInput {
                cache: &mut c,
                tokens: &all,
                logits: Logits::None,
                tree: None,
            }],
            &[0, 2],
        )
        .unwrap()
        .remove(0);
    let h = model.config.hidden;
    let layer = |l: usize| &r.hidden.iter().find(|(x, _)| *x == l).unwrap().1;
    let mut next = 0usize;
    for line in std::fs::read_to_string(&dump).unwrap().lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let (start, rows, width, layers): (usize, usize, usize, usize) = (
            f[1].parse().unwrap(),
            f[2].parse().unwrap(),
            f[3].parse().unwrap(),
            f[4].parse().unwrap(),
        );
        assert_eq!((width, layers), (h, 2), "{line:.60}");
        assert_eq!(start, next, "rows arrive for every position, in order");
        let vals: Vec<f32> = f[5..].iter().map(|x| x.parse().unwrap()).collect();
        assert_eq!(vals.len(), 2 * rows * h);
        // Declared order: layer 2 first, then layer 0; bit-identical to the
        // reference (batch invariance).
        for (k, l) in [2usize, 0].into_iter().enumerate() {
            assert_eq!(
                &vals[k * rows * h..(k + 1) * rows * h],
                &layer(l)[start * h..(start + rows) * h],
                "layer {l}, positions {start}..{}",
                start + rows
            );
        }
        next = start + rows;
    }
    // The prompt's prefill positions came first, then every decode step's.
    assert!(next >= prompt.len(), "{next}");
}
