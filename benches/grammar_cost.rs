//! What a constraint costs next to a decode step, at batch 1, on the
//! default model: along greedy constrained outputs (JSON schemas of the
//! structured benchmark and a regex), the per-token time of the mask (the
//! sampled path), of the greedy check (`Guide::allows`, one lexer step),
//! of advancing the guide and of the forced-token lookup, against the
//! one-token target forward measured in the same run.
//!
//! `cargo bench --bench grammar_cost` (medians over every position).

use specd_test_kit as common;

use std::time::Instant;

use specd::model::{load_model, Logits};
use specd::plain::generate;
use specd::speculative::Request;
use specd::structured::{ConstraintSpec, Grammars};
use specd::tokenizer::{ChatMessage, Tokenizer};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let path = common::smollm_path();
    let threads = std::env::var("SPECD_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    let model = load_model(&path, threads).unwrap();
    let tok = Tokenizer::for_model(&path).unwrap();
    let t = Instant::now();
    let grammars =
        Grammars::new(&tok, model.config.vocab_size, &model.config.eos_token_ids).unwrap();
    println!(
        "grammar engine built in {:.1} ms (once per model)",
        t.elapsed().as_secs_f64() * 1e3
    );
    let data = include_str!("data/structured/prompts.jsonl");
    let mut cases: Vec<(String, String, ConstraintSpec)> = data
        .lines()
        .step_by(10)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["category"].as_str().unwrap().to_string(),
                v["prompt"].as_str().unwrap().to_string(),
                ConstraintSpec::JsonSchema(v["schema"].clone()),
            )
        })
        .collect();
    cases.push((
        "regex".into(),
        "Is the sky blue? Answer and explain.".into(),
        ConstraintSpec::Regex(r"(Yes|No), because [a-z ,]{10,80}\.".into()),
    ));
    println!(
        "{:<16} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "constraint",
        "tokens",
        "compile",
        "forward",
        "mask",
        "allows",
        "advance",
        "forced",
        "greedy%"
    );
    for (name, prompt, spec) in cases {
        let t = Instant::now();
        let c = grammars.compile(&spec, "bench").unwrap();
        let compile = t.elapsed().as_secs_f64();
        let text = tok
            .apply_chat_template(&[ChatMessage::user(prompt)], true)
            .unwrap();
        let ids = tok.encode(&text, false).unwrap();
        let req = Request {
            constraint: Some(c.clone()),
            ..Request::greedy(ids.clone(), 128)
        };
        let out = generate(&model, Some(&tok), &req, |_| {}).unwrap();
        // Replay the output: time each piece at each position.
        let mut cache = model.new_cache();
        model.forward_one(&mut cache, &ids, Logits::Last).unwrap();
        let (mut fwd, mut mask, mut allows, mut adv, mut forced) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut g = c.start();
        let mut g_mask = c.start();
        let mut row = vec![0f32; model.config.vocab_size];
        for &t in &out.tokens {
            let t0 = Instant::now();
            let _ = g.allows(t);
            allows.push(t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            g_mask.mask_row(&mut row).unwrap();
            mask.push(t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            g.advance(t).unwrap();
            g_mask.advance(t).unwrap();
            adv.push(t0.elapsed().as_secs_f64() / 2.0);
            let t0 = Instant::now();
            let _ = g.forced();
            forced.push(t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            model.forward_one(&mut cache, &[t], Logits::Last).unwrap();
            fwd.push(t0.elapsed().as_secs_f64());
        }
        let f = median(fwd);
        let (m, a, d, ff) = (median(mask), median(allows), median(adv), median(forced));
        println!(
            "{:<16} {:>6} {:>7.2}ms {:>7.0}us {:>7.0}us {:>7.0}us {:>7.0}us {:>6.0}us {:>7.1}%",
            name,
            out.tokens.len(),
            compile * 1e3,
            f * 1e6,
            m * 1e6,
            a * 1e6,
            d * 1e6,
            ff * 1e6,
            100.0 * (a + d + ff) / f
        );
    }
    println!("greedy% = (allows + advance + forced) / forward: the constraint's share of a greedy decode step; a sampled step pays mask instead of allows");
}
