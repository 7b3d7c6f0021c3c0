//! Migration from llama-swap: its `config.yaml`, read as berth models.
//!
//! Each llama-swap model becomes a worker kind of its own, `llama-swap-NAME`
//! (its `cmd` as the command, its `env`, an `http` table), and a model
//! naming it, so a `config.yaml` serves under `berth serve --llama-swap
//! config.yaml` as it did under llama-swap, with berth's guarantees. What
//! maps:
//!
//! | llama-swap | berth |
//! |---|---|
//! | `cmd` (comment lines dropped, `\` continuations joined, split as a POSIX shell would, without one) | `command`, `${PORT}` as `{port}` |
//! | `macros` (global and per model, `${name}`, typed when a whole value), `${env.VAR}`, `${MODEL_ID}` | expanded as llama-swap does |
//! | `proxy` (`http://localhost:${PORT}` or `127.0.0.1`) | where the server listens |
//! | `checkEndpoint` (`none`: no check) | `http.health` (`none` likewise: ready when it accepts connections) |
//! | `ttl` (seconds, 0 never, default `globalTTL`) | `keep_alive` |
//! | `env` (`"K=V"`) | the worker kind's `env` |
//! | `aliases` | `aliases`: other names `/v1` requests may use |
//! | `useModelName` | `http.model` |
//! | `concurrencyLimit` | `max_concurrency` |
//! | `unloadTimeout` | `http.stop_grace` |
//! | `healthCheckTimeout` | `load_timeout` |
//!
//! What does not map is named in the notes the reader returns, which `berth
//! serve` prints: `cmdStop` (berth stops a server by signal, then SIGKILL),
//! `filters`, `groups`, `profiles`, `matrix`, `hooks`, `peers`, `apiKeys`,
//! `startPort` (berth chooses ports), and llama-swap's logging and UI keys.
//! A model whose `cmd` takes no `${PORT}` (a fixed port) is refused with
//! why: berth gives each start its own port, so that a swap's new server can
//! start beside the old one.

use std::collections::BTreeMap;
use std::time::Duration;

use yaml_serde::{Mapping, Value};

use crate::config::{HttpSpec, ModelSpec, WorkerKind};

/// What a llama-swap config becomes.
#[derive(Debug, Default)]
pub struct Migrated {
    pub workers: BTreeMap<String, WorkerKind>,
    pub models: Vec<ModelSpec>,
    /// What was ignored or refused, a sentence each.
    pub notes: Vec<String>,
}

/// Top-level keys with no berth equivalent, and why.
const IGNORED_TOP: &[(&str, &str)] = &[
    (
        "groups",
        "berth loads models on demand within memory_budget and max_loaded, and evicts idle ones",
    ),
    ("profiles", "no equivalent"),
    ("selectors", "no equivalent"),
    ("routing", "no equivalent"),
    ("matrix", "no equivalent"),
    (
        "hooks",
        "no equivalent (load a model at start with POST /api/models/NAME/load)",
    ),
    ("peers", "berth serves its own models only"),
    ("apiKeys", "set berth's own `token` (or BERTH_TOKEN)"),
    ("startPort", "berth chooses a free port for each start"),
    ("logRequests", "no equivalent"),
    ("logLevel", "set BERTH_LOG"),
    ("logTimeFormat", "no equivalent"),
    ("logToStdout", "no equivalent"),
    ("metricsMaxInMemory", "berth's metrics are at /metrics"),
    ("captureBuffer", "no equivalent"),
    ("store", "no equivalent"),
    ("ui", "no equivalent"),
    ("performance", "no equivalent"),
    ("upstream", "no equivalent"),
    ("sendLoadingState", "no equivalent"),
    ("includeAliasesInList", "no equivalent"),
];

