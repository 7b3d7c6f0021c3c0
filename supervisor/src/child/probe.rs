//! Asking a worker program which backends it offers: `PROGRAM ARGS
//! --backends`, one name a line on stdout, exit 0 (docs/wire.md); and any
//! other one bounded run of a worker program ([`run_once`]: sleep's
//! checkpoint helper, `child/checkpoint.rs`).
//!
//! The program is the operator's, but what it does is not trusted: the
//! whole exchange is bounded in time (its exit *and* the end of its
//! output, which a child it forked may hold open) and in size, and it runs
//! in a process group of its own that is killed when the exchange ends,
//! whatever it left behind. It gets the worker's environment and folder,
//! no wire, and no descriptor of the supervisor's.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::child::program::WorkerProgram;

/// How long the whole exchange may take.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// The most output read; a program printing more is not a berth worker.
pub(crate) const PROBE_MAX_OUTPUT: usize = 64 << 10;

/// A backend a program offers, and the options it takes where it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Offered {
    pub name: String,
    /// `None`: not declared (any option may be refused only at load).
    pub options: Option<Vec<String>>,
}

/// Runs `program --backends` and returns what it printed (a line per
/// backend: `NAME`, or `NAME: OPTION, OPTION, ...`), or why it could not.
pub(crate) fn ask_backends(program: &WorkerProgram) -> Result<Vec<Offered>, String> {
    ask(program, PROBE_TIMEOUT, PROBE_MAX_OUTPUT)
}

/// One line of `--backends`.
fn offered(line: &str) -> Option<Offered> {
    let line = line.trim();
    if line.is_empty() {
        return None;
    }
    Some(match line.split_once(':') {
        Some((name, options)) => Offered {
            name: name.trim().to_string(),
            options: Some(
                options
                    .split(',')
                    .map(str::trim)
                    .filter(|o| !o.is_empty())
                    .map(str::to_string)
                    .collect(),
            ),
        },
        None => Offered {
            name: line.to_string(),
            options: None,
        },
    })
}

/// One bounded run of `program` with `args` after its own: what it printed
/// on stdout (up to `limit`, within `timeout`), its exit status if it
/// exited in time, and the last of its stderr. The same hygiene as a
/// worker's start (the worker's environment less `without`, its folder, no
/// descriptor of the supervisor's), in a process group of its own that is
/// killed when the run ends, whatever it left behind. Blocks.
pub(crate) fn run_once(
    program: &WorkerProgram,
    args: &[&str],
    without: &[&str],
    timeout: Duration,
    limit: usize,
) -> Result<Ran, String> {
    let deadline = Instant::now() + timeout;
    let mut command = Command::new(&program.path);
    command
        .args(&program.args)
        .args(args)
        .env_clear()
        .envs(crate::child::spawn::passthrough_env())
        .envs(program.env.iter().map(|(k, v)| (k, v)));
    for name in without {
        command.env_remove(name);
    }
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    if let Some(dir) = &program.cwd {
        command.current_dir(dir);
    }
    // SAFETY: between fork and exec: cloexec_from (close_range, fcntl,
    // getrlimit) and prctl are async-signal-safe and allocate nothing.
    unsafe {
        command.pre_exec(|| {
            crate::child::spawn::cloexec_from(3)?;
            // Dies with this thread, which waits for it below.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
            Ok(())
        });
    }
    // Kept from the stray reaper of a subreaper supervisor (the probe runs
    // outside its group) until it is reaped below.
    let (mut child, waiting) = {
        let _spawning = crate::child::orphans::spawning();
        let child = command.spawn().map_err(|e| format!("cannot run it: {e}"))?;
        let waiting = crate::child::orphans::waiting_for(child.id());
        (child, waiting)
    };
    let group = child.id() as i32;
    let kill_group = || {
        // SAFETY: killpg takes integers; a group already gone is ESRCH.
        unsafe { libc::killpg(group, libc::SIGKILL) };
    };
    let stdout = child.stdout.take().expect("piped");
    let stderr = child.stderr.take().expect("piped");
    let (read, stderr_tail) = read_output(stdout, stderr, deadline, limit);
    let status = match read {
        Ok(_) => wait_until(&mut child, deadline),
        Err(_) => None,
    };
    kill_group();
    let _ = child.wait();
    drop(waiting);
    Ok(Ran {
        read,
        status,
        stderr_tail,
    })
}

