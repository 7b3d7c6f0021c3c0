//! `berth serve`'s configuration file (TOML).
//!
//! ```toml
//! listen = "127.0.0.1:7733"     # or "unix:/run/berth.sock", or "0.0.0.0:7733" with a token
//! token = "s3cret"              # bearer token; required off loopback
//! memory_budget = "8GiB"
//! max_loaded = 4
//! keep_alive = "5m"             # default for models without their own
//! models_dir = "/var/lib/berth/models"
//!
//! [[model]]
//! name = "minilm"
//! backend = "embed"
//! model = "all-MiniLM-L6-v2"     # relative: inside models_dir
//! keep_alive = "10m"
//! memory_limit = "1GiB"
//! load_mode = "mmap"
//! options = { threads = 2 }
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use std::collections::BTreeMap;

use crate::config::{
    Group, Matrix, ModelSpec, Residency, Rules, WorkerKind, check_bytes, check_duration,
};
pub use crate::server::options::{
    DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_LISTEN, DEFAULT_MAX_BODY,
    DEFAULT_MAX_BODY_TOTAL, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_INPUTS, DEFAULT_SEND_TIMEOUT,
    MAX_CONNECTIONS_LIMIT,
};
use crate::server::{Listen, ServeOptions};

pub const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(300);
/// Largest answer a worker may send through the sidecar.
pub const DEFAULT_MAX_RESPONSE: u64 = 64 << 20;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    #[serde(default)]
    pub listen: Option<String>,
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default, with = "crate::units::bytes_opt")]
    pub memory_budget: Option<u64>,
    #[serde(default)]
    pub max_loaded: Option<usize>,
    /// Requests waiting for their model's load or turn, all models together
    /// (default 512).
    #[serde(default)]
    pub max_queue: Option<usize>,
    /// How models take turns when they cannot all have room (`[turn] min =
    /// "2s", max = "20s"`); see docs/configuration.md.
    #[serde(default)]
    pub turn: crate::config::Turns,
    /// VRAM berth's workers may hold on one GPU together.
    #[serde(default, with = "crate::units::bytes_opt")]
    pub gpu_memory_budget: Option<u64>,
    #[serde(default, with = "crate::units::duration_opt")]
    pub keep_alive: Option<Duration>,
    #[serde(default)]
    pub models_dir: Option<PathBuf>,
    #[serde(default, with = "crate::units::duration_opt")]
    pub load_timeout: Option<Duration>,
    #[serde(default, with = "crate::units::duration_opt")]
    pub drain_timeout: Option<Duration>,
    /// Largest request body accepted (default 16 MiB).
    #[serde(default, with = "crate::units::bytes_opt")]
    pub max_body: Option<u64>,
    /// Request bodies held at once, all together (default 256 MiB, at
    /// least `max_body`).
    #[serde(default, with = "crate::units::bytes_opt")]
    pub max_body_total: Option<u64>,
    /// Where the supervisor records its workers, so the next one can stop
    /// what it leaves if it is killed (default: under `~/.cache/berth/run/`).
    #[serde(default)]
    pub state_file: Option<PathBuf>,
    /// First restart delay after a crash (default 500 ms, doubling to 60 s).
    #[serde(default, with = "crate::units::duration_opt")]
    pub restart_backoff: Option<Duration>,
    /// See [`crate::config::SupervisorConfig::answer_spin`] (default 100 µs, `0s`
    /// never spins, at most 1 ms).
    #[serde(default, with = "crate::units::duration_opt")]
    pub answer_spin: Option<Duration>,
    /// Worker programs models may name (`worker = "NAME"`), declared by the
    /// operator: `[workers.NAME] binary = "/path", env = { K = "V" }`, or
    /// `command = ["python3", "-m", "berth_worker"]` for a stream-wire worker.
    #[serde(default)]
    pub workers: BTreeMap<String, WorkerKind>,
    /// `Host` header values accepted besides the listen address itself
    /// (`berth.internal:7733`): how an operator exposes berth under a name.
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// `Origin` header values accepted (`https://app.example`); browsers'
    /// requests from any other origin are refused.
    #[serde(default)]
    pub allowed_origins: Vec<String>,
    /// `GET /metrics` answers without the token (and, off loopback, without
    /// the Host check), as the probes do: for scrapers that cannot send a
    /// token, such as an inference gateway's endpoint picker (default false).
    #[serde(default)]
    pub public_metrics: bool,
    /// Connections held at once (default 512).
    #[serde(default)]
    pub max_connections: Option<usize>,
    /// See [`DEFAULT_HEADER_TIMEOUT`] (default 10 s).
    #[serde(default, with = "crate::units::duration_opt")]
    pub header_timeout: Option<Duration>,
    /// See [`DEFAULT_BODY_TIMEOUT`] (default 60 s).
    #[serde(default, with = "crate::units::duration_opt")]
    pub body_timeout: Option<Duration>,
    /// See [`DEFAULT_SEND_TIMEOUT`] (default 30 s).
    #[serde(default, with = "crate::units::duration_opt")]
    pub send_timeout: Option<Duration>,
    /// Texts one `/v1/embeddings` request may carry (default 2048).
    #[serde(default)]
    pub max_inputs: Option<usize>,
    /// Largest answer a worker may send (default 64 MiB).
    #[serde(default, with = "crate::units::bytes_opt")]
    pub max_response: Option<u64>,
    /// Models registered at once (default 1024).
    #[serde(default)]
    pub max_models: Option<usize>,
    /// Whether HTTP clients may register (or swap to) the test doubles
    /// `hog`, `fault` and `gpu-hog`, which hold memory, crash or hang on
    /// command (default: no; the config may always name them).
    #[serde(default)]
    pub test_backends: bool,
    #[serde(default, rename = "model")]
    pub models: Vec<ModelSpec>,
    /// Models that swap with each other, or run alone (`config/residency.rs`).
    #[serde(default)]
    pub groups: BTreeMap<String, Group>,
    /// The sets of models that may run together, instead of groups.
    #[serde(default)]
    pub matrix: Option<Matrix>,
}

