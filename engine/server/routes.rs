//! The endpoint handlers.

use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::http::StatusCode;
use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use serde_json::{json, Map, Value};

use super::auth::check_auth;
use super::errors::ApiError;
use super::requests::{self, ChatBody, Common, CompletionBody, Parsed};
use super::sse::{AbortGuard, Echo, Kind, Shape, SseStream};
use super::AppState;
use crate::error::SpecdError;
use crate::speculative::Event;
use crate::tokenizer::ChatMessage;

type State = web::Data<AppState>;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn completions(
    req: HttpRequest,
    body: Result<Bytes, actix_web::Error>,
    st: State,
) -> Result<HttpResponse, ApiError> {
    check_auth(&req, &st)?;
    let body = requests::body_object(&read_body(body)?)?;
    let prompts =
        requests::completion_prompts(requests::from_body::<CompletionBody>(&body)?, st.vocab())?;
    let mut common: Common = requests::from_body(&body)?;
    if common.tools.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(ApiError::bad_field(
            "tools",
            "`tools` is offered on /v1/chat/completions only",
        ));
    }
    // echo: each prompt comes back before its choice (with its logprobs
    // when logprobs are asked); with max_tokens 0, the prompt alone.
    let echo = common.echo.take().is_some_and(|e| e.0);
    let drop_generated = echo
        && matches!(
            common.max_tokens.or(common.max_completion_tokens),
            Some(requests::UInt(0))
        );
    if echo && common.stream.is_some_and(|s| s.0) {
        return Err(ApiError::bad_field(
            "echo",
            "`echo` with `stream` is not supported; ask without streaming",
        ));
    }
    if drop_generated {
        // The prompt alone: nothing generated can hold min_tokens back
        // (refused against the 0 asked for, not the 1 decoded).
        if requests::min_tokens(common.min_tokens.as_ref())? > 0 {
            return Err(ApiError::bad_field(
                "min_tokens",
                "`min_tokens` is more than `max_tokens` (0: `echo` returns the prompt alone)",
            ));
        }
        common.max_tokens = Some(requests::UInt(1));
        common.max_completion_tokens = None;
    }
    // Every prompt is validated before any is submitted; tokenizing and
    // compiling a constraint run off the HTTP workers, which keep serving
    // streams and health checks meanwhile.
    let (prompts, mut parsed) = off_worker(&st, move |st| {
        let mut shaping = None;
        let many = prompts.len() > 1;
        let parsed = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                // Only errors about this prompt name it: the other fields
                // are the batch's, and fail the same for every prompt.
                let ids =
                    requests::encode(st, p).map_err(|e| if many { e.for_prompt(i) } else { e })?;
                requests::validate_with(common.clone(), st, ids, &mut shaping).map_err(|e| {
                    if many && e.is_about_the_prompt() {
                        e.for_prompt(i)
                    } else {
                        e
                    }
                })
            })
            .collect::<Result<Vec<Parsed>, ApiError>>()?;
        Ok((prompts, parsed))
    })
    .await?;
    let echo = echo.then(|| Echo {
        prompts: prompts
            .iter()
            .zip(&parsed)
            .map(|(p, parsed)| {
                let text = match p {
                    requests::PromptIn::Text(s) => s.clone(),
                    requests::PromptIn::Ids(ids) => {
                        st.tokenizer.decode(ids, false).unwrap_or_default()
                    }
                };
                (text, parsed.req.prompt.first().copied())
            })
            .collect(),
        drop_generated,
    });
    if echo.is_some() {
        for p in &mut parsed {
            p.req.prompt_logprobs = p.req.logprobs;
        }
    }
    run_choices(&st, &req, parsed, Kind::Completion, echo).await
}

