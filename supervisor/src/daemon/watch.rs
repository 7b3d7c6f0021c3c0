//! `--watch-config`: a reload when a config file changes, and only once
//! the change is whole.
//!
//! Editors and shells save in ways a watcher must not take at face value:
//! `>` and `cp` truncate the file and then write it (an empty file, valid
//! TOML with no models, lies there in between, a second or more with a
//! slow writer); a write may stop at any line. So a change is applied only
//! once every watched file has stayed the same ([`Stamp`]: inode, size,
//! modification and change times) for [`SETTLE`], no watched file is
//! empty, and the file is the same after it was read as before (the
//! reload checks that); and a config with no models never replaces one
//! with some (the reload refuses that unless asked). Replacing the file by
//! a rename, as most editors do, is seen at once and whole.

use std::path::PathBuf;
use std::sync::Weak;
use std::time::{Duration, Instant};

use super::live::Live;
use super::reload::Ask;
use crate::input::Stamp;

/// How often the files are looked at.
const LOOK_EVERY: Duration = Duration::from_millis(250);

/// How long a changed file must stay unchanged before it is read.
pub(crate) const SETTLE: Duration = Duration::from_secs(2);

/// Reloads when one of `files` changes and has settled, while the daemon
/// lives.
pub(super) async fn watch_files(live: Weak<Live>, files: Vec<PathBuf>) {
    let look = || -> Vec<Option<Stamp>> { files.iter().map(|f| Stamp::of(f)).collect() };
    let mut applied = look();
    let mut ticker = tokio::time::interval(LOOK_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The stamps last seen while a change settles, and since when.
    let mut settling: Option<(Vec<Option<Stamp>>, Instant)> = None;
    loop {
        ticker.tick().await;
        let now = look();
        if now == applied {
            settling = None;
            continue;
        }
        match &settling {
            Some((seen, since)) if *seen == now => {
                if since.elapsed() < SETTLE {
                    continue;
                }
            }
            _ => {
                settling = Some((now, Instant::now()));
                continue;
            }
        }
        // Settled. An empty or missing file is a save that has not written
        // yet, or a file that will come back: wait for its next change.
        if now.iter().any(|s| s.is_none_or(|s| s.is_empty())) {
            continue;
        }
        settling = None;
        let Some(live) = live.upgrade() else { return };
        match live
            .reload("a config file changed (--watch-config)", Ask::default())
            .await
        {
            Ok(_) => applied = now,
            // Refused (a bad file, one that changed while read): the next
            // change is looked at, not this one again.
            Err(_) => applied = now,
        }
    }
}
