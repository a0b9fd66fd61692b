//! The TOML configuration: model, engine limits, plugin directories, named
//! proposers, server and routing.
//!
//! Invariants:
//! - Unknown keys are rejected everywhere; every error names the file, the
//!   key and what was expected.
//! - Proposer names are unique; `none` is reserved for plain decoding.
//! - Relative paths are resolved against the config file's directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Result, SpecdError};
use crate::model::Model;
use crate::plugins::{self, PluginProposer};
use crate::speculative::compose::Compose;
use crate::speculative::drafter::Drafter;
use crate::speculative::driver::EngineConfig;
use crate::speculative::proposer::Proposer;
use crate::tokenizer::Tokenizer;

/// A chat template given as `value`: the file at `path` when one exists
/// (`.jinja` or anything else), else the text itself when it looks like a
/// template; a missing file named by a bare path is an error naming it.
pub fn read_template(path: &Path, value: &str) -> Result<String> {
    if path.is_file() {
        return std::fs::read_to_string(path).map_err(|e| SpecdError::Config {
            file: path.display().to_string(),
            msg: format!("chat template: {e}"),
        });
    }
    if value.contains("{{") || value.contains("{%") {
        return Ok(value.to_string());
    }
    Err(SpecdError::Config {
        file: path.display().to_string(),
        msg: "chat_template: no such file, and not template text".into(),
    })
}

/// The built-in default configuration (`configs/default.toml`).
pub const DEFAULT_TOML: &str = include_str!("../configs/default.toml");

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// GGUF file or safetensors directory; default: the embedded SmolLM2.
    pub path: Option<PathBuf>,
    pub threads: Option<usize>,
    /// Name served in the API (default: the file stem).
    pub name: Option<String>,
    /// KV cache element type: "f16" (default, half the memory) or "f32".
    pub kv_dtype: Option<crate::model::KvDtype>,
    /// Chat template replacing the model's (a base model's file has none):
    /// a file (relative to the config) or the template text itself.
    pub chat_template: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    pub max_batch_tokens: usize,
    pub max_running: usize,
    pub max_draft: usize,
    /// KV budget in blocks of 64 tokens; 0: `max_running` full contexts.
    pub kv_blocks: usize,
    /// Proposer for requests that name none (`none`: plain decoding).
    pub default_proposer: String,
    /// Adapt draft lengths to each sequence's acceptance (0 when drafting
    /// does not pay).
    pub adaptive_draft: bool,
    /// Verify cost of one extra drafted token relative to a one-token
    /// forward, for the adaptive policy (measure with `specd bench-model`):
    /// the price with `draft_pricing = "fixed"`, of a sampled request
    /// decoding alone whose proposer drafts from a q of its own, and the
    /// prior until the engine has measured its own verify costs.
    pub draft_cost: f64,
    /// `measured` (default): price drafted tokens from verify times the
    /// engine measures on this machine at each step's batch size, so
    /// speculation backs off as load makes verification compute-bound
    /// (in a batch, and for a request decoding alone that is greedy or
    /// drafted one-hot, whose tokens do not depend on its draft lengths);
    /// `fixed`: always `draft_cost`.
    pub draft_pricing: DraftPricing,
    /// Reuse the KV blocks of prompt prefixes across requests.
    pub prefix_cache: bool,
    /// Most cached prefix blocks (0: a quarter of the KV budget).
    pub prefix_cache_blocks: usize,
    /// `fair` (default): admission, running slots and prefill budget are
    /// shared across requests by priority, so one request's many prompts
    /// cannot hold every other request's first token; `fcfs`: first come,
    /// first served by sequence.
    pub scheduling: crate::speculative::fairness::Scheduling,
    /// Most prompt tokens one step computes (chunked prefill, within
    /// `max_batch_tokens`; blocks found in the prefix cache ride along
    /// free): a step's time is every running sequence's
    /// time per output token and a new request's wait before its prefill
    /// starts. On the CPUs measured, chunks past 64-128 tokens gain no
    /// prefill throughput (docs/performance.md).
    pub max_prefill_tokens: usize,
}

