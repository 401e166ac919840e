//! The agent's configuration: one documented struct, loaded from a TOML file, then
//! environment overrides (`KVSCOPE_AGENT_*`), then command-line flags (see
//! [`crate::cli`]). Every field has a default, so an empty file is a valid config.
//!
//! ```toml
//! agent_id = "node-1"
//! cluster = "prod"
//! nats_url = "nats://127.0.0.1:4222"   # or a cluster's: "nats://a:4222,nats://b:4222,nats://c:4222"
//! router_log = "/var/log/dynamo/frontend.log"   # "-" for stdin, or a pattern:
//! # router_log = "/var/log/pods/dynamo_*frontend*/*/*.log"
//! from_start = false
//! record = "/var/lib/kvscope/agent.jsonl"
//! buffer_capacity = 100000
//! buffer_max_bytes = 268435456  # and at most this much of their JSON
//! kv_max_message_bytes = 67108864   # a publisher sending more in one message is dropped
//! max_line_bytes = 16777216    # longer router log lines are skipped and counted
//! heartbeat_interval_secs = 1.0
//! stream_max_age_secs = 86400
//! stream_max_bytes = 4294967296  # the stream's oldest records go first past this (0: no limit)
//! stream_replicas = 0          # servers keeping it (0: 3 on a cluster of three or more, else 1)
//! join_timeout_secs = 30.0
//! tenant_field = "x_request_id"          # a request's tenant from its arrival line (default: its cache salt)
//! tenant_pattern = "^([^-]+)-"           # the part of it that names the tenant (first group)
//! reorder_window_ms = 250      # how long records wait for a quiet router log
//! kv_reorder_window_ms = 250   # at most this for a quiet KV event publisher (default: as above)
//! metrics_listen = "127.0.0.1:9464"
//!
//! [nixl]             # eBPF tracing of libnixl.so (needs root, or CAP_SYS_ADMIN + CAP_SYS_PTRACE)
//! enabled = true
//! libraries = ["/opt/venv/lib/python3.11/site-packages/.nixl_cu12.mesonpy.libs/libnixl.so"]
//! discover = true      # also libraries mapped by running processes, rescanned
//! scan_interval_secs = 2.0
//! report_interval_secs = 1.0
//! completion_sites = true  # false: probe every getXferStatus poll instead (costlier)
//! sample_every = 16        # one transfer's record (span) in 16, besides every failed,
//!                          # notifying or slow one; the figures count every transfer
//! slow_transfer_ms = 10.0  # a transfer slower than this always has its record (0: off)
//! tally_series = 512       # the kernel's table of transfer series (~19 KiB each)
//! # pid = 1234         # only this process
//!
//! [nats]             # who this agent is to NATS (see kvscope_wire::nats_security)
//! creds_file = "/var/run/secrets/kvscope/agent.creds"
//! tls_ca_file = "/var/run/secrets/kvscope/ca.pem"
//!
//! [otlp]             # OTLP export (off without an endpoint; see kvscope_otlp::config)
//! endpoint = "http://127.0.0.1:4317"
//!
//! [[kv_endpoints]]
//! endpoint = "tcp://127.0.0.1:5557"
//! worker_id = 7587886582197386541
//! dp_rank = 0          # optional: else the batch's own dp_rank, else 0
//! ```

