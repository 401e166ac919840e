//! A lab bus that only kvscope writes to, set up as a production one would be: TLS with
//! a CA made for the run, and a user per process with the permissions its role needs.
//!
//! - Each agent's user may publish only `kvscope.<cluster>.<agent_id>.>` (and create or
//!   update its cluster's stream) and read only its own inbox.
//! - The collector's may read the streams and acknowledge, and publish no record.
//! - The observer's (the tests' view) may only read a stream's state.
//!
//! The permissions are the ones kvscope documents for a production server
//! (`kvscope_wire::Subjects::agent_permissions` and `collector_permissions`), so the lab
//! checks them.
//!
//! Dynamo's NATS (its event plane) is a second server, with a password of its own and
//! no TLS: Dynamo 1.6.1's NATS client panics on a TLS server ("Could not automatically
//! determine the process-level CryptoProvider", seen here), so a fleet on 1.6.1 cannot
//! share a TLS-only bus with kvscope. kvscope's agent reads it with Dynamo's own
//! `NATS_AUTH_*` variables, as Dynamo's processes do.
//!
//! Every password is random; the certificates' keys, the servers' configurations and the
//! lab's `lab.json` that hold them are written owner-only (mode 0600).

use anyhow::{bail, Context as _, Result};
use kvscope_wire::{Permissions, Subjects};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The collector's user.
pub const COLLECTOR_USER: &str = "kvscope-collector";
/// The durable consumer (and so the inbox) the collector's user is allowed.
pub const COLLECTOR_DURABLE: &str = "kvscope-collector";
/// Reads stream state only (the tests' view of the bus).
pub const OBSERVER_USER: &str = "kvscope-observer";
/// Dynamo's processes.
pub const DYNAMO_USER: &str = "dynamo";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BusSecurity {
    /// The run's CA: what every client trusts for the server.
    pub ca_file: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub users: Vec<BusUser>,
}

#[derive(Clone, Serialize, Deserialize)]
pub struct BusUser {
    pub name: String,
    pub password: String,
    pub role: BusRole,
}

impl std::fmt::Debug for BusUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BusUser({}, {:?})", self.name, self.role)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BusRole {
    Agent {
        agent_id: String,
        cluster: String,
    },
    /// `durables`: the durable consumers (so the inboxes) it may use beside
    /// [`COLLECTOR_DURABLE`] (a collector limited to one model has its own).
    Collector {
        clusters: Vec<String>,
        #[serde(default)]
        durables: Vec<String>,
    },
    Observer {
        clusters: Vec<String>,
    },
    Dynamo,
}

/// An agent with a user on the lab's bus, and the cluster it publishes to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BusAgent {
    pub agent_id: String,
    pub cluster: String,
}

impl BusAgent {
    pub fn new(agent_id: &str, cluster: &str) -> Self {
        Self {
            agent_id: agent_id.into(),
            cluster: cluster.into(),
        }
    }
}

/// The user name of the agent `agent_id`.
pub fn agent_user(agent_id: &str) -> String {
    format!("kvscope-agent-{agent_id}")
}

/// A CA made for one run, and a server certificate it signed for 127.0.0.1 and
/// localhost (openssl CLI, P-256, valid 7 days): for the lab's TLS listeners.
#[derive(Debug, Clone)]
pub struct LoopbackCa {
    pub ca_file: PathBuf,
    /// The CA's key (mode 0600), to sign client certificates with.
    pub ca_key: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
}

const EC_KEY: [&str; 5] = [
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:P-256",
    "-nodes",
];

