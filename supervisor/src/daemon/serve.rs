//! The daemon's life: bind (or take over a handed-over socket), serve
//! until a signal, hand over to a new binary when an upgrade asks (and
//! serve on if it is called off), and shut down in bounded time.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;

use std::path::PathBuf;

use super::live::Live;
use super::notify;
use super::reload::{Ask, ReloadFn, SharedApplied};
use super::upgrade::{self, Upgrades};
use crate::server::{ServeOptions, listen, refuse_open_door};
use crate::supervisor::EventKind;
use crate::supervisor::Supervisor;

/// What the daemon serves with besides the front door's options.
pub(crate) struct Extras {
    /// How to read the config again and apply it (`SIGHUP`, `POST
    /// /api/reload`); without it, there is nothing to reload.
    pub reload: Option<ReloadFn>,
    /// The config in force and its texts (with a config file), which an
    /// upgrade hands over.
    pub applied: Option<SharedApplied>,
    /// Files whose change reloads the config (`--watch-config`).
    pub watch: Vec<PathBuf>,
    /// The server's state file: `berth upgrade --binary` leaves its
    /// request beside it.
    pub state_file: Option<PathBuf>,
}

/// Serves on `bound` (bound now, or the socket an in-place upgrade handed
/// over, with the workers it handed over: `adoption`, adopted while this
/// serves) until
/// SIGTERM or SIGINT, then shuts down in bounded time:
/// - new connections are no longer accepted, and open ones are told to close
///   after their current request;
/// - every model drains for at most `drain_timeout`, then its worker is
///   stopped (Shutdown, SIGTERM, SIGKILL, as an unload does), which fails
///   whatever was still in flight, so no request can hold the exit;
/// - connections get a last moment to deliver those answers, and whatever
///   is still open then (a half-sent request, a client not reading) is
///   dropped.
///
/// A second signal stops at once: every worker's group is killed and the
/// process exits with status 130.
pub(crate) async fn serve_on(
    supervisor: Supervisor,
    options: ServeOptions,
    extras: Extras,
    bound: listen::Bound,
    adoption: Option<upgrade::Adoption>,
) -> Result<(), String> {
    refuse_open_door(&options)?;
    let (upgrades, mut checked) = Upgrades::new(supervisor.clone());
    // The front door, replaced whole by a reload; each request takes the
    // one current when it comes.
    let (app_tx, app) = tokio::sync::watch::channel(Router::new());
    let live = Live::new(
        extras.reload,
        app_tx,
        supervisor.clone(),
        upgrades,
        &options,
    );
    let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
    // What an upgrade hands over besides the workers.
    let served = upgrade::Served {
        applied: extras.applied.clone(),
        state_file: extras.state_file.clone(),
    };
    tokio::spawn(signals(stop_tx, Arc::clone(&live), extras.state_file));
    if live.reloads() && !extras.watch.is_empty() {
        tokio::spawn(super::watch::watch_files(
            Arc::downgrade(&live),
            extras.watch,
        ));
    }
    tokio::spawn(crate::heap::run_heap_trimmer());
    tracing::info!("berth serve listening on {}", options.listen);
    if adoption.is_none() {
        supervisor.emit(EventKind::ServerStarted {
            listen: options.listen.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        });
        eprintln!("berth: listening on {}", options.listen);
    }
    notify::notify(&format!(
        "READY=1\nSTATUS=listening on {}\nMAINPID={}",
        options.listen,
        std::process::id()
    ));
    tokio::spawn(notify::watchdog());
    upgrade::serving();
    if let Some(adoption) = adoption {
        // Off the async threads, while the accept loop below runs.
        let adopter = supervisor.clone();
        tokio::task::spawn_blocking(move || {
            let upgraded = adoption.run(&adopter);
            say_upgraded(&upgraded);
            adopter.emit(upgraded);
            // The worker kinds, asked only now: a Python kind's answer
            // starts an interpreter, which on a small machine took the
            // CPU from the adoption and the first requests. A kind that
            // cannot start says so here and at its next load.
            if let Err(e) = adopter.check_workers() {
                tracing::warn!("a worker kind cannot start workers: {e}");
            }
        });
    }
    let closing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let connections = listen::Connections::new(options.connections.max_connections);
    loop {
        // Until a shutdown, or an upgrade whose binary passed its check.
        let (pause_tx, pause) = tokio::sync::watch::channel(false);
        let listening = listen::serve(
            &bound,
            app.clone(),
            options.connections,
            &closing,
            pause,
            &connections,
        );
        tokio::pin!(listening);
        // The accept loop ends only once paused; were it to end sooner,
        // that ends the serving too.
        let checked = tokio::select! {
            _ = stop.wait_for(|s| *s) => None,
            Some(checked) = checked.recv() => Some(checked),
            () = &mut listening => None,
        };
        let Some(checked) = checked else {
            let _ = pause_tx.send(true);
            listening.await;
            break;
        };
        // An upgrade. First, still accepting: answers say `Connection:
        // close`, event streams end, and the connections open now are
        // waited for; the new ones each serve one request. Past the wait,
        // the upgrade is called off without new connections ever having
        // waited.
        supervisor.handing_over(true);
        closing.store(true, std::sync::atomic::Ordering::SeqCst);
        let older = connections.new_epoch();
        let mut paused_at_unix_ms = crate::base::unix_ms();
        let wait = supervisor.config().drain_timeout;
        let drained = tokio::select! {
            drained = connections.wait_closed_before(older, wait) => drained,
            _ = stop.wait_for(|s| *s) => false,
            () = &mut listening => false,
        };
        let called_off = if *stop.borrow() {
            Some("berth was asked to stop".to_string())
        } else if !drained {
            Some(format!(
                "{} connections were still open after {} (a long answer streaming?); nothing \
                 changed: ask again when they are done",
                connections.open_before(older),
                crate::units::format_duration(wait)
            ))
        } else {
            // What need not run while new connections wait runs first;
            // then accepting stops (new connections wait in the backlog
            // for the new binary), and the last one-request connections
            // finish.
            upgrade::quiesce(&supervisor).await;
            let _ = pause_tx.send(true);
            paused_at_unix_ms = crate::base::unix_ms();
            listening.await;
            let last = upgrade::last_requests(options.connections.header_timeout);
            if connections.wait_closed(last).await {
                None
            } else {
                Some(format!(
                    "{} connections opened during the handover were still open after {} (a \
                     stream begun meanwhile?); nothing changed: ask again",
                    connections.open(),
                    crate::units::format_duration(last)
                ))
            }
        };
        // Returns only when the upgrade was called off: serve on.
        upgrade::hand_over(
            &supervisor,
            &bound,
            &checked,
            &stop,
            &served,
            called_off,
            paused_at_unix_ms,
        )
        .await;
        live.upgrades.called_off();
        closing.store(false, std::sync::atomic::Ordering::SeqCst);
        if *stop.borrow() {
            break;
        }
    }
    drop(bound);
    supervisor.emit(EventKind::ServerDraining);
    notify::notify(&format!(
        "STOPPING=1\nSTATUS=draining requests (at most {}), then stopping every worker",
        crate::units::format_duration(supervisor.config().drain_timeout)
    ));
    eprintln!(
        "berth: shutting down: draining requests (at most {}), then stopping every worker",
        crate::units::format_duration(supervisor.config().drain_timeout)
    );
    // Each report is logged by the supervisor as the unload ends.
    for failed in supervisor
        .shutdown()
        .await
        .into_iter()
        .filter_map(Result::err)
    {
        eprintln!("berth: {failed}");
    }
    supervisor.emit(EventKind::ServerStopped);
    // What workers left behind that was adopted by this subreaper.
    let adopted = crate::child::orphans::kill_adopted();
    if adopted > 0 {
        eprintln!("berth: stopped {adopted} processes workers had left behind");
    }
    if !connections.wait_closed(Duration::from_secs(2)).await {
        eprintln!(
            "berth: closing {} connections that did not finish",
            connections.open()
        );
    }
    Ok(())
}

