//! `embed`: sentence embeddings from a sentence-transformers BERT directory
//! (all-MiniLM-L6-v2 and its kind) with candle, on the CPU or a GPU; the
//! encoder is berth's own (`bert.rs`: candle's operations for large
//! batches; for a few rows, where a single text spends its time, a pass on
//! plain slices, `few.rs`, with products of its own, `kernel.rs`).
//!
//! The directory holds `config.json`, `model.safetensors`, `tokenizer.json`
//! and optionally `1_Pooling/config.json` (only mean pooling is supported,
//! which is what these models use). A batch is padded to its longest text
//! and runs as one forward pass; vectors are mean-pooled over the attention
//! mask and L2-normalised.
//!
//! Requests that arrive while a pass runs are batched (the worker library's
//! [`Batching`]): up to 64 requests and about 8192 tokens, their texts sorted
//! by length into passes of 32, each request answered with its own vectors;
//! bad input fails only its own request.
//!
//! Options: `load_mode` = `mmap` (default) | `read`; `threads`;
//! `max_length` (tokens per text, default 256, the model's training length);
//! `device` = `cpu` | `cuda` | `cuda:N` (default: the GPU the supervisor
//! placed the worker on, else the CPU; CUDA needs a worker built with the
//! `cuda` feature); `warmup` (default true: a two-text pass at load runs
//! the kernels a request will, so none waits for a GPU's first run;
//! `warmup_ms` in the load details).
//! Request: `{"input": "text"}` or `{"input": ["text", ...]}`, and
//! optionally `"encoding": "f32"`.
//! Response: `{"embeddings": [[...], ...], "dim": 384, "tokens": N}`; with
//! `"encoding": "f32"`, `{"count": N, "dim": 384, "tokens": T}` and the
//! vectors as `N x dim` little-endian `f32` bulk bytes (what the sidecar
//! asks for: no numbers formatted or parsed).

use std::path::{Path, PathBuf};

use berth_protocol::{Body, ErrorKind, LoadSpec, WireError};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::Config;
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

use crate::backends::files::{FileError, ModelFile, open_in};
use crate::backends::{
    LoadMode, choose_device, configure_threads, device_details, parse_request, warm_up,
};
use crate::{Backend, Batching, LoadContext, RequestContext};

mod bert;
mod few;
mod kernel;

use bert::Bert;
pub use bert::agreement_with_candle;

struct Embed {
    model: Bert,
    tokenizer: Tokenizer,
    dim: usize,
    dir: PathBuf,
    load_mode: LoadMode,
    max_length: usize,
    threads: usize,
    device: Device,
    /// The warm-up pass at load, in milliseconds (`None`: turned off).
    warmup_ms: Option<f64>,
}

fn load_error(spec: &LoadSpec, message: String) -> WireError {
    WireError::new(
        ErrorKind::LoadFailed,
        format!("model `{}`: {message}", spec.name),
    )
}

/// `name` in the model's folder, opened beneath it (see `files.rs`).
fn open(spec: &LoadSpec, dir: &Path, name: &str) -> Result<ModelFile, WireError> {
    open_in(dir, name).map_err(|e| load_error(spec, format!("`{}` {e}", dir.join(name).display())))
}

fn read_text(spec: &LoadSpec, dir: &Path, name: &str) -> Result<String, WireError> {
    open(spec, dir, name)?.read_to_string().map_err(|e| {
        load_error(
            spec,
            format!("cannot read `{}`: {e}", dir.join(name).display()),
        )
    })
}

/// The options this backend takes.
pub const OPTIONS: &[&str] = &["load_mode", "threads", "max_length", "device", "warmup"];

