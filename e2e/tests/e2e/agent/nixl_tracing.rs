//! The agent's eBPF NIXL tracing against the real `libnixl.so` of the `nixl-cu12==1.5.1`
//! wheel, driven by the NIXL lab (real agents, UCX DRAM transfers, injected failures).
//!
//! Needs root (or CAP_SYS_ADMIN) and uprobes: CI runs as root. Where that is
//! missing these tests FAIL with the agent's own message naming what is missing; they
//! never pass without tracing.
//!
//! Asserts: the agent's transfers (by process, local and remote agent, op, stage and
//! exact status), bytes, descriptors and handshakes (by call, peers and exact status)
//! equal the lab's ground truth; latencies are measured and never exceed the lab's
//! own wall-clock of the same phase; a process started after the agent is found and
//! traced, and traced again when it restarts; a build no table holds is traced exactly
//! at its derived offsets and sites; one whose offsets cannot be derived is still
//! counted, without bytes, and says why.

use super::support;

use kvscope_agent::nixl::NixlTracer;
use kvscope_nixl_lab::truth::{HandshakeCall, TransferOutcome, Truth};
use kvscope_wire::nixl::{NixlReport, XferStage};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;
use support::{start_tracer, tracer_config};

/// (pid, local, remote, op, stage, status name) → (transfers, bytes, descriptors)
type TransferTally = BTreeMap<(u32, String, String, String, XferStage, String), (u64, u64, u64)>;
/// (pid, local, remote, op) → (transfers, Σ ns, max ns) of the lab's own clock
type LabClock = BTreeMap<(u32, String, String, String), (u64, u64, u64)>;
/// (pid, call, local, remote, status name) → calls
type CallTally = BTreeMap<(u32, String, String, String, String), u64>;

fn native_name(code: i32) -> String {
    kvscope_agent::nixl::event::status_name(code).into_owned()
}

/// What the agent reads of a build: its requests' byte and descriptor counts, and the
/// requests themselves (ops, remote agents; registered lengths).
#[derive(Clone, Copy)]
struct Reads {
    counts: bool,
    requests: bool,
    /// Handshakes and background metadata loads compared too.
    handshakes: bool,
}

impl Reads {
    fn all_or_none(with_bytes: bool) -> Self {
        Reads {
            counts: with_bytes,
            requests: with_bytes,
            handshakes: true,
        }
    }
}

fn expected_transfers(truth: &Truth, reads: Reads) -> TransferTally {
    let mut t = TransferTally::new();
    for x in &truth.transfers {
        let code = x
            .status
            .nixl
            .unwrap_or_else(|| panic!("the lab knows every transfer's NIXL status: {x:?}"));
        let stage = match x.outcome {
            TransferOutcome::Done | TransferOutcome::FailedAtCompletion => XferStage::Complete,
            TransferOutcome::FailedAtCreate => XferStage::Create,
            TransferOutcome::FailedAtPost => XferStage::Post,
            TransferOutcome::TimedOut => panic!("a transfer timed out in the lab: {x:?}"),
        };
        let op = serde_json::to_value(x.op)
            .unwrap()
            .as_str()
            .unwrap()
            .to_string();
        let counted = reads.counts && stage != XferStage::Create;
        // makeXferReq names no remote agent (its arguments are prepared lists): a failed
        // one has none, nor, without the build's offsets, does any transfer it made,
        // whose request is then not read.
        let remote = if x.prepped && (stage == XferStage::Create || !reads.requests) {
            String::new()
        } else {
            x.remote.clone()
        };
        let e = t
            .entry((x.pid, x.local.clone(), remote, op, stage, native_name(code)))
            .or_default();
        e.0 += 1;
        if counted {
            e.1 += x.bytes;
            e.2 += u64::from(x.descriptors);
        }
    }
    t
}

fn traced_transfers(report: &NixlReport, pids: &[u32], with_bytes: bool) -> TransferTally {
    let mut t = TransferTally::new();
    for x in report.transfers.iter().filter(|x| pids.contains(&x.pid)) {
        let e = t
            .entry((
                x.pid,
                x.local_agent.clone(),
                x.remote_agent.clone(),
                x.op.clone(),
                x.stage,
                x.status.clone(),
            ))
            .or_default();
        e.0 += x.transfers;
        if with_bytes {
            e.1 += x.bytes;
            e.2 += x.descriptors;
        }
    }
    t
}

