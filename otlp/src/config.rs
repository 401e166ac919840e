//! The `[otlp]` section of the agent's and the collector's config files, and the
//! standard `OTEL_*` environment variables that override it.
//!
//! ```toml
//! [otlp]
//! endpoint = "http://127.0.0.1:4317"   # unset: no export (the default)
//! protocol = "grpc"                    # or "http/protobuf" (then e.g. :4318)
//! headers = { authorization = "Bearer …" }
//! timeout_secs = 10.0
//! export_interval_secs = 15.0
//! service_name = "kvscope-agent"       # default: kvscope-agent / kvscope-collector
//! resource_attributes = { "deployment.environment.name" = "prod" }
//! max_spans_per_second = 1000
//! max_queued_spans = 8192
//!
//! certificate = "/etc/ssl/certs/ca-certificates.crt"  # whom https:// trusts (the default)
//! # client_certificate = "client.crt"  # mutual TLS, with client_key
//! # client_key = "client.key"
//! compression = "gzip"                 # or "none" (the default)
//!
//! [otlp.traces]                        # per-signal overrides (also [otlp.metrics])
//! endpoint = "http://127.0.0.1:4318/v1/traces"
//! protocol = "http/protobuf"
//! enabled = true
//! ```

use kvscope_kit::config::Env;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Whom `https://` endpoints are checked against when no `certificate` is given: the
/// system's CA bundle (Debian's; the image carries it too).
pub(crate) const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// TLS settings an https:// endpoint is reached with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The CA certificates (PEM) the receiver's certificate must chain to.
    pub ca: PathBuf,
    /// A client certificate chain and key (PEM) for mutual TLS.
    pub client: Option<(PathBuf, PathBuf)>,
}

/// How export bodies are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    #[default]
    None,
    Gzip,
}

impl std::str::FromStr for Compression {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "none" | "" => Ok(Self::None),
            "gzip" => Ok(Self::Gzip),
            other => Err(ConfigError::Compression(other.to_string())),
        }
    }
}

/// Wire protocol of an OTLP endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Protocol {
    /// OTLP/gRPC (port 4317 by convention).
    #[default]
    #[serde(rename = "grpc")]
    Grpc,
    /// OTLP/HTTP with protobuf bodies (port 4318 by convention).
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

impl std::str::FromStr for Protocol {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "grpc" => Ok(Self::Grpc),
            "http/protobuf" => Ok(Self::HttpProtobuf),
            other => Err(ConfigError::Protocol(other.to_string())),
        }
    }
}

/// The two signals kvscope exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Metrics,
    Traces,
}

impl Signal {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Metrics => "metrics",
            Self::Traces => "traces",
        }
    }
}

/// What can be wrong in the OTLP settings.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("unknown OTLP protocol {0:?}: use \"grpc\" or \"http/protobuf\"")]
    Protocol(String),
    #[error("{key}={value:?} is not a number of {unit}")]
    Number {
        key: String,
        value: String,
        unit: &'static str,
    },
    #[error("{key} has {item:?}, which is not key=value (comma-separated list)")]
    KeyValue { key: String, item: String },
    #[error("otlp.{field} must be > 0")]
    NotPositive { field: &'static str },
    #[error("OTLP endpoint {0:?} must start with http:// or https://")]
    Endpoint(String),
    #[error("otlp: client_certificate and client_key go together (mutual TLS needs both)")]
    ClientIdentity,
    #[error("unknown OTLP compression {0:?}: use \"gzip\" or \"none\"")]
    Compression(String),
}

