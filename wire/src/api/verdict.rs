//! Per-request spill verdicts as the collector serves them (`/api/verdicts`): the
//! measurements of ARCHITECTURE.md ("The measurements") for one routed request.

use crate::tier::LowerTierBlocks;
use crate::{SequenceHash, WorkerKey};
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
    pub trace: Option<crate::TraceContext>,
    /// Found later to have been judged before a KV event it depends on (one stamped
    /// earlier, applied after it): its overlaps may be short.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub judged_before_event: bool,
    /// The request's tenant: the cache salt its first block was stored under, where an
    /// engine named one ([`crate::api::window::TenantFigures`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
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
    #[serde(with = "crate::worker_map")]
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
    pub nixl: Option<crate::nixl::RequestNixl>,
    /// The overlap the router credited the chosen worker with (its logged view of the
    /// choice, beside `chosen_overlap_blocks`, the engines' truth), joined when the
    /// verdict is served (`/api/verdicts`) once the view came; the fold leaves it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_overlap_blocks: Option<u32>,
    /// How far the chosen worker's match extends past its device overlap through its
    /// host tier, then its disk tier (as Dynamo's router extends it): blocks it would
    /// onload rather than compute. Empty on a fleet whose engines publish no lower tier.
    #[serde(default, skip_serializing_if = "LowerTierBlocks::is_empty")]
    pub chosen_lower_tiers: LowerTierBlocks,
    /// The same for the best worker.
    #[serde(default, skip_serializing_if = "LowerTierBlocks::is_empty")]
    pub best_lower_tiers: LowerTierBlocks,
    /// The part of the true delta the chosen worker held in its own lower tiers: onloaded,
    /// not recomputed. `true_delta_tokens − onload_delta_tokens` had to be recomputed.
    #[serde(default)]
    pub onload_delta_tokens: u64,
}
