//! The ranges every setting is held to: names, options, durations, sizes,
//! concurrency and queues, so no value from a config or a client can
//! overflow a clock or make the supervisor hold without bound.

use std::time::Duration;

/// Longest model name accepted.
pub const MAX_NAME_LEN: usize = 128;
/// A model's options: how many, how long a name, how long a value. What
/// one registration can make the supervisor hold stays small.
pub const MAX_OPTIONS: usize = 64;
pub const MAX_OPTION_NAME: usize = 64;
pub const MAX_OPTION_VALUE: usize = 4096;
/// Other names one model may have (llama-swap's `aliases`): a real config
/// gives a few; the bound keeps what one registration can make the
/// supervisor hold, and check, small.
pub const MAX_ALIASES: usize = 64;
/// GPUs one model may name.
pub const MAX_GPUS: usize = 64;
/// Models registered at once, by default.
pub const DEFAULT_MAX_MODELS: usize = 1024;
/// Longest duration accepted anywhere (keep-alive, timeouts, windows): a
/// year. Longer values are refused rather than overflowing a clock.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);
/// Largest size accepted for a memory setting: 1 PiB.
pub const MAX_BYTES: u64 = 1 << 50;
/// Most requests one worker may take at once.
pub const MAX_CONCURRENCY: usize = 4096;
/// Longest queue a model may have.
pub const MAX_QUEUE: usize = 1 << 20;

/// `field` within `0..=MAX_DURATION`, or a reason naming the field and range.
pub fn check_duration(field: &str, value: Option<Duration>) -> std::result::Result<(), String> {
    match value {
        Some(d) if d > MAX_DURATION => Err(format!(
            "{field} {} is out of range: 0s to {}",
            crate::units::format_duration(d),
            crate::units::format_duration(MAX_DURATION)
        )),
        _ => Ok(()),
    }
}

/// `field` within `0..=MAX_BYTES`, or a reason naming the field and range.
pub fn check_bytes(field: &str, value: Option<u64>) -> std::result::Result<(), String> {
    match value {
        Some(b) if b > MAX_BYTES => Err(format!(
            "{field} {b} bytes is out of range: 0 to {MAX_BYTES} (1 PiB)"
        )),
        _ => Ok(()),
    }
}