/// A failed loadRemoteMD never learns the remote name (the metadata did not parse), and
/// sendLocalMD names an address, not an agent: both sides compare them without one.
fn remote_for(call: &str, status: &str, remote: &str) -> String {
    if (call == "loadRemoteMD" && status != "SUCCESS") || call == "sendLocalMD" {
        String::new()
    } else {
        remote.to_string()
    }
}

fn expected_handshakes(truth: &Truth) -> CallTally {
    let mut t = CallTally::new();
    for h in &truth.handshakes {
        let code = h
            .status
            .nixl
            .unwrap_or_else(|| panic!("the lab knows every handshake's NIXL status: {h:?}"));
        let call = h.call.method().to_string();
        let status = native_name(code).to_string();
        let remote = remote_for(&call, &status, h.remote.as_deref().unwrap_or(""));
        *t.entry((h.pid, call, h.local.clone(), remote, status))
            .or_default() += 1;
    }
    t
}

fn traced_handshakes(report: &NixlReport, pids: &[u32]) -> CallTally {
    let mut t = CallTally::new();
    for c in report.calls.iter().filter(|c| pids.contains(&c.pid)) {
        let is_handshake = [
            HandshakeCall::LoadRemoteMd,
            HandshakeCall::FetchRemoteMd,
            HandshakeCall::SendLocalMd,
            HandshakeCall::MakeConnection,
            HandshakeCall::CheckRemoteMd,
            HandshakeCall::InvalidateRemoteMd,
        ]
        .iter()
        .any(|h| h.method() == c.call);
        if !is_handshake {
            continue;
        }
        let remote = remote_for(&c.call, &c.status, &c.remote_agent);
        *t.entry((
            c.pid,
            c.call.clone(),
            c.local_agent.clone(),
            remote,
            c.status.clone(),
        ))
        .or_default() += c.calls;
    }
    t
}

/// Calls of `method` by these processes.
fn traced_calls(report: &NixlReport, pids: &[u32], method: &str) -> u64 {
    report
        .calls
        .iter()
        .filter(|c| pids.contains(&c.pid) && c.call == method)
        .map(|c| c.calls)
        .sum()
}

fn diff<K: Ord + std::fmt::Debug, V: PartialEq + std::fmt::Debug>(
    want: &BTreeMap<K, V>,
    got: &BTreeMap<K, V>,
) -> Vec<String> {
    let mut out = Vec::new();
    for (k, v) in want {
        match got.get(k) {
            Some(g) if g == v => {}
            other => out.push(format!("{k:?}: lab {v:?}, agent {other:?}")),
        }
    }
    for (k, v) in got {
        if !want.contains_key(k) {
            out.push(format!("{k:?}: lab none, agent {v:?}"));
        }
    }
    out
}

