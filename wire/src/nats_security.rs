//! How a kvscope process proves who it is to NATS, and how it checks that the server is
//! the one it means: the `[nats]` section of the agent's and the collector's config
//! files, over which the `KVSCOPE_NATS_*` variables apply.
//!
//! ```toml
//! [nats]
//! user = "kvscope-agent-node-1"          # with a password (KVSCOPE_NATS_PASSWORD or password_file)
//! password_file = "/var/run/secrets/kvscope/nats-password"
//! # token_file = "/var/run/secrets/kvscope/nats-token"
//! # nkey_seed_file = "/var/run/secrets/kvscope/agent.nk"
//! # creds_file = "/var/run/secrets/kvscope/agent.creds"   # a JWT and its seed (nsc)
//! tls_ca_file = "/var/run/secrets/kvscope/ca.pem"         # the CA that signed the server's certificate
//! # tls_cert_file = "/var/run/secrets/kvscope/client.pem"  # a client certificate, for servers that verify one
//! # tls_key_file = "/var/run/secrets/kvscope/client-key.pem"
//! tls_required = true                    # never speak to the server in clear
//! ```
//!
//! One way of authenticating at a time: user and password, a token, an nkey seed, or a
//! creds file. Secrets never come from the file itself: a password or token is given by
//! its variable or read from the file named (a Kubernetes secret mounted as a file).
//!
//! Dynamo's own processes read `NATS_AUTH_USERNAME`/`NATS_AUTH_PASSWORD`,
//! `NATS_AUTH_TOKEN`, `NATS_AUTH_NKEY` (the seed itself) and
//! `NATS_AUTH_CREDENTIALS_FILE`; [`NatsSecurity::from_dynamo_env`] reads the same, for
//! the agent's tap of Dynamo's event plane.

use kvscope_kit::config::{Env, EnvError};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// A secret that never shows in `Debug` output or a serialized config.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsSecurity {
    /// User name, with a password. Env: `KVSCOPE_NATS_USER`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// A file holding the user's password. Env: `KVSCOPE_NATS_PASSWORD_FILE`, or the
    /// password itself in `KVSCOPE_NATS_PASSWORD`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
    /// A file holding the server's token. Env: `KVSCOPE_NATS_TOKEN_FILE`, or the token
    /// itself in `KVSCOPE_NATS_TOKEN`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// A file holding an nkey seed (`SU…`). Env: `KVSCOPE_NATS_NKEY_SEED_FILE`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nkey_seed_file: Option<PathBuf>,
    /// A creds file: a user JWT and its nkey seed. Env: `KVSCOPE_NATS_CREDS`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub creds_file: Option<PathBuf>,
    /// PEM certificates of the CA(s) that signed the server's certificate, trusted
    /// instead of the system's. Env: `KVSCOPE_NATS_TLS_CA`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca_file: Option<PathBuf>,
    /// This process's certificate (PEM), for a server that verifies its clients; with
    /// `tls_key_file`. Env: `KVSCOPE_NATS_TLS_CERT`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<PathBuf>,
    /// The key of `tls_cert_file` (PEM). Env: `KVSCOPE_NATS_TLS_KEY`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<PathBuf>,
    /// Refuse a server that does not offer TLS (default: TLS when the server asks for
    /// it, or the URL is `tls://`). Env: `KVSCOPE_NATS_TLS_REQUIRED` (`1`/`true`).
    pub tls_required: bool,
    /// From `KVSCOPE_NATS_PASSWORD` only.
    #[serde(skip)]
    pub password: Option<Secret>,
    /// From `KVSCOPE_NATS_TOKEN` only.
    #[serde(skip)]
    pub token: Option<Secret>,
    /// From Dynamo's `NATS_AUTH_NKEY` only: the seed itself.
    #[serde(skip)]
    pub nkey_seed: Option<Secret>,
}

#[derive(Debug, thiserror::Error)]
pub enum NatsSecurityError {
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error("NATS authentication: give one of user and password, a token, an nkey seed or a creds file, not {0}")]
    SeveralMethods(String),
    #[error("NATS authentication: user {0:?} has no password (KVSCOPE_NATS_PASSWORD or nats.password_file)")]
    NoPassword(String),
    #[error("NATS authentication: a password without a user (KVSCOPE_NATS_USER or nats.user)")]
    NoUser,
    #[error("NATS TLS: a client certificate needs its key and a key its certificate (nats.tls_cert_file and nats.tls_key_file)")]
    HalfClientCertificate,
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} {path} is empty")]
    Empty { what: &'static str, path: PathBuf },
}

