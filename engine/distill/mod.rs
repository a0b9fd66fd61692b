//! `specd distill`: train proposers for a target by self-distillation on
//! CPU, from the target's own responses to training prompts.
//!
//! - this file: the shared data pipeline. The target answers training
//!   prompts that are disjoint from every evaluation set the project ships
//!   (`prompts`: generated instructions and code stubs, none sharing an
//!   8-gram of words with Spec-Bench or HumanEval), in batches through the
//!   engine; the samples (prompt + response tokens) are cached in
//!   `<out>/samples.json` so a rerun or a resume does not regenerate them.
//!   Two prompt mixes (`PromptMix`): `templated` (the shipped heads' data)
//!   and `varied`, which adds role-play, arithmetic and reasoning prompts
//!   to 70% of the token budget, then spends the rest on tasks over
//!   passages the target wrote in that first stage (summaries, extraction,
//!   translation, questions over one or two documents), each prompt again
//!   checked against the evaluation sets.
//! - `draft`: a small standalone Llama draft (`specd distill draft`).
//! - `eagle`: an EAGLE-3 head over the target's features
//!   (`specd distill eagle`).
//!
//! Invariant: no evaluation prompt (or a text sharing an 8-gram of words
//! with one, or quoting a shorter one whole) is ever trained on: prompts
//! are checked before they are asked, the target's responses as they
//! finish and again when a cache is reused (a sample whose response
//! overlaps is dropped and does not count toward the token budget).

pub mod corpus;
pub mod coverage;
pub mod dflash;
pub mod diagnose;
pub mod draft;
pub mod eagle;
mod fused;
pub mod medusa;
pub mod prompts;
pub(crate) mod train;

use std::path::Path;
use std::sync::Arc;

pub use draft::{distill, DistillConfig, State};

use crate::distill::prompts::PromptMix;
use crate::error::{Result, SpecdError};
use crate::model::Model;
use crate::sampler::SamplingParams;
use crate::speculative::drafter::Drafter;
use crate::speculative::driver::{EngineConfig, SyncDriver};
use crate::speculative::Request;
use crate::tokenizer::{ChatMessage, Tokenizer};

/// Indices of `n` samples split into (training, validation): every sample
/// whose seeded hash falls under `val_fraction` is held out. Every trainer
/// and `diagnose` split this way, so "validation" is the same texts.
pub(crate) fn split(n: usize, seed: u64, val_fraction: f64) -> (Vec<usize>, Vec<usize>) {
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for i in 0..n {
        let mut r = crate::sampler::Rng::new(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        if r.next_f64() < val_fraction {
            val.push(i);
        } else {
            train.push(i);
        }
    }
    (train, val)
}

fn json_err(path: &Path, e: impl std::fmt::Display) -> SpecdError {
    SpecdError::InvalidRequest(format!("{}: {e}", path.display()))
}

/// Builds prompts with `make` against the evaluation sets' 8-gram index,
/// logs how many there are (`what`) and how many were dropped, and returns
/// (text, chat) pairs.
fn checked_set(
    what: &str,
    make: impl FnOnce(
        &crate::distill::prompts::NgramIndex,
    ) -> (Vec<crate::distill::prompts::TrainingPrompt>, usize),
) -> Vec<(String, bool)> {
    let eval = crate::datasets::evaluation_texts();
    let index = crate::distill::prompts::NgramIndex::new(eval.iter().map(String::as_str));
    let (prompts, dropped) = make(&index);
    eprintln!(
        "specd distill: {} {what}; {dropped} dropped for sharing an 8-gram with Spec-Bench or HumanEval",
        prompts.len()
    );
    prompts.into_iter().map(|p| (p.text, p.chat)).collect()
}

/// Prompts to generate training text from: generated instructions and
/// code stubs that share no 8-gram of words with any evaluation set the
/// project ships (see `prompts`). Returns (text, chat) pairs.
pub fn prompt_set(limit: usize) -> Vec<(String, bool)> {
    checked_set(
        "training prompts (generated instructions and code stubs)",
        |index| crate::distill::prompts::training_prompts(limit.max(1), 7, index),
    )
}

/// The first stage of the `varied` mix (`prompts::varied_prompts`).
pub fn varied_prompt_set(limit: usize) -> Vec<(String, bool)> {
    checked_set(
        "training prompts (instructions, code stubs, role-play, arithmetic, reasoning)",
        |index| crate::distill::prompts::varied_prompts(limit.max(1), 7, index),
    )
}

/// The second stage of the `varied` mix: tasks over `passages` the target
/// wrote (`prompts::passage_prompts`, about 110 words each).
pub fn passage_prompt_set(passages: &[String], limit: usize, seed: u64) -> Vec<(String, bool)> {
    checked_set("tasks over passages the target wrote", |index| {
        crate::distill::prompts::passage_prompts(passages, limit.max(1), 110, seed ^ 0xBA55, index)
    })
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
    /// Which text prompts (ignored with `prompt_ids`).
    pub mix: PromptMix,
    /// Train on this `specd distill corpus` directory instead of
    /// generating text: its samples in order, up to `gen_tokens` response
    /// tokens (all of them with 0).
    pub corpus: Option<std::path::PathBuf>,
    /// Only these shards of `corpus` (all of them with None): a run that
    /// continues a shipped head on shards it has not seen.
    pub corpus_shards: Option<std::ops::Range<usize>>,
}

/// One training sample: a prompt and the target's response.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    pub tokens: Vec<u32>,
    /// Tokens of `tokens` that are prompt (the rest is the response).
    pub prompt_len: usize,
}

