//! Generation: each request's prompt fed through the model in chunks, then
//! the requests decoded together, one token each per step, each step's text
//! streamed as a delta as soon as no stop string can still claim it. A
//! request that ends (a stop, its length, cancellation) leaves the batch;
//! the others go on.

use std::time::Instant;

use berth_protocol::{Body, ErrorKind, WireError};
use candle_core::Tensor;
use candle_transformers::generation::LogitsProcessor;
use serde_json::json;

use super::Generate;
use super::model::Sequence;
use super::request::{Prompt, Request};
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

/// A request's context: its own (continuous batching) or the caller's.
pub(super) enum Ctx<'a> {
    Owned(RequestContext),
    Borrowed(&'a RequestContext),
}

impl std::ops::Deref for Ctx<'_> {
    type Target = RequestContext;
    fn deref(&self) -> &RequestContext {
        match self {
            Ctx::Owned(ctx) => ctx,
            Ctx::Borrowed(ctx) => ctx,
        }
    }
}

/// One request being generated.
pub(super) struct Job<'a> {
    req: Request,
    ctx: Ctx<'a>,
    seq: Sequence,
    sampler: LogitsProcessor,
    prompt_tokens: usize,
    max_tokens: usize,
    /// The logits the next token is sampled from.
    logits: Option<Tensor>,
    generated: Vec<u32>,
    text: String,
    /// Bytes of `text` streamed so far.
    emitted: usize,
    finish_reason: &'static str,
    prompt_ms: f64,
    decode_started: Instant,
    decode_steps: usize,
}

impl std::fmt::Debug for Job<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("id", &self.ctx.id())
            .field("prompt_tokens", &self.prompt_tokens)
            .field("generated", &self.generated.len())
            .finish_non_exhaustive()
    }
}

/// What a job does after its sample.
enum Next {
    Token(u32),
    Done,
}

