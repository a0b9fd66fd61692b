//! Proposer plugins end to end: the built-in ngram and suffix cdylibs, the
//! out-of-tree example, broken libraries, panics, and config errors.

use specd_test_kit as common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::{TempDir, TINY};
use specd::config::Config;
use specd::model::{load_model, Model};
use specd::plain::generate;
use specd::plugins;
use specd::speculative::driver::{EngineConfig, SyncDriver};
use specd::speculative::proposer::QKind;
use specd::speculative::{Completion, Request};
use specd::tokenizer::Tokenizer;

use common::build_out_of_tree;

fn lib_file(dir: &Path, stem: &str) -> PathBuf {
    dir.join(format!(
        "{}{stem}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ))
}

fn tiny() -> (TempDir, Arc<Model>) {
    let dir = TempDir::new("plugins-tiny");
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, &TINY, 21, GgmlDType::Q4_1, "llama");
    let m = Arc::new(load_model(&path, 2).unwrap());
    (dir, m)
}

fn run(
    model: &Arc<Model>,
    cfg: &Config,
    proposer: &str,
    prompts: &[Vec<u32>],
    n: usize,
    tok: Option<Arc<Tokenizer>>,
) -> (SyncDriver, Vec<Completion>) {
    let drafter = cfg.build_drafter(model, tok.clone()).unwrap();
    let mut ec = EngineConfig::for_model(model);
    ec.scheduler.max_running = 4;
    ec.scheduler.max_draft = 8;
    let mut e = SyncDriver::new(model.clone(), tok, ec, drafter);
    let ids: Vec<u64> = prompts
        .iter()
        .map(|p| {
            e.add(
                Request {
                    proposer: Some(proposer.into()),
                    ..Request::greedy(p.clone(), n)
                },
                None,
            )
            .unwrap()
        })
        .collect();
    let mut done = e.run_to_completion().unwrap();
    done.sort_by_key(|c| ids.iter().position(|&i| i == c.id).unwrap());
    (e, done)
}

fn plain(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    generate(model, None, &Request::greedy(prompt.to_vec(), n), |_| {})
        .unwrap()
        .tokens
}

#[test]
fn ngram_suffix_and_the_corpus_are_lossless_on_20_humaneval_prompts() {
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    let data = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/humaneval_first20.jsonl"
    ))
    .unwrap();
    let prompts: Vec<Vec<u32>> = data
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            tok.encode(v["prompt"].as_str().unwrap(), false).unwrap()
        })
        .collect();
    assert_eq!(prompts.len(), 20);
    let n = 48;
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| plain(&model, p, n)).collect();
    // Suffix drafting from the built-in corpus of SmolLM2's own outputs:
    // without the per-request and global trees every draft is the corpus's.
    let corpus = Config::parse(
        "[[proposer]]\nname = \"corpus\"\nplugin = \"suffix\"\nmax_draft = 8\n\
         [proposer.options]\ncorpus = \"builtin\"\nglobal = false\nmin_match = 1000\n\
         [[proposer]]\nname = \"corpus-tree\"\nplugin = \"suffix\"\nmax_draft = 16\n\
         [proposer.options]\ncorpus = \"auto\"\ntree = true\n",
        None,
    )
    .unwrap();
    let builtin = Config::builtin();
    for (cfg, proposer) in [
        (&builtin, "ngram"),
        (&builtin, "suffix"),
        (&builtin, "suffix-tree"),
        (&builtin, "ngram-tree"),
        (&corpus, "corpus"),
        (&corpus, "corpus-tree"),
    ] {
        let (_, done) = run(&model, cfg, proposer, &prompts, n, Some(tok.clone()));
        let (mut drafted, mut accepted) = (0, 0);
        for (i, (c, w)) in done.iter().zip(&want).enumerate() {
            assert_eq!(
                &c.tokens, w,
                "{proposer}: HumanEval/{i} differs from plain decoding"
            );
            drafted += c.stats.drafted;
            accepted += c.stats.accepted;
        }
        assert!(
            accepted > 0,
            "{proposer}: drafted {drafted}, accepted {accepted}"
        );
    }
}

