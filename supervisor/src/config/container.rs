//! A model's server run from an image: a worker kind's `container` table,
//! and the `podman run`/`docker run` command lines berth recognises as one
//! (a llama-swap `cmd`, a kind's own `command`). Either way the command is
//! taken apart here, and `child/container.rs` runs it with berth's own
//! flags: a name of its own for each start, its cgroup, its mark.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::base::Engine;

/// A container as a model's server (`[workers.NAME] container = {...}`,
/// with the kind's `http` table).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerSpec {
    /// The engine: `podman` (the default) or `docker`, by name or path.
    #[serde(default = "default_engine")]
    pub engine: String,
    /// The image (`ghcr.io/ggml-org/llama.cpp:server`): it must be on the
    /// machine or pullable by the engine.
    pub image: String,
    /// The server's arguments, after the image: `{port}` is the port berth
    /// chose (the host's, on the host's network), `{model}` the model's path.
    #[serde(default)]
    pub args: Vec<String>,
    /// Volumes, as the engine's `-v` takes them (`/srv/models:/models:ro`).
    #[serde(default)]
    pub volumes: Vec<String>,
    /// The server's environment inside the container.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The container's network: `host` (the default: the server listens on
    /// the host's loopback, on `{port}`, and berth checks the listener is
    /// the container's), or the engine's own network with `port`.
    #[serde(default)]
    pub network: Option<String>,
    /// The port the server listens on inside the container, published on
    /// the host's loopback at the port berth chose (`-p 127.0.0.1:{port}:N`).
    #[serde(default)]
    pub port: Option<u16>,
    /// The OCI runtime (`runc`, `crun`), where the engine's default cannot
    /// run on this host.
    #[serde(default)]
    pub runtime: Option<String>,
    /// Resource limits, as the engine's `--ulimit` takes them
    /// (`nofile=65536:65536`).
    #[serde(default)]
    pub ulimits: Vec<String>,
    /// More of the engine's `run` options, as given (`--shm-size=8g`).
    #[serde(default)]
    pub options: Vec<String>,
}

fn default_engine() -> String {
    "podman".into()
}

impl ContainerSpec {
    /// The `run` command line it stands for (berth's own flags are added
    /// at each start).
    pub fn command(&self) -> Vec<String> {
        let mut argv = vec![self.engine.clone()];
        // podman takes the runtime before `run`, docker after it.
        let runtime = self.runtime.as_ref().map(|r| format!("--runtime={r}"));
        let podman = Engine::of(&self.engine) == Some(Engine::Podman);
        if podman {
            argv.extend(runtime.clone());
        }
        argv.push("run".into());
        if !podman {
            argv.extend(runtime);
        }
        match (&self.network, self.port) {
            (Some(network), _) => argv.push(format!("--network={network}")),
            (None, None) => argv.push("--network=host".into()),
            (None, Some(_)) => {}
        }
        if let Some(port) = self.port {
            argv.push("-p".into());
            argv.push(format!("127.0.0.1:{{port}}:{port}"));
        }
        for volume in &self.volumes {
            argv.push("-v".into());
            argv.push(volume.clone());
        }
        for (name, value) in &self.env {
            argv.push("-e".into());
            argv.push(format!("{name}={value}"));
        }
        for ulimit in &self.ulimits {
            argv.push(format!("--ulimit={ulimit}"));
        }
        argv.extend(self.options.iter().cloned());
        argv.push(self.image.clone());
        argv.extend(self.args.iter().cloned());
        argv
    }

    /// Every field well formed, and the command it stands for one berth
    /// can run.
    pub fn check(&self) -> Result<(), String> {
        if self.image.trim().is_empty() || self.image.starts_with('-') {
            return Err(format!(
                "`container.image` {:?} is no image name",
                self.image
            ));
        }
        if self.network.as_deref() == Some("host") && self.port.is_some() {
            return Err(
                "`container.port` publishes a port of the container's own network; \
                        on the host's network (`network = \"host\"`) the server listens on \
                        `{port}` itself: drop one"
                    .into(),
            );
        }
        if self.port == Some(0) {
            return Err("`container.port` 0 is no port".into());
        }
        match RunCommand::parse(&self.command()) {
            Some(Ok(_)) => Ok(()),
            Some(Err(e)) => Err(format!("`container`: {e}")),
            None => Err(format!(
                "`container.engine` {:?} is not podman or docker",
                self.engine
            )),
        }
    }
}

