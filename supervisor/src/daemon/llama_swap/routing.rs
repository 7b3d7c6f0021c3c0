//! The keys of a llama-swap config that are about more than one model:
//! `routing` (groups, the matrix; and their legacy top-level forms),
//! `profiles`, `selectors`, `hooks` and `apiKeys`.

use std::collections::BTreeMap;

use yaml_serde::{Mapping, Value};

use crate::config::{Group, Matrix, NamedSet, Residency};
use crate::server::llama_swap::layer::{Profile, Selector, Strategy};

/// The group llama-swap puts every model in no group into: one at a time,
/// alone.
pub(super) const DEFAULT_GROUP: &str = "llama-swap-default";

/// Names as a request or the file may give them: a model's ID or alias, to
/// its berth name.
pub(super) type Names = BTreeMap<String, String>;

/// `routing.scheduler.settings.fifo.priority` (model ID → priority, default
/// 0): who goes first when models wait for room, by berth name. A model
/// that is not one of the file's is left out and said (llama-swap refuses
/// the file; its own example names models A to D that it does not have).
pub(super) fn priorities(
    root: &Mapping,
    names: &Names,
    notes: &mut Vec<String>,
) -> Result<BTreeMap<String, i32>, String> {
    let Some(priority) = root
        .get("routing")
        .and_then(|r| r.get("scheduler"))
        .and_then(|s| s.get("settings"))
        .and_then(|s| s.get("fifo"))
        .and_then(|f| f.get("priority"))
    else {
        return Ok(BTreeMap::new());
    };
    let Value::Mapping(priority) = priority else {
        return Err("routing.scheduler.settings.fifo.priority is not a mapping".into());
    };
    let mut out = BTreeMap::new();
    for (id, value) in priority {
        let id = id.as_str().unwrap_or_default();
        let Some(name) = names.get(id) else {
            notes.push(format!(
                "routing.scheduler.settings.fifo.priority references unknown model {id:?}: left \
                 out (llama-swap refuses the file)"
            ));
            continue;
        };
        let value = value
            .as_i64()
            .and_then(|v| i32::try_from(v).ok())
            .ok_or_else(|| {
                format!("routing.scheduler.settings.fifo.priority.{id} is not a whole number")
            })?;
        out.insert(name.clone(), value);
    }
    Ok(out)
}

