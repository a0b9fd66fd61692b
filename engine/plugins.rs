//! The proposer plugin host: finds, loads and validates plugin libraries and
//! adapts a plugin instance to the engine's `Proposer` trait.
//!
//! Invariants:
//! - A library is validated before any of its functions is called: the entry
//!   symbol must exist, `abi_major` must equal ours, and only
//!   `min(struct_size, size_of::<Descriptor>())` bytes of the descriptor are
//!   read.
//! - Libraries are never unloaded (instances and callbacks may outlive any
//!   one owner); each path is loaded once per process.
//! - Every call into a plugin goes through its vtable with host-allocated
//!   buffers; a non-OK status becomes an `Err` carrying the plugin's message,
//!   which the `Drafter` turns into poisoning (plain decoding), never a lost
//!   request.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use specd_plugin_abi as abi;

use crate::error::{Result, SpecdError};
use crate::model::Model;
use crate::sampler::Distribution;
use crate::speculative::proposer::{Capabilities, Draft, DraftQ, ProposeInput, Proposer, QKind};
use crate::speculative::SeqId;
use crate::tokenizer::Tokenizer;

/// A validated, loaded plugin library.
#[derive(Debug)]
pub struct PluginLibrary {
    pub path: PathBuf,
    pub name: String,
    pub version: String,
    pub build_id: String,
    pub abi_minor: u32,
    caps: abi::Capabilities,
    vtable: abi::VTable,
}

fn plugin_err(path: &Path, why: impl std::fmt::Display) -> SpecdError {
    SpecdError::Plugin(format!("{}: {why}", path.display()))
}

/// # Safety
/// `s` must point to `len` bytes valid for the life of the library.
unsafe fn abi_string(s: abi::Str) -> String {
    if s.ptr.is_null() || s.len == 0 {
        return String::new();
    }
    // SAFETY: guaranteed by the caller (descriptor strings are static).
    let bytes = unsafe { std::slice::from_raw_parts(s.ptr, s.len) };
    String::from_utf8_lossy(bytes).into_owned()
}

fn registry() -> &'static Mutex<HashMap<PathBuf, Arc<PluginLibrary>>> {
    static LIBS: OnceLock<Mutex<HashMap<PathBuf, Arc<PluginLibrary>>>> = OnceLock::new();
    LIBS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Load and validate the plugin library at `path` (once per process).
pub fn load_library(path: &Path) -> Result<Arc<PluginLibrary>> {
    let canon = path
        .canonicalize()
        .map_err(|e| plugin_err(path, format!("cannot open: {e}")))?;
    let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(l) = reg.get(&canon) {
        return Ok(l.clone());
    }
    // SAFETY: loading a library runs its initialisers. We only load files
    // the operator configured as specd plugins; that trust is the contract
    // of a plugin system. Errors (not a library, wrong architecture) come
    // back as `Err` without running anything.
    let lib = unsafe { libloading::Library::new(&canon) }
        .map_err(|e| plugin_err(path, format!("not a loadable library: {e}")))?;
    // SAFETY: the symbol is looked up by name; its type is fixed by the ABI.
    let entry: libloading::Symbol<'_, abi::EntryFn> = unsafe { lib.get(abi::ENTRY_SYMBOL) }.map_err(|_| {
        plugin_err(
            path,
            "missing entry symbol `specd_proposer_entry`: not a specd proposer plugin (build it with specd-plugin-sdk's export_proposer!)",
        )
    })?;
    // SAFETY: calling the plugin's entry function, which the ABI defines as
    // returning a pointer to a static descriptor (or null).
    let desc_ptr = unsafe { entry() };
    if desc_ptr.is_null() {
        return Err(plugin_err(path, "entry symbol returned no descriptor"));
    }
    // Read the versions first: their offsets never change.
    // SAFETY: every descriptor starts with abi_major, abi_minor, struct_size.
    let (major, minor, size) = unsafe {
        let p = desc_ptr as *const u32;
        (
            p.read_unaligned(),
            p.add(1).read_unaligned(),
            p.add(2).read_unaligned(),
        )
    };
    if major != abi::ABI_MAJOR {
        return Err(plugin_err(
            path,
            format!(
                "ABI mismatch: plugin built for ABI {major}.{minor}, this host speaks ABI {}.{}",
                abi::ABI_MAJOR,
                abi::ABI_MINOR
            ),
        ));
    }
    let known = std::mem::size_of::<abi::Descriptor>();
    if (size as usize) < known {
        return Err(plugin_err(
            path,
            format!("descriptor of {size} bytes is smaller than ABI {major}.0's {known}"),
        ));
    }
    // SAFETY: the plugin declares at least `known` readable bytes (checked
    // above); we copy exactly our struct's size, ignoring appended fields.
    let desc: abi::Descriptor = unsafe { std::ptr::read_unaligned(desc_ptr) };
    // SAFETY: descriptor strings are static in the library, never unloaded.
    let (name, version, build_id) = unsafe {
        (
            abi_string(desc.name),
            abi_string(desc.version),
            abi_string(desc.build_id),
        )
    };
    if name.is_empty() {
        return Err(plugin_err(path, "descriptor has an empty name"));
    }
    let loaded = Arc::new(PluginLibrary {
        path: canon.clone(),
        name,
        version,
        build_id,
        abi_minor: minor,
        caps: desc.caps,
        vtable: desc.vtable,
    });
    // Never unload: instances and their callbacks may outlive any owner.
    std::mem::forget(lib);
    reg.insert(canon, loaded.clone());
    tracing::info!(plugin = %loaded.name, version = %loaded.version, build = %loaded.build_id, path = %path.display(), "loaded proposer plugin");
    Ok(loaded)
}