/// Per-model keys with no berth equivalent.
const IGNORED_MODEL: &[(&str, &str)] = &[
    (
        "cmdStop",
        "berth stops a server with its stop signal, then SIGKILL",
    ),
    ("filters", "requests pass to the server unchanged"),
    ("unlisted", "every model is listed"),
    ("name", "no equivalent"),
    ("description", "no equivalent"),
    ("metadata", "no equivalent"),
    ("capabilities", "no equivalent"),
    ("timeouts", "no equivalent"),
    ("compat", "no equivalent"),
    ("sendLoadingState", "no equivalent"),
];

/// Reads a llama-swap `config.yaml` from its text. `env` looks up the
/// variables `${env.VAR}` names.
pub fn migrate(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Migrated, String> {
    check_shape(text)?;
    let mut root: Value =
        yaml_serde::from_str(text).map_err(|e| format!("not a YAML file: {e}"))?;
    root.apply_merge()
        .map_err(|e| format!("cannot apply its `<<` merge keys: {e}"))?;
    let root = expand_env(&root, env)?;
    let Value::Mapping(root) = root else {
        return Err("the file is not a mapping of keys".into());
    };
    let mut out = Migrated::default();
    let global_macros = macros(root.get("macros"), "macros")?;
    let global_ttl = root.get("globalTTL").and_then(Value::as_i64).unwrap_or(0);
    let health_timeout = root
        .get("healthCheckTimeout")
        .and_then(Value::as_i64)
        .unwrap_or(120)
        .max(15);
    let global_unload = root
        .get("unloadTimeout")
        .and_then(Value::as_i64)
        .filter(|t| *t > 0)
        .unwrap_or(10);
    for (key, why) in IGNORED_TOP {
        if root.contains_key(*key) {
            out.notes.push(format!("ignored `{key}`: {why}"));
        }
    }
    let Some(Value::Mapping(models)) = root.get("models") else {
        return Err("no `models` mapping".into());
    };
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
        match model_of(&id, model, &global_macros) {
            Ok(expanded) => match one_model(
                &id,
                &expanded,
                global_ttl,
                health_timeout,
                global_unload,
                &mut out.notes,
            ) {
                Ok((kind, spec)) => {
                    if let Err(e) = spec.validate() {
                        out.notes.push(format!("model `{id}` left out: {e}"));
                        continue;
                    }
                    if let Some(first) = out.models.iter().find(|m| m.name == spec.name) {
                        out.notes.push(format!(
                            "model `{id}` left out: its berth name `{}` is already model `{}`'s \
                             in this file (IDs differing only in characters a berth name \
                             cannot hold); rename one",
                            spec.name,
                            first.aliases.last().unwrap_or(&first.name)
                        ));
                        continue;
                    }
                    out.workers
                        .insert(spec.worker.clone().expect("named"), kind);
                    out.models.push(spec);
                }
                Err(why) => out.notes.push(format!("model `{id}` left out: {why}")),
            },
            Err(why) => out.notes.push(format!("model `{id}` left out: {why}")),
        }
    }
    Ok(out)
}

/// Model `id`'s entry with its macros (the file's, then its own) expanded.
fn model_of(id: &str, model: &Value, global: &[(String, Value)]) -> Result<Value, String> {
    let Value::Mapping(model) = model else {
        return Err("it is not a mapping".into());
    };
    let mut all = global.to_vec();
    for (name, value) in macros(model.get("macros"), "its macros")? {
        all.retain(|(n, _)| *n != name);
        all.push((name, value));
    }
    all.insert(0, ("MODEL_ID".into(), Value::String(id.into())));
    expand(&Value::Mapping(model.clone()), &all)
}

/// The most bytes a llama-swap file may have, and the deepest it may nest:
/// a real one is a few KiB, five levels deep. Checked before the YAML is
/// parsed, so a hostile file costs no parse.
const MAX_FILE: usize = 1 << 20;
const MAX_DEPTH: usize = 32;
/// The longest value a macro may expand to: the kernel's limit on one
/// argument (`MAX_ARG_STRLEN`), which no command line can pass anyway.
const MAX_VALUE: usize = 128 << 10;