use crate::nixl::NixlTraceConfig;
use kvscope_kit::config::Env;
use kvscope_wire::WorkerSpec;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// This agent's name in every record it sends (default: the host name).
    /// Env: `KVSCOPE_AGENT_ID`.
    pub agent_id: String,
    /// The cluster the records belong to: one JetStream stream per cluster (default
    /// `default`). Env: `KVSCOPE_AGENT_CLUSTER`.
    pub cluster: String,
    /// NATS server, or a cluster's servers separated by commas (any of them is
    /// connected to, and reconnected to; default `nats://127.0.0.1:4222`). Env:
    /// `KVSCOPE_AGENT_NATS_URL`.
    pub nats_url: String,
    /// Engines' ZMQ KV event publishers to tap, each with the worker identity the router
    /// uses for it (default none). Env: `KVSCOPE_AGENT_KV` as comma-separated
    /// `ENDPOINT=WORKER_ID[/DP]` items.
    pub kv_endpoints: Vec<KvEndpoint>,
    /// The router's log file to follow, `-` for stdin, or a glob pattern (`*`, `?`,
    /// `[…]`) whose every match is followed, looked up again every 2 s (Kubernetes pod
    /// logs; see `taps::router::files`) (default none). Env: `KVSCOPE_AGENT_ROUTER_LOG`.
    pub router_log: Option<String>,
    /// Read the router log from its beginning instead of its end (default false).
    /// Env: `KVSCOPE_AGENT_FROM_START` (`1`/`true`).
    pub from_start: bool,
    /// Append every record the agent produces, as one JSON line, to this file (default
    /// none). Env: `KVSCOPE_AGENT_RECORD`.
    pub record: Option<PathBuf>,
    /// Records kept in memory while NATS is away; beyond it new records are dropped and
    /// counted (default 100000). Env: `KVSCOPE_AGENT_BUFFER_CAPACITY`.
    pub buffer_capacity: usize,
    /// Bytes of records' JSON kept in memory while NATS is away; beyond it new records
    /// are dropped and counted (default 256 MiB). Env: `KVSCOPE_AGENT_BUFFER_MAX_BYTES`.
    pub buffer_max_bytes: usize,
    /// The largest ZMQ message (all frames) a KV event publisher may send; a publisher
    /// that claims more is disconnected before anything of it is held, counted in
    /// `kv_peer_violations`, and reconnected to (default 64 MiB: a batch of ~10M
    /// tokens). Env: `KVSCOPE_AGENT_KV_MAX_MESSAGE_BYTES`.
    pub kv_max_message_bytes: u64,
    /// The longest router log line read; a longer one is skipped to its end and
    /// counted in `log_lines_too_long`, never held whole (default 16 MiB; a decision
    /// of a 1M-token prompt is ~1.4 MB). Env: `KVSCOPE_AGENT_MAX_LINE_BYTES`.
    pub max_line_bytes: usize,
    /// Seconds between heartbeat records carrying the counters (default 1).
    /// Env: `KVSCOPE_AGENT_HEARTBEAT_SECS`.
    pub heartbeat_interval_secs: f64,
    /// The stream's retention in seconds, set when the agent creates or updates it
    /// (default 86400). Env: `KVSCOPE_AGENT_STREAM_MAX_AGE_SECS`.
    pub stream_max_age_secs: u64,
    /// The stream's size limit in bytes, set when the agent creates or updates it: past
    /// it the oldest records are discarded (default 4 GiB; 0: no limit, the age only).
    /// It must fit the NATS server's JetStream store (`max_file_store`), or the server
    /// refuses the stream; without one a busy fleet fills that store and every publish
    /// is refused. Env: `KVSCOPE_AGENT_STREAM_MAX_BYTES`.
    pub stream_max_bytes: u64,
    /// How many servers keep the stream, set when the agent creates or updates it: 0
    /// (default) is 3 when the servers form a cluster of three or more, else 1. Env:
    /// `KVSCOPE_AGENT_STREAM_REPLICAS`.
    pub stream_replicas: usize,
    /// How long, in the log's own time, half a routing decision waits for its other
    /// half before it counts as unjoined (default 30).
    pub join_timeout_secs: f64,
    /// Which log lines decisions come from: `auto` (the router's DEBUG `[ROUTING_INPUT]`
    /// and `Selected worker` lines, and Dynamo's request trace for requests those never
    /// named), `routing_input`, or `request_trace` (`DYN_REQUEST_TRACE=1`, any level).
    /// Env: `KVSCOPE_AGENT_DECISIONS`.
    pub decisions: crate::taps::router::join::DecisionSource,
    /// Once decisions come from the request trace (written when each request ends),
    /// every record waits this long, in milliseconds, so a decision slots in at its
    /// request's arrival time; a request that ends later than that is judged late and
    /// counted in `records_late` (default 10000). Env: `KVSCOPE_AGENT_REQUEST_TRACE_WINDOW_MS`.
    pub request_trace_window_ms: u64,
    /// The field of a request's arrival line (the frontend's INFO `request received`,
    /// which carries the HTTP request's span: `x_request_id`, …) that names the
    /// request's tenant; without it a request's tenant is its cache salt. Env:
    /// `KVSCOPE_AGENT_TENANT_FIELD`.
    pub tenant_field: Option<String>,
    /// The part of `tenant_field`'s value that is the tenant: a regular expression whose
    /// first group (else its whole match) names it; a value it does not match names
    /// none (counted). Env: `KVSCOPE_AGENT_TENANT_PATTERN`.
    pub tenant_pattern: Option<String>,
    /// Serve Prometheus `/metrics` of the agent's counters here (default none).
    /// Env: `KVSCOPE_AGENT_METRICS_LISTEN`.
    pub metrics_listen: Option<String>,
    /// How often the log follower looks for new lines, rotation and truncation, in
    /// milliseconds (default 20).
    pub log_poll_interval_ms: u64,
    /// How long a record waits for records of its sources that happened earlier but
    /// reach the agent later (a router log line vs the ZMQ events of the prefill it
    /// caused), in milliseconds (default 250; 0 sends in arrival order). Records leave
    /// in event-time order; see `sink`. Env: `KVSCOPE_AGENT_REORDER_WINDOW_MS`.
    pub reorder_window_ms: u64,
    /// The longest a record waits for an engine's KV event publisher that has gone
    /// quiet, in milliseconds (default: `reorder_window_ms`). Within it the wait is
    /// measured: twice the largest delivery lag (engine stamp → arrival here) of any
    /// publisher's batches in the last 5–10 s, plus 2 ms, so a decision waits a few ms
    /// for idle workers on a healthy node and longer when the agent falls behind. A
    /// batch delayed beyond the wait is counted in `records_late` and may miss the
    /// decisions it preceded. Env: `KVSCOPE_AGENT_KV_REORDER_WINDOW_MS`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_reorder_window_ms: Option<u64>,
    /// How long a shutdown waits for buffered records to reach NATS, in seconds
    /// (default 5).
    pub shutdown_grace_secs: f64,
    /// eBPF tracing of NIXL (default off). Env: `KVSCOPE_AGENT_NIXL` (`1`/`true`),
    /// `KVSCOPE_AGENT_NIXL_LIBS` (comma-separated paths), `KVSCOPE_AGENT_NIXL_PID`,
    /// `KVSCOPE_AGENT_NIXL_COMPLETION_SITES`, `KVSCOPE_AGENT_NIXL_SAMPLE_EVERY`,
    /// `KVSCOPE_AGENT_NIXL_SLOW_TRANSFER_MS`, `KVSCOPE_AGENT_NIXL_TALLY_SERIES`.
    pub nixl: NixlTraceConfig,
    /// Dynamo's discovery store (default none): workers, models, KV publishers. Env:
    /// Dynamo's own `DYN_DISCOVERY_BACKEND`, `DYN_FILE_KV`, `ETCD_ENDPOINTS`,
    /// `ETCD_AUTH_USERNAME`/`ETCD_AUTH_PASSWORD` (see `kvscope_discovery::config`).
    pub discovery: kvscope_discovery::DiscoveryConfig,
    /// Tap Dynamo's event plane: every discovered KV publisher's channel (ZMQ, or NATS
    /// subjects), so one agent sees the fleet's KV events as the router does (default:
    /// on when discovery is configured and no `kv_endpoints` are given).
    /// Env: `KVSCOPE_AGENT_EVENT_PLANE` (`1`/`0`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_plane: Option<bool>,
    /// The NATS server of Dynamo's event plane when it runs on NATS (default: Dynamo's
    /// `NATS_SERVER`, else `nats_url`). Env: `NATS_SERVER`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_plane_nats_url: Option<String>,
    /// How the agent authenticates to kvscope's bus and checks its TLS (default: none).
    /// Env: `KVSCOPE_NATS_*` (see `kvscope_wire::nats_security`). A server that limits
    /// each agent to its own subjects gives this agent `kvscope.<cluster>.<agent_id>.>`.
    pub nats: kvscope_wire::NatsSecurity,
    /// The credentials of Dynamo's NATS, for the event-plane tap: from Dynamo's own
    /// `NATS_AUTH_*` variables only, as Dynamo's processes read them.
    #[serde(skip)]
    pub event_plane_nats: kvscope_wire::NatsSecurity,
    /// OTLP export of the agent's metrics and NIXL spans (default off: no endpoint).
    /// Env: the standard `OTEL_EXPORTER_OTLP_*`, `OTEL_SERVICE_NAME`, ... (see
    /// `kvscope_otlp::config`).
    pub otlp: kvscope_otlp::OtlpConfig,
}

