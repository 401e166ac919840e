//! Dynamo's own event plane, as Dynamo 1.6.1 sends KV events to its router (pure: bytes
//! in, batches and problems out).
//!
//! **ZMQ** (`--event-plane zmq`, the default): each publisher binds a PUB; a message is
//! four frames, `[topic, publisher_id (u64 BE), sequence (u64 BE), frame]`, where `frame`
//! is a version byte (1), the envelope's length (u32 BE), then the envelope.
//! **NATS** (`--event-plane nats`): core NATS, subject `<prefix>.kv-events`, the
//! envelope as the message body.
//!
//! The envelope is a msgpack map `{publisher_id, sequence, published_at (unix ms),
//! topic, payload (bin)}`; `sequence` counts the publisher's messages from 0. For
//! `kv-events` the payload is a msgpack array of router events:
//!
//! ```text
//! {worker_id, storage_tier: "device"|"host_pinned"|"disk"|"external", residency_domain?,
//!  event: {event_id, dp_rank,
//!          data: {"stored": {parent_hash, start_position, blocks: [{block_hash, tokens_hash, mm_extra_info}]}}
//!              | {"removed": {block_hashes}} | "cleared"}}
//! ```
//!
//! `block_hash` is the engine's hash of the block (`parent_hash` and removals name blocks
//! by it); `tokens_hash` is Dynamo's local hash of its tokens, which is what the router
//! matches prompts against. Token ids are not carried. Unknown keys are ignored and
//! missing optional ones defaulted; an event that cannot be read is reported and
//! skipped, the rest kept. Nothing here panics on any input.

use crate::vllm_events::{block_hash, EventProblem, PayloadError};
use crate::{KvEvent, WorkerKey};
use rmpv::Value;

const MAX_DEPTH: usize = 64;
/// The frame format version Dynamo 1.6.1 writes.
pub(crate) const FRAME_VERSION: u8 = 1;

/// A ZMQ message that is not Dynamo's four-frame shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaneFrameError {
    #[error("expected 4 frames [topic, publisher_id, sequence, frame], got {0}")]
    FrameCount(usize),
    #[error("the {0} frame has {1} bytes, expected 8")]
    IdLength(&'static str, usize),
    #[error("the frame header is {0} bytes, expected at least 5")]
    Short(usize),
    #[error("frame version {0}, expected {FRAME_VERSION}")]
    Version(u8),
    #[error("the frame header says {said} bytes, the frame holds {holds}")]
    Length { said: u32, holds: usize },
}

/// The envelope around every event-plane message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub publisher_id: u64,
    pub sequence: u64,
    pub published_at_ms: u64,
    pub topic: String,
    pub payload: Vec<u8>,
}

/// The envelope bytes of a ZMQ event-plane message.
pub fn split_zmq_frames<B: AsRef<[u8]>>(frames: &[B]) -> Result<&[u8], PlaneFrameError> {
    let [_topic, publisher, sequence, frame] = frames else {
        return Err(PlaneFrameError::FrameCount(frames.len()));
    };
    for (name, f) in [("publisher_id", publisher), ("sequence", sequence)] {
        if f.as_ref().len() != 8 {
            return Err(PlaneFrameError::IdLength(name, f.as_ref().len()));
        }
    }
    let frame = frame.as_ref();
    if frame.len() < 5 {
        return Err(PlaneFrameError::Short(frame.len()));
    }
    if frame[0] != FRAME_VERSION {
        return Err(PlaneFrameError::Version(frame[0]));
    }
    let said = u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]);
    if said as usize != frame.len() - 5 {
        return Err(PlaneFrameError::Length {
            said,
            holds: frame.len() - 5,
        });
    }
    Ok(&frame[5..])
}

