//! `berth serve`: the sidecar daemon.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use berth::fetch::{DEFAULT_MODELS, fetch};
use berth::orphans;
use berth::server::config::{DEFAULT_LISTEN, ServeConfig};
use berth::server::{Listen, serve};
use berth::{ModelSpec, Supervisor};
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// A TOML config (see docs/configuration.md); without one, the default models are
    /// served (fetched by package name if missing).
    #[arg(long, short = 'c')]
    config: Option<PathBuf>,
    /// `127.0.0.1:7733` (default), `0.0.0.0:7733` (needs a token) or `unix:/path`.
    #[arg(long)]
    listen: Option<String>,
    /// Bearer token clients must send; overrides the config's.
    #[arg(long, env = "BERTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The worker program (default: this executable, as `berth worker`).
    #[arg(long, env = "BERTH_WORKER")]
    worker: Option<PathBuf>,
    /// A llama-swap `config.yaml`: its models are served as HTTP-server
    /// models beside the config's (docs/upstream.md says what maps, and
    /// berth says at start what it ignores).
    #[arg(long, value_name = "CONFIG_YAML")]
    llama_swap: Option<PathBuf>,
    /// Reload the config when its file (or the llama-swap file) changes,
    /// as `SIGHUP` and `berth reload` do.
    #[arg(long)]
    watch_config: bool,
    /// Check that this binary could take over from a running berth started
    /// with the same arguments (an in-place upgrade asks it first), print
    /// what it reads, and exit.
    #[arg(long = "upgrade-check", hide = true)]
    upgrade_check: bool,
}

