//! Everything that answers "how many leading blocks of this request does each worker
//! hold", behind one interface: kvscope's fleet mirror and every exact per-worker
//! indexer `dynamo-kv-router` 1.6.1 exposes.
//!
//! A contender turns a run of events into its own input format in [`Contender::prepare`]
//! (not timed: in production that shape arrives ready from the wire), then
//! [`Contender::apply`]s it (timed, and done when it returns: the next query must see
//! every event before it), then answers a query (timed).

use crate::trace::{Op, Span, Trace};
use dynamo_kv_router::indexer::positional::{LevelIndex, PositionalIndexer, SearchMode};
use dynamo_kv_router::indexer::{
    BranchShardedIndexer, KvIndexer, KvIndexerInterface, KvIndexerMetrics, SyncIndexer,
    ThreadPoolIndexer,
};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent, WorkerWithDpRank,
};
use dynamo_kv_router::radix_tree::RadixTree;
use dynamo_kv_router::ConcurrentRadixTreeCompressed;
use kvscope_collector::fold::fleet_index::FleetIndex;
use kvscope_wire::WorkerKey;
use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;
use std::ops::Range;
use std::sync::Arc;

/// Dynamo's `kv_block_size` for its wrappers; only used when they hash tokens, which
/// nothing here asks them to do.
const BLOCK_SIZE: u32 = 16;
/// Jump size of the positional indexer, as Dynamo's own tests build it.
const POSITIONAL_JUMP: usize = 32;

pub trait Contender {
    /// A run of events in the contender's own input format.
    type Batch;
    /// A query in the contender's own input format.
    type Query;
    type Answer;

    fn prepare(&mut self, trace: &Trace, ops: Range<usize>) -> Self::Batch;
    fn apply(&mut self, trace: &Trace, batch: Self::Batch);
    fn prepare_query(&self, trace: &Trace, locals: Span) -> Self::Query;
    fn query(&mut self, trace: &Trace, query: Self::Query) -> Self::Answer;
    /// An order-independent digest of every worker's non-zero overlap.
    fn digest(answer: &Self::Answer) -> u64;
    /// Workers with a non-zero overlap.
    fn holders(answer: &Self::Answer) -> usize;
}

/// The contenders, by the name the command line and the report use.
pub const CONTENDERS: &[(&str, &str)] = &[
    (
        "kvscope",
        "kvscope FleetIndex: store/remove/clear, and per query sequence hashes + overlaps; \
         single thread",
    ),
    (
        "dynamo-radix-tree",
        "RadixTree: the single-threaded tree (worker-side LocalKvIndexer, Dynamo's tests); \
         single thread",
    ),
    (
        "dynamo-positional",
        "PositionalIndexer (NestedMap), strided jump search (jump 32), driven directly; \
         single thread",
    ),
    (
        "dynamo-positional-binary",
        "PositionalIndexer, binary search mode, driven directly; single thread",
    ),
    (
        "dynamo-crtc-1",
        "ThreadPoolIndexer<ConcurrentRadixTreeCompressed>, 1 event thread, reads inline: \
         the router's default shape; 2 threads",
    ),
    (
        "dynamo-crtc-4",
        "ThreadPoolIndexer<ConcurrentRadixTreeCompressed>, 4 event threads (Dynamo's \
         default router_event_threads); 5 threads on 2 cores",
    ),
    (
        "dynamo-positional-tp-1",
        "ThreadPoolIndexer<PositionalIndexer>, 1 event thread, reads inline; 2 threads",
    ),
    (
        "dynamo-kv-indexer",
        "KvIndexer: RadixTree on its own thread behind tokio channels (router \
         'single' mode); 2 threads",
    ),
    (
        "dynamo-branch-sharded",
        "BranchShardedIndexer over 2 ThreadPoolIndexer<CRTC> shards of 1 event thread, \
         routing depth 1; 3 threads",
    ),
];

pub fn describe(name: &str) -> &'static str {
    CONTENDERS
        .iter()
        .find(|(n, _)| *n == name)
        .map_or("?", |(_, d)| d)
}

