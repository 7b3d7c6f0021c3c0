//! The seeds' VRAM problem and berth's cure, side by side, on one GPU.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench gpu`
//!
//! - In one process that keeps running, as a framework does: a 4 GiB
//!   "model" allocated and then "unloaded" twice over — its blocks kept in a
//!   pool (what a caching allocator such as PyTorch's does), and its blocks
//!   freed with the CUDA context left alive. NVML's reading for the process
//!   says what stays held.
//! - berth: `gpu-hog` at 4 GiB loaded in a worker and unloaded; the unload
//!   report's `gpu_reclaimed_bytes` and `gpu_reclaim_ms`, and NVML's
//!   process list without the worker's pid.
//! - 50 load/unload cycles of `gpu-hog` at 512 MiB: the device's used
//!   memory before and after.
//!
//! Without an NVIDIA driver it says so and measures nothing.

use std::time::{Duration, Instant};

use berth::gpu::{DeviceReading, Inventory, inventory, process_vram};
use berth::{Body, ModelSpec, Supervisor};
use berth_tests::test_config;
use cudarc::driver::{CudaContext, CudaSlice};

const MIB: u64 = 1 << 20;
const MODEL_MIB: usize = 4096;

fn devices() -> Vec<DeviceReading> {
    match inventory() {
        Inventory::Devices(devices) => devices,
        Inventory::NoGpu(reason) => panic!("the GPU went away: {reason}"),
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / MIB as f64)
}

/// What NVML says this process holds, after the driver has had a moment.
fn own_vram() -> String {
    std::thread::sleep(Duration::from_millis(200));
    match process_vram(&devices(), &[std::process::id()]) {
        Some(bytes) => mib(bytes),
        None => "0 MiB (pid not in NVML's list)".into(),
    }
}

/// A framework's life in one process: the context is made once and lives
/// as long as the process.
fn in_process() -> (String, String, String) {
    let context = CudaContext::new(0).expect("a CUDA context on device 0");
    let stream = context.default_stream();
    let bytes = MODEL_MIB << 20;
    let model: CudaSlice<u8> = stream.alloc_zeros(bytes).expect("4 GiB on the device");
    stream.synchronize().unwrap();
    let loaded = own_vram();

    // "Unload" 1: the caching allocator keeps the blocks for later.
    let pool = vec![model];
    stream.synchronize().unwrap();
    let pooled = own_vram();

    // "Unload" 2: the blocks are freed; the context (and whatever the
    // driver keeps for it) stays.
    drop(pool);
    stream.synchronize().unwrap();
    let freed = own_vram();
    // A server process would keep its context until it exits; the bench
    // lets it go only now, after the readings, so berth's part starts clean.
    drop(stream);
    drop(context);
    (loaded, pooled, freed)
}

async fn berth_unload(sup: &Supervisor) {
    let before = devices();
    let spec = ModelSpec::new("vram", "gpu-hog").option("alloc_mib", MODEL_MIB);
    let load = sup.load(spec).await.expect("gpu-hog loads");
    let held = load.vram_bytes.unwrap_or(0);
    let started = Instant::now();
    let unload = sup.unload("vram").await.expect("gpu-hog unloads");
    let took = started.elapsed();
    let after = devices();
    let pid_gone = process_vram(&after, &[load.pid]).is_none();
    let reclaimed = unload.gpu_reclaimed_bytes.unwrap_or(0);
    println!(
        "| berth: gpu-hog {MODEL_MIB} MiB, worker stopped | {} against pid {} | 0 MiB (no process) | {} reclaimed ({:.1}% of what it held), pid {} NVML's list; unload {:.0} ms, of which the device took {:.0} ms to give the memory back |",
        mib(held),
        load.pid,
        mib(reclaimed),
        100.0 * reclaimed as f64 / held.max(1) as f64,
        if pid_gone { "gone from" } else { "STILL IN" },
        took.as_secs_f64() * 1e3,
        unload.gpu_reclaim_ms.unwrap_or(0.0),
    );
    let used_before: u64 = before.iter().map(|d| d.used_bytes).sum();
    let used_after: u64 = after.iter().map(|d| d.used_bytes).sum();
    println!(
        "| device used memory, before the load → after the unload | {} → {} | | |",
        mib(used_before),
        mib(used_after)
    );
}

async fn cycles(sup: &Supervisor) {
    const N: usize = 50;
    let before: u64 = devices().iter().map(|d| d.used_bytes).sum();
    let started = Instant::now();
    let mut unload_ms = Vec::with_capacity(N);
    for _ in 0..N {
        sup.load(ModelSpec::new("cycle", "gpu-hog").option("alloc_mib", 512))
            .await
            .expect("gpu-hog loads");
        sup.request("cycle", Body::json("{}")).await.unwrap();
        let t = Instant::now();
        sup.unload("cycle").await.unwrap();
        unload_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    std::thread::sleep(Duration::from_millis(500));
    let after: u64 = devices().iter().map(|d| d.used_bytes).sum();
    unload_ms.sort_by(f64::total_cmp);
    println!(
        "| {N} load/unload cycles of gpu-hog 512 MiB ({:.1} s) | device used {} → {} | | unload p50 {:.0} ms, max {:.0} ms |",
        started.elapsed().as_secs_f64(),
        mib(before),
        mib(after),
        unload_ms[N / 2],
        unload_ms[N - 1],
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let devices = match inventory() {
        Inventory::NoGpu(reason) => {
            println!("gpu bench: {reason}; it needs an NVIDIA GPU and measured nothing");
            return;
        }
        Inventory::Devices(devices) => devices,
    };
    for d in &devices {
        println!(
            "GPU {}: {}, {} total, {} used before the bench",
            d.index,
            d.name,
            mib(d.total_bytes),
            mib(d.used_bytes)
        );
    }
    println!();
    println!(
        "| after \"unloading\" a {MODEL_MIB} MiB model | VRAM while loaded | VRAM still held | notes |"
    );
    println!("|---|---|---|---|");
    let (loaded, pooled, freed) = in_process();
    println!(
        "| in-process, blocks kept in a pool (caching allocator) | {loaded} | {pooled} | the process keeps running |"
    );
    println!(
        "| in-process, blocks freed, CUDA context alive | {loaded} | {freed} | the context's own share stays |"
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let sup = Supervisor::new(test_config());
        berth_unload(&sup).await;
        cycles(&sup).await;
        sup.shutdown().await;
    });
}
