//! The collector's HTTP endpoints: Prometheus `/metrics` and a read-only JSON API, whose
//! types are the contract in `kvscope_wire::api` (`/api/whatif` answers the collector's
//! own what-if, `crate::whatif::CapacityWhatIf`).

use crate::report::OpportunityReport;
use crate::serve::metrics;
use crate::state::{lock, Shared};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use kvscope_wire::api::summary::CollectorSummary;
use serde::Deserialize;
use std::sync::Arc;

pub fn router(shared: Arc<Shared>) -> Router {
    // A standby's figures are the serving collector's again: it answers with its status
    // (`/api/summary`, `/readyz`, its role on `/metrics`) and nothing else.
    let figures = Router::new()
        .route("/api/windows", get(windows))
        .route("/api/verdicts", get(verdicts))
        .route("/api/tenants", get(tenants))
        .route("/api/report", get(report_json))
        .route("/api/report.md", get(report_md))
        .route("/api/report.html", get(report_html))
        .route("/api/nixl", get(nixl_pairs))
        .route("/api/nixl/agents", get(nixl_agents))
        .route("/api/whatif", get(whatif))
        .route_layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            unless_standing_by,
        ));
    Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/api/summary", get(summary))
        .merge(figures)
        .with_state(shared)
}

async fn unless_standing_by(
    State(s): State<Arc<Shared>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let lease = lock(&s.bus).lease.clone();
    if lease.role.serves() {
        return next.run(request).await;
    }
    let holder = lease.holder.as_deref().unwrap_or("another collector");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!("standing by: {holder} serves this scope (see /api/summary)\n"),
    )
        .into_response()
}

/// OpenMetrics for scrapers that ask for it (Prometheus does), else the text format.
async fn metrics_text(
    State(s): State<Arc<Shared>>,
    headers: axum::http::HeaderMap,
) -> impl IntoResponse {
    let format = kvscope_kit::prom::Format::negotiate(
        headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()),
    );
    let body = metrics::exposition(&s, format);
    ([(header::CONTENT_TYPE, format.content_type())], body)
}

/// How long messages may wait with none applied before the collector is not ready.
const STALLED_AFTER_NS: u64 = 30_000_000_000;

/// Ready when it consumes the stream, has rebuilt its state from it, and applies what
/// waits for it.
async fn readyz(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    let (status, body) = readiness(&s).readiness();
    (
        axum::http::StatusCode::from_u16(status).unwrap_or(axum::http::StatusCode::OK),
        body,
    )
}

/// The collector's readiness checks now (`/readyz`, and `kvscope_collector_not_ready`
/// on `/metrics`): every check registered, holding or failing.
pub fn readiness(s: &Shared) -> kvscope_kit::Health {
    let bus = lock(&s.bus).clone();
    let health = kvscope_kit::Health::new();
    let check = |name: &'static str, failing: Option<String>| match failing {
        Some(why) => health.fail(name, why),
        None => health.ok(name),
    };
    check(
        "bus",
        (!bus.connected)
            .then(|| "not consuming the stream (NATS unreachable or refusing)".to_string()),
    );
    check(
        "lease",
        (!bus.lease.role.serves()).then(|| match (&bus.lease.error, &bus.lease.holder) {
            (Some(e), _) => format!("cannot take its scope's lease: {e}"),
            (None, Some(h)) => format!("standing by: {h} serves this scope"),
            (None, None) => "standing by: looking at its scope's lease".to_string(),
        }),
    );
    check(
        "state",
        bus.rebuilding
            .then(|| "rebuilding its state from the stream".to_string()),
    );
    check(
        "recording",
        bus.recording_failed
            .then(|| "the recording stopped after a write error".to_string()),
    );
    check(
        "consumer",
        bus.consumer_error
            .as_ref()
            .map(|e| format!("its durable consumer cannot be read: {e}")),
    );
    let idle_ns = kvscope_kit::clock::now_ns().saturating_sub(bus.applied_at_ns);
    check(
        "applying",
        (!bus.rebuilding && bus.consumer_pending > 0 && idle_ns > STALLED_AFTER_NS).then(|| {
            format!(
                "{} messages wait for it and none was applied for {} s",
                bus.consumer_pending,
                idle_ns / 1_000_000_000
            )
        }),
    );
    health
}

