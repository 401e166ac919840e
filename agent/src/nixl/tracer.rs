//! The running NIXL tracer: attaches the probes to configured and discovered
//! `libnixl.so` files, drains their ring buffers into the [`NixlAggregator`], rescans
//! `/proc` for new copies of the library and for exited processes.

use super::aggregate::NixlAggregator;
use super::derive::Isa;
use super::discovery::{self, FileId};
use super::event::NixlEvent;
use super::library::{LibraryError, NixlLibrary};
use super::offsets::Counts;
use super::probes::{self, AttachScope, LoadedProbes, TransferCounting};
use super::spans::NixlSpans;
use aya::maps::{MapData, RingBuf};
use kvscope_wire::nixl::{NixlLibraryStatus, NixlReport};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::task::JoinHandle;
use tracing::{info, warn};

/// How long a request's transfers stay in the reports after they last moved: long
/// enough that a report lost on the way is made good by a later one.
pub(crate) const REQUESTS_WINDOW_NS: u64 = 30_000_000_000;

/// What to trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NixlTraceConfig {
    /// Trace NIXL at all.
    pub enabled: bool,
    /// `libnixl.so` files to attach to at start, before any process maps them.
    pub libraries: Vec<PathBuf>,
    /// Also find libraries mapped by running processes (`/proc/*/maps`), now and every
    /// `scan_interval_secs`.
    pub discover: bool,
    /// Trace only this process.
    pub pid: Option<u32>,
    /// See transfers end, posts return and creations fail at the completion sites
    /// derived from each build (no probe on a status poll or a successful creation);
    /// false: always with the probes on the methods' entries and returns (exact too,
    /// but they fire on every poll).
    pub completion_sites: bool,
    /// Where the probes count every transfer themselves (a build whose offsets are
    /// known), send the record of one transfer in this many (1: every one) besides
    /// every failure, every one carrying a notification and every slow one. The records
    /// make spans (each says why it was kept) and the request join; the figures stay
    /// exact whatever this is.
    pub sample_every: u64,
    /// A transfer slower than this (post → terminal status, ms) has its record sent
    /// whatever `sample_every` is; 0: none for that alone.
    pub slow_transfer_ms: f64,
    /// Series (process, agents, op, stage, status) the kernel's table of transfer
    /// tallies holds, preallocated (~19 KiB each, per traced library); a series past it
    /// has every transfer's record sent and counted by the agent instead.
    pub tally_series: u32,
    pub scan_interval_secs: f64,
    /// How often the figures are sent to the collector.
    pub report_interval_secs: f64,
}

impl Default for NixlTraceConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            libraries: Vec::new(),
            discover: true,
            pid: None,
            completion_sites: true,
            sample_every: 16,
            slow_transfer_ms: 10.0,
            tally_series: 512,
            scan_interval_secs: 2.0,
            report_interval_secs: 1.0,
        }
    }
}

#[derive(Default)]
struct State {
    aggregator: NixlAggregator,
    libraries: BTreeMap<FileId, NixlLibraryStatus>,
    /// Discovered files that could not be traced: not retried every scan.
    failed: BTreeSet<FileId>,
    /// Processes whose maps could not be read, already warned of.
    denied: BTreeSet<u32>,
    malformed: u64,
    /// Probe records read.
    read: u64,
    /// When a traced process was first seen gone.
    exited_at: std::collections::HashMap<u32, std::time::Instant>,
    /// Spans of transfers and handshakes, once OTLP trace export is on.
    spans: Option<NixlSpans>,
}

struct Attached {
    probes: Arc<Mutex<LoadedProbes>>,
    reader: JoinHandle<()>,
}

/// A started tracer. Dropping it detaches every probe.
pub struct NixlTracer {
    state: Arc<Mutex<State>>,
    attached: Arc<Mutex<BTreeMap<FileId, Attached>>>,
    scanner: Option<JoinHandle<()>>,
}

impl Drop for NixlTracer {
    fn drop(&mut self) {
        if let Some(s) = self.scanner.take() {
            s.abort();
        }
        let mut attached = lock(&self.attached);
        for (_, a) in std::mem::take(&mut *attached) {
            a.reader.abort();
        }
    }
}

