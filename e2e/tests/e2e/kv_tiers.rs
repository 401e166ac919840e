//! KV tiers: how far each worker's match extends past its device overlap through its
//! host and disk tiers, measured by the collector's fold and checked against Dynamo
//! 1.6.1's own lower-tier indexers and tiered walk (the oracle's `dynamo_tiers`, on the
//! `dynamo-kv-router` crate) on the same records.
//!
//! The records are those an engine with a host and a disk tier publishes (vLLM's
//! offloading connector, SGLang's hierarchical cache): prompts stored on the device as
//! they are routed, blocks offloaded to host memory (`medium` CPU) while the device
//! still holds them, evicted from the device, spilled from host memory to disk (`DISK`)
//! and evicted from both, over three workers and conversations that share system
//! prompts; a seeded generator plays a few thousand such steps. Dynamo 1.6.1's mocker
//! publishes no lower tier (with `--num-host-blocks` its events carry no medium and the
//! router logs `host_pinned_blocks=0` for every choice), so the lab cannot drive this.
//!
//! Asserts, per decision: the device overlaps equal the oracle's; the chosen and best
//! workers' host and disk extensions equal the router's walk; the onloaded part of the
//! true delta is the chosen worker's extension within it. A fold that ignored the lower
//! tiers, matched them from the chain's start, or let the disk tier skip a gap in the
//! host tier would differ.

use kvscope_collector::fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_e2e::oracle::{dynamo_tiers, TieredMatch};
use kvscope_wire::hashing::{local_block_hashes, sequence_hashes, DYNAMO_HASH_SEED};
use kvscope_wire::LowerTierBlocks;
use kvscope_wire::{
    Envelope, KvEvent, KvEventBatch, Record, RoutingDecision, SequenceStatus, Tier, WorkerKey,
};
use std::collections::{HashMap, HashSet};

const BS: u32 = 16;
const WORKERS: u64 = 3;

/// xorshift64*: a fixed seed, so a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The engines' side: what each worker holds in each tier (engine hash = the block's
/// sequence hash, one hash per block across tiers, as vLLM's offloading keeps it), and
/// the records their publishers sent.
struct Fleet {
    held: HashMap<(Tier, u64), HashSet<u64>>,
    seq: HashMap<u64, u64>,
    records: Vec<Envelope>,
    t: u64,
}

impl Fleet {
    fn holds(&self, tier: Tier, w: u64, block: u64) -> bool {
        self.held
            .get(&(tier, w))
            .is_some_and(|s| s.contains(&block))
    }

    fn push(&mut self, record: Record) {
        self.t += 1_000_000;
        self.records.push(Envelope {
            agent: "engines".into(),
            observed_ns: self.t,
            record,
        });
    }

    fn publish(&mut self, w: u64, ev: KvEvent) {
        let seq = self.seq.entry(w).or_insert(0);
        let (n, status) = match *seq {
            0 => (0, SequenceStatus::First),
            n => (n, SequenceStatus::InOrder),
        };
        *seq += 1;
        self.push(Record::KvEvents(KvEventBatch {
            worker: key(w),
            publisher: format!("tcp://127.0.0.1:{}", 5500 + w),
            origin: Default::default(),
            seq: n,
            sequence: status,
            engine_ts: 0.0,
            events: vec![ev],
        }));
    }

    /// `w` stores `chain[from..to]` (tokens `tokens`) in `tier`, chained on the block
    /// before it.
    fn store(&mut self, tier: Tier, w: u64, chain: &[u64], tokens: &[u32], from: usize, to: usize) {
        let set = self.held.entry((tier, w)).or_default();
        set.extend(&chain[from..to]);
        self.publish(
            w,
            KvEvent::BlockStored {
                block_hashes: chain[from..to].to_vec(),
                parent_block_hash: from.checked_sub(1).map(|p| chain[p]),
                token_ids: tokens[from * BS as usize..to * BS as usize].to_vec(),
                block_size: BS,
                local_hashes: None,
                lora_name: None,
                medium: medium(tier),
                cache_salt: None,
            },
        );
    }

