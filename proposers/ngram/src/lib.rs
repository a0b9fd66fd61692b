//! Prompt-lookup decoding: find the longest suffix n-gram of the sequence
//! (n from `max_n` down to `min_n`) earlier in its own prompt and output,
//! and propose the tokens that followed its most recent occurrence.
//! Deterministic: q is one-hot.
//!
//! With `branches` > 1 the draft is a tree: the continuations of up to
//! that many earlier occurrences of the longest matching n-gram (most
//! recent first), merged where they share a prefix, each at most
//! `max_depth` deep, within the engine's node budget. Siblings are
//! distinct one-hot candidates the engine tries in turn (lossless).
//!
//! Options: `min_n` (default 1), `max_n` (3), `max_draft` (4; tree
//! nodes with branches), `branches` (1), `max_depth` (4).

use std::collections::HashSet;

use specd_plugin_sdk::{Caps, Host, Options, Plugin, Proposal, SeqView};

/// Up to `k` tokens that followed the most recent earlier occurrence of the
/// longest matching suffix n-gram of `tokens`.
pub fn lookup(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 || min_n == 0 {
        return Vec::new();
    }
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
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

/// The continuations (at most `depth` tokens each) of up to `branches`
/// earlier occurrences of the longest matching suffix n-gram, most recent
/// first, merged into a trie of at most `budget` nodes: (tokens, parents),
/// parents indexing earlier nodes (-1: the context).
pub fn lookup_tree(
    tokens: &[u32],
    (min_n, max_n): (usize, usize),
    budget: usize,
    branches: usize,
    depth: usize,
) -> (Vec<u32>, Vec<i32>) {
    let len = tokens.len();
    let (mut out, mut parents) = (Vec::new(), Vec::new());
    if budget == 0 || min_n == 0 || branches == 0 || depth == 0 {
        return (out, parents);
    }
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        let mut found = 0;
        for start in (0..len - n).rev() {
            if found == branches || out.len() == budget {
                break;
            }
            if &tokens[start..start + n] != suffix {
                continue;
            }
            found += 1;
            let mut at = -1i32;
            for &t in &tokens[start + n..(start + n + depth).min(len)] {
                let existing = (0..out.len()).find(|&i| parents[i] == at && out[i] == t);
                at = match existing {
                    Some(i) => i as i32,
                    None if out.len() < budget => {
                        out.push(t);
                        parents.push(at);
                        (out.len() - 1) as i32
                    }
                    None => break,
                };
            }
        }
        if found > 0 {
            break;
        }
    }
    (out, parents)
}

pub struct Ngram {
    min_n: usize,
    max_n: usize,
    max_draft: usize,
    branches: usize,
    max_depth: usize,
    live: HashSet<u64>,
    host: Host,
}

