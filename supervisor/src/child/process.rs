//! Watching a worker process: its exit status and its output.
//!
//! Every worker is reaped the moment it exits: a pidfd (Linux 5.3+) turns
//! readable then, and the runtime's reactor wakes a task that reaps it, so
//! an idle worker costs no thread. Where `pidfd_open` is refused (an older
//! kernel, a seccomp filter) a thread blocks in `wait()` instead. Its
//! stdout and stderr are read line by line into the log the same way
//! (`child/output.rs`), keeping the last lines of stderr for error
//! messages.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::sync::watch;

use crate::base::{CapMechanism, ExitStatus, KillCause};
use crate::child::limits::{Cgroup, MemoryCap};
use crate::report::WorkerStart;

pub use crate::child::output::STDERR_TAIL_LINES;
use crate::child::output::forward_lines;

#[derive(Debug)]
pub(crate) struct ProcessWatch {
    pid: u32,
    exit: watch::Receiver<Option<ExitStatus>>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    stderr_closed: watch::Receiver<bool>,
    cap: Option<MemoryCap>,
    /// The cgroup of a worker without a cap (a capped one's is its cap's).
    fence: Option<Cgroup>,
    /// Its mark (`BERTH_WORKER_MARK`), which what it starts inherits.
    mark: String,
    /// Its start time (clock ticks after boot): nothing it started is older.
    start_time: u64,
    model: String,
    kill_cause: Mutex<Option<KillCause>>,
    /// Highest RSS the supervisor saw (the RSS-polling cap's evidence).
    polled_peak: std::sync::atomic::AtomicU64,
    /// A stop has begun: its exit is planned, its sweep is the stop's, and
    /// a health check failing meanwhile (a server closes its socket on
    /// SIGTERM) is no reason to kill it.
    stopping: std::sync::atomic::AtomicBool,
    /// How it began: started cold, or forked from a preloaded interpreter.
    start: WorkerStart,
    /// Copies of the read ends of its stdout and stderr, which an in-place
    /// upgrade hands over (the readers own the live ones).
    output_fds: Option<(OwnedFd, OwnedFd)>,
}

impl ProcessWatch {
    /// Takes ownership of the child: from here on, this watch reaps it.
    /// `mark` is the one the worker was started with (its environment's
    /// `BERTH_WORKER_MARK`), kept in the state file.
    pub fn start(
        model: &str,
        mut child: Child,
        cap: Option<MemoryCap>,
        fence: Option<Cgroup>,
        mark: &str,
    ) -> Self {
        let pid = child.id();
        let out = child.stdout.take().map(|o| File::from(OwnedFd::from(o)));
        let err = child.stderr.take().map(|e| File::from(OwnedFd::from(e)));
        Self::watch(
            model,
            pid,
            (out, err),
            Reapable::Child(child),
            cap,
            fence,
            mark,
        )
    }

    /// Takes over a worker this process did not spawn but is now the parent
    /// of (forked from a preloaded interpreter and re-parented to this
    /// subreaper): from here on, this watch reaps it. `output` is the read
    /// ends of its stdout and stderr.
    pub fn adopt(
        model: &str,
        pid: u32,
        output: (File, File),
        cap: Option<MemoryCap>,
        fence: Option<Cgroup>,
        mark: &str,
    ) -> Self {
        let (out, err) = output;
        Self::watch(
            model,
            pid,
            (Some(out), Some(err)),
            Reapable::Adopted(pid),
            cap,
            fence,
            mark,
        )
    }

