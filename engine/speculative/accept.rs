//! Acceptance of drafted tokens against the target's logits.
//!
//! Greedy: accept while the draft equals argmax(p); at the first mismatch
//! emit argmax(p); if every draft is accepted emit the bonus argmax.
//!
//! Sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft x with
//! probability min(1, p(x) / q(x)); on rejection sample from
//! norm(max(p - q, 0)); if every draft is accepted sample the bonus from p.
//! p is `sampler::distribution` of the penalised logits, the same transforms
//! every request uses, so the output distribution is exactly p's.
//!
//! Invariant: the only randomness is the request's own `Rng`, advanced
//! once per emitted token (sampled requests): each position draws from a
//! stream seeded by that draw, so a seeded request reproduces. One-hot
//! drafts (lookup proposers, forced tokens) are verified by coupling: the
//! position's token is p's inverse CDF at the position's first uniform,
//! exactly the token plain decoding (`plain::generate`) draws, so a seeded
//! sampled request's output does not depend on what was drafted.

use std::collections::HashMap;

use super::proposer::{Draft, DraftQ, SiblingMode};
use super::SeqId;
use crate::error::{Result, SpecdError};
use crate::sampler::{self, Distribution, Rng, SamplingParams};
use crate::structured::{Constraint, Guide};

/// How acceptance runs. Only `Exact` is lossless; the other variants are
/// deliberate bugs that exist so the statistical tests can show they detect
/// each one (a test that cannot fail proves nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Acceptance {
    #[default]
    Exact,
    /// Lossy: a rejection resamples from p instead of norm(max(p - q, 0)).
    ResidualFromP,
    /// Lossy: penalties at later draft positions ignore the drafts accepted
    /// earlier in the same step.
    StalePenalties,
    /// Lossy: p is the temperature softmax without top-k, top-p or min-p.
    UnfilteredTarget,
    /// Lossy: p ignores the request's logit bias.
    UnbiasedTarget,
    /// Lossy: after a rejected sibling drawn without replacement, q is not
    /// renormalised without it.
    StaleSiblingQ,
    /// Lossy: under a constraint, a draft is accepted against p with the
    /// disallowed tokens removed but not renormalised.
    UnnormalisedMask,
    /// Lossy: `min_tokens`'s count is not advanced by the drafts accepted
    /// earlier in the same step (every row of a step is held back as its
    /// first row is).
    StaleEndBan,
}

/// `min_tokens` at one acceptance: `ids` (end of sequence, stop token
/// ids) get probability 0 at the next `rows` generated positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndBan {
    pub rows: usize,
    pub ids: Vec<u32>,
}

/// The result of verifying one sequence's draft.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Accepted {
    /// Number of draft tokens accepted.
    pub accepted: usize,
    /// Accepted drafts followed by the correction or bonus token.
    pub tokens: Vec<u32>,
    /// One per token when the request asked for logprobs, else empty.
    pub logprobs: Vec<super::TokenLogprob>,
    /// Constrained requests: the tokens the constraint forces next (the
    /// next step's free drafts), when the request drafts them.
    pub forced: Vec<u32>,
    /// Constrained requests: the constraint has ended (end of sequence
    /// consumed); the sequence finishes.
    pub done: bool,
}

/// Acceptance mass below this is treated as zero (p and q agree); the
/// correction then comes from p itself.
const RESIDUAL_EPS: f64 = 1e-9;

/// Penalised target distribution at one verified position.
fn target(
    row: &[f32],
    context: &[u32],
    generated: &[u32],
    params: &SamplingParams,
) -> Distribution {
    if params.has_penalties() {
        let mut l = row.to_vec();
        sampler::apply_penalties(&mut l, context, generated, params);
        sampler::distribution(&l, params)
    } else {
        sampler::distribution(row, params)
    }
}

/// The residual target of recursive rejection sampling: p over its support,
/// lowered by each rejected candidate's q and renormalised.
///
/// Kept unnormalised (`mass` is the total) and copied from p only when a
/// rejection first changes it, so plain decoding samples straight from p;
/// a rejection touches only the entries of q's support (a one-hot q: one
/// entry), found through a token -> position index built on the first
/// lookup that misses the most probable entries.
#[derive(Debug, Clone)]
struct Residual<'a> {
    p: &'a Distribution,
    /// Unnormalised weights in `p.ids` order once a rejection changed them.
    w: Option<Vec<f64>>,
    mass: f64,
    /// Token -> position in `p.ids` (`u32::MAX`: outside the support).
    pos: Option<Vec<u32>>,
    vocab: usize,
}

/// Entries of p scanned before a lookup builds the position index.
const RESIDUAL_SCAN: usize = 32;

impl<'a> Residual<'a> {
    fn new(p: &'a Distribution, vocab: usize) -> Self {
        Self {
            p,
            w: None,
            mass: 1.0,
            pos: None,
            vocab,
        }
    }

