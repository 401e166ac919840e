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
//!
//! Its parts: `api.rs` (the HTTP API above), `ledger.rs` (what became of each
//! idempotency key, the counts and recent outcomes), `engine.rs` (each engine's KV events
//! into its book, the migrated blocks out as the worker's own events), [`fleet`] (the
//! NIXL agents) and [`book`] (the blocks each engine holds).

mod api;
pub mod book;
mod engine;
pub mod fleet;
mod ledger;
pub mod process;

pub use api::{ServeStatus, WorkerStatus};
pub use ledger::{DirectiveCounts, MigrationOutcome};

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use kvscope_wire::{KvEvent, WorkerKey};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};
use zeromq::Socket;

use book::BlockBook;
use fleet::{FleetHandle, FleetUp, Member};
use ledger::Ledger;

use crate::protocol::WorkerSpec;

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

struct Shared {
    token: String,
    workers: Vec<WorkerState>,
    fleet: FleetHandle,
    inject: AtomicBool,
    ledger: Ledger,
}

type AppState = Arc<Shared>;

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
                tasks.push(tokio::spawn(engine::forward_to_sidecar(
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
                tasks.push(tokio::spawn(engine::publish_loop(socket, rx, stop.clone())));
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
        ledger: Ledger::default(),
    });
    for i in 0..shared.workers.len() {
        if shared.workers[i].cfg.engine.is_some() {
            tasks.push(tokio::spawn(engine::follow_engine(
                shared.clone(),
                i,
                stop.clone(),
            )));
        }
    }
    let app = api::router(shared.clone());
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
