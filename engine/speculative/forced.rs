//! Forced tokens as free drafts (jump-forward): where a request's
//! constraint allows exactly one continuation, those tokens are drafted
//! with q = 1 ahead of whatever the proposer drafted.
//!
//! Invariants:
//! - The forced chain comes first; the proposer's draft continues after it
//!   only where the proposer itself drafted the forced tokens (its subtree
//!   under the matching path, with its own q). Keeping that continuation
//!   depends only on tokens before it, so its law is the q it reports and
//!   acceptance stays exact.
//! - A lookup proposer (one-hot q, no hidden states: it drafts from the
//!   tokens it is given alone) drafts from the context extended by the
//!   forced tokens, and its whole draft follows them (`prepend_forced`).
//! - The result never exceeds `max` nodes, and parents precede children.

use super::proposer::{Draft, DraftQ};

/// Merge `forced` ahead of the proposer's draft `d`, at most `max` nodes.
/// Returns the draft and how many leading nodes are forced.
pub fn with_forced(forced: &[u32], d: Draft, max: usize) -> (Draft, usize) {
    let m = forced.len().min(max);
    if m == 0 {
        return (d, 0);
    }
    let (mut tokens, mut q, mut parents) = chain_of(&forced[..m]);
    // Follow the forced tokens down the proposer's draft from the root.
    let mut at: Option<usize> = None;
    let mut matched = m == forced.len();
    for &f in &forced[..m] {
        if !matched {
            break;
        }
        match (0..d.tokens.len()).find(|&i| d.parent(i) == at && d.tokens[i] == f) {
            Some(i) => at = Some(i),
            None => matched = false,
        }
    }
    if let (true, Some(at)) = (matched, at) {
        // The subtree under the last matched node, re-rooted at the last
        // forced node (parents precede children, so one pass finds it).
        let mut new_index: Vec<Option<usize>> = vec![None; d.tokens.len()];
        new_index[at] = Some(m - 1);
        for i in at + 1..d.tokens.len() {
            if tokens.len() >= max {
                break;
            }
            if let Some(np) = d.parent(i).and_then(|p| new_index[p]) {
                new_index[i] = Some(tokens.len());
                tokens.push(d.tokens[i]);
                q.push(d.q[i].clone());
                parents.push(np as i32);
            }
        }
    }
    (assemble(tokens, q, parents, d.source), m)
}

/// The forced tokens as a chain: tokens, one-hot q, parents.
fn chain_of(forced: &[u32]) -> (Vec<u32>, Vec<DraftQ>, Vec<i32>) {
    (
        forced.to_vec(),
        vec![DraftQ::OneHot; forced.len()],
        (0..forced.len() as i32).map(|i| i - 1).collect(),
    )
}

/// A draft from its nodes (`parents` dropped when it is a chain).
fn assemble(tokens: Vec<u32>, q: Vec<DraftQ>, parents: Vec<i32>, source: Option<String>) -> Draft {
    let chain = parents.iter().enumerate().all(|(i, &p)| p == i as i32 - 1);
    Draft {
        tokens,
        q,
        parents: (!chain).then_some(parents),
        source,
    }
}

/// The forced chain, then `d`: a draft the proposer made from the context
/// extended by the forced tokens (a lookup proposer, which drafts from the
/// tokens it is given alone). At most `max` nodes.
pub fn prepend_forced(forced: &[u32], d: Draft, max: usize) -> (Draft, usize) {
    let m = forced.len().min(max);
    if m == 0 {
        return (d, 0);
    }
    let (mut tokens, mut q, mut parents) = chain_of(&forced[..m]);
    if m == forced.len() {
        let keep = d.tokens.len().min(max - m);
        for i in 0..keep {
            tokens.push(d.tokens[i]);
            q.push(d.q[i].clone());
            parents.push(d.parent(i).map_or(m - 1, |p| p + m) as i32);
        }
    }
    (assemble(tokens, q, parents, d.source), m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(tokens: &[u32]) -> Draft {
        Draft {
            tokens: tokens.to_vec(),
            q: vec![DraftQ::OneHot; tokens.len()],
            parents: None,
            source: None,
        }
    }

    #[test]
    fn a_proposer_that_drafted_the_forced_tokens_keeps_its_continuation() {
        let (d, n) = with_forced(&[5, 6], chain(&[5, 6, 7, 8]), 8);
        assert_eq!((d.tokens.as_slice(), n), (&[5, 6, 7, 8][..], 2));
        assert!(d.parents.is_none());
        // Capped at `max` nodes.
        let (d, _) = with_forced(&[5, 6], chain(&[5, 6, 7, 8]), 3);
        assert_eq!(d.tokens, vec![5, 6, 7]);
    }

    #[test]
    fn a_draft_that_disagrees_is_dropped_after_the_forced_chain() {
        let (d, n) = with_forced(&[5, 6], chain(&[5, 9, 7]), 8);
        assert_eq!((d.tokens, n), (vec![5, 6], 2));
        let (d, n) = with_forced(&[], chain(&[5, 9]), 8);
        assert_eq!((d.tokens, n), (vec![5, 9], 0));
        // A cap under the forced run keeps its head and nothing else.
        let (d, n) = with_forced(&[5, 6, 7], chain(&[5, 6, 7, 8]), 2);
        assert_eq!((d.tokens, n), (vec![5, 6], 2));
    }

    #[test]
    fn a_draft_from_the_extended_context_follows_the_forced_chain() {
        let (d, n) = with_forced_after(&[5, 6], chain(&[7, 8]), 8);
        assert_eq!((d.tokens.as_slice(), n), (&[5, 6, 7, 8][..], 2));
        assert!(d.parents.is_none());
        let t = Draft {
            tokens: vec![7, 9, 8],
            q: vec![DraftQ::OneHot; 3],
            parents: Some(vec![-1, -1, 0]),
            source: None,
        };
        let (d, _) = with_forced_after(&[5], t, 3);
        assert_eq!(d.tokens, vec![5, 7, 9]);
        assert_eq!(d.parents, Some(vec![-1, 0, 0]));
    }

    fn with_forced_after(f: &[u32], d: Draft, max: usize) -> (Draft, usize) {
        prepend_forced(f, d, max)
    }

    #[test]
    fn a_tree_keeps_the_subtree_under_the_forced_path() {
        // root -> {5 -> {6 -> 7, 8}, 9}
        let t = Draft {
            tokens: vec![5, 9, 6, 8, 7],
            q: vec![DraftQ::OneHot; 5],
            parents: Some(vec![-1, -1, 0, 0, 2]),
            source: None,
        };
        let (d, n) = with_forced(&[5], t.clone(), 8);
        assert_eq!(n, 1);
        assert_eq!(d.tokens, vec![5, 6, 8, 7]);
        assert_eq!(d.parents, Some(vec![-1, 0, 0, 1]));
        let (d, _) = with_forced(&[5, 6], t, 8);
        assert_eq!(d.tokens, vec![5, 6, 7]);
        assert!(d.parents.is_none());
    }
}
