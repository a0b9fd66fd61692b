//! n-gram lookup cost over realistic history lengths.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use std::hint::black_box;

fn history(n: usize) -> Vec<u32> {
    // Code-like repetition: a small vocabulary of recurring phrases.
    (0..n)
        .map(|i| ((i * 7919) % 97 + (i / 50) % 5) as u32)
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("ngram_lookup");
    for n in [256usize, 1024, 4096] {
        let h = history(n);
        g.bench_with_input(BenchmarkId::from_parameter(n), &h, |b, h| {
            b.iter(|| specd_proposer_ngram::lookup(black_box(h), 1, 3, 4))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
