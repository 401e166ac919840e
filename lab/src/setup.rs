//! Creates the lab's Python venv of a Dynamo release. Idempotent: does nothing when the
//! venv already has that release and imports `dynamo.frontend` and `dynamo.mocker`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use tracing::info;

use crate::release::{venv_dir, DEFAULT_DYNAMO};

/// The wheel's dependencies that are never installed: `aisimulate` is a stub that
/// downloads from outside at install time (and the mocker does not need it).
const SKIPPED_REQUIREMENTS: &[&str] = &["aisimulate"];

/// What the lab itself needs beside Dynamo's own requirements: `tokenizers` for the
/// model fixture's generator.
pub const LAB_PACKAGES: &[&str] = &["tokenizers", "pyyaml", "packaging"];

/// Prints the requirements `ai-dynamo` and `ai-dynamo-runtime` declare, without extras
/// and with their markers evaluated here, one per line, leaving out the runtime itself
/// (installed already, pinned) and the skipped ones (argv). pip's own `packaging` reads
/// them, so nothing needs installing first.
const REQUIREMENTS_PY: &str = r#"
import importlib.metadata as m, sys
from pip._vendor.packaging.requirements import Requirement
skip = {"ai-dynamo-runtime", *sys.argv[1:]}
for dist in ("ai-dynamo", "ai-dynamo-runtime"):
    for line in m.requires(dist) or []:
        req = Requirement(line)
        if req.name in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        req.marker = None
        print(req)
"#;

/// True when the lab venv of the default release imports the Dynamo frontend and mocker.
pub fn venv_ready(lab_dir: &Path) -> bool {
    release_ready(lab_dir, DEFAULT_DYNAMO)
}

/// True when the venv of Dynamo `version` under `lab_dir` has that release and imports
/// its frontend and mocker.
pub fn release_ready(lab_dir: &Path, version: &str) -> bool {
    let python = venv_dir(lab_dir, version).join("bin").join("python");
    let check = format!(
        "import importlib.metadata as m, dynamo.frontend, dynamo.mocker, zmq, msgspec\n\
         assert m.version('ai-dynamo') == {version:?}"
    );
    python.exists()
        && Command::new(&python)
            .args(["-c", &check])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
}

/// Ensures the venv of the default release exists under `lab_dir`.
pub fn ensure_venv(lab_dir: &Path) -> Result<()> {
    ensure_release(lab_dir, DEFAULT_DYNAMO).map(drop)
}

/// Ensures the venv of Dynamo `version` exists under `lab_dir` (creating and installing
/// it if needed) and returns its folder.
pub fn ensure_release(lab_dir: &Path, version: &str) -> Result<PathBuf> {
    let venv = venv_dir(lab_dir, version);
    if release_ready(lab_dir, version) {
        info!(venv = %venv.display(), "Lab venv ready (Dynamo {version} importable).");
        return Ok(venv);
    }
    std::fs::create_dir_all(lab_dir)
        .with_context(|| format!("creating lab dir {}", lab_dir.display()))?;
    let python = venv.join("bin").join("python");
    let pip = venv.join("bin").join("pip");
    if python.exists() && !pip.exists() {
        // A venv made without ensurepip (Debian's python3 minus python3-venv) has no
        // pip and would fail here for ever: make it again.
        info!(venv = %venv.display(), "The venv has no pip; recreating it.");
        std::fs::remove_dir_all(&venv)
            .with_context(|| format!("removing the broken venv {}", venv.display()))?;
    }
    if !python.exists() {
        info!(venv = %venv.display(), "Creating Python venv.");
        run(
            Command::new("python3").arg("-m").arg("venv").arg(&venv),
            "python3 -m venv",
        )?;
    }
    let wheels = [
        format!("ai-dynamo=={version}"),
        format!("ai-dynamo-runtime=={version}"),
    ];
    info!(packages = ?wheels, "Installing Dynamo (--no-deps); this downloads ~300 MB.");
    run(
        Command::new(&pip)
            .args(["install", "--disable-pip-version-check", "--no-deps"])
            .args(&wheels),
        "pip install ai-dynamo",
    )?;
    let out = Command::new(&python)
        .args(["-c", REQUIREMENTS_PY])
        .args(SKIPPED_REQUIREMENTS)
        .output()
        .context("reading the wheel's requirements")?;
    if !out.status.success() {
        bail!(
            "reading ai-dynamo {version}'s requirements failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let requirements: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    info!(?requirements, lab = ?LAB_PACKAGES, "Installing what Dynamo {version} requires.");
    run(
        Command::new(&pip)
            .args(["install", "--disable-pip-version-check"])
            .args(&requirements)
            .args(LAB_PACKAGES),
        "pip install Dynamo's requirements",
    )?;
    if !release_ready(lab_dir, version) {
        bail!(
            "venv at {} still cannot import Dynamo {version}'s frontend and mocker after install",
            venv.display()
        );
    }
    info!(venv = %venv.display(), "Lab venv ready.");
    Ok(venv)
}

/// Checks that `nats-server` is on PATH (or in /usr/sbin, where Debian puts it).
pub fn nats_server_path() -> Result<std::path::PathBuf> {
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("nats-server");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    for dir in ["/usr/sbin", "/usr/local/sbin", "/usr/bin", "/usr/local/bin"] {
        let candidate = Path::new(dir).join("nats-server");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!("nats-server not found on PATH or in /usr/sbin (Debian: apt-get install nats-server)")
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {what}"))?;
    if !status.success() {
        bail!("{what} failed with {status}");
    }
    Ok(())
}
