//! Debian packages the tests need (Chromium, podman): found on the PATH,
//! else installed with `apt-get` when the tests run as root (as on CI),
//! once (a lock keeps two test binaries from running apt at once);
//! otherwise the test fails and says what to install.

use std::fs::File;
use std::path::PathBuf;
use std::process::Command;

/// `name` on the PATH.
pub fn find(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| PathBuf::from(dir).join(name))
        .find(|p| p.is_file())
}

/// The program `look` finds, installing `packages` first where it finds
/// none (with their recommended packages or not); `what` says which test
/// needs them, for the failure without root.
pub fn ensure(
    what: &str,
    packages: &[&str],
    recommends: bool,
    look: &dyn Fn() -> Option<PathBuf>,
) -> PathBuf {
    if let Some(path) = look() {
        return path;
    }
    assert!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() } == 0,
        "{what} needs Debian's {packages:?}: install them (`apt-get install {}`) or run the \
         tests as root, which installs them",
        packages.join(" ")
    );
    let lock = crate::target_dir().join("apt-install.lock");
    let file = File::create(&lock).expect("the install lock");
    let held = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .expect("the install lock");
    if look().is_none() {
        let mut install = vec!["install", "-y", "-qq"];
        if !recommends {
            install.push("--no-install-recommends");
        }
        install.extend_from_slice(packages);
        // One `apt-get update` a run of the tests, whichever test asks first.
        let updated = crate::target_dir().join("apt-updated");
        let fresh = std::fs::metadata(&updated)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age.as_secs() < 3600));
        let update: &[&str] = if fresh { &[] } else { &["update", "-qq"] };
        for args in [update, &install[..]].into_iter().filter(|a| !a.is_empty()) {
            let status = Command::new("apt-get")
                .args(args)
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()
                .expect("apt-get runs");
            assert!(status.success(), "apt-get {args:?} failed: {status}");
            if args == update {
                let _ = std::fs::write(&updated, "");
            }
        }
    }
    drop(held);
    look().unwrap_or_else(|| panic!("{packages:?} installed, yet {what} finds no program"))
}
