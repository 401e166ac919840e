//! vLLM's KV event wire format (pure: bytes in, events and problems out; and the encoder
//! the NIXL lab's workers publish with). The agent taps publishers with the decoder.
//!
//! A ZMQ message is the multipart `[topic, seq (u64 big-endian), payload]`; the payload
//! is msgpack `[ts: f64, [event…], dp_rank]` (`dp_rank` may be nil or missing; a map
//! `{ts, events, data_parallel_rank}` is accepted too). Events come in two encodings:
//!
//! - positional tagged arrays (msgspec `array_like` structs with `tag=True`, vLLM before
//!   PR #42892): `["BlockStored", block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id, medium, lora_name, extra_keys, group_idx, …]`,
//!   `["BlockRemoved", block_hashes, medium, group_idx]`, `["AllBlocksCleared"]`;
//! - maps with a `type` key (newer vLLM and Dynamo's mocker):
//!   `{type: "BlockStored", block_hashes, parent_block_hash, token_ids, block_size, …}`.
//!
//! Trailing and unknown fields are ignored, optional ones may be missing. Block hashes
//! are msgpack uint64, signed int64 (SGLang; the bits are kept) or bytes (the low 64
//! bits read big-endian, i.e. the last 8 bytes; shorter strings are left-padded).
//! An event of an unknown type or with bad fields is reported as an [`EventProblem`]
//! and skipped; the rest of the batch is kept. Nothing here panics on any input.

use crate::KvEvent;
use rmpv::Value;

/// Deepest msgpack nesting accepted. A batch nests about six levels (extra_keys hold
/// tuples inside lists); the bound keeps hostile input from recursing deep.
const MAX_DEPTH: usize = 64;

/// The ZMQ message was not a `[topic, seq, payload]` multipart.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("expected 3 frames [topic, seq, payload], got {0}")]
    FrameCount(usize),
    #[error("the sequence frame has {0} bytes, expected 8")]
    SeqLength(usize),
}

/// The payload was not msgpack, or not the batch shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    #[error("not msgpack: {0}")]
    NotMsgpack(String),
    #[error("{0} bytes after the msgpack value")]
    TrailingBytes(usize),
    #[error("not a KV event batch: {0}")]
    NotBatch(&'static str),
}

/// An event that was skipped, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventProblem {
    /// A well-formed event of a type this decoder does not know.
    Unknown { index: usize, event_type: String },
    /// An event with no type, or a known type with fields missing or of the wrong type.
    Malformed {
        index: usize,
        event_type: String,
        reason: String,
    },
}

/// A decoded payload.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedPayload {
    pub engine_ts: f64,
    pub dp_rank: Option<u32>,
    pub events: Vec<KvEvent>,
    pub problems: Vec<EventProblem>,
}

/// Split a multipart message into its sequence number and payload.
pub fn split_frames<B: AsRef<[u8]>>(frames: &[B]) -> Result<(u64, &[u8]), FrameError> {
    let [_topic, seq, payload] = frames else {
        return Err(FrameError::FrameCount(frames.len()));
    };
    let seq: [u8; 8] = seq
        .as_ref()
        .try_into()
        .map_err(|_| FrameError::SeqLength(seq.as_ref().len()))?;
    Ok((u64::from_be_bytes(seq), payload.as_ref()))
}

