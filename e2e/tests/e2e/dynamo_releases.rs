//! kvscope on every Dynamo release in the matrix, as a fleet of that release runs it: the
//! lab started from the release's own wheel (`kvscope-lab setup --dynamo VERSION`), its
//! mockers' own vLLM-format KV events (and replay sockets) tapped, its router's log
//! read, and each decision's per-worker overlaps compared with `dynamo-kv-router`'s radix
//! tree fed the same events, request by request.
//!
//! Which releases: `KVSCOPE_DYNAMO_RELEASES` (space-separated), by default 1.4.1 (the
//! release the migration fork is based on) and the lab's default, the newest on PyPI;
//! `scripts/dynamo-matrix` runs every release it lists and writes the table of docs/compatibility.md.
//! Releases before 1.6 have no `DYN_EVENT_PLANE_HOST`, so every release runs Dynamo's
//! event plane on the lab's NATS (the one setting all of them keep on loopback).
//!
//! Asserts, per release and per shape — the engines' taps with file discovery and the
//! router's DEBUG routing lines; Dynamo's event plane with etcd discovery; the engines'
//! taps with the router at INFO and its request trace on, decisions from the trace —
//! every request the workload sent is a joined decision, 0 events were malformed, and
//! every decision's overlaps equal the oracle's. Then, on the oldest release, the router
//! run with the newest release's `DYN_LOG` (`dynamo_kv_router=debug`, which on 1.4 and
//! 1.5 logs no `[ROUTING_INPUT]`) and no request trace: no decision is made, and the
//! agent's log says which `DYN_LOG` to set.

use kvscope_e2e::oracle;

use kvscope_agent::internal_events::{ROUTER_SCORES_DYN_LOG, ROUTING_INPUT_DYN_LOG};
use kvscope_fleet::fleet_run::{replay, FleetRunConfig, KvSource};
use kvscope_lab::release::DEFAULT_DYNAMO;
use kvscope_lab::workload;
use kvscope_lab::{LabConfig, LabDiscovery, LabEventPlane};
use kvscope_wire::recording::read_recording;
use kvscope_wire::{KvOrigin, Record};
use std::path::Path;
use std::time::Duration;

const WINDOW_SECS: f64 = 4.0;

/// The releases to run: `KVSCOPE_DYNAMO_RELEASES`, else 1.4.1 and the default.
fn releases() -> Vec<String> {
    match std::env::var("KVSCOPE_DYNAMO_RELEASES") {
        Ok(v) if !v.trim().is_empty() => v.split_whitespace().map(String::from).collect(),
        _ => vec!["1.4.1".into(), DEFAULT_DYNAMO.into()],
    }
}

fn lab(release: &str, frontend_log_filter: &str) -> LabConfig {
    let lab = LabConfig {
        dynamo: release.into(),
        workers: 3,
        event_plane: LabEventPlane::Nats,
        frontend_log_filter: frontend_log_filter.into(),
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        ..LabConfig::default()
    };
    kvscope_lab::setup::ensure_release(&lab.lab_dir, release).unwrap_or_else(|e| {
        panic!("the lab venv of Dynamo {release} (scripts/setup makes it): {e:#}")
    });
    lab
}

/// The sum of every series of `name` in a Prometheus text exposition.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// What one release and source came to, for the matrix's table.
struct Outcome {
    decisions: usize,
    requests: usize,
    spills: usize,
    batches: usize,
    /// The target the router logged `[ROUTING_INPUT]` under.
    routing_input_target: String,
    /// Decisions whose router view came, and of those the ones it got exactly right.
    views: (u64, u64),
    /// The agent's counters of what it read past or could not join, as of its last
    /// heartbeat, where not zero: `name n`.
    counted: Vec<String>,
}

/// Counters that say a source was read in part: fields left out, lines or events not
/// understood, choices never joined.
fn is_degradation(counter: &str) -> bool {
    counter.contains("left_out")
        || matches!(
            counter,
            "decisions_unjoined" | "log_malformed_lines" | "kv_unknown_events" | "kv_decode_errors"
        )
}

/// The target of the first `[ROUTING_INPUT]` line of the router's log.
fn routing_input_target(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .find(|l| l.contains("[ROUTING_INPUT]"))
        .and_then(|l| {
            // `DEBUG span:span: target: message`: the target is the first word with a
            // module path in it (the spans before it have none).
            l.split_whitespace()
                .skip_while(|w| *w != "DEBUG")
                .find(|w| w.contains("::") && w.ends_with(':'))
                .map(|w| w.trim_end_matches(':').to_string())
        })
        .unwrap_or_else(|| "none".into())
}

