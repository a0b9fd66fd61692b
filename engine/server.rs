//! `specd serve`: OpenAI-compatible HTTP on actix-web.
//!
//! Invariants:
//! - Every request is validated before the engine sees it; a bad field
//!   answers 400 with an OpenAI-style error naming it, a full queue 429 with
//!   `Retry-After`, an unknown model 404; nothing accepted is lost.
//! - A request whose client goes away (stream dropped, connection closed) is
//!   aborted, which frees its KV blocks at the next step.
//! - Usage in every response (and the final SSE chunk) comes from the
//!   engine's `Completion`, the same numbers the metrics count.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::http::StatusCode;
use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse, ResponseError};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::config::Config;
use crate::error::SpecdError;
use crate::sampler::{FinishReason, SamplingParams};
use crate::speculative::actors::{Abort, EngineHandle};
use crate::speculative::{Completion, Event, Request, SeqId};
use crate::tokenizer::{ChatMessage, Tokenizer};

/// An OpenAI-style error response.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn bad_field(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
            retry_after: None,
        }
    }

    fn status(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut r = HttpResponse::build(self.status);
        if let Some(s) = self.retry_after {
            r.insert_header(("Retry-After", s.to_string()));
        }
        r.json(json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }))
    }
}

impl From<SpecdError> for ApiError {
    fn from(e: SpecdError) -> Self {
        match &e {
            SpecdError::Overloaded(_) => Self {
                retry_after: Some(1),
                code: Some("overloaded"),
                ..Self::status(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    e.to_string(),
                )
            },
            SpecdError::ContextOverflow { .. } => Self {
                code: Some("context_length_exceeded"),
                ..Self::bad_field("max_tokens", e.to_string())
            },
            SpecdError::InvalidRequest(m) => {
                let param = [
                    "temperature",
                    "top_p",
                    "top_k",
                    "min_p",
                    "presence_penalty",
                    "frequency_penalty",
                    "repetition_penalty",
                    "prompt",
                    "max_tokens",
                    "proposer",
                ]
                .into_iter()
                .find(|p| m.contains(p));
                Self {
                    param: param.map(str::to_string),
                    ..Self::bad_field("", m.clone())
                }
            }
            SpecdError::EngineStopped => Self::status(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                e.to_string(),
            ),
            _ => Self::status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            ),
        }
    }
}

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

type State = web::Data<AppState>;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn check_auth(req: &HttpRequest, st: &AppState) -> Result<(), ApiError> {
    let Some(key) = &st.api_key else {
        return Ok(());
    };
    let got = req
        .headers()
        .get("authorization")
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "));
    if got == Some(key.as_str()) {
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

// ------------------------------------------------------------ field parsing

fn num(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| ApiError::bad_field(key, format!("`{key}` must be a finite number"))),
        Some(v) => Err(ApiError::bad_field(
            key,
            format!("`{key}` must be a number, got {}", type_name(v)),
        )),
    }
}

