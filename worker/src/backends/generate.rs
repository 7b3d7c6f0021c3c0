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
//! - `quant` = `native` (default; `q4_1` is accepted for a Q4_1 file: the
//!   weights as the file has them) or `q8_0`: convert the weights once to
//!   Q8_0, cached next to the file as `<stem>.Q8_0.gguf` and reused while it
//!   is newer than the source. candle has no SIMD kernel for Q4_1; Q8_0
//!   has one, and for SmolLM2-135M on 2 cores it decodes about 2x and reads
//!   prompts about 4x faster, for a file half as large again;
//! - defaults for requests: `max_tokens` (256), `temperature` (0 = greedy),
//!   `top_p` (none), `seed` (none: a fresh seed per request, so sampled
//!   answers vary unless a seed is given; greedy ignores it).
//!
//! Request (JSON): `{"messages": [{"role": "system"|"user"|"assistant",
//! "content": "..."}, ...]}`, or `{"input": "..."}` / `{"prompt": "..."}`,
//! which is one user message (the model is a chat model; raw completion is
//! not offered). Optional per request: `max_tokens`, `temperature`, `top_p`,
//! `seed`, `stop` (a string or an array of strings).
//!
//! While generating, chunks `{"delta": "..."}` stream the text; their
//! concatenation is exactly the final `text`. Final body:
//! `{"text", "finish_reason": "stop"|"length", "prompt_tokens",
//! "completion_tokens", "prompt_ms", "decode_ms", "decode_tokens_per_s"}`,
//! where `decode_tokens_per_s` counts one-token forward passes after the
//! prompt's.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Cursor, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use berth_protocol::{Body, ErrorKind, LoadSpec, WireError};
use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use candle_transformers::generation::LogitsProcessor;
use candle_transformers::models::quantized_llama::{MAX_SEQ_LEN, ModelWeights};
use serde::Deserialize;
use serde_json::json;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use crate::backends::{LoadMode, choose_device, configure_threads, device_name};
use crate::{Backend, LoadContext, Progress, RequestContext};

const OPTIONS: &[&str] = &[
    "load_mode",
    "threads",
    "device",
    "quant",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
];
const DEFAULT_MAX_TOKENS: usize = 256;
const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>";
/// GGUF `token_type` values.
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;
/// Prompt tokens per forward pass. Attention scores take heads × chunk ×
/// context floats: a 4k-token prompt in one pass peaks at 2.2 GiB even for
/// SmolLM2-135M, in chunks at 0.6 GiB.
const PREFILL_CHUNK: usize = 256;
/// `general.file_type` for "mostly Q8_0" (llama.cpp's `LLAMA_FTYPE_MOSTLY_Q8_0`).
const FILE_TYPE_Q8_0: u32 = 7;

/// Generation settings: the model's defaults, overridden per request.
#[derive(Debug, Clone, PartialEq)]
struct Settings {
    max_tokens: usize,
    temperature: f64,
    top_p: Option<f64>,
    /// `None`: a fresh seed per request, so sampled answers vary.
    seed: Option<u64>,
}

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