pub fn load(spec: &LoadSpec, ctx: &LoadContext) -> Result<Box<dyn Backend>, WireError> {
    let opts = ctx.options(spec);
    opts.only(OPTIONS)?;
    let load_mode = LoadMode::from_options(spec, &opts)?;
    let device = choose_device(spec, &opts, ctx)?;
    let threads = configure_threads(opts.get("threads")?);
    let max_length: usize = opts.get_or("max_length", 256)?;
    let dir = PathBuf::from(spec.model.as_deref().ok_or_else(|| {
        load_error(
            spec,
            "the embed backend needs --model DIR (a sentence-transformers directory)".into(),
        )
    })?);
    if !dir.is_dir() {
        return Err(load_error(
            spec,
            format!("`{}` is not a directory", dir.display()),
        ));
    }

    let config_path = dir.join("config.json");
    let config: Config =
        serde_json::from_str(&read_text(spec, &dir, "config.json")?).map_err(|e| {
            load_error(
                spec,
                format!("`{}` is not a BERT config: {e}", config_path.display()),
            )
        })?;
    let pooling = dir.join("1_Pooling/config.json");
    let pooling_text =
        match open_in(&dir, "1_Pooling/config.json") {
            Err(FileError::Missing) => None,
            Err(e) => return Err(load_error(spec, format!("`{}` {e}", pooling.display()))),
            Ok(mut file) => Some(file.read_to_string().map_err(|e| {
                load_error(spec, format!("cannot read `{}`: {e}", pooling.display()))
            })?),
        };
    if let Some(text) = pooling_text {
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| load_error(spec, format!("`{}` is not JSON: {e}", pooling.display())))?;
        if value["pooling_mode_mean_tokens"] != serde_json::Value::Bool(true) {
            return Err(load_error(
                spec,
                format!(
                    "`{}` asks for a pooling other than mean pooling, which is all this backend does",
                    pooling.display()
                ),
            ));
        }
    }
    ctx.progress().advance();

    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer_bytes = open(spec, &dir, "tokenizer.json")?
        .read_bytes()
        .map_err(|e| {
            load_error(
                spec,
                format!("cannot read `{}`: {e}", tokenizer_path.display()),
            )
        })?;
    let mut tokenizer = Tokenizer::from_bytes(&tokenizer_bytes).map_err(|e| {
        load_error(
            spec,
            format!("cannot load `{}`: {e}", tokenizer_path.display()),
        )
    })?;
    let max_length = max_length.min(config.max_position_embeddings);
    // tokenizer.json pads every text to 128; padding to the longest in the
    // batch is what makes single texts cheap.
    tokenizer.with_padding(Some(PaddingParams {
        strategy: PaddingStrategy::BatchLongest,
        ..Default::default()
    }));
    tokenizer
        .with_truncation(Some(TruncationParams {
            max_length,
            ..Default::default()
        }))
        .map_err(|e| load_error(spec, format!("cannot set truncation: {e}")))?;
    ctx.progress().advance();

    let weights = dir.join("model.safetensors");
    let mut weights_file = open(spec, &dir, "model.safetensors")?;
    let bad_weights = |e: candle_core::Error| {
        load_error(
            spec,
            format!("cannot load weights from `{}`: {e}", weights.display()),
        )
    };
    let vb = match load_mode {
        // SAFETY: the file is mapped read-only; berth's fetch step writes
        // weights by rename, so a mapped file is never modified in place.
        // The file opened and checked above, by its descriptor.
        LoadMode::Mmap => unsafe {
            VarBuilder::from_mmaped_safetensors(&[weights_file.path()], DType::F32, &device)
                .map_err(bad_weights)?
        },
        LoadMode::Read => {
            let bytes = weights_file.read_bytes().map_err(|e| {
                load_error(spec, format!("cannot read `{}`: {e}", weights.display()))
            })?;
            VarBuilder::from_buffered_safetensors(bytes, DType::F32, &device)
                .map_err(bad_weights)?
        }
    };
    let model = Bert::load(vb, &config, threads).map_err(bad_weights)?;
    ctx.progress().advance();
    let mut embed = Embed {
        model,
        tokenizer,
        dim: config.hidden_size,
        dir,
        load_mode,
        max_length,
        threads,
        device,
        warmup_ms: None,
    };
    // Two texts of different lengths: padding and the mask run too.
    embed.warmup_ms = warm_up(spec, &opts, || {
        embed
            .embed(&[
                "warm-up".into(),
                "a second, longer text to warm up on".into(),
            ])
            .map(drop)
    })?;
    ctx.progress().advance();
    Ok(Box::new(embed))
}

/// `{"input": "text"}` or `{"input": ["a", "b"]}`, and `"encoding"`.
#[derive(serde::Deserialize)]
struct EmbedRequest {
    input: Input,
    #[serde(default)]
    encoding: Option<String>,
}

#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Input {
    One(String),
    Many(Vec<String>),
}

/// Texts per forward pass: past this, batching gains little on a CPU and
/// the pass's memory keeps growing.
const PASS: usize = 32;