    fn watch(
        model: &str,
        pid: u32,
        (out, err): (Option<File>, Option<File>),
        reapable: Reapable,
        cap: Option<MemoryCap>,
        fence: Option<Cgroup>,
        mark: &str,
    ) -> Self {
        let stderr = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL_LINES)));
        let (closed_tx, stderr_closed) = watch::channel(false);
        let output_fds = match (&out, &err) {
            (Some(out), Some(err)) => out
                .try_clone()
                .ok()
                .zip(err.try_clone().ok())
                .map(|(out, err)| (OwnedFd::from(out), OwnedFd::from(err))),
            _ => None,
        };
        if let Some(out) = out {
            forward_lines(model, pid, "stdout", out, None, None);
        }
        match err {
            Some(err) => forward_lines(
                model,
                pid,
                "stderr",
                err,
                Some(Arc::clone(&stderr)),
                Some(closed_tx),
            ),
            None => {
                let _ = closed_tx.send(true);
            }
        }
        let cgroup = cap
            .as_ref()
            .and_then(MemoryCap::cgroup)
            .or(fence.as_ref())
            .map(|c| c.dir().to_path_buf());
        crate::child::orphans::register(pid, model, mark, cgroup);
        let (exit_tx, exit) = watch::channel(None);
        reap(reapable, move |status| {
            crate::child::orphans::unregister(pid);
            let _ = exit_tx.send(Some(status));
        });
        ProcessWatch {
            pid,
            exit,
            stderr,
            stderr_closed,
            cap,
            fence,
            mark: mark.to_string(),
            start_time: crate::child::orphans::start_time(pid).unwrap_or(0),
            model: model.to_string(),
            kill_cause: Mutex::new(None),
            polled_peak: std::sync::atomic::AtomicU64::new(0),
            stopping: std::sync::atomic::AtomicBool::new(false),
            start: WorkerStart::Cold,
            output_fds,
        }
    }

    /// The copies of its output's read ends an in-place upgrade hands over.
    pub(crate) fn output_fds(&self) -> Option<&(OwnedFd, OwnedFd)> {
        self.output_fds.as_ref()
    }

    /// Its memory cap or own cgroup as an in-place upgrade hands them over.
    pub(crate) fn handed_limits(
        &self,
    ) -> (
        Option<crate::child::limits::HandedCap>,
        Option<crate::child::limits::HandedCgroup>,
    ) {
        (
            self.cap.as_ref().map(MemoryCap::handed),
            self.fence.as_ref().map(Cgroup::handed),
        )
    }

    /// Says how it began (cold by default).
    pub(crate) fn with_start(mut self, start: WorkerStart) -> Self {
        self.start = start;
        self
    }

    /// How it began.
    pub fn start_kind(&self) -> &WorkerStart {
        &self.start
    }

    /// Marks the start of a planned stop.
    pub fn begin_stop(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether a planned stop has begun.
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn cap(&self) -> Option<&MemoryCap> {
        self.cap.as_ref()
    }

    /// The worker's own cgroup, if it has one: everything it started is in it.
    pub fn cgroup(&self) -> Option<&Cgroup> {
        self.cap
            .as_ref()
            .and_then(MemoryCap::cgroup)
            .or(self.fence.as_ref())
    }

    /// The worker's mark, which everything it starts inherits.
    pub fn mark(&self) -> &str {
        &self.mark
    }

    /// When the worker started, in clock ticks after boot.
    pub fn start_time(&self) -> u64 {
        self.start_time
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    /// Kills the group, recording why (the first cause recorded wins).
    pub fn kill_for(&self, cause: KillCause) {
        self.kill_cause
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(cause);
        self.signal_group(Signal::SIGKILL);
    }

    /// Why the worker died, if the supervisor or its cgroup killed it.
    pub fn kill_cause(&self) -> Option<KillCause> {
        if let Some(cause) = self
            .kill_cause
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Some(cause);
        }
        let cap = self.cap.as_ref()?;
        cap.oom_killed().then(|| KillCause::MemoryLimit {
            limit_bytes: cap.limit,
            peak_bytes: cap.peak().unwrap_or(cap.limit),
            mechanism: cap.mechanism,
        })
    }

    /// For a cap the kernel cannot enforce: samples RSS every 50 ms until the
    /// process exits and kills it past the limit.
    pub fn spawn_rss_guard(self: &Arc<Self>) {
        let Some(cap) = &self.cap else { return };
        if cap.mechanism != CapMechanism::RssPoll {
            return;
        }
        let limit = cap.limit;
        let watch = Arc::clone(self);
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(Duration::from_millis(50));
            while watch.try_exit().is_none() {
                ticker.tick().await;
                let rss = crate::child::memory::process_memory(watch.pid)
                    .map(|m| m.rss_bytes)
                    .unwrap_or(0);
                let peak = watch
                    .polled_peak
                    .fetch_max(rss, std::sync::atomic::Ordering::Relaxed)
                    .max(rss);
                if rss > limit {
                    watch.kill_for(KillCause::MemoryLimit {
                        limit_bytes: limit,
                        peak_bytes: peak,
                        mechanism: CapMechanism::RssPoll,
                    });
                    return;
                }
            }
        });
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The exit status, once the process has been reaped.
    pub fn try_exit(&self) -> Option<ExitStatus> {
        self.exit.borrow().clone()
    }

    /// Waits until the process has exited and been reaped.
    pub async fn exited(&self) -> ExitStatus {
        let mut rx = self.exit.clone();
        match rx.wait_for(Option::is_some).await {
            Ok(status) => status.clone().unwrap_or(ExitStatus::Code(-1)),
            Err(_) => ExitStatus::Code(-1),
        }
    }

    /// [`Self::exited`] bounded by `timeout`.
    pub async fn exited_within(&self, timeout: Duration) -> Option<ExitStatus> {
        tokio::time::timeout(timeout, self.exited()).await.ok()
    }

    /// The last stderr lines, after giving the pipe a moment to deliver what
    /// a dying process wrote (a grandchild holding the pipe open must not
    /// hold us up, hence the bound).
    pub async fn stderr_tail(&self) -> Vec<String> {
        let mut closed = self.stderr_closed.clone();
        let _ = tokio::time::timeout(Duration::from_millis(250), closed.wait_for(|c| *c)).await;
        self.stderr_lines()
    }

    /// The last stderr lines kept so far, without waiting.
    pub fn stderr_lines(&self) -> Vec<String> {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    pub async fn stderr_suffix(&self) -> String {
        let tail = self.stderr_tail().await;
        if tail.is_empty() {
            String::new()
        } else {
            format!(" (stderr: {})", tail.join(" | "))
        }
    }

    /// Sends `signal` to the worker's whole process group. A group that is
    /// already gone is not an error.
    pub fn signal_group(&self, signal: Signal) {
        match killpg(Pid::from_raw(self.pid as i32), signal) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
            Err(e) => {
                tracing::warn!(pid = self.pid, %signal, "cannot signal the worker's group: {e}")
            }
        }
    }
}

