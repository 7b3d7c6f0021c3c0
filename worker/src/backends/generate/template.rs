//! The text around the model: the ChatML prompt a conversation is rendered
//! into (with the default system prompt the file's template carries), and
//! the scan of generated text for stop strings that decides what may be
//! streamed yet.

use super::request::{Message, Role};

pub(super) const IM_START: &str = "<|im_start|>";
pub(super) const IM_END: &str = "<|im_end|>";

/// The ChatML chat format (`<|im_start|>role\ncontent<|im_end|>\n`), the only
/// one this backend renders. The model's Jinja template is not executed: it
/// is recognised, and its default system prompt taken out of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ChatMl {
    pub(super) default_system: Option<String>,
}

impl ChatMl {
    pub(super) fn from_template(template: &str) -> Result<Self, String> {
        if !template.contains(IM_START) {
            return Err(
                "its chat template is not ChatML (no `<|im_start|>`), the only format this backend renders"
                    .into(),
            );
        }
        Ok(ChatMl {
            default_system: default_system_prompt(template),
        })
    }

    pub(super) fn render(&self, messages: &[Message]) -> String {
        let mut out = String::new();
        let mut turn = |role: &str, content: &str| {
            out.push_str(IM_START);
            out.push_str(role);
            out.push('\n');
            out.push_str(content);
            out.push_str(IM_END);
            out.push('\n');
        };
        if let Some(system) = &self.default_system
            && messages.first().map(|m| m.role) != Some(Role::System)
        {
            turn(Role::System.as_str(), system);
        }
        for m in messages {
            turn(m.role.as_str(), &m.content);
        }
        out.push_str(IM_START);
        out.push_str(Role::Assistant.as_str());
        out.push('\n');
        out
    }
}

/// The system prompt a ChatML template inserts when the conversation has
/// none: a literal `<|im_start|>system\n...<|im_end|>` in the template. A
/// system turn built from an expression (quotes, braces) is not a default.
fn default_system_prompt(template: &str) -> Option<String> {
    let marker = format!("{IM_START}system");
    template.match_indices(&marker).find_map(|(at, _)| {
        let rest = &template[at + marker.len()..];
        let rest = rest
            .strip_prefix('\n')
            .or_else(|| rest.strip_prefix("\\n"))?;
        let (content, _) = rest.split_once(IM_END)?;
        if content.is_empty() || content.contains(['\'', '"', '{', '}']) {
            return None;
        }
        Some(content.replace("\\n", "\n"))
    })
}

/// How much of the text generated so far may be streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scan {
    /// A stop string begins at this byte offset: the text ends there.
    Stop(usize),
    /// `text[..end]` is final and may be sent.
    Safe(usize),
}

/// Scans `text`, of which `text[..emitted]` was already streamed.
///
/// Held back: a trailing U+FFFD (the decoder's stand-in for a UTF-8
/// sequence whose remaining bytes are in tokens not generated yet), and a
/// tail that could be the start of a stop string. Because such a tail is never
/// sent, a stop string can only begin at or after `emitted`.
pub(super) fn scan(text: &str, emitted: usize, stops: &[String]) -> Scan {
    let pending = text.get(emitted..).unwrap_or("");
    if let Some(at) = stops.iter().filter_map(|s| pending.find(s.as_str())).min() {
        return Scan::Stop(emitted + at);
    }
    let settled = pending.trim_end_matches('\u{FFFD}');
    let held = settled
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| {
            let tail = &settled[i..];
            stops.iter().any(|s| s.starts_with(tail))
        })
        .unwrap_or(settled.len());
    Scan::Safe(emitted + held)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn stops(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn scan_without_stops_sends_everything_but_a_broken_tail() {
        assert_eq!(scan("hello", 0, &[]), Scan::Safe(5));
        assert_eq!(scan("hello", 2, &[]), Scan::Safe(5));
        assert_eq!(scan("caf\u{FFFD}", 0, &[]), Scan::Safe(3));
        assert_eq!(scan("a\u{FFFD}b", 0, &[]), Scan::Safe(5));
    }

    #[test]
    fn scan_holds_back_a_possible_stop_start() {
        let s = stops(&["\nUser:", "END"]);
        assert_eq!(scan("answer\nUs", 0, &s), Scan::Safe(6));
        assert_eq!(scan("answer E", 0, &s), Scan::Safe(7));
        assert_eq!(scan("answer\nUx", 0, &s), Scan::Safe(9));
        // A held tail is re-examined from where streaming stopped.
        assert_eq!(scan("answer\nUser", 6, &s), Scan::Safe(6));
    }

    #[test]
    fn scan_finds_the_earliest_stop_after_the_sent_text() {
        let s = stops(&["b", "cd"]);
        assert_eq!(scan("xxcdab", 0, &s), Scan::Stop(2));
        assert_eq!(scan("xx\nUser: hi", 2, &stops(&["\nUser:"])), Scan::Stop(2));
        assert_eq!(scan("é stop", 0, &stops(&["stop"])), Scan::Stop(3));
    }

    #[test]
    fn scan_concatenation_equals_the_text() {
        // Feed growing prefixes as a decoder would and rebuild the stream.
        let full = "Hello wörld, 漢字 and more END trailing";
        let s = stops(&["END"]);
        let mut emitted = 0;
        let mut streamed = String::new();
        let mut result = None;
        for (i, _) in full.char_indices().skip(1).chain([(full.len(), ' ')]) {
            let text = &full[..i];
            match scan(text, emitted, &s) {
                Scan::Stop(at) => {
                    streamed.push_str(&text[emitted..at]);
                    result = Some(text[..at].to_string());
                    break;
                }
                Scan::Safe(end) => {
                    streamed.push_str(&text[emitted..end]);
                    emitted = end;
                }
            }
        }
        assert_eq!(result.as_deref(), Some("Hello wörld, 漢字 and more "));
        assert_eq!(streamed, "Hello wörld, 漢字 and more ");
    }

    #[test]
    fn chatml_adds_the_templates_default_system_prompt() {
        let chat = ChatMl::from_template(SMOLLM2_TEMPLATE).unwrap();
        assert_eq!(
            chat.default_system.as_deref(),
            Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
        );
        let user = [Message {
            role: Role::User,
            content: "Hi".into(),
        }];
        assert_eq!(
            chat.render(&user),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn chatml_keeps_the_callers_system_prompt() {
        let chat = ChatMl::from_template(SMOLLM2_TEMPLATE).unwrap();
        let messages = [
            Message {
                role: Role::System,
                content: "Be brief.".into(),
            },
            Message {
                role: Role::User,
                content: "Hi".into(),
            },
            Message {
                role: Role::Assistant,
                content: "Hello.".into(),
            },
            Message {
                role: Role::User,
                content: "Bye".into(),
            },
        ];
        assert_eq!(
            chat.render(&messages),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn chatml_without_a_literal_system_prompt_adds_none() {
        let template = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}";
        let chat = ChatMl::from_template(template).unwrap();
        assert_eq!(chat.default_system, None);
        let escaped = "{{ '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}";
        assert_eq!(
            default_system_prompt(escaped).as_deref(),
            Some("You are Qwen.")
        );
        let expression = "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>' }}";
        assert_eq!(default_system_prompt(expression), None);
    }

    #[test]
    fn a_template_that_is_not_chatml_is_refused() {
        let llama3 = "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{% endfor %}";
        let err = ChatMl::from_template(llama3).unwrap_err();
        assert!(err.contains("not ChatML"), "{err}");
    }
}
