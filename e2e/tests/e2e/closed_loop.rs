//! The closed loop on the lab, every part real: Dynamo 1.6.1's KV router and 3 mocker
//! workers spill under a chat workload; `kvscope agent` taps the mockers' KV events and
//! the router's log, and traces NIXL with eBPF; `kvscope collector` measures spills;
//! the data plane is one real NIXL 1.5.1 agent per mocker, in a `kvscope-nixl-lab
//! sidecar` inside that mocker's process tree (as a vLLM engine's NIXL agent lives under
//! Dynamo's worker), which also publishes the blocks migrated to it as vLLM KV events;
//! `kvscope-nixl-lab serve` follows the mockers' KV events, takes directives and drives
//! the sidecars; `kvscope actuator` reads the collector, flips DRY → LIVE (file backend)
//! and sends directives to the lab. No worker id is given to any kvscope process: the
//! agent tells the workers of the sidecars' publishers and NIXL agents from the process
//! tree, and the actuator maps NIXL agents to workers from what the agent told.
//!
//! Asserts: with the (test-tuned) thresholds met the actuator goes LIVE and issues
//! migrations the lab performs over NIXL; the agent's eBPF counts exactly the READs the
//! lab made (start-up probes + migrations) and the handshakes; every migration's READ
//! spans (exported over OTLP to a receiver in the test) name its request — read from
//! the notification each READ carries, as vLLM's NixlConnector sends it — sit in the
//! trace of that request's spill verdict span, and add up to the lab's bytes; the collector applied
//! the migrated blocks to the targets' mirrors; then injected handshake failures drive
//! the actuator back to DRY, and the audit log explains both flips; `kvscope whatif`'s
//! cost side, priced from the recording, predicts the bytes each migration moved and
//! the NIXL time the data plane's clock measured. Throughout, every
//! socket of every process of the loop (Dynamo's, NATS, the NIXL data plane with UCX,
//! agent, collector, actuator) stays on 127.0.0.1: no connection to another address,
//! and no listener off loopback except the wildcard binds inside Dynamo 1.6.1 that no
//! setting changes, which the test lists. Needs root (eBPF) and the lab
//! (`scripts/setup`); fails saying so otherwise.

use kvscope_e2e::otlp_receiver;

use kvscope_actuator::act::audit::AuditEntry;
use kvscope_actuator::act::audit::AuditEvent;
use kvscope_actuator::act::mode::Mode;
use kvscope_actuator::decide::policy::{SafetyTrigger, Transition};
use kvscope_collector::fold::analyzer::AnalyzerConfig;
use kvscope_collector::whatif::migration::Pricing;
use kvscope_collector::whatif::WhatIf;
use kvscope_discovery::procfs::{SocketInfo, SocketWatch};
use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::LabConfig;
use kvscope_nixl_lab::serve::process::ServeProcess;
use kvscope_nixl_lab::serve::{MigrationOutcome, ServeStatus, ServeWorker};
use kvscope_nixl_lab::sidecar::SidecarReady;
use kvscope_wire::cost::FigureSource;
use kvscope_wire::nixl::NixlPair;
use kvscope_wire::recording::read_recording;
use kvscope_wire::{KvEvent, Record, WorkerKey};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const WINDOW_SECS: f64 = 4.0;
const TOKEN: &str = "closed-loop-test-token-0123456789";

async fn get_json<T: serde::de::DeserializeOwned>(url: &str) -> anyhow::Result<T> {
    Ok(reqwest::get(url).await?.error_for_status()?.json().await?)
}

