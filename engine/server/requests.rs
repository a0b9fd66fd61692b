//! Request bodies: serde types for `/v1/completions` and
//! `/v1/chat/completions`, and their validation into an engine `Request`.
//!
//! Invariants:
//! - Every error names its field (`param`), with a message that says what
//!   the field must be and what it got; paths come from
//!   `serde_path_to_error` (`messages[0].role`, `speculation.max_draft`).
//! - Unknown top-level fields are accepted (clients send extras); inside
//!   our own `speculation` object they are refused.
//! - Nothing reaches the engine unvalidated: sampling parameters, stop
//!   strings, the context limit and the proposer are all checked here.

use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::web::Bytes;
use serde::de::{self, Deserializer, Unexpected, Visitor};
use serde::Deserialize;
use serde_json::Value;

use super::errors::ApiError;
use super::AppState;
use crate::sampler::SamplingParams;
use crate::speculative::Request;
use crate::structured::Constraint;
use crate::tokenizer::ChatMessage;

// ------------------------------------------------------------ field types

/// Defines a newtype whose deserializer says, on a wrong value, what the
/// field must be (`$expect`): `visit_*` methods it does not list refuse the
/// value with serde's `invalid_type`.
macro_rules! field_type {
    ($name:ident, $t:ty, $expect:literal, { $($visit:item)* }) => {
        #[derive(Debug, Clone, Copy)]
        pub struct $name(pub $t);

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl<'de> Visitor<'de> for V {
                    type Value = $name;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str($expect)
                    }
                    $($visit)*
                }
                d.deserialize_any(V)
            }
        }
    };
}

field_type!(Num, f64, "a finite number", {
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Num, E> {
        if v.is_finite() {
            Ok(Num(v))
        } else {
            Err(E::invalid_value(Unexpected::Float(v), &self))
        }
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Num, E> {
        Ok(Num(v as f64))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Num, E> {
        Ok(Num(v as f64))
    }
});

field_type!(UInt, u64, "a non-negative integer", {
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<UInt, E> {
        Ok(UInt(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<UInt, E> {
        u64::try_from(v)
            .map(UInt)
            .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
    }
});

field_type!(TopK, usize, "a non-negative integer or -1", {
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<TopK, E> {
        Ok(TopK(v as usize))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<TopK, E> {
        match v {
            -1 => Ok(TopK(0)),
            v if v >= 0 => Ok(TopK(v as usize)),
            v => Err(E::invalid_value(Unexpected::Signed(v), &self)),
        }
    }
});

field_type!(Flag, bool, "a boolean", {
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Flag, E> {
        Ok(Flag(v))
    }
});

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `prompt` on `/v1/completions`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string, a list of strings, or token ids")]
pub enum Prompt {
    Text(String),
    Batch(Vec<Value>),
}

/// Our extension: the proposer and draft cap for this request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Speculation {
    pub proposer: Option<String>,
    pub max_draft: Option<UInt>,
}

/// OpenAI's `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// A last chunk before `[DONE]` with no choices and the request's
    /// usage; every other chunk's `usage` is null.
    pub include_usage: Option<Flag>,
}

/// The fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub n: Option<UInt>,
    pub best_of: Option<UInt>,
    pub logprobs: Option<Value>,
    pub echo: Option<Flag>,
    pub stream: Option<Flag>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<UInt>,
    pub max_completion_tokens: Option<UInt>,
    pub temperature: Option<Num>,
    pub top_p: Option<Num>,
    pub top_k: Option<TopK>,
    pub min_p: Option<Num>,
    pub presence_penalty: Option<Num>,
    pub frequency_penalty: Option<Num>,
    pub repetition_penalty: Option<Num>,
    pub seed: Option<UInt>,
    pub stop: Option<Stop>,
    pub ignore_eos: Option<Flag>,
    pub speculation: Option<Speculation>,
    /// Scheduling priority (vLLM's field): an integer, lower runs first.
    pub priority: Option<Value>,
    /// Constraints on the output (`constraints.rs`): OpenAI's
    /// `response_format`, vLLM's `structured_outputs` and its older
    /// `guided_*` fields.
    pub response_format: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub guided_choice: Option<Value>,
    // Fields this server does not implement: accepted only when they ask
    // for nothing (null, empty, or the default), else a 400 naming them.
    pub top_logprobs: Option<Value>,
    pub logit_bias: Option<Value>,
    /// Chat only (`tools.rs`).
    pub tools: Option<Value>,
    pub parallel_tool_calls: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub suffix: Option<Value>,
    // vLLM's and OpenAI's further fields, refused unless they ask for this
    // server's behaviour (see `unimplemented_fields`).
    pub min_tokens: Option<Value>,
    pub stop_token_ids: Option<Value>,
    pub include_stop_str_in_output: Option<Value>,
    pub skip_special_tokens: Option<Value>,
    pub chat_template_kwargs: Option<Value>,
    pub add_generation_prompt: Option<Value>,
    pub continue_final_message: Option<Value>,
    pub prediction: Option<Value>,
    pub modalities: Option<Value>,
    pub audio: Option<Value>,
    pub allowed_token_ids: Option<Value>,
    pub bad_words: Option<Value>,
    pub use_beam_search: Option<Value>,
    pub length_penalty: Option<Value>,
    pub truncate_prompt_tokens: Option<Value>,
    pub prompt_logprobs: Option<Value>,
    pub guided_whitespace_pattern: Option<Value>,
    pub spaces_between_special_tokens: Option<Value>,
    pub return_tokens_as_token_ids: Option<Value>,
}

/// `min_tokens` (vLLM's): a count of tokens, null or absent for 0 (the
/// request's validation checks it against `max_tokens`).
pub(super) fn min_tokens(v: Option<&Value>) -> Result<usize, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(0),
        Some(x) => x
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| {
                ApiError::bad_field(
                    "min_tokens",
                    format!("`min_tokens` must be a non-negative integer, got {x}"),
                )
            }),
    }
}

