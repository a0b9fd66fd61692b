//! SuffixDecoding (Oliaro et al., 2024): drafts from suffix trees.
//!
//! Each request keeps a suffix tree (a suffix trie cut at `max_depth`) over
//! its prompt and output, updated token by token; a global tree holds the
//! outputs of earlier requests, bounded to `max_global_nodes` by evicting the
//! oldest documents. To draft, the longest suffix of the sequence that
//! occurs in either tree (with a continuation) is found; the draft follows
//! the most frequent child at each step, for at most
//! `floor(factor * match_length)` tokens (capped by `max_draft`). q is
//! one-hot.
//!
//! With `tree = true` the draft is a speculation tree instead, as
//! SuffixDecoding drafts them: from the match, the continuations are
//! expanded best first by their empirical path probability (counts in the
//! suffix tree), up to the engine's node budget, `floor(factor *
//! match_length)` deep, leaving out steps rarer than `min_prob`; of the
//! per-request and the global tree's trees the one with the larger
//! expected accepted length is drafted. Siblings are distinct tokens, each
//! a one-hot candidate the engine tries in turn, so sampling stays exact.
//!
//! With `corpus` set, a third source joins them: a static datastore of the
//! target's own earlier outputs (`datastore`, read by `corpus`), walked
//! through the same [`Walk`] trait; it drafts where its match (at least
//! `corpus_min_match` tokens) is the longer one (chains, which stop below
//! the path probability `corpus_min_prob`) or its tree expects more.
//!
//! Options: `max_depth` (32), `factor` (1.0), `min_match` (1),
//! `max_draft` (8 chain tokens; 16 tree nodes), `max_global_nodes`
//! (200000), `global` (true), `tree` (false), `min_prob` (0.1),
//! `min_score` (0: a tree node's least path probability), `corpus`
//! (off; `builtin`, `auto` or a corpus directory), `corpus_min_match` (2),
//! `corpus_min_prob` (0.5).

use std::collections::{HashMap, VecDeque};

mod corpus;
pub mod datastore;
pub use datastore::Datastore;

use specd_plugin_sdk::{Caps, Host, Options, Plugin, Proposal, SeqView};

const ROOT: u32 = 0;

#[derive(Debug, Clone, Default)]
struct Node {
    /// (token, child) sorted by token.
    children: Vec<(u32, u32)>,
    count: u32,
    depth: u16,
}

/// A suffix trie truncated at `max_depth`, with occurrence counts.
#[derive(Debug, Clone)]
pub struct SuffixTree {
    nodes: Vec<Node>,
    free: Vec<u32>,
    max_depth: usize,
    live: usize,
}

impl SuffixTree {
    pub fn new(max_depth: usize) -> Self {
        Self {
            nodes: vec![Node::default()],
            free: Vec::new(),
            max_depth: max_depth.clamp(1, u16::MAX as usize),
            live: 1,
        }
    }

