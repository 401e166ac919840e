//! The kvscope NIXL lab: emulated decode workers that run real NIXL 1.5.1 agents (the
//! PyPI wheel's `libnixl.so`, UCX backend, DRAM) through `nixl-sys`, doing metadata
//! handshakes, KV block migrations (the target pulls the source's blocks, with a
//! notification) and failures injected on demand — and reporting their ground truth, so
//! the `libnixl.so` uprobes can be tested against it.
//!
//! - [`NixlLibs`]: where the wheel's libraries are (`libnixl.so` for the uprobes) and the
//!   environment a process needs to load them; [`setup::ensure_wheel`] downloads and
//!   unpacks the wheel.
//! - [`run::run`]: carries out a [`plan::Plan`] built from a [`plan::RunConfig`] (the
//!   `mixed` scenario by default) with in-process agents or one process per agent, and
//!   returns the [`truth::Truth`].
//! - [`bench::bench`]: a transfer loop for measuring probe overhead.
//! - [`serve::serve`]: the workers as a long-running data plane for the actuator's
//!   migration directives (HTTP), following their engines' KV events and publishing
//!   the blocks migrated to them as vLLM-format KV events.
//! - [`worker`]: one agent and its pool; [`protocol`]: the commands it takes.
//! - [`status`]: NIXL status codes at the Rust, C API and `nixlAgent` layers.

pub mod bench;
pub mod libs;
pub mod link;
pub mod plan;
pub mod protocol;
pub mod run;
pub mod serve;
pub mod setup;
pub mod sidecar;
pub mod status;
pub mod truth;
pub mod worker;

pub use libs::NixlLibs;
pub use truth::Truth;

/// Set when the binary re-executes itself with the libraries' environment, so it does
/// not try again.
pub const REEXEC_MARKER_ENV: &str = "KVSCOPE_NIXL_LAB_REEXEC";

/// The `kvscope-nixl-lab` binary, for other crates' tests: `target/<profile>/` next to
/// the running test binary, brought up to date with `cargo build -p kvscope-nixl-lab`
/// first (a no-op after `cargo test --workspace`, which builds every binary; a lone
/// `cargo test -p kvscope-agent` would otherwise run a stale lab).
///
/// # Panics
/// When the binary cannot be found or built (this is test support).
pub fn lab_binary() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the running executable's path");
    // target/<profile>/deps/<test binary> → target/<profile>
    let dir = exe
        .parent()
        .and_then(|d| {
            if d.ends_with("deps") {
                d.parent()
            } else {
                Some(d)
            }
        })
        .expect("the executable's folder")
        .to_path_buf();
    let bin = dir.join("kvscope-nixl-lab");
    {
        let mut cargo = std::process::Command::new(env!("CARGO"));
        cargo
            .args(["build", "-q", "-p", "kvscope-nixl-lab"])
            .current_dir(kvscope_lab::paths::workspace_dir());
        // Not the variables cargo set for this test: build scripts that watch one (ring
        // watches CARGO_MANIFEST_DIR) would rebuild half the tree here, and again on
        // the next build from a shell.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            if [
                "CARGO_MANIFEST_",
                "CARGO_PKG_",
                "CARGO_CRATE_",
                "CARGO_BIN_",
                "CARGO_PRIMARY_",
            ]
            .iter()
            .any(|p| k.starts_with(p))
                || k == "CARGO_TARGET_TMPDIR"
            {
                cargo.env_remove(k.as_ref());
            }
        }
        if let Some(target_dir) = dir.parent() {
            cargo.arg("--target-dir").arg(target_dir);
        }
        if dir.ends_with("release") {
            cargo.arg("--release");
        }
        let status = cargo
            .status()
            .expect("running cargo build -p kvscope-nixl-lab");
        assert!(status.success(), "cargo build -p kvscope-nixl-lab failed");
    }
    assert!(
        bin.is_file(),
        "{} is missing after building it",
        bin.display()
    );
    bin
}

/// Run the scenario `name` (`mixed`, `clean`) in a process of its own (the lab binary,
/// [`lab_binary`]), its truth written under `dir`; the truth.
///
/// # Panics
/// When the run fails or its truth does not parse (this is test support).
pub fn run_scenario(name: &str, dir: &std::path::Path) -> Truth {
    let path = dir.join(format!("truth-{name}.json"));
    let out = std::process::Command::new(lab_binary())
        .args(["run", "--scenario", name, "--truth-out"])
        .arg(&path)
        .output()
        .expect("the NIXL lab runs");
    assert!(
        out.status.success(),
        "kvscope-nixl-lab run --scenario {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(&path).expect("the truth file")).expect("the truth")
}
