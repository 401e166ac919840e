//! Reading the store's entries from where Dynamo keeps them.
//!
//! - **file** (`DYN_FILE_KV`): one JSON document per file, the file name the URL-encoded
//!   key inside its bucket folder (`v1/instances/dynamo%2Fbackend%2Fgenerate%2F<hex>`).
//! - **etcd** (`ETCD_ENDPOINTS`): every key under `v1/`, read through etcd's v3 JSON
//!   gateway (`POST /v3/kv/range`, keys and values base64), which every etcd since 3.4
//!   serves on its client port; with `ETCD_AUTH_USERNAME`/`ETCD_AUTH_PASSWORD`, a token
//!   from `/v3/auth/authenticate` first. Endpoints are tried in order. `https://`
//!   endpoints are read over TLS trusting `ETCD_AUTH_CA`, presenting
//!   `ETCD_AUTH_CLIENT_CERT`/`ETCD_AUTH_CLIENT_KEY` when given (mutual TLS), as
//!   Dynamo's etcd client does.
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
        /// For `https://` endpoints.
        tls: Option<EtcdTls>,
    },
    /// Dynamo's `kubernetes` backend: see [`crate::kubernetes`].
    Kubernetes(crate::kubernetes::KubeApi),
}

/// etcd's TLS: the CA to trust and, for mutual TLS, the client's certificate and key
/// (PEM files; `ETCD_AUTH_CA`, `ETCD_AUTH_CLIENT_CERT`, `ETCD_AUTH_CLIENT_KEY`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca: PathBuf,
    pub client: Option<(PathBuf, PathBuf)>,
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

/// The largest entry of a file store read: Dynamo writes entries of a few KB (a model
/// card with its chat template is the largest); a larger file is no entry Dynamo wrote,
/// and reading it every poll would hold its whole size in memory.
pub(crate) const MAX_ENTRY_BYTES: u64 = 4 << 20;

/// An entry of the store left unread, and why (counted by the reader's owner).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedEntry {
    pub path: String,
    pub reason: String,
}

/// One read of the store: its entries, as (key with its bucket, document), and what
/// was skipped.
#[derive(Debug, Clone, Default)]
pub struct StoreRead {
    pub entries: Vec<(String, Value)>,
    pub skipped: Vec<SkippedEntry>,
}

impl Backend {
    /// Every entry under `v1/`, as (key with its bucket, document), and what was skipped.
    pub async fn read(&self, http: &reqwest::Client) -> Result<StoreRead, DiscoveryError> {
        match self {
            Backend::File { root } => {
                let root = root.clone();
                tokio::task::spawn_blocking(move || read_file_store_all(&root))
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
                tls,
            } => {
                let mut errors = Vec::new();
                for ep in endpoints {
                    let etcd = Etcd::new(http, ep, tls.as_ref());
                    match read_etcd(etcd, username.as_deref(), password.as_deref()).await {
                        Ok(entries) => {
                            return Ok(StoreRead {
                                entries,
                                skipped: Vec::new(),
                            })
                        }
                        Err(e) => errors.push(e.to_string()),
                    }
                }
                Err(DiscoveryError::NoEtcd(errors.join("; ")))
            }
            Backend::Kubernetes(k) => Ok(StoreRead {
                entries: k.read().await?,
                skipped: Vec::new(),
            }),
        }
    }
}

/// The file backend's store under `root` (the folder `DYN_FILE_KV` names): its entries.
pub fn read_file_store(root: &Path) -> Result<Vec<(String, Value)>, DiscoveryError> {
    read_file_store_all(root).map(|r| r.entries)
}

/// The file backend's store under `root`, and the files skipped: anything but a
/// regular file (a FIFO would block the read for good, a device never end) and files
/// over [`MAX_ENTRY_BYTES`].
pub(crate) fn read_file_store_all(root: &Path) -> Result<StoreRead, DiscoveryError> {
    let v1 = root.join("v1");
    let buckets = match std::fs::read_dir(&v1) {
        Ok(b) => b,
        // No worker has registered yet.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(StoreRead::default()),
        Err(source) => {
            return Err(DiscoveryError::Io {
                path: v1.display().to_string(),
                source,
            })
        }
    };
    let mut out = StoreRead::default();
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
            let path = f.path();
            let skip = |reason: String| SkippedEntry {
                path: path.display().to_string(),
                reason,
            };
            // Files can be mid-write or just removed; such a file is read next time.
            let Ok(meta) = std::fs::metadata(&path) else {
                continue;
            };
            if !meta.is_file() {
                out.skipped.push(skip("not a regular file".into()));
                continue;
            }
            if meta.len() > MAX_ENTRY_BYTES {
                out.skipped.push(skip(format!(
                    "{} bytes, over the {MAX_ENTRY_BYTES}-byte limit of an entry",
                    meta.len()
                )));
                continue;
            }
            let Ok(text) = read_regular_at_most(&path, MAX_ENTRY_BYTES) else {
                continue;
            };
            if let Ok(doc) = serde_json::from_str::<Value>(&text) {
                out.entries.push((format!("v1/{bucket_name}/{name}"), doc));
            }
        }
    }
    out.entries.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// A regular file's text, read to `limit` bytes at most (it may have been swapped for a