impl Default for EngineSection {
    fn default() -> Self {
        Self {
            max_batch_tokens: 512,
            max_running: 16,
            max_draft: 4,
            kv_blocks: 0,
            default_proposer: "none".into(),
            adaptive_draft: true,
            draft_cost: 0.10,
            draft_pricing: DraftPricing::Measured,
            prefix_cache: true,
            prefix_cache_blocks: 0,
            scheduling: Default::default(),
            max_prefill_tokens: 64,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PluginsSection {
    #[serde(default)]
    pub dirs: Vec<PathBuf>,
}

/// One named proposer: a plugin (by name or path) with its options.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProposerConfig {
    pub name: String,
    /// Plugin name to find in the plugin directories (default: `name`).
    pub plugin: Option<String>,
    /// Explicit library path (instead of `plugin`).
    pub path: Option<PathBuf>,
    pub max_draft: Option<usize>,
    /// A composed proposer: the names of other `[[proposer]]` tables whose
    /// fresh instances it holds, asked in this order (cheapest first). Its
    /// options: `costs` (member name -> drafting cost of one call relative
    /// to a one-token target forward; default 0) and `verify_cost` (per
    /// drafted token; default `engine.draft_cost`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub compose: Vec<String>,
    /// What drafting one token costs this proposer itself, relative to a
    /// one-token target forward (a draft model's or head's own forward);
    /// the adaptive policy adds it to the token's verify cost, so a
    /// proposer stops drafting where its acceptance does not pay for both.
    /// Default 0 (lookup proposers cost next to nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_cost: Option<f64>,
    /// Where the plugin runs: `none` (in the daemon's process, the
    /// default) or `process` (a `specd plugin-host` child that is replaced
    /// if it crashes, exits or misses `propose_timeout_ms`).
    #[serde(default, skip_serializing_if = "Isolation::is_none")]
    pub isolation: Isolation,
    /// Deadline of one propose exchange with a plugin-host child
    /// (`isolation = "process"` only; default 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub propose_timeout_ms: Option<u64>,
    /// Whether sampled requests' acceptance uses the q the proposer
    /// reports drawing each token from (default: yes). `false` verifies
    /// every drafted token as a point mass instead, exact whatever the
    /// plugin drafted and reported (for a plugin not trusted to report
    /// its q truthfully), at some acceptance (`speculative::proposer::Configured`).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub trust_q: bool,
    /// Passed to the plugin as TOML.
    #[serde(default)]
    pub options: toml::Table,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// How the adaptive policy prices a drafted token.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DraftPricing {
    #[default]
    Measured,
    Fixed,
}

/// What a reload does (see `Config::plan_reload`).
#[derive(Debug, Clone, Default)]
pub struct ReloadPlan {
    /// The config to run with afterwards.
    pub merged: Config,
    /// Unchanged proposers (their instances stay).
    pub keep: Vec<String>,
    /// New names, and changed ones (fresh instances of both are built).
    pub added: Vec<String>,
    pub replaced: Vec<String>,
    pub removed: Vec<String>,
    /// Sections the file changed that a reload does not apply.
    pub not_applied: Vec<String>,
}

pub use crate::speculative::proposer::Isolation;

/// Default `propose_timeout_ms`.
pub const DEFAULT_PROPOSE_TIMEOUT_MS: u64 = 1000;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSection {
    pub host: String,
    pub port: u16,
    /// Bearer token; `SPECD_API_KEY` overrides; empty: no auth.
    pub api_key: String,
    /// More accepted bearer tokens, one per client: per-client limits
    /// count by key (without keys, by peer address).
    pub api_keys: Vec<String>,
    /// Most sequences (prompts x `n`) one client may have unfinished at
    /// once; a request past it gets 429 with `Retry-After` (0: no limit).
    pub max_client_sequences: usize,
    /// Most prompt tokens one client may have in unfinished requests at
    /// once (0: no limit).
    pub max_client_prompt_tokens: usize,
    /// Waiting requests beyond which new ones get 429.
    pub max_queue: usize,
    /// Seconds in-flight requests get to finish on SIGTERM/SIGINT.
    pub shutdown_grace_secs: u64,
    /// Whether a request's `speculation.proposer` may override routing.
    pub allow_request_proposer: bool,
    /// The most urgent `priority` a request may ask for (lower runs
    /// first; 0, the default priority: a request may yield to others but
    /// not go ahead of them, nor preempt them). Lower it for trusted
    /// clients.
    pub min_priority: i32,
    /// Largest request body in bytes.
    pub max_body_bytes: usize,
    /// Seconds a stream may go without sending anything (a request
    /// queued, or a long prefill) before it sends an SSE comment
    /// (`: keep-alive`) so proxies and clients do not time it out (0:
    /// never).
    pub sse_keepalive_secs: u64,
    /// Weighted traffic splits between proposer arms (requests that name
    /// no proposer).
    pub split: Vec<Split>,
    /// Proposers that draft beside live traffic, scored against the tokens
    /// actually emitted, without extra target forwards.
    pub shadow: Vec<String>,
    /// Parse special tokens (`<|im_start|>`, ...) inside chat message
    /// content and completion prompts. Off: they are encoded as the text
    /// they spell, so a client cannot forge a system or assistant turn.
    /// Only for trusted deployments.
    pub parse_special_tokens: bool,
    /// Serve `/v1/admin/*` (proposer listing and reload; behind the API
    /// key when one is set). Off: 404.
    pub admin: bool,
}

/// One traffic-split arm.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Split {
    pub name: String,
    pub proposer: String,
    pub weight: f64,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            api_key: String::new(),
            api_keys: Vec::new(),
            max_client_sequences: 0,
            max_client_prompt_tokens: 0,
            max_queue: 256,
            shutdown_grace_secs: 10,
            allow_request_proposer: true,
            min_priority: 0,
            max_body_bytes: 1 << 20,
            sse_keepalive_secs: 15,
            split: Vec::new(),
            parse_special_tokens: false,
            shadow: Vec::new(),
            admin: true,
        }
    }
}