/// Refuses a file too large, or nested too deep (flow collections `[`/`{`,
/// or indentation), to be a llama-swap config.
fn check_shape(text: &str) -> Result<(), String> {
    if text.len() > MAX_FILE {
        return Err(format!(
            "it is {} bytes; a llama-swap config is at most {MAX_FILE}",
            text.len()
        ));
    }
    let mut depth = 0usize;
    for line in text.lines() {
        let indent = line.len() - line.trim_start_matches([' ', '-']).len();
        if indent > MAX_DEPTH * 8 && !line.trim().is_empty() {
            return Err(format!(
                "it is indented {indent} columns deep; a llama-swap config nests a few levels"
            ));
        }
        let (mut quote, mut escaped) = (None, false);
        for c in line.chars() {
            match (quote, c) {
                (None, '#') => break,
                (None, '\'' | '"') => quote = Some(c),
                (Some('"'), '\\') if !escaped => {
                    escaped = true;
                    continue;
                }
                (Some(q), c) if c == q && !escaped => quote = None,
                (None, '[' | '{') => {
                    depth += 1;
                    if depth > MAX_DEPTH {
                        return Err(format!(
                            "its brackets nest more than {MAX_DEPTH} deep; a llama-swap config \
                             nests a few levels"
                        ));
                    }
                }
                (None, ']' | '}') => depth = depth.saturating_sub(1),
                _ => {}
            }
            escaped = false;
        }
    }
    Ok(())
}

/// A mapping of macros, in order.
fn macros(value: Option<&Value>, what: &str) -> Result<Vec<(String, Value)>, String> {
    let Some(value) = value else {
        return Ok(Vec::new());
    };
    let Value::Mapping(map) = value else {
        return Err(format!("`{what}` is not a mapping"));
    };
    map.iter()
        .map(|(k, v)| {
            let name = k
                .as_str()
                .ok_or_else(|| format!("a name in `{what}` is not a string"))?;
            if matches!(name, "PORT" | "PID" | "MODEL_ID") {
                return Err(format!("`{what}` may not define `{name}`"));
            }
            Ok((name.to_string(), v.clone()))
        })
        .collect()
}

/// `value` with `each` applied to every string in it, at any depth (keys
/// are left as they are): how macros and `${env.VAR}` are expanded.
fn map_strings(
    value: &Value,
    each: &mut impl FnMut(&str) -> Result<Value, String>,
) -> Result<Value, String> {
    Ok(match value {
        Value::String(text) => each(text)?,
        Value::Sequence(items) => Value::Sequence(
            items
                .iter()
                .map(|v| map_strings(v, each))
                .collect::<Result<_, _>>()?,
        ),
        Value::Mapping(map) => {
            let mut out = Mapping::new();
            for (k, v) in map {
                out.insert(k.clone(), map_strings(v, each)?);
            }
            Value::Mapping(out)
        }
        other => other.clone(),
    })
}

/// `${env.VAR}` replaced by the variable's value in every string of the
/// parsed file, as llama-swap does; a string that is exactly `${env.VAR}`
/// takes the value as YAML reads it (a number stays a number). Replaced
/// after parsing rather than in the text, so a value holding quotes or
/// colons is the value, wherever it is used.
fn expand_env(value: &Value, env: &dyn Fn(&str) -> Option<String>) -> Result<Value, String> {
    map_strings(value, &mut |text| {
        if !text.contains("${env.") {
            return Ok(Value::String(text.to_string()));
        }
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(at) = rest.find("${env.") {
            out.push_str(&rest[..at]);
            let after = &rest[at + 6..];
            let end = after
                .find('}')
                .ok_or_else(|| format!("an unclosed `${{env.` in: {text}"))?;
            let name = &after[..end];
            let value = env(name).ok_or_else(|| format!("`${{env.{name}}}`: {name} is not set"))?;
            if value.contains('\0') {
                return Err(format!("`${{env.{name}}}` holds a NUL"));
            }
            out.push_str(&value);
            if out.len() > MAX_VALUE {
                return Err(format!(
                    "`${{env.{name}}}` makes a value longer than {MAX_VALUE} bytes"
                ));
            }
            rest = &after[end + 1..];
        }
        out.push_str(rest);
        let whole =
            text.starts_with("${env.") && text.ends_with('}') && text.matches("${").count() == 1;
        Ok(match yaml_serde::from_str::<Value>(&out) {
            Ok(v @ (Value::Number(_) | Value::Bool(_))) if whole => v,
            _ => Value::String(out),
        })
    })
}

