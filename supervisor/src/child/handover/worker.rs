//! One worker across an in-place upgrade: [`hand`] writes down what the
//! old berth knows of it, [`adopt`] makes the new berth's handle of it
//! from that, after checking it is alive, its child, and the very process
//! handed over (its start time).

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_protocol::{Command, Event};
use ipc_channel::ipc::{IpcReceiver, IpcSender};

use super::ipc::{self, Captured};
use super::{HandedWire, HandedWorker, Packet, take};
use crate::child::handle::WorkerHandle;
use crate::child::health;
use crate::child::limits::{Cgroup, MemoryCap};
use crate::child::link::{Events, HelloInfo, Link, WireFds};
use crate::child::process::ProcessWatch;
use crate::child::upstream::{Prepared, Upstream};
use crate::config::{ModelSpec, SupervisorConfig};
use crate::report::LoadReport;

/// What the old berth writes down of one worker; the descriptors returned
/// must stay open until the exec (the state names them).
pub(crate) fn hand(
    handle: &WorkerHandle,
    idle: Duration,
    report: LoadReport,
) -> std::io::Result<(HandedWorker, Vec<OwnedFd>)> {
    let process = handle.process();
    let (commands, wire_fds) = handle.wire_for_handover()?;
    let mut keep = Vec::new();
    let packet = |c: &Captured| Packet {
        bytes: c.packet.clone(),
        fd: c.fd.as_raw_fd(),
    };
    let wire = match (handle.upstream_server(), commands, wire_fds) {
        (Some(upstream), _, _) => HandedWire::Http {
            address: upstream.address().clone(),
            container: upstream.container().cloned(),
            outside: upstream.outside().map(str::to_string),
        },
        (
            None,
            Some(commands),
            WireFds {
                events: Some(events),
                ..
            },
        ) => {
            let wire = HandedWire::Ipc {
                commands: packet(&commands),
                events: packet(events),
            };
            keep.push(commands.fd);
            wire
        }
        (
            None,
            None,
            WireFds {
                socket: Some(socket),
                ..
            },
        ) => HandedWire::Stream {
            socket: socket.as_raw_fd(),
        },
        _ => {
            return Err(std::io::Error::other(format!(
                "model `{}`: its worker's wire was not set aside when it started",
                handle.model()
            )));
        }
    };
    let (cap, fence) = process.handed_limits();
    let handed = HandedWorker {
        model: handle.model().to_string(),
        pid: handle.pid(),
        start_time: process.start_time(),
        mark: process.mark().to_string(),
        backend: handle.backend().to_string(),
        worker_version: handle.worker_version().to_string(),
        wire,
        output: process
            .output_fds()
            .map(|(out, err)| (out.as_raw_fd(), err.as_raw_fd())),
        cap,
        fence,
        start: process.start_kind().clone(),
        age_ms: handle.uptime().as_millis() as u64,
        idle_ms: idle.as_millis() as u64,
        requests: handle.requests(),
        load_info: handle.load_info(),
        baseline_rss: handle.baseline_rss(),
        load_micros: handle.load_time().as_micros() as u64,
        report,
    };
    Ok((handed, keep))
}

/// Whether `pid` is this process's live child started at `start_time`.
fn is_the_child(pid: u32, start_time: u64) -> Result<(), String> {
    let stat = procfs::process::Process::new(pid as i32)
        .and_then(|p| p.stat())
        .map_err(|_| format!("pid {pid} is gone"))?;
    if stat.ppid as u32 != std::process::id() {
        return Err(format!(
            "pid {pid} is not a child of this berth (its parent is {})",
            stat.ppid
        ));
    }
    if stat.starttime != start_time {
        return Err(format!(
            "pid {pid} is another process than the worker handed over (it started at tick {}, \
             the worker at {start_time})",
            stat.starttime
        ));
    }
    if matches!(stat.state, 'Z' | 'X') {
        return Err(format!("pid {pid} has exited"));
    }
    Ok(())
}

/// A handed-over worker's descriptors, taken (close-on-exec from now on).
enum Taken {
    Ipc { commands: OwnedFd, events: OwnedFd },
    Stream(OwnedFd),
    Http,
}

