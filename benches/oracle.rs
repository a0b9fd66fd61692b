//! Speculation with a replaying oracle at several error rates against plain
//! decoding, all in one run on the default model (greedy).
//!
//! `cargo bench --bench oracle` prints mean accepted length and tok/s per
//! arm; each arm is checked token for token against plain decoding.

use specd_test_kit as common;

use std::sync::Arc;
use std::time::Instant;

use specd::model::load_model;
use specd::speculative::drafter::Drafter;
use specd::speculative::driver::{EngineConfig, SyncDriver};
use specd::speculative::Request;
use specd::tokenizer::Tokenizer;

fn main() {
    let path = common::smollm_path();
    let threads = std::env::var("SPECD_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    let model = Arc::new(load_model(&path, threads).unwrap());
    let tok = Tokenizer::for_model(&path).unwrap();
    let texts = [
        "def quicksort(arr):",
        "The history of the Roman Empire",
        "<|im_start|>user\nExplain photosynthesis briefly.<|im_end|>\n<|im_start|>assistant\n",
        "import numpy as np\n\ndef normalize(x):",
    ];
    let n = 96;
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tok.encode(t, false).unwrap())
        .collect();
    let run = |proposer: Option<common::OracleProposer>| {
        let mut cfg = EngineConfig::for_model(&model);
        cfg.scheduler.max_running = 1;
        cfg.scheduler.max_draft = 4;
        let name = proposer.as_ref().map(|_| "oracle".to_string());
        let mut d = Drafter::new();
        if let Some(p) = proposer {
            d.add(Box::new(p));
        }
        let mut e = SyncDriver::new(model.clone(), None, cfg, d);
        let t = Instant::now();
        for p in &prompts {
            e.add(
                Request {
                    proposer: name.clone().or(Some("none".into())),
                    ignore_eos: true,
                    ..Request::greedy(p.clone(), n)
                },
                None,
            )
            .unwrap();
        }
        let mut done = e.run_to_completion().unwrap();
        done.sort_by_key(|c| c.id);
        (t.elapsed().as_secs_f64(), done)
    };
    let (t_plain, plain) = run(None);
    let answers: Vec<(Vec<u32>, Vec<u32>)> = prompts
        .iter()
        .cloned()
        .zip(plain.iter().map(|c| c.tokens.clone()))
        .collect();
    let toks: usize = plain.iter().map(|c| c.tokens.len()).sum();
    println!(
        "{} prompts x {n} tokens, greedy, max draft 4, {threads} threads, sequential requests",
        prompts.len()
    );
    println!(
        "{:<14} {:>10} {:>9} {:>8}",
        "arm", "mean acc", "tok/s", "speedup"
    );
    println!(
        "{:<14} {:>10.2} {:>9.1} {:>8.2}",
        "plain",
        1.0,
        toks as f64 / t_plain,
        1.0
    );
    for rate in [0.0, 0.1, 0.3, 0.6, 1.0] {
        let oracle =
            common::OracleProposer::new(answers.clone(), rate, 4, model.config.vocab_size as u32);
        let (t, done) = run(Some(oracle));
        for (c, p) in done.iter().zip(&plain) {
            assert_eq!(
                c.tokens, p.tokens,
                "losslessness failure at error rate {rate}"
            );
        }
        let steps: u64 = done.iter().map(|c| c.stats.verify_steps).sum();
        let acc: u64 = done.iter().map(|c| c.stats.accepted).sum();
        println!(
            "{:<14} {:>10.2} {:>9.1} {:>8.2}",
            format!("oracle e={rate}"),
            (acc + steps) as f64 / steps as f64,
            toks as f64 / t,
            t_plain / t
        );
    }
}
