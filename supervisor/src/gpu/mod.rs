//! GPUs, as NVML sees them: each device's memory and each process's share
//! of it, read without the supervisor ever creating a CUDA context (a context
//! alone costs hundreds of MiB of VRAM). NVML is loaded at run time; on a
//! machine without the NVIDIA driver everything here says "no GPU" and the
//! rest of berth works as before.
//!
//! One concern per file: `nvml` reads the devices, `status` is what
//! `/api/gpus`, `berth gpus` and the metrics show, `placement` decides
//! which devices a model's worker goes on within the VRAM budget, `budget`
//! says which GPU is past that budget once loads are measured, and
//! `frameworks` tells the worker's frameworks (JAX) its share of a card.

mod budget;
mod frameworks;
mod nvml;
mod placement;
mod status;

pub use budget::{Overrun, fullest, overrun};
pub use frameworks::{VRAM_BYTES, fraction_base, fraction_conflict, framework_env};
pub use nvml::{DeviceReading, Inventory, inventory, process_vram, total_bytes, uuid};
pub use placement::{AutoWord, GpuRequest, Holder, Plan, plan, worker_env};
pub use status::{DeviceStatus, GpuProcess, GpuStatus};

#[cfg(test)]
const GIB: u64 = 1 << 30;

/// Two H100-class devices as NVML reported them on a shared host: the
/// readings the tests of every file here work on.
#[cfg(test)]
fn recorded() -> Vec<DeviceReading> {
    vec![
        DeviceReading {
            index: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            uuid: Some("GPU-5a1c3e7b-93f0-2d4e-8c61-0b7d9e2f4a10".into()),
            total_bytes: 80 * GIB,
            used_bytes: 60 * GIB,
            free_bytes: 20 * GIB,
            processes: vec![(4121, 30 * GIB), (777, 30 * GIB)],
        },
        DeviceReading {
            index: 1,
            name: "NVIDIA H100 80GB HBM3".into(),
            uuid: None,
            total_bytes: 80 * GIB,
            used_bytes: 10 * GIB,
            free_bytes: 70 * GIB,
            processes: vec![(4188, 10 * GIB)],
        },
    ]
}
