//! The speculation policy: how much to draft for a sequence this step.
//!
//! Invariant: drafting never costs more than it is expected to earn; when
//! no draft length pays for its verify cost the policy chooses 0 (plain
//! decoding), and the scheduler probes with one draft now and then so the
//! acceptance estimate keeps learning.

/// The draft length in `0..=cap` that maximises expected tokens per unit of
/// verify cost, for a per-draft acceptance rate `alpha` (assumed
/// independent per position): E(k) = (1 - alpha^(k+1)) / (1 - alpha)
/// tokens for a cost of 1 + `cost` * k. Returns 0 (plain decoding) when no
/// draft length pays for itself.
pub fn choose_draft_len(alpha: f64, cap: usize, cost: f64) -> usize {
    let a = alpha.clamp(0.0, 0.999);
    let mut best = (0usize, 1.0f64);
    for k in 1..=cap {
        let expected = (1.0 - a.powi(k as i32 + 1)) / (1.0 - a);
        let value = expected / (1.0 + cost * k as f64);
        if value > best.1 + 1e-9 {
            best = (k, value);
        }
    }
    best.0
}

/// What a verify forward costs on this machine, as a function of the
/// tokens it feeds, learned online from decode steps (every fed position
/// computes logits). Drafted tokens are then priced by what they add to the
/// step they join, relative to each sequence's share of that step: at
/// batch 1 that is the memory-bound `(t(1 + k) - t(1)) / k / t(1)`, at
/// batch 16 the marginal token costs a larger share, so speculation that
/// pays alone can stop paying under load.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyCostModel {
    /// Mean step time (seconds) by tokens fed, and how many steps it has
    /// seen (a running mean for the first `WINDOW` steps, then an EMA that
    /// follows the machine); `None`: never seen.
    times: Vec<Option<(f64, u32)>>,
    /// The step line `t = m + n (c + a ctx)`: decayed sums of x x^T and
    /// x t over decode steps, x = (1, n, n ctx / 1024) (see `StepLine`).
    line: StepLine,
}

/// A least-squares line through recent decode steps: a step of `n` tokens
/// whose sequences hold `ctx` positions on average costs
/// `m + n (c + a ctx / 1024)` seconds (`m`: what every step pays, reading
/// the weights; `c`: a token's rows; `a`: its attention per 1,024
/// positions of context). Keyed by the tokens alone, a step's time mixes
/// up batches of short and long contexts (a run's last sequences are its
/// longest prompts), and a few noisy sizes next to each other gave slopes
/// near zero or below; the line uses every step, decayed by `DECAY` per
/// step so it follows the machine.
#[derive(Debug, Clone, PartialEq, Default)]
struct StepLine {
    xx: [[f64; 3]; 3],
    xt: [f64; 3],
}

impl StepLine {
    /// Weight a step keeps per later step (a memory of about 200 steps).
    const DECAY: f64 = 0.995;

    fn features(n: f64, ctx: f64) -> [f64; 3] {
        [1.0, n, n * ctx / 1024.0]
    }

    fn record(&mut self, n: usize, ctx: f64, seconds: f64) {
        let x = Self::features(n as f64, ctx);
        for i in 0..3 {
            for j in 0..3 {
                self.xx[i][j] = self.xx[i][j] * Self::DECAY + x[i] * x[j];
            }
            self.xt[i] = self.xt[i] * Self::DECAY + x[i] * seconds;
        }
    }

    /// The fitted `(m, c, a)`, when the steps seen vary enough in size to
    /// tell a token's cost from the step's (a spread of at least one token
    /// either way) and the fit is sane (`c` > 0, every time positive).
    fn fit(&self) -> Option<[f64; 3]> {
        let w = self.xx[0][0];
        if w < 8.0 {
            return None;
        }
        let mean = self.xx[0][1] / w;
        if self.xx[1][1] / w - mean * mean < 1.0 {
            return None;
        }
        // A small ridge keeps the attention term determined when every
        // step's context is alike (n and n ctx nearly collinear); the
        // prediction at such steps is unaffected.
        let mut a = self.xx;
        let ridge = 1e-6 * (a[1][1] + a[2][2]).max(1e-12);
        a[2][2] += ridge;
        let th = solve3(a, self.xt)?;
        (th[1] > 0.0 && th.iter().all(|v| v.is_finite())).then_some(th)
    }
}

