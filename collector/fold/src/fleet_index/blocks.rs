//! The mirror's blocks: a trie over local hashes with one record per distinct block
//! (sequence hash) in an arena, each record pointing at the interned set of workers
//! holding it.
//!
//! Each record knows its parent, how many children it has, and one linked child (the
//! first one made under it while it had none linked). The other children, and the
//! chains' first blocks, are in a table keyed by sequence hash. So:
//!
//! - a chain that grows at its end (a prompt's new blocks, a decoded block) adds records
//!   linked from their parent: no hashing beyond the sequence hash itself, no table;
//! - following a chain the mirror holds — a worker storing a prefix another holds, a
//!   routing query — checks the linked child (usually the next record in memory, as a
//!   store's blocks are made together) and reads the sequence hash from it; a query
//!   takes a run of such records as a compressed edge is taken, comparing its hashes in
//!   order ([`Blocks::follow_run`]);
//! - only at a branch does a step probe the table, which holds the branches and the
//!   chains' first blocks only, so it stays small.
//!
//! A record whose last holder leaves is kept (a chain evicted and stored again finds its
//! records) until unheld records outnumber a quarter of the held ones (and 16k); then a
//! sweep frees every unheld record without children, leaves first, so a live record's
//! parent is always live.

use super::holder_sets::{SetId, EMPTY};
use super::FastMap;
use kvscope_wire::hashing::{chain_hash, LocalBlockHash};
use kvscope_wire::SequenceHash;
use std::collections::hash_map::Entry;

/// A record's position in [`Blocks`].
pub(super) type BlockIdx = u32;
/// No record: a first block's parent, a record without children.
const NO_BLOCK: BlockIdx = BlockIdx::MAX;
/// A freed record's holders (unheld records have `EMPTY`).
const FREED: SetId = EMPTY - 1;
/// The bit of [`Block::children`] that says the record is in the table.
const IN_TABLE: u32 = 1 << 31;
/// Unheld records kept at least: 512 KiB of records, so that a small fleet, whose
/// evicted chains come back most often, finds them (a handful in tests, so that they
/// sweep often).
#[cfg(not(test))]
const MIN_UNHELD_KEPT: usize = 16 * 1024;
#[cfg(test)]
const MIN_UNHELD_KEPT: usize = 3;

/// One distinct block: 32 bytes.
#[derive(Debug, Clone, Copy)]
struct Block {
    seq: SequenceHash,
    local: LocalBlockHash,
    parent: BlockIdx,
    /// The linked child; the others are in the table.
    next: BlockIdx,
    /// Who holds it; `EMPTY`: nobody (kept until a sweep); `FREED`: a free slot.
    holders: SetId,
    /// Children, and `IN_TABLE` when the record is in the table.
    children: u32,
}

impl Block {
    fn child_count(&self) -> u32 {
        self.children & !IN_TABLE
    }

    /// Whether every child of this record is the linked one (or there are none): then a
    /// step that misses the linked child needs no table probe.
    fn children_all_linked(&self) -> bool {
        self.child_count() <= u32::from(self.next != NO_BLOCK)
    }
}

/// The records, in chunks of fixed size: the arena is most of the mirror's memory, and a
/// vector doubling its capacity would leave up to half of it allocated and unused (and
/// copy it all at each doubling).
#[derive(Debug, Default)]
struct Arena {
    // Boxed so that growing the vector moves chunk pointers, not chunks.
    #[allow(clippy::vec_box)]
    chunks: Vec<Box<[Block; Arena::CHUNK]>>,
    len: usize,
}

impl Arena {
    /// 2,048 records (64 KiB) a chunk; 8 in tests, so that the arena fills often.
    #[cfg(not(test))]
    const CHUNK_BITS: u32 = 11;
    #[cfg(test)]
    const CHUNK_BITS: u32 = 3;
    const CHUNK: usize = 1 << Self::CHUNK_BITS;

    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, record: Block) {
        if self.len == self.chunks.len() * Self::CHUNK {
            let chunk: Box<[Block; Self::CHUNK]> = vec![record; Self::CHUNK]
                .into_boxed_slice()
                .try_into()
                .expect("a chunk of CHUNK records");
            self.chunks.push(chunk);
        }
        let i = self.len;
        self.len += 1;
        self[i] = record;
    }
}

impl std::ops::Index<usize> for Arena {
    type Output = Block;

    #[inline(always)]
    fn index(&self, i: usize) -> &Block {
        &self.chunks[i >> Self::CHUNK_BITS][i & (Self::CHUNK - 1)]
    }
}

impl std::ops::IndexMut<usize> for Arena {
    #[inline(always)]
    fn index_mut(&mut self, i: usize) -> &mut Block {
        &mut self.chunks[i >> Self::CHUNK_BITS][i & (Self::CHUNK - 1)]
    }
}

