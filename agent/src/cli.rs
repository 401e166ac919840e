//! Command line: `kvscope-agent` and `kvscope agent`. Flags override the config file
//! and the `KVSCOPE_AGENT_*` environment (see [`crate::config`]).

use crate::config::{AgentConfig, KvEndpoint};
use clap::Parser;
use std::path::PathBuf;

/// Per-node kvscope agent: taps engines' ZMQ KV events and the router's log, and ships
/// normalized records to NATS JetStream.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvscope-agent", version, args_conflicts_with_subcommands = true, after_help = format!("{}\n\n{}", kvscope_otlp::HELP, kvscope_wire::nats_security::HELP))]
pub struct Cli {
    /// TOML config file (every field optional; see the `config` module docs).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub log: kvscope_kit::LogArgs,
    /// This agent's name in its records [default: the host name].
    #[arg(long)]
    pub agent_id: Option<String>,
    /// Cluster name: one JetStream stream per cluster [default: default].
    #[arg(long)]
    pub cluster: Option<String>,
    /// NATS server, or a cluster's servers separated by commas
    /// [default: nats://127.0.0.1:4222].
    #[arg(long)]
    pub nats_url: Option<String>,
    /// An engine's KV event publisher (vLLM's format), e.g. tcp://127.0.0.1:5557, and,
    /// without discovery, its worker: ENDPOINT=WORKER_ID[/DP_RANK]. With discovery the
    /// agent finds the worker itself (the process listening on the endpoint, or an ancestor
    /// of it, serves the worker's request plane; or it shares the worker's pod).
    /// Repeatable; replaces the config's list.
    #[arg(long = "kv", value_name = "ENDPOINT[=WORKER_ID[/DP]]")]
    pub kv: Vec<KvEndpoint>,
    /// Dynamo's discovery store: file, etcd or none [default: $DYN_DISCOVERY_BACKEND,
    /// else none]. The file backend's root is $DYN_FILE_KV (or --discovery-root), etcd's
    /// endpoints $ETCD_ENDPOINTS (or --etcd-endpoints), as Dynamo reads them.
    #[arg(long, value_name = "BACKEND")]
    pub discovery: Option<kvscope_discovery::config::BackendKind>,
    /// The file discovery backend's root folder [default: $DYN_FILE_KV].
    #[arg(long, value_name = "DIR")]
    pub discovery_root: Option<PathBuf>,
    /// etcd endpoints, comma-separated [default: $ETCD_ENDPOINTS, else http://localhost:2379].
    #[arg(long, value_name = "URLS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Tap Dynamo's event plane (every discovered KV publisher) [default: on with
    /// discovery and no --kv].
    #[arg(long, overrides_with = "no_event_plane")]
    pub event_plane: bool,
    /// Do not tap Dynamo's event plane.
    #[arg(long)]
    pub no_event_plane: bool,
    /// The router's log file to follow (like tail -F), - for stdin, or a glob pattern
    /// whose every match is followed (e.g. '/var/log/pods/dynamo_*frontend*/*/*.log' on a
    /// Kubernetes node: each frontend pod's newest log, found again every 2 s).
    #[arg(long, value_name = "PATH|-|PATTERN")]
    pub router_log: Option<String>,
    /// Read the router log from its beginning rather than its end.
    #[arg(long)]
    pub from_start: bool,
    /// Append every record, one JSON line each, to this file.
    #[arg(long, value_name = "FILE")]
    pub record: Option<PathBuf>,
    /// Records kept in memory while NATS is away [default: 100000].
    #[arg(long)]
    pub buffer_capacity: Option<usize>,
    /// Bytes of records kept in memory while NATS is away [default: 268435456].
    #[arg(long)]
    pub buffer_max_bytes: Option<usize>,
    /// The largest ZMQ message a KV publisher may send; one claiming more is
    /// disconnected and counted [default: 67108864].
    #[arg(long)]
    pub kv_max_message_bytes: Option<u64>,
    /// The longest router log line read; longer ones are skipped and counted
    /// [default: 16777216].
    #[arg(long)]
    pub max_line_bytes: Option<usize>,
    /// Where decisions come from: auto, routing-input or request-trace [default: auto].
    #[arg(long, value_name = "SOURCE")]
    pub decisions: Option<crate::taps::router::join::DecisionSource>,
    /// How long records wait for request-trace decisions, in ms [default: 10000].
    #[arg(long)]
    pub request_trace_window_ms: Option<u64>,
    /// The field of a request's arrival line (the frontend's `request received`, with the
    /// HTTP request's span: e.g. x_request_id) that names its tenant [default: none, a
    /// request's tenant is its cache salt].
    #[arg(long, value_name = "FIELD")]
    pub tenant_field: Option<String>,
    /// A regular expression whose first group (else its whole match) is the tenant
    /// within --tenant-field's value [default: the whole value].
    #[arg(long, value_name = "REGEX")]
    pub tenant_pattern: Option<String>,
    /// Seconds between heartbeats [default: 1].
    #[arg(long)]
    pub heartbeat_secs: Option<f64>,
    /// Retention of the JetStream stream in seconds [default: 86400].
    #[arg(long)]
    pub stream_max_age_secs: Option<u64>,
    /// The stream's size limit in bytes: past it the oldest records are discarded; it
    /// must fit the NATS server's JetStream store (0: no limit) [default: 4294967296].
    #[arg(long)]
    pub stream_max_bytes: Option<u64>,
    /// How many servers keep the stream (0: 3 when the servers form a cluster of three
    /// or more, else 1) [default: 0].
    #[arg(long)]
    pub stream_replicas: Option<usize>,
    /// How long half a routing decision waits for the other half, in log seconds
    /// [default: 30].
    #[arg(long)]
    pub join_timeout_secs: Option<f64>,
    /// Serve Prometheus /metrics on this address, e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<String>,
    /// How long records wait for earlier ones that arrive later, in milliseconds
    /// [default: 250; 0 = arrival order].
    #[arg(long)]
    pub reorder_window_ms: Option<u64>,
    /// The longest records wait for a quiet KV event publisher, in milliseconds
    /// [default: the reorder window]. Within it the wait is twice the largest recent
    /// delivery lag of KV batches plus 2 ms (a few ms on a healthy node); a batch later
    /// than the wait is counted as late.
    #[arg(long)]
    pub kv_reorder_window_ms: Option<u64>,
    /// Trace NIXL with eBPF: libnixl.so files mapped by running processes, found by
    /// scanning /proc now and every few seconds. Needs root (or CAP_SYS_ADMIN + CAP_SYS_PTRACE).
    #[arg(long)]
    pub nixl: bool,
    /// A libnixl.so to trace from the start, before any process maps it (repeatable;
    /// implies --nixl).
    #[arg(long = "nixl-lib", value_name = "PATH")]
    pub nixl_lib: Vec<PathBuf>,
    /// Trace NIXL in this process only (implies --nixl).
    #[arg(long, value_name = "PID")]
    pub nixl_pid: Option<u32>,
    /// Do not scan /proc for libnixl.so: trace only --nixl-lib files.
    #[arg(long)]
    pub no_nixl_discover: bool,
    /// Probe every createXferReq, makeXferReq, getXferStatus and releaseXferReq call,
    /// even where the build's completion sites are known (which fire only on a failed
    /// creation and once per transfer end instead: two hits per transfer). The figures
    /// are the same; the traced loop pays more.
    #[arg(long)]
    pub nixl_status_probes: bool,
    /// Send one NIXL transfer's record in N (its span, its join to a request), besides
    /// every failed one, every one carrying a notification and every slow one. The
    /// transfer figures are counted in the kernel, exact for every transfer, whatever N
    /// is (on a build whose struct offsets are known; otherwise every record is sent).
    #[arg(long, value_name = "N")]
    pub nixl_sample_every: Option<u64>,
    /// A NIXL transfer slower than this (post to terminal status) always has its record
    /// sent; 0: none for being slow.
    #[arg(long, value_name = "MS")]
    pub nixl_slow_transfer_ms: Option<f64>,
    /// Series (process, local and remote agent, op, stage, status) the kernel's table of
    /// NIXL transfer tallies holds (preallocated, ~19 KiB each per traced library); a
    /// series past it has every transfer's record sent and counted by the agent.
    #[arg(long, value_name = "N")]
    pub nixl_tally_series: Option<u32>,
    /// Print the effective configuration as TOML and exit (secrets such as OTLP headers
    /// shown as <redacted>).
    #[arg(long)]
    pub print_config: bool,
    #[command(subcommand)]
    pub command: Option<AgentCommand>,
}