/// A specd corpus directory holding `docs` as responses (empty prompts),
/// in the shard format `specd distill corpus` writes.
fn write_corpus(dir: &Path, docs: &[Vec<u32>]) {
    use std::io::Write;
    std::fs::create_dir_all(dir).unwrap();
    let mut raw = b"SPECDCORPUS1".to_vec();
    for d in docs {
        raw.push(0);
        raw.extend_from_slice(&1.0f32.to_le_bytes());
        raw.extend_from_slice(&0u64.to_le_bytes());
        raw.extend_from_slice(&0u32.to_le_bytes());
        raw.extend_from_slice(&0u32.to_le_bytes());
        raw.extend_from_slice(&(d.len() as u32).to_le_bytes());
        for t in d {
            raw.extend_from_slice(&t.to_le_bytes());
        }
    }
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(&raw).unwrap();
    std::fs::write(dir.join("shard-0000.bin.gz"), e.finish().unwrap()).unwrap();
}

#[test]
fn a_suffix_tree_below_its_score_floor_is_not_drafted() {
    // Every token of a 12-token vocabulary is followed by three others in
    // the prompt (counts 2, 1, 1), so a one-token match's first nodes score
    // at most 0.5: a floor of 0.6 leaves out what no floor drafts, and the
    // output stays plain decoding's either way.
    let spec = common::TinySpec { vocab: 12, ..TINY };
    let dir = TempDir::new("plugins-floor");
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, &spec, 8, GgmlDType::Q4_1, "llama");
    let model = Arc::new(load_model(&path, 2).unwrap());
    let prompt: Vec<u32> = (0..12u32)
        .flat_map(|x| [x, (x + 1) % 12, x, (x + 2) % 12])
        .collect();
    let n = 24;
    let want = plain(&model, &prompt, n);
    let drafted = |floor: f64| {
        let cfg = Config::parse(
            &format!(
                "[[proposer]]\nname = \"t\"\nplugin = \"suffix\"\nmax_draft = 8\n\
                 [proposer.options]\ntree = true\nglobal = false\nmin_score = {floor}\n"
            ),
            None,
        )
        .unwrap();
        let mut ec = EngineConfig::for_model(&model);
        ec.scheduler.adaptive_draft = false;
        let drafter = cfg.build_drafter(&model, None).unwrap();
        let mut e = SyncDriver::new(model.clone(), None, ec, drafter);
        e.add(
            Request {
                proposer: Some("t".into()),
                ignore_eos: true,
                ..Request::greedy(prompt.clone(), n)
            },
            None,
        )
        .unwrap();
        let done = e.run_to_completion().unwrap();
        assert_eq!(done[0].tokens, want, "min_score {floor}");
        done[0].stats.drafted
    };
    let (all, floored) = (drafted(0.0), drafted(0.6));
    eprintln!("drafted without a floor {all}, with 0.6 {floored}");
    assert!(all > 0 && floored < all, "{all} vs {floored}");
}

#[test]
fn the_built_in_corpus_is_refused_for_another_vocabulary() {
    // The built-in corpus is SmolLM2's: refused by name for another
    // vocabulary, skipped under `auto`.
    let (_d, tiny) = tiny();
    let bad = Config::parse(
        "[[proposer]]\nname = \"c\"\nplugin = \"suffix\"\n[proposer.options]\ncorpus = \"builtin\"\n",
        None,
    )
    .unwrap();
    let Err(e) = bad.build_drafter(&tiny, None) else {
        panic!("the built-in corpus was accepted for another vocabulary")
    };
    let e = e.to_string();
    assert!(e.contains("vocabulary differs"), "{e}");
    let auto = Config::parse(
        "[[proposer]]\nname = \"c\"\nplugin = \"suffix\"\n[proposer.options]\ncorpus = \"auto\"\n",
        None,
    )
    .unwrap();
    assert!(auto.build_drafter(&tiny, None).is_ok());
}

