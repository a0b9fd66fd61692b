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
