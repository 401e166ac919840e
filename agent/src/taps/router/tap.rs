//! The router log tap: lines from [`crate::taps::router::follower`] through the parser and joiner
//! of [`crate::taps::router::join`], out as decision and migration records.

use crate::counters::AgentStats;
use crate::internal_events::{
    DecisionClockBehind, DecisionJoined, DecisionTraced, DecisionUnjoined, InternalEvent,
    LogLineFuture, LogLineMalformed, LogLineRead, LogLineTooLong, MigrationLineParsed,
    RequestIdShortened, RouterCandidatesUnjoined, RouterTenantUnread, RoutingInputMissing,
};
use crate::sink::{RecordSink, SourceId};
use crate::taps::router::cri::{CriJoiner, CriOutput};
use crate::taps::router::follower::LogItem;
use crate::taps::router::join::{DecisionSource, LogOutput, RouterLogProcessor, TenantField};
use kvscope_kit::clock::now_ns;
use kvscope_wire::Record;
use tokio::sync::mpsc;

/// Halves of decisions that may wait at once.
pub(crate) const MAX_PENDING: usize = 100_000;

pub struct RouterTap {
    processor: RouterLogProcessor,
    /// Kubernetes' container log format, unwrapped (other lines pass through).
    cri: CriJoiner,
}

/// A record from the log, and when it happened if not at its line's time (a decision
/// from the request trace happened when its request arrived).
pub(crate) type LogRecord = (Record, Option<u64>);

impl RouterTap {
    /// Lines joined from CRI partials are held up to `max_line_bytes`.
    pub fn new(join_timeout_ns: u64, max_line_bytes: usize, source: DecisionSource) -> Self {
        Self {
            processor: RouterLogProcessor::with_source(join_timeout_ns, MAX_PENDING, source),
            cri: CriJoiner::new(max_line_bytes),
        }
    }

    /// Decisions name their tenant by `field` of their request's arrival line.
    pub fn with_tenant_field(mut self, field: Option<TenantField>) -> Self {
        self.processor = self.processor.with_tenant_field(field);
        self
    }

    /// The timestamp of the latest log line that carried one (UNIX ns).
    pub(crate) fn log_time_ns(&self) -> Option<u64> {
        self.processor.last_ts_ns()
    }

    /// One input item → records; every line and problem is counted.
    pub fn item(&mut self, item: &LogItem, stats: &AgentStats) -> Vec<LogRecord> {
        let mut lines = Vec::new();
        match item {
            LogItem::Line(line) => {
                LogLineRead.emit(stats);
                lines.push(self.cri.push(line));
            }
            LogItem::End => lines.extend(self.cri.finish()),
        }
        let mut outputs = Vec::new();
        for l in lines {
            match l {
                CriOutput::Line { text, .. } => {
                    outputs.extend(self.processor.line(&text, now_ns()))
                }
                CriOutput::TooLong(bytes) => LogLineTooLong {
                    source: "a CRI line joined from partials",
                    bytes,
                }
                .emit(stats),
                CriOutput::Pending => {}
            }
        }
        if matches!(item, LogItem::End) {
            outputs.extend(self.processor.finish());
        }
        Self::records(outputs, stats)
    }

    /// No line came for a while: what waited on the next one by log time and may go now.
    pub fn idle(&mut self, stats: &AgentStats) -> Vec<LogRecord> {
        Self::records(self.processor.idle(now_ns()), stats)
    }

    /// The processor's outputs as records; every problem counted.
    fn records(outputs: Vec<LogOutput>, stats: &AgentStats) -> Vec<LogRecord> {
        let mut records = Vec::new();
        for o in outputs {
            let id = match &o {
                LogOutput::Decision(d) => Some(&d.request_id),
                LogOutput::TracedDecision { decision, .. } => Some(&decision.request_id),
                LogOutput::RequestEnd(e) => Some(&e.request_id),
                _ => None,
            };
            if id.is_some_and(|id| kvscope_wire::is_shortened_request_id(id)) {
                RequestIdShortened.emit(stats);
            }
            match o {
                LogOutput::Decision(d) => {
                    DecisionJoined {
                        request_id: &d.request_id,
                    }
                    .emit(stats);
                    records.push((Record::Decision(d), None));
                }
                LogOutput::TracedDecision { decision, at_ns } => {
                    DecisionTraced {
                        request_id: &decision.request_id,
                    }
                    .emit(stats);
                    records.push((Record::Decision(decision), Some(at_ns)));
                }
                LogOutput::TraceDuplicate => {}
                // Stamped when it ended, as its line was written.
                LogOutput::RequestEnd(e) => records.push((Record::RequestEnd(e), None)),
                // Stamped when the route ended, as its line was written.
                LogOutput::RouterView(v) => records.push((Record::RouterView(v), None)),
                LogOutput::FutureLine { ts_ns, ahead_ns } => {
                    LogLineFuture { ts_ns, ahead_ns }.emit(stats)
                }
                LogOutput::Migration(m) => {
                    MigrationLineParsed { kind: m.kind }.emit(stats);
                    records.push((Record::Migration(m), None));
                }
                LogOutput::Malformed(e) => LogLineMalformed {
                    kind: e.kind.as_str(),
                    reason: &e.reason,
                }
                .emit(stats),
                LogOutput::Unjoined { request_id, half } => DecisionUnjoined {
                    request_id: &request_id,
                    half: half.as_str(),
                }
                .emit(stats),
                LogOutput::RoutingInputMissing => RoutingInputMissing.emit(stats),
                LogOutput::CandidatesUnjoined(lines) => {
                    RouterCandidatesUnjoined { lines }.emit(stats)
                }
                LogOutput::TenantUnread => RouterTenantUnread.emit(stats),
            }
        }
        records
    }
}

