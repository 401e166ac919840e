//! Prometheus exposition of the collector's figures, built from its state at scrape time
//! so no figure can drift from the one the API and the report show.

use crate::analyzer::FleetAnalyzer;
use crate::bus::BusStatus;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

type Labels = Vec<(String, String)>;

fn counter(reg: &mut Registry, name: &str, help: &str, v: u64) {
    let c: Counter<u64> = Counter::default();
    c.inc_by(v);
    reg.register(name, help, c);
}

fn gauge(reg: &mut Registry, name: &str, help: &str, v: f64) {
    let g: Gauge<f64, AtomicU64> = Gauge::default();
    g.set(v);
    reg.register(name, help, g);
}

fn gauge_family(
    reg: &mut Registry,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (Labels, f64)>,
) {
    let f: Family<Labels, Gauge<f64, AtomicU64>> = Family::default();
    for (labels, v) in rows {
        f.get_or_create(&labels).set(v);
    }
    reg.register(name, help, f);
}

fn counter_family(
    reg: &mut Registry,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (Labels, u64)>,
) {
    let f: Family<Labels, Counter<u64>> = Family::default();
    for (labels, v) in rows {
        f.get_or_create(&labels).inc_by(v);
    }
    reg.register(name, help, f);
}

/// Render the OpenMetrics text for the current state.
pub fn render(a: &FleetAnalyzer, bus: &BusStatus) -> String {
    let mut reg = Registry::with_prefix("kvscope");
    let c = a.counters();
    counter(&mut reg, "collector_records", "Records applied.", c.records);
    counter(
        &mut reg,
        "collector_undecodable_records",
        "Bus messages that were not valid records.",
        c.undecodable_records,
    );
    counter(
        &mut reg,
        "kv_batches",
        "KV event batches applied.",
        c.kv_batches,
    );
    counter(&mut reg, "kv_events", "KV events applied.", c.kv_events);
    counter(
        &mut reg,
        "kv_stored_blocks",
        "Blocks stored in the fleet mirror.",
        c.stored_blocks,
    );
    counter(
        &mut reg,
        "kv_removed_blocks",
        "Blocks removed from the fleet mirror.",
        c.removed_blocks,
    );
    counter(
        &mut reg,
        "kv_unknown_parent_events",
        "Stores naming a parent the worker never stored (dropped).",
        c.unknown_parent_events,
    );
    counter(
        &mut reg,
        "kv_unknown_removed_blocks",
        "Removals of blocks the worker never stored.",
        c.unknown_removed_blocks,
    );
    counter(
        &mut reg,
        "kv_token_count_mismatches",
        "Stores whose tokens did not fill one block per hash.",
        c.token_count_mismatches,
    );
    counter(
        &mut reg,
        "kv_sequence_gaps",
        "Gaps in publisher sequence numbers.",
        c.sequence_gaps,
    );
    counter(
        &mut reg,
        "kv_missed_batches",
        "Event batches lost in sequence gaps.",
        c.missed_batches,
    );
    counter(
        &mut reg,
        "kv_sequence_resets",
        "Publisher sequence resets (engine restarts).",
        c.sequence_resets,
    );
    counter(
        &mut reg,
        "kv_generated_blocks",
        "Stored blocks in no prompt recently routed to their worker (decode-generated).",
        c.generated_blocks,
    );
    counter(
        &mut reg,
        "kv_batch_order_faults",
        "KV batches lost or reordered between agent and collector.",
        c.batch_order_faults,
    );
    counter(
        &mut reg,
        "decisions",
        "Routing decisions judged.",
        c.decisions,
    );
    counter(
        &mut reg,
        "spills",
        "Routing decisions judged spills.",
        c.spills,
    );
    counter(
        &mut reg,
        "decisions_for_unseen_workers",
        "Decisions for workers that never sent KV events.",
        c.decisions_for_unseen_workers,
    );
    counter(
        &mut reg,
        "decisions_fully_cached",
        "Decisions whose whole prompt was already cached on the chosen worker.",
        c.decisions_fully_cached,
    );
    counter(
        &mut reg,
        "migration_log_lines",
        "KVMIGRATE log lines seen.",
        c.migration_lines,
    );
    counter(
        &mut reg,
        "collector_late_records",
        "Records older than the open window.",
        c.late_records,
    );
    gauge(
        &mut reg,
        "fleet_cached_block_pairs",
        "Cached (block, worker) pairs in the mirror.",
        a.index().cached_pairs() as f64,
    );
    gauge_family(
        &mut reg,
        "worker_cached_blocks",
        "Blocks cached per worker.",
        a.index()
            .workers()
            .map(|w| (worker_labels(&w), a.index().cached_blocks(&w) as f64)),
    );
    if let Some(w) = a.closed_windows().rev().find(|w| !w.summary.warmup) {
        let s = &w.summary;
        gauge(
            &mut reg,
            "window_spill_rate",
            "Spill rate of the last measured window.",
            s.spill_rate.unwrap_or(0.0),
        );
        gauge(
            &mut reg,
            "window_requests",
            "Routed requests in the last measured window.",
            s.requests as f64,
        );
        gauge(
            &mut reg,
            "window_true_delta_tokens_per_second",
            "True-delta migratable volume of the last measured window.",
            s.true_delta_tok_per_s,
        );
        gauge(
            &mut reg,
            "window_upper_bound_tokens_per_second",
            "Upper-bound migratable volume of the last measured window.",
            s.upper_bound_tok_per_s,
        );
        gauge(
            &mut reg,
            "window_uncached_prefill_tokens_per_second",
            "Uncached prefill of the last measured window.",
            s.uncached_prefill_tok_per_s,
        );
        gauge(
            &mut reg,
            "window_true_delta_tokens_p90",
            "p90 true delta per spill in the last measured window.",
            s.true_delta.p90 as f64,
        );
        gauge(
            &mut reg,
            "window_event_only_delta_tokens",
            "Event-only delta tokens in the last measured window.",
            s.event_only.delta_tokens as f64,
        );
    }
    gauge(
        &mut reg,
        "windows_measured",
        "Measured (post-warm-up) windows held.",
        a.closed_windows().filter(|w| !w.summary.warmup).count() as f64,
    );
    gauge(
        &mut reg,
        "collector_watermark_seconds",
        "Latest record time seen (UNIX seconds).",
        a.watermark_ns() as f64 / 1e9,
    );
    gauge(
        &mut reg,
        "collector_bus_connected",
        "1 when connected to NATS.",
        if bus.connected { 1.0 } else { 0.0 },
    );
    gauge(
        &mut reg,
        "collector_bus_pending",
        "Records waiting in the stream for this collector.",
        bus.pending as f64,
    );
    gauge(
        &mut reg,
        "collector_bus_applied_sequence",
        "Stream sequence of the last applied record.",
        bus.applied_seq as f64,
    );
    counter(
        &mut reg,
        "collector_bus_missing_records",
        "Stream records gone (expired or deleted) before this collector applied them.",
        bus.missing_records,
    );
    gauge(
        &mut reg,
        "collector_recording_failed",
        "1 when the recording stopped after a write error.",
        if bus.recording_failed { 1.0 } else { 0.0 },
    );
    let agent_rows = |f: fn(&kvscope_wire::AgentCounters) -> u64| {
        a.agents()
            .iter()
            .map(move |(id, st)| {
                (
                    vec![("agent".to_string(), id.clone())],
                    f(&st.heartbeat.counters),
                )
            })
            .collect::<Vec<_>>()
    };
    counter_family(
        &mut reg,
        "agent_kv_decode_errors",
        "Agent: undecodable KV payloads.",
        agent_rows(|k| k.kv_decode_errors),
    );
    counter_family(
        &mut reg,
        "agent_kv_bad_frames",
        "Agent: malformed ZMQ frames.",
        agent_rows(|k| k.kv_bad_frames),
    );
    counter_family(
        &mut reg,
        "agent_kv_unknown_events",
        "Agent: KV events of unknown type.",
        agent_rows(|k| k.kv_unknown_events),
    );
    counter_family(
        &mut reg,
        "agent_kv_malformed_events",
        "Agent: malformed KV events.",
        agent_rows(|k| k.kv_malformed_events),
    );
    counter_family(
        &mut reg,
        "agent_log_malformed_lines",
        "Agent: router log lines that failed to parse.",
        agent_rows(|k| k.log_malformed_lines),
    );
    counter_family(
        &mut reg,
        "agent_decisions_unjoined",
        "Agent: routing inputs never joined with a selection.",
        agent_rows(|k| k.decisions_unjoined),
    );
    counter_family(
        &mut reg,
        "agent_publish_dropped",
        "Agent: records dropped while NATS was away.",
        agent_rows(|k| k.publish_dropped),
    );
    gauge_family(
        &mut reg,
        "agent_last_seen_seconds",
        "Agent: time of its last heartbeat (UNIX seconds).",
        a.agents().iter().map(|(id, st)| {
            (
                vec![("agent".to_string(), id.clone())],
                st.last_seen_ns as f64 / 1e9,
            )
        }),
    );
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, &reg);
    // The NIXL pair histograms carry buckets merged from the agents' reports, which the
    // client library cannot take: their text goes before the closing `# EOF`.
    let pairs = crate::nixl::pairs(a.agents());
    if !pairs.is_empty() {
        let body_end = out.rfind("# EOF").unwrap_or(out.len());
        out.insert_str(body_end, &crate::nixl::render(&pairs));
    }
    out
}

/// Everything `/metrics` shows: the figures and the OTLP export health. The one source
/// of both `/metrics` and the OTLP metrics export.
pub fn exposition(shared: &crate::bus::Shared) -> String {
    let bus = crate::bus::lock(&shared.bus).clone();
    let mut out = render(&crate::bus::lock(&shared.analyzer), &bus);
    let body_end = out.rfind("# EOF").unwrap_or(out.len());
    out.insert_str(
        body_end,
        &shared.otlp.render_prometheus("kvscope_collector", ""),
    );
    out
}

fn worker_labels(w: &kvscope_wire::WorkerKey) -> Labels {
    vec![
        ("worker_id".into(), w.worker_id.to_string()),
        ("dp_rank".into(), w.dp_rank.to_string()),
    ]
}
