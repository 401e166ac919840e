//! Decisions from the log formats production runs: the lab's frontend logs JSON lines
//! (`DYN_LOGGING_JSONL=1`), and the same log is written, as it grows, the way the
//! kubelet writes a container's log on Kubernetes — CRI lines (`<time> stderr P|F
//! <text>`) with every line split into partial pieces of random sizes, and the file
//! rotated (renamed, a new one started) between the pieces of a line.
//!
//! One `kvscope agent` follows the JSON-lines log (with the lab's KV events); a second
//! follows the CRI file, found as on a node by a pattern over the pods' log folders
//! (`pods/dynamo_*frontend*/*/*.log`, a worker pod's log beside it not matched). Asserts: every request is a joined decision from the JSON
//! lines, with overlaps equal to `dynamo-kv-router`'s; the CRI agent read exactly the
//! same decisions, in the same order, none unjoined or cut, across the rotation. (The
//! same JSON-lines parser is checked against the router's own replica-sync events in
//! the agent's unit tests; the text format by `lab_e2e.rs`.)

use kvscope_e2e::oracle;

use kvscope_collector::fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::bus_security::BusAgent;
use kvscope_lab::process::{stop_all, ManagedProcess};
use kvscope_lab::workload::{self, SplitMix64};
use kvscope_lab::LabConfig;
use kvscope_wire::recording::read_recording;
use kvscope_wire::{Envelope, Record, RoutingDecision};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const WINDOW_SECS: f64 = 4.0;

/// Copies `source` (as it grows) into `dest` in the CRI format, each line in random
/// pieces, rotating `dest` once after `rotate_after` lines, in the middle of a line.
fn cri_writer(
    source: PathBuf,
    dest: PathBuf,
    rotate_after: usize,
    stop: Arc<AtomicBool>,
    written: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut rng = SplitMix64::new(7);
        let open = |p: &Path| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .unwrap()
        };
        let mut out = open(&dest);
        let mut reader = loop {
            match std::fs::File::open(&source) {
                Ok(f) => break std::io::BufReader::new(f),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let mut line = String::new();
        let mut lines = 0;
        let mut rotated = false;
        loop {
            line.clear();
            let n = reader.read_line(&mut line).unwrap();
            if n == 0 || !line.ends_with('\n') {
                if stop.load(Ordering::Relaxed) && n == 0 {
                    return;
                }
                // A partial read: wait for the rest of the line.
                let mut rest = String::new();
                while !line.ends_with('\n') {
                    std::thread::sleep(Duration::from_millis(10));
                    rest.clear();
                    if reader.read_line(&mut rest).unwrap() == 0 && line.is_empty() {
                        break;
                    }
                    line.push_str(&rest);
                }
                if line.is_empty() {
                    continue;
                }
            }
            let text = line.trim_end_matches('\n');
            let bytes = text.as_bytes();
            let mut at = 0;
            let mut pieces = 0;
            loop {
                let take = (1 + rng.below(300) as usize).min(bytes.len() - at);
                // Pieces end on character boundaries (the kubelet splits bytes; a
                // Dynamo warning carries an em dash, and where it falls depends on the
                // checkout's path, which the line names).
                let mut end = at + take;
                while !text.is_char_boundary(end) {
                    end += 1;
                }
                let last = end >= bytes.len();
                let ts = kvscope_kit::clock::now_ns();
                let stamp = format!("{}.{:09}Z", civil(ts / 1_000_000_000), ts % 1_000_000_000);
                writeln!(
                    out,
                    "{stamp} stderr {} {}",
                    if last { "F" } else { "P" },
                    &text[at..end]
                )
                .unwrap();
                pieces += 1;
                at = end;
                if !rotated && lines >= rotate_after && pieces == 1 && !last {
                    rotated = true;
                    // Rotation in the middle of a line, as the kubelet renames the file
                    // and the runtime reopens a new one.
                    out.flush().unwrap();
                    drop(out);
                    std::fs::rename(&dest, dest.with_extension("log.20261201-000000")).unwrap();
                    out = open(&dest);
                }
                if last {
                    break;
                }
            }
            out.flush().unwrap();
            lines += 1;
            written.store(lines, Ordering::Relaxed);
        }
    })
}