/// `stop_token_ids` (vLLM's): token ids of this model, at most 64.
fn stop_token_ids(v: Option<&Value>, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let field = "stop_token_ids";
    let items = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) if a.len() <= 64 => a,
        Some(Value::Array(a)) => {
            return Err(ApiError::bad_field(
                field,
                format!("at most 64 stop token ids, got {}", a.len()),
            ))
        }
        Some(other) => {
            return Err(ApiError::bad_field(
                field,
                format!(
                    "`stop_token_ids` must be a list of token ids, got {}",
                    type_name(other)
                ),
            ))
        }
    };
    items
        .iter()
        .map(|x| {
            x.as_u64()
                .filter(|&id| (id as usize) < vocab)
                .map(|id| id as u32)
                .ok_or_else(|| {
                    ApiError::bad_field(
                        field,
                        format!("{x} is not a token id of this model (0..{vocab})"),
                    )
                })
        })
        .collect()
}

/// Longest stop string (bytes): every generated token is checked against
/// every stop string, so their length is the per-token cost.
pub const MAX_STOP_BYTES: usize = 1024;

/// `logit_bias`: an object from token ids (as strings, OpenAI's shape) to
/// biases; each id must be in the vocabulary.
fn logit_bias(v: Option<&Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(ApiError::bad_field(
                "logit_bias",
                format!("`logit_bias` must be an object from token ids to biases, got {other}"),
            ))
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, b) in map {
        let field = format!("logit_bias.{k}");
        let id = k
            .parse::<u32>()
            .ok()
            .filter(|&id| (id as usize) < vocab)
            .ok_or_else(|| {
                ApiError::bad_field(
                    &field,
                    format!("`{k}` is not a token id of this model (0..{vocab})"),
                )
            })?;
        let b = b.as_f64().ok_or_else(|| {
            ApiError::bad_field(&field, format!("the bias must be a number, got {b}"))
        })?;
        out.push((id, b as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(ApiError::bad_field(
            "logit_bias",
            format!(
                "token id {} appears more than once (keys that spell the same id, such as \"5\" and \"05\")",
                w[0].0
            ),
        ));
    }
    Ok(out)
}

/// Alternatives per token if the request wants logprobs: chat's
/// `logprobs: true` with `top_logprobs` (0-20), or completions'
/// `logprobs: N` (0-20).
fn logprobs_wanted(c: &Common) -> Result<Option<usize>, ApiError> {
    let max = crate::speculative::MAX_TOP_LOGPROBS;
    let top = match &c.top_logprobs {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if n as usize <= max => Some(n as usize),
            _ => {
                return Err(ApiError::bad_field(
                    "top_logprobs",
                    format!("`top_logprobs` must be an integer from 0 to {max}, got {v}"),
                ))
            }
        },
    };
    let want = match &c.logprobs {
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => Some(top.unwrap_or(0)),
        Some(v) => match v.as_u64() {
            Some(n) if n as usize <= max => Some(n as usize),
            _ => {
                return Err(ApiError::bad_field(
                    "logprobs",
                    format!(
                        "`logprobs` must be true/false (chat) or an integer from 0 to {max} (completions), got {v}"
                    ),
                ))
            }
        },
    };
    if want.is_none() && top.is_some_and(|t| t > 0) {
        return Err(ApiError::bad_field(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        ));
    }
    Ok(want)
}

