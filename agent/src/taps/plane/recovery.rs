//! Dynamo's own recovery for its event plane: each KV publisher registers a
//! `worker_kv_query_source_<publisher hex>` endpoint on the TCP request plane (its
//! `recovery_target` in discovery), which answers with the worker's events — the whole
//! tree as events to replay onto an empty cache (`TreeDump`), or the buffered events
//! from an id on (`Events`). The router uses it when it starts late or sees a gap; so
//! does the event-plane tap.
//!
//! One query is two TCP connections, as Dynamo's own request-plane client makes them
//! (Dynamo 1.6.1, read off the wire; all integers big-endian):
//!
//! 1. to the worker's `host:port`: `u16` path length, the path (the registered
//!    `transport.tcp` after `host:port/`), `u16` headers length, a JSON object of
//!    headers, `u32` payload length, and a two-part payload — `u64` header length,
//!    `u64` body length, `u64` checksum (0), a JSON control message naming where to
//!    answer, and the msgpack request `{worker_id, dp_rank, start_event_id,
//!    end_event_id}`. The worker acks with `u32` length + text: empty is accepted.
//! 2. the worker connects back to the address in the control message and streams
//!    two-part frames: a handshake and a prologue (headers only), data frames
//!    `{"data": <answer>, "complete_final": false}` (msgpack bodies), a final marker,
//!    then the header `"sentinel"`.
//!
//! Every size the peer claims is checked against a limit before anything is read for
//! it, and the whole exchange has a deadline.

use kvscope_wire::dynamo_events::{decode_router_events, PlaneEvent};
use kvscope_wire::WorkerKey;
use rmpv::Value;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The most one answer may hold (a tree dump of a large cache is big).
const MAX_FRAME_BYTES: u64 = 512 << 20;

/// What a recovery query gave.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovered {
    /// The events to apply, in order.
    pub events: Vec<PlaneEvent>,
    /// The newest event id they cover: live events up to it are in them.
    pub last_event_id: u64,
    /// A tree dump: the worker's cache is exactly these events applied to an empty one.
    pub dump: bool,
}

/// A fresh id in UUID form (Dynamo's client sends v4 UUIDs; the worker only echoes
/// them).
fn fresh_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let word = || {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.finish()
    };
    let (a, b) = (word(), word());
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        b >> 52,
        b & 0xffff_ffff_ffff
    )
}

fn two_part(header: &[u8], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(24 + header.len() + body.len());
    out.extend_from_slice(&(header.len() as u64).to_be_bytes());
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    out.extend_from_slice(&0u64.to_be_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(body);
    out
}

/// Ask the publisher registered at `tcp` (its recovery target's `transport.tcp`,
/// `host:port/<path>`) for `worker`'s events from `start_event_id` (none: the whole
/// tree). `block_size` is the worker's, for the stored blocks.
pub async fn query(
    tcp: &str,
    worker: WorkerKey,
    start_event_id: Option<u64>,
    block_size: u32,
    timeout: Duration,
) -> Result<Recovered, String> {
    tokio::time::timeout(timeout, exchange(tcp, worker, start_event_id, block_size))
        .await
        .map_err(|_| format!("no complete answer within {timeout:?}"))?
}

async fn exchange(
    tcp: &str,
    worker: WorkerKey,
    start_event_id: Option<u64>,
    block_size: u32,
) -> Result<Recovered, String> {
    let (addr, path) = tcp
        .split_once('/')
        .ok_or_else(|| format!("{tcp:?} is not host:port/path"))?;
    let mut request = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    // Answers come back to the address this host reaches the worker from.
    let local = request.local_addr().map_err(|e| e.to_string())?;
    let listener = TcpListener::bind((local.ip(), 0))
        .await
        .map_err(|e| format!("listening for the answer: {e}"))?;
    let answer_at = listener.local_addr().map_err(|e| e.to_string())?;
    let (id, subject) = (fresh_id(), fresh_id());
    let info = serde_json::json!({
        "address": answer_at.to_string(), "subject": subject, "context": id, "stream_type": "response"
    })
    .to_string();
    let control = serde_json::json!({
        "id": id, "request_type": "single_in", "response_type": "many_out", "payload_codec": "msgpack",
        "connection_info": {"transport": "tcp_server", "info": info}
    })
    .to_string();
    let body = Value::Map(vec![
        ("worker_id".into(), worker.worker_id.into()),
        ("dp_rank".into(), u64::from(worker.dp_rank).into()),
        (
            "start_event_id".into(),
            start_event_id.map_or(Value::Nil, Value::from),
        ),
        ("end_event_id".into(), Value::Nil),
    ]);
    let mut body_bytes = Vec::new();
    rmpv::encode::write_value(&mut body_bytes, &body).map_err(|e| e.to_string())?;
    let payload = two_part(control.as_bytes(), &body_bytes);
    let headers = serde_json::json!({"request-id": id}).to_string();
    let mut frame = Vec::new();
    frame.extend_from_slice(&(path.len() as u16).to_be_bytes());
    frame.extend_from_slice(path.as_bytes());
    frame.extend_from_slice(&(headers.len() as u16).to_be_bytes());
    frame.extend_from_slice(headers.as_bytes());
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(&payload);
    request
        .write_all(&frame)
        .await
        .map_err(|e| format!("sending the query: {e}"))?;
    let n = request
        .read_u32()
        .await
        .map_err(|e| format!("reading the ack: {e}"))?;
    if n != 0 {
        let mut text = vec![0; n.min(4096) as usize];
        let _ = request.read_exact(&mut text).await;
        return Err(format!(
            "the worker refused the query: {}",
            String::from_utf8_lossy(&text)
        ));
    }
    let (mut stream, _) = listener
        .accept()
        .await
        .map_err(|e| format!("waiting for the answer: {e}"))?;
    let mut answer = None;
    loop {
        let hl = stream
            .read_u64()
            .await
            .map_err(|e| format!("answer: {e}"))?;
        let bl = stream
            .read_u64()
            .await
            .map_err(|e| format!("answer: {e}"))?;
        let _checksum = stream
            .read_u64()
            .await
            .map_err(|e| format!("answer: {e}"))?;
        if hl.saturating_add(bl) > MAX_FRAME_BYTES {
            return Err(format!(
                "an answer frame claims {} bytes",
                hl.saturating_add(bl)
            ));
        }
        let mut header = vec![0; hl as usize];
        stream
            .read_exact(&mut header)
            .await
            .map_err(|e| format!("answer: {e}"))?;
        let mut body = vec![0; bl as usize];
        stream
            .read_exact(&mut body)
            .await
            .map_err(|e| format!("answer: {e}"))?;
        if !header.is_empty() {
            let h: serde_json::Value = serde_json::from_slice(&header)
                .map_err(|e| format!("an answer header is not JSON: {e}"))?;
            if h == "sentinel" {
                break;
            }
            if let Some(err) = h.get("error").filter(|e| !e.is_null()) {
                return Err(format!("the worker's handler failed: {err}"));
            }
        }
        if body.is_empty() {
            continue;
        }
        let v = rmpv::decode::read_value(&mut body.as_slice())
            .map_err(|e| format!("an answer body is not msgpack: {e}"))?;
        if let Some(data) = field(&v, "data") {
            answer = Some(response(data, block_size)?);
        }
    }
    answer.ok_or_else(|| "the worker's answer held no data".into())
}

fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    match v {
        Value::Map(m) => m
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v),
        _ => None,
    }
}

