//! Built-in backends, one file each.
//!
//! `echo`, `hog` and `fault` need no weights: they are the IPC baseline, the
//! memory-holding stand-in for a caching allocator, and the way every
//! failure path is tested. `gpu-hog` is `hog` on the device.

mod common;
pub mod echo;
pub mod embed;
pub mod fault;
mod files;
pub mod generate;
pub mod gpu_hog;
pub mod hog;

pub use common::{
    CUDA_BUILD_HINT, LoadMode, choose_device, configure_threads, device_details, device_name,
    parse_request, warm_up,
};

impl crate::Registry {
    /// The backends built into `berth-worker`.
    pub fn builtin() -> Self {
        let mut r = Self::new();
        r.register_with_options("echo", echo::load, echo::OPTIONS);
        r.register_with_options("hog", hog::load, hog::OPTIONS);
        r.register_with_options("fault", fault::load, fault::OPTIONS);
        r.register_with_options("generate", generate::load, generate::OPTIONS);
        r.register_with_options("embed", embed::load, embed::OPTIONS);
        r.register_with_options("gpu-hog", gpu_hog::load, gpu_hog::OPTIONS);
        r
    }
}
