//! Tool calls: function definitions rendered into the prompt, the grammar
//! that constrains a call, and the parser that reads calls back out.
//!
//! The format (Hermes', which Qwen and many fine-tunes use) is documented
//! for the model in a system message when its chat template has no tool
//! support of its own (SmolLM2's has none):
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! Calls made earlier in a conversation are rendered the same way in the
//! assistant's turn, and tool results as a user turn wrapped in
//! `<tool_response>`.
//!
//! Invariants:
//! - With `required` or a named function the output is constrained to one
//!   call (several with `parallel_tool_calls`), its `arguments` matching
//!   that function's parameter schema; with `auto`, to calls or to text
//!   that does not start with `<`; `none` renders no tools and constrains
//!   nothing.
//! - `parse_calls` accepts exactly what the grammar produces, so a
//!   constrained output always parses.

use serde_json::{json, Value};

use super::ConstraintSpec;

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

/// One function a request offers.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments object.
    pub parameters: Value,
}

/// What the model may do with the tools.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// One call read from the output.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments object as compact JSON text (OpenAI's `arguments`).
    pub arguments: String,
}

/// One tool as OpenAI (and Hugging Face chat templates) write it:
/// `{"type": "function", "function": {"name", "description", "parameters"}}`.
fn definition(t: &Tool) -> Value {
    let mut f = json!({"name": t.name});
    if let Some(d) = &t.description {
        f["description"] = json!(d);
    }
    f["parameters"] = t.parameters.clone();
    json!({"type": "function", "function": f})
}

/// The tools as a chat template's `tools` (a list of `definition`s).
pub fn definitions(tools: &[Tool]) -> Value {
    Value::Array(tools.iter().map(definition).collect())
}

/// The system text that documents the tools and the call format.
pub fn system_prompt(tools: &[Tool]) -> String {
    let mut s = String::from(
        "You can call functions to answer. The available functions, as JSON schemas:\n<tools>\n",
    );
    for t in tools {
        let mut f = json!({"name": t.name, "parameters": t.parameters});
        if let Some(d) = &t.description {
            f["description"] = json!(d);
        }
        s.push_str(&json!({"type": "function", "function": f}).to_string());
        s.push('\n');
    }
    s.push_str(
        "</tools>\nTo call a function, reply with only this, one block per call:\n\
         <tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n</tool_call>\n\
         Otherwise, answer in plain text.",
    );
    s
}

/// A call as the model writes it.
pub fn render_call(name: &str, arguments: &Value) -> String {
    format!(
        "{CALL_OPEN}\n{}\n{CALL_CLOSE}",
        json!({"name": name, "arguments": arguments})
    )
}

/// A tool result as the user turn that carries it.
pub fn render_result(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// The constraint for `choice` over `tools` (`None` for `ToolChoice::None`).
pub fn grammar(tools: &[Tool], choice: &ToolChoice, parallel: bool) -> Option<ConstraintSpec> {
    let offered: Vec<&Tool> = match choice {
        ToolChoice::None => return None,
        ToolChoice::Named(n) => tools.iter().filter(|t| &t.name == n).collect(),
        ToolChoice::Auto | ToolChoice::Required => tools.iter().collect(),
    };
    let branches: Vec<Value> = offered
        .iter()
        .map(|t| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    let body = json!({
        "anyOf": branches,
        "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
    });
    // A newline may follow the last call (chat models end a turn's last
    // line with one), so the turn can end there instead of starting
    // another call.
    let calls = if parallel {
        "call (\"\\n\" call)* \"\\n\"?"
    } else {
        "call \"\\n\"?"
    };
    let start = match choice {
        ToolChoice::Auto => "start: calls | TEXT",
        _ => "start: calls",
    };
    Some(ConstraintSpec::Lark(format!(
        "{start}\ncalls: {calls}\ncall: \"{open}\\n\" %json {body} \"\\n{close}\"\nTEXT: /[^<][\\s\\S]*/\n",
        open = CALL_OPEN,
        close = CALL_CLOSE,
    )))
}

/// Whether an output (so far) is tool calls: `Some(true)` when it starts
/// with `<`, which under the tools grammar only its calls branch does
/// (the text branch starts with any other character, whitespace too),
/// `Some(false)` for any other first character, `None` while empty. Calls
/// are read only where this says so: text that starts with whitespace and
/// then holds a call block is text the grammar never checked as a call.
pub fn is_calls(text: &str) -> Option<bool> {
    text.chars().next().map(|c| c == '<')
}

/// The calls in `text`: `Some` when the text is one or more call blocks
/// (whitespace between them, none before the first: see `is_calls`), each
/// a JSON object with a string `name` and an object `arguments`; `None`
/// for anything else (a text answer).
pub fn parse_calls(text: &str) -> Option<Vec<ToolCall>> {
    if is_calls(text) != Some(true) {
        return None;
    }
    let mut rest = text;
    let mut calls = Vec::new();
    while !rest.is_empty() {
        let body = rest.strip_prefix(CALL_OPEN)?;
        let end = body.find(CALL_CLOSE)?;
        calls.push(parse_call(&body[..end])?);
        rest = body[end + CALL_CLOSE.len()..].trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

fn parse_call(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments")?;
    args.is_object().then(|| ToolCall {
        name,
        arguments: args.to_string(),
    })
}

/// Streaming: complete call blocks at the start of `buf` are taken out and
/// returned; what remains is an unfinished block (or whitespace).
pub fn take_complete_calls(buf: &mut String) -> Vec<ToolCall> {
    let mut out = Vec::new();
    loop {
        let trimmed = buf.trim_start();
        let Some(body) = trimmed.strip_prefix(CALL_OPEN) else {
            break;
        };
        let Some(end) = body.find(CALL_CLOSE) else {
            break;
        };
        let Some(call) = parse_call(&body[..end]) else {
            break;
        };
        out.push(call);
        let consumed = buf.len() - body.len() + end + CALL_CLOSE.len();
        buf.drain(..consumed);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_round_trip_and_text_is_not_a_call() {
        let a = render_call("f", &json!({"x": 1}));
        let b = render_call("g", &json!({}));
        let calls = parse_calls(&format!("{a}\n{b}\n")).unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "f");
        assert_eq!(calls[0].arguments, r#"{"x":1}"#);
        assert_eq!(parse_calls("The weather is fine."), None);
        // The text branch may start with whitespace and then hold
        // anything: a call block after it is text, not a call.
        assert_eq!(parse_calls(&format!(" {a}")), None);
        assert_eq!(parse_calls(&format!("\n{a}")), None);
        assert_eq!(is_calls(""), None);
        assert_eq!(is_calls("\n<tool_call>"), Some(false));
        assert_eq!(is_calls(&a), Some(true));
        assert_eq!(parse_calls(&format!("{a} and then text")), None);
        assert_eq!(
            parse_calls("<tool_call>\n{\"name\": 3}\n</tool_call>"),
            None
        );
        let mut buf = format!("{a}\n<tool_call>\n{{\"name\": \"g\", \"argu");
        let got = take_complete_calls(&mut buf);
        assert_eq!(got.len(), 1);
        assert!(buf.trim_start().starts_with(CALL_OPEN));
    }
}
