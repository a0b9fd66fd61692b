//! The C ABI between the specd host and proposer plugins, version 2.
//!
//! Rules that keep it stable:
//! - Only `#[repr(C)]` plain data and `extern "C"` function pointers cross.
//! - A plugin exports one symbol, [`ENTRY_SYMBOL`], returning a pointer to a
//!   static [`Descriptor`]. The host checks `abi_major` first and refuses
//!   any other major version, naming both.
//! - **Every struct is size-prefixed.** Each starts with `struct_size` (the
//!   descriptor: after its two version words), the size the writer built it
//!   with. A reader copies `min(struct_size, its own size)` bytes into a
//!   zeroed struct ([`read_sized`]), so a minor version appends fields (and
//!   nullable functions) at the end of any struct, and an older reader or
//!   writer sees zeros (null, `None`) for what it does not know. Changing
//!   an existing field is a major bump. Structs are never passed as arrays
//!   with a fixed stride: `propose` takes an array of pointers.
//! - The host allocates every output buffer and passes its capacity; nothing
//!   allocated on one side is freed on the other.
//! - Every call returns a [`Status`]; after a non-OK status the host may ask
//!   `last_error` for a message. Panics never cross: the SDK catches them.
//!
//! Threads: `create`, `capabilities` and every other vtable function of
//! one instance may be called from any host thread, but never concurrently
//! (an instance must be `Send`, it need not be `Sync`); different instances
//! may be called concurrently from different threads. [`HostApi`]
//! callbacks may be called from inside any vtable call, on the calling
//! thread, and nowhere else.
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
//!
//! Trees: a draft may be a tree, each node with a parent index (`-1`: off
//! the context; always smaller than the node's own index), siblings in the
//! order they were drawn. A node's q is the distribution it was drawn from
//! at its parent before any earlier sibling; siblings are drawn from that
//! same q either independently ([`SIBLINGS_IID`]) or without replacement
//! ([`SIBLINGS_WITHOUT_REPLACEMENT`], distinct tokens), as the
//! capabilities declare. A node that is not its parent's first child may
//! leave its q empty (`q_len` 0): it is the first sibling's.

#![no_std]

use core::ffi::c_void;

/// Incremented on any incompatible change.
pub const ABI_MAJOR: u32 = 2;
/// Incremented when fields or functions are appended.
pub const ABI_MINOR: u32 = 2;

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

/// Siblings drawn independently from their parent's q.
pub const SIBLINGS_IID: u32 = 0;
/// Siblings drawn one after another without replacement (distinct tokens).
pub const SIBLINGS_WITHOUT_REPLACEMENT: u32 = 1;

/// Marker for the size-prefixed structs [`read_sized`] reads.
///
/// # Safety
/// The type is `#[repr(C)]`, starts with a `u32` `struct_size`, and the
/// all-zero bit pattern is a valid value of it (null pointers, `None`
/// functions, zero numbers).
pub unsafe trait SizePrefixed {}