impl ServeConfig {
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let config = Self::read(path)?;
        config
            .check()
            .map_err(|e| format!("`{}`: {e}", path.display()))?;
        Ok(config)
    }

    /// The container engines its servers run (a kind's `container`, a
    /// `podman run`/`docker run` command): what a start of `berth serve`
    /// and `berth reap` sweep of containers a dead berth left.
    pub fn container_engines(&self) -> Vec<String> {
        let mut engines: Vec<String> = self
            .workers
            .values()
            .filter_map(|kind| match &kind.container {
                Some(container) => Some(container.engine.clone()),
                None => kind.command.as_deref().and_then(engine_of),
            })
            .chain(
                self.models
                    .iter()
                    .filter_map(|m| m.command.as_deref().and_then(engine_of)),
            )
            .collect();
        engines.sort();
        engines.dedup();
        engines
    }

    /// Parses the file without [`check`](Self::check)ing its values (the
    /// CLI fetches missing default models in between). A relative `model`
    /// path is taken inside [`models_root`](Self::models_root), so a config
    /// names `all-MiniLM-L6-v2` wherever `berth fetch` put it.
    pub fn read(path: &Path) -> Result<Self, String> {
        let text = crate::input::read_text(path, crate::input::CONFIG_MAX, "the config")?;
        Self::parse(&text, path)
    }

    /// A config from its text (`path` names it in errors, and its models'
    /// relative paths are under its `models_dir`).
    pub fn parse(text: &str, path: &Path) -> Result<Self, String> {
        let mut config: ServeConfig = toml::from_str(text).map_err(|e| {
            format!(
                "`{}` is not a valid berth config: {}",
                path.display(),
                toml_error(text, &e)
            )
        })?;
        let mut seen = std::collections::HashSet::new();
        for model in &config.models {
            if !seen.insert(&model.name) {
                return Err(format!(
                    "`{}`: model `{}` is listed twice",
                    path.display(),
                    model.name
                ));
            }
        }
        let root = config.models_root();
        for model in &mut config.models {
            if let Some(p) = model.model.as_mut()
                && p.is_relative()
            {
                *p = root.join(&*p);
            }
        }
        Ok(config)
    }

    /// Where models live: `models_dir`, else the fetch directory
    /// (`$BERTH_MODELS`, else `~/.cache/berth/models`).
    pub fn models_root(&self) -> PathBuf {
        self.models_dir
            .clone()
            .unwrap_or_else(crate::fetch::models_dir)
    }

    /// The groups or matrix, checked against the models listed.
    pub fn rules(&self) -> Result<Rules, String> {
        let residency = Residency {
            groups: self.groups.clone(),
            matrix: self.matrix.clone(),
        };
        residency.compile(&|name| self.models.iter().any(|m| m.name == name))
    }

    /// Each set of models the rules let run together must fit the budgets:
    /// `max_loaded`, and `memory_budget` where each member declares its
    /// `memory_limit`.
    fn check_rules(&self) -> Result<(), String> {
        let rules = self.rules()?;
        for (what, members) in rules.together() {
            if let Some(max) = self.max_loaded
                && members.len() > max
            {
                return Err(format!(
                    "{what} lets {} models run together, past max_loaded {max}: raise max_loaded or split it",
                    members.len()
                ));
            }
            let limits: Option<u64> = members
                .iter()
                .map(|m| {
                    self.models
                        .iter()
                        .find(|s| s.name == *m)
                        .and_then(|s| s.memory_limit)
                })
                .sum();
            if let (Some(budget), Some(sum)) = (self.memory_budget, limits)
                && sum > budget
            {
                return Err(format!(
                    "{what} lets models run together whose memory limits add up to {}, past the memory budget of {}: raise memory_budget or split it",
                    crate::units::mib(sum),
                    crate::units::mib(budget)
                ));
            }
        }
        Ok(())
    }

    /// Every duration, size and count against its allowed range, and every
    /// model spec, so nothing out of range reaches a clock or an allocation.
    pub fn check(&self) -> Result<(), String> {
        for (name, kind) in &self.workers {
            kind.check(name)?;
        }
        for (field, value) in [
            ("keep_alive", self.keep_alive),
            ("load_timeout", self.load_timeout),
            ("drain_timeout", self.drain_timeout),
            ("restart_backoff", self.restart_backoff),
            ("header_timeout", self.header_timeout),
            ("body_timeout", self.body_timeout),
            ("send_timeout", self.send_timeout),
        ] {
            check_duration(field, value)?;
        }
        if let Some(spin) = self.answer_spin
            && spin > crate::config::MAX_ANSWER_SPIN
        {
            return Err(format!(
                "answer_spin {} is out of range: 0s to 1ms",
                crate::units::format_duration(spin)
            ));
        }
        for (field, value) in [
            ("memory_budget", self.memory_budget),
            ("gpu_memory_budget", self.gpu_memory_budget),
            ("max_response", self.max_response),
        ] {
            check_bytes(field, value)?;
        }
        if let Some(b) = self.max_body
            && !(1024..=(1 << 30)).contains(&b)
        {
            return Err(format!(
                "max_body {b} bytes is out of range: 1 KiB to 1 GiB"
            ));
        }
        let max_body = self.max_body.unwrap_or(DEFAULT_MAX_BODY);
        if let Some(total) = self.max_body_total
            && !(max_body..=(64 << 30)).contains(&total)
        {
            return Err(format!(
                "max_body_total {total} bytes is out of range: max_body ({max_body}) to 64 GiB"
            ));
        }
        if let Some(n) = self.max_connections
            && !(1..=MAX_CONNECTIONS_LIMIT).contains(&n)
        {
            return Err(format!(
                "max_connections {n} is out of range: 1 to {MAX_CONNECTIONS_LIMIT}"
            ));
        }
        if let Some(n) = self.max_inputs
            && !(1..=1_000_000).contains(&n)
        {
            return Err(format!("max_inputs {n} is out of range: 1 to 1000000"));
        }
        if let Some(0) = self.max_loaded {
            return Err("max_loaded must be at least 1".into());
        }
        if let Some(n) = self.max_queue
            && !(1..=1 << 20).contains(&n)
        {
            return Err(format!("max_queue {n} is out of range: 1 to {}", 1 << 20));
        }
        if let (Some(min), Some(max)) = (self.turn.min, self.turn.max)
            && min > max
        {
            return Err(format!(
                "turn.min ({}) is longer than turn.max ({}): a model could not keep its least \
                 turn",
                crate::units::format_duration(min),
                crate::units::format_duration(max)
            ));
        }
        if let Some(n) = self.max_models
            && !(1..=1_000_000).contains(&n)
        {
            return Err(format!("max_models {n} is out of range: 1 to 1000000"));
        }
        for d in [self.header_timeout, self.body_timeout, self.send_timeout]
            .into_iter()
            .flatten()
        {
            if d.is_zero() {
                return Err(
                    "header_timeout, body_timeout and send_timeout must be above 0s".into(),
                );
            }
        }
        if let Some(token) = &self.token
            && token.trim().is_empty()
        {
            return Err("token is blank; give a real token or leave it out".into());
        }
        for model in &self.models {
            model.validate().map_err(|e| e.to_string())?;
        }
        self.check_rules()
    }

    /// How the sidecar serves, this file's values over the defaults.
    pub fn serve_options(&self, listen: Listen, token: Option<String>) -> ServeOptions {
        let mut options = ServeOptions::new(listen);
        options.token = token;
        options.max_body = self.max_body.unwrap_or(DEFAULT_MAX_BODY) as usize;
        options.max_body_total = self
            .max_body_total
            .unwrap_or(DEFAULT_MAX_BODY_TOTAL)
            .max(options.max_body as u64) as usize;
        options.body_timeout = self.body_timeout.unwrap_or(options.body_timeout);
        options.max_inputs = self.max_inputs.unwrap_or(options.max_inputs);
        options.allowed_hosts = self.allowed_hosts.clone();
        options.allowed_origins = self.allowed_origins.clone();
        options.public_metrics = self.public_metrics;
        options.connections.header_timeout = self
            .header_timeout
            .unwrap_or(options.connections.header_timeout);
        options.connections.max_connections = self
            .max_connections
            .unwrap_or(options.connections.max_connections);
        options.connections.send_timeout = self
            .send_timeout
            .unwrap_or(options.connections.send_timeout);
        options.test_backends = self.test_backends;
        options
    }

    /// The supervisor's settings, this file's values over the defaults:
    /// `worker` is the worker program and its role arguments, `models_root`
    /// where models registered over HTTP must lie.
    pub fn supervisor_config(
        &self,
        (worker_binary, worker_args): (Option<PathBuf>, Vec<String>),
        models_root: PathBuf,
    ) -> crate::config::SupervisorConfig {
        let defaults = crate::config::SupervisorConfig::default();
        crate::config::SupervisorConfig {
            worker_binary,
            worker_args,
            load_timeout: self.load_timeout.unwrap_or(defaults.load_timeout),
            drain_timeout: self.drain_timeout.unwrap_or(defaults.drain_timeout),
            default_keep_alive: Some(self.keep_alive.unwrap_or(DEFAULT_KEEP_ALIVE)),
            memory_budget: self.memory_budget,
            max_loaded: self.max_loaded,
            gpu_memory_budget: self.gpu_memory_budget,
            models_root: Some(models_root),
            restart_backoff: self.restart_backoff.unwrap_or(defaults.restart_backoff),
            workers: self.workers.clone(),
            max_response: self.max_response.unwrap_or(DEFAULT_MAX_RESPONSE),
            max_models: self.max_models.unwrap_or(defaults.max_models),
            answer_spin: self.answer_spin.unwrap_or(defaults.answer_spin),
            // Checked by `check`, which every config passes before this.
            residency: self.rules().unwrap_or_default(),
            max_queue: self.max_queue.unwrap_or(defaults.max_queue),
            turn: self.turn,
            ..defaults
        }
    }
}