impl Plugin for Ngram {
    const NAME: &'static str = "ngram";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn default_capabilities() -> Caps {
        Caps::one_hot(4)
    }

    fn create(o: &Options, host: Host) -> Result<Self, String> {
        o.reject_unknown(&["min_n", "max_n", "max_draft", "branches", "max_depth"])?;
        let min_n = o.get("min_n", 1usize)?;
        let max_n = o.get("max_n", 3usize)?;
        let max_draft = o.get("max_draft", 4usize)?;
        if min_n == 0 || max_n < min_n {
            return Err(format!(
                "option `min_n`/`max_n`: need 1 <= min_n <= max_n, got {min_n} and {max_n}"
            ));
        }
        let branches = o.get("branches", 1usize)?;
        let max_depth = o.get("max_depth", 4usize)?;
        if branches == 0 || max_depth == 0 {
            return Err("options `branches` and `max_depth` must be >= 1".into());
        }
        Ok(Self {
            min_n,
            max_n,
            max_draft,
            branches,
            max_depth,
            live: HashSet::new(),
            host,
        })
    }

    fn capabilities(&self) -> Caps {
        let mut c = Caps::one_hot(self.max_draft as u32);
        if self.branches > 1 {
            c.tree = true;
            c.max_depth = self.max_depth.min(self.max_draft) as u32;
            c.siblings = specd_plugin_sdk::Siblings::WithoutReplacement;
        }
        c
    }

    fn start(&mut self, seq: u64, _tokens: &[u32]) -> Result<(), String> {
        self.live.insert(seq);
        Ok(())
    }

    fn propose(&mut self, batch: &[SeqView<'_>]) -> Result<Vec<Proposal>, String> {
        let drafts: Vec<Proposal> = batch
            .iter()
            .map(|s| {
                let budget = s.max_draft.min(self.max_draft);
                if self.branches > 1 {
                    let (tokens, parents) = lookup_tree(
                        s.tokens,
                        (self.min_n, self.max_n),
                        budget,
                        self.branches,
                        self.max_depth,
                    );
                    return Proposal {
                        tokens,
                        q: Vec::new(),
                        parents: Some(parents),
                    };
                }
                Proposal::one_hot(lookup(s.tokens, self.min_n, self.max_n, budget))
            })
            .collect();
        let hits = drafts.iter().filter(|d| !d.tokens.is_empty()).count();
        self.host.counter("ngram_lookup_hits", hits as u64);
        Ok(drafts)
    }

    fn observe(&mut self, _seq: u64, _tokens: &[u32], _path: &[u32]) -> Result<(), String> {
        Ok(())
    }

    fn finish(&mut self, seq: u64) {
        self.live.remove(&seq);
    }
}

#[cfg(feature = "plugin")]
specd_plugin_sdk::export_proposer!(Ngram);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_longest_most_recent_match() {
        // suffix [1, 2] occurred at 0 (then 3, 4) and at 4 (then 9, 5).
        let t = [1, 2, 3, 4, 1, 2, 9, 5, 1, 2];
        assert_eq!(lookup(&t, 1, 3, 3), vec![9, 5, 1]);
        // The trigram [5, 1, 2] never recurs.
        assert_eq!(lookup(&t, 3, 3, 3), Vec::<u32>::new());
        // A longer match wins over a more recent shorter one.
        let t = [7, 8, 9, 1, 5, 9, 2, 7, 8, 9];
        assert_eq!(lookup(&t, 1, 3, 2), vec![1, 5]);
        assert_eq!(lookup(&[7, 8], 1, 3, 2), Vec::<u32>::new());
        assert_eq!(lookup(&[7, 7], 1, 3, 4), vec![7]);
        assert_eq!(lookup(&[1, 2, 1], 1, 3, 0), Vec::<u32>::new());
    }

    #[test]
    fn draft_is_capped_by_the_remaining_history() {
        let t = [4, 5, 6, 4];
        assert_eq!(lookup(&t, 1, 2, 10), vec![5, 6, 4]);
    }

    #[test]
    fn branches_merge_the_continuations_of_several_matches() {
        // [1, 2] recurs at 0 (then 3, 4), at 4 (then 3, 5) and at 8.
        let t = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2];
        let (tok, par) = lookup_tree(&t, (1, 2), 16, 3, 2);
        // Most recent first: 3 -> 5, then 3 (shared) -> 4.
        assert_eq!(tok, vec![3, 5, 4]);
        assert_eq!(par, vec![-1, 0, 0]);
        // One branch is the chain lookup gives.
        let (tok, par) = lookup_tree(&t, (1, 2), 16, 1, 3);
        assert_eq!(tok, lookup(&t, 1, 2, 3));
        assert_eq!(par, vec![-1, 0, 1]);
        // The node budget bounds the tree.
        let (tok, _) = lookup_tree(&t, (1, 2), 2, 3, 2);
        assert_eq!(tok, vec![3, 5]);
        // Siblings are distinct.
        let t = [9, 1, 9, 2, 9, 1, 9];
        let (tok, par) = lookup_tree(&t, (1, 1), 16, 3, 1);
        assert_eq!((tok, par), (vec![1, 2], vec![-1, -1]));
    }
}
