//! `specd serve`: the OpenAI-compatible daemon, and its watchdog.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;

use specd::speculative::actors::{EngineHandle, EngineParts};

use super::load_config;

#[derive(Args)]
pub struct ServeArgs {
    /// TOML config (default: the built-in configs/default.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Validate the config (and find its plugins), print the resolved
    /// configuration, and exit.
    #[arg(long)]
    pub check_config: bool,
    /// Override [server] host / port (port 0: any free port).
    #[arg(long)]
    pub host: Option<String>,
    #[arg(long)]
    pub port: Option<u16>,
    /// Override [model] path (a file, a directory or a catalogued name such
    /// as gemma3-270m); the served model name follows it.
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long)]
    pub threads: Option<usize>,
}

pub fn run(a: ServeArgs) -> Result<()> {
    let mut cfg = load_config(&a.config)?;
    let file_cfg = cfg.clone();
    if let Some(h) = a.host {
        cfg.server.host = h;
    }
    if let Some(p) = a.port {
        cfg.server.port = p;
    }
    if let Some(m) = a.model {
        // The served name follows the model given here, not the config's.
        cfg.model.name = None;
        cfg.model.path = Some(specd::fetch::cli_model_path(&m)?);
    }
    if let Some(t) = a.threads {
        cfg.model.threads = Some(t);
    }
    if a.check_config {
        for p in &cfg.proposer {
            if !p.compose.is_empty() {
                // Its members are checked in their own turn.
                println!(
                    "# proposer `{}`: composes {}",
                    p.name,
                    p.compose.join(" + ")
                );
                continue;
            }
            let path = cfg.library_path(p)?;
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
        // Only catalogued models (the embedded default, or one named in
        // `[model] path`) may be "not fetched yet": a path the user named
        // must exist. Checking a config never downloads.
        let catalogued = cfg
            .model
            .path
            .as_ref()
            .filter(|p| !cfg.resolve(p).exists())
            .and_then(|p| p.to_str())
            .and_then(specd::fetch::by_name);
        let model_path = match (&cfg.model.path, catalogued) {
            (_, Some(c)) => c.path(),
            (Some(_), None) => cfg.model_path().context("[model] path")?,
            (None, None) => specd::fetch::default_model_path(),
        };
        println!(
            "# model: {}{}",
            model_path.display(),
            if model_path.exists() {
                ""
            } else {
                " (not fetched yet)"
            }
        );
        if model_path.exists() {
            let tok = cfg.tokenizer(&model_path)?;
            check_chat_template(&cfg, &tok, &model_path)?;
        }
        println!("# config: {}", describe(&cfg));
        // The config as it will run, but not its secret.
        let mut shown = cfg.clone();
        if !shown.server.api_key.is_empty() {
            shown.server.api_key = "<redacted>".into();
        }
        print!("{}", toml::to_string_pretty(&shown)?);
        return Ok(());
    }
    // Latencies users set objectives on are real histograms (bucketed,
    // aggregatable across servers); the rest stay summaries.
    const LATENCY_BUCKETS: [f64; 14] = [
        0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    ];
    use metrics_exporter_prometheus::Matcher;
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("specd_queue_wait_seconds".into()),
            &LATENCY_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full("specd_time_to_first_token_seconds".into()),
            &LATENCY_BUCKETS,
        )?
        .install_recorder()
        .context("installing the metrics recorder")?;
    let (model_path, model) = cfg
        .load_target()
        .with_context(|| format!("loading the model of {}", describe(&cfg)))?;
    let model = Arc::new(model);
    let tok = Arc::new(cfg.tokenizer(&model_path)?);
    check_chat_template(&cfg, &tok, &model_path)?;
    let drafter = cfg.build_drafter(&model, Some(tok.clone()))?;
    let ec = cfg.engine_config(&model);
    // Default name: the catalogued name the config gives, else the stem.
    let catalogued = cfg
        .model
        .path
        .as_ref()
        .and_then(|p| p.to_str())
        .and_then(specd::fetch::by_name)
        .map(|c| c.name.to_string());
    let model_name = cfg.model.name.clone().or(catalogued).unwrap_or_else(|| {
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
    actix_web::rt::System::new().block_on(async move {
        let engine = EngineHandle::start(EngineParts {
            model: model.clone(),
            tokenizer: Some(tok.clone()),
            config: ec,
            drafter,
        });
        let watched = engine.clone();
        let state =
            actix_web::web::Data::new(specd::server::AppState::new(specd::server::AppParts {
                engine,
                model,
                tokenizer: tok,
                model_name: model_name.clone(),
                config: cfg,
                file_config: file_cfg,
                api_key,
                metrics: Some(metrics),
            }));
        reload_on_sighup(state.clone());
        let server = actix_web::HttpServer::new(move || {
            actix_web::App::new()
                .app_data(state.clone())
                .configure(|c| specd::server::routes(c, body_limit))
                .default_service(specd::server::default_service())
        })
        .workers(2)
        // A client that closes its connection is gone: its handler is
        // dropped (and its request aborted) at once, not after the answer
        // it will never read has been computed.
        .h1_allow_half_closed(false)
        .shutdown_timeout(grace)
        .bind((host.as_str(), port))
        .with_context(|| format!("binding {host}:{port}"))?;
        for addr in server.addrs() {
            eprintln!("specd listening on http://{addr} (model {model_name})");
        }
        let running = server.run();
        let failed = watchdog(watched, running.handle());
        let served = running.await.context("server");
        specd::plugins::process::remove_socket_dir();
        served?;
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

/// SIGHUP: re-read the config file's proposers and routing, as
/// `POST /v1/admin/proposers/reload` does; the outcome goes to the log.
fn reload_on_sighup(state: actix_web::web::Data<specd::server::AppState>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        eprintln!("specd: cannot listen for SIGHUP; reload with POST /v1/admin/proposers/reload");
        return;
    };
    actix_web::rt::spawn(async move {
        while hup.recv().await.is_some() {
            match specd::server::admin::reload(&state).await {
                Ok(r) => eprintln!(
                    "specd: SIGHUP: proposers reloaded (generation {}; added {:?}, replaced {:?}, removed {:?}; {} sequences finish on replaced instances){}",
                    r.generation,
                    r.added,
                    r.replaced,
                    r.removed,
                    r.retired_sequences,
                    if r.not_applied.is_empty() {
                        String::new()
                    } else {
                        format!("; not applied (restart): {}", r.not_applied.join(", "))
                    }
                ),
                Err(e) => eprintln!("specd: SIGHUP: reload refused, nothing changed: {}", e.message),
            }
        }
    });
}

/// Where a config came from, for messages.
fn describe(cfg: &specd::config::Config) -> String {
    cfg.source
        .as_ref()
        .map(|s| s.display().to_string())
        .unwrap_or_else(|| "the built-in default config".into())
}

/// The chat template compiles and renders a user turn (a server whose
/// every chat request would fail does not start), naming where it came
/// from.
fn check_chat_template(
    cfg: &specd::config::Config,
    tok: &specd::tokenizer::Tokenizer,
    model_path: &std::path::Path,
) -> anyhow::Result<()> {
    tok.check_chat_template()
        .with_context(|| match &cfg.model.chat_template {
            Some(t) => format!("`[model] chat_template` ({t}) of {}", describe(cfg)),
            None => format!("the chat template of {}", model_path.display()),
        })
}
