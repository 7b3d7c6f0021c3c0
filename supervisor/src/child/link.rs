//! A worker's connection, whichever wire it speaks: `ipc-channel` for Rust
//! workers, the stream wire for the rest. Everything above this file (the
//! handle, routing, health, stops, reports) sees one kind of connection, so
//! every policy applies to both wires unchanged.

use berth_protocol::{Body, Bulk, Command, Event};
use ipc_channel::ipc::{IpcReceiver, IpcSender, IpcSharedMemory};

use std::os::fd::{AsFd, OwnedFd};

use crate::child::handover::ipc::Captured;
use crate::child::stream::{SendError, StreamReader, StreamWriter};

/// Where commands go.
#[derive(Debug, Clone)]
pub(crate) enum Link {
    Ipc(IpcSender<Command>),
    Stream(StreamWriter),
    /// An HTTP server takes no commands: requests are relayed to it, its
    /// health is polled, and a stop signals it.
    None,
}

/// Where events come from.
#[derive(Debug)]
pub(crate) enum Events {
    Ipc(IpcReceiver<Event>),
    Stream(StreamReader),
}

/// What of a worker's wire an in-place upgrade hands over
/// (`crate::child::handover`), kept aside close-on-exec while the worker runs: the
/// reader owns the live endpoint, and exec ends the reader.
#[derive(Debug, Default)]
pub(crate) struct WireFds {
    /// `ipc-channel`: the events receiver, as captured.
    pub events: Option<Captured>,
    /// The stream wire: a copy of the socket.
    pub socket: Option<OwnedFd>,
}

/// Sets a handover's copy aside from `events`, and returns the events to
/// read: an `ipc-channel` receiver captured and rebuilt (`child::handover::ipc`),
/// or the stream wire's `socket` as it is.
pub(crate) fn keep_for_handover(
    events: Events,
    socket: Option<OwnedFd>,
) -> std::io::Result<(Events, WireFds)> {
    match events {
        Events::Ipc(receiver) => {
            let captured = crate::child::handover::ipc::capture(receiver)?;
            let receiver =
                crate::child::handover::ipc::rebuild(&captured.packet, captured.fd.as_fd())?;
            Ok((
                Events::Ipc(receiver),
                WireFds {
                    events: Some(captured),
                    socket: None,
                },
            ))
        }
        Events::Stream(reader) => Ok((
            Events::Stream(reader),
            WireFds {
                events: None,
                socket,
            },
        )),
    }
}

/// What a worker said about itself in its hello, on either wire.
#[derive(Debug, Clone)]
pub(crate) struct HelloInfo {
    pub pid: u32,
    pub worker_version: String,
    pub backends: Vec<String>,
}

impl Link {
    pub(crate) fn send(&self, command: Command) -> Result<(), SendError> {
        match self {
            Link::Ipc(tx) => tx.send(for_ipc(command)).map_err(|_| SendError::Closed),
            Link::Stream(writer) => writer.send(&command),
            Link::None => Err(SendError::Refused(
                "an HTTP server takes no worker commands; send it HTTP requests".into(),
            )),
        }
    }
}

/// A body mapped from a stream worker's memfd cannot cross `ipc-channel`
/// as it is: its bytes go into shared memory first.
fn for_ipc(command: Command) -> Command {
    match command {
        Command::Request {
            id,
            body:
                Body {
                    json,
                    bulk: Bulk::Mapped(bytes),
                },
        } => Command::Request {
            id,
            body: Body {
                json,
                bulk: Bulk::Shared(IpcSharedMemory::from_bytes((*bytes).as_ref())),
            },
        },
        other => other,
    }
}
