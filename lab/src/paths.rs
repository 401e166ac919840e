//! Where the lab keeps things.

use std::path::PathBuf;

/// Environment variable that overrides the lab directory (venv, runs).
pub const LAB_DIR_ENV: &str = "KVSCOPE_LAB_DIR";

/// The workspace root (the folder holding the top-level `Cargo.toml`).
pub fn workspace_dir() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// The lab directory: `$KVSCOPE_LAB_DIR`, else `<workspace>/.lab` (git-ignored).
pub fn default_lab_dir() -> PathBuf {
    match std::env::var_os(LAB_DIR_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => workspace_dir().join(".lab"),
    }
}

/// The Python interpreter of the lab venv (the default Dynamo release's).
pub fn venv_python(lab_dir: &std::path::Path) -> PathBuf {
    crate::release::venv_dir(lab_dir, crate::release::DEFAULT_DYNAMO)
        .join("bin")
        .join("python")
}

/// The committed tiny model fixture (`tokenizer.json`, `config.json`, ...).
pub fn model_fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join("model")
}

/// The helper scripts shipped with the lab (e.g. `dump_kv_events.py`).
pub fn scripts_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts")
}

/// The workspace binary `bin`, for tests in other packages: `target/<profile>/` next to
/// the running test binary, every binary of the workspace brought up to date first with
/// one `cargo build --workspace --bins` per process. The same command as `scripts/setup`'s,
/// so the same features: after it (and in `scripts/test`), a no-op; a lone `cargo test -p
/// kvscope-e2e` would otherwise run a stale or missing binary.
///
/// # Panics
/// When the binaries cannot be built or `bin` is not among them (this is test support).
pub fn built_binary(bin: &str) -> PathBuf {
    static BUILT: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    let dir = BUILT
        .get_or_init(build_workspace_binaries)
        .as_ref()
        .unwrap_or_else(|e| panic!("{e}"));
    let path = dir.join(bin);
    assert!(
        path.is_file(),
        "{} is missing after building the workspace's binaries",
        path.display()
    );
    path
}

/// `cargo build --workspace --bins` into the target folder of the running test binary;
/// that folder (`target/<profile>`).
fn build_workspace_binaries() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("the running executable's path: {e}"))?;
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
        .ok_or_else(|| format!("no folder above {}", exe.display()))?
        .to_path_buf();
    let mut cargo = std::process::Command::new(env!("CARGO"));
    cargo
        .args(["build", "-q", "--workspace", "--bins"])
        .current_dir(workspace_dir());
    // Not the variables cargo set for this test: build scripts that watch one (ring
    // watches CARGO_MANIFEST_DIR) would rebuild half the tree here, and again on the
    // next build from a shell.
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
        .map_err(|e| format!("running cargo build --workspace --bins: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build --workspace --bins failed ({status})"));
    }
    Ok(dir)
}