/// CLOCK_MONOTONIC in ns: the clock of the probes' time stamps (`bpf_ktime_get_ns`).
fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn degraded_reason(lib: &NixlLibrary, offsets_known: bool) -> Option<String> {
    let mut reasons = Vec::new();
    if !offsets_known {
        reasons.push(format!(
            "the struct offsets could not be derived from the library ({}): calls, \
             statuses and latencies are counted, but bytes, descriptor counts, the op of \
             transfers made with makeXferReq and agents' names are not read (`kvscope \
             agent nixl-inspect {}` shows what was found)",
            lib.derivation
                .offsets()
                .err()
                .unwrap_or_else(|| "unknown reason".into()),
            lib.path.display()
        ));
    }
    match lib.offsets.map(|o| o.counts) {
        Some(Counts::Never) => reasons.push(format!(
            "bytes and descriptor counts are not read ({}): each transfer's bytes are \
             counted as unknown; every other figure is exact",
            lib.derivation.counts_because
        )),
        Some(Counts::WithTelemetry { .. }) => reasons.push(format!(
            "bytes and descriptor counts are read only from agents whose NIXL telemetry is \
             enabled (NIXL_TELEMETRY_ENABLE=y, or the agent's config; {}): other \
             transfers' bytes are counted as unknown; every other figure is exact",
            lib.derivation.counts_because
        )),
        _ => {}
    }
    if !lib.missing.is_empty() {
        reasons.push(format!(
            "methods not exported, not traced: {}",
            lib.missing.join(", ")
        ));
    }
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

impl NixlTracer {
    /// Attach to the configured libraries (an error here is fatal: it names the missing
    /// capability or kernel feature), then keep discovering.
    pub async fn start(cfg: &NixlTraceConfig) -> anyhow::Result<Self> {
        probes::check_can_load()?;
        let tracer = Self {
            state: Arc::new(Mutex::new(State::default())),
            attached: Arc::new(Mutex::new(BTreeMap::new())),
            scanner: None,
        };
        let scope = match cfg.pid.and_then(NonZeroU32::new) {
            Some(pid) => AttachScope::Process(pid),
            None => AttachScope::AllProcesses,
        };
        let sites = ProbeSettings {
            completion_sites: cfg.completion_sites,
            counting: TransferCounting {
                tally_series: cfg.tally_series.max(1),
                sample_every: cfg.sample_every.max(1),
                slow_ns: (cfg.slow_transfer_ms.max(0.0) * 1e6) as u64,
            },
        };
        for path in &cfg.libraries {
            let id = discovery::file_id(path).map_err(|e| {
                anyhow::anyhow!("cannot read the NIXL library {}: {e}", path.display())
            })?;
            attach_one(&tracer.state, &tracer.attached, id, path, scope, sites)?;
        }
        let mut tracer = tracer;
        if cfg.discover {
            let state = tracer.state.clone();
            let attached = tracer.attached.clone();
            let only_pid = cfg.pid;
            let every = Duration::from_secs_f64(cfg.scan_interval_secs.max(0.05));
            // The first scan runs before start returns, so processes already running
            // are traced from the moment the agent is up. Other users' processes it may
            // not read for want of CAP_SYS_PTRACE make it stop here, naming it: on a
            // node, those are the engines.
            let denied = rescan(&state, &attached, only_pid, scope, sites);
            if let Some(pid) = denied.first() {
                let lacking = crate::capabilities::effective()
                    .map(|eff| crate::capabilities::lacking(eff, &["SYS_PTRACE"]))
                    .unwrap_or_default();
                if !lacking.is_empty() {
                    anyhow::bail!(
                        "cannot read /proc/<pid>/maps of {} processes of other users (pid {pid} \
                         among them), so cannot find their libnixl.so: the agent lacks \
                         CAP_SYS_PTRACE (or give the library with --nixl-lib and \
                         --no-nixl-discover)",
                        denied.len()
                    );
                }
            }
            tracer.scanner = Some(tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    let (state, attached) = (state.clone(), attached.clone());
                    let _ = tokio::task::spawn_blocking(move || {
                        rescan(&state, &attached, only_pid, scope, sites)
                    })
                    .await;
                }
            }));
        }
        Ok(tracer)
    }

    /// The figures so far, with each library's status and the records lost, and the
    /// requests whose transfers moved in the last [`REQUESTS_WINDOW_NS`].
    pub fn report(&self) -> NixlReport {
        let lost: u64 = lock(&self.attached)
            .values()
            .map(|a| lock(&a.probes).lost())
            .sum();
        settle(&self.state, &self.attached);
        let in_flight: Vec<_> = lock(&self.attached)
            .values()
            .flat_map(|a| lock(&a.probes).in_flight())
            .collect();
        let st = lock(&self.state);
        let mut r = st.aggregator.report();
        let now = monotonic_ns();
        r.in_flight = st.aggregator.in_flight(now, &in_flight);
        r.requests = st.aggregator.recent_requests(now, REQUESTS_WINDOW_NS);
        r.libraries = st.libraries.values().cloned().collect();
        r.events_lost = lost;
        r.events_malformed += st.malformed;
        r.events_read = st.read;
        r
    }

    /// The live local agents by (pid, name).
    pub fn local_agents(&self) -> std::collections::BTreeSet<(u32, String)> {
        settle(&self.state, &self.attached);
        lock(&self.state).aggregator.local_agents()
    }

    /// Send a span per transfer and handshake from now on (rate-capped by the sink).
    pub(crate) fn set_spans(&self, spans: NixlSpans) {
        if spans.sink.enabled() {
            lock(&self.state).spans = Some(spans);
        }
    }

    /// Libraries with probes attached.
    pub fn attached_libraries(&self) -> usize {
        lock(&self.attached).len()
    }
}

