//! NIXL figures from the agent's eBPF probes to the collector, with the real binaries:
//! `kvscope agent --nixl-lib <the wheel's libnixl.so>` → `nats-server -js` →
//! `kvscope collector run`, while the NIXL lab migrates blocks with injected failures.
//!
//! Asserts: the agent's `/metrics` carries the transfers the lab made, and the
//! collector's per-pair view (`/api/nixl`, `/metrics`) equals the lab's truth pair by
//! pair: successful transfers by op, their bytes, failures, handshakes by outcome.
//! Needs root for the probes (CI runs as root): without it the agent exits naming the
//! missing capability and this test fails.

use kvscope_lab::nats::NatsServer;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use kvscope_nixl_lab::truth::{CallOutcome, TransferOutcome, Truth};
use kvscope_wire::nixl::NixlPair;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const CLUSTER: &str = "nixltest";

/// The probes see every process using the wheel's libnixl.so: the tests that compare
/// what they saw with a lab's truth run one at a time.
static ONE_LAB_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Debug, Default, PartialEq)]
struct PairFigures {
    ok_by_op: BTreeMap<String, u64>,
    bytes_ok: u64,
    failed: u64,
    handshakes_ok: u64,
    handshakes_failed: u64,
}

fn op_name(op: kvscope_nixl_lab::truth::Op) -> String {
    serde_json::to_value(op)
        .unwrap()
        .as_str()
        .unwrap()
        .to_string()
}

/// What the collector should show per (local, remote), from the lab's truth. Handshakes
/// whose remote the probes cannot know (a failed loadRemoteMD: the metadata did not
/// parse; sendLocalMD: an address, not an agent) and failed makeXferReq calls sit under
/// an empty remote.
fn expected(truth: &Truth) -> BTreeMap<(String, String), PairFigures> {
    let mut m: BTreeMap<(String, String), PairFigures> = BTreeMap::new();
    for x in &truth.transfers {
        // A failed makeXferReq names no remote agent (its arguments are prepared lists).
        let remote = if x.prepped && x.outcome == TransferOutcome::FailedAtCreate {
            String::new()
        } else {
            x.remote.clone()
        };
        let p = m.entry((x.local.clone(), remote)).or_default();
        if x.outcome == TransferOutcome::Done {
            *p.ok_by_op.entry(op_name(x.op)).or_default() += 1;
            p.bytes_ok += x.bytes;
        } else {
            p.failed += 1;
        }
    }
    for h in &truth.handshakes {
        let call = h.call.method();
        let ok = h.outcome == CallOutcome::Ok;
        let remote = if (call == "loadRemoteMD" && !ok) || call == "sendLocalMD" {
            String::new()
        } else {
            h.remote.clone().unwrap_or_default()
        };
        let p = m.entry((h.local.clone(), remote)).or_default();
        if ok {
            p.handshakes_ok += 1;
        } else {
            p.handshakes_failed += 1;
        }
    }
    // Background metadata loads are handshakes too: the agent that loads holds the
    // metadata of the peer it fetched from, or of the peer that sent it.
    for h in &truth.handshakes {
        if let Some(a) = h.async_load.as_ref().filter(|a| a.arrived) {
            let remote = if h.call.method() == "sendLocalMD" {
                h.local.clone()
            } else {
                h.remote.clone().unwrap_or_default()
            };
            m.entry((a.loaded_by.clone(), remote))
                .or_default()
                .handshakes_ok += 1;
        }
    }
    m
}

fn observed(pairs: &[NixlPair]) -> BTreeMap<(String, String), PairFigures> {
    pairs
        .iter()
        .map(|p| {
            (
                (p.local_agent.clone(), p.remote_agent.clone()),
                PairFigures {
                    ok_by_op: p.transfers_ok.clone(),
                    bytes_ok: p.bytes_ok,
                    failed: p.transfers_failed,
                    handshakes_ok: p.handshakes_ok,
                    handshakes_failed: p.handshakes_failed,
                },
            )
        })
        .collect()
}

async fn get(url: &str) -> Option<String> {
    reqwest::get(url).await.ok()?.text().await.ok()
}

/// NATS, the collector and the agent (probes on the wheel's libnixl.so), up and attached.
struct Pipeline {
    procs: StopOnDrop,
    _nats: NatsServer,
    _ports: kvscope_lab::ports::PortReservation,
    collector_addr: String,
    agent_metrics: String,
}

