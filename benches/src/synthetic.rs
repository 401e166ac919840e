//! A synthetic fleet trace: multi-turn conversations over shared system prompts, routed
//! to workers with a bounded KV cache each, with LRU eviction.
//!
//! Every conversation belongs to a family (a system prompt shared by all conversations
//! of that family). Turn t's prompt is the whole conversation so far (system prompt,
//! earlier user turns and answers) plus a new user message; the answer's blocks are
//! stored one event per block as decode fills them, so the next turn finds them cached.
//! The router keeps a conversation on its last worker with probability `stay` and
//! otherwise sends it to a random worker (a spill), which recomputes and stores the
//! prefix again: the same blocks end up cached on several workers. Each worker evicts
//! the least recently used conversation's tail blocks when its cache is full, and a
//! family's system-prompt blocks when the worker holds none of its conversations.
//!
//! Block hashes are Dynamo's: a block's engine hash is its Dynamo sequence hash (the
//! mocker publishes exactly that), so every Dynamo indexer, including the positional
//! one that recomputes sequence hashes, sees a stream it is built for.

use crate::trace::Trace;
use kvscope_wire::hashing::chain_hash;
use kvscope_wire::WorkerKey;
use std::collections::{BTreeMap, HashMap};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The shape of the synthetic fleet. Every field has a default.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, clap::Args)]
pub struct FleetSpec {
    /// Workers in the fleet.
    #[arg(long = "fleet-workers", default_value_t = 256)]
    pub workers: u32,
    /// KV cache capacity of each worker, in blocks.
    #[arg(long = "fleet-capacity", default_value_t = 6144)]
    pub capacity_blocks: u32,
    /// Conversation families (distinct system prompts).
    #[arg(long = "fleet-families", default_value_t = 32)]
    pub families: u32,
    /// Blocks in each system prompt.
    #[arg(long = "fleet-system-blocks", default_value_t = 64)]
    pub system_blocks: u32,
    /// Conversations in progress at any time, per worker.
    #[arg(long = "fleet-sessions-per-worker", default_value_t = 16)]
    pub sessions_per_worker: u32,
    /// Most turns in a conversation (each has 1..=this, uniformly).
    #[arg(long = "fleet-max-turns", default_value_t = 12)]
    pub max_turns: u32,
    /// Most blocks in a user message (1..=this, uniformly).
    #[arg(long = "fleet-max-user-blocks", default_value_t = 40)]
    pub max_user_blocks: u32,
    /// Most blocks in an answer (1..=this, uniformly).
    #[arg(long = "fleet-max-output-blocks", default_value_t = 24)]
    pub max_output_blocks: u32,
    /// Probability that the router keeps a conversation on its last worker.
    #[arg(long = "fleet-stay", default_value_t = 0.85)]
    pub stay: f64,
    /// One worker restarts (`AllBlocksCleared`) every this many requests (0: never).
    #[arg(long = "fleet-clear-every", default_value_t = 20_000)]
    pub clear_every: u64,
    /// Routed requests in the trace.
    #[arg(long = "fleet-requests", default_value_t = 80_000)]
    pub requests: u64,
    #[arg(long = "fleet-seed", default_value_t = 0x6b76_7363_6f70_65)]
    pub seed: u64,
}

