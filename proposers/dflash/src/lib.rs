//! DFlash block drafting as a proposer plugin: a DFlash drafter
//! (`specd_model::dflash`) reads the target's features of a few layers and
//! drafts a whole block in one forward: the query block `[newest token,
//! mask, ..., mask]` gives a distribution for every following position at
//! once, each conditioned on the committed text only (not on the other
//! drafted tokens).
//!
//! Per sequence the plugin keeps each draft layer's context cache: every
//! committed position whose features the host delivered is fused and
//! projected once (`Dflash::context`). Drafts never enter that cache, so a
//! rejected block costs nothing to roll back.
//!
//! Drafting (`mode`):
//! - `chain` (default): slot d gives the d-th drafted token (greedy: its
//!   argmax; sampling: drawn from its q after the request's temperature /
//!   top-k / top-p / min-p).
//! - `tree`: every node at depth d takes children from slot d+1's
//!   candidates (the block's distributions do not depend on the drafted
//!   tokens). Greedy: the `max_draft` nodes of highest cumulative
//!   log-probability, best first over each slot's `top_k` candidates.
//!   Sampling: the root's children and each expanded node's are drawn
//!   without replacement from the slot's q, their number fixed before
//!   they are drawn, so rejection sampling stays lossless.
//!
//! Options: `model` (the drafter's directory: config.json and safetensors
//! in z-lab's layout; default: the drafter built into the plugin for
//! SmolLM2-135M-Instruct), `mode` ("chain" | "tree"), `max_draft`
//! (tree nodes or chain length cap; default 16 for trees, `depth` for
//! chains), `depth`
//! (most slots used, default block_size - 1), `top_k` (4), `seed`,
//! `window` (most context positions one catch-up takes in besides the
//! first 4, default 1024; 0: all the host delivered), `min_confidence`
//! (default 0: off; a chain stops, a greedy tree prunes, where the
//! product of the drafted tokens' probabilities times the next slot's
//! largest falls below it, decided before that slot is drawn from).
//!
//! Invariant: every drafted token is drawn from the q reported for it
//! (greedy: any token; the host checks against the target's argmax), and
//! how many children a node gets is fixed before they are drawn.

use std::collections::HashMap;
use std::path::PathBuf;

use specd_model::dflash::Dflash;
use specd_model::eagle::KvStore;
use specd_model::sampler::{self, Rng, SamplingParams};
use specd_plugin_sdk::{
    abi, feature_rows, take_without_replacement, Caps, FeatureRows, Host, Options, Plugin,
    Proposal, SeqView, Siblings, Q,
};

/// Positions a window never drops: the opening tokens of the chat
/// template, which every training sample starts with.
const SINK: usize = 4;

const OPTIONS: [&str; 9] = [
    "model",
    "mode",
    "max_draft",
    "depth",
    "top_k",
    "seed",
    "window",
    "min_confidence",
    "test_control",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Chain,
    Tree,
}

struct SeqState {
    /// Per draft layer: keys and values of the committed positions.
    ctx: Vec<KvStore>,
    /// Position of each context row (ascending).
    pos: Vec<usize>,
    /// Next position whose features were not taken in.
    next: usize,
    /// Delivered features of positions not yet committed before the
    /// newest token (kept until the sequence reaches past them).
    pending: FeatureRows,
    rng: Rng,
}

pub struct DflashPlugin {
    model: Dflash,
    host: Host,
    mode: Mode,
    max_draft: usize,
    depth: usize,
    top_k: usize,
    seed: u64,
    window: usize,
    log_min_conf: f32,
    /// Test control only (`test_control = "argmax_sampled"`): under
    /// sampling draft each slot's most likely token while reporting the
    /// slot's q. Lossy; the chi-square test must catch it.
    argmax_sampled: bool,
    /// The mask rows' input, fetched once.
    mask_row: Option<Vec<f32>>,
    seqs: HashMap<u64, SeqState>,
}

/// A draft node.
#[derive(Debug, Clone)]
struct Node {
    token: u32,
    parent: Option<usize>,
    depth: usize,
    score: f32,
}

fn params_of(s: &SeqView<'_>) -> SamplingParams {
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: s.top_p,
        min_p: s.min_p,
        seed: s.seed,
        ..Default::default()
    }
}

#[cfg(feature = "builtin-drafter")]
mod builtin {
    pub const CONFIG: &str = include_str!("../drafters/smollm2-135m-instruct/config.json");
    pub const WEIGHTS: &[u8] =
        include_bytes!("../drafters/smollm2-135m-instruct/model.safetensors");
}

