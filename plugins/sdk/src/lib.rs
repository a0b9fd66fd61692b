//! Write a specd proposer plugin in safe Rust.
//!
//! Implement [`Plugin`] and call [`export_proposer!`]; build the crate as a
//! `cdylib`. The macro generates the C ABI entry point and vtable; every
//! exported function catches panics and reports them as a status with a
//! message, so a panic never crosses into the host.
//!
//! ```ignore
//! struct Mine;
//! impl specd_plugin_sdk::Plugin for Mine { /* ... */ }
//! specd_plugin_sdk::export_proposer!(Mine);
//! ```
//!
//! Threads: the host drives one instance from one thread at a time, but
//! possibly a different thread from call to call, so a `Plugin` must be
//! `Send` (it need not be `Sync`). [`Host`] callbacks may be used inside
//! any trait method, on the calling thread.
//!
//! Drafts may be chains or trees ([`Proposal::parents`]); see the ABI
//! crate for the draft contract that keeps sampling lossless.

pub use specd_plugin_abi as abi;

use abi::{Capabilities, HostApi, Str};

/// Draft distribution at one position.
///
/// The contract: the drafted token must be drawn from this q (under greedy
/// decoding, the argmax, reported as `OneHot`). The host checks that q is
/// of the declared kind, a distribution (finite, non-negative, total 1
/// within 1e-3) and gives the drafted token positive mass; a proposer that
/// breaks this is poisoned (its sequences decode without speculation).
#[derive(Debug, Clone, PartialEq)]
pub enum Q {
    OneHot,
    /// (token, probability) pairs; the rest has probability 0.
    Sparse(Vec<(u32, f32)>),
    /// Dense over the vocabulary.
    Full(Vec<f32>),
    /// For a node that is not its parent's first child: the first
    /// sibling's q (siblings are drawn from one q).
    AsFirstSibling,
}

/// One sequence's draft, as a plugin returns it (the host validates it and
/// turns it into its own `Draft`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// One per token (may be empty for one-hot proposers).
    pub q: Vec<Q>,
    /// Parent index per token for tree drafts (`-1`: off the context;
    /// always smaller than the node's index), siblings in the order drawn.
    pub parents: Option<Vec<i32>>,
}

impl Proposal {
    pub fn one_hot(tokens: Vec<u32>) -> Self {
        Self {
            tokens,
            q: Vec::new(),
            parents: None,
        }
    }
}

/// How the children of one tree node are drawn from its q.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Siblings {
    /// Independently (with replacement).
    Iid,
    /// One after another without replacement: distinct tokens.
    #[default]
    WithoutReplacement,
}

/// Draw one sibling without replacement: remove and return an entry of
/// `left` (token, weight) chosen in proportion to its weight, with `u` a
/// uniform draw in [0, 1). Calling it again on what is left draws the next
/// sibling from q renormalised without the earlier ones, which is what
/// [`Siblings::WithoutReplacement`] declares to the host. `None` when
/// `left` is empty.
pub fn take_without_replacement(left: &mut Vec<(u32, f32)>, u: f64) -> Option<(u32, f32)> {
    if left.is_empty() {
        return None;
    }
    let z: f64 = left.iter().map(|(_, p)| f64::from(*p)).sum();
    let target = u * z;
    let mut cum = 0f64;
    let mut pick = left.len() - 1;
    for (j, (_, p)) in left.iter().enumerate() {
        cum += f64::from(*p);
        if target < cum {
            pick = j;
            break;
        }
    }
    Some(left.remove(pick))
}

/// What the proposer needs and produces.
#[derive(Debug, Clone, PartialEq)]
pub struct Caps {
    pub q_kind: u32,
    pub sparse_k: u32,
    /// Most draft tokens (tree nodes) per sequence and call.
    pub max_draft: u32,
    pub tree: bool,
    /// Deepest tree node (0: `max_draft`).
    pub max_depth: u32,
    pub siblings: Siblings,
    /// Target layers whose hidden states it wants, in the order it wants
    /// them (at most 8).
    pub hidden_layers: Vec<u32>,
    pub needs_embeddings: bool,
    pub needs_output_head: bool,
    /// Bytes of per-sequence cache kept per token of a sequence, at most
    /// (a draft model's KV cache): the host counts them in its KV budget.
    pub kv_bytes_per_token: u32,
}

