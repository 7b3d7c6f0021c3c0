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
        None,
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
        None,
    )
    .unwrap();
    let Address::Unix(path) = &socket.address else {
        panic!()
    };
    assert_eq!(socket.args, [format!("--sock={}", path.display())]);
    drop(socket);
    let err = prepare(
        "server",
        &["--port=8000".to_string()],
        None,
        None,
        false,
        None,
    )
    .unwrap_err();
    assert!(err.contains("{port}"), "{err}");
    let err = prepare(
        "server",
        &["{port}".into(), "{model}".into()],
        None,
        None,
        false,
        None,
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
        None,
    )
    .unwrap();
    assert_eq!(fixed.args, ["--port".to_string(), free.to_string()]);
    assert!(prepare("server", &[], None, None, true, None).is_ok());
    let err = prepare("server", &["{port}".into()], None, None, true, None).unwrap_err();
    assert!(err.contains("names no port"), "{err}");
    // Another loopback address, `localhost`, or another host by its name.
    let two = prepare(
        "s",
        &["{port}".into()],
        None,
        None,
        false,
        Some("127.0.0.2"),
    )
    .unwrap();
    let Address::Tcp(addr) = &two.address else {
        panic!("{:?}", two.address)
    };
    assert_eq!(addr.ip().to_string(), "127.0.0.2");
    let six = prepare("s", &[], None, Some(8080), false, Some("[::1]")).unwrap();
    assert_eq!(six.address.to_string(), "http://[::1]:8080");
    let local = prepare("s", &[], None, Some(8080), false, Some("localhost")).unwrap();
    assert_eq!(local.address.to_string(), "http://127.0.0.1:8080");
    let named = prepare("s", &["{port}".into()], None, None, false, Some("qwen")).unwrap();
    let Address::Host(host, port) = &named.address else {
        panic!("{:?}", named.address)
    };
    assert_eq!(
        (host.as_str(), named.args[0].as_str()),
        ("qwen", port.to_string().as_str())
    );
    let err = prepare("s", &[], None, None, true, Some("qwen")).unwrap_err();
    assert!(err.contains("find_port"), "{err}");
    let err = prepare("s", &["{socket}".into()], None, None, false, Some("qwen")).unwrap_err();
    assert!(err.contains("socket"), "{err}");
    let err = prepare("s", &["{port}".into()], None, None, false, Some("a b")).unwrap_err();
    assert!(err.contains("not a host name"), "{err}");
}
