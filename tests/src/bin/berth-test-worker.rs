//! A worker that misbehaves at the handshake, for the tests that check the
//! supervisor refuses it clearly and promptly. `BERTH_TEST_WORKER_MODE`:
//! - `wrong-version`: says hello with protocol version 999;
//! - `never-connect`: sleeps forever without connecting;
//! - `wrong-first-message`: sends a pong instead of a hello.

use std::time::Duration;

use berth_protocol::{Command, ENV_BOOTSTRAP, Event, Hello, WorkerStats};
use ipc_channel::ipc::{self, IpcSender};

fn main() {
    let mode = std::env::var("BERTH_TEST_WORKER_MODE").unwrap_or_default();
    let server = std::env::var(ENV_BOOTSTRAP).expect("started by a supervisor");
    if mode == "never-connect" {
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    let events: IpcSender<Event> = IpcSender::connect(server).expect("connect");
    let (commands, command_rx) = ipc::channel::<Command>().expect("channel");
    let event = match mode.as_str() {
        "wrong-version" => Event::Hello(Hello {
            protocol_version: 999,
            pid: std::process::id(),
            worker_version: "9.9.9".into(),
            backends: vec!["echo".into()],
            commands,
        }),
        "wrong-first-message" => Event::Pong {
            seq: 0,
            stats: WorkerStats::default(),
        },
        other => panic!("unknown BERTH_TEST_WORKER_MODE `{other}`"),
    };
    events.send(event).expect("send");
    // Stay until told to go (or killed), like a worker that ignores us would.
    while let Ok(command) = command_rx.recv() {
        if matches!(command, Command::Shutdown) {
            return;
        }
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