/// A child process to reap: one spawned here, or one adopted (forked by a
/// preloaded interpreter and re-parented to this subreaper), known by pid.
enum Reapable {
    Child(Child),
    Adopted(u32),
}

impl Reapable {
    fn pid(&self) -> u32 {
        match self {
            Reapable::Child(child) => child.id(),
            Reapable::Adopted(pid) => *pid,
        }
    }

    /// Its status if it has exited (and is now reaped), `None` if it runs.
    fn try_wait(&mut self) -> Option<ExitStatus> {
        match self {
            Reapable::Child(child) => match child.try_wait() {
                Ok(Some(status)) => Some(ExitStatus::from_std(status)),
                Ok(None) => None,
                Err(_) => Some(ExitStatus::Code(-1)),
            },
            Reapable::Adopted(pid) => adopted_status(*pid, Some(WaitPidFlag::WNOHANG)),
        }
    }

    /// Blocks until it exits; its status.
    fn wait(self) -> ExitStatus {
        match self {
            Reapable::Child(mut child) => match child.wait() {
                Ok(status) => ExitStatus::from_std(status),
                Err(_) => ExitStatus::Code(-1),
            },
            Reapable::Adopted(pid) => loop {
                if let Some(status) = adopted_status(pid, None) {
                    return status;
                }
            },
        }
    }
}