/// The fields a request may send only with their do-nothing values, each
/// with what it asked for when it asks for more.
fn unimplemented_fields(c: &Common) -> Result<(), ApiError> {
    let empty = |v: &Value| match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    };
    type Allowed<'a> = &'a dyn Fn(&Value) -> bool;
    let is = |want: bool| move |v: &Value| v.is_null() || v.as_bool() == Some(want);
    let checks: [(&str, &Option<Value>, Allowed); 20] = [
        ("functions", &c.functions, &empty),
        ("function_call", &c.function_call, &|v| {
            empty(v) || v.as_str() == Some("none")
        }),
        ("suffix", &c.suffix, &empty),
        (
            "include_stop_str_in_output",
            &c.include_stop_str_in_output,
            &is(false),
        ),
        ("skip_special_tokens", &c.skip_special_tokens, &is(true)),
        ("chat_template_kwargs", &c.chat_template_kwargs, &empty),
        ("add_generation_prompt", &c.add_generation_prompt, &is(true)),
        (
            "continue_final_message",
            &c.continue_final_message,
            &is(false),
        ),
        ("prediction", &c.prediction, &empty),
        ("modalities", &c.modalities, &|v| {
            empty(v) || *v == serde_json::json!(["text"])
        }),
        ("audio", &c.audio, &empty),
        ("allowed_token_ids", &c.allowed_token_ids, &empty),
        ("bad_words", &c.bad_words, &empty),
        ("use_beam_search", &c.use_beam_search, &is(false)),
        ("length_penalty", &c.length_penalty, &|v| {
            v.is_null() || v.as_f64() == Some(1.0)
        }),
        ("truncate_prompt_tokens", &c.truncate_prompt_tokens, &empty),
        ("prompt_logprobs", &c.prompt_logprobs, &empty),
        (
            "guided_whitespace_pattern",
            &c.guided_whitespace_pattern,
            &empty,
        ),
        (
            "spaces_between_special_tokens",
            &c.spaces_between_special_tokens,
            &is(true),
        ),
        (
            "return_tokens_as_token_ids",
            &c.return_tokens_as_token_ids,
            &is(false),
        ),
    ];
    for (field, value, ok) in checks {
        if let Some(v) = value {
            if !ok(v) {
                let mut shown = v.to_string();
                if shown.len() > 60 {
                    let cut = (0..=60)
                        .rev()
                        .find(|&i| shown.is_char_boundary(i))
                        .unwrap_or(0);
                    shown.truncate(cut);
                    shown.push_str("...");
                }
                return Err(ApiError::bad_field(
                    field,
                    format!("`{field}` is not supported by this server (got {shown})"),
                ));
            }
        }
    }
    Ok(())
}

/// `/v1/completions`' own fields.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionBody {
    pub prompt: Prompt,
}