/// `a x = b` for a 3x3 system (Gaussian elimination with partial
/// pivoting); `None` when singular.
fn solve3(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let piv = (col..3).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[piv][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, piv);
        b.swap(col, piv);
        for r in col + 1..3 {
            let f = a[r][col] / a[col][col];
            for k in col..3 {
                a[r][k] -= f * a[col][k];
            }
            b[r] -= f * b[col];
        }
    }
    let mut x = [0.0; 3];
    for r in (0..3).rev() {
        let s: f64 = (r + 1..3).map(|k| a[r][k] * x[k]).sum();
        x[r] = (b[r] - s) / a[r][r];
    }
    Some(x)
}

impl VerifyCostModel {
    /// Steps after which a size's mean becomes an EMA of weight 1/WINDOW.
    const WINDOW: u32 = 20;

    /// A model for steps of up to `max_tokens` tokens.
    pub fn new(max_tokens: usize) -> Self {
        Self {
            times: vec![None; max_tokens.max(1) + 1],
            line: StepLine::default(),
        }
    }

    /// A decode-only step that fed `tokens` to sequences holding `ctx`
    /// positions on average took `seconds`.
    pub fn record(&mut self, tokens: usize, ctx: f64, seconds: f64) {
        if tokens == 0 || !seconds.is_finite() || seconds <= 0.0 || !ctx.is_finite() || ctx < 0.0 {
            return;
        }
        if tokens < self.times.len() {
            self.line.record(tokens, ctx, seconds);
        }
        let Some(slot) = self.times.get_mut(tokens) else {
            return;
        };
        *slot = Some(match *slot {
            Some((t, n)) => {
                let n = n.saturating_add(1);
                let w = 1.0 / f64::from(n.min(Self::WINDOW));
                ((1.0 - w) * t + w * seconds, n)
            }
            None => (seconds, 1),
        });
    }

    /// The measured mean at exactly `n` tokens.
    fn at(&self, n: usize) -> Option<f64> {
        self.times.get(n).copied().flatten().map(|(t, _)| t)
    }

    /// Estimated seconds for a step feeding `n` tokens: measured, linearly
    /// interpolated between the nearest measured sizes, or extrapolated
    /// from the two nearest on one side; `None` without enough data.
    pub fn time(&self, n: usize) -> Option<f64> {
        let n = n.min(self.times.len() - 1);
        if let Some(t) = self.at(n) {
            return Some(t);
        }
        let below: Vec<(usize, f64)> = (1..n)
            .rev()
            .filter_map(|i| self.at(i).map(|t| (i, t)))
            .take(2)
            .collect();
        let above: Vec<(usize, f64)> = (n + 1..self.times.len())
            .filter_map(|i| self.at(i).map(|t| (i, t)))
            .take(2)
            .collect();
        let line = |(x0, y0): (usize, f64), (x1, y1): (usize, f64)| {
            let slope = (y1 - y0) / (x1 as f64 - x0 as f64);
            (y0 + slope * (n as f64 - x0 as f64)).max(y0.min(y1) * 0.5)
        };
        match (below.first(), above.first(), below.get(1), above.get(1)) {
            (Some(&b), Some(&a), _, _) => Some(line(b, a)),
            (Some(&b0), None, Some(&b1), _) => Some(line(b1, b0)),
            (None, Some(&a0), _, Some(&a1)) => Some(line(a0, a1)),
            _ => None,
        }
    }

    /// `time(n)`, or where that has too little data, the measured size
    /// nearest `n` (`None`: nothing measured yet).
    pub fn time_or_nearest(&self, n: usize) -> Option<f64> {
        self.time(n).or_else(|| {
            (1..self.times.len())
                .filter_map(|i| self.at(i).map(|t| (i.abs_diff(n), t)))
                .min_by_key(|&(d, _)| d)
                .map(|(_, t)| t)
        })
    }