impl Generate {
    /// Tokenizes and checks a request and feeds its prompt through the model.
    pub(super) fn start<'a>(&self, req: Request, ctx: Ctx<'a>) -> Result<Job<'a>, WireError> {
        let backend = |e: candle_core::Error| self.error(ErrorKind::Backend, e);
        let rendered;
        let prompt = match &req.prompt {
            Prompt::Chat(messages) => {
                rendered = self.chat.render(messages);
                rendered.as_str()
            }
            Prompt::Raw(text) => text.as_str(),
        };
        // What cannot fit the context is refused before it is tokenized:
        // tokenizing a prompt of megabytes takes the worker's memory
        // (several times the text) for an answer that can only be no.
        let can_fit = self.context_length.saturating_mul(self.max_token_bytes);
        if prompt.len() > can_fit {
            return Err(self.error(
                ErrorKind::InputTooLarge,
                format!(
                    "the prompt is {} bytes; the context holds {} tokens of at most {} bytes \
                     each, so no more than {can_fit} bytes can fit: shorten it",
                    prompt.len(),
                    self.context_length,
                    self.max_token_bytes
                ),
            ));
        }
        let encoding = self
            .tokenizer
            .encode(prompt, false)
            .map_err(|e| self.error(ErrorKind::Internal, format!("tokenizing: {e}")))?;
        let mut ids: Vec<u32> = self.bos.into_iter().collect();
        ids.extend_from_slice(encoding.get_ids());
        let prompt_tokens = ids.len();
        if prompt_tokens == 0 {
            // A raw prompt of text the tokenizer makes nothing of, on a
            // model without a BOS token.
            return Err(self.error(
                ErrorKind::BadRequest,
                "the prompt has no tokens: send text the model's tokenizer reads",
            ));
        }
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
        let sampler = LogitsProcessor::new(
            req.settings.seed.unwrap_or_else(fresh_seed),
            Some(req.settings.temperature),
            req.settings.top_p,
        );
        let start = Instant::now();
        let mut seq = Sequence::default();
        let mut logits = None;
        for chunk in ids.chunks(PREFILL_CHUNK) {
            if ctx.is_cancelled() {
                return Err(self.cancelled());
            }
            logits = Some(self.model.prefill(&mut seq, chunk).map_err(backend)?);
            ctx.progress().advance();
        }
        let logits =
            logits.ok_or_else(|| self.error(ErrorKind::Internal, "the prompt has no tokens"))?;
        Ok(Job {
            req,
            ctx,
            seq,
            sampler,
            prompt_tokens,
            max_tokens,
            logits: Some(logits),
            generated: Vec::new(),
            text: String::new(),
            emitted: 0,
            finish_reason: "length",
            prompt_ms: start.elapsed().as_secs_f64() * 1e3,
            decode_started: Instant::now(),
            decode_steps: 0,
        })
    }

    /// One step of continuous batching: every job samples its next token
    /// (those that end leave, with their answers), then one forward pass
    /// for the rest.
    pub(super) fn step_jobs(
        &self,
        active: &mut Vec<Job<'_>>,
    ) -> Vec<(berth_protocol::RequestId, Result<Body, WireError>)> {
        let mut ended = Vec::new();
        let mut tokens = Vec::with_capacity(active.len());
        let mut i = 0;
        while i < active.len() {
            match self.advance(&mut active[i]) {
                Ok(Next::Token(token)) => {
                    tokens.push(token);
                    i += 1;
                }
                Ok(Next::Done) => {
                    let job = active.remove(i);
                    let id = job.ctx.id();
                    ended.push((id, self.finish(job)));
                }
                Err(e) => {
                    let job = active.remove(i);
                    ended.push((job.ctx.id(), Err(e)));
                }
            }
        }
        if active.is_empty() {
            return ended;
        }
        let mut seqs: Vec<&mut Sequence> = active.iter_mut().map(|j| &mut j.seq).collect();
        let rows = self.model.step(&mut seqs, &tokens).and_then(|logits| {
            (0..tokens.len())
                .map(|b| logits.get(b))
                .collect::<candle_core::Result<Vec<Tensor>>>()
        });
        match rows {
            Ok(rows) => {
                for (job, row) in active.iter_mut().zip(rows) {
                    job.logits = Some(row);
                    job.decode_steps += 1;
                    job.ctx.progress().advance();
                }
            }
            Err(e) => {
                // A failed pass fails every request in it.
                let e = self.error(ErrorKind::Backend, e);
                ended.extend(active.drain(..).map(|j| (j.ctx.id(), Err(e.clone()))));
            }
        }
        ended
    }

    /// Samples `job`'s next token and streams what text it makes safe to
    /// send; says whether the job goes on.
    fn advance(&self, job: &mut Job<'_>) -> Result<Next, WireError> {
        let logits = job
            .logits
            .take()
            .ok_or_else(|| self.error(ErrorKind::Internal, "no logits to sample"))?;
        let next = job
            .sampler
            .sample(&logits)
            .map_err(|e| self.error(ErrorKind::Backend, e))?;
        if self.end_ids.contains(&next) {
            job.finish_reason = "stop";
            return Ok(Next::Done);
        }
        job.generated.push(next);
        job.text = self
            .tokenizer
            .decode(&job.generated, true)
            .map_err(|e| self.error(ErrorKind::Internal, format!("detokenizing: {e}")))?;
        let end = match scan(&job.text, job.emitted, &job.req.stop) {
            Scan::Stop(at) => {
                job.finish_reason = "stop";
                job.text.truncate(at);
                return Ok(Next::Done);
            }
            Scan::Safe(end) => end,
        };
        // Decoding is prefix-stable (byte-level BPE, lossy UTF-8 only at the
        // held-back tail), so `emitted` stays a char boundary.
        if let Some(delta) = job.text.get(job.emitted..end).filter(|d| !d.is_empty()) {
            send_delta(&job.ctx, delta)?;
            job.emitted = end;
        }
        if job.generated.len() >= job.max_tokens {
            return Ok(Next::Done);
        }
        if job.ctx.is_cancelled() {
            return Err(self.cancelled());
        }
        Ok(Next::Token(next))
    }

    /// The final body of a job that ended.
    fn finish(&self, job: Job<'_>) -> Result<Body, WireError> {
        if let Some(delta) = job.text.get(job.emitted..).filter(|d| !d.is_empty()) {
            send_delta(&job.ctx, delta)?;
        }
        let decode_s = job.decode_started.elapsed().as_secs_f64();
        let decode_tokens_per_s = if job.decode_steps > 0 && decode_s > 0.0 {
            job.decode_steps as f64 / decode_s
        } else {
            0.0
        };
        Ok(Body::json(
            json!({
                "text": job.text,
                "finish_reason": job.finish_reason,
                "prompt_tokens": job.prompt_tokens,
                "completion_tokens": job.generated.len(),
                "prompt_ms": job.prompt_ms,
                "decode_ms": decode_s * 1e3,
                "decode_tokens_per_s": decode_tokens_per_s,
            })
            .to_string(),
        ))
    }

    fn cancelled(&self) -> WireError {
        self.error(ErrorKind::Cancelled, "the request was cancelled")
    }
}

fn send_delta(ctx: &RequestContext, delta: &str) -> Result<(), WireError> {
    ctx.chunk(Body::json(json!({ "delta": delta }).to_string()))
}
