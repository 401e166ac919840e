//! Interned sets of workers: each distinct set of holders is stored once, its members
//! sorted by worker key, with the number of blocks pointing at it; it is freed with its
//! last block. Adding or removing one worker goes through a small cache of recent
//! transitions, since a store or an eviction moves a whole run of blocks from one set to
//! the same other set.

use super::{FastMap, WorkerIdx};
use kvscope_wire::WorkerKey;
use std::cmp::Ordering;

/// A holder set's position in [`HolderSets`].
pub(super) type SetId = u32;
/// "No set": the empty set, as a transition's source or result.
pub(super) const EMPTY: SetId = SetId::MAX;
/// The bit that makes a set id a one-worker set, `SINGLE | worker`: most blocks have one
/// holder, and such sets need no slot, no interning and no block count.
const SINGLE: SetId = 1 << 31;

const FOLD: u64 = 0x9e37_79b9_7f4a_7c15;
/// Idle sets kept before they are freed (more in a fleet with many sets).
const IDLE_SETS: usize = 256;

#[derive(Debug)]
pub(super) struct HolderSets {
    /// Worker index → key: the order of every set's members.
    keys: Vec<WorkerKey>,
    /// `singles[w] == w`: the members of the one-worker set {w}.
    singles: Vec<WorkerIdx>,
    slots: Vec<HolderSet>,
    free: Vec<SetId>,
    /// Sets whose last block went away, not freed yet: a set often comes back soon (a
    /// worker's set of its own blocks, in a small fleet with churn), and while it lives
    /// the transitions cached to it stay valid.
    idle: Vec<SetId>,
    by_members: FastMap<Box<[WorkerIdx]>, SetId>,
    /// Direct-mapped; sized with the number of workers.
    transitions: Vec<Transition>,
    /// The last transition taken: a store or an eviction moves a run of blocks from one
    /// set to the same other set, so most transitions repeat the previous one.
    last: LastTransition,
    /// Bumped whenever sets are freed: `last` is valid while it has not moved.
    frees: u32,
}

#[derive(Debug, Default)]
struct HolderSet {
    members: Box<[WorkerIdx]>,
    /// Blocks whose holders are exactly this set.
    blocks: u32,
    /// Bumped when the slot is freed, so a cached transition can tell a reused slot.
    generation: u32,
}

#[derive(Debug, Clone, Copy)]
struct Transition {
    from: SetId,
    from_generation: u32,
    worker: WorkerIdx,
    add: bool,
    to: SetId,
    to_generation: u32,
}

#[derive(Debug, Clone, Copy)]
struct LastTransition {
    from: SetId,
    worker: WorkerIdx,
    add: bool,
    to: Option<SetId>,
    /// [`HolderSets::frees`] when it was taken.
    frees: u32,
}

const NO_TRANSITION: Transition = Transition {
    from: EMPTY,
    from_generation: 0,
    worker: WorkerIdx::MAX,
    add: false,
    to: EMPTY,
    to_generation: 0,
};

impl Default for HolderSets {
    fn default() -> Self {
        Self {
            keys: Vec::new(),
            singles: Vec::new(),
            slots: Vec::new(),
            free: Vec::new(),
            idle: Vec::new(),
            by_members: FastMap::default(),
            transitions: Vec::new(),
            last: LastTransition {
                from: EMPTY,
                worker: WorkerIdx::MAX,
                add: false,
                to: None,
                frees: 0,
            },
            frees: 0,
        }
    }
}

impl HolderSets {
    /// A new worker, with the next index.
    pub(super) fn add_worker(&mut self, key: WorkerKey) {
        // Below SINGLE | (SINGLE - 2), so that a one-worker set is never EMPTY or a
        // caller's marker just below it.
        assert!(self.keys.len() < (SINGLE - 2) as usize, "too many workers");
        self.singles.push(self.keys.len() as WorkerIdx);
        self.keys.push(key);
        let want = (self.keys.len() * 8).next_power_of_two().clamp(64, 1 << 13);
        if want > self.transitions.len() {
            self.transitions = vec![NO_TRANSITION; want];
        }
    }

    #[inline]
    pub(super) fn key(&self, w: WorkerIdx) -> WorkerKey {
        self.keys[w as usize]
    }

    /// The order of set members.
    #[inline]
    pub(super) fn cmp(&self, a: WorkerIdx, b: WorkerIdx) -> Ordering {
        self.keys[a as usize].cmp(&self.keys[b as usize])
    }

    #[inline(always)]
    pub(super) fn members(&self, id: SetId) -> &[WorkerIdx] {
        if id & SINGLE != 0 {
            let w = (id & !SINGLE) as usize;
            return &self.singles[w..=w];
        }
        &self.slots[id as usize].members
    }

    /// Whether set `id` has worker `w`; `EMPTY` has nobody (all its bits are set, so it
    /// reads as the one-worker set of a worker index that is never given out).
    #[inline(always)]
    pub(super) fn contains(&self, id: SetId, w: WorkerIdx) -> bool {
        if id & SINGLE != 0 {
            return id == SINGLE | w;
        }
        self.members(id)
            .binary_search_by(|m| self.cmp(*m, w))
            .is_ok()
    }

