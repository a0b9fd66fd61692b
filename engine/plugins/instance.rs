//! A plugin instance adapted to the engine's `Proposer` trait.

use std::sync::Arc;

use specd_plugin_abi as abi;

use super::callbacks::{
    host_counter, host_embed, host_lm_head, host_log, host_token_text, CtxHandle, HostCtx,
};
use super::library::PluginLibrary;
use crate::error::{Result, SpecdError};
use crate::model::Model;
use crate::sampler::Distribution;
use crate::speculative::proposer::{
    Capabilities, Draft, DraftQ, ProposeInput, Proposer, ProposerInfo, QKind, SiblingMode,
};
use crate::speculative::SeqId;
use crate::tokenizer::Tokenizer;

/// The target model's sizes a plugin instance is told about.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TargetDims {
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
}

impl TargetDims {
    pub fn of(c: &crate::model::ModelConfig) -> Self {
        Self {
            vocab: c.vocab_size,
            hidden: c.hidden,
            layers: c.layers,
        }
    }
}

/// Most hidden layers a proposer may ask for (the ABI's array size).
pub(crate) const MAX_HIDDEN_LAYERS: usize = 8;

/// Most tokens (tree nodes) a proposer may declare it drafts a step.
pub(crate) const MAX_PLUGIN_DRAFT: usize = 256;

/// Most KV bytes a proposer may declare it keeps per token (16 MiB; a 70B
/// model's own cache is about a fiftieth of that).
pub(crate) const MAX_KV_BYTES_PER_TOKEN: usize = 16 << 20;

/// Most q entries (floats) one propose call may have the host allocate:
/// 1 GiB of them (e.g. 64 sequences x 16 drafted tokens x a 256k
/// vocabulary).
const MAX_Q_FLOATS: usize = 1 << 28;

/// What a plugin declares must fit the target: hidden layers that exist,
/// at most `MAX_HIDDEN_LAYERS` of them, none twice. A layer past the
/// target would fail every forward that carries one of its sequences
/// (other requests' too), so such a proposer is refused when created.
pub(crate) fn check_caps(
    name: &str,
    caps: &Capabilities,
    dims: TargetDims,
) -> std::result::Result<(), String> {
    // The host sizes a call's output buffers by `max_draft` (times the
    // vocabulary for a full q), so a declared limit is bounded here, not
    // trusted: a shadow proposer drafts at its own limit.
    if caps.max_draft > MAX_PLUGIN_DRAFT {
        return Err(format!(
            "proposer '{name}': max_draft {} declared, at most {MAX_PLUGIN_DRAFT}",
            caps.max_draft
        ));
    }
    if caps.kv_bytes_per_token > MAX_KV_BYTES_PER_TOKEN {
        return Err(format!(
            "proposer '{name}': kv_bytes_per_token {} declared, at most {MAX_KV_BYTES_PER_TOKEN}",
            caps.kv_bytes_per_token
        ));
    }
    let layers = &caps.hidden_layers;
    if layers.len() > MAX_HIDDEN_LAYERS {
        return Err(format!(
            "proposer '{name}': {} hidden layers declared, at most {MAX_HIDDEN_LAYERS}",
            layers.len()
        ));
    }
    // Layer `l < layers` is the residual stream after block `l`, layer
    // `layers` the final-normed state.
    if let Some(&bad) = layers.iter().find(|&&l| l > dims.layers) {
        return Err(format!(
            "proposer '{name}': hidden layer {bad} declared, but the target has {} layers \
             (0 to {} after each block, {} for the final-normed state)",
            dims.layers,
            dims.layers.saturating_sub(1),
            dims.layers
        ));
    }
    if let Some((i, &l)) = layers
        .iter()
        .enumerate()
        .find(|(i, l)| layers[..*i].contains(l))
    {
        return Err(format!(
            "proposer '{name}': hidden layer {l} declared twice (entry {i})"
        ));
    }
    Ok(())
}

