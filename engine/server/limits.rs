//! Per-client limits on what one client may have in the engine at once:
//! sequences (prompts x choices) and prompt tokens, summed over its
//! unfinished requests.
//!
//! Invariants:
//! - A client is the API key it authenticated with when the server has
//!   keys, else its peer address (a proxy in front makes every client
//!   one: give each client its own key from `[server] api_keys`).
//! - A request is admitted whole or refused whole (429 with
//!   `Retry-After`, naming the limit, before anything reaches the
//!   engine; 400 when it alone exceeds a limit, since no retry can
//!   pass); its `Lease` gives its share back when the last of its choices
//!   is dropped (finished, failed or aborted), so nothing leaks however
//!   the client goes away.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use actix_web::http::StatusCode;
use actix_web::HttpRequest;

use super::errors::ApiError;

/// What a client holds now.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Load {
    seqs: usize,
    tokens: usize,
}

/// The limits of `[server]` (0: none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub max_sequences: usize,
    pub max_prompt_tokens: usize,
}

/// Every client's load.
#[derive(Debug, Default)]
pub struct ClientLoads {
    loads: Mutex<HashMap<String, Load>>,
}

/// One admitted request's share of its client's load, given back on drop.
#[derive(Debug)]
pub struct Lease {
    loads: Arc<ClientLoads>,
    client: String,
    load: Load,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut map = self.loads.loads.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = map.get_mut(&self.client) {
            l.seqs = l.seqs.saturating_sub(self.load.seqs);
            l.tokens = l.tokens.saturating_sub(self.load.tokens);
            if *l == Load::default() {
                map.remove(&self.client);
            }
        }
    }
}

impl ClientLoads {
    /// Admit `seqs` sequences carrying `tokens` prompt tokens for `client`
    /// under `limits`, or refuse with a 429 naming the limit.
    pub fn acquire(
        self: &Arc<Self>,
        client: &str,
        seqs: usize,
        tokens: usize,
        limits: Limits,
    ) -> Result<Lease, ApiError> {
        let mut map = self.loads.lock().unwrap_or_else(|e| e.into_inner());
        let now = map.get(client).copied().unwrap_or_default();
        let over = |limit: usize, have: usize, add: usize| limit > 0 && have + add > limit;
        let refuse = |what: &str, limit: usize, have: usize, add: usize| {
            metrics::counter!("specd_client_limit_refusals_total", "limit" => what.to_string())
                .increment(1);
            ApiError {
                retry_after: Some(1),
                code: Some("client_limit"),
                ..ApiError::status(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    format!(
                        "per-client limit `{what}` = {limit}: this client has {have} in flight and the request adds {add}; retry when some finish"
                    ),
                )
            }
        };
        // A request larger than a limit on its own would be refused for
        // ever: a 400, not a 429 that invites the same retry.
        let checks = [
            (
                "max_client_sequences",
                limits.max_sequences,
                now.seqs,
                seqs,
                "n",
            ),
            (
                "max_client_prompt_tokens",
                limits.max_prompt_tokens,
                now.tokens,
                tokens,
                "prompt",
            ),
        ];
        for (what, limit, _, add, field) in checks {
            if over(limit, 0, add) {
                return Err(ApiError::bad_field(
                    field,
                    format!("the request alone needs {add} against this server's per-client limit `{what}` = {limit}"),
                ));
            }
        }
        for (what, limit, have, add, _) in checks {
            if over(limit, have, add) {
                return Err(refuse(what, limit, have, add));
            }
        }
        let load = Load { seqs, tokens };
        let e = map.entry(client.to_string()).or_default();
        e.seqs += seqs;
        e.tokens += tokens;
        Ok(Lease {
            loads: self.clone(),
            client: client.to_string(),
            load,
        })
    }

    /// Clients holding anything now.
    pub fn clients(&self) -> usize {
        self.loads.lock().map(|m| m.len()).unwrap_or(0)
    }
}

/// Who sent `req`: its API key when the server has keys (checked by
/// `check_auth` before), else its peer address.
pub fn client_of(req: &HttpRequest, keyed: bool) -> String {
    if keyed {
        if let Some(k) = req
            .headers()
            .get("authorization")
            .and_then(|h| h.to_str().ok())
            .and_then(|h| h.strip_prefix("Bearer "))
        {
            return format!("key:{k}");
        }
    }
    match req.peer_addr() {
        Some(a) => format!("peer:{}", a.ip()),
        None => "peer:unknown".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_count_against_their_client_until_dropped() {
        let loads = Arc::new(ClientLoads::default());
        let lim = Limits {
            max_sequences: 4,
            max_prompt_tokens: 1000,
        };
        let a = loads.acquire("a", 3, 600, lim).unwrap();
        // Another client is not affected.
        let b = loads.acquire("b", 4, 1000, lim).unwrap();
        let e = loads.acquire("a", 2, 10, lim).unwrap_err();
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.retry_after, Some(1));
        assert!(
            e.message.contains("`max_client_sequences` = 4"),
            "{}",
            e.message
        );
        let e = loads.acquire("a", 1, 401, lim).unwrap_err();
        assert!(
            e.message.contains("max_client_prompt_tokens"),
            "{}",
            e.message
        );
        // What fits still fits; dropping gives the share back.
        let a2 = loads.acquire("a", 1, 400, lim).unwrap();
        drop(a);
        drop(a2);
        let _a3 = loads.acquire("a", 4, 1000, lim).unwrap();
        drop(b);
        assert_eq!(loads.clients(), 1);
        // Never admissible on its own: 400 naming the limit.
        let e = loads.acquire("d", 5, 1, lim).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message.contains("`max_client_sequences` = 4"),
            "{}",
            e.message
        );
        let e = loads.acquire("d", 1, 1001, lim).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        // No limits: anything goes.
        let none = loads.acquire("c", 1 << 20, 1 << 30, Limits::default());
        assert!(none.is_ok());
    }
}
