//! Creates the lab's Python venv with Dynamo 1.6.1. Idempotent: does nothing when the
//! venv already imports `dynamo.frontend` and `dynamo.mocker`.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use tracing::info;

use crate::paths::venv_python;

/// Dynamo wheels, installed with `--no-deps`: `ai-dynamo` depends on `aisimulate`, a stub
/// that downloads from outside.
pub const DYNAMO_PACKAGES: &[&str] = &["ai-dynamo==1.6.1", "ai-dynamo-runtime==1.6.1"];

/// Dynamo's runtime dependencies (installed normally), plus `tokenizers` for the model
/// fixture generator.
pub const RUNTIME_PACKAGES: &[&str] = &[
    "aiohttp",
    "certifi",
    "msgspec",
    "prometheus-client",
    "pyzmq",
    "tqdm",
    "typing-extensions",
    "zstandard",
    "pydantic<=2.13.5",
    "uvloop",
    "pyyaml",
    "packaging",
    "tokenizers",
];

/// True when `<lab_dir>/venv/bin/python` can import the Dynamo frontend and mocker.
pub fn venv_ready(lab_dir: &Path) -> bool {
    let python = venv_python(lab_dir);
    python.exists()
        && Command::new(&python)
            .args(["-c", "import dynamo.frontend, dynamo.mocker, zmq, msgspec"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
}

/// Ensures the venv exists under `lab_dir` (creating and installing it if needed).
pub fn ensure_venv(lab_dir: &Path) -> Result<()> {
    if venv_ready(lab_dir) {
        info!(venv = %lab_dir.join("venv").display(), "Lab venv ready (Dynamo 1.6.1 importable).");
        return Ok(());
    }
    std::fs::create_dir_all(lab_dir)
        .with_context(|| format!("creating lab dir {}", lab_dir.display()))?;
    let venv = lab_dir.join("venv");
    let python = venv_python(lab_dir);
    let pip = lab_dir.join("venv").join("bin").join("pip");
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
    info!(packages = ?DYNAMO_PACKAGES, "Installing Dynamo (--no-deps); this downloads ~300 MB.");
    run(
        Command::new(&pip)
            .args(["install", "--disable-pip-version-check", "--no-deps"])
            .args(DYNAMO_PACKAGES),
        "pip install ai-dynamo",
    )?;
    info!(packages = ?RUNTIME_PACKAGES, "Installing Dynamo's runtime dependencies.");
    run(
        Command::new(&pip)
            .args(["install", "--disable-pip-version-check"])
            .args(RUNTIME_PACKAGES),
        "pip install runtime dependencies",
    )?;
    if !venv_ready(lab_dir) {
        bail!(
            "venv at {} still cannot import dynamo.frontend/dynamo.mocker after install",
            venv.display()
        );
    }
    info!(venv = %venv.display(), "Lab venv ready.");
    Ok(())
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
