//! Waiting for the worker's hello, on either wire.
//!
//! `IpcOneShotServer::accept` blocks with no timeout, so it runs on a thread
//! of its own while the caller races it against the deadline and the
//! worker's exit. When the race is lost the thread is released: the worker
//! is killed (closing its end) and an empty connection is made and dropped,
//! either of which makes `accept` return.
//!
//! On the stream wire the hello is the first frame on the socket pair; the
//! supervisor answers `welcome` with the version chosen, or `refused`.

use std::time::Duration;

use berth_protocol::stream::{self as wire, STREAM_VERSIONS};
use berth_protocol::{Event, Hello, PROTOCOL_VERSION};
use ipc_channel::ipc::{IpcOneShotServer, IpcSender};
use tokio::sync::oneshot;

use crate::child::link::{Events, HelloInfo, Link};
use crate::child::process::ProcessWatch;
use crate::child::stream::{Ended, Inbound, StreamReader, StreamWriter};
use crate::error::{Error, Result, VersionMismatch};

/// A worker that said hello: its events, its commands, what it said.
pub(crate) type Accepted = (Events, Link, HelloInfo);

/// Opens the one-shot server a worker connects to.
pub(crate) fn open(model: &str) -> Result<(IpcOneShotServer<Event>, String)> {
    IpcOneShotServer::new().map_err(|source| Error::Io {
        model: model.to_string(),
        what: "cannot open the handshake socket",
        source,
    })
}

/// Why the wait for a hello ended without one.
pub(crate) enum HandshakeOutcome {
    Ok(Accepted),
    Failed(Error),
    TimedOut,
}

/// How long a refused stream worker has to read why and exit on its own
/// before it is killed.
const REFUSED_GRACE: Duration = Duration::from_secs(2);

/// Waits for the hello until `timeout`, the worker's exit, or a bad message.
pub(crate) async fn accept(
    model: &str,
    program: &str,
    pid: u32,
    server: IpcOneShotServer<Event>,
    server_name: &str,
    process: &ProcessWatch,
    timeout: Duration,
) -> HandshakeOutcome {
    let (tx, rx) = oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("berth-accept".into())
        .spawn(move || {
            let _ = tx.send(server.accept());
        });
    if let Err(e) = spawned {
        return HandshakeOutcome::Failed(Error::Io {
            model: model.into(),
            what: "cannot start the handshake thread",
            source: e,
        });
    }
    let outcome = tokio::select! {
        accepted = rx => match accepted {
            Ok(Ok((events, Event::Hello(hello)))) => check(model, program, pid, events, hello),
            Ok(Ok((_, other))) => HandshakeOutcome::Failed(Error::UnexpectedMessage {
                model: model.into(), expected: "Hello", received: other.name(),
            }),
            Ok(Err(e)) => HandshakeOutcome::Failed(handshake_error(model, pid, format!(
                "sent a first message that is not a berth hello ({e}); is it a berth worker of \
                 protocol version {PROTOCOL_VERSION}?"
            ))),
            Err(_) => HandshakeOutcome::Failed(handshake_error(model, pid, "handshake thread vanished".into())),
        },
        exit = process.exited() => HandshakeOutcome::Failed(handshake_error(model, pid, format!(
            "{exit} before saying hello; {}{}",
            cannot_start(&process.stderr_tail().await).unwrap_or_else(|| "is it a berth worker?".into()),
            process.stderr_suffix().await
        ))),
        () = tokio::time::sleep(timeout) => HandshakeOutcome::TimedOut,
    };
    if !matches!(outcome, HandshakeOutcome::Ok(_)) {
        // Releases a thread still blocked in accept(); harmless otherwise.
        if let Ok(sender) = IpcSender::<Event>::connect(server_name.to_string()) {
            drop(sender);
        }
    }
    outcome
}

