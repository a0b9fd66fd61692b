//! Response shapes (JSON and server-sent events) and the guard that aborts
//! a request whose client went away.
//!
//! Invariants: usage in every response (and the final SSE chunk) comes from
//! the engine's `Completion`; a request whose stream is dropped before its
//! final event is aborted, which frees its KV blocks.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::web::Bytes;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::sampler::FinishReason;
use crate::speculative::actors::{Abort, EngineHandle};
use crate::speculative::{Completion, Event, SeqId, TokenLogprob};

pub(super) fn usage(c: &Completion) -> Value {
    usage_of(c.prompt_tokens, c.tokens.len(), &c.stats)
}

/// `usage`: token counts and the speculation figures of `stats`.
fn usage_of(prompt: usize, completion: usize, stats: &crate::speculative::SpecStats) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "speculation": {
            "proposer": stats.proposer,
            "drafted_tokens": stats.drafted,
            "accepted_tokens": stats.accepted,
            "verify_steps": stats.verify_steps,
            "acceptance_rate": stats.acceptance_rate(),
            "mean_accepted_length": stats.mean_accepted_len(),
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
    pub(super) tokenizer: std::sync::Arc<crate::tokenizer::Tokenizer>,
    /// Whether the request asked for logprobs.
    pub(super) logprobs: bool,
    /// Completions with `echo`: each prompt comes back before its choices.
    pub(super) echo: Option<Echo>,
    /// Chat with tools offered: output that is calls comes back as
    /// `tool_calls` (finish `tool_calls`).
    pub(super) tools: bool,
}

/// A streamed chat choice with tools: undecided until its first
/// character (`<` starts calls, anything else, whitespace too, is text:
/// `tools::is_calls`).
#[derive(Clone, Copy, PartialEq)]
enum ToolMode {
    Undecided,
    Text,
    Calls,
}

/// What `echo` puts before each choice: the prompt's text and first token
/// (whose log-probability is null: nothing predicts it), per prompt.
pub(super) struct Echo {
    pub(super) prompts: Vec<(String, Option<u32>)>,
    /// `max_tokens: 0`: the prompt alone (the engine still decoded one
    /// token, which is dropped).
    pub(super) drop_generated: bool,
}

impl Shape {
    /// OpenAI's `tool_calls` entries for `calls`, numbered from `start`
    /// within choice `choice`.
    fn tool_calls_json(
        &self,
        choice: usize,
        calls: &[crate::structured::tools::ToolCall],
        start: usize,
    ) -> Vec<Value> {
        calls
            .iter()
            .enumerate()
            .map(|(k, c)| {
                json!({
                    "index": start + k,
                    "id": format!("call_{}_{choice}_{}", self.id, start + k),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                })
            })
            .collect()
    }

