//! Per-worker cgroups: memory caps enforced by the kernel where it lets us,
//! and a fence around everything a worker starts.
//!
//! Each worker gets a cgroup of its own under the supervisor's (where one
//! can be made): cgroup v2 where the memory controller is delegated to us,
//! else the v1 memory controller. The child joins it between fork and exec,
//! so not one page of its own is allocated outside it, and whatever it
//! forks later is in it too, whatever process group or session that
//! process moves to: stopping a worker kills every task of its cgroup
//! (`cgroup.kill` on v2). A capped worker's cgroup also carries its limit
//! (`memory.max` and `memory.swap.max = 0`; `memory.limit_in_bytes` and
//! `memory.memsw.limit_in_bytes` where swap accounting exists). Where no
//! cgroup can be written, a cap falls back to polling the worker's RSS
//! every 50 ms and killing it past the limit (the report says which
//! mechanism was used), and a stop finds what a worker left by its mark and
//! as the supervisor's adopted children. On cgroup v2 the supervisor first
//! moves itself into a leaf of its own subtree when it has to (a delegated
//! systemd service, a container's cgroup namespace).
//!
//! `BERTH_NO_CGROUPS=1` in the supervisor's environment makes none (for a
//! host where cgroups are managed by something else, and for the tests of
//! the fallbacks).

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::base::CapMechanism;

/// A worker's memory cap and, for the cgroup mechanisms, its cgroup.
#[derive(Debug)]
pub struct MemoryCap {
    pub limit: u64,
    pub mechanism: CapMechanism,
    cgroup: Option<Cgroup>,
}

/// A worker's own cgroup, removed when dropped (once it is empty).
#[derive(Debug)]
pub struct Cgroup {
    dir: PathBuf,
    procs: CString,
    version: CapMechanism,
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
            let own = own_cgroup_v2();
            if must_move(own.as_deref(), &leaf) {
                std::fs::create_dir_all(&leaf)?;
                // "0": the writing process, all its threads.
                write(&leaf.join("cgroup.procs"), "0")?;
                if first_time(&MOVE_SAID) {
                    tracing::info!(
                        "moved berth into {} so that its workers' cgroups can have memory caps",
                        leaf.display()
                    );
                }
            }
            write(&control, "+memory")
        }
        other => other,
    }
}

/// Whether the move into the leaf was said already: it is a fact about
/// the process, said once, however many loads meet a busy controller.
static MOVE_SAID: AtomicBool = AtomicBool::new(false);

/// True the first time it is asked of `said`, false after.
fn first_time(said: &AtomicBool) -> bool {
    !said.swap(true, Ordering::Relaxed)
}

/// Whether berth, in cgroup `own` (`None`: unknown), must move itself into
/// `leaf`: not when it is there already (a later load meeting the
/// controller busy for another reason moves nothing and says nothing).
fn must_move(own: Option<&Path>, leaf: &Path) -> bool {
    own != Some(leaf)
}

/// This process's cgroup v2 folder, from `/proc/self/cgroup`.
fn own_cgroup_v2() -> Option<PathBuf> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/')))
}

/// The folder of the hierarchy workers' cgroups of `version` are made in.
fn hierarchy_root(version: CapMechanism) -> &'static Path {
    match version {
        CapMechanism::CgroupV2 => Path::new("/sys/fs/cgroup"),
        _ => Path::new("/sys/fs/cgroup/memory"),
    }
}

/// The cgroup version workers' cgroups are made in, if any can be.
pub(crate) fn cgroup_version() -> Option<CapMechanism> {
    if cgroups_off() {
        return None;
    }
    cgroup_base().map(|(version, _)| version)
}

/// Whether the operator turned cgroups off (`BERTH_NO_CGROUPS=1`).
fn cgroups_off() -> bool {
    std::env::var_os("BERTH_NO_CGROUPS").is_some_and(|v| v == "1")
}

/// A cgroup as an in-place upgrade hands it over.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct HandedCgroup {
    pub dir: PathBuf,
    pub version: CapMechanism,
}

/// A memory cap as an in-place upgrade hands it over.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct HandedCap {
    pub limit: u64,
    pub mechanism: CapMechanism,
    pub cgroup: Option<HandedCgroup>,
}

