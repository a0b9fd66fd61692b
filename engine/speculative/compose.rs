//! `Compose`: a proposer made of member proposers (e.g. suffix and eagle)
//! that picks, per sequence and step, the member whose draft promises the
//! most accepted tokens per unit of cost.
//!
//! Members are asked in configuration order (cheapest first). After a
//! member drafts, its draft is scored by its expected accepted tokens
//! (from that member's acceptance on this sequence, an EMA with a prior
//! from all sequences) per unit of cost (one target forward, plus the
//! verify cost of the drafted tokens, plus the member's own drafting cost);
//! a member not yet asked is scored by what its steps accepted so far. The
//! sequence stops asking as soon as a draft in hand beats every member
//! still unasked, so an expensive member (eagle) only drafts when the
//! cheap one (suffix) has no convincing match.
//!
//! Invariants:
//! - Every member sees every committed token (`observe`), and every target
//!   hidden row of the layers it declared, in order: rows delivered while
//!   a member was not asked are kept for it and passed with its next call
//!   (flushed through a zero-length call when they pile up).
//! - A draft is passed on unchanged but for its q's representation (a
//!   one-hot q becomes the composite's declared kind), and is labelled with
//!   the member that drafted it (`Draft::source`), which metrics carry.

use std::collections::HashMap;

use super::hidden::HiddenRows;
use super::proposer::{Capabilities, Draft, DraftQ, ProposeInput, Proposer, QKind};
use super::SeqId;
use crate::sampler::{Distribution, SamplingParams};

/// Rows of buffered hidden states beyond which a member is flushed.
const FLUSH_ROWS: usize = 64;

/// Bounds of a member's probe interval (steps).
const PROBE_MIN: u32 = 8;
const PROBE_MAX: u32 = 128;

/// An exponential moving average with a prior.
#[derive(Debug, Clone, Copy)]
struct Ema {
    value: f64,
    n: u32,
}

impl Ema {
    fn new(prior: f64) -> Self {
        Self { value: prior, n: 0 }
    }

    /// The prior counts as two observations; later ones decay at 0.25.
    fn add(&mut self, x: f64) {
        self.n = self.n.saturating_add(1);
        let w = (1.0 / f64::from(self.n + 2)).max(0.25);
        self.value += w * (x - self.value);
    }
}

/// Acceptance of one member: per drafted depth, and accepted per step.
#[derive(Debug, Clone, Copy)]
struct Track {
    rate: Ema,
    per_step: Ema,
}

impl Track {
    fn new(prior: &Track) -> Self {
        Self {
            rate: Ema::new(prior.rate.value),
            per_step: Ema::new(prior.per_step.value),
        }
    }

    fn record(&mut self, depth: usize, accepted: usize) {
        if depth > 0 {
            self.rate.add(accepted as f64 / depth as f64);
            self.per_step.add(accepted as f64);
        }
    }
}

struct Member {
    name: String,
    proposer: Box<dyn Proposer>,
    caps: Capabilities,
    /// Drafting cost of one call relative to a one-token target forward.
    cost: f64,
    /// For each of the member's layers, its index in the composite's.
    layer_idx: Vec<usize>,
    prior: Track,
}

/// Hidden rows waiting for one member.
#[derive(Debug, Default)]
struct Pending {
    start: usize,
    rows: usize,
    /// One block per member layer.
    layers: HiddenRows,
}

#[derive(Debug)]
struct SeqState {
    tracks: Vec<Track>,
    pending: Vec<Pending>,
    /// The member that drafted the last step and the draft's depth.
    last: Option<(usize, usize)>,
    /// Drafting steps so far.
    steps: u32,
    /// Per member: every how many steps it is asked even when its estimate
    /// says it will lose (a probe, so a member that fell behind can come
    /// back). Starts at `PROBE_MIN`; doubles (up to `PROBE_MAX`) each time
    /// a probe loses, so a member that keeps losing costs little; back to
    /// `PROBE_MIN` when it wins.
    probe_every: Vec<u32>,
}

pub struct Compose {
    name: String,
    members: Vec<Member>,
    caps: Capabilities,
    vocab: usize,
    /// The target's hidden width (of delivered hidden rows).
    hidden: usize,
    /// Verify cost of one drafted token relative to a one-token forward.
    verify_cost: f64,
    seqs: HashMap<SeqId, SeqState>,
}