pub fn decode_envelope(bytes: &[u8]) -> Result<Envelope, PayloadError> {
    let v = read_one(bytes)?;
    let Value::Map(m) = &v else {
        return Err(PayloadError::NotBatch("the envelope is not a map"));
    };
    let uint = |k: &'static str| get(m, k).and_then(Value::as_u64);
    let payload = match get(m, "payload") {
        Some(Value::Binary(b)) => b.clone(),
        // rmp-serde writes `Vec<u8>` as an array of small ints unless told otherwise.
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_u64().and_then(|b| u8::try_from(b).ok()))
            .collect::<Option<Vec<u8>>>()
            .ok_or(PayloadError::NotBatch("payload array holds a non-byte"))?,
        _ => return Err(PayloadError::NotBatch("no payload")),
    };
    Ok(Envelope {
        publisher_id: uint("publisher_id").ok_or(PayloadError::NotBatch("no publisher_id"))?,
        sequence: uint("sequence").ok_or(PayloadError::NotBatch("no sequence"))?,
        published_at_ms: uint("published_at").unwrap_or(0),
        topic: get(m, "topic")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        payload,
    })
}

/// One router event read off the plane.
#[derive(Debug, Clone, PartialEq)]
pub struct PlaneEvent {
    pub worker: WorkerKey,
    pub event_id: u64,
    pub event: KvEvent,
}

/// The events of one `kv-events` payload.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DecodedEvents {
    pub events: Vec<PlaneEvent>,
    pub problems: Vec<EventProblem>,
}

/// Decode a `kv-events` payload. `block_size` is the worker's (from its model card):
/// the plane does not carry it per event.
pub fn decode_router_events(
    payload: &[u8],
    block_size: u32,
) -> Result<DecodedEvents, PayloadError> {
    let v = read_one(payload)?;
    let Value::Array(raw) = &v else {
        return Err(PayloadError::NotBatch(
            "the payload is not an array of events",
        ));
    };
    let mut out = DecodedEvents::default();
    for (index, ev) in raw.iter().enumerate() {
        match decode_one(ev, block_size) {
            Ok(e) => out.events.push(e),
            Err(p) => out.problems.push(match p {
                Problem::Unknown(event_type) => EventProblem::Unknown { index, event_type },
                Problem::Malformed(reason) => EventProblem::Malformed {
                    index,
                    event_type: "router event".into(),
                    reason,
                },
            }),
        }
    }
    Ok(out)
}

enum Problem {
    Unknown(String),
    Malformed(String),
}

fn decode_one(ev: &Value, block_size: u32) -> Result<PlaneEvent, Problem> {
    let bad = |r: &str| Problem::Malformed(r.to_string());
    let Value::Map(m) = ev else {
        return Err(bad("not a map"));
    };
    let worker_id = get(m, "worker_id")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("no worker_id"))?;
    let medium = match get(m, "storage_tier").and_then(Value::as_str) {
        None | Some("device") => None,
        Some("host_pinned") => Some("CPU".to_string()),
        Some("disk") => Some("DISK".to_string()),
        Some(other) => Some(other.to_ascii_uppercase()),
    };
    let Some(Value::Map(inner)) = get(m, "event") else {
        return Err(bad("no event"));
    };
    let event_id = get(inner, "event_id")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("no event_id"))?;
    let dp_rank = match get(inner, "dp_rank") {
        None | Some(Value::Nil) => 0,
        Some(v) => v
            .as_u64()
            .and_then(|d| u32::try_from(d).ok())
            .ok_or_else(|| bad("dp_rank is not a u32"))?,
    };
    let event = match get(inner, "data") {
        Some(Value::String(s)) if s.as_str() == Some("cleared") => KvEvent::AllBlocksCleared,
        Some(Value::Map(d)) if d.len() == 1 => {
            let (k, body) = &d[0];
            match k.as_str() {
                Some("stored") => stored(body, block_size, medium).map_err(Problem::Malformed)?,
                Some("removed") => {
                    let Value::Map(r) = body else {
                        return Err(bad("removed is not a map"));
                    };
                    KvEvent::BlockRemoved {
                        block_hashes: hash_list(get(r, "block_hashes"), "block_hashes")
                            .map_err(Problem::Malformed)?,
                        medium,
                    }
                }
                Some(other) => return Err(Problem::Unknown(other.to_string())),
                None => return Err(bad("data key is not a string")),
            }
        }
        Some(Value::String(s)) => {
            return Err(Problem::Unknown(s.as_str().unwrap_or("?").to_string()))
        }
        _ => return Err(bad("no data")),
    };
    Ok(PlaneEvent {
        worker: WorkerKey { worker_id, dp_rank },
        event_id,
        event,
    })
}

