//! Structured outputs: constraints compiled by llguidance over specd's
//! tokenizer, lossless under every proposer (greedy identity with plain
//! constrained decoding, the sampled constrained law), forced tokens
//! drafted for free, and schema-valid output.

use specd_test_kit as common;

use std::sync::Arc;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use common::{TempDir, TinySpec, TINY};
use specd::config::Config;
use specd::model::{load_model, Model};
use specd::plain::generate;
use specd::sampler::{FinishReason, SamplingParams};
use specd::speculative::accept::Acceptance;
use specd::speculative::driver::{EngineConfig, SyncDriver};
use specd::speculative::{Completion, Request};
use specd::structured::{ConstraintSpec, Grammars};
use specd::tokenizer::{ChatMessage, Tokenizer};

struct Smol {
    model: Arc<Model>,
    tok: Arc<Tokenizer>,
    grammars: Grammars,
}

fn smol() -> Smol {
    let path = common::smollm_path();
    let model = Arc::new(load_model(&path, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(&path).unwrap());
    let grammars =
        Grammars::new(&tok, model.config.vocab_size, &model.config.eos_token_ids).unwrap();
    Smol {
        model,
        tok,
        grammars,
    }
}

fn chat(tok: &Tokenizer, q: &str) -> Vec<u32> {
    let text = tok
        .apply_chat_template(&[ChatMessage::user(q)], true)
        .unwrap();
    tok.encode(&text, false).unwrap()
}

fn run(s: &Smol, proposer_cfg: &Config, reqs: Vec<Request>) -> (SyncDriver, Vec<Completion>) {
    let drafter = proposer_cfg
        .build_drafter(&s.model, Some(s.tok.clone()))
        .unwrap();
    let mut ec = EngineConfig::for_model(&s.model);
    ec.scheduler.max_running = 8;
    ec.scheduler.max_draft = 8;
    let mut e = SyncDriver::new(s.model.clone(), Some(s.tok.clone()), ec, drafter);
    let ids: Vec<u64> = reqs.into_iter().map(|r| e.add(r, None).unwrap()).collect();
    let mut done = e.run_to_completion().unwrap();
    done.sort_by_key(|c| ids.iter().position(|&i| i == c.id).unwrap());
    (e, done)
}

#[test]
fn a_schema_constrains_plain_decoding_to_valid_json() {
    let s = smol();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    });
    let c = s
        .grammars
        .compile(
            &ConstraintSpec::JsonSchema(schema.clone()),
            "response_format",
        )
        .unwrap();
    eprintln!(
        "initial forced: {:?}",
        s.tok.decode(c.initial_forced(), false)
    );
    let req = Request {
        constraint: Some(c),
        ..Request::greedy(chat(&s.tok, "Describe a person as JSON."), 96)
    };
    let out = generate(&s.model, Some(&s.tok), &req, |_| {}).unwrap();
    eprintln!("{:?} {:?}", out.text, out.finish);
    assert_eq!(out.finish, FinishReason::Stop);
    let v: serde_json::Value = serde_json::from_str(&out.text).unwrap();
    assert!(jsonschema::is_valid(&schema, &v), "{v}");
}

fn person_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "city": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "languages": {"type": "array", "items": {"enum": ["python", "rust", "c", "go"]}, "maxItems": 3}
        },
        "required": ["name", "city", "age", "languages"],
        "additionalProperties": false
    })
}