    fn remove(&mut self, tier: Tier, w: u64, blocks: Vec<u64>) {
        if blocks.is_empty() {
            return;
        }
        let set = self.held.entry((tier, w)).or_default();
        for b in &blocks {
            set.remove(b);
        }
        self.publish(
            w,
            KvEvent::BlockRemoved {
                block_hashes: blocks,
                medium: medium(tier),
            },
        );
    }

    /// How many leading blocks of `chain` `w` holds in `tier`.
    fn prefix(&self, tier: Tier, w: u64, chain: &[u64]) -> usize {
        chain
            .iter()
            .take_while(|b| self.holds(tier, w, **b))
            .count()
    }
}

fn medium(tier: Tier) -> Option<String> {
    match tier {
        Tier::Device => None,
        Tier::Host => Some("CPU".into()),
        Tier::Disk => Some("DISK".into()),
    }
}

fn key(w: u64) -> WorkerKey {
    WorkerKey {
        worker_id: w,
        dp_rank: 0,
    }
}

/// The seeded stream: `steps` engine and router actions.
fn tiered_stream(seed: u64, steps: usize) -> Vec<Envelope> {
    let mut rng = Rng(seed);
    let mut fleet = Fleet {
        held: HashMap::new(),
        seq: HashMap::new(),
        records: Vec::new(),
        t: 0,
    };
    // Twelve conversations over three system prompts of three blocks each.
    let mut convs: Vec<Vec<u32>> = (0..12u32)
        .map(|c| {
            let family = c % 3;
            (0..3 * BS)
                .map(|i| family * 1_000_000 + i)
                .chain((0..BS).map(|i| 50_000_000 + c * 100_000 + i))
                .collect()
        })
        .collect();
    let mut requests = 0;
    for _ in 0..steps {
        let c = rng.below(convs.len() as u64) as usize;
        let w = 1 + rng.below(WORKERS);
        let action = rng.below(12);
        if action < 4 {
            // A turn: the prompt grows, the router sends it to `w`, which stores on its
            // device what it did not hold.
            if rng.below(2) == 0 {
                let n = convs[c].len() as u32;
                let grow = BS * (1 + rng.below(2) as u32);
                convs[c].extend((0..grow).map(|i| 90_000_000 + c as u32 * 1_000_000 + n + i));
            }
        }
        let tokens = convs[c].clone();
        let chain = sequence_hashes(&local_block_hashes(&tokens, BS as usize, DYNAMO_HASH_SEED));
        let device = fleet.prefix(Tier::Device, w, &chain);
        match action {
            0..=3 => {
                requests += 1;
                fleet.push(Record::Decision(RoutingDecision {
                    tenant: None,
                    model: None,
                    request_id: format!("r{requests}"),
                    worker: key(w),
                    isl_tokens: tokens.len() as u64,
                    block_size: BS,
                    local_hashes: local_block_hashes(&tokens, BS as usize, DYNAMO_HASH_SEED),
                    sequence_hashes: None,
                    worker_type: None,
                    router_mode: Some("kv".into()),
                    clock_behind_ms: None,
                    selection: Default::default(),
                    trace: None,
                }));
                if device < chain.len() {
                    fleet.store(Tier::Device, w, &chain, &tokens, device, chain.len());
                }
            }
            4..=5 => {
                // Offload a run of device blocks not yet in host memory.
                if device == 0 {
                    continue;
                }
                let from = rng.below(device as u64) as usize;
                let to = (from..device)
                    .take_while(|i| !fleet.holds(Tier::Host, w, chain[*i]))
                    .last()
                    .map_or(from, |i| i + 1);
                if to > from {
                    fleet.store(Tier::Host, w, &chain, &tokens, from, to);
                }
            }
            6..=7 => {
                // The device evicts the tail of what it holds of this conversation, past
                // the shared system prompt: an engine evicts a chain's last blocks
                // first (vLLM frees a request's blocks in reverse order), never a block
                // whose descendants it keeps.
                if device <= 3 {
                    continue;
                }
                let from = 3 + rng.below(device as u64 - 2) as usize;
                fleet.remove(Tier::Device, w, chain[from..device].to_vec());
            }
            8 => {
                // Host memory spills a run to disk: stored there, removed from host.
                let Some(from) = (0..chain.len()).find(|i| {
                    fleet.holds(Tier::Host, w, chain[*i])
                        && !fleet.holds(Tier::Disk, w, chain[*i])
                        && rng.below(3) == 0
                }) else {
                    continue;
                };
                let parent_held = from == 0
                    || [Tier::Device, Tier::Host, Tier::Disk]
                        .iter()
                        .any(|t| fleet.holds(*t, w, chain[from - 1]));
                if !parent_held {
                    continue;
                }
                let to = (from..chain.len())
                    .take_while(|i| {
                        fleet.holds(Tier::Host, w, chain[*i])
                            && !fleet.holds(Tier::Disk, w, chain[*i])
                    })
                    .last()
                    .map_or(from, |i| i + 1);
                fleet.store(Tier::Disk, w, &chain, &tokens, from, to);
                fleet.remove(Tier::Host, w, chain[from..to].to_vec());
            }
            9..=10 => {
                // Host memory or disk evicts some of this conversation's blocks.
                let tier = if action == 9 { Tier::Host } else { Tier::Disk };
                let gone: Vec<u64> = chain
                    .iter()
                    .copied()
                    .filter(|b| fleet.holds(tier, w, *b) && rng.below(3) == 0)
                    .collect();
                fleet.remove(tier, w, gone);
            }
            _ => {}
        }
    }
    fleet.records
}

