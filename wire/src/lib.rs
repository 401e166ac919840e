//! The contracts between kvscope's parts: records, subjects, hashing, codecs, the HTTP API.
//!
//! Everything the agent ships to the collector over NATS JetStream, and everything a
//! recording holds, is an [`Envelope`] around one [`Record`]; what the collector's HTTP
//! API serves is in [`api`], the actuator's directives to a data plane in [`directive`].
//! Keeping these types in one small crate means the two sides of each hop can never
//! disagree about a field.

// Its codecs are fuzzed without a sanitizer (scripts/fuzz): safe Rust only.
#![forbid(unsafe_code)]

pub mod api;
pub mod bundle;
pub mod cost;
pub mod directive;
pub mod dynamo_events;
pub mod hashing;
pub mod kv_admission;
pub mod nats_security;
pub mod nixl;
pub mod packed;
pub mod parts;
pub mod record;
pub mod recording;
pub mod subject;
pub mod tier;
pub mod trace_ids;
pub mod vllm_events;

pub use hashing::{local_block_hash, sequence_hashes, LocalBlockHash, SequenceHash};
pub use nats_security::NatsSecurity;
pub use record::worker_map;
pub use record::*;
pub use subject::{Permissions, Subjects};
pub use tier::{LowerTierBlocks, Tier};
