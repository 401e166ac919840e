//! The actuator's HTTP API (127.0.0.1 by default):
//!
//! - `GET /healthz` — `ok`.
//! - `GET /metrics` — Prometheus text: mode, evaluations, flips, directives, input
//!   freshness (see [`crate::daemon::metrics`]). Open to read.
//! - `GET /api/status` — mode, operator hold, what the backends last took, directive
//!   totals, the latest evaluation with its reasons and figures. Open to read.
//! - `GET /api/audit?limit=N` — the audit log's last N entries (default 100). Bearer token.
//! - `POST /api/override` — `{"state": "off" | "dry" | "auto", "note": "…"}`: hold OFF,
//!   hold DRY, or hand the mode back to the policy (from DRY). Bearer token.
//!
//! The token is compared in constant time; a missing or wrong one gets 401, after a
//! one-second delay, one refusal at a time (counted in
//! `kvscope_actuator_api_refusals_total`).

use crate::act::audit;
use crate::act::mode::Override;
use crate::daemon::runtime::Actuator;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvscope_kit::clock::now_ns;
use serde::Deserialize;
use std::sync::Arc;
use tokio::sync::Mutex;

#[derive(Clone)]
struct ApiState {
    actuator: Arc<Mutex<Actuator>>,
    health: Arc<kvscope_kit::Health>,
    token: Arc<String>,
    refusals: Arc<Refusals>,
    http: Arc<kvscope_kit::http::ServerStats>,
}

/// Wrong tokens, slowed down: each refusal is answered only after [`REFUSAL_DELAY`],
/// one at a time, so guessing costs a second a try however many run in parallel.
#[derive(Default)]
struct Refusals {
    count: std::sync::atomic::AtomicU64,
    one_at_a_time: Mutex<()>,
}

const REFUSAL_DELAY: std::time::Duration = std::time::Duration::from_secs(1);

/// The API over `actuator`; every write and audit read needs `token` (an empty token
/// refuses them all). `/readyz` answers from `health`.
pub fn router(
    actuator: Arc<Mutex<Actuator>>,
    health: Arc<kvscope_kit::Health>,
    token: String,
    http: Arc<kvscope_kit::http::ServerStats>,
) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/api/status", get(status))
        .route("/api/audit", get(audit_tail))
        .route("/api/override", post(override_mode))
        .with_state(ApiState {
            actuator,
            health,
            token: Arc::new(token),
            refusals: Arc::default(),
            http,
        })
}

async fn readyz(State(s): State<ApiState>) -> Response {
    let (status, body) = s.health.readiness();
    (StatusCode::from_u16(status).unwrap_or(StatusCode::OK), body).into_response()
}

async fn unauthorized(s: &ApiState) -> Response {
    s.refusals
        .count
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let _turn = s.refusals.one_at_a_time.lock().await;
    tokio::time::sleep(REFUSAL_DELAY).await;
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        kvscope_kit::auth::REFUSAL_BODY,
    )
        .into_response()
}

async fn metrics_text(State(s): State<ApiState>) -> impl IntoResponse {
    let refused = s.refusals.count.load(std::sync::atomic::Ordering::Relaxed);
    let body =
        crate::daemon::metrics::render(&*s.actuator.lock().await, refused, &s.http, &s.health);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
}

async fn status(State(s): State<ApiState>) -> impl IntoResponse {
    Json(s.actuator.lock().await.status())
}

#[derive(Deserialize)]
struct Limit {
    limit: Option<usize>,
}

async fn audit_tail(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Query(q): Query<Limit>,
) -> Response {
    if !kvscope_kit::auth::authorized(&headers, &s.token) {
        return unauthorized(&s).await;
    }
    let path = s.actuator.lock().await.audit_path().to_path_buf();
    match audit::tail(&path, q.limit.unwrap_or(100).min(10_000), 64 << 20) {
        Ok(entries) => Json(entries).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OverrideRequest {
    state: Override,
    #[serde(default)]
    note: String,
}

/// The most an override's body may be (`{"state": …, "note": …}`).
const MAX_OVERRIDE_BYTES: usize = 16 * 1024;

/// The token is checked on the headers before a byte of the body is read: an
/// unauthenticated client cannot make the actuator hold its body.
async fn override_mode(State(s): State<ApiState>, req: axum::extract::Request) -> Response {
    if !kvscope_kit::auth::authorized(req.headers(), &s.token) {
        return unauthorized(&s).await;
    }
    let body = match axum::body::to_bytes(req.into_body(), MAX_OVERRIDE_BYTES).await {
        Ok(b) => b,
        Err(_) => {
            return (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("an override is {MAX_OVERRIDE_BYTES} bytes at most\n"),
            )
                .into_response()
        }
    };
    let req: OverrideRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("expected {{\"state\": \"off\"|\"dry\"|\"auto\", \"note\": \"…\"}}: {e}\n"),
            )
                .into_response()
        }
    };
    let mut a = s.actuator.lock().await;
    let note = if req.note.is_empty() {
        "via the API".to_string()
    } else {
        req.note
    };
    a.operator(req.state, &note, now_ns()).await;
    Json(a.status()).into_response()
}
