//! Reads Dynamo's file discovery store (`--discovery-backend file`, root `DYN_FILE_KV`).
//!
//! Layout observed with Dynamo 1.6.1 (one JSON document per file; file names are
//! URL-encoded keys, the last segment of instance keys is the instance id in hex):
//!
//! ```text
//! v1/instances/dynamo%2Fbackend%2Fgenerate%2F<id hex>
//!     {"type":"Endpoint","namespace":"dynamo","component":"backend","endpoint":"generate",
//!      "instance_id":2129558125179076404,"transport":{"tcp":"127.0.0.1:43745/…"},…}
//! v1/event_sources/namespace%2Fdynamo%2F…%2Ftopic%2Fkv%2Devents%2F<publisher hex>
//!     {"type":"EventSource","topic":"kv-events","publisher_id":…,
//!      "metadata":{"worker":{"worker_id":2129558125179076404,"dp_rank":0},…}}
//! v1/event_channels/…%2Ftopic%2Fkv%2Devents%2F<publisher hex>
//!     {"type":"EventChannel","topic":"kv-events","instance_id":<publisher id>,
//!      "transport":{"kind":"Zmq","config":{"endpoint":"tcp://127.0.0.1:33763"}}}
//! v1/mdc/dynamo%2Fbackend%2Fgenerate%2F<id hex>   (model card, with runtime_config)
//! ```
//!
//! The `instance_id` of a worker's `generate` endpoint is the `worker_id` the KV router
//! logs (`Selected worker … worker_id=…`). The event channel endpoint is Dynamo's own
//! event plane (Dynamo's internal encoding), *not* the vLLM-format publisher bound with
//! `--zmq-kv-events-ports`; that one is not recorded in the store.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A worker found in the discovery store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiscoveredWorker {
    /// Dynamo instance id = the router's `worker_id`.
    pub worker_id: u64,
    pub namespace: String,
    pub component: String,
    /// Serving endpoint name (`generate`).
    pub endpoint: String,
    /// Request-plane address (e.g. `127.0.0.1:43745/1d8d…/dynamo/backend/generate`).
    pub request_plane: Option<String>,
    /// DP ranks that publish KV events for this worker (from `event_sources`).
    pub dp_ranks: Vec<u32>,
    /// Dynamo event-plane ZMQ endpoints carrying this worker's `kv-events` (Dynamo's
    /// internal encoding, one per publisher). Not the vLLM-format publisher.
    pub event_plane_kv_endpoints: Vec<String>,
    /// Model served (from the model card), if present.
    pub model: Option<String>,
    /// `total_kv_blocks` from the model card's runtime config, if present.
    pub total_kv_blocks: Option<u64>,
    /// KV block size from the model card, if present.
    pub kv_cache_block_size: Option<u64>,
}