/// What the agent can do besides running.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum AgentCommand {
    /// Read a libnixl.so and print what the NIXL probes would read of it: each struct
    /// offset and the instructions it was derived from, the fields that could not be
    /// derived and why, and its completion sites with the instructions that placed them
    /// (or why there are none). Reads x86-64 and aarch64 builds (an aarch64 build's
    /// offsets only: the probes attach to x86-64 builds). Attach the output
    /// to a bug report about NIXL figures. Needs no privileges: it only reads the file.
    NixlInspect {
        /// The library file (e.g. a wheel's .nixl_cu12.mesonpy.libs/libnixl.so).
        library: PathBuf,
    },
}

/// `kvscope agent nixl-inspect LIB`'s text.
pub(crate) fn nixl_inspect(library: &std::path::Path) -> anyhow::Result<String> {
    use crate::nixl::offsets::Counts;
    let lib = crate::nixl::library::NixlLibrary::inspect(library, true)?;
    let mut s = format!(
        "library        {}\nbuild-id       {}\n",
        lib.path.display(),
        if lib.build_id.is_empty() {
            "(none)"
        } else {
            &lib.build_id
        }
    );
    s.push_str(&format!("isa            {}\n", lib.derivation.isa.name()));
    if lib.derivation.isa != crate::nixl::derive::Isa::X86_64 {
        // Derived offline: no probe is attached to such a build, so nothing is "read".
        s.push_str(&format!(
            "offsets        {}\nprobes         none: the probes read x86-64 registers \
             (the offsets are derived to check them against the x86-64 build's)\n\n",
            match lib.derivation.offsets() {
                Ok(_) => "all derived".to_string(),
                Err(why) => format!("unknown ({why})"),
            }
        ));
        s.push_str(&lib.derivation.report());
        return Ok(s);
    }
    s.push_str(&format!(
        "offsets        {}\n",
        match lib.derivation.offsets() {
            Ok(o) => match o.counts {
                Counts::Always => {
                    "all derived: bytes, ops, remote agents and notifications are read".into()
                }
                Counts::WithTelemetry { .. } => "all derived: ops, remote agents and \
                    notifications are read; bytes and descriptor counts when the agent's \
                    telemetry is enabled (see the end)"
                    .to_string(),
                Counts::Never => "all derived: ops, remote agents and notifications are \
                    read; bytes and descriptor counts are not (see the end)"
                    .to_string(),
            },
            Err(why) => format!(
                "unknown ({why}): calls, statuses and latencies are counted, nothing \
                 is read of the requests"
            ),
        }
    ));
    s.push_str(&format!(
        "ends           {}\n",
        match &lib.derivation.end_sites {
            _ if lib.sites => {
                "at the completion sites of getXferStatus and releaseXferReq (one probe hit per \
             transfer end)"
                    .to_string()
            }
            Ok(_) => "probed on every getXferStatus poll and release (sites disabled, or \
                      the offsets unknown)"
                .to_string(),
            Err(_) => "probed on every getXferStatus poll and release (no completion sites: \
                       see the end)"
                .to_string(),
        }
    ));
    s.push_str(&format!(
        "posts          {}\n",
        match &lib.derivation.post_site {
            _ if lib.post_at_site => {
                "at the site where postXferReq's status is final (one probe hit per post \
                 besides its entry)"
                    .to_string()
            }
            Ok(_) => "at postXferReq's return (sites disabled, or the offsets unknown)".to_string(),
            Err(_) => "at postXferReq's return (no site: see the end)".to_string(),
        }
    ));
    s.push_str(&format!(
        "creations      {}\n",
        match (&lib.derivation.create_sites, &lib.derivation.make_sites) {
            _ if lib.creations_at_sites => "at the failure sites of createXferReq and \
                makeXferReq (no probe hit on a successful creation)"
                .to_string(),
            (Ok(_), Ok(_)) => "at the methods' entries and returns (sites disabled, or the \
                offsets unknown)"
                .to_string(),
            _ => "at the methods' entries and returns (no failure sites: see the end)".to_string(),
        }
    ));
    if !lib.missing.is_empty() {
        s.push_str(&format!("not exported   {}\n", lib.missing.join(", ")));
    }
    s.push('\n');
    s.push_str(&lib.derivation.report());
    Ok(s)
}

