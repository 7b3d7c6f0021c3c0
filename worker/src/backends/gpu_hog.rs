//! `gpu-hog`: holds device memory the way a caching allocator does (a
//! PyTorch process keeps VRAM after a model is "unloaded"), and optionally
//! grows by `leak_mib_per_request`. Unloading it shows the device memory
//! coming back with the process, measured by the supervisor through NVML.
//!
//! The CUDA driver is loaded at run time (cudarc's dynamic loading), so the
//! worker builds and runs without the toolkit; the driver is probed before a
//! context is created, because creating one without it panics.
//!
//! Options: `alloc_mib` (default 0), `leak_mib_per_request` (default 0),
//! `request_ms` (each request works this long, advancing its progress: a
//! model that is busy, default 0),
//! `device` (an index among the worker's visible devices, default 0),
//! `on_oom`: `error` (default: the request fails, the worker serves on) or
//! `abort` (the error goes to stderr and the process aborts, as a framework
//! with an uncaught out-of-memory exception dies), `preallocate`: `xla`
//! (before `alloc_mib`, take what JAX's XLA client preallocates at its
//! first operation, read from the variables JAX reads: a fraction of the
//! device's memory, `XLA_CLIENT_MEM_FRACTION` or
//! `XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75 when neither is set; nothing with
//! `XLA_PYTHON_CLIENT_PREALLOCATE=false`), so that berth's settings for JAX
//! workers are tested on a machine with no JAX for CUDA. As JAX 0.11 does,
//! it refuses the two fraction variables together: it says so on stderr
//! and runs "on the CPU", holding no device memory at all (JAX 0.11.2's
//! CUDA plugin, measured on an H100: "XLA_CLIENT_MEM_FRACTION is specified
//! together with XLA_PYTHON_CLIENT_MEM_FRACTION. Remove the latter one, it
//! is deprecated.", then the CPU backend alone).

use std::sync::Arc;

use berth_protocol::{Body, ErrorKind, LoadSpec, WireError};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};

use crate::{Backend, LoadContext, RequestContext};

struct GpuHog {
    /// `None`: it fell back to the CPU as JAX does (see the module doc).
    stream: Option<Arc<CudaStream>>,
    held: Vec<CudaSlice<u8>>,
    leak_bytes: usize,
    request_ms: u64,
    device: usize,
    abort_on_oom: bool,
}

/// True when the CUDA driver library can be loaded on this machine.
#[cfg(not(feature = "cuda"))]
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// With the `cuda` feature candle links libcuda into the worker, which
/// could not have started without the driver.
#[cfg(feature = "cuda")]
pub fn driver_present() -> bool {
    true
}

fn describe_error(e: &DriverError, bytes: usize, device: usize) -> String {
    if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        format!(
            "CUDA out of memory allocating {} MiB on device {device}",
            bytes >> 20
        )
    } else {
        format!("CUDA error on device {device}: {e}")
    }
}

/// The options this backend takes.
pub const OPTIONS: &[&str] = &[
    "alloc_mib",
    "leak_mib_per_request",
    "request_ms",
    "load_ms",
    "device",
    "on_oom",
    "preallocate",
];

/// What JAX's CUDA plugin says, and does, when both fraction variables are
/// set: it does not start, and JAX carries on with the CPU alone.
const XLA_BOTH_FRACTIONS: &str = "XLA_CLIENT_MEM_FRACTION is specified together with \
     XLA_PYTHON_CLIENT_MEM_FRACTION. Remove the latter one, it is deprecated.";

