//! The scheduler's choice for a model that can sleep and holds GPU room
//! another load needs: sleep, when host memory holds its copy and its wake
//! beats its cold load; else stop. Said in the `evicted` event.

use std::time::Duration;

use crate::error::Error;
use crate::gpu;
use crate::supervisor::{EventKind, Supervisor};

/// The bandwidth a wake is reckoned at: host to device over PCIe, well
/// below a Gen4 x16 link's, so the estimate errs towards stopping.
const WAKE_BYTES_PER_S: f64 = 8e9;
/// What a wake costs besides the copy (the driver's steps, the helper).
const WAKE_OVERHEAD: Duration = Duration::from_millis(100);
/// Host memory kept free beyond a sleeping model's copy.
const HOST_MARGIN: u64 = 1 << 30;

/// Whether a model holding `vram` bytes on its GPUs, whose cold load took
/// `cold_load`, sleeps rather than stops to make room: `Ok` says why it
/// sleeps, `Err` why it is stopped instead. `available`: the host's
/// available memory; `budget_left`: what `memory_budget` leaves, if set.
pub(in crate::supervisor) fn sleep_choice(
    vram: u64,
    available: u64,
    budget_left: Option<u64>,
    cold_load: Duration,
) -> std::result::Result<String, String> {
    use crate::units::{format_duration, mib};
    if vram == 0 {
        return Err("stopped, not put to sleep: NVML shows no GPU memory held by it".into());
    }
    let wake = WAKE_OVERHEAD + Duration::from_secs_f64(vram as f64 / WAKE_BYTES_PER_S);
    // Said to the 10 ms: an estimate.
    let wake = Duration::from_millis(wake.as_millis() as u64 / 10 * 10);
    let cold_load = Duration::from_millis(cold_load.as_millis() as u64);
    if available < vram.saturating_add(HOST_MARGIN) {
        return Err(format!(
            "stopped, not put to sleep: host memory ({} available) cannot hold its {} copy \
             and a GiB to spare",
            mib(available),
            mib(vram)
        ));
    }
    if let Some(left) = budget_left
        && left < vram
    {
        return Err(format!(
            "stopped, not put to sleep: `memory_budget` leaves {}, less than its {} copy",
            mib(left),
            mib(vram)
        ));
    }
    if wake >= cold_load {
        return Err(format!(
            "stopped, not put to sleep: its wake (about {} for {}) would not beat its cold \
             load ({})",
            format_duration(wake),
            mib(vram),
            format_duration(cold_load)
        ));
    }
    Ok(format!(
        "asleep instead of stopped: its wake (about {} for {}) beats its cold load ({}), and \
         host memory holds its copy",
        format_duration(wake),
        mib(vram),
        format_duration(cold_load)
    ))
}

impl Supervisor {
    /// `victim` gives its GPU room up for `model` by sleeping, where it can
    /// and that is the cheaper way back ([`sleep_choice`]); `Err` carries
    /// why it is to be stopped instead (`None`: it cannot sleep at all).
    pub(in crate::supervisor) async fn sleep_for(
        &self,
        victim: &str,
        model: &str,
        why: crate::supervisor::admission::Why,
        devices: &[gpu::DeviceReading],
    ) -> std::result::Result<(), Option<String>> {
        let budget = self.config().memory_budget;
        let (pids, cold_load, budget_left) = {
            let state = self.lock();
            let Some(entry) = state.catalogue.get(victim) else {
                return Err(None);
            };
            if entry.spec.sleep.is_none() {
                return Err(None);
            }
            let Some(slot) = state.slots.get(victim) else {
                return Err(None);
            };
            let Some(worker) = &slot.worker else {
                return Err(None);
            };
            let cold_load = slot
                .report
                .as_ref()
                .map(|r| Duration::from_secs_f64(r.load_ms.max(0.0) / 1e3))
                .unwrap_or_default();
            let used = crate::supervisor::room::room(&state, victim).used;
            let budget_left = budget.map(|b| b.saturating_sub(used));
            (worker.pids(), cold_load, budget_left)
        };
        let vram = gpu::process_vram(devices, &pids).unwrap_or(0);
        let available = crate::child::memory::system_memory().available_bytes;
        let because = sleep_choice(vram, available, budget_left, cold_load).map_err(Some)?;
        tracing::info!(model, victim, "making room: {because}");
        match self.sleep(victim).await {
            Ok(_) => {
                self.emit(EventKind::Evicted {
                    model: victim.into(),
                    for_model: Some(model.into()),
                    reason: Some(why.as_str().into()),
                    sleep: Some(because),
                    ran_ms: None,
                    served: None,
                });
                Ok(())
            }
            // Stopped instead (its `sleep_failed` says why): room made.
            Err(Error::SleepFailed { .. }) => Ok(()),
            Err(e) => Err(Some(format!("stopped, not put to sleep: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_model_sleeps_when_host_memory_holds_it_and_its_wake_beats_its_load() {
        let secs = Duration::from_secs;
        let ok = sleep_choice(8 * GIB, 64 * GIB, None, secs(30)).unwrap();
        assert!(
            ok.starts_with("asleep instead of stopped: its wake (about 1s 170ms for"),
            "{ok}"
        );
        // Host memory too small (with a GiB to spare), the budget too small,
        // a load cheaper than the wake, nothing on the GPU: stopped.
        for (vram, available, budget, load, why) in [
            (8 * GIB, 8 * GIB, None, secs(30), "host memory"),
            (
                8 * GIB,
                64 * GIB,
                Some(4 * GIB),
                secs(30),
                "`memory_budget` leaves",
            ),
            (
                8 * GIB,
                64 * GIB,
                None,
                secs(1),
                "would not beat its cold load",
            ),
            (0, 64 * GIB, None, secs(30), "no GPU memory"),
        ] {
            let err = sleep_choice(vram, available, budget, load).unwrap_err();
            assert!(err.starts_with("stopped, not put to sleep"), "{err}");
            assert!(err.contains(why), "{why}: {err}");
        }
    }
}
