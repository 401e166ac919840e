//! A lab fleet with kvscope attached: the lab's processes, plus `kvscope agent` (reading
//! the fleet's KV events and following the router's log) and `kvscope collector run`
//! (recording what it applies), both as child processes of this one so a test can kill
//! and restart them.
//!
//! The agent is given what a Dynamo deployment gives its pods — the discovery
//! variables (`DYN_DISCOVERY_BACKEND` with `DYN_FILE_KV` or `ETCD_ENDPOINTS`,
//! `NATS_SERVER`) — and no worker id: with [`KvSource::EngineTaps`] it taps each mocker's
//! vLLM-format publisher by address and finds whose it is; with [`KvSource::EventPlane`]
//! it reads Dynamo's event plane from discovery alone.

use anyhow::{bail, Context as _};
use kvscope_collector::fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_collector::report::OpportunityReport;
use kvscope_lab::daemons::{CollectorApi, Daemons};
use kvscope_lab::process::ManagedProcess;
use kvscope_lab::workload::WorkloadConfig;
use kvscope_lab::{Lab, LabConfig};
use kvscope_wire::api::verdict::SpillVerdict;
use kvscope_wire::Envelope;
use kvscope_wire::Subjects;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use tracing::info;

/// The cluster name the lab's records travel under.
pub const LAB_CLUSTER: &str = "lab";

/// Where the agent reads the fleet's KV events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvSource {
    /// Each engine's own vLLM-format publisher, by address (`--kv ENDPOINT`).
    #[default]
    EngineTaps,
    /// Dynamo's event plane, every publisher discovery lists.
    EventPlane,
    /// Only what the caller passes (`start_with`'s `--kv` arguments).
    Given,
}

/// A recording judged again, as `kvscope collector report --replay` does: the analyzer
/// afterwards, every verdict in order, and the records.
pub struct Replayed {
    pub analyzer: FleetAnalyzer,
    pub verdicts: Vec<SpillVerdict>,
    pub envelopes: Vec<Envelope>,
}

/// Judge `recording` again with windows (and warm-up) of `window_secs`, and, when
/// given, only `models`.
pub fn replay(recording: &Path, window_secs: f64, models: &[&str]) -> anyhow::Result<Replayed> {
    let rec = kvscope_wire::recording::read_recording(recording)
        .with_context(|| format!("reading {}", recording.display()))?;
    anyhow::ensure!(
        rec.bad_lines.is_empty(),
        "{} bad lines in {}",
        rec.bad_lines.len(),
        recording.display()
    );
    let mut analyzer = FleetAnalyzer::new(AnalyzerConfig {
        window_secs,
        warmup_secs: window_secs,
        models: models.iter().map(|m| m.to_string()).collect(),
        ..AnalyzerConfig::default()
    });
    let verdicts = rec
        .envelopes
        .iter()
        .filter_map(|e| analyzer.apply(e))
        .collect();
    Ok(Replayed {
        analyzer,
        verdicts,
        envelopes: rec.envelopes,
    })
}

impl Replayed {
    /// The requests of `ids` that no decision in the recording names.
    pub fn undecided<'a>(&self, ids: &'a [String]) -> Vec<&'a str> {
        let decided: std::collections::HashSet<&str> = self
            .envelopes
            .iter()
            .filter_map(|e| match &e.record {
                kvscope_wire::Record::Decision(d) => Some(d.request_id.as_str()),
                _ => None,
            })
            .collect();
        ids.iter()
            .map(String::as_str)
            .filter(|id| !decided.contains(id))
            .collect()
    }
}

#[derive(Debug, Clone)]
pub struct FleetRunConfig {
    pub lab: LabConfig,
    pub kv_source: KvSource,
    /// Collector window length and warm-up, in seconds.
    pub window_secs: f64,
    pub warmup_secs: f64,
    /// Extra environment of the agent and of the collector (e.g. `OTEL_*`).
    pub agent_env: Vec<(String, String)>,
    pub collector_env: Vec<(String, String)>,
    /// kvscope's bus when it is not the lab's NATS: another server's or a cluster's
    /// URLs (comma-separated), without security.
    pub bus_url: Option<String>,
}

