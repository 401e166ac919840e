//! Joins the router's `[ROUTING_INPUT]` and `Selected worker` lines by request id into
//! [`RoutingDecision`]s (pure).
//!
//! Time is the log's own: each line's timestamp (or the last one seen, for lines without
//! one) advances the joiner's clock, and a half still alone `timeout` after its line is
//! given up as unjoined. The same log therefore always gives the same decisions,
//! whenever and however fast it is read.

use crate::taps::router::parse::{
    parse_line, Candidate, LineContent, LineKind, MalformedLine, RoutingInput, SelectedWorker,
};
use kvscope_wire::{MigrationLogLine, RouterCandidate, RoutingDecision, TraceContext, WorkerKey};
use std::collections::{HashMap, VecDeque};

/// Which half of a decision arrived without the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    /// A `[ROUTING_INPUT]` line never followed by its `Selected worker` line.
    InputOnly,
    /// A `Selected worker` line whose `[ROUTING_INPUT]` line never came.
    SelectionOnly,
}

impl Half {
    pub fn as_str(self) -> &'static str {
        match self {
            Half::InputOnly => "routing_input_only",
            Half::SelectionOnly => "selected_worker_only",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum JoinOutput {
    Joined(Box<RoutingDecision>),
    Unjoined { request_id: String, half: Half },
}

#[derive(Debug)]
struct Pending<T> {
    generation: u64,
    value: T,
}

/// The joiner's state: halves waiting for their other half.
#[derive(Debug)]
pub(crate) struct DecisionJoiner {
    timeout_ns: u64,
    max_pending: usize,
    now_ns: u64,
    generation: u64,
    inputs: HashMap<String, Pending<RoutingInput>>,
    selections: HashMap<String, Pending<SelectedWorker>>,
    /// Arrival order of pending halves: (record time, generation, half, request id).
    order: VecDeque<(u64, u64, Half, String)>,
}

impl DecisionJoiner {
    /// `timeout_ns`: how long (in log time) a half may wait; `max_pending`: how many
    /// halves may wait at once (the oldest are given up beyond it).
    pub fn new(timeout_ns: u64, max_pending: usize) -> Self {
        Self {
            timeout_ns,
            max_pending: max_pending.max(1),
            now_ns: 0,
            generation: 0,
            inputs: HashMap::new(),
            selections: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    pub fn pending(&self) -> usize {
        self.inputs.len() + self.selections.len()
    }

    pub fn input(&mut self, ts_ns: u64, input: RoutingInput) -> Vec<JoinOutput> {
        let mut out = self.advance(ts_ns);
        if let Some(sel) = self.selections.remove(&input.request_id) {
            out.push(JoinOutput::Joined(Box::new(join(input, sel.value))));
            return out;
        }
        let id = input.request_id.clone();
        let generation = self.next_generation();
        if self
            .inputs
            .insert(
                id.clone(),
                Pending {
                    generation,
                    value: input,
                },
            )
            .is_some()
        {
            // A second input for the same request before any selection: the first one
            // was never decided (or its selection line was lost).
            out.push(JoinOutput::Unjoined {
                request_id: id.clone(),
                half: Half::InputOnly,
            });
        }
        // Waiting is measured on the joiner's clock, which never goes back: a line dated
        // before its predecessors (a clock stepped back) waits its full timeout.
        self.order
            .push_back((self.now_ns, generation, Half::InputOnly, id));
        self.enforce_cap(&mut out);
        out
    }

    pub fn selected(&mut self, ts_ns: u64, sel: SelectedWorker) -> Vec<JoinOutput> {
        let mut out = self.advance(ts_ns);
        if let Some(input) = self.inputs.remove(&sel.request_id) {
            out.push(JoinOutput::Joined(Box::new(join(input.value, sel))));
            return out;
        }
        let id = sel.request_id.clone();
        let generation = self.next_generation();
        if self
            .selections
            .insert(
                id.clone(),
                Pending {
                    generation,
                    value: sel,
                },
            )
            .is_some()
        {
            out.push(JoinOutput::Unjoined {
                request_id: id.clone(),
                half: Half::SelectionOnly,
            });
        }
        self.order
            .push_back((self.now_ns, generation, Half::SelectionOnly, id));
        self.enforce_cap(&mut out);
        out
    }

    /// Move the clock to `ts_ns` (never backwards) and give up halves older than the
    /// timeout.
    pub(crate) fn advance(&mut self, ts_ns: u64) -> Vec<JoinOutput> {
        self.now_ns = self.now_ns.max(ts_ns);
        let mut out = Vec::new();
        while let Some((t, ..)) = self.order.front() {
            if t.saturating_add(self.timeout_ns) >= self.now_ns {
                break;
            }
            self.expire_front(&mut out);
        }
        out
    }

    /// Drop the choice waiting for `request_id`'s routing input: the request was decided
    /// otherwise (from its request-trace record). Its place in the expiry order finds it
    /// gone and reports nothing.
    pub(crate) fn forget_selection(&mut self, request_id: &str) {
        self.selections.remove(request_id);
    }

    /// Give up every waiting half (end of input).
    pub fn flush(&mut self) -> Vec<JoinOutput> {
        let mut out = Vec::new();
        while !self.order.is_empty() {
            self.expire_front(&mut out);
        }
        out
    }

    fn enforce_cap(&mut self, out: &mut Vec<JoinOutput>) {
        while self.pending() > self.max_pending && !self.order.is_empty() {
            self.expire_front(out);
        }
    }

    fn expire_front(&mut self, out: &mut Vec<JoinOutput>) {
        let Some((_, generation, half, id)) = self.order.pop_front() else {
            return;
        };
        let still_waiting = match half {
            Half::InputOnly => remove_if_generation(&mut self.inputs, &id, generation),
            Half::SelectionOnly => remove_if_generation(&mut self.selections, &id, generation),
        };
        if still_waiting {
            out.push(JoinOutput::Unjoined {
                request_id: id,
                half,
            });
        }
    }

    fn next_generation(&mut self) -> u64 {
        self.generation += 1;
        self.generation
    }
}

fn remove_if_generation<T>(
    map: &mut HashMap<String, Pending<T>>,
    id: &str,
    generation: u64,
) -> bool {
    if map.get(id).is_some_and(|p| p.generation == generation) {
        map.remove(id);
        true
    } else {
        false
    }
}

fn join(input: RoutingInput, sel: SelectedWorker) -> RoutingDecision {
    RoutingDecision {
        tenant: None,
        model: input.model,
        request_id: input.request_id,
        worker: WorkerKey {
            worker_id: sel.worker_id,
            dp_rank: sel.dp_rank,
        },
        isl_tokens: input.isl_tokens,
        block_size: input.block_size,
        local_hashes: input.local_hashes,
        sequence_hashes: None,
        worker_type: sel.worker_type,
        router_mode: sel.router_mode,
        clock_behind_ms: None,
        selection: sel.selection,
        trace: input.trace,
    }
}

/// What one log line yields.
/// Which log lines routing decisions are taken from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionSource {
    /// The router's `[ROUTING_INPUT]` (DEBUG) and `Selected worker` lines, at the
    /// routing moment; and, for requests no such line named, Dynamo's request trace.
    #[default]
    Auto,
    /// Only `[ROUTING_INPUT]` + `Selected worker`.
    RoutingInput,
    /// Only the request trace (`DYN_REQUEST_TRACE=1`), at any log level.
    RequestTrace,
}

impl std::str::FromStr for DecisionSource {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "routing-input" | "routing_input" => Ok(Self::RoutingInput),
            "request-trace" | "request_trace" => Ok(Self::RequestTrace),
            other => Err(format!(
                "unknown decision source {other:?} (expected auto, routing-input or request-trace)"
            )),
        }
    }
}

/// How far ahead of this host's clock a log line may be dated (clocks of two hosts
/// disagree by this much at most); beyond it the line's time is not taken.
pub const FUTURE_TOLERANCE_NS: u64 = 60_000_000_000;

/// Request ids recently decided from routing lines, so that their request-trace
/// records (written at the end of the same requests) are not decisions twice.
#[derive(Debug, Default)]
struct RecentIds {
    set: std::collections::HashSet<String>,
    order: std::collections::VecDeque<String>,
}

impl RecentIds {
    const CAP: usize = 100_000;

    /// Remember `id`; whether it was new.
    fn insert(&mut self, id: &str) -> bool {
        if !self.set.insert(id.to_string()) {
            return false;
        }
        self.order.push_back(id.to_string());
        if self.order.len() > Self::CAP {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        true
    }

    fn contains(&self, id: &str) -> bool {
        self.set.contains(id)
    }
}

/// A value per recent request, the first one noted winning: where a request sits in the
/// router's traces (the first line of a request that carries a span: the frontend's
/// `http-request` span, the root of the request's trace), the worker its `Selected
/// worker` line named.
#[derive(Debug)]
struct RecentByRequest<V> {
    map: HashMap<String, V>,
    order: VecDeque<String>,
}

impl<V> Default for RecentByRequest<V> {
    fn default() -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
        }
    }
}

