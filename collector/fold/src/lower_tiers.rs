//! The tiers below the device cache: which blocks each worker holds in host memory and
//! on disk, from the KV events whose `medium` names those tiers. The device mirror
//! ([`FleetIndex`]) is what the router scores first and what every overlap is; this one
//! answers how far a worker's match extends through its lower tiers past its device
//! overlap, as Dynamo's router extends it (ARCHITECTURE.md, "KV tiers"): blocks an
//! engine onloads instead of recomputing.
//!
//! Blocks are keyed by sequence hash, as in the device mirror, so a block offloaded by
//! one worker and a request's chain are compared on the same identity. A store names its
//! parent by the engine's hash; the parent is found in the same tier, another lower
//! tier, or the device mirror (an engine offloads a block its device cache still holds).

use crate::fleet_index::{FastMap, FleetIndex, MirrorError};
use kvscope_wire::hashing::{chain_hash, LocalBlockHash};
use kvscope_wire::{SequenceHash, Tier, WorkerKey};

/// One worker's blocks in one lower tier.
#[derive(Debug, Default)]
struct TierCache {
    /// Engine hash → the block stored under it, and how many times it was stored (an
    /// engine may store a block again; it leaves when every store is removed, as
    /// Dynamo's dedup filter counts them).
    by_engine: FastMap<u64, (SequenceHash, u32)>,
    /// Blocks held, with the number of engine hashes holding each.
    held: FastMap<SequenceHash, u32>,
}

impl TierCache {
    fn hold(&mut self, engine: u64, seq: SequenceHash) {
        match self.by_engine.get_mut(&engine) {
            Some((old, n)) if *old == seq => *n += 1,
            Some((old, n)) => {
                // The engine reused a hash for other content: the old block is gone.
                let old = std::mem::replace(old, seq);
                *n = 1;
                self.release(old);
                *self.held.entry(seq).or_insert(0) += 1;
            }
            None => {
                self.by_engine.insert(engine, (seq, 1));
                *self.held.entry(seq).or_insert(0) += 1;
            }
        }
    }

    fn release(&mut self, seq: SequenceHash) {
        if let Some(n) = self.held.get_mut(&seq) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&seq);
            }
        }
    }
}

/// What a lower-tier event did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TierOutcome {
    pub stored: u64,
    pub removed: u64,
    /// Removed hashes the tier did not hold.
    pub unknown: u64,
}

/// Every worker's lower tiers.
#[derive(Debug, Default)]
pub struct LowerTiers {
    caches: FastMap<(Tier, WorkerKey), TierCache>,
    /// (block, worker, tier) triples held, over every cache: a verdict on a fleet with no
    /// lower tier asks nothing more than this.
    held: usize,
}

impl LowerTiers {
    /// Apply a lower tier's `BlockStored`: `locals` are its blocks' local hashes (one per
    /// block, in order), as for the device mirror. A store without them (a publisher
    /// that sends only the engine's hashes of an offload) names blocks the device cache
    /// holds under the same hashes; those are found there, the rest counted as unknown.
    pub fn store(
        &mut self,
        tier: Tier,
        worker: WorkerKey,
        parent_engine_hash: Option<u64>,
        engine_hashes: &[u64],
        locals: &[LocalBlockHash],
        device: &FleetIndex,
    ) -> Result<TierOutcome, MirrorError> {
        let before = self.held_by(tier, worker);
        let out = self.store_blocks(
            tier,
            worker,
            parent_engine_hash,
            engine_hashes,
            locals,
            device,
        );
        self.held = self.held + self.held_by(tier, worker) - before;
        out
    }

    fn store_blocks(
        &mut self,
        tier: Tier,
        worker: WorkerKey,
        parent_engine_hash: Option<u64>,
        engine_hashes: &[u64],
        locals: &[LocalBlockHash],
        device: &FleetIndex,
    ) -> Result<TierOutcome, MirrorError> {
        let mut out = TierOutcome::default();
        if locals.is_empty() {
            for engine in engine_hashes {
                let Some(seq) = self.seq_of_engine(worker, *engine, device) else {
                    out.unknown += 1;
                    continue;
                };
                self.cache(tier, worker).hold(*engine, seq);
                out.stored += 1;
            }
            return Ok(out);
        }
        let mut prev = match parent_engine_hash {
            None => None,
            Some(p) => Some(
                self.seq_of_engine(worker, p, device)
                    .ok_or(MirrorError::UnknownParent)?,
            ),
        };
        let cache = self.cache(tier, worker);
        for (engine, local) in engine_hashes.iter().zip(locals) {
            let seq = chain_hash(prev, *local);
            cache.hold(*engine, seq);
            prev = Some(seq);
            out.stored += 1;
        }
        Ok(out)
    }

    /// Apply a lower tier's `BlockRemoved`.
    pub fn remove(&mut self, tier: Tier, worker: WorkerKey, engine_hashes: &[u64]) -> TierOutcome {
        let mut out = TierOutcome::default();
        let Some(cache) = self.caches.get_mut(&(tier, worker)) else {
            out.unknown = engine_hashes.len() as u64;
            return out;
        };
        let before = cache.held.len();
        for engine in engine_hashes {
            let Some((seq, n)) = cache.by_engine.get_mut(engine) else {
                out.unknown += 1;
                continue;
            };
            *n -= 1;
            if *n == 0 {
                let seq = *seq;
                cache.by_engine.remove(engine);
                cache.release(seq);
                out.removed += 1;
            }
        }
        self.held = self.held + cache.held.len() - before;
        out
    }