/// Route requests for `model` to `proposer` by default.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Route {
    pub model: String,
    pub proposer: String,
}

fn default_dataset() -> String {
    "spec_bench".into()
}
fn one() -> usize {
    1
}
fn default_max_tokens() -> usize {
    128
}
fn default_out() -> PathBuf {
    PathBuf::from("ab-results")
}
fn default_bootstrap() -> usize {
    1000
}

/// One arm: plain decoding (`proposer = "none"`) or a named proposer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ArmConfig {
    pub name: String,
    pub proposer: String,
    pub max_draft: Option<usize>,
    /// Override `[engine] draft_pricing` for this arm (to compare pricing
    /// policies in one run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_pricing: Option<DraftPricing>,
    /// Draft the tokens a prompt's constraint forces (default: on; the
    /// plain arm never does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forced_drafts: Option<bool>,
}

/// The `[ab]` section of a config.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AbSection {
    /// `spec_bench`, `humaneval`, `structured` (prompts with a JSON
    /// schema each), or `jsonl` (with `path`; a line's optional `schema`
    /// constrains its output).
    #[serde(default = "default_dataset")]
    pub dataset: String,
    pub path: Option<PathBuf>,
    /// 0: every prompt.
    #[serde(default)]
    pub limit_per_category: usize,
    #[serde(default = "one")]
    pub repeats: usize,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
    /// Apply the chat template (default: yes, except for HumanEval).
    pub chat: Option<bool>,
    #[serde(default = "default_out")]
    pub out_dir: PathBuf,
    #[serde(default)]
    pub sampling: crate::sampler::SamplingParams,
    #[serde(default = "default_bootstrap")]
    pub bootstrap: usize,
    #[serde(default)]
    pub arm: Vec<ArmConfig>,
    /// A concurrency sweep instead of one-at-a-time requests: for each
    /// point, every arm runs all prompts with that many in flight on a
    /// fresh engine (fresh proposers), reporting aggregate tok/s.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub concurrency: Vec<usize>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub model: ModelSection,
    #[serde(default)]
    pub engine: EngineSection,
    #[serde(default)]
    pub plugins: PluginsSection,
    /// `[[proposer]]` tables (a single `[proposer]` table works too).
    #[serde(default, deserialize_with = "one_or_many")]
    pub proposer: Vec<ProposerConfig>,
    #[serde(default)]
    pub server: ServerSection,
    #[serde(default)]
    pub route: Vec<Route>,
    /// `specd ab` settings.
    #[serde(default)]
    pub ab: Option<AbSection>,
    /// Where this config came from (for error messages and relative paths).
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// `[proposer]` (one table) or `[[proposer]]` (several), with the inner
/// error kept (an untagged enum would hide which key was wrong).
fn one_or_many<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<ProposerConfig>, D::Error> {
    let v = toml::Value::deserialize(d)?;
    match v {
        toml::Value::Array(_) => {
            Vec::<ProposerConfig>::deserialize(v).map_err(serde::de::Error::custom)
        }
        toml::Value::Table(_) => ProposerConfig::deserialize(v)
            .map(|p| vec![p])
            .map_err(serde::de::Error::custom),
        other => Err(serde::de::Error::custom(format!(
            "`proposer`: expected a table or an array of tables, got {}",
            other.type_str()
        ))),
    }
}

impl Config {
    /// Parse `text` (from `file`, for messages and relative paths).
    pub fn parse(text: &str, file: Option<&Path>) -> Result<Self> {
        let name = file
            .map(|f| f.display().to_string())
            .unwrap_or_else(|| "<built-in default>".into());
        let mut c: Config = toml::from_str(text).map_err(|e| SpecdError::Config {
            file: name.clone(),
            msg: e.to_string().trim().to_string(),
        })?;
        c.source = file.map(Path::to_path_buf);
        c.validate(&name)?;
        Ok(c)
    }