pub async fn run(args: ServeArgs) -> ExitCode {
    if args.upgrade_check {
        return match read_files(&args) {
            Ok(_) => {
                let answer = berth::upgrade::CheckAnswer::mine();
                println!("{}", serde_json::to_string(&answer).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(message) => super::fail("upgrade_check_failed", &message, false),
        };
    }
    let upgrading = berth::upgrade::is_upgrade();
    match start(args).await {
        Ok(()) => ExitCode::SUCCESS,
        // Exec'd by an in-place upgrade and unable to serve: the previous
        // binary takes every worker back (this returns only if it cannot).
        Err(message) if upgrading => {
            eprintln!("berth: the upgraded binary cannot serve: {message}; going back");
            let why = berth::upgrade::fall_back(&message).await;
            super::fail("serve_failed", &format!("{message}; {why}"), false)
        }
        Err(message) => super::fail("serve_failed", &message, false),
    }
}

/// The config files read and checked, as at start and at each reload: the
/// config (the defaults without one), with a llama-swap file's models and
/// kinds merged in, and that file's API layer.
fn read_files(
    args: &ServeArgs,
) -> Result<(ServeConfig, Option<berth::server::llama_swap::Migrated>), String> {
    let mut config = match &args.config {
        Some(path) => {
            let config = ServeConfig::read(path)?;
            fetch_named_defaults(&config.models, &config.models_root())?;
            config
                .check()
                .map_err(|e| format!("`{}`: {e}", path.display()))?;
            config
        }
        None => ServeConfig::default(),
    };
    let llama_swap = match &args.llama_swap {
        Some(path) => Some(add_llama_swap(&mut config, path)?),
        None => None,
    };
    Ok((config, llama_swap))
}

/// The token: the command line's (or `BERTH_TOKEN`) over the config's.
fn token_of(args: &ServeArgs, config: &ServeConfig) -> Result<Option<String>, String> {
    match args.token.clone().or(config.token.clone()) {
        Some(t) if t.trim().is_empty() => {
            Err("the token is blank; give a real token or none".into())
        }
        token => Ok(token),
    }
}

/// The front door's options from a config: its limits and tokens, and a
/// llama-swap file's keys and API layer.
fn front_door(
    config: &ServeConfig,
    listen: Listen,
    token: Option<String>,
    llama_swap: Option<&mut berth::server::llama_swap::Migrated>,
) -> berth::server::ServeOptions {
    let mut options = config.serve_options(listen, token);
    if let Some(migrated) = llama_swap {
        options.api_keys = std::mem::take(&mut migrated.api_keys);
        options.llama_swap = Some(std::sync::Arc::new(std::mem::take(&mut migrated.compat)));
    }
    options
}

async fn start(args: ServeArgs) -> Result<(), String> {
    let has_files = args.config.is_some() || args.llama_swap.is_some();
    if args.watch_config && !has_files {
        return Err("--watch-config needs a config file (--config or --llama-swap)".into());
    }
    let (config, mut llama_swap) = read_files(&args)?;
    let listen = Listen::parse(
        args.listen
            .as_deref()
            .or(config.listen.as_deref())
            .unwrap_or(DEFAULT_LISTEN),
    )?;
    let token = token_of(&args, &config)?;
    let models_root = config.models_root();
    // Exec'd by an in-place upgrade: the previous berth's workers and
    // listening socket are this one's.
    let takeover = berth::upgrade::Takeover::from_env().transpose()?;
    let state_file = config
        .state_file
        .clone()
        .unwrap_or_else(|| default_state_file(&listen));
    // Before anything is read, written or started: this server's state
    // file must be its own.
    adopt_orphans(
        state_file.clone(),
        takeover
            .as_ref()
            .map(|t| t.worker_pids())
            .unwrap_or_default(),
    )?;
    super::reap::sweep_engines(&config.container_engines()).await;
    let worker = super::default_worker(args.worker.clone());
    let supervisor = Supervisor::new(config.supervisor_config(worker.clone(), models_root.clone()));
    match supervisor.check_workers() {
        Ok(()) => {}
        // Taking workers over that run already: the next start of a kind
        // that cannot start says so, as a load.
        Err(e) if takeover.is_some() => {
            tracing::warn!("a worker kind cannot start workers: {e}");
        }
        Err(e) => return Err(format!("cannot start workers: {e}")),
    }
    let models = if has_files {
        config.models.clone()
    } else {
        default_catalogue(&models_root)?
    };
    for spec in models {
        let name = spec.name.clone();
        supervisor
            .register(spec)
            .map_err(|e| format!("cannot register model `{name}`: {e}"))?;
    }
    berth::server::listen::raise_descriptor_limit();
    let mut options = front_door(&config, listen.clone(), token, llama_swap.as_mut());
    options.state_file = Some(state_file);
    berth::server::refuse_open_door(&options)?;
    if has_files {
        options.reload = Some(reloader(&args, &supervisor, config, listen.clone(), worker));
        if args.watch_config {
            options.watch_config = args
                .config
                .iter()
                .chain(&args.llama_swap)
                .cloned()
                .collect();
        }
    }
    if let Some(mut takeover) = takeover {
        let bound = takeover.listener(&listen)?;
        let upgraded = takeover_into(takeover, &supervisor);
        return berth::server::serve_on(supervisor, options, bound, Some(upgraded)).await;
    }
    if let Some(migrated) = llama_swap {
        // `hooks.on_startup.preload`: one after another, in the
        // background, as llama-swap does.
        let preloader = supervisor.clone();
        tokio::spawn(async move {
            for model in migrated.preload {
                match preloader.ensure_loaded(&model).await {
                    Ok(_) => tracing::info!(model, "preloaded (hooks.on_startup.preload)"),
                    Err(e) => tracing::warn!(model, "preload failed: {e}"),
                }
            }
        });
    }
    serve(supervisor, options).await
}

/// How the daemon reloads (`SIGHUP`, `berth reload`, `--watch-config`):
/// the files read and checked as at start, the worker kinds probed, and
/// only then the change applied over `applied`, the config in force.
fn reloader(
    args: &ServeArgs,
    supervisor: &Supervisor,
    applied: ServeConfig,
    listen: Listen,
    worker: (Option<PathBuf>, Vec<String>),
) -> berth::server::reload::ReloadFn {
    let applied = std::sync::Arc::new(tokio::sync::Mutex::new(applied));
    let (args, supervisor) = (args.clone(), supervisor.clone());
    std::sync::Arc::new(move || {
        let (args, supervisor, applied) = (args.clone(), supervisor.clone(), applied.clone());
        let (listen, worker) = (listen.clone(), worker.clone());
        Box::pin(async move {
            let mut applied = applied.lock().await;
            let (config, mut llama_swap, new) = tokio::task::spawn_blocking(move || {
                let (config, llama_swap) = read_files(&args)?;
                let token = token_of(&args, &config)?;
                let new = config.supervisor_config(worker, config.models_root());
                new.check_workers()
                    .map_err(|e| format!("cannot start workers: {e}"))?;
                Ok::<_, String>(((config, token), llama_swap, new))
            })
            .await
            .map_err(|e| format!("the reload's reading of the files failed: {e}"))??;
            let (config, token) = config;
            let options = front_door(&config, listen.clone(), token, llama_swap.as_mut());
            if !listen.is_private() && options.token.is_none() && options.api_keys.is_empty() {
                return Err(format!(
                    "the new config has no token, and berth listens on {listen}: anyone who \
                     could reach it could run models; keep a token (or restart berth on \
                     127.0.0.1)"
                ));
            }
            let report = berth::server::reload::apply(&supervisor, &applied, &config, new).await;
            *applied = config;
            Ok((report, options))
        })
    })
}

/// Adopts the workers an in-place upgrade handed over (those it cannot are
/// stopped and named in the event returned).
fn takeover_into(takeover: berth::upgrade::Takeover, supervisor: &Supervisor) -> berth::EventKind {
    let event = takeover.adopt(supervisor);
    if let berth::EventKind::Upgraded {
        from,
        to,
        adopted,
        lost,
        ..
    } = &event
    {
        eprintln!(
            "berth: upgraded in place from {from} to {to}: {} workers kept, {} lost",
            adopted.len(),
            lost.len()
        );
        for line in lost {
            eprintln!("berth: not kept: {line}");
        }
    }
    event
}

/// Reaps what workers fork, and stops what a killed predecessor left (but
/// `keep`: the workers an in-place upgrade hands over).
fn adopt_orphans(state_file: PathBuf, keep: Vec<u32>) -> Result<(), String> {
    if let Err(e) = orphans::become_subreaper() {
        tracing::warn!("cannot become a child subreaper ({e}); orphans of workers go to init");
    }
    let stopped = orphans::use_state_file_keeping(&state_file, &keep)?;
    if stopped > 0 {
        eprintln!(
            "berth: stopped {stopped} processes left by a previous supervisor ({})",
            state_file.display()
        );
    }
    tokio::spawn(async {
        let mut ticker = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            ticker.tick().await;
            orphans::reap_strays(orphans::Strays::All);
        }
    });
    Ok(())
}

fn default_state_file(listen: &Listen) -> PathBuf {
    let name: String = listen
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/berth/run")
        .join(format!("serve-{name}.json"))
}

/// Fetches the default models whose folders the config's models name
/// (`model = "all-MiniLM-L6-v2"`) and that are missing, as a plain
/// `berth serve` does.
fn fetch_named_defaults(models: &[ModelSpec], dir: &std::path::Path) -> Result<(), String> {
    for model in DEFAULT_MODELS {
        let folder = dir.join(model.folder);
        let Some(spec) = models
            .iter()
            .find(|s| s.model.as_ref().is_some_and(|p| p.starts_with(&folder)))
        else {
            continue;
        };
        // Checked (every file's digest) once per default model, however
        // many specs name it.
        if !model.is_present(dir) {
            fetch(model, dir, &mut |line: &str| eprintln!("berth: {line}")).map_err(|e| {
                format!(
                    "model `{}`: cannot fetch default model `{}` into `{}`: {e}",
                    spec.name,
                    model.name,
                    dir.display()
                )
            })?;
        }
    }
    Ok(())
}

/// The default models, fetched first where missing.
fn default_catalogue(dir: &std::path::Path) -> Result<Vec<ModelSpec>, String> {
    let terminal = std::io::stderr().is_terminal();
    let mut specs = Vec::new();
    for model in DEFAULT_MODELS {
        let mut say = |line: &str| {
            if terminal || !model.is_present(dir) {
                eprintln!("berth: {line}");
            }
        };
        let path = fetch(model, dir, &mut say)
            .map_err(|e| format!("cannot fetch default model `{}`: {e}", model.name))?;
        let mut spec = ModelSpec::new(model.name, model.backend).model(path);
        // A cap, so no request (thousands of texts, a runaway context) can
        // take the host's memory: several times each model's measured peak.
        spec.memory_limit = Some(model.memory_limit);
        specs.push(spec);
    }
    Ok(specs)
}

/// Adds the models and rules of a llama-swap `config.yaml` to `config`,
/// saying what of it berth does not honour; returns the rest of it.
fn add_llama_swap(
    config: &mut ServeConfig,
    path: &std::path::Path,
) -> Result<berth::server::llama_swap::Migrated, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    let mut migrated = berth::server::llama_swap::migrate(&text, &|name| std::env::var(name).ok())
        .map_err(|e| {
            format!(
                "`{}` is not a llama-swap config berth can read: {e}",
                path.display()
            )
        })?;
    for note in &migrated.notes {
        eprintln!("berth: llama-swap config {}: {note}", path.display());
    }
    for (name, kind) in std::mem::take(&mut migrated.workers) {
        if config.workers.contains_key(&name) {
            return Err(format!(
                "worker kind `{name}` is declared in the config and made from `{}`; rename one",
                path.display()
            ));
        }
        config.workers.insert(name, kind);
    }
    for model in std::mem::take(&mut migrated.models) {
        if config.models.iter().any(|m| m.name == model.name) {
            return Err(format!(
                "model `{}` is in the config and in `{}`; rename one",
                model.name,
                path.display()
            ));
        }
        config.models.push(model);
    }
    let residency = std::mem::take(&mut migrated.residency);
    if !residency.groups.is_empty() && (!config.groups.is_empty() || config.matrix.is_some())
        || residency.matrix.is_some() && (!config.groups.is_empty() || config.matrix.is_some())
    {
        return Err(format!(
            "the config has `groups` or a `matrix`, and so does `{}`; keep one",
            path.display()
        ));
    }
    config.groups.extend(residency.groups);
    if residency.matrix.is_some() {
        config.matrix = residency.matrix;
    }
    config
        .check()
        .map_err(|e| format!("`{}`: {e}", path.display()))?;
    Ok(migrated)
}
