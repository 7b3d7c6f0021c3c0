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

/// The most a request file may hold: a path, in JSON.
const REQUEST_MAX: u64 = 64 << 10;

/// The binary a request file next to `state_file` names, if there is one
/// this server's own user wrote (and no one else could); it is removed.
/// The file is opened without following a link and without blocking (a
/// FIFO there must not hold the signal's handling), and its type, owner,
/// mode and size are read from the descriptor before a byte of it is:
/// what is checked is what is read. Blocking: call it off the async
/// threads.
pub(crate) fn requested_binary(state_file: &Path) -> Result<Option<PathBuf>, String> {
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let path = request_file(state_file);
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(&path);
    let file = match opened {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            return Err(format!(
                "cannot open {} ({e}: a link there is refused); it was removed, nothing changed",
                path.display()
            ));
        }
    };
    let _ = std::fs::remove_file(&path);
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !meta.is_file() || meta.uid() != me || meta.mode() & 0o022 != 0 || meta.len() > REQUEST_MAX {
        return Err(format!(
            "{} is not a request file of this server's user (a regular file of uid {me} of \
             at most {REQUEST_MAX} bytes, writable by no one else); it was removed, nothing \
             changed",
            path.display()
        ));
    }
    let mut text = String::new();
    file.take(REQUEST_MAX)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let request: RequestFile = serde_json::from_str(&text).map_err(|e| {
        format!(
            "{} is not an upgrade request: {}",
            path.display(),
            crate::input::quote(&e.to_string())
        )
    })?;
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
                "the daemon runs as uid {}, this is uid {me}: run `berth upgrade --binary` as \
                 the daemon's user (e.g. `sudo -u` it), on its host",
                meta.uid()
            )));
        }
    }
    // The pid named must be the berth that holds this state file's lock:
    // else the signal would go to whatever process has that pid now, and
    // the request file beside a state file nobody serves.
    if !holds_lock(pid as u32, &Path::new(state_file).with_extension("lock")) {
        return Err(fail(format!(
            "pid {pid} does not hold the lock of state file {state_file}: the daemon that \
             answered is not the one that owns it (or is not on this host); run this on the \
             daemon's host, against the daemon itself"
        )));
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

/// Whether process `pid` holds the `flock` on `lock` (as the kernel lists
/// it in `/proc/locks`: the lock's type, holder pid and the file's inode).
fn holds_lock(pid: u32, lock: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(lock) else {
        return false;
    };
    let (dev, ino) = (meta.dev(), meta.ino());
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let Ok(locks) = std::fs::read_to_string("/proc/locks") else {
        return false;
    };
    locks.lines().any(|line| {
        // `1: FLOCK  ADVISORY  WRITE 1234 00:1f:5678 0 EOF`
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(kind), Some(holder), Some(file)) = (fields.get(1), fields.get(4), fields.get(5))
        else {
            return false;
        };
        let mut parts = file.split(':');
        let (Some(maj), Some(min), Some(inode)) = (parts.next(), parts.next(), parts.next()) else {
            return false;
        };
        *kind == "FLOCK"
            && holder.parse::<u32>() == Ok(pid)
            && u32::from_str_radix(maj, 16) == Ok(major)
            && u32::from_str_radix(min, 16) == Ok(minor)
            && inode.parse::<u64>() == Ok(ino)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the process holding the lock holds it: this process, once it
    /// takes the `flock`; not pid 1, and nobody before it is taken.
    #[test]
    fn the_lock_holder_is_read_from_the_kernel() {
        use std::os::fd::AsRawFd;
        let lock = std::env::temp_dir().join(format!("berth-lock-test-{}", std::process::id()));
        let file = std::fs::File::create(&lock).unwrap();
        let me = std::process::id();
        assert!(!holds_lock(me, &lock));
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(
            unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
            0
        );
        assert!(holds_lock(me, &lock));
        assert!(!holds_lock(1, &lock));
        drop(file);
        assert!(!holds_lock(me, &lock));
        std::fs::remove_file(&lock).unwrap();
    }
}
