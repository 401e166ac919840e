//! Dynamo's discovery store, read the way Dynamo's own router reads it, so kvscope knows
//! the fleet without anything typed by hand.
//!
//! Every Dynamo process registers itself in the store (`--discovery-backend`, default
//! etcd; also `file` and `kubernetes`): the router's `worker_id` is the instance id a
//! worker's `generate` endpoint registers, and it changes when the worker restarts. The
//! store also holds each worker's model card (model, KV block size, `total_kv_blocks`,
//! data-parallel ranks) and, per KV event publisher (one per worker and dp rank), the
//! event-plane channel its events travel on and the endpoint that answers recovery
//! queries. Layout, as Dynamo 1.6.1 writes it (keys `<bucket>/<key>`; the file backend
//! URL-encodes the key as the file name inside the bucket folder, etcd keeps it as is):
//!
//! ```text
//! v1/instances/<ns>/<component>/<endpoint>/<instance hex>
//!     {"type":"Endpoint","namespace":"dynamo","component":"backend","endpoint":"generate",
//!      "instance_id":2129558125179076404,"transport":{"tcp":"127.0.0.1:43745/…"},…}
//! v1/mdc/<ns>/<component>/<endpoint>/<instance hex>          (the model card)
//!     {"type":"Model","instance_id":…,"card_json":{"display_name":"…","kv_cache_block_size":16,
//!      "runtime_config":{"total_kv_blocks":48,"data_parallel_start_rank":0,"data_parallel_size":1,…},…}}
//! v1/event_sources/namespace/<ns>/component/<c>/endpoint/<e>/topic/kv-events/<publisher hex>
//!     {"type":"EventSource","topic":"kv-events","publisher_id":…,
//!      "metadata":{"worker":{"worker_id":…,"dp_rank":0},"recovery_target":{…}}}
//! v1/event_channels/namespace/<ns>/component/<c>/endpoint/<e>/topic/kv-events/<publisher hex>
//!     {"type":"EventChannel","topic":"kv-events","instance_id":<publisher id>,
//!      "transport":{"kind":"Zmq","config":{"endpoint":"tcp://127.0.0.1:33763"}}}
//!      (or {"kind":"Nats","config":{"subject_prefix":"namespace.dynamo.component.backend.endpoint.generate"}})
//! ```
//!
//! [`Fleet::from_entries`] turns the entries into workers and publishers (pure, tested on
//! the lab's captured store); [`backend`] reads them from a backend; [`Fleet::changes`]
//! says what appeared and went away between two reads; [`procfs`] tells which local
//! process listens on an address (how a node agent maps an engine's own publisher to
//! its worker).

pub mod backend;
pub mod config;
pub mod kubernetes;
pub mod procfs;

pub use backend::{Backend, DiscoveryError};
pub use config::DiscoveryConfig;

use kvscope_wire::WorkerKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// The topic of the KV events on Dynamo's event plane.
pub const KV_EVENTS_TOPIC: &str = "kv-events";

/// A worker: one instance serving a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Worker {
    /// Dynamo's instance id: the router's `worker_id`.
    pub instance_id: u64,
    pub namespace: String,
    pub component: String,
    pub endpoint: String,
    /// The request-plane address (`host:port/<id>/<ns>/<component>/<endpoint>` for TCP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_plane: Option<String>,
    /// The model it serves (the card's `display_name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// KV capacity per dp rank, in blocks (`runtime_config.total_kv_blocks`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_kv_blocks: Option<u64>,
    /// The data-parallel ranks it runs (from the card; else the ranks its publishers
    /// name).
    pub dp_ranks: Vec<u32>,
    /// `aggregated`, `prefill` or `decode`, when the card says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_type: Option<String>,
    /// The model's `config.json` as the worker registered it (the card's
    /// `model_info.hf_config_json.path`: a path on the worker's own file system).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_config: Option<String>,
}

/// Where a publisher's events travel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Channel {
    /// A ZMQ PUB bound by the publisher.
    Zmq { endpoint: String },
    /// Core NATS subjects `<subject_prefix>.<topic>`, shared by an endpoint's publishers.
    Nats { subject_prefix: String },
}

impl Channel {
    /// The NATS subject of `topic` on this channel, for a NATS channel.
    pub fn nats_subject(&self, topic: &str) -> Option<String> {
        match self {
            Channel::Nats { subject_prefix } => Some(format!("{subject_prefix}.{topic}")),
            Channel::Zmq { .. } => None,
        }
    }
}

