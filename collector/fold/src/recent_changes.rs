//! The fleet's latest block changes, kept to tell why the router's view of a choice was
//! wrong: a block the router did not credit was stored just before the decision (a store
//! it had not applied yet), a block it credited was removed just before (a removal it had
//! not applied yet), or stored only after it (the router saw the store before kvscope).
//!
//! Kept per batch as the engine's hashes (a removal names only those) and, for stores, the
//! mirror's sequence hashes beside them: a change costs a copy of its hashes, never a
//! hash-table insert on the event path. A lookup scans the ring, and runs only for a
//! decision the router got wrong.

use kvscope_wire::{SequenceHash, WorkerKey};
use std::collections::VecDeque;

/// Blocks kept, fleet-wide (16 bytes each for a store, 8 for a removal): at 100k block
/// changes per second, the last ~0.6 s; on a lab-sized fleet, minutes.
const KEPT_BLOCKS: usize = 65_536;
/// A change this close before a decision is one the router may not have applied yet;
/// one older is a view the router lost, not one it had yet to update.
pub const STALE_HORIZON_NS: u64 = 5_000_000_000;

/// One batch's change: its hashes are the next `len` (a removal) or `2 × len` (a store:
/// the engine's, then the mirror's) entries of [`RecentChanges::hashes`].
#[derive(Debug)]
struct Change {
    worker: WorkerKey,
    at_ns: u64,
    len: usize,
    stored: bool,
}

impl Change {
    fn entries(&self) -> usize {
        if self.stored {
            2 * self.len
        } else {
            self.len
        }
    }
}

/// Why the router's overlap for its chosen worker differed from what the worker held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StaleCause {
    /// Under: the first block it did not credit was stored within
    /// [`STALE_HORIZON_NS`] before the decision, this long before.
    StoredLately { lag_ns: u64 },
    /// Over: the first block it credited wrongly was removed within
    /// [`STALE_HORIZON_NS`] before the decision, this long before.
    RemovedLately { lag_ns: u64 },
    /// Over: the first block it credited wrongly was stored on the worker after the
    /// decision (the router applied the store before kvscope's mirror had it).
    StoredAfter,
    /// Nothing kept explains it: an older change (lost, or never applied), or one past
    /// what the ring keeps.
    Unexplained,
}

/// The changes, oldest first, and their hashes in one ring: no allocation per batch.
#[derive(Debug, Default)]
pub(crate) struct RecentChanges {
    changes: VecDeque<Change>,
    hashes: VecDeque<u64>,
    blocks: usize,
}

impl RecentChanges {
    /// `worker` stored `engine` (the mirror's `stored`, in order) at `at_ns`.
    pub fn stored(
        &mut self,
        worker: WorkerKey,
        at_ns: u64,
        engine: &[u64],
        stored: &[SequenceHash],
    ) {
        let n = engine.len().min(stored.len());
        self.hashes.extend(&engine[..n]);
        self.hashes.extend(&stored[..n]);
        self.push(worker, at_ns, n, true);
    }

    /// `worker` removed `engine` at `at_ns`.
    pub fn removed(&mut self, worker: WorkerKey, at_ns: u64, engine: &[u64]) {
        self.hashes.extend(engine);
        self.push(worker, at_ns, engine.len(), false);
    }

    fn push(&mut self, worker: WorkerKey, at_ns: u64, len: usize, stored: bool) {
        if len == 0 {
            return;
        }
        self.blocks += len;
        self.changes.push_back(Change {
            worker,
            at_ns,
            len,
            stored,
        });
        while self.blocks > KEPT_BLOCKS {
            let Some(old) = self.changes.pop_front() else {
                break;
            };
            self.blocks -= old.len;
            self.hashes.drain(..old.entries());
        }
    }

