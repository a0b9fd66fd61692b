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

use std::sync::Arc;

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

/// How the children of one tree node were drawn, which decides how
/// multi-candidate rejection sampling updates q after a rejection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SiblingMode {
    /// Each child drawn independently from the parent's q (with
    /// replacement): q stays the same for every sibling.
    Iid,
    /// Children drawn one after another from the parent's q without
    /// replacement (distinct tokens): after a rejected sibling x, q becomes
    /// norm(q with x removed).
    #[default]
    WithoutReplacement,
}

/// What a proposer declares about itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Capabilities {
    /// Target layers whose hidden states it needs (see `model::ForwardOutput`),
    /// in the order it wants them.
    pub hidden_layers: Vec<usize>,
    pub q_kind: QKind,
    /// Most drafted tokens (tree nodes) per sequence and step.
    pub max_draft: usize,
    /// Emits token trees (parent indices) rather than linear chains.
    pub tree: bool,
    /// Deepest tree node (chains: `max_draft`).
    pub max_depth: usize,
    /// How siblings are drawn (trees only).
    pub siblings: SiblingMode,
    /// What drafting one token costs the proposer itself, relative to a
    /// one-token target forward (`[[proposer]] token_cost`). The adaptive
    /// policy adds it to a drafted token's verify cost, so a proposer whose
    /// own model costs more than its acceptance earns stops drafting.
    /// `None` (not configured): where the verify price is measured too
    /// (in a batch, or a sequence alone that is greedy or drafted one-hot:
    /// `Scheduler::measured_price`) the scheduler measures it from the
    /// proposer's calls (`Scheduler::own_cost`); a sampled sequence
    /// decoding alone with drafts of another q kind prices it at 0, so its
    /// draft lengths (and a seeded request's tokens) do not depend on
    /// timing.
    pub token_cost: Option<f64>,
    /// Bytes of per-sequence cache the proposer keeps per token of a
    /// sequence, at most (a draft model's KV cache): the KV manager charges
    /// them to the budget beside the target's cache (`kv_manager`).
    pub kv_bytes_per_token: usize,
}

impl Default for Capabilities {
    fn default() -> Self {
        Self {
            hidden_layers: Vec::new(),
            q_kind: QKind::OneHot,
            max_draft: 4,
            tree: false,
            max_depth: 16,
            siblings: SiblingMode::default(),
            token_cost: None,
            kv_bytes_per_token: 0,
        }
    }
}

/// The draft distribution at one draft position.
#[derive(Debug, Clone, PartialEq)]
pub enum DraftQ {
    OneHot,
    Sparse(Distribution),
    /// Dense probabilities over the vocabulary (shared between the siblings
    /// of a tree node, which were all drawn from it).
    Full(Arc<[f32]>),
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

/// One sequence's drafted tokens, with q for each: a chain, or a tree.
///
/// In a tree, `parents[i]` is the index of node i's parent (`-1`: it hangs
/// off the committed context), always smaller than `i`; siblings appear in
/// the order they were drawn. `q[i]` is the distribution node i was drawn
/// from at its parent *before* any earlier sibling was drawn, so siblings
/// carry the same q (share the `Arc`); the sibling mode says how drawing
/// the earlier siblings changed it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// Same length as `tokens`.
    pub q: Vec<DraftQ>,
    /// `None`: a chain (node i's parent is i - 1).
    pub parents: Option<Vec<i32>>,
    /// The member of a composed proposer that drafted it (metrics and
    /// reports label the step with it); `None`: the proposer itself.
    pub source: Option<String>,
}

impl Draft {
    /// Parent of node `i` (`None`: the root, i.e. the committed context).
    pub fn parent(&self, i: usize) -> Option<usize> {
        match &self.parents {
            None => i.checked_sub(1),
            Some(p) => usize::try_from(p[i]).ok(),
        }
    }

    /// Depth of every node (1 for children of the root).
    pub fn depths(&self) -> Vec<usize> {
        let mut d = vec![0usize; self.tokens.len()];
        for i in 0..d.len() {
            d[i] = self.parent(i).map_or(1, |p| d[p] + 1);
        }
        d
    }