    /// Nodes in use (the root included).
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 1
    }

    fn child(&self, node: u32, tok: u32) -> Option<u32> {
        let c = &self.nodes[node as usize].children;
        c.binary_search_by_key(&tok, |&(t, _)| t)
            .ok()
            .map(|i| c[i].1)
    }

    fn child_or_insert(&mut self, node: u32, tok: u32) -> u32 {
        let depth = self.nodes[node as usize].depth + 1;
        match self.nodes[node as usize]
            .children
            .binary_search_by_key(&tok, |&(t, _)| t)
        {
            Ok(i) => self.nodes[node as usize].children[i].1,
            Err(i) => {
                let fresh = Node {
                    children: Vec::new(),
                    count: 0,
                    depth,
                };
                let id = match self.free.pop() {
                    Some(id) => {
                        self.nodes[id as usize] = fresh;
                        id
                    }
                    None => {
                        self.nodes.push(fresh);
                        (self.nodes.len() - 1) as u32
                    }
                };
                self.live += 1;
                self.nodes[node as usize].children.insert(i, (tok, id));
                id
            }
        }
    }

    /// Extend every active suffix (ending at the previous token) by `tok`;
    /// `active` becomes the suffixes ending at `tok`.
    pub fn push(&mut self, active: &mut Vec<u32>, tok: u32) {
        let mut next = Vec::with_capacity(active.len() + 1);
        for &a in active.iter().chain(std::iter::once(&ROOT)) {
            if (self.nodes[a as usize].depth as usize) < self.max_depth {
                let c = self.child_or_insert(a, tok);
                self.nodes[c as usize].count += 1;
                next.push(c);
            }
        }
        *active = next;
    }

    /// Add every suffix window of `doc`.
    pub fn insert(&mut self, doc: &[u32]) {
        let mut active = Vec::new();
        for &t in doc {
            self.push(&mut active, t);
        }
    }

    /// Remove a document inserted earlier, pruning nodes that reach zero.
    pub fn remove(&mut self, doc: &[u32]) {
        for start in 0..doc.len() {
            let end = (start + self.max_depth).min(doc.len());
            let mut node = ROOT;
            for &t in &doc[start..end] {
                let Some(c) = self.child(node, t) else { break };
                let n = &mut self.nodes[c as usize];
                n.count = n.count.saturating_sub(1);
                if n.count == 0 {
                    // Its whole subtree has count 0 too (a child never
                    // outnumbers its parent): unlink and free it.
                    let pos = self.nodes[node as usize]
                        .children
                        .binary_search_by_key(&t, |&(tk, _)| tk)
                        .expect("child present");
                    self.nodes[node as usize].children.remove(pos);
                    self.free_subtree(c);
                    break;
                }
                node = c;
            }
        }
    }

    fn free_subtree(&mut self, root: u32) {
        let mut stack = vec![root];
        while let Some(n) = stack.pop() {
            let children = std::mem::take(&mut self.nodes[n as usize].children);
            stack.extend(children.into_iter().map(|(_, c)| c));
            self.free.push(n);
            self.live -= 1;
        }
    }

    /// Longest suffix of `context` (at most `max_depth`) present in the tree
    /// with at least one continuation: `(node, match length)`.
    pub fn longest_match(&self, context: &[u32]) -> Option<(u32, usize)> {
        let n = context.len();
        for len in (1..=self.max_depth.min(n)).rev() {
            let mut node = ROOT;
            let mut ok = true;
            for &t in &context[n - len..] {
                match self.child(node, t) {
                    Some(c) => node = c,
                    None => {
                        ok = false;
                        break;
                    }
                }
            }
            if ok && !self.nodes[node as usize].children.is_empty() {
                return Some((node, len));
            }
        }
        None
    }

    /// Follow the most frequent child (lowest token on ties) for up to `k`
    /// steps.
    pub fn continuation(&self, node: u32, k: usize) -> Vec<u32> {
        continuation(self, node, k, 0.0)
    }

    /// A speculation tree from `node` (SuffixDecoding's): see [`speculate`].
    pub fn speculate(
        &self,
        node: u32,
        budget: usize,
        depth: usize,
        min_prob: f64,
    ) -> (Vec<u32>, Vec<i32>, Vec<f64>) {
        speculate(self, node, budget, depth, min_prob)
    }

    /// Occurrence count of the path `tokens` (0 if absent).
    pub fn count(&self, tokens: &[u32]) -> u32 {
        let mut node = ROOT;
        for &t in tokens {
            match self.child(node, t) {
                Some(c) => node = c,
                None => return 0,
            }
        }
        self.nodes[node as usize].count
    }
}

/// What drafting walks: the suffix trees and the corpus datastore.
pub trait Walk {
    type Node: Copy;
    /// The children of `n` whose step probability (count over `total`) is
    /// at least `min_prob` (others may be returned too), as `(token,
    /// count, child)` in token order, and `total`, the sum of all
    /// children's counts.
    fn kids(&self, n: Self::Node, min_prob: f64) -> (Vec<(u32, u32, Self::Node)>, u64);
}

