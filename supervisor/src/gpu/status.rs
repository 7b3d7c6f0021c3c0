//! The GPUs as people see them: each device's memory and which of its
//! compute processes are berth's workers, by model. `GET /api/gpus`,
//! `berth gpus` and `/metrics` all show this view.

use serde::{Deserialize, Serialize};

use super::nvml::Inventory;

/// The GPUs as `berth gpus` and `GET /api/gpus` show them: each device's
/// memory, and which of its processes are berth's workers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuStatus {
    /// Why no device is listed (no driver, or the driver sees none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
    pub devices: Vec<DeviceStatus>,
}

/// One device, with berth's share of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStatus {
    pub index: u32,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    pub total_bytes: u64,
    pub used_bytes: u64,
    pub free_bytes: u64,
    /// What berth's workers hold here together.
    pub berth_bytes: u64,
    pub processes: Vec<GpuProcess>,
}

/// A compute process on a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    pub pid: u32,
    pub bytes: u64,
    /// The model whose worker it is; `None`: not one of berth's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl GpuStatus {
    /// `inventory` with each process that is one of `workers` (`(pid,
    /// model)`) named.
    pub fn new(inventory: Inventory, workers: &[(u32, String)]) -> GpuStatus {
        let devices = match inventory {
            Inventory::NoGpu(reason) => {
                return GpuStatus {
                    unavailable: Some(reason),
                    devices: Vec::new(),
                };
            }
            Inventory::Devices(devices) => devices,
        };
        let model_of = |pid: u32| {
            workers
                .iter()
                .find(|(p, _)| *p == pid)
                .map(|(_, m)| m.clone())
        };
        GpuStatus {
            unavailable: None,
            devices: devices
                .into_iter()
                .map(|d| {
                    let processes: Vec<GpuProcess> = d
                        .processes
                        .iter()
                        .map(|&(pid, bytes)| GpuProcess {
                            pid,
                            bytes,
                            model: model_of(pid),
                        })
                        .collect();
                    DeviceStatus {
                        index: d.index,
                        name: d.name,
                        uuid: d.uuid,
                        total_bytes: d.total_bytes,
                        used_bytes: d.used_bytes,
                        free_bytes: d.free_bytes,
                        berth_bytes: processes
                            .iter()
                            .filter(|p| p.model.is_some())
                            .map(|p| p.bytes)
                            .sum(),
                        processes,
                    }
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{GIB, recorded};

    #[test]
    fn the_gpu_status_names_berths_workers() {
        let status = GpuStatus::new(Inventory::Devices(recorded()), &[(4188, "smollm2".into())]);
        assert_eq!(status.unavailable, None);
        assert_eq!(status.devices[0].berth_bytes, 0);
        assert_eq!(status.devices[1].berth_bytes, 10 * GIB);
        assert_eq!(
            status.devices[1].processes,
            vec![GpuProcess {
                pid: 4188,
                bytes: 10 * GIB,
                model: Some("smollm2".into())
            }]
        );
        assert_eq!(status.devices[0].processes[1].model, None);
        let none = GpuStatus::new(Inventory::NoGpu("no NVIDIA driver found".into()), &[]);
        assert_eq!(
            serde_json::to_value(&none).unwrap(),
            serde_json::json!({"unavailable": "no NVIDIA driver found", "devices": []})
        );
    }
}
