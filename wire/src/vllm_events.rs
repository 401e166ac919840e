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
//! Dynamo's mocker before 1.5 writes positional events whose `medium` it leaves out when
//! it has none (serde's `skip_serializing_if` on a positional struct), so its `group_idx`
//! (an integer) sits where `medium` belongs: `["BlockRemoved", block_hashes, 0]`, and a
//! host-tier block's `["BlockStored", …, block_size, "CPU_PINNED", 0]`. An integer in a
//! positional medium slot is read that way (no medium, or the string one slot earlier),
//! and counted ([`DecodedPayload::medium_left_out`]): vLLM's own positional events always
//! carry medium there, a string or nil.
//!
//! Fields the agent does not carry (vLLM's `lora_id`, `extra_keys`, `group_idx`, the KV
//! cache spec, and since 0.33 `locality`, `ownership`, `session_id`,
//! `lookahead_token_ids`; any other a newer version adds) are read past and counted per
//! event that sets them ([`FieldsLeftOut`]); optional ones may be missing. Block hashes
//! are msgpack uint64, signed int64 (SGLang; the bits are kept) or bytes (the low 64
//! bits read big-endian, i.e. the last 8 bytes; shorter strings are left-padded).
//! An event of an unknown type or with bad fields is reported as an [`EventProblem`]
//! and skipped; the rest of the batch is kept. Nothing here panics on any input.

use crate::kv_admission::{CacheSpecKind, EventMeta, Locality, Ownership};
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

/// Fields of vLLM's events the decoder reads past without carrying, each counted per
/// event (decoded) that sets it: to nil is unset. `other` counts names this decoder does
/// not know (a newer vLLM's). The fields that say which events the mirror takes
/// ([`META_FIELDS`]) are read into [`DecodedPayload::meta`] instead.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FieldsLeftOut {
    pub lora_id: u32,
    pub extra_keys: u32,
    pub kv_cache_spec_sliding_window: u32,
    pub session_id: u32,
    pub lookahead_token_ids: u32,
    pub other: u32,
}

/// The fields read into an event's [`EventMeta`].
pub const META_FIELDS: [&str; 4] = ["group_idx", "kv_cache_spec_kind", "locality", "ownership"];

impl FieldsLeftOut {
    /// The count of field `name` (`other` for a name this decoder does not know).
    pub fn field_mut(&mut self, name: &str) -> &mut u32 {
        match name {
            "lora_id" => &mut self.lora_id,
            "extra_keys" => &mut self.extra_keys,
            "kv_cache_spec_sliding_window" => &mut self.kv_cache_spec_sliding_window,
            "session_id" => &mut self.session_id,
            "lookahead_token_ids" => &mut self.lookahead_token_ids,
            _ => &mut self.other,
        }
    }

    /// Field `name` of one event was set (`nil` says whether it was nil); the fields
    /// read into [`EventMeta`] are not left out.
    fn saw(&mut self, name: &str, nil: bool) {
        if !nil && !META_FIELDS.contains(&name) {
            *self.field_mut(name) = 1;
        }
    }

    fn add(&mut self, other: &FieldsLeftOut) {
        for (name, n) in other.counts() {
            *self.field_mut(name) += n;
        }
    }

    /// `(name, count)` of every field.
    pub fn counts(&self) -> [(&'static str, u32); 6] {
        [
            ("lora_id", self.lora_id),
            ("extra_keys", self.extra_keys),
            (
                "kv_cache_spec_sliding_window",
                self.kv_cache_spec_sliding_window,
            ),
            ("session_id", self.session_id),
            ("lookahead_token_ids", self.lookahead_token_ids),
            ("other", self.other),
        ]
    }
}

/// Read field `name`'s value `h` into `meta`, where it is one of [`META_FIELDS`] of the
/// type vLLM writes it in (another type is read as unset, as Dynamo reads it).
fn note_meta(meta: &mut EventMeta, name: &str, h: &Head<'_>) {
    match (name, h) {
        ("group_idx", Head::Uint(g)) => meta.group_idx = u32::try_from(*g).ok(),
        ("kv_cache_spec_kind", Head::Str(b)) => {
            meta.spec_kind = std::str::from_utf8(b).ok().map(CacheSpecKind::from_wire)
        }
        ("locality", Head::Str(b)) => {
            meta.locality = std::str::from_utf8(b).ok().map(Locality::from_wire)
        }
        ("ownership", Head::Str(b)) => {
            meta.ownership = std::str::from_utf8(b).map_or(Ownership::Unknown, Ownership::from_wire)
        }
        _ => {}
    }
}

/// The name of a positional event's field past the ones carried (vLLM's order; the tag
/// is position 0).
fn positional_field(kind: &str, pos: u32) -> &'static str {
    const STORED: [&str; 11] = [
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    ];
    const REMOVED: [&str; 3] = ["group_idx", "locality", "ownership"];
    let named = match kind {
        "BlockStored" => pos.checked_sub(5).and_then(|i| STORED.get(i as usize)),
        "BlockRemoved" => pos.checked_sub(3).and_then(|i| REMOVED.get(i as usize)),
        _ => None,
    };
    named.copied().unwrap_or("other")
}

/// The fields the decoder carries (the rest are counted, [`FieldsLeftOut`]); in a map
/// event, a second of one is counted as `other`.
pub const CARRIED: [&str; 8] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "medium",
    "lora_name",
    // SGLang's: the tenant namespace its block hashes are salted with, part of the
    // blocks' identity (`KvEvent::BlockStored::cache_salt`).
    "cache_salt",
];

