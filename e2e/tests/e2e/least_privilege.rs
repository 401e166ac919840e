//! Least privilege, proven: the real agent, as a non-root user holding exactly the
//! node agent's capabilities (`kvscope_agent::capabilities::NODE_AGENT`, the list the
//! DaemonSet adds — `deploy_manifests.rs` checks that), finds and probes the wheel's
//! libnixl.so in another user's (root's) processes and counts a NIXL lab scenario
//! exactly; without any one of them it exits, naming the one it lacks. Needs root to
//! hand out the capabilities (CI runs as root) and util-linux's `setpriv`.

use kvscope_agent::capabilities::NODE_AGENT;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use kvscope_nixl_lab::truth::{TransferOutcome, Truth};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// A user that owns nothing here, as the DaemonSet's container user would not.
const USER: &str = "65532";

/// `exe args…` as `USER`, with exactly `caps` (Kubernetes spelling) in its effective,
/// permitted, inheritable, ambient and bounding sets.
fn as_user_with(caps: &[&str], exe: &Path) -> Command {
    let list: String = std::iter::once("-all".to_string())
        .chain(caps.iter().map(|c| format!("+{}", c.to_lowercase())))
        .collect::<Vec<_>>()
        .join(",");
    let mut cmd = Command::new("setpriv");
    cmd.args([
        &format!("--reuid={USER}"),
        &format!("--regid={USER}"),
        "--clear-groups",
        &format!("--inh-caps={list}"),
        &format!("--ambient-caps={list}"),
        &format!("--bounding-set={list}"),
        "--",
    ])
    .arg(exe);
    cmd
}

/// The agent's successful transfers per (local, remote, op) and its terminal-status
/// transfers in all, for the local agents `ours`, from its `/metrics`.
fn traced(metrics: &str, ours: &[String]) -> (BTreeMap<(String, String, String), u64>, u64) {
    let label = |line: &str, name: &str| -> String {
        line.split(&format!("{name}=\""))
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or_default()
            .to_string()
    };
    let mut ok = BTreeMap::new();
    let mut terminal = 0;
    for line in metrics
        .lines()
        .filter(|l| l.starts_with("kvscope_agent_nixl_transfers_total{"))
        .filter(|l| l.contains("stage=\"complete\""))
    {
        if !ours.contains(&label(line, "local_agent")) {
            continue;
        }
        let n: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        terminal += n;
        if line.contains("status=\"SUCCESS\"") {
            *ok.entry((
                label(line, "local_agent"),
                label(line, "remote_agent"),
                label(line, "op"),
            ))
            .or_default() += n;
        }
    }
    (ok, terminal)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_agent_needs_exactly_its_capabilities() {
    let libs = kvscope_nixl_lab::NixlLibs::ensure(&kvscope_lab::paths::default_lab_dir())
        .unwrap_or_else(|e| panic!("the NIXL wheel is not set up: {e}"));
    let nixl_lab = kvscope_nixl_lab::lab_binary();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    // The agent where the user can run it (the build folder's parents may not let it).
    let exe = dir.path().join("kvscope");
    std::fs::copy(kvscope_e2e::kvscope(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(
        std::fs::metadata(&libs.libnixl)
            .unwrap()
            .permissions()
            .mode()
            & 0o004
            != 0,
        "the wheel's libnixl.so is readable by others"
    );

    // A root process holding libnixl.so, so the agent has something to find at start.
    let prefix = format!("lp{}-", std::process::id());
    let mut holder = Command::new(&nixl_lab);
    holder.args(["bench", "--agent-prefix", &format!("{prefix}hold-")]);
    holder.args(["--iters", "100000", "--warmup", "0", "--pace-ms", "200"]);
    holder.args(["--max-secs", "150", "--out", "/dev/null"]);
    let mut procs = StopOnDrop(vec![ManagedProcess::spawn(
        "holder",
        holder,
        &dir.path().join("holder.log"),
    )
    .unwrap()]);

    let held = kvscope_lab::ports::reserve_ports(1).unwrap();
    let metrics_addr = format!("127.0.0.1:{}", held.ports()[0]);
    // The DaemonSet's way: discover libraries in every process (no --nixl-lib).
    let agent_args = |metrics: Option<&str>| {
        let mut a = vec!["agent", "--nats-url", "nats://127.0.0.1:1", "--nixl"];
        if let Some(m) = metrics {
            a.extend(["--metrics-listen", m]);
        }
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let mut agent = as_user_with(NODE_AGENT, &exe);
    agent.args(agent_args(Some(&metrics_addr)));
    procs
        .0
        .push(ManagedProcess::spawn("agent", agent, &dir.path().join("agent.log")).unwrap());

    // Attached once /metrics shows the library fully traced.
    let url = format!("http://{metrics_addr}/metrics");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = match reqwest::get(&url).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        if text
            .lines()
            .any(|l| l.starts_with("kvscope_agent_nixl_library_info{") && l.ends_with(" 1"))
        {
            break;
        }
        if let Some(status) = procs.0[1].exited() {
            panic!(
                "the agent exited ({status}) holding {NODE_AGENT:?}: {}",
                std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not trace the holder's libnixl.so in 30 s: {}",
            std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A scenario of another user's (root's), with failures; its truth against the counts.
    let truth: Truth = kvscope_nixl_lab::run_scenario("mixed", dir.path());
    let ours: Vec<String> = truth.transfers.iter().map(|x| x.local.clone()).collect();
    let mut want_ok: BTreeMap<(String, String, String), u64> = BTreeMap::new();
    for x in truth
        .transfers
        .iter()
        .filter(|x| x.outcome == TransferOutcome::Done)
    {
        let op = serde_json::to_value(x.op)
            .unwrap()
            .as_str()
            .unwrap()
            .to_string();
        *want_ok
            .entry((x.local.clone(), x.remote.clone(), op))
            .or_default() += 1;
    }
    let want_terminal = truth
        .transfers
        .iter()
        .filter(|x| {
            x.outcome != TransferOutcome::FailedAtCreate
                && x.outcome != TransferOutcome::FailedAtPost
        })
        .count() as u64;
    assert!(want_terminal > 0 && !want_ok.is_empty());
    let deadline = Instant::now() + Duration::from_secs(20);
    let got = loop {
        let text = kvscope_e2e::get_text(&url).await;
        let got = traced(&text, &ours);
        if (got.0 == want_ok && got.1 == want_terminal) || Instant::now() > deadline {
            break got;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(got.0, want_ok, "successful transfers per pair and op");
    assert_eq!(
        got.1, want_terminal,
        "transfers that reached a terminal status"
    );
    if let Some(agent) = procs.0.pop() {
        kvscope_lab::process::stop_all(&mut [agent], Duration::from_secs(5));
    }

    // Without any one of them: exits, naming it.
    for missing in NODE_AGENT {
        let rest: Vec<&str> = NODE_AGENT
            .iter()
            .copied()
            .filter(|c| c != missing)
            .collect();
        let mut agent = as_user_with(&rest, &exe);
        agent.args(agent_args(None));
        let out = tokio::time::timeout(
            Duration::from_secs(60),
            tokio::process::Command::from(agent).output(),
        )
        .await
        .unwrap_or_else(|_| panic!("without CAP_{missing} the agent kept running"))
        .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "without CAP_{missing}: {err}");
        let said = err.lines().last().unwrap_or_default();
        assert!(
            said.contains(&format!("lacks CAP_{missing}"))
                || said.contains(&format!("CAP_{missing} grants")),
            "without CAP_{missing}, the error names it: {said}"
        );
    }
    procs.stop(Duration::from_secs(5));
}