fn load(o: &Options, host: &Host) -> Result<Dflash, String> {
    let raw = o.get("model", String::new())?;
    let layers = host
        .n_layers()
        .ok_or("the host does not say how many layers the target has (ABI 2.1 or later needed)")?;
    if raw.is_empty() {
        #[cfg(feature = "builtin-drafter")]
        {
            return Dflash::from_bytes(
                "builtin:smollm2-135m-instruct",
                builtin::CONFIG,
                builtin::WEIGHTS,
                host.hidden_size(),
                host.vocab_size(),
                layers,
            );
        }
        #[cfg(not(feature = "builtin-drafter"))]
        return Err(
            "option `model`: path to the DFlash drafter's directory is required (this build has no built-in drafter)"
                .into(),
        );
    }
    let path = match (raw.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(&raw),
    };
    Dflash::load(&path, host.hidden_size(), host.vocab_size(), layers)
}

impl DflashPlugin {
    fn mask_row(&mut self) -> Result<Vec<f32>, String> {
        if let Some(m) = &self.mask_row {
            return Ok(m.clone());
        }
        let m = match &self.model.mask_embedding {
            Some(m) => m.clone(),
            None => self
                .host
                .embed(&[self.model.cfg.mask_token])
                .ok_or("the host offers no target embeddings")?,
        };
        self.mask_row = Some(m.clone());
        Ok(m)
    }

