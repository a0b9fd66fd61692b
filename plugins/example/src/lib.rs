//! An example third-party proposer: "bigram" drafting. It remembers, per
//! sequence, which token most often followed each token, and drafts by
//! chaining those most frequent successors.
//!
//! Build: `cargo build --release` in this directory gives
//! `target/release/libspecd_example_proposer.so`; point a `[[proposer]]`
//! table's `path` at it.
//!
//! Options: `max_draft` (3), `panic_on_propose` (false; for failure tests),
//! `tree` (false) and `width` (2): with `tree`, drafts are trees: at every
//! level the most likely successor continues the line and `width - 1`
//! siblings hang beside it; under sampling every node's children are drawn
//! without replacement from the bigram distribution (smoothed over the whole
//! vocabulary), which is reported as the full q of the first child and
//! shared by its siblings. A worked example of the tree half of the ABI.

use std::collections::HashMap;

use specd_plugin_sdk::{abi, Caps, Host, Options, Plugin, Proposal, SeqView, Siblings, Q};

#[derive(Default)]
struct Counts {
    /// token -> (successor -> count)
    next: HashMap<u32, HashMap<u32, u32>>,
    last: Option<u32>,
}

impl Counts {
    fn push(&mut self, t: u32) {
        if let Some(p) = self.last {
            *self.next.entry(p).or_default().entry(t).or_default() += 1;
        }
        self.last = Some(t);
    }

    /// The bigram distribution after `t`, smoothed over `vocab` tokens.
    fn dist(&self, t: u32, vocab: usize) -> Vec<f32> {
        let mut w = vec![0.05f64; vocab];
        if let Some(next) = self.next.get(&t) {
            for (&n, &c) in next {
                if (n as usize) < vocab {
                    w[n as usize] += c as f64;
                }
            }
        }
        let z: f64 = w.iter().sum();
        w.iter().map(|x| (x / z) as f32).collect()
    }

    fn best(&self, t: u32) -> Option<u32> {
        self.next
            .get(&t)?
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(&tok, _)| tok)
    }
}

pub struct Bigram {
    max_draft: usize,
    panic_on_propose: bool,
    tree: bool,
    width: usize,
    seqs: HashMap<u64, Counts>,
    host: Host,
    /// A small xorshift generator per instance, for sampled trees.
    rng: u64,
}

impl Bigram {
    fn uniform(&mut self, seed: u64) -> f64 {
        self.rng ^= seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Draw `k` distinct tokens from `q`, one after another without
    /// replacement (each from `q` renormalised without the earlier ones).
    fn draw_distinct(&mut self, q: &[f32], k: usize, seed: u64) -> Vec<u32> {
        let mut out: Vec<u32> = Vec::new();
        for _ in 0..k.min(q.len()) {
            let mass: f64 = q
                .iter()
                .enumerate()
                .filter(|(i, _)| !out.contains(&(*i as u32)))
                .map(|(_, &p)| p as f64)
                .sum();
            let u = self.uniform(seed) * mass;
            let mut cum = 0.0;
            let mut pick = None;
            for (i, &p) in q.iter().enumerate() {
                if out.contains(&(i as u32)) {
                    continue;
                }
                cum += p as f64;
                pick = Some(i as u32);
                if u < cum {
                    break;
                }
            }
            match pick {
                Some(t) => out.push(t),
                None => break,
            }
        }
        out
    }

    /// A tree of at most `max` nodes: a line of first children, each level
    /// with `width - 1` siblings beside it.
    fn tree(&mut self, c: &Counts, last: u32, max: usize, greedy: bool, seed: u64) -> Proposal {
        let vocab = self.host.vocab_size();
        let mut p = Proposal {
            parents: Some(Vec::new()),
            ..Default::default()
        };
        let (mut cur, mut parent) = (last, -1i32);
        while p.tokens.len() < max {
            let q = c.dist(cur, vocab);
            let kids = if greedy {
                // Deterministic: the most likely successors, best first.
                let mut order: Vec<u32> = (0..vocab as u32).collect();
                order.sort_by(|&a, &b| q[b as usize].total_cmp(&q[a as usize]).then(a.cmp(&b)));
                order.truncate(self.width);
                order
            } else {
                self.draw_distinct(&q, self.width, seed)
            };
            let first = p.tokens.len();
            for (j, &k) in kids.iter().enumerate() {
                if p.tokens.len() >= max {
                    break;
                }
                p.tokens.push(k);
                p.parents.as_mut().unwrap().push(parent);
                p.q.push(match (greedy, j) {
                    (true, _) => Q::OneHot,
                    (false, 0) => Q::Full(q.clone()),
                    (false, _) => Q::AsFirstSibling,
                });
            }
            if p.tokens.len() == first {
                break;
            }
            cur = p.tokens[first];
            parent = first as i32;
        }
        p
    }
}

impl Plugin for Bigram {
    const NAME: &'static str = "example-bigram";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn default_capabilities() -> Caps {
        Caps::one_hot(3)
    }