    fn index(&mut self, id: u32) -> Option<usize> {
        let ids = &self.p.ids;
        if let Some(k) = ids.iter().take(RESIDUAL_SCAN).position(|&i| i == id) {
            return Some(k);
        }
        if ids.len() <= RESIDUAL_SCAN {
            return None;
        }
        let vocab = self.vocab;
        let pos = self.pos.get_or_insert_with(|| {
            let mut v = vec![u32::MAX; vocab];
            for (k, &i) in ids.iter().enumerate() {
                if let Some(slot) = v.get_mut(i as usize) {
                    *slot = k as u32;
                }
            }
            v
        });
        pos.get(id as usize)
            .filter(|&&k| k != u32::MAX)
            .map(|&k| k as usize)
    }

    fn weight(&self, k: usize) -> f64 {
        match &self.w {
            Some(w) => w[k],
            None => f64::from(self.p.probs[k]),
        }
    }

    fn prob(&mut self, id: u32) -> f64 {
        self.index(id).map_or(0.0, |k| self.weight(k) / self.mass)
    }

    /// `self <- norm(max(self - q, 0))`, q given by its support (a token
    /// may not repeat; drafts are validated for that). Zero mass left
    /// means p and q agree (a rejection then had probability 0): the
    /// residual stays as it was.
    fn subtract(&mut self, q: &[(u32, f64)]) {
        let mut changes: Vec<(usize, f64)> = Vec::new();
        let mut removed = 0f64;
        for &(id, qv) in q {
            if qv <= 0.0 {
                continue;
            }
            if let Some(k) = self.index(id) {
                let old = self.weight(k);
                let new = (old - qv * self.mass).max(0.0);
                if new < old {
                    removed += old - new;
                    changes.push((k, new));
                }
            }
        }
        let left = self.mass - removed;
        if changes.is_empty() || left < RESIDUAL_EPS * self.mass {
            return;
        }
        let p = self.p;
        let w = self
            .w
            .get_or_insert_with(|| p.probs.iter().map(|&x| f64::from(x)).collect());
        for (k, v) in changes {
            w[k] = v;
        }
        self.mass = left;
    }

    fn sample(&self, rng: &mut Rng) -> u32 {
        self.sample_at(rng.next_f64())
    }

    /// The token at `u` in [0, 1) of the residual's inverse CDF (entries in
    /// `p.ids` order): with no rejection applied, the one `p` draws at `u`.
    fn sample_at(&self, u: f64) -> u32 {
        let n = self.p.ids.len();
        let u = u * self.mass;
        let mut cum = 0.0;
        // p itself (plain decoding, or no rejection changed it) or the
        // lowered weights: one loop each, no per-entry branch.
        let hit = match &self.w {
            None => self.p.probs.iter().position(|&x| {
                cum += f64::from(x);
                u < cum
            }),
            Some(w) => w.iter().position(|&x| {
                cum += x;
                u < cum
            }),
        };
        if let Some(k) = hit {
            return self.p.ids[k];
        }
        // Rounding at the top end: the last token with mass.
        (0..n)
            .rev()
            .find(|&k| self.weight(k) > 0.0)
            .map_or(self.p.ids[0], |k| self.p.ids[k])
    }
}

/// Whether `q` puts all its mass on `t` (one-hot, or a sparse or full q
/// with 1 at `t` and nothing elsewhere): a deterministic candidate.
pub(super) fn point_mass(q: &DraftQ, t: u32) -> bool {
    match q {
        DraftQ::OneHot => true,
        DraftQ::Sparse(d) => d.prob(t) == 1.0 && d.probs.iter().filter(|&&p| p != 0.0).count() == 1,
        DraftQ::Full(f) => {
            f.get(t as usize) == Some(&1.0)
                && f.iter()
                    .enumerate()
                    .all(|(i, &p)| p == 0.0 || i == t as usize)
        }
    }
}

/// The total mass q reports (1 up to the plugin's rounding).
fn q_total(q: &DraftQ) -> f64 {
    match q {
        DraftQ::OneHot => 1.0,
        DraftQ::Sparse(d) => d
            .probs
            .iter()
            .filter(|&&p| p > 0.0)
            .map(|&p| f64::from(p))
            .sum(),
        DraftQ::Full(v) => v.iter().filter(|&&p| p > 0.0).map(|&p| f64::from(p)).sum(),
    }
}

/// The support of q given that `drafted` was drawn from it, scaled by
/// `scale`, without the tokens in `removed`.
fn q_support(q: &DraftQ, drafted: u32, removed: &[u32], scale: f64) -> Vec<(u32, f64)> {
    let keep = |id: u32| !removed.contains(&id);
    match q {
        DraftQ::OneHot => {
            if keep(drafted) {
                vec![(drafted, scale)]
            } else {
                Vec::new()
            }
        }
        DraftQ::Sparse(d) => d
            .ids
            .iter()
            .zip(&d.probs)
            .filter(|(&id, &p)| p > 0.0 && keep(id))
            .map(|(&id, &p)| (id, f64::from(p) * scale))
            .collect(),
        DraftQ::Full(v) => v
            .iter()
            .enumerate()
            .filter(|(id, &p)| p > 0.0 && keep(*id as u32))
            .map(|(id, &p)| (id as u32, f64::from(p) * scale))
            .collect(),
    }
}