    /// Take in the features delivered for each sequence: every committed
    /// position before the newest token goes through the fusion and each
    /// layer's key and value projections (all sequences in one call).
    fn ingest(&mut self, batch: &[SeqView<'_>]) -> Result<(), String> {
        let h = self.model.cfg.hidden;
        let nl = self.model.cfg.feature_layers.len();
        let layers = self.model.layers.len();
        let kvd = self.model.cfg.kv_dim();
        let seed = self.seed;
        let window = self.window;
        let mut take: Vec<(u64, FeatureRows)> = Vec::new();
        for s in batch {
            if s.hidden_rows > 0 && (s.hidden_width != h || s.hidden_layers != nl) {
                return Err(format!(
                    "features of {} layers x {} delivered; the drafter reads {nl} x {h}",
                    s.hidden_layers, s.hidden_width
                ));
            }
            let st = self.seqs.entry(s.seq).or_insert_with(|| SeqState {
                ctx: (0..layers).map(|_| KvStore::new(kvd)).collect(),
                pos: Vec::new(),
                next: 0,
                pending: Vec::new(),
                rng: Rng::new(seed ^ s.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            });
            let start = s.hidden_start as usize;
            if s.tokens.len() < st.next + 1 {
                // The sequence is shorter than its context: start over.
                for c in &mut st.ctx {
                    c.truncate(0);
                }
                st.pos.clear();
                st.next = 0;
                st.pending.clear();
            }
            if s.hidden_rows > 0 && start < st.next {
                // Positions seen again (the host recomputed them).
                let keep = st.pos.partition_point(|&p| p < start);
                for c in &mut st.ctx {
                    c.truncate(keep);
                }
                st.pos.truncate(keep);
                st.next = start;
                st.pending.clear();
            }
            let ready = feature_rows(s, &mut st.pending, window, SINK)?;
            if !ready.is_empty() {
                take.push((s.seq, ready));
            }
        }
        if take.is_empty() {
            return Ok(());
        }
        let (mut feats, mut pos) = (Vec::new(), Vec::new());
        for (_, ready) in &take {
            for (p, f) in ready {
                feats.extend_from_slice(f);
                pos.push(*p);
            }
        }
        let kv = self.model.context(&feats, &pos);
        let mut r0 = 0;
        for (seq, ready) in take {
            let st = self.seqs.get_mut(&seq).ok_or("sequence state lost")?;
            for (c, new) in st.ctx.iter_mut().zip(&kv) {
                c.extend_rows(new, r0..r0 + ready.len());
            }
            st.pos.extend(ready.iter().map(|(p, _)| *p));
            st.next = ready[ready.len() - 1].0 + 1;
            r0 += ready.len();
        }
        Ok(())
    }

    /// The slot's draft distribution under `params`, in target ids.
    fn q_of(&self, logits: &[f32], params: &SamplingParams) -> sampler::Distribution {
        let mut d = sampler::distribution(logits, params);
        for id in &mut d.ids {
            *id = self.model.to_target(*id);
        }
        d
    }

    /// The `k` most likely tokens of a slot (target ids) with their
    /// log-probabilities at temperature 1, best first.
    fn top(&self, logits: &[f32], k: usize) -> Vec<(u32, f32)> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        let k = k.min(idx.len());
        if k == 0 {
            return Vec::new();
        }
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            logits[b].total_cmp(&logits[a]).then(a.cmp(&b))
        });
        idx.truncate(k);
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        idx.into_iter()
            .map(|i| (self.model.to_target(i as u32), logits[i] - lse))
            .collect()
    }

    /// A greedy draft from the slots' logits: the chain of argmaxes, or the
    /// best `budget` nodes of the tree over each slot's top candidates.
    fn greedy(&self, slots: &[&[f32]], budget: usize) -> Proposal {
        let mut d = Proposal::default();
        let k = if self.mode == Mode::Chain {
            1
        } else {
            self.top_k
        };
        let tops: Vec<Vec<(u32, f32)>> = slots.iter().map(|l| self.top(l, k)).collect();
        // Best first: every node's score is at most its parent's, so the
        // order keeps parents before children.
        let mut nodes: Vec<Node> = Vec::new();
        let mut open: Vec<Node> = tops[0]
            .iter()
            .map(|&(t, lp)| Node {
                token: t,
                parent: None,
                depth: 1,
                score: lp,
            })
            .collect();
        while nodes.len() < budget {
            let Some(best) = (0..open.len()).max_by(|&a, &b| {
                open[a]
                    .score
                    .total_cmp(&open[b].score)
                    .then(open[b].depth.cmp(&open[a].depth))
                    .then(b.cmp(&a))
            }) else {
                break;
            };
            let n = open.swap_remove(best);
            if n.score < self.log_min_conf {
                break;
            }
            let id = nodes.len();
            if n.depth < slots.len() {
                for &(t, lp) in &tops[n.depth] {
                    open.push(Node {
                        token: t,
                        parent: Some(id),
                        depth: n.depth + 1,
                        score: n.score + lp,
                    });
                }
            }
            nodes.push(n);
        }
        for n in &nodes {
            d.tokens.push(n.token);
            d.q.push(Q::OneHot);
            if self.mode == Mode::Tree {
                d.parents
                    .get_or_insert_with(Vec::new)
                    .push(n.parent.map_or(-1, |p| p as i32));
            }
        }
        d
    }

    /// Draw `k` distinct tokens from `q` (without replacement), or under
    /// the lossy control its `k` most likely.
    fn draw(&self, q: &[(u32, f32)], k: usize, rng: &mut Rng) -> Vec<(u32, f32)> {
        if self.argmax_sampled {
            let mut s = q.to_vec();
            s.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            s.truncate(k);
            return s;
        }
        let mut left = q.to_vec();
        let mut out = Vec::new();
        for _ in 0..k.min(left.len()) {
            match take_without_replacement(&mut left, rng.next_f64()) {
                Some(x) => out.push(x),
                None => break,
            }
        }
        out
    }

    /// A sampled draft: chains draw one token per slot; trees draw each
    /// expanded node's children without replacement from the next slot's
    /// q, best-scored frontier nodes first while the budget lasts.
    fn sampled(
        &self,
        slots: &[&[f32]],
        params: &SamplingParams,
        budget: usize,
        rng: &mut Rng,
    ) -> Proposal {
        let qs: Vec<Vec<(u32, f32)>> = slots
            .iter()
            .map(|l| {
                let d = self.q_of(l, params);
                d.ids
                    .into_iter()
                    .zip(d.probs)
                    .filter(|(_, p)| *p > 0.0)
                    .collect()
            })
            .collect();
        let top = |q: &[(u32, f32)]| q.iter().map(|x| x.1).fold(0f32, f32::max).max(1e-30).ln();
        let mut d = Proposal::default();
        let tree = self.mode == Mode::Tree;
        let mut nodes: Vec<Node> = Vec::new();
        // Children of `parent` drawn from slot `depth - 1`'s q.
        let add = |nodes: &mut Vec<Node>,
                   d: &mut Proposal,
                   parent: Option<usize>,
                   depth: usize,
                   k: usize,
                   rng: &mut Rng| {
            let q = &qs[depth - 1];
            let base = parent.map_or(0.0, |p| nodes[p].score);
            if k == 0 || base + top(q) < self.log_min_conf {
                return;
            }
            for (i, (t, p)) in self.draw(q, k, rng).into_iter().enumerate() {
                nodes.push(Node {
                    token: t,
                    parent,
                    depth,
                    score: base + p.max(1e-30).ln(),
                });
                d.tokens.push(t);
                d.q.push(if i == 0 {
                    Q::Sparse(q.clone())
                } else {
                    Q::AsFirstSibling
                });
                if tree {
                    d.parents
                        .get_or_insert_with(Vec::new)
                        .push(parent.map_or(-1, |p| p as i32));
                }
            }
        };
        let k = if tree { self.top_k.min(budget) } else { 1 };
        add(&mut nodes, &mut d, None, 1, k, rng);
        let mut frontier: Vec<usize> = (0..nodes.len()).collect();
        for depth in 2..=slots.len() {
            frontier.sort_by(|&a, &b| nodes[b].score.total_cmp(&nodes[a].score).then(a.cmp(&b)));
            frontier.truncate(if tree { self.top_k } else { 1 });
            let mut next = Vec::new();
            for &p in &frontier {
                let left = budget.saturating_sub(nodes.len());
                let k = if tree {
                    self.top_k.min(left)
                } else {
                    left.min(1)
                };
                let before = nodes.len();
                add(&mut nodes, &mut d, Some(p), depth, k, rng);
                next.extend(before..nodes.len());
            }
            if next.is_empty() {
                break;
            }
            frontier = next;
        }
        d
    }
}

