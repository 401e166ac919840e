//! Mode backends and the directive sink against the real things: an HTTP server (axum,
//! in the test), a file, and a process whose environment the command backend changes.

mod support;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{post, put};
use axum::{Json, Router};
use kvscope_actuator::act::backend::{ModeBackend, ModeBackendConfig};
use kvscope_actuator::act::directive::{BlockRange, DirectiveOutcome, MigrationDirective};
use kvscope_actuator::act::mode::Mode;
use kvscope_actuator::act::sink::DirectiveSink;
use kvscope_actuator::config::DirectiveConfig;
use kvscope_wire::cost::Prediction;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use support::worker;
use tokio::sync::watch;

/// What a test server received.
#[derive(Default)]
struct Seen {
    requests: Vec<(HeaderMap, serde_json::Value)>,
    attempts: HashMap<String, u32>,
    status: Option<StatusCode>,
}

type Shared = Arc<Mutex<Seen>>;

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

async fn mode_endpoint(
    State(s): State<Shared>,
    headers: HeaderMap,
    Json(body): Json<serde_json::Value>,
) -> StatusCode {
    let mut s = s.lock().unwrap();
    s.requests.push((headers, body));
    s.status.unwrap_or(StatusCode::NO_CONTENT)
}

#[tokio::test]
async fn the_http_backend_puts_the_mode_with_its_token() {
    let seen = Shared::default();
    let base = serve(
        Router::new()
            .route("/mode", put(mode_endpoint))
            .with_state(seen.clone()),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("router-token");
    std::fs::write(&token, "router-secret\n").unwrap();
    let b = ModeBackend::new(ModeBackendConfig::Http {
        url: format!("{base}/mode"),
        token_file: Some(token),
        timeout_secs: 10.0,
    })
    .unwrap();
    b.apply(Mode::Live, "6 windows qualify", 42).await.unwrap();
    b.apply(Mode::Dry, "stale", 43).await.unwrap();
    {
        let s = seen.lock().unwrap();
        assert_eq!(s.requests.len(), 2);
        let (h, body) = &s.requests[0];
        assert_eq!(h["authorization"], "Bearer router-secret");
        assert_eq!(
            body,
            &serde_json::json!({"dyn_kv_migration": "1", "state": "live", "reason": "6 windows qualify", "at_ns": 42})
        );
        assert_eq!(s.requests[1].1["dyn_kv_migration"], "dry");
    }
    seen.lock().unwrap().status = Some(StatusCode::SERVICE_UNAVAILABLE);
    let e = b.apply(Mode::Live, "x", 44).await.unwrap_err().to_string();
    assert!(e.contains("answered 503"), "{e}");
}

#[tokio::test]
async fn the_file_backend_writes_the_mode_atomically() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("migration.env");
    let b = ModeBackend::new(ModeBackendConfig::File {
        path: path.clone(),
        content: "DYN_KV_MIGRATION={mode}\n# kvscope: {state}\n".into(),
    })
    .unwrap();
    for (mode, text) in [
        (Mode::Dry, "DYN_KV_MIGRATION=dry\n# kvscope: dry\n"),
        (Mode::Live, "DYN_KV_MIGRATION=1\n# kvscope: live\n"),
        (Mode::Off, "DYN_KV_MIGRATION=0\n# kvscope: off\n"),
    ] {
        b.apply(mode, "t", 0).await.unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
    }
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["migration.env"], "no temporary file left behind");
    let nowhere = ModeBackend::new(ModeBackendConfig::File {
        path: dir.path().join("no/such/dir/m.env"),
        content: "{mode}".into(),
    })
    .unwrap();
    assert!(nowhere.apply(Mode::Dry, "t", 0).await.is_err());
}

fn environ(pid: &str) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    raw.split(|b| *b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect()
}

/// Restart a small process with `DYN_KV_MIGRATION=<mode>` (what a rolling env change
/// does to a deployment), then wait until it runs with it, like `rollout status`.
const RESTART_SCRIPT: &str = r#"
pidfile="$1"; mode="$2"
if [ -f "$pidfile" ]; then kill "$(cat "$pidfile")" 2>/dev/null || true; fi
DYN_KV_MIGRATION="$mode" sleep 120 </dev/null >/dev/null 2>&1 &
pid=$!
echo "$pid" > "$pidfile"
i=0
until tr '\0' '\n' < /proc/$pid/environ 2>/dev/null | grep -qx "DYN_KV_MIGRATION=$mode"; do
  i=$((i+1)); [ "$i" -gt 1000 ] && { echo "not up with $mode" >&2; exit 1; }
  sleep 0.01
done
"#;

fn kill(pid: &str) {
    let _ = std::process::Command::new("kill").arg(pid).status();
}

#[tokio::test]
async fn the_command_backend_flips_a_real_process_environment() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("restart.sh");
    std::fs::write(&script, RESTART_SCRIPT).unwrap();
    let pidfile = dir.path().join("worker.pid");
    let b = ModeBackend::new(ModeBackendConfig::Command {
        argv: vec![
            "sh".into(),
            script.display().to_string(),
            pidfile.display().to_string(),
            "{mode}".into(),
        ],
        timeout_secs: 60.0,
    })
    .unwrap();
    let mut pids = Vec::new();
    for (mode, value) in [(Mode::Dry, "dry"), (Mode::Live, "1"), (Mode::Dry, "dry")] {
        let r = b.apply(mode, "t", 0).await;
        let pid = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .to_string();
        pids.push(pid.clone());
        r.unwrap();
        let env = environ(&pid);
        assert!(
            env.contains(&format!("DYN_KV_MIGRATION={value}")),
            "{mode}: {env:?}"
        );
        assert_eq!(
            env.iter()
                .filter(|v| v.starts_with("DYN_KV_MIGRATION="))
                .count(),
            1
        );
    }
    assert_ne!(pids[0], pids[1], "restarted, not edited in place");
    assert_ne!(pids[1], pids[2]);
    kill(&pids[2]);
}

