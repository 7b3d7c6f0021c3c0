//! One llama-swap model entry as a berth worker kind and model, with what
//! the front door needs of it (its listing, filters, loading state).

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value as Json;
use yaml_serde::Value;

use super::text::split_command;
use crate::config::{HttpSpec, ModelSpec, WorkerKind};
use crate::server::llama_swap::layer::{Filters, Listing};

/// The file's settings every model falls back on.
pub(super) struct Defaults {
    pub ttl: i64,
    pub health_timeout: i64,
    pub unload_timeout: i64,
}

/// A model entry, converted.
pub(super) struct Model {
    pub kind: WorkerKind,
    pub spec: ModelSpec,
    pub listing: Listing,
    pub filters: Filters,
    pub loading_state: Option<bool>,
}

/// Each per-model key llama-swap reads, and what berth does with it; a key
/// not here is named as unknown (llama-swap ignores those too).
pub(super) const MODEL_KEYS: &[(&str, &str)] = &[
    ("cmd", "the server's command"),
    ("cmdStop", "`http.stop_command`"),
    ("proxy", "where the server listens"),
    ("aliases", "aliases"),
    ("env", "the worker kind's env"),
    ("checkEndpoint", "`http.health`"),
    ("ttl", "keep_alive"),
    ("unloadTimeout", "`http.stop_grace`"),
    ("unlisted", "left out of /v1/models"),
    ("useModelName", "`http.model`"),
    ("name", "/v1/models"),
    ("description", "/v1/models"),
    ("metadata", "/v1/models"),
    ("capabilities", "/v1/models"),
    ("concurrencyLimit", "max_concurrency"),
    ("filters", "the request body rewritten"),
    ("macros", "expanded"),
    (
        "sendLoadingState",
        "a streamed answer says the model is loading",
    ),
    ("timeouts", "refused"),
    ("compat", "refused"),
    ("healthCheckTimeout", "refused"),
];

/// Where a `proxy` says the server listens.
enum ProxyPort {
    /// `${PORT}`: the one berth chooses for the start.
    Chosen,
    Fixed(u16),
}

