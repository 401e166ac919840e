//! Events of the router log follower.

use super::{InternalEvent, LogLimiter};
use crate::counters::{add, AgentStats};
use kvscope_wire::MigrationLogKind;
use tracing::{debug, info, warn};

/// One line read from the router's log.
pub(crate) struct LogLineRead;

impl InternalEvent<AgentStats> for LogLineRead {
    fn emit(self, stats: &AgentStats) {
        add(&stats.log_lines, 1);
    }
}

/// A line that looked like a decision or migration line but did not parse.
pub(crate) struct LogLineMalformed<'a> {
    pub kind: &'a str,
    pub reason: &'a str,
}

static MALFORMED_LINE: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for LogLineMalformed<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = MALFORMED_LINE.check() {
            warn!(kind = %self.kind, reason = %self.reason, suppressed, "Malformed router log line; skipped.");
        }
        add(&stats.log_malformed_lines, 1);
    }
}

pub(crate) struct DecisionJoined<'a> {
    pub request_id: &'a str,
}

impl InternalEvent<AgentStats> for DecisionJoined<'_> {
    fn emit(self, stats: &AgentStats) {
        debug!(request_id = %self.request_id, "Routing decision joined.");
        add(&stats.decisions_joined, 1);
    }
}

/// Half of a decision whose other half never came within the join timeout.
pub(crate) struct DecisionUnjoined<'a> {
    pub request_id: &'a str,
    pub half: &'a str,
}

static UNJOINED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for DecisionUnjoined<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = UNJOINED.check() {
            warn!(request_id = %self.request_id, half = %self.half, suppressed, "Routing decision never completed.");
        }
        add(&stats.decisions_unjoined, 1);
    }
}

/// A request's arrival line without the tenant field the agent was told to read, or
/// whose value the pattern does not match.
pub(crate) struct RouterTenantUnread;

static TENANT_UNREAD: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for RouterTenantUnread {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = TENANT_UNREAD.check() {
            warn!(
                suppressed,
                "A request's arrival line (`request received`) has no tenant_field, or its value \
                 does not match tenant_pattern: its tenant is its cache salt's."
            );
        }
        add(&stats.router_tenants_unread, 1);
    }
}

/// Router score lines ([`crate::taps::router::parse::Candidate`]) set beside no view.
pub(crate) struct RouterCandidatesUnjoined {
    pub lines: u64,
}

static CANDIDATES_UNJOINED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for RouterCandidatesUnjoined {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = CANDIDATES_UNJOINED.check() {
            warn!(
                lines = self.lines,
                suppressed,
                "The router's per-worker score lines came without a view of their request to set \
                 them beside: log `[ROUTING] Best` too (DYN_LOG with dynamo_llm::kv_router=debug)."
            );
        }
        add(&stats.router_candidates_unjoined, self.lines);
    }
}

/// The router logs its choices, but neither the `[ROUTING_INPUT]` lines nor the request
/// trace decisions are made of: what to set on it. No counter (the unjoined choices are
/// counted); said once per log.
pub(crate) struct RoutingInputMissing;

/// The `DYN_LOG` directives under which the routers of Dynamo 1.4 on write their
/// `[ROUTING_INPUT]` lines: 1.4 and 1.5 log them from `dynamo_llm::kv_router`, 1.6 from
/// its selection service (read from each release's own binary). Both together are
/// right on every one of them; docs/deploy.md gives the narrower one per release.
pub const ROUTING_INPUT_DYN_LOG: &str =
    "info,dynamo_llm::kv_router=debug,dynamo_kv_router::services::selection::core::run=debug";

/// The `DYN_LOG` directive under which routers log what they credited workers they did
/// not choose: Dynamo 1.4 and 1.5 their score of every worker for every request
/// (`Formula for worker_id=…`, one line per worker: a fleet of hundreds of workers writes
/// hundreds of lines per request, so it is no default); 1.6's disaggregated prefill
/// router a line per choice made past the worker it believed best (`Router selected a
/// worker with lower KV cache overlap`). 1.6 logs nothing of the kind for aggregated
/// routes.
pub const ROUTER_SCORES_DYN_LOG: &str =
    "dynamo_kv_router::scheduling::selector=debug,dynamo_llm::kv_router::embedded=debug";

impl InternalEvent<AgentStats> for RoutingInputMissing {
    fn emit(self, _stats: &AgentStats) {
        warn!(
            "The router log has `Selected worker` lines but no [ROUTING_INPUT] line and no request \
             trace, so no decision can be made of them: run the frontend with \
             DYN_REQUEST_TRACE=1 DYN_REQUEST_TRACE_SINKS=stderr (read at any log level), or with \
             DYN_LOG={ROUTING_INPUT_DYN_LOG}."
        );
    }
}

