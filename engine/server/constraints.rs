//! Request fields that constrain the output: OpenAI's `response_format`
//! (`json_object`, `json_schema`) and vLLM's `structured_outputs` (`json`,
//! `regex`, `grammar`, `choice`; also accepted as the older top-level
//! `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice`).
//!
//! Invariants:
//! - At most one constraint per request; a second is a 400 naming both.
//! - Every constraint is compiled here, before the request is queued: an
//!   invalid schema, regex or grammar is a 400 naming the field and
//!   llguidance's reason.

use serde_json::Value;

use super::errors::ApiError;
use super::requests::{type_name, Common};
use super::AppState;
use crate::structured::{Constraint, ConstraintSpec};

/// The constraint a request asks for, as (field, spec).
fn requested(c: &Common) -> Result<Option<(String, ConstraintSpec)>, ApiError> {
    let mut found: Vec<(String, ConstraintSpec)> = Vec::new();
    if let Some(rf) = &c.response_format {
        if let Some(x) = response_format(rf)? {
            found.push(x);
        }
    }
    if let Some(so) = &c.structured_outputs {
        let Value::Object(o) = so else {
            return Err(ApiError::bad_field(
                "structured_outputs",
                format!(
                    "`structured_outputs` must be an object with one of json, regex, grammar, choice (got {})",
                    type_name(so)
                ),
            ));
        };
        for (k, v) in o {
            let field = format!("structured_outputs.{k}");
            match vllm_field(k, v, &field)? {
                Some(spec) => found.push((field, spec)),
                None => {
                    return Err(ApiError::bad_field(
                        &field,
                        format!("`{field}` is not supported (json, regex, grammar, choice)"),
                    ))
                }
            }
        }
    }
    for (k, v) in [
        ("json", &c.guided_json),
        ("regex", &c.guided_regex),
        ("grammar", &c.guided_grammar),
        ("choice", &c.guided_choice),
    ] {
        if let Some(v) = v.as_ref().filter(|v| !v.is_null()) {
            let field = format!("guided_{k}");
            if let Some(spec) = vllm_field(k, v, &field)? {
                found.push((field, spec));
            }
        }
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(ApiError::bad_field(
            &found[1].0,
            format!(
                "`{}` and `{}` both constrain the output; send one",
                found[0].0, found[1].0
            ),
        )),
    }
}

/// OpenAI's `response_format`.
fn response_format(rf: &Value) -> Result<Option<(String, ConstraintSpec)>, ApiError> {
    let bad = |field: &str, msg: String| Err(ApiError::bad_field(field, msg));
    let Some(o) = rf.as_object() else {
        return match rf {
            Value::Null => Ok(None),
            _ => bad(
                "response_format",
                format!(
                    "`response_format` must be an object (got {})",
                    type_name(rf)
                ),
            ),
        };
    };
    match o.get("type").and_then(Value::as_str) {
        None if o.is_empty() => Ok(None),
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some((
            "response_format".into(),
            ConstraintSpec::JsonObject,
        ))),
        Some("json_schema") => {
            let field = "response_format.json_schema";
            let Some(js) = o.get("json_schema").and_then(Value::as_object) else {
                return bad(
                    field,
                    format!("`{field}` must be an object with `name` and `schema`"),
                );
            };
            match js.get("name") {
                Some(Value::String(n))
                    if !n.is_empty()
                        && n.len() <= 64
                        && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') => {}
                Some(v) => {
                    return bad(
                        "response_format.json_schema.name",
                        format!(
                            "`response_format.json_schema.name` must be 1-64 letters, digits, `_` or `-` (got {})",
                            short(v)
                        ),
                    )
                }
                None => {
                    return bad(
                        "response_format.json_schema.name",
                        "`response_format.json_schema.name` is required".into(),
                    )
                }
            }
            if let Some(s) = js.get("strict") {
                if !s.is_boolean() && !s.is_null() {
                    return bad(
                        "response_format.json_schema.strict",
                        format!(
                            "`response_format.json_schema.strict` must be a boolean (got {})",
                            type_name(s)
                        ),
                    );
                }
            }
            let schema = match js.get("schema") {
                // OpenAI's default: any JSON object.
                None | Some(Value::Null) => serde_json::json!({"type": "object"}),
                Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                Some(s) => {
                    return bad(
                        "response_format.json_schema.schema",
                        format!(
                            "`response_format.json_schema.schema` must be a JSON schema object (got {})",
                            type_name(s)
                        ),
                    )
                }
            };
            Ok(Some((
                "response_format.json_schema.schema".into(),
                ConstraintSpec::JsonSchema(schema),
            )))
        }
        Some(other) => bad(
            "response_format.type",
            format!("`response_format.type` = `{other}` is not supported (text, json_object, json_schema)"),
        ),
        None => bad(
            "response_format.type",
            "`response_format.type` is required (text, json_object, json_schema)".into(),
        ),
    }
}

