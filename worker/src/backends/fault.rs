//! `fault`: fails on command. Every failure path of the supervisor is tested
//! against this backend in a real process, never against a mock.
//!
//! Option `mode`:
//! - `ok`: behaves like `echo`;
//! - `crash-on-load`, `crash-on-request`: the process dies of SIGSEGV;
//! - `abort-on-request`: the process aborts (SIGABRT);
//! - `exit-on-request`: the process exits with `exit_code` (default 3);
//! - `hang-on-load`, `hang-on-request`: blocks forever without progress;
//! - `ignore-shutdown`: serves like `echo`, but ignores SIGTERM and never
//!   finishes the `Shutdown` command, so only SIGKILL ends it.
//!
//! Other options:
//! - `load_delay_ms`: sleeps during load (a slow but progressing load);
//! - `crash_on`: a request whose JSON contains this text crashes the worker
//!   (a poison input), others are echoed; `crash_delay_ms` first works on it
//!   that long (so requests sent after it are surely in flight when it dies);
//! - `crash_on_load_if_exists`: crashes at load while this file exists (a
//!   model broken until someone fixes it);
//! - `fail_load_with`: the load fails with this message, after
//!   `load_delay_ms` (a framework's exception at load, in its own words:
//!   JAX's `RESOURCE_EXHAUSTED: Out of memory ...`);
//! - `spawn_grandchild`: at load, starts a process that ignores SIGTERM (a
//!   worker's helper that would outlive it);
//! - `escape_mib`: at load, starts a process that leaves the worker's
//!   process group and session (`setsid`, then a second fork) and holds
//!   this many MiB: a daemonising helper that a group kill cannot reach;
//!   `escape_clear_mark` (with it) also drops the worker's mark from its
//!   environment, so only a cgroup finds it;
//! - `stderr_bytes`: each request first writes this many bytes to stderr as
//!   one line (a worker flooding its output);
//! - `response_bytes`: each request is answered with a JSON object padded
//!   to this many bytes (a worker answering too much).

use std::time::Duration;

use berth_protocol::{Body, ErrorKind, LoadSpec, WireError};

use crate::{Backend, LoadContext, RequestContext};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Ok,
    CrashOnLoad,
    HangOnLoad,
    CrashOnRequest,
    HangOnRequest,
    AbortOnRequest,
    ExitOnRequest,
    IgnoreShutdown,
}

const MODES: &[(&str, Mode)] = &[
    ("ok", Mode::Ok),
    ("crash-on-load", Mode::CrashOnLoad),
    ("hang-on-load", Mode::HangOnLoad),
    ("crash-on-request", Mode::CrashOnRequest),
    ("hang-on-request", Mode::HangOnRequest),
    ("abort-on-request", Mode::AbortOnRequest),
    ("exit-on-request", Mode::ExitOnRequest),
    ("ignore-shutdown", Mode::IgnoreShutdown),
];

#[derive(Debug)]
struct Fault {
    /// The process started outside the worker's group (`escape_mib`).
    escaped: Option<u32>,
    mode: Mode,
    exit_code: i32,
    crash_on: Option<String>,
    crash_delay_ms: u64,
    grandchild: Option<std::process::Child>,
    stderr_bytes: usize,
    response_bytes: usize,
}

/// A deliberate crash writes no core dump: with systemd-coredump or apport
/// a dump of the process takes seconds, and the crash would no longer show
/// how fast berth notices a death.
fn no_core_dump() {
    // SAFETY: PR_SET_DUMPABLE takes an integer flag; no memory is involved.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong);
    }
}

fn crash() -> ! {
    eprintln!("fault: raising SIGSEGV as asked");
    no_core_dump();
    // Rust's runtime handles SIGSEGV to report stack overflows and returns
    // from a raised one; restore the default so it kills, as a real fault does.
    // SAFETY: resetting a disposition and raising a signal have no
    // memory-safety preconditions.
    unsafe {
        libc::signal(libc::SIGSEGV, libc::SIG_DFL);
        libc::raise(libc::SIGSEGV);
    }
    unreachable!("SIGSEGV is fatal")
}

