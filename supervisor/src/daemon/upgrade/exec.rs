//! The exec itself: the new binary checked ([`check_binary`]), the state
//! written to a memfd and the process replaced ([`exec`]), the handed-over
//! state read back in the new program ([`handed_over`]), and the way back
//! to the previous binary when the new one cannot serve ([`fall_back`]).
//! The states and the failures of the whole upgrade are told in
//! `docs/internals/upgrade.md`.

use std::ffi::{CString, OsString};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::child::spawn::Exec;

use super::state::{self, READS, VERSION};
use crate::child::handover::ipc;
use crate::child::handover::take;

/// The environment variable naming the previous binary's descriptor, set
/// with [`state::ENV_STATE_FD`] for the new program.
const ENV_PREVIOUS_FD: &str = "BERTH_UPGRADE_PREVIOUS_FD";

/// The flag that makes `berth serve` check it could take over, and exit.
pub const CHECK_FLAG: &str = "--upgrade-check";

/// What a binary answers to [`CHECK_FLAG`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckAnswer {
    pub version: String,
    pub build: String,
    /// The state versions it adopts.
    pub reads: Vec<u32>,
    pub ipc_channel: String,
}

impl CheckAnswer {
    /// This binary's answer.
    pub fn mine() -> CheckAnswer {
        CheckAnswer {
            version: env!("CARGO_PKG_VERSION").to_string(),
            build: crate::base::build_mark(),
            reads: READS.to_vec(),
            ipc_channel: ipc::IPC_CHANNEL_VERSION.to_string(),
        }
    }
}

/// How long the check of a new binary may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(30);

/// The binary an upgrade runs by default: the path this one was started
/// from, as it is on disk now (a package manager replaced the file).
pub fn default_binary() -> Result<PathBuf, String> {
    let me = std::fs::read_link("/proc/self/exe")
        .map_err(|e| format!("cannot tell which binary this is: {e}"))?;
    let shown = me.to_string_lossy();
    Ok(match shown.strip_suffix(" (deleted)") {
        Some(path) => PathBuf::from(path),
        None => me,
    })
}

/// The new binary, opened once: the file checked is the file exec'd,
/// whatever replaces its path in between (the check runs it through this
/// process's descriptor, `/proc/PID/fd/N`, and the exec is an `fexecve`
/// of the same descriptor).
#[derive(Debug)]
pub(crate) struct Binary {
    pub path: PathBuf,
    fd: OwnedFd,
}

impl Binary {
    /// Opens `path`: a regular file this user may execute.
    pub(crate) fn open(path: &Path) -> Result<Binary, String> {
        let shown = path.display();
        let file = std::fs::File::open(path).map_err(|e| format!("cannot open `{shown}`: {e}"))?;
        let meta = file
            .metadata()
            .map_err(|e| format!("cannot read `{shown}`: {e}"))?;
        let c = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("`{shown}` has a NUL byte"))?;
        // SAFETY: access with a NUL-terminated path; no memory involved.
        let executable = unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0;
        if !meta.is_file() || !executable {
            return Err(format!("`{shown}` is not a file this user may execute"));
        }
        Ok(Binary {
            path: path.to_path_buf(),
            fd: OwnedFd::from(file),
        })
    }

    /// The path that runs exactly the file opened, from this process.
    fn through_descriptor(&self) -> PathBuf {
        PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            self.fd.as_raw_fd()
        ))
    }
}

/// The niceness the check of a new binary runs at (0 is berth's own).
const CHECK_NICENESS: libc::c_int = 10;

