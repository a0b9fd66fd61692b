//! The run loop: one request at a time on a `SyncDriver`, arm order
//! rotated per prompt, fresh proposers for every repeat.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::stats::{summarize, token_mismatches};
use super::{AbReport, Prompt, Record};
use crate::config::{AbSection, ArmConfig, Config};
use crate::error::{Result, SpecdError};
use crate::model::Model;
use crate::sampler::SamplingParams;
use crate::speculative::driver::SyncDriver;
use crate::speculative::{Event, Request};
use crate::structured::{Constraint, ConstraintSpec, Grammars};
use crate::tokenizer::{ChatMessage, Tokenizer};

/// Run one request alone on `engine`, timing its tokens.
fn run_one(
    engine: &mut SyncDriver,
    req: Request,
    max_batch_tokens: usize,
) -> Result<(Record, Vec<u32>)> {
    let prompt_tokens = req.prompt.len();
    let times0 = engine.times.clone();
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
                Event::Error(e) | Event::Rejected(e) => return Err(SpecdError::InvalidRequest(e)),
            }
        }
    }
    let c = completion.expect("loop ends with a completion");
    let wall = t0.elapsed().as_secs_f64();
    let times = engine.times.since(&times0);
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
            draft_s: times.draft_s,
            verify_s: times.verify_s,
            steps_by_tokens: times
                .by_tokens
                .iter()
                .map(|(&k, &(n, v, d))| (k, n, v, d))
                .collect(),
            members: c
                .stats
                .members
                .iter()
                .map(|(m, v)| (m.clone(), v[0], v[1], v[2]))
                .collect(),
            finish_stop: c.finish == crate::sampler::FinishReason::Stop,
            complete: None,
        },
        c.tokens,
    ))
}

/// Run the A/B described by `cfg.ab` over `prompts`.
/// The configured arms, with a plain arm first unless one is configured;
/// and the plain arm's name.
pub(super) fn arms_with_plain(ab: &AbSection) -> (Vec<ArmConfig>, String) {
    let mut arms = ab.arm.clone();
    let plain = match arms.iter_mut().find(|a| a.proposer == "none") {
        Some(a) => {
            // The baseline is plain (constrained) decoding: no forced
            // drafts unless the arm asks.
            a.forced_drafts.get_or_insert(false);
            a.name.clone()
        }
        None => {
            arms.insert(
                0,
                ArmConfig {
                    name: "plain".into(),
                    proposer: "none".into(),
                    max_draft: None,
                    draft_pricing: None,
                    forced_drafts: Some(false),
                },
            );
            "plain".into()
        }
    };
    (arms, plain)
}

/// The arms (plain included) whose output must be plain decoding's token
/// for token: every arm when greedy; when sampled (one seed per prompt,
/// the same for every arm), plain and the arms whose proposer declares
/// one-hot q, whose drafts are verified by coupling to plain decoding's
/// draws (`speculative::accept`); the others' rejections decide tokens.
pub(super) fn compared_arms(
    arms: &[ArmConfig],
    greedy: bool,
    drafter: &crate::speculative::drafter::Drafter,
) -> Vec<String> {
    arms.iter()
        .filter(|a| {
            greedy
                || a.proposer == "none"
                || drafter
                    .capabilities(&a.proposer)
                    .is_some_and(|c| c.q_kind == crate::speculative::proposer::QKind::OneHot)
        })
        .map(|a| a.name.clone())
        .collect()
}

/// Every arm names a loaded proposer (or none).
pub(super) fn check_arms(
    arms: &[ArmConfig],
    drafter: &crate::speculative::drafter::Drafter,
) -> Result<()> {
    for a in arms {
        if a.proposer != "none" && !drafter.has(&a.proposer) {
            return Err(SpecdError::InvalidRequest(format!(
                "arm `{}`: unknown proposer `{}`",
                a.name, a.proposer
            )));
        }
    }
    Ok(())
}

