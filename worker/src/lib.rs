//! The berth worker: one process, one model.
//!
//! A worker binary is three lines: build a [`Registry`] of backends and hand
//! it to [`serve`]. The stock `berth-worker` binary registers the built-in
//! backends; a host with its own model code implements [`Backend`], registers
//! it next to (or instead of) the built-ins and points the supervisor at its
//! own binary (see `examples/custom-worker.rs`).

mod backend;
pub mod backends;
mod checkpoint;
mod hygiene;
mod kernels;
mod options;
mod pool;
mod serve;
mod stats;

pub use backend::{
    Backend, Batching, LoadContext, LoadFn, Progress, Registry, RequestContext, Stepping,
};
pub use berth_protocol as protocol;
pub use options::Options;
pub use serve::{serve, serve_with_args};
pub use stats::self_memory;