/// One engine publisher and the worker it belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEndpoint {
    /// ZMQ endpoint of the publisher, e.g. `tcp://127.0.0.1:5557`.
    pub endpoint: String,
    /// The worker (instance) id the router logs for this engine. When absent, the agent
    /// finds it through discovery: the local process listening on the endpoint's port
    /// also serves one worker's request-plane port (found again after every reconnect,
    /// so a restarted engine is its new worker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<u64>,
    /// The publisher's replay socket (vLLM's `replay_endpoint`, the mocker's
    /// `--zmq-replay-ports`): batches missed in a gap, or before the agent first saw the
    /// publisher, are asked from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_endpoint: Option<String>,
    /// Data-parallel rank; when absent, each batch's own `dp_rank` is used (else 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
}

impl std::str::FromStr for KvEndpoint {
    type Err = String;

    /// `ENDPOINT[@REPLAY_ENDPOINT][=WORKER_ID[/DP]]`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addresses, worker) = match s.rsplit_once('=') {
            Some((a, w)) => (a, Some(w)),
            None => (s, None),
        };
        let (endpoint, replay) = match addresses.split_once('@') {
            Some((e, r)) => (e.trim(), Some(r.trim())),
            None => (addresses.trim(), None),
        };
        if endpoint.is_empty() {
            return Err(format!("{s:?} has no endpoint"));
        }
        if replay.is_some_and(str::is_empty) {
            return Err(format!("{s:?} has an empty replay endpoint after @"));
        }
        let worker: Option<WorkerSpec> = worker
            .map(|w| w.parse().map_err(|e| format!("{s:?}: {e}")))
            .transpose()?;
        Ok(KvEndpoint {
            endpoint: endpoint.to_string(),
            worker_id: worker.map(|w| w.worker_id),
            dp_rank: worker.and_then(|w| w.dp_rank),
            replay_endpoint: replay.map(str::to_string),
        })
    }
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            agent_id: default_agent_id(),
            cluster: "default".into(),
            nats_url: "nats://127.0.0.1:4222".into(),
            kv_endpoints: Vec::new(),
            router_log: None,
            from_start: false,
            record: None,
            buffer_capacity: 100_000,
            buffer_max_bytes: 256 << 20,
            kv_max_message_bytes: 64 << 20,
            max_line_bytes: 16 << 20,
            heartbeat_interval_secs: 1.0,
            stream_max_age_secs: 86_400,
            stream_max_bytes: kvscope_wire::subject::DEFAULT_STREAM_MAX_BYTES,
            stream_replicas: 0,
            join_timeout_secs: 30.0,
            decisions: Default::default(),
            request_trace_window_ms: 10_000,
            tenant_field: None,
            tenant_pattern: None,
            metrics_listen: None,
            log_poll_interval_ms: 20,
            reorder_window_ms: 250,
            kv_reorder_window_ms: None,
            shutdown_grace_secs: 5.0,
            nixl: NixlTraceConfig::default(),
            discovery: kvscope_discovery::DiscoveryConfig::default(),
            event_plane: None,
            event_plane_nats_url: None,
            nats: Default::default(),
            event_plane_nats: Default::default(),
            otlp: kvscope_otlp::OtlpConfig::default(),
        }
    }
}

