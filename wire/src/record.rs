//! The normalized records an agent observes and the collector consumes.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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

/// A worker as a user names one on a command line or in an environment variable:
/// `WORKER_ID` or `WORKER_ID/DP`. Unlike [`WorkerKey`] the rank may be absent, which
/// callers read as "the batch's own rank" (agent) or "every rank" (actuator), so the
/// parse keeps that distinction instead of defaulting it to 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerSpec {
    pub worker_id: u64,
    pub dp_rank: Option<u32>,
}

impl WorkerSpec {
    /// The form, as every parse error names it.
    pub(crate) const FORM: &'static str = "WORKER_ID[/DP]";

    /// Whether `w` is this worker (at any rank when none was given).
    pub fn matches(&self, w: &WorkerKey) -> bool {
        self.worker_id == w.worker_id && self.dp_rank.is_none_or(|d| d == w.dp_rank)
    }
}

impl std::str::FromStr for WorkerKey {
    type Err = WorkerSpecError;

    /// `WORKER_ID` (rank 0) or `WORKER_ID/DP`, as [`Display`](std::fmt::Display) writes
    /// it: the key of [`worker_map`] objects.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let w: WorkerSpec = s.parse()?;
        Ok(WorkerKey {
            worker_id: w.worker_id,
            dp_rank: w.dp_rank.unwrap_or(0),
        })
    }
}

/// Why a `WORKER_ID[/DP]` did not parse. Each message quotes the whole input and the
/// expected form, since it ends up in front of whoever typed the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerSpecError {
    #[error("bad worker id {id:?} in {spec:?} (expected {form}, WORKER_ID an unsigned integer): {source}", form = WorkerSpec::FORM)]
    WorkerId {
        spec: String,
        id: String,
        source: std::num::ParseIntError,
    },
    #[error("bad dp rank {dp:?} in {spec:?} (expected {form}, DP an unsigned 32-bit integer): {source}", form = WorkerSpec::FORM)]
    DpRank {
        spec: String,
        dp: String,
        source: std::num::ParseIntError,
    },
}

impl std::str::FromStr for WorkerSpec {
    type Err = WorkerSpecError;

    /// `WORKER_ID` or `WORKER_ID/DP`, spaces around either part ignored.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (id, dp) = match s.split_once('/') {
            Some((id, dp)) => (id, Some(dp)),
            None => (s, None),
        };
        let worker_id = id
            .trim()
            .parse()
            .map_err(|source| WorkerSpecError::WorkerId {
                spec: s.to_string(),
                id: id.to_string(),
                source,
            })?;
        let dp_rank = dp
            .map(|dp| {
                dp.trim().parse().map_err(|source| WorkerSpecError::DpRank {
                    spec: s.to_string(),
                    dp: dp.to_string(),
                    source,
                })
            })
            .transpose()?;
        Ok(WorkerSpec { worker_id, dp_rank })
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

/// Written with its `kind` first (serde writes an internally tagged enum's tag first);
/// read by [`Record`]'s own `Deserialize`, which takes that order's fast path.
#[derive(Clone, Debug, PartialEq, Serialize)]
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
    /// A worker as Dynamo's discovery store describes it: appeared or changed, or gone.
    Worker(WorkerRecord),
    /// A request's life as Dynamo's request trace tells it when the request ends.
    RequestEnd(RequestEnd),
    /// What the router believed the worker it chose held of the request's prompt.
    RouterView(RouterView),
}

/// Every record's `kind`, as written.
const RECORD_KINDS: &[&str] = &[
    "kv_events",
    "decision",
    "migration",
    "heartbeat",
    "nixl",
    "worker",
    "request_end",
    "router_view",
];

/// An internally tagged enum read tag first ([`TagFirst`]): its tag's key, and how the
/// rest of a map is read once the tag is known.
trait TaggedMap: Sized {
    /// The tag's key (`kind`, `type`).
    const TAG: &'static str;
    const EXPECTING: &'static str;
    /// Reads the fields of the variant `tag` (the map without the tag) from `rest`.
    fn of_tag<'de, D: serde::Deserializer<'de>>(tag: &str, rest: D) -> Result<Self, D::Error>;
}

/// serde's derived reader of an internally tagged enum copies the whole map into an
/// untyped buffer before it can look for the tag, and reads the map again from it: for
/// records that was a third of the collector's CPU at 100k KV blocks/s, and for the KV
/// events inside them (every token id buffered) another sixth. Every writer puts the
/// tag first, so the rest of the map is read straight into the variant; a map whose tag
/// comes later (written by hand, or by another JSON library) is buffered as a JSON value
/// and read the same way.
struct TagFirst<T>(std::marker::PhantomData<T>);

impl<'de, T: TaggedMap> serde::de::Visitor<'de> for TagFirst<T> {
    type Value = T;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(T::EXPECTING)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<T, A::Error> {
        use serde::de::Error;
        let Some(first) = map.next_key::<String>()? else {
            return Err(A::Error::missing_field(T::TAG));
        };
        if first == T::TAG {
            let tag: String = map.next_value()?;
            return T::of_tag(&tag, serde::de::value::MapAccessDeserializer::new(map));
        }
        let mut rest = serde_json::Map::new();
        rest.insert(first, map.next_value()?);
        while let Some((key, value)) = map.next_entry::<String, serde_json::Value>()? {
            rest.insert(key, value);
        }
        let tag = match rest.remove(T::TAG) {
            Some(serde_json::Value::String(tag)) => tag,
            Some(other) => {
                return Err(A::Error::invalid_type(
                    serde::de::Unexpected::Other(&other.to_string()),
                    &format!("a {} name", T::TAG).as_str(),
                ))
            }
            None => return Err(A::Error::missing_field(T::TAG)),
        };
        T::of_tag(&tag, serde_json::Value::Object(rest)).map_err(A::Error::custom)
    }
}

impl<'de> Deserialize<'de> for Record {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(TagFirst::<Record>(std::marker::PhantomData))
    }
}

impl TaggedMap for Record {
    const TAG: &'static str = "kind";
    const EXPECTING: &'static str = "a record: a map with its \"kind\"";

    fn of_tag<'de, D: serde::Deserializer<'de>>(kind: &str, rest: D) -> Result<Self, D::Error> {
        record_of_kind(kind, rest)
    }
}

