//! kvscope's own processes in a harness (the end-to-end tests, the demo, the freshness
//! bench): its collector and agent as children of the harness, so it can kill and
//! restart them, and the collector's HTTP API read while they run. What each harness
//! passes them (the lab's discovery, a bench's config files) stays its own.

use crate::process::{stop_all, ManagedProcess};
use anyhow::bail;
use serde_json::Value;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

/// A collector and an agent, each started when the harness is ready for it; stopped on
/// drop (collector first) if the harness did not stop them.
#[derive(Debug, Default)]
pub struct Daemons {
    pub collector: Option<ManagedProcess>,
    /// A second collector of the same scope, standing by (its lease, `kvscope_collector::lease`).
    pub standby: Option<ManagedProcess>,
    pub agent: Option<ManagedProcess>,
}

impl Daemons {
    /// The first of them that has exited: its name, status and log.
    pub fn exited(&mut self) -> Option<(String, ExitStatus, PathBuf)> {
        self.collector
            .iter_mut()
            .chain(self.standby.iter_mut())
            .chain(self.agent.iter_mut())
            .find_map(|p| p.exited().map(|s| (p.name.clone(), s, p.log.clone())))
    }

    /// Stop the agent (SIGTERM, then SIGKILL after `grace`).
    pub fn stop_agent(&mut self, grace: Duration) {
        if let Some(p) = self.agent.take() {
            stop_all(&mut [p], grace);
        }
    }

    /// Kill the collector without warning (SIGKILL), as a crash would.
    pub fn kill_collector(&mut self) {
        if let Some(mut p) = self.collector.take() {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
    }

    /// Stop them all, the collectors first (they flush their recordings), each given
    /// `grace` after SIGTERM.
    pub fn stop(&mut self, grace: Duration) {
        let mut procs: Vec<ManagedProcess> = self
            .collector
            .take()
            .into_iter()
            .chain(self.standby.take())
            .chain(self.agent.take())
            .collect();
        stop_all(&mut procs, grace);
    }

    /// (name, pid) of each running one.
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.collector
            .iter()
            .chain(&self.standby)
            .chain(&self.agent)
            .map(|p| (p.name.clone(), p.pid()))
            .collect()
    }
}

impl Drop for Daemons {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(2));
    }
}

/// The collector's read-only HTTP API, as a harness reads it.
#[derive(Debug, Clone)]
pub struct CollectorApi {
    base: String,
    http: reqwest::Client,
}

impl CollectorApi {
    /// The API of a collector listening on `listen` (`host:port`).
    pub fn new(listen: &str) -> Self {
        Self {
            base: format!("http://{listen}"),
            http: reqwest::Client::new(),
        }
    }

    /// `http://host:port`.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// GET a JSON document (`/api/summary`, `/api/report`, …).
    pub async fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        Ok(self.get(path).await?.json().await?)
    }

    /// GET a text document (`/metrics`, the report's Markdown).
    pub async fn get_text(&self, path: &str) -> anyhow::Result<String> {
        Ok(self.get(path).await?.text().await?)
    }

    /// GET `path`; an error status is an error.
    async fn get(&self, path: &str) -> anyhow::Result<reqwest::Response> {
        Ok(self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await?
            .error_for_status()?)
    }

    pub async fn summary(&self) -> anyhow::Result<Value> {
        self.get_json("/api/summary").await
    }

    /// Poll the summary until `ready` holds, for at most `timeout`; on time-out the
    /// error says what was waited for, then `hint` (where to look: a log).
    pub async fn wait_summary(
        &self,
        what: &str,
        timeout: Duration,
        hint: &str,
        ready: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(s) = self.summary().await {
                if ready(&s) {
                    return Ok(s);
                }
            }
            if Instant::now() > deadline {
                bail!("waited {timeout:?} for {what}; {hint}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