fn attach_one(
    state: &Arc<Mutex<State>>,
    attached: &Arc<Mutex<BTreeMap<FileId, Attached>>>,
    id: FileId,
    path: &Path,
    scope: AttachScope,
    settings: ProbeSettings,
) -> Result<(), anyhow::Error> {
    if lock(attached).contains_key(&id) {
        return Ok(());
    }
    let library = NixlLibrary::inspect(path, settings.completion_sites)?;
    if library.derivation.isa != Isa::X86_64 {
        return Err(LibraryError::ForeignIsa {
            path: path.to_owned(),
            isa: library.derivation.isa,
        }
        .into());
    }
    let mut probes = LoadedProbes::attach(library, scope, settings.counting)?;
    let offsets_known = probes.offsets.is_some();
    let status = NixlLibraryStatus {
        path: path.display().to_string(),
        build_id: probes.library.build_id.clone(),
        offsets_known,
        completion_sites: probes.library.sites,
        post_site: probes.library.post_at_site,
        creation_sites: probes.library.creations_at_sites,
        probes_attached: probes.attached as u32,
        degraded: degraded_reason(&probes.library, offsets_known),
    };
    match (&status.degraded, &probes.offsets) {
        (Some(why), _) => warn!(library = %status.path, "NIXL tracing degraded: {why}"),
        (None, Some(o)) => info!(
            library = %status.path, build_id = %status.build_id, offsets = o.version,
            probes = status.probes_attached, completion_sites = status.completion_sites,
            "Tracing NIXL."
        ),
        (None, None) => {}
    }
    let ring = probes
        .take_ring()
        .ok_or_else(|| anyhow::anyhow!("the NIXL BPF object has no `events` ring buffer"))?;
    let reader = tokio::spawn(read_ring(ring, state.clone()));
    lock(state).libraries.insert(id.clone(), status);
    lock(attached).insert(
        id,
        Attached {
            probes: Arc::new(Mutex::new(probes)),
            reader,
        },
    );
    Ok(())
}

/// Look for new libraries and attach to them; returns the processes whose maps could
/// not be read (each warned of once).
fn rescan(
    state: &Arc<Mutex<State>>,
    attached: &Arc<Mutex<BTreeMap<FileId, Attached>>>,
    only_pid: Option<u32>,
    scope: AttachScope,
    settings: ProbeSettings,
) -> BTreeSet<u32> {
    let discovery::Scan {
        libraries: found,
        denied,
    } = discovery::scan(Path::new("/proc"), only_pid);
    {
        let mut st = lock(state);
        let new: Vec<u32> = denied.difference(&st.denied).copied().collect();
        if !new.is_empty() {
            warn!(pids = ?new, "Cannot read these processes' maps (permission): a libnixl.so in them is not traced.");
        }
        st.denied = denied.clone();
    }
    for (id, lib) in &found {
        if lock(attached).contains_key(id) || lock(state).failed.contains(id) {
            continue;
        }
        match attach_one(state, attached, id.clone(), &lib.path, scope, settings) {
            Ok(()) => {
                info!(library = %lib.path.display(), pids = ?lib.pids, "Found a NIXL process.")
            }
            Err(e) => {
                warn!(library = %lib.path.display(), "Cannot trace NIXL: {e:#}");
                let mut st = lock(state);
                st.failed.insert(id.clone());
                st.libraries.insert(
                    id.clone(),
                    NixlLibraryStatus {
                        path: lib.path.display().to_string(),
                        build_id: String::new(),
                        offsets_known: false,
                        completion_sites: false,
                        post_site: false,
                        creation_sites: false,
                        probes_attached: 0,
                        degraded: Some(format!("not traced: {e:#}")),
                    },
                );
            }
        }
    }
    settle(state, attached);
    denied
}