/// One rejection of a chain draft `drafted` with q: a sample from
/// norm(max(p - q, 0)) (or from p when no mass is left).
#[cfg(test)]
fn sample_residual(p: &Distribution, q: &DraftQ, drafted: u32, rng: &mut Rng) -> u32 {
    let vocab = p.ids.iter().max().map_or(0, |&m| m as usize + 1);
    let mut r = Residual::new(p, vocab);
    r.subtract(&q_support(q, drafted, &[], 1.0));
    r.sample(rng)
}

/// Verify a chain `draft` against `rows` (`(draft.len() + 1) x vocab`
/// logits for the inputs `[last, d1 .. dk]`). `context` is every committed
/// token (prompt and output), `generated` the committed output alone.
#[allow(clippy::too_many_arguments)]
pub fn accept(
    rows: &[f32],
    vocab: usize,
    draft: &Draft,
    context: &[u32],
    generated: &[u32],
    params: &SamplingParams,
    rng: &mut Rng,
    acceptance: Acceptance,
) -> Result<Accepted> {
    let (a, _) = accept_tree(
        rows,
        vocab,
        draft,
        SiblingMode::WithoutReplacement,
        context,
        generated,
        params,
        rng,
        acceptance,
        None,
        None,
    )?;
    Ok(a)
}

