//! What the policy reads: the collector's JSON API responses (their types are the
//! contract in `kvscope_wire::api`), fetched live or read from a file saved earlier
//! (`plan --save`).

use kvscope_wire::api::summary::CollectorSummary;
use kvscope_wire::api::verdict::SpillVerdict;
use kvscope_wire::api::window::WindowSummary;
use kvscope_wire::nixl::{NixlAgentRow, NixlPair};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One consistent-enough read of the collector: four requests, close together.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CollectorView {
    pub summary: CollectorSummary,
    /// Closed windows, newest first (as `/api/windows` serves them).
    pub windows: Vec<WindowSummary>,
    /// Recent verdicts, newest first (as `/api/verdicts` serves them).
    #[serde(default)]
    pub verdicts: Vec<SpillVerdict>,
    /// Per NIXL agent pair, cumulative (as `/api/nixl` serves them).
    #[serde(default)]
    pub nixl: Vec<NixlPair>,
    /// The worker each NIXL agent belongs to, as the node agents told it (as
    /// `/api/nixl/agents` serves them): the mapping where `[[worker_agents]]` is silent.
    #[serde(default)]
    pub nixl_agents: Vec<NixlAgentRow>,
}

/// A saved read, for `plan --input`: the view and when it was taken.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct CollectorSnapshot {
    /// When the responses were fetched (UNIX ns); `plan --input` evaluates as of then.
    pub captured_ns: u64,
    #[serde(flatten)]
    pub view: CollectorView,
}

#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("collector request {url} failed: {error}")]
    Request { url: String, error: String },
    #[error("the collector is not ready ({url}): {why}")]
    NotReady { url: String, why: String },
    #[error("collector answered {status} to {url}")]
    Status {
        url: String,
        status: reqwest::StatusCode,
    },
    #[error("collector response from {url} is not what the actuator expects: {source}")]
    Decode {
        url: String,
        source: serde_json::Error,
    },
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a saved collector read: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
}

/// Reads the collector's JSON API: of a scope's collectors (their URLs separated by
/// commas: the one holding the lease and its standby), the one that says it is ready.
#[derive(Clone, Debug)]
pub struct CollectorClient {
    http: reqwest::Client,
    bases: Vec<String>,
    /// The collector last found ready, read until it is not.
    current: Arc<AtomicUsize>,
    window_limit: usize,
    verdict_limit: usize,
}

impl CollectorClient {
    pub fn new(
        base_urls: &str,
        timeout: Duration,
        window_limit: usize,
        verdict_limit: usize,
    ) -> Result<Self, reqwest::Error> {
        Ok(Self {
            http: reqwest::Client::builder().timeout(timeout).build()?,
            bases: collector_urls(base_urls),
            current: Arc::default(),
            window_limit,
            verdict_limit,
        })
    }

    fn base(&self) -> &str {
        let i = self.current.load(Ordering::Relaxed);
        self.bases.get(i).map_or("", String::as_str)
    }

    /// GET `path` of the collector read now: the URL asked and the response, whatever
    /// its status.
    async fn send(&self, path: &str) -> Result<(String, reqwest::Response), InputError> {
        self.send_to(self.base(), path).await
    }

    async fn send_to(
        &self,
        base: &str,
        path: &str,
    ) -> Result<(String, reqwest::Response), InputError> {
        let url = format!("{base}{path}");
        match self.http.get(&url).send().await {
            Ok(resp) => Ok((url, resp)),
            Err(e) => Err(InputError::Request {
                error: error_chain(&e),
                url,
            }),
        }
    }

    async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, InputError> {
        let (url, resp) = self.send(path).await?;
        if !resp.status().is_success() {
            return Err(InputError::Status {
                url,
                status: resp.status(),
            });
        }
        let bytes = resp.bytes().await.map_err(|e| InputError::Request {
            url: url.clone(),
            error: error_chain(&e),
        })?;
        serde_json::from_slice(&bytes).map_err(|source| InputError::Decode { url, source })
    }

    /// Whether the collector serves figures it has caught up on (`/readyz`): one that is
    /// rebuilding its state from the stream (after a restart), not consuming it, or not
    /// applying what waits for it answers 503 and says why. Its figures are then not the
    /// fleet's now, and acting on them would act on stale data.
    ///
    /// Of several collectors, the one read last is asked first, then the others in
    /// order; the first ready is read from then on. None ready: the error of the one
    /// read last (a standby says who serves).
    pub async fn ready(&self) -> Result<(), InputError> {
        let first = self.current.load(Ordering::Relaxed);
        let mut error = None;
        for i in (0..self.bases.len()).map(|k| (first + k) % self.bases.len()) {
            match self.ready_at(&self.bases[i]).await {
                Ok(()) => {
                    self.current.store(i, Ordering::Relaxed);
                    return Ok(());
                }
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        Err(error.unwrap_or(InputError::Request {
            url: String::new(),
            error: "no collector URL".into(),
        }))
    }

    async fn ready_at(&self, base: &str) -> Result<(), InputError> {
        let (url, resp) = self.send_to(base, "/readyz").await?;
        let status = resp.status();
        if status == reqwest::StatusCode::SERVICE_UNAVAILABLE {
            let body = resp.text().await.unwrap_or_default();
            // The failing checks (`check: why`, under a `not ready` line), on one line,
            // bounded.
            let mut why: String = body
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && *l != "not ready")
                .collect::<Vec<_>>()
                .join("; ");
            if why.len() > 300 {
                let cut = (0..=300)
                    .rev()
                    .find(|i| why.is_char_boundary(*i))
                    .unwrap_or(0);
                why.truncate(cut);
            }
            return Err(InputError::NotReady { url, why });
        }
        if !status.is_success() {
            return Err(InputError::Status { url, status });
        }
        Ok(())
    }

    /// Fetch summary, windows, verdicts, NIXL pairs and NIXL agents' workers.
    pub async fn fetch(&self) -> Result<CollectorView, InputError> {
        let summary = self.get("/api/summary").await?;
        let windows = self
            .get(&format!("/api/windows?limit={}", self.window_limit))
            .await?;
        let verdicts = self
            .get(&format!("/api/verdicts?limit={}", self.verdict_limit))
            .await?;
        let nixl = self.get("/api/nixl").await?;
        let nixl_agents = self.get("/api/nixl/agents").await?;
        Ok(CollectorView {
            summary,
            windows,
            verdicts,
            nixl,
            nixl_agents,
        })
    }
}

/// The collector URLs of `collector_url`: one, or a scope's collectors separated by
/// commas, each without its trailing slash.
pub fn collector_urls(urls: &str) -> Vec<String> {
    urls.split(',')
        .map(|u| u.trim().trim_end_matches('/').to_string())
        .filter(|u| !u.is_empty())
        .collect()
}

/// An error and its causes on one line, without repeats (reqwest nests the same text).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts: Vec<String> = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        cur = s.source();
    }
    parts.join(": ")
}

impl CollectorSnapshot {
    pub fn read(path: &Path) -> Result<Self, InputError> {
        let text = std::fs::read(path).map_err(|source| InputError::Read {
            path: path.display().to_string(),
            source,
        })?;
        serde_json::from_slice(&text).map_err(|source| InputError::Parse {
            path: path.display().to_string(),
            source,
        })
    }
}
