//! `--watch-config`: a reload when a config file changes.

use super::live::Live;

/// Reloads when one of `files` changes (its size or modification time,
/// looked at every second) while the daemon lives (`--watch-config`). A
/// file caught half-written fails to read, changes nothing, and the next
/// look sees it whole.
pub(super) async fn watch_files(live: std::sync::Weak<Live>, files: Vec<std::path::PathBuf>) {
    let look = || -> Vec<Option<(std::time::SystemTime, u64)>> {
        files
            .iter()
            .map(|f| {
                let meta = std::fs::metadata(f).ok()?;
                Some((meta.modified().ok()?, meta.len()))
            })
            .collect()
    };
    let mut seen = look();
    let mut ticker = tokio::time::interval(std::time::Duration::from_secs(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let now = look();
        if now == seen {
            continue;
        }
        seen = now;
        let Some(live) = live.upgrade() else { return };
        let _ = live.reload("a config file changed (--watch-config)").await;
    }
}