impl Settings {
    fn check(&self) -> Result<(), String> {
        if self.max_tokens == 0 {
            return Err("`max_tokens` must be at least 1".into());
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "`temperature` must be a number >= 0 (0 = greedy), not {}",
                self.temperature
            ));
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(format!("`top_p` must be in (0, 1], not {p}"));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Message {
    role: Role,
    content: String,
}

/// A parsed, validated request.
#[derive(Debug, Clone, PartialEq)]
struct Request {
    messages: Vec<Message>,
    settings: Settings,
    stop: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequest {
    input: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<RawMessage>>,
    max_tokens: Option<usize>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<u64>,
    stop: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct RawMessage {
    role: String,
    content: RawContent,
}

/// A message's content: a string, or OpenAI's array of content parts.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawContent {
    Text(String),
    Parts(Vec<RawPart>),
}

#[derive(Deserialize)]
struct RawPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

impl RawContent {
    fn into_text(self, message: usize) -> Result<String, String> {
        match self {
            RawContent::Text(text) => Ok(text),
            RawContent::Parts(parts) => parts
                .into_iter()
                .map(|p| match (p.kind.as_str(), p.text) {
                    ("text", Some(text)) => Ok(text),
                    (kind, _) => Err(format!(
                        "message {message} has a `{kind}` content part; this model takes text only"
                    )),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|texts| texts.concat()),
        }
    }
}

/// Parses a request body; the error is the message for a `BadRequest`.
fn parse_request(json: &str, defaults: &Settings) -> Result<Request, String> {
    let raw: RawRequest = serde_json::from_str(json).map_err(|e| {
        if e.is_data() {
            format!("bad request: {e}")
        } else {
            format!("the request is not valid JSON: {e}")
        }
    })?;
    let messages = match (raw.input, raw.prompt, raw.messages) {
        (Some(text), None, None) | (None, Some(text), None) => {
            if text.trim().is_empty() {
                return Err("the input is empty".into());
            }
            vec![Message {
                role: Role::User,
                content: text,
            }]
        }
        (None, None, Some(raw)) => {
            if raw.is_empty() {
                return Err("`messages` is empty".into());
            }
            let mut messages = Vec::with_capacity(raw.len());
            for (i, m) in raw.into_iter().enumerate() {
                let role = match m.role.as_str() {
                    "system" => Role::System,
                    "user" => Role::User,
                    "assistant" => Role::Assistant,
                    other => {
                        return Err(format!(
                            "message {i} has role `{other}` (roles: system, user, assistant)"
                        ));
                    }
                };
                messages.push(Message {
                    role,
                    content: m.content.into_text(i)?,
                });
            }
            if messages.iter().all(|m| m.content.trim().is_empty()) {
                return Err("every message is empty".into());
            }
            messages
        }
        (None, None, None) => {
            return Err(
                "the request has no text: send {\"input\": TEXT} or {\"messages\": [...]}".into(),
            );
        }
        _ => return Err("send only one of `input`, `prompt` and `messages`".into()),
    };
    let settings = Settings {
        max_tokens: raw.max_tokens.unwrap_or(defaults.max_tokens),
        temperature: raw.temperature.unwrap_or(defaults.temperature),
        top_p: raw.top_p.or(defaults.top_p),
        seed: raw.seed.or(defaults.seed),
    };
    settings.check()?;
    let stop = match raw.stop {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::String(s)) => vec![s],
        Some(serde_json::Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                serde_json::Value::String(s) => Ok(s),
                other => Err(format!("`stop` holds {other}, not a string")),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(format!(
                "`stop` must be a string or an array of strings, not {other}"
            ));
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err("a `stop` string is empty".into());
    }
    Ok(Request {
        messages,
        settings,
        stop,
    })
}

/// The ChatML chat format (`<|im_start|>role\ncontent<|im_end|>\n`), the only
/// one this backend renders. The model's Jinja template is not executed: it
/// is recognised, and its default system prompt taken out of it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ChatMl {
    default_system: Option<String>,
}

impl ChatMl {
    fn from_template(template: &str) -> Result<Self, String> {
        if !template.contains(IM_START) {
            return Err(
                "its chat template is not ChatML (no `<|im_start|>`), the only format this backend renders"
                    .into(),
            );
        }
        Ok(ChatMl {
            default_system: default_system_prompt(template),
        })
    }

