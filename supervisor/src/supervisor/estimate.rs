//! What a model will take before it is ever loaded, from its files: a
//! GGUF file's tensors plus the cache its context needs, a safetensors
//! file's (or folder's) tensors as their headers list them. A first load
//! is planned with this, so budgets hold from the first load, not the
//! second (its load then measures what it really took, which plans the
//! next). Only headers are read, each bounded: a file that is not what its
//! name says estimates nothing, and the weights' size on disk stands in.

use std::io::{BufReader, Read, Seek};
use std::path::Path;

/// An estimate of a model's memory, and what it was made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Estimate {
    pub bytes: u64,
    /// `gguf`, `safetensors`.
    pub from: &'static str,
}

/// The context the cache of a GGUF model is counted for, at most: a server
/// is rarely run at a trained context of 128k tokens, and counting one
/// would keep a model off a machine it fits.
const CONTEXT_COUNTED: u64 = 32_768;

/// The most of a header read: GGUF's metadata holds the tokenizer's
/// vocabulary (a few MB); a safetensors header is a JSON object.
const HEADER_MAX: u64 = 256 << 20;

/// The estimate for a model at `path` (a `.gguf` file, a `.safetensors`
/// file, or a folder holding either), if its files say; blocking.
pub(super) fn from_files(path: &Path) -> Option<Estimate> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.is_file() {
        return of_file(path);
    }
    if !meta.is_dir() {
        return None;
    }
    let mut gguf = None;
    let mut safetensors = 0u64;
    let mut any_safetensors = false;
    for entry in std::fs::read_dir(path)
        .ok()?
        .filter_map(Result::ok)
        .take(10_000)
    {
        let file = entry.path();
        match file.extension().and_then(|e| e.to_str()) {
            Some("gguf") if gguf.is_none() => gguf = gguf_estimate(&file),
            Some("safetensors") => {
                if let Some(bytes) = safetensors_bytes(&file) {
                    safetensors += bytes;
                    any_safetensors = true;
                }
            }
            _ => {}
        }
    }
    gguf.or_else(|| {
        any_safetensors.then_some(Estimate {
            bytes: safetensors,
            from: "safetensors",
        })
    })
}

/// `path` opened if it is a regular file, without blocking: a FIFO or a
/// device planted in a model's folder is no estimate, never a wait (the
/// load then refuses it, naming it).
fn open(path: &Path) -> Option<std::fs::File> {
    crate::input::open_regular(path, u64::MAX, "the weights")
        .ok()
        .map(|(file, _)| file)
}

fn of_file(path: &Path) -> Option<Estimate> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("gguf") => gguf_estimate(path),
        Some("safetensors") => Some(Estimate {
            bytes: safetensors_bytes(path)?,
            from: "safetensors",
        }),
        _ => None,
    }
}

/// A safetensors file's tensors' bytes, from its header.
fn safetensors_bytes(path: &Path) -> Option<u64> {
    let mut file = open(path)?;
    let size = file.metadata().ok()?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len).ok()?;
    let len = u64::from_le_bytes(len);
    // A length past the file is a lie: nothing is allocated for it.
    if len > HEADER_MAX || len > size.saturating_sub(8) {
        return None;
    }
    let mut header = Vec::new();
    file.take(len).read_to_end(&mut header).ok()?;
    if header.len() as u64 != len {
        return None;
    }
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).ok()?;
    let mut total = 0u64;
    for (name, tensor) in &header {
        if name == "__metadata__" {
            continue;
        }
        let offsets = tensor.get("data_offsets")?.as_array()?;
        let (start, end) = (offsets.first()?.as_u64()?, offsets.get(1)?.as_u64()?);
        total = total.checked_add(end.checked_sub(start)?)?;
    }
    Some(total)
}

