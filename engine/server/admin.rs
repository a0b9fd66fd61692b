//! `/v1/admin/*`: the proposer listing and hot reload (also on SIGHUP).
//!
//! Invariants:
//! - Admin endpoints answer 404 when `[server] admin = false`, and need the
//!   API key when one is set.
//! - A reload validates the whole new config and builds every new proposer
//!   before anything changes; any failure changes nothing and says why.
//!   Then the engine swaps between steps (see `actors::Reload`) and only
//!   after it accepted does the server route by the new config.
//! - Libraries are never unloaded: a proposer whose library path changed
//!   loads the new file beside the old one.

use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::json;

use super::auth::check_auth;
use super::errors::ApiError;
use super::AppState;
use crate::config::Config;
use crate::speculative::drafter::ProposerSet;

/// What a successful reload did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadReport {
    pub generation: u64,
    pub added: Vec<String>,
    pub replaced: Vec<String>,
    pub removed: Vec<String>,
    pub unchanged: Vec<String>,
    /// Running sequences that keep a replaced proposer until they end.
    pub retired_sequences: usize,
    /// Running sequences whose proposer was removed (decoding plainly).
    pub orphaned_sequences: usize,
    /// Sections the file changed that a reload does not apply (restart).
    pub not_applied: Vec<String>,
}

/// Why a reload changed nothing.
#[derive(Debug, Clone)]
pub struct ReloadError {
    /// 400: the config is invalid or a proposer cannot be built; 409: there
    /// is no config file to read again; 503: the engine is gone.
    pub status: StatusCode,
    pub message: String,
}

impl ReloadError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

/// Re-read the config file and swap the proposers (see the module docs).
pub async fn reload(st: &AppState) -> Result<ReloadReport, ReloadError> {
    let _one = st.reload_lock.lock().await;
    let current = st.config();
    let Some(path) = current.source.clone() else {
        return Err(ReloadError::new(
            StatusCode::CONFLICT,
            "the daemon was started without --config: there is no config file to read again",
        ));
    };
    let bad =
        |e: crate::error::SpecdError| ReloadError::new(StatusCode::BAD_REQUEST, e.to_string());
    let new = Config::load(&path).map_err(bad)?;
    let file_before = st
        .file_config
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let mut plan = current.plan_reload(&file_before, &new).map_err(bad)?;
    // A poisoned instance (a plugin that failed) is rebuilt even when its
    // config is unchanged: a reload is how an operator recovers it. So is
    // one whose library file was rebuilt in place since it was loaded.
    if let Some(listing) = st.engine.proposers().await {
        let poisoned: Vec<String> = listing
            .iter()
            .filter(|l| l.role == "live" && (l.poisoned.is_some() || l.info.library_rebuilt))
            .map(|l| l.name.clone())
            .collect();
        plan.keep.retain(|n| {
            let rebuild = poisoned.contains(n);
            if rebuild {
                plan.replaced.push(n.clone());
            }
            !rebuild
        });
    }
    // Build every new instance off the reactor (plugins may load models or
    // start plugin-host children); one failure drops them all.
    let (model, tok) = (st.model.clone(), st.tokenizer.clone());
    let to_build: Vec<String> = plan.added.iter().chain(&plan.replaced).cloned().collect();
    let merged = plan.merged.clone();
    let built = web::block(move || {
        to_build
            .iter()
            .map(|n| {
                let p = merged
                    .proposer
                    .iter()
                    .find(|p| &p.name == n)
                    .ok_or_else(|| format!("proposer `{n}` vanished from the plan"))?;
                merged
                    .build_proposer(p, &model, Some(tok.clone()))
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, String>>()
    })
    .await
    .map_err(|e| ReloadError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
    .map_err(|e| ReloadError::new(StatusCode::BAD_REQUEST, format!("{}: {e}", path.display())))?;
    let names: Vec<String> = plan
        .merged
        .proposer
        .iter()
        .map(|p| p.name.clone())
        .collect();
    let set = ProposerSet {
        proposers: built,
        keep: plan.keep.clone(),
    };
    let out = st
        .engine
        .reload(set, names)
        .await
        .map_err(|e| ReloadError::new(StatusCode::SERVICE_UNAVAILABLE, e))?;
    *st.config.write().unwrap_or_else(|e| e.into_inner()) = std::sync::Arc::new(plan.merged);
    *st.file_config.write().unwrap_or_else(|e| e.into_inner()) = std::sync::Arc::new(new);
    metrics::counter!("specd_proposer_reloads_total").increment(1);
    Ok(ReloadReport {
        generation: out.generation,
        added: plan.added,
        replaced: plan.replaced,
        removed: plan.removed,
        unchanged: plan.keep,
        retired_sequences: out.retired_sequences,
        orphaned_sequences: out.orphaned_sequences,
        not_applied: plan.not_applied,
    })
}

fn admin_enabled(st: &AppState) -> Result<(), ApiError> {
    if st.config().server.admin {
        Ok(())
    } else {
        Err(ApiError::status(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "admin endpoints are disabled ([server] admin = false)",
        ))
    }
}

/// `POST /v1/admin/proposers/reload`.
pub(super) async fn reload_proposers(
    req: HttpRequest,
    st: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    admin_enabled(&st)?;
    check_auth(&req, &st)?;
    match reload(&st).await {
        Ok(r) => {
            tracing::warn!(
                generation = r.generation,
                added = ?r.added,
                replaced = ?r.replaced,
                removed = ?r.removed,
                "proposers reloaded"
            );
            Ok(HttpResponse::Ok().json(r))
        }
        Err(e) => {
            tracing::warn!("proposer reload refused: {}", e.message);
            Err(ApiError {
                code: Some("reload_refused"),
                ..ApiError::status(e.status, "invalid_request_error", e.message)
            })
        }
    }
}

/// `GET /v1/admin/proposers`.
pub(super) async fn list_proposers(
    req: HttpRequest,
    st: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    admin_enabled(&st)?;
    check_auth(&req, &st)?;
    let list = st
        .engine
        .proposers()
        .await
        .ok_or_else(|| ApiError::from(crate::error::SpecdError::EngineStopped))?;
    Ok(HttpResponse::Ok().json(json!({ "object": "list", "data": list })))
}
