//! One worker across an in-place upgrade: [`hand`] writes down what the
//! old berth knows of it, [`adopt`] makes the new berth's handle of it
//! from that, after checking it is alive, its child, and the very process
//! handed over (its start time).

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_protocol::{Command, Event};
use ipc_channel::ipc::{IpcReceiver, IpcSender};

use super::ipc::{self, Captured};
use super::state::{HandedWire, HandedWorker, Packet};
use super::take;
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
        fd: super::state::number(&c.fd),
    };
    let wire = match (handle.upstream_server(), commands, wire_fds) {
        (Some(upstream), _, _) => HandedWire::Http {
            address: upstream.address().clone(),
            container: upstream.container().cloned(),
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
            socket: super::state::number(socket),
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
            .map(|(out, err)| (super::state::number(out), super::state::number(err))),
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

/// A handed-over worker that is not to be served (its model left the
/// config): its descriptors are closed and, if it is still this process's
/// child, its group is killed; what it left is swept as any escapee.
pub(crate) fn discard(w: HandedWorker) {
    let fds: Vec<OwnedFd> = match &w.wire {
        // SAFETY: each named once by the state, taken once here.
        HandedWire::Ipc { commands, events } => unsafe { vec![take(commands.fd), take(events.fd)] },
        // SAFETY: as above.
        HandedWire::Stream { socket } => unsafe { vec![take(*socket)] },
        HandedWire::Http { .. } => Vec::new(),
    };
    drop(fds);
    if let Some((out, err)) = w.output {
        // SAFETY: as above.
        drop(unsafe { (take(out), take(err)) });
    }
    if is_the_child(w.pid, w.start_time).is_ok() {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(w.pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        // Reaped as a stray by the subreaper's sweep.
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
    // SAFETY: each named once by the state, taken once here.
    let output = w
        .output
        .map(|(out, err)| unsafe { (File::from(take(out)), File::from(take(err))) });
    let wire = match &w.wire {
        HandedWire::Ipc { commands, events } => {
            // SAFETY: as above.
            let (c, e) = unsafe { (take(commands.fd), take(events.fd)) };
            Some((Some((c, e)), None))
        }
        // SAFETY: as above.
        HandedWire::Stream { socket } => Some((None, Some(unsafe { take(*socket) }))),
        HandedWire::Http { .. } => None,
    };
    is_the_child(w.pid, w.start_time)?;
    let refuse = |why: String| {
        // Alive and ours, but not to be served: it goes (with its group).
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(w.pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
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
    let handle = match (w.wire, wire) {
        (HandedWire::Ipc { commands, events }, Some((Some((c, e)), _))) => {
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
            WorkerHandle::new(
                model,
                &w.backend,
                Arc::clone(&process),
                (
                    Events::Ipc(receiver),
                    Link::Ipc(sender),
                    hello(&w.backend, w.pid, &w.worker_version),
                ),
                kept,
                started_at,
                (config.max_response, config.answer_spin),
            )
            .map_err(|e| refuse(e.to_string()))?
        }
        (HandedWire::Stream { .. }, Some((_, Some(socket)))) => {
            let ours = socket
                .try_clone()
                .map_err(|e| refuse(format!("cannot take over its socket: {e}")))?;
            let (reader, writer) = crate::child::stream::connect(ours)
                .map_err(|e| refuse(format!("cannot take over its socket: {e}")))?;
            WorkerHandle::new(
                model,
                &w.backend,
                Arc::clone(&process),
                (
                    Events::Stream(reader),
                    Link::Stream(writer),
                    hello(&w.backend, w.pid, &w.worker_version),
                ),
                WireFds {
                    events: None,
                    socket: Some(socket),
                },
                started_at,
                (config.max_response, config.answer_spin),
            )
            .map_err(|e| refuse(e.to_string()))?
        }
        (HandedWire::Http { address, container }, _) => {
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
                Upstream::new(model, &prepared, http, program.env).in_container(container),
            );
            WorkerHandle::upstream(model, Arc::clone(&process), upstream, started_at)
        }
        _ => return Err(refuse("its wire was handed over incomplete".into())),
    };
    handle.resume(w.requests, w.load_info, w.baseline_rss, w.load_micros);
    handle.sample_rss();
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
