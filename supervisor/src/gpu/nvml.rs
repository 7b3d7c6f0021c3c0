//! Reading NVML: the lazily loaded library, every device's memory and
//! compute processes ([`inventory`]), a device's UUID, and one process's
//! VRAM. Everything else in `gpu` works on these readings, so it can be
//! tested on recorded ones without a driver.

use std::sync::OnceLock;

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use serde::{Deserialize, Serialize};

/// One device at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceReading {
    /// NVML's index: the order of the devices' PCI bus ids.
    pub index: u32,
    pub name: String,
    /// The device's UUID (`GPU-…`), which names it to CUDA whatever order
    /// CUDA enumerates devices in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
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
            uuid: device.uuid().ok(),
            total_bytes: memory.total,
            used_bytes: memory.used,
            free_bytes: memory.free,
            processes,
        });
    }
    Inventory::Devices(devices)
}

/// The UUID of NVML's device `index`, without reading every device's
/// memory and processes as [`inventory`] does; `None` without a driver.
pub fn uuid(index: u32) -> Option<String> {
    nvml().ok()?.device_by_index(index).ok()?.uuid().ok()
}

/// The memory of NVML's device `index`, in bytes; `None` without a driver.
pub fn total_bytes(index: u32) -> Option<u64> {
    let device = nvml().ok()?.device_by_index(index).ok()?;
    device.memory_info().ok().map(|m| m.total)
}

/// VRAM held by `pids` (a worker, or an HTTP server's whole tree) across
/// `devices`; `None` when they hold none.
pub fn process_vram(devices: &[DeviceReading], pids: &[u32]) -> Option<u64> {
    let bytes: u64 = devices
        .iter()
        .flat_map(|d| &d.processes)
        .filter(|(p, _)| pids.contains(p))
        .map(|(_, b)| b)
        .sum();
    (bytes > 0).then_some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{GIB, recorded};

    #[test]
    fn per_process_vram_sums_across_devices() {
        let devices = recorded();
        assert_eq!(process_vram(&devices, &[4121]), Some(30 * GIB));
        assert_eq!(process_vram(&devices, &[4121, 4188]), Some(40 * GIB));
        assert_eq!(process_vram(&devices, &[1]), None);
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