pub(super) fn one_model(
    id: &str,
    name: &str,
    model: &Value,
    macros: &[(String, Value)],
    defaults: &Defaults,
    notes: &mut Vec<String>,
) -> Result<Model, String> {
    let get = |key: &str| model.get(key);
    let text = |key: &str| get(key).and_then(Value::as_str).map(str::to_string);
    if let Value::Mapping(map) = model {
        for key in map.keys() {
            let key = key.as_str().unwrap_or("?");
            match key {
                "timeouts" => notes.push(format!(
                    "model `{id}`: `timeouts` not honoured: berth reaches the server on the \
                     loopback, at once; a request's time is bounded by its `timeout` field and \
                     the model's stall_timeout"
                )),
                "compat" => notes.push(format!(
                    "model `{id}`: `compat` not honoured: berth never relays a websocket (an \
                     upgrade is answered 502), so there are none to ignore"
                )),
                "healthCheckTimeout" => notes.push(format!(
                    "model `{id}`: its own `healthCheckTimeout` ignored, as llama-swap does: \
                     the file's applies"
                )),
                key if MODEL_KEYS.iter().any(|(k, _)| *k == key) => {}
                key => notes.push(format!(
                    "model `{id}`: unknown key `{key}` ignored (llama-swap ignores it too)"
                )),
            }
        }
    }
    let cmd = text("cmd").ok_or("it has no `cmd`")?;
    let argv = split_command(&cmd)?;
    if argv.is_empty() {
        return Err("its `cmd` is empty".into());
    }
    let cmd_port = argv.iter().any(|a| a.contains("${PORT}"));
    let proxy = text("proxy").unwrap_or_else(|| "http://localhost:${PORT}".into());
    let (host, port) = proxy_of(&proxy)?;
    let mut http = HttpSpec::new(text("checkEndpoint").unwrap_or_else(|| "/health".into()));
    if let Some(host) = &host {
        if let crate::config::Reach::Elsewhere(name) = crate::config::Reach::of(Some(host))? {
            if matches!(port, ProxyPort::Chosen) && !cmd_port {
                return Err(format!(
                    "its `proxy` `{proxy}` names `${{PORT}}` but its `cmd` does not (llama-swap \
                     refuses it too): name the port in both"
                ));
            }
            notes.push(format!(
                "model `{id}`: its server is reached at `{name}` (its `proxy`), not on this \
                 machine's loopback: berth runs and stops its `cmd` here, but the server's \
                 memory is outside berth's cgroup, so its load report, `ps` and an unload's \
                 proof cover what berth ran, not the server (said in each)"
            ));
        }
        http.host = Some(host.clone());
    }
    match port {
        ProxyPort::Chosen if cmd_port => {}
        ProxyPort::Fixed(port) => http.port = Some(port),
        ProxyPort::Chosen => {
            http.find_port = true;
            notes.push(format!(
                "model `{id}`: its `cmd` names no `${{PORT}}` and its `proxy` is `{proxy}` (which \
                 llama-swap refuses): berth finds the port its server listens on once started"
            ));
        }
    }
    let fixed = http.port.map(|p| p.to_string());
    let fill_port = |a: &str| match &fixed {
        Some(port) => a.replace("${PORT}", port),
        None => a.replace("${PORT}", "{port}"),
    };
    if let Some(left) = argv
        .iter()
        .find(|a| a.contains("${") && !a.contains("${PORT}"))
    {
        return Err(format!("`{left}` names a macro that is not defined"));
    }
    let argv: Vec<String> = argv.iter().map(|a| fill_port(a)).collect();
    if let Some(stop) = text("cmdStop") {
        let stop = split_command(&stop)?;
        if stop.is_empty() {
            return Err("its `cmdStop` is empty".into());
        }
        // `${PORT}`: the port of the start being stopped (`{port}`).
        if stop.iter().any(|a| a.contains("${PORT}")) && fixed.is_none() && !cmd_port {
            return Err(
                "its `cmdStop` names `${PORT}` but its `cmd` does not (llama-swap refuses it \
                 too): name the server by `${MODEL_ID}` or `${PID}`"
                    .into(),
            );
        }
        if let Some(left) = stop
            .iter()
            .find(|a| a.contains("${") && !a.contains("${PID}") && !a.contains("${PORT}"))
        {
            return Err(format!(
                "its `cmdStop`'s `{left}` names a macro that is not defined"
            ));
        }
        http.stop_command = Some(
            stop.iter()
                .map(|a| fill_port(a).replace("${PID}", "{pid}"))
                .collect(),
        );
    }
    if http.health.trim() == "none" {
        http.health = "none".into();
    }
    http.model = text("useModelName").filter(|n| !n.is_empty());
    let unload = get("unloadTimeout")
        .and_then(Value::as_i64)
        .filter(|t| *t > 0)
        .unwrap_or(defaults.unload_timeout);
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
                // `{port}`: filled in at each start.
                let v = fill_port(v);
                Ok((k.to_string(), v))
            })
            .collect::<Result<_, String>>()?,
        Some(_) => return Err("its `env` is not a list of \"K=V\"".into()),
    };
    let kind = WorkerKind {
        binary: None,
        command: Some(argv),
        container: None,
        cwd: None,
        env,
        http: Some(http),
        preload: Vec::new(),
        preload_at_start: false,
        preload_keep_alive: None,
    };
    let mut spec = ModelSpec::new(name, "");
    spec.worker = Some(format!("llama-swap-{name}"));
    let ttl = get("ttl").and_then(Value::as_i64).filter(|t| *t >= 0);
    spec.keep_alive = match ttl.unwrap_or(defaults.ttl) {
        0 => Some(crate::config::MAX_DURATION),
        seconds => Some(Duration::from_secs(seconds.max(0) as u64)),
    };
    spec.load_timeout = Some(Duration::from_secs(defaults.health_timeout as u64));
    if let Some(limit) = get("concurrencyLimit").and_then(Value::as_i64) {
        spec.max_concurrency = Some(if limit > 0 { limit as usize } else { 10 });
    }
    let mut aliases: Vec<String> = match get("aliases") {
        Some(Value::Sequence(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty())
            .collect(),
        _ => Vec::new(),
    };
    let filters = expand_keys(get("filters"), macros, fixed.as_deref())?;
    let filters = Filters::from_yaml(id, filters.as_ref())?;
    // A request may name an entry of `setParamsByID`: it is an alias.
    for key in filters.by_id.keys() {
        if key != id && !aliases.contains(key) {
            aliases.push(key.clone());
        }
    }
    if name != id {
        aliases.push(id.to_string());
    }
    spec.aliases = aliases;
    let to_json = |v: &Value| serde_json::to_value(v).unwrap_or(Json::Null);
    let listing = Listing {
        id: id.to_string(),
        name: text("name")
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty()),
        description: text("description")
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty()),
        metadata: get("metadata").map(|m| {
            let mut m = to_json(m);
            if let Some(port) = &fixed {
                replace_port(&mut m, port);
            }
            m
        }),
        capabilities: get("capabilities").map(to_json),
        unlisted: get("unlisted").and_then(Value::as_bool).unwrap_or(false),
        aliases: spec.aliases.clone(),
    };
    Ok(Model {
        kind,
        spec,
        listing,
        filters,
        loading_state: get("sendLoadingState").and_then(Value::as_bool),
    })
}

