//! EAGLE draft heads as a proposer plugin: the head reads the target's own
//! features (EAGLE-3: three layers fused; EAGLE-1: the final-normed state)
//! and drafts chains or dynamic trees (EAGLE-2).
//!
//! Per sequence the plugin keeps the head's KV cache of committed positions:
//! every position whose target features the host delivered becomes a pair
//! (features of position p, token p+1) processed at position p; the last
//! pair's output is the root of the next draft. Draft nodes never enter
//! that cache; a rejected draft costs nothing to roll back.
//!
//! Drafting (`mode`):
//! - `chain`: one token per depth (greedy: argmax; sampling: drawn from
//!   the head's distribution after the request's temperature / top-k /
//!   top-p / min-p).
//! - `tree` (EAGLE-2): the root's `top_k` children; at every depth the
//!   `top_k` frontier nodes of highest cumulative probability are expanded
//!   (one batched head step per depth), each with `top_k` children. Under
//!   greedy decoding the best `max_draft` nodes by cumulative probability
//!   are kept (the budget the engine's policy gives per sequence and
//!   step); under sampling children are drawn without replacement and a
//!   node's number of children is fixed before they are drawn (from the
//!   budget left), never pruned by their own values, so rejection
//!   sampling stays lossless.
//!
//! Options (`DRAFT_OPTIONS`; the plugins add where the head comes from):
//! `mode`
//! ("tree" | "chain", default "tree"), `max_draft` (tree nodes or chain
//! length cap, default 16 / 5), `depth` (6), `top_k` (4), `seed`,
//! `window` (the most positions one catch-up processes, default 256; 0:
//! all that the host delivered, itself bounded by its `max_hidden_rows`),
//! `min_confidence` (default 0: off): a node is expanded only while the
//! head's confidence in its path stays at least this, the product of its
//! ancestors' probabilities (greedy: the head's own, at temperature 1;
//! sampling: the drawn tokens' q) and the largest probability of the q its
//! children would be drawn from. The verify of a drafted token costs the
//! same whether it is accepted or not, and the head's confidence tracks its
//! acceptance, so a chain stops where the next token is unlikely to pay
//! (EAGLE-2's observation, applied to when to stop). The test is made
//! before anything is drawn from that q, from the path already drawn:
//! which tokens get drafted never depends on their own values, so
//! rejection sampling stays lossless.
//!
//! Invariant: every drafted token is drawn from the q reported for it
//! (greedy: any token; the host checks against the target's argmax), and
//! whether a node is expanded is decided before its children are drawn.

use specd_model::eagle::{Head, KvStore, Src, Variant};
use specd_model::sampler::{self, Rng, SamplingParams};
use specd_plugin_sdk::{
    abi, feature_rows, take_without_replacement, Caps, Host, Options, Proposal, SeqView, Siblings,
    Q,
};
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Tree,
    Chain,
}

/// The head's output at the last committed pair of a sequence.
#[derive(Debug, Clone)]
struct Root {
    /// Position of the pair (the sequence length minus 2).
    pos: usize,
    y: Vec<f32>,
    logits: Vec<f32>,
}

/// (position, features) rows waiting to become pairs.
type Pending = specd_plugin_sdk::FeatureRows;

#[derive(Debug)]
struct SeqState {
    /// Keys and values of the committed pairs, one row per pair.
    cache: KvStore,
    /// Position of each cache row (ascending; gaps where a catch-up was
    /// cut to the window).
    row_pos: Vec<usize>,
    /// Next position whose pair is not in the cache.
    pairs: usize,
    /// Features delivered for positions whose next token is not known yet.
    pending: Pending,
    root: Option<Root>,
    rng: Rng,
}

/// Default `window`: the whole prompt of most chat turns and of every
/// HumanEval task; longer prompts and long pauses are cut to it.
pub const DEFAULT_WINDOW: usize = 256;

/// Positions a window never drops: the first pairs of a sequence (the
/// chat template's opening tokens, which every training sample starts
/// with; StreamingLLM's attention sink).
pub const SINK: usize = 4;

