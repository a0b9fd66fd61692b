//! The engine's error type. Every variant names the offending input so the
//! CLI and (later) the HTTP layer can report it without guessing.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum SpecdError {
    #[error("model file not found: {0}")]
    ModelNotFound(PathBuf),
    #[error("cannot read model {path}: {reason}")]
    BadModel { path: PathBuf, reason: String },
    #[error("{path}: unsupported model architecture '{arch}' (supported: {})", crate::SUPPORTED_ARCHITECTURES.join(", "))]
    UnsupportedArchitecture { path: PathBuf, arch: String },
    #[error("prompt plus generation needs {needed} positions but the context holds {limit}")]
    ContextOverflow { needed: usize, limit: usize },
    #[error("KV cache holds {have} positions; cannot roll back to {want}")]
    CacheRollback { have: usize, want: usize },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A request field out of range or malformed: `field` names it as the
    /// API spells it (what an HTTP error's `param` reports), `msg` says why
    /// (and starts with the field's name).
    #[error("invalid request: {msg}")]
    InvalidField { field: &'static str, msg: String },
    #[error("overloaded: {0} requests already waiting")]
    Overloaded(usize),
    #[error("engine stopped")]
    EngineStopped,
    #[error("plugin: {0}")]
    Plugin(String),
    #[error("config {file}: {msg}")]
    Config { file: String, msg: String },
    #[error("model fetch failed: {0}")]
    Fetch(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = SpecdError> = std::result::Result<T, E>;

impl SpecdError {
    /// `field` is invalid: `"{field}: {why}"`.
    pub fn invalid_field(field: &'static str, why: impl std::fmt::Display) -> Self {
        Self::InvalidField {
            field,
            msg: format!("{field}: {why}"),
        }
    }

    pub(crate) fn bad_model(path: &std::path::Path, reason: impl std::fmt::Display) -> Self {
        Self::BadModel {
            path: path.to_path_buf(),
            reason: reason.to_string(),
        }
    }
}

/// The message of a caught panic (`catch_unwind`'s payload).
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic".into()
    }
}
