//! A worker kind's preloaded interpreter: the kind's own program, started
//! with `BERTH_PRELOAD`, imports the kind's heavy modules once and then
//! forks a worker for each load, swap, recycle and restart of a model of
//! that kind (`python/berth_worker/preloader.py`; docs/wire.md, "Preloaded
//! workers").
//!
//! A fork is double: the preloader's child forks the worker and exits, so
//! the worker is re-parented to this supervisor, a child subreaper, which
//! reaps it and reads its exit status as it does a spawned worker's. The
//! fork frame carries everything the spawn path would have set: the
//! worker's whole environment (the same [`worker_env`]), its folder, the
//! cgroup it joins before its backend loads, and three descriptors: its
//! wire's socket, its stdout and its stderr.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Deserialize;
use tokio::io::unix::AsyncFd;

use crate::child::limits::Cgroup;
use crate::child::memory::{ProcessMemory, process_memory, tree_memory};
use crate::child::process::ProcessWatch;
use crate::child::spawn::{Connect, SpawnOptions, spawn, worker_env};
use crate::child::stream::io as wire_io;

/// The environment variable that makes a `berth_worker` program a preloader.
pub(crate) const ENV_PRELOAD: &str = "BERTH_PRELOAD";

/// The variable of spaces that makes room in the preloader's environment
/// block for each worker's environment (environ_block.py), and its size.
const ENV_SPACE: &str = "BERTH_ENV_SPACE";
const ENV_SPACE_BYTES: usize = 32 << 10;

/// The `cgroup.procs` of the cgroup the preloader's first spare worker
/// joins (each fork frame names the next one's).
const ENV_SPARE_CGROUP: &str = "BERTH_SPARE_CGROUP";

/// The longest control frame either side sends.
const MAX_FRAME: usize = 1 << 20;

/// Whether this process is a child subreaper: a preloader's workers are
/// re-parented to it only then, and only then can it reap them.
pub(crate) fn is_subreaper() -> bool {
    let mut flag: libc::c_int = 0;
    // SAFETY: PR_GET_CHILD_SUBREAPER writes one int through the pointer.
    let rc = unsafe { libc::prctl(libc::PR_GET_CHILD_SUBREAPER, &mut flag as *mut libc::c_int) };
    rc == 0 && flag != 0
}

/// Why a preloader could not be had.
#[derive(Debug, Clone)]
pub(crate) enum StartFailure {
    /// The preload is the operator's mistake (a module that starts a
    /// thread, opens a GPU, or does not import): the kind starts cold
    /// until the configuration changes.
    Refused { module: String, reason: String },
    /// It failed this time (it died, timed out, broke the control socket):
    /// the next load tries again.
    Failed(String),
}

impl std::fmt::Display for StartFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartFailure::Refused { module, reason } => {
                write!(f, "the preload was refused: module `{module}`: {reason}")
            }
            StartFailure::Failed(why) => write!(f, "the preloaded interpreter failed: {why}"),
        }
    }
}

/// A running preloaded interpreter of one worker kind.
#[derive(Debug)]
pub(crate) struct Preloader {
    kind: String,
    process: Arc<ProcessWatch>,
    /// One fork at a time: each is a frame out and its answer back.
    control: tokio::sync::Mutex<Control>,
    modules: Vec<String>,
    import: Duration,
    started: Instant,
    forks: AtomicU64,
    next_id: AtomicU64,
    /// Its last full memory reading, and when: `ps` and `/metrics` read it
    /// at most once a second, however many poll (smaps_rollup walks its
    /// page tables: ~10 ms for an interpreter holding PyTorch).
    memory: std::sync::Mutex<Option<(Instant, ProcessMemory)>>,
    /// The cgroup made for its spare worker (spare.py: a worker forked
    /// ahead of its load), which the spare joins while nobody waits: the
    /// next fork's worker is that spare, and this its cgroup. Dropped, once
    /// the preloader has ended, by the task that sweeps up after it.
    spare_cgroup: Arc<std::sync::Mutex<Option<Cgroup>>>,
}