/// Mixes one (worker, overlap) pair into a digest term; summing terms makes the digest
/// independent of map order.
fn term(worker_id: u64, dp_rank: u32, score: u32) -> u64 {
    let mut z = worker_id
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(u64::from(dp_rank) << 32 | u64::from(score));
    z = (z ^ (z >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^ (z >> 29)
}

// ---------------------------------------------------------------------------------
// kvscope

/// Reads every cache line of `hashes`, so that the timed call that follows finds them
/// in cache (eight hashes to a line).
fn warm(hashes: &[u64]) -> u64 {
    hashes.iter().step_by(8).fold(0, |acc, h| acc ^ h)
}

pub struct Kvscope {
    index: FleetIndex,
}

impl Kvscope {
    pub fn new() -> Self {
        Self {
            index: FleetIndex::new(),
        }
    }

    pub fn index(&self) -> &FleetIndex {
        &self.index
    }
}

impl Contender for Kvscope {
    type Batch = Range<usize>;
    type Query = Span;
    type Answer = BTreeMap<WorkerKey, u32>;

    fn prepare(&mut self, trace: &Trace, ops: Range<usize>) -> Range<usize> {
        // Dynamo's contenders read their input from the batch just converted for them,
        // so in cache; kvscope reads its input in place from the trace, so it is read
        // once here, untimed, to start its timed call with its input in cache too.
        black_box(trace.ops[ops.clone()].iter().fold(0u64, |acc, op| {
            acc ^ match *op {
                Op::Store { blocks, start, .. } => {
                    let (engine, locals) = trace.stored(start, blocks);
                    warm(engine) ^ warm(locals)
                }
                Op::Remove { engine, .. } => warm(trace.hashes(engine)),
                Op::Clear { .. } | Op::Query { .. } => 0,
            }
        }));
        ops
    }

    fn apply(&mut self, trace: &Trace, batch: Range<usize>) {
        self.index
            .prefetch_stores(trace.ops[batch.clone()].iter().filter_map(|op| {
                let s = trace.store(op)?;
                Some((s.worker, s.parent, *s.engine.first()?))
            }));
        for op in &trace.ops[batch] {
            match *op {
                Op::Store { .. } => {
                    let s = trace.store(op).expect("a store");
                    let _ = black_box(
                        self.index
                            .store_hashed(s.worker, s.parent, s.engine, s.locals),
                    );
                }
                Op::Remove { worker, engine, .. } => {
                    black_box(
                        self.index
                            .remove(trace.workers[worker as usize], trace.hashes(engine)),
                    );
                }
                Op::Clear { worker } => {
                    black_box(self.index.clear(trace.workers[worker as usize]));
                }
                Op::Query { .. } => unreachable!("batches hold events only"),
            }
        }
    }

    fn prepare_query(&self, trace: &Trace, locals: Span) -> Span {
        black_box(warm(trace.hashes(locals)));
        locals
    }

    fn query(&mut self, trace: &Trace, locals: Span) -> Self::Answer {
        // What the analyzer does per routing decision: the decision carries the router's
        // local hashes; the analyzer needs the chain's sequence hashes and the overlaps.
        let matched = self.index.match_chain(trace.hashes(locals));
        black_box(&matched.chain);
        matched.overlaps
    }

    fn digest(answer: &Self::Answer) -> u64 {
        answer
            .iter()
            .filter(|(_, s)| **s > 0)
            .fold(0u64, |d, (w, s)| {
                d.wrapping_add(term(w.worker_id, w.dp_rank, *s))
            })
    }
    fn holders(answer: &Self::Answer) -> usize {
        answer.values().filter(|s| **s > 0).count()
    }
}

// ---------------------------------------------------------------------------------
// Dynamo: shared conversion

/// Builds Dynamo `RouterEvent`s from the stream, numbering each worker's events.
#[derive(Default)]
pub struct EventBuilder {
    next_id: HashMap<u32, u64>,
}

impl EventBuilder {
    pub fn events(&mut self, trace: &Trace, ops: Range<usize>) -> Vec<RouterEvent> {
        trace.ops[ops]
            .iter()
            // A removal the publisher's filter left empty is not sent.
            .filter(|op| !matches!(op, Op::Remove { passed, .. } if passed.len == 0))
            .map(|op| self.event(trace, op))
            .collect()
    }

    fn event(&mut self, trace: &Trace, op: &Op) -> RouterEvent {
        let (worker, data) = match *op {
            Op::Store { .. } => {
                let s = trace.store(op).expect("a store");
                (
                    s.index,
                    KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash: s.parent.map(ExternalSequenceBlockHash),
                        start_position: None,
                        blocks: s
                            .engine
                            .iter()
                            .zip(s.locals)
                            .map(|(e, l)| KvCacheStoredBlockData {
                                block_hash: ExternalSequenceBlockHash(*e),
                                tokens_hash: LocalBlockHash(*l),
                                mm_extra_info: None,
                            })
                            .collect(),
                    }),
                )
            }
            // What Dynamo's publisher passes on.
            Op::Remove { worker, passed, .. } => (
                worker,
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: trace
                        .hashes(passed)
                        .iter()
                        .map(|h| ExternalSequenceBlockHash(*h))
                        .collect(),
                }),
            ),
            Op::Clear { worker } => (worker, KvCacheEventData::Cleared),
            Op::Query { .. } => unreachable!("batches hold events only"),
        };
        let id = self.next_id.entry(worker).or_insert(0);
        *id += 1;
        let key = trace.workers[worker as usize];
        RouterEvent::new(
            key.worker_id,
            KvCacheEvent {
                event_id: *id,
                data,
                dp_rank: key.dp_rank,
            },
        )
    }
}

