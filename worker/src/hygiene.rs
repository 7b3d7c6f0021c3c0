//! What a worker does before anything else: make sure it cannot outlive the
//! supervisor that started it.

use berth_protocol::{ENV_BOOTSTRAP, ENV_PARENT_PID};

/// What the environment told us about the supervisor.
pub(crate) struct Bootstrap {
    pub server_name: String,
}

/// Arms the parent-death signal and re-checks the parent.
///
/// The supervisor also arms `PR_SET_PDEATHSIG` between fork and exec; doing it
/// again here costs nothing and covers a host that spawns workers its own
/// way. The parent check closes the race where the supervisor died before the
/// signal was armed: then we have been re-parented and must not run on.
pub(crate) fn start() -> Result<Bootstrap, String> {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number, and
    // resetting a signal's disposition has no memory-safety preconditions.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
        // Rust's runtime handles SIGSEGV and SIGBUS to report stack overflows,
        // and swallows one that was sent rather than faulted. A worker dies of
        // the signal that hit it, so the supervisor can report it.
        libc::signal(libc::SIGSEGV, libc::SIG_DFL);
        libc::signal(libc::SIGBUS, libc::SIG_DFL);
    }
    let server_name = std::env::var(ENV_BOOTSTRAP).map_err(|_| {
        format!(
            "berth-worker is started by the berth supervisor and is not meant to be run by hand \
             ({ENV_BOOTSTRAP} is not set); try `berth run --backend echo --input hi`"
        )
    })?;
    if let Ok(expected) = std::env::var(ENV_PARENT_PID) {
        let expected: i32 = expected
            .parse()
            .map_err(|_| format!("{ENV_PARENT_PID}={expected} is not a pid"))?;
        let actual = nix::unistd::getppid().as_raw();
        if actual != expected {
            return Err(format!(
                "the supervisor (pid {expected}) is gone (parent is now pid {actual}); exiting"
            ));
        }
    }
    Ok(Bootstrap { server_name })
}
