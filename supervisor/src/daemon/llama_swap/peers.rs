//! llama-swap's `peers`, read and checked as its loader does
//! (`internal/config/peer.go`): each peer's `proxy` (required, a URL),
//! `apiKey`, `models` (required, not empty), `filters` and `timeouts`;
//! every `PEER/MODEL` distinct from the others and from every local name.
//! What they become at run time is `server/llama_swap/peers.rs`.

use std::time::Duration;

use yaml_serde::{Mapping, Value};

use crate::server::llama_swap::layer::Filters;
use crate::server::llama_swap::peers::{Peer, PeerUrl};

/// llama-swap's defaults for `timeouts.connect` and `timeouts.responseHeader`.
const CONNECT: u64 = 30;
const RESPONSE_HEADER: u64 = 60;

/// The file's peers, its global macros expanded in their values; `taken`
/// says of a name whether a local model, alias, selector or pin has it.
pub(super) fn peers(
    root: &Mapping,
    macros: &[(String, Value)],
    taken: &dyn Fn(&str) -> Option<String>,
    notes: &mut Vec<String>,
) -> Result<Vec<Peer>, String> {
    let Some(value) = root.get("peers") else {
        return Ok(Vec::new());
    };
    if value.is_null() {
        return Ok(Vec::new());
    }
    let value = super::text::expand(value, macros).map_err(|e| format!("peers: {e}"))?;
    let Value::Mapping(map) = value else {
        return Err("`peers` is not a mapping of peer IDs".into());
    };
    let mut out: Vec<Peer> = Vec::new();
    for (id, peer) in &map {
        let id = match id {
            Value::String(id) => id.clone(),
            other => yaml_serde::to_string(other)
                .unwrap_or_default()
                .trim()
                .to_string(),
        };
        let peer = one(&id, peer, notes).map_err(|e| format!("peers.{id}: {e}"))?;
        out.push(peer);
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    // Every FQN once, and none a local name (llama-swap's
    // ValidatePeerNamespace).
    let mut seen: Vec<(String, &str, &str)> = Vec::new();
    for peer in &out {
        for model in &peer.models {
            let fqn = format!("{}/{model}", peer.id);
            if let Some((_, other, other_model)) = seen.iter().find(|(f, _, _)| *f == fqn) {
                if *other != peer.id {
                    return Err(format!(
                        "peer model name {fqn:?} is ambiguous between peers.{other} model \
                         {other_model:?} and peers.{} model {model:?}",
                        peer.id
                    ));
                }
                continue;
            }
            if let Some(what) = taken(&fqn) {
                return Err(format!(
                    "{what} conflicts with fully qualified peer model name {fqn:?}"
                ));
            }
            seen.push((fqn, peer.id.as_str(), model.as_str()));
        }
    }
    Ok(out)
}

fn one(id: &str, peer: &Value, notes: &mut Vec<String>) -> Result<Peer, String> {
    let Value::Mapping(peer) = peer else {
        return Err("it is not a mapping (`proxy`, `models`, `apiKey`, `filters`)".into());
    };
    let proxy = match peer.get("proxy") {
        Some(Value::String(p)) if !p.trim().is_empty() => p.clone(),
        None | Some(Value::Null) => return Err("proxy is required".into()),
        Some(_) => return Err("`proxy` is not a URL string".into()),
    };
    let url = PeerUrl::parse(&proxy)?;
    let api_key = match peer.get("apiKey") {
        None | Some(Value::Null) => None,
        Some(Value::String(k)) if k.trim().is_empty() => None,
        Some(Value::String(k)) => Some(k.trim().to_string()),
        Some(_) => return Err("`apiKey` is not a string".into()),
    };
    let mut models = Vec::new();
    match peer.get("models") {
        Some(Value::Sequence(list)) => {
            for (i, m) in list.iter().enumerate() {
                let m = match m {
                    Value::String(m) => m.trim().to_string(),
                    Value::Number(n) => n.to_string(),
                    _ => return Err(format!("`models[{i}]` is not a model name")),
                };
                if m.is_empty() {
                    notes.push(format!("peers.{id}.models[{i}] is empty: left out"));
                } else if !models.contains(&m) {
                    models.push(m);
                }
            }
        }
        None | Some(Value::Null) => {}
        Some(_) => return Err("`models` is not a list of model names".into()),
    }
    if models.is_empty() {
        return Err("peer models can not be empty".into());
    }
    let filters = Filters::from_peer_yaml(peer.get("filters"))?;
    let seconds = |key: &str, default: u64| -> Result<Option<Duration>, String> {
        match peer.get("timeouts").and_then(|t| t.get(key)) {
            None | Some(Value::Null) => Ok(Some(Duration::from_secs(default))),
            Some(v) => match v.as_i64() {
                Some(0) => Ok(None),
                Some(s) if s > 0 => Ok(Some(Duration::from_secs(s as u64))),
                _ => Err(format!("`timeouts.{key}` is not a whole number of seconds")),
            },
        }
    };
    let connect_timeout = seconds("connect", CONNECT)?.unwrap_or(Duration::from_secs(CONNECT));
    let header_timeout = seconds("responseHeader", RESPONSE_HEADER)?;
    if let Some(Value::Mapping(timeouts)) = peer.get("timeouts") {
        for key in timeouts.keys().filter_map(Value::as_str) {
            if !["connect", "responseHeader"].contains(&key) {
                notes.push(format!(
                    "peers.{id}.timeouts.{key} not honoured: berth keeps its own connection \
                     timeouts (a connection idle 30 s is closed)"
                ));
            }
        }
    }
    for key in peer.keys().filter_map(Value::as_str) {
        if !["proxy", "apiKey", "models", "filters", "timeouts"].contains(&key) {
            notes.push(format!(
                "peers.{id}: unknown key `{key}` ignored (llama-swap ignores it too)"
            ));
        }
    }
    Ok(Peer {
        id: id.to_string(),
        url,
        api_key,
        models,
        filters,
        connect_timeout,
        header_timeout,
    })
}
