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
//!
//! - Under `isolation = "process"` the library is never loaded into the
//!   daemon: a `specd plugin-host` child loads it, and a child that dies or
//!   hangs is replaced while its sequences decode plainly (`process`).
//!
//! Rooms: `library` (load and validate a cdylib), `callbacks` (the
//! `HostApi` the host gives every instance), `instance` (a plugin instance
//! as an engine `Proposer`), `wire` (the plugin-host protocol), `process`
//! (the daemon's side of a plugin-host child), `host` (the child's side);
//! this file finds libraries by name.

use std::path::PathBuf;

use crate::error::{Result, SpecdError};

mod callbacks;
pub mod host;
mod instance;
mod library;
pub mod process;
pub mod wire;

pub use instance::{PluginProposer, TargetDims};
pub use library::{load_library, PluginLibrary};
pub use process::{plugin_host_exe, ProcessProposer, ProcessSpec};

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