/// `routing` (or the legacy `groups`/`matrix`) as berth's residency rules.
/// Members that are no model of the file are left out of their group (or
/// set), each said: llama-swap would refuse to start.
pub(super) fn residency(
    root: &Mapping,
    names: &Names,
    ids: &[String],
    notes: &mut Vec<String>,
) -> Result<Residency, String> {
    let legacy_groups = root.get("groups");
    let legacy_matrix = root.get("matrix");
    let router = root.get("routing").and_then(|r| r.get("router"));
    if (legacy_groups.is_some() || legacy_matrix.is_some()) && router.is_some() {
        return Err(
            "config uses both the legacy top-level 'matrix'/'groups' keys and the new \
             'routing.router' block; please migrate the top-level keys into 'routing.router' \
             and remove them"
                .into(),
        );
    }
    if legacy_groups.is_some() && legacy_matrix.is_some() {
        return Err("config cannot use both 'groups' and 'matrix'".into());
    }
    if let Some(scheduler) = root.get("routing").and_then(|r| r.get("scheduler")) {
        match scheduler
            .get("use")
            .and_then(Value::as_str)
            .unwrap_or("fifo")
        {
            "fifo" => {}
            other => {
                return Err(format!(
                    "routing.scheduler.use: unknown scheduler {other:?} (valid: fifo)"
                ));
            }
        }
    }
    let (use_, groups, matrix) = match router {
        Some(router) => {
            let settings = router.get("settings");
            (
                router
                    .get("use")
                    .and_then(Value::as_str)
                    .unwrap_or("group")
                    .to_string(),
                settings.and_then(|s| s.get("groups")),
                settings.and_then(|s| s.get("matrix")),
            )
        }
        None if legacy_matrix.is_some() => ("matrix".into(), None, legacy_matrix),
        None => ("group".into(), legacy_groups, None),
    };
    let member = |id: &str, what: &str, notes: &mut Vec<String>| -> Option<String> {
        let found = names.get(id).cloned();
        if found.is_none() {
            notes.push(format!(
                "{what} names `{id}`, which is no model of this file: left out of it"
            ));
        }
        found
    };
    match use_.as_str() {
        "" | "group" => {
            if matrix.is_some() {
                notes.push(
                    "`routing.router.settings.matrix` not used: `routing.router.use` is `group`"
                        .into(),
                );
            }
            let mut out = BTreeMap::new();
            if let Some(groups) = groups {
                let Value::Mapping(groups) = groups else {
                    return Err("`groups` is not a mapping".into());
                };
                for (name, group) in groups {
                    let name = name.as_str().ok_or("a group's name is not a string")?;
                    if let Value::Mapping(keys) = group {
                        for key in keys.keys() {
                            let key = key.as_str().unwrap_or("?");
                            if !["members", "swap", "exclusive", "persistent"].contains(&key) {
                                notes.push(format!(
                                    "group `{name}`: unknown key `{key}` ignored (llama-swap \
                                     ignores it too; a group has `members`, `swap`, \
                                     `exclusive`, `persistent`)"
                                ));
                            }
                        }
                    }
                    let flag = |key: &str, default: bool| {
                        group.get(key).and_then(Value::as_bool).unwrap_or(default)
                    };
                    let mut members = Vec::new();
                    for m in group
                        .get("members")
                        .and_then(Value::as_sequence)
                        .into_iter()
                        .flatten()
                    {
                        let id = m.as_str().ok_or("a group member is not a string")?;
                        if let Some(m) = member(id, &format!("group `{name}`"), notes)
                            && !members.contains(&m)
                        {
                            members.push(m);
                        }
                    }
                    out.insert(
                        name.to_string(),
                        Group {
                            members,
                            swap: flag("swap", true),
                            exclusive: flag("exclusive", true),
                            persistent: flag("persistent", false),
                        },
                    );
                }
            }
            let grouped: Vec<String> = out.values().flat_map(|g| g.members.clone()).collect();
            let alone: Vec<String> = ids
                .iter()
                .filter_map(|id| names.get(id))
                .filter(|m| !grouped.contains(m))
                .cloned()
                .collect();
            if !alone.is_empty() {
                notes.push(format!(
                    "models in no group ({}) run one at a time and alone, in llama-swap's \
                     default group (berth calls it `{DEFAULT_GROUP}`)",
                    alone.join(", ")
                ));
                out.insert(
                    DEFAULT_GROUP.into(),
                    Group {
                        members: alone,
                        swap: true,
                        exclusive: true,
                        persistent: false,
                    },
                );
            }
            Ok(Residency {
                groups: out,
                matrix: None,
            })
        }
        "matrix" => {
            let Some(Value::Mapping(m)) = matrix else {
                return Err(
                    "routing.router.use is 'matrix' but routing.router.settings.matrix is not set"
                        .into(),
                );
            };
            if groups.is_some() {
                notes.push(
                    "`routing.router.settings.groups` not used: `routing.router.use` is `matrix`"
                        .into(),
                );
            }
            let mut vars = BTreeMap::new();
            for (k, v) in m
                .get("vars")
                .and_then(Value::as_mapping)
                .into_iter()
                .flatten()
            {
                let (Some(k), Some(v)) = (k.as_str(), v.as_str()) else {
                    return Err("matrix: a var is not a string".into());
                };
                if let Some(model) = member(v, &format!("matrix var `{k}`"), notes) {
                    vars.insert(k.to_string(), model);
                }
            }
            let mut evict_costs = BTreeMap::new();
            for (k, v) in m
                .get("evict_costs")
                .and_then(Value::as_mapping)
                .into_iter()
                .flatten()
            {
                let k = k
                    .as_str()
                    .ok_or("matrix: an evict_costs key is not a string")?;
                let cost = v.as_u64().filter(|c| *c > 0).ok_or_else(|| {
                    format!("matrix: evict_cost for {k:?} must be a positive integer")
                })?;
                let key = if vars.contains_key(k) {
                    Some(k.to_string())
                } else {
                    member(k, "matrix evict_costs", notes)
                };
                if let Some(key) = key {
                    evict_costs.insert(key, cost);
                }
            }
            let mut sets = Vec::new();
            for (k, v) in m
                .get("sets")
                .and_then(Value::as_mapping)
                .into_iter()
                .flatten()
            {
                let (Some(name), Some(expr)) = (k.as_str(), v.as_str()) else {
                    return Err("matrix: a set is not `name: expression`".into());
                };
                sets.push(NamedSet {
                    name: name.into(),
                    expr: rename(expr, names, &vars),
                });
            }
            // A set naming what is no model is left out, saying so (and
            // with it any set that includes it).
            let known = |m: &str| names.values().any(|n| n == m);
            let mut kept: Vec<NamedSet> = Vec::new();
            for set in sets {
                let all = Matrix {
                    vars: vars.clone(),
                    sets: kept.iter().cloned().chain([set.clone()]).collect(),
                    evict_costs: BTreeMap::new(),
                };
                match (Residency {
                    groups: BTreeMap::new(),
                    matrix: Some(all),
                })
                .compile(&known)
                {
                    Ok(_) => kept.push(set),
                    Err(e) => notes.push(format!("matrix set `{}` left out: {e}", set.name)),
                }
            }
            if kept.is_empty() {
                notes.push("the matrix has no set berth can keep: models run without it".into());
                return Ok(Residency::default());
            }
            Ok(Residency {
                groups: BTreeMap::new(),
                matrix: Some(Matrix {
                    vars,
                    sets: kept,
                    evict_costs,
                }),
            })
        }
        other => Err(format!(
            "routing.router.use: unknown router {other:?} (valid: group, matrix)"
        )),
    }
}

