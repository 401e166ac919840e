//! An independent oracle for the collector's overlaps, built on the real
//! `dynamo-kv-router` 1.6.1 crate (a dev-dependency only).
//!
//! It replays kvscope records through the same steps Dynamo 1.6.1 takes from a vLLM ZMQ
//! event to the router's radix tree, using the crate's own code wherever it is public:
//!
//! 1. **Worker-side publisher** (`lib/llm/src/kv_router/publisher/zmq_listener.rs`): every
//!    raw event of a ZMQ batch, in order, goes through
//!    `ZmqEventNormalizer::preprocess_with_reason` + `normalize_preprocessed` (→
//!    `zmq_wire::convert_event`), with one event id per accepted event from a per-worker
//!    counter. `convert_event` makes `KvCacheStoreData { parent_hash: engine parent,
//!    blocks: [KvCacheStoredBlockData { block_hash: engine hash, tokens_hash:
//!    compute_block_hash_for_seq(block tokens, kv_block_size, lora_name)[0] }] }`; it stops
//!    at the first block whose size is not `kv_block_size` or whose tokens are missing,
//!    turns a store that repeats a hash (or names itself as parent) into an empty
//!    `Removed` (a no-op), maps `BlockRemoved` to `Removed` and `AllBlocksCleared` to
//!    `Cleared` for that `(worker_id, dp_rank)`, and drops events of an unknown `medium`.
//!    The engine's ZMQ sequence number is not looked at after start-up: a gap is not
//!    replayed and a restart (sequence going backwards, kvscope's
//!    `SequenceStatus::Reset`) clears nothing. The oracle does the same: it ignores
//!    `KvEventBatch::sequence` entirely. (The crate's *standalone* indexer listener,
//!    `services/indexer/listener.rs`, differs: it replays gaps and silently drops
//!    "stale" batches whose sequence is not above the last one, i.e. everything after an
//!    engine restart until the count catches up. That is not the frontend path.)
//! 2. **Event processor** (`publisher/event_processor.rs`, `publisher/dedup.rs`): with
//!    the default `batching_timeout_ms = None` every event is flushed on its own, through
//!    `EventDedupFilter`: stores always pass and add 1 to a refcount per
//!    `(dp_rank, storage tier)` and block hash; a remove passes only for hashes whose
//!    refcount drops to 0 or that were never counted; a `Cleared` resets that rank's
//!    refcounts. Mirrored below (`Refcounts`) for the device tier.
//! 3. **Router indexer**: events whose tier is not the device (GPU) tier go to the
//!    lower-tier indexers, not the primary tree the overlap comes from
//!    (`RouterEvent::targets_primary`). The frontend uses
//!    `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`, which is asynchronous; the oracle
//!    uses the synchronous `RadixTree`, which has the same semantics for everything here
//!    (unknown parent: store skipped with `ParentBlockNotFound`; unknown removed hash:
//!    skipped with `BlockNotFound`, the rest of the event still applied; a removed hash
//!    truncates the worker's coverage of that chain from that block on), and applies
//!    every event before the next query.
//!
//! For each `Record::Decision` it calls `RadixTree::find_matches(local_hashes, false)`
//! and keeps the workers with a non-zero score.
//!
//! **Lower tiers** ([`dynamo_tiers`]): the events step 3 sends to the lower-tier
//! indexers go to the crate's own `LowerTierIndexers` (one `LowerTierIndexer` per host,
//! disk and external tier, keyed by the engine's hashes), and a decision's match is
//! extended through them with the router's own walk, `query_lower_tiers_with_options`,
//! seeded by `RadixTree::find_match_details` (each worker's device overlap and last
//! matched hash). The dedup refcounts of step 2 are kept per tier, as Dynamo keeps them.
//!
//! An engine's tokens reach the records as their blocks' local hashes (the agent hashes
//! them, `KvEvent::hash_tokens`). Step 1 then runs on placeholder tokens of the same
//! count, one block's worth per local hash: Dynamo's conversion looks at how many tokens
//! each block has (and at multimodal token ids, which kvscope records never carry), and
//! hashes them; the blocks it converts then take the agent's local hashes in order. That
//! those hashes are Dynamo's `compute_block_hash_for_seq` of the tokens is checked on its
//! own against the crate (`wire/tests/hash_vectors.rs`).
//!
//! Assumptions the records cannot settle: the publisher's configured `kv_block_size`
//! is taken to be the `block_size` of the first `BlockStored` seen from that worker key
//! (Dynamo drops blocks whose size differs from it); a store's `cache_salt` goes to the
//! publisher as its `cache_salt` (Dynamo's cache namespace); there are no multimodal or
//! eagle fields in kvscope records, so they are absent here too.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use dynamo_kv_router::indexer::{
    query_lower_tiers_with_options, LowerTierIndexers, LowerTierQueryOptions,
};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier, WorkerWithDpRank,
};
use dynamo_kv_router::radix_tree::RadixTree;
use dynamo_kv_router::zmq_wire::{BlockHashValue, RawKvEvent, ZmqEventNormalizer};
use kvscope_wire::{Envelope, KvEvent, KvEventBatch, KvOrigin, Record, WorkerKey};

