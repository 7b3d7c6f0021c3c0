//! `echo`: returns the request body unchanged, bulk part included. The
//! baseline for what the process boundary costs.
//!
//! Option `chunks` (default 0): each request is first answered with that
//! many streamed chunks, each carrying the request's JSON, then the body.
//! Option `batch` (default 1): take up to that many waiting requests at once.

use berth_protocol::{Body, LoadSpec, WireError};

use crate::backends::common::batch_option;
use crate::{Backend, Batching, LoadContext, RequestContext};

#[derive(Debug)]
struct Echo {
    chunks: u32,
    batching: Option<Batching>,
}

pub fn load(spec: &LoadSpec, ctx: &LoadContext) -> Result<Box<dyn Backend>, WireError> {
    let opts = ctx.options(spec);
    opts.only(&["chunks", "batch"])?;
    Ok(Box::new(Echo {
        chunks: opts.get_or("chunks", 0)?,
        batching: batch_option(spec, &opts)?,
    }))
}

impl Backend for Echo {
    fn handle(&mut self, request: Body, ctx: &RequestContext) -> Result<Body, WireError> {
        for _ in 0..self.chunks {
            ctx.chunk(Body::json(request.json.clone()))?;
            ctx.progress().advance();
        }
        ctx.progress().advance();
        Ok(request)
    }

    fn batching(&self) -> Option<Batching> {
        self.batching
    }
}
