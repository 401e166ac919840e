//! A transfer loop for measuring what probes cost: two agents in this process, N
//! transfers of S bytes, each through the full lifecycle (`createXferReq` →
//! `postXferReq` → `getXferStatus`* → `releaseXferReq`) unless the handle is reused.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, MemType, NixlError, OptArgs, SystemStorage, XferDescList, XferStatus,
};
use serde::{Deserialize, Serialize};

use crate::libs::NixlLibs;
use crate::truth::Op;
use crate::worker::WorkerError;

/// What to measure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BenchConfig {
    /// Bytes per transfer.
    pub size: u64,
    /// Measured transfers.
    pub iters: u32,
    /// Unmeasured transfers first.
    pub warmup: u32,
    /// READ or WRITE.
    pub op: Op,
    /// Descriptors the bytes are split into (each `size / descs`).
    pub descs: u32,
    /// Attach a notification to every transfer.
    pub notif: bool,
    /// Create one request and repost it, instead of create/release per transfer.
    pub reuse_handle: bool,
    /// Pause of NIXL's progress thread between UCX progress rounds (µs). nixl-sys's
    /// default, 0, makes two threads spin beside the loop; on a small machine that
    /// shows up as multi-ms stalls (mean ≫ median). 100 keeps the loop's numbers steady.
    pub progress_delay_us: u64,
    /// Stop early after this many seconds.
    pub max_secs: u64,
    /// Prefix of the two agents' names (`<prefix>initiator`, `<prefix>target`).
    pub agent_prefix: String,
    /// Pause before each transfer, ms (0: none). A paced loop is not a measurement: it
    /// keeps two agents alive and busy for tools attached later (the lab's worker
    /// sidecars).
    pub pace_ms: u64,
    /// After the first post that leaves its transfer in progress, wait this long before
    /// polling its status (ms; 0: poll at once): a transfer held in flight, as one whose
    /// peer never completes it looks to the probes until it is polled again. Only the
    /// first: posts often complete inside the call on loopback, so a caller asks for
    /// enough transfers that one is left in progress, and is held once.
    pub hold_ms: u64,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            size: 4096,
            iters: 20_000,
            warmup: 200,
            op: Op::Write,
            descs: 1,
            notif: false,
            reuse_handle: false,
            progress_delay_us: 100,
            max_secs: 120,
            agent_prefix: "bench-".into(),
            pace_ms: 0,
            hold_ms: 0,
        }
    }
}

/// Latency percentiles, ns.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Percentiles {
    /// Median.
    pub p50: u64,
    /// 90th.
    pub p90: u64,
    /// 99th.
    pub p99: u64,
    /// Largest.
    pub max: u64,
}

/// What `bench` prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// Process that ran the loop.
    pub pid: u32,
    /// The configuration.
    pub config: BenchConfig,
    /// Measured transfers completed.
    pub transfers: u64,
    /// Failed transfers (should be 0).
    pub failures: u64,
    /// Wall clock of the measured loop, ns.
    pub elapsed_ns: u64,
    /// Transfers per second.
    pub transfers_per_sec: f64,
    /// Bytes per second.
    pub bytes_per_sec: f64,
    /// Mean ns per transfer (elapsed / transfers), lifecycle included.
    pub ns_per_transfer: f64,
    /// Per-transfer latency (create → done → release), ns.
    pub latency_ns: Percentiles,
    /// Posts that completed inside `postXferReq`.
    pub post_completed_inline: u64,
    /// `getXferStatus` calls.
    pub status_polls: u64,
    /// Calls per `nixlAgent` method in the measured loop.
    pub nixl_calls: BTreeMap<String, u64>,
    /// The `libnixl.so` used.
    pub libnixl: String,
    /// Its build-id.
    pub build_id: Option<String>,
    /// True when `max_secs` cut the loop short.
    pub cut_short: bool,
}