/// One KV event publisher: one worker's (and dp rank's) events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvPublisher {
    pub publisher_id: u64,
    pub worker: WorkerKey,
    /// Its event-plane channel (absent until the channel entry is seen).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<Channel>,
    /// The endpoint answering recovery queries for it, as registered (its name and
    /// request-plane address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<RecoveryTarget>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryTarget {
    pub endpoint: String,
    pub instance_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<String>,
}

/// What the store says about the fleet at one read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fleet {
    /// By instance id.
    pub workers: BTreeMap<u64, Worker>,
    /// By publisher id.
    pub kv_publishers: BTreeMap<u64, KvPublisher>,
}

/// What changed between two reads of the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FleetChange {
    /// A worker appeared, or what the store says of it changed.
    Worker(Worker),
    /// A worker's registration went away (it stopped, or its lease expired).
    WorkerGone(u64),
    /// A KV publisher appeared or changed (its channel arrived, say).
    Publisher(KvPublisher),
    PublisherGone(KvPublisher),
}

impl Fleet {
    /// Reads store entries, `(key with its bucket, document)`; entries of other kinds,
    /// topics or shapes are ignored (the store holds more than kvscope needs).
    pub fn from_entries<'a>(entries: impl IntoIterator<Item = (&'a str, &'a Value)>) -> Self {
        let mut fleet = Fleet::default();
        let mut instances: Vec<Worker> = Vec::new();
        let mut cards: BTreeMap<u64, &Value> = BTreeMap::new();
        let mut channels: BTreeMap<u64, Channel> = BTreeMap::new();
        let mut sources = Vec::new();
        for (key, doc) in entries {
            let bucket = key.split('/').take(2).collect::<Vec<_>>().join("/");
            match bucket.as_str() {
                "v1/instances" => instances.extend(instance(doc)),
                "v1/mdc" => {
                    if let Some(id) = doc.get("instance_id").and_then(Value::as_u64) {
                        cards.insert(id, doc);
                    }
                }
                "v1/event_channels" if topic(doc) == Some(KV_EVENTS_TOPIC) => {
                    if let (Some(id), Some(ch)) =
                        (doc.get("instance_id").and_then(Value::as_u64), channel(doc))
                    {
                        channels.insert(id, ch);
                    }
                }
                "v1/event_sources" if topic(doc) == Some(KV_EVENTS_TOPIC) => {
                    sources.push(doc);
                }
                _ => {}
            }
        }
        // One instance id registers several endpoints (its recovery endpoints too): the
        // worker is the endpoint its model card names, else `generate`.
        for w in instances {
            let card_endpoint = cards
                .get(&w.instance_id)
                .and_then(|c| c.get("endpoint"))
                .and_then(Value::as_str);
            let is_worker = match card_endpoint {
                Some(ep) => ep == w.endpoint,
                None => w.endpoint == "generate",
            };
            if is_worker {
                fleet.workers.insert(w.instance_id, w);
            }
        }
        for (id, card) in cards {
            if let Some(w) = fleet.workers.get_mut(&id) {
                apply_card(w, card);
            }
        }
        for doc in sources {
            let Some(p) = publisher(doc) else { continue };
            let p = KvPublisher {
                channel: channels.get(&p.publisher_id).cloned(),
                ..p
            };
            if let Some(w) = fleet.workers.get_mut(&p.worker.worker_id) {
                if !w.dp_ranks.contains(&p.worker.dp_rank) {
                    w.dp_ranks.push(p.worker.dp_rank);
                    w.dp_ranks.sort_unstable();
                }
            }
            fleet.kv_publishers.insert(p.publisher_id, p);
        }
        fleet
    }

    /// The workers serving `model`.
    pub fn serving(&self, model: &str) -> impl Iterator<Item = &Worker> + '_ {
        let model = model.to_string();
        self.workers
            .values()
            .filter(move |w| w.model.as_deref() == Some(model.as_str()))
    }

    /// What changed from `before` to `self`, workers before their publishers when they
    /// appear and after them when they go.
    pub fn changes(&self, before: &Fleet) -> Vec<FleetChange> {
        let mut out = Vec::new();
        for (id, w) in &self.workers {
            if before.workers.get(id) != Some(w) {
                out.push(FleetChange::Worker(w.clone()));
            }
        }
        for (id, p) in &self.kv_publishers {
            if before.kv_publishers.get(id) != Some(p) {
                out.push(FleetChange::Publisher(p.clone()));
            }
        }
        for (id, p) in &before.kv_publishers {
            if !self.kv_publishers.contains_key(id) {
                out.push(FleetChange::PublisherGone(p.clone()));
            }
        }
        for id in before.workers.keys() {
            if !self.workers.contains_key(id) {
                out.push(FleetChange::WorkerGone(*id));
            }
        }
        out
    }
}

