//! The admission decision, pure: given what holds the machine's room now
//! (each model's memory, whether it is idle, how long it has had its turn)
//! and what a new worker needs, what to do next: place it, evict one
//! model, wait, or refuse. `room.rs` reads the state into a [`Room`] and
//! carries the decision out, one step at a time, planning again after each
//! (`docs/internals/scheduler.md` tells the whole scheduler).
//!
//! The rules, in order:
//! 1. What can never fit (more than a budget on its own) is refused at
//!    once, naming the figures: no eviction, no wait, no loop.
//! 2. What fits is placed (on the GPUs placement chose).
//! 3. Short of room, an idle model goes, least recently used first.
//! 4. Memory on its way back (a model draining or stopping): wait for it.
//! 5. Else a busy model whose turn is over yields: it takes no new request,
//!    finishes what it has in flight, and goes. A turn is over at its most
//!    ([`Turns::max_for`]); for a waiter of higher priority, at its least
//!    ([`Turns::min_for`]). A model that is loading or restarting is
//!    waited for, as is one whose turn is not over: until then, [`Admit::Wait`]
//!    says how long at most.
//! 6. Nothing holds room that could ever give it: refused, naming who
//!    holds what.

use std::time::Duration;

use super::ModelState;
use super::footprint::Need;
use crate::config::Turns;
use crate::error::Error;
use crate::gpu;
use crate::units::mib;

/// One model holding room, as admission sees it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Held {
    pub name: String,
    /// RAM it holds (its worker's, and a load's reservation).
    pub ram: u64,
    pub state: ModelState,
    /// Ready, nothing in flight, queued or waiting for it: it may go now.
    pub idle: bool,
    /// Ready and not being replaced: it can be stopped (a loading or
    /// restarting model cannot).
    pub stoppable: bool,
    pub in_flight: u32,
    /// How long it has had its room (since its load ended).
    pub turn: Duration,
    /// What its load took (the turns' defaults follow it).
    pub load_time: Duration,
    pub priority: i32,
    /// How long since it was last used: the least recently used goes first.
    pub unused_for: Duration,
    /// It holds memory on a GPU.
    pub on_gpu: bool,
}

/// What the supervisor holds when a new worker asks for room: read under
/// the state lock, then planned without it.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Room {
    /// RAM held by workers, loads in progress and workers being retired.
    pub used: u64,
    /// Models with a worker or a load in progress.
    pub loaded: usize,
    /// Some model is draining or stopping, or a replaced worker is still
    /// stopping: memory is on its way back.
    pub freeing: bool,
    /// Every model that holds room but the one asking.
    pub held: Vec<Held>,
}

/// The supervisor's limits, as admission sees them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Limits {
    pub budget: Option<u64>,
    pub max_loaded: Option<usize>,
}

/// Who asks for room.
#[derive(Debug, Clone, Copy)]
pub(super) struct Asker<'a> {
    pub model: &'a str,
    pub priority: i32,
}

/// What to do about a new worker, one step at a time.
#[derive(Debug)]
pub(super) enum Admit {
    /// It fits: start it (on these GPUs, for a model that asked for some).
    Place(Option<Vec<u32>>),
    /// Unload this model (`why`), then plan again. A busy one yields: it
    /// takes no new request and finishes those in flight first.
    Evict(String, Why),
    /// Plan again once something changed, or after this long at most (the
    /// soonest a busy model's turn ends).
    Wait(Option<Duration>),
    /// It cannot fit; the error says why.
    Refuse(Error),
}

/// Why a model gives its room up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// It was idle.
    Idle,
    /// Its most turn was over while another waited.
    TurnOver,
    /// A waiter of higher priority came, and its least turn was over.
    Priority,
    /// The GPU's placement chose it.
    Gpu,
}

impl Why {
    /// As events and logs say it.
    pub fn as_str(self) -> &'static str {
        match self {
            Why::Idle => "idle",
            Why::TurnOver => "turn_over",
            Why::Priority => "priority",
            Why::Gpu => "gpu",
        }
    }
}