#[test]
fn suffix_drafting_from_a_corpus_keeps_the_sampled_distribution() {
    let spec = common::TinySpec { vocab: 12, ..TINY };
    let dir = TempDir::new("plugins-corpus-stat");
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, &spec, 8, GgmlDType::Q4_1, "llama");
    let model = Arc::new(load_model(&path, 2).unwrap());
    // The prompt never repeats and the global tree is off: only the corpus
    // can draft, and it continues the prompt's last tokens several ways.
    let prompt = [3u32, 7, 1, 9, 2];
    let corpus = dir.0.join("corpus");
    write_corpus(
        &corpus,
        &[
            vec![1, 9, 2, 5, 6, 4],
            vec![9, 2, 5, 6, 8],
            vec![4, 1, 9, 2, 5, 0, 11],
            vec![9, 2, 10, 3],
        ],
    );
    let missing = Config::parse(
        "[[proposer]]\nname = \"c\"\nplugin = \"suffix\"\n[proposer.options]\ncorpus = \"/no/such/corpus\"\n",
        None,
    )
    .unwrap();
    let Err(e) = missing.build_drafter(&model, None) else {
        panic!("a missing corpus was accepted")
    };
    let e = e.to_string();
    assert!(e.contains("/no/such/corpus"), "{e}");
    for (name, tree) in [("corpus", false), ("corpus-tree", true)] {
        let cfg = Config::parse(
            &format!(
                "[[proposer]]\nname = \"{name}\"\nplugin = \"suffix\"\nmax_draft = 8\n\
                 [proposer.options]\ncorpus = \"{}\"\nglobal = false\ntree = {tree}\n\
                 corpus_min_prob = 0.2\n",
                corpus.display()
            ),
            None,
        )
        .unwrap();
        assert_keeps_first_two(&model, &cfg, name, &prompt, 91_000, 15_000);
    }
}

#[test]
fn out_of_tree_example_loads_by_path_and_is_lossless() {
    let release = build_out_of_tree("plugins/example");
    let lib = lib_file(&release, "specd_example_proposer");
    let (_d, model) = tiny();
    let cfg = Config::parse(
        &format!(
            "[[proposer]]\nname = \"bigram\"\npath = \"{}\"\nmax_draft = 3\n",
            lib.display()
        ),
        None,
    )
    .unwrap();
    let prompts = vec![vec![5u32, 6, 7, 5, 6, 7, 5, 6], vec![9, 10, 11, 12, 9, 10]];
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| plain(&model, p, 30)).collect();
    let (e, done) = run(&model, &cfg, "bigram", &prompts, 30, None);
    for (c, w) in done.iter().zip(&want) {
        assert_eq!(&c.tokens, w);
        assert!(c.stats.drafted > 0, "the example drafted");
    }
    assert!(e.drafter.poisoned("bigram").is_none());
    let l = plugins::load_library(&lib).unwrap();
    assert_eq!(l.name, "example-bigram");
    assert!(l.build_id.contains("abi2."), "{}", l.build_id);
}

#[test]
fn trust_q_false_makes_a_full_q_plugin_verified_as_point_masses() {
    // The example in tree mode reports full q; `trust_q = false` wraps it
    // so the engine sees (and verifies) one-hot drafts.
    let release = build_out_of_tree("plugins/example");
    let lib = lib_file(&release, "specd_example_proposer");
    let (_d, model) = tiny();
    for (trust, want) in [("", QKind::Full), ("trust_q = false\n", QKind::OneHot)] {
        let cfg = Config::parse(
            &format!(
                "[[proposer]]\nname = \"bigram\"\npath = \"{}\"\n{trust}[proposer.options]\ntree = true\n",
                lib.display()
            ),
            None,
        )
        .unwrap();
        let d = cfg.build_drafter(&model, None).unwrap();
        assert_eq!(d.capabilities("bigram").unwrap().q_kind, want, "{trust:?}");
    }
}