/// Every proposer (chains, trees, trained heads, composed) with constrained
/// and unconstrained sequences in one batch, forced drafts on and off:
/// greedy output equals plain constrained decoding token for token.
#[test]
fn greedy_constrained_output_is_identical_with_every_proposer_batched() {
    let s = smol();
    let schema = person_schema();
    let json = s
        .grammars
        .compile(
            &ConstraintSpec::JsonSchema(schema.clone()),
            "response_format",
        )
        .unwrap();
    let regex = s
        .grammars
        .compile(
            &ConstraintSpec::Regex(r"(Yes|No), because [a-z ,]{10,60}\.".into()),
            "regex",
        )
        .unwrap();
    let prompts = [
        chat(
            &s.tok,
            "Give the name, city, age and languages of a programmer as JSON.",
        ),
        chat(&s.tok, "Is the sky blue? Answer yes or no and explain."),
        chat(&s.tok, "List three fruits."),
        chat(
            &s.tok,
            "Give the name, city, age and languages of a teacher as JSON.",
        ),
    ];
    let n = 72;
    // How many tokens the first request's JSON takes (plain decoding).
    let exact = {
        let r = Request {
            constraint: Some(json.clone()),
            ..Request::greedy(prompts[0].clone(), n)
        };
        generate(&s.model, Some(&s.tok), &r, |_| {})
            .unwrap()
            .tokens
            .len()
    };
    let reqs = |proposer: &str| -> Vec<Request> {
        let mk = |i: usize, c: Option<&specd::structured::Constraint>, forced: bool| Request {
            proposer: Some(proposer.into()),
            constraint: c.cloned(),
            forced_drafts: forced,
            ..Request::greedy(prompts[i].clone(), n)
        };
        vec![
            mk(0, Some(&json), true),
            mk(1, Some(&regex), true),
            mk(2, None, true),
            mk(3, Some(&json), false),
            // Ends where the schema completes, end of sequence or not (the
            // completing token is often a drafted `}` with rows after it).
            Request {
                ignore_eos: true,
                ..mk(3, Some(&json), true)
            },
            // The output completes the schema exactly at max_tokens: `stop`,
            // as in plain decoding.
            Request {
                max_tokens: exact,
                ..mk(0, Some(&json), true)
            },
        ]
    };
    let plain: Vec<_> = reqs("none")
        .iter()
        .map(|r| generate(&s.model, Some(&s.tok), r, |_| {}).unwrap())
        .collect();
    assert_eq!(plain[4].finish, FinishReason::Stop);
    assert_eq!(plain[5].finish, FinishReason::Stop);
    assert_eq!(plain[5].tokens.len(), exact);
    let want: Vec<Vec<u32>> = plain.iter().map(|g| g.tokens.clone()).collect();
    for w in [&want[0], &want[3]] {
        let text = s.tok.decode(w, false).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(jsonschema::is_valid(&schema, &v), "{text}");
    }
    let all = Config::load(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/configs/ab/all.toml"
    )))
    .unwrap();
    let builtin = Config::builtin();
    let cases: Vec<(&Config, &str)> = [
        "none",
        "ngram",
        "suffix",
        "draft",
        "eagle",
        "medusa",
        "medusa-tree",
        "mtp",
        "compose",
    ]
    .iter()
    .map(|p| (&all, *p))
    .chain([(&builtin, "suffix-tree"), (&builtin, "ngram-tree")])
    .collect();
    for (cfg, proposer) in cases {
        let (e, done) = run(&s, cfg, reqs(proposer));
        for (i, (c, w)) in done.iter().zip(&plain).enumerate() {
            assert_eq!(
                c.tokens, w.tokens,
                "{proposer}: request {i} differs from plain decoding"
            );
            assert_eq!(c.finish, w.finish, "{proposer}: request {i}'s finish");
        }
        assert!(
            e.drafter.poisoned(proposer).is_none(),
            "{proposer} poisoned"
        );
        // The forced-token drafter drafted the schema's skeleton (and was
        // accepted) where it was on, and never where it was off.
        let forced = |c: &Completion| c.stats.members.get("grammar").copied().unwrap_or_default();
        let on = forced(&done[0]);
        eprintln!(
            "{proposer}: grammar drafts {on:?}, stats {:?}",
            done[0].stats.accepted
        );
        assert!(on[1] > 0 && on[2] > 0, "{proposer}: {on:?}");
        assert_eq!(forced(&done[3]), [0, 0, 0], "{proposer}");
        assert_eq!(forced(&done[2]), [0, 0, 0], "{proposer}");
    }
}

/// The tiny model's vocabulary: letters and pairs a regular expression can
/// constrain (id 2 is the end of sequence).
const TINY_TOKENS: [&str; 12] = [
    "a", "b", "<eos>", "c", "ab", "ba", "x", "y", "aa", "bb", "yx", "z",
];

/// `TINY_TOKENS` as GGUF metadata.
fn tiny_tokens() -> Value {
    Value::Array(
        TINY_TOKENS
            .iter()
            .map(|t| Value::String(t.to_string()))
            .collect(),
    )
}

fn tiny_with_tokens(dir: &TempDir, name: &str, seed: u64) -> std::path::PathBuf {
    let spec = TinySpec { vocab: 12, ..TINY };
    let p = dir.0.join(name);
    let tokens = tiny_tokens();
    common::write_tiny_gguf_with(
        &p,
        &spec,
        seed,
        GgmlDType::Q8_0,
        "llama",
        "t",
        Vec::new(),
        vec![("tokenizer.ggml.tokens".into(), tokens)],
    );
    p
}

