//! The `specd` command line.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use std::sync::Arc;
use std::time::Instant;

use specd::config::Config;
use specd::generate::generate;
use specd::model::{self, Model};
use specd::sampler::SamplingParams;
use specd::speculative::actors::{EngineHandle, EngineParts};
use specd::speculative::drafter::Drafter;
use specd::speculative::driver::EngineConfig;
use specd::speculative::{Completion, Event, Request};
use specd::tokenizer::{ChatMessage, Tokenizer};

#[derive(Parser)]
#[command(
    name = "specd",
    version,
    about = "Speculative-decoding inference engine"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text for one prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// Measure prefill, decode and k-token verify cost of a model.
    BenchModel(BenchArgs),
    /// A/B-compare proposer strategies on Spec-Bench, HumanEval or a JSONL.
    Ab(AbArgs),
    /// Train models for speculation.
    Distill {
        #[command(subcommand)]
        what: DistillCmd,
    },
    /// Serve the OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Fetch the default model into $SPECD_HOME (default ~/.cache/specd);
    /// a cached copy whose SHA-256 matches is kept.
    FetchModel {
        /// Download again even if a verified copy is cached.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Args)]
struct ModelArgs {
    /// GGUF file or safetensors directory; default: the embedded SmolLM2-135M-Instruct.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Compute threads (default: available cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Quantize F32 matrices to Q8_0 after loading (e.g. a safetensors
    /// draft, as the draft plugin does by default).
    #[arg(long)]
    quantize: bool,
    /// KV cache element type: f16 (default) or f32.
    #[arg(long, value_parser = parse_kv_dtype)]
    kv_dtype: Option<model::KvDtype>,
}

fn parse_kv_dtype(s: &str) -> std::result::Result<model::KvDtype, String> {
    match s {
        "f16" => Ok(model::KvDtype::F16),
        "f32" => Ok(model::KvDtype::F32),
        other => Err(format!("unknown KV cache type {other:?} (use f16 or f32)")),
    }
}

impl ModelArgs {
    fn path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => Ok(specd::fetch::ensure_default_model()?),
        }
    }

    fn load(&self) -> Result<(PathBuf, Model)> {
        let path = self.path()?;
        let threads = self.threads.unwrap_or_else(model::llama::default_threads);
        let mut m = model::load_model(&path, threads)
            .with_context(|| format!("loading {}", path.display()))?;
        if self.quantize {
            m.quantize_f32_to_q8_0();
        }
        if let Some(d) = self.kv_dtype {
            m.set_kv_dtype(d);
        }
        Ok((path, m))
    }
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt (or use --prompts for a batch).
    #[arg(long, required_unless_present = "prompts", conflicts_with = "prompts")]
    prompt: Option<String>,
    /// JSONL file, one object a line with a `prompt` string; other fields are
    /// carried into the output. Runs every request through the scheduler.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Requests running at once in batch mode.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Proposer: none, or a name from the config's [[proposer]] tables
    /// (the built-in config has ngram and suffix).
    #[arg(long, default_value = "none")]
    proposer: String,
    /// TOML config (default: the built-in configs/default.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Cap on drafted tokens per step.
    #[arg(long, default_value_t = 4)]
    max_draft: usize,
    /// Write Prometheus metrics text here when done.
    #[arg(long)]
    metrics_out: Option<PathBuf>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    #[arg(long)]
    ignore_eos: bool,
}

#[derive(Args)]
struct AbArgs {
    /// TOML config with an [ab] section (see configs/ab/).
    #[arg(long)]
    config: PathBuf,
    /// Override [ab] dataset: spec_bench, humaneval or jsonl.
    #[arg(long)]
    dataset: Option<String>,
    /// Dataset file (Spec-Bench question.jsonl, HumanEval .jsonl(.gz), or a JSONL of prompts).
    #[arg(long)]
    path: Option<PathBuf>,
    #[arg(long)]
    limit_per_category: Option<usize>,
    #[arg(long)]
    max_tokens: Option<usize>,
    #[arg(long)]
    repeats: Option<usize>,
    /// Output directory for results.json, summary.md, report.html.
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Subcommand)]
enum DistillCmd {
    /// Train a small draft model for a target by self-distillation.
    Draft(DistillArgs),
}