pub(crate) struct MigrationLineParsed {
    pub kind: MigrationLogKind,
}

impl InternalEvent<AgentStats> for MigrationLineParsed {
    fn emit(self, stats: &AgentStats) {
        debug!(kind = ?self.kind, "Migration log line.");
        add(&stats.migration_lines, 1);
    }
}

/// The followed file was replaced (rotation) or cut (truncation). No counter.
pub(crate) struct LogFileReopened<'a> {
    pub path: &'a str,
    pub reason: &'a str,
}

impl InternalEvent<AgentStats> for LogFileReopened<'_> {
    fn emit(self, _stats: &AgentStats) {
        info!(path = %self.path, reason = %self.reason, "Router log reopened.");
    }
}

/// A router log file matching the `router_log` pattern is followed. No counter.
pub(crate) struct RouterLogFollowed<'a> {
    pub path: &'a std::path::Path,
    pub from_start: bool,
}

impl InternalEvent<AgentStats> for RouterLogFollowed<'_> {
    fn emit(self, _stats: &AgentStats) {
        info!(path = %self.path.display(), from_start = self.from_start, "Following a router log the pattern matches.");
    }
}

/// A followed router log no longer matches (its pod is gone) or a newer file in its
/// folder took over (the container restarted): read to its end and let go. No counter.
pub(crate) struct RouterLogReleased<'a> {
    pub path: &'a std::path::Path,
}

impl InternalEvent<AgentStats> for RouterLogReleased<'_> {
    fn emit(self, _stats: &AgentStats) {
        info!(path = %self.path.display(), "Router log let go: no longer the live file the pattern matches.");
    }
}

/// The router log cannot be read right now (missing, permissions); retried.
pub(crate) struct LogFileUnavailable<'a> {
    pub path: &'a str,
    pub error: &'a str,
}

static UNAVAILABLE: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for LogFileUnavailable<'_> {
    fn emit(self, _stats: &AgentStats) {
        if let Some(suppressed) = UNAVAILABLE.check() {
            warn!(path = %self.path, error = %self.error, suppressed, "Router log unavailable; waiting for it.");
        }
    }
}

/// A request id longer than kvscope keeps (256 bytes): kept as its first bytes and a
/// hash (`kvscope_wire::bounded_request_id`).
pub(crate) struct RequestIdShortened;

static ID_SHORTENED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for RequestIdShortened {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = ID_SHORTENED.check() {
            warn!(
                suppressed,
                "A request id longer than 256 bytes: kept as its first bytes and a hash."
            );
        }
        add(&stats.request_ids_shortened, 1);
    }
}

/// A router log line longer than the limit: skipped to its end, never held whole.
pub(crate) struct LogLineTooLong<'a> {
    pub source: &'a str,
    pub bytes: u64,
}

static TOO_LONG: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for LogLineTooLong<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = TOO_LONG.check() {
            warn!(source = %self.source, bytes = self.bytes, suppressed, "Router log line longer than max_line_bytes; skipped.");
        }
        add(&stats.log_lines_too_long, 1);
    }
}

/// A routing decision read from Dynamo's request trace (no routing lines named it).
pub(crate) struct DecisionTraced<'a> {
    pub request_id: &'a str,
}

impl InternalEvent<AgentStats> for DecisionTraced<'_> {
    fn emit(self, stats: &AgentStats) {
        debug!(request_id = %self.request_id, "Routing decision from the request trace.");
        add(&stats.decisions_traced, 1);
    }
}

/// The router log was cut under the follower (truncated in place, `copytruncate`,
/// possibly written again past where it had read): it is read again from its start.
/// Lines written between the follower's last read and the cut went to the copy and are
/// not read: counted here.
pub(crate) struct LogFileTruncated<'a> {
    pub path: &'a str,
    pub position: u64,
    pub size_now: u64,
}

impl InternalEvent<AgentStats> for LogFileTruncated<'_> {
    fn emit(self, stats: &AgentStats) {
        warn!(path = %self.path, position = self.position, size_now = self.size_now, "Router log truncated under the follower; reading it again from its start (lines written just before the cut may be missed).");
        add(&stats.log_truncations, 1);
    }
}

/// A router log line dated too far ahead of this host's clock (a wrong clock, or a
/// forged line): its time is not taken, so it cannot stop the joins.
pub(crate) struct LogLineFuture {
    pub ts_ns: u64,
    pub ahead_ns: u64,
}

static FUTURE: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for LogLineFuture {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = FUTURE.check() {
            warn!(
                ts_ns = self.ts_ns,
                ahead_s = self.ahead_ns as f64 / 1e9,
                suppressed,
                "Router log line dated ahead of this host's clock; its time is ignored."
            );
        }
        add(&stats.log_lines_future, 1);
    }
}
