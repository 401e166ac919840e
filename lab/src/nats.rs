//! A `nats-server -js` on loopback with its store in a folder: the lab's bus, and the
//! one way tests start a real NATS.

use crate::bus_security::BusSecurity;
use crate::process::{stop_all, ManagedProcess};
use anyhow::{Context as _, Result};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// A running server; dropping it stops it.
pub struct NatsServer {
    process: Vec<ManagedProcess>,
    port: u16,
    security: Option<BusSecurity>,
}

impl NatsServer {
    /// Start on 127.0.0.1:`port` with JetStream stored under `dir` (log in
    /// `dir/nats.log`); returns once it accepts connections.
    pub fn start(dir: &Path, port: u16) -> Result<Self> {
        Self::start_with(dir, port, None)
    }

    /// [`Self::start`] with TLS, accounts and users as `security` says (see
    /// [`crate::bus_security`]).
    pub fn start_with(dir: &Path, port: u16, security: Option<BusSecurity>) -> Result<Self> {
        let process = spawn(dir, port, security.as_ref())?;
        Self::ready(dir, process, port, security)
    }

    /// [`Self::start_anywhere`] with the server's JetStream store limited to
    /// `max_file_store` bytes, as a deployment's `jetstream { max_file_store }` does.
    pub fn start_with_store_limit(dir: &Path, max_file_store: u64) -> Result<Self> {
        let reservation = crate::ports::reserve_ports(1).context("picking a port for NATS")?;
        let port = reservation.ports()[0];
        let process = spawn_limited(dir, port, None, max_file_store)?;
        Self::ready(dir, process, port, None)
    }

    /// The server `process` started on `port`, once it accepts connections.
    fn ready(
        dir: &Path,
        process: ManagedProcess,
        port: u16,
        security: Option<BusSecurity>,
    ) -> Result<Self> {
        let server = Self {
            process: vec![process],
            port,
            security,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "nats-server did not accept connections on 127.0.0.1:{port} within 10 s \
                 (see {})",
                dir.join("nats.log").display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(server)
    }

    /// Start on a free port under `dir`.
    pub fn start_anywhere(dir: &Path) -> Result<Self> {
        // Held until the server accepts connections, so nothing alongside takes it first.
        let reservation = crate::ports::reserve_ports(1).context("picking a port for NATS")?;
        Self::start(dir, reservation.ports()[0])
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.process[0].pid()
    }

    /// The users and CA, when it runs secured.
    pub fn security(&self) -> Option<&BusSecurity> {
        self.security.as_ref()
    }
}

/// The JetStream store every lab server gets. nats-server's own default is 75% of the
/// disk free when it starts, so on a machine with under 5.4 GiB free it refuses
/// kvscope's default stream (4 GiB) and every daemon stays unready; a deployment sets
/// the limit (the manifests: 8GB), and so does the lab. nats-server reserves it without
/// checking the disk: the tests write megabytes.
pub const LAB_MAX_FILE_STORE: u64 = 16 << 30;

/// `jetstream { … }` of a server configuration: its store under `store`, at most
/// `max_file_store` bytes.
pub fn jetstream_config(store: &Path, max_file_store: u64) -> String {
    format!(
        "jetstream {{\n  store_dir: {}\n  max_file_store: {max_file_store}\n}}\n",
        crate::bus_security::quote(&store.display().to_string())
    )
}

/// Spawn `nats-server` with JetStream on 127.0.0.1:`port`, store under `dir/nats`
/// ([`LAB_MAX_FILE_STORE`]), log in `dir/nats.log`, without waiting for it (the lab
/// waits for its whole fleet at once). With `security`, its configuration file (mode
/// 0600, it holds the passwords) sets TLS, the accounts and the users.
pub fn spawn(dir: &Path, port: u16, security: Option<&BusSecurity>) -> Result<ManagedProcess> {
    spawn_limited(dir, port, security, LAB_MAX_FILE_STORE)
}

fn spawn_limited(
    dir: &Path,
    port: u16,
    security: Option<&BusSecurity>,
    max_file_store: u64,
) -> Result<ManagedProcess> {
    let store = dir.join("nats");
    std::fs::create_dir_all(&store).context("creating the NATS store folder")?;
    let jetstream = jetstream_config(&store, max_file_store);
    let conf = dir.join("nats-server.conf");
    match security {
        None => std::fs::write(&conf, format!("listen: \"127.0.0.1:{port}\"\n{jetstream}"))
            .context("writing the NATS configuration")?,
        Some(s) => crate::bus_security::write_private(&conf, &s.server_config(port, &jetstream))?,
    }
    let mut cmd = Command::new(crate::setup::nats_server_path()?);
    cmd.arg("-c").arg(&conf);
    ManagedProcess::spawn("nats-server", cmd, &dir.join("nats.log"))
}

/// Spawn Dynamo's own NATS beside a secured bus (see [`crate::bus_security`] for why
/// it is a server of its own): 127.0.0.1:`port`, store under `dir/dynamo-nats`, log in
/// `dir/dynamo-nats.log`, Dynamo's user only.
pub fn spawn_dynamo(dir: &Path, port: u16, security: &BusSecurity) -> Result<ManagedProcess> {
    let store = dir.join("dynamo-nats");
    std::fs::create_dir_all(&store).context("creating Dynamo's NATS store folder")?;
    let conf = dir.join("dynamo-nats-server.conf");
    let jetstream = jetstream_config(&store, LAB_MAX_FILE_STORE);
    crate::bus_security::write_private(&conf, &security.dynamo_server_config(port, &jetstream))?;
    let mut cmd = Command::new(crate::setup::nats_server_path()?);
    cmd.arg("-c").arg(&conf);
    ManagedProcess::spawn("dynamo-nats-server", cmd, &dir.join("dynamo-nats.log"))
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        stop_all(&mut self.process, Duration::from_secs(2));
    }
}
