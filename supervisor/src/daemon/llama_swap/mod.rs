//! Migration from llama-swap: its `config.yaml`, read as berth models and
//! rules, so `berth serve --llama-swap config.yaml` serves what llama-swap
//! did, with berth's guarantees, and answers llama-swap's API (`server/llama_swap/api.rs`).
//!
//! Each model becomes a worker kind of its own, `llama-swap-NAME` (its
//! `cmd` as the command, its `env`, an `http` table), and a model naming
//! it; `routing` (or the legacy `groups`/`matrix`) becomes berth's
//! residency rules (`config/residency.rs`); `profiles`, `selectors`,
//! `filters` and the listing keys become the front door's llama-swap layer
//! (`server/llama_swap/layer.rs`); `apiKeys` are accepted as tokens; `hooks.on_startup
//! .preload` loads at start. Every key of the file is either honoured or
//! named in the notes [`migrate`] returns, which `berth serve` prints:
//! docs/llama-swap.md has the whole table.

use std::collections::BTreeMap;

use yaml_serde::Value;

mod model;
mod routing;
#[cfg(test)]
mod tests;
mod text;

use crate::config::{ModelSpec, Residency, WorkerKind};
use crate::server::llama_swap::layer::{Compat, Extras};
use model::{Defaults, berth_name, one_model};

/// What a llama-swap config becomes.
#[derive(Debug, Default)]
pub struct Migrated {
    pub workers: BTreeMap<String, WorkerKind>,
    pub models: Vec<ModelSpec>,
    /// Which models may run together.
    pub residency: Residency,
    /// Accepted as tokens, besides berth's own.
    pub api_keys: Vec<String>,
    /// Loaded at start, in order.
    pub preload: Vec<String>,
    /// The front door's llama-swap layer.
    pub compat: Compat,
    /// What was not honoured, or changed, a sentence each.
    pub notes: Vec<String>,
}

/// Top-level keys llama-swap reads that berth does not honour, and why.
const NOT_HONOURED: &[(&str, &str)] = &[
    (
        "startPort",
        "berth chooses a free loopback port for each start of a `${PORT}` server (so a \
         swap's new server starts beside the old)",
    ),
    (
        "logLevel",
        "berth's log level is BERTH_LOG (`BERTH_LOG=debug`); its log and the servers' output \
         are at /logs",
    ),
    (
        "logToStdout",
        "berth writes its log and the servers' output (each line marked with its model) to \
         stderr; /logs and /logs/stream serve both",
    ),
    ("logTimeFormat", "berth's log lines carry RFC 3339 times"),
    ("logRequests", "llama-swap does not use it either"),
    (
        "metricsMaxInMemory",
        "berth's request counters and memory are at /metrics and /api/history",
    ),
    (
        "captureBuffer",
        "berth keeps no copies of requests or answers",
    ),
    ("store", "berth keeps no copies of requests or answers"),
    ("ui", "berth's console is at /"),
    (
        "performance",
        "berth samples memory every second (/api/history) and the GPUs at /api/gpus",
    ),
    (
        "upstream",
        "`ignorePaths`: a /upstream request loads its model whatever its path",
    ),
    (
        "peers",
        "berth serves the models on this machine only; no peer's model is served or listed",
    ),
];

/// Top-level keys berth honours.
const HONOURED: &[&str] = &[
    "healthCheckTimeout",
    "globalTTL",
    "unloadTimeout",
    "macros",
    "models",
    "routing",
    "groups",
    "matrix",
    "profiles",
    "selectors",
    "hooks",
    "apiKeys",
    "sendLoadingState",
    "includeAliasesInList",
];