/// Replays kvscope records in order into dynamo-kv-router's RadixTree and returns, for each
/// Record::Decision in the input, the request id and the overlap (in blocks) of every worker
/// that has a non-zero overlap, as the Dynamo indexer computes it at that point in the stream.
pub fn dynamo_overlaps(records: &[Envelope]) -> Vec<(String, BTreeMap<WorkerKey, u32>)> {
    replay_decisions(records, |oracle, locals| oracle.overlaps(locals))
}

/// [`dynamo_overlaps`] through the tiers: per decision, every worker's device overlap
/// and how far the router extends it through its host tier, then its disk tier (disk
/// and external, as the router's `disk_blocks` counts them), for the workers that hold
/// any of it.
pub fn dynamo_tiers(records: &[Envelope]) -> Vec<(String, BTreeMap<WorkerKey, TieredMatch>)> {
    replay_decisions(records, |oracle, locals| oracle.tiered(locals))
}

/// A worker's match through the tiers, in blocks, as Dynamo's router counts it: the
/// device overlap, then the host and disk extensions past it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TieredMatch {
    pub device: u32,
    pub host: u32,
    pub disk: u32,
}

/// Replay `records` in order, asking `query` for each decision's chain (its local
/// hashes), the answer kept for the workers of the decision's model and pool.
fn replay_decisions<T>(
    records: &[Envelope],
    query: impl Fn(&DynamoOracle, &[u64]) -> BTreeMap<WorkerKey, T>,
) -> Vec<(String, BTreeMap<WorkerKey, T>)> {
    let mut oracle = DynamoOracle::new();
    let mut out = Vec::new();
    let mut removed = std::collections::HashSet::new();
    // Dynamo's router keeps one index per model, and a disaggregated fleet's prefill
    // router its own of the prefill workers: a request is matched only against the
    // workers of its model and pool (the chosen worker's).
    let mut models: HashMap<u64, (String, bool)> = HashMap::new();
    for env in records {
        match &env.record {
            Record::Worker(w) if w.state == kvscope_wire::WorkerState::Up => {
                if let Some(m) = &w.model {
                    let prefill = w
                        .worker_type
                        .as_deref()
                        .is_some_and(|t| t.eq_ignore_ascii_case("prefill"));
                    models.insert(w.worker_id, (m.clone(), prefill));
                }
            }
            // The router stops listening to a worker that left discovery.
            Record::KvEvents(batch) if removed.contains(&batch.worker.worker_id) => {}
            Record::KvEvents(batch) => oracle.apply(batch),
            // Dynamo's router drops a worker from its index when the worker leaves
            // discovery (`indexer.remove_worker`).
            Record::Worker(w) if w.state == kvscope_wire::WorkerState::Gone => {
                oracle.tree_mut().remove_worker(w.worker_id);
                removed.insert(w.worker_id);
            }
            Record::Decision(d) => {
                let locals = match &d.sequence_hashes {
                    Some(seq) => oracle.locals_of(seq),
                    None => d.local_hashes.clone(),
                };
                let mut o = query(&oracle, &locals);
                if let Some(m) = models.get(&d.worker.worker_id) {
                    o.retain(|w, _| models.get(&w.worker_id) == Some(m));
                }
                out.push((d.request_id.clone(), o));
            }
            _ => {}
        }
    }
    out
}

