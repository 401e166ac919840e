//! Collector configuration: a TOML file, overridden by `KVSCOPE_COLLECTOR_*` environment
//! variables and command-line flags (see `kvscope-collector run --help`).

use crate::analyzer::AnalyzerConfig;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CollectorConfig {
    /// NATS server with JetStream enabled.
    pub nats_url: String,
    /// Cluster name: selects the stream `KVSCOPE_<CLUSTER>` and subjects `kvscope.<cluster>.>`.
    pub cluster: String,
    /// Name of this collector's durable JetStream consumer. Each collector needs its
    /// own: the figures are a fold over the whole stream, so collectors sharing one
    /// consumer would each see only part of it.
    pub durable_name: String,
    /// Address of `/metrics` and the JSON API. Loopback by default.
    pub listen: SocketAddr,
    /// Write every applied record to this file (JSON lines); rewritten from the stream on
    /// every start, so it always holds the whole stream in order.
    pub record: Option<PathBuf>,
    /// Write `report.md`, `report.json` and `report.html` here on shutdown.
    pub report_dir: Option<PathBuf>,
    /// Maximum age of records in the stream (when this collector creates it).
    pub stream_max_age_secs: u64,
    pub analyzer: AnalyzerConfig,
    /// OTLP export of the collector's metrics and spans (default off: no endpoint). The
    /// standard `OTEL_EXPORTER_OTLP_*` variables override it (see `kvscope_otlp::config`).
    pub otlp: kvscope_otlp::OtlpConfig,
    /// How the collector authenticates to NATS and checks its TLS (default: none).
    /// `KVSCOPE_NATS_*` override it (see `kvscope_wire::nats_security`).
    pub nats: kvscope_wire::NatsSecurity,
}

impl Default for CollectorConfig {
    fn default() -> Self {
        Self {
            nats_url: "nats://127.0.0.1:4222".into(),
            cluster: "default".into(),
            durable_name: "kvscope-collector".into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 9465)),
            record: None,
            report_dir: None,
            stream_max_age_secs: 24 * 3600,
            analyzer: AnalyzerConfig::default(),
            otlp: kvscope_otlp::OtlpConfig::default(),
            nats: Default::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
}

impl CollectorConfig {
    /// Load from `path`, or the defaults when there is no file.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.into(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_file_keeps_the_other_defaults() {
        let c: CollectorConfig =
            toml::from_str("cluster = \"lab\"\n[analyzer]\nwindow_secs = 5.0\n").unwrap();
        assert_eq!(c.cluster, "lab");
        assert_eq!(c.analyzer.window_secs, 5.0);
        assert_eq!(c.analyzer.min_windows, 6);
        assert_eq!(c.listen.ip().to_string(), "127.0.0.1");
    }

    #[test]
    fn unknown_keys_are_rejected() {
        assert!(toml::from_str::<CollectorConfig>("clustr = \"x\"").is_err());
    }
}
