//! The daemon: `berth serve`'s whole life as one library call,
//! [`run`], with its options as a plain struct, so that the command line
//! only parses arguments and a test (or a host) can run a daemon itself.
//!
//! Its rooms, in the order of a daemon's life:
//! - `files.rs`: the config files read and checked (the same way at start,
//!   at each reload, and for an upgrade's check), the default models
//!   fetched where no config names any, a llama-swap file imported
//!   (`llama_swap/`) and merged; `config/` is the config file's shape;
//! - `start.rs`: from the options to serving: the state file taken, what a
//!   killed predecessor left stopped, containers of dead berths swept
//!   (`reap.rs`), the models registered, and a fresh listener or an
//!   upgrade's takeover;
//! - `serve.rs`: the serve loop, the signals, the shutdown in bounded time;
//! - `live.rs`: the front door in force and what the API may ask of the
//!   daemon (the server's `Controls`);
//! - `reload.rs`: reading the files again and applying the difference;
//!   `watch.rs`: doing so when a file changes (`--watch-config`);
//! - `upgrade/`: the in-place upgrade, from the request to the takeover;
//! - `notify.rs`: the service manager's readiness protocol.
//!
//! `docs/internals/upgrade.md` and `docs/internals/reload.md` tell the two
//! mechanisms whole.

use std::path::PathBuf;

pub mod config;
pub(crate) mod files;
mod live;
mod llama_swap;
mod notify;
mod reap;
mod reload;
mod serve;
mod start;
pub mod upgrade;
mod watch;

pub use config::ServeConfig;
pub use reap::{reap, sweep_engines};

/// How `berth serve` runs: what its command line says.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// A TOML config (docs/configuration.md); without one (and without a
    /// llama-swap file), the default models are served, fetched by package
    /// name where missing.
    pub config: Option<PathBuf>,
    /// `127.0.0.1:7733`, `0.0.0.0:7733` (needs a token) or `unix:/path`,
    /// over the config's `listen`.
    pub listen: Option<String>,
    /// The bearer token clients must send, over the config's.
    pub token: Option<String>,
    /// The worker program and the arguments before its own (`berth worker`
    /// for this executable in its worker role); `None` for the default.
    pub worker: (Option<PathBuf>, Vec<String>),
    /// A llama-swap `config.yaml` whose models are served beside the
    /// config's.
    pub llama_swap: Option<PathBuf>,
    /// A folder of llama-swap files (llama-swap's `-config-dir`): its
    /// `.yml`/`.yaml` files merged after `llama_swap`'s, in name order.
    pub llama_swap_dir: Option<PathBuf>,
    /// Reload when a config file changes, as `SIGHUP` does.
    pub watch_config: bool,
}

/// Runs the daemon until it is told to stop, then stops every worker;
/// `Err` says why it could not start (or serve on). Exec'd by an in-place
/// upgrade and unable to serve, it execs the previous binary, which takes
/// every worker back; that returns only if it cannot.
pub async fn run(options: Options) -> Result<(), String> {
    let upgrading = upgrade::is_upgrade();
    upgrade::watchdog(upgrade::serve_within());
    match start::start(options).await {
        Ok(()) => Ok(()),
        Err(message) if upgrading => {
            eprintln!("berth: the upgraded binary cannot serve: {message}; going back");
            let why = upgrade::fall_back(&message).await;
            Err(format!("{message}; {why}"))
        }
        Err(message) => Err(message),
    }
}

/// What `berth serve --upgrade-check` answers: the files read and checked
/// as [`run`] would, and which handover states this binary adopts.
pub fn check(options: &Options) -> Result<upgrade::CheckAnswer, String> {
    files::read_files(options)?;
    Ok(upgrade::CheckAnswer::mine())
}

/// Until the daemon's own handlers are in (a moment after start, and after
/// each in-place upgrade's exec, which resets them to their defaults),
/// SIGHUP and SIGUSR2 would end berth and every model with it: called
/// before anything else, it makes them wait. A fresh start ignores them
/// meanwhile; a program exec'd by an upgrade finds them blocked already
/// (the old one blocked them right before its exec, and a mask survives
/// it), so one sent across the exec is held, not lost, and handled once
/// the handlers are in. Workers start with both at their defaults and
/// unblocked.
pub fn hold_reload_signals() {
    if upgrade::is_upgrade() {
        return;
    }
    // SAFETY: setting a signal's disposition to SIG_IGN is always sound.
    unsafe {
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
        libc::signal(libc::SIGUSR2, libc::SIG_IGN);
    }
}