/// Decode one msgpack payload.
pub fn decode_payload(bytes: &[u8]) -> Result<DecodedPayload, PayloadError> {
    let mut rd = bytes;
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| PayloadError::NotMsgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(PayloadError::TrailingBytes(rd.len()));
    }
    let (ts, events, dp_rank) = match &value {
        Value::Array(a) if a.len() >= 2 => (&a[0], &a[1], a.get(2)),
        Value::Array(_) => return Err(PayloadError::NotBatch("fewer than 2 elements")),
        Value::Map(m) => (
            map_get(m, "ts").ok_or(PayloadError::NotBatch("no ts"))?,
            map_get(m, "events").ok_or(PayloadError::NotBatch("no events"))?,
            map_get(m, "data_parallel_rank").or_else(|| map_get(m, "dp_rank")),
        ),
        _ => return Err(PayloadError::NotBatch("neither an array nor a map")),
    };
    let engine_ts = as_f64(ts).ok_or(PayloadError::NotBatch("ts is not a number"))?;
    let Value::Array(raw_events) = events else {
        return Err(PayloadError::NotBatch("events is not an array"));
    };
    let dp_rank = match dp_rank {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|r| u32::try_from(r).ok())
                .ok_or(PayloadError::NotBatch("dp_rank is not a u32 or nil"))?,
        ),
    };
    let mut out = DecodedPayload {
        engine_ts,
        dp_rank,
        events: Vec::with_capacity(raw_events.len()),
        problems: Vec::new(),
    };
    for (index, raw) in raw_events.iter().enumerate() {
        match decode_event(raw) {
            Ok(ev) => out.events.push(ev),
            Err(EventError::Unknown(event_type)) => out
                .problems
                .push(EventProblem::Unknown { index, event_type }),
            Err(EventError::Malformed { event_type, reason }) => {
                out.problems.push(EventProblem::Malformed {
                    index,
                    event_type,
                    reason,
                })
            }
        }
    }
    Ok(out)
}

enum EventError {
    Unknown(String),
    Malformed { event_type: String, reason: String },
}

/// Field access over both encodings: by position in a tagged array, by name in a map.
enum Fields<'a> {
    Positional(&'a [Value]),
    Named(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    /// The field at `pos` (array, counting the tag as 0) or named `name` (map). Nil
    /// counts as missing.
    fn get(&self, pos: usize, name: &str) -> Option<&'a Value> {
        let v = match self {
            Fields::Positional(a) => a.get(pos),
            Fields::Named(m) => map_get(m, name),
        };
        v.filter(|v| !v.is_nil())
    }
}

fn decode_event(raw: &Value) -> Result<KvEvent, EventError> {
    let (event_type, fields) = match raw {
        Value::Array(a) => match a.first() {
            Some(Value::String(s)) => (s.as_str(), Fields::Positional(a)),
            _ => return Err(malformed("?", "array without a string tag")),
        },
        Value::Map(m) => match map_get(m, "type") {
            Some(Value::String(s)) => (s.as_str(), Fields::Named(m)),
            _ => return Err(malformed("?", "map without a string `type`")),
        },
        _ => return Err(malformed("?", "neither an array nor a map")),
    };
    let Some(event_type) = event_type else {
        return Err(malformed("?", "type is not UTF-8"));
    };
    let bad = |reason: String| malformed(event_type, &reason);
    match event_type {
        "BlockStored" => Ok(KvEvent::BlockStored {
            block_hashes: hashes(fields.get(1, "block_hashes")).map_err(bad)?,
            parent_block_hash: match fields.get(2, "parent_block_hash") {
                None => None,
                Some(v) => Some(block_hash(v).map_err(|e| bad(format!("parent_block_hash: {e}")))?),
            },
            token_ids: token_ids(fields.get(3, "token_ids")).map_err(bad)?,
            local_hashes: None,
            block_size: fields
                .get(4, "block_size")
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .ok_or_else(|| bad("block_size missing or not a u32".into()))?,
            medium: opt_string(fields.get(6, "medium"), "medium").map_err(bad)?,
            lora_name: opt_string(fields.get(7, "lora_name"), "lora_name").map_err(bad)?,
        }),
        "BlockRemoved" => Ok(KvEvent::BlockRemoved {
            block_hashes: hashes(fields.get(1, "block_hashes")).map_err(bad)?,
            medium: opt_string(fields.get(2, "medium"), "medium").map_err(bad)?,
        }),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(EventError::Unknown(other.to_string())),
    }
}

