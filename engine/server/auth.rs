//! Bearer-token authentication: the `/v1/` API and admin routes call
//! `check_auth` first (`/health`, `/ready` and `/metrics` stay open). *Invariant:* with no key configured every request
//! passes; with keys, only `Authorization: Bearer <one of them>` does, and
//! a refusal is a 401 `invalid_api_key` naming no key.

use actix_web::http::StatusCode;
use actix_web::HttpRequest;

use super::errors::ApiError;
use super::AppState;

pub(super) fn check_auth(req: &HttpRequest, st: &AppState) -> Result<(), ApiError> {
    if st.api_keys.is_empty() {
        return Ok(());
    }
    let got = req
        .headers()
        .get("authorization")
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "));
    if got.is_some_and(|g| st.api_keys.iter().any(|k| k == g)) {
        Ok(())
    } else {
        Err(ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::status(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "missing or invalid API key",
            )
        })
    }
}
