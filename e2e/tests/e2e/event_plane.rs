//! kvscope on a Dynamo fleet with nothing wired by hand: the lab with etcd discovery (a
//! real etcd on loopback) and Dynamo's own event plane, ZMQ in one test and NATS in the
//! other; `kvscope agent` is given only what a Dynamo pod has — `DYN_DISCOVERY_BACKEND`,
//! `ETCD_ENDPOINTS`, `NATS_SERVER` — and the router's log. No worker id, no publisher
//! address.
//!
//! Asserts, on each shape: the agent found every worker (with its model and block
//! size) and read every KV event from the event plane; every request the workload sent
//! is a joined decision; and each decision's per-worker overlaps equal those of
//! `dynamo-kv-router` 1.6.1's radix tree fed the same events, exactly. In the ZMQ run a
//! mocker is stopped and started again mid-run: its old id is retired (its mirror
//! dropped, no verdict names it afterwards) and the new one followed.

use kvscope_e2e::oracle;

use kvscope_collector::fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_fleet::fleet_run::{FleetRunConfig, KvSource};
use kvscope_lab::workload;
use kvscope_lab::{LabConfig, LabDiscovery, LabEventPlane};
use kvscope_wire::recording::read_recording;
use kvscope_wire::{KvOrigin, Record, WorkerState};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

const WINDOW_SECS: f64 = 4.0;

async fn run_shape(event_plane: LabEventPlane, restart_a_worker: bool) {
    let lab = LabConfig {
        workers: 3,
        discovery: LabDiscovery::Etcd,
        event_plane,
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        ..LabConfig::default()
    };
    let mut run = kvscope_e2e::fleet(FleetRunConfig {
        kv_source: KvSource::EventPlane,
        ..FleetRunConfig::new(lab, WINDOW_SECS)
    })
    .await
    .expect("lab (etcd discovery), agent and collector start");
    let first_ids: BTreeSet<u64> = run.lab().workers().iter().map(|w| w.worker_id).collect();
    let wl = run.chat_workload(if restart_a_worker { 24.0 } else { 16.0 });
    let workload = tokio::spawn(workload::run(wl));
    let mut retired = None;
    if restart_a_worker {
        tokio::time::sleep(Duration::from_secs(8)).await;
        let (old, new) = run
            .restart_worker(1)
            .await
            .expect("the mocker stops and starts again under a new id");
        assert_ne!(old, new);
        retired = Some(old);
    }
    let summary = workload.await.unwrap().expect("the workload runs");
    assert!(summary.ok >= 60, "{} requests", summary.ok);
    let ids = summary.router_request_ids();
    run.wait_for_decisions(ids.len() as u64, Duration::from_secs(60))
        .await
        .expect("every decision reaches the collector");
    let workers_now: BTreeSet<u64> = run.lab().workers().iter().map(|w| w.worker_id).collect();
    let recording = run.finish().await.expect("the collector catches up");

    let rec = read_recording(&recording).unwrap();
    assert!(rec.bad_lines.is_empty());
    // Every KV batch came off the event plane; the fleet came from discovery.
    let batches: Vec<_> = rec
        .envelopes
        .iter()
        .filter_map(|e| match &e.record {
            Record::KvEvents(b) => Some(b),
            _ => None,
        })
        .collect();
    assert!(!batches.is_empty());
    assert!(batches.iter().all(|b| b.origin == KvOrigin::EventPlane));
    let mut fleet: BTreeMap<u64, WorkerState> = BTreeMap::new();
    for e in &rec.envelopes {
        if let Record::Worker(w) = &e.record {
            assert_eq!(w.model.as_deref(), Some("kvscope-tiny"));
            assert_eq!(w.block_size, Some(16));
            fleet.insert(w.worker_id, w.state);
        }
    }
    let up: BTreeSet<u64> = fleet
        .iter()
        .filter(|(_, s)| **s == WorkerState::Up)
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(
        up, workers_now,
        "discovery's workers, as the agent saw them"
    );
    let decided: HashSet<&str> = rec
        .envelopes
        .iter()
        .filter_map(|e| match &e.record {
            Record::Decision(d) => Some(d.request_id.as_str()),
            _ => None,
        })
        .collect();
    let missing: Vec<&String> = ids
        .iter()
        .filter(|id| !decided.contains(id.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "{} requests without a decision",
        missing.len()
    );

    let mut analyzer = FleetAnalyzer::new(AnalyzerConfig {
        window_secs: WINDOW_SECS,
        warmup_secs: WINDOW_SECS,
        ..AnalyzerConfig::default()
    });
    let mut verdicts = Vec::new();
    let mut after_retire = Vec::new();
    let mut retired_seen = false;
    for e in &rec.envelopes {
        if let Record::Worker(w) = &e.record {
            retired_seen |= Some(w.worker_id) == retired && w.state == WorkerState::Gone;
        }
        if let Some(v) = analyzer.apply(e) {
            if retired_seen {
                after_retire.push(v.clone());
            }
            verdicts.push(v);
        }
    }
    oracle::assert_overlaps_equal(&verdicts, &rec.envelopes);
    assert!(verdicts.iter().any(|v| !v.overlaps.is_empty()));
    assert!(verdicts.iter().any(|v| v.spill), "the router spills");
    if let Some(old) = retired {
        assert!(retired_seen, "the stopped mocker's id was retired");
        assert_eq!(analyzer.counters().workers_retired, 1);
        assert!(first_ids.contains(&old) && !workers_now.contains(&old));
        assert!(!after_retire.is_empty(), "decisions after the restart");
        for v in &after_retire {
            assert!(
                v.chosen.worker_id != old
                    && v.best.worker_id != old
                    && v.overlaps.keys().all(|k| k.worker_id != old),
                "{} names the retired worker {old}",
                v.request_id
            );
        }
        let new = workers_now.difference(&first_ids).next().copied().unwrap();
        assert!(
            after_retire.iter().any(|v| v.chosen.worker_id == new),
            "the restarted mocker (now {new}) is routed to and judged"
        );
    }
    eprintln!(
        "{event_plane:?} event plane: {} decisions, {} spills, {} batches, all equal to Dynamo's indexer",
        verdicts.len(),
        verdicts.iter().filter(|v| v.spill).count(),
        batches.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_discovery_and_the_zmq_event_plane_with_a_worker_restart() {
    run_shape(LabEventPlane::Zmq, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_discovery_and_the_nats_event_plane() {
    run_shape(LabEventPlane::Nats, false).await;
}