impl Pipeline {
    async fn start(dir: &Path) -> Self {
        let exe = kvscope_e2e::kvscope();
        let libs = kvscope_nixl_lab::NixlLibs::ensure(&kvscope_lab::paths::default_lab_dir())
            .unwrap_or_else(|e| panic!("the NIXL wheel is not set up: {e}"));
        let nats = NatsServer::start_anywhere(dir).expect("nats-server starts");
        let held = kvscope_lab::ports::reserve_ports(2).unwrap();
        let ports = held.ports();
        let (collector_addr, agent_metrics) = (
            format!("127.0.0.1:{}", ports[0]),
            format!("127.0.0.1:{}", ports[1]),
        );

        let mut procs = StopOnDrop::default();
        let mut collector = Command::new(&exe);
        collector
            .args([
                "collector",
                "run",
                "--nats-url",
                &nats.url(),
                "--cluster",
                CLUSTER,
            ])
            .args(["--listen", &collector_addr]);
        procs.push(
            ManagedProcess::spawn("collector", collector, &dir.join("collector.log")).unwrap(),
        );
        let mut agent = Command::new(&exe);
        agent
            .args(["agent", "--nats-url", &nats.url(), "--cluster", CLUSTER])
            .args([
                "--agent-id",
                "nixl-node",
                "--metrics-listen",
                &agent_metrics,
            ])
            .arg("--nixl-lib")
            .arg(&libs.libnixl)
            .arg("--no-nixl-discover");
        procs.push(ManagedProcess::spawn("agent", agent, &dir.join("agent.log")).unwrap());

        // The agent is up (probes attached) once its /metrics shows the library.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = get(&format!("http://{agent_metrics}/metrics"))
                .await
                .unwrap_or_default();
            if text.contains("kvscope_agent_nixl_library_info{") {
                break;
            }
            if let Some(status) = procs[1].exited() {
                panic!(
                    "the agent exited ({status}): {}",
                    std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not attach its NIXL probes in 30 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Self {
            procs,
            _nats: nats,
            _ports: held,
            collector_addr,
            agent_metrics,
        }
    }

    async fn pairs(&self) -> Vec<NixlPair> {
        match get(&format!("http://{}/api/nixl", self.collector_addr)).await {
            Some(body) => serde_json::from_str(&body).unwrap_or_default(),
            None => Vec::new(),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_figures_reach_the_collector_pair_by_pair() {
    let _one = ONE_LAB_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut pipeline = Pipeline::start(dir.path()).await;
    let (collector_addr, agent_metrics) = (
        pipeline.collector_addr.clone(),
        pipeline.agent_metrics.clone(),
    );

    let truth: Truth = kvscope_nixl_lab::run_scenario("mixed", dir.path());
    let want = expected(&truth);

    // The collector's view converges on the truth (reports are cumulative, every second).
    let deadline = Instant::now() + Duration::from_secs(30);
    let got = loop {
        let pairs = pipeline.pairs().await;
        let got = observed(&pairs);
        if got == want || Instant::now() > deadline {
            break got;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let diffs: Vec<String> = want
        .iter()
        .filter(|(k, v)| got.get(*k) != Some(*v))
        .map(|(k, v)| format!("{k:?}: lab {v:?}, collector {:?}", got.get(k)))
        .chain(
            got.keys()
                .filter(|k| !want.contains_key(*k))
                .map(|k| format!("{k:?}: collector only {:?}", got[k])),
        )
        .collect();
    assert!(
        diffs.is_empty(),
        "collector pairs vs the lab:\n{}",
        diffs.join("\n")
    );

    let agent_text = get(&format!("http://{agent_metrics}/metrics"))
        .await
        .unwrap();
    let traced: u64 = agent_text
        .lines()
        .filter(|l| {
            l.starts_with("kvscope_agent_nixl_transfers_total{") && l.contains("stage=\"complete\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    let done = truth
        .transfers
        .iter()
        .filter(|x| {
            x.outcome != TransferOutcome::FailedAtCreate
                && x.outcome != TransferOutcome::FailedAtPost
        })
        .count() as u64;
    assert_eq!(
        traced, done,
        "the agent's /metrics: transfers that reached a terminal status"
    );
    let collector_text = get(&format!("http://{collector_addr}/metrics"))
        .await
        .unwrap();
    assert!(
        collector_text.contains("kvscope_nixl_pair_transfer_latency_seconds_bucket{"),
        "the collector exports per-pair latency histograms"
    );
    // OpenMetrics for a scraper that asks for it (Prometheus does), text otherwise.
    let openmetrics = reqwest::Client::new()
        .get(format!("http://{collector_addr}/metrics"))
        .header("accept", "application/openmetrics-text;version=1.0.0")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        openmetrics.trim_end().ends_with("# EOF") && !collector_text.contains("# EOF"),
        "OpenMetrics when asked for"
    );
    pipeline.procs.stop(Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_held_in_flight_ages_on_its_pair_then_clears() {
    let _one = ONE_LAB_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let pipeline = Pipeline::start(dir.path()).await;
    // Two agents whose first transfer left in progress by its post is held in flight for
    // 6 s (posts of 4 MiB on loopback often complete inside the call, even a fresh
    // connection's first: forty of them leave one in progress).
    // When every post completes inside the call (a fresh connection's first too, now
    // and then), nothing is ever in flight: that pair is given up, said, and a new one
    // tried, three times at most.
    let mut attempt = 0;
    let (local, remote, mut bench, report, seen) = loop {
        let prefix = format!("held{}-{attempt}-", std::process::id());
        let (local, remote) = (format!("{prefix}initiator"), format!("{prefix}target"));
        let report = dir.path().join(format!("bench{attempt}.json"));
        let mut bench = Command::new(kvscope_nixl_lab::lab_binary());
        bench
            .args(["bench", "--agent-prefix", &prefix, "--op", "read"])
            .args(["--size", "4194304", "--iters", "40", "--warmup", "0"])
            .args(["--hold-ms", "6000", "--out"])
            .arg(&report);
        let mut bench = bench.spawn().expect("the NIXL lab runs");

        // The collector shows the pair with a transfer in flight, aging past 2 s; the
        // agent too.
        let deadline = Instant::now() + Duration::from_secs(30);
        let seen = loop {
            let pair = pipeline
                .pairs()
                .await
                .into_iter()
                .find(|p| p.local_agent == local && p.remote_agent == remote);
            if let Some(p) =
                pair.filter(|p| p.in_flight >= 1 && p.oldest_in_flight_seconds >= Some(2.0))
            {
                break Some(p);
            }
            let exited = bench.try_wait().unwrap().is_some();
            if Instant::now() > deadline || exited {
                let r: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(&report).unwrap_or_default())
                        .unwrap_or_default();
                if exited && r["transfers"] == r["post_completed_inline"] && attempt < 2 {
                    eprintln!(
                        "every one of {} posts on {local} -> {remote} completed inside the \
                         call: nothing was in flight; again with a new pair",
                        r["transfers"]
                    );
                    break None;
                }
                panic!(
                    "no transfer seen in flight on {local} -> {remote} for 2 s (bench: {} transfers, {} completed inside the post)",
                    r["transfers"], r["post_completed_inline"]
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        match seen {
            Some(p) => break (local, remote, bench, report, p),
            None => attempt += 1,
        }
    };
    assert!(seen.oldest_in_flight_seconds.unwrap() < 7.0, "{seen:?}");
    let agent_text = get(&format!("http://{}/metrics", pipeline.agent_metrics))
        .await
        .unwrap();
    let series = format!(
        "kvscope_agent_nixl_transfers_in_flight{{agent=\"nixl-node\",local_agent=\"{local}\",remote_agent=\"{remote}\"}} 1"
    );
    assert!(agent_text.contains(&series), "missing {series}");

    // Released: nothing in flight, every transfer counted done.
    assert!(bench.wait().unwrap().success());
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let p = pipeline
            .pairs()
            .await
            .into_iter()
            .find(|p| p.local_agent == local && p.remote_agent == remote)
            .unwrap();
        if p.in_flight == 0 && p.transfers_ok.get("READ").copied() == r["transfers"].as_u64() {
            assert_eq!(p.oldest_in_flight_seconds, None);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "in flight after the release: {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn without_privileges_the_agent_names_the_missing_capability() {
    // The agent and the library copied where an unprivileged user can reach them, then
    // run as `nobody` with no capabilities: loading the probes must fail with the one
    // message that says what to grant, and the agent must exit non-zero.
    use std::os::unix::fs::PermissionsExt;
    let libs = kvscope_nixl_lab::NixlLibs::ensure(&kvscope_lab::paths::default_lab_dir())
        .unwrap_or_else(|e| panic!("the NIXL wheel is not set up: {e}"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = dir.path().join("kvscope");
    std::fs::copy(kvscope_e2e::kvscope(), &exe).unwrap();
    let lib = dir.path().join("libnixl.so");
    std::fs::copy(&libs.libnixl, &lib).unwrap();
    std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(&exe)
        .args([
            "agent",
            "--nats-url",
            "nats://127.0.0.1:1",
            "--no-nixl-discover",
        ])
        .arg("--nixl-lib")
        .arg(&lib)
        .output()
        .expect("setpriv (util-linux) runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the agent must not run without its probes: {err}"
    );
    assert!(
        err.contains("CAP_BPF") && err.contains("CAP_PERFMON") && err.contains("root"),
        "the error names what to grant: {err}"
    );
}
