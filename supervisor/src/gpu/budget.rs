//! The per-GPU VRAM budget once loads are measured. Placement plans a load
//! with what the model is expected to take (its declared `vram`, its last
//! measurement, or its weights' size), which for a first load can be far
//! less than it takes: three 20 GiB models of unknown size all fit a
//! 48 GiB budget on paper. Once NVML shows what berth's workers really
//! hold, this says whether a GPU is over its budget, and which idle model
//! there goes first. It decides on NVML readings it is given and reads
//! nothing itself.

use super::nvml::DeviceReading;
use super::placement::{Holder, held_on};
use crate::units::gib;

/// A GPU where berth's workers together hold more than the per-GPU budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overrun {
    pub device: u32,
    /// What berth's workers hold there (NVML's reading, or a declared share
    /// where that is more).
    pub held: u64,
    pub budget: u64,
    /// The least recently used idle model holding memory there: the one to
    /// evict first. `None`: nothing there may be evicted.
    pub victim: Option<String>,
    /// Whether evicting every idle model there would bring it within the
    /// budget.
    pub evicting_helps: bool,
    /// Each of berth's models there with what it holds, for the message.
    pub holders: Vec<String>,
}

impl Overrun {
    /// "GPU 0: berth's workers hold 61.0 GiB, past the per-GPU budget of
    /// 48.0 GiB (`a` 20.0 GiB, `b` 20.5 GiB idle, ...)".
    pub fn describe(&self) -> String {
        format!(
            "GPU {}: berth's workers hold {}, past the per-GPU budget of {} ({})",
            self.device,
            gib(self.held),
            gib(self.budget),
            self.holders.join(", ")
        )
    }
}

/// The GPU (among `only`, when given) where berth's workers are furthest
/// past `budget`, with the idle model to evict there first; `None` when
/// every GPU is within it.
pub fn overrun(
    devices: &[DeviceReading],
    budget: u64,
    holders: &[Holder],
    only: Option<&[u32]>,
) -> Option<Overrun> {
    devices
        .iter()
        .filter(|d| only.is_none_or(|o| o.contains(&d.index)))
        .filter_map(|device| {
            let held = held_by(device, holders);
            (held > budget).then_some((device, held))
        })
        .max_by_key(|(_, held)| *held)
        .map(|(device, held)| {
            let here: Vec<(&Holder, u64)> = holders
                .iter()
                .map(|h| (h, held_on(device, h)))
                .filter(|(_, bytes)| *bytes > 0)
                .collect();
            let idle: u64 = here
                .iter()
                .filter(|(h, _)| h.evictable)
                .map(|(_, b)| b)
                .sum();
            Overrun {
                device: device.index,
                held,
                budget,
                evicting_helps: held - idle <= budget,
                victim: here
                    .iter()
                    .filter(|(h, _)| h.evictable)
                    .min_by_key(|(h, _)| h.last_used)
                    .map(|(h, _)| h.model.clone()),
                holders: here
                    .iter()
                    .map(|(h, bytes)| {
                        let idle = if h.evictable { " idle" } else { "" };
                        format!("`{}` {}{idle}", h.model, gib(*bytes))
                    })
                    .collect(),
            }
        })
}

/// How full the fullest device is, as a fraction of the per-GPU `budget`
/// (past 1 when over it); 0 without a device.
pub fn fullest(devices: &[DeviceReading], budget: u64, holders: &[Holder]) -> f64 {
    devices
        .iter()
        .map(|device| held_by(device, holders) as f64 / budget.max(1) as f64)
        .fold(0.0, f64::max)
}

/// What berth's workers hold on `device`, all together.
fn held_by(device: &DeviceReading, holders: &[Holder]) -> u64 {
    holders.iter().map(|h| held_on(device, h)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GIB;

    fn device(index: u32, processes: Vec<(u32, u64)>) -> DeviceReading {
        let used: u64 = processes.iter().map(|(_, b)| b).sum();
        DeviceReading {
            index,
            name: "NVIDIA H100 80GB HBM3".into(),
            uuid: None,
            total_bytes: 80 * GIB,
            used_bytes: used,
            free_bytes: 80 * GIB - used,
            processes,
        }
    }

    fn holder(model: &str, pid: u32, gpu: u32, evictable: bool, last_used: u64) -> Holder {
        Holder {
            model: model.into(),
            pids: vec![pid],
            gpus: vec![gpu],
            reserved_bytes: 0,
            evictable,
            last_used,
        }
    }

    /// What an H100 showed with `gpu_memory_budget = "48GiB"`: three models
    /// of 20 GiB placed as "unknown size" one after the other, 61 GiB in
    /// all. Measured, the GPU is over its budget, and the least recently
    /// used idle model there goes first.
    #[test]
    fn three_measured_20_gib_models_are_past_a_48_gib_budget() {
        let devices = [
            device(0, vec![(1, 20 * GIB), (2, 20 * GIB), (3, 21 * GIB)]),
            device(1, vec![(4, 70 * GIB)]),
        ];
        let holders = [
            holder("a", 1, 0, true, 5),
            holder("b", 2, 0, true, 3),
            holder("new", 3, 0, false, 9),
            holder("elsewhere", 4, 1, true, 1),
        ];
        let over = overrun(&devices, 48 * GIB, &holders, Some(&[0])).unwrap();
        assert_eq!((over.device, over.held), (0, 61 * GIB));
        assert_eq!(over.victim.as_deref(), Some("b"));
        assert!(over.evicting_helps);
        let text = over.describe();
        assert!(
            text.contains("61.0 GiB, past the per-GPU budget of 48.0 GiB")
                && text.contains("`b` 20.0 GiB idle")
                && text.contains("`new` 21.0 GiB"),
            "{text}"
        );
        // GPU 1 is over too, and further: without `only` it comes first.
        let worst = overrun(&devices, 48 * GIB, &holders, None).unwrap();
        assert_eq!(
            (worst.device, worst.victim.as_deref()),
            (1, Some("elsewhere"))
        );
    }

    #[test]
    fn within_the_budget_or_with_nothing_idle() {
        let devices = [device(
            0,
            vec![(1, 20 * GIB), (2, 20 * GIB), (777, 30 * GIB)],
        )];
        // 777 is not berth's: it counts against the card, not the budget.
        let holders = [holder("a", 1, 0, false, 5), holder("b", 2, 0, false, 3)];
        assert_eq!(overrun(&devices, 40 * GIB, &holders, None), None);
        let over = overrun(&devices, 39 * GIB, &holders, None).unwrap();
        assert_eq!(over.victim, None, "both are busy");
        assert!(!over.evicting_helps);
        // A newcomer larger than the budget alone: evicting its idle
        // neighbour would not make it fit, so nothing is evicted for it.
        let holders = [
            holder("idle", 1, 0, true, 1),
            holder("huge", 777, 0, false, 9),
        ];
        let over = overrun(&devices, 25 * GIB, &holders, None).unwrap();
        assert_eq!(over.victim.as_deref(), Some("idle"));
        assert!(!over.evicting_helps, "{over:?}");
    }

    #[test]
    fn a_declared_share_counts_until_the_model_grows_into_it() {
        let devices = [device(0, vec![(1, 2 * GIB), (2, 20 * GIB)])];
        let share = Holder {
            reserved_bytes: 30 * GIB,
            ..holder("jax", 1, 0, true, 1)
        };
        let over = overrun(
            &devices,
            48 * GIB,
            &[share, holder("b", 2, 0, false, 2)],
            None,
        );
        assert_eq!(
            over.map(|o| (o.held, o.victim)),
            Some((50 * GIB, Some("jax".into())))
        );
    }
}
