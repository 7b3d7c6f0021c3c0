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

mod merge;
mod model;
mod peers;
mod routing;
#[cfg(test)]
mod tests;
mod text;

use crate::config::{ModelSpec, Residency, WorkerKind};
use crate::server::llama_swap::layer::{Compat, Extras};
use crate::server::llama_swap::peers::Peers;
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
    "peers",
    "upstream",
];

/// Reads a llama-swap `config.yaml` from its text. `env` looks up the
/// variables `${env.VAR}` names.
pub fn migrate(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Migrated, String> {
    let Value::Mapping(root) = parse(text, env)? else {
        return Err("the file is not a mapping of keys".into());
    };
    migrate_root(root)
}

/// Reads several llama-swap files as one, merged as llama-swap merges its
/// `-config` and `-config-dir` files (`merge.rs`); each `(label, text)`.
pub fn migrate_all(
    files: &[(String, String)],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Migrated, String> {
    if let [(_, text)] = files {
        return migrate(text, env);
    }
    let parsed = files
        .iter()
        .map(|(label, text)| {
            Ok((
                label.clone(),
                parse(text, env).map_err(|e| format!("{label}: {e}"))?,
            ))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let Value::Mapping(root) = merge::merge(parsed)? else {
        return Err("the files are not mappings of keys".into());
    };
    migrate_root(root)
}

/// One file's text, its size and nesting checked, its `<<` merge keys and
/// `${env.VAR}` applied.
fn parse(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Value, String> {
    text::check_shape(text)?;
    let mut root: Value =
        yaml_serde::from_str(text).map_err(|e| format!("not a YAML file: {e}"))?;
    root.apply_merge()
        .map_err(|e| format!("cannot apply its `<<` merge keys: {e}"))?;
    text::expand_env(&root, env)
}

fn migrate_root(root: yaml_serde::Mapping) -> Result<Migrated, String> {
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
        // An alias (or a `setParamsByID` key) two models claim: llama-swap
        // refuses the file, and so does berth, in its words.
        for alias in &converted.spec.aliases {
            if let Some(first) = out
                .models
                .iter()
                .position(|m| m.name == *alias || m.aliases.contains(alias))
            {
                return Err(format!(
                    "duplicate alias {alias} found in model: {id} (model `{}` has it already; \
                     llama-swap refuses this file too: give each model its own aliases and \
                     `setParamsByID` keys)",
                    ids[first]
                ));
            }
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
    let taken = |fqn: &str| {
        let name = names.get(fqn)?;
        Some(if extras.get(name).is_some_and(|e| e.listing.id == fqn) {
            format!("model ID {fqn:?}")
        } else {
            format!("model {name} alias {fqn:?}")
        })
    };
    let peers = Peers::new(peers::peers(&root, &global_macros, &taken, &mut out.notes)?);
    let selectors = routing::selectors(
        &root,
        &names,
        &|t| peers.resolve(t).is_some(),
        &mut out.notes,
    )?;
    let profiles = routing::profiles(
        &root,
        &|t| names.contains_key(t) || selectors.contains_key(t) || peers.resolve(t).is_some(),
        &mut out.notes,
    )?;
    for (fqn, _) in peers
        .qualified()
        .map(|(p, m)| (format!("{}/{m}", p.id), ()))
    {
        if selectors.contains_key(&fqn) {
            return Err(format!(
                "selector ID {fqn:?} conflicts with fully qualified peer model name {fqn:?}"
            ));
        }
        for (name, profile) in &profiles {
            if profile.pins.contains_key(&fqn) {
                return Err(format!(
                    "profile {name} pin {fqn:?} conflicts with fully qualified peer model name \
                     {fqn:?}"
                ));
            }
        }
    }
    out.preload = routing::preload(&root, &names, &mut out.notes);
    out.api_keys = routing::api_keys(&root)?;
    let include_aliases = root
        .get("includeAliasesInList")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    out.compat = Compat::new(extras, profiles, selectors, include_aliases);
    out.compat.peers = peers;
    out.compat.ignore_paths = ignore_paths(&root, &mut out.notes)?;
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

/// llama-swap's `upstream.ignorePaths` default: a browser's and a UI's
/// assets, which never load a model.
const IGNORE_PATHS: &str = r".*\.(js|json|css|png|gif|jpg|jpeg|ico|txt)$";

/// `upstream.ignorePaths`: regular expressions (RE2's syntax, which the
/// `regex` crate shares) over a `/upstream` request's path past the model;
/// none given, llama-swap's default.
fn ignore_paths(
    root: &yaml_serde::Mapping,
    notes: &mut Vec<String>,
) -> Result<Vec<regex::Regex>, String> {
    let upstream = match root.get("upstream") {
        None | Some(Value::Null) => None,
        Some(Value::Mapping(m)) => Some(m),
        Some(_) => return Err("`upstream` is not a mapping".into()),
    };
    let mut patterns = Vec::new();
    if let Some(upstream) = upstream {
        for key in upstream.keys().filter_map(Value::as_str) {
            if key != "ignorePaths" {
                notes.push(format!(
                    "unknown key `upstream.{key}` ignored (llama-swap ignores it too)"
                ));
            }
        }
        match upstream.get("ignorePaths") {
            None | Some(Value::Null) => {}
            Some(Value::Sequence(list)) => {
                for p in list {
                    let Some(p) = p.as_str() else {
                        return Err("`upstream.ignorePaths` holds something that is not a regular expression".into());
                    };
                    patterns.push(p.to_string());
                }
            }
            Some(_) => {
                return Err("`upstream.ignorePaths` is not a list of regular expressions".into());
            }
        }
    }
    if patterns.is_empty() {
        patterns.push(IGNORE_PATHS.to_string());
    }
    patterns
        .iter()
        .map(|p| {
            regex::RegexBuilder::new(p)
                .size_limit(1 << 20)
                .build()
                .map_err(|e| format!("upstream.ignorePaths: invalid regular expression {p:?}: {e}"))
        })
        .collect()
}