impl Plugin for DflashPlugin {
    const NAME: &'static str = "dflash";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn default_capabilities() -> Caps {
        Caps {
            q_kind: abi::Q_SPARSE,
            sparse_k: 1 << 20,
            tree: true,
            max_depth: 15,
            siblings: Siblings::WithoutReplacement,
            needs_embeddings: true,
            ..Caps::one_hot(15)
        }
    }

    fn create(o: &Options, host: Host) -> Result<Self, String> {
        o.reject_unknown(&OPTIONS)?;
        let argmax_sampled = match o.get("test_control", String::new())?.as_str() {
            "" => false,
            "argmax_sampled" => true,
            c => return Err(format!("option `test_control`: unknown control \"{c}\"")),
        };
        let mode = match o.get("mode", "chain".to_string())?.as_str() {
            "chain" => Mode::Chain,
            "tree" => Mode::Tree,
            m => {
                return Err(format!(
                    "option `mode`: expected \"chain\" or \"tree\", got \"{m}\""
                ))
            }
        };
        let model = load(o, &host)?;
        let slots = model.cfg.block_size - 1;
        let depth = o.get("depth", slots)?.min(slots);
        let max_draft = o.get("max_draft", if mode == Mode::Chain { depth } else { 16 })?;
        let top_k = o.get("top_k", 4usize)?;
        if depth == 0 || max_draft == 0 || top_k == 0 {
            return Err("options `depth`, `max_draft` and `top_k` must be at least 1".into());
        }
        let min_conf = o.get("min_confidence", 0.0f64)?;
        if !(0.0..1.0).contains(&min_conf) {
            return Err(format!(
                "option `min_confidence`: expected a probability in [0, 1), got {min_conf}"
            ));
        }
        host.log(
            2,
            &format!(
                "dflash drafter loaded: {} layers, block {}, draft vocabulary {}, features of layers {:?}, {:.1} MB per block",
                model.layers.len(),
                model.cfg.block_size,
                model.cfg.draft_vocab,
                model.cfg.target_layer_ids,
                model.step_bytes() as f64 / 1e6
            ),
        );
        Ok(Self {
            host,
            mode,
            max_draft,
            depth,
            top_k,
            seed: o.get("seed", 0u64)?,
            window: o.get("window", 1024usize)?,
            log_min_conf: if min_conf > 0.0 {
                (min_conf as f32).ln()
            } else {
                f32::NEG_INFINITY
            },
            argmax_sampled,
            mask_row: None,
            model,
            seqs: HashMap::new(),
        })
    }

    fn capabilities(&self) -> Caps {
        Caps {
            q_kind: abi::Q_SPARSE,
            sparse_k: self.model.cfg.draft_vocab as u32,
            max_draft: self.max_draft as u32,
            tree: self.mode == Mode::Tree,
            max_depth: if self.mode == Mode::Tree {
                self.depth as u32
            } else {
                0
            },
            siblings: Siblings::WithoutReplacement,
            hidden_layers: self
                .model
                .cfg
                .feature_layers
                .iter()
                .map(|&l| l as u32)
                .collect(),
            needs_embeddings: true,
            needs_output_head: self.model.lm_head.is_none(),
            // Per cached position: every draft layer's injected keys and
            // values (f32) and the position.
            kv_bytes_per_token: u32::try_from(
                self.model.layers.len() * 2 * self.model.cfg.kv_dim() * std::mem::size_of::<f32>()
                    + std::mem::size_of::<usize>(),
            )
            .unwrap_or(u32::MAX),
        }
    }

    fn start(&mut self, seq: u64, _tokens: &[u32]) -> Result<(), String> {
        self.seqs.remove(&seq);
        Ok(())
    }

    fn propose(&mut self, batch: &[SeqView<'_>]) -> Result<Vec<Proposal>, String> {
        // The plugin's compute threads help each other instead of sleeping
        // between the forward's small products (`with_caller_pool`).
        specd_model::llama::with_caller_pool(|| self.propose_inner(batch))
    }

    fn observe(&mut self, _seq: u64, _tokens: &[u32], _path: &[u32]) -> Result<(), String> {
        Ok(())
    }

    fn finish(&mut self, seq: u64) {
        self.seqs.remove(&seq);
    }
}

