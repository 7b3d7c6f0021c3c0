//! `hog`: holds memory the way a caching allocator does, and optionally
//! leaks a little more on every request, the way an autodiff graph that is
//! never freed does. Unloading it is the demonstration that a process
//! boundary gets every byte back.
//!
//! Options: `alloc_mib` (held from load on, default 0),
//! `leak_kib_per_request` (default 0), `work_ms` (each request takes this
//! long, advancing progress as it goes, like a model computing; default 0),
//! `batch` (take up to that many waiting requests at once; default 1),
//! `load_ms` (the load takes this long at least, advancing progress as it
//! goes, like a model reading its weights; default 0).

use std::time::{Duration, Instant};

use berth_protocol::{Body, ErrorKind, LoadSpec, WireError};

use crate::{Backend, LoadContext, RequestContext};

const PAGE: usize = 4096;

#[derive(Debug)]
struct Hog {
    held: Vec<Vec<u8>>,
    leak_bytes: usize,
    work: Duration,
    batching: Option<crate::Batching>,
}

/// Allocates `bytes` and writes every page so it is resident, not merely reserved.
fn touched(bytes: usize, ctx_progress: impl Fn()) -> Vec<u8> {
    let mut v = vec![0u8; bytes];
    for (i, page) in v.chunks_mut(PAGE).enumerate() {
        page[0] = 1;
        if i % 4096 == 0 {
            ctx_progress();
        }
    }
    v
}

/// The options this backend takes.
pub const OPTIONS: &[&str] = &[
    "alloc_mib",
    "leak_kib_per_request",
    "work_ms",
    "batch",
    "load_ms",
];

pub fn load(spec: &LoadSpec, ctx: &LoadContext) -> Result<Box<dyn Backend>, WireError> {
    let opts = ctx.options(spec);
    opts.only(OPTIONS)?;
    let batching = crate::backends::common::batch_option(spec, &opts)?;
    let alloc_mib: usize = opts.get_or("alloc_mib", 0)?;
    let leak_kib: usize = opts.get_or("leak_kib_per_request", 0)?;
    let too_large = |key: &str| {
        WireError::new(
            berth_protocol::ErrorKind::BadRequest,
            format!(
                "model `{}`: option `{key}` is too large for this machine",
                spec.name
            ),
        )
    };
    let bytes = alloc_mib
        .checked_mul(1 << 20)
        .ok_or_else(|| too_large("alloc_mib"))?;
    let leak_bytes = leak_kib
        .checked_mul(1 << 10)
        .ok_or_else(|| too_large("leak_kib_per_request"))?;
    let loading = Instant::now();
    let block = touched(bytes, || ctx.progress().advance());
    let load = Duration::from_millis(opts.get_or("load_ms", 0)?);
    while loading.elapsed() < load {
        std::thread::sleep(Duration::from_millis(10).min(load));
        ctx.progress().advance();
    }
    let work = Duration::from_millis(opts.get_or("work_ms", 0)?);
    Ok(Box::new(Hog {
        held: vec![block],
        leak_bytes,
        work,
        batching,
    }))
}

impl Hog {
    fn held_bytes(&self) -> usize {
        self.held.iter().map(Vec::len).sum()
    }
}

impl Backend for Hog {
    fn batching(&self) -> Option<crate::Batching> {
        self.batching
    }

    fn handle(&mut self, _request: Body, ctx: &RequestContext) -> Result<Body, WireError> {
        let started = Instant::now();
        while started.elapsed() < self.work {
            if ctx.is_cancelled() {
                return Err(WireError::new(
                    ErrorKind::Cancelled,
                    "cancelled while working",
                ));
            }
            std::thread::sleep(Duration::from_millis(10).min(self.work));
            ctx.progress().advance();
        }
        if self.leak_bytes > 0 {
            let leaked = touched(self.leak_bytes, || {});
            self.held.push(leaked);
        }
        ctx.progress().advance();
        Ok(Body::json(
            serde_json::json!({ "held_bytes": self.held_bytes() }).to_string(),
        ))
    }

    fn describe(&self) -> serde_json::Value {
        serde_json::json!({ "held_bytes": self.held_bytes(), "leak_bytes_per_request": self.leak_bytes })
    }
}
