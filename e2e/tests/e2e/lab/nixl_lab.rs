//! Runs the real NIXL 1.5.1 wheel: the `mixed` scenario in-process and as processes,
//! the bench loop, and the error a missing wheel gives. Needs `kvscope-nixl-lab setup`
//! (the tests fail, with that advice, when the wheel is not unpacked).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kvscope_nixl_lab::libs::KNOWN_LIBNIXL_BUILD_ID;
use kvscope_nixl_lab::status::{native, Injection};
use kvscope_nixl_lab::truth::{HandshakeCall, Op, TransferOutcome, WorkerMode};
use kvscope_nixl_lab::{NixlLibs, Truth};

fn lab_dir() -> PathBuf {
    kvscope_lab::paths::default_lab_dir()
}

/// The wheel's libraries, or a failure that says how to get them.
fn libs() -> NixlLibs {
    match NixlLibs::locate(&lab_dir()) {
        Ok(libs) => libs,
        Err(e) => panic!("{e}"),
    }
}

fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("kvscope-nixl-lab-test-{name}-"))
        .tempdir()
        .unwrap()
}

fn run(args: &[&str]) -> (Output, u32, Duration) {
    let t0 = Instant::now();
    let child = Command::new(kvscope_nixl_lab::lab_binary())
        .args(args)
        .env("KVSCOPE_LAB_DIR", lab_dir())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn kvscope-nixl-lab");
    let pid = child.id();
    let out = child.wait_with_output().expect("wait for kvscope-nixl-lab");
    (out, pid, t0.elapsed())
}