/// A `podman run`/`docker run` command line, taken apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunCommand {
    /// The engine's program, as given.
    pub program: String,
    pub engine: Engine,
    /// The engine's options before `run` (`--runtime=runc` for podman).
    pub globals: Vec<String>,
    /// The `run` options kept, flag and value as given.
    pub options: Vec<String>,
    pub image: String,
    /// After the image: the server's arguments.
    pub args: Vec<String>,
    /// berth's own flags the command gave, left out (berth gives its own).
    pub dropped: Vec<String>,
}

/// `run` options that take a value as the next argument (both engines').
const WITH_VALUE: &[&str] = &[
    "-a",
    "--add-host",
    "--annotation",
    "--attach",
    "--blkio-weight",
    "--cap-add",
    "--cap-drop",
    "--cgroup-conf",
    "--cgroupns",
    "--cpu-period",
    "--cpu-quota",
    "--cpu-shares",
    "--cpus",
    "--cpuset-cpus",
    "--cpuset-mems",
    "-c",
    "--device",
    "--device-cgroup-rule",
    "--dns",
    "--dns-option",
    "--dns-search",
    "-e",
    "--entrypoint",
    "--env",
    "--env-file",
    "--expose",
    "--gpus",
    "--group-add",
    "-h",
    "--health-cmd",
    "--health-interval",
    "--health-retries",
    "--health-start-period",
    "--health-timeout",
    "--hostname",
    "--ip",
    "--ipc",
    "-l",
    "--label",
    "--label-file",
    "--log-driver",
    "--log-opt",
    "-m",
    "--mac-address",
    "--memory",
    "--memory-reservation",
    "--memory-swap",
    "--mount",
    "--name",
    "--net",
    "--network",
    "--network-alias",
    "--oom-score-adj",
    "-p",
    "--pid",
    "--pids-limit",
    "--platform",
    "--pod",
    "--publish",
    "--pull",
    "--runtime",
    "--secret",
    "--security-opt",
    "--shm-size",
    "--stop-signal",
    "--stop-timeout",
    "--sysctl",
    "--tmpfs",
    "-u",
    "--ulimit",
    "--user",
    "--userns",
    "--uts",
    "-v",
    "--volume",
    "--volumes-from",
    "-w",
    "--workdir",
    "--cidfile",
    "--sdnotify",
    "--cgroup-parent",
    "--cgroups",
    "--restart",
    "--detach-keys",
];

/// berth's own flags: dropped from a command that gives them.
const BERTHS: &[&str] = &[
    "--name",
    "--rm",
    "--init",
    "-d",
    "--detach",
    "--replace",
    "--cidfile",
    "-t",
    "--tty",
    "-i",
    "--interactive",
    "-it",
    "-ti",
    "--sdnotify",
];

/// Flags that would take the container out of berth's hands.
const REFUSED: &[(&str, &str)] = &[
    (
        "--cgroup-parent",
        "berth places the container in the model's own cgroup",
    ),
    (
        "--cgroups",
        "berth places the container in the model's own cgroup",
    ),
    (
        "--restart",
        "berth restarts a server that dies; an engine's restart policy would start one berth \
         does not know",
    ),
];

impl RunCommand {
    /// `argv` taken apart if it runs a container (`podman run …`,
    /// `docker run …`, `docker container run …`); `None` if it does not.
    pub fn parse(argv: &[String]) -> Option<Result<RunCommand, String>> {
        let program = argv.first()?;
        let engine = Engine::of(program)?;
        let mut rest = argv[1..].iter().peekable();
        let mut globals = Vec::new();
        // The engine's own options, up to `run`.
        loop {
            let arg = rest.next()?;
            if arg == "run" {
                break;
            }
            if arg == "container" && rest.peek().is_some_and(|a| *a == "run") {
                rest.next();
                break;
            }
            if !arg.starts_with('-') {
                return None;
            }
            globals.push(arg.clone());
            if !arg.contains('=') && global_takes_value(arg) {
                globals.push(rest.next()?.clone());
            }
        }
        let mut options = Vec::new();
        let mut dropped = Vec::new();
        let image = loop {
            let Some(arg) = rest.next() else {
                return Some(Err(format!("`{program} run` names no image")));
            };
            if arg == "--" {
                match rest.next() {
                    Some(image) => break image.clone(),
                    None => return Some(Err(format!("`{program} run` names no image"))),
                }
            }
            if !arg.starts_with('-') || arg == "-" {
                break arg.clone();
            }
            // A short flag with its value attached (`-p8080:80`,
            // `-lkey=value`): taken apart, so it is checked as the long form.
            let attached = short_with_value(arg);
            let (flag, inline) = match (&attached, arg.split_once('=')) {
                (Some((flag, _)), _) => (*flag, false),
                (None, Some((flag, _))) => (flag, true),
                (None, None) => (arg.as_str(), false),
            };
            if let Some((_, why)) = REFUSED.iter().find(|(f, _)| *f == flag) {
                return Some(Err(format!(
                    "`{flag}` is not for a container berth runs: {why}"
                )));
            }
            let value = if let Some((_, value)) = &attached {
                Some(value.to_string())
            } else if !inline && WITH_VALUE.contains(&flag) {
                match rest.next() {
                    Some(value) => Some(value.clone()),
                    None => return Some(Err(format!("`{flag}` wants a value"))),
                }
            } else {
                None
            };
            if BERTHS.contains(&flag) {
                dropped.push(flag.to_string());
                continue;
            }
            let given = value
                .as_deref()
                .or_else(|| arg.split_once('=').map(|(_, v)| v));
            if let Err(e) = check_option(flag, given) {
                return Some(Err(e));
            }
            match &attached {
                Some((flag, value)) => options.extend([flag.to_string(), value.to_string()]),
                None => {
                    options.push(arg.clone());
                    options.extend(value);
                }
            }
        };
        Some(Ok(RunCommand {
            program: program.clone(),
            engine,
            globals,
            options,
            image,
            args: rest.cloned().collect(),
            dropped,
        }))
    }

