//! Which program a worker runs: the model's own command or binary, its
//! declared worker kind's, else the supervisor's own worker; the wire it
//! speaks, its environment and folder.

use std::path::PathBuf;

use crate::child::spawn::find_worker_binary;
use crate::config::{HttpSpec, ModelSpec, SupervisorConfig};
use crate::error::{Error, Result};

/// The worker binary's file name.
pub const WORKER_BINARY: &str = "berth-worker";

/// Which wire a worker program speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Wire {
    /// `ipc-channel`: a Rust worker built on `berth-worker`.
    Ipc,
    /// The stream wire (`docs/wire.md`): a worker in any language.
    Stream,
    /// None: an HTTP inference server (`child/upstream.rs`).
    Http,
}

/// A worker program: what to execute, the arguments that select its worker
/// role (none for a plain worker binary), its environment and folder, and
/// the wire it speaks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct WorkerProgram {
    pub path: PathBuf,
    pub args: Vec<String>,
    /// The worker kind's environment, then the model's own.
    pub env: Vec<(String, String)>,
    pub cwd: Option<PathBuf>,
    pub wire: Wire,
    /// How to reach it, for an HTTP server.
    pub http: Option<HttpSpec>,
}

impl WorkerProgram {
    fn plain(path: PathBuf, args: Vec<String>) -> Self {
        WorkerProgram {
            path,
            args,
            env: Vec::new(),
            cwd: None,
            wire: Wire::Ipc,
            http: None,
        }
    }
}

impl std::fmt::Display for WorkerProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.path.display())?;
        for arg in &self.args {
            write!(f, " {arg}")?;
        }
        Ok(())
    }
}

/// The program a worker for `spec` runs: the spec's own command (a
/// stream-wire worker) or binary (a host's), else its declared worker
/// kind's, else the supervisor's (with its role arguments), else
/// `berth-worker` next to this executable.
pub(crate) fn worker_program(spec: &ModelSpec, config: &SupervisorConfig) -> Result<WorkerProgram> {
    let kind = spec.worker.as_ref().and_then(|k| config.workers.get(k));
    // A kind's container is the `run` command it stands for.
    let container = kind.and_then(|k| k.container.as_ref()).map(|c| c.command());
    let command = spec
        .command
        .as_ref()
        .or(kind.and_then(|k| k.command.as_ref()))
        .or(container.as_ref());
    let binary = spec
        .worker_binary
        .as_ref()
        .or(kind.and_then(|k| k.binary.as_ref()));
    let mut program = match (command, binary) {
        (Some(argv), _) if spec.worker_binary.is_none() => {
            let (program, args) = argv.split_first().ok_or_else(|| Error::InvalidSpec {
                model: spec.name.clone(),
                reason: "`command` is empty".into(),
            })?;
            match spec.http_spec(config) {
                Some(http) => WorkerProgram {
                    wire: Wire::Http,
                    http: Some(http.clone()),
                    ..WorkerProgram::plain(program.into(), args.to_vec())
                },
                None => WorkerProgram {
                    wire: Wire::Stream,
                    ..WorkerProgram::plain(program.into(), args.to_vec())
                },
            }
        }
        (_, Some(path)) => WorkerProgram::plain(path.clone(), Vec::new()),
        _ => default_program(config)?,
    };
    program.env = kind
        .map(|k| k.env.clone().into_iter().collect())
        .unwrap_or_default();
    program.env.extend(spec.env.iter().cloned());
    // A relative folder is the supervisor's own folder's, once: the same
    // path for a spawn and for a fork from a preloaded interpreter, which
    // is already in that folder itself.
    program.cwd = spec
        .cwd
        .clone()
        .or(kind.and_then(|k| k.cwd.clone()))
        .map(|dir| std::path::absolute(&dir).unwrap_or(dir));
    Ok(program)
}

/// The supervisor's own worker program (with its role arguments), else
/// `berth-worker` next to this executable.
pub(crate) fn default_program(config: &SupervisorConfig) -> Result<WorkerProgram> {
    match &config.worker_binary {
        Some(path) => Ok(WorkerProgram::plain(
            path.clone(),
            config.worker_args.clone(),
        )),
        None => {
            find_worker_binary(WORKER_BINARY).map(|path| WorkerProgram::plain(path, Vec::new()))
        }
    }
}
