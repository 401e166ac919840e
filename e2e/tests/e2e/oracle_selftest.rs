//! Hand-built records through the Dynamo oracle (tests/oracle), checking the obvious
//! overlaps: two workers, a shared prefix, a removal, a clear, an unknown parent, the
//! publisher's refcount dedup, a lower-tier store, and an engine restart.

use kvscope_e2e::oracle;

use std::collections::BTreeMap;

use kvscope_wire::hashing::{local_block_hashes, seed_for_lora, DYNAMO_HASH_SEED};
use kvscope_wire::{
    Envelope, KvEvent, KvEventBatch, Record, RoutingDecision, SequenceStatus, WorkerKey,
};
use oracle::{dynamo_overlaps, DynamoOracle};

const BS: u32 = 16;
const W1: WorkerKey = WorkerKey {
    worker_id: 1,
    dp_rank: 0,
};
const W2: WorkerKey = WorkerKey {
    worker_id: 2,
    dp_rank: 0,
};
const W2R1: WorkerKey = WorkerKey {
    worker_id: 2,
    dp_rank: 1,
};

fn toks(n_blocks: usize, salt: u32) -> Vec<u32> {
    (0..n_blocks as u32 * BS)
        .map(|i| i * 7 + salt * 100_000)
        .collect()
}

fn env(ns: u64, record: Record) -> Envelope {
    Envelope {
        agent: "test".into(),
        observed_ns: ns,
        record,
    }
}

fn batch(worker: WorkerKey, seq: u64, sequence: SequenceStatus, events: Vec<KvEvent>) -> Record {
    Record::KvEvents(KvEventBatch {
        worker,
        publisher: format!("tcp://127.0.0.1:{}", 5500 + worker.worker_id),
        origin: Default::default(),
        seq,
        sequence,
        engine_ts: seq as f64,
        events,
    })
}

