//! The normalized records an agent observes and the collector consumes.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The wall clock, UNIX nanoseconds: the time base of every record and of the
/// collector's `available_ns` stamps (agent, collector and benchmarks share it).
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// One cache as the router names it: a worker instance and its data-parallel rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerKey {
    pub worker_id: u64,
    #[serde(default)]
    pub dp_rank: u32,
}

impl std::fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}

/// A record with who saw it and when (UNIX nanoseconds on the agent's clock). The
/// collector's windows are cut on `observed_ns`, so a replay of the same records gives
/// the same windows whatever the wall clock says during the replay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    pub agent: String,
    pub observed_ns: u64,
    pub record: Record,
}

impl Envelope {
    pub fn to_json(&self) -> Vec<u8> {
        // Serializing these plain data types cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// One ZMQ message of KV events from one engine publisher.
    KvEvents(KvEventBatch),
    /// A routing decision joined from the router's log.
    Decision(RoutingDecision),
    /// One of the migration fork's `KVMIGRATE*` log lines.
    Migration(MigrationLogLine),
    /// The agent's periodic self-report; also advances the collector's clock when the
    /// fleet is idle.
    Heartbeat(AgentHeartbeat),
    /// NIXL transfers and handshakes the agent's eBPF probes measured (cumulative).
    Nixl(crate::nixl::NixlReport),
}

/// How a batch's publisher sequence number relates to the previous one seen from the
/// same publisher.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum SequenceStatus {
    /// The next number, as expected.
    InOrder,
    /// The first batch seen from this publisher (the agent may have joined late).
    First,
    /// Numbers were skipped: `missed` batches never arrived.
    Gap { missed: u64 },
    /// The number went backwards: the engine restarted and its cache is new.
    Reset,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvEventBatch {
    pub worker: WorkerKey,
    /// The ZMQ endpoint the batch came from.
    pub publisher: String,
    pub seq: u64,
    pub sequence: SequenceStatus,
    /// The engine's own timestamp (seconds), as sent.
    pub engine_ts: f64,
    pub events: Vec<KvEvent>,
}

/// One KV cache event, in the vLLM event model. Engine block hashes are normalized to
/// u64 (unsigned ints as sent, SGLang's signed ints by their bits, byte strings by their
/// low 64 bits read big-endian, as vLLM does for its int hashes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lora_name: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        medium: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        medium: Option<String>,
    },
    AllBlocksCleared,
}

