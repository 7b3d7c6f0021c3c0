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
pub mod child;
mod config;
mod error;
pub mod fetch;
pub mod gpu;
mod heap;
pub mod logs;
pub mod orphans;
mod report;
pub mod server;
mod supervisor;
mod units;
pub mod upgrade;

pub use base::{CapMechanism, KillCause, StopGraces};
pub use berth_protocol as protocol;
pub use berth_protocol::{Body, Bulk};
pub use child::handle::{Piece, ResponseStream, WorkerHandle};
pub use config::{
    ContainerSpec, Engine, HttpSpec, ModelSpec, SupervisorConfig, WorkerKind, is_dangerous_env,
};
pub use error::{Error, ErrorClass, Result, VersionMismatch};
pub use report::{ExitStatus, LoadReport, StopKind, UnloadReport, Warning, WorkerStart};
pub use supervisor::{
    BatchingStatus, CatalogueEntry, EVENT_HISTORY, Event, EventKind, Follow, Followed, HostSample,
    Lease, MemoryHistory, ModelCounters, ModelSample, ModelState, ModelStatus, Occupancy,
    PreloaderStatus, RequestOptions, RequestStream, Supervisor, SwapReport,
};
pub use units::{mib, parse_bytes, parse_duration};