fn int(obj: &Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n.as_u64().map(Some).ok_or_else(|| {
            ApiError::bad_field(key, format!("`{key}` must be a non-negative integer"))
        }),
        Some(v) => Err(ApiError::bad_field(
            key,
            format!("`{key}` must be an integer, got {}", type_name(v)),
        )),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// What both endpoints share once parsed.
struct Parsed {
    req: Request,
    stream: bool,
}

/// Parse the sampling, stop and speculation fields common to both endpoints.
fn parse_common(
    obj: &Map<String, Value>,
    st: &AppState,
    prompt: Vec<u32>,
) -> Result<Parsed, ApiError> {
    if let Some(m) = obj.get("model") {
        let m = m
            .as_str()
            .ok_or_else(|| ApiError::bad_field("model", "`model` must be a string"))?;
        if m != st.model_name {
            return Err(ApiError {
                code: Some("model_not_found"),
                param: Some("model".into()),
                ..ApiError::status(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    format!(
                        "model `{m}` does not exist; this server serves `{}`",
                        st.model_name
                    ),
                )
            });
        }
    }
    if let Some(n) = int(obj, "n")? {
        if n != 1 {
            return Err(ApiError::bad_field("n", "only n = 1 is supported"));
        }
    }
    if let Some(n) = int(obj, "best_of")? {
        if n != 1 {
            return Err(ApiError::bad_field(
                "best_of",
                "only best_of = 1 is supported",
            ));
        }
    }
    match obj.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(_) => {
            return Err(ApiError::bad_field(
                "logprobs",
                "logprobs are not supported by this server",
            ))
        }
    }
    if obj.get("echo").and_then(Value::as_bool) == Some(true) {
        return Err(ApiError::bad_field("echo", "echo is not supported"));
    }
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(ApiError::bad_field(
                "stream",
                format!("`stream` must be a boolean, got {}", type_name(v)),
            ))
        }
    };
    let room = st.max_seq_len.saturating_sub(prompt.len());
    let max_tokens = match int(obj, "max_tokens")?.or(int(obj, "max_completion_tokens")?) {
        Some(0) => {
            return Err(ApiError::bad_field(
                "max_tokens",
                "`max_tokens` must be at least 1",
            ))
        }
        Some(m) => m as usize,
        None => room.min(256),
    };
    if prompt.len() + max_tokens > st.max_seq_len {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::bad_field(
                "max_tokens",
                format!(
                    "prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the context of {} tokens",
                    prompt.len(),
                    st.max_seq_len
                ),
            )
        });
    }
    let d = SamplingParams::default();
    let params = SamplingParams {
        temperature: num(obj, "temperature")?.map(|x| x as f32).unwrap_or(1.0),
        top_p: num(obj, "top_p")?.map(|x| x as f32).unwrap_or(d.top_p),
        top_k: match obj.get("top_k") {
            Some(Value::Number(n)) if n.as_i64() == Some(-1) => 0,
            _ => int(obj, "top_k")?.map(|x| x as usize).unwrap_or(0),
        },
        min_p: num(obj, "min_p")?.map(|x| x as f32).unwrap_or(d.min_p),
        presence_penalty: num(obj, "presence_penalty")?
            .map(|x| x as f32)
            .unwrap_or(0.0),
        frequency_penalty: num(obj, "frequency_penalty")?
            .map(|x| x as f32)
            .unwrap_or(0.0),
        repetition_penalty: num(obj, "repetition_penalty")?
            .map(|x| x as f32)
            .unwrap_or(1.0),
        seed: int(obj, "seed")?.unwrap_or_else(rand_seed),
    };
    params.validate().map_err(|e| {
        let msg = match e {
            SpecdError::InvalidRequest(m) => m,
            other => other.to_string(),
        };
        let field = msg.split(':').next().unwrap_or("").trim().to_string();
        ApiError::bad_field(&field, msg)
    })?;
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > 16 {
                return Err(ApiError::bad_field("stop", "at most 16 stop strings"));
            }
            a.iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        ApiError::bad_field("stop", "`stop` entries must be strings")
                    })
                })
                .collect::<Result<_, _>>()?
        }
        Some(v) => {
            return Err(ApiError::bad_field(
                "stop",
                format!(
                    "`stop` must be a string or a list of strings, got {}",
                    type_name(v)
                ),
            ))
        }
    };
    let (mut proposer, mut max_draft) = (None, None);
    match obj.get("speculation") {
        None | Some(Value::Null) => {}
        Some(Value::Object(s)) => {
            for k in s.keys() {
                if k != "proposer" && k != "max_draft" {
                    return Err(ApiError::bad_field(
                        "speculation",
                        format!("unknown field `speculation.{k}`"),
                    ));
                }
            }
            if let Some(p) = s.get("proposer") {
                let p = p.as_str().ok_or_else(|| {
                    ApiError::bad_field("speculation.proposer", "must be a string")
                })?;
                if !st.config.server.allow_request_proposer {
                    return Err(ApiError::bad_field(
                        "speculation.proposer",
                        "this server does not allow choosing the proposer per request",
                    ));
                }
                if p != "none" && !st.proposers.iter().any(|n| n == p) {
                    return Err(ApiError::bad_field(
                        "speculation.proposer",
                        format!(
                            "unknown proposer `{p}` (available: none, {})",
                            st.proposers.join(", ")
                        ),
                    ));
                }
                proposer = Some(p.to_string());
            }
            max_draft = int(s, "max_draft")
                .map_err(|e| ApiError::bad_field("speculation.max_draft", e.message))?
                .map(|x| x as usize);
        }
        Some(v) => {
            return Err(ApiError::bad_field(
                "speculation",
                format!("`speculation` must be an object, got {}", type_name(v)),
            ))
        }
    }
    // Precedence: the request's own choice, then a weighted traffic split,
    // then the model's route (or the engine default).
    let (proposer, arm) = match proposer {
        Some(p) => (p, None),
        None => match pick_split(st) {
            Some(sp) => (sp.proposer.clone(), Some(sp.name.clone())),
            None => (st.config.route(&st.model_name).to_string(), None),
        },
    };
    Ok(Parsed {
        req: Request {
            prompt,
            params,
            max_tokens,
            stop,
            ignore_eos: obj
                .get("ignore_eos")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            proposer: Some(proposer),
            max_draft,
            arm,
        },
        stream,
    })
}