fn default_agent_id() -> String {
    kvscope_kit::host_name().unwrap_or_else(|| "agent".into())
}

impl AgentConfig {
    /// Defaults, then the file (if any), then the process environment.
    pub fn load(file: Option<&Path>) -> anyhow::Result<Self> {
        let mut cfg: Self = kvscope_kit::config::load_file(file)?;
        cfg.apply_env(|k| std::env::var(k).ok())?;
        Ok(cfg)
    }

    pub fn from_toml(text: &str) -> anyhow::Result<Self> {
        Ok(toml::from_str(text)?)
    }

    /// Apply `KVSCOPE_AGENT_*` overrides read through `var`.
    pub fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> anyhow::Result<()> {
        let env = Env::new(&var);
        if let Some(v) = env.get("KVSCOPE_AGENT_ID") {
            self.agent_id = v;
        }
        if let Some(v) = env.get("KVSCOPE_AGENT_CLUSTER") {
            self.cluster = v;
        }
        if let Some(v) = env.get("KVSCOPE_AGENT_NATS_URL") {
            self.nats_url = v;
        }
        if let Some(v) = env.list("KVSCOPE_AGENT_KV")? {
            self.kv_endpoints = v;
        }
        if let Some(v) = env.get("KVSCOPE_AGENT_ROUTER_LOG") {
            self.router_log = Some(v);
        }
        if let Some(v) = env.flag("KVSCOPE_AGENT_FROM_START") {
            self.from_start = v;
        }
        if let Some(v) = env.get("KVSCOPE_AGENT_RECORD") {
            self.record = Some(v.into());
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_BUFFER_CAPACITY")? {
            self.buffer_capacity = v;
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_BUFFER_MAX_BYTES")? {
            self.buffer_max_bytes = v;
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_KV_MAX_MESSAGE_BYTES")? {
            self.kv_max_message_bytes = v;
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_MAX_LINE_BYTES")? {
            self.max_line_bytes = v;
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_DECISIONS")? {
            self.decisions = v;
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_REQUEST_TRACE_WINDOW_MS")? {
            self.request_trace_window_ms = v;
        }
        if let Some(v) = env.get("KVSCOPE_AGENT_TENANT_FIELD") {
            self.tenant_field = Some(v);
        }
        if let Some(v) = env.get("KVSCOPE_AGENT_TENANT_PATTERN") {
            self.tenant_pattern = Some(v);
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_HEARTBEAT_SECS")? {
            self.heartbeat_interval_secs = v;
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_STREAM_MAX_AGE_SECS")? {
            self.stream_max_age_secs = v;
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_STREAM_MAX_BYTES")? {
            self.stream_max_bytes = v;
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_STREAM_REPLICAS")? {
            self.stream_replicas = v;
        }
        if let Some(v) = env.get("KVSCOPE_AGENT_METRICS_LISTEN") {
            self.metrics_listen = Some(v);
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_REORDER_WINDOW_MS")? {
            self.reorder_window_ms = v;
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_KV_REORDER_WINDOW_MS")? {
            self.kv_reorder_window_ms = Some(v);
        }
        if let Some(v) = env.flag("KVSCOPE_AGENT_NIXL") {
            self.nixl.enabled = v;
        }
        if let Some(v) = env.list::<PathBuf>("KVSCOPE_AGENT_NIXL_LIBS")? {
            self.nixl.libraries = v;
            self.nixl.enabled |= !self.nixl.libraries.is_empty();
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_NIXL_PID")? {
            self.nixl.pid = Some(v);
            self.nixl.enabled = true;
        }
        if let Some(v) = env.flag("KVSCOPE_AGENT_NIXL_COMPLETION_SITES") {
            self.nixl.completion_sites = v;
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_NIXL_SAMPLE_EVERY")? {
            self.nixl.sample_every = v;
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_NIXL_SLOW_TRANSFER_MS")? {
            self.nixl.slow_transfer_ms = v;
        }
        if let Some(v) = env.parse("KVSCOPE_AGENT_NIXL_TALLY_SERIES")? {
            self.nixl.tally_series = v;
        }
        if let Some(v) = env.flag("KVSCOPE_AGENT_EVENT_PLANE") {
            self.event_plane = Some(v);
        }
        if let Some(v) = env.trimmed("NATS_SERVER").filter(|v| !v.is_empty()) {
            self.event_plane_nats_url = Some(v);
        }
        self.event_plane_nats = kvscope_wire::NatsSecurity::from_dynamo_env(&var);
        self.nats.apply_env(&var)?;
        self.discovery.apply_env(&var)?;
        self.otlp.apply_env(&var)?;
        Ok(())
    }