/// `${PORT}` in the metadata's strings, where the port is fixed.
fn replace_port(value: &mut Json, port: &str) {
    match value {
        Json::String(s) if s.contains("${PORT}") => {
            let replaced = s.replace("${PORT}", port);
            *value = if *s == "${PORT}" {
                port.parse::<u64>()
                    .map(Json::from)
                    .unwrap_or(Json::String(replaced))
            } else {
                Json::String(replaced)
            };
        }
        Json::Array(items) => items.iter_mut().for_each(|v| replace_port(v, port)),
        Json::Object(map) => map.values_mut().for_each(|v| replace_port(v, port)),
        _ => {}
    }
}

/// `filters.setParamsByID`'s keys expanded with every macro the model's
/// values were (llama-swap does so, then takes each key as an alias), and
/// `${PORT}` where the port is fixed.
fn expand_keys(
    filters: Option<&Value>,
    macros: &[(String, Value)],
    port: Option<&str>,
) -> Result<Option<Value>, String> {
    let Some(Value::Mapping(filters)) = filters else {
        return Ok(filters.cloned());
    };
    let mut filters = filters.clone();
    for key in ["setParamsByID"] {
        let Some(Value::Mapping(by_id)) = filters.get(key) else {
            continue;
        };
        let mut expanded = yaml_serde::Mapping::new();
        for (k, v) in by_id {
            let Some(text) = k.as_str() else {
                return Err(format!(
                    "its `filters.{key}` has a key that is not a string"
                ));
            };
            let mut text = match super::text::expand(&Value::String(text.to_string()), macros)? {
                Value::String(s) => s,
                other => yaml_serde::to_string(&other)
                    .unwrap_or_default()
                    .trim()
                    .to_string(),
            };
            if let Some(port) = port {
                text = text.replace("${PORT}", port);
            } else if text.contains("${PORT}") {
                return Err(format!(
                    "its `filters.{key}` key `{text}` names `${{PORT}}`, which berth chooses \
                     for each start: a request cannot name it"
                ));
            }
            if expanded.contains_key(Value::String(text.clone())) {
                return Err(format!(
                    "its `filters.{key}` has two keys that resolve to `{text}` (llama-swap \
                     refuses it too)"
                ));
            }
            expanded.insert(Value::String(text), v.clone());
        }
        filters.insert(Value::String(key.into()), Value::Mapping(expanded));
    }
    Ok(Some(Value::Mapping(filters)))
}

/// Where a `proxy` URL says the server is: its host, where it is not
/// `127.0.0.1` (`None`), and its port: `${PORT}`, or a number.
fn proxy_of(proxy: &str) -> Result<(Option<String>, ProxyPort), String> {
    let rest = proxy
        .trim()
        .strip_prefix("http://")
        .ok_or_else(|| format!("its `proxy` `{proxy}` is not an http:// address"))?;
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    if !path.is_empty() {
        return Err(format!(
            "its `proxy` `{proxy}` has a path; berth relays /v1 requests to the server's root"
        ));
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => (host, Some(port)),
        _ => (authority, None),
    };
    let reach = crate::config::Reach::of(Some(host))
        .map_err(|_| format!("its `proxy` `{proxy}` names no host berth can reach"))?;
    let host = match reach {
        crate::config::Reach::Loopback(ip) if ip == std::net::Ipv4Addr::LOCALHOST => None,
        _ => Some(host.to_string()),
    };
    let port = match port {
        None => ProxyPort::Fixed(80),
        Some("${PORT}") => ProxyPort::Chosen,
        Some(port) => match port.parse::<u16>() {
            Ok(p) if p > 0 => ProxyPort::Fixed(p),
            _ => return Err(format!("its `proxy` `{proxy}` has no valid port")),
        },
    };
    Ok((host, port))
}

/// A llama-swap model ID as a berth model name.
pub(super) fn berth_name(id: &str) -> String {
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