/// A weighted random traffic-split arm, if splits are configured.
fn pick_split(st: &AppState) -> Option<&crate::config::Split> {
    let splits = &st.config.server.split;
    let total: f64 = splits.iter().map(|s| s.weight).sum();
    if splits.is_empty() || total <= 0.0 {
        return None;
    }
    let u = st
        .split_rng
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .next_f64()
        * total;
    let mut cum = 0.0;
    for s in splits {
        cum += s.weight;
        if u < cum {
            return Some(s);
        }
    }
    splits.last()
}

fn rand_seed() -> u64 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    (t as u64) ^ 0x9E37_79B9_7F4A_7C15
}

fn body_object(body: &Bytes) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_field("", format!("request body is not valid JSON: {e}")))?;
    match v {
        Value::Object(o) => Ok(o),
        other => Err(ApiError::bad_field(
            "",
            format!(
                "request body must be a JSON object, got {}",
                type_name(&other)
            ),
        )),
    }
}

fn encode(st: &AppState, text: &str, special: bool) -> Result<Vec<u32>, ApiError> {
    let ids = st.tokenizer.encode(text, special).map_err(ApiError::from)?;
    if ids.is_empty() {
        return Err(ApiError::bad_field("prompt", "prompt is empty"));
    }
    if ids.len() >= st.max_seq_len {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::bad_field(
                "prompt",
                format!(
                    "prompt has {} tokens; the context holds {}",
                    ids.len(),
                    st.max_seq_len
                ),
            )
        });
    }
    Ok(ids)
}

// ------------------------------------------------------------ responses

fn usage(c: &Completion) -> Value {
    json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.tokens.len(),
        "total_tokens": c.prompt_tokens + c.tokens.len(),
        "speculation": {
            "proposer": c.stats.proposer,
            "drafted_tokens": c.stats.drafted,
            "accepted_tokens": c.stats.accepted,
            "verify_steps": c.stats.verify_steps,
            "acceptance_rate": c.stats.acceptance_rate(),
            "mean_accepted_length": c.stats.mean_accepted_len(),
        }
    })
}

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Aborted => "abort",
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

struct Shape {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
}

impl Shape {
    fn chunk(&self, text: &str, finish: Option<&str>, usage: Option<Value>, first: bool) -> Value {
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
            Kind::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": text})
                } else if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        let mut v = json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }

    fn full(&self, c: &Completion) -> Value {
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": 0, "text": c.text, "logprobs": null, "finish_reason": finish_str(c.finish)})
            }
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": null,
                "finish_reason": finish_str(c.finish),
            }),
        };
        json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(c),
        })
    }
}

/// Aborts the request when dropped before it finished (client gone).
struct AbortGuard {
    engine: EngineHandle,
    id: SeqId,
    armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            metrics::counter!("specd_client_disconnects_total").increment(1);
            self.engine.scheduler.do_send(Abort(self.id));
        }
    }
}

/// Server-sent events for one request.
struct SseStream {
    rx: UnboundedReceiver<Event>,
    shape: Shape,
    guard: AbortGuard,
    first: bool,
    done: bool,
}

