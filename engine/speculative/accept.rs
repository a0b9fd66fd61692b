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
//! Invariant: the only randomness is the request's own `Rng`, consumed in a
//! fixed order, so a seeded request reproduces.

use std::collections::HashMap;

use super::proposer::{Draft, DraftQ};
use super::SeqId;
use crate::error::{Result, SpecdError};
use crate::sampler::{self, Distribution, Rng, SamplingParams};

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
}

/// The result of verifying one sequence's draft.
#[derive(Debug, Clone, PartialEq)]
pub struct Accepted {
    /// Number of draft tokens accepted.
    pub accepted: usize,
    /// Accepted drafts followed by the correction or bonus token.
    pub tokens: Vec<u32>,
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

fn sample_residual(p: &Distribution, q: &DraftQ, drafted: u32, rng: &mut Rng) -> u32 {
    let resid: Vec<f64> = p
        .ids
        .iter()
        .zip(&p.probs)
        .map(|(&id, &pp)| (pp as f64 - q.prob(drafted, id) as f64).max(0.0))
        .collect();
    let z: f64 = resid.iter().sum();
    if z < RESIDUAL_EPS {
        return p.sample(rng);
    }
    let u = rng.next_f64() * z;
    let mut cum = 0.0;
    for (&id, &r) in p.ids.iter().zip(&resid) {
        cum += r;
        if u < cum {
            return id;
        }
    }
    // Rounding at the top end: the last token with residual mass.
    p.ids
        .iter()
        .zip(&resid)
        .rev()
        .find(|(_, &r)| r > 0.0)
        .map(|(&id, _)| id)
        .unwrap_or(p.ids[0])
}

/// Verify `draft` against `rows` (`(draft.len() + 1) x vocab` logits for the
/// inputs `[last, d1 .. dk]`). `context` is every committed token (prompt
/// and output), `generated` the committed output alone.
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
    let k = draft.tokens.len();
    if vocab == 0 || rows.len() != (k + 1) * vocab || draft.q.len() != k {
        return Err(SpecdError::InvalidRequest(format!(
            "acceptance: {} logits for {} drafts ({} q) over a vocabulary of {vocab}",
            rows.len(),
            k,
            draft.q.len()
        )));
    }
    let greedy = params.is_greedy();
    // Penalties see the accepted drafts as context; without penalties the
    // history is never read, so it is not copied.
    let penalised = params.has_penalties();
    let (mut ctx, mut gen) = if penalised {
        (context.to_vec(), generated.to_vec())
    } else {
        (Vec::new(), Vec::new())
    };
    let mut tokens = Vec::with_capacity(k + 1);
    for i in 0..=k {
        let row = &rows[i * vocab..(i + 1) * vocab];
        if greedy && !params.has_penalties() {
            let best = sampler::argmax(row);
            if i < k && draft.tokens[i] == best {
                tokens.push(best);
                continue;
            }
            tokens.push(best);
            return Ok(Accepted {
                accepted: i,
                tokens,
            });
        }
        let p = if acceptance == Acceptance::UnfilteredTarget {
            let raw = SamplingParams {
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                ..params.clone()
            };
            target(row, &ctx, &gen, &raw)
        } else {
            target(row, &ctx, &gen, params)
        };
        if i == k {
            tokens.push(p.sample(rng));
            return Ok(Accepted {
                accepted: k,
                tokens,
            });
        }
        let d = draft.tokens[i];
        let q = &draft.q[i];
        let pd = p.prob(d) as f64;
        let accepted = if greedy {
            pd >= 1.0
        } else {
            let qd = q.prob(d, d) as f64;
            qd > 0.0 && rng.next_f64() < (pd / qd).min(1.0)
        };
        if accepted {
            tokens.push(d);
            if penalised && acceptance != Acceptance::StalePenalties {
                ctx.push(d);
                gen.push(d);
            }
            continue;
        }
        let fix = if greedy {
            p.ids[0]
        } else {
            match acceptance {
                Acceptance::ResidualFromP => p.sample(rng),
                _ => sample_residual(&p, q, d, rng),
            }
        };
        tokens.push(fix);
        return Ok(Accepted {
            accepted: i,
            tokens,
        });
    }
    // The loop returns at i == k at the latest.
    Err(SpecdError::InvalidRequest(
        "acceptance ended without a token".into(),
    ))
}

/// One sequence's acceptance input.
#[derive(Debug, Clone)]
pub struct AcceptItem {
    pub seq: SeqId,
    /// `(draft.len() + 1) x vocab` logits.
    pub rows: Vec<f32>,
    pub draft: Draft,
    pub params: SamplingParams,
    /// Committed tokens (prompt and output) for penalties.
    pub context: Vec<u32>,
    pub prompt_len: usize,
}

/// The sample stage's struct: turns logits into accepted tokens with the
/// rules above; owns each request's RNG.
#[derive(Debug)]
pub struct Acceptor {
    vocab: usize,
    rngs: HashMap<SeqId, Rng>,
    pub acceptance: Acceptance,
}

impl Acceptor {
    pub fn new(vocab: usize) -> Self {
        Self {
            vocab,
            rngs: HashMap::new(),
            acceptance: Acceptance::Exact,
        }
    }

    pub fn end(&mut self, ids: &[SeqId]) {
        for id in ids {
            self.rngs.remove(id);
        }
    }

    /// Accept one item's drafts with its request's RNG.
    pub fn accept_one(&mut self, it: &AcceptItem) -> Result<Accepted> {
        let rng = self
            .rngs
            .entry(it.seq)
            .or_insert_with(|| Rng::new(it.params.seed));
        accept(
            &it.rows,
            self.vocab,
            &it.draft,
            &it.context,
            &it.context[it.prompt_len.min(it.context.len())..],
            &it.params,
            rng,
            self.acceptance,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits_for(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.max(1e-30).ln()).collect()
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
                tokens: vec![2, 1]
            }
        );
        let draft = Draft {
            tokens: vec![2, 1],
            q: vec![DraftQ::OneHot, DraftQ::OneHot],
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
                tokens: vec![2, 1, 3]
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
        let q = DraftQ::Full(vec![0.75, 0.25]);
        for _ in 0..100 {
            assert_eq!(sample_residual(&p, &q, 0, &mut rng), 1);
        }
        // p == q: no residual mass; the guard samples from p itself.
        let same = DraftQ::Full(vec![0.25, 0.75]);
        let n = 20000;
        let ones = (0..n)
            .filter(|_| sample_residual(&p, &same, 1, &mut rng) == 1)
            .count();
        assert!((ones as f64 / n as f64 - 0.75).abs() < 0.015, "{ones}");
    }
}
