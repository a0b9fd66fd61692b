//! `specd bench-model`: prefill and decode throughput, and the cost of
//! verifying k tokens (all-position logits) relative to one, measured in one
//! run on one model.

use std::time::Instant;

use crate::error::Result;
use crate::model::{Logits, Model};

/// The kernel path, and where AMX was timed against VNNI to choose it,
/// the two timings (`KernelPath::best`).
fn kernel_name(path: crate::model::kernels::KernelPath) -> String {
    match crate::model::kernels::amx_calibration() {
        Some((amx, vnni)) => format!(
            "{path:?} (AMX {amx:.0} us vs VNNI {vnni:.0} us per 64-row product; AMX runs where under 90%)"
        ),
        None => format!("{path:?}"),
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelBench {
    pub threads: usize,
    pub kernel: String,
    pub prefill_tokens: usize,
    /// Median over `PREFILL_RUNS` timed prefills, each into a new cache.
    pub prefill_tok_s: f64,
    /// The slowest and fastest of those prefills (tok/s).
    pub prefill_range: (f64, f64),
    /// How many prefills were timed.
    pub prefill_runs: usize,
    pub decode_tokens: usize,
    pub decode_tok_s: f64,
    pub context: usize,
    /// (k, median ms per forward of k tokens, ratio to k = 1)
    pub verify: Vec<(usize, f64, f64)>,
    /// (nodes, median ms per forward of a tree of that many drafted nodes
    /// plus its root, ratio to k = 1), verified with the tree mask.
    pub tree_verify: Vec<(usize, f64, f64)>,
    /// (nodes, median ms of a chain of as many tokens as the tree feeds,
    /// the tree's median over it): the chain is timed in blocks that
    /// alternate with the tree's, so drift hits both alike.
    pub tree_vs_chain: Vec<(usize, f64, f64)>,
    /// Bytes of weights as held in memory (repacked).
    pub weight_bytes: usize,
    /// Bytes of the one KV cache at `context` (+ the largest k).
    pub kv_bytes: usize,
    /// (the model's context, bytes of one sequence's KV there once the
    /// sliding layers' entries outside their window are released, bytes
    /// with every layer's kept).
    pub kv_full_context: (usize, usize, usize),
    /// Peak resident set of the process (Linux `VmHWM`) over the model's
    /// work, leaving out the bandwidth probes' buffers; None where unknown.
    pub peak_rss_bytes: Option<usize>,
    /// Memory read bandwidth with the model's thread count (GB/s, best of
    /// several passes over a buffer far larger than the caches).
    pub read_gb_s: f64,
    /// Read bandwidth re-reading a buffer the size of the weights (GB/s):
    /// what decode, which reads every weight once per token, can reach
    /// with whatever share of the weights the caches hold.
    pub weights_read_gb_s: f64,
    /// The decode rate that reading the weights once per token at
    /// `weights_read_gb_s` allows (tok/s): decode's memory-bound ceiling.
    pub decode_limit_tok_s: f64,
    /// Whether every timed decode and verify forward started with the
    /// weights evicted from the CPU caches (`--cold`): each one streams
    /// them from memory, as on a machine whose last-level cache is far
    /// smaller than the model. `decode_limit_tok_s` then uses
    /// `read_gb_s`.
    pub cold: bool,
}

/// Read bandwidth of this machine with `threads` threads: the best of
/// `passes` timed sums over `bytes` of memory (each thread its own slice).
pub fn read_bandwidth(threads: usize, bytes: usize, passes: usize) -> f64 {
    let words = (bytes / 8).max(1 << 16);
    let buf: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9))
        .collect();
    let threads = threads.max(1);
    let chunk = words.div_ceil(threads);
    let mut best = 0.0f64;
    for _ in 0..passes.max(1) {
        let t = Instant::now();
        let total: u64 = std::thread::scope(|sc| {
            let hs: Vec<_> = buf
                .chunks(chunk)
                .map(|part| {
                    sc.spawn(move || {
                        // Four independent sums, so the adds keep up with
                        // the loads and the loop stays memory-bound.
                        let mut acc = [0u64; 4];
                        for q in part.chunks_exact(4) {
                            for j in 0..4 {
                                acc[j] = acc[j].wrapping_add(q[j]);
                            }
                        }
                        acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, |a, b| a.wrapping_add(b))
        });
        std::hint::black_box(total);
        let gb_s = (words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9;
        best = best.max(gb_s);
    }
    best
}

/// A `kB` field of `/proc/self/status`, in bytes.
fn status_bytes(field: &str) -> Option<usize> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Peak resident set size of this process (`VmHWM`).
pub fn peak_rss_bytes() -> Option<usize> {
    status_bytes("VmHWM:")
}

/// Resident set size of this process now (`VmRSS`).
pub fn rss_bytes() -> Option<usize> {
    status_bytes("VmRSS:")
}

/// Reset the peak resident set size (`VmHWM`) to the current one
/// (`/proc/self/clear_refs`, Linux 4.0+); false where that is not possible.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Timed prefills per run (one alone moved 10-20% between runs on the
/// 2-core hosts; the median of a few is what a change is judged by).
const PREFILL_RUNS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Deterministic pseudo-text token ids (avoid specials at the bottom:
/// ids from 100, or from half the vocabulary when it is that small).
pub fn tokens(n: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let lo = 100.min(vocab as u64 / 2);
    let mut x = salt.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (lo + x % (vocab as u64 - lo).max(1)) as u32
        })
        .collect()
}

/// Consecutive timed forwards of one shape in `bench_model`'s verify
/// loop, after `VERIFY_WARMUP` untimed ones of the same shape.
pub const VERIFY_BLOCK: usize = 5;
pub const VERIFY_WARMUP: usize = 3;

#[allow(clippy::too_many_arguments)]
pub fn bench_model(
    model: &Model,
    prefill: usize,
    decode: usize,
    context: usize,
    ks: &[usize],
    trees: &[usize],
    reps: usize,
    cold: bool,
) -> Result<ModelBench> {
    let vocab = model.config.vocab_size;
    if cold && !model.evict_weights_from_caches() {
        return Err(crate::error::SpecdError::InvalidRequest(
            "--cold: this CPU cannot evict the weights from its caches (x86-64 only)".into(),
        ));
    }
    // Time `f`, first evicting the weights if `cold` (not timed).
    let timed = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        if cold {
            model.evict_weights_from_caches();
        }
        let t = Instant::now();
        f()?;
        Ok(t.elapsed().as_secs_f64())
    };
    // Prefill: one chunk, last-position logits (warm up once first).
    let prompt = tokens(prefill, vocab, 1);
    {
        let mut c = model.new_cache();
        model.forward_one(&mut c, &prompt[..prefill.min(32)], Logits::Last)?;
    }
    let mut rates = Vec::with_capacity(PREFILL_RUNS);
    for _ in 0..PREFILL_RUNS {
        let mut c = model.new_cache();
        let t = Instant::now();
        model.forward_one(&mut c, &prompt, Logits::Last)?;
        rates.push(prefill as f64 / t.elapsed().as_secs_f64());
    }
    let prefill_range = (
        rates.iter().copied().fold(f64::INFINITY, f64::min),
        rates.iter().copied().fold(0.0, f64::max),
    );
    let prefill_tok_s = median(rates);

    // Decode: one token at a time after a short prompt.
    let mut c = model.new_cache();
    model.forward_one(&mut c, &prompt[..16.min(prefill)], Logits::Last)?;
    let steps = tokens(decode, vocab, 2);
    let mut decode_s = 0.0;
    for &tok in &steps {
        decode_s += timed(&mut || model.forward_one(&mut c, &[tok], Logits::Last).map(drop))?;
    }
    let decode_tok_s = decode as f64 / decode_s;
    // What reading the weights once per token allows here: a buffer of
    // their size re-read (caches help as much as they help decode), and
    // 512 MiB (memory alone), with the model's threads.
    // The bandwidth probes' buffers (up to 512 MiB) are not the model's:
    // the peak before them is kept and the high-water mark reset after.
    let peak_before = peak_rss_bytes();
    let weights_read_gb_s = read_bandwidth(model.threads(), model.weight_bytes(), 9);
    let read_gb_s = read_bandwidth(model.threads(), 512 << 20, 5);
    let reset = reset_peak_rss();

    // Verify cost at a fixed context: forward k tokens, roll back, repeat.
    // Each shape is timed in blocks of `VERIFY_BLOCK` consecutive forwards,
    // each block after `VERIFY_WARMUP` untimed forwards of the same shape,
    // and the blocks take turns, so drift hits the shapes of a phase alike
    // while each is timed close to its steady state: a forward right after
    // larger ones ran 15-45% slower here, recovering over tens of
    // milliseconds, which shrank every ratio when shapes were interleaved
    // one forward at a time. Chains first, then trees (their ratios are to
    // the chains' one-token forward, timed a few seconds earlier).
    // The context is filled in chunks of 512 tokens, as the engine's
    // default `max_batch_tokens` prefills a long prompt.
    let mut c = model.new_cache();
    for chunk in tokens(context, vocab, 3).chunks(512) {
        model.forward_one(&mut c, chunk, Logits::None)?;
    }
    let most = ks
        .iter()
        .chain(trees.iter().map(|n| n + 1).collect::<Vec<_>>().iter())
        .copied()
        .max()
        .unwrap_or(1);
    let draft = tokens(most, vocab, 4);
    // Trees: a ternary heap (node i's parent is (i - 1) / 3), the bushy
    // shape of top-k expansion, rooted at the last committed token.
    let masks: Vec<crate::model::TreeMask> = trees
        .iter()
        .map(|&n| crate::model::TreeMask {
            parents: (0..=n).map(|i| i.checked_sub(1).map(|j| j / 3)).collect(),
        })
        .collect();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); ks.len()];
    let mut tree_times: Vec<Vec<f64>> = vec![Vec::new(); trees.len()];
    let mut twin_times: Vec<Vec<f64>> = vec![Vec::new(); trees.len()];
    let mut left = reps;
    while left > 0 {
        let n = left.min(VERIFY_BLOCK);
        left -= n;
        for (i, &k) in ks.iter().enumerate() {
            for j in 0..n + VERIFY_WARMUP {
                let s = timed(&mut || {
                    model
                        .forward_one(&mut c, &draft[..k], Logits::All)
                        .map(drop)
                })?;
                if j >= VERIFY_WARMUP {
                    times[i].push(s * 1e3);
                }
                c.truncate(context)?;
            }
        }
    }
    let mut left = reps;
    while left > 0 {
        let n = left.min(VERIFY_BLOCK);
        left -= n;
        for (i, mask) in masks.iter().enumerate() {
            // The tree, then a chain of as many tokens (its twin).
            for (tree, out) in [(Some(mask), &mut tree_times[i]), (None, &mut twin_times[i])] {
                for j in 0..n + VERIFY_WARMUP {
                    let s = timed(&mut || {
                        model
                            .forward(
                                &mut [crate::model::ForwardInput {
                                    cache: &mut c,
                                    tokens: &draft[..mask.parents.len()],
                                    logits: Logits::All,
                                    tree,
                                }],
                                &[],
                            )
                            .map(drop)
                    })?;
                    if j >= VERIFY_WARMUP {
                        out.push(s * 1e3);
                    }
                    c.truncate(context)?;
                }
            }
        }
    }
    let kv_bytes = c.num_blocks() * c.layout().block_bytes();
    let med: Vec<f64> = times.into_iter().map(median).collect();
    let base = ks
        .iter()
        .position(|&k| k == 1)
        .map(|i| med[i])
        .unwrap_or(med[0]);
    let verify = ks
        .iter()
        .zip(&med)
        .map(|(&k, &m)| (k, m, m / base))
        .collect();
    let tree_med: Vec<f64> = tree_times.into_iter().map(median).collect();
    let tree_verify = trees
        .iter()
        .zip(&tree_med)
        .map(|(&n, &m)| (n, m, m / base))
        .collect();
    let tree_vs_chain = trees
        .iter()
        .zip(&tree_med)
        .zip(twin_times.into_iter().map(median))
        .map(|((&n, &t), c)| (n, c, t / c))
        .collect();
    Ok(ModelBench {
        threads: model.threads(),
        kernel: kernel_name(model.kernel_path()),
        prefill_tokens: prefill,
        prefill_tok_s,
        prefill_range,
        prefill_runs: PREFILL_RUNS,
        decode_tokens: decode,
        decode_tok_s,
        context,
        verify,
        tree_verify,
        tree_vs_chain,
        weight_bytes: model.weight_bytes(),
        kv_bytes,
        kv_full_context: {
            let l = c.layout();
            let n = model.config.max_seq_len;
            (n, l.bytes_at(n), l.blocks_for(n) * l.block_bytes())
        },
        // Without a reset, the resident set now (the probe's buffers are
        // freed) stands in for the peak after the probes.
        peak_rss_bytes: peak_before.max(if reset { peak_rss_bytes() } else { rss_bytes() }),
        read_gb_s,
        weights_read_gb_s,
        decode_limit_tok_s: if cold { read_gb_s } else { weights_read_gb_s } * 1e9
            / model.weight_bytes().max(1) as f64,
        cold,
    })
}

