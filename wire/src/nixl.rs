//! NIXL figures an agent's probes measured: cumulative counters per process, local NIXL
//! agent, remote agent, op and status, sent periodically. Cumulative (not deltas) so a
//! lost or duplicated report never skews a total: the collector keeps only the latest
//! whole report per agent (keyed by the envelope's agent name, each one replacing the
//! last) and sums its rows over pids per (local NIXL agent, remote NIXL agent) pair.
//! Per-pid rows never go backwards because the agent folds the figures of a process
//! that exits into pid 0 rather than dropping them; rates are left to whoever reads
//! the cumulative counters (e.g. Prometheus `rate()` on the collector's `/metrics`).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Upper bounds (inclusive, nanoseconds) of the latency buckets: 1-2.5-5 steps from 1 µs
/// to 10 s. Shared by agent and collector so histograms from many agents add up.
pub const LATENCY_BOUNDS_NS: [u64; 22] = [
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// The `call` names (as the agent reports them) that are metadata exchanges: the
/// handshakes counted per pair.
pub const HANDSHAKE_CALLS: [&str; 7] = [
    "loadRemoteMD",
    "loadRemoteMD_async",
    "fetchRemoteMD",
    "sendLocalMD",
    "makeConnection",
    "checkRemoteMD",
    "invalidateRemoteMD",
];

/// The request a transfer's notification names, when it is in vLLM's NixlConnector
/// format, `<request id>:<n>`, which every release since 0.9.1 sends with its KV
/// transfers (and the NIXL lab's data plane too); `None` for anything else: nothing is
/// guessed. Whose id, and what `n` is, changed over the releases:
///
/// | vLLM | path | id | n |
/// |---|---|---|---|
/// | 0.9.1 – 0.12 | decode READs | the decode side's own | tp ratio |
/// | 0.13 | decode READs | the prefill side's (`remote_request_id`) | tp ratio |
/// | 0.14 – 0.28 | decode READs | the prefill side's | decode world size |
/// | 0.29 on | decode READs | the prefill side's | expected consumers |
/// | 0.24 on | prefill WRITEs (push) | the decode side's | prefill world size |
///
/// 0.9.0 sent the bare id (not read: any text could be one). Heartbeats (`HB:<ids>`)
/// and push registrations (`PUSH_REG:<msgpack>`) are sent with `genNotif`, not with a
/// transfer, and are refused here too. vLLM appends `-<8 hex digits>` to the id a
/// request came with ([`vllm_base_request_id`] takes it off).
pub fn notif_request_id(notif: &str) -> Option<&str> {
    if notif.starts_with("HB:") || notif.starts_with("PUSH_REG:") {
        return None;
    }
    let (id, consumers) = notif.rsplit_once(':')?;
    let valid_id = !id.is_empty() && id.chars().all(|c| c.is_ascii_graphic());
    let valid_count = !consumers.is_empty()
        && consumers.len() <= 6
        && consumers.bytes().all(|b| b.is_ascii_digit());
    (valid_id && valid_count).then_some(id)
}

/// The id a request came to vLLM with, from vLLM's own id for it: without the
/// `-<8 hex digits>` vLLM appends (its `get_base_request_id`); None when it ends in
/// none. The router knows the request by this one.
pub fn vllm_base_request_id(id: &str) -> Option<&str> {
    let (base, suffix) = id.rsplit_once('-')?;
    (!base.is_empty()
        && suffix.len() == 8
        && suffix
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    .then_some(base)
}

/// Append one series of a latency histogram in seconds (cumulative `buckets` at
/// [`LATENCY_BOUNDS_NS`]) as both the agent and the collector export them. `labels` is
/// already escaped.
pub fn write_latency_histogram(
    out: &mut kvscope_kit::prom::Exposition,
    name: &str,
    labels: &str,
    buckets: &[u64],
    count: u64,
    sum_ns: u64,
) {
    out.histogram(
        name,
        labels,
        LATENCY_BOUNDS_NS.iter().map(|le| *le as f64 / 1e9),
        buckets,
        count,
        sum_ns as f64 / 1e9,
    );
}

/// A latency distribution: exact count, sum and max, percentiles from the agent's
/// hdrhistogram, and cumulative bucket counts at [`LATENCY_BOUNDS_NS`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub sum_ns: u64,
    pub max_ns: u64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    /// `buckets[i]` = observations ≤ `LATENCY_BOUNDS_NS[i]` (cumulative).
    pub buckets: Vec<u64>,
}

/// Latency merged from many summaries: exact count, sum and max; percentiles estimated
/// from the shared buckets (upper bound of the bucket holding the quantile).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MergedLatency {
    pub count: u64,
    pub sum_ns: u64,
    pub max_ns: u64,
    pub buckets: Vec<u64>,
}

