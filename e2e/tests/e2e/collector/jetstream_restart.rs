//! The collector against a real `nats-server -js`: it consumes records with its durable
//! consumer, survives `kill -9` and a restart without losing or double-counting a record,
//! and its live figures equal a replay of its recording and an in-process fold of the
//! records published.

use async_nats::jetstream;
use kvscope_collector::fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_collector::report::OpportunityReport;
use kvscope_lab::nats::NatsServer;
use kvscope_lab::process::{signal_group, ManagedProcess, StopOnDrop};
use kvscope_wire::hashing::{local_block_hashes, DYNAMO_HASH_SEED};
use kvscope_wire::subject::stream_config;
use kvscope_wire::{
    AgentHeartbeat, Envelope, KvEvent, KvEventBatch, Record, RoutingDecision, SequenceStatus,
    Subjects, WorkerKey,
};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const S: u64 = 1_000_000_000;

/// A port for the collector's API, free now (the collector binds it soon after).
fn api_port() -> u16 {
    kvscope_lab::ports::pick_ports(1).expect("a free port")[0]
}

/// A deterministic fleet trace: 3 workers storing growing conversations, decisions that
/// sometimes go to a worker without the prefix, evictions, and heartbeats.
fn trace(n: usize) -> Vec<Envelope> {
    let mut out = Vec::new();
    let mut seqs = [0u64; 3];
    let bs = 4u32;
    for i in 0..n {
        let t = 1_000 * S + (i as u64) * S / 40;
        let conv = (i / 6) as u32;
        let turns = (i % 6) as u32 + 1;
        let tokens: Vec<u32> = (0..turns * 2 * bs).map(|k| conv * 1000 + k).collect();
        let holder = (conv % 3) as u64;
        let env = |record| Envelope {
            agent: "node-a".into(),
            observed_ns: t,
            record,
        };
        match i % 4 {
            0 | 1 => {
                let hashes: Vec<u64> = (0..tokens.len() as u64 / bs as u64)
                    .map(|b| (conv as u64) << 20 | b)
                    .collect();
                let w = if i % 4 == 0 { holder } else { (holder + 1) % 3 };
                seqs[w as usize] += 1;
                out.push(env(Record::KvEvents(KvEventBatch {
                    worker: WorkerKey {
                        worker_id: w,
                        dp_rank: 0,
                    },
                    publisher: format!("tcp://127.0.0.1:{}", 5000 + w),
                    origin: Default::default(),
                    seq: seqs[w as usize],
                    sequence: SequenceStatus::InOrder,
                    engine_ts: 0.0,
                    events: vec![
                        KvEvent::BlockStored {
                            block_hashes: hashes,
                            parent_block_hash: None,
                            token_ids: tokens.clone(),
                            block_size: bs,
                            local_hashes: None,
                            lora_name: None,
                            medium: None,
                            cache_salt: None,
                        },
                        KvEvent::BlockRemoved {
                            block_hashes: vec![((conv as u64).saturating_sub(4)) << 20],
                            medium: None,
                        },
                    ],
                })));
            }
            2 => out.push(env(Record::Decision(RoutingDecision {
                tenant: None,
                model: None,
                request_id: format!("req-{i}"),
                worker: WorkerKey {
                    worker_id: (holder + (i as u64 % 2)) % 3,
                    dp_rank: 0,
                },
                isl_tokens: tokens.len() as u64 + 3,
                block_size: bs,
                local_hashes: local_block_hashes(&tokens, bs as usize, DYNAMO_HASH_SEED),
                sequence_hashes: None,
                worker_type: None,
                router_mode: Some("kv".into()),
                clock_behind_ms: None,
                selection: Default::default(),
                trace: None,
            }))),
            _ => out.push(env(Record::Heartbeat(AgentHeartbeat::default()))),
        }
    }
    out
}

fn analyzer_config() -> AnalyzerConfig {
    AnalyzerConfig {
        window_secs: 1.0,
        warmup_secs: 1.0,
        ..Default::default()
    }
}

/// The collector, stopped when the guard drops; its output goes to a log next to the
/// recording (kept in the test's temporary directory).
fn spawn_collector(nats: &str, listen: &str, record: &Path) -> StopOnDrop {
    let mut cmd = Command::new(kvscope_e2e::collector());
    cmd.args([
        "--window-secs",
        "1",
        "--warmup-secs",
        "1",
        "run",
        "--cluster",
        "t",
        "--nats-url",
        nats,
        "--listen",
        listen,
        "--record",
    ])
    .arg(record)
    .arg("--report-dir")
    .arg(record.with_extension("reports"));
    let log = record.with_extension("collector.log");
    StopOnDrop(vec![
        ManagedProcess::spawn("collector", cmd, &log).expect("the collector starts")
    ])
}

