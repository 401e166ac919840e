//! Clock skew between the router's host and the engines': the lab's frontend runs with
//! its wall clock 100 ms ahead of the host's, then 100 ms behind (libfaketime), while
//! the mockers and the agent keep the host's.
//!
//! The router's own figure is the reference here: at each choice Dynamo logs the chosen
//! worker's overlap from its own indexer (`overlap_blocks` on the `route request
//! completed` line), which no clock of kvscope's touches. Asserts:
//!
//! - **ahead** (the case that used to put decisions after their own prefill): the agent
//!   estimates the offset within 10 ms, moves the log's stamps back (counted), and the
//!   verdicts' chosen overlaps equal the router's as often as with no skew at all;
//! - **behind** (not correctable: it looks like slow delivery): the agent shows a lag
//!   floor of about 100 ms, flags every decision once it has seen a few lines, and the
//!   collector counts the flagged verdicts as data faults of their windows;
//! - both ways, every request is a joined decision and the overlaps equal
//!   `dynamo-kv-router`'s tree fed the same records.

use kvscope_e2e::oracle;

use kvscope_collector::report::OpportunityReport;
use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::workload;
use kvscope_lab::LabConfig;
use kvscope_wire::{AgentCounters, Record};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

const WINDOW_SECS: f64 = 4.0;

/// Per router request id, the chosen worker's overlap as the router's indexer had it.
fn router_overlaps(log: &Path) -> HashMap<String, u32> {
    let text = std::fs::read_to_string(log).expect("the frontend log");
    let mut out = HashMap::new();
    for line in text.lines() {
        let Some(at) = line.find(" overlap_blocks=") else {
            continue;
        };
        if !line.contains("route request completed") {
            continue;
        }
        // The router's request id is the last one before the overlap (the first is the
        // HTTP request's).
        let Some(id_at) = line[..at].rfind("request_id=") else {
            continue;
        };
        let id = line[id_at + 11..at]
            .split_whitespace()
            .next()
            .unwrap()
            .trim_matches('"');
        let n = line[at + 16..].split_whitespace().next().unwrap();
        out.insert(id.to_string(), n.parse().unwrap());
    }
    out
}

struct Skewed {
    /// The agent's `/metrics` for the router log: estimated offset, lag floor (s).
    ahead_s: f64,
    lag_floor_s: f64,
    decisions: usize,
    /// Verdicts whose chosen overlap equals the router's own.
    agree: usize,
    flagged_behind: usize,
    after_own_prefill: usize,
    counters: AgentCounters,
    collector_clock_behind: u64,
    faulted_windows: usize,
    /// Measured windows with decisions, and of them those without a data fault.
    windows_with_requests: usize,
    clean_windows_with_requests: usize,
}

/// The value of `name`'s series for the router log in a Prometheus text exposition.
fn router_log_gauge(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l.contains("source=\"router_log\""))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} for the router log in:\n{text}"))
}

