//! What a new worker needs room for: its RAM (measured by its last run, or
//! its weights on disk, or its `memory_limit`) and, on GPUs, its VRAM.

use std::time::{Duration, Instant};

use super::estimate::Estimate;
use super::slot::Entry;
use crate::config::ModelSpec;
use crate::gpu;

/// What a new worker needs room for.
#[derive(Debug, Clone)]
pub(super) struct Need {
    /// RAM to count for it while it loads.
    pub(super) ram: u64,
    /// It replaces the model's current worker (swap, recycle, restart),
    /// which already counts toward `max_loaded`.
    pub(super) replacing: bool,
    /// Its GPU request and the VRAM it is expected to take on each device.
    pub(super) gpu: Option<(gpu::GpuRequest, u64)>,
    /// Where `ram` came from: `measured` (its last load of the same
    /// thing), `gguf`, `safetensors`, `files` (its weights' size on disk),
    /// `memory_limit`, `unknown`.
    pub(super) from: &'static str,
}

/// What a model of unknown size (no weights on disk to measure, no earlier
/// load, no `memory_limit`) is counted as before its first load: it is not
/// free.
pub const UNKNOWN_FOOTPRINT: u64 = 256 << 20;

impl Need {
    /// Sized from what the model's last worker measured when it ran the
    /// same thing, else from its files (`files`, read by [`from_files`]
    /// before the state lock was taken: a GGUF's tensors and its context's
    /// cache, safetensors headers, else the weights' size on disk), else
    /// from its `memory_limit`, else [`UNKNOWN_FOOTPRINT`]; on GPUs, its
    /// declared `vram` comes first.
    pub(super) fn new(
        spec: &ModelSpec,
        entry: Option<&Entry>,
        replacing: bool,
        files: &Estimate,
    ) -> Need {
        let same = entry.filter(|e| {
            e.spec.backend == spec.backend
                && e.spec.model == spec.model
                && e.spec.options == spec.options
        });
        let disk = files.bytes;
        let (unmeasured, unmeasured_from) = if disk > 0 {
            (disk, files.from)
        } else {
            match spec.memory_limit {
                Some(limit) => (limit, "memory_limit"),
                None => (UNKNOWN_FOOTPRINT, "unknown"),
            }
        };
        let (ram, from) = match same.and_then(|e| e.last_peak_bytes) {
            Some(measured) => (measured, "measured"),
            None => (unmeasured, unmeasured_from),
        };
        Need {
            ram,
            from,
            replacing,
            // A declared share is the operator's word; else what it last
            // measured, else its weights' size.
            gpu: spec.gpus.clone().map(|request| {
                let vram = spec
                    .vram
                    .or_else(|| same.and_then(|e| e.last_vram_bytes))
                    .unwrap_or(disk);
                (request, vram)
            }),
        }
    }

    pub(super) fn vram(&self) -> u64 {
        self.gpu.as_ref().map(|(_, vram)| *vram).unwrap_or(0)
    }
}

/// What a model's files say it will take, read off the async runtime: a
/// GGUF's or safetensors' headers (`estimate.rs`), else the bytes its
/// weights take on disk ([`footprint_on_disk`]).
pub(super) async fn from_files(spec: &ModelSpec) -> Estimate {
    let none = Estimate {
        bytes: 0,
        from: "unknown",
    };
    let Some(path) = spec.model.clone() else {
        return none;
    };
    tokio::task::spawn_blocking(move || {
        super::estimate::from_files(&path).unwrap_or_else(|| Estimate {
            bytes: footprint_on_disk(&path),
            from: "files",
        })
    })
    .await
    .unwrap_or(none)
}

/// Bounds of the walk: a model folder deeper, larger or slower than this
/// is counted as far as the walk got.
const WALK_DEPTH: usize = 8;
const WALK_ENTRIES: usize = 10_000;
const WALK_TIME: Duration = Duration::from_secs(1);

/// The bytes under `path`: a file's size, or the sizes of a folder's files,
/// walked without following symlinks (a folder holding two links to
/// itself, or the whole models directory named as a model, must not hold
/// anything up), at most [`WALK_DEPTH`] deep, [`WALK_ENTRIES`] entries and
/// [`WALK_TIME`] long. Blocking: never under the state lock, never on the
/// runtime's threads.
pub(crate) fn footprint_on_disk(path: &std::path::Path) -> u64 {
    let started = Instant::now();
    let mut total = 0u64;
    let mut entries = 0usize;
    // The model's own path may be a symlink (a fetched model's folder is a
    // plain one; an operator's may not be): that one is followed.
    let Ok(top) = std::fs::metadata(path) else {
        return 0;
    };
    if !top.is_dir() {
        return top.len();
    }
    let mut folders = vec![(path.to_path_buf(), 0usize)];
    while let Some((folder, depth)) = folders.pop() {
        let Ok(list) = std::fs::read_dir(&folder) else {
            continue;
        };
        for entry in list.filter_map(Result::ok) {
            entries += 1;
            if entries > WALK_ENTRIES || started.elapsed() > WALK_TIME {
                tracing::warn!(
                    path = %path.display(),
                    "the model's folder is too large to measure ({entries} entries in {:?}); \
                     counted {total} bytes of it",
                    started.elapsed()
                );
                return total;
            }
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                if depth + 1 < WALK_DEPTH {
                    folders.push((entry.path(), depth + 1));
                }
            } else if kind.is_file() {
                total += entry.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
    }
    total
}
