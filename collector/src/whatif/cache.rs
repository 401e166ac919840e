//! One worker's prefix cache as the what-if simulates it: a fixed number of blocks,
//! least recently used evicted first (the mocker's and vLLM's policy for blocks no
//! running request holds), a request's prefix matched block by block from its first.

use kvscope_wire::SequenceHash;
use std::collections::{BTreeMap, HashMap};

/// A cache of `capacity` blocks, each touched by the requests that use it.
#[derive(Debug, Clone)]
pub struct SimulatedCache {
    capacity: usize,
    /// Each resident block and the tick it was last used at.
    last_use: HashMap<SequenceHash, u64>,
    /// The same, by tick: the first entry is the least recently used block.
    by_tick: BTreeMap<u64, SequenceHash>,
    tick: u64,
    evicted: u64,
}

impl SimulatedCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            last_use: HashMap::new(),
            by_tick: BTreeMap::new(),
            tick: 0,
            evicted: 0,
        }
    }

    /// How many of `chain`'s blocks, from its first, are resident now.
    pub fn prefix_hit(&self, chain: &[SequenceHash]) -> usize {
        chain
            .iter()
            .take_while(|b| self.last_use.contains_key(b))
            .count()
    }

    /// A request prefilled `chain` here: its matched prefix is reused, the rest stored,
    /// all of it now the most recently used (the first block most recent of all, as an
    /// engine frees a finished request's blocks last-first, so a shared prefix outlives
    /// its tails); the least recently used others are evicted to make room. Returns the
    /// prefix that was already here.
    pub fn prefill(&mut self, chain: &[SequenceHash]) -> usize {
        let hit = self.prefix_hit(chain);
        if self.capacity == 0 {
            return hit;
        }
        // Tails first, so the prefix ends up the most recent.
        for &b in chain.iter().rev() {
            self.tick += 1;
            if let Some(old) = self.last_use.insert(b, self.tick) {
                self.by_tick.remove(&old);
            }
            self.by_tick.insert(self.tick, b);
        }
        while self.last_use.len() > self.capacity {
            let Some((_, b)) = self.by_tick.pop_first() else {
                break;
            };
            self.last_use.remove(&b);
            self.evicted += 1;
        }
        hit
    }

    pub fn resident(&self) -> usize {
        self.last_use.len()
    }

    pub fn evicted(&self) -> u64 {
        self.evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_is_matched_from_the_first_block() {
        let mut c = SimulatedCache::new(8);
        assert_eq!(c.prefill(&[1, 2, 3]), 0);
        assert_eq!(c.prefix_hit(&[1, 2, 9]), 2);
        assert_eq!(c.prefix_hit(&[2, 3]), 2);
        assert_eq!(
            c.prefix_hit(&[9, 1]),
            0,
            "a hole at the start matches nothing"
        );
    }

    #[test]
    fn the_least_recently_used_blocks_go_first_and_the_prefix_outlives_its_tails() {
        let mut c = SimulatedCache::new(4);
        c.prefill(&[1, 2, 3]);
        c.prefill(&[1, 5]); // 1 reused; 5 stored: 4 blocks, full
        assert_eq!(c.resident(), 4);
        c.prefill(&[6]); // evicts the least recent: 3 (the first request's tail)
        assert_eq!(c.evicted(), 1);
        assert_eq!(c.prefix_hit(&[1, 2, 3]), 2);
        assert_eq!(c.prefix_hit(&[1, 5]), 2);
        assert_eq!(c.resident(), 4);
    }

    #[test]
    fn a_chain_longer_than_the_cache_keeps_its_prefix() {
        let mut c = SimulatedCache::new(2);
        c.prefill(&[1, 2, 3, 4]);
        assert_eq!(c.resident(), 2);
        assert_eq!(c.prefix_hit(&[1, 2, 3, 4]), 2);
        let mut none = SimulatedCache::new(0);
        none.prefill(&[1]);
        assert_eq!(none.prefix_hit(&[1]), 0);
    }
}