    pub fn load(file: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(file).map_err(|e| SpecdError::Config {
            file: file.display().to_string(),
            msg: format!("cannot read: {e}"),
        })?;
        Self::parse(&text, Some(file))
    }

    pub fn builtin() -> Self {
        Self::parse(DEFAULT_TOML, None).expect("the built-in config is valid")
    }

    fn validate(&self, file: &str) -> Result<()> {
        let err = |msg: String| {
            Err(SpecdError::Config {
                file: file.to_string(),
                msg,
            })
        };
        let mut seen = std::collections::HashSet::new();
        for p in &self.proposer {
            if p.name == "none" || p.name.is_empty() {
                return err(format!("proposer name `{}` is reserved", p.name));
            }
            if p.name.contains('@') {
                return err(format!(
                    "proposer name `{}`: `@` is reserved (it marks instances retired by a reload)",
                    p.name
                ));
            }
            if !seen.insert(p.name.as_str()) {
                return err(format!("proposer `{}` is defined twice", p.name));
            }
            if p.plugin.is_some() && p.path.is_some() {
                return err(format!(
                    "proposer `{}`: give `plugin` or `path`, not both",
                    p.name
                ));
            }
            if let Some(c) = p.token_cost {
                if !c.is_finite() || c < 0.0 {
                    return err(format!(
                        "proposer `{}`: token_cost must be a finite number >= 0 (a fraction of a one-token target forward), got {c}",
                        p.name
                    ));
                }
            }
            if p.propose_timeout_ms.is_some() && p.isolation != Isolation::Process {
                return err(format!(
                    "proposer `{}`: propose_timeout_ms needs isolation = \"process\" (an in-process plugin cannot be interrupted)",
                    p.name
                ));
            }
            if p.propose_timeout_ms == Some(0) {
                return err(format!(
                    "proposer `{}`: propose_timeout_ms must be at least 1",
                    p.name
                ));
            }
            if !p.compose.is_empty() && p.isolation != Isolation::None {
                return err(format!(
                    "proposer `{}`: a composed proposer runs in the daemon; set `isolation` on its members",
                    p.name
                ));
            }
            if !p.compose.is_empty() && (p.plugin.is_some() || p.path.is_some()) {
                return err(format!(
                    "proposer `{}`: a composed proposer (`compose`) has no `plugin` or `path`",
                    p.name
                ));
            }
        }
        for p in self.proposer.iter().filter(|p| !p.compose.is_empty()) {
            for m in &p.compose {
                match self.proposer.iter().find(|q| &q.name == m) {
                    None => {
                        return err(format!(
                            "proposer `{}`: compose names `{m}`, which is no [[proposer]]",
                            p.name
                        ))
                    }
                    Some(q) if !q.compose.is_empty() => {
                        return err(format!(
                            "proposer `{}`: member `{m}` is itself composed",
                            p.name
                        ))
                    }
                    Some(_) => {}
                }
            }
            // A cost: a finite number >= 0, float or integer.
            let is_cost = |v: &toml::Value| {
                v.as_float()
                    .or(v.as_integer().map(|i| i as f64))
                    .is_some_and(|x| x.is_finite() && x >= 0.0)
            };
            if let Some(v) = p.options.get("verify_cost") {
                if !is_cost(v) {
                    return err(format!(
                        "proposer `{}`: verify_cost must be a non-negative number, got {v}",
                        p.name
                    ));
                }
            }
            let known_opts = ["costs", "verify_cost"];
            if let Some(k) = p.options.keys().find(|k| !known_opts.contains(&k.as_str())) {
                return err(format!(
                    "proposer `{}`: unknown option `{k}` of a composed proposer (known: costs, verify_cost)",
                    p.name
                ));
            }
            if let Some(costs) = p.options.get("costs") {
                let Some(t) = costs.as_table() else {
                    return err(format!(
                        "proposer `{}`: `costs` must be a table of member = number",
                        p.name
                    ));
                };
                for (k, v) in t {
                    if !p.compose.contains(k) {
                        return err(format!(
                            "proposer `{}`: `costs` names `{k}`, which is not a member",
                            p.name
                        ));
                    }
                    if !is_cost(v) {
                        return err(format!(
                            "proposer `{}`: cost of `{k}` must be a non-negative number",
                            p.name
                        ));
                    }
                }
            }
        }
        let known = |n: &str| n == "none" || seen.contains(n);
        if !known(&self.engine.default_proposer) {
            return err(format!(
                "engine.default_proposer = `{}` names no [[proposer]]",
                self.engine.default_proposer
            ));
        }
        for r in &self.route {
            if !known(&r.proposer) {
                return err(format!(
                    "route for model `{}`: unknown proposer `{}`",
                    r.model, r.proposer
                ));
            }
        }
        for sp in &self.server.split {
            if !known(&sp.proposer) {
                return err(format!(
                    "server.split `{}`: unknown proposer `{}`",
                    sp.name, sp.proposer
                ));
            }
            if !(sp.weight.is_finite() && sp.weight > 0.0) {
                return err(format!(
                    "server.split `{}`: weight must be a positive number",
                    sp.name
                ));
            }
        }
        for sh in &self.server.shadow {
            if sh == "none" || !known(sh) {
                return err(format!("server.shadow: unknown proposer `{sh}`"));
            }
        }
        if let Some(ab) = &self.ab {
            if ab.repeats == 0 || ab.bootstrap == 0 {
                return err("ab.repeats and ab.bootstrap must be at least 1".into());
            }
            let mut names = std::collections::HashSet::new();
            for a in &ab.arm {
                if !names.insert(a.name.as_str()) {
                    return err(format!("ab arm `{}` is defined twice", a.name));
                }
                if a.name == "plain" && a.proposer != "none" {
                    return err(format!(
                        "ab arm `plain` is the baseline every run adds (proposer none); name the `{}` arm otherwise",
                        a.proposer
                    ));
                }
                if !known(&a.proposer) {
                    return err(format!(
                        "ab arm `{}`: unknown proposer `{}`",
                        a.name, a.proposer
                    ));
                }
            }
        }
        if self.engine.max_running == 0 || self.engine.max_batch_tokens == 0 {
            return err("engine.max_running and engine.max_batch_tokens must be at least 1".into());
        }
        if !(self.engine.draft_cost.is_finite() && self.engine.draft_cost >= 0.0) {
            return err(format!(
                "engine.draft_cost must be a finite number >= 0 (a fraction of a one-token target forward), got {}",
                self.engine.draft_cost
            ));
        }
        if self.server.max_queue == 0 {
            return err(
                "server.max_queue must be at least 1 (requests wait there to be admitted)".into(),
            );
        }
        if self.engine.max_prefill_tokens == 0 {
            return err(
                "engine.max_prefill_tokens must be at least 1 (no prompt could ever be prefilled)"
                    .into(),
            );
        }
        if self.server.api_keys.iter().any(|k| k.trim().is_empty()) {
            return err("server.api_keys: a key must not be empty".into());
        }
        Ok(())
    }

