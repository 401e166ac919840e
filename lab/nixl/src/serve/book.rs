//! What one engine holds, from its own KV events: every cached block by its Dynamo
//! sequence hash (the name migration directives use), with the engine's block hash and
//! the block's tokens (what a target publishes once the block has landed). Pure: events
//! in, lookups out; unit-tested here.

use std::collections::HashMap;

use kvscope_wire::hashing::{chain_hash, local_block_hashes, seed_for_lora};
use kvscope_wire::{KvEvent, SequenceHash};

/// One cached block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BookBlock {
    /// The engine's block hash (what its KV events name the block by).
    pub engine_hash: u64,
    /// The block's tokens.
    pub tokens: Vec<u32>,
}

/// Events the book could not apply, by reason (counted, never silently dropped).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct BookFaults {
    /// `BlockStored` naming a parent the book does not hold (its blocks are skipped:
    /// their sequence hashes cannot be computed).
    pub unknown_parent: u64,
    /// `BlockStored` with fewer full blocks of tokens than block hashes (the extra
    /// hashes are skipped).
    pub missing_tokens: u64,
    /// `BlockRemoved` of a block the book does not hold.
    pub unknown_removed: u64,
}

/// The blocks one engine holds.
#[derive(Debug, Default)]
pub struct BlockBook {
    by_seq: HashMap<SequenceHash, BookBlock>,
    seq_of_engine: HashMap<u64, SequenceHash>,
    /// Events applied.
    pub events: u64,
    /// What could not be applied.
    pub faults: BookFaults,
}

impl BlockBook {
    pub fn new() -> Self {
        Self::default()
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.by_seq.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_seq.is_empty()
    }

    /// The block with this sequence hash, if held.
    pub fn get(&self, seq: SequenceHash) -> Option<&BookBlock> {
        self.by_seq.get(&seq)
    }

    /// Apply one event of the engine's.
    pub fn apply(&mut self, event: &KvEvent) {
        self.events += 1;
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_name,
                ..
            } => {
                let mut parent = match parent_block_hash {
                    None => None,
                    Some(p) => match self.seq_of_engine.get(p) {
                        Some(s) => Some(*s),
                        None => {
                            self.faults.unknown_parent += 1;
                            return;
                        }
                    },
                };
                let bs = (*block_size).max(1) as usize;
                let locals = local_block_hashes(token_ids, bs, seed_for_lora(lora_name.as_deref()));
                if locals.len() < block_hashes.len() {
                    self.faults.missing_tokens += 1;
                }
                for (i, (engine, local)) in block_hashes.iter().zip(&locals).enumerate() {
                    let seq = chain_hash(parent, *local);
                    if let Some(old) = self.seq_of_engine.insert(*engine, seq) {
                        if old != seq {
                            self.by_seq.remove(&old);
                        }
                    }
                    self.by_seq.insert(
                        seq,
                        BookBlock {
                            engine_hash: *engine,
                            tokens: token_ids[i * bs..(i + 1) * bs].to_vec(),
                        },
                    );
                    parent = Some(seq);
                }
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for engine in block_hashes {
                    match self.seq_of_engine.remove(engine) {
                        Some(seq) => {
                            self.by_seq.remove(&seq);
                        }
                        None => self.faults.unknown_removed += 1,
                    }
                }
            }
            KvEvent::AllBlocksCleared => {
                self.by_seq.clear();
                self.seq_of_engine.clear();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::hashing::DYNAMO_HASH_SEED;
    use kvscope_wire::sequence_hashes;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: 2,
            local_hashes: None,
            lora_name: None,
            medium: None,
            cache_salt: None,
        }
    }

    #[test]
    fn blocks_are_found_by_the_sequence_hash_the_router_computes() {
        let toks = [1, 2, 3, 4, 5, 6];
        let chain = sequence_hashes(&local_block_hashes(&toks, 2, DYNAMO_HASH_SEED));
        let mut b = BlockBook::new();
        b.apply(&stored(&[10, 11], None, &toks[..4]));
        b.apply(&stored(&[12], Some(11), &toks[4..]));
        assert_eq!(b.len(), 3);
        assert_eq!(
            b.get(chain[2]),
            Some(&BookBlock {
                engine_hash: 12,
                tokens: vec![5, 6]
            })
        );
        b.apply(&KvEvent::BlockRemoved {
            block_hashes: vec![11, 99],
            medium: None,
        });
        assert!(b.get(chain[1]).is_none());
        assert_eq!(b.faults.unknown_removed, 1);
        // A store under a parent the book no longer holds is counted, not guessed.
        b.apply(&stored(&[13], Some(11), &[7, 8]));
        assert_eq!(b.faults.unknown_parent, 1);
        assert_eq!(b.len(), 2);
        b.apply(&stored(&[14, 15], None, &[1, 2]));
        assert_eq!(b.faults.missing_tokens, 1);
        b.apply(&KvEvent::AllBlocksCleared);
        assert!(b.is_empty());
        assert_eq!(b.events, 6);
    }
}