impl Caps {
    pub fn one_hot(max_draft: u32) -> Self {
        Self {
            q_kind: abi::Q_ONE_HOT,
            sparse_k: 0,
            max_draft,
            tree: false,
            max_depth: 0,
            siblings: Siblings::default(),
            hidden_layers: Vec::new(),
            needs_embeddings: false,
            needs_output_head: false,
            kv_bytes_per_token: 0,
        }
    }

    pub fn to_abi(&self) -> Capabilities {
        let mut layers = [0u32; 8];
        let n = self.hidden_layers.len().min(8);
        layers[..n].copy_from_slice(&self.hidden_layers[..n]);
        Capabilities {
            struct_size: abi::size_of::<Capabilities>(),
            q_kind: self.q_kind,
            sparse_k: self.sparse_k,
            max_draft: self.max_draft,
            tree: u32::from(self.tree),
            max_depth: self.max_depth,
            sibling_mode: match self.siblings {
                Siblings::Iid => abi::SIBLINGS_IID,
                Siblings::WithoutReplacement => abi::SIBLINGS_WITHOUT_REPLACEMENT,
            },
            n_hidden_layers: n as u32,
            hidden_layers: layers,
            needs_embeddings: u32::from(self.needs_embeddings),
            needs_output_head: u32::from(self.needs_output_head),
            kv_bytes_per_token: self.kv_bytes_per_token,
        }
    }
}

/// One sequence of a propose call, borrowed from the host.
#[derive(Debug, Clone, Copy)]
pub struct SeqView<'a> {
    pub seq: u64,
    pub tokens: &'a [u32],
    pub max_draft: usize,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    /// The seed to draw this sequence's drafts with: apart from the
    /// engine's acceptance stream, and new whenever the sequence is seen
    /// again from the start (it mixes in the committed length), so seed a
    /// sequence's generator from it when the sequence is first seen.
    pub seed: u64,
    /// Hidden states of the declared layers, in declaration order, for
    /// every position committed since this proposer last saw the sequence
    /// (prefill positions included), at most the newest few thousand (the
    /// host's `max_hidden_rows`, default 4,096, plus up to a quarter more
    /// before it trims; `hidden_start` then skips the older positions):
    /// `hidden_layers` blocks of `hidden_rows x hidden_width`, rows for
    /// positions `hidden_start..hidden_start + hidden_rows`. See
    /// [`SeqView::layer`].
    pub hidden: &'a [f32],
    pub hidden_rows: usize,
    pub hidden_width: usize,
    pub hidden_layers: usize,
    pub hidden_start: u64,
}

impl<'a> SeqView<'a> {
    /// The rows of the `i`-th declared layer (`hidden_rows x hidden_width`).
    pub fn layer(&self, i: usize) -> &'a [f32] {
        let n = self.hidden_rows * self.hidden_width;
        self.hidden.get(i * n..(i + 1) * n).unwrap_or(&[])
    }

    /// Greedy decoding (the draft is then checked against the target's
    /// argmax and q may be one-hot).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

/// The host's callbacks (logging, metrics, target embeddings and head).
#[derive(Debug, Clone, Copy)]
pub struct Host {
    api: HostApi,
}

// SAFETY: specd's callbacks are thread-safe and catch their own panics, and
// the `ctx` they receive is a handle the host looks up in a table of live
// instances (never dereferenced as an address): a copy of `Host` used from
// another thread, even after its instance was destroyed, gets the
// callbacks' error results, never freed memory.
unsafe impl Send for Host {}

fn to_str(s: &str) -> Str {
    Str {
        ptr: s.as_ptr(),
        len: s.len(),
    }
}

impl Host {
    /// # Safety
    /// `api` must be a valid host API table whose callbacks outlive the
    /// instance (the host guarantees this for the table it passes to
    /// `create`).
    pub unsafe fn from_abi(api: HostApi) -> Self {
        Self { api }
    }

    /// Log through the host's logger (level: 0 error .. 3 debug).
    pub fn log(&self, level: u32, msg: &str) {
        if let Some(f) = self.api.log {
            // SAFETY: valid callback (see `from_abi`); `msg` outlives the call.
            unsafe { f(self.api.ctx, level, to_str(msg)) }
        }
    }

