//! A disaggregated fleet, nothing configured by hand: Dynamo 1.6.1's router in front of
//! 2 prefill and 2 decode mockers (`--disaggregation-mode`), the agent and collector
//! started as for any lab. The router logs two decisions per request under one request
//! id, the prefill worker's first, then the decode worker's.
//!
//! Asserts: every request's prefill decision is judged and its decode decision counted
//! as its decode leg (no duplicate); every verdict chooses and finds its best among the
//! prefill workers; the spills' Σ true delta equals Dynamo's own router counters (best −
//! selected cached prefix tokens) over the run. The router logs its routing lines and
//! the worker it passed over (`ROUTING_INPUT_DYN_LOG`, `ROUTER_SCORES_DYN_LOG`): the
//! router-view audit, the best worker's view included, equals the count from its log and
//! the radix tree; every passed-over line goes with its view. Needs the lab
//! (`scripts/setup`).

use kvscope_agent::internal_events::{ROUTER_SCORES_DYN_LOG, ROUTING_INPUT_DYN_LOG};
use kvscope_fleet::fleet_run::{replay, FleetRunConfig};
use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::LabConfig;
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::Duration;

const WINDOW_SECS: f64 = 4.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_decisions_are_judged_on_the_prefill_pool() {
    let lab = LabConfig {
        workers: 2,
        prefill_workers: 2,
        frontend_args: vec!["--router-temperature".into(), "0.5".into()],
        frontend_log_filter: format!("{ROUTING_INPUT_DYN_LOG},{ROUTER_SCORES_DYN_LOG}"),
        ..LabConfig::default()
    };
    let run = kvscope_e2e::fleet(FleetRunConfig::new(lab, WINDOW_SECS))
        .await
        .expect("a disaggregated lab, agent and collector start");
    let roles = |role: &str| -> BTreeSet<u64> {
        run.lab()
            .workers()
            .iter()
            .filter(|w| w.role.as_deref() == Some(role))
            .map(|w| w.worker_id)
            .collect()
    };
    let (prefill, decode) = (roles("prefill"), roles("decode"));
    assert_eq!((prefill.len(), decode.len()), (2, 2));
    let summary = workload::run(WorkloadConfig {
        frontend: run.lab().frontend_url().to_string(),
        sessions: 24,
        families: 3,
        max_turns: 6,
        concurrency: 16,
        rate: Some(20.0),
        duration_secs: 600.0,
        ..WorkloadConfig::default()
    })
    .await
    .expect("the workload runs");
    assert_eq!(summary.failed, 0, "every workload request succeeds");
    run.wait_drained(Duration::from_secs(1), Duration::from_secs(60))
        .await
        .expect("the collector catches up");
    let s: Value = run.summary().await.unwrap();
    let verdicts: Vec<Value> =
        kvscope_e2e::get_json(&format!("{}/api/verdicts?limit=100000", run.api())).await;
    let router_log = run.lab().router_log().to_path_buf();
    let recording = run.finish().await.expect("the run ends cleanly");

    let c = &s["counters"];
    let ok = summary.ok as u64;
    eprintln!("{ok} requests; counters {c}");
    assert_eq!(c["decisions"], ok, "one verdict per request: {c}");
    assert_eq!(c["decode_legs"], ok, "and one decode leg: {c}");
    assert_eq!(c["duplicate_decisions"], 0, "{c}");
    assert_eq!(verdicts.len() as u64, ok);
    let id = |v: &Value, k: &str| v[k]["worker_id"].as_u64().unwrap();
    for v in &verdicts {
        assert!(
            prefill.contains(&id(v, "chosen")),
            "chosen a prefill worker: {v}"
        );
        assert!(
            prefill.contains(&id(v, "best")),
            "best a prefill worker: {v}"
        );
    }
    let spills: Vec<&Value> = verdicts.iter().filter(|v| v["spill"] == true).collect();
    let delta: u64 = spills
        .iter()
        .map(|v| v["true_delta_tokens"].as_u64().unwrap())
        .sum();
    eprintln!(
        "{} spills, {delta} true-delta tokens; the router's own best − selected: {:?}",
        spills.len(),
        summary.router_spilled_cached_tokens
    );
    assert!(!spills.is_empty(), "the router spilled");
    assert_eq!(
        summary.router_spilled_cached_tokens,
        Some(delta as f64),
        "kvscope's Σ true delta = Dynamo's best − selected cached prefix tokens"
    );

    // The router's view: the fold's audit equals the count from the router's own log and
    // the radix tree, and every line naming a worker passed over went with its view.
    let replayed = replay(&recording, WINDOW_SECS, &[]).expect("the recording reads back");
    let log_text = std::fs::read_to_string(&router_log).expect("the router log");
    let passed_over = log_text
        .lines()
        .filter(|l| l.contains("Router selected a worker with lower KV cache overlap"))
        .count();
    let (views, _) =
        kvscope_e2e::router_view::count(&log_text, &replayed.verdicts, &replayed.envelopes);
    eprintln!("{passed_over} passed-over lines; the router's view {views:?}");
    assert_eq!(replayed.analyzer.router_view(), &views, "the router's view");
    assert_eq!(
        views.compared as usize,
        replayed.verdicts.len(),
        "every decision has its view"
    );
    if passed_over > 0 {
        assert!(
            views.spills_best_scored > 0,
            "a spill's view names the worker passed over: {views:?}"
        );
    }
    let counters =
        kvscope_e2e::last_agent_counters(&replayed.envelopes).expect("the agent's heartbeats");
    assert_eq!(
        counters.router_candidates_unjoined, 0,
        "every passed-over line went with its view"
    );
}