impl<V: Clone> RecentByRequest<V> {
    /// Requests remembered at once; the oldest are forgotten beyond it (a request's
    /// decision, migration and request-trace lines come within seconds of its first
    /// line).
    const CAP: usize = 50_000;

    fn note(&mut self, request_id: &str, value: V) {
        if self.map.contains_key(request_id) {
            return;
        }
        self.order.push_back(request_id.to_string());
        self.map.insert(request_id.to_string(), value);
        if self.order.len() > Self::CAP {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }

    fn get(&self, request_id: &str) -> Option<V> {
        self.map.get(request_id).cloned()
    }
}

/// The workers the router scored per recent request (its `Formula for worker_id=…`
/// lines, which come before the choice), until the request's view takes them: per
/// request, each line's pool and score.
#[derive(Debug, Default)]
struct Scored {
    map: HashMap<String, Vec<(Option<String>, RouterCandidate)>>,
    order: VecDeque<String>,
    /// Score lines held, over every request.
    lines: usize,
}

impl Scored {
    /// Requests whose scores wait for their view at once: the view comes within a second
    /// of the choice ([`CHOICE_VIEW_HOLD_NS`]), so only the requests being routed wait;
    /// the oldest are given up beyond it.
    const CAP: usize = 4_096;
    /// Score lines held at once (a line per worker scored: a few MiB): the oldest
    /// requests' are given up beyond it, and a request's lines past it.
    const CAP_LINES: usize = 65_536;

    /// Keep `c`; how many score lines were given up to make room.
    fn note(&mut self, c: Candidate) -> u64 {
        use std::collections::hash_map::Entry;
        let list = match self.map.entry(c.request_id) {
            Entry::Occupied(e) if e.get().len() >= Self::CAP_LINES => return 1,
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                self.order.push_back(e.key().clone());
                e.insert(Vec::new())
            }
        };
        list.push((c.worker_type, c.candidate));
        self.lines += 1;
        let mut given_up = 0;
        while self.order.len() > Self::CAP || self.lines > Self::CAP_LINES {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            let n = self.map.remove(&old).map_or(0, |l| l.len());
            self.lines -= n;
            given_up += n as u64;
        }
        given_up
    }

