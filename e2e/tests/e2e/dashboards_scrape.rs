//! The Grafana dashboards against a real Prometheus fed by a real lab run.
//!
//! One run: the Dynamo lab fleet (KV router + 3 mockers) with `kvscope agent` (KV taps,
//! the router's log, and eBPF probes on the NIXL wheel's libnixl.so) and `kvscope
//! collector`; the NIXL lab's mixed scenario (real transfers, injected handshake and
//! transfer failures) under the agent's probes; `kvscope actuator` (DRY) reading the
//! collector; and Debian's Prometheus scraping agent, collector and actuator every
//! 2 s. Then every target of every panel of every dashboard in
//! `dashboards/grafana/dashboards/` goes through Prometheus' `/api/v1/query`, with the
//! template variables at "All" and Grafana's macros set to the run's span. No panel is
//! skipped: a panel without a query, a target without data, or a panel whose data is
//! all NaN fails the test naming the dashboard, panel and expression. Each template
//! variable's `label_values()` query must have values too, and every `/metrics` of
//! kvscope's must pass `promtool check metrics`. Prometheus scrapes Dynamo's frontend
//! too, whose own figures a panel sets beside kvscope's.
//!
//! Needs root for the probes (CI runs as root) and Debian's prometheus (scripts/setup).

use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use kvscope_lab::prometheus::{PrometheusServer, ScrapeJob};
use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::LabConfig;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

const TOKEN: &str = "scrape-test-token-0123456789";

fn dashboards_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dashboards/grafana/dashboards")
}

/// Every dashboard JSON, by file name.
fn load_dashboards() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dashboards_dir()).expect("dashboards/grafana/dashboards") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            let v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap())
                .unwrap_or_else(|e| panic!("{name} is not valid JSON: {e}"));
            out.push((name, v));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(out.len() >= 4, "four dashboards at least: {out:?}");
    out
}

/// Panels, rows' nested panels included (rows themselves are not panels with data).
fn panels(dash: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().into_iter().flatten() {
        if p["type"] == "row" {
            out.extend(p["panels"].as_array().into_iter().flatten());
        } else {
            out.push(p);
        }
    }
    out
}

/// Replace the dashboard's template variables (at "All": their `allValue`) and Grafana's
/// macros; an unknown `$name` left over is an error.
fn substitute(expr: &str, vars: &[(String, String)], span_s: u64) -> Result<String, String> {
    let span = format!("{span_s}s");
    let mut s = expr
        .replace("$__rate_interval", &span)
        .replace("$__range_s", &span_s.to_string())
        .replace("$__range_ms", &(span_s * 1000).to_string())
        .replace("$__range", &span)
        .replace("$__interval_ms", "1000")
        .replace("$__interval", "1s");
    // Longest names first, so `$agent` does not eat the start of `$agent_id`.
    let mut vars = vars.to_vec();
    vars.sort_by_key(|(n, _)| std::cmp::Reverse(n.len()));
    for (name, value) in &vars {
        s = s
            .replace(&format!("${{{name}}}"), value)
            .replace(&format!("${name}"), value);
    }
    match s.find('$') {
        Some(i) => Err(format!("unknown variable or macro at {:?}", &s[i..])),
        None => Ok(s),
    }
}

fn finite_values(result: &[Value]) -> usize {
    result
        .iter()
        .filter_map(|r| r["value"][1].as_str())
        .filter(|v| v.parse::<f64>().is_ok_and(f64::is_finite))
        .count()
}