/// How long a process must be gone before its agents and handles are forgotten: its
/// last probe records may still wait in the ring buffer.
const EXITED_GRACE: Duration = Duration::from_secs(10);

/// What the probes are loaded with, the same for every library.
#[derive(Clone, Copy, Debug)]
struct ProbeSettings {
    completion_sites: bool,
    counting: TransferCounting,
}

/// The kernel's tallies read afresh, then the processes that exited forgotten, here and
/// in the probes' maps: all under the libraries' lock (taken before the state's, as
/// everywhere), so that no other reading of the tallies comes between the two.
fn settle(state: &Arc<Mutex<State>>, attached: &Arc<Mutex<BTreeMap<FileId, Attached>>>) {
    let attached = lock(attached);
    let mut tallies = Vec::new();
    for a in attached.values() {
        match lock(&a.probes).tallies() {
            Ok(t) => tallies.extend(t),
            // Not a part taken for the whole (a process's figures would be folded short
            // and the rest deleted): the last reading stands until the next.
            Err(e) => {
                warn!("cannot read the NIXL probes' tallies: {e}");
                return;
            }
        }
    }
    let exited = {
        let mut st = lock(state);
        st.aggregator.set_kernel_tallies(tallies);
        forget_exited(&mut st)
    };
    if !exited.is_empty() {
        for a in attached.values() {
            lock(&a.probes).forget_processes(&exited);
        }
    }
}

/// Forget the agents and request handles of processes that exited (their pids may be
/// reused, and their handles would otherwise stay forever), folding their figures into
/// the exited processes' (see [`NixlAggregator::process_exited`]); the pids forgotten.
fn forget_exited(st: &mut State) -> Vec<u32> {
    let now = std::time::Instant::now();
    let mut forgotten = Vec::new();
    for pid in st.aggregator.pids() {
        if Path::new("/proc").join(pid.to_string()).exists() {
            st.exited_at.remove(&pid);
            continue;
        }
        let since = *st.exited_at.entry(pid).or_insert(now);
        if now.duration_since(since) >= EXITED_GRACE {
            st.aggregator.process_exited(pid);
            st.exited_at.remove(&pid);
            forgotten.push(pid);
        }
    }
    forgotten
}

/// How often the agent drains the ring buffer when the probes did not wake it.
const DRAIN_INTERVAL: Duration = Duration::from_millis(20);

async fn read_ring(ring: RingBuf<MapData>, state: Arc<Mutex<State>>) {
    let mut fd = match AsyncFd::new(ring) {
        Ok(fd) => fd,
        Err(e) => {
            warn!("cannot poll the NIXL ring buffer: {e}");
            return;
        }
    };
    // The probes wake the agent only when the ring fills up (see `event_submit` in
    // ebpf/nixl/common.h); a short timer drains it otherwise.
    let mut tick = tokio::time::interval(DRAIN_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut batch = Vec::new();
        tokio::select! {
            ready = fd.readable_mut() => {
                let mut guard = match ready {
                    Ok(g) => g,
                    Err(e) => {
                        warn!("the NIXL ring buffer failed: {e}");
                        return;
                    }
                };
                let ring = guard.get_inner_mut();
                while let Some(item) = ring.next() {
                    batch.push(NixlEvent::decode(&item));
                }
                guard.clear_ready();
            }
            _ = tick.tick() => {
                let ring = fd.get_mut();
                while let Some(item) = ring.next() {
                    batch.push(NixlEvent::decode(&item));
                }
            }
        }
        if batch.is_empty() {
            continue;
        }
        // Span times: the newest event of the batch happened about now (the ring is
        // drained at least every DRAIN_INTERVAL); the others that much earlier by the
        // probes' own clock.
        let now = kvscope_kit::clock::now_ns();
        let newest = batch
            .iter()
            .filter_map(|e| e.as_ref().ok().map(|e| e.ts_ns))
            .max()
            .unwrap_or(0);
        let mut st = lock(&state);
        let State {
            aggregator,
            spans,
            malformed,
            read,
            ..
        } = &mut *st;
        *read += batch.len() as u64;
        for e in batch {
            match (e, spans.as_ref()) {
                (Ok(e), Some(spans)) => aggregator.apply_observing(&e, &mut |o| {
                    spans.record(&o, now.saturating_sub(newest.saturating_sub(o.ts_ns)))
                }),
                (Ok(e), None) => aggregator.apply(&e),
                (Err(err), _) => {
                    *malformed += 1;
                    tracing::debug!("{err}");
                }
            }
        }
    }
}
