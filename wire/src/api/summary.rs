//! `/api/summary`: where the collector stands — its bus reader, its mirror, its counters,
//! the agents it hears from and the fleet discovery described.

use crate::api::window::WindowSummary;
use crate::nixl::NixlReport;
use crate::{AgentHeartbeat, WorkerRecord};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `/api/summary`. Every field has a default, so a reader of an older or newer collector
/// (or of a saved read) gets what is there.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CollectorSummary {
    pub bus: BusStatus,
    /// Workers the mirror holds.
    pub workers: usize,
    /// (block, worker) pairs cached in the mirror.
    pub cached_block_pairs: usize,
    /// The latest record time the collector has seen (agents' clocks, UNIX ns).
    pub watermark_ns: u64,
    pub windows_closed: usize,
    pub open_window: Option<WindowSummary>,
    pub counters: CollectorCounters,
    /// The router's own view of its choices set beside the engines' truth.
    pub router_view: RouterViewAudit,
    /// The router's view of the chosen workers' lower tiers beside the engines'.
    #[serde(default)]
    pub router_tier_view: TierViewAudit,
    /// Every agent the collector has heard from, with when it last did.
    pub agents: BTreeMap<String, AgentStatus>,
    /// The workers discovery described, by instance id (retired ones included).
    pub fleet: BTreeMap<u64, WorkerRecord>,
}

/// Where the bus reader is; shown on `/metrics` and the API.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BusStatus {
    pub connected: bool,
    /// The stream sequence of the last record applied.
    pub applied_seq: u64,
    /// A model's copies of heartbeats and NIXL reports, skipped by a collector of the
    /// whole fleet (it has them from their plain subjects).
    pub model_copies_skipped: u64,
    /// The subjects consumed, when limited to one model's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    /// Messages still waiting in the stream for this collector (a bundle of records,
    /// or one part of a record too large for one message, is one).
    pub pending: u64,
    /// Records read while rebuilding state at start (each of a bundle's; a model's
    /// copies that a collector of the whole fleet skips are not), applied or counted as
    /// refused.
    pub rebuilt_records: u64,
    pub rebuilding: bool,
    /// Stream records that were gone (expired or deleted) when the collector came to
    /// apply them: a hole in what it has seen.
    pub missing_records: u64,
    /// The stream's first record when the collector started: the ones before it were
    /// discarded by the stream's age and size limits, and the figures begin there.
    pub stream_first_seq: u64,
    /// The recording stopped after a write error.
    pub recording_failed: bool,
    /// Flushes of the recording that failed (it tries again at the next).
    pub recording_flush_failures: u64,
    /// Attempts to connect to NATS that failed (the reader waits and tries again).
    pub connect_failures: u64,
    /// Things the NATS server refused this collector (credentials, permissions).
    pub nats_refusals: u64,
    /// Pulls from the durable consumer that failed (retried).
    pub pull_failures: u64,
    /// Deliveries without JetStream metadata: skipped (a record among them is fetched
    /// by sequence when the next delivery shows the gap).
    pub messages_without_metadata: u64,
    /// Acks that failed (the record may come again, and is skipped then).
    pub ack_failures: u64,
    /// Times the stream was found made anew under its name (a server whose storage was
    /// wiped: its sequence numbers start again): the collector made its consumer anew
    /// and went on from the new stream's first record. Records the old stream held that
    /// the collector had not applied are gone (gaps in the engines' batch sequences show
    /// any KV events among them).
    pub stream_resets: u64,
    /// Messages waiting for this collector's consumer at the latest look at the
    /// consumer (`pending` is as of the latest delivery).
    pub consumer_pending: u64,
    /// When a message was last applied (UNIX ns, the collector's clock): with messages
    /// waiting and none applied for long, the collector is not ready.
    pub applied_at_ns: u64,
    /// Why the durable consumer could not be read at the latest look, when it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumer_error: Option<String>,
    /// The server leading the stream, on a NATS cluster (as of the latest look).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_leader: Option<String>,
    /// Times the stream's leader was seen to move to another server.
    pub stream_leader_changes: u64,
    /// How many servers keep the stream (as of the latest look).
    pub stream_replicas: usize,
    /// Whether this collector serves its scope or stands by (see [`LeaseStatus`]).
    pub lease: LeaseStatus,
}

/// What a collector is to its scope (the fleet, or one model): the one that serves, a
/// warm standby that folds the same stream and serves once the other is gone, or one
/// that runs without a lease (turned off: nothing keeps a second from serving too).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectorRole {
    Leader,
    Standby,
    /// Also a collector serving a recording, with no bus.
    #[default]
    Alone,
}

