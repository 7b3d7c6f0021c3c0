//! `/api/models/{name}/infer`, the one route a custom backend has: bytes in
//! and out, and every streamed piece, on both wires.

use berth_tests::python::python_worker_command;
use berth_tests::*;
use serde_json::{Value, json};

fn server() -> Server {
    let argv = serde_json::to_string(&python_worker_command()).unwrap();
    Server::start(&format!(
        "[[model]]\nname = \"rust\"\nbackend = \"echo\"\noptions = {{ chunks = 3 }}\n\n\
         [[model]]\nname = \"python\"\nbackend = \"echo\"\ncommand = {argv}\n\
         options = {{ chunks = 3 }}\n"
    ))
}

/// Standard base64, decoded (the tests' own, to check the server's).
fn unbase64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let mut out = Vec::new();
    for quad in text.as_bytes().chunks(4) {
        let digits: Vec<u8> = quad
            .iter()
            .filter(|c| **c != b'=')
            .map(|c| value(*c))
            .collect();
        let n = digits
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, d)| n | (u32::from(*d) << (18 - 6 * i)));
        out.extend_from_slice(&n.to_be_bytes()[1..digits.len()]);
    }
    out
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 % 251) as u8).collect()
}

/// Bytes in with their JSON, bytes out with theirs, on both wires and in
/// both forms (inside the message, and in shared memory or a memfd).
#[test]
fn bytes_go_in_and_come_back_whole() {
    let server = server();
    for model in ["rust", "python"] {
        for len in [1000, 1 << 20] {
            let json = br#"{"tensor": "x"}"#;
            let mut body = json.to_vec();
            body.extend_from_slice(&pattern(len));
            let path = format!("/api/models/{model}/infer");
            let length = json.len().to_string();
            let reply = server.raw(
                "POST",
                &path,
                &[
                    ("content-type", "application/octet-stream"),
                    ("berth-json-length", &length),
                    ("accept", "application/octet-stream"),
                ],
                Some(&body),
            );
            assert_eq!(reply.status, 200, "{model} {len}: {}", reply.text());
            assert_eq!(
                reply.header("content-type"),
                Some("application/octet-stream")
            );
            let n: usize = reply.header("berth-json-length").unwrap().parse().unwrap();
            let answered: Value = serde_json::from_slice(&reply.body[..n]).unwrap();
            assert_eq!(answered, json!({"tensor": "x"}), "{model} {len}");
            assert!(
                reply.body[n..] == pattern(len)[..],
                "{model} {len}: the bytes came back whole"
            );
            assert_eq!(reply.header("berth-chunks"), Some("3"), "{model} {len}");

            // Asked for JSON: the bytes come as base64 beside the answer.
            let reply = server.raw(
                "POST",
                &path,
                &[
                    ("content-type", "application/octet-stream"),
                    ("berth-json-length", &length),
                ],
                Some(&body),
            );
            assert_eq!(reply.status, 200, "{model} {len}: {}", reply.text());
            let envelope = reply.json();
            assert_eq!(envelope["body"], json!({"tensor": "x"}), "{model}");
            assert_eq!(
                unbase64(envelope["bulk_base64"].as_str().unwrap()),
                pattern(len),
                "{model} {len}"
            );
        }
        // Without Berth-Json-Length the whole body is bulk, the JSON `{}`.
        let reply = server.raw(
            "POST",
            &format!("/api/models/{model}/infer"),
            &[
                ("content-type", "application/octet-stream"),
                ("accept", "application/octet-stream"),
            ],
            Some(b"raw bytes"),
        );
        assert_eq!(reply.status, 200, "{model}: {}", reply.text());
        assert_eq!(reply.body, b"{}raw bytes", "{model}");
    }
}

/// Every streamed piece, as server-sent events or as lines of JSON; a
/// plain answer says how many it left out.
#[test]
fn chunks_stream_as_events_or_lines_and_are_never_dropped_unsaid() {
    let server = server();
    for model in ["rust", "python"] {
        let path = format!("/api/models/{model}/infer");
        let reply = server.raw(
            "POST",
            &path,
            &[
                ("content-type", "application/json"),
                ("accept", "text/event-stream"),
            ],
            Some(br#"{"n": 1}"#),
        );
        assert_eq!(reply.status, 200, "{model}: {}", reply.text());
        assert!(
            reply
                .header("content-type")
                .is_some_and(|t| t.starts_with("text/event-stream"))
        );
        let text = reply.text();
        let events: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .collect();
        assert_eq!(
            events,
            ["chunk", "chunk", "chunk", "done"],
            "{model}: {text}"
        );
        let data: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        assert_eq!(data[0], json!({"chunk": {"n": 1}}), "{model}");
        assert_eq!(data[3], json!({"done": {"n": 1}}), "{model}");

        let reply = server.raw(
            "POST",
            &path,
            &[
                ("content-type", "application/json"),
                ("accept", "application/x-ndjson"),
            ],
            Some(br#"{"n": 2}"#),
        );
        assert_eq!(reply.status, 200, "{model}: {}", reply.text());
        let lines: Vec<Value> = reply
            .text()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(
            lines,
            [
                json!({"chunk": {"n": 2}}),
                json!({"chunk": {"n": 2}}),
                json!({"chunk": {"n": 2}}),
                json!({"done": {"n": 2}}),
            ],
            "{model}"
        );

        // Plain JSON: the final answer as it was, and the count left out.
        let reply = server.raw(
            "POST",
            &path,
            &[("content-type", "application/json")],
            Some(br#"{"n": 3}"#),
        );
        assert_eq!(reply.status, 200);
        assert_eq!(reply.json(), json!({"n": 3}), "{model}");
        assert_eq!(reply.header("berth-chunks"), Some("3"), "{model}");
    }
}

/// A body of bytes whose JSON length is wrong is refused before anything
/// reaches the worker, naming what is wrong; bytes are taken by `infer`
/// alone.
#[test]
fn a_malformed_body_of_bytes_is_refused() {
    let server = server();
    for (length, phrase) in [("999", "past the body's"), ("x", "not a number")] {
        let reply = server.raw(
            "POST",
            "/api/models/rust/infer",
            &[
                ("content-type", "application/octet-stream"),
                ("berth-json-length", length),
            ],
            Some(b"{}abc"),
        );
        assert_eq!(reply.status, 400, "{}", reply.text());
        assert!(reply.text().contains(phrase), "{}", reply.text());
    }
    let reply = server.raw(
        "POST",
        "/api/models/rust/infer",
        &[
            ("content-type", "application/octet-stream"),
            ("berth-json-length", "3"),
        ],
        Some(b"{x}abc"),
    );
    assert_eq!(reply.status, 400, "{}", reply.text());
    let reply = server.raw(
        "POST",
        "/api/models/rust/load",
        &[("content-type", "application/octet-stream")],
        Some(b"abc"),
    );
    assert_eq!(reply.status, 415, "{}", reply.text());
    assert!(server.ps().is_empty(), "nothing was loaded");
}