impl Walk for SuffixTree {
    type Node = u32;
    fn kids(&self, n: u32, _min_prob: f64) -> (Vec<(u32, u32, u32)>, u64) {
        let kids: Vec<(u32, u32, u32)> = self.nodes[n as usize]
            .children
            .iter()
            .map(|&(t, c)| (t, self.nodes[c as usize].count, c))
            .collect();
        let total = kids.iter().map(|k| u64::from(k.1)).sum();
        (kids, total)
    }
}

impl Walk for Datastore {
    type Node = datastore::Span;
    fn kids(&self, n: Self::Node, min_prob: f64) -> (Vec<(u32, u32, Self::Node)>, u64) {
        let (kids, total) = self.children(n, min_prob);
        (kids, u64::from(total))
    }
}

/// Follow the most frequent child (lowest token on ties) for up to `k`
/// steps, stopping before the path's empirical probability (the product of
/// its steps' count over their siblings' total) falls below `min_path`.
pub fn continuation<W: Walk>(w: &W, mut node: W::Node, k: usize, min_path: f64) -> Vec<u32> {
    let mut out = Vec::with_capacity(k);
    let mut path = 1.0;
    while out.len() < k {
        let (kids, total) = w.kids(node, min_path / path);
        let best = kids
            .iter()
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
            .copied();
        match best {
            Some((t, c, n)) if total > 0 && path * (c as f64 / total as f64) >= min_path => {
                path *= c as f64 / total as f64;
                out.push(t);
                node = n;
            }
            _ => break,
        }
    }
    out
}

/// A speculation tree from `node` (SuffixDecoding's): candidates are
/// scored by their empirical path probability (the product, along the
/// path, of each child's count over the sum of its siblings' counts);
/// the best-scoring candidate joins the tree next (best first, so a
/// parent always precedes its children and the kept nodes are the
/// `budget` most probable paths' nodes), until `budget` nodes, depth
/// `depth`, or no candidate whose step probability is at least
/// `min_prob`. Returns (tokens, parents, scores), parents as indices
/// into the returned nodes (-1: a child of the context).
pub fn speculate<W: Walk>(
    w: &W,
    node: W::Node,
    budget: usize,
    depth: usize,
    min_prob: f64,
) -> (Vec<u32>, Vec<i32>, Vec<f64>) {
    // A max-heap by score, ties to the earlier-pushed candidate so the
    // result is stable.
    let mut heap: std::collections::BinaryHeap<Candidate<W::Node>> = Default::default();
    let mut seq = 0u64;
    let mut push_children = |heap: &mut std::collections::BinaryHeap<Candidate<W::Node>>,
                             at: W::Node,
                             score: f64,
                             parent: i32,
                             d: usize| {
        if d >= depth {
            return;
        }
        let (kids, total) = w.kids(at, min_prob);
        if total == 0 {
            return;
        }
        for (tok, count, c) in kids {
            let p = f64::from(count) / total as f64;
            if p < min_prob {
                continue;
            }
            seq += 1;
            heap.push(Candidate {
                score: score * p,
                seq,
                tok,
                node: c,
                parent,
                depth: d + 1,
            });
        }
    };
    push_children(&mut heap, node, 1.0, -1, 0);
    let (mut tokens, mut parents, mut scores) = (Vec::new(), Vec::new(), Vec::new());
    while tokens.len() < budget {
        let Some(c) = heap.pop() else { break };
        let me = tokens.len() as i32;
        tokens.push(c.tok);
        parents.push(c.parent);
        scores.push(c.score);
        push_children(&mut heap, c.node, c.score, me, c.depth);
    }
    (tokens, parents, scores)
}

/// The nodes of a speculation tree (as `speculate` returns it: best first,
/// so scores never rise and parents precede children) whose path
/// probability is at least `min_score`: a prefix, itself a tree.
pub fn prune_by_score(
    (mut tokens, mut parents, mut scores): (Vec<u32>, Vec<i32>, Vec<f64>),
    min_score: f64,
) -> (Vec<u32>, Vec<i32>, Vec<f64>) {
    let keep = scores.iter().take_while(|&&x| x >= min_score).count();
    tokens.truncate(keep);
    parents.truncate(keep);
    scores.truncate(keep);
    (tokens, parents, scores)
}

