//! Folding probe events into NIXL figures: transfers per (pid, local agent, remote
//! agent, op, stage, status) with bytes and post → done latency, and calls per (pid,
//! local agent, remote agent, method, status) with latency.
//!
//! Pure: events in, [`NixlReport`] out, so it is unit-tested without BPF.
//!
//! A process that exits has its figures folded into those of pid [`EXITED_PID`] and
//! its per-process state dropped, so memory follows the live processes, not every one
//! ever traced, while every total (summed over pids, as on `/metrics` and in the
//! collector) keeps growing monotonically.

use super::event::{flags, status_name, EventKind, NixlCall, NixlEvent};
use super::tally::{InflightEntry, KernelTally, LatencyHistogram, TallyKey};
use kvscope_wire::nixl::{LatencySummary, NixlCallStats, NixlReport, NixlTransferStats, XferStage};
use std::collections::{btree_map, BTreeMap, HashMap};

/// The local agent label when the agent's name was never seen (created before the
/// probes attached, on a build whose offsets are unknown).
pub(crate) const UNKNOWN_AGENT: &str = "unknown";

/// The pid under which the figures of processes that exited are kept, summed (no
/// process has pid 0 in user space).
pub(crate) const EXITED_PID: u32 = 0;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct TransferKey {
    pid: u32,
    local: String,
    remote: String,
    op: &'static str,
    stage: XferStage,
    status: i32,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct CallKey {
    pid: u32,
    local: String,
    remote: String,
    call: NixlCall,
    status: i32,
}

/// Counts, bytes and a latency histogram.
#[derive(Clone, Debug, Default)]
struct Tally {
    count: u64,
    bytes: u64,
    descs: u64,
    /// Of `count`, transfers whose bytes were not read (counted as 0 in `bytes`).
    bytes_unknown: u64,
    /// Of `count`, registrations whose bytes are of their first descriptors only.
    bytes_partial: u64,
    latency: LatencyHistogram,
    sum_ns: u64,
    max_ns: u64,
}

impl Tally {
    fn add(&mut self, bytes: Option<u64>, descs: u64, latency_ns: Option<u64>) {
        // Bytes and descriptors are read from the traced process's memory: a wrong
        // value must not stop the agent, so sums saturate.
        self.count += 1;
        let Some(bytes) = bytes else {
            self.bytes_unknown += 1;
            return self.add_latency(latency_ns);
        };
        self.bytes = self.bytes.saturating_add(bytes);
        self.descs = self.descs.saturating_add(descs);
        self.add_latency(latency_ns);
    }

    fn add_latency(&mut self, latency_ns: Option<u64>) {
        if let Some(ns) = latency_ns {
            self.latency.record(ns);
            self.sum_ns = self.sum_ns.saturating_add(ns);
            self.max_ns = self.max_ns.max(ns);
        }
    }

    /// Add `other`'s figures to these.
    fn merge(&mut self, other: &Tally) {
        self.count += other.count;
        self.bytes = self.bytes.saturating_add(other.bytes);
        self.descs = self.descs.saturating_add(other.descs);
        self.bytes_unknown += other.bytes_unknown;
        self.bytes_partial += other.bytes_partial;
        self.latency.add(&other.latency);
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    fn summary(&self) -> LatencySummary {
        let h = &self.latency;
        if h.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            count: h.len(),
            sum_ns: self.sum_ns,
            max_ns: self.max_ns,
            p50_ns: h.value_at_quantile(0.5).min(self.max_ns),
            p90_ns: h.value_at_quantile(0.9).min(self.max_ns),
            p99_ns: h.value_at_quantile(0.99).min(self.max_ns),
            buckets: h.cumulative_bounds(),
        }
    }
}

impl From<KernelTally> for Tally {
    fn from(k: KernelTally) -> Self {
        let latency = k.latency;
        // The probes' max is a plain compare-and-store (two CPUs may race it down): never
        // below the highest bucket counted.
        let max_ns = k.max_ns.max(latency.floor_of_highest());
        Self {
            count: k.count,
            bytes: k.bytes,
            descs: k.descs,
            bytes_unknown: k.bytes_unknown,
            bytes_partial: 0,
            latency,
            sum_ns: k.sum_ns,
            max_ns,
        }
    }
}

/// What is known of a request handle between its creation and its release.
#[derive(Clone, Debug, Default)]
struct RequestInfo {
    local: String,
    remote: String,
    op: Option<i32>,
    bytes: u64,
    descs: u64,
    /// Its post could not read its byte count (`flags::BYTES_UNKNOWN`).
    bytes_unknown: bool,
    /// Posted and in progress: a terminal status is due.
    awaiting: bool,
    /// Its notification message, when it carries one and it reads as text (cut at 63
    /// bytes: then `notif_truncated`).
    notif: Option<String>,
    notif_truncated: bool,
}

fn op_name(op: Option<i32>) -> &'static str {
    match op {
        Some(0) => "READ",
        Some(1) => "WRITE",
        _ => "unknown",
    }
}