fn local_hashes(trace: &Trace, locals: Span) -> Vec<LocalBlockHash> {
    trace
        .hashes(locals)
        .iter()
        .map(|h| LocalBlockHash(*h))
        .collect()
}

fn digest_scores(scores: &OverlapScores) -> u64 {
    scores
        .scores
        .iter()
        .filter(|(_, s)| **s > 0)
        .fold(0u64, |d, (w, s)| {
            d.wrapping_add(term(w.worker_id, w.dp_rank, *s))
        })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread tokio runtime")
}

// ---------------------------------------------------------------------------------
// RadixTree

pub struct DynamoRadixTree {
    tree: RadixTree,
    events: EventBuilder,
}

impl DynamoRadixTree {
    pub fn new() -> Self {
        Self {
            tree: RadixTree::new(),
            events: EventBuilder::default(),
        }
    }
}

impl Contender for DynamoRadixTree {
    type Batch = Vec<RouterEvent>;
    type Query = Vec<LocalBlockHash>;
    type Answer = OverlapScores;

    fn prepare(&mut self, trace: &Trace, ops: Range<usize>) -> Self::Batch {
        self.events.events(trace, ops)
    }
    fn apply(&mut self, _trace: &Trace, batch: Self::Batch) {
        for e in batch {
            let _ = black_box(self.tree.apply_event(e));
        }
    }
    fn prepare_query(&self, trace: &Trace, locals: Span) -> Self::Query {
        local_hashes(trace, locals)
    }
    fn query(&mut self, _trace: &Trace, query: Self::Query) -> OverlapScores {
        self.tree.find_matches(query, false)
    }
    fn digest(answer: &OverlapScores) -> u64 {
        digest_scores(answer)
    }
    fn holders(answer: &OverlapScores) -> usize {
        answer.scores.values().filter(|s| **s > 0).count()
    }
}

// ---------------------------------------------------------------------------------
// PositionalIndexer, driven on this thread (its event path is public and synchronous;
// the per-worker reverse map is the caller's, as a ThreadPoolIndexer lane keeps it).

pub struct DynamoPositional {
    index: PositionalIndexer,
    worker_blocks: HashMap<WorkerWithDpRank, LevelIndex, rustc_hash::FxBuildHasher>,
    events: EventBuilder,
}

impl DynamoPositional {
    pub fn new(mode: SearchMode) -> Self {
        Self {
            index: PositionalIndexer::new_with_mode(POSITIONAL_JUMP, mode),
            worker_blocks: HashMap::default(),
            events: EventBuilder::default(),
        }
    }
}

impl Contender for DynamoPositional {
    type Batch = Vec<RouterEvent>;
    type Query = Vec<LocalBlockHash>;
    type Answer = OverlapScores;

    fn prepare(&mut self, trace: &Trace, ops: Range<usize>) -> Self::Batch {
        self.events.events(trace, ops)
    }
    fn apply(&mut self, _trace: &Trace, batch: Self::Batch) {
        for e in batch {
            let _ = black_box(self.index.apply_event(&mut self.worker_blocks, e, None));
        }
    }
    fn prepare_query(&self, trace: &Trace, locals: Span) -> Self::Query {
        local_hashes(trace, locals)
    }
    fn query(&mut self, _trace: &Trace, query: Self::Query) -> OverlapScores {
        SyncIndexer::find_matches(&self.index, &query, false)
    }
    fn digest(answer: &OverlapScores) -> u64 {
        digest_scores(answer)
    }
    fn holders(answer: &OverlapScores) -> usize {
        answer.scores.values().filter(|s| **s > 0).count()
    }
}

// ---------------------------------------------------------------------------------
// ThreadPoolIndexer<T>: events go to the pool's threads; a barrier (flush) after each
// run of events makes the next query see all of them, as the oracle requires.

pub struct DynamoThreadPool<T: SyncIndexer> {
    pool: ThreadPoolIndexer<T>,
    rt: tokio::runtime::Runtime,
    events: EventBuilder,
}

impl<T: SyncIndexer> DynamoThreadPool<T> {
    pub fn new(backend: T, threads: usize) -> Self {
        Self {
            pool: ThreadPoolIndexer::new(backend, threads, BLOCK_SIZE),
            rt: runtime(),
            events: EventBuilder::default(),
        }
    }
}