/// Poll `probe` every 250 ms until it returns Some, for at most `limit`; on time-out
/// fail with `what` and the last state `show` gives.
async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + limit;
    loop {
        match probe().await {
            Ok(v) => return v,
            Err(last) => {
                assert!(
                    Instant::now() < deadline,
                    "waited {limit:?} for {what}; last: {last}"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// No socket talks to or listens on anything but loopback, except the wildcard binds
/// Dynamo 1.6.1 makes whatever its settings say (its event-plane PUBs, which bind
/// `tcp://0.0.0.0:<port>` and only advertise `DYN_EVENT_PLANE_HOST`, and the mocker's
/// vLLM-format publisher and replay socket, bound on `tcp://*:<port>`): those are
/// listed, and any other fails the test.
fn assert_loopback_only(seen: &[SocketInfo], lab: &kvscope_lab::Lab) {
    let manifest = lab.manifest();
    let entries = kvscope_discovery::backend::read_file_store(&manifest.discovery_dir).unwrap();
    let mut dynamo_wildcards: BTreeMap<u16, String> =
        kvscope_discovery::event_channels(entries.iter().map(|(k, v)| (k.as_str(), v)))
            .into_iter()
            .filter_map(|(topic, ch)| match ch {
                kvscope_discovery::Channel::Zmq { endpoint } => {
                    let port = endpoint.rsplit(':').next()?.parse().ok()?;
                    Some((port, format!("event plane PUB ({topic})")))
                }
                kvscope_discovery::Channel::Nats { .. } => None,
            })
            .collect();
    let port_of = |ep: &str| ep.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
    for w in &manifest.workers {
        if let Some(port) = port_of(&w.kv_events_endpoint) {
            dynamo_wildcards.insert(port, "mocker vLLM-format KV publisher".into());
        }
        if let Some(port) = w.kv_replay_endpoint.as_deref().and_then(port_of) {
            dynamo_wildcards.insert(port, "mocker KV replay socket (ROUTER)".into());
        }
    }
    let dynamo_pids: BTreeSet<u32> = kvscope_discovery::procfs::pids_in_groups(
        Path::new("/proc"),
        &manifest
            .workers
            .iter()
            .map(|w| w.process.pid)
            .chain([manifest.frontend.pid])
            .collect::<Vec<_>>(),
    )
    .into_iter()
    .collect();
    assert!(
        seen.iter().any(|s| s.process.starts_with("kvscope-nixl")),
        "the NIXL data plane's sockets were seen: {seen:#?}"
    );
    let off_loopback: Vec<String> = seen
        .iter()
        .filter(|s| !s.peer_is_loopback())
        .map(|s| s.to_string())
        .collect();
    assert!(
        off_loopback.is_empty(),
        "connections off loopback: {off_loopback:#?}"
    );
    let mut listed = Vec::new();
    let mut wrong = Vec::new();
    for s in seen.iter().filter(|s| s.is_listener()) {
        if kvscope_discovery::procfs::is_loopback(s.local.ip()) {
            continue;
        }
        match dynamo_wildcards.get(&s.local.port()) {
            Some(role) if s.is_wildcard() && dynamo_pids.contains(&s.pid) => {
                listed.push(format!("{s}: {role}"))
            }
            _ => wrong.push(s.to_string()),
        }
    }
    assert!(wrong.is_empty(), "listeners off loopback: {wrong:#?}");
    eprintln!(
        "{} sockets seen, all on loopback but these wildcard binds inside Dynamo 1.6.1 \
         (no setting changes them):\n  {}",
        seen.len(),
        listed.join("\n  ")
    );
}

/// A sidecar's ready file, once it is written (the sidecar starts with its mocker).
fn wait_ready(path: &Path) -> SidecarReady {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(b) = std::fs::read(path) {
            return serde_json::from_slice(&b).unwrap();
        }
        assert!(Instant::now() < deadline, "no {} in 60 s", path.display());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn read_audit(path: &Path) -> Vec<AuditEntry> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("audit line {l}: {e}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spills_go_live_migrate_over_nixl_and_handshake_failures_drop_to_dry() {
    let lab_dir = kvscope_lab::paths::default_lab_dir();
    let libs = kvscope_nixl_lab::NixlLibs::locate(&lab_dir).unwrap_or_else(|e| panic!("{e}"));
    let exe = kvscope_e2e::kvscope();
    // The NIXL data plane: under each mocker, as a vLLM engine's NIXL agent and KV
    // publisher live under Dynamo's worker process, a sidecar holds the worker's NIXL
    // agent and publishes the blocks migrated to it; `serve` (started below) drives them.
    // Agent names unique to this run: the probes see every process using the wheel's
    // libnixl.so, other NIXL labs on this machine included, and those name their agents
    // decode-0, decode-1, ….
    let prefix = format!("loop{}-", std::process::id());
    let agent_name = |i: usize| format!("{prefix}decode-{i}");
    let sidecars = tempfile::tempdir().unwrap();
    let ready_file = |i: usize| sidecars.path().join(format!("sidecar-{i}.json"));
    let sidecar: Vec<String> = [
        kvscope_nixl_lab::lab_binary().display().to_string(),
        "sidecar".into(),
        "--name".into(),
        format!("{prefix}decode-{{index}}"),
        "--index".into(),
        "{index}".into(),
        "--ready-file".into(),
        sidecars
            .path()
            .join("sidecar-{index}.json")
            .display()
            .to_string(),
        "--deadline-secs".into(),
        "600".into(),
    ]
    .into();
    let lab = LabConfig {
        workers: 3,
        // A softmax temperature makes the router spill in every window even on a busy
        // machine (0.2 left a window without a spill here once).
        frontend_args: vec!["--router-temperature".into(), "0.5".into()],
        // Room enough that a source rarely evicts a spill's blocks before its directive.
        num_gpu_blocks: 2048,
        worker_sidecar: sidecar,
        ..LabConfig::default()
    };
    let libnixl = libs.libnixl.display().to_string();
    let rx = otlp_receiver::Receiver::start().await;
    let otlp_env = |url: &str| vec![("OTEL_EXPORTER_OTLP_ENDPOINT".to_string(), url.to_string())];
    let mut run = kvscope_e2e::fleet_with(
        FleetRunConfig {
            agent_env: otlp_env(&rx.grpc_url),
            collector_env: otlp_env(&rx.grpc_url),
            ..FleetRunConfig::new(lab, WINDOW_SECS)
        },
        |lab| {
            // The sidecars' publishers, by endpoint only: the agent tells each one's
            // worker from the process tree (no worker id anywhere on kvscope's side).
            let mut args = vec!["--nixl-lib".to_string(), libnixl.clone()];
            for w in lab.workers() {
                let ready = wait_ready(&ready_file(w.index));
                args.push("--kv".into());
                args.push(ready.kv_endpoint);
            }
            Ok(args)
        },
    )
    .await
    .expect("lab, agent (with eBPF) and collector start");
    let sockets = SocketWatch::start(run.process_groups(), Duration::from_millis(200));
    let run_dir = run.run_dir();
    let mockers: Vec<(usize, u64, String)> = run
        .lab()
        .workers()
        .iter()
        .map(|w| (w.index, w.worker_id, w.kv_events_endpoint.clone()))
        .collect();

    // The coordinator, started after the agent so its probes see the start-up
    // handshakes and probe READs. It is the lab's data plane, told which sidecar stands
    // for which worker; kvscope is told nothing.
    let serve_workers: Vec<ServeWorker> = mockers
        .iter()
        .map(|(i, id, ep)| ServeWorker {
            name: agent_name(*i),
            worker: WorkerKey {
                worker_id: *id,
                dp_rank: 0,
            },
            engine: Some(ep.clone()),
            kv_bind: String::new(),
            sidecar: Some(ready_file(*i)),
        })
        .collect();
    let serve = ServeProcess::start(
        &kvscope_nixl_lab::lab_binary(),
        &serve_workers,
        TOKEN,
        &run_dir.join("nixl-serve.log"),
        &[],
        Duration::from_secs(90),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    sockets.add_groups(&[serve.process.pid()]);
    let serve_url = serve.url();

    // The actuator, tuned so that the small lab qualifies within seconds: any spill of a
    // block or more is worth migrating (recompute priced at 50 tok/s), 4 windows of 4 s.
    let token_file = run_dir.join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let audit_path = run_dir.join("actuator-audit.jsonl");
    let mode_file = run_dir.join("migration.env");
    let api_port_held = kvscope_lab::ports::reserve_ports(1).unwrap();
    let api_port = api_port_held.ports()[0];
    let config = format!(
        r#"collector_url = "{collector}"
interval_secs = 1.0
audit_log = "{audit}"

[policy]
min_windows = 4
min_true_delta_tok_per_s = 1.0
min_beneficial_share = 0.5
min_candidate_spills = 1
min_tokens = 16
kv_bytes_per_token = 256
prefill_tok_per_s = 50.0
use_measured_prefill = false
dispatch_overhead_ms = 0.0
min_handshakes = 3
min_handshake_success_ratio = 0.9
max_data_age_secs = 30.0
max_agent_silence_secs = 30.0
cooldown_secs = 5.0
max_flips_per_hour = 6

[api]
listen = "127.0.0.1:{api_port}"
token_file = "{token}"

[[mode_backends]]
kind = "file"
path = "{mode_file}"

[directives]
enabled = true
url = "{serve_url}/v1/migrations"
token_file = "{token}"
rate_per_s = 20.0
burst = 20
max_age_secs = 10.0
"#,
        collector = run.api(),
        audit = audit_path.display(),
        token = token_file.display(),
        mode_file = mode_file.display(),
    );
    let config_path = run_dir.join("actuator.toml");
    std::fs::write(&config_path, config).unwrap();
    let mut cmd = Command::new(&exe);
    cmd.arg("actuator")
        .arg("--config")
        .arg(&config_path)
        .arg("run")
        .env("RUST_LOG", "info")
        .env_remove("KVSCOPE_ACTUATOR_API_TOKEN");
    let actuator = ManagedProcess::spawn("actuator", cmd, &run_dir.join("actuator.log"))
        .expect("the actuator starts");
    sockets.add_groups(&[actuator.pid()]);
    let mut actuator = StopOnDrop(vec![actuator]);
    let status_url = format!("http://127.0.0.1:{api_port}/api/status");

    let wl = WorkloadConfig {
        frontend: run.lab().frontend_url().to_string(),
        sessions: 48,
        families: 3,
        max_turns: 40,
        concurrency: 32,
        rate: Some(20.0),
        duration_secs: 120.0,
        ..WorkloadConfig::default()
    };
    let workload = tokio::spawn(workload::run(wl));

    // 1. LIVE on measured evidence.
    wait_for(
        "the actuator to go LIVE",
        Duration::from_secs(90),
        || async {
            let s: Value = get_json(&status_url).await.map_err(|e| e.to_string())?;
            if s["mode"] == "LIVE" {
                Ok(())
            } else {
                Err(format!(
                    "mode {}; reasons {}",
                    s["mode"], s["last_evaluation"]["reasons"]
                ))
            }
        },
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(&mode_file).unwrap(),
        "DYN_KV_MIGRATION=1\n",
        "the file backend holds LIVE"
    );

    // 2. Migrations performed over NIXL.
    let http = reqwest::Client::new();
    let lab_status = |http: reqwest::Client, url: String| async move {
        let s: ServeStatus = http
            .get(format!("{url}/v1/status"))
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        Ok::<ServeStatus, String>(s)
    };
    // Enough migrations that their costs, summed, average out a busy machine's jitter.
    wait_for("12 migrations", Duration::from_secs(90), || {
        let f = lab_status(http.clone(), serve_url.clone());
        async move {
            let s = f.await?;
            if s.directives.migrated >= 12 {
                Ok(())
            } else {
                Err(format!("{:?}", s.directives))
            }
        }
    })
    .await;

    // 3. Injected handshake failures: back to DRY.
    let r = http
        .post(format!("{serve_url}/v1/inject"))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({"handshake_failures": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    wait_for(
        "the actuator to drop to DRY",
        Duration::from_secs(60),
        || async {
            let s: Value = get_json(&status_url).await.map_err(|e| e.to_string())?;
            if s["mode"] == "DRY" {
                Ok(())
            } else {
                Err(format!(
                    "mode {}; directives {}",
                    s["mode"], s["directives"]
                ))
            }
        },
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(&mode_file).unwrap(),
        "DYN_KV_MIGRATION=dry\n"
    );
    workload.abort();

    // The lab's account of what it did; the eBPF figures must come to equal it exactly.
    let want = |st: &ServeStatus| {
        // Per (target, source): the READs the lab made (one start-up probe per ordered
        // pair + every migration's); per target: the loads that failed.
        let mut reads: BTreeMap<(String, String), u64> = BTreeMap::new();
        for t in 0..3 {
            for s in (0..3).filter(|&s| s != t) {
                reads.insert((agent_name(t), agent_name(s)), 1);
            }
        }
        let mut failed: BTreeMap<String, u64> = BTreeMap::new();
        for o in &st.outcomes {
            let (Some(src), Some(dst)) = (&o.source_agent, &o.target_agent) else {
                continue;
            };
            *reads.entry((dst.clone(), src.clone())).or_default() += o.transfers;
            if o.handshakes_failed > 0 {
                *failed.entry(dst.clone()).or_default() += o.handshakes_failed;
            }
        }
        (reads, failed)
    };
    let (got, lab_final) = wait_for(
        "the agent's eBPF figures to equal the lab's READs and failed loads",
        Duration::from_secs(30),
        || {
            let st = lab_status(http.clone(), serve_url.clone());
            let api = run.api();
            let prefix = prefix.clone();
            let want = &want;
            async move {
                let st = st.await?;
                let (want_reads, want_failed) = want(&st);
                let pairs: Vec<NixlPair> = get_json(&format!("{api}/api/nixl"))
                    .await
                    .map_err(|e| e.to_string())?;
                let pairs: Vec<NixlPair> = pairs
                    .into_iter()
                    .filter(|p| p.local_agent.starts_with(&prefix))
                    .collect();
                let reads: BTreeMap<(String, String), u64> = pairs
                    .iter()
                    .filter_map(|p| {
                        let n = p.transfers_ok.get("READ").copied().unwrap_or(0);
                        (n > 0).then(|| ((p.local_agent.clone(), p.remote_agent.clone()), n))
                    })
                    .collect();
                let failed: BTreeMap<String, u64> = pairs
                    .iter()
                    .filter(|p| p.handshakes_failed > 0)
                    .map(|p| (p.local_agent.clone(), p.handshakes_failed))
                    .collect();
                if reads == want_reads && failed == want_failed {
                    Ok((pairs, st))
                } else {
                    Err(format!(
                        "reads {reads:?} vs {want_reads:?}; failed {failed:?} vs {want_failed:?}"
                    ))
                }
            }
        },
    )
    .await;
    let migrated = lab_final
        .outcomes
        .iter()
        .filter(|o| o.outcome == "migrated")
        .count();
    assert!(migrated >= 3, "{migrated} migrations");
    assert!(
        lab_final
            .outcomes
            .iter()
            .any(|o| o.outcome == "handshake_failed" && o.handshakes_failed >= 1),
        "the injected failures reached NIXL"
    );
    assert!(got.iter().all(|p| p.transfers_failed == 0));

    // Each migration's READs as spans: named by its request, in its verdict's trace,
    // bytes and count equal to the lab's.
    let migrations: Vec<_> = lab_final
        .outcomes
        .iter()
        .filter(|o| o.outcome == "migrated")
        .collect();
    let attrs =
        |s: &kvscope_otlp::proto::trace::v1::Span| otlp_receiver::string_attrs(&s.attributes);
    let (transfers, verdicts) = wait_for(
        "every migration's READ spans and verdict span",
        Duration::from_secs(30),
        || {
            let agent = rx.spans("kvscope-agent");
            let collector = rx.spans("kvscope-collector");
            let migrations = &migrations;
            async move {
                let transfers: Vec<_> = agent
                    .into_iter()
                    .map(|(_, _, s)| s)
                    .filter(|s| s.name == kvscope_agent::nixl::spans::TRANSFER_SPAN)
                    .collect();
                let verdicts: Vec<_> = collector
                    .into_iter()
                    .map(|(_, _, s)| s)
                    .filter(|s| s.name == kvscope_collector::serve::spans::SPILL_SPAN)
                    .collect();
                let missing: Vec<&str> = migrations
                    .iter()
                    .map(|o| o.request_id.as_str())
                    .filter(|rid| {
                        let named = |s: &&kvscope_otlp::proto::trace::v1::Span| {
                            attrs(s).get("kvscope.request_id").map(String::as_str) == Some(*rid)
                        };
                        !(transfers.iter().any(|s| named(&s)) && verdicts.iter().any(|s| named(&s)))
                    })
                    .collect();
                if missing.is_empty() {
                    Ok((transfers, verdicts))
                } else {
                    Err(format!("no READ or verdict span for {missing:?}"))
                }
            }
        },
    )
    .await;
    for o in &migrations {
        let rid = o.request_id.as_str();
        let of_request: Vec<_> = transfers
            .iter()
            .filter(|s| attrs(s).get("kvscope.request_id").map(String::as_str) == Some(rid))
            .collect();
        let verdict = verdicts
            .iter()
            .find(|s| attrs(s).get("kvscope.request_id").map(String::as_str) == Some(rid))
            .unwrap();
        let bytes: u64 = of_request
            .iter()
            .map(|s| attrs(s)["nixl.bytes"].parse::<u64>().unwrap())
            .sum();
        assert_eq!(
            (of_request.len() as u64, bytes),
            (o.transfers, o.bytes),
            "{rid}: READ spans and bytes = the lab's"
        );
        for s in &of_request {
            let a = attrs(s);
            assert_eq!(a["nixl.op"], "READ");
            assert_eq!(a["nixl.notif"], format!("{rid}:1"));
            assert_eq!(Some(&a["nixl.local_agent"]), o.target_agent.as_ref());
            assert_eq!(Some(&a["nixl.remote_agent"]), o.source_agent.as_ref());
            assert_eq!(
                s.trace_id, verdict.trace_id,
                "{rid}: in its verdict's trace"
            );
        }
    }
    // And in the collector's verdicts: what NIXL moved for each migrated request.
    let api = run.api();
    let verdicts: Vec<Value> = wait_for(
        "each migrated request's NIXL figures in /api/verdicts",
        Duration::from_secs(30),
        || {
            let url = format!("{api}/api/verdicts?limit=100000");
            let migrations = &migrations;
            async move {
                let verdicts: Vec<Value> = get_json(&url).await.map_err(|e| e.to_string())?;
                for o in migrations {
                    let Some(v) = verdicts.iter().find(|v| v["request_id"] == o.request_id) else {
                        return Err(format!("no verdict for {}", o.request_id));
                    };
                    let got = (v["nixl"]["transfers"].as_u64(), v["nixl"]["bytes"].as_u64());
                    if got != (Some(o.transfers), Some(o.bytes)) {
                        return Err(format!(
                            "{}: nixl {} vs the lab's {} transfers, {} bytes",
                            o.request_id, v["nixl"], o.transfers, o.bytes
                        ));
                    }
                    if v["nixl"]["nixl_seconds"].as_f64().unwrap_or(0.0) <= 0.0 {
                        return Err(format!("{}: no NIXL time", o.request_id));
                    }
                }
                Ok(verdicts)
            }
        },
    )
    .await;

    // The audit log explains both flips.
    actuator.stop(Duration::from_secs(5));
    let audit = read_audit(&audit_path);
    let flips: Vec<_> = audit
        .iter()
        .filter_map(|e| match &e.event {
            AuditEvent::ModeChanged { evaluation } => Some(evaluation),
            _ => None,
        })
        .collect();
    let live = flips
        .iter()
        .find(|e| e.to == Mode::Live)
        .expect("an audited flip to LIVE");
    assert_eq!(live.transition, Transition::EnterLive);
    assert!(live.safety.is_empty());
    let f = live.figures.as_ref().expect("the figures behind LIVE");
    assert!(f.entry_streak >= 4, "{}", f.entry_streak);
    assert!(f.nixl.proven, "the NIXL path was proven by the probes");
    assert!(!live.reasons.is_empty());
    let to_dry = flips
        .iter()
        .find(|e| e.from == Mode::Live && e.to == Mode::Dry)
        .expect("an audited drop to DRY");
    assert_eq!(to_dry.transition, Transition::SafetyDrop);
    assert!(
        to_dry.safety.iter().any(|t| matches!(
            t,
            SafetyTrigger::HandshakeFailures { .. } | SafetyTrigger::DirectiveFailures { .. }
        )),
        "the drop names the failing handshakes or directives: {:?}",
        to_dry.safety
    );
    assert!(
        audit
            .iter()
            .any(|e| matches!(&e.event, AuditEvent::DirectiveOutcomes { .. })),
        "directive outcomes are audited"
    );

    // The collector applied the migrated blocks to the targets' mirrors: every batch the
    // data plane published arrived from its publisher, under the target's worker id.
    let seen = sockets.finish();
    assert_loopback_only(&seen, run.lab());
    drop(serve);
    run.stop_agent().await;
    run.wait_drained(Duration::from_secs(1), Duration::from_secs(60))
        .await
        .expect("the collector catches up");
    let summary = run.summary().await.unwrap();
    let recording = run.recording.clone();
    run.stop();
    let rec = read_recording(&recording).unwrap();
    let publishers: BTreeMap<String, WorkerKey> = lab_final
        .workers
        .iter()
        .map(|w| (w.kv_endpoint.clone(), w.worker))
        .collect();
    let mut landed = 0u64;
    let mut blocks = BTreeSet::new();
    for e in &rec.envelopes {
        let Record::KvEvents(b) = &e.record else {
            continue;
        };
        let Some(target) = publishers.get(&b.publisher) else {
            continue;
        };
        assert_eq!(
            b.worker, *target,
            "a data-plane batch under its target's id"
        );
        for ev in &b.events {
            let KvEvent::BlockStored { block_hashes, .. } = ev else {
                panic!("the data plane only publishes stores: {ev:?}");
            };
            blocks.extend(block_hashes.iter().map(|h| (b.worker, *h)));
        }
        landed += 1;
    }
    let published: u64 = lab_final.workers.iter().map(|w| w.published_batches).sum();
    assert!(published >= 3);
    assert_eq!(
        landed, published,
        "every batch the data plane published reached the collector"
    );
    assert!(!blocks.is_empty());
    let c = &summary["counters"];
    assert_eq!(c["unknown_parent_events"], 0, "{c}");
    assert_eq!(c["token_count_mismatches"], 0, "{c}");

    migration_costs_as_predicted(&recording, &migrations, &verdicts);
}

/// The what-if's cost side against what was measured: the recorded spills the lab
/// migrated, priced as `kvscope whatif` prices them (the lab's 256 B per token, the
/// recording's NIXL figures through the owners the agent told, a handshake at the pair's
/// mean), against the bytes the data plane moved and its own clock (each migration's
/// `loadRemoteMD` and post → done), and the probes' post → done for the request.
fn migration_costs_as_predicted(
    recording: &Path,
    migrations: &[&MigrationOutcome],
    verdicts: &[Value],
) {
    let whatif = WhatIf::from_recording(
        recording,
        AnalyzerConfig {
            window_secs: WINDOW_SECS,
            warmup_secs: WINDOW_SECS,
            ..AnalyzerConfig::default()
        },
    )
    .expect("the recording replays");
    let pricing = Pricing {
        kv_bytes_per_token: 256,
        kv_bytes_from: "given".into(),
        prefill_tok_per_s: 50.0,
        prefill_from: "given".into(),
        dispatch_overhead_s: 0.0,
        bandwidth_bytes_per_s: None,
        handshake_s: None,
    };
    let priced = whatif.recorded_spills(&pricing, 16);
    // Per migration: [bytes, handshake s, transfer s] predicted, by the lab's clock,
    // and the probes' transfer s.
    let mut sums = [[0f64; 3]; 2];
    let mut probes_s = 0.0;
    eprintln!("request: bytes predicted/moved; handshake s predicted/lab; transfer s predicted/lab/probes");
    for o in migrations {
        let p = priced
            .iter()
            .find(|p| p.request_id == o.request_id)
            .unwrap_or_else(|| panic!("{}: migrated but not a recorded spill", o.request_id));
        assert_eq!(
            (p.bandwidth_from, p.handshake_from),
            (FigureSource::Pair, FigureSource::Pair),
            "{}: priced with its pair's figures",
            o.request_id
        );
        let pred = p.prediction.as_ref().expect("priced");
        let probes = verdicts
            .iter()
            .find(|v| v["request_id"] == o.request_id)
            .and_then(|v| v["nixl"]["nixl_seconds"].as_f64())
            .unwrap();
        let predicted = [pred.bytes as f64, pred.handshake_s, pred.transfer_s];
        let lab = [
            o.bytes as f64,
            o.load_ns as f64 / 1e9,
            o.post_to_done_ns as f64 / 1e9,
        ];
        eprintln!(
            "{}: {}/{}; {:.6}/{:.6}; {:.6}/{:.6}/{probes:.6}",
            o.request_id, predicted[0], lab[0], predicted[1], lab[1], predicted[2], lab[2]
        );
        for i in 0..3 {
            sums[0][i] += predicted[i];
            sums[1][i] += lab[i];
        }
        probes_s += probes;
    }
    let n = migrations.len() as f64;
    let per = |v: f64| v / n;
    let check = |what: &str, predicted: f64, measured: f64, tolerance: f64| {
        let err = predicted / measured - 1.0;
        eprintln!(
            "{n} migrations, {what} per migration: predicted {:.6}, measured {:.6}, error {:+.1}%",
            per(predicted),
            per(measured),
            100.0 * err
        );
        assert!(err.abs() <= tolerance, "{what}: {:+.1}% off", 100.0 * err);
    };
    let ([bytes, hs, xfer], [lab_bytes, lab_hs, lab_xfer]) = (sums[0], sums[1]);
    check("bytes", bytes, lab_bytes, 0.10);
    // Handshake and transfer each, and their sum (what a migration costs), printed.
    for (what, p, m) in [
        ("handshake s (the lab's clock)", hs, lab_hs),
        ("transfer s (the lab's clock)", xfer, lab_xfer),
        (
            "NIXL s (handshake + transfer)",
            hs + xfer,
            lab_hs + lab_xfer,
        ),
    ] {
        eprintln!(
            "{n} migrations, {what} per migration: predicted {:.6}, measured {:.6}, error {:+.1}%",
            per(p),
            per(m),
            100.0 * (p / m - 1.0)
        );
    }
    // Within a factor of 2 only (a wrong pair, unit or model is off by more): these
    // migrations are a few 4 KiB blocks, so their time is a fixed cost per READ and
    // handshake that a busy machine's scheduling swings, and the pairs' figures include
    // each pair's start-up READ (the connection's first transfer, 0.1–4 ms and more under
    // load). Measured: −27% to +27% in seven runs, transfers alone +9% to +64%
    // (docs/benchmarks-log.md, "Migration cost against the closed loop").
    let err = (hs + xfer) / (lab_hs + lab_xfer);
    eprintln!("NIXL s predicted / measured: {err:.3}");
    assert!(
        (0.5..=2.0).contains(&err),
        "NIXL time per migration {err:.2}× what the data plane measured"
    );
    // The probes time the same READs as the data plane's own clock.
    check(
        "transfer s (the probes', against the lab's)",
        probes_s,
        lab_xfer,
        0.10,
    );
}
