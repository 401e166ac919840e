//! A collector lost is a collector back: the lab fleet with two collectors of one scope.
//! The first takes the scope's lease (a NATS key-value entry) and serves; the second folds
//! the same stream as a warm standby. Mid-workload the first is killed (SIGKILL).
//!
//! Asserts: while both run, only the leader is ready and serves figures (the standby's
//! `/readyz` 503, its `/api/windows` 503, its `/metrics` its role and no figure); never,
//! at any 100 ms sample of the whole run, are both ready; after the kill the standby is
//! ready again within the documented bound (the lease's 10 s plus its look, ≤ 30 s), with
//! nobody ready between; the actuator, given both collectors' URLs, reads the leader,
//! then nothing (missing input, on which it holds nothing LIVE), then the standby; the promoted
//! collector applied every record the agent published, once and in the agent's order,
//! and its verdicts equal Dynamo's indexer over the same records and its windows and
//! report those of an undisturbed fold of them.

use kvscope_collector::fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_collector::report::OpportunityReport;
use kvscope_e2e::oracle;
use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use kvscope_lab::workload;
use kvscope_lab::LabConfig;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WINDOW_SECS: f64 = 4.0;

async fn ready(http: &reqwest::Client, base: &str) -> bool {
    http.get(format!("{base}/readyz"))
        .timeout(Duration::from_millis(500))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_collector_serves_within_seconds_of_its_leaders_death() {
    let lab = LabConfig {
        workers: 3,
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        ..LabConfig::default()
    };
    let mut run = kvscope_e2e::fleet(FleetRunConfig::new(lab, WINDOW_SECS))
        .await
        .expect("lab, agent and collector start");
    let leader = run.api();
    let standby = run.start_standby().await.expect("the standby starts");
    let s = standby
        .wait_summary(
            "the standby to stand by",
            Duration::from_secs(30),
            "see collector-standby.log",
            |s| s["bus"]["lease"]["role"] == "standby" && s["bus"]["lease"]["holder"].is_string(),
        )
        .await
        .expect("the second collector stands by");
    eprintln!("standby: {}", s["bus"]["lease"]);
    let http = reqwest::Client::new();
    assert!(ready(&http, &leader).await, "the leader is ready");
    assert!(!ready(&http, standby.base()).await, "the standby is not");
    let windows = http
        .get(format!("{}/api/windows", standby.base()))
        .send()
        .await
        .unwrap();
    assert_eq!(windows.status(), 503, "a standby serves no figures");
    let metrics = standby.get_text("/metrics").await.unwrap();
    assert!(
        metrics.contains("kvscope_collector_role{role=\"standby\"} 1"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("kvscope_decisions_total"),
        "a standby's /metrics has figures"
    );

    // The actuator, told both collectors: it reads the ready one.
    let actuator_addr = format!(
        "127.0.0.1:{}",
        kvscope_lab::ports::pick_ports(1).unwrap()[0]
    );
    let mut actuator = Command::new(kvscope_e2e::kvscope());
    actuator
        .args([
            "actuator",
            "--collector-url",
            &format!("{leader},{}", standby.base()),
        ])
        .arg("--audit-log")
        .arg(run.run_dir().join("actuator-audit.jsonl"))
        .args(["run", "--listen", &actuator_addr, "--interval-secs", "1"])
        .env_remove("KVSCOPE_ACTUATOR_CONFIG")
        .env("KVSCOPE_ACTUATOR_API_TOKEN", "standby-test-token");
    let _actuator = StopOnDrop(vec![ManagedProcess::spawn(
        "actuator",
        actuator,
        &run.run_dir().join("actuator.log"),
    )
    .unwrap()]);
    let evaluations = |input: &'static str| {
        let url = format!("http://{actuator_addr}/metrics");
        async move {
            let text = reqwest::get(&url).await.ok()?.text().await.ok()?;
            let line = format!("kvscope_actuator_evaluations_total{{input=\"{input}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(line.as_str()))
                .and_then(|n| n.trim().parse::<u64>().ok())
        }
    };

    // Both collectors' readiness, every 100 ms, for the whole run.
    let samples: Arc<Mutex<Vec<(Instant, bool, bool)>>> = Arc::default();
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let (samples, watching, http) = (samples.clone(), watching.clone(), http.clone());
        let (a, b) = (leader.clone(), standby.base().to_string());
        tokio::spawn(async move {
            while watching.load(Ordering::Relaxed) {
                let (ra, rb) = tokio::join!(ready(&http, &a), ready(&http, &b));
                samples.lock().unwrap().push((Instant::now(), ra, rb));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let wl = run.chat_workload(36.0);
    let workload = tokio::spawn(workload::run(wl));
    // Killed once the actuator has read the leader's figures (its first window past
    // the warm-up closed).
    let started = Instant::now();
    while evaluations("fresh").await.unwrap_or(0) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(25),
            "the actuator never read the leader's figures"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "the actuator read the leader {:.1} s into the workload",
        started.elapsed().as_secs_f64()
    );
    run.kill_collector();
    let killed = Instant::now();
    let missing_at_kill = evaluations("missing").await.unwrap();
    let mut back = None;
    while killed.elapsed() < Duration::from_secs(40) {
        if ready(&http, standby.base()).await {
            back = Some(killed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let back = back.expect("the standby serves within 40 s of its leader's death");
    eprintln!(
        "the standby was ready {:.2} s after the leader was killed",
        back.as_secs_f64()
    );
    assert!(
        back <= Duration::from_secs(30),
        "over the documented 30 s: {back:?}"
    );
    // Meanwhile the actuator read no figures (nobody ready: missing input, on which its
    // policy holds nothing LIVE); then it reads the standby's.
    let missing_at_takeover = evaluations("missing").await.unwrap();
    let fresh_at_takeover = evaluations("fresh").await.unwrap();
    assert!(
        missing_at_takeover > missing_at_kill,
        "no evaluation without input while neither collector was ready"
    );
    run.standby_is_the_collector().unwrap();
    let summary = workload.await.unwrap().expect("the workload runs");
    assert_eq!(summary.failed, 0);
    assert!(summary.ok >= 100, "{} requests", summary.ok);
    run.stop_agent().await;
    run.wait_drained(Duration::from_secs(1), Duration::from_secs(60))
        .await
        .expect("the promoted collector catches up");
    watching.store(false, Ordering::Relaxed);
    watcher.await.unwrap();
    assert!(
        evaluations("fresh").await.unwrap() > fresh_at_takeover,
        "the actuator reads the collector that took over"
    );
    let s = run.summary().await.unwrap();
    assert_eq!(s["bus"]["lease"]["role"], "leader", "{}", s["bus"]["lease"]);
    assert_eq!(s["bus"]["lease"]["acquired"], 1);
    let live = run.report().await.expect("the promoted collector's report");
    let live_windows: Vec<serde_json::Value> =
        run.get_json("/api/windows?limit=1000").await.unwrap();
    let metrics = run.get_text("/metrics").await.unwrap();
    assert!(metrics.contains("kvscope_collector_role{role=\"leader\"} 1"));
    let recording = run.recording.clone();
    let agent_recording = run.agent_recording.clone();
    run.stop();

    // Never two ready; nobody ready between the kill and the takeover.
    let samples = samples.lock().unwrap();
    assert!(samples.len() > 100, "{} samples", samples.len());
    assert!(
        samples.iter().all(|&(_, a, b)| !(a && b)),
        "both collectors were ready at once"
    );
    let gap = samples
        .iter()
        .filter(|&&(t, a, b)| t > killed && !a && !b)
        .count();
    eprintln!(
        "{} readiness samples; {gap} after the kill with neither ready",
        samples.len()
    );
    assert!(
        gap > 0,
        "the lease's expiry left a moment without a collector"
    );

    // What the promoted collector applied: every record the agent published, in order.
    let sent = kvscope_e2e::applied_as_published(&agent_recording, &recording);
    // Its verdicts, windows and report: Dynamo's indexer's overlaps, and those of an
    // undisturbed fold of the same records.
    let mut undisturbed = FleetAnalyzer::new(AnalyzerConfig {
        window_secs: WINDOW_SECS,
        warmup_secs: WINDOW_SECS,
        ..AnalyzerConfig::default()
    });
    let verdicts: Vec<_> = sent
        .envelopes
        .iter()
        .filter_map(|e| undisturbed.apply(e))
        .collect();
    assert!(verdicts.len() >= summary.ok);
    oracle::assert_overlaps_equal(&verdicts, &sent.envelopes);
    let expected = OpportunityReport::from_analyzer(&undisturbed);
    assert!(live.requests > 0);
    assert_eq!(
        serde_json::to_value(&live).unwrap(),
        serde_json::to_value(&expected).unwrap(),
        "the promoted collector's report vs an undisturbed fold's"
    );
    let expected_windows: Vec<serde_json::Value> = undisturbed
        .closed_windows()
        .rev()
        .map(|w| serde_json::to_value(&w.summary).unwrap())
        .collect();
    assert_eq!(live_windows.len(), expected_windows.len(), "closed windows");
    assert!(
        live_windows == expected_windows,
        "the windows of an undisturbed fold"
    );
}