#[derive(Debug, Clone)]
pub(crate) enum Prompt {
    /// Text, and whether to apply the chat template.
    Text(String, bool),
    Ids(Vec<u32>),
    /// A conversation, through the chat template.
    Chat(Vec<ChatMessage>),
}

/// One prompt to answer, and how.
#[derive(Debug, Clone)]
pub(crate) struct Job {
    pub prompt: Prompt,
    /// 0: greedy.
    pub temperature: f32,
    pub seed: u64,
}

/// Generate (or load from `<out>/samples.json`) the target's responses.
pub fn training_data(
    model: &Arc<Model>,
    tok: &Arc<Tokenizer>,
    cfg: &DataConfig,
    out: &Path,
) -> Result<Vec<Sample>> {
    training_data_excluding(model, tok, cfg, out, &[])
}

/// What a cache of samples was generated with: reused only for the same.
fn data_meta(model: &Model, cfg: &DataConfig) -> serde_json::Value {
    let c = &model.config;
    serde_json::json!({
        "mix": format!("{:?}", cfg.mix),
        "seed": cfg.seed,
        "gen_max_tokens": cfg.gen_max_tokens,
        "temperature": cfg.temperature,
        "sampled_fraction": cfg.sampled_fraction,
        "prompt_ids": cfg.prompt_ids,
        "target": [c.vocab_size, c.hidden, c.layers],
    })
}

