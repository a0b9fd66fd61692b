//! The C ABI between the specd host and proposer plugins.
//!
//! Rules that keep it stable:
//! - Only `#[repr(C)]` plain data and `extern "C"` function pointers cross.
//! - A plugin exports one symbol, [`ENTRY_SYMBOL`], returning a pointer to a
//!   static [`Descriptor`]. The host checks `abi_major` first and then reads
//!   only `min(struct_size, size_of::<Descriptor>())` bytes, so fields are
//!   only ever appended (a minor version bump); a change to an existing field
//!   is a major bump.
//! - The host allocates every output buffer and passes its capacity; nothing
//!   allocated on one side is freed on the other.
//! - Every call returns a [`Status`]; after a non-OK status the host may ask
//!   `last_error` for a message. Panics never cross: the SDK catches them.
//!
//! The draft contract (what keeps sampling lossless): **each draft token
//! must be drawn from the q the plugin reports for its position** (under
//! greedy decoding, temperature 0 or top_k 1: the argmax of whatever the
//! plugin computed, reported as one-hot). The host accepts token x with
//! probability min(1, p(x)/q(x)) and resamples rejections from
//! norm(max(p - q, 0)), which reproduces the target distribution p exactly
//! only if x really was drawn from that q. How q is computed (with or
//! without the request's temperature, top-k, top-p) is the plugin's
//! choice; a q that is close to p is accepted more often. The host checks
//! every reported q: token ids inside the vocabulary, the declared kind
//! (one-hot is always allowed under greedy decoding), entries finite and
//! non-negative, a total of 1 within 1e-3, and q(draft token) > 0. A plugin
//! that breaks a rule is poisoned: its sequences decode without
//! speculation, and the log names the rule.

#![no_std]

use core::ffi::c_void;

/// Incremented on any incompatible change.
pub const ABI_MAJOR: u32 = 1;
/// Incremented when fields or functions are appended.
pub const ABI_MINOR: u32 = 0;

/// The symbol every plugin exports: `extern "C" fn() -> *const Descriptor`.
pub const ENTRY_SYMBOL: &[u8] = b"specd_proposer_entry\0";

pub type EntryFn = unsafe extern "C" fn() -> *const Descriptor;

/// Call status.
pub type Status = u32;
pub const STATUS_OK: Status = 0;
pub const STATUS_ERROR: Status = 1;
/// The plugin panicked (caught inside the plugin).
pub const STATUS_PANIC: Status = 2;

/// Borrowed UTF-8 text: valid for the duration of the call (or, in a
/// descriptor, for the life of the loaded library).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Str {
    pub ptr: *const u8,
    pub len: usize,
}

impl Str {
    pub const fn from_static(s: &'static str) -> Self {
        Self {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }

    pub const fn empty() -> Self {
        Self {
            ptr: core::ptr::null(),
            len: 0,
        }
    }
}

/// How the plugin describes q. One-hot: q = delta(draft token), for
/// deterministic proposers. Sparse: up to `sparse_k` (id, probability)
/// pairs that sum to 1. Full: a probability per vocabulary entry.
pub const Q_ONE_HOT: u32 = 0;
pub const Q_SPARSE: u32 = 1;
pub const Q_FULL: u32 = 2;

/// What a proposer needs and produces.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Capabilities {
    /// `Q_ONE_HOT`, `Q_SPARSE` or `Q_FULL`.
    pub q_kind: u32,
    /// Entries per draft position for `Q_SPARSE`.
    pub sparse_k: u32,
    pub max_draft: u32,
    /// 1 if drafts are trees (parent indices), 0 for linear chains.
    pub tree: u32,
    /// Target layers whose hidden states the plugin wants (up to 8).
    pub hidden_layers: [u32; 8],
    pub n_hidden_layers: u32,
    /// 1 if the plugin calls `HostApi::embed` / `HostApi::lm_head`.
    pub needs_embeddings: u32,
    pub needs_output_head: u32,
}

/// One sequence in a propose call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SeqInput {
    pub seq: u64,
    /// Committed tokens (prompt and output), ending with the token the next
    /// verify feeds first.
    pub tokens: *const u32,
    pub n_tokens: usize,
    /// At most this many drafts for this sequence.
    pub max_draft: u32,
    /// The request's sampling transforms. Greedy when `temperature <= 0`
    /// or `top_k == 1`. Each draft token must be drawn from the q reported
    /// for it (see the crate docs); using these transforms for q is the
    /// usual way to keep q close to the target's p.
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    /// Hidden states of the declared layers for the positions committed by
    /// the last verify: `n_hidden_rows` rows of `hidden_width` floats per
    /// layer, layers in declaration order, concatenated.
    pub hidden: *const f32,
    pub n_hidden_rows: u32,
    pub hidden_width: u32,
}

