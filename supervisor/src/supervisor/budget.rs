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
//! The same watch checks the per-GPU budget (`gpu_budget.rs`).

use std::sync::Weak;
use std::time::{Duration, Instant};

use super::admission::room;
use super::{Inner, Supervisor};
use crate::units::mib;

/// How often the budget is checked.
const EVERY: Duration = Duration::from_secs(1);
/// The most often "over the budget, nothing idle" is logged.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Once a second while the supervisor lives: the memory budget and the
/// per-GPU budget (`gpu_budget.rs`), whichever are set then.
pub(super) async fn budget_watch(inner: Weak<Inner>) {
    let mut ticker = tokio::time::interval(EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut warned_ram, mut warned_gpu): (Option<Instant>, Option<Instant>) = (None, None);
    loop {
        ticker.tick().await;
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let supervisor = Supervisor { inner: strong };
        if supervisor.is_shutting_down() {
            return;
        }
        // Read at each check: a reload may set or change them.
        let config = supervisor.config();
        let (ram, gpu) = (config.memory_budget, config.gpu_memory_budget);
        if let Some(budget) = ram {
            ram_step(&supervisor, budget, &mut warned_ram).await;
        }
        if let Some(budget) = gpu {
            super::gpu_budget::gpu_step(&supervisor, budget, &mut warned_gpu).await;
        }
    }
}

/// Whether a "nothing idle to evict" warning is due (at most once a
/// minute), noting it said now if so.
pub(super) fn warn_due(warned: &mut Option<Instant>) -> bool {
    let due = warned.is_none_or(|at| at.elapsed() >= WARN_EVERY);
    if due {
        *warned = Some(Instant::now());
    }
    due
}

/// One check of the memory budget: evicts the least recently used idle
/// model while the workers hold more.
async fn ram_step(supervisor: &Supervisor, budget: u64, warned: &mut Option<Instant>) {
    let room = room(&supervisor.lock(), "");
    if room.used <= budget {
        return;
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
        None if warn_due(warned) => {
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
