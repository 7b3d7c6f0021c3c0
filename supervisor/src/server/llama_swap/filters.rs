//! A llama-swap `filters` table (a model's or a peer's): the request body
//! rewritten before it reaches the server, as llama-swap rewrites it.

use std::collections::BTreeMap;

use serde_json::{Map, Value as Json};
use yaml_serde::Value;

/// `filters`: the request body rewritten before it reaches the server.
#[derive(Debug, Clone, Default)]
pub struct Filters {
    /// Removed, sorted (`model` never).
    pub strip: Vec<String>,
    pub set: Map<String, Json>,
    /// By the name the request used: set after `set`.
    pub by_id: BTreeMap<String, Map<String, Json>>,
}

impl Filters {
    pub(crate) fn from_yaml(id: &str, value: Option<&Value>) -> Result<Filters, String> {
        Self::read(Some(id), value)
    }

    /// A peer's `filters`: its `setParamsByID` keys as written (llama-swap
    /// expands no macro there).
    pub(crate) fn from_peer_yaml(value: Option<&Value>) -> Result<Filters, String> {
        Self::read(None, value)
    }

    fn read(id: Option<&str>, value: Option<&Value>) -> Result<Filters, String> {
        let Some(value) = value else {
            return Ok(Filters::default());
        };
        let json = serde_json::to_value(value).map_err(|e| format!("its `filters`: {e}"))?;
        let Json::Object(map) = json else {
            return Err("its `filters` is not a mapping".into());
        };
        let object = |key: &str| -> Result<Map<String, Json>, String> {
            match map.get(key) {
                None | Some(Json::Null) => Ok(Map::new()),
                Some(Json::Object(m)) => Ok(m.clone()),
                Some(_) => Err(format!("its `filters.{key}` is not a mapping")),
            }
        };
        let strip_text = match map.get("stripParams").or_else(|| map.get("strip_params")) {
            None | Some(Json::Null) => String::new(),
            Some(Json::String(s)) => s.clone(),
            Some(_) => return Err("its `filters.stripParams` is not a string".into()),
        };
        let mut strip: Vec<String> = strip_text
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty() && *p != "model")
            .map(str::to_string)
            .collect();
        strip.sort();
        strip.dedup();
        let mut set = object("setParams")?;
        set.remove("model");
        let mut by_id = BTreeMap::new();
        for (key, params) in object("setParamsByID")? {
            let Json::Object(mut params) = params else {
                return Err(format!(
                    "its `filters.setParamsByID.{key}` is not a mapping"
                ));
            };
            params.remove("model");
            // A model's keys are expanded as llama-swap expands them.
            let key = match id {
                Some(id) => key.replace("${MODEL_ID}", id),
                None => key,
            };
            if id.is_some() && key.contains("${") {
                return Err(format!(
                    "its `filters.setParamsByID` key `{key}` names a macro that is not defined"
                ));
            }
            by_id.insert(key, params);
        }
        for (key, _) in map.iter() {
            if !["stripParams", "strip_params", "setParams", "setParamsByID"]
                .contains(&key.as_str())
            {
                return Err(format!("its `filters` has an unknown key `{key}`"));
            }
        }
        Ok(Filters { strip, set, by_id })
    }

    pub fn is_empty(&self) -> bool {
        self.strip.is_empty() && self.set.is_empty() && self.by_id.is_empty()
    }

    /// Rewrites `body` as llama-swap does: strip, then `setParams`, then the
    /// entry for the name the request used (`requested`). Keys are paths,
    /// `a.b` a nested field.
    pub fn apply(&self, requested: &str, body: &mut Map<String, Json>) {
        for path in &self.strip {
            remove_path(body, path);
        }
        let mut keys: Vec<&String> = self.set.keys().collect();
        keys.sort();
        for key in keys {
            set_path(body, key, self.set[key].clone());
        }
        if let Some(params) = self.by_id.get(requested) {
            let mut keys: Vec<&String> = params.keys().collect();
            keys.sort();
            for key in keys {
                set_path(body, key, params[key].clone());
            }
        }
    }
}

fn remove_path(body: &mut Map<String, Json>, path: &str) {
    match path.split_once('.') {
        None => {
            body.remove(path);
        }
        Some((head, rest)) => {
            if let Some(Json::Object(inner)) = body.get_mut(head) {
                remove_path(inner, rest);
            }
        }
    }
}

fn set_path(body: &mut Map<String, Json>, path: &str, value: Json) {
    match path.split_once('.') {
        None => {
            body.insert(path.to_string(), value);
        }
        Some((head, rest)) => {
            let inner = body
                .entry(head.to_string())
                .or_insert_with(|| Json::Object(Map::new()));
            if !inner.is_object() {
                *inner = Json::Object(Map::new());
            }
            if let Json::Object(inner) = inner {
                set_path(inner, rest, value);
            }
        }
    }
}