    /// Whether the agent taps Dynamo's event plane (see `event_plane`).
    pub(crate) fn taps_event_plane(&self) -> bool {
        self.event_plane.unwrap_or(
            self.discovery.backend != kvscope_discovery::config::BackendKind::None
                && self.kv_endpoints.is_empty(),
        )
    }

    /// Dynamo's NATS for the event-plane tap, and how to authenticate to it: Dynamo's
    /// `NATS_AUTH_*` when given; else, where it is kvscope's own bus, the bus's settings.
    pub(crate) fn event_plane_nats(&self) -> (String, kvscope_wire::NatsSecurity) {
        let url = self
            .event_plane_nats_url
            .clone()
            .unwrap_or_else(|| self.nats_url.clone());
        let security = if !self.event_plane_nats.authenticates() && url == self.nats_url {
            self.nats.clone()
        } else {
            self.event_plane_nats.clone()
        };
        (url, security)
    }

    /// What a KV event publisher may make a tap hold.
    pub(crate) fn kv_limits(&self) -> crate::taps::engine::zmtp::Limits {
        crate::taps::engine::zmtp::Limits {
            max_message_bytes: self.kv_max_message_bytes,
            ..Default::default()
        }
    }

    /// The window for KV event publishers (see `kv_reorder_window_ms`), in ms.
    pub fn kv_reorder_window_ms(&self) -> u64 {
        self.kv_reorder_window_ms.unwrap_or(self.reorder_window_ms)
    }

