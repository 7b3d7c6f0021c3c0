//! The state file: every live worker's pid, process group, start time,
//! mark and cgroup, written at each start and reap, so that a supervisor
//! starting after one that could not clean up (SIGKILLed, its host lost
//! power to it) stops what is left, checked by boot id and start time so a
//! recycled pid is never touched. One writer: the file's lock
//! (`flock` on `<file>.lock`, naming the holder's pid) is taken before
//! anything is read or written.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use super::{WorkerRecord, carries_mark, carrying_mark, live};

#[derive(Debug, Serialize, Deserialize)]
struct StateFile {
    supervisor_pid: u32,
    boot_id: String,
    workers: Vec<WorkerRecord>,
}

/// The state file, once this process has one.
static STATE_FILE: OnceLock<PathBuf> = OnceLock::new();

/// Held for the life of the process: the state file's lock.
static STATE_LOCK: OnceLock<std::fs::File> = OnceLock::new();

/// Serialises writes of the state file.
static WRITING: Mutex<()> = Mutex::new(());

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The state file this process keeps, once it has one.
pub fn state_file() -> Option<&'static Path> {
    STATE_FILE.get().map(PathBuf::as_path)
}

pub(super) fn persist() {
    let Some(path) = STATE_FILE.get() else { return };
    // One write at a time, each of the snapshot taken under the same lock:
    // the last write is always of the latest state.
    let _writing = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    let state = StateFile {
        supervisor_pid: std::process::id(),
        boot_id: boot_id(),
        workers: live().values().cloned().collect(),
    };
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let written = serde_json::to_vec_pretty(&state)
        .map_err(std::io::Error::other)
        .and_then(|bytes| {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            // Its own user's alone (a file others could write is refused
            // when it is read back).
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .and_then(|mut file| file.write_all(&bytes))
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        tracing::warn!(path = %path.display(), "cannot write the state file: {e}");
    }
}

/// Takes the state file's lock, or names the supervisor that holds it.
fn lock_state_file(path: &Path) -> Result<(), String> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::io::AsRawFd;
    let lock_path = path.with_extension("lock");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(|e| {
            format!(
                "cannot open the state file's lock {}: {e}",
                lock_path.display()
            )
        })?;
    // SAFETY: flock on a descriptor this function owns; no memory involved.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        return Err(format!(
            "state file {} is in use by another berth serve (pid {}); give this one its own \
             `state_file` (and address), or stop that one first",
            path.display(),
            holder.trim()
        ));
    }
    let _ = file.set_len(0);
    let _ = file.rewind();
    let _ = write!(file, "{}", std::process::id());
    STATE_LOCK
        .set(file)
        .map_err(|_| "a state file is already in use".to_string())
}

/// Adopts `path` as this supervisor's state file: first stops what a
/// previous supervisor recorded there and left running (but the workers in
/// `keep`: those an in-place upgrade hands over, this process's own
/// children, named in the state file it wrote before its exec), then keeps
/// the file up to date. Returns how many processes were stopped.
pub fn use_state_file_keeping(path: &Path, keep: &[u32]) -> Result<usize, String> {
    // Checked before anything is created or locked: a path that is not a
    // state file of berth's is refused and left as it is.
    trusted_state_file(path)?;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    }
    lock_state_file(path)?;
    let previous = trusted_state_file(path)?;
    let stopped = previous
        .as_ref()
        .map_or(0, |previous| stop_leftovers(previous, keep));
    STATE_FILE
        .set(path.to_path_buf())
        .map_err(|_| "a state file is already in use".to_string())?;
    persist();
    Ok(stopped)
}

