//! Prometheus exposition of the collector's figures, built from its state at scrape time
//! so no figure can drift from the one the API and the report show.
//!
//! Rates belong to Prometheus: the volumes (prompt, uncached prefill, true delta, upper
//! bound) are counters and per-spill histograms, so `rate()` over any range gives the
//! tok/s a window gives, and `histogram_quantile()` the percentiles. The last measured
//! window's own figures are there too (`kvscope_window_*`), as the report computes them.

use crate::fold::analyzer::{FleetAnalyzer, TokenHistogram, TOKEN_BOUNDS};
use kvscope_kit::prom::{labels, Exposition, Format, Kind};
use kvscope_wire::api::summary::BusStatus;

/// Everything `/metrics` shows, in `format`: the figures and the OTLP export health.
/// The one source of both `/metrics` and the OTLP metrics export.
pub fn exposition(shared: &crate::state::Shared, format: Format) -> String {
    let bus = crate::state::lock(&shared.bus).clone();
    let mut out = Exposition::new(format);
    write_lease(&mut out, &bus.lease);
    // A standby's figures would be a second series of the serving collector's: it shows
    // its role, its lease and its health only.
    if bus.lease.role.serves() {
        write(&mut out, &crate::state::lock(&shared.analyzer), &bus);
    }
    shared
        .otlp
        .write_prometheus(&mut out, "kvscope_collector", "");
    shared.http.write_prometheus(&mut out, "kvscope_collector");
    write_agent_clocks(&mut out, &crate::state::lock(&shared.clocks).offsets());
    crate::serve::api::readiness(shared).write_prometheus(&mut out, "kvscope_collector");
    out.finish()
}

fn write_lease(out: &mut Exposition, l: &kvscope_wire::api::summary::LeaseStatus) {
    use kvscope_wire::api::summary::CollectorRole;
    let name = "kvscope_collector_role";
    out.family(
        name,
        Kind::Gauge,
        "1 for this collector's role: leader (holds its scope's lease and serves), standby (folds the same stream, serves once the lease is free) or alone (no lease).",
    );
    for role in [
        CollectorRole::Leader,
        CollectorRole::Standby,
        CollectorRole::Alone,
    ] {
        out.gauge(
            name,
            &labels(&[("role", role.as_str())]),
            u64::from(l.role == role),
        );
    }
    for (name, help, n) in [
        (
            "kvscope_collector_lease_acquired",
            "Times this collector took its scope's lease.",
            l.acquired,
        ),
        (
            "kvscope_collector_lease_holder_changes",
            "Times this collector saw its scope's lease pass to another holder.",
            l.holder_changes,
        ),
        (
            "kvscope_collector_lease_lost",
            "Times this collector stopped serving because it could not renew its lease (it stands by again).",
            l.lost,
        ),
        (
            "kvscope_collector_lease_failures",
            "Looks at or renewals of the lease that failed (the bus away or refusing the bucket).",
            l.failures,
        ),
    ] {
        out.family(name, Kind::Counter, help);
        out.counter(name, "", n);
    }
}

/// The router's view of its choices against the engines' truth: decisions by how the
/// router's credited overlap compared, the blocks it was off by, and the spills it could
/// not see.
fn write_tier_view(out: &mut Exposition, v: &kvscope_wire::api::summary::TierViewAudit) {
    let name = "kvscope_router_tier_view_decisions";
    out.family(
        name,
        Kind::Counter,
        "Judged decisions whose line stated how far the router extended the chosen worker's match through its host and disk tiers, by how that compared with what its engine held then (exact, over, under).",
    );
    for (outcome, n) in [("exact", v.exact), ("over", v.over), ("under", v.under)] {
        out.counter(name, &labels(&[("outcome", outcome)]), n);
    }
}