    fn create(o: &Options, host: Host) -> Result<Self, String> {
        o.reject_unknown(&["max_draft", "panic_on_propose", "tree", "width"])?;
        host.log(2, "example bigram proposer created");
        Ok(Self {
            max_draft: o.get("max_draft", 3usize)?,
            panic_on_propose: o.get("panic_on_propose", false)?,
            tree: o.get("tree", false)?,
            width: o.get("width", 2usize)?.max(1),
            seqs: HashMap::new(),
            host,
            rng: 0x853c_49e6_748f_ea9b,
        })
    }

    fn capabilities(&self) -> Caps {
        if self.tree {
            Caps {
                q_kind: abi::Q_FULL,
                tree: true,
                siblings: Siblings::WithoutReplacement,
                ..Caps::one_hot(self.max_draft as u32)
            }
        } else {
            Caps::one_hot(self.max_draft as u32)
        }
    }

    fn start(&mut self, seq: u64, tokens: &[u32]) -> Result<(), String> {
        let mut c = Counts::default();
        for &t in tokens {
            c.push(t);
        }
        self.seqs.insert(seq, c);
        Ok(())
    }

    fn propose(&mut self, batch: &[SeqView<'_>]) -> Result<Vec<Proposal>, String> {
        if self.panic_on_propose {
            panic!("example plugin asked to panic in propose");
        }
        let mut out = Vec::with_capacity(batch.len());
        for s in batch {
            if self.tree {
                let c = self
                    .seqs
                    .remove(&s.seq)
                    .ok_or_else(|| format!("unknown sequence {}", s.seq))?;
                let last = s.tokens.last().copied().unwrap_or(0);
                let max = s.max_draft.min(self.max_draft);
                let seed = s.seed ^ s.tokens.len() as u64;
                out.push(self.tree(&c, last, max, s.is_greedy(), seed));
                self.seqs.insert(s.seq, c);
                continue;
            }
            let c = self
                .seqs
                .get(&s.seq)
                .ok_or_else(|| format!("unknown sequence {}", s.seq))?;
            let mut draft = Vec::new();
            let mut cur = s.tokens.last().copied();
            while draft.len() < s.max_draft.min(self.max_draft) {
                match cur.and_then(|t| c.best(t)) {
                    Some(n) => {
                        draft.push(n);
                        cur = Some(n);
                    }
                    None => break,
                }
            }
            out.push(Proposal::one_hot(draft));
        }
        self.host
            .counter("example_bigram_proposals", out.len() as u64);
        Ok(out)
    }

    fn observe(&mut self, seq: u64, tokens: &[u32], _path: &[u32]) -> Result<(), String> {
        let c = self
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| format!("unknown sequence {seq}"))?;
        for &t in tokens {
            c.push(t);
        }
        Ok(())
    }

    fn finish(&mut self, seq: u64) {
        self.seqs.remove(&seq);
    }
}

specd_plugin_sdk::export_proposer!(Bigram);