/// A decoded payload.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedPayload {
    pub engine_ts: f64,
    pub dp_rank: Option<u32>,
    pub events: Vec<KvEvent>,
    /// What each event says beside its blocks (`meta[i]` of `events[i]`): which events
    /// the mirror takes ([`crate::kv_admission::Admission`]).
    pub meta: Vec<EventMeta>,
    pub problems: Vec<EventProblem>,
    /// Events read in the layout of Dynamo's mocker before 1.5 (medium left out, its
    /// `group_idx` in medium's slot): decoded, and counted here.
    pub medium_left_out: u32,
    /// Fields set on the decoded events that the agent does not carry.
    pub fields_left_out: FieldsLeftOut,
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
///
/// Read in one pass, in place: a batch of a few hundred blocks carries thousands of
/// token ids, and building an `rmpv` value for each (as this decoder did) was a quarter
/// of the agent's CPU at 100k KV blocks/s. The pass walks the whole payload as
/// `rmpv::decode::read_value_with_max_depth` would (the same markers, the same depth
/// accounting), so a payload that is not msgpack anywhere is refused whole, as before,
/// and every field is read as before (the tests check both against `rmpv`).
pub fn decode_payload(bytes: &[u8]) -> Result<DecodedPayload, PayloadError> {
    let mut rd = Reader {
        bytes,
        pos: 0,
        medium_left_out: 0,
        fields_left_out: FieldsLeftOut::default(),
    };
    let batch = rd
        .batch()
        .map_err(|e| PayloadError::NotMsgpack(e.to_string()))?;
    if rd.pos < bytes.len() {
        return Err(PayloadError::TrailingBytes(bytes.len() - rd.pos));
    }
    let (ts, events, dp_rank) = match batch {
        Batch::Array { n, .. } if n < 2 => {
            return Err(PayloadError::NotBatch("fewer than 2 elements"))
        }
        Batch::Array { ts, events, dp, .. } => (ts, events, dp),
        Batch::Map {
            ts,
            events,
            data_parallel_rank,
            dp_rank,
        } => (
            Some(ts.ok_or(PayloadError::NotBatch("no ts"))?),
            Some(events.ok_or(PayloadError::NotBatch("no events"))?),
            data_parallel_rank.or(dp_rank),
        ),
        Batch::Neither => return Err(PayloadError::NotBatch("neither an array nor a map")),
    };
    let engine_ts = match ts {
        Some(Head::F64(f)) => f,
        Some(Head::F32(f)) => f64::from(f),
        Some(Head::Uint(u)) => u as f64,
        Some(Head::Int(i)) => i as f64,
        _ => return Err(PayloadError::NotBatch("ts is not a number")),
    };
    let Some(Some(raw_events)) = events else {
        return Err(PayloadError::NotBatch("events is not an array"));
    };
    let dp_rank = match dp_rank {
        None | Some(Head::Nil) => None,
        Some(Head::Uint(r)) if r <= u64::from(u32::MAX) => Some(r as u32),
        Some(_) => return Err(PayloadError::NotBatch("dp_rank is not a u32 or nil")),
    };
    let mut out = DecodedPayload {
        engine_ts,
        dp_rank,
        events: Vec::with_capacity(raw_events.len()),
        meta: Vec::with_capacity(raw_events.len()),
        problems: Vec::new(),
        medium_left_out: rd.medium_left_out,
        fields_left_out: rd.fields_left_out,
    };
    for (index, event) in raw_events.into_iter().enumerate() {
        match event {
            Ok((ev, meta)) => {
                out.events.push(ev);
                out.meta.push(meta);
            }
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

fn malformed(event_type: &str, reason: &str) -> EventError {
    EventError::Malformed {
        event_type: event_type.to_string(),
        reason: reason.to_string(),
    }
}

/// Why the walk over a payload stopped: it is not msgpack (as `rmpv` reads it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
enum WalkError {
    #[error("the payload ends inside a value")]
    Truncated,
    #[error("msgpack nested deeper than {MAX_DEPTH} levels")]
    TooDeep,
}

/// One msgpack value's first part: scalars whole, strings and binaries with their
/// bytes, arrays and maps with their length.
#[derive(Debug, Clone, Copy)]
enum Head<'a> {
    Nil,
    Bool,
    /// A non-negative integer, whichever marker it came in (as `rmpv` reads them).
    Uint(u64),
    Int(i64),
    F32(f32),
    F64(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext,
    Array(u32),
    Map(u32),
}

impl<'a> Head<'a> {
    fn type_name(&self) -> &'static str {
        match self {
            Head::Nil => "nil",
            Head::Bool => "bool",
            Head::Uint(_) | Head::Int(_) => "int",
            Head::F32(_) | Head::F64(_) => "float",
            Head::Str(_) => "str",
            Head::Bin(_) => "bin",
            Head::Array(_) => "array",
            Head::Map(_) => "map",
            Head::Ext => "ext",
        }
    }

    /// A string: `Some(None)` when it is not UTF-8; `None` when it is no string.
    fn str(&self) -> Option<Option<&'a str>> {
        match self {
            Head::Str(b) => Some(std::str::from_utf8(b).ok()),
            _ => None,
        }
    }

    fn key(&self) -> Option<&'a str> {
        self.str().flatten()
    }
}

/// One event as read: the event and what it says beside its blocks, or why it was
/// skipped.
type ReadEvent = Result<(KvEvent, EventMeta), EventError>;

/// The top level as read: its shape, and the fields the batch is made of.
enum Batch<'a> {
    Array {
        n: u32,
        ts: Option<Head<'a>>,
        events: Option<Option<Vec<ReadEvent>>>,
        dp: Option<Head<'a>>,
    },
    Map {
        ts: Option<Head<'a>>,
        events: Option<Option<Vec<ReadEvent>>>,
        data_parallel_rank: Option<Head<'a>>,
        dp_rank: Option<Head<'a>>,
    },
    Neither,
}

/// An event's fields as read (the first of each name in a map; by position in an
/// array, as its tag says). Arrays of hashes and tokens are read as they come: `None`
/// when the value is not an array, else its items or the first bad one's reason.
#[derive(Default)]
struct Slots<'a> {
    tag: Option<Head<'a>>,
    hashes: Option<Option<Result<Vec<u64>, String>>>,
    parent: Option<Head<'a>>,
    tokens: Option<Option<Result<Vec<u32>, String>>>,
    block_size: Option<Head<'a>>,
    medium: Option<Head<'a>>,
    lora_name: Option<Head<'a>>,
    cache_salt: Option<Head<'a>>,
    /// The string items of `extra_keys`' first block (where Dynamo tags a request's cache
    /// salt for vLLM, `dynamo-cache-salt:…`).
    first_block_keys: Vec<&'a [u8]>,
    extra_keys_seen: bool,
    /// A positional BlockStored's slot 5 (vLLM's old `lora_id`; the mocker's medium when
    /// it left medium out).
    before_medium: Option<Head<'a>>,
}

/// An event's `extra_keys` as read ([`Reader::extra_keys`]).
struct ExtraKeys<'a> {
    head: Head<'a>,
    first_block: Vec<&'a [u8]>,
    /// The multimodal objects of each block that holds any, by block index.
    media: Vec<(usize, Vec<u64>)>,
}

/// A multimodal object's routing hash, from an `extra_keys` item in the form Dynamo's
/// vLLM handler hands vLLM for a hash its frontend issued: 16 hex digits (the hash)
/// and 48 zeros. vLLM's own 64-digit hashes and other keys (LoRA names, salts, prompt
/// embeddings) are no object here, as Dynamo 1.6's publisher reads them.
pub fn media_object(item: &[u8]) -> Option<u64> {
    if item.len() != 64
        || !item[..16].iter().all(u8::is_ascii_hexdigit)
        || !item[16..].iter().all(|&c| c == b'0')
    {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(&item[..16]).ok()?, 16).ok()
}

