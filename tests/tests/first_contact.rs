//! What a new user meets first: the README's main command on a fresh clone,
//! and the CLI in a shell pipeline.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use berth_tests::*;
use serde_json::{Value, json};

fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    let body = body.to_string();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).unwrap();
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let json = out
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b).ok())
        .unwrap_or(Value::Null);
    (status, json)
}

/// `cargo run --release --bin berth -- serve` builds only the `berth`
/// binary: with nothing else beside it, the default models must serve.
#[test]
fn berth_alone_serves_both_default_models() {
    // The default models, fetched where `berth serve` looks for them.
    default_model("minilm");
    default_model("smollm2");
    let dir = std::env::temp_dir().join(format!("berth-fresh-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let alone = dir.join("berth");
    std::fs::copy(berth_bin(), &alone).unwrap();
    assert!(!dir.join("berth-worker").exists());
    let port = free_port();
    let mut child = Command::new(&alone)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .env_remove("BERTH_WORKER")
        .env("HOME", std::env::var("HOME").unwrap_or_default())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(
        wait_for(Duration::from_secs(60), || TcpStream::connect((
            "127.0.0.1",
            port
        ))
        .is_ok()),
        "berth serve came up"
    );
    let (status, reply) = post(
        port,
        "/v1/embeddings",
        &json!({ "model": "minilm", "input": "first contact" }),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["data"][0]["embedding"].as_array().unwrap().len(), 384);
    let (status, reply) = post(
        port,
        "/v1/chat/completions",
        &json!({ "model": "smollm2", "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 4 }),
    );
    assert_eq!(status, 200, "{reply}");
    assert!(
        reply["choices"][0]["message"]["content"].is_string(),
        "{reply}"
    );
    // Its workers are the same executable, in its worker role.
    let workers = children_of(child.id());
    assert!(!workers.is_empty());
    for (pid, _) in workers {
        let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        assert!(cmdline.contains("berth\0worker"), "{cmdline:?}");
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// `berth ... | head -c 100`: the reader goes away; berth ends quietly.
#[test]
fn a_cli_command_writing_into_a_closed_pipe_ends_quietly() {
    let server = Server::start("[[model]]\nname = \"e\"\nbackend = \"echo\"\n");
    for args in [
        vec!["ps", "--url", server.url.as_str()],
        vec!["run", "--backend", "echo", "--input", "hello"],
    ] {
        let mut child = Command::new(berth_bin())
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader is gone before berth writes
        let mut stderr = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        let status = child.wait().unwrap();
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(!stderr.contains("Broken pipe"), "{args:?}: {stderr}");
        use std::os::unix::process::ExitStatusExt;
        assert!(
            status.success() || status.signal() == Some(libc::SIGPIPE),
            "{args:?}: {status:?}"
        );
    }
}
