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
//! spawn happens on one long-lived spawner thread.

use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc as std_mpsc;

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

type SpawnJob = (Command, oneshot::Sender<io::Result<Child>>);

fn spawner() -> &'static std_mpsc::Sender<SpawnJob> {
    static SPAWNER: OnceLock<std_mpsc::Sender<SpawnJob>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = std_mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("berth-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("cannot start the berth spawner thread");
        tx
    })
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
    env.push((crate::orphans::ENV_WORKER_MARK.into(), mark.into()));
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
    // prctl, getppid, open, write, close); it allocates nothing (the path
    // was allocated before the fork).
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
        .send((command, reply))
        .map_err(|_| spawn_error(io::Error::other("the spawner thread is gone")))?;
    rx.await
        .map_err(|_| spawn_error(io::Error::other("the spawner thread is gone")))?
        .map_err(spawn_error)
}
