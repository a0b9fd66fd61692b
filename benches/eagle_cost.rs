//! What one EAGLE draft step costs next to one target forward, on the
//! default model with the shipped head (or `SPECD_EAGLE_HEAD=dir`), at a
//! 256-token context: a 1-token target decode forward, target verify
//! forwards of 2..=17 tokens, and head steps of 1 row (a chain step), 4
//! rows (a tree depth of top_k 4) and 3 rows (taking in a step's features),
//! each with its draft-vocabulary logits; and a chain step as a plugin
//! runs it, right after a target forward, through the global pool or the
//! calling thread's own.
//!
//! `cargo bench --bench eagle_cost` (medians of 41 runs; ratios are to the
//! 1-token target forward measured in the same run).

use specd_test_kit as common;

use std::path::PathBuf;
use std::time::Instant;

use specd::model::eagle::{Head, Src};
use specd::model::{load_model, Logits};

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
    let c = &model.config;
    let head_dir = std::env::var_os("SPECD_EAGLE_HEAD")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("proposers/eagle/heads/smollm2-135m-instruct")
        });
    let head = Head::load(&head_dir, c.hidden, c.vocab_size, c.layers).unwrap();
    let ctx = 256usize;
    let reps = 41;
    let tokens: Vec<u32> = (0..ctx as u32).map(|i| 100 + (i * 37) % 5000).collect();
    let mut cache = model.new_cache();
    model
        .forward_one(&mut cache, &tokens, Logits::None)
        .unwrap();
    let mut verify = Vec::new();
    for n in [1usize, 2, 3, 5, 9, 17] {
        let feed: Vec<u32> = (0..n as u32).map(|i| 200 + i).collect();
        let times: Vec<f64> = (0..reps)
            .map(|_| {
                let t = Instant::now();
                model.forward_one(&mut cache, &feed, Logits::All).unwrap();
                let dt = t.elapsed().as_secs_f64();
                cache.truncate(ctx).unwrap();
                dt
            })
            .collect();
        verify.push((n, median(times)));
    }
    let unit = verify[0].1;
    // The head's cache: `ctx` rows of keys.
    let h = c.hidden;
    let nl = head.cfg.feature_layers.len();
    let feats: Vec<f32> = (0..ctx * nl * h)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let e: Vec<f32> = (0..ctx * h)
        .map(|i| ((i * 104729) % 1000) as f32 / 5000.0 - 0.1)
        .collect();
    let g = head.fuse(&feats, ctx);
    let pos: Vec<usize> = (0..ctx).collect();
    let sees: Vec<Vec<Src>> = (0..ctx).map(|r| (0..r).map(Src::Own).collect()).collect();
    let (y, keys) = head.step(&[], &g, &e, &pos, &sees);
    let step = |rows: usize, fused: bool| -> f64 {
        let times: Vec<f64> = (0..reps)
            .map(|_| {
                let t = Instant::now();
                let gi = if fused {
                    head.fuse(&feats[..rows * nl * h], rows)
                } else {
                    y[..rows * h].to_vec()
                };
                let pos: Vec<usize> = (ctx..ctx + rows).collect();
                let sees: Vec<Vec<Src>> = (0..rows)
                    .map(|_| {
                        vec![Src::Range {
                            store: 0,
                            start: 0,
                            end: ctx,
                        }]
                    })
                    .collect();
                let (yy, _) = head.step(&[&keys], &gi, &e[..rows * h], &pos, &sees);
                let l = head.logits(&yy, rows).unwrap();
                std::hint::black_box(l);
                t.elapsed().as_secs_f64()
            })
            .collect();
        median(times)
    };
    let chain = step(1, false);
    let tree4 = step(4, false);
    let ingest = step(3, true);
    // A chain step as a plugin's propose runs it: right after a target
    // forward (the head's weights out of the caches, the threads idle),
    // from a thread outside any pool, through the global pool
    // (`with_helpers`) or the caller's own (`with_caller_pool`); each on
    // a fresh thread, so neither sees the other's pool.
    let after_forward = |own_pool: bool| -> f64 {
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let mut cache = model.new_cache();
                model
                    .forward_one(&mut cache, &tokens, Logits::None)
                    .unwrap();
                let times: Vec<f64> = (0..reps)
                    .map(|_| {
                        model.forward_one(&mut cache, &[7], Logits::Last).unwrap();
                        cache.truncate(ctx).unwrap();
                        let t = Instant::now();
                        let work = || {
                            let sees = vec![vec![Src::Range {
                                store: 0,
                                start: 0,
                                end: ctx,
                            }]];
                            let (yy, _) = head.step(&[&keys], &y[..h], &e[..h], &[ctx], &sees);
                            head.logits(&yy, 1).unwrap()
                        };
                        let l = if own_pool {
                            specd::model::llama::with_caller_pool(work)
                        } else {
                            specd::model::llama::with_helpers(work)
                        };
                        std::hint::black_box(l);
                        t.elapsed().as_secs_f64()
                    })
                    .collect();
                median(times)
            })
            .join()
            .unwrap()
        })
    };
    // Two interleaved rounds, averaged: the order does not favour either.
    let (mut via_global, mut via_own) = (0.0, 0.0);
    for _ in 0..2 {
        via_global += after_forward(false) / 2.0;
        via_own += after_forward(true) / 2.0;
    }
    println!(
        "target: {} layers, hidden {}; head: {:?}, draft vocabulary {}, {:.1} MB of weights per step; context {ctx}, {threads} threads, kernels {:?}",
        c.layers,
        h,
        head.cfg.variant,
        head.cfg.draft_vocab,
        head.step_bytes() as f64 / 1e6,
        model.kernel_path()
    );
    println!("target 1-token forward: {:.2} ms (the unit)", unit * 1e3);
    for (n, t) in &verify[1..] {
        println!(
            "target verify of {n} tokens: {:.2} ms = {:.2}",
            t * 1e3,
            t / unit
        );
    }
    println!(
        "head step, 1 row (chain): {:.3} ms = {:.3}",
        chain * 1e3,
        chain / unit
    );
    println!(
        "head step, 4 rows (tree depth): {:.3} ms = {:.3}",
        tree4 * 1e3,
        tree4 / unit
    );
    println!(
        "head step, 3 rows of features (fc + layer): {:.3} ms = {:.3}",
        ingest * 1e3,
        ingest / unit
    );
    println!(
        "chain step after a target forward, global pool (with_helpers): {:.3} ms = {:.3}",
        via_global * 1e3,
        via_global / unit
    );
    println!(
        "chain step after a target forward, caller's pool (with_caller_pool): {:.3} ms = {:.3}",
        via_own * 1e3,
        via_own / unit
    );
}
