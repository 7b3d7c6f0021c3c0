//! Every released protocol version keeps a serialized fixture of its
//! messages; this test decodes them with today's types and re-encodes them
//! byte for byte, so a change of wire shape cannot slip in unnoticed.
//! `BERTH_BLESS=1` writes the fixtures of the current version.

use std::collections::BTreeMap;
use std::path::PathBuf;

use berth_protocol::*;
use ipc_channel::ipc::IpcMessage;

fn body() -> Body {
    Body {
        json: r#"{"input":"hi"}"#.into(),
        bulk: Bulk::Inline(vec![1, 2, 3]),
    }
}

fn commands() -> Vec<Command> {
    vec![
        Command::Load(LoadSpec {
            name: "minilm".into(),
            backend: "embed".into(),
            model: Some("/models/minilm".into()),
            options: BTreeMap::from([("load_mode".to_string(), "mmap".to_string())]),
        }),
        Command::Request {
            id: 7,
            body: body(),
        },
        Command::Cancel { id: 7 },
        Command::Ping { seq: 3 },
        Command::Shutdown,
    ]
}

fn events() -> Vec<Event> {
    vec![
        Event::Loaded(LoadInfo {
            details: "{}".into(),
            load_micros: 1234,
            max_batch: 64,
        }),
        Event::LoadFailed(WireError::new(ErrorKind::LoadFailed, "no such file")),
        Event::Chunk {
            id: 7,
            body: body(),
        },
        Event::Done {
            id: 7,
            result: Ok(body()),
            run: RunInfo {
                batch: 3,
                compute_micros: 4567,
            },
        },
        Event::Done {
            id: 8,
            result: Err(WireError::new(ErrorKind::BadRequest, "empty input")),
            run: RunInfo::default(),
        },
        Event::Pong {
            seq: 3,
            stats: WorkerStats {
                rss_bytes: 1,
                peak_rss_bytes: 2,
                progress: 3,
                requests_done: 4,
                in_flight: 5,
            },
        },
    ]
}

fn check<T>(file: &str, expected: Vec<T>)
where
    T: serde::Serialize + for<'de> serde::Deserialize<'de>,
{
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/fixtures/v{PROTOCOL_VERSION}"))
        .join(file);
    let encoded = postcard::to_stdvec(&expected).unwrap();
    if std::env::var_os("BERTH_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &encoded).unwrap();
    }
    let fixture = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; write it with BERTH_BLESS=1", path.display()));
    let decoded: Vec<T> = IpcMessage::from_data(fixture.clone())
        .to()
        .unwrap_or_else(|e| panic!("{} no longer decodes: {e}", path.display()));
    assert_eq!(
        postcard::to_stdvec(&decoded).unwrap(),
        fixture,
        "{file}: decode/encode is not stable"
    );
    assert_eq!(
        encoded, fixture,
        "{file}: today's encoding differs from the v{PROTOCOL_VERSION} fixture"
    );
}

#[test]
fn commands_of_this_version_decode() {
    check("commands.bin", commands());
}

#[test]
fn events_of_this_version_decode() {
    check("events.bin", events());
}

#[test]
fn error_codes_are_stable() {
    let codes: Vec<&str> = ErrorKind::ALL.iter().map(|k| k.code()).collect();
    assert_eq!(
        codes,
        [
            "bad_request",
            "unknown_backend",
            "load_failed",
            "not_loaded",
            "cancelled",
            "input_too_large",
            "backend_error",
            "internal"
        ]
    );
}
