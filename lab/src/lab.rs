//! Starting and stopping the lab: NATS, the Dynamo frontend (KV router) and N mockers.

use std::collections::BTreeSet;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::paths;
use crate::process::log_tail;
use crate::process::{group_alive, stop_all, ManagedProcess};
use crate::router_log::{parse_added_worker, strip_ansi};

/// The `service.name` of the frontend's exported traces.
pub const FRONTEND_SERVICE_NAME: &str = "dynamo-frontend";

/// How to start a lab. Every field has a default (see [`LabConfig::default`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LabConfig {
    /// Lab directory holding the venv (`venv/`) and, by default, the runs (`runs/`).
    /// Default: `$KVSCOPE_LAB_DIR` or `<workspace>/.lab`.
    pub lab_dir: PathBuf,
    /// The Dynamo release to run, from its venv under `lab_dir`
    /// ([`crate::release::venv_dir`]; `kvscope-lab setup --dynamo` makes it). Default
    /// [`crate::release::DEFAULT_DYNAMO`].
    pub dynamo: String,
    /// Run directory for logs, the discovery store, NATS storage and `lab.json`.
    /// Default: a fresh `<lab_dir>/runs/<unix time>-<pid>-<n>`.
    pub run_dir: Option<PathBuf>,
    /// Model directory given to the mockers. Default: the committed fixture `lab/fixtures/model`.
    pub model_path: PathBuf,
    /// Served model name (what `/v1/models` lists and requests name). Default `kvscope-tiny`.
    pub model_name: String,
    /// The model name of each mocker, by index, for a fleet serving several models
    /// behind one frontend (mockers past the list, and all when it is empty, serve
    /// `model_name`). Default empty.
    pub worker_models: Vec<String>,
    /// Number of mocker workers (one process each). Default 3.
    pub workers: usize,
    /// Disaggregated serving: this many prefill mockers (`--disaggregation-mode prefill`,
    /// each with a bootstrap port) beside the `workers`, which then decode
    /// (`--disaggregation-mode decode`). Dynamo 1.6.1's decode mockers publish no KV
    /// events: their manifest entries have no KV endpoint. Default 0 (aggregated).
    pub prefill_workers: usize,
    /// KV block size in tokens. Default 16.
    pub block_size: u32,
    /// KV capacity per worker in blocks (`--num-gpu-blocks-override`); small, so the
    /// workload forces evictions and the router spills. Default 256.
    pub num_gpu_blocks: u32,
    /// Mocker `--speedup-ratio` (higher = faster simulated GPU). Default 2.0.
    pub speedup_ratio: f64,
    /// The prefill mockers' `--speedup-ratio`, where it differs from `speedup_ratio`: a
    /// decode pool slower at prefill than the prefill pool (as busy decode engines are),
    /// so that remote prefill can pay off for long prompts. Default none.
    pub prefill_speedup_ratio: Option<f64>,
    /// Start a `nats-server -js` on loopback (Dynamo itself doesn't need it here; the
    /// kvscope agent and collector use it as their bus). Default true.
    pub nats: bool,
    /// Run NATS as a production bus would: TLS, kvscope and Dynamo in accounts of their
    /// own, a user per agent allowed to publish under its own name only (see
    /// [`crate::bus_security`]). Default true.
    pub bus_security: bool,
    /// The agents that get a user on the secured bus, each for its cluster. Default
    /// `lab-node` in cluster `lab`.
    pub bus_agents: Vec<crate::bus_security::BusAgent>,
    /// Leave ANSI colours in the router log. Default false (`DYN_SDK_DISABLE_ANSI_LOGGING=1`).
    pub ansi_logs: bool,
    /// `DYN_LOG` for the frontend. Default `info,dynamo_kv_router=debug`.
    pub frontend_log_filter: String,
    /// The frontend logs JSON lines (`DYN_LOGGING_JSONL=1`), as production often runs
    /// it. Default false.
    pub frontend_jsonl_logs: bool,
    /// The frontend writes Dynamo's request trace (`DYN_REQUEST_TRACE=1`, stderr sink)
    /// into its log: one record per request, whatever the log level. Default false.
    pub request_trace: bool,
    /// The frontend exports its traces over OTLP/gRPC to this endpoint, e.g.
    /// `http://127.0.0.1:4317` (`OTEL_EXPORT_ENABLED=1`,
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_SERVICE_NAME=dynamo-frontend`): the
    /// traces kvscope's spans join. Default none (not exported).
    pub frontend_otlp_traces: Option<String>,
    /// `DYN_LOG` for the mockers. Default `info`.
    pub worker_log_filter: String,
    /// Extra arguments for `python -m dynamo.frontend` (e.g. `--router-track-output-blocks`).
    pub frontend_args: Vec<String>,
    /// The frontend's wall clock reads this many ms off the host's (libfaketime,
    /// `LD_PRELOAD`): the skew between a router's host and its engines' hosts, in one
    /// machine. Its monotonic clock is left alone. Default 0 (no preload).
    pub frontend_clock_offset_ms: i64,
    /// Extra arguments for each `python -m dynamo.mocker`.
    pub mocker_args: Vec<String>,
    /// A program (and its arguments) run inside each mocker's process tree, as a vLLM
    /// engine's NIXL agent runs under Dynamo's worker process: a shell starts it in the
    /// background, then becomes the mocker (`exec`), so the mocker is its parent. `{index}`
    /// in an argument is the mocker's index. It shares the mocker's log and process
    /// group (stopped with it). Default none.
    pub worker_sidecar: Vec<String>,
    /// How long to wait for everything to be ready, in seconds. Default 120.
    pub startup_timeout_secs: f64,
    /// Grace period between SIGTERM and SIGKILL when stopping, in seconds. Default 5.
    pub stop_grace_secs: f64,
    /// Dynamo's discovery backend: `file` (a folder in the run dir) or `etcd` (a real
    /// etcd on loopback). Default file.
    pub discovery: LabDiscovery,
    /// Dynamo's event plane: `zmq` or `nats` (the lab's NATS server). Default zmq.
    pub event_plane: LabEventPlane,
    /// Each mocker keeps its last KV batches behind a replay socket
    /// (`--zmq-replay-ports`), as vLLM's publisher can. Default true.
    pub replay: bool,
}

/// Where the lab's Dynamo keeps its discovery store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LabDiscovery {
    #[default]
    File,
    Etcd,
}

/// How the lab's Dynamo carries its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LabEventPlane {
    #[default]
    Zmq,
    Nats,
}

impl Default for LabConfig {
    fn default() -> Self {
        Self {
            lab_dir: paths::default_lab_dir(),
            dynamo: crate::release::DEFAULT_DYNAMO.into(),
            run_dir: None,
            model_path: paths::model_fixture_dir(),
            model_name: "kvscope-tiny".into(),
            worker_models: Vec::new(),
            workers: 3,
            prefill_workers: 0,
            block_size: 16,
            num_gpu_blocks: 256,
            speedup_ratio: 2.0,
            prefill_speedup_ratio: None,
            nats: true,
            bus_security: true,
            bus_agents: vec![crate::bus_security::BusAgent::new("lab-node", "lab")],
            ansi_logs: false,
            frontend_log_filter: "info,dynamo_kv_router=debug".into(),
            frontend_jsonl_logs: false,
            request_trace: false,
            frontend_otlp_traces: None,
            worker_log_filter: "info".into(),
            frontend_args: Vec::new(),
            frontend_clock_offset_ms: 0,
            mocker_args: Vec::new(),
            worker_sidecar: Vec::new(),
            startup_timeout_secs: 120.0,
            stop_grace_secs: 5.0,
            discovery: LabDiscovery::File,
            event_plane: LabEventPlane::Zmq,
            replay: true,
        }
    }
}

/// A mocker's part in a disaggregated lab.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl LabConfig {
    /// Mocker `index`'s part: the first `workers` decode and the rest prefill in a
    /// disaggregated lab; none when aggregated.
    pub fn role(&self, index: usize) -> Option<Role> {
        match (self.prefill_workers, index >= self.workers) {
            (0, _) => None,
            (_, true) => Some(Role::Prefill),
            (_, false) => Some(Role::Decode),
        }
    }

    /// Have every mocker answer with the replies planned in `trace` (a Mooncake JSONL
    /// file, [`crate::workload::answer_trace`]) for the requests that name them, instead
    /// of random tokens: Dynamo's `--response-replay-trace-path`.
    pub fn answering_from(mut self, trace: &std::path::Path) -> Self {
        self.mocker_args.push("--response-replay-trace-path".into());
        self.mocker_args.push(trace.display().to_string());
        self
    }

    /// The model mocker `index` serves.
    pub fn worker_model(&self, index: usize) -> &str {
        self.worker_models
            .get(index)
            .map_or(self.model_name.as_str(), String::as_str)
    }

    /// Every model the lab serves, each once.
    pub fn served_models(&self) -> Vec<&str> {
        let mut m: Vec<&str> = (0..self.workers).map(|i| self.worker_model(i)).collect();
        m.sort_unstable();
        m.dedup();
        m
    }
}

/// One started process, as recorded in the manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub name: String,
    /// PID, also the process group id.
    pub pid: u32,
    pub log: PathBuf,
}

/// One mocker worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub index: usize,
    /// The model it serves.
    #[serde(default)]
    pub model: String,
    /// Dynamo worker id, exactly as the router logs it (`Selected worker … worker_id=`).
    pub worker_id: u64,
    pub dp_rank: u32,
    /// The vLLM-format KV event publisher (ZMQ PUB) of this worker; empty for a decode
    /// worker of a disaggregated lab, which publishes none.
    pub kv_events_endpoint: String,
    /// `prefill` or `decode` in a disaggregated lab; none when aggregated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Its replay socket (ZMQ ROUTER), when the lab runs with replay.
    #[serde(default)]
    pub kv_replay_endpoint: Option<String>,
    pub process: ProcessInfo,
}

/// A running lab (written as `lab.json` in the run directory).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub run_dir: PathBuf,
    /// The Dynamo release the lab runs (`ai-dynamo`'s version in its venv).
    #[serde(default)]
    pub dynamo_version: String,
    /// Base URL of the OpenAI-compatible frontend, e.g. `http://127.0.0.1:40123`.
    pub frontend_url: String,
    pub model_name: String,
    pub model_path: PathBuf,
    /// `nats://127.0.0.1:<port>` when NATS was started.
    pub nats_url: Option<String>,
    /// The bus's CA and users, when it runs secured (`LabConfig::bus_security`).
    #[serde(default)]
    pub bus_security: Option<crate::bus_security::BusSecurity>,
    /// Dynamo's NATS (`NATS_SERVER` for Dynamo's processes): the bus itself, or beside a
    /// secured bus a server of its own, started with the NATS event plane.
    #[serde(default)]
    pub dynamo_nats_url: Option<String>,
    #[serde(default)]
    pub dynamo_nats: Option<ProcessInfo>,
    /// The frontend's log: KV router decisions (`[ROUTING_INPUT]`, `Selected worker`).
    pub router_log: PathBuf,
    /// `DYN_FILE_KV`: the file discovery store (see `kvscope_discovery`); unused with etcd.
    pub discovery_dir: PathBuf,
    #[serde(default)]
    pub discovery: LabDiscovery,
    /// `ETCD_ENDPOINTS` when the lab runs etcd discovery.
    #[serde(default)]
    pub etcd_url: Option<String>,
    #[serde(default)]
    pub etcd: Option<ProcessInfo>,
    #[serde(default)]
    pub event_plane: LabEventPlane,
    pub block_size: u32,
    pub num_gpu_blocks: u32,
    pub speedup_ratio: f64,
    pub workers: Vec<WorkerInfo>,
    pub frontend: ProcessInfo,
    pub nats: Option<ProcessInfo>,
    pub started_at_unix_ms: u64,
    pub startup_secs: f64,
}