/// `/v1/chat/completions`' own fields.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatBody {
    pub messages: Vec<Message>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    /// Optional only for an assistant turn that made tool calls.
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's calls (OpenAI's shape: `id`, `type`,
    /// `function.name`, `function.arguments` as a JSON string).
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` turn's call id (accepted; results are matched by order).
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

/// Message content: a string, or text parts (`{"type": "text", "text": ...}`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or a list of text parts")]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    /// `"text"` (the only kind served; absent reads as text).
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// Required of a text part; optional here so that a part of another
    /// kind (an `image_url`) is refused by its kind, by name.
    pub text: Option<String>,
}

// ------------------------------------------------------------ parsing

pub(super) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The value at a `serde_path_to_error` path (`a.b[2].c`), if present.
fn lookup<'a>(root: &'a Value, path: &str) -> Option<&'a Value> {
    let mut v = root;
    if path == "." || path.is_empty() {
        return Some(v);
    }
    for part in path.split('.') {
        let (key, idx) = match part.find('[') {
            Some(i) => (&part[..i], Some(&part[i..])),
            None => (part, None),
        };
        if !key.is_empty() {
            v = v.get(key)?;
        }
        if let Some(idx) = idx {
            for n in idx.split(['[', ']']).filter(|s| !s.is_empty()) {
                v = v.get(n.parse::<usize>().ok()?)?;
            }
        }
    }
    Some(v)
}

fn join(path: &str, field: &str) -> String {
    if path == "." || path.is_empty() {
        field.to_string()
    } else if path == field || path.ends_with(&format!(".{field}")) {
        // serde_path_to_error already entered the key.
        path.to_string()
    } else {
        format!("{path}.{field}")
    }
}

/// Deserialize `T` from `body`, turning the first error into a 400 that
/// names the field, what it must be and what it got.
pub fn from_body<T: serde::de::DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize::<_, T>(body).map_err(|e| {
        let path = e.path().to_string();
        let msg = e.inner().to_string();
        let quoted = |rest: &str| rest.split('`').next().unwrap_or("").to_string();
        if let Some(rest) = msg.strip_prefix("missing field `") {
            let param = join(&path, &quoted(rest));
            return ApiError::bad_field(&param, format!("missing required field `{param}`"));
        }
        if let Some(rest) = msg.strip_prefix("unknown field `") {
            let param = join(&path, &quoted(rest));
            return ApiError::bad_field(&param, format!("unknown field `{param}`"));
        }
        let expected = msg.rsplit("expected ").next().unwrap_or(&msg);
        let got = lookup(body, &path).map(type_name).unwrap_or("nothing");
        let detail = match lookup(body, &path) {
            Some(Value::Number(n)) => format!("{got} ({n})"),
            _ => got.to_string(),
        };
        ApiError::bad_field(&path, format!("`{path}` must be {expected}, got {detail}"))
    })
}

/// Parse a body as a JSON object.
pub fn body_object(body: &Bytes) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_field("", format!("request body is not valid JSON: {e}")))?;
    match v {
        Value::Object(_) => Ok(v),
        other => Err(ApiError::bad_field(
            "",
            format!(
                "request body must be a JSON object, got {}",
                type_name(&other)
            ),
        )),
    }
}

/// The prompt text of a completions body (one string; a list of one string
/// is accepted as that string).
/// One prompt of `/v1/completions`: text, or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptIn {
    Text(String),
    Ids(Vec<u32>),
}

/// Most prompts in one batched completion request.
pub const MAX_BATCH_PROMPTS: usize = 64;