pub struct FleetRun {
    exe: PathBuf,
    cfg: FleetRunConfig,
    /// Before the lab: stopped first when the run is dropped.
    daemons: Daemons,
    lab: Option<Lab>,
    nats_url: String,
    collector_listen: String,
    collector_api: CollectorApi,
    /// The collector's recording of every record it applied, in order.
    pub recording: PathBuf,
    /// The agent's own recording of every record it published.
    pub agent_recording: PathBuf,
    /// More arguments for the agent (from [`Self::start_with`]).
    agent_extra_args: Vec<String>,
    /// A second collector of the same scope (`start_standby`): where it listens, its API,
    /// its recording.
    standby: Option<(String, CollectorApi, PathBuf)>,
}

impl FleetRunConfig {
    /// `lab` with the agent tapping the engines, windows and warm-up of `window_secs`,
    /// no extra environment.
    pub fn new(lab: LabConfig, window_secs: f64) -> Self {
        Self {
            lab,
            kv_source: KvSource::default(),
            window_secs,
            warmup_secs: window_secs,
            agent_env: Vec::new(),
            collector_env: Vec::new(),
            bus_url: None,
        }
    }
}

impl FleetRun {
    /// Start the lab, then the collector, then the agent. `exe` is the `kvscope` binary.
    pub async fn start(exe: &Path, cfg: FleetRunConfig) -> anyhow::Result<Self> {
        Self::start_with(exe, cfg, |_| Ok(Vec::new())).await
    }

    /// [`Self::start`], giving the agent the extra arguments `agent_args` returns once the
    /// lab is up (e.g. more `--kv` taps for the lab's worker ids, `--nixl-lib`,
    /// `--metrics-listen`).
    pub async fn start_with(
        exe: &Path,
        cfg: FleetRunConfig,
        agent_args: impl FnOnce(&Lab) -> anyhow::Result<Vec<String>>,
    ) -> anyhow::Result<Self> {
        let lab = Lab::start(cfg.lab.clone())
            .await
            .context("starting the lab")?;
        let nats_url = match &cfg.bus_url {
            Some(url) => url.clone(),
            None => lab
                .nats_url()
                .context("the lab was started without NATS; kvscope needs it as its bus")?
                .to_string(),
        };
        let run_dir = lab.run_dir().to_path_buf();
        let port = kvscope_lab::ports::pick_ports(1)?[0];
        let mut run = FleetRun {
            exe: exe.to_path_buf(),
            cfg,
            collector_listen: format!("127.0.0.1:{port}"),
            collector_api: CollectorApi::new(&format!("127.0.0.1:{port}")),
            recording: run_dir.join("collector-recording.jsonl"),
            agent_recording: run_dir.join("agent-recording.jsonl"),
            nats_url,
            lab: Some(lab),
            daemons: Daemons::default(),
            agent_extra_args: Vec::new(),
            standby: None,
        };
        let extra = agent_args(run.lab())?;
        run.agent_extra_args = extra;
        run.start_collector()?;
        run.wait_collector_up().await?;
        run.start_agent()?;
        run.wait_agent_seen().await?;
        Ok(run)
    }

    pub fn lab(&self) -> &Lab {
        self.lab.as_ref().expect("the lab runs until stop")
    }

    /// The end-to-end tests' chat workload against the lab's frontend for
    /// `duration_secs`: 24 sessions in 3 prefix families, up to 30 turns, 12 in flight,
    /// 15 requests/s.
    pub fn chat_workload(&self, duration_secs: f64) -> WorkloadConfig {
        WorkloadConfig {
            frontend: self.lab().frontend_url().to_string(),
            sessions: 24,
            families: 3,
            max_turns: 30,
            concurrency: 12,
            rate: Some(15.0),
            duration_secs,
            ..WorkloadConfig::default()
        }
    }

