//! OTLP spans of what the collector concludes: one per spill verdict and one per
//! migration log line (`KVMIGRATE…`).
//!
//! A request's spans are in the router's own trace of it when its log lines carried
//! one (Dynamo's JSON lines do: [`TraceContext`]), as children of the router's span;
//! otherwise the trace id derives from the request id. Either way a request's spill
//! verdict and its migration lines share one trace, and a migration span links to the
//! verdict span, whose id derives from the request id. Spans are not made for records re-applied while the collector rebuilds its
//! state at start: those were exported by the run that first applied them.

use kvscope_otlp::proto::trace::v1::{span, Span, Status};
use kvscope_otlp::{attr_bool, attr_int, attr_str, SpanSink};
use kvscope_wire::api::verdict::SpillVerdict;
use kvscope_wire::trace_ids::{span_id, trace_id};
use kvscope_wire::{Envelope, MigrationLogKind, MigrationLogLine, Record, TraceContext};

/// The span name of a spill verdict.
pub const SPILL_SPAN: &str = "kvscope.spill_verdict";
/// The span name of a migration log line.
pub const MIGRATION_SPAN: &str = "kvscope.migration";

fn verdict_span_id(request_id: &str) -> Vec<u8> {
    span_id(&format!("verdict/{request_id}"))
}

/// The trace id, parent span id and span flags of a span about `key`: the router's
/// trace and span when known (a parent in another process), else a trace of its own.
fn place(trace: Option<&TraceContext>, key: &str) -> (Vec<u8>, Vec<u8>, u32) {
    match trace {
        Some(t) => (
            t.trace_id_bytes(),
            t.span_id_bytes(),
            kvscope_otlp::traces::PARENT_IS_REMOTE,
        ),
        None => (trace_id(key), Vec::new(), 0),
    }
}

/// The spill verdict as a span at its decision time.
pub fn verdict_span(v: &SpillVerdict, agent: &str) -> Span {
    let (trace_id, parent_span_id, flags) = place(v.trace.as_ref(), &v.request_id);
    Span {
        trace_id,
        parent_span_id,
        flags,
        span_id: verdict_span_id(&v.request_id),
        name: SPILL_SPAN.into(),
        kind: span::SpanKind::Internal as i32,
        start_time_unix_nano: v.decided_ns,
        end_time_unix_nano: v.decided_ns,
        attributes: vec![
            attr_str("kvscope.request_id", v.request_id.clone()),
            attr_bool("kvscope.spill", v.spill),
            attr_str("kvscope.worker.chosen.id", v.chosen.worker_id.to_string()),
            attr_int("kvscope.worker.chosen.dp_rank", v.chosen.dp_rank),
            attr_str("kvscope.worker.best.id", v.best.worker_id.to_string()),
            attr_int("kvscope.worker.best.dp_rank", v.best.dp_rank),
            attr_int("kvscope.overlap.chosen_blocks", v.chosen_overlap_blocks),
            attr_int("kvscope.overlap.best_blocks", v.best_overlap_blocks),
            attr_int("kvscope.block_size", v.block_size),
            attr_int("kvscope.isl_tokens", v.isl_tokens),
            attr_int("kvscope.upper_bound_tokens", v.upper_bound_tokens),
            attr_int("kvscope.true_delta_tokens", v.true_delta_tokens),
            attr_int("kvscope.generated_delta_tokens", v.generated_delta_tokens),
            attr_int("kvscope.onload_delta_tokens", v.onload_delta_tokens),
            attr_int("kvscope.uncached_prefill_tokens", v.uncached_prefill_tokens),
            attr_str("kvscope.agent.id", agent.to_string()),
        ]
        .into_iter()
        .chain(v.model.clone().map(|m| attr_str("kvscope.model", m)))
        .chain(v.tenant.clone().map(|t| attr_str("kvscope.tenant", t)))
        .collect(),
        ..Default::default()
    }
}

fn outcome(kind: MigrationLogKind) -> &'static str {
    match kind {
        MigrationLogKind::Spill => "dispatched",
        MigrationLogKind::HandshakeObtained => "handshake_obtained",
        MigrationLogKind::DispatchFailed => "dispatch_failed",
        MigrationLogKind::DecodingOnTarget => "decoding_on_target",
    }
}