    /// The workers scored in the pool of the view's worker (a disaggregated request is
    /// scored in each pool under one id), the first score of each; and how many lines
    /// the request had. `None` when the view's worker was not among them.
    fn take(&mut self, view: &kvscope_wire::RouterView) -> (Option<Vec<RouterCandidate>>, u64) {
        let Some(list) = self.map.remove(&view.request_id) else {
            return (None, 0);
        };
        self.lines -= list.len();
        let n = list.len() as u64;
        let Some(pool) = list
            .iter()
            .find(|(_, c)| c.worker == view.worker)
            .map(|(pool, _)| pool.clone())
        else {
            return (None, n);
        };
        let mut seen = std::collections::HashSet::new();
        let out = list
            .into_iter()
            .filter(|(p, c)| *p == pool && seen.insert(c.worker))
            .map(|(_, c)| c)
            .collect();
        (Some(out), n)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum LogOutput {
    Decision(RoutingDecision),
    /// A decision from the request trace: it happened at `at_ns` (the request's arrival),
    /// long before its line was written.
    TracedDecision {
        decision: RoutingDecision,
        at_ns: u64,
    },
    /// A request-trace record for a request already decided from its routing lines.
    TraceDuplicate,
    /// A request's life from its request-trace record (with its decision, or its
    /// duplicate, before it).
    RequestEnd(kvscope_wire::RequestEnd),
    /// A line dated further ahead of this host's clock than clocks can disagree: its
    /// time is not taken (it would stop every join until real time caught up).
    FutureLine {
        ts_ns: u64,
        ahead_ns: u64,
    },
    Migration(MigrationLogLine),
    /// The router's view of a choice (its line comes when the request's route ends).
    RouterView(kvscope_wire::RouterView),
    /// Router score lines given up: their request's view never came while they were
    /// remembered, or it named a worker they did not score.
    CandidatesUnjoined(u64),
    /// A request's arrival line without the tenant field it was told to read, or whose
    /// value the pattern does not match: its tenant is its cache salt's.
    TenantUnread,
    Malformed(MalformedLine),
    Unjoined {
        request_id: String,
        half: Half,
    },
    /// The router logs its choices but nothing decisions are made of: no
    /// `[ROUTING_INPUT]` line and no request-trace record so far, while a `Selected
    /// worker` line went unjoined. Said once per log.
    RoutingInputMissing,
}

/// The longest tenant name kept: a longer one is none read.
const MAX_TENANT: usize = 256;

/// Which field of a request's arrival line (the frontend's INFO `request received`,
/// with the HTTP request's span: `x_request_id`, …) names its tenant, and, optionally,
/// the part of it that does: the pattern's first group, or its whole match.
#[derive(Debug, Clone)]
pub struct TenantField {
    pub field: String,
    pub pattern: Option<regex::Regex>,
}

impl TenantField {
    /// The tenant `fields` name: `None` where the field is missing or empty, the pattern
    /// does not match, or the name is longer than [`MAX_TENANT`].
    fn tenant_of(&self, fields: &[(String, String)]) -> Option<String> {
        let value = fields.iter().find(|(k, _)| *k == self.field)?.1.as_str();
        let tenant = match &self.pattern {
            None => value,
            // The first group where the pattern has one (a match without it names none),
            // else the whole match.
            Some(re) => {
                let c = re.captures(value)?;
                c.get(usize::from(re.captures_len() > 1))?.as_str()
            }
        };
        (!tenant.is_empty() && tenant.len() <= MAX_TENANT).then(|| tenant.to_string())
    }
}

/// Parser and joiner together: log lines in, records and problems out.
#[derive(Debug)]
pub struct RouterLogProcessor {
    joiner: DecisionJoiner,
    last_ts_ns: Option<u64>,
    source: DecisionSource,
    routed: RecentIds,
    /// Requests whose router view was sent: Dynamo 1.5 logs it twice (as it chooses, at
    /// DEBUG, and when the route ends), the same figure.
    viewed: RecentIds,
    /// Views written as the router chose (`[ROUTING] Best`), oldest first with their
    /// log time, held [`CHOICE_VIEW_HOLD_NS`]: Dynamo 1.6's disaggregated prefill router
    /// writes the worker it passed over from another task, just before or just after
    /// that line. A view of the route's end (1.5, 1.6) that comes first goes in the held
    /// one's place (the same figures). Each with this host's clock when it was read, so
    /// that a router gone idle after it does not hold it ([`Self::idle`]).
    choice_views: VecDeque<HeldView>,
    /// This host's clock at the line being processed (0: none).
    wall_ns: u64,
    spans: RecentByRequest<TraceContext>,
    /// The model each recent request asked for, from its arrival line.
    models: RecentByRequest<String>,
    /// Which field of a request's arrival line names its tenant, when told.
    tenant_field: Option<TenantField>,
    /// The tenant each recent request's arrival line named.
    tenants: RecentByRequest<String>,
    scored: Scored,
    /// The worker each recent `Selected worker` line named: the worker of a request-trace
    /// record that names none (Dynamo before 1.5 writes none).
    chosen: RecentByRequest<WorkerKey>,
    /// What the log has shown that decisions are made of, for
    /// [`LogOutput::RoutingInputMissing`].
    routing_inputs: u64,
    traces: u64,
    selections: u64,
    advised: bool,
}

/// How long (log time) a view written as the router chose waits for the lines that
/// concern its choice and come from other tasks (microseconds apart in practice).
const CHOICE_VIEW_HOLD_NS: u64 = 1_000_000_000;

/// A view written as the router chose, waiting: its log time, this host's clock when its
/// line was read (0: none), the view.
type HeldView = (u64, u64, kvscope_wire::RouterView);

/// Choices seen, with no routing input and no request trace beside them, after which the
/// router is told what to set without waiting for one to time out (in log time, which
/// stands still while the router is idle). A router that logs its inputs writes each
/// one before the choice it leads to, so one choice would do; a few allow for lines
/// reordered on the way.
const ADVISE_AFTER_SELECTIONS: u64 = 8;

impl RouterLogProcessor {
    pub fn new(timeout_ns: u64, max_pending: usize) -> Self {
        Self::with_source(timeout_ns, max_pending, DecisionSource::Auto)
    }

    /// Name each decision's tenant by `field` of its request's arrival line.
    pub(crate) fn with_tenant_field(mut self, field: Option<TenantField>) -> Self {
        self.tenant_field = field;
        self
    }

    pub(crate) fn with_source(timeout_ns: u64, max_pending: usize, source: DecisionSource) -> Self {
        Self {
            joiner: DecisionJoiner::new(timeout_ns, max_pending),
            last_ts_ns: None,
            source,
            routed: RecentIds::default(),
            viewed: RecentIds::default(),
            choice_views: VecDeque::new(),
            wall_ns: 0,
            spans: RecentByRequest::default(),
            models: RecentByRequest::default(),
            tenant_field: None,
            tenants: RecentByRequest::default(),
            scored: Scored::default(),
            chosen: RecentByRequest::default(),
            routing_inputs: 0,
            traces: 0,
            selections: 0,
            advised: false,
        }
    }

    /// Process one line. `wall_ns` is this host's clock: the record time used while the
    /// log has shown no timestamp at all, and what a line's own time is checked against
    /// (0: no clock, e.g. a log read long after it was written, no check).
    pub fn line(&mut self, raw: &str, wall_ns: u64) -> Vec<LogOutput> {
        let fallback_ns = wall_ns;
        self.wall_ns = wall_ns;
        let mut parsed = match parse_line(raw) {
            Ok(p) => p,
            Err(e) => {
                let mut out = Vec::new();
                if let Some(ts) = e.ts_ns {
                    self.last_ts_ns = Some(ts);
                    out.extend(self.joiner.advance(ts).into_iter().map(from_join));
                }
                out.push(LogOutput::Malformed(e));
                return out;
            }
        };
        let mut future = None;
        if let Some(ts) = parsed.ts_ns {
            if wall_ns > 0 && ts > wall_ns.saturating_add(FUTURE_TOLERANCE_NS) {
                future = Some(LogOutput::FutureLine {
                    ts_ns: ts,
                    ahead_ns: ts - wall_ns,
                });
                parsed.ts_ns = None;
            }
        }
        if let Some(ts) = parsed.ts_ns {
            // Never backwards: a line dated before its predecessors (a clock stepped
            // back) keeps the clock where it was.
            self.last_ts_ns = Some(self.last_ts_ns.map_or(ts, |l| l.max(ts)));
        }
        let now = self.last_ts_ns.unwrap_or(fallback_ns);
        match &parsed.content {
            LineContent::RoutingInput(_) => self.routing_inputs += 1,
            LineContent::RequestTrace(_) => self.traces += 1,
            LineContent::SelectedWorker(_) => self.selections += 1,
            _ => {}
        }
        let mut out: Vec<LogOutput> = future.into_iter().collect();
        out.extend(self.decide(parsed, now));
        out.extend(self.held_views_due(Some(now)));
        self.advise(&mut out);
        out
    }

    /// Say once what the router needs, when a choice went unjoined, or enough choices
    /// came, in a log that has shown nothing decisions are made of.
    fn advise(&mut self, out: &mut Vec<LogOutput>) {
        let unjoined_choice = out.iter().any(|o| {
            matches!(
                o,
                LogOutput::Unjoined {
                    half: Half::SelectionOnly,
                    ..
                }
            )
        });
        let choices_alone = unjoined_choice || self.selections >= ADVISE_AFTER_SELECTIONS;
        if choices_alone && !self.advised && self.routing_inputs == 0 && self.traces == 0 {
            self.advised = true;
            out.push(LogOutput::RoutingInputMissing);
        }
    }

    fn decide(
        &mut self,
        parsed: crate::taps::router::parse::ParsedLine,
        now: u64,
    ) -> Vec<LogOutput> {
        let routing_lines = self.source != DecisionSource::RequestTrace;
        // Whatever the decisions come from: a request-trace record that names no worker
        // takes this one for its decision and its end.
        if let LineContent::SelectedWorker(sel) = &parsed.content {
            let key = WorkerKey {
                worker_id: sel.worker_id,
                dp_rank: sel.dp_rank,
            };
            self.chosen.note(&sel.request_id, key);
        }
        let joined = match parsed.content {
            LineContent::RoutingInput(mut i) if routing_lines => {
                // A routing line outside the request's span (a completions request's)
                // names no model: the request's arrival line did.
                if i.model.is_none() {
                    i.model = self.models.get(&i.request_id);
                }
                self.joiner.input(now, i)
            }
            LineContent::SelectedWorker(s) if routing_lines => self.joiner.selected(now, s),
            LineContent::RoutingInput(_) | LineContent::SelectedWorker(_) => {
                self.joiner.advance(now)
            }
            LineContent::RequestTrace(mut t) => {
                let mut out = self.advanced(now);
                let Some(worker) = t.worker.or_else(|| self.chosen.get(&t.request_id)) else {
                    out.push(LogOutput::Malformed(MalformedLine {
                        kind: LineKind::RequestTrace,
                        ts_ns: parsed.ts_ns,
                        reason: "no worker, and no `Selected worker` line named the request".into(),
                    }));
                    return out;
                };
                t.set_worker(worker);
                let end = LogOutput::RequestEnd(t.end);
                out.push(match self.source {
                    DecisionSource::RoutingInput => {
                        out.push(end);
                        return out;
                    }
                    _ if self.routed.contains(&t.request_id) => LogOutput::TraceDuplicate,
                    _ => {
                        // Decided here: the choice's line waits for no routing input.
                        self.joiner.forget_selection(&t.request_id);
                        LogOutput::TracedDecision {
                            at_ns: t.received_ns,
                            decision: RoutingDecision {
                                tenant: self.tenants.get(&t.request_id),
                                model: self.models.get(&t.request_id),
                                trace: self.spans.get(&t.request_id),
                                request_id: t.request_id,
                                worker,
                                isl_tokens: t.isl_tokens,
                                block_size: t.block_size,
                                local_hashes: Vec::new(),
                                sequence_hashes: Some(t.sequence_hashes),
                                worker_type: None,
                                router_mode: None,
                                clock_behind_ms: None,
                                selection: Default::default(),
                            },
                        }
                    }
                });
                out.push(end);
                return out;
            }
            LineContent::Migration(mut m) => {
                if m.trace.is_none() {
                    m.trace = m.request_id.as_deref().and_then(|id| self.spans.get(id));
                }
                let mut out = self.advanced(now);
                out.push(LogOutput::Migration(m));
                return out;
            }
            // A route's end states the view a held one did: it goes in its place (the
            // held one, viewed by then, is not sent).
            LineContent::RouterView(v) => {
                let mut out = self.advanced(now);
                out.extend(self.view(v));
                return out;
            }
            // Held a while: lines about the choice from other tasks may come after it.
            LineContent::ChoiceView(v) => {
                let mut out = self.advanced(now);
                if !self.viewed.contains(&v.request_id) {
                    self.choice_views.push_back((now, self.wall_ns, v));
                    if self.choice_views.len() > Scored::CAP {
                        if let Some((_, _, oldest)) = self.choice_views.pop_front() {
                            out.extend(self.view(oldest));
                        }
                    }
                }
                return out;
            }
            LineContent::Candidate(c) => return self.scores(now, [c], false),
            // Written by the first leg's router (the prefill pool's) as it chooses: one
            // whose view went before it is lost, and counted.
            LineContent::PassedOver { chosen, best } => {
                return self.scores(now, [chosen, best], true)
            }
            LineContent::RequestSpan {
                request_id,
                trace,
                model,
                fields,
            } => {
                if let Some(trace) = trace {
                    self.spans.note(&request_id, trace);
                }
                if let Some(model) = model {
                    self.models.note(&request_id, model);
                }
                let mut out = self.advanced(now);
                // Only an arrival line carries fields; it names the tenant, or is counted.
                if let Some(by) = self.tenant_field.as_ref().filter(|_| !fields.is_empty()) {
                    match by.tenant_of(&fields) {
                        Some(tenant) => self.tenants.note(&request_id, tenant),
                        None => out.push(LogOutput::TenantUnread),
                    }
                }
                return out;
            }
            LineContent::Other => self.joiner.advance(now),
        };
        joined.into_iter().map(|j| self.output(j)).collect()
    }

    /// The held views written as the router chose that waited their time at log time
    /// `now`, sent; every one at the log's end (`None`).
    fn held_views_due(&mut self, now: Option<u64>) -> Vec<LogOutput> {
        let mut out = Vec::new();
        while let Some((t, _, _)) = self.choice_views.front() {
            if now.is_some_and(|now| now.saturating_sub(*t) <= CHOICE_VIEW_HOLD_NS) {
                break;
            }
            if let Some((_, _, v)) = self.choice_views.pop_front() {
                out.extend(self.view(v));
            }
        }
        out
    }

    /// No line came for a while; `wall_ns` is this host's clock. Log time stands still
    /// while the router is idle, so the views held longer than their time by this clock
    /// are sent: whatever concerned their choice was written, and read, by now. (The
    /// last request before a quiet spell would otherwise wait for the next one.)
    pub fn idle(&mut self, wall_ns: u64) -> Vec<LogOutput> {
        let mut out = Vec::new();
        while let Some((_, read_ns, _)) = self.choice_views.front() {
            if *read_ns == 0 || wall_ns.saturating_sub(*read_ns) <= CHOICE_VIEW_HOLD_NS {
                break;
            }
            if let Some((_, _, v)) = self.choice_views.pop_front() {
                out.extend(self.view(v));
            }
        }
        out
    }

    /// Send a request's first view, with what the router credited the workers it scored.
    fn view(&mut self, mut v: kvscope_wire::RouterView) -> Vec<LogOutput> {
        let mut out = Vec::new();
        if self.viewed.insert(&v.request_id) {
            match self.scored.take(&v) {
                (Some(c), _) => v.candidates = c,
                (None, 0) => {}
                (None, n) => out.push(LogOutput::CandidatesUnjoined(n)),
            }
            out.push(LogOutput::RouterView(v));
        }
        out
    }

    /// Keep what the router credited workers with until the request's view takes it.
    /// A score for a request whose view was sent already is the other leg's of a
    /// disaggregated request (scored in the other pool after the first leg's view), whose
    /// view is not sent either; or, `late_is_lost`, one that came too late.
    fn scores<const N: usize>(
        &mut self,
        now: u64,
        scores: [Candidate; N],
        late_is_lost: bool,
    ) -> Vec<LogOutput> {
        let mut out = self.advanced(now);
        let mut given_up = 0;
        for c in scores {
            if !self.viewed.contains(&c.request_id) {
                given_up += self.scored.note(c);
            } else if late_is_lost {
                given_up += 1;
            }
        }
        if given_up > 0 {
            out.push(LogOutput::CandidatesUnjoined(given_up));
        }
        out
    }

    /// The joiner moved to `now`: what that times out or completes.
    fn advanced(&mut self, now: u64) -> Vec<LogOutput> {
        self.joiner
            .advance(now)
            .into_iter()
            .map(|j| self.output(j))
            .collect()
    }

    /// End of input: every waiting half is unjoined.
    pub fn finish(&mut self) -> Vec<LogOutput> {
        let mut out: Vec<LogOutput> = self
            .joiner
            .flush()
            .into_iter()
            .map(|j| self.output(j))
            .collect();
        out.extend(self.held_views_due(None));
        let scores = std::mem::take(&mut self.scored).lines as u64;
        if scores > 0 {
            out.push(LogOutput::CandidatesUnjoined(scores));
        }
        self.advise(&mut out);
        out
    }

    fn output(&mut self, mut j: JoinOutput) -> LogOutput {
        if let JoinOutput::Joined(d) = &mut j {
            let _ = self.routed.insert(&d.request_id);
            if d.trace.is_none() {
                d.trace = self.spans.get(&d.request_id);
            }
            d.tenant = self.tenants.get(&d.request_id);
        }
        from_join(j)
    }

    pub fn pending(&self) -> usize {
        self.joiner.pending()
    }

    /// The timestamp of the latest line that carried one.
    pub(crate) fn last_ts_ns(&self) -> Option<u64> {
        self.last_ts_ns
    }
}

fn from_join(j: JoinOutput) -> LogOutput {
    match j {
        JoinOutput::Joined(d) => LogOutput::Decision(*d),
        JoinOutput::Unjoined { request_id, half } => LogOutput::Unjoined { request_id, half },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::MigrationLogKind;

    const SEC: u64 = 1_000_000_000;

    fn input_line(t: &str, id: &str) -> String {
        format!(
            r#"2026-11-29T07:50:{t}Z DEBUG dynamo_kv_router::services::selection::core::run: [ROUTING_INPUT] request local hashes request_id="{id}" isl_tokens=41 block_size=16 num_blocks=2 local_hashes=[1, 2]"#
        )
    }

    fn selected_line(t: &str, id: &str, worker: u64) -> String {
        format!(
            r#"2026-11-29T07:50:{t}Z  INFO dynamo_kv_router::scheduling::selector: Selected worker router_mode="kv" request_id="{id}" worker_id={worker} worker_type=decode dp_rank=0 logit=1.5"#
        )
    }

    /// Dynamo 1.4.1's lines for one request at INFO with its request trace on (from a
    /// lab run): the choice, the push router's second line naming it, and a trace record
    /// that names no worker.
    const SELECTED_1_4: &str = r#"2026-12-06T00:34:43.359134Z  INFO dynamo_kv_router::scheduling::selector: Selected worker router_mode="kv" request_id="21436302-dc60-4063-ad53-3a9acbef8ebc" worker_id=9459974957482215462 worker_type=decode dp_rank=0 logit=44.6875 host_pinned_blocks=0 disk_blocks=0"#;
    const DIRECT_1_4: &str = r#"2026-12-06T00:34:43.359279Z  INFO http-request:kv_router.route_request: dynamo_runtime::pipeline::network::egress::push_router: Selected worker router_mode="direct" worker_id=9459974957482215462 method=POST uri=/v1/chat/completions version=HTTP/1.1 x_request_id="kvs1-f0-s0-t0" request_id=4bb53919-bbf8-41e9-a808-bfbb9654a214 model="kvscope-tiny" request_id=21436302-dc60-4063-ad53-3a9acbef8ebc worker_id=9459974957482215462 dp_rank=0 overlap_blocks=0 phase=Aggregated"#;
    const TRACE_1_4: &str = r#"{"schema":"dynamo.request.trace.v1","event_type":"request_end","event_time_unix_ms":1796517283656,"request":{"request_id":"21436302-dc60-4063-ad53-3a9acbef8ebc","output_tokens":48,"request_received_ms":1796517283358,"replay":{"trace_block_size":16,"input_length":363,"input_sequence_hashes":[10727121658098691967,15275267342297074326,7375352336032406556,17560640216513767913,15073706878928611288,8252991589065432562,14953605036702321363,12164931848139966153,12071722925418535950,17772797552201021476,1436747025742223031,17503885107798822372,12240456092014238377,4793530057045324508,7108234055237421221,4042922544960204802,6762894876225801776,11619616664344318741,9556359332630750635,13305982363416624172,12372964440359219063,7738972847060308784,9279606034765418375]}}}"#;

    #[test]
    fn a_trace_record_naming_no_worker_takes_the_one_its_choice_named() {
        for source in [DecisionSource::Auto, DecisionSource::RequestTrace] {
            let mut p = RouterLogProcessor::with_source(30 * SEC, 1000, source);
            let mut out = p.line(SELECTED_1_4, 0);
            out.extend(p.line(DIRECT_1_4, 0));
            out.extend(p.line(TRACE_1_4, 0));
            out.extend(p.finish());
            let decisions: Vec<&RoutingDecision> = out
                .iter()
                .filter_map(|o| match o {
                    LogOutput::TracedDecision { decision, .. } => Some(decision),
                    _ => None,
                })
                .collect();
            assert_eq!(decisions.len(), 1, "{source:?}: {out:?}");
            let d = decisions[0];
            assert_eq!(d.request_id, "21436302-dc60-4063-ad53-3a9acbef8ebc");
            assert_eq!(d.worker.worker_id, 9459974957482215462);
            assert_eq!(d.sequence_hashes.as_ref().map(Vec::len), Some(363 / 16));
            let end = out.iter().find_map(|o| match o {
                LogOutput::RequestEnd(e) => Some(e),
                _ => None,
            });
            assert_eq!(end.map(|e| e.worker.worker_id), Some(9459974957482215462));
            // Decided: the choice is not left waiting for a routing input.
            assert!(
                !out.iter().any(|o| matches!(o, LogOutput::Unjoined { .. })),
                "{source:?}: {out:?}"
            );
        }
        // A record no choice named is malformed, said so, and nothing is made of it.
        let mut p = RouterLogProcessor::new(30 * SEC, 1000);
        let out = p.line(TRACE_1_4, 0);
        assert!(
            matches!(&out[..], [LogOutput::Malformed(m)] if m.reason.contains("no worker")),
            "{out:?}"
        );
    }

    #[test]
    fn a_router_logging_only_its_choices_is_told_once_what_to_set() {
        let count = |out: &[LogOutput]| {
            out.iter()
                .filter(|o| matches!(o, LogOutput::RoutingInputMissing))
                .count()
        };
        // Choices alone (INFO, no request trace): said once, however many go unjoined.
        let mut p = RouterLogProcessor::new(5 * SEC, 1000);
        let mut out = Vec::new();
        for (t, id) in [("01", "a"), ("02", "b"), ("09", "c"), ("20", "d")] {
            out.extend(p.line(&selected_line(t, id, 7), 0));
        }
        out.extend(p.finish());
        assert_eq!(count(&out), 1, "{out:?}");
        // Told while the router is busy, before any choice has timed out in log time.
        let mut p = RouterLogProcessor::new(5 * SEC, 1000);
        let mut out = Vec::new();
        for i in 0..ADVISE_AFTER_SELECTIONS {
            assert_eq!(count(&out), 0, "{out:?}");
            out.extend(p.line(&selected_line("01", &format!("r{i}"), 7), 0));
        }
        assert_eq!(count(&out), 1, "{out:?}");
        // A log with routing inputs, even one that lost a few, needs nothing.
        let mut p = RouterLogProcessor::new(5 * SEC, 1000);
        let mut out = p.line(&input_line("01", "a"), 0);
        out.extend(p.line(&selected_line("01", "a", 7), 0));
        out.extend(p.line(&selected_line("02", "b", 7), 0));
        out.extend(p.finish());
        assert_eq!(count(&out), 0, "{out:?}");
        assert!(out.contains(&LogOutput::Unjoined {
            request_id: "b".into(),
            half: Half::SelectionOnly
        }));
    }

    #[test]
    fn a_line_dated_an_hour_ahead_or_a_clock_stepped_back_stops_no_join() {
        // The agent's clock reads 07:50:30.
        let wall = crate::taps::router::parse::parse_rfc3339_ns("2026-11-29T07:50:30Z").unwrap();
        let mut p = RouterLogProcessor::new(30 * SEC, 1000);
        let mut out = Vec::new();
        let future =
            r#"2026-11-29T08:50:00Z  INFO dynamo_llm::http: request received request_id=x"#;
        out.extend(p.line(future, wall));
        assert!(matches!(out[..], [LogOutput::FutureLine { .. }]), "{out:?}");
        // The following decisions join as if that line had not been there.
        out.clear();
        for (t, id) in [("01", "a"), ("02", "b")] {
            out.extend(p.line(&input_line(t, id), wall));
            out.extend(p.line(&selected_line(t, id, 7), wall));
        }
        assert_eq!(out, vec![decision("a", 7), decision("b", 7)]);
        // A clock stepped back an hour: halves still wait their timeout, and join.
        out.clear();
        let back = |l: String| l.replace("07:50:", "06:50:");
        out.extend(p.line(&back(input_line("03", "c")), wall));
        out.extend(p.line(&input_line("04", "d"), wall));
        out.extend(p.line(&back(selected_line("05", "c", 8)), wall));
        out.extend(p.line(&selected_line("06", "d", 8), wall));
        assert_eq!(out, vec![decision("c", 8), decision("d", 8)]);
    }

    fn decision(id: &str, worker: u64) -> LogOutput {
        LogOutput::Decision(RoutingDecision {
            tenant: None,
            model: None,
            request_id: id.into(),
            worker: WorkerKey {
                worker_id: worker,
                dp_rank: 0,
            },
            isl_tokens: 41,
            block_size: 16,
            local_hashes: vec![1, 2],
            sequence_hashes: None,
            worker_type: Some("decode".into()),
            router_mode: Some("kv".into()),
            clock_behind_ms: None,
            selection: kvscope_wire::Selection {
                logit: Some(1.5),
                pinned: false,
                lower_tiers: None,
            },
            trace: None,
        })
    }

    #[test]
    fn joins_by_request_id_in_either_order_and_interleaved() {
        let mut p = RouterLogProcessor::new(30 * SEC, 1000);
        assert_eq!(p.line(&input_line("01.0", "a"), 0), vec![]);
        assert_eq!(p.line(&input_line("01.1", "b"), 0), vec![]);
        assert_eq!(
            p.line(&selected_line("01.2", "b", 7), 0),
            vec![decision("b", 7)]
        );
        assert_eq!(p.line(&selected_line("01.3", "c", 8), 0), vec![]);
        assert_eq!(
            p.line(&selected_line("01.4", "a", 9), 0),
            vec![decision("a", 9)]
        );
        assert_eq!(p.line(&input_line("01.5", "c"), 0), vec![decision("c", 8)]);
        assert_eq!(p.pending(), 0);
        assert_eq!(p.finish(), vec![]);
    }

    #[test]
    fn halves_alone_past_the_timeout_are_unjoined_in_log_time() {
        let mut p = RouterLogProcessor::new(5 * SEC, 1000);
        assert_eq!(p.line(&input_line("00.0", "lost"), 0), vec![]);
        assert_eq!(p.line(&selected_line("01.0", "orphan", 3), 0), vec![]);
        // 5 s later is still within the timeout (the line has no decision content).
        assert_eq!(
            p.line("2026-11-29T07:50:05Z INFO other: request completed", 0),
            vec![]
        );
        assert_eq!(
            p.line("2026-11-29T07:50:05.5Z INFO other: something", 0),
            vec![LogOutput::Unjoined {
                request_id: "lost".into(),
                half: Half::InputOnly
            }]
        );
        // The selection waits until its own deadline, then goes too.
        assert_eq!(p.line(&input_line("06.0", "x"), 0), vec![]);
        assert_eq!(
            p.line(&input_line("06.1", "y"), 0),
            vec![LogOutput::Unjoined {
                request_id: "orphan".into(),
                half: Half::SelectionOnly
            }]
        );
        // A late selection for an expired input is itself a half.
        assert_eq!(p.line(&selected_line("06.2", "lost", 1), 0), vec![]);
        assert_eq!(
            p.line(&selected_line("06.3", "x", 1), 0),
            vec![decision("x", 1)]
        );
        let mut rest = p.finish();
        rest.sort_by_key(|o| format!("{o:?}"));
        assert_eq!(
            rest,
            vec![
                LogOutput::Unjoined {
                    request_id: "lost".into(),
                    half: Half::SelectionOnly
                },
                LogOutput::Unjoined {
                    request_id: "y".into(),
                    half: Half::InputOnly
                },
            ]
        );
    }

    #[test]
    fn a_repeated_half_gives_up_the_first() {
        let mut p = RouterLogProcessor::new(30 * SEC, 1000);
        assert_eq!(p.line(&input_line("01.0", "a"), 0), vec![]);
        assert_eq!(
            p.line(&input_line("02.0", "a"), 0),
            vec![LogOutput::Unjoined {
                request_id: "a".into(),
                half: Half::InputOnly
            }]
        );
        assert_eq!(
            p.line(&selected_line("03.0", "a", 2), 0),
            vec![decision("a", 2)]
        );
        // The first input's queue entry must not expire the joined request later.
        assert_eq!(p.line("2026-11-29T07:59:00Z INFO x: y", 0), vec![]);
    }

    #[test]
    fn the_pending_cap_gives_up_the_oldest() {
        let mut p = RouterLogProcessor::new(3600 * SEC, 2);
        p.line(&input_line("01.0", "a"), 0);
        p.line(&input_line("01.1", "b"), 0);
        assert_eq!(
            p.line(&input_line("01.2", "c"), 0),
            vec![LogOutput::Unjoined {
                request_id: "a".into(),
                half: Half::InputOnly
            }]
        );
        assert_eq!(p.pending(), 2);
    }

    #[test]
    fn lines_without_timestamps_use_the_last_one_or_the_fallback() {
        let mut p = RouterLogProcessor::new(5 * SEC, 1000);
        let bare = |id: &str| {
            format!(
                r#"[ROUTING_INPUT] request local hashes request_id="{id}" isl_tokens=41 block_size=16 local_hashes=[1, 2]"#
            )
        };
        assert_eq!(p.line(&bare("a"), 100 * SEC), vec![]);
        assert_eq!(
            p.line(&bare("b"), 106 * SEC),
            vec![LogOutput::Unjoined {
                request_id: "a".into(),
                half: Half::InputOnly
            }]
        );
    }

    #[test]
    fn garbage_and_migration_lines() {
        let mut p = RouterLogProcessor::new(5 * SEC, 1000);
        assert_eq!(p.line("\u{0}\u{1}binary junk", 0), vec![]);
        let out = p.line("2026-11-29T07:50:01Z DEBUG x: [ROUTING_INPUT] request local hashes request_id=\"a\" local_hashes=[1,", 0);
        assert!(matches!(&out[..], [LogOutput::Malformed(_)]), "{out:?}");
        let out = p.line(
            "2026-11-29T07:50:01Z INFO x: KVMIGRATE: producer handshake obtained request_id=\"a\"",
            0,
        );
        assert!(matches!(
            &out[..],
            [LogOutput::Migration(MigrationLogLine {
                kind: MigrationLogKind::HandshakeObtained,
                ..
            })]
        ));
    }

    /// Dynamo 1.5 logs its view of a choice twice, as it chooses (DEBUG) and when the
    /// route ends: one view is sent.
    #[test]
    fn a_view_logged_twice_is_sent_once() {
        let best = r#"2026-12-06T05:59:12.247404Z DEBUG http-request:kv_router.select_worker: dynamo_llm::kv_router::push_router::selection: [ROUTING] Best: worker_7 dp_rank=0 with 2/3 blocks overlap request_id=r-1 worker_id=7 dp_rank=0 overlap_blocks=2 total_blocks=3"#;
        let done = r#"2026-12-06T05:59:12.300000Z  INFO http-request:kv_router.route_request: request_span: route request completed request.outcome="success" request_id=h-1 otel.kind="client" request_id=r-1 dp_rank=0 overlap_blocks=2 phase=Aggregated worker_id=7"#;
        let mut p = RouterLogProcessor::new(30 * SEC, 100);
        let views: Vec<_> = [best, done]
            .iter()
            .flat_map(|l| p.line(l, 0))
            .filter_map(|o| match o {
                LogOutput::RouterView(v) => Some(v),
                _ => None,
            })
            .collect();
        assert_eq!(views.len(), 1, "{views:?}");
        assert_eq!(
            (views[0].request_id.as_str(), views[0].overlap_blocks),
            ("r-1", 2)
        );
    }

    /// A view written as the router chose, with no line after it (the router went
    /// idle): sent once this host's clock shows its hold passed, not before.
    #[test]
    fn a_held_view_goes_when_the_router_is_idle() {
        let best = r#"2026-12-06T05:59:12.247404Z DEBUG http-request:kv_router.select_worker: dynamo_llm::kv_router::push_router::selection: [ROUTING] Best: worker_7 dp_rank=0 with 2/3 blocks overlap request_id=r-1 worker_id=7 dp_rank=0 overlap_blocks=2 total_blocks=3"#;
        let read_at = 1_797_000_000 * SEC;
        let mut p = RouterLogProcessor::new(30 * SEC, 100);
        assert!(p.line(best, read_at).is_empty());
        assert!(p.idle(read_at + SEC / 2).is_empty(), "held its time");
        let out = p.idle(read_at + 2 * SEC);
        assert!(
            matches!(&out[..], [LogOutput::RouterView(v)] if v.request_id == "r-1"),
            "{out:?}"
        );
        assert!(p.finish().is_empty(), "sent once");
    }

    fn read_capture(name: &str) -> String {
        std::fs::read_to_string(format!(
            "{}/../lab/fixtures/samples/{name}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap()
    }

    /// A captured router log's decisions (counted) and views, to its end; any other
    /// output but an unjoined half fails the test.
    fn views_of_capture(name: &str) -> (usize, Vec<kvscope_wire::RouterView>) {
        let mut p = RouterLogProcessor::new(30 * SEC, 10_000);
        let text = read_capture(name);
        let mut outputs: Vec<LogOutput> = text.lines().flat_map(|l| p.line(l, 0)).collect();
        // What the log holds at its end comes out then.
        outputs.extend(p.finish());
        let (mut decisions, mut views) = (0, Vec::new());
        for o in outputs {
            match o {
                LogOutput::RouterView(v) => views.push(v),
                LogOutput::Decision(_) => decisions += 1,
                LogOutput::Unjoined { .. } => {}
                other => panic!("{name}: {other:?}"),
            }
        }
        (decisions, views)
    }

    /// A real Dynamo 1.4.1 router log at `dynamo_kv_router::scheduling::selector=debug`:
    /// every view carries what the router credited each of the three workers with, its
    /// own worker's credit equal to the overlap it logged; no score line is left over.
    #[test]
    fn score_lines_go_with_their_view() {
        let (decisions, views) = views_of_capture("router_log_1_4_1_scores.log");
        assert_eq!(views.len(), 16);
        assert_eq!(decisions, 16);
        for v in &views {
            assert_eq!(v.candidates.len(), 3, "{v:?}");
            let own = v.candidates.iter().find(|c| c.worker == v.worker).unwrap();
            assert_eq!(own.credited_blocks, f64::from(v.overlap_blocks), "{v:?}");
        }
        assert!(views
            .iter()
            .any(|v| v.candidates.iter().any(|c| c.credited_blocks > 0.0)));
    }

    /// A disaggregated request on Dynamo 1.4.1 (one prefill worker, two decode workers):
    /// scored, chosen and viewed in the prefill pool, then again in the decode pool under
    /// the same id. The view sent is the first leg's, with the prefill pool's scores; the
    /// second leg's lines are neither sent nor counted as unjoined.
    #[test]
    fn a_disaggregated_requests_view_carries_its_first_legs_scores() {
        let (_, views) = views_of_capture("router_log_1_4_1_disagg_scores.log");
        assert_eq!(views.len(), 4, "one view per request");
        for v in &views {
            assert_eq!(v.candidates.len(), 1, "{v:?}");
            assert_eq!(v.candidates[0].worker, v.worker);
        }
    }

    /// A real Dynamo 1.6.1 disaggregated log at `dynamo_llm=debug` (2 prefill, 2 decode
    /// mockers): the prefill router's passed-over lines come before or after the
    /// `[ROUTING] Best` view it writes as it chooses, always before the route's end. The
    /// views are read at the routes' ends, so each passed-over request's view carries
    /// the chosen worker's credit (its overlap) and the worker it passed over, credited
    /// with more; the other requests' carry none; nothing is lost.
    #[test]
    fn a_passed_over_worker_goes_with_its_view_whichever_line_comes_first() {
        let name = "router_log_1_6_1_disagg_passed_over.log";
        let passed_over = read_capture(name)
            .lines()
            .filter(|l| l.contains("lower KV cache overlap"))
            .count();
        let (_, views) = views_of_capture(name);
        assert_eq!(views.len(), 6, "one view per request");
        let with: Vec<_> = views.iter().filter(|v| !v.candidates.is_empty()).collect();
        assert_eq!(with.len(), passed_over, "{views:?}");
        for v in with {
            assert_eq!(v.phase.as_deref(), Some("Prefill"), "{v:?}");
            let [chosen, best] = &v.candidates[..] else {
                panic!("{v:?}");
            };
            assert_eq!(chosen.worker, v.worker);
            assert_eq!(chosen.credited_blocks, f64::from(v.overlap_blocks));
            assert!(best.credited_blocks > chosen.credited_blocks, "{v:?}");
        }
    }

    /// A passed-over line that comes later than its request's view went (past the
    /// second a view written as the router chose waits) is lost, and counted.
    #[test]
    fn a_passed_over_line_after_its_view_is_counted() {
        let lines = [
            r#"2026-12-07T12:34:28.494054Z DEBUG http-request:kv_router.select_worker: dynamo_llm::kv_router::routing_host::kv_selection: [ROUTING] Best: worker_11840306891121132110 dp_rank=0 with 0/23 blocks overlap request_id=0db12805 worker_id=11840306891121132110 dp_rank=0 overlap_blocks=0 total_blocks=23"#,
            "2026-12-07T12:34:30Z  INFO other: a line two seconds on",
            r#"2026-12-07T12:34:30.1Z DEBUG dynamo_llm::kv_router::embedded: Router selected a worker with lower KV cache overlap request_id="0db12805" worker_type="prefill" selected_worker_id=11840306891121132110 selected_dp_rank=0 selected_overlap_blocks=0.0 highest_overlap_worker_id=11396365133843937557 highest_overlap_dp_rank=0 highest_overlap_blocks=20.0 overlap_blocks_lost=20.0"#,
        ];
        let mut p = RouterLogProcessor::new(30 * SEC, 10_000);
        let (mut views, mut lost) = (0, 0);
        for line in lines {
            for o in p.line(line, 0) {
                match o {
                    LogOutput::RouterView(v) => {
                        assert!(v.candidates.is_empty());
                        views += 1
                    }
                    LogOutput::CandidatesUnjoined(n) => lost += n,
                    _ => {}
                }
            }
        }
        assert_eq!((views, lost), (1, 2));
    }

    /// A view written as the router chose waits a second of log time for the lines of
    /// other tasks about its choice, then goes; its route's end, where it comes first,
    /// goes in its place; held views go at the log's end.
    #[test]
    fn a_view_as_chosen_waits_a_second() {
        let best = |t: &str, id: &str| {
            format!(
                r#"2026-12-07T09:30:{t}Z DEBUG dynamo_llm::kv_router::push_router::selection: [ROUTING] Best: worker_1 dp_rank=0 with 2/3 blocks overlap request_id={id} worker_id=1 dp_rank=0 overlap_blocks=2 total_blocks=3"#
            )
        };
        let end = |t: &str, id: &str| {
            format!(
                r#"2026-12-07T09:30:{t}Z  INFO http-request:kv_router.route_request: request_span: route request completed request.outcome="success" request_id={id} dp_rank=0 overlap_blocks=1 phase=Aggregated worker_id=1"#
            )
        };
        let views = |p: &mut RouterLogProcessor, lines: &[String]| -> Vec<(String, u32)> {
            lines
                .iter()
                .flat_map(|l| p.line(l, 0))
                .filter_map(|o| match o {
                    LogOutput::RouterView(v) => Some((v.request_id, v.overlap_blocks)),
                    _ => None,
                })
                .collect()
        };
        let named = |v: &[(&str, u32)]| -> Vec<(String, u32)> {
            v.iter().map(|(i, n)| (i.to_string(), *n)).collect()
        };
        let mut p = RouterLogProcessor::new(30 * SEC, 100);
        assert_eq!(views(&mut p, &[best("00.0", "a"), best("00.5", "b")]), []);
        // a's route ends first: its end's view; b's held one goes a second on.
        assert_eq!(
            views(&mut p, &[end("00.7", "a"), best("01.2", "c")]),
            named(&[("a", 1)])
        );
        assert_eq!(views(&mut p, &[best("01.6", "d")]), named(&[("b", 2)]));
        // Those whose route's end came are not sent twice.
        assert_eq!(views(&mut p, &[end("01.7", "c")]), named(&[("c", 1)]));
        let rest: Vec<_> = p
            .finish()
            .into_iter()
            .filter_map(|o| match o {
                LogOutput::RouterView(v) => Some((v.request_id, v.overlap_blocks)),
                _ => None,
            })
            .collect();
        assert_eq!(rest, named(&[("d", 2)]));
    }

    /// Score lines held stay within their bounds, however many come without views:
    /// every line is either held or counted given up.
    #[test]
    fn score_lines_held_are_bounded() {
        let mut s = Scored::default();
        let line = |id: u64, w: u64| Candidate {
            request_id: format!("r-{id}"),
            worker_type: None,
            candidate: RouterCandidate {
                worker: WorkerKey {
                    worker_id: w,
                    dp_rank: 0,
                },
                credited_blocks: 1.0,
            },
        };
        let mut given_up = 0;
        // 300 workers scored per request, 1,000 requests: past the line bound.
        for id in 0..1_000 {
            for w in 0..300 {
                given_up += s.note(line(id, w));
            }
        }
        assert!(s.lines <= Scored::CAP_LINES, "{}", s.lines);
        assert_eq!(s.lines, s.map.values().map(Vec::len).sum::<usize>());
        assert_eq!(given_up + s.lines as u64, 300_000);
        // One request scoring more workers than the bound holds keeps the bound.
        let mut s = Scored::default();
        let given_up: u64 = (0..70_000).map(|w| s.note(line(0, w))).sum();
        assert_eq!((s.lines, given_up), (Scored::CAP_LINES, 70_000 - 65_536));
    }

    /// Score lines whose view never comes, or names a worker they did not score, are
    /// given up and counted; a view without score lines has no candidates.
    #[test]
    fn score_lines_without_their_view_are_counted() {
        let scored_in = |id: &str, worker: u64, pool: &str| {
            format!(
                r#"2026-12-07T09:30:16Z DEBUG dynamo_kv_router::scheduling::selector: Formula for worker_id={worker} dp_rank=0 with 2.00 effective cached blocks: 1.0 = 1.0 request_id="{id}" worker_type="{pool}""#
            )
        };
        let score = |id: &str, worker: u64| scored_in(id, worker, "decode");
        let best = |id: &str, worker: u64| {
            format!(
                r#"2026-12-07T09:30:16Z DEBUG dynamo_llm::kv_router::push_router::selection: [ROUTING] Best: worker_{worker} dp_rank=0 with 2/3 blocks overlap request_id={id} worker_id={worker} dp_rank=0 overlap_blocks=2 total_blocks=3"#
            )
        };
        let mut p = RouterLogProcessor::new(30 * SEC, 100);
        let mut out = Vec::new();
        // a: scored, its view names another worker; b: a view alone; c: scores alone;
        // d: a first leg's scores and view, then its second leg's (not sent, not counted).
        for l in [
            score("a", 1),
            score("a", 2),
            best("a", 3),
            best("b", 1),
            score("c", 1),
            scored_in("d", 1, "prefill"),
            best("d", 1),
            score("d", 2),
            best("d", 2),
        ] {
            out.extend(p.line(&l, 0));
        }
        out.extend(p.finish());
        let given_up: u64 = out
            .iter()
            .filter_map(|o| match o {
                LogOutput::CandidatesUnjoined(n) => Some(*n),
                _ => None,
            })
            .sum();
        assert_eq!(given_up, 3, "{out:?}");
        let views: Vec<_> = out
            .iter()
            .filter_map(|o| match o {
                LogOutput::RouterView(v) => Some(v),
                _ => None,
            })
            .collect();
        assert_eq!(views.len(), 3);
        assert!(views[..2].iter().all(|v| v.candidates.is_empty()));
        assert_eq!(views[2].candidates.len(), 1);
    }

    /// Told which field names a request's tenant, the decision carries the part the
    /// pattern picks from the request's arrival line (text or JSON); a line without it,
    /// or whose value does not match, names none and is counted.
    #[test]
    fn a_decision_takes_its_tenant_from_the_field_it_was_told() {
        let arrival = |id: &str, x: &str| {
            format!(
                r#"2026-12-07T09:48:34.271917Z  INFO http-request: dynamo_llm::http::service::metrics: request received request_id={id} model=m endpoint=chat_completions method=POST uri=/v1/chat/completions version=HTTP/1.1 x_request_id="{x}" request_id=h-{id}"#
            )
        };
        let input = |id: &str| {
            format!(
                r#"2026-12-07T09:48:34.3Z DEBUG r: [ROUTING_INPUT] request local hashes request_id="{id}" isl_tokens=32 block_size=16 num_blocks=2 local_hashes=[1, 2]"#
            )
        };
        let selected = |id: &str| {
            format!(
                r#"2026-12-07T09:48:34.3Z  INFO r: Selected worker router_mode="kv" request_id="{id}" worker_id=5 worker_type=decode dp_rank=0"#
            )
        };
        let json_arrival = r#"{"time":"2026-12-07T09:48:34.4Z","level":"INFO","target":"dynamo_llm::http::service::metrics","message":"request received","request_id":"d","model":"m","x_request_id":"acme-7"}"#;
        let mut p = RouterLogProcessor::new(30 * SEC, 100).with_tenant_field(Some(TenantField {
            field: "x_request_id".into(),
            pattern: Some(regex::Regex::new("^([a-z]+)-[0-9]+$").unwrap()),
        }));
        let mut lines = Vec::new();
        for (id, x) in [("a", "acme-1"), ("b", "globex-2"), ("c", "no tenant here")] {
            lines.extend([arrival(id, x), input(id), selected(id)]);
        }
        lines.extend([json_arrival.to_string(), input("d"), selected("d")]);
        lines.extend([input("e"), selected("e")]);
        let out: Vec<LogOutput> = lines.iter().flat_map(|l| p.line(l, 0)).collect();
        let tenants: Vec<(String, Option<String>)> = out
            .iter()
            .filter_map(|o| match o {
                LogOutput::Decision(d) => Some((d.request_id.clone(), d.tenant.clone())),
                _ => None,
            })
            .collect();
        let want = [
            ("a", Some("acme")),
            ("b", Some("globex")),
            ("c", None),
            ("d", Some("acme")),
            ("e", None),
        ]
        .map(|(id, t)| (id.to_string(), t.map(str::to_string)));
        assert_eq!(tenants, want);
        let unread = out
            .iter()
            .filter(|o| **o == LogOutput::TenantUnread)
            .count();
        assert_eq!(
            unread, 1,
            "c's arrival line named none; e had no arrival line"
        );
        // A line that named no tenant still names the request's model.
        assert!(out.iter().any(|o| matches!(o,
            LogOutput::Decision(d) if d.request_id == "c" && d.model.as_deref() == Some("m"))));
        // Without a field to read, no decision names a tenant.
        let mut p = RouterLogProcessor::new(30 * SEC, 100);
        let out: Vec<LogOutput> = lines.iter().flat_map(|l| p.line(l, 0)).collect();
        assert!(out.iter().all(|o| match o {
            LogOutput::Decision(d) => d.tenant.is_none(),
            o => *o != LogOutput::TenantUnread,
        }));
    }

    /// A `/v1/completions` request (Dynamo 1.6.1, as its router logged it): its routing
    /// line names no model, its arrival line does, and the decision carries it.
    #[test]
    fn a_completions_decision_takes_its_model_from_the_arrival_line() {
        let lines = [
            r#"2026-12-07T09:48:34.271917Z  INFO http-request:completions:completions_single: dynamo_llm::http::service::metrics: request received request_id=dd6412b8-5b30-4945-a896-7e695701456e model=kvscope-tiny endpoint=completions request_type=unary method=POST uri=/v1/completions version=HTTP/1.1 x_request_id="kvs1-f0-s0-t0" request_id=c09fc6d0-7057-40bc-92d9-47ceb5d07453"#,
            r#"2026-12-07T09:48:34.272696Z DEBUG http-request:completions:completions_single:kv_router.select_worker: dynamo_kv_router::services::selection::core::run: [ROUTING_INPUT] request local hashes request_id="dd6412b8-5b30-4945-a896-7e695701456e" isl_tokens=363 block_size=16 num_blocks=22 local_hashes=[10727121658098691967, 10060893319996048412, 1315618679366844118, 6059141941202179221, 6640369694136407544, 16775136687545088301, 16691156668715235362, 6061652779405888081, 16835456371756827759, 439184397688277037, 6323260952704293153, 8004874949799055233, 7948110736437753711, 13787794629018888402, 5815191518440233677, 14273424717306483592, 7369272689864542765, 12840954977886852384, 10561530869724339103, 16451162339363919287, 7271169924214517285, 16447221900264701573] method=POST uri=/v1/completions version=HTTP/1.1 x_request_id="kvs1-f0-s0-t0" request_id=c09fc6d0-7057-40bc-92d9-47ceb5d07453"#,
            r#"2026-12-07T09:48:34.272811Z  INFO dynamo_kv_router::scheduling::selector: Selected worker router_mode="kv" request_id="dd6412b8-5b30-4945-a896-7e695701456e" worker_id=17597927887417138432 worker_type=decode dp_rank=0 logit=44.6875 host_pinned_blocks=0 disk_blocks=0"#,
        ];
        assert!(!lines[1].contains(" model="));
        let decide = |lines: &[&str]| {
            let mut p = RouterLogProcessor::new(30 * SEC, 100);
            lines
                .iter()
                .flat_map(|l| p.line(l, 0))
                .find_map(|o| match o {
                    LogOutput::Decision(d) => Some(d),
                    _ => None,
                })
                .unwrap()
        };
        assert_eq!(decide(&lines).model.as_deref(), Some("kvscope-tiny"));
        // Without the arrival line: none, not a guess.
        assert_eq!(decide(&lines[1..]).model, None);
    }

    /// Every decision in the captured lab logs joins; plain and coloured agree.
    #[test]
    fn captured_router_logs_join_completely() {
        let mut all = Vec::new();
        for name in ["router_log_plain.log", "router_log_ansi.log"] {
            let text = std::fs::read_to_string(format!(
                "{}/../lab/fixtures/samples/{name}",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap();
            let mut p = RouterLogProcessor::new(30 * SEC, 10_000);
            let (mut decisions, mut views) = (Vec::new(), 0);
            for line in text.lines() {
                for o in p.line(line, 0) {
                    match o {
                        LogOutput::Decision(d) => decisions.push(d),
                        LogOutput::RouterView(_) => views += 1,
                        // The capture is an excerpt: a decision cut at its start or end
                        // can only be at the edges.
                        LogOutput::Unjoined { .. } => {}
                        other => panic!("{name}: {other:?}"),
                    }
                }
            }
            let leftover = p.finish();
            assert!(leftover.len() <= 2, "{name}: {leftover:?}");
            assert!(!decisions.is_empty());
            assert!(views > 0, "{name}: the routes' closing lines are views");
            for d in &decisions {
                assert_eq!(
                    d.local_hashes.len() as u64,
                    d.isl_tokens / u64::from(d.block_size)
                );
            }
            all.push(decisions);
        }
        eprintln!("plain {} coloured {}", all[0].len(), all[1].len());
    }
}

#[cfg(test)]
mod captured_jsonl {
    use super::*;

    /// A real Dynamo 1.6.1 frontend's JSON-lines log (`DYN_LOGGING_JSONL=1`, router at
    /// debug) and the replica-sync `AddRequest` events the same frontend published for
    /// the same requests: every decision read from the log names the worker the event
    /// names, and its local hashes chain to exactly the sequence hashes the event carries.
    #[test]
    fn jsonl_decisions_match_the_routers_own_replica_sync_events() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../lab/fixtures/samples/");
        let log = std::fs::read_to_string(format!("{dir}router_log_jsonl.log")).unwrap();
        let events: serde_json::Value = serde_json::from_slice(
            &std::fs::read(format!("{dir}router_replica_sync_adds.json")).unwrap(),
        )
        .unwrap();
        let mut p = RouterLogProcessor::new(30 * 1_000_000_000, 1000);
        let (mut decisions, mut views) = (Vec::new(), Vec::new());
        for line in log.lines() {
            for out in p.line(line, 0) {
                match out {
                    LogOutput::Decision(d) => decisions.push(d),
                    LogOutput::RouterView(v) => views.push(v),
                    LogOutput::Malformed(e) => panic!("{e}: {line}"),
                    _ => {}
                }
            }
        }
        let adds = events["add_requests"].as_array().unwrap();
        assert_eq!(decisions.len(), 9);
        // Each route's closing line is the view of its decision: same id, same worker.
        assert_eq!(views.len(), 9);
        for v in &views {
            assert!(
                decisions
                    .iter()
                    .any(|d| d.request_id == v.request_id && d.worker == v.worker),
                "{v:?}"
            );
        }
        assert_eq!(adds.len(), 9);
        for a in adds {
            let id = a["request_id"].as_str().unwrap();
            let d = decisions
                .iter()
                .find(|d| d.request_id == id)
                .unwrap_or_else(|| panic!("no decision for {id}"));
            assert_eq!(
                d.worker.worker_id,
                a["worker"]["worker_id"].as_u64().unwrap(),
                "{id}"
            );
            let seq: Vec<u64> = a["token_sequence"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_u64().unwrap())
                .collect();
            assert_eq!(kvscope_wire::sequence_hashes(&d.local_hashes), seq, "{id}");
            assert_eq!(d.block_size, 16);
        }
    }

    /// The trace context of each request in the captured JSON log: its decision is in
    /// the trace its routing line names, under the router's `kv_router.select_worker`
    /// span; without routing lines (INFO), decisions from the request trace are under
    /// the frontend's `http-request` span of the same trace.
    #[test]
    fn jsonl_decisions_carry_the_routers_trace_context() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../lab/fixtures/samples/");
        let log =
            std::fs::read_to_string(format!("{dir}router_log_jsonl_debug_with_trace.log")).unwrap();
        let trace = std::fs::read_to_string(format!("{dir}request_trace.jsonl")).unwrap();
        // What each line says of itself: request id, span name → (trace id, span id).
        let mut spans: HashMap<(String, String), TraceContext> = HashMap::new();
        for line in log.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
            if let Some(t) = TraceContext::parse(&s("trace_id"), &s("span_id")) {
                spans.insert((s("request_id"), s("span_name")), t);
            }
        }
        let decide = |source: DecisionSource, text: &str| -> Vec<RoutingDecision> {
            super::captured_trace::decide(source, text)
                .into_iter()
                .map(|(d, _)| d)
                .collect()
        };
        let routed = decide(DecisionSource::RoutingInput, &log);
        assert_eq!(routed.len(), 9);
        for d in &routed {
            let want = &spans[&(d.request_id.clone(), "kv_router.select_worker".into())];
            assert_eq!(d.trace.as_ref(), Some(want), "{}", d.request_id);
        }
        let info: String = log
            .lines()
            .filter(|l| !l.contains("ROUTING_INPUT"))
            .chain(trace.lines())
            .map(|l| format!("{l}\n"))
            .collect();
        let traced = decide(DecisionSource::Auto, &info);
        assert_eq!(traced.len(), 9);
        for d in &traced {
            let want = &spans[&(d.request_id.clone(), "http-request".into())];
            assert_eq!(d.trace.as_ref(), Some(want), "{}", d.request_id);
            let routed = routed
                .iter()
                .find(|r| r.request_id == d.request_id)
                .unwrap();
            assert_eq!(
                routed.trace.as_ref().map(|t| &t.trace_id),
                Some(&want.trace_id),
                "one trace per request"
            );
        }
    }
}

#[cfg(test)]
mod captured_trace {
    use super::*;

    /// The decisions `source` takes from `text`, with the arrival time of those from the
    /// request trace; a malformed line fails the test.
    pub(super) fn decide(
        source: DecisionSource,
        text: &str,
    ) -> Vec<(RoutingDecision, Option<u64>)> {
        let mut p = RouterLogProcessor::with_source(30 * 1_000_000_000, 1000, source);
        let mut out = Vec::new();
        for line in text.lines() {
            for o in p.line(line, 0) {
                match o {
                    LogOutput::Decision(d) => out.push((d, None)),
                    LogOutput::TracedDecision { decision, at_ns } => {
                        out.push((decision, Some(at_ns)))
                    }
                    LogOutput::Malformed(e) => panic!("{e}: {line}"),
                    _ => {}
                }
            }
        }
        out
    }

    fn read(name: &str) -> String {
        std::fs::read_to_string(format!(
            "{}/../lab/fixtures/samples/{name}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap()
    }

    /// One Dynamo 1.6.1 run (3 mockers, 9 requests) logged both ways: the router's DEBUG
    /// routing lines (JSON lines) and the request trace's file sink. Decisions from the
    /// trace alone name the same workers, and their sequence hashes are the routing
    /// lines' local hashes chained; with both in one log (`auto`), each request is one
    /// decision.
    #[test]
    fn request_trace_decisions_equal_the_routing_lines() {
        let debug = read("router_log_jsonl_debug_with_trace.log");
        let trace = read("request_trace.jsonl");
        let routed = decide(DecisionSource::RoutingInput, &debug);
        let traced = decide(DecisionSource::RequestTrace, &trace);
        assert_eq!((routed.len(), traced.len()), (9, 9));
        for (d, _) in &routed {
            let (t, at) = traced
                .iter()
                .find(|(t, _)| t.request_id == d.request_id)
                .unwrap_or_else(|| panic!("{} not traced", d.request_id));
            assert_eq!(t.worker, d.worker);
            assert_eq!((t.isl_tokens, t.block_size), (d.isl_tokens, d.block_size));
            assert_eq!(
                t.sequence_hashes.as_deref(),
                Some(&kvscope_wire::sequence_hashes(&d.local_hashes)[..])
            );
            assert!(at.is_some_and(|ns| ns > 1_796_000_000_000_000_000));
            t.check_prompt_blocks().unwrap();
        }
        // Both kinds of lines in one input: one decision per request, from the routing lines.
        let both = decide(DecisionSource::Auto, &format!("{debug}\n{trace}"));
        assert_eq!(both.len(), 9);
        assert!(both.iter().all(|(_, at)| at.is_none()));
        assert!(decide(DecisionSource::RoutingInput, &trace).is_empty());
    }
}
