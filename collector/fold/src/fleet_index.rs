//! The fleet KV mirror: which blocks every worker has cached, keyed by Dynamo-compatible
//! sequence hashes so a request's block chain can be matched against every worker at once.
//!
//! Layout, chosen so that a fleet of 1,000 workers × 50k blocks fits in a few GiB, and
//! so that following a chain the mirror already holds costs a few loads per block:
//!
//! - one record per distinct block ([`blocks`]), in a trie over local hashes: a chain
//!   growing at its end links new records to their parent without any table, and a
//!   store of a prefix another worker holds, or a routing query, follows the links with
//!   no hashing and no table probe while the chain is mirrored;
//! - each record points at the *set* of workers holding it; holder sets are interned
//!   ([`holder_sets`]): every block held by the same workers points at the same set, so
//!   a system prompt cached on 900 workers costs one 900-entry set, not 900 entries per
//!   block, and a query walking a chain compares set ids, touching members only where
//!   the set changes; a set of one worker is encoded in its id;
//! - per worker, engine block hash → record (what `BlockRemoved` names), plus two small
//!   side tables for what is rare: an engine block stored more than once, and one block
//!   held through more than one engine block.
//!
//! The tables are std's (SwissTable) maps with a one-multiply hasher: the keys are
//! hashes already.

mod blocks;
mod engine_map;
mod holder_sets;

use blocks::{BlockIdx, Blocks, ChainKey, Visited};
use engine_map::EngineMap;
use holder_sets::{HolderSets, SetId, EMPTY};
use kvscope_wire::hashing::{chain_hash, LocalBlockHash};
use kvscope_wire::{SequenceHash, WorkerKey};
use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// Why a KV event could not be applied to the mirror. Each is counted by the caller; none
/// stops the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MirrorError {
    #[error("stored blocks name a parent block the worker never stored")]
    UnknownParent,
    #[error("a store's token count does not match its block hashes and block size")]
    TokenCountMismatch,
}

/// What one `BlockStored` event did to the mirror.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoredSegment {
    /// Sequence hashes of the newly stored blocks, in chain order.
    pub blocks: Vec<SequenceHash>,
    /// How many of the segment's leading blocks the best *other* worker already held when
    /// this worker stored (and so recomputed) them: the event-only delta, in blocks.
    pub held_elsewhere: u32,
    /// That other worker, when `held_elsewhere > 0`.
    pub held_by: Option<WorkerKey>,
    /// The store had fewer full blocks of tokens than block hashes (or the reverse); the
    /// shorter of the two was applied.
    pub token_count_mismatch: bool,
}

/// Result of a removal.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RemoveOutcome {
    pub removed: u64,
    /// Removals of a block stored more than once: it stays until its last store goes.
    pub still_stored: u64,
    pub unknown: u64,
}

/// A request's chain matched against the mirror.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChainMatch {
    /// The chain's sequence hashes, one per local hash.
    pub chain: Vec<SequenceHash>,
    /// For every worker holding at least the first block: how many leading blocks of the
    /// chain it holds (`overlap_w` in ARCHITECTURE.md).
    pub overlaps: BTreeMap<WorkerKey, u32>,
}

/// Hashes the side tables' keys (block hashes, worker keys, small integers): one folded
/// multiply per word; SipHash's resistance to chosen keys buys nothing here.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
    fn write_u64(&mut self, x: u64) {
        let p = u128::from(self.0 ^ x) * u128::from(0x9e37_79b9_7f4a_7c15u64);
        self.0 = (p as u64) ^ ((p >> 64) as u64);
    }
    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
}

/// A map keyed by hashes, or by small ids, hashed with [`FoldHasher`].
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FoldHasher>>;

/// A worker's position in [`FleetIndex::workers`].
type WorkerIdx = u32;

/// Above this many records the mirror is taken to be larger than the CPU caches: its
/// table probes, and a removal's records, are then touched together first, so that their
/// cache misses overlap (below it they would not miss, and the touches cost instructions).
const COLD_RECORDS: usize = 1 << 16;

/// Most stores of a run [`FleetIndex::prefetch_stores`] loads for (the first ones): a run
/// longer than this (a replayed batch, a fill) is applied past it as before.
const PREFETCH_STORES: usize = 1024;

/// Blocks a worker stored recently, by engine hash, direct-mapped: a store's parent is
/// usually the last block stored in that conversation, and finding it here saves a probe
/// of the worker's engine-hash table, which is large and cold in a big fleet. Always a
/// subset of that table.
#[derive(Debug)]
struct RecentStores(Box<[(u64, BlockIdx); Self::SLOTS]>);

impl Default for RecentStores {
    fn default() -> Self {
        Self(Box::new([(0, Self::NONE); Self::SLOTS]))
    }
}

impl RecentStores {
    const SLOTS: usize = 64;
    const NONE: BlockIdx = BlockIdx::MAX;

    fn slot(engine: u64) -> usize {
        (engine.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58) as usize
    }

    fn get(&self, engine: u64) -> Option<BlockIdx> {
        let (e, b) = self.0[Self::slot(engine)];
        (e == engine && b != Self::NONE).then_some(b)
    }

    fn put(&mut self, engine: u64, b: BlockIdx) {
        self.0[Self::slot(engine)] = (engine, b);
    }

    fn forget(&mut self, engine: u64) {
        let slot = &mut self.0[Self::slot(engine)];
        if slot.0 == engine {
            slot.1 = Self::NONE;
        }
    }