/// The depth left inside a value that had `depth` left: `rmpv` takes one level for a
/// value, one for an array's or a map's items, one for a string's or a binary's bytes.
fn deeper(depth: u16) -> Result<u16, WalkError> {
    depth.checked_sub(1).ok_or(WalkError::TooDeep)
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Events decoded in the mocker's left-out-medium layout so far.
    medium_left_out: u32,
    /// Fields left out of the events decoded so far.
    fields_left_out: FieldsLeftOut,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WalkError> {
        let end = self.pos.checked_add(n).ok_or(WalkError::Truncated)?;
        let b = self.bytes.get(self.pos..end).ok_or(WalkError::Truncated)?;
        self.pos = end;
        Ok(b)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], WalkError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn len8(&mut self) -> Result<usize, WalkError> {
        Ok(usize::from(self.be::<1>()?[0]))
    }

    fn len16(&mut self) -> Result<usize, WalkError> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }

    fn len32(&mut self) -> Result<usize, WalkError> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }

    /// A value's marker and what follows it up to its items (strings', binaries' and
    /// extensions' bytes included).
    fn head(&mut self) -> Result<Head<'a>, WalkError> {
        let m = self.take(1)?[0];
        let signed = |i: i64| {
            if i >= 0 {
                Head::Uint(i as u64)
            } else {
                Head::Int(i)
            }
        };
        Ok(match m {
            0x00..=0x7f => Head::Uint(u64::from(m)),
            0xe0..=0xff => Head::Int(i64::from(m as i8)),
            // rmpv reads the reserved marker as nil.
            0xc0 | 0xc1 => Head::Nil,
            0xc2 | 0xc3 => Head::Bool,
            0xcc => Head::Uint(u64::from(self.be::<1>()?[0])),
            0xcd => Head::Uint(u64::from(u16::from_be_bytes(self.be()?))),
            0xce => Head::Uint(u64::from(u32::from_be_bytes(self.be()?))),
            0xcf => Head::Uint(u64::from_be_bytes(self.be()?)),
            0xd0 => signed(i64::from(self.be::<1>()?[0] as i8)),
            0xd1 => signed(i64::from(i16::from_be_bytes(self.be()?))),
            0xd2 => signed(i64::from(i32::from_be_bytes(self.be()?))),
            0xd3 => signed(i64::from_be_bytes(self.be()?)),
            0xca => Head::F32(f32::from_be_bytes(self.be()?)),
            0xcb => Head::F64(f64::from_be_bytes(self.be()?)),
            0xa0..=0xbf => Head::Str(self.take(usize::from(m & 0x1f))?),
            0xd9 => {
                let n = self.len8()?;
                Head::Str(self.take(n)?)
            }
            0xda => {
                let n = self.len16()?;
                Head::Str(self.take(n)?)
            }
            0xdb => {
                let n = self.len32()?;
                Head::Str(self.take(n)?)
            }
            0xc4 => {
                let n = self.len8()?;
                Head::Bin(self.take(n)?)
            }
            0xc5 => {
                let n = self.len16()?;
                Head::Bin(self.take(n)?)
            }
            0xc6 => {
                let n = self.len32()?;
                Head::Bin(self.take(n)?)
            }
            // Extensions: a type byte, then their bytes.
            0xd4..=0xd8 => {
                self.take(1 + (1usize << (m - 0xd4)))?;
                Head::Ext
            }
            0xc7 => {
                let n = self.len8()?;
                self.take(1)?;
                self.take(n)?;
                Head::Ext
            }
            0xc8 => {
                let n = self.len16()?;
                self.take(1)?;
                self.take(n)?;
                Head::Ext
            }
            0xc9 => {
                let n = self.len32()?;
                self.take(1)?;
                self.take(n)?;
                Head::Ext
            }
            0x90..=0x9f => Head::Array(u32::from(m & 0x0f)),
            0xdc => Head::Array(self.len16()? as u32),
            0xdd => Head::Array(u32::from_be_bytes(self.be()?)),
            0x80..=0x8f => Head::Map(u32::from(m & 0x0f)),
            0xde => Head::Map(self.len16()? as u32),
            0xdf => Head::Map(u32::from_be_bytes(self.be()?)),
        })
    }

    /// The rest of a value whose head `h` was read with `depth` left after its own
    /// level: an array's or a map's items walked, the depth of a string's, a binary's
    /// or an extension's bytes checked.
    fn finish(&mut self, h: &Head<'a>, depth: u16) -> Result<(), WalkError> {
        match *h {
            Head::Str(_) | Head::Ext => {
                deeper(deeper(depth)?)?;
            }
            Head::Bin(_) => {
                deeper(depth)?;
            }
            Head::Array(n) => {
                let items = deeper(depth)?;
                for _ in 0..n {
                    self.value(items)?;
                }
            }
            Head::Map(n) => {
                let items = deeper(depth)?;
                for _ in 0..u64::from(n) * 2 {
                    self.value(items)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// One whole value with `depth` left; its head.
    fn value(&mut self, depth: u16) -> Result<Head<'a>, WalkError> {
        let depth = deeper(depth)?;
        let h = self.head()?;
        self.finish(&h, depth)?;
        Ok(h)
    }

    /// An array whose items `item` reads, all of them walked: `None` when the value is
    /// no array; else the items, or the first bad one's reason.
    fn array<T>(
        &mut self,
        depth: u16,
        mut item: impl FnMut(&Head<'a>) -> Result<T, String>,
    ) -> Result<Option<Result<Vec<T>, String>>, WalkError> {
        let depth = deeper(depth)?;
        let h = self.head()?;
        let Head::Array(n) = h else {
            self.finish(&h, depth)?;
            return Ok(None);
        };
        let items = deeper(depth)?;
        // Never more room than the bytes left could fill: a hostile length reserves
        // nothing.
        let mut out = Vec::with_capacity((n as usize).min(self.bytes.len() - self.pos));
        let mut bad = None;
        for _ in 0..n {
            let h = self.value(items)?;
            if bad.is_none() {
                match item(&h) {
                    Ok(v) => out.push(v),
                    Err(e) => bad = Some(e),
                }
            }
        }
        Ok(Some(match bad {
            None => Ok(out),
            Some(e) => Err(e),
        }))
    }

    /// vLLM's `extra_keys` (one entry per block: nil or an array of items), walked whole:
    /// its head; the string items of its first block's entry (the first 64), where
    /// Dynamo tags a request's cache salt; and each block's multimodal objects (items
    /// that are a marked routing hash, alone or as `[hash, offset]`: [`media_object`]).
    fn extra_keys(&mut self, depth: u16) -> Result<ExtraKeys<'a>, WalkError> {
        let depth = deeper(depth)?;
        let head = self.head()?;
        let mut keys = ExtraKeys {
            head,
            first_block: Vec::new(),
            media: Vec::new(),
        };
        let Head::Array(n) = head else {
            self.finish(&head, depth)?;
            return Ok(keys);
        };
        let blocks = deeper(depth)?;
        for i in 0..n {
            let mut objects = Vec::new();
            let entry_depth = deeper(blocks)?;
            let entry = self.head()?;
            let Head::Array(m) = entry else {
                self.finish(&entry, entry_depth)?;
                continue;
            };
            let items = deeper(entry_depth)?;
            for _ in 0..m {
                let item_depth = deeper(items)?;
                let item = self.head()?;
                let hash = match item {
                    Head::Str(s) => {
                        self.finish(&item, item_depth)?;
                        if i == 0 && keys.first_block.len() < 64 {
                            keys.first_block.push(s);
                        }
                        Some(s)
                    }
                    // `[hash, block-relative offset]` (vLLM 0.19 and later).
                    Head::Array(k) if k > 0 => {
                        let pair = deeper(item_depth)?;
                        let first = self.value(pair)?;
                        for _ in 1..k {
                            self.value(pair)?;
                        }
                        match first {
                            Head::Str(s) => Some(s),
                            _ => None,
                        }
                    }
                    _ => {
                        self.finish(&item, item_depth)?;
                        None
                    }
                };
                if let Some(o) = hash.and_then(media_object) {
                    objects.push(o);
                }
            }
            // Only blocks holding objects take room: a forged list of a million empty
            // entries costs nothing.
            if !objects.is_empty() {
                keys.media.push((i as usize, objects));
            }
        }
        Ok(keys)
    }

    fn hashes(&mut self, depth: u16) -> Result<Option<Result<Vec<u64>, String>>, WalkError> {
        self.array(depth, |h| {
            head_block_hash(h).map_err(|e| format!("block_hashes: {e}"))
        })
    }

    fn tokens(&mut self, depth: u16) -> Result<Option<Result<Vec<u32>, String>>, WalkError> {
        self.array(depth, |h| match *h {
            Head::Uint(t) if t <= u64::from(u32::MAX) => Ok(t as u32),
            other => Err(format!(
                "token id of type {} is not a u32",
                other.type_name()
            )),
        })
    }

    fn batch(&mut self) -> Result<Batch<'a>, WalkError> {
        let depth = deeper(MAX_DEPTH as u16)?;
        let h = self.head()?;
        Ok(match h {
            Head::Array(n) => {
                let items = deeper(depth)?;
                let (mut ts, mut events, mut dp) = (None, None, None);
                for i in 0..n {
                    match i {
                        0 => ts = Some(self.value(items)?),
                        1 => events = Some(self.events(items)?),
                        2 => dp = Some(self.value(items)?),
                        _ => {
                            self.value(items)?;
                        }
                    }
                }
                Batch::Array { n, ts, events, dp }
            }
            Head::Map(n) => {
                let items = deeper(depth)?;
                let (mut ts, mut events, mut dpr, mut dpk) = (None, None, None, None);
                for _ in 0..n {
                    let key = self.value(items)?;
                    match key.key() {
                        Some("ts") if ts.is_none() => ts = Some(self.value(items)?),
                        Some("events") if events.is_none() => events = Some(self.events(items)?),
                        Some("data_parallel_rank") if dpr.is_none() => {
                            dpr = Some(self.value(items)?)
                        }
                        Some("dp_rank") if dpk.is_none() => dpk = Some(self.value(items)?),
                        _ => {
                            self.value(items)?;
                        }
                    }
                }
                Batch::Map {
                    ts,
                    events,
                    data_parallel_rank: dpr,
                    dp_rank: dpk,
                }
            }
            other => {
                self.finish(&other, depth)?;
                Batch::Neither
            }
        })
    }

    /// The events array: `None` when the value is no array.
    fn events(&mut self, depth: u16) -> Result<Option<Vec<ReadEvent>>, WalkError> {
        let depth = deeper(depth)?;
        let h = self.head()?;
        let Head::Array(n) = h else {
            self.finish(&h, depth)?;
            return Ok(None);
        };
        let items = deeper(depth)?;
        let mut out = Vec::with_capacity((n as usize).min(self.bytes.len() - self.pos));
        for _ in 0..n {
            out.push(self.event(items)?);
        }
        Ok(Some(out))
    }

    fn event(&mut self, depth: u16) -> Result<ReadEvent, WalkError> {
        let depth = deeper(depth)?;
        let h = self.head()?;
        let mut slots = Slots::default();
        let mut meta = EventMeta::default();
        match h {
            Head::Array(n) => {
                let items = deeper(depth)?;
                if n == 0 {
                    return Ok(Err(malformed("?", "array without a string tag")));
                }
                let tag = self.value(items)?;
                let kind = tag.key();
                let mut left = FieldsLeftOut::default();
                for pos in 1..n {
                    match (kind, pos) {
                        (Some("BlockStored" | "BlockRemoved"), 1) => {
                            slots.hashes = Some(self.hashes(items)?)
                        }
                        (Some("BlockStored"), 2) => slots.parent = Some(self.value(items)?),
                        (Some("BlockStored"), 3) => slots.tokens = Some(self.tokens(items)?),
                        (Some("BlockStored"), 4) => slots.block_size = Some(self.value(items)?),
                        (Some("BlockStored"), 5) => slots.before_medium = Some(self.value(items)?),
                        (Some("BlockStored"), 6) | (Some("BlockRemoved"), 2) => {
                            slots.medium = Some(self.value(items)?)
                        }
                        (Some("BlockStored"), 7) => slots.lora_name = Some(self.value(items)?),
                        (Some("BlockStored"), 8) => {
                            let keys = self.extra_keys(items)?;
                            slots.first_block_keys = keys.first_block;
                            meta.media = keys.media;
                            left.saw("extra_keys", matches!(keys.head, Head::Nil));
                        }
                        (Some(kind @ ("BlockStored" | "BlockRemoved")), _) => {
                            let h = self.value(items)?;
                            let name = positional_field(kind, pos);
                            note_meta(&mut meta, name, &h);
                            left.saw(name, matches!(h, Head::Nil));
                        }
                        _ => {
                            self.value(items)?;
                        }
                    }
                }
                // The mocker's left-out medium: its group_idx where medium belongs.
                let left_out = matches!(slots.medium, Some(Head::Uint(_)));
                if left_out {
                    if let Some(h) = &slots.medium {
                        note_meta(&mut meta, "group_idx", h);
                    }
                    slots.medium = slots
                        .before_medium
                        .take()
                        .filter(|h| kind == Some("BlockStored") && matches!(h, Head::Str(_)));
                }
                // vLLM's slot 5 is lora_id (an integer); the mocker's medium is a string.
                if let Some(Head::Uint(_) | Head::Int(_)) = slots.before_medium {
                    left.saw("lora_id", false);
                }
                let event = match tag.str() {
                    None => Err(malformed("?", "array without a string tag")),
                    Some(None) => Err(malformed("?", "type is not UTF-8")),
                    Some(Some(kind)) => event_of(kind, slots),
                };
                if event.is_ok() {
                    self.medium_left_out += u32::from(left_out);
                    self.fields_left_out.add(&left);
                }
                Ok(event.map(|e| (e, meta)))
            }
            Head::Map(n) => {
                let items = deeper(depth)?;
                let mut left = FieldsLeftOut::default();
                for _ in 0..n {
                    let key = self.value(items)?;
                    match key.key() {
                        Some("type") if slots.tag.is_none() => slots.tag = Some(self.value(items)?),
                        Some("block_hashes") if slots.hashes.is_none() => {
                            slots.hashes = Some(self.hashes(items)?)
                        }
                        Some("parent_block_hash") if slots.parent.is_none() => {
                            slots.parent = Some(self.value(items)?)
                        }
                        Some("token_ids") if slots.tokens.is_none() => {
                            slots.tokens = Some(self.tokens(items)?)
                        }
                        Some("block_size") if slots.block_size.is_none() => {
                            slots.block_size = Some(self.value(items)?)
                        }
                        Some("medium") if slots.medium.is_none() => {
                            slots.medium = Some(self.value(items)?)
                        }
                        Some("lora_name") if slots.lora_name.is_none() => {
                            slots.lora_name = Some(self.value(items)?)
                        }
                        Some("cache_salt") if slots.cache_salt.is_none() => {
                            slots.cache_salt = Some(self.value(items)?)
                        }
                        Some("extra_keys") if !slots.extra_keys_seen => {
                            let keys = self.extra_keys(items)?;
                            slots.first_block_keys = keys.first_block;
                            meta.media = keys.media;
                            slots.extra_keys_seen = true;
                            left.saw("extra_keys", matches!(keys.head, Head::Nil));
                        }
                        name => {
                            let h = self.value(items)?;
                            let name = name.filter(|n| !CARRIED.contains(n)).unwrap_or("other");
                            note_meta(&mut meta, name, &h);
                            left.saw(name, matches!(h, Head::Nil));
                        }
                    }
                }
                let event = match slots.tag.as_ref().and_then(Head::str) {
                    None => Err(malformed("?", "map without a string `type`")),
                    Some(None) => Err(malformed("?", "type is not UTF-8")),
                    Some(Some(kind)) => event_of(kind, slots),
                };
                if event.is_ok() {
                    self.fields_left_out.add(&left);
                }
                Ok(event.map(|e| (e, meta)))
            }
            other => {
                self.finish(&other, depth)?;
                Ok(Err(malformed("?", "neither an array nor a map")))
            }
        }
    }
}

/// The event its fields make, checked in the order the fields are listed (the first
/// bad one is the reason given). Nil counts as missing.
fn event_of<'a>(event_type: &str, slots: Slots<'a>) -> Result<KvEvent, EventError> {
    let bad = |reason: String| malformed(event_type, &reason);
    fn present(h: Option<Head<'_>>) -> Option<Head<'_>> {
        h.filter(|h| !matches!(h, Head::Nil))
    }
    let hashes = |h: Option<Option<Result<Vec<u64>, String>>>| match h {
        Some(Some(Ok(v))) => Ok(v),
        Some(Some(Err(e))) => Err(bad(e)),
        _ => Err(bad("block_hashes missing or not an array".into())),
    };
    let opt_string = |h: Option<Head<'a>>, name: &str| match present(h) {
        None => Ok(None),
        Some(Head::Str(b)) => std::str::from_utf8(b)
            .map(|s| Some(s.to_string()))
            .map_err(|_| bad(format!("{name} is not UTF-8"))),
        Some(other) => Err(bad(format!("{name} of type {}", other.type_name()))),
    };
    match event_type {
        "BlockStored" => Ok(KvEvent::BlockStored {
            block_hashes: hashes(slots.hashes)?,
            parent_block_hash: match present(slots.parent) {
                None => None,
                Some(h) => {
                    Some(head_block_hash(&h).map_err(|e| bad(format!("parent_block_hash: {e}")))?)
                }
            },
            token_ids: match slots.tokens {
                Some(Some(Ok(v))) => v,
                Some(Some(Err(e))) => return Err(bad(e)),
                _ => return Err(bad("token_ids missing or not an array".into())),
            },
            local_hashes: None,
            block_size: match present(slots.block_size) {
                Some(Head::Uint(b)) if b <= u64::from(u32::MAX) => b as u32,
                _ => return Err(bad("block_size missing or not a u32".into())),
            },
            medium: opt_string(slots.medium, "medium")?,
            cache_salt: {
                let lora = opt_string(slots.lora_name, "lora_name")?;
                match opt_string(slots.cache_salt, "cache_salt")? {
                    Some(salt) => Some(salt),
                    None => tagged_cache_salt(
                        slots
                            .first_block_keys
                            .iter()
                            .filter_map(|k| std::str::from_utf8(k).ok()),
                        lora.as_deref(),
                    ),
                }
            },
            lora_name: opt_string(slots.lora_name, "lora_name")?,
        }),
        "BlockRemoved" => Ok(KvEvent::BlockRemoved {
            block_hashes: hashes(slots.hashes)?,
            medium: opt_string(slots.medium, "medium")?,
        }),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(EventError::Unknown(other.to_string())),
    }
}

