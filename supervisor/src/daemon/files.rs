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
        })
    }
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
    let llama_swap = match &texts.llama_swap {
        Some((path, text)) => Some(add_llama_swap(&mut config, path, text)?),
        None => None,
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
fn add_llama_swap(config: &mut ServeConfig, path: &Path, text: &str) -> Result<Migrated, String> {
    let mut migrated =
        llama_swap::migrate(text, &|name| std::env::var(name).ok()).map_err(|e| {
            format!(
                "`{}` is not a llama-swap config berth can read: {}",
                path.display(),
                quote_lines(&e)
            )
        })?;
    for note in &migrated.notes {
        eprintln!("berth: llama-swap config {}: {note}", path.display());
    }
    for (name, kind) in std::mem::take(&mut migrated.workers) {
        if config.workers.contains_key(&name) {
            return Err(format!(
                "worker kind `{name}` is declared in the config and made from `{}`; rename one",
                path.display()
            ));
        }
        config.workers.insert(name, kind);
    }
    for model in std::mem::take(&mut migrated.models) {
        if config.models.iter().any(|m| m.name == model.name) {
            return Err(format!(
                "model `{}` is in the config and in `{}`; rename one",
                model.name,
                path.display()
            ));
        }
        config.models.push(model);
    }
    let residency = std::mem::take(&mut migrated.residency);
    if !residency.groups.is_empty() && (!config.groups.is_empty() || config.matrix.is_some())
        || residency.matrix.is_some() && (!config.groups.is_empty() || config.matrix.is_some())
    {
        return Err(format!(
            "the config has `groups` or a `matrix`, and so does `{}`; keep one",
            path.display()
        ));
    }
    config.groups.extend(residency.groups);
    if residency.matrix.is_some() {
        config.matrix = residency.matrix;
    }
    config
        .check()
        .map_err(|e| format!("`{}`: {e}", path.display()))?;
    Ok(migrated)
}
