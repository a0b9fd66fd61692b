//! Test-only proposers: an oracle with an error rate, a random full-q
//! proposer, one that panics.

use super::*;

/// Replays a known continuation of each prompt, replacing each drafted token
/// with a wrong one with probability `error_rate`.
pub struct OracleProposer {
    pub answers: std::collections::HashMap<Vec<u32>, Vec<u32>>,
    pub error_rate: f64,
    pub max_draft: usize,
    pub vocab: u32,
    prompts: std::collections::HashMap<SeqId, usize>,
    rng: Rng,
    /// Wall time every propose call spends before drafting (a slow
    /// proposer's own model, for pricing tests).
    delay: Option<std::time::Duration>,
    /// Bytes per token of a per-sequence cache it declares (none kept).
    cache_bytes: usize,
}

impl OracleProposer {
    /// The same oracle, declaring a per-sequence cache of `bytes` a token
    /// (`Capabilities::kv_bytes_per_token`), as a draft model does.
    pub fn with_cache_bytes(mut self, bytes: usize) -> Self {
        self.cache_bytes = bytes;
        self
    }

    /// The same oracle, spending `delay` in every propose call.
    pub fn with_delay(mut self, delay: std::time::Duration) -> Self {
        self.delay = Some(delay);
        self
    }

    pub fn new(
        answers: Vec<(Vec<u32>, Vec<u32>)>,
        error_rate: f64,
        max_draft: usize,
        vocab: u32,
    ) -> Self {
        Self {
            answers: answers.into_iter().collect(),
            error_rate,
            max_draft,
            vocab,
            prompts: Default::default(),
            rng: Rng::new(99),
            delay: None,
            cache_bytes: 0,
        }
    }
}

impl Proposer for OracleProposer {
    fn name(&self) -> &str {
        "oracle"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            max_draft: self.max_draft,
            kv_bytes_per_token: self.cache_bytes,
            ..Default::default()
        }
    }
    fn start(&mut self, seq: SeqId, prompt: &[u32]) -> Result<(), String> {
        // On resume after preemption `prompt` includes earlier output; find
        // the original prompt as the longest known prefix.
        let len = self
            .answers
            .keys()
            .filter(|p| prompt.starts_with(p))
            .map(|p| p.len())
            .max()
            .ok_or("unknown prompt")?;
        self.prompts.insert(seq, len);
        Ok(())
    }
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
        if let Some(d) = self.delay {
            std::thread::sleep(d);
        }
        let mut out = Vec::new();
        for b in batch {
            let plen = self.prompts[&b.seq];
            let answer = &self.answers[&b.tokens[..plen]];
            let pos = b.tokens.len() - plen;
            let mut tokens: Vec<u32> = answer.iter().skip(pos).take(b.max_draft).copied().collect();
            for t in tokens.iter_mut() {
                if self.rng.next_f64() < self.error_rate {
                    *t = (*t + 1 + (self.rng.next_u64() % (self.vocab as u64 - 1)) as u32)
                        % self.vocab;
                }
            }
            out.push(Draft {
                q: vec![DraftQ::OneHot; tokens.len()],
                tokens,
                parents: None,
                source: None,
            });
        }
        Ok(out)
    }
    fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
        Ok(())
    }
    fn finish(&mut self, seq: SeqId) {
        self.prompts.remove(&seq);
    }
}

/// Drafts from a random full distribution q (fresh each position), so that
/// acceptance exercises min(1, p/q) and the residual with a real q.
pub struct RandomProposer {
    pub vocab: usize,
    pub max_draft: usize,
    rng: Rng,
}

impl RandomProposer {
    pub fn new(vocab: usize, max_draft: usize, seed: u64) -> Self {
        Self {
            vocab,
            max_draft,
            rng: Rng::new(seed),
        }
    }
}

impl Proposer for RandomProposer {
    fn name(&self) -> &str {
        "random"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            q_kind: QKind::Full,
            max_draft: self.max_draft,
            ..Default::default()
        }
    }
    fn start(&mut self, _: SeqId, _: &[u32]) -> Result<(), String> {
        Ok(())
    }
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
        let mut out = Vec::new();
        for b in batch {
            let mut d = Draft::default();
            for _ in 0..b.max_draft {
                // Peaked random q: cubes of uniforms, normalised.
                let w: Vec<f64> = (0..self.vocab)
                    .map(|_| self.rng.next_f64().powi(3))
                    .collect();
                let z: f64 = w.iter().sum();
                let q: Vec<f32> = w.iter().map(|x| (x / z) as f32).collect();
                let u = self.rng.next_f64();
                let mut cum = 0.0;
                let mut tok = (self.vocab - 1) as u32;
                for (i, &p) in q.iter().enumerate() {
                    cum += p as f64;
                    if u < cum {
                        tok = i as u32;
                        break;
                    }
                }
                d.tokens.push(tok);
                d.q.push(DraftQ::Full(q.into()));
            }
            out.push(d);
        }
        Ok(out)
    }
    fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
        Ok(())
    }
    fn finish(&mut self, _: SeqId) {}
}

/// Reports a peaked random full q per drafted token, as `RandomProposer`,
/// but drafts that q's most likely token instead of drawing from it: a
/// plugin whose reported q is not what it drew from.
pub struct LyingProposer(pub RandomProposer);

impl Proposer for LyingProposer {
    fn name(&self) -> &str {
        "liar"
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    fn start(&mut self, seq: SeqId, prompt: &[u32]) -> Result<(), String> {
        self.0.start(seq, prompt)
    }
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
        let mut drafts = self.0.propose(batch)?;
        for d in &mut drafts {
            for (t, q) in d.tokens.iter_mut().zip(&d.q) {
                if let DraftQ::Full(q) = q {
                    *t = (0..q.len())
                        .max_by(|&a, &b| q[a].total_cmp(&q[b]))
                        .unwrap_or(0) as u32;
                }
            }
        }
        Ok(drafts)
    }
    fn observe(&mut self, seq: SeqId, committed: &[u32], path: &[usize]) -> Result<(), String> {
        self.0.observe(seq, committed, path)
    }
    fn finish(&mut self, seq: SeqId) {
        self.0.finish(seq)
    }
}

/// Panics on its second propose call.
#[derive(Default)]
pub struct PanickyProposer {
    calls: usize,
}

impl PanickyProposer {
    pub fn new() -> Self {
        Self { calls: 0 }
    }
}

impl Proposer for PanickyProposer {
    fn name(&self) -> &str {
        "panicky"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
    fn start(&mut self, _: SeqId, _: &[u32]) -> Result<(), String> {
        Ok(())
    }
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
        self.calls += 1;
        if self.calls == 2 {
            panic!("deliberate test panic in propose");
        }
        Ok(batch
            .iter()
            .map(|b| Draft {
                tokens: vec![b.tokens[b.tokens.len() - 1]; b.max_draft],
                q: vec![DraftQ::OneHot; b.max_draft],
                parents: None,
                source: None,
            })
            .collect())
    }
    fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
        Ok(())
    }
    fn finish(&mut self, _: SeqId) {}
}
