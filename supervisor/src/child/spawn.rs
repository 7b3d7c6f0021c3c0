//! Starting a worker process.
//!
//! - cleared environment plus what the worker needs;
//! - its own process group, so a stop reaches everything it forked;
//! - no descriptor but stdin, stdout, stderr and its wire's: whatever the
//!   supervisor itself inherited stays behind;
//! - `PR_SET_NO_NEW_PRIVS`, so nothing it execs can gain privileges;
//! - `PR_SET_PDEATHSIG = SIGKILL` armed between fork and exec, and the parent
//!   re-checked right after, so a supervisor killed at any moment (even by
//!   SIGKILL) takes its workers with it.
//!
//! The parent-death signal fires when the *thread* that forked the child
//! exits, not the process. Tokio's blocking threads come and go, so every
//! spawn happens on one long-lived spawner thread: the process's main
//! thread where the program installed it ([`main_thread_spawns`], as
//! `berth` does), which also makes an in-place upgrade's `execve`
//! (`crate::daemon::upgrade`) without ending the forking thread; else a thread of
//! its own, started at the first spawn (a library host).

use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex, OnceLock};

use std::os::fd::RawFd;

use berth_protocol::stream::{ENV_FD, WORKER_FD};
use berth_protocol::{ENV_BOOTSTRAP, ENV_MODEL_NAME, ENV_PARENT_PID};
use tokio::sync::oneshot;

use crate::error::{Error, Result};

/// Environment variables passed through to workers when the supervisor has them.
/// `LD_LIBRARY_PATH` is where the NVIDIA driver's and the CUDA toolkit's
/// libraries are found when they are outside the loader's default path
/// (`/usr/local/cuda/lib64`, a conda env): a CUDA build of the worker links
/// them and would not start without it.
pub const PASSTHROUGH_ENV: &[&str] = &[
    "LD_LIBRARY_PATH",
    "RUST_BACKTRACE",
    "RUST_LOG",
    "TMPDIR",
    "LANG",
    "LC_ALL",
    "BERTH_MODELS",
    "HOME",
    // Where a stream-wire worker's `command` (`python3`) was found, and
    // what its own helpers (`sh`, compilers) need.
    "PATH",
];

/// The [`PASSTHROUGH_ENV`] variables the supervisor has.
pub(crate) fn passthrough_env() -> impl Iterator<Item = (&'static str, String)> {
    PASSTHROUGH_ENV
        .iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| (*k, v)))
}

/// What the spawner thread does: start a worker, or replace the whole
/// process image (an in-place upgrade, `crate::daemon::upgrade`).
enum Job {
    Spawn(Command, oneshot::Sender<io::Result<Child>>),
    Exec(Exec, oneshot::Sender<io::Error>),
    /// The program run beside the main thread's spawner has returned.
    Done,
}

/// An `execve` of this process, from the thread that forked every worker:
/// the parent-death signal fires when the forking *thread* ends, and
/// `execve` ends every thread but its caller, so any other thread's exec
/// would kill every worker.
pub(crate) struct Exec {
    /// A descriptor of the program (`fexecve`): the file opened and
    /// checked, whatever has replaced or removed its path since.
    pub program: RawFd,
    pub argv: Vec<std::ffi::CString>,
    pub env: Vec<std::ffi::CString>,
    /// Descriptors the new image inherits: close-on-exec is cleared on
    /// them right before the exec (never earlier, so no worker spawned
    /// meanwhile takes them), and set again if the exec fails.
    pub keep: Vec<RawFd>,
}

fn spawner() -> &'static std_mpsc::Sender<Job> {
    if let Some(main) = MAIN_SPAWNER.get() {
        return main;
    }
    static SPAWNER: OnceLock<std_mpsc::Sender<Job>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = std_mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("berth-spawner".into())
            .spawn(move || {
                for job in rx {
                    if !run_job(job) {
                        break;
                    }
                }
            })
            .expect("cannot start the berth spawner thread");
        tx
    })
}

