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

use super::{RoutedRequest, WhatIf, WhatIfError};
use dynamo_kv_router::protocols::{PrefillLoadHint, WorkerWithDpRank};
use dynamo_kv_router::scheduling::{OverlapSignals, ScheduleMode};
use dynamo_kv_router::{
    ActiveSequencesMultiWorker, DefaultWorkerSelector, KvRouterConfig, NoopSequencePublisher,
    SchedulingRequest, SequenceRequest, WorkerConfigLike, WorkerSelectionInput, WorkerSelector,
};
use kvscope_wire::WorkerKey;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
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

/// How long each part of a request took, as its request-trace record says.
#[derive(Debug, Clone, Copy)]
struct Lifetime {
    ttft_ns: u64,
    total_ns: u64,
    output_tokens: u64,
}

/// Something that happens to a routed request after its decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    /// Its first token: its prefill tokens leave the worker's load.
    FirstToken,
    /// Its output grew by a block (with output-block tracking).
    OutputBlock,
    /// It ended: its blocks leave the worker's load, its session's idle time starts.
    End,
}

/// A session's binding to a worker (hard affinity, as Dynamo's `SessionAffinity`).
#[derive(Debug, Clone, Copy)]
struct Binding {
    worker: WorkerKey,
    in_flight: u32,
    idle_until_ns: u64,
}

/// One model's router: its workers, its load tracker and its selector.
struct ModelRouter {
    workers: HashMap<u64, ModelWorker>,
    keys: Vec<WorkerKey>,
    tracker: ActiveSequencesMultiWorker<NoopSequencePublisher>,
}

/// One run of the model over the recorded requests.
struct Run<'a> {
    w: &'a WhatIf,
    settings: RouterSettings,
    selector: DefaultWorkerSelector,
    routers: BTreeMap<Option<&'a str>, ModelRouter>,
    lifetimes: &'a [Lifetime],
    /// Each request's session: the first turn of its conversation.
    session_of: &'a [usize],
    sessions: HashMap<usize, Binding>,
    steps: BinaryHeap<Reverse<(u64, u64, Step, usize)>>,
    step_seq: u64,
    base: tokio::time::Instant,
    t0_ns: u64,
    /// Where each request went, and whether by its session's binding.
    went: Vec<WorkerKey>,
    pinned: u64,
}