#[test]
fn lower_tier_extensions_equal_dynamos_tiered_walk() {
    let (mut decisions, mut extended, mut onloaded) = (0, 0, 0);
    for seed in [0x9e37_79b9_7f4a_7c15, 7, 2026] {
        let records = tiered_stream(seed, 3_000);
        let want = dynamo_tiers(&records);
        let mut fold = FleetAnalyzer::new(AnalyzerConfig::default());
        let verdicts: Vec<_> = records.iter().filter_map(|e| fold.apply(e)).collect();
        assert_eq!(verdicts.len(), want.len(), "a verdict per decision");
        let c = fold.counters();
        assert!(c.lower_tier_stored_blocks > 0 && c.lower_tier_removed_blocks > 0);
        assert_eq!(
            (
                c.unknown_parent_events,
                c.unknown_medium_events,
                c.lower_tier_unknown_blocks
            ),
            (0, 0, 0),
            "every lower-tier event applied"
        );
        for (v, (id, tiers)) in verdicts.iter().zip(&want) {
            assert_eq!(&v.request_id, id);
            let device: std::collections::BTreeMap<WorkerKey, u32> = tiers
                .iter()
                .filter(|(_, m)| m.device > 0)
                .map(|(w, m)| (*w, m.device))
                .collect();
            assert_eq!(v.overlaps, device, "{id}: device overlaps");
            let lower = |w: &WorkerKey| {
                let m: TieredMatch = tiers.get(w).copied().unwrap_or_default();
                LowerTierBlocks {
                    host_blocks: m.host,
                    disk_blocks: m.disk,
                }
            };
            assert_eq!(
                v.chosen_lower_tiers,
                lower(&v.chosen),
                "{id}: chosen worker's tiers"
            );
            assert_eq!(
                v.best_lower_tiers,
                lower(&v.best),
                "{id}: best worker's tiers"
            );
            let gap = v.best_overlap_blocks - v.chosen_overlap_blocks;
            assert_eq!(
                v.onload_delta_tokens,
                u64::from(lower(&v.chosen).total().min(gap)) * u64::from(BS),
                "{id}: onloaded part of the true delta"
            );
            decisions += 1;
            extended +=
                usize::from(!v.chosen_lower_tiers.is_empty() || !v.best_lower_tiers.is_empty());
            onloaded += usize::from(v.onload_delta_tokens > 0);
        }
    }
    eprintln!(
        "{decisions} decisions, {extended} with a lower-tier extension for the chosen or best \
         worker, {onloaded} with an onloaded part of the true delta: all equal to Dynamo's walk"
    );
    // The streams exercise what is checked.
    assert!(
        extended > decisions / 10 && onloaded > 0,
        "{extended} / {onloaded}"
    );
}
