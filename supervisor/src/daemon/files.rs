//! The daemon's files, read and checked the same way at start, at each
//! reload and for an upgrade's check: the config (the default models
//! without one, fetched by package name where missing), with a llama-swap
//! file's models and kinds merged in, and that file's API layer.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use super::Options;
use super::config::ServeConfig;
use super::llama_swap::{self, Migrated};
use crate::config::ModelSpec;
use crate::fetch::{DEFAULT_MODELS, fetch};
use crate::input::{CONFIG_MAX, Stamp, quote_lines, read_text};
use crate::server::{Listen, ServeOptions};

/// The files' texts, each read once (bounded, regular files only:
/// `crate::input`), so that what is checked is what is applied, and what
/// an in-place upgrade hands over is what was applied.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Texts {
    pub config: Option<(PathBuf, String)>,
    pub llama_swap: Option<(PathBuf, String)>,
    /// `--llama-swap-dir`'s files, in the order they merge.
    #[serde(default)]
    pub llama_swap_dir: Vec<(PathBuf, String)>,
}

impl Texts {
    /// The files `options` names, read now.
    pub(crate) fn read(options: &Options) -> Result<Texts, String> {
        // Read, then looked at again: a file that changed meanwhile (a save
        // in progress) is not applied half-read.
        let read = |path: &PathBuf, what: &str| -> Result<(PathBuf, String), String> {
            let before = Stamp::of(path);
            let text = read_text(path, CONFIG_MAX, what)?;
            if Stamp::of(path) != before {
                return Err(format!(
                    "{what} `{}` changed while it was read (a save in progress?); nothing \
                     changed: it is read again at its next change or reload",
                    path.display()
                ));
            }
            Ok((path.clone(), text))
        };
        Ok(Texts {
            config: options
                .config
                .as_ref()
                .map(|p| read(p, "the config"))
                .transpose()?,
            llama_swap: options
                .llama_swap
                .as_ref()
                .map(|p| read(p, "the llama-swap config"))
                .transpose()?,
            llama_swap_dir: match &options.llama_swap_dir {
                Some(dir) => dir_files(dir, options.llama_swap.as_deref())?
                    .iter()
                    .map(|p| read(p, "the llama-swap config"))
                    .collect::<Result<_, _>>()?,
                None => Vec::new(),
            },
        })
    }

    /// The llama-swap files, in the order they merge: `--llama-swap`'s,
    /// then `--llama-swap-dir`'s.
    fn llama_swap_files(&self) -> Vec<(PathBuf, String)> {
        self.llama_swap
            .iter()
            .chain(&self.llama_swap_dir)
            .cloned()
            .collect()
    }
}

/// The most files `--llama-swap-dir` reads: a folder of configs has a
/// handful; thousands are not configs, and each is held whole while read.
const MAX_DIR_FILES: usize = 256;

/// The `.yml` and `.yaml` files of `dir` (not its folders'), sorted by
/// name, as llama-swap's `-config-dir` reads them; `file` (the
/// `--llama-swap` file) must not be one of them.
pub(super) fn dir_files(dir: &Path, file: Option<&Path>) -> Result<Vec<PathBuf>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        format!(
            "cannot read the llama-swap config folder `{}`: {e}",
            dir.display()
        )
    })?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot read `{}`: {e}", dir.display()))?;
        let path = entry.path();
        let yaml = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e == "yml" || e == "yaml");
        if yaml && std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            files.push(path);
        }
    }
    files.sort();
    if files.len() > MAX_DIR_FILES {
        return Err(format!(
            "--llama-swap-dir `{}` has {} .yml/.yaml files; berth reads at most {MAX_DIR_FILES} \
             (each up to 8 MiB): merge some, or point at the folder of the config's own files",
            dir.display(),
            files.len()
        ));
    }
    if let Some(file) = file {
        let same = |p: &PathBuf| match (p.canonicalize(), file.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        if files.iter().any(same) {
            return Err(format!(
                "--llama-swap `{}` is also in --llama-swap-dir `{}`; remove it from one",
                file.display(),
                dir.display()
            ));
        }
    }
    if files.is_empty() && file.is_none() {
        return Err(format!(
            "--llama-swap-dir `{}` has no .yml or .yaml file: no configuration sources found",
            dir.display()
        ));
    }
    Ok(files)
}

/// The config files read and checked, as at start and at each reload: the
/// config (the defaults without one), with a llama-swap file's models and
/// kinds merged in, and that file's API layer.
pub(super) fn read_files(options: &Options) -> Result<(ServeConfig, Option<Migrated>), String> {
    parse_files(&Texts::read(options)?)
}

/// [`read_files`] on texts read already.
pub(super) fn parse_files(texts: &Texts) -> Result<(ServeConfig, Option<Migrated>), String> {
    let mut config = match &texts.config {
        Some((path, text)) => {
            let config = ServeConfig::parse(text, path)?;
            fetch_named_defaults(&config.models, &config.models_root())?;
            config
                .check()
                .map_err(|e| format!("`{}`: {}", path.display(), quote_lines(&e)))?;
            config
        }
        None => ServeConfig::default(),
    };
    let files = texts.llama_swap_files();
    let llama_swap = match files.is_empty() {
        false => Some(add_llama_swap(&mut config, &files)?),
        true => None,
    };
    Ok((config, llama_swap))
}

