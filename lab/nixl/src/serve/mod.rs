//! `kvscope-nixl-lab serve`: the NIXL lab's decode workers as a long-running data plane
//! for migrations. Each worker is a real NIXL agent (see [`fleet`]) standing for one
//! engine (a Dynamo worker id): it follows that engine's vLLM-format ZMQ KV events to
//! know which blocks the engine holds ([`book`]), publishes the blocks migrated *to* it
//! as vLLM-format KV events of its own, and the lab takes the actuator's
//! `MigrationDirective`s over HTTP:
//!
//! - `POST /v1/migrations` (bearer token; `Idempotency-Key` header = the directive's
//!   key): the source serves as producer, the target loads the source's metadata and
//!   READs the blocks, checks the bytes that landed, then publishes them as
//!   `BlockStored`. 200 migrated; 409 a key seen before (with its first outcome; a
//!   failed key may be retried); 422 a directive this lab cannot perform (unknown
//!   worker, no block hashes, blocks the source no longer holds, a parent the target
//!   no longer holds); 502 the NIXL handshake or transfer failed (the actuator retries
//!   with the same key); 500 the data did not check out.
//! - `POST /v1/inject` (bearer): `{"handshake_failures": true}` mangles the source's
//!   metadata before every target loads it from then on (NIXL_ERR_MISMATCH), `false`
//!   stops it.
//! - `GET /v1/status`, `GET /healthz`: workers, books, publishers, outcomes.
//!
//! A worker's NIXL agent and publisher live in this process, or in a sidecar inside its
//! engine's process tree (`--worker …,sidecar=FILE`, see [`crate::sidecar`]), which this
//! process drives over the sidecar's control socket.

pub mod book;
pub mod fleet;
pub mod process;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvscope_wire::directive::{bearer_matches, MigrationDirective, IDEMPOTENCY_HEADER};
use kvscope_wire::vllm_events::{decode_payload, split_frames};
use kvscope_wire::{KvEvent, WorkerKey};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};
use zeromq::{Socket, SocketRecv, SocketSend};

use book::{BlockBook, BookFaults};
use fleet::{FleetHandle, FleetUp, Member, MigrationFailure, MigrationJob, MigrationReport};

use crate::protocol::WorkerSpec;

/// Outcomes kept for `/v1/status`.
const KEEP_OUTCOMES: usize = 1000;

/// One serving worker, as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServeWorker {
    /// NIXL agent name (what the actuator's `worker_agents` maps the worker id to).
    pub name: String,
    /// The engine it stands for, as the router names it.
    pub worker: WorkerKey,
    /// The engine's ZMQ KV event publisher to follow (none: the worker holds nothing
    /// and can only be a target).
    pub engine: Option<String>,
    /// Where to publish this worker's own KV events (`tcp://127.0.0.1:0` picks a port).
    pub kv_bind: String,
    /// The ready file of the sidecar that holds this worker's NIXL agent and KV event
    /// publisher inside its engine's process tree (`kvscope-nixl-lab sidecar`); none:
    /// both live in this process. `name` must be the sidecar's agent name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidecar: Option<std::path::PathBuf>,
}

impl std::str::FromStr for ServeWorker {
    type Err = String;

    /// `name=decode-0,worker_id=7[,dp_rank=0][,engine=tcp://…][,kv=tcp://127.0.0.1:0][,sidecar=FILE]`
    fn from_str(s: &str) -> Result<Self, String> {
        let mut w = ServeWorker {
            name: String::new(),
            worker: WorkerKey {
                worker_id: u64::MAX,
                dp_rank: 0,
            },
            engine: None,
            kv_bind: "tcp://127.0.0.1:0".into(),
            sidecar: None,
        };
        for part in s.split(',') {
            let Some((k, v)) = part.split_once('=') else {
                return Err(format!("--worker {s:?}: {part:?} is not KEY=VALUE"));
            };
            let bad = |e: std::num::ParseIntError| format!("--worker {s:?}: {k}: {e}");
            match k {
                "name" => w.name = v.to_string(),
                "worker_id" => w.worker.worker_id = v.parse().map_err(bad)?,
                "dp_rank" => w.worker.dp_rank = v.parse().map_err(bad)?,
                "engine" => w.engine = Some(v.to_string()),
                "kv" => w.kv_bind = v.to_string(),
                "sidecar" => w.sidecar = Some(v.into()),
                _ => {
                    return Err(format!(
                        "--worker {s:?}: unknown key {k:?} (name, worker_id, dp_rank, engine, kv, sidecar)"
                    ))
                }
            }
        }
        if w.name.is_empty() || w.worker.worker_id == u64::MAX {
            return Err(format!("--worker {s:?}: name= and worker_id= are required"));
        }
        Ok(w)
    }
}

