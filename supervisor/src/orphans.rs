//! Processes that outlive their supervisor, and what berth does about them.
//!
//! Workers die with their supervisor (parent-death signal), but what a
//! worker forked does not: the signal is not inherited across fork. So:
//! - the supervisor can become a *child subreaper*: orphans of its workers
//!   are re-parented to it (not to init), and it reaps them;
//! - every worker's pid, process group and start time is kept in a state
//!   file; a supervisor starting with the same file after one that could
//!   not clean up (it was SIGKILLed, the host lost power to it) stops what
//!   is left in those process groups, checked by boot id and start time so
//!   a recycled pid is never touched.
//!
//! The state file has one writer: a second supervisor given the same file
//! finds it locked (`flock` on `<file>.lock`, which names the holder's pid)
//! and refuses to start, before it reads or writes anything; inside one
//! supervisor, writes are serialised and each writes the latest snapshot.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

/// One live worker, as the state file records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    pub pid: u32,
    /// The worker's process group (its own pid: workers lead their group).
    pub pgid: u32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub start_time: u64,
    pub model: String,
    /// A value unique to this worker, in its environment as
    /// [`ENV_WORKER_MARK`] and inherited by what it starts: where the
    /// worker itself is gone, a process of its group is only taken for its
    /// descendant when it carries the mark.
    #[serde(default)]
    pub mark: String,
    /// The worker's own cgroup, where it had one: what it started is in it,
    /// whatever group or session that moved to.
    #[serde(default)]
    pub cgroup: Option<PathBuf>,
}

/// The environment variable that carries a worker's mark.
pub const ENV_WORKER_MARK: &str = "BERTH_WORKER_MARK";

/// A fresh mark for a worker about to start.
pub(crate) fn new_mark() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    format!("{:016x}", h.finish())
}

fn carries_mark(pid: u32, mark: &str) -> bool {
    let wanted = format!("{ENV_WORKER_MARK}={mark}");
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|env| env.split(|b| *b == 0).any(|var| var == wanted.as_bytes()))
}

#[derive(Debug, Serialize, Deserialize)]
struct StateFile {
    supervisor_pid: u32,
    boot_id: String,
    workers: Vec<WorkerRecord>,
}

static LIVE: Mutex<BTreeMap<u32, WorkerRecord>> = Mutex::new(BTreeMap::new());
static STATE_FILE: OnceLock<PathBuf> = OnceLock::new();
/// Held for the life of the process: the state file's lock.
static STATE_LOCK: OnceLock<std::fs::File> = OnceLock::new();
/// Serialises writes of the state file.
static WRITING: Mutex<()> = Mutex::new(());

fn live() -> std::sync::MutexGuard<'static, BTreeMap<u32, WorkerRecord>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Live processes (not zombies) carrying `mark`, started no earlier than
/// `since` (clock ticks after boot): what a worker with that mark started.
pub(crate) fn carrying_mark(mark: &str, since: u64) -> Vec<u32> {
    if mark.is_empty() {
        return Vec::new();
    }
    let me = std::process::id() as i32;
    let Ok(all) = procfs::process::all_processes() else {
        return Vec::new();
    };
    all.filter_map(Result::ok)
        .filter_map(|p| p.stat().ok())
        .filter(|s| s.pid != me && s.starttime >= since && s.state != 'Z' && s.state != 'X')
        .map(|s| s.pid as u32)
        .filter(|pid| carries_mark(*pid, mark))
        .collect()
}

/// True while `pid` is a process that is not a zombie.
pub(crate) fn is_live(pid: u32) -> bool {
    procfs::process::Process::new(pid as i32)
        .and_then(|p| p.stat())
        .is_ok_and(|s| s.state != 'Z' && s.state != 'X')
}

