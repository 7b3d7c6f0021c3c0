//! What of one worker crosses an in-place upgrade's exec: the record the
//! old berth writes of it ([`HandedWorker`], serialised into the state the
//! daemon hands over), the descriptors that record names, and, in the new
//! program, the handle made from it again (`worker.rs`). An `ipc-channel`
//! endpoint crosses as the packet `ipc-channel` itself wrote (`ipc.rs`); a
//! stream-wire socket and the stdout/stderr pipes as plain descriptors; an
//! HTTP server as its address (and its container).
//!
//! The daemon's side (the state as a whole, the exec, the takeover of the
//! listening socket) is `daemon/upgrade/`; the supervisor's (freezing the
//! models, writing every worker down, installing the adopted ones) is
//! `supervisor/handover.rs`.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use serde::{Deserialize, Serialize};

use crate::child::limits::{HandedCap, HandedCgroup};
use crate::report::{LoadReport, WorkerStart};

pub(crate) mod ipc;
mod worker;

pub(crate) use worker::{adopt, discard, hand};

/// One running worker (or HTTP server) and what it was loaded as.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct HandedWorker {
    pub model: String,
    pub pid: u32,
    /// Clock ticks after boot: with `pid`, which process this is.
    pub start_time: u64,
    pub mark: String,
    pub backend: String,
    pub worker_version: String,
    pub wire: HandedWire,
    /// Read ends of its stdout and stderr.
    pub output: Option<(RawFd, RawFd)>,
    pub cap: Option<HandedCap>,
    pub fence: Option<HandedCgroup>,
    pub start: WorkerStart,
    /// Milliseconds since it was started, and since its model was last used.
    pub age_ms: u64,
    pub idle_ms: u64,
    pub requests: u64,
    pub load_info: Option<berth_protocol::LoadInfo>,
    pub baseline_rss: u64,
    pub load_micros: u64,
    pub report: LoadReport,
}

/// A packet `ipc-channel` wrote for one endpoint, and its descriptor.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Packet {
    pub bytes: Vec<u8>,
    pub fd: RawFd,
}

/// How the worker is reached.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "wire", rename_all = "snake_case")]
pub(crate) enum HandedWire {
    Ipc {
        commands: Packet,
        events: Packet,
    },
    Stream {
        socket: RawFd,
    },
    /// An HTTP server: its address, and its container if it runs in one.
    Http {
        address: crate::child::upstream::Address,
        container: Option<crate::child::container::Container>,
        /// Why its memory is outside what berth measures, where it is.
        #[serde(default)]
        outside: Option<String>,
    },
}

impl HandedWorker {
    /// The descriptors this record names: what the exec must keep open.
    pub(crate) fn descriptors(&self) -> Vec<RawFd> {
        let mut fds = Vec::new();
        match &self.wire {
            HandedWire::Ipc { commands, events } => fds.extend([commands.fd, events.fd]),
            HandedWire::Stream { socket } => fds.push(*socket),
            HandedWire::Http { .. } => {}
        }
        if let Some((out, err)) = self.output {
            fds.extend([out, err]);
        }
        fds
    }
}

/// Takes an inherited descriptor (close-on-exec from now on).
///
/// # Safety
/// `fd` must be a descriptor the handover named, taken once.
pub(crate) unsafe fn take(fd: RawFd) -> OwnedFd {
    // SAFETY: F_SETFD on the caller's descriptor.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    // SAFETY: the caller's promise.
    unsafe { OwnedFd::from_raw_fd(fd) }
}