/// A plugin instance as an engine `Proposer`.
pub struct PluginProposer {
    name: String,
    lib: Arc<PluginLibrary>,
    inst: abi::Instance,
    caps: abi::Capabilities,
    vocab: usize,
    hidden: usize,
    // Boxed so the pointers handed to the plugin stay put.
    _host: Box<abi::HostApi>,
    /// Unregistered after `destroy` (fields drop after `Drop::drop`).
    _ctx: CtxHandle,
    /// Output buffers kept between calls (q can be `nodes x vocab` floats
    /// per sequence: allocated once, never zeroed per step).
    bufs: Buffers,
}

#[derive(Debug, Default)]
struct Buffers {
    tokens: Vec<u32>,
    n_drafted: Vec<u32>,
    q_ids: Vec<u32>,
    q_probs: Vec<f32>,
    q_len: Vec<u32>,
    parents: Vec<i32>,
    /// What recent calls needed of the q buffers, which give back room
    /// no call of a window used.
    q_need: HighWater,
}

/// Calls in a window of `HighWater`.
const Q_WINDOW_CALLS: u32 = 256;
/// q buffers up to this many entries are kept whatever their use (4 MiB
/// of f32: not worth a reallocation).
const Q_KEEP_ENTRIES: usize = 1 << 20;

/// The largest need of the calls of the current window. One call with a
/// large batch of full-q drafts (up to `MAX_Q_FLOATS` entries, 1 GiB) must
/// not keep its buffers for the process's life: at the end of a window in
/// which no call needed half of what a buffer holds, the buffer shrinks
/// to the window's largest need.
#[derive(Debug, Default)]
struct HighWater {
    max: usize,
    calls: u32,
}

impl HighWater {
    /// Record a call needing `need` entries of a buffer holding `held`:
    /// the length to shrink the buffer to, at the end of a window where
    /// it holds more than twice the window's largest need (and more than
    /// `Q_KEEP_ENTRIES`).
    fn note(&mut self, need: usize, held: usize) -> Option<usize> {
        self.max = self.max.max(need);
        self.calls += 1;
        if self.calls < Q_WINDOW_CALLS {
            return None;
        }
        let keep = std::mem::take(&mut self.max);
        self.calls = 0;
        (held > Q_KEEP_ENTRIES && held / 2 > keep).then_some(keep)
    }
}

/// Shrink `v` to `len` entries and give back the rest of its allocation.
fn shrink<T>(v: &mut Vec<T>, len: usize) {
    v.truncate(len);
    v.shrink_to_fit();
}

// SAFETY: the instance is only ever driven from one thread at a time (the
// DraftActor owns it); plugins are required to tolerate moving between
// threads, as the ABI documents, and the host context is read-only.
unsafe impl Send for PluginProposer {}

impl std::fmt::Debug for PluginProposer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginProposer")
            .field("name", &self.name)
            .field("plugin", &self.lib.name)
            .finish()
    }
}

impl PluginProposer {
    /// Create an instance of `lib` registered as `name`, with `options` (a
    /// TOML table) and access to the target `model`.
    pub fn create(
        name: &str,
        lib: Arc<PluginLibrary>,
        options: &toml::Table,
        model: Option<Arc<Model>>,
        tokenizer: Option<Arc<Tokenizer>>,
    ) -> Result<Self> {
        let dims = model
            .as_ref()
            .map(|m| TargetDims::of(&m.config))
            .unwrap_or_default();
        Self::create_with(
            name,
            lib,
            options,
            dims,
            HostCtx::new(name, model, tokenizer),
        )
    }

    /// Like `create`, for a plugin-host child: the target's sizes are given
    /// and the model at `model_path` is loaded only if a callback needs it.
    pub fn create_lazy(
        name: &str,
        lib: Arc<PluginLibrary>,
        options: &toml::Table,
        dims: TargetDims,
        model_path: Option<std::path::PathBuf>,
    ) -> Result<Self> {
        Self::create_with(name, lib, options, dims, HostCtx::lazy(name, model_path))
    }

