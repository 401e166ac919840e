//! A real etcd (Debian's `etcd-server`) on loopback with its data in a folder: Dynamo's
//! default discovery backend, for the lab runs and tests that use it.

use crate::process::ManagedProcess;
use anyhow::{Context as _, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where Debian installs it.
pub fn etcd_path() -> Result<PathBuf> {
    for p in ["/usr/bin/etcd", "/usr/local/bin/etcd"] {
        if Path::new(p).exists() {
            return Ok(p.into());
        }
    }
    anyhow::bail!(
        "etcd is not installed (Debian: apt-get install etcd-server; scripts/setup does it)"
    )
}

/// Spawn `etcd` serving clients on 127.0.0.1:`client_port` (peers on `peer_port`), data
/// under `dir/etcd`, log in `dir/etcd.log`, without waiting for it.
pub fn spawn(dir: &Path, client_port: u16, peer_port: u16) -> Result<ManagedProcess> {
    let data = dir.join("etcd");
    std::fs::create_dir_all(&data).context("creating the etcd data folder")?;
    let client = format!("http://127.0.0.1:{client_port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let mut cmd = Command::new(etcd_path()?);
    cmd.args(["--name", "lab", "--data-dir"])
        .arg(&data)
        .args(["--listen-client-urls", &client])
        .args(["--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer])
        .args(["--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("lab={peer}")])
        .env_remove("ETCD_ENDPOINTS");
    ManagedProcess::spawn("etcd", cmd, &dir.join("etcd.log"))
}
