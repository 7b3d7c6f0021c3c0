use super::*;

#[test]
fn placeholders_are_filled_and_one_address_is_required() {
    let args: Vec<String> = ["--model", "{model}", "--port", "{port}"]
        .map(String::from)
        .to_vec();
    let prepared = prepare(
        "server",
        &args,
        Some(Path::new("/models/x.gguf")),
        None,
        false,
    )
    .unwrap();
    let Address::Tcp(addr) = &prepared.address else {
        panic!("{:?}", prepared.address)
    };
    assert_eq!(
        prepared.args,
        [
            "--model",
            "/models/x.gguf",
            "--port",
            &addr.port().to_string()
        ]
    );
    let socket = prepare(
        "server",
        &["--sock={socket}".to_string()],
        None,
        None,
        false,
    )
    .unwrap();
    let Address::Unix(path) = &socket.address else {
        panic!()
    };
    assert_eq!(socket.args, [format!("--sock={}", path.display())]);
    drop(socket);
    let err = prepare("server", &["--port=8000".to_string()], None, None, false).unwrap_err();
    assert!(err.contains("{port}"), "{err}");
    let err = prepare(
        "server",
        &["{port}".into(), "{model}".into()],
        None,
        None,
        false,
    )
    .unwrap_err();
    assert!(err.contains("no `model` path"), "{err}");
    // A fixed port fills `{port}` (or is named as it is); a server that
    // finds its own port names none.
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let fixed = prepare(
        "server",
        &["--port".into(), "{port}".into()],
        None,
        Some(free),
        false,
    )
    .unwrap();
    assert_eq!(fixed.args, ["--port".to_string(), free.to_string()]);
    assert!(prepare("server", &[], None, None, true).is_ok());
    let err = prepare("server", &["{port}".into()], None, None, true).unwrap_err();
    assert!(err.contains("names no port"), "{err}");
}