    /// `kvscope agent` beside the run's own: on the run's bus as `agent_id` of `cluster`
    /// (one of the lab's `bus_agents`), with that agent's credentials. The caller adds
    /// its taps.
    pub fn other_agent(&self, agent_id: &str, cluster: &str) -> anyhow::Result<Command> {
        let mut cmd = Command::new(&self.exe);
        cmd.args(["agent", "--nats-url", self.nats_url(), "--cluster", cluster])
            .args(["--agent-id", agent_id])
            .envs(self.agent_bus_env(agent_id)?)
            .env("RUST_LOG", "info");
        Ok(cmd)
    }

    pub fn api(&self) -> String {
        self.collector_api.base().to_string()
    }

    /// The collector's listen address (`host:port`).
    pub fn collector_addr(&self) -> &str {
        &self.collector_listen
    }

    /// The NATS URL the agent and collector use.
    pub fn nats_url(&self) -> &str {
        &self.nats_url
    }

    /// `KVSCOPE_NATS_*` for a kvscope process logging in to the lab's bus as `user`
    /// (nothing when the bus runs without security).
    pub fn bus_env(&self, user: &str) -> anyhow::Result<Vec<(String, String)>> {
        if self.cfg.bus_url.is_some() {
            return Ok(Vec::new());
        }
        match &self.lab().manifest().bus_security {
            Some(s) => s.kvscope_env(user),
            None => Ok(Vec::new()),
        }
    }

    /// [`Self::bus_env`] for the agent `agent_id` (one of `LabConfig::bus_agents`).
    pub(crate) fn agent_bus_env(&self, agent_id: &str) -> anyhow::Result<Vec<(String, String)>> {
        self.bus_env(&kvscope_lab::bus_security::agent_user(agent_id))
    }

