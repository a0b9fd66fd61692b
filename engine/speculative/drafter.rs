//! The `Drafter`: the draft stage's struct, which owns the proposers.
//!
//! Invariants:
//! - A proposer failure (error or panic) poisons that proposer: its
//!   sequences continue with plain decoding (empty drafts), never lost.
//! - Drafts are capped at the smaller of the proposer's, the request's and
//!   the scheduler's limit; a proposer that returns more is truncated.
//! - A proposer sees only what its capabilities declare: token history
//!   always, target hidden states only for the layers it asked for.
//! - Every draft is validated before it reaches the verifier, for every
//!   proposer (built-in, plugin or test): token ids inside the vocabulary,
//!   one q per token of the declared kind, and each q a distribution
//!   (finite, non-negative, summing to 1 within 1e-3) that gives its drafted
//!   token positive mass. A draft that breaks a rule poisons its proposer
//!   with a message naming the rule, so one bad proposer never fails the
//!   batch's forward or biases sampling.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::proposer::{validate_draft, Capabilities, Draft, ProposeInput, Proposer};
use super::SeqId;
use crate::error::panic_message;

struct Slot {
    proposer: Box<dyn Proposer>,
    caps: Capabilities,
    poisoned: Option<String>,
}

/// A proposer drafting beside live traffic: its drafts are never verified,
/// only scored against the tokens the sequence actually commits (exactly
/// its acceptance under greedy decoding), at no target-forward cost.
struct Shadow {
    slot: Slot,
    name: String,
    /// Tokens committed per sequence since it started.
    log: HashMap<SeqId, Vec<u32>>,
    /// Unsettled drafts: (offset into `log`, tokens).
    pending: HashMap<SeqId, Vec<(usize, Vec<u32>)>>,
    score: super::SpecStats,
}

impl Shadow {
    /// Score drafts whose outcome is known (a mismatch, or enough committed
    /// tokens); with `all`, score the rest against what was committed.
    fn settle(&mut self, seq: SeqId, all: bool) {
        let (Some(log), Some(pend)) = (self.log.get(&seq), self.pending.get_mut(&seq)) else {
            return;
        };
        let score = &mut self.score;
        pend.retain(|(off, d)| {
            let avail = &log[(*off).min(log.len())..];
            let m = d.iter().zip(avail).take_while(|(a, b)| a == b).count();
            let decided = all || avail.len() >= d.len() || m < avail.len();
            if decided {
                score.record(d.len(), m);
            }
            !decided
        });
    }
}

/// Owns the proposers; one `propose` call per proposer per step.
pub struct Drafter {
    slots: HashMap<String, Slot>,
    seqs: HashMap<SeqId, String>,
    shadows: Vec<Shadow>,
    /// The target's vocabulary size (drafted ids must fall below it).
    vocab: Option<usize>,
}