    /// The verify cost of one drafted token in a step of `batch` decoding
    /// sequences holding `ctx` positions on average, relative to one
    /// sequence's share of the step without drafts: from the step line,
    /// `(c + a ctx) / (t(batch) / batch)`. `None` until the steps seen
    /// vary enough in size to tell (the caller falls back to a prior).
    pub fn draft_cost(&self, batch: usize, ctx: f64) -> Option<f64> {
        let [m, c, a] = self.line.fit()?;
        let b = batch.max(1) as f64;
        let per_token = c + a * ctx.max(0.0) / 1024.0;
        let step = m + b * per_token;
        (per_token > 0.0 && step > 0.0).then(|| per_token / (step / b))
    }

    /// Steps a size must have seen before `alone_draft_cost` reads its mean.
    const ALONE_SEEN: u32 = 8;

    /// The verify cost of one drafted token for a sequence decoding alone,
    /// relative to its one-token step: the step line where fitted
    /// (`draft_cost(1, ctx)`, at `ctx` positions), else from the measured
    /// means, `(t(n) - t(1)) / (n - 1) / t(1)` at the smallest size `n > 1`
    /// seen `ALONE_SEEN` times (whatever the context). Alone, drafts are
    /// mostly one or two tokens, too alike in size for the line (which
    /// wants a token's spread either way), while the means of those two
    /// sizes are the price asked. The means are keyed by tokens fed, so
    /// `t(2)` also holds two sequences' undrafted steps, which cost about
    /// what one sequence's two tokens do, and a size's mean moves only
    /// when steps of that size are seen. `None` without both sizes, or
    /// when noise puts `t(n)` at or below `t(1)` (the caller keeps its
    /// configured price: a price of zero would draft at any acceptance).
    pub fn alone_draft_cost(&self, ctx: f64) -> Option<f64> {
        if let Some(c) = self.draft_cost(1, ctx) {
            return Some(c);
        }
        let seen = |n: usize| match self.times.get(n).copied().flatten() {
            Some((t, k)) if k >= Self::ALONE_SEEN => Some(t),
            _ => None,
        };
        let t1 = seen(1)?;
        let (n, tn) = (2..self.times.len()).find_map(|n| seen(n).map(|t| (n, t)))?;
        let c = (tn - t1) / (n - 1) as f64 / t1;
        (c.is_finite() && c > 0.0).then_some(c)
    }

    /// A step of `batch` tokens at `ctx` positions of context, in seconds,
    /// from the step line (`None`: not fitted yet).
    pub fn line_time(&self, batch: usize, ctx: f64) -> Option<f64> {
        let [m, c, a] = self.line.fit()?;
        let t = m + batch as f64 * (c + a * ctx.max(0.0) / 1024.0);
        (t > 0.0).then_some(t)
    }
}

/// What the drafting policy tracks for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqPolicy {
    /// Drafted positions accepted, and drafted positions tested, each
    /// decayed by `DECAY` per position tested after it: a step whose draft
    /// of depth d had a accepted tested a + 1 positions (a when all d were
    /// accepted), since the target judges positions in order and stops at
    /// the first rejection. Their ratio (with the prior) estimates the
    /// per-position acceptance rate.
    pub accepted: f64,
    pub tested: f64,
    /// Decode steps since the last draft (for probing when drafting paused).
    pub steps_without_draft: u32,
    /// Consecutive probes (drafts after a pause) of which nothing was
    /// accepted: for a proposer with its own cost (`token_cost`), each
    /// doubles the wait before the next (up to 16x).
    pub probe_misses: u32,
    /// Tree size policy (tree proposers only).
    pub tree: Option<TreePolicy>,
}

impl Default for SeqPolicy {
    fn default() -> Self {
        Self {
            accepted: 0.0,
            tested: 0.0,
            steps_without_draft: 0,
            probe_misses: 0,
            tree: None,
        }
    }
}

impl SeqPolicy {
    /// Weight a tested position keeps per position tested after it (an
    /// effective memory of about ten positions).
    pub const DECAY: f64 = 0.9;
    /// The prior: `PRIOR_TESTED` positions accepted at `PRIOR_RATE`.
    pub const PRIOR_RATE: f64 = 0.5;
    pub const PRIOR_TESTED: f64 = 2.0;

    /// The estimated per-position acceptance rate: accepted over tested
    /// positions, pooled (each tested position weighs the same, however
    /// long the chain it was in), with the prior.
    ///
    /// Pooling matters: the mean of each step's accepted / depth
    /// (what this used to be) weighs a rejection at the first position
    /// like a whole chain's, and reads a proposer accepted 40% of the time
    /// as about 30% (the test below), which paused drafting that pays.
    pub fn acceptance(&self) -> f64 {
        (self.accepted + Self::PRIOR_TESTED * Self::PRIOR_RATE) / (self.tested + Self::PRIOR_TESTED)
    }

