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
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

use super::files::Texts;
use crate::config::SupervisorConfig;
use crate::daemon::config::ServeConfig;
use crate::error::Error;
use crate::report::ReloadReport;
use crate::server::ServeOptions;
use crate::supervisor::Supervisor;

/// What a reload is asked with.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ask {
    /// A config with no models may replace one with some: every model is
    /// then unloaded and deregistered. Without it such a config is taken
    /// for a file caught half-written, and refused.
    pub allow_empty: bool,
}

/// Reads the files again and applies them (the daemon's own, from
/// `berth serve`): the report and the front door's new options.
pub type ReloadFn = Arc<
    dyn Fn(Ask) -> BoxFuture<'static, Result<(ReloadReport, ServeOptions), String>> + Send + Sync,
>;

/// The config in force: what the start or the last reload applied (a step
/// that failed keeps what it would have changed as it was, so the next
/// reload tries it again), and the files' texts it was read from, which an
/// in-place upgrade hands over.
#[derive(Debug)]
pub(crate) struct Applied {
    pub config: ServeConfig,
    pub texts: Texts,
}

/// [`Applied`], shared by the reloads and the upgrade.
pub(crate) type SharedApplied = Arc<tokio::sync::Mutex<Applied>>;

/// How long a step whose model is busy (loading, swapping, being
/// unloaded) waits for it to settle before the step is left pending.
const BUSY_WAIT: Duration = Duration::from_secs(30);

/// Refuses a config with no models where models are registered, unless
/// asked: an empty file is a save caught between its truncation and its
/// write far more often than an operator's wish.
pub(crate) fn refuse_emptying(
    old: &ServeConfig,
    new: &ServeConfig,
    ask: Ask,
) -> Result<(), String> {
    if ask.allow_empty || !new.models.is_empty() || old.models.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the new config has no models, and {} are served from the files now (a file caught \
         half-written, between its truncation and its write?); nothing changed. To remove \
         every model, say so: `berth reload --allow-empty` (`POST /api/reload?allow_empty=true`)",
        old.models.len()
    ))
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
    compare!(live: memory_budget, max_loaded, max_queue, turn, gpu_memory_budget, keep_alive, models_dir,
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
/// kinds that changed, once nothing forked from them is left. A step whose
/// model is busy waits for it (at most [`BUSY_WAIT`]); a step that fails
/// leaves its model as it was, named in `failed` and `pending`, and the
/// config returned (what is now in force) keeps the model's old entry, so
/// the next reload tries the step again.
pub async fn apply(
    supervisor: &Supervisor,
    old: &ServeConfig,
    new: &ServeConfig,
    config: SupervisorConfig,
) -> (ReloadReport, ServeConfig) {
    let mut report = models(old, new);
    (report.settings, report.restart_needed) = settings(old, new);
    let retired = supervisor.replace_config(config).await;
    let spec_of = |name: &str| new.models.iter().find(|m| m.name == name).cloned();
    let mut failed = Vec::new();
    for name in &report.removed {
        match patiently(name, || supervisor.deregister(name)).await {
            // Removed over the API already: gone, as asked.
            Ok(_) | Err(Error::UnknownModel { .. }) => {}
            Err(e) => failed.push((name.clone(), e)),
        }
    }
    for name in &report.added {
        let spec = spec_of(name).expect("an added model is in the new config");
        if let Err(e) = supervisor.register(spec) {
            failed.push((name.clone(), e));
        }
    }
    for name in &report.changed {
        let spec = spec_of(name).expect("a changed model is in the new config");
        match patiently(name, || supervisor.swap(spec.clone())).await {
            Ok(_) => {}
            // Removed over the API meanwhile: the file has it, so it is
            // registered as the file says.
            Err(Error::UnknownModel { .. }) => {
                if let Err(e) = supervisor.register(spec) {
                    failed.push((name.clone(), e));
                }
            }
            Err(e) => failed.push((name.clone(), e)),
        }
    }
    for preloader in retired {
        preloader.stop().await;
    }
    // What is in force: the new config, but the failed steps' models as
    // they were.
    let mut in_force = new.clone();
    for (name, e) in failed {
        in_force.models.retain(|m| m.name != name);
        if let Some(was) = old.models.iter().find(|m| m.name == name) {
            in_force.models.push(was.clone());
            // A change of its worker kind stays pending too.
            if let Some(kind) = &was.worker
                && let Some(old_kind) = old.workers.get(kind)
            {
                in_force.workers.insert(kind.clone(), old_kind.clone());
            }
        }
        report.failed.push(format!("{name}: {e}"));
        report.pending.push(name);
    }
    (report, in_force)
}

/// Runs `step` until it does not fail for its model being busy, or
/// [`BUSY_WAIT`] has passed.
async fn patiently<T, F>(model: &str, mut step: impl FnMut() -> F) -> Result<T, Error>
where
    F: std::future::Future<Output = Result<T, Error>>,
{
    let until = Instant::now() + BUSY_WAIT;
    loop {
        match step().await {
            Err(Error::Busy { .. }) if Instant::now() < until => {
                tracing::debug!(model, "the reload waits for the model to settle");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> ServeConfig {
        toml::from_str(text).unwrap()
    }

    /// A config with no models replaces one with some only when asked; an
    /// empty one over an empty one, or one with models, is no question.
    #[test]
    fn an_emptying_config_is_refused_unless_asked() {
        let some = config("[[model]]\nname = \"a\"\nbackend = \"echo\"\n");
        let none = config("");
        let err = refuse_emptying(&some, &none, Ask::default()).unwrap_err();
        assert!(err.contains("--allow-empty"), "{err}");
        assert!(refuse_emptying(&some, &none, Ask { allow_empty: true }).is_ok());
        assert!(refuse_emptying(&none, &none, Ask::default()).is_ok());
        assert!(refuse_emptying(&none, &some, Ask::default()).is_ok());
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
