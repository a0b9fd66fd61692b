//! The `specd` command line: one file per command, and what they share
//! (model arguments, config loading, prompt encoding).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use specd::config::Config;
use specd::model::{self, Model};
use specd::tokenizer::{ChatMessage, Tokenizer};

pub mod ab;
pub mod bench;
pub mod bench_load;
pub mod distill;
pub mod fetch;
pub mod generate;
pub mod quantize;
pub mod serve;

#[derive(Args)]
pub struct ModelArgs {
    /// GGUF file or safetensors directory; default: the embedded SmolLM2-135M-Instruct.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute threads (default: available cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Quantize F32 matrices to Q8_0 after loading (e.g. a safetensors
    /// draft, as the draft plugin does by default).
    #[arg(long)]
    pub quantize: bool,
    /// KV cache element type: f16 (default) or f32.
    #[arg(long, value_parser = parse_kv_dtype)]
    pub kv_dtype: Option<model::KvDtype>,
}

pub fn parse_kv_dtype(s: &str) -> std::result::Result<model::KvDtype, String> {
    match s {
        "f16" => Ok(model::KvDtype::F16),
        "f32" => Ok(model::KvDtype::F32),
        other => Err(format!("unknown KV cache type {other:?} (use f16 or f32)")),
    }
}

impl ModelArgs {
    fn path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(specd::fetch::resolve_model(p)?),
            None => Ok(specd::fetch::ensure_default_model()?),
        }
    }

    fn load(&self) -> Result<(PathBuf, Model)> {
        let path = self.path()?;
        let threads = self.threads.unwrap_or_else(model::llama::default_threads);
        let mut m = model::load_model(&path, threads)
            .with_context(|| format!("loading {}", path.display()))?;
        if self.quantize {
            m.quantize_f32_to_q8_0();
        }
        if let Some(d) = self.kv_dtype {
            m.set_kv_dtype(d);
        }
        Ok((path, m))
    }
}

pub fn encode_prompt(tok: &Tokenizer, text: &str, chat: bool) -> Result<Vec<u32>> {
    Ok(if chat {
        let t = tok.apply_chat_template(&[ChatMessage::user(text.to_string())], true)?;
        tok.encode(&t, false)?
    } else {
        tok.encode(text, true)?
    })
}

pub fn load_config(path: &Option<PathBuf>) -> Result<Config> {
    Ok(match path {
        Some(p) => Config::load(p)?,
        None => Config::builtin(),
    })
}
