//! The one stream every contender is fed: KV events as the router-side index receives
//! them (device tier only, each block with its engine hash and its local hash already
//! computed from its tokens) and routing queries (a request's local hashes), in order.
//!
//! Hashes live in one arena so that a stream of millions of blocks costs 8 bytes per
//! hash and no allocation per op.

use anyhow::Context as _;
use kvscope_wire::recording::read_recording;
use kvscope_wire::{KvEvent, Record, WorkerKey};
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

/// One step of the stream. Hash ranges index [`Trace::hashes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `BlockStored`: `blocks` engine hashes at `start` in the arena, then as many local
    /// hashes (see [`Trace::stored`]).
    Store {
        worker: u32,
        blocks: u32,
        start: u64,
        parent: Option<u64>,
    },
    /// `BlockRemoved`, by engine hash: `engine` as the engine sent it (kvscope's feed),
    /// `passed` what Dynamo's publisher passes on to its indexers (`EventDedupFilter`: a
    /// hash stored more than once leaves only with its last store). The same span when
    /// nothing was stored twice.
    Remove {
        worker: u32,
        engine: Span,
        passed: Span,
    },
    /// `AllBlocksCleared`.
    Clear { worker: u32 },
    /// A routing decision: every worker's overlap with these local hashes.
    Query { locals: Span },
}

/// A run of hashes in the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: u64,
    pub len: u32,
}

impl Span {
    fn range(self) -> Range<usize> {
        self.start as usize..self.start as usize + self.len as usize
    }
}

/// What a stream holds, counted once while it is built.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct TraceStats {
    pub workers: usize,
    pub store_events: u64,
    pub stored_blocks: u64,
    pub remove_events: u64,
    pub removed_blocks: u64,
    pub clears: u64,
    pub queries: u64,
    pub query_blocks: u64,
}

impl TraceStats {
    /// Blocks stored, removed and looked up: the unit of "block ops/s".
    pub fn block_ops(&self) -> u64 {
        self.stored_blocks + self.removed_blocks + self.query_blocks
    }
}

#[derive(Debug, Default)]
pub struct Trace {
    pub name: String,
    /// Worker index (as used in [`Op`]) → the worker's key.
    pub workers: Vec<WorkerKey>,
    pub ops: Vec<Op>,
    hashes: Vec<u64>,
    pub stats: TraceStats,
}

/// A store event as the mirror takes it ([`Trace::store`]).
pub struct Stored<'a> {
    /// The worker's index in [`Trace::workers`].
    pub index: u32,
    pub worker: WorkerKey,
    /// The parent's engine hash.
    pub parent: Option<u64>,
    pub engine: &'a [u64],
    pub locals: &'a [u64],
}

