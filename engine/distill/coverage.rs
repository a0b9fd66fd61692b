//! `specd distill coverage`: how much of a target's own output a draft
//! vocabulary can name at all.
//!
//! A trained head (EAGLE-3, MTP, Medusa, DFlash, the compact draft) drafts
//! only tokens of its draft vocabulary; where the target emits a token
//! outside it, every draft position that needs that token is rejected
//! whatever the head learned. This measures that ceiling on an evaluation
//! set's plain outputs (the JSONL `specd generate --prompts` writes, whose
//! `token_ids` are the target's greedy tokens): per category, the share of
//! output tokens inside each given head's vocabulary and inside the
//! vocabulary the trainers would choose from a corpus at each given size
//! (`choose_draft_vocab`: the most frequent response tokens, EOS always in).
//! A completion's ending EOS is not among its `token_ids` (it is always
//! covered), so the shares are a slight underestimate.
//!
//! Invariant: only the outputs are read from the evaluation set; the
//! vocabularies come from heads and the training corpus, never from the
//! outputs measured.

use std::path::{Path, PathBuf};

use super::train::{choose_draft_vocab, InitHead};
use super::Sample;
use crate::error::{Result, SpecdError};

/// Per category (in order of first appearance, then `all`): output tokens
/// and, per column, the share of them inside that column's vocabulary.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CoverageReport {
    pub columns: Vec<String>,
    pub rows: Vec<CoverageRow>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct CoverageRow {
    pub category: String,
    pub tokens: usize,
    pub shares: Vec<f64>,
}

/// The vocabularies to measure: a head's (`InitHead::read`, so every
/// trained layout with a `d2t`) or a corpus's top `n`.
pub enum Vocab<'a> {
    Head(PathBuf),
    Top { n: usize, samples: &'a [Sample] },
}

fn bad(path: &Path, line: usize, why: impl std::fmt::Display) -> SpecdError {
    SpecdError::InvalidRequest(format!("{}:{line}: {why}", path.display()))
}

/// The outputs' token ids per category, in order of first appearance
/// (lines without `category` count toward the `all` row only).
pub fn read_outputs(path: &Path, vocab: usize) -> Result<Vec<(String, Vec<u32>)>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| SpecdError::InvalidRequest(format!("{}: {e}", path.display())))?;
    let mut cats: Vec<(String, Vec<u32>)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let j: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(path, n, format!("not JSON ({e})")))?;
        let ids = j["token_ids"].as_array().ok_or_else(|| {
            bad(
                path,
                n,
                "no `token_ids` array (write the outputs with `specd generate --prompts`)",
            )
        })?;
        let ids = ids
            .iter()
            .map(|v| {
                v.as_u64()
                    .filter(|&t| (t as usize) < vocab)
                    .map(|t| t as u32)
                    .ok_or_else(|| {
                        bad(
                            path,
                            n,
                            format!("token id {v} is not one of the target's {vocab}"),
                        )
                    })
            })
            .collect::<Result<Vec<u32>>>()?;
        let cat = match &j["category"] {
            serde_json::Value::Null => String::new(),
            serde_json::Value::String(c) if c == "all" => {
                return Err(bad(
                    path,
                    n,
                    "category `all` is the name of the total row; rename it",
                ))
            }
            serde_json::Value::String(c) => c.clone(),
            other => {
                return Err(bad(
                    path,
                    n,
                    format!("`category` must be a string, got {other}"),
                ))
            }
        };
        match cats.iter_mut().find(|(c, _)| *c == cat) {
            Some((_, v)) => v.extend(ids),
            None => cats.push((cat, ids)),
        }
    }
    if cats.iter().all(|(_, v)| v.is_empty()) {
        return Err(SpecdError::InvalidRequest(format!(
            "{}: no output tokens to measure",
            path.display()
        )));
    }
    Ok(cats)
}