fn stored(body: &Value, block_size: u32, medium: Option<String>) -> Result<KvEvent, String> {
    let Value::Map(s) = body else {
        return Err("stored is not a map".into());
    };
    let parent_block_hash = match get(s, "parent_hash") {
        None | Some(Value::Nil) => None,
        Some(v) => Some(block_hash(v).map_err(|e| format!("parent_hash: {e}"))?),
    };
    let Some(Value::Array(blocks)) = get(s, "blocks") else {
        return Err("no blocks".into());
    };
    let mut block_hashes = Vec::with_capacity(blocks.len());
    let mut local_hashes = Vec::with_capacity(blocks.len());
    for b in blocks {
        let Value::Map(b) = b else {
            return Err("a block is not a map".into());
        };
        let h = get(b, "block_hash").ok_or("a block without block_hash")?;
        let t = get(b, "tokens_hash").ok_or("a block without tokens_hash")?;
        block_hashes.push(block_hash(h).map_err(|e| format!("block_hash: {e}"))?);
        local_hashes.push(block_hash(t).map_err(|e| format!("tokens_hash: {e}"))?);
    }
    Ok(KvEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids: Vec::new(),
        block_size,
        local_hashes: Some(local_hashes),
        lora_name: None,
        medium,
        cache_salt: None,
    })
}

fn hash_list(v: Option<&Value>, name: &str) -> Result<Vec<u64>, String> {
    let Some(Value::Array(a)) = v else {
        return Err(format!("{name} missing or not an array"));
    };
    a.iter()
        .map(|h| block_hash(h).map_err(|e| format!("{name}: {e}")))
        .collect()
}

fn read_one(bytes: &[u8]) -> Result<Value, PayloadError> {
    let mut rd = bytes;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| PayloadError::NotMsgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(PayloadError::TrailingBytes(rd.len()));
    }
    Ok(v)
}

fn get<'a>(m: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    m.iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// Encode an envelope and its `kv-events` payload as Dynamo 1.6.1 does (named msgpack),
/// for tests and the lab: [`decode_envelope`] and [`decode_router_events`] read it back.
pub fn encode(
    publisher_id: u64,
    sequence: u64,
    published_at_ms: u64,
    events: &[PlaneEvent],
) -> Vec<u8> {
    fn map(kv: Vec<(&str, Value)>) -> Value {
        Value::Map(kv.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
    }
    let ints = |xs: &[u64]| Value::Array(xs.iter().map(|&x| Value::from(x)).collect());
    let events: Vec<Value> = events
        .iter()
        .map(|e| {
            let (data, tier) = match &e.event {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    local_hashes,
                    medium,
                    ..
                } => (
                    map(vec![(
                        "stored",
                        map(vec![
                            (
                                "parent_hash",
                                parent_block_hash.map_or(Value::Nil, Value::from),
                            ),
                            ("start_position", Value::Nil),
                            (
                                "blocks",
                                Value::Array(
                                    block_hashes
                                        .iter()
                                        .zip(local_hashes.iter().flatten())
                                        .map(|(&h, &t)| {
                                            map(vec![
                                                ("block_hash", Value::from(h)),
                                                ("tokens_hash", Value::from(t)),
                                                ("mm_extra_info", Value::Nil),
                                            ])
                                        })
                                        .collect(),
                                ),
                            ),
                        ]),
                    )]),
                    medium.clone(),
                ),
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => (
                    map(vec![(
                        "removed",
                        map(vec![("block_hashes", ints(block_hashes))]),
                    )]),
                    medium.clone(),
                ),
                KvEvent::AllBlocksCleared => (Value::from("cleared"), None),
            };
            let tier = match tier.as_deref() {
                None | Some("GPU") => "device",
                Some("CPU") => "host_pinned",
                Some(_) => "disk",
            };
            map(vec![
                ("worker_id", Value::from(e.worker.worker_id)),
                ("storage_tier", Value::from(tier)),
                (
                    "event",
                    map(vec![
                        ("event_id", Value::from(e.event_id)),
                        ("data", data),
                        ("dp_rank", Value::from(e.worker.dp_rank)),
                    ]),
                ),
            ])
        })
        .collect();
    let mut payload = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut payload, &Value::Array(events));
    let env = map(vec![
        ("publisher_id", Value::from(publisher_id)),
        ("sequence", Value::from(sequence)),
        ("published_at", Value::from(published_at_ms)),
        ("topic", Value::from("kv-events")),
        ("payload", Value::Binary(payload)),
    ]);
    let mut out = Vec::new();
    let _ = rmpv::encode::write_value(&mut out, &env);
    out
}

