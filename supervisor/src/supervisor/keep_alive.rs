//! Keep-alive: idle models are unloaded when theirs runs out.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::ModelState;
use super::room::is_idle;
use super::{Inner, Supervisor};

/// How often a model whose keep-alive ran out while it was busy is looked
/// at again.
const BUSY_RECHECK: Duration = Duration::from_millis(100);

/// Unloads idle models whose keep-alive ran out. It sleeps until the next
/// keep-alive ends or `changed` wakes it (a slot changed, a request set a
/// keep-alive), so idle models cost it no wake-ups.
pub(super) async fn keep_alive_reaper(inner: Weak<Inner>, changed: Arc<Notify>) {
    let mut wake_at: Option<Instant> = None;
    loop {
        match wake_at {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at.into()) => {}
                    () = changed.notified() => {}
                }
            }
            None => changed.notified().await,
        }
        let Some(strong) = inner.upgrade() else {
            return;
        };
        if strong.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        let now = Instant::now();
        let mut expired = Vec::new();
        wake_at = None;
        {
            let state = strong.state.lock().unwrap_or_else(|e| e.into_inner());
            for (name, slot) in &state.slots {
                let Some(at) = slot.expires_at else { continue };
                let next = if at > now {
                    at
                } else if is_idle(&state, name, slot) {
                    expired.push(name.clone());
                    continue;
                } else if slot.state == ModelState::Ready {
                    // Busy past its keep-alive: its request's end renews
                    // it, and nothing wakes the reaper for that.
                    now + BUSY_RECHECK
                } else {
                    // Loading, restarting, failed, stopping: a change of
                    // state wakes the reaper; until then there is nothing
                    // to look at (a failed model would otherwise be looked
                    // at ten times a second for ever).
                    continue;
                };
                wake_at = Some(wake_at.map_or(next, |w| w.min(next)));
            }
        }
        let supervisor = Supervisor { inner: strong };
        for name in expired {
            let supervisor = supervisor.clone();
            tokio::spawn(async move {
                tracing::info!(model = name, "keep-alive ran out; unloading");
                match supervisor.unload(&name).await {
                    Ok(_) => supervisor.emit(super::EventKind::KeepAliveExpired {
                        model: name.clone(),
                    }),
                    Err(e) => tracing::debug!(model = name, "keep-alive unload skipped: {e}"),
                }
            });
        }
    }
}
