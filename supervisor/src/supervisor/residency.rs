//! Carrying out the residency rules (`config/residency.rs`): before a model
//! starts, the running models that may not run beside it (its groups' or
//! matrix's say, or a server on its fixed port) are drained and stopped.

use std::time::{Duration, Instant};

use super::admission::{Asker, turn_left};
use super::queue::Gate;
use super::room::room;
use super::{EventKind, ModelState, Supervisor};
use crate::error::{Error, Result};

impl Supervisor {
    /// Stops what may not run beside `model`, with the machine's gate held,
    /// so no two loads decide at once; returns the gate, still held. An
    /// idle model stops at once; a busy one keeps its turn (see
    /// `admission::turn_left`), then yields: it takes no new request,
    /// finishes those in flight, and stops. A model that cannot stop yet
    /// (loading, being swapped, its turn not over) is waited for, the gate
    /// let go meanwhile (its place kept), up to the drain timeout and a
    /// minute more past what its turn takes. `swapping_to`: a swap's new
    /// spec, whose port counts for the model.
    pub(super) async fn make_way<'a>(
        &'a self,
        model: &str,
        mut gate: Gate<'a>,
        swapping_to: Option<&crate::config::ModelSpec>,
    ) -> Result<Gate<'a>> {
        let config = &self.config();
        let priority = swapping_to
            .map(|s| s.priority)
            .or_else(|| self.lock().catalogue.get(model).map(|e| e.spec.priority))
            .unwrap_or(0);
        let asker = Asker { model, priority };
        let mut deadline = Instant::now() + config.drain_timeout + Duration::from_secs(60);
        loop {
            self.check_running(model)?;
            let changed = self.inner.changed.notified();
            let (victims, room) = {
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
                (
                    config.residency.must_stop(model, &running, &port),
                    room(&state, model),
                )
            };
            if victims.is_empty() {
                return Ok(gate);
            }
            let mut waiting: Option<(String, String)> = None;
            let mut soonest: Option<Duration> = None;
            for victim in victims {
                let held = room.held.iter().find(|h| h.name == victim);
                // Busy: it keeps its turn, and yields once that is over.
                if let Some(held) = held.filter(|h| h.stoppable && !h.idle) {
                    if let Some(left) = turn_left(held, asker, &config.turn) {
                        soonest = Some(soonest.map_or(left, |s| s.min(left)));
                        deadline = deadline.max(Instant::now() + left + Duration::from_secs(60));
                        waiting = Some((victim, "its turn is not over".into()));
                        continue;
                    }
                    tracing::info!(
                        model,
                        victim,
                        "its turn is over; it yields to a model it may not run beside"
                    );
                    self.give_room(&victim, Some(model), "turn_over", None)
                        .await;
                    continue;
                }
                tracing::info!(model, victim, "stopping a model that may not run beside it");
                match self.unload(&victim).await {
                    Ok(report) => {
                        tracing::info!("{report}");
                        self.emit(EventKind::Evicted {
                            model: victim,
                            for_model: Some(model.into()),
                            reason: Some("residency".into()),
                            sleep: None,
                            ran_ms: None,
                            served: None,
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
                let wait = soonest
                    .unwrap_or(Duration::from_millis(200))
                    .min(Duration::from_millis(200));
                gate = gate
                    .pause(async move {
                        let _ = tokio::time::timeout(wait, changed).await;
                    })
                    .await;
            }
        }
    }
}
