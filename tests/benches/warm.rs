//! Warm starts: Python workers forked from their kind's preloaded
//! interpreter against the same workers started cold, in alternating
//! rounds, same run; docs/performance.md's "Warm starts" tables.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench warm`
//!
//! 1. Load of `minilm-torch` (MiniLM in plain PyTorch, the shipped weights)
//!    and of `eqx-stack` (JAX/Equinox, 24 blocks): cold against forked, and
//!    the forked load against the backend's own load time (measured inside
//!    the worker: the weights, once the framework is imported).
//! 2. A swap of `minilm-torch` under four clients: from the swap call to
//!    the new worker serving, cold against forked, and requests failed.
//! 3. Memory of four `minilm-torch` workers forked against four cold:
//!    RSS, PSS and what each owns, summed, the preloader's beside them.
//!
//! Arguments pick sections by name (`load`, `swap`, `memory`); none runs all.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use berth::{Body, ModelSpec, Supervisor, SupervisorConfig, WorkerKind, WorkerStart};
use berth_tests::bench::{Rounds, machine, median};
use berth_tests::python::{example_spec, examples_dir, examples_python};
use berth_tests::{default_model, test_config};

const MIB: f64 = (1 << 20) as f64;
const ROUNDS: usize = 6;

/// One model of the examples, as a cold spec and as a forked one.
struct Model {
    label: &'static str,
    backend: &'static str,
    kind: &'static str,
    preload: &'static [&'static str],
    options: &'static [(&'static str, &'static str)],
    weights: bool,
}

const TORCH: Model = Model {
    label: "minilm-torch",
    backend: "torch_embed",
    kind: "ex-torch",
    preload: &["torch", "berth_examples.torch_embed"],
    options: &[],
    weights: true,
};

const JAX: Model = Model {
    label: "eqx-stack",
    backend: "eqx_stack",
    kind: "ex-jax",
    preload: &["jax", "equinox", "berth_examples.eqx_stack"],
    options: &[("init", "blocks")],
    weights: false,
};

impl Model {
    fn spec(&self, name: &str, forked: bool) -> ModelSpec {
        let mut spec = if forked {
            let mut spec = ModelSpec::new(name, self.backend).cwd(examples_dir());
            spec.worker = Some(self.kind.into());
            spec
        } else {
            example_spec(name, self.backend)
        };
        for (k, v) in self.options {
            spec = spec.option(*k, *v);
        }
        if self.weights {
            spec = spec.model(default_model("minilm"));
        }
        spec
    }
}

/// The tests' settings with the two preloading kinds declared; this
/// process a child subreaper, as `berth serve` is.
fn config() -> SupervisorConfig {
    berth::become_subreaper().expect("a child subreaper");
    let mut config = test_config();
    for model in [&TORCH, &JAX] {
        let mut kind = WorkerKind::command([
            examples_python().display().to_string(),
            "-m".into(),
            "berth_examples".into(),
        ]);
        kind.cwd = Some(examples_dir());
        kind.preload = model.preload.iter().map(|m| m.to_string()).collect();
        config.workers.insert(model.kind.into(), kind);
    }
    config
}

/// Loads `spec`, unloads it; the load report's (load, backend) ms.
async fn load_once(sup: &Supervisor, spec: ModelSpec, forked: bool) -> (f64, f64) {
    let name = spec.name.clone();
    let report = sup.load(spec).await.unwrap();
    assert_eq!(
        matches!(report.start, WorkerStart::Forked { .. }),
        forked,
        "{:?}",
        report.start
    );
    sup.unload(&name).await.unwrap();
    (report.load_ms, report.backend_load_ms)
}

async fn loads(sup: &Supervisor, model: &Model) {
    // The first forked load starts the preloader: its imports, reported apart.
    let started = Instant::now();
    load_once(sup, model.spec("warmup", true), true).await;
    let first = started.elapsed().as_secs_f64() * 1e3;
    let imports = sup
        .preloaders()
        .into_iter()
        .find(|p| p.kind == model.kind)
        .map_or(0.0, |p| p.import_ms);
    let (mut speedup, mut own) = (Rounds::new(), Rounds::new());
    for round in 0..ROUNDS {
        let (cold, forked) = if round % 2 == 0 {
            let cold = load_once(sup, model.spec("cold", false), false).await;
            (cold, load_once(sup, model.spec("forked", true), true).await)
        } else {
            let forked = load_once(sup, model.spec("forked", true), true).await;
            (
                load_once(sup, model.spec("cold", false), false).await,
                forked,
            )
        };
        speedup.push(cold.0, forked.0);
        own.push(forked.0, forked.1);
    }
    speedup.print(
        &format!("{} load: cold / forked", model.label),
        "cold",
        "forked",
        "ms",
        1.0,
    );
    own.print(
        &format!("{} forked load / its backend's own load", model.label),
        "forked load",
        "backend (weights)",
        "ms",
        1.0,
    );
    println!(
        "| {} preloader: its first forked load (imports included) | {first:.0} ms | imports {imports:.0} ms | | 1 |",
        model.label
    );
}

