//! A worker's table from engine block hash to the mirror's record: the one lookup every
//! stored and every removed block needs, so the one most worth making cheap.
//!
//! Buckets of one cache line (five entries), two candidate buckets per key: a key lives
//! in its first bucket unless that was full when it came, and each bucket counts the
//! keys of its own that live in their second one. A lookup reads one line, and a second
//! only when that count says a key of this bucket may be there; a removal frees its slot
//! in place; when both of a new key's buckets are full, keys move to their other bucket
//! along a short walk to make room. In a fleet whose tables are far larger than the CPU
//! caches, that is one cache miss per stored or removed block where std's SwissTable
//! takes two (a control group, then the bucket).

use super::blocks::BlockIdx;

/// Entries in a bucket: as many as fit in 64 bytes with their blocks and two counts.
const SLOTS: usize = 5;

/// Buckets a cuckoo walk passes through at most to make room ([`EngineMap::make_room`]).
const MAX_WALK: usize = 16;

/// One cache line: five keys, their blocks, how many are used, and how many keys whose
/// first bucket this is live in their second.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Bucket {
    engines: [u64; SLOTS],
    blocks: [BlockIdx; SLOTS],
    len: u8,
    spilled: u8,
}

const EMPTY_BUCKET: Bucket = Bucket {
    engines: [0; SLOTS],
    blocks: [0; SLOTS],
    len: 0,
    spilled: 0,
};

impl Bucket {
    /// The slot holding `engine`. Every slot is compared and the used ones kept by a
    /// mask, without a branch per slot: where a key sits in its bucket is random, and
    /// a loop that stops at it mispredicts about once per lookup.
    #[inline(always)]
    fn position(&self, engine: u64) -> Option<usize> {
        let hits = self
            .engines
            .iter()
            .enumerate()
            .fold(0u32, |m, (i, e)| m | (u32::from(*e == engine) << i));
        let hits = hits & ((1 << self.len) - 1);
        (hits != 0).then(|| hits.trailing_zeros() as usize)
    }

    #[inline(always)]
    fn push(&mut self, engine: u64, block: BlockIdx) {
        let i = self.len as usize;
        self.engines[i] = engine;
        self.blocks[i] = block;
        self.len += 1;
    }

    /// Remove slot `i`, moving the last slot into it.
    #[inline(always)]
    fn take(&mut self, i: usize) -> BlockIdx {
        let block = self.blocks[i];
        let last = self.len as usize - 1;
        self.engines[i] = self.engines[last];
        self.blocks[i] = self.blocks[last];
        self.len -= 1;
        block
    }
}

#[derive(Debug, Default)]
pub(super) struct EngineMap {
    /// A power of two long (or empty).
    buckets: Vec<Bucket>,
    len: usize,
}

impl EngineMap {
    /// Entries.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The key's two buckets (distinct when there are two or more buckets). Engine hashes
    /// are usually well mixed already, but tests and some engines number blocks: a
    /// multiply spreads sequential keys.
    #[inline(always)]
    fn homes(&self, engine: u64) -> (usize, usize) {
        let mask = self.buckets.len() - 1;
        let h = engine.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let first = (h >> 40) as usize & mask;
        let second = (h >> 16) as usize & mask;
        let second = if second == first { first ^ 1 } else { second } & mask;
        (first, second)
    }

    /// Where `engine` lives: its bucket, the slot, and whether it is its second bucket.
    #[inline(always)]
    fn find(&self, engine: u64) -> Option<(usize, usize, bool)> {
        if self.buckets.is_empty() {
            return None;
        }
        let (first, second) = self.homes(engine);
        self.find_in(engine, first, second)
    }

    /// [`Self::find`] with the key's buckets known.
    #[inline(always)]
    fn find_in(&self, engine: u64, first: usize, second: usize) -> Option<(usize, usize, bool)> {
        let b = &self.buckets[first];
        if let Some(i) = b.position(engine) {
            return Some((first, i, false));
        }
        if b.spilled == 0 {
            return None;
        }
        self.buckets[second]
            .position(engine)
            .map(|i| (second, i, true))
    }

    #[inline]
    pub(super) fn get(&self, engine: u64) -> Option<BlockIdx> {
        self.find(engine).map(|(b, i, _)| self.buckets[b].blocks[i])
    }

    /// Map `engine` to `block`; returns the block it mapped to before, if any.
    #[inline]
    pub(super) fn insert(&mut self, engine: u64, block: BlockIdx) -> Option<BlockIdx> {
        // At most 3/4 full. The walk finds room for a key up to 4/5 and beyond, but a
        // table held at its limit by churn (a small worker whose cache is always full)
        // then walks on many stores: at 4/5, kvscope ran 25% slower on the lab recording.
        if (self.len + 1) * 4 > self.buckets.len() * SLOTS * 3 {
            self.grow();
        }
        // The key's buckets, found once for both the search and the placing (and again
        // only if the table grows, which moves them).
        let mut homes = self.homes(engine);
        if let Some((b, i, _)) = self.find_in(engine, homes.0, homes.1) {
            return Some(std::mem::replace(&mut self.buckets[b].blocks[i], block));
        }
        while !self.place(engine, block, homes) {
            self.grow();
            homes = self.homes(engine);
        }
        self.len += 1;
        None
    }