/// Wait until the tracer has seen as many transfers and calls from `pids` as the lab
/// made (the ring buffer is drained asynchronously), or a few seconds passed.
async fn settle(tracer: &NixlTracer, pids: &[u32], truth: &Truth) -> NixlReport {
    let want_transfers = truth.transfers.len() as u64;
    let want_calls = truth.handshakes.len() as u64;
    let mut report = tracer.report();
    for _ in 0..100 {
        let got_transfers: u64 = report
            .transfers
            .iter()
            .filter(|t| pids.contains(&t.pid))
            .map(|t| t.transfers)
            .sum();
        let got_calls: u64 = traced_handshakes(&report, pids).values().sum();
        if got_transfers >= want_transfers && got_calls >= want_calls {
            // One more beat for stragglers of other kinds (notifications, releases).
            tokio::time::sleep(Duration::from_millis(200)).await;
            return tracer.report();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        report = tracer.report();
    }
    report
}

fn truth_pids(truth: &Truth) -> Vec<u32> {
    let mut pids: Vec<u32> = truth.agents.iter().map(|a| a.pid).collect();
    pids.push(truth.run_pid);
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Everything the agent measured about the processes of `truth` equals the truth.
fn assert_exact(report: &NixlReport, truth: &Truth, with_bytes: bool) {
    assert_exact_on(report, truth, Reads::all_or_none(with_bytes))
}

fn assert_exact_on(report: &NixlReport, truth: &Truth, reads: Reads) {
    let with_bytes = reads.counts;
    let pids = truth_pids(truth);
    assert_eq!(report.events_lost, 0, "no probe record lost");
    assert_eq!(report.events_malformed, 0, "every probe record attributed");

    let d = diff(
        &expected_transfers(truth, reads),
        &traced_transfers(report, &pids, with_bytes),
    );
    assert!(
        d.is_empty(),
        "transfers differ from the lab's truth:\n{}",
        d.join("\n")
    );
    // Every posted transfer whose bytes were not read is counted as such.
    let posted = truth
        .transfers
        .iter()
        .filter(|x| x.outcome != TransferOutcome::FailedAtCreate)
        .count() as u64;
    let unknown: u64 = report
        .transfers
        .iter()
        .filter(|x| pids.contains(&x.pid))
        .map(|x| x.bytes_unknown)
        .sum();
    assert_eq!(
        unknown,
        if with_bytes { 0 } else { posted },
        "transfers whose bytes are unknown"
    );
    if reads.handshakes {
        let d = diff(
            &expected_handshakes(truth),
            &traced_handshakes(report, &pids),
        );
        assert!(
            d.is_empty(),
            "handshakes differ from the lab's truth:\n{}",
            d.join("\n")
        );

        // fetchRemoteMD completes on NIXL's listener thread: one nixlAgentData::loadRemoteMD
        // per metadata blob that arrived.
        let arrived = truth
            .handshakes
            .iter()
            .filter(|h| h.async_load.as_ref().is_some_and(|a| a.arrived))
            .count() as u64;
        assert_eq!(
            traced_calls(report, &pids, "loadRemoteMD_async"),
            arrived,
            "background metadata loads"
        );
    }
    // getXferTelemetry's refusals (the lab asks after each done transfer, as vLLM
    // does), per agent and peer: seen at the path the agent derives.
    let mut refused: BTreeMap<(u32, String, String), u64> = BTreeMap::new();
    for x in truth
        .transfers
        .iter()
        .filter(|x| x.telemetry_refused == Some(true))
    {
        let remote = if reads.requests {
            x.remote.clone()
        } else {
            String::new()
        };
        *refused.entry((x.pid, x.local.clone(), remote)).or_default() += 1;
    }
    let mut traced_refused: BTreeMap<(u32, String, String), u64> = BTreeMap::new();
    for c in report
        .calls
        .iter()
        .filter(|c| pids.contains(&c.pid) && c.call == "getXferTelemetry")
    {
        assert_eq!(c.status, "ERR_NO_TELEMETRY", "{c:?}");
        *traced_refused
            .entry((c.pid, c.local_agent.clone(), c.remote_agent.clone()))
            .or_default() += c.calls;
    }
    let d = diff(&refused, &traced_refused);
    assert!(
        d.is_empty(),
        "getXferTelemetry refusals differ from the lab's truth:\n{}",
        d.join("\n")
    );
    let calls = &truth.summary.nixl_calls;
    for method in ["genNotif", "getNotifs", "registerMem", "deregisterMem"] {
        assert_eq!(
            traced_calls(report, &pids, method),
            calls.get(method).copied().unwrap_or(0),
            "{method} calls"
        );
    }
    if reads.requests {
        let registered: u64 = report
            .calls
            .iter()
            .filter(|c| pids.contains(&c.pid) && c.call == "registerMem")
            .map(|c| c.bytes)
            .sum();
        assert_eq!(
            registered, truth.summary.registered_bytes,
            "registered bytes"
        );
    }
}

/// Latencies exist, and the probes' post → done never exceeds the lab's own clock of
/// the same phase (the probes fire inside it), pair by pair and op by op.
fn assert_latencies_within_the_lab_clock(report: &NixlReport, truth: &Truth) {
    let pids = truth_pids(truth);
    let mut lab = LabClock::new();
    for x in truth
        .transfers
        .iter()
        .filter(|x| x.outcome == TransferOutcome::Done)
    {
        let ns = x
            .post_to_done_ns
            .expect("the lab timed every done transfer");
        let op = serde_json::to_value(x.op)
            .unwrap()
            .as_str()
            .unwrap()
            .to_string();
        let e = lab
            .entry((x.pid, x.local.clone(), x.remote.clone(), op))
            .or_default();
        e.0 += 1;
        e.1 += ns;
        e.2 = e.2.max(ns);
    }
    assert!(!lab.is_empty(), "the lab completed transfers");
    for ((pid, local, remote, op), (n, sum, max)) in &lab {
        let t = report
            .transfers
            .iter()
            .find(|t| {
                pids.contains(&t.pid)
                    && t.pid == *pid
                    && &t.local_agent == local
                    && &t.remote_agent == remote
                    && &t.op == op
                    && t.stage == XferStage::Complete
                    && t.status == "SUCCESS"
            })
            .unwrap_or_else(|| panic!("no traced transfers {local} → {remote} {op}"));
        assert_eq!(
            t.latency.count, *n,
            "{local} → {remote} {op}: one latency per transfer"
        );
        assert!(
            t.latency.max_ns > 0 && t.latency.p50_ns > 0,
            "{local} → {remote}: measured"
        );
        assert!(
            t.latency.sum_ns <= *sum && t.latency.max_ns <= *max,
            "{local} → {remote} {op}: probes' post → done (Σ {} ns, max {}) above the lab's \
             clock (Σ {sum} ns, max {max})",
            t.latency.sum_ns,
            t.latency.max_ns
        );
    }
    // Handshakes: each call's probe latency within the lab's wall-clock of that call.
    let mut lab_calls: BTreeMap<(u32, String, String), u64> = BTreeMap::new();
    for h in &truth.handshakes {
        *lab_calls
            .entry((h.pid, h.call.method().to_string(), h.local.clone()))
            .or_default() += h.wall_ns;
    }
    for ((pid, call, local), wall) in &lab_calls {
        let traced: u64 = report
            .calls
            .iter()
            .filter(|c| c.pid == *pid && &c.call == call && &c.local_agent == local)
            .map(|c| c.latency.sum_ns)
            .sum();
        assert!(traced > 0, "{local} {call}: latency measured");
        assert!(
            traced <= *wall,
            "{local} {call}: probes Σ {traced} ns above the lab's Σ {wall} ns"
        );
    }
}

/// A NIXL lab run in progress (its truth is read when it ends).
struct LabRun {
    /// The lab, in its own process group with the processes it starts: stopped if the
    /// test fails before [`LabRun::finish`].
    proc: kvscope_lab::process::StopOnDrop,
    truth_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl LabRun {
    fn spawn(args: &[&str]) -> Self {
        Self::spawn_with_env(args, &[])
    }

    /// With these variables set for the lab and its NIXL agents.
    fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let truth_path = dir.path().join("truth.json");
        let mut cmd = std::process::Command::new(kvscope_nixl_lab::lab_binary());
        cmd.arg("run")
            .args(args)
            .arg("--truth-out")
            .arg(&truth_path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .envs(env.iter().copied());
        let lab = kvscope_lab::process::ManagedProcess::spawn_with_stdio("nixl-lab", cmd)
            .expect("the NIXL lab starts");
        Self {
            proc: kvscope_lab::process::StopOnDrop(vec![lab]),
            truth_path,
            _dir: dir,
        }
    }

    /// The lab keeps its pid when it re-executes itself with the libraries' environment.
    fn pid(&self) -> u32 {
        self.proc[0].pid()
    }

    fn finish(self) -> Truth {
        self.try_finish().unwrap_or_else(|e| panic!("{e}"))
    }

    /// The truth, or why the lab failed (its last error line first).
    fn try_finish(mut self) -> Result<Truth, String> {
        // Out of the guard: reaped here, so its group is never signalled afterwards.
        let lab = self.proc.pop().expect("spawned with one process");
        let out = lab.child.wait_with_output().expect("the NIXL lab runs");
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            // The error's first cause (anyhow's report), else its first line.
            let cause = stderr
                .lines()
                .map(str::trim)
                .skip_while(|l| *l != "Caused by:")
                .nth(1)
                .or_else(|| stderr.lines().find(|l| l.starts_with("Error:")))
                .unwrap_or("")
                .trim_start_matches("0: ")
                .to_string();
            return Err(format!(
                "the NIXL lab failed ({}): {cause}\n{stderr}",
                out.status
            ));
        }
        Ok(
            serde_json::from_slice(&std::fs::read(&self.truth_path).unwrap())
                .expect("the lab's truth JSON"),
        )
    }
}

fn run_lab(args: &[&str]) -> Truth {
    LabRun::spawn(args).finish()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traced_counts_equal_the_lab_truth_in_one_process_and_across_processes() {
    let libs = support::nixl_libs();
    let tracer = start_tracer(&tracer_config(vec![libs.libnixl.clone()], false, None)).await;
    let st = &tracer.report().libraries[0];
    assert!(
        st.offsets_known && st.completion_sites && st.degraded.is_none(),
        "the wheel's build is fully traced, its transfers' ends at its completion \
         sites: {st:?}"
    );
    lab_truth_is_traced_exactly(
        &tracer,
        &[
            &["--scenario", "mixed"][..],
            &["--scenario", "mixed", "--processes"][..],
        ],
    )
    .await;
}

/// The status-call probes (what a build without completion sites gets, or an operator
/// asking for them) give the same exact figures on the same build; here with every
/// transfer's record sent (the other tests send one in 16).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_call_probes_give_the_same_figures() {
    let libs = support::nixl_libs();
    let mut cfg = tracer_config(vec![libs.libnixl.clone()], false, None);
    cfg.completion_sites = false;
    cfg.sample_every = 1;
    let tracer = start_tracer(&cfg).await;
    let st = &tracer.report().libraries[0];
    assert!(
        st.offsets_known && !st.completion_sites && st.degraded.is_none(),
        "{st:?}"
    );
    lab_truth_is_traced_exactly(&tracer, &[&["--scenario", "mixed", "--processes"][..]]).await;
}

/// A kernel table of one series: the first series the lab makes is counted in the
/// kernel, every other from its records (sent untallied), one in 16 sampled: exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn series_past_the_kernel_table_are_counted_from_their_records() {
    let libs = support::nixl_libs();
    let mut cfg = tracer_config(vec![libs.libnixl.clone()], false, None);
    cfg.tally_series = 1;
    let tracer = start_tracer(&cfg).await;
    lab_truth_is_traced_exactly(&tracer, &[&["--scenario", "mixed"][..]]).await;
}

async fn lab_truth_is_traced_exactly(tracer: &NixlTracer, runs: &[&[&str]]) {
    for args in runs {
        let truth = run_lab(args);
        let pids = truth_pids(&truth);
        let report = settle(tracer, &pids, &truth).await;
        eprintln!(
            "lab {args:?}: {} transfers, {} handshakes, pids {pids:?}",
            truth.transfers.len(),
            truth.handshakes.len()
        );
        assert!(
            truth.summary.injections.values().sum::<u64>() > 0,
            "failures were injected"
        );
        assert_exact(&report, &truth, true);
        assert_latencies_within_the_lab_clock(&report, &truth);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_started_later_is_found_and_traced_again_after_a_restart() {
    // No library configured: the tracer finds the lab's libnixl.so in /proc/*/maps. The
    // lab maps the library, then waits before its first NIXL call so the scan can see
    // it; the second run is a new process from the same file (a restart).
    let tracer = start_tracer(&tracer_config(Vec::new(), true, None)).await;
    let mut seen_pids = Vec::new();
    for _ in 0..2 {
        let truth = run_lab(&["--scenario", "mixed", "--start-delay-ms", "1500"]);
        let pids = truth_pids(&truth);
        let report = settle(&tracer, &pids, &truth).await;
        assert!(
            tracer.attached_libraries() >= 1,
            "the running lab's libnixl.so was discovered"
        );
        assert_exact(&report, &truth, true);
        seen_pids.extend(pids);
    }
    seen_pids.sort_unstable();
    seen_pids.dedup();
    assert!(
        seen_pids.len() >= 2,
        "two distinct processes were traced: {seen_pids:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_process_asked_for_is_traced() {
    // Two labs on the same library at once; the tracer follows one pid.
    let traced = LabRun::spawn(&["--scenario", "mixed", "--start-delay-ms", "3000"]);
    let other = LabRun::spawn(&["--scenario", "clean", "--start-delay-ms", "3000"]);
    let tracer = start_tracer(&tracer_config(Vec::new(), true, Some(traced.pid()))).await;
    let (traced, other) = (traced.finish(), other.finish());
    let report = settle(&tracer, &truth_pids(&traced), &traced).await;
    assert_exact(&report, &traced, true);
    let strays: Vec<u32> = report
        .transfers
        .iter()
        .map(|t| t.pid)
        .chain(report.calls.iter().map(|c| c.pid))
        .filter(|p| *p != traced.run_pid)
        .collect();
    assert!(
        strays.is_empty() && other.run_pid != traced.run_pid,
        "only pid {} is traced, not {}: saw {strays:?}",
        traced.run_pid,
        other.run_pid
    );
}

/// Where the kernel counts transfers, a transfer that is not kept sends no record: the
/// lab's WRITE loop without notifications (long enough to run while the tracer follows
/// its pid) is counted in full from the kernel's tallies while the records read stay near
/// one or two (post, end) per sixteen transfers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unkept_transfers_send_no_record() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(kvscope_nixl_lab::lab_binary());
    cmd.args([
        "bench",
        "--size",
        "4096",
        "--iters",
        "1000000",
        "--pace-ms",
        "1",
    ])
    .args(["--max-secs", "60", "--agent-prefix", "sampled-"])
    .arg("--out")
    .arg(dir.path().join("bench.json"))
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null());
    let bench = kvscope_lab::process::ManagedProcess::spawn_with_stdio("nixl-bench", cmd)
        .expect("the NIXL bench loop starts");
    let pid = bench.pid();
    let _bench = kvscope_lab::process::StopOnDrop(vec![bench]);
    let cfg = tracer_config(Vec::new(), true, Some(pid));
    assert_eq!(cfg.sample_every, 16, "the default");
    let tracer = start_tracer(&cfg).await;
    let counted = |r: &NixlReport| -> u64 {
        r.transfers
            .iter()
            .filter(|t| t.pid == pid && t.stage == XferStage::Complete)
            .map(|t| t.transfers)
            .sum()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let report = loop {
        let r = tracer.report();
        if counted(&r) >= 20_000 {
            break r;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} transfers counted in 60 s",
            counted(&r)
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    };
    let transfers = counted(&report);
    let failed: u64 = report
        .transfers
        .iter()
        .filter(|t| t.status != "SUCCESS")
        .map(|t| t.transfers)
        .sum();
    eprintln!(
        "{transfers} transfers counted, {failed} failed, {} probe records read",
        report.events_read
    );
    assert_eq!(failed, 0);
    // Two records per kept transfer, one in 16 kept, a few calls and agents besides;
    // every record sent would be two per transfer.
    assert!(
        report.events_read * 4 < transfers,
        "{} records for {transfers} transfers",
        report.events_read
    );
    assert!(report.events_read > 0, "the kept ones' records");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_in_no_table_is_traced_bytes_included() {
    // The same library with another build-id, as a NIXL built from source has: the
    // offsets and every completion site (getXferStatus', releaseXferReq's,
    // postXferReq's, and createXferReq's and makeXferReq's failures) are derived from
    // its instructions, so every figure is exact, bytes included, at the sites.
    let libs = support::nixl_libs();
    let dir = tempfile::tempdir().unwrap();
    let copy = support::copy_libs_with_new_build_id(&libs.lib_dir, dir.path());
    let lib = copy.join("libnixl.so");
    let inspected = kvscope_agent::nixl::library::NixlLibrary::inspect(&lib, true).unwrap();
    assert!(inspected.sites && inspected.post_at_site && inspected.creations_at_sites);
    let tracer = start_tracer(&tracer_config(vec![lib.clone()], false, None)).await;
    let st = tracer.report().libraries[0].clone();
    assert!(
        st.offsets_known && st.completion_sites && st.post_site && st.creation_sites,
        "{st:?}"
    );
    assert_eq!(st.degraded, None);

    let truth = run_lab(&["--scenario", "mixed", "--lib-dir", copy.to_str().unwrap()]);
    assert_eq!(
        truth.nixl.libnixl,
        lib.display().to_string(),
        "the lab ran on the copy"
    );
    let pids = truth_pids(&truth);
    let report = settle(&tracer, &pids, &truth).await;
    assert_exact(&report, &truth, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_whose_offsets_cannot_be_derived_is_counted_without_bytes_and_says_why() {
    // Another build-id, and no instruction left that names a descriptor's length.
    let libs = support::nixl_libs();
    let dir = tempfile::tempdir().unwrap();
    let copy = support::copy_libs_patched(&libs.lib_dir, dir.path(), &[support::DESCRIPTOR_SUM]);
    let lib = copy.join("libnixl.so");
    let tracer = start_tracer(&tracer_config(vec![lib.clone()], false, None)).await;
    let st = tracer.report().libraries[0].clone();
    assert!(!st.offsets_known && !st.completion_sites, "{st:?}");
    let why = st
        .degraded
        .clone()
        .expect("the agent says what it cannot measure");
    assert!(
        why.contains("registerMem") && why.contains("bytes") && why.contains("nixl-inspect"),
        "{why}"
    );

    let truth = run_lab(&["--scenario", "mixed", "--lib-dir", copy.to_str().unwrap()]);
    assert_eq!(
        truth.nixl.libnixl,
        lib.display().to_string(),
        "the lab ran on the copy"
    );
    let pids = truth_pids(&truth);
    let report = settle(&tracer, &pids, &truth).await;
    // Calls, statuses and peers stay exact: the agents' names come from their
    // constructor's argument and the remote agents' from the calls' own arguments,
    // which do not depend on the build. Only bytes and descriptor counts are unknown,
    // and the remote agent of a transfer made by makeXferReq (which names none).
    assert_exact(&report, &truth, false);
    let bytes: u64 = report
        .transfers
        .iter()
        .filter(|t| pids.contains(&t.pid))
        .map(|t| t.bytes)
        .sum();
    assert_eq!(bytes, 0, "no bytes without offsets");
}

/// The NIXL versions whose wheels' libraries the matrix traces: `KVSCOPE_NIXL_MATRIX`
/// (`scripts/nixl-matrix` sets every published one), else the ones `scripts/setup`
/// fetches — the oldest, one in the middle, 1.4.1 — with the lab's own 1.5.1 wheel
/// traced by every other test here.
fn matrix_versions() -> Vec<String> {
    std::env::var("KVSCOPE_NIXL_MATRIX")
        .unwrap_or_else(|_| "1.0.1 1.3.2 1.4.1".into())
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn older_builds_are_traced_exactly_on_their_derived_offsets() {
    // Each wheel's library, in no table, traced while the NIXL lab runs on it with the
    // agents' telemetry on (as vLLM runs it) and off, every figure against its truth.
    // Builds from 1.4 fill their requests' byte counts always; older ones only when
    // the agent's telemetry is on (the flag is read at each post), else each transfer's
    // bytes are counted as unknown. Before 1.5, makeXferReq takes its op by reference
    // (its std::vector overload, probed there). Handshakes are not compared: the lab
    // (nixl-sys 1.5.1) cannot name some statuses older C APIs return, and
    // nixlAgentData::loadRemoteMD is not exported before 1.5. One row per run; every row
    // is printed (the docs' table), then any failure fails the test.
    use kvscope_agent::nixl::offsets::Counts;
    let mut rows = vec![
        "| NIXL | build-id | byte counts | completion sites | telemetry | transfers | bytes traced of moved | refusals seen | every figure |".to_string(),
        "|---|---|---|---|---|---|---|---|---|".to_string(),
    ];
    let mut failed = Vec::new();
    for version in matrix_versions() {
        for telemetry in [true, false] {
            let dir = support::older_nixl_lib_dir(&version);
            let lib = dir.join("libnixl.so");
            let tracer = start_tracer(&tracer_config(vec![lib.clone()], false, None)).await;
            let st = tracer.report().libraries[0].clone();
            let inspected = kvscope_agent::nixl::library::NixlLibrary::inspect(&lib, true)
                .expect("the wheel's library is read");
            let counts = inspected.offsets.map(|o| o.counts);
            let counts_text = match counts {
                Some(Counts::Always) => "always".to_string(),
                Some(Counts::WithTelemetry { data_flag }) => {
                    format!("with telemetry (data+{data_flag:#x})")
                }
                Some(Counts::Never) => "never".into(),
                None => "offsets unknown".into(),
            };
            let env: &[(&str, &str)] = if telemetry {
                &[("NIXL_TELEMETRY_ENABLE", "y")]
            } else {
                &[]
            };
            let truth = match LabRun::spawn_with_env(
                &["--scenario", "mixed", "--lib-dir", dir.to_str().unwrap()],
                env,
            )
            .try_finish()
            {
                Ok(truth) => truth,
                Err(e) => {
                    // Counted as a failure: a build the lab cannot drive is not checked.
                    let why = e.lines().next().unwrap_or_default().to_string();
                    eprintln!("{version}: {e}");
                    rows.push(format!(
                        "| {version} | {}… | {counts_text} | | {} | | | | not driven: {why} |",
                        &inspected.build_id[..inspected.build_id.len().min(8)],
                        if telemetry { "on" } else { "off" },
                    ));
                    failed.push(format!("{version} (telemetry {telemetry}): not driven"));
                    continue;
                }
            };
            let pids = truth_pids(&truth);
            let report = settle(&tracer, &pids, &truth).await;
            drop(tracer);
            let with_bytes = match counts {
                Some(Counts::Always) => true,
                Some(Counts::WithTelemetry { .. }) => telemetry,
                _ => false,
            };
            let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // Transfers end at sites wherever getXferStatus' were derived (1.4 on);
                // posts return and creations fail at theirs in every build.
                assert!(
                    st.offsets_known
                        && st.completion_sites == inspected.derivation.end_sites.is_ok()
                        && st.post_site
                        && st.creation_sites,
                    "{version}: {st:?}"
                );
                let minor: Vec<u32> = version
                    .split('.')
                    .take(2)
                    .map(|p| p.parse().unwrap_or(0))
                    .collect();
                if minor >= vec![1, 4] {
                    assert!(st.completion_sites, "{version}: {st:?}");
                }
                assert_eq!(truth.nixl.libnixl, lib.display().to_string(), "{version}");
                // The lab asks each done transfer's telemetry: refused exactly where it
                // is off (the comparison checks the probes saw each refusal).
                let done: Vec<_> = truth
                    .transfers
                    .iter()
                    .filter(|x| x.outcome == TransferOutcome::Done)
                    .collect();
                assert!(!done.is_empty(), "{version}");
                assert!(
                    done.iter().all(|x| x.telemetry_refused == Some(!telemetry)),
                    "{version}: telemetry {telemetry}"
                );
                assert_exact_on(
                    &report,
                    &truth,
                    Reads {
                        counts: with_bytes,
                        requests: true,
                        handshakes: false,
                    },
                );
            }));
            let moved: u64 = truth
                .transfers
                .iter()
                .filter(|x| x.outcome == TransferOutcome::Done)
                .map(|x| x.bytes)
                .sum();
            let traced: u64 = report
                .transfers
                .iter()
                .filter(|x| {
                    pids.contains(&x.pid) && x.stage == XferStage::Complete && x.status == "SUCCESS"
                })
                .map(|x| x.bytes)
                .sum();
            let refused: u64 = report
                .calls
                .iter()
                .filter(|c| pids.contains(&c.pid) && c.call == "getXferTelemetry")
                .map(|c| c.calls)
                .sum();
            rows.push(format!(
                "| {version} | {}… | {} | {} | {} | {} | {traced} of {moved} | {refused} | {} |",
                &inspected.build_id[..inspected.build_id.len().min(8)],
                counts_text,
                match (st.completion_sites, st.post_site, st.creation_sites) {
                    (true, true, true) => "ends, posts, creations",
                    (false, true, true) => "posts, creations; ends: status-call probes",
                    _ => "DIFFERS: not every site derived",
                },
                if telemetry { "on" } else { "off" },
                truth.transfers.len(),
                if checked.is_ok() { "exact" } else { "DIFFERS" },
            ));
            if checked.is_err() {
                failed.push(format!("{version} (telemetry {telemetry})"));
            }
        }
    }
    eprintln!("{}", rows.join("\n"));
    assert!(failed.is_empty(), "not exact: {failed:?}");
}