/// Seed of choice `j` of a request seeded `seed` (choice 0 keeps it, so
/// `n = 1` is unchanged; every choice reproduces with the request seed).
fn choice_seed(seed: u64, j: usize) -> u64 {
    seed ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A request's choices: `n` per prompt, for one or more prompts, each its own
/// sequence (scheduled together; a prompt's later choices start from its
/// first choice's prompt KV), answered in order: choice `i * n + j` is
/// prompt i's choice j. If any submission is refused, the ones already
/// submitted are aborted (their guards drop).
async fn run_choices(
    st: &State,
    http: &HttpRequest,
    parsed: Vec<Parsed>,
    kind: Kind,
    echo: Option<Echo>,
) -> Result<HttpResponse, ApiError> {
    let stream = parsed[0].stream;
    let include_usage = parsed[0].include_usage;
    let logprobs = parsed[0].req.logprobs.is_some();
    let tools = parsed[0].tools;
    let n = parsed[0].n.max(1);
    // More sequences than the queue holds can never be admitted together:
    // refuse that outright (a 429 would invite retries of the same).
    let limit = st.config().server.max_queue;
    if parsed.len().saturating_mul(n) > limit {
        return Err(ApiError::bad_field(
            "n",
            format!(
                "{} prompts x n = {n} asks for {} sequences; this server queues at most {limit} at once",
                parsed.len(),
                parsed.len().saturating_mul(n)
            ),
        ));
    }
    // The client's limits: the whole request or nothing. Its prompt
    // tokens count once per prompt (choices share their prompt's KV).
    let config = st.config();
    let server = &config.server;
    let lease = st.clients.acquire(
        &super::limits::client_of(http, !st.api_keys.is_empty()),
        parsed.len() * n,
        parsed.iter().map(|p| p.req.prompt.len()).sum(),
        super::limits::Limits {
            max_sequences: server.max_client_sequences,
            max_prompt_tokens: server.max_client_prompt_tokens,
        },
    )?;
    let lease = std::sync::Arc::new(lease);
    let mut parts = Vec::with_capacity(parsed.len() * n);
    let mut first_id = None;
    for p in parsed {
        let mut first_of_prompt = None;
        for j in 0..n {
            let mut r = p.req.clone();
            r.params.seed = choice_seed(p.req.params.seed, j);
            r.fork_of = first_of_prompt;
            // Every prompt and choice of this request: one group.
            r.group = first_id;
            let (id, rx) = st.engine.submit(r).await.map_err(ApiError::from)?;
            first_id.get_or_insert(id);
            first_of_prompt.get_or_insert(id);
            parts.push((
                rx,
                AbortGuard {
                    engine: st.engine.clone(),
                    id,
                    armed: true,
                    _lease: lease.clone(),
                },
            ));
        }
    }
    let shape = Shape {
        kind,
        id: format!(
            "{}-{}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            first_id.unwrap_or(0)
        ),
        created: now(),
        model: st.model_name.clone(),
        tokenizer: st.tokenizer.clone(),
        logprobs,
        echo,
        tools,
    };
    if stream {
        return Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .streaming(SseStream::new(parts, shape, n, include_usage).keepalive(
                std::time::Duration::from_secs(st.config().server.sse_keepalive_secs),
            )));
    }
    let mut done = Vec::with_capacity(parts.len());
    for (rx, guard) in &mut parts {
        loop {
            match rx.recv().await {
                Some(Event::Tokens { .. }) => {}
                Some(Event::Finished(c)) => {
                    guard.armed = false;
                    done.push(c);
                    break;
                }
                Some(Event::Error(e)) => {
                    guard.armed = false;
                    return Err(ApiError::status(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        e,
                    ));
                }
                Some(Event::Rejected(e)) => {
                    guard.armed = false;
                    return Err(ApiError::status(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
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
    Ok(HttpResponse::Ok().json(shape.full_many(&done, n)))
}

async fn chat(
    req: HttpRequest,
    body: Result<Bytes, actix_web::Error>,
    st: State,
) -> Result<HttpResponse, ApiError> {
    check_auth(&req, &st)?;
    let body = requests::body_object(&read_body(body)?)?;
    let native = st.tokenizer.native_tool_template();
    let mut messages = requests::chat_messages(requests::from_body::<ChatBody>(&body)?, native)?;
    let common: Common = requests::from_body(&body)?;
    if common.logprobs.as_ref().is_some_and(|v| v.is_number()) {
        return Err(ApiError::bad_field(
            "logprobs",
            "chat's `logprobs` is true or false; `top_logprobs` gives the alternatives per token",
        ));
    }
    let tools = super::tools::parse(
        common.tools.as_ref(),
        common.tool_choice.as_ref(),
        common.parallel_tool_calls.as_ref(),
    )?;
    // Offered tools go to a template that documents them itself, or are
    // documented to the model in the system turn.
    let mut offered = None;
    if let Some(t) = tools.filter(|t| t.active()) {
        if native {
            offered = Some(crate::structured::tools::definitions(&t.tools));
        } else {
            let doc = crate::structured::tools::system_prompt(&t.tools);
            match messages.first_mut().filter(|m| m.role == "system") {
                Some(m) => m.content = format!("{}\n\n{doc}", m.content),
                None => messages.insert(0, ChatMessage::new("system", doc)),
            }
        }
    }
    let parsed = off_worker(&st, move |st| {
        let ids = requests::encode_chat(st, &messages, offered.as_ref())?;
        requests::validate(common, st, ids)
    })
    .await?;
    run_choices(&st, &req, vec![parsed], Kind::Chat, None).await
}

/// Run a request's CPU work (tokenizing, rendering the chat template,
/// compiling its constraint) on actix's blocking pool, so the HTTP
/// workers stay free for streams and health checks.
async fn off_worker<T: Send + 'static>(
    st: &State,
    f: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let st = st.clone();
    web::block(move || f(&st)).await.map_err(|e| {
        ApiError::status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("request validation did not finish: {e}"),
        )
    })?
}

async fn models(req: HttpRequest, st: State) -> Result<HttpResponse, ApiError> {
    check_auth(&req, &st)?;
    Ok(HttpResponse::Ok().json(json!({
        "object": "list",
        "data": [model_card(&st)],
    })))
}

/// `GET /v1/models/{id}`: the served model, or 404 naming it.
async fn model(
    req: HttpRequest,
    id: web::Path<String>,
    st: State,
) -> Result<HttpResponse, ApiError> {
    check_auth(&req, &st)?;
    if *id != st.model_name {
        return Err(ApiError::model_not_found(&id, &st.model_name));
    }
    Ok(HttpResponse::Ok().json(model_card(&st)))
}

/// The served model as `/v1/models` lists it.
fn model_card(st: &AppState) -> Value {
    json!({"id": st.model_name, "object": "model", "created": 0, "owned_by": "specd", "max_model_len": st.max_seq_len})
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
        "splits": st.config().server.split,
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

/// A request body, or the error that reading it met (over the body
/// limit: 413; a broken upload: its status) as an API error in the
/// OpenAI shape like every other, not actix's plain-text one.
fn read_body(body: Result<Bytes, actix_web::Error>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.as_response_error().status_code();
        let hint = if status == actix_web::http::StatusCode::PAYLOAD_TOO_LARGE {
            " (the server's `max_body_bytes`)"
        } else {
            ""
        };
        ApiError::status(
            status,
            "invalid_request_error",
            format!("reading the request body: {e}{hint}"),
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
        .route("/v1/models/{id:.+}", web::get().to(model))
        .route("/v1/speculation/stats", web::get().to(speculation_stats))
        .route("/health", web::get().to(health))
        .route("/ready", web::get().to(ready))
        .route("/metrics", web::get().to(metrics_text))
        .route(
            "/v1/admin/proposers",
            web::get().to(super::admin::list_proposers),
        )
        .route(
            "/v1/admin/proposers/reload",
            web::post().to(super::admin::reload_proposers),
        );
}

/// Default handler for unknown paths.
pub fn default_service() -> actix_web::Route {
    web::route().to(not_found)
}