/// What [`run_once`] saw.
pub(crate) struct Ran {
    /// Its stdout, or why it was not read whole.
    pub read: Result<Vec<u8>, Unread>,
    /// Its exit status, if it exited in time.
    pub status: Option<std::process::ExitStatus>,
    /// The last bytes of its stderr.
    pub stderr_tail: Vec<u8>,
}

fn ask(program: &WorkerProgram, timeout: Duration, limit: usize) -> Result<Vec<Offered>, String> {
    let Ran {
        read,
        status,
        stderr_tail,
    } = run_once(program, &["--backends"], &[], timeout, limit)?;
    let stderr_tail = String::from_utf8_lossy(&stderr_tail)
        .trim()
        .replace('\n', " | ");
    let stderr_note = if stderr_tail.is_empty() {
        String::new()
    } else {
        format!(" (stderr: {stderr_tail})")
    };
    let output = match read {
        Ok(bytes) => bytes,
        Err(Unread::TooLong) => {
            return Err(format!(
                "it printed more than {} KiB to `--backends`; a berth worker prints its \
                 backends' names, one a line",
                limit >> 10
            ));
        }
        Err(Unread::TimedOut) => {
            return Err(format!(
                "its `--backends` output did not end within {} s{}",
                timeout.as_secs(),
                stderr_note
            ));
        }
        Err(Unread::Failed(e)) => return Err(format!("cannot read its output: {e}")),
    };
    let Some(status) = status else {
        return Err(format!(
            "it printed its backends but did not exit within {} s{stderr_note}",
            timeout.as_secs()
        ));
    };
    if !status.success() {
        return Err(format!(
            "`--backends` {}{stderr_note}",
            crate::report::ExitStatus::from_std(status)
        ));
    }
    let offered: Vec<Offered> = String::from_utf8_lossy(&output)
        .lines()
        .filter_map(offered)
        .filter(|o| !o.name.is_empty())
        .collect();
    if offered.is_empty() {
        return Err(format!(
            "`--backends` printed no backend names{stderr_note}"
        ));
    }
    Ok(offered)
}

/// Why output could not be read whole.
pub(crate) enum Unread {
    TimedOut,
    TooLong,
    Failed(std::io::Error),
}

/// The most of stderr kept (its last bytes) for error messages.
const STDERR_KEPT: usize = 2048;

/// Reads `stdout` to its end, up to `limit` bytes, until `deadline`, and
/// meanwhile the last bytes of `stderr` (read too, so a program writing
/// much there is not stopped on a full pipe).
fn read_output(
    mut stdout: impl Read + AsRawFd,
    mut stderr: impl Read + AsRawFd,
    deadline: Instant,
    limit: usize,
) -> (Result<Vec<u8>, Unread>, Vec<u8>) {
    let mut out = Vec::new();
    let mut err = Vec::new();
    let mut err_open = true;
    let mut buf = [0u8; 8192];
    let result = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break Err(Unread::TimedOut);
        }
        let mut polls = [
            libc::pollfd {
                fd: stdout.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                // A negative descriptor is skipped by poll.
                fd: if err_open { stderr.as_raw_fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let wait_ms = left.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: two pollfds, valid for the call.
        let ready = unsafe { libc::poll(polls.as_mut_ptr(), 2, wait_ms) };
        if ready < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            break Err(Unread::Failed(e));
        }
        if err_open && polls[1].revents != 0 {
            match stderr.read(&mut buf) {
                Ok(0) | Err(_) => err_open = false,
                Ok(n) => {
                    err.extend_from_slice(&buf[..n]);
                    let excess = err.len().saturating_sub(STDERR_KEPT);
                    err.drain(..excess);
                }
            }
        }
        if polls[0].revents == 0 {
            continue;
        }
        match stdout.read(&mut buf) {
            Ok(0) => break Ok(out),
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                if out.len() > limit {
                    break Err(Unread::TooLong);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(Unread::Failed(e)),
        }
    };
    (result, err)
}

/// The child's exit status if it exits before `deadline`.
fn wait_until(
    child: &mut std::process::Child,
    deadline: Instant,
) -> Option<std::process::ExitStatus> {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
            _ => return None,
        }
    }
}

