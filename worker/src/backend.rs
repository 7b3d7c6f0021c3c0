//! The `Backend` trait and the registry a worker binary is built from.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use berth_protocol::{Body, ErrorKind, Event, LoadSpec, RequestId, WireError};
use ipc_channel::ipc::IpcSender;

use crate::options::Options;

/// A loaded model inside a worker.
///
/// The worker calls [`Backend::handle`] for one request at a time, on a
/// thread of its own, so an implementation needs no locking. Heartbeats are
/// answered by another thread; the `progress` counter in the contexts is how
/// the supervisor tells a slow model from a stuck one, so advance it from the
/// code doing the work (per token, per batch), never from a timer.
pub trait Backend: Send {
    /// Serve one request. Stream partial results with
    /// [`RequestContext::chunk`]; return the final body.
    fn handle(&mut self, request: Body, ctx: &RequestContext) -> Result<Body, WireError>;

    /// What the load report shows about the loaded model (dimensions,
    /// context length, ...). Empty by default.
    fn describe(&self) -> serde_json::Value {
        serde_json::Value::Object(Default::default())
    }

    /// Called once when the supervisor asks the worker to exit, before the
    /// backend is dropped. Flush or release what needs it; the default does
    /// nothing.
    fn shutdown(&mut self) {}

    /// Whether this backend serves several requests at once, and how many.
    /// When it does, the worker gathers the requests that arrived while the
    /// previous batch ran (never waiting for more when it is idle) and hands
    /// them to [`Backend::handle_batch`]. `None` (the default): one at a time.
    fn batching(&self) -> Option<Batching> {
        None
    }

    /// What `request` counts against [`Batching::max_cost`] (a token
    /// estimate, say). 1 by default.
    fn cost(&self, request: &Body) -> usize {
        let _ = request;
        1
    }

    /// Serves a batch: one result per request, in order. Each request has
    /// its own context (its own id, chunks and cancellation), and fails or
    /// succeeds on its own: a request with bad input gets its error while
    /// the others get their answers. The default serves them one by one.
    fn handle_batch(
        &mut self,
        batch: Vec<(Body, &RequestContext)>,
    ) -> Vec<Result<Body, WireError>> {
        batch
            .into_iter()
            .map(|(body, ctx)| self.handle(body, ctx))
            .collect()
    }

    /// For a backend whose work on a request is a loop of steps (a decoder,
    /// a token at a time): the worker then batches continuously. Requests
    /// begin as they arrive (within [`Backend::batching`]'s limits), each
    /// step advances all that have begun, and each is answered the moment
    /// it ends, rather than a batch being gathered, run and answered
    /// whole. `None` (the default): [`Backend::handle_batch`].
    fn stepping(&mut self) -> Option<&mut dyn Stepping> {
        None
    }
}

/// Continuous batching: see [`Backend::stepping`].
pub trait Stepping {
    /// Takes a request on (parsing it, feeding its prompt). An error answers
    /// it at once; the requests already begun go on.
    fn begin(&mut self, request: Body, ctx: RequestContext) -> Result<(), WireError>;

    /// Advances every request begun and not ended by one step; returns
    /// those that ended, each with its answer (an error ends only its own).
    fn step(&mut self) -> Vec<(RequestId, Result<Body, WireError>)>;

    /// Requests begun and not ended.
    fn active(&self) -> usize;

    /// Drops every request begun: after a panic in [`Stepping::step`] the
    /// worker fails them all.
    fn abandon(&mut self);
}

/// How a backend takes requests in batches (see [`Backend::batching`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// Requests in one batch at most.
    pub max_batch: usize,
    /// The sum of the requests' [`Backend::cost`]s in one batch at most (a
    /// token budget); a request over it on its own still runs, alone.
    pub max_cost: usize,
}

/// How a backend is loaded: from the spec to a ready [`Backend`].
pub type LoadFn = fn(&LoadSpec, &LoadContext) -> Result<Box<dyn Backend>, WireError>;

/// The backends a worker binary can load, by name.
#[derive(Clone, Default)]
pub struct Registry {
    entries: Vec<Entry>,
}