impl LatencySummary {
    /// The summary of exactly these observations (percentiles by nearest rank): what a
    /// fixture or a replayed run states outright.
    pub fn exact(values_ns: &[u64]) -> Self {
        let m = MergedLatency::exact(values_ns);
        let mut sorted = values_ns.to_vec();
        sorted.sort_unstable();
        let rank = |q: f64| {
            let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1));
            sorted.get(i - 1).copied().unwrap_or(0)
        };
        Self {
            count: m.count,
            sum_ns: m.sum_ns,
            max_ns: m.max_ns,
            p50_ns: rank(0.5),
            p90_ns: rank(0.9),
            p99_ns: rank(0.99),
            buckets: m.buckets,
        }
    }
}

impl MergedLatency {
    /// The distribution of exactly these observations (every bucket present).
    pub fn exact(values_ns: &[u64]) -> Self {
        let mut m = Self {
            buckets: vec![0; LATENCY_BOUNDS_NS.len()],
            ..Self::default()
        };
        for &v in values_ns {
            m.observe(v);
        }
        m
    }

    /// Add one agent's summary.
    pub fn add(&mut self, l: &LatencySummary) {
        self.add_parts(l.count, l.sum_ns, l.max_ns, &l.buckets);
    }

    /// Add one observation of `ns`.
    pub fn observe(&mut self, ns: u64) {
        // Called per verdict: no allocation.
        if self.buckets.len() < LATENCY_BOUNDS_NS.len() {
            self.buckets.resize(LATENCY_BOUNDS_NS.len(), 0);
        }
        self.count = self.count.saturating_add(1);
        self.sum_ns = self.sum_ns.saturating_add(ns);
        self.max_ns = self.max_ns.max(ns);
        for (b, le) in self.buckets.iter_mut().zip(LATENCY_BOUNDS_NS) {
            *b += u64::from(ns <= le);
        }
    }

    /// Add another merged distribution (e.g. pairs summed fleet-wide).
    pub fn merge(&mut self, other: &MergedLatency) {
        self.add_parts(other.count, other.sum_ns, other.max_ns, &other.buckets);
    }

    fn add_parts(&mut self, count: u64, sum_ns: u64, max_ns: u64, buckets: &[u64]) {
        if count == 0 {
            return;
        }
        // Saturating: a delay measured against a far-off clock (a record stamped near
        // the epoch, a skewed host) must not overflow the sum.
        self.count = self.count.saturating_add(count);
        self.sum_ns = self.sum_ns.saturating_add(sum_ns);
        self.max_ns = self.max_ns.max(max_ns);
        if self.buckets.len() < buckets.len() {
            self.buckets.resize(buckets.len(), 0);
        }
        // Bucket counts come from agents' reports: saturate like the count and sum.
        for (a, b) in self.buckets.iter_mut().zip(buckets) {
            *a = a.saturating_add(*b);
        }
    }

    /// The upper bound of the bucket holding quantile `q`, capped at the exact max.
    pub fn quantile_ns(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = (q.clamp(0.0, 1.0) * self.count as f64).ceil().max(1.0) as u64;
        let le = self
            .buckets
            .iter()
            .zip(LATENCY_BOUNDS_NS)
            .find(|(n, _)| **n >= rank)
            .map(|(_, le)| le)
            .unwrap_or(self.max_ns);
        Some(le.min(self.max_ns))
    }
}