    fn create_with(
        name: &str,
        lib: Arc<PluginLibrary>,
        options: &toml::Table,
        dims: TargetDims,
        ctx: HostCtx,
    ) -> Result<Self> {
        let TargetDims {
            vocab,
            hidden,
            layers,
        } = dims;
        let ctx = CtxHandle::register(ctx);
        let host = Box::new(abi::HostApi {
            struct_size: abi::size_of::<abi::HostApi>(),
            vocab_size: vocab as u32,
            hidden_size: hidden as u32,
            ctx: ctx.as_ptr(),
            log: Some(host_log),
            counter_add: Some(host_counter),
            embed: Some(host_embed),
            lm_head: Some(host_lm_head),
            token_text: Some(host_token_text),
            n_layers: layers as u32,
        });
        let text = toml::to_string(options)
            .map_err(|e| SpecdError::Plugin(format!("proposer '{name}': options: {e}")))?;
        let mut inst: abi::Instance = std::ptr::null_mut();
        let mut err = vec![0u8; 4096];
        let mut written = 0usize;
        // SAFETY: vtable from a validated descriptor; every pointer is live
        // for the call and `err` has the capacity passed.
        let status = unsafe {
            (lib.fns.create)(
                abi::Str {
                    ptr: text.as_ptr(),
                    len: text.len(),
                },
                &*host,
                &mut inst,
                err.as_mut_ptr(),
                err.len(),
                &mut written,
            )
        };
        if status != abi::STATUS_OK || inst.is_null() {
            let msg = String::from_utf8_lossy(&err[..written.min(err.len())]).into_owned();
            return Err(SpecdError::Plugin(format!(
                "proposer '{name}' ({}): {msg}",
                lib.path.display()
            )));
        }
        // Ask the instance; it writes at most our struct's size and reports
        // what it wrote (the rest keeps the descriptor's defaults).
        let mut caps = abi::Capabilities {
            struct_size: abi::size_of::<abi::Capabilities>(),
            ..lib.caps
        };
        // SAFETY: valid instance and a writable struct of the size declared.
        if unsafe { (lib.fns.capabilities)(inst, &mut caps) } != abi::STATUS_OK {
            caps = lib.caps;
        }
        let mut p = Self {
            name: name.to_string(),
            lib,
            inst,
            caps,
            vocab,
            hidden,
            _host: host,
            _ctx: ctx,
            bufs: Buffers::default(),
        };
        if p.caps.n_hidden_layers as usize > MAX_HIDDEN_LAYERS {
            return Err(SpecdError::Plugin(format!(
                "proposer '{name}': {} hidden layers declared, at most {MAX_HIDDEN_LAYERS}",
                p.caps.n_hidden_layers
            )));
        }
        check_caps(name, &p.capabilities(), dims).map_err(SpecdError::Plugin)?;
        // q buffers are sized by `sparse_k` entries per drafted token.
        let k_limit = if vocab > 0 { vocab } else { 1 << 16 };
        if p.caps.q_kind == abi::Q_SPARSE && p.caps.sparse_k as usize > k_limit {
            return Err(SpecdError::Plugin(format!(
                "proposer '{name}': sparse_k {} declared, at most {k_limit} (the vocabulary)",
                p.caps.sparse_k
            )));
        }
        if p.caps.q_kind == abi::Q_FULL && p.vocab == 0 {
            return Err(SpecdError::Plugin(format!(
                "proposer '{name}': full q needs the target model"
            )));
        }
        p.name = name.to_string();
        Ok(p)
    }

    pub fn library(&self) -> &PluginLibrary {
        &self.lib
    }

    /// The callback table this instance was given (for tests of the host's
    /// side of the ABI).
    #[doc(hidden)]
    pub fn host_api(&self) -> &abi::HostApi {
        &self._host
    }

