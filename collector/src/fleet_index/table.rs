//! A hash table for the mirror's hot maps, whose keys are block hashes: open addressing
//! with linear probing, each key stored next to its value, so that a lookup in a table
//! far larger than the CPU caches costs one cache miss (std's `HashMap` keeps its control
//! bytes apart from its entries: two).
//!
//! Robin Hood placement (an entry far from its home slot displaces one nearer to its own)
//! keeps probe runs short at 7/8 load, and a lookup for an absent key stops as soon as it
//! meets an entry nearer home than itself. Removal shifts the rest of the run back, so
//! there are no tombstones.
//!
//! Keys are already hashes, or small integers in tests: a folded multiply spreads them.
//! Key 0 marks an empty slot, so the value under key 0 lives on the side.

/// Most slots in use, in eighths, before the table doubles.
const MAX_LOAD_EIGHTHS: usize = 7;
const FOLD: u64 = 0x9e37_79b9_7f4a_7c15;

#[derive(Debug, Clone, Copy, Default)]
struct Slot<V> {
    key: u64,
    value: V,
}

#[derive(Debug, Clone)]
pub(super) struct BlockTable<V> {
    slots: Box<[Slot<V>]>,
    /// Keys in `slots` (the side entry for key 0 not included).
    len: usize,
    /// 64 − log2(slots.len()): an index is the top bits of the folded key.
    shift: u32,
    zero: Option<V>,
}

impl<V: Copy + Default> Default for BlockTable<V> {
    fn default() -> Self {
        Self {
            slots: Box::default(),
            len: 0,
            shift: 64,
            zero: None,
        }
    }
}

fn fold(key: u64) -> u64 {
    let p = u128::from(key) * u128::from(FOLD);
    (p as u64) ^ ((p >> 64) as u64)
}

impl<V: Copy + Default> BlockTable<V> {
    #[cfg(test)]
    fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    fn home(&self, key: u64) -> usize {
        // shift < 64 whenever there are slots to index.
        (fold(key) >> self.shift) as usize
    }

    /// How far slot `i`'s entry sits past its home slot.
    fn distance(&self, i: usize) -> usize {
        i.wrapping_sub(self.home(self.slots[i].key)) & self.mask()
    }

    /// The slot holding `key`, if any.
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(key);
        let mut d = 0;
        loop {
            let k = self.slots[i].key;
            if k == key {
                return Some(i);
            }
            if k == 0 || self.distance(i) < d {
                return None;
            }
            i = (i + 1) & mask;
            d += 1;
        }
    }

    pub(super) fn get(&self, key: u64) -> Option<V> {
        if key == 0 {
            return self.zero;
        }
        self.find(key).map(|i| self.slots[i].value)
    }

    pub(super) fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        if key == 0 {
            return self.zero.as_mut();
        }
        self.find(key).map(|i| &mut self.slots[i].value)
    }

    /// Load the home slots of `keys` in one tight loop, so that their cache misses
    /// overlap instead of coming one after another in the work that follows. Returns a
    /// value only to keep the loads; pass it to `std::hint::black_box`.
    pub(super) fn touch(&self, keys: impl Iterator<Item = u64>) -> u64 {
        if self.slots.is_empty() {
            return 0;
        }
        keys.fold(0, |acc, k| acc ^ self.slots[self.home(k)].key)
    }

    /// The value under `key`, inserting `V::default()` first if absent; and whether it
    /// was inserted.
    pub(super) fn get_or_default(&mut self, key: u64) -> (&mut V, bool) {
        if key == 0 {
            let inserted = self.zero.is_none();
            return (self.zero.get_or_insert_with(V::default), inserted);
        }
        if let Some(i) = self.find(key) {
            return (&mut self.slots[i].value, false);
        }
        self.reserve_one();
        let i = self.place(Slot {
            key,
            value: V::default(),
        });
        self.len += 1;
        (&mut self.slots[i].value, true)
    }

    /// Put an absent key in, displacing entries nearer their home; returns its slot.
    fn place(&mut self, entry: Slot<V>) -> usize {
        let mask = self.mask();
        let mut i = self.home(entry.key);
        let mut d = 0;
        let mut carried = entry;
        let mut landed = None;
        loop {
            if self.slots[i].key == 0 {
                self.slots[i] = carried;
                return landed.unwrap_or(i);
            }
            let resident = self.distance(i);
            if resident < d {
                std::mem::swap(&mut self.slots[i], &mut carried);
                landed.get_or_insert(i);
                d = resident;
            }
            i = (i + 1) & mask;
            d += 1;
        }
    }

    /// Insert or replace; returns the previous value.
    pub(super) fn insert(&mut self, key: u64, value: V) -> Option<V> {
        let (v, inserted) = self.get_or_default(key);
        let old = *v;
        *v = value;
        (!inserted).then_some(old)
    }

    pub(super) fn remove(&mut self, key: u64) -> Option<V> {
        if key == 0 {
            return self.zero.take();
        }
        let mut hole = self.find(key)?;
        let value = self.slots[hole].value;
        // Backward shift: the rest of the run moves one slot nearer home, up to an empty
        // slot or an entry already at home.
        let mask = self.mask();
        let mut j = (hole + 1) & mask;
        while self.slots[j].key != 0 && self.distance(j) > 0 {
            self.slots[hole] = self.slots[j];
            hole = j;
            j = (j + 1) & mask;
        }
        self.slots[hole] = Slot::default();
        self.len -= 1;
        Some(value)
    }

    /// Every (key, value), in no particular order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        self.zero.map(|v| (0, v)).into_iter().chain(
            self.slots
                .iter()
                .filter(|s| s.key != 0)
                .map(|s| (s.key, s.value)),
        )
    }

    /// Empty the table, keeping its slots.
    pub(super) fn clear(&mut self) {
        self.slots.fill(Slot::default());
        self.len = 0;
        self.zero = None;
    }

    fn reserve_one(&mut self) {
        if (self.len + 1) * 8 <= self.slots.len() * MAX_LOAD_EIGHTHS {
            return;
        }
        let n = (self.slots.len() * 2).max(8);
        let old = std::mem::replace(&mut self.slots, vec![Slot::default(); n].into_boxed_slice());
        self.shift = 64 - n.trailing_zeros();
        for s in old.iter().filter(|s| s.key != 0) {
            self.place(*s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn behaves_like_a_hash_map_through_inserts_removals_and_growth() {
        let mut t: BlockTable<u32> = BlockTable::default();
        let mut m: HashMap<u64, u32> = HashMap::new();
        // Small keys collide in their home slots; 0 is the side entry.
        let mut x = 7u64;
        for i in 0..20_000u32 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let key = if i % 3 == 0 { x % 64 } else { x >> 20 };
            if x % 5 < 2 {
                assert_eq!(t.remove(key), m.remove(&key), "remove {key}");
            } else {
                assert_eq!(t.insert(key, i), m.insert(key, i), "insert {key}");
            }
            assert_eq!(t.len(), m.len());
        }
        for (k, v) in &m {
            assert_eq!(t.get(*k), Some(*v));
        }
        let mut all: Vec<_> = t.iter().collect();
        all.sort_unstable();
        let mut want: Vec<_> = m.into_iter().collect();
        want.sort_unstable();
        assert_eq!(all, want);
        t.clear();
        assert_eq!((t.len(), t.get(want[0].0)), (0, None));
    }
}
