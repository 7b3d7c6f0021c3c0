//! Clients that do not read, second round: a stalled answer holds its
//! connection for `send_timeout` at most, a stream nobody reads is cancelled
//! past a small backlog, a body too large is refused at once, and a client
//! waiting for a load when the server stops is told why.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use berth_tests::*;
use serde_json::json;

fn fd_count_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// CPU time a process has used, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = procfs::process::Process::new(pid as i32)
        .and_then(|p| p.stat())
        .unwrap();
    (stat.utime + stat.stime) as f64 / procfs::ticks_per_second() as f64
}

fn rss_of(pid: u32) -> u64 {
    berth::memory::resident_bytes(pid).unwrap_or(0)
}

/// A POST on a connection of its own that is never read from.
fn stalled(port: u16, path: &str, body: &str, accept: &str) -> TcpStream {
    stalled_bytes(port, path, body.as_bytes(), "application/json", accept)
}

/// [`stalled`] with a body of any type.
fn stalled_bytes(
    port: u16,
    path: &str,
    body: &[u8],
    content_type: &str,
    accept: &str,
) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    // A small receive buffer: the answer stays in the server.
    let size: libc::c_int = 4096;
    // SAFETY: setsockopt reads an int, valid for the call, on our socket.
    unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&stream),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&size as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Type: {content_type}\r\n\
         Accept: {accept}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    stream.write_all(body).unwrap();
    stream
}

/// A process's private resident memory (`RssAnon`), in bytes.
fn anon_of(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

/// Clients that ask for 6 MB answers and read none of them: meanwhile the
/// server answers everyone else, and each is dropped once its answer has
/// made no progress for `send_timeout`, with the connections and the memory
/// they held given back.
#[test]
fn clients_that_never_read_are_dropped_after_send_timeout() {
    let server = Server::start(
        "send_timeout = \"2s\"\n\
         [[model]]\nname = \"big\"\nbackend = \"fault\"\noptions = { response_bytes = 6000000 }\n",
    );
    let port = server.port();
    assert_eq!(server.post("/api/models/big/load", json!({})).0, 200);
    let fds = fd_count_of(server.pid());
    let clients: Vec<TcpStream> = (0..30)
        .map(|_| stalled(port, "/api/models/big/infer", "{}", "application/json"))
        .collect();
    assert!(
        wait_for(Duration::from_secs(30), || fd_count_of(server.pid())
            >= fds + 30),
        "the clients are connected"
    );
    assert_eq!(server.get("/healthz").0, 200, "others are served meanwhile");
    assert!(
        wait_for(Duration::from_secs(30), || fd_count_of(server.pid())
            <= fds + 2),
        "the stalled connections were dropped: {} descriptors, {fds} before",
        fd_count_of(server.pid())
    );
    drop(clients);
    assert_eq!(server.get("/healthz").0, 200);
}

/// A large embeddings answer is written as the client takes it: a client
/// that never reads makes the server hold the vectors, not their four times
/// larger JSON text.
#[test]
fn a_large_embeddings_answer_is_held_compact() {
    let minilm = default_model("minilm");
    let server = Server::start(&format!(
        "send_timeout = \"30s\"\n[[model]]\nname = \"minilm\"\nbackend = \"embed\"\nmodel = \"{}\"\n",
        minilm.display()
    ));
    let port = server.port();
    let texts: Vec<String> = (0..2000).map(|i| format!("text {i}")).collect();
    let body = json!({ "model": "minilm", "input": texts }).to_string();
    // Read in full once: the JSON is ~6 MB.
    let (status, full) = server.post_text("/v1/embeddings", serde_json::from_str(&body).unwrap());
    assert_eq!(status, 200);
    let json_size = full.len() as u64;
    let parsed: serde_json::Value = serde_json::from_str(&full).unwrap();
    assert_eq!(parsed["data"].as_array().unwrap().len(), 2000);
    assert_eq!(parsed["data"][1999]["index"], 1999);
    assert!(json_size > 5_000_000, "{json_size}");
    let before = rss_of(server.pid());
    let clients: Vec<TcpStream> = (0..8)
        .map(|_| stalled(port, "/v1/embeddings", &body, "application/json"))
        .collect();
    // All eight answered (the worker is idle again) and held by the server.
    assert!(wait_for(Duration::from_secs(60), || {
        server
            .ps()
            .iter()
            .all(|m| m["in_flight"] == 0 && m["requests"].as_u64() >= Some(9))
    }));
    std::thread::sleep(Duration::from_millis(500));
    let held = rss_of(server.pid()).saturating_sub(before);
    assert!(
        held < 8 * json_size / 2,
        "8 stalled answers hold {held} bytes; their JSON is {} bytes",
        8 * json_size
    );
    drop(clients);
}

/// A large infer answer is written from where the worker left its bytes
/// (shared memory), and its base64 envelope a piece at a time as the client
/// takes it: clients that never read make the server hold no private copy
/// of their answers (it held the bytes, or their base64 text, whole).
#[test]
fn a_large_infer_answer_is_held_where_the_worker_left_it() {
    let server =
        Server::start("send_timeout = \"30s\"\n[[model]]\nname = \"e\"\nbackend = \"echo\"\n");
    let port = server.port();
    assert_eq!(server.post("/api/models/e/load", json!({})).0, 200);
    let bulk: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8).collect();
    let octets = [("Content-Type", "application/octet-stream")];
    // Read in full once each way: whole and right.
    let whole = server.raw(
        "POST",
        "/api/models/e/infer",
        &[octets[0], ("Accept", "application/octet-stream")],
        Some(&bulk),
    );
    assert_eq!(whole.status, 200, "{}", whole.text());
    assert_eq!(whole.header("berth-json-length"), Some("2"));
    assert_eq!(&whole.body[..2], b"{}");
    assert!(whole.body[2..] == bulk[..], "the bytes came back whole");
    let envelope = server
        .raw("POST", "/api/models/e/infer", &octets, Some(&bulk))
        .json();
    let encoded = envelope["bulk_base64"].as_str().unwrap();
    assert_eq!(encoded.len(), bulk.len().div_ceil(3) * 4);
    assert_eq!(envelope["body"], json!({}));
    assert!(
        encoded.starts_with("AAECAwQF") && encoded.ends_with('='),
        "{}",
        &encoded[..16]
    );
    // Eight at once, read in full: the buffers uploads take at once are the
    // allocator's before the measure, not counted as held after.
    std::thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(|| {
                let reply = server.raw("POST", "/api/models/e/infer", &octets, Some(&bulk));
                assert_eq!(reply.status, 200);
            });
        }
    });
    let before = anon_of(server.pid());
    const CLIENTS: u64 = 16;
    let clients: Vec<TcpStream> = (0..CLIENTS)
        .map(|i| {
            let accept = if i % 2 == 0 {
                "application/octet-stream"
            } else {
                "application/json"
            };
            stalled_bytes(
                port,
                "/api/models/e/infer",
                &bulk,
                "application/octet-stream",
                accept,
            )
        })
        .collect();
    // All answered by the worker, and held by the server.
    assert!(wait_for(Duration::from_secs(60), || {
        let ps = server.ps();
        ps[0]["in_flight"] == 0 && ps[0]["requests"].as_u64() >= Some(10 + CLIENTS)
    }));
    std::thread::sleep(Duration::from_millis(500));
    // Copies held whole came to about twice the bytes (8 clients: 130 MB
    // for 64 MiB); what is left is the allocator keeping the uploads'
    // buffers (19-25 MB for 8 clients, not growing with their number).
    let held = anon_of(server.pid()).saturating_sub(before);
    assert!(
        held < CLIENTS * bulk.len() as u64 / 2,
        "{CLIENTS} stalled answers hold {held} private bytes; their bytes are {} bytes",
        CLIENTS * bulk.len() as u64
    );
    drop(clients);
}

