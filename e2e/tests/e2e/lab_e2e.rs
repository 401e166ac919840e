//! The whole pipeline on the real lab: Dynamo 1.6.1's KV router with 3 mocker workers,
//! a bounded chat workload that makes it spill, `kvscope agent` → NATS JetStream →
//! `kvscope collector`, with the collector killed (SIGKILL) and restarted mid-run.
//!
//! Asserts: every request the workload sent appears as a joined routing decision; for
//! every decision the collector's per-worker overlaps equal those of `dynamo-kv-router`
//! 1.6.1's own radix tree fed the same events in the same order; spills happen; the true
//! delta never exceeds the upper bound; the live report after the restart equals a
//! replay of the recording (in process and through `kvscope collector report --replay`)
//! and has at least 6 measured windows.

use kvscope_e2e::oracle;

use kvscope_collector::fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_collector::report::{OpportunityReport, ReportStatus};
use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::LabConfig;
use kvscope_wire::Record;
use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

const WINDOW_SECS: f64 = 4.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lab_fleet_end_to_end_with_a_collector_crash() {
    // Spills from load alone vary from run to run on a small machine (0 to 35 in 500
    // requests were seen here); a little softmax temperature in the router's choice (a
    // setting real deployments use to spread load) makes them certain, and Dynamo's own
    // counters below still say exactly how much cached prefix the router passed over.
    let lab = LabConfig {
        workers: 3,
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        ..LabConfig::default()
    };
    let gpu_blocks = lab.num_gpu_blocks;
    let exe = kvscope_e2e::kvscope();
    let mut run = kvscope_e2e::fleet(FleetRunConfig::new(lab, WINDOW_SECS))
        .await
        .expect("lab, agent and collector start");
    let wl = WorkloadConfig {
        frontend: run.lab().frontend_url().to_string(),
        // Three families over three workers and enough concurrency that the router's
        // load term sometimes beats the cache. Bounded by time, not by turns, so the
        // run covers ≥ 6 windows after the warm-up however fast the machine is.
        sessions: 48,
        families: 3,
        max_turns: 40,
        concurrency: 32,
        rate: Some(20.0),
        duration_secs: 36.0,
        ..WorkloadConfig::default()
    };
    let workload = tokio::spawn(workload::run(wl));
    tokio::time::sleep(Duration::from_secs(12)).await;
    run.kill_collector();
    tokio::time::sleep(Duration::from_secs(3)).await;
    run.restart_collector()
        .await
        .expect("the collector restarts");
    let summary = workload.await.unwrap().expect("the workload runs");
    assert_eq!(summary.failed, 0, "every workload request succeeds");
    assert!(
        summary.ok >= 100,
        "a real workload ran: {} requests",
        summary.ok
    );

    // Stop the agent so the stream stops growing, let the collector apply all of it.
    run.stop_agent().await;
    run.wait_drained(Duration::from_secs(1), Duration::from_secs(60))
        .await
        .expect("the collector catches up");
    let live = run.report().await.expect("the live report");
    let live_whatif: serde_json::Value = run
        .get_json(
            "/api/whatif?reserve=0,0.5&kv_bytes_per_token=256&gate=16,1024\
             &nixl_bandwidth_gbps=10&handshake_ms=0.1&dispatch_overhead_ms=0",
        )
        .await
        .expect("the live what-if");
    let live_summary: serde_json::Value = run
        .get_json("/api/summary")
        .await
        .expect("the live summary");
    // Each served verdict carries the router's view of its choice (every route ended).
    let served: Vec<kvscope_wire::api::verdict::SpillVerdict> = run
        .get_json("/api/verdicts?limit=50")
        .await
        .expect("the live verdicts");
    assert!(!served.is_empty());
    assert!(
        served.iter().all(|v| v.router_overlap_blocks.is_some()),
        "a served verdict without the router's view"
    );
    let router_log = run.lab().router_log().to_path_buf();
    let recording = run.recording.clone();
    let agent_recording = run.agent_recording.clone();
    run.stop();

    // Nothing lost or reordered between the agent and the collector, across the crash.
    let rec = kvscope_e2e::applied_as_published(&agent_recording, &recording);

    // Every request the workload sent shows up as a joined decision.
    let decided: HashSet<&str> = rec
        .envelopes
        .iter()
        .filter_map(|e| match &e.record {
            Record::Decision(d) => Some(d.request_id.as_str()),
            _ => None,
        })
        .collect();
    let missing: Vec<_> = summary
        .requests
        .iter()
        .filter_map(|r| r.router_request_id.as_deref())
        .filter(|id| !decided.contains(id))
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} requests have no joined decision, e.g. {:?}",
        missing.len(),
        summary.ok,
        &missing[..missing.len().min(3)]
    );

    // The collector's overlaps equal dynamo-kv-router's, decision by decision.
    let cfg = AnalyzerConfig {
        window_secs: WINDOW_SECS,
        warmup_secs: WINDOW_SECS,
        ..AnalyzerConfig::default()
    };
    let mut analyzer = FleetAnalyzer::new(cfg.clone());
    let verdicts: Vec<_> = rec
        .envelopes
        .iter()
        .filter_map(|e| analyzer.apply(e))
        .collect();
    oracle::assert_overlaps_equal(&verdicts, &rec.envelopes);
    assert!(
        verdicts.iter().any(|v| !v.overlaps.is_empty()),
        "some requests hit a cached prefix"
    );

    // The router's view of each choice against the engines' truth, counted from the
    // router's own log and the radix tree's overlaps: the live collector's audit (rebuilt
    // after its SIGKILL) is the same count, and every decision has its view.
    let (want, _) = kvscope_e2e::router_view::count(
        &std::fs::read_to_string(&router_log).unwrap(),
        &verdicts,
        &rec.envelopes,
    );
    let audit: kvscope_wire::api::summary::RouterViewAudit =
        serde_json::from_value(live_summary["router_view"].clone()).unwrap();
    eprintln!("router view: {audit:?}");
    assert_eq!(audit, want);
    assert_eq!(
        want.compared as usize,
        verdicts.len(),
        "every decision has its view"
    );

    // The what-if with nothing changed is the recorded run: per request, the overlap on
    // its chosen worker just checked against Dynamo's radix tree; in all, its prompt and
    // uncached prefill tokens; `kvscope whatif` prints the same totals.
    let w = kvscope_collector::whatif::WhatIf::from_recording(&recording, cfg).unwrap();
    assert_eq!(w.requests().len(), verdicts.len());
    for (r, v) in w.requests().iter().zip(&verdicts) {
        assert_eq!(
            (r.request_id.as_str(), r.worker, r.recorded_overlap_blocks),
            (v.request_id.as_str(), v.chosen, v.chosen_overlap_blocks)
        );
    }
    let prompt: u64 = verdicts.iter().map(|v| v.isl_tokens).sum();
    let uncached: u64 = verdicts.iter().map(|v| v.uncached_prefill_tokens).sum();
    let c = w.capacity(Some(gpu_blocks as u64), &[0.0, 0.5]).unwrap();
    assert_eq!(
        (c.recorded.prompt_tokens, c.recorded.uncached_prefill_tokens),
        (prompt, uncached)
    );
    assert!(
        c.rows[1].totals.uncached_prefill_tokens >= c.rows[0].totals.uncached_prefill_tokens,
        "half the cache never prefills less: {c:?}"
    );
    let out = kvscope_e2e::succeeded(
        Command::new(&exe)
            // Each worker's size from the recording's discovery records.
            .args([
                "whatif",
                "--format",
                "json",
                "--reserve",
                "0,0.5",
                // Migration priced so that every spill pays (no NIXL in this lab).
                "--kv-bytes-per-token",
                "256",
                "--gate",
                "16,1024",
                "--nixl-bandwidth-gbps",
                "10",
                "--handshake-ms",
                "0.1",
                "--dispatch-overhead-ms",
                "0",
                "--replay",
            ])
            .arg(&recording),
    );
    let cli: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        cli["capacity"]["recorded"]["uncached_prefill_tokens"],
        uncached
    );
    assert_eq!(
        live_whatif, cli,
        "the live collector's /api/whatif is the what-if on its recording"
    );
    assert_eq!(
        cli["capacity"]["rows"][1]["blocks_per_worker"],
        gpu_blocks / 2
    );
    // Migration with nothing else changed moves exactly the recorded spills' true deltas
    // over each gate.
    for (i, gate) in [16u64, 1024].into_iter().enumerate() {
        let over: Vec<_> = verdicts
            .iter()
            .filter(|v| v.spill && v.true_delta_tokens >= gate)
            .collect();
        let g = &cli["migration"]["recorded_gates"][i];
        assert_eq!(g["gate_tokens"], gate);
        assert_eq!(g["spills_over_gate"], over.len(), "{g}");
        assert_eq!(
            g["migrations"],
            over.len(),
            "every spill pays at this price: {g}"
        );
        let tokens: u64 = over.iter().map(|v| v.true_delta_tokens).sum();
        assert_eq!(g["migrated_tokens"], tokens);
        assert_eq!(g["bytes"], tokens * 256);
    }
    assert!(
        cli["migration"]["recorded_gates"][0]["migrations"].as_u64() > Some(0),
        "the lab spills"
    );

    // Every turn adds new text, so no decision may find its whole prompt cached on the
    // chosen worker: one that does was applied after its own prefill's KV events.
    assert_eq!(
        analyzer.counters().decisions_fully_cached,
        0,
        "decisions applied in event-time order"
    );

    // Spills, and the true delta within the upper bound everywhere.
    let spills = verdicts.iter().filter(|v| v.spill).count();
    let kvscope_delta: u64 = verdicts.iter().map(|v| v.true_delta_tokens).sum();
    eprintln!(
        "lab run: {} requests, {} decisions, {} spills, {} records; Σ true delta {} tokens; \
         Dynamo's own router counters (best − selected cached prefix): {:?} tokens",
        summary.ok,
        verdicts.len(),
        spills,
        rec.envelopes.len(),
        kvscope_delta,
        summary.router_spilled_cached_tokens
    );
    assert!(spills > 0, "the lab workload makes the router spill");
    // Dynamo's router counts, per decision, the cached prefix of the best eligible worker
    // minus the selected one's: the same sum from its own index. kvscope measures it
    // from the engines' events alone, in event-time order. The router applies the same
    // events a little later than they happen (they cross its event plane while it is
    // busy routing), so it may decide before seeing a block kvscope orders before the
    // decision, or its log line may carry a time a little before the decision it logs.
    // Its figure must lie within what kvscope measures if the router's view is off the
    // log time by −10 to +50 ms, decision by decision (that band, not a percentage: it
    // was exact here, idle and under CPU load, and 2.4% low once in CI).
    let router = summary
        .router_spilled_cached_tokens
        .expect("the frontend's router counters") as u64;
    let lags_ms = [0i64, -10, 10, 25, 50];
    let by_lag: Vec<Vec<u64>> = lags_ms
        .iter()
        .map(|&ms| {
            oracle::true_delta_with_router_lag(
                &rec.envelopes,
                ms * 1_000_000,
                AnalyzerConfig {
                    window_secs: WINDOW_SECS,
                    warmup_secs: WINDOW_SECS,
                    ..AnalyzerConfig::default()
                },
            )
        })
        .collect();
    assert!(
        by_lag[0]
            == verdicts
                .iter()
                .map(|v| v.true_delta_tokens)
                .collect::<Vec<_>>(),
        "with no lag the re-ordered replay is the recording's order"
    );
    let low: u64 = (0..verdicts.len())
        .map(|i| by_lag.iter().map(|d| d[i]).min().unwrap())
        .sum();
    let high: u64 = (0..verdicts.len())
        .map(|i| by_lag.iter().map(|d| d[i]).max().unwrap())
        .sum();
    let sums: Vec<u64> = by_lag.iter().map(|d| d.iter().sum()).collect();
    eprintln!(
        "Σ true delta if the router lags by {lags_ms:?} ms: {sums:?}; band [{low}, {high}]; \
         Dynamo: {router}"
    );
    // A block's worth of slack per side for a decision made between two log lines.
    let slack = 16;
    assert!(
        low.saturating_sub(slack) <= router && router <= high + slack,
        "kvscope's Σ true delta {kvscope_delta} (band [{low}, {high}] for a router lagging \
         −10 to +50 ms) vs Dynamo's own best − selected {router} tokens"
    );
    for v in &verdicts {
        assert!(
            v.true_delta_tokens <= v.upper_bound_tokens,
            "{}: true delta above the upper bound",
            v.request_id
        );
    }

    // Live figures after the crash equal a replay; the report is ready.
    let replayed = OpportunityReport::from_analyzer(&analyzer);
    assert_eq!(
        serde_json::to_value(&live).unwrap(),
        serde_json::to_value(&replayed).unwrap(),
        "live report vs replay of the recording"
    );
    assert_eq!(
        live.status,
        ReportStatus::Ready,
        "≥ 6 measured windows: {:?}",
        live.status
    );
    assert!(live.windows_measured >= 6);
    assert!(live.spills > 0, "spills inside the measured windows");
    let out = kvscope_e2e::succeeded(
        Command::new(&exe)
            .args([
                "collector",
                "--window-secs",
                &WINDOW_SECS.to_string(),
                "--warmup-secs",
                &WINDOW_SECS.to_string(),
            ])
            .args(["report", "--format", "json", "--replay"])
            .arg(&recording),
    );
    let mut cli: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // The report of a recording ends with its what-if; the live report has none.
    let whatif = cli.as_object_mut().unwrap().remove("whatif");
    assert!(
        whatif.is_some_and(|w| w["capacity"]["rows"]
            .as_array()
            .is_some_and(|r| !r.is_empty())),
        "the report's what-if"
    );
    assert_eq!(
        cli,
        serde_json::to_value(&live).unwrap(),
        "kvscope collector report --replay reproduces the live figures"
    );
    let md = live.to_markdown();
    assert!(md.contains("true delta") && md.contains("## Windows"));
}
