//! Router knobs: the recorded requests routed again by a model of Dynamo's KV router
//! built from Dynamo's own parts: its load tracker (`ActiveSequencesMultiWorker`, the
//! router's view of each worker's active blocks and prefill tokens) and its reference
//! worker selector (`DefaultWorkerSelector`, the frontend's cost and picker), over each
//! worker's cache simulated as the other questions simulate it.
//!
//! Each request's timing comes from Dynamo's request trace (`DYN_REQUEST_TRACE=1`, which
//! the agent reads from the router's log): the router books a request's prompt blocks
//! and prefill tokens on its worker when it routes it, drops the prefill tokens at the
//! first token and the blocks at the end, so with the recorded decisions the model's load
//! is the router's own. A request without a trace record lives as long as the median one
//! (counted).
//!
//! What the model holds fixed: each request's arrival and durations (a request sent to a
//! busier worker would take longer there, and a closed-loop client would send its next
//! turn later), and so the workload itself.
//!
//! Sessions, for affinity: the frontend names them by a header (`x-dynamo-session-id`)
//! that no log shows, so the model follows each conversation by its chain
//! ([`super::previous_turns`]): what affinity does when clients name one session per
//! conversation.

use super::replay::{Pool, Router};
use super::{RoutedRequest, WhatIf, WhatIfError};
use dynamo_kv_router::protocols::{PrefillLoadHint, WorkerWithDpRank};
use dynamo_kv_router::scheduling::{OverlapSignals, ScheduleMode};
use dynamo_kv_router::{
    ActiveSequencesMultiWorker, DefaultWorkerSelector, KvRouterConfig, NoopSequencePublisher,
    SchedulingRequest, SequenceRequest, WorkerConfigLike, WorkerSelectionInput, WorkerSelector,
};
use kvscope_fold::window::Spread;
use kvscope_wire::WorkerKey;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// The router's settings the model reads, as Dynamo 1.6.1's frontend takes them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RouterSettings {
    /// `--router-kv-overlap-score-credit`: blocks of prefill each cached block takes off
    /// a worker's cost (default 1).
    pub overlap_score_credit: f64,
    /// `--router-prefill-load-scale`: the weight of a worker's prefill load, this
    /// request's uncached part included, against its decode blocks (default 1).
    pub prefill_load_scale: f64,
    /// `--router-temperature`: 0 takes the cheapest worker, more samples a softmax of
    /// the costs (default 0).
    pub temperature: f64,
    /// `--router-track-output-blocks`: a request's decode blocks count as they grow.
    pub track_output_blocks: bool,
    /// `--router-session-affinity-ttl-secs`: a session stays on its worker until idle
    /// this long (none: off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_affinity_ttl_secs: Option<u64>,
}

impl Default for RouterSettings {
    /// Dynamo 1.6.1's defaults.
    fn default() -> Self {
        Self {
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            temperature: 0.0,
            track_output_blocks: false,
            session_affinity_ttl_secs: None,
        }
    }
}

/// The frontend's bound on an affinity TTL.
const MAX_AFFINITY_TTL_SECS: u64 = 31_536_000;

/// Why a router setting cannot be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SettingError {
    #[error(
        "{0:?} is no router setting the what-if models (kv-overlap-score-credit, \
         prefill-load-scale, kv-overlap-score-weight, temperature, track-output-blocks, \
         session-affinity-ttl-secs)"
    )]
    Unknown(String),
    #[error("{0:?} is not key=value")]
    NotAPair(String),
    #[error("{key}={value}: {why}")]
    Value {
        key: String,
        value: String,
        why: &'static str,
    },
}

impl RouterSettings {
    /// These settings changed by `change`: `key=value` pairs, comma-separated, each key a
    /// frontend flag without its `--router-` (`temperature=0.5,track-output-blocks=true`;
    /// `session-affinity-ttl-secs=off` turns affinity off; the deprecated
    /// `kv-overlap-score-weight=w` sets the prefill load scale to w, and the credit to 0
    /// when w is 0, as Dynamo maps it).
    pub fn changed(mut self, change: &str) -> Result<Self, SettingError> {
        for pair in change.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| SettingError::NotAPair(pair.to_string()))?;
            let key = key.trim().trim_start_matches('-').replace('_', "-");
            let key = key.strip_prefix("router-").unwrap_or(&key);
            let value = value.trim();
            let bad = |why| SettingError::Value {
                key: key.to_string(),
                value: value.to_string(),
                why,
            };
            let number = || {
                value
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .ok_or_else(|| bad("a finite number, 0 or more"))
            };
            match key {
                "kv-overlap-score-credit" => self.overlap_score_credit = number()?,
                "prefill-load-scale" => self.prefill_load_scale = number()?,
                "kv-overlap-score-weight" => {
                    let w = number()?;
                    self.prefill_load_scale = w;
                    if w == 0.0 {
                        self.overlap_score_credit = 0.0;
                    }
                }
                "temperature" => self.temperature = number()?,
                "track-output-blocks" => {
                    self.track_output_blocks = match value {
                        "true" | "on" | "1" => true,
                        "false" | "off" | "0" => false,
                        _ => return Err(bad("true or false")),
                    }
                }
                "session-affinity-ttl-secs" => {
                    self.session_affinity_ttl_secs = match value {
                        "off" | "none" => None,
                        v => Some(
                            v.parse::<u64>()
                                .ok()
                                .filter(|t| (1..=MAX_AFFINITY_TTL_SECS).contains(t))
                                .ok_or_else(|| bad("whole seconds, 1 to 31536000, or off"))?,
                        ),
                    }
                }
                _ => return Err(SettingError::Unknown(key.to_string())),
            }
        }
        Ok(self)
    }

    /// The change of Dynamo's defaults that a frontend's command line makes, in the form
    /// [`Self::changed`] reads: the flags the model knows (`--router-temperature 0.5`,
    /// `--router-track-output-blocks`, `--router-session-affinity-ttl-secs=300`, …);
    /// every other argument is left alone.
    pub fn change_from_frontend_args(args: &[String]) -> String {
        const VALUED: [&str; 5] = [
            "kv-overlap-score-credit",
            "prefill-load-scale",
            "kv-overlap-score-weight",
            "temperature",
            "session-affinity-ttl-secs",
        ];
        let mut pairs = Vec::new();
        let mut it = args.iter().peekable();
        while let Some(arg) = it.next() {
            let Some(flag) = arg.strip_prefix("--router-") else {
                continue;
            };
            let (key, inline) = match flag.split_once('=') {
                Some((k, v)) => (k, Some(v.to_string())),
                None => (flag, None),
            };
            if key == "track-output-blocks" {
                pairs.push(format!("{key}={}", inline.as_deref().unwrap_or("true")));
            } else if VALUED.contains(&key) {
                if let Some(v) = inline.or_else(|| it.next().cloned()) {
                    pairs.push(format!("{key}={v}"));
                }
            }
        }
        pairs.join(",")
    }

    fn kv_router_config(&self) -> KvRouterConfig {
        KvRouterConfig {
            overlap_score_credit: self.overlap_score_credit,
            prefill_load_scale: self.prefill_load_scale,
            router_temperature: self.temperature,
            router_track_output_blocks: self.track_output_blocks,
            ..KvRouterConfig::default()
        }
    }
}

