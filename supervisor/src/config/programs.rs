//! Which programs run as workers, and only by the operator's word: worker
//! kinds (a Rust binary, a command on the stream wire, an HTTP server with
//! its `http` table), their command lines, and the environment variables a
//! model may not set.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::container::ContainerSpec;
use super::limits::check_duration;

/// Environment variables that change which code a program runs or how it is
/// loaded: the dynamic loader's (`LD_*`, glibc's tunables and module paths),
/// shells' start-up files, interpreters' start-up hooks and search paths, and
/// `PATH`. A model spec may not set these; only an operator's worker kind.
pub fn is_dangerous_env(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "BASH_ENV",
        "ENV",
        "SHELLOPTS",
        "BASHOPTS",
        "PS4",
        "IFS",
        "CDPATH",
        "PATH",
        "GLIBC_TUNABLES",
        "GCONV_PATH",
        "LOCPATH",
        "NLSPATH",
        "HOSTALIASES",
        "RESOLV_HOST_CONF",
        "MALLOC_TRACE",
        "PYTHONSTARTUP",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONINSPECT",
        "PYTHONUSERBASE",
        "PYTHONBREAKPOINT",
        "PERL5OPT",
        "PERL5LIB",
        "PERLLIB",
        "PERL5DB",
        "RUBYOPT",
        "RUBYLIB",
        "NODE_OPTIONS",
        "NODE_PATH",
        "JAVA_TOOL_OPTIONS",
        "_JAVA_OPTIONS",
        "JDK_JAVA_OPTIONS",
        "CLASSPATH",
        "LUA_INIT",
        "LUA_PATH",
        "LUA_CPATH",
        "TCLLIBPATH",
        "CUDA_INJECTION64_PATH",
        "OPENSSL_CONF",
        "OPENSSL_ENGINES",
        "OCL_ICD_FILENAMES",
        "HSA_TOOLS_LIB",
    ];
    let upper = name.to_ascii_uppercase();
    upper.starts_with("LD_")
        || upper.starts_with("DYLD_")
        || upper.starts_with("BASH_FUNC_")
        || EXACT.contains(&upper.as_str())
}

/// A command line a worker is started with: a program and its arguments,
/// none empty or holding a NUL byte.
pub fn check_command(argv: &[String]) -> std::result::Result<(), String> {
    match argv.first() {
        None => Err("`command` is empty; give the program and its arguments, \
                     e.g. [\"python3\", \"-m\", \"berth_worker\"]"
            .into()),
        Some(program) if program.trim().is_empty() => {
            Err("`command` starts with an empty program name".into())
        }
        _ => match argv.iter().find(|a| a.contains('\0')) {
            Some(arg) => Err(format!("`command` argument {arg:?} holds a NUL byte")),
            None => Ok(()),
        },
    }
}

/// A worker program the operator declares by name, so that a model (even
/// one registered over HTTP) can run it by naming the kind, never the path.
/// Either a `binary` (a Rust worker on `ipc-channel`) or a `command` (a
/// worker on the stream wire: Python, any language).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerKind {
    /// The program (a `berth-worker`-compatible binary, or a wrapper that
    /// execs one: `setpriv`, a seccomp launcher, ...).
    #[serde(default)]
    pub binary: Option<PathBuf>,
    /// A stream-wire worker's command line (`["python3", "-m", "berth_worker"]`).
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// An HTTP server run from an image by podman or docker, with the
    /// kind's `http` table (see [`ContainerSpec`]; docs/containers.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<ContainerSpec>,
    /// Its working directory.
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    /// Environment for it; may set loader and interpreter variables, since
    /// only an operator writes it. For an HTTP server, `{port}` in a value
    /// is the port of each start, as in its command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// With `command`: the program is an HTTP inference server, reached as
    /// this says (see [`HttpSpec`]).
    #[serde(default)]
    pub http: Option<HttpSpec>,
    /// With a stream-wire `command` that serves through `berth_worker`:
    /// Python modules a preloaded interpreter of this kind imports once
    /// (`["torch", "berth_examples.torch_embed"]`); every worker of the kind
    /// is then forked from it, warm, rather than started cold
    /// (docs/python-workers.md, "Warm starts").
    #[serde(default)]
    pub preload: Vec<String>,
    /// Start the preloaded interpreter with the supervisor rather than at
    /// the kind's first load.
    #[serde(default)]
    pub preload_at_start: bool,
    /// How long the preloaded interpreter is kept once no model of its
    /// kind is loaded (default 10 minutes).
    #[serde(default, with = "crate::units::duration_opt")]
    pub preload_keep_alive: Option<Duration>,
}

