//! `specd bench-load`: interactive chats beside long-prompt batches, on the
//! engine's own driver with real arrival times. Reports the interactive
//! class's time to first token and time per output token without the
//! background load and with it under each scheduling policy, and the
//! aggregate throughput of the loaded runs.
//!
//! Invariant: every run of one call sees the same requests at the same
//! offsets from its start (interactive chats every `interval`, background
//! requests at 0); runs differ only in scheduling and in whether the
//! background is present.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::error::Result;
use crate::model::Model;
use crate::sampler::SamplingParams;
use crate::speculative::driver::{EngineConfig, SyncDriver};
use crate::speculative::fairness::Scheduling;
use crate::speculative::{Event, Request};
use crate::tokenizer::Tokenizer;

/// What one `bench_load` call runs.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Interactive chat prompts (token ids), sent in turn.
    pub chats: Vec<Vec<u32>>,
    /// Interactive requests, one every `interval`.
    pub interactive: usize,
    pub interval: Duration,
    pub interactive_tokens: usize,
    /// Background requests at time 0, each with `background_prompts`
    /// prompts of `background_len` tokens.
    pub background_requests: usize,
    pub background_prompts: usize,
    pub background_len: usize,
    pub background_tokens: usize,
    /// Proposer of every request (`none`: plain decoding).
    pub proposer: String,
}

/// One run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct LoadRun {
    /// `unloaded`, or the scheduling policy of a loaded run.
    pub name: String,
    pub ttft_p50_ms: f64,
    pub ttft_p95_ms: f64,
    pub ttft_p99_ms: f64,
    /// Time per output token after the first.
    pub tpot_p50_ms: f64,
    pub tpot_p95_ms: f64,
    /// Prompt plus generated tokens of every request over the run's wall
    /// time (first arrival to last completion).
    pub throughput_tok_s: f64,
    pub wall_s: f64,
    pub preemptions: u64,
    /// Token positions the target computed (recompute after preemption
    /// included) and the steps it took: what separates policies'
    /// throughput.
    pub computed_tokens: u64,
    pub steps: u64,
}

struct Tracked {
    arrival: Duration,
    rx: UnboundedReceiver<Event>,
    first: Option<Duration>,
    done: Option<Duration>,
    tokens: usize,
    interactive: bool,
}

/// Nearest-rank percentile (0 for no samples).
pub fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * q).round() as usize]
}

/// A scheduler setting a loaded run uses: the policy and, for fair
/// runs, `max_prefill_tokens` (`None`: the config's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    pub scheduling: Scheduling,
    pub max_prefill_tokens: Option<usize>,
}

impl Setting {
    pub fn name(&self) -> String {
        match (self.scheduling, self.max_prefill_tokens) {
            (Scheduling::Fcfs, _) => "fcfs".into(),
            (Scheduling::Fair, None) => "fair".into(),
            (Scheduling::Fair, Some(n)) => format!("fair/{n}"),
        }
    }
}

/// Run `spec` unloaded (interactive only, with the first fair setting)
/// and loaded under each of `settings`, on drivers from `make_driver` (a
/// fresh one per run).
pub fn bench_load(
    spec: &LoadSpec,
    settings: &[Setting],
    make_driver: &dyn Fn(Setting) -> Result<SyncDriver>,
    vocab: usize,
) -> Result<Vec<LoadRun>> {
    let unloaded = settings
        .iter()
        .copied()
        .find(|s| s.scheduling == Scheduling::Fair)
        .unwrap_or(Setting {
            scheduling: Scheduling::Fair,
            max_prefill_tokens: None,
        });
    let mut runs = vec![run_once(
        spec,
        false,
        "unloaded",
        make_driver(unloaded)?,
        vocab,
    )?];
    for &s in settings {
        runs.push(run_once(spec, true, &s.name(), make_driver(s)?, vocab)?);
    }
    Ok(runs)
}