/// Verify a draft, chain or tree, against `rows` (one row of logits for the
/// root, the last committed token, then one per node). Returns the accepted
/// tokens (the path's drafts, then the correction or bonus token) and the
/// path's node indices.
///
/// Greedy: from the root, follow the child equal to the target's argmax.
///
/// Sampling: multi-candidate recursive rejection sampling (SpecInfer, Miao
/// et al. 2024, Theorem 4.2, for siblings drawn i.i.d.; Sequoia, Chen et al.
/// 2024, Algorithm 2, for siblings drawn without replacement). At a node
/// with target distribution p and children x_1..x_m drawn from q: accept
/// x_i with probability min(1, p_i(x_i) / q_i(x_i)); after a rejection set
/// p_{i+1} = norm(max(p_i - q_i, 0)) and, without replacement,
/// q_{i+1} = norm(q_i with x_i removed); if every child is rejected (or
/// the node is a leaf) sample from the residual. By induction on the
/// children, the token emitted at each node is distributed exactly as p.
/// One-hot children (lookup proposers' chains and trees) are deterministic
/// candidates, verified by coupling instead: the node emits p's inverse CDF
/// at the position's first uniform (plain decoding's draw) and accepts the
/// child equal to it, so any child can be accepted, each with p(x), and
/// the emitted token does not depend on the draft.
#[allow(clippy::too_many_arguments)]
pub fn accept_tree(
    rows: &[f32],
    vocab: usize,
    draft: &Draft,
    siblings: SiblingMode,
    context: &[u32],
    generated: &[u32],
    params: &SamplingParams,
    rng: &mut Rng,
    acceptance: Acceptance,
    guide: Option<&mut Guide>,
    ban: Option<&EndBan>,
) -> Result<(Accepted, Vec<usize>)> {
    let n = draft.tokens.len();
    let parents_ok = draft.parents.as_ref().is_none_or(|p| {
        p.len() == n && p.iter().enumerate().all(|(i, &x)| x >= -1 && x < i as i32)
    });
    if vocab == 0 || rows.len() != (n + 1) * vocab || draft.q.len() != n || !parents_ok {
        return Err(SpecdError::InvalidRequest(format!(
            "acceptance: {} logits for {n} drafts ({} q) over a vocabulary of {vocab}",
            rows.len(),
            draft.q.len()
        )));
    }
    // children[r]: the nodes whose parent is row r (row 0: the root).
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); n + 1];
    for i in 0..n {
        children[draft.parent(i).map_or(0, |p| p + 1)].push(i);
    }
    let greedy = params.is_greedy();
    let target_params = match acceptance {
        Acceptance::UnfilteredTarget => SamplingParams {
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..params.clone()
        },
        Acceptance::UnbiasedTarget => SamplingParams {
            logit_bias: Vec::new(),
            ..params.clone()
        },
        _ => params.clone(),
    };
    let penalised = target_params.has_penalties();
    // Penalties see the accepted drafts as context; without penalties the
    // history is never read, so it is not copied.
    let (mut ctx, mut gen) = if penalised {
        (context.to_vec(), generated.to_vec())
    } else {
        (Vec::new(), Vec::new())
    };
    let mut tokens = Vec::new();
    let mut path = Vec::new();
    let mut r = 0usize;
    let mut guide = guide;
    // A constrained row: disallowed tokens at -inf (reused buffer).
    let mut masked: Vec<f32> = Vec::new();
    // A row `min_tokens` holds back: its end tokens at -inf.
    let mut banned: Vec<f32> = Vec::new();
    loop {
        let raw = &rows[r * vocab..(r + 1) * vocab];
        // This row's generated position, counted from the first row.
        let at = if acceptance == Acceptance::StaleEndBan {
            0
        } else {
            path.len()
        };
        let raw = match ban {
            Some(b) if at < b.rows => {
                banned.clear();
                banned.extend_from_slice(raw);
                sampler::suppress(&mut banned, &b.ids);
                &banned[..]
            }
            _ => raw,
        };
        let kids = &children[r];
        let done = |tokens: Vec<u32>, path: Vec<usize>| {
            Ok((
                Accepted {
                    accepted: path.len(),
                    tokens,
                    ..Accepted::default()
                },
                path,
            ))
        };
        let chosen = if greedy {
            let pick = |row: &[f32]| {
                if penalised {
                    target(row, &ctx, &gen, &target_params).ids[0]
                } else {
                    sampler::argmax(row)
                }
            };
            let mut best = pick(raw);
            // Masking only lowers other logits: an allowed unmasked choice
            // is the masked one (one lexer step instead of a mask).
            if let Some(g) = guide.as_deref_mut() {
                if !g.allows(best) {
                    masked.clear();
                    masked.extend_from_slice(raw);
                    g.mask_row(&mut masked)?;
                    best = pick(&masked);
                }
            }
            match kids.iter().find(|&&c| draft.tokens[c] == best) {
                Some(&c) => c,
                None => {
                    if let Some(g) = guide.as_deref_mut() {
                        g.advance(best)?;
                    }
                    tokens.push(best);
                    return done(tokens, path);
                }
            }
        } else {
            // This position's own stream, seeded by one draw of the
            // request's: the request's stream advances once per emitted
            // token, so position g always draws from the g-th seed,
            // whatever the steps' draft lengths were.
            let mut at_rng = Rng::new(rng.next_u64());
            let row = match guide.as_deref_mut() {
                Some(g) => {
                    masked.clear();
                    masked.extend_from_slice(raw);
                    g.mask_row(&mut masked)?;
                    &masked[..]
                }
                None => raw,
            };
            let p = target(row, &ctx, &gen, &target_params);
            let mut res = Residual::new(&p, vocab);
            // The lossy control: the acceptance test reads the unmasked
            // law, its disallowed mass dropped without renormalising.
            let unnormalised = (acceptance == Acceptance::UnnormalisedMask).then(|| {
                let full = target(raw, &ctx, &gen, &target_params);
                let allowed: Vec<bool> = row.iter().map(|l| l.is_finite()).collect();
                move |x: u32| {
                    if allowed[x as usize] {
                        f64::from(full.prob(x))
                    } else {
                        0.0
                    }
                }
            });
            let mut next = None;
            // The token this position emits when no rejection decided it
            // (`None`: sampled from the residual below).
            let mut emit = None;
            // One-hot siblings are deterministic candidates: each carries q
            // = 1 on its own token. The position's token is p's inverse CDF
            // at one uniform u, the token plain decoding draws at u; a child
            // equal to it is accepted, else that token is the correction.
            // Each child is emitted with probability p(x), every other
            // token with p's own: exactly p, and (one u per position) the
            // same token plain decoding with this seed emits, however long
            // or wide the draft was.
            // (A composite lifts its lookup members' one-hot q to its own
            // kind, one point mass per sibling: still deterministic.)
            let one_hot = !kids.is_empty()
                && kids
                    .iter()
                    .all(|&c| point_mass(&draft.q[c], draft.tokens[c]));
            if one_hot {
                let u = at_rng.next_f64();
                match &unnormalised {
                    None => {
                        let x = res.sample_at(u);
                        next = kids.iter().copied().find(|&c| draft.tokens[c] == x);
                        // The lossy control: a miss redraws from p, which
                        // can give a child's token again.
                        emit = if acceptance == Acceptance::ResidualFromP {
                            None
                        } else {
                            Some(x)
                        };
                    }
                    // The lossy control: the children take intervals of u
                    // as wide as the first one's unmasked mass (dropped
                    // without renormalising) and the later ones' p; a miss
                    // samples p without them.
                    Some(f) => {
                        let mut tried: Vec<u32> = Vec::new();
                        let mut cum = 0.0;
                        for &c in kids {
                            let x = draft.tokens[c];
                            if tried.contains(&x) {
                                continue;
                            }
                            cum += if tried.is_empty() {
                                f(x)
                            } else {
                                res.p.prob(x) as f64
                            };
                            if u < cum {
                                next = Some(c);
                                break;
                            }
                            tried.push(x);
                        }
                        if next.is_none() {
                            for &x in &tried {
                                res.subtract(&[(x, 1.0)]);
                            }
                        }
                    }
                }
            } else if let Some(&first) = kids.first() {
                let (qb, qt) = (&draft.q[first], draft.tokens[first]);
                // q as drawn from: its own total, not 1 (validation lets a
                // plugin's sum be off by 1e-3; a without-replacement draw
                // of a sibling is from the mass left, `total - removed`).
                let total = q_total(qb);
                // Without replacement: tokens already drawn, and their mass.
                let mut removed: Vec<u32> = Vec::new();
                let mut removed_mass = 0f64;
                for &c in kids {
                    let x = draft.tokens[c];
                    let scale = 1.0 / (total - removed_mass).max(f64::MIN_POSITIVE);
                    let qx = if removed.contains(&x) {
                        0.0
                    } else {
                        qb.prob(qt, x) as f64 * scale
                    };
                    let px = match (&unnormalised, removed.is_empty()) {
                        (Some(f), true) => f(x),
                        _ => res.prob(x),
                    };
                    if qx > 0.0 && at_rng.next_f64() < (px / qx).min(1.0) {
                        next = Some(c);
                        break;
                    }
                    if acceptance != Acceptance::ResidualFromP {
                        res.subtract(&q_support(qb, qt, &removed, scale));
                    }
                    if siblings == SiblingMode::WithoutReplacement
                        && acceptance != Acceptance::StaleSiblingQ
                    {
                        removed.push(x);
                        removed_mass += qb.prob(qt, x) as f64;
                    }
                }
            }
            match next {
                Some(c) => c,
                None => {
                    let x = emit.unwrap_or_else(|| res.sample(&mut at_rng));
                    if let Some(g) = guide.as_deref_mut() {
                        g.advance(x)?;
                    }
                    tokens.push(x);
                    return done(tokens, path);
                }
            }
        };
        let x = draft.tokens[chosen];
        if let Some(g) = guide.as_deref_mut() {
            g.advance(x)?;
        }
        tokens.push(x);
        path.push(chosen);
        // A constraint this token completes ends the sequence here, as in
        // plain decoding: no correction or bonus (only end of sequence
        // could follow, and `ignore_eos` would keep it).
        if guide.as_deref().is_some_and(|g| g.done()) {
            return done(tokens, path);
        }
        if penalised && acceptance != Acceptance::StalePenalties {
            ctx.push(x);
            gen.push(x);
        }
        r = chosen + 1;
    }
}

