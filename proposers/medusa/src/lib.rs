//! Medusa-1 heads as a proposer plugin: `K` heads read the target's last
//! (final-normed) hidden state and each proposes the token one step
//! further ahead; candidates form a sparse tree (Medusa's "tree choices")
//! or a chain, verified by the target in one forward.
//!
//! The heads run once per step and sequence, on the hidden state of the
//! position before the newest token (the one whose output the engine
//! sampled that token from): head `k` drafts depth `k + 1` of the tree.
//! Nothing else is cached; a rejected draft costs nothing to roll back.
//!
//! Tree choices (`tree`, TOML array of paths, e.g. `[[0], [0, 0], [1]]`):
//! path `[r1, .., rd]` is the node at depth `d` whose token is the `rd`-th
//! candidate of head `d` under its parent `[r1, .., r(d-1)]`. Paths are
//! listed parents first, best first; a step's draft budget keeps the
//! first `budget` of them (never chosen by value, so the shape is fixed
//! before any token is drawn).
//!
//! Tokens:
//! - greedy: candidate `r` of head `d` is its `r`-th most likely token.
//! - sampling (lossless): each node's children are drawn without
//!   replacement from `q_d`, head `d`'s distribution after the request's
//!   temperature / top-k / top-p / min-p; the engine accepts by rejection
//!   sampling. Medusa's "typical acceptance" is lossy and not offered.
//!
//! Options: `head` (directory with config.json + *.safetensors; default:
//! the heads built into the plugin for SmolLM2-135M-Instruct), `mode`
//! ("tree" | "chain", default "tree"), `tree` (tree choices; default a
//! 16-node tree), `max_draft` (node cap), `depth` (chain length, default
//! the number of heads), `seed`.
//!
//! Invariant: every drafted token is drawn from the q reported for it
//! (greedy: any token; the host checks against the target's argmax).

use std::collections::HashMap;
use std::path::PathBuf;

use specd_model::medusa::MedusaHead;
use specd_model::sampler::{self, Rng, SamplingParams};
use specd_plugin_sdk::{
    abi, take_without_replacement, Caps, Host, Options, Plugin, Proposal, SeqView, Siblings, Q,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Tree,
    Chain,
}

/// The default sparse tree for four heads: 16 nodes, parents first,
/// ordered by how often each path was accepted in a Spec-Bench-free
/// validation run (top-1 chains first, then the runners-up).
pub const DEFAULT_TREE: &[&[usize]] = &[
    &[0],
    &[0, 0],
    &[1],
    &[0, 0, 0],
    &[0, 1],
    &[2],
    &[1, 0],
    &[0, 0, 0, 0],
    &[0, 0, 1],
    &[3],
    &[0, 2],
    &[1, 1],
    &[0, 1, 0],
    &[2, 0],
    &[1, 0, 0],
    &[0, 0, 0, 1],
];

/// A node of the tree choices.
#[derive(Debug, Clone)]
struct Shape {
    parent: Option<usize>,
    /// 1-based: the head `depth - 1` drafts it.
    depth: usize,
    /// Candidate rank under its parent.
    rank: usize,
}

/// Validate tree choices: non-empty paths, each parent listed before it,
/// no repeats, no deeper than `heads`.
fn tree_shape(choices: &[Vec<usize>], heads: usize) -> Result<Vec<Shape>, String> {
    let mut index: HashMap<&[usize], usize> = HashMap::new();
    let mut out = Vec::with_capacity(choices.len());
    for (i, path) in choices.iter().enumerate() {
        if path.is_empty() {
            return Err(format!("option `tree`: path {i} is empty"));
        }
        if path.len() > heads {
            return Err(format!(
                "option `tree`: path {path:?} is {} deep; the head file has {heads} heads",
                path.len()
            ));
        }
        if index.contains_key(path.as_slice()) {
            return Err(format!("option `tree`: path {path:?} is listed twice"));
        }
        let parent = if path.len() == 1 {
            None
        } else {
            match index.get(&path[..path.len() - 1]) {
                Some(&p) => Some(p),
                None => {
                    return Err(format!(
                        "option `tree`: path {path:?} comes before (or without) its parent {:?}",
                        &path[..path.len() - 1]
                    ))
                }
            }
        };
        index.insert(path.as_slice(), i);
        out.push(Shape {
            parent,
            depth: path.len(),
            rank: path[path.len() - 1],
        });
    }
    Ok(out)
}

#[derive(Debug)]
struct SeqState {
    /// (position, final-normed hidden state) of the newest delivered row.
    root: Option<(usize, Vec<f32>)>,
    rng: Rng,
}