    /// A client of the lab's bus that may read stream state only.
    pub async fn observe_bus(&self) -> anyhow::Result<async_nats::Client> {
        let env = self.bus_env(kvscope_lab::bus_security::OBSERVER_USER)?;
        let mut security = kvscope_wire::NatsSecurity::default();
        security.apply_env(|k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))?;
        Ok(security
            .connect_options(None)
            .await?
            .connect(kvscope_wire::nats_security::server_urls(&self.nats_url).as_slice())
            .await?)
    }

    /// The process groups of everything running: the lab's, the agent's and the
    /// collector's.
    pub fn process_groups(&self) -> Vec<u32> {
        let mut groups = self.lab().manifest().process_groups();
        groups.extend(self.daemons.pids().into_iter().map(|(_, pid)| pid));
        groups
    }

    /// The lab run's folder (logs, recordings).
    pub fn run_dir(&self) -> PathBuf {
        self.lab().run_dir().to_path_buf()
    }

    fn start_collector(&mut self) -> anyhow::Result<()> {
        let (listen, recording) = (self.collector_listen.clone(), self.recording.clone());
        self.daemons.collector = Some(self.spawn_collector("collector", &listen, &recording)?);
        Ok(())
    }

    /// Start a second collector of the same scope (its own listen address and
    /// recording): it stands by while the first holds the scope's lease.
    pub async fn start_standby(&mut self) -> anyhow::Result<CollectorApi> {
        let port = kvscope_lab::ports::pick_ports(1)?[0];
        let listen = format!("127.0.0.1:{port}");
        let recording = self.run_dir().join("collector-standby-recording.jsonl");
        self.daemons.standby =
            Some(self.spawn_collector("collector-standby", &listen, &recording)?);
        let api = CollectorApi::new(&listen);
        let hint = format!(
            "see {}",
            self.run_dir().join("collector-standby.log").display()
        );
        api.wait_summary("the standby's API", Duration::from_secs(30), &hint, |_| {
            true
        })
        .await?;
        self.standby = Some((listen, api.clone(), recording));
        Ok(api)
    }

    /// After [`Self::kill_collector`]: the standby is the run's collector from now on
    /// (its API, its recording, stopped by [`Self::finish`]).
    pub fn standby_is_the_collector(&mut self) -> anyhow::Result<()> {
        let (listen, api, recording) = self.standby.take().context("no standby started")?;
        self.daemons.collector = self.daemons.standby.take();
        self.collector_listen = listen;
        self.collector_api = api;
        self.recording = recording;
        Ok(())
    }

    fn spawn_collector(
        &self,
        name: &str,
        listen: &str,
        recording: &Path,
    ) -> anyhow::Result<ManagedProcess> {
        let mut cmd = Command::new(&self.exe);
        cmd.arg("collector")
            .args(["--window-secs", &self.cfg.window_secs.to_string()])
            .args(["--warmup-secs", &self.cfg.warmup_secs.to_string()])
            .args([
                "run",
                "--nats-url",
                &self.nats_url,
                "--cluster",
                LAB_CLUSTER,
            ])
            .args(["--listen", listen])
            .arg("--record")
            .arg(recording)
            .env("RUST_LOG", "info")
            .envs(self.bus_env(kvscope_lab::bus_security::COLLECTOR_USER)?)
            .envs(self.cfg.collector_env.iter().map(|(k, v)| (k, v)));
        let log = self.run_dir().join(format!("{name}.log"));
        ManagedProcess::spawn(name, cmd, &log)
    }

    fn start_agent(&mut self) -> anyhow::Result<()> {
        let lab = self.lab();
        let mut cmd = Command::new(&self.exe);
        cmd.arg("agent")
            .args([
                "--nats-url",
                &self.nats_url,
                "--cluster",
                LAB_CLUSTER,
                "--agent-id",
                "lab-node",
            ])
            .arg("--router-log")
            .arg(lab.router_log())
            .arg("--from-start")
            .arg("--record")
            .arg(&self.agent_recording)
            .env("RUST_LOG", "info")
            .envs(self.agent_bus_env("lab-node")?)
            .envs(lab.manifest().dynamo_env())
            .envs(self.cfg.agent_env.iter().map(|(k, v)| (k, v)));
        if self.cfg.kv_source == KvSource::EngineTaps {
            // A decode mocker of a disaggregated lab publishes nothing to tap.
            for w in lab
                .workers()
                .iter()
                .filter(|w| !w.kv_events_endpoint.is_empty())
            {
                let tap = match &w.kv_replay_endpoint {
                    Some(replay) => format!("{}@{replay}", w.kv_events_endpoint),
                    None => w.kv_events_endpoint.clone(),
                };
                cmd.arg("--kv").arg(tap);
            }
        }
        cmd.args(&self.agent_extra_args);
        let log = self.run_dir().join("agent.log");
        self.daemons.agent = Some(ManagedProcess::spawn("agent", cmd, &log)?);
        Ok(())
    }

    /// Until the collector serves: its API answers and it holds its scope's lease (it
    /// takes it once it has rebuilt its state from the stream).
    async fn wait_collector_up(&self) -> anyhow::Result<()> {
        self.wait_for_summary("the collector to serve", "collector.log", |s| {
            s["bus"]["lease"]["role"] != "standby"
        })
        .await
    }

    /// Poll the collector's summary until `ready` holds, for at most 30 s; on time-out
    /// the error names the log to read.
    async fn wait_for_summary(
        &self,
        what: &str,
        log: &str,
        ready: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<()> {
        let hint = format!("see {}", self.run_dir().join(log).display());
        self.collector_api
            .wait_summary(what, Duration::from_secs(30), &hint, ready)
            .await
            .map(|_| ())
    }

    /// Stop lab mocker `index` and start it again (a new worker id): see
    /// [`Lab::restart_worker`]. Returns (old id, new id).
    pub async fn restart_worker(&mut self, index: usize) -> anyhow::Result<(u64, u64)> {
        let lab = self.lab.as_mut().context("the lab is stopped")?;
        tokio::task::block_in_place(|| lab.restart_worker(index))
    }

    /// Wait until the collector has judged at least `n` decisions.
    pub async fn wait_for_decisions(&self, n: u64, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.summary().await?;
            if s["counters"]["decisions"].as_u64().unwrap_or(0) >= n {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "waited {timeout:?} for {n} decisions; counters {}",
                    s["counters"]
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Stop the agent (SIGTERM, then SIGKILL after a grace period).
    /// Stop the agent, once it has had time to read what the lab last wrote: it polls
    /// the router's log every 20 ms, and a request's trace record is written as the
    /// request ends, the moment the workload sees its reply.
    pub async fn stop_agent(&mut self) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        self.daemons.stop_agent(Duration::from_secs(5));
    }

    /// Wait until the collector has a heartbeat from the agent, so the agent's taps are
    /// connected before any workload starts.
    async fn wait_agent_seen(&self) -> anyhow::Result<()> {
        self.wait_for_summary("the agent's first heartbeat", "agent.log", |s| {
            s["agents"].as_object().is_some_and(|a| !a.is_empty())
        })
        .await
    }

    /// Kill the collector without warning (SIGKILL), as a crash would.
    pub fn kill_collector(&mut self) {
        self.daemons.kill_collector();
    }

    /// Start the collector again (after [`Self::kill_collector`]).
    pub async fn restart_collector(&mut self) -> anyhow::Result<()> {
        self.start_collector()?;
        self.wait_collector_up().await
    }

    pub async fn summary(&self) -> anyhow::Result<Value> {
        self.collector_api.summary().await
    }

    pub async fn report(&self) -> anyhow::Result<OpportunityReport> {
        self.get_json("/api/report").await
    }

    /// GET a JSON document from the collector's API.
    pub async fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        self.collector_api.get_json(path).await
    }

    /// GET a text document from the collector (`/metrics`, the report's Markdown).
    pub async fn get_text(&self, path: &str) -> anyhow::Result<String> {
        self.collector_api.get_text(path).await
    }

    /// Wait until the agent has published everything it saw of the workload and the
    /// collector has applied the whole stream: the stream's last sequence, read after
    /// `settle`, is applied.
    pub async fn wait_drained(&self, settle: Duration, timeout: Duration) -> anyhow::Result<()> {
        tokio::time::sleep(settle).await;
        let js = async_nats::jetstream::new(self.observe_bus().await?);
        let mut stream = js
            .get_stream(Subjects::new(LAB_CLUSTER).stream_name())
            .await?;
        let last = stream.info().await?.state.last_sequence;
        let deadline = Instant::now() + timeout;
        loop {
            let applied = self
                .summary()
                .await
                .ok()
                .and_then(|s| s["bus"]["applied_seq"].as_u64())
                .unwrap_or(0);
            if applied >= last {
                info!(last, "The collector applied the whole stream.");
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the collector applied up to {applied} of {last} records in time");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The end of a run: stop the agent, let the collector apply everything it sent,
    /// stop everything (the collector gracefully: it flushes its recording); the
    /// collector's recording.
    pub async fn finish(mut self) -> anyhow::Result<PathBuf> {
        self.stop_agent().await;
        self.wait_drained(Duration::from_secs(1), Duration::from_secs(60))
            .await
            .context("the collector did not catch up with the agent")?;
        let recording = self.recording.clone();
        self.stop();
        Ok(recording)
    }

    pub fn stop(mut self) {
        self.daemons.stop(Duration::from_secs(5));
        if let Some(lab) = self.lab.take() {
            lab.stop();
        }
    }
}