/// Reads the fields of a record of `kind` (its map without the tag) from `rest`.
fn record_of_kind<'de, D: serde::Deserializer<'de>>(
    kind: &str,
    rest: D,
) -> Result<Record, D::Error> {
    Ok(match kind {
        "kv_events" => Record::KvEvents(KvEventBatch::deserialize(rest)?),
        "decision" => Record::Decision(RoutingDecision::deserialize(rest)?),
        "migration" => Record::Migration(MigrationLogLine::deserialize(rest)?),
        "heartbeat" => Record::Heartbeat(AgentHeartbeat::deserialize(rest)?),
        "nixl" => Record::Nixl(crate::nixl::NixlReport::deserialize(rest)?),
        "worker" => Record::Worker(WorkerRecord::deserialize(rest)?),
        "request_end" => Record::RequestEnd(RequestEnd::deserialize(rest)?),
        "router_view" => Record::RouterView(RouterView::deserialize(rest)?),
        other => {
            return Err(serde::de::Error::unknown_variant(other, RECORD_KINDS));
        }
    })
}

/// Whether a worker is registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    /// Registered (first seen, or what the store says of it changed).
    Up,
    /// Its registration went away: the process stopped or its lease expired. Its id is
    /// not reused; a restarted engine registers under a new one.
    Gone,
}

/// One worker instance (every dp rank of it), as discovery describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// Dynamo's instance id: the router's `worker_id`.
    pub worker_id: u64,
    pub state: WorkerState,
    /// The model it serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// KV capacity of each dp rank, in blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_kv_blocks: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dp_ranks: Vec<u32>,
    /// `aggregated`, `prefill` or `decode`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_type: Option<String>,
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
    /// A batch the publisher's replay socket sent again, to fill a gap or the start of
    /// a publisher seen late: what would have been lost, recovered.
    Replayed,
}

impl SequenceStatus {
    /// Whether batches before this one are missing for good (not replayed): the
    /// worker's mirror lacks what they held. `seq` is the batch's number; a publisher
    /// first seen past its number 0 missed its start.
    pub fn leaves_mirror_incomplete(&self, seq: u64) -> bool {
        match self {
            SequenceStatus::Gap { .. } => true,
            SequenceStatus::First | SequenceStatus::Reset => seq > 0,
            SequenceStatus::InOrder | SequenceStatus::Replayed => false,
        }
    }
}

/// Where a batch of KV events was read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvOrigin {
    /// An engine's own publisher (vLLM's format): the engine's events as it emits them.
    #[default]
    Engine,
    /// Dynamo's event plane: the same events after the worker's publisher has
    /// normalized them (local hashes instead of tokens, removals of blocks stored twice
    /// already filtered), exactly what Dynamo's router indexes.
    EventPlane,
}

impl KvOrigin {
    pub(crate) fn is_engine(&self) -> bool {
        *self == KvOrigin::Engine
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvEventBatch {
    pub worker: WorkerKey,
    /// The endpoint the batch came from (a ZMQ endpoint, or the event plane's channel
    /// and publisher).
    pub publisher: String,
    #[serde(default, skip_serializing_if = "KvOrigin::is_engine")]
    pub origin: KvOrigin,
    pub seq: u64,
    pub sequence: SequenceStatus,
    /// The engine's own timestamp (seconds), as sent.
    pub engine_ts: f64,
    pub events: Vec<KvEvent>,
}

/// One KV cache event, in the vLLM event model. Engine block hashes are normalized to
/// u64 (unsigned ints as sent, SGLang's signed ints by their bits, byte strings by their
/// low 64 bits read big-endian, as vLLM does for its int hashes).
///
/// Written with its `type` first (serde writes an internally tagged enum's tag first);
/// read by its own `Deserialize`, which takes that order's fast path.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum KvEvent {
    BlockStored {
        #[serde(serialize_with = "crate::packed::write")]
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        /// The blocks' tokens (vLLM's events); empty when the source carries only their
        /// hashes (Dynamo's event plane), then in `local_hashes`.
        #[serde(serialize_with = "crate::packed::write")]
        token_ids: Vec<u32>,
        block_size: u32,
        /// Dynamo's local hash of each block (xxh3 of its tokens, seeded), as Dynamo's
        /// event plane carries them instead of the tokens.
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            serialize_with = "crate::packed::write_some"
        )]
        local_hashes: Option<Vec<u64>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lora_name: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        medium: Option<String>,
        /// The cache salt the blocks were stored under (SGLang's `cache_salt`: a
        /// tenant's namespace). Part of a block's identity, as Dynamo's router hashes
        /// it: blocks of equal tokens under another salt are other blocks.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cache_salt: Option<String>,
    },
    BlockRemoved {
        #[serde(serialize_with = "crate::packed::write")]
        block_hashes: Vec<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        medium: Option<String>,
    },
    AllBlocksCleared,
}

impl KvEvent {
    /// A store's blocks' local hashes, what the mirror matches on: the ones it carries
    /// when it has no tokens (Dynamo's event plane, an agent's [`Self::hash_tokens`]),
    /// else its tokens', one per full block (a trailing partial block has none, as
    /// Dynamo gives it none). `None` for removals and clears.
    pub fn stored_local_hashes(&self) -> Option<std::borrow::Cow<'_, [u64]>> {
        let KvEvent::BlockStored {
            token_ids,
            block_size,
            local_hashes,
            lora_name,
            cache_salt,
            ..
        } = self
        else {
            return None;
        };
        Some(match local_hashes {
            Some(l) if token_ids.is_empty() => l.into(),
            _ => crate::hashing::local_block_hashes(
                token_ids,
                *block_size as usize,
                crate::hashing::seed_for(cache_salt.as_deref(), lora_name.as_deref()),
            )
            .into(),
        })
    }

    /// Replace a store's token ids by its blocks' local hashes
    /// ([`Self::stored_local_hashes`]), as Dynamo's own publisher hands them to its
    /// indexer: a hash takes 8 bytes where a block's tokens take 4 per token. A store
    /// whose tokens do not fill one block per block hash still shows as such (fewer
    /// hashes than blocks). Other events stay as they are.
    pub fn hash_tokens(&mut self) {
        self.hash_tokens_with_media(&[], crate::hashing::MediaPlaceholders::default());
    }

    /// [`Self::hash_tokens`] for a store whose blocks hold multimodal objects (`media`,
    /// by block index, ascending, as the engine's event named them; see
    /// [`crate::kv_admission::EventMeta::media`]): those blocks hashed with their objects
    /// as Dynamo's publisher hashes them, given the model's `placeholders`
    /// ([`crate::hashing::local_block_hash_with_media`]). How many of its full blocks
    /// held objects.
    pub fn hash_tokens_with_media(
        &mut self,
        media: &[(usize, Vec<u64>)],
        placeholders: crate::hashing::MediaPlaceholders,
    ) -> usize {
        let KvEvent::BlockStored {
            token_ids,
            block_size,
            local_hashes,
            lora_name,
            cache_salt,
            ..
        } = self
        else {
            return 0;
        };
        // Hashed already (no tokens, its hashes carried).
        if token_ids.is_empty() && local_hashes.is_some() {
            return 0;
        }
        let (hashed, held) = crate::hashing::local_block_hashes_with_media(
            token_ids,
            *block_size as usize,
            crate::hashing::seed_for(cache_salt.as_deref(), lora_name.as_deref()),
            media,
            placeholders,
        );
        *local_hashes = Some(hashed);
        *token_ids = Vec::new();
        held
    }
}

