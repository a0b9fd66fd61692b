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

/// A new set of proposers for `Drafter::swap` (a reload).
pub struct ProposerSet {
    /// New instances: added proposers, and replacements of changed ones.
    pub proposers: Vec<Box<dyn Proposer>>,
    /// Names whose current instance stays as it is (unchanged config).
    pub keep: Vec<String>,
}

impl std::fmt::Debug for ProposerSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProposerSet")
            .field(
                "proposers",
                &self.proposers.iter().map(|p| p.name()).collect::<Vec<_>>(),
            )
            .field("keep", &self.keep)
            .finish()
    }
}

/// One row of `Drafter::list`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ProposerListing {
    pub name: String,
    /// `live` (routable), `retired` (a replaced instance finishing its
    /// sequences) or `shadow`.
    pub role: &'static str,
    pub live_sequences: usize,
    pub max_draft: usize,
    pub tree: bool,
    pub hidden_layers: Vec<usize>,
    #[serde(flatten)]
    pub info: super::proposer::ProposerInfo,
    pub poisoned: Option<String>,
}

/// Owns the proposers; one `propose` call per proposer per step.
///
/// Slots are keyed by proposer name; a reload (`swap`) that replaces a
/// proposer with running sequences moves the old instance to a retired key
/// (`name@generation`) that those sequences keep until they finish.
pub struct Drafter {
    slots: HashMap<String, Slot>,
    /// Keys of retired slots (dropped with their last sequence).
    retired: std::collections::HashSet<String>,
    seqs: HashMap<SeqId, String>,
    shadows: Vec<Shadow>,
    /// The target's vocabulary size (drafted ids must fall below it).
    vocab: Option<usize>,
    /// What each proposer's propose calls cost since `take_spent`.
    spent: Vec<DraftSpent>,
}