/// `2026-12-01T09:52:26` for UNIX seconds.
fn civil(secs: u64) -> String {
    let rem = secs % 86_400;
    let (y, m, d) = kvscope_kit::clock::civil_from_days((secs / 86_400) as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn decisions(envelopes: &[Envelope]) -> Vec<RoutingDecision> {
    envelopes
        .iter()
        .filter_map(|e| match &e.record {
            Record::Decision(d) => Some(d.clone()),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_lines_and_kubernetes_cri_logs_give_the_decisions_of_the_router() {
    let lab = LabConfig {
        workers: 3,
        frontend_jsonl_logs: true,
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        bus_agents: vec![
            BusAgent::new("lab-node", "lab"),
            BusAgent::new("cri-node", "cri"),
        ],
        ..LabConfig::default()
    };
    let run = kvscope_e2e::fleet(FleetRunConfig::new(lab, WINDOW_SECS))
        .await
        .expect("lab (JSON-lines frontend log), agent and collector start");
    let run_dir = run.run_dir();
    let pods = run_dir.join("pods/dynamo_frontend-0_0a1b/frontend");
    std::fs::create_dir_all(&pods).unwrap();
    let cri_log = pods.join("0.log");
    let (stop, written) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let writer = cri_writer(
        run.lab().router_log().to_path_buf(),
        cri_log.clone(),
        120,
        stop.clone(),
        written.clone(),
    );
    // A worker pod's log beside it, with a line that would be a decision: the pattern
    // below does not match it.
    let worker_pod = run_dir.join("pods/dynamo_worker-0_9f2c/main");
    std::fs::create_dir_all(&worker_pod).unwrap();
    std::fs::write(
        worker_pod.join("0.log"),
        "2026-12-01T00:00:00.000000000Z stderr F 2026-12-01T00:00:00.000000Z DEBUG \
         dynamo_kv_router::services::selection::core::run: [ROUTING_INPUT] request local \
         hashes request_id=\"decoy\" isl_tokens=16 block_size=16 num_blocks=1 local_hashes=[7]\n",
    )
    .unwrap();
    let cri_recording = run_dir.join("cri-agent.jsonl");
    // As on a node: the frontend pods' logs by pattern, their paths unknown beforehand.
    let pattern = run_dir.join("pods/dynamo_*frontend*/*/*.log");
    let mut cmd = run.other_agent("cri-node", "cri").unwrap();
    cmd.args(["--from-start", "--router-log"])
        .arg(&pattern)
        .arg("--record")
        .arg(&cri_recording);
    let mut cri_agent =
        vec![ManagedProcess::spawn("cri-agent", cmd, &run_dir.join("cri-agent.log")).unwrap()];

    let summary = workload::run(run.chat_workload(16.0))
        .await
        .expect("the workload runs");
    assert!(summary.ok >= 60);
    let ids = summary.router_request_ids();
    run.wait_for_decisions(ids.len() as u64, Duration::from_secs(60))
        .await
        .expect("every decision reaches the collector");
    // The CRI copy catches up with the log, then its agent reads the rest.
    let source_lines = std::fs::read_to_string(run.lab().router_log())
        .unwrap()
        .lines()
        .count();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while written.load(Ordering::Relaxed) < source_lines {
        assert!(
            std::time::Instant::now() < deadline,
            "the CRI writer fell behind"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert!(
        cri_log.with_extension("log.20261201-000000").exists(),
        "the CRI log was rotated"
    );
    let want = ids.len();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let got = read_recording(&cri_recording)
            .map(|r| decisions(&r.envelopes).len())
            .unwrap_or(0);
        if got >= want {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the CRI agent has {got} of {want} decisions"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop_all(&mut cri_agent, Duration::from_secs(5));
    let recording = run.finish().await.expect("the collector catches up");

    let rec = read_recording(&recording).unwrap();
    let mut analyzer = FleetAnalyzer::new(AnalyzerConfig {
        window_secs: WINDOW_SECS,
        warmup_secs: WINDOW_SECS,
        ..AnalyzerConfig::default()
    });
    let verdicts: Vec<_> = rec
        .envelopes
        .iter()
        .filter_map(|e| analyzer.apply(e))
        .collect();
    assert_eq!(
        verdicts.len(),
        ids.len(),
        "every request, from the JSON lines"
    );
    oracle::assert_overlaps_equal(&verdicts, &rec.envelopes);
    assert!(verdicts.iter().any(|v| v.spill));

    let cri = read_recording(&cri_recording).unwrap();
    assert_eq!(
        decisions(&cri.envelopes),
        decisions(&rec.envelopes),
        "the CRI file gave the same decisions, in order"
    );
    let counters = kvscope_e2e::last_agent_counters(&cri.envelopes).unwrap();
    assert_eq!(
        (
            counters.decisions_unjoined,
            counters.log_lines_too_long,
            counters.log_malformed_lines
        ),
        (0, 0, 0),
        "{counters:?}"
    );
}
