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
    /// `BlockRemoved`, by engine hash.
    Remove { worker: u32, engine: Span },
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

    pub fn push_remove(&mut self, worker: u32, engine: impl IntoIterator<Item = u64>) {
        let engine = self.push_hashes(engine);
        self.stats.remove_events += 1;
        self.stats.removed_blocks += u64::from(engine.len);
        self.ops.push(Op::Remove { worker, engine });
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
        // Per worker: how many times each engine hash is stored. Dynamo's publisher
        // folds repeated stores of one hash (`EventDedupFilter`) before its index sees
        // them and kvscope counts them inside its mirror; a stream that has them would
        // need two different feeds, so they are refused rather than silently skewed.
        let mut stored: HashMap<(u32, u64), u32> = HashMap::new();
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
                                for h in block_hashes {
                                    let n = stored.entry((w, *h)).or_insert(0);
                                    *n += 1;
                                    anyhow::ensure!(
                                        *n == 1,
                                        "worker {} stores block {h} twice: not supported by \
                                         the benchmark",
                                        batch.worker
                                    );
                                }
                                trace.push_store(
                                    w,
                                    *parent_block_hash,
                                    block_hashes.iter().copied(),
                                    locals.iter().copied(),
                                );
                            }
                            KvEvent::BlockRemoved { block_hashes, .. } => {
                                for h in block_hashes {
                                    stored.remove(&(w, *h));
                                }
                                trace.push_remove(w, block_hashes.iter().copied());
                            }
                            KvEvent::AllBlocksCleared => {
                                stored.retain(|(sw, _), _| *sw != w);
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

/// The device tier, as the collector's analyzer reads a medium.
fn is_device_tier(medium: Option<&str>) -> bool {
    kvscope_wire::Tier::of_medium(medium) == Some(kvscope_wire::Tier::Device)
}