/// Errors reading the store.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("reading discovery dir {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Reads every worker serving `generate` endpoints under the store root `dir`
/// (the value of `DYN_FILE_KV`). Unreadable or foreign files are skipped. Sorted by
/// worker id.
pub fn read_workers(dir: &Path) -> Result<Vec<DiscoveredWorker>, DiscoveryError> {
    let v1 = dir.join("v1");
    let mut workers: BTreeMap<u64, DiscoveredWorker> = BTreeMap::new();

    for doc in read_docs(&v1.join("instances"))? {
        if doc.get("type").and_then(Value::as_str) != Some("Endpoint") {
            continue;
        }
        let endpoint = str_field(&doc, "endpoint");
        if endpoint != "generate" {
            continue;
        }
        let Some(worker_id) = doc.get("instance_id").and_then(Value::as_u64) else {
            continue;
        };
        workers.insert(
            worker_id,
            DiscoveredWorker {
                worker_id,
                namespace: str_field(&doc, "namespace"),
                component: str_field(&doc, "component"),
                endpoint,
                request_plane: doc
                    .pointer("/transport/tcp")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                dp_ranks: Vec::new(),
                event_plane_kv_endpoints: Vec::new(),
                model: None,
                total_kv_blocks: None,
                kv_cache_block_size: None,
            },
        );
    }

    // Event-plane channels by publisher id.
    let mut channels: BTreeMap<u64, String> = BTreeMap::new();
    for doc in read_docs(&v1.join("event_channels"))? {
        if doc.get("topic").and_then(Value::as_str) != Some("kv-events") {
            continue;
        }
        if let (Some(id), Some(ep)) = (
            doc.get("instance_id").and_then(Value::as_u64),
            doc.pointer("/transport/config/endpoint")
                .and_then(Value::as_str),
        ) {
            channels.insert(id, ep.to_string());
        }
    }
    for doc in read_docs(&v1.join("event_sources"))? {
        if doc.get("topic").and_then(Value::as_str) != Some("kv-events") {
            continue;
        }
        let Some(worker_id) = doc
            .pointer("/metadata/worker/worker_id")
            .and_then(Value::as_u64)
        else {
            continue;
        };
        let Some(w) = workers.get_mut(&worker_id) else {
            continue;
        };
        if let Some(rank) = doc
            .pointer("/metadata/worker/dp_rank")
            .and_then(Value::as_u64)
        {
            let rank = rank as u32;
            if !w.dp_ranks.contains(&rank) {
                w.dp_ranks.push(rank);
                w.dp_ranks.sort_unstable();
            }
        }
        if let Some(ep) = doc
            .get("publisher_id")
            .and_then(Value::as_u64)
            .and_then(|p| channels.get(&p))
        {
            w.event_plane_kv_endpoints.push(ep.clone());
        }
    }
    for doc in read_docs(&v1.join("mdc"))? {
        let Some(worker_id) = doc.get("instance_id").and_then(Value::as_u64) else {
            continue;
        };
        let Some(w) = workers.get_mut(&worker_id) else {
            continue;
        };
        w.model = doc
            .pointer("/card_json/display_name")
            .and_then(Value::as_str)
            .map(str::to_string);
        w.total_kv_blocks = doc
            .pointer("/card_json/runtime_config/total_kv_blocks")
            .and_then(Value::as_u64);
        w.kv_cache_block_size = doc
            .pointer("/card_json/kv_cache_block_size")
            .and_then(Value::as_u64);
    }
    Ok(workers.into_values().collect())
}

fn str_field(doc: &Value, key: &str) -> String {
    doc.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

/// All JSON documents directly in `dir` (missing dir = none).
/// Every event-plane channel in the store under `dir` with a ZMQ endpoint, as
/// (topic, endpoint): the PUB sockets Dynamo's workers and frontends bind.
pub fn zmq_event_channels(dir: &Path) -> Result<Vec<(String, String)>, DiscoveryError> {
    Ok(read_docs(&dir.join("v1").join("event_channels"))?
        .iter()
        .filter_map(|doc| {
            Some((
                str_field(doc, "topic"),
                doc.pointer("/transport/config/endpoint")?
                    .as_str()?
                    .to_string(),
            ))
        })
        .collect())
}

fn read_docs(dir: &Path) -> Result<Vec<Value>, DiscoveryError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(DiscoveryError::Io {
                path: dir.display().to_string(),
                source,
            })
        }
    };
    let mut docs = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if !path.is_file() {
            continue;
        }
        // Files can be mid-write; a half-written one is skipped and seen next time.
        if let Ok(text) = std::fs::read_to_string(&path) {
            if let Ok(v) = serde_json::from_str::<Value>(&text) {
                docs.push(v);
            }
        }
    }
    Ok(docs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_committed_sample_store() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/samples/discovery");
        let workers = read_workers(&dir).unwrap();
        assert!(!workers.is_empty(), "sample store has workers");
        for w in &workers {
            assert_eq!(w.endpoint, "generate");
            assert_eq!(w.dp_ranks, vec![0]);
            assert_eq!(w.event_plane_kv_endpoints.len(), 1);
            assert_eq!(w.kv_cache_block_size, Some(16));
        }
    }

    #[test]
    fn missing_dir_is_empty() {
        let workers = read_workers(Path::new("/nonexistent/kvscope")).unwrap();
        assert!(workers.is_empty());
    }
}