fn run_mixed(extra: &[&str], name: &str) -> (Truth, u32, Duration) {
    libs();
    let dir = scratch(name);
    let truth_path = dir.path().join("truth.json");
    let mut args = vec![
        "run",
        "--scenario",
        "mixed",
        "--truth-out",
        truth_path.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (out, pid, took) = run(&args);
    assert!(
        out.status.success(),
        "kvscope-nixl-lab run failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let truth: Truth =
        serde_json::from_slice(&std::fs::read(&truth_path).unwrap()).expect("truth parses");
    (truth, pid, took)
}

/// What the mixed scenario asks for, checked against any run of it.
fn check_mixed(t: &Truth) {
    let problems = t.check();
    assert!(problems.is_empty(), "truth inconsistent: {problems:#?}");
    let c = &t.config;
    assert_eq!(t.scenario, "mixed");
    assert_eq!(t.nixl.version, "1.5.1");
    assert_eq!(t.nixl.build_id.as_deref(), Some(KNOWN_LIBNIXL_BUILD_ID));
    assert_eq!(
        t.agents.len() as u32,
        c.workers + 1,
        "ring workers + decode-doomed"
    );

    // migrations: every planned one done; the in-flight injection may add done READs
    // (posts that completed inline before one returned IN_PROG)
    assert!(t.transfers_with(Op::Read, TransferOutcome::Done) >= u64::from(c.reads));
    assert_eq!(
        t.transfers_with(Op::Write, TransferOutcome::Done),
        u64::from(c.writes)
    );
    assert_eq!(t.summary.data_verified.error, 0);
    assert_eq!(
        t.summary.data_verified.ok,
        t.transfers_with(Op::Read, TransferOutcome::Done)
            + t.transfers_with(Op::Write, TransferOutcome::Done)
    );
    for x in &t.transfers {
        assert!((c.min_blocks..=c.max_blocks).contains(&x.descriptors));
        assert_eq!(x.bytes, u64::from(x.descriptors) * u64::from(c.block_size));
    }
    let done_bytes: u64 = t
        .transfers
        .iter()
        .filter(|x| x.outcome == TransferOutcome::Done)
        .map(|x| x.bytes)
        .sum();
    assert_eq!(done_bytes, t.summary.bytes_done.values().sum::<u64>());

    // injected failures, each with the native status a uretprobe will read
    let failed = |inj: Injection| -> Vec<(TransferOutcome, Option<i32>)> {
        t.transfers
            .iter()
            .filter(|x| x.injected == Some(inj) && x.outcome != TransferOutcome::Done)
            .map(|x| (x.outcome, x.status.nixl))
            .collect()
    };
    let n = |k: u32, v: (TransferOutcome, Option<i32>)| vec![v; k as usize];
    let not_found = Some(native::ERR_NOT_FOUND);
    assert_eq!(
        failed(Injection::UnknownRemote),
        n(
            c.unknown_remote,
            (TransferOutcome::FailedAtCreate, not_found)
        )
    );
    assert_eq!(
        failed(Injection::InvalidatedRemote),
        n(
            c.invalidated_remote,
            (TransferOutcome::FailedAtCreate, not_found)
        )
    );
    assert_eq!(
        failed(Injection::InvalidatedBeforePost),
        n(
            c.invalidated_before_post,
            (TransferOutcome::FailedAtPost, not_found)
        )
    );
    assert_eq!(
        failed(Injection::InvalidatedInFlight),
        n(
            c.invalidated_in_flight,
            (TransferOutcome::FailedAtCompletion, not_found)
        )
    );
    assert_eq!(
        failed(Injection::RemoteGone),
        n(
            c.remote_gone,
            (
                TransferOutcome::FailedAtPost,
                Some(native::ERR_REMOTE_DISCONNECT)
            )
        )
    );
    assert_eq!(
        t.transfers
            .iter()
            .filter(|x| x.outcome == TransferOutcome::TimedOut)
            .count(),
        0
    );
    for (inj, asked) in [
        (Injection::CorruptMetadata, c.corrupt_metadata),
        (Injection::DeadListener, c.dead_listener),
        (Injection::UnknownConnect, c.unknown_connect),
        (Injection::UnknownRemote, c.unknown_remote),
        (Injection::InvalidatedRemote, c.invalidated_remote),
        (Injection::InvalidatedBeforePost, c.invalidated_before_post),
        (Injection::InvalidatedInFlight, c.invalidated_in_flight),
        (Injection::RemoteGone, c.remote_gone),
    ] {
        assert_eq!(t.injected(inj), u64::from(asked), "{inj:?}");
    }

    let corrupt: Vec<Option<i32>> = t
        .handshakes
        .iter()
        .filter(|h| h.injected == Some(Injection::CorruptMetadata))
        .map(|h| h.status.nixl)
        .collect();
    assert_eq!(
        corrupt,
        vec![Some(native::ERR_MISMATCH); c.corrupt_metadata as usize]
    );
    assert_eq!(
        t.handshake_errors(HandshakeCall::LoadRemoteMd),
        u64::from(c.corrupt_metadata)
    );
    assert_eq!(
        t.handshake_errors(HandshakeCall::MakeConnection),
        u64::from(c.unknown_connect)
    );
    assert_eq!(
        t.summary.async_loads.error,
        u64::from(c.dead_listener),
        "dead listeners never deliver"
    );
    for h in t
        .handshakes
        .iter()
        .filter(|h| h.call != HandshakeCall::CheckRemoteMd && h.injected.is_none())
    {
        // the one expected error outside injections: tearing down the dead listener's name
        let dead_teardown = h.call == HandshakeCall::InvalidateRemoteMd
            && h.remote
                .as_deref()
                .is_some_and(|r| r.starts_with("ghost-listener"));
        assert!(
            h.status.is_ok() || dead_teardown,
            "unexpected failure: {h:?}"
        );
    }
    for call in [HandshakeCall::FetchRemoteMd, HandshakeCall::SendLocalMd] {
        let good = t
            .handshakes
            .iter()
            .filter(|h| h.call == call && h.injected.is_none());
        assert!(good.clone().count() > 0, "{call:?} used");
        assert!(
            good.into_iter()
                .all(|h| h.async_load.as_ref().is_some_and(|a| a.arrived)),
            "{call:?} delivered"
        );
    }

    // notifications: every certain one arrives, nothing from nowhere
    let s = &t.summary;
    assert!(s.notifications_sent >= u64::from(c.reads + c.gen_notifs));
    assert!(s.notifications_received >= s.notifications_sent);
    assert!(s.notifications_received <= s.notifications_sent + s.notifications_sent_uncertain);
    assert_eq!(
        s.registered_bytes,
        u64::from(c.workers + 1) * u64::from(c.blocks) * u64::from(c.block_size)
    );
    assert_eq!(
        s.internal_calls["nixlAgentData::loadRemoteMD"],
        s.nixl_calls["loadRemoteMD"] + s.async_loads.ok
    );
}

#[test]
fn wheel_is_set_up_with_the_known_build() {
    let libs = libs();
    assert!(libs.libnixl.is_file() && libs.libnixl_capi.is_file() && libs.ucx_plugin.is_file());
    assert_eq!(libs.build_id.as_deref(), Some(KNOWN_LIBNIXL_BUILD_ID));
    let env = libs.child_env();
    assert!(env
        .iter()
        .any(|(k, v)| k == "NIXL_PLUGIN_DIR" && *v == libs.plugin_dir));
}

#[test]
fn mixed_scenario_in_process() {
    let (t, pid, took) = run_mixed(&[], "inproc");
    check_mixed(&t);
    assert_eq!(t.mode, WorkerMode::InProcess);
    assert_eq!(
        t.run_pid, pid,
        "the run keeps its pid when it re-executes itself"
    );
    assert!(t.agents.iter().all(|a| a.pid == pid));
    assert!(t.transfers.iter().all(|x| x.pid == pid));
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

#[test]
fn mixed_scenario_as_processes() {
    let (t, pid, took) = run_mixed(&["--processes"], "procs");
    check_mixed(&t);
    assert_eq!(t.mode, WorkerMode::Processes);
    assert_eq!(t.run_pid, pid);
    let pids: BTreeSet<u32> = t.agents.iter().map(|a| a.pid).collect();
    assert_eq!(pids.len(), t.agents.len(), "one process per agent");
    assert!(!pids.contains(&pid));
    let by_pid: BTreeSet<u32> = t.summary.nixl_calls_by_pid.keys().copied().collect();
    assert_eq!(by_pid, pids);
    for x in &t.transfers {
        let owner = t.agents.iter().find(|a| a.name == x.local).unwrap();
        assert_eq!(
            x.pid, owner.pid,
            "transfer {} attributed to its initiator's process",
            x.seq
        );
    }
    // every worker process is gone
    for p in pids {
        assert!(
            !PathBuf::from(format!("/proc/{p}")).exists() || is_zombie(p),
            "worker {p} still running"
        );
    }
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

#[test]
fn bench_runs_a_write_loop() {
    libs();
    let (out, pid, _) = run(&[
        "bench", "--size", "4096", "--iters", "2000", "--warmup", "50",
    ]);
    assert!(
        out.status.success(),
        "bench failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench prints JSON");
    assert_eq!(report["pid"], pid);
    assert_eq!(report["transfers"], 2000);
    assert_eq!(report["failures"], 0);
    assert_eq!(report["config"]["op"], "WRITE");
    assert_eq!(report["nixl_calls"]["createXferReq"], 2000);
    assert_eq!(report["nixl_calls"]["postXferReq"], 2000);
    assert!(report["transfers_per_sec"].as_f64().unwrap() > 0.0);
    let bps = report["bytes_per_sec"].as_f64().unwrap();
    let tps = report["transfers_per_sec"].as_f64().unwrap();
    assert!((bps / tps - 4096.0).abs() < 1.0);
    assert!(report["ns_per_transfer"].as_f64().unwrap() > 0.0);
}

#[test]
fn missing_wheel_says_to_run_setup() {
    let empty = scratch("empty-lab");
    let empty = empty.path();
    let out = Command::new(kvscope_nixl_lab::lab_binary())
        .args(["run", "--scenario", "mixed"])
        .env("KVSCOPE_LAB_DIR", empty)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("kvscope-nixl-lab setup"), "{stderr}");
}

#[test]
fn lab_binary_finds_this_build() {
    assert_eq!(
        kvscope_nixl_lab::lab_binary().canonicalize().unwrap(),
        kvscope_nixl_lab::lab_binary().canonicalize().unwrap()
    );
}

#[test]
fn help_explains_the_commands() {
    let out = Command::new(kvscope_nixl_lab::lab_binary())
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for word in [
        "setup",
        "run",
        "bench",
        "libs",
        "env",
        "NIXL_PLUGIN_DIR",
        "LD_LIBRARY_PATH",
    ] {
        assert!(help.contains(word), "--help lacks {word}:\n{help}");
    }
    let out = Command::new(kvscope_nixl_lab::lab_binary())
        .args(["run", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for word in [
        "--processes",
        "--truth-out",
        "--corrupt-metadata",
        "--remote-gone",
        "--set",
    ] {
        assert!(help.contains(word), "run --help lacks {word}");
    }
}

#[test]
fn lib_dir_and_start_delay_are_honoured() {
    let libs = libs();
    let dir = scratch("libdir");
    let truth_path = dir.path().join("truth.json");
    let (out, pid, took) = run(&[
        "run",
        "--scenario",
        "clean",
        "--reads",
        "2",
        "--writes",
        "1",
        "--lib-dir",
        libs.lib_dir.to_str().unwrap(),
        "--start-delay-ms",
        "300",
        "--truth-out",
        truth_path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let t: Truth = serde_json::from_slice(&std::fs::read(&truth_path).unwrap()).unwrap();
    assert!(t.check().is_empty(), "{:?}", t.check());
    assert_eq!(t.run_pid, pid);
    assert_eq!(t.nixl.libnixl, libs.libnixl.display().to_string());
    assert_eq!(t.scenario, "clean+overrides");
    assert_eq!(t.transfers_with(Op::Read, TransferOutcome::Done), 2);
    assert!(t.wall_ns >= 300_000_000 && took >= Duration::from_millis(300));
}
