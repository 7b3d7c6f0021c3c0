//! A model's server in a container (`config/container.rs` takes the
//! command apart): run with berth's own flags, stopped in order, proven
//! gone, and swept when a berth that ran it died (`sweep.rs`).
//!
//! A container's processes are not the children of the `podman run`
//! client berth starts: they hang from the engine's monitor (podman's
//! `conmon`, containerd's shim). So berth gives each start:
//! - the model's cgroup (podman on cgroup v2: `--cgroups=split`, which
//!   keeps conmon and the payload in sub-cgroups of the client's, the
//!   model's; on v1: `--cgroup-parent` of the model's cgroup): what berth
//!   measures, caps and kills is the container's processes, not the
//!   client's;
//! - `--rm --init` (podman also `--replace`), a name of its own
//!   (`berth-MODEL-PID-N`: no "name already in use" when a removal lags),
//!   a `--cidfile`;
//! - labels naming the supervisor that ran it (`berth.owner=PID.START`)
//!   and the model, and the worker's mark in its environment;
//! - podman's `--sdnotify=ignore` (berth's own `NOTIFY_SOCKET` never
//!   reaches it: the client's environment is cleared);
//! - its GPUs by UUID (podman: CDI `nvidia.com/gpu=UUID`; docker:
//!   `--gpus device=UUID,…`).
//!
//! A stop is the engine's stop with the model's grace, then its forced
//! removal, then the cgroup killed; the proof is the engine saying the
//! container does not exist and the cgroup being empty, never a
//! successful `rm` alone.

use std::path::PathBuf;
use std::time::Duration;

use crate::config::{Engine, RunCommand};

mod sweep;

pub use sweep::sweep;

/// The label naming the supervisor that ran a container.
pub const OWNER_LABEL: &str = "berth.owner";
/// The label naming the model a container serves.
pub const MODEL_LABEL: &str = "berth.model";
/// The label naming the model's cgroup (its path in its hierarchy).
pub const CGROUP_LABEL: &str = "berth.cgroup";
/// Stands for the model's cgroup in the command line (`start.rs` fills
/// it, or drops the argument where the model has no cgroup).
pub(crate) const CGROUP: &str = "{cgroup}";
/// Stands for podman's `--cgroups=split` where the model has a cgroup.
pub(crate) const SPLIT: &str = "{cgroups=split}";
/// How long an engine command may take before berth gives up on it.
const ENGINE_TIMEOUT: Duration = Duration::from_secs(30);

/// One start of a container (an in-place upgrade hands it over whole).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct Container {
    pub engine: Engine,
    /// Its listener is a process in the model's cgroup: the server's own
    /// (the host's network) or podman's conmon holding a published port;
    /// docker's published port is its daemon's proxy's, outside it.
    pub listener_in_cgroup: bool,
    /// The engine's program and its options before `run`.
    program: String,
    globals: Vec<String>,
    pub name: String,
    cidfile: PathBuf,
}

/// This supervisor, as its containers' owner label names it: its pid and
/// start time, so that a later berth tells a live owner from a dead one
/// whose pid came back.
pub(crate) fn owner() -> String {
    let pid = std::process::id();
    format!(
        "{pid}.{}",
        crate::child::orphans::start_time(pid).unwrap_or(0)
    )
}