impl Manifest {
    /// Reads `lab.json`.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// All process group ids this lab started.
    pub fn process_groups(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.workers.iter().map(|w| w.process.pid).collect();
        v.push(self.frontend.pid);
        v.extend(self.nats.as_ref().map(|n| n.pid));
        v.extend(self.dynamo_nats.as_ref().map(|n| n.pid));
        v.extend(self.etcd.as_ref().map(|n| n.pid));
        v
    }

    /// The variables through which Dynamo's processes find each other, as a Dynamo
    /// deployment sets them for every pod: what a kvscope process given the fleet's
    /// environment reads (`DYN_DISCOVERY_BACKEND`, `DYN_FILE_KV` or `ETCD_ENDPOINTS`,
    /// `NATS_SERVER` with the NATS event plane, and on a secured bus Dynamo's user in
    /// `NATS_AUTH_*` and the CA in `SSL_CERT_FILE`).
    pub fn dynamo_env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        match (self.discovery, &self.etcd_url) {
            (LabDiscovery::Etcd, Some(url)) => {
                env.push(("DYN_DISCOVERY_BACKEND".into(), "etcd".into()));
                env.push(("ETCD_ENDPOINTS".into(), url.clone()));
            }
            _ => {
                env.push(("DYN_DISCOVERY_BACKEND".into(), "file".into()));
                env.push((
                    "DYN_FILE_KV".into(),
                    self.discovery_dir.display().to_string(),
                ));
            }
        }
        if self.event_plane == LabEventPlane::Nats {
            if let Some(url) = &self.dynamo_nats_url {
                env.push(("NATS_SERVER".into(), url.clone()));
            }
        }
        env.extend(self.bus_security.iter().flat_map(|s| s.dynamo_env()));
        env
    }
}