    /// Put a new key in its first bucket, or its second (its [`Self::homes`]); when both
    /// are full, first make room in its first bucket by moving keys along a cuckoo walk.
    /// False when that fails too.
    #[inline(always)]
    fn place(&mut self, engine: u64, block: BlockIdx, (first, second): (usize, usize)) -> bool {
        if (self.buckets[first].len as usize) < SLOTS {
            self.buckets[first].push(engine, block);
            return true;
        }
        if (self.buckets[second].len as usize) < SLOTS && self.buckets[first].spilled < u8::MAX {
            self.buckets[second].push(engine, block);
            self.buckets[first].spilled += 1;
            return true;
        }
        if self.make_room(first) {
            self.buckets[first].push(engine, block);
            return true;
        }
        false
    }

    /// The bucket `engine`, now in bucket `at`, would move to: its other one. `None` when
    /// that would take it to its second bucket and its first one's count of keys living
    /// in their second is at its limit.
    #[inline]
    fn other_home(&self, engine: u64, at: usize) -> Option<usize> {
        let (first, second) = self.homes(engine);
        if at != first {
            return Some(first);
        }
        (self.buckets[first].spilled < u8::MAX).then_some(second)
    }

    /// Make room in full bucket `b` by moving one of its keys to its other bucket. When
    /// every key's other bucket is full too, the walk goes on from one of those (chosen
    /// at random, so that walks do not repeat each other), up to [`MAX_WALK`] buckets
    /// deep: a cuckoo walk. It moves nothing until it has found room, then shifts the
    /// keys along it from the end, so each move goes into a bucket with a free slot.
    /// False when no room was found (nothing moved).
    ///
    /// With only a one-step move, a table 60% full already met keys whose both buckets
    /// and every neighbour were full, and doubled: at 1,000 workers × 50k blocks more
    /// than half the tables had doubled early, and the mirror's heap was 0.5 GiB larger.
    #[cold]
    fn make_room(&mut self, b: usize) -> bool {
        // (bucket, key to move out of it, where to): the walk so far.
        let mut walk = [(0usize, 0u64, 0usize); MAX_WALK];
        let mut random = (b as u64 ^ self.len as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut at = b;
        for depth in 0..MAX_WALK {
            // Candidates to walk on with: one picked at random among them.
            let mut next = None;
            let mut candidates = 0u64;
            for i in 0..SLOTS {
                let engine = self.buckets[at].engines[i];
                let Some(to) = self.other_home(engine, at) else {
                    continue;
                };
                // A key already on the walk would be moved twice.
                if walk[..depth].iter().any(|&(_, e, _)| e == engine) {
                    continue;
                }
                if (self.buckets[to].len as usize) < SLOTS {
                    walk[depth] = (at, engine, to);
                    self.shift_along(&walk[..=depth]);
                    return true;
                }
                candidates += 1;
                random ^= random << 13;
                random ^= random >> 7;
                random ^= random << 17;
                if random.is_multiple_of(candidates) {
                    next = Some((engine, to));
                }
            }
            let Some((engine, to)) = next else {
                return false;
            };
            walk[depth] = (at, engine, to);
            at = to;
        }
        false
    }

    /// Carry out a walk [`Self::make_room`] found, from its end: each key moves into the
    /// slot the move after it freed (the last into free room).
    fn shift_along(&mut self, walk: &[(usize, u64, usize)]) {
        for &(from, engine, to) in walk.iter().rev() {
            let i = self.buckets[from]
                .position(engine)
                .expect("a key on the walk is where the walk found it: each is moved once");
            let block = self.buckets[from].take(i);
            self.buckets[to].push(engine, block);
            // Moved to its second bucket, or back to its first.
            let (first, _) = self.homes(engine);
            if from == first {
                self.buckets[first].spilled += 1;
            } else {
                self.buckets[first].spilled -= 1;
            }
        }
    }

    /// Unmap `engine`; returns the block it mapped to, if any.
    #[inline]
    pub(super) fn remove(&mut self, engine: u64) -> Option<BlockIdx> {
        let (b, i, spilled) = self.find(engine)?;
        if spilled {
            let (first, _) = self.homes(engine);
            self.buckets[first].spilled -= 1;
        }
        self.len -= 1;
        Some(self.buckets[b].take(i))
    }

    /// Every mapped block (a block mapped from two engine hashes comes twice).
    pub(super) fn blocks(&self) -> impl Iterator<Item = BlockIdx> + '_ {
        self.buckets
            .iter()
            .flat_map(|b| b.blocks[..b.len as usize].iter().copied())
    }

    /// Empty, keeping the allocation (a worker that restarts fills it again).
    pub(super) fn clear(&mut self) {
        self.buckets.fill(EMPTY_BUCKET);
        self.len = 0;
    }