    fn render(&self, messages: &[Message]) -> String {
        let mut out = String::new();
        let mut turn = |role: &str, content: &str| {
            out.push_str(IM_START);
            out.push_str(role);
            out.push('\n');
            out.push_str(content);
            out.push_str(IM_END);
            out.push('\n');
        };
        if let Some(system) = &self.default_system
            && messages.first().map(|m| m.role) != Some(Role::System)
        {
            turn(Role::System.as_str(), system);
        }
        for m in messages {
            turn(m.role.as_str(), &m.content);
        }
        out.push_str(IM_START);
        out.push_str(Role::Assistant.as_str());
        out.push('\n');
        out
    }
}

/// The system prompt a ChatML template inserts when the conversation has
/// none: a literal `<|im_start|>system\n...<|im_end|>` in the template. A
/// system turn built from an expression (quotes, braces) is not a default.
fn default_system_prompt(template: &str) -> Option<String> {
    let marker = format!("{IM_START}system");
    template.match_indices(&marker).find_map(|(at, _)| {
        let rest = &template[at + marker.len()..];
        let rest = rest
            .strip_prefix('\n')
            .or_else(|| rest.strip_prefix("\\n"))?;
        let (content, _) = rest.split_once(IM_END)?;
        if content.is_empty() || content.contains(['\'', '"', '{', '}']) {
            return None;
        }
        Some(content.replace("\\n", "\n"))
    })
}

/// How much of the text generated so far may be streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scan {
    /// A stop string begins at this byte offset: the text ends there.
    Stop(usize),
    /// `text[..end]` is final and may be sent.
    Safe(usize),
}

/// Scans `text`, of which `text[..emitted]` was already streamed.
///
/// Held back: a trailing U+FFFD (the decoder's stand-in for a UTF-8
/// sequence whose remaining bytes are in tokens not generated yet), and a
/// tail that could be the start of a stop string. Because such a tail is never
/// sent, a stop string can only begin at or after `emitted`.
fn scan(text: &str, emitted: usize, stops: &[String]) -> Scan {
    let pending = text.get(emitted..).unwrap_or("");
    if let Some(at) = stops.iter().filter_map(|s| pending.find(s.as_str())).min() {
        return Scan::Stop(emitted + at);
    }
    let settled = pending.trim_end_matches('\u{FFFD}');
    let held = settled
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| {
            let tail = &settled[i..];
            stops.iter().any(|s| s.starts_with(tail))
        })
        .unwrap_or(settled.len());
    Scan::Safe(emitted + held)
}

/// Builds the tokenizer a GGUF file describes (`tokenizer.ggml.*`): a
/// byte-level BPE over the file's tokens and merges, with its control tokens
/// as special tokens that encode as single ids. For SmolLM2 (`pre` =
/// `smollm`) the pre-tokenizer splits digits one by one first, like its
/// `tokenizer.json`. Encode with `add_special_tokens = false`: there is no
/// post-processor; a BOS token, if the file wants one, is the caller's.
///
/// candle's own GGUF tokenizer is not used: it adds a leading space and
/// ignores the `smollm` pre-tokenizer.
pub fn tokenizer_from_gguf(content: &Content) -> Result<Tokenizer, String> {
    let md = &content.metadata;
    let model = md_str(md, "tokenizer.ggml.model").unwrap_or("(none)");
    if model != "gpt2" {
        return Err(format!(
            "tokenizer model `{model}` is not supported (only `gpt2`, byte-level BPE)"
        ));
    }
    let digits_first = match md_str(md, "tokenizer.ggml.pre") {
        Some("smollm") => true,
        Some("gpt-2") => false,
        Some(other) => {
            return Err(format!(
                "pre-tokenizer `{other}` is not supported (supported: smollm, gpt-2)"
            ));
        }
        None => return Err("the file names no pre-tokenizer (`tokenizer.ggml.pre`)".into()),
    };
    let tokens = md_strings(md, "tokenizer.ggml.tokens")?;
    let merges = md_strings(md, "tokenizer.ggml.merges")?;
    let types = match md.get("tokenizer.ggml.token_type") {
        None => Vec::new(),
        Some(Value::Array(v)) => v.iter().map(value_i64).collect(),
        Some(_) => return Err("`tokenizer.ggml.token_type` is not an array".into()),
    };

    let mut vocab = Vocab::default();
    for (id, token) in tokens.iter().enumerate() {
        let id = u32::try_from(id).map_err(|_| "the vocabulary is too large".to_string())?;
        vocab.entry(token.to_string()).or_insert(id);
    }
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| format!("merge `{m}` is not two tokens"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| format!("cannot build the BPE tokenizer: {e}"))?;

    let byte_level = ByteLevel::new(false, true, true);
    let mut pre: Vec<PreTokenizerWrapper> = Vec::new();
    if digits_first {
        pre.push(Digits::new(true).into());
    }
    pre.push(byte_level.into());
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(Sequence::new(pre)));
    tokenizer.with_decoder(Some(byte_level));

    let mut special = Vec::new();
    let mut user_defined = Vec::new();
    for (token, kind) in tokens.iter().zip(&types) {
        match kind {
            Some(TOKEN_CONTROL) => special.push(AddedToken::from(token.to_string(), true)),
            Some(TOKEN_USER_DEFINED) => {
                user_defined.push(AddedToken::from(token.to_string(), false))
            }
            _ => {}
        }
    }
    tokenizer
        .add_special_tokens(special)
        .map_err(|e| format!("cannot add the control tokens: {e}"))?;
    tokenizer
        .add_tokens(user_defined)
        .map_err(|e| format!("cannot add the user-defined tokens: {e}"))?;
    Ok(tokenizer)
}