/// A worker as the selector sees it: its dp ranks.
struct ModelWorker {
    dp_start: u32,
    dp_size: u32,
}

impl WorkerConfigLike for ModelWorker {
    fn data_parallel_start_rank(&self) -> u32 {
        self.dp_start
    }
    fn data_parallel_size(&self) -> u32 {
        self.dp_size
    }
    fn max_num_batched_tokens(&self) -> Option<u64> {
        None
    }
    fn total_kv_blocks(&self) -> Option<u64> {
        None
    }
}

/// A session's binding to a worker (hard affinity, as Dynamo's `SessionAffinity`).
#[derive(Debug, Clone, Copy)]
struct Binding {
    worker: WorkerKey,
    in_flight: u32,
    idle_until_ns: u64,
}

/// One pool's router: its workers, its load tracker.
struct PoolRouter {
    workers: HashMap<u64, ModelWorker>,
    keys: Vec<WorkerKey>,
    tracker: ActiveSequencesMultiWorker<NoopSequencePublisher>,
    prefill: bool,
}

/// One run of the model over the recorded requests: Dynamo's selector and load tracker
/// deciding each request as the replay brings it.
struct Run<'a> {
    w: &'a WhatIf,
    settings: RouterSettings,
    /// `None`: every request goes where it went (the load-view check).
    selector: Option<DefaultWorkerSelector>,
    routers: BTreeMap<Pool<'a>, PoolRouter>,
    /// Each request's session: the first turn of its conversation.
    session_of: &'a [usize],
    sessions: HashMap<usize, Binding>,
    /// Requests the tracker holds now.
    booked: Vec<bool>,
    base: tokio::time::Instant,
    t0_ns: u64,
    went: Vec<WorkerKey>,
    pinned: u64,
    selector_errors: u64,
    tracker_errors: u64,
    /// With the recorded decisions: each decision's cost by the tracker's load against
    /// the cost the router logged, in blocks.
    cost_errors: Vec<f64>,
    /// With the recorded decisions: those judged (a choice among several workers), and
    /// those that took the cheapest by the model's costs.
    cheapest: (u64, u64),
}

impl<'a> Run<'a> {
    fn new(
        w: &'a WhatIf,
        settings: RouterSettings,
        seed: Option<u64>,
        session_of: &'a [usize],
    ) -> Self {
        Run {
            w,
            settings,
            selector: seed.map(|seed| {
                DefaultWorkerSelector::new_seeded(Some(settings.kv_router_config()), "decode", seed)
            }),
            routers: w.pool_routers(),
            session_of,
            sessions: HashMap::new(),
            booked: vec![false; w.requests.len()],
            base: tokio::time::Instant::now(),
            t0_ns: w.requests.first().map_or(0, |r| r.decided_ns),
            went: Vec::with_capacity(w.requests.len()),
            pinned: 0,
            selector_errors: 0,
            tracker_errors: 0,
            cost_errors: Vec::new(),
            cheapest: (0, 0),
        }
    }

    fn instant(&self, t_ns: u64) -> tokio::time::Instant {
        self.base + Duration::from_nanos(t_ns.saturating_sub(self.t0_ns))
    }

    fn router_of(&self, i: usize) -> Option<&PoolRouter> {
        self.routers.get(&self.w.pool_of(&self.w.requests[i]))
    }

    /// The tracker let go of request `i` (its end, or the router's expiry).
    fn unbook(&mut self, i: usize, at_ns: u64) {
        if !std::mem::replace(&mut self.booked[i], false) {
            return;
        }
        let when = self.instant(at_ns);
        let id = &self.w.requests[i].request_id;
        if let Some(router) = self.router_of(i) {
            if router.tracker.free(id, when).is_err() {
                self.tracker_errors += 1;
            }
        }
    }

    /// The worker Dynamo's selector picks for `r` with each candidate's cached prefix
    /// and the tracker's load now (Dynamo's own log lines of the pick silenced: they
    /// would read as real decisions).
    fn select(
        selector: &DefaultWorkerSelector,
        router: &PoolRouter,
        r: &RoutedRequest,
        hits: &[(WorkerKey, usize)],
        when: tokio::time::Instant,
    ) -> Option<WorkerKey> {
        let mut overlap = OverlapSignals {
            tier_overlap_blocks: Default::default(),
            effective_overlap_blocks: Default::default(),
            effective_cached_tokens: Default::default(),
        };
        for &(w, h) in hits {
            let key = WorkerWithDpRank::new(w.worker_id, w.dp_rank);
            overlap.effective_overlap_blocks.insert(key, h as f64);
            overlap
                .effective_cached_tokens
                .insert(key, h * r.block_size as usize);
        }
        let request = SchedulingRequest {
            mode: ScheduleMode::QueryOnly {
                request_id: Some(r.request_id.clone()),
            },
            token_seq: Some(r.chain.clone()),
            isl_tokens: r.isl_tokens as usize,
            lora_name: None,
            expected_output_tokens: None,
            affinity_target: None,
            pinned_worker: None,
            allowed_worker_ids: None,
            routing_constraints: Default::default(),
            router_config_override: None,
            track_prefill_tokens: true,
            priority_jump: 0.0,
            strict_priority: 0,
            policy_class: None,
            session_context: None,
            overlap,
            kv_transfer_candidates: None,
            retain_kv_transfer_chain: false,
            shared_cache_hits: None,
            worker_loads: router.tracker.project_worker_loads(Some(&r.chain), when),
            resp_tx: None,
        };
        let picked = tracing::dispatcher::with_default(&tracing::Dispatch::none(), || {
            selector.select_worker(WorkerSelectionInput::configured(
                &router.workers,
                &request,
                request.eligibility(),
                r.block_size,
            ))
        })
        .ok()?;
        Some(WorkerKey {
            worker_id: picked.worker.worker_id,
            dp_rank: picked.worker.dp_rank,
        })
    }

