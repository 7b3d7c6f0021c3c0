//! The Python worker's costs, each beside its baseline in the same run,
//! interleaved (A B A B ...) so that noise on a shared machine lands on both
//! sides; docs/performance.md's "Workers in Python" table.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench python`
//!
//! - echo round trip through berth to `python3 -m berth_worker` vs a bare
//!   Python echo over the same kind of socket and framing, with rounds that
//!   start from idle and rounds that start back to back (`bench::STARTS`);
//! - 64 MiB of bulk bytes through the Python echo (a sealed memfd each way)
//!   vs two plain memcpys of 64 MiB;
//! - spawn to ready for a Python worker vs `python3 -c pass`.
//!
//! Sections alone: `... --bench python -- echo | bulk | spawn`.
//!
//! Each line gives medians, and the median ratio of per-round medians with
//! its 10th-90th percentile spread. `BERTH_BENCH_ANSWER_SPIN_US=0` runs it
//! with callers that park at once (`answer_spin`), as the core bench.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::time::Instant;

use berth::{Body, Bulk, ModelSpec, Supervisor};
use berth_tests::bench::{Rounds, STARTS, echo_config, machine, median, timed};
use berth_tests::python::{python_worker_command, repo_root, test_python};

/// The bare baseline: `bare_echo.py` on one end of a socket pair.
struct Bare {
    sock: UnixStream,
    child: std::process::Child,
}

impl Bare {
    fn start() -> Bare {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let fd = theirs.as_raw_fd();
        let mut command = std::process::Command::new(test_python());
        command
            .arg(repo_root().join("tests/python/bare_echo.py"))
            .env("BERTH_FD", "3");
        // SAFETY: dup2 between fork and exec is async-signal-safe.
        unsafe {
            command.pre_exec(move || {
                if libc::dup2(fd, 3) != 3 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().unwrap();
        drop(theirs);
        Bare { sock: ours, child }
    }

    fn round_trip(&mut self, frame: &[u8], buf: &mut [u8]) {
        self.sock.write_all(frame).unwrap();
        self.sock.read_exact(&mut buf[..frame.len()]).unwrap();
    }
}

impl Drop for Bare {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn round_trips(sup: &Supervisor, run: &impl Fn(&str) -> bool) {
    sup.load(ModelSpec::new("py-echo", "echo").command(python_worker_command()))
        .await
        .unwrap();
    let worker = sup.worker("py-echo").unwrap();
    if run("echo") {
        echoes(&worker).await;
    }
    if run("bulk") {
        bulk(&worker).await;
    }
    sup.unload("py-echo").await.unwrap();
}

async fn echoes(worker: &berth::WorkerHandle) {
    let body = || Body::json(r#"{"input":"hello"}"#);
    let frame = berth_protocol::stream::frame(
        br#"{"type":"request","id":1,"body":{"input":"hello"}}"#,
        &[],
    );
    let mut bare = Bare::start();
    let mut buf = vec![0u8; 1024];
    for _ in 0..300 {
        worker.call(body()).await.unwrap();
        bare.round_trip(&frame, &mut buf);
    }
    for (start, pause) in STARTS {
        let mut rounds = Rounds::new();
        for _ in 0..30 {
            let mut v = Vec::with_capacity(200);
            std::thread::sleep(pause);
            for _ in 0..200 {
                let t = Instant::now();
                worker.call(body()).await.unwrap();
                v.push(t.elapsed().as_secs_f64());
            }
            rounds.a.push(median(&mut v));
            std::thread::sleep(pause);
            rounds
                .b
                .push(timed(200, || bare.round_trip(&frame, &mut buf)));
        }
        rounds.print(
            &format!("echo round trip, {start}"),
            "berth → Python worker",
            "bare Python socket",
            "µs",
            1e6,
        );
    }
}

async fn bulk(worker: &berth::WorkerHandle) {
    const BULK: usize = 64 << 20;
    let bytes: Vec<u8> = (0..BULK).map(|i| (i % 251) as u8).collect();
    let mut copy = vec![0u8; BULK];
    let mut rounds = Rounds::new();
    for _ in 0..10 {
        let body = Body {
            json: "{}".into(),
            bulk: Bulk::Inline(bytes.clone()),
        };
        let t = Instant::now();
        let reply = worker.call(body).await.unwrap();
        assert_eq!(reply.bulk_bytes().len(), BULK);
        rounds.a.push(t.elapsed().as_secs_f64());
        rounds.b.push(timed(3, || {
            copy.copy_from_slice(&bytes);
            std::hint::black_box(&copy);
            copy.copy_from_slice(&bytes);
            std::hint::black_box(&copy);
        }));
    }
    rounds.print(
        "64 MiB bulk, round trip",
        "berth → Python (memfd each way)",
        "2 × memcpy",
        "ms",
        1e3,
    );
}

async fn spawn_to_ready(sup: &Supervisor) {
    let mut rounds = Rounds::new();
    for _ in 0..10 {
        let load = sup
            .load(ModelSpec::new("py-spawn", "echo").command(python_worker_command()))
            .await
            .unwrap();
        sup.unload("py-spawn").await.unwrap();
        rounds.a.push(load.load_ms / 1e3);
        let t = Instant::now();
        let status = std::process::Command::new(test_python())
            .args(["-c", "pass"])
            .status()
            .unwrap();
        assert!(status.success());
        rounds.b.push(t.elapsed().as_secs_f64());
    }
    rounds.print(
        "spawn → ready",
        "Python worker",
        "`python3 -c pass`",
        "ms",
        1e3,
    );
}

fn main() {
    let runtime = berth_tests::bench::runtime();
    let _ = test_python();
    let config = echo_config();
    println!(
        "Python workers ({}; answer_spin {:?})\n",
        machine(),
        config.answer_spin
    );
    println!("| what | berth | baseline | ratio, median (p10–p90) | samples |");
    println!("|---|---|---|---|---|");
    let run = berth_tests::bench::sections();
    runtime.block_on(async {
        let sup = Supervisor::new(config);
        if run("echo") || run("bulk") {
            round_trips(&sup, &run).await;
        }
        if run("spawn") {
            spawn_to_ready(&sup).await;
        }
        sup.shutdown().await;
    });
}