#[tokio::test]
async fn command_arguments_are_substituted_never_interpreted_by_a_shell() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let marker = dir.path().join("injected");
    let b = ModeBackend::new(ModeBackendConfig::Command {
        argv: vec![
            "sh".into(),
            "-c".into(),
            "printf '%s' \"$1\" > \"$2\"".into(),
            "sh".into(),
            format!("DYN_KV_MIGRATION={{mode}}; touch {}", marker.display()),
            out.display().to_string(),
        ],
        timeout_secs: 30.0,
    })
    .unwrap();
    b.apply(Mode::Live, "t", 0).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        format!("DYN_KV_MIGRATION=1; touch {}", marker.display())
    );
    assert!(!Path::new(&marker).exists());
}

fn directive(request_id: &str) -> MigrationDirective {
    MigrationDirective {
        idempotency_key: format!("kvm-{request_id}"),
        request_id: request_id.into(),
        session_id: None,
        source: worker(1),
        target: worker(2),
        source_nixl_agent: Some("nixl-1".into()),
        target_nixl_agent: Some("nixl-2".into()),
        blocks: BlockRange {
            first: 4,
            count: 2048,
            block_size: 16,
        },
        block_hashes: vec![],
        parent_block_hash: None,
        tokens: 32_768,
        decided_ns: 1,
        issued_ns: 2,
        predicted: Prediction {
            tokens: 32_768,
            bytes: 32_768 * 131_072,
            handshake_s: 0.002,
            transfer_s: 0.2,
            dispatch_overhead_s: 0.005,
            migrate_s: 0.207,
            recompute_s: 3.2,
            prefill_tok_per_s: 10_000.0,
            net_benefit_s: 3.0,
        },
    }
}

async fn directive_endpoint(
    State(s): State<Shared>,
    headers: HeaderMap,
    Json(body): Json<serde_json::Value>,
) -> (StatusCode, &'static str) {
    let mut s = s.lock().unwrap();
    let key = headers["idempotency-key"].to_str().unwrap().to_string();
    let n = {
        let n = s.attempts.entry(key).or_default();
        *n += 1;
        *n
    };
    let id = body["request_id"].as_str().unwrap().to_string();
    s.requests.push((headers, body));
    match id.as_str() {
        "ok" => (StatusCode::ACCEPTED, "queued"),
        "dup" => (StatusCode::CONFLICT, "already migrated"),
        "bad" => (
            StatusCode::UNPROCESSABLE_ENTITY,
            "source does not hold the blocks",
        ),
        "flaky" if n < 3 => (StatusCode::SERVICE_UNAVAILABLE, "busy"),
        "flaky" => (StatusCode::OK, "done"),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "down"),
    }
}

#[tokio::test]
async fn directives_are_posted_idempotently_with_bounded_retries_and_never_while_dry() {
    let seen = Shared::default();
    let base = serve(
        Router::new()
            .route("/migrations", post(directive_endpoint))
            .with_state(seen.clone()),
    )
    .await;
    let sink = DirectiveSink::new(&DirectiveConfig {
        enabled: true,
        url: Some(format!("{base}/migrations")),
        max_retries: 2,
        retry_backoff_ms: 1,
        ..DirectiveConfig::default()
    })
    .unwrap();
    let (live_tx, live) = watch::channel(true);
    let mut outcomes = HashMap::new();
    for id in ["ok", "dup", "bad", "flaky", "down"] {
        outcomes.insert(id, sink.send(&directive(id), &live).await);
    }
    assert_eq!(
        outcomes["ok"],
        DirectiveOutcome::Accepted {
            status: 202,
            attempts: 1
        }
    );
    assert_eq!(outcomes["dup"], DirectiveOutcome::Duplicate { attempts: 1 });
    assert!(
        matches!(&outcomes["bad"], DirectiveOutcome::Rejected { status: 422, attempts: 1, body } if body.contains("does not hold")),
        "{:?}",
        outcomes["bad"]
    );
    assert_eq!(
        outcomes["flaky"],
        DirectiveOutcome::Accepted {
            status: 200,
            attempts: 3
        }
    );
    assert!(
        matches!(&outcomes["down"], DirectiveOutcome::Failed { attempts: 3, error } if error.contains("503")),
        "{:?}",
        outcomes["down"]
    );
    {
        let s = seen.lock().unwrap();
        assert_eq!(s.attempts["kvm-flaky"], 3, "retried with the same key");
        assert_eq!(
            s.attempts["kvm-down"], 3,
            "retries bounded: 1 + max_retries"
        );
        assert_eq!(s.attempts["kvm-bad"], 1, "a rejection is not retried");
        let (h, body) = &s.requests[0];
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(
            body["blocks"],
            serde_json::json!({"first": 4, "count": 2048, "block_size": 16})
        );
        assert_eq!(
            body["source"],
            serde_json::json!({"worker_id": 1, "dp_rank": 0})
        );
        assert_eq!(body["idempotency_key"], "kvm-ok");
    }
    // DRY: nothing goes out.
    live_tx.send_replace(false);
    let before = seen.lock().unwrap().requests.len();
    assert_eq!(
        sink.send(&directive("ok"), &live).await,
        DirectiveOutcome::Abandoned
    );
    assert_eq!(seen.lock().unwrap().requests.len(), before);
}