/// `training_data`, also keeping out of training any response that
/// overlaps one of `exclude` (texts beyond the shipped evaluation sets,
/// e.g. a private benchmark).
pub fn training_data_excluding(
    model: &Arc<Model>,
    tok: &Arc<Tokenizer>,
    cfg: &DataConfig,
    out: &Path,
    exclude: &[String],
) -> Result<Vec<Sample>> {
    let eval = crate::datasets::evaluation_texts();
    let index =
        crate::distill::prompts::NgramIndex::new(eval.iter().chain(exclude).map(String::as_str));
    let overlaps = |s: &Sample| -> Result<bool> {
        let response = tok.decode(s.tokens.get(s.prompt_len..).unwrap_or(&[]), true)?;
        Ok(index.shared_content(&response).is_some())
    };
    if let Some(dir) = &cfg.corpus {
        let (man, all) = corpus::load_shards(dir, tok, cfg.corpus_shards.clone())?;
        let mut kept = Vec::new();
        let (mut n, mut dropped) = (0usize, 0usize);
        for c in all {
            if cfg.gen_tokens > 0 && n >= cfg.gen_tokens {
                break;
            }
            let s = c.sample;
            if s.prompt_len >= s.tokens.len() || overlaps(&s)? {
                dropped += 1;
                continue;
            }
            n += s.tokens.len() - s.prompt_len;
            kept.push(s);
        }
        let shards = match &cfg.corpus_shards {
            Some(r) => format!("shards {}..{} of {}", r.start, r.end, man.shards.len()),
            None => format!("{} shards", man.shards.len()),
        };
        eprintln!(
            "specd distill: {n} response tokens of {} samples from the corpus in {} ({shards}, {} tokens in all; {dropped} dropped)",
            kept.len(),
            dir.display(),
            man.response_tokens()
        );
        if n < cfg.gen_tokens {
            eprintln!(
                "specd distill: the corpus holds fewer than the {} tokens asked for: training on all of it",
                cfg.gen_tokens
            );
        }
        return Ok(kept);
    }
    let path = out.join("samples.json");
    let meta_path = out.join("samples.meta.json");
    let meta = data_meta(model, cfg);
    if let Ok(text) = std::fs::read_to_string(&path) {
        let same = std::fs::read_to_string(&meta_path)
            .ok()
            .and_then(|m| serde_json::from_str::<serde_json::Value>(&m).ok())
            .is_some_and(|m| m == meta);
        if same {
            let d: Vec<Sample> = serde_json::from_str(&text).map_err(|e| json_err(&path, e))?;
            let mut kept = Vec::with_capacity(d.len());
            for s in d {
                if s.prompt_len < s.tokens.len() && !overlaps(&s)? {
                    kept.push(s);
                }
            }
            let n: usize = kept.iter().map(|s| s.tokens.len() - s.prompt_len).sum();
            if n >= cfg.gen_tokens {
                eprintln!(
                    "specd distill: reusing {n} response tokens of {} samples from {}",
                    kept.len(),
                    path.display()
                );
                return Ok(kept);
            }
        } else {
            eprintln!(
                "specd distill: {} was generated with other settings (or by an older version): generating anew",
                path.display()
            );
        }
    }
    let mut ec = EngineConfig::for_model(model);
    ec.scheduler.max_running = cfg.concurrency.max(1);
    ec.scheduler.max_waiting = usize::MAX;
    let mut engine = SyncDriver::new(model.clone(), Some(tok.clone()), ec, Drafter::new());
    let max_prompt = model.config.max_seq_len / 2;
    let n_prompts = |tokens: usize| tokens / (cfg.gen_max_tokens / 4).max(1) + 8;
    let bar = indicatif::ProgressBar::new(cfg.gen_tokens as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} target tokens  {per_sec}  {elapsed} elapsed, ~{eta} left",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut gen = Generator {
        engine: &mut engine,
        max_prompt,
        tok,
        cfg,
        bar: &bar,
        evaluation: &index,
        dropped: 0,
    };
    let text = |v: Vec<(String, bool)>| -> Vec<Prompt> {
        v.into_iter()
            .map(|(t, chat)| Prompt::Text(t, chat))
            .collect()
    };
    // One stage (token ids, or the templated mix), or the varied mix's two.
    let single: Option<Vec<Prompt>> = if !cfg.prompt_ids.is_empty() {
        Some(
            cfg.prompt_ids
                .iter()
                .cloned()
                .cycle()
                .take(n_prompts(cfg.gen_tokens))
                .map(Prompt::Ids)
                .collect(),
        )
    } else if cfg.mix == PromptMix::Templated {
        Some(text(prompt_set(n_prompts(cfg.gen_tokens))))
    } else {
        None
    };
    let data: Vec<Sample> = if let Some(prompts) = single {
        gen.run(&prompts, cfg.gen_tokens, 0)?
            .into_iter()
            .map(|(_, s)| s)
            .collect()
    } else {
        // Stage 1: instructions, code, role-play, arithmetic, reasoning.
        let first = cfg.gen_tokens * 7 / 10;
        let prompts = text(varied_prompt_set(n_prompts(first)));
        let done = gen.run(&prompts, first, 0)?;
        // Stage 2: tasks over what the target wrote to instructions.
        let passages: Vec<String> = done
            .iter()
            .filter(|(k, _)| matches!(prompts[*k], Prompt::Text(_, true)))
            .map(|(_, s)| tok.decode(&s.tokens[s.prompt_len..], true))
            .collect::<Result<_>>()?;
        let got: usize = done
            .iter()
            .map(|(_, s)| s.tokens.len() - s.prompt_len)
            .sum();
        let rest = cfg.gen_tokens.saturating_sub(got);
        let second = text(passage_prompt_set(&passages, n_prompts(rest), cfg.seed));
        let more = gen.run(&second, rest, prompts.len())?;
        done.into_iter().chain(more).map(|(_, s)| s).collect()
    };
    bar.finish_and_clear();
    eprintln!(
        "specd distill: {} responses dropped for sharing an 8-gram with Spec-Bench, HumanEval or an excluded text",
        gen.dropped
    );
    std::fs::create_dir_all(out)?;
    std::fs::write(
        &path,
        serde_json::to_string(&data).map_err(|e| json_err(&path, e))?,
    )?;
    std::fs::write(&meta_path, meta.to_string())?;
    let total: usize = data.iter().map(|s| s.tokens.len() - s.prompt_len).sum();
    eprintln!(
        "specd distill: {total} generated tokens from {} prompts",
        data.len()
    );
    Ok(data)
}