/// Everything `serve` needs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub workers: Vec<ServeWorker>,
    pub listen: SocketAddr,
    /// Bearer token for the writes (≥ 16 characters).
    pub token: String,
    /// Blocks per pool (half serve as source blocks, half as landing blocks).
    pub blocks: u32,
    /// Bytes per KV block.
    pub block_size: u32,
    pub listener_delay_us: u64,
    pub progress_delay_us: u64,
}

/// What `serve` prints on stdout (one JSON line) once everything is up.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServeReady {
    pub listen: String,
    pub pid: u32,
    pub workers: Vec<ReadyWorker>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReadyWorker {
    pub name: String,
    pub worker: WorkerKey,
    /// Where its KV events are published (tap it with `--kv ENDPOINT=WORKER_ID`).
    pub kv_endpoint: String,
    pub engine: Option<String>,
    pub nixl_listen_port: u16,
}

/// The answer to one directive.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MigrationOutcome {
    pub idempotency_key: String,
    pub request_id: String,
    /// migrated | handshake_failed | transfer_failed | data_mismatch | rejected | lab
    pub outcome: String,
    pub source_agent: Option<String>,
    pub target_agent: Option<String>,
    pub blocks: usize,
    pub bytes: u64,
    /// The sequence hashes now published as stored on the target.
    #[serde(default)]
    pub block_hashes: Vec<u64>,
    pub handshakes: u64,
    pub handshakes_failed: u64,
    pub transfers: u64,
    pub detail: Option<String>,
    pub at_ns: u64,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct DirectiveCounts {
    pub received: u64,
    pub migrated: u64,
    pub duplicate: u64,
    pub rejected: u64,
    pub failed: u64,
    pub unauthorized: u64,
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

struct WorkerState {
    cfg: ServeWorker,
    kv_endpoint: String,
    fill_blocks: u32,
    book: Mutex<BlockBook>,
    undecodable: std::sync::atomic::AtomicU64,
    skipped: std::sync::atomic::AtomicU64,
    published: std::sync::atomic::AtomicU64,
    publish: mpsc::UnboundedSender<Vec<KvEvent>>,
}

enum KeyState {
    InFlight,
    /// The outcome, and whether it is final (a failed one may be retried).
    Done(Box<MigrationOutcome>, bool),
}

struct Shared {
    token: String,
    workers: Vec<WorkerState>,
    fleet: FleetHandle,
    inject: AtomicBool,
    keys: Mutex<HashMap<String, KeyState>>,
    counts: Mutex<DirectiveCounts>,
    outcomes: Mutex<VecDeque<MigrationOutcome>>,
}

type AppState = Arc<Shared>;

fn authorized(headers: &HeaderMap, token: &str) -> bool {
    bearer_matches(
        headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok()),
        token,
    )
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
        "a valid bearer token is required\n",
    )
        .into_response()
}