    /// Load both buckets of every key in `engines`, so that their cache misses overlap
    /// before the batch is applied one key at a time. Both: a key whose first bucket
    /// has spilled is looked for in its second, and a new one whose first is full is
    /// placed there; loading only the first left those a miss each, one after the
    /// other (a third of the store path's samples on the synthetic fleet, 2026-12-07).
    #[inline]
    pub(super) fn touch(&self, engines: &[u64]) {
        std::hint::black_box(engines.iter().fold(0, |acc, e| acc ^ self.touch_one(*e)));
    }

    /// [`Self::touch`] for one key: the value its loads read, for the caller to fold.
    #[inline]
    pub(super) fn touch_one(&self, engine: u64) -> u64 {
        if self.buckets.is_empty() {
            return 0;
        }
        let (first, second) = self.homes(engine);
        self.buckets[first].engines[0] ^ self.buckets[second].engines[0]
    }

    #[cold]
    fn grow(&mut self) {
        self.grow_to((self.buckets.len() * 2).max(4));
    }

    /// Rebuild with `n` buckets, or more if some key finds both its buckets full.
    fn grow_to(&mut self, n: usize) {
        let old = std::mem::replace(&mut self.buckets, vec![EMPTY_BUCKET; n]);
        let all_placed = old.iter().all(|b| {
            (0..b.len as usize).all(|i| {
                let engine = b.engines[i];
                self.place(engine, b.blocks[i], self.homes(engine))
            })
        });
        if !all_placed {
            self.buckets = old;
            self.grow_to(n * 2);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn a_bucket_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Bucket>(), 64);
    }

    #[test]
    fn agrees_with_a_hash_map_under_random_inserts_and_removals() {
        // Keys from a small range collide, and spill to their second buckets; the
        // table grows, churns and drains.
        for (range, ops) in [(64u64, 20_000), (5_000, 60_000), (u64::MAX, 60_000)] {
            let mut rng = crate::fleet_index::test_rng(range);
            let mut map = EngineMap::default();
            let mut model: HashMap<u64, BlockIdx> = HashMap::new();
            for op in 0..ops {
                let key = match range {
                    u64::MAX => rng(3_000) * 0x1_0000_0001,
                    r => rng(r),
                };
                let block = (op % 1_000) as BlockIdx;
                let insert = match op * 3 / ops {
                    0 => rng(4) != 0,
                    1 => rng(2) == 0,
                    _ => rng(4) == 0,
                };
                if insert {
                    assert_eq!(map.insert(key, block), model.insert(key, block), "{key}");
                } else {
                    assert_eq!(map.remove(key), model.remove(&key), "{key}");
                }
                assert_eq!(map.len(), model.len());
                if op % 997 == 0 {
                    for (k, v) in &model {
                        assert_eq!(map.get(*k), Some(*v), "{k}");
                    }
                    let mut got: Vec<BlockIdx> = map.blocks().collect();
                    let mut want: Vec<BlockIdx> = model.values().copied().collect();
                    got.sort_unstable();
                    want.sort_unstable();
                    assert_eq!(got, want);
                }
            }
            for k in 0..range.min(10_000) {
                assert_eq!(map.get(k), model.get(&k).copied(), "{k}");
            }
        }
    }

    #[test]
    fn fills_to_three_quarters_without_growing_early() {
        // A table grows when three quarters of its slots are used; before that, a key
        // whose both buckets are full must find room by moving others, also under churn.
        let mut rng = crate::fleet_index::test_rng(7);
        let mut map = EngineMap::default();
        map.grow_to(1024);
        let full = 1024 * SLOTS * 3 / 4;
        let mut keys: Vec<u64> = Vec::new();
        for round in 0..20 {
            while keys.len() < full {
                let key = rng(u64::MAX);
                if map.insert(key, keys.len() as BlockIdx).is_none() {
                    keys.push(key);
                }
            }
            assert_eq!(map.buckets.len(), 1024, "grew early in round {round}");
            for (i, k) in keys.iter().enumerate() {
                assert!(map.get(*k).is_some(), "key {i} of round {round} lost");
            }
            // Remove a random tenth, then fill up again.
            for _ in 0..full / 10 {
                let k = keys.swap_remove(rng(keys.len() as u64) as usize);
                assert!(map.remove(k).is_some());
            }
        }
        let spilled: usize = map.buckets.iter().map(|b| b.spilled as usize).sum();
        let in_second = map
            .buckets
            .iter()
            .enumerate()
            .flat_map(|(at, b)| b.engines[..b.len as usize].iter().map(move |e| (at, *e)))
            .filter(|&(at, e)| map.homes(e).0 != at)
            .count();
        assert_eq!(
            spilled, in_second,
            "each bucket counts its keys living elsewhere"
        );
    }

    #[test]
    fn clear_keeps_the_buckets_and_forgets_every_entry() {
        let mut map = EngineMap::default();
        for k in 0..100 {
            map.insert(k, k as BlockIdx);
        }
        let buckets = map.buckets.len();
        map.clear();
        assert_eq!((map.len(), map.buckets.len()), (0, buckets));
        assert!((0..100).all(|k| map.get(k).is_none()));
        assert_eq!(map.blocks().count(), 0);
    }
}