    /// The cost Dynamo's default scorer gives `worker` for `r` with the tracker's load
    /// now and `overlap` cached blocks (no host or disk tier): what the router logs as
    /// the chosen worker's `logit`.
    fn cost(
        &self,
        router: &PoolRouter,
        r: &RoutedRequest,
        worker: WorkerKey,
        overlap: u32,
        when: tokio::time::Instant,
    ) -> Option<f64> {
        let loads = router.tracker.project_worker_loads(Some(&r.chain), when);
        let l = loads.get(&WorkerWithDpRank::new(worker.worker_id, worker.dp_rank))?;
        let bs = f64::from(r.block_size.max(1));
        let prefill_blocks = (l.active_prefill_tokens as f64 + r.isl_tokens as f64) / bs;
        let prefill =
            (prefill_blocks - self.settings.overlap_score_credit * f64::from(overlap)).max(0.0);
        Some(self.settings.prefill_load_scale * prefill + l.potential_decode_blocks() as f64)
    }
}

impl Router for Run<'_> {
    fn route(&mut self, i: usize, r: &RoutedRequest, hits: &[(WorkerKey, usize)]) -> WorkerKey {
        let now = r.decided_ns;
        let when = self.instant(now);
        let session = self.session_of[i];
        let Some(router) = self.router_of(i) else {
            self.went.push(r.worker);
            return r.worker;
        };
        // Affinity binds a conversation to its decode worker; a prefill pool's
        // decisions are made afresh.
        let affinity = self.settings.session_affinity_ttl_secs.is_some() && !router.prefill;
        let bound = affinity
            .then(|| self.sessions.get(&session))
            .flatten()
            .filter(|b| b.in_flight > 0 || now < b.idle_until_ns)
            .map(|b| b.worker)
            .filter(|w| router.keys.binary_search(w).is_ok());
        let (worker, selector_error) = match (bound, &self.selector) {
            (Some(w), _) => (w, false),
            (None, Some(selector)) => match Self::select(selector, router, r, hits, when) {
                Some(w) => (w, false),
                None => (r.worker, true),
            },
            (None, None) => (r.worker, false),
        };
        let cost_error = match (&self.selector, r.selection.logit) {
            (None, Some(logged)) => self
                .cost(router, r, worker, r.recorded_overlap_blocks, when)
                .map(|cost| cost - logged),
            _ => None,
        };
        // Whether the router took the cheapest worker (at temperature 0 it always does):
        // each candidate's cost by the same load, its overlap as simulated.
        let cheapest = (self.selector.is_none() && bound.is_none() && hits.len() > 1)
            .then(|| {
                let cost = |w: WorkerKey, h: usize| self.cost(router, r, w, h as u32, when);
                let own = hits.iter().find(|(w, _)| *w == worker)?;
                let mine = cost(worker, own.1)?;
                Some(
                    hits.iter()
                        .filter(|(w, _)| *w != worker)
                        .filter_map(|&(w, h)| cost(w, h))
                        .all(|other| mine <= other + 1e-9),
                )
            })
            .flatten();
        // The prefill the router books is the prompt less the chosen worker's cached
        // prefix: with the recorded decisions (the load-view check) the one the router
        // saw, so that the check measures the load accounting alone; otherwise the
        // simulated one.
        let hit = if self.selector.is_none() && bound.is_none() {
            r.recorded_overlap_blocks as usize
        } else {
            hits.iter()
                .find(|(w, _)| *w == worker)
                .map_or(0, |(_, h)| *h)
        };
        let cached = super::cached_tokens(r.isl_tokens, hit as u64, r.block_size);
        let booked = router
            .tracker
            .add_request(
                SequenceRequest {
                    request_id: r.request_id.clone(),
                    token_sequence: Some(r.chain.clone()),
                    track_prefill_tokens: true,
                    expected_output_tokens: None,
                    prefill_load_hint: Some(PrefillLoadHint {
                        initial_effective_prefill_tokens: (r.isl_tokens - cached) as usize,
                        expected_prefill_duration: None,
                    }),
                    worker: WorkerWithDpRank::new(worker.worker_id, worker.dp_rank),
                    lora_name: None,
                },
                when,
            )
            .is_ok();
        self.booked[i] = booked;
        self.cost_errors.extend(cost_error);
        if let Some(c) = cheapest {
            self.cheapest.0 += 1;
            self.cheapest.1 += u64::from(c);
        }
        self.tracker_errors += u64::from(!booked);
        self.selector_errors += u64::from(selector_error);
        self.pinned += u64::from(bound.is_some());
        if affinity {
            let b = self.sessions.entry(session).or_insert(Binding {
                worker,
                in_flight: 0,
                idle_until_ns: 0,
            });
            b.worker = worker;
            b.in_flight += 1;
        }
        self.went.push(worker);
        worker
    }

    fn tracks_output_blocks(&self) -> bool {
        self.settings.track_output_blocks
    }

    fn first_token(&mut self, i: usize, at_ns: u64) {
        if !self.booked[i] {
            return;
        }
        let when = self.instant(at_ns);
        let id = &self.w.requests[i].request_id;
        if let Some(router) = self.router_of(i) {
            if router.tracker.mark_prefill_completed(id, when).is_err() {
                self.tracker_errors += 1;
            }
        }
    }

    fn output_block(&mut self, i: usize) {
        if !self.booked[i] {
            return;
        }
        let id = &self.w.requests[i].request_id;
        if let Some(router) = self.router_of(i) {
            if router.tracker.add_output_block(id, None).is_err() {
                self.tracker_errors += 1;
            }
        }
    }

    fn expired(&mut self, i: usize, at_ns: u64) {
        self.unbook(i, at_ns);
    }

    fn ended(&mut self, i: usize, at_ns: u64) {
        self.unbook(i, at_ns);
        if let (Some(ttl), Some(b)) = (
            self.settings.session_affinity_ttl_secs,
            self.sessions.get_mut(&self.session_of[i]),
        ) {
            b.in_flight = b.in_flight.saturating_sub(1);
            b.idle_until_ns = at_ns.saturating_add(ttl.saturating_mul(1_000_000_000));
        }
    }
}

/// Figures of one routing of the recorded requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RoutedFigures {
    pub requests: u64,
    pub spills: u64,
    pub spill_rate: f64,
    /// Σ (best − chosen overlap) × block size over the spills.
    pub true_delta_tokens: u64,
    pub hit_rate: f64,
    pub uncached_prefill_tokens: u64,
    /// Of the requests that follow a previous turn, the share sent to its worker.
    pub stay_share: f64,
}

