//! The `kvscope-actuator` binary: `plan` against a real kvscope collector (a recording
//! replayed into it, served by its own HTTP router), saved reads, the configuration, and
//! the refusal to write without a token.

use kvscope_collector::fold::analyzer::AnalyzerConfig;
use kvscope_collector::state::Shared;
use kvscope_kit::clock::now_ns;
use kvscope_wire::hashing::{local_block_hashes, DYNAMO_HASH_SEED};
use kvscope_wire::nixl::{LatencySummary, NixlCallStats, NixlReport, NixlTransferStats, XferStage};
use kvscope_wire::recording::RecordingWriter;
use kvscope_wire::{
    AgentHeartbeat, Envelope, KvEvent, KvEventBatch, Record, RoutingDecision, SequenceStatus,
    WorkerKey,
};
use std::path::Path;
use std::process::{Command, Output};

const S: u64 = 1_000_000_000;
const BS: u32 = 16;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvscope-actuator"))
}

fn run(cmd: &mut Command) -> Output {
    cmd.env_remove("KVSCOPE_ACTUATOR_API_TOKEN")
        .env_remove("KVSCOPE_ACTUATOR_CONFIG")
        .output()
        .unwrap()
}

fn w(id: u64) -> WorkerKey {
    WorkerKey {
        worker_id: id,
        dp_rank: 0,
    }
}

/// A minute of a two-worker fleet ending just now: one request a second, each prompt
/// cached on worker 1 and routed to worker 2 (a 128-token spill), heartbeats from two
/// agents, and NIXL figures between the workers' agents (5 handshakes, 1 GB/s).
fn record_fleet(path: &Path) {
    let end = now_ns() - S / 2;
    let start = end - 60 * S;
    let mut rec = RecordingWriter::append(path).unwrap();
    let env = |agent: &str, t: u64, record: Record| Envelope {
        agent: agent.into(),
        observed_ns: t,
        record,
    };
    for i in 0..60u64 {
        let t = start + i * S;
        let tokens: Vec<u32> = (0..8 * BS).map(|k| (i as u32) * 1000 + k).collect();
        rec.write(&env(
            "node-a",
            t,
            Record::KvEvents(KvEventBatch {
                worker: w(1),
                publisher: "tcp://127.0.0.1:1".into(),
                origin: Default::default(),
                seq: i,
                sequence: if i == 0 {
                    SequenceStatus::First
                } else {
                    SequenceStatus::InOrder
                },
                engine_ts: 0.0,
                events: vec![KvEvent::BlockStored {
                    block_hashes: (0..8).map(|b| i * 100 + b + 1).collect(),
                    parent_block_hash: None,
                    token_ids: tokens.clone(),
                    block_size: BS,
                    local_hashes: None,
                    lora_name: None,
                    medium: None,
                    cache_salt: None,
                }],
            }),
        ))
        .unwrap();
        let mut prompt = tokens.clone();
        prompt.extend(0..10);
        rec.write(&env(
            "node-a",
            t + S / 10,
            Record::Decision(RoutingDecision {
                tenant: None,
                model: None,
                request_id: format!("req-{i}"),
                worker: w(2),
                isl_tokens: prompt.len() as u64,
                block_size: BS,
                local_hashes: local_block_hashes(&prompt, BS as usize, DYNAMO_HASH_SEED),
                sequence_hashes: None,
                worker_type: None,
                router_mode: None,
                clock_behind_ms: None,
                selection: Default::default(),
                trace: None,
            }),
        ))
        .unwrap();
        for agent in ["node-a", "node-b"] {
            rec.write(&env(
                agent,
                t + S / 2,
                Record::Heartbeat(AgentHeartbeat::default()),
            ))
            .unwrap();
        }
    }
    let nixl = NixlReport {
        transfers: vec![NixlTransferStats {
            pid: 7,
            local_agent: "nixl-2".into(),
            remote_agent: "nixl-1".into(),
            op: "READ".into(),
            stage: XferStage::Complete,
            status: "SUCCESS".into(),
            transfers: 10,
            bytes: 10_000_000,
            bytes_unknown: 0,
            descriptors: 10,
            latency: LatencySummary::exact(&[1_000_000; 10]),
        }],
        calls: vec![NixlCallStats {
            pid: 7,
            local_agent: "nixl-2".into(),
            remote_agent: "nixl-1".into(),
            call: "loadRemoteMD".into(),
            status: "SUCCESS".into(),
            calls: 5,
            bytes: 0,
            bytes_partial: 0,
            latency: LatencySummary::exact(&[800_000; 5]),
        }],
        ..NixlReport::default()
    };
    rec.write(&env("node-b", end, Record::Nixl(nixl))).unwrap();
    rec.flush().unwrap();
}

const CONFIG: &str = r#"
[policy]
min_tokens = 64
min_true_delta_tok_per_s = 50.0
kv_bytes_per_token = 1000
prefill_tok_per_s = 1000.0

[[worker_agents]]
worker_id = 1
nixl_agent = "nixl-1"

[[worker_agents]]
worker_id = 2
nixl_agent = "nixl-2"
"#;

