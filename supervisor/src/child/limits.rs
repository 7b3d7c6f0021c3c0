//! Per-worker memory caps, enforced by the kernel where it lets us.
//!
//! Each capped worker gets a memory cgroup of its own under the
//! supervisor's: cgroup v2 (`memory.max`, `memory.swap.max = 0`) where the
//! memory controller is delegated to us, else the v1 memory controller
//! (`memory.limit_in_bytes`, and `memory.memsw.limit_in_bytes` where swap
//! accounting exists). The child joins its cgroup between fork and exec, so
//! not one page of its own is allocated outside it. Where neither can be
//! written, the supervisor polls the worker's RSS every 50 ms and kills it
//! past the limit; the report says which mechanism was used. On cgroup v2
//! the supervisor first moves itself into a leaf of its own subtree when it
//! has to (a delegated systemd service, a container's cgroup namespace).

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::base::CapMechanism;

/// A worker's memory cap and, for the cgroup mechanisms, its cgroup.
#[derive(Debug)]
pub struct MemoryCap {
    pub limit: u64,
    pub mechanism: CapMechanism,
    dir: Option<PathBuf>,
    procs: Option<CString>,
}

/// Where new cgroups for workers go, and which version it is: decided once
/// per process, because on cgroup v2 the first cap may move the supervisor
/// itself into a leaf (see [`enable_memory_below`]), after which its own
/// cgroup is no longer the base.
fn cgroup_base() -> Option<(CapMechanism, PathBuf)> {
    static BASE: std::sync::OnceLock<Option<(CapMechanism, PathBuf)>> = std::sync::OnceLock::new();
    BASE.get_or_init(find_cgroup_base).clone()
}

fn find_cgroup_base() -> Option<(CapMechanism, PathBuf)> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    // Pure v2: one "0::/path" line and the memory controller at the root.
    if let Ok(controllers) = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
        && controllers.split_whitespace().any(|c| c == "memory")
        && let Some(path) = own.lines().find_map(|l| l.strip_prefix("0::"))
    {
        return Some((
            CapMechanism::CgroupV2,
            Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/')),
        ));
    }
    let path = own.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then(|| path.to_string())
    })?;
    Some((
        CapMechanism::CgroupV1,
        Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/')),
    ))
}

fn write(path: &Path, value: &str) -> std::io::Result<()> {
    std::fs::write(path, value)
}

/// Enables the memory controller for `base`'s children. cgroup v2 allows
/// that only in a cgroup without processes of its own (the "no internal
/// processes" rule), and `base` is where the supervisor itself runs: under
/// systemd's `Delegate=` or in a container's cgroup namespace, it is the
/// root of the subtree berth was given. Refused for that reason (EBUSY),
/// the supervisor moves itself into a leaf, `base/supervisor`, as systemd
/// recommends for delegated services, and tries again. Done once; later
/// calls find the controller enabled.
fn enable_memory_below(base: &Path) -> std::io::Result<()> {
    let control = base.join("cgroup.subtree_control");
    match write(&control, "+memory") {
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            let leaf = base.join("supervisor");
            std::fs::create_dir_all(&leaf)?;
            // "0": the writing process, all its threads.
            write(&leaf.join("cgroup.procs"), "0")?;
            tracing::info!(
                "moved berth into {} so that its workers' cgroups can have memory caps",
                leaf.display()
            );
            write(&control, "+memory")
        }
        other => other,
    }
}

fn try_cgroup(model: &str, limit: u64) -> Result<(CapMechanism, PathBuf), String> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let (mechanism, base) = cgroup_base().ok_or("no memory cgroup found")?;
    let parent = base.join("berth");
    let leaf = parent.join(format!(
        "{model}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let setup = || -> std::io::Result<()> {
        std::fs::create_dir_all(&parent)?;
        if mechanism == CapMechanism::CgroupV2 {
            // Controllers flow down only where each level enables them.
            enable_memory_below(&base)?;
            write(&parent.join("cgroup.subtree_control"), "+memory")?;
        }
        std::fs::create_dir(&leaf)?;
        match mechanism {
            CapMechanism::CgroupV2 => {
                write(&leaf.join("memory.max"), &limit.to_string())?;
                let _ = write(&leaf.join("memory.swap.max"), "0");
            }
            _ => {
                write(&leaf.join("memory.limit_in_bytes"), &limit.to_string())?;
                let _ = write(
                    &leaf.join("memory.memsw.limit_in_bytes"),
                    &limit.to_string(),
                );
            }
        }
        Ok(())
    };
    match setup() {
        Ok(()) => Ok((mechanism, leaf)),
        Err(e) => {
            let _ = std::fs::remove_dir(&leaf);
            Err(format!(
                "cannot set up {} under {}: {e}",
                mechanism,
                parent.display()
            ))
        }
    }
}

impl MemoryCap {
    /// A cap of `limit` bytes for a worker about to start.
    pub fn prepare(model: &str, limit: u64) -> MemoryCap {
        match try_cgroup(model, limit) {
            Ok((mechanism, dir)) => {
                let procs = CString::new(
                    dir.join("cgroup.procs")
                        .into_os_string()
                        .into_encoded_bytes(),
                )
                .ok();
                MemoryCap {
                    limit,
                    mechanism,
                    dir: Some(dir),
                    procs,
                }
            }
            Err(reason) => {
                tracing::info!(model, "memory limit falls back to RSS polling: {reason}");
                MemoryCap {
                    limit,
                    mechanism: CapMechanism::RssPoll,
                    dir: None,
                    procs: None,
                }
            }
        }
    }

    /// The `cgroup.procs` file the child writes itself into before exec.
    pub(crate) fn procs_file(&self) -> Option<&CString> {
        self.procs.as_ref()
    }

    fn read_u64(&self, file: &str) -> Option<u64> {
        std::fs::read_to_string(self.dir.as_ref()?.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn read_counter(&self, file: &str, key: &str) -> Option<u64> {
        let text = std::fs::read_to_string(self.dir.as_ref()?.join(file)).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
    }

    /// Peak memory charged to the worker's cgroup (cgroup mechanisms only).
    pub fn peak(&self) -> Option<u64> {
        match self.mechanism {
            CapMechanism::CgroupV2 => self.read_u64("memory.peak"),
            CapMechanism::CgroupV1 => self.read_u64("memory.max_usage_in_bytes"),
            CapMechanism::RssPoll => None,
        }
    }

    /// Memory charged to the worker's cgroup now.
    pub fn usage(&self) -> Option<u64> {
        match self.mechanism {
            CapMechanism::CgroupV2 => self.read_u64("memory.current"),
            CapMechanism::CgroupV1 => self.read_u64("memory.usage_in_bytes"),
            CapMechanism::RssPoll => None,
        }
    }

    /// True once the kernel has OOM-killed something in the worker's cgroup.
    pub fn oom_killed(&self) -> bool {
        let kills = match self.mechanism {
            CapMechanism::CgroupV2 => self.read_counter("memory.events", "oom_kill "),
            CapMechanism::CgroupV1 => self.read_counter("memory.oom_control", "oom_kill "),
            CapMechanism::RssPoll => None,
        };
        kills.unwrap_or(0) > 0
    }
}

impl Drop for MemoryCap {
    /// Removes the cgroup once the worker is gone (an empty cgroup can be
    /// removed; its charges went with its processes).
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            for _ in 0..50 {
                if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            tracing::warn!(dir = %dir.display(), "could not remove a worker cgroup");
        }
    }
}