/// The process's main thread as the spawner, where a program installed it
/// ([`main_thread_spawns`]).
static MAIN_SPAWNER: OnceLock<std_mpsc::Sender<Job>> = OnceLock::new();

/// Runs one job; false once the loop should end.
fn run_job(job: Job) -> bool {
    match job {
        Job::Spawn(mut command, reply) => {
            let _ = reply.send(command.spawn());
        }
        Job::Exec(exec, reply) => {
            let _ = reply.send(exec_now(&exec));
        }
        Job::Done => return false,
    }
    true
}

/// The signals that would end berth were they delivered across the exec
/// (`execve` resets handled signals to their default action): blocked
/// from just before the exec, so the new program finds them pending and
/// handles them once its handlers are in (a mask survives `execve`).
const HELD_ACROSS_EXEC: [libc::c_int; 2] = [libc::SIGHUP, libc::SIGUSR2];

/// Blocks (or unblocks) [`HELD_ACROSS_EXEC`] in the calling thread.
pub(crate) fn hold_reload_signals(hold: bool) {
    // SAFETY: a sigset built with sigemptyset/sigaddset, applied to this
    // thread's mask only.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in HELD_ACROSS_EXEC {
            libc::sigaddset(&mut set, signal);
        }
        let how = if hold {
            libc::SIG_BLOCK
        } else {
            libc::SIG_UNBLOCK
        };
        libc::pthread_sigmask(how, &set, std::ptr::null_mut());
    }
}

/// Replaces the process image; returns only on failure, with every kept
/// descriptor close-on-exec again and the signals it held unblocked.
fn exec_now(exec: &Exec) -> io::Error {
    let set_cloexec = |on: bool| {
        for &fd in &exec.keep {
            // SAFETY: fcntl on descriptors the caller keeps open.
            unsafe { libc::fcntl(fd, libc::F_SETFD, if on { libc::FD_CLOEXEC } else { 0 }) };
        }
    };
    let mut argv: Vec<*const libc::c_char> = exec.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut env: Vec<*const libc::c_char> = exec.env.iter().map(|e| e.as_ptr()).collect();
    env.push(std::ptr::null());
    set_cloexec(false);
    hold_reload_signals(true);
    // SAFETY: argv and env are NUL-terminated arrays of C strings that
    // outlive the call; on success nothing after it runs.
    unsafe { libc::fexecve(exec.program, argv.as_ptr(), env.as_ptr()) };
    let error = io::Error::last_os_error();
    hold_reload_signals(false);
    set_cloexec(true);
    error
}

/// Runs `program` on a thread of its own while this thread, the process's
/// main one, spawns every worker and performs any in-place upgrade's exec;
/// returns what `program` returned. Workers spawned (or adopted as
/// orphans) then all have the main thread as their parent, which lives as
/// long as the process and survives its `execve`: an upgraded berth keeps
/// them, and can upgrade again. Call it first thing in `main`.
pub fn main_thread_spawns<T: Send + 'static>(program: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std_mpsc::channel::<Job>();
    if MAIN_SPAWNER.set(tx.clone()).is_err() {
        return program();
    }
    let result = Arc::new(Mutex::new(None));
    let slot = Arc::clone(&result);
    let runner = std::thread::Builder::new()
        .name("berth-main".into())
        // A main thread's stack, as the program would have had.
        .stack_size(8 << 20)
        .spawn(move || {
            // Sent even when `program` panics, so this thread ends too.
            struct Finished(std_mpsc::Sender<Job>);
            impl Drop for Finished {
                fn drop(&mut self) {
                    let _ = self.0.send(Job::Done);
                }
            }
            let _finished = Finished(tx);
            let value = program();
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(value);
        })
        .expect("cannot start berth's main thread");
    for job in rx {
        if !run_job(job) {
            break;
        }
    }
    if let Err(panic) = runner.join() {
        std::panic::resume_unwind(panic);
    }
    let value = result.lock().unwrap_or_else(|e| e.into_inner()).take();
    value.expect("the program returned")
}