/// Generates training samples through an engine (`run`, once per stage).
pub(crate) struct Generator<'a> {
    pub engine: &'a mut SyncDriver,
    /// Prompts are cut to this many tokens.
    pub max_prompt: usize,
    pub tok: &'a Tokenizer,
    pub cfg: &'a DataConfig,
    pub bar: &'a indicatif::ProgressBar,
    /// Responses sharing an n-gram with these texts are not kept.
    pub evaluation: &'a crate::distill::prompts::NgramIndex,
    /// Responses dropped for that.
    pub dropped: usize,
}

impl Generator<'_> {
    /// Decodes `prompts` through the engine until `budget` response tokens are
    /// collected; returns each finished prompt's index and sample, in prompt
    /// order. Prompt `k` is seeded `seed + offset + k`, and every
    /// 1/`sampled_fraction`-th one (counting from `offset`) is sampled.
    fn run(
        &mut self,
        prompts: &[Prompt],
        budget: usize,
        offset: usize,
    ) -> Result<Vec<(usize, Sample)>> {
        let cfg = self.cfg;
        let jobs: Vec<Job> = prompts
            .iter()
            .enumerate()
            .map(|(k, p)| {
                // Every 1/fraction-th response is sampled, the rest greedy.
                let j = k + offset;
                let sampled = cfg.temperature > 0.0
                    && cfg.sampled_fraction > 0.0
                    && ((j as f32 * cfg.sampled_fraction).floor()
                        != ((j + 1) as f32 * cfg.sampled_fraction).floor());
                Job {
                    prompt: p.clone(),
                    temperature: if sampled { cfg.temperature } else { 0.0 },
                    seed: cfg.seed.wrapping_add(j as u64),
                }
            })
            .collect();
        self.run_jobs(&jobs, budget)
    }

    /// Decodes `jobs` through the engine until `budget` response tokens
    /// are collected; returns each finished job's index and sample, in job
    /// order.
    pub(crate) fn run_jobs(&mut self, jobs: &[Job], budget: usize) -> Result<Vec<(usize, Sample)>> {
        let (tok, cfg, max_prompt) = (self.tok, self.cfg, self.max_prompt);
        // Every prompt is queued; the scheduler keeps `concurrency` of them
        // decoding, so the batch stays full until enough text is collected.
        let mut prompt_of = std::collections::HashMap::new();
        for (k, job) in jobs.iter().enumerate() {
            let ids = match &job.prompt {
                Prompt::Text(text, true) => tok.encode(
                    &tok.apply_chat_template(&[ChatMessage::user(text.clone())], true)?,
                    false,
                )?,
                Prompt::Text(text, false) => tok.encode(text, true)?,
                Prompt::Ids(ids) => ids.clone(),
                Prompt::Chat(messages) => {
                    tok.encode(&tok.apply_chat_template(messages, true)?, false)?
                }
            };
            let ids: Vec<u32> = ids.into_iter().take(max_prompt).collect();
            let id = self.engine.add(
                Request {
                    params: SamplingParams {
                        temperature: job.temperature,
                        seed: job.seed,
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
        while total < budget && !prompt_of.is_empty() && done.len() < jobs.len() {
            for c in self.engine.step()?.finished {
                // (Requests an earlier call aborted finish here too.)
                if let Some((k, ids)) = prompt_of.remove(&c.id) {
                    // An empty response teaches nothing, and a reloaded
                    // cache drops it: keep the samples (and so the
                    // validation split) of a fresh run and a resumed one
                    // the same.
                    if c.tokens.is_empty() {
                        continue;
                    }
                    // A response that overlaps an evaluation text is not
                    // trained on, and does not count toward the budget.
                    if self
                        .evaluation
                        .shared_content(&tok.decode(&c.tokens, true)?)
                        .is_some()
                    {
                        self.dropped += 1;
                        continue;
                    }
                    total += c.tokens.len();
                    self.bar.inc(c.tokens.len() as u64);
                    done.push((k, ids, c.tokens));
                }
            }
        }
        // What is still queued or running is dropped with its requests.
        for id in prompt_of.into_keys() {
            self.engine.abort(id);
        }
        done.sort_by_key(|d| d.0);
        Ok(done
            .into_iter()
            .map(|(k, ids, response)| {
                let prompt_len = ids.len();
                let mut tokens = ids;
                tokens.extend(response);
                (k, Sample { tokens, prompt_len })
            })
            .collect())
    }
}
