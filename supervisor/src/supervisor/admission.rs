//! Making room for a new worker: the memory budget, `max_loaded` and the
//! per-GPU VRAM budget, by evicting idle models least recently used first.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::footprint::Need;
use super::slot::Slot;
use super::{ModelState, State, Supervisor};
use crate::error::{Error, Result};
use crate::gpu;
use crate::units::mib;

/// What the supervisor holds when a new worker asks for room: read under
/// the state lock, then planned without it.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Room {
    /// RAM held by workers, loads in progress and workers being retired.
    pub used: u64,
    /// Models with a worker or a load in progress.
    pub loaded: usize,
    /// The least recently used idle model other than the one asking.
    pub lru_idle: Option<String>,
    /// Some model is draining or stopping, or a replaced worker is still
    /// stopping: memory is on its way back.
    pub freeing: bool,
    /// Each model's holding, for the refusal's message.
    pub holders: Vec<String>,
}

/// The supervisor's limits, as admission sees them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Limits {
    pub budget: Option<u64>,
    pub max_loaded: Option<usize>,
}

/// What to do about a new worker, one step at a time.
#[derive(Debug)]
pub(super) enum Admit {
    /// It fits: start it (on these GPUs, for a model that asked for some).
    Place(Option<Vec<u32>>),
    /// Unload this idle model, then plan again.
    Evict(String),
    /// Memory is on its way back: plan again once something changed.
    Wait,
    /// It cannot fit; the error says why.
    Refuse(Error),
}

/// The admission decision, pure: the RAM budget and `max_loaded` first (any
/// idle model helps there), then the GPU placement's verdict (`gpu`, for a
/// model on GPUs). A GPU that cannot take the model even with every idle
/// model evicted is refused before anything is evicted for RAM. `may_wait`:
/// the caller has not yet waited as long as it will for memory to come
/// back.
pub(super) fn plan(
    model: &str,
    need: &Need,
    room: &Room,
    limits: Limits,
    gpu: Option<gpu::Plan>,
    may_wait: bool,
) -> Admit {
    if let Some(budget) = limits.budget
        && need.ram > budget
    {
        return Admit::Refuse(Error::BudgetExceeded {
            model: model.into(),
            needed: need.ram,
            reason: format!("more than the whole memory budget of {}", mib(budget)),
        });
    }
    let fits = limits.budget.is_none_or(|b| room.used + need.ram <= b)
        && limits.max_loaded.is_none_or(|m| {
            // A replaced model is counted once.
            if need.replacing {
                room.loaded <= m
            } else {
                room.loaded < m
            }
        });
    let gpu_victim = match gpu {
        None => None,
        Some(gpu::Plan::Invalid(reason)) => {
            return Admit::Refuse(Error::InvalidSpec {
                model: model.into(),
                reason,
            });
        }
        Some(gpu::Plan::Refuse(reason)) => {
            return if room.freeing && may_wait {
                Admit::Wait
            } else {
                Admit::Refuse(Error::GpuBudgetExceeded {
                    model: model.into(),
                    needed: need.vram(),
                    reason,
                })
            };
        }
        Some(gpu::Plan::Place(gpus)) if fits => return Admit::Place(Some(gpus)),
        Some(gpu::Plan::Place(_)) => None,
        Some(gpu::Plan::Evict(victim)) => Some(victim),
    };
    if fits && need.gpu.is_none() {
        return Admit::Place(None);
    }
    // RAM first (any idle model helps there); then the GPU's pick.
    let victim = if fits {
        gpu_victim
    } else {
        room.lru_idle.clone()
    };
    match victim {
        Some(victim) => Admit::Evict(victim),
        None if room.freeing && may_wait => Admit::Wait,
        None => {
            let what = match (limits.budget, limits.max_loaded) {
                (Some(b), Some(m)) => format!("the memory budget of {} and max_loaded {m}", mib(b)),
                (Some(b), None) => format!("the memory budget of {}", mib(b)),
                (None, Some(m)) => format!("max_loaded {m}"),
                (None, None) => "the limits".into(),
            };
            Admit::Refuse(Error::BudgetExceeded {
                model: model.into(),
                needed: need.ram,
                reason: format!(
                    "which does not fit {what}, and no idle model can be evicted; held by: {}",
                    room.holders.join(", ")
                ),
            })
        }
    }
}