/// The backends `program` offers (`--backends`, see `child/probe.rs`),
/// asked once per program and remembered, or why it could not say (a
/// wrapper that passes no arguments on, a program that is not a berth
/// worker, one that hangs). Blocks while it asks; the cache's lock is not
/// held meanwhile.
pub(crate) fn offered_backends(
    program: &WorkerProgram,
) -> std::result::Result<Vec<Offered>, String> {
    use std::collections::HashMap;
    use std::sync::Mutex;
    type Known = HashMap<WorkerProgram, std::result::Result<Vec<Offered>, String>>;
    static KNOWN: Mutex<Option<Known>> = Mutex::new(None);
    let known = |f: &mut dyn FnMut(&mut Known)| {
        let mut guard = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
        f(guard.get_or_insert_with(HashMap::new));
    };
    let mut cached = None;
    known(&mut |k| cached = k.get(program).cloned());
    if let Some(answer) = cached {
        return answer;
    }
    let answer = ask_backends(program);
    known(&mut |k| {
        k.insert(program.clone(), answer.clone());
    });
    answer
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::child::program::Wire;

    fn sh(script: &str) -> WorkerProgram {
        WorkerProgram {
            path: "/bin/sh".into(),
            args: vec!["-c".into(), script.into(), "sh".into()],
            env: Vec::new(),
            cwd: None,
            wire: Wire::Ipc,
            http: None,
        }
    }

    #[test]
    fn a_worker_prints_its_backends_and_maybe_their_options() {
        let offered = ask(
            &sh("printf 'echo\\n\\nhog: alloc_mib, work_ms\\nbare:\\n'"),
            PROBE_TIMEOUT,
            1024,
        )
        .unwrap();
        let names: Vec<&str> = offered.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["echo", "hog", "bare"]);
        assert_eq!(offered[0].options, None);
        assert_eq!(
            offered[1].options.as_deref(),
            Some(&["alloc_mib".to_string(), "work_ms".to_string()][..])
        );
        assert_eq!(offered[2].options.as_deref(), Some(&[][..]));
    }

    #[test]
    fn a_child_holding_stdout_open_cannot_hold_the_probe() {
        let started = Instant::now();
        // Prints, leaves a child with stdout open (in a session of its own,
        // out of the group's reach), and exits.
        let err = ask(
            &sh("echo echo; setsid sleep 3 & exit 0"),
            Duration::from_millis(500),
            1024,
        )
        .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(3), "{err}");
        assert!(err.contains("did not end within"), "{err}");
    }

    #[test]
    fn a_flood_of_output_is_named_as_such() {
        let err = ask(&sh("yes"), PROBE_TIMEOUT, 64 << 10).unwrap_err();
        assert!(err.contains("more than 64 KiB"), "{err}");
    }

    #[test]
    fn a_failing_probe_says_how_it_failed() {
        let err = ask(&sh("echo oops >&2; exit 3"), PROBE_TIMEOUT, 1024).unwrap_err();
        assert!(err.contains("code 3") && err.contains("oops"), "{err}");
        let err = ask(&sh("exit 0"), PROBE_TIMEOUT, 1024).unwrap_err();
        assert!(err.contains("no backend names"), "{err}");
    }

    #[test]
    fn what_the_probe_leaves_in_its_group_is_killed() {
        // A grandchild (double fork) that outlives the probe, in its group.
        let _ = ask(
            &sh("echo echo; (sleep 987654 >/dev/null 2>&1 &); exit 0"),
            PROBE_TIMEOUT,
            1024,
        );
        let left = || {
            procfs::process::all_processes()
                .unwrap()
                .filter_map(Result::ok)
                .filter(|p| p.cmdline().is_ok_and(|c| c == ["sleep", "987654"]))
                .filter(|p| p.stat().is_ok_and(|s| s.state != 'Z'))
                .count()
        };
        let deadline = Instant::now() + Duration::from_secs(2);
        while left() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            left(),
            0,
            "the probe's grandchild was killed with its group"
        );
    }
}