/// The engine a command runs a container with, if it does.
fn engine_of(argv: &[String]) -> Option<String> {
    matches!(crate::config::RunCommand::parse(argv), Some(Ok(_))).then(|| argv[0].clone())
}

/// A TOML error said by where it is: the line, the table (a model by its
/// name) and the key, then what is wrong with its value — the toml crate
/// names the key only inside the line it quotes.
fn toml_error(text: &str, error: &toml::de::Error) -> String {
    let Some(span) = error.span().filter(|s| s.start <= text.len()) else {
        return crate::input::quote_lines(&error.to_string());
    };
    let start = (0..=span.start)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[start..].find('\n').map_or(text.len(), |i| start + i);
    let number = text[..line_start].matches('\n').count() + 1;
    let line = &text[line_start..line_end];
    let column = start - line_start;
    // The key: before the last `=` ahead of the error (after any `{` or
    // `,` of an inline table), or the span itself when it is the key.
    let key = match line[..column].rfind('=') {
        Some(eq) => {
            let before = &line[..eq];
            let from = before.rfind(['{', ',']).map_or(0, |i| i + 1);
            before[from..].trim()
        }
        None => text
            .get(span.clone())
            .map(str::trim)
            .filter(|k| !k.is_empty() && !k.contains('\n'))
            .unwrap_or(""),
    };
    // The table: the nearest header above, a model's by its name.
    let above: Vec<&str> = text[..line_start].lines().collect();
    let table = above
        .iter()
        .rposition(|l| l.trim_start().starts_with('['))
        .map(|at| {
            let header = above[at].trim();
            let header = header.split('#').next().unwrap_or(header).trim();
            let section = text[line_start..]
                .lines()
                .take_while(|l| !l.trim_start().starts_with('['));
            let name = above[at + 1..]
                .iter()
                .copied()
                .chain(section)
                .find_map(|l| {
                    let (k, v) = l.split_once('=')?;
                    (k.trim() == "name").then(|| v.trim().trim_matches(['"', '\'']).to_string())
                });
            match name {
                Some(name) if header.starts_with("[[") => format!("{header} `{name}`"),
                _ => header.to_string(),
            }
        });
    let mut place = format!("line {number}");
    if let Some(table) = table {
        place.push_str(&format!(", {}", crate::input::quote(&table)));
    }
    if !key.is_empty() {
        place.push_str(&format!(", `{}`", crate::input::quote(key)));
    }
    format!(
        "{place}: {} (the line: `{}`)",
        crate::input::quote(error.message().trim_end()),
        crate::input::quote(line.trim())
    )
}

#[cfg(test)]
mod tests;