fn md_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Option<&'a str> {
    match md.get(key) {
        Some(Value::String(s)) => Some(s),
        _ => None,
    }
}

fn md_strings<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Vec<&'a str>, String> {
    let Some(Value::Array(items)) = md.get(key) else {
        return Err(format!("the file has no `{key}` array"));
    };
    items
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.as_str()),
            _ => Err(format!("`{key}` holds a value that is not a string")),
        })
        .collect()
}

fn value_i64(v: &Value) -> Option<i64> {
    match *v {
        Value::U8(x) => Some(x.into()),
        Value::I8(x) => Some(x.into()),
        Value::U16(x) => Some(x.into()),
        Value::I16(x) => Some(x.into()),
        Value::U32(x) => Some(x.into()),
        Value::I32(x) => Some(x.into()),
        Value::U64(x) => i64::try_from(x).ok(),
        Value::I64(x) => Some(x),
        _ => None,
    }
}

fn md_u32(md: &HashMap<String, Value>, key: &str) -> Option<u32> {
    md.get(key)
        .and_then(value_i64)
        .and_then(|x| u32::try_from(x).ok())
}

/// The file's bytes, mapped or read.
enum Data {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Data {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Data::Mapped(m) => m,
            Data::Owned(v) => v,
        }
    }
}

fn open_data(path: &Path, mode: LoadMode) -> Result<Data, String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!("model file `{shown}` does not exist"),
        _ => format!("cannot read model file `{shown}`: {e}"),
    })?;
    if meta.is_dir() {
        return Err(format!(
            "`{shown}` is a directory; the generate backend needs a GGUF file"
        ));
    }
    let read_err = |e: std::io::Error| format!("cannot read model file `{shown}`: {e}");
    match mode {
        // An empty file cannot be mapped; it fails the GGUF check instead.
        LoadMode::Mmap if meta.len() > 0 => {
            let file = File::open(path).map_err(read_err)?;
            // SAFETY: the map is read-only and lives only while the model is
            // built (candle copies every tensor out of it). A file truncated
            // meanwhile kills this worker with SIGBUS, which the supervisor
            // reports like any crash; it cannot corrupt another process.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(read_err)?;
            Ok(Data::Mapped(map))
        }
        _ => std::fs::read(path).map(Data::Owned).map_err(read_err),
    }
}

/// A reader that advances the load progress on every read, so a long load
/// shows as moving.
struct Counted<'a, R> {
    inner: R,
    progress: &'a Progress,
}

impl<R: Read> Read for Counted<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.progress.advance();
        self.inner.read(buf)
    }
}

impl<R: Seek> Seek for Counted<'_, R> {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        self.inner.seek(pos)
    }
}

fn parse_gguf(bytes: &[u8], shown: &str, progress: &Progress) -> Result<Content, String> {
    if bytes.get(..4) != Some(b"GGUF".as_slice()) {
        return Err(format!("`{shown}` is not a GGUF file"));
    }
    let mut reader = Counted {
        inner: Cursor::new(bytes),
        progress,
    };
    Content::read(&mut reader).map_err(|e| format!("`{shown}` is not a valid GGUF file: {e}"))
}