async fn run_skewed(offset_ms: i64) -> Skewed {
    let lab = LabConfig {
        workers: 3,
        frontend_clock_offset_ms: offset_ms,
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        ..LabConfig::default()
    };
    // Held until the agent binds it, so the lab cannot take it in between.
    let metrics_held = kvscope_lab::ports::reserve_ports(1).unwrap();
    let metrics = format!("127.0.0.1:{}", metrics_held.ports()[0]);
    let mut cfg = FleetRunConfig::new(lab, WINDOW_SECS);
    cfg.agent_env
        .push(("KVSCOPE_AGENT_METRICS_LISTEN".into(), metrics.clone()));
    let run = kvscope_e2e::fleet(cfg)
        .await
        .expect("lab (frontend clock skewed), agent and collector start");
    let summary = workload::run(run.chat_workload(14.0))
        .await
        .expect("the workload runs");
    assert_eq!(summary.failed, 0);
    assert!(summary.ok >= 60, "{} requests", summary.ok);
    run.wait_for_decisions(summary.ok as u64, Duration::from_secs(60))
        .await
        .expect("every decision reaches the collector");
    let text = reqwest::get(format!("http://{metrics}/metrics"))
        .await
        .and_then(|r| r.error_for_status())
        .expect("the agent's /metrics")
        .text()
        .await
        .unwrap();
    let ahead_s = router_log_gauge(&text, "kvscope_agent_source_clock_ahead_seconds");
    let lag_floor_s = router_log_gauge(&text, "kvscope_agent_source_lag_floor_seconds");
    let router_log = run.lab().router_log().to_path_buf();
    let recording = run.finish().await.expect("the collector catches up");

    let replayed = kvscope_fleet::fleet_run::replay(&recording, WINDOW_SECS, &[]).unwrap();
    let verdicts = &replayed.verdicts;
    assert_eq!(verdicts.len(), summary.ok, "every request, joined");
    oracle::assert_overlaps_equal(verdicts, &replayed.envelopes);

    let router = router_overlaps(&router_log);
    let agree = verdicts
        .iter()
        .filter(|v| router.get(&v.request_id) == Some(&v.chosen_overlap_blocks))
        .count();
    let counters = kvscope_e2e::last_agent_counters(&replayed.envelopes).expect("heartbeats");
    let flagged_behind = replayed
        .envelopes
        .iter()
        .filter(|e| matches!(&e.record, Record::Decision(d) if d.clock_behind_ms.is_some()))
        .count();
    let report = OpportunityReport::from_analyzer(&replayed.analyzer);
    let with_requests: Vec<_> = replayed
        .analyzer
        .closed_windows()
        .filter(|w| !w.summary.warmup && w.summary.requests > 0)
        .map(|w| w.summary.data_faults)
        .collect();
    let s = Skewed {
        ahead_s,
        lag_floor_s,
        windows_with_requests: with_requests.len(),
        clean_windows_with_requests: with_requests.iter().filter(|f| **f == 0).count(),
        decisions: verdicts.len(),
        agree,
        flagged_behind,
        after_own_prefill: verdicts.iter().filter(|v| v.after_own_prefill).count(),
        counters,
        collector_clock_behind: replayed.analyzer.counters().verdicts_clock_behind,
        faulted_windows: report.windows_with_data_faults,
    };
    eprintln!(
        "frontend clock {offset_ms:+} ms: agent estimates {:.1} ms ahead, lag floor {:.1} ms; \
         {} decisions, chosen overlap = router's for {} ({:.1}%); {} after their own \
         prefill; {} flagged clock-behind; {} records corrected; {} windows faulted",
        s.ahead_s * 1e3,
        s.lag_floor_s * 1e3,
        s.decisions,
        s.agree,
        100.0 * s.agree as f64 / s.decisions as f64,
        s.after_own_prefill,
        s.flagged_behind,
        s.counters.records_clock_corrected,
        s.faulted_windows,
    );
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_clock_ahead_is_corrected_and_one_behind_is_flagged() {
    // Ahead: corrected. The estimate is the true offset less the second smallest delay
    // with which a log line reached the agent (a 20 ms poll).
    let a = run_skewed(100).await;
    assert!(
        (0.080..=0.1005).contains(&a.ahead_s),
        "estimated {:.1} ms ahead for a 100 ms offset",
        a.ahead_s * 1e3
    );
    assert!(a.counters.records_clock_corrected >= a.decisions as u64);
    assert_eq!(
        a.flagged_behind, 0,
        "a clock ahead is not flagged as behind"
    );
    // With no skew the lab's verdicts agree with the router's own overlap every time
    // (206 of 206 measured); uncorrected, a 100 ms lead put 9 of 205 after their own
    // prefill. Allow 2% for the router's indexer, which applies events on its own
    // threads.
    assert!(
        a.agree as f64 >= 0.98 * a.decisions as f64,
        "{} of {} verdicts agree with the router",
        a.agree,
        a.decisions
    );
    assert!(
        a.after_own_prefill * 100 <= a.decisions,
        "{} after their own prefill",
        a.after_own_prefill
    );

    // Behind: shown and flagged, not corrected.
    let b = run_skewed(-100).await;
    assert_eq!(b.ahead_s, 0.0, "a clock behind is not taken for one ahead");
    assert!(
        (0.095..=0.150).contains(&b.lag_floor_s),
        "lag floor {:.1} ms for a clock 100 ms behind",
        b.lag_floor_s * 1e3
    );
    assert_eq!(b.counters.records_clock_corrected, 0);
    // Flagged once the agent has three lines of the log (the router logs several
    // before the first request).
    assert!(
        b.flagged_behind as f64 >= 0.9 * b.decisions as f64,
        "{} of {} decisions flagged",
        b.flagged_behind,
        b.decisions
    );
    assert_eq!(b.counters.decisions_clock_behind, b.flagged_behind as u64);
    assert_eq!(b.collector_clock_behind, b.flagged_behind as u64);
    assert!(b.windows_with_requests > 0);
    assert_eq!(
        b.clean_windows_with_requests, 0,
        "every measured window with flagged decisions is a faulted one"
    );
    assert!(b.faulted_windows >= b.windows_with_requests);
}
