//! The agent end to end against the real things: a `nats-server -js` (Debian's), a
//! pyzmq PUB sending vLLM-shaped batches (and restarting, as an engine would), and a
//! router log file being appended. Asserts the exact records that arrive on JetStream.
//! If `nats-server` or the lab's python are missing this fails: it never skips.

use futures::StreamExt;
use kvscope_agent::config::{AgentConfig, KvEndpoint};
use kvscope_lab::nats::NatsServer;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use kvscope_wire::hashing::{local_block_hashes, DYNAMO_HASH_SEED};
use kvscope_wire::{
    AgentCounters, Envelope, KvEvent, KvEventBatch, MigrationLogKind, MigrationLogLine, Record,
    RoutingDecision, SequenceStatus, Subjects, WorkerKey,
};
use rmpv::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::support;
use support::{mocker_sample, python};

fn free_port() -> u16 {
    kvscope_lab::ports::pick_ports(1).unwrap()[0]
}

/// A pyzmq XPUB that sends `messages` (frames) once a subscriber is there.
struct Publisher {
    /// One process, stopped if the test fails before [`Publisher::stop`].
    child: StopOnDrop,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl Publisher {
    fn start(endpoint: &str, messages: &[Vec<Vec<u8>>], dir: &Path, name: &str) -> Self {
        let spec = serde_json::json!({
            "messages": messages.iter().map(|m| serde_json::json!({
                "frames_hex": m.iter().map(|f| f.iter().map(|b| format!("{b:02x}")).collect::<String>()).collect::<Vec<_>>()
            })).collect::<Vec<_>>()
        });
        let path = dir.join(format!("{name}.json"));
        std::fs::write(&path, serde_json::to_vec(&spec).unwrap()).unwrap();
        let mut cmd = Command::new(python());
        cmd.arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/e2e/agent/support/kv_publisher.py"
        ))
        .arg(endpoint)
        .arg(&path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
        let mut child = ManagedProcess::spawn_with_stdio(name, cmd).unwrap_or_else(|e| {
            panic!(
                "cannot run {} (the lab venv with pyzmq; run scripts/setup): {e:#}",
                python().display()
            )
        });
        let out = std::io::BufReader::new(child.child.stdout.take().unwrap());
        let mut p = Publisher {
            child: StopOnDrop(vec![child]),
            out,
        };
        assert_eq!(p.line(), "bound");
        p
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.out.read_line(&mut l).unwrap();
        l.trim().to_string()
    }

    /// Wait for "sent N" (the subscriber connected and everything went out).
    fn wait_sent(&mut self) {
        assert!(self.line().starts_with("subscribed"));
        assert!(self.line().starts_with("sent"));
    }