/// A routing decision: the request's block chain (`[ROUTING_INPUT]`) joined with the
/// worker the router selected (`Selected worker`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoutingDecision {
    pub request_id: String,
    pub worker: WorkerKey,
    pub isl_tokens: u64,
    pub block_size: u32,
    /// The router's local block hashes of the request's full blocks, in order.
    pub local_hashes: Vec<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_mode: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationLogKind {
    /// `KVMIGRATE_SPILL: request routed off the worker holding its KV`
    Spill,
    /// `KVMIGRATE: producer handshake obtained`
    HandshakeObtained,
    /// `KVMIGRATE: producer dispatch failed`
    DispatchFailed,
    /// `KVMIGRATE: decoding on target with migrated KV`
    DecodingOnTarget,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MigrationLogLine {
    /// Serialized as `migration_kind`: `kind` is already [`Record`]'s tag, and a second
    /// `kind` key in the same JSON object cannot be read back.
    #[serde(rename = "migration_kind")]
    pub kind: MigrationLogKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migratable_tokens: Option<u64>,
    /// Every other key=value field of the line, kept as text.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fields: BTreeMap<String, String>,
}

/// Cumulative counters of everything the agent saw go wrong (and right) since it
/// started. The collector shows the latest of each agent in its report and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AgentCounters {
    pub kv_batches: u64,
    pub kv_events: u64,
    /// ZMQ messages that were not `[topic, seq, payload]` multiparts.
    pub kv_bad_frames: u64,
    /// Payloads that were not valid msgpack or not the vLLM batch shape.
    pub kv_decode_errors: u64,
    /// Events of a type the agent does not know (skipped, the rest of the batch kept).
    pub kv_unknown_events: u64,
    /// Events of a known type with fields missing or of the wrong type.
    pub kv_malformed_events: u64,
    pub kv_sequence_gaps: u64,
    pub kv_missed_batches: u64,
    pub kv_sequence_resets: u64,
    pub log_lines: u64,
    /// Lines that looked like router decision lines but could not be parsed.
    pub log_malformed_lines: u64,
    pub decisions_joined: u64,
    /// `[ROUTING_INPUT]` lines never followed by a `Selected worker` line (or the
    /// reverse) within the join timeout.
    pub decisions_unjoined: u64,
    pub migration_lines: u64,
    pub published: u64,
    /// Records dropped because the local buffer was full while NATS was away.
    pub publish_dropped: u64,
    pub publish_errors: u64,
    /// Records that reached the agent later than its reorder window after an already
    /// published one: sent at once, stamped no earlier than their predecessor.
    pub records_late: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentHeartbeat {
    pub counters: AgentCounters,
    /// Records waiting in the agent's local buffer for NATS.
    #[serde(default)]
    pub buffered: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trips_through_json() {
        let e = Envelope {
            agent: "a".into(),
            observed_ns: 7,
            record: Record::KvEvents(KvEventBatch {
                worker: WorkerKey {
                    worker_id: 3,
                    dp_rank: 0,
                },
                publisher: "tcp://127.0.0.1:5557".into(),
                seq: 4,
                sequence: SequenceStatus::Gap { missed: 2 },
                engine_ts: 1.5,
                events: vec![
                    KvEvent::BlockStored {
                        block_hashes: vec![1, 2],
                        parent_block_hash: None,
                        token_ids: vec![1, 2, 3, 4],
                        block_size: 2,
                        lora_name: None,
                        medium: Some("GPU".into()),
                    },
                    KvEvent::AllBlocksCleared,
                ],
            }),
        };
        let back = Envelope::from_json(&e.to_json()).unwrap();
        assert_eq!(back, e);
    }

    #[test]
    fn a_migration_record_round_trips_through_json() {
        let e = Envelope {
            agent: "a".into(),
            observed_ns: 1,
            record: Record::Migration(MigrationLogLine {
                kind: MigrationLogKind::Spill,
                request_id: Some("r".into()),
                source: None,
                target: None,
                tokens: Some(3),
                migratable_tokens: None,
                fields: BTreeMap::new(),
            }),
        };
        assert_eq!(Envelope::from_json(&e.to_json()).unwrap(), e);
    }

    #[test]
    fn unknown_fields_are_tolerated() {
        let j = br#"{"agent":"a","observed_ns":1,"new_field":1,"record":{"kind":"heartbeat","counters":{"kv_batches":2,"future":9}}}"#;
        let e = Envelope::from_json(j).unwrap();
        match e.record {
            Record::Heartbeat(h) => assert_eq!(h.counters.kv_batches, 2),
            other => panic!("unexpected {other:?}"),
        }
    }
}

impl std::str::FromStr for WorkerKey {
    type Err = String;

    /// `"<worker_id>"` or `"<worker_id>/<dp_rank>"`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (id, dp) = s.split_once('/').unwrap_or((s, "0"));
        Ok(WorkerKey {
            worker_id: id
                .trim()
                .parse()
                .map_err(|e| format!("bad worker id {id:?}: {e}"))?,
            dp_rank: dp
                .trim()
                .parse()
                .map_err(|e| format!("bad dp rank {dp:?}: {e}"))?,
        })
    }
}

/// Serde adapter for maps keyed by [`WorkerKey`]: JSON object keys must be strings, so
/// the key is written as `"<worker_id>/<dp_rank>"`. Use with
/// `#[serde(with = "kvscope_wire::worker_map")]`.
pub mod worker_map {
    use super::WorkerKey;
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::collections::BTreeMap;

    pub fn serialize<V: Serialize, S: Serializer>(
        map: &BTreeMap<WorkerKey, V>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_map(map.iter().map(|(k, v)| (k.to_string(), v)))
    }

    pub fn deserialize<'de, V: Deserialize<'de>, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<WorkerKey, V>, D::Error> {
        let raw = BTreeMap::<String, V>::deserialize(d)?;
        raw.into_iter()
            .map(|(k, v)| Ok((k.parse().map_err(D::Error::custom)?, v)))
            .collect()
    }
}