/// Takes the descriptors the state names for `w`: its wire's and its
/// output's. Each is taken once: the state is consumed with `w`.
fn take_descriptors(w: &HandedWorker) -> (Taken, Option<(File, File)>) {
    // SAFETY: each descriptor named once by the state, taken once here.
    unsafe {
        let wire = match &w.wire {
            HandedWire::Ipc { commands, events } => Taken::Ipc {
                commands: take(commands.fd),
                events: take(events.fd),
            },
            HandedWire::Stream { socket } => Taken::Stream(take(*socket)),
            HandedWire::Http { .. } => Taken::Http,
        };
        let output = w
            .output
            .map(|(out, err)| (File::from(take(out)), File::from(take(err))));
        (wire, output)
    }
}

/// Kills a handed-over worker's group (reaped as a stray by the
/// subreaper's sweep).
fn kill_group(pid: u32) {
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// A handed-over worker that is not to be served (its model left the
/// config): its descriptors are closed and, if it is still this process's
/// child, it goes with all it started (see [`dispose`]).
pub(crate) fn discard(w: HandedWorker) {
    drop(take_descriptors(&w));
    if is_the_child(w.pid, w.start_time).is_ok() {
        Disposal::of(&w).run();
    }
}

/// A handed-over worker berth will not serve, stopped with everything of it:
/// its group killed now; then, in the background, its own cgroup killed
/// and removed once empty (else an empty folder stays behind), and its
/// container, if it ran one, removed by its engine (else it would keep
/// running under the live berth's owner label, which no sweep takes).
struct Disposal {
    pid: u32,
    model: String,
    cgroup: Option<crate::child::limits::HandedCgroup>,
    container: Option<crate::child::container::Container>,
}

impl Disposal {
    fn of(w: &HandedWorker) -> Disposal {
        Disposal {
            pid: w.pid,
            model: w.model.clone(),
            cgroup: w
                .fence
                .clone()
                .or_else(|| w.cap.as_ref().and_then(|c| c.cgroup.clone())),
            container: match &w.wire {
                HandedWire::Http { container, .. } => container.clone(),
                _ => None,
            },
        }
    }

    fn run(&self) {
        kill_group(self.pid);
        self.leftovers();
    }

    /// Its cgroup and container, in the background.
    fn leftovers(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (model, cgroup, container) = (
            self.model.clone(),
            self.cgroup.clone(),
            self.container.clone(),
        );
        runtime.spawn(async move {
            if let Some(container) = container {
                let _ = container.remove(&model).await;
            }
            if let Some(cgroup) = cgroup {
                crate::child::limits::kill_cgroup(&cgroup.dir, cgroup.version);
                for _ in 0..200 {
                    if crate::child::limits::remove_cgroup(&cgroup.dir) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        });
    }
}

/// The new berth's handle of a handed-over worker, watched as one it
/// started: reaped, heartbeats, its memory cap.
pub(crate) fn adopt(
    w: HandedWorker,
    spec: &ModelSpec,
    config: &SupervisorConfig,
) -> Result<(Arc<WorkerHandle>, LoadReport), String> {
    let model = w.model.as_str();
    // Taken first, whatever follows: a worker refused here is killed, and
    // its descriptors closed.
    let (taken, output) = take_descriptors(&w);
    let disposal = Disposal::of(&w);
    if let Err(why) = is_the_child(w.pid, w.start_time) {
        // Gone (or another's): what is left of it (its cgroup, a
        // container) goes, but no process of that pid is touched.
        disposal.leftovers();
        return Err(why);
    }
    let refuse = |why: String| {
        // Alive and ours, but not to be served: it goes, with all of it.
        disposal.run();
        why
    };
    let cap = w
        .cap
        .clone()
        .map(MemoryCap::taken_over)
        .transpose()
        .map_err(&refuse)?;
    let fence = w
        .fence
        .clone()
        .map(Cgroup::taken_over)
        .transpose()
        .map_err(&refuse)?;
    let output = match output {
        Some(output) => output,
        None => {
            let null = || File::open("/dev/null");
            null()
                .and_then(|a| null().map(|b| (a, b)))
                .map_err(|e| refuse(format!("cannot open /dev/null: {e}")))?
        }
    };
    let process = Arc::new(
        ProcessWatch::adopt(model, w.pid, output, cap, fence, &w.mark).with_start(w.start.clone()),
    );
    process.spawn_rss_guard();
    let started_at = Instant::now()
        .checked_sub(Duration::from_millis(w.age_ms))
        .unwrap_or_else(Instant::now);
    // A berth worker's wire (either kind), or an HTTP server's address.
    enum Reached {
        Worker(Events, Link, WireFds),
        Server(
            crate::child::upstream::Address,
            Option<crate::child::container::Container>,
            Option<String>,
        ),
    }
    let wire = match (w.wire, taken) {
        (
            HandedWire::Ipc { commands, events },
            Taken::Ipc {
                commands: c,
                events: e,
            },
        ) => {
            let sender: IpcSender<Command> = ipc::rebuild(&commands.bytes, c.as_fd())
                .map_err(|e| refuse(format!("cannot take over its commands channel: {e}")))?;
            drop(c);
            let receiver: IpcReceiver<Event> = ipc::rebuild(&events.bytes, e.as_fd())
                .map_err(|e| refuse(format!("cannot take over its events channel: {e}")))?;
            let kept = WireFds {
                events: Some(Captured {
                    packet: events.bytes,
                    fd: e,
                }),
                socket: None,
            };
            Reached::Worker(Events::Ipc(receiver), Link::Ipc(sender), kept)
        }
        (HandedWire::Stream { .. }, Taken::Stream(socket)) => {
            let (reader, writer) = socket
                .try_clone()
                .and_then(crate::child::stream::connect)
                .map_err(|e| refuse(format!("cannot take over its socket: {e}")))?;
            let kept = WireFds {
                events: None,
                socket: Some(socket),
            };
            Reached::Worker(Events::Stream(reader), Link::Stream(writer), kept)
        }
        (
            HandedWire::Http {
                address,
                container,
                outside,
            },
            Taken::Http,
        ) => Reached::Server(address, container, outside),
        _ => return Err(refuse("its wire was handed over incomplete".into())),
    };
    let handle = match wire {
        Reached::Worker(events, link, kept) => WorkerHandle::new(
            model,
            &w.backend,
            Arc::clone(&process),
            (events, link, hello(&w.backend, w.pid, &w.worker_version)),
            kept,
            started_at,
            (config.max_response, config.answer_spin),
        )
        .map_err(|e| refuse(e.to_string()))?,
        Reached::Server(address, container, outside) => {
            let program = crate::child::program::worker_program(spec, config)
                .map_err(|e| refuse(e.to_string()))?;
            let Some(http) = program.http.clone() else {
                return Err(refuse(format!(
                    "its kind is no longer an HTTP server's (it runs `{}`)",
                    program.path.display()
                )));
            };
            let prepared = Prepared {
                args: Vec::new(),
                path: String::new(),
                reserved: Arc::new(crate::child::ports::Reserved::taken_over(&address)),
                address,
            };
            let upstream = Arc::new(
                Upstream::new(model, &prepared, http, program.env)
                    .in_container(container)
                    .outside_berth(outside),
            );
            WorkerHandle::upstream(model, Arc::clone(&process), upstream, started_at)
        }
    };
    handle.resume(w.requests, w.load_info, w.baseline_rss, w.load_micros);
    let heartbeat_timeout = match handle.upstream_server() {
        Some(upstream) => upstream.unhealthy_after(),
        None => config.heartbeat_timeout,
    };
    health::spawn(
        Arc::downgrade(&handle),
        health::HealthPolicy {
            interval: config.heartbeat_interval,
            heartbeat_timeout,
            stall_timeout: spec.stall_timeout,
        },
    );
    Ok((handle, w.report))
}

fn hello(backend: &str, pid: u32, worker_version: &str) -> HelloInfo {
    HelloInfo {
        pid,
        worker_version: worker_version.to_string(),
        backends: vec![backend.to_string()],
    }
}
