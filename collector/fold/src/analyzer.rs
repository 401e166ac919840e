//! The fleet analyzer: applies records in stream order to the mirror, judges every
//! routing decision, runs the event-only measurement, and cuts windows on record time.
//!
//! It is a pure fold over records — no clocks, no I/O — so a live run and a replay of the
//! same records give the same figures.

use crate::fleet_index::{FastMap, FleetIndex, MirrorError};
use crate::lower_tiers::LowerTiers;
use crate::recent_changes::{RecentChanges, StaleCause};
use crate::tenants::TenantRoots;
use crate::verdict;
use crate::window::{ClosedWindow, OpenWindow};
use kvscope_wire::api::summary::{AgentStatus, CollectorCounters, RouterViewAudit, TierViewAudit};
use kvscope_wire::api::verdict::SpillVerdict;
use kvscope_wire::api::window::{MigrationLogWindow, ModelFigures, TenantFigures, WindowSummary};
use kvscope_wire::nixl::{MergedLatency, NixlAgentOwner, NixlAgentRow};
use kvscope_wire::{
    Envelope, KvEvent, KvEventBatch, MigrationLogKind, MigrationLogLine, Record, RequestEnd,
    RoutingDecision, Selection, SequenceHash, SequenceStatus, Tier, WorkerKey, WorkerRecord,
    WorkerState,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};

/// How the analyzer measures. Every field has a default that fits a Dynamo fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AnalyzerConfig {
    /// Window length in seconds.
    pub window_secs: f64,
    /// Seconds after the first record whose windows are shown but not measured: the
    /// fork's first point after boot read ~5.8× slow.
    pub warmup_secs: f64,
    /// Smallest overlap gap, in blocks, that counts as a spill.
    pub min_spill_blocks: u32,
    /// Measured windows needed before a report gives figures.
    pub min_windows: usize,
    /// Closed windows kept in memory for the API and reports.
    pub keep_windows: usize,
    /// Recent verdicts kept for the API.
    pub keep_verdicts: usize,
    /// How long the prompt blocks of a decision are remembered until their worker
    /// stores them, in seconds (then for a minute more: [`HELD_PROMPT_MEMORY_NS`]): a
    /// block a worker stores that is in no prompt remembered for it was generated while
    /// decoding (an output block).
    pub prompt_memory_secs: f64,
    /// Measure only these models (empty: every model). A large fleet can be split
    /// across collectors by model on the same stream: the others' workers are not
    /// mirrored and their decisions not judged (both counted).
    pub models: Vec<String>,
}

impl Default for AnalyzerConfig {
    fn default() -> Self {
        Self {
            window_secs: 15.0,
            warmup_secs: 15.0,
            min_spill_blocks: 1,
            min_windows: 6,
            keep_windows: 5760,
            keep_verdicts: 1000,
            prompt_memory_secs: 600.0,
            models: Vec::new(),
        }
    }
}

/// Verdicts remembered for [`CollectorCounters::verdicts_judged_before_event`]: at most
/// this many, and none older than [`JUDGED_MEMORY_NS`] before the newest.
const JUDGED_MEMORY: usize = 4096;
const JUDGED_MEMORY_NS: u64 = 10_000_000_000;
/// ... and at most this many chain hashes in all (8 MiB): long prompts' chains are long.
const JUDGED_MEMORY_HASHES: usize = 1 << 20;

/// A verdict's decision time and chain, kept a while to find events it missed.
#[derive(Debug)]
struct Judged {
    decided_ns: u64,
    request_id: String,
    chain: Vec<SequenceHash>,
    flagged: bool,
}

/// How long a prompt block stays remembered once its worker holds it (stored since it
/// was routed, or already cached then): long enough for a preempted request's blocks,
/// evicted and computed again, to be told from decode output. A block routed and not
/// yet stored is remembered for `prompt_memory_secs` (a request may wait that long for
/// its prefill). Remembering every routed block for the whole `prompt_memory_secs` grew
/// the collector by ~2 MB/s at 100k KV blocks/s.
const HELD_PROMPT_MEMORY_NS: u64 = 60_000_000_000;

/// Stores remembered per worker for [`CollectorCounters::verdicts_after_own_prefill`].
const RECENT_STORE_ENDS: usize = 64;
/// How soon after the store ending its chain a fully cached decision looks like its
/// own prefill's (see [`CollectorCounters::verdicts_after_own_prefill`]).
const OWN_PREFILL_NS: u64 = 250_000_000;

/// Upper bounds (inclusive, tokens) of the per-spill token histograms on `/metrics`:
/// one block of 16 tokens up to 256k tokens, doubling.
pub const TOKEN_BOUNDS: [u64; 15] = [
    16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144,
];

/// A cumulative histogram of token counts at [`TOKEN_BOUNDS`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenHistogram {
    /// `buckets[i]` = observations ≤ `TOKEN_BOUNDS[i]` (cumulative).
    pub buckets: [u64; TOKEN_BOUNDS.len()],
    pub count: u64,
    pub sum: u64,
    /// Per bucket (the last one: above every bound), the latest observation that fell
    /// in it, with its trace: OpenMetrics exemplars, so a Grafana panel of the histogram
    /// links to the trace of a spill in it.
    pub exemplars: Vec<Option<Exemplar>>,
}

/// One observation of a histogram, with the trace it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exemplar {
    /// The trace id, as lowercase hex (what `kvscope.spill_verdict` spans carry).
    pub trace_id: String,
    pub value: u64,
    /// When it was observed (UNIX ns).
    pub at_ns: u64,
}

impl TokenHistogram {
    /// [`Self::observe`], remembering the observation as its bucket's exemplar.
    pub(crate) fn observe_traced(&mut self, tokens: u64, trace_id: String, at_ns: u64) {
        self.observe(tokens);
        let bucket = TOKEN_BOUNDS
            .iter()
            .position(|&le| tokens <= le)
            .unwrap_or(TOKEN_BOUNDS.len());
        self.exemplars.resize(TOKEN_BOUNDS.len() + 1, None);
        self.exemplars[bucket] = Some(Exemplar {
            trace_id,
            value: tokens,
            at_ns,
        });
    }

    pub fn observe(&mut self, tokens: u64) {
        self.count += 1;
        // Tokens come from the wire: a crafted decision must not overflow the sum.
        self.sum = self.sum.saturating_add(tokens);
        for (b, le) in self.buckets.iter_mut().zip(TOKEN_BOUNDS) {
            if tokens <= le {
                *b += 1;
            }
        }
    }
}

/// One worker's routing figures since start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerTotals {
    /// Decisions routed to it.
    pub decisions: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens it already had cached (its overlap × block size).
    pub cached_prompt_tokens: u64,
    /// Spills routed to it (it was chosen, another worker held more).
    pub spills_in: u64,
    /// Spills away from it (it held the most, another was chosen).
    pub spills_out: u64,
}

/// Cumulative figures since start (or since the replay began), for Prometheus counters
/// and histograms; the windows hold the same figures per window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FleetTotals {
    pub prompt_tokens: u64,
    pub uncached_prefill_tokens: u64,
    /// True delta per spill.
    pub true_delta: TokenHistogram,
    /// Upper bound (the fork's `migratable_tokens`) per spill.
    pub upper_bound: TokenHistogram,
    /// The part of the true delta in decode-generated blocks.
    pub generated_delta_tokens: u64,
    /// The part of the true delta the chosen worker onloaded from its lower tiers.
    pub onload_delta_tokens: u64,
    pub workers: BTreeMap<WorkerKey, WorkerTotals>,
    /// Per model, when discovery named the workers' models.
    pub models: BTreeMap<String, ModelFigures>,
    /// Per tenant (the cache salt of a request's first block).
    pub tenants: TenantFigures,
    /// The fork's KVMIGRATE log lines by kind.
    pub migration_log: MigrationLogWindow,
}

#[derive(Debug)]
pub struct FleetAnalyzer {
    cfg: AnalyzerConfig,
    window_ns: u64,
    index: FleetIndex,
    /// The host and disk tiers: how far a worker's match extends past its device overlap.
    lower: LowerTiers,
    /// The salts of salted chain roots: a request's tenant.
    tenant_roots: TenantRoots,
    counters: CollectorCounters,
    router_view: RouterViewAudit,
    tier_view: TierViewAudit,
    /// The latest block changes, to tell why a router view was wrong.
    recent_changes: RecentChanges,
    /// Router views that came before their decision, waiting for it (see
    /// [`Self::apply_router_view`]).
    views_waiting: (
        HashMap<String, (u64, kvscope_wire::RouterView)>,
        VecDeque<String>,
    ),
    totals: FleetTotals,
    agents: BTreeMap<String, AgentStatus>,
    first_ns: Option<u64>,
    watermark_ns: u64,
    open: Option<OpenWindow>,
    closed: VecDeque<ClosedWindow>,
    verdicts: VecDeque<SpillVerdict>,
    /// Last batch sequence number applied per (agent, publisher).
    publisher_seqs: HashMap<(String, String), u64>,
    /// Per worker: the prompt blocks of decisions routed to it, with the time until which
    /// each is remembered (see [`HELD_PROMPT_MEMORY_NS`]). Every decision writes its
    /// whole chain here, so the map hashes the block hashes with one multiply, not
    /// SipHash. (Its cache misses stay: at 700 decisions/s it is still a fifth of the
    /// collector's CPU.)
    recent_prompts: HashMap<WorkerKey, FastMap<SequenceHash, u64>>,
    verdict_delay: MergedLatency,
    /// The workers discovery described, by instance id (retired ones included).
    fleet: BTreeMap<u64, WorkerRecord>,
    /// Each worker's model as the router's own decisions named it (`RoutingDecision::
    /// model`, the request's model on its chosen worker), for workers discovery gives
    /// no model: a fleet followed without discovery (`--kv ENDPOINT=ID`) is still
    /// judged model by model. At most [`MAX_LEARNED_MODELS`] workers.
    learned_models: HashMap<u64, String>,
    /// Workers whose mirror lacks events lost for good, until their cache starts
    /// anew (cleared, or an engine restart seen from its first batch).
    incomplete: std::collections::BTreeSet<WorkerKey>,
    /// Per worker, the last block of each of its latest stores and when: a decision
    /// whose whole chain ends in a block its chosen worker stored just before was
    /// probably applied after its own prefill.
    recent_store_ends: HashMap<WorkerKey, VecDeque<(SequenceHash, u64)>>,
    /// Request ids judged lately, oldest first, to refuse a decision seen twice.
    /// Each with which of its decisions were seen (a disaggregated request has two).
    judged_ids: (HashMap<String, Legs>, VecDeque<String>),
    /// The latest verdicts' chains, oldest first (see [`Judged`]), and their hashes in all.
    judged: VecDeque<Judged>,
    judged_hashes: usize,
    /// Per request named by NIXL notifications: the latest cumulative row of each
    /// (node agent, local NIXL agent, remote NIXL agent), and the requests' arrival order.
    request_nixl: RequestNixlRows,
    /// The latest judged requests, oldest first, for the what-if (`/api/whatif`), and
    /// their chains' hashes in all.
    routed: VecDeque<RoutedRequest>,
    routed_hashes: usize,
    /// Each kept request's place among all ever kept, by request id, and the place of
    /// the oldest still kept: where a request's end (its request-trace record) is told.
    routed_at: HashMap<String, u64>,
    routed_first: u64,
    /// Every NIXL agent's owner as its node agent last told it, by (node, NIXL agent),
    /// with when: a node agent stops telling an agent whose process is gone, but the
    /// requests it served stay in the what-if's history.
    told_owners: BTreeMap<(String, String), (NixlAgentOwner, u64)>,
}

/// Workers whose model is learned from decisions at most (a worker id is 64 bits
/// from a log line: the map must not grow with a forged or churning one).
const MAX_LEARNED_MODELS: usize = 65_536;

/// The decisions seen of a request judged lately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Legs {
    /// An aggregated (or decode) decision, judged.
    One,
    /// A prefill decision, judged; its decode decision not seen yet.
    Prefill,
    PrefillAndDecode,
}

/// What a decision is to the request ids judged lately.
enum Judgement {
    First,
    /// The decode decision after the request's judged prefill decision.
    DecodeLeg,
    /// Seen before: a repeated line, or a replay.
    Again,
}

/// A prefill worker's decision or record (`worker_type`), as Dynamo names them.
fn is_prefill(worker_type: Option<&str>) -> bool {
    worker_type.is_some_and(|t| t.eq_ignore_ascii_case("prefill"))
}

/// NIXL agent owners remembered after their node agent stopped telling them, at most
/// (the oldest told are forgotten first: engines that restart take new agent names).
const MAX_TOLD_OWNERS: usize = 4096;

/// How long (record time) a router view that came before its decision waits for it.
const VIEW_WAIT_NS: u64 = 60_000_000_000;
/// The most router views waiting for their decisions at once.
const VIEW_WAIT_MAX: usize = 10_000;