    fn error(&self, what: &str, status: abi::Status) -> String {
        let mut buf = vec![0u8; 4096];
        // SAFETY: valid instance; `buf` has the capacity passed.
        let n = unsafe { (self.lib.fns.last_error)(self.inst, buf.as_mut_ptr(), buf.len()) };
        let msg = String::from_utf8_lossy(&buf[..n.min(buf.len())]).into_owned();
        let kind = if status == abi::STATUS_PANIC {
            "panicked"
        } else {
            "failed"
        };
        format!("plugin {} {what} {kind}: {msg}", self.lib.name)
    }
}

impl Drop for PluginProposer {
    fn drop(&mut self) {
        // SAFETY: the instance came from this library's `create` and is not
        // used after this call.
        unsafe { (self.lib.fns.destroy)(self.inst) };
    }
}

impl Proposer for PluginProposer {
    fn name(&self) -> &str {
        &self.name
    }

    fn info(&self) -> ProposerInfo {
        ProposerInfo {
            plugin: self.lib.name.clone(),
            version: self.lib.version.clone(),
            build_id: self.lib.build_id.clone(),
            path: Some(self.lib.path.display().to_string()),
            library_rebuilt: self.lib.rebuilt(),
            ..ProposerInfo::default()
        }
    }

    fn capabilities(&self) -> Capabilities {
        let c = &self.caps;
        Capabilities {
            hidden_layers: c.hidden_layers[..(c.n_hidden_layers as usize).min(8)]
                .iter()
                .map(|&l| l as usize)
                .collect(),
            q_kind: match c.q_kind {
                abi::Q_SPARSE => QKind::Sparse,
                abi::Q_FULL => QKind::Full,
                _ => QKind::OneHot,
            },
            max_draft: c.max_draft as usize,
            tree: c.tree != 0,
            max_depth: match c.max_depth {
                0 => c.max_draft as usize,
                d => d as usize,
            },
            siblings: if c.sibling_mode == abi::SIBLINGS_IID {
                SiblingMode::Iid
            } else {
                SiblingMode::WithoutReplacement
            },
            // Set by the host's configuration (`speculative::proposer::Configured`).
            token_cost: None,
            kv_bytes_per_token: c.kv_bytes_per_token as usize,
        }
    }