/// The prefix Dynamo's vLLM handler puts before a request's cache salt in what it hands
/// vLLM, so the salt shows in `extra_keys` apart from LoRA names and multimodal hashes.
pub const DYNAMO_CACHE_SALT_PREFIX: &str = "dynamo-cache-salt:";

/// A store's cache salt from its first block's `extra_keys` strings, where it carries no
/// `cache_salt` of its own, as Dynamo's publisher finds it: the first item tagged
/// [`DYNAMO_CACHE_SALT_PREFIX`] with something after it, skipping one item equal to the
/// store's LoRA name (vLLM lists the adapter's name first). An untagged salt (vLLM's own
/// `cache_salt` without Dynamo) cannot be told from other keys and stays unread, as
/// Dynamo leaves it.
fn tagged_cache_salt<'k>(
    first_block: impl Iterator<Item = &'k str>,
    lora_name: Option<&str>,
) -> Option<String> {
    let mut unmatched_lora = lora_name.filter(|n| !n.is_empty());
    for key in first_block {
        if unmatched_lora == Some(key) {
            unmatched_lora = None;
            continue;
        }
        if let Some(salt) = key.strip_prefix(DYNAMO_CACHE_SALT_PREFIX) {
            if !salt.is_empty() {
                return Some(salt.to_string());
            }
        }
    }
    None
}

