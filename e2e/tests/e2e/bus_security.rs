//! A bus only kvscope writes to. The lab's NATS runs as a production bus would: TLS
//! with the run's own CA, a user per process, each agent's user allowed to publish
//! only under its own name (`kvscope.<cluster>.<agent_id>.>`). Then a stranger, and an
//! agent gone bad, try what the hostile tester did: forged decisions for a worker that
//! does not exist, a record dated 50 years ahead, records under another agent's name.
//!
//! Asserts, against the real nats-server, agent and collector:
//! - no credentials, a wrong password, or no CA: no connection; a plain-text client
//!   is told TLS is required and nothing it sends lands;
//! - an agent's user cannot publish another agent's subjects: JetStream never stores
//!   them, and the real agent binary run under another agent's name counts
//!   `bus_refusals` on its `/metrics` while none of its records land;
//! - the collector's user cannot publish a record;
//! - a record an agent publishes under its own subject but naming another agent is
//!   refused by the collector and counted (`foreign_records`); one dated 50 years
//!   ahead is quarantined (`future_records`);
//! - through all of it the real agent's decisions are judged, every request the
//!   workload sent is one, and no verdict names the forged worker.

use async_nats::jetstream;
use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::bus_security::{agent_user, BusAgent, COLLECTOR_USER};
use kvscope_lab::process::ManagedProcess;
use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::LabConfig;
use kvscope_wire::recording::read_recording;
use kvscope_wire::{Envelope, NatsSecurity, Record, RoutingDecision, Subjects, WorkerKey};
use std::io::{Read as _, Write as _};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WINDOW_SECS: f64 = 4.0;
const FORGED_WORKER: u64 = 999_999;

fn security(env: &[(String, String)]) -> NatsSecurity {
    let mut s = NatsSecurity::default();
    s.apply_env(|k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
        .unwrap();
    s
}

fn forged(agent: &str, request_id: &str, observed_ns: u64) -> Envelope {
    Envelope {
        agent: agent.into(),
        observed_ns,
        record: Record::Decision(RoutingDecision {
            tenant: None,
            model: None,
            request_id: request_id.into(),
            worker: WorkerKey {
                worker_id: FORGED_WORKER,
                dp_rank: 0,
            },
            isl_tokens: 64,
            block_size: 16,
            local_hashes: vec![1, 2, 3, 4],
            sequence_hashes: None,
            worker_type: None,
            router_mode: Some("kv".into()),
            clock_behind_ms: None,
            selection: Default::default(),
            trace: None,
        }),
    }
}

/// Publish through JetStream and wait for its acknowledgement: `Ok` only if the
/// stream stored the record.
async fn stored(js: &jetstream::Context, subject: String, e: &Envelope) -> Result<(), String> {
    let ack = js
        .publish(subject, e.to_json().into())
        .await
        .map_err(|e| e.to_string())?;
    match tokio::time::timeout(Duration::from_secs(3), ack).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no acknowledgement".into()),
    }
}