/// Reads a llama-swap `config.yaml` from its text. `env` looks up the
/// variables `${env.VAR}` names.
pub fn migrate(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Migrated, String> {
    text::check_shape(text)?;
    let mut root: Value =
        yaml_serde::from_str(text).map_err(|e| format!("not a YAML file: {e}"))?;
    root.apply_merge()
        .map_err(|e| format!("cannot apply its `<<` merge keys: {e}"))?;
    let root = text::expand_env(&root, env)?;
    let Value::Mapping(root) = root else {
        return Err("the file is not a mapping of keys".into());
    };
    let mut out = Migrated::default();
    for key in root.keys() {
        let key = key.as_str().unwrap_or("?");
        if let Some((_, why)) = NOT_HONOURED.iter().find(|(k, _)| *k == key) {
            out.notes.push(format!("`{key}` not honoured: {why}"));
        } else if !HONOURED.contains(&key) {
            out.notes.push(format!(
                "unknown key `{key}` ignored (llama-swap ignores it too)"
            ));
        }
    }
    let global_macros = text::macros(root.get("macros"), "macros")?;
    let defaults = Defaults {
        ttl: root.get("globalTTL").and_then(Value::as_i64).unwrap_or(0),
        health_timeout: root
            .get("healthCheckTimeout")
            .and_then(Value::as_i64)
            .unwrap_or(120)
            .max(15),
        unload_timeout: root
            .get("unloadTimeout")
            .and_then(Value::as_i64)
            .filter(|t| *t > 0)
            .unwrap_or(10),
    };
    let loading_state = root
        .get("sendLoadingState")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let Some(Value::Mapping(models)) = root.get("models") else {
        return Err("no `models` mapping".into());
    };
    let mut extras = BTreeMap::new();
    let mut ids = Vec::new();
    // One rule for every model: one that cannot be served is left out,
    // saying why, and the rest are served.
    for (id, model) in models {
        let id = match id {
            Value::String(id) => id.clone(),
            other => {
                out.notes.push(format!(
                    "a model whose ID is not a string ({}) left out",
                    yaml_serde::to_string(other).unwrap_or_default().trim()
                ));
                continue;
            }
        };
        let name = berth_name(&id);
        let converted = model_of(&id, model, &global_macros)
            .and_then(|(m, macros)| one_model(&id, &name, &m, &macros, &defaults, &mut out.notes));
        let converted = match converted {
            Ok(converted) => converted,
            Err(why) => {
                out.notes.push(format!("model `{id}` left out: {why}"));
                continue;
            }
        };
        if let Err(e) = converted.spec.validate() {
            out.notes.push(format!("model `{id}` left out: {e}"));
            continue;
        }
        if let Some(first) = out.models.iter().find(|m| m.name == name) {
            out.notes.push(format!(
                "model `{id}` left out: its berth name `{name}` is already model `{}`'s in this \
                 file (IDs differing only in characters a berth name cannot hold); rename one",
                first.aliases.last().unwrap_or(&first.name)
            ));
            continue;
        }
        if name != id {
            out.notes.push(format!(
                "model `{id}` is called `{name}` in berth (a berth name is letters, digits, `-`, \
                 `_`, `.`); its ID is kept as an alias"
            ));
        }
        out.workers.insert(
            converted.spec.worker.clone().expect("named"),
            converted.kind,
        );
        extras.insert(
            name.clone(),
            Extras {
                listing: converted.listing,
                filters: converted.filters,
                loading_state: converted.loading_state.unwrap_or(loading_state),
            },
        );
        out.models.push(converted.spec);
        ids.push(id);
    }
    // Every name a request or a rule may use, to the berth name.
    let mut names = routing::Names::new();
    for spec in &out.models {
        names.insert(spec.name.clone(), spec.name.clone());
        for alias in &spec.aliases {
            names.insert(alias.clone(), spec.name.clone());
        }
    }
    for (name, extra) in &extras {
        names.insert(extra.listing.id.clone(), name.clone());
    }
    out.residency = routing::residency(&root, &names, &ids, &mut out.notes)?;
    for (name, priority) in routing::priorities(&root, &names, &mut out.notes)? {
        if let Some(spec) = out.models.iter_mut().find(|m| m.name == name) {
            spec.priority = priority;
        }
    }
    let selectors = routing::selectors(&root, &names, &mut out.notes)?;
    let profiles = routing::profiles(
        &root,
        &|t| names.contains_key(t) || selectors.contains_key(t),
        &mut out.notes,
    )?;
    out.preload = routing::preload(&root, &names, &mut out.notes);
    out.api_keys = routing::api_keys(&root)?;
    let include_aliases = root
        .get("includeAliasesInList")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    out.compat = Compat::new(extras, profiles, selectors, include_aliases);
    Ok(out)
}

/// Model `id`'s entry with its macros expanded, and the macros it was
/// expanded with (its `setParamsByID` keys are expanded with them too).
fn model_of(
    id: &str,
    model: &Value,
    global: &[(String, Value)],
) -> Result<(Value, Vec<(String, Value)>), String> {
    let Value::Mapping(model) = model else {
        return Err("it is not a mapping".into());
    };
    let all = model_macros(id, global, text::macros(model.get("macros"), "its macros")?);
    Ok((text::expand(&Value::Mapping(model.clone()), &all)?, all))
}

/// A model's macros as llama-swap merges them: `MODEL_ID`, then the
/// file's in their order, a model's macro of the same name taking the
/// file's place (so a file macro that uses it, declared after it, sees the
/// model's value), then the model's own others. Expanded last to first.
fn model_macros(
    id: &str,
    global: &[(String, Value)],
    own: Vec<(String, Value)>,
) -> Vec<(String, Value)> {
    let mut all = vec![("MODEL_ID".to_string(), Value::String(id.into()))];
    all.extend(global.iter().cloned());
    for (name, value) in own {
        match all.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => all.push((name, value)),
        }
    }
    all
}
