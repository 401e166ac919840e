//! Lost KV batches, recovered or flagged: the lab's mocker 0 publishes through a relay
//! (this test, a ZMQ SUB → PUB) that drops one message in five; `kvscope agent` taps
//! the relay, and asks the mocker's own replay socket (`--zmq-replay-ports`, as vLLM's
//! `replay_endpoint`) for what it missed.
//!
//! With replay: every batch the mocker published reaches the collector exactly once —
//! the dropped ones replayed, in order — so its mirror is the engine's, verdicts equal
//! `dynamo-kv-router`'s over the same events, and the report counts the gaps as
//! recovered (replayed batches, no sequence gap, no verdict on an incomplete mirror).
//! Without replay: the gaps stay, worker 0's mirror is marked incomplete, and the
//! verdicts judged meanwhile are flagged and counted.

use kvscope_e2e::oracle;

use kvscope_collector::fold::analyzer::FleetAnalyzer;
use kvscope_collector::report::OpportunityReport;
use kvscope_fleet::fleet_run::{FleetRunConfig, KvSource, Replayed};
use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::LabConfig;
use kvscope_wire::{Record, SequenceStatus};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use zeromq::{Socket, SocketRecv, SocketSend};

const WINDOW_SECS: f64 = 4.0;

/// Relay `from` (a PUB) to a PUB bound on `to`, dropping every fifth message; counts
/// what it passed and dropped.
async fn relay(from: String, to: String, passed: Arc<AtomicU64>, dropped: Arc<AtomicU64>) {
    let mut out = zeromq::PubSocket::new();
    out.bind(&to).await.expect("the relay binds");
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&from)
        .await
        .expect("the relay reaches the mocker");
    sub.subscribe("").await.unwrap();
    let mut n = 0u64;
    while let Ok(msg) = sub.recv().await {
        n += 1;
        if n % 5 == 3 {
            dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        if out.send(msg).await.is_err() {
            return;
        }
        passed.fetch_add(1, Ordering::Relaxed);
    }
}

struct Outcome {
    analyzer: FleetAnalyzer,
    batches_of_worker0: Vec<(u64, SequenceStatus)>,
    dropped: u64,
    records: Vec<kvscope_wire::Envelope>,
    verdicts: Vec<kvscope_wire::api::verdict::SpillVerdict>,
}

