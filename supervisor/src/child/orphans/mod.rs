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
//! supervisor, writes are serialised and each writes the latest snapshot
//! (`state_file.rs`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

mod state_file;

use state_file::persist;
pub use state_file::{state_file, use_state_file_keeping};

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

/// Every live worker, by pid.
static LIVE: Mutex<BTreeMap<u32, WorkerRecord>> = Mutex::new(BTreeMap::new());

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
