//! Each NIXL wheel driven through its own Python API (`nixl_cu12._api`, as vLLM drives
//! it), not the project's lab: the agent, attached to that wheel's `libnixl.so` with
//! offsets derived from it, counts every transfer (op, peer, bytes), the creation toward
//! an agent never loaded, every metadata load and its failure, the genNotif, the bytes
//! registered (one registration of 300 descriptors among them), each
//! transfer's notification as a request, and getXferTelemetry's refusals, all equal to
//! what the driver (`lab/nixl/py/wheel_driver.py`) did. The oldest wheel scripts/setup
//! unpacks, one in the middle, and the newest (the lab's); with the agents' telemetry on
//! (vLLM's default) and off.
//!
//! Needs root for the probes (CI runs as root) and `scripts/setup` (the wheels'
//! packages and numpy under `.lab/nixl`).

use super::support;

use kvscope_agent::nixl::NixlTracer;
use kvscope_wire::nixl::{NixlReport, XferStage};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Deserialize, Debug)]
struct DriverTransfer {
    op: String,
    bytes: u64,
    descriptors: u64,
    notif: String,
}

#[derive(Deserialize, Debug)]
struct Handshakes {
    ok: u64,
    failed: u64,
}

/// What the driver did (its JSON).
#[derive(Deserialize, Debug)]
struct DriverTruth {
    pid: u32,
    local: String,
    remote: String,
    transfers: Vec<DriverTransfer>,
    handshakes: Handshakes,
    creations_toward_unknown: u64,
    telemetry_refused: u64,
    gen_notif: u64,
    registered_bytes: u64,
}

/// A wheel unpacked: the folder holding its `nixl_cu12` package, and its libraries.
fn wheel(version: &str) -> (PathBuf, PathBuf) {
    let lab = kvscope_lab::paths::default_lab_dir();
    let root = if version == "1.5.1" {
        lab.join("nixl/wheel")
    } else {
        support::older_nixl_lib_dir(version)
            .parent()
            .unwrap()
            .to_path_buf()
    };
    assert!(
        root.join("nixl_cu12/_api.py").is_file(),
        "the NIXL {version} wheel's Python package is not under {}: run scripts/setup",
        root.display()
    );
    let libs = root.join(".nixl_cu12.mesonpy.libs");
    (root, libs)
}

fn drive(version: &str, pkg: &Path, libs: &Path, telemetry: bool) -> DriverTruth {
    let lab = kvscope_lab::paths::default_lab_dir();
    let pydeps = lab.join("nixl/pydeps");
    assert!(
        pydeps.join("numpy").is_dir(),
        "numpy for the wheels' Python API is not under {}: run scripts/setup",
        pydeps.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("truth.json");
    let mut cmd = std::process::Command::new(support::python());
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../lab/nixl/py/wheel_driver.py"
    ))
    .arg(&out)
    .env(
        "PYTHONPATH",
        std::env::join_paths([pkg, pydeps.as_path()]).unwrap(),
    );
    kvscope_nixl_lab::NixlLibs::from_lib_dir(libs)
        .unwrap_or_else(|e| panic!("{version}: {e}"))
        .apply_env(&mut cmd);
    if telemetry {
        cmd.env("NIXL_TELEMETRY_ENABLE", "y");
    } else {
        cmd.env_remove("NIXL_TELEMETRY_ENABLE");
    }
    let done = cmd.output().expect("the driver runs");
    assert!(
        done.status.success(),
        "{version}: the wheel driver failed ({}): {}",
        done.status,
        String::from_utf8_lossy(&done.stderr)
    );
    serde_json::from_slice(&std::fs::read(&out).unwrap()).expect("the driver's JSON")
}