/// Every event-plane channel in the entries, of every topic, as (topic, channel): the
/// PUB sockets Dynamo's workers and frontends bind, for instance.
pub fn event_channels<'a>(
    entries: impl IntoIterator<Item = (&'a str, &'a Value)>,
) -> Vec<(String, Channel)> {
    entries
        .into_iter()
        .filter(|(k, _)| k.starts_with("v1/event_channels/"))
        .filter_map(|(_, doc)| Some((topic(doc)?.to_string(), channel(doc)?)))
        .collect()
}

fn topic(doc: &Value) -> Option<&str> {
    doc.get("topic").and_then(Value::as_str)
}

fn text(doc: &Value, key: &str) -> String {
    doc.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

fn instance(doc: &Value) -> Option<Worker> {
    if doc.get("type").and_then(Value::as_str) != Some("Endpoint") {
        return None;
    }
    Some(Worker {
        instance_id: doc.get("instance_id")?.as_u64()?,
        namespace: text(doc, "namespace"),
        component: text(doc, "component"),
        endpoint: text(doc, "endpoint"),
        request_plane: doc
            .pointer("/transport/tcp")
            .and_then(Value::as_str)
            .map(str::to_string),
        model: None,
        block_size: None,
        total_kv_blocks: None,
        dp_ranks: Vec::new(),
        worker_type: None,
        model_config: None,
    })
}

fn apply_card(w: &mut Worker, doc: &Value) {
    let card = doc.get("card_json").unwrap_or(doc);
    w.model = card
        .get("display_name")
        .or_else(|| card.get("slug"))
        .and_then(Value::as_str)
        .map(str::to_string);
    w.block_size = card
        .get("kv_cache_block_size")
        .and_then(Value::as_u64)
        .and_then(|b| u32::try_from(b).ok());
    w.worker_type = card
        .get("worker_type")
        .and_then(Value::as_str)
        .map(str::to_string);
    w.model_config = card
        .pointer("/model_info/hf_config_json/path")
        .and_then(Value::as_str)
        .map(str::to_string);
    let rc = card.get("runtime_config");
    w.total_kv_blocks = rc
        .and_then(|r| r.get("total_kv_blocks"))
        .and_then(Value::as_u64);
    let start = rc
        .and_then(|r| r.get("data_parallel_start_rank"))
        .and_then(Value::as_u64);
    let size = rc
        .and_then(|r| r.get("data_parallel_size"))
        .and_then(Value::as_u64);
    if let (Some(start), Some(size)) = (start, size) {
        // A card cannot make the agent hold a huge list: ranks beyond 4096 are ignored.
        w.dp_ranks = (start..start.saturating_add(size.min(4096)))
            .filter_map(|r| u32::try_from(r).ok())
            .collect();
    }
}

fn channel(doc: &Value) -> Option<Channel> {
    let t = doc.get("transport")?;
    match t.get("kind")?.as_str()? {
        "Zmq" => Some(Channel::Zmq {
            endpoint: t.pointer("/config/endpoint")?.as_str()?.to_string(),
        }),
        "Nats" => Some(Channel::Nats {
            subject_prefix: t.pointer("/config/subject_prefix")?.as_str()?.to_string(),
        }),
        _ => None,
    }
}

fn publisher(doc: &Value) -> Option<KvPublisher> {
    let meta = doc.get("metadata")?;
    let worker_id = meta.pointer("/worker/worker_id")?.as_u64()?;
    let dp_rank = meta
        .pointer("/worker/dp_rank")
        .and_then(Value::as_u64)
        .and_then(|d| u32::try_from(d).ok())
        .unwrap_or(0);
    let publisher_id = doc
        .get("publisher_id")
        .or_else(|| meta.get("publisher_id"))?
        .as_u64()?;
    let recovery = meta.get("recovery_target").and_then(|r| {
        Some(RecoveryTarget {
            endpoint: r.get("endpoint")?.as_str()?.to_string(),
            instance_id: r.get("instance_id")?.as_u64()?,
            tcp: r
                .pointer("/transport/tcp")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    });
    Some(KvPublisher {
        publisher_id,
        worker: WorkerKey { worker_id, dp_rank },
        channel: None,
        recovery,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The store the lab's Dynamo 1.6.1 wrote (three mockers), read through the file
    /// backend's decoding.
    fn lab_store() -> Vec<(String, Value)> {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../lab/fixtures/samples/discovery"
        );
        backend::read_file_store(std::path::Path::new(dir)).unwrap()
    }

    #[test]
    fn the_lab_store_gives_three_workers_with_their_publishers() {
        let entries = lab_store();
        let fleet = Fleet::from_entries(entries.iter().map(|(k, v)| (k.as_str(), v)));
        assert_eq!(fleet.workers.len(), 3, "{:#?}", fleet.workers);
        assert_eq!(fleet.kv_publishers.len(), 3);
        for w in fleet.workers.values() {
            assert_eq!(w.model.as_deref(), Some("kvscope-tiny"));
            assert_eq!(w.block_size, Some(16));
            assert_eq!(w.total_kv_blocks, Some(48));
            assert_eq!(w.dp_ranks, vec![0]);
            assert!(w
                .model_config
                .as_deref()
                .is_some_and(|p| p.ends_with("/lab/fixtures/model/config.json")));
            assert_eq!(w.endpoint, "generate");
            assert!(w
                .request_plane
                .as_deref()
                .unwrap()
                .starts_with("127.0.0.1:"));
        }
        for p in fleet.kv_publishers.values() {
            assert!(fleet.workers.contains_key(&p.worker.worker_id));
            assert!(
                matches!(&p.channel, Some(Channel::Zmq { endpoint }) if endpoint.starts_with("tcp://127.0.0.1:")),
                "{p:?}"
            );
            let r = p.recovery.as_ref().unwrap();
            assert_eq!(r.instance_id, p.worker.worker_id);
            assert!(r.endpoint.starts_with("worker_kv_query_source_"));
        }
        assert_eq!(fleet.serving("kvscope-tiny").count(), 3);
        assert_eq!(fleet.serving("other").count(), 0);
    }

    #[test]
    fn changes_name_what_appeared_and_went_away() {
        let entries = lab_store();
        let full = Fleet::from_entries(entries.iter().map(|(k, v)| (k.as_str(), v)));
        let gone_worker = *full.workers.keys().next().unwrap();
        let fewer = Fleet::from_entries(
            entries
                .iter()
                .filter(|(k, v)| {
                    !k.ends_with(&format!("{gone_worker:x}"))
                        && v.pointer("/metadata/worker/worker_id")
                            .and_then(Value::as_u64)
                            != Some(gone_worker)
                })
                .map(|(k, v)| (k.as_str(), v)),
        );
        assert_eq!(fewer.workers.len(), 2);
        let changes = fewer.changes(&full);
        assert!(changes.contains(&FleetChange::WorkerGone(gone_worker)));
        assert_eq!(
            changes
                .iter()
                .filter(|c| matches!(c, FleetChange::PublisherGone(p) if p.worker.worker_id == gone_worker))
                .count(),
            1
        );
        assert!(fewer.changes(&fewer).is_empty());
        let back = full.changes(&fewer);
        assert!(back
            .iter()
            .any(|c| matches!(c, FleetChange::Worker(w) if w.instance_id == gone_worker)));
    }

    #[test]
    fn a_nats_channel_names_its_subject() {
        let doc: Value = serde_json::json!({
            "type": "EventChannel", "topic": "kv-events", "instance_id": 7,
            "transport": {"kind": "Nats", "config": {"subject_prefix": "namespace.dynamo.component.backend.endpoint.generate"}}
        });
        let ch = channel(&doc).unwrap();
        assert_eq!(
            ch.nats_subject(KV_EVENTS_TOPIC).as_deref(),
            Some("namespace.dynamo.component.backend.endpoint.generate.kv-events")
        );
        for bad in [
            serde_json::json!({"transport": {"kind": "Tcp"}}),
            serde_json::json!({"transport": {"kind": "Zmq", "config": {}}}),
            serde_json::json!({}),
        ] {
            assert_eq!(channel(&bad), None);
        }
    }
}
