//! `specd serve`: OpenAI-compatible HTTP on actix-web.
//!
//! Rooms: `requests` (serde request types and their validation into an
//! engine `Request`), `errors` (`ApiError` and the mapping of engine errors
//! to HTTP codes), `sse` (response shapes, server-sent events, the abort
//! guard), `routes` (the handlers and the route table).
//!
//! Invariants:
//! - Every request is validated before the engine sees it; a bad field
//!   answers 400 with an OpenAI-style error naming it, a full queue 429 with
//!   `Retry-After`, an unknown model 404; nothing accepted is lost.
//! - A request whose client goes away (stream dropped, connection closed) is
//!   aborted, which frees its KV blocks at the next step.
//! - Usage in every response (and the final SSE chunk) comes from the
//!   engine's `Completion`, the same numbers the metrics count.
//! - `/health` and `/ready` ping the engine and answer 503 once it failed.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::config::Config;
use crate::speculative::actors::EngineHandle;
use crate::tokenizer::Tokenizer;

pub mod errors;
pub mod requests;
mod routes;
mod sse;

pub use errors::ApiError;
pub use routes::{default_service, routes};

/// Shared server state.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub model_name: String,
    pub config: Config,
    pub max_seq_len: usize,
    pub api_key: Option<String>,
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    pub ready: AtomicBool,
    pub proposers: Vec<String>,
    /// Draws traffic-split arms.
    pub split_rng: std::sync::Mutex<crate::sampler::Rng>,
}
