//! A real etcd (Debian's `etcd-server`) on loopback with its data in a folder: Dynamo's
//! default discovery backend, for the lab runs and tests that use it.

use crate::bus_security::LoopbackCa;
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
    spawn_with(dir, client_port, peer_port, None)
}

/// [`spawn`] with clients over TLS: the server certificate `ca` signed, and every client
/// presenting a certificate it signed (mutual TLS, `--client-cert-auth`).
pub fn spawn_with(
    dir: &Path,
    client_port: u16,
    peer_port: u16,
    tls: Option<&LoopbackCa>,
) -> Result<ManagedProcess> {
    let data = dir.join("etcd");
    std::fs::create_dir_all(&data).context("creating the etcd data folder")?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let client = format!("{scheme}://127.0.0.1:{client_port}");
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
    if let Some(ca) = tls {
        cmd.arg("--cert-file")
            .arg(&ca.server_cert)
            .arg("--key-file")
            .arg(&ca.server_key)
            .arg("--trusted-ca-file")
            .arg(&ca.ca_file)
            .arg("--client-cert-auth");
    }
    ManagedProcess::spawn("etcd", cmd, &dir.join("etcd.log"))
}