/// The directories searched for plugins by name: `extra` (from config),
/// `$SPECD_PLUGIN_PATH`, then the running executable's directory and its
/// parent (cargo puts workspace cdylibs in `target/<profile>/`, test
/// binaries in `target/<profile>/deps/`).
pub fn plugin_dirs(extra: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = extra.to_vec();
    if let Some(p) = std::env::var_os("SPECD_PLUGIN_PATH") {
        dirs.extend(std::env::split_paths(&p));
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(d) = exe.parent() {
            dirs.push(d.to_path_buf());
            if let Some(pp) = d.parent() {
                dirs.push(pp.to_path_buf());
            }
        }
    }
    dirs
}

/// File names a plugin called `name` may have.
pub fn library_names(name: &str) -> Vec<String> {
    let (pre, suf) = (std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    let snake = name.replace('-', "_");
    vec![
        format!("{pre}specd_proposer_{snake}{suf}"),
        format!("{pre}{snake}{suf}"),
    ]
}

/// Find plugin `name` in `dirs`.
pub fn find_plugin(name: &str, dirs: &[PathBuf]) -> Result<PathBuf> {
    for d in dirs {
        for f in library_names(name) {
            let p = d.join(&f);
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    Err(SpecdError::Plugin(format!(
        "unknown plugin '{name}': none of {} in {} (build it with `cargo build --release --workspace`, add its directory to [plugins] dirs, or give `path`)",
        library_names(name).join(" / "),
        dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
    )))
}

/// What the host offers plugins through `HostApi`.
struct HostCtx {
    proposer: String,
    model: Option<Arc<Model>>,
    tokenizer: Option<Arc<Tokenizer>>,
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

unsafe extern "C" fn host_log(ctx: *mut c_void, level: u32, msg: abi::Str) {
    callback("log", (), || {
        if ctx.is_null() {
            return;
        }
        // SAFETY: `ctx` is the `HostCtx` this instance was created with,
        // alive until the instance is destroyed; `msg` is valid for the call.
        let (ctx, msg) = unsafe { (&*(ctx as *const HostCtx), abi_string(msg)) };
        match level {
            0 => tracing::error!(proposer = %ctx.proposer, "{msg}"),
            1 => tracing::warn!(proposer = %ctx.proposer, "{msg}"),
            2 => tracing::info!(proposer = %ctx.proposer, "{msg}"),
            _ => tracing::debug!(proposer = %ctx.proposer, "{msg}"),
        }
    })
}

unsafe extern "C" fn host_counter(ctx: *mut c_void, name: abi::Str, value: u64) {
    callback("counter_add", (), || {
        if ctx.is_null() {
            return;
        }
        // SAFETY: as in `host_log`.
        let (ctx, name) = unsafe { (&*(ctx as *const HostCtx), abi_string(name)) };
        let clean: String = name
            .chars()
            .take(64)
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        metrics::counter!(format!("specd_plugin_{clean}_total"), "proposer" => ctx.proposer.clone())
            .increment(value);
    })
}

unsafe extern "C" fn host_embed(
    ctx: *mut c_void,
    tokens: *const u32,
    n: usize,
    out: *mut f32,
    cap: usize,
) -> usize {
    callback("embed", 0, || {
        if ctx.is_null() || tokens.is_null() || out.is_null() {
            return 0;
        }
        // SAFETY: as in `host_log`.
        let ctx = unsafe { &*(ctx as *const HostCtx) };
        let Some(m) = &ctx.model else { return 0 };
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

unsafe extern "C" fn host_lm_head(
    ctx: *mut c_void,
    hidden: *const f32,
    rows: usize,
    out: *mut f32,
    cap: usize,
) -> usize {
    callback("lm_head", 0, || {
        if ctx.is_null() || hidden.is_null() || out.is_null() {
            return 0;
        }
        // SAFETY: as in `host_log`.
        let ctx = unsafe { &*(ctx as *const HostCtx) };
        let Some(m) = &ctx.model else { return 0 };
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

unsafe extern "C" fn host_token_text(
    ctx: *mut c_void,
    token: u32,
    out: *mut u8,
    cap: usize,
) -> usize {
    callback("token_text", 0, || {
        if ctx.is_null() {
            return 0;
        }
        // SAFETY: as in `host_log`.
        let ctx = unsafe { &*(ctx as *const HostCtx) };
        let Some(text) = ctx.tokenizer.as_ref().and_then(|t| t.id_to_token(token)) else {
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

/// A plugin instance as an engine `Proposer`.
pub struct PluginProposer {
    name: String,
    lib: Arc<PluginLibrary>,
    inst: abi::Instance,
    caps: abi::Capabilities,
    vocab: usize,
    // Boxed so the pointers handed to the plugin stay put.
    _host: Box<abi::HostApi>,
    _ctx: Box<HostCtx>,
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
        let vocab = model.as_ref().map(|m| m.config.vocab_size).unwrap_or(0);
        let hidden = model.as_ref().map(|m| m.config.hidden).unwrap_or(0);
        let ctx = Box::new(HostCtx {
            proposer: name.to_string(),
            model,
            tokenizer,
        });
        let host = Box::new(abi::HostApi {
            struct_size: std::mem::size_of::<abi::HostApi>() as u32,
            ctx: &*ctx as *const HostCtx as *mut c_void,
            log: host_log,
            counter_add: host_counter,
            vocab_size: vocab as u32,
            hidden_size: hidden as u32,
            embed: host_embed,
            lm_head: host_lm_head,
            token_text: host_token_text,
        });
        let text = toml::to_string(options)
            .map_err(|e| SpecdError::Plugin(format!("proposer '{name}': options: {e}")))?;
        let mut inst: abi::Instance = std::ptr::null_mut();
        let mut err = vec![0u8; 4096];
        let mut written = 0usize;
        // SAFETY: vtable from a validated descriptor; every pointer is live
        // for the call and `err` has the capacity passed.
        let status = unsafe {
            (lib.vtable.create)(
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
        let mut caps = lib.caps;
        // SAFETY: valid instance and a writable struct.
        if unsafe { (lib.vtable.capabilities)(inst, &mut caps) } != abi::STATUS_OK {
            caps = lib.caps;
        }
        let mut p = Self {
            name: name.to_string(),
            lib,
            inst,
            caps,
            vocab,
            _host: host,
            _ctx: ctx,
        };
        if p.caps.tree != 0 {
            return Err(SpecdError::Plugin(format!(
                "proposer '{name}': tree drafts are not verified by this host yet"
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
        let n = unsafe { (self.lib.vtable.last_error)(self.inst, buf.as_mut_ptr(), buf.len()) };
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
        unsafe { (self.lib.vtable.destroy)(self.inst) };
    }
}

impl Proposer for PluginProposer {
    fn name(&self) -> &str {
        &self.name
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
        }
    }

    fn start(&mut self, seq: SeqId, prompt: &[u32]) -> std::result::Result<(), String> {
        // SAFETY: valid instance; the token buffer is live for the call.
        let s = unsafe { (self.lib.vtable.start)(self.inst, seq, prompt.as_ptr(), prompt.len()) };
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
        let draft_cap = batch.iter().map(|b| b.max_draft).max().unwrap_or(0).max(1);
        let q_cap = match self.caps.q_kind {
            abi::Q_SPARSE => self.caps.sparse_k.max(1) as usize,
            abi::Q_FULL => self.vocab,
            _ => 0,
        };
        let hidden: Vec<Vec<f32>> = batch
            .iter()
            .map(|b| {
                b.hidden
                    .iter()
                    .flat_map(|(_, h)| h.iter().copied())
                    .collect()
            })
            .collect();
        let width = self
            ._ctx
            .model
            .as_ref()
            .map(|m| m.config.hidden)
            .unwrap_or(0);
        let inputs: Vec<abi::SeqInput> = batch
            .iter()
            .zip(&hidden)
            .map(|(b, h)| {
                let rows = match (b.hidden.first(), width) {
                    (Some((_, first)), w) if w > 0 => first.len() / w,
                    _ => 0,
                };
                abi::SeqInput {
                    seq: b.seq,
                    tokens: b.tokens.as_ptr(),
                    n_tokens: b.tokens.len(),
                    max_draft: b.max_draft as u32,
                    temperature: b.params.temperature,
                    top_k: b.params.top_k as u32,
                    top_p: b.params.top_p,
                    min_p: b.params.min_p,
                    seed: b.params.seed,
                    hidden: h.as_ptr(),
                    n_hidden_rows: rows as u32,
                    hidden_width: width as u32,
                }
            })
            .collect();
        let n = batch.len();
        let mut tokens = vec![0u32; n * draft_cap];
        let mut n_drafted = vec![0u32; n];
        let mut q_ids = vec![0u32; n * draft_cap * q_cap];
        let mut q_probs = vec![0f32; n * draft_cap * q_cap];
        let mut q_len = vec![0u32; n * draft_cap];
        let mut parents = vec![-1i32; n * draft_cap];
        let mut out = abi::DraftOut {
            draft_cap: draft_cap as u32,
            q_cap: q_cap as u32,
            tokens: tokens.as_mut_ptr(),
            n_drafted: n_drafted.as_mut_ptr(),
            q_ids: q_ids.as_mut_ptr(),
            q_probs: q_probs.as_mut_ptr(),
            q_len: q_len.as_mut_ptr(),
            parents: parents.as_mut_ptr(),
        };
        // SAFETY: valid instance; every buffer is live and sized exactly as
        // `out` describes; inputs point into `batch` and `hidden`, both live.
        let s = unsafe { (self.lib.vtable.propose)(self.inst, inputs.as_ptr(), n, &mut out) };
        if s != abi::STATUS_OK {
            return Err(self.error("propose", s));
        }
        let mut drafts = Vec::with_capacity(n);
        for (i, b) in batch.iter().enumerate() {
            let k = (n_drafted[i] as usize).min(b.max_draft).min(draft_cap);
            let mut d = Draft::default();
            for j in 0..k {
                let slot = i * draft_cap + j;
                let tok = tokens[slot];
                if self.vocab > 0 && tok as usize >= self.vocab {
                    return Err(format!(
                        "plugin {} drafted token {tok} outside the vocabulary",
                        self.lib.name
                    ));
                }
                d.tokens.push(tok);
                let base = slot * q_cap;
                d.q.push(match self.caps.q_kind {
                    // Nothing written: a one-hot q (allowed under greedy
                    // decoding whatever the declared kind).
                    abi::Q_SPARSE | abi::Q_FULL if q_len[slot] == 0 => DraftQ::OneHot,
                    abi::Q_SPARSE => {
                        let len = (q_len[slot] as usize).min(q_cap);
                        let mut pairs: Vec<(u32, f32)> = (0..len)
                            .map(|e| (q_ids[base + e], q_probs[base + e]))
                            .collect();
                        pairs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                        DraftQ::Sparse(Distribution {
                            ids: pairs.iter().map(|p| p.0).collect(),
                            probs: pairs.iter().map(|p| p.1).collect(),
                        })
                    }
                    abi::Q_FULL => DraftQ::Full(q_probs[base..base + q_cap].to_vec()),
                    _ => DraftQ::OneHot,
                });
            }
            drafts.push(d);
        }
        Ok(drafts)
    }

    fn observe(&mut self, seq: SeqId, committed: &[u32]) -> std::result::Result<(), String> {
        // SAFETY: valid instance; the token buffer is live for the call.
        let s = unsafe {
            (self.lib.vtable.observe)(self.inst, seq, committed.as_ptr(), committed.len())
        };
        if s == abi::STATUS_OK {
            Ok(())
        } else {
            Err(self.error("observe", s))
        }
    }

    fn finish(&mut self, seq: SeqId) {
        // SAFETY: valid instance.
        let s = unsafe { (self.lib.vtable.finish)(self.inst, seq) };
        if s != abi::STATUS_OK {
            tracing::warn!(proposer = %self.name, "{}", self.error("finish", s));
        }
    }
}