    /// A step drafted `drafted` of the proposer's own tokens (deepest
    /// `depth`) and `accepted` were accepted; `forced`: the step drafted a
    /// constraint's forced tokens (which alone do not count as a draft).
    pub fn record(&mut self, drafted: usize, depth: usize, accepted: usize, forced: bool) {
        if drafted > 0 {
            // Positions tested: the accepted ones, plus the one rejected
            // (none when the whole depth was accepted).
            let depth = depth.max(1);
            let accepted = accepted.min(depth);
            let tested = accepted + usize::from(accepted < depth);
            let keep = Self::DECAY.powi(tested as i32);
            self.accepted = self.accepted * keep + accepted as f64;
            self.tested = self.tested * keep + tested as f64;
            if self.steps_without_draft > 0 {
                // A draft after a pause: a probe.
                self.probe_misses = if accepted == 0 {
                    self.probe_misses.saturating_add(1)
                } else {
                    0
                };
            }
            self.steps_without_draft = 0;
            if let Some(tp) = &mut self.tree {
                tp.record(drafted, accepted);
            }
        } else if !forced {
            self.steps_without_draft += 1;
        }
    }

    /// The draft length out of the cap `k` that recent acceptance pays for
    /// at `cost` a drafted token (`own` of it the proposer's own;
    /// `tree`: a tree proposer, sized by its `TreePolicy`), with a probe of
    /// one token now and then while paused: less often as drafts get
    /// dearer than `draft_cost` (under load, or a costly proposer), and
    /// for a proposer with its own cost after each probe that missed (a
    /// lookup's probe costs only its verify, and its matches come and go).
    pub fn draft_len(&self, k: usize, cost: f64, own: f64, draft_cost: f64, tree: bool) -> usize {
        let mut k = match (&self.tree, tree) {
            // Trees: the node budget whose measured accepted length pays
            // best for its verify cost.
            (Some(tp), true) => tp.choose(k, cost),
            _ => choose_draft_len(self.acceptance(), k, cost),
        };
        let backoff = if own > 0.0 {
            self.probe_misses.min(4)
        } else {
            0
        };
        let every =
            (8.0 * (cost / draft_cost.max(1e-3)).max(1.0)).min(128.0) * f64::from(1u32 << backoff);
        if k == 0 && f64::from(self.steps_without_draft) >= every {
            k = 1;
        }
        k
    }
}

/// The node budget of tree proposers, learned per sequence.
///
/// Budgets are powers of two up to the proposer's cap (and the cap). For
/// each, an estimate of the tokens a step accepts is kept (an EMA of what
/// steps drafted with that budget accepted); unseen budgets start from a
/// prior of log2(budget + 1), which favours middle sizes. The policy picks
/// the budget that maximises (1 + accepted) / (1 + cost * nodes), 0 when
/// none beats plain decoding, and every 8th step tries the budget next to
/// the best one so the estimates keep up with the sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct TreePolicy {
    budgets: Vec<usize>,
    accepted: Vec<f64>,
    steps: u32,
}

impl TreePolicy {
    pub fn new(cap: usize) -> Self {
        let mut budgets: Vec<usize> = (0..)
            .map(|e| 1usize << e)
            .take_while(|&b| b < cap)
            .collect();
        if cap > 0 {
            budgets.push(cap);
        }
        let accepted = budgets.iter().map(|&b| ((b + 1) as f64).log2()).collect();
        Self {
            budgets,
            accepted,
            steps: 0,
        }
    }

    fn value(&self, i: usize, cost: f64) -> f64 {
        (1.0 + self.accepted[i]) / (1.0 + cost * self.budgets[i] as f64)
    }