/// Says on stderr what an in-place upgrade kept and lost.
fn say_upgraded(event: &EventKind) {
    if let EventKind::Upgraded {
        from,
        to,
        adopted,
        lost,
        ..
    } = event
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
}

/// The first SIGTERM or SIGINT starts the shutdown; a second one kills every
/// worker's group and exits at once. SIGHUP reloads the config; SIGUSR2
/// upgrades in place (to the binary a request file beside the state file
/// names, else to the one berth was started from).
async fn signals(
    stop: tokio::sync::watch::Sender<bool>,
    live: Arc<Live>,
    state_file: Option<PathBuf>,
) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int), Ok(mut hup), Ok(mut usr2)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
        signal(SignalKind::user_defined2()),
    ) else {
        tracing::error!(
            "cannot install the SIGTERM/SIGINT/SIGHUP/SIGUSR2 handlers; stop berth with SIGKILL"
        );
        // Keep the sender: dropping it would read as a stop.
        std::future::pending::<()>().await;
        return;
    };
    // The handlers are in: what an upgrade's exec held (see
    // `daemon::hold_reload_signals`) is delivered now, to this thread.
    crate::child::spawn::hold_reload_signals(false);
    // SIGHUP reloads the config (its default action would end berth and
    // every model with it), at any time, draining included.
    let reloads = Arc::clone(&live);
    tokio::spawn(async move {
        let live = reloads;
        while hup.recv().await.is_some() {
            if live.reloads() {
                let live = Arc::clone(&live);
                tokio::spawn(async move { live.reload("SIGHUP", Ask::default()).await });
            } else {
                tracing::warn!("SIGHUP: no config file to reload; nothing changed");
            }
        }
    });
    // SIGUSR2 upgrades in place (its default action would end berth).
    tokio::spawn(async move {
        while usr2.recv().await.is_some() {
            // Off the async threads: it opens and reads a file.
            let requested = match state_file.clone() {
                Some(state) => {
                    tokio::task::spawn_blocking(move || upgrade::requested_binary(&state))
                        .await
                        .unwrap_or_else(|e| Err(format!("reading the request file failed: {e}")))
                }
                None => Ok(None),
            };
            let binary = match requested {
                Err(e) => {
                    live.upgrades.refuse(&e);
                    continue;
                }
                Ok(binary) => binary,
            };
            let upgrades = live.upgrades.clone();
            tokio::spawn(async move { upgrades.request("SIGUSR2", binary).await });
        }
    });
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    let _ = stop.send(true);
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    let killed = crate::child::orphans::kill_all_now();
    eprintln!("berth: second signal: killed {killed} workers' process groups; exiting now");
    std::process::exit(130);
}