/// A GGUF model: its tensors (the file past its header) and the K and V
/// cache of its context (f16), from its metadata.
fn gguf_estimate(path: &Path) -> Option<Estimate> {
    let file = open(path)?;
    let size = file.metadata().ok()?.len();
    let mut reader = BufReader::new(file).take(HEADER_MAX);
    let header = read_gguf_header(&mut reader)?;
    let consumed = reader.get_mut().stream_position().ok()?;
    let tensors = size.saturating_sub(consumed);
    let arch = header.string("general.architecture")?;
    let key = |k: &str| header.number(&format!("{arch}.{k}"));
    let cache = match (
        key("block_count"),
        key("embedding_length"),
        key("attention.head_count"),
    ) {
        (Some(layers), Some(embedding), Some(heads)) if heads > 0 => {
            let kv_heads = key("attention.head_count_kv").unwrap_or(heads);
            let context = key("context_length").unwrap_or(4096).min(CONTEXT_COUNTED);
            // K and V, per layer, per token: the KV heads' share of the
            // embedding, 2 bytes an element.
            2 * layers * context * (embedding / heads) * kv_heads * 2
        }
        _ => 0,
    };
    Some(Estimate {
        bytes: tensors + cache,
        from: "gguf",
    })
}

/// The scalar and string values of a GGUF header's metadata.
#[derive(Debug, Default)]
struct GgufHeader {
    numbers: std::collections::HashMap<String, u64>,
    strings: std::collections::HashMap<String, String>,
}

impl GgufHeader {
    fn number(&self, key: &str) -> Option<u64> {
        self.numbers.get(key).copied()
    }

    fn string(&self, key: &str) -> Option<&str> {
        self.strings.get(key).map(String::as_str)
    }
}

/// Reads a GGUF header (v2 or v3): its metadata, then its tensor infos
/// (skipped), leaving `reader` at the end of them.
fn read_gguf_header(reader: &mut impl Read) -> Option<GgufHeader> {
    if read_u32(reader)? != 0x4655_4747 {
        return None;
    }
    let version = read_u32(reader)?;
    if !(2..=3).contains(&version) {
        return None;
    }
    let tensors = read_u64(reader)?;
    let entries = read_u64(reader)?;
    if tensors > 1 << 20 || entries > 1 << 20 {
        return None;
    }
    let mut header = GgufHeader::default();
    for _ in 0..entries {
        let key = read_string(reader)?;
        let kind = read_u32(reader)?;
        match kind {
            8 => {
                let value = read_string(reader)?;
                header.strings.insert(key, value);
            }
            9 => {
                let inner = read_u32(reader)?;
                let count = read_u64(reader)?;
                for _ in 0..count {
                    skip_value(reader, inner)?;
                }
            }
            _ => {
                if let Some(n) = read_number(reader, kind)? {
                    header.numbers.insert(key, n);
                }
            }
        }
    }
    for _ in 0..tensors {
        let _name = read_string(reader)?;
        let dims = read_u32(reader)?;
        if dims > 8 {
            return None;
        }
        for _ in 0..dims {
            read_u64(reader)?;
        }
        read_u32(reader)?;
        read_u64(reader)?;
    }
    Some(header)
}

fn read_u32(r: &mut impl Read) -> Option<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b).ok()?;
    Some(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> Option<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b).ok()?;
    Some(u64::from_le_bytes(b))
}

fn read_string(r: &mut impl Read) -> Option<String> {
    let len = read_u64(r)?;
    if len > 1 << 20 {
        return None;
    }
    let mut bytes = vec![0u8; len as usize];
    r.read_exact(&mut bytes).ok()?;
    String::from_utf8(bytes).ok()
}

/// A scalar of GGUF type `kind`, as a whole number where it is one
/// (`Some(None)`: a float or a bool, read and set aside).
fn read_number(r: &mut impl Read, kind: u32) -> Option<Option<u64>> {
    let width = scalar_width(kind)?;
    let mut b = [0u8; 8];
    r.read_exact(&mut b[..width]).ok()?;
    let raw = u64::from_le_bytes(b);
    Some(match kind {
        0 | 2 | 4 | 10 => Some(raw),
        // Signed: only what is not negative is a count.
        1 => (raw as u8 as i8 >= 0).then_some(raw & 0xff),
        3 => (raw as u16 as i16 >= 0).then_some(raw & 0xffff),
        5 => (raw as u32 as i32 >= 0).then_some(raw & 0xffff_ffff),
        11 => (raw as i64 >= 0).then_some(raw),
        _ => None,
    })
}

