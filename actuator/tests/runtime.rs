//! The whole actuator on generated collector reads: the policy, a real file backend and
//! HTTP endpoints, directives, the audit log, its restart, and its HTTP API.

mod support;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{post, put};
use axum::{Json, Router};
use kvscope_actuator::act::audit::{self, AuditEntry, AuditEvent};
use kvscope_actuator::act::backend::ModeBackendConfig;
use kvscope_actuator::act::mode::Mode;
use kvscope_actuator::config::{ActuatorConfig, DirectiveConfig};
use kvscope_actuator::daemon::runtime::Actuator;
use kvscope_actuator::decide::input::CollectorView;
use kvscope_actuator::decide::policy::Transition;
use kvscope_wire::api::verdict::SpillVerdict;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::*;

#[derive(Default)]
struct Endpoint {
    bodies: Vec<serde_json::Value>,
    keys: Vec<String>,
    /// Answer this to a PUT of `"1"` (LIVE).
    live_status: Option<StatusCode>,
}

type Shared = Arc<Mutex<Endpoint>>;

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

async fn migrations(
    State(s): State<Shared>,
    headers: HeaderMap,
    Json(body): Json<serde_json::Value>,
) -> StatusCode {
    let mut s = s.lock().unwrap();
    s.keys
        .push(headers["idempotency-key"].to_str().unwrap().to_string());
    s.bodies.push(body);
    StatusCode::ACCEPTED
}

async fn mode(State(s): State<Shared>, Json(body): Json<serde_json::Value>) -> StatusCode {
    let mut s = s.lock().unwrap();
    let live = body["dyn_kv_migration"] == "1";
    s.bodies.push(body);
    match s.live_status {
        Some(st) if live => st,
        _ => StatusCode::NO_CONTENT,
    }
}

fn config(dir: &Path, directive_url: &str) -> ActuatorConfig {
    ActuatorConfig {
        audit_log: dir.join("audit.jsonl"),
        worker_agents: vec!["1=nixl-1".parse().unwrap(), "2=nixl-2".parse().unwrap()],
        mode_backends: vec![ModeBackendConfig::File {
            path: dir.join("migration.env"),
            content: "DYN_KV_MIGRATION={mode}\n".into(),
        }],
        directives: DirectiveConfig {
            enabled: true,
            url: Some(directive_url.to_string()),
            retry_backoff_ms: 1,
            ..DirectiveConfig::default()
        },
        ..ActuatorConfig::default()
    }
}

fn spill(id: &str, decided_ns: u64, delta_blocks: u32) -> SpillVerdict {
    SpillVerdict {
        tenant: None,
        model: None,
        incomplete_mirror: false,
        after_own_prefill: false,
        clock_behind_ms: None,
        trace: None,
        judged_before_event: false,
        request_id: id.into(),
        decided_ns,
        chosen: worker(2),
        chosen_overlap_blocks: 3,
        best: worker(1),
        best_overlap_blocks: 3 + delta_blocks,
        block_size: 16,
        isl_tokens: u64::from(3 + delta_blocks) * 16 + 40,
        spill: true,
        upper_bound_tokens: u64::from(3 + delta_blocks) * 16,
        true_delta_tokens: u64::from(delta_blocks) * 16,
        generated_delta_tokens: 0,
        uncached_prefill_tokens: u64::from(delta_blocks) * 16 + 40,
        overlaps: BTreeMap::new(),
        available_ns: None,
        delta_block_hashes: Vec::new(),
        delta_parent_hash: None,
        nixl: None,
        router_overlap_blocks: None,
        chosen_lower_tiers: Default::default(),
        best_lower_tiers: Default::default(),
        onload_delta_tokens: 0,
    }
}

fn with_verdicts(mut v: CollectorView, verdicts: Vec<SpillVerdict>) -> CollectorView {
    v.verdicts = verdicts.into_iter().rev().collect();
    v
}

fn mode_file(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("migration.env")).unwrap()
}

fn entries(path: &Path) -> Vec<AuditEntry> {
    audit::tail(path, usize::MAX, u64::MAX).unwrap()
}