/// What `state` holds, as admission sees it for `model`.
pub(super) fn room(state: &State, model: &str) -> Room {
    let rss = |s: &Slot| {
        s.worker
            .as_ref()
            .map(|w| w.memory().last.rss_bytes)
            .unwrap_or(0)
            + s.reserved_bytes
    };
    Room {
        used: state.slots.values().map(rss).sum::<u64>()
            + state
                .retiring
                .values()
                .map(|r| r.worker.memory().last.rss_bytes)
                .sum::<u64>(),
        // A failed model holds nothing; a replaced one is counted once.
        loaded: state
            .slots
            .values()
            .filter(|s| s.worker.is_some() || s.loading.is_some())
            .count(),
        lru_idle: state
            .slots
            .iter()
            .filter(|(name, slot)| name.as_str() != model && is_idle(state, name, slot))
            .min_by_key(|(_, slot)| slot.last_used)
            .map(|(name, _)| name.clone()),
        freeing: !state.retiring.is_empty()
            || state
                .slots
                .values()
                .any(|s| matches!(s.state, ModelState::Draining | ModelState::Stopping)),
        holders: state
            .slots
            .iter()
            .map(|(name, s)| {
                let busy = s.worker.as_ref().map(|w| w.in_flight()).unwrap_or(0);
                format!(
                    "`{name}` {} ({} in flight, {})",
                    mib(rss(s)),
                    busy,
                    s.state()
                )
            })
            .collect(),
    }
}

impl Supervisor {
    /// Evicts idle models, least recently used first, until the new worker
    /// fits the memory budget, `max_loaded` and (for a model on GPUs) the
    /// per-GPU VRAM budget; returns the GPUs it goes on. While a model that
    /// is being unloaded will free what is missing, waits for it rather
    /// than refuse. Called with the load gate held. The decision is
    /// [`plan`]'s; this carries it out.
    pub(super) async fn make_room(&self, model: &str, need: &Need) -> Result<Option<Vec<u32>>> {
        let limits = Limits {
            budget: self.config().memory_budget,
            max_loaded: self.config().max_loaded,
        };
        // Long enough for a drain and a stop to finish.
        let room_wait = self.config().drain_timeout + Duration::from_secs(10);
        let waiting_since = Instant::now();
        loop {
            self.check_running(model)?;
            // NVML is read outside the lock: it can take milliseconds.
            let devices = match &need.gpu {
                None => None,
                Some(_) => match gpu::inventory() {
                    gpu::Inventory::Devices(devices) => Some(devices),
                    gpu::Inventory::NoGpu(reason) => {
                        return Err(Error::InvalidSpec {
                            model: model.into(),
                            reason: format!("it asks for GPUs but {reason}"),
                        });
                    }
                },
            };
            let changed = self.inner.changed.notified();
            let (room, gpu_plan) = {
                let state = self.lock();
                let gpu_plan = match (&need.gpu, &devices) {
                    (Some((request, vram)), Some(devices)) => Some(gpu::plan(
                        request,
                        devices,
                        *vram,
                        self.config().gpu_memory_budget,
                        &gpu_holders(&state, model),
                    )),
                    _ => None,
                };
                (room(&state, model), gpu_plan)
            };
            let may_wait = waiting_since.elapsed() < room_wait;
            match plan(model, need, &room, limits, gpu_plan, may_wait) {
                Admit::Place(gpus) => return Ok(gpus),
                Admit::Refuse(e) => return Err(e),
                Admit::Wait => {
                    let _ = tokio::time::timeout(Duration::from_millis(200), changed).await;
                }
                Admit::Evict(victim) => {
                    tracing::info!(
                        model,
                        victim,
                        "evicting the least recently used idle model to make room"
                    );
                    self.evict(&victim, Some(model)).await;
                }
            }
        }
    }
}