async fn run_through_relay(replay: bool) -> Outcome {
    let lab = LabConfig {
        workers: 3,
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        ..LabConfig::default()
    };
    let relay_port = kvscope_lab::ports::reserve_ports(1).unwrap();
    let relay_ep = format!("tcp://127.0.0.1:{}", relay_port.ports()[0]);
    let (passed, dropped) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut worker0 = 0;
    let run = kvscope_e2e::fleet_with(
        FleetRunConfig {
            kv_source: KvSource::Given,
            ..FleetRunConfig::new(lab, WINDOW_SECS)
        },
        |lab| {
            let mut args = Vec::new();
            for (i, w) in lab.workers().iter().enumerate() {
                let replay_ep = w
                    .kv_replay_endpoint
                    .clone()
                    .expect("the lab runs replay sockets");
                let tap = if i == 0 {
                    worker0 = w.worker_id;
                    tokio::spawn(relay(
                        w.kv_events_endpoint.clone(),
                        relay_ep.clone(),
                        passed.clone(),
                        dropped.clone(),
                    ));
                    // The relay is this test's, so its worker is named here.
                    format!("{relay_ep}@{replay_ep}={}", w.worker_id)
                } else {
                    format!("{}@{replay_ep}", w.kv_events_endpoint)
                };
                args.push("--kv".to_string());
                args.push(if replay || i > 0 {
                    tap
                } else {
                    format!("{relay_ep}={}", w.worker_id)
                });
            }
            Ok(args)
        },
    )
    .await
    .expect("lab, relay, agent and collector start");
    drop(relay_port);
    let summary = workload::run(WorkloadConfig {
        frontend: run.lab().frontend_url().to_string(),
        sessions: 18,
        families: 3,
        max_turns: 30,
        concurrency: 9,
        rate: Some(12.0),
        duration_secs: 14.0,
        ..WorkloadConfig::default()
    })
    .await
    .expect("the workload runs");
    assert!(summary.ok >= 50);
    run.wait_for_decisions(summary.ok as u64, Duration::from_secs(60))
        .await
        .expect("every decision reaches the collector");
    let recording = run.finish().await.expect("the collector catches up");
    let Replayed {
        analyzer,
        verdicts,
        envelopes,
    } = kvscope_fleet::fleet_run::replay(&recording, WINDOW_SECS, &[]).unwrap();
    let batches_of_worker0 = envelopes
        .iter()
        .filter_map(|e| match &e.record {
            Record::KvEvents(b) if b.worker.worker_id == worker0 => Some((b.seq, b.sequence)),
            _ => None,
        })
        .collect();
    assert!(
        dropped.load(Ordering::Relaxed) >= 5,
        "the relay dropped messages"
    );
    Outcome {
        analyzer,
        batches_of_worker0,
        dropped: dropped.load(Ordering::Relaxed),
        records: envelopes,
        verdicts,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gaps_are_repaired_through_the_replay_socket() {
    let o = run_through_relay(true).await;
    let seqs: Vec<u64> = o.batches_of_worker0.iter().map(|(s, _)| *s).collect();
    let max = *seqs.iter().max().unwrap();
    // Every batch the mocker published up to its last, exactly once, in order (the
    // last dropped message may have had no successor to reveal it).
    assert_eq!(seqs, (0..=max).collect::<Vec<_>>(), "worker 0's batches");
    let replayed = o
        .batches_of_worker0
        .iter()
        .filter(|(_, s)| *s == SequenceStatus::Replayed)
        .count() as u64;
    assert!(
        replayed + 1 >= o.dropped,
        "{replayed} replayed of {} dropped",
        o.dropped
    );
    let c = o.analyzer.counters();
    assert_eq!(c.sequence_gaps, 0, "{c:?}");
    // The counter counts every worker's replayed batches: the other workers' taps may
    // replay too (a subscriber that joins late, or under load, misses a publisher's
    // first messages and asks for them).
    let replayed_all = o
        .records
        .iter()
        .filter(
            |e| matches!(&e.record, Record::KvEvents(b) if b.sequence == SequenceStatus::Replayed),
        )
        .count() as u64;
    assert!(replayed_all >= replayed);
    assert_eq!(c.replayed_batches, replayed_all);
    assert_eq!(c.verdicts_on_incomplete_mirror, 0);
    assert!(o.verdicts.iter().all(|v| !v.incomplete_mirror));
    oracle::assert_overlaps_equal(&o.verdicts, &o.records);
    let report = OpportunityReport::from_analyzer(&o.analyzer);
    let md = report.to_markdown();
    assert!(md.contains("batches recovered through replay"), "{md}");
    eprintln!(
        "relay dropped {}, {replayed} replayed; {} decisions equal to Dynamo's indexer",
        o.dropped,
        o.verdicts.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replay_the_worker_is_marked_incomplete_and_its_verdicts_flagged() {
    let o = run_through_relay(false).await;
    let c = o.analyzer.counters();
    assert!(c.sequence_gaps >= 1, "{c:?}");
    // Worker 0's tap has no replay socket, so none of its batches is replayed. (The
    // other workers' taps have one, and may use it: a subscriber that joins late, or
    // under load, misses a publisher's first messages and asks for them.)
    assert!(
        o.batches_of_worker0
            .iter()
            .all(|(_, s)| *s != SequenceStatus::Replayed),
        "worker 0 has no replay socket"
    );
    assert!(c.verdicts_on_incomplete_mirror > 0, "{c:?}");
    let flagged = o.verdicts.iter().filter(|v| v.incomplete_mirror).count() as u64;
    assert_eq!(flagged, c.verdicts_on_incomplete_mirror);
    // Until the first gap nothing is flagged.
    assert!(!o.verdicts[0].incomplete_mirror);
    let report = OpportunityReport::from_analyzer(&o.analyzer);
    assert!(report.windows_with_data_faults > 0);
    assert!(report
        .to_markdown()
        .contains("verdicts judged on an incomplete mirror"));
}
