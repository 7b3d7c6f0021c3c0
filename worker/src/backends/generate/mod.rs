//! `generate`: chat text generation with a quantized Llama-architecture GGUF
//! model (SmolLM2 and its kin) through candle, on the CPU or a GPU.
//!
//! Model: `--model FILE.gguf`; the tokenizer and the chat template come from
//! the file's metadata.
//!
//! Options:
//! - `load_mode` = `mmap` (default: map the file, copy the tensors out, unmap)
//!   or `read` (read the whole file into the worker's memory first);
//! - `threads`: compute threads (default: the cores this process may use);
//! - `device` = `cpu` | `cuda` | `cuda:N` (default: the GPU the supervisor
//!   placed the worker on, else the CPU; CUDA needs a worker built with the
//!   `cuda` feature);
//! - `max_batch`: requests decoded together at most (1 turns batching
//!   off). Default 8, but 1 for Q4_1 weights on a CPU without AVX2, FMA and
//!   F16C: there only candle's scalar Q4_1 loop runs, a step over 8 rows
//!   costs about 8 single steps, and batching measured no gain (1.03x)
//!   and a later median answer (1.3-1.6x);
//! - `quant` = `native` (default; `q4_1` is accepted for a Q4_1 file: the
//!   weights as the file has them) or `q8_0`: convert the weights once to
//!   Q8_0, cached next to the file as `<stem>.Q8_0.gguf` and reused while it
//!   is newer than the source. With AVX2 the Q4_1 weights run on berth's
//!   own kernel (`q4_1.rs`) and are the faster of the two; `q8_0` is for
//!   CPUs without it, where candle's Q8_0 kernel is the only SIMD one;
//! - `warmup` (default true): at load, a short prefill and a batched decode
//!   step run every kernel a request will, so that no request waits for
//!   a GPU's first run (`warmup_ms` in the load details);
//! - defaults for requests: `max_tokens` (256), `temperature` (0 = greedy),
//!   `top_p` (none), `seed` (none: a fresh seed per request, so sampled
//!   answers vary unless a seed is given; greedy ignores it).
//!
//! Request (JSON): `{"messages": [{"role": "system"|"user"|"assistant",
//! "content": "..."}, ...]}`, or `{"input": "..."}` / `{"prompt": "..."}`,
//! which is one user message, or `{"raw_prompt": "..."}`: text the model
//! continues as it is, through no chat template (OpenAI's legacy
//! completions). Optional per request: `max_tokens`, `temperature`,
//! `top_p`, `seed`, `stop` (a string or an array of strings).
//!
//! While generating, chunks `{"delta": "..."}` stream the text; their
//! concatenation is exactly the final `text`. Final body:
//! `{"text", "finish_reason": "stop"|"length", "prompt_tokens",
//! "completion_tokens", "prompt_ms", "decode_ms", "decode_tokens_per_s"}`,
//! where `decode_tokens_per_s` counts one-token forward passes after the
//! prompt's.
//!
//! The code, one concern a file:
//! - `request.rs`: a request body parsed and checked into messages and
//!   generation settings;
//! - `template.rs`: the ChatML prompt and the stop-string scan that decides
//!   how much generated text may be streamed;
//! - `gguf.rs`: the GGUF file's metadata and the tokenizer it describes;
//! - `weights.rs`: the model file's bytes and the cached Q8_0 conversion;
//! - `model.rs`: the Llama forward pass, weights shared, each sequence's
//!   KV cache its own, so that a decode step runs several sequences;
//! - `q4_1.rs`: Q4_1 matrix products with AVX2 (candle's are scalar), to
//!   the bit what candle's compute;
//! - `compare.rs`: the CPU's logits against another device's on the same
//!   file (`berth-worker --compare-devices`);
//! - `decode.rs`: each request's prefill, then the batch's decode steps,
//!   sampling and streamed deltas per request;
//! - this file: the options, `load` and the `Backend` glue.
//!
//! Batching: requests that arrive while a batch runs are gathered by the
//! worker (up to `max_batch` and a budget of 16,384 tokens of
//! prompt and reply) and decoded together, one token each per forward pass:
//! the weights are read once per step for all of them. Each is prefilled on
//! its own, samples with its own settings, streams its own deltas, and ends
//! (stop, length, cancellation, error) on its own. A request that arrives
//! while a batch decodes joins it between two steps (continuous batching,
//! the worker library's `Stepping`), prefilled alone first.

