//! Verdicts without the router's DEBUG line: Dynamo's request trace
//! (`DYN_REQUEST_TRACE=1`), which a frontend writes at any log level, one record per
//! request when it ends, with the chosen worker and the prompt's sequence hashes.
//!
//! The lab's frontend writes both its DEBUG routing lines and the request trace. One
//! `kvscope agent` (the fleet run's, `--decisions auto`) takes decisions from the
//! routing lines; a second one, tapping the same mockers, from the trace alone
//! (`--decisions request-trace`). Asserts: the second has every request, judged
//! exactly as `dynamo-kv-router`'s tree over its own records; and it measures what the
//! first measures — the figure that says how far INFO-level verdicts are from the
//! DEBUG-line ones on the lab (printed, and bounded here).

use kvscope_e2e::oracle;

use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::bus_security::BusAgent;
use kvscope_lab::process::{stop_all, ManagedProcess};
use kvscope_lab::workload;
use kvscope_lab::LabConfig;
use kvscope_wire::api::verdict::SpillVerdict;
use kvscope_wire::recording::read_recording;
use kvscope_wire::Record;
use std::collections::BTreeMap;
use std::path::Path;

use std::time::Duration;

const WINDOW_SECS: f64 = 4.0;

fn verdicts(path: &Path) -> (Vec<SpillVerdict>, Vec<kvscope_wire::Envelope>) {
    let r = kvscope_fleet::fleet_run::replay(path, WINDOW_SECS, &[]).unwrap();
    (r.verdicts, r.envelopes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_trace_verdicts_measure_what_the_debug_lines_measure() {
    let lab = LabConfig {
        workers: 3,
        request_trace: true,
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        bus_agents: vec![
            BusAgent::new("lab-node", "lab"),
            BusAgent::new("info-node", "info"),
        ],
        ..LabConfig::default()
    };
    let run = kvscope_e2e::fleet(FleetRunConfig::new(lab, WINDOW_SECS))
        .await
        .expect("lab (request trace on), agent and collector start");
    let run_dir = run.run_dir();
    // The INFO-level agent: the same mockers, decisions from the trace only.
    let info_recording = run_dir.join("info-agent.jsonl");
    let mut cmd = run.other_agent("info-node", "info").unwrap();
    cmd.args(["--decisions", "request-trace"])
        .args(["--request-trace-window-ms", "5000", "--from-start"])
        .arg("--router-log")
        .arg(run.lab().router_log())
        .arg("--record")
        .arg(&info_recording)
        .envs(run.lab().manifest().dynamo_env());
    for w in run.lab().workers() {
        let replay = w.kv_replay_endpoint.clone().unwrap();
        cmd.arg("--kv")
            .arg(format!("{}@{replay}", w.kv_events_endpoint));
    }
    let mut info_agent =
        vec![ManagedProcess::spawn("info-agent", cmd, &run_dir.join("info-agent.log")).unwrap()];
    // Both agents subscribed before the first request.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let summary = workload::run(run.chat_workload(16.0))
        .await
        .expect("the workload runs");
    assert!(summary.ok >= 60);
    run.wait_for_decisions(summary.ok as u64, Duration::from_secs(60))
        .await
        .expect("every decision reaches the collector");
    // The trace agent holds records 5 s for late traces: give it that, then stop it.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let n = read_recording(&info_recording)
            .map(|r| {
                r.envelopes
                    .iter()
                    .filter(|e| matches!(e.record, Record::Decision(_)))
                    .count()
            })
            .unwrap_or(0);
        if n >= summary.ok {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the trace agent has {n} of {} decisions",
            summary.ok
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    stop_all(&mut info_agent, Duration::from_secs(10));
    let recording = run.finish().await.expect("the collector catches up");

    let (debug, _) = verdicts(&recording);
    let (info, info_records) = verdicts(&info_recording);
    assert_eq!(debug.len(), summary.ok);
    assert_eq!(
        info.len(),
        summary.ok,
        "every request, from the trace alone"
    );
    oracle::assert_overlaps_equal(&info, &info_records);

    let by_id: BTreeMap<&str, &SpillVerdict> =
        debug.iter().map(|v| (v.request_id.as_str(), v)).collect();
    let (mut same, mut spills_debug, mut spills_info) = (0, 0, 0);
    let (mut delta_debug, mut delta_info) = (0u64, 0u64);
    for v in &info {
        let d = by_id[v.request_id.as_str()];
        assert_eq!(
            v.chosen, d.chosen,
            "{}: the same chosen worker",
            v.request_id
        );
        same += usize::from(v.overlaps == d.overlaps);
        spills_debug += usize::from(d.spill);
        spills_info += usize::from(v.spill);
        delta_debug += d.true_delta_tokens;
        delta_info += v.true_delta_tokens;
    }
    let share = same as f64 / info.len() as f64;
    eprintln!(
        "request trace vs DEBUG lines: {same} of {} verdicts with identical overlaps ({:.1}%); \
         spills {spills_info} vs {spills_debug}; Σ true delta {delta_info} vs {delta_debug} tokens",
        info.len(),
        share * 100.0
    );
    assert!(share >= 0.9, "only {:.1}% identical", share * 100.0);
    let ratio = delta_info as f64 / delta_debug.max(1) as f64;
    assert!(
        (0.8..=1.2).contains(&ratio),
        "Σ true delta ratio {ratio:.3}"
    );
}
