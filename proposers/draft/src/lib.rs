//! A standalone draft model as a proposer plugin.
//!
//! Loads any Llama-family GGUF or safetensors model with the engine's own
//! model code (this crate links `specd`; nothing is copied), keeps a KV
//! cache per sequence with rollback, and drafts for every sequence of a
//! batch in one forward per draft position. Under greedy requests it drafts
//! the draft model's argmax (q one-hot); under sampling it samples from its
//! own distribution after the request's temperature / top-k / top-p / min-p
//! and returns that full q, so the host's rejection sampling stays lossless.
//!
//! Two kinds of draft load:
//! - a plain model (GGUF file or safetensors directory) with the target's
//!   vocabulary and its own tokenizer;
//! - a *compact* draft (`specd distill draft` with a draft vocabulary;
//!   `"embed_from_target": true` in its config.json): its input embedding
//!   is the target's (asked of the host once, at load) through the shipped
//!   projection `model.embed_proj.weight`, and its head covers only
//!   `draft_vocab_size` tokens, mapped to target ids by `d2t`
//!   (`target = i + d2t[i]`). Tokens outside the draft vocabulary get
//!   q = 0 and are never drafted, which rejection sampling allows.
//!
//! Two modes (`mode`):
//! - `chain` (default): autoregressive, one draft forward per drafted
//!   token;
//! - `parallel` (PARD): a compact draft trained with `--parallel K` drafts
//!   up to K tokens in one forward, the last real token followed by K - 1
//!   mask tokens (the draft's learned mask embedding); the masks' cache
//!   entries are dropped by the next catch-up, which feeds the accepted
//!   tokens instead. Each position's q is its own row's distribution
//!   (independent of the tokens drafted before it, which rejection
//!   sampling allows). Configure it as a second `[[proposer]]` beside the
//!   chain one, and requests pick either by name.
//!
//! Options: `model` (path; `~/` is expanded; unset: the compact draft
//! trained for SmolLM2-135M-Instruct, compiled in), `mode` (`chain`),
//! `threads` (2), `max_draft` (4), `quantize` (true: F32 matrices to Q8_0
//! at load), `window` (the most tokens one catch-up feeds, default 256; 0:
//! all).
//!
//! Invariant: the draft shares the target's vocabulary: same size and the
//! same token string for every id (checked at creation: id by id against a
//! plain draft's tokenizer, by the fingerprint a compact draft records).

use std::collections::HashMap;
use std::path::PathBuf;

use specd_model::sampler::{self, Rng, SamplingParams};
use specd_model::tokenizer::Tokenizer;
use specd_model::{ForwardInput, KvCache, Logits, Model};
use specd_plugin_sdk::{abi, Caps, Host, Options, Plugin, Proposal, SeqView, Q};

struct SeqState {
    cache: KvCache,
    /// Tokens whose KV entries the cache holds, in order: the cache's view
    /// of the history, `tokens[..sink] ++ tokens[skip_to..]` (all of it
    /// until a catch-up is cut to the window).
    cached: Vec<u32>,
    sink: usize,
    skip_to: usize,
    rng: Rng,
}

/// Tokens kept from the start of the history when a catch-up is cut to
/// the window (the attention sink of StreamingLLM: the first positions,
/// the chat template's system turn, anchor the model's attention).
const SINK: usize = 4;

/// Default `window`: the most tokens one catch-up feeds.
pub const DEFAULT_WINDOW: usize = 256;

/// What a catch-up does: the cache's new view (`sink`, `skip_to`), how
/// much of the cached tokens stays (`keep`), and the tokens to feed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CatchUp {
    sink: usize,
    skip_to: usize,
    keep: usize,
    feed: Vec<u32>,
}

/// The cache view `tokens[..sink] ++ tokens[skip_to..]`, without a copy.
fn view(tokens: &[u32], sink: usize, skip_to: usize) -> impl Iterator<Item = &u32> + Clone {
    tokens[..sink.min(tokens.len())]
        .iter()
        .chain(&tokens[skip_to.min(tokens.len())..])
}

