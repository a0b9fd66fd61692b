//! Quantized matmul kernels on SmolLM2-135M's shapes (and a 7B-sized square
//! one), Q4_1 beside Q5_0 and the K-quants: time per call for 1 to 8 activation
//! rows (and 16 and 64, where prefill's AMX path runs), so the per-row cost
//! of a verify shows apart from the weight streaming every call pays. Uses the global rayon pool (all cores);
//! `SPECD_NO_AVX512=1` times the AVX2 path.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use specd::model::kernels::{matmul_many, wants_q8, Activations, KernelPath};
use specd::model::{QMatrix, WeightFormat};
use std::hint::black_box;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// A random matrix in ggml block format (scale 1/64, codes from the lcg).
fn matrix(format: WeightFormat, rows: usize, cols: usize, seed: &mut u64) -> QMatrix {
    let nb = rows * cols / 32;
    let mut raw = Vec::new();
    let h = half::f16::from_f32(1.0 / 64.0).to_le_bytes();
    let bytes = |n: usize, seed: &mut u64| -> Vec<u8> {
        (0..n).map(|_| (lcg(seed) * 127.0) as i8 as u8).collect()
    };
    match format {
        WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K => {
            let d = half::f16::from_f32(1.0 / 1024.0).to_le_bytes();
            for _ in 0..nb / 8 {
                if format != WeightFormat::Q6K {
                    raw.extend_from_slice(&d);
                    raw.extend_from_slice(&d);
                    let rest = if format == WeightFormat::Q4K {
                        140
                    } else {
                        172
                    };
                    raw.extend(bytes(rest, seed));
                } else {
                    raw.extend(bytes(208, seed));
                    raw.extend_from_slice(&d);
                }
            }
            return QMatrix::from_ggml_blocks(format, rows, cols, &raw).unwrap();
        }
        _ => {}
    }
    for _ in 0..nb {
        raw.extend_from_slice(&h);
        match format {
            WeightFormat::Q4_1 => {
                raw.extend_from_slice(&h);
                raw.extend((0..16).map(|_| (lcg(seed) * 127.0) as i8 as u8));
            }
            WeightFormat::Q4_0 => raw.extend((0..16).map(|_| (lcg(seed) * 127.0) as i8 as u8)),
            WeightFormat::Q5_0 => raw.extend((0..20).map(|_| (lcg(seed) * 127.0) as i8 as u8)),
            _ => raw.extend((0..32).map(|_| (lcg(seed) * 127.0) as i8 as u8)),
        }
    }
    QMatrix::from_ggml_blocks(format, rows, cols, &raw).unwrap()
}

fn bench(c: &mut Criterion) {
    let mut seed = 1u64;
    let shapes = [
        ("ffn_down_q4_1", WeightFormat::Q4_1, 576usize, 1536usize),
        ("ffn_down_q4_k", WeightFormat::Q4K, 576, 1536),
        ("ffn_down_q5_k", WeightFormat::Q5K, 576, 1536),
        ("ffn_down_q6_k", WeightFormat::Q6K, 576, 1536),
        ("square4096_q4_1", WeightFormat::Q4_1, 4096, 4096),
        ("square4096_q4_k", WeightFormat::Q4K, 4096, 4096),
        ("ffn_up_q4_1", WeightFormat::Q4_1, 1536, 576),
        ("ffn_up_q5_0", WeightFormat::Q5_0, 1536, 576),
        ("head_q8_0", WeightFormat::Q8_0, 49152, 576),
    ];
    let path = KernelPath::best();
    for (name, format, rows, cols) in shapes {
        let w = matrix(format, rows, cols, &mut seed);
        let mut g = c.benchmark_group(format!("matmul_{name}_{path:?}"));
        for n in [1usize, 2, 4, 8, 16, 64] {
            let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed)).collect();
            let mut a = Activations::new(path);
            g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
                let mut out = Vec::new();
                b.iter(|| {
                    a.prepare(black_box(&x), n, cols, wants_q8(&w));
                    matmul_many(&a, &[&w], &mut [&mut out]);
                    black_box(&out);
                })
            });
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
