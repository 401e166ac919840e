//! `freshness`: how soon a KV event counts in a verdict, through the real pipeline.
//!
//! A load generator plays the engines and the router: one ZMQ PUB socket per worker
//! sending vLLM/Dynamo-mocker KV event batches (`[topic, seq, msgpack [ts, [events…],
//! dp_rank]]`, map-shaped events with token ids), and a router log file it appends
//! `[ROUTING_INPUT]` / `Selected worker` lines to, as Dynamo 1.6.1 logs them. The real
//! `kvscope agent` (a child process) taps the sockets and follows the log, ships records
//! to a real `nats-server -js`, and the real `kvscope collector run` (a child process)
//! judges every decision.
//!
//! The workload is multi-turn chat: each turn of a conversation first stores the
//! previous turn's answer blocks on the worker that served it (the decode finishing),
//! then the next turn's decision is logged — its verdict's overlap on that worker
//! includes the blocks just published — then the chosen worker stores the turn's
//! prefill. Caches are bounded (LRU eviction of whole conversations, published as
//! `BlockRemoved`). For every decision that follows such an answer, the generator keeps
//! when it published the answer batch; the collector stamps each verdict with the
//! moment it had it ready (`available_ns`, its wall clock, read as it applied the
//! decision; the same clock as the generator's, on one machine). After the run the
//! bench reads every verdict once from `/api/verdicts`, so nothing polls the collector
//! while it is measured. Each verdict is also checked: its overlap on the answer's
//! worker must count the answer (else it was judged before the event: stale), and its
//! overlap on the chosen worker must not count the turn's own prefill (else it was
//! judged after it: the ordering the agent's reorder window exists for).

use crate::compare::machine;
use crate::measure::quantile;
use anyhow::{bail, Context as _};
use bytes::Bytes;
use kvscope_collector::config::CollectorConfig;
use kvscope_kit::clock::now_ns;
use kvscope_lab::daemons::{CollectorApi, Daemons};
use kvscope_lab::nats::{NatsCluster, NatsServer};
use kvscope_lab::process::ManagedProcess;
use kvscope_lab::workload::SplitMix64;
use kvscope_wire::hashing::{chain_hash, local_block_hash, DYNAMO_HASH_SEED};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use zeromq::{Socket as _, SocketSend as _, ZmqMessage};

#[derive(clap::Args, Clone, Debug)]
pub struct FreshnessArgs {
    /// KV event blocks to publish per second, stored plus removed, over all workers.
    #[arg(long, default_value_t = 100_000)]
    blocks_per_sec: u64,
    /// Measured seconds (after the warm-up).
    #[arg(long, default_value_t = 30.0)]
    duration_secs: f64,
    /// Seconds of load before measuring (the caches fill; not counted).
    #[arg(long, default_value_t = 5.0)]
    warmup_secs: f64,
    /// Workers, one ZMQ publisher each.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Each worker's KV cache, in blocks (whole conversations are evicted, least
    /// recently used first, beyond it).
    #[arg(long, default_value_t = 16_384)]
    capacity_blocks: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Conversations in flight (each takes its next turn in round-robin order).
    #[arg(long, default_value_t = 256)]
    conversations: usize,
    /// New prompt blocks per turn (the user's message).
    #[arg(long, default_value_t = 32)]
    prompt_blocks: usize,
    /// Answer blocks per turn (stored on the serving worker when decoding ends).
    #[arg(long, default_value_t = 16)]
    answer_blocks: usize,
    /// Turns per conversation; a new conversation then takes its place.
    #[arg(long, default_value_t = 8)]
    turns: u32,
    /// Probability that the router sends a turn off the worker holding the conversation.
    #[arg(long, default_value_t = 0.15)]
    spill: f64,
    /// The generator's tick: events and decisions go out in batches this often.
    #[arg(long, default_value_t = 5)]
    tick_ms: u64,
    /// The agent's reorder window (`reorder_window_ms`).
    #[arg(long, default_value_t = 250)]
    reorder_window_ms: u64,
    /// The agent's longest wait for quiet KV event publishers (`kv_reorder_window_ms`;
    /// within it the agent waits as its measured delivery lag says) [default: the
    /// agent's, i.e. the reorder window].
    #[arg(long)]
    kv_reorder_window_ms: Option<u64>,
    /// How often the agent polls the router log (`log_poll_interval_ms`).
    #[arg(long, default_value_t = 20)]
    log_poll_ms: u64,
    /// The stream's byte limit (`stream_max_bytes`, agent and collector). A fleet that
    /// has run a while keeps its stream at the limit, discarding as much as it takes
    /// in: a limit below what the run publishes (~4 MB/s at 100k blocks/s) measures
    /// that state [default: the agent's, 4 GiB, which a short run never reaches].
    #[arg(long)]
    stream_max_bytes: Option<u64>,
    /// The `kvscope` binary [default: next to this one].
    #[arg(long)]
    kvscope: Option<PathBuf>,
    /// Keep the run folder (logs, configs, router log, NATS store) here instead of a
    /// temporary one that is removed.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Seed of the workload.
    #[arg(long, default_value_t = 6)]
    seed: u64,
    /// After the load, kill the collector (SIGKILL, as a crash) and start it again on the
    /// same stream: how long until it answers, says it is ready, and has applied the
    /// whole stream again (it rebuilds from the stream's first record). A long run (or a
    /// high --blocks-per-sec) fills the stream first: 4 GiB is ~110 M block events.
    #[arg(long)]
    restart_collector: bool,
    /// Run a second collector of the same scope from the start, standing by (its lease);
    /// after the load kill the first (SIGKILL): how long until the standby says it is
    /// ready and has the whole stream, its counters beside the first one's.
    #[arg(long)]
    standby: bool,
    /// NATS servers the bus runs on: 1, or a JetStream cluster of 3 on loopback (the
    /// stream then kept by all three: `stream_replicas` at its default).
    #[arg(long, default_value_t = 1)]
    nats_servers: usize,
}