/// A node waiting to join a speculation tree.
#[derive(Debug, Clone, Copy)]
struct Candidate<N> {
    score: f64,
    /// Push order: among equal scores the earlier candidate wins.
    seq: u64,
    tok: u32,
    node: N,
    parent: i32,
    depth: usize,
}

impl<N> PartialEq for Candidate<N> {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == std::cmp::Ordering::Equal
    }
}
impl<N> Eq for Candidate<N> {}
impl<N> PartialOrd for Candidate<N> {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl<N> Ord for Candidate<N> {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.seq.cmp(&self.seq))
    }
}

/// Earlier outputs, bounded in nodes; the oldest documents go first.
#[derive(Debug, Clone)]
pub struct GlobalTree {
    pub tree: SuffixTree,
    docs: VecDeque<Vec<u32>>,
    max_nodes: usize,
}

impl GlobalTree {
    pub fn new(max_depth: usize, max_nodes: usize) -> Self {
        Self {
            tree: SuffixTree::new(max_depth),
            docs: VecDeque::new(),
            max_nodes,
        }
    }

    pub fn add(&mut self, doc: Vec<u32>) {
        if doc.is_empty() {
            return;
        }
        self.tree.insert(&doc);
        self.docs.push_back(doc);
        while self.tree.len() > self.max_nodes {
            let Some(old) = self.docs.pop_front() else {
                break;
            };
            self.tree.remove(&old);
        }
    }

    pub fn docs(&self) -> usize {
        self.docs.len()
    }
}

struct SeqState {
    tree: SuffixTree,
    active: Vec<u32>,
    prompt_len: usize,
    tokens: Vec<u32>,
}

pub struct Suffix {
    max_depth: usize,
    factor: f64,
    min_match: usize,
    max_draft: usize,
    use_global: bool,
    /// Draft speculation trees (else chains of the most frequent path).
    tree: bool,
    /// Least step probability of a tree node.
    min_prob: f64,
    /// Least path probability (score) of a tree node.
    min_score: f64,
    global: GlobalTree,
    /// The target's earlier outputs (`corpus`), with the shortest match and
    /// the least step probability it drafts from.
    corpus: Option<Datastore>,
    corpus_min_match: usize,
    corpus_min_prob: f64,
    seqs: HashMap<u64, SeqState>,
    host: Host,
}

impl Suffix {
    /// Draft for one context: a speculation tree grown from the match in
    /// the per-request and in the global tree, whichever expects more
    /// accepted tokens (the sum of its nodes' path probabilities), or with
    /// `tree = false` the chain `draft_chain` gives.
    fn draft(&self, seq: u64, context: &[u32], cap: usize) -> Proposal {
        if !self.tree {
            return Proposal::one_hot(self.draft_chain(seq, context, cap));
        }
        let budget = cap.min(self.max_draft);
        if budget == 0 {
            return Proposal::one_hot(Vec::new());
        }
        let mut best: Option<(f64, Vec<u32>, Vec<i32>)> = None;
        let mut consider = |tree: (Vec<u32>, Vec<i32>, Vec<f64>)| {
            let (tokens, parents, scores) = prune_by_score(tree, self.min_score);
            let value: f64 = scores.iter().sum();
            if !tokens.is_empty() && best.as_ref().is_none_or(|b| value > b.0) {
                best = Some((value, tokens, parents));
            }
        };
        let depth = |len: usize| {
            ((self.factor * len as f64).floor() as usize)
                .max(1)
                .min(self.max_depth)
        };
        let local = self.seqs.get(&seq).map(|s| &s.tree);
        let global = self.use_global.then_some(&self.global.tree);
        for tree in [local, global].into_iter().flatten() {
            let Some((node, len)) = tree.longest_match(context) else {
                continue;
            };
            if len >= self.min_match {
                consider(tree.speculate(node, budget, depth(len), self.min_prob));
            }
        }
        if let Some((ds, (span, len))) = self.corpus_match(context) {
            let min_prob = self.min_prob.max(self.corpus_min_prob);
            consider(speculate(ds, span, budget, depth(len), min_prob));
        }
        match best {
            Some((_, tokens, parents)) => Proposal {
                tokens,
                q: Vec::new(),
                parents: Some(parents),
            },
            None => Proposal::one_hot(Vec::new()),
        }
    }