/// What the dynamic loader said, when a worker program could not start for
/// want of a shared library ("error while loading shared libraries:
/// libcuda.so.1: cannot open shared object file"), and what to do about
/// it: a CUDA worker on a machine without the NVIDIA driver, or without
/// CUDA's libraries on its path.
pub(crate) fn cannot_start(stderr: &[String]) -> Option<String> {
    let line = stderr
        .iter()
        .find(|l| l.contains("error while loading shared libraries"))?;
    let library = line
        .split("error while loading shared libraries: ")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .unwrap_or("a library")
        .trim();
    let advice = if library.starts_with("libcuda.so") || library.starts_with("libnvidia-ml") {
        "that is the NVIDIA driver's: this worker was built with CUDA and starts only where the \
         NVIDIA driver is installed; on this machine use the stock worker (its models run on \
         the CPU)"
    } else if ["libcudart", "libcublas", "libcurand", "libnvrtc"]
        .iter()
        .any(|l| library.starts_with(l))
    {
        "that is one of CUDA's libraries: put the folder holding it on the worker kind's \
         LD_LIBRARY_PATH (`[workers.NAME] env`); PyTorch's CUDA wheels carry them in \
         site-packages/nvidia/cu13/lib (docs/gpu.md)"
    } else {
        "install it, or put the folder holding it on the worker kind's LD_LIBRARY_PATH \
         (`[workers.NAME] env`)"
    };
    Some(format!(
        "it cannot start: the shared library `{library}` it needs is not found; {advice}"
    ))
}

fn handshake_error(model: &str, pid: u32, reason: String) -> Error {
    Error::Handshake {
        model: model.into(),
        pid,
        reason,
    }
}

fn wrong_pid(model: &str, pid: u32, said: u32) -> Option<Error> {
    (said != pid).then(|| {
        handshake_error(
            model,
            pid,
            format!("said hello as pid {said}; a process other than the one started connected"),
        )
    })
}

fn check(
    model: &str,
    program: &str,
    pid: u32,
    events: ipc_channel::ipc::IpcReceiver<Event>,
    hello: Hello,
) -> HandshakeOutcome {
    if hello.protocol_version != PROTOCOL_VERSION {
        return HandshakeOutcome::Failed(Error::ProtocolMismatch {
            model: model.into(),
            pid,
            mismatch: Box::new(VersionMismatch {
                program: program.into(),
                pid,
                wire: "protocol",
                supervisor: PROTOCOL_VERSION.to_string(),
                worker: hello.protocol_version.to_string(),
                advice: "rebuild the worker binary (or the host's binary built on the \
                         berth-worker library) from the same berth release as this supervisor"
                    .into(),
                ending: "it was stopped".into(),
            }),
        });
    }
    if let Some(e) = wrong_pid(model, pid, hello.pid) {
        return HandshakeOutcome::Failed(e);
    }
    let info = HelloInfo {
        pid: hello.pid,
        worker_version: hello.worker_version,
        backends: hello.backends,
    };
    HandshakeOutcome::Ok((Events::Ipc(events), Link::Ipc(hello.commands), info))
}

/// Sends `refused` with `reason`, gives the worker [`REFUSED_GRACE`] to
/// read it and exit on its own (the caller kills it after that), and says
/// how it ended.
async fn refuse(writer: &StreamWriter, process: &ProcessWatch, reason: &str) -> String {
    if writer.send_header(&wire::refused(reason)).is_err() {
        return "it was stopped; its socket was already closed".into();
    }
    match process.exited_within(REFUSED_GRACE).await {
        Some(exit) => format!("it was refused and {exit}{}", process.stderr_suffix().await),
        None => format!(
            "it was refused and did not exit within {} s, so it was stopped",
            REFUSED_GRACE.as_secs()
        ),
    }
}

fn versions(list: &[u32]) -> String {
    let list: Vec<String> = list.iter().map(u32::to_string).collect();
    if list.is_empty() {
        "none".into()
    } else {
        list.join(", ")
    }
}