impl CollectorRole {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Leader => "leader",
            Self::Standby => "standby",
            Self::Alone => "alone",
        }
    }
    /// Whether this collector answers for its scope (API, `/readyz`, figures, spans).
    pub fn serves(self) -> bool {
        self != Self::Standby
    }
}

/// The collector's lease on its scope, held in a NATS key-value bucket: the one whose
/// entry is in the bucket serves; the entry expires `ttl_secs` after its last renewal, so
/// a collector that dies is followed by its standby within about that long.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LeaseStatus {
    pub role: CollectorRole,
    /// This collector's name in the lease (its host and listen address).
    pub identity: String,
    /// Who holds the lease, as of the latest look.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// The lease's lifetime after each renewal (the bucket's), in seconds.
    pub ttl_secs: u64,
    /// Times this collector took the lease.
    pub acquired: u64,
    /// Times it saw the holder change (another collector took it).
    pub holder_changes: u64,
    /// Times this collector stopped serving because it could not renew the lease.
    pub lost: u64,
    /// Looks at or renewals of the lease that failed (the bus away, or refusing).
    pub failures: u64,
    /// Why the latest look or renewal failed, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How the router's view of its choices compares with what the engines held when it
/// chose: for each judged decision whose router view came, the blocks of the prompt the
/// router credited the chosen worker with (its logged `overlap_blocks`) against the
/// blocks the chosen worker's engine had stored and not removed at the decision (the
/// verdict's `chosen_overlap_blocks`).
/// The router's view of the chosen worker's lower tiers (how far it extended the match
/// past the device overlap through host memory and disk, as its decision line states
/// it) set beside the engines' (the verdict's `chosen_lower_tiers`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TierViewAudit {
    /// Judged decisions whose line stated the router's lower-tier view.
    pub compared: u64,
    pub exact: u64,
    /// The router extended the match further than the engines held (Σ blocks over).
    pub over: u64,
    pub over_blocks: u64,
    /// The router extended it less far than the engines held (Σ blocks short).
    pub under: u64,
    pub under_blocks: u64,
}