/// Copy a size-prefixed struct written by the other side: the first
/// `min(struct_size, size_of::<T>())` bytes, the rest zero. Returns `None`
/// for a null pointer or a `struct_size` below 4.
///
/// # Safety
/// `p` is null or points to at least `struct_size` readable bytes of a
/// struct laid out as `T` (or a prefix or extension of it).
pub unsafe fn read_sized<T: SizePrefixed + Copy>(p: *const T) -> Option<T> {
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` is readable for at least its first 4 bytes (the caller's
    // contract), which hold `struct_size`.
    let size = unsafe { (p as *const u32).read_unaligned() } as usize;
    if size < 4 {
        return None;
    }
    // SAFETY: `T: SizePrefixed` promises the all-zero pattern is valid.
    let mut out: T = unsafe { core::mem::zeroed() };
    let n = size.min(core::mem::size_of::<T>());
    // SAFETY: `n` bytes are readable at `p` and writable in `out`; the two
    // do not overlap.
    unsafe {
        core::ptr::copy_nonoverlapping(p as *const u8, &mut out as *mut T as *mut u8, n);
    }
    Some(out)
}

/// The size of `T` as a `struct_size` value.
pub const fn size_of<T>() -> u32 {
    core::mem::size_of::<T>() as u32
}

/// What a proposer needs and produces.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Capabilities {
    pub struct_size: u32,
    /// `Q_ONE_HOT`, `Q_SPARSE` or `Q_FULL`.
    pub q_kind: u32,
    /// Entries per draft position for `Q_SPARSE`.
    pub sparse_k: u32,
    /// Most draft tokens (tree nodes) per sequence and call.
    pub max_draft: u32,
    /// 1 if drafts are trees (parent indices), 0 for linear chains.
    pub tree: u32,
    /// Deepest tree node the plugin drafts (0: `max_draft`).
    pub max_depth: u32,
    /// `SIBLINGS_IID` or `SIBLINGS_WITHOUT_REPLACEMENT`.
    pub sibling_mode: u32,
    /// Target layers whose hidden states the plugin wants, in the order it
    /// wants them (up to 8): layer `l < layers` is the residual stream
    /// after block `l`, layer `layers` the final-normed state.
    pub n_hidden_layers: u32,
    pub hidden_layers: [u32; 8],
    /// 1 if the plugin calls `HostApi::embed` / `HostApi::lm_head`.
    pub needs_embeddings: u32,
    pub needs_output_head: u32,
    /// Since 2.2: bytes of per-sequence cache (a draft model's KV, a
    /// head's own attention cache) the plugin keeps for each token of a
    /// sequence, at most; the host charges them to its KV budget beside
    /// the target's cache. 0 (and every plugin built before 2.2): none.
    pub kv_bytes_per_token: u32,
}

// SAFETY: repr(C), starts with struct_size, all-zero is valid.
unsafe impl SizePrefixed for Capabilities {}

/// One sequence in a propose call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SeqInput {
    pub struct_size: u32,
    /// At most this many draft tokens (tree nodes) for this sequence; 0
    /// when the host only delivers hidden states.
    pub max_draft: u32,
    pub seq: u64,
    /// Committed tokens (prompt and output), ending with the token the next
    /// verify feeds first.
    pub tokens: *const u32,
    pub n_tokens: usize,
    /// The request's sampling transforms. Greedy when `temperature <= 0`
    /// or `top_k == 1`. Each draft token must be drawn from the q reported
    /// for it (see the crate docs); using these transforms for q is the
    /// usual way to keep q close to the target's p.
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    /// A seed for this request's draws, derived from the request's seed
    /// (the host's own stream, which tests the draft, is seeded apart).
    pub seed: u64,
    /// Hidden states of the declared layers, in declaration order, for
    /// every position committed since the plugin last saw this sequence
    /// (prefill positions included; all of them again after a restart),
    /// at most the newest few thousand (the host's `max_hidden_rows`,
    /// default 4,096, plus up to a quarter more before it trims;
    /// `hidden_start` then skips the older ones): `n_hidden_layers` blocks
    /// of `n_hidden_rows x hidden_width` floats, rows for positions
    /// `hidden_start..hidden_start + n_hidden_rows`.
    pub hidden: *const f32,
    pub n_hidden_rows: u32,
    pub hidden_width: u32,
    pub n_hidden_layers: u32,
    pub hidden_start: u64,
}

// SAFETY: repr(C), starts with struct_size, all-zero is valid.
unsafe impl SizePrefixed for SeqInput {}

/// Host-allocated output of a propose call. For sequence `i` and node `j`,
/// the token goes to `tokens[i * draft_cap + j]`, its parent to
/// `parents[..]` (same index; `-1` off the context; chains may leave the
/// host's default `j - 1`), and q to `q_probs[(i * draft_cap + j) * q_cap
/// ..]` (with ids in `q_ids` for sparse q; dense over the vocabulary for
/// full q, where `q_cap` = vocab and all `q_cap` entries are written), with
/// the number written in `q_len` (0: one-hot, or, for a later sibling, the
/// first sibling's q).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DraftOut {
    pub struct_size: u32,
    pub draft_cap: u32,
    pub q_cap: u32,
    pub tokens: *mut u32,
    /// Drafts written per sequence.
    pub n_drafted: *mut u32,
    /// Null where the proposer declared full q (no ids to write).
    pub q_ids: *mut u32,
    pub q_probs: *mut f32,
    /// Entries written per draft position.
    pub q_len: *mut u32,
    /// Parent index per draft token (`-1`: hangs off the context).
    pub parents: *mut i32,
}

// SAFETY: repr(C), starts with struct_size, all-zero is valid.
unsafe impl SizePrefixed for DraftOut {}

/// What one step committed for a sequence.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ObserveInput {
    pub struct_size: u32,
    pub seq: u64,
    /// Newly committed tokens (accepted drafts, then the correction or
    /// bonus token).
    pub tokens: *const u32,
    pub n_tokens: usize,
    /// The accepted path through the last draft: node indices, root first.
    pub path: *const u32,
    pub n_path: usize,
}

