//! The fleet KV mirror: which blocks every worker has cached, keyed by Dynamo-compatible
//! sequence hashes so a request's block chain can be matched against every worker at once.

use kvscope_wire::hashing::{chain_hash, local_block_hashes, seed_for_lora};
use kvscope_wire::{SequenceHash, WorkerKey};
use std::collections::{BTreeMap, HashMap, HashSet};

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

#[derive(Debug, Clone, Copy)]
struct EngineBlock {
    seq: SequenceHash,
    stores: u32,
}

#[derive(Debug, Default)]
struct WorkerCache {
    /// Engine block hash → its sequence hash and how many stores named it. Engines may
    /// store the same block more than once (Dynamo's `EventDedupFilter` counts them the
    /// same way): it leaves the cache only when every store has been removed.
    by_engine: HashMap<u64, EngineBlock>,
    /// Sequence hash → how many engine blocks hold it on this worker.
    blocks: HashMap<SequenceHash, u32>,
    /// Cached blocks this worker generated while decoding (stored outside any prompt
    /// routed to it), as the analyzer marked them.
    generated: HashSet<SequenceHash>,
}

/// Every worker's cached blocks.
#[derive(Debug, Default)]
pub struct FleetIndex {
    workers: HashMap<WorkerKey, WorkerCache>,
    holders: HashMap<SequenceHash, Vec<WorkerKey>>,
}

impl FleetIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Workers the mirror has heard of (including ones whose cache is now empty).
    pub fn workers(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.workers.keys().copied()
    }

    /// Number of blocks cached on `worker`.
    pub fn cached_blocks(&self, worker: &WorkerKey) -> usize {
        self.workers.get(worker).map_or(0, |w| w.blocks.len())
    }

    /// Total (block, worker) pairs in the mirror.
    pub fn cached_pairs(&self) -> usize {
        self.workers.values().map(|w| w.blocks.len()).sum()
    }

    pub fn knows_worker(&self, worker: &WorkerKey) -> bool {
        self.workers.contains_key(worker)
    }

    /// Make sure `worker` is known, even before it stores anything.
    pub fn touch(&mut self, worker: WorkerKey) {
        self.workers.entry(worker).or_default();
    }

    /// Apply a `BlockStored` event. Returns what was stored and the event-only delta.
    #[allow(clippy::too_many_arguments)]
    pub fn store(
        &mut self,
        worker: WorkerKey,
        parent_engine_hash: Option<u64>,
        engine_hashes: &[u64],
        token_ids: &[u32],
        block_size: u32,
        lora_name: Option<&str>,
    ) -> Result<StoredSegment, MirrorError> {
        let cache = self.workers.entry(worker).or_default();
        let parent = match parent_engine_hash {
            None => None,
            Some(p) => Some(
                cache
                    .by_engine
                    .get(&p)
                    .ok_or(MirrorError::UnknownParent)?
                    .seq,
            ),
        };
        let locals = local_block_hashes(token_ids, block_size as usize, seed_for_lora(lora_name));
        let n = locals.len().min(engine_hashes.len());
        if n == 0 && !engine_hashes.is_empty() {
            return Err(MirrorError::TokenCountMismatch);
        }
        let mut blocks = Vec::with_capacity(n);
        let mut prev = parent;
        for local in &locals[..n] {
            let s = chain_hash(prev, *local);
            blocks.push(s);
            prev = Some(s);
        }
        let (held_elsewhere, held_by) = self.longest_run_elsewhere(&blocks, worker);
        let cache = self.workers.entry(worker).or_default();
        for (engine, seq) in engine_hashes[..n].iter().zip(&blocks) {
            match cache.by_engine.get_mut(engine) {
                Some(b) if b.seq == *seq => {
                    b.stores += 1;
                    continue;
                }
                Some(b) => {
                    // The engine reused a hash for other content: the old block is gone.
                    let old = b.seq;
                    *b = EngineBlock {
                        seq: *seq,
                        stores: 1,
                    };
                    release(cache, &mut self.holders, worker, old);
                }
                None => {
                    cache.by_engine.insert(
                        *engine,
                        EngineBlock {
                            seq: *seq,
                            stores: 1,
                        },
                    );
                }
            }
            let count = cache.blocks.entry(*seq).or_insert(0);
            *count += 1;
            if *count == 1 {
                self.holders.entry(*seq).or_default().push(worker);
            }
        }
        Ok(StoredSegment {
            blocks,
            held_elsewhere,
            held_by,
            token_count_mismatch: locals.len() != engine_hashes.len(),
        })
    }

    /// Apply a `BlockRemoved` event. Unknown blocks are skipped and counted in the result.
    pub fn remove(&mut self, worker: WorkerKey, engine_hashes: &[u64]) -> RemoveOutcome {
        let mut out = RemoveOutcome::default();
        let Some(cache) = self.workers.get_mut(&worker) else {
            out.unknown = engine_hashes.len() as u64;
            return out;
        };
        for engine in engine_hashes {
            match cache.by_engine.get_mut(engine) {
                Some(b) if b.stores > 1 => {
                    b.stores -= 1;
                    out.still_stored += 1;
                }
                Some(b) => {
                    let seq = b.seq;
                    cache.by_engine.remove(engine);
                    release(cache, &mut self.holders, worker, seq);
                    out.removed += 1;
                }
                None => out.unknown += 1,
            }
        }
        out
    }

    /// Apply `AllBlocksCleared` (or an engine restart): the worker's cache is empty.
    pub fn clear(&mut self, worker: WorkerKey) -> u64 {
        let Some(cache) = self.workers.get_mut(&worker) else {
            return 0;
        };
        let n = cache.blocks.len() as u64;
        for seq in cache.blocks.keys() {
            drop_holder(&mut self.holders, *seq, worker);
        }
        cache.blocks.clear();
        cache.by_engine.clear();
        cache.generated.clear();
        n
    }

    /// Mark a block cached on `worker` as decode-generated (not from a prompt).
    pub fn mark_generated(&mut self, worker: WorkerKey, seq: SequenceHash) {
        if let Some(cache) = self.workers.get_mut(&worker) {
            if cache.blocks.contains_key(&seq) {
                cache.generated.insert(seq);
            }
        }
    }

    /// How many of `blocks` are cached on `worker` as decode-generated.
    pub fn generated_among(&self, worker: &WorkerKey, blocks: &[SequenceHash]) -> u32 {
        self.workers.get(worker).map_or(0, |c| {
            blocks.iter().filter(|b| c.generated.contains(b)).count() as u32
        })
    }

    /// For every worker holding at least the first block: how many leading blocks of
    /// `chain` it holds (`overlap_w` in DESIGN.md).
    pub fn overlaps(&self, chain: &[SequenceHash]) -> BTreeMap<WorkerKey, u32> {
        let mut result = BTreeMap::new();
        let Some(first) = chain.first() else {
            return result;
        };
        let mut alive: Vec<WorkerKey> = match self.holders.get(first) {
            Some(h) => h.clone(),
            None => return result,
        };
        for (k, seq) in chain.iter().enumerate().skip(1) {
            let holders = self.holders.get(seq).map(Vec::as_slice).unwrap_or(&[]);
            alive.retain(|w| {
                let keep = holders.contains(w);
                if !keep {
                    result.insert(*w, k as u32);
                }
                keep
            });
            if alive.is_empty() {
                break;
            }
        }
        for w in alive {
            result.insert(w, chain.len() as u32);
        }
        result
    }

    /// The longest run of `chain`'s leading blocks held by one worker other than `except`.
    fn longest_run_elsewhere(
        &self,
        chain: &[SequenceHash],
        except: WorkerKey,
    ) -> (u32, Option<WorkerKey>) {
        let mut best = (0, None);
        for (w, n) in self.overlaps(chain) {
            if w != except && n > best.0 {
                best = (n, Some(w));
            }
        }
        best
    }
}

