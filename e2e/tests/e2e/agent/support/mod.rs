//! Shared by the agent's integration tests: the lab's Python (pyzmq) and the real
//! mocker messages captured in `lab/fixtures/samples`.

use std::path::PathBuf;

/// The lab venv's Python (pyzmq), as `scripts/setup` makes it.
#[allow(dead_code)]
pub fn python() -> PathBuf {
    kvscope_lab::paths::venv_python(&kvscope_lab::paths::default_lab_dir())
}

/// The captured ZMQ messages of a Dynamo 1.6.1 mocker (frames in hex and base64).
#[allow(dead_code)]
pub fn mocker_sample() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../lab/fixtures/samples/kv_events_mocker.json"
    );
    serde_json::from_slice(&std::fs::read(path).expect("the captured mocker sample"))
        .expect("valid sample JSON")
}

/// The NIXL wheel's libraries (`scripts/setup` downloads the wheel; this fails with the
/// command to run when it is missing).
#[allow(dead_code)]
pub fn nixl_libs() -> kvscope_nixl_lab::NixlLibs {
    kvscope_nixl_lab::NixlLibs::ensure(&kvscope_lab::paths::default_lab_dir())
        .unwrap_or_else(|e| panic!("the NIXL wheel is not set up: {e}"))
}

/// An older wheel's NIXL library folder, as `scripts/setup` unpacks it under
/// `.lab/nixl/versions/<version>` (this fails with the command to run when missing).
#[allow(dead_code)]
pub fn older_nixl_lib_dir(version: &str) -> PathBuf {
    let dir = kvscope_lab::paths::default_lab_dir()
        .join("nixl/versions")
        .join(version)
        .join(".nixl_cu12.mesonpy.libs");
    assert!(
        dir.join("libnixl.so").is_file(),
        "the NIXL {version} wheel's libraries are not under {}: run scripts/setup",
        dir.display()
    );
    dir
}

/// The `libnixl.so` of the NIXL `version` wheel built for aarch64 (scripts/setup).
pub fn aarch64_nixl_lib(version: &str) -> PathBuf {
    let lib = kvscope_lab::paths::default_lab_dir()
        .join("nixl/aarch64")
        .join(version)
        .join("libnixl.so");
    assert!(
        lib.is_file(),
        "the NIXL {version} aarch64 wheel's libnixl.so is not at {}: run scripts/setup",
        lib.display()
    );
    lib
}

/// A copy of the wheel's NIXL library folder under `dest` whose `libnixl.so` carries
/// another GNU build-id (a NIXL build no table holds, as one built from source). The
/// bundled UCX folder, found through `$ORIGIN/../nixl_cu12.libs`, is linked, not copied.
/// Returns the copied library folder.
#[allow(dead_code)]
pub fn copy_libs_with_new_build_id(lib_dir: &std::path::Path, dest: &std::path::Path) -> PathBuf {
    copy_libs_patched(lib_dir, dest, &[])
}

/// `registerMem`'s (and `deregisterMem`'s) sum of the descriptors' lengths for NIXL's
/// telemetry, `add 0x8(%rax),%rsi; add $0x38,%rax`, and the same with the sum replaced
/// by `xor %esi,%esi; xchg %ax,%ax`: the loop still ends, the telemetry counts 0 bytes
/// registered, and no instruction names a descriptor's length any more.
#[allow(dead_code)]
pub const DESCRIPTOR_SUM: (&[u8], &[u8]) = (
    &[0x48, 0x03, 0x70, 0x08, 0x48, 0x83, 0xc0, 0x38],
    &[0x31, 0xf6, 0x66, 0x90, 0x48, 0x83, 0xc0, 0x38],
);

/// `getXferStatus`' test of the request's status for in progress in the lab's build
/// (`mov 0xb8(%rbx),%ebp; cmp $1,%ebp`), made a test for 2: no path is known to be in
/// progress, so no end site can be placed (the file is read, never run).
#[allow(dead_code)]
pub const STATUS_IN_PROGRESS_TEST: (&[u8], &[u8]) = (
    &[0x8b, 0xab, 0xb8, 0x00, 0x00, 0x00, 0x83, 0xfd, 0x01],
    &[0x8b, 0xab, 0xb8, 0x00, 0x00, 0x00, 0x83, 0xfd, 0x02],
);

/// `postXferReq`'s return of its status from the frame in the lab's build
/// (`mov -0xe8(%rbp),%eax; lea -0x28(%rbp),%rsp`), made `xor %eax,%eax` and a nop: the
/// status returned is no longer where a site can read it (the file is read, never run).
#[allow(dead_code)]
pub const POST_STATUS_RETURN: (&[u8], &[u8]) = (
    &[0x8b, 0x85, 0x18, 0xff, 0xff, 0xff, 0x48, 0x8d, 0x65, 0xd8],
    &[0x31, 0xc0, 0x0f, 0x1f, 0x40, 0x00, 0x48, 0x8d, 0x65, 0xd8],
);

/// `createXferReq`'s `mov $-2,%r15d` in the lab's build (the status two failure paths
/// share), made `mov %eax,%r15d` and a nop: those paths return whatever the call before
/// left, which may be success, so no set of sites sees every failure (the file is read,
/// never run).
#[allow(dead_code)]
pub const CREATE_FAILURE_STATUS: (&[u8], &[u8]) = (
    &[0x41, 0xbf, 0xfe, 0xff, 0xff, 0xff],
    &[0x41, 0x89, 0xc7, 0x0f, 0x1f, 0x00],
);

