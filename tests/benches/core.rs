//! Core benchmarks, printed as docs/performance.md's tables.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench core`
//!
//! Against baselines measured in the same run, in alternating rounds (the
//! ratio is the median of the per-round ratios, with its 10th–90th
//! percentile spread):
//! - an `echo` round trip through berth vs a bare `ipc-channel` round trip
//!   between this process and a peer process that echoes (this bench,
//!   started again as the peer), with rounds that start from idle and
//!   rounds that start back to back (`bench::STARTS`);
//! - a 64 MiB payload through the worker in shared memory and inside the
//!   message vs two plain `memcpy`s of 64 MiB (in and out);
//! - spawn → ready for `echo` vs spawning and reaping `true`.
//!
//! `BERTH_BENCH_ANSWER_SPIN_US=0` runs it with callers that park at once
//! (`answer_spin` 0; default 100 µs).
//!
//! Without a baseline, for scale: the echo backend called in-process. The
//! unload of 1 GiB against the kernel's own is the `unload` bench.

use std::time::{Duration, Instant};

use berth::{Body, Bulk, ModelSpec, Supervisor};
use berth_protocol::LoadSpec;
use berth_tests::bench::{Rounds, STARTS, echo_config, machine, median, runtime};
use berth_worker::{LoadContext, Registry, RequestContext};
use ipc_channel::ipc::{self, IpcOneShotServer, IpcReceiver, IpcSender, IpcSharedMemory};

/// Set in the peer's environment: the one-shot server to connect to.
const PEER_ENV: &str = "BERTH_BENCH_IPC_PEER";

/// What the bare peer and this process exchange: first the peer's command
/// sender, then echoed payloads (the same JSON text berth carries).
type PeerMessage = (Option<IpcSender<String>>, String);

/// The bare peer: echoes every string back until this process goes away.
fn run_peer(server: String) {
    let events = IpcSender::<PeerMessage>::connect(server).expect("the bench's server");
    let (commands, incoming) = ipc::channel::<String>().unwrap();
    events.send((Some(commands), String::new())).unwrap();
    while let Ok(text) = incoming.recv() {
        if events.send((None, text)).is_err() {
            break;
        }
    }
}

/// A bare `ipc-channel` peer process, the same shape as a worker: one
/// channel each way, started from a one-shot server.
struct BarePeer {
    child: std::process::Child,
    commands: IpcSender<String>,
    events: IpcReceiver<PeerMessage>,
}

impl BarePeer {
    fn start() -> BarePeer {
        let (server, name) = IpcOneShotServer::<PeerMessage>::new().unwrap();
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .env(PEER_ENV, name)
            .spawn()
            .unwrap();
        let (events, (commands, _)) = server.accept().unwrap();
        BarePeer {
            child,
            commands: commands.expect("the peer's command sender"),
            events,
        }
    }

    fn round_trip(&self, text: &str) -> String {
        self.commands.send(text.to_string()).unwrap();
        self.events.recv().unwrap().1
    }
}

impl Drop for BarePeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Median seconds of `n` round trips of `f`, after `pause`.
async fn per_call<F: std::future::Future>(
    n: usize,
    pause: Duration,
    mut f: impl FnMut() -> F,
) -> f64 {
    let mut v = Vec::with_capacity(n);
    std::thread::sleep(pause);
    for _ in 0..n {
        let t = Instant::now();
        std::hint::black_box(f().await);
        v.push(t.elapsed().as_secs_f64());
    }
    median(&mut v)
}

async fn round_trips(sup: &Supervisor) {
    const PER_ROUND: usize = 300;
    const ROUNDS: usize = 30;
    let text = r#"{"input":"hello"}"#;
    sup.load(ModelSpec::new("echo", "echo")).await.unwrap();
    let worker = sup.worker("echo").unwrap();
    let peer = BarePeer::start();
    assert_eq!(peer.round_trip(text), text);
    let through_request = || async { sup.request("echo", Body::json(text)).await.unwrap() };
    let through_handle = || async { worker.call(Body::json(text)).await.unwrap() };
    let bare = || async { peer.round_trip(text) };
    for _ in 0..3 {
        per_call(PER_ROUND, Duration::ZERO, through_request).await;
        per_call(PER_ROUND, Duration::ZERO, through_handle).await;
        per_call(PER_ROUND, Duration::ZERO, bare).await;
    }
    for (start, pause) in STARTS {
        let (mut requests, mut calls) = (Rounds::new(), Rounds::new());
        for round in 0..ROUNDS {
            // Three sides: each takes each place in turn.
            let mut times = [0.0; 3];
            for k in 0..3 {
                let side = (round + k) % 3;
                times[side] = match side {
                    0 => per_call(PER_ROUND, pause, through_request).await,
                    1 => per_call(PER_ROUND, pause, through_handle).await,
                    _ => per_call(PER_ROUND, pause, bare).await,
                };
            }
            requests.push(times[0], times[2]);
            calls.push(times[1], times[2]);
        }
        requests.print(
            &format!("echo round trip, {start}"),
            "`Supervisor::request`",
            "bare `ipc-channel`",
            "µs",
            1e6,
        );
        calls.print(
            &format!("echo round trip, {start}"),
            "the worker's handle (`call`)",
            "bare `ipc-channel`",
            "µs",
            1e6,
        );
    }
    sup.unload("echo").await.unwrap();
    drop(peer);

    let spec = LoadSpec {
        name: "echo".into(),
        backend: "echo".into(),
        model: None,
        options: Default::default(),
    };
    let mut backend = Registry::builtin()
        .load(&spec, &LoadContext::standalone())
        .unwrap();
    let ctx = RequestContext::standalone();
    let local = per_call(5000, Duration::ZERO, || {
        let reply = backend.handle(Body::json(text), &ctx).unwrap();
        async move { reply }
    })
    .await;
    println!(
        "| echo call, in-process (for scale) | {:.2} µs | | | |",
        local * 1e6
    );
}