/// Result of a removal.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RemoveOutcome {
    pub removed: u64,
    /// Removals of a block stored more than once: it stays until its last store goes.
    pub still_stored: u64,
    pub unknown: u64,
}

fn release(
    cache: &mut WorkerCache,
    holders: &mut HashMap<SequenceHash, Vec<WorkerKey>>,
    worker: WorkerKey,
    seq: SequenceHash,
) {
    if let Some(count) = cache.blocks.get_mut(&seq) {
        *count -= 1;
        if *count == 0 {
            cache.blocks.remove(&seq);
            cache.generated.remove(&seq);
            drop_holder(holders, seq, worker);
        }
    }
}

fn drop_holder(
    holders: &mut HashMap<SequenceHash, Vec<WorkerKey>>,
    seq: SequenceHash,
    worker: WorkerKey,
) {
    if let Some(h) = holders.get_mut(&seq) {
        h.retain(|w| *w != worker);
        if h.is_empty() {
            holders.remove(&seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::hashing::{local_block_hashes, sequence_hashes, DYNAMO_HASH_SEED};

    fn w(id: u64) -> WorkerKey {
        WorkerKey {
            worker_id: id,
            dp_rank: 0,
        }
    }

    fn chain(tokens: &[u32], bs: usize) -> Vec<SequenceHash> {
        sequence_hashes(&local_block_hashes(tokens, bs, DYNAMO_HASH_SEED))
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
        let o = idx.overlaps(&chain(&toks, 2));
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
        assert_eq!(idx.overlaps(&chain(&toks, 2))[&w(1)], 1);
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
    fn clear_empties_one_worker_only() {
        let mut idx = FleetIndex::new();
        let toks: Vec<u32> = (0..4).collect();
        idx.store(w(1), None, &[1, 2], &toks, 2, None).unwrap();
        idx.store(w(2), None, &[1, 2], &toks, 2, None).unwrap();
        assert_eq!(idx.clear(w(1)), 2);
        let o = idx.overlaps(&chain(&toks, 2));
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
        assert_eq!(idx.overlaps(&chain(&toks, 2))[&w(1)], 1);
        idx.remove(w(1), &[2]);
        assert!(idx.overlaps(&chain(&toks, 2)).is_empty());
    }

    #[test]
    fn a_block_stored_twice_needs_two_removals() {
        let mut idx = FleetIndex::new();
        let toks: Vec<u32> = (0..2).collect();
        idx.store(w(1), None, &[1], &toks, 2, None).unwrap();
        idx.store(w(1), None, &[1], &toks, 2, None).unwrap();
        assert_eq!(idx.remove(w(1), &[1]).still_stored, 1);
        assert_eq!(idx.overlaps(&chain(&toks, 2))[&w(1)], 1);
        assert_eq!(idx.remove(w(1), &[1]).removed, 1);
        assert!(idx.overlaps(&chain(&toks, 2)).is_empty());
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
}