impl Run<'_> {
    fn instant(&self, t_ns: u64) -> tokio::time::Instant {
        self.base + Duration::from_nanos(t_ns.saturating_sub(self.t0_ns))
    }

    fn schedule(&mut self, at_ns: u64, step: Step, i: usize) {
        self.step_seq += 1;
        self.steps.push(Reverse((at_ns, self.step_seq, step, i)));
    }

    /// Every step due by `now_ns`, in time order.
    fn advance(&mut self, now_ns: u64) {
        while let Some(&Reverse((at, _, step, i))) = self.steps.peek() {
            if at > now_ns {
                break;
            }
            self.steps.pop();
            let w = self.w;
            let r = &w.requests[i];
            let when = self.instant(at);
            let Some(router) = self.routers.get(&r.model.as_deref()) else {
                continue;
            };
            // The tracker's errors are a request it no longer holds: nothing to undo.
            match step {
                Step::FirstToken => {
                    let _ = router.tracker.mark_prefill_completed(&r.request_id, when);
                }
                Step::OutputBlock => {
                    let _ = router.tracker.add_output_block(&r.request_id, None);
                }
                Step::End => {
                    let _ = router.tracker.free(&r.request_id, when);
                    if let (Some(ttl), Some(b)) = (
                        self.settings.session_affinity_ttl_secs,
                        self.sessions.get_mut(&self.session_of[i]),
                    ) {
                        b.in_flight = b.in_flight.saturating_sub(1);
                        b.idle_until_ns = at.saturating_add(ttl * 1_000_000_000);
                    }
                }
            }
        }
    }

    /// Where request `i` goes, given each candidate's cached prefix now; booked there.
    fn route(&mut self, i: usize, r: &RoutedRequest, hits: &[(WorkerKey, usize)]) -> WorkerKey {
        let now = r.decided_ns;
        self.advance(now);
        let when = self.instant(now);
        let session = self.session_of[i];
        let Some(router) = self.routers.get(&r.model.as_deref()) else {
            self.went.push(r.worker);
            return r.worker;
        };
        let bound = self
            .settings
            .session_affinity_ttl_secs
            .and_then(|_| self.sessions.get(&session))
            .filter(|b| b.in_flight > 0 || now < b.idle_until_ns)
            .map(|b| b.worker)
            .filter(|w| router.keys.contains(w));
        let worker = match bound {
            Some(w) => w,
            None => self.select(router, r, hits, when).unwrap_or(r.worker),
        };
        let hit = hits
            .iter()
            .find(|(w, _)| *w == worker)
            .map_or(0, |(_, h)| *h);
        let cached = super::cached_tokens(r.isl_tokens, hit as u64, r.block_size);
        // A request id the tracker holds already (a repeated id) keeps its first booking.
        let _ = router.tracker.add_request(
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
        );
        if bound.is_some() {
            self.pinned += 1;
        }
        let block_size = r.block_size.max(1) as u64;
        let life = self.lifetimes[i];
        self.schedule(now.saturating_add(life.ttft_ns), Step::FirstToken, i);
        if self.settings.track_output_blocks && life.output_tokens > 0 {
            // The router adds a block each time prompt + output so far spans one more.
            let itl = (life.total_ns.saturating_sub(life.ttft_ns))
                / life.output_tokens.saturating_sub(1).max(1);
            let mut blocks = r.isl_tokens.div_ceil(block_size);
            for k in 1..=life.output_tokens {
                let total = (r.isl_tokens + k).div_ceil(block_size);
                if total > blocks {
                    blocks = total;
                    let at = now
                        .saturating_add(life.ttft_ns)
                        .saturating_add(itl.saturating_mul(k - 1));
                    self.schedule(at, Step::OutputBlock, i);
                }
            }
        }
        self.schedule(now.saturating_add(life.total_ns), Step::End, i);
        if self.settings.session_affinity_ttl_secs.is_some() {
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

    /// The worker Dynamo's selector picks for `r` with each candidate's cached prefix
    /// and the tracker's load now.
    fn select(
        &self,
        router: &ModelRouter,
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
        let picked = self
            .selector
            .select_worker(WorkerSelectionInput::configured(
                &router.workers,
                &request,
                request.eligibility(),
                r.block_size,
            ))
            .ok()?;
        Some(WorkerKey {
            worker_id: picked.worker.worker_id,
            dp_rank: picked.worker.dp_rank,
        })
    }
}

/// Figures of one routing of the recorded requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RoutedFigures {
    pub requests: u64,
    /// Of the requests that follow a previous turn, the share sent to its worker.
    pub stay_share: f64,
    pub spills: u64,
    pub spill_rate: f64,
    /// Σ (best − chosen overlap) × block size over the spills.
    pub true_delta_tokens: u64,
    pub hit_rate: f64,
    pub uncached_prefill_tokens: u64,
}

/// The spread of a figure over the model's runs (seeds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let v: Vec<f64> = values.into_iter().collect();
        if v.is_empty() {
            return Self::default();
        }
        Self {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }
}

/// What the model predicts for one setting of the router, over its runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KnobRow {
    /// The change asked for, as given (empty: the recorded settings).
    pub change: String,
    pub settings: RouterSettings,
    pub spill_rate: Spread,
    pub true_delta_tokens: Spread,
    pub hit_rate: Spread,
    pub uncached_prefill_tokens: Spread,
    /// Requests sent by their session's binding (affinity), mean share.
    pub pinned_share: f64,
    /// Of the requests that follow a previous turn, the share sent to that turn's
    /// worker (mean): how much the router keeps conversations in place, whatever
    /// worker each one started on.
    pub stay_share: f64,
}