async fn bulk(sup: &Supervisor) {
    const SIZE: usize = 64 << 20;
    const ROUNDS: usize = 12;
    sup.load(ModelSpec::new("echo", "echo")).await.unwrap();
    let worker = sup.worker("echo").unwrap();
    let data: Vec<u8> = (0..SIZE).map(|i| (i % 253) as u8).collect();
    // From the caller's bytes to the answer's bytes readable: filling the
    // region (or the message) is part of the round trip.
    let round_trip = async |shared: bool| {
        let t = Instant::now();
        let bulk = if shared {
            Bulk::Shared(IpcSharedMemory::from_bytes(&data))
        } else {
            Bulk::Inline(data.clone())
        };
        let reply = worker
            .call(Body {
                json: String::new(),
                bulk,
            })
            .await
            .unwrap();
        let back = reply.bulk_bytes();
        assert_eq!(back.len(), SIZE);
        // Read the answer, as a caller would: a page of every 4 KiB.
        std::hint::black_box(back.iter().step_by(4096).map(|&b| b as u64).sum::<u64>());
        t.elapsed().as_secs_f64()
    };
    let mut dst = vec![0u8; SIZE];
    let mut copies = || {
        let t = Instant::now();
        // In, into memory already mapped; out, into fresh memory (as the
        // worker's answer is).
        dst.copy_from_slice(std::hint::black_box(&data));
        let back = std::hint::black_box(&dst).clone();
        std::hint::black_box(back.iter().step_by(4096).map(|&b| b as u64).sum::<u64>());
        t.elapsed().as_secs_f64()
    };
    let (mut shared, mut inline) = (Rounds::new(), Rounds::new());
    round_trip(true).await;
    for round in 0..ROUNDS {
        // The baseline goes first in odd rounds, last in even ones.
        let before = (round % 2 == 1).then(&mut copies);
        let a = round_trip(true).await;
        let c = round_trip(false).await;
        let b = before.unwrap_or_else(&mut copies);
        shared.push(a, b);
        inline.push(c, b);
    }
    shared.print(
        "64 MiB round trip",
        "in a new shared region",
        "two `memcpy`s of 64 MiB",
        "ms",
        1e3,
    );
    inline.print(
        "64 MiB round trip",
        "inside the message",
        "two `memcpy`s of 64 MiB",
        "ms",
        1e3,
    );
    sup.unload("echo").await.unwrap();
}

async fn spawn_to_ready(sup: &Supervisor) {
    const ROUNDS: usize = 30;
    let spawn_true = || {
        let t = Instant::now();
        std::process::Command::new("true").status().unwrap();
        t.elapsed().as_secs_f64()
    };
    let mut loads = Rounds::new();
    let mut unloads = Vec::new();
    for round in 0..ROUNDS {
        let b = if round % 2 == 1 { spawn_true() } else { 0.0 };
        let t = Instant::now();
        sup.load(ModelSpec::new("echo", "echo")).await.unwrap();
        let a = t.elapsed().as_secs_f64();
        let b = if round % 2 == 0 { spawn_true() } else { b };
        loads.push(a, b);
        let t = Instant::now();
        sup.unload("echo").await.unwrap();
        unloads.push(t.elapsed());
    }
    loads.print(
        "spawn → ready",
        "`echo` worker",
        "spawn and reap `true`",
        "ms",
        1e3,
    );
    unloads.sort();
    println!(
        "| unload (graceful), `echo` | {:.1} ms | | | |",
        unloads[unloads.len() / 2].as_secs_f64() * 1e3
    );
}

fn main() {
    if let Ok(server) = std::env::var(PEER_ENV) {
        return run_peer(server);
    }
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    runtime().block_on(async {
        let config = echo_config();
        let spin = config.answer_spin;
        let sup = Supervisor::new(config);
        println!("Core ({}; answer_spin {spin:?})\n", machine());
        println!("| what | berth | baseline | ratio, median (p10–p90) | samples |");
        println!("|---|---|---|---|---|");
        round_trips(&sup).await;
        bulk(&sup).await;
        spawn_to_ready(&sup).await;
        sup.shutdown().await;
    });
}
