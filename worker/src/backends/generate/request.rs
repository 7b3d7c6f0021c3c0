//! Request bodies: the JSON a client sends, parsed and checked into chat
//! messages (or a raw prompt), generation settings and stop strings, so
//! that decoding only ever sees a valid request.

use serde::Deserialize;

/// Generation settings: the model's defaults, overridden per request.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Settings {
    pub(super) max_tokens: usize,
    pub(super) temperature: f64,
    pub(super) top_p: Option<f64>,
    /// `None`: a fresh seed per request, so sampled answers vary.
    pub(super) seed: Option<u64>,
}

impl Settings {
    pub(super) fn check(&self) -> Result<(), String> {
        if self.max_tokens == 0 {
            return Err("`max_tokens` must be at least 1".into());
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "`temperature` must be a number >= 0 (0 = greedy), not {}",
                self.temperature
            ));
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(format!("`top_p` must be in (0, 1], not {p}"));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Message {
    pub(super) role: Role,
    pub(super) content: String,
}

/// What the model continues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Prompt {
    /// A conversation, rendered through the model's chat template.
    Chat(Vec<Message>),
    /// Text fed as it is, no template: OpenAI's legacy completions.
    Raw(String),
}

/// A parsed, validated request.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Request {
    pub(super) prompt: Prompt,
    pub(super) settings: Settings,
    pub(super) stop: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequest {
    input: Option<String>,
    prompt: Option<String>,
    raw_prompt: Option<String>,
    messages: Option<Vec<RawMessage>>,
    max_tokens: Option<usize>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<u64>,
    stop: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct RawMessage {
    role: String,
    content: RawContent,
}

/// A message's content: a string, or OpenAI's array of content parts.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawContent {
    Text(String),
    Parts(Vec<RawPart>),
}

#[derive(Deserialize)]
struct RawPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

impl RawContent {
    fn into_text(self, message: usize) -> Result<String, String> {
        match self {
            RawContent::Text(text) => Ok(text),
            RawContent::Parts(parts) => parts
                .into_iter()
                .map(|p| match (p.kind.as_str(), p.text) {
                    ("text", Some(text)) => Ok(text),
                    (kind, _) => Err(format!(
                        "message {message} has a `{kind}` content part; this model takes text only"
                    )),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|texts| texts.concat()),
        }
    }
}

/// Parses a request body; the error is the message for a `BadRequest`.
pub(super) fn parse_request(json: &str, defaults: &Settings) -> Result<Request, String> {
    let raw: RawRequest = serde_json::from_str(json).map_err(|e| {
        if e.is_data() {
            format!("bad request: {e}")
        } else {
            format!("the request is not valid JSON: {e}")
        }
    })?;
    let prompt = match (raw.input, raw.prompt, raw.raw_prompt, raw.messages) {
        (Some(text), None, None, None) | (None, Some(text), None, None) => {
            if text.trim().is_empty() {
                return Err("the input is empty".into());
            }
            Prompt::Chat(vec![Message {
                role: Role::User,
                content: text,
            }])
        }
        (None, None, Some(text), None) => {
            if text.is_empty() {
                return Err("the prompt is empty".into());
            }
            Prompt::Raw(text)
        }
        (None, None, None, Some(raw)) => {
            if raw.is_empty() {
                return Err("`messages` is empty".into());
            }
            let mut messages = Vec::with_capacity(raw.len());
            for (i, m) in raw.into_iter().enumerate() {
                let role = match m.role.as_str() {
                    "system" => Role::System,
                    "user" => Role::User,
                    "assistant" => Role::Assistant,
                    other => {
                        return Err(format!(
                            "message {i} has role `{other}` (roles: system, user, assistant)"
                        ));
                    }
                };
                messages.push(Message {
                    role,
                    content: m.content.into_text(i)?,
                });
            }
            if messages.iter().all(|m| m.content.trim().is_empty()) {
                return Err("every message is empty".into());
            }
            Prompt::Chat(messages)
        }
        (None, None, None, None) => {
            return Err(
                "the request has no text: send {\"input\": TEXT} or {\"messages\": [...]}".into(),
            );
        }
        _ => {
            return Err("send only one of `input`, `prompt`, `raw_prompt` and `messages`".into());
        }
    };
    let settings = Settings {
        max_tokens: raw.max_tokens.unwrap_or(defaults.max_tokens),
        temperature: raw.temperature.unwrap_or(defaults.temperature),
        top_p: raw.top_p.or(defaults.top_p),
        seed: raw.seed.or(defaults.seed),
    };
    settings.check()?;
    let stop = match raw.stop {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::String(s)) => vec![s],
        Some(serde_json::Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                serde_json::Value::String(s) => Ok(s),
                other => Err(format!("`stop` holds {other}, not a string")),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(format!(
                "`stop` must be a string or an array of strings, not {other}"
            ));
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err("a `stop` string is empty".into());
    }
    Ok(Request {
        prompt,
        settings,
        stop,
    })
}

#[cfg(test)]
mod tests {
    use super::super::DEFAULT_MAX_TOKENS;
    use super::*;

