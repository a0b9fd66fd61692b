//! Engines over plugin configs, option refusals, seeded first-two-token
//! runs, and the shipped-artefact check on SmolLM2.

use super::*;

/// An engine over `cfg`'s proposers as the head-plugin tests use it: no
/// adaptive drafting (every step drafts what the plugin offers), an
/// unbounded queue.
pub fn plugin_engine(
    model: &std::sync::Arc<specd::model::Model>,
    tok: Option<std::sync::Arc<specd::tokenizer::Tokenizer>>,
    cfg: &specd::config::Config,
    running: usize,
    max_draft: usize,
) -> specd::speculative::driver::SyncDriver {
    let drafter = cfg.build_drafter(model, tok.clone()).unwrap();
    let mut ec = specd::speculative::driver::EngineConfig::for_model(model);
    ec.scheduler.max_running = running;
    ec.scheduler.max_draft = max_draft;
    ec.scheduler.max_waiting = usize::MAX;
    ec.scheduler.adaptive_draft = false;
    specd::speculative::driver::SyncDriver::new(model.clone(), tok, ec, drafter)
}

/// Run `reqs` to completion; completions in request order.
pub fn run_all(
    e: &mut specd::speculative::driver::SyncDriver,
    reqs: Vec<specd::speculative::Request>,
) -> Vec<specd::speculative::Completion> {
    let ids: Vec<u64> = reqs.into_iter().map(|r| e.add(r, None).unwrap()).collect();
    let mut done = e.run_to_completion().unwrap();
    done.sort_by_key(|c| ids.iter().position(|&i| i == c.id).unwrap());
    done
}

