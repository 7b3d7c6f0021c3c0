//! Reloading the configuration in place (`SIGHUP`, `berth reload`,
//! `POST /api/reload`, `berth serve --watch-config`): the new files are read
//! and checked first, and one that fails changes nothing and says why.
//! Then models added are registered, removed ones unloaded and
//! deregistered, changed ones swapped (make-before-break: the old worker
//! serves until the new one is ready), unchanged ones left as they are;
//! the settings that can change live do (the supervisor's from its next
//! use of each, the HTTP front door's from the next request), and those
//! that cannot are named. One event and one log line say what changed.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};

use crate::server::config::ServeConfig;
use crate::server::{ServeOptions, router};
use crate::{Supervisor, SupervisorConfig};

/// Reads the files again and applies them (the daemon's own, from
/// `berth serve`): the report and the front door's new options.
pub type ReloadFn =
    Arc<dyn Fn() -> BoxFuture<'static, Result<(ReloadReport, ServeOptions), String>> + Send + Sync>;

/// What a reload changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadReport {
    /// Models registered.
    pub added: Vec<String>,
    /// Models unloaded (if loaded) and deregistered.
    pub removed: Vec<String>,
    /// Models whose spec or worker kind changed: swapped if loaded, their
    /// spec replaced if not.
    pub changed: Vec<String>,
    /// Models left as they were.
    pub unchanged: Vec<String>,
    /// Settings that changed and apply now.
    pub settings: Vec<String>,
    /// Settings that changed but apply only at a restart of berth.
    pub restart_needed: Vec<String>,
    /// `model: why` for each model a step failed for (a changed model
    /// whose swap failed keeps its old worker and spec).
    pub failed: Vec<String>,
}

impl std::fmt::Display for ReloadReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |v: &[String]| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.join(", ")
            }
        };
        write!(
            f,
            "config reloaded: added {}; removed {}; changed {}; {} unchanged; settings {}",
            list(&self.added),
            list(&self.removed),
            list(&self.changed),
            self.unchanged.len(),
            list(&self.settings)
        )?;
        if !self.restart_needed.is_empty() {
            write!(
                f,
                "; changed but applied only at a restart: {}",
                self.restart_needed.join(", ")
            )?;
        }
        if !self.failed.is_empty() {
            write!(f, "; FAILED: {}", self.failed.join("; "))?;
        }
        Ok(())
    }
}

/// The settings a reload applies live, and those it names: the file's
/// keys, compared by value.
fn settings(old: &ServeConfig, new: &ServeConfig) -> (Vec<String>, Vec<String>) {
    let mut live = Vec::new();
    let mut restart = Vec::new();
    macro_rules! compare {
        ($list:ident: $($key:ident),*) => {
            $(if format!("{:?}", old.$key) != format!("{:?}", new.$key) {
                $list.push(stringify!($key).to_string());
            })*
        };
    }
    compare!(live: memory_budget, max_loaded, gpu_memory_budget, keep_alive, models_dir,
        load_timeout, drain_timeout, restart_backoff, answer_spin, max_response, max_models,
        groups, matrix, token, max_body, max_body_total, allowed_hosts, allowed_origins,
        public_metrics, body_timeout, max_inputs, test_backends);
    compare!(restart: listen, state_file, max_connections, header_timeout, send_timeout);
    let kinds: Vec<String> = old
        .workers
        .keys()
        .chain(new.workers.keys())
        .filter(|k| old.workers.get(*k) != new.workers.get(*k))
        .cloned()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|k| format!("workers.{k}"))
        .collect();
    live.extend(kinds);
    (live, restart)
}

/// Which models a reload adds, removes, changes and keeps: a model is
/// changed when its spec is, or the worker kind it names is.
fn models(old: &ServeConfig, new: &ServeConfig) -> ReloadReport {
    let mut report = ReloadReport::default();
    let kind_changed = |kind: &Option<String>| {
        kind.as_ref()
            .is_some_and(|k| old.workers.get(k) != new.workers.get(k))
    };
    for spec in &new.models {
        match old.models.iter().find(|m| m.name == spec.name) {
            None => report.added.push(spec.name.clone()),
            Some(was) if was != spec || kind_changed(&spec.worker) => {
                report.changed.push(spec.name.clone())
            }
            Some(_) => report.unchanged.push(spec.name.clone()),
        }
    }
    for spec in &old.models {
        if !new.models.iter().any(|m| m.name == spec.name) {
            report.removed.push(spec.name.clone());
        }
    }
    report
}

/// Applies `new` (already read and checked) over `old`: the supervisor's
/// settings and worker kinds first (an added model may name a new kind),
/// then the removed models, the added, the changed (one swap at a time,
/// each make-before-break), and last the preloaded interpreters of the
/// kinds that changed, once nothing forked from them is left.
pub async fn apply(
    supervisor: &Supervisor,
    old: &ServeConfig,
    new: &ServeConfig,
    config: SupervisorConfig,
) -> ReloadReport {
    let mut report = models(old, new);
    (report.settings, report.restart_needed) = settings(old, new);
    let retired = supervisor.replace_config(config).await;
    let spec_of = |name: &str| new.models.iter().find(|m| m.name == name).cloned();
    for name in &report.removed {
        if let Err(e) = supervisor.deregister(name).await {
            report.failed.push(format!("{name}: {e}"));
        }
    }
    for name in &report.added {
        let spec = spec_of(name).expect("an added model is in the new config");
        if let Err(e) = supervisor.register(spec) {
            report.failed.push(format!("{name}: {e}"));
        }
    }
    for name in &report.changed {
        let spec = spec_of(name).expect("a changed model is in the new config");
        if let Err(e) = supervisor.swap(spec).await {
            report.failed.push(format!("{name}: {e}"));
        }
    }
    for preloader in retired {
        preloader.stop().await;
    }
    report
}