/// Plan a catch-up of a cache holding `cached` (the view `(sink,
/// skip_to)` of an earlier history, maybe with drafted tokens after it)
/// to the history `tokens` (not empty): keep the longest prefix of the
/// view still committed and feed the rest, at least the last token (its
/// logits draft the next). A catch-up longer than `window` (0: unbounded)
/// feeds only the first `SINK` tokens and the newest `window`: a probe
/// after a long pause, or a long prompt, then costs a bounded forward; the
/// draft's positions are compressed and its drafts may be worse, never
/// wrong.
fn plan_catch_up(
    cached: &[u32],
    mut sink: usize,
    mut skip_to: usize,
    tokens: &[u32],
    window: usize,
) -> CatchUp {
    let n = tokens.len();
    sink = sink.min(skip_to);
    if skip_to >= n {
        // The history was cut to the window's start or below: start over
        // (the view would end before the newest token).
        sink = 0;
        skip_to = 0;
    }
    let len = |sink: usize, skip_to: usize| sink.min(n) + n - skip_to.min(n);
    let common = |sink: usize, skip_to: usize| {
        cached
            .iter()
            .zip(view(tokens, sink, skip_to))
            .take_while(|(a, b)| a == b)
            .count()
            .min(len(sink, skip_to).saturating_sub(1))
    };
    let mut keep = common(sink, skip_to);
    if window > 0 && len(sink, skip_to) - keep > window {
        skip_to = n - window;
        sink = SINK.min(skip_to);
        keep = common(sink, skip_to);
    }
    CatchUp {
        sink,
        skip_to,
        keep,
        feed: view(tokens, sink, skip_to).skip(keep).copied().collect(),
    }
}

impl SeqState {
    /// Catch the cache up to `tokens` (see `plan_catch_up`); returns the
    /// tokens to feed.
    fn catch_up(&mut self, tokens: &[u32], window: usize) -> Result<Vec<u32>, String> {
        let plan = plan_catch_up(&self.cached, self.sink, self.skip_to, tokens, window);
        self.cache.truncate(plan.keep).map_err(|e| e.to_string())?;
        self.cached.truncate(plan.keep);
        self.cached.extend_from_slice(&plan.feed);
        self.sink = plan.sink;
        self.skip_to = plan.skip_to;
        Ok(plan.feed)
    }
}

pub struct DraftModel {
    model: Model,
    /// A compact draft's head over its draft vocabulary.
    head: Option<compact::Head>,
    /// Parallel mode (the head holds the mask token and how far).
    parallel: bool,
    /// The target's vocabulary size (a parallel draft's model has one
    /// more row, the mask).
    vocab: usize,
    max_draft: usize,
    window: usize,
    seqs: HashMap<u64, SeqState>,
}

pub mod compact;

/// Check that the draft's vocabulary equals the target's, id by id.
pub fn check_vocab(host: &Host, draft: &Tokenizer, draft_vocab: usize) -> Result<(), String> {
    let target = host.vocab_size();
    if target != draft_vocab {
        return Err(format!(
            "vocabulary mismatch: the draft model has {draft_vocab} tokens, the target {target}"
        ));
    }
    if host.token_text(0).is_none() {
        return Err(
            "cannot check the vocabulary: the host offers no token strings (no target tokenizer)"
                .into(),
        );
    }
    for id in 0..target as u32 {
        let (t, d) = (host.token_text(id), draft.id_to_token(id));
        if t != d {
            return Err(format!(
                "vocabulary mismatch at token {id}: target {:?}, draft {:?}",
                t.unwrap_or_default(),
                d.unwrap_or_default()
            ));
        }
    }
    Ok(())
}

