//! A fleet serving two models behind one frontend: the lab with four mockers, two
//! serving `alpha` and two `beta` (Dynamo 1.6.1's KV router keeps one index per model),
//! and the same chat workload sent to both models at once, so the two models' prompts
//! share every token prefix. kvscope learns each worker's model from discovery.
//!
//! Asserts: every verdict names its request's model, its best worker serves that model
//! and no worker of the other model appears among its overlaps, although the other
//! model's workers held the same tokens (shown with Dynamo's radix tree fed all the
//! events); overlaps equal Dynamo's per-model indexes exactly; the figures are split
//! per model (report and `/metrics`); a collector limited to one model
//! (`--models alpha`) judges only that model's decisions and mirrors only its workers.

use kvscope_e2e::oracle;

use kvscope_collector::fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_collector::report::OpportunityReport;
use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::LabConfig;
use kvscope_wire::recording::read_recording;
use kvscope_wire::{Record, WorkerKey};
use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

const WINDOW_SECS: f64 = 4.0;

fn analyzer(models: &[&str]) -> FleetAnalyzer {
    FleetAnalyzer::new(AnalyzerConfig {
        window_secs: WINDOW_SECS,
        warmup_secs: WINDOW_SECS,
        models: models.iter().map(|m| m.to_string()).collect(),
        ..AnalyzerConfig::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_are_measured_apart_and_a_collector_can_take_one() {
    let lab = LabConfig {
        workers: 4,
        model_name: "alpha".into(),
        worker_models: ["alpha", "alpha", "beta", "beta"]
            .map(String::from)
            .to_vec(),
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        ..LabConfig::default()
    };
    let exe = kvscope_e2e::kvscope();
    let run = kvscope_e2e::fleet(FleetRunConfig::new(lab, WINDOW_SECS))
        .await
        .expect("lab, agent and collector start");
    let models: BTreeMap<u64, String> = run
        .lab()
        .workers()
        .iter()
        .map(|w| (w.worker_id, w.model.clone()))
        .collect();
    // The same conversations (same seed) to both models.
    let workload = |model: &str| WorkloadConfig {
        frontend: run.lab().frontend_url().to_string(),
        model: Some(model.to_string()),
        tag: Some(format!("m-{model}")),
        sessions: 12,
        families: 2,
        max_turns: 20,
        concurrency: 6,
        rate: Some(8.0),
        duration_secs: 16.0,
        ..WorkloadConfig::default()
    };
    let (a, b) = tokio::join!(
        workload::run(workload("alpha")),
        workload::run(workload("beta"))
    );
    let (a, b) = (a.expect("alpha workload"), b.expect("beta workload"));
    assert!(a.ok >= 30 && b.ok >= 30, "{} / {} requests", a.ok, b.ok);
    assert_eq!(a.failed + b.failed, 0);
    run.wait_for_decisions((a.ok + b.ok) as u64, Duration::from_secs(60))
        .await
        .expect("every decision reaches the collector");
    let metrics = run.get_text("/metrics").await.unwrap();

    // A live collector for alpha alone, on the same stream: it consumes only alpha's
    // subjects (one filter, its own durable consumer) and judges alpha's decisions as
    // the whole-fleet collector did, without decoding a record of beta's.
    let held = kvscope_lab::ports::reserve_ports(1).unwrap();
    let listen = format!("127.0.0.1:{}", held.ports()[0]);
    let mut cmd = Command::new(&exe);
    cmd.args(["collector", "--models", "alpha"])
        .args(["--window-secs", &WINDOW_SECS.to_string()])
        .args(["--warmup-secs", &WINDOW_SECS.to_string()])
        .args(["run", "--nats-url", run.nats_url(), "--cluster"])
        .arg(kvscope_fleet::fleet_run::LAB_CLUSTER)
        .args(["--listen", &listen])
        .envs(
            run.bus_env(kvscope_lab::bus_security::COLLECTOR_USER)
                .unwrap(),
        );
    let _alpha_only = StopOnDrop(vec![ManagedProcess::spawn(
        "collector-alpha",
        cmd,
        &run.run_dir().join("collector-alpha.log"),
    )
    .unwrap()]);
    let alpha_decisions = |text: &str, model: &str| -> Option<u64> {
        let series = format!("kvscope_model_decisions_total{{model=\"{model}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.trim().parse().ok())
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let limited: serde_json::Value = loop {
        let text = reqwest::get(format!("http://{listen}/metrics"))
            .await
            .ok()
            .map(|r| r.text());
        let text = match text {
            Some(t) => t.await.unwrap_or_default(),
            None => String::new(),
        };
        if alpha_decisions(&text, "alpha") == Some(a.ok as u64) {
            assert_eq!(alpha_decisions(&text, "beta"), None, "no beta figures");
            break kvscope_e2e::get_json(&format!("http://{listen}/api/summary")).await;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the alpha collector did not judge alpha's {} decisions: {:?}",
            a.ok,
            alpha_decisions(&text, "alpha")
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(
        limited["bus"]["filter"].as_str(),
        Some("kvscope.lab.*.m.alpha.>")
    );
    assert_eq!(
        limited["counters"]["decisions_other_models"], 0,
        "{limited}"
    );
    assert_eq!(limited["counters"]["batches_other_models"], 0, "{limited}");
    assert_eq!(limited["counters"]["undecodable_records"], 0);
    // The whole-fleet collector judged the same alpha decisions, and skipped the agents'
    // per-model copies of their heartbeats.
    assert_eq!(alpha_decisions(&metrics, "alpha"), Some(a.ok as u64));
    let whole = run.summary().await.unwrap();
    assert!(
        whole["bus"]["model_copies_skipped"].as_u64() > Some(0),
        "{}",
        whole["bus"]
    );

    let router_log = run.lab().router_log().to_path_buf();
    let recording = run.finish().await.expect("the collector catches up");
    let rec = read_recording(&recording).unwrap();

    // Every verdict is judged among its model's workers.
    let mut all = analyzer(&[]);
    let verdicts: Vec<_> = rec.envelopes.iter().filter_map(|e| all.apply(e)).collect();
    assert_eq!(verdicts.len(), a.ok + b.ok);
    let model_of = |w: &WorkerKey| models[&w.worker_id].as_str();
    for v in &verdicts {
        let m = v.model.as_deref().expect("the verdict names its model");
        assert_eq!(model_of(&v.chosen), m);
        assert_eq!(
            model_of(&v.best),
            m,
            "{}: best worker of another model",
            v.request_id
        );
        assert!(
            v.overlaps.keys().all(|w| model_of(w) == m),
            "{:?}",
            v.overlaps
        );
    }
    oracle::assert_overlaps_equal(&verdicts, &rec.envelopes);
    // Without discovery (a fleet followed with `--kv ENDPOINT=ID` alone): each worker's
    // model comes from the router's own lines (`[ROUTING_INPUT]` carries the request's
    // model), and every verdict is still judged among its model's workers, equal to
    // Dynamo's per-model indexes (the oracle told the models by the store).
    let without_store: Vec<_> = rec
        .envelopes
        .iter()
        .filter(|e| !matches!(e.record, Record::Worker(_)))
        .cloned()
        .collect();
    let mut blind = analyzer(&[]);
    let blind_verdicts: Vec<_> = without_store
        .iter()
        .filter_map(|e| blind.apply(e))
        .collect();
    assert_eq!(blind_verdicts.len(), a.ok + b.ok);
    // A verdict with no model is one whose router line named none: checked against the
    // router's own log, so a model the line carried and the agent lost fails here.
    let router_log = std::fs::read_to_string(&router_log).expect("the frontend's log");
    let mut unnamed = Vec::new();
    for v in &blind_verdicts {
        let Some(m) = v.model.as_deref() else {
            let needle = format!("request_id=\"{}\"", v.request_id);
            let lines: Vec<&str> = router_log
                .lines()
                .filter(|l| l.contains("[ROUTING_INPUT]") && l.contains(&needle))
                .collect();
            assert!(!lines.is_empty(), "{}: no routing line", v.request_id);
            for l in &lines {
                // What the line carried besides its hashes, for whoever reads the log.
                let shown = match (l.find("local_hashes=["), l.rfind(']')) {
                    (Some(a), Some(b)) if a < b => format!("{}…{}", &l[..a], &l[b + 1..]),
                    _ => l.to_string(),
                };
                eprintln!("a routing line that names no model: {shown}");
                assert!(
                    !l.contains(" model="),
                    "{}: the router's line names its model, the verdict does not",
                    v.request_id
                );
            }
            unnamed.push(v.request_id.clone());
            continue;
        };
        assert_eq!(model_of(&v.chosen), m);
        assert!(
            v.overlaps.keys().all(|w| model_of(w) == m),
            "{:?}",
            v.overlaps
        );
    }
    // The frontend's request span names the model on every routing line it logs inside
    // the request (every one in every lab run looked at); one logged outside it is rare.
    assert!(
        unnamed.len() * 50 <= blind_verdicts.len(),
        "{} of {} routing lines name no model",
        unnamed.len(),
        blind_verdicts.len()
    );
    assert_eq!(
        blind.counters().verdicts_model_unknown as usize,
        unnamed.len()
    );
    assert_eq!(blind.counters().verdicts_left_out_unknown_model, 0);
    assert_eq!(blind.models_learned().count(), models.len());
    let named: Vec<_> = blind_verdicts
        .iter()
        .filter(|v| !unnamed.contains(&v.request_id))
        .cloned()
        .collect();
    oracle::assert_overlaps_equal(&named, &rec.envelopes);
    // Without the split, the other model's workers would have looked like candidates:
    // one radix tree fed every event finds them holding the same prefixes.
    let mut blended = oracle::DynamoOracle::new();
    let mut crossed = 0;
    for e in &rec.envelopes {
        match &e.record {
            Record::KvEvents(batch) => blended.apply(batch),
            Record::Decision(d) => {
                let m = model_of(&d.worker);
                crossed += usize::from(
                    blended
                        .overlaps(&d.local_hashes)
                        .keys()
                        .any(|w| model_of(w) != m),
                );
            }
            _ => {}
        }
    }
    assert!(crossed > 0, "the two models' workers shared prefixes");
    eprintln!(
        "{} decisions ({} alpha, {} beta); {crossed} would have counted another model's workers",
        verdicts.len(),
        a.ok,
        b.ok
    );

    // Figures per model, in the report and on /metrics.
    let report = OpportunityReport::from_analyzer(&all);
    assert_eq!(
        report.models.keys().map(String::as_str).collect::<Vec<_>>(),
        ["alpha", "beta"]
    );
    let totals = &all.totals().models;
    assert_eq!(totals["alpha"].requests as usize, a.ok);
    assert_eq!(totals["beta"].requests as usize, b.ok);
    assert!(report.to_markdown().contains("## Models"));
    for m in ["alpha", "beta"] {
        assert!(
            metrics.contains(&format!("kvscope_model_decisions_total{{model=\"{m}\"}}")),
            "{metrics}"
        );
    }

    // A collector for one model.
    let mut alpha = analyzer(&["alpha"]);
    let only: Vec<_> = rec
        .envelopes
        .iter()
        .filter_map(|e| alpha.apply(e))
        .collect();
    assert_eq!(only.len(), a.ok);
    assert!(only.iter().all(|v| v.model.as_deref() == Some("alpha")));
    assert_eq!(alpha.counters().decisions_other_models as usize, b.ok);
    assert!(alpha.counters().batches_other_models > 0);
    for (id, m) in &models {
        let k = WorkerKey {
            worker_id: *id,
            dp_rank: 0,
        };
        assert_eq!(
            alpha.index().cached_blocks(&k) > 0,
            m == "alpha",
            "worker {id} ({m}) mirrored by the alpha collector?"
        );
    }
    let out = kvscope_e2e::succeeded(
        Command::new(&exe)
            .args(["collector", "--models", "alpha"])
            .args(["--window-secs", &WINDOW_SECS.to_string()])
            .args(["--warmup-secs", &WINDOW_SECS.to_string()])
            .args(["report", "--format", "json", "--replay"])
            .arg(&recording),
    );
    let cli: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        cli["collector"]["decisions"].as_u64(),
        Some(a.ok as u64),
        "kvscope collector --models alpha judges alpha only"
    );
}
