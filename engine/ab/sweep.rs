//! The concurrency sweep (`specd ab --concurrency 1,4,16,64`): aggregate
//! throughput of every arm with N requests in flight.
//!
//! Invariants:
//! - Every (point, arm) runs on a fresh engine: fresh proposers (the
//!   suffix tree learns every output, which would inflate later points)
//!   and a fresh verify-cost model; the arm order rotates point by point.
//! - All prompts run at every point, with exactly `concurrency` requests
//!   in flight while any are left.
//! - The compared arms' tokens at every point (`run::compared_arms`: every
//!   arm under greedy decoding; plain and the one-hot arms when sampled)
//!   are compared with the plain arm at the first point (speculation and
//!   batching are both lossless).

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::run::{arm_request, arms_with_plain, check_arms, compared_arms, encode_prompts};
use super::{Mismatch, Prompt};
use crate::config::{AbSection, Config, DraftPricing};
use crate::error::{Result, SpecdError};
use crate::model::Model;
use crate::sampler::SamplingParams;
use crate::speculative::driver::{EngineConfig, SyncDriver};
use crate::speculative::kv_manager::{KvManager, Pool};
use crate::speculative::SeqId;
use crate::tokenizer::Tokenizer;

/// One arm at one concurrency.
#[derive(Debug, Clone, Serialize)]
pub struct SweepRow {
    pub concurrency: usize,
    pub arm: String,
    pub requests: usize,
    /// Runs folded into this row (repeats).
    pub runs: usize,
    pub tokens: usize,
    pub wall_s: f64,
    pub tok_per_s: f64,
    /// Against the plain arm at the same concurrency.
    pub vs_plain: f64,
    pub drafted: u64,
    pub accepted: u64,
    pub verify_steps: u64,
    /// Mean verify cost of a drafted token the policy priced drafts at
    /// (relative to a sequence's share of a step).
    pub mean_draft_price: Option<f64>,
    /// Share of the wall time spent in the draft stage (proposers).
    pub draft_share: f64,
}

