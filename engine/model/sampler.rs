//! Sampling as pure functions: logits -> (penalties, temperature, top-k,
//! top-p, min-p) -> a normalised distribution -> a token, plus a seeded
//! deterministic RNG and stop handling.
//!
//! Invariants:
//! - `distribution` is the single definition of a request's target
//!   distribution p; speculative acceptance uses exactly this function for
//!   both p and any proposer's q, so the two see the same transforms.
//! - Ties break towards the lower token id, so greedy is deterministic.
//! - The RNG is seeded per request and never shared between requests.

use serde::{Deserialize, Serialize};

use crate::error::{Result, SpecdError};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 means greedy (the scheduler decodes temperatures below
    /// `MIN_TEMPERATURE` greedily).
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
    /// Multiplicative (HF / llama.cpp) penalty over prompt and output; 1 disables.
    pub repetition_penalty: f32,
    /// OpenAI-style additive penalties over generated tokens; 0 disables.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: u64,
    /// Added to these tokens' logits after the penalties (OpenAI
    /// `logit_bias`, each in [-100, 100]); ids past the vocabulary are
    /// ignored.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

/// Temperatures below this decode greedily (as in vLLM): at 1e-5 a token
/// within 1e-4 of the top logit is already e^-10 less likely, and below
/// about 3e-39 `1 / temperature` is no longer a finite f32.
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// The multiplicative repetition penalty's range: beyond it a logit of a
/// few tens divided or multiplied by the penalty leaves f32.
pub const REPETITION_PENALTY_RANGE: std::ops::RangeInclusive<f32> = 0.01..=100.0;

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }

    /// Whether logits change before `distribution` (penalties or a logit
    /// bias): then every p, greedy or not, goes through `apply_penalties`.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
    }

    /// Reject out-of-range values, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |f: &'static str, why: &str| Err(SpecdError::invalid_field(f, why));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", "must be a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "must be in [0, 1]");
        }
        if !REPETITION_PENALTY_RANGE.contains(&self.repetition_penalty) {
            return bad("repetition_penalty", "must be in [0.01, 100]");
        }
        if !self.presence_penalty.is_finite() || self.presence_penalty.abs() > 2.0 {
            return bad("presence_penalty", "must be in [-2, 2]");
        }
        if !self.frequency_penalty.is_finite() || self.frequency_penalty.abs() > 2.0 {
            return bad("frequency_penalty", "must be in [-2, 2]");
        }
        if self
            .logit_bias
            .iter()
            .any(|&(_, b)| !b.is_finite() || b.abs() > 100.0)
        {
            return bad("logit_bias", "each bias must be in [-100, 100]");
        }
        Ok(())
    }

    /// The same request with temperatures below `MIN_TEMPERATURE` made
    /// greedy (0), so the engine and every plugin agree it is greedy.
    pub fn normalized(mut self) -> Self {
        if self.temperature < MIN_TEMPERATURE {
            self.temperature = 0.0;
        }
        self
    }
}

/// The seed a proposer draws its draft with for a request seeded `seed`
/// whose sequence has `committed` tokens: a stream apart from the
/// engine's own (acceptance and resampling draw from streams seeded by
/// draws of `Rng::new(seed)`, one a position), so a
/// plugin that seeds its generator from the request's seed never replays
/// the numbers that test its draft (rejection sampling needs the two
/// independent). Plugins seed a sequence's generator when they first see
/// it, and see it again from the start after a preemption or a restart
/// of their process: the committed length, which only grows while tokens
/// are emitted, gives that generator a new stream, so no number whose
/// draw an emitted token already reveals is drawn again.
pub fn draft_seed(seed: u64, committed: usize) -> u64 {
    let len = (committed as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    Rng::new(seed ^ 0xD2AF_7000_5EED_0001 ^ len).next_u64()
}

/// xoshiro256** seeded through splitmix64: small, fast, reproducible.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Self {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A normalised distribution over its support. `ids[0]` is the most
/// probable token and `ids` are sorted by probability (descending, ties by
/// id) at least as far as any truncation (top-k, top-p, min-p) needed; a
/// temperature-only distribution keeps its far tail (each token under 1e-6
/// of the mass) unsorted, in id order, after the sorted head. Tokens
/// outside `ids` have probability 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Distribution {
    pub ids: Vec<u32>,
    pub probs: Vec<f32>,
}

