//! specd: a speculative-decoding inference engine.
//!
//! See ARCHITECTURE.md for the map of modules and their invariants.

pub mod ab;
pub mod bench_load;
pub mod bench_model;
pub mod config;
pub mod datasets;
pub mod distill;
pub mod fetch;
pub mod plain;
pub mod plugins;
pub mod server;
pub mod speculative;
pub mod structured;

// The model layer is its own crate (`engine/model`), which the proposer
// plugins depend on alone; these re-exports keep `specd::model`,
// `specd::sampler`, `specd::tokenizer` and `specd::error` one path.
pub use specd_model as model;
pub use specd_model::{error, sampler, tokenizer};

pub use error::{Result, SpecdError};