impl Container {
    /// The command line of a start of `run` for `model` (after the
    /// engine's program), and the container it makes. `gpus`: the UUIDs
    /// of the GPUs placement gave the model.
    pub(crate) fn plan(
        model: &str,
        run: &RunCommand,
        gpus: &[String],
        host: &Host,
    ) -> Result<(Container, Vec<String>), String> {
        let cgroup_v2 = host.cgroup_v2;
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let safe: String = model
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        // Counted from this program's start in ms: after an in-place
        // upgrade (the same pid) a new name is never one a container
        // handed over still runs under.
        static BASE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let base = *BASE.get_or_init(crate::base::unix_ms);
        let name = format!(
            "berth-{safe}-{}-{}",
            std::process::id(),
            base + NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let dir = private_dir()?;
        let cidfile = dir.join(format!("{name}.cid"));
        let _ = std::fs::remove_file(&cidfile);
        let podman = run.engine == Engine::Podman;
        let mut args = run.globals.clone();
        if podman
            && !cgroup_v2
            && !run
                .globals
                .iter()
                .any(|g| g.starts_with("--cgroup-manager"))
        {
            // `--cgroup-parent` is a path only to the cgroupfs manager.
            args.push("--cgroup-manager=cgroupfs".into());
        }
        let given = |flag: &str| {
            run.globals
                .iter()
                .chain(&run.options)
                .any(|o| o == flag || o.starts_with(&format!("{flag}=")))
        };
        if podman && !cgroup_v2 && host.runc && !given("--runtime") {
            // crun refuses cgroup v1 and hybrid hosts; runc runs there.
            args.push("--runtime=runc".into());
        }
        args.extend(["run", "--rm", "--init"].map(String::from));
        if podman {
            args.push("--replace".into());
            args.push("--sdnotify=ignore".into());
        }
        args.extend([
            "--name".into(),
            name.clone(),
            "--cidfile".into(),
            cidfile.display().to_string(),
            "--label".into(),
            format!("{OWNER_LABEL}={}", owner()),
            "--label".into(),
            format!("{MODEL_LABEL}={model}"),
            // The model's cgroup, for a sweep after this berth is gone
            // (left out where it has none).
            format!("--label={CGROUP_LABEL}={CGROUP}"),
            // From the client's environment: the worker's mark.
            "--env".into(),
            crate::child::orphans::ENV_WORKER_MARK.into(),
        ]);
        if podman && cgroup_v2 {
            args.push(SPLIT.into());
        } else {
            args.push(format!("--cgroup-parent={CGROUP}"));
        }
        if !gpus.is_empty() {
            match run.engine {
                Engine::Podman => {
                    for uuid in gpus {
                        args.push("--device".into());
                        args.push(format!("nvidia.com/gpu={uuid}"));
                    }
                }
                Engine::Docker => {
                    args.push("--gpus".into());
                    args.push(format!("\"device={}\"", gpus.join(",")));
                }
            }
        }
        // The limits a worker of berth's has (its own), where the command
        // gives none: an engine's defaults for root (1,048,576 open files,
        // podman's process limit) may be above what this host lets a
        // runtime set, and then every container fails to start.
        let ulimit_given = |name: &str| {
            run.options.iter().enumerate().any(|(i, o)| {
                let value = match o.strip_prefix("--ulimit") {
                    Some(v) if v.starts_with('=') => &v[1..],
                    Some("") => run.options.get(i + 1).map_or("", String::as_str),
                    _ => return false,
                };
                value.starts_with(&format!("{name}="))
            })
        };
        for (name, limit) in [("nofile", host.nofile), ("nproc", host.nproc)] {
            if let Some(limit) = limit
                && !ulimit_given(name)
            {
                args.push(format!("--ulimit={name}={limit}:{limit}"));
            }
        }
        args.extend(loopback_only(&run.options));
        args.push(run.image.clone());
        args.extend(run.args.iter().cloned());
        Ok((
            Container {
                engine: run.engine,
                listener_in_cgroup: podman || run.host_network(),
                program: run.program.clone(),
                globals: run.globals.clone(),
                name,
                cidfile,
            },
            args,
        ))
    }

    /// The container's id, once the engine wrote it.
    pub(crate) fn id(&self) -> Option<String> {
        let id = std::fs::read_to_string(&self.cidfile).ok()?;
        let id = id.trim();
        (!id.is_empty()).then(|| id.to_string())
    }

    /// The engine's stop, with `grace` before its SIGKILL; whether it
    /// succeeded.
    pub(crate) async fn stop(&self, model: &str, grace: Duration) -> bool {
        let secs = grace.as_secs().max(1).to_string();
        let ok = self
            .engine(["stop", "-t", &secs, &self.name], grace + ENGINE_TIMEOUT)
            .await
            .is_ok_and(|out| out.status.success());
        tracing::info!(
            model,
            container = self.name,
            ok,
            "asked the engine to stop the container"
        );
        ok
    }

    /// Its forced removal (kill, then remove), then whether the engine
    /// still knows it.
    pub(crate) async fn remove(&self, model: &str) -> Gone {
        let removal = self.engine(["rm", "-f", &self.name], ENGINE_TIMEOUT).await;
        if let Ok(out) = &removal
            && !out.status.success()
        {
            let stderr = String::from_utf8_lossy(&out.stderr);
            if !is_no_such(&stderr) {
                tracing::warn!(
                    model,
                    container = self.name,
                    "`rm -f` failed: {}",
                    stderr.trim()
                );
            }
        }
        let _ = std::fs::remove_file(&self.cidfile);
        match exists(&self.program, &self.globals, self.engine, &self.name).await {
            Ok(false) => Gone::Removed,
            Ok(true) => Gone::StillThere,
            Err(e) => Gone::Unknown(e),
        }
    }

    async fn engine<const N: usize>(
        &self,
        args: [&str; N],
        timeout: Duration,
    ) -> Result<std::process::Output, String> {
        run_engine(&self.program, &self.globals, &args, timeout).await
    }
}

/// The options with a port published on every interface (`-p
/// {port}:8080`, as llama-swap's examples write it) published on the
/// loopback only: berth's front door is the way in, with its tokens.
fn loopback_only(options: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(options.len());
    let mut publish_next = false;
    for option in options {
        let fixed = match option.split_once('=') {
            _ if publish_next => loopback(option),
            Some((flag, value)) if flag == "-p" || flag == "--publish" => {
                format!("{flag}={}", loopback(value))
            }
            _ => option.clone(),
        };
        publish_next = option == "-p" || option == "--publish";
        out.push(fixed);
    }
    out
}

/// A publication bound to 127.0.0.1: `HOST_PORT:CONTAINER_PORT` and a
/// bare `CONTAINER_PORT` (published on a port the engine picks) are, an
/// address given is kept.
fn loopback(mapping: &str) -> String {
    match mapping.matches(':').count() {
        0 => format!("127.0.0.1::{mapping}"),
        1 => format!("127.0.0.1:{mapping}"),
        _ => mapping.to_string(),
    }
}

/// The folder of berth's cidfiles: this user's alone (0700, owned by this
/// user, checked), under `$XDG_RUNTIME_DIR` where there is one, else
/// `berth-UID` in the temporary folder. A folder another user made there,
/// or one others may write, is refused rather than used.
fn private_dir() -> Result<PathBuf, String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let base = match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        Some(run) if run.is_absolute() && run.is_dir() => run.join("berth"),
        _ => std::env::temp_dir().join(format!("berth-{uid}")),
    };
    let dir = base.join("containers");
    for folder in [&base, &dir] {
        match std::fs::DirBuilder::new().mode(0o700).create(folder) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("cannot make {}: {e}", folder.display())),
        }
        let meta = std::fs::symlink_metadata(folder)
            .map_err(|e| format!("cannot read {}: {e}", folder.display()))?;
        if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
            return Err(format!(
                "{} is not a folder of this user's alone (uid {uid}, mode 0700); berth keeps \
                 its containers' cidfiles there: remove it, or set XDG_RUNTIME_DIR",
                folder.display()
            ));
        }
    }
    Ok(dir)
}

