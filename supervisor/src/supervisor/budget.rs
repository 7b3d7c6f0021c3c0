//! The memory budget after loads. Admission counts a model in with what it
//! was measured (or expected) to take, but a model can grow once loaded (a
//! leak, a cache filling up) and push the models together past
//! `memory_budget`. While a budget is set, once a second the supervisor
//! compares what its workers hold with it (the heartbeats' readings) and
//! evicts idle models, least recently used first, until they fit. If no
//! model is idle it says so in the log (at most once a minute), and new
//! loads are refused, naming what holds the memory, until some comes back
//! (admission decides that from the same figures). A model that alone
//! outgrows what it may hold is what `memory_limit` and `max_rss` are for.

use std::sync::Weak;
use std::time::{Duration, Instant};

use super::admission::room;
use super::{Inner, Supervisor};
use crate::units::mib;

/// How often the budget is checked.
const EVERY: Duration = Duration::from_secs(1);
/// The most often "over the budget, nothing idle" is logged.
const WARN_EVERY: Duration = Duration::from_secs(60);

pub(super) async fn budget_watch(inner: Weak<Inner>, budget: u64) {
    let mut ticker = tokio::time::interval(EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned: Option<Instant> = None;
    loop {
        ticker.tick().await;
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let supervisor = Supervisor { inner: strong };
        if supervisor.is_shutting_down() {
            return;
        }
        let room = room(&supervisor.lock(), "");
        if room.used <= budget {
            continue;
        }
        match room.lru_idle {
            Some(victim) => {
                tracing::warn!(
                    victim,
                    "loaded models hold {}, over the memory budget of {}; evicting the least \
                     recently used idle model",
                    mib(room.used),
                    mib(budget)
                );
                supervisor.evict(&victim, None).await;
            }
            None if warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) => {
                warned = Some(Instant::now());
                tracing::warn!(
                    "loaded models hold {}, over the memory budget of {}, and none is idle to \
                     evict; new loads are refused until memory comes back. Held by: {}",
                    mib(room.used),
                    mib(budget),
                    room.holders.join(", ")
                );
            }
            None => {}
        }
    }
}
