//! Dynamo-compatible block hashing.
//!
//! The collector keys every worker's cached blocks by the same hashes Dynamo's KV router
//! uses, so overlaps computed from engine events line up with the router's
//! `local_hashes`: a block's *local* hash is xxh3-64 (seed 1337) over its token ids as
//! little-endian u32; a block's *sequence* hash chains the previous sequence hash with
//! the local hash, so it identifies the whole prefix up to and including that block.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Seed Dynamo uses for block hashes without a LoRA adapter.
pub const DYNAMO_HASH_SEED: u64 = 1337;

/// Hash of one full block's tokens, independent of what precedes it.
pub type LocalBlockHash = u64;
/// Hash of a block together with its whole prefix.
pub type SequenceHash = u64;

/// The seed for a LoRA adapter: Dynamo offsets the base seed by the adapter name's hash.
pub fn seed_for_lora(lora_name: Option<&str>) -> u64 {
    seed_for(None, lora_name)
}

/// The seed of a block's identity: Dynamo offsets the base seed by the LoRA adapter
/// name's hash and, apart from it (another inner seed), by the cache salt's (the
/// tenant's namespace), so blocks of equal tokens under another adapter or salt hash
/// apart. Empty names are none.
pub fn seed_for(cache_salt: Option<&str>, lora_name: Option<&str>) -> u64 {
    let mut seed = DYNAMO_HASH_SEED;
    if let Some(name) = lora_name.filter(|n| !n.is_empty()) {
        seed = seed.wrapping_add(xxh3_64(name.as_bytes()));
    }
    if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxhash_rust::xxh3::xxh3_64_with_seed(salt.as_bytes(), 1));
    }
    seed
}

/// Local hash of one block of token ids.
pub fn local_block_hash(tokens: &[u32], seed: u64) -> LocalBlockHash {
    hash_in(&mut Vec::with_capacity(tokens.len() * 4), tokens, seed)
}

/// [`local_block_hash`] with the tokens' bytes laid out in `bytes` (cleared first), so
/// that hashing a store's blocks takes one buffer, not one per block.
fn hash_in(bytes: &mut Vec<u8>, tokens: &[u32], seed: u64) -> LocalBlockHash {
    bytes.clear();
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(bytes, seed)
}

/// Sequence hash of a block whose parent has sequence hash `parent` (None for the first
/// block of a sequence, whose sequence hash is its local hash).
pub fn chain_hash(parent: Option<SequenceHash>, local: LocalBlockHash) -> SequenceHash {
    match parent {
        None => local,
        Some(p) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&p.to_le_bytes());
            bytes[8..].copy_from_slice(&local.to_le_bytes());
            xxh3_64_with_seed(&bytes, DYNAMO_HASH_SEED)
        }
    }
}

/// Sequence hashes for a chain of local hashes starting at the root.
pub fn sequence_hashes(locals: &[LocalBlockHash]) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(locals.len());
    let mut parent = None;
    for &l in locals {
        let s = chain_hash(parent, l);
        out.push(s);
        parent = Some(s);
    }
    out
}

/// Local hashes of every *full* block in `tokens`; a trailing partial block is ignored,
/// as Dynamo ignores it.
pub fn local_block_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<LocalBlockHash> {
    local_block_hashes_with_media(tokens, block_size, seed, &[], MediaPlaceholders::default()).0
}

/// [`local_block_hashes`] of a store whose blocks hold multimodal objects (`media`: by
/// block index, ascending), those blocks hashed with them
/// ([`local_block_hash_with_media`]); and how many full blocks held objects.
pub fn local_block_hashes_with_media(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    media: &[(usize, Vec<u64>)],
    placeholders: MediaPlaceholders,
) -> (Vec<LocalBlockHash>, usize) {
    if block_size == 0 {
        return (Vec::new(), 0);
    }
    let mut bytes = Vec::with_capacity(block_size * 4);
    let mut next = media.iter().peekable();
    let mut held = 0;
    let hashes = tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(i, block)| {
            while next.next_if(|(at, _)| *at < i).is_some() {}
            match next.next_if(|(at, _)| *at == i) {
                Some((_, objects)) => {
                    held += 1;
                    local_block_hash_with_media(block, seed, objects, placeholders)
                }
                None => hash_in(&mut bytes, block, seed),
            }
        })
        .collect();
    (hashes, held)
}

/// The token ids a model's prompts hold where an image or a video goes (its
/// `config.json`'s `image_token_id`, and `video_token_id` or `video_token_index`): the
/// runs Dynamo's vLLM publisher rewrites to stand for the object they hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MediaPlaceholders {
    pub image: Option<u32>,
    pub video: Option<u32>,
}