/// A Hugging Face hub cache under `run_dir` in which every served model name is a
/// snapshot of `model_path`'s files (links), as `huggingface_hub` lays one out.
fn hub_cache(run_dir: &Path, model_path: &Path, models: &[&str]) -> anyhow::Result<PathBuf> {
    const REVISION: &str = "0000000000000000000000000000000000000000";
    let cache = run_dir.join("hub-cache");
    for model in models {
        let repo = cache.join(format!("models--{}", model.replace('/', "--")));
        let snapshot = repo.join("snapshots").join(REVISION);
        std::fs::create_dir_all(&snapshot)
            .with_context(|| format!("creating {}", snapshot.display()))?;
        std::fs::create_dir_all(repo.join("refs"))?;
        std::fs::write(repo.join("refs").join("main"), REVISION)?;
        for entry in std::fs::read_dir(model_path)
            .with_context(|| format!("listing {}", model_path.display()))?
        {
            let entry = entry?;
            let link = snapshot.join(entry.file_name());
            if !link.exists() {
                std::os::unix::fs::symlink(entry.path(), &link)
                    .with_context(|| format!("linking {}", link.display()))?;
            }
        }
    }
    Ok(cache)
}

/// libfaketime's thread-safe preload (Debian's `faketime` package; `scripts/setup`
/// installs it).
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// Make `cmd`'s wall clock read `offset_ms` off the host's.
pub fn skew_clock(cmd: &mut Command, offset_ms: i64) -> Result<(), LabError> {
    if !Path::new(LIBFAKETIME).exists() {
        return Err(LabError::Other(anyhow::anyhow!(
            "a clock offset needs libfaketime ({LIBFAKETIME}): apt-get install faketime \
             (scripts/setup does)"
        )));
    }
    let sign = if offset_ms < 0 { '-' } else { '+' };
    let ms = offset_ms.unsigned_abs();
    // Beside whatever the command preloads already (the loopback shim).
    let preload = cmd
        .get_envs()
        .find(|(k, _)| *k == crate::loopback::LD_PRELOAD_ENV)
        .and_then(|(_, v)| v)
        .map(|v| format!("{LIBFAKETIME}:{}", v.to_string_lossy()))
        .unwrap_or_else(|| LIBFAKETIME.to_string());
    cmd.env(crate::loopback::LD_PRELOAD_ENV, preload)
        .env("FAKETIME", format!("{sign}{}.{:03}", ms / 1000, ms % 1000))
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    Ok(())
}

/// Why a lab did not start.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("lab venv missing or broken at {0}: run `kvscope-lab setup --dynamo {1}`")]
    VenvMissing(PathBuf, String),
    #[error(
        "{what} exited during startup ({status}); see {log}\n--- last lines of {log} ---\n{tail}"
    )]
    ProcessExited {
        what: String,
        status: String,
        log: String,
        tail: String,
    },
    #[error("lab not ready after {secs:.0}s: {waiting_for}\nlogs: {logs}\n{tails}")]
    Timeout {
        secs: f64,
        waiting_for: String,
        logs: String,
        tails: String,
    },
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// A running lab. Stops (kills the process groups of) everything it started on
/// [`Lab::stop`] or drop.
#[derive(Debug)]
pub struct Lab {
    manifest: Manifest,
    procs: Vec<ManagedProcess>,
    stop_grace: Duration,
    /// Each mocker's command, to start it again ([`Lab::restart_worker`]).
    mocker_cmds: Vec<Command>,
    startup_timeout: Duration,
    restarts: usize,
}