    /// A streamed chat chunk whose delta is given.
    fn delta_chunk(
        &self,
        index: usize,
        delta: Value,
        finish: Option<&str>,
        usage: Option<Value>,
    ) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }

    /// `logprobs` in OpenAI's shape for the kind: chat's `content` list
    /// (token, logprob, bytes, top_logprobs) or completions' parallel lists
    /// (tokens, token_logprobs, top_logprobs, text_offset, counted in
    /// characters from `*offset`, which advances). `null` unless asked.
    fn logprobs_json(&self, lps: &[TokenLogprob], offset: &mut usize) -> Value {
        self.logprobs_with_lead(None, lps.iter(), offset)
    }

    /// `logprobs_json` after an unpredicted `lead` token (completions'
    /// echoed first prompt token: null log-probability, null alternatives).
    fn logprobs_with_lead<'a>(
        &self,
        lead: Option<u32>,
        lps: impl Iterator<Item = &'a TokenLogprob> + Clone,
        offset: &mut usize,
    ) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let tok = &self.tokenizer;
        let piece = |t: u32| {
            let b = tok.token_bytes(t);
            (String::from_utf8_lossy(&b).into_owned(), b)
        };
        match self.kind {
            Kind::Chat => {
                let content: Vec<Value> = lps
                    .map(|lp| {
                        let (s, b) = piece(lp.token);
                        let top: Vec<Value> = lp
                            .top
                            .iter()
                            .map(|&(t, l)| {
                                let (s, b) = piece(t);
                                json!({"token": s, "logprob": l, "bytes": b})
                            })
                            .collect();
                        json!({"token": s, "logprob": lp.logprob, "bytes": b, "top_logprobs": top})
                    })
                    .collect();
                json!({ "content": content })
            }
            Kind::Completion => {
                let mut tokens = Vec::new();
                let mut values = Vec::new();
                let mut tops = Vec::new();
                let mut offsets = Vec::new();
                if let Some(t) = lead {
                    let (s, _) = piece(t);
                    offsets.push(*offset);
                    *offset += s.chars().count();
                    tokens.push(s);
                    values.push(None);
                    tops.push(Value::Null);
                }
                for lp in lps {
                    let (s, _) = piece(lp.token);
                    offsets.push(*offset);
                    *offset += s.chars().count();
                    tokens.push(s);
                    values.push(Some(lp.logprob));
                    let top: serde_json::Map<String, Value> = lp
                        .top
                        .iter()
                        .map(|&(t, l)| (piece(t).0, json!(l)))
                        .collect();
                    tops.push(Value::Object(top));
                }
                json!({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets})
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn chunk(
        &self,
        index: usize,
        text: &str,
        finish: Option<&str>,
        usage: Option<Value>,
        first: bool,
        lps: &[TokenLogprob],
        offset: &mut usize,
    ) -> Value {
        let logprobs = self.logprobs_json(lps, offset);
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": text})
                } else if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
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
}

impl Shape {
    /// One response for several choices (`n` per prompt, prompts in
    /// order): usage and speculation figures summed over them, prompt
    /// tokens counted once per prompt.
    pub(super) fn full_many(&self, cs: &[Completion], n: usize) -> Value {
        let choices: Vec<Value> = cs
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let logprobs = self.logprobs_json(&c.logprobs, &mut 0);
                match (self.kind, &self.echo) {
                    (Kind::Completion, Some(e)) => {
                        let (prompt, first) = e.prompts.get(i / n.max(1)).cloned().unwrap_or_default();
                        let generated: &[TokenLogprob] =
                            if e.drop_generated { &[] } else { &c.logprobs };
                        let logprobs = self.logprobs_with_lead(
                            first,
                            c.prompt_logprobs.iter().chain(generated),
                            &mut 0,
                        );
                        let text = if e.drop_generated {
                            prompt
                        } else {
                            prompt + &c.text
                        };
                        let finish = if e.drop_generated { "length" } else { finish_str(c.finish) };
                        json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish})
                    }
                    (Kind::Completion, None) => json!({"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": finish_str(c.finish)}),
                    // Tools: the complete calls the output starts with
                    // (an unfinished one cut by max_tokens is dropped, and
                    // the finish is then `length`).
                    (Kind::Chat, _) => match (self.tools
                        && crate::structured::tools::is_calls(&c.text) == Some(true))
                    .then(|| {
                            let mut rest = c.text.clone();
                            let calls = crate::structured::tools::take_complete_calls(&mut rest);
                            (calls, rest.trim().is_empty())
                        })
                        .filter(|(calls, _)| !calls.is_empty())
                    {
                        Some((calls, complete)) => json!({
                            "index": i,
                            "message": {"role": "assistant", "content": null,
                                        "tool_calls": self.tool_calls_json(i, &calls, 0)},
                            "logprobs": logprobs,
                            "finish_reason": if complete { "tool_calls" } else { finish_str(c.finish) },
                        }),
                        None => json!({
                            "index": i,
                            "message": {"role": "assistant", "content": c.text},
                            "logprobs": logprobs,
                            "finish_reason": finish_str(c.finish),
                        }),
                    },
                }
            })
            .collect();
        json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage_many(cs.iter(), n),
        })
    }

    /// Usage of several choices (`n` per prompt, prompts in order):
    /// speculation figures summed, prompt tokens counted once per prompt.
    fn usage_many<'a>(&self, cs: impl Iterator<Item = &'a Completion> + Clone, n: usize) -> Value {
        let mut stats = crate::speculative::SpecStats::default();
        for c in cs.clone() {
            stats.add(&c.stats);
        }
        stats.proposer = cs
            .clone()
            .next()
            .map(|c| c.stats.proposer.clone())
            .unwrap_or_default();
        let prompt: usize = cs.clone().step_by(n.max(1)).map(|c| c.prompt_tokens).sum();
        let completion: usize = if self.echo.as_ref().is_some_and(|e| e.drop_generated) {
            0
        } else {
            cs.map(|c| c.tokens.len()).sum()
        };
        usage_of(prompt, completion, &stats)
    }
}

/// Aborts the request when dropped before it finished (client gone).
pub(super) struct AbortGuard {
    pub(super) engine: EngineHandle,
    pub(super) id: SeqId,
    pub(super) armed: bool,
    /// The request's share of its client's limits, given back when the
    /// last of its choices' guards goes.
    pub(super) _lease: std::sync::Arc<super::limits::Lease>,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            metrics::counter!("specd_client_disconnects_total").increment(1);
            self.engine.scheduler.do_send(Abort(self.id));
        }
    }
}

