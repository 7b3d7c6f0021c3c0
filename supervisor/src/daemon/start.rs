//! `berth serve` from its options to serving: the files read, the state
//! file taken (stopping what a killed predecessor left), the container
//! engines swept, the models registered, and then either a fresh listener
//! or, exec'd by an in-place upgrade, the handed-over socket and workers.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::Options;
use super::files::{Texts, default_catalogue, front_door, parse_files, token_of};
use super::reload::{Applied, ReloadFn, SharedApplied, refuse_emptying};
use super::serve::{Extras, serve_on};
use super::upgrade::Takeover;
use crate::child::orphans;
use crate::server::{Listen, listen, refuse_open_door};
use crate::supervisor::Supervisor;

pub(super) async fn start(options: Options) -> Result<(), String> {
    let has_files = options.config.is_some()
        || options.llama_swap.is_some()
        || options.llama_swap_dir.is_some();
    if options.watch_config && !has_files {
        return Err(
            "--watch-config needs a config file (--config, --llama-swap or --llama-swap-dir)"
                .into(),
        );
    }
    // Exec'd by an in-place upgrade: the previous berth's workers and
    // listening socket are this one's, and so is what it served: the
    // config's texts it had applied, its state file, its catalogue. An
    // upgrade changes the binary and nothing else.
    let takeover = Takeover::from_env().transpose()?;
    // A fault for the upgrade's tests: a takeover that hangs on its way to
    // serving, in the build whose mark the variable names (its watchdog
    // then hands every worker back to the previous binary).
    if takeover.is_some()
        && std::env::var("BERTH_FAULT_TAKEOVER_HANG").is_ok_and(|m| m == crate::base::build_mark())
    {
        tracing::warn!("BERTH_FAULT_TAKEOVER_HANG: this takeover hangs, as asked");
        std::future::pending::<()>().await;
    }
    let texts = match takeover.as_ref().and_then(Takeover::files) {
        Some(texts) => texts,
        None => Texts::read(&options)?,
    };
    let (config, mut llama_swap) = parse_files(&texts)?;
    let texts_watched: Vec<std::path::PathBuf> = texts
        .llama_swap_dir
        .iter()
        .map(|(p, _)| p.clone())
        .collect();
    let listen = Listen::parse(
        options
            .listen
            .as_deref()
            .or(config.listen.as_deref())
            .unwrap_or(crate::server::DEFAULT_LISTEN),
    )?;
    let token = token_of(&options, &config)?;
    let models_root = config.models_root();
    let state_file = match takeover.as_ref().and_then(Takeover::state_file) {
        Some(state_file) => state_file,
        None => config
            .state_file
            .clone()
            .unwrap_or_else(|| default_state_file(&listen)),
    };
    // Before anything is read, written or started: this server's state
    // file must be its own.
    adopt_orphans(
        state_file.clone(),
        takeover
            .as_ref()
            .map(|t| t.worker_pids())
            .unwrap_or_default(),
    )?;
    // The previous program swept at its start; a takeover holds new
    // connections meanwhile, so it does not sweep again.
    if takeover.is_none() {
        super::reap::sweep_engines(&config.container_engines()).await;
    }
    let worker = options.worker.clone();
    let supervisor = Supervisor::new(config.supervisor_config(worker.clone(), models_root.clone()));
    // Taking workers over that run already, the kinds were checked by the
    // previous program: they are asked again once every worker is adopted
    // (`serve_on`), not while new connections wait.
    if takeover.is_none() {
        supervisor
            .check_workers()
            .map_err(|e| format!("cannot start workers: {e}"))?;
    }
    let models = match takeover.as_ref().and_then(Takeover::catalogue) {
        Some(catalogue) => catalogue,
        None if has_files => config.models.clone(),
        None => default_catalogue(&models_root)?,
    };
    for spec in models {
        let name = spec.name.clone();
        let registered = match takeover {
            Some(_) => supervisor.register_handed_over(spec),
            None => supervisor.register(spec),
        };
        registered.map_err(|e| format!("cannot register model `{name}`: {e}"))?;
    }
    listen::raise_descriptor_limit();
    let front = front_door(&config, listen.clone(), token, llama_swap.as_mut());
    refuse_open_door(&front)?;
    let mut extras = Extras {
        reload: None,
        applied: None,
        watch: Vec::new(),
        state_file: Some(state_file),
    };
    if has_files {
        let applied = Arc::new(tokio::sync::Mutex::new(Applied { config, texts }));
        extras.applied = Some(Arc::clone(&applied));
        extras.reload = Some(reloader(
            &options,
            &supervisor,
            applied,
            listen.clone(),
            worker,
        ));
        if options.watch_config {
            // A folder is watched as itself (a file added, removed or
            // saved by a rename) and as its files (one written in place).
            extras.watch = options
                .config
                .iter()
                .chain(&options.llama_swap)
                .chain(&options.llama_swap_dir)
                .cloned()
                .chain(texts_watched.iter().cloned())
                .collect();
        }
    }
    if let Some(mut takeover) = takeover {
        let bound = takeover.listener(&listen)?;
        // Accepting comes first: the workers are adopted meanwhile, and a
        // request for a model waits until its worker is.
        let adoption = takeover.begin(&supervisor);
        return serve_on(supervisor, front, extras, bound, Some(adoption)).await;
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
    let bound = listen::bind(&listen).await?;
    serve_on(supervisor, front, extras, bound, None).await
}

/// How long a reload may take to read and check the files: a disk that
/// hangs, or a config that names models to fetch, must not hold every
/// later reload for good.
const READ_BOUND: Duration = Duration::from_secs(120);

/// How the daemon reloads (`SIGHUP`, `berth reload`, `--watch-config`):
/// the files read and checked as at start, the worker kinds probed, and
/// only then the change applied over `applied`, the config in force.
fn reloader(
    options: &Options,
    supervisor: &Supervisor,
    applied: SharedApplied,
    listen: Listen,
    worker: (Option<PathBuf>, Vec<String>),
) -> ReloadFn {
    let (options, supervisor) = (options.clone(), supervisor.clone());
    Arc::new(move |ask| {
        let (options, supervisor, applied) = (options.clone(), supervisor.clone(), applied.clone());
        let (listen, worker) = (listen.clone(), worker.clone());
        Box::pin(async move {
            let mut applied = applied.lock().await;
            let read = tokio::task::spawn_blocking(move || {
                let texts = Texts::read(&options)?;
                let (config, llama_swap) = parse_files(&texts)?;
                let token = token_of(&options, &config)?;
                let new = config.supervisor_config(worker, config.models_root());
                new.check_workers()
                    .map_err(|e| format!("cannot start workers: {e}"))?;
                Ok::<_, String>(((config, token, texts), llama_swap, new))
            });
            let ((config, token, texts), mut llama_swap, new) =
                tokio::time::timeout(READ_BOUND, read)
                    .await
                    .map_err(|_| {
                        format!(
                            "reading and checking the files took over {}; nothing changed",
                            crate::units::format_duration(READ_BOUND)
                        )
                    })?
                    .map_err(|e| format!("the reload's reading of the files failed: {e}"))??;
            refuse_emptying(&applied.config, &config, ask)?;
            let options = front_door(&config, listen.clone(), token, llama_swap.as_mut());
            if !listen.is_private() && options.token.is_none() && options.api_keys.is_empty() {
                return Err(format!(
                    "the new config has no token, and berth listens on {listen}: anyone who \
                     could reach it could run models; keep a token (or restart berth on \
                     127.0.0.1)"
                ));
            }
            let (report, in_force) =
                super::reload::apply(&supervisor, &applied.config, &config, new).await;
            *applied = Applied {
                config: in_force,
                texts,
            };
            Ok((report, options))
        })
    })
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
        // Not at once: a fresh start has just stopped what the state file
        // named, and a takeover's predecessor looked a second ago.
        let every = std::time::Duration::from_secs(1);
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
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