impl futures_core::Stream for SseStream {
    type Item = Result<Bytes, actix_web::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        loop {
            match self.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Event::Tokens { text, .. })) => {
                    if text.is_empty() && !self.first {
                        continue;
                    }
                    let first = self.first;
                    self.first = false;
                    let v = self.shape.chunk(&text, None, None, first);
                    return Poll::Ready(Some(Ok(Bytes::from(format!("data: {v}\n\n")))));
                }
                Poll::Ready(Some(Event::Finished(c))) => {
                    self.done = true;
                    self.guard.armed = false;
                    let first = self.first;
                    let v =
                        self.shape
                            .chunk("", Some(finish_str(c.finish)), Some(usage(&c)), first);
                    return Poll::Ready(Some(Ok(Bytes::from(format!(
                        "data: {v}\n\ndata: [DONE]\n\n"
                    )))));
                }
                Poll::Ready(Some(Event::Error(e))) => {
                    self.done = true;
                    self.guard.armed = false;
                    let v = json!({"error": {"message": e, "type": "server_error", "param": null, "code": null}});
                    return Poll::Ready(Some(Ok(Bytes::from(format!(
                        "data: {v}\n\ndata: [DONE]\n\n"
                    )))));
                }
                Poll::Ready(None) => {
                    self.done = true;
                    return Poll::Ready(None);
                }
            }
        }
    }
}

async fn run_request(st: &State, parsed: Parsed, kind: Kind) -> Result<HttpResponse, ApiError> {
    let (id, mut rx) = st.engine.submit(parsed.req).await.map_err(ApiError::from)?;
    let shape = Shape {
        kind,
        id: format!(
            "{}-{id}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            }
        ),
        created: now(),
        model: st.model_name.clone(),
    };
    let mut guard = AbortGuard {
        engine: st.engine.clone(),
        id,
        armed: true,
    };
    if parsed.stream {
        let s = SseStream {
            rx,
            shape,
            guard,
            first: true,
            done: false,
        };
        return Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .streaming(s));
    }
    loop {
        match rx.recv().await {
            Some(Event::Tokens { .. }) => {}
            Some(Event::Finished(c)) => {
                guard.armed = false;
                return Ok(HttpResponse::Ok().json(shape.full(&c)));
            }
            Some(Event::Error(e)) => {
                guard.armed = false;
                return Err(ApiError::status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    e,
                ));
            }
            None => {
                guard.armed = false;
                return Err(ApiError::from(SpecdError::EngineStopped));
            }
        }
    }
}

async fn completions(req: HttpRequest, body: Bytes, st: State) -> Result<HttpResponse, ApiError> {
    check_auth(&req, &st)?;
    let obj = body_object(&body)?;
    let prompt = match obj.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_string()
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::bad_field(
                "prompt",
                "batched prompts are not supported; send one string",
            ))
        }
        Some(v) => {
            return Err(ApiError::bad_field(
                "prompt",
                format!("`prompt` must be a string, got {}", type_name(v)),
            ))
        }
        None => {
            return Err(ApiError::bad_field(
                "prompt",
                "missing required field `prompt`",
            ))
        }
    };
    let ids = encode(&st, &prompt, true)?;
    let parsed = parse_common(&obj, &st, ids)?;
    run_request(&st, parsed, Kind::Completion).await
}

async fn chat(req: HttpRequest, body: Bytes, st: State) -> Result<HttpResponse, ApiError> {
    check_auth(&req, &st)?;
    let obj = body_object(&body)?;
    let msgs = match obj.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => {
            return Err(ApiError::bad_field(
                "messages",
                "`messages` must not be empty",
            ))
        }
        Some(v) => {
            return Err(ApiError::bad_field(
                "messages",
                format!("`messages` must be an array, got {}", type_name(v)),
            ))
        }
        None => {
            return Err(ApiError::bad_field(
                "messages",
                "missing required field `messages`",
            ))
        }
    };
    let mut messages = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let field = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad_field(&field, format!("`{field}.role` must be a string"))
        })?;
        if !matches!(role, "system" | "user" | "assistant" | "developer") {
            return Err(ApiError::bad_field(
                &field,
                format!("`{field}.role` = `{role}` is not supported"),
            ));
        }
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .map(|p| {
                    p.get("text").and_then(Value::as_str).ok_or_else(|| {
                        ApiError::bad_field(&field, "only text content parts are supported")
                    })
                })
                .collect::<Result<Vec<_>, _>>()?
                .join(""),
            _ => {
                return Err(ApiError::bad_field(
                    &field,
                    format!("`{field}.content` must be a string"),
                ))
            }
        };
        let role = if role == "developer" { "system" } else { role };
        messages.push(ChatMessage {
            role: role.into(),
            content,
        });
    }
    let text = st
        .tokenizer
        .apply_chat_template(&messages, true)
        .map_err(ApiError::from)?;
    let ids = encode(&st, &text, false)?;
    let parsed = parse_common(&obj, &st, ids)?;
    run_request(&st, parsed, Kind::Chat).await
}

