//! What a client can make berth hold or do is bounded, and no request holds
//! the daemon: lists in a registration (aliases, GPUs) are bounded and
//! looked up, never scanned; request bodies held at once have a total.

use std::time::{Duration, Instant};

use berth_tests::*;
use serde_json::json;

/// The slowest `/healthz` among `n` tries spread over `during`.
fn slowest_health(server: &Server, until: Instant) -> Duration {
    let mut slowest = Duration::ZERO;
    while Instant::now() < until {
        let started = Instant::now();
        let (status, _) = server.get("/healthz");
        assert_eq!(status, 200);
        slowest = slowest.max(started.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    }
    slowest
}

/// One registration with 110,000 aliases (a 14 MB body) used a core for
/// ten minutes under the state lock: `/healthz` timed out, SIGTERM was
/// ignored. Aliases are bounded per model and looked up in an index; a
/// spec body is bounded before it is parsed; a catalogue full of aliases
/// costs a request naming one nothing.
#[test]
fn many_aliases_cannot_freeze_the_daemon() {
    let server = Server::start("[[model]]\nname = \"e\"\nbackend = \"echo\"\n");
    let many: Vec<String> = (0..20_000).map(|i| format!("alias-{i}")).collect();
    let started = Instant::now();
    let (status, reply) = server.put(
        "/api/models/q",
        json!({ "backend": "echo", "aliases": many }),
    );
    assert_eq!(status, 400, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("20000 aliases; a model has at most 64"),
        "{message}"
    );
    let huge: Vec<String> = (0..110_000)
        .map(|i| format!("a-much-longer-alias-{i:08}-x"))
        .collect();
    let (status, reply) = server.put(
        "/api/models/q",
        json!({ "backend": "echo", "aliases": huge }),
    );
    assert_eq!(status, 413, "{reply}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    // 400 models of 64 aliases each (25,600 names), registered while
    // /healthz is polled: it never waits on them.
    let url = server.url.clone();
    let register = std::thread::spawn(move || {
        let agent = ureq::Agent::new_with_defaults();
        for m in 0..400 {
            let aliases: Vec<String> = (0..64).map(|i| format!("m{m}-alias-{i}")).collect();
            let reply = agent
                .put(format!("{url}/api/models/m{m}"))
                .send_json(json!({ "backend": "echo", "aliases": aliases }));
            assert!(reply.is_ok(), "m{m}: {reply:?}");
        }
    });
    let slowest = slowest_health(&server, Instant::now() + Duration::from_secs(2));
    register.join().unwrap();
    assert!(
        slowest < Duration::from_millis(500),
        "/healthz took {slowest:?}"
    );
    // A name already taken, as a name or an alias, is refused naming its
    // holder; an alias names its model in a request.
    let (status, reply) = server.put(
        "/api/models/other",
        json!({ "backend": "echo", "aliases": ["m399-alias-63"] }),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("the name `m399-alias-63` is already model `m399`'s"),
        "{reply}"
    );
    let (status, reply) = server.put("/api/models/m5-alias-1", json!({ "backend": "echo" }));
    assert_eq!(status, 400, "{reply}");
    let (status, reply) = server.post("/api/models/m399-alias-63/infer", json!({ "x": 1 }));
    assert_eq!(status, 200, "{reply}");
    // Deregistered, its aliases are free again.
    let (status, _) = server.delete("/api/models/m399");
    assert_eq!(status, 200);
    let (status, reply) = server.put(
        "/api/models/other",
        json!({ "backend": "echo", "aliases": ["m399-alias-63"] }),
    );
    assert_eq!(status, 201, "{reply}");
    // Other lists a client can make long are bounded too.
    let gpus: Vec<u32> = (0..10_000).collect();
    let (status, reply) = server.put("/api/models/g", json!({ "backend": "echo", "gpus": gpus }));
    assert_eq!(status, 400, "{reply}");
    let (status, reply) = server.put(
        "/api/models/g",
        json!({ "backend": "echo", "aliases": ["x", "x"] }),
    );
    assert_eq!(status, 400, "{reply}");
}

/// The process's resident and peak memory, from `/proc/PID/status`.
fn rss_and_peak(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// 100 clients each sending a 15 MiB body at once had berth hold 1.66 GB,
/// and 546 MB after. Bodies held at once have a total (`max_body_total`):
/// past it a body is answered 503 at once, with `Retry-After`, and not
/// read; what was held goes back to the kernel afterwards.
#[test]
fn request_bodies_held_at_once_are_bounded_and_given_back() {
    let server = Server::start(
        "max_body = \"4MiB\"\nmax_body_total = \"24MiB\"\n\n[[model]]\nname = \"e\"\nbackend = \"echo\"\n",
    );
    let (status, _) = server.post("/api/models/e/infer", json!({ "warm": true }));
    assert_eq!(status, 200);
    std::thread::sleep(Duration::from_millis(500));
    let (before, _) = rss_and_peak(server.pid());
    let body = vec![7u8; 3 << 20];
    let url = server.url.clone();
    let clients: Vec<_> = (0..40)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            std::thread::spawn(move || {
                let agent: ureq::Agent = ureq::Agent::config_builder()
                    .http_status_as_error(false)
                    .build()
                    .into();
                let reply = agent
                    .post(format!("{url}/api/models/e/infer"))
                    .header("Content-Type", "application/octet-stream")
                    .send(&body[..])
                    .unwrap();
                let retry = reply.headers().get("retry-after").is_some();
                (reply.status().as_u16(), retry)
            })
        })
        .collect();
    let answers: Vec<(u16, bool)> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let served = answers.iter().filter(|(s, _)| *s == 200).count();
    let refused = answers.iter().filter(|(s, r)| *s == 503 && *r).count();
    assert_eq!(served + refused, 40, "{answers:?}");
    assert!(served > 0, "{answers:?}");
    let (_, peak) = rss_and_peak(server.pid());
    // The bodies' total, a copy of each on its way to the worker and the
    // answers on their way back: a few times max_body_total, never 40 x 3 MiB
    // several times over.
    assert!(
        peak < before + 4 * (24 << 20),
        "peak {} MiB from {} MiB",
        peak >> 20,
        before >> 20
    );
    assert!(
        wait_for(Duration::from_secs(5), || rss_and_peak(server.pid()).0
            < before + (24 << 20)),
        "RSS {} MiB after, {} MiB before",
        rss_and_peak(server.pid()).0 >> 20,
        before >> 20
    );
}