/// Send `signal` to the guarded collector, reap it, and forget it (so the guard never
/// signals its maybe reused group id); its exit status.
fn signal_and_reap(collector: &mut StopOnDrop, signal: &str) -> std::process::ExitStatus {
    signal_group(collector[0].pid(), signal);
    let status = collector[0].child.wait().unwrap();
    collector.clear();
    status
}

async fn get_json(url: &str) -> Option<serde_json::Value> {
    reqwest::get(url).await.ok()?.json().await.ok()
}

/// The summary once the collector has applied up to `seq` and serves (holds its lease:
/// a standby applies records too, but serves no figures).
async fn wait_applied(api: &str, seq: u64) -> serde_json::Value {
    wait_summary(api, &format!("applied up to stream sequence {seq}"), |s| {
        s["bus"]["applied_seq"].as_u64() == Some(seq) && s["bus"]["lease"]["role"] == "leader"
    })
    .await
}

/// The collector's summary once `done` holds of it (within 60 s, else fail naming `what`).
async fn wait_summary(
    api: &str,
    what: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(s) = get_json(&format!("{api}/api/summary")).await {
            if done(&s) {
                return s;
            }
        }
        assert!(Instant::now() < deadline, "the collector never {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_collector_resumes_without_losing_or_repeating_records() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_anywhere(&dir.path().join("js"))
        .expect("nats-server -js (scripts/setup)");
    let url = nats.url();
    let subjects = Subjects::new("t");
    let js = jetstream::new(async_nats::connect(&url).await.unwrap());
    js.get_or_create_stream(stream_config(
        &subjects,
        Duration::from_secs(3600),
        kvscope_wire::subject::DEFAULT_STREAM_MAX_BYTES,
        1,
    ))
    .await
    .unwrap();
    let records = trace(1200);
    let publish = |batch: &[Envelope]| {
        let js = js.clone();
        let subjects = subjects.clone();
        let batch = batch.to_vec();
        async move {
            for e in &batch {
                js.publish(subjects.for_record(&e.agent, &e.record), e.to_json().into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
        }
    };
    // Half the records before the collector starts: it must rebuild them from the stream.
    publish(&records[..600]).await;
    let port = api_port();
    let listen = format!("127.0.0.1:{port}");
    let api = format!("http://{listen}");
    let recording = dir.path().join("rec.jsonl");
    let mut collector = spawn_collector(&url, &listen, &recording);
    // The count is set when the rebuild ends, just after its last record is applied.
    let rebuilt = wait_summary(&api, "rebuilt up to stream sequence 600", |s| {
        s["bus"]["applied_seq"].as_u64() == Some(600) && s["bus"]["rebuilding"] == false
    })
    .await;
    assert_eq!(
        rebuilt["bus"]["rebuilt_records"].as_u64(),
        Some(600),
        "the records in the stream at start are rebuilt: {}",
        rebuilt["bus"]
    );
    // More records while it runs; kill it hard in the middle of them.
    let publisher = tokio::spawn(publish(&records[600..1000]));
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal_and_reap(&mut collector, "KILL");
    publisher.await.unwrap();
    publish(&records[1000..1100]).await;
    let mut collector = spawn_collector(&url, &listen, &recording);
    publish(&records[1100..]).await;
    let summary = wait_applied(&api, 1200).await;
    assert_eq!(
        summary["counters"]["records"].as_u64(),
        Some(1200),
        "every record applied exactly once"
    );
    let live: OpportunityReport =
        serde_json::from_value(get_json(&format!("{api}/api/report")).await.unwrap()).unwrap();
    let page = reqwest::get(format!("{api}/api/report.html"))
        .await
        .unwrap();
    assert_eq!(page.headers()["content-type"], "text/html; charset=utf-8");
    assert_eq!(
        page.text().await.unwrap(),
        live.to_html(),
        "/api/report.html"
    );
    // A graceful stop flushes the recording.
    assert!(
        signal_and_reap(&mut collector, "TERM").success(),
        "the collector exits cleanly on SIGTERM"
    );
    let written = std::fs::read_to_string(recording.with_extension("reports").join("report.html"));
    assert_eq!(
        written.unwrap(),
        live.to_html(),
        "run --report-dir writes report.html"
    );

    let mut expected = FleetAnalyzer::new(analyzer_config());
    records.iter().for_each(|r| {
        expected.apply(r);
    });
    let expected = OpportunityReport::from_analyzer(&expected);
    assert!(
        expected.spills > 0 && expected.windows_measured >= 6,
        "the trace must exercise spills over ≥ 6 windows"
    );
    assert_same(
        &live,
        &expected,
        "live figures after a kill and restart vs an uninterrupted fold",
    );

    let out = kvscope_e2e::succeeded(
        Command::new(kvscope_e2e::collector())
            .args([
                "--window-secs",
                "1",
                "--warmup-secs",
                "1",
                "report",
                "--format",
                "json",
                "--replay",
            ])
            .arg(&recording),
    );
    let mut replayed: OpportunityReport = serde_json::from_slice(&out.stdout).unwrap();
    // The report of a recording ends with its what-if (here, with no cache size in the
    // trace, why there is none); the live report has none.
    assert!(replayed.whatif_unavailable.is_some());
    replayed.whatif_unavailable = None;
    assert_same(
        &replayed,
        &expected,
        "report --replay of the recording vs the live figures",
    );
}

/// Equality with a readable message: the first JSON path where the two reports differ.
fn assert_same(a: &OpportunityReport, b: &OpportunityReport, what: &str) {
    fn diff(path: String, a: &serde_json::Value, b: &serde_json::Value) -> Option<String> {
        use serde_json::Value::*;
        match (a, b) {
            (Object(x), Object(y)) => x.keys().chain(y.keys()).find_map(|k| {
                diff(
                    format!("{path}.{k}"),
                    x.get(k).unwrap_or(&Null),
                    y.get(k).unwrap_or(&Null),
                )
            }),
            (Array(x), Array(y)) if x.len() == y.len() => x
                .iter()
                .zip(y)
                .enumerate()
                .find_map(|(i, (p, q))| diff(format!("{path}[{i}]"), p, q)),
            _ if a == b => None,
            _ => Some(format!("{path}: {a} != {b}")),
        }
    }
    let (x, y) = (
        serde_json::to_value(a).unwrap(),
        serde_json::to_value(b).unwrap(),
    );
    if let Some(d) = diff(String::new(), &x, &y) {
        panic!("{what}: first difference at {d}");
    }
}

/// A record stamped 50 years ahead — a wrong clock, or anyone who can reach NATS —
/// must not move the collector's windows and watermark to its date: it is quarantined
/// and counted, and the real records after it are applied as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_dated_far_ahead_is_quarantined_not_applied() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_anywhere(&dir.path().join("js"))
        .expect("nats-server -js (scripts/setup)");
    let url = nats.url();
    let subjects = Subjects::new("t");
    let js = jetstream::new(async_nats::connect(&url).await.unwrap());
    js.get_or_create_stream(stream_config(
        &subjects,
        Duration::from_secs(3600),
        kvscope_wire::subject::DEFAULT_STREAM_MAX_BYTES,
        1,
    ))
    .await
    .unwrap();
    let now = kvscope_kit::clock::now_ns();
    let beat = |agent: &str, t: u64| Envelope {
        agent: agent.into(),
        observed_ns: t,
        record: Record::Heartbeat(AgentHeartbeat::default()),
    };
    let fifty_years = 50 * 365 * 86_400 * 1_000_000_000u64;
    // The real ones dated before they are stored (a record dated after its storing is
    // moved back to it: its agent's clock is ahead, `ingest/clocks.rs`).
    let records = [
        beat("real", now - 2_000_000_000),
        beat("forger", now + fifty_years),
        beat("real", now - 1_000_000_000),
    ];
    for e in &records {
        js.publish(subjects.for_record(&e.agent, &e.record), e.to_json().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let listen = format!("127.0.0.1:{}", api_port());
    let api = format!("http://{listen}");
    let recording = dir.path().join("rec.jsonl");
    let _collector = spawn_collector(&url, &listen, &recording);
    let s = wait_applied(&api, 3).await;
    assert_eq!(s["counters"]["future_records"], 1, "{s}");
    assert_eq!(s["watermark_ns"].as_u64(), Some(now - 1_000_000_000));
    assert_eq!(s["counters"]["heartbeats"], 2);
}

/// Publish `records` on `subjects` as fast as the server acknowledges them (a hundred in
/// flight); the acknowledgements that failed, as the server's reasons.
async fn publish_all(
    js: &jetstream::Context,
    subjects: &Subjects,
    records: &[Envelope],
) -> Vec<String> {
    let mut refused = Vec::new();
    for chunk in records.chunks(100) {
        let mut acks = Vec::new();
        for e in chunk {
            match js
                .publish(subjects.for_record(&e.agent, &e.record), e.to_json().into())
                .await
            {
                Ok(ack) => acks.push(ack),
                Err(e) => refused.push(e.to_string()),
            }
        }
        for ack in acks {
            if let Err(e) = ack.await {
                refused.push(e.to_string());
            }
        }
    }
    refused
}

/// A stream at its size limit discards its oldest records, so a NATS server whose
/// JetStream store is small keeps taking the fleet's records (without the limit the same
/// server refuses every publish once its store is full); a collector started then
/// rebuilds from the first record kept and says where its figures begin; and one that
/// falls behind by more than the stream keeps counts what it never saw, all at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_at_its_size_limit_discards_its_oldest_and_the_collector_counts_them() {
    let dir = tempfile::tempdir().unwrap();
    let store_limit = 2u64 << 20;
    let stream_limit = 512u64 << 10;
    let nats = NatsServer::start_with_store_limit(&dir.path().join("js"), store_limit)
        .expect("nats-server -js (scripts/setup)");
    let url = nats.url();
    let js = jetstream::new(async_nats::connect(&url).await.unwrap());
    let records = trace(12_000);
    let bytes: usize = records.iter().map(|e| e.to_json().len()).sum();
    assert!(
        bytes as u64 > 2 * store_limit,
        "the trace must overfill the server's store ({bytes} bytes)"
    );

    // What the limit is for: with none, the server refuses records once its store is full.
    let unlimited = Subjects::new("u");
    let mut stream = js
        .get_or_create_stream(stream_config(&unlimited, Duration::from_secs(3600), 0, 1))
        .await
        .unwrap();
    assert_eq!(stream.info().await.unwrap().config.max_bytes, -1);
    let refused = publish_all(&js, &unlimited, &records).await;
    assert!(
        !refused.is_empty(),
        "a stream without a size limit overfills the server's {store_limit}-byte store"
    );
    js.delete_stream(unlimited.stream_name()).await.unwrap();

    // A limit the server's store cannot hold is refused (the agent's readiness says so).
    let subjects = Subjects::new("t");
    let too_large = js
        .get_or_create_stream(stream_config(
            &subjects,
            Duration::from_secs(3600),
            2 * store_limit,
            1,
        ))
        .await;
    assert!(
        too_large.is_err(),
        "a stream larger than the server's store"
    );
    let mut stream = js
        .get_or_create_stream(stream_config(
            &subjects,
            Duration::from_secs(3600),
            stream_limit,
            1,
        ))
        .await
        .unwrap();
    let refused = publish_all(&js, &subjects, &records).await;
    assert_eq!(
        refused,
        Vec::<String>::new(),
        "the limited stream takes every record"
    );
    let state = stream.info().await.unwrap().state.clone();
    assert!(state.bytes <= stream_limit, "{state:?}");
    assert_eq!(state.last_sequence, records.len() as u64);
    assert!(
        state.first_sequence > 1,
        "the oldest were discarded: {state:?}"
    );

    let listen = format!("127.0.0.1:{}", api_port());
    let api = format!("http://{listen}");
    let mut collector = spawn_collector(&url, &listen, &dir.path().join("rec.jsonl"));
    let rebuilt = wait_summary(&api, "rebuilt the stream, and serving", |s| {
        s["bus"]["applied_seq"].as_u64() == Some(state.last_sequence)
            && s["bus"]["rebuilding"] == false
            && s["bus"]["lease"]["role"] == "leader"
    })
    .await;
    let bus = &rebuilt["bus"];
    assert_eq!(
        bus["stream_first_seq"].as_u64(),
        Some(state.first_sequence),
        "{bus}"
    );
    assert_eq!(
        bus["rebuilt_records"].as_u64(),
        Some(state.messages),
        "every record kept is rebuilt: {bus}"
    );
    let metrics = kvscope_e2e::get_text(&format!("{api}/metrics")).await;
    assert!(
        metrics.contains(&format!(
            "kvscope_collector_bus_stream_first_sequence {}",
            state.first_sequence
        )),
        "the first sequence is on /metrics"
    );

    // Stopped while the stream moves on by more than it keeps, the collector finds the
    // records after its position gone.
    signal_group(collector[0].pid(), "STOP");
    let refused = publish_all(&js, &subjects, &records).await;
    signal_group(collector[0].pid(), "CONT");
    assert!(refused.is_empty(), "{refused:?}");
    let last = 2 * records.len() as u64;
    let s = wait_applied(&api, last).await;
    let (applied, missing) = (
        s["counters"]["records"].as_u64().unwrap(),
        s["bus"]["missing_records"].as_u64().unwrap(),
    );
    assert!(missing > 0, "records were discarded unread: {}", s["bus"]);
    assert_eq!(
        applied + missing,
        last - state.first_sequence + 1,
        "every sequence from the first kept is applied or counted missing: {}",
        s["bus"]
    );
    assert!(
        s["bus"]["applied_seq"].as_u64() == Some(last)
            && collector[0].child.try_wait().unwrap().is_none(),
        "the collector goes on"
    );
}
