use super::*;

#[test]
fn names_are_checked_before_anything_starts() {
    assert!(ModelSpec::new("mini-lm_2.v1", "echo").validate().is_ok());
    for bad in ["", "has space", "a/b", ".", "..", ".hidden"] {
        let err = ModelSpec::new(bad, "echo").validate().unwrap_err();
        assert_eq!(err.kind(), "invalid_spec", "{bad:?}");
    }
    let err = ModelSpec::new("m", "embed")
        .model("/nonexistent/dir")
        .validate()
        .unwrap_err();
    assert!(err.to_string().contains("/nonexistent/dir"), "{err}");
}

#[test]
fn loader_and_interpreter_variables_are_refused_in_a_spec() {
    for key in [
        "LD_PRELOAD",
        "ld_library_path",
        "BASH_ENV",
        "PYTHONSTARTUP",
        "PATH",
        "GLIBC_TUNABLES",
    ] {
        let mut spec = ModelSpec::new("m", "echo");
        spec.env.push((key.into(), "x".into()));
        let err = spec.validate().unwrap_err();
        assert!(err.to_string().contains(key), "{key}: {err}");
        assert!(err.to_string().contains("[workers.NAME]"), "{err}");
    }
    let mut fine = ModelSpec::new("m", "echo");
    fine.env.push(("CUDA_VISIBLE_DEVICES".into(), "0".into()));
    assert!(fine.validate().is_ok());
}

#[test]
fn out_of_range_durations_and_sizes_name_the_field_and_range() {
    let mut spec = ModelSpec::new("m", "echo");
    spec.keep_alive = Some(Duration::from_secs(10_000_000_000));
    let err = spec.validate().unwrap_err().to_string();
    assert!(err.contains("keep_alive") && err.contains("0s to"), "{err}");
    let mut spec = ModelSpec::new("m", "echo");
    spec.max_rss = Some(u64::MAX);
    let err = spec.validate().unwrap_err().to_string();
    assert!(err.contains("max_rss") && err.contains("1 PiB"), "{err}");
    let mut spec = ModelSpec::new("m", "echo");
    spec.max_concurrency = Some(usize::MAX);
    assert!(
        spec.validate()
            .unwrap_err()
            .to_string()
            .contains("max_concurrency")
    );
}

#[test]
fn a_worker_kind_must_be_declared() {
    let mut spec = ModelSpec::new("m", "echo");
    spec.worker = Some("python".into());
    let err = spec.validate_for(&SupervisorConfig::default()).unwrap_err();
    assert!(err.to_string().contains("[workers.python]"), "{err}");
    let mut config = SupervisorConfig::default();
    config
        .workers
        .insert("python".into(), WorkerKind::binary("/bin/true"));
    assert!(spec.validate_for(&config).is_ok());
}

#[test]
fn jax_s_two_fraction_names_are_refused_together_across_kind_and_model() {
    let mut config = SupervisorConfig::default();
    let mut kind = WorkerKind::binary("/bin/true");
    kind.env
        .insert("XLA_CLIENT_MEM_FRACTION".into(), "0.5".into());
    config.workers.insert("jax".into(), kind);
    let mut spec = ModelSpec::new("m", "echo");
    spec.worker = Some("jax".into());
    assert!(spec.validate_for(&config).is_ok());
    spec.env
        .push(("XLA_PYTHON_CLIENT_MEM_FRACTION".into(), "0.25".into()));
    let err = spec.validate_for(&config).unwrap_err().to_string();
    assert!(
        err.contains("model `m`") && err.contains("keep one"),
        "{err}"
    );
}
