//! The CLI's HTTP client for a running `berth serve`: over TCP (ureq) or
//! HTTP/1.1 over a unix socket, with the daemon's errors mapped to a
//! [`Failure`]. Kept apart so the commands deal in JSON values, not
//! transports; every POST carries a JSON body, as the daemon requires.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use clap::Args;
use serde_json::Value;

/// Where the daemon is.
#[derive(Debug, Clone, Args)]
pub struct Remote {
    /// The daemon's URL, or `unix:/path` for a daemon listening on a unix
    /// socket.
    #[arg(
        long,
        env = "BERTH_URL",
        default_value = "http://127.0.0.1:7733",
        global = true
    )]
    url: String,
    /// Bearer token, if the daemon wants one.
    #[arg(long, env = "BERTH_TOKEN", hide_env_values = true, global = true)]
    token: Option<String>,
    /// Print the daemon's JSON instead of text.
    #[arg(long, global = true)]
    pub(super) json: bool,
}

#[derive(Clone)]
pub(super) struct Client {
    agent: ureq::Agent,
    remote: Remote,
}

/// What went wrong: an error code (the daemon's, or one of the client's own
/// such as `unreachable`) and a message for people.
pub(super) type Failure = (String, String);

/// A response: its status and its body as a stream of bytes.
pub(super) struct Reply {
    pub(super) status: u16,
    pub(super) body: Box<dyn Read>,
}

impl Client {
    pub(super) fn new(remote: &Remote) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(None)
            .build()
            .into();
        Client {
            agent,
            remote: remote.clone(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.remote.url.trim_end_matches('/'))
    }

    fn auth<B>(&self, request: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.remote.token {
            Some(token) => request.header("Authorization", format!("Bearer {token}")),
            None => request,
        }
    }

    fn unreachable(&self, e: impl std::fmt::Display) -> Failure {
        (
            "unreachable".to_string(),
            format!(
                "cannot reach berth at {}: {e}; is `berth serve` running?",
                self.remote.url
            ),
        )
    }

    /// Sends a GET (no body) or a POST (a JSON body or none).
    pub(super) fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Reply, Failure> {
        if let Some(socket) = self.remote.url.strip_prefix("unix:") {
            return unix_request(
                Path::new(socket),
                method,
                path,
                self.remote.token.as_deref(),
                body,
            )
            .map_err(|e| self.unreachable(e));
        }
        let url = self.url(path);
        let result = match (method, body) {
            ("GET", _) => self.auth(self.agent.get(url)).call(),
            (_, Some(body)) => self.auth(self.agent.post(url)).send_json(body),
            // Always JSON: the daemon refuses a POST of any other type.
            (_, None) => self
                .auth(self.agent.post(url))
                .send_json(serde_json::json!({})),
        };
        let response = result.map_err(|e| self.unreachable(e))?;
        Ok(Reply {
            status: response.status().as_u16(),
            body: Box::new(response.into_body().into_reader()),
        })
    }

    pub(super) fn finish(&self, reply: Reply) -> Result<Value, Failure> {
        let Reply { status, mut body } = reply;
        let mut text = String::new();
        body.read_to_string(&mut text)
            .map_err(|e| ("io_error".to_string(), e.to_string()))?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if (200..300).contains(&status) {
            Ok(value)
        } else {
            let code = value["error"]["code"]
                .as_str()
                .unwrap_or("http_error")
                .to_string();
            let message = value["error"]["message"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| format!("HTTP {status}: {value}"));
            Err((code, message))
        }
    }

    pub(super) fn get(&self, path: &str) -> Result<Value, Failure> {
        self.finish(self.send("GET", path, None)?)
    }

    pub(super) fn post(&self, path: &str, body: Option<Value>) -> Result<Value, Failure> {
        self.finish(self.send("POST", path, body.as_ref())?)
    }
}

/// HTTP/1.1 over a unix socket, one request per connection: what `berth
/// serve --listen unix:/path` speaks. The body comes back as it arrives
/// (chunked or sized), so streamed answers stream.
fn unix_request(
    socket: &Path,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> io::Result<Reply> {
    let mut stream = UnixStream::connect(socket)?;
    // Always JSON: the daemon refuses a POST of any other type.
    let payload = match body {
        Some(body) => Some(body.to_string()),
        None if method != "GET" => Some("{}".to_string()),
        None => None,
    };
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(token) = token {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    match &payload {
        Some(p) => head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            p.len()
        )),
        None if method != "GET" => head.push_str("Content-Length: 0\r\n"),
        None => {}
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    if let Some(p) = &payload {
        stream.write_all(p.as_bytes())?;
    }
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("not an HTTP response: {:?}", line.trim_end()),
            )
        })?;
    let (mut chunked, mut length) = (false, None);
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            let (name, value) = (name.trim(), value.trim());
            if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value.eq_ignore_ascii_case("chunked");
            } else if name.eq_ignore_ascii_case("content-length") {
                length = value.parse::<u64>().ok();
            }
        }
    }
    let body: Box<dyn Read> = match (chunked, length) {
        (true, _) => Box::new(Chunked {
            inner: reader,
            left: 0,
            done: false,
        }),
        (false, Some(n)) => Box::new(reader.take(n)),
        (false, None) => Box::new(reader),
    };
    Ok(Reply { status, body })
}

/// A chunked HTTP/1.1 body, decoded as it is read.
struct Chunked<R> {
    inner: R,
    /// Bytes left in the current chunk.
    left: u64,
    done: bool,
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            self.inner.read_line(&mut line)?;
            let size = line.trim().split(';').next().unwrap_or_default().trim();
            self.left = u64::from_str_radix(size, 16).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad chunk size {:?}", line.trim_end()),
                )
            })?;
            if self.left == 0 {
                self.done = true;
                return Ok(0);
            }
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.left -= n as u64;
        if self.left == 0 {
            // The CRLF that ends the chunk.
            let mut crlf = String::new();
            self.inner.read_line(&mut crlf)?;
        }
        Ok(n)
    }
}