/// `value` with every `${name}` of `macros` replaced, in every string,
/// recursively; a string that is exactly `${name}` takes the macro's value
/// as it is (a number stays a number). Later macros may use earlier ones,
/// so a value can double at each: past [`MAX_VALUE`] bytes it is refused,
/// naming the macro.
fn expand(value: &Value, macros: &[(String, Value)]) -> Result<Value, String> {
    map_strings(value, &mut |text| {
        let mut text = text.to_string();
        for (name, with) in macros {
            if text == format!("${{{name}}}") {
                match with {
                    // A string macro may use others: expanded below.
                    Value::String(s) => text = s.clone(),
                    _ => return Ok(with.clone()),
                }
                break;
            }
        }
        // Later macros may use earlier ones: the last declared first.
        for (name, with) in macros.iter().rev() {
            let shown = match with {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                _ => continue,
            };
            let pattern = format!("${{{name}}}");
            let uses = text.matches(&pattern).count();
            if uses == 0 {
                continue;
            }
            let grown = text.len() - uses * pattern.len() + uses * shown.len();
            if grown > MAX_VALUE {
                return Err(format!(
                    "macro `{name}` expands to more than {MAX_VALUE} bytes (macros that use \
                     earlier ones double at each step); a command line cannot pass it"
                ));
            }
            text = text.replace(&pattern, &shown);
        }
        Ok(Value::String(text))
    })
}

