//! Per-request spill verdicts: the measurements of ARCHITECTURE.md ("The measurements")
//! for one routed request.

use crate::fleet_index::FleetIndex;
use kvscope_wire::{RoutingDecision, SequenceHash, WorkerKey};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What the collector concludes about one routed request, from the mirror's state when
/// the decision arrived.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpillVerdict {
    pub request_id: String,
    /// The model the request was for (the chosen worker's, from discovery): the best
    /// worker is only ever one serving it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Judged while a worker it could have gone to had an incomplete mirror (events lost
    /// for good): its overlaps may be short.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incomplete_mirror: bool,
    /// Its whole prompt was cached on the chosen worker by a store just before it: most
    /// likely judged after its own prefill (clock skew between router and engines).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub after_own_prefill: bool,
    /// Every router log line reached the agent at least this late (ms) for seconds
    /// before it: the router's clock may be behind, so it may be judged before events
    /// it depends on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_behind_ms: Option<u64>,
    /// The request's place in the router's own traces (from the decision): the verdict
    /// span is a child of that span, and exemplars name that trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<kvscope_wire::TraceContext>,
    /// Found later to have been judged before a KV event it depends on (one stamped
    /// earlier, applied after it): its overlaps may be short.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub judged_before_event: bool,
    pub decided_ns: u64,
    pub chosen: WorkerKey,
    pub chosen_overlap_blocks: u32,
    /// The worker with the longest cached prefix (the chosen one on a tie).
    pub best: WorkerKey,
    pub best_overlap_blocks: u32,
    pub block_size: u32,
    pub isl_tokens: u64,
    /// Whether chosen ≠ best by at least the configured number of blocks.
    pub spill: bool,
    /// overlap_best × block_size: the fork's `migratable_tokens`, an upper bound.
    pub upper_bound_tokens: u64,
    /// (overlap_best − overlap_chosen) × block_size: what a migration would really save.
    pub true_delta_tokens: u64,
    /// The part of the true delta in blocks the best worker generated while decoding
    /// (output blocks): what a router blind to output blocks cannot see.
    #[serde(default)]
    pub generated_delta_tokens: u64,
    /// isl − overlap_chosen × block_size: the prefill the chosen worker has to compute.
    pub uncached_prefill_tokens: u64,
    /// Every worker's non-zero overlap, in blocks.
    #[serde(with = "kvscope_wire::worker_map")]
    pub overlaps: BTreeMap<WorkerKey, u32>,
    /// When a live collector had this verdict ready to serve (UNIX ns, its own clock):
    /// stamped by the bus reader as it applies the decision. A replay leaves it out, so
    /// its figures never depend on when it runs. `kvscope-bench freshness` reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available_ns: Option<u64>,
    /// The Dynamo sequence hashes of the true delta's blocks — chain positions
    /// `chosen_overlap_blocks .. best_overlap_blocks`, in order: what a migration moves.
    /// Block positions alone do not let the target name what it received.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub delta_block_hashes: Vec<SequenceHash>,
    /// The sequence hash of the block the delta extends (the chosen worker's last cached
    /// block of the chain); none when the delta starts the chain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_parent_hash: Option<SequenceHash>,
    /// What NIXL moved for this request as the node agents' probes saw it (transfers
    /// whose notification named it: a migration's READs), joined when the verdict is
    /// served (`/api/verdicts`); the fold leaves it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nixl: Option<kvscope_wire::nixl::RequestNixl>,
}

impl SpillVerdict {
    /// The verdict's trace id, lowercase hex: the router's trace of the request when
    /// known, else the one derived from the request id.
    pub fn trace_id_hex(&self) -> String {
        match &self.trace {
            Some(t) => t.trace_id.clone(),
            None => kvscope_otlp::trace_id_hex(&self.request_id),
        }
    }

    /// Judge `decision` against the mirror. `min_blocks` is the smallest overlap gap that
    /// counts as a spill.
    pub fn judge(
        index: &FleetIndex,
        decision: &RoutingDecision,
        decided_ns: u64,
        min_blocks: u32,
    ) -> Self {
        let matched = match &decision.sequence_hashes {
            Some(seq) => index.match_seq_chain(seq),
            None => index.match_chain(&decision.local_hashes),
        };
        Self::judge_matched(
            index,
            decision,
            &matched.chain,
            matched.overlaps,
            decided_ns,
            min_blocks,
        )
    }