fn malformed(event_type: &str, reason: &str) -> EventError {
    EventError::Malformed {
        event_type: event_type.to_string(),
        reason: reason.to_string(),
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<u64>, String> {
    let Some(Value::Array(a)) = v else {
        return Err("block_hashes missing or not an array".into());
    };
    a.iter()
        .map(|h| block_hash(h).map_err(|e| format!("block_hashes: {e}")))
        .collect()
}

/// One engine block hash as u64: unsigned as sent, signed by its bits, bytes by their
/// low 64 bits read big-endian.
pub fn block_hash(v: &Value) -> Result<u64, String> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|s| s as u64))
            .ok_or_else(|| "integer out of range".to_string()),
        Value::Binary(b) => Ok(low_u64_be(b)),
        other => Err(format!("hash of type {}", type_name(other))),
    }
}

fn low_u64_be(b: &[u8]) -> u64 {
    let tail = &b[b.len().saturating_sub(8)..];
    let mut buf = [0u8; 8];
    buf[8 - tail.len()..].copy_from_slice(tail);
    u64::from_be_bytes(buf)
}

fn token_ids(v: Option<&Value>) -> Result<Vec<u32>, String> {
    let Some(Value::Array(a)) = v else {
        return Err("token_ids missing or not an array".into());
    };
    a.iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| format!("token id of type {} is not a u32", type_name(t)))
        })
        .collect()
}

fn opt_string(v: Option<&Value>, name: &str) -> Result<Option<String>, String> {
    match v {
        None => Ok(None),
        Some(Value::String(s)) => s
            .as_str()
            .map(|s| Some(s.to_string()))
            .ok_or_else(|| format!("{name} is not UTF-8")),
        Some(other) => Err(format!("{name} of type {}", type_name(other))),
    }
}

fn map_get<'a>(m: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    m.iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::F64(f) => Some(*f),
        Value::F32(f) => Some(f64::from(*f)),
        Value::Integer(i) => i.as_f64(),
        _ => None,
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "bool",
        Value::Integer(_) => "int",
        Value::F32(_) | Value::F64(_) => "float",
        Value::String(_) => "str",
        Value::Binary(_) => "bin",
        Value::Array(_) => "array",
        Value::Map(_) => "map",
        Value::Ext(..) => "ext",
    }
}

/// Encode a batch the way vLLM (since PR #42892) and Dynamo's mocker publish it: the
/// payload `[ts, [event…], dp_rank]` with every event a map with a `type` key, block
/// hashes as msgpack uint64. [`decode_payload`] reads it back unchanged.
pub fn encode_payload(engine_ts: f64, events: &[KvEvent], dp_rank: u32) -> Vec<u8> {
    fn hashes(xs: &[u64]) -> Value {
        Value::Array(xs.iter().map(|&x| Value::from(x)).collect())
    }
    fn map(kv: Vec<(&str, Value)>) -> Value {
        Value::Map(kv.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
    }
    fn opt_str(x: Option<&str>) -> Value {
        x.map_or(Value::Nil, Value::from)
    }
    let events = events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_name,
                medium,
                // vLLM's format carries tokens, not Dynamo's hashes of them.
                local_hashes: _,
            } => map(vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", hashes(block_hashes)),
                (
                    "parent_block_hash",
                    parent_block_hash.map_or(Value::Nil, Value::from),
                ),
                (
                    "token_ids",
                    Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                ),
                ("block_size", Value::from(*block_size)),
                ("lora_id", Value::Nil),
                ("medium", opt_str(medium.as_deref())),
                ("lora_name", opt_str(lora_name.as_deref())),
            ]),
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => map(vec![
                ("type", Value::from("BlockRemoved")),
                ("block_hashes", hashes(block_hashes)),
                ("medium", opt_str(medium.as_deref())),
            ]),
            KvEvent::AllBlocksCleared => map(vec![("type", Value::from("AllBlocksCleared"))]),
        })
        .collect();
    let batch = Value::Array(vec![
        Value::F64(engine_ts),
        Value::Array(events),
        Value::from(dp_rank),
    ]);
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