fn one_model(
    id: &str,
    model: &Value,
    global_ttl: i64,
    health_timeout: i64,
    global_unload: i64,
    notes: &mut Vec<String>,
) -> Result<(WorkerKind, ModelSpec), String> {
    let get = |key: &str| model.get(key);
    let text = |key: &str| get(key).and_then(Value::as_str).map(str::to_string);
    for (key, why) in IGNORED_MODEL {
        if get(key).is_some() {
            notes.push(format!("model `{id}`: ignored `{key}`: {why}"));
        }
    }
    let cmd = text("cmd").ok_or("it has no `cmd`")?;
    let argv = split_command(&cmd)?;
    if argv.is_empty() {
        return Err("its `cmd` is empty".into());
    }
    if let Some(left) = argv
        .iter()
        .find(|a| a.contains("${") && !a.contains("${PORT}"))
    {
        return Err(format!("`{left}` names a macro that is not defined"));
    }
    if !argv.iter().any(|a| a.contains("${PORT}")) {
        return Err(
            "its `cmd` listens on a port of its own (no `${PORT}`); berth chooses a port for \
             each start, so put `${PORT}` where the port goes"
                .into(),
        );
    }
    let argv: Vec<String> = argv
        .iter()
        .map(|a| a.replace("${PORT}", "{port}"))
        .collect();
    if let Some(proxy) = text("proxy") {
        let proxy = proxy.trim_end_matches('/');
        let fine = ["http://localhost:${PORT}", "http://127.0.0.1:${PORT}"];
        if !fine.contains(&proxy) {
            return Err(format!(
                "its `proxy` is `{proxy}`; berth reaches the server on the loopback port it \
                 chooses (`http://127.0.0.1:${{PORT}}`)"
            ));
        }
    }
    let mut http = HttpSpec::new(text("checkEndpoint").unwrap_or_else(|| "/health".into()));
    if http.health.trim() == "none" {
        http.health = "none".into();
    }
    http.model = text("useModelName").filter(|n| !n.is_empty());
    let unload = get("unloadTimeout")
        .and_then(Value::as_i64)
        .filter(|t| *t > 0)
        .unwrap_or(global_unload);
    http.stop_grace = Some(Duration::from_secs(unload as u64));
    let env = match get("env") {
        None => BTreeMap::new(),
        Some(Value::Sequence(items)) => items
            .iter()
            .map(|item| {
                let pair = item.as_str().ok_or("an `env` entry is not a string")?;
                let (k, v) = pair
                    .split_once('=')
                    .ok_or_else(|| format!("`env` entry `{pair}` is not K=V"))?;
                Ok((k.to_string(), v.to_string()))
            })
            .collect::<Result<_, String>>()?,
        Some(_) => return Err("its `env` is not a list of \"K=V\"".into()),
    };
    let kind = WorkerKind {
        binary: None,
        command: Some(argv),
        cwd: None,
        env,
        http: Some(http),
        preload: Vec::new(),
        preload_at_start: false,
        preload_keep_alive: None,
    };
    let name = berth_name(id);
    if name != id {
        notes.push(format!(
            "model `{id}` is called `{name}` in berth (a berth name is letters, digits, `-`, \
             `_`, `.`); its ID is kept as an alias"
        ));
    }
    let mut spec = ModelSpec::new(name.clone(), "");
    spec.worker = Some(format!("llama-swap-{name}"));
    let ttl = get("ttl").and_then(Value::as_i64).filter(|t| *t >= 0);
    spec.keep_alive = match ttl.unwrap_or(global_ttl) {
        0 => Some(crate::config::MAX_DURATION),
        seconds => Some(Duration::from_secs(seconds.max(0) as u64)),
    };
    spec.load_timeout = Some(Duration::from_secs(health_timeout as u64));
    if let Some(limit) = get("concurrencyLimit").and_then(Value::as_i64) {
        spec.max_concurrency = Some(if limit > 0 { limit as usize } else { 10 });
    }
    let mut aliases: Vec<String> = match get("aliases") {
        Some(Value::Sequence(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        _ => Vec::new(),
    };
    if name != id {
        aliases.push(id.to_string());
    }
    spec.aliases = aliases;
    Ok((kind, spec))
}

/// A llama-swap model ID as a berth model name.
fn berth_name(id: &str) -> String {
    let name: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect();
    let name = name.trim_start_matches('.').to_string();
    if name.is_empty() {
        "model".into()
    } else {
        name
    }
}

/// `cmd` as argv, as llama-swap splits it: comment lines dropped, a line
/// ending in `\` joined to the next, then split as a POSIX shell would
/// (quotes, backslash escapes) without running one.
pub(crate) fn split_command(cmd: &str) -> Result<Vec<String>, String> {
    let text: String = cmd
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| l.strip_suffix('\\').unwrap_or(l))
        .collect::<Vec<_>>()
        .join(" ");
    let mut args = Vec::new();
    let mut current = String::new();
    let mut started = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                started = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => current.push(c),
                        None => return Err("an unclosed `'` in `cmd`".into()),
                    }
                }
            }
            '"' => {
                started = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('$' | '`' | '"' | '\\')) => current.push(c),
                            Some(c) => {
                                current.push('\\');
                                current.push(c);
                            }
                            None => return Err("an unclosed `\"` in `cmd`".into()),
                        },
                        Some(c) => current.push(c),
                        None => return Err("an unclosed `\"` in `cmd`".into()),
                    }
                }
            }
            '\\' => {
                started = true;
                if let Some(c) = chars.next() {
                    current.push(c);
                }
            }
            c if c.is_whitespace() => {
                if started {
                    args.push(std::mem::take(&mut current));
                    started = false;
                }
            }
            c => {
                started = true;
                current.push(c);
            }
        }
    }
    if started {
        args.push(current);
    }
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = r#"
healthCheckTimeout: 60
startPort: 10001
logLevel: debug
macros:
  "server": /opt/llama/llama-server
  "ctx": 4096