/// What one run measured.
#[derive(Debug, Serialize)]
pub struct FreshnessReport {
    pub blocks_per_sec_target: u64,
    /// NATS servers of the bus (the stream's replicas).
    pub nats_servers: usize,
    pub reorder_window_ms: u64,
    pub kv_reorder_window_ms: Option<u64>,
    pub log_poll_ms: u64,
    pub measured_secs: f64,
    /// Stored and removed blocks published per second over the measured period.
    pub published_stored_per_sec: f64,
    pub published_removed_per_sec: f64,
    pub decisions_per_sec: f64,
    /// Everything the generator published over the whole run (warm-up included), to
    /// compare with what the collector applied.
    pub published_stored_total: u64,
    pub published_removed_total: u64,
    pub decisions_total: u64,
    /// Decisions issued in the measured period, and of them those that follow a
    /// just-published answer (the ones measured).
    pub decisions: u64,
    pub measured_decisions: u64,
    /// Measured decisions without a verdict at the collector.
    pub verdicts_missing: u64,
    /// Verdicts whose overlap on the answer's worker missed the answer (judged before
    /// the event was applied).
    pub verdicts_missed_event: u64,
    /// Verdicts whose chosen worker already counted the turn's own prefill (judged after
    /// events that happened later).
    pub verdicts_saw_own_prefill: u64,
    /// Event publish → verdict available, ms.
    pub event_to_verdict_ms: Percentiles,
    /// Decision logged → verdict available, ms.
    pub decision_to_verdict_ms: Percentiles,
    /// The same figure per slice of the measured period: does it stay put (sustained)
    /// or grow (falling behind)?
    pub slices: Vec<Slice>,
    /// What the collector and agent counted (totals over the run).
    pub collector: Value,
    /// The collector's bus reader at the end (`BusStatus`: records missing, where the
    /// stream began).
    pub collector_bus: Value,
    pub agent: Value,
    /// CPU time over the measured period per process, in cores.
    pub cpu_cores: BTreeMap<String, f64>,
    /// Resident memory per process when the measured period starts and when it ends,
    /// MiB (`VmRSS`): whether a process's memory grows with the load's duration.
    pub rss_mib: BTreeMap<String, (f64, f64)>,
    pub load_average_start: String,
    pub load_average_end: String,
    /// The collector killed and started again after the load (`--restart-collector`).
    pub restart: Option<RestartReport>,
    /// The collector killed after the load and its standby taking over (`--standby`).
    pub takeover: Option<RestartReport>,
}

/// A collector killed (SIGKILL) after the load and started again on the same stream.
#[derive(Debug, Serialize)]
pub struct RestartReport {
    /// The stream's last sequence the first collector had applied (messages: a bundle of
    /// records is one).
    pub stream_messages: u64,
    /// The NATS store on disk when the collector was killed.
    pub stream_bytes: u64,
    /// Records the new collector read while rebuilding.
    pub rebuilt_records: u64,
    /// From its start: its API answered, `/readyz` said 200, it had applied the stream
    /// up to where the first one was and finished rebuilding.
    pub answered_secs: f64,
    pub ready_secs: Option<f64>,
    pub caught_up_secs: f64,
    /// The same counters as the first collector's (stored, removed, decisions).
    pub same_counters: bool,
}