impl SweepRow {
    /// Fold a repeat's run into this row.
    fn add(&mut self, o: &SweepRow) {
        self.requests += o.requests;
        self.tokens += o.tokens;
        self.draft_share = (self.draft_share * self.wall_s + o.draft_share * o.wall_s)
            / (self.wall_s + o.wall_s).max(1e-9);
        self.wall_s += o.wall_s;
        self.tok_per_s = self.tokens as f64 / self.wall_s.max(1e-9);
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        self.verify_steps += o.verify_steps;
        let n = self.runs as f64;
        self.mean_draft_price = match (self.mean_draft_price, o.mean_draft_price) {
            (Some(a), Some(b)) => Some((a * n + b) / (n + 1.0)),
            (a, b) => a.or(b),
        };
        self.runs += 1;
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SweepReport {
    pub dataset: String,
    pub prompts: usize,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub threads: usize,
    pub repeats: usize,
    pub points: Vec<usize>,
    pub rows: Vec<SweepRow>,
    /// The arms compared token for token with plain decoding at the first
    /// point, at every point: all when greedy; when sampled, plain and the
    /// arms whose proposer declares one-hot q (plain decoding's draws for
    /// the seed, alone or batched: `speculative::accept`).
    pub compared: Vec<String>,
    pub mismatches: Vec<Mismatch>,
}

/// Run the sweep over `points`.
pub fn sweep(
    cfg: &Config,
    ab: &AbSection,
    model: Arc<Model>,
    tok: Arc<Tokenizer>,
    prompts: &[Prompt],
    chat: bool,
    points: &[usize],
) -> Result<SweepReport> {
    ab.sampling.validate()?;
    if points.is_empty() || points.contains(&0) {
        return Err(SpecdError::InvalidRequest(
            "concurrency: give one or more positive numbers".into(),
        ));
    }
    let (arms, plain) = arms_with_plain(ab);
    let encoded = encode_prompts(&tok, prompts, chat)?;
    let constraints = super::run::compile_schemas(&model, &tok, prompts)?;
    let longest = encoded.iter().map(Vec::len).max().unwrap_or(0);
    let fresh = |c: usize, pricing: Option<DraftPricing>| -> Result<SyncDriver> {
        let drafter = cfg.build_drafter(&model, Some(tok.clone()))?;
        let mut ec = cfg.engine_config(&model);
        ec.scheduler.max_running = c;
        ec.scheduler.max_waiting = prompts.len().max(1);
        if let Some(p) = pricing {
            ec.scheduler.measured_pricing = p == DraftPricing::Measured;
        }
        // Room for every running request's whole context, no more, and
        // for the largest proposer cache charged beside it (an arm with a
        // draft model would otherwise wait for blocks the plain arm has).
        let ctx = longest + ab.max_tokens + ec.scheduler.max_draft + 1;
        let charge = drafter
            .names()
            .iter()
            .filter_map(|n| drafter.capabilities(n))
            .map(|c| c.kv_bytes_per_token)
            .max()
            .unwrap_or(0);
        let kv = KvManager::for_model(&model, 0);
        let extra =
            kv.charged_blocks_for(Pool::Target, ctx, charge) - kv.blocks_for(Pool::Target, ctx);
        ec.kv_blocks = EngineConfig::kv_blocks_for(&model, c, ctx) + c * extra;
        ec.prefix_cache_blocks = 0;
        Ok(SyncDriver::new(
            model.clone(),
            Some(tok.clone()),
            ec,
            drafter,
        ))
    };
    let probe = fresh(1, None)?;
    check_arms(&arms, &probe.drafter)?;
    let compared = compared_arms(&arms, ab.sampling.is_greedy(), &probe.drafter);
    drop(probe);
    let total = (points.len() * arms.len() * ab.repeats.max(1)) as u64;
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} runs  {elapsed}  {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();
    let mut outputs: Vec<(usize, String, Vec<Vec<u32>>)> = Vec::new();
    let repeats = ab.repeats.max(1);
    for (pi, &c) in points.iter().enumerate() {
        let mut point_rows: Vec<SweepRow> = Vec::new();
        // Repeats rotate the arm order again, so drift on a shared machine
        // spreads over every arm; their tokens and times add up.
        for rep in 0..repeats {
            for k in 0..arms.len() {
                let arm = &arms[(pi + rep + k) % arms.len()];
                bar.set_message(format!(
                    "concurrency {c}, {} (repeat {})",
                    arm.name,
                    rep + 1
                ));
                let mut engine = fresh(c, arm.draft_pricing)?;
                let (row, toks) =
                    run_point(&mut engine, ab, &encoded, &constraints, arm, c, &model)?;
                match point_rows.iter_mut().find(|r| r.arm == row.arm) {
                    Some(r) => r.add(&row),
                    None => point_rows.push(row),
                }
                if rep == 0 {
                    outputs.push((c, arm.name.clone(), toks));
                }
                bar.inc(1);
            }
        }
        let base = point_rows
            .iter()
            .find(|r| r.arm == plain)
            .map(|r| r.tok_per_s)
            .unwrap_or(0.0);
        for mut r in point_rows {
            r.vs_plain = if base > 0.0 { r.tok_per_s / base } else { 0.0 };
            rows.push(r);
        }
    }
    bar.finish_and_clear();
    rows.sort_by_key(|r| {
        (
            r.concurrency,
            arms.iter().position(|a| a.name == r.arm).unwrap_or(0),
        )
    });
    let mut mismatches = Vec::new();
    if let Some((_, _, reference)) = outputs
        .iter()
        .find(|(c, a, _)| *c == points[0] && *a == plain)
    {
        for (c, arm, toks) in outputs.iter().filter(|(_, a, _)| compared.contains(a)) {
            for (i, (a, b)) in toks.iter().zip(reference).enumerate() {
                if a != b {
                    let position = a.iter().zip(b).take_while(|(x, y)| x == y).count();
                    mismatches.push(Mismatch {
                        prompt_id: prompts[i].id.clone(),
                        arm: format!("{arm} @ concurrency {c}"),
                        repeat: 0,
                        position,
                    });
                }
            }
        }
    }
    Ok(SweepReport {
        dataset: ab.dataset.clone(),
        prompts: prompts.len(),
        max_tokens: ab.max_tokens,
        sampling: ab.sampling.clone(),
        threads: model.threads(),
        repeats,
        points: points.to_vec(),
        rows,
        compared,
        mismatches,
    })
}

/// Every prompt through `engine` with `c` requests in flight.
fn run_point(
    engine: &mut SyncDriver,
    ab: &AbSection,
    encoded: &[Vec<u32>],
    constraints: &[Option<crate::structured::Constraint>],
    arm: &crate::config::ArmConfig,
    c: usize,
    model: &Model,
) -> Result<(SweepRow, Vec<Vec<u32>>)> {
    let mut next = 0;
    let mut in_flight: std::collections::HashMap<SeqId, usize> = Default::default();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); encoded.len()];
    let (mut drafted, mut accepted, mut steps, mut tokens) = (0u64, 0u64, 0u64, 0usize);
    let t0 = Instant::now();
    while next < encoded.len() || !in_flight.is_empty() {
        while in_flight.len() < c && next < encoded.len() {
            let req = arm_request(
                ab,
                &encoded[next],
                arm,
                next as u64 * 7919,
                model,
                constraints[next].as_ref(),
            );
            let id = engine.add(req, None)?;
            in_flight.insert(id, next);
            next += 1;
        }
        for done in engine.step()?.finished {
            let Some(i) = in_flight.remove(&done.id) else {
                continue;
            };
            drafted += done.stats.drafted;
            accepted += done.stats.accepted;
            steps += done.stats.verify_steps;
            tokens += done.tokens.len();
            out[i] = done.tokens;
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    Ok((
        SweepRow {
            concurrency: c,
            arm: arm.name.clone(),
            requests: encoded.len(),
            runs: 1,
            tokens,
            wall_s: wall,
            tok_per_s: tokens as f64 / wall.max(1e-9),
            vs_plain: 0.0,
            drafted,
            accepted,
            verify_steps: steps,
            mean_draft_price: engine.scheduler.mean_draft_price(),
            draft_share: engine.times.draft_s / wall.max(1e-9),
        },
        out,
    ))
}

/// A Markdown table: one row per arm (in first-seen order, those `keep`
/// accepts), one column per concurrency, each cell from `cell`.
fn sweep_table(
    r: &SweepReport,
    keep: impl Fn(&SweepRow) -> bool,
    cell: impl Fn(&SweepRow) -> String,
) -> String {
    let mut s = String::from("| arm |");
    for c in &r.points {
        s += &format!(" {c} |");
    }
    s += "\n|---|";
    for _ in &r.points {
        s += "---|";
    }
    s += "\n";
    let mut arms: Vec<&str> = Vec::new();
    for row in r.rows.iter().filter(|x| keep(x)) {
        if !arms.contains(&row.arm.as_str()) {
            arms.push(&row.arm);
        }
    }
    for a in arms {
        s += &format!("| {a} |");
        for c in &r.points {
            match r.rows.iter().find(|x| x.arm == a && x.concurrency == *c) {
                Some(x) => s += &format!(" {} |", cell(x)),
                None => s += " |",
            }
        }
        s += "\n";
    }
    s
}

/// The sweep as Markdown: aggregate tok/s and the ratio to plain, then the
/// drafting figures behind them.
pub fn sweep_markdown(r: &SweepReport) -> String {
    let mut s = format!(
        "# Concurrency sweep: {} ({} prompts, {} repeat(s), max_tokens {}, temperature {}, {} threads)\n\n",
        r.dataset, r.prompts, r.repeats, r.max_tokens, r.sampling.temperature, r.threads
    );
    s += "Aggregate tok/s (ratio to plain at the same concurrency); every (point, arm) on a fresh engine.\n\n";
    s += &sweep_table(
        r,
        |_| true,
        |x| format!("{:.1} ({:.2}x)", x.tok_per_s, x.vs_plain),
    );
    s += "\nDrafted tokens per verify step / acceptance / mean price of a drafted token (verify cost relative to a sequence's share of the step) / share of wall time in the draft stage:\n\n";
    s += &sweep_table(
        r,
        |x| x.drafted + x.verify_steps > 0,
        |x| {
            let per = x.drafted as f64 / x.verify_steps.max(1) as f64;
            let acc = x.accepted as f64 / x.drafted.max(1) as f64;
            let price = x
                .mean_draft_price
                .map(|p| format!("{p:.3}"))
                .unwrap_or_else(|| "-".into());
            format!(
                "{per:.2} / {acc:.2} / {price} / {:.1}%",
                100.0 * x.draft_share
            )
        },
    );
    s += "\n";
    if r.mismatches.is_empty() {
        if r.sampling.is_greedy() {
            s += "Every arm at every concurrency matched plain decoding token for token.\n";
        } else {
            s += &format!(
                "Sampled with one seed per prompt: {} matched plain decoding at concurrency {} token for token at every concurrency (batching and one-hot drafts leave plain decoding's draws for the seed as they are).\n",
                r.compared.join(", "),
                r.points.first().copied().unwrap_or(1)
            );
            let mut arms: Vec<&str> = r.rows.iter().map(|x| x.arm.as_str()).collect();
            arms.sort_unstable();
            arms.dedup();
            if arms.len() > r.compared.len() {
                s += "The other arms' sampled outputs are not compared (their rejections decide tokens).\n";
            }
        }
    }
    for m in &r.mismatches {
        s += &format!(
            "- MISMATCH: {} prompt {} from position {}\n",
            m.arm, m.prompt_id, m.position
        );
    }
    s
}

/// Write `sweep.json` and `sweep.md` into `dir`.
pub fn write_sweep(r: &SweepReport, dir: &std::path::Path) -> Result<Vec<std::path::PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let files = vec![dir.join("sweep.json"), dir.join("sweep.md")];
    std::fs::write(
        &files[0],
        serde_json::to_string_pretty(r).map_err(|e| SpecdError::InvalidRequest(e.to_string()))?,
    )?;
    std::fs::write(&files[1], sweep_markdown(r))?;
    Ok(files)
}