    fn clear(&mut self) {
        self.0.fill((0, Self::NONE));
    }
}

#[derive(Debug, Default)]
struct WorkerCache {
    /// Engine block hash → the block stored under it.
    by_engine: EngineMap,
    /// The last stores of `by_engine`.
    recent: RecentStores,
    /// Engine blocks stored more than once: the stores beyond the first. Engines may store
    /// the same block more than once (Dynamo's `EventDedupFilter` counts them the same
    /// way): it leaves the cache only when every store has been removed.
    restores: FastMap<u64, u32>,
    /// Blocks held through more than one engine block: the holds beyond the first.
    extra_holds: FastMap<BlockIdx, u32>,
    /// Distinct blocks held.
    cached: usize,
    /// Cached blocks this worker generated while decoding (stored outside any prompt
    /// routed to it), as the analyzer marked them.
    generated: HashSet<SequenceHash, BuildHasherDefault<FoldHasher>>,
}

/// Every worker's cached blocks.
#[derive(Debug, Default)]
pub struct FleetIndex {
    index_of: FastMap<WorkerKey, WorkerIdx>,
    workers: Vec<WorkerCache>,
    blocks: Blocks,
    sets: HolderSets,
    /// The last worker looked up: events come in batches per worker.
    last_worker: Option<(WorkerKey, WorkerIdx)>,
    /// Scratch for removals, kept to save an allocation per event.
    released: Vec<BlockIdx>,
    /// Scratch for queries' walks, kept to save two allocations per query; in a cell, as
    /// a query only reads the mirror.
    walk_scratch: RefCell<WalkScratch>,
    /// The last store's worker and blocks, for [`Self::mark_generated`], which the
    /// analyzer calls right after a store (most records are not in the table, so a
    /// sequence hash alone does not find them).
    last_store: (WorkerIdx, Vec<BlockIdx>),
    /// Where in `last_store` the previous mark was found: marks come in chain order.
    mark_cursor: usize,
}