/// Where in its life a transfer ended up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum XferStage {
    /// `createXferReq`/`makeXferReq` failed: nothing was posted.
    Create,
    /// `postXferReq` returned an error.
    Post,
    /// A terminal status: at `postXferReq` (completed inline) or from `getXferStatus`.
    Complete,
    /// Released while still in progress (no terminal status seen).
    ReleasedInFlight,
}

impl XferStage {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Post => "post",
            Self::Complete => "complete",
            Self::ReleasedInFlight => "released_in_flight",
        }
    }
}

/// Transfers of one (pid, local agent, remote agent, op, stage, status).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlTransferStats {
    /// The traced process; 0 for the processes that exited, summed.
    pub pid: u32,
    pub local_agent: String,
    pub remote_agent: String,
    /// `READ`, `WRITE` or `unknown`.
    pub op: String,
    pub stage: XferStage,
    /// `nixl_status_t` name (`SUCCESS`, `ERR_NOT_FOUND`, ...).
    pub status: String,
    pub transfers: u64,
    /// Bytes of these transfers whose bytes were read.
    pub bytes: u64,
    /// Of `transfers`, those whose bytes were not read (not in `bytes`): the build's
    /// offsets are unknown, or its requests hold no byte count for them (NIXL before
    /// 1.4 with the agent's telemetry off).
    #[serde(default)]
    pub bytes_unknown: u64,
    pub descriptors: u64,
    /// Post → terminal status, for `complete`.
    pub latency: LatencySummary,
}

/// Calls of one `nixlAgent` method with one outcome: handshakes (metadata exchange),
/// notifications, memory registration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlCallStats {
    /// The traced process; 0 for the processes that exited, summed.
    pub pid: u32,
    pub local_agent: String,
    /// The remote agent where the call carries one, else empty.
    pub remote_agent: String,
    /// The method as NIXL names it (`loadRemoteMD`, `genNotif`, ...).
    pub call: String,
    pub status: String,
    pub calls: u64,
    /// Bytes (registerMem / deregisterMem).
    pub bytes: u64,
    /// Of `calls`, registrations of more descriptors than the probes sum (65,536):
    /// their bytes are those of the first ones.
    #[serde(default)]
    pub bytes_partial: u64,
    pub latency: LatencySummary,
}

/// A traced `libnixl.so` file and how well it is traced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlLibraryStatus {
    pub path: String,
    pub build_id: String,
    /// The build's offsets were derived: bytes, ops and remote names are measured.
    pub offsets_known: bool,
    /// Transfers are seen to end at the build's completion sites inside NIXL (derived
    /// from its `getXferStatus` and `releaseXferReq`), so no probe fires on a status
    /// poll or a release (false: the status-call probes, which fire on every
    /// `getXferStatus`).
    #[serde(default)]
    pub completion_sites: bool,
    /// Posts are seen returning at one instruction (derived from the build's
    /// `postXferReq`); false: by its return probe.
    #[serde(default)]
    pub post_site: bool,
    /// Creations are seen only where they fail (sites derived from the build's
    /// `createXferReq` and `makeXferReq`); false: at the methods' entry and return
    /// probes. (Agents before these were derived called it `return_sites`.)
    #[serde(default, alias = "return_sites")]
    pub creation_sites: bool,
    pub probes_attached: u32,
    /// Set when something is not measured, saying what and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub degraded: Option<String>,
}

/// One agent's NIXL figures since it started.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlReport {
    pub libraries: Vec<NixlLibraryStatus>,
    pub transfers: Vec<NixlTransferStats>,
    pub calls: Vec<NixlCallStats>,
    /// Probe records lost: the ring buffer was full, or a post's per-thread slot was
    /// taken by another thread's post before it returned.
    pub events_lost: u64,
    /// Probe records the agent could not decode or attribute.
    pub events_malformed: u64,
    /// Probe records the agent read: where the probes count transfers themselves, far
    /// fewer than the transfers (only the kept ones' records are sent).
    #[serde(default)]
    pub events_read: u64,
    /// Which Dynamo worker each live local NIXL agent belongs to, as the node agent
    /// tells it from the processes (empty from agents that do not tell).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub owners: Vec<NixlAgentOwner>,
    /// Transfers posted and not yet seen finished, per (pid, local agent, remote agent),
    /// as of the report (empty: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_flight: Vec<NixlInFlight>,
    /// Per request named by its transfers' notifications, the ones updated lately (at
    /// most [`REPORTED_REQUESTS`], newest first): cumulative, so a lost report is made
    /// good by the next one while the request is still in it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requests: Vec<NixlRequestTransfers>,
}

