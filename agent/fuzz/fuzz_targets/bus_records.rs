//! Any bytes as what reaches the collector from the bus and from Dynamo's event plane:
//! a record's JSON, a bundle of records, a part of a record (with any part header), an
//! event-plane envelope and its router events. Never a panic; the part joiner never holds more than its
//! limit.
#![no_main]

use kvscope_wire::dynamo_events::{decode_envelope, decode_router_events, split_zmq_frames};
use kvscope_wire::parts::{PartsLimits, Reassembler};
use kvscope_wire::Envelope;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = Envelope::from_json(data);
    for entry in kvscope_wire::bundle::entries("kvscope.c.a.records", data).flatten() {
        assert!(!entry.subject.is_empty());
        let _ = Envelope::from_json(entry.json);
    }
    if let Ok(env) = decode_envelope(data) {
        let _ = decode_router_events(&env.payload, 16);
    }
    let _ = decode_router_events(data, 16);
    if data.len() >= 3 {
        let (a, b) = (
            usize::from(data[0]) % data.len(),
            usize::from(data[1]) % data.len(),
        );
        let (a, b) = (a.min(b), a.max(b));
        let frames = [&data[..a], &data[a..b], &data[b..], &data[..0]];
        let _ = split_zmq_frames(&frames);
    }
    // Parts: the bytes cut into messages whose ids and part headers come from the bytes.
    let limits = PartsLimits {
        max_record_bytes: 1024,
        max_open_records: 4,
    };
    let mut r = Reassembler::new(limits);
    for (i, chunk) in data.chunks(37).enumerate() {
        let id = format!(
            "run{}-{}:{}",
            chunk[0] % 3,
            chunk.get(1).copied().unwrap_or(0) % 4,
            i
        );
        let part = format!(
            "{}/{}",
            chunk.get(2).copied().unwrap_or(0) % 5,
            chunk.get(3).copied().unwrap_or(1) % 6
        );
        let _ = r.accept(
            Some(&id),
            (chunk[0] % 2 == 0).then_some(part.as_str()),
            chunk,
        );
        assert!(r.held_bytes() <= limits.max_record_bytes * limits.max_open_records);
    }
});