/// A `KVMIGRATE…` line as a span at the time the agent saw it, in its request's trace
/// and linked to the request's spill verdict span.
/// `at` tells apart lines without a request id: the record's bus message and its place
/// in it (`<seq>` or `<seq>.<index>`).
pub(crate) fn migration_span(
    m: &MigrationLogLine,
    agent: &str,
    observed_ns: u64,
    at: &str,
) -> Span {
    let outcome = outcome(m.kind);
    // Lines without a request id still get a trace of their own.
    let trace_key = m
        .request_id
        .clone()
        .unwrap_or_else(|| format!("migration/{agent}/{at}"));
    let mut attributes = vec![
        attr_str("kvscope.migration.outcome", outcome),
        attr_str("kvscope.agent.id", agent.to_string()),
    ];
    let field = |k: &str| m.fields.get(k).cloned();
    let text = [
        ("kvscope.request_id", m.request_id.clone()),
        ("kvscope.migration.source", m.source.clone()),
        ("kvscope.migration.target", m.target.clone()),
        (
            "kvscope.migration.directive_id",
            field("directive_id").or_else(|| field("directive")),
        ),
    ];
    attributes.extend(
        text.into_iter()
            .filter_map(|(k, v)| v.map(|v| attr_str(k, v))),
    );
    let numbers = [
        ("kvscope.migration.tokens", m.tokens),
        ("kvscope.migration.migratable_tokens", m.migratable_tokens),
        (
            "kvscope.migration.blocks",
            field("blocks").and_then(|b| b.parse().ok()),
        ),
    ];
    attributes.extend(
        numbers
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| attr_int(k, v))),
    );
    let (trace_id, parent_span_id, flags) = place(m.trace.as_ref(), &trace_key);
    let links = m
        .request_id
        .as_deref()
        .map(|rid| span::Link {
            // The verdict's trace is the line's when both are the router's.
            trace_id: match &m.trace {
                Some(t) => t.trace_id_bytes(),
                None => kvscope_wire::trace_ids::trace_id(rid),
            },
            span_id: verdict_span_id(rid),
            attributes: vec![attr_str("kvscope.link", "spill_verdict")],
            ..Default::default()
        })
        .into_iter()
        .collect();
    let failed = m.kind == MigrationLogKind::DispatchFailed;
    if failed {
        attributes.push(attr_str("error.type", "producer_dispatch_failed"));
    }
    Span {
        trace_id,
        parent_span_id,
        flags,
        span_id: span_id(&format!("migration/{agent}/{at}/{trace_key}/{outcome}")),
        name: MIGRATION_SPAN.into(),
        kind: span::SpanKind::Internal as i32,
        start_time_unix_nano: observed_ns,
        end_time_unix_nano: observed_ns,
        attributes,
        links,
        status: failed.then(|| Status {
            message: "producer dispatch failed".into(),
            code: 2, // STATUS_CODE_ERROR
        }),
        ..Default::default()
    }
}

/// The spans of one applied record (the `index`th of bus message `seq`): the spill
/// The span export, as the collector's state is told of each record applied.
pub(crate) struct VerdictSpans(pub SpanSink);

impl crate::state::AppliedSink for VerdictSpans {
    fn applied(&self, env: &Envelope, verdict: Option<&SpillVerdict>, seq: u64, index: usize) {
        if self.0.enabled() {
            record(&self.0, env, verdict, seq, index);
        }
    }
}

/// verdict it produced, or its migration line.
pub fn record(
    sink: &SpanSink,
    env: &Envelope,
    verdict: Option<&SpillVerdict>,
    seq: u64,
    index: usize,
) {
    let span = match (&env.record, verdict) {
        (_, Some(v)) if v.spill => verdict_span(v, &env.agent),
        (Record::Migration(m), _) => {
            let at = match index {
                0 => seq.to_string(),
                i => format!("{seq}.{i}"),
            };
            migration_span(m, &env.agent, env.observed_ns, &at)
        }
        _ => return,
    };
    // A few spans per second at most: built before the cap is asked.
    sink.record(span);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn a_migration_shares_its_request_s_trace_and_links_its_verdict() {
        let m = MigrationLogLine {
            kind: MigrationLogKind::DispatchFailed,
            request_id: Some("r-1".into()),
            source: Some("w1".into()),
            target: Some("w2".into()),
            tokens: Some(4096),
            migratable_tokens: Some(2048),
            fields: BTreeMap::from([("directive_id".to_string(), "d-9".to_string())]),
            trace: None,
        };
        let s = migration_span(&m, "node", 5, "7");
        assert_eq!(s.trace_id, trace_id("r-1"));
        assert_eq!(s.links[0].span_id, verdict_span_id("r-1"));
        assert_eq!(s.status.as_ref().map(|s| s.code), Some(2));
        let keys: Vec<_> = s.attributes.iter().map(|a| a.key.as_str()).collect();
        for k in [
            "kvscope.migration.outcome",
            "kvscope.migration.source",
            "kvscope.migration.target",
            "kvscope.migration.directive_id",
            "kvscope.migration.tokens",
            "error.type",
        ] {
            assert!(keys.contains(&k), "{k} in {keys:?}");
        }
        let anonymous = MigrationLogLine {
            request_id: None,
            ..m
        };
        assert!(migration_span(&anonymous, "node", 5, "8").links.is_empty());
    }

    /// With the router's trace context, both spans are children of the router's span in
    /// its trace, and the migration's link names the verdict in that trace.
    #[test]
    fn spans_join_the_routers_trace_when_it_is_known() {
        let t =
            TraceContext::parse("e3dc865584cf0a24f81738cf84ceb1c7", "c4bb29434de1f7bc").unwrap();
        let trace_bytes = vec![
            0xe3, 0xdc, 0x86, 0x55, 0x84, 0xcf, 0x0a, 0x24, 0xf8, 0x17, 0x38, 0xcf, 0x84, 0xce,
            0xb1, 0xc7,
        ];
        let span_bytes = vec![0xc4, 0xbb, 0x29, 0x43, 0x4d, 0xe1, 0xf7, 0xbc];
        let m = MigrationLogLine {
            kind: MigrationLogKind::Spill,
            request_id: Some("r-1".into()),
            source: None,
            target: None,
            tokens: None,
            migratable_tokens: None,
            fields: BTreeMap::new(),
            trace: Some(t.clone()),
        };
        let s = migration_span(&m, "node", 5, "7");
        assert_eq!(
            (s.trace_id.clone(), s.parent_span_id.clone()),
            (trace_bytes.clone(), span_bytes.clone())
        );
        assert_eq!(s.links[0].trace_id, trace_bytes);
        assert_eq!(s.links[0].span_id, verdict_span_id("r-1"));
        assert_eq!(s.flags, kvscope_otlp::traces::PARENT_IS_REMOTE);
        assert_eq!(place(None, "r-1"), (trace_id("r-1"), Vec::new(), 0));
        assert_eq!(
            place(Some(&t), "r-1"),
            (
                trace_bytes,
                span_bytes,
                kvscope_otlp::traces::PARENT_IS_REMOTE
            )
        );
    }
}
