//! One request's generation: the prompt fed through the model in chunks,
//! then tokens sampled one at a time, each step's text streamed as a delta
//! as soon as no stop string can still claim it.

use std::time::Instant;

use berth_protocol::{Body, ErrorKind, WireError};
use candle_core::Tensor;
use candle_transformers::generation::LogitsProcessor;
use serde_json::json;

use super::Generate;
use super::request::Request;
use super::template::{Scan, scan};
use crate::RequestContext;

/// Prompt tokens per forward pass. Attention scores take heads × chunk ×
/// context floats: a 4k-token prompt in one pass peaks at 2.2 GiB even for
/// SmolLM2-135M, in chunks at 0.6 GiB.
const PREFILL_CHUNK: usize = 256;

/// A seed for a request that named none.
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

impl Generate {
    pub(super) fn generate(&self, req: &Request, ctx: &RequestContext) -> Result<Body, WireError> {
        let backend = |e: candle_core::Error| self.error(ErrorKind::Backend, e);
        let prompt = self.chat.render(&req.messages);
        let encoding = self
            .tokenizer
            .encode(prompt.as_str(), false)
            .map_err(|e| self.error(ErrorKind::Internal, format!("tokenizing: {e}")))?;
        let mut ids: Vec<u32> = self.bos.into_iter().collect();
        ids.extend_from_slice(encoding.get_ids());
        let prompt_tokens = ids.len();
        if prompt_tokens >= self.context_length {
            return Err(self.error(
                ErrorKind::InputTooLarge,
                format!(
                    "the prompt is {prompt_tokens} tokens; the context holds {} (with room for at least one generated token)",
                    self.context_length
                ),
            ));
        }
        let max_tokens = req
            .settings
            .max_tokens
            .min(self.context_length - prompt_tokens);
        let mut sampler = LogitsProcessor::new(
            req.settings.seed.unwrap_or_else(fresh_seed),
            Some(req.settings.temperature),
            req.settings.top_p,
        );
        let mut model = self.model.clone();
        let cancelled = || self.error(ErrorKind::Cancelled, "the request was cancelled");
        if ctx.is_cancelled() {
            return Err(cancelled());
        }

        let start = Instant::now();
        let mut last = None;
        for (i, chunk) in ids.chunks(PREFILL_CHUNK).enumerate() {
            if ctx.is_cancelled() {
                return Err(cancelled());
            }
            let input = Tensor::new(chunk, &self.device)
                .and_then(|t| t.unsqueeze(0))
                .map_err(backend)?;
            last = Some(model.forward(&input, i * PREFILL_CHUNK).map_err(backend)?);
            ctx.progress().advance();
        }
        let mut logits = last
            .ok_or_else(|| self.error(ErrorKind::Internal, "the prompt has no tokens"))?
            .squeeze(0)
            .map_err(backend)?;
        let prompt_ms = start.elapsed().as_secs_f64() * 1e3;

        let start = Instant::now();
        let mut generated: Vec<u32> = Vec::new();
        let mut emitted = 0usize;
        let mut decode_steps = 0usize;
        let mut finish_reason = "length";
        let mut text = String::new();
        loop {
            let next = sampler.sample(&logits).map_err(backend)?;
            if self.end_ids.contains(&next) {
                finish_reason = "stop";
                break;
            }
            generated.push(next);
            text = self
                .tokenizer
                .decode(&generated, true)
                .map_err(|e| self.error(ErrorKind::Internal, format!("detokenizing: {e}")))?;
            let end = match scan(&text, emitted, &req.stop) {
                Scan::Stop(at) => {
                    finish_reason = "stop";
                    text.truncate(at);
                    break;
                }
                Scan::Safe(end) => end,
            };
            // Decoding is prefix-stable (byte-level BPE, lossy UTF-8 only at
            // the held-back tail), so `emitted` stays a char boundary.
            if let Some(delta) = text.get(emitted..end).filter(|d| !d.is_empty()) {
                self.send_delta(ctx, delta)?;
                emitted = end;
            }
            if generated.len() >= max_tokens {
                break;
            }
            if ctx.is_cancelled() {
                return Err(cancelled());
            }
            let input = Tensor::new(&[next], &self.device)
                .and_then(|t| t.unsqueeze(0))
                .map_err(backend)?;
            logits = model
                .forward(&input, prompt_tokens + generated.len() - 1)
                .and_then(|l| l.squeeze(0))
                .map_err(backend)?;
            decode_steps += 1;
            ctx.progress().advance();
        }
        if let Some(delta) = text.get(emitted..).filter(|d| !d.is_empty()) {
            self.send_delta(ctx, delta)?;
        }
        let decode_s = start.elapsed().as_secs_f64();
        let decode_tokens_per_s = if decode_steps > 0 && decode_s > 0.0 {
            decode_steps as f64 / decode_s
        } else {
            0.0
        };
        Ok(Body::json(
            json!({
                "text": text,
                "finish_reason": finish_reason,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": generated.len(),
                "prompt_ms": prompt_ms,
                "decode_ms": decode_s * 1e3,
                "decode_tokens_per_s": decode_tokens_per_s,
            })
            .to_string(),
        ))
    }

    fn send_delta(&self, ctx: &RequestContext, delta: &str) -> Result<(), WireError> {
        ctx.chunk(Body::json(json!({ "delta": delta }).to_string()))
    }
}