#[derive(Debug, Default)]
pub(super) struct Blocks {
    records: Arena,
    /// Chains' first blocks and children other than the linked one.
    table: FastMap<SequenceHash, BlockIdx>,
    free: Vec<BlockIdx>,
    /// Records with no holder, not yet swept.
    unheld: usize,
    /// Unheld records a sweep had to keep (they have children): the next sweep waits
    /// for that many more.
    kept_by_sweep: usize,
}

/// A record's holders, from [`Blocks::holders_mut`]: read, then changed, with the record
/// indexed once (an arena index costs a bounds check and a load of the chunk pointer).
pub(super) struct HoldersMut<'a> {
    holders: &'a mut SetId,
    unheld: &'a mut usize,
}

impl HoldersMut<'_> {
    #[inline(always)]
    pub(super) fn get(&self) -> SetId {
        *self.holders
    }

    /// Change them, keeping [`Blocks`]'s count of unheld records.
    #[inline(always)]
    pub(super) fn set(self, to: SetId) {
        let from = std::mem::replace(self.holders, to);
        match (from == EMPTY, to == EMPTY) {
            (true, false) => *self.unheld -= 1,
            (false, true) => *self.unheld += 1,
            _ => {}
        }
    }
}

/// A record a query met ([`Blocks::find_child`]), read in place: a query changes nothing,
/// so it keeps a reference where a store keeps a copy ([`Found`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Visited<'a>(&'a Block, BlockIdx);

impl Visited<'_> {
    pub(super) fn seq(self) -> SequenceHash {
        self.0.seq
    }

    /// Who holds it: `EMPTY` when nobody does.
    pub(super) fn holders(self) -> SetId {
        self.0.holders
    }
}

/// Which of a record's hashes a walk matches: a routing decision names its blocks by
/// local hash, or (Dynamo's request traces) by sequence hash.
#[derive(Debug, Clone, Copy)]
pub(super) enum ChainKey {
    Local,
    Seq,
}

impl ChainKey {
    #[inline(always)]
    fn of(self, r: &Block) -> u64 {
        match self {
            ChainKey::Local => r.local,
            ChainKey::Seq => r.seq,
        }
    }
}

/// The records [`Blocks::follow_run`] went along, in chain order.
#[derive(Debug, Clone, Copy)]
pub(super) struct Run<'a>(&'a [Block]);

impl<'a> Run<'a> {
    pub(super) fn len(self) -> usize {
        self.0.len()
    }

    pub(super) fn seqs(self) -> impl Iterator<Item = SequenceHash> + 'a {
        self.0.iter().map(|r| r.seq)
    }
}

/// A record [`Blocks::child`] found, copied: the next step along the chain reads the link
/// from here instead of indexing the arena again. Its link is the record's until a child
/// is made under it, which only that next step does.
#[derive(Debug, Clone, Copy)]
pub(super) struct Found {
    b: BlockIdx,
    record: Block,
}

impl Found {
    pub(super) fn idx(&self) -> BlockIdx {
        self.b
    }

    pub(super) fn seq(&self) -> SequenceHash {
        self.record.seq
    }

    /// Who held it when found: `EMPTY` when nobody did.
    pub(super) fn holders(&self) -> SetId {
        self.record.holders
    }
}

impl Blocks {
    /// Records allocated (live or free).
    pub(super) fn len(&self) -> usize {
        self.records.len()
    }

    /// Record `b`, for a walk along a chain from it.
    pub(super) fn found(&self, b: BlockIdx) -> Found {
        Found {
            b,
            record: self.records[b as usize],
        }
    }

    /// Whether the mirror is taken to be larger than the CPU caches
    /// ([`super::COLD_RECORDS`]); in tests always, so that the touches run on every input.
    #[inline]
    pub(super) fn cold(&self) -> bool {
        cfg!(test) || self.len() > super::COLD_RECORDS
    }

    pub(super) fn seq(&self, b: BlockIdx) -> SequenceHash {
        self.records[b as usize].seq
    }

    /// Who holds `b`: `EMPTY` when nobody does.
    pub(super) fn holders(&self, b: BlockIdx) -> SetId {
        self.records[b as usize].holders
    }

    pub(super) fn set_holders(&mut self, b: BlockIdx, to: SetId) {
        self.holders_mut(b).set(to);
    }