/// The daemon's reloads: one at a time, each ending with the front door
/// rebuilt from the new options.
pub(crate) struct Live {
    reload: ReloadFn,
    app: tokio::sync::watch::Sender<axum::Router>,
    supervisor: Supervisor,
    upgrades: crate::server::upgrade::Upgrades,
    one_at_a_time: tokio::sync::Mutex<()>,
}

impl Live {
    pub(crate) fn new(
        reload: ReloadFn,
        app: tokio::sync::watch::Sender<axum::Router>,
        supervisor: Supervisor,
        upgrades: crate::server::upgrade::Upgrades,
    ) -> Arc<Live> {
        Arc::new(Live {
            reload,
            app,
            supervisor,
            upgrades,
            one_at_a_time: tokio::sync::Mutex::new(()),
        })
    }

    /// Reads the files again and applies them; `trigger` says what asked
    /// (`SIGHUP`, `POST /api/reload`, a file's change).
    pub(crate) async fn reload(self: &Arc<Self>, trigger: &str) -> Result<ReloadReport, String> {
        let _one = self.one_at_a_time.lock().await;
        // The service manager is told a reload runs, then that it is over
        // (systemd's `Type=notify-reload` waits for both).
        crate::server::notify::notify(&format!(
            "RELOADING=1\nMONOTONIC_USEC={}\nSTATUS=reloading the config ({trigger})",
            monotonic_usec()
        ));
        let reloaded = (self.reload)().await;
        crate::server::notify::notify("READY=1\nSTATUS=serving");
        match reloaded {
            Ok((report, mut options)) => {
                options.reload = Some(Arc::clone(&self.reload));
                let _ = self.app.send_replace(router(
                    self.supervisor.clone(),
                    &options,
                    Some(self),
                    &self.upgrades,
                ));
                tracing::info!(trigger, "{report}");
                self.supervisor
                    .emit(crate::supervisor::EventKind::ConfigReloaded {
                        trigger: trigger.to_string(),
                        report: report.clone(),
                    });
                Ok(report)
            }
            Err(why) => {
                tracing::error!(
                    trigger,
                    "the config was not reloaded, nothing changed: {why}"
                );
                self.supervisor
                    .emit(crate::supervisor::EventKind::ConfigRejected {
                        trigger: trigger.to_string(),
                        error: why.clone(),
                    });
                Err(why)
            }
        }
    }
}

/// `CLOCK_MONOTONIC` now, in microseconds (what `RELOADING=1` is sent
/// with).
pub(crate) fn monotonic_usec() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the struct we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000 + now.tv_nsec as u64 / 1_000
}

/// Reloads when one of `files` changes (its size or modification time,
/// looked at every second) while the daemon lives (`--watch-config`). A
/// file caught half-written fails to read, changes nothing, and the next
/// look sees it whole.
pub(crate) async fn watch_files(live: std::sync::Weak<Live>, files: Vec<std::path::PathBuf>) {
    let look = || -> Vec<Option<(std::time::SystemTime, u64)>> {
        files
            .iter()
            .map(|f| {
                let meta = std::fs::metadata(f).ok()?;
                Some((meta.modified().ok()?, meta.len()))
            })
            .collect()
    };
    let mut seen = look();
    let mut ticker = tokio::time::interval(std::time::Duration::from_secs(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let now = look();
        if now == seen {
            continue;
        }
        seen = now;
        let Some(live) = live.upgrade() else { return };
        let _ = live.reload("a config file changed (--watch-config)").await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> ServeConfig {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn models_are_added_removed_changed_and_kept_by_spec_and_kind() {
        let old = config(
            r#"
            memory_budget = "4GiB"
            listen = "127.0.0.1:1"
            [workers.py]
            command = ["python3", "-m", "berth_worker"]
            [[model]]
            name = "kept"
            backend = "echo"
            [[model]]
            name = "gone"
            backend = "echo"
            [[model]]
            name = "respecced"
            backend = "echo"
            [[model]]
            name = "rekinded"
            backend = "echo"
            worker = "py"
            "#,
        );
        let new = config(
            r#"
            memory_budget = "8GiB"
            listen = "127.0.0.1:2"
            [workers.py]
            command = ["python3", "-X", "dev", "-m", "berth_worker"]
            [[model]]
            name = "kept"
            backend = "echo"
            [[model]]
            name = "respecced"
            backend = "echo"
            keep_alive = "1m"
            [[model]]
            name = "rekinded"
            backend = "echo"
            worker = "py"
            [[model]]
            name = "new"
            backend = "echo"
            "#,
        );
        let report = models(&old, &new);
        assert_eq!(report.added, ["new"]);
        assert_eq!(report.removed, ["gone"]);
        assert_eq!(report.changed, ["respecced", "rekinded"]);
        assert_eq!(report.unchanged, ["kept"]);
        let (live, restart) = settings(&old, &new);
        assert_eq!(live, ["memory_budget", "workers.py"]);
        assert_eq!(restart, ["listen"]);
    }
}