/// The request `arm` makes for prompt `ids`: the section's sampling with
/// its seed offset by `seed_offset` (the same for every arm), up to
/// `max_tokens` within the model's context.
pub(super) fn arm_request(
    ab: &AbSection,
    ids: &[u32],
    arm: &ArmConfig,
    seed_offset: u64,
    model: &Model,
    constraint: Option<&Constraint>,
) -> Request {
    let room = model.config.max_seq_len.saturating_sub(ids.len());
    Request {
        prompt: ids.to_vec(),
        params: SamplingParams {
            seed: ab.sampling.seed.wrapping_add(seed_offset),
            ..ab.sampling.clone()
        },
        max_tokens: ab.max_tokens.min(room),
        stop: Vec::new(),
        ignore_eos: false,
        stop_token_ids: Vec::new(),
        min_tokens: 0,
        proposer: Some(arm.proposer.clone()),
        max_draft: arm.max_draft,
        arm: Some(arm.name.clone()),
        logprobs: None,
        fork_of: None,
        prompt_logprobs: None,
        priority: 0,
        group: None,
        constraint: constraint.cloned(),
        forced_drafts: arm.forced_drafts.unwrap_or(true),
    }
}

/// Each prompt's schema compiled for the model (`None` where it has none).
pub(super) fn compile_schemas(
    model: &Model,
    tok: &Tokenizer,
    prompts: &[Prompt],
) -> Result<Vec<Option<Constraint>>> {
    if prompts.iter().all(|p| p.schema.is_none()) {
        return Ok(vec![None; prompts.len()]);
    }
    let g = Grammars::new(tok, model.config.vocab_size, &model.config.eos_token_ids)?;
    prompts
        .iter()
        .map(|p| {
            p.schema
                .as_ref()
                .map(|s| {
                    g.compile(
                        &ConstraintSpec::JsonSchema(s.clone()),
                        &format!("prompt `{}` schema", p.id),
                    )
                })
                .transpose()
        })
        .collect()
}

/// Token ids of every prompt (through the chat template with `chat`).
pub(super) fn encode_prompts(
    tok: &Tokenizer,
    prompts: &[Prompt],
    chat: bool,
) -> Result<Vec<Vec<u32>>> {
    prompts
        .iter()
        .map(|p| {
            if chat {
                let t = tok.apply_chat_template(&[ChatMessage::user(p.text.clone())], true)?;
                tok.encode(&t, false)
            } else {
                tok.encode(&p.text, true)
            }
        })
        .collect()
}