fn hang() -> ! {
    eprintln!("fault: hanging as asked");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// The options this backend takes.
pub const OPTIONS: &[&str] = &[
    "mode",
    "exit_code",
    "load_delay_ms",
    "crash_on",
    "crash_delay_ms",
    "crash_on_load_if_exists",
    "fail_load_with",
    "spawn_grandchild",
    "escape_mib",
    "escape_clear_mark",
    "stderr_bytes",
    "response_bytes",
];

pub fn load(spec: &LoadSpec, ctx: &LoadContext) -> Result<Box<dyn Backend>, WireError> {
    let opts = ctx.options(spec);
    opts.only(OPTIONS)?;
    if let Some(marker) = opts.str("crash_on_load_if_exists")
        && std::path::Path::new(marker).exists()
    {
        eprintln!("fault: {marker} exists; crashing on load as asked");
        crash();
    }
    let name = opts.str("mode").unwrap_or("ok");
    let mode = MODES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, m)| *m)
        .ok_or_else(|| {
            WireError::new(
                ErrorKind::LoadFailed,
                format!(
                    "model `{}`: fault mode `{name}` does not exist (modes: {})",
                    spec.name,
                    MODES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
                ),
            )
        })?;
    let delay_ms: u64 = opts.get_or("load_delay_ms", 0)?;
    for _ in 0..delay_ms / 10 {
        std::thread::sleep(Duration::from_millis(10));
        ctx.progress().advance();
    }
    if let Some(message) = opts.str("fail_load_with") {
        return Err(WireError::new(ErrorKind::LoadFailed, message.to_string()));
    }
    match mode {
        Mode::CrashOnLoad => crash(),
        Mode::HangOnLoad => hang(),
        Mode::IgnoreShutdown => {
            // SAFETY: setting a signal's disposition to SIG_IGN is always sound.
            unsafe {
                libc::signal(libc::SIGTERM, libc::SIG_IGN);
            }
        }
        _ => {}
    }
    let grandchild = if opts.get_or("spawn_grandchild", false)? {
        let child = std::process::Command::new("sh")
            .args(["-c", "trap '' TERM; while :; do sleep 1; done"])
            .spawn()
            .map_err(|e| {
                WireError::new(
                    ErrorKind::LoadFailed,
                    format!("model `{}`: cannot start the grandchild: {e}", spec.name),
                )
            })?;
        eprintln!(
            "fault: started grandchild pid {} that ignores SIGTERM",
            child.id()
        );
        Some(child)
    } else {
        None
    };
    let escape_mib: usize = opts.get_or("escape_mib", 0)?;
    let escaped = if escape_mib > 0 {
        let pid = escape(escape_mib, opts.get_or("escape_clear_mark", false)?).map_err(|e| {
            WireError::new(
                ErrorKind::LoadFailed,
                format!(
                    "model `{}`: cannot start the escaping process: {e}",
                    spec.name
                ),
            )
        })?;
        eprintln!("fault: started pid {pid} outside the worker's group holding {escape_mib} MiB");
        Some(pid)
    } else {
        None
    };
    Ok(Box::new(Fault {
        escaped,
        mode,
        exit_code: opts.get_or("exit_code", 3)?,
        crash_on: opts.str("crash_on").map(str::to_owned),
        crash_delay_ms: opts.get_or("crash_delay_ms", 0)?,
        grandchild,
        stderr_bytes: opts.get_or("stderr_bytes", 0)?,
        response_bytes: opts.get_or("response_bytes", 0)?,
    }))
}