/// Assert that every verdict's per-worker overlaps equal Dynamo's for the same records
/// (the verdicts judged from `records`, in order), naming the first that differ.
pub fn assert_overlaps_equal(
    verdicts: &[kvscope_wire::api::verdict::SpillVerdict],
    records: &[Envelope],
) {
    let expected = dynamo_overlaps(records);
    assert_eq!(verdicts.len(), expected.len(), "verdicts vs decisions");
    let mismatches: Vec<String> = verdicts
        .iter()
        .zip(&expected)
        .filter(|(v, (id, o))| v.request_id != *id || v.overlaps != *o)
        .map(|(v, (_, o))| {
            format!(
                "{}: kvscope {:?} vs dynamo {:?}",
                v.request_id, v.overlaps, o
            )
        })
        .collect();
    assert!(
        mismatches.is_empty(),
        "{} of {} decisions differ from Dynamo's indexer: {:#?}",
        mismatches.len(),
        verdicts.len(),
        &mismatches[..mismatches.len().min(5)]
    );
}

/// What happened to the events the oracle was given (for tests that want to know
/// whether Dynamo rejected something).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OracleCounters {
    /// Events accepted by the publisher's normalizer and converted.
    pub converted: u64,
    /// Events dropped by the normalizer (unknown medium, filtered group, ...).
    pub filtered: u64,
    /// Events that went to a lower storage tier, not the primary (GPU) tree.
    pub lower_tier: u64,
    /// Removes swallowed entirely by the publisher's refcount dedup.
    pub dedup_swallowed: u64,
    /// Stores the tree rejected because the parent was unknown for that worker.
    pub parent_not_found: u64,
    /// Removes that named at least one block the tree did not hold for that worker.
    pub block_not_found: u64,
    /// Other errors from `apply_event`.
    pub other_errors: u64,
    /// Lower-tier events a lower-tier indexer refused.
    pub lower_tier_errors: u64,
}

#[derive(Default)]
struct PublisherState {
    /// The publisher's normalizer; created with the first stored event's block size.
    normalizer: Option<ZmqEventNormalizer>,
    next_event_id: u64,
    /// `EventDedupFilter` refcounts per tier of this `(worker, dp_rank)`.
    refcounts: HashMap<(StorageTier, ExternalSequenceBlockHash), usize>,
}

/// The stateful oracle behind [`dynamo_overlaps`], for callers that interleave their
/// own queries.
pub struct DynamoOracle {
    tree: RadixTree,
    /// Every stored block's sequence hash → its local hash, and engine hash → sequence
    /// hash (to chain a store onto its parent): how a decision known by sequence hashes
    /// (the request trace) is put to the tree, which matches by local hash.
    seq_to_local: HashMap<u64, u64>,
    engine_to_seq: HashMap<(WorkerKey, u64), u64>,
    publishers: HashMap<WorkerKey, PublisherState>,
    /// The router's lower-tier indexers (host, disk, external), made on the first
    /// lower-tier event.
    lower: LowerTierIndexers,
    warnings: Arc<AtomicU32>,
    pub counters: OracleCounters,
}

impl Default for DynamoOracle {
    fn default() -> Self {
        Self::new()
    }
}

impl DynamoOracle {
    pub fn new() -> Self {
        Self {
            tree: RadixTree::new(),
            seq_to_local: HashMap::new(),
            engine_to_seq: HashMap::new(),
            publishers: HashMap::new(),
            lower: LowerTierIndexers::new(1, 16),
            warnings: Arc::new(AtomicU32::new(0)),
            counters: OracleCounters::default(),
        }
    }

    /// The local hashes of a chain known by its sequence hashes, up to the first block
    /// never stored anywhere (no worker can hold it or anything after it).
    pub fn locals_of(&self, seq: &[u64]) -> Vec<u64> {
        seq.iter()
            .map_while(|s| self.seq_to_local.get(s).copied())
            .collect()
    }