impl DflashPlugin {
    fn propose_inner(&mut self, batch: &[SeqView<'_>]) -> Result<Vec<Proposal>, String> {
        let mut out = vec![Proposal::default(); batch.len()];
        let seen: Vec<SeqView<'_>> = batch
            .iter()
            .copied()
            .filter(|s| s.tokens.len() >= 2)
            .collect();
        self.ingest(&seen)?;
        // Draft where asked and the context reaches the newest token.
        let active: Vec<usize> = (0..batch.len())
            .filter(|&i| {
                let s = &batch[i];
                s.max_draft > 0
                    && s.tokens.len() >= 2
                    && self
                        .seqs
                        .get(&s.seq)
                        .is_some_and(|st| st.next + 1 == s.tokens.len() && !st.pos.is_empty())
            })
            .collect();
        if active.is_empty() {
            return Ok(out);
        }
        let (h, bs) = (self.model.cfg.hidden, self.model.cfg.block_size);
        let mask = self.mask_row()?;
        let newest: Vec<u32> = active
            .iter()
            .map(|&i| *batch[i].tokens.last().unwrap_or(&0))
            .collect();
        let emb = self
            .host
            .embed(&newest)
            .filter(|e| e.len() == newest.len() * h)
            .ok_or("the host offers no target embeddings")?;
        let mut e = Vec::with_capacity(active.len() * bs * h);
        let mut starts = Vec::with_capacity(active.len());
        for (k, &i) in active.iter().enumerate() {
            e.extend_from_slice(&emb[k * h..(k + 1) * h]);
            for _ in 1..bs {
                e.extend_from_slice(&mask);
            }
            starts.push(batch[i].tokens.len() - 1);
        }
        let ctx: Vec<&[KvStore]> = active
            .iter()
            .map(|&i| self.seqs[&batch[i].seq].ctx.as_slice())
            .collect();
        let y = self.model.block(&ctx, &e, &starts);
        // Output rows: slots 1..=depth of each block, no deeper than the
        // largest budget asked (a draft of k nodes is at most k deep).
        let most = active
            .iter()
            .map(|&i| batch[i].max_draft.min(self.max_draft))
            .max()
            .unwrap_or(1);
        let depth = self.depth.min(most);
        let mut rows = Vec::with_capacity(active.len() * depth * h);
        for b in 0..active.len() {
            rows.extend_from_slice(&y[(b * bs + 1) * h..(b * bs + 1 + depth) * h]);
        }
        let n_rows = active.len() * depth;
        let logits = match self.model.logits(&rows, n_rows) {
            Some(l) => l,
            None => self
                .host
                .lm_head(&rows, n_rows)
                .ok_or("the host offers no output head")?,
        };
        let lw = logits.len() / n_rows.max(1);
        for (b, &i) in active.iter().enumerate() {
            let s = &batch[i];
            let budget = s.max_draft.min(self.max_draft);
            let slots: Vec<&[f32]> = (0..depth)
                .map(|d| &logits[(b * depth + d) * lw..(b * depth + d + 1) * lw])
                .collect();
            let slots = if self.mode == Mode::Chain {
                &slots[..budget.min(depth)]
            } else {
                &slots[..]
            };
            out[i] = if s.is_greedy() {
                self.greedy(slots, budget)
            } else {
                let params = params_of(s);
                let mut rng = self.seqs[&s.seq].rng.clone();
                let d = self.sampled(slots, &params, budget, &mut rng);
                if let Some(st) = self.seqs.get_mut(&s.seq) {
                    st.rng = rng;
                }
                d
            };
        }
        Ok(out)
    }
}

#[cfg(feature = "plugin")]
specd_plugin_sdk::export_proposer!(DflashPlugin);