/// The most requests one NIXL report carries.
pub const REPORTED_REQUESTS: usize = 1024;

/// What one local NIXL agent moved for one request, cumulative: the transfers whose
/// notification named the request ([`notif_request_id`]), to or from `remote_agent`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlRequestTransfers {
    pub request_id: String,
    pub local_agent: String,
    pub remote_agent: String,
    /// Transfers that completed, their bytes, and Σ post → done.
    pub transfers: u64,
    pub bytes: u64,
    pub nixl_ns: u64,
    /// Transfers that failed (at post, at completion, or released in flight).
    #[serde(default)]
    pub failed: u64,
}

/// A request's NIXL transfers summed over agents (`/api/verdicts`' `nixl`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestNixl {
    pub transfers: u64,
    pub bytes: u64,
    /// Σ post → done, seconds.
    pub nixl_seconds: f64,
    pub failed: u64,
}

/// Transfers of one (pid, local agent, remote agent) posted and in progress: their
/// terminal status not yet seen. A stuck transfer shows as one that stays here, aging.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlInFlight {
    pub pid: u32,
    pub local_agent: String,
    pub remote_agent: String,
    pub transfers: u64,
    /// How long the oldest of them has been in flight, at the report, in ns.
    pub oldest_age_ns: u64,
}

/// The Dynamo worker a local NIXL agent belongs to, told from the processes: a vLLM
/// engine's NIXL agent lives in the engine process, under the Dynamo worker process that
/// serves the worker's request plane (or in the same process, or at least in the same
/// Kubernetes pod). `worker_id` is absent when no worker could be told, and `how` then
/// says why: nothing is guessed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlAgentOwner {
    /// The NIXL agent's name, as transfers and pairs name it.
    pub agent: String,
    /// The process holding it.
    pub pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<u64>,
    /// The dp rank, where the worker has several and one of its KV publishers is in the
    /// agent's process tree (absent: the worker's only rank, or not told).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
    /// How it was told (`same process`, `parent process 1234`, `same pod …`), or why not.
    pub how: String,
}

/// One row of the collector's `/api/nixl/agents`: an owner as a node agent told it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlAgentRow {
    /// The kvscope agent (node) that told it.
    pub node: String,
    #[serde(flatten)]
    pub owner: NixlAgentOwner,
}