    /// The node budget for the next step, at most `cap`.
    pub fn choose(&self, cap: usize, cost: f64) -> usize {
        let usable: Vec<usize> = (0..self.budgets.len())
            .filter(|&i| self.budgets[i] <= cap)
            .collect();
        let Some(&best) = usable
            .iter()
            .max_by(|&&a, &&b| self.value(a, cost).total_cmp(&self.value(b, cost)))
        else {
            return cap.min(1);
        };
        if self.value(best, cost) <= 1.0 + 1e-9 {
            return 0;
        }
        let pick = if self.steps % 8 == 7 {
            // Explore a neighbour, alternating up and down.
            let up = (self.steps / 8).is_multiple_of(2);
            let pos = usable.iter().position(|&i| i == best).unwrap_or(0);
            let n = if up { pos + 1 } else { pos.saturating_sub(1) };
            usable.get(n).copied().unwrap_or(best)
        } else {
            best
        };
        self.budgets[pick].min(cap)
    }

    /// A step that drafted `nodes` nodes accepted `accepted` of them.
    pub fn record(&mut self, nodes: usize, accepted: usize) {
        self.steps = self.steps.wrapping_add(1);
        // The largest budget the step fit in.
        if let Some(i) = self.budgets.iter().position(|&b| b >= nodes) {
            self.accepted[i] = 0.7 * self.accepted[i] + 0.3 * accepted as f64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_length_follows_acceptance_and_cost() {
        // Drafts that are rarely accepted do not pay for their verify cost.
        assert_eq!(choose_draft_len(0.1, 8, 0.25), 0);
        // Good acceptance with cheap verification drafts long.
        assert_eq!(choose_draft_len(0.9, 8, 0.1), 8);
        // In between, a middle length wins.
        let k = choose_draft_len(0.7, 8, 0.3);
        assert!((1..8).contains(&k), "{k}");
        // Free verification: always the cap (for any positive acceptance).
        assert_eq!(choose_draft_len(0.3, 5, 0.0), 5);
        assert_eq!(choose_draft_len(0.9, 0, 0.1), 0);
    }

    /// Steps of a sequence whose drafts are each accepted with
    /// probability `alpha` (position after position, until the first
    /// rejection) at `cost` per drafted token (`own` of it the proposer's):
    /// the share of steps that draft, and tokens per unit of cost over
    /// plain decoding.
    fn run_policy(alpha: f64, cost: f64, own: f64, cap: usize) -> (f64, f64) {
        let mut p = SeqPolicy::default();
        let mut seed = 7u64;
        let mut uniform = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        let (steps, mut drafting, mut tokens, mut spent) = (20_000, 0, 0.0, 0.0);
        for _ in 0..steps {
            let k = p.draft_len(cap, cost, own, 0.12, false);
            let mut acc = 0;
            while acc < k && uniform() < alpha {
                acc += 1;
            }
            p.record(k, k, acc, false);
            drafting += usize::from(k > 0);
            tokens += 1.0 + acc as f64;
            spent += 1.0 + cost * k as f64;
        }
        (drafting as f64 / steps as f64, tokens / spent)
    }

    #[test]
    fn acceptance_is_pooled_over_tested_positions() {
        // A draft of 4 rejected at its first position tested one position;
        // one accepted whole tested four.
        let mut p = SeqPolicy::default();
        p.record(4, 4, 0, false);
        p.record(4, 4, 4, false);
        let d = SeqPolicy::DECAY;
        let want = (4.0 + 2.0 * 0.5) / ((1.0 * d.powi(4) + 4.0) + 2.0);
        assert!((p.acceptance() - want).abs() < 1e-12, "{}", p.acceptance());
        // Drafts accepted 40% of the time at 0.15 a token pay (1.4 tokens
        // for 1.15 at one token a step), so the policy drafts on nearly
        // every step and earns most of that: the mean of accepted / depth
        // it used to follow read such a proposer as about 30% accepted,
        // and paused it on all but one step in seven (1.04x).
        let (share, gain) = run_policy(0.4, 0.15, 0.03, 4);
        assert!(share > 0.9, "drafts on {share} of steps");
        assert!(gain > 1.18, "earns {gain}");
        // Drafts that never pay stay rare (probes only) and cost little.
        let (share, gain) = run_policy(0.05, 0.15, 0.03, 4);
        assert!(share < 0.1, "drafts on {share} of steps");
        assert!(gain > 0.98, "{gain}");
        // Near-certain drafts run to the cap.
        let mut p = SeqPolicy::default();
        for _ in 0..20 {
            p.record(4, 4, 4, false);
        }
        assert_eq!(p.draft_len(4, 0.15, 0.03, 0.12, false), 4);
    }

    #[test]
    fn verify_costs_are_learned_interpolated_and_priced_by_batch() {
        let mut m = VerifyCostModel::new(128);
        assert_eq!(m.draft_cost(1, 0.0), None, "nothing measured yet");
        // Per size: a machine where a step costs 10 ms + 0.5 ms per token
        // up to 8 tokens, then 1.5 ms per token.
        let t = |n: usize| {
            if n <= 8 {
                0.010 + 0.0005 * n as f64
            } else {
                0.014 + 0.0015 * (n - 8) as f64
            }
        };
        for n in [1, 2, 3, 5, 8, 16, 20, 32, 48, 64] {
            for _ in 0..5 {
                m.record(n, 0.0, t(n));
            }
        }
        // Measured sizes are exact; others interpolate; past the data they
        // extrapolate from the last two.
        assert!((m.time(8).unwrap() - t(8)).abs() < 1e-12);
        assert!((m.time(4).unwrap() - t(4)).abs() < 1e-9);
        assert!((m.time(40).unwrap() - t(40)).abs() < 1e-9);
        assert!((m.time(80).unwrap() - t(80)).abs() < 1e-9);
        // A size's mean follows the machine, slowly.
        let mut drift = m.clone();
        for _ in 0..200 {
            drift.record(16, 0.0, t(16) * 2.0);
        }
        assert!((drift.time(16).unwrap() / t(16) - 2.0).abs() < 0.01);
        // Garbage is ignored.
        m.record(0, 0.0, 1.0);
        m.record(4, 0.0, f64::NAN);
        m.record(4, 0.0, -1.0);
        m.record(4, f64::NAN, 1.0);
        m.record(1000, 0.0, 1.0);
        assert!((m.time(4).unwrap() - t(4)).abs() < 1e-9);
    }

    /// A sequence decoding alone drafts one or two tokens a step: too
    /// alike in size for the step line, so its price comes from the means
    /// of the sizes seen, once each has been seen often enough.
    #[test]
    fn a_lone_sequence_is_priced_from_its_measured_sizes() {
        // 5 ms a one-token step, 0.45 ms more per drafted token (0.09).
        let t = |n: usize| 0.005 + 0.00045 * (n - 1) as f64;
        let mut m = VerifyCostModel::new(64);
        assert_eq!(m.alone_draft_cost(300.0), None, "nothing measured yet");
        for i in 0..40 {
            m.record(1, 300.0, t(1));
            if i < 5 {
                m.record(2, 300.0, t(2));
            }
        }
        assert_eq!(m.draft_cost(1, 300.0), None, "the line is not fitted");
        assert_eq!(m.alone_draft_cost(300.0), None, "two tokens seen 5 times");
        for _ in 0..5 {
            m.record(2, 300.0, t(2));
        }
        let c = m.alone_draft_cost(300.0).unwrap();
        assert!((c - 0.09).abs() < 1e-9, "{c}");
        // Only three-token steps beside the one-token ones: per token.
        let mut m3 = VerifyCostModel::new(64);
        for _ in 0..10 {
            m3.record(1, 300.0, t(1));
            m3.record(3, 300.0, t(3));
        }
        assert!((m3.alone_draft_cost(300.0).unwrap() - 0.09).abs() < 1e-9);
        // Two- and three-token steps at different costs per token (0.45
        // and 0.6 ms): the smallest larger size answers.
        let mut m23 = VerifyCostModel::new(64);
        for _ in 0..10 {
            m23.record(1, 300.0, t(1));
            m23.record(2, 300.0, t(2));
            m23.record(3, 300.0, t(1) + 0.0012);
        }
        assert_eq!(m23.draft_cost(1, 300.0), None);
        assert!((m23.alone_draft_cost(300.0).unwrap() - 0.09).abs() < 1e-9);
        // Once steps vary enough for the step line, the line answers.
        let mut wide = m23.clone();
        for _ in 0..10 {
            wide.record(6, 300.0, t(1) + 0.005);
        }
        let line = wide.draft_cost(1, 300.0).expect("the line is fitted");
        assert_eq!(wide.alone_draft_cost(300.0), Some(line));
        assert!((line - 0.09).abs() > 0.01, "{line}");
        // Noise that puts the larger step below the one-token one gives
        // no price, never zero or less.
        let mut noisy = VerifyCostModel::new(64);
        for _ in 0..10 {
            noisy.record(1, 300.0, 0.005);
            noisy.record(2, 300.0, 0.0049);
        }
        assert_eq!(noisy.alone_draft_cost(300.0), None);
    }

    /// The step line: a machine where a step costs 4 ms plus, per token,
    /// 0.6 ms and 0.4 ms per 1,024 positions of context. A run whose big
    /// batches are short contexts and whose small ones are long (its last
    /// sequences are its longest prompts) has step times that fall more
    /// slowly with the batch than a token costs; keyed by tokens alone
    /// that read as cheap drafts. The line prices a drafted token at what
    /// it costs, relative to a sequence's share of the step.
    #[test]
    fn drafts_are_priced_from_a_line_through_steps_and_contexts() {
        let step = |n: usize, ctx: f64| 0.004 + n as f64 * (0.0006 + 0.0004 * ctx / 1024.0);
        let mut m = VerifyCostModel::new(512);
        // A few steps of nearly one size say nothing about a token's cost:
        // no price (the caller's prior), never a slope read from noise.
        for (i, n) in [20, 21, 20, 21, 20, 21, 20, 21, 20].into_iter().enumerate() {
            let noise = if i % 2 == 0 { 1.03 } else { 0.97 };
            m.record(n, 100.0, step(n, 100.0) * noise);
        }
        assert_eq!(m.draft_cost(20, 100.0), None);
        // A run draining from 24 sequences at 100 positions to 1 at 2,000,
        // with drafts on some steps, noise of a few percent.
        let mut m = VerifyCostModel::new(512);
        let mut seed = 11u64;
        for i in 0..400 {
            let batch = 24 - (i * 23 / 399);
            let ctx = 100.0 + 1900.0 * i as f64 / 399.0;
            let extra = (i * 7) % 3 * batch / 2;
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            let noise = 1.0 + 0.04 * ((seed >> 33) as f64 / (1u64 << 31) as f64 - 0.5);
            m.record(batch + extra, ctx, step(batch + extra, ctx) * noise);
        }
        for (batch, ctx) in [(20, 300.0), (4, 1500.0), (2, 100.0)] {
            let share = step(batch, ctx) / batch as f64;
            let want = (0.0006 + 0.0004 * ctx / 1024.0) / share;
            let got = m.draft_cost(batch, ctx).unwrap();
            assert!(
                (got / want - 1.0).abs() < 0.1,
                "{batch} at {ctx}: {got} vs {want}"
            );
        }
        // A busy batch's drafted token costs most of a sequence's share:
        // only near-certain drafts pay there, while a pair drafts freely.
        let busy = m.draft_cost(20, 300.0).unwrap();
        assert!(busy > 0.6, "{busy}");
        assert_eq!(choose_draft_len(0.6, 8, busy), 0);
        assert!(choose_draft_len(0.6, 8, m.draft_cost(2, 100.0).unwrap()) >= 1);
        // The line's step times follow the machine.
        let t = m.line_time(10, 500.0).unwrap();
        assert!((t / step(10, 500.0) - 1.0).abs() < 0.05, "{t}");
    }

    #[test]
    fn tree_budget_follows_what_trees_accept() {
        let settle = |accept: fn(usize) -> usize, cost: f64| {
            let mut p = TreePolicy::new(64);
            for _ in 0..120 {
                let n = p.choose(64, cost);
                p.record(n.max(1), accept(n.max(1)));
            }
            // The choice outside exploration steps.
            (0..8).map(|_| p.choose(64, cost)).min().unwrap()
        };
        // Big trees keep paying: the policy grows to them.
        let big = settle(|n| n / 2, 0.05);
        assert!(big >= 32, "{big}");
        // Acceptance saturates at two tokens: small trees.
        let small = settle(|n| n.min(2), 0.1);
        assert!((1..=4).contains(&small), "{small}");
        // Nothing is ever accepted: drafting stops (0), bar the probes.
        assert_eq!(settle(|_| 0, 0.1), 0);
        // Never more than the cap of this step.
        assert!(TreePolicy::new(64).choose(3, 0.0) <= 3);
    }
}
