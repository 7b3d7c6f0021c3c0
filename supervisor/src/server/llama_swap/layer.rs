//! What a llama-swap config asks of the front door, kept at run time: each
//! model's listing and filters, the profiles (one active at a time) and the
//! selectors, resolved per request as llama-swap's current code does.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use serde_json::{Map, Value as Json, json};

pub use super::filters::Filters;

/// How a model shows in `/v1/models`.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    /// Its llama-swap ID.
    pub id: String,
    pub name: Option<String>,
    pub description: Option<String>,
    pub metadata: Option<Json>,
    pub capabilities: Option<Json>,
    pub unlisted: bool,
    pub aliases: Vec<String>,
}

/// A profile: names a request may use, pinned to a model (or a selector);
/// `None` turns the name off.
#[derive(Debug, Clone, Default)]
pub struct Profile {
    pub description: String,
    pub pins: BTreeMap<String, Option<String>>,
}

/// How a selector picks its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// The first target.
    Pin,
    /// The first ready target, else the first loading, else the first.
    Warm,
    /// The least busy target in use while it has fewer than this many
    /// requests in flight, else the first one not in use.
    Spillover(usize),
}

/// A selector: a name resolved per request to one of its targets.
#[derive(Debug, Clone)]
pub struct Selector {
    pub strategy: Strategy,
    /// Model IDs or aliases, as written.
    pub targets: Vec<String>,
    pub name: Option<String>,
    pub description: Option<String>,
    pub metadata: Option<Json>,
    pub unlisted: bool,
}

/// A model's extras, by its berth name.
#[derive(Debug, Clone, Default)]
pub struct Extras {
    pub listing: Listing,
    pub filters: Filters,
    pub loading_state: bool,
}

/// The llama-swap layer of the front door.
#[derive(Debug, Default)]
pub struct Compat {
    pub models: BTreeMap<String, Extras>,
    pub profiles: BTreeMap<String, Profile>,
    pub selectors: BTreeMap<String, Selector>,
    pub include_aliases: bool,
    /// Models other servers serve (`peers`).
    pub peers: super::peers::Peers,
    /// Requests in flight, for `/api/inflight/{id}/cancel`.
    pub inflight: super::inflight::Inflight,
    /// `upstream.ignorePaths`: `/upstream` paths that never load a model.
    pub ignore_paths: Vec<regex::Regex>,
    active: Mutex<Option<String>>,
    /// Requests in flight through each selector, per target.
    spilled: Arc<Mutex<HashMap<(String, String), usize>>>,
}

/// A selector's request in flight to a target; dropped when its answer ends.
#[derive(Debug)]
pub struct Spill {
    key: (String, String),
    counts: Arc<Mutex<HashMap<(String, String), usize>>>,
}

impl Drop for Spill {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = counts.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

impl Compat {
    pub fn new(
        models: BTreeMap<String, Extras>,
        profiles: BTreeMap<String, Profile>,
        selectors: BTreeMap<String, Selector>,
        include_aliases: bool,
    ) -> Compat {
        Compat {
            models,
            profiles,
            selectors,
            include_aliases,
            ..Compat::default()
        }
    }

    pub fn active_profile(&self) -> Option<String> {
        self.active
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Makes `name` the active profile (`None`: none); `Err` if there is no
    /// such profile.
    pub fn set_active(&self, name: Option<&str>) -> Result<(), String> {
        if let Some(name) = name
            && !self.profiles.contains_key(name)
        {
            return Err(format!("profile \"{name}\" not found"));
        }
        *self.active.lock().unwrap_or_else(|e| e.into_inner()) = name.map(str::to_string);
        Ok(())
    }

    /// The active profile's pin for `requested`: `Some(None)` turns it off.
    pub fn pin(&self, requested: &str) -> Option<Option<String>> {
        let active = self.active_profile()?;
        self.profiles.get(&active)?.pins.get(requested).cloned()
    }

    /// `selector`'s pick; `state` says of a target whether it is ready
    /// (`Some(true)`), loading (`Some(false)`), stopping (`None` with
    /// `stopping`) or not running.
    pub fn select(
        &self,
        selector: &str,
        state: &dyn Fn(&str) -> TargetState,
    ) -> Result<Picked, String> {
        let s = &self.selectors[selector];
        // One lock for the pick and its count: concurrent requests see each
        // other's.
        let mut counts = self.spilled.lock().unwrap_or_else(|e| e.into_inner());
        let target = match s.strategy {
            Strategy::Pin => s.targets[0].clone(),
            Strategy::Warm => s
                .targets
                .iter()
                .find(|t| state(t) == TargetState::Ready)
                .or_else(|| s.targets.iter().find(|t| state(t) == TargetState::Starting))
                .unwrap_or(&s.targets[0])
                .clone(),
            Strategy::Spillover(limit) => {
                let count = |t: &String| {
                    counts
                        .get(&(selector.to_string(), t.clone()))
                        .copied()
                        .unwrap_or(0)
                };
                let mut active = Vec::new();
                let mut cold = Vec::new();
                for t in &s.targets {
                    match state(t) {
                        TargetState::Stopping => {}
                        TargetState::Ready | TargetState::Starting => active.push(t),
                        TargetState::Idle if count(t) > 0 => active.push(t),
                        TargetState::Idle => cold.push(t),
                    }
                }
                let least = active.iter().min_by_key(|t| count(t)).copied();
                match (least, cold.first()) {
                    (None, Some(c)) => (*c).clone(),
                    (None, None) => {
                        return Err(format!(
                            "selector \"{selector}\" has no available spillover targets"
                        ));
                    }
                    (Some(l), _) if count(l) < limit => l.clone(),
                    (Some(_), Some(c)) => (*c).clone(),
                    (Some(l), None) => l.clone(),
                }
            }
        };
        let spill = matches!(s.strategy, Strategy::Spillover(_)).then(|| {
            let key = (selector.to_string(), target.clone());
            *counts.entry(key.clone()).or_insert(0) += 1;
            Spill {
                key,
                counts: Arc::clone(&self.spilled),
            }
        });
        Ok(Picked { target, spill })
    }

    /// `/api/profiles`.
    pub fn profiles_json(&self) -> Json {
        let profiles: Vec<Json> = self
            .profiles
            .iter()
            .map(|(id, p)| {
                let pins: Map<String, Json> = p
                    .pins
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone().map(Json::String).unwrap_or(Json::Null)))
                    .collect();
                json!({"id": id, "description": p.description, "pins": pins})
            })
            .collect();
        json!({"active": self.active_profile(), "profiles": profiles})
    }
}