impl Embed {
    /// Embeds `texts` in one forward pass; one unit-length vector per text,
    /// and each text's tokens (padding excluded).
    pub fn embed(&self, texts: &[String]) -> Result<(Vec<Vec<f32>>, Vec<usize>), String> {
        let encodings = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| format!("tokenizing: {e}"))?;
        let n = encodings.len();
        let len = encodings.first().map(|e| e.get_ids().len()).unwrap_or(0);
        let mut ids = Vec::with_capacity(n * len);
        let mut types = Vec::with_capacity(n * len);
        let mut mask = Vec::with_capacity(n * len);
        for e in &encodings {
            ids.extend_from_slice(e.get_ids());
            types.extend_from_slice(e.get_type_ids());
            mask.extend_from_slice(e.get_attention_mask());
        }
        let tokens: Vec<usize> = encodings
            .iter()
            .map(|e| e.get_attention_mask().iter().filter(|m| **m != 0).count())
            .collect();
        if let Some(hidden) = self.model.few(&ids, &types, &mask, len) {
            return hidden
                .map(|hidden| (mean_pooled(&hidden, &mask, n, len), tokens))
                .map_err(|e| format!("running the model: {e}"));
        }
        let run = || -> candle_core::Result<Vec<Vec<f32>>> {
            let ids = Tensor::from_vec(ids, (n, len), &self.device)?;
            let types = Tensor::from_vec(types, (n, len), &self.device)?;
            let mask = Tensor::from_vec(mask, (n, len), &self.device)?;
            let hidden = self.model.forward(&ids, &types, &mask)?;
            let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
            let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
            let counts = mask.sum(1)?;
            let mean = summed.broadcast_div(&counts)?;
            let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?;
            mean.broadcast_div(&norm)?.to_vec2::<f32>()
        };
        run()
            .map(|v| (v, tokens))
            .map_err(|e| format!("running the model: {e}"))
    }
}

/// Each text's hidden states (`n` texts of `len` rows) averaged over its
/// tokens (`mask` 1) and scaled to unit length: the candle path's pooling,
/// in its order of sums, on the few-rows pass's own output.
fn mean_pooled(hidden: &[f32], mask: &[u32], n: usize, len: usize) -> Vec<Vec<f32>> {
    let width = hidden.len() / (n * len).max(1);
    (0..n)
        .map(|t| {
            let mut sum = vec![0f32; width];
            let mut count = 0f32;
            for r in t * len..(t + 1) * len {
                let m = mask[r] as f32;
                count += m;
                for (s, h) in sum.iter_mut().zip(&hidden[r * width..(r + 1) * width]) {
                    *s += h * m;
                }
            }
            let mean: Vec<f32> = sum.iter().map(|s| s / count).collect();
            let norm = mean.iter().map(|v| v * v).sum::<f32>().sqrt();
            mean.iter().map(|v| v / norm).collect()
        })
        .collect()
}

/// One request's texts and how it wants its vectors.
struct Asked {
    texts: Vec<String>,
    bulk: bool,
}