    /// A chain: the most frequent continuation of the longer match.
    fn draft_chain(&self, seq: u64, context: &[u32], cap: usize) -> Vec<u32> {
        let local = self
            .seqs
            .get(&seq)
            .and_then(|s| s.tree.longest_match(context).map(|m| (&s.tree, m)));
        let global = if self.use_global {
            self.global
                .tree
                .longest_match(context)
                .map(|m| (&self.global.tree, m))
        } else {
            None
        };
        let best = match (local, global) {
            (Some(l), Some(g)) => Some(if g.1 .1 > l.1 .1 { g } else { l }),
            (l, g) => l.or(g),
        };
        let k = |len: usize| {
            ((self.factor * len as f64).floor() as usize)
                .max(1)
                .min(cap)
                .min(self.max_draft)
        };
        let best = best.filter(|b| b.1 .1 >= self.min_match);
        // The corpus drafts where its match is the longer one.
        if let Some((ds, (span, len))) = self.corpus_match(context) {
            if best.is_none_or(|b| len > b.1 .1) {
                return continuation(ds, span, k(len), self.corpus_min_prob);
            }
        }
        let Some((tree, (node, len))) = best else {
            return Vec::new();
        };
        tree.continuation(node, k(len))
    }

    /// The corpus's longest match, if at least `corpus_min_match` long.
    fn corpus_match(&self, context: &[u32]) -> Option<(&Datastore, (datastore::Span, usize))> {
        let ds = self.corpus.as_ref()?;
        let m = ds.longest_match(context)?;
        (m.1 >= self.corpus_min_match).then_some((ds, m))
    }
}

impl Suffix {
    /// One-hot drafts of up to `max_draft` tokens (tree nodes), as trees
    /// of distinct siblings at most `max_depth` deep when `tree`.
    fn caps(max_draft: usize, tree: bool, max_depth: usize) -> Caps {
        let mut c = Caps::one_hot(max_draft as u32);
        if tree {
            c.tree = true;
            c.max_depth = max_depth.min(max_draft) as u32;
            c.siblings = specd_plugin_sdk::Siblings::WithoutReplacement;
        }
        c
    }
}