/// One request's part of an event stream (one choice).
pub(super) struct Part {
    rx: UnboundedReceiver<Event>,
    guard: AbortGuard,
    first: bool,
    done: bool,
    /// Its completion, once finished (for `include_usage`'s totals).
    completion: Option<Completion>,
    /// Characters of this choice's tokens so far (completions' text_offset).
    offset: usize,
    /// Tools offered: what the output is, text held back until that is
    /// known (or until a call block completes), calls sent so far.
    tool_mode: ToolMode,
    tool_buf: String,
    /// The held tokens' logprobs: they go out with the chunk that sends
    /// the held text or the calls it completes, so the streamed lists add
    /// up to the whole response's.
    tool_lps: Vec<TokenLogprob>,
    calls_sent: usize,
}

/// Server-sent events for one request, or for several prompts of one
/// request (a choice each, indexed in order; events interleave as they
/// come). `[DONE]` follows the last choice's final chunk, also when the
/// engine drops a choice without a result (that choice gets an error
/// chunk). Each final chunk carries its choice's usage; with
/// `stream_options.include_usage` instead, every chunk's `usage` is null
/// and one chunk with no choices and the request's usage precedes
/// `[DONE]` (OpenAI's shape).
pub(super) struct SseStream {
    parts: Vec<Part>,
    shape: Shape,
    /// Choices per prompt.
    n: usize,
    include_usage: bool,
    /// Where the next poll starts, so no choice starves the others.
    next: usize,
    done: bool,
    /// Silence after which a `: keep-alive` comment goes out, and the
    /// timer that runs from the last bytes sent.
    keepalive: Option<(std::time::Duration, Pin<Box<tokio::time::Sleep>>)>,
}

impl SseStream {
    pub(super) fn new(
        parts: Vec<(UnboundedReceiver<Event>, AbortGuard)>,
        shape: Shape,
        n: usize,
        include_usage: bool,
    ) -> Self {
        Self {
            parts: parts
                .into_iter()
                .map(|(rx, guard)| Part {
                    rx,
                    guard,
                    first: true,
                    done: false,
                    completion: None,
                    offset: 0,
                    tool_mode: if shape.tools {
                        ToolMode::Undecided
                    } else {
                        ToolMode::Text
                    },
                    tool_buf: String::new(),
                    tool_lps: Vec::new(),
                    calls_sent: 0,
                })
                .collect(),
            shape,
            n,
            include_usage,
            next: 0,
            done: false,
            keepalive: None,
        }
    }

    /// Send an SSE comment after `every` without other bytes (zero: never).
    pub(super) fn keepalive(mut self, every: std::time::Duration) -> Self {
        // Longer than a day is as good as never, and keeps the timer's
        // deadline arithmetic far from overflow.
        let every = every.min(std::time::Duration::from_secs(86_400));
        self.keepalive = (!every.is_zero()).then(|| (every, Box::pin(tokio::time::sleep(every))));
        self
    }

    /// Restart the keep-alive timer (bytes just went out).
    fn sent(&mut self) {
        if let Some((every, sleep)) = &mut self.keepalive {
            sleep.as_mut().reset(tokio::time::Instant::now() + *every);
        }
    }

    /// Choice `i` ends with an error event of `kind` (`[DONE]` follows if
    /// it was the last).
    fn choice_error(
        &mut self,
        i: usize,
        message: String,
        kind: &str,
    ) -> Poll<Option<Result<Bytes, actix_web::Error>>> {
        let part = &mut self.parts[i];
        part.done = true;
        part.guard.armed = false;
        self.next = (i + 1) % self.parts.len();
        let v = json!({"error": {"message": message, "type": kind, "param": null, "code": null, "index": i}});
        self.frame(v)
    }

    fn frame(&mut self, mut v: Value) -> Poll<Option<Result<Bytes, actix_web::Error>>> {
        if self.include_usage && v.get("choices").is_some() {
            v["usage"] = Value::Null;
        }
        let mut s = format!("data: {v}\n\n");
        if self.parts.iter().all(|p| p.done) {
            self.done = true;
            if self.include_usage {
                let usage = self.shape.usage_many(
                    self.parts.iter().filter_map(|p| p.completion.as_ref()),
                    self.n,
                );
                let last = json!({
                    "id": self.shape.id,
                    "object": if self.shape.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
                    "created": self.shape.created,
                    "model": self.shape.model,
                    "choices": [],
                    "usage": usage,
                });
                s.push_str(&format!("data: {last}\n\n"));
            }
            s.push_str("data: [DONE]\n\n");
        }
        Poll::Ready(Some(Ok(Bytes::from(s))))
    }
}

impl futures_core::Stream for SseStream {
    type Item = Result<Bytes, actix_web::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = self.as_mut().poll_events(cx);
        if !matches!(polled, Poll::Pending) {
            self.sent();
            return polled;
        }
        let quiet = match &mut self.keepalive {
            Some((_, sleep)) => sleep.as_mut().poll(cx).is_ready(),
            None => false,
        };
        if quiet {
            self.sent();
            return Poll::Ready(Some(Ok(Bytes::from_static(b": keep-alive\n\n"))));
        }
        Poll::Pending
    }
}