    /// Keep the first `n` nodes (a prefix of a tree is a tree, since
    /// parents precede children).
    pub fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
        self.q.truncate(n);
        if let Some(p) = &mut self.parents {
            p.truncate(n);
        }
    }

    /// Cut a proposer's draft to the `max` nodes it was asked for (longer
    /// drafts are cut, as documented), unless its parts disagree in length,
    /// which validation then refuses as they are.
    pub fn cut_to(&mut self, max: usize) {
        let consistent = self.q.len() == self.tokens.len()
            && self
                .parents
                .as_ref()
                .is_none_or(|p| p.len() == self.tokens.len());
        if consistent {
            self.truncate(self.tokens.len().min(max));
        }
    }
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
    /// Hidden states of the declared layers, in declaration order
    /// (`(layer, rows x hidden)`), for every position committed since this
    /// proposer last saw the sequence (prefill positions included), at
    /// most the newest `SchedulerConfig::max_hidden_rows` and a quarter:
    /// rows cover positions
    /// `hidden_start..hidden_start + rows`.
    pub hidden: &'a [(usize, Vec<f32>)],
    pub hidden_start: usize,
}

/// Where a plugin runs (`[[proposer]] isolation`).
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// In the daemon's process.
    #[default]
    None,
    /// In a `specd plugin-host` child.
    Process,
}

impl Isolation {
    pub fn is_none(&self) -> bool {
        *self == Isolation::None
    }
}

/// A proposer instance's health, as the admin listing shows it.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ProposerState {
    #[default]
    Healthy,
    /// A plugin-host child is being replaced.
    Restarting,
    /// It failed and serves no drafts until a reload.
    Poisoned,
}

/// What the admin listing (`GET /v1/admin/proposers`) says about a
/// proposer instance.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ProposerInfo {
    /// The plugin's own name (a built-in's name, or `compose`).
    pub plugin: String,
    pub version: String,
    pub build_id: String,
    /// The library it was loaded from.
    pub path: Option<String>,
    pub isolation: Isolation,
    pub state: ProposerState,
    /// The plugin host's process id (process isolation).
    pub pid: Option<u32>,
    pub restarts: u64,
    pub crashes: u64,
    pub timeouts: u64,
    /// From a child's failure to its replacement's first answer (the
    /// backoff included).
    pub last_recovery_ms: Option<f64>,
    /// From starting the replacement child to its first answer.
    pub last_start_ms: Option<f64>,
    pub last_failure: Option<String>,
    /// The library file this instance runs (or, composed, a member's) was
    /// replaced since it was loaded: a reload builds the proposer anew.
    pub library_rebuilt: bool,
}

/// A drafting strategy. Implementations live in the engine (built-ins and
/// test proposers) or behind the plugin ABI.
pub trait Proposer: Send {
    fn name(&self) -> &str;
    fn capabilities(&self) -> Capabilities;
    /// What to list about this instance (defaults: an in-process proposer
    /// named after itself, healthy).
    fn info(&self) -> ProposerInfo {
        ProposerInfo {
            plugin: self.name().to_string(),
            ..ProposerInfo::default()
        }
    }
    /// A sequence starts (or restarts after preemption) with `prompt`.
    fn start(&mut self, seq: SeqId, prompt: &[u32]) -> Result<(), String>;
    /// Draft for every sequence in `batch` in one call.
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String>;
    /// Tokens committed for `seq` by the last step, and the accepted path
    /// through its draft (node indices, root first; empty when the step
    /// had no draft of this proposer's).
    fn observe(&mut self, seq: SeqId, committed: &[u32], path: &[usize]) -> Result<(), String>;
    fn finish(&mut self, seq: SeqId);
}

/// A proposer with what the host's configuration sets about it; everything
/// else passes through.
/// - `token_cost`: its own drafting cost (`Capabilities::token_cost`).
/// - `trust_q` (`[[proposer]] trust_q`, default true): whether sampled
///   acceptance uses the q it reports. Without trust every drafted token
///   is verified as a point mass (`accept`'s coupling: the position emits
///   plain decoding's draw, and a candidate equal to it is accepted, with
///   the target's probability of it). That is
///   exact whatever the proposer drafted and however it drew it (only its
///   draws must not see the engine's), so losslessness does not rest on a
///   plugin reporting the q it drew from; the price is acceptance
///   (`sum_x q(x) p(x)` instead of `sum_x min(p(x), q(x))` for a truthful
///   one). Greedy decoding is unchanged.
pub struct Configured {
    pub inner: Box<dyn Proposer>,
    pub token_cost: Option<f64>,
    pub trust_q: bool,
}

impl Proposer for Configured {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        let inner = self.inner.capabilities();
        Capabilities {
            token_cost: self.token_cost.or(inner.token_cost),
            q_kind: if self.trust_q {
                inner.q_kind
            } else {
                QKind::OneHot
            },
            ..inner
        }
    }
    fn info(&self) -> ProposerInfo {
        self.inner.info()
    }
    fn start(&mut self, seq: SeqId, prompt: &[u32]) -> Result<(), String> {
        self.inner.start(seq, prompt)
    }
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
        let mut drafts = self.inner.propose(batch)?;
        if !self.trust_q {
            for d in &mut drafts {
                d.q.iter_mut().for_each(|q| *q = DraftQ::OneHot);
            }
        }
        Ok(drafts)
    }
    fn observe(&mut self, seq: SeqId, committed: &[u32], path: &[usize]) -> Result<(), String> {
        self.inner.observe(seq, committed, path)
    }
    fn finish(&mut self, seq: SeqId) {
        self.inner.finish(seq)
    }
}

