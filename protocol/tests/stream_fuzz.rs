//! A property test of the stream wire's decoder: generated frames (valid
//! ones, mutated ones, random bytes), cut into random reads with random
//! descriptors attached, never panic the decoder or the message check,
//! never make it hold more than one frame plus one read, and valid frames
//! come out as they went in.
//!
//! CI decodes 20,000 frames; `BERTH_FUZZ_FRAMES=1000000 cargo test --release
//! -p berth-protocol --test stream_fuzz -- --nocapture` runs a million (the
//! figure in docs/performance.md). The generator has a fixed seed (`BERTH_FUZZ_SEED` to
//! vary it), so a failure repeats.

use berth_protocol::stream::{FrameDecoder, MAX_FRAME, WorkerMessage, frame};

/// xorshift64*: small, fast, and the same everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

const KINDS: &[&str] = &[
    "hello",
    "loaded",
    "load_failed",
    "chunk",
    "done",
    "pong",
    "request",
    "nonsense",
    "",
];

fn json_value(rng: &mut Rng, depth: u32) -> serde_json::Value {
    use serde_json::json;
    match rng.below(if depth > 2 { 4 } else { 6 }) {
        0 => json!(rng.below(1000)),
        1 => json!(format!("s{}", rng.next())),
        2 => json!(null),
        3 => json!(rng.chance(50)),
        4 => serde_json::Value::Array(
            (0..rng.below(4))
                .map(|_| json_value(rng, depth + 1))
                .collect(),
        ),
        _ => {
            let mut m = serde_json::Map::new();
            for i in 0..rng.below(4) {
                m.insert(format!("k{i}"), json_value(rng, depth + 1));
            }
            serde_json::Value::Object(m)
        }
    }
}

/// Makes one member's value.
type Member = fn(&mut Rng) -> serde_json::Value;

/// A header of a random type with random members (right or wrong).
fn header(rng: &mut Rng, payload: usize) -> Vec<u8> {
    use serde_json::json;
    let kind = KINDS[rng.below(KINDS.len() as u64) as usize];
    let mut h = serde_json::Map::new();
    h.insert("type".into(), json!(kind));
    let members: &[(&str, Member)] = &[
        ("id", |r| json!(r.below(5))),
        ("seq", |r| json!(r.below(5))),
        ("body", |r| json_value(r, 0)),
        ("versions", |r| json!([r.below(3)])),
        ("pid", |r| json!(r.below(1 << 20))),
        ("backends", |_| json!(["echo"])),
        ("details", |r| json_value(r, 0)),
        ("error", |r| {
            let kind = ["bad_request", "on_fire", "cancelled"][r.below(3) as usize];
            json!({"kind": kind, "message": "m"})
        }),
        ("stats", |r| {
            json!({"rss_bytes": r.below(9), "peak_rss_bytes": 1, "progress": 2,
                   "requests_done": 3, "in_flight": 0})
        }),
        ("id", |_| json!("not a number")),
    ];
    for (name, make) in members {
        if rng.chance(40) {
            h.insert((*name).into(), make(rng));
        }
    }
    if payload > 0 && rng.chance(97) {
        h.insert("bulk".into(), json!({"inline": payload}));
    } else if rng.chance(3) {
        h.insert("bulk".into(), json!({"memfd": rng.below(64)}));
    }
    serde_json::to_vec(&h).unwrap()
}

fn one_frame(rng: &mut Rng) -> Vec<u8> {
    let max = if rng.chance(5) { 70_000 } else { 64 };
    let payload: Vec<u8> = (0..rng.below(max)).map(|_| rng.next() as u8).collect();
    let h = header(rng, payload.len());
    let mut bytes = frame(&h, &payload);
    match rng.below(30) {
        // Flip bytes anywhere.
        0 => {
            for _ in 0..=rng.below(4) {
                let i = rng.below(bytes.len() as u64) as usize;
                bytes[i] ^= rng.next() as u8 | 1;
            }
        }
        // A random length or header length.
        1 => {
            let field = if rng.chance(50) { 0 } else { 4 };
            let value = match rng.below(4) {
                0 => u32::MAX,
                1 => MAX_FRAME + 1,
                2 => rng.below(8) as u32,
                _ => rng.next() as u32,
            };
            bytes[field..field + 4].copy_from_slice(&value.to_le_bytes());
        }
        // Random bytes altogether.
        2 => {
            bytes = (0..rng.below(100)).map(|_| rng.next() as u8).collect();
        }
        _ => {}
    }
    bytes
}