impl std::fmt::Debug for Compose {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compose")
            .field("name", &self.name)
            .field(
                "members",
                &self.members.iter().map(|m| &m.name).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// A member to compose: its name (for labels), the proposer and its
/// drafting cost per call relative to a one-token target forward.
pub struct MemberSpec {
    pub name: String,
    pub proposer: Box<dyn Proposer>,
    pub cost: f64,
}

impl Compose {
    /// A composite from its `[[proposer]]` table: `members` (name and
    /// instance, in `compose` order) and the options `costs` (member name
    /// -> cost of one call, in one-token target forwards; default 0) and
    /// `verify_cost` (per drafted token; default `default_verify_cost`,
    /// the engine's `draft_cost`).
    pub fn from_options(
        name: &str,
        members: Vec<(String, Box<dyn Proposer>)>,
        options: &toml::Table,
        default_verify_cost: f64,
        target: &crate::model::ModelConfig,
    ) -> Result<Self, String> {
        let number = |v: &toml::Value| v.as_float().or(v.as_integer().map(|i| i as f64));
        let costs = options.get("costs").and_then(|c| c.as_table());
        let members = members
            .into_iter()
            .map(|(m, proposer)| MemberSpec {
                cost: costs
                    .and_then(|c| c.get(&m))
                    .and_then(number)
                    .unwrap_or(0.0),
                name: m,
                proposer,
            })
            .collect();
        let verify_cost = options
            .get("verify_cost")
            .and_then(number)
            .unwrap_or(default_verify_cost);
        Self::new(name, members, target.vocab_size, target.hidden, verify_cost)
    }

    /// Compose `members` (asked in this order) for a target of `vocab`
    /// tokens and hidden width `hidden`, with `verify_cost` per drafted
    /// token.
    pub fn new(
        name: &str,
        members: Vec<MemberSpec>,
        vocab: usize,
        hidden: usize,
        verify_cost: f64,
    ) -> Result<Self, String> {
        if members.is_empty() {
            return Err(format!("compose proposer `{name}`: no members"));
        }
        let mut layers: Vec<usize> = Vec::new();
        let mut caps = Capabilities {
            q_kind: QKind::OneHot,
            max_draft: 0,
            max_depth: 0,
            ..Default::default()
        };
        let mut tree_mode = None;
        let mut out = Vec::new();
        for m in members {
            let c = m.proposer.capabilities();
            let layer_idx = c
                .hidden_layers
                .iter()
                .map(|l| match layers.iter().position(|x| x == l) {
                    Some(i) => i,
                    None => {
                        layers.push(*l);
                        layers.len() - 1
                    }
                })
                .collect();
            caps.q_kind = match (caps.q_kind, c.q_kind) {
                (QKind::Full, _) | (_, QKind::Full) => QKind::Full,
                (QKind::Sparse, _) | (_, QKind::Sparse) => QKind::Sparse,
                _ => QKind::OneHot,
            };
            caps.max_draft = caps.max_draft.max(c.max_draft);
            // Every member keeps its own cache for the sequence.
            caps.kv_bytes_per_token = caps.kv_bytes_per_token.saturating_add(c.kv_bytes_per_token);
            caps.max_depth = caps
                .max_depth
                .max(if c.tree { c.max_depth } else { c.max_draft });
            if c.tree {
                if tree_mode.is_some_and(|t| t != c.siblings) {
                    return Err(format!(
                        "compose proposer `{name}`: tree members draw siblings differently ({:?} vs {:?})",
                        tree_mode, c.siblings
                    ));
                }
                tree_mode = Some(c.siblings);
                caps.tree = true;
                caps.siblings = c.siblings;
            }
            let prior = Track {
                rate: Ema::new(0.5),
                per_step: Ema::new(1.0),
            };
            out.push(Member {
                name: m.name,
                proposer: m.proposer,
                caps: c,
                cost: m.cost,
                layer_idx,
                prior,
            });
        }
        caps.hidden_layers = layers;
        Ok(Self {
            name: name.to_string(),
            members: out,
            caps,
            vocab,
            hidden,
            verify_cost,
            seqs: HashMap::new(),
        })
    }

    fn state(&mut self, seq: SeqId) -> &mut SeqState {
        let members = &self.members;
        self.seqs.entry(seq).or_insert_with(|| SeqState {
            tracks: members.iter().map(|m| Track::new(&m.prior)).collect(),
            pending: members.iter().map(|_| Pending::default()).collect(),
            last: None,
            steps: 0,
            probe_every: members.iter().map(|_| PROBE_MIN).collect(),
        })
    }

    /// Expected accepted tokens of a drafted `d` by member `m` per cost.
    fn value_of(&self, m: usize, track: &Track, d: &Draft) -> f64 {
        if d.tokens.is_empty() {
            return 1.0 / (1.0 + self.members[m].cost);
        }
        let expected = if d.parents.is_some() {
            track.per_step.value
        } else {
            let a = track.rate.value.clamp(0.0, 0.999);
            (1..=d.tokens.len()).map(|i| a.powi(i as i32)).sum()
        };
        (1.0 + expected) / (1.0 + self.verify_cost * d.tokens.len() as f64 + self.members[m].cost)
    }

    /// What member `m` is expected to be worth before it drafts.
    fn estimate(&self, m: usize, track: &Track, max_draft: usize) -> f64 {
        let c = &self.members[m].caps;
        let n = c.max_draft.min(max_draft).max(1) as f64;
        let expected = if c.tree {
            track.per_step.value
        } else {
            let a = track.rate.value.clamp(0.0, 0.999);
            (1..=n as i32).map(|i| a.powi(i)).sum()
        };
        (1.0 + expected) / (1.0 + self.verify_cost * n + self.members[m].cost)
    }

    /// A member's q in the composite's declared kind: one-hot lifted to
    /// sparse or full, sparse to full. Siblings that carried one q carry
    /// one (shared) q after the conversion.
    fn convert(&self, mut d: Draft) -> Draft {
        let dense = |ids: &[u32], probs: &[f32]| -> DraftQ {
            let mut v = vec![0f32; self.vocab];
            for (&i, &p) in ids.iter().zip(probs) {
                if let Some(x) = v.get_mut(i as usize) {
                    *x = p;
                }
            }
            DraftQ::Full(v.into())
        };
        let mut done: Vec<(Distribution, DraftQ)> = Vec::new();
        for (q, &t) in d.q.iter_mut().zip(&d.tokens) {
            let new = match (&*q, self.caps.q_kind) {
                (DraftQ::OneHot, QKind::Sparse) => DraftQ::Sparse(Distribution::one_hot(t)),
                (DraftQ::OneHot, QKind::Full) => dense(&[t], &[1.0]),
                (DraftQ::Sparse(s), QKind::Full) => match done.iter().find(|(k, _)| k == s) {
                    Some((_, f)) => f.clone(),
                    None => {
                        let f = dense(&s.ids, &s.probs);
                        done.push((s.clone(), f.clone()));
                        f
                    }
                },
                _ => continue,
            };
            *q = new;
        }
        d
    }

    /// Call member `m` for the inputs `idx` (with their pending hidden
    /// rows), at their own draft limits or `max_draft: Some(0)` to flush.
    fn call(
        &mut self,
        m: usize,
        batch: &[ProposeInput<'_>],
        idx: &[usize],
        max_draft: Option<usize>,
    ) -> Result<Vec<Draft>, String> {
        let pend: Vec<Pending> = idx
            .iter()
            .map(|&i| std::mem::take(&mut self.state(batch[i].seq).pending[m]))
            .collect();
        // Each member draws from its own stream: two plugins that seed
        // their generators alike from the request's seed (eagle and
        // medusa do) would otherwise draw the same numbers, the later one
        // replaying numbers the earlier one's accepted drafts revealed.
        let params: Vec<std::borrow::Cow<'_, SamplingParams>> = idx
            .iter()
            .map(|&i| member_params(batch[i].params, m))
            .collect();
        let inputs: Vec<ProposeInput<'_>> = idx
            .iter()
            .zip(&pend)
            .zip(&params)
            .map(|((&i, p), params)| ProposeInput {
                seq: batch[i].seq,
                tokens: batch[i].tokens,
                max_draft: max_draft.unwrap_or(batch[i].max_draft),
                params,
                hidden: &p.layers,
                hidden_start: p.start,
            })
            .collect();
        let member = &mut self.members[m];
        let drafts = member
            .proposer
            .propose(&inputs)
            .map_err(|e| format!("member `{}`: {e}", member.name))?;
        if drafts.len() != inputs.len() {
            return Err(format!(
                "member `{}` returned {} drafts for {} sequences",
                member.name,
                drafts.len(),
                inputs.len()
            ));
        }
        // Each member's draft is cut to what it was asked for and its
        // shape checked against its own declaration before the composite
        // reads its tree or converts its q (the drafter validates the
        // composite's draft, q and all): a bad one names the member.
        drafts
            .into_iter()
            .zip(&inputs)
            .map(|(mut d, inp)| {
                d.cut_to(inp.max_draft);
                super::proposer::validate_shape(&d, &member.caps)
                    .map(|()| d)
                    .map_err(|why| format!("member `{}`: sequence {}: {why}", member.name, inp.seq))
            })
            .collect()
    }
}

impl Proposer for Compose {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        self.caps.clone()
    }

    /// `compose(a, b)`; process isolation, restarts and failures summed
    /// over the members; restarting while any member is.
    fn info(&self) -> super::proposer::ProposerInfo {
        let members: Vec<_> = self.members.iter().map(|m| m.proposer.info()).collect();
        let names: Vec<&str> = self.members.iter().map(|m| m.name.as_str()).collect();
        use super::proposer::{Isolation, ProposerState};
        let isolated = members.iter().any(|i| i.isolation == Isolation::Process);
        super::proposer::ProposerInfo {
            library_rebuilt: members.iter().any(|i| i.library_rebuilt),
            plugin: format!("compose({})", names.join(", ")),
            isolation: if isolated {
                Isolation::Process
            } else {
                Isolation::None
            },
            state: if members.iter().any(|i| i.state != ProposerState::Healthy) {
                ProposerState::Restarting
            } else {
                ProposerState::Healthy
            },
            restarts: members.iter().map(|i| i.restarts).sum(),
            crashes: members.iter().map(|i| i.crashes).sum(),
            timeouts: members.iter().map(|i| i.timeouts).sum(),
            last_failure: members.iter().find_map(|i| i.last_failure.clone()),
            ..Default::default()
        }
    }

    fn start(&mut self, seq: SeqId, prompt: &[u32]) -> Result<(), String> {
        self.seqs.remove(&seq);
        for m in &mut self.members {
            m.proposer
                .start(seq, prompt)
                .map_err(|e| format!("member `{}`: {e}", m.name))?;
        }
        Ok(())
    }

    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
        // Buffer every delivered hidden row for every member that wants it.
        for inp in batch {
            let rows = inp.hidden.first().map_or(0, |(_, v)| v.len()) / self.hidden.max(1);
            if rows == 0 {
                continue;
            }
            let idxs: Vec<Vec<usize>> = self.members.iter().map(|m| m.layer_idx.clone()).collect();
            let st = self.state(inp.seq);
            for (m, idx) in idxs.iter().enumerate() {
                if idx.is_empty() {
                    continue;
                }
                let p = &mut st.pending[m];
                if p.rows == 0 || p.start + p.rows != inp.hidden_start {
                    // Fresh (or non-contiguous: the host recomputed): restart.
                    *p = Pending {
                        start: inp.hidden_start,
                        rows: 0,
                        layers: idx
                            .iter()
                            .map(|&li| (inp.hidden[li].0, Vec::new()))
                            .collect(),
                    };
                }
                for (k, &li) in idx.iter().enumerate() {
                    p.layers.0[k].1.extend_from_slice(&inp.hidden[li].1);
                }
                p.rows += rows;
                // A member asked rarely holds a bounded buffer too (the
                // host's default cap).
                let max = super::hidden::MAX_HIDDEN_ROWS;
                p.layers.trim(&mut p.start, p.rows, max);
                p.rows = p.rows.min(max);
            }
        }
        let mut best: Vec<Option<(f64, usize, Draft)>> = (0..batch.len()).map(|_| None).collect();
        // Per input: the members that drafted this step, with their values.
        let mut asked: Vec<Vec<(usize, f64)>> = vec![Vec::new(); batch.len()];
        let mut open: Vec<usize> = (0..batch.len())
            .filter(|&i| batch[i].max_draft > 0)
            .collect();
        for m in 0..self.members.len() {
            if open.is_empty() {
                break;
            }
            let drafts = self.call(m, batch, &open, None)?;
            let mut still = Vec::new();
            for (&i, d) in open.iter().zip(drafts) {
                let track = self.state(batch[i].seq).tracks[m];
                // A drawn draft (q not one-hot) is valued before its draws:
                // keeping or dropping it by its own size (which may follow
                // its drawn tokens) would bias the tokens verified away
                // from the q they report.
                let v = if d.q.iter().all(|q| matches!(q, DraftQ::OneHot)) {
                    self.value_of(m, &track, &d)
                } else {
                    self.estimate(m, &track, batch[i].max_draft)
                };
                if !d.tokens.is_empty() {
                    asked[i].push((m, v));
                }
                if !d.tokens.is_empty() && best[i].as_ref().is_none_or(|b| v > b.0) {
                    best[i] = Some((v, m, d));
                }
                let have = best[i].as_ref().map_or(1.0, |b| b.0);
                let st = &self.seqs[&batch[i].seq];
                let better_later = (m + 1..self.members.len()).any(|n| {
                    let every = st.probe_every[n].max(1);
                    st.steps % every == every - 1
                        || self.estimate(n, &st.tracks[n], batch[i].max_draft) > have
                });
                if better_later {
                    still.push(i);
                }
            }
            open = still;
        }
        // Members with too many rows piled up take them in now.
        for m in 0..self.members.len() {
            let full: Vec<usize> = (0..batch.len())
                .filter(|&i| {
                    self.seqs
                        .get(&batch[i].seq)
                        .is_some_and(|s| s.pending[m].rows >= FLUSH_ROWS)
                })
                .collect();
            if !full.is_empty() {
                self.call(m, batch, &full, Some(0))?;
            }
        }
        let mut out = Vec::with_capacity(batch.len());
        for (i, b) in best.into_iter().enumerate() {
            let st = self.state(batch[i].seq);
            st.steps = st.steps.wrapping_add(1);
            let winner = b.as_ref().map(|b| b.1);
            for &(m, _) in &asked[i] {
                st.probe_every[m] = if Some(m) == winner {
                    PROBE_MIN
                } else {
                    (st.probe_every[m] * 2).min(PROBE_MAX)
                };
            }
            match b {
                Some((_, m, d)) => {
                    st.last = Some((m, d.depths().into_iter().max().unwrap_or(0)));
                    let mut d = self.convert(d);
                    d.source = Some(self.members[m].name.clone());
                    out.push(d);
                }
                None => {
                    st.last = None;
                    out.push(Draft::default());
                }
            }
        }
        Ok(out)
    }

    fn observe(&mut self, seq: SeqId, committed: &[u32], path: &[usize]) -> Result<(), String> {
        let last = self.seqs.get_mut(&seq).and_then(|s| s.last.take());
        if let Some((m, depth)) = last {
            let accepted = committed.len().saturating_sub(1).min(depth);
            if let Some(st) = self.seqs.get_mut(&seq) {
                st.tracks[m].record(depth, accepted);
            }
            self.members[m].prior.record(depth, accepted);
        }
        for (k, mem) in self.members.iter_mut().enumerate() {
            let p: &[usize] = if last.is_some_and(|(m, _)| m == k) {
                path
            } else {
                &[]
            };
            mem.proposer
                .observe(seq, committed, p)
                .map_err(|e| format!("member `{}`: {e}", mem.name))?;
        }
        Ok(())
    }

    fn finish(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
        for m in &mut self.members {
            m.proposer.finish(seq);
        }
    }
}

/// The sampling parameters member `m` of a composite sees: the request's,
/// with the seed of every member after the first moved to a stream of its
/// own (a greedy request's seed is never read).
fn member_params(p: &SamplingParams, m: usize) -> std::borrow::Cow<'_, SamplingParams> {
    if m == 0 || p.is_greedy() {
        return std::borrow::Cow::Borrowed(p);
    }
    let mut own = p.clone();
    own.seed = crate::sampler::Rng::new(p.seed ^ (m as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
        .next_u64();
    std::borrow::Cow::Owned(own)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplingParams;

    /// Drafts `len` copies of `token` when the last token is `when`
    /// (always if `None`); records the hidden rows it is given.
    struct Fake {
        name: &'static str,
        token: u32,
        len: usize,
        when: Option<u32>,
        layers: Vec<usize>,
        /// Drafting calls (max_draft > 0), shared with the test.
        asked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        /// (position, first value of the first layer) of every row seen.
        rows: std::sync::Arc<std::sync::Mutex<Vec<(usize, f32)>>>,
        /// The request seed of every drafting call.
        seeds: std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
    }

    impl Fake {
        fn new(
            name: &'static str,
            token: u32,
            len: usize,
            when: Option<u32>,
            layers: Vec<usize>,
        ) -> Self {
            Self {
                name,
                token,
                len,
                when,
                layers,
                asked: Default::default(),
                rows: Default::default(),
                seeds: Default::default(),
            }
        }
    }

    impl Proposer for Fake {
        fn name(&self) -> &str {
            self.name
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                hidden_layers: self.layers.clone(),
                max_draft: 4,
                ..Default::default()
            }
        }
        fn start(&mut self, _: SeqId, _: &[u32]) -> Result<(), String> {
            Ok(())
        }
        fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
            Ok(batch
                .iter()
                .map(|b| {
                    if let Some((_, v)) = b.hidden.first() {
                        for (r, chunk) in v.chunks(2).enumerate() {
                            self.rows
                                .lock()
                                .unwrap()
                                .push((b.hidden_start + r, chunk[0]));
                        }
                    }
                    if b.max_draft == 0 {
                        return Draft::default();
                    }
                    self.asked
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.seeds.lock().unwrap().push(b.params.seed);
                    if self.when.is_some_and(|w| b.tokens.last() != Some(&w)) {
                        return Draft::default();
                    }
                    let n = self.len.min(b.max_draft);
                    Draft {
                        tokens: vec![self.token; n],
                        q: vec![DraftQ::OneHot; n],
                        ..Default::default()
                    }
                })
                .collect())
        }
        fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
            Ok(())
        }
        fn finish(&mut self, _: SeqId) {}
    }

    fn input<'a>(
        seq: SeqId,
        tokens: &'a [u32],
        params: &'a SamplingParams,
        hidden: &'a [(usize, Vec<f32>)],
        start: usize,
    ) -> ProposeInput<'a> {
        ProposeInput {
            seq,
            tokens,
            max_draft: 4,
            params,
            hidden,
            hidden_start: start,
        }
    }

    /// A composite of two members (asked in this order) with their costs,
    /// over a 16-token vocabulary and hidden width 2.
    fn pair(a: (&str, Box<dyn Proposer>, f64), b: (&str, Box<dyn Proposer>, f64)) -> Compose {
        let spec = |(name, proposer, cost): (&str, Box<dyn Proposer>, f64)| MemberSpec {
            name: name.into(),
            proposer,
            cost,
        };
        Compose::new("hybrid", vec![spec(a), spec(b)], 16, 2, 0.1).unwrap()
    }

    #[test]
    fn picks_the_cheap_member_when_it_pays_and_labels_drafts() {
        let cheap = Fake::new("cheap", 7, 4, Some(1), vec![]);
        let dear = Fake::new("dear", 9, 3, None, vec![]);
        let mut c = pair(
            ("cheap", Box::new(cheap), 0.0),
            ("dear", Box::new(dear), 0.3),
        );
        let p = SamplingParams::default();
        // The cheap member matches (last token 1): its draft is taken, and
        // once its drafts are accepted the dear one is not even asked.
        for step in 0..6 {
            let d = c.propose(&[input(1, &[3, 1], &p, &[], 0)]).unwrap();
            assert_eq!(d[0].source.as_deref(), Some("cheap"), "step {step}");
            assert_eq!(d[0].tokens, vec![7; 4]);
            c.observe(1, &[7, 7, 7, 7, 2], &[0, 1, 2, 3]).unwrap();
        }
        // No match: the dear member drafts.
        let d = c.propose(&[input(1, &[3, 5], &p, &[], 0)]).unwrap();
        assert_eq!(d[0].source.as_deref(), Some("dear"));
        // A cheap member whose drafts always fail loses to a dear one whose
        // drafts are accepted, even when it matches.
        for _ in 0..6 {
            let d = c.propose(&[input(2, &[3, 1], &p, &[], 0)]).unwrap();
            if d[0].source.as_deref() == Some("dear") {
                c.observe(2, &[9, 9, 9, 4], &[0, 1, 2]).unwrap();
            } else {
                c.observe(2, &[4], &[]).unwrap();
            }
        }
        let d = c.propose(&[input(2, &[3, 1], &p, &[], 0)]).unwrap();
        assert_eq!(d[0].source.as_deref(), Some("dear"));
    }

    /// A member that keeps losing is probed ever more rarely: its drafts
    /// cost time even when they are thrown away.
    #[test]
    fn a_member_that_keeps_losing_is_probed_ever_more_rarely() {
        let cheap = Fake::new("cheap", 7, 4, None, vec![]);
        let dear = Fake::new("dear", 9, 4, None, vec![]);
        let asked = dear.asked.clone();
        let mut c = pair(
            ("cheap", Box::new(cheap), 0.0),
            ("dear", Box::new(dear), 5.0),
        );
        let p = SamplingParams::default();
        let steps = 400;
        for _ in 0..steps {
            let d = c.propose(&[input(1, &[1, 2], &p, &[], 0)]).unwrap();
            assert_eq!(d[0].source.as_deref(), Some("cheap"));
            c.observe(1, &[7, 7, 3], &[0, 1]).unwrap();
        }
        // A fixed probe every 8th step would ask it 50 times.
        let n = asked.load(std::sync::atomic::Ordering::Relaxed);
        assert!((3..=12).contains(&n), "probed {n} times in {steps} steps");
    }

    #[test]
    fn every_member_gets_every_hidden_row_once_in_order() {
        let cheap = Fake::new("cheap", 7, 4, None, vec![]);
        let feat = Fake::new("feat", 9, 2, None, vec![3]);
        let seen = feat.rows.clone();
        let mut c = pair(
            ("cheap", Box::new(cheap), 0.0),
            ("feat", Box::new(feat), 5.0),
        );
        assert_eq!(c.capabilities().hidden_layers, vec![3]);
        let p = SamplingParams::default();
        let mut pos = 0usize;
        // The cheap member always wins (the other costs too much), so the
        // feature member is called for rare probes and to flush its
        // piled-up rows.
        for step in 0..150 {
            let n = 1 + step % 3;
            let hidden = vec![(
                3usize,
                (pos..pos + n)
                    .flat_map(|r| [r as f32, 0.0])
                    .collect::<Vec<f32>>(),
            )];
            let d = c.propose(&[input(1, &[1, 2], &p, &hidden, pos)]).unwrap();
            assert_eq!(d[0].source.as_deref(), Some("cheap"));
            c.observe(1, &[7, 7], &[0]).unwrap();
            pos += n;
            // Rows pile up for the member, but never past the flush size.
            let pending = pos - seen.lock().unwrap().len();
            assert!(pending < FLUSH_ROWS, "step {step}: {pending} rows pending");
        }
        // The rest comes with the member's next call.
        c.call(1, &[input(1, &[1, 2], &p, &[], pos)], &[0], Some(0))
            .unwrap();
        let rows = seen.lock().unwrap().clone();
        let want: Vec<(usize, f32)> = (0..pos).map(|r| (r, r as f32)).collect();
        assert_eq!(rows, want, "every row once, in order, at its position");
    }

    /// A drawn draft is kept or passed over on what was known before its
    /// draws, never on its drawn tokens: a member whose draft is 4 tokens
    /// long after drawing 7 and 1 token long after drawing 9 (q = 1/2
    /// each) must reach verification with 7 and 9 in equal shares. Valued
    /// by its length, the 1-token drafts lost to the other member and
    /// only 7s were verified, against the q they reported.
    #[test]
    fn a_drawn_draft_is_chosen_before_its_draws_are_seen() {
        struct Drawn(crate::sampler::Rng);
        impl Proposer for Drawn {
            fn name(&self) -> &str {
                "drawn"
            }
            fn capabilities(&self) -> Capabilities {
                Capabilities {
                    max_draft: 4,
                    q_kind: QKind::Sparse,
                    ..Default::default()
                }
            }
            fn start(&mut self, _: SeqId, _: &[u32]) -> Result<(), String> {
                Ok(())
            }
            fn propose(&mut self, b: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
                let q = Distribution {
                    ids: vec![7, 9],
                    probs: vec![0.5, 0.5],
                };
                Ok(b.iter()
                    .map(|_| {
                        let x = q.sample(&mut self.0);
                        let tokens = if x == 7 { vec![7, 7, 7, 7] } else { vec![9] };
                        Draft {
                            q: vec![DraftQ::Sparse(q.clone()); tokens.len()],
                            tokens,
                            ..Default::default()
                        }
                    })
                    .collect())
            }
            fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
                Ok(())
            }
            fn finish(&mut self, _: SeqId) {}
        }
        // At the prior acceptance (0.5) and verify cost 0.1 a 4-token
        // chain is worth 1.384, a 1-token one 1.364; the one-hot member's
        // 4 tokens at cost 0.01 are worth 1.374, between them.
        let fixed = Fake::new("fixed", 3, 4, None, vec![]);
        let mut c = pair(
            ("drawn", Box::new(Drawn(crate::sampler::Rng::new(5))), 0.0),
            ("fixed", Box::new(fixed), 0.01),
        );
        let p = SamplingParams::default();
        let (mut drawn, mut sevens) = (0usize, 0usize);
        let steps = 400;
        for seq in 0..steps {
            let d = c.propose(&[input(seq, &[1, 2], &p, &[], 0)]).unwrap();
            if d[0].source.as_deref() == Some("drawn") {
                drawn += 1;
                sevens += usize::from(d[0].tokens[0] == 7);
            }
            c.finish(seq);
        }
        assert!(
            drawn as u64 > steps * 9 / 10,
            "drawn member chosen {drawn} times"
        );
        let share = sevens as f64 / drawn as f64;
        assert!(
            (0.4..0.6).contains(&share),
            "7 in {share:.2} of the verified drawn drafts; q gives it 0.5"
        );
    }

    #[test]
    fn one_hot_drafts_take_the_composite_q_kind() {
        struct Sparse;
        impl Proposer for Sparse {
            fn name(&self) -> &str {
                "sparse"
            }
            fn capabilities(&self) -> Capabilities {
                Capabilities {
                    q_kind: QKind::Sparse,
                    ..Default::default()
                }
            }
            fn start(&mut self, _: SeqId, _: &[u32]) -> Result<(), String> {
                Ok(())
            }
            fn propose(&mut self, b: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
                Ok(b.iter().map(|_| Draft::default()).collect())
            }
            fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
                Ok(())
            }
            fn finish(&mut self, _: SeqId) {}
        }
        let mut c = pair(
            ("one", Box::new(Fake::new("one", 5, 2, None, vec![])), 0.0),
            ("sparse", Box::new(Sparse), 0.0),
        );
        assert_eq!(c.capabilities().q_kind, QKind::Sparse);
        let p = SamplingParams {
            temperature: 0.8,
            ..Default::default()
        };
        let d = c.propose(&[input(1, &[1, 2], &p, &[], 0)]).unwrap();
        assert_eq!(d[0].tokens, vec![5, 5]);
        assert!(d[0]
            .q
            .iter()
            .all(|q| *q == DraftQ::Sparse(Distribution::one_hot(5))));
        let caps = c.capabilities();
        assert!(super::super::proposer::validate_draft(&d[0], &caps, Some(16), false).is_ok());
    }

    #[test]
    fn sparse_member_drafts_become_full_in_a_full_composite_keeping_siblings_shared() {
        let mut c = pair(
            ("a", Box::new(Fake::new("a", 7, 4, None, vec![])), 0.0),
            ("b", Box::new(Fake::new("b", 9, 3, None, vec![])), 0.0),
        );
        // As if one member declared full q (a draft model) and another
        // sparse (Medusa heads): the composite declares full.
        c.caps.q_kind = QKind::Full;
        c.caps.tree = true;
        let at_root = Distribution {
            ids: vec![3, 5],
            probs: vec![0.75, 0.25],
        };
        let below = Distribution {
            ids: vec![1],
            probs: vec![1.0],
        };
        let d = Draft {
            tokens: vec![3, 5, 1],
            q: vec![
                DraftQ::Sparse(at_root.clone()),
                DraftQ::Sparse(at_root),
                DraftQ::Sparse(below),
            ],
            parents: Some(vec![-1, -1, 0]),
            source: None,
        };
        let d = c.convert(d);
        match (&d.q[0], &d.q[1], &d.q[2]) {
            (DraftQ::Full(a), DraftQ::Full(b), DraftQ::Full(x)) => {
                assert!(std::sync::Arc::ptr_eq(a, b), "siblings share one q");
                assert_eq!((a[3], a[5], a.len()), (0.75, 0.25, 16));
                assert_eq!(x[1], 1.0);
            }
            q => panic!("not converted: {q:?}"),
        }
        for greedy in [true, false] {
            crate::speculative::proposer::validate_draft(&d, &c.caps, Some(16), greedy).unwrap();
        }
    }

    #[test]
    fn one_hot_tree_siblings_lifted_to_sparse_pass_validation_under_sampling() {
        // A lookup member's tree (one-hot siblings) in a composite that
        // declares sparse q: each sibling becomes its own point mass,
        // which acceptance tries in turn exactly. Validation must let the
        // draft through (it once poisoned the composite on its first
        // sampled tree), and still refuse siblings whose real q differ.
        let mut c = pair(
            ("a", Box::new(Fake::new("a", 7, 4, None, vec![])), 0.0),
            ("b", Box::new(Fake::new("b", 9, 3, None, vec![])), 0.0),
        );
        c.caps.q_kind = QKind::Sparse;
        c.caps.tree = true;
        let d = c.convert(Draft {
            tokens: vec![3, 5, 1],
            q: vec![DraftQ::OneHot; 3],
            parents: Some(vec![-1, -1, 0]),
            source: None,
        });
        assert_ne!(d.q[0], d.q[1]);
        let check =
            |d: &Draft| crate::speculative::proposer::validate_draft(d, &c.caps, Some(16), false);
        check(&d).unwrap();
        let spread = |a: u32, b: u32| {
            DraftQ::Sparse(Distribution {
                ids: vec![a, b],
                probs: vec![0.5, 0.5],
            })
        };
        let unlike = Draft {
            tokens: vec![3, 5],
            q: vec![spread(3, 4), spread(5, 6)],
            parents: Some(vec![-1, -1]),
            source: None,
        };
        let e = check(&unlike).unwrap_err();
        assert!(e.contains("same q"), "{e}");
    }

    #[test]
    fn members_draw_from_streams_of_their_own() {
        // Plugins seed their generators from the request's seed alike
        // (eagle's and medusa's formulas are the same): a composite hands
        // every member after the first a seed of its own, under sampling.
        let (a, b) = (
            Fake::new("a", 7, 2, Some(99), vec![]),
            Fake::new("b", 9, 2, None, vec![]),
        );
        let (sa, sb) = (a.seeds.clone(), b.seeds.clone());
        let mut c = pair(("a", Box::new(a), 0.0), ("b", Box::new(b), 0.0));
        let p = SamplingParams {
            temperature: 0.8,
            seed: 1234,
            ..Default::default()
        };
        for _ in 0..3 {
            c.propose(&[input(1, &[3, 1], &p, &[], 0)]).unwrap();
        }
        let (sa, sb) = (sa.lock().unwrap().clone(), sb.lock().unwrap().clone());
        assert!(!sa.is_empty() && !sb.is_empty(), "{sa:?} {sb:?}");
        assert!(sa.iter().all(|&s| s == 1234), "{sa:?}");
        assert!(sb.iter().all(|&s| s != 1234), "{sb:?}");
    }

    #[test]
    fn a_members_malformed_tree_is_refused_naming_it_not_a_panic() {
        struct Bad;
        impl Proposer for Bad {
            fn name(&self) -> &str {
                "bad"
            }
            fn capabilities(&self) -> Capabilities {
                Capabilities {
                    max_draft: 4,
                    tree: true,
                    ..Default::default()
                }
            }
            fn start(&mut self, _: SeqId, _: &[u32]) -> Result<(), String> {
                Ok(())
            }
            fn propose(&mut self, b: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
                // A parent past the draft: reading its depths would index
                // out of bounds.
                Ok(b.iter()
                    .map(|_| Draft {
                        tokens: vec![1, 2],
                        q: vec![DraftQ::OneHot; 2],
                        parents: Some(vec![-1, 7]),
                        source: None,
                    })
                    .collect())
            }
            fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
                Ok(())
            }
            fn finish(&mut self, _: SeqId) {}
        }
        let mut c = pair(
            ("bad", Box::new(Bad), 0.0),
            ("b", Box::new(Fake::new("b", 9, 3, None, vec![])), 0.0),
        );
        let p = SamplingParams::default();
        let e = c.propose(&[input(1, &[3, 1], &p, &[], 0)]).unwrap_err();
        assert!(
            e.contains("member `bad`") && e.contains("sequence 1"),
            "{e}"
        );
    }
}