/// The prompts of a completion request in order: a string, a list of
/// strings, a list of token ids, or a list of token-id lists (OpenAI's four
/// shapes). Token ids must be in the vocabulary.
pub fn completion_prompts(b: CompletionBody, vocab: usize) -> Result<Vec<PromptIn>, ApiError> {
    let ids_of = |field: &str, v: &[Value]| -> Result<Vec<u32>, ApiError> {
        v.iter()
            .enumerate()
            .map(|(j, x)| {
                x.as_u64()
                    .filter(|&t| (t as usize) < vocab)
                    .map(|t| t as u32)
                    .ok_or_else(|| {
                        ApiError::bad_field(
                            &format!("{field}[{j}]"),
                            format!("`{field}[{j}]` must be a token id below {vocab}, got {x}"),
                        )
                    })
            })
            .collect()
    };
    let list = match b.prompt {
        Prompt::Text(s) => return Ok(vec![PromptIn::Text(s)]),
        Prompt::Batch(v) => v,
    };
    if list.is_empty() {
        return Err(ApiError::bad_field("prompt", "`prompt` must not be empty"));
    }
    if list.iter().all(Value::is_number) {
        return Ok(vec![PromptIn::Ids(ids_of("prompt", &list)?)]);
    }
    if list.len() > MAX_BATCH_PROMPTS {
        return Err(ApiError::bad_field(
            "prompt",
            format!(
                "{} prompts in one request; at most {MAX_BATCH_PROMPTS}",
                list.len()
            ),
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, x)| match x {
            Value::String(s) => Ok(PromptIn::Text(s.clone())),
            Value::Array(a) => Ok(PromptIn::Ids(ids_of(&format!("prompt[{i}]"), a)?)),
            other => Err(ApiError::bad_field(
                &format!("prompt[{i}]"),
                format!(
                    "`prompt[{i}]` must be a string or a list of token ids, got {}",
                    type_name(other)
                ),
            )),
        })
        .collect()
}

/// Chat messages for the template, each role checked. With `native`
/// (the model's template handles tools: `Tokenizer::native_tool_template`)
/// an assistant turn's calls stay `tool_calls` (arguments parsed to an
/// object, as Hugging Face templates expect) and a `tool` turn stays one,
/// with its `tool_call_id` and `name`; otherwise both are written into
/// the text in the documented format (`structured::tools`).
pub fn chat_messages(b: ChatBody, native: bool) -> Result<Vec<ChatMessage>, ApiError> {
    if b.messages.is_empty() {
        return Err(ApiError::bad_field(
            "messages",
            "`messages` must not be empty",
        ));
    }
    b.messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let field = format!("messages[{i}].role");
            let content = match m.content {
                Some(Content::Text(s)) => Some(s),
                Some(Content::Parts(p)) => {
                    if let Some((j, k)) = p.iter().enumerate().find_map(|(j, p)| {
                        p.kind.as_deref().filter(|k| *k != "text").map(|k| (j, k))
                    }) {
                        let f = format!("messages[{i}].content[{j}].type");
                        return Err(ApiError::bad_field(
                            &f,
                            format!("only text parts are supported, got `{k}`"),
                        ));
                    }
                    let mut text = String::new();
                    for (j, part) in p.into_iter().enumerate() {
                        let Some(t) = part.text else {
                            let f = format!("messages[{i}].content[{j}].text");
                            return Err(ApiError::bad_field(&f, format!("`{f}` is required")));
                        };
                        text.push_str(&t);
                    }
                    Some(text)
                }
                None => None,
            };
            let need_content = || {
                let f = format!("messages[{i}].content");
                ApiError::bad_field(&f, format!("`{f}` is required"))
            };
            let (role, content) = match m.role.as_str() {
                "system" | "user" => (m.role, content.ok_or_else(need_content)?),
                "developer" => ("system".into(), content.ok_or_else(need_content)?),
                "assistant" => {
                    let calls = m.tool_calls.unwrap_or_default();
                    if content.is_none() && calls.is_empty() {
                        return Err(need_content());
                    }
                    let mut text = content.unwrap_or_default();
                    let mut native_calls = Vec::new();
                    for (k, c) in calls.iter().enumerate() {
                        let f = format!("messages[{i}].tool_calls[{k}].function");
                        let name = c["function"]["name"].as_str();
                        let args = c["function"]["arguments"]
                            .as_str()
                            .and_then(|a| serde_json::from_str::<Value>(a).ok())
                            .filter(Value::is_object);
                        let (Some(name), Some(args)) = (name, args) else {
                            return Err(ApiError::bad_field(
                                &f,
                                format!("`{f}` needs a `name` and `arguments` (a JSON object as a string)"),
                            ));
                        };
                        if native {
                            let id = c["id"].as_str().map_or_else(|| format!("call_{k}"), str::to_string);
                            native_calls.push(serde_json::json!({"id": id, "type": "function",
                                "function": {"name": name, "arguments": args}}));
                            continue;
                        }
                        // Earlier calls, in the format the model writes them.
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(&crate::structured::tools::render_call(name, &args));
                    }
                    return Ok(ChatMessage {
                        tool_calls: (!native_calls.is_empty()).then(|| Value::Array(native_calls)),
                        ..ChatMessage::new(m.role, text)
                    });
                }
                // A tool's result: the template's own `tool` turn, or a
                // user turn as the documented format has it.
                "tool" if native => {
                    return Ok(ChatMessage {
                        tool_call_id: m.tool_call_id,
                        name: m.name,
                        ..ChatMessage::new("tool", content.ok_or_else(need_content)?)
                    })
                }
                "tool" => (
                    "user".into(),
                    crate::structured::tools::render_result(&content.ok_or_else(need_content)?),
                ),
                other => {
                    return Err(ApiError::bad_field(
                        &field,
                        format!("`{field}` = `{other}` is not supported (system, user, assistant, developer, tool)"),
                    ))
                }
            };
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

/// What both endpoints share once validated.
pub struct Parsed {
    pub req: Request,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Choices to generate for the prompt (`n`).
    pub n: usize,
    /// The model is offered tools: its output may be calls.
    pub tools: bool,
}

/// Most choices per prompt (`n`).
pub const MAX_N: usize = 16;

fn rand_seed() -> u64 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    (t as u64) ^ 0x9E37_79B9_7F4A_7C15
}

/// Validate the fields both endpoints share into an engine request for
/// `prompt`.
pub fn validate(c: Common, st: &AppState, prompt: Vec<u32>) -> Result<Parsed, ApiError> {
    validate_with(c, st, prompt, &mut None)
}

/// The request's constraint and whether tools are active, compiled once
/// for all the prompts of a request (`validate_with`).
pub type Shaping = Option<(Option<Constraint>, Option<super::tools::ToolSetup>)>;

/// [`validate`] for one of several prompts sharing `c`: the constraint is
/// compiled for the first and reused by the rest (a schema or grammar
/// compiles in milliseconds, on an HTTP worker).
pub fn validate_with(
    c: Common,
    st: &AppState,
    prompt: Vec<u32>,
    shaping: &mut Shaping,
) -> Result<Parsed, ApiError> {
    let stream = c.stream.is_some_and(|s| s.0);
    let include_usage = match &c.stream_options {
        Some(_) if !stream => {
            return Err(ApiError::bad_field(
                "stream_options",
                "`stream_options` is only allowed when `stream` is true",
            ))
        }
        Some(o) => o.include_usage.is_some_and(|f| f.0),
        None => false,
    };
    if let Some(m) = &c.model {
        if *m != st.model_name {
            return Err(ApiError::model_not_found(m, &st.model_name));
        }
    }
    unimplemented_fields(&c)?;
    let n = match c.n {
        None => 1,
        Some(UInt(k)) if (1..=MAX_N as u64).contains(&k) => k as usize,
        Some(UInt(k)) => {
            return Err(ApiError::bad_field(
                "n",
                format!("`n` must be from 1 to {MAX_N}, got {k}"),
            ))
        }
    };
    if c.best_of.is_some_and(|n| n.0 != 1) {
        return Err(ApiError::bad_field(
            "best_of",
            "only best_of = 1 is supported",
        ));
    }
    let logprobs = logprobs_wanted(&c)?;
    if c.echo.is_some_and(|e| e.0) {
        return Err(ApiError::bad_field(
            "echo",
            "`echo` is only offered on /v1/completions",
        ));
    }
    let room = st.max_seq_len.saturating_sub(prompt.len());
    if let (Some(UInt(a)), Some(UInt(b))) = (c.max_tokens, c.max_completion_tokens) {
        if a != b {
            return Err(ApiError::bad_field(
                "max_completion_tokens",
                format!("`max_tokens` ({a}) and `max_completion_tokens` ({b}) disagree: give one"),
            ));
        }
    }
    let max_tokens = match c.max_tokens.or(c.max_completion_tokens) {
        Some(UInt(0)) => {
            return Err(ApiError::bad_field(
                "max_tokens",
                "`max_tokens` must be at least 1",
            ))
        }
        Some(UInt(m)) => m as usize,
        None => room.min(256),
    };
    if prompt.len().saturating_add(max_tokens) > st.max_seq_len {
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
    // The constraint compiles (on an HTTP worker) only for a request whose
    // cheap fields are valid.
    let (constraint, tools) = match shaping {
        Some(done) => done.clone(),
        None => shaping.insert(shape(&c, st)?).clone(),
    };
    let d = SamplingParams::default();
    let f = |x: Option<Num>, default: f32| x.map(|n| n.0 as f32).unwrap_or(default);
    let params = SamplingParams {
        temperature: f(c.temperature, 1.0),
        top_p: f(c.top_p, d.top_p),
        top_k: c.top_k.map(|k| k.0).unwrap_or(0),
        min_p: f(c.min_p, d.min_p),
        presence_penalty: f(c.presence_penalty, 0.0),
        frequency_penalty: f(c.frequency_penalty, 0.0),
        repetition_penalty: f(c.repetition_penalty, 1.0),
        seed: c.seed.map(|s| s.0).unwrap_or_else(rand_seed),
        logit_bias: logit_bias(c.logit_bias.as_ref(), st.vocab())?,
    };
    params.validate().map_err(ApiError::from)?;
    let stop = match c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) if v.len() > 16 => {
            return Err(ApiError::bad_field("stop", "at most 16 stop strings"))
        }
        Some(Stop::Many(v)) => v,
    };
    if let Some(i) = stop.iter().position(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad_field(
            "stop",
            format!(
                "stop string {i} is {} bytes long; at most {MAX_STOP_BYTES}",
                stop[i].len()
            ),
        ));
    }
    let priority = match &c.priority {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| {
                ApiError::bad_field(
                    "priority",
                    format!(
                        "`priority` must be an integer from {} to {} (lower runs first), got {}",
                        i32::MIN,
                        i32::MAX,
                        if v.is_number() {
                            v.to_string()
                        } else {
                            type_name(v).to_string()
                        }
                    ),
                )
            })?,
    };
    let spec = c.speculation.unwrap_or_default();
    let config = st.config();
    if priority < config.server.min_priority {
        return Err(ApiError::bad_field(
            "priority",
            format!(
                "`priority` {priority} runs ahead of what this server allows (at least {}, `[server] min_priority`)",
                config.server.min_priority
            ),
        ));
    }
    let mut proposer = None;
    if let Some(p) = spec.proposer {
        if !config.server.allow_request_proposer {
            return Err(ApiError::bad_field(
                "speculation.proposer",
                "this server does not allow choosing the proposer per request",
            ));
        }
        let names = st.proposers();
        if p != "none" && !names.contains(&p) {
            return Err(ApiError::bad_field(
                "speculation.proposer",
                format!(
                    "unknown proposer `{p}` (available: none, {})",
                    names.join(", ")
                ),
            ));
        }
        proposer = Some(p);
    }
    // Precedence: the request's own choice, then a weighted traffic split,
    // then the model's route (or the engine default).
    let (proposer, arm) = match proposer {
        Some(p) => (p, None),
        None => match pick_split(st, &config) {
            Some(sp) => (sp.proposer.clone(), Some(sp.name.clone())),
            None => (config.route(&st.model_name).to_string(), None),
        },
    };
    Ok(Parsed {
        req: Request {
            prompt,
            params,
            max_tokens,
            stop,
            ignore_eos: c.ignore_eos.is_some_and(|f| f.0),
            stop_token_ids: stop_token_ids(c.stop_token_ids.as_ref(), st.vocab())?,
            min_tokens: min_tokens(c.min_tokens.as_ref())?,
            proposer: Some(proposer),
            max_draft: spec.max_draft.map(|m| m.0 as usize),
            arm,
            logprobs,
            fork_of: None,
            prompt_logprobs: None,
            priority,
            group: None,
            constraint,
            forced_drafts: true,
        },
        stream,
        include_usage,
        n,
        tools: tools.is_some(),
    })
}