impl Trace {
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }

    /// A trace over the same workers as `other` (same indices), e.g. a later phase.
    pub fn continuing(name: impl Into<String>, other: &Trace) -> Self {
        Self {
            name: name.into(),
            workers: other.workers.clone(),
            ..Self::default()
        }
    }

    pub fn hashes(&self, span: Span) -> &[u64] {
        &self.hashes[span.range()]
    }

    /// What `op` stores, when it is a store.
    pub fn store(&self, op: &Op) -> Option<Stored<'_>> {
        match *op {
            Op::Store {
                worker,
                blocks,
                start,
                parent,
            } => {
                let (engine, locals) = self.stored(start, blocks);
                Some(Stored {
                    index: worker,
                    worker: self.workers[worker as usize],
                    parent,
                    engine,
                    locals,
                })
            }
            _ => None,
        }
    }

    /// A store's engine hashes and local hashes.
    pub fn stored(&self, start: u64, blocks: u32) -> (&[u64], &[u64]) {
        let (start, n) = (start as usize, blocks as usize);
        (
            &self.hashes[start..start + n],
            &self.hashes[start + n..start + 2 * n],
        )
    }

    fn push_hashes(&mut self, hashes: impl IntoIterator<Item = u64>) -> Span {
        let start = self.hashes.len();
        self.hashes.extend(hashes);
        Span {
            start: start as u64,
            len: (self.hashes.len() - start) as u32,
        }
    }

    pub fn worker_index(&mut self, key: WorkerKey, index: &mut HashMap<WorkerKey, u32>) -> u32 {
        *index.entry(key).or_insert_with(|| {
            self.workers.push(key);
            self.workers.len() as u32 - 1
        })
    }

    pub fn push_store(
        &mut self,
        worker: u32,
        parent: Option<u64>,
        engine: impl IntoIterator<Item = u64>,
        locals: impl IntoIterator<Item = u64>,
    ) {
        let engine = self.push_hashes(engine);
        let locals = self.push_hashes(locals);
        assert_eq!(engine.len, locals.len, "one local hash per stored block");
        self.stats.store_events += 1;
        self.stats.stored_blocks += u64::from(engine.len);
        self.ops.push(Op::Store {
            worker,
            blocks: engine.len,
            start: engine.start,
            parent,
        });
    }

    /// A removal, and the hashes of it Dynamo's publisher passes on (see [`Op::Remove`]).
    pub fn push_remove(&mut self, worker: u32, engine: &[u64], passed: &[u64]) {
        let engine_span = self.push_hashes(engine.iter().copied());
        let passed = if passed == engine {
            engine_span
        } else {
            self.push_hashes(passed.iter().copied())
        };
        self.stats.remove_events += 1;
        self.stats.removed_blocks += u64::from(engine_span.len);
        self.ops.push(Op::Remove {
            worker,
            engine: engine_span,
            passed,
        });
    }

    pub fn push_clear(&mut self, worker: u32) {
        self.stats.clears += 1;
        self.ops.push(Op::Clear { worker });
    }

    pub fn push_query(&mut self, locals: impl IntoIterator<Item = u64>) {
        let locals = self.push_hashes(locals);
        self.stats.queries += 1;
        self.stats.query_blocks += u64::from(locals.len);
        self.ops.push(Op::Query { locals });
    }

    pub fn finish(mut self) -> Self {
        self.stats.workers = self.workers.len();
        self.hashes.shrink_to_fit();
        self.ops.shrink_to_fit();
        self
    }

    /// Bytes the stream itself occupies (reported so the reader can see it is not in
    /// any contender's figure).
    pub fn heap_bytes(&self) -> usize {
        self.hashes.capacity() * 8 + self.ops.capacity() * std::mem::size_of::<Op>()
    }

    /// The stream of a kvscope recording (JSONL of `Envelope`, e.g. the lab's
    /// `collector-recording.jsonl`): every device-tier KV event and every routing
    /// decision, in recording order. Local hashes are computed here, outside any timed
    /// region, the way both pipelines compute them before their index (Dynamo in the
    /// worker-side publisher, kvscope in the collector's `FleetIndex::store`).
    pub fn from_recording(path: &Path) -> anyhow::Result<Self> {
        let rec = read_recording(path)
            .with_context(|| format!("cannot read the recording {}", path.display()))?;
        let mut trace = Trace::new(format!(
            "lab recording {}",
            path.file_name().unwrap_or_default().to_string_lossy()
        ));
        let mut index = HashMap::new();
        // kvscope counts repeated stores inside its mirror and gets the stream as sent;
        // the Dynamo indexers get what their publisher's filter passes on.
        let mut filter = PublisherFilter::default();
        let mut passed = Vec::new();
        for env in &rec.envelopes {
            match &env.record {
                Record::KvEvents(batch) => {
                    let w = trace.worker_index(batch.worker, &mut index);
                    for ev in &batch.events {
                        match ev {
                            KvEvent::BlockStored { medium, .. }
                            | KvEvent::BlockRemoved { medium, .. }
                                if !is_device_tier(medium.as_deref()) => {}
                            KvEvent::BlockStored {
                                block_hashes,
                                parent_block_hash,
                                ..
                            } => {
                                let locals = ev.stored_local_hashes().unwrap_or_default();
                                anyhow::ensure!(
                                    locals.len() == block_hashes.len(),
                                    "a store with partial blocks: not supported by the benchmark"
                                );
                                filter.store(batch.worker, block_hashes);
                                trace.push_store(
                                    w,
                                    *parent_block_hash,
                                    block_hashes.iter().copied(),
                                    locals.iter().copied(),
                                );
                            }
                            KvEvent::BlockRemoved { block_hashes, .. } => {
                                filter.remove(batch.worker, block_hashes, &mut passed);
                                trace.push_remove(w, block_hashes, &passed);
                            }
                            KvEvent::AllBlocksCleared => {
                                filter.clear(batch.worker);
                                trace.push_clear(w);
                            }
                        }
                    }
                }
                Record::Decision(d) => trace.push_query(d.local_hashes.iter().copied()),
                // Migration lines, heartbeats, NIXL reports: nothing for an index.
                _ => {}
            }
        }
        Ok(trace.finish())
    }
}