/// One constrained sampling run: `n` seeded 3-token requests through
/// `proposer` under `acceptance`; the first two tokens' counts.
#[allow(clippy::too_many_arguments)]
fn constrained_counts(
    model: &Arc<Model>,
    tok: &Arc<Tokenizer>,
    cfg: &Config,
    c: &specd::structured::Constraint,
    prompt: &[u32],
    params: &SamplingParams,
    proposer: &str,
    acceptance: Acceptance,
    n: u64,
) -> Vec<u64> {
    let max_draft = EngineConfig::for_model(model).scheduler.max_draft;
    let mut e = common::plugin_engine(model, Some(tok.clone()), cfg, 64, max_draft);
    e.acceptor.acceptance = acceptance;
    for i in 0..n {
        e.add(
            Request {
                params: SamplingParams {
                    seed: 91_000 + i,
                    ..params.clone()
                },
                proposer: Some(proposer.into()),
                constraint: Some(c.clone()),
                // Drafts here come from the proposer alone.
                forced_drafts: false,
                ..Request::greedy(prompt.to_vec(), 3)
            },
            None,
        )
        .unwrap();
    }
    let done = e.run_to_completion().unwrap();
    assert_eq!(done.len() as u64, n, "{proposer}: every request completes");
    let v = model.config.vocab_size;
    let mut counts = vec![0u64; v * v];
    let drafted: u64 = done.iter().map(|c| c.stats.drafted).sum();
    let accepted: u64 = done.iter().map(|c| c.stats.accepted).sum();
    assert!(
        drafted > n / 2 && accepted > 0,
        "{proposer} must draft: {drafted} {accepted}"
    );
    for c in &done {
        counts[c.tokens[0] as usize * v + c.tokens[1] as usize] += 1;
    }
    counts
}

/// The regular expression both sampled-law tests constrain to.
const LAW_REGEX: &str = "a[ab]*[xy]+z";

/// A target, its tokenizer and `LAW_REGEX` compiled over it.
fn law_fixture(
    target: &std::path::Path,
) -> (Arc<Model>, Arc<Tokenizer>, specd::structured::Constraint) {
    let model = Arc::new(load_model(target, 2).unwrap());
    let tok = Arc::new(Tokenizer::for_model(target).unwrap());
    let grammars =
        Grammars::new(&tok, model.config.vocab_size, &model.config.eos_token_ids).unwrap();
    let c = grammars
        .compile(&ConstraintSpec::Regex(LAW_REGEX.into()), "regex")
        .unwrap();
    (model, tok, c)
}

/// The exact constrained law of the first two tokens: each position's
/// logits masked by the constraint at that point, then the sampling law;
/// checked to put no mass outside the constraint.
fn constrained_law(
    model: &Model,
    c: &specd::structured::Constraint,
    prompt: &[u32],
    params: &SamplingParams,
) -> Vec<f64> {
    let exact = common::exact_first_two_shaped(model, prompt, params, |out, l| {
        c.start_at(out).unwrap().mask_row(l).unwrap()
    });
    let v = model.config.vocab_size;
    // No mass outside the constraint: the first token is one of a, ab,
    // aa; the second cannot be the end or z.
    for t1 in [1usize, 2, 3, 5, 6, 7, 9, 10, 11] {
        assert!(exact[t1 * v..(t1 + 1) * v].iter().all(|&p| p == 0.0));
    }
    assert!((0..v).all(|t1| exact[t1 * v + 2] == 0.0 && exact[t1 * v + 11] == 0.0));
    exact
}