impl std::fmt::Debug for Drafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drafter")
            .field("proposers", &self.slots.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// The failure message of a guarded call, if it failed.
fn failure<T>(what: &str, r: std::thread::Result<Result<T, String>>) -> Option<String> {
    match r {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(format!("{what}: {e}")),
        Err(p) => Some(format!("{what} panicked: {}", panic_message(&*p))),
    }
}

impl Default for Drafter {
    fn default() -> Self {
        Self::new()
    }
}

impl Drafter {
    pub fn new() -> Self {
        Self {
            slots: HashMap::new(),
            seqs: HashMap::new(),
            shadows: Vec::new(),
            vocab: None,
        }
    }

    /// The target's vocabulary size; drafts with ids at or above it are
    /// refused (the engine sets this from its model).
    pub fn set_vocab(&mut self, vocab: usize) {
        self.vocab = Some(vocab);
    }

    /// Register a shadow proposer (scored, never verified).
    pub fn add_shadow(&mut self, proposer: Box<dyn Proposer>) {
        let caps = proposer.capabilities();
        let name = proposer.name().to_string();
        self.shadows.push(Shadow {
            slot: Slot {
                proposer,
                caps,
                poisoned: None,
            },
            name,
            log: HashMap::new(),
            pending: HashMap::new(),
            score: Default::default(),
        });
    }

    /// Scores of the shadow proposers.
    pub fn shadow_stats(&self) -> Vec<(String, super::SpecStats)> {
        self.shadows
            .iter()
            .map(|s| (s.name.clone(), s.score.clone()))
            .collect()
    }

    /// Register a proposer under its name (replacing one of the same name).
    pub fn add(&mut self, proposer: Box<dyn Proposer>) {
        let caps = proposer.capabilities();
        self.slots.insert(
            proposer.name().to_string(),
            Slot {
                proposer,
                caps,
                poisoned: None,
            },
        );
    }

    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.slots.keys().cloned().collect();
        v.sort();
        v
    }

    pub fn has(&self, name: &str) -> bool {
        self.slots.contains_key(name)
    }

    pub fn capabilities(&self, name: &str) -> Option<&Capabilities> {
        self.slots.get(name).map(|s| &s.caps)
    }

    /// Why `name` was poisoned, if it was.
    pub fn poisoned(&self, name: &str) -> Option<&str> {
        self.slots.get(name).and_then(|s| s.poisoned.as_deref())
    }

    fn poison(slot: &mut Slot, name: &str, why: String) {
        tracing::warn!(proposer = name, reason = %why, "proposer failed; its sequences continue without speculation");
        metrics::counter!("specd_proposer_failures_total", "proposer" => name.to_string())
            .increment(1);
        slot.poisoned = Some(why);
    }

    /// Attach `seq` to proposer `name` (`none`: plain, shadows only).
    pub fn start(&mut self, seq: SeqId, name: &str, prompt: &[u32]) {
        for sh in &mut self.shadows {
            sh.log.insert(seq, Vec::new());
            sh.pending.insert(seq, Vec::new());
            if sh.slot.poisoned.is_none() {
                let r = catch_unwind(AssertUnwindSafe(|| sh.slot.proposer.start(seq, prompt)));
                if let Some(why) = failure("start", r) {
                    Self::poison(&mut sh.slot, &sh.name, why);
                }
            }
        }
        self.seqs.insert(seq, name.to_string());
        if let Some(slot) = self.slots.get_mut(name) {
            if slot.poisoned.is_some() {
                return;
            }
            match catch_unwind(AssertUnwindSafe(|| slot.proposer.start(seq, prompt))) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => Self::poison(slot, name, format!("start: {e}")),
                Err(p) => Self::poison(
                    slot,
                    name,
                    format!("start panicked: {}", panic_message(&*p)),
                ),
            }
        }
    }

    /// The proposer a sequence drafts with (if any).
    pub fn proposer_of(&self, seq: SeqId) -> Option<&str> {
        self.seqs.get(&seq).map(|s| s.as_str())
    }

    /// Hidden-state layers wanted for `seq` by its proposer.
    pub fn hidden_layers(&self, seq: SeqId) -> &[usize] {
        self.seqs
            .get(&seq)
            .and_then(|n| self.slots.get(n))
            .filter(|s| s.poisoned.is_none())
            .map(|s| s.caps.hidden_layers.as_slice())
            .unwrap_or(&[])
    }

    /// Draft for every input; sequences of a poisoned or failing proposer
    /// get empty drafts. Output is in input order.
    pub fn propose(&mut self, inputs: &[ProposeInput<'_>]) -> Vec<Draft> {
        let mut out = vec![Draft::default(); inputs.len()];
        let mut by_name: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, inp) in inputs.iter().enumerate() {
            if inp.max_draft == 0 {
                continue;
            }
            if let Some(name) = self.seqs.get(&inp.seq) {
                by_name.entry(name.as_str()).or_default().push(i);
            }
        }
        let names: Vec<(String, Vec<usize>)> = by_name
            .into_iter()
            .map(|(n, v)| (n.to_string(), v))
            .collect();
        for (name, idx) in names {
            let Some(slot) = self.slots.get_mut(&name) else {
                continue;
            };
            if slot.poisoned.is_some() {
                continue;
            }
            let cap = slot.caps.max_draft;
            let batch: Vec<ProposeInput<'_>> = idx
                .iter()
                .map(|&i| ProposeInput {
                    seq: inputs[i].seq,
                    tokens: inputs[i].tokens,
                    max_draft: inputs[i].max_draft.min(cap),
                    params: inputs[i].params,
                    hidden: inputs[i].hidden,
                    hidden_start: inputs[i].hidden_start,
                })
                .collect();
            match catch_unwind(AssertUnwindSafe(|| slot.proposer.propose(&batch))) {
                Ok(Ok(drafts)) if drafts.len() == batch.len() => {
                    let mut checked = Vec::with_capacity(drafts.len());
                    let mut bad = None;
                    for (mut d, b) in drafts.into_iter().zip(&batch) {
                        // Longer drafts than allowed are cut (documented);
                        // everything else must hold exactly.
                        let n = d.tokens.len().min(b.max_draft);
                        let consistent = d.q.len() == d.tokens.len()
                            && d.parents.as_ref().is_none_or(|p| p.len() == d.tokens.len());
                        if consistent {
                            d.truncate(n);
                        }
                        let greedy = b.params.is_greedy();
                        if let Err(why) = validate_draft(&d, &slot.caps, self.vocab, greedy) {
                            bad = Some(format!("sequence {}: {why}", b.seq));
                            break;
                        }
                        checked.push(d);
                    }
                    match bad {
                        Some(why) => Self::poison(slot, &name, format!("invalid draft: {why}")),
                        None => {
                            for (&i, d) in idx.iter().zip(checked) {
                                out[i] = d;
                            }
                        }
                    }
                }
                Ok(Ok(drafts)) => Self::poison(
                    slot,
                    &name,
                    format!(
                        "propose returned {} drafts for {} sequences",
                        drafts.len(),
                        batch.len()
                    ),
                ),
                Ok(Err(e)) => Self::poison(slot, &name, format!("propose: {e}")),
                Err(p) => Self::poison(
                    slot,
                    &name,
                    format!("propose panicked: {}", panic_message(&*p)),
                ),
            }
        }
        self.shadow_propose(inputs);
        out
    }

    fn shadow_propose(&mut self, inputs: &[ProposeInput<'_>]) {
        for sh in &mut self.shadows {
            if sh.slot.poisoned.is_some() || inputs.is_empty() {
                continue;
            }
            let cap = sh.slot.caps.max_draft;
            let batch: Vec<ProposeInput<'_>> = inputs
                .iter()
                .filter(|i| sh.log.contains_key(&i.seq))
                .map(|i| ProposeInput {
                    seq: i.seq,
                    tokens: i.tokens,
                    max_draft: cap,
                    params: i.params,
                    hidden: i.hidden,
                    hidden_start: i.hidden_start,
                })
                .collect();
            if batch.is_empty() {
                continue;
            }
            match catch_unwind(AssertUnwindSafe(|| sh.slot.proposer.propose(&batch))) {
                Ok(Ok(drafts)) if drafts.len() == batch.len() => {
                    for (b, d) in batch.iter().zip(drafts) {
                        if d.tokens.is_empty() {
                            continue;
                        }
                        let off = sh.log.get(&b.seq).map(|l| l.len()).unwrap_or(0);
                        let mut t = d.tokens;
                        t.truncate(cap);
                        sh.pending.entry(b.seq).or_default().push((off, t));
                    }
                }
                other => {
                    let why = match other {
                        Ok(Ok(d)) => format!(
                            "propose returned {} drafts for {} sequences",
                            d.len(),
                            batch.len()
                        ),
                        Ok(Err(e)) => format!("propose: {e}"),
                        Err(p) => format!("propose panicked: {}", panic_message(&*p)),
                    };
                    Self::poison(&mut sh.slot, &sh.name, why);
                }
            }
        }
    }

    /// Tokens a step committed for `seq`, and the accepted path through
    /// its draft (node indices, root first).
    pub fn observe(&mut self, seq: SeqId, committed: &[u32], path: &[usize]) {
        for sh in &mut self.shadows {
            let Some(log) = sh.log.get_mut(&seq) else {
                continue;
            };
            log.extend_from_slice(committed);
            sh.score.tokens += committed.len() as u64;
            sh.settle(seq, false);
            if sh.slot.poisoned.is_none() {
                let r = catch_unwind(AssertUnwindSafe(|| {
                    sh.slot.proposer.observe(seq, committed)
                }));
                if let Some(why) = failure("observe", r) {
                    Self::poison(&mut sh.slot, &sh.name, why);
                }
            }
        }
        let Some(name) = self.seqs.get(&seq).cloned() else {
            return;
        };
        let Some(slot) = self.slots.get_mut(name.as_str()) else {
            return;
        };
        if slot.poisoned.is_some() {
            return;
        }
        let r = catch_unwind(AssertUnwindSafe(|| {
            slot.proposer.observe_path(seq, committed, path)
        }));
        if let Some(why) = failure("observe", r) {
            Self::poison(slot, &name, why);
        }
    }

    pub fn finish(&mut self, seq: SeqId) {
        for sh in &mut self.shadows {
            if !sh.log.contains_key(&seq) {
                continue;
            }
            sh.settle(seq, true);
            sh.score.requests += 1;
            sh.log.remove(&seq);
            sh.pending.remove(&seq);
            if sh.slot.poisoned.is_none() {
                let r = catch_unwind(AssertUnwindSafe(|| {
                    sh.slot.proposer.finish(seq);
                    Ok::<(), String>(())
                }));
                if let Some(why) = failure("finish", r) {
                    Self::poison(&mut sh.slot, &sh.name, why);
                }
            }
        }
        let Some(name) = self.seqs.remove(&seq) else {
            return;
        };
        let Some(slot) = self.slots.get_mut(name.as_str()) else {
            return;
        };
        if slot.poisoned.is_some() {
            return;
        }
        let r = catch_unwind(AssertUnwindSafe(|| {
            slot.proposer.finish(seq);
            Ok::<(), String>(())
        }));
        if let Some(why) = failure("finish", r) {
            Self::poison(slot, &name, why);
        }
    }
}