fn percentiles(mut v: Vec<u64>) -> Percentiles {
    if v.is_empty() {
        return Percentiles::default();
    }
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    Percentiles {
        p50: at(0.50),
        p90: at(0.90),
        p99: at(0.99),
        max: *v.last().unwrap_or(&0),
    }
}

fn agent(name: &str, progress_delay_us: u64) -> Result<Agent, WorkerError> {
    let err = |what| {
        move |source| WorkerError::Nixl {
            what,
            agent: name.to_string(),
            source,
        }
    };
    let cfg = AgentConfig {
        enable_prog_thread: true,
        enable_listen_thread: false,
        pthr_delay_us: progress_delay_us,
        ..AgentConfig::default()
    };
    let a = Agent::new_configured(name, &cfg).map_err(err("creating the agent"))?;
    let (_m, params) = a
        .get_plugin_params("UCX")
        .map_err(err("getPluginParams(UCX)"))?;
    a.create_backend("UCX", &params)
        .map_err(err("createBackend(UCX)"))?;
    Ok(a)
}

/// Posts `req` and polls it to completion: `Some((completed inside the post, polls))`,
/// `None` on failure or when still in progress at `deadline`.
fn post_and_wait(
    agent: &Agent,
    req: &nixl_sys::XferRequest,
    calls: &mut BTreeMap<String, u64>,
    deadline: Instant,
    hold: Duration,
) -> Option<(bool, u64)> {
    *calls.entry("postXferReq".into()).or_insert(0) += 1;
    match agent.post_xfer_req(req, None) {
        Ok(false) => Some((true, 0)),
        Ok(true) => {
            std::thread::sleep(hold);
            let mut polls = 0;
            loop {
                polls += 1;
                *calls.entry("getXferStatus".into()).or_insert(0) += 1;
                match agent.get_xfer_status(req) {
                    Ok(XferStatus::Success) => return Some((false, polls)),
                    Ok(XferStatus::InProgress) if Instant::now() >= deadline => return None,
                    Ok(XferStatus::InProgress) => std::hint::spin_loop(),
                    Err(_) => return None,
                }
            }
        }
        Err(_) => None,
    }
}

