//! Where to find Dynamo's discovery store: the `[discovery]` section of the agent's
//! config, over which Dynamo's own variables apply, so a kvscope process given the
//! fleet's environment finds what Dynamo finds.
//!
//! ```toml
//! [discovery]
//! backend = "etcd"                          # file | etcd | kubernetes | none (DYN_DISCOVERY_BACKEND)
//! file_root = "/var/run/dynamo/discovery"   # the file backend's root (DYN_FILE_KV)
//! etcd_endpoints = ["http://127.0.0.1:2379"]  # (ETCD_ENDPOINTS, comma-separated)
//! poll_interval_secs = 1.0
//! # kubernetes: in a pod all of these come from the service account and the pod's
//! # environment (KUBERNETES_SERVICE_HOST/PORT, POD_NAMESPACE)
//! # kube_server = "https://10.96.0.1:443"
//! # kube_namespace = "dynamo"
//! # kube_token_file = "/var/run/secrets/kubernetes.io/serviceaccount/token"
//! # kube_ca_file = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
//! ```
//!
//! etcd credentials come only from `ETCD_AUTH_USERNAME` / `ETCD_AUTH_PASSWORD` and its
//! TLS files from `ETCD_AUTH_CA` / `ETCD_AUTH_CLIENT_CERT` / `ETCD_AUTH_CLIENT_KEY`, as
//! Dynamo reads them, never from the file.

use crate::backend::Backend;
use kvscope_kit::config::{Env, EnvError};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Which store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// No discovery: workers only as configured by hand (`--kv ENDPOINT=WORKER_ID`).
    #[default]
    None,
    File,
    Etcd,
    /// Dynamo's `kubernetes` backend, read from the API server (in a pod).
    Kubernetes,
}

impl std::str::FromStr for BackendKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" | "none" => Ok(Self::None),
            "file" => Ok(Self::File),
            "etcd" => Ok(Self::Etcd),
            "kubernetes" => Ok(Self::Kubernetes),
            "mem" => Err("the mem backend lives inside one Dynamo process and cannot be read from outside it".into()),
            other => Err(format!("unknown discovery backend {other:?} (expected file, etcd, kubernetes or none)")),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// The store (default none). Env: `DYN_DISCOVERY_BACKEND`.
    pub backend: BackendKind,
    /// The file backend's root folder. Env: `DYN_FILE_KV`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file_root: Option<PathBuf>,
    /// etcd endpoints, tried in order (default `http://localhost:2379`, as Dynamo's).
    /// Env: `ETCD_ENDPOINTS`, comma-separated.
    pub etcd_endpoints: Vec<String>,
    /// Seconds between reads of the store (default 1).
    pub poll_interval_secs: f64,
    /// The Kubernetes API server (default: in a pod, `KUBERNETES_SERVICE_HOST`/`_PORT`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kube_server: Option<String>,
    /// The namespace whose workers to read (default `POD_NAMESPACE`, Dynamo's
    /// `/etc/podinfo/pod_namespace`, the service account's). Env: `POD_NAMESPACE`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kube_namespace: Option<String>,
    /// The bearer token, read again on every poll (default the service account's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kube_token_file: Option<PathBuf>,
    /// The API server's CA (default the service account's `ca.crt`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kube_ca_file: Option<PathBuf>,
    /// From `ETCD_AUTH_USERNAME` / `ETCD_AUTH_PASSWORD` only.
    #[serde(skip)]
    pub etcd_username: Option<String>,
    #[serde(skip)]
    pub etcd_password: Option<String>,
    /// From `ETCD_AUTH_CA`, `ETCD_AUTH_CLIENT_CERT`, `ETCD_AUTH_CLIENT_KEY` only: for
    /// `https://` endpoints.
    #[serde(skip)]
    pub etcd_ca: Option<PathBuf>,
    #[serde(skip)]
    pub etcd_client_cert: Option<PathBuf>,
    #[serde(skip)]
    pub etcd_client_key: Option<PathBuf>,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            backend: BackendKind::None,
            file_root: None,
            etcd_endpoints: vec!["http://localhost:2379".into()],
            poll_interval_secs: 1.0,
            kube_server: None,
            kube_namespace: None,
            kube_token_file: None,
            kube_ca_file: None,
            etcd_username: None,
            etcd_password: None,
            etcd_ca: None,
            etcd_client_cert: None,
            etcd_client_key: None,
        }
    }
}