impl Distribution {
    pub fn one_hot(id: u32) -> Self {
        Self {
            ids: vec![id],
            probs: vec![1.0],
        }
    }

    pub fn prob(&self, id: u32) -> f32 {
        self.ids
            .iter()
            .position(|&i| i == id)
            .map(|p| self.probs[p])
            .unwrap_or(0.0)
    }

    /// Dense copy over `vocab` entries.
    pub fn dense(&self, vocab: usize) -> Vec<f32> {
        let mut d = vec![0f32; vocab];
        for (&i, &p) in self.ids.iter().zip(&self.probs) {
            d[i as usize] = p;
        }
        d
    }

    pub fn sample(&self, rng: &mut Rng) -> u32 {
        let u = rng.next_f64();
        let mut cum = 0f64;
        for (&id, &p) in self.ids.iter().zip(&self.probs) {
            cum += p as f64;
            if u < cum {
                return id;
            }
        }
        // Rounding at the top end (the f32 masses sum short of u): the last
        // token with mass, never one the law gives 0 (a zero-weight tail
        // under top-k, a masked token).
        self.ids
            .iter()
            .zip(&self.probs)
            .rev()
            .find(|&(_, &p)| p > 0.0)
            .map_or_else(
                || *self.ids.last().expect("distribution has support"),
                |(&id, _)| id,
            )
    }
}

/// Index of the largest logit (lowest index on ties).
/// NaN entries never win (unless every entry is NaN: then 0).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    if logits.get(best).is_some_and(|v| v.is_nan()) {
        // `v > NaN` is never true: start again from the first number.
        if let Some(first) = logits.iter().position(|v| !v.is_nan()) {
            best = first;
            for (i, &v) in logits.iter().enumerate().skip(first) {
                if v > logits[best] {
                    best = i;
                }
            }
        }
    }
    best as u32
}

