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
}