async fn serve_collector(recording: &Path) -> String {
    let analyzer = kvscope_collector::whatif::recording::replay(
        recording,
        AnalyzerConfig {
            window_secs: 5.0,
            warmup_secs: 5.0,
            ..AnalyzerConfig::default()
        },
    )
    .unwrap();
    let app = kvscope_collector::serve::api::router(Shared::new(
        analyzer,
        None,
        kvscope_wire::Subjects::new("test"),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_against_a_real_collector_would_go_live_and_acts_on_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let recording = dir.path().join("fleet.jsonl");
    record_fleet(&recording);
    let collector = serve_collector(&recording).await;
    let cfg = dir.path().join("actuator.toml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let audit = dir.path().join("audit.jsonl");
    let saved = dir.path().join("read.json");
    let (cfg2, audit2) = (cfg.clone(), audit.clone());
    let args = move |extra: &[&str]| {
        let mut c = bin();
        c.arg("--config")
            .arg(&cfg2)
            .arg("--audit-log")
            .arg(&audit2)
            .arg("--collector-url")
            .arg(&collector)
            .arg("plan")
            .args(extra);
        c
    };
    // The collector serves from this runtime: run the binary beside it.
    let out = tokio::task::spawn_blocking(move || {
        let saved = saved.to_str().unwrap();
        let json = run(&mut args(&["--json", "--save", saved]));
        let text = run(&mut args(&[]));
        let from_file = run(&mut args(&["--json", "--input", saved]));
        let live = run(&mut args(&["--current", "live"]));
        (json, text, from_file, live)
    })
    .await
    .unwrap();
    let (json, text, from_file, live) = out;
    for o in [&json, &text, &from_file, &live] {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let ev: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(ev["transition"], "enter_live", "{ev:#}");
    assert_eq!(
        (ev["from"].as_str(), ev["to"].as_str()),
        (Some("DRY"), Some("LIVE"))
    );
    let f = &ev["figures"];
    assert_eq!(
        f["nixl"]["handshakes"],
        serde_json::json!({"ok": 5, "failed": 0})
    );
    assert_eq!(f["nixl"]["mapped"], true);
    let newest = &f["windows"][0];
    assert_eq!(newest["spills"], 5, "{newest:#}");
    assert_eq!(newest["candidates"], 5);
    assert_eq!(newest["beneficial"], 5);
    assert_eq!(f["entry_streak"], 6);

    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("DRY → would go LIVE"), "{text}");
    assert!(text.contains("6 consecutive windows qualify"), "{text}");
    assert!(
        text.contains("Nothing was changed (plan acts on nothing)."),
        "{text}"
    );
    assert!(!audit.exists(), "plan writes no audit entry");

    // The saved read gives the same evaluation.
    let again: serde_json::Value = serde_json::from_slice(&from_file.stdout).unwrap();
    assert_eq!(again["transition"], ev["transition"]);
    assert_eq!(again["figures"]["windows"], ev["figures"]["windows"]);

    // Told the router is LIVE, the plan keeps it LIVE.
    let live = String::from_utf8_lossy(&live.stdout);
    assert!(live.contains("LIVE → would stay LIVE"), "{live}");
}

#[test]
fn writing_without_a_token_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("actuator.toml");
    std::fs::write(
        &cfg,
        "[[mode_backends]]\nkind = \"file\"\npath = \"m.env\"\n[api]\nenabled = false\n",
    )
    .unwrap();
    let out = run(bin()
        .arg("--config")
        .arg(&cfg)
        .arg("--audit-log")
        .arg(dir.path().join("audit.jsonl"))
        .arg("run"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no API token configured, and 1 mode backend(s) configured"),
        "{err}"
    );
    assert!(!dir.path().join("m.env").exists());
    // The API alone needs one too.
    let out = run(bin()
        .arg("--audit-log")
        .arg(dir.path().join("audit.jsonl"))
        .args(["--collector-url", "http://127.0.0.1:9", "run"]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the API is enabled (on 127.0.0.1:9466)"),
        "{err}"
    );
    assert!(
        !dir.path().join("audit.jsonl").exists(),
        "refused before anything was written"
    );
}

#[test]
fn help_explains_the_policy_and_print_config_round_trips() {
    let help = run(bin().arg("--help"));
    let help = String::from_utf8_lossy(&help.stdout);
    for s in [
        "POLICY.",
        "min_windows (6)",
        "producer handshake obtained",
        "PLAN.",
        "AUDIT.",
        "BACKENDS.",
        "SAFETY.",
        "bearer token",
    ] {
        assert!(help.contains(s), "{s} missing from --help:\n{help}");
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("actuator.toml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let out = run(bin()
        .arg("--config")
        .arg(&cfg)
        .env("KVSCOPE_ACTUATOR_MIN_WINDOWS", "9")
        .arg("print-config"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    let back = kvscope_actuator::config::ActuatorConfig::from_toml(&printed).unwrap();
    assert_eq!(back.policy.min_windows, 9);
    assert_eq!(back.policy.min_tokens, 64);
    assert_eq!(back.worker_agents.len(), 2);
}

/// The daemon reads the collector only once it says it has caught up: a collector that
/// does not consume its stream (here, one serving a replay with no bus) answers 503 on
/// `/readyz`, and the client reports why instead of handing its figures on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_has_not_caught_up_is_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let recording = dir.path().join("fleet.jsonl");
    record_fleet(&recording);
    let collector = serve_collector(&recording).await;
    let client = kvscope_actuator::decide::input::CollectorClient::new(
        &collector,
        std::time::Duration::from_secs(5),
        10,
        10,
    )
    .unwrap();
    let err = client.ready().await.unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(
            err,
            kvscope_actuator::decide::input::InputError::NotReady { .. }
        ),
        "{text}"
    );
    assert!(text.contains("bus: not consuming the stream"), "{text}");
    // Its figures are still there for `plan`, which acts on nothing.
    assert!(client.fetch().await.is_ok());
}
