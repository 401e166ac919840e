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

/// A JetStream cluster of `nats-server`s on loopback, each with its own store and log
/// under one folder (`dir/n<i>/`), routes between every pair: what a fleet that runs
/// NATS as a cluster runs. Members can be killed and started again (same name, same
/// store, same ports), as a node lost and replaced.
pub struct NatsCluster {
    dir: std::path::PathBuf,
    /// Client and route port of each member.
    ports: Vec<(u16, u16)>,
    /// Each member's process, `None` while killed.
    members: Vec<Option<ManagedProcess>>,
}

impl NatsCluster {
    /// Start `n` members under `dir`; returns once each accepts connections.
    pub fn start(dir: &Path, n: usize) -> Result<Self> {
        let reservation = crate::ports::reserve_ports(2 * n).context("picking ports for NATS")?;
        let p = reservation.ports();
        let ports: Vec<(u16, u16)> = (0..n).map(|i| (p[2 * i], p[2 * i + 1])).collect();
        drop(reservation);
        let mut cluster = Self {
            dir: dir.to_path_buf(),
            ports,
            members: (0..n).map(|_| None).collect(),
        };
        for i in 0..n {
            cluster.start_member(i)?;
        }
        Ok(cluster)
    }

    /// Member `i`'s server name (what the stream's cluster info names its leader by).
    pub fn name(i: usize) -> String {
        format!("n{i}")
    }

    /// Every member's client URL, comma-separated (what kvscope's daemons take).
    pub fn urls(&self) -> String {
        self.ports
            .iter()
            .map(|(client, _)| format!("nats://127.0.0.1:{client}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Start member `i` (again): its configuration, store and ports as before.
    pub fn start_member(&mut self, i: usize) -> Result<()> {
        let dir = self.dir.join(Self::name(i));
        let store = dir.join("store");
        std::fs::create_dir_all(&store).context("creating a NATS member's store folder")?;
        let routes: Vec<String> = self
            .ports
            .iter()
            .map(|(_, route)| format!("\"nats-route://127.0.0.1:{route}\""))
            .collect();
        let (client, route) = self.ports[i];
        let conf = dir.join("nats-server.conf");
        std::fs::write(
            &conf,
            format!(
                "server_name: {}\nlisten: \"127.0.0.1:{client}\"\n{}cluster {{\n  name: kvscope\n  listen: \"127.0.0.1:{route}\"\n  routes: [{}]\n}}\n",
                Self::name(i),
                jetstream_config(&store, LAB_MAX_FILE_STORE),
                routes.join(", ")
            ),
        )
        .context("writing a NATS member's configuration")?;
        let mut cmd = Command::new(crate::setup::nats_server_path()?);
        cmd.arg("-c").arg(&conf);
        let log = dir.join("nats.log");
        let process = ManagedProcess::spawn(&Self::name(i), cmd, &log)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "NATS member {i} did not accept connections on 127.0.0.1:{client} within 10 s \
                 (see {})",
                log.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.members[i] = Some(process);
        Ok(())
    }

    /// `(index, pid)` of each member running.
    pub fn pids(&self) -> Vec<(usize, u32)> {
        self.members
            .iter()
            .enumerate()
            .filter_map(|(i, m)| m.as_ref().map(|p| (i, p.pid())))
            .collect()
    }

    /// SIGKILL member `i` (a node lost).
    pub fn kill_member(&mut self, i: usize) {
        if let Some(mut p) = self.members[i].take() {
            crate::process::signal_group(p.pid(), "KILL");
            let _ = p.child.wait();
        }
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        let mut running: Vec<ManagedProcess> =
            self.members.iter_mut().filter_map(Option::take).collect();
        stop_all(&mut running, Duration::from_secs(5));
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