/// The token that stands for multimodal object `object` (its routing hash) in a prompt:
/// Dynamo's frontend writes it over the object's placeholder run, and its publisher over
/// the engine's, so equal objects make equal blocks (SGLang's pad value: the hash's low
/// 30 bits past one million).
pub fn media_pad_token(object: u64) -> u32 {
    (1_000_000 + (object & ((1 << 30) - 1))) as u32
}

/// The local hash of a block holding (part of) the multimodal objects `objects`, in
/// their order in the prompt, as Dynamo 1.6's publisher hashes a vLLM store's block:
///
/// - with a video placeholder known, the block's placeholder runs are mapped to the
///   objects exactly (an image run is one object; consecutive video runs, split by
///   timestamps, one) and each run is written over with its object's pad token;
/// - else, with an image placeholder known and in the block, each image run in turn
///   takes the next object's pad token (the last object's past the end);
/// - where neither applies (no run, or runs that do not map one to one), the block's
///   tokens are hashed with the objects' hashes after them, sorted.
///
/// A block without objects is [`local_block_hash`]'s.
pub fn local_block_hash_with_media(
    tokens: &[u32],
    seed: u64,
    objects: &[u64],
    placeholders: MediaPlaceholders,
) -> LocalBlockHash {
    if objects.is_empty() {
        return local_block_hash(tokens, seed);
    }
    let padded = if placeholders.video.is_some() {
        pad_runs_exactly(tokens, placeholders, objects)
    } else {
        placeholders
            .image
            .filter(|i| tokens.contains(i))
            .map(|image| pad_image_runs(tokens, image, objects))
    };
    if let Some(t) = padded {
        return local_block_hash(&t, seed);
    }
    let mut sorted = objects.to_vec();
    sorted.sort_unstable();
    let mut bytes = Vec::with_capacity(tokens.len() * 4 + sorted.len() * 8);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    for o in sorted {
        bytes.extend_from_slice(&o.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, seed)
}

/// Each run of `image` tokens written over with the next object's pad token (the last
/// object's for runs past them).
fn pad_image_runs(tokens: &[u32], image: u32, objects: &[u64]) -> Vec<u32> {
    let mut out = tokens.to_vec();
    let mut run = 0usize;
    for i in 0..out.len() {
        if out[i] != image {
            continue;
        }
        if i > 0 && tokens[i - 1] == image {
            out[i] = out[i - 1];
            continue;
        }
        out[i] = media_pad_token(objects[run.min(objects.len() - 1)]);
        run += 1;
    }
    out
}

/// The placeholder runs mapped one to one onto `objects` (an image run is one object; a
/// video's consecutive runs one), each written over with its object's pad token; `None`
/// when there is no run, the counts differ, or one token stands for both.
fn pad_runs_exactly(
    tokens: &[u32],
    placeholders: MediaPlaceholders,
    objects: &[u64],
) -> Option<Vec<u32>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Kind {
        Image,
        Video,
    }
    if placeholders.image.is_some() && placeholders.image == placeholders.video {
        return None;
    }
    let kind = |t: u32| {
        if placeholders.image == Some(t) {
            Some(Kind::Image)
        } else if placeholders.video == Some(t) {
            Some(Kind::Video)
        } else {
            None
        }
    };
    // (start, end, object index) of each run.
    let mut runs = Vec::new();
    let (mut objects_seen, mut previous) = (0usize, None);
    let mut i = 0;
    while i < tokens.len() {
        let Some(k) = kind(tokens[i]) else {
            i += 1;
            continue;
        };
        let start = i;
        while i < tokens.len() && kind(tokens[i]) == Some(k) {
            i += 1;
        }
        if k == Kind::Image || previous != Some(Kind::Video) {
            objects_seen += 1;
        }
        previous = Some(k);
        runs.push((start, i, objects_seen - 1));
    }
    if runs.is_empty() || objects_seen != objects.len() {
        return None;
    }
    let mut out = tokens.to_vec();
    for (start, end, object) in runs {
        out[start..end].fill(media_pad_token(objects[object]));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_sequence_hash_is_the_local_hash() {
        let l = local_block_hash(&[1, 2, 3, 4], DYNAMO_HASH_SEED);
        assert_eq!(sequence_hashes(&[l])[0], l);
    }

    #[test]
    fn partial_blocks_are_ignored() {
        let h = local_block_hashes(&[1, 2, 3, 4, 5], 2, DYNAMO_HASH_SEED);
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn lora_changes_the_seed() {
        assert_eq!(seed_for_lora(None), DYNAMO_HASH_SEED);
        assert_eq!(seed_for_lora(Some("")), DYNAMO_HASH_SEED);
        assert_ne!(seed_for_lora(Some("adapter")), DYNAMO_HASH_SEED);
    }
}
