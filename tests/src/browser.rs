//! A real browser for the console's tests: Debian's headless Chromium,
//! driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
//! JSON messages ending in a NUL on descriptors 3 and 4), so no port and
//! no WebSocket library.
//!
//! Chromium is installed by the harness when it is missing and the tests
//! run as root (`apt-get install chromium`, as on CI); otherwise the test
//! fails and says how to install it.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Chromium's path, installing Debian's package first where it is missing.
pub fn chromium() -> PathBuf {
    crate::apt::ensure("the console's browser test", &["chromium"], false, &|| {
        crate::apt::find("chromium").or_else(|| crate::apt::find("chromium-browser"))
    })
}

/// One headless Chromium with one page.
#[derive(Debug)]
pub struct Browser {
    child: Child,
    to: File,
    from: BufReader<File>,
    next: u64,
    session: String,
    _profile: TempDir,
}

#[derive(Debug)]
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A pipe whose ends no other child inherits (tests run in parallel).
fn pipe() -> (OwnedFd, OwnedFd) {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("a pipe")
}

impl Browser {
    /// Starts Chromium and opens `url` in a page `width` x `height`.
    pub fn open(url: &str, width: u32, height: u32) -> Browser {
        let profile = std::env::temp_dir().join(format!(
            "berth-chromium-{}-{}",
            std::process::id(),
            crate::free_port()
        ));
        std::fs::create_dir_all(&profile).unwrap();
        // Ours: write commands to `to_browser.1`, read from `from_browser.0`.
        let (to_read, to_write) = pipe();
        let (from_read, from_write) = pipe();
        let (child_in, child_out) = (to_read.as_raw_fd(), from_write.as_raw_fd());
        let mut command = Command::new(chromium());
        command
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--hide-scrollbars",
                "--remote-debugging-pipe",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(format!("--window-size={width},{height}"))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: only fcntl and dup2, async-signal-safe, between fork and
        // exec. Both ends move above 4 first, so that placing one on 3 or 4
        // cannot overwrite the other; dup2 clears close-on-exec.
        unsafe {
            command.pre_exec(move || {
                let high_in = libc::fcntl(child_in, libc::F_DUPFD, 10);
                let high_out = libc::fcntl(child_out, libc::F_DUPFD, 10);
                if high_in < 0
                    || high_out < 0
                    || libc::dup2(high_in, 3) < 0
                    || libc::dup2(high_out, 4) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("Chromium starts");
        drop((to_read, from_write));
        let mut browser = Browser {
            child,
            to: File::from(to_write),
            from: BufReader::new(File::from(from_read)),
            next: 0,
            session: String::new(),
            _profile: TempDir(profile),
        };
        let target = browser.call("Target.createTarget", json!({"url": "about:blank"}));
        let target = target["targetId"].as_str().expect("a target").to_string();
        let attached = browser.call(
            "Target.attachToTarget",
            json!({"targetId": target, "flatten": true}),
        );
        browser.session = attached["sessionId"].as_str().expect("a session").into();
        browser.call("Page.enable", json!({}));
        browser.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": false}),
        );
        browser.call("Page.navigate", json!({"url": url}));
        browser
    }

    /// Sends a DevTools command (to the page once attached) and waits for
    /// its answer; events that arrive meanwhile are passed over.
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = self.next;
        let mut message = json!({"id": id, "method": method, "params": params});
        if !self.session.is_empty() {
            message["sessionId"] = json!(self.session);
        }
        let mut bytes = serde_json::to_vec(&message).unwrap();
        bytes.push(0);
        self.to.write_all(&bytes).expect("Chromium reads its pipe");
        loop {
            if self.from.buffer().is_empty() {
                // Not for ever: a Chromium that hangs fails the test.
                let mut fd = libc::pollfd {
                    fd: self.from.get_ref().as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one pollfd, ours, for the call's length.
                let ready = unsafe { libc::poll(&mut fd, 1, 60_000) };
                assert!(ready > 0, "Chromium did not answer {method} within 60 s");
            }
            let mut raw = Vec::new();
            let n = self.from.read_until(0, &mut raw).expect("Chromium answers");
            assert!(n > 0, "Chromium closed its pipe during {method}");
            raw.pop();
            let reply: Value = serde_json::from_slice(&raw).expect("DevTools JSON");
            if reply["id"] == id {
                assert!(reply["error"].is_null(), "{method}: {}", reply["error"]);
                return reply["result"].clone();
            }
        }
    }

    /// Runs `expression` in the page (awaiting a promise) and returns its
    /// value; a thrown error fails the test.
    pub fn eval(&mut self, expression: &str) -> Value {
        let out = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
        );
        assert!(
            out["exceptionDetails"].is_null(),
            "{expression}: {:#}",
            out["exceptionDetails"]
        );
        out["result"]["value"].clone()
    }

    /// Waits until `expression` is truthy in the page; returns its value.
    pub fn wait_for(&mut self, expression: &str, timeout: Duration) -> Value {
        let start = Instant::now();
        loop {
            let value = self.call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
            );
            let v = &value["result"]["value"];
            let truthy = !(v.is_null()
                || *v == json!(false)
                || *v == json!(0)
                || *v == json!("")
                || value["exceptionDetails"].is_object());
            if truthy {
                return v.clone();
            }
            assert!(
                start.elapsed() < timeout,
                "the page never showed `{expression}` (last: {value:#})"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The page as a PNG.
    pub fn screenshot(&mut self) -> Vec<u8> {
        let shot = self.call(
            "Page.captureScreenshot",
            json!({"format": "png", "captureBeyondViewport": false}),
        );
        decode_base64(shot["data"].as_str().expect("PNG data"))
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn decode_base64(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a' + 26) as u32,
            b'0'..=b'9' => (c - b'0' + 52) as u32,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let bytes: Vec<u8> = text.bytes().filter(|c| *c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= value(*c) << (18 - 6 * i);
        }
        out.push((n >> 16) as u8);
        if chunk.len() > 2 {
            out.push((n >> 8) as u8);
        }
        if chunk.len() > 3 {
            out.push(n as u8);
        }
    }
    out
}