#[derive(Args)]
struct DistillArgs {
    /// Target model (default: the embedded SmolLM2).
    #[arg(long)]
    target: Option<PathBuf>,
    /// Output directory (checkpoints, model.safetensors, config.json,
    /// tokenizer.json); training resumes from a checkpoint found there.
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 768)]
    intermediate: usize,
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long, default_value_t = 400)]
    steps: usize,
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Target-generated tokens to train on.
    #[arg(long, default_value_t = 60000)]
    gen_tokens: usize,
    #[arg(long, default_value_t = 50)]
    checkpoint_every: usize,
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Args)]
struct ServeArgs {
    /// TOML config (default: the built-in configs/default.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Validate the config (and find its plugins), print the resolved
    /// configuration, and exit.
    #[arg(long)]
    check_config: bool,
    /// Override [server] host / port (port 0: any free port).
    #[arg(long)]
    host: Option<String>,
    #[arg(long)]
    port: Option<u16>,
    /// Override [model] path.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 512)]
    prefill: usize,
    #[arg(long, default_value_t = 128)]
    decode: usize,
    #[arg(long, default_value_t = 256)]
    context: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,5,6,8")]
    ks: Vec<usize>,
    #[arg(long, default_value_t = 15)]
    reps: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::FetchModel { force } => {
            let cached = specd::fetch::default_model_path();
            let p = if !force
                && cached.exists()
                && specd::fetch::sha256_file(&cached)? == specd::fetch::SHA256
            {
                eprintln!("specd: {} is cached and verified", cached.display());
                cached
            } else {
                specd::fetch::fetch_default_model()?
            };
            println!("{}", p.display());
            Ok(())
        }
        Cmd::Generate(a) => cmd_generate(a),
        Cmd::Serve(a) => cmd_serve(a),
        Cmd::Ab(a) => cmd_ab(a),
        Cmd::Distill {
            what: DistillCmd::Draft(a),
        } => {
            let target = match a.target {
                Some(t) => t,
                None => specd::fetch::ensure_default_model()?,
            };
            let cfg = specd::distill::DistillConfig {
                layers: a.layers,
                hidden: a.hidden,
                heads: a.heads,
                intermediate: a.intermediate,
                seq_len: a.seq_len,
                batch: a.batch,
                steps: a.steps,
                lr: a.lr,
                gen_tokens: a.gen_tokens,
                checkpoint_every: a.checkpoint_every,
                ..Default::default()
            };
            let threads = a.threads.unwrap_or_else(model::llama::default_threads);
            let out = specd::distill::distill(&target, &a.out, &cfg, threads)?;
            println!("{}", out.display());
            Ok(())
        }
        Cmd::BenchModel(a) => cmd_bench(a),
    }
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
    }
}

fn encode_prompt(tok: &Tokenizer, text: &str, chat: bool) -> Result<Vec<u32>> {
    Ok(if chat {
        let t = tok.apply_chat_template(&[ChatMessage::user(text.to_string())], true)?;
        tok.encode(&t, false)?
    } else {
        tok.encode(text, true)?
    })
}

fn load_config(path: &Option<PathBuf>) -> Result<Config> {
    Ok(match path {
        Some(p) => Config::load(p)?,
        None => Config::builtin(),
    })
}

