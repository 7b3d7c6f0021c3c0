//! The daemon's live state, as the API and the signals reach it: the front
//! door in force (replaced whole by a reload), reloads one at a time, and
//! upgrade requests handed to the serve loop. It answers the server's
//! [`Controls`], so the HTTP layer asks for a reload or an upgrade without
//! knowing the daemon.

use std::sync::{Arc, Weak};

use axum::Router;
use futures_util::future::BoxFuture;
use tokio::sync::watch;

use super::notify::{monotonic_usec, notify};
use super::reload::{Ask, ReloadFn};
use super::upgrade::Upgrades;
use crate::report::ReloadReport;
use crate::server::{Controls, ServeOptions, UpgradeAccepted, router};
use crate::supervisor::EventKind;
use crate::supervisor::Supervisor;

pub(crate) struct Live {
    /// How to read the files again; `None` without a config file.
    reload: Option<ReloadFn>,
    app: watch::Sender<Router>,
    supervisor: Supervisor,
    pub(crate) upgrades: Upgrades,
    one_at_a_time: tokio::sync::Mutex<()>,
    /// Itself, for the front doors it builds (whose handle is weak: the
    /// daemon holds the strong one).
    me: Weak<Live>,
}

impl Live {
    /// The daemon's live state, serving `options` through `app` from now.
    pub(crate) fn new(
        reload: Option<ReloadFn>,
        app: watch::Sender<Router>,
        supervisor: Supervisor,
        upgrades: Upgrades,
        options: &ServeOptions,
    ) -> Arc<Live> {
        let live = Arc::new_cyclic(|me| Live {
            reload,
            app,
            supervisor,
            upgrades,
            one_at_a_time: tokio::sync::Mutex::new(()),
            me: me.clone(),
        });
        live.serve(options);
        live
    }

    /// Whether there is a config to read again.
    pub(crate) fn reloads(&self) -> bool {
        self.reload.is_some()
    }

    /// The front door for `options`, from the next request on.
    fn serve(&self, options: &ServeOptions) {
        let controls: Weak<dyn Controls> = self.me.clone();
        let _ = self
            .app
            .send_replace(router(self.supervisor.clone(), options, Some(controls)));
    }

    /// Reads the files again and applies them; `trigger` says what asked
    /// (`SIGHUP`, `POST /api/reload`, a file's change).
    pub(crate) async fn reload(&self, trigger: &str, ask: Ask) -> Result<ReloadReport, String> {
        let Some(reload) = &self.reload else {
            return Err("there is no config file to reload".into());
        };
        let _one = self.one_at_a_time.lock().await;
        // The service manager is told a reload runs, then that it is over
        // (systemd's `Type=notify-reload` waits for both).
        notify(&format!(
            "RELOADING=1\nMONOTONIC_USEC={}\nSTATUS=reloading the config ({trigger})",
            monotonic_usec()
        ));
        let reloaded = reload(ask).await;
        if let Ok((_, options)) = &reloaded {
            self.serve(options);
        }
        // Once the new front door serves.
        notify("READY=1\nSTATUS=serving");
        match reloaded {
            Ok((report, _)) => {
                tracing::info!(trigger, "{report}");
                self.supervisor.emit(EventKind::ConfigReloaded {
                    trigger: trigger.to_string(),
                    report: Box::new(report.clone()),
                });
                Ok(report)
            }
            Err(why) => {
                tracing::error!(
                    trigger,
                    "the config was not reloaded, nothing changed: {why}"
                );
                self.supervisor.emit(EventKind::ConfigRejected {
                    trigger: trigger.to_string(),
                    error: why.clone(),
                });
                Err(why)
            }
        }
    }
}

impl Controls for Live {
    fn reload(
        &self,
        trigger: &'static str,
        allow_empty: bool,
    ) -> BoxFuture<'_, Option<Result<ReloadReport, String>>> {
        Box::pin(async move {
            if !self.reloads() {
                return None;
            }
            Some(Live::reload(self, trigger, Ask { allow_empty }).await)
        })
    }

    fn upgrade(&self, trigger: &'static str) -> BoxFuture<'_, Result<UpgradeAccepted, String>> {
        Box::pin(async move {
            let answer = self.upgrades.request(trigger, None).await?;
            Ok(UpgradeAccepted {
                to: format!("{} ({})", answer.version, answer.build),
            })
        })
    }

    fn handover_versions(&self) -> &'static [u32] {
        super::upgrade::READS
    }
}