/// Whether a model is idle: ready, no request in flight or queued, not
/// being replaced. Eviction and the keep-alive both stop only idle models;
/// this is where "idle" is decided.
pub(super) fn is_idle(state: &State, name: &str, slot: &Slot) -> bool {
    slot.state == ModelState::Ready
        && !slot.swapping
        && slot.worker.as_ref().is_some_and(|w| w.in_flight() == 0)
        && state
            .catalogue
            .get(name)
            .is_none_or(|e| e.queued.load(Ordering::SeqCst) == 0)
}

/// berth's workers and loads in progress as GPU placement sees them;
/// `model` itself (being replaced) is never a candidate for eviction, and
/// its own reservation (a retried restart's) is not counted against it.
pub(super) fn gpu_holders(state: &State, model: &str) -> Vec<gpu::Holder> {
    // A declared share is held for as long as its worker runs, used or not
    // (a PyTorch model grows into it at its first large batch).
    let share = |name: &str| {
        state
            .catalogue
            .get(name)
            .and_then(|e| e.spec.vram)
            .unwrap_or(0)
    };
    let mut holders: Vec<gpu::Holder> = state
        .retiring
        .values()
        .map(|r| gpu::Holder {
            model: r.model.clone(),
            pids: r.worker.pids(),
            gpus: r.gpus.clone(),
            reserved_bytes: share(&r.model),
            evictable: false,
            last_used: 0,
        })
        .collect();
    for (name, slot) in &state.slots {
        // Larger is more recent.
        let last_used = u64::MAX - slot.last_used.elapsed().as_micros() as u64;
        if let Some(worker) = &slot.worker {
            holders.push(gpu::Holder {
                model: name.clone(),
                pids: worker.pids(),
                gpus: slot.gpus.clone(),
                reserved_bytes: share(name),
                evictable: name != model && is_idle(state, name, slot),
                last_used,
            });
        }
        if let Some(incoming) = slot.incoming_gpu.as_ref().filter(|_| name != model) {
            holders.push(gpu::Holder {
                model: name.clone(),
                pids: incoming.pid.into_iter().collect(),
                gpus: incoming.gpus.clone(),
                reserved_bytes: incoming.vram,
                evictable: false,
                last_used,
            });
        }
    }
    holders
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn need(ram: u64) -> Need {
        Need {
            ram,
            replacing: false,
            gpu: None,
        }
    }

    fn room(used: u64, loaded: usize, lru_idle: Option<&str>, freeing: bool) -> Room {
        Room {
            used,
            loaded,
            lru_idle: lru_idle.map(str::to_string),
            freeing,
            holders: vec!["`a` 300.0 MiB (0 in flight, ready)".into()],
        }
    }

    fn budget(mib: u64) -> Limits {
        Limits {
            budget: Some(mib * MIB),
            max_loaded: None,
        }
    }

    #[test]
    fn a_model_that_fits_is_placed() {
        let admit = plan(
            "m",
            &need(100 * MIB),
            &room(300 * MIB, 1, None, false),
            budget(512),
            None,
            true,
        );
        assert!(matches!(admit, Admit::Place(None)), "{admit:?}");
        let unlimited = plan(
            "m",
            &need(u64::MAX / 2),
            &room(0, 9, None, false),
            Limits::default(),
            None,
            true,
        );
        assert!(matches!(unlimited, Admit::Place(None)));
    }

    #[test]
    fn past_the_budget_the_least_recently_used_idle_model_goes_first() {
        let admit = plan(
            "m",
            &need(300 * MIB),
            &room(300 * MIB, 1, Some("old"), false),
            budget(512),
            None,
            true,
        );
        assert!(matches!(&admit, Admit::Evict(v) if v == "old"), "{admit:?}");
    }

    #[test]
    fn with_nothing_idle_it_waits_for_memory_on_its_way_back_then_refuses_naming_holders() {
        let busy = room(300 * MIB, 1, None, true);
        let admit = plan("m", &need(300 * MIB), &busy, budget(512), None, true);
        assert!(matches!(admit, Admit::Wait), "{admit:?}");
        let admit = plan("m", &need(300 * MIB), &busy, budget(512), None, false);
        let Admit::Refuse(e) = admit else {
            panic!("{admit:?}")
        };
        assert_eq!(e.kind(), "memory_budget_exceeded");
        assert!(e.to_string().contains("held by: `a` 300.0 MiB"), "{e}");
        let nothing = room(300 * MIB, 1, None, false);
        assert!(matches!(
            plan("m", &need(300 * MIB), &nothing, budget(512), None, true),
            Admit::Refuse(_)
        ));
    }

    #[test]
    fn a_model_larger_than_the_whole_budget_is_refused_at_once() {
        let admit = plan(
            "m",
            &need(600 * MIB),
            &room(0, 0, Some("idle"), true),
            budget(512),
            None,
            true,
        );
        let Admit::Refuse(e) = admit else {
            panic!("{admit:?}")
        };
        assert!(
            e.to_string().contains("more than the whole memory budget"),
            "{e}"
        );
    }

    #[test]
    fn max_loaded_counts_a_replaced_model_once() {
        let limits = Limits {
            budget: None,
            max_loaded: Some(2),
        };
        let full = room(0, 2, Some("old"), false);
        assert!(matches!(
            plan("m", &need(0), &full, limits, None, true),
            Admit::Evict(_)
        ));
        let swap = Need {
            replacing: true,
            ..need(0)
        };
        assert!(matches!(
            plan("m", &swap, &full, limits, None, true),
            Admit::Place(None)
        ));
    }

    #[test]
    fn the_gpus_verdict_comes_after_ram_and_a_gpu_refusal_before_any_eviction() {
        let on_gpu = Need {
            gpu: Some((gpu::GpuRequest::Devices(vec![0, 1]), 4 << 30)),
            ..need(100 * MIB)
        };
        let roomy = room(0, 1, Some("idle"), false);
        let placed = plan(
            "m",
            &on_gpu,
            &roomy,
            budget(512),
            Some(gpu::Plan::Place(vec![1])),
            true,
        );
        assert!(matches!(placed, Admit::Place(Some(g)) if g == vec![1]));
        let evict = plan(
            "m",
            &on_gpu,
            &roomy,
            budget(512),
            Some(gpu::Plan::Evict("gpu-idle".into())),
            true,
        );
        assert!(
            matches!(&evict, Admit::Evict(v) if v == "gpu-idle"),
            "{evict:?}"
        );
        // RAM short: the RAM's pick goes first, whatever the GPU says.
        let tight = room(500 * MIB, 1, Some("ram-idle"), false);
        let ram_first = plan(
            "m",
            &on_gpu,
            &tight,
            budget(512),
            Some(gpu::Plan::Place(vec![0])),
            true,
        );
        assert!(
            matches!(&ram_first, Admit::Evict(v) if v == "ram-idle"),
            "{ram_first:?}"
        );
        let refused = plan(
            "m",
            &on_gpu,
            &tight,
            budget(512),
            Some(gpu::Plan::Refuse("full".into())),
            true,
        );
        let Admit::Refuse(e) = refused else {
            panic!("{refused:?}")
        };
        assert_eq!(e.kind(), "gpu_memory_budget_exceeded");
        let invalid = plan(
            "m",
            &on_gpu,
            &roomy,
            budget(512),
            Some(gpu::Plan::Invalid("no GPU 7".into())),
            true,
        );
        assert!(matches!(invalid, Admit::Refuse(Error::InvalidSpec { .. })));
    }
}