struct PendingWorker {
    index: usize,
    port: u16,
    role: Option<Role>,
    proc_idx: usize,
    worker_id: Option<u64>,
}

impl Lab {
    /// Starts NATS (optional), the frontend and the mockers, waits until the frontend
    /// serves the model with every worker registered in the KV router, and writes
    /// `lab.json`.
    pub async fn start(config: LabConfig) -> Result<Lab, LabError> {
        let cfg = config.clone();
        tokio::task::spawn_blocking(move || Lab::start_blocking(cfg))
            .await
            .map_err(|e| LabError::Other(anyhow::anyhow!("startup task failed: {e}")))?
    }

    /// Blocking variant of [`Lab::start`].
    pub fn start_blocking(config: LabConfig) -> Result<Lab, LabError> {
        let t0 = Instant::now();
        let started_at_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let venv = crate::release::venv_dir(&config.lab_dir, &config.dynamo);
        let python = venv.join("bin").join("python");
        if !python.exists() {
            return Err(LabError::VenvMissing(venv, config.dynamo.clone()));
        }
        let build = crate::release::DynamoBuild::read(&venv)?;
        if config.event_plane == LabEventPlane::Zmq && !build.event_plane_host {
            return Err(LabError::Other(anyhow::anyhow!(
                "Dynamo {} has no DYN_EVENT_PLANE_HOST: its ZMQ event plane would advertise \
                 this machine's other address; run it with the NATS event plane \
                 (--event-plane nats)",
                build.version
            )));
        }
        let run_dir = match &config.run_dir {
            Some(d) => d.clone(),
            None => fresh_run_dir(&config.lab_dir)?,
        };
        let discovery_dir = run_dir.join("discovery");
        std::fs::create_dir_all(&discovery_dir)
            .with_context(|| format!("creating {}", discovery_dir.display()))?;
        let model_path = std::fs::canonicalize(&config.model_path)
            .with_context(|| format!("model path {}", config.model_path.display()))?;

        // Held until the whole fleet is up, so nothing alongside takes a port before the
        // process it is meant for binds it.
        let mockers = config.workers + config.prefill_workers;
        let reservation = crate::ports::reserve_ports(5 + 2 * mockers + config.prefill_workers)
            .context("choosing free ports")?;
        let ports = reservation.ports();
        let (http_port, nats_port, etcd_ports) = (ports[0], ports[1], [ports[2], ports[3]]);
        let dynamo_nats_port = ports[4];
        let (zmq_ports, rest) = ports[5..].split_at(mockers);
        let (replay_ports, bootstrap_ports) = rest.split_at(mockers);
        if config.event_plane == LabEventPlane::Nats && !config.nats {
            return Err(LabError::Other(anyhow::anyhow!(
                "the NATS event plane needs the lab's NATS server (nats = true)"
            )));
        }

        let mut lab = Lab {
            manifest: Manifest {
                run_dir: run_dir.clone(),
                dynamo_version: build.version.clone(),
                frontend_url: format!("http://127.0.0.1:{http_port}"),
                model_name: config.model_name.clone(),
                model_path: model_path.clone(),
                nats_url: None,
                bus_security: None,
                dynamo_nats_url: None,
                dynamo_nats: None,
                router_log: run_dir.join("frontend.log"),
                discovery_dir: discovery_dir.clone(),
                discovery: config.discovery,
                etcd_url: None,
                etcd: None,
                event_plane: config.event_plane,
                block_size: config.block_size,
                num_gpu_blocks: config.num_gpu_blocks,
                speedup_ratio: config.speedup_ratio,
                workers: Vec::new(),
                frontend: ProcessInfo {
                    name: "frontend".into(),
                    pid: 0,
                    log: run_dir.join("frontend.log"),
                },
                nats: None,
                started_at_unix_ms,
                startup_secs: 0.0,
            },
            procs: Vec::new(),
            stop_grace: Duration::from_secs_f64(config.stop_grace_secs),
            mocker_cmds: Vec::new(),
            startup_timeout: Duration::from_secs_f64(config.startup_timeout_secs),
            restarts: 0,
        };
        // From here on, an early return drops `lab`, which stops what was started.

        if config.nats {
            let security = if config.bus_security {
                // A collector limited to one of the lab's models has a durable consumer
                // of its own (`kvscope-collector-<model>`).
                let mut models: Vec<String> = (0..config.workers)
                    .map(|i| {
                        format!(
                            "kvscope-collector-{}",
                            kvscope_wire::subject::token(config.worker_model(i))
                        )
                    })
                    .collect();
                models.sort();
                models.dedup();
                Some(crate::bus_security::BusSecurity::create_with(
                    &run_dir.join("nats-security"),
                    &config.bus_agents,
                    &models,
                )?)
            } else {
                None
            };
            let p = crate::nats::spawn(&run_dir, nats_port, security.as_ref())?;
            lab.manifest.bus_security = security;
            let log = p.log.clone();
            lab.manifest.nats = Some(ProcessInfo {
                name: "nats-server".into(),
                pid: p.pid(),
                log,
            });
            lab.manifest.nats_url = Some(format!("nats://127.0.0.1:{nats_port}"));
            lab.procs.push(p);
            lab.manifest.dynamo_nats_url = lab.manifest.nats_url.clone();
            match &lab.manifest.bus_security {
                Some(s) if config.event_plane == LabEventPlane::Nats => {
                    let p = crate::nats::spawn_dynamo(&run_dir, dynamo_nats_port, s)?;
                    lab.manifest.dynamo_nats = Some(ProcessInfo {
                        name: "dynamo-nats-server".into(),
                        pid: p.pid(),
                        log: p.log.clone(),
                    });
                    lab.manifest.dynamo_nats_url =
                        Some(format!("nats://127.0.0.1:{dynamo_nats_port}"));
                    lab.procs.push(p);
                }
                // Dynamo's processes use NATS only for its event plane here: none.
                Some(_) => lab.manifest.dynamo_nats_url = None,
                None => {}
            }
        }

        if config.discovery == LabDiscovery::Etcd {
            let p = crate::etcd::spawn(&run_dir, etcd_ports[0], etcd_ports[1])?;
            lab.manifest.etcd = Some(ProcessInfo {
                name: "etcd".into(),
                pid: p.pid(),
                log: p.log.clone(),
            });
            lab.manifest.etcd_url = Some(format!("http://127.0.0.1:{}", etcd_ports[0]));
            lab.procs.push(p);
            // Dynamo's processes exit if etcd does not answer at their start.
            let deadline = Instant::now() + Duration::from_secs(30);
            while TcpStream::connect_timeout(
                &([127, 0, 0, 1], etcd_ports[0]).into(),
                Duration::from_millis(200),
            )
            .is_err()
            {
                if Instant::now() > deadline {
                    return Err(LabError::Other(anyhow::anyhow!(
                        "etcd did not listen on 127.0.0.1:{} within 30 s; see {}",
                        etcd_ports[0],
                        run_dir.join("etcd.log").display()
                    )));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let planes: Vec<String> = [
            "--discovery-backend",
            match config.discovery {
                LabDiscovery::File => "file",
                LabDiscovery::Etcd => "etcd",
            },
            "--event-plane",
            match config.event_plane {
                LabEventPlane::Zmq => "zmq",
                LabEventPlane::Nats => "nats",
            },
            "--request-plane",
            "tcp",
        ]
        .map(str::to_string)
        .to_vec();
        let hub_cache = hub_cache(&run_dir, &model_path, &config.served_models())?;
        // Every mocker binds its KV event and replay sockets to 0.0.0.0, whatever it is
        // told (1.4 to 1.6): the shim keeps them, and anything else, on loopback.
        let shim = run_dir.join(crate::loopback::LOOPBACK_SHIM_FILE);
        crate::loopback::write_shim(&shim)
            .with_context(|| format!("writing the loopback shim {}", shim.display()))?;
        let etcd_url = lab.manifest.etcd_url.clone();
        let nats_url = lab.manifest.dynamo_nats_url.clone();
        let nats_auth: Vec<(String, String)> = lab
            .manifest
            .bus_security
            .iter()
            .flat_map(|s| s.dynamo_env())
            .collect();
        let dyn_env = |cmd: &mut Command, filter: &str| {
            if let Some(url) = &etcd_url {
                cmd.env("ETCD_ENDPOINTS", url);
            }
            if let Some(url) = &nats_url {
                cmd.env("NATS_SERVER", url);
            }
            cmd.envs(nats_auth.iter().map(|(k, v)| (k, v)));
            cmd.env("DYN_LOG", filter)
                .env("DYN_EVENT_PLANE_HOST", "127.0.0.1")
                .env("DYN_TCP_RPC_HOST", "127.0.0.1")
                .env("DYN_TCP_RESPONSE_STREAM_HOST", build.response_stream_host())
                .env("DYN_SYSTEM_HOST", "127.0.0.1")
                // A prefill worker's bootstrap address (else the machine's host name).
                .env("DYN_HTTP_RPC_HOST", "127.0.0.1")
                .env("DYN_FILE_KV", &discovery_dir)
                .env("DYN_SELF_HOST_METADATA", "0")
                // A frontend before 1.6 looks a served model up on the hub by its name:
                // it finds it here, and no process ever asks the network.
                .env("HF_HUB_CACHE", &hub_cache)
                .env("HF_HUB_OFFLINE", "1")
                .env(crate::loopback::LD_PRELOAD_ENV, &shim)
                .env("PYTHONUNBUFFERED", "1")
                .env_remove("DYN_SYSTEM_PORT")
                .env_remove("DYN_LOGGING_JSONL");
            if config.ansi_logs {
                cmd.env_remove("DYN_SDK_DISABLE_ANSI_LOGGING")
                    .env_remove("NO_COLOR");
            } else {
                cmd.env("DYN_SDK_DISABLE_ANSI_LOGGING", "1")
                    .env("NO_COLOR", "1");
            }
        };

        let mut fe = Command::new(&python);
        fe.args(["-m", "dynamo.frontend", "--router-mode", "kv"])
            .args(["--http-host", "127.0.0.1", "--http-port"])
            .arg(http_port.to_string())
            .args(&planes)
            .args(&config.frontend_args)
            .current_dir(&run_dir);
        dyn_env(&mut fe, &config.frontend_log_filter);
        if config.frontend_jsonl_logs {
            fe.env("DYN_LOGGING_JSONL", "1");
        }
        match &config.frontend_otlp_traces {
            Some(endpoint) => {
                fe.env("OTEL_EXPORT_ENABLED", "1")
                    .env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
                    .env("OTEL_SERVICE_NAME", FRONTEND_SERVICE_NAME);
            }
            None => {
                fe.env_remove("OTEL_EXPORT_ENABLED");
            }
        }
        if config.frontend_clock_offset_ms != 0 {
            skew_clock(&mut fe, config.frontend_clock_offset_ms)?;
        }
        if config.request_trace {
            fe.env("DYN_REQUEST_TRACE", "1")
                .env("DYN_REQUEST_TRACE_SINKS", "stderr");
        } else {
            fe.env_remove("DYN_REQUEST_TRACE");
        }
        let p = ManagedProcess::spawn("frontend", fe, &lab.manifest.router_log)?;
        lab.manifest.frontend.pid = p.pid();
        let frontend_idx = lab.procs.len();
        lab.procs.push(p);

        let mut pending = Vec::new();
        for (index, &port) in zmq_ports.iter().enumerate() {
            let role = config.role(index);
            let mut cmd = Command::new(&python);
            cmd.args(["-m", "dynamo.mocker", "--model-path"])
                .arg(&model_path)
                .args(["--model-name", config.worker_model(index)])
                .args(["--block-size", &config.block_size.to_string()])
                .args([
                    "--num-gpu-blocks-override",
                    &config.num_gpu_blocks.to_string(),
                ])
                .args([
                    "--speedup-ratio",
                    &match role {
                        Some(Role::Prefill) => {
                            config.prefill_speedup_ratio.unwrap_or(config.speedup_ratio)
                        }
                        _ => config.speedup_ratio,
                    }
                    .to_string(),
                ])
                .args(["--zmq-kv-events-ports", &port.to_string()])
                .args(&planes)
                .args(if config.replay {
                    vec![
                        "--zmq-replay-ports".to_string(),
                        replay_ports[index].to_string(),
                    ]
                } else {
                    Vec::new()
                })
                .args(match role {
                    Some(Role::Prefill) => vec![
                        "--disaggregation-mode".to_string(),
                        "prefill".into(),
                        "--bootstrap-ports".into(),
                        bootstrap_ports[index - config.workers].to_string(),
                    ],
                    Some(Role::Decode) => vec!["--disaggregation-mode".into(), "decode".into()],
                    None => Vec::new(),
                })
                .args(&config.mocker_args)
                .current_dir(&run_dir);
            dyn_env(&mut cmd, &config.worker_log_filter);
            let cmd = with_sidecar(&config.worker_sidecar, index, cmd);
            let name = format!("mocker-{index}");
            let log = run_dir.join(format!("{name}.log"));
            lab.mocker_cmds.push(copy_command(&cmd));
            let p = ManagedProcess::spawn(&name, cmd, &log)?;
            pending.push(PendingWorker {
                index,
                port,
                role,
                proc_idx: lab.procs.len(),
                worker_id: None,
            });
            lab.procs.push(p);
        }
        info!(run_dir = %run_dir.display(), workers = config.workers, "Lab processes started; waiting for readiness.");

        // Readiness loop.
        let timeout = Duration::from_secs_f64(config.startup_timeout_secs);
        let deadline = Instant::now() + timeout;
        let mut nats_ready = !config.nats;
        // When /v1/models first listed every served model.
        let mut served_at: Option<Instant> = None;
        let mut router_workers: BTreeSet<u64> = BTreeSet::new();
        let mut last_models_probe = Instant::now() - Duration::from_secs(1);
        loop {
            for p in lab.procs.iter_mut() {
                if let Some(status) = p.exited() {
                    return Err(LabError::ProcessExited {
                        what: p.name.clone(),
                        status: status.to_string(),
                        log: p.log.display().to_string(),
                        tail: log_tail(&p.log, 30),
                    });
                }
            }
            if !nats_ready {
                nats_ready = TcpStream::connect_timeout(
                    &([127, 0, 0, 1], nats_port).into(),
                    Duration::from_millis(200),
                )
                .is_ok();
            }
            for w in pending.iter_mut().filter(|w| w.worker_id.is_none()) {
                w.worker_id = worker_id_from_log(&lab.procs[w.proc_idx].log);
            }
            router_workers.extend(added_workers(&lab.procs[frontend_idx].log));
            if last_models_probe.elapsed() >= Duration::from_millis(500) {
                last_models_probe = Instant::now();
                if served_at.is_none()
                    && config
                        .served_models()
                        .iter()
                        .all(|m| models_lists(http_port, m))
                {
                    served_at = Some(Instant::now());
                }
                // A Dynamo 1.4 router logs `Adding worker` only for workers that come
                // after it starts; those it finds at its start (all of them, or some,
                // when they register together) it takes silently (it logs `Removing
                // worker` for them at the end). Once the model has been served a while,
                // the frontend's own list of instances stands in for the lines.
                if served_at.is_some_and(|t| t.elapsed() >= SILENT_ADD_GRACE) {
                    router_workers.extend(generate_instances(http_port));
                }
            }
            let all_ids = pending.iter().all(|w| w.worker_id.is_some());
            let all_routed = all_ids
                && pending
                    .iter()
                    .all(|w| w.worker_id.is_some_and(|id| router_workers.contains(&id)));
            if nats_ready && served_at.is_some() && all_routed {
                break;
            }
            if Instant::now() >= deadline {
                let mut waiting = Vec::new();
                if !nats_ready {
                    waiting.push(format!("nats-server on port {nats_port}"));
                }
                for w in &pending {
                    match w.worker_id {
                        None => waiting.push(format!("mocker-{} worker id (log line 'Initializing KvEventPublisher for worker', or a decode worker's 'FPM direct publisher started worker_id=')", w.index)),
                        Some(id) if !router_workers.contains(&id) => waiting.push(format!("router to add worker {id} (mocker-{})", w.index)),
                        _ => {}
                    }
                }
                if served_at.is_none() {
                    waiting.push(format!("/v1/models to list {:?}", config.served_models()));
                }
                let logs: Vec<String> = lab
                    .procs
                    .iter()
                    .map(|p| p.log.display().to_string())
                    .collect();
                let tails: String = lab
                    .procs
                    .iter()
                    .map(|p| {
                        format!(
                            "--- last lines of {} ---\n{}\n",
                            p.log.display(),
                            log_tail(&p.log, 12)
                        )
                    })
                    .collect();
                return Err(LabError::Timeout {
                    secs: timeout.as_secs_f64(),
                    waiting_for: waiting.join("; "),
                    logs: logs.join(" "),
                    tails,
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }

        // Cross-check with the file discovery store.
        let discovered: BTreeSet<u64> = kvscope_discovery::backend::read_file_store(&discovery_dir)
            .map(|entries| {
                kvscope_discovery::Fleet::from_entries(entries.iter().map(|(k, v)| (k.as_str(), v)))
                    .workers
                    .into_keys()
                    .collect()
            })
            .unwrap_or_default();
        for w in &pending {
            let p = &lab.procs[w.proc_idx];
            let worker_id = w.worker_id.unwrap_or_default();
            if config.discovery == LabDiscovery::File && !discovered.contains(&worker_id) {
                warn!(
                    worker_id,
                    "Worker id from the mocker log is not in the discovery store."
                );
            }
            lab.manifest.workers.push(WorkerInfo {
                index: w.index,
                model: config.worker_model(w.index).to_string(),
                worker_id,
                dp_rank: 0,
                kv_events_endpoint: if w.role == Some(Role::Decode) {
                    String::new()
                } else {
                    format!("tcp://127.0.0.1:{}", w.port)
                },
                kv_replay_endpoint: (config.replay && w.role != Some(Role::Decode))
                    .then(|| format!("tcp://127.0.0.1:{}", replay_ports[w.index])),
                role: w.role.map(|r| r.name().to_string()),
                process: ProcessInfo {
                    name: p.name.clone(),
                    pid: p.pid(),
                    log: p.log.clone(),
                },
            });
        }
        let open = crate::loopback::wildcard_listeners(&lab.manifest.process_groups());
        if !open.is_empty() {
            return Err(LabError::Other(anyhow::anyhow!(
                "the lab's processes listen on every address, where every lab socket must stay \
                 on loopback: {}",
                open.join(", ")
            )));
        }
        lab.manifest.startup_secs = t0.elapsed().as_secs_f64();
        let manifest_path = run_dir.join("lab.json");
        // Owner-only: on a secured bus it holds the users' passwords.
        crate::bus_security::write_private(
            &manifest_path,
            &serde_json::to_string_pretty(&lab.manifest).context("encoding manifest")?,
        )?;
        info!(
            frontend = %lab.manifest.frontend_url,
            startup_secs = format!("{:.1}", lab.manifest.startup_secs),
            manifest = %manifest_path.display(),
            "Lab ready."
        );
        Ok(lab)
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    pub fn frontend_url(&self) -> &str {
        &self.manifest.frontend_url
    }
    pub fn nats_url(&self) -> Option<&str> {
        self.manifest.nats_url.as_deref()
    }
    pub fn router_log(&self) -> &Path {
        &self.manifest.router_log
    }
    pub fn workers(&self) -> &[WorkerInfo] {
        &self.manifest.workers
    }
    pub fn run_dir(&self) -> &Path {
        &self.manifest.run_dir
    }
    /// Path of `lab.json`.
    pub fn manifest_path(&self) -> PathBuf {
        self.manifest.run_dir.join("lab.json")
    }

    /// Stops every process this lab started (SIGTERM, then SIGKILL to the groups).
    pub fn stop(mut self) {
        self.stop_inner();
    }

    /// Stop mocker `index` (SIGTERM, as an orchestrator stops a pod: it deregisters from
    /// discovery) and start it again with the same command; it comes back under a new
    /// worker id, as a restarted Dynamo worker does. Returns (old id, new id) once the
    /// router has added the new one; the manifest is updated.
    pub fn restart_worker(&mut self, index: usize) -> anyhow::Result<(u64, u64)> {
        let name = format!("mocker-{index}");
        let w = self
            .manifest
            .workers
            .iter()
            .position(|w| w.index == index)
            .with_context(|| format!("no worker {index}"))?;
        let old = self.manifest.workers[w].worker_id;
        let p = self
            .procs
            .iter()
            .position(|p| p.name == name)
            .with_context(|| format!("{name} is not running"))?;
        let mut stopped = vec![self.procs.remove(p)];
        stop_all(&mut stopped, self.stop_grace);
        self.restarts += 1;
        let log = self
            .manifest
            .run_dir
            .join(format!("{name}-restart{}.log", self.restarts));
        let cmd = copy_command(&self.mocker_cmds[index]);
        let proc = ManagedProcess::spawn(&name, cmd, &log)?;
        let pid = proc.pid();
        self.procs.push(proc);
        let deadline = Instant::now() + self.startup_timeout;
        let new = loop {
            if let Some(id) = worker_id_from_log(&log) {
                if added_workers(&self.manifest.router_log).contains(&id) {
                    break id;
                }
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{name} did not come back within {:?}; see {}",
                self.startup_timeout,
                log.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        let info = &mut self.manifest.workers[w];
        info.worker_id = new;
        info.process = ProcessInfo { name, pid, log };
        let path = self.manifest_path();
        std::fs::write(&path, serde_json::to_vec_pretty(&self.manifest)?)
            .with_context(|| format!("writing {}", path.display()))?;
        info!(index, old, new, "Mocker restarted under a new worker id.");
        Ok((old, new))
    }

    fn stop_inner(&mut self) {
        if self.procs.is_empty() {
            return;
        }
        info!(run_dir = %self.manifest.run_dir.display(), "Stopping lab.");
        stop_all(&mut self.procs, self.stop_grace);
        self.procs.clear();
    }

    /// Stops the processes recorded in a `lab.json` (for a lab left behind by a crashed
    /// `kvscope-lab up`). Returns the groups that were still alive.
    pub fn stop_from_manifest(manifest: &Manifest, grace: Duration) -> Vec<u32> {
        let alive: Vec<u32> = manifest
            .process_groups()
            .into_iter()
            .filter(|&g| g != 0 && group_alive(g))
            .collect();
        for &g in &alive {
            crate::process::signal_group(g, "TERM");
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && alive.iter().any(|&g| group_alive(g)) {
            std::thread::sleep(Duration::from_millis(100));
        }
        for &g in &alive {
            if group_alive(g) {
                crate::process::signal_group(g, "KILL");
            }
        }
        alive
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

fn fresh_run_dir(lab_dir: &Path) -> anyhow::Result<PathBuf> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let base = lab_dir.join("runs");
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    for n in 0..1000 {
        let dir = base.join(format!("{secs}-{}-{n}", std::process::id()));
        // create_dir fails if the folder exists, so two labs started at once in one
        // process (parallel tests) never share a run dir.
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating run dir {}", dir.display())),
        }
    }
    anyhow::bail!("could not pick a fresh run dir under {}", base.display())
}

/// `cmd` started by a shell that first starts `sidecar` (`{index}` replaced) in the
/// background: the sidecar's parent is the process that becomes `cmd`.
fn with_sidecar(sidecar: &[String], index: usize, cmd: Command) -> Command {
    if sidecar.is_empty() {
        return cmd;
    }
    let quote = |a: &str| format!("'{}'", a.replace('\'', r"'\''"));
    let line: Vec<String> = sidecar
        .iter()
        .map(|a| quote(&a.replace("{index}", &index.to_string())))
        .collect();
    let mut sh = Command::new("/bin/sh");
    sh.arg("-c")
        .arg(format!("{} & exec \"$@\"", line.join(" ")))
        .arg("sh")
        .arg(cmd.get_program())
        .args(cmd.get_args());
    carry_env_and_dir(&cmd, &mut sh);
    sh
}

/// A new command with `cmd`'s program, arguments, environment changes and folder.
fn copy_command(cmd: &Command) -> Command {
    let mut c = Command::new(cmd.get_program());
    c.args(cmd.get_args());
    carry_env_and_dir(cmd, &mut c);
    c
}

/// `from`'s environment changes and folder, onto `to`.
fn carry_env_and_dir(from: &Command, to: &mut Command) {
    for (k, v) in from.get_envs() {
        match v {
            Some(v) => to.env(k, v),
            None => to.env_remove(k),
        };
    }
    if let Some(d) = from.get_current_dir() {
        to.current_dir(d);
    }
}

/// The worker id a mocker logs at startup:
/// `Initializing KvEventPublisher for worker 2129558125179076404 on serving endpoint …`.
fn worker_id_from_log(log: &Path) -> Option<u64> {
    let bytes = std::fs::read(log).ok()?;
    let text = String::from_utf8_lossy(&bytes);
    text.lines().find_map(|line| {
        let line = strip_ansi(line);
        // A decode worker of a disaggregated lab publishes no KV events; its forward
        // pass metrics publisher names the same id.
        let rest = line
            .split("Initializing KvEventPublisher for worker ")
            .nth(1)
            .or_else(|| line.split("FPM direct publisher started worker_id=").nth(1))?;
        rest.split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    })
}

fn added_workers(log: &Path) -> Vec<u64> {
    let Ok(bytes) = std::fs::read(log) else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&bytes);
    text.lines()
        .filter(|l| l.contains("Adding worker"))
        .filter_map(|l| parse_added_worker(&strip_ansi(l)).map(|(id, _)| id))
        .collect()
}

/// GET /v1/models with a tiny blocking HTTP/1.0 client (readiness only).
/// How long after the model is first served the frontend's instance list counts as the
/// router's ([`generate_instances`]).
const SILENT_ADD_GRACE: Duration = Duration::from_secs(2);

/// The instance ids the frontend's `/health` lists for a `generate` endpoint: the
/// workers it has found in discovery.
fn generate_instances(port: u16) -> Vec<u64> {
    #[derive(Deserialize)]
    struct Health {
        #[serde(default)]
        instances: Vec<Instance>,
    }
    #[derive(Deserialize)]
    struct Instance {
        endpoint: String,
        instance_id: u64,
    }
    let Some(body) = http_get(port, "/health") else {
        return Vec::new();
    };
    let json = body.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str::<Health>(json)
        .map(|h| {
            h.instances
                .into_iter()
                .filter(|i| i.endpoint == "generate")
                .map(|i| i.instance_id)
                .collect()
        })
        .unwrap_or_default()
}

/// A plain HTTP/1.0 GET of `path` on loopback `port`: the whole response, head included.
fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(300))
            .ok()?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .ok()?;
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.starts_with("HTTP/1.").then_some(body)
}

fn models_lists(port: u16, model: &str) -> bool {
    http_get(port, "/v1/models").is_some_and(|body| body.contains(&format!("\"id\":\"{model}\"")))
}