#[derive(Debug)]
struct Control {
    socket: AsyncFd<OwnedFd>,
    buf: Vec<u8>,
}

/// What the preloader says (preloader.py).
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Said {
    Preloaded {
        modules: Vec<String>,
        import_us: u64,
        /// Files the preload left open (they point at /dev/null in workers).
        #[serde(default)]
        open_files: Vec<String>,
    },
    Refused {
        module: String,
        reason: String,
    },
    Forked {
        id: u64,
        pid: u32,
        /// It still holds a spare forked earlier (not this frame's
        /// worker): the frame's `spare_cgroup_procs` goes unused.
        #[serde(default)]
        spare_kept: bool,
    },
    ForkFailed {
        id: Option<u64>,
        reason: String,
    },
}

/// What a fork needs besides the preloader.
pub(crate) struct ForkRequest<'a> {
    pub model: &'a str,
    pub mark: &'a str,
    /// The worker's environment beyond what every worker gets.
    pub extra_env: &'a [(String, String)],
    pub cwd: Option<&'a Path>,
    /// The `cgroup.procs` it writes itself into first.
    pub cgroup_procs: Option<&'a Path>,
    /// Its end of the wire's socket pair.
    pub wire: RawFd,
}

/// Why a fork gave no worker.
#[derive(Debug)]
pub(crate) struct ForkFailure {
    pub why: String,
    /// The preloader did not answer as the protocol says (it timed out,
    /// broke its socket, said something else): it may yet fork a worker
    /// late, and is not to be trusted with another fork.
    pub unanswered: bool,
}

/// A worker the preloader forked, now this process's child.
pub(crate) struct Forked {
    pub pid: u32,
    /// The read ends of its stdout and stderr.
    pub output: (File, File),
}