/// Tolerance on the total mass of a reported q.
pub const Q_SUM_TOLERANCE: f64 = 1e-3;

/// The part of `validate_draft` that says whether a draft can be read at
/// all: one q per token, and a tree's parents earlier nodes within the
/// declared depth (a composite checks its members' drafts so before it
/// reads their trees; their q is checked where the composite's is).
pub fn validate_shape(d: &Draft, caps: &Capabilities) -> Result<(), String> {
    if d.q.len() != d.tokens.len() {
        return Err(format!(
            "{} drafted tokens but {} q entries",
            d.tokens.len(),
            d.q.len()
        ));
    }
    if let Some(parents) = &d.parents {
        if !caps.tree {
            return Err("returned a tree but declared linear drafts".into());
        }
        if parents.len() != d.tokens.len() {
            return Err(format!(
                "{} drafted tokens but {} parents",
                d.tokens.len(),
                parents.len()
            ));
        }
        for (i, &p) in parents.iter().enumerate() {
            if p < -1 || p >= i as i32 {
                return Err(format!(
                    "node {i}: parent {p} must be -1 or an earlier node"
                ));
            }
        }
        if let Some((i, depth)) = d
            .depths()
            .into_iter()
            .enumerate()
            .find(|&(_, depth)| depth > caps.max_depth)
        {
            return Err(format!(
                "node {i}: depth {depth} exceeds the declared max_depth {}",
                caps.max_depth
            ));
        }
    }
    Ok(())
}

/// Check one draft against the rules every proposer must follow (see the
/// module invariants); `Err` names the rule and the offending position.
///
/// Under greedy decoding every proposer may report a one-hot q (its draft is
/// the argmax of whatever it computed); under sampling q must be of the
/// declared kind. Trees: parents precede their children, depth stays within
/// the declared limit, and under sampling the siblings of a node share their
/// q, give each sibling positive mass and, drawn without replacement, are
/// distinct tokens.
pub fn validate_draft(
    d: &Draft,
    caps: &Capabilities,
    vocab: Option<usize>,
    greedy: bool,
) -> Result<(), String> {
    let kind = caps.q_kind;
    validate_shape(d, caps)?;
    let in_vocab = |t: u32| vocab.is_none_or(|v| (t as usize) < v);
    // Full q vectors already checked (siblings share one).
    let mut checked: Vec<*const f32> = Vec::new();
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
                if !checked.contains(&v.as_ptr()) {
                    mass(&mut v.iter().copied())?;
                    checked.push(v.as_ptr());
                }
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
    if !greedy && d.parents.is_some() {
        validate_siblings(d, caps.siblings)?;
    }
    Ok(())
}

/// Under sampling, the siblings of each node were drawn from one q: every
/// later sibling repeats the first one's q, and without replacement the
/// siblings are distinct tokens. Siblings that are each a point mass on
/// their own token (a lookup's candidates, lifted to sparse or full q by a
/// composite) are deterministic candidates, which acceptance verifies
/// exactly by coupling (`accept`'s one-hot children).
fn validate_siblings(d: &Draft, mode: SiblingMode) -> Result<(), String> {
    let mut first: std::collections::HashMap<Option<usize>, usize> = Default::default();
    let mut tokens: std::collections::HashMap<Option<usize>, Vec<u32>> = Default::default();
    for i in 0..d.tokens.len() {
        let parent = d.parent(i);
        let f = *first.entry(parent).or_insert(i);
        let seen = tokens.entry(parent).or_default();
        if mode == SiblingMode::WithoutReplacement && seen.contains(&d.tokens[i]) {
            return Err(format!(
                "node {i}: token {} repeats a sibling, but siblings are declared drawn without replacement",
                d.tokens[i]
            ));
        }
        seen.push(d.tokens[i]);
        if f == i {
            continue;
        }
        let same = match (&d.q[f], &d.q[i]) {
            (DraftQ::Full(a), DraftQ::Full(b)) => Arc::ptr_eq(a, b) || a == b,
            (a, b) => a == b,
        } || (super::accept::point_mass(&d.q[f], d.tokens[f])
            && super::accept::point_mass(&d.q[i], d.tokens[i]));
        if !same {
            return Err(format!(
                "node {i}: siblings must carry the same q (the distribution at their parent)"
            ));
        }
    }
    Ok(())
}