async fn summary(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    let bus = lock(&s.bus).clone();
    let a = lock(&s.analyzer);
    let summary = CollectorSummary {
        bus,
        workers: a.index().workers().count(),
        cached_block_pairs: a.index().cached_pairs(),
        watermark_ns: a.watermark_ns(),
        windows_closed: a.closed_windows().len(),
        open_window: a.open_window().cloned(),
        counters: a.counters().clone(),
        router_view: a.router_view().clone(),
        router_tier_view: a.tier_view().clone(),
        agents: a.agents().clone(),
        fleet: a.fleet().clone(),
    };
    Json(summary)
}

/// Every tenant's figures since the collector started (`TenantFigures`).
async fn tenants(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    Json(lock(&s.analyzer).totals().tenants.clone())
}

#[derive(Deserialize)]
struct Limit {
    limit: Option<usize>,
}

async fn windows(State(s): State<Arc<Shared>>, Query(q): Query<Limit>) -> impl IntoResponse {
    let a = lock(&s.analyzer);
    let n = q.limit.unwrap_or(100);
    let w: Vec<_> = a
        .closed_windows()
        .rev()
        .take(n)
        .map(|w| w.summary.clone())
        .collect();
    Json(w)
}

async fn verdicts(State(s): State<Arc<Shared>>, Query(q): Query<Limit>) -> impl IntoResponse {
    let a = lock(&s.analyzer);
    let n = q.limit.unwrap_or(100);
    let v: Vec<_> = a
        .recent_verdicts()
        .rev()
        .take(n)
        .map(|v| {
            let mut v = v.clone();
            v.nixl = a.request_nixl(&v.request_id);
            v.router_overlap_blocks = a
                .routed_request(&v.request_id)
                .and_then(|r| r.router_overlap_blocks);
            v
        })
        .collect();
    Json(v)
}

async fn nixl_pairs(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    Json(crate::fold::nixl::pairs(lock(&s.analyzer).agents()))
}

async fn nixl_agents(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    Json(crate::fold::nixl::owners(lock(&s.analyzer).agents()))
}

async fn report_json(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    Json(OpportunityReport::from_analyzer(&lock(&s.analyzer)))
}

async fn report_md(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    let md = OpportunityReport::from_analyzer(&lock(&s.analyzer)).to_markdown();
    ([(header::CONTENT_TYPE, "text/markdown; charset=utf-8")], md)
}

async fn report_html(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    let html = OpportunityReport::from_analyzer(&lock(&s.analyzer)).to_html();
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], html)
}

/// `kvscope whatif` on the requests the collector keeps, its flags as the query:
/// `?reserve=0,0.15&gpu_blocks=N&kv_bytes_per_token=B&gate=1024,16384…` (no model config:
/// the collector reads no file a request names).
async fn whatif(
    State(s): State<Arc<Shared>>,
    q: Result<Query<crate::whatif::question::WhatIfInputs>, QueryRejection>,
) -> Response {
    let bad = |msg: String| (StatusCode::BAD_REQUEST, format!("{msg}\n")).into_response();
    let q = match q {
        Ok(Query(q)) => q,
        Err(e) => return bad(e.body_text()),
    };
    // One at a time: each is ~50 simulations of every kept request (the capacity
    // calibration's, the reserves', the router model's runs).
    static RUNNING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if RUNNING.swap(true, std::sync::atomic::Ordering::AcqRel) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "1")],
            "a what-if is running; try again\n",
        )
            .into_response();
    }
    struct Done;
    impl Drop for Done {
        fn drop(&mut self) {
            RUNNING.store(false, std::sync::atomic::Ordering::Release);
        }
    }
    let done = Done;
    // Copied out under the lock; the simulation runs without it, off the async threads.
    let w = crate::whatif::WhatIf::from_analyzer(&lock(&s.analyzer));
    // The slot is freed when the simulation ends, not when this handler does: a client
    // that hangs up leaves it running, and a second one must not start beside it.
    let run = move || {
        let _done = done;
        q.answer(&w)
    };
    match tokio::task::spawn_blocking(run).await {
        Ok(Ok(c)) => Json(c).into_response(),
        Ok(Err(e)) => bad(e.to_string()),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}