    fn learn_hashes(&mut self, worker: WorkerKey, ev: &KvEvent) {
        let (
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                ..
            },
            Some(locals),
        ) = (ev, ev.stored_local_hashes())
        else {
            return;
        };
        let mut prev =
            parent_block_hash.and_then(|p| self.engine_to_seq.get(&(worker, p)).copied());
        for (engine, local) in block_hashes.iter().zip(locals.iter()) {
            let seq = kvscope_wire::hashing::chain_hash(prev, *local);
            self.seq_to_local.insert(seq, *local);
            self.engine_to_seq.insert((worker, *engine), seq);
            prev = Some(seq);
        }
    }

    /// One batch, from an engine's publisher (through the worker-side steps) or from
    /// Dynamo's event plane (straight to the tree, as the router applies it).
    pub fn apply(&mut self, batch: &KvEventBatch) {
        for ev in &batch.events {
            self.learn_hashes(batch.worker, ev);
        }
        match batch.origin {
            KvOrigin::Engine => self.apply_batch(batch.worker, &batch.events),
            KvOrigin::EventPlane => {
                for ev in &batch.events {
                    self.apply_plane_event(batch.worker, ev);
                }
            }
        }
    }

    /// One ZMQ batch of one worker key, events in order.
    pub fn apply_batch(&mut self, worker: WorkerKey, events: &[KvEvent]) {
        for ev in events {
            self.apply_one(worker, ev);
        }
    }

    /// An event as Dynamo's event plane carried it: the worker's publisher already
    /// normalized and de-duplicated it, so the router applies it to its tree as is.
    fn apply_plane_event(&mut self, worker: WorkerKey, ev: &KvEvent) {
        let dyn_worker = WorkerWithDpRank::new(worker.worker_id, worker.dp_rank);
        let state = self.publishers.entry(worker).or_default();
        let event_id = state.next_event_id;
        state.next_event_id += 1;
        let medium = match ev {
            KvEvent::BlockStored { medium, .. } | KvEvent::BlockRemoved { medium, .. } => {
                medium.as_deref()
            }
            KvEvent::AllBlocksCleared => None,
        };
        let tier = match medium {
            None => StorageTier::Device,
            Some(m) => match StorageTier::from_kv_medium(m) {
                Some(t) => t,
                None => {
                    self.counters.filtered += 1;
                    return;
                }
            },
        };
        let data = match ev {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                local_hashes,
                ..
            } => KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent_block_hash.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: block_hashes
                    .iter()
                    .zip(local_hashes.iter().flatten())
                    .map(|(&h, &l)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(h),
                        tokens_hash: LocalBlockHash(l),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
            KvEvent::BlockRemoved { block_hashes, .. } => {
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: block_hashes
                        .iter()
                        .copied()
                        .map(ExternalSequenceBlockHash)
                        .collect(),
                })
            }
            KvEvent::AllBlocksCleared => KvCacheEventData::Cleared,
        };
        self.counters.converted += 1;
        let event = RouterEvent::with_storage_tier(
            dyn_worker.worker_id,
            KvCacheEvent {
                event_id,
                data,
                dp_rank: dyn_worker.dp_rank,
            },
            tier,
        );
        if tier.is_gpu() {
            self.apply_to_tree(event);
        } else {
            self.apply_to_lower_tier(event);
        }
    }

    fn apply_one(&mut self, worker: WorkerKey, ev: &KvEvent) {
        let dyn_worker = WorkerWithDpRank::new(worker.worker_id, worker.dp_rank);
        let raw = to_raw(ev);
        let state = self.publishers.entry(worker).or_default();
        if state.normalizer.is_none() {
            if let KvEvent::BlockStored { block_size, .. } = ev {
                state.normalizer = Some(ZmqEventNormalizer::with_warning_count(
                    *block_size,
                    self.warnings.clone(),
                ));
            }
        }
        // Removes and clears do not depend on the block size; before the first store a
        // throwaway normalizer converts them.
        let mut scratch;
        let normalizer = match state.normalizer.as_mut() {
            Some(n) => n,
            None => {
                scratch = ZmqEventNormalizer::with_warning_count(0, self.warnings.clone());
                &mut scratch
            }
        };
        let raw = match normalizer.preprocess_with_reason(raw, dyn_worker) {
            Ok(raw) => raw,
            Err(_) => {
                self.counters.filtered += 1;
                return;
            }
        };
        let event_id = state.next_event_id;
        state.next_event_id += 1;
        let Some(placement) = normalizer.normalize_preprocessed(raw, event_id, dyn_worker) else {
            self.counters.filtered += 1;
            return;
        };
        self.counters.converted += 1;
        let Some(mut router_event) = placement.into_router_event() else {
            self.counters.filtered += 1;
            return;
        };
        if let (
            KvCacheEventData::Stored(store),
            KvEvent::BlockStored {
                token_ids,
                local_hashes: Some(locals),
                ..
            },
        ) = (&mut router_event.event.data, ev)
        {
            if token_ids.is_empty() {
                // The blocks converted from placeholder tokens take the agent's hashes.
                for (block, &local) in store.blocks.iter_mut().zip(locals) {
                    block.tokens_hash = LocalBlockHash(local);
                }
            }
        }
        let tier = router_event.storage_tier;

        // EventDedupFilter (per dp rank and tier).
        match &mut router_event.event.data {
            KvCacheEventData::Stored(store) => {
                for b in &store.blocks {
                    *state.refcounts.entry((tier, b.block_hash)).or_insert(0) += 1;
                }
            }
            KvCacheEventData::Removed(remove) => {
                let refcounts = &mut state.refcounts;
                remove
                    .block_hashes
                    .retain(|h| match refcounts.get_mut(&(tier, *h)) {
                        Some(n) => {
                            *n -= 1;
                            if *n == 0 {
                                refcounts.remove(&(tier, *h));
                                true
                            } else {
                                false
                            }
                        }
                        None => true,
                    });
                if remove.block_hashes.is_empty() {
                    // `filter_remove_in_domain` returns None: nothing is published.
                    self.counters.dedup_swallowed += 1;
                    return;
                }
            }
            KvCacheEventData::Cleared => state.refcounts.retain(|(t, _), _| *t != tier),
        }

        if !router_event.targets_primary().unwrap_or(false) {
            self.apply_to_lower_tier(router_event);
            return;
        }
        self.apply_to_tree(router_event);
    }

    /// A host, disk or external tier's event, to that tier's indexer, applied before
    /// the next query (the router's indexers are asynchronous; the oracle waits).
    fn apply_to_lower_tier(&mut self, router_event: RouterEvent) {
        self.counters.lower_tier += 1;
        let indexer = self.lower.get_or_create(router_event.storage_tier);
        // Its worker threads apply the event; waiting on them needs no async runtime.
        if futures::executor::block_on(indexer.apply_event_and_wait(router_event)).is_err() {
            self.counters.lower_tier_errors += 1;
        }
    }

    /// Every worker's match through the tiers for this chain of local hashes, as the
    /// router walks it: the device tree's match (overlap and last matched hash), then
    /// the lower tiers in the router's order, each from where the faster ones ended.
    pub fn tiered(&self, local_hashes: &[u64]) -> BTreeMap<WorkerKey, TieredMatch> {
        let seq: Vec<LocalBlockHash> = local_hashes.iter().copied().map(LocalBlockHash).collect();
        let device = self.tree.find_match_details(seq.clone(), false);
        let lower = query_lower_tiers_with_options(
            &self.lower,
            &seq,
            &device,
            LowerTierQueryOptions::default(),
        );
        let key = |w: &WorkerWithDpRank| WorkerKey {
            worker_id: w.worker_id,
            dp_rank: w.dp_rank,
        };
        let mut out: BTreeMap<WorkerKey, TieredMatch> = BTreeMap::new();
        for (w, n) in &device.overlap_scores.scores {
            out.entry(key(w)).or_default().device = *n;
        }
        for (tier, details) in &lower {
            for (w, n) in &details.hits {
                let m = out.entry(key(w)).or_default();
                match tier {
                    StorageTier::HostPinned => m.host += *n as u32,
                    StorageTier::Disk | StorageTier::External => m.disk += *n as u32,
                    StorageTier::Device => {}
                }
            }
        }
        out.retain(|_, m| m.device + m.host + m.disk > 0);
        out
    }

    fn apply_to_tree(&mut self, router_event: RouterEvent) {
        match self.tree.apply_event(router_event) {
            Ok(()) => {}
            Err(e) => {
                let s = format!("{e:?}");
                if s.contains("ParentBlockNotFound") {
                    self.counters.parent_not_found += 1;
                } else if s.contains("BlockNotFound") {
                    self.counters.block_not_found += 1;
                } else {
                    self.counters.other_errors += 1;
                }
            }
        }
    }

    /// Overlap in blocks of every worker with a non-zero overlap for this chain of
    /// router local hashes.
    pub fn overlaps(&self, local_hashes: &[u64]) -> BTreeMap<WorkerKey, u32> {
        let seq: Vec<LocalBlockHash> = local_hashes.iter().copied().map(LocalBlockHash).collect();
        self.tree
            .find_matches(seq, false)
            .scores
            .into_iter()
            .filter(|(_, score)| *score > 0)
            .map(|(w, score)| {
                (
                    WorkerKey {
                        worker_id: w.worker_id,
                        dp_rank: w.dp_rank,
                    },
                    score,
                )
            })
            .collect()
    }

    /// Direct access to the tree, e.g. for `RouterEvent`s built by hand.
    pub fn tree_mut(&mut self) -> &mut RadixTree {
        &mut self.tree
    }

    /// Apply a `RouterEvent` straight to the tree (no publisher steps).
    pub fn apply_router_event(&mut self, event: RouterEvent) {
        let _ = self.tree.apply_event(event);
    }
}

