//! `specd serve`: OpenAI-compatible HTTP on actix-web.
//!
//! Rooms: `requests` (serde request types and their validation into an
//! engine `Request`), `errors` (`ApiError` and the mapping of engine errors
//! to HTTP codes), `sse` (response shapes, server-sent events, the abort
//! guard), `limits` (per-client limits), `routes` (the handlers and the
//! route table).
//!
//! Invariants:
//! - Every request is validated before the engine sees it; a bad field
//!   answers 400 with an OpenAI-style error naming it, a full queue or a
//!   client over its `[server]` limits 429 with `Retry-After`, an unknown
//!   model 404; nothing accepted is lost.
//! - The sequences of one request (its prompts and choices) share one
//!   scheduling group, so fair scheduling shares slots between requests.
//! - A request whose client goes away (stream dropped, connection closed) is
//!   aborted, which frees its KV blocks at the next step.
//! - Usage in every response (and the final SSE chunk) comes from the
//!   engine's `Completion`, the same numbers the metrics count.
//! - `/health` and `/ready` ping the engine and answer 503 once it failed.
//! - The routing config (`AppState::config`) is swapped whole by a reload
//!   (`admin`), after the engine accepted the new proposer set; a request
//!   reads one snapshot of it.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};

use crate::config::Config;
use crate::model::Model;
use crate::speculative::actors::EngineHandle;
use crate::tokenizer::Tokenizer;

pub mod admin;
mod auth;
pub mod constraints;
pub mod errors;
pub mod limits;
pub mod requests;
mod routes;
mod sse;
pub mod tools;

pub use errors::ApiError;
pub use routes::{default_service, routes};

/// Shared server state.
pub struct AppState {
    pub engine: EngineHandle,
    /// The target (reloads build proposers against it).
    pub model: Arc<Model>,
    pub tokenizer: Arc<Tokenizer>,
    pub model_name: String,
    /// The running config (with command-line overrides); replaced by a
    /// reload.
    config: RwLock<Arc<Config>>,
    /// The config file as last applied (a reload compares against it).
    file_config: RwLock<Arc<Config>>,
    pub max_seq_len: usize,
    /// Accepted bearer tokens (empty: no auth).
    pub api_keys: Vec<String>,
    /// What each client has in flight (`[server]` per-client limits).
    pub clients: Arc<limits::ClientLoads>,
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    pub ready: AtomicBool,
    /// Draws traffic-split arms.
    pub split_rng: std::sync::Mutex<crate::sampler::Rng>,
    /// One reload at a time.
    reload_lock: tokio::sync::Mutex<()>,
    /// The grammar engine over this model's vocabulary, built at the
    /// first constrained request.
    grammars: std::sync::OnceLock<Result<Arc<crate::structured::Grammars>, String>>,
}

/// What `AppState::new` needs.
pub struct AppParts {
    pub engine: EngineHandle,
    pub model: Arc<Model>,
    pub tokenizer: Arc<Tokenizer>,
    pub model_name: String,
    /// What runs (command-line overrides applied).
    pub config: Config,
    /// The config file as read.
    pub file_config: Config,
    /// `SPECD_API_KEY` or `[server] api_key`, if any (`api_keys` join it).
    pub api_key: Option<String>,
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

impl AppState {
    pub fn new(p: AppParts) -> Self {
        let api_keys = p
            .api_key
            .clone()
            .into_iter()
            .chain(p.config.server.api_keys.iter().cloned())
            .collect();
        Self {
            engine: p.engine,
            // The context the engine serves (the KV budget may hold less
            // than the model's).
            max_seq_len: p.config.engine_config(&p.model).scheduler.max_seq_len,
            model: p.model,
            tokenizer: p.tokenizer,
            model_name: p.model_name,
            config: RwLock::new(Arc::new(p.config)),
            file_config: RwLock::new(Arc::new(p.file_config)),
            api_keys,
            clients: Arc::default(),
            metrics: p.metrics,
            ready: AtomicBool::new(true),
            split_rng: std::sync::Mutex::new(crate::sampler::Rng::new(0x5eed)),
            reload_lock: tokio::sync::Mutex::new(()),
            grammars: std::sync::OnceLock::new(),
        }
    }

    /// The grammar engine (built once, on first use).
    pub fn grammars(&self) -> Result<Arc<crate::structured::Grammars>, String> {
        self.grammars
            .get_or_init(|| {
                crate::structured::Grammars::new(
                    &self.tokenizer,
                    self.model.config.vocab_size,
                    &self.model.config.eos_token_ids,
                )
                .map(Arc::new)
                .map_err(|e| e.to_string())
            })
            .clone()
    }

    /// Token ids a request may use: the tokenizer's and the model's
    /// vocabulary both (a tokenizer with added tokens can be larger; an id
    /// past the model's would fail the whole forward it joins).
    pub fn vocab(&self) -> usize {
        self.tokenizer
            .vocab_size()
            .min(self.model.config.vocab_size)
    }

    /// A snapshot of the running config.
    pub fn config(&self) -> Arc<Config> {
        self.config
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Routable proposer names.
    pub fn proposers(&self) -> Vec<String> {
        self.config()
            .proposer
            .iter()
            .map(|p| p.name.clone())
            .collect()
    }
}