/// What the model predicts for one setting of the router, over its runs (each figure's
/// mean and spread over the runs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KnobRow {
    /// The change asked for, as given (empty: the recorded settings).
    pub change: String,
    pub settings: RouterSettings,
    pub spill_rate: Spread,
    pub true_delta_tokens: Spread,
    pub hit_rate: Spread,
    pub uncached_prefill_tokens: Spread,
    /// Of the requests that follow a previous turn, the share sent to that turn's
    /// worker: how much the router keeps conversations in place, whatever worker each
    /// one started on.
    pub stay_share: Spread,
    /// Requests sent by their session's binding (affinity), mean share.
    pub pinned_share: f64,
    /// Decisions the selector could not make (the recorded worker kept), and load the
    /// tracker refused, summed over the runs.
    pub selector_errors: u64,
    pub tracker_errors: u64,
}

/// How far the model's load view is the router's own: each recorded decision's cost,
/// from the tracker's load with every request where it went, against the `logit` the
/// router logged for it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LoadViewCheck {
    /// Decisions whose line carried a cost.
    pub decisions: u64,
    /// |model − logged|, blocks.
    pub median_abs_error_blocks: f64,
    pub p90_abs_error_blocks: f64,
    /// Share within one block.
    pub within_one_block: f64,
    /// Of the recorded decisions among several workers, the share that took the
    /// cheapest by the model's costs (each worker's overlap as simulated): all at
    /// temperature 0, fewer where the router samples.
    pub chose_cheapest: f64,
}

/// The router-knob question's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouterWhatIf {
    /// The recorded run's router settings (as given; Dynamo's defaults unless said).
    pub recorded_settings: RouterSettings,
    /// The recorded run's own figures, as the collector judged them.
    pub recorded: RoutedFigures,
    /// Recorded decisions the router logged as pinned (session affinity, or a worker
    /// the request named).
    pub recorded_pinned_share: f64,
    /// The model's load view against the router's logged costs, where the log gave
    /// them (`Selected worker … logit=`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_view: Option<LoadViewCheck>,
    /// The model at the recorded settings: how far it reproduces the recorded run.
    pub model_at_recorded: KnobRow,
    /// Where the model at the recorded settings misses the recorded run by more than
    /// [`REPRODUCTION_TOLERANCE`] allows, what it misses: `rows` is then empty (a model
    /// that does not reproduce its own run predicts nothing about another setting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_misses: Option<String>,
    pub rows: Vec<KnobRow>,
    /// Runs (seeds) per setting: the selector breaks ties, and samples above
    /// temperature 0, at random.
    pub runs: u32,
    /// Requests timed by their request-trace record, and those given the median life.
    pub requests_timed: u64,
    pub requests_untimed: u64,
    /// Conversations followed by their chains (the sessions of affinity).
    pub sessions: u64,
    /// Simulated cache blocks per real block (the capacity question's calibration).
    pub calibration: f64,
}

/// At most this many router settings in one what-if.
pub(crate) const MAX_ROUTER_CHANGES: usize = 16;
/// At most this many runs (seeds) per setting.
pub(crate) const MAX_ROUTER_RUNS: u32 = 16;

/// How near the model at the recorded settings must come to the recorded run for its
/// other rows to be shown: the tolerance the model was validated to on real lab runs
/// (docs/benchmarks-log.md, "Router settings predicted against real runs"; `e2e/tests/e2e/router_knobs.rs` holds every
/// prediction to it): hit rate within 10% of the measured figure, spill rate within 10
/// points, and uncached prefill within 15% — the model's 10% widened by how far one
/// recorded run is from another of the same setting (up to 9%): runs of the demo and of
/// router_knobs' base setting, with nothing else on the machine, measured the model at
/// −10.7% and −11.5% there while every other figure held.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    pub hit_rate_rel: f64,
    pub uncached_rel: f64,
    pub spill_rate_points: f64,
}

pub const REPRODUCTION_TOLERANCE: Tolerance = Tolerance {
    hit_rate_rel: 0.10,
    uncached_rel: 0.15,
    spill_rate_points: 0.10,
};

impl Tolerance {
    /// What `model` misses of `recorded`, said figure by figure; `None` when it
    /// reproduces the run. A figure is reproduced when it lies within this tolerance of
    /// the mean of the model's runs, or within the range the runs span: where the
    /// router samples (temperature above 0), the recorded run is one draw, and the
    /// model's own draws spread as far as real runs do (BENCHMARKS.md: two real runs of
    /// one setting differ by up to 9% in uncached prefill).
    pub fn misses(&self, model: &KnobRow, recorded: &RoutedFigures) -> Option<String> {
        let rel = |predicted: f64, measured: f64| {
            if measured == 0.0 {
                if predicted == 0.0 {
                    0.0
                } else {
                    f64::INFINITY
                }
            } else {
                predicted / measured - 1.0
            }
        };
        let within_runs = |s: &Spread, v: f64| s.min - 1e-12 <= v && v <= s.max + 1e-12;
        let mut misses = Vec::new();
        let hit = rel(model.hit_rate.mean, recorded.hit_rate);
        if hit.abs() > self.hit_rate_rel && !within_runs(&model.hit_rate, recorded.hit_rate) {
            misses.push(format!(
                "hit rate {} against the measured {} ({:+.1}%, tolerance {:.0}%)",
                pct(model.hit_rate.mean),
                pct(recorded.hit_rate),
                100.0 * hit,
                100.0 * self.hit_rate_rel
            ));
        }
        let uncached = rel(
            model.uncached_prefill_tokens.mean,
            recorded.uncached_prefill_tokens as f64,
        );
        if uncached.abs() > self.uncached_rel
            && !within_runs(
                &model.uncached_prefill_tokens,
                recorded.uncached_prefill_tokens as f64,
            )
        {
            misses.push(format!(
                "uncached prefill {:.0} tokens against the measured {} ({:+.1}%, tolerance {:.0}%)",
                model.uncached_prefill_tokens.mean,
                recorded.uncached_prefill_tokens,
                100.0 * uncached,
                100.0 * self.uncached_rel
            ));
        }
        let spill = model.spill_rate.mean - recorded.spill_rate;
        if spill.abs() > self.spill_rate_points
            && !within_runs(&model.spill_rate, recorded.spill_rate)
        {
            misses.push(format!(
                "spill rate {} against the measured {} ({:+.1} points, tolerance {:.0})",
                pct(model.spill_rate.mean),
                pct(recorded.spill_rate),
                100.0 * spill,
                100.0 * self.spill_rate_points
            ));
        }
        (!misses.is_empty()).then(|| misses.join("; "))
    }
}

impl WhatIf {
    /// Each request's session: the first turn of its conversation.
    fn sessions(&self) -> Vec<usize> {
        let mut of = Vec::with_capacity(self.requests.len());
        for i in 0..self.requests.len() {
            let s = match self.previous.get(i).copied().flatten() {
                Some(p) => of[p],
                None => i,
            };
            of.push(s);
        }
        of
    }