/// Sampling through each of `arms` (proposer, control, requests), the
/// proposers of the config `toml`, keeps the exact constrained law of
/// `target` after `prompt` (chi-square at 0.1%), and its lossy control
/// is rejected.
fn assert_constrained_law(
    target: &std::path::Path,
    prompt: &[u32],
    toml: &str,
    arms: &[(&str, Acceptance, u64)],
) {
    let (model, tok, c) = law_fixture(target);
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let exact = constrained_law(&model, &c, prompt, &params);
    let cfg = Config::parse(toml, None).unwrap();
    for &(proposer, control, n) in arms {
        let sample = |a: Acceptance| {
            constrained_counts(&model, &tok, &cfg, &c, prompt, &params, proposer, a, n)
        };
        let (stat, df) = common::chi_square(&sample(Acceptance::Exact), &exact);
        let crit = common::chi2_crit_999(df);
        eprintln!("{proposer}: chi2 {stat:.1} (df {df}, 0.1% critical {crit:.1})");
        assert!(
            stat < crit,
            "{proposer}: constrained law differs: {stat} > {crit}"
        );
        let (bad, bdf) = common::chi_square(&sample(control), &exact);
        eprintln!("{proposer}: {control:?}: chi2 {bad:.1} (df {bdf})");
        assert!(
            bad > 1.5 * common::chi2_crit_999(bdf),
            "{proposer}: a lossy acceptance went unnoticed: {bad}"
        );
    }
}

/// Under a constraint, sampling through ngram, suffix (chains and trees)
/// and a draft model keeps the exact constrained law (chi-square on the
/// first two tokens), and the same test rejects a lossy control that
/// accepts drafts against the masked law without renormalising it.
#[test]
fn sampling_under_a_constraint_keeps_the_constrained_law() {
    let dir = TempDir::new("structured-stat");
    let target = tiny_with_tokens(&dir, "target.gguf", 8);
    let draft = tiny_with_tokens(&dir, "draft.gguf", 31);
    // The prompt repeats, so the lookup proposers draft from the start,
    // and what they draft is often (not always) allowed. The lookups
    // draft allowed tokens the control misjudges; the draft model,
    // unaware of the constraint, drafts mostly disallowed ones, so its
    // control is the residual resampled from the masked p instead.
    assert_constrained_law(
        &target,
        &[3, 7, 4, 9, 3, 7, 4, 9, 3, 7],
        &format!(
            "[[proposer]]\nname = \"ngram\"\nplugin = \"ngram\"\n\
             [[proposer]]\nname = \"suffix-tree\"\nplugin = \"suffix\"\n[proposer.options]\ntree = true\n\
             [[proposer]]\nname = \"draft\"\nplugin = \"draft\"\nmax_draft = 3\n[proposer.options]\nmodel = \"{}\"\nthreads = 1\n",
            draft.display()
        ),
        &[
            ("ngram", Acceptance::UnnormalisedMask, 12_000),
            ("suffix-tree", Acceptance::UnnormalisedMask, 12_000),
            ("draft", Acceptance::ResidualFromP, 8_000),
        ],
    );
}

/// The same for a trained proposer that drafts from the target's hidden
/// states: an MTP layer (chains and trees of its sampled drafts), which
/// knows nothing of the constraint.
#[test]
fn sampling_under_a_constraint_keeps_the_law_through_a_trained_proposer() {
    let dir = TempDir::new("structured-stat-mtp");
    let spec = TinySpec { vocab: 12, ..TINY };
    let target = common::mtp_gguf_target_with(
        &dir.0.join("mtp.gguf"),
        &spec,
        true,
        GgmlDType::Q8_0,
        vec![("tokenizer.ggml.tokens".into(), tiny_tokens())],
    );
    assert_constrained_law(
        &target,
        &[3, 7, 4, 9, 3, 7],
        &format!(
            "[[proposer]]\nname = \"mtp\"\nplugin = \"mtp\"\n[proposer.options]\nmodel = \"{0}\"\ndepth = 3\n\
             [[proposer]]\nname = \"mtp-tree\"\nplugin = \"mtp\"\n[proposer.options]\nmodel = \"{0}\"\nmode = \"tree\"\nmax_draft = 6\ndepth = 3\ntop_k = 2\n",
            target.display()
        ),
        &[
            ("mtp", Acceptance::ResidualFromP, 10_000),
            ("mtp-tree", Acceptance::ResidualFromP, 10_000),
        ],
    );
}