/// Per-signal overrides (`[otlp.metrics]`, `[otlp.traces]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SignalConfig {
    /// Export this signal when an endpoint is set (default true).
    /// Env: `OTEL_METRICS_EXPORTER=none` / `OTEL_TRACES_EXPORTER=none` turn it off.
    pub enabled: bool,
    /// The signal's own endpoint, used as is (for HTTP: the full URL, with its
    /// `/v1/metrics` or `/v1/traces` path). Env: `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`,
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`.
    pub endpoint: Option<String>,
    /// Protocol for this signal (default: `otlp.protocol`). Env:
    /// `OTEL_EXPORTER_OTLP_{METRICS,TRACES}_PROTOCOL`.
    pub protocol: Option<Protocol>,
    /// Extra headers for this signal, on top of `otlp.headers`. Env:
    /// `OTEL_EXPORTER_OTLP_{METRICS,TRACES}_HEADERS`.
    pub headers: BTreeMap<String, String>,
    /// Timeout of one export of this signal (default: `otlp.timeout_secs`). Env:
    /// `OTEL_EXPORTER_OTLP_{METRICS,TRACES}_TIMEOUT` (milliseconds).
    pub timeout_secs: Option<f64>,
    /// TLS overrides for this signal (default: `otlp`'s). Env:
    /// `OTEL_EXPORTER_OTLP_{METRICS,TRACES}_{CERTIFICATE,CLIENT_CERTIFICATE,CLIENT_KEY,INSECURE}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_certificate: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub insecure: Option<bool>,
    /// Compression for this signal (default: `otlp.compression`). Env:
    /// `OTEL_EXPORTER_OTLP_{METRICS,TRACES}_COMPRESSION`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<Compression>,
}

impl Default for SignalConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            endpoint: None,
            protocol: None,
            headers: BTreeMap::new(),
            timeout_secs: None,
            certificate: None,
            client_certificate: None,
            client_key: None,
            insecure: None,
            compression: None,
        }
    }
}

/// OTLP export settings. Export is off unless an endpoint is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OtlpConfig {
    /// Base endpoint of the OTLP receiver (default none: no export). gRPC: used as is
    /// (`http://host:4317`); HTTP: `/v1/metrics` and `/v1/traces` are appended
    /// (`http://host:4318`). Env: `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub endpoint: Option<String>,
    /// `grpc` (default) or `http/protobuf`. Env: `OTEL_EXPORTER_OTLP_PROTOCOL`.
    pub protocol: Protocol,
    /// Headers sent with every export, e.g. an authorization token (default none).
    /// Env: `OTEL_EXPORTER_OTLP_HEADERS` (`k1=v1,k2=v2`).
    pub headers: BTreeMap<String, String>,
    /// Timeout of one export, in seconds (default 10). Env: `OTEL_EXPORTER_OTLP_TIMEOUT`
    /// (milliseconds, as the OTel spec says).
    pub timeout_secs: f64,
    /// Seconds between metric exports (default 15, Prometheus' usual scrape interval).
    /// Env: `OTEL_METRIC_EXPORT_INTERVAL` (milliseconds).
    pub export_interval_secs: f64,
    /// `service.name` (default `kvscope-agent` / `kvscope-collector`).
    /// Env: `OTEL_SERVICE_NAME`.
    pub service_name: Option<String>,
    /// Extra resource attributes (default none). Env: `OTEL_RESOURCE_ATTRIBUTES`
    /// (`k1=v1,k2=v2`).
    pub resource_attributes: BTreeMap<String, String>,
    /// Spans accepted per second; beyond it spans are dropped and counted (default
    /// 1000). NIXL transfers at lab rates reach tens of thousands per second: their
    /// figures stay exact in the metrics, the spans are a bounded sample.
    pub max_spans_per_second: u32,
    /// Spans waiting for export; beyond it new spans are dropped and counted (default
    /// 8192), so a receiver that is down costs bounded memory.
    pub max_queued_spans: usize,
    /// CA certificates (PEM) an `https://` receiver's certificate must chain to
    /// (default: the system bundle, [`SYSTEM_CA_BUNDLE`]). Env:
    /// `OTEL_EXPORTER_OTLP_CERTIFICATE`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<PathBuf>,
    /// Client certificate chain (PEM) for mutual TLS, with `client_key`. Env:
    /// `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_certificate: Option<PathBuf>,
    /// The client certificate's private key (PEM). Env: `OTEL_EXPORTER_OTLP_CLIENT_KEY`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key: Option<PathBuf>,
    /// A gRPC endpoint given without a scheme (`host:4317`) is reached over plain
    /// `http://` when true, else over `https://` (default false). Env:
    /// `OTEL_EXPORTER_OTLP_INSECURE`.
    pub insecure: bool,
    /// `gzip` compresses every export body (default `none`). Env:
    /// `OTEL_EXPORTER_OTLP_COMPRESSION`.
    pub compression: Compression,
    /// Metrics overrides.
    pub metrics: SignalConfig,
    /// Traces overrides.
    pub traces: SignalConfig,
}

