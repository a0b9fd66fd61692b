//! A configurable tree proposer (sibling modes, shapes, lossy controls).

use super::*;

/// How `TreeProposer` builds its trees.
pub enum TreeMode {
    /// Greedy: trees of random shape (generated level by level, so the
    /// verifier must reorder them) that hold the true continuation of
    /// `answers` on a random branch, cut short with probability `error` at
    /// each level, among random siblings and distractor subtrees. q is
    /// one-hot.
    Oracle {
        answers: std::collections::HashMap<Vec<u32>, Vec<u32>>,
        error: f64,
    },
    /// Sampling: every node's children drawn from a fresh random q (shared
    /// by the siblings; entries are uniforms raised to `peak`, normalised;
    /// `peak` 0: half the mass on one random token, half spread evenly),
    /// independently or without replacement as the sibling mode says; up to
    /// `width` children per node, `depth` levels.
    Random {
        width: usize,
        depth: usize,
        peak: i32,
    },
    /// Sampling with a one-hot proposer (as suffix and n-gram lookups
    /// draft): trees shaped as `Random`'s, siblings distinct tokens, every
    /// node reporting q = 1 on its own token; candidates drawn from one
    /// fixed peaked distribution.
    RandomOneHot { width: usize, depth: usize },
}

/// A test-only tree proposer (see `TreeMode`).
pub struct TreeProposer {
    pub name: String,
    pub vocab: usize,
    pub max_nodes: usize,
    pub siblings: specd::speculative::proposer::SiblingMode,
    pub mode: TreeMode,
    prompts: std::collections::HashMap<SeqId, usize>,
    rng: Rng,
}

impl TreeProposer {
    pub fn new(
        name: &str,
        vocab: usize,
        max_nodes: usize,
        siblings: specd::speculative::proposer::SiblingMode,
        mode: TreeMode,
        seed: u64,
    ) -> Self {
        Self {
            name: name.into(),
            vocab,
            max_nodes,
            siblings,
            mode,
            prompts: Default::default(),
            rng: Rng::new(seed),
        }
    }

    fn other_token(&mut self, not: &[u32]) -> u32 {
        loop {
            let t = (self.rng.next_u64() % self.vocab as u64) as u32;
            if !not.contains(&t) {
                return t;
            }
        }
    }

    /// A peaked random distribution over the vocabulary.
    fn random_q(&mut self, peak: i32) -> Vec<f32> {
        if peak == 0 {
            let spike = (self.rng.next_u64() % self.vocab as u64) as usize;
            let even = 0.5 / self.vocab as f32;
            return (0..self.vocab)
                .map(|t| even + if t == spike { 0.5 } else { 0.0 })
                .collect();
        }
        let w: Vec<f64> = (0..self.vocab)
            .map(|_| self.rng.next_f64().powi(peak))
            .collect();
        let z: f64 = w.iter().sum();
        w.iter().map(|x| (x / z) as f32).collect()
    }

    fn draw(&mut self, q: &[f32], removed: &[u32]) -> u32 {
        let mass: f64 = q
            .iter()
            .enumerate()
            .filter(|(i, _)| !removed.contains(&(*i as u32)))
            .map(|(_, &p)| p as f64)
            .sum();
        let u = self.rng.next_f64() * mass;
        let mut cum = 0.0;
        let mut last = 0;
        for (i, &p) in q.iter().enumerate() {
            if removed.contains(&(i as u32)) {
                continue;
            }
            cum += p as f64;
            last = i as u32;
            if u < cum {
                return last;
            }
        }
        last
    }

    fn oracle_tree(&mut self, truth: &[u32], max: usize, error: f64) -> Draft {
        let mut tokens: Vec<u32> = Vec::new();
        let mut parents: Vec<i32> = Vec::new();
        let mut on_path: i32 = -1;
        let mut level = 0;
        while tokens.len() < max && level < truth.len() {
            let keep_truth = self.rng.next_f64() >= error;
            let k = 1 + (self.rng.next_u64() % 3) as usize;
            let t = (self.rng.next_u64() % k as u64) as usize;
            let mut next_path = None;
            let mut used = vec![truth[level]];
            for j in 0..k {
                if tokens.len() >= max {
                    break;
                }
                let tok = if j == t && keep_truth {
                    truth[level]
                } else {
                    let x = self.other_token(&used);
                    used.push(x);
                    x
                };
                if j == t && keep_truth {
                    next_path = Some(tokens.len() as i32);
                }
                tokens.push(tok);
                parents.push(on_path);
            }
            // A distractor subtree under some earlier node.
            if tokens.len() < max && !tokens.is_empty() && self.rng.next_f64() < 0.5 {
                let p = (self.rng.next_u64() % tokens.len() as u64) as i32;
                let x = self.other_token(&[]);
                tokens.push(x);
                parents.push(p);
            }
            match next_path {
                Some(p) => on_path = p,
                None => break,
            }
            level += 1;
        }
        Draft {
            q: vec![DraftQ::OneHot; tokens.len()],
            tokens,
            parents: Some(parents),
            source: None,
        }
    }