#[tokio::test]
async fn dry_to_live_with_directives_then_back_to_dry_all_audited() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = Shared::default();
    let base = serve(
        Router::new()
            .route("/migrations", post(migrations))
            .with_state(endpoint.clone()),
    )
    .await;
    let cfg = config(dir.path(), &format!("{base}/migrations"));
    let audit_path = cfg.audit_log.clone();
    let mut f = Fleet::new();
    f.push_n(2, Spec::warmup());
    let mut a = Actuator::new(cfg.clone(), f.now()).unwrap();
    a.start(f.now()).await;
    assert_eq!(mode_file(dir.path()), "DYN_KV_MIGRATION=dry\n");

    // DRY while the windows build up; spills meanwhile get no directive.
    for i in 0..5 {
        f.push(Spec::good());
        let now = f.now();
        let v = with_verdicts(f.view(), vec![spill(&format!("dry-{i}"), now - S, 2048)]);
        assert_eq!(a.tick(Ok(v), now).await.to, Mode::Dry);
    }
    assert!(!a.live());
    f.push(Spec::good());
    let ev = a.tick(Ok(f.view()), f.now()).await.clone();
    assert_eq!(ev.transition, Transition::EnterLive);
    assert!(a.live());
    assert_eq!(mode_file(dir.path()), "DYN_KV_MIGRATION=1\n");

    // LIVE: spills after the flip that pass the gate become directives, once each.
    f.push(Spec::live_ok());
    let now = f.now();
    let verdicts = vec![
        spill("before-live", ev.at_ns - S, 2048),
        spill("big-1", now - 3 * S, 2048),
        spill("small", now - 2 * S, 4),
        spill("big-2", now - S, 4096),
    ];
    a.tick(Ok(with_verdicts(f.view(), verdicts.clone())), now)
        .await;
    a.settle(Duration::from_secs(30), now).await;
    {
        let e = endpoint.lock().unwrap();
        let ids: Vec<_> = e.bodies.iter().map(|b| b["request_id"].clone()).collect();
        assert_eq!(ids, ["big-1", "big-2"]);
        assert_eq!(e.bodies[1]["blocks"]["count"], 4096);
        assert_eq!(e.bodies[1]["target_nixl_agent"], "nixl-2");
        assert!(e.keys.iter().all(|k| k.starts_with("kvm-")));
    }
    let totals = a.status().directives.unwrap();
    assert_eq!(
        (totals.issued, totals.accepted, totals.in_flight),
        (2, 2, 0)
    );
    // The same verdicts again: nothing new goes out.
    a.tick(Ok(with_verdicts(f.view(), verdicts)), now + S).await;
    a.settle(Duration::from_secs(30), now + S).await;
    assert_eq!(endpoint.lock().unwrap().bodies.len(), 2);

    // The silent failure: back to DRY within the window, and no directive after it.
    f.push(Spec::silent_failure());
    let now = f.now();
    let ev = a
        .tick(
            Ok(with_verdicts(
                f.view(),
                vec![spill("after-drop", now - S, 2048)],
            )),
            now,
        )
        .await
        .clone();
    assert_eq!(ev.transition, Transition::SafetyDrop);
    assert!(!a.live());
    assert_eq!(mode_file(dir.path()), "DYN_KV_MIGRATION=dry\n");
    a.settle(Duration::from_secs(30), now).await;
    assert_eq!(endpoint.lock().unwrap().bodies.len(), 2);

    // The audit explains both flips with their figures.
    let log = entries(&audit_path);
    let kinds: Vec<&str> = log
        .iter()
        .map(|e| match &e.event {
            AuditEvent::Started { .. } => "started",
            AuditEvent::ModeChanged { .. } => "mode_changed",
            AuditEvent::InputChanged { .. } => "input_changed",
            AuditEvent::DirectivesIssued { .. } => "directives_issued",
            AuditEvent::DirectiveOutcomes { .. } => "directive_outcomes",
            AuditEvent::Operator { .. } => "operator",
            AuditEvent::BackendFailed { .. } => "backend_failed",
            AuditEvent::BackendRecovered { .. } => "backend_recovered",
            AuditEvent::Stopped { .. } => "stopped",
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "started",
            "input_changed",
            "mode_changed",
            "directives_issued",
            "directive_outcomes",
            "mode_changed"
        ]
    );
    let flips: Vec<_> = log
        .iter()
        .filter_map(|e| match &e.event {
            AuditEvent::ModeChanged { evaluation } => Some((e.mode, evaluation.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(flips[0].0, Mode::Live);
    assert!(flips[0].1.reasons[0].starts_with("6 consecutive windows qualify"));
    assert_eq!(flips[0].1.figures.as_ref().unwrap().windows.len(), 6);
    assert_eq!(flips[1].0, Mode::Dry);
    assert!(flips[1].1.reasons[0].starts_with("silent NIXL failure"));
    let raw = std::fs::read_to_string(&audit_path).unwrap();
    assert!(raw
        .lines()
        .all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok()));

    let text =
        kvscope_actuator::daemon::metrics::render(&a, 0, &Default::default(), &Default::default());
    for line in [
        "kvscope_actuator_flips_total{from=\"dry\",to=\"live\",reason=\"thresholds_met\"} 1",
        "kvscope_actuator_flips_total{from=\"live\",to=\"dry\",reason=\"silent_failure\"} 1",
        "kvscope_actuator_flips_total{from=\"live\",to=\"dry\",reason=\"stale\"} 0",
        "kvscope_actuator_mode{mode=\"dry\"} 1",
        "kvscope_actuator_mode{mode=\"live\"} 0",
        "kvscope_actuator_applied_mode{mode=\"dry\"} 1",
        "kvscope_actuator_input_errors_total 0",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
    assert!(
        !text.contains("kvscope_actuator_directives_total{outcome=\"accepted\"} 0"),
        "the accepted directives are counted:\n{text}"
    );

    // A restart takes over the flips (cap, cooldown) from the log, and asserts DRY.
    a.stop(now).await;
    drop(a);
    let mut b = Actuator::new(cfg, now + S).unwrap();
    assert_eq!(b.engine().state().flips_ns.len(), 2);
    b.start(now + S).await;
    f.push_n(8, Spec::good());
    let ev = b.tick(Ok(f.view()), f.now()).await;
    assert_eq!(ev.to, Mode::Dry);
    assert!(
        ev.reasons.iter().any(|r| r.starts_with("cooldown:")),
        "{:#?}",
        ev.reasons
    );
    let text =
        kvscope_actuator::daemon::metrics::render(&b, 0, &Default::default(), &Default::default());
    assert!(
        text.contains("kvscope_actuator_flips_held_back_total{reason=\"cooldown\"} 1"),
        "only the cooldown held LIVE back:\n{text}"
    );
}

#[tokio::test]
async fn a_live_that_a_backend_cannot_apply_is_rolled_back_and_sends_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = Shared::default();
    let router = Shared::default();
    router.lock().unwrap().live_status = Some(StatusCode::INTERNAL_SERVER_ERROR);
    let base = serve(
        Router::new()
            .route("/migrations", post(migrations))
            .with_state(endpoint.clone())
            .merge(
                Router::new()
                    .route("/mode", put(mode))
                    .with_state(router.clone()),
            ),
    )
    .await;
    let mut cfg = config(dir.path(), &format!("{base}/migrations"));
    cfg.mode_backends.push(ModeBackendConfig::Http {
        url: format!("{base}/mode"),
        token_file: None,
        timeout_secs: 10.0,
    });
    let audit_path = cfg.audit_log.clone();
    let mut f = Fleet::new();
    f.push_n(2, Spec::warmup());
    let mut a = Actuator::new(cfg, f.now()).unwrap();
    a.start(f.now()).await;
    f.push_n(6, Spec::good());
    let now = f.now();
    let v = with_verdicts(f.view(), vec![spill("r", now, 2048)]);
    assert_eq!(
        a.tick(Ok(v), now).await.to,
        Mode::Live,
        "the policy said LIVE"
    );
    assert_eq!(a.mode(), Mode::Dry, "but the actuator is DRY");
    assert!(!a.live());
    // The file backend had taken LIVE: it is put back.
    assert_eq!(mode_file(dir.path()), "DYN_KV_MIGRATION=dry\n");
    let modes: Vec<_> = router
        .lock()
        .unwrap()
        .bodies
        .iter()
        .map(|b| b["dyn_kv_migration"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(modes, ["dry", "1", "dry"]);
    a.settle(Duration::from_secs(30), now).await;
    assert!(endpoint.lock().unwrap().bodies.is_empty(), "no directive");
    let log = entries(&audit_path);
    assert!(log.iter().any(|e| matches!(&e.event, AuditEvent::BackendFailed { attempted: Mode::Live, errors } if errors[0].contains("answered 500"))), "{log:#?}");
    assert_eq!(log.last().unwrap().mode, Mode::Dry);
    // The failed attempt counts as a flip: the cooldown holds back a retry.
    f.push(Spec::good());
    let ev = a.tick(Ok(f.view()), f.now()).await;
    assert_eq!(ev.to, Mode::Dry);
    assert!(ev.reasons.iter().any(|r| r.starts_with("cooldown:")));
    let text =
        kvscope_actuator::daemon::metrics::render(&a, 0, &Default::default(), &Default::default());
    for line in [
        "kvscope_actuator_flips_total{from=\"live\",to=\"dry\",reason=\"backend_failed\"} 1",
        "kvscope_actuator_mode_apply_failures_total 1",
        "kvscope_actuator_applied_mode{mode=\"dry\"} 1",
        "kvscope_actuator_mode_applied_ok 1",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
}

#[tokio::test]
async fn the_api_needs_the_token_for_writes_and_the_audit() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ActuatorConfig {
        audit_log: dir.path().join("audit.jsonl"),
        mode_backends: vec![ModeBackendConfig::File {
            path: dir.path().join("migration.env"),
            content: "DYN_KV_MIGRATION={mode}\n".into(),
        }],
        ..ActuatorConfig::default()
    };
    let mut f = Fleet::new();
    f.push_n(2, Spec::warmup()).push_n(3, Spec::good());
    let mut a = Actuator::new(cfg, f.now()).unwrap();
    a.start(f.now()).await;
    a.tick(Ok(f.view()), f.now()).await;
    let a = Arc::new(tokio::sync::Mutex::new(a));
    let token = "a-test-token-0123456789";
    let health = Arc::new(kvscope_kit::Health::new());
    let base = serve(kvscope_actuator::daemon::api::router(
        a.clone(),
        health.clone(),
        token.into(),
        Default::default(),
    ))
    .await;
    let http = reqwest::Client::new();

    // Live always; ready when its checks hold, else 503 with what does not.
    let get = |path: &str| http.get(format!("{base}{path}")).send();
    assert_eq!(get("/healthz").await.unwrap().status(), 200);
    assert_eq!(get("/readyz").await.unwrap().status(), 200);
    health.fail("collector", "cannot read the collector: refused");
    let r = get("/readyz").await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.text().await.unwrap(),
        "not ready\ncollector: cannot read the collector: refused\n"
    );
    health.ok("collector");
    assert_eq!(get("/readyz").await.unwrap().status(), 200);

    let status: serde_json::Value = http
        .get(format!("{base}/api/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["mode"], "DRY");
    assert_eq!(status["applied"]["mode"], "DRY");
    assert!(status["last_evaluation"]["reasons"][0]
        .as_str()
        .unwrap()
        .starts_with("only 3 complete post-warm-up windows"));

    for auth in [None, Some("Bearer wrong-token-0123456789"), Some(token)] {
        let mut req = http
            .post(format!("{base}/api/override"))
            .json(&serde_json::json!({"state": "off", "note": "maintenance"}));
        if let Some(h) = auth {
            req = req.header("authorization", h);
        }
        assert_eq!(req.send().await.unwrap().status(), 401);
        let mut req = http.get(format!("{base}/api/audit"));
        if let Some(h) = auth {
            req = req.header("authorization", h);
        }
        assert_eq!(req.send().await.unwrap().status(), 401);
    }
    // The token is checked before the body is read: a request announcing 2 MB that
    // never sends a byte of it is refused all the same (the actuator does not wait for,
    // nor hold, an unauthenticated body).
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = base.trim_start_matches("http://");
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(
            b"POST /api/override HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
              content-length: 2000000\r\n\r\n",
        )
        .await
        .unwrap();
        let mut head = [0u8; 12];
        tokio::time::timeout(std::time::Duration::from_secs(10), c.read_exact(&mut head))
            .await
            .expect("answered without the body")
            .unwrap();
        assert_eq!(&head, b"HTTP/1.1 401");
    }
    // Every refusal is counted (and was slowed down).
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kvscope_actuator_api_refusals_total 7"),
        "{metrics}"
    );
    assert_eq!(
        mode_file(dir.path()),
        "DYN_KV_MIGRATION=dry\n",
        "nothing changed"
    );
    assert_eq!(a.lock().await.mode(), Mode::Dry);

    let bearer = format!("Bearer {token}");
    let resp = http
        .post(format!("{base}/api/override"))
        .header("authorization", &bearer)
        .json(&serde_json::json!({"state": "off", "note": "maintenance"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let status: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(
        (status["mode"].as_str(), status["hold"].as_str()),
        (Some("OFF"), Some("OFF"))
    );
    assert_eq!(mode_file(dir.path()), "DYN_KV_MIGRATION=0\n");
    let bad = http
        .post(format!("{base}/api/override"))
        .header("authorization", &bearer)
        .json(&serde_json::json!({"state": "live"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400, "LIVE is never an operator override");

    let audit: Vec<serde_json::Value> = http
        .get(format!("{base}/api/audit?limit=1"))
        .header("authorization", &bearer)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0]["event"], "operator");
    assert_eq!(audit[0]["note"], "maintenance");
    assert_eq!(audit[0]["to"], "OFF");

    // /metrics is open to read, like the status.
    let metrics = http.get(format!("{base}/metrics")).send().await.unwrap();
    assert_eq!(metrics.status(), 200);
    let text = metrics.text().await.unwrap();
    for line in [
        "kvscope_actuator_mode{mode=\"off\"} 1",
        "kvscope_actuator_operator_hold 1",
        "kvscope_actuator_flips_total{from=\"dry\",to=\"off\",reason=\"operator\"} 1",
        "kvscope_actuator_evaluations_total{input=\"fresh\"} 1",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
}