/// A set expression with its model IDs as berth names (vars kept).
fn rename(expr: &str, names: &Names, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if !word.is_empty() {
            let w = std::mem::take(word);
            out.push_str(if vars.contains_key(&w) {
                &w
            } else {
                names.get(&w).unwrap_or(&w)
            });
        }
    };
    for c in expr.chars() {
        if c.is_alphanumeric() || "_-.".contains(c) {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// `profiles`: each a mapping of `description` and `pins`; llama-swap's
/// own error for the legacy list.
pub(super) fn profiles(
    root: &Mapping,
    valid_target: &dyn Fn(&str) -> bool,
    notes: &mut Vec<String>,
) -> Result<BTreeMap<String, Profile>, String> {
    let mut out = BTreeMap::new();
    let Some(profiles) = root.get("profiles") else {
        return Ok(out);
    };
    let Value::Mapping(profiles) = profiles else {
        return Err("`profiles` is not a mapping".into());
    };
    for (name, profile) in profiles {
        let name = name.as_str().unwrap_or_default();
        if name.is_empty() {
            return Err("profiles: profile names cannot be empty".into());
        }
        let Value::Mapping(profile) = profile else {
            notes.push(format!(
                "profile `{name}` refused: profile must be a mapping with description and pins; \
                 the legacy list syntax is no longer supported"
            ));
            continue;
        };
        let description = profile
            .get("description")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let Some(Value::Mapping(pins)) = profile.get("pins") else {
            return Err(format!(
                "profiles.{name}.pins must contain at least one entry"
            ));
        };
        if pins.is_empty() {
            return Err(format!(
                "profiles.{name}.pins must contain at least one entry"
            ));
        }
        let mut kept = BTreeMap::new();
        for (pin, target) in pins {
            let pin = pin.as_str().unwrap_or_default();
            if pin.is_empty() {
                return Err(format!("profiles.{name}.pins: pin names cannot be empty"));
            }
            let target = target.as_str().map(str::trim).filter(|t| !t.is_empty());
            if let Some(t) = target
                && !valid_target(t)
            {
                notes.push(format!(
                    "profiles.{name}.pins.{pin} references unknown model {t:?} (neither in \
                     this file nor a peer's): that pin left out"
                ));
                continue;
            }
            kept.insert(pin.to_string(), target.map(str::to_string));
        }
        out.insert(
            name.to_string(),
            Profile {
                description: description.into(),
                pins: kept,
            },
        );
    }
    Ok(out)
}

/// `selectors`, checked as llama-swap checks them.
pub(super) fn selectors(
    root: &Mapping,
    names: &Names,
    peer: &dyn Fn(&str) -> bool,
    notes: &mut Vec<String>,
) -> Result<BTreeMap<String, Selector>, String> {
    let mut out = BTreeMap::new();
    let Some(selectors) = root.get("selectors") else {
        return Ok(out);
    };
    let Value::Mapping(selectors) = selectors else {
        return Err("`selectors` is not a mapping".into());
    };
    for (id, s) in selectors {
        let id = id.as_str().unwrap_or_default().to_string();
        if names.contains_key(&id) {
            return Err(format!(
                "selectors.{id}: name conflicts with model ID or alias {id:?}"
            ));
        }
        let strategy = match s.get("strategy").and_then(Value::as_str) {
            None => return Err(format!("selectors.{id}.strategy is required")),
            Some("pin") => Strategy::Pin,
            Some("warm") => Strategy::Warm,
            Some("spillover") => {
                let n = s
                    .get("settings")
                    .and_then(|v| v.get("spillover"))
                    .map(|v| v.as_i64().unwrap_or(0))
                    .unwrap_or(1);
                if n < 1 {
                    return Err(format!("selectors.{id}.settings.spillover must be >= 1"));
                }
                Strategy::Spillover(n as usize)
            }
            Some(other) => {
                return Err(format!(
                    "selectors.{id}.strategy: unknown strategy {other:?} (valid: warm, pin, spillover)"
                ));
            }
        };
        let mut targets = Vec::new();
        for (i, t) in s
            .get("targets")
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let t = t.as_str().unwrap_or_default().trim().to_string();
            if selectors.contains_key(t.as_str()) {
                return Err(format!(
                    "selectors.{id}.targets[{i}] references selector {t:?}; selector chaining is not supported"
                ));
            }
            if !names.contains_key(&t) && !peer(&t) {
                notes.push(format!(
                    "selectors.{id}.targets[{i}] references unknown model {t:?} (neither in \
                     this file nor a peer's): that target left out"
                ));
                continue;
            }
            targets.push(t);
        }
        if targets.is_empty() {
            notes.push(format!(
                "selector `{id}` left out: none of its targets is a model here or a peer's"
            ));
            continue;
        }
        let text = |k: &str| s.get(k).and_then(Value::as_str).map(str::to_string);
        out.insert(
            id,
            Selector {
                strategy,
                targets,
                name: text("name"),
                description: text("description"),
                metadata: s.get("metadata").and_then(|m| serde_json::to_value(m).ok()),
                unlisted: s.get("unlisted").and_then(Value::as_bool).unwrap_or(false),
            },
        );
    }
    Ok(out)
}

/// `hooks.on_startup.preload`: the models to load at start, in order;
/// names that are no model are said and dropped, as llama-swap drops them.
pub(super) fn preload(root: &Mapping, names: &Names, notes: &mut Vec<String>) -> Vec<String> {
    let mut out = Vec::new();
    let Some(hooks) = root.get("hooks") else {
        return out;
    };
    for (key, _) in hooks.as_mapping().into_iter().flatten() {
        if key.as_str() != Some("on_startup") {
            notes.push(format!(
                "`hooks.{}` not honoured: berth knows `on_startup` only",
                key.as_str().unwrap_or("?")
            ));
        }
    }
    let list = hooks
        .get("on_startup")
        .and_then(|h| h.get("preload"))
        .and_then(Value::as_sequence);
    for id in list
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::trim)
    {
        match names.get(id) {
            Some(name) if !out.contains(name) => out.push(name.clone()),
            Some(_) => {}
            None => notes.push(format!(
                "`hooks.on_startup.preload` names `{id}`, which is no model of this file (a \
                 selector or a peer's cannot be preloaded): left out"
            )),
        }
    }
    out
}

/// `apiKeys`: each must be one word.
pub(super) fn api_keys(root: &Mapping) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for (i, key) in root
        .get("apiKeys")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let key = key.as_str().map(str::trim).unwrap_or_default();
        if key.is_empty() {
            return Err("empty api key found in apiKeys".into());
        }
        if key.contains(char::is_whitespace) {
            return Err(format!("apiKeys[{i}]: api key cannot contain spaces"));
        }
        out.push(key.to_string());
    }
    Ok(out)
}