/// Reaps those of `pids` that are this process's exited children (a
/// worker's escaped processes, adopted by a subreaper supervisor). Only
/// these pids: an embedding host's own children are never touched.
pub(crate) fn reap_exact(pids: &std::collections::BTreeSet<u32>) {
    let me = std::process::id() as i32;
    for pid in pids {
        let ours = procfs::process::Process::new(*pid as i32)
            .and_then(|p| p.stat())
            .is_ok_and(|s| s.ppid == me && s.state == 'Z');
        if ours {
            let _ = nix::sys::wait::waitpid(
                Pid::from_raw(*pid as i32),
                Some(nix::sys::wait::WaitPidFlag::WNOHANG),
            );
        }
    }
}

pub(crate) fn start_time(pid: u32) -> Option<u64> {
    procfs::process::Process::new(pid as i32)
        .and_then(|p| p.stat())
        .ok()
        .map(|s| s.starttime)
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Called when a worker starts.
pub(crate) fn register(pid: u32, model: &str, mark: &str, cgroup: Option<PathBuf>) {
    let record = WorkerRecord {
        pid,
        pgid: pid,
        start_time: start_time(pid).unwrap_or(0),
        model: model.into(),
        mark: mark.into(),
        cgroup,
    };
    live().insert(pid, record);
    persist();
}

/// Called once a worker has been reaped.
pub(crate) fn unregister(pid: u32) {
    live().remove(&pid);
    persist();
}

/// The state file this process keeps, once it has one.
pub fn state_file() -> Option<&'static Path> {
    STATE_FILE.get().map(PathBuf::as_path)
}

/// Pids of this process's live workers.
pub fn live_pids() -> Vec<u32> {
    live().keys().copied().collect()
}

/// True for a pid this process spawned as a worker and has not reaped.
fn is_worker(pid: u32) -> bool {
    live().contains_key(&pid) || waited_for().contains(&pid)
}