fn to_raw(ev: &KvEvent) -> RawKvEvent {
    match ev {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_name,
            medium,
            local_hashes,
            cache_salt,
        } => RawKvEvent::BlockStored {
            block_hashes: block_hashes
                .iter()
                .map(|h| BlockHashValue::Unsigned(*h))
                .collect(),
            parent_block_hash: parent_block_hash.map(BlockHashValue::Unsigned),
            token_ids: match local_hashes {
                // Placeholders, as many as the hashed blocks had (see the module's docs).
                Some(l) if token_ids.is_empty() => vec![0; l.len() * *block_size as usize],
                _ => token_ids.clone(),
            },
            block_size: *block_size as usize,
            medium: medium.clone(),
            lora_name: lora_name.clone(),
            cache_namespace: cache_salt.clone(),
            block_mm_infos: None,
            is_eagle: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
            locality: None,
            ownership: None,
            session_id: None,
        },
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
        } => RawKvEvent::BlockRemoved {
            block_hashes: block_hashes
                .iter()
                .map(|h| BlockHashValue::Unsigned(*h))
                .collect(),
            medium: medium.clone(),
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
            locality: None,
            ownership: None,
        },
        KvEvent::AllBlocksCleared => RawKvEvent::AllBlocksCleared { ownership: None },
    }
}

/// Per decision, the true delta kvscope measures when every routing decision is applied
/// `lag_ns` earlier than its log time, i.e. before the KV events of the last `lag_ns`:
/// what a router whose index lags the engines by that much would have seen (a negative
/// lag: a router that saw events stamped after its log line).
pub fn true_delta_with_router_lag(
    envelopes: &[Envelope],
    lag_ns: i64,
    config: kvscope_collector::fold::analyzer::AnalyzerConfig,
) -> Vec<u64> {
    let mut order: Vec<&Envelope> = envelopes.iter().collect();
    // Stable: records with equal keys keep the agent's order.
    order.sort_by_key(|e| match e.record {
        Record::Decision(_) => e.observed_ns as i64 - lag_ns,
        _ => e.observed_ns as i64,
    });
    let mut analyzer = kvscope_collector::fold::analyzer::FleetAnalyzer::new(config);
    order
        .into_iter()
        .filter_map(|e| analyzer.apply(e))
        .map(|v| v.true_delta_tokens)
        .collect()
}