/// The multipart message of one batch: `[topic, seq (u64 big-endian), payload]`.
pub fn frames(topic: &[u8], seq: u64, payload: Vec<u8>) -> [Vec<u8>; 3] {
    [topic.to_vec(), seq.to_be_bytes().to_vec(), payload]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn batch(events: Vec<Value>, dp: Option<Value>) -> Value {
        let mut a = vec![Value::F64(1.5), Value::Array(events)];
        if let Some(dp) = dp {
            a.push(dp);
        }
        Value::Array(a)
    }

    fn ints(xs: &[u64]) -> Value {
        Value::Array(xs.iter().map(|&x| Value::from(x)).collect())
    }

    fn map(kv: Vec<(&str, Value)>) -> Value {
        Value::Map(kv.into_iter().map(|(k, v)| (s(k), v)).collect())
    }

    fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, bs: u32) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: tokens,
            block_size: bs,
            local_hashes: None,
            lora_name: None,
            medium: None,
        }
    }

    #[test]
    fn the_encoder_round_trips_every_event_type() {
        let events = vec![
            KvEvent::BlockStored {
                block_hashes: vec![u64::MAX, 2],
                parent_block_hash: Some(7),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                local_hashes: None,
                lora_name: None,
                medium: Some("GPU".into()),
            },
            stored(vec![3], None, vec![5, 6], 2),
            KvEvent::BlockRemoved {
                block_hashes: vec![2],
                medium: None,
            },
            KvEvent::AllBlocksCleared,
        ];
        let bytes = encode_payload(12.5, &events, 3);
        let p = decode_payload(&bytes).unwrap();
        assert_eq!((p.engine_ts, p.dp_rank), (12.5, Some(3)));
        assert!(p.problems.is_empty(), "{:?}", p.problems);
        assert_eq!(p.events, events);
        let f = frames(b"", 9, bytes.clone());
        assert_eq!(split_frames(&f).unwrap(), (9, bytes.as_slice()));
    }

    #[test]
    fn positional_events_with_all_vllm_fields() {
        let ev = Value::Array(vec![
            s("BlockStored"),
            ints(&[u64::MAX, 2]),
            Value::from(7u64),
            ints(&[1, 2, 3, 4]),
            Value::from(2u64),
            Value::Nil,                                 // lora_id
            s("GPU"),                                   // medium
            s("adapter"),                               // lora_name
            Value::Array(vec![Value::Nil, Value::Nil]), // extra_keys
            Value::from(0u64),                          // group_idx
            s("full_attention"),
            Value::Nil,
            s("some future field"),
        ]);
        let removed = Value::Array(vec![
            s("BlockRemoved"),
            ints(&[2]),
            s("GPU"),
            Value::from(0),
        ]);
        let cleared = Value::Array(vec![s("AllBlocksCleared")]);
        let p = decode_payload(&encode(&batch(
            vec![ev, removed, cleared],
            Some(Value::from(1)),
        )))
        .unwrap();
        assert_eq!(p.engine_ts, 1.5);
        assert_eq!(p.dp_rank, Some(1));
        assert!(p.problems.is_empty());
        assert_eq!(
            p.events,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![u64::MAX, 2],
                    parent_block_hash: Some(7),
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    local_hashes: None,
                    lora_name: Some("adapter".into()),
                    medium: Some("GPU".into()),
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![2],
                    medium: Some("GPU".into())
                },
                KvEvent::AllBlocksCleared,
            ]
        );
    }

    #[test]
    fn positional_events_with_only_the_first_fields() {
        let ev = Value::Array(vec![
            s("BlockStored"),
            ints(&[5]),
            Value::Nil,
            ints(&[9, 9]),
            Value::from(2u64),
        ]);
        let removed = Value::Array(vec![s("BlockRemoved"), ints(&[5])]);
        let p = decode_payload(&encode(&batch(vec![ev, removed], None))).unwrap();
        assert_eq!(p.dp_rank, None);
        assert_eq!(
            p.events,
            vec![
                stored(vec![5], None, vec![9, 9], 2),
                KvEvent::BlockRemoved {
                    block_hashes: vec![5],
                    medium: None
                }
            ]
        );
    }

    #[test]
    fn map_events_with_unknown_and_missing_fields() {
        let ev = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints(&[1, 2])),
            ("token_ids", ints(&[1, 2, 3, 4])),
            ("block_size", Value::from(2)),
            ("group_idx", Value::from(0)),
            ("locality", s("local")),
        ]);
        let removed = map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", ints(&[1])),
            ("medium", s("CPU")),
        ]);
        let p = decode_payload(&encode(&batch(
            vec![ev, removed, map(vec![("type", s("AllBlocksCleared"))])],
            Some(Value::Nil),
        )))
        .unwrap();
        assert!(p.problems.is_empty());
        assert_eq!(
            p.events,
            vec![
                stored(vec![1, 2], None, vec![1, 2, 3, 4], 2),
                KvEvent::BlockRemoved {
                    block_hashes: vec![1],
                    medium: Some("CPU".into())
                },
                KvEvent::AllBlocksCleared
            ]
        );
    }

    #[test]
    fn hashes_as_signed_ints_and_bytes() {
        assert_eq!(block_hash(&Value::from(-1i64)).unwrap(), u64::MAX);
        assert_eq!(block_hash(&Value::from(i64::MIN)).unwrap(), 1u64 << 63);
        let digest: Vec<u8> = (0u8..32).collect();
        assert_eq!(
            block_hash(&Value::Binary(digest)).unwrap(),
            u64::from_be_bytes([24, 25, 26, 27, 28, 29, 30, 31])
        );
        assert_eq!(block_hash(&Value::Binary(vec![1, 2])).unwrap(), 0x0102);
        assert_eq!(block_hash(&Value::Binary(vec![])).unwrap(), 0);
        assert!(block_hash(&s("x")).is_err());
        assert!(block_hash(&Value::F64(1.0)).is_err());
    }

    #[test]
    fn unknown_event_types_are_skipped_and_the_rest_kept() {
        let unknown = Value::Array(vec![s("BlockPinned"), ints(&[1])]);
        let unknown_map = map(vec![("type", s("Offloaded"))]);
        let cleared = Value::Array(vec![s("AllBlocksCleared")]);
        let p = decode_payload(&encode(&batch(vec![unknown, cleared, unknown_map], None))).unwrap();
        assert_eq!(p.events, vec![KvEvent::AllBlocksCleared]);
        assert_eq!(
            p.problems,
            vec![
                EventProblem::Unknown {
                    index: 0,
                    event_type: "BlockPinned".into()
                },
                EventProblem::Unknown {
                    index: 2,
                    event_type: "Offloaded".into()
                }
            ]
        );
    }

    #[test]
    fn malformed_events_are_skipped_and_the_rest_kept() {
        let cases = vec![
            Value::from(3),                                   // not an event
            Value::Array(vec![]),                             // no tag
            Value::Array(vec![Value::from(1)]),               // int tag
            map(vec![("block_hashes", ints(&[1]))]),          // no type
            Value::Array(vec![s("BlockStored"), ints(&[1])]), // missing fields
            Value::Array(vec![
                s("BlockStored"),
                s("x"),
                Value::Nil,
                ints(&[1]),
                Value::from(1),
            ]), // hashes not array
            Value::Array(vec![
                s("BlockStored"),
                ints(&[1]),
                Value::Nil,
                ints(&[1 << 40]),
                Value::from(1),
            ]), // token > u32
            Value::Array(vec![
                s("BlockStored"),
                ints(&[1]),
                s("p"),
                ints(&[1]),
                Value::from(1),
            ]), // parent a string
            Value::Array(vec![
                s("BlockStored"),
                ints(&[1]),
                Value::Nil,
                ints(&[1]),
                Value::from(-1),
            ]), // negative block size
            Value::Array(vec![
                s("BlockStored"),
                ints(&[1]),
                Value::Nil,
                ints(&[1]),
                Value::from(1),
                Value::Nil,
                Value::from(5),
            ]), // medium an int
            Value::Array(vec![s("BlockRemoved"), Value::Array(vec![Value::F64(1.0)])]), // float hash
            map(vec![("type", s("BlockRemoved"))]),                                     // no hashes
        ];
        let n = cases.len();
        let mut events = cases;
        events.push(Value::Array(vec![s("AllBlocksCleared")]));
        let p = decode_payload(&encode(&batch(events, None))).unwrap();
        assert_eq!(p.events, vec![KvEvent::AllBlocksCleared]);
        assert_eq!(p.problems.len(), n);
        assert!(
            p.problems
                .iter()
                .all(|x| matches!(x, EventProblem::Malformed { .. })),
            "{:?}",
            p.problems
        );
    }

    #[test]
    fn malformed_msgpack_and_wrong_shapes_are_payload_errors() {
        assert!(matches!(
            decode_payload(b""),
            Err(PayloadError::NotMsgpack(_))
        ));
        assert!(decode_payload(&[0xc1]).is_err()); // the reserved marker
        assert!(matches!(
            decode_payload(&[0x93, 0xcb, 0x41]),
            Err(PayloadError::NotMsgpack(_))
        )); // truncated
        assert!(matches!(
            decode_payload(&[0xdd, 0xff, 0xff, 0xff, 0xff]),
            Err(PayloadError::NotMsgpack(_))
        )); // huge array, no data
        let good = encode(&batch(vec![], None));
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(
            decode_payload(&trailing),
            Err(PayloadError::TrailingBytes(1))
        );
        for v in [
            Value::from(1),
            Value::Array(vec![Value::F64(1.0)]),
            Value::Array(vec![s("ts"), Value::Array(vec![])]),
            Value::Array(vec![Value::F64(1.0), Value::from(2)]),
            Value::Array(vec![Value::F64(1.0), Value::Array(vec![]), s("rank")]),
            Value::Array(vec![Value::F64(1.0), Value::Array(vec![]), Value::from(-1)]),
            map(vec![("events", Value::Array(vec![]))]),
        ] {
            assert!(
                matches!(decode_payload(&encode(&v)), Err(PayloadError::NotBatch(_))),
                "{v:?}"
            );
        }
        // Deep nesting is refused, not recursed into.
        let deep: Vec<u8> = std::iter::repeat_n(0x91u8, 100_000).collect();
        assert!(decode_payload(&deep).is_err());
    }

    #[test]
    fn a_map_shaped_batch_is_accepted() {
        let b = map(vec![
            ("ts", Value::F64(2.0)),
            (
                "events",
                Value::Array(vec![Value::Array(vec![s("AllBlocksCleared")])]),
            ),
            ("data_parallel_rank", Value::from(3)),
        ]);
        let p = decode_payload(&encode(&b)).unwrap();
        assert_eq!((p.engine_ts, p.dp_rank, p.events.len()), (2.0, Some(3), 1));
    }

    #[test]
    fn truncated_and_odd_frames() {
        let seq = 5u64.to_be_bytes();
        assert_eq!(
            split_frames(&[b"".as_slice(), &seq, b"x"]).unwrap(),
            (5, b"x".as_slice())
        );
        assert_eq!(split_frames::<&[u8]>(&[]), Err(FrameError::FrameCount(0)));
        assert_eq!(
            split_frames(&[b"".as_slice(), &seq]),
            Err(FrameError::FrameCount(2))
        );
        assert_eq!(
            split_frames(&[b"".as_slice(), &seq, b"", b""]),
            Err(FrameError::FrameCount(4))
        );
        assert_eq!(
            split_frames(&[b"".as_slice(), &seq[..7], b"x"]),
            Err(FrameError::SeqLength(7))
        );
        // A payload cut short anywhere is an error, never a panic.
        let full = encode(&batch(
            vec![Value::Array(vec![
                s("BlockStored"),
                ints(&[1, 2]),
                Value::Nil,
                ints(&[1, 2, 3, 4]),
                Value::from(2),
            ])],
            Some(Value::from(0)),
        ));
        for cut in 0..full.len() {
            assert!(decode_payload(&full[..cut]).is_err(), "cut at {cut}");
        }
        assert!(decode_payload(&full).is_ok());
    }

    /// The mocker messages captured from the lab (Dynamo 1.6.1, map encoding).
    #[test]
    fn decodes_the_captured_mocker_messages() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../lab/fixtures/samples/kv_events_mocker.json"
        );
        let sample: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let msgs = sample["messages"].as_array().unwrap();
        assert!(!msgs.is_empty());
        for m in msgs {
            let frames: Vec<Vec<u8>> = m["frames_hex"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| hex(h.as_str().unwrap()))
                .collect();
            let (seq, payload) = split_frames(&frames).unwrap();
            assert_eq!(seq, m["seq"].as_u64().unwrap());
            let p = decode_payload(payload).unwrap();
            assert!(p.problems.is_empty(), "{:?}", p.problems);
            let want = &m["decoded_payload"];
            assert_eq!(p.engine_ts, want[0].as_f64().unwrap());
            assert_eq!(p.dp_rank.map(u64::from), want[2].as_u64());
            let want_events = want[1].as_array().unwrap();
            assert_eq!(p.events.len(), want_events.len());
            for (got, w) in p.events.iter().zip(want_events) {
                let hashes: Vec<u64> = w["block_hashes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|h| h.as_u64().unwrap())
                    .collect();
                match (got, w["type"].as_str().unwrap()) {
                    (
                        KvEvent::BlockStored {
                            block_hashes,
                            parent_block_hash,
                            token_ids,
                            block_size,
                            ..
                        },
                        "BlockStored",
                    ) => {
                        assert_eq!(block_hashes, &hashes);
                        assert_eq!(*parent_block_hash, w["parent_block_hash"].as_u64());
                        assert_eq!(token_ids.len(), w["token_ids"].as_array().unwrap().len());
                        assert_eq!(u64::from(*block_size), w["block_size"].as_u64().unwrap());
                    }
                    (KvEvent::BlockRemoved { block_hashes, .. }, "BlockRemoved") => {
                        assert_eq!(block_hashes, &hashes)
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
    }

    fn hex(h: &str) -> Vec<u8> {
        (0..h.len() / 2)
            .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).unwrap())
            .collect()
    }

    /// A few thousand random and mutated inputs: the decoder must return, never panic.
    #[test]
    fn never_panics_on_random_or_mutated_input() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let seeds: Vec<Vec<u8>> = vec![
            encode(&batch(
                vec![
                    Value::Array(vec![
                        s("BlockStored"),
                        ints(&[1, 2]),
                        Value::from(3),
                        ints(&[1, 2, 3, 4]),
                        Value::from(2),
                        Value::Nil,
                        s("GPU"),
                    ]),
                    Value::Array(vec![s("BlockRemoved"), ints(&[1]), s("GPU")]),
                    Value::Array(vec![s("AllBlocksCleared")]),
                ],
                Some(Value::from(0)),
            )),
            encode(&batch(
                vec![map(vec![
                    ("type", s("BlockStored")),
                    (
                        "block_hashes",
                        Value::Array(vec![Value::Binary(vec![1; 32]), Value::from(-5)]),
                    ),
                    ("parent_block_hash", Value::Nil),
                    ("token_ids", ints(&[1, 2])),
                    ("block_size", Value::from(1)),
                ])],
                None,
            )),
        ];
        let mut decoded_ok = 0;
        for i in 0..4000 {
            let input: Vec<u8> = if i % 4 == 0 {
                (0..(next() % 64)).map(|_| next() as u8).collect()
            } else {
                let mut m = seeds[i % seeds.len()].clone();
                for _ in 0..=(next() % 4) {
                    let pos = (next() as usize) % m.len();
                    match next() % 3 {
                        0 => m[pos] = next() as u8,
                        1 => m.truncate(pos),
                        _ => m.insert(pos, next() as u8),
                    }
                    if m.is_empty() {
                        break;
                    }
                }
                m
            };
            if decode_payload(&input).is_ok() {
                decoded_ok += 1;
            }
            let seq = next().to_be_bytes();
            let _ = split_frames(&[b"".as_slice(), &seq[..(next() % 9) as usize], &input]);
        }
        // Some mutations leave a valid batch (changed numbers, truncated token lists):
        // the test exercises the event paths, not only the top-level rejection.
        assert!(decoded_ok > 0);
    }
}