/// Engine block hashes for a token chain: opaque to Dynamo, so anything unique works;
/// `tag` keeps different chains apart.
fn stored(tokens: &[u32], first_block: usize, tag: u64, parent: Option<u64>) -> KvEvent {
    let n = tokens.len() / BS as usize;
    KvEvent::BlockStored {
        block_hashes: (0..n)
            .map(|i| tag * 1000 + (first_block + i) as u64)
            .collect(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: BS,
        local_hashes: None,
        lora_name: None,
        medium: None,
        cache_salt: None,
    }
}

fn decision(id: &str, worker: WorkerKey, tokens: &[u32]) -> Record {
    Record::Decision(RoutingDecision {
        tenant: None,
        model: None,
        request_id: id.into(),
        worker,
        isl_tokens: tokens.len() as u64,
        block_size: BS,
        local_hashes: local_block_hashes(tokens, BS as usize, DYNAMO_HASH_SEED),
        sequence_hashes: None,
        worker_type: None,
        router_mode: Some("kv".into()),
        clock_behind_ms: None,
        selection: Default::default(),
        trace: None,
    })
}

fn m(pairs: &[(WorkerKey, u32)]) -> BTreeMap<WorkerKey, u32> {
    pairs.iter().copied().collect()
}

#[test]
fn shared_prefix_removal_and_clear() {
    let a = toks(4, 1); // blocks a0..a3
    let mut b = a[..2 * BS as usize].to_vec(); // shares a0, a1
    b.extend(toks(2, 2)); // then b2, b3

    let records = vec![
        // W1 caches all of a (engine hashes 1000..1003).
        env(
            1,
            batch(W1, 0, SequenceStatus::First, vec![stored(&a, 0, 1, None)]),
        ),
        // W2 caches a0,a1 then continues with b2,b3 in a second event of the same batch.
        env(
            2,
            batch(
                W2,
                0,
                SequenceStatus::First,
                vec![
                    stored(&a[..2 * BS as usize], 0, 1, None),
                    stored(&b[2 * BS as usize..], 2, 2, Some(1001)),
                ],
            ),
        ),
        env(3, decision("r-a", W1, &a)),
        env(4, decision("r-b", W2, &b)),
        // A request that shares only the first block with a.
        env(5, {
            let mut c = a[..BS as usize].to_vec();
            c.extend(toks(3, 3));
            decision("r-c", W1, &c)
        }),
        // A request nobody has.
        env(6, decision("r-none", W1, &toks(3, 4))),
        // W1 evicts a2: its coverage of a is now a0, a1.
        env(
            7,
            batch(
                W1,
                1,
                SequenceStatus::InOrder,
                vec![KvEvent::BlockRemoved {
                    block_hashes: vec![1002],
                    medium: None,
                }],
            ),
        ),
        env(8, decision("r-a-after-remove", W1, &a)),
        // W2 clears its whole cache.
        env(
            9,
            batch(
                W2,
                1,
                SequenceStatus::InOrder,
                vec![KvEvent::AllBlocksCleared],
            ),
        ),
        env(10, decision("r-b-after-clear", W2, &b)),
        env(11, decision("r-a-after-clear", W1, &a)),
    ];

    let got = dynamo_overlaps(&records);
    let want = vec![
        ("r-a".to_string(), m(&[(W1, 4), (W2, 2)])),
        ("r-b".to_string(), m(&[(W1, 2), (W2, 4)])),
        ("r-c".to_string(), m(&[(W1, 1), (W2, 1)])),
        ("r-none".to_string(), m(&[])),
        ("r-a-after-remove".to_string(), m(&[(W1, 2), (W2, 2)])),
        ("r-b-after-clear".to_string(), m(&[(W1, 2)])),
        ("r-a-after-clear".to_string(), m(&[(W1, 2)])),
    ];
    assert_eq!(got, want);
}

#[test]
fn unknown_parent_is_skipped_and_unknown_removal_is_harmless() {
    let a = toks(3, 5);
    let mut o = DynamoOracle::new();
    // A continuation whose parent W1 never stored: Dynamo skips the whole store.
    o.apply_batch(W1, &[stored(&a[BS as usize..], 1, 5, Some(5000))]);
    assert_eq!(o.counters.parent_not_found, 1);
    let hashes = local_block_hashes(&a, BS as usize, DYNAMO_HASH_SEED);
    assert_eq!(o.overlaps(&hashes), m(&[]));
    // Store the chain properly.
    o.apply_batch(W1, &[stored(&a, 0, 5, None)]);
    assert_eq!(o.overlaps(&hashes), m(&[(W1, 3)]));
    // Removing a block W1 never had: reported, nothing changes.
    o.apply_batch(
        W1,
        &[KvEvent::BlockRemoved {
            block_hashes: vec![987_654],
            medium: None,
        }],
    );
    assert_eq!(o.counters.block_not_found, 1);
    assert_eq!(o.overlaps(&hashes), m(&[(W1, 3)]));
    // Removing the first block truncates W1's whole chain.
    o.apply_batch(
        W1,
        &[KvEvent::BlockRemoved {
            block_hashes: vec![5000],
            medium: None,
        }],
    );
    assert_eq!(o.overlaps(&hashes), m(&[]));
}

#[test]
fn publisher_refcount_dedup_keeps_twice_stored_blocks() {
    let a = toks(2, 6);
    let hashes = local_block_hashes(&a, BS as usize, DYNAMO_HASH_SEED);
    let mut o = DynamoOracle::new();
    o.apply_batch(W1, &[stored(&a, 0, 6, None), stored(&a, 0, 6, None)]);
    assert_eq!(o.overlaps(&hashes), m(&[(W1, 2)]));
    let remove_second = KvEvent::BlockRemoved {
        block_hashes: vec![6001],
        medium: None,
    };
    // First removal only drops the refcount to 1: the publisher swallows it.
    o.apply_batch(W1, std::slice::from_ref(&remove_second));
    assert_eq!(o.counters.dedup_swallowed, 1);
    assert_eq!(o.overlaps(&hashes), m(&[(W1, 2)]));
    // Second removal reaches the router.
    o.apply_batch(W1, &[remove_second]);
    assert_eq!(o.overlaps(&hashes), m(&[(W1, 1)]));
}

#[test]
fn dp_ranks_are_separate_caches_and_lower_tiers_do_not_count() {
    let a = toks(3, 7);
    let hashes = local_block_hashes(&a, BS as usize, DYNAMO_HASH_SEED);
    let mut o = DynamoOracle::new();
    o.apply_batch(W2, &[stored(&a, 0, 7, None)]);
    o.apply_batch(W2R1, &[stored(&a[..BS as usize], 0, 7, None)]);
    // A CPU-tier copy on W1 is not in the primary tree.
    o.apply_batch(
        W1,
        &[KvEvent::BlockStored {
            block_hashes: vec![7000, 7001, 7002],
            parent_block_hash: None,
            token_ids: a.clone(),
            block_size: BS,
            local_hashes: None,
            lora_name: None,
            medium: Some("CPU".into()),
            cache_salt: None,
        }],
    );
    assert_eq!(o.counters.lower_tier, 1);
    assert_eq!(o.overlaps(&hashes), m(&[(W2, 3), (W2R1, 1)]));
    // Clearing rank 1 leaves rank 0 alone.
    o.apply_batch(W2R1, &[KvEvent::AllBlocksCleared]);
    assert_eq!(o.overlaps(&hashes), m(&[(W2, 3)]));
}

#[test]
fn lora_blocks_only_match_lora_requests() {
    let a = toks(2, 8);
    let mut o = DynamoOracle::new();
    o.apply_batch(
        W1,
        &[KvEvent::BlockStored {
            block_hashes: vec![8000, 8001],
            parent_block_hash: None,
            token_ids: a.clone(),
            block_size: BS,
            local_hashes: None,
            lora_name: Some("my-lora".into()),
            medium: Some("GPU".into()),
            cache_salt: None,
        }],
    );
    let base = local_block_hashes(&a, BS as usize, DYNAMO_HASH_SEED);
    let lora = local_block_hashes(&a, BS as usize, seed_for_lora(Some("my-lora")));
    assert_eq!(o.overlaps(&base), m(&[]));
    assert_eq!(o.overlaps(&lora), m(&[(W1, 2)]));
}

#[test]
fn partial_trailing_block_and_wrong_block_size_are_not_indexed() {
    let a = toks(3, 9);
    let hashes = local_block_hashes(&a, BS as usize, DYNAMO_HASH_SEED);
    let mut o = DynamoOracle::new();
    // Three engine hashes but tokens for only 2.5 blocks: the third block is dropped.
    o.apply_batch(
        W1,
        &[KvEvent::BlockStored {
            block_hashes: vec![9000, 9001, 9002],
            parent_block_hash: None,
            token_ids: a[..(2 * BS + BS / 2) as usize].to_vec(),
            block_size: BS,
            local_hashes: None,
            lora_name: None,
            medium: None,
            cache_salt: None,
        }],
    );
    assert_eq!(o.overlaps(&hashes), m(&[(W1, 2)]));
    // A later event with another block size on the same publisher: Dynamo's normalizer
    // keeps the first size and publishes no blocks of the other.
    o.apply_batch(
        W1,
        &[KvEvent::BlockStored {
            block_hashes: vec![9002],
            parent_block_hash: Some(9001),
            token_ids: a[(2 * BS) as usize..].to_vec(),
            block_size: BS / 2,
            local_hashes: None,
            lora_name: None,
            medium: None,
            cache_salt: None,
        }],
    );
    assert_eq!(o.overlaps(&hashes), m(&[(W1, 2)]));
}

#[test]
fn engine_restart_reset_does_not_clear() {
    let a = toks(2, 10);
    let records = vec![
        env(
            1,
            batch(W1, 5, SequenceStatus::First, vec![stored(&a, 0, 10, None)]),
        ),
        // The engine restarted (sequence went back to 0) but sent no AllBlocksCleared:
        // Dynamo's publisher ignores the sequence number, so W1 keeps its blocks.
        env(2, batch(W1, 0, SequenceStatus::Reset, vec![])),
        env(3, decision("r", W1, &a)),
    ];
    assert_eq!(
        dynamo_overlaps(&records),
        vec![("r".to_string(), m(&[(W1, 2)]))]
    );
}

/// Agents send an engine's tokens as their blocks' local hashes (`KvEvent::hash_tokens`);
/// the oracle then runs Dynamo's conversion on placeholder tokens. For stores with a
/// partial trailing block, a second block size, a LoRA adapter, a repeated hash, a CPU
/// tier, removals and a clear, Dynamo's overlaps from the hashes equal those from the
/// tokens, and the collector's from the hashes equal both.
#[test]
fn hashed_tokens_give_dynamo_s_overlaps() {
    let a = toks(4, 10);
    let c = toks(2, 11);
    let store = |hashes: Vec<u64>, parent, tokens: &[u32], bs, lora: Option<&str>, medium| {
        KvEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: bs,
            local_hashes: None,
            lora_name: lora.map(str::to_string),
            medium,
            cache_salt: None,
        }
    };
    let lora_decision = |id: &str, tokens: &[u32]| {
        let Record::Decision(mut d) = decision(id, W2, tokens) else {
            unreachable!()
        };
        d.local_hashes = local_block_hashes(tokens, BS as usize, seed_for_lora(Some("ad")));
        Record::Decision(d)
    };
    let half = (2 * BS + BS / 2) as usize;
    let events = [
        (W1, vec![stored(&a, 0, 10, None)]),
        // 2.5 blocks of tokens for three hashes; then a store of another block size.
        (
            W2,
            vec![store(
                vec![11_000, 11_001, 11_002],
                None,
                &a[..half],
                BS,
                None,
                None,
            )],
        ),
        (
            W2,
            vec![store(
                vec![11_003],
                Some(11_001),
                &a[2 * BS as usize..],
                BS / 2,
                None,
                None,
            )],
        ),
        // A LoRA adapter's blocks, a repeated hash (dropped whole), a CPU-tier copy.
        (
            W2,
            vec![store(vec![12_000, 12_001], None, &c, BS, Some("ad"), None)],
        ),
        (
            W1,
            vec![store(vec![13_000, 13_000], None, &c, BS, None, None)],
        ),
        (
            W2R1,
            vec![store(
                vec![14_000, 14_001],
                None,
                &c,
                BS,
                None,
                Some("CPU".into()),
            )],
        ),
        (
            W1,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![10_003],
                medium: None,
            }],
        ),
    ];
    let mut records: Vec<Envelope> = Vec::new();
    for (i, (w, evs)) in events.into_iter().enumerate() {
        let sequence = if i == 0 {
            SequenceStatus::First
        } else {
            SequenceStatus::InOrder
        };
        records.push(env(i as u64 + 1, batch(w, i as u64, sequence, evs)));
    }
    for (i, r) in [
        decision("a", W1, &a),
        decision("c", W1, &c),
        lora_decision("c-lora", &c),
        decision("a-again", W2, &a),
    ]
    .into_iter()
    .enumerate()
    {
        records.push(env(100 + i as u64, r));
    }
    records.push(env(
        200,
        batch(
            W2,
            9,
            SequenceStatus::InOrder,
            vec![KvEvent::AllBlocksCleared],
        ),
    ));
    records.push(env(201, decision("after-clear", W1, &a)));

    let hashed: Vec<Envelope> = records
        .iter()
        .cloned()
        .map(|mut e| {
            if let Record::KvEvents(b) = &mut e.record {
                b.events.iter_mut().for_each(KvEvent::hash_tokens);
            }
            e
        })
        .collect();
    assert_ne!(hashed, records, "the stores carry hashes now");
    let from_tokens = dynamo_overlaps(&records);
    assert_eq!(dynamo_overlaps(&hashed), from_tokens);
    let found: Vec<_> = from_tokens.iter().map(|(_, o)| o.clone()).collect();
    assert_eq!(
        found,
        vec![
            m(&[(W1, 3), (W2, 2)]),
            m(&[]),
            m(&[(W2, 2)]),
            m(&[(W1, 3), (W2, 2)]),
            m(&[(W1, 3)]),
        ],
        "{from_tokens:?}"
    );
    let mut analyzer = kvscope_collector::fold::analyzer::FleetAnalyzer::new(Default::default());
    let verdicts: Vec<_> = hashed.iter().filter_map(|e| analyzer.apply(e)).collect();
    oracle::assert_overlaps_equal(&verdicts, &records);
}

