//! The config file's parsing and checks.

use super::*;

#[test]
fn a_config_with_human_units_parses() {
    let config: ServeConfig = toml::from_str(
        r#"
        listen = "127.0.0.1:9000"
        memory_budget = "2GiB"
        keep_alive = "5m"
        [[model]]
        name = "hog"
        backend = "hog"
        keep_alive = "1s"
        memory_limit = "512MiB"
        options = { alloc_mib = 64, verbose = true }
        "#,
    )
    .unwrap();
    assert_eq!(config.memory_budget, Some(2 << 30));
    assert_eq!(config.keep_alive, Some(Duration::from_secs(300)));
    let hog = &config.models[0];
    assert_eq!(hog.keep_alive, Some(Duration::from_secs(1)));
    assert_eq!(hog.memory_limit, Some(512 << 20));
    assert_eq!(hog.options["alloc_mib"], "64");
    assert_eq!(hog.options["verbose"], "true");
}

#[test]
fn a_relative_model_path_is_taken_inside_models_dir() {
    let dir = std::env::temp_dir().join(format!("berth-config-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("weights")).unwrap();
    let file = dir.join("serve.toml");
    std::fs::write(
        &file,
        format!(
            "models_dir = \"{}\"\n[[model]]\nname = \"a\"\nbackend = \"echo\"\nmodel = \"weights\"\n\
             [[model]]\nname = \"b\"\nbackend = \"echo\"\nmodel = \"{}\"\n",
            dir.display(),
            dir.join("weights").display()
        ),
    )
    .unwrap();
    let config = ServeConfig::from_file(&file).unwrap();
    assert_eq!(
        config.models[0].model.as_deref(),
        Some(&*dir.join("weights"))
    );
    assert_eq!(
        config.models[1].model.as_deref(),
        Some(&*dir.join("weights"))
    );
    // Missing inside models_dir: named with the full path.
    std::fs::write(
        &file,
        format!(
            "models_dir = \"{}\"\n[[model]]\nname = \"a\"\nbackend = \"echo\"\nmodel = \"nope\"\n",
            dir.display()
        ),
    )
    .unwrap();
    let err = ServeConfig::from_file(&file).unwrap_err();
    assert!(
        err.contains(&dir.join("nope").display().to_string()),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_keys_are_refused() {
    let err = toml::from_str::<ServeConfig>("lisen = \"x\"").unwrap_err();
    assert!(err.to_string().contains("lisen"), "{err}");
}

#[test]
fn out_of_range_settings_name_the_field() {
    for (text, field) in [
        ("keep_alive = 1e19", "keep_alive"),
        ("drain_timeout = \"100000000000s\"", "drain_timeout"),
        ("memory_budget = \"1000000TiB\"", "memory_budget"),
        ("max_connections = 0", "max_connections"),
        ("token = \"  \"", "token"),
        ("max_body = 1", "max_body"),
        ("answer_spin = \"2ms\"", "answer_spin"),
        ("[[model]]\nname = \"..\"\nbackend = \"echo\"", "model name"),
        (
            "[[model]]\nname = \"m\"\nbackend = \"echo\"\nkeep_alive = 1e19",
            "keep_alive",
        ),
        (
            "[[model]]\nname = \"m\"\nbackend = \"echo\"\nmax_concurrency = 99999999",
            "max_concurrency",
        ),
    ] {
        let err = match toml::from_str::<ServeConfig>(text) {
            Ok(config) => config.check().unwrap_err(),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(field), "{text}: {err}");
    }
}

/// A property test without a framework: a fixed-seed generator feeds
/// every duration and size field extreme and random values, in a TOML
/// config and in an HTTP registration body. Nothing panics; a value that
/// is accepted is in range; one that is refused is refused naming its
/// field.
#[test]
fn every_duration_and_size_field_survives_random_extremes() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let model_fields = [
        ("keep_alive", true),
        ("load_timeout", true),
        ("stall_timeout", true),
        ("restart_window", true),
        ("memory_limit", false),
        ("max_rss", false),
        ("vram", false),
    ];
    let top_fields = [
        ("keep_alive", true),
        ("load_timeout", true),
        ("drain_timeout", true),
        ("restart_backoff", true),
        ("header_timeout", true),
        ("body_timeout", true),
        ("send_timeout", true),
        ("memory_budget", false),
        ("gpu_memory_budget", false),
        ("max_response", false),
        ("max_body_total", false),
        ("answer_spin", true),
    ];
    let units = [
        "", "s", "ms", "m", "h", "d", "y", "KiB", "MiB", "GiB", "TiB", "GB", "parsecs",
    ];
    for case in 0..4000 {
        let r = next();
        // A JSON/TOML number or a string, from tiny to absurd.
        let exponent = (r % 400) as i32 - 60;
        let mantissa = (next() % 10_000) as f64 / 1000.0;
        let sign = if r % 7 == 0 { -1.0 } else { 1.0 };
        let number = sign * mantissa * 10f64.powi(exponent);
        let text = match case % 5 {
            0 => format!("{number}"),
            1 => format!(
                "{}{}",
                number.abs(),
                units[(next() % units.len() as u64) as usize]
            ),
            2 => ["NaN", "inf", "-inf", "1e400", "18446744073709551616", ""][(next() % 6) as usize]
                .to_string(),
            3 => format!("{}", next()),
            _ => format!(
                "{}{}",
                next() % 1000,
                units[(next() % units.len() as u64) as usize]
            ),
        };
        let as_toml = if case % 2 == 0 && number.is_finite() && !number.is_nan() {
            format!("{number:e}")
        } else {
            format!("{text:?}")
        };
        let as_json: serde_json::Value = if case % 2 == 0 {
            serde_json::Number::from_f64(number)
                .map_or(serde_json::json!(text), serde_json::Value::Number)
        } else {
            serde_json::json!(text)
        };
        let (field, is_duration) = model_fields[(next() % model_fields.len() as u64) as usize];
        // Over HTTP: the registration body.
        let body = serde_json::json!({ "backend": "echo", field: as_json.clone() });
        match crate::server::management::spec_from("m", body.to_string().as_bytes())
            .map_err(|e| e.message)
            .and_then(|spec| spec.validate().map(|()| spec).map_err(|e| e.to_string()))
        {
            Ok(spec) => {
                let ok = if is_duration {
                    [
                        spec.keep_alive,
                        spec.load_timeout,
                        spec.stall_timeout,
                        spec.restart_window,
                    ]
                    .iter()
                    .flatten()
                    .all(|d| *d <= crate::config::MAX_DURATION)
                } else {
                    [spec.memory_limit, spec.max_rss, spec.vram]
                        .iter()
                        .flatten()
                        .all(|b| *b <= crate::config::MAX_BYTES)
                };
                assert!(ok, "{field} = {as_json} accepted out of range");
            }
            Err(message) => assert!(message.contains(field), "{field} = {as_json}: {message}"),
        }
        // In the TOML, at the top and in a model.
        let (top, _) = top_fields[(next() % top_fields.len() as u64) as usize];
        for text in [
            format!("{top} = {as_toml}\n"),
            format!("[[model]]\nname = \"m\"\nbackend = \"echo\"\n{field} = {as_toml}\n"),
        ] {
            let name = if text.starts_with('[') { field } else { top };
            match toml::from_str::<ServeConfig>(&text) {
                Ok(config) => {
                    if let Err(message) = config.check() {
                        assert!(message.contains(name), "{text}: {message}");
                    }
                }
                Err(e) => assert!(e.to_string().contains(name), "{text}: {e}"),
            }
        }
    }
}

/// Rules the budgets cannot hold are an error at start, naming them.
#[test]
fn groups_and_sets_must_fit_the_budgets() {
    let config = |extra: &str| -> Result<(), String> {
        let text = format!(
            "max_loaded = 2\nmemory_budget = \"1GiB\"\n{extra}\n\
             [[model]]\nname = \"a\"\nbackend = \"echo\"\nmemory_limit = \"600MiB\"\n\
             [[model]]\nname = \"b\"\nbackend = \"echo\"\nmemory_limit = \"600MiB\"\n\
             [[model]]\nname = \"c\"\nbackend = \"echo\"\n"
        );
        toml::from_str::<ServeConfig>(&text).unwrap().check()
    };
    assert!(config("").is_ok());
    let err = config("[groups.all]\nmembers = [\"a\", \"b\", \"c\"]\nswap = false").unwrap_err();
    assert!(
        err.contains("group `all` lets 3 models run together, past max_loaded 2"),
        "{err}"
    );
    let err = config("[matrix]\nsets = [{ name = \"s\", expr = \"a & b\" }]").unwrap_err();
    assert!(err.contains("memory limits add up to 1200.0 MiB"), "{err}");
    // One that swaps runs one at a time: it fits.
    assert!(config("[groups.all]\nmembers = [\"a\", \"b\", \"c\"]").is_ok());
    let err = config("[groups.x]\nmembers = [\"ghost\"]").unwrap_err();
    assert!(err.contains("names model `ghost`"), "{err}");
}

#[test]
fn a_bad_value_is_said_by_its_line_model_and_key() {
    let text = "[server]\nlisten = \"127.0.0.1:1\"\n\n[[model]]\nname = \"a\"\nbackend = \"echo\"\nmemory_limit = -5\n";
    let e = ServeConfig::parse(text, std::path::Path::new("b.toml")).unwrap_err();
    assert!(
        e.contains("line 7, [[model]] `a`, `memory_limit`: `-5` is not a size (a whole number of bytes from 0"),
        "{e}"
    );
    assert!(e.contains("(the line: `memory_limit = -5`)"), "{e}");
    assert!(!e.contains('\n'), "{e}");
    // A misspelt key is named by itself.
    let text = "[[model]]\nname = \"b\"\nbackend = \"echo\"\nmemroy_limit = \"1GiB\"\n";
    let e = ServeConfig::parse(text, std::path::Path::new("b.toml")).unwrap_err();
    assert!(
        e.contains("line 4, [[model]] `b`, `memroy_limit`: unknown field"),
        "{e}"
    );
    // A table's key, and an inline table's.
    let text = "[turn]\nmin = \"soon\"\n";
    let e = ServeConfig::parse(text, std::path::Path::new("b.toml")).unwrap_err();
    assert!(e.contains("line 2, [turn], `min`: "), "{e}");
    let text = "turn = { max = \"1s\", min = \"soon\" }\n";
    let e = ServeConfig::parse(text, std::path::Path::new("b.toml")).unwrap_err();
    assert!(e.contains("line 1, `min`: "), "{e}");
}