/// A selector's target, as the supervisor has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetState {
    Ready,
    Starting,
    Stopping,
    Idle,
}

/// A selector's pick, and its place in the spillover count.
#[derive(Debug)]
pub struct Picked {
    pub target: String,
    pub spill: Option<Spill>,
}

/// `capabilities` rendered as llama-swap renders them in `/v1/models`.
pub fn render_capabilities(caps: &Json, record: &mut Map<String, Json>) {
    let list = |key: &str| -> Vec<String> {
        caps.get(key)
            .and_then(Json::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Json::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    };
    let (inputs, outputs) = (list("in"), list("out"));
    let has = |v: &[String], m: &str| v.iter().any(|x| x == m);
    if !inputs.is_empty() || !outputs.is_empty() {
        let mut arch = json!({"input_modalities": inputs, "output_modalities": outputs});
        if !inputs.is_empty() && !outputs.is_empty() {
            arch["modality"] = json!(format!("{}->{}", inputs.join("+"), outputs.join("+")));
        }
        record.insert("architecture".into(), arch);
    }
    let tools = caps.get("tools").and_then(Json::as_bool).unwrap_or(false);
    let mut flags = Map::new();
    for (flag, on) in [
        ("vision", has(&inputs, "image")),
        (
            "audio_transcriptions",
            has(&inputs, "audio") && has(&outputs, "text"),
        ),
        (
            "audio_speech",
            has(&inputs, "text") && has(&outputs, "audio"),
        ),
        (
            "image_generation",
            has(&inputs, "text") && has(&outputs, "image"),
        ),
        (
            "image_to_image",
            has(&inputs, "image") && has(&outputs, "image"),
        ),
        ("function_calling", tools),
        (
            "reranker",
            caps.get("reranker")
                .and_then(Json::as_bool)
                .unwrap_or(false),
        ),
    ] {
        if on {
            flags.insert(flag.into(), Json::Bool(true));
        }
    }
    if !flags.is_empty() {
        record.insert("capabilities".into(), Json::Object(flags));
    }
    if tools {
        record.insert(
            "supported_parameters".into(),
            json!(["tools", "tool_choice"]),
        );
    }
    if let Some(context) = caps
        .get("context")
        .and_then(Json::as_u64)
        .filter(|c| *c > 0)
    {
        record.insert("context_length".into(), json!(context));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_strip_then_set_then_set_by_the_name_used() {
        let yaml: yaml_serde::Value = yaml_serde::from_str(
            "stripParams: \"temperature, top_p, model\"\nsetParams:\n  temperature: 0.7\n  a.b: 1\nsetParamsByID:\n  m:high:\n    chat_template_kwargs:\n      reasoning_effort: high\n",
        )
        .unwrap();
        let filters = Filters::from_yaml("m", Some(&yaml)).unwrap();
        assert_eq!(filters.strip, ["temperature", "top_p"]);
        let mut body = json!({"model": "m:high", "temperature": 0.1, "top_p": 0.5, "x": 1})
            .as_object()
            .unwrap()
            .clone();
        filters.apply("m:high", &mut body);
        assert_eq!(
            Json::Object(body),
            json!({"model": "m:high", "temperature": 0.7, "x": 1, "a": {"b": 1},
                   "chat_template_kwargs": {"reasoning_effort": "high"}})
        );
    }

    #[test]
    fn selectors_pick_as_llama_swap_does() {
        let selector = |strategy| Selector {
            strategy,
            targets: vec!["a".into(), "b".into()],
            name: None,
            description: None,
            metadata: None,
            unlisted: false,
        };
        let compat = Compat::new(
            BTreeMap::new(),
            BTreeMap::new(),
            BTreeMap::from([
                ("p".into(), selector(Strategy::Pin)),
                ("w".into(), selector(Strategy::Warm)),
                ("s".into(), selector(Strategy::Spillover(2))),
            ]),
            false,
        );
        let b_ready = |t: &str| {
            if t == "b" {
                TargetState::Ready
            } else {
                TargetState::Idle
            }
        };
        assert_eq!(compat.select("p", &b_ready).unwrap().target, "a");
        assert_eq!(compat.select("w", &b_ready).unwrap().target, "b");
        // b is in use: it takes two, then a cold one starts.
        let one = compat.select("s", &b_ready).unwrap();
        let two = compat.select("s", &b_ready).unwrap();
        let three = compat.select("s", &b_ready).unwrap();
        assert_eq!(
            (
                one.target.as_str(),
                two.target.as_str(),
                three.target.as_str()
            ),
            ("b", "b", "a")
        );
        drop((one, two));
        assert_eq!(compat.select("s", &b_ready).unwrap().target, "b");
    }
}