impl SseStream {
    fn poll_events(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, actix_web::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let n = self.parts.len();
        for k in 0..n {
            let i = (self.next + k) % n;
            loop {
                let part = &mut self.parts[i];
                if part.done {
                    break;
                }
                match part.rx.poll_recv(cx) {
                    Poll::Pending => break,
                    Poll::Ready(Some(Event::Tokens { text, logprobs, .. }))
                        if part.tool_mode != ToolMode::Text =>
                    {
                        // Tools offered: hold text until the output shows
                        // whether it is calls; send each call whole.
                        part.tool_buf.push_str(&text);
                        part.tool_lps.extend(logprobs);
                        if part.tool_mode == ToolMode::Undecided {
                            match crate::structured::tools::is_calls(&part.tool_buf) {
                                None => continue,
                                Some(true) => part.tool_mode = ToolMode::Calls,
                                Some(false) => {
                                    part.tool_mode = ToolMode::Text;
                                    let held = std::mem::take(&mut part.tool_buf);
                                    let lps = std::mem::take(&mut part.tool_lps);
                                    let first = std::mem::replace(&mut part.first, false);
                                    self.next = (i + 1) % n;
                                    let v =
                                        self.shape.chunk(i, &held, None, None, first, &lps, &mut 0);
                                    return self.frame(v);
                                }
                            }
                        }
                        let calls =
                            crate::structured::tools::take_complete_calls(&mut part.tool_buf);
                        if calls.is_empty() {
                            continue;
                        }
                        let start = part.calls_sent;
                        part.calls_sent += calls.len();
                        let first = std::mem::replace(&mut part.first, false);
                        // The logprobs of every token held so far (the
                        // next call's first tokens may be among them).
                        let lps = std::mem::take(&mut part.tool_lps);
                        self.next = (i + 1) % n;
                        let mut delta =
                            json!({"tool_calls": self.shape.tool_calls_json(i, &calls, start)});
                        if first {
                            delta["role"] = json!("assistant");
                            delta["content"] = Value::Null;
                        }
                        let mut v = self.shape.delta_chunk(i, delta, None, None);
                        v["choices"][0]["logprobs"] = self.shape.logprobs_json(&lps, &mut 0);
                        return self.frame(v);
                    }
                    Poll::Ready(Some(Event::Tokens { text, logprobs, .. })) => {
                        if text.is_empty() && logprobs.is_empty() && !part.first {
                            continue;
                        }
                        let first = std::mem::replace(&mut part.first, false);
                        let mut offset = part.offset;
                        self.next = (i + 1) % n;
                        let v =
                            self.shape
                                .chunk(i, &text, None, None, first, &logprobs, &mut offset);
                        self.parts[i].offset = offset;
                        return self.frame(v);
                    }
                    Poll::Ready(Some(Event::Finished(c))) => {
                        part.done = true;
                        part.guard.armed = false;
                        let first = part.first;
                        // Tools: calls end with `tool_calls`; text held
                        // back (an unfinished block, cut by max_tokens)
                        // goes out as content.
                        let finish = if part.calls_sent > 0 && part.tool_buf.trim().is_empty() {
                            "tool_calls"
                        } else {
                            finish_str(c.finish)
                        };
                        // An unfinished call after complete ones is dropped;
                        // with none complete, what came is sent as text.
                        let held = if part.tool_mode == ToolMode::Text || part.calls_sent > 0 {
                            String::new()
                        } else {
                            std::mem::take(&mut part.tool_buf)
                        };
                        // Tokens held and not yet sent (an unfinished call
                        // or text) keep their logprobs in the last chunk.
                        let lps = std::mem::take(&mut part.tool_lps);
                        self.next = (i + 1) % n;
                        let v = self.shape.chunk(
                            i,
                            &held,
                            Some(finish),
                            Some(usage(&c)),
                            first,
                            &lps,
                            &mut 0,
                        );
                        self.parts[i].completion = Some(c);
                        return self.frame(v);
                    }
                    Poll::Ready(Some(Event::Error(e))) => {
                        return self.choice_error(i, e, "server_error");
                    }
                    Poll::Ready(Some(Event::Rejected(e))) => {
                        return self.choice_error(i, e, "invalid_request_error");
                    }
                    Poll::Ready(None) => {
                        // The engine dropped the channel without a final
                        // event: this choice ends here, with an error the
                        // client can see (and `[DONE]` if it was the last).
                        return self.choice_error(
                            i,
                            "the engine stopped before this choice finished".into(),
                            "server_error",
                        );
                    }
                }
            }
        }
        Poll::Pending
    }
}
