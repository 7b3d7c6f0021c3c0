//! `berth serve` as the hardening tests run it: a daemon in a process
//! group of its own with its stderr in a file, a scratch folder for its
//! config, and the plain requests a client sends it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{berth_bin, free_port, raw_http, wait_for};

/// A JSON POST on a connection of its own, as any client sends it.
pub fn post_json(port: u16, path: &str, body: &str) -> (u16, String) {
    raw_http(
        port,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    )
}

/// A fresh scratch folder for one test.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("berth-hardening-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `berth serve` with `config`, its stderr in a file, in a process group of
/// its own (so a bug that signals "its own group" cannot reach the tests).
#[derive(Debug)]
pub struct Daemon {
    pub child: Child,
    stderr: PathBuf,
}

impl Daemon {
    pub fn start(dir: &Path, config: &str, args: &[&str]) -> Daemon {
        use std::os::unix::process::CommandExt;
        let config_path = dir.join("berth.toml");
        std::fs::write(&config_path, config).unwrap();
        let stderr = dir.join(format!("stderr-{}.log", free_port()));
        let child = Command::new(berth_bin())
            .arg("serve")
            .arg("--config")
            .arg(&config_path)
            .args(args)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .process_group(0)
            .spawn()
            .unwrap();
        Daemon { child, stderr }
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn exited_within(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), signal);
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.signal(nix::sys::signal::Signal::SIGTERM);
            if self.exited_within(Duration::from_secs(15)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
    }
}

/// Waits (20 s at most) until `/healthz` answers 200.
pub fn wait_healthy(port: u16) -> bool {
    wait_for(Duration::from_secs(20), || {
        TcpStream::connect(("127.0.0.1", port)).is_ok_and(|mut s| {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = s.write_all(
                b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            );
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out.starts_with("HTTP/1.1 200")
        })
    })
}