/// [`copy_libs_with_new_build_id`], with every occurrence of each `(from, to)` pair's
/// bytes in `libnixl.so` replaced (each must occur).
#[allow(dead_code)]
pub fn copy_libs_patched(
    lib_dir: &std::path::Path,
    dest: &std::path::Path,
    patches: &[(&[u8], &[u8])],
) -> PathBuf {
    fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            let target = to.join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                copy_dir(&e.path(), &target);
            } else {
                std::fs::copy(e.path(), &target).unwrap();
            }
        }
    }
    let name = lib_dir.file_name().expect("a library folder");
    let copy = dest.join(name);
    copy_dir(lib_dir, &copy);
    let bundled = lib_dir.parent().unwrap().join("nixl_cu12.libs");
    std::os::unix::fs::symlink(&bundled, dest.join("nixl_cu12.libs")).unwrap();

    let lib = copy.join("libnixl.so");
    let mut bytes = std::fs::read(&lib).unwrap();
    let id = kvscope_nixl_lab::libs::elf_build_id(&bytes)
        .expect("the wheel's libnixl.so has a build-id");
    let raw: Vec<u8> = (0..id.len() / 2)
        .map(|i| u8::from_str_radix(&id[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let at = bytes
        .windows(raw.len())
        .position(|w| w == raw.as_slice())
        .expect("the build-id bytes in the file");
    // A build-id of its own per patch set (a build-id names the bytes: the agent
    // derives a build once): the first bytes flipped, the next mixed with the patches'.
    for b in &mut bytes[at..at + 4] {
        *b ^= 0xff - patches.len() as u8;
    }
    let mixed = patches
        .iter()
        .flat_map(|(_, to)| to.iter())
        .fold(0u32, |h, b| h.rotate_left(5) ^ u32::from(*b));
    for (b, m) in bytes[at + 4..at + 8].iter_mut().zip(mixed.to_le_bytes()) {
        *b ^= m;
    }
    for (from, to) in patches {
        assert_eq!(from.len(), to.len());
        let mut found = 0;
        let mut i = 0;
        while let Some(at) = bytes[i..].windows(from.len()).position(|w| w == *from) {
            bytes[i + at..i + at + to.len()].copy_from_slice(to);
            i += at + to.len();
            found += 1;
        }
        assert!(found > 0, "{from:02x?} is not in {}", lib.display());
    }
    std::fs::write(&lib, &bytes).unwrap();
    let new_id = kvscope_nixl_lab::libs::elf_build_id(&bytes).unwrap();
    assert_ne!(new_id, id, "the copy has another build-id");
    copy
}

/// The tracer's configuration for the NIXL tests: these libraries, completion sites where
/// the build has them, quick scans and reports, the default sampling of records (one in
/// 16: the figures checked are the kernel's, exact whatever it is).
#[allow(dead_code)]
pub fn tracer_config(
    libraries: Vec<PathBuf>,
    discover: bool,
    pid: Option<u32>,
) -> kvscope_agent::nixl::NixlTraceConfig {
    kvscope_agent::nixl::NixlTraceConfig {
        enabled: true,
        libraries,
        discover,
        pid,
        completion_sites: true,
        scan_interval_secs: 0.1,
        report_interval_secs: 1.0,
        ..Default::default()
    }
}

/// The tracer started, or the test fails saying why it cannot run here.
#[allow(dead_code)]
pub async fn start_tracer(
    cfg: &kvscope_agent::nixl::NixlTraceConfig,
) -> kvscope_agent::nixl::NixlTracer {
    match kvscope_agent::nixl::NixlTracer::start(cfg).await {
        Ok(t) => t,
        Err(e) => panic!(
            "NIXL tracing is not available here, so this test cannot run (it must run as \
             root with uprobes, as CI does): {e:#}"
        ),
    }
}

/// The value of the first line of `name`'s series on the `/metrics` page at `addr`
/// (`name` may carry its labels); `None` while the page or the series is not there.
#[allow(dead_code)]
pub fn metric(addr: &str, name: &str) -> Option<u64> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).ok()?;
    conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    conn.read_to_string(&mut text).ok()?;
    text.lines()
        .filter(|l| l.starts_with(name))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The real `kvscope-agent` binary on `nats_url`, tapping each of `kv` (`--kv` values),
/// serving `/metrics` on `metrics` and recording into `recording`; it logs into
/// `dir/agent.log` and is stopped when the guard drops.
#[allow(dead_code)]
pub fn spawn_agent(
    dir: &std::path::Path,
    nats_url: &str,
    name: &str,
    metrics: &str,
    kv: &[String],
    recording: &std::path::Path,
) -> kvscope_lab::process::StopOnDrop {
    let mut cmd = std::process::Command::new(kvscope_e2e::agent());
    cmd.args(["--nats-url", nats_url, "--cluster", name])
        .args([
            "--agent-id",
            &format!("{name}-test"),
            "--heartbeat-secs",
            "0.2",
        ])
        .args(["--metrics-listen", metrics]);
    for k in kv {
        cmd.arg("--kv").arg(k);
    }
    cmd.arg("--record").arg(recording);
    kvscope_lab::process::StopOnDrop(vec![kvscope_lab::process::ManagedProcess::spawn(
        "agent",
        cmd,
        &dir.join("agent.log"),
    )
    .expect("the agent starts")])
}