groups:
  small:
    members: ["tiny"]
models:
  "tiny":
    # the small one
    cmd: |
      ${server} --port ${PORT}
      # a comment line
      -m "/models/tiny model.gguf" \
      --ctx-size ${ctx} --alias ${MODEL_ID}
    env:
      - "CUDA_VISIBLE_DEVICES=0"
    aliases: ["gpt-4o-mini"]
    checkEndpoint: /health
    ttl: 60
    useModelName: "tiny-upstream"
    cmdStop: "kill ${PID}"
  "qwen:7b":
    cmd: ${server} --port ${PORT} -m /m/q.gguf
    checkEndpoint: none
    concurrencyLimit: 2
  "fixed":
    cmd: /opt/server --port 9000
    proxy: http://127.0.0.1:9000
"#;

    #[test]
    fn a_llama_swap_config_becomes_berth_models_and_says_what_it_ignores() {
        let out = migrate(CONFIG, &|_| None).unwrap();
        assert_eq!(out.models.len(), 2, "{:?}", out.notes);
        let tiny = out.models.iter().find(|m| m.name == "tiny").unwrap();
        assert_eq!(tiny.keep_alive, Some(Duration::from_secs(60)));
        assert_eq!(tiny.load_timeout, Some(Duration::from_secs(60)));
        assert_eq!(tiny.aliases, ["gpt-4o-mini"]);
        let kind = &out.workers[tiny.worker.as_ref().unwrap()];
        assert_eq!(
            kind.command.as_deref().unwrap(),
            [
                "/opt/llama/llama-server",
                "--port",
                "{port}",
                "-m",
                "/models/tiny model.gguf",
                "--ctx-size",
                "4096",
                "--alias",
                "tiny"
            ]
        );
        assert_eq!(kind.env["CUDA_VISIBLE_DEVICES"], "0");
        let http = kind.http.as_ref().unwrap();
        assert_eq!(http.health, "/health");
        assert_eq!(http.model.as_deref(), Some("tiny-upstream"));
        let qwen = out.models.iter().find(|m| m.name == "qwen-7b").unwrap();
        assert_eq!(qwen.aliases, ["qwen:7b"], "its ID stays reachable");
        assert_eq!(qwen.max_concurrency, Some(2));
        assert_eq!(
            out.workers[qwen.worker.as_ref().unwrap()]
                .http
                .as_ref()
                .unwrap()
                .health,
            "none"
        );
        let notes = out.notes.join("\n");
        for said in [
            "ignored `groups`",
            "ignored `startPort`",
            "ignored `logLevel`",
            "ignored `cmdStop`",
            "model `fixed` left out",
        ] {
            assert!(notes.contains(said), "`{said}` not in:\n{notes}");
        }
    }

    #[test]
    fn env_variables_are_expanded_and_missing_ones_refused() {
        let text = "models:\n  m:\n    cmd: ${env.SERVER} --port ${PORT}\n";
        let out = migrate(text, &|k| (k == "SERVER").then(|| "/bin/srv".into())).unwrap();
        let kind = out.workers.values().next().unwrap();
        assert_eq!(kind.command.as_ref().unwrap()[0], "/bin/srv");
        let err = migrate(text, &|_| None).unwrap_err();
        assert!(err.contains("SERVER is not set"), "{err}");
    }

    #[test]
    fn merge_keys_and_anchors_are_applied() {
        let text = "defs:\n  base: &base\n    ttl: 5\n    checkEndpoint: /ready\nmodels:\n  m:\n    <<: *base\n    cmd: srv --port ${PORT}\n";
        let out = migrate(text, &|_| None).unwrap();
        assert_eq!(out.models[0].keep_alive, Some(Duration::from_secs(5)));
        let kind = out.workers.values().next().unwrap();
        assert_eq!(kind.http.as_ref().unwrap().health, "/ready");
    }

    /// A 1 KB file whose macros double at each step asked for 1.6 GB at
    /// once; YAML nested 100,000 deep gave no answer in 6 s. Both are
    /// refused at once, naming what.
    #[test]
    fn macros_that_double_and_deep_nesting_are_refused_fast() {
        let mut text = String::from("macros:\n  a0: \"xxxxxxxx\"\n");
        for i in 1..=40 {
            text.push_str(&format!("  a{i}: \"${{a{}}}${{a{}}}\"\n", i - 1, i - 1));
        }
        text.push_str("models:\n  m:\n    cmd: srv --port ${PORT} ${a40}\n");
        let started = std::time::Instant::now();
        let out = migrate(&text, &|_| None).unwrap();
        let notes = out.notes.join("\n");
        assert!(out.models.is_empty());
        assert!(
            notes.contains("model `m` left out") && notes.contains("expands to more than"),
            "{notes}"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(1));

        let deep = format!("models: {}{}", "[".repeat(100_000), "]".repeat(100_000));
        let started = std::time::Instant::now();
        let err = migrate(&deep, &|_| None).unwrap_err();
        assert!(err.contains("nest more than 32"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_millis(100));
        let indented: String = (0..400)
            .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
            .collect();
        assert!(
            migrate(&indented, &|_| None)
                .unwrap_err()
                .contains("indented")
        );
        // Brackets inside quotes and comments are not nesting.
        let quoted = format!(
            "# {}\nmodels:\n  m:\n    cmd: \"srv --port ${{PORT}} --x '{}'\"\n",
            "[".repeat(50),
            "{".repeat(50)
        );
        assert_eq!(migrate(&quoted, &|_| None).unwrap().models.len(), 1);
    }

    /// A `${env.X}` whose value holds quotes is the value, wherever it is
    /// used; a whole-value one keeps YAML's type.
    #[test]
    fn env_values_with_quotes_reach_the_command_as_they_are() {
        let text = "models:\n  m:\n    cmd: |\n      srv --port ${PORT} --name '${env.NAME}'\n    ttl: ${env.TTL}\n";
        let env = |k: &str| match k {
            "NAME" => Some(r#"a "quoted" b\c"#.to_string()),
            "TTL" => Some("30".to_string()),
            _ => None,
        };
        let out = migrate(text, &env).unwrap();
        let kind = out.workers.values().next().unwrap();
        assert_eq!(
            kind.command.as_ref().unwrap().last().unwrap(),
            r#"a "quoted" b\c"#
        );
        assert_eq!(out.models[0].keep_alive, Some(Duration::from_secs(30)));
    }

    /// One rule for a model that cannot be served: left out, saying why,
    /// the rest served. Two IDs that make one berth name are named as both
    /// being in this file.
    #[test]
    fn a_bad_entry_is_left_out_and_the_rest_served() {
        let text = "models:\n  \"\":\n    cmd: srv --port ${PORT}\n  \"a:b\":\n    cmd: srv --port ${PORT}\n  \"a/b\":\n    cmd: srv --port ${PORT}\n  7:\n    cmd: srv --port ${PORT}\n  ok:\n    cmd: srv --port ${PORT}\n";
        let out = migrate(text, &|_| None).unwrap();
        let names: Vec<&str> = out.models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["a-b", "ok"], "{:?}", out.notes);
        let notes = out.notes.join("\n");
        assert!(notes.contains("model `` left out"), "{notes}");
        assert!(
            notes.contains(
                "model `a/b` left out: its berth name `a-b` is already model `a:b`'s in this file"
            ),
            "{notes}"
        );
        assert!(notes.contains("not a string (7) left out"), "{notes}");
    }

    #[test]
    fn commands_split_as_a_shell_would() {
        assert_eq!(
            split_command(r#"a 'b c' "d \"e\"" f\ g"#).unwrap(),
            ["a", "b c", "d \"e\"", "f g"]
        );
        assert!(split_command("a 'b").is_err());
    }
}