/// The quantization most of the weights use (by element count), e.g. `q4_1`.
fn dominant_dtype(content: &Content) -> String {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for info in content.tensor_infos.values() {
        if info.shape.rank() >= 2 {
            *counts
                .entry(format!("{:?}", info.ggml_dtype).to_lowercase())
                .or_default() += info.shape.elem_count();
        }
    }
    counts
        .into_iter()
        .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0)))
        .map(|(name, _)| name)
        .unwrap_or_else(|| "unknown".into())
}

/// Where the Q8_0 copy of `src` is cached.
fn q8_0_cache_path(src: &Path) -> PathBuf {
    let stem = src
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    src.with_file_name(format!("{stem}.Q8_0.gguf"))
}

fn is_fresh(cache: &Path, src: &Path) -> bool {
    let modified = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .filter(|m| m.is_file())
            .and_then(|m| m.modified().ok())
    };
    matches!((modified(cache), modified(src)), (Some(c), Some(s)) if c >= s)
}

/// The weights' source after the `quant` option: a file, or (when the Q8_0
/// copy could not be written next to the source) converted bytes.
enum Source {
    File(PathBuf),
    Converted(Vec<u8>),
}

/// Converts `content`'s block-quantized tensors to Q8_0 and writes a GGUF
/// file with the same metadata to `out`. Float tensors (norms) and tensors
/// already in Q8_0 are kept as they are.
fn convert_to_q8_0<W: Write + Seek>(
    content: &Content,
    bytes: &[u8],
    out: &mut W,
    progress: &Progress,
) -> Result<(), String> {
    let mut reader = Cursor::new(bytes);
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let tensor = content
            .tensor(&mut reader, name, &Device::Cpu)
            .map_err(|e| format!("reading tensor `{name}`: {e}"))?;
        let keep = matches!(
            tensor.dtype(),
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 | GgmlDType::Q8_0
        ) || tensor.shape().dims().last().copied().unwrap_or(0) % 32 != 0;
        let tensor = if keep {
            tensor
        } else {
            tensor
                .dequantize(&Device::Cpu)
                .and_then(|t| QTensor::quantize(&t, GgmlDType::Q8_0))
                .map_err(|e| format!("converting tensor `{name}` to Q8_0: {e}"))?
        };
        tensors.push((name.as_str(), tensor));
        progress.advance();
    }
    let file_type = Value::U32(FILE_TYPE_Q8_0);
    let mut metadata: Vec<(&str, &Value)> = content
        .metadata
        .iter()
        // candle's writer aligns to 32 bytes, whatever the source said.
        .filter(|(k, _)| k.as_str() != "general.alignment")
        .map(|(k, v)| {
            let v = if k == "general.file_type" {
                &file_type
            } else {
                v
            };
            (k.as_str(), v)
        })
        .collect();
    metadata.sort_by_key(|(k, _)| *k);
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    gguf_file::write(out, &metadata, &tensors).map_err(|e| format!("writing Q8_0 weights: {e}"))
}

/// Resolves `quant=q8_0`: the cached copy when fresh, else a new one written
/// to a temporary name and renamed into place (so a reader never sees half a
/// file), else (an unwritable folder) a copy in memory.
fn q8_0_source(src: &Path, mode: LoadMode, progress: &Progress) -> Result<Source, String> {
    let cache = q8_0_cache_path(src);
    if is_fresh(&cache, src) {
        return Ok(Source::File(cache));
    }
    let shown = src.display().to_string();
    let data = open_data(src, mode)?;
    let content = parse_gguf(&data, &shown, progress)?;
    check_architecture(&content, &shown)?;
    let needs = content.tensor_infos.values().any(|t| {
        !matches!(
            t.ggml_dtype,
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 | GgmlDType::Q8_0
        )
    });
    if !needs {
        return Ok(Source::File(src.to_path_buf()));
    }
    let file_name = cache
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = cache.with_file_name(format!(".{file_name}.{}.tmp", std::process::id()));
    let written = (|| -> Result<(), String> {
        let file = File::create(&tmp).map_err(|e| e.to_string())?;
        let mut out = BufWriter::new(file);
        convert_to_q8_0(&content, &data, &mut out, progress)?;
        let file = out.into_inner().map_err(|e| e.to_string())?;
        file.sync_all().map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, &cache).map_err(|e| e.to_string())
    })();
    match written {
        Ok(()) => Ok(Source::File(cache)),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            eprintln!(
                "generate: cannot cache Q8_0 weights at `{}` ({e}); converting in memory",
                cache.display()
            );
            let mut out = Cursor::new(Vec::new());
            convert_to_q8_0(&content, &data, &mut out, progress)?;
            Ok(Source::Converted(out.into_inner()))
        }
    }
}