impl DiscoveryConfig {
    /// Apply Dynamo's variables, read through `var`.
    pub fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> Result<(), EnvError> {
        let env = Env::new(&var);
        if let Some(v) = env.parse("DYN_DISCOVERY_BACKEND")? {
            self.backend = v;
        }
        if let Some(v) = env.trimmed("DYN_FILE_KV").filter(|v| !v.is_empty()) {
            self.file_root = Some(v.into());
        }
        if let Some(v) = env.list::<String>("ETCD_ENDPOINTS")? {
            if !v.is_empty() {
                self.etcd_endpoints = v;
            }
        }
        if self.kube_server.is_none() {
            self.kube_server = crate::kubernetes::in_cluster_server(&var);
        }
        if let Some(ns) = env.trimmed("POD_NAMESPACE").filter(|v| !v.is_empty()) {
            self.kube_namespace = Some(ns);
        }
        self.etcd_username = env.get("ETCD_AUTH_USERNAME").filter(|v| !v.is_empty());
        self.etcd_password = env.get("ETCD_AUTH_PASSWORD");
        let path = |k: &str| env.trimmed(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        self.etcd_ca = path("ETCD_AUTH_CA");
        self.etcd_client_cert = path("ETCD_AUTH_CLIENT_CERT");
        self.etcd_client_key = path("ETCD_AUTH_CLIENT_KEY");
        Ok(())
    }

    /// The backend to read, or `None` without discovery; an error names what is missing.
    pub fn backend(&self) -> Result<Option<Backend>, String> {
        match self.backend {
            BackendKind::None => Ok(None),
            BackendKind::File => match &self.file_root {
                Some(root) => Ok(Some(Backend::File { root: root.clone() })),
                None => Err(
                    "file discovery needs its root folder: DYN_FILE_KV or discovery.file_root"
                        .into(),
                ),
            },
            BackendKind::Etcd => {
                if self.etcd_endpoints.is_empty() {
                    return Err("etcd discovery needs an endpoint: ETCD_ENDPOINTS or discovery.etcd_endpoints".into());
                }
                let client = match (&self.etcd_client_cert, &self.etcd_client_key) {
                    (Some(c), Some(k)) => Some((c.clone(), k.clone())),
                    (None, None) => None,
                    _ => return Err("etcd's mutual TLS needs both ETCD_AUTH_CLIENT_CERT and ETCD_AUTH_CLIENT_KEY".into()),
                };
                Ok(Some(Backend::Etcd {
                    endpoints: self.etcd_endpoints.clone(),
                    username: self.etcd_username.clone(),
                    password: self.etcd_password.clone(),
                    tls: self
                        .etcd_ca
                        .clone()
                        .map(|ca| crate::backend::EtcdTls { ca, client }),
                }))
            }
            BackendKind::Kubernetes => {
                let sa = std::path::Path::new(crate::kubernetes::SERVICE_ACCOUNT_DIR);
                let server = self.kube_server.clone().ok_or(
                    "kubernetes discovery needs the API server: run in a pod (KUBERNETES_SERVICE_HOST) or set discovery.kube_server",
                )?;
                let namespace = self
                    .kube_namespace
                    .clone()
                    .or_else(|| crate::kubernetes::default_namespace(|_| None))
                    .ok_or("kubernetes discovery needs the workers' namespace: POD_NAMESPACE or discovery.kube_namespace")?;
                Ok(Some(Backend::Kubernetes(crate::kubernetes::KubeApi {
                    server,
                    namespace,
                    token_file: self
                        .kube_token_file
                        .clone()
                        .unwrap_or_else(|| sa.join("token")),
                    ca_file: self
                        .kube_ca_file
                        .clone()
                        .unwrap_or_else(|| sa.join("ca.crt")),
                })))
            }
        }
    }

    pub fn poll_interval(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.poll_interval_secs.clamp(0.05, 3600.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamos_variables_choose_the_backend() {
        let mut c = DiscoveryConfig::default();
        assert_eq!(c.backend(), Ok(None));
        c.apply_env(|k| match k {
            "DYN_DISCOVERY_BACKEND" => Some("etcd".into()),
            "ETCD_ENDPOINTS" => Some("http://127.0.0.1:2379, http://127.0.0.1:2380".into()),
            "ETCD_AUTH_USERNAME" => Some("root".into()),
            "ETCD_AUTH_PASSWORD" => Some("pw".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(
            c.backend().unwrap(),
            Some(Backend::Etcd {
                endpoints: vec![
                    "http://127.0.0.1:2379".into(),
                    "http://127.0.0.1:2380".into()
                ],
                username: Some("root".into()),
                password: Some("pw".into()),
                tls: None,
            })
        );
        let mut f = DiscoveryConfig::default();
        f.apply_env(|k| (k == "DYN_DISCOVERY_BACKEND").then(|| "file".into()))
            .unwrap();
        assert!(f.backend().unwrap_err().contains("DYN_FILE_KV"));
        f.apply_env(|k| match k {
            "DYN_DISCOVERY_BACKEND" => Some("file".into()),
            "DYN_FILE_KV" => Some("/d".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(
            f.backend().unwrap(),
            Some(Backend::File { root: "/d".into() })
        );
        let mut k = DiscoveryConfig::default();
        k.apply_env(|k| (k == "DYN_DISCOVERY_BACKEND").then(|| "kubernetes".into()))
            .unwrap();
        assert!(k.backend().unwrap_err().contains("KUBERNETES_SERVICE_HOST"));
        k.apply_env(|k| match k {
            "DYN_DISCOVERY_BACKEND" => Some("kubernetes".into()),
            "KUBERNETES_SERVICE_HOST" => Some("10.0.0.1".into()),
            "POD_NAMESPACE" => Some("dynamo".into()),
            _ => None,
        })
        .unwrap();
        let Some(Backend::Kubernetes(api)) = k.backend().unwrap() else {
            panic!("the kubernetes backend");
        };
        assert_eq!(api.server, "https://10.0.0.1:443");
        assert_eq!(api.namespace, "dynamo");
        assert!(api.token_file.ends_with("serviceaccount/token"));
    }

    #[test]
    fn the_section_parses_and_secrets_never_serialize() {
        let c: DiscoveryConfig =
            toml_like(r#"{"backend":"file","file_root":"/x","poll_interval_secs":0.5}"#);
        assert_eq!(c.backend, BackendKind::File);
        let mut c = c;
        c.etcd_password = Some("secret".into());
        assert!(!serde_json::to_string(&c).unwrap().contains("secret"));
    }

    fn toml_like(json: &str) -> DiscoveryConfig {
        serde_json::from_str(json).unwrap()
    }
}