// SAFETY: repr(C), starts with struct_size, all-zero is valid.
unsafe impl SizePrefixed for ObserveInput {}

/// Callbacks the host offers every plugin instance. A cdylib has its own
/// copy of global state, so logging and metrics must come through here.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HostApi {
    pub struct_size: u32,
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub ctx: *mut c_void,
    /// level: 0 error, 1 warn, 2 info, 3 debug.
    pub log: Option<unsafe extern "C" fn(ctx: *mut c_void, level: u32, msg: Str)>,
    /// Add `value` to the counter `specd_plugin_<name>_total` (labelled by proposer).
    pub counter_add: Option<unsafe extern "C" fn(ctx: *mut c_void, name: Str, value: u64)>,
    /// Target token embeddings: writes `n * hidden_size` floats; returns
    /// floats written (0 on error, e.g. too small a buffer).
    pub embed: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            tokens: *const u32,
            n: usize,
            out: *mut f32,
            cap: usize,
        ) -> usize,
    >,
    /// Target output head: `rows` final-normed hidden rows to `rows * vocab`
    /// logits; returns floats written.
    pub lm_head: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            hidden: *const f32,
            rows: usize,
            out: *mut f32,
            cap: usize,
        ) -> usize,
    >,
    /// Token text (raw vocabulary string); returns bytes written.
    pub token_text: Option<
        unsafe extern "C" fn(ctx: *mut c_void, token: u32, out: *mut u8, cap: usize) -> usize,
    >,
    /// Since 2.1: the target's number of layers (0: unknown, or a 2.0 host).
    pub n_layers: u32,
}

// SAFETY: repr(C), starts with struct_size, all-zero is valid.
unsafe impl SizePrefixed for HostApi {}

/// Opaque plugin instance.
pub type Instance = *mut c_void;

/// The plugin's functions. Every entry of ABI 2.0 is required; entries
/// appended by later minor versions are optional (`None` from an older
/// plugin).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct VTable {
    pub struct_size: u32,
    /// Create an instance from the `[proposer.options]` table as TOML text.
    /// On error, `*err` (capacity `err_cap`) receives a message and
    /// `*written` its length.
    pub create: Option<
        unsafe extern "C" fn(
            config_toml: Str,
            host: *const HostApi,
            out: *mut Instance,
            err: *mut u8,
            err_cap: usize,
            written: *mut usize,
        ) -> Status,
    >,
    pub destroy: Option<unsafe extern "C" fn(inst: Instance)>,
    /// The instance's capabilities (may differ from the descriptor's
    /// defaults, e.g. `max_draft` from options); the host passes a struct
    /// with its own `struct_size`, the plugin writes at most that much.
    pub capabilities:
        Option<unsafe extern "C" fn(inst: Instance, out: *mut Capabilities) -> Status>,
    pub start: Option<
        unsafe extern "C" fn(inst: Instance, seq: u64, tokens: *const u32, n: usize) -> Status,
    >,
    /// Draft for `n_seqs` sequences (`seqs` points to that many pointers).
    pub propose: Option<
        unsafe extern "C" fn(
            inst: Instance,
            seqs: *const *const SeqInput,
            n_seqs: usize,
            out: *mut DraftOut,
        ) -> Status,
    >,
    pub observe: Option<unsafe extern "C" fn(inst: Instance, input: *const ObserveInput) -> Status>,
    pub finish: Option<unsafe extern "C" fn(inst: Instance, seq: u64) -> Status>,
    /// Copy the last error message into `buf`; returns its full length.
    pub last_error: Option<unsafe extern "C" fn(inst: Instance, buf: *mut u8, cap: usize) -> usize>,
}

// SAFETY: repr(C), starts with struct_size, all-zero is valid.
unsafe impl SizePrefixed for VTable {}

/// What the entry symbol returns. The first three words never move.
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
    /// Default capabilities (size-prefixed).
    pub caps: *const Capabilities,
    /// The functions (size-prefixed).
    pub vtable: *const VTable,
}

// SAFETY: a Descriptor is immutable once built; its pointers refer to
// static data and functions of the plugin, which are never unloaded.
unsafe impl Sync for Descriptor {}
// SAFETY: as above; nothing in it is tied to a thread.
unsafe impl Send for Descriptor {}