impl Preloader {
    /// Starts `program` as `kind`'s preloader and waits (up to `timeout`)
    /// until it has imported `modules`.
    pub(crate) async fn start(
        kind: &str,
        program: (&Path, &[String]),
        cwd: Option<&Path>,
        env: &[(String, String)],
        modules: &[String],
        timeout: Duration,
    ) -> Result<Preloader, StartFailure> {
        let failed = |why: String| StartFailure::Failed(why);
        if !is_subreaper() {
            return Err(failed(
                "this supervisor is not a child subreaper, so it could not reap the workers a \
                 preloader forks (berth serve is one; a host embedding berth calls \
                 berth::become_subreaper() first)"
                    .into(),
            ));
        }
        let label = format!("preload-{kind}");
        let (ours, theirs) = wire_io::socket_pair()
            .map_err(|e| failed(format!("cannot create its control socket: {e}")))?;
        let mut env = env.to_vec();
        env.push((
            ENV_PRELOAD.into(),
            serde_json::to_string(modules).unwrap_or_else(|_| "[]".into()),
        ));
        // Room in its initial environment block, which each forked worker
        // overwrites with its own: /proc/<pid>/environ then tells the
        // worker's model and mark, not the preloader's.
        env.push((ENV_SPACE.into(), " ".repeat(ENV_SPACE_BYTES)));
        let spare = spare_cgroup(kind);
        if let Some(procs) = spare.as_ref().and_then(|c| c.procs_file().to_str().ok()) {
            env.push((ENV_SPARE_CGROUP.into(), procs.to_string()));
        }
        let spare_cgroup = Arc::new(std::sync::Mutex::new(spare));
        let fence = Cgroup::create(&label, None)
            .inspect_err(|why| tracing::debug!(kind, "no cgroup for the preloader: {why}"))
            .ok();
        let mark = crate::child::orphans::new_mark();
        let spawning = crate::child::orphans::spawning();
        let child = spawn(SpawnOptions {
            model: &label,
            binary: program.0,
            args: program.1,
            connect: Connect::Stream(theirs.as_raw_fd()),
            cwd,
            mark: &mark,
            extra_env: &env,
            cgroup_procs: fence.as_ref().map(Cgroup::procs_file),
        })
        .await
        .map_err(|e| failed(e.to_string()))?;
        let process = Arc::new(ProcessWatch::start(&label, child, None, fence, &mark));
        drop(spawning);
        drop(theirs);
        // SAFETY: `ours` is an open descriptor this function owns; the
        // `AsyncFd` takes it and is its only user from here on.
        let socket = unsafe { AsyncFd::register(ours) }.map_err(|e| {
            failed(format!(
                "cannot watch its control socket: {}",
                e.into_parts().1
            ))
        })?;
        let mut control = Control {
            socket,
            buf: Vec::new(),
        };
        let started = Instant::now();
        let first = tokio::time::timeout(timeout, control.read()).await;
        let stop = |process: &ProcessWatch| process.signal_group(nix::sys::signal::Signal::SIGKILL);
        let said = match first {
            Ok(Ok(said)) => said,
            Ok(Err(why)) => {
                stop(&process);
                let exit = process.exited_within(Duration::from_secs(2)).await;
                let tail = process.stderr_suffix().await;
                return Err(failed(format!(
                    "it {}before it was ready{tail}",
                    match exit {
                        Some(status) => format!("exited ({status}) "),
                        None => format!("broke its control socket ({why}) "),
                    }
                )));
            }
            Err(_) => {
                stop(&process);
                return Err(failed(format!(
                    "it did not finish importing within {timeout:?} (half the load_timeout)"
                )));
            }
        };
        match said {
            Said::Preloaded {
                modules,
                import_us,
                open_files,
            } => {
                tracing::info!(
                    kind,
                    pid = process.pid(),
                    import_ms = import_us as f64 / 1e3,
                    "preloaded {}",
                    modules.join(", ")
                );
                if !open_files.is_empty() {
                    tracing::info!(
                        kind,
                        "files the preload left open, which its workers see as /dev/null: {}",
                        open_files.join(", ")
                    );
                }
                // Whatever it started goes with it, however it ends (a
                // crash, a stop): its group, and what left the group (its
                // cgroup, its mark), as for a worker.
                let watched = Arc::clone(&process);
                let spare = Arc::clone(&spare_cgroup);
                tokio::spawn(async move {
                    watched.exited().await;
                    let swept = crate::child::sweep::sweep_all(&watched).await;
                    // Its spare went with its group: the cgroup is empty.
                    drop_later(lock(&spare).take());
                    if swept.found > 0 {
                        tracing::warn!(
                            pid = watched.pid(),
                            "the preloaded interpreter ended; {} processes it started were \
                             killed",
                            swept.found
                        );
                    }
                });
                Ok(Preloader {
                    kind: kind.to_string(),
                    process,
                    control: tokio::sync::Mutex::new(control),
                    modules,
                    import: Duration::from_micros(import_us),
                    started,
                    forks: AtomicU64::new(0),
                    next_id: AtomicU64::new(1),
                    memory: std::sync::Mutex::new(None),
                    spare_cgroup,
                })
            }
            Said::Refused { module, reason } => {
                stop(&process);
                drop_later(lock(&spare_cgroup).take());
                Err(StartFailure::Refused { module, reason })
            }
            other => {
                stop(&process);
                drop_later(lock(&spare_cgroup).take());
                Err(failed(format!("it said {other:?} before it was ready")))
            }
        }
    }

