//! `specd fetch-model`: a catalogued model (the embedded default unless
//! `--model` names another) into `$SPECD_HOME`.

use anyhow::{bail, Result};

/// Fetch (or, with a verified cached copy and no `force`, keep) the model
/// and print its path.
pub fn run(name: &str, force: bool) -> Result<()> {
    let Some(c) = specd::fetch::by_name(name) else {
        let names: Vec<&str> = specd::fetch::CATALOGUE.iter().map(|c| c.name).collect();
        bail!(
            "unknown model '{name}' (catalogued: {}); a GGUF file or safetensors directory needs no fetching",
            names.join(", ")
        );
    };
    let cached = c.path();
    let p = if !force && specd::fetch::sha256_file(&cached).is_ok_and(|d| d == c.sha256) {
        eprintln!("specd: {} is cached and verified", cached.display());
        cached
    } else {
        if force {
            c.forget_cached_wheels()?;
        }
        c.fetch()?
    };
    println!("{}", p.display());
    Ok(())
}
