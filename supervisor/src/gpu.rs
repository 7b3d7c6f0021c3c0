//! GPUs, as NVML sees them: each device's memory and each process's share
//! of it, read without the supervisor ever creating a CUDA context (a context
//! alone costs hundreds of MiB of VRAM). NVML is loaded at run time; on a
//! machine without the NVIDIA driver everything here says "no GPU" and the
//! rest of berth works as before.

use std::sync::OnceLock;

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use serde::{Deserialize, Serialize};

/// One device at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceReading {
    pub index: u32,
    pub name: String,
    pub total_bytes: u64,
    pub used_bytes: u64,
    pub free_bytes: u64,
    /// `(pid, bytes)` of the compute processes on it.
    pub processes: Vec<(u32, u64)>,
}

/// What the machine has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inventory {
    /// No usable NVIDIA driver; the reason says why.
    NoGpu(String),
    Devices(Vec<DeviceReading>),
}

/// Which GPUs a model asks for: `gpus = [0, 1]` or `gpus = "auto"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum GpuRequest {
    Devices(Vec<u32>),
    Auto(AutoWord),
}

/// The word `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AutoWord {
    Auto,
}

fn nvml() -> Result<&'static Nvml, String> {
    static NVML: OnceLock<Result<Nvml, String>> = OnceLock::new();
    NVML.get_or_init(|| {
        Nvml::init().map_err(|e| format!("no NVIDIA driver found (NVML could not be loaded: {e})"))
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Reads every device now.
pub fn inventory() -> Inventory {
    let nvml = match nvml() {
        Ok(nvml) => nvml,
        Err(reason) => return Inventory::NoGpu(reason),
    };
    let count = match nvml.device_count() {
        Ok(0) => return Inventory::NoGpu("the NVIDIA driver reports no GPU".into()),
        Ok(n) => n,
        Err(e) => return Inventory::NoGpu(format!("NVML cannot count devices: {e}")),
    };
    let mut devices = Vec::new();
    for index in 0..count {
        let Ok(device) = nvml.device_by_index(index) else {
            continue;
        };
        let Ok(memory) = device.memory_info() else {
            continue;
        };
        let processes = device
            .running_compute_processes()
            .unwrap_or_default()
            .into_iter()
            .map(|p| {
                let bytes = match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => bytes,
                    UsedGpuMemory::Unavailable => 0,
                };
                (p.pid, bytes)
            })
            .collect();
        devices.push(DeviceReading {
            index,
            name: device.name().unwrap_or_default(),
            total_bytes: memory.total,
            used_bytes: memory.used,
            free_bytes: memory.free,
            processes,
        });
    }
    Inventory::Devices(devices)
}

/// VRAM held by `pid` across `devices`; `None` when it holds none.
pub fn process_vram(devices: &[DeviceReading], pid: u32) -> Option<u64> {
    let bytes: u64 = devices
        .iter()
        .flat_map(|d| &d.processes)
        .filter(|(p, _)| *p == pid)
        .map(|(_, b)| b)
        .sum();
    (bytes > 0).then_some(bytes)
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Chooses the GPUs for a model needing `footprint` bytes of VRAM (its
/// measured peak, or 0 when unknown). `auto` takes the device with the most
/// free memory that fits; explicit devices must exist and fit. With a
/// per-GPU budget, what berth's own workers hold there counts against it.
pub fn place(
    request: &GpuRequest,
    devices: &[DeviceReading],
    footprint: u64,
    budget_per_gpu: Option<u64>,
    berth_pids: &[u32],
) -> Result<Vec<u32>, String> {
    let held_by_berth = |d: &DeviceReading| -> u64 {
        d.processes
            .iter()
            .filter(|(p, _)| berth_pids.contains(p))
            .map(|(_, b)| b)
            .sum()
    };
    let fits = |d: &DeviceReading| {
        d.free_bytes >= footprint
            && budget_per_gpu.is_none_or(|b| held_by_berth(d) + footprint <= b)
    };
    let describe = |d: &DeviceReading| {
        format!(
            "GPU {} ({}) has {} free, berth holds {}",
            d.index,
            d.name,
            gib(d.free_bytes),
            gib(held_by_berth(d))
        )
    };
    match request {
        GpuRequest::Auto(_) => devices
            .iter()
            .filter(|d| fits(d))
            .max_by_key(|d| d.free_bytes)
            .map(|d| vec![d.index])
            .ok_or_else(|| {
                format!(
                    "no GPU has {} free{}: {}",
                    gib(footprint),
                    budget_per_gpu
                        .map(|b| format!(" within the per-GPU budget of {}", gib(b)))
                        .unwrap_or_default(),
                    devices.iter().map(describe).collect::<Vec<_>>().join("; ")
                )
            }),
        GpuRequest::Devices(wanted) => {
            if wanted.is_empty() {
                return Err("`gpus` is an empty list".into());
            }
            for index in wanted {
                let device = devices.iter().find(|d| d.index == *index).ok_or_else(|| {
                    format!(
                        "there is no GPU {index} (this machine has {})",
                        devices.len()
                    )
                })?;
                if !fits(device) {
                    return Err(format!(
                        "GPU {index} cannot take {}: {}",
                        gib(footprint),
                        describe(device)
                    ));
                }
            }
            Ok(wanted.clone())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// Two H100-class devices as NVML reported them on a shared host.
    fn recorded() -> Vec<DeviceReading> {
        vec![
            DeviceReading {
                index: 0,
                name: "NVIDIA H100 80GB HBM3".into(),
                total_bytes: 80 * GIB,
                used_bytes: 60 * GIB,
                free_bytes: 20 * GIB,
                processes: vec![(4121, 30 * GIB), (777, 30 * GIB)],
            },
            DeviceReading {
                index: 1,
                name: "NVIDIA H100 80GB HBM3".into(),
                total_bytes: 80 * GIB,
                used_bytes: 10 * GIB,
                free_bytes: 70 * GIB,
                processes: vec![(4188, 10 * GIB)],
            },
        ]
    }

    #[test]
    fn auto_takes_the_device_with_the_most_free_memory_that_fits() {
        let devices = recorded();
        assert_eq!(
            place(
                &GpuRequest::Auto(AutoWord::Auto),
                &devices,
                4 * GIB,
                None,
                &[]
            ),
            Ok(vec![1])
        );
        let err = place(
            &GpuRequest::Auto(AutoWord::Auto),
            &devices,
            75 * GIB,
            None,
            &[],
        )
        .unwrap_err();
        assert!(
            err.contains("GPU 0") && err.contains("GPU 1") && err.contains("75.0 GiB"),
            "{err}"
        );
    }

    #[test]
    fn the_per_gpu_budget_counts_what_berth_holds() {
        let devices = recorded();
        // berth holds 10 GiB on GPU 1 (pid 4188) and 30 GiB on GPU 0 (pid 4121).
        let berth = [4121, 4188];
        let request = GpuRequest::Auto(AutoWord::Auto);
        assert_eq!(
            place(&request, &devices, 4 * GIB, Some(16 * GIB), &berth),
            Ok(vec![1])
        );
        let err = place(&request, &devices, 8 * GIB, Some(16 * GIB), &berth).unwrap_err();
        assert!(err.contains("per-GPU budget"), "{err}");
    }

    #[test]
    fn explicit_devices_must_exist_and_fit() {
        let devices = recorded();
        assert_eq!(
            place(&GpuRequest::Devices(vec![0]), &devices, 4 * GIB, None, &[]),
            Ok(vec![0])
        );
        let err = place(&GpuRequest::Devices(vec![2]), &devices, 0, None, &[]).unwrap_err();
        assert!(err.contains("no GPU 2") && err.contains("has 2"), "{err}");
        let err = place(&GpuRequest::Devices(vec![0]), &devices, 30 * GIB, None, &[]).unwrap_err();
        assert!(
            err.contains("GPU 0 cannot take 30.0 GiB") && err.contains("20.0 GiB free"),
            "{err}"
        );
        assert!(place(&GpuRequest::Devices(vec![]), &devices, 0, None, &[]).is_err());
    }

    #[test]
    fn per_process_vram_sums_across_devices() {
        let devices = recorded();
        assert_eq!(process_vram(&devices, 4121), Some(30 * GIB));
        assert_eq!(process_vram(&devices, 1), None);
    }

    #[test]
    fn gpus_parse_as_a_list_or_auto() {
        let list: GpuRequest = serde_json::from_str("[0, 1]").unwrap();
        assert_eq!(list, GpuRequest::Devices(vec![0, 1]));
        let auto: GpuRequest = serde_json::from_str("\"auto\"").unwrap();
        assert_eq!(auto, GpuRequest::Auto(AutoWord::Auto));
        assert!(serde_json::from_str::<GpuRequest>("\"all\"").is_err());
    }

    #[test]
    fn without_a_driver_the_inventory_says_no_gpu() {
        // On a machine with a driver this reads real devices; either way it
        // answers instead of panicking.
        match inventory() {
            Inventory::NoGpu(reason) => assert!(
                reason.contains("NVIDIA") || reason.contains("GPU"),
                "{reason}"
            ),
            Inventory::Devices(devices) => assert!(devices.iter().all(|d| d.total_bytes > 0)),
        }
    }
}
