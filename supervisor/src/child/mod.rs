//! The supervisor's side of one worker process (a *child*; the worker's
//! own side is the `berth-worker` crate), one concern per file: `program`
//! (which program a worker runs), `spawn`, `start` (a worker's process,
//! spawned or forked), `preload` (a worker kind's preloaded interpreter,
//! which forks workers), `handshake`, `launch` (start → hello → load),
//! `handle` (requests and the reader), `routes` (a worker's events to the
//! requests waiting), `inbox` (a stream worker's socket, read by its reader
//! task or by a caller spinning for an answer), `death` (what a dead worker
//! leaves), `health` (heartbeats, stalls), `stop`, `sweep` (killing what a
//! worker left, in its group or outside it), `process` (reaping, kill
//! causes), `output`
//! (bounded stdout/stderr), `memory` (procfs), `limits` (memory caps),
//! `probe` (asking a program for its backends), `upstream` (an HTTP server
//! run as a worker), `container` (such a server in a container: its flags,
//! its stop, its proof, the sweep of what a dead berth left) and `ports`
//! (where such a server listens, and that it is the one there).

pub(crate) mod checkpoint;
pub mod container;
pub(crate) mod death;
pub mod handle;
pub(crate) mod handover;
pub(crate) mod handshake;
pub(crate) mod health;
mod inbox;
pub(crate) mod launch;
pub mod limits;
pub(crate) mod link;
pub mod memory;
pub mod orphans;
pub(crate) mod output;
pub(crate) mod ports;
pub(crate) mod preload;
pub(crate) mod probe;
pub mod process;
pub(crate) mod program;
mod routes;
pub mod spawn;
pub(crate) mod start;
pub mod stop;
pub(crate) mod stream;
pub(crate) mod sweep;
pub mod upstream;