/// A `WorkerKvQueryResponse` (externally tagged).
fn response(data: &Value, block_size: u32) -> Result<Recovered, String> {
    if let Some(e) = field(data, "Error") {
        return Err(format!("the worker answered: {e}"));
    }
    let (body, dump) = match (field(data, "TreeDump"), field(data, "Events")) {
        (Some(b), _) => (b, true),
        (None, Some(b)) => (b, false),
        _ => return Err(format!("an answer kvscope does not know: {data}")),
    };
    let last_event_id = field(body, "last_event_id")
        .and_then(Value::as_u64)
        .ok_or("an answer without last_event_id")?;
    let events = field(body, "events")
        .cloned()
        .unwrap_or(Value::Array(Vec::new()));
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &events).map_err(|e| e.to_string())?;
    let decoded = decode_router_events(&bytes, block_size).map_err(|e| e.to_string())?;
    if !decoded.problems.is_empty() {
        return Err(format!(
            "{} of the answer's events could not be read",
            decoded.problems.len()
        ));
    }
    Ok(Recovered {
        events: decoded.events,
        last_event_id,
        dump,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_read_as_dynamo_writes_them() {
        // The shape of a real mocker's TreeDump and an Error (msgpack, named fields).
        let stored = Value::Map(vec![
            ("worker_id".into(), 7u64.into()),
            ("storage_tier".into(), "device".into()),
            (
                "event".into(),
                Value::Map(vec![
                    ("event_id".into(), 1u64.into()),
                    (
                        "data".into(),
                        Value::Map(vec![(
                            "stored".into(),
                            Value::Map(vec![
                                ("parent_hash".into(), Value::Nil),
                                (
                                    "blocks".into(),
                                    Value::Array(vec![Value::Map(vec![
                                        ("block_hash".into(), 11u64.into()),
                                        ("tokens_hash".into(), 22u64.into()),
                                    ])]),
                                ),
                            ]),
                        )]),
                    ),
                    ("dp_rank".into(), 0u64.into()),
                ]),
            ),
        ]);
        let dump = Value::Map(vec![(
            "TreeDump".into(),
            Value::Map(vec![
                ("events".into(), Value::Array(vec![stored])),
                ("last_event_id".into(), 5u64.into()),
                ("reset_scope".into(), "all".into()),
            ]),
        )]);
        let r = response(&dump, 16).unwrap();
        assert!(r.dump);
        assert_eq!(r.last_event_id, 5);
        assert_eq!(r.events.len(), 1);
        assert_eq!(
            r.events[0].worker,
            WorkerKey {
                worker_id: 7,
                dp_rank: 0
            }
        );
        let err = Value::Map(vec![("Error".into(), "dp_rank mismatch".into())]);
        assert!(response(&err, 16).unwrap_err().contains("dp_rank mismatch"));
        let too_new = Value::Map(vec![("TooNew".into(), Value::Map(vec![]))]);
        assert!(response(&too_new, 16).is_err());
        let id = fresh_id();
        assert_eq!(id.len(), 36);
        assert_ne!(id, fresh_id());
    }
}