/// Start the fleet, the KV taps and publishers, and the HTTP API; print the ready line;
/// serve until `stop` turns true, then shut the agents down.
pub async fn serve(cfg: ServeConfig, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
    use anyhow::{bail, Context};
    if cfg.token.chars().count() < 16 {
        bail!(
            "serve needs a bearer token of at least 16 characters (--token-file or \
             KVSCOPE_NIXL_LAB_TOKEN): every directive is a write"
        );
    }
    if cfg.workers.len() < 2 {
        bail!("serve needs at least two --worker (a migration has a source and a target)");
    }
    // Held while serving, so nothing alongside takes a port before its agent binds it.
    let reservation = kvscope_lab::ports::reserve_ports(cfg.workers.len())
        .context("picking NIXL listener ports")?;
    let ports = reservation.ports();
    let specs: Vec<Member> = cfg
        .workers
        .iter()
        .enumerate()
        .map(|(i, w)| match &w.sidecar {
            Some(ready) => Member::Sidecar(ready.clone()),
            None => Member::InProcess(WorkerSpec {
                name: w.name.clone(),
                listen_port: ports[i],
                blocks: cfg.blocks,
                block_size: cfg.block_size,
                fill: 0x31 + i as u8,
                listener_delay_us: cfg.listener_delay_us,
                progress_delay_us: cfg.progress_delay_us,
            }),
        })
        .collect();
    let (fleet, up): (FleetHandle, FleetUp) =
        tokio::task::spawn_blocking(move || fleet::start(specs))
            .await
            .context("the NIXL start-up task")?
            .map_err(anyhow::Error::msg)?;
    info!(
        agents = up.agents.len(),
        handshakes = up.handshakes_ok,
        probes = up.probe_transfers_ok,
        "NIXL workers up."
    );

    for (w, a) in cfg.workers.iter().zip(&up.agents) {
        if w.name != a.name {
            bail!(
                "worker {:?} is the agent {:?} (its sidecar's --name must be the worker's name)",
                w.name,
                a.name
            );
        }
    }
    let mut workers = Vec::new();
    let mut tasks = Vec::new();
    for (i, w) in cfg.workers.iter().enumerate() {
        let (tx, rx) = mpsc::unbounded_channel();
        let kv_endpoint = match up.kv_endpoints.get(i).cloned().flatten() {
            // The sidecar publishes: forward the batches to it, in order.
            Some(ep) => {
                tasks.push(tokio::spawn(forward_to_sidecar(
                    fleet.clone(),
                    i,
                    rx,
                    stop.clone(),
                )));
                ep
            }
            None => {
                let mut socket = zeromq::PubSocket::new();
                let ep = socket.bind(&w.kv_bind).await.with_context(|| {
                    format!("binding {}'s KV event publisher on {}", w.name, w.kv_bind)
                })?;
                tasks.push(tokio::spawn(publish_loop(socket, rx, stop.clone())));
                ep.to_string()
            }
        };
        workers.push(WorkerState {
            cfg: w.clone(),
            kv_endpoint,
            fill_blocks: cfg.blocks / 2,
            book: Mutex::new(BlockBook::new()),
            undecodable: Default::default(),
            skipped: Default::default(),
            published: Default::default(),
            publish: tx,
        });
    }
    let shared = Arc::new(Shared {
        token: cfg.token.clone(),
        workers,
        fleet: fleet.clone(),
        inject: AtomicBool::new(false),
        keys: Mutex::new(HashMap::new()),
        counts: Mutex::new(DirectiveCounts::default()),
        outcomes: Mutex::new(VecDeque::new()),
    });
    for i in 0..shared.workers.len() {
        if shared.workers[i].cfg.engine.is_some() {
            tasks.push(tokio::spawn(follow_engine(shared.clone(), i, stop.clone())));
        }
    }
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/v1/status", get(status))
        .route("/v1/migrations", post(migrate))
        .route("/v1/inject", post(inject))
        .with_state(shared.clone());
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding the directive endpoint on {}", cfg.listen))?;
    let listen = listener.local_addr()?;
    if !listen.ip().is_loopback() {
        warn!(%listen, "The directive endpoint listens beyond loopback.");
    }
    let ready = ServeReady {
        listen: listen.to_string(),
        pid: std::process::id(),
        workers: shared
            .workers
            .iter()
            .zip(&up.agents)
            .map(|(w, a)| ReadyWorker {
                name: w.cfg.name.clone(),
                worker: w.cfg.worker,
                kv_endpoint: w.kv_endpoint.clone(),
                engine: w.cfg.engine.clone(),
                nixl_listen_port: a.listen_port,
            })
            .collect(),
    };
    println!("{}", serde_json::to_string(&ready)?);
    let mut stop_http = stop.clone();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = stop_http.wait_for(|s| *s).await;
        })
        .await
        .context("serving the directive endpoint")?;
    let _ = stop.wait_for(|s| *s).await;
    for t in tasks {
        t.abort();
    }
    fleet.shutdown().await;
    info!("NIXL workers shut down.");
    Ok(())
}