    /// Forks a worker; it is this process's child when this returns.
    /// `Err` says why not (the caller starts the worker cold).
    pub(crate) async fn fork(
        &self,
        request: ForkRequest<'_>,
        timeout: Duration,
    ) -> Result<Forked, ForkFailure> {
        let clean = |why: String| ForkFailure {
            why,
            unanswered: false,
        };
        let unanswered = |why: String| ForkFailure {
            why,
            unanswered: true,
        };
        if let Some(status) = self.process.try_exit() {
            return Err(clean(format!(
                "the preloaded interpreter (pid {}) has exited ({status})",
                self.pid()
            )));
        }
        let (out_r, out_w) =
            pipe().map_err(|e| clean(format!("cannot create its stdout pipe: {e}")))?;
        let (err_r, err_w) =
            pipe().map_err(|e| clean(format!("cannot create its stderr pipe: {e}")))?;
        let env: BTreeMap<String, String> = worker_env(
            request.model,
            request.mark,
            request.extra_env,
            Connect::Stream(request.wire),
        )
        .into_iter()
        .collect();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // Where the spare forked after this one waits for its load.
        let next_spare = spare_cgroup(&self.kind);
        let header = serde_json::json!({
            "type": "fork",
            "id": id,
            "env": env,
            "cwd": request.cwd.map(|p| p.to_string_lossy().into_owned()),
            "cgroup_procs": request.cgroup_procs.map(|p| p.to_string_lossy().into_owned()),
            "spare_cgroup_procs": next_spare
                .as_ref()
                .and_then(|c| c.procs_file().to_str().ok()),
        });
        let bytes = berth_protocol::stream::frame(header.to_string().as_bytes(), &[]);
        let mut control = self.control.lock().await;
        let exchange = async {
            control
                .send(
                    &bytes,
                    &[request.wire, out_w.as_raw_fd(), err_w.as_raw_fd()],
                )
                .await
                .map_err(|e| e.to_string())?;
            control.read().await
        };
        let said = tokio::time::timeout(timeout, exchange).await;
        drop(control);
        let said = match said {
            Ok(Ok(Said::Forked {
                id: got,
                pid,
                spare_kept,
            })) if got == id => {
                self.forks.fetch_add(1, Ordering::Relaxed);
                if spare_kept {
                    // Its spare waits on where it is (its cgroup is still
                    // here, or taken by a load whose frame comes next).
                    drop_later(next_spare);
                } else {
                    drop_later(std::mem::replace(
                        &mut *lock(&self.spare_cgroup),
                        next_spare,
                    ));
                }
                return Ok(Forked {
                    pid,
                    output: (File::from(out_r), File::from(err_r)),
                });
            }
            said => {
                drop_later(next_spare);
                said
            }
        };
        let said = match said {
            Ok(Ok(said)) => said,
            Ok(Err(why)) => return Err(unanswered(format!("its control socket broke: {why}"))),
            Err(_) => {
                return Err(unanswered(format!(
                    "it did not answer a fork within {timeout:?}"
                )));
            }
        };
        match said {
            Said::ForkFailed { id: got, reason } if got.is_none_or(|g| g == id) => {
                Err(clean(format!("the fork failed: {reason}")))
            }
            Said::Refused { module, reason } => {
                Err(clean(format!("it refused to fork: `{module}`: {reason}")))
            }
            other => Err(unanswered(format!("it answered a fork with {other:?}"))),
        }
    }

    /// The cgroup its spare worker sits in, made the one of a worker of
    /// `model` (named for it, capped at `limit`), for the fork about to be
    /// asked; `None` if it has none or it cannot be capped (the worker then
    /// gets a cgroup of its own, and moves there).
    pub(crate) fn spare_cgroup_for(&self, model: &str, limit: Option<u64>) -> Option<Cgroup> {
        let mut spare = lock(&self.spare_cgroup);
        let made = spare.as_mut()?.make_for(model, limit);
        match made {
            Ok(()) => spare.take(),
            Err(why) => {
                tracing::debug!(model, kind = self.kind, "the spare's cgroup is left: {why}");
                None
            }
        }
    }

    pub(crate) fn kind(&self) -> &str {
        &self.kind
    }

    pub(crate) fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub(crate) fn process(&self) -> &Arc<ProcessWatch> {
        &self.process
    }

    pub(crate) fn modules(&self) -> &[String] {
        &self.modules
    }

    /// How long its imports took.
    pub(crate) fn import_time(&self) -> Duration {
        self.import
    }

    pub(crate) fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Workers forked so far.
    pub(crate) fn forks(&self) -> u64 {
        self.forks.load(Ordering::Relaxed)
    }

    /// Its spare worker's pid, while one waits for a load.
    pub(crate) fn spare_pid(&self) -> Option<u32> {
        lock(&self.spare_cgroup)
            .as_ref()?
            .members()
            .first()
            .copied()
    }