/// Every KV event's `type`, as written.
const KV_EVENT_TYPES: &[&str] = &["BlockStored", "BlockRemoved", "AllBlocksCleared"];

impl<'de> Deserialize<'de> for KvEvent {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(TagFirst::<KvEvent>(std::marker::PhantomData))
    }
}

impl TaggedMap for KvEvent {
    const TAG: &'static str = "type";
    const EXPECTING: &'static str = "a KV event: a map with its \"type\"";

    fn of_tag<'de, D: serde::Deserializer<'de>>(ty: &str, rest: D) -> Result<Self, D::Error> {
        // The variants' fields, as the derived reader took them (a field added to a
        // variant and not here fails `every_kv_event_field_is_read_back`).
        #[derive(Deserialize)]
        struct Stored {
            #[serde(deserialize_with = "crate::packed::read")]
            block_hashes: Vec<u64>,
            parent_block_hash: Option<u64>,
            #[serde(deserialize_with = "crate::packed::read")]
            token_ids: Vec<u32>,
            block_size: u32,
            #[serde(default, deserialize_with = "crate::packed::read_some")]
            local_hashes: Option<Vec<u64>>,
            #[serde(default)]
            lora_name: Option<String>,
            #[serde(default)]
            medium: Option<String>,
            #[serde(default)]
            cache_salt: Option<String>,
        }
        #[derive(Deserialize)]
        struct Removed {
            #[serde(deserialize_with = "crate::packed::read")]
            block_hashes: Vec<u64>,
            #[serde(default)]
            medium: Option<String>,
        }
        Ok(match ty {
            "BlockStored" => {
                let f = Stored::deserialize(rest)?;
                KvEvent::BlockStored {
                    block_hashes: f.block_hashes,
                    parent_block_hash: f.parent_block_hash,
                    token_ids: f.token_ids,
                    block_size: f.block_size,
                    local_hashes: f.local_hashes,
                    lora_name: f.lora_name,
                    medium: f.medium,
                    cache_salt: f.cache_salt,
                }
            }
            "BlockRemoved" => {
                let f = Removed::deserialize(rest)?;
                KvEvent::BlockRemoved {
                    block_hashes: f.block_hashes,
                    medium: f.medium,
                }
            }
            "AllBlocksCleared" => {
                serde::de::IgnoredAny::deserialize(rest)?;
                KvEvent::AllBlocksCleared
            }
            other => return Err(serde::de::Error::unknown_variant(other, KV_EVENT_TYPES)),
        })
    }
}

/// Where a request sits in the traces the router itself exports: W3C trace context
/// (lowercase hex), as Dynamo's JSON log lines carry it (`trace_id`, `span_id` of the
/// span the line was written in). kvscope's spans about the request become children of
/// `span_id` in `trace_id`, so one trace shows the frontend, the router's choice and
/// kvscope's verdict together.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TraceContext {
    /// 32 hex digits, not all zero.
    pub trace_id: String,
    /// 16 hex digits, not all zero: the parent of kvscope's spans.
    pub span_id: String,
}

impl TraceContext {
    /// A context from the text of its two ids; `None` unless both are valid W3C ids
    /// (hex of the right length, not all zero; upper case is taken and lowered).
    pub fn parse(trace_id: &str, span_id: &str) -> Option<Self> {
        let valid = |s: &str, len: usize| {
            s.len() == len
                && s.bytes().all(|b| b.is_ascii_hexdigit())
                && s.bytes().any(|b| b != b'0')
        };
        (valid(trace_id, 32) && valid(span_id, 16)).then(|| Self {
            trace_id: trace_id.to_ascii_lowercase(),
            span_id: span_id.to_ascii_lowercase(),
        })
    }

    /// The trace id as its 16 bytes.
    pub fn trace_id_bytes(&self) -> Vec<u8> {
        hex_bytes(&self.trace_id)
    }

    /// The span id as its 8 bytes.
    pub fn span_id_bytes(&self) -> Vec<u8> {
        hex_bytes(&self.span_id)
    }
}

fn hex_bytes(s: &str) -> Vec<u8> {
    s.as_bytes()
        .chunks(2)
        .map(|pair| {
            std::str::from_utf8(pair)
                .ok()
                .and_then(|p| u8::from_str_radix(p, 16).ok())
                .unwrap_or(0)
        })
        .collect()
}

