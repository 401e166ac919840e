//! The fleet as Dynamo's discovery store describes it, followed live: the agent reads the
//! store every poll interval, publishes a [`WorkerRecord`] for each worker that appears,
//! changes or goes away (so the collector knows models and block sizes and retires the
//! workers that stopped), keeps the latest read for the taps that need it (an engine
//! tap without a configured worker id finds its worker through it), and, when it taps
//! Dynamo's event plane, starts and stops one tap per KV publisher as they come and go.

pub mod owners;

use crate::counters::AgentStats;
use crate::internal_events::{
    DiscoveryEntrySkipped, DiscoveryFailed, DiscoveryRead, InternalEvent, ModelNameShortened,
};
use crate::sink::RecordSink;
use crate::taps::plane::tap::PlaneTaps;
use kvscope_discovery::procfs;
use kvscope_discovery::{Backend, Fleet, FleetChange, Worker};
use kvscope_wire::hashing::MediaPlaceholders;
use kvscope_wire::subject;
use kvscope_wire::{Record, WorkerRecord, WorkerState};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The readiness check the store's follower keeps: its last read succeeded.
pub(crate) const DISCOVERY_CHECK: &str = "discovery";

/// The latest read of the store.
pub(crate) type FleetView = watch::Receiver<Arc<Fleet>>;

pub(crate) fn worker_record(w: &Worker, state: WorkerState) -> WorkerRecord {
    WorkerRecord {
        worker_id: w.instance_id,
        state,
        model: w.model.clone(),
        block_size: w.block_size,
        total_kv_blocks: w.total_kv_blocks,
        dp_ranks: w.dp_ranks.clone(),
        worker_type: w.worker_type.clone(),
    }
}

/// The store to follow, how often to read it, and where a whole read is told (the
/// watchdog's discovery-freshness check).
pub struct Store {
    pub backend: Backend,
    pub poll: Duration,
    pub freshness: Arc<crate::watchdog::DiscoveryFreshness>,
}

/// The longest one read of the store may take before it is given up (and counted as a
/// failed read): a read that never returns must not stop the follower.
const READ_TIMEOUT: Duration = Duration::from_secs(20);

/// Follow the store until `stop`; `view` gets every read, the sink the worker records,
/// `planes` (when tapping the event plane) every publisher change.
pub async fn run(
    store: Store,
    view: watch::Sender<Arc<Fleet>>,
    sink: Arc<RecordSink>,
    stats: Arc<AgentStats>,
    health: Arc<kvscope_kit::Health>,
    mut planes: Option<PlaneTaps>,
    mut stop: watch::Receiver<bool>,
) {
    let http = reqwest::Client::new();
    let mut known = Fleet::default();
    let Store {
        backend,
        poll,
        freshness,
    } = store;
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let shown = backend.to_string();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => break,
        }
        let read = match tokio::time::timeout(READ_TIMEOUT, backend.read(&http)).await {
            Ok(read) => read,
            Err(_) => Err(kvscope_discovery::DiscoveryError::Io {
                path: shown.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {} s", READ_TIMEOUT.as_secs()),
                ),
            }),
        };
        let fleet = match read {
            Ok(read) => {
                for skipped in &read.skipped {
                    DiscoveryEntrySkipped {
                        path: &skipped.path,
                        reason: &skipped.reason,
                    }
                    .emit(&stats);
                }
                Fleet::from_entries(read.entries.iter().map(|(k, v)| (k.as_str(), v)))
            }
            Err(e) => {
                // The store is unreachable: keep what was known, never retire on it.
                health.fail(DISCOVERY_CHECK, format!("{shown}: {e}"));
                DiscoveryFailed {
                    backend: &shown,
                    error: &e.to_string(),
                }
                .emit(&stats);
                continue;
            }
        };
        health.ok(DISCOVERY_CHECK);
        freshness.read_now();
        let changes = fleet.changes(&known);
        if changes.is_empty() {
            continue;
        }
        DiscoveryRead {
            backend: &shown,
            workers: fleet.workers.len(),
            publishers: fleet.kv_publishers.len(),
            changes: changes.len(),
        }
        .emit(&stats);
        let fleet = Arc::new(fleet);
        // Taps read the new view before they are started or stopped.
        view.send_replace(fleet.clone());
        for change in changes {
            match &change {
                FleetChange::Worker(w) => {
                    if let Some(model) = w.model.as_deref().filter(|m| subject::shortened(m)) {
                        ModelNameShortened {
                            worker_id: w.instance_id,
                            chars: model.chars().count(),
                        }
                        .emit(&stats);
                    }
                    sink.submit(Record::Worker(worker_record(w, WorkerState::Up)))
                }
                FleetChange::WorkerGone(id) => {
                    if let Some(w) = known.workers.get(id) {
                        sink.submit(Record::Worker(worker_record(w, WorkerState::Gone)));
                    }
                }
                FleetChange::Publisher(_) | FleetChange::PublisherGone(_) => {}
            }
            if let Some(p) = planes.as_mut() {
                p.apply(&change).await;
            }
        }
        known = (*fleet).clone();
    }
    if let Some(p) = planes.take() {
        p.stop().await;
    }
}