#[derive(Debug, Default, Serialize)]
pub struct Percentiles {
    pub n: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    fn of(ns: &[u64]) -> Self {
        let ms = |q| quantile(ns, q) as f64 / 1e6;
        Self {
            n: ns.len(),
            p50: ms(0.5),
            p90: ms(0.9),
            p99: ms(0.99),
            max: ms(1.0),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Slice {
    pub from_secs: f64,
    pub event_to_verdict_ms: Percentiles,
}

pub fn freshness(args: FreshnessArgs) -> anyhow::Result<()> {
    validate(&args)?;
    println!("{}", machine());
    let report = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(run(&args))?;
    print_report(&args, &report);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    anyhow::ensure!(
        report.event_to_verdict_ms.n > 0 && report.verdicts_missing == 0,
        "{} of {} measured decisions have no verdict at the collector: the figures above \
         are incomplete (see the logs named above; --out DIR keeps them)",
        report.verdicts_missing,
        report.measured_decisions
    );
    Ok(())
}

fn validate(a: &FreshnessArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.workers >= 2,
        "--workers must be at least 2 (spills need two)"
    );
    anyhow::ensure!(a.blocks_per_sec > 0, "--blocks-per-sec must be > 0");
    anyhow::ensure!(
        a.duration_secs > 0.0 && a.warmup_secs >= 0.0,
        "--duration-secs must be > 0 and --warmup-secs >= 0"
    );
    anyhow::ensure!(a.tick_ms > 0, "--tick-ms must be > 0");
    anyhow::ensure!(
        matches!(a.nats_servers, 1 | 3),
        "--nats-servers is 1 or 3 (a JetStream cluster keeps a stream on an odd number)"
    );
    anyhow::ensure!(
        a.prompt_blocks > 0 && a.answer_blocks > 0 && a.turns > 0 && a.conversations > 0,
        "--prompt-blocks, --answer-blocks, --turns and --conversations must be > 0"
    );
    anyhow::ensure!((0.0..=1.0).contains(&a.spill), "--spill is a probability");
    let longest = (a.prompt_blocks + a.answer_blocks) * a.turns as usize;
    anyhow::ensure!(
        a.capacity_blocks >= 4 * longest,
        "--capacity-blocks ({}) must hold at least 4 of the longest conversations ({longest} \
         blocks): lower --turns or the blocks per turn, or raise the capacity",
        a.capacity_blocks
    );
    Ok(())
}

fn kvscope_binary(args: &FreshnessArgs) -> anyhow::Result<PathBuf> {
    let path = match &args.kvscope {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .context("cannot find this binary")?
            .with_file_name("kvscope"),
    };
    anyhow::ensure!(
        path.exists(),
        "no kvscope binary at {}: build it with the same profile first (`cargo build \
         --profile bench -p kvscope`; scripts/bench does) or pass --kvscope PATH",
        path.display()
    );
    Ok(path)
}

const CLUSTER: &str = "bench";
/// Worker ids as the router would log them.
const WORKER_ID_BASE: u64 = 7_000_000_000_000_000_000;

/// The bus: one server, or a cluster.
enum Bus {
    One(NatsServer),
    Cluster(NatsCluster),
}

impl Bus {
    fn url(&self) -> String {
        match self {
            Bus::One(s) => s.url(),
            Bus::Cluster(c) => c.urls(),
        }
    }

    /// Where one copy of the stream is stored, under the run folder `dir` (each member
    /// of a cluster holds a whole copy).
    fn store(&self, dir: &Path) -> PathBuf {
        match self {
            Bus::One(_) => dir.join("nats"),
            Bus::Cluster(_) => dir.join(NatsCluster::name(0)).join("store"),
        }
    }

    fn pids(&self) -> Vec<(String, u32)> {
        match self {
            Bus::One(s) => vec![("nats-server".to_string(), s.pid())],
            Bus::Cluster(c) => c
                .pids()
                .into_iter()
                .map(|(i, pid)| (format!("nats-server {}", NatsCluster::name(i)), pid))
                .collect(),
        }
    }
}

struct Pipeline {
    dir: PathBuf,
    nats: Bus,
    daemons: Daemons,
    api: CollectorApi,
    /// The standby collector's API (`--standby`).
    standby_api: Option<CollectorApi>,
    /// Last, so the folder goes after NATS has stopped writing its store there.
    _temp: Option<tempfile::TempDir>,
}

impl Pipeline {
    /// Keep the run folder (logs) on disk even when it is a temporary one.
    fn keep_logs(&mut self) {
        if let Some(t) = self._temp.take() {
            let _ = t.keep();
        }
    }

    /// Fails, naming the log to read (kept on disk), when the agent or the collector
    /// has exited.
    fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some((name, status, log)) = self.daemons.exited() {
            self.keep_logs();
            bail!(
                "the {name} exited ({status}) during the run; see {}",
                log.display()
            );
        }
        Ok(())
    }

    fn stop(&mut self) {
        self.daemons.stop(Duration::from_secs(5));
    }

    fn pids(&self) -> Vec<(String, u32)> {
        let mut v = self.nats.pids();
        v.extend(self.daemons.pids());
        v.push(("generator (this bench)".into(), std::process::id()));
        v
    }

    /// Poll the collector's summary until `ready` holds or `timeout` passes.
    async fn wait_summary(
        &self,
        what: &str,
        timeout: Duration,
        ready: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<Value> {
        let hint = format!(
            "see the logs in {} (run with --out DIR to keep them)",
            self.dir.display()
        );
        self.api.wait_summary(what, timeout, &hint, ready).await
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn start_pipeline(
    args: &FreshnessArgs,
    kvscope: &Path,
    ports: &[u16],
    router_log: &Path,
    dir: PathBuf,
    temp: Option<tempfile::TempDir>,
) -> anyhow::Result<Pipeline> {
    let nats = match args.nats_servers {
        1 => Bus::One(NatsServer::start_anywhere(&dir).context("starting nats-server -js")?),
        n => Bus::Cluster(NatsCluster::start(&dir, n).context("starting a NATS cluster")?),
    };
    let listen = format!("127.0.0.1:{}", ports[args.workers]);
    let mut collector_cfg = CollectorConfig {
        nats_url: nats.url(),
        cluster: CLUSTER.into(),
        listen: listen.parse()?,
        ..CollectorConfig::default()
    };
    // Every verdict of the run stays readable at the end (one read, after the load).
    collector_cfg.analyzer.keep_verdicts = 10_000_000;
    collector_cfg.analyzer.window_secs = 5.0;
    collector_cfg.analyzer.warmup_secs = args.warmup_secs;
    if let Some(b) = args.stream_max_bytes {
        collector_cfg.stream_max_bytes = b;
    }
    std::fs::write(dir.join(COLLECTOR_TOML), toml::to_string(&collector_cfg)?)?;
    let collector = spawn_collector(kvscope, &dir, COLLECTOR_TOML, "collector.log")?;
    let (standby, standby_api) = if args.standby {
        // Started once the first holds the lease, so the first is the leader.
        CollectorApi::new(&listen)
            .wait_summary("the collector's lease", Duration::from_secs(60), "", |s| {
                s["bus"]["lease"]["role"] == "leader"
            })
            .await?;
        let listen = format!("127.0.0.1:{}", ports[args.workers + 1]);
        let cfg = CollectorConfig {
            listen: listen.parse()?,
            ..collector_cfg.clone()
        };
        std::fs::write(dir.join(STANDBY_TOML), toml::to_string(&cfg)?)?;
        (
            Some(spawn_collector(
                kvscope,
                &dir,
                STANDBY_TOML,
                "collector-standby.log",
            )?),
            Some(CollectorApi::new(&listen)),
        )
    } else {
        (None, None)
    };

    let mut agent_toml = format!(
        "agent_id = \"bench-node\"\ncluster = \"{CLUSTER}\"\nnats_url = \"{}\"\n\
         router_log = \"{}\"\nfrom_start = true\nreorder_window_ms = {}\n\
         log_poll_interval_ms = {}\nbuffer_capacity = 1000000\n",
        nats.url(),
        router_log.display(),
        args.reorder_window_ms,
        args.log_poll_ms
    );
    if let Some(ms) = args.kv_reorder_window_ms {
        agent_toml.push_str(&format!("kv_reorder_window_ms = {ms}\n"));
    }
    if let Some(b) = args.stream_max_bytes {
        agent_toml.push_str(&format!("stream_max_bytes = {b}\n"));
    }
    for (i, port) in ports[..args.workers].iter().enumerate() {
        agent_toml.push_str(&format!(
            "\n[[kv_endpoints]]\nendpoint = \"tcp://127.0.0.1:{port}\"\nworker_id = {}\n",
            WORKER_ID_BASE + i as u64
        ));
    }
    let agent_path = dir.join("agent.toml");
    std::fs::write(&agent_path, agent_toml)?;
    let mut cmd = Command::new(kvscope);
    cmd.arg("agent")
        .arg("--config")
        .arg(&agent_path)
        .env("RUST_LOG", "info");
    let agent = ManagedProcess::spawn("agent", cmd, &dir.join("agent.log"))?;
    Ok(Pipeline {
        dir,
        _temp: temp,
        nats,
        daemons: Daemons {
            collector: Some(collector),
            agent: Some(agent),
            standby,
        },
        api: CollectorApi::new(&listen),
        standby_api,
    })
}

const COLLECTOR_TOML: &str = "collector.toml";
const STANDBY_TOML: &str = "collector-standby.toml";

/// `kvscope collector run` on the run folder's config `config`, logging to `log` there.
fn spawn_collector(
    kvscope: &Path,
    dir: &Path,
    config: &str,
    log: &str,
) -> anyhow::Result<ManagedProcess> {
    let mut cmd = Command::new(kvscope);
    cmd.arg("collector")
        .arg("--config")
        .arg(dir.join(config))
        .arg("run")
        .env("RUST_LOG", "info");
    ManagedProcess::spawn("collector", cmd, &dir.join(log))
}

/// Bytes of every file under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}

/// The counters two collectors of one stream must agree on.
fn counters(s: &Value) -> [Option<u64>; 3] {
    ["stored_blocks", "removed_blocks", "decisions"].map(|k| s["counters"][k].as_u64())
}

/// Kill the collector that applied the run (`before`: its summary) and start it again
/// on the same stream, timing its way back.
async fn restart_collector(
    pipeline: &mut Pipeline,
    kvscope: &Path,
    before: &Value,
) -> anyhow::Result<RestartReport> {
    let stream_messages = before["bus"]["applied_seq"].as_u64().unwrap_or(0);
    let stream_bytes = dir_bytes(&pipeline.nats.store(&pipeline.dir));
    eprintln!(
        "kvscope-bench freshness: killing the collector (SIGKILL) on a stream of {stream_messages} \
         messages, {:.1} MiB on disk, and starting it again …",
        stream_bytes as f64 / (1 << 20) as f64
    );
    pipeline.daemons.kill_collector();
    let started = Instant::now();
    pipeline.daemons.collector = Some(spawn_collector(
        kvscope,
        &pipeline.dir,
        COLLECTOR_TOML,
        "collector-restarted.log",
    )?);
    let (mut answered, mut ready) = (None, None);
    let timeout = Duration::from_secs(1800);
    loop {
        pipeline.check_alive()?;
        let at = started.elapsed().as_secs_f64();
        if let Ok(s) = pipeline.api.summary().await {
            answered.get_or_insert(at);
            if ready.is_none() && pipeline.api.get_text("/readyz").await.is_ok() {
                ready = Some(at);
            }
            let bus = &s["bus"];
            if bus["rebuilding"] == false
                && bus["applied_seq"].as_u64().unwrap_or(0) >= stream_messages
            {
                return Ok(RestartReport {
                    stream_messages,
                    stream_bytes,
                    rebuilt_records: bus["rebuilt_records"].as_u64().unwrap_or(0),
                    answered_secs: answered.unwrap_or(at),
                    ready_secs: ready,
                    caught_up_secs: at,
                    same_counters: counters(&s) == counters(before),
                });
            }
        }
        if started.elapsed() > timeout {
            pipeline.keep_logs();
            bail!(
                "the restarted collector had not applied the stream again after {timeout:?}; \
                 see {}",
                pipeline.dir.join("collector-restarted.log").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Kill the collector that applied the run (`before`: its summary) and time its standby
/// taking over: ready, and holding the whole stream.
async fn take_over(pipeline: &mut Pipeline, before: &Value) -> anyhow::Result<RestartReport> {
    let standby = pipeline.standby_api.clone().context("no standby")?;
    let stream_messages = before["bus"]["applied_seq"].as_u64().unwrap_or(0);
    let stream_bytes = dir_bytes(&pipeline.nats.store(&pipeline.dir));
    let s = standby.summary().await?;
    eprintln!(
        "kvscope-bench freshness: killing the collector (SIGKILL) on a stream of {stream_messages} \
         messages, {:.1} MiB on disk; its standby ({}) has applied up to {} …",
        stream_bytes as f64 / (1 << 20) as f64,
        s["bus"]["lease"]["role"],
        s["bus"]["applied_seq"]
    );
    pipeline.daemons.kill_collector();
    let killed = Instant::now();
    let mut ready = None;
    loop {
        pipeline.check_alive()?;
        let at = killed.elapsed().as_secs_f64();
        if ready.is_none() && standby.get_text("/readyz").await.is_ok() {
            ready = Some(at);
        }
        if let (Some(r), Ok(s)) = (ready, standby.summary().await) {
            if s["bus"]["applied_seq"].as_u64().unwrap_or(0) >= stream_messages {
                return Ok(RestartReport {
                    stream_messages,
                    stream_bytes,
                    rebuilt_records: s["bus"]["rebuilt_records"].as_u64().unwrap_or(0),
                    answered_secs: 0.0,
                    ready_secs: Some(r),
                    caught_up_secs: at,
                    same_counters: counters(&s) == counters(before),
                });
            }
        }
        if killed.elapsed() > Duration::from_secs(600) {
            pipeline.keep_logs();
            bail!(
                "the standby had not taken over after 600 s; see {}",
                pipeline.dir.join("collector-standby.log").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn run(args: &FreshnessArgs) -> anyhow::Result<FreshnessReport> {
    let kvscope = kvscope_binary(args)?;
    let (dir, temp) = match &args.out {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            (d.clone(), None)
        }
        None => {
            let t = tempfile::Builder::new()
                .prefix("kvscope-freshness-")
                .tempdir()?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    let ports = kvscope_lab::ports::pick_ports(args.workers + 2)?;
    // The engines' sockets are bound before the agent starts (it retries anyway).
    let mut sockets = Vec::with_capacity(args.workers);
    for port in &ports[..args.workers] {
        let mut s = zeromq::PubSocket::new();
        s.bind(&format!("tcp://127.0.0.1:{port}"))
            .await
            .with_context(|| format!("cannot bind the ZMQ publisher on 127.0.0.1:{port}"))?;
        sockets.push(s);
    }
    let router_log = dir.join("router.log");
    std::fs::write(&router_log, b"")?;
    let mut pipeline = start_pipeline(args, &kvscope, &ports, &router_log, dir, temp).await?;
    pipeline
        .wait_summary(
            "the collector's API and the agent's first heartbeat",
            Duration::from_secs(30),
            |s| s["agents"].as_object().is_some_and(|a| !a.is_empty()),
        )
        .await?;

    let mut gen = Generator::new(args, sockets, &router_log)?;
    // ZMQ drops what a PUB sends before a subscriber is there: announce every worker
    // (an empty cache) until the collector has heard from all of them.
    let workers = args.workers as u64;
    let announce = async {
        loop {
            gen.announce().await?;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        #[allow(unreachable_code)]
        anyhow::Ok(())
    };
    tokio::select! {
        r = announce => r?,
        r = pipeline.wait_summary("every worker's ZMQ publisher to reach the collector", Duration::from_secs(30), |s| {
            s["workers"].as_u64() == Some(workers)
        }) => { r?; }
    }

    eprintln!(
        "kvscope-bench freshness: {} workers, {} blocks/s for {:.0} s + {:.0} s warm-up; \
         agent reorder window {} ms, log poll {} ms …",
        args.workers,
        args.blocks_per_sec,
        args.duration_secs,
        args.warmup_secs,
        args.reorder_window_ms,
        args.log_poll_ms
    );
    let load_start = loadavg();
    let pids = pipeline.pids();
    let mut cpu_at_measure = None;
    let mut rss_at_measure = None;
    let start = Instant::now();
    let start_ns = now_ns();
    let warm_ns = start_ns + (args.warmup_secs * 1e9) as u64;
    let total = Duration::from_secs_f64(args.warmup_secs + args.duration_secs);
    let mut tick = tokio::time::interval(Duration::from_millis(args.tick_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut at_warm = None;
    while start.elapsed() < total {
        tick.tick().await;
        let due = (args.blocks_per_sec as f64 * start.elapsed().as_secs_f64()) as u64;
        gen.tick(due).await?;
        if at_warm.is_none() && now_ns() >= warm_ns {
            at_warm = Some((gen.counts.clone(), now_ns()));
            cpu_at_measure = Some(cpu_ticks(&pids));
            rss_at_measure = Some(rss_mib(&pids));
        }
    }
    let end_ns = now_ns();
    let cpu_end = cpu_ticks(&pids);
    let rss_end = rss_mib(&pids);
    let load_end = loadavg();
    let (warm_counts, warm_at) = at_warm.unwrap_or_else(|| (Counts::default(), start_ns));
    let measured_secs = (end_ns - warm_at) as f64 / 1e9;
    let c = &gen.counts;
    eprintln!(
        "kvscope-bench freshness: load done ({} decisions, {} stored + {} removed blocks); \
         waiting for the collector to apply everything …",
        c.decisions, c.stored, c.removed
    );
    pipeline.check_alive()?;
    let issued = gen.counts.decisions;
    let (stored, removed) = (gen.counts.stored, gen.counts.removed);
    let applied = |s: &Value| {
        let n = |k: &str| s["counters"][k].as_u64().unwrap_or(0);
        n("decisions") >= issued && n("stored_blocks") >= stored && n("removed_blocks") >= removed
    };
    let summary = match pipeline
        .wait_summary(
            "the collector to apply everything published",
            Duration::from_secs(120),
            applied,
        )
        .await
    {
        Ok(s) => s,
        Err(e) => {
            // Lost records show in the figures below; the report is still worth having.
            pipeline.check_alive()?;
            pipeline.keep_logs();
            eprintln!(
                "kvscope-bench freshness: {e:#}; logs kept in {}",
                pipeline.dir.display()
            );
            pipeline.api.summary().await?
        }
    };
    let verdicts: Value = pipeline
        .api
        .get_json(&format!("/api/verdicts?limit={}", issued + 10))
        .await?;
    let restart = if args.restart_collector {
        Some(restart_collector(&mut pipeline, &kvscope, &summary).await?)
    } else {
        None
    };
    let takeover = if args.standby {
        Some(take_over(&mut pipeline, &summary).await?)
    } else {
        None
    };
    pipeline.stop();

    let mut by_id: HashMap<&str, &Value> = HashMap::new();
    for v in verdicts.as_array().into_iter().flatten() {
        if let Some(id) = v["request_id"].as_str() {
            by_id.insert(id, v);
        }
    }
    let mut e2v = Vec::new();
    let mut d2v = Vec::new();
    let mut per_slice: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let (mut missing, mut missed_event, mut own_prefill, mut decisions) = (0, 0, 0, 0u64);
    for p in gen.probes.iter().filter(|p| p.decided_ns >= warm_at) {
        decisions += 1;
        let Some(event_ns) = p.event_ns else { continue };
        let Some(v) = by_id.get(p.request_id.as_str()) else {
            missing += 1;
            continue;
        };
        let overlap = |w: usize| {
            v["overlaps"][format!("{}/0", WORKER_ID_BASE + w as u64)]
                .as_u64()
                .unwrap_or(0) as usize
        };
        if overlap(p.home) < p.home_expected {
            missed_event += 1;
        }
        if overlap(p.chosen) > p.chosen_expected {
            own_prefill += 1;
        }
        let Some(available) = v["available_ns"].as_u64() else {
            missing += 1;
            continue;
        };
        let d = available.saturating_sub(event_ns);
        e2v.push(d);
        d2v.push(available.saturating_sub(p.decided_ns));
        per_slice
            .entry((p.decided_ns - warm_at) / 5_000_000_000)
            .or_default()
            .push(d);
    }
    let cpu_cores = match cpu_at_measure {
        Some(before) => before
            .iter()
            .zip(&cpu_end)
            .map(|((name, a), (_, b))| (name.clone(), (b - a) as f64 / CLK_TCK / measured_secs))
            .collect(),
        None => BTreeMap::new(),
    };
    let rss_mib = match rss_at_measure {
        Some(before) => before
            .into_iter()
            .zip(rss_end)
            .map(|((name, a), (_, b))| (name, (a, b)))
            .collect(),
        None => BTreeMap::new(),
    };
    let agent = summary["agents"]["bench-node"]["heartbeat"]["counters"].clone();
    Ok(FreshnessReport {
        blocks_per_sec_target: args.blocks_per_sec,
        nats_servers: args.nats_servers,
        reorder_window_ms: args.reorder_window_ms,
        kv_reorder_window_ms: args.kv_reorder_window_ms,
        log_poll_ms: args.log_poll_ms,
        measured_secs,
        published_stored_per_sec: (c.stored - warm_counts.stored) as f64 / measured_secs,
        published_removed_per_sec: (c.removed - warm_counts.removed) as f64 / measured_secs,
        decisions_per_sec: (c.decisions - warm_counts.decisions) as f64 / measured_secs,
        published_stored_total: c.stored,
        published_removed_total: c.removed,
        decisions_total: c.decisions,
        decisions,
        measured_decisions: e2v.len() as u64 + missing,
        verdicts_missing: missing,
        verdicts_missed_event: missed_event,
        verdicts_saw_own_prefill: own_prefill,
        event_to_verdict_ms: Percentiles::of(&e2v),
        decision_to_verdict_ms: Percentiles::of(&d2v),
        slices: per_slice
            .into_iter()
            .map(|(k, v)| Slice {
                from_secs: k as f64 * 5.0,
                event_to_verdict_ms: Percentiles::of(&v),
            })
            .collect(),
        collector: summary["counters"].clone(),
        collector_bus: summary["bus"].clone(),
        agent,
        cpu_cores,
        rss_mib,
        load_average_start: load_start,
        load_average_end: load_end,
        restart,
        takeover,
    })
}

fn print_report(args: &FreshnessArgs, r: &FreshnessReport) {
    let c = &r.collector;
    let a = &r.agent;
    let kv_window = r
        .kv_reorder_window_ms
        .map_or("measured, at most the reorder window".to_string(), |ms| {
            format!("measured, at most {ms} ms")
        });
    println!(
        "\nFreshness through agent → NATS JetStream ({} server(s), the stream on each) → \
         collector: {} workers, target {} blocks/s, agent reorder window {} ms (KV \
         publishers: {kv_window}), log poll {} ms, {:.1} s measured.",
        r.nats_servers,
        args.workers,
        r.blocks_per_sec_target,
        r.reorder_window_ms,
        r.log_poll_ms,
        r.measured_secs
    );
    println!(
        "Published: {:.0} stored + {:.0} removed = {:.0} blocks/s, {:.0} decisions/s.",
        r.published_stored_per_sec,
        r.published_removed_per_sec,
        r.published_stored_per_sec + r.published_removed_per_sec,
        r.decisions_per_sec
    );
    println!("\n| delay | n | p50 | p90 | p99 | max |\n|---|---:|---:|---:|---:|---:|");
    for (name, p) in [
        (
            "KV event published → verdict available",
            &r.event_to_verdict_ms,
        ),
        (
            "decision logged → verdict available",
            &r.decision_to_verdict_ms,
        ),
    ] {
        println!(
            "| {name} | {} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
            p.n, p.p50, p.p90, p.p99, p.max
        );
    }
    println!("\n| from s | n | p50 | p99 | max |\n|---:|---:|---:|---:|---:|");
    for s in &r.slices {
        let p = &s.event_to_verdict_ms;
        println!(
            "| {:.0} | {} | {:.1} ms | {:.1} ms | {:.1} ms |",
            s.from_secs, p.n, p.p50, p.p99, p.max
        );
    }
    println!(
        "\nVerdicts: {} decisions measured of {} in the measured period; {} missing, {} judged \
         before the event they depend on, {} judged after their own prefill.",
        r.measured_decisions,
        r.decisions,
        r.verdicts_missing,
        r.verdicts_missed_event,
        r.verdicts_saw_own_prefill
    );
    println!(
        "Collector (whole run): {} stored, {} removed blocks, {} decisions, {} sequence gaps \
         ({} batches missed), {} unknown parents, {} fully cached decisions, {} late records, \
         {} verdicts it found judged before an event they depend on.",
        c["stored_blocks"],
        c["removed_blocks"],
        c["decisions"],
        c["sequence_gaps"],
        c["missed_batches"],
        c["unknown_parent_events"],
        c["decisions_fully_cached"],
        c["late_records"],
        c["verdicts_judged_before_event"]
    );
    println!(
        "Collector's bus: {} stream records missing (discarded or gone before it read them); \
         the stream began at sequence {}.",
        r.collector_bus["missing_records"], r.collector_bus["stream_first_seq"]
    );
    println!(
        "Agent (last heartbeat): {} published in {} NATS messages, {} dropped, {} late, {} sequence gaps.",
        a["published"],
        // An agent older than bundles does not count its messages.
        a["messages_published"]
            .as_u64()
            .map_or_else(|| "?".to_string(), |n| n.to_string()),
        a["publish_dropped"],
        a["records_late"],
        a["kv_sequence_gaps"]
    );
    let cpu: Vec<String> = r
        .cpu_cores
        .iter()
        .map(|(k, v)| format!("{k} {v:.2}"))
        .collect();
    println!(
        "CPU over the measured period, in cores: {}.",
        cpu.join(", ")
    );
    let rss: Vec<String> = r
        .rss_mib
        .iter()
        .map(|(k, (a, b))| format!("{k} {a:.0} → {b:.0}"))
        .collect();
    println!(
        "Resident memory over the measured period, MiB: {}.",
        rss.join(", ")
    );
    println!(
        "Load average: {} at start, {} at end.",
        r.load_average_start, r.load_average_end
    );
    if let Some(x) = &r.takeover {
        print_takeover(x);
    }
    if let Some(x) = &r.restart {
        println!(
            "\nCollector killed (SIGKILL) and started again on the stream ({} messages, {:.1} MiB \
             on disk): API answering after {:.2} s, /readyz 200 after {}, the whole stream \
             applied again ({} records rebuilt) after {:.2} s ({:.0} records/s); counters {} \
             the first collector's.",
            x.stream_messages,
            x.stream_bytes as f64 / (1 << 20) as f64,
            x.answered_secs,
            x.ready_secs
                .map_or("never, while it caught up".to_string(), |s| format!(
                    "{s:.2} s"
                )),
            x.rebuilt_records,
            x.caught_up_secs,
            x.rebuilt_records as f64 / x.caught_up_secs.max(1e-9),
            if x.same_counters {
                "equal to"
            } else {
                "NOT equal to"
            }
        );
    }
}

fn print_takeover(x: &RestartReport) {
    println!(
        "\nCollector killed (SIGKILL) on a stream of {} messages ({:.1} MiB on disk), its \
         standby following it: /readyz 200 after {}, the whole stream held after {:.2} s; \
         counters {} the first collector's.",
        x.stream_messages,
        x.stream_bytes as f64 / (1 << 20) as f64,
        x.ready_secs
            .map_or("never".to_string(), |s| format!("{s:.2} s")),
        x.caught_up_secs,
        if x.same_counters {
            "equal to"
        } else {
            "NOT equal to"
        }
    );
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Clock ticks per second of `/proc/<pid>/stat` times (100 on Linux x86-64).
const CLK_TCK: f64 = 100.0;

/// utime + stime of each process, in clock ticks (0 when unreadable).
fn cpu_ticks(pids: &[(String, u32)]) -> Vec<(String, u64)> {
    pids.iter()
        .map(|(name, pid)| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // Fields after the command name (which may hold spaces), from field 3 on.
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let f: Vec<&str> = rest.split_whitespace().collect();
            let t = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            (name.clone(), t(11) + t(12))
        })
        .collect()
}

/// `VmRSS` of each process, MiB (0 when unreadable).
fn rss_mib(pids: &[(String, u32)]) -> Vec<(String, f64)> {
    pids.iter()
        .map(|(name, pid)| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let kib = status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
                .unwrap_or(0.0);
            (name.clone(), kib / 1024.0)
        })
        .collect()
}

/// One decision the generator made.
struct Probe {
    request_id: String,
    decided_ns: u64,
    /// When the answer batch this decision depends on was published (None for a
    /// conversation's first turn, which depends on nothing just published).
    event_ns: Option<u64>,
    home: usize,
    /// Leading blocks of the request the home worker holds, the answer included.
    home_expected: usize,
    chosen: usize,
    /// Leading blocks the chosen worker holds before the turn's prefill.
    chosen_expected: usize,
}

#[derive(Debug, Clone, Default)]
struct Counts {
    stored: u64,
    removed: u64,
    decisions: u64,
}

struct Conversation {
    id: u64,
    locals: Vec<u64>,
    seqs: Vec<u64>,
    turns: u32,
    home: usize,
    /// Leading blocks of `seqs` each worker holds.
    held: HashMap<usize, usize>,
    /// Answer blocks generated on `home`, to be stored at the start of the next turn.
    answer_pending: bool,
}

/// Which conversations a worker holds, least recently used first.
#[derive(Default)]
struct WorkerCache {
    used: usize,
    clock: u64,
    lru: BTreeMap<u64, u64>,
    stamp: HashMap<u64, u64>,
}

impl WorkerCache {
    fn touch(&mut self, conv: u64) {
        self.clock += 1;
        if let Some(old) = self.stamp.insert(conv, self.clock) {
            self.lru.remove(&old);
        }
        self.lru.insert(self.clock, conv);
    }
}

/// msgpack KV event batches for one worker, built up during a phase.
struct Outbox {
    events: Vec<u8>,
    n: u32,
    seq: u64,
}

struct Generator {
    args: FreshnessArgs,
    sockets: Vec<zeromq::PubSocket>,
    outboxes: Vec<Outbox>,
    log: std::fs::File,
    lines: String,
    rng: SplitMix64,
    convs: HashMap<u64, Conversation>,
    active: Vec<u64>,
    cursor: usize,
    next_conv: u64,
    caches: Vec<WorkerCache>,
    counts: Counts,
    probes: Vec<Probe>,
    /// When each worker's last batch went out (this phase).
    published_ns: Vec<u64>,
}

impl Generator {
    fn new(
        args: &FreshnessArgs,
        sockets: Vec<zeromq::PubSocket>,
        log: &Path,
    ) -> anyhow::Result<Self> {
        let n = sockets.len();
        let mut g = Self {
            args: args.clone(),
            sockets,
            outboxes: (0..n)
                .map(|_| Outbox {
                    events: Vec::new(),
                    n: 0,
                    seq: 0,
                })
                .collect(),
            log: std::fs::OpenOptions::new().append(true).open(log)?,
            lines: String::new(),
            rng: SplitMix64::new(args.seed),
            convs: HashMap::new(),
            active: Vec::new(),
            cursor: 0,
            next_conv: 0,
            caches: (0..n).map(|_| WorkerCache::default()).collect(),
            counts: Counts::default(),
            probes: Vec::new(),
            published_ns: vec![0; n],
        };
        for _ in 0..args.conversations {
            let id = g.new_conversation();
            g.active.push(id);
        }
        Ok(g)
    }

    fn new_conversation(&mut self) -> u64 {
        let id = self.next_conv;
        self.next_conv += 1;
        let home = self.rng.below(self.sockets.len() as u64) as usize;
        self.convs.insert(
            id,
            Conversation {
                id,
                locals: Vec::new(),
                seqs: Vec::new(),
                turns: 0,
                home,
                held: HashMap::new(),
                answer_pending: false,
            },
        );
        id
    }

    /// Every worker sends one empty batch (until the collector has heard from each).
    async fn announce(&mut self) -> anyhow::Result<()> {
        self.send(true).await
    }

    /// Send each worker's pending events as one batch (engines publish on change).
    async fn flush(&mut self) -> anyhow::Result<()> {
        self.send(false).await
    }

    /// One tick: conversations take turns until `due` blocks have been published in
    /// all (or every conversation had its turn this tick).
    async fn tick(&mut self, due: u64) -> anyhow::Result<()> {
        let mut turning = Vec::new();
        let mut planned = self.counts.stored + self.counts.removed;
        while planned < due && turning.len() < self.active.len() {
            let id = self.active[self.cursor];
            self.cursor = (self.cursor + 1) % self.active.len();
            let c = &self.convs[&id];
            // A rough plan of this turn's blocks (stores; removals follow them).
            let next_len = c.seqs.len() + self.args.answer_blocks + self.args.prompt_blocks;
            planned += 2 * (next_len - c.held.get(&c.home).copied().unwrap_or(0)) as u64;
            turning.push(id);
        }
        if turning.is_empty() {
            return Ok(());
        }
        // Phase 1: the previous turns' answers (decode finished) are stored.
        let mut answered = Vec::with_capacity(turning.len());
        for &id in &turning {
            answered.push(self.store_answer(id));
        }
        self.flush().await?;
        let answer_ns = self.published_ns.clone();
        // Phase 2: the next turns are routed and logged.
        let decided_ns = now_ns();
        let ts = rfc3339(decided_ns);
        let mut prefills = Vec::with_capacity(turning.len());
        for (&id, answered) in turning.iter().zip(answered) {
            prefills.push(self.decide(id, decided_ns, &ts, answered.then(|| answer_ns.clone())));
        }
        self.log.write_all(self.lines.as_bytes())?;
        self.lines.clear();
        // Phase 3: the chosen workers store the turns' prefills.
        for (id, chosen) in turning.iter().zip(prefills) {
            self.prefill(*id, chosen);
        }
        self.flush().await
    }

    fn store_answer(&mut self, id: u64) -> bool {
        let Some(c) = self.convs.get(&id) else {
            return false;
        };
        if !c.answer_pending {
            return false;
        }
        let home = c.home;
        self.extend(id, self.args.answer_blocks);
        self.store(id, home);
        true
    }

    /// Append `n` new blocks to the conversation's chain.
    fn extend(&mut self, id: u64, n: usize) {
        let bs = self.args.block_size as usize;
        let c = self.convs.get_mut(&id).expect("a live conversation");
        for _ in 0..n {
            let tokens = block_tokens(c.id, c.locals.len(), bs);
            let local = local_block_hash(&tokens, DYNAMO_HASH_SEED);
            let seq = chain_hash(c.seqs.last().copied(), local);
            c.locals.push(local);
            c.seqs.push(seq);
        }
    }

    /// Store on `w` every block of the conversation's chain it does not hold yet,
    /// evicting least recently used conversations first when the cache is full.
    fn store(&mut self, id: u64, w: usize) {
        let (from, len) = {
            let c = &self.convs[&id];
            (c.held.get(&w).copied().unwrap_or(0), c.seqs.len())
        };
        let new = len - from;
        self.caches[w].touch(id);
        while self.caches[w].used + new > self.args.capacity_blocks {
            let Some((&stamp, &victim)) = self.caches[w].lru.iter().find(|(_, c)| **c != id) else {
                break;
            };
            self.caches[w].lru.remove(&stamp);
            self.caches[w].stamp.remove(&victim);
            self.evict(victim, w);
        }
        if new == 0 {
            return;
        }
        let bs = self.args.block_size as usize;
        let c = self.convs.get_mut(&id).expect("a live conversation");
        let out = &mut self.outboxes[w];
        let buf = &mut out.events;
        out.n += 1;
        enc(rmp::encode::write_map_len(buf, 5));
        enc(rmp::encode::write_str(buf, "type"));
        enc(rmp::encode::write_str(buf, "BlockStored"));
        enc(rmp::encode::write_str(buf, "block_hashes"));
        enc(rmp::encode::write_array_len(buf, new as u32));
        for &s in &c.seqs[from..] {
            enc(rmp::encode::write_uint(buf, s));
        }
        enc(rmp::encode::write_str(buf, "parent_block_hash"));
        match from.checked_sub(1).map(|i| c.seqs[i]) {
            Some(p) => enc(rmp::encode::write_uint(buf, p)),
            None => enc(rmp::encode::write_nil(buf)),
        }
        enc(rmp::encode::write_str(buf, "token_ids"));
        enc(rmp::encode::write_array_len(buf, (new * bs) as u32));
        for i in from..len {
            for t in block_tokens(c.id, i, bs) {
                enc(rmp::encode::write_uint(buf, u64::from(t)));
            }
        }
        enc(rmp::encode::write_str(buf, "block_size"));
        enc(rmp::encode::write_uint(buf, bs as u64));
        c.held.insert(w, len);
        self.caches[w].used += new;
        self.counts.stored += new as u64;
    }

    /// Remove the whole conversation from worker `w`.
    fn evict(&mut self, id: u64, w: usize) {
        let Some(c) = self.convs.get_mut(&id) else {
            return;
        };
        let Some(n) = c.held.remove(&w) else {
            return;
        };
        if c.home == w {
            // Its answer can no longer be stored on top of the evicted prefix.
            c.answer_pending = false;
        }
        let out = &mut self.outboxes[w];
        let buf = &mut out.events;
        out.n += 1;
        enc(rmp::encode::write_map_len(buf, 2));
        enc(rmp::encode::write_str(buf, "type"));
        enc(rmp::encode::write_str(buf, "BlockRemoved"));
        enc(rmp::encode::write_str(buf, "block_hashes"));
        enc(rmp::encode::write_array_len(buf, n as u32));
        for &s in &c.seqs[..n] {
            enc(rmp::encode::write_uint(buf, s));
        }
        self.caches[w].used -= n;
        self.counts.removed += n as u64;
        let retired = c.turns >= self.args.turns && c.held.is_empty();
        if retired && !self.active.contains(&id) {
            self.convs.remove(&id);
        }
    }

    /// Route the conversation's next turn and log it; returns the chosen worker.
    fn decide(&mut self, id: u64, decided_ns: u64, ts: &str, answer_ns: Option<Vec<u64>>) -> usize {
        let workers = self.sockets.len();
        let spill = (self.rng.next_u64() as f64 / u64::MAX as f64) < self.args.spill;
        let other = self.rng.below(workers as u64 - 1) as usize;
        self.extend(id, self.args.prompt_blocks);
        let c = &self.convs[&id];
        let home = c.home;
        let chosen = if spill && c.turns > 0 {
            (home + 1 + other) % workers
        } else {
            home
        };
        let request_id = format!("c{}-t{}", c.id, c.turns);
        let bs = self.args.block_size;
        let locals: Vec<String> = c.locals.iter().map(u64::to_string).collect();
        use std::fmt::Write as _;
        let _ = writeln!(
            self.lines,
            "{ts} DEBUG dynamo_kv_router::scheduler: [ROUTING_INPUT] request local hashes \
             request_id=\"{request_id}\" isl_tokens={} block_size={bs} num_blocks={} \
             local_hashes=[{}]",
            c.locals.len() as u64 * u64::from(bs),
            c.locals.len(),
            locals.join(", ")
        );
        let _ = writeln!(
            self.lines,
            "{ts}  INFO dynamo_kv_router::scheduler: Selected worker router_mode=\"kv\" \
             request_id=\"{request_id}\" worker_id={} worker_type=decode dp_rank=0",
            WORKER_ID_BASE + chosen as u64
        );
        self.probes.push(Probe {
            request_id,
            decided_ns,
            event_ns: answer_ns.map(|t| t[home]),
            home,
            home_expected: c.held.get(&home).copied().unwrap_or(0),
            chosen,
            chosen_expected: c.held.get(&chosen).copied().unwrap_or(0),
        });
        self.counts.decisions += 1;
        chosen
    }

    /// The chosen worker stores the turn's prefill; the conversation now lives there,
    /// its answer pending; after its last turn a new conversation takes its place.
    fn prefill(&mut self, id: u64, chosen: usize) {
        self.store(id, chosen);
        let turns = self.args.turns;
        let c = self.convs.get_mut(&id).expect("a live conversation");
        c.home = chosen;
        c.turns += 1;
        c.answer_pending = true;
        if c.turns >= turns {
            let fresh = self.new_conversation();
            if let Some(slot) = self.active.iter_mut().find(|a| **a == id) {
                *slot = fresh;
            }
        }
    }

    /// Send each worker's events as one batch; `empty_too`: also workers without any.
    async fn send(&mut self, empty_too: bool) -> anyhow::Result<()> {
        for w in 0..self.sockets.len() {
            let out = &mut self.outboxes[w];
            if out.n == 0 && !empty_too {
                continue;
            }
            let ts = now_ns();
            let mut payload = Vec::with_capacity(out.events.len() + 16);
            enc(rmp::encode::write_array_len(&mut payload, 3));
            enc(rmp::encode::write_f64(&mut payload, ts as f64 / 1e9));
            enc(rmp::encode::write_array_len(&mut payload, out.n));
            payload.extend_from_slice(&out.events);
            enc(rmp::encode::write_uint(&mut payload, 0));
            out.events.clear();
            out.n = 0;
            let frames = vec![
                Bytes::from_static(b"kv-events"),
                Bytes::copy_from_slice(&out.seq.to_be_bytes()),
                Bytes::from(payload),
            ];
            out.seq += 1;
            let msg = ZmqMessage::try_from(frames)
                .map_err(|e| anyhow::anyhow!("cannot build a ZMQ message: {e}"))?;
            self.published_ns[w] = ts;
            self.sockets[w]
                .send(msg)
                .await
                .with_context(|| format!("ZMQ publish on worker {w}"))?;
        }
        Ok(())
    }
}

/// Writes into a `Vec<u8>` cannot fail; the encoder's `Result` is for other writers.
fn enc<T, E>(r: Result<T, E>) {
    let _ = r;
}

/// The token ids of block `index` of conversation `conv`: distinct per conversation and
/// position (the first block's differ per conversation, so nothing is shared by chance).
fn block_tokens(conv: u64, index: usize, block_size: usize) -> Vec<u32> {
    let mut r = SplitMix64::new(conv.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index as u64);
    (0..block_size)
        .map(|_| (r.next_u64() % 150_000) as u32)
        .collect()
}

/// `2026-11-29T13:20:01.123456Z` for UNIX ns (tracing's default timestamp format).
fn rfc3339(ns: u64) -> String {
    let secs = ns / 1_000_000_000;
    let micros = (ns % 1_000_000_000) / 1_000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{micros:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339() {
        // Expected values from `date -u -d @SECONDS`.
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000000Z");
        assert_eq!(
            rfc3339(1_795_000_000_123_456_789),
            "2026-11-18T11:06:40.123456Z"
        );
        assert_eq!(
            rfc3339(951_782_400_000_000_000),
            "2000-02-29T00:00:00.000000Z"
        );
    }
}