/// Each `(option lines, expected text)` case: a proposer of `plugin` with
/// `key = path` and the lines is refused at load with an error containing
/// the text.
pub fn assert_options_refused(
    model: &std::sync::Arc<specd::model::Model>,
    plugin: &str,
    (key, path): (&str, &std::path::Path),
    cases: &[(&str, &str)],
) {
    for (extra, want) in cases {
        let cfg = specd::config::Config::parse(
            &format!(
                "[[proposer]]\nname = \"p\"\nplugin = \"{plugin}\"\n[proposer.options]\n{key} = \"{}\"\n{extra}\n",
                path.display()
            ),
            None,
        )
        .unwrap();
        let e = match cfg.build_drafter(model, None) {
            Ok(_) => panic!("{extra}: accepted"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(want), "{extra}: {e}");
    }
}

/// Counts of the first two sampled tokens of `n` seeded requests (seeds
/// from `seed0`) through proposer `name`, and the tokens accepted and
/// drafted per request.
pub fn first_two_runs(
    model: &std::sync::Arc<specd::model::Model>,
    cfg: &specd::config::Config,
    name: &str,
    prompt: &[u32],
    params: &specd::sampler::SamplingParams,
    n: usize,
    seed0: u64,
) -> (Vec<u64>, f64, f64) {
    use specd::speculative::Request;
    let v = model.config.vocab_size;
    let mut e = plugin_engine(model, None, cfg, 64, 16);
    let reqs = (0..n)
        .map(|i| Request {
            params: specd::sampler::SamplingParams {
                seed: seed0 + i as u64,
                ..params.clone()
            },
            proposer: Some(name.into()),
            ignore_eos: true,
            ..Request::greedy(prompt.to_vec(), 3)
        })
        .collect();
    let done = run_all(&mut e, reqs);
    assert!(e.drafter.poisoned(name).is_none(), "{name} poisoned");
    let mut counts = vec![0u64; v * v];
    for c in &done {
        counts[c.tokens[0] as usize * v + c.tokens[1] as usize] += 1;
    }
    let accepted: u64 = done.iter().map(|c| c.stats.accepted).sum();
    let drafted: u64 = done.iter().map(|c| c.stats.drafted).sum();
    (
        counts,
        accepted as f64 / n as f64,
        drafted as f64 / n as f64,
    )
}

/// `texts` as chat-templated user turns, encoded.
pub fn chat_prompts(tok: &specd::tokenizer::Tokenizer, texts: &[&str]) -> Vec<Vec<u32>> {
    texts
        .iter()
        .map(|t| {
            let chat = tok
                .apply_chat_template(&[specd::tokenizer::ChatMessage::user(*t)], true)
                .unwrap();
            tok.encode(&chat, false).unwrap()
        })
        .collect()
}

/// A shipped head or module on SmolLM2 through `config` (a path under the
/// repository): greedy chat requests of each of `names` and of plain
/// decoding, batched together, equal plain decoding token for token and
/// in their logprobs bit for bit; each named proposer is not poisoned and
/// its mean accepted length is above `floor(name)`.
pub fn shipped_is_lossless_and_accepted(
    config: &str,
    names: &[&str],
    max_draft: usize,
    floor: impl Fn(&str) -> f64,
) {
    use specd::speculative::Request;
    let path = smollm_path();
    let model = std::sync::Arc::new(specd::model::load_model(&path, 2).unwrap());
    let tok = std::sync::Arc::new(specd::tokenizer::Tokenizer::for_model(&path).unwrap());
    let cfg = specd::config::Config::load(&repo_root().join(config)).unwrap();
    let mut e = plugin_engine(&model, Some(tok.clone()), &cfg, 12, max_draft);
    let prompts = chat_prompts(
        &tok,
        &[
            "Explain why the sky is blue in two sentences.",
            "Write a Python function that checks whether a string is a palindrome.",
            "List four uses of copper.",
        ],
    );
    let n = 48;
    let reqs: Vec<Request> = names
        .iter()
        .chain(&["none"])
        .flat_map(|name| {
            prompts.iter().map(move |p| Request {
                proposer: Some(name.to_string()),
                ignore_eos: true,
                logprobs: Some(2),
                ..Request::greedy(p.clone(), n)
            })
        })
        .collect();
    let done = run_all(&mut e, reqs);
    let plain = &done[names.len() * prompts.len()..];
    for (i, c) in done.iter().enumerate() {
        let want = &plain[i % prompts.len()];
        assert_eq!(
            c.tokens, want.tokens,
            "{} differs from plain decoding",
            c.stats.proposer
        );
        assert_eq!(c.logprobs.len(), n);
        assert_eq!(c.logprobs, want.logprobs, "{}", c.stats.proposer);
    }
    for &name in names {
        let mut s = specd::speculative::SpecStats::default();
        for c in done.iter().filter(|c| c.stats.proposer == name) {
            s.add(&c.stats);
        }
        eprintln!(
            "{name}: mean accepted length {:.2}, {}/{} drafted tokens accepted",
            s.mean_accepted_len(),
            s.accepted,
            s.drafted,
        );
        assert!(e.drafter.poisoned(name).is_none(), "{name} poisoned");
        assert!(
            s.mean_accepted_len() > floor(name),
            "{name}: the shipped head must be accepted: {:.2}",
            s.mean_accepted_len()
        );
    }
}

/// The target's features of `layers` (hidden indices) for `tokens`, row
/// by row, layers side by side.
pub fn target_features(model: &specd::model::Model, tokens: &[u32], layers: &[usize]) -> Vec<f32> {
    let h = model.config.hidden;
    let mut c = model.new_cache();
    let out = model
        .forward(
            &mut [specd::model::ForwardInput {
                cache: &mut c,
                tokens,
                logits: specd::model::Logits::None,
                tree: None,
            }],
            layers,
        )
        .unwrap()
        .pop()
        .unwrap();
    let mut f = vec![0f32; tokens.len() * layers.len() * h];
    for (li, (_, rows)) in out.hidden.iter().enumerate() {
        for r in 0..tokens.len() {
            let dst = r * layers.len() * h + li * h;
            f[dst..dst + h].copy_from_slice(&rows[r * h..(r + 1) * h]);
        }
    }
    f
}
