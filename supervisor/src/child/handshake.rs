//! Waiting for the worker's hello.
//!
//! `IpcOneShotServer::accept` blocks with no timeout, so it runs on a thread
//! of its own while the caller races it against the deadline and the
//! worker's exit. When the race is lost the thread is released: the worker
//! is killed (closing its end) and an empty connection is made and dropped,
//! either of which makes `accept` return.

use std::time::Duration;

use berth_protocol::{Event, Hello, PROTOCOL_VERSION};
use ipc_channel::ipc::{IpcOneShotServer, IpcReceiver, IpcSender};
use tokio::sync::oneshot;

use crate::child::process::ProcessWatch;
use crate::error::{Error, Result};

pub(crate) type Accepted = (IpcReceiver<Event>, Hello);

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

/// Waits for the hello until `timeout`, the worker's exit, or a bad message.
pub(crate) async fn accept(
    model: &str,
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
            Ok(Ok((events, Event::Hello(hello)))) => check(model, pid, events, hello),
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
            "{exit} before saying hello; is it a berth worker?{}",
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

fn handshake_error(model: &str, pid: u32, reason: String) -> Error {
    Error::Handshake {
        model: model.into(),
        pid,
        reason,
    }
}

fn check(model: &str, pid: u32, events: IpcReceiver<Event>, hello: Hello) -> HandshakeOutcome {
    if hello.protocol_version != PROTOCOL_VERSION {
        return HandshakeOutcome::Failed(Error::ProtocolMismatch {
            model: model.into(),
            pid,
            supervisor: PROTOCOL_VERSION,
            worker: hello.protocol_version,
        });
    }
    if hello.pid != pid {
        return HandshakeOutcome::Failed(handshake_error(
            model,
            pid,
            format!(
                "said hello as pid {}; a process other than the one started connected",
                hello.pid
            ),
        ));
    }
    HandshakeOutcome::Ok((events, hello))
}