/// `waitpid` on an adopted child: its status once it has exited, `None`
/// while it runs (with `WNOHANG`) or a wait was interrupted.
fn adopted_status(pid: u32, flags: Option<WaitPidFlag>) -> Option<ExitStatus> {
    match waitpid(Pid::from_raw(pid as i32), flags) {
        Ok(WaitStatus::Exited(_, code)) => Some(ExitStatus::Code(code)),
        Ok(WaitStatus::Signaled(_, signal, _)) => Some(ExitStatus::Signal(signal.as_str().into())),
        Ok(_) | Err(nix::errno::Errno::EINTR) => None,
        // ECHILD: not our child (any more): nothing to wait for.
        Err(_) => Some(ExitStatus::Code(-1)),
    }
}

/// Reaps a child once it exits and hands its status to `exited`: on the
/// runtime through a pidfd, or on a thread of its own where there is no
/// pidfd or no runtime.
fn reap(child: Reapable, exited: impl FnOnce(ExitStatus) + Send + 'static) {
    let pid = child.pid();
    let mut unreaped = Unreaped(Some((child, Box::new(exited))));
    let reactor = tokio::runtime::Handle::try_current().ok();
    let pidfd = reactor.as_ref().and_then(|_| pidfd_open(pid));
    if let (Some(reactor), Some(pidfd)) = (reactor, pidfd) {
        // Registering needs the runtime's context, which this thread has.
        // SAFETY: an `OwnedFd` is a valid open descriptor that stays open,
        // and its `as_raw_fd` always names it, until the `AsyncFd` drops it.
        let registered = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
        };
        match registered.map_err(|e| e.into_parts().1) {
            Ok(pidfd) => {
                reactor.spawn(async move {
                    loop {
                        if unreaped.try_reap() {
                            return;
                        }
                        match pidfd.readable().await {
                            Ok(mut ready) => ready.clear_ready(),
                            // The reactor is going away: `unreaped`'s drop
                            // hands the wait to a thread.
                            Err(_) => return,
                        }
                    }
                });
                return;
            }
            Err(e) => tracing::debug!(pid, "cannot watch the worker's pidfd ({e}); a thread waits"),
        }
    }
    drop(unreaped);
}

/// A worker not yet reaped, and who to tell when it is. Dropped unreaped
/// (no pidfd, or the runtime shut down with the reaping task pending), it
/// hands the blocking wait to a thread, so no worker is left a zombie and
/// its pid is never forgotten while it could still be reused.
struct Unreaped(Option<(Reapable, Exited)>);

/// Who is told of a worker's exit status, once.
type Exited = Box<dyn FnOnce(ExitStatus) + Send>;

impl Unreaped {
    /// Reaps it if it has exited; true once it is reaped and told.
    fn try_reap(&mut self) -> bool {
        let Some((child, _)) = self.0.as_mut() else {
            return true;
        };
        let Some(status) = child.try_wait() else {
            return false;
        };
        if let Some((_, exited)) = self.0.take() {
            exited(status);
        }
        true
    }
}

impl Drop for Unreaped {
    fn drop(&mut self) {
        let Some((child, exited)) = self.0.take() else {
            return;
        };
        let pid = child.pid();
        let spawned = std::thread::Builder::new()
            .name(format!("berth-wait-{pid}"))
            .spawn(move || exited(child.wait()));
        if spawned.is_err() {
            tracing::error!(
                pid,
                "cannot start a waiter thread; the worker will not be reaped promptly"
            );
        }
    }
}

/// A descriptor that turns readable when process `pid` exits; `None` where
/// the kernel refuses it. The process is our unreaped child (spawned, or
/// adopted), so its pid cannot be reused before we reap it.
fn pidfd_open(pid: u32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // or -1; it touches no memory of ours.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the syscall succeeded, so `fd` is an open descriptor that
    // nothing else owns. pidfds are close-on-exec.
    Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}
