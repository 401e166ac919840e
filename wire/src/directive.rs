//! Migration directives as they travel from the actuator to a data plane (the NIXL
//! lab's workers, or a router's endpoint). Both sides check the bearer token with
//! `kvscope_kit::auth`.
//! The actuator decides them (`kvscope_actuator::act::directive`); receivers only need these
//! types, without the actuator's dependencies.

use crate::WorkerKey;
use serde::{Deserialize, Serialize};

/// The HTTP header carrying [`MigrationDirective::idempotency_key`].
pub const IDEMPOTENCY_HEADER: &str = "Idempotency-Key";

/// The blocks to migrate: positions `first .. first + count` of the request's block chain
/// (the part the source holds and the target does not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRange {
    pub first: u32,
    pub count: u32,
    pub block_size: u32,
}

/// One migration to perform: the source (holding the KV) serves as producer, the target
/// pulls.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrationDirective {
    /// Stable for the same spill: a receiver that sees it twice performs it once.
    pub idempotency_key: String,
    pub request_id: String,
    /// The session (conversation) when known; the collector's verdicts do not carry it yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    pub source: WorkerKey,
    pub target: WorkerKey,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_nixl_agent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_nixl_agent: Option<String>,
    pub blocks: BlockRange,
    /// The Dynamo sequence hashes of the blocks in `blocks`, in chain order (the
    /// verdict's `delta_block_hashes`): what the target will hold afterwards.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub block_hashes: Vec<u64>,
    /// The sequence hash of the block they extend (position `blocks.first − 1`, which the
    /// target already holds); none when `blocks.first` is 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_block_hash: Option<u64>,
    /// The true delta, tokens.
    pub tokens: u64,
    /// When the router decided (UNIX ns, the agent's clock).
    pub decided_ns: u64,
    /// When the actuator issued the directive (UNIX ns).
    pub issued_ns: u64,
    pub predicted: Prediction,
}

/// What one migration of `tokens` is predicted to cost and save.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub tokens: u64,
    pub bytes: u64,
    pub handshake_s: f64,
    pub transfer_s: f64,
    pub dispatch_overhead_s: f64,
    /// handshake + transfer + dispatch overhead.
    pub migrate_s: f64,
    /// tokens / prefill rate.
    pub recompute_s: f64,
    pub prefill_tok_per_s: f64,
    /// recompute − migrate: positive means migrating is faster.
    pub net_benefit_s: f64,
}