/// Apply repetition (over `context`: prompt and output), presence and
/// frequency (over `generated`) penalties in place, then the logit bias.
pub fn apply_penalties(logits: &mut [f32], context: &[u32], generated: &[u32], p: &SamplingParams) {
    if p.repetition_penalty != 1.0 {
        let mut seen = std::collections::HashSet::new();
        for &t in context {
            if seen.insert(t) {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts = std::collections::HashMap::new();
        for &t in generated {
            *counts.entry(t).or_insert(0u32) += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
    }
    for &(t, b) in &p.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
}

/// Give `ids` probability 0 (logit -inf) before any other transform;
/// ids past the vocabulary are ignored.
pub fn suppress(logits: &mut [f32], ids: &[u32]) {
    for &t in ids {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Tokens below this share of the mass are left out of the sort (they
/// stay in the support, after the sorted ones, in id order).
const SORTED_MASS_FLOOR: f64 = 1e-6;

/// The target distribution for already-penalised `logits`.
///
/// Cost: one vectorised f32 `exp` per vocabulary entry and sums in f64;
/// sorting is limited to what the transforms need (the top-k survivors,
/// the nucleus candidates, the min-p survivors, or with temperature alone
/// the tokens above `SORTED_MASS_FLOOR` of the mass). `exp` underflows to
/// an exact 0 below e^-87.3 of the most probable token; such tokens (each
/// under 1e-37 of the mass) are outside the support.
pub fn distribution(logits: &[f32], p: &SamplingParams) -> Distribution {
    if p.is_greedy() {
        return Distribution::one_hot(argmax(logits));
    }
    let inv_t = 1.0 / p.temperature;
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let w: Vec<f32> = logits
        .iter()
        .map(|&l| crate::kernels::exp_f32((l - max) * inv_t))
        .collect();
    let total = sum_f64(&w);
    if !(total.is_finite() && total > 0.0) {
        // Logits that are not all finite (an infinite or NaN logit, or a
        // temperature too small for `1 / temperature`): the limit of the
        // distribution is the top logit.
        return Distribution::one_hot(argmax(logits));
    }
    let by_weight = |a: &u32, b: &u32| w[*b as usize].total_cmp(&w[*a as usize]).then(a.cmp(b));
    let top_k = p.top_k > 0 && p.top_k < w.len();
    let mut cand: Vec<u32> = if top_k {
        let mut idx: Vec<u32> = (0..w.len() as u32).collect();
        idx.select_nth_unstable_by(p.top_k - 1, by_weight);
        idx.truncate(p.top_k);
        idx.sort_unstable_by(by_weight);
        idx
    } else if p.top_p < 1.0 {
        // Only tokens above a threshold can be in the nucleus once the mass
        // above it reaches top_p: lower the threshold until it does.
        let mut thr = total * 1e-3;
        // Ends: `total` is finite and positive (checked above).
        loop {
            let mass: f64 = w
                .iter()
                .filter(|&&x| f64::from(x) >= thr)
                .map(|&x| f64::from(x))
                .sum();
            if mass >= p.top_p as f64 * total || thr < total * 1e-12 {
                break;
            }
            thr *= 0.1;
        }
        let mut c: Vec<u32> = (0..w.len() as u32)
            .filter(|&i| f64::from(w[i as usize]) >= thr)
            .collect();
        c.sort_unstable_by(by_weight);
        c
    } else if p.min_p > 0.0 {
        // The most probable token has weight e^0 = 1.
        let thr = p.min_p;
        let mut c: Vec<u32> = (0..w.len() as u32)
            .filter(|&i| w[i as usize] >= thr)
            .collect();
        c.sort_unstable_by(by_weight);
        c
    } else {
        // Temperature alone: the whole support; sorted where the mass is.
        let floor = total * SORTED_MASS_FLOOR;
        let mut head: Vec<u32> = Vec::new();
        let mut tail: Vec<u32> = Vec::new();
        for (i, &x) in w.iter().enumerate() {
            if f64::from(x) >= floor {
                head.push(i as u32);
            } else if x > 0.0 {
                tail.push(i as u32);
            }
        }
        head.sort_unstable_by(by_weight);
        head.extend_from_slice(&tail);
        head
    };
    // top-p applies to the top-k survivors (renormalised) when top-k is on,
    // else to the whole vocabulary (the threshold only pruned the tail).
    let mass_k: f64 = if top_k {
        cand.iter().map(|&i| f64::from(w[i as usize])).sum()
    } else {
        total
    };
    if p.top_p < 1.0 {
        let target = p.top_p as f64 * mass_k;
        let mut cum = 0.0;
        let mut keep = cand.len();
        for (n, &i) in cand.iter().enumerate() {
            cum += f64::from(w[i as usize]);
            if cum >= target {
                keep = n + 1;
                break;
            }
        }
        cand.truncate(keep.max(1));
    }
    if let (true, Some(&top)) = (p.min_p > 0.0, cand.first()) {
        let thr = w[top as usize] * p.min_p;
        cand.retain(|&i| w[i as usize] >= thr);
    }
    let z: f64 = if cand.len() == w.len() {
        total
    } else {
        cand.iter().map(|&i| f64::from(w[i as usize])).sum()
    };
    let inv_z = 1.0 / z;
    let probs = cand
        .iter()
        .map(|&i| (f64::from(w[i as usize]) * inv_z) as f32)
        .collect();
    Distribution { ids: cand, probs }
}

/// Sum of `w` in f64, in 8 fixed lanes (vectorises; a fixed order, so the
/// same logits always give the same distribution).
fn sum_f64(w: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = w.chunks_exact(8);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] += f64::from(c[l]);
        }
    }
    acc.iter().sum::<f64>() + rem.iter().map(|&x| f64::from(x)).sum::<f64>()
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS token or a stop string.
    Stop,
    /// max_tokens reached.
    Length,
    Aborted,
}

/// One stop string's matcher (Knuth-Morris-Pratt over its bytes): `state`
/// is how long a prefix of it the text seen so far ends with, advanced a
/// byte at a time, so every occurrence, overlapping ones included, is seen
/// where it ends, in time linear in the text.
#[derive(Debug, Clone)]
struct StopMatcher {
    stop: Vec<u8>,
    /// `fail[i]`: the longest proper prefix of `stop[..=i]` that is also
    /// its suffix.
    fail: Vec<usize>,
    state: usize,
}

impl StopMatcher {
    fn new(stop: &str) -> Self {
        let stop = stop.as_bytes().to_vec();
        let mut fail = vec![0; stop.len()];
        let mut k = 0;
        for i in 1..stop.len() {
            while k > 0 && stop[i] != stop[k] {
                k = fail[k - 1];
            }
            if stop[i] == stop[k] {
                k += 1;
            }
            fail[i] = k;
        }
        Self {
            stop,
            fail,
            state: 0,
        }
    }

    /// Feed one byte; true when an occurrence ends with it.
    fn feed(&mut self, b: u8) -> bool {
        if self.state == self.stop.len() {
            self.state = self.fail[self.state - 1];
        }
        while self.state > 0 && self.stop[self.state] != b {
            self.state = self.fail[self.state - 1];
        }
        if self.stop[self.state] == b {
            self.state += 1;
        }
        self.state == self.stop.len()
    }

    /// The longest proper prefix of the stop string the text ends with.
    fn partial(&self) -> usize {
        if self.state == self.stop.len() {
            self.fail[self.state - 1]
        } else {
            self.state
        }
    }
}

/// Holds back streamed text that could still become a stop string, so a
/// stop string split across tokens is caught and never emitted. Matching
/// costs time linear in the text (`StopMatcher`): a long stop string with
/// a self-similar prefix costs no more per token than a short one.
#[derive(Debug, Clone, Default)]
pub struct StopBuffer {
    matchers: Vec<StopMatcher>,
    pending: String,
    stopped: bool,
}

impl StopBuffer {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            matchers: stops
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| StopMatcher::new(s))
                .collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Add decoded text; returns the text now safe to emit.
    pub fn push(&mut self, text: &str) -> String {
        self.push_checked(text, true)
    }

    /// `push`, where `check` says whether a stop string may end here
    /// (vLLM's `min_tokens` holds stop strings back until that many tokens
    /// exist): unchecked text is emitted but for the part that could
    /// still begin a stop string, and a later checked push stops only at
    /// a stop string ending in its own text.
    pub fn push_checked(&mut self, text: &str, check: bool) -> String {
        if self.stopped {
            return String::new();
        }
        let fresh = self.pending.len();
        self.pending.push_str(text);
        // The earliest start among the stop strings' first occurrences
        // ending in `text` (each matcher sees every byte once).
        let mut first: Option<usize> = None;
        for m in &mut self.matchers {
            let mut found = false;
            for (j, &b) in text.as_bytes().iter().enumerate() {
                if m.feed(b) && check && !found {
                    found = true;
                    let start = fresh + j + 1 - m.stop.len();
                    first = Some(first.map_or(start, |f| f.min(start)));
                }
            }
        }
        if let Some(i) = first {
            // A UTF-8 stop string starts on a character boundary.
            self.stopped = true;
            let out = self.pending[..i].to_string();
            self.pending.clear();
            return out;
        }
        // The longest suffix of pending that is a proper prefix of some
        // stop string (it starts on a character boundary, as the stop
        // string does).
        let hold = self
            .matchers
            .iter()
            .map(StopMatcher::partial)
            .max()
            .unwrap_or(0)
            .min(self.pending.len());
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        out
    }

    /// End of generation without a stop: release what was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draw_past_the_rounded_total_takes_the_last_token_with_mass() {
        // Masses summing short of 1 (f32 rounding, exaggerated), the tail
        // at zero (top-k over a masked or underflowed row).
        let d = Distribution {
            ids: vec![4, 9, 7],
            probs: vec![0.25, 0.25, 0.0],
        };
        let mut rng = Rng::new(3);
        let mut past = 0;
        for _ in 0..2000 {
            let x = d.sample(&mut rng);
            assert_ne!(x, 7, "a token of mass 0 was drawn");
            past += usize::from(x == 9);
        }
        // About half the draws land past 0.5 and must fall back to id 9.
        assert!(past > 1200, "{past}");
    }

    #[test]
    fn a_proposer_draws_from_a_stream_apart_from_the_engines() {
        // Plugins seed their generators from the seed the host hands them
        // (eagle-core: option ^ seed * golden, the option 0 by default);
        // the engine tests their drafts with streams seeded by draws of
        // `Rng::new(request seed)`, one a position. The two must never be
        // the same stream, seed 0 included.
        for seed in (0..1000u64).chain([u64::MAX, 1 << 63]) {
            for committed in [0, 1, 17, 4096] {
                let handed = draft_seed(seed, committed);
                assert_ne!(handed, seed);
                let plugin = handed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let (mut a, mut b) = (Rng::new(seed), Rng::new(plugin));
                let mut at = Rng::new(Rng::new(seed).next_u64());
                let first = b.next_u64();
                assert_ne!(a.next_u64(), first, "seed {seed}");
                assert_ne!(at.next_u64(), first, "seed {seed}");
            }
        }
        // A sequence seen again from the start (a preemption, a plugin
        // process restarted) with more tokens committed draws anew.
        let streams: std::collections::HashSet<u64> =
            (0..10_000).map(|n| draft_seed(42, n)).collect();
        assert_eq!(streams.len(), 10_000);
    }

    fn params(t: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            ..Default::default()
        }
    }

    #[test]
    fn logits_or_temperatures_that_leave_f32_give_the_top_token() {
        // 1 / 1e-40 is infinite in f32; an infinite or NaN logit makes the
        // weights NaN. Every transform then returns the top logit, and
        // never loops or returns an empty support.
        let logits = [0.5f32, 2.0, 1.0, -3.0];
        for p in [
            SamplingParams {
                top_p: 0.9,
                ..params(1e-40)
            },
            SamplingParams {
                min_p: 0.2,
                ..params(1e-40)
            },
            SamplingParams {
                top_k: 3,
                ..params(1e-40)
            },
            params(1e-40),
        ] {
            assert_eq!(distribution(&logits, &p), Distribution::one_hot(1), "{p:?}");
        }
        let p = SamplingParams {
            top_p: 0.9,
            ..params(0.7)
        };
        let inf = [0.5f32, f32::INFINITY, 1.0];
        assert_eq!(distribution(&inf, &p), Distribution::one_hot(1));
        let nan = [f32::NAN, 0.5, 2.0, 1.0];
        assert_eq!(distribution(&nan, &p), Distribution::one_hot(2));
        assert_eq!(argmax(&nan), 2, "NaN never wins");
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        // Requests below MIN_TEMPERATURE are made greedy before they run;
        // penalties that would push logits out of f32 are refused.
        assert!(params(1e-6).normalized().is_greedy());
        assert!(!params(1e-4).normalized().is_greedy());
        let rp = |r: f32| SamplingParams {
            repetition_penalty: r,
            ..params(0.7)
        };
        for bad in [1e-39, 0.0, 1e3, f32::NAN] {
            let e = rp(bad).validate().unwrap_err().to_string();
            assert!(e.contains("repetition_penalty"), "{e}");
        }
        assert!(rp(1.3).validate().is_ok());
    }

    #[test]
    fn greedy_is_argmax_with_low_index_ties() {
        let d = distribution(&[0.1, 3.0, 3.0, -1.0], &params(0.0));
        assert_eq!(d, Distribution::one_hot(1));
    }

    #[test]
    fn temperature_matches_softmax() {
        let logits = [1.0f32, 2.0, 0.5];
        let d = distribution(&logits, &params(0.5));
        let e: Vec<f64> = logits.iter().map(|&l| ((l as f64) / 0.5).exp()).collect();
        let z: f64 = e.iter().sum();
        for (i, &x) in e.iter().enumerate() {
            assert!((d.prob(i as u32) as f64 - x / z).abs() < 1e-6);
        }
    }

    /// Temperature alone: every token is in the support with its softmax
    /// probability, the most probable first and the head sorted.
    #[test]
    fn temperature_alone_keeps_the_whole_vocabulary() {
        let logits: Vec<f32> = (0..49152)
            .map(|i| ((i as f32) * 0.7391).sin() * 9.0)
            .collect();
        let d = distribution(&logits, &params(0.7));
        assert_eq!(d.ids.len(), logits.len());
        let e: Vec<f64> = logits.iter().map(|&l| (f64::from(l) / 0.7).exp()).collect();
        let z: f64 = e.iter().sum();
        let dense = d.dense(logits.len());
        for (i, &x) in e.iter().enumerate() {
            assert!((f64::from(dense[i]) - x / z).abs() < 1e-7 * (1.0 + x / z * 1e3));
        }
        assert_eq!(d.ids[0], argmax(&logits));
        let sorted_head = d
            .probs
            .iter()
            .take_while(|&&p| f64::from(p) >= 1e-6)
            .count();
        assert!(sorted_head > 10);
        assert!(d.probs[..sorted_head].windows(2).all(|w| w[0] >= w[1]));
        let sum: f64 = d.probs.iter().map(|&p| f64::from(p)).sum();
        assert!((sum - 1.0).abs() < 1e-5);
    }

    #[test]
    fn top_p_keeps_smallest_nucleus_with_enough_mass() {
        // probs 0.5, 0.25, 0.125, 0.0625, 0.0625
        let logits: Vec<f32> = [0.5f32, 0.25, 0.125, 0.0625, 0.0625]
            .iter()
            .map(|p| p.ln())
            .collect();
        let mut p = params(1.0);
        p.top_p = 0.7;
        let d = distribution(&logits, &p);
        assert_eq!(d.ids, vec![0, 1]);
        assert!((d.probs[0] - 2.0 / 3.0).abs() < 1e-6 && (d.probs[1] - 1.0 / 3.0).abs() < 1e-6);
        p.top_p = 0.75;
        assert_eq!(distribution(&logits, &p).ids, vec![0, 1]);
        p.top_p = 0.76;
        assert_eq!(distribution(&logits, &p).ids, vec![0, 1, 2]);
        // Kept mass is at least top_p of the whole on a large vocabulary.
        let big: Vec<f32> = (0..5000).map(|i| -(i as f32) * 0.003).collect();
        p.top_p = 0.9;
        let d = distribution(&big, &p);
        let w: Vec<f64> = big.iter().map(|&l| (l as f64).exp()).collect();
        let z: f64 = w.iter().sum();
        let kept: f64 = d.ids.iter().map(|&i| w[i as usize]).sum::<f64>() / z;
        let without_last = kept - w[*d.ids.last().unwrap() as usize] / z;
        assert!(
            kept >= 0.9 - 1e-9 && without_last < 0.9,
            "{kept} {without_last}"
        );
    }

    #[test]
    fn top_k_and_min_p_truncate() {
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let mut p = params(1.0);
        p.top_k = 2;
        assert_eq!(distribution(&logits, &p).ids, vec![0, 1]);
        p.top_k = 0;
        p.min_p = 0.3; // e^-1 = 0.37 survives, e^-2 = 0.135 does not
        assert_eq!(distribution(&logits, &p).ids, vec![0, 1]);
    }

    #[test]
    fn seeded_sampling_reproduces_and_differs_across_seeds() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let d = distribution(&logits, &params(1.0));
        let run = |seed| {
            let mut r = Rng::new(seed);
            (0..50).map(|_| d.sample(&mut r)).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn sample_frequencies_follow_the_distribution() {
        let d = Distribution {
            ids: vec![3, 1, 2],
            probs: vec![0.6, 0.3, 0.1],
        };
        let mut r = Rng::new(7);
        let mut c = [0usize; 4];
        for _ in 0..20000 {
            c[d.sample(&mut r) as usize] += 1;
        }
        assert!((c[3] as f64 / 20000.0 - 0.6).abs() < 0.02);
        assert!((c[2] as f64 / 20000.0 - 0.1).abs() < 0.01);
    }

    #[test]
    fn penalties_follow_their_definitions() {
        let mut l = vec![2.0f32, -2.0, 1.0, 1.0];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..params(1.0)
        };
        apply_penalties(&mut l, &[0, 1, 0], &[2, 2], &p);
        assert_eq!(l, vec![1.0, -4.0, 1.0 - 0.5 - 0.5, 1.0]);
    }

    /// Unchecked text (before `min_tokens`) never stops, even when a stop
    /// string lies in it whole; a stop string begun there and ended in
    /// checked text does.
    #[test]
    fn unchecked_text_holds_stop_strings_back() {
        let mut b = StopBuffer::new(vec!["ab".into(), "xabc".into()]);
        assert_eq!(b.push_checked("1ab2", false), "1ab2");
        // "xab" could begin "xabc": held, though it holds "ab" whole.
        assert_eq!(b.push_checked("xab", false), "");
        assert!(!b.stopped());
        // Checked: "ab" inside the held text does not count; "xabc"
        // ends here.
        assert_eq!(b.push_checked("c", true), "");
        assert!(b.stopped());
        let mut b = StopBuffer::new(vec!["ab".into(), "xabc".into()]);
        b.push_checked("xab", false);
        assert_eq!(b.push_checked("d", true), "xabd");
        assert!(!b.stopped());
        assert_eq!(b.push_checked("a", true), "");
        assert_eq!(b.push_checked("b", true), "");
        assert!(b.stopped());
        // A stop string held whole in unchecked text hides no overlapping
        // one that ends in checked text: "\n\n" + "\n" stops at 1.
        let mut b = StopBuffer::new(vec!["\n\n".into(), "\n\nQ:".into()]);
        assert_eq!(b.push_checked("A\n\n", false), "A");
        assert_eq!(b.push_checked("\n", true), "\n");
        assert!(b.stopped());
        // Multi-byte text: a stop string begun in unchecked text and
        // ended in checked text, and one wholly unchecked.
        let mut b = StopBuffer::new(vec!["€é".into()]);
        assert_eq!(b.push_checked("é€", false), "é");
        assert_eq!(b.push_checked("é€", true), "");
        assert!(b.stopped());
        let mut b = StopBuffer::new(vec!["é€".into()]);
        assert_eq!(b.push_checked("aé€", false), "aé€");
        assert_eq!(b.push_checked("xé", true), "x");
        assert_eq!(b.push_checked("€", true), "");
        assert!(b.stopped());
    }

    /// The matcher against a naive search: every stop string's occurrences
    /// (overlapping included) and the held-back length, over random texts
    /// pushed in random pieces.
    #[test]
    fn stop_matching_agrees_with_a_naive_search() {
        let mut rng = Rng::new(11);
        let alphabet = ['a', 'b', 'é'];
        let word = |rng: &mut Rng, n: usize| -> String {
            (0..n)
                .map(|_| alphabet[(rng.next_u64() % 3) as usize])
                .collect()
        };
        for _ in 0..400 {
            let stops: Vec<String> = (0..2)
                .map(|_| {
                    let n = 1 + (rng.next_u64() % 4) as usize;
                    word(&mut rng, n)
                })
                .collect();
            let text = word(&mut rng, 24);
            let min = (rng.next_u64() % 10) as usize;
            // Pieces of one character each; the first `min` unchecked.
            let mut b = StopBuffer::new(stops.clone());
            let mut out = String::new();
            let mut seen = String::new();
            let mut want_stop = None;
            for (k, c) in text.chars().enumerate() {
                let fresh = seen.len();
                seen.push(c);
                if k >= min && want_stop.is_none() {
                    want_stop = stops
                        .iter()
                        .filter_map(|s| {
                            (0..seen.len())
                                .filter(|&i| seen.is_char_boundary(i))
                                .find(|&i| seen[i..].starts_with(s.as_str()) && i + s.len() > fresh)
                        })
                        .min();
                }
                out.push_str(&b.push_checked(&c.to_string(), k >= min));
                if b.stopped() {
                    break;
                }
            }
            match want_stop {
                Some(i) => {
                    assert!(b.stopped(), "{stops:?} {text:?} {min}");
                    assert_eq!(out, seen[..i], "{stops:?} {text:?} {min}");
                }
                None => {
                    assert!(!b.stopped(), "{stops:?} {text:?} {min}");
                    out.push_str(&b.finish());
                    assert_eq!(out, text, "{stops:?} {text:?} {min}");
                }
            }
        }
    }

    #[test]
    fn stop_string_split_across_tokens_is_caught() {
        let mut s = StopBuffer::new(vec!["</end>".into()]);
        let mut out = String::new();
        for piece in ["Hello", " wor", "ld<", "/e", "nd> tail"] {
            out += &s.push(piece);
        }
        assert!(s.stopped());
        assert_eq!(out, "Hello world");
        // A held-back partial match is released when it turns out not to be one.
        let mut s = StopBuffer::new(vec!["STOP".into()]);
        assert_eq!(s.push("abcST"), "abc");
        assert_eq!(s.push("x"), "STx");
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn validation_names_the_field() {
        let p = SamplingParams {
            top_p: 1.5,
            ..Default::default()
        };
        assert!(p.validate().unwrap_err().to_string().contains("top_p"));
        let p = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert!(p
            .validate()
            .unwrap_err()
            .to_string()
            .contains("temperature"));
    }
}