/// Options of every head-based draft mode (besides where the head comes
/// from).
pub const DRAFT_OPTIONS: [&str; 8] = [
    "mode",
    "max_draft",
    "depth",
    "top_k",
    "seed",
    "window",
    "min_confidence",
    "test_control",
];

pub struct Eagle {
    head: Head,
    host: Host,
    mode: Mode,
    max_draft: usize,
    depth: usize,
    top_k: usize,
    seed: u64,
    /// Most pairs one catch-up takes into the cache (0: all): after a
    /// long pause (the engine's policy stopped drafting, or a long prompt)
    /// only the newest `window` positions are processed (and the first
    /// `SINK` of the sequence), so a probe costs a bounded amount whatever
    /// it missed. Older positions stay out of the head's attention; drafts
    /// may be worse, never wrong.
    window: usize,
    /// Natural log of `min_confidence` (negative infinity: off): a node
    /// whose path confidence times its children's largest q is below it is
    /// not expanded.
    log_min_conf: f32,
    /// Test control only (`test_control = "rerank_sampled"`): prune
    /// sampled trees by their nodes' own probabilities, as EAGLE-2 does
    /// under greedy decoding. Lossy; the chi-square test must catch it.
    rerank_sampled: bool,
    /// Test control only (`test_control = "gate_drawn"`): apply
    /// `min_confidence` to each drawn token's own probability after the
    /// draw, dropping the ones below it. Lossy; the chi-square test must
    /// catch it.
    gate_drawn: bool,
    seqs: HashMap<u64, SeqState>,
}

/// A draft node under construction.
#[derive(Debug, Clone)]
struct Node {
    token: u32,
    parent: Option<usize>,
    depth: usize,
    /// Cumulative log-probability under the head.
    score: f32,
    /// Row of the node's own key in the per-sequence draft store, once
    /// expanded, with its output.
    key: Option<usize>,
    y: Option<Vec<f32>>,
}

