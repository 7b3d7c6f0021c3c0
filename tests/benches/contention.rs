//! Many models, one machine: what `berth serve` answers when models that
//! cannot share the machine (`max_loaded = 1`) are all asked at once, with
//! turns (the default) beside a model taking a busy one's room at once
//! (`turn.max = "0s"`, what a swap group did before turns: a swap per
//! request), in alternating rounds.
//!
//! For each case: answers a second against the bound (what one model
//! serves when it never swaps, times the share of time not spent loading
//! at the turn berth chose), loads per answer, the waits' p50, p99 and
//! longest, and refusals.
//!
//! `cargo bench -p berth-tests --bench contention [-- CASE]`, CASE one of
//! the names printed; `BERTH_BENCH_SECS` sets each run's length (default 20).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use berth_tests::bench::{machine, median, percentile};
use berth_tests::{Server, StopOnDrop};
use serde_json::Value;

#[derive(Clone, Copy)]
struct Case {
    name: &'static str,
    models: usize,
    clients: usize,
    work_ms: u64,
    load_ms: u64,
}

const CASES: &[Case] = &[
    Case {
        name: "2x3-100ms-0.2s",
        models: 2,
        clients: 3,
        work_ms: 100,
        load_ms: 200,
    },
    Case {
        name: "2x1-100ms-0.2s",
        models: 2,
        clients: 1,
        work_ms: 100,
        load_ms: 200,
    },
    Case {
        name: "2x8-1s-2s",
        models: 2,
        clients: 8,
        work_ms: 1000,
        load_ms: 2000,
    },
    Case {
        name: "4x1-100ms-0.2s",
        models: 4,
        clients: 1,
        work_ms: 100,
        load_ms: 200,
    },
    Case {
        name: "4x8-100ms-2s",
        models: 4,
        clients: 8,
        work_ms: 100,
        load_ms: 2000,
    },
];

#[derive(Debug, Default)]
struct Figures {
    answers: usize,
    refused: usize,
    loads: usize,
    /// Mean load time (ms), from the load reports.
    load_ms: f64,
    waits: Vec<f64>,
    secs: f64,
}

fn config(case: &Case, at_once: bool) -> String {
    let mut out = String::from("test_backends = true\nmax_loaded = 1\n");
    if at_once {
        out.push_str("turn = { min = \"0s\", max = \"0s\" }\n");
    }
    for m in 0..case.models {
        out.push_str(&format!(
            "[[model]]\nname = \"m{m}\"\nbackend = \"hog\"\noptions = {{ alloc_mib = 32, work_ms = {}, load_ms = {} }}\n",
            case.work_ms, case.load_ms
        ));
    }
    out
}

fn run(case: &Case, at_once: bool, secs: u64) -> Figures {
    let server = Server::start(&config(case, at_once));
    let stop = AtomicBool::new(false);
    let seen = Mutex::new(Figures::default());
    let started = Instant::now();
    std::thread::scope(|scope| {
        let _stop = StopOnDrop(&stop);
        for m in 0..case.models {
            for _ in 0..case.clients {
                let (server, stop, seen) = (&server, &stop, &seen);
                scope.spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let sent = Instant::now();
                        let (status, _) =
                            server.post(&format!("/api/models/m{m}/infer"), serde_json::json!({}));
                        let waited = sent.elapsed().as_secs_f64() * 1e3;
                        let mut seen = seen.lock().unwrap();
                        if status == 200 {
                            seen.answers += 1;
                            seen.waits.push(waited);
                        } else {
                            seen.refused += 1;
                            drop(seen);
                            std::thread::sleep(Duration::from_millis(200));
                        }
                    }
                });
            }
        }
        std::thread::sleep(Duration::from_secs(secs));
        stop.store(true, Ordering::Relaxed);
    });
    let mut figures = seen.into_inner().unwrap();
    figures.secs = started.elapsed().as_secs_f64();
    let loaded: Vec<Value> = server.events_of("loaded");
    figures.loads = loaded.len();
    let mut times: Vec<f64> = loaded
        .iter()
        .filter_map(|e| e["report"]["load_ms"].as_f64())
        .collect();
    figures.load_ms = if times.is_empty() {
        0.0
    } else {
        median(&mut times)
    };
    figures
}

/// What one model serves a second when it never swaps (one request at a
/// time, `work_ms` each), times the share of time not spent loading with
/// turns of `turn` and loads of `load`.
fn bound(case: &Case, turn: f64, load: f64) -> f64 {
    1000.0 / case.work_ms as f64 * turn / (turn + load)
}

fn row(case: &Case, policy: &str, f: &mut Figures, turn_s: f64) {
    let per_s = f.answers as f64 / f.secs;
    let load_s = f.load_ms / 1e3;
    let bound = bound(case, turn_s, load_s);
    let (p50, p99, longest) = if f.waits.is_empty() {
        (0.0, 0.0, 0.0)
    } else {
        (
            percentile(&mut f.waits, 0.5),
            percentile(&mut f.waits, 0.99),
            f.waits.iter().cloned().fold(0.0, f64::max),
        )
    };
    println!(
        "| {} | {policy} | {per_s:.2} | {bound:.2} | {:.2}× | {:.3} | {:.0} / {:.0} / {:.0} ms | {} |",
        case.name,
        per_s / bound,
        f.loads as f64 / f.answers.max(1) as f64,
        p50,
        p99,
        longest,
        f.refused
    );
}

fn main() {
    let which = std::env::args().nth(1).filter(|a| !a.starts_with('-'));
    let secs: u64 = std::env::var("BERTH_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    println!(
        "Models that cannot share the machine, all asked at once ({})\n",
        machine()
    );
    println!(
        "| case (models×clients, work, load) | policy | answers/s | bound | of bound | loads per answer | wait p50 / p99 / longest | refused |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for case in CASES {
        if which.as_deref().is_some_and(|w| w != case.name) {
            continue;
        }
        // Alternating rounds: turns first in one, at once first in the next.
        for round in 0..2 {
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for at_once in order {
                let mut figures = run(case, at_once, secs);
                // The turn berth chose: its default for the measured load.
                let load_s = figures.load_ms / 1e3;
                let turn_s = if at_once { 0.0 } else { 5f64.max(4.0 * load_s) };
                let policy = if at_once {
                    "at once (turn 0 s)"
                } else {
                    "turns (default)"
                };
                // At once, the bound is the turns' (the same machine).
                let shown_turn = if at_once {
                    5f64.max(4.0 * load_s)
                } else {
                    turn_s
                };
                row(case, policy, &mut figures, shown_turn);
            }
        }
    }
}
