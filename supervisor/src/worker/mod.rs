//! One worker process, one concern per file.

pub mod handle;
pub(crate) mod handshake;
pub(crate) mod health;
pub(crate) mod launch;
pub mod limits;
pub mod memory;
pub mod orphans;
pub(crate) mod output;
pub mod process;
pub mod spawn;
pub mod stop;