    fn start(&mut self, seq: SeqId, prompt: &[u32]) -> std::result::Result<(), String> {
        // SAFETY: valid instance; the token buffer is live for the call.
        let s = unsafe { (self.lib.fns.start)(self.inst, seq, prompt.as_ptr(), prompt.len()) };
        if s == abi::STATUS_OK {
            Ok(())
        } else {
            Err(self.error("start", s))
        }
    }

    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> std::result::Result<Vec<Draft>, String> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let draft_cap = batch
            .iter()
            .map(|b| b.max_draft)
            .max()
            .unwrap_or(0)
            .clamp(1, MAX_PLUGIN_DRAFT);
        let q_cap = match self.caps.q_kind {
            abi::Q_SPARSE => self.caps.sparse_k.max(1) as usize,
            abi::Q_FULL => self.vocab,
            _ => 0,
        };
        let width = self.hidden;
        // Every declared layer, in declaration order, one block each.
        let hidden: Vec<Vec<f32>> = batch
            .iter()
            .map(|b| {
                b.hidden
                    .iter()
                    .flat_map(|(_, h)| h.iter().copied())
                    .collect()
            })
            .collect();
        let inputs: Vec<abi::SeqInput> = batch
            .iter()
            .zip(&hidden)
            .map(|(b, h)| {
                let rows = match (b.hidden.first(), width) {
                    (Some((_, first)), w) if w > 0 => first.len() / w,
                    _ => 0,
                };
                abi::SeqInput {
                    struct_size: abi::size_of::<abi::SeqInput>(),
                    max_draft: b.max_draft as u32,
                    seq: b.seq,
                    tokens: b.tokens.as_ptr(),
                    n_tokens: b.tokens.len(),
                    temperature: b.params.temperature,
                    top_k: b.params.top_k as u32,
                    top_p: b.params.top_p,
                    min_p: b.params.min_p,
                    seed: crate::sampler::draft_seed(b.params.seed, b.tokens.len()),
                    hidden: h.as_ptr(),
                    n_hidden_rows: rows as u32,
                    hidden_width: width as u32,
                    n_hidden_layers: b.hidden.len() as u32,
                    hidden_start: b.hidden_start as u64,
                }
            })
            .collect();
        let ptrs: Vec<*const abi::SeqInput> = inputs.iter().map(|i| i as *const _).collect();
        let n = batch.len();
        let slots = n * draft_cap;
        let q_floats = slots
            .checked_mul(q_cap)
            .filter(|&f| f <= MAX_Q_FLOATS)
            .ok_or_else(|| {
                format!(
                    "plugin {}: {n} sequences x {draft_cap} drafted tokens x {q_cap} q entries \
                 exceed the {MAX_Q_FLOATS} q entries a call may use",
                    self.lib.name
                )
            })?;
        let b = &mut self.bufs;
        // Small buffers are reset every call; q entries are only read where
        // the plugin says it wrote them (`q_len`), so they are reused as is.
        for (v, fill) in [(&mut b.tokens, 0u32), (&mut b.q_len, 0u32)] {
            v.clear();
            v.resize(slots, fill);
        }
        b.n_drafted.clear();
        b.n_drafted.resize(n, 0);
        b.parents.clear();
        b.parents
            .extend((0..n).flat_map(|_| (0..draft_cap as i32).map(|j| j - 1)));
        if let Some(keep) = b.q_need.note(q_floats, b.q_probs.len()) {
            shrink(&mut b.q_probs, keep);
            shrink(&mut b.q_ids, keep);
        }
        if b.q_probs.len() < q_floats {
            b.q_probs.resize(q_floats, 0.0);
        }
        // A full q is every id in order: no ids are written.
        let id_floats = if self.caps.q_kind == abi::Q_FULL {
            0
        } else {
            q_floats
        };
        if b.q_ids.len() < id_floats {
            b.q_ids.resize(id_floats, 0);
        }
        let mut out = abi::DraftOut {
            struct_size: abi::size_of::<abi::DraftOut>(),
            draft_cap: draft_cap as u32,
            q_cap: q_cap as u32,
            tokens: b.tokens.as_mut_ptr(),
            n_drafted: b.n_drafted.as_mut_ptr(),
            q_ids: if id_floats == 0 {
                std::ptr::null_mut()
            } else {
                b.q_ids.as_mut_ptr()
            },
            q_probs: b.q_probs.as_mut_ptr(),
            q_len: b.q_len.as_mut_ptr(),
            parents: b.parents.as_mut_ptr(),
        };
        // SAFETY: valid instance; every buffer is live and at least as large
        // as `out` describes; `ptrs` point into `inputs`, whose own pointers
        // point into `batch` and `hidden`, all live for the call.
        let s = unsafe { (self.lib.fns.propose)(self.inst, ptrs.as_ptr(), n, &mut out) };
        if s != abi::STATUS_OK {
            return Err(self.error("propose", s));
        }
        let b = &self.bufs;
        let tree = self.caps.tree != 0;
        let mut drafts = Vec::with_capacity(n);
        for (i, inp) in batch.iter().enumerate() {
            let k = (b.n_drafted[i] as usize).min(inp.max_draft).min(draft_cap);
            let mut d = Draft::default();
            let mut parents = Vec::with_capacity(k);
            // The q of each parent's first child, for later siblings.
            let mut first_q: std::collections::HashMap<i32, usize> = Default::default();
            for j in 0..k {
                let slot = i * draft_cap + j;
                let tok = b.tokens[slot];
                if self.vocab > 0 && tok as usize >= self.vocab {
                    return Err(format!(
                        "plugin {} drafted token {tok} outside the vocabulary",
                        self.lib.name
                    ));
                }
                let parent = if tree { b.parents[slot] } else { j as i32 - 1 };
                parents.push(parent);
                d.tokens.push(tok);
                let base = slot * q_cap;
                let len = (b.q_len[slot] as usize).min(q_cap);
                let sibling_of = first_q.get(&parent).copied();
                let q = match self.caps.q_kind {
                    // Nothing written for a later sibling: its first
                    // sibling's q; for anything else: one-hot (allowed under
                    // greedy decoding whatever the declared kind).
                    abi::Q_SPARSE | abi::Q_FULL if len == 0 => match sibling_of {
                        Some(f) if tree => d.q[f].clone(),
                        _ => DraftQ::OneHot,
                    },
                    abi::Q_SPARSE => {
                        let mut pairs: Vec<(u32, f32)> = (0..len)
                            .map(|e| (b.q_ids[base + e], b.q_probs[base + e]))
                            .collect();
                        pairs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                        DraftQ::Sparse(Distribution {
                            ids: pairs.iter().map(|p| p.0).collect(),
                            probs: pairs.iter().map(|p| p.1).collect(),
                        })
                    }
                    abi::Q_FULL if len < q_cap => {
                        return Err(format!(
                            "plugin {} wrote {len} of the {q_cap} entries of a full q",
                            self.lib.name
                        ))
                    }
                    abi::Q_FULL => DraftQ::Full(b.q_probs[base..base + q_cap].into()),
                    _ => DraftQ::OneHot,
                };
                d.q.push(q);
                first_q.entry(parent).or_insert(j);
            }
            if tree {
                d.parents = Some(parents);
            }
            drafts.push(d);
        }
        Ok(drafts)
    }

    fn observe(
        &mut self,
        seq: SeqId,
        committed: &[u32],
        path: &[usize],
    ) -> std::result::Result<(), String> {
        let path: Vec<u32> = path.iter().map(|&p| p as u32).collect();
        let input = abi::ObserveInput {
            struct_size: abi::size_of::<abi::ObserveInput>(),
            seq,
            tokens: committed.as_ptr(),
            n_tokens: committed.len(),
            path: path.as_ptr(),
            n_path: path.len(),
        };
        // SAFETY: valid instance; the input and its buffers live for the call.
        let s = unsafe { (self.lib.fns.observe)(self.inst, &input) };
        if s == abi::STATUS_OK {
            Ok(())
        } else {
            Err(self.error("observe", s))
        }
    }

    fn finish(&mut self, seq: SeqId) {
        // SAFETY: valid instance.
        let s = unsafe { (self.lib.fns.finish)(self.inst, seq) };
        if s != abi::STATUS_OK {
            tracing::warn!(proposer = %self.name, "{}", self.error("finish", s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer one large call grew gives its room back at the end of the
    /// first window no call of which needed half of it; a window that
    /// needed it, or a buffer too small to matter, keeps it.
    #[test]
    fn q_buffers_give_back_room_a_window_of_calls_did_not_use() {
        let big = 8 * Q_KEEP_ENTRIES;
        let mut w = HighWater::default();
        let mut held = big;
        // The large call itself falls in the first window: kept.
        assert_eq!(w.note(big, held), None);
        for _ in 1..Q_WINDOW_CALLS {
            assert_eq!(w.note(1000, held), None);
        }
        // A window of small calls: shrunk to the largest of them.
        let mut shrunk = None;
        for i in 0..Q_WINDOW_CALLS {
            let need = if i == 7 { 5000 } else { 1000 };
            if let Some(keep) = w.note(need, held) {
                assert_eq!(i, Q_WINDOW_CALLS - 1, "only at the window's end");
                shrunk = Some(keep);
            }
        }
        assert_eq!(shrunk, Some(5000));
        held = 5000;
        // Small buffers stay, used or not.
        for _ in 0..2 * Q_WINDOW_CALLS {
            assert_eq!(w.note(10, held), None);
        }
        // A window that used over half of the buffer keeps it.
        held = big;
        for i in 0..Q_WINDOW_CALLS {
            let need = if i == 100 { big / 2 + 1 } else { 10 };
            assert_eq!(w.note(need, held), None);
        }
        let mut v = vec![0f32; 4096];
        shrink(&mut v, 100);
        assert_eq!(v.len(), 100);
        assert!(v.capacity() < 4096);
    }
}