/// Two tenants' equal prompts under their cache salts (SGLang's `cache_salt`, Dynamo's
/// cache namespace): Dynamo's publisher seeds each store's hashes with its salt, so a
/// request of one tenant (hashed with its salt, as the router hashes it) overlaps only
/// that tenant's blocks; the collector's fold credits the same, never across salts.
#[test]
fn cache_salts_keep_equal_prompts_apart() {
    use kvscope_wire::hashing::seed_for;
    let a = toks(4, 1);
    let salted = |tag: u64, salt: &str| {
        let mut ev = stored(&a, 0, tag, None);
        if let KvEvent::BlockStored { cache_salt, .. } = &mut ev {
            *cache_salt = Some(salt.into());
        }
        ev
    };
    let request = |id: &str, worker: WorkerKey, salt: Option<&str>| {
        let Record::Decision(mut d) = decision(id, worker, &a) else {
            unreachable!()
        };
        d.local_hashes = local_block_hashes(&a, BS as usize, seed_for(salt, None));
        Record::Decision(d)
    };
    let records = vec![
        env(
            1,
            batch(W1, 0, SequenceStatus::First, vec![salted(1, "tenant-a")]),
        ),
        env(
            2,
            batch(W2, 0, SequenceStatus::First, vec![salted(2, "tenant-b")]),
        ),
        env(3, request("ra", W2, Some("tenant-a"))),
        env(4, request("rb", W1, Some("tenant-b"))),
        env(5, request("r", W1, None)),
    ];
    let want = vec![
        ("ra".to_string(), m(&[(W1, 4)])),
        ("rb".to_string(), m(&[(W2, 4)])),
        ("r".to_string(), m(&[])),
    ];
    assert_eq!(dynamo_overlaps(&records), want, "Dynamo's view");
    let mut fold = kvscope_collector::fold::analyzer::FleetAnalyzer::new(Default::default());
    let verdicts: Vec<_> = records.iter().filter_map(|e| fold.apply(e)).collect();
    let got: Vec<(String, BTreeMap<WorkerKey, u32>)> = verdicts
        .iter()
        .map(|v| (v.request_id.clone(), v.overlaps.clone()))
        .collect();
    assert_eq!(got, want, "the fold's view");
    // Each request's tenant, and the figures per tenant summing to the fleet's.
    let tenants: Vec<Option<&str>> = verdicts.iter().map(|v| v.tenant.as_deref()).collect();
    assert_eq!(tenants, [Some("tenant-a"), Some("tenant-b"), None]);
    let t = &fold.totals().tenants;
    let spills: u64 = t.tenants.values().map(|f| f.spills).sum::<u64>() + t.unsalted.spills;
    let requests: u64 = t.tenants.values().map(|f| f.requests).sum::<u64>() + t.unsalted.requests;
    assert_eq!(
        (requests, spills),
        (3, verdicts.iter().filter(|v| v.spill).count() as u64)
    );
    assert_eq!(
        (t.tenants["tenant-a"].spills, t.tenants["tenant-b"].spills),
        (1, 1)
    );
}
