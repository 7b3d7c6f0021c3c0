//! The text of a llama-swap config: its size and nesting bounded before
//! it is parsed, its macros and `${env.VAR}` expanded as llama-swap does,
//! and `cmd` split as a shell would split it, without one.

use yaml_serde::{Mapping, Value};

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
pub(super) fn check_shape(text: &str) -> Result<(), String> {
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
pub(super) fn macros(value: Option<&Value>, what: &str) -> Result<Vec<(String, Value)>, String> {
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
pub(super) fn expand_env(
    value: &Value,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Value, String> {
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
pub(super) fn expand(value: &Value, macros: &[(String, Value)]) -> Result<Value, String> {
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