/// How a run reads the fleet.
#[derive(Debug, Clone, Copy)]
struct Shape {
    /// For the table.
    name: &'static str,
    kv_source: KvSource,
    discovery: LabDiscovery,
    /// Decisions from Dynamo's request trace, the router at INFO (no `[ROUTING_INPUT]`).
    request_trace: bool,
}

const SHAPES: [Shape; 3] = [
    Shape {
        name: "the engines (vLLM format), file discovery, DEBUG routing lines",
        kv_source: KvSource::EngineTaps,
        discovery: LabDiscovery::File,
        request_trace: false,
    },
    Shape {
        name: "Dynamo's event plane, etcd discovery, DEBUG routing lines",
        kv_source: KvSource::EventPlane,
        discovery: LabDiscovery::Etcd,
        request_trace: false,
    },
    Shape {
        name: "the engines (vLLM format), file discovery, request trace at INFO",
        kv_source: KvSource::EngineTaps,
        discovery: LabDiscovery::File,
        request_trace: true,
    },
];

/// One release, one shape: the workload, then every check of the module's header.
async fn exact_on(release: &str, shape: Shape) -> Outcome {
    let kv_source = shape.kv_source;
    // With the routing lines, the selector's score per worker too (1.4 and 1.5 log it;
    // 1.6 none): the router's view of the workers it passed over.
    let routing_lines = format!("{ROUTING_INPUT_DYN_LOG},{ROUTER_SCORES_DYN_LOG}");
    let mut lab = lab(
        release,
        if shape.request_trace {
            "info"
        } else {
            &routing_lines
        },
    );
    lab.discovery = shape.discovery;
    lab.request_trace = shape.request_trace;
    let run = kvscope_e2e::fleet(FleetRunConfig {
        kv_source,
        ..FleetRunConfig::new(lab, WINDOW_SECS)
    })
    .await
    .unwrap_or_else(|e| panic!("Dynamo {release}: lab, agent and collector start: {e:#}"));
    assert_eq!(run.lab().manifest().dynamo_version, release);
    let summary = workload::run(run.chat_workload(16.0))
        .await
        .expect("the workload runs");
    assert!(
        summary.ok >= 60,
        "Dynamo {release}: {} requests",
        summary.ok
    );
    let ids = summary.router_request_ids();
    assert_eq!(
        ids.len(),
        summary.ok as usize,
        "every reply names its request"
    );
    run.wait_for_decisions(ids.len() as u64, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| {
            panic!("Dynamo {release}: every decision reaches the collector: {e:#}")
        });
    run.wait_drained(Duration::from_secs(2), Duration::from_secs(30))
        .await
        .expect("the collector catches up");
    let metrics = run
        .get_text("/metrics")
        .await
        .expect("the collector's metrics");
    let router_log = run.lab().router_log().to_path_buf();
    let routing_input_target = routing_input_target(&router_log);
    let malformed = metric_sum(
        &metrics,
        "kvscope_collector_agent_kv_malformed_events_total",
    );
    let recording = run.finish().await.expect("the collector stops");

    assert_eq!(
        malformed, 0.0,
        "Dynamo {release} {kv_source:?}: malformed KV events"
    );
    let replayed = replay(&recording, WINDOW_SECS, &[]).expect("the recording reads back");
    let verdicts = &replayed.verdicts;
    let batches = replayed
        .envelopes
        .iter()
        .filter(|e| match &e.record {
            Record::KvEvents(b) => {
                let want = match kv_source {
                    KvSource::EventPlane => KvOrigin::EventPlane,
                    _ => KvOrigin::Engine,
                };
                assert_eq!(b.origin, want, "Dynamo {release}: a batch from elsewhere");
                true
            }
            _ => false,
        })
        .count();
    assert!(batches > 0, "Dynamo {release} {kv_source:?}: no KV events");
    assert_eq!(
        replayed.undecided(&ids),
        Vec::<&str>::new(),
        "Dynamo {release}: requests without a decision"
    );
    oracle::assert_overlaps_equal(verdicts, &replayed.envelopes);
    assert!(verdicts.iter().any(|v| !v.overlaps.is_empty()));
    // The router's view, where this release logs it at this level (1.6 at INFO as each
    // route ends, 1.4/1.5 at DEBUG as it chooses): the audit is the count from its log and
    // the radix tree, and every decision has its view.
    let log_text = std::fs::read_to_string(&router_log).unwrap_or_default();
    let (views, view_lines) =
        kvscope_e2e::router_view::count(&log_text, verdicts, &replayed.envelopes);
    eprintln!(
        "Dynamo {release} ({}): the router's view {views:?}",
        shape.name
    );
    assert_eq!(
        replayed.analyzer.router_view(),
        &views,
        "Dynamo {release} ({}): the router's view",
        shape.name
    );
    if view_lines > 0 {
        assert_eq!(
            views.compared as usize,
            verdicts.len(),
            "Dynamo {release} ({}): every decision has its view",
            shape.name
        );
    }
    // Where the router scored each worker in its log, every spill's view carries its
    // score of the best worker (the count above from the log itself, the fold's equal).
    if log_text.contains("Formula for worker_id=") {
        assert_eq!(
            views.spills_best_scored, views.spills,
            "Dynamo {release} ({}): every spill's view has the best worker's score",
            shape.name
        );
    }
    let counters =
        kvscope_e2e::last_agent_counters(&replayed.envelopes).expect("the agent's heartbeats");
    assert_eq!(
        counters.router_candidates_unjoined, 0,
        "Dynamo {release} ({}): every score line went with its view",
        shape.name
    );
    let counted = serde_json::to_value(&counters)
        .unwrap()
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, v)| is_degradation(k) && v.as_u64().is_some_and(|n| n > 0))
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    Outcome {
        decisions: verdicts.len(),
        requests: ids.len(),
        spills: verdicts.iter().filter(|v| v.spill).count(),
        batches,
        routing_input_target,
        views: (views.compared, views.exact),
        counted,
    }
}