impl FleetIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Workers the mirror has heard of (including ones whose cache is now empty).
    pub fn workers(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        (0..self.workers.len() as WorkerIdx).map(|w| self.sets.key(w))
    }

    /// Number of blocks cached on `worker`.
    pub fn cached_blocks(&self, worker: &WorkerKey) -> usize {
        self.index_of
            .get(worker)
            .map_or(0, |w| self.workers[*w as usize].cached)
    }

    /// Total (block, worker) pairs in the mirror.
    pub fn cached_pairs(&self) -> usize {
        self.workers.iter().map(|w| w.cached).sum()
    }

    pub(crate) fn knows_worker(&self, worker: &WorkerKey) -> bool {
        self.index_of.contains_key(worker)
    }

    /// Make sure `worker` is known, even before it stores anything.
    pub fn touch(&mut self, worker: WorkerKey) {
        self.worker_idx(worker);
    }

    fn worker_idx(&mut self, worker: WorkerKey) -> WorkerIdx {
        if let Some((key, w)) = self.last_worker {
            if key == worker {
                return w;
            }
        }
        let (workers, sets) = (&mut self.workers, &mut self.sets);
        let w = *self.index_of.entry(worker).or_insert_with(|| {
            sets.add_worker(worker);
            workers.push(WorkerCache::default());
            (workers.len() - 1) as WorkerIdx
        });
        self.last_worker = Some((worker, w));
        w
    }

    fn known_worker_idx(&self, worker: &WorkerKey) -> Option<WorkerIdx> {
        match self.last_worker {
            Some((key, w)) if key == *worker => Some(w),
            _ => self.index_of.get(worker).copied(),
        }
    }

    /// The block `worker` stores under `engine_hash`, by its sequence hash: how a lower
    /// tier's store finds a parent (or a block) it names by the engine's hash.
    pub(crate) fn seq_of_engine(
        &self,
        worker: &WorkerKey,
        engine_hash: u64,
    ) -> Option<SequenceHash> {
        let w = self.known_worker_idx(worker)?;
        let cache = &self.workers[w as usize];
        let b = cache
            .recent
            .get(engine_hash)
            .or_else(|| cache.by_engine.get(engine_hash))?;
        Some(self.blocks.seq(b))
    }

    /// [`Self::store_hashed`] from a store's tokens, for tests (the analyzer reads a
    /// store's local hashes through `KvEvent::stored_local_hashes`).
    #[cfg(test)]
    pub fn store(
        &mut self,
        worker: WorkerKey,
        parent_engine_hash: Option<u64>,
        engine_hashes: &[u64],
        token_ids: &[u32],
        block_size: u32,
        lora_name: Option<&str>,
    ) -> Result<StoredSegment, MirrorError> {
        use kvscope_wire::hashing::{local_block_hashes, seed_for_lora};
        let locals = local_block_hashes(token_ids, block_size as usize, seed_for_lora(lora_name));
        self.store_hashed(worker, parent_engine_hash, engine_hashes, &locals)
    }

    /// Apply a `BlockStored` event, given its blocks' local hashes (one per full block, in
    /// order), as Dynamo's publisher hands them to its indexer. Returns what was stored
    /// and the event-only delta.
    pub fn store_hashed(
        &mut self,
        worker: WorkerKey,
        parent_engine_hash: Option<u64>,
        engine_hashes: &[u64],
        locals: &[LocalBlockHash],
    ) -> Result<StoredSegment, MirrorError> {
        let w = self.worker_idx(worker);
        let n = locals.len().min(engine_hashes.len());
        let cache = &self.workers[w as usize];
        if self.blocks.cold() {
            cache.by_engine.touch(&engine_hashes[..n]);
        }
        let parent = match parent_engine_hash {
            None => None,
            Some(p) => Some(match cache.recent.get(p) {
                Some(b) => b,
                None => cache.by_engine.get(p).ok_or(MirrorError::UnknownParent)?,
            }),
        };
        if n == 0 && !engine_hashes.is_empty() {
            return Err(MirrorError::TokenCountMismatch);
        }
        let mut blocks = Vec::with_capacity(n);
        let mut stored = std::mem::take(&mut self.last_store.1);
        stored.clear();
        // The event-only delta walks the new blocks as they were before this store; each
        // block is read just before this worker is added to it (the walk leaves this
        // worker out, so its own additions do not change what it sees).
        // (Fresh vectors: they allocate only when the store's first block is held, and
        // reusing the queries' scratch measured slower here.)
        let mut walk = Walk::new(Some(w), Vec::new());
        let mut left = Vec::new();
        let mut prev = parent.map(|p| self.blocks.found(p));
        for (engine, local) in engine_hashes[..n].iter().zip(&locals[..n]) {
            let found = self.blocks.child(prev.as_ref(), *local);
            prev = Some(found);
            let (b, holders) = (found.idx(), found.holders());
            blocks.push(found.seq());
            stored.push(b);
            if walk.active() {
                walk.step(&self.sets, holders, &mut left);
            }
            let cache = &mut self.workers[w as usize];
            match cache.by_engine.insert(*engine, b) {
                None => cache.recent.put(*engine, b),
                Some(old) if old == b => {
                    *cache.restores.entry(*engine).or_insert(0) += 1;
                    continue;
                }
                Some(old) => {
                    // The engine reused a hash for other content: the old block is gone.
                    cache.recent.put(*engine, b);
                    cache.restores.remove(engine);
                    self.release(w, old);
                }
            }
            // `old` is another block: `b`'s holders are still the ones read above.
            self.hold(w, b, holders);
        }
        walk.finish(&mut left);
        self.last_store = (w, stored);
        self.mark_cursor = 0;
        let (held_elsewhere, held_by) = self.longest_run(&left);
        self.blocks.maybe_sweep();
        Ok(StoredSegment {
            blocks,
            held_elsewhere,
            held_by,
            token_count_mismatch: locals.len() != engine_hashes.len(),
        })
    }

    /// Load, for each store of a run of events about to be applied, what it reads first:
    /// its first block's key buckets in the worker's engine-hash table and its parent's
    /// record. A decode store (one block) waits on those two misses and has nothing else
    /// to overlap them with; loaded for the whole run at once, they overlap each other.
    /// Items: (worker, parent engine hash, first engine hash). Reads only: a store whose
    /// parent comes earlier in the same run simply finds nothing to load yet.
    pub fn prefetch_stores(&self, stores: impl IntoIterator<Item = (WorkerKey, Option<u64>, u64)>) {
        if !self.blocks.cold() {
            return;
        }
        let mut acc = 0u64;
        // Three lines a store: the loads of this many stay in L2 until they are used.
        for (worker, parent, first) in stores.into_iter().take(PREFETCH_STORES) {
            let Some(w) = self.known_worker_idx(&worker) else {
                continue;
            };
            let cache = &self.workers[w as usize];
            acc ^= cache.by_engine.touch_one(first);
            if let Some(b) = parent.and_then(|p| cache.recent.get(p)) {
                acc ^= self.blocks.seq(b);
            }
        }
        std::hint::black_box(acc);
    }

    /// Apply a `BlockRemoved` event. Unknown blocks are skipped and counted in the result.
    pub fn remove(&mut self, worker: WorkerKey, engine_hashes: &[u64]) -> RemoveOutcome {
        let mut out = RemoveOutcome::default();
        let Some(w) = self.known_worker_idx(&worker) else {
            out.unknown = engine_hashes.len() as u64;
            return out;
        };
        // In two passes, the second first touching the records it will change (in a cold
        // mirror): an eviction names many blocks, and their cache misses then overlap.
        let cache = &mut self.workers[w as usize];
        if self.blocks.cold() {
            cache.by_engine.touch(engine_hashes);
        }
        let mut released = std::mem::take(&mut self.released);
        for engine in engine_hashes {
            if !cache.restores.is_empty() {
                if let Entry::Occupied(mut r) = cache.restores.entry(*engine) {
                    *r.get_mut() -= 1;
                    if *r.get() == 0 {
                        r.remove();
                    }
                    out.still_stored += 1;
                    continue;
                }
            }
            match cache.by_engine.remove(*engine) {
                Some(b) => {
                    cache.recent.forget(*engine);
                    released.push(b);
                }
                None => out.unknown += 1,
            }
        }
        if released.len() > 1 && self.blocks.cold() {
            self.blocks.touch(released.iter().copied());
        }
        for b in &released {
            self.release(w, *b);
        }
        out.removed = released.len() as u64;
        released.clear();
        self.released = released;
        self.blocks.maybe_sweep();
        out
    }

    /// Apply `AllBlocksCleared` (or an engine restart): the worker's cache is empty.
    pub fn clear(&mut self, worker: WorkerKey) -> u64 {
        let Some(w) = self.known_worker_idx(&worker) else {
            return 0;
        };
        let cache = &mut self.workers[w as usize];
        let n = cache.cached as u64;
        let mut by_engine = std::mem::take(&mut cache.by_engine);
        cache.recent.clear();
        cache.restores.clear();
        cache.extra_holds.clear();
        cache.generated.clear();
        cache.cached = 0;
        let held: Vec<BlockIdx> = by_engine.blocks().collect();
        for chunk in held.chunks(64) {
            self.blocks.touch(chunk.iter().copied());
            for b in chunk {
                // A block held through two engine blocks comes twice: the second finds
                // the worker gone from its set already.
                self.drop_holder(w, *b);
            }
        }
        by_engine.clear();
        self.workers[w as usize].by_engine = by_engine;
        self.blocks.maybe_sweep();
        n
    }

    /// Mark a block of the last store on `worker` as decode-generated (not from a
    /// prompt). Blocks not held by the worker, or not in its last store, are not marked.
    pub(crate) fn mark_generated(&mut self, worker: WorkerKey, seq: SequenceHash) {
        let Some(w) = self.known_worker_idx(&worker) else {
            return;
        };
        let (stored_by, stored) = &self.last_store;
        if *stored_by != w {
            return;
        }
        let n = stored.len();
        let found = (0..n)
            .map(|k| (self.mark_cursor + k) % n)
            .find(|k| self.blocks.seq(stored[*k]) == seq);
        let Some(k) = found else {
            return;
        };
        self.mark_cursor = k + 1;
        if self.sets.contains(self.blocks.holders(stored[k]), w) {
            self.workers[w as usize].generated.insert(seq);
        }
    }

    /// How many of `blocks` are cached on `worker` as decode-generated.
    pub(crate) fn generated_among(&self, worker: &WorkerKey, blocks: &[SequenceHash]) -> u32 {
        self.index_of.get(worker).map_or(0, |w| {
            let generated = &self.workers[*w as usize].generated;
            if generated.is_empty() {
                return 0;
            }
            blocks.iter().filter(|b| generated.contains(b)).count() as u32
        })
    }

    /// The run of decode-generated blocks `blocks` ends with on `worker` (start, end
    /// positions, end exclusive): a previous turn's reply at the end of a cached prefix.
    /// Read from the end, as long as the reply.
    pub(crate) fn generated_tail(
        &self,
        worker: &WorkerKey,
        blocks: &[SequenceHash],
    ) -> Option<(u32, u32)> {
        let generated = &self.workers[*self.index_of.get(worker)? as usize].generated;
        if generated.is_empty() {
            return None;
        }
        let n = blocks
            .iter()
            .rev()
            .take_while(|b| generated.contains(b))
            .count();
        (n > 0).then(|| ((blocks.len() - n) as u32, blocks.len() as u32))
    }

    /// A request's local hashes matched against the mirror: the chain's sequence hashes
    /// and every worker's overlap. The
    /// sequence hashes are read from the records while the chain is mirrored (found by
    /// following the trie's links), computed past its end.
    pub fn match_chain(&self, locals: &[LocalBlockHash]) -> ChainMatch {
        let mut chain = Vec::with_capacity(locals.len());
        let overlaps = self.walk_chain(locals, ChainKey::Local, Some(&mut chain));
        // Past its end: hashed.
        let mut last = chain.last().copied();
        chain.extend(locals[chain.len()..].iter().map(|local| {
            let seq = chain_hash(last, *local);
            last = Some(seq);
            seq
        }));
        ChainMatch { chain, overlaps }
    }

    /// [`Self::match_chain`] for a request known by its blocks' sequence hashes (what
    /// Dynamo's request trace and replica-sync events carry) instead of their local
    /// hashes: the same walk, each step found by the hash it names.
    pub(crate) fn match_seq_chain(&self, chain: &[SequenceHash]) -> ChainMatch {
        // The request's own hashes are the chain: the walk need not collect them.
        let overlaps = self.walk_chain(chain, ChainKey::Seq, None);
        ChainMatch {
            chain: chain.to_vec(),
            overlaps,
        }
    }

    /// The walk of both queries: along the records while the mirror holds the chain
    /// named by `keys` (hashes of kind `by`), each block's sequence hash into `chain`
    /// when given (the first block the mirror lacks too, then it stops); every worker's
    /// overlap.
    #[inline]
    fn walk_chain(
        &self,
        keys: &[u64],
        by: ChainKey,
        mut chain: Option<&mut Vec<SequenceHash>>,
    ) -> BTreeMap<WorkerKey, u32> {
        let mut scratch = self.walk_scratch.take();
        let mut walk = Walk::new(None, scratch.alive);
        let left = &mut scratch.left;
        let mut at: Option<Visited> = None;
        let mut rest = keys;
        while let Some((key, tail)) = rest.split_first() {
            rest = tail;
            match self.blocks.find(at, *key, by) {
                Ok(found) => {
                    if let Some(chain) = chain.as_deref_mut() {
                        chain.push(found.seq());
                    }
                    let active = walk.active();
                    if active {
                        walk.step(&self.sets, found.holders(), left);
                    }
                    // Then along the run laid out after it, while its holders stay
                    // the same (a change of holders is the walk's to take).
                    let same = active.then(|| found.holders());
                    let (run, last) = self.blocks.follow_run(found, rest, by, same);
                    if let Some(chain) = chain.as_deref_mut() {
                        chain.extend(run.seqs());
                    }
                    if active {
                        walk.skip(run.len() as u32);
                    }
                    rest = &rest[run.len()..];
                    at = Some(last);
                }
                Err(seq) => {
                    if let Some(chain) = chain.as_deref_mut() {
                        chain.push(seq);
                    }
                    if walk.active() {
                        walk.step(&self.sets, EMPTY, left);
                    }
                    break;
                }
            }
        }
        scratch.alive = walk.finish(left);
        let overlaps = self.overlap_map(left);
        self.walk_scratch.replace(scratch);
        overlaps
    }

    /// The overlaps of the workers a walk reported, which it takes out of `left`.
    fn overlap_map(&self, left: &mut Vec<(WorkerIdx, u32)>) -> BTreeMap<WorkerKey, u32> {
        // A handful of workers (every query in a small fleet): inserted one by one, which
        // costs less than collecting and sorting them first.
        if left.len() <= 4 {
            let mut map = BTreeMap::new();
            for (w, n) in left.drain(..) {
                map.insert(self.sets.key(w), n);
            }
            return map;
        }
        // Workers come out in runs sorted by key: sorted cheaply, then built in bulk, from
        // a vector of the right size that `from_iter` takes over as it is.
        let mut keyed = Vec::with_capacity(left.len());
        keyed.extend(left.drain(..).map(|(w, n)| (self.sets.key(w), n)));
        BTreeMap::from_iter(keyed)
    }

    /// Of the workers a walk reported, the one holding the longest run (the lowest
    /// worker key among equals), and that run.
    fn longest_run(&self, left: &[(WorkerIdx, u32)]) -> (u32, Option<WorkerKey>) {
        let mut best: (u32, Option<WorkerKey>) = (0, None);
        for (w, n) in left {
            let key = self.sets.key(*w);
            if *n > best.0 || (*n == best.0 && best.1.is_some_and(|b| key < b)) {
                best = (*n, Some(key));
            }
        }
        best
    }

    /// `w` now holds block `b`, whose holders are `from`, through one more engine block.
    fn hold(&mut self, w: WorkerIdx, b: BlockIdx, from: SetId) {
        let cache = &mut self.workers[w as usize];
        if self.sets.contains(from, w) {
            *cache.extra_holds.entry(b).or_insert(0) += 1;
            return;
        }
        let to = self.sets.with(from, w);
        self.sets.retain(to);
        if from != EMPTY {
            self.sets.release(from);
        }
        self.blocks.set_holders(b, to);
        cache.cached += 1;
    }

    /// `w` holds block `b` through one engine block fewer.
    // Inline: a removal releases its blocks in a loop, and a call's register saves and
    // restores were a quarter of a release.
    #[inline(always)]
    fn release(&mut self, w: WorkerIdx, b: BlockIdx) {
        let cache = &mut self.workers[w as usize];
        if !cache.extra_holds.is_empty() {
            if let Entry::Occupied(mut x) = cache.extra_holds.entry(b) {
                *x.get_mut() -= 1;
                if *x.get() == 0 {
                    x.remove();
                }
                return;
            }
        }
        if !self.drop_holder(w, b) {
            return;
        }
        let cache = &mut self.workers[w as usize];
        cache.cached -= 1;
        if !cache.generated.is_empty() {
            cache.generated.remove(&self.blocks.seq(b));
        }
    }

    /// Take `w` out of block `b`'s holders if it is one; whether it was.
    #[inline(always)]
    fn drop_holder(&mut self, w: WorkerIdx, b: BlockIdx) -> bool {
        let holders = self.blocks.holders_mut(b);
        let from = holders.get();
        if !self.sets.contains(from, w) {
            return false;
        }
        let to = self.sets.without(from, w);
        if let Some(to) = to {
            self.sets.retain(to);
        }
        holders.set(to.unwrap_or(EMPTY));
        self.sets.release(from);
        true
    }
}

