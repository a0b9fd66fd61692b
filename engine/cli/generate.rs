//! `specd generate`: one prompt (streamed) or a JSONL batch through the
//! actor engine.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;

use specd::model::Model;
use specd::plain::generate;
use specd::sampler::SamplingParams;
use specd::speculative::actors::{EngineHandle, EngineParts};
use specd::speculative::drafter::Drafter;
use specd::speculative::{Completion, Event, Request};
use specd::structured::{Constraint, ConstraintSpec, Grammars};
use specd::tokenizer::Tokenizer;

use super::{encode_prompt, load_config, ModelArgs};

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt (or use --prompts for a batch).
    #[arg(long, required_unless_present = "prompts", conflicts_with = "prompts")]
    pub prompt: Option<String>,
    /// JSONL file, one object a line with a `prompt` string; other fields are
    /// carried into the output. Runs every request through the scheduler.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Chat template file for --chat (instead of the model's; a base
    /// model's file has none).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Requests running at once in batch mode.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Proposer: none, or a name from the config's [[proposer]] tables
    /// (the built-in config has suffix, ngram, suffix-tree and ngram-tree).
    #[arg(long, default_value = "none")]
    pub proposer: String,
    /// TOML config (default: the built-in configs/default.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Cap on drafted tokens per step.
    #[arg(long, default_value_t = 4)]
    pub max_draft: usize,
    /// Write Prometheus metrics text here when done.
    #[arg(long)]
    pub metrics_out: Option<PathBuf>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    #[arg(long)]
    pub ignore_eos: bool,
    /// Constrain the output to this JSON schema (a file).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["grammar", "regex"])]
    pub json_schema: Option<PathBuf>,
    /// Constrain the output to this Lark grammar (a file, llguidance's
    /// dialect).
    #[arg(long, value_name = "FILE", conflicts_with = "regex")]
    pub grammar: Option<PathBuf>,
    /// Constrain the output to this regular expression.
    #[arg(long)]
    pub regex: Option<String>,
    /// Do not draft the tokens a constraint forces.
    #[arg(long)]
    pub no_forced_drafts: bool,
}

fn sampling(a: &GenerateArgs) -> SamplingParams {
    SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        seed: a.seed,
        logit_bias: Vec::new(),
    }
}

/// The constraint the flags ask for, compiled for this model.
fn constraint(a: &GenerateArgs, model: &Model, tok: &Tokenizer) -> Result<Option<Constraint>> {
    let spec = if let Some(f) = &a.json_schema {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not JSON", f.display()))?;
        ConstraintSpec::JsonSchema(v)
    } else if let Some(f) = &a.grammar {
        ConstraintSpec::Lark(
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?,
        )
    } else if let Some(r) = &a.regex {
        ConstraintSpec::Regex(r.clone())
    } else {
        return Ok(None);
    };
    let field = if a.json_schema.is_some() {
        "--json-schema"
    } else if a.grammar.is_some() {
        "--grammar"
    } else {
        "--regex"
    };
    let g = Grammars::new(tok, model.config.vocab_size, &model.config.eos_token_ids)?;
    Ok(Some(g.compile(&spec, field)?))
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    let (path, model) = a.model.load()?;
    let tok = match &a.chat_template {
        Some(t) => Tokenizer::for_model(&path)?.with_chat_template(
            std::fs::read_to_string(t)
                .with_context(|| format!("--chat-template {}", t.display()))?,
        ),
        None => Tokenizer::for_model(&path)?,
    };
    let result = match &a.prompts {
        None if a.proposer == "none" => generate_plain(&a, &model, &tok),
        None => {
            let prompt = a.prompt.clone().unwrap_or_default();
            run_batch(
                &a,
                model,
                tok,
                vec![serde_json::json!({ "prompt": prompt })],
                true,
            )
        }
        Some(file) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            let mut rows = Vec::new();
            for (i, line) in text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
            {
                let v: serde_json::Value = serde_json::from_str(line)
                    .with_context(|| format!("{}:{}: not a JSON object", file.display(), i + 1))?;
                if !v.get("prompt").is_some_and(|p| p.is_string()) {
                    anyhow::bail!(
                        "{}:{}: missing string field `prompt`",
                        file.display(),
                        i + 1
                    );
                }
                rows.push(v);
            }
            run_batch(&a, model, tok, rows, false)
        }
    };
    if let Some(out) = &a.metrics_out {
        std::fs::write(out, metrics.render())
            .with_context(|| format!("writing {}", out.display()))?;
    }
    result
}

fn generate_plain(a: &GenerateArgs, model: &Model, tok: &Tokenizer) -> Result<()> {
    let prompt = encode_prompt(tok, a.prompt.as_deref().unwrap_or_default(), a.chat)?;
    let req = Request {
        params: sampling(a),
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        constraint: constraint(a, model, tok)?,
        ..Request::greedy(prompt, a.max_tokens)
    };
    let stdout = std::io::stdout();
    let out = generate(model, Some(tok), &req, |t| {
        let mut s = stdout.lock();
        let _ = s.write_all(t.as_bytes());
        let _ = s.flush();
    })?;
    println!();
    eprintln!(
        "prompt tokens: {}  generated tokens: {}  finish: {:?}  time to first token: {:.1} ms  decode: {:.1} tok/s",
        out.prompt_tokens,
        out.tokens.len(),
        out.finish,
        out.time_to_first_token.as_secs_f64() * 1e3,
        out.decode_tok_per_s()
    );
    Ok(())
}

struct Outcome {
    completion: Completion,
    ttft: f64,
    total: f64,
}