/// The judged requests kept for the what-if: at most this many chain hashes in all
/// (32 MiB), each request counted as [`ROUTED_REQUEST_WEIGHT`] more for its id, its
/// fields and its request-trace end, the oldest forgotten first.
const ROUTED_MEMORY_HASHES: usize = 1 << 22;
const ROUTED_REQUEST_WEIGHT: usize = 32;

/// One routed request as judged: where it went, its prompt's full blocks, and what the
/// chosen worker held of them (what the what-if replays).
#[derive(Debug, Clone)]
pub struct RoutedRequest {
    pub request_id: String,
    pub decided_ns: u64,
    /// The model of the chosen worker: the router chose among its workers only.
    pub model: Option<String>,
    pub worker: WorkerKey,
    pub chain: Vec<SequenceHash>,
    pub isl_tokens: u64,
    pub block_size: u32,
    pub recorded_overlap_blocks: u32,
    /// The worker holding the most of the chain then, and how much (the verdict's best).
    pub recorded_best: WorkerKey,
    pub recorded_best_overlap_blocks: u32,
    /// The run of the chain (start, end positions) that ends the best's (else the
    /// chosen) worker's cached prefix as decode-generated blocks: the previous turn's
    /// reply, which its worker's decode stored before this prompt came back with it.
    pub decoded_tail: Option<(u32, u32)>,
    /// What the router logged of its choice (its cost; pinned or not).
    pub selection: Selection,
    /// The overlap the router credited the chosen worker with, once its view came.
    pub router_overlap_blocks: Option<u32>,
    /// The request's life as Dynamo's request trace told it, once it ended.
    pub end: Option<RequestEnd>,
}

impl RoutedRequest {
    /// The true delta in blocks when the recorded verdict was a spill (the best worker
    /// held at least `min_spill_blocks` more than the chosen one), as [`verdict`] judges.
    pub fn recorded_spill_blocks(&self, min_spill_blocks: u32) -> Option<u32> {
        let gap = self
            .recorded_best_overlap_blocks
            .saturating_sub(self.recorded_overlap_blocks);
        (self.recorded_best != self.worker && gap >= min_spill_blocks.max(1)).then_some(gap)
    }
}

/// (node agent, local NIXL agent, remote NIXL agent, vLLM's id for the request).
type RequestNixlKey = (String, String, String, String);

/// What node agents reported moving per request (see [`FleetAnalyzer::request_nixl`]).
#[derive(Debug, Default)]
struct RequestNixlRows {
    /// Request id → what moved, per [`RequestNixlKey`].
    rows: HashMap<String, BTreeMap<RequestNixlKey, kvscope_wire::nixl::NixlRequestTransfers>>,
    order: VecDeque<String>,
}

impl RequestNixlRows {
    /// Requests remembered, oldest forgotten first (as many as verdicts are judged in
    /// minutes at lab rates; a verdict's NIXL figures come within seconds of it).
    const CAP: usize = 100_000;

    fn apply(&mut self, agent: &str, rows: &[kvscope_wire::nixl::NixlRequestTransfers]) {
        for r in rows {
            // Under vLLM's id for the request, and under the id the request came with
            // (the router's), where vLLM appended its suffix.
            let ids = std::iter::once(r.request_id.as_str())
                .chain(kvscope_wire::nixl::vllm_base_request_id(&r.request_id));
            for id in ids {
                if !self.rows.contains_key(id) {
                    self.order.push_back(id.to_string());
                    if self.order.len() > Self::CAP {
                        if let Some(old) = self.order.pop_front() {
                            self.rows.remove(&old);
                        }
                    }
                }
                self.rows.entry(id.to_string()).or_default().insert(
                    (
                        agent.to_string(),
                        r.local_agent.clone(),
                        r.remote_agent.clone(),
                        r.request_id.clone(),
                    ),
                    r.clone(),
                );
            }
        }
    }
}

impl FleetAnalyzer {
    pub fn new(cfg: AnalyzerConfig) -> Self {
        let window_ns = ((cfg.window_secs.max(0.001)) * 1e9) as u64;
        Self {
            cfg,
            window_ns,
            index: FleetIndex::new(),
            lower: LowerTiers::default(),
            tenant_roots: TenantRoots::default(),
            counters: CollectorCounters::default(),
            router_view: RouterViewAudit::default(),
            tier_view: TierViewAudit::default(),
            recent_changes: RecentChanges::default(),
            views_waiting: Default::default(),
            totals: FleetTotals::default(),
            agents: BTreeMap::new(),
            first_ns: None,
            watermark_ns: 0,
            open: None,
            closed: VecDeque::new(),
            verdicts: VecDeque::new(),
            publisher_seqs: HashMap::new(),
            recent_prompts: HashMap::new(),
            verdict_delay: MergedLatency::default(),
            fleet: BTreeMap::new(),
            learned_models: HashMap::new(),
            incomplete: std::collections::BTreeSet::new(),
            judged_ids: Default::default(),
            recent_store_ends: HashMap::new(),
            judged: VecDeque::new(),
            judged_hashes: 0,
            request_nixl: RequestNixlRows::default(),
            routed: VecDeque::new(),
            routed_hashes: 0,
            routed_at: HashMap::new(),
            routed_first: 0,
            told_owners: BTreeMap::new(),
        }
    }

    pub fn config(&self) -> &AnalyzerConfig {
        &self.cfg
    }
    pub fn index(&self) -> &FleetIndex {
        &self.index
    }
    /// The router's view of its choices beside the engines' truth (see
    /// [`RouterViewAudit`]).
    pub fn tier_view(&self) -> &TierViewAudit {
        &self.tier_view
    }

    pub fn router_view(&self) -> &RouterViewAudit {
        &self.router_view
    }

    pub fn counters(&self) -> &CollectorCounters {
        &self.counters
    }
    pub fn counters_mut(&mut self) -> &mut CollectorCounters {
        &mut self.counters
    }
    pub fn totals(&self) -> &FleetTotals {
        &self.totals
    }
    pub fn agents(&self) -> &BTreeMap<String, AgentStatus> {
        &self.agents
    }
    /// Every NIXL agent's owner as last told, those no longer told included (see
    /// `told_owners`): what maps the workers of past requests to their NIXL agents.
    pub fn owners_ever_told(&self) -> Vec<NixlAgentRow> {
        self.told_owners
            .iter()
            .map(|((node, _), (owner, _))| NixlAgentRow {
                node: node.clone(),
                owner: owner.clone(),
            })
            .collect()
    }

    fn remember_owners(&mut self, node: &str, owners: &[NixlAgentOwner], at_ns: u64) {
        for o in owners {
            self.told_owners
                .insert((node.to_string(), o.agent.clone()), (o.clone(), at_ns));
        }
        // Forget the oldest told in one pass (a report naming thousands of new agents
        // costs one sort, not a scan per agent).
        if let Some(excess) = self
            .told_owners
            .len()
            .checked_sub(MAX_TOLD_OWNERS)
            .filter(|&e| e > 0)
        {
            let mut by_age: Vec<((String, String), u64)> = self
                .told_owners
                .iter()
                .map(|(k, (_, at))| (k.clone(), *at))
                .collect();
            by_age.sort_by_key(|(_, at)| *at);
            for (k, _) in by_age.into_iter().take(excess) {
                self.told_owners.remove(&k);
            }
        }
    }
    /// The workers discovery described (the latest record of each; retired ones too).
    pub fn fleet(&self) -> &BTreeMap<u64, WorkerRecord> {
        &self.fleet
    }
    /// The model a worker serves: as discovery said, else as the router's decisions
    /// routed to it named it.
    pub fn model_of(&self, worker_id: u64) -> Option<&str> {
        self.discovered_model_of(worker_id)
            .or_else(|| self.learned_models.get(&worker_id).map(String::as_str))
    }
    fn discovered_model_of(&self, worker_id: u64) -> Option<&str> {
        self.fleet.get(&worker_id).and_then(|w| w.model.as_deref())
    }
    /// Whether this collector measures `worker_id`'s model (`analyzer.models`). By
    /// discovery's word only: a model learned from a decision comes after the worker's
    /// first KV events, which a collector limited to models would have skipped.
    fn measures(&self, worker_id: u64) -> bool {
        self.cfg.models.is_empty()
            || self
                .discovered_model_of(worker_id)
                .is_some_and(|m| self.cfg.models.iter().any(|x| x == m))
    }
    /// Learn the chosen worker's model from a decision that names its request's model,
    /// where discovery gives none; a decision that names another model than
    /// discovery's is counted (discovery's stands).
    fn learn_model(&mut self, d: &RoutingDecision) {
        let Some(m) = d.model.as_deref() else {
            return;
        };
        let w = d.worker.worker_id;
        match self.discovered_model_of(w) {
            Some(known) if known != m => self.counters.decisions_model_mismatch += 1,
            Some(_) => {}
            None => {
                let room = self.learned_models.len() < MAX_LEARNED_MODELS;
                match self.learned_models.get_mut(&w) {
                    Some(had) if had != m => {
                        // A worker id serves one model; the later word wins (a
                        // restarted id reused), counted.
                        self.counters.decisions_model_mismatch += 1;
                        *had = m.to_string();
                    }
                    Some(_) => {}
                    None if room => {
                        self.learned_models.insert(w, m.to_string());
                    }
                    None => {}
                }
            }
        }
    }
    /// Workers discovery gives no model that the router's decisions named one for.
    pub fn models_learned(&self) -> impl Iterator<Item = (u64, &str)> {
        self.learned_models
            .iter()
            .filter(|(w, _)| self.discovered_model_of(**w).is_none())
            .map(|(w, m)| (*w, m.as_str()))
    }
    fn retired(&self, worker_id: u64) -> bool {
        self.fleet
            .get(&worker_id)
            .is_some_and(|w| w.state == WorkerState::Gone)
    }
    pub fn closed_windows(
        &self,
    ) -> impl DoubleEndedIterator<Item = &ClosedWindow> + ExactSizeIterator {
        self.closed.iter()
    }
    pub fn open_window(&self) -> Option<&WindowSummary> {
        self.open.as_ref().map(|w| &w.summary)
    }
    /// The judged request `id`, while it is kept (see [`RoutedRequest`]).
    pub fn routed_request(&self, id: &str) -> Option<&RoutedRequest> {
        let at = *self.routed_at.get(id)?;
        self.routed.get(at.checked_sub(self.routed_first)? as usize)
    }

    fn routed_request_mut(&mut self, id: &str) -> Option<&mut RoutedRequest> {
        let at = *self.routed_at.get(id)?;
        self.routed
            .get_mut(at.checked_sub(self.routed_first)? as usize)
    }

    /// The latest judged requests, oldest first (see [`RoutedRequest`]).
    pub fn routed_requests(
        &self,
    ) -> impl DoubleEndedIterator<Item = &RoutedRequest> + ExactSizeIterator {
        self.routed.iter()
    }

    pub fn recent_verdicts(&self) -> impl DoubleEndedIterator<Item = &SpillVerdict> {
        self.verdicts.iter()
    }

    /// What the node agents' NIXL probes saw move for `request_id` (its transfers named
    /// it in their notifications), summed over agents; `None` when nothing did.
    pub fn request_nixl(&self, request_id: &str) -> Option<kvscope_wire::nixl::RequestNixl> {
        let rows = self.request_nixl.rows.get(request_id)?;
        let mut n = kvscope_wire::nixl::RequestNixl::default();
        for r in rows.values() {
            n.transfers += r.transfers;
            n.bytes += r.bytes;
            n.nixl_seconds += r.nixl_ns as f64 / 1e9;
            n.failed += r.failed;
        }
        Some(n)
    }
    /// The latest record time seen.
    pub fn watermark_ns(&self) -> u64 {
        self.watermark_ns
    }

    /// Note when the latest verdict became available to readers (a live collector's
    /// wall clock, read by the bus reader right after [`Self::apply`] judged it; the fold
    /// itself reads no clock).
    /// `live`: the decision arrived live, not in the replay that rebuilds state at start,
    /// so its decision → verdict delay counts in [`Self::verdict_delay`].
    pub fn stamp_latest_verdict(&mut self, available_ns: u64, live: bool) {
        if let Some(v) = self.verdicts.back_mut() {
            v.available_ns = Some(available_ns);
            if live {
                self.verdict_delay
                    .observe(available_ns.saturating_sub(v.decided_ns));
            }
        }
    }

    /// Routing decision (the router's log time) → verdict available here, for the
    /// decisions judged live.
    pub fn verdict_delay(&self) -> &MergedLatency {
        &self.verdict_delay
    }