/// splitmix64: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in 0..n.
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
    /// Uniform in 1..=n.
    fn one_to(&mut self, n: u32) -> u32 {
        1 + self.below(u64::from(n.max(1))) as u32
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

struct Session {
    id: u64,
    family: u32,
    turns_left: u32,
    /// Local and sequence hashes of the conversation so far.
    locals: Vec<u64>,
    seqs: Vec<u64>,
    last_worker: Option<u32>,
}

#[derive(Clone, Copy)]
struct Resident {
    family: u32,
    /// Leading blocks of the conversation cached here (≥ the system prompt).
    len: u32,
    stamp: u64,
}

#[derive(Default)]
struct WorkerCache {
    resident: HashMap<u64, Resident>,
    lru: BTreeMap<u64, u64>,
    /// Resident conversations per family; the family's system prompt is cached while > 0.
    families: HashMap<u32, u32>,
    used: u64,
}

/// Generates requests and the KV events they cause, appending them to a [`Trace`].
pub struct FleetGen {
    spec: FleetSpec,
    rng: Rng,
    workers: Vec<WorkerCache>,
    live: Vec<Session>,
    next_session: u64,
    family_locals: Vec<Vec<u64>>,
    family_seqs: Vec<Vec<u64>>,
    stamp: u64,
    requests: u64,
}

/// The local hash of block `i` of conversation `session` past its system prompt (a
/// stand-in for xxh3 over the block's tokens: unique per conversation and position).
fn session_local(session: u64, i: u32) -> u64 {
    xxh3_64_with_seed(&i.to_le_bytes(), session ^ 0x5e55_1000)
}

fn family_local(family: u32, i: u32) -> u64 {
    xxh3_64_with_seed(&i.to_le_bytes(), u64::from(family) ^ 0xfa31_1700)
}

impl FleetGen {
    pub fn new(spec: FleetSpec, trace: &mut Trace) -> Self {
        let mut index = HashMap::new();
        for w in 0..spec.workers {
            trace.worker_index(
                WorkerKey {
                    worker_id: u64::from(w),
                    dp_rank: 0,
                },
                &mut index,
            );
        }
        let (family_locals, family_seqs) = (0..spec.families.max(1))
            .map(|f| {
                let locals: Vec<u64> = (0..spec.system_blocks)
                    .map(|i| family_local(f, i))
                    .collect();
                let seqs = kvscope_wire::sequence_hashes(&locals);
                (locals, seqs)
            })
            .unzip();
        let mut gen = Self {
            rng: Rng(spec.seed),
            workers: (0..spec.workers).map(|_| WorkerCache::default()).collect(),
            live: Vec::new(),
            next_session: 0,
            family_locals,
            family_seqs,
            stamp: 0,
            requests: 0,
            spec,
        };
        let live = u64::from(gen.spec.workers) * u64::from(gen.spec.sessions_per_worker.max(1));
        for _ in 0..live {
            let s = gen.new_session();
            gen.live.push(s);
        }
        gen
    }

    fn new_session(&mut self) -> Session {
        let family = self.rng.below(u64::from(self.spec.families.max(1))) as u32;
        let id = self.next_session;
        self.next_session += 1;
        Session {
            id,
            family,
            turns_left: self.rng.one_to(self.spec.max_turns),
            locals: self.family_locals[family as usize].clone(),
            seqs: self.family_seqs[family as usize].clone(),
            last_worker: None,
        }
    }

    /// (block, worker) pairs cached across the fleet right now.
    pub fn cached_pairs(&self) -> u64 {
        self.workers.iter().map(|w| w.used).sum()
    }

    /// The least-filled worker's cached blocks.
    pub fn min_worker_blocks(&self) -> u64 {
        self.workers.iter().map(|w| w.used).min().unwrap_or(0)
    }

    /// Sequence hashes of blocks `from..to` of a (possibly finished) conversation.
    fn seqs_of(&self, session: u64, family: u32, from: u32, to: u32) -> Vec<u64> {
        let sys = self.spec.system_blocks;
        let fam = &self.family_seqs[family as usize];
        let mut out = Vec::with_capacity((to - from) as usize);
        let mut prev = fam.last().copied();
        for i in 0..to {
            let s = if i < sys {
                fam[i as usize]
            } else {
                let s = chain_hash(prev, session_local(session, i));
                prev = Some(s);
                s
            };
            if i >= from {
                out.push(s);
            }
        }
        out
    }

    fn touch(&mut self, w: u32, session: u64, family: u32, len: u32) {
        self.stamp += 1;
        let stamp = self.stamp;
        let cache = &mut self.workers[w as usize];
        match cache.resident.get_mut(&session) {
            Some(r) => {
                cache.lru.remove(&r.stamp);
                r.stamp = stamp;
                r.len = len;
            }
            None => {
                cache
                    .resident
                    .insert(session, Resident { family, len, stamp });
                *cache.families.entry(family).or_insert(0) += 1;
            }
        }
        cache.lru.insert(stamp, session);
    }

    /// Evict least recently used conversations' tails (never `keep`'s) until `need`
    /// more blocks fit on worker `w`.
    fn make_room(&mut self, trace: &mut Trace, w: u32, need: u64, keep: u64) {
        let sys = self.spec.system_blocks;
        let cap = u64::from(self.spec.capacity_blocks);
        loop {
            let cache = &self.workers[w as usize];
            if cache.used + need <= cap {
                return;
            }
            let excess = cache.used + need - cap;
            let Some((&stamp, &victim)) = cache.lru.iter().find(|(_, s)| **s != keep) else {
                return; // only the conversation itself is left: it outgrows the cache
            };
            let r = cache.resident[&victim];
            let take = excess.min(u64::from(r.len - sys)) as u32;
            let mut removed = self.seqs_of(victim, r.family, r.len - take, r.len);
            removed.reverse(); // tail first, as an engine frees them
            let cache = &mut self.workers[w as usize];
            cache.used -= u64::from(take);
            if r.len - take > sys {
                cache.resident.get_mut(&victim).expect("resident").len = r.len - take;
            } else {
                cache.resident.remove(&victim);
                cache.lru.remove(&stamp);
                let n = cache.families.get_mut(&r.family).expect("family counted");
                *n -= 1;
                if *n == 0 {
                    cache.families.remove(&r.family);
                    cache.used -= u64::from(sys);
                    removed.extend(self.family_seqs[r.family as usize].iter().rev());
                }
            }
            // The fleet stores no hash twice: both feeds are the same.
            trace.push_remove(w, &removed, &removed);
        }
    }

    /// One routed request: its query (when `with_query`), the evictions it causes, the
    /// prefill store and the answer's blocks.
    pub fn request(&mut self, trace: &mut Trace, with_query: bool) {
        self.requests += 1;
        let spec = self.spec.clone();
        let n_workers = u64::from(spec.workers);
        if spec.clear_every > 0 && self.requests.is_multiple_of(spec.clear_every) {
            let w = self.rng.below(n_workers) as u32;
            self.workers[w as usize] = WorkerCache::default();
            trace.push_clear(w);
        }
        let sys = spec.system_blocks;
        let user = self.rng.one_to(spec.max_user_blocks);
        let output = self.rng.one_to(spec.max_output_blocks);
        let si = self.rng.below(self.live.len() as u64) as usize;

        // The new user message.
        let (id, family) = (self.live[si].id, self.live[si].family);
        let grow = |s: &mut Session, n: u32| {
            for _ in 0..n {
                let i = s.locals.len() as u32;
                let l = session_local(s.id, i);
                s.seqs.push(chain_hash(s.seqs.last().copied(), l));
                s.locals.push(l);
            }
        };
        grow(&mut self.live[si], user);
        let prompt = self.live[si].locals.len() as u32;
        if with_query {
            trace.push_query(self.live[si].locals.iter().copied());
        }
        let w = match self.live[si].last_worker {
            Some(w) if self.rng.chance(spec.stay) => w,
            _ => self.rng.below(n_workers) as u32,
        };

        // What worker w already holds of this prompt.
        let cache = &self.workers[w as usize];
        let cached = match cache.resident.get(&id) {
            Some(r) => r.len,
            None if cache.families.contains_key(&family) => sys,
            None => 0,
        };
        if cached > 0 {
            self.touch(w, id, family, cached);
        }
        let need = u64::from(prompt - cached + output);
        self.make_room(trace, w, need, id);

        let s = &self.live[si];
        let parent = (cached > 0).then(|| s.seqs[cached as usize - 1]);
        let range = cached as usize..prompt as usize;
        trace.push_store(
            w,
            parent,
            s.seqs[range.clone()].iter().copied(),
            s.locals[range].iter().copied(),
        );
        grow(&mut self.live[si], output);
        let s = &self.live[si];
        for i in prompt as usize..s.locals.len() {
            trace.push_store(w, Some(s.seqs[i - 1]), [s.seqs[i]], [s.locals[i]]);
        }
        let len = s.locals.len() as u32;
        self.touch(w, id, family, len);
        self.workers[w as usize].used += need;

        let s = &mut self.live[si];
        s.last_worker = Some(w);
        s.turns_left -= 1;
        if s.turns_left == 0 {
            self.live[si] = self.new_session();
        }
    }
}

/// The trace of `spec.requests` routed requests, each with its query.
pub fn fleet_trace(spec: &FleetSpec) -> (Trace, u64) {
    let mut trace = Trace::new(format!(
        "synthetic fleet: {} workers × {} blocks, {} requests",
        spec.workers, spec.capacity_blocks, spec.requests
    ));
    let mut gen = FleetGen::new(spec.clone(), &mut trace);
    for _ in 0..spec.requests {
        gen.request(&mut trace, true);
    }
    let pairs = gen.cached_pairs();
    (trace.finish(), pairs)
}
