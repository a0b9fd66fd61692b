//! specd's test kit: what the integration tests and benches share (tiny
//! models, proposer fixtures, the daemon harness, head-plugin helpers,
//! statistics and out-of-tree builds). Tests use it as
//! `use specd_test_kit as common;`; every module's items are re-exported
//! at the root.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use specd::sampler::Rng;
use specd::speculative::proposer::{Capabilities, Draft, DraftQ, ProposeInput, Proposer, QKind};
use specd::speculative::SeqId;
use std::path::{Path, PathBuf};

pub mod builds;
pub mod daemon;
pub mod heads;
pub mod mtp;
pub mod proposers;
pub mod stats;
pub mod tiny;
pub mod tree;

pub use builds::*;
pub use daemon::*;
pub use heads::*;
pub use mtp::*;
pub use proposers::*;
pub use stats::*;
pub use tiny::*;
pub use tree::*;

/// The repository root (the `specd` package's directory).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `specd` binary of the build these tests run from
/// (`<target>/<profile>/specd`, beside the `deps/` directory holding the
/// test executable).
pub fn specd_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().unwrap().parent().unwrap();
    profile.join(format!("specd{}", std::env::consts::EXE_SUFFIX))
}
