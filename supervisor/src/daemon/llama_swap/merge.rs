//! Several llama-swap files as one (`-config` and `-config-dir`, berth's
//! `--llama-swap` and `--llama-swap-dir`), merged as llama-swap's
//! `internal/config/merge.go` merges them, before any macro is expanded
//! (so a file's macro serves every file's models):
//! - `models`, `groups`, `profiles`, `selectors`, `peers`, `matrix` and
//!   `routing.router.settings.groups|matrix` are maps of names: a name
//!   defined in two files is an error;
//! - any other mapping is merged key by key, lists are joined (the earlier
//!   file's first), a scalar set twice must be set alike (or be empty in
//!   one of them).

use yaml_serde::{Mapping, Value};

/// Maps whose keys each name one thing, defined in one file only.
const IDENTITY: &[&str] = &[
    "models",
    "groups",
    "profiles",
    "selectors",
    "peers",
    "matrix",
    "routing.router.settings.groups",
    "routing.router.settings.matrix",
];

/// `files` (each file's label and its parsed root, in order) merged; an
/// empty file is skipped.
pub(super) fn merge(files: Vec<(String, Value)>) -> Result<Value, String> {
    let mut merged = Mapping::new();
    let mut any = false;
    for (file, root) in files {
        match root {
            Value::Null => continue,
            Value::Mapping(map) => {
                any = true;
                into(&mut merged, map, "", &file)?;
            }
            _ => return Err(format!("config {file}: top-level YAML must be a mapping")),
        }
    }
    if !any {
        return Err("no configuration sources found (every file is empty)".into());
    }
    Ok(Value::Mapping(merged))
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "nothing",
        Value::Bool(_) | Value::Number(_) | Value::String(_) => "a value",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

fn into(dst: &mut Mapping, src: Mapping, path: &str, file: &str) -> Result<(), String> {
    for (key, value) in src {
        let name = key.as_str().map(str::to_string).unwrap_or_else(|| {
            yaml_serde::to_string(&key)
                .unwrap_or_default()
                .trim()
                .to_string()
        });
        let here = if path.is_empty() {
            name.clone()
        } else {
            format!("{path}.{name}")
        };
        let Some(old) = dst.get_mut(&key) else {
            dst.insert(key, value);
            continue;
        };
        if IDENTITY.contains(&here.as_str()) {
            let (Value::Mapping(old), Value::Mapping(new)) = (&mut *old, value) else {
                return Err(format!(
                    "conflict at {here:?}: expected a mapping, introduced by {file}"
                ));
            };
            for (child, v) in new {
                if old.contains_key(&child) {
                    let child = child.as_str().unwrap_or("?");
                    return Err(format!(
                        "duplicate {here} {child:?} found in {file} (already defined in another \
                         config source)"
                    ));
                }
                old.insert(child, v);
            }
            continue;
        }
        match (&mut *old, value) {
            (Value::Mapping(old), Value::Mapping(new)) => into(old, new, &here, file)?,
            (Value::Sequence(old), Value::Sequence(new)) => old.extend(new),
            (_, Value::Null) => {}
            (old @ Value::Null, new) => *old = new,
            (old, new) if kind(old) == "a value" && kind(&new) == "a value" => {
                if *old != new {
                    return Err(format!(
                        "conflict at {here:?}: {file} sets a different value than a previous \
                         source"
                    ));
                }
            }
            (old, new) => {
                return Err(format!(
                    "conflict at {here:?}: {} in one file, {} in {file}",
                    kind(old),
                    kind(&new)
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(text: &str) -> Value {
        yaml_serde::from_str(text).unwrap()
    }

    #[test]
    fn files_merge_as_llama_swaps_merge_go_does() {
        let merged = merge(vec![
            (
                "a.yaml".into(),
                yaml("macros: {ctx: 4096}\napiKeys: [k1]\nmodels: {a: {cmd: x}}\nhealthCheckTimeout: 60"),
            ),
            ("empty.yaml".into(), Value::Null),
            (
                "b.yaml".into(),
                yaml("macros: {base: y}\napiKeys: [k2]\nmodels: {b: {cmd: y}}\nhealthCheckTimeout: 60"),
            ),
        ])
        .unwrap();
        assert_eq!(
            merged,
            yaml(
                "macros: {ctx: 4096, base: y}\napiKeys: [k1, k2]\nmodels: {a: {cmd: x}, b: {cmd: y}}\nhealthCheckTimeout: 60"
            )
        );
    }

    #[test]
    fn a_name_defined_twice_or_a_value_set_two_ways_is_refused() {
        let twice = merge(vec![
            ("a.yaml".into(), yaml("models: {m: {cmd: x}}")),
            ("b.yaml".into(), yaml("models: {m: {cmd: y}}")),
        ]);
        assert_eq!(
            twice.unwrap_err(),
            "duplicate models \"m\" found in b.yaml (already defined in another config source)"
        );
        let routing = merge(vec![
            (
                "a.yaml".into(),
                yaml("routing: {router: {settings: {groups: {g: {members: [a]}}}}}"),
            ),
            (
                "b.yaml".into(),
                yaml("routing: {router: {settings: {groups: {g: {members: [b]}}}}}"),
            ),
        ]);
        assert!(
            routing
                .unwrap_err()
                .starts_with("duplicate routing.router.settings.groups \"g\"")
        );
        let scalar = merge(vec![
            ("a.yaml".into(), yaml("globalTTL: 60")),
            ("b.yaml".into(), yaml("globalTTL: 30")),
        ]);
        assert_eq!(
            scalar.unwrap_err(),
            "conflict at \"globalTTL\": b.yaml sets a different value than a previous source"
        );
        let list = merge(vec![("a.yaml".into(), yaml("- a"))]);
        assert_eq!(
            list.unwrap_err(),
            "config a.yaml: top-level YAML must be a mapping"
        );
    }
}