/// The room a [`Walk`] uses, kept between walks.
#[derive(Debug, Default)]
struct WalkScratch {
    alive: Vec<WorkerIdx>,
    /// Workers the walk left behind, with the blocks each held.
    left: Vec<(WorkerIdx, u32)>,
}

/// A walk along a chain, one block at a time: which workers (but one) hold every block
/// so far. Members are compared only where a block's holder set differs from the
/// previous block's.
struct Walk {
    except: Option<WorkerIdx>,
    alive: Vec<WorkerIdx>,
    current: SetId,
    /// Blocks stepped over.
    blocks: u32,
}

impl Walk {
    /// A walk keeping its workers in `alive` (empty; its room is reused).
    fn new(except: Option<WorkerIdx>, alive: Vec<WorkerIdx>) -> Self {
        debug_assert!(alive.is_empty());
        Self {
            except,
            alive,
            current: EMPTY,
            blocks: 0,
        }
    }

    /// `n` more blocks held by the current set.
    fn skip(&mut self, n: u32) {
        self.blocks += n;
    }

    /// Whether a next block can still change anything.
    fn active(&self) -> bool {
        self.blocks == 0 || !self.alive.is_empty()
    }

    /// The next block is held by `set` (`EMPTY`: nobody): `(worker, n)` into `left` for
    /// every worker that held all `n` blocks before it but not this one.
    #[inline]
    fn step(&mut self, sets: &HolderSets, set: SetId, left: &mut Vec<(WorkerIdx, u32)>) {
        // Most blocks of a chain have the same holders as the one before.
        if self.blocks > 0 && set == self.current {
            self.blocks += 1;
            return;
        }
        self.step_to(sets, set, left);
    }