impl Default for OtlpConfig {
    fn default() -> Self {
        Self {
            endpoint: None,
            protocol: Protocol::Grpc,
            headers: BTreeMap::new(),
            timeout_secs: 10.0,
            export_interval_secs: 15.0,
            service_name: None,
            resource_attributes: BTreeMap::new(),
            max_spans_per_second: 1000,
            max_queued_spans: 8192,
            certificate: None,
            client_certificate: None,
            client_key: None,
            insecure: false,
            compression: Compression::None,
            metrics: SignalConfig::default(),
            traces: SignalConfig::default(),
        }
    }
}

/// Where and how one signal goes.
#[derive(Debug, Clone, PartialEq)]
pub struct SignalTarget {
    pub signal: Signal,
    /// gRPC: the server URL; HTTP: the full URL to POST to.
    pub url: String,
    pub protocol: Protocol,
    pub headers: BTreeMap<String, String>,
    pub timeout: Duration,
    /// For an `https://` url: whom to trust, who to be.
    pub tls: Option<TlsFiles>,
    pub compression: Compression,
}

fn millis(key: &str, v: &str) -> Result<f64, ConfigError> {
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|n| n.is_finite() && *n >= 0.0)
        .map(|n| n / 1000.0)
        .ok_or_else(|| ConfigError::Number {
            key: key.into(),
            value: v.into(),
            unit: "milliseconds",
        })
}