/// When `held`'s turn is over for `asker`: `None` now (it may yield), else
/// how long until then.
pub(super) fn turn_left(held: &Held, asker: Asker, turns: &Turns) -> Option<Duration> {
    let end = if asker.priority > held.priority {
        turns.min_for(held.load_time)
    } else {
        turns.max_for(held.load_time)
    };
    end.checked_sub(held.turn).filter(|left| !left.is_zero())
}

/// The admission decision (see the module's rules). `gpu`: the GPU
/// placement's verdict, for a model on GPUs.
pub(super) fn plan(
    asker: Asker,
    need: &Need,
    room: &Room,
    limits: Limits,
    turns: &Turns,
    gpu: Option<gpu::Plan>,
) -> Admit {
    let model = asker.model;
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
    let mut gpu_refused = None;
    match gpu {
        None => {}
        Some(gpu::Plan::Invalid(reason)) => {
            return Admit::Refuse(Error::InvalidSpec {
                model: model.into(),
                reason,
            });
        }
        Some(gpu::Plan::Place(gpus)) if fits => return Admit::Place(Some(gpus)),
        Some(gpu::Plan::Place(_)) => {}
        Some(gpu::Plan::Evict(victim)) if fits => return Admit::Evict(victim, Why::Gpu),
        Some(gpu::Plan::Evict(_)) => {}
        Some(gpu::Plan::Refuse(reason)) => gpu_refused = Some(reason),
    }
    if fits && gpu_refused.is_none() {
        return Admit::Place(None);
    }
    // Who could give room: for the GPU, only those on a GPU (an idle model
    // elsewhere gives it nothing); for RAM and `max_loaded`, anyone.
    let candidates: Vec<&Held> = room
        .held
        .iter()
        .filter(|h| h.name != model && (gpu_refused.is_none() || h.on_gpu))
        .collect();
    // RAM first (any idle model helps there), least recently used first.
    if gpu_refused.is_none()
        && let Some(idle) = candidates
            .iter()
            .filter(|h| h.idle && h.stoppable)
            .max_by_key(|h| h.unused_for)
    {
        return Admit::Evict(idle.name.clone(), Why::Idle);
    }
    if room.freeing {
        return Admit::Wait(None);
    }
    // A busy model whose turn is over yields: the one longest past it.
    let busy: Vec<&&Held> = candidates
        .iter()
        .filter(|h| h.stoppable && !h.idle)
        .collect();
    if let Some(over) = busy
        .iter()
        .filter(|h| turn_left(h, asker, turns).is_none())
        .max_by_key(|h| h.turn)
    {
        let why = if asker.priority > over.priority && over.turn < turns.max_for(over.load_time) {
            Why::Priority
        } else {
            Why::TurnOver
        };
        return Admit::Evict(over.name.clone(), why);
    }
    let soonest = busy.iter().filter_map(|h| turn_left(h, asker, turns)).min();
    let loading = candidates.iter().any(|h| !h.stoppable);
    if soonest.is_some() || loading {
        return Admit::Wait(soonest);
    }
    // Nothing that holds room could ever give it.
    let holders: Vec<String> = room
        .held
        .iter()
        .map(|h| {
            format!(
                "`{}` {} ({} in flight, {})",
                h.name,
                mib(h.ram),
                h.in_flight,
                h.state
            )
        })
        .collect();
    if let Some(reason) = gpu_refused {
        return Admit::Refuse(Error::GpuBudgetExceeded {
            model: model.into(),
            needed: need.vram(),
            reason,
        });
    }
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
            "which does not fit {what}, and nothing that holds room could give it; held by: {}",
            if holders.is_empty() {
                "nothing".into()
            } else {
                holders.join(", ")
            }
        ),
    })
}

#[cfg(test)]
mod tests;