/// Hand batches to a sidecar's own publisher, in order.
async fn forward_to_sidecar(
    fleet: FleetHandle,
    worker: usize,
    mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let events = tokio::select! {
            e = rx.recv() => match e { Some(e) => e, None => return },
            _ = stop.wait_for(|s| *s) => return,
        };
        if let Err(e) = fleet.publish(worker, events).await {
            warn!(worker, error = %e, "Publishing KV events through the sidecar failed.");
        }
    }
}

/// Publish batches as vLLM does: `[topic "", seq, payload]`, seq from 0.
async fn publish_loop(
    mut socket: zeromq::PubSocket,
    mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut seq = 0u64;
    loop {
        let events = tokio::select! {
            e = rx.recv() => match e { Some(e) => e, None => return },
            _ = stop.wait_for(|s| *s) => return,
        };
        match crate::sidecar::kv_message(seq, &events) {
            Some(m) => {
                if let Err(e) = socket.send(m).await {
                    warn!(error = %e, "Publishing KV events failed.");
                }
            }
            None => warn!("Building a KV event message failed."),
        }
        seq += 1;
    }
}

/// Follow the engine's KV events into the worker's book (reconnecting with back-off).
async fn follow_engine(shared: AppState, i: usize, mut stop: watch::Receiver<bool>) {
    let w = &shared.workers[i];
    let Some(endpoint) = w.cfg.engine.clone() else {
        return;
    };
    let mut backoff = Duration::from_millis(100);
    while !*stop.borrow() {
        let mut socket = zeromq::SubSocket::new();
        let connected =
            match tokio::time::timeout(Duration::from_secs(2), socket.connect(&endpoint)).await {
                Ok(Ok(())) => socket.subscribe("").await.map_err(|e| e.to_string()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("connect timed out".into()),
            };
        if let Err(error) = connected {
            warn!(worker = %w.cfg.name, engine = %endpoint, %error, "Cannot follow the engine's KV events; retrying.");
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
            continue;
        }
        info!(worker = %w.cfg.name, engine = %endpoint, "Following the engine's KV events.");
        loop {
            let msg = tokio::select! {
                m = socket.recv() => m,
                _ = stop.wait_for(|s| *s) => return,
            };
            let Ok(msg) = msg else { break };
            let frames = msg.into_vec();
            let decoded = split_frames(&frames)
                .map_err(|e| e.to_string())
                .and_then(|(_, payload)| decode_payload(payload).map_err(|e| e.to_string()));
            match decoded {
                Ok(p) => {
                    if !p.problems.is_empty() {
                        w.skipped
                            .fetch_add(p.problems.len() as u64, Ordering::Relaxed);
                        warn!(worker = %w.cfg.name, skipped = p.problems.len(), problems = ?p.problems, "Engine KV events skipped (counted).");
                    }
                    let mut book = w.book.lock().unwrap_or_else(|e| e.into_inner());
                    for ev in &p.events {
                        book.apply(ev);
                    }
                }
                Err(error) => {
                    w.undecodable.fetch_add(1, Ordering::Relaxed);
                    warn!(worker = %w.cfg.name, %error, "Undecodable KV event message from the engine (counted).");
                }
            }
        }
    }
}

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
        directives: *s.counts.lock().unwrap_or_else(|e| e.into_inner()),
        outcomes: s
            .outcomes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect(),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InjectBody {
    handshake_failures: bool,
}

async fn inject(State(s): State<AppState>, headers: HeaderMap, body: Json<InjectBody>) -> Response {
    if !authorized(&headers, &s.token) {
        return unauthorized();
    }
    s.inject.store(body.handshake_failures, Ordering::Relaxed);
    info!(
        handshake_failures = body.handshake_failures,
        "Handshake failure injection changed."
    );
    (StatusCode::OK, "ok\n").into_response()
}

fn bump(s: &Shared, f: impl FnOnce(&mut DirectiveCounts)) {
    f(&mut s.counts.lock().unwrap_or_else(|e| e.into_inner()));
}

fn rejected(s: &Shared, d: &MigrationDirective, detail: String) -> Response {
    bump(s, |c| c.rejected += 1);
    let o = outcome_of(
        d,
        "rejected",
        None,
        None,
        &MigrationReport::default(),
        Some(detail),
    );
    remember(s, &o, false);
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
        detail: detail.or_else(|| r.detail.clone()),
        at_ns: crate::worker::unix_ns(),
    }
}

