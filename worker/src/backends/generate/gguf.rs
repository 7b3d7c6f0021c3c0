//! The GGUF file as metadata: parsing its header, reading typed values out
//! of its key-value store, checking the architecture, and building the
//! tokenizer it describes (a model file carries its own tokenizer).

use std::collections::HashMap;
use std::io::{Cursor, Read, Seek, SeekFrom};

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use crate::Progress;

/// GGUF `token_type` values.
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

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

pub(super) fn md_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Option<&'a str> {
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

pub(super) fn md_u32(md: &HashMap<String, Value>, key: &str) -> Option<u32> {
    md.get(key)
        .and_then(value_i64)
        .and_then(|x| u32::try_from(x).ok())
}

pub(super) fn parse_gguf(
    bytes: &[u8],
    shown: &str,
    progress: &Progress,
) -> Result<Content, String> {
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
pub(super) fn dominant_dtype(content: &Content) -> String {
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

pub(super) fn check_architecture(content: &Content, shown: &str) -> Result<(), String> {
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

/// What the file must hold to be loaded: a `llama` model
/// ([`check_architecture`]) whose every tensor's declared shape and type
/// fit, with its offset, inside the file's `len` bytes. A header can claim
/// any shape (`[2^62, 2^62]`); unchecked, that loads and then fails every
/// request with an overflow.
pub(super) fn check_model(content: &Content, len: u64, shown: &str) -> Result<(), String> {
    check_architecture(content, shown)?;
    for (name, info) in &content.tensor_infos {
        let dims = info.shape.dims();
        let elements = dims
            .iter()
            .try_fold(1u64, |n, d| n.checked_mul(*d as u64))
            .filter(|n| *n > 0 || dims.contains(&0));
        let block = info.ggml_dtype.block_size() as u64;
        let bytes = elements
            .filter(|n| n % block == 0)
            .and_then(|n| (n / block).checked_mul(info.ggml_dtype.type_size() as u64));
        let end = bytes.and_then(|b| {
            content
                .tensor_data_offset
                .checked_add(info.offset)
                .and_then(|start| start.checked_add(b))
        });
        match end {
            Some(end) if end <= len => {}
            _ => {
                return Err(format!(
                    "`{shown}` declares tensor `{name}` of shape {dims:?} ({:?}) at offset {}, \
                     which does not fit in the file's {len} bytes; the file is corrupt or \
                     truncated",
                    info.ggml_dtype, info.offset
                ));
            }
        }
    }
    Ok(())
}

/// A reader that advances the load progress on every read, so a long load
/// shows as moving.
pub(super) struct Counted<'a, R> {
    pub(super) inner: R,
    pub(super) progress: &'a Progress,
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file;

    use super::super::template::{IM_END, IM_START};

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
}