/// The greedy fast path (`Guide::allows`, one lexer step) decides exactly
/// as the mask: checked on the model's top candidates at every position of
/// a constrained generation, forced-byte positions included.
#[test]
fn the_greedy_fast_check_agrees_with_the_mask_everywhere() {
    let s = smol();
    for spec in [
        ConstraintSpec::JsonSchema(person_schema()),
        ConstraintSpec::JsonSchema(serde_json::json!({"type": "object", "properties": {
            "answer": {"type": "string", "maxLength": 40}, "confidence": {"enum": ["low", "medium", "high"]}},
            "required": ["answer", "confidence"], "additionalProperties": false})),
        ConstraintSpec::Regex(r"(Yes|No), because [a-z ,]{10,60}\.".into()),
    ] {
        let c = s.grammars.compile(&spec, "x").unwrap();
        let req = Request {
            constraint: Some(c.clone()),
            ..Request::greedy(
                chat(&s.tok, "What is the capital of France? Answer as asked."),
                48,
            )
        };
        let out = generate(&s.model, Some(&s.tok), &req, |_| {}).unwrap();
        let mut g = c.start();
        // A guide whose masks are computed ahead (the accept actor's
        // prefetch): the same sets.
        let mut ahead = c.start();
        let mut cache = s.model.new_cache();
        let mut logits = s
            .model
            .forward_one(&mut cache, &req.prompt, specd::model::Logits::Last)
            .unwrap()
            .logits;
        let mut checked = 0;
        for &t in &out.tokens {
            let mask = c
                .start_at(&out.tokens[..checked])
                .unwrap()
                .allowed()
                .unwrap();
            let mut order: Vec<u32> = (0..logits.len() as u32).collect();
            order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
            for &cand in order.iter().take(64).chain(&s.model.config.eos_token_ids) {
                assert_eq!(
                    g.allows(cand),
                    mask.is_allowed(cand),
                    "{:?} after {:?}: token {cand} {:?}",
                    spec.kind(),
                    s.tok.decode(&out.tokens[..checked], false),
                    s.tok.decode(&[cand], false)
                );
            }
            ahead.prefetch();
            assert_eq!(ahead.allowed().unwrap().as_slice(), mask.as_slice());
            ahead.prefetch();
            g.advance(t).unwrap();
            ahead.advance(t).unwrap();
            checked += 1;
            logits = s
                .model
                .forward_one(&mut cache, &[t], specd::model::Logits::Last)
                .unwrap()
                .logits;
        }
        assert!(checked > 5);
    }
}

/// The engine's output under a constraint equals plain constrained
/// decoding where the grammar forces bytes a single token could cover
/// (`"}` after an enum value): both take the mask's canonical token.
#[test]
fn forced_bytes_take_the_same_token_in_plain_and_speculative_decoding() {
    let s = smol();
    let schema = serde_json::json!({"type": "object", "properties": {
        "answer": {"type": "string", "maxLength": 40}, "confidence": {"enum": ["low", "medium", "high"]}},
        "required": ["answer", "confidence"], "additionalProperties": false});
    let c = s
        .grammars
        .compile(&ConstraintSpec::JsonSchema(schema), "x")
        .unwrap();
    let base = Request {
        constraint: Some(c),
        ..Request::greedy(chat(&s.tok, "What is the capital of France?"), 40)
    };
    let plain = generate(&s.model, Some(&s.tok), &base, |_| {}).unwrap();
    for (proposer, forced) in [
        ("none", true),
        ("none", false),
        ("suffix", true),
        ("ngram", false),
    ] {
        let req = Request {
            proposer: Some(proposer.into()),
            forced_drafts: forced,
            ..base.clone()
        };
        let (_, done) = run(&s, &Config::builtin(), vec![req]);
        assert_eq!(
            done[0].tokens, plain.tokens,
            "{proposer}, forced drafts {forced}"
        );
        assert_eq!(done[0].finish, plain.finish);
    }
}