/// How long without a line before the tap looks at what waits on the next one.
const IDLE_TICK: std::time::Duration = std::time::Duration::from_millis(250);

/// Run until the channel closes. The log's records are `source` in the sink: it is read
/// in order, so its timestamps only move forward (within the router's own write order).
/// Decisions from the request trace are the exception: each is written when its
/// request ends, long after it happened, so from the first one on every record waits
/// `trace_window_ns` for the log (however far the log has got), and a traced decision
/// slots in at its request's arrival time if it comes within that window.
pub async fn run(
    mut tap: RouterTap,
    mut rx: mpsc::Receiver<LogItem>,
    budget: std::sync::Arc<crate::taps::router::follower::LineBudget>,
    sink: std::sync::Arc<RecordSink>,
    source: SourceId,
    trace_window_ns: u64,
    stats: std::sync::Arc<AgentStats>,
) {
    let mut held = false;
    loop {
        let records = match tokio::time::timeout(IDLE_TICK, rx.recv()).await {
            Ok(Some(item)) => {
                let records = tap.item(&item, &stats);
                if let LogItem::Line(l) = &item {
                    budget.give(l.len());
                }
                records
            }
            Ok(None) => break,
            Err(_) => tap.idle(&stats),
        };
        let at = tap.log_time_ns();
        if records.is_empty() {
            // Any timestamped line tells how far the log has got.
            if let Some(t) = at {
                sink.advance(source, t);
            }
        }
        for (mut r, happened) in records {
            if happened.is_some() && !held {
                sink.hold_source(source, trace_window_ns);
                held = true;
            }
            if let Record::Decision(d) = &mut r {
                if let Some(floor_ns) = sink.clock_behind_ns(source) {
                    d.clock_behind_ms = Some(floor_ns / 1_000_000);
                    DecisionClockBehind { floor_ns }.emit(&stats);
                }
            }
            // A decision happened when the router logged it, not when we read the line.
            sink.submit_event(source, r, happened.or(at));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_lines_decisions_and_problems() {
        let stats = AgentStats::default();
        let mut t = RouterTap::new(1_000_000_000, 1 << 20, DecisionSource::Auto);
        let lines = [
            r#"2026-11-29T07:50:01Z DEBUG r: [ROUTING_INPUT] request local hashes request_id="a" isl_tokens=32 block_size=16 num_blocks=2 local_hashes=[1, 2]"#,
            "random noise",
            r#"2026-11-29T07:50:01Z DEBUG r: [ROUTING_INPUT] request local hashes request_id="b" isl_tokens=32"#,
            r#"2026-11-29T07:50:01Z  INFO r: Selected worker router_mode="kv" request_id="a" worker_id=5 worker_type=decode dp_rank=0"#,
            r#"2026-11-29T07:50:01Z DEBUG r: [ROUTING_INPUT] request local hashes request_id="never" isl_tokens=16 block_size=16 num_blocks=1 local_hashes=[3]"#,
            "2026-11-29T07:50:02Z  INFO p: KVMIGRATE_SPILL: request routed off the worker holding its KV request_id=\"a\" source=5 target=6 tokens=32 migratable_tokens=16",
        ];
        let mut records = Vec::new();
        for l in lines {
            records.extend(t.item(&LogItem::Line(l.into()), &stats));
        }
        records.extend(t.item(&LogItem::End, &stats));
        assert!(
            matches!(
                &records[..],
                [(Record::Decision(_), None), (Record::Migration(_), None)]
            ),
            "{records:?}"
        );
        let c = stats.snapshot();
        assert_eq!(
            (
                c.log_lines,
                c.log_malformed_lines,
                c.decisions_joined,
                c.decisions_unjoined,
                c.migration_lines
            ),
            (6, 1, 1, 1, 1)
        );
    }
}
