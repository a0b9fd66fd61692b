//! What one training step of a trained proposer costs: the EAGLE-3 head
//! and the MTP module at SmolLM2-135M's shapes and the default recipe
//! (draft vocabulary 4,096, TTT 4), on seeded random data, forward,
//! backward and AdamW together. Prints token-steps per second (rows times
//! TTT steps, the unit `distill` reports) and the matmul GFLOP/s, plus
//! the timed steps' losses (the same on every build of the same graph,
//! up to float rounding).
//!
//! `cargo bench --bench train_step` (`SPECD_TRAIN_BENCH=b,t,steps`,
//! default 4,512,5: one 2,048-token batch, the default `batch_tokens`).

use specd::distill::eagle::bench_train_step;

fn main() {
    let spec = std::env::var("SPECD_TRAIN_BENCH").unwrap_or_else(|_| "4,512,5".into());
    let v: Vec<usize> = spec
        .split(',')
        .filter_map(|x| x.trim().parse().ok())
        .collect();
    let (b, t, steps) = match v[..] {
        [b, t, s] => (b, t, s),
        _ => panic!("SPECD_TRAIN_BENCH is b,t,steps (got {spec})"),
    };
    println!("train step, {b} x {t} rows, TTT 4, median of {steps}");
    for (name, mtp) in [("eagle", false), ("mtp", true)] {
        let r = bench_train_step(mtp, b, t, steps).expect("bench");
        println!(
            "{name:6} {:8.3} s/step  {:9.0} token-steps/s  {:6.1} GFLOP/s  losses {:?}",
            r.seconds, r.rate, r.gflops, r.losses
        );
    }
}