/// Waits for a stream worker's hello until `timeout`, its exit, or a bad
/// frame, and answers it: `welcome` with the version chosen, or `refused`.
pub(crate) async fn accept_stream(
    model: &str,
    program: &str,
    pid: u32,
    mut reader: StreamReader,
    writer: StreamWriter,
    process: &ProcessWatch,
    timeout: Duration,
) -> HandshakeOutcome {
    let first = tokio::select! {
        first = reader.next() => first,
        exit = process.exited() => return HandshakeOutcome::Failed(handshake_error(model, pid, format!(
            "{exit} before saying hello; {}{}",
            cannot_start(&process.stderr_tail().await).unwrap_or_else(|| {
                "is its `command` a berth worker (one built on the berth_worker package, or \
                 speaking docs/wire.md)?"
                    .into()
            }),
            process.stderr_suffix().await
        ))),
        () = tokio::time::sleep(timeout) => return HandshakeOutcome::TimedOut,
    };
    let hello = match first {
        Ok(Inbound::Hello(hello)) => hello,
        Ok(Inbound::Event(event)) => {
            return HandshakeOutcome::Failed(Error::UnexpectedMessage {
                model: model.into(),
                expected: "hello",
                received: event.name(),
            });
        }
        Err(Ended::Violation(v)) => {
            return HandshakeOutcome::Failed(handshake_error(
                model,
                pid,
                format!("sent {v} where a hello was expected (docs/wire.md)"),
            ));
        }
        Err(Ended::Closed) => {
            let exit = process.exited().await;
            return HandshakeOutcome::Failed(handshake_error(
                model,
                pid,
                format!(
                    "closed its socket and {exit} before saying hello{}",
                    process.stderr_suffix().await
                ),
            ));
        }
    };
    if let Some(e) = wrong_pid(model, pid, hello.pid) {
        let ending = refuse(&writer, process, &e.to_string()).await;
        return HandshakeOutcome::Failed(match e {
            Error::Handshake { model, pid, reason } => Error::Handshake {
                model,
                pid,
                reason: format!("{reason} ({ending})"),
            },
            other => other,
        });
    }
    let Some(version) = wire::choose_version(&hello.versions) else {
        let reason = format!(
            "the worker speaks wire versions {}; this supervisor speaks {}",
            versions(&hello.versions),
            versions(STREAM_VERSIONS)
        );
        let ending = refuse(&writer, process, &reason).await;
        let python_package = hello.library.as_deref() == Some("berth_worker")
            || hello
                .runtime
                .as_deref()
                .is_some_and(|r| r.starts_with("CPython") || r.starts_with("PyPy"));
        return HandshakeOutcome::Failed(Error::ProtocolMismatch {
            model: model.into(),
            pid,
            mismatch: Box::new(VersionMismatch {
                program: program.into(),
                pid,
                wire: "stream-wire",
                supervisor: versions(STREAM_VERSIONS),
                worker: versions(&hello.versions),
                advice: if python_package {
                    "install the berth_worker package of this berth release into the worker's \
                     Python environment (`pip install ./python` from the same checkout)"
                        .into()
                } else {
                    format!(
                        "make the worker speak stream-wire version {} (docs/wire.md, section 8)",
                        versions(STREAM_VERSIONS)
                    )
                },
                ending,
            }),
        });
    };
    if writer.send_header(&wire::welcome(version)).is_err() {
        return HandshakeOutcome::Failed(handshake_error(
            model,
            pid,
            "closed its socket right after its hello".into(),
        ));
    }
    let info = HelloInfo {
        pid: hello.pid,
        worker_version: match hello.runtime {
            Some(runtime) => format!("{} ({runtime})", hello.worker_version),
            None => hello.worker_version,
        },
        backends: hello.backends,
    };
    HandshakeOutcome::Ok((Events::Stream(reader), Link::Stream(writer), info))
}

#[cfg(test)]
mod tests {
    use super::cannot_start;

    #[test]
    fn a_missing_library_is_named_with_what_to_do() {
        let tail = |line: &str| vec!["something before".to_string(), line.to_string()];
        let driver = cannot_start(&tail(
            "/opt/berth-worker-cuda: error while loading shared libraries: libcuda.so.1: \
             cannot open shared object file: No such file or directory",
        ))
        .unwrap();
        assert!(
            driver.contains("`libcuda.so.1`") && driver.contains("NVIDIA driver"),
            "{driver}"
        );
        let cublas = cannot_start(&tail(
            "w: error while loading shared libraries: libcublas.so.13: cannot open shared object \
             file: No such file or directory",
        ))
        .unwrap();
        assert!(cublas.contains("LD_LIBRARY_PATH") && cublas.contains("nvidia/cu13/lib"));
        assert_eq!(
            cannot_start(&tail("Traceback (most recent call last):")),
            None
        );
    }
}