/// Runs `binary` as this process was run, with [`CHECK_FLAG`]: it must
/// start, read the config, and adopt this build's state.
pub(crate) async fn check_binary(binary: &Binary) -> Result<CheckAnswer, String> {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let mut command = tokio::process::Command::new(binary.through_descriptor());
    command
        .args(&args)
        .arg(CHECK_FLAG)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let shown = binary.path.display();
    let child = command
        .spawn()
        .map_err(|e| format!("cannot run `{shown}`: {e}"))?;
    // The check is background work while this berth serves: at a lower
    // priority, it takes the CPU that requests leave (measured on two
    // cores under four clients: at the same priority, its start made the
    // requests sent meanwhile wait up to 25 ms). Set from here, once it
    // runs: a `pre_exec` would make the spawn a fork of this whole process.
    if let Some(pid) = child.id() {
        // SAFETY: a plain system call on our own child, not yet reaped; its
        // failure leaves the priority as it was.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, pid, CHECK_NICENESS) };
    }
    let out = tokio::time::timeout(CHECK_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| {
            format!(
                "`{shown}` did not answer its check within {}s",
                CHECK_TIMEOUT.as_secs()
            )
        })?
        .map_err(|e| format!("cannot run `{shown}`: {e}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stderr = stderr.trim();
    if !out.status.success() {
        return Err(format!(
            "`{shown}` failed its check ({}){}",
            out.status,
            if stderr.is_empty() {
                String::new()
            } else {
                format!(": {}", tail(stderr, 600))
            }
        ));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let answer: CheckAnswer = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .ok_or_else(|| {
            format!("`{shown}` is not a berth that upgrades in place (its check said nothing berth reads)")
        })?;
    if !answer.reads.contains(&VERSION) {
        return Err(format!(
            "`{shown}` (berth {}) adopts handover states {:?}; this berth writes version \
             {VERSION}: stop and start berth to change to it",
            answer.version, answer.reads
        ));
    }
    if answer.ipc_channel != ipc::IPC_CHANNEL_VERSION {
        return Err(format!(
            "`{shown}` (berth {}) is built with ipc-channel {}, this berth with {}: its \
             workers could not be taken over; stop and start berth to change to it",
            answer.version,
            answer.ipc_channel,
            ipc::IPC_CHANNEL_VERSION
        ));
    }
    Ok(answer)
}

/// The last `max` characters of `text`.
fn tail(text: &str, max: usize) -> &str {
    let skip = text.chars().count().saturating_sub(max);
    text.char_indices()
        .nth(skip)
        .map_or(text, |(at, _)| &text[at..])
}

/// Opens a descriptor of the running binary (what the new one execs again
/// if it cannot serve; valid even once the file is replaced).
fn this_binary() -> std::io::Result<OwnedFd> {
    std::fs::File::open("/proc/self/exe").map(OwnedFd::from)
}

/// The handed-over state and the descriptors it names, ready for the exec.
pub(crate) struct Prepared {
    pub state: state::Handover,
    /// Held open until the exec.
    pub keep: Vec<OwnedFd>,
}

/// Writes `prepared` down and execs `binary` (the file opened and checked)
/// in this process; returns only if the exec failed, with why (every
/// descriptor then closes again).
pub(crate) async fn exec(binary: &Binary, mut prepared: Prepared) -> String {
    let previous = match this_binary() {
        Ok(fd) => fd,
        Err(e) => return format!("cannot open this binary for a fallback: {e}"),
    };
    prepared.state.previous_binary = previous.as_raw_fd();
    prepared.state.binary = binary.fd.as_raw_fd();
    let memfd = match prepared.state.to_memfd() {
        Ok(fd) => fd,
        Err(e) => return format!("cannot write the handover state: {e}"),
    };
    // The descriptor stays open across the exec (a script's interpreter
    // reads it), and the new program closes it once it serves.
    let program = binary.fd.as_raw_fd();
    let mut keep = prepared.state.descriptors();
    keep.push(memfd.as_raw_fd());
    let exec = match exec_of(program, memfd.as_raw_fd(), previous.as_raw_fd(), keep) {
        Ok(exec) => exec,
        Err(e) => return e,
    };
    let error = crate::child::spawn::exec(exec).await;
    drop((memfd, previous, prepared.keep));
    format!("cannot exec `{}`: {error}", binary.path.display())
}

/// The exec of `program` with this process's arguments, its environment
/// and the state's descriptors.
fn exec_of(
    program: RawFd,
    state_fd: RawFd,
    previous_fd: RawFd,
    keep: Vec<RawFd>,
) -> Result<Exec, String> {
    let c = |s: &std::ffi::OsStr| {
        CString::new(s.as_encoded_bytes())
            .map_err(|_| "a NUL byte in an argument or the environment".to_string())
    };
    let argv = std::env::args_os()
        .map(|a| c(&a))
        .collect::<Result<Vec<_>, _>>()?;
    let mut env = Vec::new();
    for (key, value) in std::env::vars_os() {
        if key == state::ENV_STATE_FD || key == ENV_PREVIOUS_FD {
            continue;
        }
        let mut pair = key;
        pair.push("=");
        pair.push(value);
        env.push(c(&pair)?);
    }
    env.push(c(format!("{}={state_fd}", state::ENV_STATE_FD).as_ref())?);
    env.push(c(format!("{ENV_PREVIOUS_FD}={previous_fd}").as_ref())?);
    Ok(Exec {
        program,
        argv,
        env,
        keep,
    })
}

/// A handover this process was started with, if any: read from the
/// descriptor the environment names.
pub(crate) fn handed_over() -> Option<Result<state::Handover, String>> {
    let fd = std::env::var(state::ENV_STATE_FD).ok()?;
    Some(
        fd.parse::<RawFd>()
            .map_err(|_| format!("{}={fd} is not a descriptor", state::ENV_STATE_FD))
            .and_then(state::Handover::read),
    )
}

/// Whether this process was exec'd by an in-place upgrade.
pub fn is_upgrade() -> bool {
    std::env::var_os(state::ENV_STATE_FD).is_some()
}

/// This process, exec'd by an upgrade, cannot serve (`reason`): execs the
/// previous binary with the same state, so that it takes every worker back.
/// Returns only if that exec failed too, with why: the caller then exits,
/// and the workers die with the process.
pub async fn fall_back(reason: &str) -> String {
    match fall_back_exec(reason) {
        Ok((exec, memfd)) => {
            let error = crate::child::spawn::exec(exec).await;
            drop(memfd);
            format!("cannot exec the previous binary again: {error}")
        }
        Err(e) => e,
    }
}

/// [`fall_back`] from a thread outside the async runtime.
fn fall_back_blocking(reason: &str) -> String {
    match fall_back_exec(reason) {
        Ok((exec, memfd)) => {
            let error = crate::child::spawn::exec_blocking(exec);
            drop(memfd);
            format!("cannot exec the previous binary again: {error}")
        }
        Err(e) => e,
    }
}

/// The exec of the previous binary with the state handed over, marked with
/// why (and the state's new memfd, to hold until the exec).
fn fall_back_exec(reason: &str) -> Result<(Exec, OwnedFd), String> {
    let fd = |name: &str| -> Option<RawFd> { std::env::var(name).ok()?.parse().ok() };
    let (Some(state_fd), Some(previous)) = (fd(state::ENV_STATE_FD), fd(ENV_PREVIOUS_FD)) else {
        return Err("no previous binary was handed over".into());
    };
    // The state says why, for the previous binary's event.
    let state = match state::Handover::read(state_fd) {
        // This is the previous binary, exec'd back already: once is all.
        Ok(state) if state.fell_back.is_some() => {
            return Err("the previous binary, exec'd back already, cannot serve either".into());
        }
        Ok(mut state) => {
            state.fell_back = Some(reason.to_string());
            state
        }
        Err(e) => return Err(format!("the handed-over state cannot be read back: {e}")),
    };
    let memfd = state
        .to_memfd()
        .map_err(|e| format!("cannot write the handover state again: {e}"))?;
    let mut keep = state.descriptors();
    keep.push(memfd.as_raw_fd());
    let exec = exec_of(previous, memfd.as_raw_fd(), previous, keep)?;
    Ok((exec, memfd))
}

/// How long a program exec'd by an upgrade may take to serve before the
/// previous binary takes every worker back: a binary that passed its
/// check but hangs on its way to serving must not freeze berth for good.
/// `BERTH_UPGRADE_SERVE_WITHIN` (a duration) sets another.
pub(crate) fn serve_within() -> Duration {
    std::env::var("BERTH_UPGRADE_SERVE_WITHIN")
        .ok()
        .and_then(|v| crate::units::parse_duration(&v).ok())
        .unwrap_or(Duration::from_secs(60))
}

/// Set once this process serves (or, exec'd by an upgrade, has taken the
/// workers over and serves): the watchdog stands down.
static SERVING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Says this process serves.
pub(crate) fn serving() {
    SERVING.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// In a program exec'd by an upgrade: a thread that, if the program does
/// not serve within `within`, execs the previous binary with the state
/// handed over (from the main thread, as every exec is), which takes every
/// worker back.
pub(crate) fn watchdog(within: Duration) {
    if !is_upgrade() {
        return;
    }
    let started = std::time::Instant::now();
    let _ = std::thread::Builder::new()
        .name("berth-upgrade-watchdog".into())
        .spawn(move || {
            while started.elapsed() < within {
                if SERVING.load(std::sync::atomic::Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if SERVING.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            let reason = format!(
                "the upgraded binary did not serve within {}",
                crate::units::format_duration(within)
            );
            eprintln!("berth: {reason}; going back to the previous binary");
            let why = fall_back_blocking(&reason);
            eprintln!("berth: {why}");
        });
}

/// Closes the state's memfd and the previous binary's descriptor, once the
/// new program serves.
pub(crate) fn close_handover_descriptors(previous_binary: RawFd, binary: RawFd) {
    let state_fd = std::env::var(state::ENV_STATE_FD)
        .ok()
        .and_then(|v| v.parse::<RawFd>().ok());
    for fd in state_fd.into_iter().chain([previous_binary, binary]) {
        if fd > 2 {
            // SAFETY: descriptors the handover named, used by nothing else
            // once serving; taken once here.
            drop(unsafe { take(fd) });
        }
    }
}