    #[inline(never)]
    fn step_to(&mut self, sets: &HolderSets, set: SetId, left: &mut Vec<(WorkerIdx, u32)>) {
        let k = self.blocks;
        self.blocks += 1;
        if set == EMPTY {
            left.extend(self.alive.drain(..).map(|w| (w, k)));
            return;
        }
        if k == 0 {
            self.current = set;
            let except = self.except;
            let members = sets.members(set);
            // Reserved: a filter's length is not known, and a large set would grow the
            // vector several times.
            self.alive.reserve(members.len());
            self.alive
                .extend(members.iter().filter(|w| Some(**w) != except));
            // Each of them ends in `left`, once: room for all, rather than growing it.
            left.reserve(self.alive.len());
            return;
        }
        // Not `current`: `step` took that case.
        self.current = set;
        let members = sets.members(set);
        if self.alive.len() * 8 < members.len() {
            self.alive.retain(|w| {
                let keep = members.binary_search_by(|m| sets.cmp(*m, *w)).is_ok();
                if !keep {
                    left.push((*w, k));
                }
                keep
            });
        } else {
            // Both sorted by worker key: one merge.
            let mut j = 0;
            self.alive.retain(|w| {
                while j < members.len() && sets.cmp(members[j], *w).is_lt() {
                    j += 1;
                }
                let keep = j < members.len() && members[j] == *w;
                if !keep {
                    left.push((*w, k));
                }
                keep
            });
        }
    }