mod compare;
mod decode;
mod gguf;
mod model;
mod q4_1;
mod request;
mod template;
mod weights;

use std::collections::HashSet;
use std::io::Cursor;
use std::path::Path;

use berth_protocol::{Body, ErrorKind, LoadSpec, RequestId, WireError};
use candle_core::quantized::gguf_file::Value;
use serde_json::json;
use tokenizers::Tokenizer;

use crate::backends::{
    LoadMode, choose_device, configure_threads, device_details, device_name, warm_up,
};
use crate::{Backend, Batching, LoadContext, RequestContext, Stepping};

pub use compare::compare_devices;
pub use gguf::tokenizer_from_gguf;
#[doc(hidden)]
pub use model::{Agreement, agreement_with_candle};

use decode::{Ctx, Job};
use gguf::{Counted, check_model, dominant_dtype, md_str, md_u32, parse_gguf};
use model::{Llama, MAX_SEQ_LEN};
use request::{Settings, parse_request};
use template::{ChatMl, IM_END, IM_START};
use weights::{Data, Source, data_of, open_data, q8_0_source};

/// The options this backend takes.
pub const OPTIONS: &[&str] = &[
    "load_mode",
    "threads",
    "device",
    "quant",
    "max_batch",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "warmup",
];
const DEFAULT_MAX_TOKENS: usize = 256;
const DEFAULT_MAX_BATCH: usize = 8;
/// Prompt and reply tokens of one batch at most: their KV caches (46 KB a
/// token for SmolLM2-135M) stay under ~0.75 GiB.
const MAX_BATCH_TOKENS: usize = 16_384;

#[derive(Debug)]
struct Generate {
    name: String,
    /// Shared by every request; each request's KV cache is its own, and
    /// goes when it ends.
    model: Llama,
    max_batch: usize,
    /// Requests being decoded (continuous batching), each with its own
    /// context.
    running: Vec<Job<'static>>,
    tokenizer: Tokenizer,
    chat: ChatMl,
    /// Tokens that end the reply (end of turn, end of text).
    end_ids: HashSet<u32>,
    bos: Option<u32>,
    context_length: usize,
    /// The longest token's text, in bytes: a prompt longer than this times
    /// the context cannot fit, and is refused before it is tokenized.
    max_token_bytes: usize,
    defaults: Settings,
    details: serde_json::Value,
}