    /// Resolve a path from the config against the config file's directory.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        match (&self.source, p.is_relative()) {
            (Some(src), true) => src.parent().unwrap_or(Path::new(".")).join(p),
            _ => p.to_path_buf(),
        }
    }

    /// Plugin search path: configured dirs, then the defaults.
    pub fn plugin_dirs(&self) -> Vec<PathBuf> {
        let dirs: Vec<PathBuf> = self.plugins.dirs.iter().map(|d| self.resolve(d)).collect();
        plugins::plugin_dirs(&dirs)
    }

    /// Load every configured proposer into a `Drafter`.
    pub fn build_drafter(
        &self,
        model: &Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
    ) -> Result<Drafter> {
        let mut d = Drafter::new();
        for p in &self.proposer {
            let make = || self.build_proposer(p, model, tokenizer.clone());
            d.add(make()?);
            if self.server.shadow.contains(&p.name) {
                // A separate instance, so shadow state never touches live drafting.
                d.add_shadow(make()?, self.engine.max_draft);
            }
        }
        Ok(d)
    }

    /// The library file of plugin proposer `p` (its `path`, or its plugin
    /// found in the plugin directories).
    pub fn library_path(&self, p: &ProposerConfig) -> Result<PathBuf> {
        match &p.path {
            Some(path) => Ok(self.resolve(path)),
            None => {
                plugins::find_plugin(p.plugin.as_deref().unwrap_or(&p.name), &self.plugin_dirs())
                    .map_err(|e| SpecdError::Plugin(format!("proposer `{}`: {e}", p.name)))
            }
        }
    }

    /// A fresh instance of the proposer `p` (a composed one builds fresh
    /// instances of its members), carrying its configured `token_cost`.
    pub fn build_proposer(
        &self,
        p: &ProposerConfig,
        model: &Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
    ) -> Result<Box<dyn Proposer>> {
        let inner = self.build_bare_proposer(p, model, tokenizer)?;
        Ok(if p.token_cost.is_some() || !p.trust_q {
            Box::new(crate::speculative::proposer::Configured {
                inner,
                token_cost: p.token_cost,
                trust_q: p.trust_q,
            })
        } else {
            inner
        })
    }

    fn build_bare_proposer(
        &self,
        p: &ProposerConfig,
        model: &Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
    ) -> Result<Box<dyn Proposer>> {
        if !p.compose.is_empty() {
            let mut members = Vec::new();
            for m in &p.compose {
                let q = self.proposer.iter().find(|q| &q.name == m).ok_or_else(|| {
                    SpecdError::Plugin(format!("proposer `{}`: unknown member `{m}`", p.name))
                })?;
                members.push((m.clone(), self.build_proposer(q, model, tokenizer.clone())?));
            }
            let c = Compose::from_options(
                &p.name,
                members,
                &p.options,
                self.engine.draft_cost,
                &model.config,
            )
            .map_err(SpecdError::Plugin)?;
            return Ok(Box::new(c));
        }
        let path = self.library_path(p)?;
        let mut options = p.options.clone();
        if let Some(m) = p.max_draft {
            options
                .entry("max_draft")
                .or_insert(toml::Value::Integer(m as i64));
        }
        if p.isolation == Isolation::Process {
            // The library is loaded only by the child, never by the daemon.
            let spec = plugins::ProcessSpec::new(
                &p.name,
                &path,
                &options,
                &model.config,
                self.model_path().ok(),
                p.propose_timeout_ms.unwrap_or(DEFAULT_PROPOSE_TIMEOUT_MS),
            )?;
            return Ok(Box::new(plugins::ProcessProposer::spawn(spec)?));
        }
        let lib = plugins::load_library(&path)
            .map_err(|e| SpecdError::Plugin(format!("proposer `{}`: {e}", p.name)))?;
        Ok(Box::new(PluginProposer::create(
            &p.name,
            lib,
            &options,
            Some(model.clone()),
            tokenizer,
        )?))
    }

    /// The target model's path: `[model] path` resolved against the config
    /// file, or the embedded default (fetched on first use). A path the
    /// user named must exist.
    pub fn model_path(&self) -> Result<PathBuf> {
        match &self.model.path {
            Some(p) => {
                let path = self.resolve(p);
                if path.exists() {
                    Ok(path)
                } else if let Some(c) = p.to_str().and_then(crate::fetch::by_name) {
                    // A catalogued name (`path = "gemma3-270m"`).
                    c.ensure()
                } else {
                    Err(SpecdError::ModelNotFound(path))
                }
            }
            None => crate::fetch::ensure_default_model(),
        }
    }

    /// The target's tokenizer, with `[model] chat_template` applied.
    pub fn tokenizer(&self, model_path: &Path) -> Result<Tokenizer> {
        let tok = Tokenizer::for_model(model_path)?;
        Ok(match &self.model.chat_template {
            Some(t) => tok.with_chat_template(read_template(&self.resolve(Path::new(t)), t)?),
            None => tok,
        })
    }

    /// Load the target model with `[model] threads` (default: available
    /// cores) and `kv_dtype`.
    pub fn load_target(&self) -> Result<(PathBuf, Model)> {
        let path = self.model_path()?;
        let threads = self
            .model
            .threads
            .unwrap_or_else(crate::model::llama::default_threads);
        let mut model = crate::model::load_model(&path, threads)?;
        if let Some(d) = self.model.kv_dtype {
            model.set_kv_dtype(d);
        }
        Ok((path, model))
    }

    /// The engine's sizing for `model`: `[engine]` (KV blocks for
    /// `max_running` contexts of 4096 tokens when `kv_blocks = 0`) and the
    /// waiting-queue limit from `[server] max_queue`. The one place an
    /// `EngineConfig` is derived from a config.
    pub fn engine_config(&self, model: &Model) -> EngineConfig {
        let mut ec = EngineConfig::for_model(model);
        self.apply_engine(&mut ec.scheduler);
        ec.scheduler.max_waiting = self.server.max_queue;
        ec.kv_blocks = self.kv_blocks(model, ec.scheduler.max_running);
        // The served context is what the budget holds (as both drivers
        // apply it; set here too so the config's readers see it).
        ec.scheduler.max_seq_len = ec.served_max_seq_len();
        ec.prefix_cache_blocks = match (self.engine.prefix_cache, self.engine.prefix_cache_blocks) {
            (false, _) => 0,
            (true, 0) => (ec.kv_blocks / 4).max(1),
            (true, n) => n,
        };
        ec
    }

    /// KV blocks for `running` sequences: `[engine] kv_blocks`, or room for
    /// `running` contexts of 4096 tokens (capped at the model's).
    pub fn kv_blocks(&self, model: &Model, running: usize) -> usize {
        match self.engine.kv_blocks {
            0 => EngineConfig::kv_blocks_for(model, running, 4096),
            n => n,
        }
    }

    /// Apply the `[engine]` settings to a scheduler config.
    pub fn apply_engine(&self, s: &mut crate::speculative::scheduler::SchedulerConfig) {
        s.max_batch_tokens = self.engine.max_batch_tokens;
        s.max_running = self.engine.max_running;
        s.max_draft = self.engine.max_draft;
        s.adaptive_draft = self.engine.adaptive_draft;
        s.draft_cost = self.engine.draft_cost;
        s.measured_pricing = self.engine.draft_pricing == DraftPricing::Measured;
        s.default_proposer = Some(self.engine.default_proposer.clone()).filter(|p| p != "none");
        s.scheduling = self.engine.scheduling;
        s.max_prefill_tokens = self.engine.max_prefill_tokens;
    }

    /// Plan a reload from `new` (the config file read again): what a reload
    /// may change is taken from it (`[[proposer]]`, `[plugins]`, `[[route]]`,
    /// `[server] split` and `allow_request_proposer`, `[engine]
    /// default_proposer`), everything else stays as running (`self`), and
    /// sections of `new` that differ from `file_before` (the file as last
    /// applied) in anything else are listed as not applied. The merged
    /// config is validated as a whole: an invalid one is an error and
    /// changes nothing.
    pub fn plan_reload(&self, file_before: &Config, new: &Config) -> Result<ReloadPlan> {
        let mut merged = self.clone();
        merged.proposer = new.proposer.clone();
        merged.plugins = new.plugins.clone();
        merged.route = new.route.clone();
        merged.server.split = new.server.split.clone();
        merged.server.allow_request_proposer = new.server.allow_request_proposer;
        merged.engine.default_proposer = new.engine.default_proposer.clone();
        merged.source = new.source.clone();
        // `[ab]` means nothing to a server, but its arms name proposers:
        // checked against the new set, not the running one.
        merged.ab = new.ab.clone();
        let file = new
            .source
            .as_ref()
            .map(|s| s.display().to_string())
            .unwrap_or_default();
        merged.validate(&file).map_err(|e| match e {
            SpecdError::Config { file, msg } if msg.starts_with("server.shadow") => {
                SpecdError::Config {
                    file,
                    msg: format!(
                        "{msg} (shadow proposers are not reloaded: keep them, or restart)"
                    ),
                }
            }
            e => e,
        })?;
        // What stays as running although the file changed it.
        let mut not_applied = Vec::new();
        let (mut a, mut b) = (file_before.clone(), new.clone());
        for c in [&mut a, &mut b] {
            c.proposer.clear();
            c.plugins = Default::default();
            c.route.clear();
            c.server.split.clear();
            c.server.allow_request_proposer = true;
            c.engine.default_proposer.clear();
            c.source = None;
        }
        if a.model != b.model {
            not_applied.push("[model]".to_string());
        }
        if a.engine != b.engine {
            not_applied.push("[engine] (other than default_proposer)".to_string());
        }
        if a.server.shadow != b.server.shadow {
            not_applied.push("[server] shadow".to_string());
        }
        a.server.shadow.clear();
        b.server.shadow.clear();
        if a.server != b.server {
            not_applied.push("[server] (other than split and allow_request_proposer)".to_string());
        }
        if a.ab != b.ab {
            not_applied.push("[ab]".to_string());
        }
        let plugins_same = self.plugins == merged.plugins;
        let same = |n: &str| -> bool {
            let (Some(o), Some(p)) = (
                self.proposer.iter().find(|p| p.name == n),
                merged.proposer.iter().find(|p| p.name == n),
            ) else {
                return false;
            };
            o == p && (plugins_same || (p.path.is_some() && p.compose.is_empty()))
        };
        let mut plan = ReloadPlan {
            not_applied,
            ..Default::default()
        };
        for p in &merged.proposer {
            let unchanged = same(&p.name) && p.compose.iter().all(|m| same(m));
            if unchanged {
                plan.keep.push(p.name.clone());
            } else if self.proposer.iter().any(|o| o.name == p.name) {
                plan.replaced.push(p.name.clone());
            } else {
                plan.added.push(p.name.clone());
            }
        }
        plan.removed = self
            .proposer
            .iter()
            .filter(|o| !merged.proposer.iter().any(|p| p.name == o.name))
            .map(|o| o.name.clone())
            .collect();
        plan.merged = merged;
        Ok(plan)
    }

    /// The proposer for requests to `model` that name none.
    pub fn route(&self, model: &str) -> &str {
        self.route
            .iter()
            .find(|r| r.model == model)
            .map(|r| r.proposer.as_str())
            .unwrap_or(&self.engine.default_proposer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_and_shipped_configs_parse() {
        let c = Config::builtin();
        assert!(c.proposer.iter().any(|p| p.name == "ngram"));
        for f in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/configs")).unwrap() {
            let f = f.unwrap().path();
            if f.extension().is_some_and(|e| e == "toml") {
                Config::load(&f).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }

    #[test]
    fn errors_name_file_key_and_type() {
        let e = Config::parse(
            "[engine]\nmax_draft = \"four\"\n",
            Some(Path::new("x.toml")),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("x.toml") && e.contains("max_draft") && e.contains("expected usize"),
            "{e}"
        );
        let e = Config::parse("[engine]\nmax_drafts = 4\n", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `max_drafts`"), "{e}");
        let e = Config::parse("[[proposer]]\nname = \"a\"\nplugins = \"x\"\n", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `plugins`"), "{e}");
        let e = Config::parse(
            "[[proposer]]\nname = \"a\"\n[[proposer]]\nname = \"a\"\n",
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("defined twice"), "{e}");
        let e = Config::parse("[engine]\ndefault_proposer = \"zz\"\n", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("names no [[proposer]]"), "{e}");
        let e = Config::parse("[model]\nkv_dtype = \"f8\"\n", Some(Path::new("k.toml")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("k.toml") && e.contains("kv_dtype") && e.contains("expected `f16` or `f32`"),
            "{e}"
        );
        let c = Config::parse("[model]\nkv_dtype = \"f32\"\n", None).unwrap();
        assert_eq!(c.model.kv_dtype, Some(crate::model::KvDtype::F32));
        // Values that would run nothing, mislead or divide by nothing.
        for (toml, needle) in [
            ("[engine]\ndraft_cost = nan\n", "engine.draft_cost must be a finite number >= 0"),
            ("[engine]\ndraft_cost = -0.5\n", "engine.draft_cost must be a finite number >= 0"),
            ("[server]\nmax_queue = 0\n", "server.max_queue must be at least 1"),
            ("[server]\napi_keys = [\"a\", \"\"]\n", "server.api_keys: a key must not be empty"),
            ("[engine]\nscheduling = \"lifo\"\n", "unknown variant `lifo`"),
            ("[ab]\nrepeats = 0\n", "ab.repeats and ab.bootstrap must be at least 1"),
            ("[ab]\nbootstrap = 0\n", "ab.repeats and ab.bootstrap must be at least 1"),
            (
                "[[proposer]]\nname = \"ngram\"\n[ab]\n[[ab.arm]]\nname = \"plain\"\nproposer = \"ngram\"\n",
                "ab arm `plain` is the baseline",
            ),
            (
                "[[proposer]]\nname = \"ngram\"\n[[proposer]]\nname = \"h\"\ncompose = [\"ngram\"]\n[proposer.options]\nverify_cost = \"0.2\"\n",
                "verify_cost must be a non-negative number",
            ),
        ] {
            let e = Config::parse(toml, None).unwrap_err().to_string();
            assert!(e.contains(needle), "{toml}: {e}");
        }
        let e = Config::parse("[model\n", None).unwrap_err().to_string();
        assert!(
            e.contains("<built-in default>") || e.contains("config"),
            "{e}"
        );
    }

    #[test]
    fn a_reload_checks_ab_arms_against_the_new_proposers() {
        // Removing a proposer and its `[ab]` arm together is a valid
        // reload (the running `[ab]` section is not the new one).
        let text = |with_suffix: bool| {
            let mut t = String::from("[[proposer]]\nname = \"ngram\"\n");
            if with_suffix {
                t.push_str("[[proposer]]\nname = \"suffix\"\n");
            }
            t.push_str("[ab]\n[[ab.arm]]\nname = \"ngram\"\nproposer = \"ngram\"\n");
            if with_suffix {
                t.push_str("[[ab.arm]]\nname = \"suffix\"\nproposer = \"suffix\"\n");
            }
            Config::parse(&t, None).unwrap()
        };
        let (before, after) = (text(true), text(false));
        let plan = before.plan_reload(&before, &after).unwrap();
        assert_eq!(plan.removed, ["suffix"]);
    }

    #[test]
    fn single_proposer_table_and_routes() {
        let c = Config::parse(
            "[proposer]\nname = \"ng\"\nplugin = \"ngram\"\nmax_draft = 3\n[proposer.options]\nmax_n = 2\n[[route]]\nmodel = \"m\"\nproposer = \"ng\"\n",
            None,
        )
        .unwrap();
        assert_eq!(c.proposer.len(), 1);
        assert_eq!(c.proposer[0].options["max_n"].as_integer(), Some(2));
        assert_eq!(c.route("m"), "ng");
        assert_eq!(c.route("other"), "none");
    }
}
