//! The directive endpoint's HTTP API: `POST /v1/migrations`, `POST /v1/inject`,
//! `GET /v1/status`, `GET /healthz` (see the module above for what each answers).

use super::book::BookFaults;
use super::fleet::{MigrationFailure, MigrationJob, MigrationReport};
use super::ledger::{Admission, DirectiveCounts, MigrationOutcome};
use super::{AppState, Shared};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvscope_wire::directive::{MigrationDirective, IDEMPOTENCY_HEADER};
use kvscope_wire::{KvEvent, WorkerKey};
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering;
use tracing::{info, warn};

pub(super) fn router(shared: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/v1/status", get(status))
        .route("/v1/migrations", post(migrate))
        .route("/v1/inject", post(inject))
        .with_state(shared)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub name: String,
    pub worker: WorkerKey,
    pub kv_endpoint: String,
    pub engine: Option<String>,
    pub book_blocks: usize,
    pub book_events: u64,
    pub book_faults: BookFaultsView,
    pub engine_messages_undecodable: u64,
    /// Events of an unknown type or with bad fields in otherwise good messages (skipped).
    pub engine_events_skipped: u64,
    pub published_batches: u64,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct BookFaultsView {
    pub unknown_parent: u64,
    pub missing_tokens: u64,
    pub unknown_removed: u64,
}

impl From<BookFaults> for BookFaultsView {
    fn from(f: BookFaults) -> Self {
        Self {
            unknown_parent: f.unknown_parent,
            missing_tokens: f.missing_tokens,
            unknown_removed: f.unknown_removed,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServeStatus {
    pub workers: Vec<WorkerStatus>,
    pub inject_handshake_failures: bool,
    pub directives: DirectiveCounts,
    pub outcomes: Vec<MigrationOutcome>,
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
        kvscope_kit::auth::REFUSAL_BODY,
    )
        .into_response()
}

/// Start the fleet, the KV taps and publishers, and the HTTP API; print the ready line;
/// serve until `stop` turns true, then shut the agents down.
async fn status(State(s): State<AppState>) -> Json<ServeStatus> {
    let workers = s
        .workers
        .iter()
        .map(|w| {
            let book = w.book.lock().unwrap_or_else(|e| e.into_inner());
            WorkerStatus {
                name: w.cfg.name.clone(),
                worker: w.cfg.worker,
                kv_endpoint: w.kv_endpoint.clone(),
                engine: w.cfg.engine.clone(),
                book_blocks: book.len(),
                book_events: book.events,
                book_faults: book.faults.into(),
                engine_messages_undecodable: w.undecodable.load(Ordering::Relaxed),
                engine_events_skipped: w.skipped.load(Ordering::Relaxed),
                published_batches: w.published.load(Ordering::Relaxed),
            }
        })
        .collect();
    Json(ServeStatus {
        workers,
        inject_handshake_failures: s.inject.load(Ordering::Relaxed),
        directives: s.ledger.counts(),
        outcomes: s.ledger.outcomes(),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InjectBody {
    handshake_failures: bool,
}

async fn inject(State(s): State<AppState>, headers: HeaderMap, body: Json<InjectBody>) -> Response {
    if !kvscope_kit::auth::authorized(&headers, &s.token) {
        return unauthorized();
    }
    s.inject.store(body.handshake_failures, Ordering::Relaxed);
    info!(
        handshake_failures = body.handshake_failures,
        "Handshake failure injection changed."
    );
    (StatusCode::OK, "ok\n").into_response()
}

fn rejected(s: &Shared, d: &MigrationDirective, detail: String) -> Response {
    s.ledger.bump(|c| c.rejected += 1);
    let o = outcome_of(
        d,
        "rejected",
        None,
        None,
        &MigrationReport::default(),
        Some(detail),
    );
    s.ledger.remember(&o, false);
    (StatusCode::UNPROCESSABLE_ENTITY, Json(o)).into_response()
}

fn outcome_of(
    d: &MigrationDirective,
    outcome: &str,
    source: Option<&str>,
    target: Option<&str>,
    r: &MigrationReport,
    detail: Option<String>,
) -> MigrationOutcome {
    MigrationOutcome {
        idempotency_key: d.idempotency_key.clone(),
        request_id: d.request_id.clone(),
        outcome: outcome.into(),
        source_agent: source.map(str::to_string),
        target_agent: target.map(str::to_string),
        blocks: d.block_hashes.len(),
        bytes: r.bytes,
        block_hashes: Vec::new(),
        handshakes: r.handshakes.len() as u64,
        handshakes_failed: r
            .handshakes
            .iter()
            .filter(|h| h.outcome == crate::truth::CallOutcome::Error)
            .count() as u64,
        transfers: r.transfers.len() as u64,
        load_ns: r
            .handshakes
            .iter()
            .filter(|h| h.call == crate::truth::HandshakeCall::LoadRemoteMd)
            .map(|h| h.wall_ns)
            .sum(),
        post_to_done_ns: r.transfers.iter().filter_map(|t| t.post_to_done_ns).sum(),
        detail: detail.or_else(|| r.detail.clone()),
        at_ns: crate::worker::unix_ns(),
    }
}

fn find_worker(s: &Shared, agent: Option<&str>, key: &WorkerKey) -> Option<usize> {
    match agent {
        Some(name) => s.workers.iter().position(|w| w.cfg.name == name),
        None => s.workers.iter().position(|w| w.cfg.worker == *key),
    }
}

async fn migrate(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if !kvscope_kit::auth::authorized(&headers, &s.token) {
        s.ledger.bump(|c| c.unauthorized += 1);
        return unauthorized();
    }
    s.ledger.bump(|c| c.received += 1);
    let d: MigrationDirective = match serde_json::from_slice(&body) {
        Ok(d) => d,
        Err(e) => {
            s.ledger.bump(|c| c.rejected += 1);
            return (
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("not a MigrationDirective: {e}\n"),
            )
                .into_response();
        }
    };
    if let Some(h) = headers.get(IDEMPOTENCY_HEADER) {
        if h.to_str().ok() != Some(d.idempotency_key.as_str()) {
            return rejected(
                &s,
                &d,
                format!("the {IDEMPOTENCY_HEADER} header differs from the body's idempotency_key"),
            );
        }
    }
    match s.ledger.admit(&d.idempotency_key) {
        Admission::Admitted => {}
        Admission::InFlight => {
            s.ledger.bump(|c| c.duplicate += 1);
            return (StatusCode::CONFLICT, "in flight\n").into_response();
        }
        Admission::Done(o) => {
            s.ledger.bump(|c| c.duplicate += 1);
            return (StatusCode::CONFLICT, Json(o)).into_response();
        }
    }
    let Some(src) = find_worker(&s, d.source_nixl_agent.as_deref(), &d.source) else {
        return rejected(&s, &d, format!("no lab worker for the source {}", d.source));
    };
    let Some(dst) = find_worker(&s, d.target_nixl_agent.as_deref(), &d.target) else {
        return rejected(&s, &d, format!("no lab worker for the target {}", d.target));
    };
    if src == dst {
        return rejected(&s, &d, "source and target are the same worker".into());
    }
    if d.block_hashes.is_empty() {
        return rejected(
            &s,
            &d,
            "the directive carries no block_hashes: the lab needs them to know which blocks to move"
                .into(),
        );
    }
    let (source_w, target_w) = (&s.workers[src], &s.workers[dst]);
    // What the source's engine holds, and where the target's chain continues.
    let resolved = {
        let book = source_w.book.lock().unwrap_or_else(|e| e.into_inner());
        let mut blocks = Vec::new();
        let mut missing = 0usize;
        for h in &d.block_hashes {
            match book.get(*h) {
                Some(b) => blocks.push(b.clone()),
                None => missing += 1,
            }
        }
        (blocks, missing)
    };
    let (blocks, missing) = resolved;
    if missing > 0 {
        return rejected(
            &s,
            &d,
            format!(
                "the source {} no longer holds {missing} of the {} blocks",
                source_w.cfg.name,
                d.block_hashes.len()
            ),
        );
    }
    let parent_engine = match d.parent_block_hash {
        None => None,
        Some(p) => {
            let book = target_w.book.lock().unwrap_or_else(|e| e.into_inner());
            match book.get(p) {
                Some(b) => Some(b.engine_hash),
                None => {
                    drop(book);
                    return rejected(
                        &s,
                        &d,
                        format!(
                            "the target {} no longer holds the block the delta extends",
                            target_w.cfg.name
                        ),
                    );
                }
            }
        }
    };
    let job = MigrationJob {
        source: src,
        target: dst,
        source_blocks: d
            .block_hashes
            .iter()
            .map(|h| (h % u64::from(source_w.fill_blocks.max(1))) as u32)
            .collect(),
        corrupt_handshake: s.inject.load(Ordering::Relaxed),
        notif: Some(format!("{}:1", d.request_id)),
    };
    let report = s.fleet.migrate(job).await;
    let (src_name, dst_name) = (
        Some(source_w.cfg.name.as_str()),
        Some(target_w.cfg.name.as_str()),
    );
    let (code, name) = match report.failure {
        None => (StatusCode::OK, "migrated"),
        Some(MigrationFailure::HandshakeFailed) => (StatusCode::BAD_GATEWAY, "handshake_failed"),
        Some(MigrationFailure::TransferFailed) => (StatusCode::BAD_GATEWAY, "transfer_failed"),
        Some(MigrationFailure::DataMismatch) => {
            (StatusCode::INTERNAL_SERVER_ERROR, "data_mismatch")
        }
        Some(MigrationFailure::Lab) => (StatusCode::INTERNAL_SERVER_ERROR, "lab"),
    };
    let mut o = outcome_of(&d, name, src_name, dst_name, &report, None);
    if report.failure.is_none() {
        // The blocks landed: the target now holds them, and says so as its engine would.
        let block_size = blocks.first().map_or(0, |b| b.tokens.len() as u32);
        let ev = KvEvent::BlockStored {
            block_hashes: blocks.iter().map(|b| b.engine_hash).collect(),
            parent_block_hash: parent_engine,
            token_ids: blocks
                .iter()
                .flat_map(|b| b.tokens.iter().copied())
                .collect(),
            block_size,
            local_hashes: None,
            lora_name: None,
            medium: None,
            cache_salt: None,
        };
        if target_w.publish.send(vec![ev]).is_ok() {
            target_w.published.fetch_add(1, Ordering::Relaxed);
        }
        o.block_hashes = d.block_hashes.clone();
        s.ledger.bump(|c| c.migrated += 1);
        info!(key = %d.idempotency_key, source = %source_w.cfg.name, target = %target_w.cfg.name,
              blocks = d.block_hashes.len(), bytes = report.bytes, "Migrated.");
    } else {
        s.ledger.bump(|c| c.failed += 1);
        warn!(key = %d.idempotency_key, source = %source_w.cfg.name, target = %target_w.cfg.name,
              outcome = name, detail = ?report.detail, "Migration failed.");
    }
    s.ledger.remember(&o, report.failure.is_none());
    (code, Json(o)).into_response()
}