fn run_once(
    spec: &LoadSpec,
    loaded: bool,
    name: &str,
    mut d: SyncDriver,
    vocab: usize,
) -> Result<LoadRun> {
    // (offset, request, interactive), in arrival order.
    let mut arrivals: Vec<(Duration, Request, bool)> = Vec::new();
    let proto = |prompt: Vec<u32>, max_tokens: usize| Request {
        proposer: Some(spec.proposer.clone()),
        ignore_eos: true,
        params: SamplingParams::greedy(),
        ..Request::greedy(prompt, max_tokens)
    };
    if loaded {
        for r in 0..spec.background_requests {
            for p in 0..spec.background_prompts {
                let salt = 1000 + (r * spec.background_prompts + p) as u64;
                let prompt = crate::bench_model::tokens(spec.background_len, vocab, salt);
                arrivals.push((Duration::ZERO, proto(prompt, spec.background_tokens), false));
            }
        }
    }
    for i in 0..spec.interactive {
        let prompt = spec.chats[i % spec.chats.len().max(1)].clone();
        let at = spec.interval * (i as u32 + 1);
        arrivals.push((at, proto(prompt, spec.interactive_tokens), true));
    }
    let mut tracked: Vec<Tracked> = Vec::new();
    let mut next = 0;
    // Background prompts of one request share a group (set once the
    // request's first sequence has its id).
    let mut groups: Vec<Option<u64>> = vec![None; spec.background_requests];
    let mut bg_seen = 0usize;
    let start = Instant::now();
    let mut preemptions = 0u64;
    let mut steps = 0u64;
    let computed_before = d.verifier.forwarded_tokens();
    loop {
        let now = start.elapsed();
        while next < arrivals.len() && arrivals[next].0 <= now {
            let (at, mut req, interactive) = arrivals[next].clone();
            let mut group_slot = None;
            if !interactive && spec.background_prompts > 0 {
                let g = bg_seen / spec.background_prompts;
                req.group = groups[g];
                group_slot = Some(g);
                bg_seen += 1;
            }
            let (tx, rx) = unbounded_channel();
            let id = d.add(req, Some(tx))?;
            if let Some(g) = group_slot {
                groups[g].get_or_insert(id);
            }
            tracked.push(Tracked {
                arrival: at,
                rx,
                first: None,
                done: None,
                tokens: 0,
                interactive,
            });
            next += 1;
        }
        if d.scheduler.is_idle() {
            if next >= arrivals.len() {
                break;
            }
            std::thread::sleep(arrivals[next].0.saturating_sub(start.elapsed()));
            continue;
        }
        let report = d.step()?;
        steps += 1;
        preemptions += report
            .finished
            .iter()
            .map(|c| u64::from(c.preemptions))
            .sum::<u64>();
        let t = start.elapsed();
        for tr in tracked.iter_mut().filter(|t| t.done.is_none()) {
            while let Ok(ev) = tr.rx.try_recv() {
                match ev {
                    Event::Tokens { ids, .. } if !ids.is_empty() => {
                        tr.first.get_or_insert(t);
                        tr.tokens += ids.len();
                    }
                    Event::Finished(_) | Event::Error(_) | Event::Rejected(_) => tr.done = Some(t),
                    _ => {}
                }
            }
        }
    }
    let wall = tracked
        .iter()
        .filter_map(|t| t.done)
        .max()
        .unwrap_or_default()
        .as_secs_f64();
    let inter: Vec<&Tracked> = tracked.iter().filter(|t| t.interactive).collect();
    let ttft: Vec<f64> = inter
        .iter()
        .filter_map(|t| Some((t.first? - t.arrival).as_secs_f64() * 1e3))
        .collect();
    let tpot: Vec<f64> = inter
        .iter()
        .filter(|t| t.tokens > 1)
        .filter_map(|t| Some((t.done? - t.first?).as_secs_f64() * 1e3 / (t.tokens - 1) as f64))
        .collect();
    let total_tokens: usize = arrivals
        .iter()
        .map(|(_, r, _)| r.prompt.len())
        .sum::<usize>()
        + tracked.iter().map(|t| t.tokens).sum::<usize>();
    Ok(LoadRun {
        name: name.to_string(),
        ttft_p50_ms: percentile(&ttft, 0.5),
        ttft_p95_ms: percentile(&ttft, 0.95),
        ttft_p99_ms: percentile(&ttft, 0.99),
        tpot_p50_ms: percentile(&tpot, 0.5),
        tpot_p95_ms: percentile(&tpot, 0.95),
        throughput_tok_s: total_tokens as f64 / wall.max(1e-9),
        wall_s: wall,
        preemptions,
        computed_tokens: d.verifier.forwarded_tokens() - computed_before,
        steps,
    })
}

/// Short chat questions, through `tok`'s chat template.
pub fn chat_prompts(tok: &Tokenizer) -> Result<Vec<Vec<u32>>> {
    const TEXTS: [&str; 8] = [
        "What is the capital of France?",
        "Give me three tips for staying focused while studying.",
        "Write a haiku about autumn rain.",
        "Explain what a hash map is in two sentences.",
        "How do I reverse a list in Python?",
        "Suggest a name for a friendly robot.",
        "Why is the sky blue? Answer briefly.",
        "List four fruits that are high in vitamin C.",
    ];
    TEXTS
        .iter()
        .map(|t| {
            let s = tok
                .apply_chat_template(&[crate::tokenizer::ChatMessage::user(t.to_string())], true)?;
            tok.encode(&s, false)
        })
        .collect()
}

/// A driver for `model` with `config`'s engine settings under `setting`.
pub fn driver(
    model: &Arc<Model>,
    tok: Option<Arc<Tokenizer>>,
    config: &crate::config::Config,
    setting: Setting,
) -> Result<SyncDriver> {
    let mut ec: EngineConfig = config.engine_config(model);
    ec.scheduler.scheduling = setting.scheduling;
    if let Some(n) = setting.max_prefill_tokens {
        ec.scheduler.max_prefill_tokens = n;
    }
    if setting.scheduling == Scheduling::Fcfs {
        // The scheduler before fair scheduling: prefill chunks up to the
        // whole batch budget.
        ec.scheduler.max_prefill_tokens = ec.scheduler.max_batch_tokens;
    }
    ec.scheduler.max_waiting = usize::MAX;
    let drafter = config.build_drafter(model, tok.clone())?;
    Ok(SyncDriver::new(model.clone(), tok, ec, drafter))
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 51.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 1.0), 3.0);
    }
}