/// Children this process runs outside its own group and waits for itself
/// (a `--backends` probe): never reaped as strays.
fn waited_for() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<u32>> {
    static WAITED: Mutex<std::collections::BTreeSet<u32>> =
        Mutex::new(std::collections::BTreeSet::new());
    WAITED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Children being started and not yet registered (as a worker, or with
/// [`waiting_for`]), and how many starts there have been: the stray
/// reaper reaps nothing while one is under way or if one began during its
/// scan, so a child that exits at once is never taken from its waiter.
static SPAWNS_IN_PROGRESS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static SPAWNS_BEGUN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Held from before a child is started until it is registered.
#[derive(Debug)]
pub(crate) struct Spawning(());

pub(crate) fn spawning() -> Spawning {
    use std::sync::atomic::Ordering;
    SPAWNS_BEGUN.fetch_add(1, Ordering::SeqCst);
    SPAWNS_IN_PROGRESS.fetch_add(1, Ordering::SeqCst);
    Spawning(())
}

impl Drop for Spawning {
    fn drop(&mut self) {
        SPAWNS_IN_PROGRESS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Keeps the stray reaper off `pid`, a child the caller waits for itself,
/// until the returned guard is dropped (after that wait).
pub(crate) fn waiting_for(pid: u32) -> WaitingFor {
    waited_for().insert(pid);
    WaitingFor(pid)
}

/// See [`waiting_for`].
#[derive(Debug)]
pub(crate) struct WaitingFor(u32);

impl Drop for WaitingFor {
    fn drop(&mut self) {
        waited_for().remove(&self.0);
    }
}

fn persist() {
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

/// Kills every live worker's process group now (SIGKILL), for a stop that
/// cannot wait. Returns how many groups were signalled.
pub fn kill_all_now() -> usize {
    let groups: Vec<u32> = live().values().map(|r| r.pgid).collect();
    let own = nix::unistd::getpgrp().as_raw() as u32;
    groups
        .into_iter()
        .filter(|&g| g > 1 && g != own)
        .filter(|&g| killpg(Pid::from_raw(g as i32), Signal::SIGKILL).is_ok())
        .count()
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

/// Makes this process the subreaper of everything its workers fork.
pub fn become_subreaper() -> std::io::Result<()> {
    // SAFETY: PR_SET_CHILD_SUBREAPER takes an integer flag; no memory is involved.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Which exited children [`reap_strays`] may reap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strays {
    /// Every child outside this process's own group that is not a worker:
    /// orphans of workers, re-parented to a subreaper, are always in a
    /// worker's group; children this process ran itself (a `--backends`
    /// probe, pip) are in its own group and are left to whoever waits for
    /// them. Only for the `berth serve` daemon.
    All,
    /// Only those in this process group (a worker's, after a sweep). An
    /// embedding host's own children are never touched: reaping them would
    /// steal their exit status from its `wait`.
    InGroup(u32),
}

/// Reaps exited children that are not workers (orphans re-parented to a
/// subreaper). Workers are left to their own waiters.
pub fn reap_strays(which: Strays) -> usize {
    use std::sync::atomic::Ordering;
    let me = std::process::id() as i32;
    let own_group = nix::unistd::getpgrp().as_raw();
    let begun = SPAWNS_BEGUN.load(Ordering::SeqCst);
    if SPAWNS_IN_PROGRESS.load(Ordering::SeqCst) > 0 {
        return 0;
    }
    let Ok(all) = procfs::process::all_processes() else {
        return 0;
    };
    let strays: Vec<u32> = all
        .filter_map(Result::ok)
        .filter_map(|p| p.stat().ok())
        .filter(|s| s.ppid == me && s.state == 'Z' && !is_worker(s.pid as u32))
        .filter(|s| match which {
            Strays::All => s.pgrp != own_group,
            Strays::InGroup(pgid) => s.pgrp == pgid as i32,
        })
        .map(|s| s.pid as u32)
        .collect();
    // A start that began meanwhile may have made one of these zombies
    // before it registered its child: next time.
    if SPAWNS_IN_PROGRESS.load(Ordering::SeqCst) > 0 || SPAWNS_BEGUN.load(Ordering::SeqCst) != begun
    {
        return 0;
    }
    for pid in &strays {
        let _ = nix::sys::wait::waitpid(
            Pid::from_raw(*pid as i32),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG),
        );
    }
    strays.len()
}

/// Adopts `path` as this supervisor's state file: first stops what a
/// previous supervisor recorded there and left running, then keeps the file
/// up to date. Returns how many processes were stopped.
pub fn use_state_file(path: &Path) -> Result<usize, String> {
    use_state_file_keeping(path, &[])
}

/// [`use_state_file`], leaving alone the workers in `keep` (those an
/// in-place upgrade hands over: this process's own children, named in the
/// state file it wrote before its exec).
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
    for record in previous.workers.iter().filter(|r| !keep.contains(&r.pid)) {
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

/// Kills and reaps every process this supervisor adopted as a subreaper
/// (what its workers forked and left behind, whatever group or session it
/// moved to) that is still its child: at the end of `berth serve`, so none
/// goes on under init. Children in the supervisor's own process group
/// (what it ran itself) are left alone. Returns how many.
pub fn kill_adopted() -> usize {
    let me = std::process::id() as i32;
    let own_group = nix::unistd::getpgrp().as_raw();
    let Ok(all) = procfs::process::all_processes() else {
        return 0;
    };
    let adopted: std::collections::BTreeSet<u32> = all
        .filter_map(Result::ok)
        .filter_map(|p| p.stat().ok())
        .filter(|s| s.ppid == me && s.pgrp != own_group && !is_worker(s.pid as u32))
        .map(|s| s.pid as u32)
        .collect();
    for pid in &adopted {
        let _ = nix::sys::signal::kill(Pid::from_raw(*pid as i32), Signal::SIGKILL);
    }
    for _ in 0..100 {
        reap_exact(&adopted);
        if !adopted.iter().any(|pid| {
            procfs::process::Process::new(*pid as i32)
                .and_then(|p| p.stat())
                .is_ok_and(|s| s.ppid == me)
        }) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    adopted.len()
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