/// Per-sequence drafting state during one `propose`.
struct Work {
    slot: usize,
    greedy: bool,
    params: SamplingParams,
    budget: usize,
    nodes: Vec<Node>,
    /// Nodes to expand at the current depth.
    frontier: Vec<usize>,
    /// Keys of expanded draft nodes.
    store: KvStore,
    /// The q (draft distribution over target ids) each expanded node's
    /// children were drawn from, by parent (`None`: the root).
    q: HashMap<Option<usize>, Q>,
    root_pos: usize,
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

impl Eagle {
    /// An instance drafting with `head` (options: `DRAFT_OPTIONS`); what
    /// `create` does after loading the head, and what other head-based
    /// plugins (`mtp`) build on.
    pub fn create_with(o: &Options, host: Host, head: Head) -> Result<Self, String> {
        let control = o.get("test_control", String::new())?;
        let (rerank_sampled, gate_drawn) = match control.as_str() {
            "" => (false, false),
            "rerank_sampled" => (true, false),
            "gate_drawn" => (false, true),
            c => return Err(format!("option `test_control`: unknown control \"{c}\"")),
        };
        let mode = match o.get("mode", "tree".to_string())?.as_str() {
            "tree" => Mode::Tree,
            "chain" => Mode::Chain,
            m => {
                return Err(format!(
                    "option `mode`: expected \"tree\" or \"chain\", got \"{m}\""
                ))
            }
        };
        let depth = o.get("depth", if mode == Mode::Chain { 5usize } else { 6 })?;
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
                "eagle head loaded: {:?}, draft vocabulary {}, features of layers {:?}, {:.1} MB per draft step",
                head.cfg.variant,
                head.cfg.draft_vocab,
                head.cfg.feature_layers,
                head.step_bytes() as f64 / 1e6
            ),
        );
        Ok(Self {
            head,
            host,
            mode,
            max_draft,
            depth,
            top_k,
            seed: o.get("seed", 0u64)?,
            window: o.get("window", DEFAULT_WINDOW)?,
            log_min_conf: if min_conf > 0.0 {
                (min_conf as f32).ln()
            } else {
                f32::NEG_INFINITY
            },
            rerank_sampled,
            gate_drawn,
            seqs: HashMap::new(),
        })
    }

    /// The sequence's state; its draw stream is seeded from the plugin's
    /// `seed` and the request's (not the sequence id), so a seeded request
    /// drafts, and so decodes, the same every time.
    fn state(&mut self, seq: u64, req_seed: u64) -> &mut SeqState {
        let dim = self.head.cfg.kv_dim();
        let seed = self.seed;
        self.seqs.entry(seq).or_insert_with(|| SeqState {
            cache: KvStore::new(dim),
            row_pos: Vec::new(),
            pairs: 0,
            pending: Vec::new(),
            root: None,
            rng: Rng::new(seed ^ req_seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        })
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, String> {
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        self.host
            .embed(tokens)
            .ok_or_else(|| "the host offers no target embeddings".to_string())
    }

    /// Hidden inputs `g` of rows with embeddings `e` and either target
    /// features (`from_features`) or the parent's head output.
    fn hidden_in(&self, e: &[f32], x: &[f32], rows: usize, from_features: bool) -> Vec<f32> {
        match self.head.cfg.variant {
            Variant::Eagle3 if from_features => self.head.fuse(x, rows),
            Variant::Eagle3 => x.to_vec(),
            Variant::Eagle1 | Variant::Mtp => self.head.fuse_pair(e, x, rows),
        }
    }

    /// Logits of head outputs: over the draft vocabulary (EAGLE-3) or the
    /// target's (EAGLE-1, through the host's output head).
    fn logits(&self, y: &[f32], rows: usize) -> Result<Vec<f32>, String> {
        match self.head.logits(y, rows) {
            Some(l) => Ok(l),
            None => self
                .host
                .lm_head(&self.head.for_target_head(y), rows)
                .ok_or_else(|| "the host offers no output head".to_string()),
        }
    }

    fn to_target(&self, id: u32) -> u32 {
        self.head.d2t.get(id as usize).copied().unwrap_or(id)
    }

    /// Take in the features delivered for each sequence: new pairs go
    /// through the head (all sequences in one step) into the caches, and
    /// the last pair becomes the root.
    fn ingest(&mut self, batch: &[SeqView<'_>], active: &[usize]) -> Result<(), String> {
        let h = self.head.cfg.hidden;
        let nl = self.head.cfg.feature_layers.len();
        // Per sequence: the rows (position, features) that become pairs now.
        let mut rows: Vec<(usize, Pending)> = Vec::new();
        let window = self.window;
        for &i in active {
            let s = &batch[i];
            if s.hidden_rows > 0 && (s.hidden_width != h || s.hidden_layers != nl) {
                return Err(format!(
                    "features of {} layers x {} delivered; the head reads {nl} x {h}",
                    s.hidden_layers, s.hidden_width
                ));
            }
            let st = self.state(s.seq, s.seed);
            let start = s.hidden_start as usize;
            if s.hidden_rows > 0 && start < st.pairs {
                // Positions seen again (the host recomputed them): restart
                // the cache there.
                let keep = st.row_pos.partition_point(|&p| p < start);
                st.cache.truncate(keep);
                st.row_pos.truncate(keep);
                st.pairs = start;
                st.pending.clear();
                st.root = None;
            }
            let ready = feature_rows(s, &mut st.pending, window, SINK)?;
            if !ready.is_empty() {
                rows.push((i, ready));
            }
        }
        if rows.is_empty() {
            return Ok(());
        }
        let mut stores: Vec<&KvStore> = Vec::new();
        let (mut g_in, mut toks, mut pos) = (Vec::new(), Vec::new(), Vec::new());
        let mut feats = Vec::new();
        for (i, ready) in &rows {
            let s = &batch[*i];
            let st = &self.seqs[&s.seq];
            stores.push(&st.cache);
            for (p, f) in ready {
                feats.extend_from_slice(f);
                toks.push(s.tokens[p + 1]);
                pos.push(*p);
            }
        }
        let e = self.embed(&toks)?;
        g_in.extend(self.hidden_in(&e, &feats, pos.len(), true));
        // Every new row's cache entry, then the layer only for each
        // sequence's last row (the root to draft from): the history rows'
        // outputs are never read.
        let kv = self.head.kv_rows(&g_in, &e, &pos);
        let ew = e.len() / pos.len().max(1);
        let gw = g_in.len() / pos.len().max(1);
        let mut last_rows = Vec::new();
        let mut r = 0;
        for (_, ready) in &rows {
            r += ready.len();
            last_rows.push(r - 1);
        }
        let kv_store = stores.len();
        stores.push(&kv);
        let (mut g_last, mut e_last, mut pos_last, mut sees_last) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut first = 0;
        for (si, &lr) in last_rows.iter().enumerate() {
            g_last.extend_from_slice(&g_in[lr * gw..(lr + 1) * gw]);
            e_last.extend_from_slice(&e[lr * ew..(lr + 1) * ew]);
            pos_last.push(pos[lr]);
            sees_last.push(vec![
                Src::Range {
                    store: si,
                    start: 0,
                    end: stores[si].len(),
                },
                Src::Range {
                    store: kv_store,
                    start: first,
                    end: lr,
                },
            ]);
            first = lr + 1;
        }
        let (ylast, _) = self
            .head
            .step(&stores, &g_last, &e_last, &pos_last, &sees_last);
        drop(stores);
        let own = kv;
        let logits = self.logits(&ylast, last_rows.len())?;
        let lw = logits.len() / last_rows.len().max(1);
        let mut r0 = 0;
        for (k, (i, ready)) in rows.iter().enumerate() {
            let seq = batch[*i].seq;
            let st = self.seqs.get_mut(&seq).ok_or("sequence state lost")?;
            st.cache.extend_rows(&own, r0..r0 + ready.len());
            st.row_pos.extend(ready.iter().map(|(p, _)| *p));
            let last = &ready[ready.len() - 1];
            st.pairs = last.0 + 1;
            st.root = Some(Root {
                pos: last.0,
                y: ylast[k * h..(k + 1) * h].to_vec(),
                logits: logits[k * lw..(k + 1) * lw].to_vec(),
            });
            r0 += ready.len();
        }
        Ok(())
    }

    /// The draft distribution of logits under `params` (ids: draft ids),
    /// mapped to target ids.
    fn q_of(&self, logits: &[f32], params: &SamplingParams) -> sampler::Distribution {
        let mut d = sampler::distribution(logits, params);
        for id in &mut d.ids {
            *id = self.to_target(*id);
        }
        d
    }

    /// Children of a node with path score `base` whose head output has
    /// `logits`: (token, log q) pairs, and the q to report (first child's)
    /// under sampling. None at all when `base` plus the log of the largest
    /// probability is below `min_confidence` (decided before any draw).
    fn children(
        &self,
        w: &mut Work,
        logits: &[f32],
        k: usize,
        base: f32,
        rng: &mut Rng,
    ) -> (Vec<(u32, f32)>, Option<Q>) {
        if w.greedy {
            // The k best (draft ids), as target ids with log-softmax scores.
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
            if base + (max - lse) < self.log_min_conf {
                return (Vec::new(), None);
            }
            let mut idx: Vec<usize> = (0..logits.len()).collect();
            let k = k.min(idx.len());
            if k == 0 {
                return (Vec::new(), None);
            }
            idx.select_nth_unstable_by(k - 1, |&a, &b| {
                logits[b].total_cmp(&logits[a]).then(a.cmp(&b))
            });
            idx.truncate(k);
            idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let out = idx
                .into_iter()
                .map(|i| (self.to_target(i as u32), logits[i] - lse))
                .collect();
            (out, Some(Q::OneHot))
        } else {
            // Draw k distinct tokens one after another, each from q
            // renormalised without the earlier ones.
            let d = self.q_of(logits, &w.params);
            let top = d.probs.iter().copied().fold(0f32, f32::max);
            if !self.gate_drawn && base + top.max(1e-30).ln() < self.log_min_conf {
                return (Vec::new(), None);
            }
            let mut left: Vec<(u32, f32)> = d
                .ids
                .iter()
                .copied()
                .zip(d.probs.iter().copied())
                .filter(|(_, p)| *p > 0.0)
                .collect();
            let q = Q::Sparse(left.clone());
            let mut out = Vec::new();
            for _ in 0..k.min(left.len()) {
                let Some((t, p)) = take_without_replacement(&mut left, rng.next_f64()) else {
                    break;
                };
                out.push((t, p.max(1e-30).ln()));
            }
            if self.gate_drawn {
                // The lossy control: the bar judged on what was drawn.
                out.retain(|&(_, lp)| base + lp >= self.log_min_conf);
                if out.is_empty() {
                    return (out, None);
                }
            }
            (out, Some(q))
        }
    }
}

/// The plugin entry points, for `impl Plugin` in the eagle and mtp crates.
impl Eagle {
    pub fn default_caps() -> Caps {
        Caps {
            q_kind: abi::Q_SPARSE,
            sparse_k: 1 << 20,
            tree: true,
            max_depth: 6,
            siblings: Siblings::WithoutReplacement,
            needs_embeddings: true,
            ..Caps::one_hot(16)
        }
    }

    pub fn caps(&self) -> Caps {
        let (tree, max_depth) = match self.mode {
            Mode::Tree => (true, self.depth as u32),
            Mode::Chain => (false, 0),
        };
        Caps {
            q_kind: abi::Q_SPARSE,
            sparse_k: self.head.cfg.draft_vocab as u32,
            max_draft: self.max_draft as u32,
            tree,
            max_depth,
            siblings: Siblings::WithoutReplacement,
            hidden_layers: self
                .head
                .cfg
                .feature_layers
                .iter()
                .map(|&l| l as u32)
                .collect(),
            needs_embeddings: true,
            needs_output_head: self.head.lm_head.is_none(),
            kv_bytes_per_token: self.kv_bytes_per_token(),
        }
    }

    /// Bytes a sequence's state takes per cached position: the head's keys
    /// and values (f32) and the row's position.
    fn kv_bytes_per_token(&self) -> u32 {
        let b =
            2 * self.head.cfg.kv_dim() * std::mem::size_of::<f32>() + std::mem::size_of::<usize>();
        u32::try_from(b).unwrap_or(u32::MAX)
    }

    pub fn start_seq(&mut self, seq: u64) -> Result<(), String> {
        self.seqs.remove(&seq);
        Ok(())
    }

    /// Drafts for `batch`, computed on the calling thread with the idle
    /// compute threads helping (`with_caller_pool`): the head's products
    /// are a few hundred microseconds each, and handed to rayon's sleeping
    /// workers one by one each paid their wake-up, as handing the whole
    /// call to one and waking the caller after paid two.
    pub fn propose_batch(&mut self, batch: &[SeqView<'_>]) -> Result<Vec<Proposal>, String> {
        specd_model::llama::with_caller_pool(|| self.propose_inner(batch))
    }

    fn propose_inner(&mut self, batch: &[SeqView<'_>]) -> Result<Vec<Proposal>, String> {
        let mut drafts: Vec<Proposal> = vec![Proposal::default(); batch.len()];
        // Features are taken in for every sequence (a zero-length call
        // only feeds the cache); drafts only where asked.
        let seen: Vec<usize> = (0..batch.len())
            .filter(|&i| batch[i].tokens.len() >= 2)
            .collect();
        self.ingest(batch, &seen)?;
        let active: Vec<usize> = seen
            .into_iter()
            .filter(|&i| batch[i].max_draft > 0)
            .collect();
        let h = self.head.cfg.hidden;
        let mut works: Vec<Work> = Vec::new();
        let mut rngs: Vec<Rng> = Vec::new();
        for &i in &active {
            let s = &batch[i];
            let n = s.tokens.len();
            let Some(st) = self.seqs.get(&s.seq) else {
                continue;
            };
            // Draft only from the pair right before the newest token.
            let Some(root) = st.root.as_ref().filter(|r| r.pos + 2 == n) else {
                continue;
            };
            let params = params_of(s);
            let budget = s.max_draft.min(self.max_draft);
            let mut w = Work {
                slot: i,
                greedy: s.is_greedy(),
                params,
                budget,
                nodes: Vec::new(),
                frontier: Vec::new(),
                store: KvStore::new(self.head.cfg.kv_dim()),
                q: HashMap::new(),
                root_pos: root.pos,
            };
            let mut rng = st.rng.clone();
            let k = match self.mode {
                Mode::Chain => 1,
                Mode::Tree if w.greedy || self.rerank_sampled => self.top_k,
                Mode::Tree => self.top_k.min(budget),
            };
            let logits = root.logits.clone();
            let (kids, q) = self.children(&mut w, &logits, k, 0.0, &mut rng);
            for (t, lp) in kids {
                w.nodes.push(Node {
                    token: t,
                    parent: None,
                    depth: 1,
                    score: lp,
                    key: None,
                    y: None,
                });
            }
            if let Some(q) = q {
                w.q.insert(None, q);
            }
            w.frontier = (0..w.nodes.len()).collect();
            works.push(w);
            rngs.push(rng);
        }
        let max_depth = match self.mode {
            Mode::Chain => self.depth.min(self.max_draft),
            Mode::Tree => self.depth,
        };
        for depth in 1..max_depth {
            // Which nodes of each sequence expand at this depth.
            let mut rows: Vec<(usize, usize)> = Vec::new();
            for (wi, w) in works.iter_mut().enumerate() {
                let limit = match self.mode {
                    Mode::Chain => usize::from(w.nodes.len() < w.budget),
                    Mode::Tree if w.greedy || self.rerank_sampled => self.top_k,
                    // Sampling: only while budget is left for children.
                    Mode::Tree => {
                        if w.nodes.len() < w.budget {
                            self.top_k
                        } else {
                            0
                        }
                    }
                };
                // Nodes already below `min_confidence` would be refused
                // children anyway (a probability is at most 1): no head
                // step for them.
                let mut f: Vec<usize> = w
                    .frontier
                    .iter()
                    .copied()
                    .filter(|&n| {
                        w.nodes[n].depth == depth
                            && (self.gate_drawn || w.nodes[n].score >= self.log_min_conf)
                    })
                    .collect();
                f.sort_by(|&a, &b| {
                    w.nodes[b]
                        .score
                        .total_cmp(&w.nodes[a].score)
                        .then(a.cmp(&b))
                });
                f.truncate(limit);
                for n in f {
                    rows.push((wi, n));
                }
            }
            if rows.is_empty() {
                break;
            }
            // One batched head step over every expanded node.
            let toks: Vec<u32> = rows
                .iter()
                .map(|&(wi, n)| works[wi].nodes[n].token)
                .collect();
            let e = self.embed(&toks)?;
            let mut x = Vec::with_capacity(rows.len() * h);
            for &(wi, n) in &rows {
                let w = &works[wi];
                match w.nodes[n].parent {
                    Some(p) => x.extend_from_slice(w.nodes[p].y.as_deref().unwrap_or(&[])),
                    None => {
                        let st = &self.seqs[&batch[w.slot].seq];
                        x.extend_from_slice(
                            &st.root.as_ref().map(|r| r.y.clone()).unwrap_or_default(),
                        );
                    }
                }
            }
            let g = self.hidden_in(&e, &x, rows.len(), false);
            let mut stores: Vec<&KvStore> = Vec::new();
            let mut store_of: HashMap<usize, (usize, usize)> = HashMap::new();
            for &(wi, _) in &rows {
                if let std::collections::hash_map::Entry::Vacant(v) = store_of.entry(wi) {
                    let w = &works[wi];
                    let cache = &self.seqs[&batch[w.slot].seq].cache;
                    stores.push(cache);
                    stores.push(&w.store);
                    v.insert((stores.len() - 2, stores.len() - 1));
                }
            }
            let mut pos = Vec::with_capacity(rows.len());
            let mut sees = Vec::with_capacity(rows.len());
            for &(wi, n) in &rows {
                let w = &works[wi];
                let (cs, ds) = store_of[&wi];
                let node = &w.nodes[n];
                pos.push(w.root_pos + node.depth);
                let mut see = vec![Src::Range {
                    store: cs,
                    start: 0,
                    end: stores[cs].len(),
                }];
                // Ancestors' keys, root first.
                let mut anc = Vec::new();
                let mut p = node.parent;
                while let Some(a) = p {
                    if let Some(k) = w.nodes[a].key {
                        anc.push(k);
                    }
                    p = w.nodes[a].parent;
                }
                see.extend(anc.into_iter().rev().map(|row| Src::Row { store: ds, row }));
                sees.push(see);
            }
            let (y, own) = self.head.step(&stores, &g, &e, &pos, &sees);
            drop(stores);
            let logits = self.logits(&y, rows.len())?;
            let lw = logits.len() / rows.len().max(1);
            for (r, &(wi, n)) in rows.iter().enumerate() {
                let w = &mut works[wi];
                let key = w.store.len();
                w.store.extend_rows(&own, r..r + 1);
                w.nodes[n].key = Some(key);
                w.nodes[n].y = Some(y[r * h..(r + 1) * h].to_vec());
                let k = match self.mode {
                    Mode::Chain => 1,
                    Mode::Tree if w.greedy || self.rerank_sampled => self.top_k,
                    Mode::Tree => self.top_k.min(w.budget.saturating_sub(w.nodes.len())),
                };
                if k == 0 {
                    continue;
                }
                let wl = &logits[r * lw..(r + 1) * lw];
                let rng = &mut rngs[wi];
                let base = w.nodes[n].score;
                let (kids, q) = self.children(w, wl, k, base, rng);
                if let Some(q) = q {
                    w.q.insert(Some(n), q);
                }
                for (t, lp) in kids {
                    w.frontier.push(w.nodes.len());
                    w.nodes.push(Node {
                        token: t,
                        parent: Some(n),
                        depth: depth + 1,
                        score: base + lp,
                        key: None,
                        y: None,
                    });
                }
            }
        }
        // Emit: greedy trees keep the best `budget` nodes (ancestors score
        // at least as high as their descendants); everything else keeps
        // every drawn node. Parents precede children.
        for (wi, w) in works.into_iter().enumerate() {
            let n = w.nodes.len();
            let rerank = w.greedy || self.rerank_sampled;
            // Greedy trees also drop nodes below `min_confidence` (chains
            // stop before drawing one).
            let gated = w.greedy && self.log_min_conf > f32::NEG_INFINITY;
            let keep: Vec<usize> = if self.mode == Mode::Tree && rerank && (n > w.budget || gated) {
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by(|&a, &b| {
                    w.nodes[b]
                        .score
                        .total_cmp(&w.nodes[a].score)
                        .then(w.nodes[a].depth.cmp(&w.nodes[b].depth))
                        .then(a.cmp(&b))
                });
                let mut chosen = vec![false; n];
                let mut count = 0;
                for i in order {
                    if count >= w.budget || (gated && w.nodes[i].score < self.log_min_conf) {
                        break;
                    }
                    if w.nodes[i].parent.is_none_or(|p| chosen[p]) {
                        chosen[i] = true;
                        count += 1;
                    }
                }
                (0..n).filter(|&i| chosen[i]).collect()
            } else {
                // Chains and sampled trees never draw past the budget.
                (0..n).collect()
            };
            let mut index = vec![-1i32; n];
            let d = &mut drafts[w.slot];
            for (k, &i) in keep.iter().enumerate() {
                index[i] = k as i32;
                let node = &w.nodes[i];
                d.tokens.push(node.token);
                let parent = node.parent.map_or(-1, |p| index[p]);
                if self.mode == Mode::Tree {
                    d.parents.get_or_insert_with(Vec::new).push(parent);
                }
                // The first kept child of its parent carries the q.
                let first = keep[..k].iter().all(|&o| w.nodes[o].parent != node.parent);
                d.q.push(match w.q.get(&node.parent) {
                    _ if w.greedy => Q::OneHot,
                    Some(q) if first => q.clone(),
                    _ => Q::AsFirstSibling,
                });
            }
            if let Some(st) = self.seqs.get_mut(&batch[w.slot].seq) {
                st.rng = rngs[wi].clone();
            }
        }
        Ok(drafts)
    }

    pub fn finish_seq(&mut self, seq: u64) {
        self.seqs.remove(&seq);
    }
}