#[test]
fn a_plugin_that_panics_in_propose_leaves_requests_completing_plainly() {
    let release = build_out_of_tree("plugins/example");
    let lib = lib_file(&release, "specd_example_proposer");
    let (_d, model) = tiny();
    let cfg = Config::parse(
        &format!(
            "[[proposer]]\nname = \"boom\"\npath = \"{}\"\n[proposer.options]\npanic_on_propose = true\n",
            lib.display()
        ),
        None,
    )
    .unwrap();
    let prompts = vec![vec![5u32, 6, 7, 5, 6, 7], vec![3, 4, 3, 4]];
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| plain(&model, p, 20)).collect();
    let (e, done) = run(&model, &cfg, "boom", &prompts, 20, None);
    for (c, w) in done.iter().zip(&want) {
        assert_eq!(
            &c.tokens, w,
            "a failing plugin must not change or lose output"
        );
    }
    let why = e.drafter.poisoned("boom").expect("poisoned");
    assert!(
        why.contains("panicked") && why.contains("asked to panic"),
        "{why}"
    );
}

#[test]
fn broken_libraries_give_clear_errors() {
    let release = build_out_of_tree("tests/fixtures/plugins");
    let e = plugins::load_library(&lib_file(&release, "specd_fixture_bad_abi"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("ABI mismatch") && e.contains("999.0") && e.contains("ABI 2."),
        "{e}"
    );
    // A plugin built for ABI 1 (before trees and size-prefixed structs) is
    // refused, naming both versions, before anything of it is called.
    let e = plugins::load_library(&lib_file(&release, "specd_fixture_abi1"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("plugin built for ABI 1.0, this host speaks ABI 2.2"),
        "{e}"
    );
    // A panic in `default_capabilities` stays in the plugin's entry point.
    let e = plugins::load_library(&lib_file(&release, "specd_fixture_panicky_caps"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("entry symbol returned no descriptor"), "{e}");
    let e = plugins::load_library(&lib_file(&release, "specd_fixture_no_entry"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("missing entry symbol `specd_proposer_entry`"),
        "{e}"
    );
    let dir = TempDir::new("notalib");
    let fake = dir.0.join("libspecd_proposer_fake.so");
    std::fs::write(&fake, "this is text, not a shared library").unwrap();
    let e = plugins::load_library(&fake).unwrap_err().to_string();
    assert!(e.contains("not a loadable library"), "{e}");
    let e = plugins::find_plugin("zzz", std::slice::from_ref(&dir.0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown plugin 'zzz'"), "{e}");
    // Config pointing at the fake library: the proposer entry is named.
    let (_d, model) = tiny();
    let cfg = Config::parse(
        &format!(
            "[[proposer]]\nname = \"fake\"\npath = \"{}\"\n",
            fake.display()
        ),
        None,
    )
    .unwrap();
    let e = cfg.build_drafter(&model, None).unwrap_err().to_string();
    assert!(
        e.contains("proposer `fake`") && e.contains("not a loadable library"),
        "{e}"
    );
}

#[test]
fn plugin_options_are_checked_with_the_key_named() {
    let (_d, model) = tiny();
    let cfg = Config::parse(
        "[[proposer]]\nname = \"ngram\"\n[proposer.options]\nmax_m = 3\n",
        None,
    )
    .unwrap();
    let e = cfg.build_drafter(&model, None).unwrap_err().to_string();
    assert!(e.contains("unknown option `max_m`"), "{e}");
    let cfg = Config::parse(
        "[[proposer]]\nname = \"ngram\"\n[proposer.options]\nmax_n = \"three\"\n",
        None,
    )
    .unwrap();
    let e = cfg.build_drafter(&model, None).unwrap_err().to_string();
    assert!(e.contains("option `max_n`: expected an integer"), "{e}");
}

#[test]
fn a_plugin_declaring_an_absurd_draft_limit_is_refused_when_created() {
    // The host sizes a propose call's buffers by the declared limit (a
    // shadow drafts at it): a limit of millions would allocate gigabytes
    // per sequence, so it is refused up front, in process and in a
    // plugin-host child alike.
    let (_d, model) = tiny();
    for isolation in ["none", "process"] {
        let cfg = Config::parse(
            &format!(
                "[[proposer]]\nname = \"ngram\"\nisolation = \"{isolation}\"\n[proposer.options]\nmax_draft = 1000000\n"
            ),
            None,
        )
        .unwrap();
        let e = cfg.build_drafter(&model, None).unwrap_err().to_string();
        assert!(
            e.contains("max_draft 1000000 declared, at most 256"),
            "{isolation}: {e}"
        );
        // The largest allowed still loads.
        let cfg = Config::parse(
            &format!(
                "[[proposer]]\nname = \"ngram\"\nisolation = \"{isolation}\"\n[proposer.options]\nmax_draft = 256\n"
            ),
            None,
        )
        .unwrap();
        assert!(cfg.build_drafter(&model, None).is_ok(), "{isolation}");
    }
}

/// Sample the first two tokens of `prompt` 20,000 times (temperature 1,
/// seeds from `seed0`) with `proposer` drafting at least `min_drafted`
/// tokens: their distribution equals the target's (chi-square), and the
/// same test rejects a lossy residual (resampled from p).
fn assert_keeps_first_two(
    model: &Arc<Model>,
    cfg: &Config,
    proposer: &str,
    prompt: &[u32],
    seed0: u64,
    min_drafted: u64,
) {
    use specd::sampler::SamplingParams;
    use specd::speculative::accept::Acceptance;
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let exact = common::exact_first_two(model, prompt, &params);
    let v = model.config.vocab_size;
    let sample = |acceptance: Acceptance| {
        let drafter = cfg.build_drafter(model, None).unwrap();
        let mut ec = EngineConfig::for_model(model);
        ec.scheduler.max_running = 64;
        ec.scheduler.max_waiting = usize::MAX;
        ec.scheduler.adaptive_draft = false;
        let mut e = SyncDriver::new(model.clone(), None, ec, drafter);
        e.acceptor.acceptance = acceptance;
        for i in 0..20_000u64 {
            e.add(
                Request {
                    params: SamplingParams {
                        seed: seed0 + i,
                        ..params.clone()
                    },
                    proposer: Some(proposer.into()),
                    ignore_eos: true,
                    ..Request::greedy(prompt.to_vec(), 3)
                },
                None,
            )
            .unwrap();
        }
        let done = e.run_to_completion().unwrap();
        let mut counts = vec![0u64; v * v];
        let drafted: u64 = done.iter().map(|c| c.stats.drafted).sum();
        assert!(drafted > min_drafted, "{proposer} must draft: {drafted}");
        for c in &done {
            counts[c.tokens[0] as usize * v + c.tokens[1] as usize] += 1;
        }
        counts
    };
    let (stat, df) = common::chi_square(&sample(Acceptance::Exact), &exact);
    let crit = common::chi2_crit_999(df);
    eprintln!("{proposer}: chi2 {stat:.1} (df {df}, 0.1% critical {crit:.1})");
    assert!(
        stat < crit,
        "{proposer}: sampled distribution differs: {stat} > {crit}"
    );
    let (bad, bdf) = common::chi_square(&sample(Acceptance::ResidualFromP), &exact);
    eprintln!("{proposer}: residual from p: chi2 {bad:.1} (df {bdf})");
    assert!(
        bad > common::chi2_crit_999(bdf),
        "{proposer}: a lossy residual went unnoticed: {bad}"
    );
}

/// The sampled distribution of the first two tokens with each built-in
/// (one-hot) proposer equals the target's, and the same test catches a
/// residual that resamples from p.
#[test]
fn ngram_and_suffix_keep_the_sampled_distribution() {
    let spec = common::TinySpec { vocab: 12, ..TINY };
    let dir = TempDir::new("plugins-stat");
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, &spec, 8, GgmlDType::Q4_1, "llama");
    let model = Arc::new(load_model(&path, 2).unwrap());
    // The prompt repeats, so both proposers draft from the first step on.
    let prompt = [3u32, 7, 1, 9, 3, 7, 1, 9, 3, 7];
    let cfg = Config::builtin();
    for proposer in ["ngram", "suffix", "suffix-tree", "ngram-tree"] {
        assert_keeps_first_two(&model, &cfg, proposer, &prompt, 77_000, 10_000);
    }
}

#[test]
fn host_callbacks_refuse_overflowing_sizes_instead_of_touching_memory() {
    let (_d, model) = tiny();
    let dirs = plugins::plugin_dirs(&[]);
    let lib = plugins::load_library(&plugins::find_plugin("ngram", &dirs).unwrap()).unwrap();
    let p = plugins::PluginProposer::create(
        "ngram",
        lib,
        &toml::Table::new(),
        Some(model.clone()),
        None,
    )
    .unwrap();
    let api = *p.host_api();
    let (embed, lm_head) = (api.embed.unwrap(), api.lm_head.unwrap());
    let (h, v) = (model.config.hidden, model.config.vocab_size);
    let tokens = [1u32, 2, 3];
    let mut out = vec![0f32; 3 * h];
    // SAFETY: the callbacks are called as a plugin would, with live buffers
    // whose true sizes are passed as capacities; the lengths are the lies
    // under test, which the host must refuse before reading anything.
    unsafe {
        let n = embed(api.ctx, tokens.as_ptr(), 3, out.as_mut_ptr(), out.len());
        assert_eq!(n, 3 * h, "a valid call works");
        let n = embed(
            api.ctx,
            tokens.as_ptr(),
            usize::MAX / 2,
            out.as_mut_ptr(),
            out.len(),
        );
        assert_eq!(n, 0, "n * hidden overflows");
        let bad = [v as u32];
        let n = embed(api.ctx, bad.as_ptr(), 1, out.as_mut_ptr(), out.len());
        assert_eq!(n, 0, "token outside the vocabulary");
        let mut logits = vec![0f32; v];
        let n = lm_head(api.ctx, out.as_ptr(), 1, logits.as_mut_ptr(), logits.len());
        assert_eq!(n, v);
        let n = lm_head(
            api.ctx,
            out.as_ptr(),
            usize::MAX / 3,
            logits.as_mut_ptr(),
            usize::MAX,
        );
        assert_eq!(n, 0, "rows * vocab overflows");
        let n = embed(
            std::ptr::null_mut(),
            tokens.as_ptr(),
            3,
            out.as_mut_ptr(),
            out.len(),
        );
        assert_eq!(n, 0, "no context");
    }
}

#[test]
fn out_of_tree_example_drafts_trees_through_the_abi_losslessly() {
    use specd::sampler::SamplingParams;
    use specd::speculative::accept::Acceptance;
    let release = build_out_of_tree("plugins/example");
    let lib = lib_file(&release, "specd_example_proposer");
    let cfg = Config::parse(
        &format!(
            "[[proposer]]\nname = \"bigram-tree\"\npath = \"{}\"\nmax_draft = 9\n[proposer.options]\ntree = true\nwidth = 3\n",
            lib.display()
        ),
        None,
    )
    .unwrap();
    // Greedy: identical to plain decoding, batched.
    let (_d, model) = tiny();
    let prompts = vec![vec![5u32, 6, 7, 5, 6, 7, 5, 6], vec![9, 10, 11, 12, 9, 10]];
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| plain(&model, p, 30)).collect();
    let (e, done) = run(&model, &cfg, "bigram-tree", &prompts, 30, None);
    assert!(
        e.drafter.poisoned("bigram-tree").is_none(),
        "{:?}",
        e.drafter.poisoned("bigram-tree")
    );
    for (c, w) in done.iter().zip(&want) {
        assert_eq!(&c.tokens, w);
        assert!(c.stats.drafted > 0 && c.stats.accepted > 0, "{:?}", c.stats);
    }
    // Sampling: trees whose siblings are drawn without replacement from a
    // full q that only the first child carries across the ABI.
    let spec = common::TinySpec { vocab: 12, ..TINY };
    let dir = TempDir::new("plugins-tree-stat");
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, &spec, 8, GgmlDType::Q4_1, "llama");
    let model = Arc::new(load_model(&path, 2).unwrap());
    let prompt = [3u32, 7, 1, 9, 3, 7, 1, 9, 3, 7];
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let exact = common::exact_first_two(&model, &prompt, &params);
    let sample = |acceptance: Acceptance| {
        let drafter = cfg.build_drafter(&model, None).unwrap();
        let mut ec = EngineConfig::for_model(&model);
        ec.scheduler.max_running = 64;
        ec.scheduler.max_waiting = usize::MAX;
        ec.scheduler.adaptive_draft = false;
        let mut e = SyncDriver::new(model.clone(), None, ec, drafter);
        e.acceptor.acceptance = acceptance;
        for i in 0..12_000u64 {
            e.add(
                Request {
                    params: SamplingParams {
                        seed: 91_000 + i,
                        ..params.clone()
                    },
                    proposer: Some("bigram-tree".into()),
                    ignore_eos: true,
                    ..Request::greedy(prompt.to_vec(), 3)
                },
                None,
            )
            .unwrap();
        }
        let done = e.run_to_completion().unwrap();
        assert!(
            e.drafter.poisoned("bigram-tree").is_none(),
            "{:?}",
            e.drafter.poisoned("bigram-tree")
        );
        let accepted: u64 = done.iter().map(|c| c.stats.accepted).sum();
        assert!(accepted > 6_000, "the trees are accepted: {accepted}");
        let v = spec.vocab;
        let mut counts = vec![0u64; v * v];
        for c in &done {
            counts[c.tokens[0] as usize * v + c.tokens[1] as usize] += 1;
        }
        counts
    };
    let (stat, df) = common::chi_square(&sample(Acceptance::Exact), &exact);
    let crit = common::chi2_crit_999(df);
    eprintln!("example trees: chi2 {stat:.1} (df {df}, 0.1% critical {crit:.1})");
    assert!(stat < crit, "sampled distribution differs: {stat} > {crit}");
    let (bad, bdf) = common::chi_square(&sample(Acceptance::ResidualFromP), &exact);
    eprintln!("example trees, residual from p: chi2 {bad:.1} (df {bdf})");
    assert!(
        bad > 1.5 * common::chi2_crit_999(bdf),
        "a lossy residual went unnoticed: {bad}"
    );
}

/// A plugin built with `panic = "abort"` could take the daemon down with
/// one panic (there is nothing for the host to catch): `export_proposer!`
/// refuses to compile it, saying why.
#[test]
fn a_plugin_built_with_panic_abort_does_not_compile() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/panic-abort");
    let target = common::target_dir().join("out-of-tree-panic-abort");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["build", "--release", "--offline", "--quiet"])
        .current_dir(&dir)
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a panic = \"abort\" plugin compiled");
    assert!(
        stderr.contains("export_proposer!: this plugin is built with panic = \"abort\"")
            && stderr.contains("panic = \"unwind\""),
        "{stderr}"
    );
}