/// A routing decision: the request's block chain (`[ROUTING_INPUT]`) joined with the
/// worker the router selected (`Selected worker`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoutingDecision {
    pub request_id: String,
    pub worker: WorkerKey,
    pub isl_tokens: u64,
    pub block_size: u32,
    /// The router's local block hashes of the request's full blocks, in order (empty
    /// when the source gives `sequence_hashes` instead).
    #[serde(
        serialize_with = "crate::packed::write",
        deserialize_with = "crate::packed::read"
    )]
    pub local_hashes: Vec<u64>,
    /// The request's full blocks as Dynamo's sequence hashes, when that is what the
    /// source gives (the request trace, replica-sync events): what the chain is matched
    /// by then.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "crate::packed::write_some",
        deserialize_with = "crate::packed::read_some"
    )]
    pub sequence_hashes: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_mode: Option<String>,
    /// Set when every line of the decision's source reached the agent at least this
    /// late (ms) over the last seconds: the source's clock may be behind the agent's
    /// by up to that much, so the decision may be stamped, and judged, too early.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_behind_ms: Option<u64>,
    /// What the router's line said of its choice, beside the worker.
    #[serde(default, skip_serializing_if = "Selection::is_empty")]
    pub selection: Selection,
    /// The request's place in the router's own traces, when its log lines carry it
    /// (Dynamo's JSON lines do).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceContext>,
    /// The model the request asked for, where the router's line names it (the
    /// `model` field of the HTTP request's span on `[ROUTING_INPUT]`): a worker's model
    /// where discovery gives none, so a fleet followed without discovery is still
    /// judged model by model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The request's tenant as a field of its request named it, where the agent was
    /// told which (`tenant_field`); else the collector takes the cache salt its blocks
    /// were stored under.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// What Dynamo's router logged of a choice besides the worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Selection {
    /// The chosen worker's cost (`logit`; lower is better): its prefill and decode load
    /// less its cache credit, as the router's load view had them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit: Option<f64>,
    /// The request was pinned to its worker (`Selected pinned worker`: session
    /// affinity, or a worker the request named), not chosen among all.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pinned: bool,
    /// How far the router extended the chosen worker's match through its host and disk
    /// tiers (Dynamo 1.6's `host_pinned_blocks` and `disk_blocks` on `Selected worker`):
    /// its view of the lower tiers, audited against the engines' (`TierViewAudit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lower_tiers: Option<crate::tier::LowerTierBlocks>,
}

impl Selection {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

impl RoutingDecision {
    /// Whether the decision's prompt can be what the router hashed; see
    /// [`check_prompt_blocks`].
    pub fn check_prompt_blocks(&self) -> Result<(), PromptBlocksError> {
        check_prompt_blocks(self.isl_tokens, self.block_size, self.blocks())
    }

    /// The number of full blocks the decision names.
    pub fn blocks(&self) -> usize {
        self.sequence_hashes
            .as_ref()
            .map_or(self.local_hashes.len(), Vec::len)
    }
}

/// The longest request id kept as it is. Dynamo's are UUIDs (36 bytes) and a client's
/// `x-request-id` rarely passes a hundred; a longer one is kept as its first bytes and a
/// hash ([`bounded_request_id`]), so a forged megabyte id costs no megabyte anywhere
/// it is kept (the agent's joiner, the bus, the collector's judged ids and verdicts).
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// `id` as kvscope keeps it: itself when at most [`MAX_REQUEST_ID_BYTES`] long, else its
/// first bytes (at a character boundary), `…#` and 16 hex digits of its hash: still one
/// id per id, the same wherever it is bounded, and never longer than the limit.
pub fn bounded_request_id(id: &str) -> std::borrow::Cow<'_, str> {
    if id.len() <= MAX_REQUEST_ID_BYTES {
        return std::borrow::Cow::Borrowed(id);
    }
    let hash = format!("…#{:016x}", xxhash_rust::xxh3::xxh3_64(id.as_bytes()));
    let mut keep = MAX_REQUEST_ID_BYTES - hash.len();
    while !id.is_char_boundary(keep) {
        keep -= 1;
    }
    std::borrow::Cow::Owned(format!("{}{hash}", &id[..keep]))
}

/// Whether `id` is an id [`bounded_request_id`] shortened (its `…#` and hash at the
/// end): how the parts that keep ids count the ones they shortened.
pub fn is_shortened_request_id(id: &str) -> bool {
    id.len() > 18
        && id.len() <= MAX_REQUEST_ID_BYTES
        && id[..id.len() - 16].ends_with("…#")
        && id[id.len() - 16..].bytes().all(|b| b.is_ascii_hexdigit())
}

/// A prompt whose length, block size and block count cannot belong together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromptBlocksError {
    #[error("block_size is 0")]
    ZeroBlockSize,
    #[error(
        "isl_tokens={isl_tokens} in blocks of {block_size} is {full_blocks} full blocks, \
         but the router hashed {hashed}"
    )]
    BlockCount {
        isl_tokens: u64,
        block_size: u32,
        full_blocks: u64,
        hashed: usize,
    },
}

/// The router hashes one local hash per full block of a prompt (a partial last block is
/// not hashed), so a prompt of `isl_tokens` tokens has exactly `isl_tokens / block_size`
/// local hashes. A decision breaking that was corrupted or crafted: its token counts
/// would feed every token total, so it is counted as malformed instead of judged.
pub fn check_prompt_blocks(
    isl_tokens: u64,
    block_size: u32,
    hashed: usize,
) -> Result<(), PromptBlocksError> {
    if block_size == 0 {
        return Err(PromptBlocksError::ZeroBlockSize);
    }
    let full_blocks = isl_tokens / u64::from(block_size);
    if full_blocks != hashed as u64 {
        return Err(PromptBlocksError::BlockCount {
            isl_tokens,
            block_size,
            full_blocks,
            hashed,
        });
    }
    Ok(())
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

/// A request's life as Dynamo's request trace tells it (`DYN_REQUEST_TRACE=1`, one
/// `request_end` record per request, at any log level): when it arrived, when its first
/// token came and when it ended, and its sizes. The router books a worker's load by
/// these same moments (a request's prompt from its arrival, its prefill until its first
/// token, its blocks until it ends), so the what-if rebuilds each worker's load from
/// them; the first-token times are also each path's measured TTFT.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestEnd {
    pub request_id: String,
    /// The worker that decoded it (the one that prefilled it too, unless
    /// `prefill_worker` says otherwise).
    pub worker: WorkerKey,
    /// The worker that prefilled it, where that was another worker (disaggregated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_worker: Option<WorkerKey>,
    /// When the frontend received it, UNIX ns.
    pub received_ns: u64,
    /// Time to its first token, ms (none when it ended before one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// From arrival to its end, ms (none when the record gives none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_ms: Option<f64>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Prompt tokens the engine found cached, as the trace reports them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
}