pub struct Medusa {
    head: MedusaHead,
    mode: Mode,
    shape: Vec<Shape>,
    max_draft: usize,
    seed: u64,
    /// The target's final-normed state's hidden index.
    final_layer: usize,
    /// Test control only (`test_control = "top_tokens_sampled"`): under
    /// sampling, draft q's most likely tokens instead of drawing them.
    /// Lossy; the chi-square test must catch it.
    top_tokens_sampled: bool,
    seqs: HashMap<u64, SeqState>,
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

/// Indices of the `k` largest logits, best first (ties: lower id).
fn top_k(logits: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(logits.len());
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let cmp = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    idx.select_nth_unstable_by(k - 1, cmp);
    idx.truncate(k);
    idx.sort_by(cmp);
    idx
}

/// The target's output head rows of `ids` (`ids.len() x h`), read back
/// through the host's output head on a scaled identity basis (127/128:
/// exact in the 8-bit activation blocks the host's kernels may use).
fn target_rows(host: &Host, ids: &[u32]) -> Result<Vec<f32>, String> {
    let (h, v) = (host.hidden_size(), host.vocab_size());
    const S: f32 = 127.0 / 128.0;
    let mut basis = vec![0f32; h * h];
    for c in 0..h {
        basis[c * h + c] = S;
    }
    let cols = host
        .lm_head(&basis, h)
        .ok_or("the heads read out through the target's output head, and the host offers none")?;
    if cols.len() != h * v {
        return Err(format!(
            "the host's output head returned {} values for {h} rows of a {v}-token vocabulary",
            cols.len()
        ));
    }
    let mut rows = vec![0f32; ids.len() * h];
    for (d, &t) in ids.iter().enumerate() {
        for c in 0..h {
            rows[d * h + c] = cols[c * v + t as usize] / S;
        }
    }
    Ok(rows)
}

impl Medusa {
    fn load_head(o: &Options, host: &Host) -> Result<MedusaHead, String> {
        let raw = o.get("head", String::new())?;
        if raw.is_empty() {
            #[cfg(feature = "builtin-head")]
            {
                return MedusaHead::from_bytes(
                    "builtin:smollm2-135m-instruct",
                    builtin::CONFIG,
                    builtin::WEIGHTS,
                    host.hidden_size(),
                    host.vocab_size(),
                );
            }
            #[cfg(not(feature = "builtin-head"))]
            return Err("option `head`: path to the heads' directory is required (this build has no built-in heads)".into());
        }
        let path = match (raw.strip_prefix("~/"), std::env::var_os("HOME")) {
            (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
            _ => PathBuf::from(&raw),
        };
        MedusaHead::load(&path, host.hidden_size(), host.vocab_size())
    }

    fn to_target(&self, id: usize) -> u32 {
        self.head.d2t.get(id).copied().unwrap_or(id as u32)
    }

    /// One sequence's draft from its heads' logits (`heads x dv`).
    fn draft(&self, s: &SeqView<'_>, logits: &[f32], rng: &mut Rng) -> Proposal {
        let dv = self.head.cfg.draft_vocab;
        let budget = s.max_draft.min(self.max_draft).min(self.shape.len());
        let shape = &self.shape[..budget];
        let greedy = s.is_greedy();
        let head_logits = |d: usize| &logits[(d - 1) * dv..d * dv];
        // Token of each node (None: dropped, with its descendants).
        let mut token: Vec<Option<u32>> = vec![None; shape.len()];
        let mut q_of: Vec<Q> = vec![Q::OneHot; shape.len()];
        if greedy {
            let deepest = shape.iter().map(|n| n.depth).max().unwrap_or(0);
            for d in 1..=deepest {
                let need = shape
                    .iter()
                    .filter(|n| n.depth == d)
                    .map(|n| n.rank + 1)
                    .max()
                    .unwrap_or(0);
                let top = top_k(head_logits(d), need);
                for (i, n) in shape.iter().enumerate() {
                    if n.depth == d && n.parent.is_none_or(|p| token[p].is_some()) {
                        token[i] = top.get(n.rank).map(|&t| self.to_target(t));
                    }
                }
            }
        } else {
            let params = params_of(s);
            let mut qs: HashMap<usize, Vec<(u32, f32)>> = HashMap::new();
            // Parents in order (the root first): draw their children.
            let parents = std::iter::once(None).chain((0..shape.len()).map(Some));
            for p in parents {
                if p.is_some_and(|p| token[p].is_none()) {
                    continue;
                }
                let kids: Vec<usize> = (0..shape.len()).filter(|&i| shape[i].parent == p).collect();
                let Some(&first) = kids.first() else {
                    continue;
                };
                let d = shape[first].depth;
                let q = qs.entry(d).or_insert_with(|| {
                    let dist = sampler::distribution(head_logits(d), &params);
                    dist.ids
                        .iter()
                        .zip(&dist.probs)
                        .filter(|(_, &p)| p > 0.0)
                        .map(|(&i, &p)| (self.to_target(i as usize), p))
                        .collect()
                });
                let mut left = q.clone();
                if self.top_tokens_sampled {
                    left.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                }
                for (j, &kid) in kids.iter().enumerate() {
                    if left.is_empty() {
                        break;
                    }
                    let t = if self.top_tokens_sampled {
                        left.remove(0).0
                    } else {
                        // Without replacement: from q renormalised
                        // without the earlier siblings.
                        take_without_replacement(&mut left, rng.next_f64()).map_or(0, |x| x.0)
                    };
                    token[kid] = Some(t);
                    q_of[kid] = if j == 0 {
                        Q::Sparse(q.clone())
                    } else {
                        Q::AsFirstSibling
                    };
                }
            }
        }
        // Emit the surviving nodes in order, parents remapped.
        let mut d = Proposal::default();
        let mut index = vec![-1i32; shape.len()];
        for (i, n) in shape.iter().enumerate() {
            let Some(t) = token[i] else { continue };
            if n.parent.is_some_and(|p| index[p] < 0) {
                continue;
            }
            index[i] = d.tokens.len() as i32;
            d.tokens.push(t);
            d.q.push(std::mem::replace(&mut q_of[i], Q::OneHot));
            if self.mode == Mode::Tree {
                d.parents
                    .get_or_insert_with(Vec::new)
                    .push(n.parent.map_or(-1, |p| index[p]));
            }
        }
        d
    }
}

#[cfg(feature = "builtin-head")]
mod builtin {
    pub const CONFIG: &str = include_str!("../heads/smollm2-135m-instruct/config.json");
    pub const WEIGHTS: &[u8] = include_bytes!("../heads/smollm2-135m-instruct/model.safetensors");
}

impl Plugin for Medusa {
    const NAME: &'static str = "medusa";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn default_capabilities() -> Caps {
        Caps {
            q_kind: abi::Q_SPARSE,
            sparse_k: 1 << 20,
            tree: true,
            max_depth: 4,
            siblings: Siblings::WithoutReplacement,
            ..Caps::one_hot(16)
        }
    }

