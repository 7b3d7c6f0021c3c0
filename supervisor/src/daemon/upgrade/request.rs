//! An upgrade asked for on the daemon's host (`berth upgrade --binary`):
//! the request file beside the daemon's state file that names the new
//! binary, written by [`ask`] (which then signals the daemon) and read by
//! the daemon at `SIGUSR2` ([`requested_binary`]). Only the daemon's own
//! user can have written it: which program runs is the operator's choice,
//! and no HTTP client names one.

use std::path::{Path, PathBuf};

/// The file `berth upgrade --binary` writes next to the state file.
pub fn request_file(state_file: &Path) -> PathBuf {
    state_file.with_extension("upgrade")
}

/// What a request file asks for.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct RequestFile {
    pub binary: PathBuf,
}

/// The binary a request file next to `state_file` names, if there is one
/// this server's own user wrote (and no one else could); it is removed.
pub(crate) fn requested_binary(state_file: &Path) -> Result<Option<PathBuf>, String> {
    use std::os::unix::fs::MetadataExt;
    let path = request_file(state_file);
    let meta = match std::fs::symlink_metadata(&path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let text = std::fs::read_to_string(&path);
    let _ = std::fs::remove_file(&path);
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !meta.is_file() || meta.uid() != me || meta.mode() & 0o022 != 0 {
        return Err(format!(
            "{} is not a request file of this server's user (a regular file of uid {me}, \
             writable by no one else); it was removed, nothing changed",
            path.display()
        ));
    }
    let text = text.map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let request: RequestFile = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not an upgrade request: {e}", path.display()))?;
    Ok(Some(request.binary))
}

/// Asks the daemon whose pid and state file its `/api/version` named to
/// upgrade to `binary`: writes the request file, then signals it.
pub fn ask(pid: Option<u64>, state_file: Option<&str>, binary: &Path) -> Result<(), String> {
    let fail = |what: String| what;
    let binary = std::fs::canonicalize(binary)
        .map_err(|e| fail(format!("cannot find `{}`: {e}", binary.display())))?;
    let pid = pid
        .and_then(|p| i32::try_from(p).ok())
        .ok_or_else(|| fail("the daemon did not say its pid".into()))?;
    let Some(state_file) = state_file else {
        return Err(fail(
            "the daemon keeps no state file, so `--binary` cannot reach it; replace the \
             binary it was started from and run `berth upgrade` without `--binary`"
                .into(),
        ));
    };
    // The daemon takes a request file of its own user's only.
    {
        use std::os::unix::fs::MetadataExt;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if let Ok(meta) = std::fs::metadata(state_file)
            && meta.uid() != me
        {
            return Err(fail(format!(
                "the daemon runs as uid {}, this is uid {me}: run `berth upgrade --binary` as                  the daemon's user (e.g. `sudo -u` it), on its host",
                meta.uid()
            )));
        }
    }
    let path = request_file(Path::new(state_file));
    let request = RequestFile { binary };
    let text = serde_json::to_string(&request).map_err(|e| fail(e.to_string()))?;
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let _ = std::fs::remove_file(&path);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| {
                fail(format!(
                    "cannot write {} (run this as the daemon's user, on its host): {e}",
                    path.display()
                ))
            })?;
        file.write_all(text.as_bytes())
            .map_err(|e| fail(format!("cannot write {}: {e}", path.display())))?;
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGUSR2,
    )
    .map_err(|e| {
        let _ = std::fs::remove_file(&path);
        fail(format!(
            "cannot signal the daemon (pid {pid}): {e}; run this as its user, on its host"
        ))
    })
}
