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

/// The `kvscope-nixl-lab` binary, for other crates' tests, brought up to date first
/// ([`kvscope_lab::paths::built_binary`]).
///
/// # Panics
/// When the binary cannot be found or built (this is test support).
pub fn lab_binary() -> std::path::PathBuf {
    kvscope_lab::paths::built_binary("kvscope-nixl-lab")
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