impl LoopbackCa {
    /// Make the CA and the server's certificate and key under `dir`.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let ca_key = dir.join("ca-key.pem");
        let ca_file = dir.join("ca.pem");
        openssl(
            Command::new("openssl")
                .args(["req", "-x509"])
                .args(EC_KEY)
                .arg("-keyout")
                .arg(&ca_key)
                .arg("-out")
                .arg(&ca_file)
                .args(["-days", "7", "-subj", "/CN=kvscope lab CA"])
                .args(["-addext", "basicConstraints=critical,CA:TRUE"])
                .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]),
        )?;
        restrict(&ca_key)?;
        let mut ca = Self {
            ca_file,
            ca_key,
            server_cert: PathBuf::new(),
            server_key: PathBuf::new(),
        };
        (ca.server_cert, ca.server_key) = ca.issue(
            dir,
            "server",
            "127.0.0.1",
            // clientAuth too: etcd's JSON gateway dials its own gRPC port with the
            // server's certificate, which `--client-cert-auth` then checks.
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
        )?;
        Ok(ca)
    }

    /// A client certificate and key for `name`, signed by this CA, under `dir`
    /// (`<name>.pem`, `<name>-key.pem`): for mutual TLS.
    pub fn client(&self, dir: &Path, name: &str) -> Result<(PathBuf, PathBuf)> {
        self.issue(dir, name, name, "extendedKeyUsage=clientAuth\n")
    }

    fn issue(&self, dir: &Path, file: &str, cn: &str, ext: &str) -> Result<(PathBuf, PathBuf)> {
        let (key, csr, cert, ext_file) = (
            dir.join(format!("{file}-key.pem")),
            dir.join(format!("{file}.csr")),
            dir.join(format!("{file}.pem")),
            dir.join(format!("{file}.ext")),
        );
        std::fs::write(
            &ext_file,
            format!(
                "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n{ext}"
            ),
        )?;
        openssl(
            Command::new("openssl")
                .arg("req")
                .args(EC_KEY)
                .arg("-keyout")
                .arg(&key)
                .arg("-out")
                .arg(&csr)
                .args(["-subj", &format!("/CN={cn}")]),
        )?;
        openssl(
            Command::new("openssl")
                .args(["x509", "-req", "-in"])
                .arg(&csr)
                .arg("-CA")
                .arg(&self.ca_file)
                .arg("-CAkey")
                .arg(&self.ca_key)
                .args(["-CAcreateserial", "-days", "7", "-out"])
                .arg(&cert)
                .arg("-extfile")
                .arg(&ext_file),
        )?;
        restrict(&key)?;
        Ok((cert, key))
    }
}

impl BusSecurity {
    /// Make the CA, the server's certificate (for 127.0.0.1 and localhost) and a user
    /// per role under `dir`, with one agent user for each of `agents`; the collector and
    /// the observer may read the streams of the agents' clusters.
    pub fn create(dir: &Path, agents: &[BusAgent]) -> Result<Self> {
        Self::create_with(dir, agents, &[])
    }

    /// [`Self::create`], the collector also allowed the durable consumers `durables`.
    pub fn create_with(dir: &Path, agents: &[BusAgent], durables: &[String]) -> Result<Self> {
        let LoopbackCa {
            ca_file,
            server_cert,
            server_key,
            ..
        } = LoopbackCa::create(dir)?;
        let mut clusters: Vec<String> = agents.iter().map(|a| a.cluster.clone()).collect();
        clusters.sort();
        clusters.dedup();
        let mut users = vec![
            user(
                COLLECTOR_USER,
                BusRole::Collector {
                    clusters: clusters.clone(),
                    durables: durables.to_vec(),
                },
            )?,
            user(OBSERVER_USER, BusRole::Observer { clusters })?,
            user(DYNAMO_USER, BusRole::Dynamo)?,
        ];
        for a in agents {
            users.push(user(
                &agent_user(&a.agent_id),
                BusRole::Agent {
                    agent_id: a.agent_id.clone(),
                    cluster: a.cluster.clone(),
                },
            )?);
        }
        let security = Self {
            ca_file,
            server_cert,
            server_key,
            users,
        };
        // Each kvscope user's variables, for a process started by hand next to the lab.
        for u in security.users.iter().filter(|u| u.role != BusRole::Dynamo) {
            let text: String = security
                .kvscope_env(&u.name)?
                .iter()
                .map(|(k, v)| format!("{k}={v}\n"))
                .collect();
            write_private(&dir.join(format!("{}.env", u.name)), &text)?;
        }
        Ok(security)
    }

