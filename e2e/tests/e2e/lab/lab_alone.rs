//! Starts the real lab (3 mocker workers + frontend + NATS), runs a small workload and
//! checks the router log accounts for every request. Needs the lab venv
//! (`kvscope-lab setup`) and `nats-server`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::{router_log, Lab, LabConfig};

fn pid_alive(pid: u32) -> bool {
    // A reaped process has no /proc entry; a zombie would show state Z.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// Every process whose process group is one the lab started.
fn processes_in_groups(groups: &BTreeSet<u32>) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // fields after "comm)": state ppid pgrp ...
        let rest: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        if let Some(pgrp) = rest.get(2).and_then(|p| p.parse::<u32>().ok()) {
            if groups.contains(&pgrp) && rest.first() != Some(&"Z") {
                found.push((pid, stat.chars().take(80).collect()));
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lab_routes_every_request_and_stops_cleanly() {
    let t0 = Instant::now();
    let lab = Lab::start(LabConfig {
        workers: 3,
        num_gpu_blocks: 64,
        ..LabConfig::default()
    })
    .await
    .expect("lab starts (run `cargo run -p kvscope-lab -- setup` first if the venv is missing)");
    let startup = t0.elapsed();
    let manifest = lab.manifest().clone();
    assert_eq!(manifest.workers.len(), 3);
    assert!(manifest.nats_url.is_some());
    assert!(lab.manifest_path().exists(), "lab.json written");

    // Worker ids: the lab's (from mocker logs) match the discovery store's.
    let ids: BTreeSet<u64> = manifest.workers.iter().map(|w| w.worker_id).collect();
    assert_eq!(ids.len(), 3, "distinct worker ids");
    let entries = kvscope_discovery::backend::read_file_store(&manifest.discovery_dir)
        .expect("discovery store readable");
    let discovered: BTreeSet<u64> =
        kvscope_discovery::Fleet::from_entries(entries.iter().map(|(k, v)| (k.as_str(), v)))
            .workers
            .into_keys()
            .collect();
    assert_eq!(
        discovered, ids,
        "discovery store lists exactly the lab's workers"
    );

    let summary = workload::run(WorkloadConfig {
        frontend: manifest.frontend_url.clone(),
        sessions: 12,
        families: 3,
        concurrency: 6,
        rate: Some(40.0),
        max_turns: 3,
        max_tokens: 32,
        duration_secs: 60.0,
        ..WorkloadConfig::default()
    })
    .await
    .expect("workload runs");
    assert_eq!(summary.sent, 36, "12 sessions x 3 turns");
    assert_eq!(
        summary.failed,
        0,
        "failures: {:?}",
        summary
            .requests
            .iter()
            .filter(|r| !r.ok)
            .collect::<Vec<_>>()
    );

    // The router logs a `Selected worker` line for every request id, naming a lab worker.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let selected = router_log::selected_workers(lab.router_log()).expect("router log readable");
    let log_text = std::fs::read_to_string(lab.router_log()).unwrap();
    for r in &summary.requests {
        let id = r
            .router_request_id
            .as_deref()
            .expect("ok request has an id");
        let sel = selected.get(id).unwrap_or_else(|| {
            panic!(
                "no `Selected worker` line for request_id={id} ({})",
                r.x_request_id
            )
        });
        assert!(
            ids.contains(&sel.worker_id),
            "selected worker {} is a lab worker",
            sel.worker_id
        );
        assert!(
            log_text.contains(&format!("x_request_id=\"{}\"", r.x_request_id)),
            "x_request_id {} in router log",
            r.x_request_id
        );
    }
    // Prompt token counts are exact with the fixture tokenizer.
    for r in &summary.requests {
        assert_eq!(
            r.usage_prompt_tokens,
            Some(r.prompt_tokens as u64),
            "{}",
            r.x_request_id
        );
    }

    // Stop: nothing from any of the lab's process groups survives.
    let groups: BTreeSet<u32> = manifest.process_groups().into_iter().collect();
    let t_stop = Instant::now();
    tokio::task::spawn_blocking(move || lab.stop())
        .await
        .unwrap();
    eprintln!(
        "startup {:.1}s, workload {:.1}s, stop {:.1}s, spilled cached tokens {:?}",
        startup.as_secs_f64(),
        summary.elapsed_secs,
        t_stop.elapsed().as_secs_f64(),
        summary.router_spilled_cached_tokens
    );
    for &g in &groups {
        assert!(!pid_alive(g), "process {g} still alive after stop");
    }
    let left = processes_in_groups(&groups);
    assert!(left.is_empty(), "orphans left: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_lab_kills_everything() {
    let lab = Lab::start(LabConfig {
        workers: 1,
        nats: false,
        ..LabConfig::default()
    })
    .await
    .expect("lab starts");
    let groups: BTreeSet<u32> = lab.manifest().process_groups().into_iter().collect();
    tokio::task::spawn_blocking(move || drop(lab))
        .await
        .unwrap();
    let left = processes_in_groups(&groups);
    assert!(left.is_empty(), "orphans left after drop: {left:?}");
}
