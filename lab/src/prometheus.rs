//! Debian's Prometheus 2.42 (`/usr/bin/prometheus`, `/usr/bin/promtool`): a server on
//! loopback with its own storage folder, scraping the targets a test names, and its
//! HTTP query API. The one way tests run a real Prometheus and promtool.

use crate::process::{stop_all, ManagedProcess};
use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// `/usr/bin/<name>` from Debian's `prometheus` package, or an error that says how to
/// get it.
pub fn binary(name: &str) -> Result<PathBuf> {
    let path = Path::new("/usr/bin").join(name);
    if path.is_file() {
        Ok(path)
    } else {
        bail!(
            "{} not found: install Debian's prometheus package (scripts/setup does: \
             apt-get install --no-install-recommends prometheus)",
            path.display()
        )
    }
}

/// Run `promtool` with `args` in `dir`; the combined output, or an error with it.
pub fn promtool(dir: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(binary("promtool")?)
        .args(args)
        .current_dir(dir)
        .output()
        .context("running promtool")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!(
            "promtool {} failed ({}):\n{text}",
            args.join(" "),
            out.status
        );
    }
    Ok(text)
}

/// `promtool check metrics` on an exposition text (0.0.4): Prometheus' lint of metric
/// names, types and help. The problems it lists, as an error.
pub fn check_metrics(text: &str) -> Result<()> {
    use std::io::Write as _;
    let mut child = Command::new(binary("promtool")?)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running promtool check metrics")?;
    child
        .stdin
        .take()
        .context("promtool's stdin")?
        .write_all(text.as_bytes())
        .context("writing to promtool")?;
    let out = child.wait_with_output().context("waiting for promtool")?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() || !said.trim().is_empty() {
        bail!("promtool check metrics ({}):\n{said}", out.status);
    }
    Ok(())
}

/// One scrape job: a name and its `host:port` targets.
#[derive(Debug, Clone)]
pub struct ScrapeJob {
    pub job: String,
    pub targets: Vec<String>,
}

/// A running Prometheus; dropping it stops it.
pub struct PrometheusServer {
    process: Vec<ManagedProcess>,
    url: String,
    client: reqwest::Client,
}

impl PrometheusServer {
    /// Start on a free 127.0.0.1 port with storage, config and log under `dir`, scraping
    /// `jobs` every `scrape_interval_secs`; returns once it answers `/-/ready`.
    pub async fn start(dir: &Path, jobs: &[ScrapeJob], scrape_interval_secs: u32) -> Result<Self> {
        // Held until Prometheus answers, so nothing alongside takes the port first.
        let reservation =
            crate::ports::reserve_ports(1).context("picking a port for Prometheus")?;
        let port = reservation.ports()[0];
        let storage = dir.join("prometheus-data");
        std::fs::create_dir_all(&storage).context("creating Prometheus' storage folder")?;
        let mut config = format!(
            "global:\n  scrape_interval: {scrape_interval_secs}s\n  scrape_timeout: {scrape_interval_secs}s\n  evaluation_interval: {scrape_interval_secs}s\nscrape_configs:\n"
        );
        // Every target labelled `cluster: lab`, as a fleet's scrape config or external
        // labels give it (the dashboards' `cluster` variable reads it).
        for j in jobs {
            let targets: Vec<String> = j.targets.iter().map(|t| format!("\"{t}\"")).collect();
            config.push_str(&format!(
                "  - job_name: {}\n    static_configs:\n      - targets: [{}]\n        labels: {{cluster: lab}}\n",
                j.job,
                targets.join(", ")
            ));
        }
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).context("writing prometheus.yml")?;
        let mut cmd = Command::new(binary("prometheus")?);
        cmd.arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", storage.display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--storage.tsdb.retention.time=1d")
            // Exemplars scraped from OpenMetrics are kept and served (query_exemplars).
            .arg("--enable-feature=exemplar-storage");
        let log = dir.join("prometheus.log");
        let process = ManagedProcess::spawn("prometheus", cmd, &log)?;
        let server = Self {
            process: vec![process],
            url: format!("http://127.0.0.1:{port}"),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = server
                .client
                .get(format!("{}/-/ready", server.url))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ready {
                return Ok(server);
            }
            if Instant::now() > deadline {
                bail!(
                    "Prometheus did not get ready on {} within 30 s (see {})",
                    server.url,
                    log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// The exemplars of `expr`'s series over the last `secs` seconds, through
    /// `/api/v1/query_exemplars`: the `data` array (one entry per series).
    pub async fn exemplars(&self, expr: &str, secs: u64) -> Result<Vec<Value>> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs();
        let mut url = reqwest::Url::parse(&format!("{}/api/v1/query_exemplars", self.url))?;
        url.query_pairs_mut()
            .append_pair("query", expr)
            .append_pair("start", &now.saturating_sub(secs).to_string())
            .append_pair("end", &(now + 1).to_string());
        let body: Value = self.client.get(url).send().await?.json().await?;
        anyhow::ensure!(
            body["status"] == "success",
            "query_exemplars {expr}: {body}"
        );
        Ok(body["data"].as_array().cloned().unwrap_or_default())
    }

    /// An instant query through `/api/v1/query`: the `data.result` array (empty when
    /// the expression has no data), or the error Prometheus gave.
    pub async fn query(&self, expr: &str) -> Result<Vec<Value>> {
        let mut url = reqwest::Url::parse(&format!("{}/api/v1/query", self.url))?;
        url.query_pairs_mut().append_pair("query", expr);
        let body: Value = self
            .client
            .get(url)
            .send()
            .await
            .context("querying Prometheus")?
            .json()
            .await
            .context("reading Prometheus' answer")?;
        if body["status"] != "success" {
            bail!(
                "{}: {}",
                body["errorType"].as_str().unwrap_or("error"),
                body["error"].as_str().unwrap_or("no error text")
            );
        }
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// The scrape targets' health (`/api/v1/targets`): (job, instance, health, last error).
    pub async fn targets(&self) -> Result<Vec<(String, String, String, String)>> {
        let body: Value = self
            .client
            .get(format!("{}/api/v1/targets", self.url))
            .send()
            .await?
            .json()
            .await?;
        Ok(body["data"]["activeTargets"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|t| {
                        let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
                        (
                            s(&t["labels"]["job"]),
                            s(&t["labels"]["instance"]),
                            s(&t["health"]),
                            s(&t["lastError"]),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default())
    }
}

impl Drop for PrometheusServer {
    fn drop(&mut self) {
        stop_all(&mut self.process, Duration::from_secs(5));
    }
}
