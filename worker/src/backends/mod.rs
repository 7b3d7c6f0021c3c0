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
