//! Sleep's own cost, on the fake driver (`tests/fake-gpu`): no memory is
//! copied there, so what is measured is berth's path alone (the drain, the
//! helper runs of the checkpoint API, NVML read before and after), against
//! the cold way back it replaces: an unload and a load of the same
//! `gpu-hog` (spawn, handshake, CUDA context, allocation). Both in the
//! same run, in alternating rounds. On a GPU the copy over PCIe comes on
//! top of the wake (docs/gpu.md, Sleep).
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench sleep`

use std::time::Instant;

use berth_tests::bench::{Rounds, machine};
use berth_tests::fake_gpu::{FakeGpu, hog};
use serde_json::json;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    println!("Sleep on the fake driver ({})\n", machine());
    println!("| what | berth | baseline | ratio, median (p10–p90) | samples |");
    println!("|---|---|---|---|---|");
    let fake = FakeGpu::new();
    let server = fake.serve(&format!("{}sleep = \"driver\"\n", hog("nap", 1024, "[0]")));
    let post = |path: &str| {
        let started = Instant::now();
        let (status, body) = server.post(path, json!({}));
        assert_eq!(status, 200, "{path}: {body}");
        (started.elapsed().as_secs_f64(), body)
    };
    post("/api/models/nap/load");
    let mut sleeps = Rounds::new();
    let mut wakes = Rounds::new();
    for round in 0..16 {
        let warm = || {
            let (slept, _) = post("/api/models/nap/sleep");
            let (woke, _) = post("/api/models/nap/wake");
            (slept, woke)
        };
        let cold = || {
            let (stopped, _) = post("/api/models/nap/unload");
            let (loaded, _) = post("/api/models/nap/load");
            (stopped, loaded)
        };
        let ((slept, woke), (stopped, loaded)) = if round % 2 == 0 {
            let w = warm();
            (w, cold())
        } else {
            let c = cold();
            (warm(), c)
        };
        sleeps.push(slept, stopped);
        wakes.push(woke, loaded);
    }
    sleeps.print(
        "give the GPU back (1.5 GiB held)",
        "sleep (drain, lock, checkpoint, NVML)",
        "unload (graceful stop, proof)",
        "ms",
        1e3,
    );
    wakes.print(
        "have it back",
        "wake (restore, unlock, NVML)",
        "cold load of the same model",
        "ms",
        1e3,
    );
}
