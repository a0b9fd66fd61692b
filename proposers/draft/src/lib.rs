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
//! Options: `model` (path; `~/` is expanded; unset: the compact draft
//! trained for SmolLM2-135M-Instruct, compiled in), `threads` (2),
//! `max_draft` (4), `quantize` (true: F32 matrices to Q8_0 at load).
//!
//! Invariant: the draft shares the target's vocabulary: same size and the
//! same token string for every id (checked at creation: id by id against a
//! plain draft's tokenizer, by the fingerprint a compact draft records).

use std::collections::HashMap;
use std::path::PathBuf;

use specd::model::{ForwardInput, KvCache, Logits, Model};
use specd::sampler::{self, Rng, SamplingParams};
use specd::tokenizer::Tokenizer;
use specd_plugin_sdk::{abi, Caps, Host, Options, Plugin, Proposal, SeqView, Q};

struct SeqState {
    cache: KvCache,
    /// Tokens whose KV entries the cache holds, in order.
    cached: Vec<u32>,
    rng: Rng,
}

pub struct DraftModel {
    model: Model,
    /// A compact draft's head over its draft vocabulary.
    head: Option<compact::Head>,
    max_draft: usize,
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
            rng: Rng::new(seed ^ 0xD1A5_7D1A_5700),
        })
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
        o.reject_unknown(&["model", "threads", "max_draft", "quantize"])?;
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
                let model = specd::model::load_model(&path, threads)
                    .map_err(|e| format!("draft model: {e}"))?;
                let tok =
                    Tokenizer::for_model(&path).map_err(|e| format!("draft tokenizer: {e}"))?;
                check_vocab(&host, &tok, model.config.vocab_size)?;
                (model, None, format!("draft model {}", path.display()))
            }
        };
        if o.get("quantize", true)? {
            model.quantize_f32_to_q8_0();
        }
        host.log(
            2,
            &format!(
                "{what} loaded: {} layers, hidden {}{}",
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
            max_draft: o.get("max_draft", 4usize)?,
            seqs: HashMap::new(),
        })
    }

    fn capabilities(&self) -> Caps {
        Caps {
            q_kind: abi::Q_FULL,
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
        for &i in &active {
            let s = &batch[i];
            let st = self.state(s.seq, s.seed);
            let n = s.tokens.len();
            let common = st
                .cached
                .iter()
                .zip(s.tokens)
                .take_while(|(a, b)| a == b)
                .count()
                .min(n - 1);
            st.cache.truncate(common).map_err(|e| e.to_string())?;
            st.cached.truncate(common);
            feeds.push(s.tokens[common..].to_vec());
            st.cached.extend_from_slice(&s.tokens[common..]);
        }
        let max_k = active.iter().map(|&i| want[i]).max().unwrap_or(0);
        let vocab = self.model.config.vocab_size;
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
                        let logits = head.logits(&rows[rows.len() - h..]);
                        if params.is_greedy() {
                            (head.target_id(sampler::argmax(&logits)), Q::OneHot)
                        } else {
                            let d = sampler::distribution(&logits, &params);
                            let i = d.sample(&mut st.rng);
                            let dense = d.dense(logits.len());
                            (head.target_id(i), Q::Full(head.scatter(&dense, vocab)))
                        }
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