impl Cli {
    /// Defaults < file < environment < flags.
    pub fn config(&self) -> anyhow::Result<AgentConfig> {
        let mut cfg = AgentConfig::load(self.config.as_deref())?;
        self.apply(&mut cfg);
        Ok(cfg)
    }

    fn apply(&self, cfg: &mut AgentConfig) {
        if let Some(v) = &self.agent_id {
            cfg.agent_id = v.clone();
        }
        if let Some(v) = &self.cluster {
            cfg.cluster = v.clone();
        }
        if let Some(v) = &self.nats_url {
            cfg.nats_url = v.clone();
        }
        if !self.kv.is_empty() {
            cfg.kv_endpoints = self.kv.clone();
        }
        if let Some(b) = self.discovery {
            cfg.discovery.backend = b;
        }
        if let Some(d) = &self.discovery_root {
            cfg.discovery.file_root = Some(d.clone());
        }
        if !self.etcd_endpoints.is_empty() {
            cfg.discovery.etcd_endpoints = self.etcd_endpoints.clone();
        }
        if self.event_plane {
            cfg.event_plane = Some(true);
        }
        if self.no_event_plane {
            cfg.event_plane = Some(false);
        }
        if let Some(v) = &self.router_log {
            cfg.router_log = Some(v.clone());
        }
        if self.from_start {
            cfg.from_start = true;
        }
        if let Some(v) = &self.record {
            cfg.record = Some(v.clone());
        }
        if let Some(v) = self.buffer_capacity {
            cfg.buffer_capacity = v;
        }
        if let Some(v) = self.buffer_max_bytes {
            cfg.buffer_max_bytes = v;
        }
        if let Some(v) = self.kv_max_message_bytes {
            cfg.kv_max_message_bytes = v;
        }
        if let Some(v) = self.max_line_bytes {
            cfg.max_line_bytes = v;
        }
        if let Some(v) = self.decisions {
            cfg.decisions = v;
        }
        if let Some(v) = self.request_trace_window_ms {
            cfg.request_trace_window_ms = v;
        }
        if let Some(v) = &self.tenant_field {
            cfg.tenant_field = Some(v.clone());
        }
        if let Some(v) = &self.tenant_pattern {
            cfg.tenant_pattern = Some(v.clone());
        }
        if let Some(v) = self.heartbeat_secs {
            cfg.heartbeat_interval_secs = v;
        }
        if let Some(v) = self.stream_max_age_secs {
            cfg.stream_max_age_secs = v;
        }
        if let Some(v) = self.stream_max_bytes {
            cfg.stream_max_bytes = v;
        }
        if let Some(v) = self.stream_replicas {
            cfg.stream_replicas = v;
        }
        if let Some(v) = self.join_timeout_secs {
            cfg.join_timeout_secs = v;
        }
        if let Some(v) = &self.metrics_listen {
            cfg.metrics_listen = Some(v.clone());
        }
        if let Some(v) = self.reorder_window_ms {
            cfg.reorder_window_ms = v;
        }
        if let Some(v) = self.kv_reorder_window_ms {
            cfg.kv_reorder_window_ms = Some(v);
        }
        if self.nixl {
            cfg.nixl.enabled = true;
        }
        if !self.nixl_lib.is_empty() {
            cfg.nixl.libraries = self.nixl_lib.clone();
            cfg.nixl.enabled = true;
        }
        if let Some(pid) = self.nixl_pid {
            cfg.nixl.pid = Some(pid);
            cfg.nixl.enabled = true;
        }
        if self.no_nixl_discover {
            cfg.nixl.discover = false;
        }
        if self.nixl_status_probes {
            cfg.nixl.completion_sites = false;
        }
        if let Some(v) = self.nixl_sample_every {
            cfg.nixl.sample_every = v;
        }
        if let Some(v) = self.nixl_slow_transfer_ms {
            cfg.nixl.slow_transfer_ms = v;
        }
        if let Some(v) = self.nixl_tally_series {
            cfg.nixl.tally_series = v;
        }
    }
}