impl TierViewAudit {
    /// Count one decision: `believed` by the router, `held` by the engines.
    pub fn compare(&mut self, believed: crate::LowerTierBlocks, held: crate::LowerTierBlocks) {
        self.compared += 1;
        let (b, h) = (u64::from(believed.total()), u64::from(held.total()));
        if believed == held {
            self.exact += 1;
        } else if b >= h {
            // Equal totals split differently between host and disk count as over: the
            // router credited a tier the blocks were not in.
            self.over += 1;
            self.over_blocks += b - h;
        } else {
            self.under += 1;
            self.under_blocks += h - b;
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RouterViewAudit {
    /// Decisions compared.
    pub compared: u64,
    /// The router's view equalled the engines' truth.
    pub exact: u64,
    /// The router credited the worker with more than it held (blocks removed that the
    /// router had not yet applied, or a tier the engines do not report as the device's).
    pub over: u64,
    /// Blocks credited over the truth, summed.
    pub over_blocks: u64,
    /// Of the over-estimates, those whose first wrongly credited block the worker had
    /// removed within 5 s before the decision: a removal the router had not applied.
    pub over_removed_lately: u64,
    /// ... and those whose first wrongly credited block the worker stored only after the
    /// decision (in kvscope's record time): the router applied the store first. The rest
    /// of `over` is unexplained by what the collector keeps (older changes: lost or
    /// never applied events, the router's TTL or approximate mode).
    pub over_stored_after: u64,
    /// The router credited the worker with less than it held (stores it had not applied
    /// yet, lost events, output blocks it does not track).
    pub under: u64,
    /// Blocks held that the router did not credit, summed.
    pub under_blocks: u64,
    /// Of the under-estimates, those whose first uncredited block the worker stored
    /// within 5 s before the decision: a store the router had not applied yet. The rest
    /// of `under` is unexplained by what the collector keeps (a store the router lost).
    pub under_stored_lately: u64,
    /// Spills (verdicts whose best worker held more than the chosen one) compared.
    pub spills: u64,
    /// Of those, spills the router could not see: it credited the chosen worker with at
    /// least what the best worker truly held, so by its view it chose no worse.
    pub spills_unseen: u64,
    /// Spills whose view carries the router's score of the best worker (the worker
    /// passed over; Dynamo 1.4 and 1.5 log a score per worker, 1.6 none).
    pub spills_best_scored: u64,
    /// Of those, spills where the router credited the best worker with fewer blocks than
    /// it held: its view of the worker it passed over was stale. The rest of
    /// `spills_best_scored` it chose knowing what the best worker held (by load).
    pub spills_best_stale: u64,
    /// The best workers' blocks the router did not credit (held, less the whole blocks
    /// credited), summed over `spills_best_stale`.
    pub spills_best_stale_blocks: u64,
    /// Of `spills_best_stale`, those whose first uncredited block the best worker stored
    /// within 5 s before the decision: a store the router had not applied yet.
    pub spills_best_stale_stored_lately: u64,
    /// Over the misses told "not yet applied" (`over_removed_lately`,
    /// `under_stored_lately`): how long before the decision the change came, in µs of
    /// record time, summed (÷ their count: the mean) and the longest.
    pub lately_lag_us_sum: u64,
    pub lately_lag_us_max: u64,
}

impl RouterViewAudit {
    /// A miss told "not yet applied", its change `lag_ns` before the decision.
    pub fn note_lag(&mut self, lag_ns: u64) {
        let us = lag_ns / 1_000;
        self.lately_lag_us_sum = self.lately_lag_us_sum.saturating_add(us);
        self.lately_lag_us_max = self.lately_lag_us_max.max(us);
    }
}

/// Everything the collector counted since it started (or since the replay began).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CollectorCounters {
    pub records: u64,
    pub kv_batches: u64,
    pub kv_events: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub cleared_blocks: u64,
    /// Stores whose parent block the worker never stored: dropped, as Dynamo drops them.
    pub unknown_parent_events: u64,
    /// Removals of blocks the worker never stored.
    pub unknown_removed_blocks: u64,
    /// Stores and removals on a host or disk tier: applied to the lower-tier mirror,
    /// never to an overlap (the router keeps them in separate lower-tier indexes and
    /// extends a match through them past the device overlap).
    pub lower_tier_events: u64,
    pub lower_tier_stored_blocks: u64,
    pub lower_tier_removed_blocks: u64,
    /// Lower-tier blocks that could not be placed (a store of engine hashes alone that
    /// no tier of the worker held) or removed (never stored there).
    pub lower_tier_unknown_blocks: u64,
    /// Stores and removals whose `medium` names no tier an engine is known to send: left
    /// out of every tier, never guessed.
    pub unknown_medium_events: u64,
    /// Stores whose tokens did not fill exactly one block per block hash.
    pub token_count_mismatches: u64,
    pub sequence_gaps: u64,
    pub missed_batches: u64,
    /// Stored blocks in no prompt recently routed to their worker: decode-generated.
    pub generated_blocks: u64,
    /// Routed prompts whose best (or chosen) worker's cached prefix reached blocks that
    /// worker had generated while decoding: a reply sent back in the next turn and
    /// still cached where it was decoded. With none, the true delta can hold no
    /// decode-generated block (replies not sent back, or evicted before the next turn).
    pub prompts_reaching_generated_blocks: u64,
    /// Publisher sequence numbers that went backwards: the engine restarted, so the
    /// worker's mirror was cleared.
    pub sequence_resets: u64,
    /// KV batches whose publisher sequence number does not follow the last one applied
    /// here although the agent saw no gap: batches lost or reordered between agent and
    /// collector (a full agent buffer, a publish retried across a reconnect).
    pub batch_order_faults: u64,
    pub decisions: u64,
    pub spills: u64,
    /// Decisions whose prompt length, block size and block count cannot belong
    /// together (corrupted or crafted): counted, not judged.
    pub malformed_decisions: u64,
    /// Decisions for a request id already judged (among the last 100,000): counted, not
    /// judged again.
    pub duplicate_decisions: u64,
    /// The decode decision of a disaggregated request whose prefill decision was judged:
    /// the prefill pool computes the prompt's KV, so that decision is the request's
    /// verdict; counted, not judged (nor a fault).
    #[serde(default)]
    pub decode_legs: u64,
    /// Decisions whose whole prompt was cached on the chosen worker by a store that
    /// ended its chain less than 250 ms before the decision: most likely judged after
    /// their own prefill (the router's and the engines' clocks disagree, or the agent's
    /// reorder window was too short). Flagged, and a data fault of their window.
    pub verdicts_after_own_prefill: u64,
    /// Decisions whose router log lines all reached the agent at least 50 ms late for
    /// seconds before them (`clock_behind_ms`): the router's clock may be behind the
    /// agent's, so they may be judged before events they depend on. Flagged, and a data
    /// fault of their window.
    pub verdicts_clock_behind: u64,
    /// Decisions for a worker that never published a KV event.
    pub decisions_for_unseen_workers: u64,
    /// Decisions whose whole prompt was already cached on the chosen worker. Repeated
    /// prompts do that; so does a decision applied after the KV events of its own
    /// prefill (the agent's reorder window too short). In a chat workload, where every
    /// turn adds new text, it should stay near zero.
    pub decisions_fully_cached: u64,
    pub migration_lines: u64,
    /// Requests' ends from Dynamo's request trace (the what-if's router model times
    /// each worker's load by them).
    pub request_ends: u64,
    /// The router's views of its choices (`router_view` records).
    pub router_views: u64,
    /// Router views not compared: for another worker than the judged decision's (a
    /// disaggregated request's decode leg), a second view of one, or a view that waited
    /// a minute of record time (or behind 10,000 others) for a decision that never came.
    /// Views still waiting are neither compared nor counted here.
    pub router_views_unjoined: u64,
    pub heartbeats: u64,
    /// NIXL reports from agents' eBPF probes.
    pub nixl_reports: u64,
    /// Records older than the window already open (clock skew between agents).
    pub late_records: u64,
    /// Bus messages that were not valid records (counted by the bus reader).
    pub undecodable_records: u64,
    /// Records stamped more than 60 s ahead of the collector's clock (a wrong clock or a
    /// forged record): not applied, so they cannot move the windows or the watermark.
    pub future_records: u64,
    /// Records dated after the stream stored them, moved back by their agent's
    /// estimated clock offset (an agent host's clock ahead; the offsets are on
    /// `/metrics` by agent).
    pub records_clock_corrected: u64,
    /// Records whose `agent` is not the agent their subject names (a forged record, or
    /// an agent publishing another's records): not applied. A server's permissions let
    /// each agent publish under its own name only, so this is what makes the name hold.
    pub foreign_records: u64,
    /// Records sent in parts that never came whole (a part missing, out of order or
    /// past the size limit; counted by the bus reader): dropped, never guessed at.
    pub incomplete_records: u64,
    /// Workers whose registration went away in Dynamo's discovery store: their mirror
    /// was dropped and no verdict names them afterwards.
    pub workers_retired: u64,
    /// KV batches for a retired worker (late events of a process that stopped): not
    /// applied.
    pub batches_for_retired_workers: u64,
    /// KV batches a publisher's replay socket sent again to fill a gap or a late start:
    /// recovered, not lost.
    pub replayed_batches: u64,
    /// Decisions judged while a worker that could have been chosen had an incomplete
    /// mirror (batches lost for good, or a publisher first seen past its start): their
    /// verdicts are flagged, and each counts as a data fault of its window.
    pub verdicts_on_incomplete_mirror: u64,
    /// KV batches and decisions of models this collector does not measure
    /// (`analyzer.models`): skipped.
    pub batches_other_models: u64,
    pub decisions_other_models: u64,
    /// Decisions whose line named another model than the one discovery (or an earlier
    /// decision, without discovery) gives their chosen worker: discovery's stands.
    pub decisions_model_mismatch: u64,
    /// Request ids longer than 256 bytes, kept as their first bytes and a hash.
    pub request_ids_shortened: u64,
    /// Verdicts judged among every worker because neither discovery nor the router's
    /// line named the chosen worker's model: on a fleet of several models, another
    /// model's worker may have been taken for a candidate.
    pub verdicts_model_unknown: u64,
    /// Verdicts judged among their model's workers while a worker whose model nobody
    /// named (no discovery record, never chosen on a line naming its model) held more of
    /// the prompt than the chosen one: left out as a candidate, counted.
    pub verdicts_left_out_unknown_model: u64,
    /// Verdicts judged before a KV event they depend on: a batch stamped by its engine
    /// before the decision, storing a block of the decision's chain, was applied after
    /// it (it reached the agent later than the wait for it). Flagged
    /// (`judged_before_event`), and a data fault of the window open when found.
    pub verdicts_judged_before_event: u64,
}

/// The latest word from one agent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AgentStatus {
    pub last_seen_ns: u64,
    pub heartbeat: AgentHeartbeat,
    /// The agent's latest NIXL figures (cumulative), when it traces NIXL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nixl: Option<NixlReport>,
}