/// [`block_hash`] of a value read in place.
fn head_block_hash(h: &Head<'_>) -> Result<u64, String> {
    match *h {
        Head::Uint(u) => Ok(u),
        Head::Int(i) => Ok(i as u64),
        Head::Bin(b) => Ok(low_u64_be(b)),
        other => Err(format!("hash of type {}", other.type_name())),
    }
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
                cache_salt,
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
                ("cache_salt", opt_str(cache_salt.as_deref())),
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

    /// The decoder as it was, over `rmpv` values: every payload must decode the same.
    mod reference {
        use super::super::*;

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
                meta: Vec::new(),
                problems: Vec::new(),
                medium_left_out: 0,
                fields_left_out: FieldsLeftOut::default(),
            };
            for (index, raw) in raw_events.iter().enumerate() {
                match decode_event(raw) {
                    Ok((ev, left_out)) => {
                        out.medium_left_out += u32::from(left_out);
                        out.fields_left_out.add(&left_out_of(raw));
                        out.meta.push(meta_of(raw, left_out));
                        out.events.push(ev)
                    }
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

        fn decode_event(raw: &Value) -> Result<(KvEvent, bool), EventError> {
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
            // The mocker's left-out medium: an integer in a positional medium slot.
            let medium_at = if event_type == "BlockStored" { 6 } else { 2 };
            let left_out = matches!(&fields, Fields::Positional(_))
                && fields.get(medium_at, "medium").is_some_and(Value::is_u64);
            let medium = match (left_out, event_type) {
                (true, "BlockStored") => fields.get(5, "").filter(|v| v.is_str()),
                (true, _) => None,
                (false, _) => fields.get(medium_at, "medium"),
            };
            let event = match event_type {
                "BlockStored" => Ok(KvEvent::BlockStored {
                    block_hashes: hashes(fields.get(1, "block_hashes")).map_err(bad)?,
                    parent_block_hash: match fields.get(2, "parent_block_hash") {
                        None => None,
                        Some(v) => Some(
                            block_hash(v).map_err(|e| bad(format!("parent_block_hash: {e}")))?,
                        ),
                    },
                    token_ids: token_ids(fields.get(3, "token_ids")).map_err(bad)?,
                    local_hashes: None,
                    block_size: fields
                        .get(4, "block_size")
                        .and_then(Value::as_u64)
                        .and_then(|b| u32::try_from(b).ok())
                        .ok_or_else(|| bad("block_size missing or not a u32".into()))?,
                    medium: opt_string(medium, "medium").map_err(bad)?,
                    // Named only (SGLang's maps): no positional layout carries it; else the
                    // salt Dynamo tags in the first block's `extra_keys`.
                    cache_salt: match match fields {
                        Fields::Named(_) => {
                            opt_string(fields.get(0, "cache_salt"), "cache_salt").map_err(bad)?
                        }
                        Fields::Positional(_) => None,
                    } {
                        Some(salt) => Some(salt),
                        None => {
                            let lora =
                                opt_string(fields.get(7, "lora_name"), "lora_name").map_err(bad)?;
                            let first = match fields.get(8, "extra_keys") {
                                Some(Value::Array(blocks)) => match blocks.first() {
                                    Some(Value::Array(items)) => items.as_slice(),
                                    _ => &[],
                                },
                                _ => &[],
                            };
                            tagged_cache_salt(
                                first
                                    .iter()
                                    .filter(|v| v.is_str())
                                    .take(64)
                                    .filter_map(|v| v.as_str()),
                                lora.as_deref(),
                            )
                        }
                    },
                    lora_name: opt_string(fields.get(7, "lora_name"), "lora_name").map_err(bad)?,
                }),
                "BlockRemoved" => Ok(KvEvent::BlockRemoved {
                    block_hashes: hashes(fields.get(1, "block_hashes")).map_err(bad)?,
                    medium: opt_string(medium, "medium").map_err(bad)?,
                }),
                "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
                other => Err(EventError::Unknown(other.to_string())),
            };
            event.map(|e| (e, left_out && event_type != "AllBlocksCleared"))
        }

        /// What one decoded event says beside its blocks.
        fn meta_of(raw: &Value, medium_left_out: bool) -> EventMeta {
            let mut meta = EventMeta::default();
            let mut note = |name: &str, v: &Value| match (name, v) {
                ("group_idx", Value::Integer(i)) => {
                    if let Some(g) = i.as_u64() {
                        meta.group_idx = u32::try_from(g).ok()
                    }
                }
                ("kv_cache_spec_kind", Value::String(x)) => {
                    meta.spec_kind = x.as_str().map(CacheSpecKind::from_wire)
                }
                ("locality", Value::String(x)) => {
                    meta.locality = x.as_str().map(Locality::from_wire)
                }
                ("ownership", Value::String(x)) => {
                    meta.ownership = x.as_str().map_or(Ownership::Unknown, Ownership::from_wire)
                }
                _ => {}
            };
            match raw {
                Value::Array(a) => {
                    let kind = a[0].as_str().unwrap_or("");
                    let (from, medium) = match kind {
                        "BlockStored" => (8, 6),
                        "BlockRemoved" => (3, 2),
                        _ => return meta,
                    };
                    for (pos, v) in a.iter().enumerate().skip(from) {
                        note(positional_field(kind, pos as u32), v);
                    }
                    if medium_left_out {
                        note("group_idx", &a[medium]);
                    }
                }
                Value::Map(m) => {
                    for (k, v) in m {
                        if let Some(n) = k.as_str().filter(|n| !CARRIED.contains(n)) {
                            note(n, v);
                        }
                    }
                }
                _ => {}
            }
            meta
        }

        /// The fields one decoded event sets and the decoder does not carry.
        fn left_out_of(raw: &Value) -> FieldsLeftOut {
            let mut left = FieldsLeftOut::default();
            match raw {
                Value::Array(a) => {
                    let kind = a[0].as_str().unwrap_or("");
                    let from = match kind {
                        "BlockStored" => 8,
                        "BlockRemoved" => 3,
                        _ => return left,
                    };
                    for (pos, v) in a.iter().enumerate().skip(from) {
                        left.saw(positional_field(kind, pos as u32), v.is_nil());
                    }
                    if kind == "BlockStored" && a.get(5).is_some_and(|v| v.is_u64() || v.is_i64()) {
                        left.saw("lora_id", false);
                    }
                }
                Value::Map(m) => {
                    let mut carried = Vec::new();
                    for (k, v) in m {
                        let name = match k.as_str() {
                            Some(n) if CARRIED.contains(&n) && !carried.contains(&n) => {
                                carried.push(n);
                                continue;
                            }
                            Some(n) if !CARRIED.contains(&n) => n,
                            _ => "other",
                        };
                        left.saw(name, v.is_nil());
                    }
                }
                _ => {}
            }
            left
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
    }

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
            cache_salt: None,
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
                cache_salt: None,
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

    /// Dynamo's vLLM handler tags a request's cache salt (`dynamo-cache-salt:…`) in what
    /// it hands vLLM, which lists it in the first block's `extra_keys` (after the LoRA
    /// name): read from there as Dynamo's publisher reads it, both encodings, both
    /// decoders; an untagged string is no salt.
    #[test]
    fn a_salt_dynamo_tagged_in_extra_keys_is_the_stores_cache_salt() {
        let stored = |extra_keys: Value, lora: Value| {
            Value::Array(vec![
                s("BlockStored"),
                ints(&[1, 2]),
                Value::Nil,
                ints(&[1, 2, 3, 4]),
                Value::from(2u64),
                Value::Nil,
                s("GPU"),
                lora,
                extra_keys,
            ])
        };
        let keys = |first: Vec<Value>| Value::Array(vec![Value::Array(first), Value::Nil]);
        let cases = [
            (
                keys(vec![s("adapter"), s("dynamo-cache-salt:tenant-a")]),
                s("adapter"),
                Some("tenant-a"),
            ),
            // A LoRA name that looks tagged is skipped once, as Dynamo skips it.
            (
                keys(vec![s("dynamo-cache-salt:x"), s("dynamo-cache-salt:y")]),
                s("dynamo-cache-salt:x"),
                Some("y"),
            ),
            (keys(vec![s("salt-untagged"), ints(&[5])]), Value::Nil, None),
            (keys(vec![s("dynamo-cache-salt:")]), Value::Nil, None),
            (Value::Nil, Value::Nil, None),
        ];
        for (extra_keys, lora, want) in cases {
            let ev = stored(extra_keys.clone(), lora.clone());
            let map = Value::Map(vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), ints(&[1, 2])),
                (s("token_ids"), ints(&[1, 2, 3, 4])),
                (s("block_size"), Value::from(2u64)),
                (s("lora_name"), lora),
                (s("extra_keys"), extra_keys),
            ]);
            for ev in [ev, map] {
                let input = encode(&batch(vec![ev], None));
                let p = decode_payload(&input).unwrap();
                let KvEvent::BlockStored { cache_salt, .. } = &p.events[0] else {
                    panic!("{:?}", p.events)
                };
                assert_eq!(cache_salt.as_deref(), want);
                same_as_reference(&input, &Ok(p.clone()));
            }
        }
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
                    cache_salt: None,
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
    fn fields_not_carried_are_counted_per_event_that_sets_them() {
        let positional = Value::Array(vec![
            s("BlockStored"),
            ints(&[1]),
            Value::Nil,
            ints(&[1, 2]),
            Value::from(2u64),
            Value::from(4u64), // lora_id
            s("GPU"),
            Value::Nil,
            Value::Nil,        // extra_keys unset
            Value::from(2u64), // group_idx
        ]);
        let first_group = Value::Array(vec![
            s("BlockRemoved"),
            ints(&[1]),
            Value::Nil,
            Value::from(0u64), // group_idx 0: the mirror's own group
        ]);
        let mapped = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints(&[2])),
            ("token_ids", ints(&[1, 2])),
            ("block_size", Value::from(2u64)),
            ("lora_id", Value::from(3u64)),
            ("group_idx", Value::from(1u64)),
            ("locality", s("local")),
            ("session_id", Value::Nil),
            ("brand_new", Value::from(true)),
            ("medium", s("GPU")),
            ("medium", s("CPU")),
        ]);
        // A refused event's fields are not counted.
        let malformed = map(vec![
            ("type", s("BlockRemoved")),
            ("group_idx", Value::from(5u64)),
        ]);
        let input = encode(&batch(
            vec![positional, first_group, mapped, malformed],
            None,
        ));
        let p = decode_payload(&input).unwrap();
        same_as_reference(&input, &Ok(p.clone()));
        assert_eq!(p.events.len(), 3);
        assert_eq!(
            p.fields_left_out,
            FieldsLeftOut {
                lora_id: 2,
                other: 1, // brand_new and the second medium: one event
                ..FieldsLeftOut::default()
            }
        );
        // What says which events the mirror takes is read, not left out.
        let groups: Vec<_> = p.meta.iter().map(|m| (m.group_idx, m.locality)).collect();
        assert_eq!(
            groups,
            [
                (Some(2), None),
                (Some(0), None),
                (Some(1), Some(Locality::Unknown)) // vLLM spells it LOCAL
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

    /// What Dynamo's mocker before 1.5 publishes (its `ZmqRawKvEvent`, `rmp_serde::to_vec`:
    /// positional, medium skipped when None, then `group_idx: 0`), every shape of it.
    #[test]
    fn the_1_4_mockers_left_out_medium_is_read_and_counted() {
        let events = vec![
            // Device tier: no medium, group_idx where medium belongs.
            Value::Array(vec![s("BlockRemoved"), ints(&[7, 8]), Value::from(0u64)]),
            Value::Array(vec![
                s("BlockStored"),
                ints(&[5]),
                Value::Nil,
                ints(&[9, 9]),
                Value::from(2u64),
                Value::from(0u64),
            ]),
            // Host tier: medium present, group_idx after it.
            Value::Array(vec![
                s("BlockRemoved"),
                ints(&[6]),
                s("CPU_PINNED"),
                Value::from(0u64),
            ]),
            Value::Array(vec![
                s("BlockStored"),
                ints(&[6]),
                Value::from(5u64),
                ints(&[1, 2]),
                Value::from(2u64),
                s("CPU_PINNED"),
                Value::from(0u64),
            ]),
        ];
        let input = encode(&batch(events, Some(Value::from(0u64))));
        let p = decode_payload(&input).unwrap();
        same_as_reference(&input, &Ok(p.clone()));
        assert!(p.problems.is_empty(), "{:?}", p.problems);
        let removed = |h: Vec<u64>, medium: Option<&str>| KvEvent::BlockRemoved {
            block_hashes: h,
            medium: medium.map(String::from),
        };
        let mut pinned = stored(vec![6], Some(5), vec![1, 2], 2);
        if let KvEvent::BlockStored { medium, .. } = &mut pinned {
            *medium = Some("CPU_PINNED".into());
        }
        assert_eq!(
            p.events,
            vec![
                removed(vec![7, 8], None),
                stored(vec![5], None, vec![9, 9], 2),
                removed(vec![6], Some("CPU_PINNED")),
                pinned,
            ]
        );
        // The device removal and the host store were in the left-out layout.
        assert_eq!(p.medium_left_out, 2);

        // vLLM's positional events carry medium, nil or a string: never counted; a
        // negative integer or a map's integer medium is still malformed.
        let vllm = Value::Array(vec![
            s("BlockRemoved"),
            ints(&[1]),
            Value::Nil,
            Value::from(0u64),
        ]);
        let negative = Value::Array(vec![s("BlockRemoved"), ints(&[2]), Value::from(-1)]);
        let in_map = map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", ints(&[3])),
            ("medium", Value::from(0u64)),
        ]);
        let input = encode(&batch(vec![vllm, negative, in_map], None));
        let p = decode_payload(&input).unwrap();
        same_as_reference(&input, &Ok(p.clone()));
        assert_eq!(
            (p.events.len(), p.problems.len(), p.medium_left_out),
            (1, 2, 0)
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
                Value::F64(5.0),
            ]), // medium a float (an integer there is the 1.4 mocker's group_idx)
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

    /// The one-pass decoder's answer equals the `rmpv` tree decoder's, problems and
    /// errors included (a refusal's text for a payload that is not msgpack aside).
    fn same_as_reference(input: &[u8], got: &Result<DecodedPayload, PayloadError>) {
        let want = reference::decode_payload(input);
        match (got, &want) {
            (Ok(g), Ok(w)) => {
                assert_eq!(g.engine_ts.to_bits(), w.engine_ts.to_bits(), "{input:?}");
                assert_eq!(
                    (
                        &g.dp_rank,
                        &g.events,
                        &g.problems,
                        g.medium_left_out,
                        g.fields_left_out
                    ),
                    (
                        &w.dp_rank,
                        &w.events,
                        &w.problems,
                        w.medium_left_out,
                        w.fields_left_out
                    ),
                    "{input:?}"
                );
            }
            (Err(PayloadError::NotMsgpack(_)), Err(PayloadError::NotMsgpack(_))) => {}
            (g, w) => assert_eq!(g, w, "{input:?}"),
        }
    }

    #[test]
    fn decodes_as_the_rmpv_tree_decoder_did() {
        // Every marker in every field, duplicate keys, nesting at the depth limit and
        // past it, the reserved marker, lengths past the end.
        let every_kind = vec![
            Value::Nil,
            Value::Boolean(true),
            Value::from(-1),
            Value::from(-200),
            Value::from(-70_000),
            Value::from(-5_000_000_000i64),
            Value::from(200),
            Value::from(70_000),
            Value::from(5_000_000_000u64),
            Value::F32(1.5),
            Value::F64(-2.5),
            s("x"),
            s("BlockStored"),
            Value::String(rmpv::Utf8String::from("é".repeat(40))),
            Value::Binary(vec![1; 300]),
            Value::Ext(3, vec![1]),
            Value::Ext(3, vec![1; 16]),
            Value::Ext(3, vec![1; 17]),
            Value::Array(vec![Value::Nil; 20]),
            map(vec![("k", Value::Nil)]),
        ];
        let mut payloads = Vec::new();
        for v in &every_kind {
            let stored_map = map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", Value::Array(vec![v.clone()])),
                ("token_ids", ints(&[1, 2])),
                ("block_size", v.clone()),
                ("medium", v.clone()),
                ("lora_name", v.clone()),
                ("parent_block_hash", v.clone()),
                ("token_ids", v.clone()),
                ("type", v.clone()),
            ]);
            payloads.push(encode(&batch(
                vec![
                    stored_map,
                    map(vec![
                        ("block_hashes", ints(&[1])),
                        ("type", v.clone()),
                        ("token_ids", Value::Array(vec![Value::from(1), v.clone()])),
                        ("block_size", Value::from(2)),
                    ]),
                    Value::Array(vec![
                        s("BlockRemoved"),
                        Value::Array(vec![v.clone()]),
                        v.clone(),
                    ]),
                    Value::Array(vec![
                        s("BlockStored"),
                        ints(&[1]),
                        v.clone(),
                        Value::Array(vec![v.clone()]),
                        Value::from(1),
                        v.clone(),
                        v.clone(),
                        v.clone(),
                        v.clone(),
                    ]),
                    Value::Array(vec![v.clone(), v.clone()]),
                    map(vec![("type", v.clone())]),
                    v.clone(),
                ],
                Some(v.clone()),
            )));
            payloads.push(encode(&map(vec![
                ("events", Value::Array(vec![])),
                ("ts", v.clone()),
                ("dp_rank", v.clone()),
                ("data_parallel_rank", v.clone()),
                ("events", v.clone()),
            ])));
            payloads.push(encode(&map(vec![("ts", v.clone()), ("events", v.clone())])));
            payloads.push(encode(&Value::Array(vec![v.clone(), v.clone()])));
            payloads.push(encode(&Value::Array(vec![v.clone()])));
            payloads.push(encode(v));
        }
        for depth in [20, 30, 31, 32, 33, 60, 61, 62, 63, 64, 65] {
            let mut v = Value::Nil;
            for _ in 0..depth {
                v = Value::Array(vec![v]);
            }
            payloads.push(encode(&batch(vec![v.clone()], None)));
            payloads.push(encode(&v));
            let mut v = s("x");
            for _ in 0..depth {
                v = map(vec![("k", v)]);
            }
            payloads.push(encode(&batch(vec![v.clone()], None)));
            payloads.push(encode(&v));
        }
        payloads.push(vec![0xc1]);
        payloads.push(vec![0x92, 0xc1, 0x90]);
        payloads.push(vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0xc1]);
        payloads.push(vec![0xdd, 0xff, 0xff, 0xff, 0xff]);
        payloads.push(vec![0xc9, 0xff, 0xff, 0xff, 0xff, 1]);
        payloads.push(vec![0x92, 0x01, 0x90, 0x00]);
        for p in &payloads {
            same_as_reference(p, &decode_payload(p));
            // Every cut of it too.
            for cut in 0..p.len() {
                same_as_reference(&p[..cut], &decode_payload(&p[..cut]));
            }
        }
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
            let got = decode_payload(&input);
            same_as_reference(&input, &got);
            if got.is_ok() {
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