/// The report once the tracer has seen the driver's transfers and calls (the ring buffer
/// is drained asynchronously), or after ten seconds.
async fn settle(tracer: &NixlTracer, t: &DriverTruth) -> NixlReport {
    let want = t.transfers.len() as u64 + t.creations_toward_unknown;
    for _ in 0..100 {
        let r = tracer.report();
        let got: u64 = r
            .transfers
            .iter()
            .filter(|x| x.pid == t.pid)
            .map(|x| x.transfers)
            .sum();
        let calls: u64 = r
            .calls
            .iter()
            .filter(|c| c.pid == t.pid && c.call == "genNotif")
            .map(|c| c.calls)
            .sum();
        if got >= want && calls >= t.gen_notif {
            tokio::time::sleep(Duration::from_millis(300)).await;
            return tracer.report();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tracer.report()
}

fn calls(r: &NixlReport, pid: u32, call: &str, ok: bool) -> u64 {
    r.calls
        .iter()
        .filter(|c| c.pid == pid && c.call == call && (c.status == "SUCCESS") == ok)
        .map(|c| c.calls)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_wheel_driven_by_its_own_python_api_is_traced_exactly() {
    use kvscope_agent::nixl::offsets::Counts;
    for version in ["1.0.1", "1.3.2", "1.5.1"] {
        let (pkg, libs) = wheel(version);
        let lib = libs.join("libnixl.so");
        for telemetry in [true, false] {
            let tracer =
                support::start_tracer(&support::tracer_config(vec![lib.clone()], false, None))
                    .await;
            let counts = kvscope_agent::nixl::library::NixlLibrary::inspect(&lib, true)
                .unwrap()
                .offsets
                .map(|o| o.counts);
            let with_bytes = match counts {
                Some(Counts::Always) => true,
                Some(Counts::WithTelemetry { .. }) => telemetry,
                _ => panic!("{version}: offsets not derived"),
            };
            let t = drive(version, &pkg, &libs, telemetry);
            let r = settle(&tracer, &t).await;
            drop(tracer);
            let what = format!("{version}, telemetry {telemetry}");
            assert_eq!((r.events_lost, r.events_malformed), (0, 0), "{what}");

            // Transfers: per op, completed, from py-b to py-a, bytes where held.
            for op in ["READ", "WRITE"] {
                let mine: Vec<_> = t.transfers.iter().filter(|x| x.op == op).collect();
                let rows: Vec<_> = r
                    .transfers
                    .iter()
                    .filter(|x| x.pid == t.pid && x.op == op && x.stage == XferStage::Complete)
                    .collect();
                assert!(
                    rows.iter().all(|x| x.local_agent == t.local
                        && x.remote_agent == t.remote
                        && x.status == "SUCCESS"),
                    "{what}: {rows:?}"
                );
                let n: u64 = rows.iter().map(|x| x.transfers).sum();
                let bytes: u64 = rows.iter().map(|x| x.bytes).sum();
                let descs: u64 = rows.iter().map(|x| x.descriptors).sum();
                let unknown: u64 = rows.iter().map(|x| x.bytes_unknown).sum();
                assert_eq!(n, mine.len() as u64, "{what}: {op} transfers");
                if with_bytes {
                    assert_eq!(
                        bytes,
                        mine.iter().map(|x| x.bytes).sum::<u64>(),
                        "{what}: {op} bytes"
                    );
                    assert_eq!(
                        descs,
                        mine.iter().map(|x| x.descriptors).sum::<u64>(),
                        "{what}: {op} descriptors"
                    );
                    assert_eq!(unknown, 0, "{what}");
                } else {
                    assert_eq!((bytes, unknown), (0, n), "{what}: {op} bytes unknown");
                }
            }
            // The creation toward an agent never loaded.
            let failed: Vec<_> = r
                .transfers
                .iter()
                .filter(|x| x.pid == t.pid && x.stage == XferStage::Create)
                .collect();
            assert_eq!(
                failed.iter().map(|x| x.transfers).sum::<u64>(),
                t.creations_toward_unknown,
                "{what}: {failed:?}"
            );
            assert!(
                failed
                    .iter()
                    .all(|x| x.remote_agent == "py-nobody" && x.status == "ERR_NOT_FOUND"),
                "{what}: {failed:?}"
            );
            // Metadata loads, the corrupt one failing; the genNotif; the refusals.
            assert_eq!(
                (
                    calls(&r, t.pid, "loadRemoteMD", true),
                    calls(&r, t.pid, "loadRemoteMD", false)
                ),
                (t.handshakes.ok, t.handshakes.failed),
                "{what}: loadRemoteMD"
            );
            assert_eq!(calls(&r, t.pid, "genNotif", true), t.gen_notif, "{what}");
            let registered: Vec<_> = r
                .calls
                .iter()
                .filter(|c| c.pid == t.pid && c.call == "registerMem")
                .collect();
            assert_eq!(
                (
                    registered.iter().map(|c| c.bytes).sum::<u64>(),
                    registered.iter().map(|c| c.bytes_partial).sum::<u64>()
                ),
                (t.registered_bytes, 0),
                "{what}: registered bytes, every descriptor summed"
            );
            assert_eq!(
                calls(&r, t.pid, "getXferTelemetry", false),
                t.telemetry_refused,
                "{what}: refusals"
            );
            assert_eq!(t.telemetry_refused > 0, !telemetry, "{what}");
            // Each transfer's notification names its request, with what it moved.
            for x in &t.transfers {
                let id = kvscope_wire::nixl::notif_request_id(&x.notif).unwrap();
                let row = r
                    .requests
                    .iter()
                    .find(|q| q.request_id == id)
                    .unwrap_or_else(|| panic!("{what}: request {id} not reported"));
                assert_eq!(row.transfers, 1, "{what}: {row:?}");
                if with_bytes {
                    assert_eq!(row.bytes, x.bytes, "{what}: {row:?}");
                }
            }
        }
    }
}
