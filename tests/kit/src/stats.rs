//! Exact first-two-token distributions, the chi-square statistic and
//! `Sampled`, the sampled half of every losslessness test.

use std::sync::Arc;

use specd::config::Config;
use specd::model::Model;
use specd::sampler::SamplingParams;

/// Exact joint distribution of the first two generated tokens.
pub fn exact_first_two(
    model: &specd::model::Model,
    prompt: &[u32],
    params: &specd::sampler::SamplingParams,
) -> Vec<f64> {
    exact_first_two_shaped(model, prompt, params, |_, _| {})
}

/// `exact_first_two` with `shape(output so far, logits)` applied to each
/// position's logits before the request's transforms (a constraint's
/// mask).
pub fn exact_first_two_shaped(
    model: &specd::model::Model,
    prompt: &[u32],
    params: &specd::sampler::SamplingParams,
    shape: impl Fn(&[u32], &mut [f32]),
) -> Vec<f64> {
    let v = model.config.vocab_size;
    let mut c = model.new_cache();
    let mut l1 = model
        .forward_one(&mut c, prompt, specd::model::Logits::Last)
        .unwrap()
        .logits;
    shape(&[], &mut l1);
    // Penalties (a no-op without them): the first token sees the prompt,
    // the second the prompt and the first.
    specd::sampler::apply_penalties(&mut l1, prompt, &[], params);
    let p1 = specd::sampler::distribution(&l1, params).dense(v);
    let mut joint = vec![0f64; v * v];
    for t1 in 0..v {
        if p1[t1] == 0.0 {
            continue;
        }
        let mut c2 = c.clone();
        let mut l2 = model
            .forward_one(&mut c2, &[t1 as u32], specd::model::Logits::Last)
            .unwrap()
            .logits;
        shape(&[t1 as u32], &mut l2);
        let ctx: Vec<u32> = prompt.iter().copied().chain([t1 as u32]).collect();
        specd::sampler::apply_penalties(&mut l2, &ctx, &[t1 as u32], params);
        let p2 = specd::sampler::distribution(&l2, params).dense(v);
        for t2 in 0..v {
            joint[t1 * v + t2] = p1[t1] as f64 * p2[t2] as f64;
        }
    }
    joint
}

/// Pearson chi-square of `counts` against `probs`, merging cells whose
/// expected count is below 5; returns (statistic, degrees of freedom).
pub fn chi_square(counts: &[u64], probs: &[f64]) -> (f64, usize) {
    let n: u64 = counts.iter().sum();
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (&o, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e < 5.0 {
            pool_o += o as f64;
            pool_e += e;
            continue;
        }
        stat += (o as f64 - e).powi(2) / e;
        cells += 1;
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e.max(1e-9);
        cells += 1;
    }
    (stat, cells - 1)
}

/// Upper 0.1% point of chi-square (Wilson-Hilferty).
pub fn chi2_crit_999(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.0902; // standard normal upper 0.1%
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// The sampled half of a losslessness test: the exact distribution of the
/// first two tokens of `prompt` under `params`, against which seeded runs
/// through a proposer are tested. A proposer passes when its counts are
/// under the 0.1% chi-square critical value; a lossy control must land
/// above 1.5 times it, or the test could not have failed.
pub struct Sampled<'a> {
    pub model: &'a Arc<Model>,
    pub prompt: &'a [u32],
    pub params: &'a SamplingParams,
    pub exact: Vec<f64>,
}

impl<'a> Sampled<'a> {
    pub fn new(model: &'a Arc<Model>, prompt: &'a [u32], params: &'a SamplingParams) -> Self {
        let exact = exact_first_two(model, prompt, params);
        Self {
            model,
            prompt,
            params,
            exact,
        }
    }

    /// `n` seeded requests (seeds from `seed0`) through proposer `arm` of
    /// `cfg` keep the distribution, and drafts are accepted more than
    /// `min_accepted` per request (so speculation was really exercised).
    /// Returns (accepted, drafted) per request.
    pub fn assert_lossless(
        &self,
        cfg: &Config,
        arm: &str,
        n: usize,
        seed0: u64,
        min_accepted: f64,
    ) -> (f64, f64) {
        self.assert_lossless_as(arm, cfg, arm, n, seed0, min_accepted)
    }

    /// [`Sampled::assert_lossless`], the run reported as `label`.
    pub fn assert_lossless_as(
        &self,
        label: &str,
        cfg: &Config,
        arm: &str,
        n: usize,
        seed0: u64,
        min_accepted: f64,
    ) -> (f64, f64) {
        let (counts, acc, drafted) =
            crate::first_two_runs(self.model, cfg, arm, self.prompt, self.params, n, seed0);
        let (stat, df) = chi_square(&counts, &self.exact);
        let crit = chi2_crit_999(df);
        eprintln!("{label}: chi2 {stat:.1} (df {df}, 0.1% critical {crit:.1}), {drafted:.2} drafted and {acc:.2} accepted per request");
        assert!(
            stat < crit,
            "{label}: sampling is biased: chi2 {stat} > {crit}"
        );
        assert!(
            acc > min_accepted,
            "{label}: drafts must be accepted often enough to matter: {acc}"
        );
        (acc, drafted)
    }

    /// The lossy control `what` (proposer `arm` of `cfg`, `n` requests
    /// seeded from `seed0`) is caught: its chi-square is above 1.5 times
    /// the critical value.
    pub fn assert_caught(&self, cfg: &Config, arm: &str, n: usize, seed0: u64, what: &str) {
        let (bad, ..) =
            crate::first_two_runs(self.model, cfg, arm, self.prompt, self.params, n, seed0);
        let (stat, df) = chi_square(&bad, &self.exact);
        eprintln!("{arm} with {what}: chi2 {stat:.1} (df {df})");
        assert!(
            stat > 1.5 * chi2_crit_999(df),
            "the test cannot tell {what} apart: chi2 {stat}"
        );
    }
}
