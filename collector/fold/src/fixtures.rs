//! Builders of records for tests of the fold and of the crates on it: worker keys of dp
//! rank 0, envelopes from one agent, block stores of 2-token blocks, decisions hashed as
//! Dynamo hashes them. Compiled always (a feature would make the test build's
//! dependencies a second variant of the product's), used by no product code.

use kvscope_wire::hashing::{local_block_hashes, DYNAMO_HASH_SEED};
use kvscope_wire::{
    Envelope, KvEvent, KvEventBatch, Record, RoutingDecision, SequenceStatus, WorkerKey,
};

/// Worker `id`, dp rank 0.
pub fn w(id: u64) -> WorkerKey {
    WorkerKey {
        worker_id: id,
        dp_rank: 0,
    }
}

/// `record` as agent `a` observed it at `t` ns.
pub fn env(t: u64, record: Record) -> Envelope {
    Envelope {
        agent: "a".into(),
        observed_ns: t,
        record,
    }
}

/// Worker `worker` stores `tokens` as blocks of 2 named `hashes`, in batch `seq`.
pub fn stored(
    worker: u64,
    seq: u64,
    status: SequenceStatus,
    tokens: &[u32],
    hashes: &[u64],
) -> Record {
    stored_under(worker, seq, status, None, tokens, hashes)
}

/// [`stored`], the first block's parent `parent`.
pub fn stored_under(
    worker: u64,
    seq: u64,
    status: SequenceStatus,
    parent: Option<u64>,
    tokens: &[u32],
    hashes: &[u64],
) -> Record {
    batch(
        worker,
        seq,
        status,
        vec![KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: 2,
            local_hashes: None,
            lora_name: None,
            medium: None,
            cache_salt: None,
        }],
    )
}

/// A batch of `events` from worker `worker`'s publisher.
pub fn batch(worker: u64, seq: u64, status: SequenceStatus, events: Vec<KvEvent>) -> Record {
    Record::KvEvents(KvEventBatch {
        worker: w(worker),
        publisher: format!("p{worker}"),
        origin: Default::default(),
        seq,
        sequence: status,
        engine_ts: 0.0,
        events,
    })
}

/// The router sent request `id` of `tokens` to worker `to` (blocks of 2), as a record.
pub fn decision(id: &str, to: u64, tokens: &[u32]) -> Record {
    Record::Decision(routing_decision(id, to, tokens))
}

/// The router sent request `id` of `tokens` to worker `to` (blocks of 2).
pub(crate) fn routing_decision(id: &str, to: u64, tokens: &[u32]) -> RoutingDecision {
    RoutingDecision {
        tenant: None,
        model: None,
        request_id: id.into(),
        worker: w(to),
        isl_tokens: tokens.len() as u64,
        block_size: 2,
        local_hashes: local_block_hashes(tokens, 2, DYNAMO_HASH_SEED),
        sequence_hashes: None,
        worker_type: None,
        router_mode: None,
        clock_behind_ms: None,
        selection: Default::default(),
        trace: None,
    }
}