/// Run the agent until SIGINT or SIGTERM. The caller installs the tracing subscriber.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(AgentCommand::NixlInspect { library }) = &cli.command {
        print!("{}", nixl_inspect(library)?);
        return Ok(());
    }
    let cfg = cli.config()?;
    if cli.print_config {
        print!("{}", kvscope_kit::config::to_redacted_toml(&cfg)?);
        return Ok(());
    }
    let agent = crate::agent::start(cfg).await?;
    agent.run_until(shutdown_signal()).await;
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_as_the_lab_passes_them() {
        let cli = Cli::try_parse_from([
            "kvscope-agent",
            "--nats-url",
            "nats://127.0.0.1:4333",
            "--cluster",
            "lab",
            "--agent-id",
            "lab-node",
            "--router-log",
            "/tmp/frontend.log",
            "--from-start",
            "--record",
            "/tmp/r.jsonl",
            "--kv",
            "tcp://127.0.0.1:45289=9969664417447597980",
            "--kv",
            "tcp://127.0.0.1:44529=758491669810558404/1",
        ])
        .unwrap();
        let mut cfg = AgentConfig::default();
        cli.apply(&mut cfg);
        assert_eq!(cfg.cluster, "lab");
        assert_eq!(cfg.agent_id, "lab-node");
        assert!(cfg.from_start);
        assert_eq!(cfg.kv_endpoints.len(), 2);
        assert_eq!(cfg.kv_endpoints[1].dp_rank, Some(1));
        assert_eq!(cfg.kv_endpoints[0].worker_id, Some(9969664417447597980));
        cfg.validate().unwrap();
        // Without an id the endpoint's worker comes from discovery, which must be set.
        let bare = Cli::try_parse_from(["kvscope-agent", "--kv", "tcp://127.0.0.1:5557"]).unwrap();
        let mut cfg = AgentConfig::default();
        bare.apply(&mut cfg);
        let err = cfg.validate().unwrap_err().to_string();
        assert!(
            err.contains("no worker id") && err.contains("DYN_DISCOVERY_BACKEND"),
            "{err}"
        );
        let with = Cli::try_parse_from([
            "kvscope-agent",
            "--kv",
            "tcp://127.0.0.1:5557",
            "--discovery",
            "file",
            "--discovery-root",
            "/tmp/store",
        ])
        .unwrap();
        let mut cfg = AgentConfig::default();
        with.apply(&mut cfg);
        cfg.validate().unwrap();
        assert!(
            !cfg.taps_event_plane(),
            "engine taps given: no event plane by default"
        );
        assert!(Cli::try_parse_from(["kvscope-agent", "--discovery", "zookeeper"]).is_err());
    }

    #[test]
    fn the_effective_config_prints_and_reads_back() {
        let mut cfg = AgentConfig::default();
        cfg.kv_endpoints
            .push("tcp://127.0.0.1:1=2".parse().unwrap());
        cfg.router_log = Some("-".into());
        let text = toml::to_string_pretty(&cfg).unwrap();
        assert_eq!(AgentConfig::from_toml(&text).unwrap(), cfg);
    }
}
