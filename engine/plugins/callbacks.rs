//! The callbacks the host offers every plugin instance (`abi::HostApi`).
//!
//! Invariants: every callback catches panics (a panic never unwinds into
//! plugin code) and checks its sizes with overflow-checked arithmetic
//! before it reads a pointer. The `ctx` a plugin passes back is a handle
//! into a table of live contexts, never an address: a plugin thread that
//! calls back after its instance was destroyed finds nothing and gets the
//! callback's error result.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use specd_plugin_abi as abi;

use super::library::abi_string;
use crate::model::Model;
use crate::tokenizer::Tokenizer;

/// Live contexts by handle (see the module's invariants).
static CONTEXTS: OnceLock<Mutex<HashMap<usize, Arc<HostCtx>>>> = OnceLock::new();
static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(1);

fn contexts() -> std::sync::MutexGuard<'static, HashMap<usize, Arc<HostCtx>>> {
    CONTEXTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A registered `HostCtx`, unregistered when dropped (after the instance
/// it was created for is destroyed).
pub(super) struct CtxHandle(usize);

impl CtxHandle {
    pub fn register(ctx: HostCtx) -> Self {
        let id = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        contexts().insert(id, Arc::new(ctx));
        Self(id)
    }

    /// The value plugins get as `HostApi::ctx`.
    pub fn as_ptr(&self) -> *mut c_void {
        self.0 as *mut c_void
    }
}

impl Drop for CtxHandle {
    fn drop(&mut self) {
        contexts().remove(&self.0);
    }
}

/// The live context behind a plugin's `ctx`, if any.
fn lookup(ctx: *mut c_void) -> Option<Arc<HostCtx>> {
    contexts().get(&(ctx as usize)).cloned()
}

/// What the host offers plugins through `HostApi`: the target model and
/// tokenizer, given up front (in-process) or loaded from `loader` on the
/// first callback that needs them (a plugin-host child process, where a
/// plugin that never calls `embed`/`lm_head`/`token_text` never pays for a
/// second copy of the model).
pub(super) struct HostCtx {
    pub proposer: String,
    target: OnceLock<Target>,
    loader: Option<PathBuf>,
}

/// The target model and tokenizer, either of which may be missing.
type Target = (Option<Arc<Model>>, Option<Arc<Tokenizer>>);

impl HostCtx {
    pub fn new(
        proposer: &str,
        model: Option<Arc<Model>>,
        tokenizer: Option<Arc<Tokenizer>>,
    ) -> Self {
        Self {
            proposer: proposer.to_string(),
            target: OnceLock::from((model, tokenizer)),
            loader: None,
        }
    }

    /// Load the model and tokenizer at `path` when first needed.
    pub fn lazy(proposer: &str, path: Option<PathBuf>) -> Self {
        Self {
            proposer: proposer.to_string(),
            target: OnceLock::new(),
            loader: path,
        }
    }

    fn target(&self) -> &Target {
        self.target.get_or_init(|| {
            let Some(path) = &self.loader else {
                return (None, None);
            };
            let model = crate::model::load_model(path, 1)
                .map(Arc::new)
                .map_err(|e| tracing::error!(proposer = %self.proposer, "plugin host: loading {}: {e}", path.display()))
                .ok();
            let tok = Tokenizer::for_model(path)
                .map(Arc::new)
                .map_err(|e| tracing::error!(proposer = %self.proposer, "plugin host: tokenizer of {}: {e}", path.display()))
                .ok();
            (model, tok)
        })
    }

    pub fn model(&self) -> Option<&Arc<Model>> {
        self.target().0.as_ref()
    }

    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.target().1.as_ref()
    }
}

/// Run a host callback body, turning a panic into `default`: a panic must
/// never unwind into plugin code across `extern "C"`.
fn callback<T>(name: &str, default: T, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            tracing::error!(
                callback = name,
                reason = %crate::error::panic_message(&*p),
                "host callback panicked; the plugin gets an error result"
            );
            default
        }
    }
}

pub(super) unsafe extern "C" fn host_log(ctx: *mut c_void, level: u32, msg: abi::Str) {
    callback("log", (), || {
        let Some(ctx) = lookup(ctx) else { return };
        // SAFETY: `msg` is valid for the call (the ABI's contract).
        let msg = unsafe { abi_string(msg) };
        match level {
            0 => tracing::error!(proposer = %ctx.proposer, "{msg}"),
            1 => tracing::warn!(proposer = %ctx.proposer, "{msg}"),
            2 => tracing::info!(proposer = %ctx.proposer, "{msg}"),
            _ => tracing::debug!(proposer = %ctx.proposer, "{msg}"),
        }
    })
}

/// Most distinct counters one proposer may create: each is a Prometheus
/// series kept for the process's life, so a plugin naming a new one per
/// call would grow memory and `/metrics` without bound.
const MAX_PLUGIN_COUNTERS: usize = 64;