    /// kvscope's bus: listen on loopback, TLS only, `jetstream` (see
    /// [`crate::nats::jetstream_config`]), kvscope's users with their permissions.
    pub fn server_config(&self, port: u16, jetstream: &str) -> String {
        let users = self.users.iter().filter(|u| u.role != BusRole::Dynamo);
        format!(
            "listen: \"127.0.0.1:{port}\"\n{jetstream}\
             tls {{ cert_file: {}, key_file: {}, timeout: 5 }}\n{}",
            quote(&self.server_cert.display().to_string()),
            quote(&self.server_key.display().to_string()),
            authorization(users),
        )
    }

    /// Dynamo's NATS: loopback, `jetstream`, Dynamo's user only.
    pub fn dynamo_server_config(&self, port: u16, jetstream: &str) -> String {
        let users = self.users.iter().filter(|u| u.role == BusRole::Dynamo);
        format!(
            "listen: \"127.0.0.1:{port}\"\n{jetstream}{}",
            authorization(users),
        )
    }

    fn user(&self, name: &str) -> Result<&BusUser> {
        match self.users.iter().find(|u| u.name == name) {
            Some(u) => Ok(u),
            None => bail!(
                "the lab's bus has no user {name:?}; an agent needs its id in LabConfig::bus_agents"
            ),
        }
    }

    /// `KVSCOPE_NATS_*` for a kvscope process logging in as `name`.
    pub fn kvscope_env(&self, name: &str) -> Result<Vec<(String, String)>> {
        let u = self.user(name)?;
        Ok(vec![
            ("KVSCOPE_NATS_USER".into(), u.name.clone()),
            ("KVSCOPE_NATS_PASSWORD".into(), u.password.clone()),
            (
                "KVSCOPE_NATS_TLS_CA".into(),
                self.ca_file.display().to_string(),
            ),
            ("KVSCOPE_NATS_TLS_REQUIRED".into(), "1".into()),
        ])
    }

    /// `KVSCOPE_NATS_*` for the agent `agent_id`.
    pub fn agent_env(&self, agent_id: &str) -> Result<Vec<(String, String)>> {
        self.kvscope_env(&agent_user(agent_id))
    }

    /// Dynamo's own variables for its user on Dynamo's NATS.
    pub fn dynamo_env(&self) -> Vec<(String, String)> {
        let Ok(u) = self.user(DYNAMO_USER) else {
            return Vec::new();
        };
        vec![
            ("NATS_AUTH_USERNAME".into(), u.name.clone()),
            ("NATS_AUTH_PASSWORD".into(), u.password.clone()),
        ]
    }
}

/// An `authorization` block with `users`, each with its password and permissions.
fn authorization<'a>(users: impl Iterator<Item = &'a BusUser>) -> String {
    let entries: Vec<String> = users
        .map(|u| {
            format!(
                "{{ user: {}, password: {}{} }}",
                quote(&u.name),
                quote(&u.password),
                permissions(&u.role)
            )
        })
        .collect();
    format!(
        "authorization {{ users: [\n  {}\n] }}\n",
        entries.join(",\n  ")
    )
}

