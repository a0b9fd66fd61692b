//! EAGLE draft heads as a proposer plugin: the head reads the target's own
//! features (EAGLE-3: three layers fused; EAGLE-1: the final-normed state)
//! and drafts chains or dynamic trees (EAGLE-2); see `specd_eagle_core`
//! (shared with the `mtp` plugin) for how.
//!
//! Options: `head` (directory with config.json + *.safetensors; default:
//! the head built into the plugin for SmolLM2-135M-Instruct) and the
//! drafting options (`DRAFT_OPTIONS`).

use std::path::PathBuf;

pub use specd_eagle_core::{Eagle, Mode, DRAFT_OPTIONS};

/// The plugin: EAGLE's drafting over a head from `head` (or the built-in
/// one).
pub struct EaglePlugin(pub Eagle);
use specd_model::eagle::Head;
use specd_plugin_sdk::{Caps, Host, Options, Plugin, Proposal, SeqView};

#[cfg(feature = "builtin-head")]
mod builtin {
    pub const CONFIG: &str = include_str!("../heads/smollm2-135m-instruct/config.json");
    pub const WEIGHTS: &[u8] = include_bytes!("../heads/smollm2-135m-instruct/model.safetensors");
}

fn load_head(o: &Options, host: &Host) -> Result<Head, String> {
    let raw = o.get("head", String::new())?;
    let layers = host
        .n_layers()
        .ok_or("the host does not say how many layers the target has (ABI 2.1 or later needed)")?;
    if raw.is_empty() {
        #[cfg(feature = "builtin-head")]
        {
            return Head::from_bytes(
                "builtin:smollm2-135m-instruct",
                builtin::CONFIG,
                builtin::WEIGHTS,
                host.hidden_size(),
                host.vocab_size(),
                layers,
            );
        }
        #[cfg(not(feature = "builtin-head"))]
        return Err("option `head`: path to the head's directory is required (this build has no built-in head)".into());
    }
    let path = match (raw.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(&raw),
    };
    Head::load(&path, host.hidden_size(), host.vocab_size(), layers)
}

impl Plugin for EaglePlugin {
    const NAME: &'static str = "eagle";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn default_capabilities() -> Caps {
        Eagle::default_caps()
    }

    fn create(o: &Options, host: Host) -> Result<Self, String> {
        let mut known = DRAFT_OPTIONS.to_vec();
        known.push("head");
        o.reject_unknown(&known)?;
        let head = load_head(o, &host)?;
        Eagle::create_with(o, host, head).map(Self)
    }

    fn capabilities(&self) -> Caps {
        self.0.caps()
    }

    fn start(&mut self, seq: u64, _tokens: &[u32]) -> Result<(), String> {
        self.0.start_seq(seq)
    }

    fn propose(&mut self, batch: &[SeqView<'_>]) -> Result<Vec<Proposal>, String> {
        self.0.propose_batch(batch)
    }

    fn observe(&mut self, _seq: u64, _tokens: &[u32], _path: &[u32]) -> Result<(), String> {
        Ok(())
    }

    fn finish(&mut self, seq: u64) {
        self.0.finish_seq(seq)
    }
}

#[cfg(feature = "plugin")]
specd_plugin_sdk::export_proposer!(EaglePlugin);