/// How long a kind's preloaded interpreter outlives its last model by default.
pub const DEFAULT_PRELOAD_KEEP_ALIVE: Duration = Duration::from_secs(600);

/// A Python module name: dotted identifiers.
fn is_module_name(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|part| {
            let mut chars = part.chars();
            chars
                .next()
                .is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
                && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
        })
}

impl WorkerKind {
    /// A kind running a `berth-worker`-compatible binary.
    pub fn binary(path: impl Into<PathBuf>) -> Self {
        WorkerKind {
            binary: Some(path.into()),
            command: None,
            container: None,
            cwd: None,
            env: BTreeMap::new(),
            http: None,

            preload: Vec::new(),
            preload_at_start: false,
            preload_keep_alive: None,
        }
    }

    /// A kind running a stream-wire worker by its command line.
    pub fn command<S: Into<String>>(argv: impl IntoIterator<Item = S>) -> Self {
        WorkerKind {
            binary: None,
            command: Some(argv.into_iter().map(Into::into).collect()),
            container: None,
            cwd: None,
            env: BTreeMap::new(),
            http: None,

            preload: Vec::new(),
            preload_at_start: false,
            preload_keep_alive: None,
        }
    }

    /// Exactly one of `binary` and `command`, each well formed; a preload
    /// only for a stream-wire command, of module names.
    pub fn check(&self, name: &str) -> std::result::Result<(), String> {
        self.check_preload(name)?;
        if let Some(container) = &self.container {
            if self.binary.is_some() || self.command.is_some() {
                return Err(format!(
                    "worker kind `{name}` has a `container` and a `binary` or `command`; keep one"
                ));
            }
            container
                .check()
                .map_err(|e| format!("worker kind `{name}`: {e}"))?;
            return match &self.http {
                Some(http) => http
                    .check()
                    .map_err(|e| format!("worker kind `{name}`: {e}")),
                None => Err(format!(
                    "worker kind `{name}`: a `container` runs an HTTP server: give its `http` \
                     table (at least `http = {{ health = \"/health\" }}`)"
                )),
            };
        }
        match (&self.binary, &self.command) {
            (Some(_), Some(_)) => Err(format!(
                "worker kind `{name}` has both `binary` and `command`; keep one"
            )),
            (None, None) => Err(format!(
                "worker kind `{name}` has neither `binary` nor `command`; give one"
            )),
            (None, Some(argv)) => {
                check_command(argv).map_err(|e| format!("worker kind `{name}`: {e}"))?;
                match &self.http {
                    Some(http) => http
                        .check()
                        .map_err(|e| format!("worker kind `{name}`: {e}")),
                    None => Ok(()),
                }
            }
            (Some(_), None) if self.http.is_some() => Err(format!(
                "worker kind `{name}`: `http` goes with a `command` that starts the server"
            )),
            (Some(_), None) => Ok(()),
        }
    }
}

impl WorkerKind {
    fn check_preload(&self, name: &str) -> std::result::Result<(), String> {
        if self.preload.is_empty() {
            if self.preload_at_start || self.preload_keep_alive.is_some() {
                return Err(format!(
                    "worker kind `{name}`: `preload_at_start` and `preload_keep_alive` go with a \
                     `preload` list of modules"
                ));
            }
            return Ok(());
        }
        if self.command.is_none() || self.http.is_some() {
            return Err(format!(
                "worker kind `{name}`: `preload` is for a worker on the stream wire that \
                 serves through the berth_worker Python package (a `command` without `http`)"
            ));
        }
        if let Some(bad) = self.preload.iter().find(|m| !is_module_name(m)) {
            return Err(format!(
                "worker kind `{name}`: `preload` entry {bad:?} is not a Python module name \
                 (dotted identifiers, such as \"torch\" or \"berth_examples.torch_embed\")"
            ));
        }
        check_duration("preload_keep_alive", self.preload_keep_alive)
            .map_err(|e| format!("worker kind `{name}`: {e}"))
    }
}

