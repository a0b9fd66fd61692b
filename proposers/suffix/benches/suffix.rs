//! Suffix-tree update (one token) and query (longest match + draft).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use specd_proposer_suffix::SuffixTree;
use std::hint::black_box;

fn history(n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919) % 97 + (i / 50) % 5) as u32)
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("suffix_tree");
    for n in [256usize, 1024, 4096] {
        let h = history(n);
        let mut tree = SuffixTree::new(32);
        let mut active = Vec::new();
        for &t in &h {
            tree.push(&mut active, t);
        }
        g.bench_with_input(BenchmarkId::new("update", n), &n, |b, _| {
            b.iter_batched(
                || (tree.clone(), active.clone()),
                |(mut t, mut a)| t.push(&mut a, black_box(42)),
                criterion::BatchSize::LargeInput,
            )
        });
        g.bench_with_input(BenchmarkId::new("query", n), &h, |b, h| {
            b.iter(|| {
                let m = tree.longest_match(black_box(h));
                m.map(|(node, _)| tree.continuation(node, 8))
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