fn parse_embed(request: &Body) -> Result<Asked, WireError> {
    let req: EmbedRequest =
        parse_request(request, r#"{"input": "text"} or {"input": ["text", ...]}"#)?;
    let bulk = match req.encoding.as_deref() {
        None | Some("json") => false,
        Some("f32") => true,
        Some(other) => {
            return Err(WireError::new(
                ErrorKind::BadRequest,
                format!("`encoding` `{other}` is not `json` or `f32`"),
            ));
        }
    };
    let texts = match req.input {
        Input::One(text) => vec![text],
        Input::Many(texts) => texts,
    };
    if texts.is_empty() {
        return Err(WireError::new(
            ErrorKind::BadRequest,
            "`input` is an empty list; give at least one text",
        ));
    }
    Ok(Asked { texts, bulk })
}

/// Requests of one batch at most.
const MAX_BATCH: usize = 64;
/// Estimated tokens of one batch at most (see [`Embed::cost`]): 32 texts at
/// the model's training length.
const MAX_COST: usize = 32 * 256;

impl Embed {
    /// The answer to one request: JSON numbers, or bulk `f32`s.
    fn answer(&self, vectors: &[Vec<f32>], tokens: usize, bulk: bool) -> Body {
        if bulk {
            let bytes: Vec<u8> = vectors
                .iter()
                .flatten()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            let body =
                serde_json::json!({ "count": vectors.len(), "dim": self.dim, "tokens": tokens });
            return Body::with_bulk(body.to_string(), bytes);
        }
        let body = serde_json::json!({ "embeddings": vectors, "dim": self.dim, "tokens": tokens });
        Body::json(body.to_string())
    }

    /// Embeds `texts` in passes of at most [`PASS`], shortest first so that
    /// a pass pads little; vectors and token counts in `texts`' order. Stops
    /// with kind `cancelled` once `cancelled()` says so.
    fn embed_all(
        &self,
        texts: &[&str],
        progress: &crate::Progress,
        cancelled: impl Fn() -> bool,
    ) -> Result<Vec<(Vec<f32>, usize)>, WireError> {
        let mut order: Vec<usize> = (0..texts.len()).collect();
        order.sort_by_key(|&i| texts[i].len());
        let mut out: Vec<Option<(Vec<f32>, usize)>> = vec![None; texts.len()];
        for pass in order.chunks(PASS) {
            if cancelled() {
                return Err(WireError::new(ErrorKind::Cancelled, "cancelled"));
            }
            let batch: Vec<String> = pass.iter().map(|&i| texts[i].to_string()).collect();
            let (vectors, tokens) = self
                .embed(&batch)
                .map_err(|e| WireError::new(ErrorKind::Backend, e))?;
            for ((&i, v), t) in pass.iter().zip(vectors).zip(tokens) {
                out[i] = Some((v, t));
            }
            progress.advance();
        }
        Ok(out
            .into_iter()
            .map(|o| o.expect("every text embedded"))
            .collect())
    }
}

impl Backend for Embed {
    fn handle(&mut self, request: Body, ctx: &RequestContext) -> Result<Body, WireError> {
        let asked = parse_embed(&request)?;
        // At most PASS texts per forward pass: attention over a padded
        // batch grows with its size, so a request of thousands of texts
        // would otherwise need gigabytes at once. Each pass is progress.
        let texts: Vec<&str> = asked.texts.iter().map(String::as_str).collect();
        let done = self.embed_all(&texts, ctx.progress(), || ctx.is_cancelled())?;
        let tokens = done.iter().map(|(_, t)| t).sum();
        let vectors: Vec<Vec<f32>> = done.into_iter().map(|(v, _)| v).collect();
        Ok(self.answer(&vectors, tokens, asked.bulk))
    }

    fn batching(&self) -> Option<Batching> {
        Some(Batching {
            max_batch: MAX_BATCH,
            max_cost: MAX_COST,
        })
    }

    /// Estimated tokens: about one per four bytes of text plus the two
    /// special tokens, at most `max_length` per text.
    fn cost(&self, request: &Body) -> usize {
        match parse_embed(request) {
            Ok(asked) => asked
                .texts
                .iter()
                .map(|t| (t.len() / 4 + 2).min(self.max_length))
                .sum(),
            Err(_) => 1, // fails on its own when it runs
        }
    }

    /// The texts of every request in one set of passes, sorted by length;
    /// each request gets its own vectors and token count. A request with
    /// bad input fails alone; a cancelled one leaves without its vectors.
    fn handle_batch(
        &mut self,
        batch: Vec<(Body, &RequestContext)>,
    ) -> Vec<Result<Body, WireError>> {
        let asked: Vec<Result<Asked, WireError>> =
            batch.iter().map(|(body, _)| parse_embed(body)).collect();
        let mut texts: Vec<&str> = Vec::new();
        let mut owner: Vec<usize> = Vec::new();
        for (i, a) in asked.iter().enumerate() {
            if let Ok(a) = a {
                texts.extend(a.texts.iter().map(String::as_str));
                owner.extend(std::iter::repeat_n(i, a.texts.len()));
            }
        }
        let contexts: Vec<&RequestContext> = batch.iter().map(|(_, ctx)| *ctx).collect();
        let progress = contexts[0].progress();
        // The batch stops only if every request in it was cancelled.
        let all_cancelled = || contexts.iter().all(|c| c.is_cancelled());
        let done = match self.embed_all(&texts, progress, all_cancelled) {
            Ok(done) => done,
            // The model failed on the batch: each request runs alone, so
            // one text that breaks it fails only its own request.
            Err(e) if e.kind != ErrorKind::Cancelled => {
                return batch
                    .into_iter()
                    .map(|(body, ctx)| self.handle(body, ctx))
                    .collect();
            }
            Err(e) => return vec![Err(e); batch.len()],
        };
        let mut per: Vec<(Vec<Vec<f32>>, usize)> = vec![(Vec::new(), 0); batch.len()];
        for ((v, t), i) in done.into_iter().zip(owner) {
            per[i].0.push(v);
            per[i].1 += t;
        }
        asked
            .into_iter()
            .zip(per)
            .zip(contexts)
            .map(|((a, (vectors, tokens)), ctx)| {
                let a = a?;
                if ctx.is_cancelled() {
                    return Err(WireError::new(ErrorKind::Cancelled, "cancelled"));
                }
                Ok(self.answer(&vectors, tokens, a.bulk))
            })
            .collect()
    }

    fn describe(&self) -> serde_json::Value {
        let mut details = serde_json::json!({
            "dim": self.dim,
            "dir": self.dir.display().to_string(),
            "load_mode": self.load_mode.as_str(),
            "max_length": self.max_length,
            "threads": self.threads,
            "warmup_ms": self.warmup_ms,
        });
        if let (Some(out), serde_json::Value::Object(device)) =
            (details.as_object_mut(), device_details(&self.device))
        {
            out.extend(device);
        }
        details
    }
}
