//! A host's own worker binary: its own backend next to the built-ins.
//!
//! Build it with `cargo build --release --example custom-worker`, then point
//! the supervisor at it:
//! `berth run --worker target/release/examples/custom-worker --backend shout --input hello`.

use berth_worker::protocol::{Body, ErrorKind, LoadSpec, WireError};
use berth_worker::{Backend, LoadContext, Registry, RequestContext};

/// Upper-cases the `input` string of a `{"input": "..."}` request.
struct Shout;

impl Backend for Shout {
    fn handle(&mut self, request: Body, ctx: &RequestContext) -> Result<Body, WireError> {
        let value: serde_json::Value = serde_json::from_str(&request.json).map_err(|e| {
            WireError::new(ErrorKind::BadRequest, format!("request is not JSON: {e}"))
        })?;
        let text = value["input"].as_str().ok_or_else(|| {
            WireError::new(ErrorKind::BadRequest, "expected {\"input\": \"some text\"}")
        })?;
        ctx.progress().advance();
        Ok(Body::json(
            serde_json::json!({ "output": text.to_uppercase() }).to_string(),
        ))
    }
}

fn load(spec: &LoadSpec, ctx: &LoadContext) -> Result<Box<dyn Backend>, WireError> {
    ctx.options(spec).only(&[])?;
    Ok(Box::new(Shout))
}

fn main() {
    let mut registry = Registry::builtin();
    registry.register("shout", load);
    berth_worker::serve(registry)
}
