//! kvscope started after the engines, on Dynamo's ZMQ event plane with etcd discovery:
//! the caches the workers already hold come through Dynamo's own recovery endpoints.

use kvscope_e2e::oracle;

use kvscope_fleet::fleet_run::{FleetRunConfig, KvSource};
use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::{LabConfig, LabDiscovery, LabEventPlane};
use kvscope_wire::recording::read_recording;
use kvscope_wire::Record;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::Path;
use std::time::Duration;

const WINDOW_SECS: f64 = 4.0;

/// kvscope started after the engines: a second agent joins the lab's ZMQ event plane
/// once the mockers' caches are full, and gets what they hold through Dynamo's own
/// recovery endpoints (`worker_kv_query_source_*` on the TCP request plane), each
/// worker's cache as a dump before its live events. Asserts: every worker was
/// recovered, none is flagged incomplete, and for every request decided after it
/// joined, the late agent's verdict has the same per-worker overlaps as the agent
/// that saw everything from the start (printed share; at least 95%), and its overlaps
/// equal `dynamo-kv-router`'s over its own records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_started_late_recovers_the_caches_through_dynamos_endpoints() {
    use kvscope_lab::bus_security::BusAgent;
    use kvscope_lab::process::{stop_all, ManagedProcess};

    let lab = LabConfig {
        workers: 3,
        discovery: LabDiscovery::Etcd,
        event_plane: LabEventPlane::Zmq,
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        bus_agents: vec![
            BusAgent::new("lab-node", "lab"),
            BusAgent::new("late-node", "late"),
        ],
        ..LabConfig::default()
    };
    let run = kvscope_e2e::fleet(FleetRunConfig {
        kv_source: KvSource::EventPlane,
        ..FleetRunConfig::new(lab, WINDOW_SECS)
    })
    .await
    .expect("lab (etcd discovery), agent and collector start");
    let workload = |secs: f64, seed: u64| WorkloadConfig {
        seed,
        ..run.chat_workload(secs)
    };
    let first = workload::run(workload(8.0, 1))
        .await
        .expect("the first workload runs");
    assert!(first.ok >= 30, "{} requests", first.ok);

    let late_recording = run.run_dir().join("late-agent.jsonl");
    let mut cmd = run.other_agent("late-node", "late").unwrap();
    cmd.arg("--router-log")
        .arg(run.lab().router_log())
        .arg("--record")
        .arg(&late_recording)
        .envs(run.lab().manifest().dynamo_env());
    let mut late =
        vec![
            ManagedProcess::spawn("late-agent", cmd, &run.run_dir().join("late-agent.log"))
                .unwrap(),
        ];
    tokio::time::sleep(Duration::from_secs(4)).await;

    let second = workload::run(workload(10.0, 2))
        .await
        .expect("the second workload runs");
    assert!(second.ok >= 30, "{} requests", second.ok);
    let ids: HashSet<String> = second.router_request_ids().into_iter().collect();
    run.wait_for_decisions((first.ok + second.ok) as u64, Duration::from_secs(60))
        .await
        .expect("every decision reaches the collector");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let n = read_recording(&late_recording)
            .map(|r| {
                r.envelopes
                    .iter()
                    .filter(
                        |e| matches!(&e.record, Record::Decision(d) if ids.contains(&d.request_id)),
                    )
                    .count()
            })
            .unwrap_or(0);
        if n >= ids.len() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the late agent has {n} of {} decisions",
            ids.len()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop_all(&mut late, Duration::from_secs(10));
    let early = run.finish().await.expect("the collector catches up");

    let judge = |path: &Path| {
        let r = kvscope_fleet::fleet_run::replay(path, WINDOW_SECS, &[]).unwrap();
        (r.verdicts, r.envelopes)
    };
    let (early_verdicts, _) = judge(&early);
    let (late_verdicts, late_records) = judge(&late_recording);
    oracle::assert_overlaps_equal(&late_verdicts, &late_records);
    // Each worker's cache came as a dump (clear, then its blocks) before its live events.
    let dumps: BTreeSet<u64> = late_records
        .iter()
        .filter_map(|e| match &e.record {
            Record::KvEvents(b)
                if b.sequence == kvscope_wire::SequenceStatus::Replayed
                    && matches!(
                        b.events.first(),
                        Some(kvscope_wire::KvEvent::AllBlocksCleared)
                    )
                    && b.events.len() > 1 =>
            {
                Some(b.worker.worker_id)
            }
            _ => None,
        })
        .collect();
    let workers: BTreeSet<u64> = run_workers(&late_records);
    assert_eq!(dumps, workers, "every worker's cache was recovered");
    let by_id: BTreeMap<&str, &kvscope_wire::api::verdict::SpillVerdict> = early_verdicts
        .iter()
        .map(|v| (v.request_id.as_str(), v))
        .collect();
    let judged: Vec<_> = late_verdicts
        .iter()
        .filter(|v| ids.contains(&v.request_id))
        .collect();
    assert_eq!(judged.len(), ids.len());
    assert!(
        judged.iter().all(|v| !v.incomplete_mirror),
        "a recovered mirror is complete"
    );
    let same = judged
        .iter()
        .filter(|v| {
            by_id
                .get(v.request_id.as_str())
                .is_some_and(|e| e.overlaps == v.overlaps)
        })
        .count();
    let cached = judged.iter().filter(|v| !v.overlaps.is_empty()).count();
    eprintln!(
        "late agent: {} worker caches recovered; {same} of {} later verdicts with the early agent's overlaps ({cached} with cached prefixes)",
        dumps.len(),
        judged.len()
    );
    assert!(cached > 0);
    assert!(
        same as f64 >= 0.95 * judged.len() as f64,
        "{same} of {}",
        judged.len()
    );
}

/// The workers the records name in KV batches.
fn run_workers(records: &[kvscope_wire::Envelope]) -> BTreeSet<u64> {
    records
        .iter()
        .filter_map(|e| match &e.record {
            Record::KvEvents(b) => Some(b.worker.worker_id),
            _ => None,
        })
        .collect()
}
