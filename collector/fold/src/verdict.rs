//! Judging a routed request against the mirror: its [`SpillVerdict`], the measurements of
//! ARCHITECTURE.md ("The measurements").

use crate::fleet_index::FleetIndex;
use crate::lower_tiers::LowerTiers;
use kvscope_wire::api::verdict::SpillVerdict;
use kvscope_wire::LowerTierBlocks;
use kvscope_wire::{RoutingDecision, SequenceHash, Tier, WorkerKey};
use std::collections::BTreeMap;

/// The verdict's trace id, lowercase hex: the router's trace of the request when known,
/// else the one derived from the request id.
pub fn trace_id_hex(v: &SpillVerdict) -> String {
    match &v.trace {
        Some(t) => t.trace_id.clone(),
        None => kvscope_wire::trace_ids::trace_id_hex(&v.request_id),
    }
}

/// Judge `decision` against the mirror. `min_blocks` is the smallest overlap gap that
/// counts as a spill.
pub fn judge(
    index: &FleetIndex,
    decision: &RoutingDecision,
    decided_ns: u64,
    min_blocks: u32,
) -> SpillVerdict {
    let matched = match &decision.sequence_hashes {
        Some(seq) => index.match_seq_chain(seq),
        None => index.match_chain(&decision.local_hashes),
    };
    judge_matched(
        index,
        decision,
        &matched.chain,
        matched.overlaps,
        decided_ns,
        min_blocks,
    )
}

/// [`judge`] with the decision's chain already matched against the mirror
/// ([`FleetIndex::match_chain`]), for a caller that keeps the chain.
pub(crate) fn judge_matched(
    index: &FleetIndex,
    decision: &RoutingDecision,
    chain: &[SequenceHash],
    overlaps: BTreeMap<WorkerKey, u32>,
    decided_ns: u64,
    min_blocks: u32,
) -> SpillVerdict {
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
        tenant: None,
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
        router_overlap_blocks: None,
        chosen_lower_tiers: Default::default(),
        best_lower_tiers: Default::default(),
        onload_delta_tokens: 0,
    }
}

/// Extend `v`'s chosen and best workers' matches through their lower tiers (host, then
/// disk), each from where its device overlap ends, and split the true delta into what
/// the chosen worker onloads from its own lower tiers and what it recomputes.
pub(crate) fn extend_through_lower_tiers(
    v: &mut SpillVerdict,
    tiers: &LowerTiers,
    chain: &[SequenceHash],
) {
    if tiers.is_empty() {
        return;
    }
    let extend = |worker: &WorkerKey, device: u32| {
        let host = tiers.extension(Tier::Host, worker, chain, device as usize);
        let disk = tiers.extension(Tier::Disk, worker, chain, (device + host) as usize);
        LowerTierBlocks {
            host_blocks: host,
            disk_blocks: disk,
        }
    };
    v.chosen_lower_tiers = extend(&v.chosen, v.chosen_overlap_blocks);
    v.best_lower_tiers = extend(&v.best, v.best_overlap_blocks);
    let gap = v
        .best_overlap_blocks
        .saturating_sub(v.chosen_overlap_blocks);
    v.onload_delta_tokens =
        u64::from(v.chosen_lower_tiers.total().min(gap)) * u64::from(v.block_size);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{routing_decision, w};
    use kvscope_wire::hashing::sequence_hashes;

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
        let v = judge(&idx, &routing_decision("r", 2, &toks), 0, 1);
        assert!(v.spill);
        assert_eq!(v.best, w(1));
        assert_eq!((v.best_overlap_blocks, v.chosen_overlap_blocks), (4, 1));
        assert_eq!(v.upper_bound_tokens, 8);
        assert_eq!(v.true_delta_tokens, 6);
        assert_eq!(v.uncached_prefill_tokens, 9 - 2);
        // The delta by name: blocks 2..4 of the request's chain, extending block 1.
        let chain = sequence_hashes(&routing_decision("r", 2, &toks).local_hashes);
        assert_eq!(v.delta_block_hashes, chain[1..4].to_vec());
        assert_eq!(v.delta_parent_hash, Some(chain[0]));
    }

    #[test]
    fn routing_to_the_holder_is_not_a_spill() {
        let (idx, toks) = fleet();
        let v = judge(&idx, &routing_decision("r", 1, &toks), 0, 1);
        assert!(!v.spill);
        assert_eq!(v.best, w(1));
        assert_eq!(v.true_delta_tokens, 0);
        assert_eq!(v.uncached_prefill_tokens, 1);
        assert!(v.delta_block_hashes.is_empty() && v.delta_parent_hash.is_none());
    }

    #[test]
    fn small_gaps_below_min_blocks_are_not_spills() {
        let (idx, toks) = fleet();
        let v = judge(&idx, &routing_decision("r", 2, &toks), 0, 4);
        assert!(!v.spill);
        assert_eq!(v.true_delta_tokens, 6, "the delta is still measured");
    }

    #[test]
    fn a_cold_request_has_no_best_worker_but_the_chosen_one() {
        let idx = FleetIndex::new();
        let v = judge(&idx, &routing_decision("r", 3, &[5, 6, 7, 8]), 0, 1);
        assert_eq!(v.best, w(3));
        assert!(!v.spill);
        assert_eq!(v.uncached_prefill_tokens, 4);
    }
}