/// What a container's start needs to know of this host.
#[derive(Debug, Clone, Default)]
pub(crate) struct Host {
    /// Workers' cgroups are v2.
    pub cgroup_v2: bool,
    /// runc is on the PATH.
    pub runc: bool,
    /// The open-files and processes limits a container gets where its
    /// command gives none: this process's hard limits (the processes limit
    /// at most `kernel.pid_max`, above which the kernel refuses one).
    pub nofile: Option<u64>,
    pub nproc: Option<u64>,
}

impl Host {
    /// This host, now.
    pub(crate) fn now() -> Host {
        let hard = |resource| {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes the struct we own.
            let read = unsafe { libc::getrlimit(resource, &mut limit) } == 0;
            (read && limit.rlim_max != libc::RLIM_INFINITY).then_some(limit.rlim_max)
        };
        let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok());
        let nproc = match (hard(libc::RLIMIT_NPROC), pid_max) {
            (Some(n), Some(max)) => Some(n.min(max)),
            (n, max) => n.or(max),
        };
        Host {
            cgroup_v2: crate::child::limits::cgroup_version()
                == Some(crate::base::CapMechanism::CgroupV2),
            runc: on_path("runc"),
            nofile: hard(libc::RLIMIT_NOFILE),
            nproc,
        }
    }
}

