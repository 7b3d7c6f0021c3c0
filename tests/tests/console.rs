//! The console in a real browser (headless Chromium against a real `berth
//! serve`): what a person sees matches the API, a load and an unload
//! started from the page happen, the unload's reclaimed memory shows on the
//! chart and in the event list, the token is asked for once and never put
//! in a URL; and a page on another origin cannot drive berth.
//!
//! `BERTH_CONSOLE_SCREENSHOT=docs/console.png cargo test --release -p
//! berth-tests --test console` also writes the screenshot the README shows.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use berth_tests::browser::Browser;
use berth_tests::*;
use serde_json::Value;

const TOKEN: &str = "console-s3cret";

const CONFIG: &str = r#"
[[model]]
name = "hog"
backend = "hog"
options = { alloc_mib = "96" }

[[model]]
name = "echo"
backend = "echo"
"#;

const WAIT: Duration = Duration::from_secs(30);

fn model<'a>(ps: &'a [Value], name: &str) -> Option<&'a Value> {
    ps.iter().find(|m| m["name"] == name)
}

/// Whether the page's size text (its `mib`: one decimal, in MiB) is
/// `bytes` (within the rounding, which JavaScript does half up and Rust
/// half to even).
fn shows(text: &str, bytes: u64) -> bool {
    text.strip_suffix(" MiB")
        .and_then(|n| n.parse::<f64>().ok())
        .is_some_and(|n| (n - bytes as f64 / 1048576.0).abs() <= 0.051)
}

/// The size in `text` after `prefix`.
fn size_after<'a>(text: &'a str, prefix: &str) -> &'a str {
    let rest = &text[text.find(prefix).map(|i| i + prefix.len()).unwrap_or(0)..];
    let end = rest.find(" MiB").map(|i| i + 4).unwrap_or(rest.len());
    &rest[..end]
}

/// A GET with nothing but a Host: the status and the whole reply.
fn raw_get(port: u16, path: &str) -> (u16, String) {
    raw_http(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"),
    )
}

fn click(browser: &mut Browser, action: &str, name: &str) {
    let clicked = browser.wait_for(
        &format!(
            "(() => {{ const b = document.querySelector('button[data-action={action}][data-model={name}]'); \
             if (!b) return false; b.click(); return true; }})()"
        ),
        WAIT,
    );
    assert_eq!(clicked, true);
}

#[test]
fn the_console_shows_what_the_api_shows_and_drives_loads_and_unloads() {
    let server = Server::start_with(CONFIG, &["--token", TOKEN]);
    // The page needs no token (a bare request, as a browser's navigation);
    // the API does.
    let (status, page) = raw_get(server.port(), "/");
    assert_eq!(status, 200, "{page}");
    assert_eq!(raw_get(server.port(), "/api/ps").0, 401);
    let policy = page
        .lines()
        .find_map(|l| l.strip_prefix("content-security-policy: "))
        .unwrap_or_default();
    assert!(policy.contains("script-src 'self'"), "{page}");
    assert!(policy.contains("default-src 'none'"), "{page}");
    assert!(
        !page.contains("<script>"),
        "the page runs only its own script file"
    );

    let mut browser = Browser::open(&server.url, 1400, 1150);
    // Asked for the token once.
    browser.wait_for("!document.getElementById('login').hidden", WAIT);
    browser.eval(&format!(
        "document.getElementById('token').value = '{TOKEN}'; \
         document.getElementById('login').requestSubmit(); true"
    ));
    browser.wait_for(
        "!document.getElementById('console').hidden && \
         document.querySelector('#models tr[data-model=hog]') !== null",
        WAIT,
    );

    // A load started from the page loads the model.
    click(&mut browser, "load", "hog");
    assert!(
        wait_for(WAIT, || model(&server.ps(), "hog")
            .is_some_and(|m| m["state"] == "ready")),
        "the page's Load did not load hog"
    );
    let ps = server.ps();
    let hog = model(&ps, "hog").unwrap();
    let pid = hog["pid"].as_u64().unwrap();
    // The same pid and memory as /api/ps.
    browser.wait_for(
        &format!("document.querySelector('#models tr[data-model=hog]').dataset.pid === '{pid}'"),
        WAIT,
    );
    let shown = browser
        .eval("Number(document.querySelector('#models tr[data-model=hog]').dataset.rss)")
        .as_f64()
        .unwrap();
    let api = model(&server.ps(), "hog").unwrap()["rss_bytes"]
        .as_f64()
        .unwrap();
    assert!(
        (shown - api).abs() <= api * 0.05,
        "the page shows RSS {shown}, /api/ps {api}"
    );
    let cell = browser
        .eval("document.querySelector('#models tr[data-model=hog]').children[3].textContent");
    assert!(shows(cell.as_str().unwrap(), shown as u64), "{cell}");

    // An unload from the page: its reclaimed memory on the chart and in
    // the event list, as the event stream carried it.
    click(&mut browser, "unload", "hog");
    let mark = browser.wait_for(
        "(() => { const t = document.querySelector('[data-chart=hog] text[data-event=unloaded]'); \
         return t ? t.textContent : ''; })()",
        WAIT,
    );
    let events = server.raw("GET", "/api/events?follow=false", &[], None);
    let unloaded: Value = events
        .text()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .find(|e| e["type"] == "unloaded" && e["model"] == "hog")
        .expect("an unloaded event");
    let reclaimed = unloaded["report"]["reclaimed_bytes"].as_u64().unwrap();
    assert!(reclaimed > 64 << 20, "hog held 96 MiB: {unloaded:#}");
    let mark = mark.as_str().unwrap();
    assert!(mark.starts_with("unloaded: reclaimed "), "{mark}");
    assert!(shows(size_after(mark, "reclaimed "), reclaimed), "{mark}");
    let listed = browser.wait_for(
        "(() => { const li = document.querySelector('#events li[data-type=unloaded][data-model=hog]'); \
         return li ? li.textContent : ''; })()",
        WAIT,
    );
    let listed = listed.as_str().unwrap();
    assert!(
        shows(size_after(listed, "reclaimed "), reclaimed),
        "{listed}"
    );
    let report = browser.wait_for(
        &format!("(() => {{ const r = document.querySelector('#reports .report[data-pid=\"{pid}\"]'); return r ? r.textContent : ''; }})()"),
        WAIT,
    );
    assert!(
        report.as_str().unwrap().contains("0 processes left over"),
        "{report}"
    );
    // The line came down to nothing once the worker was gone.
    browser.wait_for(
        "(() => { const s = state.history.models.hog || []; return s.length > 0 && s[s.length - 1].rss_bytes === 0; })()",
        WAIT,
    );

    // The token went in a header, never in a URL (a stream still open is
    // not listed yet; its URL is built as the others are).
    let urls = browser.eval(
        "performance.getEntriesByType('resource').map(e => e.name).concat([location.href]).join(' ')",
    );
    assert!(urls.as_str().unwrap().contains("/api/ps"), "{urls}");
    assert!(!urls.as_str().unwrap().contains(TOKEN), "{urls}");

    if let Ok(path) = std::env::var("BERTH_CONSOLE_SCREENSHOT") {
        // A picture with some history: loaded again, and another model.
        click(&mut browser, "load", "hog");
        click(&mut browser, "load", "echo");
        std::thread::sleep(Duration::from_secs(4));
        std::fs::write(&path, browser.screenshot()).expect("the screenshot is written");
    }
}