/// The router-knob question's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouterWhatIf {
    /// The recorded run's router settings (as given; Dynamo's defaults unless said).
    pub recorded_settings: RouterSettings,
    /// The recorded run's own figures, as the collector judged them.
    pub recorded: RoutedFigures,
    /// The model at the recorded settings: how far it reproduces the recorded run.
    pub model_at_recorded: KnobRow,
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
pub const MAX_ROUTER_CHANGES: usize = 16;
/// At most this many runs (seeds) per setting.
pub const MAX_ROUTER_RUNS: u32 = 32;

impl WhatIf {
    /// Each request's life from its request-trace record (the median for one without),
    /// and how many had one; `None` when none had.
    fn lifetimes(&self) -> Option<(Vec<Lifetime>, u64)> {
        let known: Vec<Option<Lifetime>> = self
            .requests
            .iter()
            .map(|r| {
                let e = self.ends.get(&r.request_id)?;
                let ns = |ms: f64| (ms * 1e6).round().clamp(0.0, 1e15) as u64;
                let total_ns = ns(e.total_ms);
                Some(Lifetime {
                    ttft_ns: e.ttft_ms.map_or(total_ns, ns).min(total_ns),
                    total_ns,
                    output_tokens: e.output_tokens,
                })
            })
            .collect();
        let mut timed: Vec<Lifetime> = known.iter().flatten().copied().collect();
        if timed.is_empty() {
            return None;
        }
        let n = timed.len() as u64;
        timed.sort_by_key(|l| l.total_ns);
        let median = timed[timed.len() / 2];
        Some((known.into_iter().map(|l| l.unwrap_or(median)).collect(), n))
    }

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