/// What Dynamo's worker-side publisher passes on to the router's indexers
/// (`EventDedupFilter`): per engine (worker id and DP rank), how many times each engine
/// hash is stored; every store passes, a removal passes only with a hash's last store (or
/// for a hash never seen stored), and a clear of any rank resets the whole worker.
#[derive(Debug, Default)]
struct PublisherFilter {
    stored: HashMap<(WorkerKey, u64), u32>,
}

impl PublisherFilter {
    fn store(&mut self, engine: WorkerKey, hashes: &[u64]) {
        for h in hashes {
            *self.stored.entry((engine, *h)).or_insert(0) += 1;
        }
    }

    /// The hashes of a removal that pass, into `passed`.
    fn remove(&mut self, engine: WorkerKey, hashes: &[u64], passed: &mut Vec<u64>) {
        passed.clear();
        passed.extend(hashes.iter().copied().filter(
            |h| match self.stored.get_mut(&(engine, *h)) {
                Some(n) if *n > 1 => {
                    *n -= 1;
                    false
                }
                Some(_) => {
                    self.stored.remove(&(engine, *h));
                    true
                }
                None => true,
            },
        ));
    }

    fn clear(&mut self, engine: WorkerKey) {
        self.stored
            .retain(|(k, _), _| k.worker_id != engine.worker_id);
    }
}

/// The device tier, as the collector's analyzer reads a medium.
fn is_device_tier(medium: Option<&str>) -> bool {
    kvscope_wire::Tier::of_medium(medium) == Some(kvscope_wire::Tier::Device)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(worker_id: u64, dp_rank: u32) -> WorkerKey {
        WorkerKey { worker_id, dp_rank }
    }

    #[test]
    fn a_hash_stored_twice_passes_with_its_last_removal() {
        let mut filter = PublisherFilter::default();
        let mut passed = Vec::new();
        let (a, b) = (engine(1, 0), engine(1, 1));
        filter.store(a, &[10, 11]);
        filter.store(a, &[10]);
        filter.store(b, &[10]);
        filter.remove(a, &[10, 11], &mut passed);
        assert_eq!(passed, [11], "10 is still stored once on rank 0");
        filter.remove(a, &[10], &mut passed);
        assert_eq!(passed, [10]);
        filter.remove(a, &[99], &mut passed);
        assert_eq!(passed, [99], "a hash never stored passes");
        // Rank 1's count is its own, and a clear of rank 0 resets the whole worker.
        filter.store(b, &[10]);
        filter.remove(b, &[10], &mut passed);
        assert!(passed.is_empty());
        filter.clear(a);
        filter.remove(b, &[10], &mut passed);
        assert_eq!(passed, [10]);
    }
}
