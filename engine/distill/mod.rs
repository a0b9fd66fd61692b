//! `specd distill`: train proposers for a target by self-distillation on
//! CPU, from the target's own responses to training prompts.
//!
//! - this file: the shared data pipeline. The target answers training
//!   prompts that are disjoint from every evaluation set the project ships
//!   (`prompts`: generated instructions and code stubs, none sharing an
//!   8-gram of words with Spec-Bench or HumanEval), in batches through the
//!   engine; the samples (prompt + response tokens) are cached in
//!   `<out>/samples.json` so a rerun or a resume does not regenerate them.
//! - `draft`: a small standalone Llama draft (`specd distill draft`).
//! - `eagle`: an EAGLE-3 head over the target's features
//!   (`specd distill eagle`).
//!
//! Invariant: no evaluation prompt (or a text sharing an 8-gram of words
//! with one) is ever trained on.

pub mod draft;
pub mod eagle;
pub mod medusa;

use std::path::Path;
use std::sync::Arc;

pub use draft::{distill, DistillConfig, State};

use crate::error::{Result, SpecdError};
use crate::model::Model;
use crate::sampler::SamplingParams;
use crate::speculative::drafter::Drafter;
use crate::speculative::driver::{EngineConfig, SyncDriver};
use crate::speculative::Request;
use crate::tokenizer::{ChatMessage, Tokenizer};

fn json_err(path: &Path, e: impl std::fmt::Display) -> SpecdError {
    SpecdError::InvalidRequest(format!("{}: {e}", path.display()))
}

/// Prompts to generate training text from: generated instructions and
/// code stubs that share no 8-gram of words with any evaluation set the
/// project ships (see `prompts`). Returns (text, chat) pairs.
pub fn prompt_set(limit: usize) -> Vec<(String, bool)> {
    let eval = crate::ab::evaluation_texts();
    let index = crate::prompts::NgramIndex::new(eval.iter().map(String::as_str));
    let (prompts, dropped) = crate::prompts::training_prompts(limit.max(1), 7, &index);
    eprintln!(
        "specd distill: {} training prompts (generated instructions and code stubs); {dropped} candidates dropped for sharing an 8-gram with Spec-Bench or HumanEval",
        prompts.len()
    );
    prompts.into_iter().map(|p| (p.text, p.chat)).collect()
}

/// How the target's training text is generated.
#[derive(Debug, Clone)]
pub struct DataConfig {
    /// Generated (response) tokens to collect.
    pub gen_tokens: usize,
    /// Most tokens per response.
    pub gen_max_tokens: usize,
    /// Temperature of the sampled responses (0: all greedy).
    pub temperature: f32,
    /// Fraction of responses sampled at `temperature` (the rest greedy).
    pub sampled_fraction: f32,
    /// Requests decoded together.
    pub concurrency: usize,
    pub seed: u64,
    /// Prompts as token ids (used instead of the text prompt set when
    /// non-empty; e.g. for targets without a text tokenizer).
    pub prompt_ids: Vec<Vec<u32>>,
}

/// One training sample: a prompt and the target's response.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    pub tokens: Vec<u32>,
    /// Tokens of `tokens` that are prompt (the rest is the response).
    pub prompt_len: usize,
}

#[derive(Debug, Clone)]
enum Prompt {
    /// Text, and whether to apply the chat template.
    Text(String, bool),
    Ids(Vec<u32>),
}

/// Generate (or load from `<out>/samples.json`) the target's responses.
pub fn training_data(
    model: &Arc<Model>,
    tok: &Arc<Tokenizer>,
    cfg: &DataConfig,
    out: &Path,
) -> Result<Vec<Sample>> {
    let path = out.join("samples.json");
    if let Ok(text) = std::fs::read_to_string(&path) {
        let d: Vec<Sample> = serde_json::from_str(&text).map_err(|e| json_err(&path, e))?;
        let n: usize = d.iter().map(|s| s.tokens.len() - s.prompt_len).sum();
        if n >= cfg.gen_tokens {
            eprintln!(
                "specd distill: reusing {n} response tokens of {} samples from {}",
                d.len(),
                path.display()
            );
            return Ok(d);
        }
    }
    let mut ec = EngineConfig::for_model(model);
    ec.scheduler.max_running = cfg.concurrency.max(1);
    ec.scheduler.max_waiting = usize::MAX;
    let mut engine = SyncDriver::new(model.clone(), Some(tok.clone()), ec, Drafter::new());
    let n_prompts = cfg.gen_tokens / (cfg.gen_max_tokens / 4).max(1) + 8;
    let prompts: Vec<Prompt> = if cfg.prompt_ids.is_empty() {
        prompt_set(n_prompts)
            .into_iter()
            .map(|(t, chat)| Prompt::Text(t, chat))
            .collect()
    } else {
        cfg.prompt_ids
            .iter()
            .cloned()
            .cycle()
            .take(n_prompts)
            .map(Prompt::Ids)
            .collect()
    };
    let bar = indicatif::ProgressBar::new(cfg.gen_tokens as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} target tokens  {per_sec}  {elapsed} elapsed, ~{eta} left",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // Every prompt is queued; the scheduler keeps `concurrency` of them
    // decoding, so the batch stays full until enough text is collected.
    let mut prompt_of = std::collections::HashMap::new();
    for (k, p) in prompts.iter().enumerate() {
        let ids = match p {
            Prompt::Text(text, true) => tok.encode(
                &tok.apply_chat_template(&[ChatMessage::user(text.clone())], true)?,
                false,
            )?,
            Prompt::Text(text, false) => tok.encode(text, true)?,
            Prompt::Ids(ids) => ids.clone(),
        };
        let ids: Vec<u32> = ids.into_iter().take(model.config.max_seq_len / 2).collect();
        // Every 1/fraction-th response is sampled, the rest greedy.
        let sampled = cfg.temperature > 0.0
            && cfg.sampled_fraction > 0.0
            && ((k as f32 * cfg.sampled_fraction).floor()
                != ((k + 1) as f32 * cfg.sampled_fraction).floor());
        let id = engine.add(
            Request {
                params: SamplingParams {
                    temperature: if sampled { cfg.temperature } else { 0.0 },
                    seed: cfg.seed.wrapping_add(k as u64),
                    ..Default::default()
                },
                ..Request::greedy(ids.clone(), cfg.gen_max_tokens)
            },
            None,
        )?;
        prompt_of.insert(id, (k, ids));
    }
    let mut done = Vec::new();
    let mut total = 0usize;
    while total < cfg.gen_tokens && !prompt_of.is_empty() && done.len() < prompts.len() {
        for c in engine.step()?.finished {
            total += c.tokens.len();
            bar.inc(c.tokens.len() as u64);
            if let Some((k, ids)) = prompt_of.remove(&c.id) {
                done.push((k, ids, c.tokens));
            }
        }
    }
    done.sort_by_key(|d| d.0);
    let data: Vec<Sample> = done
        .into_iter()
        .map(|(_, ids, response)| {
            let prompt_len = ids.len();
            let mut tokens = ids;
            tokens.extend(response);
            Sample { tokens, prompt_len }
        })
        .collect();
    bar.finish_and_clear();
    std::fs::create_dir_all(out)?;
    std::fs::write(
        &path,
        serde_json::to_string(&data).map_err(|e| json_err(&path, e))?,
    )?;
    eprintln!(
        "specd distill: {total} generated tokens from {} prompts",
        data.len()
    );
    Ok(data)
}