/// What each role may do, as a `permissions` block: exactly what kvscope documents
/// for a production server (`kvscope_wire::Subjects::agent_permissions`, ...), per
/// cluster; none for Dynamo, whose server is its own.
fn permissions(role: &BusRole) -> String {
    let p = match role {
        BusRole::Dynamo => return String::new(),
        BusRole::Agent { agent_id, cluster } => Subjects::new(cluster).agent_permissions(agent_id),
        BusRole::Collector { clusters, durables } => clusters
            .iter()
            .flat_map(|c| {
                std::iter::once(COLLECTOR_DURABLE)
                    .chain(durables.iter().map(String::as_str))
                    .map(move |d| Subjects::new(c).collector_permissions(d))
            })
            .fold(Permissions::default(), Permissions::merge),
        BusRole::Observer { clusters } => Permissions {
            publish: clusters
                .iter()
                .map(|c| format!("$JS.API.STREAM.INFO.{}", Subjects::new(c).stream_name()))
                .collect(),
            subscribe: vec!["_INBOX.>".into()],
        },
    };
    format!(", {}", p.to_nats_conf())
}

fn user(name: &str, role: BusRole) -> Result<BusUser> {
    Ok(BusUser {
        name: name.to_string(),
        password: random_hex(24)?,
        role,
    })
}

fn random_hex(bytes: usize) -> Result<String> {
    use std::io::Read as _;
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .context("reading /dev/urandom for a lab password")?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// A string in the NATS configuration's syntax (JSON's quoting is a subset of it).
pub(crate) fn quote(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// Write a file only its owner may read (it holds secrets).
pub fn write_private(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    restrict(path)
}

fn restrict(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {}", path.display()))
}

fn openssl(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().context(
        "running openssl (Debian: apt-get install openssl) to make the lab's TLS certificates",
    )?;
    if !out.status.success() {
        bail!(
            "openssl failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_agent_may_publish_under_its_own_name_only() {
        let p = permissions(&BusRole::Agent {
            agent_id: "node-1".into(),
            cluster: "lab".into(),
        });
        assert!(p.contains("\"kvscope.lab.node-1.>\""), "{p}");
        assert!(p.contains("\"_INBOX_kvscope.lab.node-1.>\""), "{p}");
        assert!(!p.contains("\"kvscope.>\""), "{p}");
        let c = permissions(&BusRole::Collector {
            clusters: vec!["lab".into(), "info".into()],
            durables: vec!["kvscope-collector-alpha".into()],
        });
        assert!(
            c.contains("\"_INBOX_kvscope.lab.kvscope-collector-alpha.>\""),
            "{c}"
        );
        assert!(
            c.contains("KVSCOPE_LAB") && c.contains("KVSCOPE_INFO"),
            "{c}"
        );
        assert!(
            !c.contains("\"kvscope."),
            "the collector publishes no record: {c}"
        );
        assert_eq!(permissions(&BusRole::Dynamo), "");
    }

    #[test]
    fn each_server_has_its_own_users() {
        let dir = tempfile::tempdir().unwrap();
        let s = BusSecurity::create(
            dir.path(),
            &[BusAgent::new("a", "lab"), BusAgent::new("b", "lab")],
        )
        .unwrap();
        let jetstream = crate::nats::jetstream_config(Path::new("/store"), 1 << 30);
        let conf = s.server_config(4222, &jetstream);
        for needle in [
            "max_file_store: 1073741824",
            "tls {",
            "\"kvscope-agent-a\"",
            "\"kvscope-agent-b\"",
            "\"kvscope-collector\"",
            "127.0.0.1:4222",
        ] {
            assert!(conf.contains(needle), "{needle} missing from\n{conf}");
        }
        assert!(!conf.contains("\"dynamo\""), "{conf}");
        let dynamo = s.dynamo_server_config(4223, &jetstream);
        assert!(
            dynamo.contains("\"dynamo\"") && !dynamo.contains("kvscope-agent"),
            "{dynamo}"
        );
        assert!(s.agent_env("c").is_err());
        let env = s.agent_env("a").unwrap();
        assert_eq!(
            env[0],
            ("KVSCOPE_NATS_USER".into(), "kvscope-agent-a".into())
        );
        assert!(!format!("{:?}", s.users).contains(&s.users[0].password));
        assert!(s.ca_file.is_file() && s.server_cert.is_file());
    }
}