/// How to reach an HTTP inference server that a `command` starts: what
/// tells it is ready, what to rewrite on the way, how to stop it.
///
/// In the command, `{port}` is replaced by a free loopback port berth
/// chooses for each start (a swap's new server gets its own), `{socket}` by
/// the path of a unix socket berth chooses instead (for a server that can
/// listen on one), and `{model}` by the model's resolved path.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSpec {
    /// Polled with GET until it answers 200: then the server is ready;
    /// polled once a second while it runs: a server that stops answering
    /// for `unhealthy_after` is stopped and restarted (default `/health`).
    /// `none`: the server has no such route; it is ready, and healthy, while
    /// it accepts connections.
    #[serde(default = "default_health")]
    pub health: String,
    /// The model name the server knows, put in the `model` field of the
    /// requests relayed to it (default: the request's as it is).
    #[serde(default)]
    pub model: Option<String>,
    /// Headers added to every request relayed to the server (its own API
    /// key, say); berth's own `Authorization` is never passed on.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// The signal that asks the server to stop (`SIGTERM`, `SIGINT`,
    /// `SIGQUIT`, `SIGHUP`); the whole process group gets it.
    #[serde(default = "default_stop_signal")]
    pub stop_signal: String,
    /// How long the server has after that signal before SIGKILL (default 10 s).
    #[serde(default, with = "crate::units::duration_opt")]
    pub stop_grace: Option<Duration>,
    /// A server whose health has not answered 200 for this long is declared
    /// lost (default 30 s).
    #[serde(default, with = "crate::units::duration_opt")]
    pub unhealthy_after: Option<Duration>,
    /// The loopback port the server listens on of its own (its command names
    /// it), where berth would otherwise choose one for each start
    /// (`{port}`). Checked free before each start, and the listener checked
    /// to be the server's; models on one fixed port never run at once, and
    /// a swap stops the old server before the new one starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The server listens on a port of its own that its command does not
    /// say (its default): berth finds it, the port its processes listen on
    /// once started, and checks it is theirs. Such servers are run one at
    /// a time, as on one fixed port.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub find_port: bool,
    /// A command that asks the server to stop, run before the stop signal
    /// (llama-swap's `cmdStop`: `docker stop NAME`): `{pid}` is the
    /// server's pid, `{port}` the port this start of it listens on. Then
    /// the signal, the grace and SIGKILL as ever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_command: Option<Vec<String>>,
    /// Where the server is reached, when not at `127.0.0.1`: another
    /// loopback address (`127.0.0.2`, `::1`; `localhost` is `127.0.0.1`),
    /// or the name of a host its command makes answer (a compose service's
    /// or a container's, on a network this machine reaches: llama-swap's
    /// `proxy: http://NAME:PORT` beside `cmd: docker compose up NAME`).
    /// On another host berth still runs, stops and sweeps the command, but
    /// cannot check the listener is the server's, and the server's memory
    /// is outside its cgroup: the load report and `ps` say so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The server's own sleep, for a model with `sleep = "server"`: the
    /// paths POSTed to put it to sleep and wake it (vLLM's `/sleep?level=1`
    /// and `/wake_up`; SGLang's `/release_memory_occupation` and
    /// `/resume_memory_occupation`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep: Option<ServerSleep>,
}

/// A server's own sleep ([`HttpSpec::sleep`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSleep {
    /// POSTed to put it to sleep (`/sleep?level=1`).
    pub sleep: String,
    /// POSTed to wake it (`/wake_up`).
    pub wake: String,
    /// What it may leave on the GPU asleep, per NVML (its CUDA context and
    /// what its framework keeps: vLLM was measured leaving 0.8–16 GB);
    /// more, and it is stopped instead. Unset: any residue, reported.
    #[serde(
        default,
        with = "crate::units::bytes_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_residue: Option<u64>,
}

/// Where an HTTP server is reached, from [`HttpSpec::host`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// An address of this machine's loopback.
    Loopback(std::net::IpAddr),
    /// Another host, by its name or address: resolved at each connection.
    Elsewhere(String),
}

impl Reach {
    /// `host` read: `None` is `127.0.0.1`.
    pub fn of(host: Option<&str>) -> std::result::Result<Reach, String> {
        let Some(host) = host else {
            return Ok(Reach::Loopback(std::net::Ipv4Addr::LOCALHOST.into()));
        };
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if bare.eq_ignore_ascii_case("localhost") {
            return Ok(Reach::Loopback(std::net::Ipv4Addr::LOCALHOST.into()));
        }
        if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
            if ip.is_unspecified() {
                // A server told to listen on every address is reached on
                // the loopback.
                return Ok(Reach::Loopback(std::net::Ipv4Addr::LOCALHOST.into()));
            }
            return Ok(if ip.is_loopback() {
                Reach::Loopback(ip)
            } else {
                Reach::Elsewhere(ip.to_string())
            });
        }
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && l.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        };
        if bare.len() > 253 || !bare.split('.').all(label_ok) {
            return Err(format!(
                "`http.host` `{}` is not a host name or an IP address",
                crate::input::quote(host)
            ));
        }
        Ok(Reach::Elsewhere(bare.to_ascii_lowercase()))
    }
}