/// Field kinds the generated schemas combine: nested objects, bounded
/// arrays, enums, anyOf/oneOf, nullable fields, patterns, formats and
/// numeric bounds.
fn field_kinds() -> Vec<(&'static str, serde_json::Value)> {
    use serde_json::json;
    vec![
        (
            "name",
            json!({"type": "string", "minLength": 1, "maxLength": 24}),
        ),
        (
            "age",
            json!({"type": "integer", "minimum": 0, "maximum": 120}),
        ),
        (
            "score",
            json!({"type": "number", "minimum": 0, "maximum": 1}),
        ),
        (
            "email",
            json!({"type": "string", "format": "email", "maxLength": 40}),
        ),
        ("birthday", json!({"type": "string", "format": "date"})),
        ("status", json!({"enum": ["active", "inactive", "pending"]})),
        (
            "tags",
            json!({"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}),
        ),
        (
            "address",
            json!({"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 30},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"], "additionalProperties": false}),
        ),
        (
            "nickname",
            json!({"type": ["string", "null"], "maxLength": 16}),
        ),
        (
            "contact",
            json!({"oneOf": [
            {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
             "required": ["phone"], "additionalProperties": false},
            {"type": "object", "properties": {"fax": {"type": "integer", "minimum": 1000, "maximum": 9999}},
             "required": ["fax"], "additionalProperties": false}]}),
        ),
        (
            "id",
            json!({"anyOf": [
            {"type": "integer", "minimum": 1, "maximum": 9999},
            {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}]}),
        ),
        ("active", json!({"type": "boolean"})),
        (
            "ratings",
            json!({"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}, "maxItems": 4}),
        ),
        (
            "items",
            json!({"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": false}}),
        ),
        ("uuid", json!({"type": "string", "format": "uuid"})),
        (
            "price",
            json!({"type": "number", "minimum": 0, "maximum": 10000}),
        ),
        ("level", json!({"type": "integer", "enum": [1, 2, 3]})),
        ("note", json!({"type": ["string", "null"], "maxLength": 30})),
    ]
}

/// `count` schemas: each an object of 3-5 field kinds (the first two
/// required, the rest optional), a few nested one level deeper.
fn generated_schemas(count: usize) -> Vec<serde_json::Value> {
    let kinds = field_kinds();
    (0..count)
        .map(|i| {
            let n = 3 + i % 3;
            let mut props = serde_json::Map::new();
            let mut required = Vec::new();
            for j in 0..n {
                let (name, schema) = &kinds[(i * 7 + j * 5) % kinds.len()];
                if props.contains_key(*name) {
                    continue;
                }
                if j < 2 {
                    required.push(serde_json::json!(name));
                }
                props.insert(name.to_string(), schema.clone());
            }
            let obj = serde_json::json!({"type": "object", "properties": props,
                "required": required, "additionalProperties": false});
            if i % 5 == 4 {
                serde_json::json!({"type": "object", "properties": {"record": obj, "valid": {"type": "boolean"}},
                    "required": ["record", "valid"], "additionalProperties": false})
            } else {
                obj
            }
        })
        .collect()
}

/// 50 schemas, generated greedily (with suffix speculation) and sampled
/// (temperature 0.8, with ngram): every output that ends by `stop` parses
/// and validates (formats included); every output that ends by `length`
/// is a prefix the constraint still accepts.
#[test]
fn fifty_schemas_generate_valid_json_greedy_and_sampled() {
    let s = smol();
    let schemas = generated_schemas(50);
    let compiled: Vec<_> = schemas
        .iter()
        .enumerate()
        .map(|(i, sc)| {
            s.grammars
                .compile(&ConstraintSpec::JsonSchema(sc.clone()), "schema")
                .unwrap_or_else(|e| panic!("schema {i}: {e}\n{sc}"))
        })
        .collect();
    for (proposer, temperature) in [("suffix", 0.0f32), ("ngram", 0.8)] {
        let reqs = schemas
            .iter()
            .zip(&compiled)
            .enumerate()
            .map(|(i, (sc, c))| Request {
                params: SamplingParams {
                    temperature,
                    seed: 40 + i as u64,
                    ..Default::default()
                },
                proposer: Some(proposer.into()),
                constraint: Some(c.clone()),
                ..Request::greedy(
                    chat(
                        &s.tok,
                        &format!("Fill in a realistic example of this JSON schema: {sc}"),
                    ),
                    200,
                )
            })
            .collect();
        let (_, done) = run(&s, &Config::builtin(), reqs);
        assert_eq!(done.len(), 50);
        let mut stopped = 0;
        for (i, (c, sc)) in done.iter().zip(&schemas).enumerate() {
            let text = s.tok.decode(&c.tokens, false).unwrap();
            if c.finish == FinishReason::Stop {
                stopped += 1;
                let v: serde_json::Value = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("{proposer} schema {i}: {e}: {text}"));
                let validator = jsonschema::options()
                    .should_validate_formats(true)
                    .build(sc)
                    .unwrap();
                let errors: Vec<String> =
                    validator.iter_errors(&v).map(|e| e.to_string()).collect();
                assert!(
                    errors.is_empty(),
                    "{proposer} schema {i}: {errors:?}\n{text}\n{sc}"
                );
            } else {
                compiled[i].start_at(&c.tokens).unwrap();
            }
        }
        eprintln!("{proposer} T={temperature}: {stopped} of 50 complete within 200 tokens");
        assert!(stopped >= 45, "{proposer}: only {stopped} of 50 completed");
    }
}

/// Constrained sequences under a KV budget that preempts them mid-output
/// (recomputed, the guide kept) and with the prefix cache serving repeated
/// prompts: greedy output equals plain constrained decoding, sampled
/// output equals the same seeded run without preemption.
#[test]
fn preemption_and_prefix_caching_keep_constrained_outputs() {
    let s = smol();
    let schema = person_schema();
    let c = s
        .grammars
        .compile(&ConstraintSpec::JsonSchema(schema), "response_format")
        .unwrap();
    let prompts: Vec<Vec<u32>> = ["a pilot", "a chef", "a painter", "a nurse"]
        .iter()
        .map(|who| {
            chat(
                &s.tok,
                &format!(
                    "{}\nGive the name, city, age and languages of {who} as JSON.",
                    "We keep records of the people in our town: their names, the city they \
                     live in, their age and the programming languages they know, if any. \
                     Records are short and factual. Names are given as first and last name, \
                     cities without the country, ages as whole years, languages in lower case. "
                        .repeat(3)
                ),
            )
        })
        .collect();
    // Sampled runs draft only the forced tokens (a function of the
    // output so far), so their random draws, and so their tokens, do not
    // depend on preemption; greedy runs speculate with suffix too.
    let reqs = |temperature: f32| -> Vec<Request> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| Request {
                params: SamplingParams {
                    temperature,
                    seed: 9 + i as u64,
                    ..Default::default()
                },
                proposer: Some(if temperature > 0.0 { "none" } else { "suffix" }.into()),
                constraint: Some(c.clone()),
                ..Request::greedy(p.clone(), 96)
            })
            .collect()
    };
    let want: Vec<Vec<u32>> = reqs(0.0)
        .iter()
        .map(|r| generate(&s.model, Some(&s.tok), r, |_| {}).unwrap().tokens)
        .collect();
    let engine = |kv: Option<usize>, prefix: usize| {
        let drafter = Config::builtin()
            .build_drafter(&s.model, Some(s.tok.clone()))
            .unwrap();
        let mut ec = EngineConfig::for_model(&s.model);
        ec.scheduler.max_running = 4;
        ec.scheduler.max_waiting = usize::MAX;
        ec.scheduler.measured_pricing = false;
        ec.prefix_cache_blocks = prefix;
        if let Some(b) = kv {
            ec.kv_blocks = b;
        }
        SyncDriver::new(s.model.clone(), Some(s.tok.clone()), ec, drafter)
    };
    let run_all = |e: &mut SyncDriver, reqs: Vec<Request>| {
        let ids: Vec<u64> = reqs.into_iter().map(|r| e.add(r, None).unwrap()).collect();
        let mut done = e.run_to_completion().unwrap();
        done.sort_by_key(|c| ids.iter().position(|&i| i == c.id).unwrap());
        done
    };
    let roomy_sampled = run_all(&mut engine(None, 0), reqs(0.9));
    // Each sequence needs two 64-slot blocks at its end: five blocks for
    // four sequences preempt.
    let blocks = (prompts[0].len() + 96).div_ceil(64);
    let mut small = engine(Some(blocks * 2 + 1), 1);
    let mut preempted = 0;
    for round in 0..2 {
        let got = run_all(&mut small, reqs(0.0));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(&g.tokens, w, "round {round}, request {i}");
        }
        let sampled = run_all(&mut small, reqs(0.9));
        for (i, (g, w)) in sampled.iter().zip(&roomy_sampled).enumerate() {
            assert_eq!(g.tokens, w.tokens, "sampled, round {round}, request {i}");
        }
        preempted += got
            .iter()
            .chain(&sampled)
            .map(|c| c.preemptions)
            .sum::<u32>();
    }
    assert!(preempted > 0, "the budget must preempt");
    // The prefix cache serves the shared instructions (one request at a
    // time, so each prefill chunk covers whole blocks).
    let mut warm = engine(None, 64);
    for (i, r) in reqs(0.0).into_iter().enumerate() {
        let got = run_all(&mut warm, vec![r]);
        assert_eq!(&got[0].tokens, &want[i], "prefix cache, request {i}");
    }
    let (query, hit) = warm.verifier.prefix_stats();
    assert!(hit > 0, "{hit} of {query}");
}