    /// The model's routers, one per model, over the workers its requests went to.
    fn model_routers(&self) -> BTreeMap<Option<&str>, ModelRouter> {
        self.workers_by_model()
            .into_iter()
            .map(|(model, keys)| {
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
                    .find(|r| r.model.as_deref() == model)
                    .map_or(16, |r| r.block_size);
                let router = ModelRouter {
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
                        block_size.max(1) as usize,
                        dp_range,
                        false,
                        0,
                        "decode",
                    ),
                    keys,
                };
                (model, router)
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
        let min = self.min_spill_blocks.max(1);
        let mut f = RoutedFigures {
            requests: t.requests,
            hit_rate: t.hit_rate(),
            uncached_prefill_tokens: t.uncached_prefill_tokens,
            ..RoutedFigures::default()
        };
        for r in &self.requests {
            let gap = r
                .recorded_best_overlap_blocks
                .saturating_sub(r.recorded_overlap_blocks);
            if r.recorded_best != r.worker && gap >= min {
                f.spills += 1;
                f.true_delta_tokens += u64::from(gap) * u64::from(r.block_size);
            }
        }
        f.spill_rate = f.spills as f64 / f.requests.max(1) as f64;
        let went: Vec<WorkerKey> = self.requests.iter().map(|r| r.worker).collect();
        f.stay_share = self.stay_share(&went);
        f
    }

    /// One run of the model at `settings` with `seed`, over caches of `sizes` blocks.
    fn route_once(
        &self,
        settings: RouterSettings,
        seed: u64,
        sizes: &HashMap<WorkerKey, u64>,
        lifetimes: &[Lifetime],
        session_of: &[usize],
    ) -> (RoutedFigures, u64, Vec<WorkerKey>) {
        let t0_ns = self.requests.first().map_or(0, |r| r.decided_ns);
        let mut run = Run {
            w: self,
            settings,
            selector: DefaultWorkerSelector::new_seeded(
                Some(settings.kv_router_config()),
                "decode",
                seed,
            ),
            routers: self.model_routers(),
            lifetimes,
            session_of,
            sessions: HashMap::new(),
            steps: BinaryHeap::new(),
            step_seq: 0,
            base: tokio::time::Instant::now(),
            t0_ns,
            went: Vec::with_capacity(self.requests.len()),
            pinned: 0,
        };
        let min = self.min_spill_blocks.max(1) as usize;
        let mut f = RoutedFigures::default();
        let mut route =
            |i: usize, r: &RoutedRequest, hits: &[(WorkerKey, usize)]| run.route(i, r, hits);
        let totals = self.replay_routed(
            |w| sizes.get(w).copied().unwrap_or(0),
            true,
            Some(&mut route),
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
        (f, run.pinned, run.went)
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
        let (lifetimes, timed) = self.lifetimes().ok_or(RouterWhatIfError::NoTiming)?;
        let sizes = self.sizes(given)?;
        let (permille, _) = self.calibrated_permille(&sizes);
        let simulated: HashMap<WorkerKey, u64> = sizes
            .iter()
            .map(|(w, b)| (*w, super::scaled(*b, permille)))
            .collect();
        let session_of = self.sessions();
        let n = self.requests.len() as f64;
        let row = |change: &str, s: RouterSettings| {
            let outs: Vec<(RoutedFigures, u64, f64)> = (0..runs as u64)
                .map(|seed| {
                    let (f, pinned, went) =
                        self.route_once(s, seed, &simulated, &lifetimes, &session_of);
                    let stay = self.stay_share(&went);
                    (f, pinned, stay)
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
                pinned_share: outs.iter().map(|o| o.1 as f64).sum::<f64>() / (n * runs as f64),
                stay_share: outs.iter().map(|o| o.2).sum::<f64>() / runs as f64,
            }
        };
        let mut session_roots = session_of.clone();
        session_roots.sort_unstable();
        session_roots.dedup();
        Ok(RouterWhatIf {
            recorded_settings,
            recorded: self.recorded_figures(),
            model_at_recorded: row("", recorded_settings),
            rows: changes
                .iter()
                .zip(settings)
                .map(|(c, s)| row(c, s))
                .collect(),
            runs,
            requests_timed: timed,
            requests_untimed: self.requests.len() as u64 - timed,
            sessions: session_roots.len() as u64,
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
    #[error("at most {MAX_ROUTER_CHANGES} router settings at once, not {0}")]
    TooManyChanges(usize),
    #[error("1 to {MAX_ROUTER_RUNS} runs per setting, not {0}")]
    Runs(u32),
}

impl RouterWhatIf {
    pub fn to_markdown(&self) -> String {
        let pct = |v: f64| format!("{:.1}%", 100.0 * v);
        let spread_pct = |s: &Spread| {
            if s.max - s.min < 5e-4 {
                pct(s.mean)
            } else {
                format!("{} ({}–{})", pct(s.mean), pct(s.min), pct(s.max))
            }
        };
        let spread_n = |s: &Spread| {
            if s.max - s.min < 0.5 {
                format!("{:.0}", s.mean)
            } else {
                format!("{:.0} ({:.0}–{:.0})", s.mean, s.min, s.max)
            }
        };
        let mut s = format!(
            "# What if the router were set otherwise\n\n\
             The recorded requests routed again by Dynamo 1.6.1's own load tracker and worker \
             selector over the simulated caches ({:.2} simulated blocks per block), {} runs per \
             setting; each request's arrival and durations held as recorded \
             ({} requests timed by Dynamo's request trace, {} given the median life); \
             {} conversations followed by their prompts, as the sessions of affinity.\n\n\
             | router | spill rate | Σ true delta (tokens) | hit rate | uncached prefill tokens | \
             turns kept on their worker | by affinity |\n\
             |---|---:|---:|---:|---:|---:|---:|\n\
             | recorded run (measured) | {} | {} | {} | {} | {} | |\n",
            self.calibration,
            self.runs,
            self.requests_timed,
            self.requests_untimed,
            self.sessions,
            pct(self.recorded.spill_rate),
            self.recorded.true_delta_tokens,
            pct(self.recorded.hit_rate),
            self.recorded.uncached_prefill_tokens,
            pct(self.recorded.stay_share),
        );
        for r in std::iter::once(&self.model_at_recorded).chain(&self.rows) {
            let name = if r.change.is_empty() {
                "model, as recorded".to_string()
            } else {
                format!("model, `{}`", r.change)
            };
            s.push_str(&format!(
                "| {name} | {} | {} | {} | {} | {} | {} |\n",
                spread_pct(&r.spill_rate),
                spread_n(&r.true_delta_tokens),
                spread_pct(&r.hit_rate),
                spread_n(&r.uncached_prefill_tokens),
                pct(r.stay_share),
                pct(r.pinned_share),
            ));
        }
        s
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
    /// its first token after 0.1 ms, its end after `total_ms`.
    fn request(id: &str, worker: u64, at_ms: f64, chain: Vec<u64>) -> RoutedRequest {
        RoutedRequest {
            request_id: id.to_string(),
            decided_ns: (at_ms * 1e6) as u64,
            model: None,
            worker: w(worker),
            isl_tokens: chain.len() as u64 * 16,
            chain,
            block_size: 16,
            recorded_overlap_blocks: 0,
            recorded_best: w(worker),
            recorded_best_overlap_blocks: 0,
            decoded_runs: Vec::new(),
        }
    }

    fn end(r: &RoutedRequest, total_ms: f64) -> (String, RequestEnd) {
        (
            r.request_id.clone(),
            RequestEnd {
                request_id: r.request_id.clone(),
                worker: r.worker,
                prefill_worker: None,
                received_ns: r.decided_ns,
                ttft_ms: Some(0.1),
                total_ms,
                input_tokens: r.isl_tokens,
                output_tokens: 8,
                cached_tokens: None,
            },
        )
    }

    fn what_if(requests: Vec<(RoutedRequest, f64)>) -> WhatIf {
        let ends = requests.iter().map(|(r, t)| end(r, *t)).collect();
        let requests: Vec<RoutedRequest> = requests.into_iter().map(|(r, _)| r).collect();
        WhatIf {
            previous: super::super::previous_turns(&requests),
            requests,
            ends,
            discovered_blocks: HashMap::from([(1, 1000), (2, 1000)]),
            ..WhatIf::empty()
        }
    }

    /// Session S's first turn, then two long requests that load its worker more than the
    /// other, then S's second turn: routed on load alone (credit 0) it leaves S's
    /// worker, unless affinity holds it there; once S has been idle past the TTL, it
    /// leaves again.
    fn loaded_session(second_turn_ms: f64) -> WhatIf {
        let blocks = |from: u64, n: u64| (from..from + n).collect::<Vec<_>>();
        what_if(vec![
            (request("s-t1", 1, 0.0, blocks(1, 20)), 1.0),
            (request("big", 2, 0.5, blocks(100, 40)), 100_000.0),
            (request("big2", 1, 1.0, blocks(200, 48)), 100_000.0),
            (request("s-t2", 1, second_turn_ms, blocks(1, 22)), 1.0),
        ])
    }

    fn went(w: &WhatIf, change: &str) -> (Vec<WorkerKey>, u64) {
        let s = RouterSettings::default().changed(change).unwrap();
        let sizes = HashMap::from([(self::w(1), 1000), (self::w(2), 1000)]);
        let (lifetimes, _) = w.lifetimes().unwrap();
        let (_, pinned, went) = w.route_once(s, 7, &sizes, &lifetimes, &w.sessions());
        (went, pinned)
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
    fn without_request_timing_the_router_is_not_modelled() {
        let mut w = loaded_session(2.0);
        w.ends.clear();
        assert!(matches!(
            w.router_knobs(RouterSettings::default(), &[], 1, None),
            Err(RouterWhatIfError::NoTiming)
        ));
        let mut one = loaded_session(2.0);
        one.ends.retain(|id, _| id == "big");
        let (l, timed) = one.lifetimes().unwrap();
        assert_eq!(timed, 1);
        assert!(
            l.iter().all(|l| l.total_ns == 100_000_000_000),
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