/// The four ZMQ frames of an envelope (as [`encode`] makes it).
pub fn zmq_frames(publisher_id: u64, sequence: u64, envelope: &[u8]) -> [Vec<u8>; 4] {
    let mut frame = Vec::with_capacity(envelope.len() + 5);
    frame.push(FRAME_VERSION);
    frame.extend_from_slice(&(envelope.len() as u32).to_be_bytes());
    frame.extend_from_slice(envelope);
    [
        b"kv-events".to_vec(),
        publisher_id.to_be_bytes().to_vec(),
        sequence.to_be_bytes().to_vec(),
        frame,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len() / 2)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn the_frame_header_is_checked() {
        let env = encode(7, 3, 1000, &[]);
        let frames = zmq_frames(7, 3, &env);
        assert_eq!(split_zmq_frames(&frames).unwrap(), &env[..]);
        let mut bad = frames.clone();
        bad[3][0] = 2;
        assert_eq!(split_zmq_frames(&bad), Err(PlaneFrameError::Version(2)));
        let mut bad = frames.clone();
        bad[3].push(0);
        assert!(matches!(
            split_zmq_frames(&bad),
            Err(PlaneFrameError::Length { .. })
        ));
        assert_eq!(
            split_zmq_frames(&frames[..3]),
            Err(PlaneFrameError::FrameCount(3))
        );
        let mut bad = frames;
        bad[1].pop();
        assert_eq!(
            split_zmq_frames(&bad),
            Err(PlaneFrameError::IdLength("publisher_id", 7))
        );
    }

    fn sample() -> serde_json::Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../lab/fixtures/samples/dynamo_event_plane.json"
        );
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    }

    fn frames(v: &serde_json::Value) -> Vec<Vec<u8>> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|f| hex(f.as_str().unwrap()))
            .collect()
    }

    /// Real messages of a Dynamo 1.6.1 mocker: each event-plane message carries exactly
    /// the events of the matching vLLM-format message, with Dynamo's local hash of each
    /// block's tokens in place of the tokens.
    #[test]
    fn captured_plane_messages_match_the_engines_own_events() {
        let s = sample();
        let (zmq, vllm) = (s["zmq"].as_array().unwrap(), s["vllm"].as_array().unwrap());
        assert_eq!(zmq.len(), 22);
        let mut events = 0;
        for (i, (z, v)) in zmq.iter().zip(vllm).enumerate() {
            let z = frames(z);
            let env = decode_envelope(split_zmq_frames(&z).unwrap()).unwrap();
            assert_eq!(env.sequence, i as u64);
            assert_eq!(
                env.publisher_id,
                u64::from_be_bytes(z[1][..].try_into().unwrap())
            );
            let plane = decode_router_events(&env.payload, 16).unwrap();
            assert!(plane.problems.is_empty());
            let v = frames(v);
            let (_, payload) = crate::vllm_events::split_frames(&v).unwrap();
            let engine = crate::vllm_events::decode_payload(payload).unwrap();
            assert_eq!(plane.events.len(), engine.events.len(), "message {i}");
            for (p, e) in plane.events.iter().zip(&engine.events) {
                events += 1;
                match (&p.event, e) {
                    (
                        KvEvent::BlockStored {
                            block_hashes: ph,
                            parent_block_hash: pp,
                            local_hashes: Some(locals),
                            ..
                        },
                        KvEvent::BlockStored {
                            block_hashes: eh,
                            parent_block_hash: ep,
                            token_ids,
                            ..
                        },
                    ) => {
                        assert_eq!((ph, pp), (eh, ep));
                        assert_eq!(
                            locals,
                            &crate::hashing::local_block_hashes(
                                token_ids,
                                16,
                                crate::hashing::DYNAMO_HASH_SEED
                            )
                        );
                    }
                    (
                        KvEvent::BlockRemoved {
                            block_hashes: a, ..
                        },
                        KvEvent::BlockRemoved {
                            block_hashes: b, ..
                        },
                    ) => assert_eq!(a, b),
                    other => panic!("message {i}: {other:?}"),
                }
            }
        }
        assert_eq!(events, 23);
        // The NATS run: the same envelope as the body, on the endpoint's subject.
        for n in s["nats"].as_array().unwrap() {
            assert!(n["subject"].as_str().unwrap().ends_with(".kv-events"));
            let env = decode_envelope(&hex(n["payload_hex"].as_str().unwrap())).unwrap();
            assert!(decode_router_events(&env.payload, 16)
                .unwrap()
                .problems
                .is_empty());
        }
    }

    #[test]
    fn events_round_trip_and_the_captured_envelope_decodes() {
        let w = WorkerKey {
            worker_id: 10487897100438067676,
            dp_rank: 1,
        };
        let events = vec![
            PlaneEvent {
                worker: w,
                event_id: 18,
                event: KvEvent::BlockStored {
                    block_hashes: vec![14803036121151050313, 5],
                    parent_block_hash: Some(3871675014319301479),
                    token_ids: Vec::new(),
                    block_size: 16,
                    local_hashes: Some(vec![7673640008819948746, 6]),
                    lora_name: None,
                    medium: None,
                    cache_salt: None,
                },
            },
            PlaneEvent {
                worker: w,
                event_id: 19,
                event: KvEvent::BlockRemoved {
                    block_hashes: vec![5],
                    medium: Some("CPU".into()),
                },
            },
            PlaneEvent {
                worker: w,
                event_id: 20,
                event: KvEvent::AllBlocksCleared,
            },
        ];
        let env = decode_envelope(&encode(6684197695043325, 17, 1796118227999, &events)).unwrap();
        assert_eq!(
            (
                env.publisher_id,
                env.sequence,
                env.published_at_ms,
                env.topic.as_str()
            ),
            (6684197695043325, 17, 1796118227999, "kv-events")
        );
        let got = decode_router_events(&env.payload, 16).unwrap();
        assert!(got.problems.is_empty());
        assert_eq!(got.events, events);

        // A cut envelope is refused.
        let bytes = encode(1, 0, 0, &events);
        assert!(decode_envelope(&bytes[..bytes.len() - 3]).is_err());
    }

    #[test]
    fn bad_events_are_reported_and_the_rest_kept() {
        let good = PlaneEvent {
            worker: WorkerKey {
                worker_id: 1,
                dp_rank: 0,
            },
            event_id: 1,
            event: KvEvent::AllBlocksCleared,
        };
        let env = decode_envelope(&encode(1, 0, 0, std::slice::from_ref(&good))).unwrap();
        let mut payload = rmpv::decode::read_value(&mut &env.payload[..]).unwrap();
        let Value::Array(a) = &mut payload else {
            panic!()
        };
        a.push(Value::from(3));
        a.push(Value::Map(vec![
            (Value::from("worker_id"), Value::from(1)),
            (
                Value::from("event"),
                Value::Map(vec![
                    (Value::from("event_id"), Value::from(2)),
                    (
                        Value::from("data"),
                        Value::Map(vec![(Value::from("pinned"), Value::Nil)]),
                    ),
                ]),
            ),
        ]));
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &payload).unwrap();
        let got = decode_router_events(&bytes, 16).unwrap();
        assert_eq!(got.events, vec![good]);
        assert_eq!(got.problems.len(), 2);
        assert!(
            matches!(&got.problems[1], EventProblem::Unknown { event_type, .. } if event_type == "pinned")
        );
        for garbage in [&b""[..], b"\x93\x01", b"\xc1", b"\x80"] {
            assert!(decode_envelope(garbage).is_err());
            let _ = decode_router_events(garbage, 16);
        }
    }
}