    /// Which field of a request's arrival line names its tenant (`tenant_field`, its
    /// part `tenant_pattern`), when told; an error for a pattern that is no regular
    /// expression, or one given without a field.
    pub fn tenant_field(&self) -> anyhow::Result<Option<crate::taps::router::join::TenantField>> {
        let pattern = self
            .tenant_pattern
            .as_deref()
            .map(|p| regex::Regex::new(p).map_err(|e| anyhow::anyhow!("tenant_pattern {p:?}: {e}")))
            .transpose()?;
        match self.tenant_field.as_deref().map(str::trim) {
            Some(field) if !field.is_empty() => Ok(Some(crate::taps::router::join::TenantField {
                field: field.to_string(),
                pattern,
            })),
            _ => {
                anyhow::ensure!(
                    pattern.is_none(),
                    "tenant_pattern is set but tenant_field, the field it reads, is not"
                );
                Ok(None)
            }
        }
    }

    /// Reject values the agent cannot run with.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.agent_id.trim().is_empty(), "agent_id is empty");
        self.tenant_field()?;
        anyhow::ensure!(self.buffer_capacity > 0, "buffer_capacity must be > 0");
        anyhow::ensure!(self.buffer_max_bytes > 0, "buffer_max_bytes must be > 0");
        anyhow::ensure!(
            self.kv_max_message_bytes > 0,
            "kv_max_message_bytes must be > 0"
        );
        anyhow::ensure!(self.max_line_bytes > 0, "max_line_bytes must be > 0");
        anyhow::ensure!(
            self.heartbeat_interval_secs.is_finite() && self.heartbeat_interval_secs > 0.0,
            "heartbeat_interval_secs must be > 0"
        );
        anyhow::ensure!(
            self.join_timeout_secs.is_finite() && self.join_timeout_secs >= 0.0,
            "join_timeout_secs must be >= 0"
        );
        anyhow::ensure!(
            self.shutdown_grace_secs.is_finite() && self.shutdown_grace_secs >= 0.0,
            "shutdown_grace_secs must be >= 0"
        );
        anyhow::ensure!(
            self.nixl.sample_every >= 1,
            "nixl.sample_every must be >= 1 (1: every transfer's record)"
        );
        anyhow::ensure!(
            self.nixl.tally_series >= 1,
            "nixl.tally_series must be >= 1"
        );
        anyhow::ensure!(
            self.nixl.slow_transfer_ms.is_finite() && self.nixl.slow_transfer_ms >= 0.0,
            "nixl.slow_transfer_ms must be >= 0 (0: no transfer kept for being slow)"
        );
        let discovery = self
            .discovery
            .backend()
            .map_err(|e| anyhow::anyhow!("discovery: {e}"))?;
        anyhow::ensure!(
            self.kv_endpoints.len()
                + usize::from(self.router_log.is_some())
                + usize::from(self.nixl.enabled)
                + usize::from(self.taps_event_plane())
                > 0,
            "nothing to tap: give --kv, --router-log, --nixl, or Dynamo's discovery (DYN_DISCOVERY_BACKEND) for its event plane"
        );
        if let Some(ep) = self.kv_endpoints.iter().find(|e| e.worker_id.is_none()) {
            anyhow::ensure!(
                discovery.is_some(),
                "--kv {} has no worker id: give ENDPOINT=WORKER_ID, or Dynamo's discovery (DYN_DISCOVERY_BACKEND, --discovery) so the agent finds it",
                ep.endpoint
            );
        }
        anyhow::ensure!(
            !self.taps_event_plane() || discovery.is_some(),
            "the event plane's channels come from Dynamo's discovery: set DYN_DISCOVERY_BACKEND or --discovery"
        );
        anyhow::ensure!(
            self.nixl.scan_interval_secs.is_finite() && self.nixl.scan_interval_secs > 0.0,
            "nixl.scan_interval_secs must be > 0"
        );
        anyhow::ensure!(
            self.nixl.report_interval_secs.is_finite() && self.nixl.report_interval_secs > 0.0,
            "nixl.report_interval_secs must be > 0"
        );
        self.nats.validate()?;
        self.otlp.validate()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_kit::config::documented_toml_example;

