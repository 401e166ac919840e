//! What a pod needs from a daemon, on the real binaries and a real NATS: `/healthz`
//! (live while it answers), `/readyz` (503 with the reason until its bus is there, 200
//! once it is, 503 again when it goes away), and JSON log lines (`--log-format json`).
//! The actuator's `/readyz` is tested with its API in `actuator/tests/runtime.rs`.

use kvscope_lab::nats::NatsServer;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

async fn get(url: &str) -> (u16, String) {
    match reqwest::get(url).await {
        Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
        Err(e) => (0, e.to_string()),
    }
}

/// Poll `url` until its status is `want`; the last answer.
async fn wait_for(url: &str, want: u16) -> (u16, String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let answer = get(url).await;
        if answer.0 == want {
            return answer;
        }
        assert!(
            Instant::now() < deadline,
            "{url} did not answer {want}: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every line of `log` is a JSON object with a time, a level and a message; returns
/// the messages.
fn json_messages(log: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(log).unwrap();
    assert!(!text.is_empty(), "{} is empty", log.display());
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
            assert!(v["timestamp"].is_string(), "{line}");
            assert!(v["level"].is_string(), "{line}");
            assert!(v["target"].is_string(), "{line}");
            v["fields"]["message"]
                .as_str()
                .unwrap_or_else(|| panic!("no message: {line}"))
                .to_string()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_readiness_follow_the_bus_and_logs_are_json() {
    let exe = kvscope_e2e::kvscope();
    let dir = tempfile::tempdir().unwrap();
    let held = kvscope_lab::ports::reserve_ports(3).unwrap();
    let [nats_port, agent_port, collector_port] = held.ports()[..] else {
        unreachable!()
    };
    let nats_url = format!("nats://127.0.0.1:{nats_port}");

    let mut agent = Command::new(&exe);
    agent
        .args(["agent", "--log-format", "json", "--agent-id", "pod-test"])
        .args(["--nats-url", &nats_url])
        .args(["--metrics-listen", &format!("127.0.0.1:{agent_port}")])
        .arg("--router-log")
        .arg(dir.path().join("router.log"));
    let mut collector = Command::new(&exe);
    collector
        .args(["collector", "run", "--nats-url", &nats_url])
        .args(["--listen", &format!("127.0.0.1:{collector_port}")])
        .env("KVSCOPE_LOG_FORMAT", "json");
    let agent_log = dir.path().join("agent.log");
    let collector_log = dir.path().join("collector.log");
    let _procs = StopOnDrop(vec![
        ManagedProcess::spawn("agent", agent, &agent_log).unwrap(),
        ManagedProcess::spawn("collector", collector, &collector_log).unwrap(),
    ]);
    let agent_url = format!("http://127.0.0.1:{agent_port}");
    let collector_url = format!("http://127.0.0.1:{collector_port}");

    // No NATS yet: live, not ready, and saying why.
    assert_eq!(
        wait_for(&format!("{agent_url}/healthz"), 200).await.1,
        "ok\n"
    );
    let (_, body) = wait_for(&format!("{agent_url}/readyz"), 503).await;
    assert!(
        body.starts_with("not ready\nbus: ") && body.contains(&nats_url),
        "{body}"
    );
    wait_for(&format!("{collector_url}/healthz"), 200).await;
    let (_, body) = wait_for(&format!("{collector_url}/readyz"), 503).await;
    assert!(body.starts_with("not ready\nbus: "), "{body}");

    // NATS comes: both ready.
    let nats = NatsServer::start(dir.path(), nats_port).unwrap();
    assert_eq!(
        wait_for(&format!("{agent_url}/readyz"), 200).await.1,
        "ready\n"
    );
    assert_eq!(
        wait_for(&format!("{collector_url}/readyz"), 200).await.1,
        "ready\n"
    );
    // Metrics are still where they were.
    let (status, metrics) = get(&format!("{agent_url}/metrics")).await;
    assert_eq!(status, 200);
    assert!(metrics.contains("kvscope_agent_"), "{metrics}");

    // NATS goes: neither is ready, the agent says it lost the bus.
    drop(nats);
    let (_, body) = wait_for(&format!("{agent_url}/readyz"), 503).await;
    assert!(body.starts_with("not ready\nbus: "), "{body}");
    wait_for(&format!("{collector_url}/readyz"), 503).await;
    assert_eq!(get(&format!("{agent_url}/healthz")).await.0, 200);

    // Both logged JSON lines only (flag and environment variable alike).
    drop(_procs);
    let agent_said = json_messages(&agent_log);
    assert!(
        agent_said.iter().any(|m| m == "Agent started."),
        "{agent_said:?}"
    );
    let collector_said = json_messages(&collector_log);
    assert!(collector_said.len() >= 2, "{collector_said:?}");
}
