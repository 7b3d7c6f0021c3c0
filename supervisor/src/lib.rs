//! berth: a process-isolating model supervisor.
//!
//! Every model runs in a worker process of its own, spoken to over IPC.
//! Unloading a model stops its worker, so the kernel takes back every byte
//! (allocator caches, leaks, mapped weights) and the [`UnloadReport`] shows
//! what came back.
//!
//! ```no_run
//! # async fn demo() -> berth::Result<()> {
//! use berth::{ModelSpec, Supervisor, SupervisorConfig};
//!
//! let supervisor = Supervisor::new(SupervisorConfig::default());
//! let load = supervisor.load(ModelSpec::new("hog", "hog").option("alloc_mib", 512)).await?;
//! println!("{load}");
//! let unload = supervisor.unload("hog").await?;
//! println!("{unload}"); // reclaimed 512.0 MiB ... 0 processes left over
//! # Ok(()) }
//! ```

mod base;
mod child;
mod config;
pub mod daemon;
mod error;
pub mod fetch;
pub mod gpu;
mod heap;
mod input;
pub mod logs;
mod repoll;
mod report;
mod server;
mod supervisor;
mod units;

pub use base::{CapMechanism, KillCause, MARK_PREFIX, StopGraces, build_mark};
pub use berth_protocol as protocol;
pub use berth_protocol::{Body, Bulk};
pub use child::handle::{Piece, ResponseStream, WorkerHandle};
pub use child::orphans::{Strays, become_subreaper, reap_strays};
pub use child::ports::Address;
pub use child::spawn::main_thread_spawns;
pub use config::{
    ContainerSpec, Engine, HttpSpec, ModelSpec, ServerSleep, SleepMode, SupervisorConfig,
    WorkerKind, is_dangerous_env,
};
pub use error::{Error, ErrorClass, Result, VersionMismatch};
pub use report::{
    Admission, ExitStatus, LoadReport, ReloadReport, StopKind, UnloadReport, Warning, WorkerStart,
};
pub use server::listen::raise_descriptor_limit;
pub use server::metrics::render as prometheus_text;
pub use server::{Listen, ServeOptions};
pub use supervisor::{
    BatchingStatus, CatalogueEntry, EVENT_HISTORY, Event, EventKind, Follow, Followed, HostSample,
    Lease, MemoryHistory, ModelCounters, ModelSample, ModelState, ModelStatus, Occupancy,
    PreloaderStatus, RequestOptions, RequestStream, SleepReport, Supervisor, SwapReport,
    WakeReport,
};
pub use units::{format_duration, mib, parse_bytes, parse_duration};

/// Memory as the kernel counts it, per process: what reports are made of.
pub mod memory {
    pub use crate::child::memory::{ProcessMemory, process_memory, resident_bytes};
}