pub fn load(spec: &LoadSpec, ctx: &LoadContext) -> Result<Box<dyn Backend>, WireError> {
    let fail = |msg: String| {
        WireError::new(
            ErrorKind::LoadFailed,
            format!("model `{}`: {msg}", spec.name),
        )
    };
    let opts = ctx.options(spec);
    opts.only(OPTIONS)?;
    let path = spec.model.as_deref().ok_or_else(|| {
        fail("the generate backend needs --model FILE (a llama-architecture GGUF file)".into())
    })?;
    let load_mode = LoadMode::from_options(spec, &opts)?;
    let quant = opts.str("quant").unwrap_or("native");
    let max_batch: Option<usize> = opts.get("max_batch")?;
    if max_batch == Some(0) {
        return Err(fail(
            "`max_batch` must be at least 1 (1 turns batching off)".into(),
        ));
    }
    if !matches!(quant, "native" | "q4_1" | "q8_0") {
        return Err(fail(format!("`quant={quant}`: use native, q4_1 or q8_0")));
    }
    let defaults = Settings {
        max_tokens: opts.get_or("max_tokens", DEFAULT_MAX_TOKENS)?,
        temperature: opts.get_or("temperature", 0.0)?,
        top_p: opts.get("top_p")?,
        seed: opts.get("seed")?,
    };
    defaults.check().map_err(fail)?;
    let device = choose_device(spec, &opts, ctx)?;
    // Before any tensor operation: candle sizes its pools once.
    let threads = configure_threads(opts.get("threads")?);
    let progress = ctx.progress();

    let src = Path::new(path);
    let source = if quant == "q8_0" {
        q8_0_source(src, load_mode, progress).map_err(fail)?
    } else {
        Source::File(src.to_path_buf())
    };
    progress.advance();
    let (data, file) = match source {
        Source::File(p) => (
            open_data(&p, load_mode).map_err(fail)?,
            p.display().to_string(),
        ),
        Source::Cached(opened, p) => (
            data_of(opened, &p, load_mode).map_err(fail)?,
            p.display().to_string(),
        ),
        Source::Converted(bytes) => (
            Data::Owned(bytes),
            format!("(in memory, converted from {})", src.display()),
        ),
    };
    progress.advance();
    let content = parse_gguf(&data, &file, progress).map_err(fail)?;
    check_model(&content, data.len() as u64, &file).map_err(fail)?;
    let dtype = dominant_dtype(&content);
    let max_batch = max_batch.unwrap_or(if dtype == "q4_1" && !q4_1::runs_on(&device) {
        1
    } else {
        DEFAULT_MAX_BATCH
    });
    if quant == "q4_1" && dtype != "q4_1" {
        return Err(fail(format!(
            "`quant=q4_1` asks for Q4_1 weights but `{file}` is {dtype}; use quant=native (the file as it is) or quant=q8_0"
        )));
    }
    let md = &content.metadata;
    let template = md_str(md, "tokenizer.chat_template")
        .ok_or_else(|| fail(format!("`{file}` has no chat template")))?;
    let chat = ChatMl::from_template(template).map_err(|e| fail(format!("`{file}`: {e}")))?;
    let tokenizer = tokenizer_from_gguf(&content).map_err(|e| fail(format!("`{file}`: {e}")))?;
    progress.advance();
    for marker in [IM_START, IM_END] {
        let single = tokenizer
            .encode(marker, false)
            .is_ok_and(|e| e.get_ids().len() == 1);
        if !single {
            return Err(fail(format!(
                "`{file}`: its tokenizer has no `{marker}` token for the ChatML template"
            )));
        }
    }
    let mut end_ids: HashSet<u32> = [IM_END, "<|endoftext|>"]
        .iter()
        .filter_map(|t| tokenizer.token_to_id(t))
        .collect();
    end_ids.extend(md_u32(md, "tokenizer.ggml.eos_token_id"));
    let bos = match md.get("tokenizer.ggml.add_bos_token") {
        Some(Value::Bool(true)) => Some(
            md_u32(md, "tokenizer.ggml.bos_token_id")
                .ok_or_else(|| fail(format!("`{file}` asks for a BOS token but names none")))?,
        ),
        _ => None,
    };
    let trained_context = md_u32(md, "llama.context_length").map(|n| n as usize);
    let context_length = trained_context.unwrap_or(MAX_SEQ_LEN).min(MAX_SEQ_LEN);
    // A byte-level token's text is at least as long in UTF-8 as the bytes
    // it stands for (`Ġ` is two for one), so this bounds from above.
    let max_token_bytes = tokenizer
        .get_vocab(true)
        .keys()
        .map(String::len)
        .max()
        .unwrap_or(1)
        .max(1);
    let details = json!({
        "architecture": "llama",
        "model_name": md_str(md, "general.name"),
        "context_length": context_length,
        "trained_context_length": trained_context,
        "vocab_size": tokenizer.get_vocab_size(true),
        "layers": md_u32(md, "llama.block_count"),
        "embedding_length": md_u32(md, "llama.embedding_length"),
        "quant": dtype,
        "file": file,
        "source_file": src.display().to_string(),
        "threads": threads,
        "device": device_name(&device),
        "load_mode": load_mode.as_str(),
        "max_batch": max_batch,
        "chat_template": "chatml",
        "default_system_prompt": chat.default_system,
        "defaults": {
            "max_tokens": defaults.max_tokens,
            "temperature": defaults.temperature,
            "top_p": defaults.top_p,
            "seed": defaults.seed,
        },
    });

    let mut reader = Counted {
        inner: Cursor::new(&*data),
        progress,
    };
    let model = Llama::from_gguf(content, &mut reader, &device)
        .map_err(|e| fail(format!("cannot build the model from `{file}`: {e}")))?;
    drop(data);
    progress.advance();
    let mut details = details;
    let warmup = tokenizer
        .encode(format!("{IM_START}user\nwarm up{IM_END}"), false)
        .map_err(|e| {
            fail(format!(
                "`{file}`: its tokenizer fails on the warm-up text: {e}"
            ))
        })?;
    details["warmup_ms"] = json!(warm_up(spec, &opts, || {
        model.warm_up(warmup.get_ids()).map_err(|e| e.to_string())
    })?);
    progress.advance();
    Ok(Box::new(Generate {
        name: spec.name.clone(),
        model,
        max_batch,
        running: Vec::new(),
        tokenizer,
        chat,
        end_ids,
        bos,
        context_length,
        max_token_bytes,
        defaults,
        details,
    }))
}