    /// The model's routers, one per pool, over its candidate workers.
    fn pool_routers(&self) -> BTreeMap<Pool<'_>, PoolRouter> {
        self.workers_by_pool()
            .into_iter()
            .map(|(pool, keys)| {
                let mut ranks: HashMap<u64, (u32, u32)> = HashMap::new();
                for k in &keys {
                    let e = ranks.entry(k.worker_id).or_insert((k.dp_rank, k.dp_rank));
                    e.0 = e.0.min(k.dp_rank);
                    e.1 = e.1.max(k.dp_rank);
                }
                let dp_range: HashMap<u64, (u32, u32)> = ranks
                    .iter()
                    .map(|(w, (lo, hi))| (*w, (*lo, hi - lo + 1)))
                    .collect();
                let block_size = self
                    .requests
                    .iter()
                    .find(|r| self.pool_of(r) == pool)
                    .map_or(16, |r| r.block_size.max(1));
                let router = PoolRouter {
                    workers: dp_range
                        .iter()
                        .map(|(w, (start, size))| {
                            (
                                *w,
                                ModelWorker {
                                    dp_start: *start,
                                    dp_size: *size,
                                },
                            )
                        })
                        .collect(),
                    tracker: ActiveSequencesMultiWorker::new_without_expiry(
                        NoopSequencePublisher,
                        block_size as usize,
                        dp_range,
                        false,
                        0,
                        if pool.1 { "prefill" } else { "decode" },
                    ),
                    keys,
                    prefill: pool.1,
                };
                (pool, router)
            })
            .collect()
    }

    /// Of the requests that follow a previous turn, the share that `went` where that
    /// turn went.
    fn stay_share(&self, went: &[WorkerKey]) -> f64 {
        let (mut follow, mut stay) = (0u64, 0u64);
        for (i, p) in self.previous.iter().enumerate() {
            if let (Some(p), Some(w)) = (p, went.get(i)) {
                follow += 1;
                stay += u64::from(went.get(*p) == Some(w));
            }
        }
        stay as f64 / follow.max(1) as f64
    }

    /// The recorded run's own spill figures.
    fn recorded_figures(&self) -> RoutedFigures {
        let t = self.recorded();
        let mut f = RoutedFigures {
            requests: t.requests,
            hit_rate: t.hit_rate(),
            uncached_prefill_tokens: t.uncached_prefill_tokens,
            ..RoutedFigures::default()
        };
        for r in &self.requests {
            if let Some(gap) = r.recorded_spill_blocks(self.min_spill_blocks) {
                f.spills += 1;
                f.true_delta_tokens += u64::from(gap) * u64::from(r.block_size);
            }
        }
        f.spill_rate = f.spills as f64 / f.requests.max(1) as f64;
        let went: Vec<WorkerKey> = self.requests.iter().map(|r| r.worker).collect();
        f.stay_share = self.stay_share(&went);
        f
    }

    /// One run of the model: with a seed, Dynamo's selector decides; without, every
    /// request goes where it went. Over caches of `sizes` blocks.
    fn route_once<'a>(
        &'a self,
        settings: RouterSettings,
        seed: Option<u64>,
        sizes: &HashMap<WorkerKey, u64>,
        session_of: &'a [usize],
    ) -> (RoutedFigures, Run<'a>) {
        let mut run = Run::new(self, settings, seed, session_of);
        let min = self.min_spill_blocks.max(1) as usize;
        let mut f = RoutedFigures::default();
        let totals = self.replay_routed(
            |w| sizes.get(w).copied().unwrap_or(0),
            true,
            Some(&mut run),
            |r, _, hit, best| {
                if let Some((_, b)) = best.filter(|(_, b)| b - hit >= min) {
                    f.spills += 1;
                    f.true_delta_tokens += ((b - hit) * r.block_size as usize) as u64;
                }
            },
        );
        f.requests = totals.requests;
        f.spill_rate = f.spills as f64 / f.requests.max(1) as f64;
        f.hit_rate = totals.hit_rate();
        f.uncached_prefill_tokens = totals.uncached_prefill_tokens;
        f.stay_share = self.stay_share(&run.went);
        (f, run)
    }

    /// The model's prediction for each change of the recorded router settings, over
    /// `runs` seeds each, with each worker's size `given` or discovery's.
    pub fn router_knobs(
        &self,
        recorded_settings: RouterSettings,
        changes: &[String],
        runs: u32,
        given: Option<u64>,
    ) -> Result<RouterWhatIf, RouterWhatIfError> {
        if changes.len() > MAX_ROUTER_CHANGES {
            return Err(RouterWhatIfError::TooManyChanges(changes.len()));
        }
        if !(1..=MAX_ROUTER_RUNS).contains(&runs) {
            return Err(RouterWhatIfError::Runs(runs));
        }
        let settings: Vec<RouterSettings> = changes
            .iter()
            .map(|c| recorded_settings.changed(c))
            .collect::<Result<_, _>>()?;
        self.check(&[])?;
        let timed = self
            .lifetimes
            .as_ref()
            .ok_or(RouterWhatIfError::NoTiming)?
            .timed;
        let sizes = self.sizes(given)?;
        let (permille, calibrated) = self.calibrated_permille(&sizes);
        calibrated.map_err(RouterWhatIfError::Uncalibrated)?;
        let simulated: HashMap<WorkerKey, u64> = sizes
            .iter()
            .map(|(w, b)| (*w, super::scaled(*b, permille)))
            .collect();
        let session_of = self.sessions();
        let n = self.requests.len() as f64;
        let row = |change: &str, s: RouterSettings| {
            let outs: Vec<(RoutedFigures, u64, u64, u64)> = (0..u64::from(runs))
                .map(|seed| {
                    let (f, run) = self.route_once(s, Some(seed), &simulated, &session_of);
                    (f, run.pinned, run.selector_errors, run.tracker_errors)
                })
                .collect();
            let spread =
                |f: &dyn Fn(&RoutedFigures) -> f64| Spread::of(outs.iter().map(|o| f(&o.0)));
            KnobRow {
                change: change.to_string(),
                settings: s,
                spill_rate: spread(&|f| f.spill_rate),
                true_delta_tokens: spread(&|f| f.true_delta_tokens as f64),
                hit_rate: spread(&|f| f.hit_rate),
                uncached_prefill_tokens: spread(&|f| f.uncached_prefill_tokens as f64),
                stay_share: spread(&|f| f.stay_share),
                pinned_share: outs.iter().map(|o| o.1 as f64).sum::<f64>() / (n * f64::from(runs)),
                selector_errors: outs.iter().map(|o| o.2).sum(),
                tracker_errors: outs.iter().map(|o| o.3).sum(),
            }
        };
        let (_, held) = self.route_once(recorded_settings, None, &simulated, &session_of);
        let mut errors: Vec<f64> = held.cost_errors.iter().map(|e| e.abs()).collect();
        errors.sort_by(f64::total_cmp);
        // Nearest rank.
        let at =
            |q: f64| errors[((q * errors.len() as f64).ceil() as usize).clamp(1, errors.len()) - 1];
        let load_view = (!errors.is_empty()).then(|| LoadViewCheck {
            decisions: errors.len() as u64,
            median_abs_error_blocks: at(0.5),
            p90_abs_error_blocks: at(0.9),
            within_one_block: errors.iter().filter(|e| **e <= 1.0).count() as f64
                / errors.len() as f64,
            chose_cheapest: held.cheapest.1 as f64 / held.cheapest.0.max(1) as f64,
        });
        let recorded = self.recorded_figures();
        let model_at_recorded = row("", recorded_settings);
        let model_misses = REPRODUCTION_TOLERANCE.misses(&model_at_recorded, &recorded);
        Ok(RouterWhatIf {
            recorded_settings,
            recorded,
            recorded_pinned_share: self.requests.iter().filter(|r| r.selection.pinned).count()
                as f64
                / n,
            load_view,
            rows: if model_misses.is_none() {
                changes
                    .iter()
                    .zip(settings)
                    .map(|(c, s)| row(c, s))
                    .collect()
            } else {
                Vec::new()
            },
            model_at_recorded,
            model_misses,
            runs,
            requests_timed: timed,
            requests_untimed: self.requests.len() as u64 - timed,
            sessions: self.previous.iter().filter(|p| p.is_none()).count() as u64,
            calibration: super::calibration(&sizes, permille),
        })
    }
}

