//! How the front door serves: its address, who may call it, and its
//! limits, with the defaults a config file leaves out.

use std::sync::Arc;
use std::time::Duration;

use super::listen::{self, Listen};
use super::llama_swap;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:7733";
/// A client must send a request's head within this, on a new connection and
/// on a kept-alive one waiting for its next request (the idle timeout).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// A request's body must have arrived within this once its head has.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(60);
/// A write to a client that takes none of it for this long drops the
/// connection.
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections held at once; past it, new ones get a 503 and are closed.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
pub const MAX_CONNECTIONS_LIMIT: usize = 1 << 16;
/// Texts one embeddings request may carry (OpenAI's own limit).
pub const DEFAULT_MAX_INPUTS: usize = 2048;
pub const DEFAULT_MAX_BODY: u64 = 16 << 20;
/// Request bodies held at once, all connections together: past it a new
/// body is answered 503 at once rather than read.
pub const DEFAULT_MAX_BODY_TOTAL: u64 = 256 << 20;

/// How the sidecar serves: its address, who may call it, and its limits.
#[derive(Clone)]
pub struct ServeOptions {
    pub listen: Listen,
    pub token: Option<String>,
    pub max_body: usize,
    /// Request bodies held at once, all connections together.
    pub max_body_total: usize,
    pub body_timeout: Duration,
    pub max_inputs: usize,
    pub allowed_hosts: Vec<String>,
    pub allowed_origins: Vec<String>,
    /// `GET /metrics` passes without token or Host check.
    pub public_metrics: bool,
    pub connections: listen::ConnectionLimits,
    /// HTTP clients may register the test doubles (`hog`, `fault`, `gpu-hog`).
    pub test_backends: bool,
    /// Tokens accepted besides `token` (llama-swap's `apiKeys`).
    pub api_keys: Vec<String>,
    /// A llama-swap config's layer: its API and request rewriting.
    pub llama_swap: Option<Arc<llama_swap::layer::Compat>>,
}

impl std::fmt::Debug for ServeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeOptions")
            .field("listen", &self.listen)
            .field("max_body", &self.max_body)
            .field("allowed_hosts", &self.allowed_hosts)
            .finish_non_exhaustive()
    }
}

impl ServeOptions {
    /// Defaults for everything but the address.
    pub fn new(listen: Listen) -> ServeOptions {
        ServeOptions {
            listen,
            token: None,
            max_body: DEFAULT_MAX_BODY as usize,
            max_body_total: DEFAULT_MAX_BODY_TOTAL as usize,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            max_inputs: DEFAULT_MAX_INPUTS,
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            public_metrics: false,
            connections: listen::ConnectionLimits {
                max_connections: DEFAULT_MAX_CONNECTIONS,
                header_timeout: DEFAULT_HEADER_TIMEOUT,
                send_timeout: DEFAULT_SEND_TIMEOUT,
            },
            test_backends: false,
            api_keys: Vec::new(),
            llama_swap: None,
        }
    }
}

/// Listening on 0.0.0.0 without a token is refused.
pub fn refuse_open_door(options: &ServeOptions) -> Result<(), String> {
    if !options.listen.is_private() && options.token.is_none() && options.api_keys.is_empty() {
        return Err(format!(
            "refusing to listen on {} without a token: anyone who can reach it could run models; \
             set `token` in the config (or BERTH_TOKEN), or listen on 127.0.0.1",
            options.listen
        ));
    }
    Ok(())
}
