//! OTLP export on the real lab: Dynamo 1.6.1's KV router with 3 mocker workers under a
//! bounded workload that spills, `kvscope agent` → NATS JetStream → `kvscope collector
//! run`, both exporting to an OTLP receiver in this test — the collector over gRPC, the
//! agent over HTTP/protobuf — configured through the standard `OTEL_*` variables only.
//!
//! Asserts: both services' resources carry the semantic-convention attributes; the
//! metrics each process exports are the figures of its own `/metrics` (the collector's,
//! once the run has settled, exactly; the agent's, still running, bracketed by the
//! exports before and after a scrape); counters arrive as cumulative monotonic sums.

mod otlp_receiver;

use kvscope::fleet_run::{FleetRun, FleetRunConfig};
use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::LabConfig;
use kvscope_otlp::proto::metrics::v1::{metric::Data, number_data_point, Metric};
use otlp_receiver::{string_attrs, MetricExport, Receiver, Via};
use std::collections::BTreeMap;
use std::path::Path;
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

fn is_export_health(name: &str) -> bool {
    // The exporter's own counters move with every export.
    name.contains("_otlp_")
}

async fn get_text(url: &str) -> String {
    reqwest::get(url)
        .await
        .and_then(|r| r.error_for_status())
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .text()
        .await
        .unwrap()
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
async fn lab_metrics_reach_an_otlp_receiver_over_grpc_and_http() {
    let rx = Receiver::start().await;
    let agent_metrics_port = kvscope_lab::ports::pick_ports(1).unwrap()[0];
    let agent_metrics = format!("127.0.0.1:{agent_metrics_port}");
    let common = [
        ("OTEL_METRIC_EXPORT_INTERVAL", "500"),
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
        ..LabConfig::default()
    };
    kvscope_lab::setup::ensure_venv(&lab.lab_dir).expect("the lab venv (scripts/setup makes it)");
    let mut run = FleetRun::start(
        Path::new(env!("CARGO_BIN_EXE_kvscope")),
        FleetRunConfig {
            lab,
            window_secs: WINDOW_SECS,
            warmup_secs: WINDOW_SECS,
            collector_env: env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", &rx.grpc_url)]),
            agent_env: env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", &rx.http_url),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
                ("KVSCOPE_AGENT_METRICS_LISTEN", &agent_metrics),
            ]),
        },
    )
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
    let scrape_start = kvscope_otlp::now_ns();
    let agent_text = get_text(&format!("http://{agent_metrics}/metrics")).await;
    let scrape_end = kvscope_otlp::now_ns();
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

    // The collector, once everything is applied and the agent stopped: its last export
    // and its /metrics agree exactly (but for the exporter's own counters).
    run.stop_agent();
    run.wait_drained(Duration::from_secs(1), Duration::from_secs(60))
        .await
        .expect("the collector catches up");
    let api = run.summary().await.unwrap();
    let scrape_end = kvscope_otlp::now_ns();
    let text = get_text(&format!("{}/metrics", run.api())).await;
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
    run.stop();
}