/// Replaces this process with `exec` from the thread that spawns workers;
/// returns only if the exec failed, with why.
pub(crate) async fn exec(exec: Exec) -> io::Error {
    let (reply, rx) = oneshot::channel();
    if spawner().send(Job::Exec(exec, reply)).is_err() {
        return io::Error::other("the spawner thread is gone");
    }
    rx.await
        .unwrap_or_else(|_| io::Error::other("the spawner thread is gone"))
}

/// [`exec`] from a thread outside the async runtime (a watchdog's).
pub(crate) fn exec_blocking(exec: Exec) -> io::Error {
    let (reply, rx) = oneshot::channel();
    if spawner().send(Job::Exec(exec, reply)).is_err() {
        return io::Error::other("the spawner thread is gone");
    }
    rx.blocking_recv()
        .unwrap_or_else(|_| io::Error::other("the spawner thread is gone"))
}

/// Finds the worker binary: next to the running executable, or one folder
/// up when the executable is a test or bench harness in cargo's `deps/`.
pub fn find_worker_binary(name: &str) -> Result<PathBuf> {
    let mut searched = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        let mut dir = exe.parent().map(Path::to_path_buf);
        for _ in 0..2 {
            let Some(d) = dir else { break };
            let candidate = d.join(name);
            if candidate.is_file() {
                return Ok(candidate);
            }
            searched.push(d.clone());
            dir = if d.file_name().is_some_and(|n| n == "deps") {
                d.parent().map(Path::to_path_buf)
            } else {
                None
            };
        }
    }
    Err(Error::WorkerBinaryNotFound { searched })
}

/// What [`spawn`] needs.
#[derive(Debug)]
pub struct SpawnOptions<'a> {
    pub model: &'a str,
    pub binary: &'a Path,
    /// Arguments selecting the program's worker role (`["worker"]`).
    pub args: &'a [String],
    /// How the worker reaches the supervisor.
    pub connect: Connect<'a>,
    /// Its working directory (default: the supervisor's).
    pub cwd: Option<&'a Path>,
    /// The worker's mark (see `orphans::ENV_WORKER_MARK`).
    pub mark: &'a str,
    pub extra_env: &'a [(String, String)],
    /// A cgroup's `cgroup.procs` the child writes itself into before exec.
    pub cgroup_procs: Option<&'a std::ffi::CString>,
}

/// How a new worker reaches the supervisor.
#[derive(Debug, Clone, Copy)]
pub enum Connect<'a> {
    /// It connects to this `ipc-channel` one-shot server.
    Ipc(&'a str),
    /// It inherits this socket at [`WORKER_FD`] (the stream wire). The
    /// descriptor is close-on-exec in the supervisor; only this child gets it.
    Stream(RawFd),
    /// No wire: an HTTP server, reached on the address in its command.
    None,
}

/// Marks every descriptor from `first` up close-on-exec, so that an exec
/// takes none of them along; for the child side of a fork, between fork
/// and exec. `close_range(CLOSE_RANGE_CLOEXEC)` (Linux 5.11) does it in
/// one call; before that, every descriptor below the open-file limit is
/// marked one by one (bounded, since the limit may have been raised).
///
/// # Safety
/// Async-signal-safe: only `syscall`, `getrlimit` and `fcntl`.
pub(crate) unsafe fn cloexec_from(first: RawFd) -> io::Result<()> {
    // SAFETY: close_range takes integers and touches no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    let top = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        limit.rlim_cur.min(1 << 20) as RawFd
    } else {
        1024
    };
    for fd in first..top {
        // SAFETY: F_SETFD on a descriptor that may not be open: EBADF, ignored.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    Ok(())
}