#[test]
fn the_decoder_survives_every_generated_frame() {
    let frames: u64 = std::env::var("BERTH_FUZZ_FRAMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let seed: u64 = std::env::var("BERTH_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x9e37_79b9_7f4a_7c15);
    let mut rng = Rng(seed | 1);
    let started = std::time::Instant::now();
    let (mut decoded, mut violations, mut messages) = (0u64, 0u64, 0u64);
    let mut decoder: FrameDecoder<u32> = FrameDecoder::new();
    let mut generated = 0u64;
    while generated < frames {
        // A stream of a few frames, fed in random cuts.
        let mut stream = Vec::new();
        for _ in 0..=rng.below(4) {
            stream.extend(one_frame(&mut rng));
            generated += 1;
        }
        let mut at = 0;
        let mut broken = false;
        while at < stream.len() && !broken {
            let max = if rng.chance(20) { 100_000 } else { 200 };
            let cut = (1 + rng.below(max) as usize).min(stream.len() - at);
            let fds: Vec<u32> = (0..if rng.chance(3) { rng.below(3) } else { 0 })
                .map(|i| i as u32)
                .collect();
            if decoder.push(&stream[at..at + cut], fds).is_err() {
                broken = true;
            }
            at += cut;
            while !broken {
                match decoder.next_frame() {
                    Ok(Some(f)) => {
                        decoded += 1;
                        if WorkerMessage::from_header(f.header).is_ok() {
                            messages += 1;
                        }
                    }
                    Ok(None) => break,
                    Err(_) => broken = true,
                }
            }
            assert!(
                decoder.buffered() <= MAX_FRAME as usize + 4 + 100_000,
                "the decoder holds {} bytes",
                decoder.buffered()
            );
        }
        if broken {
            // A broken wire ends the worker; the next stream is a new one.
            violations += 1;
            decoder = FrameDecoder::new();
        }
    }
    eprintln!(
        "{generated} frames generated, {decoded} decoded, {messages} valid worker messages, \
         {violations} streams refused, in {:.2?}",
        started.elapsed()
    );
    assert!(decoded > frames / 4 && messages > 0 && violations > 0);
}

#[test]
fn valid_frames_decode_exactly_whatever_the_cuts() {
    let mut rng = Rng(7);
    for _ in 0..2_000 {
        let id = rng.below(1 << 40);
        let body = json_value(&mut rng, 0);
        let payload: Vec<u8> = (0..rng.below(300)).map(|_| rng.next() as u8).collect();
        let mut header = serde_json::json!({"type": "done", "id": id, "body": body});
        if !payload.is_empty() {
            header["bulk"] = serde_json::json!({"inline": payload.len()});
        }
        // Half say the batch they ran in.
        let run = if rng.below(2) == 0 {
            let run = berth_protocol::RunInfo {
                batch: 1 + rng.below(64) as u32,
                compute_micros: rng.below(1 << 30),
            };
            header["batch"] = run.batch.into();
            header["compute_us"] = run.compute_micros.into();
            run
        } else {
            berth_protocol::RunInfo::default()
        };
        let bytes = frame(&serde_json::to_vec(&header).unwrap(), &payload);
        let mut decoder: FrameDecoder<u32> = FrameDecoder::new();
        let mut out = None;
        let mut at = 0;
        while at < bytes.len() {
            let cut = (1 + rng.below(40) as usize).min(bytes.len() - at);
            decoder.push(&bytes[at..at + cut], Vec::new()).unwrap();
            at += cut;
            if let Some(f) = decoder.next_frame().unwrap() {
                out = Some(f);
            }
        }
        let f = out.expect("the frame came out");
        assert_eq!(f.payload, payload);
        match WorkerMessage::from_header(f.header).unwrap() {
            WorkerMessage::Done {
                id: got,
                result: Ok((json, _)),
                run: got_run,
            } => {
                assert_eq!(got, id);
                assert_eq!(got_run, run);
                let back: serde_json::Value = serde_json::from_str(&json).unwrap();
                assert_eq!(back, body);
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_descriptor_belongs_to_the_frame_whose_first_byte_it_came_with() {
    let with_fd = frame(
        br#"{"type":"done","id":1,"body":{},"bulk":{"memfd":8}}"#,
        &[],
    );
    let plain = frame(br#"{"type":"done","id":2,"body":{}}"#, &[]);
    // Plain frame, then the fd frame in one read with its descriptor: fine.
    let mut d: FrameDecoder<u32> = FrameDecoder::new();
    let mut both = plain.clone();
    both.extend_from_slice(&with_fd);
    d.push(&both, vec![9]).unwrap();
    assert!(d.next_frame().unwrap().unwrap().fd.is_none());
    assert_eq!(d.next_frame().unwrap().unwrap().fd, Some(9));
    // A descriptor with a frame that declares none: refused.
    let mut d: FrameDecoder<u32> = FrameDecoder::new();
    d.push(&plain, vec![9]).unwrap();
    let err = d.next_frame().unwrap_err();
    assert!(err.0.contains("declares none"), "{err}");
    // A frame declaring one that came without: refused.
    let mut d: FrameDecoder<u32> = FrameDecoder::new();
    d.push(&with_fd, Vec::new()).unwrap();
    let err = d.next_frame().unwrap_err();
    assert!(err.0.contains("without a descriptor"), "{err}");
}

#[test]
fn the_ping_example_of_the_spec_is_byte_for_byte() {
    let bytes = frame(br#"{"type":"ping","seq":1}"#, &[]);
    assert_eq!(bytes.len(), 31);
    assert_eq!(&bytes[..8], &[0x1b, 0, 0, 0, 0x17, 0, 0, 0]);
    assert_eq!(
        berth_protocol::stream::ping(1),
        br#"{"seq":1,"type":"ping"}"#.to_vec(),
        "serde_json orders keys; the wire does not care"
    );
}
