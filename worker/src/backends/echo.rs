//! `echo`: returns the request body unchanged, bulk part included. The
//! baseline for what the process boundary costs.
//!
//! Option `chunks` (default 0): each request is first answered with that
//! many streamed chunks, each carrying the request's JSON, then the body.
//! Option `batch` (default 1): take up to that many waiting requests at once.
//! Option `stepping` (default false): batch continuously (see
//! [`crate::Stepping`]): each step streams one chunk to every request
//! running, and a request ends after its chunks. A request may ask for its
//! own number of steps (`{"steps": N}`), and `{"panic_in_step": true}`
//! panics inside a step: the fault path of continuous batching.

use berth_protocol::{Body, ErrorKind, LoadSpec, RequestId, WireError};

use crate::backends::common::batch_option;
use crate::{Backend, Batching, LoadContext, RequestContext, Stepping};

struct Echo {
    chunks: u32,
    batching: Option<Batching>,
    stepping: bool,
    running: Vec<Running>,
}

/// A request being echoed step by step.
struct Running {
    body: Body,
    ctx: RequestContext,
    steps_left: u64,
    panics: bool,
}

impl std::fmt::Debug for Echo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Echo")
            .field("chunks", &self.chunks)
            .field("stepping", &self.stepping)
            .field("running", &self.running.len())
            .finish_non_exhaustive()
    }
}

/// The options this backend takes.
pub const OPTIONS: &[&str] = &["chunks", "batch", "stepping"];

pub fn load(spec: &LoadSpec, ctx: &LoadContext) -> Result<Box<dyn Backend>, WireError> {
    let opts = ctx.options(spec);
    opts.only(OPTIONS)?;
    Ok(Box::new(Echo {
        chunks: opts.get_or("chunks", 0)?,
        batching: batch_option(spec, &opts)?,
        stepping: opts.get_or("stepping", false)?,
        running: Vec::new(),
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

    fn stepping(&mut self) -> Option<&mut dyn Stepping> {
        if self.stepping { Some(self) } else { None }
    }
}

impl Stepping for Echo {
    fn begin(&mut self, request: Body, ctx: RequestContext) -> Result<(), WireError> {
        let asked: serde_json::Value = serde_json::from_str(&request.json).unwrap_or_default();
        self.running.push(Running {
            steps_left: asked["steps"].as_u64().unwrap_or(u64::from(self.chunks)),
            panics: asked["panic_in_step"] == true,
            body: request,
            ctx,
        });
        Ok(())
    }

    fn step(&mut self) -> Vec<(RequestId, Result<Body, WireError>)> {
        if self.running.iter().any(|r| r.panics) {
            panic!("echo: a panic in a step, as the request asked");
        }
        let mut ended = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let r = &mut self.running[i];
            let result = if r.ctx.is_cancelled() {
                Some(Err(WireError::new(
                    ErrorKind::Cancelled,
                    "the request was cancelled",
                )))
            } else if r.steps_left == 0 {
                None
            } else {
                r.steps_left -= 1;
                r.ctx.progress().advance();
                r.ctx.chunk(Body::json(r.body.json.clone())).err().map(Err)
            };
            match result {
                Some(err) => {
                    let r = self.running.remove(i);
                    ended.push((r.ctx.id(), err));
                }
                None if self.running[i].steps_left == 0 => {
                    let r = self.running.remove(i);
                    ended.push((r.ctx.id(), Ok(r.body)));
                }
                None => i += 1,
            }
        }
        ended
    }

    fn active(&self) -> usize {
        self.running.len()
    }

    fn abandon(&mut self) {
        self.running.clear();
    }
}
