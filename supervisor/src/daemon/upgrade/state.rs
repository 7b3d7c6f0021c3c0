//! What one berth hands to the next across an in-place upgrade: written to
//! a memfd as JSON, its descriptors (the listener, each worker's wire and
//! output) kept open across the exec and named here by number.

use std::io::{Read, Seek, Write};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use serde::{Deserialize, Serialize};

use crate::child::handover::HandedWorker;

/// The version of this state's shape. A binary reads the versions in
/// [`READS`]; `berth upgrade` asks the new binary before it execs.
pub const VERSION: u32 = 1;
/// The state versions this binary adopts.
pub const READS: &[u32] = &[1];

/// The environment variable that names the state's descriptor.
pub(crate) const ENV_STATE_FD: &str = "BERTH_UPGRADE_STATE_FD";

/// Everything handed over.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Handover {
    pub version: u32,
    /// `ipc-channel`'s version, whose packets `workers` hold.
    pub ipc_channel: String,
    /// The berth that wrote it: its version and its build's mark.
    pub from: String,
    /// The listening socket, still accepting into its backlog.
    pub listener: RawFd,
    /// A descriptor of the binary that wrote it: what the new binary execs
    /// again if it cannot serve.
    pub previous_binary: RawFd,
    /// The descriptor the new binary was exec'd from (kept open across the
    /// exec, for a script's interpreter); closed once it serves.
    #[serde(default = "no_descriptor")]
    pub binary: RawFd,
    pub workers: Vec<HandedWorker>,
    /// The event log, so followers' numbers go on.
    pub events: Vec<crate::supervisor::Event>,
    /// Set by a new binary that gave up and exec'd the previous one: why.
    #[serde(default)]
    pub fell_back: Option<String>,
    /// When the old berth stopped accepting (unix ms): how long the
    /// handover held new connections is measured from here.
    pub paused_at_unix_ms: u64,
    /// Every model registered, as registered (from the files, over the
    /// API, swapped since): the new program registers these, not what the
    /// files say now. `None` from a berth that did not hand them over.
    #[serde(default)]
    pub catalogue: Option<Vec<crate::config::ModelSpec>>,
    /// The config files' texts as last applied: the new program's settings
    /// (a file edited but not reloaded is not applied by an upgrade).
    #[serde(default)]
    pub files: Option<crate::daemon::files::Texts>,
    /// The state file in use (a reload does not change it; neither does an
    /// upgrade).
    #[serde(default)]
    pub state_file: Option<std::path::PathBuf>,
}

impl Handover {
    /// Every descriptor the state names: what the exec must keep open.
    pub(crate) fn descriptors(&self) -> Vec<RawFd> {
        let mut fds = vec![self.listener, self.previous_binary];
        if self.binary >= 0 {
            fds.push(self.binary);
        }
        fds.extend(self.workers.iter().flat_map(HandedWorker::descriptors));
        fds
    }

    /// Writes the state into a new memfd (close-on-exec until the exec).
    pub(crate) fn to_memfd(&self) -> std::io::Result<OwnedFd> {
        let json = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        // SAFETY: memfd_create takes a NUL-terminated name and flags.
        let fd = unsafe { libc::memfd_create(c"berth-upgrade".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor memfd_create just returned, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut file = std::fs::File::from(fd);
        file.write_all(&json)?;
        Ok(OwnedFd::from(file))
    }

    /// Reads the state from descriptor `fd` (from the start, so that a
    /// fallback can read it again).
    pub(crate) fn read(fd: RawFd) -> Result<Handover, String> {
        // SAFETY: `fd` was named by the environment as the state's; it is
        // borrowed here (ManuallyDrop), never closed.
        let file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
        let mut file: &std::fs::File = &file;
        file.rewind()
            .map_err(|e| format!("cannot read the handed-over state (descriptor {fd}): {e}"))?;
        let mut text = Vec::new();
        file.read_to_end(&mut text)
            .map_err(|e| format!("cannot read the handed-over state (descriptor {fd}): {e}"))?;
        let handover: Handover = serde_json::from_slice(&text)
            .map_err(|e| format!("the handed-over state is not one this berth reads: {e}"))?;
        if !READS.contains(&handover.version) {
            return Err(format!(
                "the handed-over state is version {}; this berth reads {READS:?}",
                handover.version
            ));
        }
        if handover.ipc_channel != crate::child::handover::ipc::IPC_CHANNEL_VERSION {
            return Err(format!(
                "the handed-over workers speak ipc-channel {}; this berth is built with {}",
                handover.ipc_channel,
                crate::child::handover::ipc::IPC_CHANNEL_VERSION
            ));
        }
        Ok(handover)
    }
}

fn no_descriptor() -> RawFd {
    -1
}
