//! What the model backends share: load modes, thread count, request parsing.

use berth_protocol::{Body, ErrorKind, LoadSpec, WireError};
use candle_core::Device;
use serde::de::DeserializeOwned;

use crate::{Batching, LoadContext, Options};

/// How to build a worker that runs models on NVIDIA GPUs.
pub const CUDA_BUILD_HINT: &str = "build one with `python3 deploy/cuda/build_worker.py --cuda \
     X.Y` (the driver's CUDA version; no toolkit needed) and declare it as a worker kind \
     (docs/gpu.md)";

/// Where a model's tensors live. The `device` option names it (`cpu`,
/// `cuda` or `cuda:N`); without it, a worker the supervisor placed on GPUs
/// (`gpus = [..]` or `"auto"`) runs on the first of them, and any other on
/// the CPU.
pub fn choose_device(
    spec: &LoadSpec,
    opts: &Options<'_>,
    ctx: &LoadContext,
) -> Result<Device, WireError> {
    let fail = |message: String| {
        WireError::new(
            ErrorKind::LoadFailed,
            format!("model `{}`: {message}", spec.name),
        )
    };
    let ordinal = match opts.str("device").map(str::trim) {
        Some("cpu") => return Ok(Device::Cpu),
        Some("cuda") => 0,
        Some(other) => other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| fail(format!("device `{other}` is not `cpu`, `cuda` or `cuda:N`")))?,
        None if ctx.gpus().is_empty() => return Ok(Device::Cpu),
        None => 0,
    };
    if !candle_core::utils::cuda_is_available() {
        return Err(fail(format!(
            "it is to run on CUDA device {ordinal}, but this berth-worker was built without CUDA; \
             {CUDA_BUILD_HINT}, or set the option `device=cpu`"
        )));
    }
    Device::new_cuda(ordinal).map_err(|e| fail(format!("cannot open CUDA device {ordinal}: {e}")))
}

/// How a device is named in load details: `cpu`, `cuda:0`.
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Runs `work` once at load, so that no request waits for what a first
/// run costs (on a GPU, the driver loading, or compiling, the kernels it
/// uses); its time in milliseconds, or `None` when the `warmup` option
/// turned it off.
pub fn warm_up(
    spec: &LoadSpec,
    opts: &Options<'_>,
    work: impl FnOnce() -> Result<(), String>,
) -> Result<Option<f64>, WireError> {
    if !opts.get_or("warmup", true)? {
        return Ok(None);
    }
    let started = std::time::Instant::now();
    work().map_err(|e| {
        WireError::new(
            ErrorKind::LoadFailed,
            format!("model `{}`: its warm-up run failed: {e}", spec.name),
        )
    })?;
    Ok(Some(started.elapsed().as_secs_f64() * 1e3))
}

/// What load details say of a device: its name, and on a GPU how candle's
/// kernel modules were loaded (machine code, or PTX the driver compiled).
pub fn device_details(device: &Device) -> serde_json::Value {
    if device.is_cuda() {
        serde_json::json!({ "device": device_name(device), "cuda_modules": crate::kernels::loaded() })
    } else {
        serde_json::json!({ "device": device_name(device) })
    }
}

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

/// The test backends' `batch` option: `N` > 1 gathers up to `N` waiting
/// requests into a batch served one by one (`Backend::handle_batch`'s
/// default), so the batching path runs under every test that sets it.
pub fn batch_option(spec: &LoadSpec, opts: &Options) -> Result<Option<Batching>, WireError> {
    let n: usize = opts.get_or("batch", 1)?;
    if n == 0 {
        return Err(WireError::new(
            ErrorKind::BadRequest,
            format!("model `{}`: option `batch` must be at least 1", spec.name),
        ));
    }
    Ok((n > 1).then_some(Batching {
        max_batch: n,
        max_cost: usize::MAX,
    }))
}