    /// Apply one record. Returns the verdict when the record was a routing decision.
    pub fn apply(&mut self, env: &Envelope) -> Option<SpillVerdict> {
        self.counters.records += 1;
        self.advance_clock(env.observed_ns);
        match &env.record {
            Record::KvEvents(batch) => {
                self.check_batch_order(&env.agent, batch);
                if self.retired(batch.worker.worker_id) {
                    self.counters.batches_for_retired_workers += 1;
                } else if !self.measures(batch.worker.worker_id) {
                    self.counters.batches_other_models += 1;
                } else {
                    self.apply_kv(batch, env.observed_ns);
                }
                None
            }
            Record::Worker(w) => {
                self.apply_worker(w);
                None
            }
            Record::Decision(d) => {
                // A forged megabyte id (or one from an agent before ids were bounded) is
                // no megabyte kept in the judged ids, the verdicts and the what-if.
                let shortened;
                let d = if d.request_id.len() > kvscope_wire::MAX_REQUEST_ID_BYTES {
                    self.counters.request_ids_shortened += 1;
                    shortened = RoutingDecision {
                        request_id: kvscope_wire::bounded_request_id(&d.request_id).into_owned(),
                        ..d.clone()
                    };
                    &shortened
                } else {
                    d
                };
                self.learn_model(d);
                if !self.measures(d.worker.worker_id) {
                    self.counters.decisions_other_models += 1;
                    return None;
                }
                if d.check_prompt_blocks().is_err() {
                    self.counters.malformed_decisions += 1;
                    self.open_summary().data_faults += 1;
                    return None;
                }
                match self.first_judgement(&d.request_id, is_prefill(d.worker_type.as_deref())) {
                    Judgement::First => {}
                    Judgement::DecodeLeg => {
                        self.counters.decode_legs += 1;
                        return None;
                    }
                    Judgement::Again => {
                        self.counters.duplicate_decisions += 1;
                        return None;
                    }
                }
                let v = self.judge(d, env.observed_ns);
                if let Some((_, view)) = self.views_waiting.0.remove(&d.request_id) {
                    self.compare_router_view(&d.request_id, &view);
                }
                Some(v)
            }
            Record::Migration(m) => {
                self.apply_migration_line(m);
                None
            }
            Record::RequestEnd(e) => {
                self.counters.request_ends += 1;
                let id = kvscope_wire::bounded_request_id(&e.request_id);
                if let Some(r) = self.routed_request_mut(&id) {
                    r.end = Some(kvscope_wire::RequestEnd {
                        request_id: id.into_owned(),
                        ..e.clone()
                    });
                }
                None
            }
            Record::RouterView(view) => {
                self.apply_router_view(view, env.observed_ns);
                None
            }
            Record::Heartbeat(h) => {
                self.counters.heartbeats += 1;
                let a = self.agents.entry(env.agent.clone()).or_default();
                a.last_seen_ns = a.last_seen_ns.max(env.observed_ns);
                a.heartbeat = h.clone();
                None
            }
            Record::Nixl(report) => {
                self.counters.nixl_reports += 1;
                let a = self.agents.entry(env.agent.clone()).or_default();
                a.last_seen_ns = a.last_seen_ns.max(env.observed_ns);
                a.nixl = Some(report.clone());
                self.request_nixl.apply(&env.agent, &report.requests);
                self.remember_owners(&env.agent, &report.owners, env.observed_ns);
                None
            }
        }
    }

    /// Set the router's view of a judged decision beside what the engines held then: the
    /// request's judged decision, when its worker is the one the view names (a
    /// disaggregated request's other leg is not the judged one) and no view of it came
    /// before. A view can come before its decision (a decision from the request trace is
    /// written when the request ends, as the view is, and an agent's reorder window may
    /// pass between them; another agent's records may come later): it waits for it, up to
    /// [`VIEW_WAIT_NS`] of record time and [`VIEW_WAIT_MAX`] views, then is given up.
    fn apply_router_view(&mut self, view: &kvscope_wire::RouterView, at_ns: u64) {
        self.counters.router_views += 1;
        let id = kvscope_wire::bounded_request_id(&view.request_id);
        if self.routed_request(&id).is_some() {
            self.compare_router_view(&id, view);
            return;
        }
        let (waiting, order) = &mut self.views_waiting;
        if waiting.contains_key(id.as_ref()) {
            self.counters.router_views_unjoined += 1;
            return;
        }
        waiting.insert(id.to_string(), (at_ns, view.clone()));
        order.push_back(id.into_owned());
        // Give up the oldest: past the wait, or past the bound. An id whose view was
        // taken by its decision is no longer waiting and just leaves the order.
        while let Some(oldest) = order.front() {
            let expired = match waiting.get(oldest) {
                None => true,
                Some((t, _)) => {
                    order.len() > VIEW_WAIT_MAX || at_ns.saturating_sub(*t) > VIEW_WAIT_NS
                }
            };
            if !expired {
                break;
            }
            if let Some(old) = order.pop_front() {
                if waiting.remove(&old).is_some() {
                    self.counters.router_views_unjoined += 1;
                }
            }
        }
    }

    /// [`Self::apply_router_view`] once request `id` (bounded) is judged.
    fn compare_router_view(&mut self, id: &str, view: &kvscope_wire::RouterView) {
        let min_spill_blocks = self.cfg.min_spill_blocks;
        let judged = self
            .routed_request_mut(id)
            .filter(|r| r.worker == view.worker && r.router_overlap_blocks.is_none());
        let Some(r) = judged else {
            self.counters.router_views_unjoined += 1;
            return;
        };
        r.router_overlap_blocks = Some(view.overlap_blocks);
        let (held, best_held) = (r.recorded_overlap_blocks, r.recorded_best_overlap_blocks);
        let spill = r.recorded_spill_blocks(min_spill_blocks).is_some();
        let believed = view.overlap_blocks;
        // The first block the router got wrong: the one past the shorter of the two.
        let first_wrong = r.chain.get(believed.min(held) as usize).copied();
        let (worker, decided_ns, best) = (r.worker, r.decided_ns, r.recorded_best);
        // What the router credited the worker it passed over with, where it logged it, and
        // the whole blocks of it (a lower tier's weighted share may add a fraction, never
        // a block of the device prefix): the chain's block past them is the first of the
        // best's it did not credit.
        let best_credit = view
            .candidates
            .iter()
            .find(|c| c.worker == best)
            .map(|c| (c.credited_blocks, c.credited_blocks.floor() as u32));
        let first_uncredited =
            best_credit.and_then(|(_, whole)| r.chain.get(whole as usize).copied());
        let recent = &self.recent_changes;
        let why = |under: bool| match first_wrong {
            Some(b) if under => recent.why_under(worker, b, decided_ns),
            Some(b) => recent.why_over(worker, b, decided_ns),
            None => StaleCause::Unexplained,
        };
        let a = &mut self.router_view;
        a.compared += 1;
        match believed.cmp(&held) {
            std::cmp::Ordering::Equal => a.exact += 1,
            std::cmp::Ordering::Greater => {
                a.over += 1;
                a.over_blocks += u64::from(believed - held);
                match why(false) {
                    StaleCause::RemovedLately { lag_ns } => {
                        a.over_removed_lately += 1;
                        a.note_lag(lag_ns);
                    }
                    StaleCause::StoredAfter => a.over_stored_after += 1,
                    StaleCause::StoredLately { .. } | StaleCause::Unexplained => {}
                }
            }
            std::cmp::Ordering::Less => {
                a.under += 1;
                a.under_blocks += u64::from(held - believed);
                if let StaleCause::StoredLately { lag_ns } = why(true) {
                    a.under_stored_lately += 1;
                    a.note_lag(lag_ns);
                }
            }
        }
        if spill {
            a.spills += 1;
            // By its own view the router chose no worse than the best worker.
            a.spills_unseen += u64::from(believed >= best_held);
            if let Some((credit, whole)) = best_credit {
                a.spills_best_scored += 1;
                if credit < f64::from(best_held) {
                    a.spills_best_stale += 1;
                    a.spills_best_stale_blocks += u64::from(best_held.saturating_sub(whole));
                    if let Some(StaleCause::StoredLately { .. }) =
                        first_uncredited.map(|b| recent.why_under(best, b, decided_ns))
                    {
                        a.spills_best_stale_stored_lately += 1;
                    }
                }
            }
        }
    }

    /// Whether `id` was judged lately (and remember it): a disaggregated request's router
    /// picks a prefill worker and then a decode worker under one request id, and the
    /// prefill decision is the one whose cache decides the prompt's prefill.
    /// A decode decision seen before the request's prefill decision is judged as an
    /// aggregated one, and the prefill decision after it counted as a duplicate: Dynamo
    /// 1.6.1 logs the prefill decision first.
    fn first_judgement(&mut self, id: &str, prefill: bool) -> Judgement {
        const KEEP: usize = 100_000;
        let (seen, order) = &mut self.judged_ids;
        if let Some(legs) = seen.get_mut(id) {
            return match (*legs, prefill) {
                (Legs::Prefill, false) => {
                    *legs = Legs::PrefillAndDecode;
                    Judgement::DecodeLeg
                }
                _ => Judgement::Again,
            };
        }
        seen.insert(
            id.to_string(),
            if prefill { Legs::Prefill } else { Legs::One },
        );
        order.push_back(id.to_string());
        if order.len() > KEEP {
            if let Some(old) = order.pop_front() {
                seen.remove(&old);
            }
        }
        Judgement::First
    }

    /// The worker's pool as discovery describes it: prefill workers are one, every
    /// other worker (aggregated, decode) the other; `None` when not told.
    fn pool_of(&self, worker_id: u64) -> Option<bool> {
        self.fleet
            .get(&worker_id)
            .and_then(|w| w.worker_type.as_deref())
            .map(|t| is_prefill(Some(t)))
    }

    /// A worker appeared, changed or went away in discovery. A retired worker's caches
    /// are dropped, all its ranks: the process is gone, and a restarted engine comes
    /// back under a new id.
    fn apply_worker(&mut self, w: &WorkerRecord) {
        let was_up = self
            .fleet
            .get(&w.worker_id)
            .is_some_and(|old| old.state == WorkerState::Up);
        if w.state == WorkerState::Gone && was_up {
            self.counters.workers_retired += 1;
            let ranks: Vec<WorkerKey> = self
                .index
                .workers()
                .filter(|k| k.worker_id == w.worker_id)
                .collect();
            for k in ranks {
                self.counters.cleared_blocks += self.index.clear(k);
                self.recent_prompts.remove(&k);
            }
            self.incomplete.retain(|k| k.worker_id != w.worker_id);
        }
        self.fleet.insert(w.worker_id, w.clone());
    }

    fn advance_clock(&mut self, t: u64) {
        let first = *self.first_ns.get_or_insert(t);
        if t < self.watermark_ns {
            if self.open.as_ref().is_some_and(|w| t < w.summary.start_ns) {
                self.counters.late_records += 1;
            }
            return;
        }
        self.watermark_ns = t;
        let start = t - t % self.window_ns;
        let warmup_end = first.saturating_add((self.cfg.warmup_secs.max(0.0) * 1e9) as u64);
        match &self.open {
            Some(w) if w.summary.start_ns == start => {}
            Some(_) => {
                let mut next = start;
                if let Some(w) = self.open.take() {
                    next = w.summary.end_ns;
                    self.push_closed(w);
                }
                // Windows without any record still count: an idle fleet measured nothing.
                // Cap the run so a jump of days does not allocate days of windows.
                let mut filled = 0;
                while next < start && filled < self.cfg.keep_windows {
                    let w = OpenWindow::new(next, next + self.window_ns, next < warmup_end);
                    self.push_closed(w);
                    next += self.window_ns;
                    filled += 1;
                }
                self.open = Some(OpenWindow::new(
                    start,
                    start + self.window_ns,
                    start < warmup_end,
                ));
            }
            None => {
                self.open = Some(OpenWindow::new(start, start + self.window_ns, true));
            }
        }
    }

    fn push_closed(&mut self, w: OpenWindow) {
        let end = w.summary.end_ns;
        for prompts in self.recent_prompts.values_mut() {
            prompts.retain(|_, until| *until >= end);
        }
        self.closed.push_back(w.close(&self.index));
        while self.closed.len() > self.cfg.keep_windows {
            self.closed.pop_front();
        }
    }

    /// How long a routed prompt block not yet stored is remembered.
    fn prompt_memory_ns(&self) -> u64 {
        (self.cfg.prompt_memory_secs.max(0.0) * 1e9) as u64
    }

    /// How long one its worker holds is (never longer than a routed one).
    fn held_prompt_memory_ns(&self) -> u64 {
        HELD_PROMPT_MEMORY_NS.min(self.prompt_memory_ns())
    }

    fn open_summary(&mut self) -> &mut WindowSummary {
        &mut self
            .open
            .as_mut()
            .expect("advance_clock opens a window before any record is applied")
            .summary
    }

    /// The agent classifies each batch against the one before it; a batch that arrives
    /// here not following the last one applied, although the agent called it in order,
    /// was lost or reordered on the way.
    fn check_batch_order(&mut self, agent: &str, batch: &KvEventBatch) {
        let key = (agent.to_string(), batch.publisher.clone());
        let last = self.publisher_seqs.insert(key, batch.seq);
        let expected = match (last, batch.sequence) {
            (Some(l), SequenceStatus::InOrder) => l.checked_add(1),
            // `missed` comes from the wire: near u64::MAX, `missed + 1` itself overflows.
            (Some(l), SequenceStatus::Gap { missed }) => {
                missed.checked_add(1).and_then(|m| l.checked_add(m))
            }
            _ => return,
        };
        if expected != Some(batch.seq) {
            self.counters.batch_order_faults += 1;
            self.open_summary().data_faults += 1;
        }
    }