/// Keep the outcome under its key (`final_` ones answer repeats with 409; failed ones
/// may be retried) and in the status list.
fn remember(s: &Shared, o: &MigrationOutcome, final_: bool) {
    s.keys.lock().unwrap_or_else(|e| e.into_inner()).insert(
        o.idempotency_key.clone(),
        KeyState::Done(Box::new(o.clone()), final_),
    );
    let mut list = s.outcomes.lock().unwrap_or_else(|e| e.into_inner());
    list.push_back(o.clone());
    while list.len() > KEEP_OUTCOMES {
        list.pop_front();
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
    if !authorized(&headers, &s.token) {
        bump(&s, |c| c.unauthorized += 1);
        return unauthorized();
    }
    bump(&s, |c| c.received += 1);
    let d: MigrationDirective = match serde_json::from_slice(&body) {
        Ok(d) => d,
        Err(e) => {
            bump(&s, |c| c.rejected += 1);
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
    // Idempotency: a key seen before is answered with what became of it, unless it
    // failed in a way worth retrying.
    {
        let mut keys = s.keys.lock().unwrap_or_else(|e| e.into_inner());
        match keys.get(&d.idempotency_key) {
            Some(KeyState::InFlight) => {
                bump(&s, |c| c.duplicate += 1);
                return (StatusCode::CONFLICT, "in flight\n").into_response();
            }
            Some(KeyState::Done(o, true)) => {
                let o = (**o).clone();
                drop(keys);
                bump(&s, |c| c.duplicate += 1);
                return (StatusCode::CONFLICT, Json(o)).into_response();
            }
            _ => {
                keys.insert(d.idempotency_key.clone(), KeyState::InFlight);
            }
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
        };
        if target_w.publish.send(vec![ev]).is_ok() {
            target_w.published.fetch_add(1, Ordering::Relaxed);
        }
        o.block_hashes = d.block_hashes.clone();
        bump(&s, |c| c.migrated += 1);
        info!(key = %d.idempotency_key, source = %source_w.cfg.name, target = %target_w.cfg.name,
              blocks = d.block_hashes.len(), bytes = report.bytes, "Migrated.");
    } else {
        bump(&s, |c| c.failed += 1);
        warn!(key = %d.idempotency_key, source = %source_w.cfg.name, target = %target_w.cfg.name,
              outcome = name, detail = ?report.detail, "Migration failed.");
    }
    remember(&s, &o, report.failure.is_none());
    (code, Json(o)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_specs_parse_and_bad_ones_say_why() {
        let w: ServeWorker = "name=decode-0,worker_id=7,engine=tcp://127.0.0.1:5557"
            .parse()
            .unwrap();
        assert_eq!(w.name, "decode-0");
        assert_eq!(w.worker.worker_id, 7);
        assert_eq!(w.engine.as_deref(), Some("tcp://127.0.0.1:5557"));
        assert_eq!(w.kv_bind, "tcp://127.0.0.1:0");
        assert_eq!(w.sidecar, None);
        let w: ServeWorker = "name=d-1,worker_id=8,sidecar=/run/sidecar-1.json"
            .parse()
            .unwrap();
        assert_eq!(
            w.sidecar.as_deref(),
            Some(std::path::Path::new("/run/sidecar-1.json"))
        );
        assert!("name=x"
            .parse::<ServeWorker>()
            .unwrap_err()
            .contains("required"));
        assert!("name=x,worker_id=a"
            .parse::<ServeWorker>()
            .unwrap_err()
            .contains("worker_id"));
        assert!("name=x,worker_id=1,colour=red"
            .parse::<ServeWorker>()
            .unwrap_err()
            .contains("unknown key"));
    }
}
