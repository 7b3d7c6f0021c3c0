//! What the API may ask of the daemon that runs it: to read its config
//! again, and to upgrade in place. The HTTP layer knows only this much of
//! the daemon (`daemon/live.rs` answers it); a server run without a daemon
//! (embedded, in a test) has no controls, and those routes say so.

use futures_util::future::BoxFuture;

use crate::report::ReloadReport;

/// An upgrade's new binary passed its check: what it is.
#[derive(Debug, Clone)]
pub struct UpgradeAccepted {
    /// `version (mark)` of the binary that takes over.
    pub to: String,
}

/// The daemon's answers to the management API.
pub trait Controls: Send + Sync {
    /// Reads the config files again and applies them; `None` when the
    /// daemon has no config file to read. `allow_empty`: a config with no
    /// models may replace one with some.
    fn reload(
        &self,
        trigger: &'static str,
        allow_empty: bool,
    ) -> BoxFuture<'_, Option<Result<ReloadReport, String>>>;

    /// Checks the binary berth was started from, as the file is now, and
    /// hands it to the serve loop; `Err` says why not, and nothing changed.
    fn upgrade(&self, trigger: &'static str) -> BoxFuture<'_, Result<UpgradeAccepted, String>>;

    /// The versions of the handover state this binary adopts.
    fn handover_versions(&self) -> &'static [u32];
}
