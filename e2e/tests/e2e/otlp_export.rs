//! OTLP export on the real lab: Dynamo 1.6.1's KV router with 3 mocker workers under a
//! bounded workload that spills, `kvscope agent` → NATS JetStream → `kvscope collector
//! run`, both exporting to an OTLP receiver in this test — the collector over gRPC, the
//! agent over HTTP/protobuf — configured through the standard `OTEL_*` variables only.
//!
//! Asserts: both services' resources carry the semantic-convention attributes; the
//! metrics each process exports are the figures of its own `/metrics` (the collector's,
//! once the run has settled, exactly; the agent's, still running, bracketed by the
//! exports before and after a scrape); counters arrive as cumulative monotonic sums.
//! Spans: one per spill the collector counted, each with its verdict's figures from the
//! JSON API (Σ true delta equal). The frontend logs JSON lines and exports its own
//! traces to the same receiver: every verdict span is in the trace Dynamo exported for
//! its request (the `http-request` span naming the request id), a child of the router's
//! `kv_router.select_worker` span there. KVMIGRATE lines appended to the router log
//! become migration spans in the same trace, linked to the verdict span.

use kvscope_e2e::otlp_receiver;

use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::LabConfig;
use kvscope_otlp::proto::metrics::v1::{metric::Data, number_data_point, Metric};
use otlp_receiver::{string_attrs, MetricExport, Receiver, Via};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const WINDOW_SECS: f64 = 3.0;

/// One exported series: its value(s), comparable across exports.
#[derive(Debug, Clone, PartialEq)]
enum Series {
    Counter(f64),
    Gauge(f64),
    Histogram {
        count: u64,
        sum: Option<f64>,
        bounds: Vec<f64>,
        counts: Vec<u64>,
    },
}

fn num(v: &Option<number_data_point::Value>) -> f64 {
    match v {
        Some(number_data_point::Value::AsInt(i)) => *i as f64,
        Some(number_data_point::Value::AsDouble(d)) => *d,
        None => f64::NAN,
    }
}

/// Every series of `metrics`, keyed by metric name and attributes.
fn series(metrics: &[Metric]) -> BTreeMap<(String, String), Series> {
    let mut out = BTreeMap::new();
    for m in metrics {
        let key = |attrs| (m.name.clone(), format!("{:?}", string_attrs(attrs)));
        match m.data.as_ref().expect("every metric has data") {
            Data::Sum(s) => {
                assert!(s.is_monotonic, "{}: counters are monotonic sums", m.name);
                assert_eq!(s.aggregation_temporality, 2, "{}: cumulative", m.name);
                for p in &s.data_points {
                    assert!(
                        p.start_time_unix_nano > 0 && p.start_time_unix_nano <= p.time_unix_nano
                    );
                    out.insert(key(&p.attributes), Series::Counter(num(&p.value)));
                }
            }
            Data::Gauge(g) => {
                for p in &g.data_points {
                    out.insert(key(&p.attributes), Series::Gauge(num(&p.value)));
                }
            }
            Data::Histogram(h) => {
                for p in &h.data_points {
                    assert_eq!(p.bucket_counts.len(), p.explicit_bounds.len() + 1);
                    assert_eq!(p.bucket_counts.iter().sum::<u64>(), p.count, "{}", m.name);
                    out.insert(
                        key(&p.attributes),
                        Series::Histogram {
                            count: p.count,
                            sum: p.sum,
                            bounds: p.explicit_bounds.clone(),
                            counts: p.bucket_counts.clone(),
                        },
                    );
                }
            }
            other => panic!("{}: unexpected metric type {other:?}", m.name),
        }
    }
    out
}

/// The OTLP view of a `/metrics` text, through the same conversion the exporter uses.
fn scrape_series(text: &str) -> BTreeMap<(String, String), Series> {
    let c = kvscope_otlp::exposition::convert(text, 1, 1);
    assert_eq!(
        c.skipped_samples, 0,
        "every /metrics sample converts:\n{text}"
    );
    series(&c.metrics)
}

fn hex_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// Whether a span's status is an error (an unset status, sent or left out, is not).
fn is_error(s: &kvscope_otlp::proto::trace::v1::Span) -> bool {
    s.status.as_ref().is_some_and(|st| st.code == 2)
}

