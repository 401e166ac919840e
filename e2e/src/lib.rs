//! The end-to-end tests' kit, one copy of each thing they share: the binaries under test
//! (from one `cargo build --workspace --bins` per process), the lab with kvscope attached,
//! the oracle (Dynamo's own `RadixTree` fed the same events) and the router-view count
//! beside it, an OTLP receiver, the data plane's directives, HTTP and command helpers. The lab itself is `kvscope-lab`, the lab
//! fleet with kvscope attached `kvscope-fleet`; the tests are `tests/e2e/`, one module per
//! subject.

pub mod data_plane;
pub mod oracle;
pub mod otlp_receiver;
pub mod router_view;

use kvscope_fleet::fleet_run::{FleetRun, FleetRunConfig};
use kvscope_lab::Lab;
use std::path::{Path, PathBuf};

/// The `kvscope` binary (the image's). Every binary under test comes from one
/// `cargo build --workspace --bins` per test process
/// ([`kvscope_lab::paths::built_binary`]), so none is stale.
pub fn kvscope() -> PathBuf {
    kvscope_lab::paths::built_binary("kvscope")
}

/// The `kvscope-demo` binary (what `scripts/demo` runs), the `kvscope` binary it starts
/// beside it.
pub fn kvscope_demo() -> PathBuf {
    kvscope_lab::paths::built_binary("kvscope-demo")
}

/// The lab's venv in `lab_dir` for the default Dynamo release, made if missing
/// (`scripts/setup` makes it; a lone test run makes it here).
///
/// # Panics
/// When it cannot be made (this is test support).
pub fn lab_venv(lab_dir: &Path) {
    kvscope_lab::setup::ensure_venv(lab_dir).expect("the lab venv (scripts/setup makes it)");
}

/// The `kvscope-agent` binary.
pub fn agent() -> PathBuf {
    kvscope_lab::paths::built_binary("kvscope-agent")
}

/// The `kvscope-collector` binary.
pub fn collector() -> PathBuf {
    kvscope_lab::paths::built_binary("kvscope-collector")
}

/// The lab of `cfg` with kvscope's agent and collector attached ([`FleetRun::start`]),
/// the lab's venv made and the `kvscope` binary built first.
pub async fn fleet(cfg: FleetRunConfig) -> anyhow::Result<FleetRun> {
    fleet_with(cfg, |_| Ok(Vec::new())).await
}

/// [`fleet`], the agent given the arguments `agent_args` returns once the lab is up
/// ([`FleetRun::start_with`]).
pub async fn fleet_with(
    cfg: FleetRunConfig,
    agent_args: impl FnOnce(&Lab) -> anyhow::Result<Vec<String>>,
) -> anyhow::Result<FleetRun> {
    lab_venv(&cfg.lab.lab_dir);
    FleetRun::start_with(&kvscope(), cfg, agent_args).await
}

/// Run `cmd` to its end; its output, once it has succeeded.
///
/// # Panics
/// When it cannot start or fails: the command, its status and what it printed.
pub fn succeeded(cmd: &mut std::process::Command) -> std::process::Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?} does not start: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The body of `GET url`.
///
/// # Panics
/// When the request fails or is not answered with success.
pub async fn get_text(url: &str) -> String {
    reqwest::get(url)
        .await
        .and_then(|r| r.error_for_status())
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .text()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
}

/// The JSON body of `GET url`.
///
/// # Panics
/// When the request fails, is not answered with success, or its body is not `T`.
pub async fn get_json<T: serde::de::DeserializeOwned>(url: &str) -> T {
    let text = get_text(url).await;
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("GET {url}: {e}: {text}"))
}

/// The collector's recording, read, once checked to hold exactly what the agent's
/// recording holds, in its order: nothing lost, applied twice or reordered between them
/// (across whatever the test did to the bus or the collector), and no bad line in either.
///
/// # Panics
/// When either cannot be read, or they differ.
pub fn applied_as_published(
    agent_recording: &Path,
    collector_recording: &Path,
) -> kvscope_wire::recording::Recording {
    let read = |p: &Path| {
        kvscope_wire::recording::read_recording(p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    let (sent, applied) = (read(agent_recording), read(collector_recording));
    for (r, who) in [(&sent, "agent's"), (&applied, "collector's")] {
        assert!(
            r.bad_lines.is_empty(),
            "the {who} recording has bad lines: {:?}",
            &r.bad_lines[..r.bad_lines.len().min(3)]
        );
    }
    assert_eq!(
        sent.envelopes.len(),
        applied.envelopes.len(),
        "records published vs applied"
    );
    assert!(
        sent.envelopes == applied.envelopes,
        "the collector applied the agent's records in the agent's order"
    );
    applied
}

/// The counters of the last agent heartbeat among `envelopes`, if any.
pub fn last_agent_counters(
    envelopes: &[kvscope_wire::Envelope],
) -> Option<kvscope_wire::AgentCounters> {
    envelopes.iter().rev().find_map(|e| match &e.record {
        kvscope_wire::Record::Heartbeat(h) => Some(h.counters.clone()),
        _ => None,
    })
}
