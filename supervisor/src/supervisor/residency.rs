//! Carrying out the residency rules (`config/residency.rs`): before a model
//! starts, the running models that may not run beside it (its groups' or
//! matrix's say, or a server on its fixed port) are drained and stopped.

use std::time::{Duration, Instant};

use tokio::sync::MutexGuard;

use super::{EventKind, ModelState, Supervisor};
use crate::error::{Error, Result};

impl Supervisor {
    /// Stops what may not run beside `model`, with the load gate held, so
    /// no two loads decide at once; returns the gate, still held. A model
    /// that cannot stop yet (loading, being swapped) is waited for, the
    /// gate let go meanwhile, up to the drain timeout and a minute more.
    /// `swapping_to`: a swap's new spec, whose port counts for the model.
    pub(super) async fn make_way<'a>(
        &'a self,
        model: &str,
        mut gate: MutexGuard<'a, ()>,
        swapping_to: Option<&crate::config::ModelSpec>,
    ) -> Result<MutexGuard<'a, ()>> {
        let config = &self.config();
        let deadline = Instant::now() + config.drain_timeout + Duration::from_secs(60);
        loop {
            self.check_running(model)?;
            let changed = self.inner.changed.notified();
            let victims = {
                let state = self.lock();
                // A failed model holds nothing: it is not running.
                let running: Vec<String> = state
                    .slots
                    .iter()
                    .filter(|(_, s)| !(s.state == ModelState::Failed && s.worker.is_none()))
                    .map(|(name, _)| name.clone())
                    .collect();
                // Its own slot, but for a swap: the caller says it is
                // loaded, or loading.
                if running.is_empty()
                    || (swapping_to.is_none() && running.iter().any(|m| m == model))
                {
                    return Ok(gate);
                }
                let port = |m: &str| {
                    let spec = match swapping_to {
                        Some(spec) if m == model => spec,
                        _ => &state.catalogue.get(m)?.spec,
                    };
                    // Servers that choose their own port likely choose one
                    // port: 0 stands for it.
                    spec.http_spec(config)
                        .and_then(|h| if h.find_port { Some(0) } else { h.port })
                };
                config.residency.must_stop(model, &running, &port)
            };
            if victims.is_empty() {
                return Ok(gate);
            }
            let mut waiting = None;
            for victim in victims {
                tracing::info!(model, victim, "stopping a model that may not run beside it");
                match self.unload(&victim).await {
                    Ok(report) => {
                        tracing::info!("{report}");
                        self.emit(EventKind::Evicted {
                            model: victim,
                            for_model: Some(model.into()),
                        });
                    }
                    Err(Error::NotLoaded { .. } | Error::UnknownModel { .. }) => {}
                    Err(Error::Busy { reason, .. }) => waiting = Some((victim, reason)),
                    Err(e) => return Err(e),
                }
            }
            if let Some((victim, reason)) = waiting {
                if Instant::now() >= deadline {
                    return Err(Error::Busy {
                        model: model.into(),
                        reason: format!(
                            "model `{victim}` may not run beside it (its groups, matrix or \
                             fixed port) and could not be stopped: {reason}; try again"
                        ),
                    });
                }
                drop(gate);
                let _ = tokio::time::timeout(Duration::from_millis(200), changed).await;
                gate = self.inner.load_gate.lock().await;
            }
        }
    }
}
