//! The weights' bytes: the model file mapped or read, and the `quant=q8_0`
//! conversion with its cache next to the source file.

use std::io::{BufWriter, Cursor, Seek, Write};
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};

use super::gguf::{check_model, parse_gguf};
use crate::Progress;
use crate::backends::LoadMode;
use crate::backends::files::{FileError, ModelFile, open_file, open_in};

/// `general.file_type` for "mostly Q8_0" (llama.cpp's `LLAMA_FTYPE_MOSTLY_Q8_0`).
const FILE_TYPE_Q8_0: u32 = 7;

/// The file's bytes, mapped or read.
pub(super) enum Data {
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

pub(super) fn open_data(path: &Path, mode: LoadMode) -> Result<Data, String> {
    let shown = path.display();
    // A regular file only: a FIFO would hold the load for ever, a device
    // never ends, a symlink loop is not a model (`files.rs`).
    let model = open_file(path).map_err(|e| match e {
        FileError::Missing => format!("model file `{shown}` does not exist"),
        FileError::NotRegular("a directory") => {
            format!("`{shown}` is a directory; the generate backend needs a GGUF file")
        }
        e => format!("model file `{shown}` {e}"),
    })?;
    data_of(model, path, mode)
}

/// The bytes of a model file already open, mapped or read.
pub(super) fn data_of(mut model: ModelFile, path: &Path, mode: LoadMode) -> Result<Data, String> {
    let shown = path.display();
    let read_err = |e: std::io::Error| format!("cannot read model file `{shown}`: {e}");
    let len = model.file.metadata().map_err(read_err)?.len();
    match mode {
        // An empty file cannot be mapped; it fails the GGUF check instead.
        LoadMode::Mmap if len > 0 => {
            // SAFETY: the map is read-only and lives only while the model is
            // built (candle copies every tensor out of it). A file truncated
            // meanwhile kills this worker with SIGBUS, which the supervisor
            // reports like any crash; it cannot corrupt another process.
            let map = unsafe { memmap2::Mmap::map(&model.file) }.map_err(read_err)?;
            Ok(Data::Mapped(map))
        }
        _ => model.read_bytes().map(Data::Owned).map_err(read_err),
    }
}

/// Where the Q8_0 copy of `src` is cached.
fn q8_0_cache_path(src: &Path) -> PathBuf {
    let stem = src
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    src.with_file_name(format!("{stem}.Q8_0.gguf"))
}

/// The cached copy `cache`, opened beneath the source's folder (a symlink
/// planted there cannot lead elsewhere) and only when it is a regular file
/// no older than `src`.
fn fresh_cache(cache: &Path, src: &Path) -> Option<ModelFile> {
    let name = cache.file_name()?.to_str()?;
    let dir = match cache.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let file = open_in(dir, name).ok()?;
    let cached = file.file.metadata().ok()?.modified().ok()?;
    let source = std::fs::metadata(src).ok()?.modified().ok()?;
    (cached >= source).then_some(file)
}

/// The weights' source after the `quant` option: a file by its path, the
/// cached copy already open, or (when the Q8_0 copy could not be written
/// next to the source) converted bytes.
pub(super) enum Source {
    File(PathBuf),
    Cached(ModelFile, PathBuf),
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
pub(super) fn q8_0_source(
    src: &Path,
    mode: LoadMode,
    progress: &Progress,
) -> Result<Source, String> {
    let cache = q8_0_cache_path(src);
    if let Some(file) = fresh_cache(&cache, src) {
        return Ok(Source::Cached(file, cache));
    }
    let shown = src.display().to_string();
    let data = open_data(src, mode)?;
    let content = parse_gguf(&data, &shown, progress)?;
    check_model(&content, data.len() as u64, &shown)?;
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
        // A new file only: a name planted there (a symlink) is not followed.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| e.to_string())?;
        let mut out = BufWriter::new(file);
        convert_to_q8_0(&content, &data, &mut out, progress)?;
        let file = out.into_inner().map_err(|e| e.to_string())?;
        file.sync_all().map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, &cache).map_err(|e| e.to_string())
    })();
    let cached = written.and_then(|()| {
        fresh_cache(&cache, src).ok_or_else(|| "it was not there once written".to_string())
    });
    match cached {
        Ok(file) => Ok(Source::Cached(file, cache)),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_q8_0_cache_sits_next_to_the_source() {
        assert_eq!(
            q8_0_cache_path(Path::new("/m/SmolLM2.Q4_1.gguf")),
            Path::new("/m/SmolLM2.Q4_1.Q8_0.gguf")
        );
    }
}
