//! Dynamo's `kubernetes` discovery backend, read from the API server.
//!
//! There each worker pod's registrations are one `DynamoWorkerMetadata` object
//! (`nvidia.com/v1alpha1`, plural `dynamoworkermetadatas`, in the worker's namespace,
//! named after its pod, owned by it). Its `spec.data` holds the documents the file and
//! etcd backends keep under `v1/`, as maps from key to document:
//!
//! | `spec.data` map | bucket |
//! |---|---|
//! | `endpoints` | `v1/instances` |
//! | `model_cards` | `v1/mdc` |
//! | `event_channels` | `v1/event_channels` |
//! | `event_sources` | `v1/event_sources` |
//!
//! A worker counts only while its pod is ready: Dynamo reads readiness from the
//! EndpointSlices labelled `nvidia.com/dynamo-discovery-enabled=true` (an endpoint with
//! `conditions.ready` and a `targetRef` naming the pod). So a read is two lists, both in
//! one namespace, and the objects of pods that are not ready are left out:
//!
//! - `GET /apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices?labelSelector=…`
//! - `GET /apis/nvidia.com/v1alpha1/namespaces/<ns>/dynamoworkermetadatas`
//!
//! In a pod, the API server, its CA and the token are the service account's
//! (`KUBERNETES_SERVICE_HOST`/`_PORT`, `/var/run/secrets/kubernetes.io/serviceaccount/`);
//! the namespace is `POD_NAMESPACE`, else Dynamo's `/etc/podinfo/pod_namespace`, else
//! the service account's. The token is read again on every poll (projected tokens
//! rotate). Read-only RBAC: `get`, `list` on those two resources.

use crate::backend::DiscoveryError;
use kvscope_kit::https::TlsClient;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where the service account's files are in a pod.
pub(crate) const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The label Dynamo's operator puts on the Services (and so the EndpointSlices) of
/// workers that use Kubernetes discovery.
pub(crate) const DISCOVERY_LABEL: &str = "nvidia.com/dynamo-discovery-enabled=true";

/// An API server to read, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeApi {
    /// `https://host:port`.
    pub server: String,
    pub namespace: String,
    pub token_file: PathBuf,
    pub ca_file: PathBuf,
}

const TIMEOUT: Duration = Duration::from_secs(10);

impl KubeApi {
    fn err(&self, message: impl Into<String>) -> DiscoveryError {
        DiscoveryError::Kubernetes {
            server: self.server.clone(),
            message: message.into(),
        }
    }

    async fn get(&self, tls: &TlsClient, token: &str, path: &str) -> Result<Value, DiscoveryError> {
        let url = format!("{}{path}", self.server.trim_end_matches('/'));
        let auth = format!("Bearer {token}");
        let answer = tls
            .request(
                "GET",
                &url,
                &[("authorization", &auth), ("accept", "application/json")],
                None,
                TIMEOUT,
            )
            .await
            .map_err(|e| self.err(format!("GET {path}: {e}")))?;
        if !(200..300).contains(&answer.status) {
            let hint = match answer.status {
                401 => " (the service account token was refused)",
                403 => " (RBAC: the service account needs get and list on dynamoworkermetadatas.nvidia.com and endpointslices.discovery.k8s.io)",
                404 => " (is Dynamo's DynamoWorkerMetadata CRD installed?)",
                _ => "",
            };
            return Err(self.err(format!(
                "GET {path}: {}{hint}: {}",
                answer.status,
                String::from_utf8_lossy(&answer.body)
                    .chars()
                    .take(300)
                    .collect::<String>()
            )));
        }
        serde_json::from_slice(&answer.body)
            .map_err(|e| self.err(format!("GET {path}: not JSON: {e}")))
    }

    /// Every ready worker's entries, keyed as the file and etcd backends key them.
    pub async fn read(&self) -> Result<Vec<(String, Value)>, DiscoveryError> {
        let token = std::fs::read_to_string(&self.token_file).map_err(|e| {
            self.err(format!(
                "reading the token {}: {e}",
                self.token_file.display()
            ))
        })?;
        let tls = TlsClient::new(&self.ca_file, None).map_err(|e| self.err(e))?;
        let ns = &self.namespace;
        let slices = self
            .get(
                &tls,
                token.trim(),
                &format!(
                    "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector={}",
                    DISCOVERY_LABEL.replace('/', "%2F").replace('=', "%3D")
                ),
            )
            .await?;
        let objects = self
            .get(
                &tls,
                token.trim(),
                &format!("/apis/nvidia.com/v1alpha1/namespaces/{ns}/dynamoworkermetadatas"),
            )
            .await?;
        Ok(entries(&ready_pods(&slices), &objects))
    }
}

/// The pods an EndpointSlice list names as ready endpoints.
pub(crate) fn ready_pods(slices: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for slice in items(slices) {
        for ep in slice
            .get("endpoints")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            // Kubernetes: a missing `ready` is to be read as ready.
            let ready = ep
                .pointer("/conditions/ready")
                .and_then(Value::as_bool)
                .unwrap_or(true);
            let pod = ep
                .get("targetRef")
                .filter(|t| t.get("kind").and_then(Value::as_str).unwrap_or("Pod") == "Pod")
                .and_then(|t| t.get("name"))
                .and_then(Value::as_str);
            if let (true, Some(pod)) = (ready, pod) {
                out.insert(pod.to_string());
            }
        }
    }
    out
}