/// One row of `bench_sampling`: decoding through the engine with one
/// proposer and one sampling setting.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SamplingBench {
    pub proposer: String,
    /// "greedy", "temperature T" or "temperature T, top-p P".
    pub mode: String,
    /// Median generated tokens per second over the repetitions.
    pub tok_s: f64,
    /// `tok_s` relative to greedy with the same proposer.
    pub vs_greedy: f64,
    /// Share of the wall time spent in the accept stage (target
    /// distributions, rejection sampling, penalties), summed over runs.
    pub accept_share: f64,
    /// Mean tokens committed per verify step.
    pub tokens_per_step: f64,
}

/// Decode `tokens` tokens after `prompt` through the engine (`SyncDriver`,
/// one sequence) for each proposer, greedy, at `temperature`, and at
/// `temperature` with top-p `top_p`; the settings are interleaved per
/// repetition so drift hits them alike. `drafter` makes a fresh set of
/// proposers for each run, so no run sees another's text.
#[allow(clippy::too_many_arguments)]
pub fn bench_sampling(
    model: &std::sync::Arc<Model>,
    drafter: &dyn Fn() -> Result<crate::speculative::drafter::Drafter>,
    proposers: &[String],
    prompt: &[u32],
    tokens: usize,
    reps: usize,
    temperature: f32,
    top_p: f32,
) -> Result<Vec<SamplingBench>> {
    use crate::sampler::SamplingParams;
    use crate::speculative::driver::{EngineConfig, SyncDriver};
    use crate::speculative::Request;
    let modes: Vec<(String, SamplingParams)> = vec![
        ("greedy".into(), SamplingParams::greedy()),
        (
            format!("temperature {temperature}"),
            SamplingParams {
                temperature,
                ..Default::default()
            },
        ),
        (
            format!("temperature {temperature}, top-p {top_p}"),
            SamplingParams {
                temperature,
                top_p,
                ..Default::default()
            },
        ),
    ];
    // (tok/s per rep, accept seconds, wall seconds, tokens, steps)
    type Acc = (Vec<f64>, f64, f64, usize, u64);
    let mut acc: Vec<Vec<Acc>> =
        vec![vec![(Vec::new(), 0.0, 0.0, 0, 0); modes.len()]; proposers.len()];
    for rep in 0..reps.max(1) {
        for (pi, name) in proposers.iter().enumerate() {
            for (mi, (_, params)) in modes.iter().enumerate() {
                let mut d = SyncDriver::new(
                    model.clone(),
                    None,
                    EngineConfig::for_model(model),
                    drafter()?,
                );
                let req = Request {
                    params: SamplingParams {
                        seed: 1 + rep as u64,
                        ..params.clone()
                    },
                    ignore_eos: true,
                    proposer: Some(name.clone()),
                    ..Request::greedy(prompt.to_vec(), tokens)
                };
                d.add(req, None)?;
                let t = Instant::now();
                let done = d.run_to_completion()?;
                let wall = t.elapsed().as_secs_f64();
                let n: usize = done.iter().map(|c| c.tokens.len()).sum();
                let a = &mut acc[pi][mi];
                a.0.push(n as f64 / wall);
                a.1 += d.times.accept_s;
                a.2 += wall;
                a.3 += n;
                a.4 += d.times.steps;
            }
        }
    }
    let mut out = Vec::new();
    for (pi, name) in proposers.iter().enumerate() {
        let greedy = median(acc[pi][0].0.clone());
        for (mi, (mode, _)) in modes.iter().enumerate() {
            let a = &acc[pi][mi];
            let tok_s = median(a.0.clone());
            out.push(SamplingBench {
                proposer: name.clone(),
                mode: mode.clone(),
                tok_s,
                vs_greedy: tok_s / greedy,
                accept_share: a.1 / a.2.max(f64::MIN_POSITIVE),
                tokens_per_step: a.3 as f64 / (a.4.max(1) as f64),
            });
        }
    }
    Ok(out)
}

