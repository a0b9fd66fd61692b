//! specd: a speculative-decoding inference engine.
//!
//! What a library user needs is re-exported at the root: load a model
//! ([`load_model`]) and a config ([`Config`]), build an engine
//! ([`EngineHandle`] for the actor engine, [`SyncDriver`] to drive the
//! same step pipeline on one thread), submit [`Request`]s and read
//! [`Completion`]s and [`Event`]s; [`generate`] is plain decoding, the
//! reference every proposer must reproduce. The modules stay public for
//! the `specd` binary, the tests and the benches; `bench_model`,
//! `bench_load` and `fetch` exist for the binary's commands.
//!
//! See ARCHITECTURE.md for the map of modules and their invariants.

pub mod ab;
#[doc(hidden)]
pub mod bench_load;
#[doc(hidden)]
pub mod bench_model;
pub mod config;
pub mod datasets;
pub mod distill;
#[doc(hidden)]
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

pub use config::Config;
pub use error::{Result, SpecdError};
pub use model::{load_model, Model};
pub use plain::generate;
pub use sampler::SamplingParams;
pub use speculative::actors::{EngineHandle, EngineParts};
pub use speculative::driver::{EngineConfig, SyncDriver};
pub use speculative::proposer::Proposer;
pub use speculative::{Completion, Event, Request};
pub use tokenizer::Tokenizer;
