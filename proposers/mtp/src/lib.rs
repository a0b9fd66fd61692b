//! Multi-token prediction (MTP) as a proposer plugin: the MTP module a
//! target ships beside its main layers (DeepSeek-V3, GLM-4.5:
//! `model.layers.{N}.{enorm,hnorm,eh_proj,...}` in safetensors,
//! `blk.{N}.nextn.*` in GGUF; see `specd_model::mtp`), or one `specd
//! distill` wrote, drafts from the target's final-normed state. One
//! module chains for several tokens (its output is the next depth's
//! state); drafts are chains or trees exactly as the eagle plugin builds
//! them (`specd_eagle_core`), so the same losslessness guarantees
//! hold: every token is drawn from the q reported for it, and sampled
//! trees never prune by drawn values.
//!
//! Options: `model` (the target's safetensors directory or GGUF file
//! holding the MTP layers, or a module's directory; default: the module
//! built into the plugin for SmolLM2-135M-Instruct), `layer` (the MTP
//! layer's index; default the first past the main model), and the eagle
//! plugin's `mode` ("chain" default | "tree"), `max_draft`, `depth`,
//! `top_k`, `seed`, `window`, `min_confidence`.

use std::path::PathBuf;

use specd_model::mtp::{load_mtp, load_mtp_bytes};
use specd_plugin_sdk::{Caps, Host, Options, Plugin, Proposal, SeqView};

use specd_eagle_core::{Eagle, DRAFT_OPTIONS};

pub struct Mtp(Eagle);

#[cfg(feature = "builtin-module")]
mod builtin {
    pub const CONFIG: &str = include_str!("../modules/smollm2-135m-instruct/config.json");
    pub const WEIGHTS: &[u8] = include_bytes!("../modules/smollm2-135m-instruct/model.safetensors");
}

/// The module trained for SmolLM2-135M-Instruct, compiled in (used when
/// `model` is unset).
fn builtin_module(host: &Host, layers: usize) -> Result<specd_model::eagle::Head, String> {
    #[cfg(feature = "builtin-module")]
    {
        load_mtp_bytes(
            "builtin:smollm2-135m-instruct",
            builtin::CONFIG,
            builtin::WEIGHTS,
            host.hidden_size(),
            host.vocab_size(),
            layers,
        )
    }
    #[cfg(not(feature = "builtin-module"))]
    {
        let _ = (host, layers, load_mtp_bytes);
        Err("option `model`: the target's safetensors directory or GGUF file holding the MTP layers (or a module's directory) is required (this build has no built-in module)".into())
    }
}

impl Plugin for Mtp {
    const NAME: &'static str = "mtp";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn default_capabilities() -> Caps {
        Eagle::default_caps()
    }

    fn create(o: &Options, host: Host) -> Result<Self, String> {
        let mut known = DRAFT_OPTIONS.to_vec();
        known.extend(["model", "layer"]);
        o.reject_unknown(&known)?;
        let raw = o.get("model", String::new())?;
        let layers = host.n_layers().ok_or(
            "the host does not say how many layers the target has (ABI 2.1 or later needed)",
        )?;
        let head = if raw.is_empty() {
            builtin_module(&host, layers)?
        } else {
            let path = match (raw.strip_prefix("~/"), std::env::var_os("HOME")) {
                (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
                _ => PathBuf::from(&raw),
            };
            let layer = match o.get("layer", -1i64)? {
                l if l < 0 => None,
                l => Some(l as usize),
            };
            load_mtp(
                &path,
                layer,
                host.hidden_size(),
                host.vocab_size(),
                layers,
                true,
            )?
        };
        // Chains unless asked otherwise: one module step per depth.
        let mut opts = o.clone();
        opts.set_default("mode", "chain");
        Eagle::create_with(&opts, host, head).map(Mtp)
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
specd_plugin_sdk::export_proposer!(Mtp);