/// Why the router-knob question cannot be answered.
#[derive(Debug, thiserror::Error)]
pub enum RouterWhatIfError {
    #[error(transparent)]
    Setting(#[from] SettingError),
    #[error(transparent)]
    WhatIf(#[from] WhatIfError),
    #[error(
        "no request has a request-trace record, so no worker's load can be timed: run \
         Dynamo's frontend with DYN_REQUEST_TRACE=1 (the agent reads it from the log)"
    )]
    NoTiming,
    #[error("the simulated caches could not be calibrated on this recording: {0}")]
    Uncalibrated(super::CalibrationFailure),
    #[error("at most {MAX_ROUTER_CHANGES} router settings at once, not {0}")]
    TooManyChanges(usize),
    #[error("1 to {MAX_ROUTER_RUNS} runs per setting, not {0}")]
    Runs(u32),
}

/// A share as a percentage.
fn pct(v: f64) -> String {
    format!("{:.1}%", 100.0 * v)
}

/// A figure's mean over the runs, and their range where they differ.
fn over_runs(s: &Spread, show: impl Fn(f64) -> String) -> String {
    if show(s.min) == show(s.max) {
        show(s.mean)
    } else {
        format!("{} ({}–{})", show(s.mean), show(s.min), show(s.max))
    }
}

impl RouterWhatIf {
    pub fn to_markdown(&self) -> String {
        let tokens = |v: f64| format!("{v:.0}");
        let mut s = format!(
            "# What if the router were set otherwise\n\n\
             The recorded requests routed again by Dynamo 1.6.1's own load tracker and worker \
             selector over the simulated caches ({:.2} simulated blocks per block), {} runs per \
             setting (mean, and the runs' range); each request's arrival and durations held as \
             recorded ({} requests timed by Dynamo's request trace, {} given the median life); \
             {} conversations followed by their prompts, as the sessions of affinity.\n",
            self.calibration, self.runs, self.requests_timed, self.requests_untimed, self.sessions,
        );
        if let Some(v) = &self.load_view {
            s.push_str(&format!(
                "The model's load view against the router's own: over {} recorded decisions, the \
                 chosen worker's cost from the model's load is within {:.2} blocks of the cost \
                 the router logged at the median and {:.2} at p90 ({} within one block); {} \
                 of the decisions took the cheapest worker by those costs.\n",
                v.decisions,
                v.median_abs_error_blocks,
                v.p90_abs_error_blocks,
                pct(v.within_one_block),
                pct(v.chose_cheapest),
            ));
            if v.median_abs_error_blocks > 1.0 {
                s.push_str(
                    "**The router's logged costs are not the model's**: the recorded settings \
                     given (overlap credit, prefill load scale) are likely not the router's; \
                     give --router-recorded as its frontend was started.\n",
                );
            }
            if self.recorded_settings.temperature == 0.0 && v.chose_cheapest < 0.9 {
                s.push_str(
                    "**The router sampled**: at temperature 0 it takes the cheapest worker \
                     every time; give --router-recorded temperature=… as its frontend was \
                     started.\n",
                );
            }
        }
        if self.recorded_pinned_share > 0.0
            && self.recorded_settings.session_affinity_ttl_secs.is_none()
        {
            s.push_str(&format!(
                "**{} of the recorded decisions were pinned** (session affinity, or a worker the \
                 request named), but the recorded settings have no affinity: give \
                 --router-recorded session-affinity-ttl-secs=N if it was on.\n",
                pct(self.recorded_pinned_share)
            ));
        }
        if self.recorded_settings.temperature == 0.0 {
            s.push_str(
                "At temperature 0 a lightly loaded fleet can settle into different routings from \
                 one run to the next (most costs tie): one recording predicts one such run; \
                 compare several.\n",
            );
        }
        s.push_str(
            "\n| router | spill rate | Σ true delta (tokens) | hit rate | uncached prefill tokens | \
             turns kept on their worker | by affinity |\n|---|---:|---:|---:|---:|---:|---:|\n",
        );
        s.push_str(&format!(
            "| recorded run (measured) | {} | {} | {} | {} | {} | {} |\n",
            pct(self.recorded.spill_rate),
            self.recorded.true_delta_tokens,
            pct(self.recorded.hit_rate),
            self.recorded.uncached_prefill_tokens,
            pct(self.recorded.stay_share),
            pct(self.recorded_pinned_share),
        ));
        let mut errors = 0;
        for r in std::iter::once(&self.model_at_recorded).chain(&self.rows) {
            let name = if r.change.is_empty() {
                "model, as recorded".to_string()
            } else {
                format!("model, `{}`", r.change)
            };
            s.push_str(&format!(
                "| {name} | {} | {} | {} | {} | {} | {} |\n",
                over_runs(&r.spill_rate, pct),
                over_runs(&r.true_delta_tokens, tokens),
                over_runs(&r.hit_rate, pct),
                over_runs(&r.uncached_prefill_tokens, tokens),
                over_runs(&r.stay_share, pct),
                pct(r.pinned_share),
            ));
            errors += r.selector_errors + r.tracker_errors;
        }
        if let Some(m) = &self.model_misses {
            s.push_str(&format!("\n{}\n", self.not_predicted(m)));
        }
        if errors > 0 {
            s.push_str(&format!(
                "\n**{errors} decisions or bookings the model could not make** (each kept the \
                 recorded worker; see the JSON's selector_errors and tracker_errors).\n"
            ));
        }
        s
    }