/// One local → remote NIXL agent pair, summed over every agent's latest report: a row of
/// the collector's `/api/nixl`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NixlPair {
    pub local_agent: String,
    pub remote_agent: String,
    /// Transfers that completed with SUCCESS, by op.
    pub transfers_ok: BTreeMap<String, u64>,
    /// Transfers that failed (at create, post or completion) or were released in flight.
    pub transfers_failed: u64,
    /// Bytes of successful transfers, where they were read.
    pub bytes_ok: u64,
    /// Successful transfers whose bytes were not read (`NixlTransferStats::bytes_unknown`).
    #[serde(default)]
    pub ok_bytes_unknown: u64,
    /// Post → done of successful transfers.
    pub latency: MergedLatency,
    /// Bytes of successful transfers over the sum of their post → done times, over
    /// the transfers whose bytes were read (None when none were).
    pub bandwidth_bytes_per_second: Option<f64>,
    pub handshakes_ok: u64,
    pub handshakes_failed: u64,
    /// Every metadata-exchange call's latency, failed ones included.
    pub handshake_latency: MergedLatency,
    /// The successful ones' only: what a migration that goes through pays.
    #[serde(default)]
    pub handshake_ok_latency: MergedLatency,
    /// Transfers posted and in progress, as of the agents' latest reports.
    #[serde(default)]
    pub in_flight: u64,
    /// How long the oldest of them had been in progress at its agent's report (s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_in_flight_seconds: Option<f64>,
    /// `invalidateRemoteMD` calls on the remote's metadata (its process gone or about to
    /// be reloaded): a peer whose state went stale.
    #[serde(default)]
    pub metadata_invalidations: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_from_vllm_notifications() {
        assert_eq!(notif_request_id("cmpl-3f2a-0:1"), Some("cmpl-3f2a-0"));
        assert_eq!(notif_request_id("a:b:2"), Some("a:b"));
        assert_eq!(
            notif_request_id("80c653b7-1670-4557-aefb-c40854626c70:4"),
            Some("80c653b7-1670-4557-aefb-c40854626c70")
        );
        for other in [
            "bench",
            "push-3",
            ":1",
            "id:",
            "id:x",
            "id:1234567",
            "a b:1",
            "HB:cmpl-1,cmpl-2",
            "HB:1",
            "PUSH_REG:\u{85}\u{a7}request",
        ] {
            assert_eq!(notif_request_id(other), None, "{other}");
        }
        // Each release's completion message, as its NixlConnector builds it: the id
        // before the last colon, whatever the number after it means.
        for (release, notif, id) in [
            ("0.9.1 (tp ratio)", "cmpl-7f3a2c1e-0:2", "cmpl-7f3a2c1e-0"),
            (
                "0.13 (remote id, tp ratio)",
                "chatcmpl-5d1e-4c2b8a9f:1",
                "chatcmpl-5d1e-4c2b8a9f",
            ),
            (
                "0.14 (world size)",
                "cmpl-abc-0-1a2b3c4d:8",
                "cmpl-abc-0-1a2b3c4d",
            ),
            (
                "0.29 (expected consumers)",
                "req:7:1a2b3c4d:4",
                "req:7:1a2b3c4d",
            ),
            (
                "0.24 push (world size)",
                "d-req-9-00ff00ff:2",
                "d-req-9-00ff00ff",
            ),
        ] {
            assert_eq!(notif_request_id(notif), Some(id), "{release}");
        }
    }

    #[test]
    fn vllm_suffixes_come_off_base_ids_stay() {
        assert_eq!(
            vllm_base_request_id("cmpl-abc-0-1a2b3c4d"),
            Some("cmpl-abc-0")
        );
        assert_eq!(
            vllm_base_request_id("80c653b7-1670-4557-aefb-c40854626c70-deadbeef"),
            Some("80c653b7-1670-4557-aefb-c40854626c70")
        );
        for none in [
            "cmpl-abc-0",
            // A UUID's last group is 12 digits.
            "80c653b7-1670-4557-aefb-c40854626c70",
            "-1a2b3c4d",
            "x-1A2B3C4D",
            "x-1a2b3c4",
            "x-1a2b3c4g",
        ] {
            assert_eq!(vllm_base_request_id(none), None, "{none}");
        }
    }

    #[test]
    fn exact_summaries_state_their_observations() {
        let l = LatencySummary::exact(&[3_000, 1_000, 2_000, 10_000]);
        assert_eq!((l.count, l.sum_ns, l.max_ns), (4, 16_000, 10_000));
        assert_eq!((l.p50_ns, l.p90_ns, l.p99_ns), (2_000, 10_000, 10_000));
        assert_eq!(l.buckets.len(), LATENCY_BOUNDS_NS.len());
        // Cumulative: the 1 µs bound holds one, every bound from 10 µs all four.
        assert_eq!(l.buckets[0], 1);
        assert_eq!(*l.buckets.last().unwrap(), 4);
        let mut m = MergedLatency::default();
        m.add(&l);
        assert_eq!(m, MergedLatency::exact(&[3_000, 1_000, 2_000, 10_000]));
        let empty = LatencySummary::exact(&[]);
        assert_eq!((empty.count, empty.p99_ns), (0, 0));
        assert!(empty.buckets.iter().all(|b| *b == 0));
    }
}