/// What XLA's client preallocates on a device of `total` bytes, from the
/// variables JAX reads (`env` looks one up); `Ok(None)`: the CUDA plugin
/// refused the variables and JAX runs on the CPU.
fn xla_preallocation(
    total: usize,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<usize>, String> {
    if env("XLA_CLIENT_MEM_FRACTION").is_some() && env("XLA_PYTHON_CLIENT_MEM_FRACTION").is_some() {
        return Ok(None);
    }
    if env("XLA_PYTHON_CLIENT_PREALLOCATE").is_some_and(|v| v == "false" || v == "0") {
        return Ok(Some(0));
    }
    let fraction =
        match env("XLA_CLIENT_MEM_FRACTION").or_else(|| env("XLA_PYTHON_CLIENT_MEM_FRACTION")) {
            None => 0.75,
            Some(text) => match text.parse::<f64>() {
                Ok(f) if (0.0..=1.0).contains(&f) => f,
                _ => {
                    return Err(format!(
                        "the memory fraction `{text}` is not a number from 0 to 1"
                    ));
                }
            },
        };
    Ok(Some((total as f64 * fraction) as usize))
}

pub fn load(spec: &LoadSpec, ctx: &LoadContext) -> Result<Box<dyn Backend>, WireError> {
    let opts = ctx.options(spec);
    opts.only(OPTIONS)?;
    let abort_on_oom = match opts.str("on_oom").unwrap_or("error") {
        "error" => false,
        "abort" => true,
        other => {
            return Err(WireError::new(
                ErrorKind::LoadFailed,
                format!(
                    "model `{}`: on_oom `{other}` is not `error` or `abort`",
                    spec.name
                ),
            ));
        }
    };
    let alloc_mib: usize = opts.get_or("alloc_mib", 0)?;
    let leak_mib: usize = opts.get_or("leak_mib_per_request", 0)?;
    let request_ms: u64 = opts.get_or("request_ms", 0)?;
    // A load as slow as a real model's (the scheduler weighs a sleep's
    // wake against it).
    let load_ms: u64 = opts.get_or("load_ms", 0)?;
    std::thread::sleep(std::time::Duration::from_millis(load_ms));
    let device: usize = opts.get_or("device", 0)?;
    let fail = |message: String| {
        WireError::new(
            ErrorKind::LoadFailed,
            format!("model `{}`: {message}", spec.name),
        )
    };
    if !driver_present() {
        return Err(fail(
            "no NVIDIA driver found (libcuda could not be loaded); gpu-hog needs an NVIDIA GPU"
                .into(),
        ));
    }
    let xla = match opts.str("preallocate") {
        None => false,
        Some("xla") => true,
        Some(other) => return Err(fail(format!("preallocate `{other}` is not `xla`"))),
    };
    // JAX reads its variables before it touches a device.
    if xla
        && xla_preallocation(0, |name| std::env::var(name).ok())
            .map_err(fail)?
            .is_none()
    {
        eprintln!("gpu-hog: {XLA_BOTH_FRACTIONS} Falling back to the CPU.");
        return Ok(Box::new(GpuHog {
            stream: None,
            held: Vec::new(),
            leak_bytes: 0,
            request_ms,
            device,
            abort_on_oom,
        }));
    }
    let context = CudaContext::new(device).map_err(|e| {
        fail(format!(
            "cannot create a CUDA context on device {device}: {e}"
        ))
    })?;
    ctx.progress().advance();
    let stream = context.default_stream();
    let mut held = Vec::new();
    if xla {
        let total = context
            .total_mem()
            .map_err(|e| fail(format!("cannot read device {device}'s memory: {e}")))?;
        let bytes = xla_preallocation(total, |name| std::env::var(name).ok())
            .map_err(fail)?
            .unwrap_or(0);
        if bytes > 0 {
            held.push(
                stream
                    .alloc_zeros::<u8>(bytes)
                    .map_err(|e| fail(describe_error(&e, bytes, device)))?,
            );
        }
    }
    // A zero-byte allocation is an error on devices without memory pools.
    if alloc_mib > 0 {
        held.push(
            stream
                .alloc_zeros::<u8>(alloc_mib << 20)
                .map_err(|e| fail(describe_error(&e, alloc_mib << 20, device)))?,
        );
    }
    stream
        .synchronize()
        .map_err(|e| fail(describe_error(&e, alloc_mib << 20, device)))?;
    ctx.progress().advance();
    Ok(Box::new(GpuHog {
        stream: Some(stream),
        held,
        leak_bytes: leak_mib << 20,
        request_ms,
        device,
        abort_on_oom,
    }))
}

impl GpuHog {
    fn held_bytes(&self) -> usize {
        self.held.iter().map(CudaSlice::len).sum()
    }
}

impl Backend for GpuHog {
    fn handle(&mut self, _request: Body, ctx: &RequestContext) -> Result<Body, WireError> {
        for _ in 0..self.request_ms / 10 {
            std::thread::sleep(std::time::Duration::from_millis(10));
            ctx.progress().advance();
        }
        if let Some(stream) = self.stream.as_ref().filter(|_| self.leak_bytes > 0) {
            let leaked = stream.alloc_zeros::<u8>(self.leak_bytes).map_err(|e| {
                let message = describe_error(&e, self.leak_bytes, self.device);
                if self.abort_on_oom {
                    eprintln!("gpu-hog: {message}");
                    std::process::abort();
                }
                WireError::new(ErrorKind::Backend, message)
            })?;
            self.held.push(leaked);
        }
        ctx.progress().advance();
        Ok(Body::json(self.describe().to_string()))
    }

    fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "held_bytes": self.held_bytes(),
            "device": self.device,
            "platform": if self.stream.is_some() { "cuda" } else { "cpu" },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::xla_preallocation;

    #[test]
    fn xla_takes_three_quarters_unless_told_otherwise() {
        let gib = 1usize << 30;
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(xla_preallocation(80 * gib, env(&[])), Ok(Some(60 * gib)));
        assert_eq!(
            xla_preallocation(80 * gib, env(&[("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.25")])),
            Ok(Some(20 * gib))
        );
        assert_eq!(
            xla_preallocation(80 * gib, env(&[("XLA_CLIENT_MEM_FRACTION", "0.5")])),
            Ok(Some(40 * gib))
        );
        // Both names: JAX 0.11's CUDA plugin refuses them, and JAX runs on
        // the CPU.
        assert_eq!(
            xla_preallocation(
                80 * gib,
                env(&[
                    ("XLA_CLIENT_MEM_FRACTION", "0.5"),
                    ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.25")
                ])
            ),
            Ok(None)
        );
        assert_eq!(
            xla_preallocation(80 * gib, env(&[("XLA_PYTHON_CLIENT_PREALLOCATE", "false")])),
            Ok(Some(0))
        );
        assert!(xla_preallocation(80 * gib, env(&[("XLA_CLIENT_MEM_FRACTION", "lots")])).is_err());
    }
}
