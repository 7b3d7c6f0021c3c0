//! The admission decision on recorded states: what the machine held when a
//! model asked for room, and what `plan` decides.

use std::time::Duration;

use super::*;

const MIB: u64 = 1 << 20;
const S: Duration = Duration::from_secs(1);

fn need(ram: u64) -> Need {
    Need {
        ram,
        replacing: false,
        gpu: None,
        from: "files",
    }
}

/// A model holding `ram` MiB, `busy` or idle, `turn` into its turn, whose
/// load took a second.
fn held(name: &str, ram: u64, busy: bool, turn: Duration) -> Held {
    Held {
        name: name.into(),
        ram: ram * MIB,
        state: ModelState::Ready,
        idle: !busy,
        stoppable: true,
        in_flight: u32::from(busy),
        turn,
        load_time: S,
        priority: 0,
        unused_for: if busy { Duration::ZERO } else { turn },
        on_gpu: false,
    }
}

fn room(held: Vec<Held>, freeing: bool) -> Room {
    Room {
        used: held.iter().map(|h| h.ram).sum(),
        loaded: held.len(),
        freeing,
        held,
    }
}

fn budget(mib: u64) -> Limits {
    Limits {
        budget: Some(mib * MIB),
        max_loaded: None,
    }
}

fn one_at_a_time() -> Limits {
    Limits {
        budget: None,
        max_loaded: Some(1),
    }
}

fn asker(priority: i32) -> Asker<'static> {
    Asker {
        model: "m",
        priority,
    }
}

/// Turns of 2 s least and 10 s most.
fn turns() -> Turns {
    Turns {
        min: Some(2 * S),
        max: Some(10 * S),
    }
}

fn decide(need_mib: u64, room: &Room, limits: Limits) -> Admit {
    plan(
        asker(0),
        &need(need_mib * MIB),
        room,
        limits,
        &turns(),
        None,
    )
}

#[test]
fn a_model_that_fits_is_placed() {
    let r = room(vec![held("a", 300, true, S)], false);
    assert!(matches!(decide(100, &r, budget(512)), Admit::Place(None)));
    let unlimited = plan(
        asker(0),
        &need(u64::MAX / 2),
        &room(Vec::new(), false),
        Limits::default(),
        &turns(),
        None,
    );
    assert!(matches!(unlimited, Admit::Place(None)));
}

#[test]
fn past_the_budget_the_least_recently_used_idle_model_goes_first() {
    let r = room(
        vec![
            held("recent", 100, false, S),
            held("old", 100, false, 30 * S),
            held("busy", 100, true, 30 * S),
        ],
        false,
    );
    let admit = decide(300, &r, budget(512));
    assert!(
        matches!(&admit, Admit::Evict(v, Why::Idle) if v == "old"),
        "{admit:?}"
    );
}

/// What could never fit is refused at once (Ollama 18282: an eviction
/// loop for a model that never fits): no eviction, no wait.
#[test]
fn a_model_larger_than_the_whole_budget_is_refused_at_once() {
    let r = room(vec![held("idle", 100, false, S)], true);
    let Admit::Refuse(e) = decide(600, &r, budget(512)) else {
        panic!("not refused")
    };
    assert!(
        e.to_string().contains("more than the whole memory budget"),
        "{e}"
    );
}

/// A busy model keeps its room until its most turn is over, then yields
/// (the second of two models that cannot share the machine is not
/// refused: it waits its turn).
#[test]
fn a_busy_model_keeps_its_room_for_its_turn_then_yields() {
    let early = room(vec![held("a", 300, true, 3 * S)], false);
    match decide(300, &early, one_at_a_time()) {
        Admit::Wait(Some(left)) => assert_eq!(left, 7 * S),
        other => panic!("{other:?}"),
    }
    let late = room(vec![held("a", 300, true, 11 * S)], false);
    assert!(matches!(
        decide(300, &late, one_at_a_time()),
        Admit::Evict(v, Why::TurnOver) if v == "a"
    ));
}

/// A model still loading (or restarting) is waited for, never refused
/// (llama.cpp 26572: a router that refused while a model loaded).
#[test]
fn a_loading_model_is_waited_for() {
    let mut loading = held("a", 300, false, Duration::ZERO);
    loading.state = ModelState::Loading;
    loading.stoppable = false;
    loading.idle = false;
    let r = room(vec![loading], false);
    assert!(matches!(
        decide(300, &r, one_at_a_time()),
        Admit::Wait(None)
    ));
}

#[test]
fn memory_on_its_way_back_is_waited_for() {
    let r = room(vec![held("a", 300, true, S)], true);
    assert!(matches!(decide(300, &r, budget(512)), Admit::Wait(None)));
}

/// A waiter of higher priority takes a busy model's room once its least
/// turn is over; one of the same priority waits for its most.
#[test]
fn a_higher_priority_waiter_takes_a_turn_after_its_least() {
    let r = room(vec![held("a", 300, true, 3 * S)], false);
    let high = plan(
        asker(5),
        &need(300 * MIB),
        &r,
        one_at_a_time(),
        &turns(),
        None,
    );
    assert!(
        matches!(&high, Admit::Evict(v, Why::Priority) if v == "a"),
        "{high:?}"
    );
    let young = room(vec![held("a", 300, true, S)], false);
    let high = plan(
        asker(5),
        &need(300 * MIB),
        &young,
        one_at_a_time(),
        &turns(),
        None,
    );
    assert!(
        matches!(&high, Admit::Wait(Some(left)) if *left == S),
        "{high:?}"
    );
}