    /// Why no other setting is predicted, when the model misses its own run.
    pub fn not_predicted(&self, misses: &str) -> String {
        format!(
            "**No other setting predicted**: at the recorded settings the model does not \
             reproduce the recorded run ({misses}), so its predictions for other settings \
             would not be worth reading. Check that --router-recorded gives the settings the \
             frontend ran with."
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::RequestEnd;

    fn w(id: u64) -> WorkerKey {
        WorkerKey {
            worker_id: id,
            dp_rank: 0,
        }
    }

    /// A request routed to `worker` at `at_ms`, its prompt `chain` (16-token blocks),
    /// its first token 0.1 ms after, its end `total_ms` after.
    fn request(id: &str, worker: u64, at_ms: f64, chain: Vec<u64>, total_ms: f64) -> RoutedRequest {
        let decided_ns = (at_ms * 1e6) as u64;
        RoutedRequest {
            request_id: id.to_string(),
            decided_ns,
            model: None,
            worker: w(worker),
            isl_tokens: chain.len() as u64 * 16,
            block_size: 16,
            recorded_overlap_blocks: 0,
            recorded_best: w(worker),
            recorded_best_overlap_blocks: 0,
            decoded_tail: None,
            selection: Default::default(),
            router_overlap_blocks: None,
            end: Some(RequestEnd {
                request_id: id.to_string(),
                worker: w(worker),
                prefill_worker: None,
                received_ns: decided_ns,
                ttft_ms: Some(0.1),
                total_ms: Some(total_ms),
                input_tokens: chain.len() as u64 * 16,
                output_tokens: 8,
                cached_tokens: None,
            }),
            chain,
        }
    }

    fn what_if(requests: Vec<RoutedRequest>) -> WhatIf {
        WhatIf {
            previous: crate::replay::previous_turns(&requests),
            lifetimes: WhatIf::compute_lifetimes(&requests),
            requests,
            // Sizes the recorded hits fit in plausibly (the calibration's bounds): the
            // largest working set below is 48 + 20 blocks.
            discovered_blocks: HashMap::from([(1, 100), (2, 100)]),
            ..WhatIf::empty()
        }
    }

    /// Session S's first turn, then two long requests that load its worker more than the
    /// other, then S's second turn: routed on load alone (credit 0) it leaves S's
    /// worker, unless affinity holds it there; once S has been idle past the TTL, it
    /// leaves again.
    fn loaded_session(second_turn_ms: f64) -> WhatIf {
        let blocks = |from: u64, n: u64| (from..from + n).collect::<Vec<_>>();
        let mut second = request("s-t2", 1, second_turn_ms, blocks(1, 22), 1.0);
        // As recorded: back on its worker, its first turn's 20 blocks cached there.
        second.recorded_overlap_blocks = 20;
        second.recorded_best_overlap_blocks = 20;
        what_if(vec![
            request("s-t1", 1, 0.0, blocks(1, 20), 1.0),
            request("big", 2, 0.5, blocks(100, 40), 100_000.0),
            request("big2", 1, 1.0, blocks(200, 48), 100_000.0),
            second,
        ])
    }

    fn went(w: &WhatIf, change: &str) -> (Vec<WorkerKey>, u64) {
        let s = RouterSettings::default().changed(change).unwrap();
        let sizes = HashMap::from([(self::w(1), 1000), (self::w(2), 1000)]);
        let sessions = w.sessions();
        let (_, run) = w.route_once(s, Some(7), &sizes, &sessions);
        (run.went, run.pinned)
    }

    #[test]
    fn affinity_keeps_a_session_on_its_worker_until_idle_past_its_ttl() {
        let near = loaded_session(2.0);
        assert_eq!(near.previous, vec![None, None, None, Some(0)]);
        let (free, pinned) = went(&near, "kv-overlap-score-credit=0");
        assert_eq!(pinned, 0);
        assert_ne!(
            free[0], free[1],
            "the first long request goes to the idle worker"
        );
        assert_eq!(
            free[2], free[0],
            "the second to the less loaded, the session's"
        );
        assert_ne!(free[3], free[0], "on load alone the second turn leaves");
        let (held, pinned) = went(
            &near,
            "kv-overlap-score-credit=0,session-affinity-ttl-secs=5",
        );
        assert_eq!(pinned, 1);
        assert_eq!(held[3], held[0], "affinity keeps it");
        // The first turn ended at 1 ms; 5 s idle later the binding is gone.
        let late = loaded_session(6_002.0);
        let (expired, pinned) = went(
            &late,
            "kv-overlap-score-credit=0,session-affinity-ttl-secs=5",
        );
        assert_eq!(pinned, 0);
        assert_ne!(expired[3], expired[0]);
    }

    #[test]
    fn the_cache_credit_brings_a_turn_back_to_its_prefix() {
        // With the default credit the second turn's 20 cached blocks outweigh the load.
        let near = loaded_session(2.0);
        let (by_cache, _) = went(&near, "");
        let (by_load, _) = went(&near, "kv-overlap-score-credit=0");
        assert_eq!(by_cache[3], by_cache[0]);
        assert_ne!(by_load[3], by_load[0]);
        let answer = near
            .router_knobs(
                RouterSettings::default(),
                &["kv-overlap-score-credit=0".to_string()],
                3,
                None,
            )
            .unwrap();
        assert_eq!((answer.requests_timed, answer.requests_untimed), (4, 0));
        assert_eq!(answer.sessions, 3);
        assert_eq!(answer.rows.len(), 1);
        assert_eq!(answer.runs, 3);
        assert!(answer.to_markdown().contains("`kv-overlap-score-credit=0`"));
    }

    #[test]
    fn the_load_view_is_checked_against_the_router_s_logged_costs() {
        let mut w = loaded_session(2.0);
        // As recorded: big2 on an idle worker 1 (s-t1 ended at 1 ms): 768/16 + 48 = 96,
        // logged 99; s-t2 on worker 1 beside big2, 20 blocks cached:
        // max(0, 352/16 − 20) + 48 + 22 = 72, logged 72.
        w.requests[2].selection.logit = Some(99.0);
        w.requests[3].selection.logit = Some(72.0);
        w.requests[3].recorded_overlap_blocks = 20;
        w.requests[3].selection.pinned = true;
        let a = w
            .router_knobs(RouterSettings::default(), &[], 1, None)
            .unwrap();
        let v = a.load_view.unwrap();
        assert_eq!(v.decisions, 2);
        assert_eq!(v.median_abs_error_blocks, 0.0);
        assert_eq!(v.p90_abs_error_blocks, 3.0);
        assert_eq!(v.within_one_block, 0.5);
        assert_eq!(
            v.chose_cheapest, 1.0,
            "each recorded decision took the cheapest"
        );
        assert_eq!(a.recorded_pinned_share, 0.25);
        assert!(
            a.to_markdown().contains("were pinned"),
            "{}",
            a.to_markdown()
        );
    }

    #[test]
    fn a_model_that_misses_its_own_run_predicts_no_other_setting() {
        // Recorded as if the second turn found nothing cached, where any cache of this
        // size keeps its first turn's 20 blocks: the model cannot reproduce that run.
        let mut w = loaded_session(2.0);
        w.requests[3].recorded_overlap_blocks = 0;
        w.requests[3].recorded_best_overlap_blocks = 0;
        let a = w
            .router_knobs(
                RouterSettings::default(),
                &["kv-overlap-score-credit=0".to_string()],
                2,
                None,
            )
            .unwrap();
        assert!(a.rows.is_empty(), "no prediction from a model that misses");
        let why = a.model_misses.as_deref().unwrap();
        assert!(
            why.starts_with("hit rate 15.4% against the measured 0.0%"),
            "{why}"
        );
        let md = a.to_markdown();
        assert!(md.contains("**No other setting predicted**"), "{md}");
        assert!(!md.contains("`kv-overlap-score-credit=0`"), "{md}");
        // Within the tolerance on each figure, nothing is said; past it, each is.
        let spread = |v: f64| Spread::of([v]);
        let recorded = RoutedFigures {
            requests: 100,
            spill_rate: 0.20,
            hit_rate: 0.50,
            uncached_prefill_tokens: 1000,
            ..RoutedFigures::default()
        };
        let model = |spill: f64, hit: f64, uncached: f64| KnobRow {
            change: String::new(),
            settings: RouterSettings::default(),
            spill_rate: spread(spill),
            true_delta_tokens: spread(0.0),
            hit_rate: spread(hit),
            uncached_prefill_tokens: spread(uncached),
            stay_share: spread(0.0),
            pinned_share: 0.0,
            selector_errors: 0,
            tracker_errors: 0,
        };
        let t = REPRODUCTION_TOLERANCE;
        assert_eq!(t.misses(&model(0.29, 0.54, 1090.0), &recorded), None);
        // Off by more than the tolerance on the mean, but inside the runs' own range:
        // the recorded run is one of the draws the model makes.
        let mut drawn = model(0.20, 0.50, 1200.0);
        drawn.uncached_prefill_tokens = Spread::of([900.0, 1200.0, 1500.0]);
        assert_eq!(t.misses(&drawn, &recorded), None);
        let all = t.misses(&model(0.05, 0.56, 1200.0), &recorded).unwrap();
        assert_eq!(all.split("; ").count(), 3, "{all}");
        assert!(all.contains("spill rate 5.0% against the measured 20.0% (-15.0 points"));
    }

    #[test]
    fn without_request_timing_the_router_is_not_modelled() {
        let mut w = loaded_session(2.0);
        w.lifetimes = None;
        assert!(matches!(
            w.router_knobs(RouterSettings::default(), &[], 1, None),
            Err(RouterWhatIfError::NoTiming)
        ));
        let mut one = loaded_session(2.0);
        for r in &mut one.requests {
            if r.request_id != "big" {
                r.end = None;
            }
        }
        let l = WhatIf::compute_lifetimes(&one.requests).unwrap();
        assert_eq!(l.timed, 1);
        assert!(
            one.requests
                .iter()
                .zip(&l.of)
                .all(|(r, l)| l.end_ns - r.decided_ns == 100_000_000_000),
            "the median life"
        );
        assert!(matches!(
            w.router_knobs(RouterSettings::default(), &["bad=1".into()], 1, None),
            Err(RouterWhatIfError::Setting(_))
        ));
        assert!(matches!(
            w.router_knobs(RouterSettings::default(), &[], 0, None),
            Err(RouterWhatIfError::Runs(0))
        ));
    }

    #[test]
    fn settings_change_as_the_frontend_names_them() {
        let d = RouterSettings::default();
        let s = d
            .changed(
                "temperature=0.5, --router-track-output-blocks=true,session_affinity_ttl_secs=30",
            )
            .unwrap();
        assert_eq!(s.temperature, 0.5);
        assert!(s.track_output_blocks);
        assert_eq!(s.session_affinity_ttl_secs, Some(30));
        assert_eq!(
            s.changed("session-affinity-ttl-secs=off").unwrap(),
            RouterSettings {
                session_affinity_ttl_secs: None,
                ..s
            }
        );
        let w0 = d.changed("kv-overlap-score-weight=0").unwrap();
        assert_eq!((w0.prefill_load_scale, w0.overlap_score_credit), (0.0, 0.0));
        let w2 = d.changed("kv-overlap-score-weight=2").unwrap();
        assert_eq!((w2.prefill_load_scale, w2.overlap_score_credit), (2.0, 1.0));
        assert_eq!(d.changed("").unwrap(), d);
        let args: Vec<String> = [
            "--router-temperature",
            "0.2",
            "--http-host",
            "127.0.0.1",
            "--router-track-output-blocks",
            "--router-session-affinity-ttl-secs=300",
            "--router-mode",
            "kv",
        ]
        .iter()
        .map(|a| a.to_string())
        .collect();
        let change = RouterSettings::change_from_frontend_args(&args);
        assert_eq!(
            change,
            "temperature=0.2,track-output-blocks=true,session-affinity-ttl-secs=300"
        );
        assert_eq!(
            d.changed(&change).unwrap().session_affinity_ttl_secs,
            Some(300)
        );
        assert!(matches!(
            d.changed("overlap=1"),
            Err(SettingError::Unknown(_))
        ));
        assert!(matches!(
            d.changed("temperature"),
            Err(SettingError::NotAPair(_))
        ));
        for bad in [
            "temperature=-1",
            "temperature=nan",
            "track-output-blocks=maybe",
            "session-affinity-ttl-secs=0",
            "session-affinity-ttl-secs=31536001",
        ] {
            assert!(
                matches!(d.changed(bad), Err(SettingError::Value { .. })),
                "{bad}"
            );
        }
    }
}