impl DraftModel {
    fn state(&mut self, seq: u64, seed: u64) -> &mut SeqState {
        let model = &self.model;
        self.seqs.entry(seq).or_insert_with(|| SeqState {
            cache: model.new_cache(),
            cached: Vec::new(),
            sink: 0,
            skip_to: 0,
            rng: Rng::new(seed ^ 0xD1A5_7D1A_5700),
        })
    }

    /// PARD: one forward per batch; each sequence feeds its catch-up and
    /// `want - 1` mask tokens, and the last `want` rows (the newest real
    /// token's and the masks') draft its `want` tokens. The masks' cache
    /// entries stay past `cached`, so the next catch-up truncates them.
    fn propose_parallel(
        &mut self,
        batch: &[SeqView<'_>],
        want: &[usize],
        active: &[usize],
        mut feeds: Vec<Vec<u32>>,
        drafts: &mut [Proposal],
    ) -> Result<(), String> {
        let (head, mask) = self
            .head
            .as_ref()
            .and_then(|h| Some((h, h.parallel()?.1)))
            .ok_or("parallel drafting needs a compact draft with a mask embedding")?;
        for (j, &i) in active.iter().enumerate() {
            feeds[j].extend(std::iter::repeat_n(mask, want[i] - 1));
        }
        let mut caches: Vec<KvCache> = Vec::with_capacity(active.len());
        for &i in active {
            let st = self
                .seqs
                .get_mut(&batch[i].seq)
                .expect("state created above");
            let layout = st.cache.layout();
            caches.push(std::mem::replace(&mut st.cache, KvCache::new(layout, 0)));
        }
        let out = {
            let mut inputs: Vec<ForwardInput<'_>> = caches
                .iter_mut()
                .zip(&feeds)
                .map(|(c, f)| ForwardInput {
                    cache: c,
                    tokens: f,
                    logits: Logits::None,
                    tree: None,
                })
                .collect();
            self.model.forward(&mut inputs, &[self.model.config.layers])
        };
        for (&i, c) in active.iter().zip(caches) {
            self.seqs.get_mut(&batch[i].seq).expect("state").cache = c;
        }
        let out = out.map_err(|e| format!("draft forward: {e}"))?;
        let h = self.model.config.hidden;
        for ((&i, o), f) in active.iter().zip(out).zip(&feeds) {
            let s = &batch[i];
            let params = params_of(s);
            let st = self.seqs.get_mut(&s.seq).expect("state");
            let rows = o.hidden.first().map(|(_, r)| r.as_slice()).unwrap_or(&[]);
            if rows.len() != f.len() * h {
                return Err("draft forward returned no final state".into());
            }
            let first = f.len() - want[i];
            for r in first..f.len() {
                let (tok, q) = draw(
                    head,
                    &rows[r * h..(r + 1) * h],
                    &params,
                    &mut st.rng,
                    self.vocab,
                );
                drafts[i].tokens.push(tok);
                drafts[i].q.push(q);
            }
        }
        Ok(())
    }
}

/// One drafted token from a compact draft's final-normed state: the
/// argmax under greedy, else a sample with its full q (over the target's
/// `vocab`, zero outside the draft vocabulary).
fn draw(
    head: &compact::Head,
    state: &[f32],
    params: &SamplingParams,
    rng: &mut Rng,
    vocab: usize,
) -> (u32, Q) {
    let logits = head.logits(state);
    if params.is_greedy() {
        (head.target_id(sampler::argmax(&logits)), Q::OneHot)
    } else {
        let d = sampler::distribution(&logits, params);
        let i = d.sample(rng);
        let dense = d.dense(logits.len());
        (head.target_id(i), Q::Full(head.scatter(&dense, vocab)))
    }
}

fn params_of(s: &SeqView<'_>) -> SamplingParams {
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: s.top_p,
        min_p: s.min_p,
        seed: s.seed,
        ..Default::default()
    }
}

