//! specd: a speculative-decoding inference engine.
//!
//! See ARCHITECTURE.md for the map of modules and their invariants.

pub mod ab;
pub mod bench;
pub mod bench_load;
pub mod config;
pub mod distill;
pub mod error;
pub mod fetch;
pub mod generate;
pub mod model;
pub mod plugins;
pub mod prompts;
pub mod sampler;
pub mod server;
pub mod speculative;
pub mod structured;
pub mod tokenizer;

pub use error::{Result, SpecdError};