/// The NIXL lab's mixed scenario (real transfers and handshakes, injected failures).
async fn run_nixl_lab() {
    let out = tokio::task::spawn_blocking(|| {
        Command::new(kvscope_nixl_lab::lab_binary())
            .args(["run", "--scenario", "mixed"])
            .output()
    })
    .await
    .unwrap()
    .expect("the NIXL lab runs");
    assert!(
        out.status.success(),
        "the NIXL lab failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn get(url: &str) -> Option<String> {
    reqwest::get(url).await.ok()?.text().await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_panel_has_data_from_a_real_prometheus() {
    let dashboards = load_dashboards();
    let exe = kvscope_e2e::kvscope();
    let libs = kvscope_nixl_lab::NixlLibs::ensure(&kvscope_lab::paths::default_lab_dir())
        .unwrap_or_else(|e| panic!("the NIXL wheel is not set up (scripts/setup): {e}"));
    let lab = LabConfig {
        workers: 3,
        frontend_args: vec!["--router-temperature".into(), "0.2".into()],
        ..LabConfig::default()
    };
    // Held until the test ends: the lab starts (and chooses its own ports) before the
    // agent and the actuator bind these.
    let ports_held = kvscope_lab::ports::reserve_ports(2).unwrap();
    let ports = ports_held.ports();
    let agent_addr = format!("127.0.0.1:{}", ports[0]);
    let actuator_addr = format!("127.0.0.1:{}", ports[1]);
    let run = kvscope_e2e::fleet_with(FleetRunConfig::new(lab, 2.0), |_| {
        Ok(vec![
            "--metrics-listen".into(),
            agent_addr.clone(),
            "--nixl-lib".into(),
            libs.libnixl.display().to_string(),
            "--no-nixl-discover".into(),
        ])
    })
    .await
    .expect("lab, agent (with NIXL probes) and collector start");
    let dir = tempfile::tempdir().unwrap();

    let mut actuator = Command::new(&exe);
    actuator
        .args(["actuator", "--collector-url", &run.api()])
        .arg("--audit-log")
        .arg(dir.path().join("audit.jsonl"))
        .args(["run", "--listen", &actuator_addr, "--interval-secs", "1"])
        .env_remove("KVSCOPE_ACTUATOR_CONFIG")
        .env("KVSCOPE_ACTUATOR_API_TOKEN", TOKEN);
    let mut procs = StopOnDrop(vec![ManagedProcess::spawn(
        "actuator",
        actuator,
        &dir.path().join("actuator.log"),
    )
    .unwrap()]);

    let prom = PrometheusServer::start(
        dir.path(),
        &[
            ScrapeJob {
                job: "kvscope-agent".into(),
                targets: vec![agent_addr.clone()],
            },
            ScrapeJob {
                job: "kvscope-collector".into(),
                targets: vec![run.collector_addr().to_string()],
            },
            ScrapeJob {
                job: "kvscope-actuator".into(),
                targets: vec![actuator_addr.clone()],
            },
            // The router's own figures, which a panel sets beside kvscope's.
            ScrapeJob {
                job: "dynamo-frontend".into(),
                targets: vec![run
                    .lab()
                    .frontend_url()
                    .trim_start_matches("http://")
                    .to_string()],
            },
        ],
        2,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let started = Instant::now();

    // The probes are attached once the agent's /metrics shows the library.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !get(&format!("http://{agent_addr}/metrics"))
        .await
        .unwrap_or_default()
        .contains("kvscope_agent_nixl_library_info{")
    {
        assert!(
            Instant::now() < deadline,
            "the agent did not attach its NIXL probes in 30 s (see {})",
            run.lab().run_dir().join("agent.log").display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // NIXL traffic with injected failures, twice: the collector's per-pair series are
    // born with the first run's totals (a rate needs them to grow while scraped), the
    // second run, beside the chat workload that makes spills, makes them grow.
    run_nixl_lab().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while prom
        .query("kvscope_nixl_pair_transfer_bytes_total > 0")
        .await
        .map_or(true, |r| r.is_empty())
    {
        assert!(
            Instant::now() < deadline,
            "Prometheus has no NIXL pair figures 30 s after the NIXL lab ran"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let second_nixl_run = tokio::spawn(run_nixl_lab());
    let summary = workload::run(WorkloadConfig {
        frontend: run.lab().frontend_url().to_string(),
        sessions: 48,
        families: 3,
        max_turns: 40,
        concurrency: 32,
        rate: Some(20.0),
        duration_secs: 20.0,
        ..WorkloadConfig::default()
    })
    .await
    .expect("the workload runs");
    second_nixl_run.await.unwrap();
    assert_eq!(summary.failed, 0, "every workload request succeeds");

    // Every target scraped and the figures in: measured windows, spills, NIXL pairs.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut missing = Vec::new();
        for (what, expr) in [
            // Scraped successfully in the last 20 s: on a loaded 2-core machine a single
            // scrape can time out, which is not what this test is about.
            (
                "every target scraped",
                "min(max_over_time(up[20s])) == 1 and count(up) == 4",
            ),
            ("a measured window", "kvscope_windows_measured > 0"),
            ("spills", "kvscope_spill_true_delta_tokens_count > 0"),
            ("NIXL pairs", "kvscope_nixl_pair_transfer_bytes_total > 0"),
            (
                "handshake failures",
                "kvscope_nixl_pair_handshakes_total{outcome=\"failed\"} > 0",
            ),
            (
                "actuator evaluations",
                "sum(kvscope_actuator_evaluations_total) > 0",
            ),
        ] {
            if prom.query(expr).await.map_or(true, |r| r.is_empty()) {
                missing.push(what);
            }
        }
        if missing.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            let targets = prom.targets().await.unwrap_or_default();
            panic!("after 60 s Prometheus still lacks {missing:?}; targets: {targets:?}");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // A few more scrapes so every rate has two points after the last change.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let span_s = started.elapsed().as_secs() + 5;

    let mut failures = Vec::new();
    // Every /metrics passes Prometheus' own lint (names, units, _total, help) in the
    // text format; Prometheus itself scraped them as OpenMetrics where offered.
    for (job, addr) in [
        ("agent", agent_addr.as_str()),
        ("collector", run.collector_addr()),
        ("actuator", actuator_addr.as_str()),
    ] {
        let text = get(&format!("http://{addr}/metrics"))
            .await
            .unwrap_or_default();
        if let Err(e) = kvscope_lab::prometheus::check_metrics(&text) {
            failures.push(format!("the {job}'s /metrics: {e:#}"));
        }
    }
    let (mut n_panels, mut n_targets) = (0, 0);
    for (file, dash) in &dashboards {
        let mut vars = Vec::new();
        for v in dash["templating"]["list"].as_array().into_iter().flatten() {
            let name = v["name"].as_str().unwrap_or_default().to_string();
            match v["type"].as_str() {
                Some("datasource") => vars.push((name, "prometheus".to_string())),
                Some("query") => {
                    // label_values(metric, label): the variable has values.
                    let def = v["query"]["query"]
                        .as_str()
                        .or(v["query"].as_str())
                        .unwrap_or_default();
                    let inner = def
                        .strip_prefix("label_values(")
                        .and_then(|s| s.strip_suffix(')'))
                        .and_then(|s| s.rsplit_once(','));
                    // The variables before it (`$cluster`) at their All values, as
                    // Grafana resolves a chained variable.
                    let inner = inner.map(|(metric, label)| {
                        (substitute(metric.trim(), &vars, span_s), label.trim())
                    });
                    match inner {
                        Some((Err(e), _)) => {
                            failures.push(format!("{file}: variable ${name}: {e} in {def}"))
                        }
                        Some((Ok(metric), label)) => {
                            let q = format!("count by ({label}) ({metric})");
                            if prom.query(&q).await.map_or(true, |r| r.is_empty()) {
                                failures
                                    .push(format!("{file}: variable ${name}: no values for {def}"));
                            }
                        }
                        None => failures.push(format!(
                            "{file}: variable ${name}: not a label_values() query: {def:?}"
                        )),
                    }
                    match v["allValue"].as_str() {
                        Some(all) if v["includeAll"] == true => vars.push((name, all.to_string())),
                        _ => failures.push(format!("{file}: variable ${name} has no All value")),
                    }
                }
                other => failures.push(format!(
                    "{file}: variable ${name} of unexpected type {other:?}"
                )),
            }
        }
        for p in panels(dash) {
            n_panels += 1;
            let title = p["title"].as_str().unwrap_or("(untitled)");
            let targets = p["targets"].as_array().cloned().unwrap_or_default();
            if targets.is_empty() {
                failures.push(format!("{file}: panel {title:?} has no query"));
                continue;
            }
            if p["datasource"]["uid"] != "${datasource}" {
                failures.push(format!(
                    "{file}: panel {title:?} does not use the $datasource variable"
                ));
            }
            let mut finite = 0;
            for t in &targets {
                n_targets += 1;
                let raw = t["expr"].as_str().unwrap_or_default();
                let expr = match substitute(raw, &vars, span_s) {
                    Ok(e) => e,
                    Err(e) => {
                        failures.push(format!("{file}: panel {title:?}: {e} in {raw}"));
                        continue;
                    }
                };
                match prom.query(&expr).await {
                    Ok(r) if r.is_empty() => {
                        failures.push(format!("{file}: panel {title:?}: no data for {expr}"))
                    }
                    Ok(r) => finite += finite_values(&r),
                    Err(e) => failures.push(format!("{file}: panel {title:?}: {e:#} for {expr}")),
                }
            }
            if finite == 0 {
                failures.push(format!(
                    "{file}: panel {title:?}: every value is NaN or missing ({} targets)",
                    targets.len()
                ));
            }
        }
    }
    // Metrics -> traces: Prometheus kept the exemplars of the spill histograms, and each
    // names the trace of a verdict the collector gave (its spans' trace id).
    let verdict_traces: std::collections::BTreeSet<String> = run
        .get_json::<Vec<Value>>("/api/verdicts?limit=100000")
        .await
        .unwrap_or_default()
        .iter()
        .filter_map(|v| v["request_id"].as_str())
        .map(kvscope_wire::trace_ids::trace_id_hex)
        .collect();
    match prom
        .exemplars("kvscope_spill_true_delta_tokens_bucket", span_s + 60)
        .await
    {
        Ok(series) => {
            let traces: Vec<String> = series
                .iter()
                .flat_map(|s| s["exemplars"].as_array().cloned().unwrap_or_default())
                .filter_map(|e| e["labels"]["trace_id"].as_str().map(str::to_string))
                .collect();
            // (The collector keeps its last verdicts only: an exemplar can outlive its
            // verdict there, but the newest ones are there.)
            if !traces.iter().any(|t| verdict_traces.contains(t)) {
                failures.push(format!(
                    "no exemplar of kvscope_spill_true_delta_tokens_bucket names a verdict's trace: {traces:?}"
                ));
            }
            for t in traces
                .iter()
                .filter(|t| t.len() != 32 || !t.bytes().all(|b| b.is_ascii_hexdigit()))
            {
                failures.push(format!("exemplar trace id {t:?} is not 32 hex digits"));
            }
        }
        Err(e) => failures.push(format!("query_exemplars: {e:#}")),
    }
    let scrape_times = prom
        .query("max by (job) (max_over_time(scrape_duration_seconds[1h]))")
        .await
        .unwrap_or_default();
    let scrape_times: Vec<String> = scrape_times
        .iter()
        .map(|r| format!("{} {} s", r["metric"]["job"], r["value"][1]))
        .collect();
    let scrape_failures = prom
        .query("sum by (job) (count_over_time(up[1h]) - sum_over_time(up[1h]))")
        .await
        .unwrap_or_default();
    let scrape_failures: Vec<String> = scrape_failures
        .iter()
        .map(|r| format!("{} {}", r["metric"]["job"], r["value"][1]))
        .collect();
    eprintln!(
        "slowest scrape per job: {scrape_times:?}; failed scrapes per job: {scrape_failures:?}"
    );
    // The router's own count of what it passed over and kvscope's true delta, for whoever
    // reads the log (the panel sets them side by side).
    let mut passed_over = Vec::new();
    for expr in [
        "sum(dynamo_component_router_kv_best_eligible_cached_prefix_tokens_total) - sum(dynamo_component_router_kv_selected_cached_prefix_tokens_total)",
        "sum(kvscope_spill_true_delta_tokens_sum)",
    ] {
        let v = prom.query(expr).await.unwrap_or_default();
        passed_over.push(v.first().map(|r| r["value"][1].to_string()));
    }
    eprintln!(
        "tokens passed over: the router's count {:?}, kvscope's true delta {:?}",
        passed_over[0], passed_over[1]
    );
    procs.stop(Duration::from_secs(5));
    drop(prom);
    run.stop();
    assert!(
        failures.is_empty(),
        "{} of {n_panels} panels / {n_targets} queries failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(n_panels >= 40, "the dashboards hold {n_panels} panels");
    eprintln!(
        "{} dashboards, {n_panels} panels, {n_targets} queries: all returned data (span {span_s} s)",
        dashboards.len()
    );
}

#[test]
fn macros_and_variables_are_substituted_and_leftovers_refused() {
    let vars = vec![
        ("agent".to_string(), ".*".to_string()),
        ("agent_id".to_string(), "a1".to_string()),
    ];
    assert_eq!(
        substitute(
            "rate(x{agent=~\"$agent\",id=\"${agent_id}\"}[$__rate_interval]) / $__range_s",
            &vars,
            90
        )
        .unwrap(),
        "rate(x{agent=~\".*\",id=\"a1\"}[90s]) / 90"
    );
    assert!(substitute("x{w=\"$worker\"}", &vars, 90)
        .unwrap_err()
        .contains("$worker"));
}

#[test]
fn grafana_provisioning_points_at_prometheus_and_the_dashboards_folder() {
    let base = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dashboards/grafana/provisioning");
    let ds = std::fs::read_to_string(base.join("datasources/kvscope.yml")).unwrap();
    assert!(
        ds.contains("apiVersion: 1") && ds.contains("type: prometheus"),
        "{ds}"
    );
    // Exemplars link to the Tempo datasource provisioned beside it.
    let parsed: serde_yaml::Value = serde_yaml::from_str(&ds).unwrap();
    let sources = parsed["datasources"].as_sequence().unwrap();
    let tempo = sources
        .iter()
        .find(|s| s["type"] == "tempo")
        .expect("a Tempo datasource");
    let prom = sources.iter().find(|s| s["type"] == "prometheus").unwrap();
    assert_eq!(
        prom["jsonData"]["exemplarTraceIdDestinations"][0]["datasourceUid"],
        tempo["uid"]
    );
    assert_eq!(
        prom["jsonData"]["exemplarTraceIdDestinations"][0]["name"], "trace_id",
        "the exemplar label the collector writes"
    );
    let spills = load_dashboards()
        .into_iter()
        .find(|(f, _)| f == "kvscope-fleet-spills.json")
        .unwrap()
        .1;
    assert!(
        spills["panels"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|t| t["exemplar"] == true
                    && t["expr"]
                        .as_str()
                        .unwrap_or_default()
                        .contains("kvscope_spill_true_delta_tokens_bucket"))),
        "a spill panel shows the exemplars"
    );
    let db = std::fs::read_to_string(base.join("dashboards/kvscope.yml")).unwrap();
    assert!(
        db.contains("type: file") && db.contains("folder: kvscope"),
        "{db}"
    );
    // Every dashboard: unique uid, the kvscope tag, the datasource variable.
    let mut uids = std::collections::HashSet::new();
    for (file, d) in load_dashboards() {
        let uid = d["uid"].as_str().unwrap_or_default().to_string();
        assert!(!uid.is_empty() && uids.insert(uid), "{file}: a unique uid");
        assert!(
            d["tags"]
                .as_array()
                .is_some_and(|t| t.contains(&Value::from("kvscope"))),
            "{file}: tagged kvscope"
        );
        assert!(
            d["templating"]["list"][0]["type"] == "datasource",
            "{file}: the datasource variable comes first"
        );
    }
}