/// Swaps `sw` (loaded as `forked` says) under four clients; (ms from the
/// swap call to the new worker serving, requests failed).
async fn swap_once(sup: &Arc<Supervisor>, forked: bool) -> (f64, u64) {
    let name = if forked { "sw-forked" } else { "sw-cold" };
    sup.load(TORCH.spec(name, forked)).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));
    let body = serde_json::json!({ "input": ["a ship in port"], "encoding": "f32" }).to_string();
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (sup, stop, failed, body) = (
                Arc::clone(sup),
                Arc::clone(&stop),
                Arc::clone(&failed),
                body.clone(),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if sup.request(name, Body::json(body.clone())).await.is_err() {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let report = sup.swap(TORCH.spec(name, forked)).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    assert_eq!(
        matches!(
            report.load.as_ref().map(|l| &l.start),
            Some(WorkerStart::Forked { .. })
        ),
        forked
    );
    sup.unload(name).await.unwrap();
    (report.switch_ms, failed.load(Ordering::Relaxed))
}

async fn swaps(sup: &Arc<Supervisor>) {
    let mut rounds = Rounds::new();
    let mut failed = 0;
    for round in 0..4 {
        let (cold, forked) = if round % 2 == 0 {
            let cold = swap_once(sup, false).await;
            (cold, swap_once(sup, true).await)
        } else {
            let forked = swap_once(sup, true).await;
            (swap_once(sup, false).await, forked)
        };
        rounds.push(cold.0, forked.0);
        failed += cold.1 + forked.1;
    }
    rounds.print(
        "minilm-torch swap under 4 clients: call → new worker serving",
        "cold",
        "forked",
        "ms",
        1.0,
    );
    println!("| requests failed during those swaps | {failed} | | | |");
}

/// Four workers loaded as `forked` says: summed (RSS, PSS, own) MiB, and
/// the kind's preloader's (RSS, PSS) meanwhile.
async fn four(sup: &Supervisor, forked: bool) -> ((f64, f64, f64), (f64, f64)) {
    let names: Vec<String> = (0..4)
        .map(|i| format!("mem-{}-{i}", if forked { "forked" } else { "cold" }))
        .collect();
    for name in &names {
        sup.load(TORCH.spec(name, forked)).await.unwrap();
    }
    // Everything touched once, as in service.
    let body = serde_json::json!({ "input": ["a ship in port"], "encoding": "f32" }).to_string();
    for name in &names {
        sup.request(name, Body::json(body.clone())).await.unwrap();
    }
    let stats = sup.stats();
    let sum = |f: fn(&berth::ModelStatus) -> u64| {
        stats
            .iter()
            .filter(|s| names.contains(&s.name))
            .map(f)
            .sum::<u64>() as f64
            / MIB
    };
    let out = (
        sum(|s| s.rss_bytes),
        sum(|s| s.pss_bytes),
        sum(|s| s.private_bytes),
    );
    let preloader = sup
        .preloaders()
        .into_iter()
        .find(|p| p.kind == TORCH.kind && forked)
        .map(|p| (p.rss_bytes as f64 / MIB, p.pss_bytes as f64 / MIB))
        .unwrap_or_default();
    for name in &names {
        sup.unload(name).await.unwrap();
    }
    (out, preloader)
}

async fn memory(sup: &Supervisor) {
    let mut cold = Vec::new();
    let mut forked = Vec::new();
    let mut preloader = Vec::new();
    for round in 0..2 {
        if round % 2 == 0 {
            cold.push(four(sup, false).await.0);
        }
        let (workers, p) = four(sup, true).await;
        forked.push(workers);
        preloader.push((p.0, p.1, 0.0));
        if round % 2 == 1 {
            cold.push(four(sup, false).await.0);
        }
    }
    let med = |v: &[(f64, f64, f64)], i: usize| {
        median(&mut v.iter().map(|t| [t.0, t.1, t.2][i]).collect::<Vec<f64>>())
    };
    println!("\n| 4 × minilm-torch | RSS, summed | PSS, summed | own (private), summed |");
    println!("|---|---|---|---|");
    println!(
        "| cold | {:.0} MiB | {:.0} MiB | {:.0} MiB |",
        med(&cold, 0),
        med(&cold, 1),
        med(&cold, 2)
    );
    println!(
        "| forked | {:.0} MiB | {:.0} MiB | {:.0} MiB |",
        med(&forked, 0),
        med(&forked, 1),
        med(&forked, 2)
    );
    println!(
        "| the preloader, while the forked four run | {:.0} MiB | {:.0} MiB | |",
        med(&preloader, 0),
        med(&preloader, 1)
    );
}

fn main() {
    let runtime = berth_tests::bench::runtime();
    let _ = examples_python();
    println!("Warm starts ({})\n", machine());
    let run = berth_tests::bench::sections();
    runtime.block_on(async {
        let sup = Arc::new(Supervisor::new(config()));
        println!("| what | A | B | ratio A/B, median (p10–p90) | samples |");
        println!("|---|---|---|---|---|");
        if run("load") {
            loads(&sup, &TORCH).await;
            loads(&sup, &JAX).await;
        }
        if run("swap") {
            swaps(&sup).await;
        }
        if run("memory") {
            memory(&sup).await;
        }
        sup.shutdown().await;
    });
}
