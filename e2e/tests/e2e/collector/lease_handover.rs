//! Two collectors of one scope on a real `nats-server -js`, no lab: the first takes the
//! scope's lease and serves, the second stands by; the first stopped cleanly (SIGTERM)
//! lets the lease go, and the second serves at its next look (within about 2 s, not the
//! lease's 10 s lifetime); the first started again stands by.

use kvscope_lab::daemons::CollectorApi;
use kvscope_lab::nats::NatsServer;
use kvscope_lab::process::{signal_group, ManagedProcess, StopOnDrop};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn spawn(nats: &str, listen: &str, dir: &Path, name: &str) -> StopOnDrop {
    let mut cmd = Command::new(kvscope_e2e::collector());
    cmd.args(["run", "--cluster", "lease", "--nats-url", nats])
        .args(["--listen", listen])
        .env("RUST_LOG", "info");
    StopOnDrop(vec![ManagedProcess::spawn(
        name,
        cmd,
        &dir.join(format!("{name}.log")),
    )
    .expect("the collector starts")])
}

/// How long until the collector on `listen` has `role`, waiting at most `within`.
async fn role_within(listen: &str, role: &str, within: Duration) -> Duration {
    let started = Instant::now();
    CollectorApi::new(listen)
        .wait_summary(&format!("{listen} to be {role}"), within, "", |s| {
            s["bus"]["lease"]["role"] == role
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_stopped_cleanly_hands_its_lease_to_the_standby_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_anywhere(&dir.path().join("js")).expect("nats-server starts");
    let ports = kvscope_lab::ports::pick_ports(2).unwrap();
    let (a, b) = (
        format!("127.0.0.1:{}", ports[0]),
        format!("127.0.0.1:{}", ports[1]),
    );
    let mut first = spawn(&nats.url(), &a, dir.path(), "first");
    role_within(&a, "leader", Duration::from_secs(30)).await;
    let _second = spawn(&nats.url(), &b, dir.path(), "second");
    role_within(&b, "standby", Duration::from_secs(30)).await;
    // Still the first's after a lifetime and more: a standby never takes a held lease.
    tokio::time::sleep(Duration::from_secs(12)).await;
    role_within(&a, "leader", Duration::from_secs(1)).await;
    role_within(&b, "standby", Duration::from_secs(1)).await;

    signal_group(first[0].pid(), "TERM");
    assert!(first[0].child.wait().unwrap().success(), "a clean stop");
    first.clear();
    let took = role_within(&b, "leader", Duration::from_secs(8)).await;
    eprintln!(
        "the standby served {:.2} s after the leader stopped",
        took.as_secs_f64()
    );
    // Back, the first stands by.
    let _first = spawn(&nats.url(), &a, dir.path(), "first-again");
    role_within(&a, "standby", Duration::from_secs(30)).await;
    role_within(&b, "leader", Duration::from_secs(1)).await;
}
