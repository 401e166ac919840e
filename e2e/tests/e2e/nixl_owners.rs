//! The worker → NIXL agent mapping without a table: the node agent tells which Dynamo
//! worker each NIXL agent belongs to from the processes, on the real lab.
//!
//! Each mocker runs a real NIXL sidecar in its process tree (`LabConfig::worker_sidecar`:
//! a paced `kvscope-nixl-lab bench`, two agents doing READ/WRITE transfers over the
//! wheel's libnixl), as a vLLM engine's NIXL agent runs under Dynamo's worker process.
//! The agent (eBPF on libnixl, Dynamo's file discovery) is given no worker id; a third
//! NIXL process under no worker stands for the agents that must not be told. Truth is
//! the lab's own: the worker id each mocker logged, and the sidecar's index in its name.
//! The collector's `/api/nixl/agents` and `/metrics`, and the actuator's mapping read
//! from the collector, must agree with it. Needs root (eBPF) and the lab
//! (`scripts/setup`).

use kvscope_actuator::decide::input::CollectorClient;
use kvscope_actuator::decide::policy::{PolicyConfig, PolicyEngine};
use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use kvscope_lab::LabConfig;
use kvscope_wire::nixl::NixlAgentRow;
use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

fn bench_args(prefix: &str) -> Vec<String> {
    [
        "bench",
        "--agent-prefix",
        prefix,
        "--iters",
        "1000",
        "--warmup",
        "0",
        "--pace-ms",
        "100",
        "--max-secs",
        "150",
        "--out",
        "/dev/null",
    ]
    .map(String::from)
    .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_agents_are_told_to_the_worker_whose_process_tree_holds_them() {
    let lab_dir = kvscope_lab::paths::default_lab_dir();
    let libs = kvscope_nixl_lab::NixlLibs::locate(&lab_dir).unwrap_or_else(|e| panic!("{e}"));
    let nixl_lab = kvscope_nixl_lab::lab_binary().display().to_string();
    // Names unique to this run: the probes see every process using the wheel's
    // libnixl.so, other tests' included.
    let prefix = format!("own{}-", std::process::id());
    let mut sidecar = vec![nixl_lab.clone()];
    sidecar.extend(bench_args(&format!("{prefix}w{{index}}-")));
    let lab = LabConfig {
        workers: 2,
        worker_sidecar: sidecar,
        ..LabConfig::default()
    };
    let libnixl = libs.libnixl.display().to_string();
    let run = kvscope_e2e::fleet_with(FleetRunConfig::new(lab, 2.0), |_| {
        Ok(vec!["--nixl-lib".to_string(), libnixl.clone()])
    })
    .await
    .expect("lab, agent (with eBPF) and collector start");
    // Per mocker index: its worker id (from its own log) and its process.
    let truth: BTreeMap<usize, (u64, u32)> = run
        .lab()
        .workers()
        .iter()
        .map(|w| (w.index, (w.worker_id, w.process.pid)))
        .collect();

    // A NIXL process under no worker: the test's own child.
    let mut stray = Command::new(&nixl_lab);
    stray.args(bench_args(&format!("{prefix}stray-")));
    let _stray = StopOnDrop(vec![ManagedProcess::spawn(
        "stray-nixl",
        stray,
        &run.run_dir().join("stray-nixl.log"),
    )
    .expect("a NIXL process under no worker")]);

    let ours = |rows: &[NixlAgentRow]| -> BTreeMap<String, NixlAgentRow> {
        rows.iter()
            .filter(|r| r.owner.agent.starts_with(&prefix))
            .map(|r| (r.owner.agent.clone(), r.clone()))
            .collect()
    };
    // Seen: the stray's two agents (created under the probes), and each sidecar's
    // initiator (created before the agent started, seen at its calls); a sidecar's target
    // only answers, so it may never be seen, and is checked only if it is.
    let deadline = Instant::now() + Duration::from_secs(90);
    let rows = loop {
        let rows: Vec<NixlAgentRow> = run.get_json("/api/nixl/agents").await.unwrap();
        let rows = ours(&rows);
        let seen = |name: String| rows.contains_key(&name);
        let initiators = truth
            .keys()
            .all(|i| seen(format!("{prefix}w{i}-initiator")));
        let strays = ["initiator", "target"]
            .iter()
            .all(|r| seen(format!("{prefix}stray-{r}")));
        if initiators && strays {
            break rows;
        }
        assert!(
            Instant::now() < deadline,
            "the sidecars' initiators and the stray process's agents were not all seen: {rows:#?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };

    let worker_of = |name: &str| -> Option<(u64, u32)> {
        let index: usize = name
            .strip_prefix(&prefix)?
            .strip_prefix('w')?
            .split('-')
            .next()?
            .parse()
            .ok()?;
        truth.get(&index).copied()
    };
    for (name, r) in &rows {
        if name.contains("stray-") {
            assert_eq!(r.owner.worker_id, None, "nothing guessed: {r:#?}");
            assert!(
                r.owner.how.starts_with("no worker's request plane"),
                "{r:#?}"
            );
            continue;
        }
        let (worker_id, mocker) =
            worker_of(name).unwrap_or_else(|| panic!("{name}: not a sidecar's"));
        assert_eq!(r.owner.worker_id, Some(worker_id), "{r:#?}");
        assert_eq!(r.owner.dp_rank, None, "one rank: not named");
        // The sidecar's parent is the mocker (the shell that started it became the mocker).
        assert_eq!(r.owner.how, format!("parent process {mocker}"), "{r:#?}");
        assert_eq!(r.node, "lab-node");
    }

    // The same on /metrics, for joining pair figures to workers in a query.
    let metrics = run.get_text("/metrics").await.unwrap();
    for (index, (worker_id, _)) in &truth {
        let series = format!(
            "kvscope_nixl_agent_worker_info{{node=\"lab-node\",agent=\"{prefix}w{index}-initiator\",worker_id=\"{worker_id}\",dp_rank=\"\"}} 1"
        );
        assert!(metrics.contains(&series), "missing: {series}");
    }
    assert!(!metrics.contains(&format!(
        "kvscope_nixl_agent_worker_info{{node=\"lab-node\",agent=\"{prefix}stray-"
    )));

    // The actuator, with no [[worker_agents]], maps each worker to its sidecar's agents
    // from the collector's answer.
    let client = CollectorClient::new(&run.api(), Duration::from_secs(5), 10, 10).unwrap();
    let view = client
        .fetch()
        .await
        .expect("the actuator reads the collector");
    let mapping = PolicyEngine::new(PolicyConfig::default(), Vec::new()).mapping_for(&view);
    for (index, (worker_id, _)) in &truth {
        for role in ["initiator", "target"] {
            let name = format!("{prefix}w{index}-{role}");
            if !rows.contains_key(&name) {
                continue;
            }
            let m = mapping
                .iter()
                .find(|m| m.nixl_agent == name)
                .unwrap_or_else(|| panic!("{name} not in the actuator's mapping: {mapping:#?}"));
            assert_eq!(m.worker_id, *worker_id);
        }
    }
    assert!(!mapping.iter().any(|m| m.nixl_agent.contains("stray-")));
    run.stop();
}