impl Generate {
    fn error(&self, kind: ErrorKind, msg: impl std::fmt::Display) -> WireError {
        WireError::new(kind, format!("model `{}`: {msg}", self.name))
    }
}

impl Generate {
    fn begin_job<'a>(&self, body: Body, ctx: Ctx<'a>) -> Result<Job<'a>, WireError> {
        let req = parse_request(&body.json, &self.defaults)
            .map_err(|e| self.error(ErrorKind::BadRequest, e))?;
        self.start(req, ctx)
    }
}

impl Stepping for Generate {
    fn begin(&mut self, request: Body, ctx: RequestContext) -> Result<(), WireError> {
        let job = self.begin_job(request, Ctx::Owned(ctx))?;
        self.running.push(job);
        Ok(())
    }

    fn step(&mut self) -> Vec<(RequestId, Result<Body, WireError>)> {
        let mut running = std::mem::take(&mut self.running);
        let ended = self.step_jobs(&mut running);
        self.running = running;
        ended
    }

    fn active(&self) -> usize {
        self.running.len()
    }

    fn abandon(&mut self) {
        self.running.clear();
    }
}

impl Backend for Generate {
    fn handle(&mut self, request: Body, ctx: &RequestContext) -> Result<Body, WireError> {
        self.handle_batch(vec![(request, ctx)])
            .pop()
            .unwrap_or_else(|| Err(self.error(ErrorKind::Internal, "no answer")))
    }

    fn batching(&self) -> Option<Batching> {
        (self.max_batch > 1).then_some(Batching {
            max_batch: self.max_batch,
            max_cost: MAX_BATCH_TOKENS,
        })
    }

    /// Prompt and reply tokens, estimated: about one per three bytes of the
    /// request, plus the reply's `max_tokens` as generation clamps it (to
    /// the context), so that a client asking for a million tokens is not
    /// costed past the batch's budget and run alone.
    fn cost(&self, request: &Body) -> usize {
        let reply = parse_request(&request.json, &self.defaults)
            .map(|r| r.settings.max_tokens)
            .unwrap_or(0);
        (request.json.len() / 3)
            .saturating_add(reply)
            .min(self.context_length)
    }

    /// Each request parsed and prefilled on its own (a bad one fails
    /// alone), then all decoded together until the last ends.
    fn handle_batch(
        &mut self,
        batch: Vec<(Body, &RequestContext)>,
    ) -> Vec<Result<Body, WireError>> {
        let ids: Vec<_> = batch.iter().map(|(_, ctx)| ctx.id()).collect();
        let mut answers = std::collections::HashMap::new();
        let mut active = Vec::new();
        for (body, ctx) in batch {
            match self.begin_job(body, Ctx::Borrowed(ctx)) {
                Ok(job) => active.push(job),
                Err(e) => {
                    answers.insert(ctx.id(), Err(e));
                }
            }
        }
        while !active.is_empty() {
            answers.extend(self.step_jobs(&mut active));
        }
        ids.iter()
            .map(|id| {
                answers
                    .remove(id)
                    .unwrap_or_else(|| Err(self.error(ErrorKind::Internal, "no answer")))
            })
            .collect()
    }

    fn stepping(&mut self) -> Option<&mut dyn Stepping> {
        Some(self)
    }

    fn describe(&self) -> serde_json::Value {
        let mut details = self.details.clone();
        if let (Some(out), serde_json::Value::Object(device)) =
            (details.as_object_mut(), device_details(self.model.device()))
        {
            out.extend(device);
        }
        details
    }
}