    /// Whether the container is on the host's network (its server's
    /// listener is its own process, not a port the engine publishes).
    pub fn host_network(&self) -> bool {
        self.options.iter().enumerate().any(|(i, o)| {
            matches!(o.as_str(), "--network=host" | "--net=host")
                || (matches!(o.as_str(), "--network" | "--net")
                    && self.options.get(i + 1).is_some_and(|v| v == "host"))
        })
    }
}

/// The label keys berth sets on a container (`berth.owner`, `berth.model`,
/// `berth.cgroup`): whoever else sets them could have a sweep take a live
/// berth's container for a dead one's.
const OWN_LABELS: &str = "berth.";

/// A `run` option that may not be given: a label in berth's own namespace,
/// a file of labels berth cannot check, a publication on every interface
/// of every port.
fn check_option(flag: &str, value: Option<&str>) -> Result<(), String> {
    match flag {
        "--label" | "-l" if value.is_some_and(|v| v.trim_start().starts_with(OWN_LABELS)) => {
            Err(format!(
                "`{flag} {}`: labels `{OWN_LABELS}*` are berth's own (they say which berth runs \
                 a container, and what a sweep may remove); a command may not set them",
                value.unwrap_or_default()
            ))
        }
        "--label-file" => Err(
            "`--label-file`: berth cannot check a file's labels against its own (`berth.*`); \
             give each label with `--label KEY=VALUE`"
                .into(),
        ),
        "-P" | "--publish-all" => Err(format!(
            "`{flag}` publishes every port of the container on every interface; berth serves \
             it on the loopback only: publish the server's port with `-p PORT` (or `-p \
             HOST_PORT:PORT`), which berth binds to 127.0.0.1"
        )),
        _ => Ok(()),
    }
}

/// A short flag that takes a value, with the value attached (`-p8080:80`):
/// the flag and the value.
fn short_with_value(arg: &str) -> Option<(&str, &str)> {
    if arg.starts_with("--") || arg.len() <= 2 || !arg.is_char_boundary(2) {
        return None;
    }
    let (flag, value) = arg.split_at(2);
    (WITH_VALUE.contains(&flag) && !value.starts_with('=')).then_some((flag, value))
}