    fn generation(&self, id: SetId) -> u32 {
        if id == EMPTY || id & SINGLE != 0 {
            0
        } else {
            self.slots[id as usize].generation
        }
    }

    /// One more block points at set `id`.
    #[inline(always)]
    pub(super) fn retain(&mut self, id: SetId) {
        if id & SINGLE == 0 {
            self.slots[id as usize].blocks += 1;
        }
    }

    /// One block fewer points at set `id`.
    #[inline(always)]
    pub(super) fn release(&mut self, id: SetId) {
        if id & SINGLE != 0 {
            return;
        }
        let slot = &mut self.slots[id as usize];
        slot.blocks -= 1;
        if slot.blocks == 0 {
            self.now_idle(id);
        }
    }

    #[inline(never)]
    fn now_idle(&mut self, id: SetId) {
        self.idle.push(id);
        if self.idle.len() > IDLE_SETS.max(self.slots.len() / 8) {
            self.free_idle();
        }
    }

    /// Free the idle sets that still have no block.
    fn free_idle(&mut self) {
        for id in std::mem::take(&mut self.idle) {
            let slot = &mut self.slots[id as usize];
            // An id is listed again each time it empties; free it once.
            if slot.blocks == 0 && !slot.members.is_empty() {
                self.frees = self.frees.wrapping_add(1);
                let members = std::mem::take(&mut slot.members);
                slot.generation = slot.generation.wrapping_add(1);
                self.by_members.remove(&members);
                self.free.push(id);
            }
        }
    }

    /// `from` ∪ {w}, for `w` not in `from` (`EMPTY`: the set {w}).
    #[inline(always)]
    pub(super) fn with(&mut self, from: SetId, w: WorkerIdx) -> SetId {
        self.transition(from, w, true)
            .expect("adding a worker never empties a set")
    }

    /// `from` ∖ {w}, for `w` in `from`; `None` when that is empty.
    #[inline(always)]
    pub(super) fn without(&mut self, from: SetId, w: WorkerIdx) -> Option<SetId> {
        self.transition(from, w, false)
    }

    #[inline(always)]
    fn transition(&mut self, from: SetId, w: WorkerIdx, add: bool) -> Option<SetId> {
        match (from, add) {
            (EMPTY, true) => return Some(SINGLE | w),
            (from, false) if from & SINGLE != 0 => return None,
            _ => {}
        }
        let last = self.last;
        if last.from == from && last.worker == w && last.add == add && last.frees == self.frees {
            return last.to;
        }
        let to = self.cached_transition(from, w, add);
        self.last = LastTransition {
            from,
            worker: w,
            add,
            to,
            frees: self.frees,
        };
        to
    }

    #[inline(never)]
    fn cached_transition(&mut self, from: SetId, w: WorkerIdx, add: bool) -> Option<SetId> {
        let from_generation = self.generation(from);
        let key = (u64::from(from) << 32 | u64::from(w)) ^ u64::from(add);
        let bits = self.transitions.len().trailing_zeros();
        let slot = (key.wrapping_mul(FOLD) >> (64 - bits)) as usize;
        let t = self.transitions[slot];
        if t.from == from
            && t.from_generation == from_generation
            && t.worker == w
            && t.add == add
            && t.to_generation == self.generation(t.to)
        {
            return (t.to != EMPTY).then_some(t.to);
        }
        let mut members = if from == EMPTY {
            Vec::with_capacity(1)
        } else {
            self.members(from).to_vec()
        };
        match (members.binary_search_by(|m| self.cmp(*m, w)), add) {
            (Err(at), true) => members.insert(at, w),
            (Ok(at), false) => {
                members.remove(at);
            }
            _ => unreachable!("adds a worker not in the set, removes one in it"),
        }
        let to = match members[..] {
            [] => EMPTY,
            [only] => SINGLE | only,
            _ => self.intern(members),
        };
        self.transitions[slot] = Transition {
            from,
            from_generation,
            worker: w,
            add,
            to,
            to_generation: self.generation(to),
        };
        (to != EMPTY).then_some(to)
    }

    /// The id of the set with exactly these (sorted) members, created without blocks if
    /// new: the caller retains it at once.
    fn intern(&mut self, members: Vec<WorkerIdx>) -> SetId {
        if let Some(id) = self.by_members.get(members.as_slice()) {
            return *id;
        }
        let members = members.into_boxed_slice();
        let id = match self.free.pop() {
            Some(id) => {
                self.slots[id as usize].members = members.clone();
                id
            }
            None => {
                self.slots.push(HolderSet {
                    members: members.clone(),
                    blocks: 0,
                    generation: 0,
                });
                (self.slots.len() - 1) as SetId
            }
        };
        self.by_members.insert(members, id);
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_contains_nobody_and_a_set_its_members() {
        let mut sets = HolderSets::default();
        for id in 0..3 {
            sets.add_worker(WorkerKey {
                worker_id: id,
                dp_rank: 0,
            });
        }
        assert!((0..3).all(|w| !sets.contains(EMPTY, w)));
        let one = sets.with(EMPTY, 1);
        let two = sets.with(one, 2);
        assert!(sets.contains(one, 1) && !sets.contains(one, 2));
        assert!(sets.contains(two, 1) && sets.contains(two, 2) && !sets.contains(two, 0));
    }
}