    fn apply_kv(&mut self, batch: &KvEventBatch, t: u64) {
        let worker = batch.worker;
        // The engine's own stamp (a replayed batch stands for what happened before).
        let engine_ns = (batch.sequence != SequenceStatus::Replayed
            && batch.engine_ts.is_finite()
            && batch.engine_ts > 0.0)
            .then_some((batch.engine_ts * 1e9) as u64);
        self.counters.kv_batches += 1;
        self.index.touch(worker);
        match batch.sequence {
            SequenceStatus::Gap { missed } => {
                self.counters.sequence_gaps += 1;
                // `missed` comes from the wire: saturate rather than panic (debug) or
                // wrap (release) on a crafted record.
                self.counters.missed_batches = self.counters.missed_batches.saturating_add(missed);
                self.open_summary().data_faults += 1;
            }
            SequenceStatus::Reset => {
                self.counters.sequence_resets += 1;
                self.counters.cleared_blocks += self.index.clear(worker);
                self.lower.clear(worker);
                self.incomplete.remove(&worker);
                self.open_summary().data_faults += 1;
            }
            SequenceStatus::Replayed => self.counters.replayed_batches += 1,
            SequenceStatus::First | SequenceStatus::InOrder => {}
        }
        if batch.sequence.leaves_mirror_incomplete(batch.seq) {
            self.incomplete.insert(worker);
        }
        // An engine's step publishes one batch: for a large fleet, many one-block decode
        // stores, whose first reads are loaded together here so that their misses overlap.
        self.index
            .prefetch_stores(batch.events.iter().filter_map(|ev| {
                match ev {
                    KvEvent::BlockStored {
                        block_hashes,
                        parent_block_hash,
                        medium,
                        ..
                    } if Tier::of_medium(medium.as_deref()) == Some(Tier::Device) => block_hashes
                        .first()
                        .map(|first| (worker, *parent_block_hash, *first)),
                    _ => None,
                }
            }));
        for ev in &batch.events {
            self.counters.kv_events += 1;
            let tier = match ev {
                KvEvent::BlockStored { medium, .. } | KvEvent::BlockRemoved { medium, .. } => {
                    Tier::of_medium(medium.as_deref())
                }
                KvEvent::AllBlocksCleared => Some(Tier::Device),
            };
            match tier {
                Some(Tier::Device) => {}
                Some(tier) => {
                    self.apply_lower_tier(worker, tier, ev);
                    continue;
                }
                None => {
                    self.counters.unknown_medium_events += 1;
                    self.open_summary().data_faults += 1;
                    continue;
                }
            }
            match ev {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    block_size,
                    cache_salt,
                    ..
                } => {
                    let locals = ev.stored_local_hashes().unwrap_or_default();
                    let stored =
                        self.index
                            .store_hashed(worker, *parent_block_hash, block_hashes, &locals);
                    match stored {
                        Ok(seg) => {
                            // A salted chain's first block names its tenant.
                            if let (None, Some(salt), Some(&first)) = (
                                parent_block_hash,
                                cache_salt.as_deref().filter(|s| !s.is_empty()),
                                locals.first(),
                            ) {
                                let root = kvscope_wire::sequence_hashes(&[first])[0];
                                self.tenant_roots.stored(root, salt);
                            }
                            self.counters.stored_blocks += seg.blocks.len() as u64;
                            self.recent_changes
                                .stored(worker, t, block_hashes, &seg.blocks);
                            if let Some(engine_ns) = engine_ns {
                                self.find_judged_before(engine_ns, &seg.blocks);
                            }
                            if let Some(&last) = seg.blocks.last() {
                                let ends = self.recent_store_ends.entry(worker).or_default();
                                ends.push_back((last, t));
                                if ends.len() > RECENT_STORE_ENDS {
                                    ends.pop_front();
                                }
                            }
                            let held_until = t.saturating_add(self.held_prompt_memory_ns());
                            let mut prompts = self.recent_prompts.get_mut(&worker);
                            for b in &seg.blocks {
                                match prompts.as_mut().and_then(|p| p.get_mut(b)) {
                                    Some(until) => *until = (*until).min(held_until),
                                    None => {
                                        self.index.mark_generated(worker, *b);
                                        self.counters.generated_blocks += 1;
                                    }
                                }
                            }
                            if seg.token_count_mismatch {
                                self.counters.token_count_mismatches += 1;
                            }
                            let min = self.cfg.min_spill_blocks.max(1);
                            let e = &mut self.open_summary().event_only;
                            e.segments += 1;
                            if seg.held_elsewhere >= min {
                                e.spills += 1;
                                // `block_size` comes from the wire.
                                e.delta_tokens = e.delta_tokens.saturating_add(
                                    u64::from(seg.held_elsewhere) * u64::from(*block_size),
                                );
                            }
                        }
                        Err(MirrorError::UnknownParent) => {
                            self.counters.unknown_parent_events += 1;
                            self.open_summary().data_faults += 1;
                        }
                        Err(MirrorError::TokenCountMismatch) => {
                            self.counters.token_count_mismatches += 1;
                            self.open_summary().data_faults += 1;
                        }
                    }
                }
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    self.recent_changes.removed(worker, t, block_hashes);
                    let out = self.index.remove(worker, block_hashes);
                    self.counters.removed_blocks += out.removed;
                    if out.unknown > 0 {
                        self.counters.unknown_removed_blocks += out.unknown;
                        self.open_summary().data_faults += 1;
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.counters.cleared_blocks += self.index.clear(worker);
                    // Whatever was missed is gone now.
                    self.incomplete.remove(&worker);
                }
            }
        }
    }

    /// A host or disk tier's store or removal, applied to the lower-tier mirror.
    fn apply_lower_tier(&mut self, worker: WorkerKey, tier: Tier, ev: &KvEvent) {
        self.counters.lower_tier_events += 1;
        let out = match ev {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                ..
            } => {
                let locals = ev.stored_local_hashes().unwrap_or_default();
                match self.lower.store(
                    tier,
                    worker,
                    *parent_block_hash,
                    block_hashes,
                    &locals,
                    &self.index,
                ) {
                    Ok(out) => out,
                    Err(_) => {
                        self.counters.unknown_parent_events += 1;
                        self.open_summary().data_faults += 1;
                        return;
                    }
                }
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                self.lower.remove(tier, worker, block_hashes)
            }
            KvEvent::AllBlocksCleared => return,
        };
        let c = &mut self.counters;
        c.lower_tier_stored_blocks += out.stored;
        c.lower_tier_removed_blocks += out.removed;
        if out.unknown > 0 {
            c.lower_tier_unknown_blocks += out.unknown;
            self.open_summary().data_faults += 1;
        }
    }

    /// Blocks an engine stored at `engine_ns` have just been applied: every verdict
    /// judged after that moment whose chain holds one of them was judged without it.
    fn find_judged_before(&mut self, engine_ns: u64, blocks: &[SequenceHash]) {
        if self.judged.back().is_none_or(|j| j.decided_ns <= engine_ns) {
            return;
        }
        let blocks: std::collections::HashSet<&SequenceHash> = blocks.iter().collect();
        let mut found = Vec::new();
        for j in self.judged.iter_mut().rev() {
            if j.decided_ns <= engine_ns {
                break;
            }
            if !j.flagged && j.chain.iter().any(|b| blocks.contains(b)) {
                j.flagged = true;
                found.push(j.request_id.clone());
            }
        }
        for id in found {
            self.counters.verdicts_judged_before_event += 1;
            self.open_summary().data_faults += 1;
            if let Some(v) = self.verdicts.iter_mut().rev().find(|v| v.request_id == id) {
                v.judged_before_event = true;
            }
        }
    }

    fn judge(&mut self, d: &RoutingDecision, t: u64) -> SpillVerdict {
        self.counters.decisions += 1;
        if !self.index.knows_worker(&d.worker) {
            self.counters.decisions_for_unseen_workers += 1;
        }
        let matched = match &d.sequence_hashes {
            Some(seq) => self.index.match_seq_chain(seq),
            None => self.index.match_chain(&d.local_hashes),
        };
        let chain = matched.chain;
        if chain.len() <= JUDGED_MEMORY_HASHES {
            self.judged_hashes += chain.len();
            self.judged.push_back(Judged {
                decided_ns: t,
                request_id: d.request_id.clone(),
                chain: chain.clone(),
                flagged: false,
            });
        }
        while self.judged.len() > JUDGED_MEMORY
            || self.judged_hashes > JUDGED_MEMORY_HASHES
            || self
                .judged
                .front()
                .is_some_and(|j| j.decided_ns.saturating_add(JUDGED_MEMORY_NS) < t)
        {
            let Some(j) = self.judged.pop_front() else {
                break;
            };
            self.judged_hashes -= j.chain.len();
        }
        // The router could only have chosen among the workers serving the request's
        // model (the chosen worker's): a worker of another model holding the same
        // tokens is no candidate, whatever its overlap.
        let model = self.model_of(d.worker.worker_id).map(str::to_string);
        let mut overlaps = matched.overlaps;
        match &model {
            Some(m) => {
                // A worker whose model nobody named (no discovery record, never chosen
                // with a model on the line) is no candidate: counted when it held
                // more of the prompt than the chosen worker.
                let chosen = overlaps.get(&d.worker).copied().unwrap_or(0);
                let mut unknown_held_more = false;
                overlaps.retain(|w, o| match self.model_of(w.worker_id) {
                    Some(x) => x == m.as_str(),
                    None => {
                        unknown_held_more |= *o > chosen;
                        false
                    }
                });
                if unknown_held_more {
                    self.counters.verdicts_left_out_unknown_model += 1;
                }
            }
            // Neither discovery nor the router's line names the model: judged among
            // every worker, which mixes models on a fleet that serves several.
            None => self.counters.verdicts_model_unknown += 1,
        }
        // Nor, on a disaggregated fleet, a worker of the other pool: a prefill decision
        // chooses among prefill workers.
        if let Some(pool) = self.pool_of(d.worker.worker_id) {
            overlaps.retain(|w, _| self.pool_of(w.worker_id).is_none_or(|p| p == pool));
        }
        let mut v = verdict::judge_matched(
            &self.index,
            d,
            &chain,
            overlaps,
            t,
            self.cfg.min_spill_blocks,
        );
        v.model = model;
        // The tenant a field of the request named (the agent was told which), else the
        // cache salt its chain's first block was stored under.
        v.tenant = d.tenant.clone().or_else(|| {
            chain
                .first()
                .and_then(|&root| self.tenant_roots.tenant_of(root))
                .map(|salt| salt.to_string())
        });
        verdict::extend_through_lower_tiers(&mut v, &self.lower, &chain);
        if let Some(believed) = d.selection.lower_tiers {
            self.tier_view.compare(believed, v.chosen_lower_tiers);
        }
        // Any worker the router could have chosen with a mirror missing events makes the
        // best (or the chosen worker's overlap) possibly wrong.
        v.incomplete_mirror = self
            .incomplete
            .iter()
            .any(|w| v.model.is_none() || self.model_of(w.worker_id) == v.model.as_deref());
        if v.incomplete_mirror {
            self.counters.verdicts_on_incomplete_mirror += 1;
            self.open_summary().data_faults += 1;
        }
        if v.clock_behind_ms.is_some() {
            self.counters.verdicts_clock_behind += 1;
            self.open_summary().data_faults += 1;
        }
        let last = chain.last().copied();
        // The blocks the chosen worker holds already are remembered as stored ones.
        let held = (v.chosen_overlap_blocks as usize).min(chain.len());
        let held_until = t.saturating_add(self.held_prompt_memory_ns());
        let routed_until = t.saturating_add(self.prompt_memory_ns());
        let prompts = self.recent_prompts.entry(d.worker).or_default();
        for (i, &b) in chain.iter().enumerate() {
            let until = if i < held { held_until } else { routed_until };
            let e = prompts.entry(b).or_insert(until);
            *e = (*e).max(until);
        }
        // The best worker's first: the longest cached prefix ends where the previous
        // turn's reply does (the chosen worker may hold an older turn's).
        let decoded_tail = self
            .index
            .generated_tail(&v.best, &chain[..v.best_overlap_blocks as usize])
            .or_else(|| {
                self.index
                    .generated_tail(&v.chosen, &chain[..v.chosen_overlap_blocks as usize])
            });
        if decoded_tail.is_some() {
            self.counters.prompts_reaching_generated_blocks += 1;
        }
        self.routed_hashes += chain.len() + ROUTED_REQUEST_WEIGHT;
        self.routed_at.insert(
            d.request_id.clone(),
            self.routed_first + self.routed.len() as u64,
        );
        self.routed.push_back(RoutedRequest {
            request_id: d.request_id.clone(),
            decided_ns: v.decided_ns,
            model: v.model.clone(),
            worker: d.worker,
            chain,
            isl_tokens: d.isl_tokens,
            block_size: d.block_size,
            recorded_overlap_blocks: v.chosen_overlap_blocks,
            recorded_best: v.best,
            recorded_best_overlap_blocks: v.best_overlap_blocks,
            decoded_tail,
            selection: d.selection,
            router_overlap_blocks: None,
            end: None,
        });
        while self.routed_hashes > ROUTED_MEMORY_HASHES {
            let Some(r) = self.routed.pop_front() else {
                break;
            };
            if self.routed_at.get(&r.request_id) == Some(&self.routed_first) {
                self.routed_at.remove(&r.request_id);
            }
            self.routed_first += 1;
            self.routed_hashes -= r.chain.len() + ROUTED_REQUEST_WEIGHT;
        }
        if d.blocks() > 0 && v.chosen_overlap_blocks as usize == d.blocks() {
            self.counters.decisions_fully_cached += 1;
            let just_stored = self.recent_store_ends.get(&d.worker).is_some_and(|ends| {
                ends.iter()
                    .any(|(b, at)| Some(*b) == last && t.saturating_sub(*at) < OWN_PREFILL_NS)
            });
            if just_stored {
                v.after_own_prefill = true;
                self.counters.verdicts_after_own_prefill += 1;
                self.open_summary().data_faults += 1;
            }
        }
        if v.spill {
            self.counters.spills += 1;
        }
        self.add_totals(&v);
        self.open
            .as_mut()
            .expect("window opened by advance_clock")
            .add_verdict(&v);
        self.verdicts.push_back(v.clone());
        while self.verdicts.len() > self.cfg.keep_verdicts {
            self.verdicts.pop_front();
        }
        v
    }

    fn add_totals(&mut self, v: &SpillVerdict) {
        let t = &mut self.totals;
        if let Some(m) = &v.model {
            t.models.entry(m.clone()).or_default().add(v);
        }
        t.tenants.add(v);
        // Token counts come from the wire (a decision's `isl_tokens`, a block size):
        // saturate so a crafted record cannot overflow a total.
        t.prompt_tokens = t.prompt_tokens.saturating_add(v.isl_tokens);
        t.uncached_prefill_tokens = t
            .uncached_prefill_tokens
            .saturating_add(v.uncached_prefill_tokens);
        let chosen = t.workers.entry(v.chosen).or_default();
        chosen.decisions += 1;
        chosen.prompt_tokens = chosen.prompt_tokens.saturating_add(v.isl_tokens);
        chosen.cached_prompt_tokens = chosen
            .cached_prompt_tokens
            .saturating_add(v.isl_tokens.saturating_sub(v.uncached_prefill_tokens));
        if v.spill {
            chosen.spills_in += 1;
            t.workers.entry(v.best).or_default().spills_out += 1;
            // The trace the verdict's span is in: the router's own, or derived.
            let trace = verdict::trace_id_hex(v);
            t.true_delta
                .observe_traced(v.true_delta_tokens, trace.clone(), v.decided_ns);
            t.upper_bound
                .observe_traced(v.upper_bound_tokens, trace, v.decided_ns);
            t.generated_delta_tokens = t
                .generated_delta_tokens
                .saturating_add(v.generated_delta_tokens);
            t.onload_delta_tokens = t.onload_delta_tokens.saturating_add(v.onload_delta_tokens);
        }
    }

    fn apply_migration_line(&mut self, m: &MigrationLogLine) {
        self.counters.migration_lines += 1;
        for w in [
            &mut self.totals.migration_log,
            &mut self
                .open
                .as_mut()
                .expect("advance_clock opens a window before any record is applied")
                .summary
                .migration_log,
        ] {
            match m.kind {
                MigrationLogKind::Spill => {
                    w.spill_lines += 1;
                    // Parsed from a router log line: saturate on a crafted value.
                    w.spill_migratable_tokens = w
                        .spill_migratable_tokens
                        .saturating_add(m.migratable_tokens.unwrap_or(0));
                }
                MigrationLogKind::HandshakeObtained => w.handshakes_obtained += 1,
                MigrationLogKind::DispatchFailed => w.dispatch_failures += 1,
                MigrationLogKind::DecodingOnTarget => w.decoding_on_target += 1,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{batch, decision, env, stored, stored_under, w};
    use kvscope_wire::AgentHeartbeat;
    use kvscope_wire::LowerTierBlocks;

    const S: u64 = 1_000_000_000;

    #[test]
    fn owners_stay_told_after_their_process_is_gone() {
        let mut a = FleetAnalyzer::new(AnalyzerConfig::default());
        let owner = |agent: &str, worker_id: u64| NixlAgentOwner {
            agent: agent.into(),
            pid: 7,
            worker_id: Some(worker_id),
            dp_rank: None,
            how: "parent process 6".into(),
        };
        let report = |owners: Vec<NixlAgentOwner>| {
            Record::Nixl(kvscope_wire::nixl::NixlReport {
                owners,
                ..Default::default()
            })
        };
        a.apply(&env(S, report(vec![owner("d0", 1), owner("d1", 2)])));
        // d1's engine restarted as another worker; d0's process is gone.
        a.apply(&env(2 * S, report(vec![owner("d1", 3)])));
        a.apply(&env(3 * S, report(vec![])));
        assert!(crate::nixl::owners(a.agents()).is_empty());
        let told: Vec<(String, Option<u64>)> = a
            .owners_ever_told()
            .into_iter()
            .map(|r| (r.owner.agent, r.owner.worker_id))
            .collect();
        assert_eq!(told, [("d0".into(), Some(1)), ("d1".into(), Some(3))]);
        // A report naming more agents than are remembered keeps the newest told.
        let many: Vec<NixlAgentOwner> = (0..MAX_TOLD_OWNERS as u64 + 10)
            .map(|i| owner(&format!("x{i}"), 100 + i))
            .collect();
        a.apply(&env(4 * S, report(many)));
        let told = a.owners_ever_told();
        assert_eq!(told.len(), MAX_TOLD_OWNERS);
        assert!(!told
            .iter()
            .any(|r| r.owner.agent == "d0" || r.owner.agent == "d1"));
    }

    /// An analyzer whose worker 1 has stored tokens 0..8 as four blocks of 2, at time 1;
    /// and those tokens.
    fn four_blocks_on_worker_1() -> (FleetAnalyzer, Vec<u32>) {
        let mut a = FleetAnalyzer::new(cfg());
        let toks: Vec<u32> = (0..8).collect();
        a.apply(&env(
            1,
            stored(1, 0, SequenceStatus::First, &toks, &[1, 2, 3, 4]),
        ));
        (a, toks)
    }

    fn worker(id: u64, state: WorkerState) -> Record {
        Record::Worker(WorkerRecord {
            worker_id: id,
            state,
            model: Some("m".into()),
            block_size: Some(2),
            total_kv_blocks: Some(8),
            dp_ranks: vec![0],
            worker_type: None,
        })
    }

    #[test]
    fn without_discovery_a_worker_s_model_is_learned_from_the_router_s_decisions() {
        // Workers 1 (model a) and 2 (model b) hold the same prompt; no discovery
        // record. A request of model a routed to worker 3 (a, empty) is a spill from
        // worker 1 only, never from worker 2, once each worker's model is known.
        let toks: Vec<u32> = (0..8).collect();
        let named = |id: &str, to: u64, model: Option<&str>| match decision(id, to, &toks) {
            Record::Decision(mut d) => {
                d.model = model.map(str::to_string);
                Record::Decision(d)
            }
            _ => unreachable!(),
        };
        let run = |b_named: bool| {
            let mut a = FleetAnalyzer::new(cfg());
            a.apply(&env(
                1,
                stored(1, 0, SequenceStatus::First, &toks, &[1, 2, 3, 4]),
            ));
            a.apply(&env(
                1,
                stored(2, 0, SequenceStatus::First, &toks, &[5, 6, 7, 8]),
            ));
            a.apply(&env(2, named("a1", 1, Some("a"))));
            a.apply(&env(3, named("b1", 2, b_named.then_some("b"))));
            let v = a.apply(&env(4, named("a2", 3, Some("a")))).unwrap();
            (a, v)
        };
        let (a, v) = run(true);
        assert_eq!(a.model_of(2), Some("b"));
        assert_eq!(v.model.as_deref(), Some("a"));
        assert_eq!(v.best, w(1), "judged among model a's workers");
        assert!(!v.overlaps.contains_key(&w(2)));
        assert_eq!(a.models_learned().count(), 3);
        assert_eq!(a.counters().verdicts_left_out_unknown_model, 0);
        assert_eq!(a.counters().verdicts_model_unknown, 0);
        // Worker 2's model never named: left out as a candidate, and said.
        let (a, v) = run(false);
        assert_eq!(a.model_of(2), None);
        assert!(!v.overlaps.contains_key(&w(2)));
        assert_eq!(a.counters().verdicts_left_out_unknown_model, 1);
        assert_eq!(
            a.counters().verdicts_model_unknown,
            1,
            "b1 judged model-blind"
        );
        // Discovery's word stands over a line's.
        let mut a = FleetAnalyzer::new(cfg());
        a.apply(&env(1, worker(1, WorkerState::Up)));
        a.apply(&env(2, named("x", 1, Some("other"))));
        assert_eq!(a.model_of(1), Some("m"));
        assert_eq!(a.counters().decisions_model_mismatch, 1);
        assert_eq!(a.models_learned().count(), 0);
    }

    #[test]
    fn a_disaggregated_request_is_judged_on_its_prefill_pool() {
        // Workers 1 and 2 prefill, 3 decodes; the decode worker holds the whole prompt
        // (a decode engine publishing its cache), prefill worker 1 half of it.
        let mut a = FleetAnalyzer::new(cfg());
        let typed = |id: u64, t: &str| match worker(id, WorkerState::Up) {
            Record::Worker(mut r) => {
                r.worker_type = Some(t.into());
                Record::Worker(r)
            }
            other => other,
        };
        for (id, t) in [(1, "prefill"), (2, "prefill"), (3, "decode")] {
            a.apply(&env(1, typed(id, t)));
        }
        let toks: Vec<u32> = (0..8).collect();
        a.apply(&env(
            2,
            stored(1, 0, SequenceStatus::First, &toks[..4], &[1, 2]),
        ));
        a.apply(&env(
            2,
            stored(3, 0, SequenceStatus::First, &toks, &[1, 2, 3, 4]),
        ));
        let leg = |to: u64, t: &str| match decision("r1", to, &toks) {
            Record::Decision(mut d) => {
                d.worker_type = Some(t.into());
                Record::Decision(d)
            }
            other => other,
        };
        // The router sends the prefill to worker 2: a spill from worker 1, not from the
        // decode worker, which the prefill router could not choose.
        let v = a.apply(&env(S, leg(2, "prefill"))).unwrap();
        assert!(v.spill);
        assert_eq!((v.best, v.best_overlap_blocks), (w(1), 2));
        assert!(!v.overlaps.contains_key(&w(3)), "{:?}", v.overlaps);
        // Its decode decision is the same request's other leg: counted, not judged, not
        // a duplicate.
        assert!(a.apply(&env(S, leg(3, "decode"))).is_none());
        // A repeated line of either leg is a duplicate.
        assert!(a.apply(&env(S, leg(2, "prefill"))).is_none());
        assert!(a.apply(&env(S, leg(3, "decode"))).is_none());
        let c = a.counters();
        assert_eq!(
            (c.decisions, c.decode_legs, c.duplicate_decisions),
            (1, 1, 2)
        );
    }

    #[test]
    fn a_decision_applied_right_after_its_own_prefill_is_flagged() {
        // Worker 1 stores the prompt at time 1 ns; the router's log, 50 ms behind the
        // engine's clock, puts the decision for that very prompt after it.
        let (mut a, toks) = four_blocks_on_worker_1();
        let v = a
            .apply(&env(50_000_000, decision("skewed", 1, &toks)))
            .unwrap();
        assert!(v.after_own_prefill);
        assert_eq!(a.counters().verdicts_after_own_prefill, 1);
        // The same prompt seconds later (a repeated prompt): fully cached, not flagged.
        let v = a.apply(&env(5 * S, decision("repeat", 1, &toks))).unwrap();
        assert!(!v.after_own_prefill);
        assert_eq!(a.counters().decisions_fully_cached, 2);
        assert_eq!(a.counters().verdicts_after_own_prefill, 1);
    }

    #[test]
    fn a_verdict_judged_before_an_event_it_depends_on_is_found_and_flagged() {
        let mut a = FleetAnalyzer::new(cfg());
        let toks: Vec<u32> = (0..8).collect();
        let at = |secs: f64, r: Record| match r {
            Record::KvEvents(mut b) => {
                b.engine_ts = secs;
                Record::KvEvents(b)
            }
            other => other,
        };
        // Worker 1 stores the first half of the prompt; the decision for the whole of
        // it comes at 10 s.
        a.apply(&env(
            S,
            at(
                1.0,
                stored(1, 0, SequenceStatus::First, &toks[..4], &[1, 2]),
            ),
        ));
        let v = a.apply(&env(10 * S, decision("late", 2, &toks))).unwrap();
        assert_eq!(v.overlaps.get(&w(1)), Some(&2));
        // The rest of the prompt, stored by worker 1 at 9.5 s by its engine's clock,
        // reaches the collector after the decision: the verdict missed it.
        a.apply(&env(
            10 * S,
            at(
                9.5,
                Record::KvEvents(KvEventBatch {
                    worker: w(1),
                    publisher: "p1".into(),
                    origin: Default::default(),
                    seq: 1,
                    sequence: SequenceStatus::InOrder,
                    engine_ts: 0.0,
                    events: vec![KvEvent::BlockStored {
                        block_hashes: vec![3, 4],
                        parent_block_hash: Some(2),
                        token_ids: toks[4..].to_vec(),
                        block_size: 2,
                        local_hashes: None,
                        lora_name: None,
                        medium: None,
                        cache_salt: None,
                    }],
                }),
            ),
        ));
        assert_eq!(a.counters().verdicts_judged_before_event, 1);
        assert!(a.recent_verdicts().next_back().unwrap().judged_before_event);
        // A store stamped after the decision (its own prefill, say) is no such event.
        a.apply(&env(
            11 * S,
            at(
                10.5,
                stored(2, 0, SequenceStatus::First, &toks, &[9, 8, 7, 6]),
            ),
        ));
        assert_eq!(a.counters().verdicts_judged_before_event, 1);
    }

    #[test]
    fn a_worker_that_leaves_discovery_is_retired_and_never_named_again() {
        let (mut a, toks) = four_blocks_on_worker_1();
        a.apply(&env(2, worker(1, WorkerState::Up)));
        a.apply(&env(2, worker(2, WorkerState::Up)));
        let v = a.apply(&env(3, decision("r1", 2, &toks))).unwrap();
        assert_eq!((v.best, v.best_overlap_blocks), (w(1), 4));
        // The same request decided again is counted, not judged twice.
        assert!(a.apply(&env(3, decision("r1", 2, &toks))).is_none());
        assert_eq!(a.counters().duplicate_decisions, 1);
        a.apply(&env(4, worker(1, WorkerState::Gone)));
        assert_eq!(a.index().cached_blocks(&w(1)), 0, "its mirror is dropped");
        assert_eq!(a.counters().workers_retired, 1);
        // Its late events are not applied; no later verdict names it.
        a.apply(&env(
            5,
            stored(1, 1, SequenceStatus::InOrder, &toks, &[1, 2, 3, 4]),
        ));
        assert_eq!(a.counters().batches_for_retired_workers, 1);
        let v = a.apply(&env(6, decision("r2", 2, &toks))).unwrap();
        assert!(
            v.overlaps.keys().all(|k| k.worker_id != 1),
            "{:?}",
            v.overlaps
        );
        assert_eq!(a.fleet()[&1].state, WorkerState::Gone);
        // A second Gone counts nothing more.
        a.apply(&env(7, worker(1, WorkerState::Gone)));
        assert_eq!(a.counters().workers_retired, 1);
    }

    fn cfg() -> AnalyzerConfig {
        AnalyzerConfig {
            window_secs: 1.0,
            warmup_secs: 1.0,
            ..Default::default()
        }
    }

    #[test]
    fn windows_close_on_record_time_and_warmup_is_flagged() {
        let mut a = FleetAnalyzer::new(cfg());
        let toks: Vec<u32> = (0..8).collect();
        a.apply(&env(
            S / 2,
            stored(1, 0, SequenceStatus::First, &toks, &[1, 2, 3, 4]),
        ));
        for i in 0..5u64 {
            let t = (i + 1) * S + S / 2;
            a.apply(&env(t, decision(&format!("r{i}"), 2, &toks)));
        }
        a.apply(&env(10 * S, Record::Heartbeat(AgentHeartbeat::default())));
        let closed: Vec<_> = a.closed_windows().map(|w| w.summary.clone()).collect();
        assert_eq!(
            closed.len(),
            10,
            "windows 0..10 closed, window 10 still open"
        );
        assert!(
            closed[0].warmup && closed[1].warmup,
            "first record at 0.5 s, warm-up to 1.5 s"
        );
        assert!(!closed[2].warmup);
        assert_eq!(closed[2].spills, 1);
        assert_eq!(closed[2].true_delta_tokens, 8);
        assert_eq!(closed[2].workers[&w(2)].spills_in, 1);
        assert_eq!(closed[2].workers[&w(1)].spills_out, 1);
        assert_eq!(closed[2].workers[&w(1)].cached_blocks, 4);
        assert_eq!(closed[7].requests, 0);
        assert_eq!(closed[7].spill_rate, None);
    }

    #[test]
    fn gaps_resets_and_unknown_blocks_are_counted_and_flag_the_window() {
        let mut a = FleetAnalyzer::new(cfg());
        let toks: Vec<u32> = (0..4).collect();
        a.apply(&env(1, stored(1, 0, SequenceStatus::First, &toks, &[1, 2])));
        a.apply(&env(
            2,
            stored(1, 5, SequenceStatus::Gap { missed: 4 }, &toks, &[3, 4]),
        ));
        a.apply(&env(3, stored(1, 0, SequenceStatus::Reset, &toks, &[1, 2])));
        a.apply(&env(
            4,
            batch(
                1,
                1,
                SequenceStatus::InOrder,
                vec![
                    KvEvent::BlockRemoved {
                        block_hashes: vec![42],
                        medium: None,
                    },
                    KvEvent::BlockStored {
                        block_hashes: vec![9],
                        parent_block_hash: Some(77),
                        token_ids: vec![1, 2],
                        block_size: 2,
                        local_hashes: None,
                        lora_name: None,
                        medium: None,
                        cache_salt: None,
                    },
                ],
            ),
        ));
        let c = a.counters();
        assert_eq!(
            (c.sequence_gaps, c.missed_batches, c.sequence_resets),
            (1, 4, 1)
        );
        assert_eq!(
            c.cleared_blocks, 2,
            "the reset cleared the engine-hash aliases 1,2 / 3,4 of the same two blocks"
        );
        assert_eq!(c.unknown_removed_blocks, 1);
        assert_eq!(c.unknown_parent_events, 1);
        assert_eq!(a.open_window().unwrap().data_faults, 4);
        assert_eq!(a.index().cached_blocks(&w(1)), 2);
    }

    #[test]
    fn a_crafted_gap_near_u64_max_saturates_the_counter_instead_of_panicking() {
        let mut a = FleetAnalyzer::new(cfg());
        let toks: Vec<u32> = (0..2).collect();
        a.apply(&env(1, stored(1, 0, SequenceStatus::First, &toks, &[1])));
        let huge = u64::MAX - 1;
        // `missed + 1` and `last + missed + 1` both overflow here: the order check must
        // call it a fault, not panic.
        a.apply(&env(
            2,
            stored(1, 1, SequenceStatus::Gap { missed: huge }, &toks, &[2]),
        ));
        assert_eq!(a.counters().missed_batches, huge);
        a.apply(&env(
            3,
            stored(1, 2, SequenceStatus::Gap { missed: huge }, &toks, &[3]),
        ));
        // The largest gap a record can claim: `missed + 1` alone overflows.
        a.apply(&env(
            4,
            stored(1, 3, SequenceStatus::Gap { missed: u64::MAX }, &toks, &[4]),
        ));
        let c = a.counters();
        assert_eq!(c.missed_batches, u64::MAX, "saturated, not wrapped");
        assert_eq!(c.sequence_gaps, 3);
        assert_eq!(
            c.batch_order_faults, 3,
            "neither gap explains the next sequence number"
        );
    }

    #[test]
    fn decisions_with_impossible_token_counts_are_counted_not_judged() {
        let (mut a, toks) = four_blocks_on_worker_1();
        let crafted = |id: &str, isl_tokens, block_size| {
            let Record::Decision(mut d) = decision(id, 2, &toks) else {
                unreachable!()
            };
            d.isl_tokens = isl_tokens;
            d.block_size = block_size;
            Record::Decision(d)
        };
        for (id, isl, bs) in [("huge", u64::MAX - 3, 2), ("short", 7, 2), ("zero", 8, 0)] {
            assert_eq!(a.apply(&env(2, crafted(id, isl, bs))), None, "{id}");
        }
        // A partial last block is not hashed: 9 tokens in blocks of 2 are 4 blocks.
        assert!(a.apply(&env(2, crafted("partial", 9, 2))).is_some());
        let c = a.counters();
        assert_eq!((c.malformed_decisions, c.decisions), (3, 1));
        assert_eq!(a.totals().prompt_tokens, 9);
        assert_eq!(a.open_window().unwrap().data_faults, 3);
    }

    #[test]
    fn token_totals_and_window_sums_saturate() {
        let (mut a, toks) = four_blocks_on_worker_1();
        // Well-formed decisions are bounded by their size, but not their sum over a
        // long run: start the sums near the top.
        a.apply(&env(2, decision("r0", 2, &toks)));
        a.totals.prompt_tokens = u64::MAX - 3;
        a.totals.uncached_prefill_tokens = u64::MAX - 3;
        a.totals.workers.get_mut(&w(2)).unwrap().prompt_tokens = u64::MAX - 3;
        let open = a.open_summary();
        open.isl_tokens = u64::MAX - 3;
        open.workers.get_mut(&w(2)).unwrap().uncached_prefill_tokens = u64::MAX - 3;
        for id in ["r1", "r2"] {
            let Record::Decision(mut d) = decision(id, 2, &toks) else {
                unreachable!()
            };
            d.isl_tokens += 1; // one uncached token past the cached blocks
            a.apply(&env(2, Record::Decision(d)));
        }
        let t = a.totals();
        assert_eq!(t.prompt_tokens, u64::MAX);
        assert_eq!(t.uncached_prefill_tokens, u64::MAX);
        assert_eq!(t.workers[&w(2)].prompt_tokens, u64::MAX);
        let open = a.open_window().unwrap();
        assert_eq!(open.isl_tokens, u64::MAX);
        assert_eq!(open.workers[&w(2)].uncached_prefill_tokens, u64::MAX);
        for tokens in [u64::MAX - 1, 5] {
            a.apply(&env(
                3,
                Record::Migration(MigrationLogLine {
                    kind: MigrationLogKind::Spill,
                    request_id: None,
                    source: None,
                    target: None,
                    tokens: None,
                    migratable_tokens: Some(tokens),
                    fields: Default::default(),
                    trace: None,
                }),
            ));
        }
        assert_eq!(a.totals().migration_log.spill_migratable_tokens, u64::MAX);
    }

    #[test]
    fn batches_lost_or_reordered_after_the_agent_are_data_faults() {
        let mut a = FleetAnalyzer::new(cfg());
        let toks: Vec<u32> = (0..2).collect();
        a.apply(&env(1, stored(1, 0, SequenceStatus::First, &toks, &[1])));
        a.apply(&env(2, stored(1, 1, SequenceStatus::InOrder, &toks, &[2])));
        // Batch 2 dropped by a full agent buffer: 3 arrives "in order".
        a.apply(&env(3, stored(1, 3, SequenceStatus::InOrder, &toks, &[3])));
        // A gap the agent saw and reported is not counted twice.
        a.apply(&env(
            4,
            stored(1, 6, SequenceStatus::Gap { missed: 2 }, &toks, &[4]),
        ));
        assert_eq!(a.counters().batch_order_faults, 1);
        assert_eq!(a.counters().sequence_gaps, 1);
    }

    #[test]
    fn a_decision_for_a_prompt_already_cached_whole_is_counted() {
        let (mut a, toks) = four_blocks_on_worker_1();
        a.apply(&env(2, decision("late", 1, &toks)));
        a.apply(&env(
            3,
            decision("new-turn", 1, &(0..10).collect::<Vec<u32>>()),
        ));
        assert_eq!(a.counters().decisions_fully_cached, 1);
    }

    #[test]
    fn only_a_live_collector_stamps_when_a_verdict_became_available() {
        let mut a = FleetAnalyzer::new(cfg());
        let toks: Vec<u32> = (0..8).collect();
        let v = a.apply(&env(2, decision("r1", 1, &toks))).unwrap();
        assert_eq!(v.available_ns, None, "the fold reads no clock");
        // Replayed at start: stamped, but its delay is not the pipeline's.
        a.stamp_latest_verdict(77, false);
        let v2 = a.apply(&env(3, decision("r2", 1, &toks))).unwrap();
        let stamps: Vec<_> = a.recent_verdicts().map(|v| v.available_ns).collect();
        assert_eq!(stamps, vec![Some(77), None]);
        assert_eq!(a.verdict_delay().count, 0);
        a.stamp_latest_verdict(v2.decided_ns + 30_000_000, true);
        let d = a.verdict_delay();
        assert_eq!((d.count, d.sum_ns, d.max_ns), (1, 30_000_000, 30_000_000));
        assert_eq!(d.quantile_ns(0.99), Some(30_000_000));
        // A decision stamped near the epoch (a synthetic or skewed source) saturates the
        // sum instead of overflowing it.
        let mut a = FleetAnalyzer::new(cfg());
        for r in ["r3", "r4", "r5"] {
            a.apply(&env(1, decision(r, 1, &toks)));
            a.stamp_latest_verdict(u64::MAX / 2, true);
        }
        assert_eq!(a.verdict_delay().count, 3);
        assert_eq!(a.verdict_delay().sum_ns, u64::MAX);
    }

    #[test]
    fn a_prompt_block_is_remembered_until_stored_then_for_a_minute() {
        let mut a = FleetAnalyzer::new(cfg());
        let prompt: Vec<u32> = (0..4).collect();
        let removed = |seq: u64| {
            batch(
                1,
                seq,
                SequenceStatus::InOrder,
                vec![KvEvent::BlockRemoved {
                    block_hashes: vec![1, 2],
                    medium: None,
                }],
            )
        };
        let stored_again = |seq: u64| stored(1, seq, SequenceStatus::InOrder, &prompt, &[1, 2]);
        a.apply(&env(S, decision("r1", 1, &prompt)));
        // Prefilled 200 s later (windows closed meanwhile): still a prompt.
        a.apply(&env(
            200 * S,
            stored(1, 0, SequenceStatus::First, &prompt, &[1, 2]),
        ));
        assert_eq!(a.counters().generated_blocks, 0);
        // Evicted and computed again within a minute (a preempted request): a prompt.
        a.apply(&env(210 * S, removed(1)));
        a.apply(&env(230 * S, stored_again(2)));
        assert_eq!(a.counters().generated_blocks, 0);
        // More than a minute after that store, the blocks are forgotten.
        a.apply(&env(240 * S, removed(3)));
        a.apply(&env(300 * S, stored_again(4)));
        assert_eq!(a.counters().generated_blocks, 2);
        // Routed while the worker holds them: remembered a minute from the decision.
        a.apply(&env(310 * S, decision("r2", 1, &prompt)));
        a.apply(&env(320 * S, removed(5)));
        a.apply(&env(360 * S, stored_again(6)));
        assert_eq!(a.counters().generated_blocks, 2);
        a.apply(&env(370 * S, removed(7)));
        a.apply(&env(500 * S, stored_again(8)));
        assert_eq!(a.counters().generated_blocks, 4);
        // Routed and not stored: remembered for prompt_memory_secs (600 s).
        let other: Vec<u32> = (10..14).collect();
        a.apply(&env(510 * S, decision("r3", 1, &other)));
        a.apply(&env(
            1_000 * S,
            stored(1, 9, SequenceStatus::InOrder, &other, &[11, 12]),
        ));
        assert_eq!(a.counters().generated_blocks, 4);
        let late: Vec<u32> = (20..24).collect();
        a.apply(&env(1_010 * S, decision("r4", 1, &late)));
        a.apply(&env(
            1_700 * S,
            stored(1, 10, SequenceStatus::InOrder, &late, &[21, 22]),
        ));
        assert_eq!(a.counters().generated_blocks, 6);
    }

    /// The router's view of request `id`: `overlap_blocks` on `worker`.
    fn view(id: &str, worker: u64, overlap_blocks: u32) -> Record {
        Record::RouterView(kvscope_wire::RouterView {
            request_id: id.into(),
            worker: w(worker),
            overlap_blocks,
            phase: Some("Aggregated".into()),
            candidates: Vec::new(),
        })
    }

    /// [`view`], with what the router credited each worker it scored with.
    fn scored_view(id: &str, worker: u64, overlap_blocks: u32, scores: &[(u64, f64)]) -> Record {
        let Record::RouterView(mut v) = view(id, worker, overlap_blocks) else {
            unreachable!()
        };
        v.candidates = scores
            .iter()
            .map(|(w_, credited_blocks)| kvscope_wire::RouterCandidate {
                worker: w(*w_),
                credited_blocks: *credited_blocks,
            })
            .collect();
        Record::RouterView(v)
    }

    /// Where the router logged a score per worker: a spill whose best worker it credited
    /// with what it held was a choice by load; one whose best it credited with less was
    /// a stale view of it, told a store not yet applied where the store came lately.
    #[test]
    fn the_routers_score_of_the_best_worker_tells_a_stale_view_from_a_choice() {
        let mut a = FleetAnalyzer::new(cfg());
        let prompt: Vec<u32> = (0..4).collect();
        a.apply(&env(
            S,
            stored(1, 0, SequenceStatus::First, &prompt, &[1, 2]),
        ));
        // r1 to worker 2, the router knowing worker 1 held both blocks.
        assert!(
            a.apply(&env(2 * S, decision("r1", 2, &prompt)))
                .unwrap()
                .spill
        );
        a.apply(&env(2 * S, scored_view("r1", 2, 0, &[(1, 2.0), (2, 0.0)])));
        // Worker 1 stores a third block; a moment later r2 (the prompt with it) goes to
        // worker 2, the router crediting worker 1 with 2.5 blocks (a lower tier's share).
        let turn2: Vec<u32> = prompt.iter().copied().chain([7, 8]).collect();
        a.apply(&env(
            5 * S,
            stored_under(1, 1, SequenceStatus::InOrder, Some(2), &turn2[4..], &[3]),
        ));
        assert!(
            a.apply(&env(5 * S + 1, decision("r2", 2, &turn2)))
                .unwrap()
                .spill
        );
        a.apply(&env(
            5 * S + 2,
            scored_view("r2", 2, 0, &[(1, 2.5), (2, 0.0)]),
        ));
        // r3: a view without scores; r4: scores without the best worker's.
        assert!(
            a.apply(&env(6 * S, decision("r3", 2, &turn2)))
                .unwrap()
                .spill
        );
        a.apply(&env(6 * S, view("r3", 2, 0)));
        assert!(
            a.apply(&env(6 * S, decision("r4", 3, &turn2)))
                .unwrap()
                .spill
        );
        a.apply(&env(6 * S, scored_view("r4", 3, 0, &[(3, 0.0)])));
        let v = a.router_view();
        assert_eq!((v.compared, v.spills, v.spills_unseen), (4, 4, 0));
        assert_eq!((v.spills_best_scored, v.spills_best_stale), (2, 1));
        assert_eq!(v.spills_best_stale_blocks, 1);
        assert_eq!(v.spills_best_stale_stored_lately, 1);
    }

    #[test]
    fn the_routers_view_is_set_beside_what_the_engines_held() {
        let mut a = FleetAnalyzer::new(cfg());
        let prompt: Vec<u32> = (0..4).collect();
        a.apply(&env(1, decision("t1", 1, &prompt)));
        a.apply(&env(
            2,
            stored(1, 0, SequenceStatus::First, &prompt, &[1, 2]),
        ));
        // Worker 1 holds the prompt's 2 blocks; t2 extends it and goes to worker 2.
        let turn2: Vec<u32> = prompt.iter().copied().chain([7, 8]).collect();
        assert!(a.apply(&env(3, decision("t2", 2, &turn2))).unwrap().spill);
        // t1: nothing was cached at its decision, and the router saw as much.
        a.apply(&env(4, view("t1", 1, 0)));
        // t2: the router credited worker 2 with worker 1's 2 blocks: over by 2, and a
        // spill it could not see.
        a.apply(&env(5, view("t2", 2, 2)));
        // No such request (yet: it waits for its decision); t1's view under another
        // worker than its decision's; a second view of t2.
        a.apply(&env(6, view("t9", 1, 1)));
        a.apply(&env(7, view("t1", 2, 1)));
        a.apply(&env(7, view("t2", 2, 2)));
        let v = a.router_view();
        assert_eq!((v.compared, v.exact, v.over, v.under), (2, 1, 1, 0));
        assert_eq!((v.over_blocks, v.under_blocks), (2, 0));
        assert_eq!((v.spills, v.spills_unseen), (1, 1));
        assert_eq!(
            (
                a.counters().router_views,
                a.counters().router_views_unjoined
            ),
            (5, 2),
            "another worker's view and a second view are not compared"
        );
        assert_eq!(
            a.routed_request("t2").unwrap().router_overlap_blocks,
            Some(2)
        );
        assert_eq!(
            a.routed_request("t1").unwrap().router_overlap_blocks,
            Some(0)
        );
        // A view under the truth, come before its decision: it waits, and is compared
        // when the decision comes; under by 1, and a spill the router saw (it credited
        // the chosen worker with less than the best held).
        let turn3: Vec<u32> = turn2.iter().copied().chain([9, 10]).collect();
        a.apply(&env(
            8,
            stored_under(2, 0, SequenceStatus::First, None, &turn2, &[1, 2, 3]),
        ));
        a.apply(&env(
            9,
            stored_under(1, 1, SequenceStatus::InOrder, Some(2), &turn3[4..], &[3, 4]),
        ));
        a.apply(&env(9, view("t3", 2, 2)));
        assert_eq!(a.router_view().compared, 2);
        assert!(a.apply(&env(10, decision("t3", 2, &turn3))).unwrap().spill);
        let v = a.router_view();
        assert_eq!((v.compared, v.exact, v.over, v.under), (3, 1, 1, 1));
        assert_eq!((v.over_blocks, v.under_blocks), (2, 1));
        assert_eq!((v.spills, v.spills_unseen), (2, 1));
        // Why: t3's uncredited block was stored on worker 2 just before its decision;
        // worker 2 never held what t2's view credited it with.
        assert_eq!(v.under_stored_lately, 1);
        assert_eq!((v.over_removed_lately, v.over_stored_after), (0, 0));
        // t9's decision never came: a minute of record time later its view is given up.
        a.apply(&env(70 * S, view("t8", 1, 0)));
        assert_eq!(a.counters().router_views_unjoined, 3);
        assert_eq!(a.counters().router_views, 7);
    }

    #[test]
    fn an_over_credit_is_told_a_late_removal_or_a_store_the_router_saw_first() {
        let mut a = FleetAnalyzer::new(cfg());
        let prompt: Vec<u32> = (0..4).collect();
        a.apply(&env(
            S,
            stored(1, 0, SequenceStatus::First, &prompt, &[1, 2]),
        ));
        // Worker 1 evicts the prompt's second block a moment before r1 comes to it; the
        // router still credits both.
        a.apply(&env(
            2 * S,
            batch(
                1,
                1,
                SequenceStatus::InOrder,
                vec![KvEvent::BlockRemoved {
                    block_hashes: vec![2],
                    medium: None,
                }],
            ),
        ));
        a.apply(&env(2 * S + 1, decision("r1", 1, &prompt)));
        a.apply(&env(2 * S + 2, view("r1", 1, 2)));
        // r2 goes to worker 2, which stores the prompt only after the decision (in
        // record time); the router credited it already.
        a.apply(&env(3 * S, decision("r2", 2, &prompt)));
        a.apply(&env(
            3 * S + 1,
            stored(2, 0, SequenceStatus::First, &prompt, &[11, 12]),
        ));
        a.apply(&env(3 * S + 2, view("r2", 2, 2)));
        // r3 to worker 1 a minute later, credited with the block removed long ago: the
        // router lost that removal.
        a.apply(&env(60 * S, decision("r3", 1, &prompt)));
        a.apply(&env(60 * S, view("r3", 1, 2)));
        let v = a.router_view();
        assert_eq!((v.compared, v.over, v.over_blocks), (3, 3, 4));
        assert_eq!((v.over_removed_lately, v.over_stored_after), (1, 1));
        assert_eq!(v.under_stored_lately, 0);
        // r1's removal came 1 ns before its decision.
        assert_eq!((v.lately_lag_us_sum, v.lately_lag_us_max), (0, 0));
    }

    #[test]
    fn the_delta_in_decode_generated_blocks_is_measured() {
        let mut a = FleetAnalyzer::new(cfg());
        let prompt: Vec<u32> = (0..4).collect();
        // Turn 1 routed to worker 1: it stores the prompt's 2 blocks, then 1 output block.
        a.apply(&env(1, decision("t1", 1, &prompt)));
        a.apply(&env(
            2,
            stored(1, 0, SequenceStatus::First, &prompt, &[1, 2]),
        ));
        let output: Vec<u32> = vec![100, 101];
        a.apply(&env(
            3,
            stored_under(1, 1, SequenceStatus::InOrder, Some(2), &output, &[3]),
        ));
        assert_eq!(a.counters().generated_blocks, 1);
        // Turn 2 (prompt + output + new text) goes to worker 2: a 3-block spill, one of
        // them an output block.
        let turn2: Vec<u32> = prompt
            .iter()
            .chain(&output)
            .copied()
            .chain([7, 8])
            .collect();
        let v = a.apply(&env(4, decision("t2", 2, &turn2))).unwrap();
        assert!(v.spill);
        assert_eq!(v.true_delta_tokens, 6);
        assert_eq!(v.generated_delta_tokens, 2);
        // The what-if's view of it: the previous reply ends the best worker's cached
        // prefix (the chosen worker holds none of it); its end, once told, beside it.
        let r = a.routed_requests().next_back().unwrap();
        assert_eq!(r.decoded_tail, Some((2, 3)));
        assert!(r.end.is_none());
        let end = RequestEnd {
            request_id: "t2".into(),
            worker: w(2),
            prefill_worker: None,
            received_ns: 4,
            ttft_ms: Some(1.0),
            total_ms: Some(2.0),
            input_tokens: 8,
            output_tokens: 2,
            cached_tokens: None,
        };
        a.apply(&env(5, Record::RequestEnd(end.clone())));
        assert_eq!(a.routed_requests().next_back().unwrap().end, Some(end));
        assert_eq!(a.counters().request_ends, 1);

        // The cumulative figures behind /metrics: one spill in the histograms, both
        // decisions per worker.
        let t = a.totals();
        assert_eq!((t.true_delta.count, t.true_delta.sum), (1, 6));
        assert_eq!((t.upper_bound.count, t.upper_bound.sum), (1, 6));
        assert_eq!(
            t.true_delta.buckets[0], 1,
            "6 tokens fall in the first bucket"
        );
        assert_eq!(t.generated_delta_tokens, 2);
        assert_eq!(t.prompt_tokens, 4 + 8);
        assert_eq!(t.workers[&w(1)].spills_out, 1);
        assert_eq!(t.workers[&w(2)].spills_in, 1);
        assert_eq!(t.workers[&w(2)].cached_prompt_tokens, 0);
    }

    #[test]
    fn host_tier_events_never_count_toward_overlap() {
        let mut a = FleetAnalyzer::new(cfg());
        let toks: Vec<u32> = (0..4).collect();
        let mut batch = stored(1, 0, SequenceStatus::First, &toks, &[1, 2]);
        if let Record::KvEvents(b) = &mut batch {
            if let KvEvent::BlockStored { medium, .. } = &mut b.events[0] {
                *medium = Some("CPU".into());
            }
        }
        a.apply(&env(1, batch));
        assert_eq!(a.counters().lower_tier_events, 1);
        assert_eq!(a.index().cached_pairs(), 0);
    }

    #[test]
    fn a_verdict_says_how_far_each_match_extends_through_the_lower_tiers() {
        let mut a = FleetAnalyzer::new(cfg());
        let toks: Vec<u32> = (0..8).collect();
        let with_medium = |mut r: Record, m: &str| {
            if let Record::KvEvents(b) = &mut r {
                for ev in &mut b.events {
                    if let KvEvent::BlockStored { medium, .. }
                    | KvEvent::BlockRemoved { medium, .. } = ev
                    {
                        *medium = Some(m.into());
                    }
                }
            }
            r
        };
        // Worker 1 holds the 4-block prompt on its device. Worker 2 held it too, offloaded
        // it to host memory (vLLM's spelling) and then to disk (SGLang's), and its device
        // kept only the first block.
        a.apply(&env(
            1,
            stored(1, 0, SequenceStatus::First, &toks, &[1, 2, 3, 4]),
        ));
        a.apply(&env(
            1,
            stored(2, 0, SequenceStatus::First, &toks, &[1, 2, 3, 4]),
        ));
        a.apply(&env(
            2,
            with_medium(
                stored(2, 1, SequenceStatus::InOrder, &toks[..6], &[1, 2, 3]),
                "CPU",
            ),
        ));
        a.apply(&env(
            2,
            with_medium(
                stored_under(2, 2, SequenceStatus::InOrder, Some(3), &toks[6..], &[4]),
                "DISK",
            ),
        ));
        a.apply(&env(
            3,
            batch(
                2,
                3,
                SequenceStatus::InOrder,
                vec![KvEvent::BlockRemoved {
                    block_hashes: vec![2, 3, 4],
                    medium: None,
                }],
            ),
        ));
        // A medium no engine sends: counted, left out.
        a.apply(&env(
            3,
            with_medium(stored(2, 4, SequenceStatus::InOrder, &toks, &[9]), "TAPE"),
        ));
        assert_eq!(a.counters().lower_tier_events, 2);
        assert_eq!(a.counters().lower_tier_stored_blocks, 4);
        assert_eq!(a.counters().unknown_medium_events, 1);
        assert_eq!(a.index().cached_blocks(&w(2)), 1);
        // The router's line says it saw none of worker 2's lower tiers (a router that
        // does not score them).
        let mut r = decision("r", 2, &toks);
        if let Record::Decision(d) = &mut r {
            d.selection.lower_tiers = Some(LowerTierBlocks::default());
        }
        let v = a.apply(&env(4, r)).unwrap();
        let audit = a.tier_view();
        assert_eq!((audit.compared, audit.under, audit.under_blocks), (1, 1, 3));
        assert_eq!(
            (v.chosen_overlap_blocks, v.best, v.best_overlap_blocks),
            (1, w(1), 4)
        );
        // Blocks 2 and 3 from host memory, block 4 from disk: the whole delta onloaded.
        assert_eq!(
            v.chosen_lower_tiers,
            LowerTierBlocks {
                host_blocks: 2,
                disk_blocks: 1
            }
        );
        assert!(v.best_lower_tiers.is_empty());
        assert_eq!((v.true_delta_tokens, v.onload_delta_tokens), (6, 6));
        // The host tier loses block 3: the match stops there, disk does not skip ahead.
        a.apply(&env(
            5,
            with_medium(
                batch(
                    2,
                    5,
                    SequenceStatus::InOrder,
                    vec![KvEvent::BlockRemoved {
                        block_hashes: vec![3],
                        medium: None,
                    }],
                ),
                "CPU",
            ),
        ));
        let v = a.apply(&env(6, decision("s", 2, &toks))).unwrap();
        assert_eq!(
            v.chosen_lower_tiers,
            LowerTierBlocks {
                host_blocks: 1,
                disk_blocks: 0
            }
        );
        assert_eq!((v.true_delta_tokens, v.onload_delta_tokens), (6, 2));
        // An engine restart takes its lower tiers with it.
        a.apply(&env(7, batch(2, 0, SequenceStatus::Reset, vec![])));
        let v = a.apply(&env(8, decision("t", 2, &toks))).unwrap();
        assert!(v.chosen_lower_tiers.is_empty());
        assert_eq!(v.onload_delta_tokens, 0);
    }

    #[test]
    fn blocks_of_equal_tokens_under_another_cache_salt_are_other_blocks() {
        use crate::fixtures::routing_decision;
        use kvscope_wire::hashing::{local_block_hashes, seed_for};
        let mut a = FleetAnalyzer::new(cfg());
        let toks: Vec<u32> = (0..8).collect();
        let salted = |r: Record, salt: &str| match r {
            Record::KvEvents(mut b) => {
                for ev in &mut b.events {
                    if let KvEvent::BlockStored { cache_salt, .. } = ev {
                        *cache_salt = Some(salt.into());
                    }
                }
                Record::KvEvents(b)
            }
            other => other,
        };
        // Two tenants send the same prompt: worker 1 stores it under salt "a", worker 2
        // under "b" (SGLang's cache_salt).
        a.apply(&env(
            1,
            salted(
                stored(1, 0, SequenceStatus::First, &toks, &[1, 2, 3, 4]),
                "a",
            ),
        ));
        a.apply(&env(
            1,
            salted(
                stored(2, 0, SequenceStatus::First, &toks, &[1, 2, 3, 4]),
                "b",
            ),
        ));
        // Tenant a's request (the router hashes it with its salt) routed to worker 2:
        // only worker 1 holds any of it.
        let mut d = routing_decision("ra", 2, &toks);
        d.local_hashes = local_block_hashes(&toks, 2, seed_for(Some("a"), None));
        let v = a.apply(&env(2, Record::Decision(d))).unwrap();
        assert_eq!(v.overlaps, BTreeMap::from([(w(1), 4)]));
        assert!(v.spill);
        // Its tenant: the salt its first block was stored under.
        assert_eq!(v.tenant.as_deref(), Some("a"));
        let mut d = routing_decision("rb", 2, &toks);
        d.local_hashes = local_block_hashes(&toks, 2, seed_for(Some("b"), None));
        let v = a.apply(&env(2, Record::Decision(d))).unwrap();
        assert_eq!((v.tenant.as_deref(), v.spill), (Some("b"), false));
        // An unsalted request holds nothing of either.
        let v = a.apply(&env(3, decision("r", 1, &toks))).unwrap();
        assert!(v.overlaps.is_empty());
        assert_eq!(v.tenant, None);
        // A tenant a field of the request named (the agent told which) is the request's,
        // over its blocks' salt.
        let mut d = routing_decision("rc", 1, &toks);
        d.local_hashes = local_block_hashes(&toks, 2, seed_for(Some("a"), None));
        d.tenant = Some("team-c".into());
        let v = a.apply(&env(3, Record::Decision(d))).unwrap();
        assert_eq!((v.tenant.as_deref(), v.spill), (Some("team-c"), false));
        // Per tenant, summing to the fleet's.
        let t = &a.totals().tenants;
        let (ta, tb) = (&t.tenants["a"], &t.tenants["b"]);
        assert_eq!((ta.requests, ta.spills, ta.true_delta_tokens), (1, 1, 8));
        assert_eq!((tb.requests, tb.spills), (1, 0));
        assert_eq!((t.unsalted.requests, t.other_tenants.requests), (1, 0));
        assert_eq!(t.tenants["team-c"].requests, 1);
        let fleet: u64 = a.totals().workers.values().map(|w| w.decisions).sum();
        assert_eq!(
            ta.requests + tb.requests + t.tenants["team-c"].requests + t.unsalted.requests,
            fleet
        );
        assert_eq!(ta.spills, a.counters().spills);
    }

    #[test]
    fn event_only_sees_recomputed_blocks_held_elsewhere() {
        let (mut a, toks) = four_blocks_on_worker_1();
        a.apply(&env(
            2,
            stored(2, 0, SequenceStatus::First, &toks[..6], &[5, 6, 7]),
        ));
        let e = &a.open_window().unwrap().event_only;
        assert_eq!((e.segments, e.spills, e.delta_tokens), (2, 1, 6));
    }

    #[test]
    fn replaying_the_same_records_gives_the_same_windows() {
        let toks: Vec<u32> = (0..8).collect();
        let records: Vec<Envelope> = (0..40u64)
            .map(|i| {
                let t = i * S / 4;
                if i % 3 == 0 {
                    env(
                        t,
                        stored(
                            i % 2,
                            i,
                            SequenceStatus::InOrder,
                            &toks[..(2 + (i as usize % 4) * 2)],
                            &[i * 10, i * 10 + 1, i * 10 + 2, i * 10 + 3][..(1 + i as usize % 4)],
                        ),
                    )
                } else {
                    env(t, decision(&format!("r{i}"), i % 3, &toks))
                }
            })
            .collect();
        let run = |rs: &[Envelope]| {
            let mut a = FleetAnalyzer::new(cfg());
            rs.iter().for_each(|r| {
                a.apply(r);
            });
            a.closed_windows()
                .map(|w| w.summary.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(&records), run(&records));
        assert!(run(&records).iter().map(|w| w.requests).sum::<u64>() > 0);
    }

    #[test]
    fn nixl_rows_join_the_router_id_vllm_suffixed() {
        let mut a = FleetAnalyzer::new(AnalyzerConfig::default());
        let row = |id: &str, remote: &str, bytes| kvscope_wire::nixl::NixlRequestTransfers {
            request_id: id.into(),
            local_agent: "d0".into(),
            remote_agent: remote.into(),
            transfers: 1,
            bytes,
            nixl_ns: 1_000,
            failed: 0,
        };
        // vLLM's ids for the router's `cmpl-7`: on two prefill ranks; and `req-2`, a
        // router id that itself ends like a suffix, known to vLLM as it came.
        a.request_nixl.apply(
            "node-a",
            &[
                row("cmpl-7-1a2b3c4d", "p0", 100),
                row("cmpl-7-00ff00ff", "p1", 20),
                row("req-2-deadbeef", "p0", 5),
            ],
        );
        let n = a.request_nixl("cmpl-7").unwrap();
        assert_eq!((n.transfers, n.bytes), (2, 120));
        assert_eq!(a.request_nixl("cmpl-7-1a2b3c4d").unwrap().bytes, 100);
        assert_eq!(a.request_nixl("req-2-deadbeef").unwrap().bytes, 5);
        assert!(a.request_nixl("cmpl-8").is_none());
        // A report repeats its rows cumulatively: replaced, not added.
        a.request_nixl
            .apply("node-a", &[row("cmpl-7-1a2b3c4d", "p0", 150)]);
        assert_eq!(a.request_nixl("cmpl-7").unwrap().bytes, 170);
    }
}