    fn stop(mut self) {
        // Closing stdin tells the script to exit; once reaped it is forgotten, so the
        // guard never signals its (maybe reused) process group.
        drop(self.child[0].child.stdin.take());
        let _ = self.child[0].child.wait();
        self.child.clear();
    }
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn ints(xs: &[u64]) -> Value {
    Value::Array(xs.iter().map(|&x| Value::from(x)).collect())
}

fn msg(seq: u64, payload: Vec<u8>) -> Vec<Vec<u8>> {
    vec![b"kv-events".to_vec(), seq.to_be_bytes().to_vec(), payload]
}

fn batch(ts: f64, events: Vec<Value>, dp: Option<u64>) -> Vec<u8> {
    let mut a = vec![Value::F64(ts), Value::Array(events)];
    if let Some(dp) = dp {
        a.push(Value::from(dp));
    }
    encode(&Value::Array(a))
}

fn hex(h: &str) -> Vec<u8> {
    (0..h.len() / 2)
        .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

const WORKER: u64 = 9969664417447597980;

const LOG_BEFORE: &str = concat!(
    "2026-11-29T07:50:01.000000Z  INFO http-request: dynamo_llm::http::service::metrics: request received request_id=r1\n",
    "\x1b[2m2026-11-29T07:50:01.100000Z\x1b[0m \x1b[34mDEBUG\x1b[0m dynamo_kv_router::services::selection::core::run\x1b[2m:\x1b[0m [ROUTING_INPUT] request local hashes \x1b[3mrequest_id\x1b[0m\x1b[2m=\x1b[0m\"r1\" isl_tokens=41 block_size=16 num_blocks=2 local_hashes=[10190339484985224020, 8425628386841907966] method=POST request_id=span-id\n",
    "garbage \u{1}\u{2} line\n",
    "2026-11-29T07:50:01.200000Z DEBUG dynamo_kv_router::services::selection::core::run: [ROUTING_INPUT] request local hashes request_id=\"r2\" isl_tokens=16 block_size=16 num_blocks=1 local_hashes=[1\n",
);

const LOG_AFTER: &str = concat!(
    "2026-11-29T07:50:01.300000Z  INFO dynamo_kv_router::scheduling::selector: Selected worker router_mode=\"kv\" request_id=\"r1\" worker_id=9969664417447597980 worker_type=decode dp_rank=0 logit=62.625 host_pinned_blocks=0 disk_blocks=0\n",
    // A host whose clock jumped 70 years ahead: its time is not taken, so it does not
    // end the wait of "lonely" below (nor move any clock), and it is counted.
    "2096-01-01T00:00:00.000000Z  INFO dynamo_llm::http::service::metrics: request received request_id=r2\n",
    "2026-11-29T07:50:01.400000Z DEBUG dynamo_kv_router::services::selection::core::run: [ROUTING_INPUT] request local hashes request_id=\"lonely\" isl_tokens=16 block_size=16 num_blocks=1 local_hashes=[5]\n",
    "2026-11-29T07:50:01.500000Z  INFO dynamo_llm::kv_router::push_router: KVMIGRATE_SPILL: request routed off the worker holding its KV request_id=\"r1\" source=758491669810558404 target=9969664417447597980 tokens=41 migratable_tokens=32\n",
    "2026-11-29T07:50:01.600000Z  WARN dynamo_llm::kv_router::push_router: KVMIGRATE: producer dispatch failed request_id=\"r1\" error=\"handshake timed out\"\n",
    // 40 s later in log time: "lonely" has waited past the 30 s join timeout.
    "2026-11-29T07:50:41.600000Z  INFO dynamo_llm::http::service::metrics: request received request_id=r3\n",
);

async fn collect_until(
    js: &async_nats::jetstream::Context,
    subjects: &Subjects,
    done: impl Fn(&[Envelope]) -> bool,
) -> Vec<Envelope> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let stream = loop {
        match js.get_stream(subjects.stream_name()).await {
            Ok(s) => break s,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "the agent never created the stream: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut got = Vec::new();
    while !done(&got) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "timed out; last counters {:#?}; got {:#?}",
            kvscope_e2e::last_agent_counters(&got),
            got.iter()
                .filter(|e: &&Envelope| !matches!(e.record, Record::Heartbeat(_)))
                .collect::<Vec<_>>()
        );
        match tokio::time::timeout(left, messages.next()).await {
            Ok(Some(Ok(m))) => {
                // A message is one record, or a bundle of records released together.
                for entry in kvscope_wire::bundle::entries(m.subject.as_str(), &m.payload) {
                    let entry = entry.unwrap();
                    let env = Envelope::from_json(entry.json).unwrap();
                    assert_eq!(entry.subject, subjects.for_record("test-node", &env.record));
                    if entry.subject != m.subject.as_str() {
                        assert_eq!(
                            m.subject.as_str(),
                            Subjects::bundle_subject(subjects.scope_of(entry.subject).unwrap())
                        );
                    }
                    got.push(env);
                }
            }
            Ok(other) => panic!("consumer ended: {other:?}"),
            Err(_) => panic!(
                "timed out; last counters {:#?}; got {got:#?}",
                kvscope_e2e::last_agent_counters(&got)
            ),
        }
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_from_zmq_and_the_router_log_arrive_on_jetstream() {
    let dir = tempfile::tempdir().unwrap();
    let nats_port = free_port();
    let _nats = NatsServer::start(&dir.path().join("js"), nats_port)
        .expect("nats-server -js (scripts/setup)");
    let zmq_port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{zmq_port}");

    // Engine, first life: a real mocker message, a positional batch, garbage, a gap with
    // an unknown and a malformed event, and a message of the wrong shape.
    let sample: serde_json::Value = mocker_sample();
    let real = &sample["messages"][0];
    let real_frames: Vec<Vec<u8>> = real["frames_hex"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| hex(h.as_str().unwrap()))
        .collect();
    let real_event = &real["decoded_payload"][1][0];
    let first_life = vec![
        real_frames.clone(),
        msg(
            1,
            batch(
                1795939426.5,
                vec![
                    Value::Array(vec![
                        s("BlockStored"),
                        ints(&[7, 8]),
                        Value::from(-3i64),
                        ints(&[1, 2, 3, 4]),
                        Value::from(2),
                        Value::Nil,
                        s("GPU"),
                        Value::Nil,
                        Value::Nil,
                        Value::from(0),
                    ]),
                    Value::Array(vec![
                        s("BlockRemoved"),
                        Value::Array(vec![Value::Binary((0u8..32).collect())]),
                        s("GPU"),
                    ]),
                ],
                Some(0),
            ),
        ),
        msg(2, b"\x93\xcb\x41 not msgpack".to_vec()),
        msg(
            5,
            batch(
                1795939427.0,
                vec![
                    Value::Array(vec![s("BlockPinned"), ints(&[1])]),
                    Value::Map(vec![
                        (s("type"), s("BlockRemoved")),
                        (s("block_hashes"), s("oops")),
                    ]),
                    Value::Map(vec![
                        (s("type"), s("AllBlocksCleared")),
                        (s("locality"), s("gpu")),
                    ]),
                ],
                None,
            ),
        ),
        vec![b"kv-events".to_vec(), vec![0, 1]],
    ];

    // The router log exists before the agent starts (read from its start).
    let log_path = dir.path().join("frontend.log");
    std::fs::write(&log_path, LOG_BEFORE).unwrap();
    let record_path = dir.path().join("agent.jsonl");

    let mut publisher = Publisher::start(&endpoint, &first_life, dir.path(), "life1");
    let agent = kvscope_agent::agent::start(AgentConfig {
        agent_id: "test-node".into(),
        cluster: "itest".into(),
        nats_url: format!("nats://127.0.0.1:{nats_port}"),
        kv_endpoints: vec![KvEndpoint {
            endpoint: endpoint.clone(),
            replay_endpoint: None,
            worker_id: Some(WORKER),
            dp_rank: None,
        }],
        router_log: Some(log_path.display().to_string()),
        from_start: true,
        record: Some(record_path.clone()),
        heartbeat_interval_secs: 0.2,
        log_poll_interval_ms: 20,
        metrics_listen: Some("127.0.0.1:0".into()),
        ..AgentConfig::default()
    })
    .await
    .unwrap();
    publisher.wait_sent();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&log_path)
        .unwrap()
        .write_all(LOG_AFTER.as_bytes())
        .unwrap();

    // Engine restart: a new process on the same port numbers from 0 again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    publisher.stop();
    let second_life = vec![msg(
        0,
        batch(
            1795939500.0,
            vec![Value::Array(vec![s("AllBlocksCleared")])],
            Some(0),
        ),
    )];
    let mut publisher = Publisher::start(&endpoint, &second_life, dir.path(), "life2");
    publisher.wait_sent();

    let client = async_nats::connect(format!("127.0.0.1:{nats_port}"))
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    let subjects = Subjects::new("itest");
    let want_counters = AgentCounters {
        kv_batches: 4,
        kv_events: 5,
        kv_bad_frames: 1,
        kv_decode_errors: 1,
        kv_unknown_events: 1,
        kv_malformed_events: 1,
        kv_events_medium_left_out: 0,
        kv_fields_left_out_lora_id: 0,
        kv_fields_left_out_extra_keys: 0,
        kv_fields_left_out_kv_cache_spec_sliding_window: 0,
        kv_fields_left_out_session_id: 0,
        kv_fields_left_out_lookahead_token_ids: 0,
        kv_fields_left_out_other: 0,
        kv_events_refused_other_owner: 0,
        // The clear's `locality` is read (a clear's is none a router heeds).
        kv_events_refused_not_local: 0,
        kv_events_refused_other_cache_group: 0,
        kv_events_refused_unknown_cache_kind: 0,
        kv_events_refused_unlearned_cache_group: 0,
        kv_events_refused_ambiguous_salt: 0,
        kv_media_blocks: 0,
        kv_media_blocks_without_placeholders: 0,
        kv_salts_inherited: 0,
        kv_sequence_gaps: 1,
        kv_missed_batches: 2,
        kv_sequence_resets: 1,
        kv_peer_violations: 0,
        kv_tap_panics: 0,
        kv_batches_replayed: 0,
        kv_gaps_recovered: 0,
        kv_replay_failures: 0,
        kv_replay_cuts: 0,
        kv_engine_times_ignored: 0,
        discovery_changes: 0,
        discovery_errors: 0,
        discovery_entries_skipped: 0,
        model_names_shortened: 0,
        log_lines: 10,
        log_malformed_lines: 1,
        log_lines_too_long: 0,
        log_truncations: 0,
        request_ids_shortened: 0,
        log_lines_future: 1,
        decisions_joined: 1,
        decisions_unjoined: 1,
        decisions_traced: 0,
        router_tenants_unread: 0,
        router_candidates_unjoined: 0,
        migration_lines: 2,
        published: 0, // not compared
        messages_published: 0,
        publish_dropped: 0,
        records_split: 0,
        records_set_aside: 0,
        publish_errors: 0,
        recording_write_failures: 0,
        bus_refusals: 0,
        // The captured batches and log lines carry their capture-time timestamps, hours
        // older than the heartbeats stamped now, so some count as late: not compared.
        records_late: 0,
        records_clock_corrected: 0,
        decisions_clock_behind: 0,
    };
    let settled = |c: &AgentCounters| {
        AgentCounters {
            published: 0,
            messages_published: 0,
            records_late: 0,
            ..c.clone()
        } == want_counters
    };
    let got = collect_until(&js, &subjects, |got| {
        kvscope_e2e::last_agent_counters(got).is_some_and(|c| settled(&c))
    })
    .await;

    // The /metrics endpoint serves the same counters.
    let addr = agent.metrics_addr().unwrap();
    let mut conn = std::net::TcpStream::connect(addr).unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(&mut conn, &mut text).unwrap();
    assert!(
        text.contains("kvscope_agent_kv_sequence_resets_total{agent=\"test-node\"} 1"),
        "{text}"
    );

    agent.shutdown().await;

    let kv: Vec<&KvEventBatch> = got
        .iter()
        .filter_map(|e| match &e.record {
            Record::KvEvents(b) => Some(b),
            _ => None,
        })
        .collect();
    let worker = WorkerKey {
        worker_id: WORKER,
        dp_rank: 0,
    };
    let real_hashes: Vec<u64> = real_event["block_hashes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect();
    let real_tokens: Vec<u32> = real_event["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let want_kv = vec![
        KvEventBatch {
            worker,
            publisher: endpoint.clone(),
            origin: Default::default(),
            seq: 0,
            sequence: SequenceStatus::First,
            engine_ts: real["decoded_payload"][0].as_f64().unwrap(),
            events: vec![KvEvent::BlockStored {
                block_hashes: real_hashes,
                parent_block_hash: None,
                // The tokens leave the node as their blocks' local hashes.
                token_ids: Vec::new(),
                block_size: 16,
                local_hashes: Some(local_block_hashes(&real_tokens, 16, DYNAMO_HASH_SEED)),
                lora_name: None,
                medium: None,
                cache_salt: None,
            }],
        },
        KvEventBatch {
            worker,
            publisher: endpoint.clone(),
            origin: Default::default(),
            seq: 1,
            sequence: SequenceStatus::InOrder,
            engine_ts: 1795939426.5,
            events: vec![
                KvEvent::BlockStored {
                    block_hashes: vec![7, 8],
                    parent_block_hash: Some((-3i64) as u64),
                    token_ids: Vec::new(),
                    block_size: 2,
                    local_hashes: Some(local_block_hashes(&[1, 2, 3, 4], 2, DYNAMO_HASH_SEED)),
                    lora_name: None,
                    medium: Some("GPU".into()),
                    cache_salt: None,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![u64::from_be_bytes([24, 25, 26, 27, 28, 29, 30, 31])],
                    medium: Some("GPU".into()),
                },
            ],
        },
        KvEventBatch {
            worker,
            publisher: endpoint.clone(),
            origin: Default::default(),
            seq: 5,
            // 3 and 4 never came, and 2 came as garbage: three batches the mirror lacks.
            sequence: SequenceStatus::Gap { missed: 3 },
            engine_ts: 1795939427.0,
            events: vec![KvEvent::AllBlocksCleared],
        },
        KvEventBatch {
            worker,
            publisher: endpoint.clone(),
            origin: Default::default(),
            seq: 0,
            sequence: SequenceStatus::Reset,
            engine_ts: 1795939500.0,
            events: vec![KvEvent::AllBlocksCleared],
        },
    ];
    assert_eq!(kv.into_iter().cloned().collect::<Vec<_>>(), want_kv);

    let decisions: Vec<&RoutingDecision> = got
        .iter()
        .filter_map(|e| match &e.record {
            Record::Decision(d) => Some(d),
            _ => None,
        })
        .collect();
    assert_eq!(
        decisions,
        vec![&RoutingDecision {
            tenant: None,
            model: None,
            request_id: "r1".into(),
            worker,
            isl_tokens: 41,
            block_size: 16,
            local_hashes: vec![10190339484985224020, 8425628386841907966],
            sequence_hashes: None,
            worker_type: Some("decode".into()),
            router_mode: Some("kv".into()),
            clock_behind_ms: None,
            selection: kvscope_wire::Selection {
                logit: Some(62.625),
                pinned: false,
                lower_tiers: Some(kvscope_wire::LowerTierBlocks::default()),
            },
            trace: None,
        }]
    );
    let migrations: Vec<&MigrationLogLine> = got
        .iter()
        .filter_map(|e| match &e.record {
            Record::Migration(m) => Some(m),
            _ => None,
        })
        .collect();
    assert_eq!(
        migrations,
        vec![
            &MigrationLogLine {
                kind: MigrationLogKind::Spill,
                request_id: Some("r1".into()),
                source: Some("758491669810558404".into()),
                target: Some("9969664417447597980".into()),
                tokens: Some(41),
                migratable_tokens: Some(32),
                fields: BTreeMap::new(),
                trace: None,
            },
            &MigrationLogLine {
                kind: MigrationLogKind::DispatchFailed,
                request_id: Some("r1".into()),
                source: None,
                target: None,
                tokens: None,
                migratable_tokens: None,
                fields: BTreeMap::from([("error".to_string(), "handshake timed out".to_string())]),
                trace: None,
            },
        ]
    );
    // Every envelope is from this agent, in non-decreasing observation time.
    assert!(got.iter().all(|e| e.agent == "test-node"));
    assert!(got.windows(2).all(|w| w[0].observed_ns <= w[1].observed_ns));

    // The recording holds the same records, in the same order (it may hold more
    // heartbeats: the last ones are written while shutting down).
    let rec = kvscope_wire::recording::read_recording(&record_path).unwrap();
    assert!(rec.bad_lines.is_empty());
    let strip = |v: &[Envelope]| {
        v.iter()
            .filter(|e| !matches!(e.record, Record::Heartbeat(_)))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(strip(&rec.envelopes), strip(&got));
    publisher.stop();
}

/// NATS comes up after the agent: records wait in the buffer, then all arrive once.
/// With a buffer of 3 while NATS is away, the rest are dropped and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_wait_for_nats_and_overflow_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let nats_port = free_port();
    let log_path = dir.path().join("frontend.log");
    let mut lines = String::new();
    for i in 0..5 {
        lines.push_str(&format!("2026-11-29T07:50:0{i}.000000Z  INFO p: KVMIGRATE: producer handshake obtained request_id=\"m{i}\"\n"));
    }
    std::fs::write(&log_path, &lines).unwrap();
    let agent = kvscope_agent::agent::start(AgentConfig {
        agent_id: "test-node".into(),
        cluster: "late".into(),
        nats_url: format!("nats://127.0.0.1:{nats_port}"),
        router_log: Some(log_path.display().to_string()),
        from_start: true,
        buffer_capacity: 3,
        heartbeat_interval_secs: 60.0,
        log_poll_interval_ms: 20,
        ..AgentConfig::default()
    })
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.stats().snapshot().log_lines < 5 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = agent.stats().snapshot();
    assert_eq!(
        (c.migration_lines, c.publish_dropped, c.published),
        (5, 2, 0)
    );
    assert_eq!(agent.buffered(), 3);

    let _nats = NatsServer::start(&dir.path().join("js"), nats_port)
        .expect("nats-server -js (scripts/setup)");
    let client = async_nats::connect(format!("127.0.0.1:{nats_port}"))
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    let got = collect_until(&js, &Subjects::new("late"), |got| got.len() >= 3).await;
    let ids: Vec<_> = got
        .iter()
        .map(|e| match &e.record {
            Record::Migration(m) => m.request_id.clone().unwrap(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(ids, vec!["m0", "m1", "m2"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.stats().snapshot().published < 3 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    agent.shutdown().await;
    // Nothing was stored twice despite the retries.
    let mut stream = js
        .get_stream(Subjects::new("late").stream_name())
        .await
        .unwrap();
    let state = stream.info().await.unwrap().state.clone();
    let mut records = 0;
    for seq in state.first_sequence..=state.last_sequence {
        let m = stream.get_raw_message(seq).await.unwrap();
        records += kvscope_wire::bundle::entries(&m.subject, &m.payload).count();
    }
    assert_eq!(records, 4, "3 records and the shutdown heartbeat");
}

/// On a server whose JetStream store cannot hold the agent's `stream_max_bytes` (4 GiB
/// by default; this store holds 2 MiB), the agent publishes to the stream that is
/// already there, created with a limit the store holds, and leaves its limits as they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_stream_is_used_when_the_server_refuses_the_agent_s_limits() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_with_store_limit(&dir.path().join("js"), 2 << 20)
        .expect("nats-server -js (scripts/setup)");
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let subjects = Subjects::new("small");
    let limits =
        || kvscope_wire::subject::stream_config(&subjects, Duration::from_secs(3600), 512 << 10, 1);
    js.get_or_create_stream(limits()).await.unwrap();
    let log_path = dir.path().join("frontend.log");
    let lines: String = (0..3)
        .map(|i| format!("2026-11-29T07:50:0{i}.000000Z  INFO p: KVMIGRATE: producer handshake obtained request_id=\"m{i}\"\n"))
        .collect();
    std::fs::write(&log_path, lines).unwrap();
    let agent = kvscope_agent::agent::start(AgentConfig {
        agent_id: "test-node".into(),
        cluster: "small".into(),
        nats_url: nats.url(),
        router_log: Some(log_path.display().to_string()),
        from_start: true,
        heartbeat_interval_secs: 60.0,
        log_poll_interval_ms: 20,
        ..AgentConfig::default()
    })
    .await
    .unwrap();
    let got = collect_until(&js, &subjects, |got| {
        got.iter()
            .filter(|e| matches!(e.record, Record::Migration(_)))
            .count()
            >= 3
    })
    .await;
    assert!(got.len() >= 3);
    agent.shutdown().await;
    let mut stream = js.get_stream(subjects.stream_name()).await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().config.max_bytes,
        limits().max_bytes,
        "the stream keeps the limits it was made with"
    );
}

/// `copytruncate` rotation with the real agent and NATS: the log is cut and written
/// again past the agent's position between two of its polls. Every line of the new
/// file arrives, after every line of the old one, and the cut is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_cut_and_rewritten_between_polls_loses_no_line() {
    let dir = tempfile::tempdir().unwrap();
    let nats_port = free_port();
    let _nats = NatsServer::start(&dir.path().join("js"), nats_port)
        .expect("nats-server -js (scripts/setup)");
    let log_path = dir.path().join("frontend.log");
    let line = |id: &str| {
        format!("2026-11-29T07:50:01.000000Z  INFO p: KVMIGRATE: producer handshake obtained request_id=\"{id}\"\n")
    };
    let before: String = (0..10).map(|i| line(&format!("m{i}"))).collect();
    std::fs::write(&log_path, &before).unwrap();
    let agent = kvscope_agent::agent::start(AgentConfig {
        agent_id: "test-node".into(),
        cluster: "cut".into(),
        nats_url: format!("nats://127.0.0.1:{nats_port}"),
        router_log: Some(log_path.display().to_string()),
        from_start: true,
        heartbeat_interval_secs: 0.5,
        // Slow polls, so the cut and the rewrite both land between two looks.
        log_poll_interval_ms: 400,
        ..AgentConfig::default()
    })
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.stats().snapshot().log_lines < 10 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // What logrotate's copytruncate does (the copy elsewhere), and the router writing
    // on at once: four times as much as was read.
    let after: String = (0..40).map(|i| line(&format!("n{i}"))).collect();
    std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&log_path)
        .unwrap();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&log_path)
        .unwrap()
        .write_all(after.as_bytes())
        .unwrap();

    let client = async_nats::connect(format!("127.0.0.1:{nats_port}"))
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    let migrations = |got: &[Envelope]| -> Vec<String> {
        got.iter()
            .filter_map(|e| match &e.record {
                Record::Migration(m) => m.request_id.clone(),
                _ => None,
            })
            .collect()
    };
    let got = collect_until(&js, &Subjects::new("cut"), |got| {
        migrations(got).len() >= 50
            && kvscope_e2e::last_agent_counters(got).is_some_and(|c| c.log_lines >= 50)
    })
    .await;
    let want: Vec<String> = (0..10)
        .map(|i| format!("m{i}"))
        .chain((0..40).map(|i| format!("n{i}")))
        .collect();
    assert_eq!(migrations(&got), want);
    let c = kvscope_e2e::last_agent_counters(&got).unwrap();
    assert_eq!((c.log_truncations, c.log_lines), (1, 50));
    agent.shutdown().await;
}
