//! kvscope's block hashing (`kvscope_wire::hashing`) against the reference functions of
//! the real `dynamo-kv-router` 1.6.1 crate: the router's request-side hashing
//! (`compute_block_hash_for_seq`, `compute_seq_hash_for_block`, `compute_next_seq_hash`,
//! `TokensWithHashes`) and the event-side hashing Dynamo's vLLM event publisher uses
//! (`zmq_wire::create_stored_blocks`, which fills `tokens_hash` of every stored block).

use dynamo_kv_router::protocols::{
    compute_block_hash, compute_block_hash_for_seq, compute_next_seq_hash,
    compute_seq_hash_for_block, BlockHashOptions, LocalBlockHash, TokensWithHashes, XXH3_SEED,
};
use dynamo_kv_router::zmq_wire::create_stored_blocks;
use kvscope_wire::hashing::{
    chain_hash, local_block_hash, local_block_hashes, seed_for_lora, sequence_hashes,
    DYNAMO_HASH_SEED,
};
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

/// Deterministic pseudo-random token ids (splitmix64), spread over a 150k vocabulary so
/// that ids above 2^16 (which expose byte-order mistakes) occur.
fn tokens(n: usize, salt: u64) -> Vec<u32> {
    let mut x = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z % 151_936) as u32
        })
        .collect()
}

/// Token sequences covering: tiny/empty, exactly one block, partial trailing blocks,
/// multi-block prompts, extreme token values.
fn sequences() -> Vec<Vec<u32>> {
    vec![
        vec![],
        (0..15).collect(),
        (0..16).collect(),
        (0..17).collect(),
        tokens(41, 1),
        tokens(64, 2),
        tokens(100, 3),
        tokens(128, 4),
        tokens(1000, 5),
        tokens(4097, 6),
        vec![u32::MAX; 70],
        vec![0; 130],
    ]
}

const LORAS: [Option<&str>; 4] = [None, Some(""), Some("my-lora"), Some("adapter/ü-2")];
const BLOCK_SIZES: [u32; 4] = [16, 64, 1, 32];

fn dynamo_locals(tokens: &[u32], block_size: u32, lora: Option<&str>) -> Vec<u64> {
    compute_block_hash_for_seq(
        tokens,
        block_size,
        BlockHashOptions {
            lora_name: lora,
            ..Default::default()
        },
    )
    .into_iter()
    .map(|h| h.0)
    .collect()
}

#[test]
fn seed_constant_matches() {
    assert_eq!(DYNAMO_HASH_SEED, XXH3_SEED);
}