    #[test]
    fn an_empty_file_gives_the_defaults() {
        let c = AgentConfig::from_toml("").unwrap();
        assert_eq!(c, AgentConfig::default());
        assert_eq!(c.cluster, "default");
        assert_eq!(c.nats_url, "nats://127.0.0.1:4222");
        assert!(!c.agent_id.is_empty());
    }

    #[test]
    fn the_documented_example_parses() {
        let example = documented_toml_example(include_str!("config.rs")).unwrap();
        let c = AgentConfig::from_toml(&example).unwrap();
        assert_eq!(
            c.kv_endpoints,
            vec![KvEndpoint {
                endpoint: "tcp://127.0.0.1:5557".into(),
                replay_endpoint: None,
                worker_id: Some(7587886582197386541),
                dp_rank: Some(0)
            }]
        );
        assert_eq!(c.metrics_listen.as_deref(), Some("127.0.0.1:9464"));
        assert!(c.otlp.target(kvscope_otlp::Signal::Metrics).is_some());
        let t = c.tenant_field().unwrap().unwrap();
        assert_eq!(t.field, "x_request_id");
        assert!(t.pattern.is_some());
    }

    #[test]
    fn a_tenant_pattern_must_be_a_regex_and_have_its_field() {
        let c = |toml: &str| AgentConfig::from_toml(toml).unwrap();
        assert!(c("").tenant_field().unwrap().is_none());
        assert!(c("tenant_field = \"user\"")
            .tenant_field()
            .unwrap()
            .is_some());
        let e = c("tenant_field = \"user\"\ntenant_pattern = \"(\"")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("tenant_pattern"), "{e}");
        let e = c("tenant_pattern = \"^(a)\"").validate().unwrap_err();
        assert!(e.to_string().contains("tenant_field"), "{e}");
    }

    #[test]
    fn unknown_fields_are_refused() {
        assert!(AgentConfig::from_toml("nats = \"x\"").is_err());
        assert!(AgentConfig::from_toml(
            "[[kv_endpoints]]\nendpoint = \"e\"\nworker_id = 1\nworker = 2"
        )
        .is_err());
    }

    #[test]
    fn env_overrides_the_file() {
        let mut c = AgentConfig::from_toml("cluster = \"file\"\nbuffer_capacity = 5").unwrap();
        c.apply_env(|k| match k {
            "KVSCOPE_AGENT_CLUSTER" => Some("env".into()),
            "KVSCOPE_AGENT_KV" => Some("tcp://127.0.0.1:1=5,tcp://127.0.0.1:2=6/1".into()),
            "KVSCOPE_AGENT_FROM_START" => Some("1".into()),
            "KVSCOPE_AGENT_STREAM_MAX_BYTES" => Some("0".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(c.cluster, "env");
        assert_eq!(c.stream_max_bytes, 0, "0: no byte limit");
        assert_eq!(c.buffer_capacity, 5);
        assert!(c.from_start);
        assert_eq!(
            c.kv_endpoints[1],
            KvEndpoint {
                endpoint: "tcp://127.0.0.1:2".into(),
                replay_endpoint: None,
                worker_id: Some(6),
                dp_rank: Some(1)
            }
        );
        assert!(c
            .clone()
            .apply_env(|k| (k == "KVSCOPE_AGENT_BUFFER_CAPACITY").then(|| "many".into()))
            .is_err());
    }

    #[test]
    fn kv_endpoint_specs() {
        let e: KvEndpoint = "tcp://127.0.0.1:5557=42".parse().unwrap();
        assert_eq!((e.worker_id, e.dp_rank), (Some(42), None));
        let e: KvEndpoint = "tcp://127.0.0.1:5557=42/3".parse().unwrap();
        assert_eq!(e.dp_rank, Some(3));
        let e: KvEndpoint = "tcp://127.0.0.1:5557".parse().unwrap();
        assert_eq!(
            (e.worker_id, e.endpoint.as_str()),
            (None, "tcp://127.0.0.1:5557")
        );
        for bad in ["", "=4", "tcp://x=abc", "tcp://x=1/y", "@tcp://r"] {
            assert!(bad.parse::<KvEndpoint>().is_err(), "{bad}");
        }
    }
}