/// Of several busy models past their turn, the one longest past it goes.
#[test]
fn the_model_longest_past_its_turn_yields_first() {
    let r = room(
        vec![held("a", 100, true, 12 * S), held("b", 100, true, 40 * S)],
        false,
    );
    assert!(matches!(
        decide(100, &r, Limits { budget: None, max_loaded: Some(2) }),
        Admit::Evict(v, Why::TurnOver) if v == "b"
    ));
}

/// The turns' defaults follow the model's load time: a load of seconds is
/// worth its while.
#[test]
fn the_default_turn_follows_the_load_time() {
    let defaults = Turns::default();
    assert_eq!(defaults.max_for(Duration::from_millis(200)), 5 * S);
    assert_eq!(defaults.max_for(3 * S), 12 * S);
    assert_eq!(defaults.min_for(Duration::from_millis(200)), S);
    assert_eq!(defaults.min_for(3 * S), 3 * S);
    let fixed = Turns {
        min: Some(30 * S),
        max: Some(10 * S),
    };
    assert_eq!(fixed.min_for(S), 10 * S, "the least is at most the most");
}

#[test]
fn max_loaded_counts_a_replaced_model_once() {
    let full = room(vec![held("a", 0, false, S), held("b", 0, false, S)], false);
    let limits = Limits {
        budget: None,
        max_loaded: Some(2),
    };
    assert!(matches!(
        plan(asker(0), &need(0), &full, limits, &turns(), None),
        Admit::Evict(..)
    ));
    let swap = Need {
        replacing: true,
        ..need(0)
    };
    assert!(matches!(
        plan(asker(0), &swap, &full, limits, &turns(), None),
        Admit::Place(None)
    ));
}

/// The GPU's verdict: placed, its own pick evicted; refused with only
/// models elsewhere idle, it waits for a busy model on a GPU and evicts
/// nothing that would not help.
#[test]
fn a_gpu_refusal_waits_for_models_on_gpus_and_evicts_none_elsewhere() {
    let on_gpu = Need {
        gpu: Some((gpu::GpuRequest::Devices(vec![0]), 4 << 30)),
        ..need(100 * MIB)
    };
    let mut gpu_busy = held("gpu-busy", 100, true, S);
    gpu_busy.on_gpu = true;
    let ram_idle = held("ram-idle", 100, false, 30 * S);
    let r = room(vec![gpu_busy, ram_idle.clone()], false);
    let placed = plan(
        asker(0),
        &on_gpu,
        &r,
        budget(4096),
        &turns(),
        Some(gpu::Plan::Place(vec![0])),
    );
    assert!(matches!(placed, Admit::Place(Some(g)) if g == vec![0]));
    let evict = plan(
        asker(0),
        &on_gpu,
        &r,
        budget(4096),
        &turns(),
        Some(gpu::Plan::Evict("gpu-idle".into())),
    );
    assert!(
        matches!(&evict, Admit::Evict(v, Why::Gpu) if v == "gpu-idle"),
        "{evict:?}"
    );
    let refused = plan(
        asker(0),
        &on_gpu,
        &r,
        budget(4096),
        &turns(),
        Some(gpu::Plan::Refuse("full".into())),
    );
    assert!(matches!(refused, Admit::Wait(Some(_))), "{refused:?}");
    let only_ram = room(vec![ram_idle], false);
    let refused = plan(
        asker(0),
        &on_gpu,
        &only_ram,
        budget(4096),
        &turns(),
        Some(gpu::Plan::Refuse("full".into())),
    );
    let Admit::Refuse(e) = refused else {
        panic!("{refused:?}")
    };
    assert_eq!(e.kind(), "gpu_memory_budget_exceeded");
    let invalid = plan(
        asker(0),
        &on_gpu,
        &r,
        budget(4096),
        &turns(),
        Some(gpu::Plan::Invalid("no GPU 7".into())),
    );
    assert!(matches!(invalid, Admit::Refuse(Error::InvalidSpec { .. })));
}

/// Nothing that holds room could give it: refused, naming the holders.
#[test]
fn with_nothing_that_could_give_room_it_is_refused_naming_holders() {
    let mut failed = held("dead", 300, false, S);
    failed.state = ModelState::Failed;
    failed.stoppable = false;
    failed.idle = false;
    let mut r = room(vec![failed], false);
    // A failed worker not loading: stoppable false but not loading either.
    r.held[0].state = ModelState::Failed;
    let admit = plan(asker(0), &need(300 * MIB), &r, budget(512), &turns(), None);
    // It is not stoppable: waited for as a load would be.
    assert!(matches!(admit, Admit::Wait(None)), "{admit:?}");
    let empty = Room {
        used: 400 * MIB,
        loaded: 0,
        freeing: false,
        held: Vec::new(),
    };
    let Admit::Refuse(e) = plan(
        asker(0),
        &need(300 * MIB),
        &empty,
        budget(512),
        &turns(),
        None,
    ) else {
        panic!("not refused")
    };
    assert_eq!(e.kind(), "memory_budget_exceeded");
    assert!(e.to_string().contains("held by: nothing"), "{e}");
}