    /// `b`'s holders, to read and then change with one access to the record.
    #[inline(always)]
    pub(super) fn holders_mut(&mut self, b: BlockIdx) -> HoldersMut<'_> {
        HoldersMut {
            holders: &mut self.records[b as usize].holders,
            unheld: &mut self.unheld,
        }
    }

    /// Load these records, so that their cache misses overlap.
    pub(super) fn touch(&self, blocks: impl Iterator<Item = BlockIdx>) {
        std::hint::black_box(blocks.fold(0, |acc, b| {
            acc ^ u64::from(self.records[b as usize].holders)
        }));
    }

    /// The child of `parent` (`None`: a chain's first block) named by `key`, a hash of
    /// kind `by`, if mirrored; else its sequence hash.
    #[inline(always)]
    pub(super) fn find<'a>(
        &'a self,
        parent: Option<Visited<'a>>,
        key: u64,
        by: ChainKey,
    ) -> Result<Visited<'a>, SequenceHash> {
        match by {
            ChainKey::Local => self.find_child(parent, key),
            // A sequence hash names the block it is.
            ChainKey::Seq => self.find_child_seq(parent, key).ok_or(key),
        }
    }

    /// The child `local` of `parent` (`None`: a chain's first block) if mirrored; else its
    /// sequence hash.
    #[inline]
    fn find_child<'a>(
        &'a self,
        parent: Option<Visited<'a>>,
        local: LocalBlockHash,
    ) -> Result<Visited<'a>, SequenceHash> {
        let seq = match parent {
            None => chain_hash(None, local),
            Some(Visited(r, at)) => {
                if let Some(c) = self.linked_child(r, at) {
                    if c.0.local == local {
                        return Ok(c);
                    }
                }
                let seq = chain_hash(Some(r.seq), local);
                if r.children_all_linked() {
                    return Err(seq);
                }
                seq
            }
        };
        match self.table.get(&seq) {
            Some(&b) => Ok(Visited(&self.records[b as usize], b)),
            None => Err(seq),
        }
    }

    /// `r`'s (record `at`'s) linked child, if any. A store's new blocks are made in
    /// consecutive records, so the child is usually the next one: read from there
    /// while the link is checked, the walk along a chain does not wait for each record
    /// before it can load the next.
    #[inline(always)]
    fn linked_child<'a>(&'a self, r: &Block, at: BlockIdx) -> Option<Visited<'a>> {
        let guess = at.wrapping_add(1);
        if r.next == guess && (guess as usize) < self.records.len() {
            return Some(Visited(&self.records[guess as usize], guess));
        }
        (r.next != NO_BLOCK).then(|| Visited(&self.records[r.next as usize], r.next))
    }

    /// From `at`, the run of its linked children laid out right after it in memory (a
    /// chain stored together, as a compressed edge keeps it) that matches `keys` (each
    /// block's hash of kind `by`), as long as each is held by `holders` (`None`: whoever
    /// holds it). Returns the run (empty if none) and its last record (`at` if none).
    ///
    /// One compare per block along the run, against records read in order: no link to
    /// wait for and no chain-step branch per block, as `RadixTree` compares an edge.
    #[inline]
    pub(super) fn follow_run<'a>(
        &'a self,
        at: Visited<'a>,
        keys: &[u64],
        by: ChainKey,
        holders: Option<SetId>,
    ) -> (Run<'a>, Visited<'a>) {
        let Visited(_, b) = at;
        let chunk = &self.records.chunks[(b >> Arena::CHUNK_BITS) as usize];
        let first = (b as usize) & (Arena::CHUNK - 1);
        // The run ends at the chunk's end at the latest: the next chunk is elsewhere.
        let room = (Arena::CHUNK - 1 - first).min(keys.len());
        let (run, next) = (
            &chunk[first..first + room],
            &chunk[first + 1..first + 1 + room],
        );
        let n = run
            .iter()
            .zip(next)
            .zip(keys)
            .enumerate()
            .take_while(|(i, ((r, c), key))| {
                // A record's link is checked before its successor is trusted: the slot
                // after the arena's last record is not one.
                r.next == b + 1 + *i as BlockIdx
                    && by.of(c) == **key
                    && holders.is_none_or(|h| c.holders == h)
            })
            .count();
        match n {
            0 => (Run(&[]), at),
            _ => (Run(&next[..n]), Visited(&next[n - 1], b + n as BlockIdx)),
        }
    }

    /// The mirrored block with sequence hash `seq`, a child of `parent` (`None`: a
    /// chain's first block). A sequence hash names its whole prefix, so the block found
    /// is that child.
    fn find_child_seq<'a>(
        &'a self,
        parent: Option<Visited<'a>>,
        seq: SequenceHash,
    ) -> Option<Visited<'a>> {
        if let Some(Visited(r, at)) = parent {
            if let Some(c) = self.linked_child(r, at) {
                if c.0.seq == seq {
                    return Some(c);
                }
            }
            if r.children_all_linked() {
                return None;
            }
        }
        self.table
            .get(&seq)
            .map(|&b| Visited(&self.records[b as usize], b))
    }

    /// The child `local` of `parent` (`None`: a chain's first block), made (unheld) if
    /// not mirrored yet.
    #[inline(always)]
    pub(super) fn child(&mut self, parent: Option<&Found>, local: LocalBlockHash) -> Found {
        // A store following a chain the mirror holds finds the linked child: inline, one
        // record read.
        if let Some(p) = parent {
            if let Some(Visited(c, b)) = self.linked_child(&p.record, p.b) {
                if c.local == local {
                    return Found { b, record: *c };
                }
            }
        }
        let b = self.child_elsewhere(parent.map(Found::idx), local);
        self.found(b)
    }

    /// [`Self::child`] when it is not the linked one: in the table, or new.
    #[inline(never)]
    fn child_elsewhere(&mut self, parent: Option<BlockIdx>, local: LocalBlockHash) -> BlockIdx {
        let Some(p) = parent else {
            let seq = chain_hash(None, local);
            return match self.table.entry(seq) {
                Entry::Occupied(e) => *e.get(),
                Entry::Vacant(e) => {
                    let b = Self::make(&mut self.records, &mut self.free, seq, local, NO_BLOCK);
                    self.records[b as usize].children |= IN_TABLE;
                    self.unheld += 1;
                    *e.insert(b)
                }
            };
        };
        let r = self.records[p as usize];
        let seq = chain_hash(Some(r.seq), local);
        let b = if r.children_all_linked() {
            let b = Self::make(&mut self.records, &mut self.free, seq, local, p);
            if r.next == NO_BLOCK {
                self.records[p as usize].next = b;
            } else {
                self.records[b as usize].children |= IN_TABLE;
                self.table.insert(seq, b);
            }
            b
        } else {
            match self.table.entry(seq) {
                Entry::Occupied(e) => return *e.get(),
                Entry::Vacant(e) => {
                    let b = Self::make(&mut self.records, &mut self.free, seq, local, p);
                    self.records[b as usize].children |= IN_TABLE;
                    *e.insert(b)
                }
            }
        };
        self.records[p as usize].children += 1;
        self.unheld += 1;
        b
    }

    fn make(
        records: &mut Arena,
        free: &mut Vec<BlockIdx>,
        seq: SequenceHash,
        local: LocalBlockHash,
        parent: BlockIdx,
    ) -> BlockIdx {
        let record = Block {
            seq,
            local,
            parent,
            next: NO_BLOCK,
            holders: EMPTY,
            children: 0,
        };
        match free.pop() {
            Some(b) => {
                records[b as usize] = record;
                b
            }
            None => {
                records.push(record);
                (records.len() - 1) as BlockIdx
            }
        }
    }

    /// Free the unheld records once there are many of them: a quarter of the held ones,
    /// and at least [`MIN_UNHELD_KEPT`]. Call between operations only: a record index
    /// held by the caller may be freed.
    pub(super) fn maybe_sweep(&mut self) {
        let held = self.records.len() - self.free.len() - self.unheld;
        if self.unheld <= self.kept_by_sweep + MIN_UNHELD_KEPT.max(held / 4) {
            return;
        }
        for b in 0..self.records.len() as BlockIdx {
            // Leaves first: freeing a record may leave its parent unheld and childless.
            let mut at = b;
            loop {
                let r = self.records[at as usize];
                if r.holders != EMPTY || r.child_count() > 0 {
                    break;
                }
                if r.children & IN_TABLE != 0 {
                    self.table.remove(&r.seq);
                }
                self.records[at as usize] = Block {
                    holders: FREED,
                    parent: NO_BLOCK,
                    next: NO_BLOCK,
                    children: 0,
                    ..r
                };
                self.free.push(at);
                self.unheld -= 1;
                if r.parent == NO_BLOCK {
                    break;
                }
                let parent = &mut self.records[r.parent as usize];
                parent.children -= 1;
                if parent.next == at {
                    // Its other children, if any, are all in the table.
                    parent.next = NO_BLOCK;
                }
                at = r.parent;
            }
        }
        self.kept_by_sweep = self.unheld;
        // Taken from the end: lowest first, so that a store's new blocks get
        // consecutive records where the sweep freed a run (see `linked_child`).
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }

    /// Records in use (held or kept), for tests.
    #[cfg(test)]
    pub(super) fn live(&self) -> usize {
        self.records.len() - self.free.len()
    }

    /// The records of the mirrored chain `locals` as far as the mirror holds it, for
    /// tests.
    #[cfg(test)]
    pub(super) fn chain_records(&self, locals: &[LocalBlockHash]) -> Vec<BlockIdx> {
        let mut at = None;
        let mut out = Vec::new();
        for local in locals {
            let Ok(found) = self.find_child(at, *local) else {
                break;
            };
            out.push(found.1);
            at = Some(found);
        }
        out
    }
}