#[test]
fn a_running_workers_last_stderr_lines_show_in_ps_and_on_the_page() {
    let server = Server::start(
        "[[model]]\nname = \"chatty\"\nbackend = \"fault\"\noptions = { stderr_bytes = \"40\" }\n",
    );
    assert_eq!(
        server
            .post("/api/models/chatty/load", serde_json::json!({}))
            .0,
        200
    );
    assert_eq!(
        server
            .post("/api/models/chatty/infer", serde_json::json!({"x": 1}))
            .0,
        200
    );
    // The line is read from the worker's pipe on a task of its own.
    let mut lines = Value::Null;
    assert!(wait_for(WAIT, || {
        lines = model(&server.ps(), "chatty").unwrap()["stderr_tail"].clone();
        lines.as_array().is_some_and(|l| !l.is_empty())
    }));
    let last = lines
        .as_array()
        .and_then(|l| l.last())
        .and_then(Value::as_str);
    assert!(last.is_some_and(|l| l.len() >= 40), "{lines}");
    let mut browser = Browser::open(&server.url, 1200, 900);
    let shown = browser.wait_for(
        "(() => { const p = document.querySelector('#stderr-live [data-model=chatty] pre'); return p ? p.textContent : ''; })()",
        WAIT,
    );
    assert!(shown.as_str().unwrap().contains(last.unwrap()), "{shown}");
}

/// A page from another origin that tries to load a model and read
/// `/api/ps`, and writes what happened into its title.
fn evil_page(berth: &str) -> String {
    format!(
        r#"<!doctype html><html><body><script>
const target = "{berth}/api/models/hog/load";
const results = [];
async function attempt(name, f) {{
  try {{ const r = await f(); results.push(name + ":" + r.type + ":" + r.status); }}
  catch (e) {{ results.push(name + ":blocked"); }}
}}
(async () => {{
  await attempt("json", () => fetch(target, {{method: "POST", headers: {{"Content-Type": "application/json"}}, body: "{{}}"}}));
  await attempt("text", () => fetch(target, {{method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}}, body: "{{}}"}}));
  await attempt("empty", () => fetch(target, {{method: "POST", mode: "no-cors"}}));
  await attempt("read", () => fetch("{berth}/api/ps"));
  document.title = "done " + results.join(" ");
}})();
</script></body></html>"#
    )
}

#[test]
fn a_page_on_another_origin_cannot_drive_berth() {
    // No token: loopback, where any page the user opens can reach berth.
    let server = Server::start(CONFIG);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let evil = format!("http://{}/", listener.local_addr().unwrap());
    let page = evil_page(&server.url);
    let stop = Arc::new(AtomicBool::new(false));
    let serving = {
        let stop = Arc::clone(&stop);
        listener.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut conn, _)) => {
                        conn.set_nonblocking(false).unwrap();
                        // Chromium opens sockets it may never use.
                        let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
                        let mut buf = [0u8; 4096];
                        let _ = conn.read(&mut buf);
                        let _ = write!(
                            conn,
                            "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                            page.len()
                        );
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        })
    };
    let mut browser = Browser::open(&evil, 800, 600);
    let title = browser.wait_for(
        "document.title.startsWith('done') ? document.title : ''",
        WAIT,
    );
    stop.store(true, Ordering::Relaxed);
    serving.join().unwrap();
    let title = title.as_str().unwrap().to_string();
    // The JSON POST needs a preflight berth never approves; reading needs
    // CORS headers berth never sends.
    assert!(title.contains("json:blocked"), "{title}");
    assert!(title.contains("read:blocked"), "{title}");
    // Whatever the browser sent, nothing was loaded.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        model(&server.ps(), "hog").is_none(),
        "a page on {evil} loaded a model ({title})"
    );
}