impl Plugin for Suffix {
    const NAME: &'static str = "suffix";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn default_capabilities() -> Caps {
        Self::caps(8, false, 32)
    }

    fn create(o: &Options, host: Host) -> Result<Self, String> {
        o.reject_unknown(&[
            "max_depth",
            "factor",
            "min_match",
            "max_draft",
            "max_global_nodes",
            "global",
            "tree",
            "min_prob",
            "min_score",
            "corpus",
            "corpus_min_match",
            "corpus_min_prob",
        ])?;
        let max_depth = o.get("max_depth", 32usize)?;
        let factor = o.get("factor", 1.0f64)?;
        if max_depth == 0 || factor.is_nan() || factor <= 0.0 {
            return Err("option `max_depth` must be >= 1 and `factor` > 0".into());
        }
        let tree = o.get("tree", false)?;
        // A probability option, refused by name outside [0, 1].
        let probability = |key: &str, default: f64| -> Result<f64, String> {
            let v = o.get(key, default)?;
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("option `{key}` must be in [0, 1], got {v}"));
            }
            Ok(v)
        };
        let min_prob = probability("min_prob", 0.1)?;
        let min_score = probability("min_score", 0.0)?;
        let corpus_min_prob = probability("corpus_min_prob", 0.5)?;
        let corpus = corpus::load(&o.get("corpus", String::new())?, &host, max_depth)?;
        Ok(Self {
            corpus,
            corpus_min_match: o.get("corpus_min_match", 2usize)?,
            corpus_min_prob,
            max_depth,
            factor,
            min_match: o.get("min_match", 1usize)?,
            max_draft: o.get("max_draft", if tree { 16usize } else { 8 })?,
            use_global: o.get("global", true)?,
            tree,
            min_prob,
            min_score,
            global: GlobalTree::new(max_depth, o.get("max_global_nodes", 200_000usize)?),
            seqs: HashMap::new(),
            host,
        })
    }

    fn capabilities(&self) -> Caps {
        Self::caps(self.max_draft, self.tree, self.max_depth)
    }

    fn start(&mut self, seq: u64, tokens: &[u32]) -> Result<(), String> {
        let mut st = SeqState {
            tree: SuffixTree::new(self.max_depth),
            active: Vec::new(),
            prompt_len: tokens.len(),
            tokens: Vec::new(),
        };
        for &t in tokens {
            st.tree.push(&mut st.active, t);
        }
        // On a restart the earlier output is already in `tokens`; keep the
        // original prompt length if we had one.
        if let Some(old) = self.seqs.get(&seq) {
            st.prompt_len = old.prompt_len;
            st.tokens = tokens[old.prompt_len.min(tokens.len())..].to_vec();
        }
        self.seqs.insert(seq, st);
        Ok(())
    }

    fn propose(&mut self, batch: &[SeqView<'_>]) -> Result<Vec<Proposal>, String> {
        let drafts: Vec<Proposal> = batch
            .iter()
            .map(|s| self.draft(s.seq, s.tokens, s.max_draft))
            .collect();
        let hits = drafts.iter().filter(|d| !d.tokens.is_empty()).count();
        self.host.counter("suffix_matches", hits as u64);
        Ok(drafts)
    }

    fn observe(&mut self, seq: u64, tokens: &[u32], _path: &[u32]) -> Result<(), String> {
        let st = self
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| format!("observe for unknown sequence {seq}"))?;
        for &t in tokens {
            st.tree.push(&mut st.active, t);
            st.tokens.push(t);
        }
        Ok(())
    }

    fn finish(&mut self, seq: u64) {
        if let Some(st) = self.seqs.remove(&seq) {
            if self.use_global {
                self.global.add(st.tokens);
            }
        }
    }
}

