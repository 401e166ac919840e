//! kvscope's bus as a fleet runs NATS: a JetStream cluster of three servers on loopback,
//! the stream on all three (`stream_replicas` left at 0: the servers say they are a
//! cluster of three), the agent and the collector given every server's URL. The lab's
//! chat workload runs through agent → cluster → collector while the stream's leader's
//! server is SIGKILLed, then a follower's (the stream has no quorum then: the agent
//! buffers), then both come back.
//!
//! Asserts: the stream is kept by three servers; its leader moved and the collector
//! counted it; every record the agent published was applied by the collector exactly
//! once, in the agent's order (0 lost, none twice); no sequence gap; every verdict equal
//! to Dynamo's own indexer over the same records (the lab tests' oracle). Needs the lab
//! (`scripts/setup`).

use kvscope_e2e::oracle;
use kvscope_fleet::fleet_run::{FleetRunConfig, Replayed};
use kvscope_lab::nats::NatsCluster;
use kvscope_lab::workload;
use kvscope_lab::LabConfig;
use kvscope_wire::Subjects;
use std::time::{Duration, Instant};

const WINDOW_SECS: f64 = 4.0;

/// The server leading the lab cluster's stream, as the cluster says (waits through an
/// election).
async fn stream_leader(urls: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let leader: Result<String, String> = async {
            let client = async_nats::ConnectOptions::new()
                .connection_timeout(Duration::from_secs(2))
                .connect(kvscope_wire::nats_security::server_urls(urls).as_slice())
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let js = async_nats::jetstream::new(client);
            let mut stream = js
                .get_stream(Subjects::new(kvscope_fleet::fleet_run::LAB_CLUSTER).stream_name())
                .await
                .map_err(|e| format!("stream: {e}"))?;
            let info = stream.info().await.map_err(|e| format!("info: {e}"))?;
            assert_eq!(info.config.num_replicas, 3, "the stream on every server");
            info.cluster
                .clone()
                .and_then(|c| c.leader)
                .ok_or_else(|| format!("no leader: {:?}", info.cluster))
        }
        .await;
        match leader {
            Ok(l) => return l,
            Err(e) => assert!(Instant::now() < deadline, "the stream has no leader: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_server_bus_loses_no_record_when_its_leader_and_a_follower_die() {
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = NatsCluster::start(dir.path(), 3).expect("three nats-servers");
    let lab = LabConfig {
        workers: 3,
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        ..LabConfig::default()
    };
    let run = kvscope_e2e::fleet(FleetRunConfig {
        bus_url: Some(cluster.urls()),
        ..FleetRunConfig::new(lab, WINDOW_SECS)
    })
    .await
    .expect("lab, agent and collector start on the cluster");
    let urls = cluster.urls();
    let cfg = run.chat_workload(20.0);
    let work = tokio::spawn(workload::run(cfg));

    tokio::time::sleep(Duration::from_secs(4)).await;
    let leader = stream_leader(&urls).await;
    // The collector looks at the stream every few seconds: once it has seen this leader,
    // the next look sees the leader moved.
    let deadline = Instant::now() + Duration::from_secs(15);
    while run.summary().await.unwrap()["bus"]["stream_leader"] != leader.as_str() {
        assert!(
            Instant::now() < deadline,
            "the collector never saw the leader {leader}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let index = |name: &str| (0..3).find(|&i| NatsCluster::name(i) == name).unwrap();
    let first = index(&leader);
    cluster.kill_member(first);
    eprintln!("killed the stream's leader {leader}");
    // Another leader is elected; then a follower of it goes too (no quorum left).
    let second_leader = stream_leader(&urls).await;
    assert_ne!(second_leader, leader);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let follower = (0..3)
        .find(|&i| i != first && NatsCluster::name(i) != second_leader)
        .unwrap();
    cluster.kill_member(follower);
    eprintln!("killed the follower {}", NatsCluster::name(follower));
    tokio::time::sleep(Duration::from_secs(4)).await;
    cluster
        .start_member(first)
        .expect("the leader's server back");
    cluster
        .start_member(follower)
        .expect("the follower's server back");
    eprintln!("both back");

    let summary = work.await.unwrap().expect("the workload runs");
    assert!(summary.ok >= 50, "{} requests", summary.ok);
    run.wait_for_decisions(summary.ok as u64, Duration::from_secs(90))
        .await
        .expect("every decision reaches the collector");
    let bus = run.summary().await.unwrap()["bus"].clone();
    assert_eq!(
        bus["stream_replicas"], 3,
        "the stream on the three servers: {bus}"
    );
    assert!(
        bus["stream_leader_changes"].as_u64().unwrap_or(0) >= 1,
        "the collector saw the leader move: {bus}"
    );
    let agent_recording = run.agent_recording.clone();
    let recording = run.finish().await.expect("the collector catches up");

    // Nothing lost or applied twice across the servers' deaths.
    let applied = kvscope_e2e::applied_as_published(&agent_recording, &recording);
    let Replayed {
        analyzer,
        verdicts,
        envelopes,
    } = kvscope_fleet::fleet_run::replay(&recording, WINDOW_SECS, &[]).unwrap();
    let c = analyzer.counters();
    assert_eq!(
        (c.sequence_gaps, c.verdicts_on_incomplete_mirror),
        (0, 0),
        "{c:?}"
    );
    oracle::assert_overlaps_equal(&verdicts, &envelopes);
    eprintln!(
        "{} records, {} verdicts equal to Dynamo's indexer; the collector saw the leader move {} times",
        applied.envelopes.len(),
        verdicts.len(),
        bus["stream_leader_changes"]
    );
}