impl Cgroup {
    /// What an in-place upgrade hands over of it.
    pub(crate) fn handed(&self) -> HandedCgroup {
        HandedCgroup {
            dir: self.dir.clone(),
            version: self.version,
        }
    }

    /// The cgroup a predecessor of this process (an in-place upgrade)
    /// created; removed once empty, as one created here.
    pub(crate) fn taken_over(handed: HandedCgroup) -> Result<Cgroup, String> {
        let procs = CString::new(
            handed
                .dir
                .join("cgroup.procs")
                .into_os_string()
                .into_encoded_bytes(),
        )
        .map_err(|_| "a cgroup path with a NUL byte".to_string())?;
        Ok(Cgroup {
            dir: handed.dir,
            procs,
            version: handed.version,
        })
    }

    /// A new cgroup for a worker of `model` about to start, capped at
    /// `limit` bytes if given.
    pub fn create(model: &str, limit: Option<u64>) -> Result<Cgroup, String> {
        if cgroups_off() {
            return Err("BERTH_NO_CGROUPS=1".into());
        }
        let (version, base) = cgroup_base().ok_or("no memory cgroup found")?;
        let parent = base.join("berth");
        let leaf = parent.join(leaf_name(model));
        let setup = || -> std::io::Result<()> {
            std::fs::create_dir_all(&parent)?;
            if version == CapMechanism::CgroupV2 {
                // Controllers flow down only where each level enables them.
                enable_memory_below(&base)?;
                write(&parent.join("cgroup.subtree_control"), "+memory")?;
            }
            std::fs::create_dir(&leaf)?;
            match limit {
                Some(limit) => set_limit(&leaf, version, limit),
                None => Ok(()),
            }
        };
        let procs = CString::new(
            leaf.join("cgroup.procs")
                .into_os_string()
                .into_encoded_bytes(),
        )
        .map_err(|_| "a cgroup path with a NUL byte".to_string())?;
        match setup() {
            Ok(()) => Ok(Cgroup {
                dir: leaf,
                procs,
                version,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir(&leaf);
                Err(format!(
                    "cannot set up {} under {}: {e}",
                    version,
                    parent.display()
                ))
            }
        }
    }

    /// Makes a cgroup made ahead (a preloader's spare worker sits in it)
    /// the one of a worker of `model`: named for it, as [`Cgroup::create`]
    /// would have (a failed rename keeps the old name, said at debug), and
    /// capped at `limit` bytes if given.
    pub(crate) fn make_for(&mut self, model: &str, limit: Option<u64>) -> Result<(), String> {
        if let Some(limit) = limit {
            set_limit(&self.dir, self.version, limit)
                .map_err(|e| format!("cannot cap {}: {e}", self.dir.display()))?;
        }
        let Some(parent) = self.dir.parent() else {
            return Ok(());
        };
        let renamed = parent.join(leaf_name(model));
        let Ok(procs) = CString::new(
            renamed
                .join("cgroup.procs")
                .into_os_string()
                .into_encoded_bytes(),
        ) else {
            return Ok(()); // a name with a NUL byte: the old one stays
        };
        match std::fs::rename(&self.dir, &renamed) {
            Ok(()) => {
                self.dir = renamed;
                self.procs = procs;
            }
            Err(e) => {
                tracing::debug!(model, dir = %self.dir.display(), "the cgroup keeps its name: {e}");
            }
        }
        Ok(())
    }

    /// The `cgroup.procs` file the child writes itself into before exec.
    pub(crate) fn procs_file(&self) -> &CString {
        &self.procs
    }

    /// Its folder (kept in the state file, for a supervisor that comes
    /// after a killed one).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its path within its hierarchy (`/process_api/x/berth/m-1-2`), as a
    /// container engine's `--cgroup-parent` takes it.
    pub fn path_in_hierarchy(&self) -> String {
        let root = hierarchy_root(self.version);
        let inner = self.dir.strip_prefix(root).unwrap_or(&self.dir);
        format!("/{}", inner.display())
    }

    /// The processes in it now.
    pub fn members(&self) -> Vec<u32> {
        members_of(&self.dir)
    }

    /// Kills every process in it: at once with `cgroup.kill` on v2 (Linux
    /// 5.14), else each member with SIGKILL.
    pub fn kill_all(&self) {
        kill_cgroup(&self.dir, self.version)
    }

    fn read_u64(&self, file: &str) -> Option<u64> {
        std::fs::read_to_string(self.dir.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn read_counter(&self, file: &str, key: &str) -> Option<u64> {
        let text = std::fs::read_to_string(self.dir.join(file)).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
    }
}

/// A new worker cgroup's folder name: the model's, this process's pid and
/// a count, so that no two are alike.
fn leaf_name(model: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{model}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Caps the cgroup at `dir` at `limit` bytes, swap included.
fn set_limit(dir: &Path, version: CapMechanism, limit: u64) -> std::io::Result<()> {
    match version {
        CapMechanism::CgroupV2 => {
            write(&dir.join("memory.max"), &limit.to_string())?;
            let _ = write(&dir.join("memory.swap.max"), "0");
        }
        _ => {
            write(&dir.join("memory.limit_in_bytes"), &limit.to_string())?;
            let _ = write(&dir.join("memory.memsw.limit_in_bytes"), &limit.to_string());
        }
    }
    Ok(())
}

/// The cgroup at `dir` and every cgroup below it, parents first. A
/// worker's own cgroup has none below it; a container's engine makes some
/// (podman: `conmon` and `libpod-ID`, for its monitor and its payload).
fn subtree(dir: &Path) -> Vec<PathBuf> {
    let mut all = vec![dir.to_path_buf()];
    let mut i = 0;
    while i < all.len() {
        if let Ok(entries) = std::fs::read_dir(&all[i]) {
            let mut below: Vec<PathBuf> = entries
                .filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect();
            below.sort();
            all.extend(below);
        }
        i += 1;
    }
    all
}

/// The processes in the cgroup at `dir` and the cgroups below it.
pub(crate) fn members_of(dir: &Path) -> Vec<u32> {
    subtree(dir)
        .iter()
        .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
        .flat_map(|text| {
            text.lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// Kills every process in the cgroup at `dir` and the cgroups below it.
pub(crate) fn kill_cgroup(dir: &Path, version: CapMechanism) {
    if version == CapMechanism::CgroupV2 && write(&dir.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    for pid in members_of(dir) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Removes the (empty) cgroup at `dir` and those below it, deepest first;
/// whether it is gone. On cgroup v1, the same path in the other
/// hierarchies too, where something made it: a container engine given the
/// model's cgroup as its parent makes it in every controller's hierarchy.
pub(crate) fn remove_cgroup(dir: &Path) -> bool {
    let v1 = Path::new("/sys/fs/cgroup/memory");
    if let Ok(inner) = dir.strip_prefix(v1)
        && let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup")
    {
        for hierarchy in hierarchies.filter_map(|e| e.ok()).map(|e| e.path()) {
            let twin = hierarchy.join(inner);
            if hierarchy != v1 && twin.is_dir() {
                for d in subtree(&twin).iter().rev() {
                    let _ = std::fs::remove_dir(d);
                }
            }
        }
    }
    for d in subtree(dir).iter().rev() {
        let _ = std::fs::remove_dir(d);
    }
    !dir.exists()
}

/// The folder of the cgroup at `path` in the hierarchy workers' cgroups
/// are made in (as [`Cgroup::path_in_hierarchy`] gives it).
pub(crate) fn worker_cgroup_at(path: &str) -> Option<PathBuf> {
    let (version, _) = cgroup_base()?;
    let root = hierarchy_root(version);
    let path = path.trim_start_matches('/');
    (!path.is_empty()).then(|| root.join(path))
}

/// Whether `dir` is a worker cgroup a berth supervisor made: a leaf of a
/// `berth` folder under this host's cgroup hierarchy, named
/// `MODEL-PID-N`. What a supervisor acts on when it finds a state file
/// left behind.
pub(crate) fn is_worker_cgroup(dir: &Path) -> Option<CapMechanism> {
    let (version, _) = cgroup_base()?;
    let under = hierarchy_root(version);
    let parent = dir.parent()?;
    let named = dir
        .file_name()?
        .to_str()?
        .rsplitn(3, '-')
        .take(2)
        .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    (dir.starts_with(under)
        && parent.file_name().is_some_and(|n| n == "berth")
        && named
        && !dir
            .components()
            .any(|c| c == std::path::Component::ParentDir))
    .then_some(version)
}

impl MemoryCap {
    /// What an in-place upgrade hands over of it.
    pub(crate) fn handed(&self) -> HandedCap {
        HandedCap {
            limit: self.limit,
            mechanism: self.mechanism,
            cgroup: self.cgroup.as_ref().map(Cgroup::handed),
        }
    }

    /// The cap a predecessor of this process (an in-place upgrade) set.
    pub(crate) fn taken_over(handed: HandedCap) -> Result<MemoryCap, String> {
        Ok(MemoryCap {
            limit: handed.limit,
            mechanism: handed.mechanism,
            cgroup: handed.cgroup.map(Cgroup::taken_over).transpose()?,
        })
    }

    /// A cap of `limit` bytes enforced by `cgroup`, already capped so.
    pub(crate) fn in_cgroup(limit: u64, cgroup: Cgroup) -> MemoryCap {
        MemoryCap {
            limit,
            mechanism: cgroup.version,
            cgroup: Some(cgroup),
        }
    }

    /// A cap of `limit` bytes for a worker about to start.
    pub fn prepare(model: &str, limit: u64) -> MemoryCap {
        match Cgroup::create(model, Some(limit)) {
            Ok(cgroup) => MemoryCap {
                limit,
                mechanism: cgroup.version,
                cgroup: Some(cgroup),
            },
            Err(reason) => {
                tracing::info!(model, "memory limit falls back to RSS polling: {reason}");
                MemoryCap {
                    limit,
                    mechanism: CapMechanism::RssPoll,
                    cgroup: None,
                }
            }
        }
    }

    /// The cgroup that enforces it, if the kernel does.
    pub fn cgroup(&self) -> Option<&Cgroup> {
        self.cgroup.as_ref()
    }

    /// Peak memory charged to the worker's cgroup (cgroup mechanisms only).
    pub fn peak(&self) -> Option<u64> {
        let cgroup = self.cgroup.as_ref()?;
        match self.mechanism {
            CapMechanism::CgroupV2 => cgroup.read_u64("memory.peak"),
            CapMechanism::CgroupV1 => cgroup.read_u64("memory.max_usage_in_bytes"),
            CapMechanism::RssPoll => None,
        }
    }

    /// True once the kernel has OOM-killed something in the worker's cgroup.
    pub fn oom_killed(&self) -> bool {
        let Some(cgroup) = &self.cgroup else {
            return false;
        };
        let kills = match self.mechanism {
            CapMechanism::CgroupV2 => cgroup.read_counter("memory.events", "oom_kill "),
            CapMechanism::CgroupV1 => cgroup.read_counter("memory.oom_control", "oom_kill "),
            CapMechanism::RssPoll => None,
        };
        kills.unwrap_or(0) > 0
    }
}

impl Drop for Cgroup {
    /// Removes the cgroup once the worker is gone (an empty cgroup can be
    /// removed; its charges went with its processes).
    fn drop(&mut self) {
        for _ in 0..50 {
            if remove_cgroup(&self.dir) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        tracing::warn!(dir = %self.dir.display(), "could not remove a worker cgroup");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a GPU machine's cgroup v2 every load logged "moved berth into
    /// .../supervisor" again (13 times in one short run): a one-time fact
    /// is said once, and a berth already in its leaf is not moved again.
    #[test]
    fn the_move_into_the_leaf_is_done_and_said_once() {
        let leaf = Path::new("/sys/fs/cgroup/system.slice/berth.service/supervisor");
        let base = leaf.parent().unwrap();
        assert!(must_move(Some(base), leaf));
        assert!(must_move(None, leaf));
        assert!(!must_move(Some(leaf), leaf));
        let said = AtomicBool::new(false);
        assert!(first_time(&said));
        assert!(!first_time(&said));
        assert!(!first_time(&said));
    }
}
