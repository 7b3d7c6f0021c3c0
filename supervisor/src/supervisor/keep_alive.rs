//! Keep-alive: idle models are unloaded when theirs runs out.

use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::admission::is_idle;
use super::{Inner, Supervisor};

/// Unloads idle models whose keep-alive ran out.
pub(super) async fn keep_alive_reaper(inner: Weak<Inner>) {
    let mut ticker = tokio::time::interval(Duration::from_millis(100));
    loop {
        ticker.tick().await;
        let Some(strong) = inner.upgrade() else {
            return;
        };
        if strong.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        let now = Instant::now();
        let expired: Vec<String> = {
            let state = strong.state.lock().unwrap_or_else(|e| e.into_inner());
            state
                .slots
                .iter()
                .filter(|(name, slot)| {
                    slot.expires_at.is_some_and(|t| t <= now) && is_idle(&state, name, slot)
                })
                .map(|(name, _)| name.clone())
                .collect()
        };
        let supervisor = Supervisor { inner: strong };
        for name in expired {
            let supervisor = supervisor.clone();
            tokio::spawn(async move {
                tracing::info!(model = name, "keep-alive ran out; unloading");
                if let Err(e) = supervisor.unload(&name).await {
                    tracing::debug!(model = name, "keep-alive unload skipped: {e}");
                }
            });
        }
    }
}