async fn models(req: HttpRequest, st: State) -> Result<HttpResponse, ApiError> {
    check_auth(&req, &st)?;
    Ok(HttpResponse::Ok().json(json!({
        "object": "list",
        "data": [{"id": st.model_name, "object": "model", "created": 0, "owned_by": "specd", "max_model_len": st.max_seq_len}],
    })))
}

async fn speculation_stats(req: HttpRequest, st: State) -> Result<HttpResponse, ApiError> {
    check_auth(&req, &st)?;
    let (arms, shadows) = st
        .engine
        .spec_stats()
        .await
        .ok_or_else(|| ApiError::from(SpecdError::EngineStopped))?;
    let arms: Map<String, Value> = arms.iter().map(|(k, v)| (k.clone(), v.summary())).collect();
    let shadows: Map<String, Value> = shadows
        .iter()
        .map(|(k, v)| (k.clone(), v.summary()))
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "arms": arms,
        "shadows": shadows,
        "splits": st.config.server.split,
    })))
}

/// How long `/health` and `/ready` wait for the engine to answer.
const PING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Alive: the process serves HTTP and the engine answers. 503 once the
/// engine has failed (the daemon then exits non-zero).
async fn health(st: State) -> HttpResponse {
    match st.engine.ping(PING_TIMEOUT).await {
        Ok(_) => HttpResponse::Ok().json(json!({"status": "alive"})),
        Err(why) => {
            HttpResponse::ServiceUnavailable().json(json!({"status": "failed", "reason": why}))
        }
    }
}

/// Ready: loading finished and the engine answers right now.
async fn ready(st: State) -> HttpResponse {
    if !st.ready.load(Ordering::Relaxed) {
        return HttpResponse::ServiceUnavailable().json(json!({"status": "loading"}));
    }
    match st.engine.ping(PING_TIMEOUT).await {
        Ok(stats) => HttpResponse::Ok().json(json!({
            "status": "ready",
            "model": st.model_name,
            "waiting": stats.waiting,
            "running": stats.running,
        })),
        Err(why) => {
            HttpResponse::ServiceUnavailable().json(json!({"status": "failed", "reason": why}))
        }
    }
}

async fn metrics_text(st: State) -> HttpResponse {
    if let Some(u) = st.engine.kv_usage().await {
        metrics::gauge!("specd_kv_used_blocks").set(u.used_blocks as f64);
    }
    match &st.metrics {
        Some(h) => HttpResponse::Ok()
            .content_type("text/plain; version=0.0.4")
            .body(h.render()),
        None => HttpResponse::NotFound().finish(),
    }
}

async fn not_found() -> Result<HttpResponse, ApiError> {
    Err(ApiError {
        code: Some("not_found"),
        ..ApiError::status(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "no such endpoint",
        )
    })
}

/// Register every route on an actix-web service config.
pub fn routes(cfg: &mut web::ServiceConfig, body_limit: usize) {
    let json_err = |limit: usize| web::PayloadConfig::new(limit);
    cfg.app_data(json_err(body_limit))
        .route("/v1/completions", web::post().to(completions))
        .route("/v1/chat/completions", web::post().to(chat))
        .route("/v1/models", web::get().to(models))
        .route("/v1/speculation/stats", web::get().to(speculation_stats))
        .route("/health", web::get().to(health))
        .route("/ready", web::get().to(ready))
        .route("/metrics", web::get().to(metrics_text));
}

/// Default handler for unknown paths.
pub fn default_service() -> actix_web::Route {
    web::route().to(not_found)
}