/// The token: the command line's (or `BERTH_TOKEN`) over the config's.
pub(super) fn token_of(options: &Options, config: &ServeConfig) -> Result<Option<String>, String> {
    match options.token.clone().or(config.token.clone()) {
        Some(t) if t.trim().is_empty() => {
            Err("the token is blank; give a real token or none".into())
        }
        token => Ok(token),
    }
}

/// The front door's options from a config: its limits and tokens, and a
/// llama-swap file's keys and API layer.
pub(super) fn front_door(
    config: &ServeConfig,
    listen: Listen,
    token: Option<String>,
    llama_swap: Option<&mut Migrated>,
) -> ServeOptions {
    let mut options = config.serve_options(listen, token);
    if let Some(migrated) = llama_swap {
        options.api_keys = std::mem::take(&mut migrated.api_keys);
        options.llama_swap = Some(std::sync::Arc::new(std::mem::take(&mut migrated.compat)));
    }
    options
}

/// Fetches the default models whose folders the config's models name
/// (`model = "all-MiniLM-L6-v2"`) and that are missing, as a plain
/// `berth serve` does.
fn fetch_named_defaults(models: &[ModelSpec], dir: &Path) -> Result<(), String> {
    for model in DEFAULT_MODELS {
        let folder = dir.join(model.folder);
        let Some(spec) = models
            .iter()
            .find(|s| s.model.as_ref().is_some_and(|p| p.starts_with(&folder)))
        else {
            continue;
        };
        // Checked (every file's digest) once per default model, however
        // many specs name it.
        if !model.is_present(dir) {
            fetch(model, dir, &mut |line: &str| eprintln!("berth: {line}")).map_err(|e| {
                format!(
                    "model `{}`: cannot fetch default model `{}` into `{}`: {e}",
                    spec.name,
                    model.name,
                    dir.display()
                )
            })?;
        }
    }
    Ok(())
}

/// The default models, fetched first where missing.
pub(super) fn default_catalogue(dir: &Path) -> Result<Vec<ModelSpec>, String> {
    let terminal = std::io::stderr().is_terminal();
    let mut specs = Vec::new();
    for model in DEFAULT_MODELS {
        let mut say = |line: &str| {
            if terminal || !model.is_present(dir) {
                eprintln!("berth: {line}");
            }
        };
        let path = fetch(model, dir, &mut say)
            .map_err(|e| format!("cannot fetch default model `{}`: {e}", model.name))?;
        let mut spec = ModelSpec::new(model.name, model.backend).model(path);
        // A cap, so no request (thousands of texts, a runaway context) can
        // take the host's memory: several times each model's measured peak.
        spec.memory_limit = Some(model.memory_limit);
        specs.push(spec);
    }
    Ok(specs)
}

/// Adds the models and rules of a llama-swap `config.yaml` to `config`,
/// saying what of it berth does not honour; returns the rest of it.
fn add_llama_swap(
    config: &mut ServeConfig,
    files: &[(PathBuf, String)],
) -> Result<Migrated, String> {
    let named: Vec<(String, String)> = files
        .iter()
        .map(|(p, t)| (p.display().to_string(), t.clone()))
        .collect();
    let shown = named
        .iter()
        .map(|(p, _)| format!("`{p}`"))
        .collect::<Vec<_>>()
        .join(" + ");
    let mut migrated =
        llama_swap::migrate_all(&named, &|name| std::env::var(name).ok()).map_err(|e| {
            format!(
                "{shown} is not a llama-swap config berth can read: {}",
                quote_lines(&e)
            )
        })?;
    let path = match files {
        [(path, _)] => path.display().to_string(),
        _ => shown.clone(),
    };
    for note in &migrated.notes {
        eprintln!("berth: llama-swap config {path}: {note}");
    }
    for (name, kind) in std::mem::take(&mut migrated.workers) {
        if config.workers.contains_key(&name) {
            return Err(format!(
                "worker kind `{name}` is declared in the config and made from {}; rename one",
                shown
            ));
        }
        config.workers.insert(name, kind);
    }
    for model in std::mem::take(&mut migrated.models) {
        if config.models.iter().any(|m| m.name == model.name) {
            return Err(format!(
                "model `{}` is in the config and in {}; rename one",
                model.name, shown
            ));
        }
        config.models.push(model);
    }
    let residency = std::mem::take(&mut migrated.residency);
    if !residency.groups.is_empty() && (!config.groups.is_empty() || config.matrix.is_some())
        || residency.matrix.is_some() && (!config.groups.is_empty() || config.matrix.is_some())
    {
        return Err(format!(
            "the config has `groups` or a `matrix`, and so does {}; keep one",
            shown
        ));
    }
    config.groups.extend(residency.groups);
    if residency.matrix.is_some() {
        config.matrix = residency.matrix;
    }
    config.check().map_err(|e| format!("{shown}: {e}"))?;
    Ok(migrated)
}