impl Backend for Fault {
    fn handle(&mut self, request: Body, ctx: &RequestContext) -> Result<Body, WireError> {
        if self.stderr_bytes > 0 {
            use std::io::Write;
            let block = vec![b'x'; 1 << 20];
            let mut left = self.stderr_bytes;
            let mut stderr = std::io::stderr().lock();
            while left > 0 {
                let n = left.min(block.len());
                let _ = stderr.write_all(&block[..n]);
                left -= n;
            }
            let _ = stderr.write_all(b"\n");
        }
        if self.response_bytes > 0 {
            ctx.progress().advance();
            let pad = "x".repeat(self.response_bytes.saturating_sub(12));
            return Ok(Body::json(format!("{{\"pad\": \"{pad}\"}}")));
        }
        if self
            .crash_on
            .as_deref()
            .is_some_and(|poison| request.json.contains(poison))
        {
            std::thread::sleep(std::time::Duration::from_millis(self.crash_delay_ms));
            crash();
        }
        match self.mode {
            Mode::CrashOnRequest => crash(),
            Mode::HangOnRequest => hang(),
            Mode::AbortOnRequest => {
                eprintln!("fault: aborting as asked");
                no_core_dump();
                std::process::abort()
            }
            Mode::ExitOnRequest => {
                eprintln!("fault: exiting with status {} as asked", self.exit_code);
                std::process::exit(self.exit_code)
            }
            _ => {
                ctx.progress().advance();
                Ok(request)
            }
        }
    }

    fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "grandchild_pid": self.grandchild.as_ref().map(std::process::Child::id),
            "escaped_pid": self.escaped,
        })
    }

    fn shutdown(&mut self) {
        if self.mode == Mode::IgnoreShutdown {
            eprintln!("fault: ignoring the shutdown command as asked");
            hang();
        }
    }
}

/// Starts a process outside this one's group and session (fork, `setsid`,
/// fork again, as a daemon does) that holds `mib` MiB of touched memory
/// until it is killed; returns its pid. With `clear_mark` it also wipes
/// its environment block (what `/proc/PID/environ` shows), the worker's
/// mark with it.
fn escape(mib: usize, clear_mark: bool) -> std::io::Result<u32> {
    // Found before the fork: the children may not allocate.
    let env_block = if clear_mark {
        Some(env_block().ok_or_else(|| std::io::Error::other("cannot read /proc/self/stat"))?)
    } else {
        None
    };
    let mut pipe = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: between fork and exit the children call only async-signal-safe
    // functions (setsid, fork, getpid, write, mmap, pause, _exit) and write
    // to memory of their own: the environment block (their stack's, where
    // the kernel put it) and what they mapped.
    unsafe {
        let first = libc::fork();
        if first < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if first == 0 {
            libc::setsid();
            if libc::fork() != 0 {
                libc::_exit(0);
            }
            if let Some((start, end)) = env_block {
                std::ptr::write_bytes(start as *mut u8, 0, end - start);
            }
            let len = mib << 20;
            let memory = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if memory != libc::MAP_FAILED {
                let bytes = memory.cast::<u8>();
                for offset in (0..len).step_by(4096) {
                    std::ptr::write_volatile(bytes.add(offset), 1);
                }
            }
            // Reported once it holds what it was asked to.
            let me = libc::getpid();
            libc::write(
                pipe[1],
                (&me as *const libc::pid_t).cast(),
                size_of::<libc::pid_t>(),
            );
            loop {
                libc::pause();
            }
        }
        libc::close(pipe[1]);
        let mut status = 0;
        libc::waitpid(first, &mut status, 0);
        let mut pid: libc::pid_t = 0;
        let got = libc::read(
            pipe[0],
            (&mut pid as *mut libc::pid_t).cast(),
            size_of::<libc::pid_t>(),
        );
        libc::close(pipe[0]);
        if got != size_of::<libc::pid_t>() as isize {
            return Err(std::io::Error::other(
                "the escaping process did not report its pid",
            ));
        }
        Ok(pid as u32)
    }
}

/// Where this process's environment block lies (`env_start`, `env_end`:
/// fields 50 and 51 of `/proc/self/stat`).
fn env_block() -> Option<(usize, usize)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which may hold spaces: field 3 on.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let start = fields.get(50 - 3)?.parse().ok()?;
    let end = fields.get(51 - 3)?.parse().ok()?;
    (end > start).then_some((start, end))
}
