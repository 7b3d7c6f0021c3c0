//! Where a model's worker goes: the `gpus` a model asks for, the plan that
//! places it on devices with room (within the per-GPU VRAM budget, evicting
//! the least recently used idle model when that makes room), and the
//! environment that puts the worker on the chosen devices. It decides on
//! NVML readings it is given and reads nothing itself.

use serde::{Deserialize, Serialize};

use super::nvml::DeviceReading;
use crate::units::gib;

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

/// The environment that puts a worker on NVML's devices `gpus`.
///
/// CUDA numbers devices fastest first unless told otherwise, NVML by PCI
/// bus id; on a machine with mixed GPUs `CUDA_VISIBLE_DEVICES=1` would name
/// another device than NVML's 1. So each device is named by its UUID where
/// NVML gives one, and `CUDA_DEVICE_ORDER=PCI_BUS_ID` makes any plain index
/// mean what it means to NVML.
/// `uuid_of` gives a device's UUID by NVML index ([`uuid`](super::uuid) in
/// production).
pub fn worker_env(gpus: &[u32], uuid_of: impl Fn(u32) -> Option<String>) -> Vec<(String, String)> {
    let visible: Vec<String> = gpus
        .iter()
        .map(|&index| uuid_of(index).unwrap_or_else(|| index.to_string()))
        .collect();
    let indices: Vec<String> = gpus.iter().map(u32::to_string).collect();
    vec![
        ("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()),
        ("CUDA_VISIBLE_DEVICES".into(), visible.join(",")),
        (berth_protocol::ENV_GPUS.into(), indices.join(",")),
    ]
}

/// One of berth's workers as placement sees it: where it runs, and whether
/// eviction may stop it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub model: String,
    /// The worker's pids (an HTTP server's whole tree: vLLM keeps its
    /// memory in an engine process of its own); none for a load whose
    /// process NVML cannot yet be tied to (its reservation stands in).
    pub pids: Vec<u32>,
    /// The devices it was placed on.
    pub gpus: Vec<u32>,
    /// VRAM counted on each of `gpus` at least: a load's still in progress,
    /// or a declared share (`vram`) for as long as its worker runs.
    pub reserved_bytes: u64,
    /// Ready, idle and not being replaced: eviction may stop it.
    pub evictable: bool,
    /// Larger is more recent; eviction takes the smallest first.
    pub last_used: u64,
}

/// What to do to place a model on GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// It fits on these devices now.
    Place(Vec<u32>),
    /// It would fit once this idle model is unloaded: unload it and plan
    /// again (the least recently used idle model on a device that helps).
    Evict(String),
    /// It cannot fit, even with every idle model evicted; the reason says
    /// what each device has.
    Refuse(String),
    /// The request itself is wrong (a device that does not exist).
    Invalid(String),
}

/// What `holder` has on `device`: NVML's reading for its pid, or its
/// reservation if that is more (a load still allocating).
pub(super) fn held_on(device: &DeviceReading, holder: &Holder) -> u64 {
    let seen = seen_on(device, holder);
    if holder.gpus.contains(&device.index) {
        seen.max(holder.reserved_bytes)
    } else {
        seen
    }
}

/// What NVML shows `holder`'s pids holding on `device`.
fn seen_on(device: &DeviceReading, holder: &Holder) -> u64 {
    device
        .processes
        .iter()
        .filter(|(p, _)| holder.pids.contains(p))
        .map(|(_, b)| b)
        .sum()
}

/// One device with berth's share of it worked out.
struct Room<'a> {
    device: &'a DeviceReading,
    /// Free memory less what loads in progress will still take.
    free: u64,
    /// What berth's workers hold or have reserved here.
    berth: u64,
    /// What evicting every idle berth model here would give back.
    idle: u64,
}

