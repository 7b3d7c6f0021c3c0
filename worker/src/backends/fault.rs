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
//!   (a poison input), others are echoed;
//! - `crash_on_load_if_exists`: crashes at load while this file exists (a
//!   model broken until someone fixes it);
//! - `spawn_grandchild`: at load, starts a process that ignores SIGTERM (a
//!   worker's helper that would outlive it);
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
    mode: Mode,
    exit_code: i32,
    crash_on: Option<String>,
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

pub fn load(spec: &LoadSpec, ctx: &LoadContext) -> Result<Box<dyn Backend>, WireError> {
    let opts = ctx.options(spec);
    opts.only(&[
        "mode",
        "exit_code",
        "load_delay_ms",
        "crash_on",
        "crash_on_load_if_exists",
        "spawn_grandchild",
        "stderr_bytes",
        "response_bytes",
    ])?;
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
    Ok(Box::new(Fault {
        mode,
        exit_code: opts.get_or("exit_code", 3)?,
        crash_on: opts.str("crash_on").map(str::to_owned),
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
        serde_json::json!({ "grandchild_pid": self.grandchild.as_ref().map(std::process::Child::id) })
    }

    fn shutdown(&mut self) {
        if self.mode == Mode::IgnoreShutdown {
            eprintln!("fault: ignoring the shutdown command as asked");
            hang();
        }
    }
}