/// The constraint `c` asks for (`response_format`, vLLM's fields, or its
/// active tools' call grammar), compiled, and its active tools.
fn shape(
    c: &Common,
    st: &AppState,
) -> Result<(Option<Constraint>, Option<super::tools::ToolSetup>), ApiError> {
    let tools = super::tools::parse(
        c.tools.as_ref(),
        c.tool_choice.as_ref(),
        c.parallel_tool_calls.as_ref(),
    )?;
    let mut constraint = super::constraints::constraint(c, st)?;
    let tools = tools.filter(|t| t.active());
    if let Some(t) = &tools {
        if constraint.is_some() {
            return Err(ApiError::bad_field(
                "tools",
                "`tools` and a `response_format` or `structured_outputs` constraint cannot both shape the output; send one",
            ));
        }
        if let Some(spec) = crate::structured::tools::grammar(&t.tools, &t.choice, t.parallel) {
            constraint = Some(super::constraints::compile(st, "tools", &spec)?);
        }
    }
    Ok((constraint, tools))
}

/// A weighted random traffic-split arm, if splits are configured.
fn pick_split<'c>(
    st: &AppState,
    config: &'c crate::config::Config,
) -> Option<&'c crate::config::Split> {
    let splits = &config.server.split;
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

/// Tokenize a completion prompt (special tokens as text unless `[server]
/// parse_special_tokens`; token ids are taken as given), checking it fits
/// the context.
pub fn encode(st: &AppState, prompt: &PromptIn) -> Result<Vec<u32>, ApiError> {
    let ids = match prompt {
        PromptIn::Ids(ids) => ids.clone(),
        PromptIn::Text(text) if st.config().server.parse_special_tokens => {
            st.tokenizer.encode(text, true).map_err(ApiError::from)?
        }
        PromptIn::Text(text) => st
            .tokenizer
            .encode_text(text, true)
            .map_err(ApiError::from)?,
    };
    check_prompt(st, ids)
}