/// One of vLLM's structured-output kinds; `None` for an unknown kind.
fn vllm_field(kind: &str, v: &Value, field: &str) -> Result<Option<ConstraintSpec>, ApiError> {
    let need_string = || {
        ApiError::bad_field(
            field,
            format!("`{field}` must be a string (got {})", type_name(v)),
        )
    };
    Ok(Some(match kind {
        "json" => match v {
            Value::Object(_) | Value::Bool(_) => ConstraintSpec::JsonSchema(v.clone()),
            // vLLM also takes the schema as a JSON string.
            Value::String(s) => {
                ConstraintSpec::JsonSchema(serde_json::from_str(s).map_err(|e| {
                    ApiError::bad_field(field, format!("`{field}` is not valid JSON: {e}"))
                })?)
            }
            _ => {
                return Err(ApiError::bad_field(
                    field,
                    format!("`{field}` must be a JSON schema (got {})", type_name(v)),
                ))
            }
        },
        "regex" => ConstraintSpec::Regex(v.as_str().ok_or_else(need_string)?.to_string()),
        "grammar" => ConstraintSpec::Lark(v.as_str().ok_or_else(need_string)?.to_string()),
        "choice" => {
            let items: Option<Vec<&str>> = v
                .as_array()
                .filter(|a| !a.is_empty())
                .and_then(|a| a.iter().map(Value::as_str).collect());
            let items = items.ok_or_else(|| {
                ApiError::bad_field(
                    field,
                    format!("`{field}` must be a non-empty list of strings"),
                )
            })?;
            ConstraintSpec::Lark(choice_grammar(&items))
        }
        _ => return Ok(None),
    }))
}

/// A grammar whose outputs are exactly `items`.
pub fn choice_grammar(items: &[&str]) -> String {
    let alts: Vec<String> = items
        .iter()
        .map(|s| Value::String((*s).to_string()).to_string())
        .collect();
    format!("start: {}\n", alts.join(" | "))
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 60 {
        s.chars().take(60).collect::<String>() + "..."
    } else {
        s
    }
}

/// Parse and compile the request's constraint (one per request).
pub fn constraint(c: &Common, st: &AppState) -> Result<Option<Constraint>, ApiError> {
    let Some((field, spec)) = requested(c)? else {
        return Ok(None);
    };
    compile(st, &field, &spec).map(Some)
}

/// Compile `spec` with the server's grammar engine; errors name `field`.
pub fn compile(st: &AppState, field: &str, spec: &ConstraintSpec) -> Result<Constraint, ApiError> {
    let g = st
        .grammars()
        .map_err(|e| ApiError::bad_field(field, format!("`{field}`: {e}")))?;
    g.compile(spec, field).map_err(|e| {
        let msg = match e {
            crate::SpecdError::InvalidRequest(m) => m,
            other => other.to_string(),
        };
        ApiError::bad_field(field, format!("invalid `{msg}"))
    })
}