/// One sequence's acceptance input.
#[derive(Debug, Clone)]
pub struct AcceptItem {
    pub seq: SeqId,
    /// `(draft.len() + 1) x vocab` logits.
    pub rows: Vec<f32>,
    pub draft: Draft,
    /// How the draft's siblings were drawn (trees).
    pub siblings: SiblingMode,
    pub params: SamplingParams,
    /// Committed tokens (prompt and output) for penalties.
    pub context: Vec<u32>,
    pub prompt_len: usize,
    /// Alternatives per token when the request asked for logprobs.
    pub logprobs: Option<usize>,
    /// The request's constraint (its guide starts at the first accept and
    /// lives until the sequence ends).
    pub constraint: Option<Constraint>,
    /// Report the constraint's forced tokens for the next step's draft.
    pub forced_drafts: bool,
    /// `min_tokens`: the end tokens held back at the next rows.
    pub ban: Option<EndBan>,
}

/// The sample stage's struct: turns logits into accepted tokens with the
/// rules above; owns each request's RNG.
#[derive(Debug)]
pub struct Acceptor {
    vocab: usize,
    rngs: HashMap<SeqId, Rng>,
    guides: HashMap<SeqId, Guide>,
    pub acceptance: Acceptance,
}

impl Acceptor {
    pub fn new(vocab: usize) -> Self {
        Self {
            vocab,
            rngs: HashMap::new(),
            guides: HashMap::new(),
            acceptance: Acceptance::Exact,
        }
    }

    /// Whether a sampled constrained sequence waits for its next mask.
    pub fn wants_prefetch(&self) -> bool {
        self.guides.values().any(|g| g.sampled && !g.done())
    }

    /// Compute each sampled constrained sequence's next mask now (the
    /// actor runs this while the next step's forward runs), so its next
    /// acceptance finds the root row's mask ready. Greedy sequences check
    /// their argmax instead and need none.
    pub fn prefetch(&mut self) {
        for g in self.guides.values_mut() {
            if g.sampled && !g.done() {
                g.prefetch();
            }
        }
    }

    pub fn end(&mut self, ids: &[SeqId]) {
        for id in ids {
            self.rngs.remove(id);
            self.guides.remove(id);
        }
    }