/// Tokenize chat messages with the model's template (message content as
/// text unless `[server] parse_special_tokens`), checking they fit.
pub fn encode_chat(
    st: &AppState,
    messages: &[ChatMessage],
    tools: Option<&Value>,
) -> Result<Vec<u32>, ApiError> {
    let ids = st
        .tokenizer
        .encode_chat_with_tools(
            messages,
            tools,
            true,
            st.config().server.parse_special_tokens,
        )
        .map_err(ApiError::from)?;
    check_prompt(st, ids)
}

fn check_prompt(st: &AppState, ids: Vec<u32>) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::bad_field("prompt", "prompt is empty"));
    }
    let vocab = st.vocab();
    if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_field(
            "prompt",
            format!("the tokenizer gave token id {t}, outside the model's vocabulary of {vocab}"),
        ));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn err<T: serde::de::DeserializeOwned + std::fmt::Debug>(v: Value) -> ApiError {
        from_body::<T>(&v).unwrap_err()
    }

    #[test]
    fn errors_name_the_field_what_it_must_be_and_what_it_got() {
        let e = err::<Common>(serde_json::json!({"temperature": "hot"}));
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert_eq!(
            e.message,
            "`temperature` must be a finite number, got a string"
        );
        let e = err::<Common>(serde_json::json!({"max_tokens": -3}));
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(
            e.message
                .contains("non-negative integer, got a number (-3)"),
            "{}",
            e.message
        );
        let e = err::<Common>(serde_json::json!({"stop": 7}));
        assert_eq!(
            e.message,
            "`stop` must be a string or a list of strings, got a number (7)"
        );
        let e = err::<Common>(serde_json::json!({"speculation": {"depth": 2}}));
        assert_eq!(e.param.as_deref(), Some("speculation.depth"));
        let e = err::<Common>(serde_json::json!({"speculation": {"max_draft": "x"}}));
        assert_eq!(e.param.as_deref(), Some("speculation.max_draft"));
        let e = err::<CompletionBody>(serde_json::json!({"max_tokens": 4}));
        assert_eq!(e.message, "missing required field `prompt`");
        let e = err::<ChatBody>(serde_json::json!({"messages": [{"role": "user", "content": 5}]}));
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        assert!(
            e.message.contains("a string or a list of text parts"),
            "{}",
            e.message
        );
        // Extra top-level fields are accepted.
        assert!(from_body::<Common>(&serde_json::json!({"user": "x", "top_k": -1})).is_ok());
    }
}
