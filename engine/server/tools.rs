//! OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` on
//! `/v1/chat/completions`: validated into a `ToolSetup`, rendered into the
//! conversation (`structured::tools` documents the format), and turned
//! into a constraint.
//!
//! Invariants:
//! - Every tool has a valid name and an object schema for its parameters,
//!   names are unique, and a named `tool_choice` names one of them; each
//!   violation is a 400 naming the entry.
//! - `tools` together with another constraint (`response_format`,
//!   `structured_outputs`) is a 400: the output cannot follow both.

use serde_json::Value;

use super::errors::ApiError;
use super::requests::type_name;
use crate::structured::tools::{Tool, ToolChoice};

/// A request's tools, once validated.
#[derive(Debug, Clone)]
pub struct ToolSetup {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

impl ToolSetup {
    /// Whether the model is offered the tools (and its output may be calls).
    pub fn active(&self) -> bool {
        !self.tools.is_empty() && self.choice != ToolChoice::None
    }
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Parse the fields; `None` when the request offers no tools.
pub fn parse(
    tools: Option<&Value>,
    choice: Option<&Value>,
    parallel: Option<&Value>,
) -> Result<Option<ToolSetup>, ApiError> {
    let list = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(v) => {
            return Err(ApiError::bad_field(
                "tools",
                format!("`tools` must be a list of functions (got {})", type_name(v)),
            ))
        }
    };
    let mut out: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let field = |f: &str| format!("tools[{i}]{f}");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::bad_field(
                &field(".type"),
                format!("`{}` must be \"function\"", field(".type")),
            ));
        }
        let Some(f) = t.get("function").and_then(Value::as_object) else {
            return Err(ApiError::bad_field(
                &field(".function"),
                format!("`{}` must be an object with a `name`", field(".function")),
            ));
        };
        let name = match f.get("name") {
            Some(Value::String(n)) if valid_name(n) => n.clone(),
            Some(v) => {
                return Err(ApiError::bad_field(
                    &field(".function.name"),
                    format!(
                        "`{}` must be 1-64 letters, digits, `_` or `-` (got {v})",
                        field(".function.name")
                    ),
                ))
            }
            None => {
                return Err(ApiError::bad_field(
                    &field(".function.name"),
                    format!("`{}` is required", field(".function.name")),
                ))
            }
        };
        if out.iter().any(|o| o.name == name) {
            return Err(ApiError::bad_field(
                &field(".function.name"),
                format!("two tools are named `{name}`"),
            ));
        }
        let description = match f.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => {
                return Err(ApiError::bad_field(
                    &field(".function.description"),
                    format!(
                        "`{}` must be a string (got {})",
                        field(".function.description"),
                        type_name(v)
                    ),
                ))
            }
        };
        let parameters = match f.get("parameters") {
            // No parameters: a function of no arguments.
            None | Some(Value::Null) => {
                serde_json::json!({"type": "object", "properties": {}, "additionalProperties": false})
            }
            Some(p @ Value::Object(_)) => p.clone(),
            Some(v) => {
                return Err(ApiError::bad_field(
                    &field(".function.parameters"),
                    format!(
                        "`{}` must be a JSON schema object (got {})",
                        field(".function.parameters"),
                        type_name(v)
                    ),
                ))
            }
        };
        out.push(Tool {
            name,
            description,
            parameters,
        });
    }
    let choice = match choice {
        None | Some(Value::Null) => {
            if out.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::bad_field(
                    "tool_choice",
                    format!(
                    "`tool_choice` = `{other}` is not one of none, auto, required, or a function"
                ),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match name {
                Some(n) if out.iter().any(|t| t.name == n) => ToolChoice::Named(n.to_string()),
                Some(n) => {
                    return Err(ApiError::bad_field(
                        "tool_choice.function.name",
                        format!("`tool_choice.function.name` = `{n}` names no tool in `tools`"),
                    ))
                }
                None => return Err(ApiError::bad_field(
                    "tool_choice.function.name",
                    "`tool_choice` must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                )),
            }
        }
        Some(v) => {
            return Err(ApiError::bad_field(
                "tool_choice",
                format!(
                    "`tool_choice` must be a string or an object (got {})",
                    type_name(v)
                ),
            ))
        }
    };
    if out.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::bad_field(
            "tool_choice",
            "`tool_choice` asks for a call but `tools` is empty",
        ));
    }
    let parallel = match parallel {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(ApiError::bad_field(
                "parallel_tool_calls",
                format!(
                    "`parallel_tool_calls` must be a boolean (got {})",
                    type_name(v)
                ),
            ))
        }
    };
    Ok((!out.is_empty()).then_some(ToolSetup {
        tools: out,
        choice,
        parallel,
    }))
}