fn check_architecture(content: &Content, shown: &str) -> Result<(), String> {
    match md_str(&content.metadata, "general.architecture") {
        Some("llama") => Ok(()),
        Some(arch) => Err(format!(
            "`{shown}` is a `{arch}` model; the generate backend runs `llama` models"
        )),
        None => Err(format!(
            "`{shown}` names no architecture (`general.architecture`)"
        )),
    }
}

#[derive(Debug)]
struct Generate {
    name: String,
    /// Never run: each request runs a clone (the tensors are shared, only
    /// the KV caches and masks are per clone), so a request starts from an
    /// empty cache and its memory goes when it ends.
    model: ModelWeights,
    tokenizer: Tokenizer,
    chat: ChatMl,
    /// Tokens that end the reply (end of turn, end of text).
    end_ids: HashSet<u32>,
    bos: Option<u32>,
    context_length: usize,
    defaults: Settings,
    details: serde_json::Value,
    device: Device,
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
        Source::Converted(bytes) => (
            Data::Owned(bytes),
            format!("(in memory, converted from {})", src.display()),
        ),
    };
    progress.advance();
    let content = parse_gguf(&data, &file, progress).map_err(fail)?;
    check_architecture(&content, &file).map_err(fail)?;
    let dtype = dominant_dtype(&content);
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
    let model = ModelWeights::from_gguf(content, &mut reader, &device)
        .map_err(|e| fail(format!("cannot build the model from `{file}`: {e}")))?;
    drop(data);
    progress.advance();
    Ok(Box::new(Generate {
        name: spec.name.clone(),
        model,
        tokenizer,
        chat,
        end_ids,
        bos,
        context_length,
        defaults,
        details,
        device,
    }))
}

impl Generate {
    fn error(&self, kind: ErrorKind, msg: impl std::fmt::Display) -> WireError {
        WireError::new(kind, format!("model `{}`: {msg}", self.name))
    }

