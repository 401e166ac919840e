//! Reading the store's entries from where Dynamo keeps them.
//!
//! - **file** (`DYN_FILE_KV`): one JSON document per file, the file name the URL-encoded
//!   key inside its bucket folder (`v1/instances/dynamo%2Fbackend%2Fgenerate%2F<hex>`).
//! - **etcd** (`ETCD_ENDPOINTS`): every key under `v1/`, read through etcd's v3 JSON
//!   gateway (`POST /v3/kv/range`, keys and values base64), which every etcd since 3.4
//!   serves on its client port; with `ETCD_AUTH_USERNAME`/`ETCD_AUTH_PASSWORD`, a token
//!   from `/v3/auth/authenticate` first. Endpoints are tried in order. `https://`
//!   endpoints need TLS, which this build does not have: such an endpoint is an error
//!   that says so.
//!
//! - **kubernetes** (in a pod): each ready worker pod's `DynamoWorkerMetadata` object,
//!   from the API server ([`crate::kubernetes`]).
//!
//! All are read whole on every poll ([`crate::config::DiscoveryConfig::poll_interval_secs`]);
//! a fleet's store is a few entries per worker. A document that is not JSON (a file
//! caught mid-write, say) is skipped and read at the next poll.

use base64::Engine as _;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why the store could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("reading the discovery folder {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("etcd at {endpoint}: {message}")]
    Etcd { endpoint: String, message: String },
    #[error("no etcd endpoint answered: {0}")]
    NoEtcd(String),
    #[error("Kubernetes API server {server}: {message}")]
    Kubernetes { server: String, message: String },
}

/// A store to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    File {
        root: PathBuf,
    },
    Etcd {
        endpoints: Vec<String>,
        username: Option<String>,
        password: Option<String>,
    },
    /// Dynamo's `kubernetes` backend: see [`crate::kubernetes`].
    Kubernetes(crate::kubernetes::KubeApi),
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::File { root } => write!(f, "file:{}", root.display()),
            Backend::Etcd { endpoints, .. } => write!(f, "etcd:{}", endpoints.join(",")),
            Backend::Kubernetes(k) => write!(f, "kubernetes:{}/{}", k.server, k.namespace),
        }
    }
}

impl Backend {
    /// Every entry under `v1/`, as (key with its bucket, document).
    pub async fn read(
        &self,
        http: &reqwest::Client,
    ) -> Result<Vec<(String, Value)>, DiscoveryError> {
        match self {
            Backend::File { root } => {
                let root = root.clone();
                tokio::task::spawn_blocking(move || read_file_store(&root))
                    .await
                    .map_err(|e| DiscoveryError::Io {
                        path: "(the reading task)".into(),
                        source: std::io::Error::other(e.to_string()),
                    })?
            }
            Backend::Etcd {
                endpoints,
                username,
                password,
            } => {
                let mut errors = Vec::new();
                for ep in endpoints {
                    match read_etcd(http, ep, username.as_deref(), password.as_deref()).await {
                        Ok(entries) => return Ok(entries),
                        Err(e) => errors.push(e.to_string()),
                    }
                }
                Err(DiscoveryError::NoEtcd(errors.join("; ")))
            }
            Backend::Kubernetes(k) => k.read().await,
        }
    }
}

/// The file backend's store under `root` (the folder `DYN_FILE_KV` names).
pub fn read_file_store(root: &Path) -> Result<Vec<(String, Value)>, DiscoveryError> {
    let v1 = root.join("v1");
    let buckets = match std::fs::read_dir(&v1) {
        Ok(b) => b,
        // No worker has registered yet.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(DiscoveryError::Io {
                path: v1.display().to_string(),
                source,
            })
        }
    };
    let mut out = Vec::new();
    for bucket in buckets.flatten() {
        let Some(bucket_name) = bucket.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let Ok(files) = std::fs::read_dir(bucket.path()) else {
            continue;
        };
        for f in files.flatten() {
            let Some(name) = f.file_name().to_str().map(percent_decode) else {
                continue;
            };
            // Files can be mid-write or just removed; such a file is read next time.
            let Ok(text) = std::fs::read_to_string(f.path()) else {
                continue;
            };
            if let Ok(doc) = serde_json::from_str::<Value>(&text) {
                out.push((format!("v1/{bucket_name}/{name}"), doc));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// `%2F` → `/` and the like; anything that is not a valid escape is kept as is.
fn percent_decode(s: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16);
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

const ETCD_TIMEOUT: Duration = Duration::from_secs(5);

async fn read_etcd(
    http: &reqwest::Client,
    endpoint: &str,
    username: Option<&str>,
    password: Option<&str>,
) -> Result<Vec<(String, Value)>, DiscoveryError> {
    let err = |message: String| DiscoveryError::Etcd {
        endpoint: endpoint.to_string(),
        message,
    };
    if endpoint.starts_with("https://") {
        return Err(err(
            "https endpoints need TLS, which this build of kvscope does not have; reach etcd over http on a trusted network or a local proxy".into(),
        ));
    }
    let base = if endpoint.contains("://") {
        endpoint.trim_end_matches('/').to_string()
    } else {
        format!("http://{}", endpoint.trim_end_matches('/'))
    };
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut token = None;
    if let Some(user) = username {
        let r: Value = http
            .post(format!("{base}/v3/auth/authenticate"))
            .json(&serde_json::json!({"name": user, "password": password.unwrap_or_default()}))
            .timeout(ETCD_TIMEOUT)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| err(format!("authenticating as {user}: {e}")))?
            .json()
            .await
            .map_err(|e| err(format!("authenticating as {user}: {e}")))?;
        token = r.get("token").and_then(Value::as_str).map(str::to_string);
    }
    // Every key from "v1/" up to (not including) "v10": the prefix "v1/".
    let mut req = http
        .post(format!("{base}/v3/kv/range"))
        .json(&serde_json::json!({"key": b64.encode("v1/"), "range_end": b64.encode("v10")}))
        .timeout(ETCD_TIMEOUT);
    if let Some(t) = &token {
        req = req.header("Authorization", t);
    }
    let r: Value = req
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|e| err(e.to_string()))?
        .json()
        .await
        .map_err(|e| err(format!("not a range answer: {e}")))?;
    let mut out = Vec::new();
    for kv in r.get("kvs").and_then(Value::as_array).into_iter().flatten() {
        let decode = |field: &str| {
            kv.get(field)
                .and_then(Value::as_str)
                .and_then(|s| b64.decode(s).ok())
        };
        let (Some(key), Some(value)) = (decode("key"), decode("value")) else {
            continue;
        };
        let Ok(key) = String::from_utf8(key) else {
            continue;
        };
        if let Ok(doc) = serde_json::from_slice::<Value>(&value) {
            out.push((key, doc));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_decode_to_keys() {
        assert_eq!(
            percent_decode("dynamo%2Fbackend%2Fworker%5Fkv%5Fquery%2Dx%2F1a"),
            "dynamo/backend/worker_kv_query-x/1a"
        );
        assert_eq!(percent_decode("a%zzb%2"), "a%zzb%2", "bad escapes stay");
        assert_eq!(percent_decode("%41"), "A");
    }

    #[test]
    fn a_missing_store_is_an_empty_one_and_garbage_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read_file_store(dir.path()).unwrap().is_empty());
        let b = dir.path().join("v1/instances");
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(b.join("x%2Fy"), "{\"type\":\"Endpoint\"}").unwrap();
        std::fs::write(b.join("half"), "{\"type\":").unwrap();
        let entries = read_file_store(dir.path()).unwrap();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].0, "v1/instances/x/y");
    }
}
