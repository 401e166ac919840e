//! One worker's prefix cache as the what-if simulates it: a fixed number of blocks,
//! those no running request holds evicted least recently used first (the mocker's and
//! vLLM's policy), a request's prefix matched block by block from its first.

use kvscope_wire::SequenceHash;
use std::collections::{BTreeMap, HashMap};

/// A resident block: how many running requests hold it, and when it was last freed
/// or used (its place in the eviction order while none holds it).
#[derive(Debug, Clone, Copy)]
struct Resident {
    holders: u32,
    tick: u64,
}

/// A cache of `capacity` blocks, each touched by the requests that use it. A block a
/// running request holds is never evicted (an engine cannot evict what it is
/// computing with); the others go least recently used first. A cache of 0 blocks still
/// holds what its running requests hold, as any size does: the hits only grow with the
/// size, which the calibration's bisection relies on.
#[derive(Debug, Clone)]
pub(crate) struct SimulatedCache {
    capacity: usize,
    resident: HashMap<SequenceHash, Resident>,
    /// The blocks no running request holds, by tick: the first is evicted first.
    free: BTreeMap<u64, SequenceHash>,
    tick: u64,
    evicted: u64,
}

impl SimulatedCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            resident: HashMap::new(),
            free: BTreeMap::new(),
            tick: 0,
            evicted: 0,
        }
    }

    /// How many of `chain`'s blocks, from its first, are resident now.
    pub(crate) fn prefix_hit(&self, chain: &[SequenceHash]) -> usize {
        chain
            .iter()
            .take_while(|b| self.resident.contains_key(b))
            .count()
    }

    /// A request prefilled `chain` here and ended at once: [`Self::acquire`] then
    /// [`Self::release`]. Returns the prefix that was already here.
    pub fn prefill(&mut self, chain: &[SequenceHash]) -> usize {
        let hit = self.acquire(chain);
        self.release(chain);
        hit
    }

    /// A request starts running on `chain`: its matched prefix is reused, the rest
    /// stored, all of it held until [`Self::release`]; the least recently used free
    /// blocks are evicted to make room (a cache whose every block is held runs over its
    /// size, as an engine's running requests outgrow its free blocks). Returns the
    /// prefix that was already here.
    pub fn acquire(&mut self, chain: &[SequenceHash]) -> usize {
        let hit = self.prefix_hit(chain);
        for &b in chain {
            match self.resident.get_mut(&b) {
                Some(r) => {
                    if r.holders == 0 {
                        self.free.remove(&r.tick);
                    }
                    r.holders += 1;
                }
                None => {
                    self.resident.insert(
                        b,
                        Resident {
                            holders: 1,
                            tick: 0,
                        },
                    );
                }
            }
        }
        self.evict();
        hit
    }

    /// A request that [`Self::acquire`]d `chain` ended: its blocks are freed, tails
    /// first, so the prefix ends up the most recent (an engine frees a finished
    /// request's blocks last-first, so a shared prefix outlives its tails).
    pub fn release(&mut self, chain: &[SequenceHash]) {
        for &b in chain.iter().rev() {
            let Some(r) = self.resident.get_mut(&b) else {
                continue;
            };
            if r.holders > 0 {
                r.holders -= 1;
                if r.holders == 0 {
                    self.tick += 1;
                    r.tick = self.tick;
                    self.free.insert(self.tick, b);
                }
            }
        }
        self.evict();
    }

    /// Blocks a decode stored (a reply), free at once: each missing one stored, each
    /// free one made recent, tails first; held ones stay held.
    pub fn store(&mut self, blocks: &[SequenceHash]) {
        for &b in blocks.iter().rev() {
            self.tick += 1;
            match self.resident.get_mut(&b) {
                Some(r) if r.holders > 0 => {}
                Some(r) => {
                    self.free.remove(&r.tick);
                    r.tick = self.tick;
                    self.free.insert(self.tick, b);
                }
                None => {
                    self.resident.insert(
                        b,
                        Resident {
                            holders: 0,
                            tick: self.tick,
                        },
                    );
                    self.free.insert(self.tick, b);
                }
            }
        }
        self.evict();
    }

    fn evict(&mut self) {
        while self.resident.len() > self.capacity {
            let Some((_, b)) = self.free.pop_first() else {
                break;
            };
            self.resident.remove(&b);
            self.evicted += 1;
        }
    }

    #[cfg(test)]
    fn resident(&self) -> usize {
        self.resident.len()
    }

    #[cfg(test)]
    fn evicted(&self) -> u64 {
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
    fn a_running_request_s_blocks_are_never_evicted() {
        let mut c = SimulatedCache::new(4);
        c.prefill(&[1, 2]);
        assert_eq!(c.acquire(&[5, 6, 7]), 0); // running: 1 or 2 must go
        assert_eq!(c.resident(), 4);
        assert_eq!(c.prefix_hit(&[1]), 1, "the prefix outlived its tail 2");
        assert_eq!(c.acquire(&[8, 9]), 0); // 1 goes; the rest are held: over its size
        assert_eq!(c.resident(), 5);
        assert_eq!(c.prefix_hit(&[5, 6, 7]), 3);
        c.release(&[5, 6, 7]);
        assert_eq!(c.resident(), 4, "freed blocks are evicted back to its size");
        assert_eq!(
            c.prefix_hit(&[5, 6, 7]),
            2,
            "the freed prefix outlives its tail"
        );
        // A reply stored after a running prompt: free at once, its prompt still held.
        c.store(&[8, 9, 10]);
        assert_eq!(c.prefix_hit(&[8, 9, 10]), 3);
        c.release(&[8, 9]);
        assert_eq!(c.resident(), 4);
        // Two requests sharing a prefix: it stays held until both end.
        let mut s = SimulatedCache::new(2);
        s.acquire(&[1]);
        s.acquire(&[1]);
        s.release(&[1]);
        s.prefill(&[2, 3]);
        assert_eq!(s.prefix_hit(&[1]), 1);
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