/// The width of a GGUF scalar type in bytes.
fn scalar_width(kind: u32) -> Option<usize> {
    Some(match kind {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        _ => return None,
    })
}

fn skip_value(r: &mut impl Read, kind: u32) -> Option<()> {
    match kind {
        8 => {
            read_string(r)?;
        }
        9 => {
            let inner = read_u32(r)?;
            let count = read_u64(r)?;
            for _ in 0..count {
                skip_value(r, inner)?;
            }
        }
        _ => {
            let width = scalar_width(kind)?;
            let mut b = [0u8; 8];
            r.read_exact(&mut b[..width]).ok()?;
        }
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    /// A FIFO (or a link to a device) where the weights should be is no
    /// estimate, at once: planning a load never waits on a file.
    #[test]
    fn a_fifo_in_place_of_the_weights_is_passed_over_at_once() {
        let dir = std::env::temp_dir().join(format!("berth-estimate-fifo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["model.safetensors", "model.gguf"] {
            let path = std::ffi::CString::new(dir.join(name).to_str().unwrap()).unwrap();
            // SAFETY: mkfifo reads the path, valid for the call.
            assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        }
        let started = std::time::Instant::now();
        assert!(from_files(&dir).is_none());
        assert!(from_files(&dir.join("model.gguf")).is_none());
        assert!(from_files(Path::new("/dev/zero")).is_none());
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A GGUF file of one tensor and a Llama's metadata: its estimate is
    /// its tensors' bytes plus the cache of its context.
    #[test]
    fn a_gguf_model_is_its_tensors_and_its_contexts_cache() {
        let mut out = Vec::new();
        out.extend(0x4655_4747u32.to_le_bytes());
        out.extend(3u32.to_le_bytes());
        out.extend(1u64.to_le_bytes());
        let numbers = [
            ("llama.block_count", 2u32),
            ("llama.embedding_length", 64),
            ("llama.attention.head_count", 8),
            ("llama.attention.head_count_kv", 2),
            ("llama.context_length", 1024),
        ];
        out.extend((numbers.len() as u64 + 2).to_le_bytes());
        string(&mut out, "general.architecture");
        out.extend(8u32.to_le_bytes());
        string(&mut out, "llama");
        // An array (the vocabulary's shape), skipped.
        string(&mut out, "tokenizer.ggml.tokens");
        out.extend(9u32.to_le_bytes());
        out.extend(8u32.to_le_bytes());
        out.extend(2u64.to_le_bytes());
        string(&mut out, "a");
        string(&mut out, "b");
        for (key, value) in numbers {
            string(&mut out, key);
            out.extend(4u32.to_le_bytes());
            out.extend(value.to_le_bytes());
        }
        string(&mut out, "w");
        out.extend(1u32.to_le_bytes());
        out.extend(16u64.to_le_bytes());
        out.extend(0u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        let header = out.len() as u64;
        out.extend(vec![0u8; 1000]);
        let dir = std::env::temp_dir().join(format!("berth-estimate-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        std::fs::write(&path, &out).unwrap();
        let estimate = from_files(&path).unwrap();
        let cache = 2 * 2 * 1024 * (64 / 8) * 2 * 2;
        assert_eq!(
            estimate,
            Estimate {
                bytes: (out.len() as u64 - header) + cache,
                from: "gguf"
            }
        );
        // Not a GGUF file: nothing.
        std::fs::write(&path, b"not gguf").unwrap();
        assert_eq!(from_files(&path), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_safetensors_folder_is_its_headers_tensors() {
        let dir = std::env::temp_dir().join(format!("berth-estimate-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, size) in [("a.safetensors", 400u64), ("b.safetensors", 600)] {
            let header = format!(
                r#"{{"__metadata__":{{"format":"pt"}},"t":{{"dtype":"F32","shape":[{}],"data_offsets":[0,{size}]}}}}"#,
                size / 4
            );
            let mut out = (header.len() as u64).to_le_bytes().to_vec();
            out.extend(header.as_bytes());
            out.extend(vec![0u8; size as usize]);
            std::fs::write(dir.join(name), out).unwrap();
        }
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        assert_eq!(
            from_files(&dir),
            Some(Estimate {
                bytes: 1000,
                from: "safetensors"
            })
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