fn write_router_view(out: &mut Exposition, v: &kvscope_wire::api::summary::RouterViewAudit) {
    let name = "kvscope_router_view_decisions";
    out.family(
        name,
        Kind::Counter,
        "Judged decisions by how the overlap the router credited the chosen worker with compared with what its engine held then (exact, over, under).",
    );
    for (outcome, n) in [("exact", v.exact), ("over", v.over), ("under", v.under)] {
        out.counter(name, &labels(&[("outcome", outcome)]), n);
    }
    let name = "kvscope_router_view_error_blocks";
    out.family(
        name,
        Kind::Counter,
        "Blocks the router credited the chosen worker with over (over) or under (under) what its engine held at the decision, summed.",
    );
    for (direction, n) in [("over", v.over_blocks), ("under", v.under_blocks)] {
        out.counter(name, &labels(&[("direction", direction)]), n);
    }
    let name = "kvscope_router_view_stale_causes";
    out.family(
        name,
        Kind::Counter,
        "Over- and under-estimates by why, from the first block the router got wrong: removed_lately (over: removed within 5 s before the decision, a removal the router had not applied), stored_after (over: stored only after the decision), stored_lately (under: stored within 5 s before, a store not yet applied), unexplained (an older change: lost or never applied).",
    );
    for (direction, cause, n) in [
        ("over", "removed_lately", v.over_removed_lately),
        ("over", "stored_after", v.over_stored_after),
        (
            "over",
            "unexplained",
            v.over
                .saturating_sub(v.over_removed_lately + v.over_stored_after),
        ),
        ("under", "stored_lately", v.under_stored_lately),
        (
            "under",
            "unexplained",
            v.under.saturating_sub(v.under_stored_lately),
        ),
    ] {
        out.counter(
            name,
            &labels(&[("direction", direction), ("cause", cause)]),
            n,
        );
    }
    out.single_counter(
        "kvscope_router_view_spills",
        "Spills whose router view came (set beside the engines' truth).",
        "",
        v.spills,
    );
    out.single_counter(
        "kvscope_router_view_spills_unseen",
        "Spills the router could not see: it credited the chosen worker with at least what the best worker held.",
        "",
        v.spills_unseen,
    );
    let name = "kvscope_router_view_best_spills";
    out.family(
        name,
        Kind::Counter,
        "Spills whose router view carries its score of the best worker (the one passed over; Dynamo 1.4/1.5 at DEBUG log one per worker), by what it believed of it: known (credited with at least what it held: a choice by load), stale_stored_lately (credited with less, its first uncredited block stored within 5 s before: a store not yet applied), stale_unexplained (credited with less, for an older change).",
    );
    for (view, n) in [
        (
            "known",
            v.spills_best_scored.saturating_sub(v.spills_best_stale),
        ),
        ("stale_stored_lately", v.spills_best_stale_stored_lately),
        (
            "stale_unexplained",
            v.spills_best_stale
                .saturating_sub(v.spills_best_stale_stored_lately),
        ),
    ] {
        out.counter(name, &labels(&[("view", view)]), n);
    }
    out.single_counter(
        "kvscope_router_view_best_stale_blocks",
        "The best worker's blocks the router did not credit, over the spills it had a stale view of the best worker in.",
        "",
        v.spills_best_stale_blocks,
    );
}

/// Each agent's clock offset, so the host whose clock runs ahead is named.
fn write_agent_clocks(out: &mut Exposition, offsets: &[(&str, u64)]) {
    if offsets.is_empty() {
        return;
    }
    let name = "kvscope_collector_agent_clock_ahead_seconds";
    out.family(
        name,
        Kind::Gauge,
        "How far an agent's clock reads ahead of the stream's, as estimated from when its records were stored: what its records' times are moved back by (0: not ahead).",
    );
    for (agent, ahead) in offsets {
        out.gauge(name, &labels(&[("agent", agent)]), *ahead as f64 / 1e9);
    }
}