    /// Accept one item's drafts with its request's RNG: the accepted tokens
    /// and the path's node indices.
    pub fn accept_one(&mut self, it: &AcceptItem) -> Result<(Accepted, Vec<usize>)> {
        let rng = self
            .rngs
            .entry(it.seq)
            .or_insert_with(|| Rng::new(it.params.seed));
        let mut guide = match &it.constraint {
            Some(c) => Some(self.guides.entry(it.seq).or_insert_with(|| c.start())),
            None => None,
        };
        let (mut a, path) = accept_tree(
            &it.rows,
            self.vocab,
            &it.draft,
            it.siblings,
            &it.context,
            &it.context[it.prompt_len.min(it.context.len())..],
            &it.params,
            rng,
            self.acceptance,
            guide.as_deref_mut(),
            it.ban.as_ref(),
        )?;
        if let Some(g) = guide {
            a.done = g.done();
            if it.forced_drafts {
                a.forced = g.forced();
            }
            g.sampled = !it.params.is_greedy();
        }
        if let Some(k) = it.logprobs {
            // Token i comes from the row of the node before it on the path
            // (row 0: the root).
            a.logprobs = a
                .tokens
                .iter()
                .enumerate()
                .map(|(i, &t)| {
                    let r = if i == 0 { 0 } else { path[i - 1] + 1 };
                    let row = &it.rows[r * self.vocab..(r + 1) * self.vocab];
                    super::TokenLogprob::of(row, t, k)
                })
                .collect();
        }
        Ok((a, path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits_for(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.max(1e-30).ln()).collect()
    }

    /// `accept_tree` on a tree drawn without replacement, with no context,
    /// guide or end ban.
    fn accept_siblings(
        rows: &[f32],
        v: usize,
        d: &Draft,
        params: &SamplingParams,
        rng: &mut Rng,
        acceptance: Acceptance,
    ) -> (Accepted, Vec<usize>) {
        accept_tree(
            rows,
            v,
            d,
            SiblingMode::WithoutReplacement,
            &[],
            &[],
            params,
            rng,
            acceptance,
            None,
            None,
        )
        .unwrap()
    }

    /// Coupling: with one-hot children, the token a sampled position
    /// emits is plain decoding's draw for the same stream, whichever
    /// children (none, wrong ones, several siblings, the right one) were
    /// drafted; a child is accepted exactly when it is that token, and
    /// the stream advances once per emitted token.
    #[test]
    fn one_hot_children_emit_plain_decodings_draw_whatever_is_drafted() {
        let v = 6;
        let row = logits_for(&[0.3, 0.25, 0.2, 0.1, 0.1, 0.05]);
        let params = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        let mut seen = [0u32; 6];
        for seed in 0..300u64 {
            // Plain decoding's draw (`plain::generate`): the law at the
            // first uniform of the stream seeded by the request's first draw.
            let plain = sampler::distribution(&row, &params)
                .sample(&mut Rng::new(Rng::new(seed).next_u64()));
            seen[plain as usize] += 1;
            for kids in [
                vec![],
                vec![0u32],
                vec![1, 2],
                vec![5, 4, 3],
                vec![plain],
                vec![3, plain],
            ] {
                let n = kids.len();
                let d = Draft {
                    tokens: kids.clone(),
                    q: vec![DraftQ::OneHot; n],
                    parents: Some(vec![-1; n]),
                    source: None,
                };
                let rows: Vec<f32> = (0..=n).flat_map(|_| row.clone()).collect();
                let mut rng = Rng::new(seed);
                let (a, path) = accept_siblings(&rows, v, &d, &params, &mut rng, Acceptance::Exact);
                assert_eq!(a.tokens[0], plain, "seed {seed}, children {kids:?}");
                assert_eq!(!path.is_empty(), kids.contains(&plain));
                // One draw of the request's stream per emitted token (an
                // accepted child, then its bonus).
                assert_eq!(a.tokens.len(), path.len() + 1);
                let mut expect = Rng::new(seed);
                for _ in 0..a.tokens.len() {
                    expect.next_u64();
                }
                assert_eq!(rng.next_u64(), expect.next_u64());
            }
        }
        // Every token is drawn now and then (the draws are p's).
        assert!(seen.iter().all(|&c| c > 0), "{seen:?}");
    }

    #[test]
    fn greedy_accepts_matching_prefix_then_corrects() {
        let v = 4;
        // argmaxes per position: 2, 1, 3
        let mut rows = Vec::new();
        rows.extend(logits_for(&[0.1, 0.2, 0.6, 0.1]));
        rows.extend(logits_for(&[0.1, 0.7, 0.1, 0.1]));
        rows.extend(logits_for(&[0.1, 0.1, 0.1, 0.7]));
        let draft = Draft {
            tokens: vec![2, 0],
            q: vec![DraftQ::OneHot, DraftQ::OneHot],
            parents: None,
            source: None,
        };
        let mut rng = Rng::new(0);
        let a = accept(
            &rows,
            v,
            &draft,
            &[0],
            &[],
            &SamplingParams::greedy(),
            &mut rng,
            Acceptance::Exact,
        )
        .unwrap();
        assert_eq!(
            a,
            Accepted {
                accepted: 1,
                tokens: vec![2, 1],
                ..Accepted::default()
            }
        );
        let draft = Draft {
            tokens: vec![2, 1],
            q: vec![DraftQ::OneHot, DraftQ::OneHot],
            parents: None,
            source: None,
        };
        let a = accept(
            &rows,
            v,
            &draft,
            &[0],
            &[],
            &SamplingParams::greedy(),
            &mut rng,
            Acceptance::Exact,
        )
        .unwrap();
        assert_eq!(
            a,
            Accepted {
                accepted: 2,
                tokens: vec![2, 1, 3],
                ..Accepted::default()
            }
        );
    }

    #[test]
    fn one_hot_rejection_never_repeats_the_rejected_token() {
        let v = 3;
        let rows = logits_for(&[0.5, 0.3, 0.2]).repeat(2);
        let draft = Draft {
            tokens: vec![0],
            q: vec![DraftQ::OneHot],
            parents: None,
            source: None,
        };
        let params = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let mut rng = Rng::new(3);
        let mut counts = [0usize; 3];
        let mut accepted = 0;
        for _ in 0..20000 {
            let a = accept(
                &rows,
                v,
                &draft,
                &[],
                &[],
                &params,
                &mut rng,
                Acceptance::Exact,
            )
            .unwrap();
            if a.accepted == 1 {
                accepted += 1;
            } else {
                counts[a.tokens[0] as usize] += 1;
            }
        }
        // Accepted with probability p(0) = 0.5; rejections resample from p
        // without token 0: 0.3 / 0.5 and 0.2 / 0.5.
        assert_eq!(counts[0], 0);
        assert!((accepted as f64 / 20000.0 - 0.5).abs() < 0.015);
        let rej = (counts[1] + counts[2]) as f64;
        assert!((counts[1] as f64 / rej - 0.6).abs() < 0.02);
    }

    #[test]
    fn residual_sampling_and_its_zero_mass_guard() {
        let p = Distribution {
            ids: vec![1, 0],
            probs: vec![0.75, 0.25],
        };
        let mut rng = Rng::new(1);
        // p - q is positive only on token 1.
        let q = DraftQ::Full(vec![0.75, 0.25].into());
        for _ in 0..100 {
            assert_eq!(sample_residual(&p, &q, 0, &mut rng), 1);
        }
        // p == q: no residual mass; the guard samples from p itself.
        let same = DraftQ::Full(vec![0.25, 0.75].into());
        let n = 20000;
        let ones = (0..n)
            .filter(|_| sample_residual(&p, &same, 1, &mut rng) == 1)
            .count();
        assert!((ones as f64 / n as f64 - 0.75).abs() < 0.015, "{ones}");
    }

    /// The residual over a whole vocabulary, lowered by a sparse q of
    /// thousands of entries, then by one-hot qs, equals the dense
    /// definition norm(max(p - q, 0)) entry for entry.
    #[test]
    fn residual_matches_the_dense_definition_on_a_large_vocabulary() {
        let vocab = 5000;
        let mut rng = Rng::new(5);
        let logits: Vec<f32> = (0..vocab).map(|_| (rng.next_f64() * 8.0) as f32).collect();
        let p = sampler::distribution(
            &logits,
            &SamplingParams {
                temperature: 0.7,
                ..Default::default()
            },
        );
        let mut dense: Vec<f64> = p.dense(vocab).iter().map(|&x| f64::from(x)).collect();
        // A sparse q over 3000 tokens (some outside p's support would be
        // impossible here: p covers everything).
        let ids: Vec<u32> = (0..3000u32).map(|i| (i * 7) % vocab as u32).collect();
        let raw: Vec<f64> = ids.iter().map(|_| rng.next_f64() + 0.01).collect();
        let z: f64 = raw.iter().sum();
        let sparse = Distribution {
            ids: ids.clone(),
            probs: raw.iter().map(|&r| (r / z) as f32).collect(),
        };
        let mut res = Residual::new(&p, vocab);
        let q = DraftQ::Sparse(sparse.clone());
        res.subtract(&q_support(&q, ids[0], &[], 1.0));
        let step = |d: &mut Vec<f64>, q: &dyn Fn(usize) -> f64| {
            for (t, x) in d.iter_mut().enumerate() {
                *x = (*x - q(t)).max(0.0);
            }
            let z: f64 = d.iter().sum();
            d.iter_mut().for_each(|x| *x /= z);
        };
        step(&mut dense, &|t| f64::from(sparse.prob(t as u32)));
        let top = p.ids[0];
        res.subtract(&q_support(&DraftQ::OneHot, top, &[], 1.0));
        step(&mut dense, &|t| f64::from(t == top as usize));
        for t in 0..vocab {
            let got = res.prob(t as u32);
            assert!(
                (got - dense[t]).abs() < 1e-9,
                "token {t}: {got} vs {}",
                dense[t]
            );
        }
    }

    /// Multi-candidate rejection sampling at one node, siblings drawn
    /// without replacement: the first emitted token is distributed as p
    /// with the q update, and not without it.
    #[test]
    fn siblings_without_replacement_use_the_mass_q_reports() {
        // Validation lets q's sum be off by 1e-3. A q of {a: 1, b: 0.0009}
        // (sum 1.0009) draws b second; renormalising by 1 - q(a) = 0
        // instead of 1.0009 - q(a) would never accept b, and b would
        // vanish from the output.
        let v = 4;
        let p = [0.1f32, 0.45, 0.45, 0.0];
        let q = [1.0f32, 0.0009, 0.0, 0.0];
        let qa: std::sync::Arc<[f32]> = q.to_vec().into();
        let rows: Vec<f32> = logits_for(&p).repeat(3);
        let params = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let (mut rng, mut draw) = (Rng::new(21), Rng::new(22));
        let mut counts = [0usize; 4];
        let n = 60000;
        for _ in 0..n {
            // Two children drawn from q/sum(q) without replacement.
            let first = if draw.next_f64() * 1.0009 < 1.0 { 0 } else { 1 };
            let d = Draft {
                tokens: vec![first, 1 - first],
                q: vec![DraftQ::Full(qa.clone()); 2],
                parents: Some(vec![-1, -1]),
                source: None,
            };
            let (a, _) = accept_siblings(&rows, v, &d, &params, &mut rng, Acceptance::Exact);
            counts[a.tokens[0] as usize] += 1;
        }
        for t in 0..4 {
            let f = counts[t] as f64 / n as f64;
            assert!((f - f64::from(p[t])).abs() < 0.01, "{counts:?} vs {p:?}");
        }
    }

    #[test]
    fn siblings_without_replacement_need_the_q_update() {
        let v = 4;
        let p = [0.05f32, 0.55, 0.25, 0.15];
        let q = [0.5f32, 0.1, 0.3, 0.1];
        let qa: std::sync::Arc<[f32]> = q.to_vec().into();
        let rows: Vec<f32> = logits_for(&p).repeat(4);
        let params = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let freq = |acceptance: Acceptance| {
            let mut rng = Rng::new(11);
            let mut draw = Rng::new(12);
            let mut counts = [0usize; 4];
            let n = 60000;
            for _ in 0..n {
                // Three children of the root, drawn from q without replacement.
                let mut drawn: Vec<u32> = Vec::new();
                for _ in 0..3 {
                    let mass: f64 = (0..v)
                        .filter(|t| !drawn.contains(&(*t as u32)))
                        .map(|t| q[t] as f64)
                        .sum();
                    let u = draw.next_f64() * mass;
                    let mut cum = 0.0;
                    let mut pick = 0;
                    for t in 0..v {
                        if drawn.contains(&(t as u32)) {
                            continue;
                        }
                        cum += q[t] as f64;
                        pick = t as u32;
                        if u < cum {
                            break;
                        }
                    }
                    drawn.push(pick);
                }
                let d = Draft {
                    tokens: drawn.clone(),
                    q: vec![DraftQ::Full(qa.clone()); 3],
                    parents: Some(vec![-1, -1, -1]),
                    source: None,
                };
                let (a, _) = accept_siblings(&rows, v, &d, &params, &mut rng, acceptance);
                counts[a.tokens[0] as usize] += 1;
            }
            counts.map(|c| c as f64 / n as f64)
        };
        let good = freq(Acceptance::Exact);
        for t in 0..4 {
            assert!((good[t] - p[t] as f64).abs() < 0.01, "{good:?} vs {p:?}");
        }
        let bad = freq(Acceptance::StaleSiblingQ);
        let off = (0..4)
            .map(|t| (bad[t] - p[t] as f64).abs())
            .fold(0.0, f64::max);
        assert!(
            off > 0.03,
            "the naive rule should be biased: {bad:?} vs {p:?}"
        );
    }

    #[test]
    fn one_hot_siblings_are_each_accepted_and_keep_p() {
        // Two deterministic candidates [1, 2] at the root: token 1 is kept
        // with probability p(1), token 2 with p(2), and anything else has
        // its own p; with a miss redrawn from p (the lossy control) the
        // candidates come back as the correction too often.
        let v = 4;
        let p = [0.1f32, 0.3, 0.4, 0.2];
        let rows: Vec<f32> = logits_for(&p).repeat(3);
        let params = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let d = Draft {
            tokens: vec![1, 2],
            q: vec![DraftQ::OneHot; 2],
            parents: Some(vec![-1, -1]),
            source: None,
        };
        let freq = |acceptance: Acceptance, d: &Draft| {
            let mut rng = Rng::new(21);
            let (mut counts, mut accepted) = ([0usize; 4], [0usize; 4]);
            let n = 60000;
            for _ in 0..n {
                let (a, path) = accept_siblings(&rows, v, d, &params, &mut rng, acceptance);
                counts[a.tokens[0] as usize] += 1;
                if let Some(&c) = path.first() {
                    accepted[d.tokens[c] as usize] += 1;
                }
            }
            (
                counts.map(|c| c as f64 / n as f64),
                accepted.map(|c| c as f64 / n as f64),
            )
        };
        let (good, acc) = freq(Acceptance::Exact, &d);
        for t in 0..4 {
            assert!((good[t] - p[t] as f64).abs() < 0.01, "{good:?} vs {p:?}");
        }
        // Every emitted 1 or 2 is an accepted draft.
        assert!(
            (acc[1] - 0.3).abs() < 0.01 && (acc[2] - 0.4).abs() < 0.01,
            "{acc:?}"
        );
        let (bad, _) = freq(Acceptance::ResidualFromP, &d);
        let off = (0..4)
            .map(|t| (bad[t] - p[t] as f64).abs())
            .fold(0.0, f64::max);
        assert!(off > 0.03, "the control should be biased: {bad:?} vs {p:?}");
        // The same candidates with their q lifted to a point mass each (a
        // composite's sparse or full kind): still each accepted, the law
        // kept. (Read as one shared q, the second was never accepted.)
        for q in [
            vec![
                DraftQ::Sparse(Distribution::one_hot(1)),
                DraftQ::Sparse(Distribution::one_hot(2)),
            ],
            vec![
                DraftQ::Full(vec![0.0, 1.0, 0.0, 0.0].into()),
                DraftQ::Full(vec![0.0, 0.0, 1.0, 0.0].into()),
            ],
        ] {
            let lifted = Draft { q, ..d.clone() };
            let (good, acc) = freq(Acceptance::Exact, &lifted);
            for t in 0..4 {
                assert!((good[t] - p[t] as f64).abs() < 0.01, "{good:?} vs {p:?}");
            }
            assert!(
                (acc[1] - 0.3).abs() < 0.01 && (acc[2] - 0.4).abs() < 0.01,
                "{acc:?}"
            );
        }
    }
}