pub fn run(
    cfg: &Config,
    ab: &AbSection,
    model: Arc<Model>,
    tok: Arc<Tokenizer>,
    prompts: &[Prompt],
    chat: bool,
) -> Result<AbReport> {
    ab.sampling.validate()?;
    // Records pair by prompt id: two prompts with one id would pair an
    // arm's record with another prompt's plain one.
    let mut ids = std::collections::HashSet::new();
    if let Some(p) = prompts.iter().find(|p| !ids.insert(p.id.as_str())) {
        return Err(SpecdError::InvalidRequest(format!(
            "prompt id `{}` appears more than once in the dataset (ids pair each arm's records with plain decoding's); give every prompt its own id",
            p.id
        )));
    }
    let (arms, plain) = arms_with_plain(ab);
    // Arms that name the same proposer (to compare draft caps or pricing)
    // get an instance each, under an alias: one shared instance would
    // learn one arm's output and draft it for the next arm on the same
    // prompt (the suffix tree does), inflating whichever runs second.
    let aliases: Vec<Option<String>> = arms
        .iter()
        .enumerate()
        .map(|(i, a)| {
            (a.proposer != "none" && arms[..i].iter().any(|b| b.proposer == a.proposer))
                .then(|| format!("{}#{}", a.proposer, a.name))
        })
        .collect();
    // Proposers keep state across requests (the suffix proposer's global
    // tree learns every output); each repeat gets fresh instances, or a
    // later repeat would draft from the identical greedy output of an
    // earlier one.
    let fresh_engine = || -> Result<SyncDriver> {
        let mut drafter = cfg.build_drafter(&model, Some(tok.clone()))?;
        for (arm, alias) in arms.iter().zip(&aliases) {
            let (Some(alias), Some(pc)) =
                (alias, cfg.proposer.iter().find(|p| p.name == arm.proposer))
            else {
                continue;
            };
            let mut pc = pc.clone();
            pc.name = alias.clone();
            drafter.add(cfg.build_proposer(&pc, &model, Some(tok.clone()))?);
        }
        let mut ec = cfg.engine_config(&model);
        ec.scheduler.max_running = 1;
        // Every arm prefills its prompt itself: the arms that run a prompt
        // after the first would otherwise find it cached.
        ec.prefix_cache_blocks = 0;
        Ok(SyncDriver::new(
            model.clone(),
            Some(tok.clone()),
            ec,
            drafter,
        ))
    };
    let mut engine = fresh_engine()?;
    check_arms(&arms, &engine.drafter)?;
    let max_batch_tokens = engine.scheduler.config.max_batch_tokens;
    let measured = engine.scheduler.config.measured_pricing;
    let encoded = encode_prompts(&tok, prompts, chat)?;
    let constraints = compile_schemas(&model, &tok, prompts)?;
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
    // A proposer that fails mid-run decodes plainly from then on: its
    // arm's figures would be plain decoding's under its name.
    let check_health = |engine: &SyncDriver| -> Result<()> {
        for (arm, alias) in arms.iter().zip(&aliases) {
            let name = alias.as_deref().unwrap_or(&arm.proposer);
            if let Some(why) = engine.drafter.poisoned(name) {
                return Err(SpecdError::InvalidRequest(format!(
                    "arm `{}`: proposer `{}` failed during the run ({why}); its figures would be plain decoding's, so no report is written",
                    arm.name, arm.proposer
                )));
            }
        }
        Ok(())
    };
    // One untimed plain request on each fresh engine: the first timed
    // request (plain's, in repeat 0) would otherwise pay the first touch
    // of its buffers alone.
    let warm_up = |engine: &mut SyncDriver| -> Result<()> {
        if let (Some(ids), Some(p)) = (encoded.first(), arms.iter().find(|a| a.name == plain)) {
            let mut req = arm_request(ab, ids, p, u64::MAX, &model, constraints[0].as_ref());
            req.max_tokens = req.max_tokens.min(8);
            run_one(engine, req, max_batch_tokens)?;
        }
        Ok(())
    };
    for rep in 0..ab.repeats {
        if rep > 0 {
            check_health(&engine)?;
            engine = fresh_engine()?;
        }
        warm_up(&mut engine)?;
        for (i, (p, ids)) in prompts.iter().zip(&encoded).enumerate() {
            let n = arms.len();
            for k in 0..n {
                // Rotate the arm order prompt by prompt (and repeat by repeat).
                let a = (i + rep + k) % n;
                let arm = &arms[a];
                let mut req = arm_request(
                    ab,
                    ids,
                    arm,
                    i as u64 * 7919 + rep as u64,
                    &model,
                    constraints[i].as_ref(),
                );
                if let Some(alias) = &aliases[a] {
                    req.proposer = Some(alias.clone());
                }
                engine.scheduler.config.measured_pricing = arm
                    .draft_pricing
                    .map_or(measured, |p| p == crate::config::DraftPricing::Measured);
                let (mut r, toks) = run_one(&mut engine, req, max_batch_tokens)?;
                r.prompt_id = p.id.clone();
                r.category = p.category.clone();
                r.arm = arm.name.clone();
                r.repeat = rep;
                if constraints[i].is_some() {
                    // Complete (ended by the constraint) and parses.
                    let text = tok.decode(&toks, false).unwrap_or_default();
                    r.complete = Some(
                        r.finish_stop && serde_json::from_str::<serde_json::Value>(&text).is_ok(),
                    );
                }
                r.token_ids = toks;
                bar.set_message(format!("{} {}", arm.name, p.id));
                bar.inc(1);
                records.push(r);
            }
        }
    }
    bar.finish_and_clear();
    check_health(&engine)?;
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
    let mut compared = compared_arms(&arms, greedy, &engine.drafter);
    compared.retain(|a| *a != plain);
    let kept: Vec<&Record> = records
        .iter()
        .filter(|r| r.arm == plain || compared.contains(&r.arm))
        .collect();
    let mismatches = token_mismatches(&kept, &plain);
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
        compared,
        records,
    })
}