fn is_export_health(name: &str) -> bool {
    // The exporter's own counters move with every export.
    name.contains("_otlp_")
}

/// Wait for an export of `service` whose data is newer than `after_ns`.
async fn export_after(rx: &Receiver, service: &str, after_ns: u64) -> MetricExport {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(e) = rx
            .metric_exports(service)
            .into_iter()
            .find(|e| e.time_ns > after_ns)
        {
            return e;
        }
        assert!(
            Instant::now() < deadline,
            "no OTLP metrics from {service} in 20 s (exports so far: {})",
            rx.metric_exports(service).len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn assert_resource(e: &MetricExport, service: &str, instance: Option<&str>) {
    let r = &e.resource;
    assert_eq!(r["service.name"], service);
    assert_eq!(r["service.version"], env!("CARGO_PKG_VERSION"));
    assert!(!r["host.name"].is_empty());
    assert!(!r["service.instance.id"].is_empty());
    if let Some(i) = instance {
        assert_eq!(r["service.instance.id"], i);
    }
    assert_eq!(
        r["deployment.environment.name"], "lab",
        "OTEL_RESOURCE_ATTRIBUTES"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lab_metrics_and_spans_reach_an_otlp_receiver_over_grpc_and_http() {
    let rx = Receiver::start().await;
    // Held until the agent binds it: a port only picked could be chosen by the lab
    // starting in between (seen: a mocker's KV publisher took it).
    let agent_metrics_held = kvscope_lab::ports::reserve_ports(1).unwrap();
    let agent_metrics_port = agent_metrics_held.ports()[0];
    let agent_metrics = format!("127.0.0.1:{agent_metrics_port}");
    let common = [
        ("OTEL_METRIC_EXPORT_INTERVAL", "500"),
        // Generous: the test machine may be busy, and a failed export fails the test.
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "30000"),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment.name=lab",
        ),
    ];
    let env = |extra: &[(&str, &str)]| -> Vec<(String, String)> {
        common
            .iter()
            .chain(extra)
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let lab = LabConfig {
        workers: 3,
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        frontend_jsonl_logs: true,
        frontend_otlp_traces: Some(rx.grpc_url.clone()),
        ..LabConfig::default()
    };
    let mut run = kvscope_e2e::fleet(FleetRunConfig {
        collector_env: env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", &rx.grpc_url)]),
        agent_env: env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &rx.http_url),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("KVSCOPE_AGENT_METRICS_LISTEN", &agent_metrics),
        ]),
        ..FleetRunConfig::new(lab, WINDOW_SECS)
    })
    .await
    .expect("lab, agent and collector start");
    let summary = workload::run(WorkloadConfig {
        frontend: run.lab().frontend_url().to_string(),
        sessions: 24,
        families: 3,
        max_turns: 20,
        concurrency: 16,
        rate: Some(20.0),
        duration_secs: 12.0,
        ..WorkloadConfig::default()
    })
    .await
    .expect("the workload runs");
    assert_eq!(summary.failed, 0);
    assert!(summary.ok >= 50, "a real workload ran: {}", summary.ok);

    // The agent, still running: every counter of a scrape lies between the exports
    // before and after it; every series of the scrape is exported with its type.
    export_after(&rx, "kvscope-agent", 0).await;
    let scrape_start = kvscope_kit::clock::now_ns();
    let agent_text = kvscope_e2e::get_text(&format!("http://{agent_metrics}/metrics")).await;
    let scrape_end = kvscope_kit::clock::now_ns();
    let after = export_after(&rx, "kvscope-agent", scrape_end).await;
    assert_eq!(
        after.via,
        Via::Http,
        "the agent exported over HTTP/protobuf"
    );
    assert_resource(&after, "kvscope-agent", Some("lab-node"));
    let earlier = rx
        .metric_exports("kvscope-agent")
        .into_iter()
        .filter(|e| e.time_ns < scrape_start)
        .max_by_key(|e| e.time_ns)
        .expect("an export before the scrape");
    let (lo, mid, hi) = (
        series(&earlier.metrics),
        scrape_series(&agent_text),
        series(&after.metrics),
    );
    let mut counters = 0;
    for (key, v) in &mid {
        let exported = hi
            .get(key)
            .unwrap_or_else(|| panic!("{key:?} of /metrics not exported"));
        assert_eq!(
            std::mem::discriminant(v),
            std::mem::discriminant(exported),
            "{key:?}: same type"
        );
        if let (Series::Counter(m), Some(Series::Counter(l)), Series::Counter(h)) =
            (v, lo.get(key), exported)
        {
            assert!(l <= m && m <= h, "{key:?}: {l} <= {m} <= {h}");
            counters += 1;
        }
    }
    assert!(
        counters >= 10,
        "the agent's counters were compared: {counters}"
    );
    assert_eq!(
        mid.len(),
        hi.len(),
        "the same series on /metrics and over OTLP"
    );

    // Migration log lines (the fork's KVMIGRATE, which Dynamo 1.6.1 does not write) for
    // three spilled requests, appended to the router log the agent follows.
    let verdicts: Vec<serde_json::Value> =
        kvscope_e2e::get_json(&format!("{}/api/verdicts?limit=100000", run.api())).await;
    let spilled: Vec<&serde_json::Value> = verdicts.iter().filter(|v| v["spill"] == true).collect();
    assert!(!spilled.is_empty(), "the router spilled");
    let mut lines = String::new();
    let mut migrations = Vec::new();
    for (i, v) in spilled.iter().take(3).enumerate() {
        let rid = v["request_id"].as_str().unwrap().to_string();
        lines.push_str(&format!(
            "  INFO dynamo_llm::kv_router::push_router: KVMIGRATE_SPILL: request routed off the worker holding its KV request_id=\"{rid}\" source={} target={} tokens={} migratable_tokens={} directive_id=d-{i} blocks={}\n",
            v["best"]["worker_id"], v["chosen"]["worker_id"], v["isl_tokens"], v["upper_bound_tokens"], v["best_overlap_blocks"]
        ));
        migrations.push((rid.clone(), "dispatched"));
        if i == 0 {
            lines.push_str(&format!("  WARN dynamo_llm::kv_router::push_router: KVMIGRATE: producer dispatch failed request_id=\"{rid}\" error=\"no producer\"\n"));
            migrations.push((rid, "dispatch_failed"));
        }
    }
    {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(run.lab().router_log())
            .unwrap();
        f.write_all(lines.as_bytes()).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while run.summary().await.unwrap()["counters"]["migration_lines"].as_u64()
        != Some(migrations.len() as u64)
    {
        assert!(
            Instant::now() < deadline,
            "the collector did not see the {} KVMIGRATE lines",
            migrations.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The collector, once everything is applied and the agent stopped: its last export
    // and its /metrics agree exactly (but for the exporter's own counters).
    run.stop_agent().await;
    run.wait_drained(Duration::from_secs(1), Duration::from_secs(60))
        .await
        .expect("the collector catches up");
    let api = run.summary().await.unwrap();
    let scrape_end = kvscope_kit::clock::now_ns();
    let text = kvscope_e2e::get_text(&format!("{}/metrics", run.api())).await;
    let last = export_after(&rx, "kvscope-collector", scrape_end).await;
    assert_eq!(last.via, Via::Grpc, "the collector exported over gRPC");
    assert_resource(&last, "kvscope-collector", None);
    let (scraped, exported) = (scrape_series(&text), series(&last.metrics));
    let strip = |m: &BTreeMap<(String, String), Series>| -> BTreeMap<(String, String), Series> {
        m.iter()
            .filter(|((n, _), _)| !is_export_health(n))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    assert_eq!(
        strip(&scraped),
        strip(&exported),
        "collector: OTLP = /metrics"
    );
    // The figures are the collector's own: its JSON API's spill count is among the
    // exported counters, and the run did spill.
    let spills = api["counters"]["spills"].as_u64().expect("counters.spills");
    let decisions = api["counters"]["decisions"]
        .as_u64()
        .expect("counters.decisions");
    assert!(spills > 0, "the router spilled ({decisions} decisions)");
    let counters: Vec<f64> = exported
        .values()
        .filter_map(|v| match v {
            Series::Counter(c) => Some(*c),
            _ => None,
        })
        .collect();
    assert!(counters.contains(&(spills as f64)) && counters.contains(&(decisions as f64)));
    // No export failed.
    for (k, v) in &exported {
        if k.0.contains("export_failures") {
            assert_eq!(*v, Series::Counter(0.0), "{k:?}");
        }
    }

    // Spans: one per spill verdict, with the verdict's figures, in its request's trace;
    // one per migration line, in the same trace and linked to the verdict span.
    let verdicts: Vec<serde_json::Value> =
        kvscope_e2e::get_json(&format!("{}/api/verdicts?limit=100000", run.api())).await;
    assert_eq!(
        verdicts.len() as u64,
        decisions,
        "the API holds every verdict of the run"
    );
    let spill_verdicts: BTreeMap<String, &serde_json::Value> = verdicts
        .iter()
        .filter(|v| v["spill"] == true)
        .map(|v| (v["request_id"].as_str().unwrap().to_string(), v))
        .collect();
    assert_eq!(spill_verdicts.len() as u64, spills);
    let deadline = Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let spans = rx.spans("kvscope-collector");
        let n = |name: &str| spans.iter().filter(|(_, _, s)| s.name == name).count();
        if n(kvscope_collector::serve::spans::SPILL_SPAN) as u64 >= spills
            && n(kvscope_collector::serve::spans::MIGRATION_SPAN) >= migrations.len()
        {
            break spans;
        }
        assert!(
            Instant::now() < deadline,
            "spans missing after 20 s: {} received",
            spans.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spans = {
        let later = rx.spans("kvscope-collector");
        assert_eq!(later.len(), spans.len(), "no span arrives twice or late");
        later
    };
    let (via, resource, _) = &spans[0];
    assert_eq!(*via, Via::Grpc);
    assert_eq!(resource["service.name"], "kvscope-collector");
    assert!(resource.contains_key("host.name") && resource.contains_key("service.instance.id"));
    let spill_spans: Vec<_> = spans
        .iter()
        .filter(|(_, _, s)| s.name == kvscope_collector::serve::spans::SPILL_SPAN)
        .map(|(_, _, s)| s)
        .collect();
    assert_eq!(spill_spans.len() as u64, spills, "one span per spill");
    let mut delta_sum = 0u64;
    for s in &spill_spans {
        let a = string_attrs(&s.attributes);
        let rid = &a["kvscope.request_id"];
        let v = spill_verdicts
            .get(rid)
            .unwrap_or_else(|| panic!("span for {rid} is no spill verdict"));
        assert_eq!(
            v["trace"]["trace_id"].as_str().map(hex_bytes),
            Some(s.trace_id.clone()),
            "{rid}: the verdict names the trace its span is in"
        );
        assert_eq!(
            s.start_time_unix_nano,
            v["decided_ns"].as_u64().unwrap(),
            "decision time"
        );
        for (attr, field) in [
            ("kvscope.worker.chosen.id", &v["chosen"]["worker_id"]),
            ("kvscope.worker.best.id", &v["best"]["worker_id"]),
            ("kvscope.overlap.chosen_blocks", &v["chosen_overlap_blocks"]),
            ("kvscope.overlap.best_blocks", &v["best_overlap_blocks"]),
            ("kvscope.upper_bound_tokens", &v["upper_bound_tokens"]),
            ("kvscope.true_delta_tokens", &v["true_delta_tokens"]),
        ] {
            assert_eq!(a[attr], field.to_string(), "{rid}: {attr}");
        }
        delta_sum += a["kvscope.true_delta_tokens"].parse::<u64>().unwrap();
    }
    // Each verdict span sits in Dynamo's own trace of its request, under the router's
    // choice. Dynamo exports a request's spans when they end, in batches.
    let dynamo = kvscope_lab::FRONTEND_SERVICE_NAME;
    let deadline = Instant::now() + Duration::from_secs(30);
    let dynamo_spans = loop {
        let spans: Vec<_> = rx.spans(dynamo).into_iter().map(|(_, _, s)| s).collect();
        let requests: std::collections::BTreeSet<String> = spans
            .iter()
            .filter(|s| s.name == "http-request")
            .filter_map(|s| string_attrs(&s.attributes).get("request_id").cloned())
            .collect();
        let missing = spill_verdicts
            .keys()
            .filter(|rid| !requests.contains(*rid))
            .count();
        if missing == 0 {
            break spans;
        }
        assert!(
            Instant::now() < deadline,
            "Dynamo's traces of {missing} spilled requests not exported in 30 s \
             ({} spans from {dynamo})",
            spans.len()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    for s in &spill_spans {
        let rid = &string_attrs(&s.attributes)["kvscope.request_id"];
        let request = dynamo_spans
            .iter()
            .find(|d| {
                d.name == "http-request"
                    && string_attrs(&d.attributes).get("request_id") == Some(rid)
            })
            .unwrap();
        assert_eq!(s.trace_id, request.trace_id, "{rid}: in Dynamo's trace");
        let parent = dynamo_spans
            .iter()
            .find(|d| d.trace_id == s.trace_id && d.span_id == s.parent_span_id)
            .unwrap_or_else(|| panic!("{rid}: the verdict's parent is none of Dynamo's spans"));
        assert_eq!(parent.name, "kv_router.select_worker", "{rid}");
    }
    eprintln!(
        "{} verdict spans, each in Dynamo's trace of its request under the router's choice",
        spill_spans.len()
    );
    let api_delta: u64 = spill_verdicts
        .values()
        .map(|v| v["true_delta_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(
        delta_sum, api_delta,
        "Σ true delta of the spans = the collector's"
    );
    assert!(delta_sum > 0);
    let migration_spans: Vec<_> = spans
        .iter()
        .filter(|(_, _, s)| s.name == kvscope_collector::serve::spans::MIGRATION_SPAN)
        .map(|(_, _, s)| s)
        .collect();
    assert_eq!(migration_spans.len(), migrations.len());
    for (rid, outcome) in &migrations {
        let s = migration_spans
            .iter()
            .find(|s| {
                let a = string_attrs(&s.attributes);
                a.get("kvscope.request_id") == Some(rid)
                    && a["kvscope.migration.outcome"] == *outcome
            })
            .unwrap_or_else(|| panic!("no {outcome} migration span for {rid}"));
        let verdict_span = spill_spans
            .iter()
            .find(|v| string_attrs(&v.attributes)["kvscope.request_id"] == *rid)
            .unwrap();
        assert_eq!(
            s.trace_id, verdict_span.trace_id,
            "same trace as the verdict"
        );
        assert_eq!(s.links.len(), 1);
        assert_eq!(
            s.links[0].span_id, verdict_span.span_id,
            "linked to the verdict"
        );
        let a = string_attrs(&s.attributes);
        if *outcome == "dispatched" {
            let v = spill_verdicts[rid];
            assert_eq!(
                a["kvscope.migration.source"],
                v["best"]["worker_id"].to_string()
            );
            assert_eq!(
                a["kvscope.migration.target"],
                v["chosen"]["worker_id"].to_string()
            );
            assert_eq!(
                a["kvscope.migration.blocks"],
                v["best_overlap_blocks"].to_string()
            );
            assert!(a["kvscope.migration.directive_id"].starts_with("d-"));
        } else {
            assert_eq!(
                s.status.as_ref().map(|st| st.code),
                Some(2),
                "a failed dispatch is an error span"
            );
            assert_eq!(a["error.type"], "producer_dispatch_failed");
        }
    }
    eprintln!(
        "OTLP: {decisions} decisions, {spills} spill spans, Σ true delta {delta_sum} tokens, {} migration spans, {} collector exports",
        migration_spans.len(),
        rx.metric_exports("kvscope-collector").len()
    );
    run.stop();
}

/// The agent's NIXL spans (eBPF probes on the NIXL lab's real transfers) and its NIXL
/// latency histograms over OTLP, configured from the agent's config file this time.
///
/// The probes see every process using the lab's `libnixl.so`, including NIXL labs other
/// tests run at the same time on this machine: figures are compared for this lab's
/// processes (the pids in its truth).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_transfer_and_handshake_spans_reach_an_otlp_receiver() {
    use kvscope_lab::nats::NatsServer;
    use kvscope_lab::process::{ManagedProcess, StopOnDrop};
    use kvscope_nixl_lab::truth::{CallOutcome, TransferOutcome, Truth};
    use kvscope_otlp::proto::trace::v1::Span;
    use std::collections::BTreeSet;
    use std::process::Command;

    let rx = Receiver::start().await;
    let exe = kvscope_e2e::kvscope();
    let libs = kvscope_nixl_lab::NixlLibs::ensure(&kvscope_lab::paths::default_lab_dir())
        .unwrap_or_else(|e| panic!("the NIXL wheel is not set up: {e}"));
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_anywhere(dir.path()).expect("nats-server starts");
    let ports = kvscope_lab::ports::pick_ports(2).unwrap();
    let metrics_addr = format!("127.0.0.1:{}", ports[0]);
    let capped_metrics = format!("127.0.0.1:{}", ports[1]);
    // Two agents tracing the same library: one that exports every span, and one capped
    // at one span per second (its service name set through OTEL_SERVICE_NAME).
    let mut procs = StopOnDrop::default();
    for (id, addr, cap, service) in [
        ("nixl-node", &metrics_addr, 1_000_000, "kvscope-agent"),
        ("nixl-capped", &capped_metrics, 1, "kvscope-agent-capped"),
    ] {
        let config = dir.path().join(format!("{id}.toml"));
        std::fs::write(
            &config,
            format!(
                "[otlp]\nendpoint = \"{}\"\nexport_interval_secs = 0.5\ntimeout_secs = 30.0\n\
                 max_spans_per_second = {cap}\n\
                 resource_attributes = {{ \"deployment.environment.name\" = \"lab\" }}\n\
                 [nixl]\nsample_every = 1\n",
                rx.grpc_url
            ),
        )
        .unwrap();
        let mut agent = Command::new(&exe);
        agent
            .arg("agent")
            .arg("--config")
            .arg(&config)
            .args(["--nats-url", &nats.url(), "--cluster", "otlpnixl"])
            .args(["--agent-id", id, "--metrics-listen", addr])
            .arg("--nixl-lib")
            .arg(&libs.libnixl)
            .arg("--no-nixl-discover")
            // The config file alone configures export.
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env("OTEL_SERVICE_NAME", service);
        let log = dir.path().join(format!("{id}.log"));
        procs.push(ManagedProcess::spawn(id, agent, &log).unwrap());
        let deadline = Instant::now() + Duration::from_secs(30);
        while reqwest::get(format!("http://{addr}/metrics"))
            .await
            .is_err()
            || rx.metric_exports(service).is_empty()
        {
            if let Some(status) = procs.last_mut().unwrap().exited() {
                panic!(
                    "agent {id} exited ({status}): {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "agent {id} is not up and exporting in 30 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    let truth: Truth = kvscope_nixl_lab::run_scenario("mixed", dir.path());
    let pids: BTreeSet<String> = truth
        .transfers
        .iter()
        .map(|x| x.pid)
        .chain(truth.handshakes.iter().map(|h| h.pid))
        .map(|p| p.to_string())
        .collect();
    // The agent's /metrics sums processes per local agent (no pid label).
    let local_agents: BTreeSet<String> = truth
        .transfers
        .iter()
        .map(|x| x.local.clone())
        .chain(truth.handshakes.iter().map(|h| h.local.clone()))
        .collect();
    let done: Vec<_> = truth
        .transfers
        .iter()
        .filter(|x| x.outcome == TransferOutcome::Done)
        .collect();
    let terminal = truth
        .transfers
        .iter()
        .filter(|x| {
            x.outcome != TransferOutcome::FailedAtCreate
                && x.outcome != TransferOutcome::FailedAtPost
        })
        .count();

    // This lab's spans from `service`, with their attributes.
    let lab_spans = |service: &str| -> Vec<(BTreeMap<String, String>, Span)> {
        rx.spans(service)
            .into_iter()
            .map(|(_, r, s)| {
                assert_eq!(r["deployment.environment.name"], "lab");
                (string_attrs(&s.attributes), s)
            })
            .filter(|(a, _)| pids.contains(&a["process.pid"]))
            .collect()
    };
    let transfer_spans = || -> Vec<(BTreeMap<String, String>, Span)> {
        lab_spans("kvscope-agent")
            .into_iter()
            .filter(|(_, s)| s.name == kvscope_agent::nixl::spans::TRANSFER_SPAN)
            .collect()
    };
    let complete = |spans: &[(BTreeMap<String, String>, Span)]| {
        spans
            .iter()
            .filter(|(a, _)| a["nixl.stage"] == "complete")
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while complete(&transfer_spans()) < terminal {
        assert!(
            Instant::now() < deadline,
            "{} of {terminal} completed transfer spans in 30 s",
            complete(&transfer_spans())
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spans = transfer_spans();
    assert_eq!(
        complete(&spans),
        terminal,
        "a span per transfer that reached a terminal status"
    );
    assert_eq!(
        spans.len(),
        truth.transfers.len(),
        "a span per transfer the lab made"
    );
    let resource = &rx.spans("kvscope-agent")[0].1;
    assert_eq!(resource["service.instance.id"], "nixl-node");
    assert!(!resource["host.name"].is_empty() && !resource["service.version"].is_empty());
    let ok_spans: Vec<_> = spans
        .iter()
        .filter(|(a, _)| a["nixl.stage"] == "complete" && a["nixl.status_code"] == "0")
        .collect();
    assert_eq!(ok_spans.len(), done.len(), "successful transfer spans");
    let bytes: u64 = ok_spans
        .iter()
        .map(|(a, _)| a["nixl.bytes"].parse::<u64>().unwrap())
        .sum();
    assert_eq!(
        bytes,
        done.iter().map(|x| x.bytes).sum::<u64>(),
        "Σ bytes = the lab's"
    );
    // Notifications: each successful transfer's span carries the message the lab
    // attached to it; those in vLLM's format (`<request id>:<readers>`) name their
    // request and sit in its trace.
    let mut want_notifs: Vec<Option<String>> = done.iter().map(|x| x.notif.clone()).collect();
    let mut got_notifs: Vec<Option<String>> = ok_spans
        .iter()
        .map(|(a, _)| a.get("nixl.notif").cloned())
        .collect();
    want_notifs.sort();
    got_notifs.sort();
    assert_eq!(got_notifs, want_notifs, "each transfer's notification");
    let mut named = 0;
    for (a, s) in &ok_spans {
        let notif = a.get("nixl.notif").map(String::as_str);
        let want = notif.and_then(kvscope_wire::nixl::notif_request_id);
        assert_eq!(
            a.get("kvscope.request_id").map(String::as_str),
            want,
            "{notif:?}"
        );
        if let Some(rid) = want {
            assert_eq!(
                s.trace_id,
                kvscope_wire::trace_ids::trace_id(rid),
                "{rid}: its trace"
            );
            named += 1;
        }
    }
    assert!(named > 0, "the lab's READ migrations name their requests");
    for (a, s) in &ok_spans {
        assert!(
            s.end_time_unix_nano > s.start_time_unix_nano,
            "the span lasts its latency"
        );
        assert!(!is_error(s), "{a:?}");
        assert!(!a["nixl.local_agent"].is_empty() && !a["nixl.remote_agent"].is_empty());
        assert!(a["nixl.op"] == "READ" || a["nixl.op"] == "WRITE");
    }
    // Every transfer's record sent (`sample_every = 1`): each span says why it was
    // kept (sampled, and a failure or a notification where it is one) and of how many.
    // Failed creations are never counted in the kernel: every one has its span, which
    // says nothing of sampling.
    for (a, s) in &spans {
        if a["nixl.stage"] == "create" {
            assert!(!a.contains_key("nixl.kept_for"), "{a:?}");
            continue;
        }
        let kept: BTreeSet<&str> = a["nixl.kept_for"].split(',').collect();
        assert!(kept.contains("sampled"), "{a:?}");
        assert_eq!(kept.contains("failure"), is_error(s), "{a:?}");
        assert_eq!(
            kept.contains("notification"),
            a.contains_key("nixl.notif"),
            "{a:?}"
        );
        assert_eq!(a["nixl.sample_every"], "1");
    }
    let failed = spans.iter().filter(|(_, s)| is_error(s)).count();
    // Each error span says what went wrong (OTel's error.type): the NIXL status, or the
    // release in flight.
    for (a, s) in spans.iter().filter(|(_, s)| is_error(s)) {
        let want = if a["nixl.stage"] == "released_in_flight" {
            "released_in_flight".to_string()
        } else {
            a["nixl.status"].clone()
        };
        assert_eq!(a.get("error.type"), Some(&want), "{s:?}");
    }
    assert!(
        spans
            .iter()
            .all(|(a, s)| is_error(s) || !a.contains_key("error.type")),
        "only error spans carry error.type"
    );
    assert_eq!(
        failed,
        truth.transfers.len() - done.len(),
        "failed transfers are error spans"
    );

    // Handshakes: every metadata exchange of the lab, by local agent, method and outcome.
    let mut want: BTreeMap<(String, String, bool), u64> = BTreeMap::new();
    for h in &truth.handshakes {
        let key = (
            h.local.clone(),
            h.call.method().to_string(),
            h.outcome == CallOutcome::Ok,
        );
        *want.entry(key).or_default() += 1;
    }
    let mut got: BTreeMap<(String, String, bool), u64> = BTreeMap::new();
    for (a, s) in lab_spans("kvscope-agent") {
        if s.name == kvscope_agent::nixl::spans::TRANSFER_SPAN {
            continue;
        }
        assert_eq!(s.name, format!("nixl.{}", a["nixl.call"]));
        let key = (
            a["nixl.local_agent"].clone(),
            a["nixl.call"].clone(),
            a["nixl.status_code"] == "0",
        );
        *got.entry(key).or_default() += 1;
    }
    for (k, n) in &want {
        assert_eq!(got.get(k), Some(n), "handshake spans {k:?}; all: {got:?}");
    }

    // This lab's NIXL latency histograms arrive as histograms equal to /metrics (its
    // processes have exited: their figures no longer move).
    let scrape_end = kvscope_kit::clock::now_ns();
    let text = kvscope_e2e::get_text(&format!("http://{metrics_addr}/metrics")).await;
    let export = export_after(&rx, "kvscope-agent", scrape_end).await;
    let (scraped, exported) = (scrape_series(&text), series(&export.metrics));
    let mut histograms = 0;
    for (k, v) in &scraped {
        let of_this_lab = local_agents
            .iter()
            .any(|a| k.1.contains(&format!("\"local_agent\": \"{a}\"")));
        if let (Series::Histogram { count, .. }, true) = (v, of_this_lab) {
            assert_eq!(exported.get(k), Some(v), "{k:?}");
            histograms += usize::from(*count > 0);
        }
        if k.0.contains("spans_dropped") || k.0.contains("export_failures") {
            assert_eq!(
                *v,
                Series::Counter(0.0),
                "{k:?}: {}",
                std::fs::read_to_string(dir.path().join("nixl-node.log")).unwrap_or_default()
            );
        }
    }
    assert!(histograms > 0, "latency histograms were exported");

    // The capped agent: spans beyond one per second are dropped and counted, none
    // lost otherwise.
    let all = lab_spans("kvscope-agent").len();
    let capped = lab_spans("kvscope-agent-capped").len();
    let text = kvscope_e2e::get_text(&format!("http://{capped_metrics}/metrics")).await;
    let dropped = |reason: &str| -> f64 {
        scrape_series(&text)
            .iter()
            .filter(|((n, attrs), _)| n.contains("spans_dropped") && attrs.contains(reason))
            .map(|(_, v)| match v {
                Series::Counter(c) => *c,
                _ => 0.0,
            })
            .sum()
    };
    let (rate, queue, failed) = (
        dropped("rate_cap"),
        dropped("queue_full"),
        dropped("export_failed"),
    );
    assert!(
        rate > 0.0 && capped < all,
        "one span per second drops some of the lab's {all}: {capped} exported, {rate} dropped"
    );
    assert_eq!((queue, failed), (0.0, 0.0));
    eprintln!(
        "OTLP NIXL: {} transfer spans ({} ok, Σ {bytes} bytes), {} handshake spans, \
         {histograms} latency histograms; capped at 1/s: {capped} of {all} exported, {rate} dropped",
        spans.len(),
        ok_spans.len(),
        got.values().sum::<u64>()
    );
    procs.stop(Duration::from_secs(5));
}