/// One proposer's propose call in a step: its wall time, the tokens it
/// drafted and the sequences it drafted for (the scheduler prices the
/// proposer's own drafting from these, `Scheduler::record_drafting`).
#[derive(Debug, Clone, PartialEq)]
pub struct DraftSpent {
    pub proposer: String,
    pub seconds: f64,
    pub drafted: usize,
    pub seqs: Vec<SeqId>,
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
            retired: Default::default(),
            seqs: HashMap::new(),
            shadows: Vec::new(),
            vocab: None,
            spent: Vec::new(),
        }
    }

    /// The propose calls made since the last call, with what they cost.
    pub fn take_spent(&mut self) -> Vec<DraftSpent> {
        std::mem::take(&mut self.spent)
    }

    /// The target's vocabulary size; drafts with ids at or above it are
    /// refused (the engine sets this from its model).
    pub fn set_vocab(&mut self, vocab: usize) {
        self.vocab = Some(vocab);
    }

    /// Register a shadow proposer (scored, never verified), drafting at
    /// most `max_draft` tokens a step (the engine's limit on live drafts:
    /// its own declared limit is the plugin's word, and sizes the call's
    /// buffers).
    pub fn add_shadow(&mut self, proposer: Box<dyn Proposer>, max_draft: usize) {
        let mut caps = proposer.capabilities();
        caps.max_draft = caps.max_draft.min(max_draft);
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

    /// Swap in a new set of proposers between steps (a reload): `keep`
    /// names keep their instance; every other current proposer is dropped,
    /// except one replaced while sequences still draft with it, which is
    /// retired under the key `retire` names for it (`(seq, key)` pairs,
    /// chosen by the scheduler, which plans with the same keys). Sequences
    /// of a removed proposer decode plainly from the next step. Returns the
    /// capabilities of every slot afterwards (retired ones included).
    pub fn swap(
        &mut self,
        set: ProposerSet,
        retire: &[(SeqId, String)],
    ) -> HashMap<String, Capabilities> {
        let mut old = std::mem::take(&mut self.slots);
        let mut slots = HashMap::new();
        for n in &set.keep {
            if let Some(s) = old.remove(n) {
                slots.insert(n.clone(), s);
            }
        }
        for (seq, key) in retire {
            let Some(name) = self.seqs.get(seq).cloned() else {
                continue;
            };
            if let Some(s) = old.remove(&name) {
                slots.insert(key.clone(), s);
                self.retired.insert(key.clone());
            }
            if slots.contains_key(key) {
                self.seqs.insert(*seq, key.clone());
            }
        }
        // Retired slots from earlier reloads stay with their sequences.
        for k in self.retired.iter() {
            if let Some(s) = old.remove(k) {
                slots.insert(k.clone(), s);
            }
        }
        // Sequences still on an instance that goes now (one replaced or
        // removed without being retired: a sequence that ended in the
        // step the reload followed, or one orphaned by an earlier removal)
        // are finished on it and detached: a new instance under the same
        // name never started them, and a strict one would fail on them.
        let stale: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, name)| old.contains_key(name.as_str()))
            .map(|(&seq, _)| seq)
            .collect();
        for seq in stale {
            let Some(name) = self.seqs.remove(&seq) else {
                continue;
            };
            if let Some(slot) = old.get_mut(&name) {
                if slot.poisoned.is_none() {
                    let _ = catch_unwind(AssertUnwindSafe(|| slot.proposer.finish(seq)));
                }
            }
        }
        for p in set.proposers {
            let caps = p.capabilities();
            slots.insert(
                p.name().to_string(),
                Slot {
                    proposer: p,
                    caps,
                    poisoned: None,
                },
            );
        }
        // Whatever is left in `old` was replaced or removed: dropped here,
        // on the draft thread, between steps.
        drop(old);
        self.slots = slots;
        self.slots
            .iter()
            .map(|(k, s)| (k.clone(), s.caps.clone()))
            .collect()
    }

    /// Every proposer (live, retired, shadow) for the admin listing.
    pub fn list(&self) -> Vec<ProposerListing> {
        let row = |name: &str, role, slot: &Slot, live| {
            let mut info = slot.proposer.info();
            if slot.poisoned.is_some() {
                info.state = super::proposer::ProposerState::Poisoned;
            }
            ProposerListing {
                name: name.to_string(),
                role,
                live_sequences: live,
                max_draft: slot.caps.max_draft,
                tree: slot.caps.tree,
                hidden_layers: slot.caps.hidden_layers.clone(),
                info,
                poisoned: slot.poisoned.clone(),
            }
        };
        let mut out: Vec<ProposerListing> = self
            .slots
            .iter()
            .map(|(k, slot)| {
                let live = self.seqs.values().filter(|v| *v == k).count();
                let role = if self.retired.contains(k) {
                    "retired"
                } else {
                    "live"
                };
                row(k, role, slot, live)
            })
            .collect();
        out.sort_by(|a, b| (a.role, &a.name).cmp(&(b.role, &b.name)));
        for sh in &self.shadows {
            out.push(row(&sh.name, "shadow", &sh.slot, sh.log.len()));
        }
        out
    }

    /// Routable proposer names (retired instances excluded).
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .slots
            .keys()
            .filter(|k| !self.retired.contains(*k))
            .cloned()
            .collect();
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
            let started = std::time::Instant::now();
            let result = catch_unwind(AssertUnwindSafe(|| slot.proposer.propose(&batch)));
            let seconds = started.elapsed().as_secs_f64();
            match result {
                Ok(Ok(drafts)) if drafts.len() == batch.len() => {
                    let mut checked = Vec::with_capacity(drafts.len());
                    let mut bad = None;
                    for (mut d, b) in drafts.into_iter().zip(&batch) {
                        // Longer drafts than allowed are cut (documented);
                        // everything else must hold exactly.
                        d.cut_to(b.max_draft);
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
                            self.spent.push(DraftSpent {
                                proposer: name.clone(),
                                seconds,
                                drafted: checked.iter().map(|d| d.tokens.len()).sum(),
                                seqs: batch.iter().map(|b| b.seq).collect(),
                            });
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
                    sh.slot.proposer.observe(seq, committed, &[])
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
            slot.proposer.observe(seq, committed, path)
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
        if let Some(slot) = self.slots.get_mut(name.as_str()) {
            if slot.poisoned.is_none() {
                let r = catch_unwind(AssertUnwindSafe(|| {
                    slot.proposer.finish(seq);
                    Ok::<(), String>(())
                }));
                if let Some(why) = failure("finish", r) {
                    Self::poison(slot, &name, why);
                }
            }
        }
        // A retired instance goes with its last sequence.
        if self.retired.contains(&name) && !self.seqs.values().any(|v| *v == name) {
            self.retired.remove(&name);
            self.slots.remove(&name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speculative::proposer::DraftQ;

    /// Drafts `token` for every sequence; counts its calls.
    struct Fixed {
        name: String,
        token: u32,
        max_draft: usize,
    }

    impl Proposer for Fixed {
        fn name(&self) -> &str {
            &self.name
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                max_draft: self.max_draft,
                ..Capabilities::default()
            }
        }
        fn start(&mut self, _: SeqId, _: &[u32]) -> Result<(), String> {
            Ok(())
        }
        fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
            Ok(batch
                .iter()
                .map(|_| Draft {
                    tokens: vec![self.token],
                    q: vec![DraftQ::OneHot],
                    ..Draft::default()
                })
                .collect())
        }
        fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
            Ok(())
        }
        fn finish(&mut self, _: SeqId) {}
    }

    fn fixed(name: &str, token: u32, max_draft: usize) -> Box<dyn Proposer> {
        Box::new(Fixed {
            name: name.into(),
            token,
            max_draft,
        })
    }

    fn draft_of(d: &mut Drafter, seq: SeqId) -> Vec<u32> {
        let params = crate::sampler::SamplingParams::default();
        let toks = [1u32, 2, 3];
        let input = ProposeInput {
            seq,
            tokens: &toks,
            max_draft: 4,
            params: &params,
            hidden: &[],
            hidden_start: 0,
        };
        d.propose(&[input]).remove(0).tokens
    }

    #[test]
    fn a_swap_keeps_unchanged_instances_retires_replaced_ones_and_orphans_removed_ones() {
        let mut d = Drafter::new();
        d.add(fixed("a", 10, 4));
        d.add(fixed("b", 20, 4));
        d.add(fixed("c", 30, 4));
        for (seq, name) in [(1, "a"), (2, "b"), (3, "c")] {
            d.start(seq, name, &[1, 2, 3]);
        }
        // a unchanged, b replaced (seq 2 keeps the old one as b@1), c
        // removed, d added.
        let caps = d.swap(
            ProposerSet {
                proposers: vec![fixed("b", 21, 2), fixed("d", 40, 4)],
                keep: vec!["a".into()],
            },
            &[(2, "b@1".into())],
        );
        let mut keys: Vec<_> = caps.keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, ["a", "b", "b@1", "d"]);
        assert_eq!(caps["b"].max_draft, 2);
        assert_eq!(caps["b@1"].max_draft, 4);
        assert_eq!(d.names(), ["a", "b", "d"]);
        assert_eq!(draft_of(&mut d, 1), [10], "a keeps its instance");
        assert_eq!(draft_of(&mut d, 2), [20], "seq 2 keeps the replaced b");
        assert!(draft_of(&mut d, 3).is_empty(), "c was removed: plain");
        // Adding c back does not hand seq 3 to an instance that never
        // started it.
        d.swap(
            ProposerSet {
                proposers: vec![fixed("c", 31, 4)],
                keep: vec!["a".into(), "b".into(), "d".into()],
            },
            &[],
        );
        assert!(draft_of(&mut d, 3).is_empty(), "seq 3 stays plain");
        d.start(4, "b", &[1]);
        assert_eq!(draft_of(&mut d, 4), [21], "a new sequence gets the new b");
        let roles: Vec<_> = d.list().iter().map(|l| (l.name.clone(), l.role)).collect();
        assert!(roles.contains(&("b@1".into(), "retired")), "{roles:?}");
        // The retired instance goes with its last sequence.
        d.finish(2);
        assert!(d.capabilities("b@1").is_none());
        assert!(d.list().iter().all(|l| l.role != "retired"));
        d.finish(3);
        assert_eq!(draft_of(&mut d, 1), [10]);
    }

    /// Fails on any sequence it did not start (as the suffix plugin does).
    struct Strict {
        started: Vec<SeqId>,
        finished: std::sync::Arc<std::sync::Mutex<Vec<SeqId>>>,
    }

    impl Proposer for Strict {
        fn name(&self) -> &str {
            "x"
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                max_draft: 2,
                ..Capabilities::default()
            }
        }
        fn start(&mut self, seq: SeqId, _: &[u32]) -> Result<(), String> {
            self.started.push(seq);
            Ok(())
        }
        fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
            batch
                .iter()
                .map(|b| match self.started.contains(&b.seq) {
                    true => Ok(Draft::default()),
                    false => Err(format!("propose for unknown sequence {}", b.seq)),
                })
                .collect()
        }
        fn observe(&mut self, seq: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
            match self.started.contains(&seq) {
                true => Ok(()),
                false => Err(format!("observe for unknown sequence {seq}")),
            }
        }
        fn finish(&mut self, seq: SeqId) {
            self.finished.lock().unwrap().push(seq);
        }
    }

    #[test]
    fn a_replacement_never_sees_sequences_its_predecessor_started() {
        // A sequence that ended in the step a reload followed is not
        // retired (it is no longer running), but its last observe and
        // finish arrive after the swap: they must not reach the new
        // instance, which would fail on them and be poisoned for all.
        let (old_done, new_done) = (Default::default(), Default::default());
        let mut d = Drafter::new();
        d.add(Box::new(Strict {
            started: Vec::new(),
            finished: std::sync::Arc::clone(&old_done),
        }));
        d.start(7, "x", &[1, 2]);
        d.swap(
            ProposerSet {
                proposers: vec![Box::new(Strict {
                    started: Vec::new(),
                    finished: std::sync::Arc::clone(&new_done),
                })],
                keep: Vec::new(),
            },
            &[],
        );
        assert_eq!(
            *old_done.lock().unwrap(),
            [7],
            "finished on its own instance"
        );
        d.observe(7, &[3], &[]);
        d.finish(7);
        assert!(d.poisoned("x").is_none(), "{:?}", d.poisoned("x"));
        assert!(new_done.lock().unwrap().is_empty());
        // The new instance serves new sequences.
        d.start(8, "x", &[1]);
        d.observe(8, &[2], &[]);
        assert!(draft_of(&mut d, 8).is_empty());
        assert!(d.poisoned("x").is_none(), "{:?}", d.poisoned("x"));
    }

    /// Declares any draft limit; records the limits it is asked for.
    struct Asked {
        declared: usize,
        asked: std::sync::Arc<std::sync::Mutex<Vec<usize>>>,
    }

    impl Proposer for Asked {
        fn name(&self) -> &str {
            "asked"
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                max_draft: self.declared,
                ..Capabilities::default()
            }
        }
        fn start(&mut self, _: SeqId, _: &[u32]) -> Result<(), String> {
            Ok(())
        }
        fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
            let mut asked = self.asked.lock().unwrap();
            asked.extend(batch.iter().map(|b| b.max_draft));
            Ok(batch.iter().map(|_| Draft::default()).collect())
        }
        fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
            Ok(())
        }
        fn finish(&mut self, _: SeqId) {}
    }

    #[test]
    fn a_shadow_drafts_within_the_engines_limit_whatever_it_declares() {
        // A plugin's declared limit sizes its call's output buffers (times
        // the vocabulary for a full q): a shadow declaring billions must
        // be asked for no more than live drafts may be.
        let asked: std::sync::Arc<std::sync::Mutex<Vec<usize>>> = Default::default();
        let mut d = Drafter::new();
        d.add(fixed("a", 10, 4));
        d.add_shadow(
            Box::new(Asked {
                declared: u32::MAX as usize,
                asked: std::sync::Arc::clone(&asked),
            }),
            6,
        );
        d.start(1, "a", &[1, 2, 3]);
        assert_eq!(draft_of(&mut d, 1), [10]);
        assert_eq!(*asked.lock().unwrap(), [6]);
        let listed = d.list();
        let row = listed.iter().find(|r| r.role == "shadow").unwrap();
        assert_eq!(row.max_draft, 6);
    }
}