impl Room<'_> {
    fn new<'a>(device: &'a DeviceReading, holders: &[Holder]) -> Room<'a> {
        let mut berth = 0;
        let mut pending = 0;
        let mut idle = 0;
        for holder in holders {
            let held = held_on(device, holder);
            berth += held;
            if holder.gpus.contains(&device.index) {
                pending += holder
                    .reserved_bytes
                    .saturating_sub(seen_on(device, holder));
            }
            if holder.evictable {
                idle += held;
            }
        }
        Room {
            device,
            free: device.free_bytes.saturating_sub(pending),
            berth,
            idle,
        }
    }

    /// Whether `footprint` fits here once `freed` bytes of berth's are gone.
    fn fits(&self, footprint: u64, freed: u64, budget: Option<u64>) -> bool {
        self.free + freed >= footprint
            && budget.is_none_or(|b| self.berth.saturating_sub(freed) + footprint <= b)
    }

    fn describe(&self) -> String {
        format!(
            "GPU {} ({}) has {} free, berth holds {} ({} of it idle)",
            self.device.index,
            self.device.name,
            gib(self.free),
            gib(self.berth),
            gib(self.idle)
        )
    }
}

/// Decides where a model needing `footprint` bytes of VRAM goes (its
/// measured footprint, or 0 when unknown). `auto` takes the device with the
/// most free memory that fits; explicit devices must exist and fit. With a
/// per-GPU budget, what berth's own workers hold there counts against it.
/// When nothing fits, the same rule as for RAM applies: the least recently
/// used idle model on a device where eviction would make room goes first.
pub fn plan(
    request: &GpuRequest,
    devices: &[DeviceReading],
    footprint: u64,
    budget_per_gpu: Option<u64>,
    holders: &[Holder],
) -> Plan {
    let rooms: Vec<Room> = devices.iter().map(|d| Room::new(d, holders)).collect();
    let room = |index: u32| rooms.iter().find(|r| r.device.index == index);
    let within = budget_per_gpu
        .map(|b| format!(" within the per-GPU budget of {}", gib(b)))
        .unwrap_or_default();
    // The devices eviction may help on, or the reason none can.
    let short: Vec<&Room> = match request {
        GpuRequest::Auto(_) => {
            if let Some(best) = rooms
                .iter()
                .filter(|r| r.fits(footprint, 0, budget_per_gpu))
                .max_by_key(|r| r.free)
            {
                return Plan::Place(vec![best.device.index]);
            }
            let helped: Vec<&Room> = rooms
                .iter()
                .filter(|r| r.fits(footprint, r.idle, budget_per_gpu))
                .collect();
            if helped.is_empty() {
                return Plan::Refuse(format!(
                    "no GPU has {} free{within}, even with every idle model evicted: {}",
                    gib(footprint),
                    rooms
                        .iter()
                        .map(Room::describe)
                        .collect::<Vec<_>>()
                        .join("; ")
                ));
            }
            helped
        }
        GpuRequest::Devices(wanted) => {
            if wanted.is_empty() {
                return Plan::Invalid("`gpus` is an empty list".into());
            }
            let mut short = Vec::new();
            for index in wanted {
                let Some(r) = room(*index) else {
                    return Plan::Invalid(format!(
                        "there is no GPU {index} (this machine has {})",
                        devices.len()
                    ));
                };
                if r.fits(footprint, 0, budget_per_gpu) {
                    continue;
                }
                if !r.fits(footprint, r.idle, budget_per_gpu) {
                    return Plan::Refuse(format!(
                        "GPU {index} cannot take {}{within}, even with every idle model evicted: {}",
                        gib(footprint),
                        r.describe()
                    ));
                }
                short.push(r);
            }
            if short.is_empty() {
                return Plan::Place(wanted.clone());
            }
            short
        }
    };
    holders
        .iter()
        .filter(|h| h.evictable && short.iter().any(|r| held_on(r.device, h) > 0))
        .min_by_key(|h| h.last_used)
        .map(|h| Plan::Evict(h.model.clone()))
        .unwrap_or_else(|| {
            Plan::Refuse(format!(
                "no GPU has {} free{within}: {}",
                gib(footprint),
                rooms
                    .iter()
                    .map(Room::describe)
                    .collect::<Vec<_>>()
                    .join("; ")
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{GIB, recorded};

    const AUTO: GpuRequest = GpuRequest::Auto(AutoWord::Auto);

    fn worker(model: &str, pid: u32, gpu: u32, evictable: bool, last_used: u64) -> Holder {
        Holder {
            model: model.into(),
            pids: vec![pid],
            gpus: vec![gpu],
            reserved_bytes: 0,
            evictable,
            last_used,
        }
    }

    #[test]
    fn auto_takes_the_device_with_the_most_free_memory_that_fits() {
        let devices = recorded();
        assert_eq!(
            plan(&AUTO, &devices, 4 * GIB, None, &[]),
            Plan::Place(vec![1])
        );
        let Plan::Refuse(err) = plan(&AUTO, &devices, 75 * GIB, None, &[]) else {
            panic!("75 GiB fits nowhere");
        };
        assert!(
            err.contains("GPU 0") && err.contains("GPU 1") && err.contains("75.0 GiB"),
            "{err}"
        );
    }

    #[test]
    fn the_per_gpu_budget_counts_what_berth_holds() {
        let devices = recorded();
        // berth holds 30 GiB on GPU 0 (pid 4121) and 10 GiB on GPU 1 (pid
        // 4188), both busy.
        let berth = [
            worker("a", 4121, 0, false, 1),
            worker("b", 4188, 1, false, 2),
        ];
        assert_eq!(
            plan(&AUTO, &devices, 4 * GIB, Some(16 * GIB), &berth),
            Plan::Place(vec![1])
        );
        let Plan::Refuse(err) = plan(&AUTO, &devices, 8 * GIB, Some(16 * GIB), &berth) else {
            panic!("nothing idle to evict");
        };
        assert!(err.contains("per-GPU budget"), "{err}");
        assert!(
            err.contains("berth holds 10.0 GiB (0.0 GiB of it idle)"),
            "{err}"
        );
    }

    #[test]
    fn explicit_devices_must_exist_and_fit() {
        let devices = recorded();
        assert_eq!(
            plan(&GpuRequest::Devices(vec![0]), &devices, 4 * GIB, None, &[]),
            Plan::Place(vec![0])
        );
        let Plan::Invalid(err) = plan(&GpuRequest::Devices(vec![2]), &devices, 0, None, &[]) else {
            panic!("there is no GPU 2");
        };
        assert!(err.contains("no GPU 2") && err.contains("has 2"), "{err}");
        let Plan::Refuse(err) = plan(&GpuRequest::Devices(vec![0]), &devices, 30 * GIB, None, &[])
        else {
            panic!("GPU 0 has 20 GiB free");
        };
        assert!(
            err.contains("GPU 0 cannot take 30.0 GiB") && err.contains("20.0 GiB free"),
            "{err}"
        );
        assert!(matches!(
            plan(&GpuRequest::Devices(vec![]), &devices, 0, None, &[]),
            Plan::Invalid(_)
        ));
    }

    #[test]
    fn a_full_budget_evicts_the_least_recently_used_idle_model_on_that_gpu() {
        let mut devices = recorded();
        // GPU 1 now holds three berth workers of 10 GiB; 777 on GPU 0 is not
        // berth's.
        devices[1].processes = vec![(10, 10 * GIB), (11, 10 * GIB), (12, 10 * GIB)];
        devices[1].used_bytes = 30 * GIB;
        devices[1].free_bytes = 50 * GIB;
        let berth = [
            worker("busy", 10, 1, false, 1),
            worker("old", 11, 1, true, 2),
            worker("recent", 12, 1, true, 3),
            worker("elsewhere", 4121, 0, true, 0),
        ];
        let request = GpuRequest::Devices(vec![1]);
        // 30 GiB held + 8 > 32: the oldest idle model on GPU 1 goes, not the
        // older one on GPU 0 (evicting it would not help) nor the busy one.
        assert_eq!(
            plan(&request, &devices, 8 * GIB, Some(32 * GIB), &berth),
            Plan::Evict("old".into())
        );
        // With it gone, NVML no longer lists pid 11 and the model fits.
        devices[1].processes.retain(|(p, _)| *p != 11);
        devices[1].free_bytes += 10 * GIB;
        assert_eq!(
            plan(&request, &devices, 8 * GIB, Some(32 * GIB), &berth[..1]),
            Plan::Place(vec![1])
        );
        // More than evicting every idle model can give: refused up front,
        // nothing is evicted for nothing.
        let Plan::Refuse(err) = plan(&request, &devices, 30 * GIB, Some(32 * GIB), &berth) else {
            panic!("the busy 10 GiB stays");
        };
        assert!(err.contains("even with every idle model evicted"), "{err}");
    }

    #[test]
    fn auto_evicts_only_where_eviction_makes_room() {
        let devices = recorded();
        // Free memory: 20 GiB on GPU 0, 70 GiB on GPU 1. berth's idle model
        // on GPU 0 holds 30 GiB; its busy one on GPU 1 holds 10 GiB.
        let berth = [
            worker("idle0", 4121, 0, true, 5),
            worker("busy1", 4188, 1, false, 1),
        ];
        // 75 GiB: GPU 1 cannot get there (busy), GPU 0 neither (20 + 30).
        assert!(matches!(
            plan(&AUTO, &devices, 75 * GIB, None, &berth),
            Plan::Refuse(_)
        ));
        // 45 GiB under a 40 GiB budget: GPU 1 has the memory but 10 + 45 is
        // over budget with nothing idle there; GPU 0 would have 50 GiB free
        // once idle0 goes, but 45 is over budget on its own.
        assert!(matches!(
            plan(&AUTO, &devices, 45 * GIB, Some(40 * GIB), &berth),
            Plan::Refuse(_)
        ));
        // 40 GiB under a 45 GiB budget: GPU 1 would hold 10 + 40 > 45; GPU 0
        // fits once idle0 goes (50 GiB free, 40 ≤ 45).
        assert_eq!(
            plan(&AUTO, &devices, 40 * GIB, Some(45 * GIB), &berth),
            Plan::Evict("idle0".into())
        );
    }

    #[test]
    fn a_load_in_progress_counts_its_reservation_until_nvml_shows_it() {
        let devices = recorded();
        // A 60 GiB load on GPU 1 that has not allocated yet: 70 GiB free
        // is really 10.
        let loading = Holder {
            model: "loading".into(),
            pids: Vec::new(),
            gpus: vec![1],
            reserved_bytes: 60 * GIB,
            evictable: false,
            last_used: 9,
        };
        assert_eq!(
            plan(
                &AUTO,
                &devices,
                15 * GIB,
                None,
                std::slice::from_ref(&loading)
            ),
            Plan::Place(vec![0])
        );
        // Once NVML sees the worker (pid 4188 holding 10 GiB of its 60),
        // only the other 50 are still to come: 20 GiB fit, 25 do not.
        let seen = [Holder {
            pids: vec![4188],
            ..loading
        }];
        let gpu1 = GpuRequest::Devices(vec![1]);
        assert_eq!(
            plan(&gpu1, &devices, 20 * GIB, None, &seen),
            Plan::Place(vec![1])
        );
        assert_eq!(
            plan(&gpu1, &devices, 25 * GIB, None, &seen),
            Plan::Refuse(
                "GPU 1 cannot take 25.0 GiB, even with every idle model evicted: \
                 GPU 1 (NVIDIA H100 80GB HBM3) has 20.0 GiB free, berth holds 60.0 GiB \
                 (0.0 GiB of it idle)"
                    .into()
            )
        );
    }

    #[test]
    fn workers_name_their_gpus_to_cuda_by_uuid_in_nvml_order() {
        let devices = recorded();
        let env = worker_env(&[1, 0], |index| {
            devices
                .iter()
                .find(|d| d.index == index)
                .and_then(|d| d.uuid.clone())
        });
        let get = |key: &str| {
            env.iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
                .unwrap()
        };
        // GPU 1's reading has no UUID: its index stands, in PCI bus order.
        assert_eq!(
            get("CUDA_VISIBLE_DEVICES"),
            "1,GPU-5a1c3e7b-93f0-2d4e-8c61-0b7d9e2f4a10"
        );
        assert_eq!(get("CUDA_DEVICE_ORDER"), "PCI_BUS_ID");
        assert_eq!(get(berth_protocol::ENV_GPUS), "1,0");
    }

    #[test]
    fn gpus_parse_as_a_list_or_auto() {
        let list: GpuRequest = serde_json::from_str("[0, 1]").unwrap();
        assert_eq!(list, GpuRequest::Devices(vec![0, 1]));
        let auto: GpuRequest = serde_json::from_str("\"auto\"").unwrap();
        assert_eq!(auto, GpuRequest::Auto(AutoWord::Auto));
        assert!(serde_json::from_str::<GpuRequest>("\"all\"").is_err());
    }
}