fn cmd_generate(a: GenerateArgs) -> Result<()> {
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    let (path, model) = a.model.load()?;
    let tok = Tokenizer::for_model(&path)?;
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
    let mut config = EngineConfig::for_model(&model);
    config.scheduler.max_running = a.concurrency.max(1);
    config.scheduler.max_draft = a.max_draft;
    config.scheduler.max_waiting = rows.len().max(1);
    config.kv_blocks = EngineConfig::kv_blocks_for(&model, config.scheduler.max_running, 4096);
    let cfg = load_config(&a.config)?;
    config.scheduler.adaptive_draft = cfg.engine.adaptive_draft;
    config.scheduler.draft_cost = cfg.engine.draft_cost;
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
                proposer: Some(a.proposer.clone()),
                max_draft: Some(a.max_draft),
                arm: None,
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
                            Some(Event::Tokens { text, ids }) => {
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
                            Some(Event::Error(e)) => anyhow::bail!("request failed: {e}"),
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

fn cmd_ab(a: AbArgs) -> Result<()> {
    use specd::ab;
    let cfg = Config::load(&a.config)?;
    let mut s = cfg
        .ab
        .clone()
        .with_context(|| format!("{}: no [ab] section", a.config.display()))?;
    if let Some(d) = a.dataset {
        s.dataset = d;
    }
    if let Some(p) = a.path {
        s.path = Some(p);
    } else if let Some(p) = &s.path {
        s.path = Some(cfg.resolve(p));
    }
    if let Some(n) = a.limit_per_category {
        s.limit_per_category = n;
    }
    if let Some(n) = a.max_tokens {
        s.max_tokens = n;
    }
    if let Some(n) = a.repeats {
        s.repeats = n.max(1);
    }
    if let Some(o) = a.out {
        s.out_dir = o;
    }
    let prompts = match s.dataset.as_str() {
        "spec_bench" => ab::load_spec_bench(s.path.as_deref())?,
        "humaneval" => ab::load_humaneval(s.path.as_deref())?,
        "jsonl" => ab::load_jsonl(s.path.as_deref().context("dataset `jsonl` needs a path")?)?,
        other => anyhow::bail!("unknown dataset `{other}` (spec_bench, humaneval, jsonl)"),
    };
    let prompts = ab::limit_per_category(prompts, s.limit_per_category);
    anyhow::ensure!(!prompts.is_empty(), "the dataset has no prompts");
    let chat = s.chat.unwrap_or(s.dataset != "humaneval");
    let model_path = match a.model.or(cfg.model.path.clone()) {
        Some(p) => cfg.resolve(&p),
        None => specd::fetch::ensure_default_model()?,
    };
    let threads = a
        .threads
        .or(cfg.model.threads)
        .unwrap_or_else(model::llama::default_threads);
    let mut model = model::load_model(&model_path, threads)?;
    if let Some(d) = cfg.model.kv_dtype {
        model.set_kv_dtype(d);
    }
    let model = Arc::new(model);
    let tok = Arc::new(Tokenizer::for_model(&model_path)?);
    eprintln!(
        "specd ab: {} prompts from {}, {} arm(s) + plain, {} repeat(s), max_tokens {}",
        prompts.len(),
        s.dataset,
        s.arm.iter().filter(|x| x.proposer != "none").count(),
        s.repeats,
        s.max_tokens
    );
    let report = ab::run(&cfg, &s, model, tok, &prompts, chat)?;
    let files = ab::write_outputs(&report, &s.out_dir)?;
    print!("{}", ab::markdown(&report));
    for f in files {
        eprintln!("wrote {}", f.display());
    }
    if !report.mismatches.is_empty() {
        anyhow::bail!(
            "{} losslessness failure(s): greedy output differs from plain decoding",
            report.mismatches.len()
        );
    }
    Ok(())
}

fn cmd_serve(a: ServeArgs) -> Result<()> {
    let mut cfg = load_config(&a.config)?;
    if let Some(h) = a.host {
        cfg.server.host = h;
    }
    if let Some(p) = a.port {
        cfg.server.port = p;
    }
    if let Some(m) = a.model {
        cfg.model.path = Some(m);
    }
    if let Some(t) = a.threads {
        cfg.model.threads = Some(t);
    }
    let model_path = match &cfg.model.path {
        Some(p) => {
            // Only the embedded default may be "not fetched yet": a path the
            // user named must exist.
            let path = cfg.resolve(p);
            if !path.exists() {
                return Err(specd::SpecdError::ModelNotFound(path))
                    .context("[model] path in the config");
            }
            path
        }
        None if a.check_config => specd::fetch::default_model_path(),
        None => specd::fetch::ensure_default_model()?,
    };
    if a.check_config {
        let dirs = cfg.plugin_dirs();
        for p in &cfg.proposer {
            let path = match &p.path {
                Some(path) => cfg.resolve(path),
                None => specd::plugins::find_plugin(p.plugin.as_deref().unwrap_or(&p.name), &dirs)?,
            };
            let lib = specd::plugins::load_library(&path)
                .with_context(|| format!("proposer `{}`", p.name))?;
            println!(
                "# proposer `{}`: plugin {} {} ({}) at {}",
                p.name,
                lib.name,
                lib.version,
                lib.build_id,
                path.display()
            );
        }
        println!(
            "# model: {}{}",
            model_path.display(),
            if model_path.exists() {
                ""
            } else {
                " (not fetched yet)"
            }
        );
        println!(
            "# config: {}",
            cfg.source
                .as_ref()
                .map(|s| s.display().to_string())
                .unwrap_or_else(|| "built-in default".into())
        );
        print!("{}", toml::to_string_pretty(&cfg)?);
        return Ok(());
    }
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    let threads = cfg
        .model
        .threads
        .unwrap_or_else(model::llama::default_threads);
    let mut model = model::load_model(&model_path, threads)
        .with_context(|| format!("loading {}", model_path.display()))?;
    if let Some(d) = cfg.model.kv_dtype {
        model.set_kv_dtype(d);
    }
    let model = Arc::new(model);
    let tok = Arc::new(Tokenizer::for_model(&model_path)?);
    let drafter = cfg.build_drafter(&model, Some(tok.clone()))?;
    let proposers = drafter.names();
    let mut ec = EngineConfig::for_model(&model);
    cfg.apply_engine(&mut ec.scheduler);
    ec.scheduler.max_waiting = cfg.server.max_queue;
    ec.kv_blocks = match cfg.engine.kv_blocks {
        0 => EngineConfig::kv_blocks_for(&model, ec.scheduler.max_running, 4096),
        n => n,
    };
    let model_name = cfg.model.name.clone().unwrap_or_else(|| {
        model_path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("model")
            .to_string()
    });
    let api_key = std::env::var("SPECD_API_KEY")
        .ok()
        .filter(|k| !k.is_empty())
        .or_else(|| Some(cfg.server.api_key.clone()).filter(|k| !k.is_empty()));
    let (host, port, grace, body_limit) = (
        cfg.server.host.clone(),
        cfg.server.port,
        cfg.server.shutdown_grace_secs,
        cfg.server.max_body_bytes,
    );
    let max_seq_len = model.config.max_seq_len;
    actix_web::rt::System::new().block_on(async move {
        let engine = EngineHandle::start(EngineParts {
            model,
            tokenizer: Some(tok.clone()),
            config: ec,
            drafter,
        });
        let watched = engine.clone();
        let state = actix_web::web::Data::new(specd::server::AppState {
            engine,
            tokenizer: tok,
            model_name: model_name.clone(),
            config: cfg,
            max_seq_len,
            api_key,
            metrics: Some(metrics),
            ready: std::sync::atomic::AtomicBool::new(true),
            proposers,
            split_rng: std::sync::Mutex::new(specd::sampler::Rng::new(0x5eed)),
        });
        let server = actix_web::HttpServer::new(move || {
            actix_web::App::new()
                .app_data(state.clone())
                .configure(|c| specd::server::routes(c, body_limit))
                .default_service(specd::server::default_service())
        })
        .workers(2)
        .shutdown_timeout(grace)
        .bind((host.as_str(), port))
        .with_context(|| format!("binding {host}:{port}"))?;
        for addr in server.addrs() {
            eprintln!("specd listening on http://{addr} (model {model_name})");
        }
        let running = server.run();
        let failed = watchdog(watched, running.handle());
        running.await.context("server")?;
        if let Some(why) = failed.get() {
            anyhow::bail!("the engine failed and cannot recover: {why}");
        }
        eprintln!("specd: shut down cleanly");
        Ok(())
    })
}

/// Ping the engine every second; when it has failed (or stops answering
/// three times in a row) stop the server, so the process exits non-zero
/// and its supervisor restarts it. Returns where the failure is recorded.
fn watchdog(
    engine: EngineHandle,
    server: actix_web::dev::ServerHandle,
) -> Arc<std::sync::OnceLock<String>> {
    let failed = Arc::new(std::sync::OnceLock::new());
    let out = failed.clone();
    actix_web::rt::spawn(async move {
        let mut misses = 0;
        loop {
            actix_web::rt::time::sleep(std::time::Duration::from_secs(1)).await;
            match engine.ping(std::time::Duration::from_secs(5)).await {
                Ok(_) => misses = 0,
                Err(why) => {
                    misses += 1;
                    if engine.health.failure().is_some() || misses >= 3 || why.contains("gone") {
                        eprintln!("specd: engine failed: {why}; stopping");
                        let _ = failed.set(why);
                        server.stop(false).await;
                        return;
                    }
                }
            }
        }
    });
    out
}

fn cmd_bench(a: BenchArgs) -> Result<()> {
    let (path, model) = a.model.load()?;
    let b = specd::bench::bench_model(&model, a.prefill, a.decode, a.context, &a.ks, a.reps)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&b)?);
        return Ok(());
    }
    println!(
        "model: {}  threads: {}  kernels: {}",
        path.display(),
        b.threads,
        b.kernel
    );
    println!(
        "prefill ({} tokens): {:.1} tok/s",
        b.prefill_tokens, b.prefill_tok_s
    );
    println!(
        "decode  ({} tokens): {:.1} tok/s",
        b.decode_tokens, b.decode_tok_s
    );
    println!(
        "verify cost at context {} (all-position logits):",
        b.context
    );
    println!("  {:>3}  {:>9}  {:>6}", "k", "ms", "x k=1");
    for (k, ms, r) in &b.verify {
        println!("  {k:>3}  {ms:>9.2}  {r:>6.2}");
    }
    let mb = |b: usize| b as f64 / (1024.0 * 1024.0);
    println!(
        "memory: weights {:.1} MiB, KV cache at context {} {:.1} MiB, peak RSS {}",
        mb(b.weight_bytes),
        b.context,
        mb(b.kv_bytes),
        b.peak_rss_bytes
            .map(|r| format!("{:.1} MiB", mb(r)))
            .unwrap_or_else(|| "unknown".into())
    );
    Ok(())
}