    /// Blocks `worker` holds in `tier`.
    fn held_by(&self, tier: Tier, worker: WorkerKey) -> usize {
        self.caches.get(&(tier, worker)).map_or(0, |c| c.held.len())
    }

    /// Forget every lower tier of `worker` (its engine restarted: host memory and a
    /// local disk cache go with the process). Returns the blocks dropped.
    pub fn clear(&mut self, worker: WorkerKey) -> u64 {
        let mut n = 0;
        for tier in Tier::LOWER {
            if let Some(c) = self.caches.remove(&(tier, worker)) {
                self.held -= c.held.len();
                n += c.held.len() as u64;
            }
        }
        n
    }

    /// How many blocks of `chain` from position `from` on `worker` holds in `tier`, one
    /// after another (`from` is where its match through the faster tiers ended).
    pub fn extension(
        &self,
        tier: Tier,
        worker: &WorkerKey,
        chain: &[SequenceHash],
        from: usize,
    ) -> u32 {
        let Some(cache) = self.caches.get(&(tier, *worker)) else {
            return 0;
        };
        chain
            .get(from..)
            .unwrap_or_default()
            .iter()
            .take_while(|seq| cache.held.contains_key(seq))
            .count() as u32
    }

    /// Whether any worker holds anything in a lower tier (most fleets: none).
    pub fn is_empty(&self) -> bool {
        self.held == 0
    }

    fn cache(&mut self, tier: Tier, worker: WorkerKey) -> &mut TierCache {
        self.caches.entry((tier, worker)).or_default()
    }

    /// The block `worker` holds under `engine` in any tier, device first.
    fn seq_of_engine(
        &self,
        worker: WorkerKey,
        engine: u64,
        device: &FleetIndex,
    ) -> Option<SequenceHash> {
        device.seq_of_engine(&worker, engine).or_else(|| {
            Tier::LOWER.iter().find_map(|t| {
                self.caches
                    .get(&(*t, worker))
                    .and_then(|c| c.by_engine.get(&engine))
                    .map(|(seq, _)| *seq)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::w;
    use kvscope_wire::hashing::{local_block_hashes, sequence_hashes};

    #[test]
    fn an_offloaded_chain_extends_a_match_past_the_device_overlap() {
        let toks: Vec<u32> = (0..64).collect();
        let locals = local_block_hashes(&toks, 16, 0);
        let chain = sequence_hashes(&locals);
        let mut device = FleetIndex::new();
        device
            .store_hashed(w(1), None, &[10, 11, 12, 13], &locals)
            .unwrap();
        let mut tiers = LowerTiers::default();
        // The whole chain offloaded to the host, then the device evicts its last two.
        tiers
            .store(Tier::Host, w(1), None, &[10, 11, 12, 13], &locals, &device)
            .unwrap();
        device.remove(w(1), &[12, 13]);
        assert_eq!(tiers.extension(Tier::Host, &w(1), &chain, 2), 2);
        assert_eq!(tiers.extension(Tier::Host, &w(1), &chain, 4), 0);
        assert_eq!(tiers.extension(Tier::Disk, &w(1), &chain, 2), 0);
        assert_eq!(tiers.extension(Tier::Host, &w(2), &chain, 0), 0);
        // A store that names its parent by the engine's hash, found on the device.
        let mut tiers = LowerTiers::default();
        tiers
            .store(Tier::Disk, w(1), Some(11), &[12, 13], &locals[2..], &device)
            .unwrap();
        assert_eq!(tiers.extension(Tier::Disk, &w(1), &chain, 2), 2);
        // A parent nobody holds is refused, not guessed.
        assert_eq!(
            tiers.store(Tier::Disk, w(1), Some(99), &[14], &locals[..1], &device),
            Err(MirrorError::UnknownParent)
        );
    }

    #[test]
    fn a_block_stored_twice_leaves_with_its_last_removal_and_a_restart_clears_it() {
        let toks: Vec<u32> = (0..32).collect();
        let locals = local_block_hashes(&toks, 16, 0);
        let chain = sequence_hashes(&locals);
        let device = FleetIndex::new();
        let mut tiers = LowerTiers::default();
        for _ in 0..2 {
            tiers
                .store(Tier::Host, w(1), None, &[1, 2], &locals, &device)
                .unwrap();
        }
        assert_eq!(tiers.remove(Tier::Host, w(1), &[1]).removed, 0);
        assert_eq!(tiers.extension(Tier::Host, &w(1), &chain, 0), 2);
        assert_eq!(
            tiers.remove(Tier::Host, w(1), &[1, 7]),
            TierOutcome {
                stored: 0,
                removed: 1,
                unknown: 1
            }
        );
        assert_eq!(tiers.extension(Tier::Host, &w(1), &chain, 0), 0);
        assert_eq!(tiers.extension(Tier::Host, &w(1), &chain, 1), 1);
        assert_eq!(tiers.clear(w(1)), 1);
        assert!(tiers.is_empty());
    }

    #[test]
    fn a_store_of_hashes_alone_finds_its_blocks_on_the_device() {
        let toks: Vec<u32> = (0..32).collect();
        let locals = local_block_hashes(&toks, 16, 0);
        let chain = sequence_hashes(&locals);
        let mut device = FleetIndex::new();
        device.store_hashed(w(1), None, &[1, 2], &locals).unwrap();
        let mut tiers = LowerTiers::default();
        let out = tiers
            .store(Tier::Host, w(1), None, &[1, 2, 3], &[], &device)
            .unwrap();
        assert_eq!((out.stored, out.unknown), (2, 1));
        assert_eq!(tiers.extension(Tier::Host, &w(1), &chain, 0), 2);
    }
}