fn items(list: &Value) -> impl Iterator<Item = &Value> {
    list.get("items")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

/// The pod a `DynamoWorkerMetadata` belongs to: its owner, else its name.
fn owner_pod(object: &Value) -> Option<&str> {
    object
        .pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|o| o.get("kind").and_then(Value::as_str) == Some("Pod"))
        .and_then(|o| o.get("name"))
        .or_else(|| object.pointer("/metadata/name"))
        .and_then(Value::as_str)
}

/// The entries of the objects whose pods are ready.
pub fn entries(ready: &BTreeSet<String>, objects: &Value) -> Vec<(String, Value)> {
    const BUCKETS: [(&str, &str); 4] = [
        ("endpoints", "v1/instances"),
        ("model_cards", "v1/mdc"),
        ("event_channels", "v1/event_channels"),
        ("event_sources", "v1/event_sources"),
    ];
    let mut out = Vec::new();
    for object in items(objects) {
        if !owner_pod(object).is_some_and(|p| ready.contains(p)) {
            continue;
        }
        let Some(data) = object.pointer("/spec/data") else {
            continue;
        };
        for (map, bucket) in BUCKETS {
            // A map can come back as null after a server-side apply: no entries.
            let Some(docs) = data.get(map).and_then(Value::as_object) else {
                continue;
            };
            for (key, doc) in docs {
                out.push((format!("{bucket}/{key}"), doc.clone()));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The namespace to read when none is configured: `POD_NAMESPACE`, Dynamo's podinfo
/// file, the service account's.
pub(crate) fn default_namespace(var: impl Fn(&str) -> Option<String>) -> Option<String> {
    var("POD_NAMESPACE")
        .filter(|v| !v.trim().is_empty())
        .or_else(|| read_trimmed(Path::new("/etc/podinfo/pod_namespace")))
        .or_else(|| read_trimmed(&Path::new(SERVICE_ACCOUNT_DIR).join("namespace")))
}

/// The in-cluster API server: `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`.
pub(crate) fn in_cluster_server(var: impl Fn(&str) -> Option<String>) -> Option<String> {
    let host = var("KUBERNETES_SERVICE_HOST").filter(|v| !v.is_empty())?;
    let port = var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|| "443".into());
    // An IPv6 service address needs brackets in a URL.
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    Some(format!("https://{host}:{port}"))
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn dwm(name: &str, owner: Option<&str>, data: Value) -> Value {
        let mut meta = json!({"name": name, "namespace": "dynamo"});
        if let Some(o) = owner {
            meta["ownerReferences"] =
                json!([{"apiVersion": "v1", "kind": "Pod", "name": o, "uid": "u"}]);
        }
        json!({"apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoWorkerMetadata", "metadata": meta, "spec": {"data": data}})
    }

    #[test]
    fn only_ready_pods_count_and_the_maps_become_the_stores_buckets() {
        let slices = json!({"items": [{"endpoints": [
            {"conditions": {"ready": true}, "targetRef": {"kind": "Pod", "name": "worker-a"}},
            {"conditions": {"ready": false}, "targetRef": {"kind": "Pod", "name": "worker-b"}},
            {"targetRef": {"kind": "Pod", "name": "worker-c"}},
            {"conditions": {"ready": true}}
        ]}]});
        let ready = ready_pods(&slices);
        assert_eq!(
            ready.iter().map(String::as_str).collect::<Vec<_>>(),
            vec!["worker-a", "worker-c"]
        );
        let objects = json!({"items": [
            dwm("worker-a", Some("worker-a"), json!({
                "endpoints": {"dynamo/backend/generate/2a": {"type": "Endpoint", "instance_id": 42}},
                "model_cards": {"dynamo/backend/generate/2a": {"type": "Model", "instance_id": 42}},
                "event_channels": null,
            })),
            dwm("worker-b", None, json!({"endpoints": {"x/y/z/1": {"type": "Endpoint"}}})),
            // Container mode: named pod-container, owned by the pod.
            dwm("worker-c-main", Some("worker-c"), json!({
                "event_channels": {"namespace/dynamo/component/backend/topic/kv-events/9": {"type": "EventChannel"}}
            })),
        ]});
        let keys: Vec<String> = entries(&ready, &objects)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(
            keys,
            vec![
                "v1/event_channels/namespace/dynamo/component/backend/topic/kv-events/9",
                "v1/instances/dynamo/backend/generate/2a",
                "v1/mdc/dynamo/backend/generate/2a",
            ]
        );
    }

    #[test]
    fn the_in_cluster_server_and_namespace_come_from_the_pods_environment() {
        let env = |k: &str| match k {
            "KUBERNETES_SERVICE_HOST" => Some("10.96.0.1".to_string()),
            "KUBERNETES_SERVICE_PORT" => Some("443".to_string()),
            "POD_NAMESPACE" => Some("dynamo".to_string()),
            _ => None,
        };
        assert_eq!(
            in_cluster_server(env).as_deref(),
            Some("https://10.96.0.1:443")
        );
        assert_eq!(default_namespace(env).as_deref(), Some("dynamo"));
        let v6 = |k: &str| (k == "KUBERNETES_SERVICE_HOST").then(|| "fd00::1".to_string());
        assert_eq!(
            in_cluster_server(v6).as_deref(),
            Some("https://[fd00::1]:443")
        );
        assert_eq!(in_cluster_server(|_| None), None);
    }
}
