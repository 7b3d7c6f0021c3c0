//! What the llama-swap tests share: `berth serve --llama-swap` on a file,
//! what it said at start, the fake server as a `cmd`, `/running`, a chat.

use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::Server;
use crate::python::{repo_root, test_python};

/// `berth serve --llama-swap FILE` (and an empty berth config), with
/// `env`; its stderr goes to `dir/stderr.log`.
pub fn serve(dir: &Path, yaml: &str, env: &[(&str, &str)]) -> Server {
    let file = dir.join("config.yaml");
    std::fs::write(&file, yaml).unwrap();
    let config = dir.join("berth.toml");
    std::fs::write(&config, "").unwrap();
    let stderr = std::fs::File::create(dir.join("stderr.log")).unwrap();
    let args = ["--llama-swap", file.to_str().unwrap()];
    Server::start_custom(&config, Some(dir), &args, env, &mut |command| {
        command.stderr(stderr.try_clone().unwrap());
    })
}

pub fn said(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default()
}

/// The fake server's command line, as a llama-swap `cmd` would name a
/// server.
pub fn fake() -> String {
    format!(
        "{} {}",
        test_python().display(),
        repo_root().join("tests/python/fake_upstream.py").display()
    )
}

/// The models in `/running`.
pub fn running(server: &Server) -> Vec<String> {
    let (status, reply) = server.get("/running");
    assert_eq!(status, 200, "{reply}");
    reply["running"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["model"].as_str().unwrap().to_string())
        .collect()
}

pub fn chat(server: &Server, model: &str, extra: Value) -> (u16, Value) {
    let mut body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    server.post("/v1/chat/completions", body)
}

/// Reads a never-ending answer (`GET path`) until `wanted` is in it.
pub fn stream_until(server: &Server, path: &str, wanted: &str) -> String {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nx-api-key: sk-hunter2\r\n\r\n",
        server.port()
    )
    .unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while !seen.contains(wanted) {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
        }
    }
    seen
}

/// The fake server run on its own, as another machine's server would be:
/// a peer. Killed when dropped.
#[derive(Debug)]
pub struct FakePeer {
    child: std::process::Child,
    pub port: u16,
}

impl Drop for FakePeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl FakePeer {
    /// Over plain HTTP on a free loopback port.
    pub fn http(dir: &Path) -> FakePeer {
        Self::start(dir, &[])
    }

    /// Over HTTPS with a certificate for `localhost` signed by itself,
    /// written to `dir/peer-cert.pem`: a client trusts it by
    /// `SSL_CERT_FILE` pointing there.
    pub fn https(dir: &Path) -> FakePeer {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let (cert_file, key_file) = (dir.join("peer-cert.pem"), dir.join("peer-key.pem"));
        std::fs::write(&cert_file, cert.cert.pem()).unwrap();
        std::fs::write(&key_file, cert.key_pair.serialize_pem()).unwrap();
        Self::start(
            dir,
            &[
                "--tls-cert",
                cert_file.to_str().unwrap(),
                "--tls-key",
                key_file.to_str().unwrap(),
            ],
        )
    }

    fn start(dir: &Path, extra: &[&str]) -> FakePeer {
        let port = crate::free_port();
        let log = std::fs::File::create(dir.join(format!("peer-{port}.log"))).unwrap();
        let child = std::process::Command::new(test_python())
            .arg(repo_root().join("tests/python/fake_upstream.py"))
            .args(["--port", &port.to_string()])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "the fake peer did not listen"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        FakePeer { child, port }
    }
}