/// Four streams nobody reads: each request is cancelled in the worker once
/// its backlog passes the bound, long before the client goes away, and the
/// server's memory stays bounded.
#[test]
fn a_stream_nobody_reads_is_cancelled_past_a_small_backlog() {
    // The connections are not dropped for a minute: the cancel is the
    // backlog's doing.
    let server = Server::start(
        "send_timeout = \"60s\"\n[[model]]\nname = \"flood\"\nbackend = \"echo\"\n\
         options = { stepping = true, chunks = 0, batch = 8 }\n",
    );
    let port = server.port();
    assert_eq!(server.post("/api/models/flood/load", json!({})).0, 200);
    let before = rss_of(server.pid());
    let body = json!({ "steps": 100_000_000u64, "pad": "x".repeat(200) }).to_string();
    let clients: Vec<TcpStream> = (0..4)
        .map(|_| stalled(port, "/api/models/flood/infer", &body, "text/event-stream"))
        .collect();
    assert!(
        wait_for(Duration::from_secs(10), || server.ps()[0]["requests"] == 4),
        "the four are running"
    );
    // Cancelled in the worker while their clients are still connected:
    // the worker, which streamed flat out, falls idle.
    let worker = server.ps()[0]["pid"].as_u64().unwrap() as u32;
    assert!(
        wait_for(Duration::from_secs(30), || {
            let before = cpu_seconds(worker);
            std::thread::sleep(Duration::from_millis(500));
            cpu_seconds(worker) - before < 0.05
        }),
        "the worker kept streaming to clients that do not read"
    );
    std::thread::sleep(Duration::from_secs(2));
    let grown = rss_of(server.pid()).saturating_sub(before);
    assert!(grown < 64 << 20, "the server grew by {grown} bytes");
    drop(clients);
}

/// A `Content-Length` above `max_body` is refused with 413 at once, not
/// with 408 once `body_timeout` has passed.
#[test]
fn a_body_announced_too_large_is_refused_at_once() {
    let server = Server::start("max_body = \"64KiB\"\nbody_timeout = \"30s\"\n");
    let port = server.port();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    write!(
        stream,
        "PUT /api/models/m HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Type: application/json\r\n\
         Content-Length: 1000000000\r\n\r\n{{"
    )
    .unwrap();
    let mut head = [0u8; 512];
    let n = stream.read(&mut head).unwrap();
    let text = String::from_utf8_lossy(&head[..n]);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
}

/// A client waiting for a load when the server is told to stop gets a 503
/// saying so, not a connection closed under it.
#[test]
fn a_client_waiting_for_a_load_at_shutdown_is_told_why() {
    let mut server = Server::start(
        "[[model]]\nname = \"slow\"\nbackend = \"fault\"\noptions = { load_delay_ms = 20000 }\n",
    );
    let url = server.url.clone();
    let waiting = std::thread::spawn(move || {
        json_reply(
            ureq::post(format!("{url}/api/models/slow/infer"))
                .config()
                .http_status_as_error(false)
                .build()
                .send_json(json!({})),
        )
    });
    assert!(
        wait_for(Duration::from_secs(10), || server
            .ps()
            .iter()
            .any(|m| m["state"] == "loading")),
        "the load has begun"
    );
    assert!(server.terminate(Duration::from_secs(30)).is_some());
    let (status, reply) = waiting.join().unwrap();
    assert_eq!(status, 503, "{reply}");
    assert_eq!(reply["error"]["code"], "shutting_down", "{reply}");
}