/// `k1=v1,k2=v2` with percent-encoded values (the W3C Baggage form the OTel spec uses
/// for `OTEL_EXPORTER_OTLP_HEADERS` and `OTEL_RESOURCE_ATTRIBUTES`).
pub(crate) fn parse_key_values(
    key: &str,
    v: &str,
) -> Result<BTreeMap<String, String>, ConfigError> {
    let mut out = BTreeMap::new();
    for item in v.split(',').filter(|s| !s.trim().is_empty()) {
        let (k, val) = item
            .split_once('=')
            .filter(|(k, _)| !k.trim().is_empty())
            .ok_or_else(|| ConfigError::KeyValue {
                key: key.into(),
                item: item.into(),
            })?;
        out.insert(k.trim().to_string(), percent_decode(val.trim()));
    }
    Ok(out)
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl OtlpConfig {
    /// Apply the standard `OTEL_*` variables read through `var` (they win over the file).
    pub fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        // The OTel spec treats an empty variable as unset.
        let env = Env::new(|k: &str| var(k).filter(|v| !v.trim().is_empty()));
        if env
            .trimmed("OTEL_SDK_DISABLED")
            .is_some_and(|v| v.eq_ignore_ascii_case("true"))
        {
            self.endpoint = None;
            self.metrics.endpoint = None;
            self.traces.endpoint = None;
            return Ok(());
        }
        if let Some(v) = env.trimmed("OTEL_EXPORTER_OTLP_ENDPOINT") {
            self.endpoint = Some(v);
        }
        if let Some(v) = env.get("OTEL_EXPORTER_OTLP_PROTOCOL") {
            self.protocol = v.parse()?;
        }
        if let Some(v) = env.get("OTEL_EXPORTER_OTLP_HEADERS") {
            self.headers
                .extend(parse_key_values("OTEL_EXPORTER_OTLP_HEADERS", &v)?);
        }
        if let Some(v) = env.get("OTEL_EXPORTER_OTLP_TIMEOUT") {
            self.timeout_secs = millis("OTEL_EXPORTER_OTLP_TIMEOUT", &v)?;
        }
        if let Some(v) = env.get("OTEL_METRIC_EXPORT_INTERVAL") {
            self.export_interval_secs = millis("OTEL_METRIC_EXPORT_INTERVAL", &v)?;
        }
        if let Some(v) = env.trimmed("OTEL_SERVICE_NAME") {
            self.service_name = Some(v);
        }
        if let Some(v) = env.trimmed("OTEL_EXPORTER_OTLP_CERTIFICATE") {
            self.certificate = Some(v.into());
        }
        if let Some(v) = env.trimmed("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE") {
            self.client_certificate = Some(v.into());
        }
        if let Some(v) = env.trimmed("OTEL_EXPORTER_OTLP_CLIENT_KEY") {
            self.client_key = Some(v.into());
        }
        if let Some(v) = env.trimmed("OTEL_EXPORTER_OTLP_INSECURE") {
            self.insecure = v.eq_ignore_ascii_case("true");
        }
        if let Some(v) = env.trimmed("OTEL_EXPORTER_OTLP_COMPRESSION") {
            self.compression = v.parse()?;
        }
        if let Some(v) = env.get("OTEL_RESOURCE_ATTRIBUTES") {
            self.resource_attributes
                .extend(parse_key_values("OTEL_RESOURCE_ATTRIBUTES", &v)?);
        }
        for (name, s) in [("METRICS", &mut self.metrics), ("TRACES", &mut self.traces)] {
            let key = |k: &str| format!("OTEL_EXPORTER_OTLP_{name}_{k}");
            if let Some(v) = env.trimmed(&key("ENDPOINT")) {
                s.endpoint = Some(v);
            }
            if let Some(v) = env.get(&key("PROTOCOL")) {
                s.protocol = Some(v.parse()?);
            }
            if let Some(v) = env.get(&key("HEADERS")) {
                s.headers.extend(parse_key_values(&key("HEADERS"), &v)?);
            }
            if let Some(v) = env.get(&key("TIMEOUT")) {
                s.timeout_secs = Some(millis(&key("TIMEOUT"), &v)?);
            }
            if let Some(v) = env.trimmed(&key("CERTIFICATE")) {
                s.certificate = Some(v.into());
            }
            if let Some(v) = env.trimmed(&key("CLIENT_CERTIFICATE")) {
                s.client_certificate = Some(v.into());
            }
            if let Some(v) = env.trimmed(&key("CLIENT_KEY")) {
                s.client_key = Some(v.into());
            }
            if let Some(v) = env.trimmed(&key("INSECURE")) {
                s.insecure = Some(v.eq_ignore_ascii_case("true"));
            }
            if let Some(v) = env.trimmed(&key("COMPRESSION")) {
                s.compression = Some(v.parse()?);
            }
            if let Some(v) = env.get(&format!("OTEL_{name}_EXPORTER")) {
                s.enabled = v.split(',').any(|e| e.trim() == "otlp");
            }
        }
        Ok(())
    }

    /// Reject values export cannot run with.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = |v: f64, field| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(ConfigError::NotPositive { field })
            }
        };
        positive(self.timeout_secs, "timeout_secs")?;
        positive(self.export_interval_secs, "export_interval_secs")?;
        if self.max_queued_spans == 0 {
            return Err(ConfigError::NotPositive {
                field: "max_queued_spans",
            });
        }
        for s in [&self.metrics, &self.traces] {
            if let Some(t) = s.timeout_secs {
                positive(t, "<signal>.timeout_secs")?;
            }
            let cert = s.client_certificate.is_some() || self.client_certificate.is_some();
            let key = s.client_key.is_some() || self.client_key.is_some();
            if cert != key {
                return Err(ConfigError::ClientIdentity);
            }
        }
        for s in [Signal::Metrics, Signal::Traces] {
            if let Some(t) = self.target(s) {
                if !(t.url.starts_with("http://") || t.url.starts_with("https://")) {
                    return Err(ConfigError::Endpoint(t.url));
                }
            }
        }
        Ok(())
    }

    /// Where `signal` goes, or `None` when it is not exported.
    pub fn target(&self, signal: Signal) -> Option<SignalTarget> {
        let s = match signal {
            Signal::Metrics => &self.metrics,
            Signal::Traces => &self.traces,
        };
        if !s.enabled {
            return None;
        }
        let protocol = s.protocol.unwrap_or(self.protocol);
        let url = match (&s.endpoint, &self.endpoint) {
            (Some(own), _) => own.clone(),
            (None, Some(base)) => match protocol {
                Protocol::Grpc => base.clone(),
                Protocol::HttpProtobuf => {
                    format!("{}/v1/{}", base.trim_end_matches('/'), signal.as_str())
                }
            },
            (None, None) => return None,
        };
        // A gRPC endpoint without a scheme: TLS unless told it is insecure (OTel spec).
        let url = if protocol == Protocol::Grpc && !url.contains("://") {
            let plain = s.insecure.unwrap_or(self.insecure);
            format!("{}://{url}", if plain { "http" } else { "https" })
        } else {
            url
        };
        let mut headers = self.headers.clone();
        headers.extend(s.headers.clone());
        let pick = |own: &Option<PathBuf>, base: &Option<PathBuf>| own.clone().or(base.clone());
        let tls = url.starts_with("https://").then(|| TlsFiles {
            ca: pick(&s.certificate, &self.certificate)
                .unwrap_or_else(|| Path::new(SYSTEM_CA_BUNDLE).to_path_buf()),
            client: pick(&s.client_certificate, &self.client_certificate)
                .zip(pick(&s.client_key, &self.client_key)),
        });
        Some(SignalTarget {
            signal,
            url,
            protocol,
            headers,
            timeout: Duration::from_secs_f64(s.timeout_secs.unwrap_or(self.timeout_secs)),
            tls,
            compression: s.compression.unwrap_or(self.compression),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_kit::config::documented_toml_example;

    #[derive(Deserialize)]
    struct Wrapper {
        otlp: OtlpConfig,
    }

    #[test]
    fn off_without_an_endpoint() {
        let c = OtlpConfig::default();
        assert_eq!(c.target(Signal::Metrics), None);
        assert_eq!(c.target(Signal::Traces), None);
        c.validate().unwrap();
    }

    #[test]
    fn the_documented_example_parses() {
        let example = documented_toml_example(include_str!("config.rs")).unwrap();
        let c = toml::from_str::<Wrapper>(&example).unwrap().otlp;
        c.validate().unwrap();
        let m = c.target(Signal::Metrics).unwrap();
        assert_eq!(m.url, "http://127.0.0.1:4317");
        assert_eq!(m.protocol, Protocol::Grpc);
        assert_eq!(m.timeout, Duration::from_secs(10));
        let t = c.target(Signal::Traces).unwrap();
        assert_eq!(t.url, "http://127.0.0.1:4318/v1/traces");
        assert_eq!(t.protocol, Protocol::HttpProtobuf);
        assert!(t.headers["authorization"].starts_with("Bearer"));
    }

    #[test]
    fn unknown_keys_are_refused() {
        assert!(toml::from_str::<Wrapper>("[otlp]\nendpont = \"x\"").is_err());
        assert!(toml::from_str::<Wrapper>("[otlp]\nprotocol = \"http/json\"").is_err());
    }

    #[test]
    fn standard_env_vars_override_the_file() {
        let mut c = OtlpConfig {
            endpoint: Some("http://file:4317".into()),
            ..OtlpConfig::default()
        };
        c.apply_env(|k| {
            Some(
                match k {
                    "OTEL_EXPORTER_OTLP_ENDPOINT" => "http://env:4318/",
                    "OTEL_EXPORTER_OTLP_PROTOCOL" => "http/protobuf",
                    "OTEL_EXPORTER_OTLP_HEADERS" => "api-key=a%20b,x=1",
                    "OTEL_EXPORTER_OTLP_TRACES_HEADERS" => "x=2",
                    "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT" => "2500",
                    "OTEL_METRIC_EXPORT_INTERVAL" => "1000",
                    "OTEL_SERVICE_NAME" => "svc",
                    "OTEL_RESOURCE_ATTRIBUTES" => "k8s.pod.name=p-1",
                    "OTEL_TRACES_EXPORTER" => "otlp",
                    _ => return None,
                }
                .to_string(),
            )
        })
        .unwrap();
        let m = c.target(Signal::Metrics).unwrap();
        assert_eq!(m.url, "http://env:4318/v1/metrics");
        assert_eq!(m.headers["api-key"], "a b");
        assert_eq!(m.headers["x"], "1");
        assert_eq!(m.timeout, Duration::from_millis(2500));
        let t = c.target(Signal::Traces).unwrap();
        assert_eq!(t.url, "http://env:4318/v1/traces");
        assert_eq!(t.headers["x"], "2");
        assert_eq!(c.export_interval_secs, 1.0);
        assert_eq!(c.service_name.as_deref(), Some("svc"));
        assert_eq!(c.resource_attributes["k8s.pod.name"], "p-1");

        c.apply_env(|k| (k == "OTEL_METRICS_EXPORTER").then(|| "none".into()))
            .unwrap();
        assert_eq!(c.target(Signal::Metrics), None);
        c.apply_env(|k| (k == "OTEL_SDK_DISABLED").then(|| "true".into()))
            .unwrap();
        assert_eq!(c.target(Signal::Traces), None);
    }

    #[test]
    fn bad_values_say_what_is_wrong() {
        let mut c = OtlpConfig::default();
        let e = c
            .apply_env(|k| (k == "OTEL_EXPORTER_OTLP_PROTOCOL").then(|| "http/json".into()))
            .unwrap_err();
        assert!(e.to_string().contains("grpc"), "{e}");
        let e = c
            .apply_env(|k| (k == "OTEL_METRIC_EXPORT_INTERVAL").then(|| "soon".into()))
            .unwrap_err();
        assert!(e.to_string().contains("milliseconds"), "{e}");
        let e = c
            .apply_env(|k| (k == "OTEL_EXPORTER_OTLP_HEADERS").then(|| "novalue".into()))
            .unwrap_err();
        assert!(e.to_string().contains("key=value"), "{e}");
        // gRPC without a scheme: TLS, unless insecure (as the OTel spec says); HTTP
        // needs one.
        c.endpoint = Some("127.0.0.1:4317".into());
        let t = c.target(Signal::Traces).unwrap();
        assert_eq!(t.url, "https://127.0.0.1:4317");
        assert_eq!(t.tls.unwrap().ca, Path::new(SYSTEM_CA_BUNDLE));
        c.insecure = true;
        let t = c.target(Signal::Traces).unwrap();
        assert_eq!((t.url.as_str(), t.tls), ("http://127.0.0.1:4317", None));
        c.protocol = Protocol::HttpProtobuf;
        c.endpoint = Some("127.0.0.1:4318".into());
        assert!(matches!(c.validate(), Err(ConfigError::Endpoint(_))));
        c.protocol = Protocol::Grpc;
        c.client_certificate = Some("client.crt".into());
        c.endpoint = Some("https://127.0.0.1:4317".into());
        assert!(matches!(c.validate(), Err(ConfigError::ClientIdentity)));
        c.client_key = Some("client.key".into());
        c.traces.certificate = Some("traces-ca.crt".into());
        let tls = c.target(Signal::Traces).unwrap().tls.unwrap();
        assert_eq!(tls.ca, Path::new("traces-ca.crt"), "the signal's own CA");
        assert_eq!(tls.client, Some(("client.crt".into(), "client.key".into())));
        c.endpoint = Some("http://127.0.0.1:4317".into());
        c.export_interval_secs = 0.0;
        assert!(c.validate().is_err());
    }
}