/// A client of the lab's bus with `sec`, and the server's refusals it was told of.
async fn client(
    url: &str,
    sec: &NatsSecurity,
    inbox_prefix: Option<&str>,
) -> Result<(async_nats::Client, Arc<Mutex<Vec<String>>>), async_nats::ConnectError> {
    let refusals = Arc::new(Mutex::new(Vec::new()));
    let seen = refusals.clone();
    let c = sec
        .connect_options(inbox_prefix)
        .await
        .unwrap()
        .event_callback(move |ev| {
            let seen = seen.clone();
            async move {
                if let Some(e) = kvscope_wire::nats_security::refusal(&ev) {
                    seen.lock().unwrap().push(e);
                }
            }
        })
        .connect(url)
        .await?;
    Ok((c, refusals))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_kvscope_writes_the_figures() {
    let lab = LabConfig {
        workers: 2,
        bus_agents: vec![
            BusAgent::new("lab-node", "lab"),
            BusAgent::new("intruder", "lab"),
        ],
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        ..LabConfig::default()
    };
    let exe = kvscope_e2e::kvscope();
    let run = kvscope_e2e::fleet(FleetRunConfig::new(lab, WINDOW_SECS))
        .await
        .expect("lab (secured bus), agent and collector start");
    let url = run.nats_url().to_string();
    let bus = run
        .lab()
        .manifest()
        .bus_security
        .clone()
        .expect("the lab's bus runs secured by default");
    let subjects = Subjects::new("lab");
    let now = kvscope_kit::clock::now_ns();

    let workload = tokio::spawn(workload::run(WorkloadConfig {
        frontend: run.lab().frontend_url().to_string(),
        sessions: 12,
        families: 3,
        max_turns: 20,
        concurrency: 6,
        rate: Some(10.0),
        duration_secs: 12.0,
        ..WorkloadConfig::default()
    }));

    // A stranger: no credentials, or a guessed password, or no CA.
    let intruder_env = bus.agent_env("intruder").unwrap();
    let intruder = security(&intruder_env);
    let anonymous = NatsSecurity {
        tls_ca_file: intruder.tls_ca_file.clone(),
        tls_required: true,
        ..Default::default()
    };
    let e = client(&url, &anonymous, None)
        .await
        .expect_err("no credentials: refused");
    assert_eq!(
        e.kind(),
        async_nats::ConnectErrorKind::AuthorizationViolation,
        "{e}"
    );
    let mut guessed = intruder.clone();
    guessed.password = Some(kvscope_wire::nats_security::Secret::new("guess"));
    let e = client(&url, &guessed, None)
        .await
        .expect_err("a wrong password: refused");
    assert_eq!(
        e.kind(),
        async_nats::ConnectErrorKind::AuthorizationViolation,
        "{e}"
    );
    let mut no_ca = intruder.clone();
    no_ca.tls_ca_file = None;
    let e = client(&url, &no_ca, None)
        .await
        .expect_err("a server certificate from an unknown CA: refused");
    assert!(e.to_string().contains("UnknownIssuer"), "{e}");
    // In plain text: the server asks for TLS and takes nothing before it.
    let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    let mut raw = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut info = vec![0u8; 4096];
    let n = raw.read(&mut info).unwrap();
    let info = String::from_utf8_lossy(&info[..n]).to_string();
    assert!(info.contains("\"tls_required\":true"), "{info}");
    let forged_plain = forged("intruder", "forged-plain", now);
    let _ = raw.write_all(
        format!(
            "CONNECT {{\"user\":\"{}\",\"pass\":\"{}\"}}\r\nPUB kvscope.lab.intruder.decision {}\r\n{}\r\n",
            agent_user("intruder"),
            intruder.password.as_ref().unwrap().expose(),
            forged_plain.to_json().len(),
            String::from_utf8_lossy(&forged_plain.to_json()),
        )
        .as_bytes(),
    );
    drop(raw);

    // An agent gone bad, with its own valid credentials.
    let (bad, bad_refusals) = client(&url, &intruder, Some(&subjects.inbox_prefix("intruder")))
        .await
        .expect("the intruder agent's user connects");
    let js = jetstream::new(bad);
    let other = forged("lab-node", "forged-other-subject", now);
    let refused = stored(&js, subjects.for_record("lab-node", &other.record), &other).await;
    assert!(
        refused.is_err(),
        "another agent's subject was stored: {refused:?}"
    );
    let foreign = forged("lab-node", "forged-foreign", now);
    stored(
        &js,
        subjects.for_record("intruder", &foreign.record),
        &foreign,
    )
    .await
    .expect("its own subject is the server's to allow");
    let future = forged(
        "intruder",
        "forged-future",
        now + 50 * 365 * 86_400 * 1_000_000_000,
    );
    stored(
        &js,
        subjects.for_record("intruder", &future.record),
        &future,
    )
    .await
    .expect("its own subject is the server's to allow");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        bad_refusals
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.to_lowercase().contains("permissions violation")),
        "the server said nothing: {:?}",
        bad_refusals.lock().unwrap()
    );

    // The collector's user writes nothing.
    let collector = security(&run.bus_env(COLLECTOR_USER).unwrap());
    let (c, _) = client(
        &url,
        &collector,
        Some(&subjects.inbox_prefix("kvscope-collector")),
    )
    .await
    .expect("the collector's user connects");
    let by_collector = forged("lab-node", "forged-by-collector", now);
    let refused = stored(
        &jetstream::new(c),
        subjects.for_record("lab-node", &by_collector.record),
        &by_collector,
    )
    .await;
    assert!(
        refused.is_err(),
        "the collector's user stored a record: {refused:?}"
    );

    // The real agent binary, given the intruder's credentials but another agent's name.
    let metrics = kvscope_lab::ports::pick_ports(1).unwrap()[0];
    let mut cmd = Command::new(&exe);
    cmd.args(["agent", "--nats-url", &url, "--cluster", "lab"])
        .args(["--agent-id", "lab-node", "--from-start", "--router-log"])
        .arg(run.lab().router_log())
        .args(["--metrics-listen", &format!("127.0.0.1:{metrics}")])
        .envs(intruder_env.iter().map(|(k, v)| (k, v)))
        .env("RUST_LOG", "info");
    let log = run.run_dir().join("impostor-agent.log");
    let mut impostor = vec![ManagedProcess::spawn("impostor-agent", cmd, &log).unwrap()];
    let deadline = Instant::now() + Duration::from_secs(30);
    let refusals = loop {
        let text = reqwest::get(format!("http://127.0.0.1:{metrics}/metrics"))
            .await
            .ok()
            .map(|r| r.text());
        let text = match text {
            Some(t) => t.await.unwrap_or_default(),
            None => String::new(),
        };
        let n = text
            .lines()
            .find(|l| l.starts_with("kvscope_agent_bus_refusals_total"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        if n > 0 {
            break n;
        }
        assert!(
            Instant::now() < deadline,
            "the impostor agent counted no refusal in 30 s; its log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("impostor agent: {refusals} refusals counted");

    let summary = workload.await.unwrap().expect("the workload runs");
    assert!(summary.ok >= 30, "{} requests", summary.ok);
    let ids = summary.router_request_ids();
    run.wait_for_decisions(ids.len() as u64, Duration::from_secs(60))
        .await
        .expect("every decision of the real agent reaches the collector");
    kvscope_lab::process::stop_all(&mut impostor, Duration::from_secs(2));
    let s = run.summary().await.unwrap();
    let counters = &s["counters"];
    assert_eq!(counters["foreign_records"], 1, "{counters}");
    assert_eq!(counters["future_records"], 1, "{counters}");
    assert_eq!(counters["undecodable_records"], 0, "{counters}");
    let workers: Vec<u64> = run.lab().workers().iter().map(|w| w.worker_id).collect();
    let recording = run.finish().await.expect("the collector catches up");

    let rec = read_recording(&recording).unwrap();
    let decisions: Vec<&RoutingDecision> = rec
        .envelopes
        .iter()
        .filter_map(|e| match &e.record {
            Record::Decision(d) => Some(d),
            _ => None,
        })
        .collect();
    assert!(
        decisions
            .iter()
            .all(|d| !d.request_id.starts_with("forged")),
        "a forged decision was applied"
    );
    assert!(decisions
        .iter()
        .all(|d| workers.contains(&d.worker.worker_id)));
    let decided: std::collections::BTreeSet<&str> =
        decisions.iter().map(|d| d.request_id.as_str()).collect();
    let sent: std::collections::BTreeSet<&str> = ids.iter().map(String::as_str).collect();
    assert_eq!(decided, sent, "the real agent's decisions, and only those");
    assert_eq!(
        decisions.len(),
        ids.len(),
        "each once: the impostor's copies never landed"
    );
    assert!(rec.envelopes.iter().all(|e| e.agent == "lab-node"));
    let replayed = kvscope_fleet::fleet_run::replay(&recording, WINDOW_SECS, &[]).unwrap();
    assert!(!replayed.verdicts.is_empty());
    assert!(replayed
        .verdicts
        .iter()
        .all(|v| v.chosen.worker_id != FORGED_WORKER && v.best.worker_id != FORGED_WORKER));
}