/// What the router believed of a choice: how many of the prompt's blocks it credited the
/// chosen worker with holding. Dynamo 1.6 logs it at INFO when the request's route ends
/// (`route request completed`, the `kv_router.route_request` span's `overlap_blocks`:
/// the effective cached blocks it scored the worker with, rounded), so it comes after
/// the decision, as a record of its own; the collector sets it beside what the engines
/// held then.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterView {
    pub request_id: String,
    /// The worker the route went to.
    pub worker: WorkerKey,
    pub overlap_blocks: u32,
    /// The route's phase as the router names it (`Aggregated`, `Prefill`, `Decode`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// What the router credited each worker it scored with, where its release logs one
    /// line per worker (Dynamo 1.4 and 1.5 at DEBUG under
    /// `dynamo_kv_router::scheduling::selector`: `Formula for worker_id=… with N effective
    /// cached blocks`; 1.6 only its disaggregated prefill router's `Router selected a
    /// worker with lower KV cache overlap`, the chosen and the believed-best worker):
    /// the router's belief about the workers it passed
    /// over, the best one among them. Empty where the log has none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<RouterCandidate>,
}

/// One worker as the router scored it for a request.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterCandidate {
    pub worker: WorkerKey,
    /// The cached blocks it credited the worker with: its device overlap, plus lower
    /// tiers' and a shared cache's blocks at their weights where the release scores them
    /// (so never less than the device overlap it believed), as logged (two decimals).
    pub credited_blocks: f64,
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
    /// The line's place in the router's own traces (its request's, when known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceContext>,
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
    /// Events in the layout of Dynamo's mocker before 1.5 (medium left out, its
    /// group_idx in medium's slot): read with medium absent, counted here.
    pub kv_events_medium_left_out: u64,
    /// Events that set a field of vLLM's the agent reads past without carrying, per
    /// field (`kvscope_wire::vllm_events::FieldsLeftOut`); left out of a heartbeat
    /// while 0, as most engines never set most of them.
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_fields_left_out_lora_id: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_fields_left_out_extra_keys: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_fields_left_out_kv_cache_spec_sliding_window: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_fields_left_out_session_id: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_fields_left_out_lookahead_token_ids: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_fields_left_out_other: u64,
    /// Events the mirror does not take, as Dynamo's publisher does not hand them to its
    /// router (`kvscope_wire::kv_admission`), by why; left out of a heartbeat while 0.
    /// Blocks managed by another cache service, or an owner no engine names.
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_events_refused_other_owner: u64,
    /// Blocks not held by the publisher (`REMOTE`).
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_events_refused_not_local: u64,
    /// A KV cache group that keeps no prefixes (a hybrid model's sliding-window or Mamba
    /// group).
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_events_refused_other_cache_group: u64,
    /// A KV cache group kind no engine is known to send.
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_events_refused_unknown_cache_kind: u64,
    /// A group other than the first whose kind no store named yet.
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_events_refused_unlearned_cache_group: u64,
    /// Stores continuing a chain whose parent was stored under two cache salts.
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_events_refused_ambiguous_salt: u64,
    /// Blocks stored holding multimodal objects, hashed with them.
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_media_blocks: u64,
    /// Of those, blocks hashed without the model's placeholder token ids.
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_media_blocks_without_placeholders: u64,
    /// Stores that named no cache salt and took their parent's (a salted chain's
    /// continuation).
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_salts_inherited: u64,
    pub kv_sequence_gaps: u64,
    pub kv_missed_batches: u64,
    pub kv_sequence_resets: u64,
    /// Connections to a KV publisher dropped because the peer broke the ZMTP protocol
    /// or a size limit (a frame claiming more than the tap allows, ...).
    pub kv_peer_violations: u64,
    /// KV event taps that panicked (a bug) and were restarted.
    pub kv_tap_panics: u64,
    /// KV batches recovered through a publisher's replay socket.
    pub kv_batches_replayed: u64,
    /// Gaps and late starts whose every missed batch was replayed.
    pub kv_gaps_recovered: u64,
    /// Replay requests that failed.
    pub kv_replay_failures: u64,
    /// Replay answers cut at the agent's batch count or byte budget, or ended without
    /// their end marker: the batches before the cut used, the rest asked for again.
    #[serde(default)]
    pub kv_replay_cuts: u64,
    /// KV batches whose engine timestamp is no time: ordered by their arrival.
    #[serde(default)]
    pub kv_engine_times_ignored: u64,
    /// Workers and KV publishers that appeared, changed or went away in discovery.
    pub discovery_changes: u64,
    /// Failed reads of Dynamo's discovery store.
    pub discovery_errors: u64,
    /// Discovery store entries left unread (not a regular file, or too large), counted
    /// at every read of the store.
    #[serde(default)]
    pub discovery_entries_skipped: u64,
    /// Discovered workers whose model name was too long for a subject token (their
    /// subjects carry a shortened one).
    #[serde(default)]
    pub model_names_shortened: u64,
    pub log_lines: u64,
    /// Lines that looked like router decision lines but could not be parsed.
    pub log_malformed_lines: u64,
    /// Router log lines longer than the agent's `max_line_bytes`: skipped.
    pub log_lines_too_long: u64,
    /// Times the router log was truncated under the follower and read from its start.
    pub log_truncations: u64,
    /// Request ids longer than 256 bytes, kept as their first bytes and a hash.
    #[serde(default)]
    pub request_ids_shortened: u64,
    /// Router log lines dated far ahead of the agent's clock: their time not taken.
    pub log_lines_future: u64,
    pub decisions_joined: u64,
    /// `[ROUTING_INPUT]` lines never followed by a `Selected worker` line (or the
    /// reverse) within the join timeout.
    pub decisions_unjoined: u64,
    /// Decisions read from Dynamo's request trace.
    pub decisions_traced: u64,
    /// Requests whose arrival line named no tenant by the field the agent was told.
    #[serde(skip_serializing_if = "is_zero")]
    pub router_tenants_unread: u64,
    /// The router's per-worker score lines set beside no view of their request.
    #[serde(default)]
    pub router_candidates_unjoined: u64,
    pub migration_lines: u64,
    pub published: u64,
    /// NATS messages those records went in (records stamped together share one:
    /// `crate::bundle`).
    #[serde(default)]
    pub messages_published: u64,
    /// Records dropped because the local buffer was full (in records or bytes) while
    /// NATS was away.
    pub publish_dropped: u64,
    /// Records larger than one NATS message, sent in parts (`kvscope_wire::parts`).
    pub records_split: u64,
    /// Records JetStream refused (not the connection): set aside, so the ones behind
    /// them go on.
    pub records_set_aside: u64,
    pub publish_errors: u64,
    /// Failed writes (or flushes) of the agent's local recording (`--record`); the
    /// records still go to NATS.
    #[serde(default)]
    pub recording_write_failures: u64,
    /// Times NATS refused this agent: its credentials (an authorization violation), or
    /// a subject its permissions do not allow it to publish to.
    #[serde(default)]
    pub bus_refusals: u64,
    /// Records that reached the agent later than its reorder window after an already
    /// published one: sent at once, stamped no earlier than their predecessor.
    pub records_late: u64,
    /// Records from a source whose clock reads ahead of this host's: stamped back by
    /// the offset the agent estimated for it.
    pub records_clock_corrected: u64,
    /// Decisions whose router log lines all reached the agent at least 50 ms late for
    /// seconds: its clock may be behind, so they may be judged before events they
    /// depend on (flagged).
    pub decisions_clock_behind: u64,
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
    fn a_long_request_id_is_kept_short_and_apart() {
        let long = "r".repeat(1 << 20);
        let b = bounded_request_id(&long);
        assert_eq!(b.len(), MAX_REQUEST_ID_BYTES);
        assert!(is_shortened_request_id(&b));
        let other = format!("{}x", "r".repeat((1 << 20) - 1));
        assert_ne!(b, bounded_request_id(&other), "two ids, two forms");
        assert_eq!(bounded_request_id("abc"), "abc");
        assert!(!is_shortened_request_id("abc"));
        // Cut at a character boundary.
        let wide = "é".repeat(300);
        let w = bounded_request_id(&wide);
        assert!(w.len() <= MAX_REQUEST_ID_BYTES && is_shortened_request_id(&w));
    }

    fn spec(s: &str) -> Result<WorkerSpec, WorkerSpecError> {
        s.parse()
    }

    #[test]
    fn a_store_s_tokens_become_its_blocks_local_hashes() {
        // Dynamo's local hash, written out: xxh3-64 of the block's tokens as
        // little-endian u32, seed 1337, or 1337 + xxh3 of the adapter's name.
        let xxh = |tokens: &[u32], seed: u64| {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, seed)
        };
        let store = |tokens: Vec<u32>, lora: Option<&str>| KvEvent::BlockStored {
            block_hashes: vec![10, 11],
            parent_block_hash: Some(9),
            token_ids: tokens,
            block_size: 2,
            local_hashes: None,
            lora_name: lora.map(str::to_string),
            medium: Some("GPU".into()),
            cache_salt: None,
        };
        let hashed = |locals: Vec<u64>, lora: Option<&str>| KvEvent::BlockStored {
            block_hashes: vec![10, 11],
            parent_block_hash: Some(9),
            token_ids: Vec::new(),
            block_size: 2,
            local_hashes: Some(locals),
            lora_name: lora.map(str::to_string),
            medium: Some("GPU".into()),
            cache_salt: None,
        };
        let mut e = store(vec![1, 2, 3, 4, 5], None);
        e.hash_tokens();
        assert_eq!(
            e,
            hashed(vec![xxh(&[1, 2], 1337), xxh(&[3, 4], 1337)], None),
            "the partial block (5) has no hash"
        );
        let lora_seed = 1337u64.wrapping_add(xxhash_rust::xxh3::xxh3_64(b"adapter"));
        let mut e = store(vec![1, 2, 3, 4], Some("adapter"));
        e.hash_tokens();
        assert_eq!(
            e,
            hashed(
                vec![xxh(&[1, 2], lora_seed), xxh(&[3, 4], lora_seed)],
                Some("adapter")
            )
        );
        let mut short = store(vec![1, 2], None);
        short.hash_tokens();
        assert_eq!(
            short,
            hashed(vec![xxh(&[1, 2], 1337)], None),
            "fewer hashes than blocks: still a token count mismatch at the collector"
        );
        for e in [
            hashed(vec![7, 8], None),
            KvEvent::BlockRemoved {
                block_hashes: vec![1],
                medium: None,
            },
            KvEvent::AllBlocksCleared,
        ] {
            let mut same = e.clone();
            same.hash_tokens();
            assert_eq!(same, e);
        }
    }

    #[test]
    fn a_prompt_has_one_local_hash_per_full_block() {
        assert_eq!(
            check_prompt_blocks(41, 16, 2),
            Ok(()),
            "a partial block is not hashed"
        );
        assert_eq!(check_prompt_blocks(32, 16, 2), Ok(()));
        assert_eq!(check_prompt_blocks(15, 16, 0), Ok(()), "no full block");
        assert_eq!(
            check_prompt_blocks(48, 16, 2),
            Err(PromptBlocksError::BlockCount {
                isl_tokens: 48,
                block_size: 16,
                full_blocks: 3,
                hashed: 2
            })
        );
        assert!(matches!(
            check_prompt_blocks(u64::MAX - 3, 2, 4),
            Err(PromptBlocksError::BlockCount { .. })
        ));
        assert_eq!(
            check_prompt_blocks(0, 0, 0),
            Err(PromptBlocksError::ZeroBlockSize)
        );
    }

    #[test]
    fn worker_specs_with_and_without_a_rank() {
        let ok = |worker_id, dp_rank| Ok(WorkerSpec { worker_id, dp_rank });
        assert_eq!(spec("42"), ok(42, None));
        assert_eq!(spec("42/3"), ok(42, Some(3)));
        assert_eq!(spec(" 42 / 0 "), ok(42, Some(0)), "spaces around parts");
        assert_eq!(spec("0"), ok(0, None));
        assert_eq!(
            spec("18446744073709551615/4294967295"),
            ok(u64::MAX, Some(u32::MAX))
        );
        let any = spec("42").unwrap();
        let rank1 = spec("42/1").unwrap();
        let key = |worker_id, dp_rank| WorkerKey { worker_id, dp_rank };
        assert!(any.matches(&key(42, 0)) && any.matches(&key(42, 7)));
        assert!(rank1.matches(&key(42, 1)) && !rank1.matches(&key(42, 0)));
        assert!(!any.matches(&key(43, 0)));
    }

    #[test]
    fn worker_keys_round_trip_through_their_display_and_default_to_rank_0() {
        let k = WorkerKey {
            worker_id: 7,
            dp_rank: 2,
        };
        assert_eq!(k.to_string().parse::<WorkerKey>(), Ok(k));
        assert_eq!("7".parse::<WorkerKey>().map(|k| k.dp_rank), Ok(0));
        assert!(matches!(
            "7/x".parse::<WorkerKey>(),
            Err(WorkerSpecError::DpRank { .. })
        ));
    }

    #[test]
    fn bad_worker_specs_say_which_part_and_the_expected_form() {
        for bad in ["", "x", "-1", "42x", "/1", "18446744073709551616", "1.5"] {
            let e = spec(bad).unwrap_err();
            assert!(matches!(e, WorkerSpecError::WorkerId { .. }), "{bad}: {e}");
            assert!(e.to_string().contains("WORKER_ID[/DP]"), "{e}");
        }
        for bad in ["42/", "42/x", "42/-1", "42/4294967296", "42/1/2"] {
            let e = spec(bad).unwrap_err();
            assert!(matches!(e, WorkerSpecError::DpRank { .. }), "{bad}: {e}");
            let msg = e.to_string();
            assert!(
                msg.contains("WORKER_ID[/DP]") && msg.contains(&format!("{bad:?}")),
                "{msg}"
            );
        }
    }

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
                origin: Default::default(),
                seq: 4,
                sequence: SequenceStatus::Gap { missed: 2 },
                engine_ts: 1.5,
                events: vec![
                    KvEvent::BlockStored {
                        block_hashes: vec![1, 2],
                        parent_block_hash: None,
                        token_ids: vec![1, 2, 3, 4],
                        block_size: 2,
                        local_hashes: None,
                        lora_name: None,
                        medium: Some("GPU".into()),
                        cache_salt: Some("tenant-a".into()),
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
                trace: None,
            }),
        };
        assert_eq!(Envelope::from_json(&e.to_json()).unwrap(), e);
    }

    #[test]
    fn a_record_is_read_whatever_the_place_of_its_kind() {
        let first = br#"{"agent":"a","observed_ns":1,"record":{"kind":"heartbeat","counters":{"kv_batches":2}}}"#;
        let later = br#"{"agent":"a","observed_ns":1,"record":{"counters":{"kv_batches":2},"kind":"heartbeat"}}"#;
        let a = Envelope::from_json(first).unwrap();
        assert_eq!(a, Envelope::from_json(later).unwrap());
        assert!(matches!(a.record, Record::Heartbeat(h) if h.counters.kv_batches == 2));
    }

    #[test]
    fn a_record_of_every_kind_is_read_back_as_written() {
        let worker = r#""worker":{"worker_id":7,"dp_rank":0}"#;
        let samples = [
            format!(
                r#"{{"kind":"kv_events",{worker},"publisher":"p","seq":1,"sequence":{{"status":"first"}},"engine_ts":1.5,"events":[{{"type":"AllBlocksCleared"}}]}}"#
            ),
            format!(
                r#"{{"kind":"decision","request_id":"r",{worker},"isl_tokens":32,"block_size":16,"local_hashes":[1,2]}}"#
            ),
            r#"{"kind":"migration","migration_kind":"spill","request_id":"r"}"#.into(),
            r#"{"kind":"heartbeat","counters":{"kv_batches":2},"buffered":1}"#.into(),
            r#"{"kind":"nixl","libraries":[],"transfers":[],"calls":[],"events_lost":1,"events_malformed":0}"#.into(),
            r#"{"kind":"worker","worker_id":7,"state":"up","model":"m"}"#.into(),
            format!(
                r#"{{"kind":"request_end","request_id":"r",{worker},"received_ns":5,"input_tokens":32,"output_tokens":4}}"#
            ),
            format!(
                r#"{{"kind":"router_view","request_id":"r",{worker},"overlap_blocks":3,"phase":"Aggregated"}}"#
            ),
        ];
        let mut kinds = Vec::new();
        for sample in &samples {
            let record: Record =
                serde_json::from_str(sample).unwrap_or_else(|e| panic!("{sample}: {e}"));
            // A kind added to `Record` fails to compile here until it has a sample.
            let name = match &record {
                Record::KvEvents(_) => "kv_events",
                Record::Decision(_) => "decision",
                Record::Migration(_) => "migration",
                Record::Heartbeat(_) => "heartbeat",
                Record::Nixl(_) => "nixl",
                Record::Worker(_) => "worker",
                Record::RequestEnd(_) => "request_end",
                Record::RouterView(_) => "router_view",
            };
            let written = serde_json::to_string(&record).unwrap();
            assert!(
                written.starts_with(&format!(r#"{{"kind":"{name}""#)),
                "{written}"
            );
            assert_eq!(serde_json::from_str::<Record>(&written).unwrap(), record);
            kinds.push(name);
        }
        kinds.sort_unstable();
        let mut known = RECORD_KINDS.to_vec();
        known.sort_unstable();
        assert_eq!(
            kinds, known,
            "one sample of every kind, and every kind is known"
        );
    }

    #[test]
    fn every_kv_event_field_is_read_back() {
        // Struct literals: a field added to a variant must be set here, and is then
        // lost on reading (failing this) until the reader takes it too.
        for event in [
            KvEvent::BlockStored {
                block_hashes: vec![1, u64::MAX],
                parent_block_hash: Some(3),
                token_ids: vec![4, 5, 6, 7],
                block_size: 2,
                local_hashes: Some(vec![8, 9]),
                lora_name: Some("l".into()),
                medium: Some("GPU".into()),
                cache_salt: None,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![1],
                medium: Some("CPU".into()),
            },
            KvEvent::AllBlocksCleared,
        ] {
            let json = serde_json::to_string(&event).unwrap();
            assert!(json.starts_with(r#"{"type":"#), "{json}");
            assert_eq!(serde_json::from_str::<KvEvent>(&json).unwrap(), event);
        }
    }

    #[test]
    fn number_lists_are_written_packed_and_read_in_either_form() {
        let stored = KvEvent::BlockStored {
            block_hashes: vec![1, u64::MAX],
            parent_block_hash: Some(3),
            token_ids: vec![4, 5, u32::MAX],
            block_size: 2,
            local_hashes: Some(vec![8, 9]),
            lora_name: None,
            medium: None,
            cache_salt: None,
        };
        let mut decision = RoutingDecision {
            tenant: None,
            model: None,
            request_id: "r".into(),
            worker: WorkerKey {
                worker_id: 1,
                dp_rank: 0,
            },
            isl_tokens: 32,
            block_size: 16,
            local_hashes: vec![u64::MAX, 0],
            sequence_hashes: Some(vec![7]),
            worker_type: None,
            router_mode: None,
            clock_behind_ms: None,
            selection: Selection::default(),
            trace: None,
        };
        let lists = [
            "block_hashes",
            "token_ids",
            "local_hashes",
            "sequence_hashes",
        ];
        let check = |packed: serde_json::Value| -> serde_json::Value {
            // The same record with each list as the decimal array written before.
            let mut arrays = packed.clone();
            for key in lists {
                if let Some(v) = packed.get(key) {
                    let text = v
                        .as_str()
                        .unwrap_or_else(|| panic!("{key} packed: {packed}"));
                    let numbers: Vec<u64> = if key == "token_ids" {
                        crate::packed::decode::<u32>(text)
                            .unwrap()
                            .into_iter()
                            .map(u64::from)
                            .collect()
                    } else {
                        crate::packed::decode::<u64>(text).unwrap()
                    };
                    arrays[key] = numbers.into();
                }
            }
            arrays
        };
        let packed = serde_json::to_value(&stored).unwrap();
        let arrays = check(packed.clone());
        assert_eq!(serde_json::from_value::<KvEvent>(arrays).unwrap(), stored);
        assert_eq!(serde_json::from_value::<KvEvent>(packed).unwrap(), stored);
        for sequence_hashes in [Some(vec![7]), None] {
            decision.sequence_hashes = sequence_hashes;
            let packed = serde_json::to_value(&decision).unwrap();
            let arrays = check(packed.clone());
            assert_eq!(
                serde_json::from_value::<RoutingDecision>(arrays).unwrap(),
                decision
            );
            assert_eq!(
                serde_json::from_value::<RoutingDecision>(packed).unwrap(),
                decision
            );
        }
    }

    /// The reader serde derives for `KvEvent` (tagged by `type`), which the tag-first
    /// reader replaced: the oracle it is compared with.
    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(tag = "type")]
    enum DerivedKvEvent {
        BlockStored {
            block_hashes: Vec<u64>,
            parent_block_hash: Option<u64>,
            token_ids: Vec<u32>,
            block_size: u32,
            #[serde(default)]
            local_hashes: Option<Vec<u64>>,
            #[serde(default)]
            lora_name: Option<String>,
            #[serde(default)]
            medium: Option<String>,
        },
        BlockRemoved {
            block_hashes: Vec<u64>,
            #[serde(default)]
            medium: Option<String>,
        },
        AllBlocksCleared,
    }

    impl From<DerivedKvEvent> for KvEvent {
        fn from(e: DerivedKvEvent) -> Self {
            match e {
                DerivedKvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    local_hashes,
                    lora_name,
                    medium,
                } => KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    local_hashes,
                    lora_name,
                    medium,
                    cache_salt: None,
                },
                DerivedKvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                },
                DerivedKvEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
            }
        }
    }

    #[test]
    fn kv_events_are_read_as_the_derived_reader_read_them() {
        let stored =
            r#""block_hashes":[1,2],"parent_block_hash":null,"token_ids":[1,2,3,4],"block_size":2"#;
        let inputs = [
            format!(r#"{{"type":"BlockStored",{stored}}}"#),
            format!(r#"{{{stored},"type":"BlockStored"}}"#),
            format!(r#"{{"type":"BlockStored",{stored},"lora_name":"x","medium":"GPU","local_hashes":[5,6]}}"#),
            format!(r#"{{"type":"BlockStored",{stored},"extra":{{"a":[1]}}}}"#),
            format!(r#"{{"extra":1,"type":"BlockStored",{stored}}}"#),
            r#"{"type":"BlockStored","block_hashes":[1],"token_ids":[1],"block_size":1}"#.into(),
            r#"{"type":"BlockStored","block_hashes":[1],"token_ids":[1]}"#.into(),
            r#"{"type":"BlockStored","block_hashes":[-1],"token_ids":[1],"block_size":1}"#.into(),
            r#"{"type":"BlockStored","block_hashes":[1],"token_ids":[4294967296],"block_size":1}"#.into(),
            r#"{"type":"BlockStored","block_hashes":null,"token_ids":[1],"block_size":1}"#.into(),
            r#"{"type":"BlockStored","block_hashes":[1],"token_ids":[1],"block_size":1,"medium":null}"#.into(),
            r#"{"type":"BlockRemoved","block_hashes":[7,8]}"#.into(),
            r#"{"block_hashes":[7,8],"medium":"CPU","type":"BlockRemoved"}"#.into(),
            r#"{"type":"BlockRemoved"}"#.into(),
            r#"{"type":"AllBlocksCleared"}"#.into(),
            r#"{"type":"AllBlocksCleared","x":[1,{"y":2}]}"#.into(),
            r#"{"x":1,"type":"AllBlocksCleared"}"#.into(),
            r#"{"type":"Gossip"}"#.into(),
            r#"{"type":7}"#.into(),
            r#"{"type":null,"block_hashes":[1]}"#.into(),
            r#"{}"#.into(),
            r#"{"block_hashes":[1]}"#.into(),
            r#"{"type":"BlockRemoved","block_hashes":[1],"block_hashes":[2]}"#.into(),
            r#"[]"#.into(),
            r#"7"#.into(),
            r#"{"type":"BlockRemoved","block_hashes":[1]"#.into(),
        ];
        for input in &inputs {
            let new = serde_json::from_str::<KvEvent>(input);
            let old = serde_json::from_str::<DerivedKvEvent>(input);
            match (&new, old) {
                (Ok(n), Ok(o)) => assert_eq!(*n, KvEvent::from(o), "{input}"),
                (Err(_), Err(_)) => {}
                (n, o) => panic!("{input}: tag-first {n:?}, derived {o:?}"),
            }
        }
    }

    #[test]
    fn a_record_without_a_known_kind_is_an_error_that_says_so() {
        for (bad, says) in [
            (r#"{"kind":"gossip","x":1}"#, "unknown variant `gossip`"),
            (r#"{"x":1,"kind":"gossip"}"#, "unknown variant `gossip`"),
            (r#"{"counters":{}}"#, "missing field `kind`"),
            (r#"{}"#, "missing field `kind`"),
            (r#"{"x":1,"kind":7}"#, "a kind name"),
            (r#"{"kind":"heartbeat","counters":7}"#, "invalid type"),
            (r#"[1]"#, "a record"),
        ] {
            let e = serde_json::from_str::<Record>(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
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

fn is_zero(n: &u64) -> bool {
    *n == 0
}