    fn random_tree(
        &mut self,
        max: usize,
        (width, depth, peak): (usize, usize, i32),
        one_hot: bool,
    ) -> Draft {
        use specd::speculative::proposer::SiblingMode;
        let mut d = Draft {
            parents: Some(Vec::new()),
            ..Default::default()
        };
        // Breadth-first: (parent index, level) to expand.
        let mut frontier: Vec<(i32, usize)> = vec![(-1, 1)];
        while let Some((parent, level)) = (!frontier.is_empty()).then(|| frontier.remove(0)) {
            if level > depth {
                continue;
            }
            let k = if parent < 0 {
                1 + (self.rng.next_u64() % width as u64) as usize
            } else {
                (self.rng.next_u64() % (width as u64 + 1)) as usize
            };
            // One-hot trees draw their candidates from one fixed peaked q
            // (as a lookup proposer favours the same continuations), so a
            // lossy rule's bias does not average out over random q's.
            let q: std::sync::Arc<[f32]> = if one_hot {
                let mut r = Rng::new(7);
                let w: Vec<f64> = (0..self.vocab).map(|_| r.next_f64().powi(3)).collect();
                let z: f64 = w.iter().sum();
                w.iter()
                    .map(|x| (x / z) as f32)
                    .collect::<Vec<f32>>()
                    .into()
            } else {
                self.random_q(peak).into()
            };
            let mut drawn = Vec::new();
            for _ in 0..k {
                if d.tokens.len() >= max {
                    break;
                }
                let removed: &[u32] = match self.siblings {
                    SiblingMode::Iid if !one_hot => &[],
                    _ => &drawn,
                };
                let x = self.draw(&q, removed);
                drawn.push(x);
                frontier.push((d.tokens.len() as i32, level + 1));
                d.tokens.push(x);
                d.q.push(if one_hot {
                    DraftQ::OneHot
                } else {
                    DraftQ::Full(q.clone())
                });
                d.parents.as_mut().unwrap().push(parent);
            }
        }
        d
    }
}

impl Proposer for TreeProposer {
    fn name(&self) -> &str {
        &self.name
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            q_kind: match self.mode {
                TreeMode::Oracle { .. } | TreeMode::RandomOneHot { .. } => QKind::OneHot,
                TreeMode::Random { .. } => QKind::Full,
            },
            max_draft: self.max_nodes,
            tree: true,
            max_depth: self.max_nodes,
            siblings: self.siblings,
            ..Default::default()
        }
    }
    fn start(&mut self, seq: SeqId, prompt: &[u32]) -> Result<(), String> {
        if let TreeMode::Oracle { answers, .. } = &self.mode {
            let len = answers
                .keys()
                .filter(|p| prompt.starts_with(p))
                .map(|p| p.len())
                .max()
                .ok_or("unknown prompt")?;
            self.prompts.insert(seq, len);
        }
        Ok(())
    }
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
        let mut out = Vec::new();
        for b in batch {
            let d = match &self.mode {
                TreeMode::Oracle { answers, error } => {
                    let plen = self.prompts[&b.seq];
                    let truth: Vec<u32> = answers[&b.tokens[..plen]]
                        .iter()
                        .skip(b.tokens.len() - plen)
                        .copied()
                        .collect();
                    let error = *error;
                    self.oracle_tree(&truth, b.max_draft, error)
                }
                TreeMode::Random { width, depth, peak } => {
                    let shape = (*width, *depth, *peak);
                    self.random_tree(b.max_draft, shape, false)
                }
                TreeMode::RandomOneHot { width, depth } => {
                    let shape = (*width, *depth, 1);
                    self.random_tree(b.max_draft, shape, true)
                }
            };
            out.push(d);
        }
        Ok(out)
    }
    fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
        Ok(())
    }
    fn finish(&mut self, seq: SeqId) {
        self.prompts.remove(&seq);
    }
}