#[cfg(feature = "plugin")]
specd_plugin_sdk::export_proposer!(Suffix);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_every_window_and_truncates_at_depth() {
        let mut t = SuffixTree::new(3);
        t.insert(&[1, 2, 1, 2, 3]);
        assert_eq!(t.count(&[1, 2]), 2);
        assert_eq!(t.count(&[2]), 2);
        assert_eq!(t.count(&[1, 2, 3]), 1);
        assert_eq!(t.count(&[2, 1, 2]), 1);
        assert_eq!(t.count(&[1, 2, 1, 2]), 0, "deeper than max_depth");
        assert_eq!(t.count(&[3, 1]), 0);
    }

    #[test]
    fn incremental_push_equals_bulk_insert() {
        let doc = [5u32, 6, 5, 6, 7, 5, 6, 5];
        let mut a = SuffixTree::new(4);
        a.insert(&doc);
        let mut b = SuffixTree::new(4);
        let mut act = Vec::new();
        for &x in &doc {
            b.push(&mut act, x);
        }
        for i in 0..doc.len() {
            for j in i + 1..=doc.len().min(i + 4) {
                assert_eq!(a.count(&doc[i..j]), b.count(&doc[i..j]));
            }
        }
        assert_eq!(a.len(), b.len());
    }

    #[test]
    fn longest_match_and_most_frequent_continuation() {
        let mut t = SuffixTree::new(8);
        // After [1, 2]: 3 follows twice, 4 once.
        t.insert(&[1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 7]);
        let (node, len) = t.longest_match(&[5, 1, 2]).unwrap();
        assert_eq!(len, 2);
        // After [1, 2, 3], 9 and 7 tie: the lower id wins; then the path ends.
        assert_eq!(t.continuation(node, 3), vec![3, 7]);
        // A longer context match wins: [8, 1, 2] -> 3.
        let (node, len) = t.longest_match(&[4, 8, 1, 2]).unwrap();
        assert_eq!(len, 4);
        assert_eq!(t.continuation(node, 2), vec![3, 7]);
        assert!(t.longest_match(&[42]).is_none());
    }

    #[test]
    fn removal_prunes_and_eviction_bounds_nodes() {
        let mut t = SuffixTree::new(4);
        t.insert(&[1, 2, 3]);
        let base = t.len();
        t.insert(&[1, 2, 4, 5]);
        t.remove(&[1, 2, 4, 5]);
        assert_eq!(t.len(), base);
        assert_eq!(t.count(&[1, 2]), 1);
        assert_eq!(t.count(&[2, 4]), 0);
        let mut g = GlobalTree::new(4, 40);
        for d in 0..20u32 {
            g.add((0..6).map(|i| d * 10 + i).collect());
            assert!(g.tree.len() <= 40);
        }
        assert!(g.docs() < 20, "old documents were evicted");
        // The newest document survives.
        assert_eq!(g.tree.count(&[190, 191]), 1);
        assert_eq!(g.tree.count(&[0, 1]), 0);
    }

    #[test]
    fn speculation_trees_take_the_most_probable_paths_best_first() {
        let mut t = SuffixTree::new(8);
        // After [1]: 2 three times (then 3 twice, 4 once), 5 once.
        t.insert(&[1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 5]);
        let (node, len) = t.longest_match(&[7, 1]).unwrap();
        assert_eq!(len, 1);
        let (tokens, parents, scores) = t.speculate(node, 3, 8, 0.0);
        // 2 (3/4), then 2 -> 3 (3/4 * 2/3 = 1/2), then 3 -> 9 (1/2 * 1),
        // ahead of 5 and 2 -> 4 (1/4 each).
        assert_eq!(tokens, vec![2, 3, 9]);
        assert_eq!(parents, vec![-1, 0, 1]);
        // The frequent path runs on (9 -> 1 -> 2 ...: probability 1/2)
        // before the rarer branches (5, 2 -> 4: 1/4) join.
        let (tokens, parents, _) = t.speculate(node, 6, 8, 0.0);
        assert_eq!(parents[..5], [-1, 0, 1, 2, 3]);
        assert_eq!(tokens[5], 5);
        assert!((scores[0] - 0.75).abs() < 1e-12 && (scores[1] - 0.5).abs() < 1e-12);
        // Parents precede their children; scores never rise along a path.
        let (tokens, parents, scores) = t.speculate(node, 64, 8, 0.0);
        for (i, &p) in parents.iter().enumerate() {
            assert!(p < i as i32);
            if p >= 0 {
                assert!(scores[i] <= scores[p as usize]);
            }
        }
        // Every node of the trie below the match is reached (depth 8).
        assert!(tokens.len() >= 7, "{tokens:?}");
        // min_prob drops rare steps; depth bounds the paths.
        let (tokens, parents, scores) = t.speculate(node, 64, 8, 0.3);
        assert!(!tokens
            .iter()
            .zip(&parents)
            .any(|(&t, &p)| t == 5 && p == -1));
        for (i, &p) in parents.iter().enumerate() {
            let step = scores[i] / if p < 0 { 1.0 } else { scores[p as usize] };
            assert!(step >= 0.3, "{tokens:?} {scores:?}");
        }
        let (_, parents, _) = t.speculate(node, 64, 1, 0.0);
        assert!(parents.iter().all(|&p| p == -1));
        // A score floor keeps the most probable paths only: 2 (3/4) and
        // 2 -> 3 (1/2) and on to 9 and 1 (1/2), not 5 or 2 -> 4 (1/4).
        let (tokens, parents, scores) = prune_by_score(t.speculate(node, 64, 8, 0.0), 0.4);
        assert!(scores.iter().all(|&x| x >= 0.4) && !scores.is_empty());
        assert_eq!(tokens[..3], [2, 3, 9]);
        assert!(!tokens.contains(&5) && !tokens.contains(&4), "{tokens:?}");
        for (i, &p) in parents.iter().enumerate() {
            assert!(p < i as i32);
        }
        let (tokens, _, _) = prune_by_score(t.speculate(node, 64, 8, 0.0), 0.9);
        assert!(tokens.is_empty());
    }
}