/// The variables read by [`NatsSecurity::apply_env`], for `--help` texts.
pub const HELP: &str = "NATS security (the [nats] config section, or): KVSCOPE_NATS_USER with \
KVSCOPE_NATS_PASSWORD or KVSCOPE_NATS_PASSWORD_FILE; KVSCOPE_NATS_TOKEN or \
KVSCOPE_NATS_TOKEN_FILE; KVSCOPE_NATS_NKEY_SEED_FILE; KVSCOPE_NATS_CREDS; \
KVSCOPE_NATS_TLS_CA, KVSCOPE_NATS_TLS_CERT, KVSCOPE_NATS_TLS_KEY, KVSCOPE_NATS_TLS_REQUIRED.";

impl NatsSecurity {
    /// Apply the `KVSCOPE_NATS_*` variables, read through `var`.
    pub fn apply_env(
        &mut self,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<(), NatsSecurityError> {
        let env = Env::new(&var);
        let path = |k: &str| env.trimmed(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        if let Some(v) = env.trimmed("KVSCOPE_NATS_USER").filter(|v| !v.is_empty()) {
            self.user = Some(v);
        }
        if let Some(v) = env.get("KVSCOPE_NATS_PASSWORD").filter(|v| !v.is_empty()) {
            self.password = Some(Secret(v));
        }
        if let Some(v) = env.get("KVSCOPE_NATS_TOKEN").filter(|v| !v.is_empty()) {
            self.token = Some(Secret(v));
        }
        let files = [
            ("KVSCOPE_NATS_PASSWORD_FILE", &mut self.password_file),
            ("KVSCOPE_NATS_TOKEN_FILE", &mut self.token_file),
            ("KVSCOPE_NATS_NKEY_SEED_FILE", &mut self.nkey_seed_file),
            ("KVSCOPE_NATS_CREDS", &mut self.creds_file),
            ("KVSCOPE_NATS_TLS_CA", &mut self.tls_ca_file),
            ("KVSCOPE_NATS_TLS_CERT", &mut self.tls_cert_file),
            ("KVSCOPE_NATS_TLS_KEY", &mut self.tls_key_file),
        ];
        for (key, field) in files {
            if let Some(p) = path(key) {
                *field = Some(p);
            }
        }
        if let Some(v) = env.flag("KVSCOPE_NATS_TLS_REQUIRED") {
            self.tls_required = v;
        }
        self.validate()
    }

    /// What Dynamo's own processes would use, from Dynamo's variables: for a tap of
    /// Dynamo's NATS, which need not be kvscope's bus. Dynamo tries user and password,
    /// then a token, an nkey, a creds file, in that order; so does this.
    pub fn from_dynamo_env(var: impl Fn(&str) -> Option<String>) -> Self {
        let get = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let mut s = Self::default();
        if let (Some(user), Some(pass)) = (get("NATS_AUTH_USERNAME"), get("NATS_AUTH_PASSWORD")) {
            s.user = Some(user);
            s.password = Some(Secret(pass));
        } else if let Some(t) = get("NATS_AUTH_TOKEN") {
            s.token = Some(Secret(t));
        } else if let Some(n) = get("NATS_AUTH_NKEY") {
            s.nkey_seed = Some(Secret(n.trim().to_string()));
        } else if let Some(p) = get("NATS_AUTH_CREDENTIALS_FILE") {
            s.creds_file = Some(p.into());
        }
        s
    }

    /// Whether any authentication is configured.
    pub fn authenticates(&self) -> bool {
        !self.methods().is_empty()
    }

    fn methods(&self) -> Vec<&'static str> {
        let mut m = Vec::new();
        if self.user.is_some() || self.password.is_some() || self.password_file.is_some() {
            m.push("user and password");
        }
        if self.token.is_some() || self.token_file.is_some() {
            m.push("a token");
        }
        if self.nkey_seed.is_some() || self.nkey_seed_file.is_some() {
            m.push("an nkey seed");
        }
        if self.creds_file.is_some() {
            m.push("a creds file");
        }
        m
    }

    /// Check that the settings make one way of authenticating and whole TLS settings.
    pub fn validate(&self) -> Result<(), NatsSecurityError> {
        let methods = self.methods();
        if methods.len() > 1 {
            return Err(NatsSecurityError::SeveralMethods(methods.join(" and ")));
        }
        let has_password = self.password.is_some() || self.password_file.is_some();
        match (&self.user, has_password) {
            (Some(u), false) => return Err(NatsSecurityError::NoPassword(u.clone())),
            (None, true) => return Err(NatsSecurityError::NoUser),
            _ => {}
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return Err(NatsSecurityError::HalfClientCertificate);
        }
        Ok(())
    }

    /// A short description for logs, without secrets: `user kvscope-agent-x, TLS (CA ca.pem)`.
    pub fn describe(&self) -> String {
        let auth = match (&self.user, self.methods().first()) {
            (Some(u), _) => format!("user {u}"),
            (None, Some(m)) => (*m).to_string(),
            (None, None) => "no authentication".into(),
        };
        let tls = match (&self.tls_ca_file, self.tls_required) {
            (Some(ca), _) => format!(", TLS (CA {})", ca.display()),
            (None, true) => ", TLS".into(),
            (None, false) => String::new(),
        };
        format!("{auth}{tls}")
    }
}

#[cfg(feature = "jetstream")]
fn read_secret(what: &'static str, path: &std::path::Path) -> Result<String, NatsSecurityError> {
    let text = std::fs::read_to_string(path).map_err(|source| NatsSecurityError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    // A secret mounted from a file usually ends in a newline that is not part of it.
    let text = text.trim().to_string();
    if text.is_empty() {
        return Err(NatsSecurityError::Empty {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(text)
}

/// The servers of a NATS URL setting: one URL, or several separated by commas (a
/// cluster's members, as the NATS tools take them). A daemon connects to any of them and
/// reconnects to any (and to the members the servers announce).
pub fn server_urls(setting: &str) -> Vec<&str> {
    setting
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

#[cfg(feature = "jetstream")]
impl NatsSecurity {
    /// Connect options carrying these settings; `inbox_prefix` (see
    /// [`crate::Subjects::inbox_prefix`]) is where replies to this process go, so a
    /// server's permissions can let each process read its own replies only.
    pub async fn connect_options(
        &self,
        inbox_prefix: Option<&str>,
    ) -> Result<async_nats::ConnectOptions, NatsSecurityError> {
        self.validate()?;
        let mut o = async_nats::ConnectOptions::new();
        if let Some(user) = &self.user {
            let pass = match (&self.password, &self.password_file) {
                (Some(p), _) => p.expose().to_string(),
                (None, Some(f)) => read_secret("the NATS password file", f)?,
                (None, None) => return Err(NatsSecurityError::NoPassword(user.clone())),
            };
            o = o.user_and_password(user.clone(), pass);
        } else if let Some(t) = &self.token {
            o = o.token(t.expose().to_string());
        } else if let Some(f) = &self.token_file {
            o = o.token(read_secret("the NATS token file", f)?);
        } else if let Some(seed) = &self.nkey_seed {
            o = o.nkey(seed.expose().to_string());
        } else if let Some(f) = &self.nkey_seed_file {
            o = o.nkey(read_secret("the NATS nkey seed file", f)?);
        } else if let Some(f) = &self.creds_file {
            o = o
                .credentials_file(f)
                .await
                .map_err(|source| NatsSecurityError::Read {
                    what: "the NATS creds file",
                    path: f.clone(),
                    source,
                })?;
        }
        if let Some(ca) = &self.tls_ca_file {
            // async-nats reads it only when it connects; read it here so a wrong path is
            // an error at start, not a connection retried for ever.
            read_secret("the NATS TLS CA file", ca)?;
            o = o.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert_file, &self.tls_key_file) {
            read_secret("the NATS TLS certificate", cert)?;
            read_secret("the NATS TLS key", key)?;
            o = o.add_client_certificate(cert.clone(), key.clone());
        }
        if self.tls_required {
            o = o.require_tls(true);
        }
        if let Some(p) = inbox_prefix {
            o = o.custom_inbox_prefix(p);
        }
        Ok(o)
    }
}

/// Whether a failed connection was the server refusing these credentials (as opposed
/// to a server not reachable), so it can be reported as such.
#[cfg(feature = "jetstream")]
pub fn refused_connection(e: &async_nats::ConnectError) -> bool {
    matches!(
        e.kind(),
        async_nats::ConnectErrorKind::AuthorizationViolation
            | async_nats::ConnectErrorKind::Authentication
    )
}

/// The server's refusal an event of a live connection reports: an authorization
/// violation, or a permissions violation (a subject this user may not publish to or
/// subscribe to); `None` for every other event.
#[cfg(feature = "jetstream")]
pub fn refusal(event: &async_nats::Event) -> Option<String> {
    match event {
        async_nats::Event::ServerError(async_nats::ServerError::AuthorizationViolation) => {
            Some("authorization violation".into())
        }
        async_nats::Event::ServerError(async_nats::ServerError::Other(e))
            if e.to_lowercase().contains("permissions violation") =>
        {
            Some(e.clone())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_setting_names_one_server_or_several() {
        assert_eq!(server_urls("nats://a:4222"), ["nats://a:4222"]);
        assert_eq!(
            server_urls(" nats://a:4222, nats://b:4222,,tls://c:4222 "),
            ["nats://a:4222", "nats://b:4222", "tls://c:4222"]
        );
        assert!(server_urls(" , ").is_empty());
    }
    use std::collections::HashMap;
    use std::path::Path;

    fn vars(v: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = v
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn variables_set_one_method_and_secrets_never_show() {
        let mut s = NatsSecurity::default();
        s.apply_env(vars(&[
            ("KVSCOPE_NATS_USER", "agent-1"),
            ("KVSCOPE_NATS_PASSWORD", "hunter2"),
            ("KVSCOPE_NATS_TLS_CA", "/ca.pem"),
            ("KVSCOPE_NATS_TLS_REQUIRED", "1"),
        ]))
        .unwrap();
        assert_eq!(s.user.as_deref(), Some("agent-1"));
        assert_eq!(s.tls_ca_file.as_deref(), Some(Path::new("/ca.pem")));
        assert!(s.tls_required && s.authenticates());
        assert!(!format!("{s:?}").contains("hunter2"));
        assert!(!serde_json::to_string(&s).unwrap().contains("hunter2"));
        assert_eq!(s.describe(), "user agent-1, TLS (CA /ca.pem)");
    }

    #[test]
    fn contradictions_are_refused_with_what_to_fix() {
        let two = NatsSecurity::default()
            .apply_env(vars(&[
                ("KVSCOPE_NATS_TOKEN", "t"),
                ("KVSCOPE_NATS_CREDS", "/a.creds"),
            ]))
            .unwrap_err();
        assert!(
            two.to_string().contains("a token and a creds file"),
            "{two}"
        );
        let nopass = NatsSecurity::default()
            .apply_env(vars(&[("KVSCOPE_NATS_USER", "u")]))
            .unwrap_err();
        assert!(
            nopass.to_string().contains("KVSCOPE_NATS_PASSWORD"),
            "{nopass}"
        );
        let half = NatsSecurity::default()
            .apply_env(vars(&[("KVSCOPE_NATS_TLS_CERT", "/c.pem")]))
            .unwrap_err();
        assert!(matches!(half, NatsSecurityError::HalfClientCertificate));
    }

    #[test]
    fn dynamos_variables_in_dynamos_order() {
        let s = NatsSecurity::from_dynamo_env(vars(&[
            ("NATS_AUTH_USERNAME", "dyn"),
            ("NATS_AUTH_PASSWORD", "pw"),
            ("NATS_AUTH_TOKEN", "ignored"),
        ]));
        assert_eq!(s.user.as_deref(), Some("dyn"));
        assert!(s.token.is_none());
        s.validate().unwrap();
        let n = NatsSecurity::from_dynamo_env(vars(&[("NATS_AUTH_NKEY", " SUAX ")]));
        assert_eq!(n.nkey_seed.as_ref().map(Secret::expose), Some("SUAX"));
        assert!(!NatsSecurity::from_dynamo_env(vars(&[])).authenticates());
    }

    #[cfg(feature = "jetstream")]
    #[test]
    fn secrets_from_files_are_read_trimmed_and_an_empty_one_is_an_error() {
        let dir = std::env::temp_dir().join(format!("kvscope-nats-sec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("pw");
        std::fs::write(&good, "s3cret\n").unwrap();
        assert_eq!(read_secret("x", &good).unwrap(), "s3cret");
        let empty = dir.join("empty");
        std::fs::write(&empty, "\n").unwrap();
        assert!(matches!(
            read_secret("x", &empty),
            Err(NatsSecurityError::Empty { .. })
        ));
        let missing = NatsSecurity {
            tls_ca_file: Some(dir.join("nope.pem")),
            ..Default::default()
        };
        let rt = tokio_rt();
        let e = rt.block_on(missing.connect_options(None)).unwrap_err();
        assert!(e.to_string().contains("nope.pem"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[cfg(feature = "jetstream")]
    fn tokio_rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }
}