#[test]
fn single_block_hash_matches_compute_block_hash() {
    for seq in sequences() {
        let mut bytes = Vec::new();
        for t in &seq {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(
            local_block_hash(&seq, DYNAMO_HASH_SEED),
            compute_block_hash(&bytes).0,
            "tokens {:?}",
            &seq[..seq.len().min(8)]
        );
    }
}

#[test]
fn local_hashes_match_compute_block_hash_for_seq() {
    for seq in sequences() {
        for bs in BLOCK_SIZES {
            for lora in LORAS {
                let ours = local_block_hashes(&seq, bs as usize, seed_for_lora(lora));
                let theirs = dynamo_locals(&seq, bs, lora);
                assert_eq!(
                    ours,
                    theirs,
                    "len={} block_size={bs} lora={lora:?}",
                    seq.len()
                );
                assert_eq!(
                    ours.len(),
                    seq.len() / bs as usize,
                    "only full blocks count"
                );
            }
        }
    }
}

#[test]
fn lora_changes_hashes_and_empty_lora_does_not() {
    let seq = tokens(64, 9);
    let base = dynamo_locals(&seq, 16, None);
    assert_eq!(dynamo_locals(&seq, 16, Some("")), base);
    assert_ne!(dynamo_locals(&seq, 16, Some("my-lora")), base);
    assert_eq!(
        local_block_hashes(&seq, 16, seed_for_lora(Some("my-lora"))),
        dynamo_locals(&seq, 16, Some("my-lora"))
    );
}

#[test]
fn sequence_hashes_match_compute_seq_hash_for_block() {
    for seq in sequences() {
        for bs in BLOCK_SIZES {
            for lora in LORAS {
                let locals = dynamo_locals(&seq, bs, lora);
                let dyn_locals: Vec<LocalBlockHash> =
                    locals.iter().copied().map(LocalBlockHash).collect();
                let theirs = compute_seq_hash_for_block(&dyn_locals);
                let ours = sequence_hashes(&locals);
                assert_eq!(
                    ours,
                    theirs,
                    "len={} block_size={bs} lora={lora:?}",
                    seq.len()
                );
                if let Some(first) = locals.first() {
                    assert_eq!(ours[0], *first, "seq[0] is the local hash");
                }
            }
        }
    }
}

#[test]
fn chain_hash_matches_compute_next_seq_hash() {
    let locals = dynamo_locals(&tokens(640, 11), 64, None);
    let mut parent: Option<u64> = None;
    for &l in &locals {
        let ours = chain_hash(parent, l);
        let theirs = match parent {
            None => l,
            Some(p) => compute_next_seq_hash(p, LocalBlockHash(l)),
        };
        assert_eq!(ours, theirs);
        parent = Some(ours);
    }
    // Arbitrary values, including extremes.
    for (p, l) in [
        (0u64, 0u64),
        (u64::MAX, 1),
        (1, u64::MAX),
        (0xDEAD_BEEF, 0xFEED_FACE),
    ] {
        assert_eq!(
            chain_hash(Some(p), l),
            compute_next_seq_hash(p, LocalBlockHash(l))
        );
    }
}

#[test]
fn tokens_with_hashes_agrees() {
    for seq in sequences() {
        for bs in [16u32, 64] {
            for lora in [None, Some("my-lora")] {
                let mut twh = TokensWithHashes::new(seq.clone(), bs);
                if let Some(name) = lora {
                    twh = twh.with_lora_name(name.to_string());
                }
                let locals: Vec<u64> = twh
                    .get_or_compute_block_hashes()
                    .iter()
                    .map(|h| h.0)
                    .collect();
                let seqs = twh.get_or_compute_seq_hashes().to_vec();
                let ours = local_block_hashes(&seq, bs as usize, seed_for_lora(lora));
                assert_eq!(locals, ours, "len={} bs={bs} lora={lora:?}", seq.len());
                assert_eq!(seqs, sequence_hashes(&ours));
            }
        }
    }
}

/// The event side: Dynamo's publisher turns a vLLM `BlockStored` into
/// `KvCacheStoredBlockData { block_hash: engine hash, tokens_hash: local hash }`; the
/// `tokens_hash` must be what kvscope computes for the same block's token ids.
#[test]
fn event_side_tokens_hash_matches() {
    let warnings = Arc::new(AtomicU32::new(0));
    for (salt, bs) in [(21u64, 16u32), (22, 64)] {
        for lora in [None, Some("my-lora")] {
            let toks = tokens(bs as usize * 5, salt);
            let engine_hashes: Vec<u64> = (0..5).map(|i| 1000 + i).collect();
            let blocks = create_stored_blocks(
                bs,
                &toks,
                &vec![bs as u64; engine_hashes.len()],
                &engine_hashes,
                lora,
                None,
                &warnings,
                None,
                None,
                None,
                None,
            );
            let ours = local_block_hashes(&toks, bs as usize, seed_for_lora(lora));
            assert_eq!(blocks.len(), 5);
            for (i, b) in blocks.iter().enumerate() {
                assert_eq!(b.block_hash.0, engine_hashes[i], "engine hash kept as is");
                assert_eq!(b.tokens_hash.0, ours[i], "block {i} bs={bs} lora={lora:?}");
            }
        }
    }
}

/// Pinned values, so a silent change on either side shows up even if both moved.
#[test]
fn pinned_vectors() {
    let seq: Vec<u32> = (0..32).collect();
    let ours = local_block_hashes(&seq, 16, DYNAMO_HASH_SEED);
    let theirs = dynamo_locals(&seq, 16, None);
    assert_eq!(ours, theirs);
    assert_eq!(ours, vec![15310707395893867146, 15292316782987903195]);
    assert_eq!(
        sequence_hashes(&ours),
        vec![15310707395893867146, 13769157705258532664]
    );
}

/// A cache salt (Dynamo's cache namespace) seeds a block's identity apart from the LoRA
/// adapter: kvscope's `seed_for` against `compute_block_hash_for_seq` with both set.
#[test]
fn cache_salt_seeds_as_dynamo_namespaces_hashes() {
    use kvscope_wire::hashing::seed_for;
    for seq in sequences() {
        for bs in [16u32, 64] {
            for lora in LORAS {
                for salt in [None, Some(""), Some("tenant-a"), Some("tenant-b")] {
                    let theirs: Vec<u64> = compute_block_hash_for_seq(
                        &seq,
                        bs,
                        BlockHashOptions {
                            lora_name: lora,
                            cache_namespace: salt,
                            ..Default::default()
                        },
                    )
                    .into_iter()
                    .map(|h| h.0)
                    .collect();
                    let ours = local_block_hashes(&seq, bs as usize, seed_for(salt, lora));
                    assert_eq!(ours, theirs, "bs={bs} lora={lora:?} salt={salt:?}");
                }
            }
        }
    }
    // Another salt, another identity; no salt is the unsalted one.
    let seq = tokens(64, 9);
    let with = |salt| local_block_hashes(&seq, 16, seed_for(salt, None));
    assert_ne!(with(Some("tenant-a")), with(Some("tenant-b")));
    assert_ne!(with(Some("tenant-a")), with(None));
    assert_eq!(with(Some("")), with(None));
}
