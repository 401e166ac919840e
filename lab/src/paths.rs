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