/// One transfer or call the probes saw end: what a span shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Observed<'a> {
    pub pid: u32,
    pub local: &'a str,
    pub remote: &'a str,
    pub what: ObservedKind,
    pub status: i32,
    /// None: not read (`NixlTransferStats::bytes_unknown`).
    pub bytes: Option<u64>,
    /// Post → terminal status for a transfer, entry → return for a call.
    pub latency_ns: Option<u64>,
    /// The probe's clock (`bpf_ktime_get_ns`) when it saw the end.
    pub ts_ns: u64,
    /// A transfer's notification message, as far as it was read.
    pub notif: Option<&'a str>,
    /// The request a transfer moves KV for, read from its notification when that is in
    /// a known format (vLLM's NixlConnector: `<request id>:<consumers>`).
    pub request_id: Option<&'a str>,
    /// Why a transfer counted in the kernel was sent (`flags::KEPT_*`; the others
    /// like it were counted, not sent); None: every one is sent.
    pub kept: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ObservedKind {
    Transfer { op: &'static str, stage: XferStage },
    Call(NixlCall),
}

/// The fold.
#[derive(Debug, Default)]
pub struct NixlAggregator {
    /// Local agent names by (pid, nixlAgent*), and by (pid, nixlAgentData*).
    agents: HashMap<(u32, u64), String>,
    agent_data: HashMap<(u32, u64), String>,
    requests: HashMap<(u32, u64), RequestInfo>,
    transfers: BTreeMap<TransferKey, Tally>,
    /// The kernel's tallies as last read ([`Self::set_kernel_tallies`]): every transfer
    /// of a build whose offsets are known, which `transfers` then leaves out.
    kernel: BTreeMap<TransferKey, Tally>,
    /// Transfers in kernel tallies of a stage this agent does not know (as last read).
    kernel_unknown: u64,
    calls: BTreeMap<CallKey, Tally>,
    /// Per request named by a notification: what each (local, remote) pair moved for it.
    by_request: RequestTallies,
    /// Events that could not be attributed (a completion for an unknown request...).
    pub unattributed: u64,
}

impl NixlAggregator {
    pub fn new() -> Self {
        Self::default()
    }

    fn local_name(&self, pid: u32, agent: u64) -> String {
        self.agents
            .get(&(pid, agent))
            .or_else(|| self.agent_data.get(&(pid, agent)))
            .cloned()
            .unwrap_or_else(|| UNKNOWN_AGENT.to_string())
    }

    /// The request `e` is about, known from its creation or first seen now.
    fn request_of(&mut self, pid: u32, e: &NixlEvent) -> &mut RequestInfo {
        let local = self.local_name(pid, e.agent);
        self.requests
            .entry((pid, e.req))
            .or_insert_with(|| RequestInfo {
                local,
                ..RequestInfo::default()
            })
    }

    fn count_transfer(
        &mut self,
        pid: u32,
        info: &RequestInfo,
        stage: XferStage,
        e: &NixlEvent,
        observe: &mut dyn FnMut(Observed<'_>),
    ) {
        let tallied = e.flags & flags::TALLIED != 0;
        let key = TransferKey {
            pid,
            local: info.local.clone(),
            remote: info.remote.clone(),
            op: op_name(info.op),
            stage,
            status: e.status,
        };
        let latency = (stage == XferStage::Complete).then_some(e.latency_ns);
        // A failed creation moved nothing; a posted transfer moved what its request
        // says, when it could be read.
        let (bytes, descs) = match stage {
            XferStage::Complete | XferStage::Post | XferStage::ReleasedInFlight => {
                (Some(info.bytes).filter(|_| !info.bytes_unknown), info.descs)
            }
            XferStage::Create => (Some(0), 0),
        };
        // Counted in the kernel already: the record is for spans and the request join.
        if !tallied {
            self.transfers
                .entry(key)
                .or_default()
                .add(bytes, descs, latency);
        }
        let request_id = info
            .notif
            .as_deref()
            .filter(|_| !info.notif_truncated)
            .and_then(kvscope_wire::nixl::notif_request_id);
        if let Some(rid) = request_id {
            let ok = stage == XferStage::Complete && e.status == 0;
            let failed = e.status < 0 || stage == XferStage::ReleasedInFlight;
            if ok || failed {
                self.by_request.add(
                    rid,
                    &info.local,
                    &info.remote,
                    ok.then_some((bytes.unwrap_or(0), e.latency_ns)),
                    e.ts_ns,
                );
            }
        }
        observe(Observed {
            pid,
            local: &info.local,
            remote: &info.remote,
            what: ObservedKind::Transfer {
                op: op_name(info.op),
                stage,
            },
            status: e.status,
            bytes,
            latency_ns: latency,
            ts_ns: e.ts_ns,
            notif: info.notif.as_deref(),
            request_id,
            kept: tallied.then_some(e.flags & flags::KEPT),
        });
    }

    /// What a transfer's record says it moved, where the build's offsets are known (it
    /// carries its pair whichever record it is: its post's may not have been sent).
    fn request_in(&self, pid: u32, e: &NixlEvent) -> RequestInfo {
        RequestInfo {
            local: self.local_name(pid, e.agent),
            remote: e.name.clone(),
            op: (e.op >= 0).then_some(e.op),
            bytes: e.bytes,
            descs: u64::from(e.descs),
            bytes_unknown: e.flags & flags::BYTES_UNKNOWN != 0,
            ..RequestInfo::default()
        }
    }

    /// The kernel's tallies, as just read (each key once or, from several copies of the
    /// library, more: then summed). Names are resolved now, while the agents are known.
    pub(crate) fn set_kernel_tallies(
        &mut self,
        tallies: impl IntoIterator<Item = (TallyKey, KernelTally)>,
    ) {
        self.kernel.clear();
        self.kernel_unknown = 0;
        for (k, t) in tallies {
            let stage = match k.stage {
                1 => XferStage::Post,
                2 => XferStage::Complete,
                3 => XferStage::ReleasedInFlight,
                _ => {
                    self.kernel_unknown += t.count;
                    continue;
                }
            };
            let key = TransferKey {
                pid: k.pid,
                local: self.local_name(k.pid, k.agent),
                remote: k.remote,
                op: op_name((k.op >= 0).then_some(k.op)),
                stage,
                status: k.status,
            };
            // Moved in: a series' histogram is ~19 KiB, and most keys come once.
            match self.kernel.entry(key) {
                btree_map::Entry::Vacant(e) => {
                    e.insert(Tally::from(t));
                }
                btree_map::Entry::Occupied(mut e) => e.get_mut().merge(&Tally::from(t)),
            }
        }
    }

    /// Processes with state here: agents, requests in flight, or figures of their own
    /// (a process whose agent was created before the probes attached has only those).
    pub fn pids(&self) -> Vec<u32> {
        let mut p: Vec<u32> = self
            .agents
            .keys()
            .chain(self.requests.keys())
            .map(|(pid, _)| *pid)
            .chain(self.transfers.keys().map(|k| k.pid))
            .chain(self.kernel.keys().map(|k| k.pid))
            .chain(self.calls.keys().map(|k| k.pid))
            .filter(|&pid| pid != EXITED_PID)
            .collect();
        p.sort_unstable();
        p.dedup();
        p
    }

    /// The live local agents by (pid, name): those created under the probes or seen at
    /// a call since.
    pub fn local_agents(&self) -> std::collections::BTreeSet<(u32, String)> {
        self.agents
            .iter()
            .chain(&self.agent_data)
            .filter(|(_, name)| !name.is_empty() && name.as_str() != UNKNOWN_AGENT)
            .map(|((pid, _), name)| (*pid, name.clone()))
            .collect()
    }

    /// A process exited: forget its handles and agents (its pid may be reused), and fold
    /// its figures into [`EXITED_PID`]'s so the totals stay while its series go.
    pub(crate) fn process_exited(&mut self, pid: u32) {
        if pid == EXITED_PID {
            return;
        }
        self.agents.retain(|(p, _), _| *p != pid);
        self.agent_data.retain(|(p, _), _| *p != pid);
        self.requests.retain(|(p, _), _| *p != pid);
        // Its kernel tallies are deleted from the kernel now (the caller's part): kept
        // here, as the exited processes' figures are.
        let ended: Vec<TransferKey> = self
            .kernel
            .keys()
            .filter(|k| k.pid == pid)
            .cloned()
            .collect();
        for key in ended {
            if let Some(t) = self.kernel.remove(&key) {
                self.transfers.entry(key).or_default().merge(&t);
            }
        }
        fold_pid(&mut self.transfers, pid);
        fold_pid(&mut self.calls, pid);
    }

    /// A transfer of request `e.req` ended. Where the build's offsets are known its next
    /// post reads everything from the request again, so it is forgotten now: the probes
    /// on a build with completion sites never see a plain release.
    fn transfer_ended(&mut self, pid: u32, e: &NixlEvent) {
        if e.flags & flags::OFFSETS_KNOWN != 0 {
            self.requests.remove(&(pid, e.req));
        }
    }

    /// Apply one probe event.
    pub fn apply(&mut self, e: &NixlEvent) {
        self.apply_observing(e, &mut |_| {});
    }

    /// Apply one probe event; `observe` sees the transfer or call it ends, if any.
    pub(crate) fn apply_observing(&mut self, e: &NixlEvent, observe: &mut dyn FnMut(Observed<'_>)) {
        let pid = e.pid;
        match e.kind {
            EventKind::AgentNew | EventKind::AgentSeen => {
                if e.kind == EventKind::AgentSeen && e.name.is_empty() {
                    return; // nothing learned; keep any name the constructor gave
                }
                self.agents.insert((pid, e.agent), e.name.clone());
                if e.data != 0 {
                    self.agent_data.insert((pid, e.data), e.name.clone());
                }
            }
            EventKind::XferCreate => {
                let local = self.local_name(pid, e.agent);
                let info = RequestInfo {
                    local,
                    remote: e.name.clone(),
                    op: (e.op >= 0).then_some(e.op),
                    ..RequestInfo::default()
                };
                // A successful creation is sent only where the build's offsets are
                // unknown (otherwise each post reads all of this from the request).
                if e.status == 0 && e.req != 0 {
                    self.requests.insert((pid, e.req), info);
                } else {
                    self.count_transfer(pid, &info, XferStage::Create, e, observe);
                }
            }
            EventKind::XferPost => {
                let info = self.request_of(pid, e);
                if e.flags & flags::OFFSETS_KNOWN != 0 {
                    if e.op >= 0 {
                        info.op = Some(e.op);
                    }
                    info.bytes = e.bytes;
                    info.descs = u64::from(e.descs);
                    if !e.name.is_empty() {
                        info.remote = e.name.clone();
                    }
                }
                info.bytes_unknown = e.flags & flags::BYTES_UNKNOWN != 0;
                info.awaiting = e.status == 1;
                let info = info.clone();
                match e.status {
                    1 => {} // in progress: the completion comes from getXferStatus
                    0 => self.count_transfer(pid, &info, XferStage::Complete, e, observe),
                    _ => self.count_transfer(pid, &info, XferStage::Post, e, observe),
                }
                if e.status != 1 {
                    self.transfer_ended(pid, e);
                }
            }
            EventKind::XferNotif => {
                let info = self.request_of(pid, e);
                // Binary notifications are not invented into text.
                info.notif = (!e.name.is_empty() && e.name.chars().all(|c| !c.is_control()))
                    .then(|| e.name.clone());
                info.notif_truncated = e.flags & flags::NAME_TRUNCATED != 0;
            }
            EventKind::XferDone => match self.requests.get_mut(&(pid, e.req)) {
                Some(info) => {
                    info.awaiting = false;
                    let info = info.clone();
                    self.count_transfer(pid, &info, XferStage::Complete, e, observe);
                    self.transfer_ended(pid, e);
                }
                // Its post's record was left unsent (it is sent for itself: failed,
                // slow, or untallied for want of room in the kernel's table); where the
                // build's offsets are known it carries its pair.
                None if e.flags & flags::OFFSETS_KNOWN != 0 => {
                    let info = self.request_in(pid, e);
                    self.count_transfer(pid, &info, XferStage::Complete, e, observe);
                }
                None => self.unattributed += 1,
            },
            EventKind::XferRelease => {
                let info = self.requests.remove(&(pid, e.req));
                if e.flags & flags::IN_FLIGHT != 0 {
                    let info = match info {
                        Some(info) => info,
                        None if e.flags & flags::OFFSETS_KNOWN != 0 => self.request_in(pid, e),
                        None => RequestInfo::default(),
                    };
                    let mut ev = e.clone();
                    ev.status = 1;
                    self.count_transfer(pid, &info, XferStage::ReleasedInFlight, &ev, observe);
                } else if info.is_some_and(|i| i.awaiting) {
                    // In progress here, yet the probes' in-flight entry is gone: its
                    // completion was lost (the BPF map evicted it). Counted, not hidden.
                    self.unattributed += 1;
                }
            }
            EventKind::Call => {
                let Some(call) = e.call else {
                    self.unattributed += 1;
                    return;
                };
                let key = CallKey {
                    pid,
                    local: self.local_name(pid, e.agent),
                    remote: e.name.clone(),
                    call,
                    status: e.status,
                };
                // A call seen only at a site (no entry) has no latency.
                let latency = (e.latency_ns > 0).then_some(e.latency_ns);
                let tally = self.calls.entry(key).or_default();
                tally.add(Some(e.bytes), u64::from(e.descs), latency);
                if e.flags & flags::BYTES_PARTIAL != 0 {
                    tally.bytes_partial += 1;
                }
                observe(Observed {
                    pid,
                    local: &self.local_name(pid, e.agent),
                    remote: &e.name,
                    what: ObservedKind::Call(call),
                    status: e.status,
                    bytes: Some(e.bytes),
                    latency_ns: latency,
                    ts_ns: e.ts_ns,
                    notif: None,
                    request_id: None,
                    kept: None,
                });
            }
        }
    }

    /// Transfers in progress per (pid, local, remote), with the age of the oldest as of
    /// `now_ns` (the probes' clock), from the probes' own entries (every posted transfer
    /// has one, whether or not its post's record was sent): (pid, request, entry). The
    /// remote agent is the entry's where the build's offsets are known, else the one
    /// its creation's record named.
    pub(crate) fn in_flight<'a>(
        &self,
        now_ns: u64,
        entries: impl IntoIterator<Item = &'a (u32, u64, InflightEntry)>,
    ) -> Vec<kvscope_wire::nixl::NixlInFlight> {
        let mut by: BTreeMap<(u32, String, String), (u64, u64)> = BTreeMap::new();
        for (pid, req, entry) in entries {
            let mut remote = entry.remote.clone();
            if remote.is_empty() {
                if let Some(info) = self.requests.get(&(*pid, *req)) {
                    remote = info.remote.clone();
                }
            }
            let e = by
                .entry((*pid, self.local_name(*pid, entry.agent), remote))
                .or_insert((0, u64::MAX));
            e.0 += 1;
            e.1 = e.1.min(entry.ts_ns);
        }
        by.into_iter()
            .map(
                |((pid, local, remote), (transfers, oldest))| kvscope_wire::nixl::NixlInFlight {
                    pid,
                    local_agent: local,
                    remote_agent: remote,
                    transfers,
                    oldest_age_ns: now_ns.saturating_sub(oldest),
                },
            )
            .collect()
    }

    /// The figures so far (cumulative).
    pub fn report(&self) -> NixlReport {
        NixlReport {
            libraries: Vec::new(),
            transfers: merged(&self.transfers, &self.kernel)
                .into_iter()
                .map(|(k, t)| NixlTransferStats {
                    pid: k.pid,
                    local_agent: k.local.clone(),
                    remote_agent: k.remote.clone(),
                    op: k.op.to_string(),
                    stage: k.stage,
                    status: status_name(k.status).to_string(),
                    transfers: t.count,
                    bytes: t.bytes,
                    bytes_unknown: t.bytes_unknown,
                    descriptors: t.descs,
                    latency: t.summary(),
                })
                .collect(),
            calls: self
                .calls
                .iter()
                .map(|(k, t)| NixlCallStats {
                    pid: k.pid,
                    local_agent: k.local.clone(),
                    remote_agent: k.remote.clone(),
                    call: k.call.name().to_string(),
                    status: status_name(k.status).to_string(),
                    calls: t.count,
                    bytes: t.bytes,
                    bytes_partial: t.bytes_partial,
                    latency: t.summary(),
                })
                .collect(),
            events_lost: 0,
            events_malformed: self.unattributed + self.kernel_unknown,
            events_read: 0,
            owners: Vec::new(),
            in_flight: Vec::new(),
            requests: Vec::new(),
        }
    }

    /// The requests whose transfers moved within `window_ns` of `now_ns` (the probes'
    /// clock), newest first, at most [`kvscope_wire::nixl::REPORTED_REQUESTS`].
    pub(crate) fn recent_requests(
        &self,
        now_ns: u64,
        window_ns: u64,
    ) -> Vec<kvscope_wire::nixl::NixlRequestTransfers> {
        self.by_request.recent(now_ns, window_ns)
    }
}

/// Per (request, local agent, remote agent): what moved, and when it last changed.
#[derive(Debug, Default)]
struct RequestTallies {
    map: HashMap<(String, String, String), (kvscope_wire::nixl::NixlRequestTransfers, u64)>,
    /// Keys in the order first seen, to forget the oldest beyond [`Self::CAP`].
    order: std::collections::VecDeque<(String, String, String)>,
}

impl RequestTallies {
    const CAP: usize = 4 * kvscope_wire::nixl::REPORTED_REQUESTS;

    /// Count one transfer's end for `request_id`: `Some((bytes, post → done ns))` when it
    /// completed, `None` when it failed.
    fn add(
        &mut self,
        request_id: &str,
        local: &str,
        remote: &str,
        done: Option<(u64, u64)>,
        at_ns: u64,
    ) {
        let key = (
            request_id.to_string(),
            local.to_string(),
            remote.to_string(),
        );
        if !self.map.contains_key(&key) {
            self.order.push_back(key.clone());
            if self.order.len() > Self::CAP {
                if let Some(old) = self.order.pop_front() {
                    self.map.remove(&old);
                }
            }
        }
        let (t, updated) = self.map.entry(key).or_insert_with(|| {
            (
                kvscope_wire::nixl::NixlRequestTransfers {
                    request_id: request_id.to_string(),
                    local_agent: local.to_string(),
                    remote_agent: remote.to_string(),
                    transfers: 0,
                    bytes: 0,
                    nixl_ns: 0,
                    failed: 0,
                },
                0,
            )
        });
        match done {
            Some((bytes, ns)) => {
                t.transfers += 1;
                t.bytes = t.bytes.saturating_add(bytes);
                t.nixl_ns = t.nixl_ns.saturating_add(ns);
            }
            None => t.failed += 1,
        }
        *updated = (*updated).max(at_ns);
    }

    fn recent(&self, now_ns: u64, window_ns: u64) -> Vec<kvscope_wire::nixl::NixlRequestTransfers> {
        let mut v: Vec<_> = self
            .map
            .values()
            .filter(|(_, at)| now_ns.saturating_sub(*at) <= window_ns)
            .collect();
        v.sort_by_key(|t| std::cmp::Reverse(t.1));
        v.into_iter()
            .take(kvscope_wire::nixl::REPORTED_REQUESTS)
            .map(|(t, _)| t.clone())
            .collect()
    }
}

/// `a`'s tallies with `b`'s added (a key in both: summed).
fn merged<'a>(
    a: &'a BTreeMap<TransferKey, Tally>,
    b: &'a BTreeMap<TransferKey, Tally>,
) -> BTreeMap<&'a TransferKey, std::borrow::Cow<'a, Tally>> {
    let mut out: BTreeMap<&TransferKey, std::borrow::Cow<'a, Tally>> = a
        .iter()
        .map(|(k, t)| (k, std::borrow::Cow::Borrowed(t)))
        .collect();
    for (k, t) in b {
        match out.get_mut(k) {
            Some(have) => have.to_mut().merge(t),
            None => {
                out.insert(k, std::borrow::Cow::Borrowed(t));
            }
        }
    }
    out
}

/// A series key: one process's.
trait OfProcess: Ord + Clone {
    fn pid(&self) -> u32;
    fn set_pid(&mut self, pid: u32);
}

impl OfProcess for TransferKey {
    fn pid(&self) -> u32 {
        self.pid
    }
    fn set_pid(&mut self, pid: u32) {
        self.pid = pid;
    }
}

impl OfProcess for CallKey {
    fn pid(&self) -> u32 {
        self.pid
    }
    fn set_pid(&mut self, pid: u32) {
        self.pid = pid;
    }
}

/// Move `pid`'s tallies in `map` under [`EXITED_PID`], adding them to any already there.
fn fold_pid<K: OfProcess>(map: &mut BTreeMap<K, Tally>, pid: u32) {
    let keys: Vec<K> = map.keys().filter(|k| k.pid() == pid).cloned().collect();
    for key in keys {
        let Some(tally) = map.remove(&key) else {
            continue;
        };
        let mut exited = key;
        exited.set_pid(EXITED_PID);
        match map.get_mut(&exited) {
            Some(t) => t.merge(&tally),
            None => {
                map.insert(exited, tally);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn ev(kind: EventKind, f: impl FnOnce(&mut NixlEvent)) -> NixlEvent {
        let mut e = NixlEvent::blank(kind);
        e.pid = 7;
        e.agent = 0x100;
        f(&mut e);
        e
    }

    /// A request's notification (sent before its post) is on the transfer that ends; in
    /// vLLM's format it names the request, otherwise (or cut short, or not text) the
    /// request stays unknown.
    #[test]
    fn notifications_name_their_requests_where_the_format_is_known() {
        let mut seen: Vec<(Option<String>, Option<String>)> = Vec::new();
        let mut a = NixlAggregator::new();
        let cases: [(&str, u32, Option<&str>, Option<&str>); 4] = [
            ("cmpl-7-0:1", 0, Some("cmpl-7-0:1"), Some("cmpl-7-0")),
            ("bench", 0, Some("bench"), None),
            (
                "cmpl-7-0:1",
                flags::NAME_TRUNCATED,
                Some("cmpl-7-0:1"),
                None,
            ),
            ("bin\u{1}ary:1", 0, None, None),
        ];
        for (i, (text, fl, want_notif, want_rid)) in cases.into_iter().enumerate() {
            let req = 0x10 + i as u64;
            a.apply(&ev(EventKind::XferNotif, |e| {
                e.req = req;
                e.name = text.into();
                e.flags = fl;
            }));
            a.apply_observing(
                &ev(EventKind::XferPost, |e| {
                    e.req = req;
                    e.status = 0;
                }),
                &mut |o| seen.push((o.notif.map(Into::into), o.request_id.map(Into::into))),
            );
            assert_eq!(
                seen.pop(),
                Some((want_notif.map(Into::into), want_rid.map(Into::into))),
                "{text:?}"
            );
        }
        // Per request: what moved, from the transfers that named it (only the first).
        let rows = a.recent_requests(u64::MAX / 2, u64::MAX);
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(rows[0].request_id, "cmpl-7-0");
        assert_eq!((rows[0].transfers, rows[0].failed), (1, 0));
        // A failed transfer for the same request, and one that moved long ago.
        a.apply(&ev(EventKind::XferNotif, |e| {
            e.req = 0x40;
            e.name = "cmpl-7-0:1".into();
        }));
        a.apply(&ev(EventKind::XferPost, |e| {
            e.req = 0x40;
            e.status = -2;
            e.ts_ns = 50;
        }));
        let rows = a.recent_requests(100, 60);
        assert_eq!((rows[0].transfers, rows[0].failed), (1, 1));
        assert!(a.recent_requests(1_000, 60).is_empty(), "none moved lately");
    }

    fn kernel_tally(count: u64, bytes: u64, latencies: &[u64]) -> KernelTally {
        let mut latency = LatencyHistogram::default();
        for &ns in latencies {
            latency.record(ns);
        }
        KernelTally {
            count,
            bytes,
            descs: count,
            bytes_unknown: 0,
            sum_ns: latencies.iter().sum(),
            max_ns: latencies.iter().copied().max().unwrap_or(0),
            latency,
        }
    }

    /// Where the kernel counts transfers, their records (sent or not) count nothing
    /// here: the figures are the kernel's tallies, named by the agents known; a
    /// record sent for itself (a failure whose post was not sent) carries its pair.
    /// A process that exits keeps its figures once its kernel tallies are deleted.
    #[test]
    fn kernel_tallies_are_the_figures_and_outlive_their_process() {
        let mut a = NixlAggregator::new();
        a.apply(&ev(EventKind::AgentNew, |e| e.name = "decode-0".into()));
        let mut seen = Vec::new();
        a.apply_observing(
            &ev(EventKind::XferDone, |e| {
                e.req = 0xd;
                e.status = -3;
                e.latency_ns = 5_000;
                e.op = 1;
                e.bytes = 4096;
                e.name = "prefill-0".into();
                e.flags = flags::OFFSETS_KNOWN | flags::TALLIED | flags::KEPT_FAILURE;
            }),
            &mut |o| seen.push((o.local.to_string(), o.remote.to_string(), o.bytes, o.kept)),
        );
        assert_eq!(
            seen,
            [(
                "decode-0".to_string(),
                "prefill-0".to_string(),
                Some(4096),
                Some(flags::KEPT_FAILURE)
            )]
        );
        assert_eq!(a.unattributed, 0);
        assert!(
            a.report().transfers.is_empty(),
            "counted in the kernel only"
        );
        let key = |status: i32| TallyKey {
            pid: 7,
            status,
            agent: 0x100,
            op: 1,
            stage: 2,
            remote: "prefill-0".into(),
        };
        let tallies = [
            (key(0), kernel_tally(3, 3 * 4096, &[1_000, 2_000, 3_000])),
            (key(-3), kernel_tally(1, 4096, &[5_000])),
        ];
        a.set_kernel_tallies(tallies);
        let figures = |a: &NixlAggregator| -> Vec<(u32, String, String, u64, u64, u64)> {
            a.report()
                .transfers
                .iter()
                .map(|t| {
                    (
                        t.pid,
                        t.local_agent.clone(),
                        t.status.clone(),
                        t.transfers,
                        t.bytes,
                        t.latency.buckets[1],
                    )
                })
                .collect()
        };
        let live = figures(&a);
        assert_eq!(live.len(), 2);
        let ok = live
            .iter()
            .find(|f| f.2 == "SUCCESS")
            .expect("the successes");
        assert_eq!(ok.1, "decode-0");
        assert_eq!((ok.3, ok.4, ok.5), (3, 3 * 4096, 2));
        a.process_exited(7);
        // The kernel's entries deleted: the next reading has none of them.
        a.set_kernel_tallies([]);
        let exited = figures(&a);
        assert_eq!(exited.len(), 2);
        assert!(exited.iter().all(|f| f.0 == EXITED_PID));
        assert_eq!(
            exited.iter().map(|f| (f.3, f.4)).collect::<Vec<_>>(),
            live.iter().map(|f| (f.3, f.4)).collect::<Vec<_>>()
        );
    }

    /// The probes' max, raced down by two CPUs, is never below the highest bucket.
    #[test]
    fn a_raced_max_is_mended() {
        let mut k = kernel_tally(2, 0, &[1_000, 90_000]);
        k.max_ns = 1_000;
        let t = Tally::from(k);
        assert!(t.max_ns >= 88_000, "{}", t.max_ns);
        assert!(t.summary().p99_ns > 88_000);
    }

    /// A transfer the kernel could not tally (its table full) has its end's record sent
    /// untallied, its pair on it: counted here, its post's record unsent or not.
    #[test]
    fn a_transfer_the_kernel_could_not_tally_is_counted_from_its_record() {
        let mut a = NixlAggregator::new();
        a.apply(&ev(EventKind::AgentNew, |e| e.name = "decode-0".into()));
        for req in [0xe, 0xf] {
            a.apply(&ev(EventKind::XferDone, |e| {
                e.req = req;
                e.latency_ns = 7_000;
                e.op = 0;
                e.bytes = 1 << 20;
                e.descs = 4;
                e.name = "prefill-1".into();
                e.flags = flags::OFFSETS_KNOWN;
            }));
        }
        let r = a.report();
        assert_eq!(r.transfers.len(), 1, "{:?}", r.transfers);
        let t = &r.transfers[0];
        assert_eq!(
            (
                t.local_agent.as_str(),
                t.remote_agent.as_str(),
                t.op.as_str(),
                t.transfers,
                t.bytes,
                t.descriptors,
                t.latency.count
            ),
            ("decode-0", "prefill-1", "READ", 2, 2 << 20, 8, 2)
        );
        assert_eq!(a.unattributed, 0);
    }

    /// In flight is what the probes' entries hold (every posted transfer has one, its
    /// post's record sent or not), per pair with the oldest's age; the remote agent the
    /// entry's, or, on a build whose offsets are unknown, the one its creation named.
    #[test]
    fn transfers_in_progress_are_listed_from_the_probes_entries() {
        let mut a = NixlAggregator::new();
        a.apply(&ev(EventKind::AgentNew, |e| e.name = "decode-0".into()));
        a.apply(&ev(EventKind::XferCreate, |e| {
            e.req = 0xa;
            e.name = "decode-1".into();
        }));
        let entry = |ts_ns: u64, remote: &str| InflightEntry {
            ts_ns,
            agent: 0x100,
            remote: remote.into(),
        };
        let entries = [
            (7, 0xa, entry(1_000, "")),
            (7, 0xb, entry(4_000, "decode-1")),
            (7, 0xc, entry(5_000, "decode-2")),
        ];
        let f = a.in_flight(10_000, &entries);
        let got: Vec<_> = f
            .iter()
            .map(|f| {
                (
                    f.local_agent.as_str(),
                    f.remote_agent.as_str(),
                    f.transfers,
                    f.oldest_age_ns,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("decode-0", "decode-1", 2, 9_000),
                ("decode-0", "decode-2", 1, 5_000)
            ]
        );
        assert!(a.in_flight(10_000, &[]).is_empty());
    }

    #[test]
    fn a_transfer_lifecycle_with_known_offsets() {
        let mut a = NixlAggregator::new();
        a.apply(&ev(EventKind::AgentNew, |e| e.name = "decode-0".into()));
        a.apply(&ev(EventKind::XferCreate, |e| {
            e.req = 0xa;
            e.op = 0;
            e.name = "decode-1".into();
        }));
        a.apply(&ev(EventKind::XferPost, |e| {
            e.req = 0xa;
            e.status = 1;
            e.flags = flags::OFFSETS_KNOWN;
            e.op = 0;
            e.bytes = 8192;
            e.descs = 2;
            e.name = "decode-1".into();
        }));
        a.apply(&ev(EventKind::XferDone, |e| {
            e.req = 0xa;
            e.status = 0;
            e.latency_ns = 5_000;
        }));
        // Reposted, then it fails at completion.
        a.apply(&ev(EventKind::XferPost, |e| {
            e.req = 0xa;
            e.status = 1;
            e.flags = flags::OFFSETS_KNOWN;
            e.op = 0;
            e.bytes = 8192;
            e.name = "decode-1".into();
        }));
        a.apply(&ev(EventKind::XferDone, |e| {
            e.req = 0xa;
            e.status = -3;
            e.latency_ns = 9_000;
        }));
        a.apply(&ev(EventKind::XferRelease, |e| e.req = 0xa));
        let r = a.report();
        assert_eq!(r.transfers.len(), 2, "{:#?}", r.transfers);
        let ok = r.transfers.iter().find(|t| t.status == "SUCCESS").unwrap();
        assert_eq!(
            (
                ok.local_agent.as_str(),
                ok.remote_agent.as_str(),
                ok.op.as_str()
            ),
            ("decode-0", "decode-1", "READ")
        );
        assert_eq!((ok.transfers, ok.bytes, ok.descriptors), (1, 8192, 2));
        assert_eq!(
            (ok.latency.count, ok.latency.sum_ns, ok.latency.max_ns),
            (1, 5_000, 5_000)
        );
        assert_eq!(*ok.latency.buckets.last().unwrap(), 1);
        assert_eq!(ok.latency.buckets[1], 0, "5 µs is above the 2.5 µs bucket");
        assert_eq!(ok.latency.buckets[2], 1, "and within 5 µs");
        let bad = r
            .transfers
            .iter()
            .find(|t| t.status == "ERR_BACKEND")
            .unwrap();
        assert_eq!((bad.stage, bad.transfers), (XferStage::Complete, 1));
        assert_eq!(a.requests.len(), 0, "released");
    }

    #[test]
    fn failures_at_create_and_post_and_release_in_flight() {
        let mut a = NixlAggregator::new();
        a.apply(&ev(EventKind::XferCreate, |e| {
            e.status = -4;
            e.op = 1;
            e.name = "ghost".into();
        }));
        a.apply(&ev(EventKind::XferCreate, |e| {
            e.req = 0xb;
            e.op = 1;
            e.name = "peer".into();
        }));
        // Unknown build: no offsets, op and remote come from the creation.
        a.apply(&ev(EventKind::XferPost, |e| {
            e.req = 0xb;
            e.status = -2;
        }));
        a.apply(&ev(EventKind::XferCreate, |e| {
            e.req = 0xc;
            e.op = 1;
            e.name = "peer".into();
        }));
        a.apply(&ev(EventKind::XferPost, |e| {
            e.req = 0xc;
            e.status = 1;
        }));
        a.apply(&ev(EventKind::XferRelease, |e| {
            e.req = 0xc;
            e.flags = flags::IN_FLIGHT;
        }));
        a.apply(&ev(EventKind::XferDone, |e| e.req = 0xdead));
        // Posted in progress, released without a completion or the in-flight flag.
        a.apply(&ev(EventKind::XferCreate, |e| e.req = 0xd));
        a.apply(&ev(EventKind::XferPost, |e| {
            e.req = 0xd;
            e.status = 1;
        }));
        a.apply(&ev(EventKind::XferRelease, |e| e.req = 0xd));
        let r = a.report();
        let stages: Vec<_> = r
            .transfers
            .iter()
            .map(|t| {
                (
                    t.stage,
                    t.status.as_str(),
                    t.remote_agent.as_str(),
                    t.op.as_str(),
                    t.local_agent.as_str(),
                )
            })
            .collect();
        assert!(stages.contains(&(
            XferStage::Create,
            "ERR_NOT_FOUND",
            "ghost",
            "WRITE",
            UNKNOWN_AGENT
        )));
        assert!(stages.contains(&(
            XferStage::Post,
            "ERR_INVALID_PARAM",
            "peer",
            "WRITE",
            UNKNOWN_AGENT
        )));
        assert!(stages.contains(&(
            XferStage::ReleasedInFlight,
            "IN_PROG",
            "peer",
            "WRITE",
            UNKNOWN_AGENT
        )));
        assert_eq!(
            r.events_malformed, 2,
            "a completion for an unknown request, a completion lost"
        );
    }

    #[test]
    fn handshakes_by_call_and_status_and_async_loads_name_their_agent() {
        let mut a = NixlAggregator::new();
        a.apply(&ev(EventKind::AgentNew, |e| {
            e.name = "prefill".into();
            e.data = 0x200;
        }));
        for status in [0, -5, 0] {
            a.apply(&ev(EventKind::Call, |e| {
                e.call = Some(NixlCall::LoadRemoteMd);
                e.status = status;
                e.latency_ns = 1_000;
                e.name = "decode".into();
            }));
        }
        a.apply(&ev(EventKind::Call, |e| {
            e.agent = 0x200; // the nixlAgentData of the background thread
            e.call = Some(NixlCall::LoadRemoteMdAsync);
            e.name = "decode".into();
        }));
        let r = a.report();
        let load_ok = r
            .calls
            .iter()
            .find(|c| c.call == "loadRemoteMD" && c.status == "SUCCESS")
            .unwrap();
        assert_eq!(
            (load_ok.calls, load_ok.local_agent.as_str()),
            (2, "prefill")
        );
        assert!(r
            .calls
            .iter()
            .any(|c| c.call == "loadRemoteMD" && c.status == "ERR_MISMATCH" && c.calls == 1));
        let asynchronous = r
            .calls
            .iter()
            .find(|c| c.call == "loadRemoteMD_async")
            .unwrap();
        assert_eq!(asynchronous.local_agent, "prefill");
    }

    /// A process's complete transfer to "peer" taking `latency_ns`, and one handshake.
    fn traffic(a: &mut NixlAggregator, pid: u32, req: u64, latency_ns: u64) {
        let at = |kind, f: &dyn Fn(&mut NixlEvent)| {
            ev(kind, |e| {
                e.pid = pid;
                e.req = req;
                f(e);
            })
        };
        a.apply(&at(EventKind::AgentNew, &|e| e.name = "decode-0".into()));
        a.apply(&at(EventKind::XferCreate, &|e| {
            e.op = 1;
            e.name = "peer".into();
        }));
        a.apply(&at(EventKind::XferPost, &|e| e.status = 1));
        a.apply(&at(EventKind::XferDone, &|e| e.latency_ns = latency_ns));
        a.apply(&at(EventKind::Call, &|e| {
            e.call = Some(NixlCall::LoadRemoteMd);
            e.name = "peer".into();
        }));
    }

    /// The report's figures summed over pids, as `/metrics` and the collector show them.
    fn totals(r: &NixlReport) -> BTreeMap<String, (u64, u64, u64, Vec<u64>)> {
        let mut m: BTreeMap<String, (u64, u64, u64, Vec<u64>)> = BTreeMap::new();
        let rows = r
            .transfers
            .iter()
            .map(|t| {
                let k = format!("{} {} {:?} {}", t.local_agent, t.op, t.stage, t.status);
                (k, t.transfers, t.bytes, &t.latency)
            })
            .chain(r.calls.iter().map(|c| {
                let k = format!("{} {} {}", c.local_agent, c.call, c.status);
                (k, c.calls, c.bytes, &c.latency)
            }));
        for (k, n, bytes, latency) in rows {
            let e = m.entry(k).or_default();
            e.0 += n;
            e.1 += bytes;
            e.2 += latency.count;
            e.3.resize(latency.buckets.len(), 0);
            e.3.iter_mut()
                .zip(&latency.buckets)
                .for_each(|(a, b)| *a += b);
        }
        m
    }

    #[test]
    fn an_exited_process_is_folded_into_the_totals_and_forgotten() {
        let mut a = NixlAggregator::new();
        traffic(&mut a, 7, 0xa, 3_000);
        traffic(&mut a, 8, 0xa, 40_000);
        // A process traced without its agent's creation: figures only.
        a.apply(&ev(EventKind::Call, |e| {
            e.pid = 9;
            e.call = Some(NixlCall::GenNotif);
        }));
        assert_eq!(a.pids(), vec![7, 8, 9]);
        let before = totals(&a.report());

        a.process_exited(7);
        a.process_exited(9);
        let r = a.report();
        assert_eq!(totals(&r), before, "folding keeps every total");
        let pids: BTreeSet<u32> = r
            .transfers
            .iter()
            .map(|t| t.pid)
            .chain(r.calls.iter().map(|c| c.pid))
            .collect();
        assert_eq!(pids, BTreeSet::from([EXITED_PID, 8]));
        assert_eq!(a.pids(), vec![8], "no state left of 7 and 9");
        assert!(a.agents.keys().all(|(p, _)| *p == 8));
        let done = |r: &NixlReport, pid| {
            r.transfers
                .iter()
                .find(|t| t.pid == pid && t.stage == XferStage::Complete)
                .map(|t| (t.transfers, t.latency.max_ns))
        };
        assert_eq!(done(&r, EXITED_PID), Some((1, 3_000)));

        // The last process exits, then a new one reuses pid 7 and exits too: the folded
        // figures only grow, with the merged latency.
        a.process_exited(8);
        traffic(&mut a, 7, 0xb, 90_000);
        a.process_exited(7);
        let r = a.report();
        assert_eq!(a.pids(), Vec::<u32>::new());
        assert_eq!(
            r.transfers.iter().filter(|t| t.pid != EXITED_PID).count(),
            0
        );
        assert_eq!(done(&r, EXITED_PID), Some((3, 90_000)));
        let after = totals(&r);
        for (k, (n, bytes, count, buckets)) in &before {
            let (n2, bytes2, count2, buckets2) = &after[k];
            assert!(
                n2 >= n && bytes2 >= bytes && count2 >= count,
                "{k} went down"
            );
            assert!(buckets2.iter().zip(buckets).all(|(b2, b)| b2 >= b), "{k}");
        }
        assert_eq!(after["decode-0 WRITE Complete SUCCESS"].0, 3);
        let latency = &r
            .transfers
            .iter()
            .find(|t| t.pid == EXITED_PID && t.stage == XferStage::Complete)
            .unwrap()
            .latency;
        assert_eq!((latency.count, latency.sum_ns), (3, 133_000));
    }
}