/// The whole environment a worker starts with, and nothing else: the
/// [`PASSTHROUGH_ENV`] variables the supervisor has, `extra_env`, its mark,
/// the supervisor's pid, its model's name and how to reach the supervisor.
/// A worker forked from a preloaded interpreter is given the same.
pub(crate) fn worker_env(
    model: &str,
    mark: &str,
    extra_env: &[(String, String)],
    connect: Connect<'_>,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = passthrough_env()
        .map(|(k, v)| (k.to_string(), v))
        .chain(extra_env.iter().cloned())
        .collect();
    env.push((crate::child::orphans::ENV_WORKER_MARK.into(), mark.into()));
    env.push((ENV_PARENT_PID.into(), std::process::id().to_string()));
    env.push((ENV_MODEL_NAME.into(), model.into()));
    match connect {
        Connect::Ipc(server_name) => env.push((ENV_BOOTSTRAP.into(), server_name.into())),
        Connect::Stream(_) => env.push((ENV_FD.into(), WORKER_FD.to_string())),
        Connect::None => {}
    }
    env
}

/// Starts a worker; it connects (or finds its socket) on its own.
pub async fn spawn(opts: SpawnOptions<'_>) -> Result<Child> {
    let supervisor_pid = std::process::id();
    let mut command = Command::new(opts.binary);
    command
        .args(opts.args)
        .env_clear()
        .envs(worker_env(
            opts.model,
            opts.mark,
            opts.extra_env,
            opts.connect,
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let stream_fd = match opts.connect {
        Connect::Stream(fd) => Some(fd),
        Connect::Ipc(_) | Connect::None => None,
    };
    if let Some(dir) = opts.cwd {
        command.current_dir(dir);
    }
    let cgroup_procs = opts.cgroup_procs.cloned();
    // SAFETY: the closure runs between fork and exec and calls only
    // async-signal-safe functions (dup2, fcntl, close_range, getrlimit,
    // sigaction, prctl, getppid, open, write, close); it allocates nothing
    // (the path was allocated before the fork).
    unsafe {
        command.pre_exec(move || {
            if let Some(fd) = stream_fd {
                // dup2 clears close-on-exec on the copy; when the socket is
                // already at WORKER_FD it is a no-op, so clear it by hand.
                if fd == WORKER_FD {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                } else if libc::dup2(fd, WORKER_FD) != WORKER_FD {
                    return Err(io::Error::last_os_error());
                }
            }
            // Nothing berth itself inherited (a shell's stray descriptors,
            // a service manager's) reaches the worker: it gets stdin,
            // stdout, stderr and its wire's descriptor, nothing else.
            let first_free = if stream_fd.is_some() {
                WORKER_FD + 1
            } else {
                3
            };
            cloexec_from(first_free)?;
            if let Some(procs) = &cgroup_procs {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
                if written != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            // `berth serve` ignores SIGHUP and SIGUSR2 until its handlers
            // are in (`cli::main`); a worker starts with their defaults.
            for signal in [libc::SIGHUP, libc::SIGUSR2] {
                let mut default: libc::sigaction = std::mem::zeroed();
                default.sa_sigaction = libc::SIG_DFL;
                if libc::sigaction(signal, &default, std::ptr::null_mut()) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            // No exec from here on can gain privileges (setuid binaries,
            // file capabilities): a worker never needs them.
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() as u32 != supervisor_pid {
                return Err(io::Error::other("the supervisor exited during spawn"));
            }
            Ok(())
        });
    }
    let (reply, rx) = oneshot::channel();
    let spawn_error = |source| Error::Spawn {
        model: opts.model.to_string(),
        binary: opts.binary.to_path_buf(),
        source,
    };
    spawner()
        .send(Job::Spawn(command, reply))
        .map_err(|_| spawn_error(io::Error::other("the spawner thread is gone")))?;
    rx.await
        .map_err(|_| spawn_error(io::Error::other("the spawner thread is gone")))?
        .map_err(spawn_error)
}