/// The worker whose process serves `endpoint` (`tcp://HOST:PORT`) on this node: the one
/// process listening on it works for that worker — it serves the worker's request
/// plane itself, or one of its ancestors does (vLLM's engine process under Dynamo's
/// worker process), or it shares the worker's pod ([`crate::fleet::owners`]). An error, with
/// the reason, while that is not (yet) so or is ambiguous.
pub(crate) fn resolve_endpoint(
    fleet: &Fleet,
    endpoint: &str,
    proc_root: &Path,
) -> Result<(u64, u32), String> {
    let (host, port) = procfs::host_port(endpoint)
        .ok_or_else(|| format!("{endpoint} has no TCP port to look up"))?;
    let sockets = procfs::sockets_of(proc_root, &procfs::all_pids(proc_root));
    let owners: Vec<u32> = procfs::listeners(&sockets, host, port)
        .into_iter()
        .collect();
    let [pid] = owners[..] else {
        return Err(if owners.is_empty() {
            format!("no local process listens on port {port}")
        } else {
            format!("several processes listen on port {port}: {owners:?}")
        });
    };
    let owner = crate::fleet::owners::worker_of_process(fleet, &sockets, proc_root, pid);
    owner.worker_id.map(|id| (id, pid)).ok_or_else(|| {
        let hint = if owner.ambiguous {
            format!("; give --kv {endpoint}=WORKER_ID")
        } else {
            String::new()
        };
        format!("process {pid} (listening on {port}): {}{hint}", owner.how)
    })
}

/// A publisher's worker, as the fleet and this node's processes tell it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherOwner {
    pub worker_id: u64,
    /// What the worker's model holds in its prompts for images and videos, or why that
    /// is not known ([`media_placeholders`]).
    pub placeholders: Result<MediaPlaceholders, String>,
}

/// Wait until `endpoint`'s worker can be told from the fleet (see [`resolve_endpoint`]),
/// re-checking at every new read of the store and every second; `None` if told to stop.
pub async fn wait_for_worker(
    view: &mut FleetView,
    endpoint: &str,
    stats: &AgentStats,
    stop: &mut watch::Receiver<bool>,
) -> Option<PublisherOwner> {
    let mut last_error = String::new();
    loop {
        let fleet = view.borrow_and_update().clone();
        let ep = endpoint.to_string();
        // Reading /proc is blocking file I/O.
        let resolved = tokio::task::spawn_blocking(move || {
            let proc_root = Path::new("/proc");
            resolve_endpoint(&fleet, &ep, proc_root).map(|(worker_id, pid)| PublisherOwner {
                worker_id,
                placeholders: media_placeholders(&fleet, worker_id, pid, proc_root),
            })
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        match resolved {
            Ok(owner) => return Some(owner),
            Err(e) => {
                if e != last_error {
                    crate::internal_events::KvWorkerUnresolved {
                        publisher: endpoint,
                        reason: &e,
                    }
                    .emit(stats);
                    last_error = e;
                }
            }
        }
        tokio::select! {
            _ = view.changed() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => return None,
        }
    }
}

/// The largest model `config.json` read: a real one is a few KiB.
const MAX_MODEL_CONFIG_BYTES: u64 = 4 << 20;

/// What a worker's model holds in its prompts where an image or a video goes, from its
/// `config.json` (the path its card registered, read through process `pid`'s root, as
/// the worker sees it): `image_token_id`, and `video_token_id` or `video_token_index`.
/// These are the ids Dynamo's vLLM handler gives its publisher, which writes a
/// multimodal object over their runs (see
/// [`kvscope_wire::hashing::local_block_hash_with_media`]). Why not, where they cannot
/// be read or the config names neither.
pub(crate) fn media_placeholders(
    fleet: &Fleet,
    worker_id: u64,
    pid: u32,
    proc_root: &Path,
) -> Result<MediaPlaceholders, String> {
    use std::io::Read;
    let path = fleet
        .workers
        .get(&worker_id)
        .and_then(|w| w.model_config.as_deref())
        .ok_or("the worker's model card names no config.json")?;
    let inside = path
        .strip_prefix('/')
        .ok_or_else(|| format!("the card's config.json path {path:?} is not absolute"))?;
    let full = proc_root.join(pid.to_string()).join("root").join(inside);
    let mut text = String::new();
    let shown = |e: std::io::Error| format!("{}: {e}", full.display());
    // Opened without waiting (a FIFO at that path would block the open forever), and
    // read only when it is a plain file.
    let file = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NONBLOCK)
            .open(&full)
            .map_err(shown)?
    };
    if !file.metadata().map_err(shown)?.is_file() {
        return Err(format!("{} is not a file", full.display()));
    }
    file.take(MAX_MODEL_CONFIG_BYTES)
        .read_to_string(&mut text)
        .map_err(shown)?;
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", full.display()))?;
    let id = |key: &str| {
        config
            .get(key)
            .and_then(serde_json::Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
    };
    let placeholders = MediaPlaceholders {
        image: id("image_token_id"),
        video: id("video_token_id").or_else(|| id("video_token_index")),
    };
    if placeholders == MediaPlaceholders::default() {
        return Err(format!(
            "{} names no image_token_id, video_token_id or video_token_index",
            full.display()
        ));
    }
    Ok(placeholders)
}