/// The state file at `path`, if there is one, checked before anything in
/// it is believed: a berth state file (JSON of its shape), a regular file
/// (not a directory, a symlink or a device), owned by this process's user
/// and writable by no one else. Its entries name processes to kill, so a
/// file someone else could write is refused, as is any file that is not
/// berth's (it would be overwritten), each with why.
fn trusted_state_file(path: &Path) -> Result<Option<StateFile>, String> {
    use std::os::unix::fs::MetadataExt;
    let shown = path.display();
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read the state file {shown}: {e}")),
    };
    let refuse = |why: String| {
        Err(format!(
            "state file {shown} {why}; name another `state_file` in the config (or remove that \
             path if it is a stale one of your own)"
        ))
    };
    if meta.is_dir() {
        return refuse("is a directory".into());
    }
    if !meta.is_file() {
        return refuse("is not a regular file (a symlink, a FIFO or a device)".into());
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return refuse(format!(
            "belongs to uid {}, not to this server's user (uid {me}): the processes it names \
             are not to be trusted",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return refuse(format!(
            "is writable by other users (mode {:o}): anyone could make berth kill their \
             processes through it",
            meta.mode() & 0o777
        ));
    }
    let bytes =
        std::fs::read(path).map_err(|e| format!("cannot read the state file {shown}: {e}"))?;
    match serde_json::from_slice::<StateFile>(&bytes) {
        Ok(state) => Ok(Some(state)),
        Err(e) => refuse(format!(
            "is not a berth state file ({e}), and berth will not overwrite it"
        )),
    }
}

fn stop_leftovers(previous: &StateFile, keep: &[u32]) -> usize {
    if previous.boot_id != boot_id() {
        return 0; // another boot: every pid in it is gone or someone else's
    }
    let leftovers: Vec<_> = previous
        .workers
        .iter()
        .filter(|r| !keep.contains(&r.pid))
        .collect();
    if leftovers.is_empty() {
        // Nothing to stop (an upgrade's takeover keeps every worker): no
        // scan of every process, which took ~1.5 ms while new connections
        // waited for the new program.
        return 0;
    }
    let owner_alive = previous.supervisor_pid != std::process::id()
        && procfs::process::Process::new(previous.supervisor_pid as i32)
            .and_then(|p| p.stat())
            .is_ok_and(|s| s.state != 'Z');
    if owner_alive {
        tracing::warn!(
            pid = previous.supervisor_pid,
            "the previous supervisor is still running; leaving its workers alone"
        );
        return 0;
    }
    let mut stopped = 0;
    let Ok(all) = procfs::process::all_processes() else {
        return 0;
    };
    let stats: Vec<_> = all
        .filter_map(Result::ok)
        .filter_map(|p| p.stat().ok())
        .collect();
    let own_group = nix::unistd::getpgrp().as_raw() as u32;
    for record in leftovers {
        let Some(leader_alive) = is_provably_ours(record, own_group, &stats) else {
            continue;
        };
        // What is still in the worker's group and started no earlier than
        // the worker: with the worker alive (same pid, same start time) its
        // whole group; with it gone, only processes that carry its mark.
        let members: Vec<u32> = stats
            .iter()
            .filter(|s| {
                s.pgrp == record.pgid as i32 && s.starttime >= record.start_time && s.state != 'Z'
            })
            .map(|s| s.pid as u32)
            .filter(|pid| leader_alive || carries_mark(*pid, &record.mark))
            .collect();
        if members.is_empty() {
            continue;
        }
        tracing::warn!(
            model = record.model,
            pgid = record.pgid,
            ?members,
            "stopping processes left by a previous supervisor"
        );
        if leader_alive {
            let _ = killpg(Pid::from_raw(record.pgid as i32), Signal::SIGKILL);
        } else {
            for pid in &members {
                let _ = nix::sys::signal::kill(Pid::from_raw(*pid as i32), Signal::SIGKILL);
            }
        }
        stopped += members.len();
    }
    for record in previous.workers.iter().filter(|r| !keep.contains(&r.pid)) {
        if is_provably_ours(record, own_group, &stats).is_none() {
            continue;
        }
        stopped += stop_escaped(record);
    }
    stopped
}

/// Stops what a recorded worker started outside its group: every task of
/// its cgroup (a worker cgroup a berth supervisor made, by its path), and
/// every process carrying its mark. Returns how many.
fn stop_escaped(record: &WorkerRecord) -> usize {
    let mut found = std::collections::BTreeSet::new();
    if let Some(dir) = &record.cgroup
        && let Some(version) = crate::child::limits::is_worker_cgroup(dir)
    {
        found.extend(crate::child::limits::members_of(dir));
        crate::child::limits::kill_cgroup(dir, version);
    }
    let marked = carrying_mark(&record.mark, record.start_time);
    for pid in &marked {
        let _ = nix::sys::signal::kill(Pid::from_raw(*pid as i32), Signal::SIGKILL);
    }
    found.extend(marked);
    if !found.is_empty() {
        tracing::warn!(
            model = record.model,
            ?found,
            "stopped processes a previous supervisor's worker left outside its group"
        );
    }
    if let Some(dir) = &record.cgroup {
        // Empty once its tasks are gone; a folder another supervisor made.
        for _ in 0..20 {
            if crate::child::limits::remove_cgroup(dir) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    found.len()
}

/// Whether a recorded worker's group may be acted on (the boot id was
/// checked by the caller), and whether its leader, the worker, still lives:
/// - never group 0 or 1, and never this process's own group;
/// - a start time and a mark were recorded (without them nothing is proven);
/// - the group's leader, where it still lives, is the recorded worker: same
///   pid and same start time (`Some(true)`). Where it is gone (`Some(false)`)
///   the caller takes only processes carrying the worker's mark, since the
///   pid may since have led another group.
fn is_provably_ours(
    record: &WorkerRecord,
    own_group: u32,
    stats: &[procfs::process::Stat],
) -> Option<bool> {
    if record.pgid <= 1 || record.pgid == own_group || record.pgid != record.pid {
        return None;
    }
    if record.start_time == 0 || record.mark.is_empty() {
        return None;
    }
    match stats.iter().find(|s| s.pid == record.pid as i32) {
        Some(leader)
            if leader.starttime == record.start_time && leader.pgrp == record.pgid as i32 =>
        {
            Some(true)
        }
        Some(_) => None,
        None => Some(false),
    }
}