/// Runs the loop.
pub fn bench(config: BenchConfig, libs: &NixlLibs) -> Result<BenchReport, WorkerError> {
    if nixl_sys::is_stub() {
        return Err(WorkerError::CapiMissing);
    }
    let nixl = |what: &'static str| {
        move |source: NixlError| WorkerError::Nixl {
            what,
            agent: "bench".into(),
            source,
        }
    };
    let target_name = format!("{}target", config.agent_prefix);
    let initiator = agent(
        &format!("{}initiator", config.agent_prefix),
        config.progress_delay_us,
    )?;
    let target = agent(&target_name, config.progress_delay_us)?;
    let size = config.size.max(1) as usize;
    let descs = config
        .descs
        .clamp(1, u32::try_from(size).unwrap_or(u32::MAX)) as usize;
    let piece = size / descs;
    let mut local_pool = SystemStorage::new(size).map_err(nixl("allocating"))?;
    local_pool.memset(0x5a);
    let remote_pool = SystemStorage::new(size).map_err(nixl("allocating"))?;
    let mut local_reg = initiator
        .register_memory(&local_pool, None)
        .map_err(nixl("registerMem"))?;
    let mut remote_reg = target
        .register_memory(&remote_pool, None)
        .map_err(nixl("registerMem"))?;
    let md = target.get_local_md().map_err(nixl("getLocalMD"))?;
    initiator
        .load_remote_md(&md)
        .map_err(nixl("loadRemoteMD"))?;
    initiator
        .make_connection(&target_name, None)
        .map_err(nixl("makeConnection"))?;

    let (la, ra) = (
        local_pool.as_slice().as_ptr() as usize,
        remote_pool.as_slice().as_ptr() as usize,
    );
    let mut local = XferDescList::new(MemType::Dram).map_err(nixl("XferDescList"))?;
    let mut remote = XferDescList::new(MemType::Dram).map_err(nixl("XferDescList"))?;
    for d in 0..descs {
        local.add_desc(la + d * piece, piece, 0);
        remote.add_desc(ra + d * piece, piece, 0);
    }
    let opts = if config.notif {
        let mut o = OptArgs::new().map_err(nixl("OptArgs"))?;
        o.set_notification_message(b"bench")
            .map_err(nixl("OptArgs"))?;
        o.set_has_notification(true).map_err(nixl("OptArgs"))?;
        Some(o)
    } else {
        None
    };

    let mut calls: BTreeMap<String, u64> = BTreeMap::new();
    let mut latencies = Vec::with_capacity(config.iters as usize);
    let (mut inline, mut polls, mut failures) = (0u64, 0u64, 0u64);
    let deadline = Duration::from_secs(config.max_secs);
    let mut cut_short = false;
    let reused = if config.reuse_handle {
        Some(
            initiator
                .create_xfer_req(
                    config.op.xfer_op(),
                    &local,
                    &remote,
                    &target_name,
                    opts.as_ref(),
                )
                .map_err(nixl("createXferReq"))?,
        )
    } else {
        None
    };
    let total = config.warmup + config.iters;
    let mut hold = Duration::from_millis(config.hold_ms);
    let mut t_loop = Instant::now();
    for i in 0..total {
        let measured = i >= config.warmup;
        if i == config.warmup {
            t_loop = Instant::now();
            calls.clear();
            (inline, polls, failures) = (0, 0, 0);
        }
        if t_loop.elapsed() > deadline {
            cut_short = true;
            break;
        }
        if config.pace_ms > 0 {
            std::thread::sleep(Duration::from_millis(config.pace_ms));
        }
        let t = Instant::now();
        let result = match &reused {
            Some(req) => post_and_wait(&initiator, req, &mut calls, t_loop + deadline, hold),
            None => {
                *calls.entry("createXferReq".into()).or_insert(0) += 1;
                match initiator.create_xfer_req(
                    config.op.xfer_op(),
                    &local,
                    &remote,
                    &target_name,
                    opts.as_ref(),
                ) {
                    Ok(req) => {
                        let result =
                            post_and_wait(&initiator, &req, &mut calls, t_loop + deadline, hold);
                        *calls.entry("releaseXferReq".into()).or_insert(0) += 1;
                        drop(req); // releaseXferReq
                        result
                    }
                    Err(_) => None,
                }
            }
        };
        match result {
            Some((done_inline, n)) => {
                inline += u64::from(done_inline);
                polls += n;
                if !done_inline {
                    hold = Duration::ZERO;
                }
            }
            None => failures += 1,
        }
        if measured {
            latencies.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
        }
    }
    let elapsed = t_loop.elapsed();
    drop(reused);
    let _ = local_reg.deregister();
    let _ = remote_reg.deregister();
    let _ = initiator.invalidate_remote_md(&target_name);

    let transfers = latencies.len() as u64;
    let secs = elapsed.as_secs_f64().max(f64::MIN_POSITIVE);
    Ok(BenchReport {
        pid: std::process::id(),
        transfers,
        failures,
        elapsed_ns: u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX),
        transfers_per_sec: transfers as f64 / secs,
        bytes_per_sec: (transfers * size as u64) as f64 / secs,
        ns_per_transfer: if transfers > 0 {
            elapsed.as_nanos() as f64 / transfers as f64
        } else {
            0.0
        },
        latency_ns: percentiles(latencies),
        post_completed_inline: inline,
        status_polls: polls,
        nixl_calls: calls,
        libnixl: libs.libnixl.display().to_string(),
        build_id: libs.build_id.clone(),
        cut_short,
        config,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_ranks() {
        let p = percentiles((1..=100).collect());
        assert_eq!((p.p50, p.p90, p.p99, p.max), (51, 90, 99, 100));
        assert_eq!(percentiles(vec![]), Percentiles::default());
    }
}