/// One backend: its name, how it loads, and the options it takes where it
/// declares them.
#[derive(Clone)]
struct Entry {
    name: &'static str,
    load: LoadFn,
    options: Option<&'static [&'static str]>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl Registry {
    /// An empty registry, for a host that wants only its own backends.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a backend whose options are not declared: the
    /// supervisor learns of an unknown option only when a load fails.
    pub fn register(&mut self, name: &'static str, load: LoadFn) -> &mut Self {
        self.insert(Entry {
            name,
            load,
            options: None,
        })
    }

    /// Adds (or replaces) a backend that takes exactly `options` (its load
    /// refuses any other, with [`Options::only`](crate::Options::only)):
    /// the supervisor then refuses a model naming another option when it
    /// is registered, before anything starts.
    pub fn register_with_options(
        &mut self,
        name: &'static str,
        load: LoadFn,
        options: &'static [&'static str],
    ) -> &mut Self {
        self.insert(Entry {
            name,
            load,
            options: Some(options),
        })
    }

    fn insert(&mut self, entry: Entry) -> &mut Self {
        self.entries.retain(|e| e.name != entry.name);
        self.entries.push(entry);
        self
    }

    pub fn names(&self) -> Vec<String> {
        self.entries.iter().map(|e| e.name.to_string()).collect()
    }

    /// The options backend `name` takes, where it declared them.
    pub fn options(&self, name: &str) -> Option<&'static [&'static str]> {
        self.entries
            .iter()
            .find(|e| e.name == name)
            .and_then(|e| e.options)
    }

    /// What `--backends` prints: a line per backend, its name and, where it
    /// declared them, `: ` and its options (docs/wire.md).
    pub fn backends_lines(&self) -> String {
        self.entries
            .iter()
            .map(|e| match e.options {
                Some(options) => format!("{}: {}", e.name, options.join(", ")),
                None => e.name.to_string(),
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub fn get(&self, name: &str) -> Option<LoadFn> {
        self.entries.iter().find(|e| e.name == name).map(|e| e.load)
    }

    /// Loads `spec` in this process. The worker's serve loop uses this, and
    /// so do in-process comparisons (benchmarks, tests).
    pub fn load(&self, spec: &LoadSpec, ctx: &LoadContext) -> Result<Box<dyn Backend>, WireError> {
        let load = self.get(&spec.backend).ok_or_else(|| {
            WireError::new(
                ErrorKind::UnknownBackend,
                format!(
                    "model `{}`: this worker has no backend `{}` (it has: {})",
                    spec.name,
                    spec.backend,
                    self.names().join(", ")
                ),
            )
        })?;
        load(spec, ctx)
    }
}

/// A counter the working code advances; read by heartbeats.
#[derive(Debug, Clone, Default)]
pub struct Progress(Arc<AtomicU64>);

impl Progress {
    pub fn advance(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// What a backend gets while loading.
#[derive(Debug, Clone, Default)]
pub struct LoadContext {
    progress: Progress,
}

impl LoadContext {
    /// A context for loading outside a worker (tests, benchmarks).
    pub fn standalone() -> Self {
        Self::default()
    }

    pub(crate) fn new(progress: Progress) -> Self {
        LoadContext { progress }
    }

    /// Advance after each load step (a tensor read, a layer built).
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// The spec's options, with typed getters whose errors name the model.
    pub fn options<'a>(&self, spec: &'a LoadSpec) -> Options<'a> {
        Options::new(spec)
    }

    /// The GPUs the supervisor placed this worker on (physical indices;
    /// CUDA sees them as devices 0..n). Empty when it placed it on none.
    pub fn gpus(&self) -> Vec<u32> {
        std::env::var(berth_protocol::ENV_GPUS)
            .map(|list| {
                list.split(',')
                    .filter_map(|i| i.trim().parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Where a streamed chunk goes.
enum ChunkSink {
    Ipc(IpcSender<Event>),
    Collect(Mutex<Vec<Body>>),
}

/// What a backend gets while serving one request.
pub struct RequestContext {
    id: RequestId,
    sink: ChunkSink,
    cancelled: Arc<Mutex<HashSet<RequestId>>>,
    progress: Progress,
}

impl fmt::Debug for RequestContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestContext")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl RequestContext {
    pub(crate) fn ipc(
        id: RequestId,
        events: IpcSender<Event>,
        cancelled: Arc<Mutex<HashSet<RequestId>>>,
        progress: Progress,
    ) -> Self {
        RequestContext {
            id,
            sink: ChunkSink::Ipc(events),
            cancelled,
            progress,
        }
    }

    /// A context for serving outside a worker: chunks are collected and
    /// returned by [`RequestContext::take_chunks`].
    pub fn standalone() -> Self {
        Self::standalone_with_id(0)
    }

    /// As [`RequestContext::standalone`], with request id `id` (contexts of
    /// one batch, in-process).
    pub fn standalone_with_id(id: RequestId) -> Self {
        RequestContext {
            id,
            sink: ChunkSink::Collect(Mutex::new(Vec::new())),
            cancelled: Arc::default(),
            progress: Progress::default(),
        }
    }

    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Sends a streamed piece of the response.
    pub fn chunk(&self, body: Body) -> Result<(), WireError> {
        match &self.sink {
            ChunkSink::Ipc(events) => events
                .send(Event::Chunk { id: self.id, body })
                .map_err(|e| WireError::new(ErrorKind::Internal, format!("sending a chunk: {e}"))),
            ChunkSink::Collect(v) => {
                v.lock().unwrap_or_else(|e| e.into_inner()).push(body);
                Ok(())
            }
        }
    }

    /// Chunks collected by a standalone context.
    pub fn take_chunks(&self) -> Vec<Body> {
        match &self.sink {
            ChunkSink::Ipc(_) => Vec::new(),
            ChunkSink::Collect(v) => {
                std::mem::take(&mut *v.lock().unwrap_or_else(|e| e.into_inner()))
            }
        }
    }

    /// True once the supervisor cancelled this request; long loops check it
    /// and return an error of kind [`ErrorKind::Cancelled`].
    pub fn is_cancelled(&self) -> bool {
        self.cancelled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&self.id)
    }

    /// Advance per unit of work (token, batch).
    pub fn progress(&self) -> &Progress {
        &self.progress
    }
}
