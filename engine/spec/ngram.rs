//! Built-in prompt-lookup proposer (n-gram matching over the sequence's own
//! prompt and output): the default speculation strategy until plugins load.
//!
//! Invariant: drafts are copies of tokens that followed the longest earlier
//! match of the sequence's suffix; q is one-hot.

use std::collections::HashMap;

use super::proposer::{Capabilities, Draft, DraftQ, ProposeInput, Proposer, QKind};
use super::SeqId;

#[derive(Debug, Clone)]
pub struct NgramProposer {
    pub min_n: usize,
    pub max_n: usize,
    pub max_draft: usize,
    seqs: HashMap<SeqId, ()>,
}

impl NgramProposer {
    pub fn new(min_n: usize, max_n: usize, max_draft: usize) -> Self {
        Self {
            min_n: min_n.max(1),
            max_n: max_n.max(min_n.max(1)),
            max_draft,
            seqs: HashMap::new(),
        }
    }
}

impl Default for NgramProposer {
    fn default() -> Self {
        Self::new(1, 3, 4)
    }
}

/// Longest suffix n-gram (n from `max_n` down to `min_n`) that occurred
/// earlier in `tokens`; returns up to `k` tokens that followed its most
/// recent earlier occurrence.
pub fn lookup(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 {
        return Vec::new();
    }
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Most recent earlier occurrence, excluding the suffix itself.
        for start in (0..len - n).rev() {
            if &tokens[start..start + n] == suffix {
                let from = start + n;
                let to = (from + k).min(len);
                if from < to {
                    return tokens[from..to].to_vec();
                }
            }
        }
    }
    Vec::new()
}

impl Proposer for NgramProposer {
    fn name(&self) -> &str {
        "ngram"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            hidden_layers: Vec::new(),
            q_kind: QKind::OneHot,
            max_draft: self.max_draft,
            tree: false,
        }
    }

    fn start(&mut self, seq: SeqId, _prompt: &[u32]) -> Result<(), String> {
        self.seqs.insert(seq, ());
        Ok(())
    }

    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
        Ok(batch
            .iter()
            .map(|b| {
                let tokens = lookup(b.tokens, self.min_n, self.max_n, b.max_draft);
                let q = vec![DraftQ::OneHot; tokens.len()];
                Draft { tokens, q }
            })
            .collect())
    }

    fn observe(&mut self, _seq: SeqId, _committed: &[u32]) {}

    fn finish(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_longest_recent_match() {
        // suffix [1, 2] occurred at 0 (followed by 3, 4) and at 4 (followed by 9).
        let t = [1, 2, 3, 4, 1, 2, 9, 5, 1, 2];
        assert_eq!(lookup(&t, 1, 3, 3), vec![9, 5, 1]);
        // trigram [5, 1, 2] does not recur; bigram does.
        assert_eq!(lookup(&t, 3, 3, 3), Vec::<u32>::new());
        assert_eq!(lookup(&[7, 8], 1, 3, 2), Vec::<u32>::new());
        assert_eq!(lookup(&[7, 7], 1, 3, 4), vec![7]);
    }
}