    /// The workers that held every block stepped over, into `left`; gives back its
    /// `alive`, emptied, for the next walk.
    fn finish(mut self, left: &mut Vec<(WorkerIdx, u32)>) -> Vec<WorkerIdx> {
        let n = self.blocks;
        left.extend(self.alive.drain(..).map(|w| (w, n)));
        self.alive
    }
}

/// A deterministic generator for the mirror's randomized tests (xorshift; `seed` not
/// 0): each call gives a number below its argument.
#[cfg(test)]
pub(super) fn test_rng(seed: u64) -> impl FnMut(u64) -> u64 {
    assert_ne!(seed, 0, "xorshift stays at 0");
    let mut rng = seed;
    move |n| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::hashing::{local_block_hashes, sequence_hashes, DYNAMO_HASH_SEED};
    use std::collections::{BTreeMap, HashMap, HashSet};

    fn w(id: u64) -> WorkerKey {
        WorkerKey {
            worker_id: id,
            dp_rank: 0,
        }
    }

    /// Every worker's overlap with the chain of `tokens` (block size 2), matched by its
    /// local hashes and, the same, by its sequence hashes.
    fn overlaps(idx: &FleetIndex, tokens: &[u32]) -> BTreeMap<WorkerKey, u32> {
        let locals = local_block_hashes(tokens, 2, DYNAMO_HASH_SEED);
        let by_local = idx.match_chain(&locals);
        let by_seq = idx.match_seq_chain(&sequence_hashes(&locals));
        assert_eq!(by_local.overlaps, by_seq.overlaps, "by sequence hash");
        assert_eq!(by_local.chain, by_seq.chain);
        by_local.overlaps
    }

    #[test]
    fn overlap_is_the_longest_cached_prefix_per_worker() {
        let mut idx = FleetIndex::new();
        let toks: Vec<u32> = (0..8).collect();
        idx.store(w(1), None, &[10, 11, 12, 13], &toks, 2, None)
            .unwrap();
        idx.store(w(2), None, &[20], &toks[..2], 2, None).unwrap();
        let seg = idx
            .store(w(2), Some(20), &[21], &toks[2..4], 2, None)
            .unwrap();
        assert_eq!(seg.held_elsewhere, 1, "block 2 was on worker 1 already");
        assert_eq!(seg.held_by, Some(w(1)));
        let o = overlaps(&idx, &toks);
        assert_eq!(o[&w(1)], 4);
        assert_eq!(o[&w(2)], 2);
    }

    #[test]
    fn removal_cuts_the_overlap_and_unknown_removals_are_counted() {
        let mut idx = FleetIndex::new();
        let toks: Vec<u32> = (0..6).collect();
        idx.store(w(1), None, &[1, 2, 3], &toks, 2, None).unwrap();
        let out = idx.remove(w(1), &[2, 99]);
        assert_eq!(
            out,
            RemoveOutcome {
                removed: 1,
                still_stored: 0,
                unknown: 1
            }
        );
        assert_eq!(overlaps(&idx, &toks)[&w(1)], 1);
        assert_eq!(idx.remove(w(7), &[1]).unknown, 1);
    }

    #[test]
    fn unknown_parent_is_an_error_and_changes_nothing() {
        let mut idx = FleetIndex::new();
        let err = idx
            .store(w(1), Some(5), &[1], &[1, 2], 2, None)
            .unwrap_err();
        assert_eq!(err, MirrorError::UnknownParent);
        assert_eq!(idx.cached_pairs(), 0);
    }

    #[test]
    fn a_chain_stored_after_a_sweep_takes_consecutive_records() {
        // Consecutive records are what lets a walk along the chain read the next one
        // before its link (`Blocks::linked_child`).
        let mut idx = FleetIndex::new();
        // Two chains whose records interleave (one grew after the other was stored),
        // evicted and swept: the sweep frees them in no useful order.
        let a: Vec<u32> = (0..16).collect();
        let b: Vec<u32> = (200..208).collect();
        idx.store(w(1), None, &[1, 2, 3, 4], &a[..8], 2, None)
            .unwrap();
        idx.store(w(1), None, &[11, 12, 13, 14], &b, 2, None)
            .unwrap();
        idx.store(w(1), Some(4), &[5, 6, 7, 8], &a[8..], 2, None)
            .unwrap();
        idx.remove(w(1), &[1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14]);
        assert_eq!(idx.blocks.live(), 0, "the evicted chains were swept");
        let second: Vec<u32> = (100..112).collect();
        idx.store(w(1), None, &[21, 22, 23, 24, 25, 26], &second, 2, None)
            .unwrap();
        let records = idx
            .blocks
            .chain_records(&local_block_hashes(&second, 2, DYNAMO_HASH_SEED));
        assert_eq!(records.len(), 6);
        assert!(
            records.windows(2).all(|p| p[1] == p[0] + 1),
            "records {records:?}"
        );
    }

    #[test]
    fn clear_empties_one_worker_only() {
        let mut idx = FleetIndex::new();
        let toks: Vec<u32> = (0..4).collect();
        idx.store(w(1), None, &[1, 2], &toks, 2, None).unwrap();
        idx.store(w(2), None, &[1, 2], &toks, 2, None).unwrap();
        assert_eq!(idx.clear(w(1)), 2);
        let o = overlaps(&idx, &toks);
        assert!(!o.contains_key(&w(1)));
        assert_eq!(o[&w(2)], 2);
    }

    #[test]
    fn the_same_chain_under_two_engine_hashes_needs_two_removals() {
        let mut idx = FleetIndex::new();
        let toks: Vec<u32> = (0..2).collect();
        idx.store(w(1), None, &[1], &toks, 2, None).unwrap();
        idx.store(w(1), None, &[2], &toks, 2, None).unwrap();
        idx.remove(w(1), &[1]);
        assert_eq!(overlaps(&idx, &toks)[&w(1)], 1);
        idx.remove(w(1), &[2]);
        assert!(overlaps(&idx, &toks).is_empty());
    }

    #[test]
    fn a_block_stored_twice_needs_two_removals() {
        let mut idx = FleetIndex::new();
        let toks: Vec<u32> = (0..2).collect();
        idx.store(w(1), None, &[1], &toks, 2, None).unwrap();
        idx.store(w(1), None, &[1], &toks, 2, None).unwrap();
        assert_eq!(idx.remove(w(1), &[1]).still_stored, 1);
        assert_eq!(overlaps(&idx, &toks)[&w(1)], 1);
        assert_eq!(idx.remove(w(1), &[1]).removed, 1);
        assert!(overlaps(&idx, &toks).is_empty());
    }

    #[test]
    fn partial_blocks_and_short_token_lists_are_flagged() {
        let mut idx = FleetIndex::new();
        let seg = idx.store(w(1), None, &[1, 2], &[1, 2, 3], 2, None).unwrap();
        assert!(seg.token_count_mismatch);
        assert_eq!(seg.blocks.len(), 1);
        assert_eq!(
            idx.store(w(1), None, &[3], &[1], 2, None).unwrap_err(),
            MirrorError::TokenCountMismatch
        );
    }

    /// The old, plain layout (per worker: engine hash → (sequence hash, stores), sequence
    /// hash → holds), answering every question by brute force.
    #[derive(Default)]
    struct Model {
        workers: BTreeMap<WorkerKey, ModelWorker>,
    }

    #[derive(Default)]
    struct ModelWorker {
        by_engine: HashMap<u64, (SequenceHash, u32)>,
        blocks: HashMap<SequenceHash, u32>,
        generated: HashSet<SequenceHash>,
    }

    impl Model {
        fn store(
            &mut self,
            worker: WorkerKey,
            parent: Option<u64>,
            engine: &[u64],
            locals: &[u64],
        ) -> Result<StoredSegment, MirrorError> {
            let c = self.workers.entry(worker).or_default();
            let parent = match parent {
                None => None,
                Some(p) => Some(c.by_engine.get(&p).ok_or(MirrorError::UnknownParent)?.0),
            };
            let n = locals.len().min(engine.len());
            if n == 0 && !engine.is_empty() {
                return Err(MirrorError::TokenCountMismatch);
            }
            let mut blocks = Vec::new();
            let mut prev = parent;
            for l in &locals[..n] {
                let s = chain_hash(prev, *l);
                blocks.push(s);
                prev = Some(s);
            }
            let mut best = (0, None);
            for (w, k) in self.overlaps(&blocks) {
                if w != worker && k > best.0 {
                    best = (k, Some(w));
                }
            }
            let c = self.workers.get_mut(&worker).unwrap();
            for (e, s) in engine[..n].iter().zip(&blocks) {
                match c.by_engine.get_mut(e) {
                    Some(b) if b.0 == *s => {
                        b.1 += 1;
                        continue;
                    }
                    Some(b) => {
                        let old = b.0;
                        *b = (*s, 1);
                        Self::release(c, old);
                    }
                    None => {
                        c.by_engine.insert(*e, (*s, 1));
                    }
                }
                *c.blocks.entry(*s).or_insert(0) += 1;
            }
            Ok(StoredSegment {
                blocks,
                held_elsewhere: best.0,
                held_by: best.1,
                token_count_mismatch: locals.len() != engine.len(),
            })
        }

        fn release(c: &mut ModelWorker, s: SequenceHash) {
            if let Some(n) = c.blocks.get_mut(&s) {
                *n -= 1;
                if *n == 0 {
                    c.blocks.remove(&s);
                    c.generated.remove(&s);
                }
            }
        }

        fn remove(&mut self, worker: WorkerKey, engine: &[u64]) -> RemoveOutcome {
            let mut out = RemoveOutcome::default();
            let Some(c) = self.workers.get_mut(&worker) else {
                out.unknown = engine.len() as u64;
                return out;
            };
            for e in engine {
                match c.by_engine.get_mut(e) {
                    Some(b) if b.1 > 1 => {
                        b.1 -= 1;
                        out.still_stored += 1;
                    }
                    Some(b) => {
                        let s = b.0;
                        c.by_engine.remove(e);
                        Self::release(c, s);
                        out.removed += 1;
                    }
                    None => out.unknown += 1,
                }
            }
            out
        }

        fn clear(&mut self, worker: WorkerKey) -> u64 {
            self.workers.get_mut(&worker).map_or(0, |c| {
                let n = c.blocks.len() as u64;
                *c = ModelWorker::default();
                n
            })
        }

        fn overlaps(&self, chain: &[SequenceHash]) -> BTreeMap<WorkerKey, u32> {
            self.workers
                .iter()
                .filter_map(|(w, c)| {
                    let k = chain
                        .iter()
                        .take_while(|s| c.blocks.contains_key(s))
                        .count();
                    (k > 0).then_some((*w, k as u32))
                })
                .collect()
        }
    }

    #[test]
    fn answers_what_the_plain_layout_answers_through_random_events() {
        // Several streams: the trie's links, branches and sweeps take different paths
        // in each.
        for seed in [0x2545_f491_4f6c_dd1du64, 7, 0x9e37_79b9, 12345] {
            random_events_against_the_model(seed);
        }
    }

    fn random_events_against_the_model(seed: u64) {
        let mut next = test_rng(seed);
        let mut idx = FleetIndex::new();
        let mut model = Model::default();
        let key = |i: u64| WorkerKey {
            worker_id: 100 - i % 4,
            dp_rank: (i / 4) as u32,
        };
        // Few local hashes and engine hashes, so that chains meet, engines reuse hashes
        // for other content, blocks are stored twice and parents go missing.
        for step in 0..40_000 {
            let worker = key(next(6));
            match next(10) {
                0..=4 => {
                    let n = 1 + next(4) as usize;
                    let engine: Vec<u64> = (0..n).map(|_| next(24)).collect();
                    let locals: Vec<u64> = (0..n + next(2) as usize).map(|_| next(3)).collect();
                    let parent = (next(3) > 0).then(|| next(24));
                    // What a batch loads first, for this store and one of a worker that
                    // may be unknown, with a parent that may be missing: it only reads.
                    idx.prefetch_stores([
                        (worker, parent, engine[0]),
                        (key(next(8)), Some(next(24)), next(24)),
                    ]);
                    let a = idx.store_hashed(worker, parent, &engine, &locals);
                    let b = model.store(worker, parent, &engine, &locals);
                    assert_eq!(a, b, "store at step {step}");
                    if let Ok(seg) = a {
                        for s in seg.blocks.iter().filter(|_| next(2) == 0) {
                            idx.mark_generated(worker, *s);
                            if model.workers[&worker].blocks.contains_key(s) {
                                model.workers.get_mut(&worker).unwrap().generated.insert(*s);
                            }
                        }
                    }
                }
                5..=7 => {
                    let engine: Vec<u64> = (0..1 + next(3)).map(|_| next(24)).collect();
                    assert_eq!(
                        idx.remove(worker, &engine),
                        model.remove(worker, &engine),
                        "remove at step {step}"
                    );
                }
                8 if next(20) == 0 => {
                    assert_eq!(
                        idx.clear(worker),
                        model.clear(worker),
                        "clear at step {step}"
                    );
                }
                _ => {
                    let locals: Vec<u64> = (0..1 + next(5)).map(|_| next(3)).collect();
                    let chain = sequence_hashes(&locals);
                    let want = model.overlaps(&chain);
                    let matched = idx.match_chain(&locals);
                    let by_seq = idx.match_seq_chain(&chain);
                    assert_eq!(by_seq.overlaps, want, "by sequence hash, step {step}");
                    assert_eq!(
                        (matched.chain, matched.overlaps),
                        (chain.clone(), want),
                        "step {step}"
                    );
                    for (w, c) in &model.workers {
                        let want = chain.iter().filter(|s| c.generated.contains(s)).count();
                        assert_eq!(idx.generated_among(w, &chain), want as u32);
                    }
                }
            }
            for (w, c) in &model.workers {
                assert_eq!(idx.cached_blocks(w), c.blocks.len(), "step {step}");
            }
        }
        assert!(idx.cached_pairs() > 0);
        // Unheld records were swept as the test went: what is live is about what is held.
        let held: usize = model.workers.values().map(|c| c.blocks.len()).sum();
        assert!(
            idx.blocks.live() <= 2 * held + 8,
            "{} records for {held} pairs",
            idx.blocks.live()
        );
        let mut known: Vec<_> = idx.workers().collect();
        known.sort();
        assert_eq!(known, model.workers.keys().copied().collect::<Vec<_>>());
    }
}
