//! OTLP spans of NIXL transfers and handshakes as the probes see them end.
//!
//! At lab rates a node can make tens of thousands of transfers per second; the figures
//! on `/metrics` (and in the OTLP metrics) stay exact, while spans are a bounded sample:
//! the [`SpanSink`]'s per-second cap admits the first spans of each second and counts
//! the rest (`kvscope_agent_otlp_spans_dropped_total{reason="rate_cap"}`), before any
//! span is built.

use super::aggregate::{Observed, ObservedKind};
use kvscope_otlp::proto::trace::v1::{span, Span, Status};
use kvscope_otlp::{attr_int, attr_str, SpanSink};
use kvscope_wire::nixl::{XferStage, HANDSHAKE_CALLS};
use kvscope_wire::trace_ids::{span_id, trace_id};

/// Span name of a transfer.
pub const TRANSFER_SPAN: &str = "nixl.transfer";
/// Span names of handshakes: `nixl.` + the `nixlAgent` method.
pub(crate) const HANDSHAKE_SPAN_PREFIX: &str = "nixl.";

/// Where the tracer sends spans, and the agent they come from.
#[derive(Clone)]
pub(crate) struct NixlSpans {
    pub sink: SpanSink,
    pub agent_id: String,
    /// One transfer in this many is kept for no other reason (`nixl.sample_every`).
    pub sample_every: u64,
}

/// Why a transfer's record was kept (`flags::KEPT_*`), as a span says it: `failure`,
/// `notification`, `slow`, `sampled`, comma-separated.
pub(crate) fn kept_for(kept: u32) -> String {
    use super::event::flags;
    [
        (flags::KEPT_FAILURE, "failure"),
        (flags::KEPT_NOTIF, "notification"),
        (flags::KEPT_SLOW, "slow"),
        (flags::KEPT_SAMPLED, "sampled"),
    ]
    .iter()
    .filter(|(f, _)| kept & f != 0)
    .map(|(_, n)| *n)
    .collect::<Vec<_>>()
    .join(",")
}

impl NixlSpans {
    /// A span for a transfer or a handshake (other calls — notifications, memory
    /// registration — have figures, not spans). `end_ns` is the wall-clock end.
    pub fn record(&self, o: &Observed<'_>, end_ns: u64) {
        let name = match o.what {
            ObservedKind::Transfer { .. } => TRANSFER_SPAN.to_string(),
            ObservedKind::Call(c) if HANDSHAKE_CALLS.contains(&c.name()) => {
                format!("{HANDSHAKE_SPAN_PREFIX}{}", c.name())
            }
            ObservedKind::Call(_) => return,
        };
        if !self.sink.admit() {
            return;
        }
        self.sink.push_admitted(self.span(name, o, end_ns));
    }

    fn span(&self, name: String, o: &Observed<'_>, end_ns: u64) -> Span {
        let start_ns = end_ns.saturating_sub(o.latency_ns.unwrap_or(0));
        let mut attributes = vec![
            attr_str("kvscope.agent.id", self.agent_id.clone()),
            attr_int("process.pid", o.pid),
            attr_str("nixl.local_agent", o.local),
            attr_str("nixl.remote_agent", o.remote),
            attr_str("nixl.status", super::event::status_name(o.status)),
            attr_int("nixl.status_code", o.status),
        ];
        if let Some(bytes) = o.bytes {
            attributes.push(attr_int("nixl.bytes", bytes));
        }
        let failed = match o.what {
            ObservedKind::Transfer { op, stage } => {
                attributes.push(attr_str("nixl.op", op));
                attributes.push(attr_str("nixl.stage", stage.as_str()));
                o.status < 0 || stage == XferStage::ReleasedInFlight
            }
            ObservedKind::Call(c) => {
                attributes.push(attr_str("nixl.call", c.name()));
                o.status < 0
            }
        };
        if failed {
            // OTel's semantic convention for what went wrong: the NIXL status name
            // (`ERR_NOT_FOUND`, …), or the transfer released while in flight.
            let kind = match o.what {
                ObservedKind::Transfer {
                    stage: XferStage::ReleasedInFlight,
                    ..
                } => "released_in_flight".into(),
                _ => super::event::status_name(o.status),
            };
            attributes.push(attr_str("error.type", kind));
        }
        if let Some(n) = o.notif {
            attributes.push(attr_str("nixl.notif", n));
        }
        // Why a transfer counted in the kernel was kept; one kept only as the sample
        // stands for `sample_every` transfers (one kept for itself, for itself).
        if let Some(kept) = o.kept {
            attributes.push(attr_str("nixl.kept_for", kept_for(kept)));
            if kept & super::event::flags::KEPT_SAMPLED != 0 {
                attributes.push(attr_int("nixl.sample_every", self.sample_every));
            }
        }
        if let Some(rid) = o.request_id {
            attributes.push(attr_str("kvscope.request_id", rid));
        }
        let key = format!(
            "nixl/{}/{}/{}/{}/{}",
            self.agent_id, o.pid, o.local, o.remote, o.ts_ns
        );
        // A transfer for a known request joins the trace kvscope's other spans about
        // that request share; any other has a trace of its own.
        let trace = o.request_id.unwrap_or(&key);
        Span {
            trace_id: trace_id(trace),
            span_id: span_id(&key),
            name,
            kind: span::SpanKind::Client as i32,
            start_time_unix_nano: start_ns,
            end_time_unix_nano: end_ns,
            attributes,
            status: failed.then(|| Status {
                message: super::event::status_name(o.status).to_string(),
                code: 2, // STATUS_CODE_ERROR
            }),
            ..Default::default()
        }
    }
}