impl DynamoThreadPool<ConcurrentRadixTreeCompressed> {
    pub fn crtc(threads: usize) -> Self {
        Self::new(ConcurrentRadixTreeCompressed::new(), threads)
    }
}

impl DynamoThreadPool<PositionalIndexer> {
    pub fn positional(threads: usize) -> Self {
        Self::new(
            PositionalIndexer::new_with_mode(POSITIONAL_JUMP, SearchMode::Strided),
            threads,
        )
    }
}

impl<T: SyncIndexer> Contender for DynamoThreadPool<T> {
    type Batch = Vec<RouterEvent>;
    type Query = Vec<LocalBlockHash>;
    type Answer = OverlapScores;

    fn prepare(&mut self, trace: &Trace, ops: Range<usize>) -> Self::Batch {
        self.events.events(trace, ops)
    }
    fn apply(&mut self, _trace: &Trace, batch: Self::Batch) {
        for e in batch {
            self.pool
                .enqueue_event(e)
                .expect("the indexer's event threads are running");
        }
        self.rt
            .block_on(self.pool.flush_and_wait())
            .expect("the indexer's event threads are running");
    }
    fn prepare_query(&self, trace: &Trace, locals: Span) -> Self::Query {
        local_hashes(trace, locals)
    }
    fn query(&mut self, _trace: &Trace, query: Self::Query) -> OverlapScores {
        // What `KvIndexerInterface::find_matches` does for this wrapper, minus the future.
        self.pool.backend().find_matches(&query, false)
    }
    fn digest(answer: &OverlapScores) -> u64 {
        digest_scores(answer)
    }
    fn holders(answer: &OverlapScores) -> usize {
        answer.scores.values().filter(|s| **s > 0).count()
    }
}

impl<T: SyncIndexer> Drop for DynamoThreadPool<T> {
    fn drop(&mut self) {
        self.pool.shutdown();
    }
}

// ---------------------------------------------------------------------------------
// The async wrappers: KvIndexer and BranchShardedIndexer, through their public
// interface, each call driven to completion on a current-thread runtime.

pub struct DynamoAsync<I: KvIndexerInterface> {
    indexer: I,
    rt: tokio::runtime::Runtime,
    events: EventBuilder,
}

impl DynamoAsync<KvIndexer> {
    pub fn kv_indexer() -> Self {
        Self {
            indexer: KvIndexer::new(
                tokio_util::sync::CancellationToken::new(),
                BLOCK_SIZE,
                Arc::new(KvIndexerMetrics::new_unregistered()),
            ),
            rt: runtime(),
            events: EventBuilder::default(),
        }
    }
}

pub type BranchSharded = BranchShardedIndexer<ThreadPoolIndexer<ConcurrentRadixTreeCompressed>>;

impl DynamoAsync<BranchSharded> {
    pub fn branch_sharded(shards: usize, threads_per_shard: usize, depth: usize) -> Self {
        let shards = (0..shards)
            .map(|_| {
                ThreadPoolIndexer::new(
                    ConcurrentRadixTreeCompressed::new(),
                    threads_per_shard,
                    BLOCK_SIZE,
                )
            })
            .collect();
        Self {
            indexer: BranchShardedIndexer::new(shards, depth, BLOCK_SIZE),
            rt: runtime(),
            events: EventBuilder::default(),
        }
    }
}

impl<I: KvIndexerInterface> Contender for DynamoAsync<I> {
    type Batch = Vec<RouterEvent>;
    type Query = Vec<LocalBlockHash>;
    type Answer = OverlapScores;

    fn prepare(&mut self, trace: &Trace, ops: Range<usize>) -> Self::Batch {
        self.events.events(trace, ops)
    }
    fn apply(&mut self, _trace: &Trace, batch: Self::Batch) {
        let indexer = &self.indexer;
        self.rt.block_on(async {
            for e in batch {
                indexer.apply_event(e).await;
            }
            indexer.flush().await;
        });
    }
    fn prepare_query(&self, trace: &Trace, locals: Span) -> Self::Query {
        local_hashes(trace, locals)
    }
    fn query(&mut self, _trace: &Trace, query: Self::Query) -> OverlapScores {
        self.rt
            .block_on(self.indexer.find_matches(query))
            .expect("the indexer answers")
    }
    fn digest(answer: &OverlapScores) -> u64 {
        digest_scores(answer)
    }
    fn holders(answer: &OverlapScores) -> usize {
        answer.scores.values().filter(|s| **s > 0).count()
    }
}

impl<I: KvIndexerInterface> Drop for DynamoAsync<I> {
    fn drop(&mut self) {
        self.indexer.shutdown();
    }
}