    fn create(o: &Options, host: Host) -> Result<Self, String> {
        o.reject_unknown(&[
            "head",
            "mode",
            "tree",
            "max_draft",
            "depth",
            "seed",
            "test_control",
        ])?;
        let top_tokens_sampled = match o.get("test_control", String::new())?.as_str() {
            "" => false,
            "top_tokens_sampled" => true,
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
        let final_layer = host.n_layers().ok_or(
            "the host does not say how many layers the target has (ABI 2.1 or later needed)",
        )?;
        let mut head = Self::load_head(o, &host)?;
        let heads = head.cfg.heads;
        let choices: Vec<Vec<usize>> = match mode {
            Mode::Chain => {
                let depth = o.get("depth", heads)?;
                if depth == 0 || depth > heads {
                    return Err(format!(
                        "option `depth`: {depth}; the head file has {heads} heads"
                    ));
                }
                (1..=depth).map(|d| vec![0; d]).collect()
            }
            Mode::Tree => o.get(
                "tree",
                DEFAULT_TREE
                    .iter()
                    .filter(|p| p.len() <= heads)
                    .map(|p| p.to_vec())
                    .collect(),
            )?,
        };
        let shape = tree_shape(&choices, heads)?;
        let max_draft = o.get("max_draft", shape.len())?;
        if max_draft == 0 || shape.is_empty() {
            return Err("options `max_draft` and `tree` must give at least one node".into());
        }
        if head.needs_target_output() {
            let rows = target_rows(&host, &head.d2t)?;
            head.attach_target_output(rows)?;
        }
        host.log(
            2,
            &format!(
                "medusa heads loaded: {} heads x {} blocks, draft vocabulary {}, {:?} output, {} tree nodes, {:.1} MB per draft step",
                heads,
                head.cfg.layers,
                head.cfg.draft_vocab,
                head.cfg.output,
                shape.len(),
                head.step_bytes() as f64 / 1e6
            ),
        );
        Ok(Self {
            head,
            mode,
            shape,
            max_draft,
            seed: o.get("seed", 0u64)?,
            final_layer,
            top_tokens_sampled,
            seqs: HashMap::new(),
        })
    }

    fn capabilities(&self) -> Caps {
        let (tree, max_depth) = match self.mode {
            Mode::Tree => (
                true,
                self.shape.iter().map(|n| n.depth).max().unwrap_or(1) as u32,
            ),
            Mode::Chain => (false, 0),
        };
        Caps {
            q_kind: abi::Q_SPARSE,
            sparse_k: self.head.cfg.draft_vocab as u32,
            max_draft: self.max_draft.min(self.shape.len()) as u32,
            tree,
            max_depth,
            siblings: Siblings::WithoutReplacement,
            hidden_layers: vec![self.final_layer as u32],
            needs_embeddings: false,
            needs_output_head: self.head.cfg.output == specd_model::medusa::Output::Target,
            // A sequence keeps its newest hidden state only.
            kv_bytes_per_token: 0,
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

impl Medusa {
    fn propose_inner(&mut self, batch: &[SeqView<'_>]) -> Result<Vec<Proposal>, String> {
        let h = self.head.cfg.hidden;
        let seed = self.seed;
        // Keep each sequence's newest delivered row.
        for s in batch {
            if s.hidden_rows == 0 {
                continue;
            }
            if s.hidden_width != h || s.hidden_layers != 1 {
                return Err(format!(
                    "features of {} layers x {} delivered; the heads read 1 x {h}",
                    s.hidden_layers, s.hidden_width
                ));
            }
            let r = s.hidden_rows - 1;
            let row = s.layer(0)[r * h..(r + 1) * h].to_vec();
            let st = self.seqs.entry(s.seq).or_insert_with(|| SeqState {
                root: None,
                // Seeded from the request's seed (not the sequence id): a
                // seeded request drafts, and so decodes, the same every time.
                rng: Rng::new(seed ^ s.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            });
            st.root = Some((s.hidden_start as usize + r, row));
        }
        // Sequences to draft for: a state for the position before the
        // newest token.
        let mut active = Vec::new();
        let mut x = Vec::new();
        for (i, s) in batch.iter().enumerate() {
            let n = s.tokens.len();
            if s.max_draft == 0 || n < 2 {
                continue;
            }
            if let Some((pos, row)) = self.seqs.get(&s.seq).and_then(|st| st.root.as_ref()) {
                if pos + 2 == n {
                    active.push(i);
                    x.extend_from_slice(row);
                }
            }
        }
        let mut drafts: Vec<Proposal> = vec![Proposal::default(); batch.len()];
        if active.is_empty() {
            return Ok(drafts);
        }
        let rows = active.len();
        let logits = self.head.logits(&x, rows)?;
        let (k, dv) = (self.head.cfg.heads, self.head.cfg.draft_vocab);
        for (r, &i) in active.iter().enumerate() {
            // This row's logits, head by head.
            let mut mine = Vec::with_capacity(k * dv);
            for head in 0..k {
                let o = (head * rows + r) * dv;
                mine.extend_from_slice(&logits[o..o + dv]);
            }
            let s = &batch[i];
            let mut rng = match self.seqs.get(&s.seq) {
                Some(st) => st.rng.clone(),
                None => continue,
            };
            drafts[i] = self.draft(s, &mine, &mut rng);
            if let Some(st) = self.seqs.get_mut(&s.seq) {
                st.rng = rng;
            }
        }
        Ok(drafts)
    }
}

#[cfg(feature = "plugin")]
specd_plugin_sdk::export_proposer!(Medusa);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_choices_are_checked() {
        let ok = tree_shape(&[vec![0], vec![0, 0], vec![1], vec![1, 0]], 2).unwrap();
        assert_eq!(ok[3].parent, Some(2));
        assert_eq!(ok[3].depth, 2);
        let e = tree_shape(&[vec![0, 0], vec![0]], 4).unwrap_err();
        assert!(e.contains("[0, 0]") && e.contains("parent"), "{e}");
        let e = tree_shape(&[vec![0], vec![0]], 4).unwrap_err();
        assert!(e.contains("twice"), "{e}");
        let e = tree_shape(&[vec![0], vec![0, 0], vec![0, 0, 0]], 2).unwrap_err();
        assert!(e.contains("2 heads"), "{e}");
        let def: Vec<Vec<usize>> = DEFAULT_TREE.iter().map(|p| p.to_vec()).collect();
        assert_eq!(tree_shape(&def, 4).unwrap().len(), 16);
    }

    #[test]
    fn top_k_is_ordered_with_ties_by_id() {
        assert_eq!(top_k(&[0.1, 0.5, 0.5, -1.0, 0.3], 3), vec![1, 2, 4]);
        assert_eq!(top_k(&[1.0], 4), vec![0]);
    }
}