/// Run `rows` through the actor engine; `stream` prints the single
/// request's text as it arrives, else one JSON line per request at the end.
fn run_batch(
    a: &GenerateArgs,
    model: Model,
    tok: Tokenizer,
    rows: Vec<serde_json::Value>,
    stream: bool,
) -> Result<()> {
    let model = Arc::new(model);
    let tok = Arc::new(tok);
    let mut prompts = Vec::with_capacity(rows.len());
    for r in &rows {
        prompts.push(encode_prompt(
            &tok,
            r["prompt"].as_str().unwrap_or_default(),
            a.chat,
        )?);
    }
    let cfg = load_config(&a.config)?;
    // The config's [engine] settings, with this command's own limits.
    let mut config = cfg.engine_config(&model);
    config.scheduler.max_running = a.concurrency.max(1);
    config.scheduler.max_draft = a.max_draft;
    config.scheduler.max_waiting = rows.len().max(1);
    config.kv_blocks = cfg.kv_blocks(&model, config.scheduler.max_running);
    let drafter = if a.proposer == "none" {
        Drafter::new()
    } else {
        if !cfg.proposer.iter().any(|p| p.name == a.proposer) {
            let names: Vec<&str> = cfg.proposer.iter().map(|p| p.name.as_str()).collect();
            anyhow::bail!(
                "unknown proposer '{}' (available: none, {})",
                a.proposer,
                names.join(", ")
            );
        }
        cfg.build_drafter(&model, Some(tok.clone()))?
    };
    let params = sampling(a);
    let constraint = constraint(a, &model, &tok)?;
    let t_all = Instant::now();
    let outcomes: Vec<Outcome> = actix_rt::System::new().block_on(async {
        let h = EngineHandle::start(EngineParts {
            model: model.clone(),
            tokenizer: Some(tok.clone()),
            config,
            drafter,
        });
        let mut rxs = Vec::new();
        for p in prompts {
            let req = Request {
                prompt: p,
                params: params.clone(),
                max_tokens: a.max_tokens,
                stop: a.stop.clone(),
                ignore_eos: a.ignore_eos,
                stop_token_ids: Vec::new(),
                min_tokens: 0,
                proposer: Some(a.proposer.clone()),
                max_draft: Some(a.max_draft),
                arm: None,
                logprobs: None,
                fork_of: None,
                prompt_logprobs: None,
                priority: 0,
                group: None,
                constraint: constraint.clone(),
                forced_drafts: !a.no_forced_drafts,
            };
            rxs.push((Instant::now(), h.submit(req).await?.1));
        }
        // Each request's timeline is read by its own task, so its first
        // token and its end are stamped when they happen, whatever the
        // other requests are doing.
        let tasks: Vec<_> = rxs
            .into_iter()
            .map(|(start, mut rx)| {
                actix_rt::spawn(async move {
                    let mut ttft = None;
                    loop {
                        match rx.recv().await {
                            Some(Event::Tokens { text, ids, .. }) => {
                                if !ids.is_empty() {
                                    ttft.get_or_insert_with(|| start.elapsed().as_secs_f64());
                                }
                                if stream {
                                    let mut s = std::io::stdout().lock();
                                    let _ = s.write_all(text.as_bytes());
                                    let _ = s.flush();
                                }
                            }
                            Some(Event::Finished(c)) => {
                                let total = start.elapsed().as_secs_f64();
                                return Ok::<Outcome, anyhow::Error>(Outcome {
                                    completion: c,
                                    ttft: ttft.unwrap_or(total),
                                    total,
                                });
                            }
                            Some(Event::Error(e) | Event::Rejected(e)) => {
                                anyhow::bail!("request failed: {e}")
                            }
                            None => anyhow::bail!("engine stopped"),
                        }
                    }
                })
            })
            .collect();
        let mut outcomes = Vec::with_capacity(tasks.len());
        for t in tasks {
            outcomes.push(t.await.context("a request's reader task failed")??);
        }
        Ok::<Vec<Outcome>, anyhow::Error>(outcomes)
    })?;
    let wall = t_all.elapsed().as_secs_f64();
    if stream {
        println!();
    }
    let mut total_tokens = 0usize;
    let mut agg = specd::speculative::SpecStats::default();
    for (row, o) in rows.iter().zip(&outcomes) {
        let c = &o.completion;
        total_tokens += c.tokens.len();
        agg.verify_steps += c.stats.verify_steps;
        agg.drafted += c.stats.drafted;
        agg.accepted += c.stats.accepted;
        if !stream {
            let mut out = row.clone();
            if let Some(obj) = out.as_object_mut() {
                obj.remove("prompt");
                obj.insert("text".into(), c.text.clone().into());
                obj.insert("prompt_tokens".into(), c.prompt_tokens.into());
                obj.insert("completion_tokens".into(), c.tokens.len().into());
                obj.insert("token_ids".into(), c.tokens.clone().into());
                obj.insert("finish_reason".into(), serde_json::to_value(c.finish)?);
            }
            println!("{out}");
        }
        let decode = (o.total - o.ttft).max(1e-9);
        eprintln!(
            "request {}: prompt tokens {}  generated {}  ttft {:.1} ms  {:.1} tok/s  acceptance {:.2}  mean accepted length {:.2}",
            c.id,
            c.prompt_tokens,
            c.tokens.len(),
            o.ttft * 1e3,
            c.tokens.len().saturating_sub(1) as f64 / decode,
            c.stats.acceptance_rate(),
            c.stats.mean_accepted_len()
        );
    }
    eprintln!(
        "total: {} requests  {} generated tokens  {:.2} s  {:.1} tok/s  proposer {}  acceptance {:.2}  mean accepted length {:.2}",
        outcomes.len(),
        total_tokens,
        wall,
        total_tokens as f64 / wall,
        a.proposer,
        agg.acceptance_rate(),
        agg.mean_accepted_len()
    );
    Ok(())
}