/// Engine options before `run` that take the next argument as their value.
fn global_takes_value(flag: &str) -> bool {
    matches!(
        flag,
        "--runtime"
            | "--root"
            | "--runroot"
            | "--storage-driver"
            | "--cgroup-manager"
            | "--log-level"
            | "--connection"
            | "-c"
            | "--context"
            | "-H"
            | "--host"
            | "--config"
            | "--url"
            | "--identity"
            | "--network-cmd-path"
            | "--conmon"
            | "--events-backend"
            | "--tmpdir"
            | "--volumepath"
            | "--imagestore"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
    }

    /// llama-swap's own docker model: its name, `--rm` and `--init` are
    /// berth's to give; its port, volume and server arguments are kept.
    #[test]
    fn llama_swaps_docker_run_is_taken_apart() {
        let run = RunCommand::parse(&argv(
            "docker run --name dkr --init --rm -p {port}:8080 -v /mnt/nvme/models:/models \
             ghcr.io/ggml-org/llama.cpp:server --model /models/m.gguf",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(run.engine, Engine::Docker);
        assert_eq!(run.image, "ghcr.io/ggml-org/llama.cpp:server");
        assert_eq!(run.args, argv("--model /models/m.gguf"));
        assert_eq!(
            run.options,
            argv("-p {port}:8080 -v /mnt/nvme/models:/models")
        );
        assert_eq!(run.dropped, argv("--name --init --rm"));
        assert!(!run.host_network());
    }

    #[test]
    fn engine_options_before_run_and_the_container_form_are_kept() {
        let run = RunCommand::parse(&argv(
            "/usr/bin/podman --runtime runc container run --network=host -e A=b img:1 --port {port}",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(run.engine, Engine::Podman);
        assert_eq!(run.globals, argv("--runtime runc"));
        assert_eq!(run.options, argv("--network=host -e A=b"));
        assert!(run.host_network());
        assert_eq!(run.image, "img:1");
    }

    #[test]
    fn what_is_no_container_and_what_berth_refuses() {
        assert!(RunCommand::parse(&argv("llama-server --port {port}")).is_none());
        assert!(RunCommand::parse(&argv("docker ps")).is_none());
        assert!(
            RunCommand::parse(&argv("podman run --rm"))
                .unwrap()
                .unwrap_err()
                .contains("no image")
        );
        let err = RunCommand::parse(&argv("docker run --restart=always img"))
            .unwrap()
            .unwrap_err();
        assert!(
            err.contains("--restart") && err.contains("berth restarts"),
            "{err}"
        );
        let err = RunCommand::parse(&argv("podman run --cgroup-parent /x img"))
            .unwrap()
            .unwrap_err();
        assert!(err.contains("own cgroup"), "{err}");
    }

    /// A command may not set berth's own labels (a sweep would take a live
    /// berth's container for a dead one's), give a file of labels berth
    /// cannot check, or publish every port everywhere; an attached short
    /// flag is checked as its long form.
    #[test]
    fn berths_labels_label_files_and_publish_all_are_refused() {
        for command in [
            "podman run --label berth.owner=1.2 img",
            "podman run --label=berth.cgroup=/x img",
            "docker run -l berth.model=m img",
            "docker run -lberth.owner=9.9 img",
            "podman run --label-file labels img",
            "docker run -P img",
            "docker run --publish-all img",
        ] {
            let err = RunCommand::parse(&argv(command))
                .unwrap()
                .expect_err(command);
            assert!(
                err.contains("berth") || err.contains("publishes"),
                "{command}: {err}"
            );
        }
        let run = RunCommand::parse(&argv("docker run -lteam=a -p18098:8080 img"))
            .unwrap()
            .unwrap();
        assert_eq!(run.options, argv("-l team=a -p 18098:8080"));
    }

    /// The native table stands for a command the parser reads back.
    #[test]
    fn the_container_table_is_a_run_command() {
        let spec = ContainerSpec {
            engine: "podman".into(),
            image: "localhost/srv:1".into(),
            args: argv("--port {port} --model {model}"),
            volumes: vec!["/srv/models:/models:ro".into()],
            env: BTreeMap::from([("HF_HUB_OFFLINE".to_string(), "1".to_string())]),
            network: None,
            port: None,
            runtime: Some("runc".into()),
            ulimits: vec!["nofile=4096:4096".into()],
            options: vec!["--shm-size=1g".into()],
        };
        spec.check().unwrap();
        let run = RunCommand::parse(&spec.command()).unwrap().unwrap();
        assert!(run.options.contains(&"--network=host".to_string()));
        assert_eq!(run.image, "localhost/srv:1");
        assert_eq!(run.args, spec.args);
        let published = ContainerSpec {
            port: Some(8080),
            ..spec.clone()
        };
        let run = RunCommand::parse(&published.command()).unwrap().unwrap();
        assert!(!run.options.iter().any(|o| o.starts_with("--network")));
        assert!(run.options.contains(&"127.0.0.1:{port}:8080".to_string()));
        let both = ContainerSpec {
            network: Some("host".into()),
            port: Some(8080),
            ..spec.clone()
        };
        assert!(both.check().unwrap_err().contains("drop one"));
        let no_engine = ContainerSpec {
            engine: "lxc".into(),
            ..spec
        };
        assert!(
            no_engine
                .check()
                .unwrap_err()
                .contains("not podman or docker")
        );
    }
}
