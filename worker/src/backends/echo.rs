//! `echo`: returns the request body unchanged, bulk part included. The
//! baseline for what the process boundary costs.

use berth_protocol::{Body, LoadSpec, WireError};

use crate::{Backend, LoadContext, RequestContext};

#[derive(Debug)]
struct Echo;

pub fn load(spec: &LoadSpec, ctx: &LoadContext) -> Result<Box<dyn Backend>, WireError> {
    ctx.options(spec).only(&[])?;
    Ok(Box::new(Echo))
}

impl Backend for Echo {
    fn handle(&mut self, request: Body, ctx: &RequestContext) -> Result<Body, WireError> {
        ctx.progress().advance();
        Ok(request)
    }
}
