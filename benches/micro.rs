//! Per-step costs of the sampling and acceptance paths.

use criterion::{criterion_group, criterion_main, Criterion};
use specd::sampler::{self, Rng, SamplingParams};
use specd::speculative::accept::{accept, Acceptance};
use specd::speculative::proposer::{Draft, DraftQ};
use std::hint::black_box;

const VOCAB: usize = 49152;

fn logits(seed: u64, rows: usize) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..rows * VOCAB)
        .map(|_| (r.next_f64() as f32 - 0.5) * 12.0)
        .collect()
}

fn bench(c: &mut Criterion) {
    let rows = logits(1, 5);
    let greedy = SamplingParams::greedy();
    let sampled = SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        ..Default::default()
    };
    let draft = Draft {
        tokens: (0..4)
            .map(|i| sampler::argmax(&rows[i * VOCAB..(i + 1) * VOCAB]))
            .collect(),
        q: vec![DraftQ::OneHot; 4],
        parents: None,
        source: None,
    };
    let ctx: Vec<u32> = (0..512).collect();
    c.bench_function("accept_greedy_k4", |b| {
        let mut rng = Rng::new(0);
        b.iter(|| {
            accept(
                black_box(&rows),
                VOCAB,
                &draft,
                &ctx,
                &ctx[256..],
                &greedy,
                &mut rng,
                Acceptance::Exact,
            )
        })
    });
    c.bench_function("accept_sampled_top_p_k4", |b| {
        let mut rng = Rng::new(0);
        b.iter(|| {
            accept(
                black_box(&rows),
                VOCAB,
                &draft,
                &ctx,
                &ctx[256..],
                &sampled,
                &mut rng,
                Acceptance::Exact,
            )
        })
    });
    let row = &rows[..VOCAB];
    c.bench_function("distribution_temperature_top_p", |b| {
        b.iter(|| sampler::distribution(black_box(row), &sampled))
    });
    c.bench_function("distribution_top_k_40", |b| {
        let p = SamplingParams {
            temperature: 0.8,
            top_k: 40,
            ..Default::default()
        };
        b.iter(|| sampler::distribution(black_box(row), &p))
    });
    c.bench_function("penalties_512_context", |b| {
        let p = SamplingParams {
            repetition_penalty: 1.1,
            frequency_penalty: 0.2,
            ..Default::default()
        };
        b.iter(|| {
            let mut l = row.to_vec();
            sampler::apply_penalties(&mut l, &ctx, &ctx[256..], &p);
            l
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