    /// [`Self::judge`] with the decision's chain already matched against the mirror
    /// ([`FleetIndex::match_chain`]), for a caller that keeps the chain.
    pub fn judge_matched(
        index: &FleetIndex,
        decision: &RoutingDecision,
        chain: &[SequenceHash],
        overlaps: BTreeMap<WorkerKey, u32>,
        decided_ns: u64,
        min_blocks: u32,
    ) -> Self {
        let chosen = decision.worker;
        let chosen_overlap = overlaps.get(&chosen).copied().unwrap_or(0);
        // Best: the longest overlap; the chosen worker wins ties, then the lowest key, so
        // a verdict never calls a tie a spill and never depends on map order.
        let (best, best_overlap) = overlaps
            .iter()
            .filter(|(w, _)| **w != chosen)
            .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
            .filter(|(_, n)| **n > chosen_overlap)
            .map_or((chosen, chosen_overlap), |(w, n)| (*w, *n));
        let bs = u64::from(decision.block_size);
        let gap = best_overlap - chosen_overlap;
        let spill = best != chosen && gap >= min_blocks.max(1);
        let cached_tokens = u64::from(chosen_overlap) * bs;
        let generated = if gap > 0 {
            index.generated_among(
                &best,
                &chain[chosen_overlap as usize..best_overlap as usize],
            )
        } else {
            0
        };
        SpillVerdict {
            request_id: decision.request_id.clone(),
            model: None,
            incomplete_mirror: false,
            after_own_prefill: false,
            clock_behind_ms: decision.clock_behind_ms,
            trace: decision.trace.clone(),
            judged_before_event: false,
            decided_ns,
            chosen,
            chosen_overlap_blocks: chosen_overlap,
            best,
            best_overlap_blocks: best_overlap,
            block_size: decision.block_size,
            isl_tokens: decision.isl_tokens,
            spill,
            upper_bound_tokens: u64::from(best_overlap) * bs,
            true_delta_tokens: u64::from(gap) * bs,
            generated_delta_tokens: u64::from(generated) * bs,
            uncached_prefill_tokens: decision.isl_tokens.saturating_sub(cached_tokens),
            overlaps,
            available_ns: None,
            delta_block_hashes: chain[chosen_overlap as usize..best_overlap as usize].to_vec(),
            delta_parent_hash: (chosen_overlap > 0 && gap > 0)
                .then(|| chain[chosen_overlap as usize - 1]),
            nixl: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::hashing::{local_block_hashes, sequence_hashes, DYNAMO_HASH_SEED};

    fn w(id: u64) -> WorkerKey {
        WorkerKey {
            worker_id: id,
            dp_rank: 0,
        }
    }

    fn decision(tokens: &[u32], to: u64) -> RoutingDecision {
        RoutingDecision {
            request_id: "r".into(),
            worker: w(to),
            isl_tokens: tokens.len() as u64,
            block_size: 2,
            local_hashes: local_block_hashes(tokens, 2, DYNAMO_HASH_SEED),
            sequence_hashes: None,
            worker_type: None,
            router_mode: None,
            clock_behind_ms: None,
            trace: None,
        }
    }

    fn fleet() -> (FleetIndex, Vec<u32>) {
        let mut idx = FleetIndex::new();
        let toks: Vec<u32> = (0..9).collect();
        idx.store(w(1), None, &[1, 2, 3, 4], &toks[..8], 2, None)
            .unwrap();
        idx.store(w(2), None, &[1], &toks[..2], 2, None).unwrap();
        (idx, toks)
    }

    #[test]
    fn a_request_sent_away_from_its_kv_is_a_spill_with_the_true_delta() {
        let (idx, toks) = fleet();
        let v = SpillVerdict::judge(&idx, &decision(&toks, 2), 0, 1);
        assert!(v.spill);
        assert_eq!(v.best, w(1));
        assert_eq!((v.best_overlap_blocks, v.chosen_overlap_blocks), (4, 1));
        assert_eq!(v.upper_bound_tokens, 8);
        assert_eq!(v.true_delta_tokens, 6);
        assert_eq!(v.uncached_prefill_tokens, 9 - 2);
        // The delta by name: blocks 2..4 of the request's chain, extending block 1.
        let chain = sequence_hashes(&decision(&toks, 2).local_hashes);
        assert_eq!(v.delta_block_hashes, chain[1..4].to_vec());
        assert_eq!(v.delta_parent_hash, Some(chain[0]));
    }

    #[test]
    fn routing_to_the_holder_is_not_a_spill() {
        let (idx, toks) = fleet();
        let v = SpillVerdict::judge(&idx, &decision(&toks, 1), 0, 1);
        assert!(!v.spill);
        assert_eq!(v.best, w(1));
        assert_eq!(v.true_delta_tokens, 0);
        assert_eq!(v.uncached_prefill_tokens, 1);
        assert!(v.delta_block_hashes.is_empty() && v.delta_parent_hash.is_none());
    }

    #[test]
    fn small_gaps_below_min_blocks_are_not_spills() {
        let (idx, toks) = fleet();
        let v = SpillVerdict::judge(&idx, &decision(&toks, 2), 0, 4);
        assert!(!v.spill);
        assert_eq!(v.true_delta_tokens, 6, "the delta is still measured");
    }

    #[test]
    fn a_cold_request_has_no_best_worker_but_the_chosen_one() {
        let idx = FleetIndex::new();
        let v = SpillVerdict::judge(&idx, &decision(&[5, 6, 7, 8], 3), 0, 1);
        assert_eq!(v.best, w(3));
        assert!(!v.spill);
        assert_eq!(v.uncached_prefill_tokens, 4);
    }
}
