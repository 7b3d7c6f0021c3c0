//! What the model backends share: load modes, thread count, request parsing.

use berth_protocol::{Body, ErrorKind, LoadSpec, WireError};
use serde::de::DeserializeOwned;

use crate::Options;

/// How weights get into the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadMode {
    /// Map the file: pages come from the page cache and are shared.
    Mmap,
    /// Read the file into the worker's own memory: nothing stays mapped.
    Read,
}

impl LoadMode {
    pub fn from_options(spec: &LoadSpec, opts: &Options<'_>) -> Result<Self, WireError> {
        match opts.str("load_mode").unwrap_or("mmap") {
            "mmap" => Ok(LoadMode::Mmap),
            "read" => Ok(LoadMode::Read),
            other => Err(WireError::new(
                ErrorKind::LoadFailed,
                format!(
                    "model `{}`: load_mode `{other}` is not `mmap` or `read`",
                    spec.name
                ),
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            LoadMode::Mmap => "mmap",
            LoadMode::Read => "read",
        }
    }
}

/// Sets the compute thread count for this process (default: the cores it
/// may run on) and returns it. candle's CPU kernels read `RAYON_NUM_THREADS`
/// when their pools start, so this must run before the first tensor op;
/// a worker holds one model, so the setting is the model's own.
pub fn configure_threads(requested: Option<usize>) -> usize {
    let threads = requested.filter(|n| *n > 0).unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    // SAFETY: called during load, before the backend starts any thread that
    // reads the environment; the serve loop's other thread never does.
    unsafe { std::env::set_var("RAYON_NUM_THREADS", threads.to_string()) };
    threads
}

/// Parses a request's JSON, with an error that shows the expected shape.
pub fn parse_request<T: DeserializeOwned>(body: &Body, expected: &str) -> Result<T, WireError> {
    serde_json::from_str(&body.json).map_err(|e| {
        WireError::new(
            ErrorKind::BadRequest,
            format!("the request is not {expected}: {e}"),
        )
    })
}