/// Time to first token of a request whose `prefix` tokens nobody asked for
/// before (cold), of a second one sharing them (warm: the prefix cache
/// holds its full blocks), and the mean over four more arriving together
/// (warm, sharing the prefill budget), through the engine, median over
/// `reps` fresh prefixes. Returns (cold ms, warm ms, four warm at once ms).
pub fn bench_prefix_cache(
    model: &std::sync::Arc<Model>,
    prefix: usize,
    reps: usize,
) -> Result<(f64, f64, f64)> {
    use crate::speculative::drafter::Drafter;
    use crate::speculative::driver::{EngineConfig, SyncDriver};
    use crate::speculative::Request;
    let vocab = model.config.vocab_size;
    let mut ec = EngineConfig::for_model(model);
    ec.prefix_cache_blocks = ec.prefix_cache_blocks.max(prefix.div_ceil(64) * 2 + 8);
    let mut d = SyncDriver::new(model.clone(), None, ec, Drafter::new());
    let ttft = |d: &mut SyncDriver, prompt: Vec<u32>| -> Result<f64> {
        let t = Instant::now();
        d.add(
            Request {
                proposer: Some("none".into()),
                ..Request::greedy(prompt, 1)
            },
            None,
        )?;
        d.run_to_completion()?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    // Mean time to first token of `prompts` added at once.
    let ttft_together = |d: &mut SyncDriver, prompts: Vec<Vec<u32>>| -> Result<f64> {
        let t = Instant::now();
        let mut rxs = Vec::new();
        for p in prompts {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            d.add(
                Request {
                    proposer: Some("none".into()),
                    ..Request::greedy(p, 1)
                },
                Some(tx),
            )?;
            rxs.push(rx);
        }
        let mut firsts = vec![None; rxs.len()];
        while firsts.iter().any(Option::is_none) && !d.scheduler.is_idle() {
            d.step()?;
            for (f, rx) in firsts.iter_mut().zip(&mut rxs) {
                while let Ok(ev) = rx.try_recv() {
                    if f.is_none()
                        && matches!(ev, crate::speculative::Event::Tokens { ref ids, .. } if !ids.is_empty())
                    {
                        *f = Some(t.elapsed().as_secs_f64() * 1e3);
                    }
                }
            }
        }
        d.run_to_completion()?;
        let n = firsts.len().max(1) as f64;
        Ok(firsts
            .into_iter()
            .map(|f| f.unwrap_or(f64::NAN))
            .sum::<f64>()
            / n)
    };
    // Warm up the kernels once.
    ttft(&mut d, tokens(64, vocab, 99))?;
    let (mut cold, mut warm, mut together) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..reps.max(1) {
        let shared = tokens(prefix, vocab, 1000 + rep as u64);
        let with = |salt: u64| {
            let mut p = shared.clone();
            p.extend(tokens(16, vocab, salt));
            p
        };
        cold.push(ttft(&mut d, with(2000 + rep as u64))?);
        warm.push(ttft(&mut d, with(3000 + rep as u64))?);
        let four = (0..4).map(|i| with(4000 + 10 * rep as u64 + i)).collect();
        together.push(ttft_together(&mut d, four)?);
    }
    Ok((median(cold), median(warm), median(together)))
}