/// The oldest release's router at the newest release's `DYN_LOG`: no `[ROUTING_INPUT]`.
async fn wrong_log_settings_are_named(release: &str) {
    let newest = LabConfig::default().frontend_log_filter;
    let run = kvscope_e2e::fleet(FleetRunConfig::new(lab(release, &newest), WINDOW_SECS))
        .await
        .unwrap_or_else(|e| panic!("Dynamo {release}: lab, agent and collector start: {e:#}"));
    let summary = workload::run(run.chat_workload(4.0))
        .await
        .expect("the workload runs");
    assert!(summary.ok > 0);
    let agent_log = run.run_dir().join("agent.log");
    let said = async {
        loop {
            let text = std::fs::read_to_string(&agent_log).unwrap_or_default();
            if text.contains(&format!("DYN_LOG={ROUTING_INPUT_DYN_LOG}")) {
                return text;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), said)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "Dynamo {release} at DYN_LOG={newest}: the agent never said what to set; see {}",
                agent_log.display()
            )
        });
    let recording = run.finish().await.expect("the collector stops");
    let rec = read_recording(&recording).unwrap();
    assert!(
        !rec.envelopes
            .iter()
            .any(|e| matches!(e.record, Record::Decision(_))),
        "Dynamo {release} at DYN_LOG={newest} logs no routing input, yet decisions came"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_release_in_the_matrix_read_exactly() {
    let releases = releases();
    // The table `scripts/dynamo-matrix` prints (a release that fails stops the test, so
    // every row printed is exact).
    println!("| Dynamo | read from | [ROUTING_INPUT] logged by | decisions | counted, not carried | result |");
    println!("|---|---|---|---|---|---|");
    for release in &releases {
        for shape in SHAPES {
            let o = exact_on(release, shape).await;
            eprintln!(
                "Dynamo {release}, {}: {} decisions, {} spills, {} KV batches, 0 malformed, \
                 every overlap equal to Dynamo's indexer; the router's view of {} decisions, \
                 {} of them exact",
                shape.name, o.decisions, o.spills, o.batches, o.views.0, o.views.1
            );
            println!(
                "| {release} | {} | {} | {} of {} requests | {} | exact |",
                shape.name,
                if shape.request_trace {
                    "(at INFO: none)".to_string()
                } else {
                    format!("`{}`", o.routing_input_target)
                },
                o.requests,
                o.requests,
                if o.counted.is_empty() {
                    "none".to_string()
                } else {
                    o.counted.join(", ")
                }
            );
        }
    }
    let number = |v: &str| -> Vec<u32> { v.split('.').map(|n| n.parse().unwrap_or(0)).collect() };
    let oldest = releases
        .iter()
        .min_by_key(|v| number(v))
        .expect("at least one release");
    if number(oldest) < vec![1, 6] {
        wrong_log_settings_are_named(oldest).await;
    }
}
