//! The host-side proposer interface: what a proposer declares
//! (`Capabilities`), what it returns (`Draft`, `DraftQ`), the `Proposer`
//! trait every drafting strategy implements (in-engine, or a plugin through
//! `plugins::PluginProposer`), and `validate_draft`, the rules every draft
//! must follow.
//!
//! Invariant: every draft of every proposer is validated before it reaches
//! the verifier (token ids inside the vocabulary, one q per token of the
//! declared kind, one-hot always allowed under greedy decoding, each q
//! finite, non-negative, summing to 1 within 1e-3, with q(draft) > 0).

use super::SeqId;
use crate::sampler::{Distribution, SamplingParams};

/// How a proposer describes its draft distribution q.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QKind {
    /// Deterministic proposers: q = delta(draft token).
    OneHot,
    /// Top entries of q; the rest has probability 0.
    Sparse,
    /// q over the whole vocabulary.
    Full,
}

/// What a proposer declares about itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Capabilities {
    /// Target layers whose hidden states it needs (see `model::ForwardOutput`).
    pub hidden_layers: Vec<usize>,
    pub q_kind: QKind,
    pub max_draft: usize,
    /// Emits token trees (parent indices) rather than linear chains.
    pub tree: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Self {
            hidden_layers: Vec::new(),
            q_kind: QKind::OneHot,
            max_draft: 4,
            tree: false,
        }
    }
}

/// The draft distribution at one draft position.
#[derive(Debug, Clone, PartialEq)]
pub enum DraftQ {
    OneHot,
    Sparse(Distribution),
    /// Dense probabilities over the vocabulary.
    Full(Vec<f32>),
}

impl DraftQ {
    /// q(token) given that `drafted` was the drafted token.
    pub fn prob(&self, drafted: u32, token: u32) -> f32 {
        match self {
            DraftQ::OneHot => f32::from(token == drafted),
            DraftQ::Sparse(d) => d.prob(token),
            DraftQ::Full(v) => v.get(token as usize).copied().unwrap_or(0.0),
        }
    }
}

/// One sequence's drafted tokens, with q for each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// Same length as `tokens`.
    pub q: Vec<DraftQ>,
}

/// One sequence's input to `propose`.
#[derive(Debug)]
pub struct ProposeInput<'a> {
    pub seq: SeqId,
    /// Committed tokens (prompt and output), ending with the token the next
    /// verify will feed first.
    pub tokens: &'a [u32],
    pub max_draft: usize,
    pub params: &'a SamplingParams,
    /// Hidden states of the declared layers for the positions committed by
    /// the last verify (`(layer, rows x hidden)`); empty if none.
    pub hidden: &'a [(usize, Vec<f32>)],
}

/// A drafting strategy. Implementations live in the engine (built-ins and
/// test proposers) or behind the plugin ABI.
pub trait Proposer: Send {
    fn name(&self) -> &str;
    fn capabilities(&self) -> Capabilities;
    /// A sequence starts (or restarts after preemption) with `prompt`.
    fn start(&mut self, seq: SeqId, prompt: &[u32]) -> Result<(), String>;
    /// Draft for every sequence in `batch` in one call.
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String>;
    /// Tokens committed for `seq` by the last step.
    fn observe(&mut self, seq: SeqId, committed: &[u32]) -> Result<(), String>;
    fn finish(&mut self, seq: SeqId);
}

/// Tolerance on the total mass of a reported q.
pub const Q_SUM_TOLERANCE: f64 = 1e-3;

/// Check one draft against the rules every proposer must follow (see the
/// module invariants); `Err` names the rule and the offending position.
///
/// Under greedy decoding every proposer may report a one-hot q (its draft is
/// the argmax of whatever it computed); under sampling q must be of the
/// declared kind.
pub fn validate_draft(
    d: &Draft,
    kind: QKind,
    vocab: Option<usize>,
    greedy: bool,
) -> Result<(), String> {
    if d.q.len() != d.tokens.len() {
        return Err(format!(
            "{} drafted tokens but {} q entries",
            d.tokens.len(),
            d.q.len()
        ));
    }
    let in_vocab = |t: u32| vocab.is_none_or(|v| (t as usize) < v);
    for (j, (&tok, q)) in d.tokens.iter().zip(&d.q).enumerate() {
        if !in_vocab(tok) {
            return Err(format!(
                "position {j}: token {tok} is outside the vocabulary of {}",
                vocab.unwrap_or(0)
            ));
        }
        let mass = |probs: &mut dyn Iterator<Item = f32>| -> Result<f64, String> {
            let mut sum = 0f64;
            for p in probs {
                if !p.is_finite() || p < 0.0 {
                    return Err(format!("position {j}: q has an entry {p}"));
                }
                sum += p as f64;
            }
            if (sum - 1.0).abs() > Q_SUM_TOLERANCE {
                return Err(format!("position {j}: q sums to {sum:.6}, not 1"));
            }
            Ok(sum)
        };
        match (kind, q) {
            (QKind::OneHot, DraftQ::OneHot) => {}
            (_, DraftQ::OneHot) if greedy => {}
            (QKind::Sparse, DraftQ::Sparse(dist)) => {
                if dist.ids.len() != dist.probs.len() {
                    return Err(format!(
                        "position {j}: sparse q has mismatched ids and probs"
                    ));
                }
                let mut seen = std::collections::HashSet::new();
                for &id in &dist.ids {
                    if !in_vocab(id) {
                        return Err(format!(
                            "position {j}: q names token {id}, outside the vocabulary"
                        ));
                    }
                    if !seen.insert(id) {
                        return Err(format!("position {j}: q lists token {id} twice"));
                    }
                }
                mass(&mut dist.probs.iter().copied())?;
            }
            (QKind::Full, DraftQ::Full(v)) => {
                if let Some(n) = vocab {
                    if v.len() != n {
                        return Err(format!(
                            "position {j}: full q has {} entries for a vocabulary of {n}",
                            v.len()
                        ));
                    }
                }
                mass(&mut v.iter().copied())?;
            }
            (declared, got) => {
                let got = match got {
                    DraftQ::OneHot => "one-hot",
                    DraftQ::Sparse(_) => "sparse",
                    DraftQ::Full(_) => "full",
                };
                return Err(format!(
                    "position {j}: declared {declared:?} q but returned {got} q"
                ));
            }
        }
        if q.prob(tok, tok) <= 0.0 {
            return Err(format!(
                "position {j}: drafted token {tok} has q = 0 (each draft token must be drawn from the q reported)"
            ));
        }
    }
    Ok(())
}