/// The collector's figures for the current state.
pub fn write(out: &mut Exposition, a: &FleetAnalyzer, bus: &BusStatus) {
    let c = a.counters();
    let counters: [(&str, &str, u64); 52] = [
        ("kvscope_collector_records", "Records applied.", c.records),
        (
            "kvscope_collector_undecodable_records",
            "Bus messages that were not valid records.",
            c.undecodable_records,
        ),
        (
            "kvscope_collector_workers_retired",
            "Workers whose registration went away in Dynamo's discovery: their mirror was dropped.",
            c.workers_retired,
        ),
        (
            "kvscope_collector_batches_for_retired_workers",
            "KV batches of a retired worker, arriving after it left discovery: not applied.",
            c.batches_for_retired_workers,
        ),
        (
            "kvscope_kv_replayed_batches",
            "KV batches a publisher's replay socket sent again (recovered, not lost).",
            c.replayed_batches,
        ),
        (
            "kvscope_verdicts_on_incomplete_mirror",
            "Decisions judged while a worker they could have gone to had an incomplete mirror (flagged).",
            c.verdicts_on_incomplete_mirror,
        ),
        (
            "kvscope_collector_batches_other_models",
            "KV batches of models this collector does not measure (--models): skipped.",
            c.batches_other_models,
        ),
        (
            "kvscope_collector_decisions_other_models",
            "Decisions for models this collector does not measure (--models): skipped.",
            c.decisions_other_models,
        ),
        (
            "kvscope_collector_decisions_model_mismatch",
            "Decisions whose line named another model than discovery gives their chosen worker (discovery's stands).",
            c.decisions_model_mismatch,
        ),
        (
            "kvscope_collector_request_ids_shortened",
            "Request ids longer than 256 bytes, kept as their first bytes and a hash.",
            c.request_ids_shortened,
        ),
        (
            "kvscope_verdicts_model_unknown",
            "Verdicts judged among every worker: neither discovery nor the router's line named the chosen worker's model.",
            c.verdicts_model_unknown,
        ),
        (
            "kvscope_verdicts_left_out_unknown_model",
            "Verdicts where a worker of unknown model held more of the prompt than the chosen one (left out as a candidate).",
            c.verdicts_left_out_unknown_model,
        ),
        (
            "kvscope_collector_future_records",
            "Records stamped far ahead of the collector's clock: not applied.",
            c.future_records,
        ),
        (
            "kvscope_collector_records_clock_corrected",
            "Records dated after the stream stored them: moved back by their agent's clock offset (kvscope_collector_agent_clock_ahead_seconds).",
            c.records_clock_corrected,
        ),
        (
            "kvscope_collector_foreign_records",
            "Records whose agent is not the one their subject names (forged): not applied.",
            c.foreign_records,
        ),
        (
            "kvscope_collector_incomplete_records",
            "Records sent in parts that never came whole (dropped).",
            c.incomplete_records,
        ),
        (
            "kvscope_collector_late_records",
            "Records older than the open window (clock skew between agents).",
            c.late_records,
        ),
        (
            "kvscope_kv_batches",
            "KV event batches applied.",
            c.kv_batches,
        ),
        ("kvscope_kv_events", "KV events applied.", c.kv_events),
        (
            "kvscope_kv_stored_blocks",
            "Blocks stored in the fleet mirror.",
            c.stored_blocks,
        ),
        (
            "kvscope_kv_removed_blocks",
            "Blocks removed from the fleet mirror.",
            c.removed_blocks,
        ),
        (
            "kvscope_kv_unknown_parent_events",
            "Stores naming a parent the worker never stored (dropped).",
            c.unknown_parent_events,
        ),
        (
            "kvscope_kv_unknown_removed_blocks",
            "Removals of blocks the worker never stored.",
            c.unknown_removed_blocks,
        ),
        (
            "kvscope_kv_token_count_mismatches",
            "Stores whose tokens did not fill one block per hash.",
            c.token_count_mismatches,
        ),
        (
            "kvscope_kv_sequence_gaps",
            "Gaps in publisher sequence numbers (KV batches lost before the agent).",
            c.sequence_gaps,
        ),
        (
            "kvscope_kv_missed_batches",
            "Event batches lost in sequence gaps.",
            c.missed_batches,
        ),
        (
            "kvscope_kv_sequence_resets",
            "Publisher sequence resets (engine restarts).",
            c.sequence_resets,
        ),
        (
            "kvscope_kv_generated_blocks",
            "Stored blocks in no prompt recently routed to their worker (decode-generated).",
            c.generated_blocks,
        ),
        (
            "kvscope_prompts_reaching_generated_blocks",
            "Routed prompts whose best (or chosen) worker's cached prefix reached blocks it had generated while decoding (a reply sent back, still cached).",
            c.prompts_reaching_generated_blocks,
        ),
        (
            "kvscope_kv_batch_order_faults",
            "KV batches lost or reordered between agent and collector.",
            c.batch_order_faults,
        ),
        (
            "kvscope_decisions",
            "Routing decisions judged.",
            c.decisions,
        ),
        (
            "kvscope_spills",
            "Routing decisions judged spills.",
            c.spills,
        ),
        (
            "kvscope_malformed_decisions",
            "Routing decisions whose prompt length, block size and block count cannot belong together: counted, not judged.",
            c.malformed_decisions,
        ),
        (
            "kvscope_verdicts_after_own_prefill",
            "Decisions whose whole prompt the chosen worker had stored just before: most likely judged after their own prefill (clock skew).",
            c.verdicts_after_own_prefill,
        ),
        (
            "kvscope_verdicts_clock_behind",
            "Decisions whose router log lines all reached the agent at least 50 ms late: the router's clock may be behind, so they may be judged early (flagged).",
            c.verdicts_clock_behind,
        ),
        (
            "kvscope_verdicts_judged_before_event",
            "Verdicts found judged before a KV event they depend on (stamped earlier by its engine, applied after them): flagged.",
            c.verdicts_judged_before_event,
        ),
        (
            "kvscope_request_ends",
            "Requests' ends read from Dynamo's request trace (the what-if's router model times each worker's load by them).",
            c.request_ends,
        ),
        (
            "kvscope_router_views",
            "The router's logged views of its choices (route request completed: overlap_blocks), read.",
            c.router_views,
        ),
        (
            "kvscope_router_views_unjoined",
            "Router views not compared: for another worker than the judged decision's, a second view of one, or one that waited a minute for a decision that never came.",
            c.router_views_unjoined,
        ),
        (
            "kvscope_duplicate_decisions",
            "Decisions for a request id already judged: counted, not judged again.",
            c.duplicate_decisions,
        ),
        (
            "kvscope_decode_legs",
            "Decode decisions of disaggregated requests whose prefill decision was judged: counted, not judged.",
            c.decode_legs,
        ),
        (
            "kvscope_decisions_for_unseen_workers",
            "Decisions for workers that never sent KV events.",
            c.decisions_for_unseen_workers,
        ),
        (
            "kvscope_decisions_fully_cached",
            "Decisions whose whole prompt was already cached on the chosen worker.",
            c.decisions_fully_cached,
        ),
        (
            "kvscope_collector_bus_missing_records",
            "Stream records gone (expired or deleted) before this collector applied them.",
            bus.missing_records,
        ),
        (
            "kvscope_collector_bus_connect_failures",
            "Attempts to connect to NATS, or to open its JetStream stream, that failed (the collector waits and tries again).",
            bus.connect_failures,
        ),
        (
            "kvscope_collector_bus_refusals",
            "Things the NATS server refused this collector (its credentials or permissions).",
            bus.nats_refusals,
        ),
        (
            "kvscope_collector_bus_pull_failures",
            "Pulls from the durable consumer that failed (retried).",
            bus.pull_failures,
        ),
        (
            "kvscope_collector_bus_stream_resets",
            "Times the stream was found made anew under its name (its server's storage wiped): the consumer made anew, the new stream followed from its first record.",
            bus.stream_resets,
        ),
        (
            "kvscope_collector_bus_stream_leader_changes",
            "Times the stream's leader was seen to move to another server of the NATS cluster (its replicas elected another: no fault, no record lost).",
            bus.stream_leader_changes,
        ),
        (
            "kvscope_collector_bus_messages_without_metadata",
            "Deliveries without JetStream metadata: skipped (a record among them is fetched by sequence once the gap shows).",
            bus.messages_without_metadata,
        ),
        (
            "kvscope_collector_bus_ack_failures",
            "Acks that failed (the record may be delivered again, and is skipped then).",
            bus.ack_failures,
        ),
        (
            "kvscope_collector_recording_flush_failures",
            "Flushes of the recording that failed (tried again at the next).",
            bus.recording_flush_failures,
        ),
    ];
    for (name, help, v) in counters {
        out.single_counter(name, help, "", v);
    }

    let t = a.totals();
    out.single_counter(
        "kvscope_prompt_tokens",
        "Prompt tokens of the routing decisions judged.",
        "",
        t.prompt_tokens,
    );
    out.single_counter(
        "kvscope_uncached_prefill_tokens",
        "Prompt tokens the chosen workers had to compute (not cached there).",
        "",
        t.uncached_prefill_tokens,
    );
    token_histogram(
        out,
        "kvscope_spill_true_delta_tokens",
        "True delta per spill: (overlap_best - overlap_chosen) x block size, what a migration would save.",
        &t.true_delta,
    );
    token_histogram(
        out,
        "kvscope_spill_upper_bound_tokens",
        "Upper bound per spill: overlap_best x block size (the fork's migratable_tokens).",
        &t.upper_bound,
    );
    out.single_counter(
        "kvscope_spill_generated_delta_tokens",
        "Part of the spills' true delta lying in decode-generated (output) blocks.",
        "",
        t.generated_delta_tokens,
    );
    out.single_counter(
        "kvscope_spill_onload_delta_tokens",
        "Part of the spills' true delta the chosen worker held in its own lower tiers (host memory, disk): onloaded, not recomputed. The rest of the true delta was recomputed.",
        "",
        t.onload_delta_tokens,
    );
    write_router_view(out, a.router_view());
    write_tier_view(out, a.tier_view());
    let m = &t.migration_log;
    let name = "kvscope_migration_log_lines";
    out.family(
        name,
        Kind::Counter,
        "The migration fork's KVMIGRATE log lines by kind (spill = KVMIGRATE_SPILL, handshake_obtained = producer handshake obtained).",
    );
    for (kind, n) in [
        ("spill", m.spill_lines),
        ("handshake_obtained", m.handshakes_obtained),
        ("dispatch_failed", m.dispatch_failures),
        ("decoding_on_target", m.decoding_on_target),
    ] {
        out.counter(name, &labels(&[("kind", kind)]), n);
    }
    out.single_counter(
        "kvscope_migration_log_spill_migratable_tokens",
        "migratable_tokens summed over the KVMIGRATE_SPILL lines.",
        "",
        m.spill_migratable_tokens,
    );

    // Per worker: bounded by the fleet (worker id, data-parallel rank).
    let worker_rows: Vec<_> = t
        .workers
        .iter()
        .map(|(w, f)| (worker_labels(w), f))
        .collect();
    for (name, help, get) in [
        (
            "kvscope_worker_decisions",
            "Routing decisions that chose this worker (its load).",
            (|f| f.decisions) as fn(&crate::fold::analyzer::WorkerTotals) -> u64,
        ),
        (
            "kvscope_worker_prompt_tokens",
            "Prompt tokens routed to this worker.",
            |f| f.prompt_tokens,
        ),
        (
            "kvscope_worker_cached_prompt_tokens",
            "Prompt tokens routed to this worker that it already had cached (its overlap).",
            |f| f.cached_prompt_tokens,
        ),
        (
            "kvscope_worker_spills_in",
            "Spills routed to this worker although another held more of the prompt.",
            |f| f.spills_in,
        ),
        (
            "kvscope_worker_spills_out",
            "Spills away from this worker although it held the most of the prompt.",
            |f| f.spills_out,
        ),
    ] {
        out.family(name, Kind::Counter, help);
        for (l, f) in &worker_rows {
            out.counter(name, l, get(f));
        }
    }
    let name = "kvscope_worker_cached_blocks";
    out.family(name, Kind::Gauge, "Blocks cached per worker in the mirror.");
    for w in a.index().workers() {
        out.gauge(name, &worker_labels(&w), a.index().cached_blocks(&w));
    }
    out.single_gauge(
        "kvscope_fleet_cached_block_pairs",
        "Cached (block, worker) pairs in the mirror.",
        "",
        a.index().cached_pairs(),
    );

    if let Some(w) = a.closed_windows().rev().find(|w| !w.summary.warmup) {
        let s = &w.summary;
        let window: [(&str, &str, f64); 6] = [
            (
                "kvscope_window_spill_ratio",
                "Spills / routed requests in the last measured window.",
                s.spill_rate.unwrap_or(0.0),
            ),
            (
                "kvscope_window_requests",
                "Routed requests in the last measured window.",
                s.requests as f64,
            ),
            (
                "kvscope_window_true_delta_tokens_per_second",
                "True-delta migratable volume of the last measured window.",
                s.true_delta_tok_per_s,
            ),
            (
                "kvscope_window_upper_bound_tokens_per_second",
                "Upper-bound migratable volume of the last measured window.",
                s.upper_bound_tok_per_s,
            ),
            (
                "kvscope_window_uncached_prefill_tokens_per_second",
                "Uncached prefill of the last measured window.",
                s.uncached_prefill_tok_per_s,
            ),
            (
                "kvscope_window_event_only_delta_tokens",
                "Event-only delta tokens in the last measured window.",
                s.event_only.delta_tokens as f64,
            ),
        ];
        for (name, help, v) in window {
            out.single_gauge(name, help, "", v);
        }
        out.single_gauge(
            "kvscope_window_end_timestamp_seconds",
            "End of the last measured window (record time, UNIX seconds).",
            "",
            s.end_ns as f64 / 1e9,
        );
    }
    out.single_gauge(
        "kvscope_windows_measured",
        "Measured (post-warm-up) windows held.",
        "",
        a.closed_windows().filter(|w| !w.summary.warmup).count(),
    );
    out.single_gauge(
        "kvscope_collector_watermark_timestamp_seconds",
        "Latest record time seen (UNIX seconds): time() minus this is the collector's lag.",
        "",
        a.watermark_ns() as f64 / 1e9,
    );
    let name = "kvscope_verdict_delay_seconds";
    let d = a.verdict_delay();
    out.family(
        name,
        Kind::Histogram,
        "Routing decision (the router's log time) to its verdict available at this collector, for decisions judged live: the router's log lag, the agent's reorder wait, the bus. Across hosts it includes their clock skew.",
    );
    kvscope_wire::nixl::write_latency_histogram(out, name, "", &d.buckets, d.count, d.sum_ns);
    out.single_gauge(
        "kvscope_collector_bus_connected",
        "1 when connected to NATS.",
        "",
        u8::from(bus.connected),
    );
    out.single_gauge(
        "kvscope_collector_bus_pending_records",
        "Records waiting in the stream for this collector.",
        "",
        bus.pending,
    );
    out.single_gauge(
        "kvscope_collector_bus_applied_sequence",
        "Stream sequence of the last applied record.",
        "",
        bus.applied_seq,
    );
    out.single_gauge(
        "kvscope_collector_bus_stream_first_sequence",
        "The stream's first record when this collector started: older ones were discarded by the stream's age and size limits, and the figures begin there.",
        "",
        bus.stream_first_seq,
    );
    out.single_gauge(
        "kvscope_collector_recording_failed",
        "1 when the recording stopped after a write error.",
        "",
        u8::from(bus.recording_failed),
    );

    // Each agent's own counters as of its last heartbeat: the fleet's pipeline health
    // from the collector alone, for agents Prometheus does not scrape.
    type AgentCounter = fn(&kvscope_wire::AgentCounters) -> u64;
    let agent_counters: [(&str, &str, AgentCounter); 12] = [
        (
            "kvscope_collector_agent_kv_decode_errors",
            "Agent (last heartbeat): undecodable KV payloads.",
            |k| k.kv_decode_errors,
        ),
        (
            "kvscope_collector_agent_kv_bad_frames",
            "Agent (last heartbeat): malformed ZMQ frames.",
            |k| k.kv_bad_frames,
        ),
        (
            "kvscope_collector_agent_kv_peer_violations",
            "Agent (last heartbeat): KV publishers dropped for breaking the protocol or a size limit.",
            |k| k.kv_peer_violations,
        ),
        (
            "kvscope_collector_agent_log_lines_too_long",
            "Agent (last heartbeat): router log lines past max_line_bytes, skipped.",
            |k| k.log_lines_too_long,
        ),
        (
            "kvscope_collector_agent_records_set_aside",
            "Agent (last heartbeat): records JetStream refused, set aside.",
            |k| k.records_set_aside,
        ),
        (
            "kvscope_collector_agent_kv_unknown_events",
            "Agent (last heartbeat): KV events of unknown type.",
            |k| k.kv_unknown_events,
        ),
        (
            "kvscope_collector_agent_kv_malformed_events",
            "Agent (last heartbeat): malformed KV events.",
            |k| k.kv_malformed_events,
        ),
        (
            "kvscope_collector_agent_kv_sequence_gaps",
            "Agent (last heartbeat): gaps in publisher sequence numbers.",
            |k| k.kv_sequence_gaps,
        ),
        (
            "kvscope_collector_agent_log_malformed_lines",
            "Agent (last heartbeat): router log lines that failed to parse.",
            |k| k.log_malformed_lines,
        ),
        (
            "kvscope_collector_agent_decisions_unjoined",
            "Agent (last heartbeat): routing inputs never joined with a selection.",
            |k| k.decisions_unjoined,
        ),
        (
            "kvscope_collector_agent_publish_dropped",
            "Agent (last heartbeat): records dropped while NATS was away.",
            |k| k.publish_dropped,
        ),
        (
            "kvscope_collector_agent_records_late",
            "Agent (last heartbeat): records later than its reorder window.",
            |k| k.records_late,
        ),
    ];
    for (name, help, get) in agent_counters {
        out.family(name, Kind::Counter, help);
        for (id, st) in a.agents() {
            out.counter(name, &labels(&[("agent", id)]), get(&st.heartbeat.counters));
        }
    }
    let name = "kvscope_collector_agent_buffered_records";
    out.family(
        name,
        Kind::Gauge,
        "Agent (last heartbeat): records waiting in its local buffer.",
    );
    for (id, st) in a.agents() {
        out.gauge(name, &labels(&[("agent", id)]), st.heartbeat.buffered);
    }
    let name = "kvscope_collector_agent_last_seen_timestamp_seconds";
    out.family(
        name,
        Kind::Gauge,
        "Agent: time of its last heartbeat or report (UNIX seconds).",
    );
    for (id, st) in a.agents() {
        out.gauge(
            name,
            &labels(&[("agent", id)]),
            st.last_seen_ns as f64 / 1e9,
        );
    }
    type ModelFigure = fn(&kvscope_wire::api::window::ModelFigures) -> u64;
    let per_model: [(&str, &str, ModelFigure); 6] = [
        (
            "kvscope_model_decisions",
            "Routing decisions judged, by model.",
            |m| m.requests,
        ),
        ("kvscope_model_spills", "Spills, by model.", |m| m.spills),
        (
            "kvscope_model_prompt_tokens",
            "Prompt tokens of judged decisions, by model.",
            |m| m.isl_tokens,
        ),
        (
            "kvscope_model_uncached_prefill_tokens",
            "Prompt tokens not cached on the chosen worker, by model.",
            |m| m.uncached_prefill_tokens,
        ),
        (
            "kvscope_model_true_delta_tokens",
            "Σ true delta over spills (best − chosen overlap among the model's workers), by model.",
            |m| m.true_delta_tokens,
        ),
        (
            "kvscope_model_upper_bound_tokens",
            "Σ upper bound (best overlap) over spills, by model.",
            |m| m.upper_bound_tokens,
        ),
    ];
    for (name, help, get) in per_model {
        out.family(name, Kind::Counter, help);
        for (model, m) in &a.totals().models {
            out.counter(name, &labels(&[("model", model)]), get(m));
        }
    }
    // Per tenant, the label bounded: the first tenants with a spill by name (never
    // changed, so each series stays a counter), every other salted tenant as `_other`,
    // requests with no salt known as `_none`.
    let tenants = &a.totals().tenants;
    let others = tenants.all_but(&tenants.metric_tenants);
    let per_tenant: [(&str, &str, ModelFigure); 3] = [
        (
            "kvscope_tenant_decisions",
            "Routing decisions judged, by tenant (a request field the agent was told to read, else the cache salt of the request's first block).",
            |m| m.requests,
        ),
        ("kvscope_tenant_spills", "Spills, by tenant.", |m| m.spills),
        (
            "kvscope_tenant_true_delta_tokens",
            "Σ true delta over spills, by tenant.",
            |m| m.true_delta_tokens,
        ),
    ];
    for (name, help, get) in per_tenant {
        out.family(name, Kind::Counter, help);
        for t in &tenants.metric_tenants {
            if let Some(m) = tenants.tenants.get(t) {
                out.counter(name, &labels(&[("tenant", t)]), get(m));
            }
        }
        out.counter(name, &labels(&[("tenant", "_other")]), get(&others));
        out.counter(
            name,
            &labels(&[("tenant", "_none")]),
            get(&tenants.unsalted),
        );
    }
    super::nixl_metrics::render(out, &crate::fold::nixl::pairs(a.agents()));
    super::nixl_metrics::render_owners(out, &crate::fold::nixl::owners(a.agents()));
}