/// Whether proposer `proposer` may add to counter `name`: one it has, or a
/// new one within `MAX_PLUGIN_COUNTERS` (past that, new names are dropped,
/// with one warning).
fn counter_admitted(proposer: &str, name: &str) -> bool {
    use std::collections::{HashMap, HashSet};
    static NAMES: std::sync::OnceLock<std::sync::Mutex<HashMap<String, HashSet<String>>>> =
        std::sync::OnceLock::new();
    let mut all = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if all.get(proposer).is_some_and(|n| n.contains(name)) {
        return true;
    }
    let names = all.entry(proposer.to_string()).or_default();
    if names.len() < MAX_PLUGIN_COUNTERS {
        names.insert(name.to_string());
        return true;
    }
    if names.len() == MAX_PLUGIN_COUNTERS {
        // The marker (not a valid cleaned name) makes the warning once.
        names.insert("-".to_string());
        tracing::warn!(
            proposer = %proposer,
            "plugin counters past {MAX_PLUGIN_COUNTERS} distinct names are dropped"
        );
    }
    false
}

pub(super) unsafe extern "C" fn host_counter(ctx: *mut c_void, name: abi::Str, value: u64) {
    callback("counter_add", (), || {
        let Some(ctx) = lookup(ctx) else { return };
        // SAFETY: `name` is valid for the call (the ABI's contract).
        let name = unsafe { abi_string(name) };
        let clean: String = name
            .chars()
            .take(64)
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        if !counter_admitted(&ctx.proposer, &clean) {
            return;
        }
        metrics::counter!(format!("specd_plugin_{clean}_total"), "proposer" => ctx.proposer.clone())
            .increment(value);
    })
}

pub(super) unsafe extern "C" fn host_embed(
    ctx: *mut c_void,
    tokens: *const u32,
    n: usize,
    out: *mut f32,
    cap: usize,
) -> usize {
    callback("embed", 0, || {
        if tokens.is_null() || out.is_null() {
            return 0;
        }
        let Some(ctx) = lookup(ctx) else { return 0 };
        let Some(m) = ctx.model() else { return 0 };
        let h = m.config.hidden;
        // Checked before any pointer is read: `n * h` may overflow.
        match n.checked_mul(h) {
            Some(need) if need <= cap => {}
            _ => return 0,
        }
        // SAFETY: the plugin passes `n` tokens and `cap` writable floats;
        // `n * h <= cap` was checked above without overflow.
        let (toks, out) = unsafe {
            (
                std::slice::from_raw_parts(tokens, n),
                std::slice::from_raw_parts_mut(out, cap),
            )
        };
        if toks.iter().any(|&t| t as usize >= m.config.vocab_size) {
            return 0;
        }
        for (i, &t) in toks.iter().enumerate() {
            m.weights
                .embed
                .dequantize_row(t as usize, &mut out[i * h..(i + 1) * h]);
        }
        n * h
    })
}

pub(super) unsafe extern "C" fn host_lm_head(
    ctx: *mut c_void,
    hidden: *const f32,
    rows: usize,
    out: *mut f32,
    cap: usize,
) -> usize {
    callback("lm_head", 0, || {
        if hidden.is_null() || out.is_null() {
            return 0;
        }
        let Some(ctx) = lookup(ctx) else { return 0 };
        let Some(m) = ctx.model() else { return 0 };
        let (h, v) = (m.config.hidden, m.config.vocab_size);
        let (Some(need), Some(input)) = (rows.checked_mul(v), rows.checked_mul(h)) else {
            return 0;
        };
        if need > cap {
            return 0;
        }
        // SAFETY: the plugin passes `rows * hidden` floats and `cap`
        // writable floats; both products were checked without overflow.
        let (hs, out) = unsafe {
            (
                std::slice::from_raw_parts(hidden, input),
                std::slice::from_raw_parts_mut(out, cap),
            )
        };
        let logits = m.lm_head(hs, rows);
        if logits.len() > out.len() {
            return 0;
        }
        out[..logits.len()].copy_from_slice(&logits);
        logits.len()
    })
}

pub(super) unsafe extern "C" fn host_token_text(
    ctx: *mut c_void,
    token: u32,
    out: *mut u8,
    cap: usize,
) -> usize {
    callback("token_text", 0, || {
        let Some(ctx) = lookup(ctx) else { return 0 };
        let Some(text) = ctx.tokenizer().and_then(|t| t.id_to_token(token)) else {
            return 0;
        };
        if out.is_null() || text.len() > cap {
            return 0;
        }
        // SAFETY: `cap` writable bytes, and `text.len() <= cap`.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), out, text.len()) };
        text.len()
    })
}

#[cfg(test)]
mod tests {
    use super::{counter_admitted, MAX_PLUGIN_COUNTERS};

    #[test]
    fn a_plugin_creates_a_bounded_number_of_counters() {
        let p = "counter-test-proposer";
        for i in 0..MAX_PLUGIN_COUNTERS {
            assert!(counter_admitted(p, &format!("c{i}")));
        }
        // New names past the cap are dropped; known ones still count.
        assert!(!counter_admitted(p, "one_more"));
        assert!(!counter_admitted(p, "and_another"));
        assert!(counter_admitted(p, "c0"));
        // Per proposer: another has its own allowance.
        assert!(counter_admitted("counter-test-other", "one_more"));
    }
}