fn default_health() -> String {
    "/health".into()
}

fn default_stop_signal() -> String {
    "SIGTERM".into()
}

/// Signals an HTTP server may be asked to stop with.
pub(crate) const STOP_SIGNALS: &[&str] = &["SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP"];

impl HttpSpec {
    /// A server polled at `health`, otherwise with the defaults.
    pub fn new(health: impl Into<String>) -> Self {
        HttpSpec {
            health: health.into(),
            model: None,
            headers: BTreeMap::new(),
            stop_signal: default_stop_signal(),
            stop_grace: None,
            unhealthy_after: None,
            port: None,
            find_port: false,
            stop_command: None,
            host: None,
            sleep: None,
        }
    }

    /// Every field well formed.
    pub fn check(&self) -> std::result::Result<(), String> {
        if let Some(sleep) = &self.sleep {
            for (key, path) in [("sleep", &sleep.sleep), ("wake", &sleep.wake)] {
                if !path.starts_with('/') || path.chars().any(char::is_whitespace) {
                    return Err(format!(
                        "`http.sleep.{key}` is a path on the server POSTed to, such as \
                         \"/sleep?level=1\" or \"/wake_up\", not `{path}`"
                    ));
                }
            }
        }
        if self.health != "none"
            && (!self.health.starts_with('/') || self.health.chars().any(char::is_whitespace))
        {
            return Err(format!(
                "`http.health` is a path on the server, such as \"/health\" (or \"none\": \
                 ready once it accepts connections), not `{}`",
                self.health
            ));
        }
        if !STOP_SIGNALS.contains(&self.stop_signal.as_str()) {
            return Err(format!(
                "`http.stop_signal` `{}` is not one of {}",
                self.stop_signal,
                STOP_SIGNALS.join(", ")
            ));
        }
        for (name, value) in &self.headers {
            if axum::http::HeaderName::try_from(name.as_str()).is_err()
                || axum::http::HeaderValue::try_from(value.as_str()).is_err()
            {
                return Err(format!(
                    "`http.headers` `{name}` is not a valid HTTP header"
                ));
            }
        }
        for (field, value) in [
            ("http.stop_grace", self.stop_grace),
            ("http.unhealthy_after", self.unhealthy_after),
        ] {
            check_duration(field, value)?;
        }
        if self.find_port && self.port.is_some() {
            return Err("give `http.port` or `http.find_port`, not both".into());
        }
        if self.port == Some(0) {
            return Err("`http.port` 0 is no port: give the port the server listens on".into());
        }
        if let Some(argv) = &self.stop_command {
            check_command(argv).map_err(|e| format!("`http.stop_command`: {e}"))?;
        }
        if let Reach::Elsewhere(host) = Reach::of(self.host.as_deref())?
            && self.find_port
        {
            return Err(format!(
                "`http.find_port` finds the port the server's processes listen on here; on \
                 `{host}` give `http.port` or name `{{port}}` in the command"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_preload_is_for_a_stream_wire_command_and_names_modules() {
        let mut python = WorkerKind::command(["python3", "-m", "berth_worker"]);
        python.preload = vec!["torch".into(), "berth_examples.torch_embed".into()];
        assert!(python.check("py").is_ok());
        for bad in ["", "torch/nn", "1torch", "torch.", "a b", "torch;rm"] {
            let mut kind = python.clone();
            kind.preload = vec![bad.into()];
            let err = kind.check("py").unwrap_err();
            assert!(err.contains("not a Python module name"), "{bad:?}: {err}");
        }
        let mut binary = WorkerKind::binary("/opt/worker");
        binary.preload = vec!["torch".into()];
        assert!(binary.check("rs").unwrap_err().contains("stream wire"));
        let mut server = python.clone();
        server.http = Some(HttpSpec::new("/health"));
        assert!(server.check("srv").unwrap_err().contains("without `http`"));
        let mut stray = WorkerKind::command(["python3"]);
        stray.preload_at_start = true;
        assert!(
            stray
                .check("py")
                .unwrap_err()
                .contains("go with a `preload`")
        );
    }
}