impl Plugin for DraftModel {
    const NAME: &'static str = "draft";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn default_capabilities() -> Caps {
        Caps {
            q_kind: abi::Q_FULL,
            ..Caps::one_hot(4)
        }
    }

    fn create(o: &Options, host: Host) -> Result<Self, String> {
        o.reject_unknown(&[
            "model",
            "mode",
            "threads",
            "max_draft",
            "quantize",
            "window",
        ])?;
        let mode = o.get("mode", "chain".to_string())?;
        if mode != "chain" && mode != "parallel" {
            return Err(format!(
                "option `mode`: {mode:?} is not a mode (\"chain\" or \"parallel\")"
            ));
        }
        let raw = o.get("model", String::new())?;
        let threads = o.get("threads", 2usize)?;
        let (mut model, head, what) = if raw.is_empty() {
            let (m, h) = compact::builtin(&host, threads)?;
            (
                m,
                Some(h),
                "built-in compact draft for SmolLM2-135M-Instruct".to_string(),
            )
        } else {
            let path = match (raw.strip_prefix("~/"), std::env::var_os("HOME")) {
                (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
                _ => PathBuf::from(&raw),
            };
            if compact::is_compact(&path) {
                let (m, h) = compact::load_dir(&path, &host, threads)?;
                (m, Some(h), format!("compact draft {}", path.display()))
            } else {
                let model = specd_model::load_model(&path, threads)
                    .map_err(|e| format!("draft model: {e}"))?;
                let tok =
                    Tokenizer::for_model(&path).map_err(|e| format!("draft tokenizer: {e}"))?;
                check_vocab(&host, &tok, model.config.vocab_size)?;
                (model, None, format!("draft model {}", path.display()))
            }
        };
        let mut max_draft = o.get("max_draft", 4usize)?;
        let parallel = if mode == "parallel" {
            let Some((k, _)) = head.as_ref().and_then(|h| h.parallel()) else {
                return Err(format!(
                    "option `mode = \"parallel\"`: the {what} was not trained for parallel drafting (no `parallel_draft` / `model.mask_embedding`; train one with `specd distill draft --parallel K`)"
                ));
            };
            // One forward drafts at most what the draft was trained for.
            max_draft = max_draft.min(k);
            true
        } else {
            false
        };
        if o.get("quantize", true)? {
            model.quantize_f32_to_q8_0();
        }
        // Several forwards a propose, each from the engine's thread: run
        // them on that thread with helpers, not handed to a sleeping pool.
        model.run_on_caller_pool();
        host.log(
            2,
            &format!(
                "{what} loaded: {} layers, hidden {}{}, {mode} drafting",
                model.config.layers,
                model.config.hidden,
                head.as_ref()
                    .map(|h| format!(", draft vocabulary {}", h.rows()))
                    .unwrap_or_default()
            ),
        );
        Ok(Self {
            model,
            head,
            parallel,
            vocab: host.vocab_size(),
            max_draft,
            window: o.get("window", DEFAULT_WINDOW)?,
            seqs: HashMap::new(),
        })
    }

    fn capabilities(&self) -> Caps {
        Caps {
            q_kind: abi::Q_FULL,
            // The draft model's cache and the cached token, per position.
            kv_bytes_per_token: u32::try_from(
                self.model.kv_bytes_per_token() + std::mem::size_of::<u32>(),
            )
            .unwrap_or(u32::MAX),
            ..Caps::one_hot(self.max_draft as u32)
        }
    }

    fn start(&mut self, seq: u64, _tokens: &[u32]) -> Result<(), String> {
        self.seqs.remove(&seq);
        Ok(())
    }

    fn propose(&mut self, batch: &[SeqView<'_>]) -> Result<Vec<Proposal>, String> {
        let mut drafts: Vec<Proposal> = vec![Proposal::default(); batch.len()];
        let want: Vec<usize> = batch
            .iter()
            .map(|s| s.max_draft.min(self.max_draft))
            .collect();
        let active: Vec<usize> = (0..batch.len())
            .filter(|&i| want[i] > 0 && !batch[i].tokens.is_empty())
            .collect();
        if active.is_empty() {
            return Ok(drafts);
        }
        // Roll each cache back to its longest prefix that is still committed
        // (accepted drafts are kept), then feed the rest of the history.
        let mut feeds: Vec<Vec<u32>> = Vec::with_capacity(active.len());
        let window = self.window;
        for &i in &active {
            let s = &batch[i];
            let st = self.state(s.seq, s.seed);
            feeds.push(st.catch_up(s.tokens, window)?);
        }
        if self.parallel {
            self.propose_parallel(batch, &want, &active, feeds, &mut drafts)?;
            return Ok(drafts);
        }
        let max_k = active.iter().map(|&i| want[i]).max().unwrap_or(0);
        let vocab = self.vocab;
        for step in 0..max_k {
            let mut caches: Vec<(usize, KvCache)> = Vec::new();
            for (j, &i) in active.iter().enumerate() {
                if step < want[i] && !feeds[j].is_empty() {
                    let st = self
                        .seqs
                        .get_mut(&batch[i].seq)
                        .expect("state created above");
                    let layout = st.cache.layout();
                    caches.push((j, std::mem::replace(&mut st.cache, KvCache::new(layout, 0))));
                }
            }
            if caches.is_empty() {
                break;
            }
            let out = {
                // A compact draft reads the final-normed state and applies
                // its own head; a plain one its model's last-row logits.
                let (logits, layers) = match &self.head {
                    Some(_) => (Logits::None, vec![self.model.config.layers]),
                    None => (Logits::Last, Vec::new()),
                };
                let mut inputs: Vec<ForwardInput<'_>> = caches
                    .iter_mut()
                    .map(|(j, c)| ForwardInput {
                        cache: c,
                        tokens: &feeds[*j],
                        logits,
                        tree: None,
                    })
                    .collect();
                self.model.forward(&mut inputs, &layers)
            };
            for (j, c) in caches.iter_mut() {
                let st = self.seqs.get_mut(&batch[active[*j]].seq).expect("state");
                let layout = c.layout();
                st.cache = std::mem::replace(c, KvCache::new(layout, 0));
            }
            let out = out.map_err(|e| format!("draft forward: {e}"))?;
            for ((j, _), o) in caches.iter().zip(out) {
                let i = active[*j];
                let s = &batch[i];
                let params = params_of(s);
                let st = self.seqs.get_mut(&s.seq).expect("state");
                let (tok, q) = match &self.head {
                    Some(head) => {
                        let h = self.model.config.hidden;
                        let rows = o.hidden.first().map(|(_, r)| r.as_slice()).unwrap_or(&[]);
                        if rows.len() < h {
                            return Err("draft forward returned no final state".into());
                        }
                        draw(head, &rows[rows.len() - h..], &params, &mut st.rng, vocab)
                    }
                    None if params.is_greedy() => (sampler::argmax(&o.logits), Q::OneHot),
                    None => {
                        let d = sampler::distribution(&o.logits, &params);
                        let t = d.sample(&mut st.rng);
                        (t, Q::Full(d.dense(o.logits.len())))
                    }
                };
                drafts[i].tokens.push(tok);
                drafts[i].q.push(q);
                // Feed the drafted token next (its KV is written by that forward).
                feeds[*j] = if step + 1 < want[i] {
                    vec![tok]
                } else {
                    Vec::new()
                };
                if step + 1 < want[i] {
                    st.cached.push(tok);
                }
            }
        }
        Ok(drafts)
    }

    fn observe(&mut self, _seq: u64, _tokens: &[u32], _path: &[u32]) -> Result<(), String> {
        Ok(())
    }

    fn finish(&mut self, seq: u64) {
        self.seqs.remove(&seq);
    }
}

#[cfg(feature = "plugin")]
specd_plugin_sdk::export_proposer!(DraftModel);

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(r: std::ops::Range<u32>) -> Vec<u32> {
        r.collect()
    }

    #[test]
    fn catch_up_keeps_the_committed_prefix_and_feeds_the_rest() {
        let t = toks(0..8);
        let p = plan_catch_up(&t[..5], 0, 0, &t, 0);
        assert_eq!((p.keep, p.feed), (5, toks(5..8)));
        // Everything cached: the last token is fed again for its logits.
        let p = plan_catch_up(&t, 0, 0, &t, 0);
        assert_eq!((p.keep, p.feed), (7, vec![7]));
        // A rejected drafted token after the prefix is dropped.
        let mut c = t[..6].to_vec();
        c.push(99);
        let p = plan_catch_up(&c, 0, 0, &t, 0);
        assert_eq!((p.keep, p.feed), (6, toks(6..8)));
        // Unbounded: a long history is fed whole.
        let long = toks(0..300);
        let p = plan_catch_up(&[], 0, 0, &long, 0);
        assert_eq!((p.sink, p.skip_to, p.keep, p.feed.len()), (0, 0, 0, 300));
    }

    #[test]
    fn a_long_catch_up_is_cut_to_the_sink_and_the_window() {
        let t = toks(0..20);
        let p = plan_catch_up(&[], 0, 0, &t, 4);
        let mut want = toks(0..SINK as u32);
        want.extend(16..20);
        assert_eq!((p.sink, p.skip_to, p.keep), (SINK, 16, 0));
        assert_eq!(p.feed, want);
        // Two more committed tokens (and one drafted one in the cache):
        // the view grows from the window, and only the new tokens are fed.
        let mut cached = p.feed.clone();
        cached.push(21);
        let t2 = toks(0..22);
        let q = plan_catch_up(&cached, p.sink, p.skip_to, &t2, 4);
        assert_eq!((q.sink, q.skip_to, q.keep), (SINK, 16, 8));
        assert_eq!(q.feed, vec![20, 21]);
        // A later long pause moves the window; the sink stays cached.
        let mut cached = cached[..8].to_vec();
        cached.extend([20, 21]);
        let t3 = toks(0..40);
        let r = plan_catch_up(&cached, q.sink, q.skip_to, &t3, 4);
        assert_eq!((r.sink, r.skip_to, r.keep), (SINK, 36, SINK));
        assert_eq!(r.feed, toks(36..40));
    }

    #[test]
    fn a_history_cut_below_the_window_starts_over() {
        // Cached view: sink 0..4, window from 16. The history is now only
        // 10 tokens (recomputed, or a different request reusing the slot).
        let mut cached = toks(0..4);
        cached.extend(16..20);
        let t = toks(0..10);
        let p = plan_catch_up(&cached, 4, 16, &t, 0);
        assert_eq!((p.sink, p.skip_to, p.keep), (0, 0, 4));
        assert_eq!(p.feed, toks(4..10));
        // With a window of 4 the rest is cut again.
        let p = plan_catch_up(&cached, 4, 16, &t, 4);
        assert_eq!((p.sink, p.skip_to, p.keep), (4, 6, 4));
        assert_eq!(p.feed, toks(6..10));
        // Cut to exactly the window's start: the view would end at the
        // sink, before the newest token, so it starts over too.
        let t = toks(0..16);
        let p = plan_catch_up(&cached, 4, 16, &t, 0);
        assert_eq!((p.sink, p.skip_to, p.keep), (0, 0, 4));
        assert_eq!(p.feed, toks(4..16));
        assert_eq!(p.feed.last(), Some(&15), "the newest token is fed last");
        // A sink past the window's start (not a state catch_up makes) is
        // clamped, never an underflow.
        let p = plan_catch_up(&[], 9, 2, &toks(0..12), 4);
        assert_eq!(p.feed.last(), Some(&11));
        assert!(p.feed.len() <= SINK + 4);
    }
}