/// Measure `outputs` (from [`read_outputs`]) against each vocabulary of a
/// target with `vocab` tokens and these EOS ids.
pub fn coverage(
    outputs: &[(String, Vec<u32>)],
    vocabs: &[Vocab<'_>],
    vocab: usize,
    eos: &[u32],
) -> Result<CoverageReport> {
    let mut columns = Vec::new();
    let mut masks = Vec::new();
    for v in vocabs {
        let (name, ids) = match v {
            Vocab::Head(dir) => {
                let h = InitHead::read(dir, "coverage", String::new(), vocab)?;
                (dir.display().to_string(), h.ids)
            }
            Vocab::Top { n, samples } => {
                let ids = choose_draft_vocab(samples, *n, vocab, eos);
                (format!("corpus top {}", ids.len()), ids)
            }
        };
        let mut m = vec![false; vocab];
        for t in ids {
            m[t as usize] = true;
        }
        columns.push(name);
        masks.push(m);
    }
    let row = |category: String, ids: &mut dyn Iterator<Item = u32>| {
        let ids: Vec<u32> = ids.collect();
        let shares = masks
            .iter()
            .map(|m| {
                let inside = ids.iter().filter(|&&t| m[t as usize]).count();
                inside as f64 / ids.len().max(1) as f64
            })
            .collect();
        CoverageRow {
            category,
            tokens: ids.len(),
            shares,
        }
    };
    let mut rows: Vec<CoverageRow> = outputs
        .iter()
        .filter(|(c, ids)| !c.is_empty() && !ids.is_empty())
        .map(|(c, ids)| row(c.clone(), &mut ids.iter().copied()))
        .collect();
    rows.push(row(
        "all".into(),
        &mut outputs.iter().flat_map(|(_, v)| v.iter().copied()),
    ));
    Ok(CoverageReport { columns, rows })
}

impl CoverageReport {
    pub fn markdown(&self) -> String {
        let mut s = format!("| category | tokens | {} |\n", self.columns.join(" | "));
        s += &format!("|---|---|{}\n", "---|".repeat(self.columns.len()));
        for r in &self.rows {
            let shares: Vec<String> = r.shares.iter().map(|x| format!("{x:.3}")).collect();
            s += &format!(
                "| {} | {} | {} |\n",
                r.category,
                r.tokens,
                shares.join(" | ")
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tensor_file::{write, TensorData};

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("specd-coverage-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn shares_count_tokens_inside_each_vocabulary() {
        let dir = tmp("shares");
        // A head whose draft vocabulary is target ids {1, 4, 7} (d2t holds
        // target - draft index offsets).
        let head = dir.join("head");
        std::fs::create_dir_all(&head).unwrap();
        write(
            &head.join("model.safetensors"),
            &[("d2t".into(), vec![3], TensorData::I64(vec![1, 3, 5]))],
        )
        .unwrap();
        let out = dir.join("out.jsonl");
        std::fs::write(
            &out,
            "{\"category\":\"a\",\"token_ids\":[1,2,4,4]}\n\n\
             {\"category\":\"b\",\"token_ids\":[7,9]}\n\
             {\"category\":\"a\",\"token_ids\":[0]}\n\
             {\"category\":\"c\",\"token_ids\":[]}\n",
        )
        .unwrap();
        let outputs = read_outputs(&out, 10).unwrap();
        // The corpus's responses: 2 three times, 9 twice, 5 once (the
        // prompt's tokens do not count); EOS 3 is always in.
        let samples = vec![
            Sample {
                tokens: vec![7, 7, 7, 7, 2, 2, 9, 5],
                prompt_len: 4,
            },
            Sample {
                tokens: vec![2, 9],
                prompt_len: 0,
            },
        ];
        let vocabs = [
            Vocab::Head(head.clone()),
            Vocab::Top {
                n: 2,
                samples: &samples,
            },
            Vocab::Top {
                n: 3,
                samples: &samples,
            },
            // More than the target's 10 tokens: all of them, named so.
            Vocab::Top {
                n: 50,
                samples: &samples,
            },
        ];
        let r = coverage(&outputs, &vocabs, 10, &[3]).unwrap();
        let got: Vec<(&str, usize, Vec<f64>)> = r
            .rows
            .iter()
            .map(|x| (x.category.as_str(), x.tokens, x.shares.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                // a: 1, 2, 4, 4, 0: head {1, 4, 7} has 3; top 2 {3, 2} has
                // 1; top 3 {3, 2, 9} has 1.
                ("a", 5, vec![0.6, 0.2, 0.2, 1.0]),
                // b: 7, 9.
                ("b", 2, vec![0.5, 0.0, 0.5, 1.0]),
                // c has no tokens: no row of its own.
                ("all", 7, vec![4.0 / 7.0, 1.0 / 7.0, 2.0 / 7.0, 1.0]),
            ]
        );
        let md = r.markdown();
        assert!(
            md.contains("| a | 5 | 0.600 | 0.200 | 0.200 | 1.000 |"),
            "{md}"
        );
        assert!(
            md.contains("| corpus top 2 | corpus top 3 | corpus top 10 |"),
            "{md}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_outputs_are_named_by_line() {
        let dir = tmp("bad");
        let out = dir.join("out.jsonl");
        for (text, want) in [
            ("{\"token_ids\":[1]}\nnot json\n", ":2: not JSON"),
            ("{\"text\":\"x\"}\n", ":1: no `token_ids` array"),
            ("{\"token_ids\":[1, 12]}\n", ":1: token id 12 is not one"),
            ("{\"token_ids\":[]}\n", "no output tokens"),
            (
                "{\"category\":3,\"token_ids\":[1]}\n",
                ":1: `category` must be a string",
            ),
            (
                "{\"category\":\"all\",\"token_ids\":[1]}\n",
                ":1: category `all`",
            ),
        ] {
            std::fs::write(&out, text).unwrap();
            let e = read_outputs(&out, 10).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        let e = coverage(
            &[("".into(), vec![1])],
            &[Vocab::Head(dir.join("missing"))],
            10,
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("model.safetensors"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