    /// Each change, newest first, with where its hashes start in [`Self::hashes`].
    fn newest_first(&self) -> impl Iterator<Item = (&Change, usize)> + '_ {
        let mut end = self.hashes.len();
        self.changes.iter().rev().map(move |c| {
            end -= c.entries();
            (c, end)
        })
    }

    /// `n` hashes from `at`.
    fn hashes(&self, at: usize, n: usize) -> impl Iterator<Item = u64> + '_ {
        self.hashes.range(at..at + n).copied()
    }

    /// Why `worker`'s engine held `block` at `decided_ns` while the router did not
    /// credit it: [`StaleCause::StoredLately`] or [`StaleCause::Unexplained`].
    pub(crate) fn why_under(
        &self,
        worker: WorkerKey,
        block: SequenceHash,
        decided_ns: u64,
    ) -> StaleCause {
        match self.last_store(worker, block, |t| t <= decided_ns) {
            Some((_, t)) if decided_ns - t <= STALE_HORIZON_NS => StaleCause::StoredLately {
                lag_ns: decided_ns - t,
            },
            _ => StaleCause::Unexplained,
        }
    }

    /// Why the router credited `worker` with `block`, which its engine did not hold at
    /// `decided_ns`: removed lately, stored after, or unexplained.
    pub(crate) fn why_over(
        &self,
        worker: WorkerKey,
        block: SequenceHash,
        decided_ns: u64,
    ) -> StaleCause {
        if let Some((engine, stored_ns)) = self.last_store(worker, block, |t| t <= decided_ns) {
            let removed = self.newest_first().find(|(c, at)| {
                c.worker == worker
                    && !c.stored
                    && c.at_ns >= stored_ns
                    && c.at_ns <= decided_ns
                    && decided_ns - c.at_ns <= STALE_HORIZON_NS
                    && self.hashes(*at, c.len).any(|h| h == engine)
            });
            if let Some((c, _)) = removed {
                return StaleCause::RemovedLately {
                    lag_ns: decided_ns - c.at_ns,
                };
            }
        }
        match self.last_store(worker, block, |t| t > decided_ns) {
            Some(_) => StaleCause::StoredAfter,
            None => StaleCause::Unexplained,
        }
    }

    /// The latest store of `block` on `worker` whose time passes `when`: its engine hash
    /// and time.
    fn last_store(
        &self,
        worker: WorkerKey,
        block: SequenceHash,
        when: impl Fn(u64) -> bool,
    ) -> Option<(u64, u64)> {
        self.newest_first()
            .filter(|(c, _)| c.worker == worker && c.stored && when(c.at_ns))
            .find_map(|(c, at)| {
                // A store's sequence hashes follow its engine hashes.
                let i = self.hashes(at + c.len, c.len).position(|s| s == block)?;
                Some((self.hashes[at + i], c.at_ns))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: WorkerKey = WorkerKey {
        worker_id: 1,
        dp_rank: 0,
    };
    const OTHER: WorkerKey = WorkerKey {
        worker_id: 2,
        dp_rank: 0,
    };
    const S: u64 = 1_000_000_000;

    fn seq(h: u64) -> SequenceHash {
        h
    }

    #[test]
    fn a_store_just_before_the_decision_is_one_the_router_had_not_applied() {
        let mut r = RecentChanges::default();
        r.stored(W, 10 * S, &[101, 102], &[seq(1), seq(2)]);
        assert_eq!(
            r.why_under(W, seq(2), 11 * S),
            StaleCause::StoredLately { lag_ns: S }
        );
        // Long held: the router lost it.
        assert_eq!(r.why_under(W, seq(2), 30 * S), StaleCause::Unexplained);
        // Another worker's store explains nothing.
        assert_eq!(r.why_under(OTHER, seq(2), 11 * S), StaleCause::Unexplained);
    }

    #[test]
    fn a_removal_just_before_or_a_store_just_after_explains_an_over_credit() {
        let mut r = RecentChanges::default();
        r.stored(W, 10 * S, &[101, 102], &[seq(1), seq(2)]);
        r.removed(W, 12 * S, &[102]);
        assert_eq!(
            r.why_over(W, seq(2), 13 * S),
            StaleCause::RemovedLately { lag_ns: S }
        );
        assert_eq!(r.why_over(W, seq(2), 20 * S), StaleCause::Unexplained);
        // Removed from another worker: not this one's removal.
        r.stored(OTHER, 10 * S, &[201], &[seq(3)]);
        r.removed(OTHER, 12 * S, &[201]);
        assert_eq!(r.why_over(W, seq(3), 13 * S), StaleCause::Unexplained);
        // Stored only after the decision.
        r.stored(W, 15 * S, &[104], &[seq(4)]);
        assert_eq!(r.why_over(W, seq(4), 14 * S), StaleCause::StoredAfter);
    }

    #[test]
    fn the_ring_keeps_a_bounded_number_of_blocks() {
        let mut r = RecentChanges::default();
        let engine: Vec<u64> = (0..1024).collect();
        let stored: Vec<SequenceHash> = engine.iter().map(|h| seq(*h)).collect();
        for i in 0..100 {
            r.stored(W, i * S, &engine, &stored);
        }
        assert!(r.blocks <= KEPT_BLOCKS, "{}", r.blocks);
        let kept = |r: &RecentChanges| r.changes.iter().map(|c| c.len).sum::<usize>();
        let entries = |r: &RecentChanges| r.changes.iter().map(Change::entries).sum::<usize>();
        assert_eq!((r.blocks, r.hashes.len()), (kept(&r), entries(&r)));
        r.removed(W, 0, &[]);
        r.removed(W, 101 * S, &[5, 6, 7]);
        assert_eq!((r.blocks, r.hashes.len()), (kept(&r), entries(&r)));
        // The newest changes are still found, their hashes where they were put, after
        // the oldest went.
        assert_eq!(
            r.why_under(W, seq(1023), 99 * S + 1),
            StaleCause::StoredLately { lag_ns: 1 }
        );
        assert_eq!(
            r.why_over(W, seq(6), 101 * S + 2),
            StaleCause::RemovedLately { lag_ns: 2 }
        );
    }
}