/// Host-allocated output of a propose call. For sequence `i` and draft
/// position `j`, the token goes to `tokens[i * draft_cap + j]` and q to
/// `q_probs[(i * draft_cap + j) * q_cap ..]` (with ids in `q_ids` for
/// sparse q; dense over the vocabulary for full q, where `q_cap` = vocab).
#[repr(C)]
#[derive(Debug)]
pub struct DraftOut {
    pub draft_cap: u32,
    pub q_cap: u32,
    pub tokens: *mut u32,
    /// Drafts written per sequence.
    pub n_drafted: *mut u32,
    pub q_ids: *mut u32,
    pub q_probs: *mut f32,
    /// Entries written per draft position (sparse q).
    pub q_len: *mut u32,
    /// Parent index per draft token for trees (-1: hangs off the context).
    pub parents: *mut i32,
}

/// Callbacks the host offers every plugin instance. A cdylib has its own
/// copy of global state, so logging and metrics must come through here.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HostApi {
    pub struct_size: u32,
    pub ctx: *mut c_void,
    /// level: 0 error, 1 warn, 2 info, 3 debug.
    pub log: unsafe extern "C" fn(ctx: *mut c_void, level: u32, msg: Str),
    /// Add `value` to the counter `specd_plugin_<name>_total` (labelled by proposer).
    pub counter_add: unsafe extern "C" fn(ctx: *mut c_void, name: Str, value: u64),
    pub vocab_size: u32,
    pub hidden_size: u32,
    /// Target token embeddings: writes `n * hidden_size` floats; returns
    /// floats written (0 on error, e.g. too small a buffer).
    pub embed: unsafe extern "C" fn(
        ctx: *mut c_void,
        tokens: *const u32,
        n: usize,
        out: *mut f32,
        cap: usize,
    ) -> usize,
    /// Target output head: `rows` final-normed hidden rows to `rows * vocab`
    /// logits; returns floats written.
    pub lm_head: unsafe extern "C" fn(
        ctx: *mut c_void,
        hidden: *const f32,
        rows: usize,
        out: *mut f32,
        cap: usize,
    ) -> usize,
    /// Token text (raw vocabulary string); returns bytes written.
    pub token_text:
        unsafe extern "C" fn(ctx: *mut c_void, token: u32, out: *mut u8, cap: usize) -> usize,
}

/// Opaque plugin instance.
pub type Instance = *mut c_void;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct VTable {
    /// Create an instance from the `[proposer.options]` table as TOML text.
    /// On error, `*err` (capacity `err_cap`) receives a message and
    /// `*written` its length.
    pub create: unsafe extern "C" fn(
        config_toml: Str,
        host: *const HostApi,
        out: *mut Instance,
        err: *mut u8,
        err_cap: usize,
        written: *mut usize,
    ) -> Status,
    pub destroy: unsafe extern "C" fn(inst: Instance),
    /// The instance's capabilities (may differ from the descriptor's
    /// defaults, e.g. `max_draft` from options).
    pub capabilities: unsafe extern "C" fn(inst: Instance, out: *mut Capabilities) -> Status,
    pub start:
        unsafe extern "C" fn(inst: Instance, seq: u64, tokens: *const u32, n: usize) -> Status,
    pub propose: unsafe extern "C" fn(
        inst: Instance,
        seqs: *const SeqInput,
        n_seqs: usize,
        out: *mut DraftOut,
    ) -> Status,
    pub observe:
        unsafe extern "C" fn(inst: Instance, seq: u64, tokens: *const u32, n: usize) -> Status,
    pub finish: unsafe extern "C" fn(inst: Instance, seq: u64) -> Status,
    /// Copy the last error message into `buf`; returns its full length.
    pub last_error: unsafe extern "C" fn(inst: Instance, buf: *mut u8, cap: usize) -> usize,
}

/// What the entry symbol returns. Append-only.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Descriptor {
    pub abi_major: u32,
    pub abi_minor: u32,
    /// `size_of::<Descriptor>()` as the plugin was built.
    pub struct_size: u32,
    pub name: Str,
    pub version: Str,
    pub build_id: Str,
    pub caps: Capabilities,
    pub vtable: VTable,
}

// SAFETY: a Descriptor is immutable once built; its pointers refer to
// static strings and functions of the plugin, which are never unloaded.
unsafe impl Sync for Descriptor {}
// SAFETY: as above; nothing in it is tied to a thread.
unsafe impl Send for Descriptor {}
