//! Response shapes (JSON and server-sent events) and the guard that aborts
//! a request whose client went away.
//!
//! Invariants: usage in every response (and the final SSE chunk) comes from
//! the engine's `Completion`; a request whose stream is dropped before its
//! final event is aborted, which frees its KV blocks.

use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::web::Bytes;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::sampler::FinishReason;
use crate::speculative::actors::{Abort, EngineHandle};
use crate::speculative::{Completion, Event, SeqId};

pub(super) fn usage(c: &Completion) -> Value {
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

pub(super) fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Aborted => "abort",
    }
}

#[derive(Clone, Copy, PartialEq)]
pub(super) enum Kind {
    Completion,
    Chat,
}

pub(super) struct Shape {
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
}

impl Shape {
    pub(super) fn chunk(
        &self,
        text: &str,
        finish: Option<&str>,
        usage: Option<Value>,
        first: bool,
    ) -> Value {
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

    pub(super) fn full(&self, c: &Completion) -> Value {
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
pub(super) struct AbortGuard {
    pub(super) engine: EngineHandle,
    pub(super) id: SeqId,
    pub(super) armed: bool,
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
pub(super) struct SseStream {
    pub(super) rx: UnboundedReceiver<Event>,
    pub(super) shape: Shape,
    pub(super) guard: AbortGuard,
    pub(super) first: bool,
    pub(super) done: bool,
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