/// Whether `program` is on the PATH.
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// What the engine said of a container after its removal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Gone {
    Removed,
    StillThere,
    /// The engine could not be asked.
    Unknown(String),
}

fn is_no_such(stderr: &str) -> bool {
    let lower = stderr.to_ascii_lowercase();
    lower.contains("no such container") || lower.contains("no container with name")
}

/// Runs the engine with `args`, its environment berth's pass-through one,
/// for at most `timeout`.
async fn run_engine(
    program: &str,
    globals: &[String],
    args: &[&str],
    timeout: Duration,
) -> Result<std::process::Output, String> {
    let mut command = tokio::process::Command::new(program);
    command
        .args(globals)
        .args(args)
        .env_clear()
        .envs(crate::child::spawn::passthrough_env())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    match tokio::time::timeout(timeout, command.output()).await {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(e)) => Err(format!("cannot run {program}: {e}")),
        Err(_) => Err(format!(
            "`{program} {}` did not answer within {timeout:?}",
            args.join(" ")
        )),
    }
}

/// Whether the engine knows a container by `name`.
async fn exists(
    program: &str,
    globals: &[String],
    engine: Engine,
    name: &str,
) -> Result<bool, String> {
    let out = match engine {
        Engine::Podman => {
            run_engine(
                program,
                globals,
                &["container", "exists", name],
                ENGINE_TIMEOUT,
            )
            .await?
        }
        Engine::Docker => {
            run_engine(
                program,
                globals,
                &["container", "inspect", name],
                ENGINE_TIMEOUT,
            )
            .await?
        }
    };
    match out.status.code() {
        Some(0) => Ok(true),
        Some(1) if engine == Engine::Podman => Ok(false),
        _ if is_no_such(&String::from_utf8_lossy(&out.stderr)) => Ok(false),
        _ => Err(format!(
            "`{program}` could not say whether {name} exists ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// Fills the model's cgroup into a container's command line: `{cgroup}`
/// becomes its path in its hierarchy and [`SPLIT`] podman's
/// `--cgroups=split`; without a cgroup both arguments are left out (and
/// the container runs where its engine puts it, said by the caller).
pub(crate) fn fill_cgroup(
    args: &[String],
    cgroup: Option<&crate::child::limits::Cgroup>,
) -> Vec<String> {
    args.iter()
        .filter_map(|arg| match (arg.as_str(), cgroup) {
            (SPLIT, Some(_)) => Some("--cgroups=split".to_string()),
            (SPLIT, None) => None,
            (a, Some(cgroup)) if a.contains(CGROUP) => {
                Some(a.replace(CGROUP, &cgroup.path_in_hierarchy()))
            }
            (a, None) if a.contains(CGROUP) => None,
            _ => Some(arg.clone()),
        })
        .collect()
}

#[cfg(test)]
mod tests;