    /// Add to the host counter `specd_plugin_<name>_total`.
    pub fn counter(&self, name: &str, value: u64) {
        if let Some(f) = self.api.counter_add {
            // SAFETY: valid callback; `name` outlives the call.
            unsafe { f(self.api.ctx, to_str(name), value) }
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.api.vocab_size as usize
    }

    pub fn hidden_size(&self) -> usize {
        self.api.hidden_size as usize
    }

    /// The target's number of layers (`None` from a host older than ABI
    /// 2.1, or without a target model).
    pub fn n_layers(&self) -> Option<usize> {
        (self.api.n_layers > 0).then_some(self.api.n_layers as usize)
    }

    /// Target embeddings of `tokens` (`tokens.len() x hidden_size`).
    pub fn embed(&self, tokens: &[u32]) -> Option<Vec<f32>> {
        let f = self.api.embed?;
        let mut out = vec![0f32; tokens.len() * self.hidden_size()];
        // SAFETY: valid callback; both buffers are live and sized as passed.
        let n = unsafe {
            f(
                self.api.ctx,
                tokens.as_ptr(),
                tokens.len(),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        (n == out.len()).then_some(out)
    }

    /// Target output head over final-normed hidden rows (`rows x vocab`).
    pub fn lm_head(&self, hidden: &[f32], rows: usize) -> Option<Vec<f32>> {
        let f = self.api.lm_head?;
        let mut out = vec![0f32; rows * self.vocab_size()];
        // SAFETY: valid callback; both buffers are live and sized as passed.
        let n = unsafe {
            f(
                self.api.ctx,
                hidden.as_ptr(),
                rows,
                out.as_mut_ptr(),
                out.len(),
            )
        };
        (n == out.len()).then_some(out)
    }

    /// Raw vocabulary string of a token.
    pub fn token_text(&self, token: u32) -> Option<String> {
        let f = self.api.token_text?;
        let mut buf = vec![0u8; 256];
        // SAFETY: valid callback; `buf` is live with the capacity passed.
        let n = unsafe { f(self.api.ctx, token, buf.as_mut_ptr(), buf.len()) };
        if n == 0 || n > buf.len() {
            return None;
        }
        buf.truncate(n);
        String::from_utf8(buf).ok()
    }
}

/// Typed access to the `[proposer.options]` table.
#[derive(Debug, Clone, Default)]
pub struct Options {
    table: toml::Table,
}

/// A type an option can be read as.
pub trait FromOption: Sized {
    const EXPECTED: &'static str;
    fn from_value(v: &toml::Value) -> Option<Self>;
}

macro_rules! int_option {
    ($($t:ty),*) => {$(
        impl FromOption for $t {
            const EXPECTED: &'static str = concat!("an integer (", stringify!($t), ")");
            fn from_value(v: &toml::Value) -> Option<Self> {
                v.as_integer().and_then(|i| <$t>::try_from(i).ok())
            }
        }
    )*};
}
int_option!(i64, u64, u32, usize);

impl FromOption for f64 {
    const EXPECTED: &'static str = "a number";
    fn from_value(v: &toml::Value) -> Option<Self> {
        v.as_float().or_else(|| v.as_integer().map(|i| i as f64))
    }
}

impl FromOption for f32 {
    const EXPECTED: &'static str = "a number";
    fn from_value(v: &toml::Value) -> Option<Self> {
        f64::from_value(v).map(|x| x as f32)
    }
}

impl FromOption for bool {
    const EXPECTED: &'static str = "a boolean";
    fn from_value(v: &toml::Value) -> Option<Self> {
        v.as_bool()
    }
}

impl FromOption for String {
    const EXPECTED: &'static str = "a string";
    fn from_value(v: &toml::Value) -> Option<Self> {
        v.as_str().map(str::to_string)
    }
}

impl FromOption for Vec<Vec<usize>> {
    const EXPECTED: &'static str = "an array of arrays of non-negative integers";
    fn from_value(v: &toml::Value) -> Option<Self> {
        v.as_array()?
            .iter()
            .map(|row| {
                row.as_array()?
                    .iter()
                    .map(|x| x.as_integer().and_then(|i| usize::try_from(i).ok()))
                    .collect()
            })
            .collect()
    }
}

impl Options {
    /// Parse the options table the host passed as TOML text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let table: toml::Table = text
            .parse()
            .map_err(|e| format!("options are not valid TOML: {e}"))?;
        Ok(Self { table })
    }

    /// `key` as `T`, or `default` when absent; a value of the wrong type is
    /// an error naming the key and the expected type.
    pub fn get<T: FromOption>(&self, key: &str, default: T) -> Result<T, String> {
        match self.table.get(key) {
            None => Ok(default),
            Some(v) => T::from_value(v).ok_or_else(|| {
                format!(
                    "option `{key}`: expected {}, got {} `{v}`",
                    T::EXPECTED,
                    v.type_str()
                )
            }),
        }
    }

    /// Set `key` to a string `value` unless it is present.
    pub fn set_default(&mut self, key: &str, value: &str) {
        self.table
            .entry(key.to_string())
            .or_insert_with(|| toml::Value::String(value.to_string()));
    }

    /// Fail on keys outside `known`, naming the first unknown one.
    pub fn reject_unknown(&self, known: &[&str]) -> Result<(), String> {
        match self.table.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => Err(format!(
                "unknown option `{k}` (known: {})",
                known.join(", ")
            )),
            None => Ok(()),
        }
    }
}

/// (position, features) rows: the declared layers' states of one
/// position side by side.
pub type FeatureRows = Vec<(usize, Vec<f32>)>;

/// The feature rows of `s` ready for a head-based proposer: those of
/// committed positions before the newest token (rows for later positions
/// wait in `pending` until the sequence reaches past them), at most the
/// newest `window` (0: all) plus the sequence's first `sink` positions.
/// Rows the window drops are never copied. A view whose `hidden` is
/// shorter than its rows say is refused.
pub fn feature_rows(
    s: &SeqView<'_>,
    pending: &mut FeatureRows,
    window: usize,
    sink: usize,
) -> Result<FeatureRows, String> {
    let (n, h, start) = (s.tokens.len(), s.hidden_width, s.hidden_start as usize);
    if s.hidden.len() < s.hidden_rows * s.hidden_layers * h {
        return Err(format!(
            "{} feature values delivered for {} rows of {} layers x {h}",
            s.hidden.len(),
            s.hidden_rows,
            s.hidden_layers
        ));
    }
    let first = if window > 0 {
        n.saturating_sub(window + 1).saturating_sub(start)
    } else {
        0
    };
    for r in 0..s.hidden_rows {
        if r < first && start + r >= sink {
            continue;
        }
        let mut f = Vec::with_capacity(s.hidden_layers * h);
        for l in 0..s.hidden_layers {
            f.extend_from_slice(&s.layer(l)[r * h..(r + 1) * h]);
        }
        pending.push((start + r, f));
    }
    let (mut ready, later): (FeatureRows, FeatureRows) =
        pending.drain(..).partition(|(p, _)| p + 1 < n);
    *pending = later;
    if window > 0 && ready.len() > window {
        let cut = ready.len() - window;
        let mut i = 0;
        ready.retain(|(p, _)| {
            i += 1;
            i > cut || *p < sink
        });
    }
    Ok(ready)
}

/// A proposer plugin.
pub trait Plugin: Sized + Send + 'static {
    /// The plugin's name (what configs refer to).
    const NAME: &'static str;
    const VERSION: &'static str;
    /// Capabilities before options are applied (the descriptor's).
    fn default_capabilities() -> Caps;
    fn create(options: &Options, host: Host) -> Result<Self, String>;
    fn capabilities(&self) -> Caps;
    fn start(&mut self, seq: u64, tokens: &[u32]) -> Result<(), String>;
    /// One draft per input, in order; at most `max_draft` tokens each.
    /// Every drafted token must be drawn from the [`Q`] reported for it.
    fn propose(&mut self, batch: &[SeqView<'_>]) -> Result<Vec<Proposal>, String>;
    /// Tokens the last step committed for `seq` (accepted drafts, then the
    /// correction or bonus token) and the accepted path through the last
    /// draft (node indices, root first).
    fn observe(&mut self, seq: u64, tokens: &[u32], path: &[u32]) -> Result<(), String>;
    fn finish(&mut self, seq: u64);
}

#[doc(hidden)]
pub mod ffi;

/// Export `$ty` (a [`Plugin`]) as this cdylib's plugin.
#[macro_export]
macro_rules! export_proposer {
    ($ty:ty) => {
        // specd keeps a failing plugin from taking the daemon down by
        // catching its panics at the C ABI boundary (the host then serves
        // the plugin's sequences without speculation). Under
        // `panic = "abort"` there is nothing to catch: one panic kills the
        // whole process with every request in flight.
        #[cfg(panic = "abort")]
        ::core::compile_error!(
            "export_proposer!: this plugin is built with panic = \"abort\". specd catches a plugin's panics at the C ABI boundary so that a failing plugin degrades to plain decoding; under panic = \"abort\" a panic would abort the daemon and every request in flight. Build plugins with panic = \"unwind\" (the default): remove `panic = \"abort\"` from the [profile.*] sections that build this crate."
        );
        /// The plugin entry point.
        #[no_mangle]
        pub extern "C" fn specd_proposer_entry() -> *const $crate::abi::Descriptor {
            static DESC: ::std::sync::OnceLock<$crate::abi::Descriptor> =
                ::std::sync::OnceLock::new();
            // A panic in the plugin's `default_capabilities` must not
            // unwind into the host: no descriptor, which the host reports.
            ::std::panic::catch_unwind(|| {
                DESC.get_or_init($crate::ffi::descriptor::<$ty>) as *const $crate::abi::Descriptor
            })
            .unwrap_or(::core::ptr::null())
        }
    };
}

#[cfg(test)]
mod tests {
    use super::{feature_rows, take_without_replacement, FeatureRows, SeqView};

    fn view<'a>(tokens: &'a [u32], hidden: &'a [f32], start: u64, rows: usize) -> SeqView<'a> {
        SeqView {
            seq: 1,
            tokens,
            max_draft: 4,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            hidden,
            hidden_rows: rows,
            hidden_width: 2,
            hidden_layers: 1,
            hidden_start: start,
        }
    }

    #[test]
    fn feature_rows_keep_the_window_the_sink_and_wait_for_the_next_token() {
        // 12 tokens, features of positions 0..12 (value = position).
        let tokens: Vec<u32> = (0..12).collect();
        let hidden: Vec<f32> = (0..12).flat_map(|p| [p as f32, -(p as f32)]).collect();
        let mut pending = FeatureRows::new();
        let ready = feature_rows(&view(&tokens, &hidden, 0, 12), &mut pending, 3, 2).unwrap();
        // Positions before the newest token only; the newest 3 and the
        // first 2 (the sink).
        let pos: Vec<usize> = ready.iter().map(|r| r.0).collect();
        assert_eq!(pos, vec![0, 1, 8, 9, 10]);
        assert_eq!(ready[2].1, vec![8.0, -8.0]);
        // Position 11 waits until the sequence has a token after it.
        assert_eq!(pending.len(), 1);
        let longer: Vec<u32> = (0..13).collect();
        let ready = feature_rows(&view(&longer, &[], 12, 0), &mut pending, 3, 2).unwrap();
        assert_eq!(ready.iter().map(|r| r.0).collect::<Vec<_>>(), vec![11]);
        assert!(pending.is_empty());
        // A view shorter than its rows say is refused, not sliced.
        let e = feature_rows(&view(&tokens, &hidden[..5], 0, 12), &mut pending, 0, 2).unwrap_err();
        assert!(e.contains("5 feature values"), "{e}");
    }

    #[test]
    fn draws_follow_the_weights_and_never_repeat() {
        let q = vec![(7u32, 0.5f32), (3, 0.3), (9, 0.2)];
        // Where u falls in the cumulative weights picks the entry.
        for (u, want) in [
            (0.0, 7),
            (0.49, 7),
            (0.5, 3),
            (0.79, 3),
            (0.8, 9),
            (0.999, 9),
        ] {
            let mut left = q.clone();
            assert_eq!(
                take_without_replacement(&mut left, u).map(|x| x.0),
                Some(want)
            );
            assert_eq!(left.len(), 2);
        }
        // The second draw renormalises over what is left: with 7 gone,
        // 3 holds 0.3 / 0.5 of the mass.
        let mut left = q.clone();
        take_without_replacement(&mut left, 0.1);
        assert_eq!(
            take_without_replacement(&mut left, 0.59).map(|x| x.0),
            Some(3)
        );
        assert_eq!(
            take_without_replacement(&mut left, 0.61).map(|x| x.0),
            Some(9)
        );
        assert_eq!(take_without_replacement(&mut left, 0.5), None);
    }
}