/// FIFO since it was looked at: refused without blocking).
fn read_regular_at_most(path: &Path, limit: u64) -> std::io::Result<String> {
    use std::io::Read;
    let (f, _) = kvscope_kit::files::open_regular(path)?;
    let mut text = String::new();
    f.take(limit).read_to_string(&mut text)?;
    Ok(text)
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

/// One etcd endpoint and how to reach it: plain HTTP through `reqwest`, or HTTPS.
struct Etcd<'a> {
    http: &'a reqwest::Client,
    endpoint: &'a str,
    base: String,
    tls: Result<Option<kvscope_kit::https::TlsClient>, String>,
}

impl<'a> Etcd<'a> {
    fn new(http: &'a reqwest::Client, endpoint: &'a str, tls: Option<&EtcdTls>) -> Self {
        let base = if endpoint.contains("://") {
            endpoint.trim_end_matches('/').to_string()
        } else {
            format!("http://{}", endpoint.trim_end_matches('/'))
        };
        let tls = if base.starts_with("https://") {
            match tls {
                Some(t) => kvscope_kit::https::TlsClient::new(
                    &t.ca,
                    t.client.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
                )
                .map(Some),
                None => Err("an https endpoint needs the CA to trust: ETCD_AUTH_CA (and ETCD_AUTH_CLIENT_CERT, ETCD_AUTH_CLIENT_KEY for mutual TLS)".into()),
            }
        } else {
            Ok(None)
        };
        Self {
            http,
            endpoint,
            base,
            tls,
        }
    }

    fn err(&self, message: String) -> DiscoveryError {
        DiscoveryError::Etcd {
            endpoint: self.endpoint.to_string(),
            message,
        }
    }

    /// POST `body` to `path`; the answer's JSON.
    async fn post(&self, path: &str, body: &Value, token: Option<&str>) -> Result<Value, String> {
        let url = format!("{}{path}", self.base);
        match &self.tls {
            Err(e) => Err(e.clone()),
            Ok(None) => {
                let mut req = self.http.post(&url).json(body).timeout(ETCD_TIMEOUT);
                if let Some(t) = token {
                    req = req.header("Authorization", t);
                }
                req.send()
                    .await
                    .and_then(|r| r.error_for_status())
                    .map_err(|e| e.to_string())?
                    .json()
                    .await
                    .map_err(|e| format!("not JSON: {e}"))
            }
            Ok(Some(tls)) => {
                let mut headers = vec![("content-type", "application/json")];
                if let Some(t) = token {
                    headers.push(("authorization", t));
                }
                let a = tls
                    .request(
                        "POST",
                        &url,
                        &headers,
                        Some(body.to_string().into_bytes()),
                        ETCD_TIMEOUT,
                    )
                    .await?;
                if !(200..300).contains(&a.status) {
                    return Err(format!(
                        "{path}: {}: {}",
                        a.status,
                        String::from_utf8_lossy(&a.body)
                            .chars()
                            .take(300)
                            .collect::<String>()
                    ));
                }
                serde_json::from_slice(&a.body).map_err(|e| format!("not JSON: {e}"))
            }
        }
    }
}

async fn read_etcd(
    etcd: Etcd<'_>,
    username: Option<&str>,
    password: Option<&str>,
) -> Result<Vec<(String, Value)>, DiscoveryError> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut token = None;
    if let Some(user) = username {
        let r = etcd
            .post(
                "/v3/auth/authenticate",
                &serde_json::json!({"name": user, "password": password.unwrap_or_default()}),
                None,
            )
            .await
            .map_err(|e| etcd.err(format!("authenticating as {user}: {e}")))?;
        token = r.get("token").and_then(Value::as_str).map(str::to_string);
    }
    // Every key from "v1/" up to (not including) "v10": the prefix "v1/".
    let r = etcd
        .post(
            "/v3/kv/range",
            &serde_json::json!({"key": b64.encode("v1/"), "range_end": b64.encode("v10")}),
            token.as_deref(),
        )
        .await
        .map_err(|e| etcd.err(e))?;
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

    #[test]
    fn a_fifo_a_folder_or_a_huge_entry_is_skipped_never_waited_on() {
        let dir = tempfile::tempdir().unwrap();
        let b = dir.path().join("v1/instances");
        std::fs::create_dir_all(b.join("a-folder")).unwrap();
        std::fs::write(b.join("ok"), "{\"type\":\"Endpoint\"}").unwrap();
        let huge = std::fs::File::create(b.join("huge")).unwrap();
        huge.set_len(MAX_ENTRY_BYTES + 1).unwrap();
        let fifo = std::process::Command::new("mkfifo")
            .arg(b.join("fifo"))
            .status()
            .is_ok_and(|s| s.success());
        // Read on another thread: a blocking read would hang this test, not fail it.
        let root = dir.path().to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(read_file_store_all(&root)));
        let read = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the read returns")
            .unwrap();
        assert_eq!(read.entries.len(), 1);
        let mut why: Vec<(String, String)> = read
            .skipped
            .iter()
            .map(|s| {
                let name = s.path.rsplit('/').next().unwrap().to_string();
                (name, s.reason.clone())
            })
            .collect();
        why.sort();
        let mut want = vec![
            ("a-folder".to_string(), "not a regular file".to_string()),
            (
                "huge".to_string(),
                format!("4194305 bytes, over the {MAX_ENTRY_BYTES}-byte limit of an entry"),
            ),
        ];
        if fifo {
            want.push(("fifo".to_string(), "not a regular file".to_string()));
        }
        want.sort();
        assert_eq!(why, want);
    }
}