    fn generate(&self, req: &Request, ctx: &RequestContext) -> Result<Body, WireError> {
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

impl Backend for Generate {
    fn handle(&mut self, request: Body, ctx: &RequestContext) -> Result<Body, WireError> {
        let req = parse_request(&request.json, &self.defaults)
            .map_err(|e| self.error(ErrorKind::BadRequest, e))?;
        self.generate(&req, ctx)
    }

    fn describe(&self) -> serde_json::Value {
        self.details.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn defaults() -> Settings {
        Settings {
            max_tokens: DEFAULT_MAX_TOKENS,
            temperature: 0.0,
            top_p: None,
            seed: None,
        }
    }

    fn stops(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn scan_without_stops_sends_everything_but_a_broken_tail() {
        assert_eq!(scan("hello", 0, &[]), Scan::Safe(5));
        assert_eq!(scan("hello", 2, &[]), Scan::Safe(5));
        assert_eq!(scan("caf\u{FFFD}", 0, &[]), Scan::Safe(3));
        assert_eq!(scan("a\u{FFFD}b", 0, &[]), Scan::Safe(5));
    }

    #[test]
    fn scan_holds_back_a_possible_stop_start() {
        let s = stops(&["\nUser:", "END"]);
        assert_eq!(scan("answer\nUs", 0, &s), Scan::Safe(6));
        assert_eq!(scan("answer E", 0, &s), Scan::Safe(7));
        assert_eq!(scan("answer\nUx", 0, &s), Scan::Safe(9));
        // A held tail is re-examined from where streaming stopped.
        assert_eq!(scan("answer\nUser", 6, &s), Scan::Safe(6));
    }

    #[test]
    fn scan_finds_the_earliest_stop_after_the_sent_text() {
        let s = stops(&["b", "cd"]);
        assert_eq!(scan("xxcdab", 0, &s), Scan::Stop(2));
        assert_eq!(scan("xx\nUser: hi", 2, &stops(&["\nUser:"])), Scan::Stop(2));
        assert_eq!(scan("é stop", 0, &stops(&["stop"])), Scan::Stop(3));
    }

    #[test]
    fn scan_concatenation_equals_the_text() {
        // Feed growing prefixes as a decoder would and rebuild the stream.
        let full = "Hello wörld, 漢字 and more END trailing";
        let s = stops(&["END"]);
        let mut emitted = 0;
        let mut streamed = String::new();
        let mut result = None;
        for (i, _) in full.char_indices().skip(1).chain([(full.len(), ' ')]) {
            let text = &full[..i];
            match scan(text, emitted, &s) {
                Scan::Stop(at) => {
                    streamed.push_str(&text[emitted..at]);
                    result = Some(text[..at].to_string());
                    break;
                }
                Scan::Safe(end) => {
                    streamed.push_str(&text[emitted..end]);
                    emitted = end;
                }
            }
        }
        assert_eq!(result.as_deref(), Some("Hello wörld, 漢字 and more "));
        assert_eq!(streamed, "Hello wörld, 漢字 and more ");
    }

    #[test]
    fn chatml_adds_the_templates_default_system_prompt() {
        let chat = ChatMl::from_template(SMOLLM2_TEMPLATE).unwrap();
        assert_eq!(
            chat.default_system.as_deref(),
            Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
        );
        let user = [Message {
            role: Role::User,
            content: "Hi".into(),
        }];
        assert_eq!(
            chat.render(&user),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn chatml_keeps_the_callers_system_prompt() {
        let chat = ChatMl::from_template(SMOLLM2_TEMPLATE).unwrap();
        let messages = [
            Message {
                role: Role::System,
                content: "Be brief.".into(),
            },
            Message {
                role: Role::User,
                content: "Hi".into(),
            },
            Message {
                role: Role::Assistant,
                content: "Hello.".into(),
            },
            Message {
                role: Role::User,
                content: "Bye".into(),
            },
        ];
        assert_eq!(
            chat.render(&messages),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn chatml_without_a_literal_system_prompt_adds_none() {
        let template = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}";
        let chat = ChatMl::from_template(template).unwrap();
        assert_eq!(chat.default_system, None);
        let escaped = "{{ '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}";
        assert_eq!(
            default_system_prompt(escaped).as_deref(),
            Some("You are Qwen.")
        );
        let expression = "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>' }}";
        assert_eq!(default_system_prompt(expression), None);
    }

    #[test]
    fn a_template_that_is_not_chatml_is_refused() {
        let llama3 = "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{% endfor %}";
        let err = ChatMl::from_template(llama3).unwrap_err();
        assert!(err.contains("not ChatML"), "{err}");
    }

    #[test]
    fn requests_parse_into_messages_and_settings() {
        let r = parse_request(r#"{"input": "What is 2 + 3?"}"#, &defaults()).unwrap();
        assert_eq!(
            r.messages,
            [Message {
                role: Role::User,
                content: "What is 2 + 3?".into()
            }]
        );
        assert_eq!(r.settings, defaults());
        assert!(r.stop.is_empty());

        let r = parse_request(
            r#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["a", "b"]}"#,
            &defaults(),
        )
        .unwrap();
        assert_eq!(r.messages.len(), 2);
        assert_eq!(r.messages[0].role, Role::System);
        assert_eq!(
            r.settings,
            Settings {
                max_tokens: 5,
                temperature: 0.7,
                top_p: Some(0.9),
                seed: Some(1)
            }
        );
        assert_eq!(r.stop, ["a", "b"]);

        let r = parse_request(r#"{"prompt": "x", "stop": "\n"}"#, &defaults()).unwrap();
        assert_eq!(r.stop, ["\n"]);
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let err = |json: &str| parse_request(json, &defaults()).unwrap_err();
        assert!(err("{").contains("not valid JSON"));
        assert!(err("[]").contains("bad request"));
        assert!(err(r#"{"input": ""}"#).contains("empty"));
        assert!(err(r#"{"prompt": "  \n"}"#).contains("empty"));
        assert!(err(r#"{"messages": []}"#).contains("`messages` is empty"));
        assert!(err(r#"{"messages": [{"role": "user", "content": ""}]}"#).contains("empty"));
        assert!(err(r#"{"messages": [{"role": "tool", "content": "x"}]}"#).contains("`tool`"));
        assert!(err(r#"{"messages": [{"role": "user"}]}"#).contains("content"));
        assert!(err("{}").contains("no text"));
        assert!(err(r#"{"input": "a", "messages": []}"#).contains("only one"));
        assert!(err(r#"{"input": "a", "max_token": 3}"#).contains("max_token"));
        assert!(err(r#"{"input": "a", "max_tokens": 0}"#).contains("max_tokens"));
        assert!(err(r#"{"input": "a", "max_tokens": -1}"#).contains("bad request"));
        assert!(err(r#"{"input": "a", "temperature": -1}"#).contains("temperature"));
        assert!(err(r#"{"input": "a", "top_p": 0}"#).contains("top_p"));
        assert!(err(r#"{"input": "a", "top_p": 1.5}"#).contains("top_p"));
        assert!(err(r#"{"input": "a", "stop": 3}"#).contains("`stop`"));
        assert!(err(r#"{"input": "a", "stop": ["x", 3]}"#).contains("`stop`"));
        assert!(err(r#"{"input": "a", "stop": [""]}"#).contains("empty"));
    }

    /// A byte-level vocabulary: the 256 byte symbols, two merges and the
    /// ChatML control tokens.
    fn tiny_content() -> Content {
        let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), IM_START.into(), IM_END.into()];
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort();
        tokens.extend(alphabet.iter().map(|c| c.to_string()));
        tokens.extend(["he".to_string(), "hel".to_string()]);
        let types: Vec<Value> = tokens
            .iter()
            .enumerate()
            .map(|(i, _)| Value::I32(if i < 3 { 3 } else { 1 }))
            .collect();
        let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
        let metadata = HashMap::from([
            (
                "tokenizer.ggml.model".to_string(),
                Value::String("gpt2".into()),
            ),
            (
                "tokenizer.ggml.pre".to_string(),
                Value::String("smollm".into()),
            ),
            ("tokenizer.ggml.tokens".to_string(), strings(tokens)),
            ("tokenizer.ggml.token_type".to_string(), Value::Array(types)),
            (
                "tokenizer.ggml.merges".to_string(),
                strings(vec!["h e".into(), "he l".into()]),
            ),
        ]);
        Content {
            magic: gguf_file::VersionedMagic::GgufV3,
            metadata,
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        }
    }

    #[test]
    fn the_gguf_tokenizer_round_trips_and_keeps_control_tokens_whole() {
        let tokenizer = tokenizer_from_gguf(&tiny_content()).unwrap();
        let text = "<|im_start|>user\nhello 12345 café naïve 漢字テスト<|im_end|>\n";
        let ids = tokenizer.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(ids[0], 1);
        assert!(ids.contains(&2));
        assert!(ids.contains(&tokenizer.token_to_id("hel").unwrap()));
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), text);
        // Digits are split one by one, and no leading space is added.
        let digits = tokenizer.encode("12", false).unwrap();
        assert_eq!(digits.get_tokens(), ["1", "2"]);
    }

    #[test]
    fn unsupported_tokenizers_are_refused() {
        let mut content = tiny_content();
        content.metadata.insert(
            "tokenizer.ggml.pre".into(),
            Value::String("llama-bpe".into()),
        );
        assert!(
            tokenizer_from_gguf(&content)
                .unwrap_err()
                .contains("llama-bpe")
        );
        content
            .metadata
            .insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
        assert!(tokenizer_from_gguf(&content).unwrap_err().contains("llama"));
    }

    #[test]
    fn the_q8_0_cache_sits_next_to_the_source() {
        assert_eq!(
            q8_0_cache_path(Path::new("/m/SmolLM2.Q4_1.gguf")),
            Path::new("/m/SmolLM2.Q4_1.Q8_0.gguf")
        );
    }
}