/// A token histogram, each bucket with its latest spill's trace as an exemplar (in
/// OpenMetrics, which Prometheus asks for).
fn token_histogram(out: &mut Exposition, name: &str, help: &str, h: &TokenHistogram) {
    let exemplars: Vec<Option<(String, f64, f64)>> = h
        .exemplars
        .iter()
        .map(|e| {
            e.as_ref().map(|e| {
                (
                    labels(&[("trace_id", &e.trace_id)]),
                    e.value as f64,
                    e.at_ns as f64 / 1e9,
                )
            })
        })
        .collect();
    out.family(name, Kind::Histogram, help)
        .histogram_with_exemplars(
            name,
            "",
            TOKEN_BOUNDS.iter().map(|le| *le as f64),
            &h.buckets,
            h.count,
            h.sum as f64,
            &exemplars,
        );
}

fn worker_labels(w: &kvscope_wire::WorkerKey) -> String {
    labels(&[
        ("worker_id", &w.worker_id.to_string()),
        ("dp_rank", &w.dp_rank.to_string()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fold::analyzer::AnalyzerConfig;
    use crate::fold::fixtures::{decision, env, stored, stored_under};
    use kvscope_wire::SequenceStatus;

    #[test]
    fn a_spill_is_in_the_histograms_with_its_trace_as_exemplar() {
        let mut a = FleetAnalyzer::new(AnalyzerConfig {
            window_secs: 1.0,
            warmup_secs: 1.0,
            ..Default::default()
        });
        // Turn 1 on worker 1: the prompt's 2 blocks and 1 output block; turn 2 (prompt +
        // output + new text) on worker 2, a 3-block spill.
        let prompt: Vec<u32> = (0..4).collect();
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
        let turn2: Vec<u32> = prompt
            .iter()
            .chain(&output)
            .copied()
            .chain([7, 8])
            .collect();
        let v = a.apply(&env(4, decision("t2", 2, &turn2))).unwrap();
        assert_eq!((v.spill, v.true_delta_tokens), (true, 6));

        let mut out = Exposition::new(Format::OpenMetrics);
        write(&mut out, &a, &BusStatus::default());
        let text = out.finish();
        // The spill's bucket carries it as an exemplar: the trace of its verdict span.
        let trace = kvscope_wire::trace_ids::trace_id_hex("t2");
        let bucket = format!(
            "kvscope_spill_true_delta_tokens_bucket{{le=\"16\"}} 1 # {{trace_id=\"{trace}\"}} 6 "
        );
        assert!(text.contains(&bucket), "{bucket} in\n{text}");
        assert_eq!(
            text.matches(" # {trace_id=").count(),
            2,
            "one per histogram"
        );
        for line in [
            "kvscope_spill_true_delta_tokens_bucket{le=\"32\"} 1\n",
            "kvscope_spill_true_delta_tokens_sum 6\n",
            "kvscope_worker_spills_in_total{worker_id=\"2\",dp_rank=\"0\"} 1\n",
            "kvscope_prompt_tokens_total 12\n",
            // No salt on these stores: every decision is the unsalted tenant's.
            "kvscope_tenant_decisions_total{tenant=\"_none\"} 2\n",
            "kvscope_tenant_spills_total{tenant=\"_none\"} 1\n",
            "kvscope_tenant_spills_total{tenant=\"_other\"} 0\n",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
    }
}