    /// Its memory with its spare worker's, read at most once a second.
    pub(crate) fn memory(&self) -> ProcessMemory {
        let mut last = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        match *last {
            Some((at, reading)) if at.elapsed() < Duration::from_secs(1) => reading,
            _ => {
                let spare: Vec<u32> = self.spare_pid().into_iter().collect();
                let reading = tree_memory(self.pid(), &spare, process_memory).unwrap_or_default();
                *last = Some((Instant::now(), reading));
                reading
            }
        }
    }

    /// False once it has exited, reaped or not: a preloader killed a
    /// moment ago is a zombie until its reaper task runs, and a fork asked
    /// of it then would find its socket broken and start the worker cold.
    pub(crate) fn is_alive(&self) -> bool {
        self.process.try_exit().is_none() && crate::child::orphans::is_live(self.pid())
    }

    /// Stops it (it holds nothing to save: its whole group is killed, its
    /// spare with it) and waits until it is reaped and its spare's cgroup
    /// removed.
    pub(crate) async fn stop(&self) {
        self.process.begin_stop();
        self.process.signal_group(nix::sys::signal::Signal::SIGKILL);
        let _ = self.process.exited_within(Duration::from_secs(5)).await;
        // Its spare went with its group; its cgroup goes now, not later:
        // an in-place upgrade stops the preloaders just before its exec.
        let spare = lock(&self.spare_cgroup).take();
        if let Some(spare) = spare {
            spare.kill_all();
            let _ = tokio::task::spawn_blocking(move || drop(spare)).await;
        }
    }
}

impl Control {
    async fn send(&mut self, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        let mut sent = 0;
        let mut fds = fds;
        while sent < bytes.len() {
            let mut guard = self.socket.writable().await?;
            match guard.try_io(|s| wire_io::send(s.as_raw_fd(), &bytes[sent..], fds)) {
                Ok(Ok(n)) => {
                    sent += n;
                    fds = &[];
                }
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }

    /// The next frame the preloader sends.
    async fn read(&mut self) -> Result<Said, String> {
        loop {
            if self.buf.len() >= 8 {
                let length =
                    u32::from_le_bytes(self.buf[0..4].try_into().expect("4 bytes")) as usize;
                let head = u32::from_le_bytes(self.buf[4..8].try_into().expect("4 bytes")) as usize;
                if length > MAX_FRAME || head + 4 > length {
                    return Err(format!("a control frame of {length} bytes is malformed"));
                }
                if self.buf.len() >= 4 + length {
                    let header = self.buf[8..8 + head].to_vec();
                    self.buf.drain(..4 + length);
                    return serde_json::from_slice(&header).map_err(|e| {
                        format!(
                            "a control frame is not one it may send ({e}): {}",
                            berth_protocol::stream::excerpt(&header)
                        )
                    });
                }
            }
            let mut chunk = [0u8; 4096];
            let mut guard = self.socket.readable().await.map_err(|e| e.to_string())?;
            match guard.try_io(|s| {
                // SAFETY: reads into `chunk`, which has the room it says.
                let n =
                    unsafe { libc::read(s.as_raw_fd(), chunk.as_mut_ptr().cast(), chunk.len()) };
                if n < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            }) {
                Ok(Ok(0)) => return Err("end of file".into()),
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
                Ok(Err(e)) => return Err(e.to_string()),
                Err(_would_block) => continue,
            }
        }
    }
}

/// A pipe, both ends close-on-exec: (read, write).
fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded: both are open descriptors nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A new cgroup for a spare of `kind`'s preloader (`preload-<kind>-spare-…`),
/// if this machine lets berth make cgroups.
fn spare_cgroup(kind: &str) -> Option<Cgroup> {
    Cgroup::create(&format!("preload-{kind}-spare"), None).ok()
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Drops a cgroup off the async threads: its removal waits (up to half a
/// second) for the processes that were in it to be gone.
fn drop_later(cgroup: Option<Cgroup>) {
    if let Some(cgroup) = cgroup {
        tokio::task::spawn_blocking(move || drop(cgroup));
    }
}