    fn defaults() -> Settings {
        Settings {
            max_tokens: DEFAULT_MAX_TOKENS,
            temperature: 0.0,
            top_p: None,
            seed: None,
        }
    }

    #[test]
    fn requests_parse_into_messages_and_settings() {
        let r = parse_request(r#"{"input": "What is 2 + 3?"}"#, &defaults()).unwrap();
        assert_eq!(
            r.prompt,
            Prompt::Chat(vec![Message {
                role: Role::User,
                content: "What is 2 + 3?".into()
            }])
        );
        assert_eq!(r.settings, defaults());
        assert!(r.stop.is_empty());

        let r = parse_request(
            r#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["a", "b"]}"#,
            &defaults(),
        )
        .unwrap();
        let Prompt::Chat(messages) = &r.prompt else {
            panic!("{:?}", r.prompt)
        };
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[0].role, Role::System);
        assert_eq!(
            r.settings,
            Settings {
                max_tokens: 5,
                temperature: 0.7,
                top_p: Some(0.9),
                seed: Some(1)
            }
        );
        assert_eq!(r.stop, ["a", "b"]);

        let r = parse_request(r#"{"prompt": "x", "stop": "\n"}"#, &defaults()).unwrap();
        assert_eq!(r.stop, ["\n"]);
        // A raw prompt is kept as it is, leading space and newline included.
        let r = parse_request(r#"{"raw_prompt": " Once upon\n"}"#, &defaults()).unwrap();
        assert_eq!(r.prompt, Prompt::Raw(" Once upon\n".into()));
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let err = |json: &str| parse_request(json, &defaults()).unwrap_err();
        assert!(err("{").contains("not valid JSON"));
        assert!(err("[]").contains("bad request"));
        assert!(err(r#"{"input": ""}"#).contains("empty"));
        assert!(err(r#"{"prompt": "  \n"}"#).contains("empty"));
        assert!(err(r#"{"messages": []}"#).contains("`messages` is empty"));
        assert!(err(r#"{"messages": [{"role": "user", "content": ""}]}"#).contains("empty"));
        assert!(err(r#"{"messages": [{"role": "tool", "content": "x"}]}"#).contains("`tool`"));
        assert!(err(r#"{"messages": [{"role": "user"}]}"#).contains("content"));
        assert!(err("{}").contains("no text"));
        assert!(err(r#"{"input": "a", "messages": []}"#).contains("only one"));
        assert!(err(r#"{"raw_prompt": "a", "prompt": "b"}"#).contains("only one"));
        assert!(err(r#"{"raw_prompt": ""}"#).contains("empty"));
        assert!(err(r#"{"input": "a", "max_token": 3}"#).contains("max_token"));
        assert!(err(r#"{"input": "a", "max_tokens": 0}"#).contains("max_tokens"));
        assert!(err(r#"{"input": "a", "max_tokens": -1}"#).contains("bad request"));
        assert!(err(r#"{"input": "a", "temperature": -1}"#).contains("temperature"));
        assert!(err(r#"{"input": "a", "top_p": 0}"#).contains("top_p"));
        assert!(err(r#"{"input": "a", "top_p": 1.5}"#).contains("top_p"));
        assert!(err(r#"{"input": "a", "stop": 3}"#).contains("`stop`"));
        assert!(err(r#"{"input": "a", "stop": ["x", 3]}"#).contains("`stop`"));
        assert!(err(r#"{"input": "a", "stop": [""]}"#).contains("empty"));
    }
}
