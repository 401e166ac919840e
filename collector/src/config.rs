//! Collector configuration: a TOML file, overridden by `KVSCOPE_COLLECTOR_*` environment
//! variables (one per field, [`CollectorConfig::apply_env`]; `OTEL_*` and
//! `KVSCOPE_NATS_*` for the `otlp` and `nats` tables), then command-line flags (see
//! `kvscope-collector run --help`). `kvscope-collector print-config` prints the result.
//!
//! ```toml
//! nats_url = "nats://127.0.0.1:4222"
//! cluster = "default"
//! durable_name = "kvscope-collector"
//! listen = "127.0.0.1:9465"
//! record = "/var/lib/kvscope/recording.jsonl"
//! report_dir = "/var/lib/kvscope/reports"
//! stream_max_age_secs = 86400
//! stream_max_bytes = 4294967296
//! stream_replicas = 0   # servers keeping it (0: 3 on a cluster of three or more, else 1)
//! lease_ttl_secs = 10   # a standby serves this long after its leader died (0: no lease)
//!
//! [analyzer]
//! window_secs = 15.0
//! warmup_secs = 15.0
//! min_spill_blocks = 1
//! models = []
//! ```
//!
//! Environment: `KVSCOPE_COLLECTOR_NATS_URL`, `_CLUSTER`, `_DURABLE_NAME`, `_LISTEN`,
//! `_RECORD`, `_REPORT_DIR`, `_STREAM_MAX_AGE_SECS`, `_STREAM_MAX_BYTES`, `_STREAM_REPLICAS`,
//! `_LEASE_TTL_SECS`, `_WINDOW_SECS`,
//! `_WARMUP_SECS`, `_MIN_SPILL_BLOCKS`, `_MIN_WINDOWS`, `_KEEP_WINDOWS`, `_KEEP_VERDICTS`,
//! `_PROMPT_MEMORY_SECS`, `_MODELS` (comma-separated).

use crate::fold::analyzer::AnalyzerConfig;
use kvscope_kit::config::{Env, EnvError};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CollectorConfig {
    /// NATS server with JetStream enabled, or a cluster's servers separated by commas
    /// (any of them is connected to, and reconnected to).
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
    /// The stream's size limit in bytes (when this collector creates it): past it the
    /// oldest records are discarded (default 4 GiB; 0: no limit). The agents set the
    /// same on the stream they create or update; keep the two equal.
    pub stream_max_bytes: u64,
    /// How many servers keep the stream (when this collector creates it): 0 (default)
    /// is 3 when the servers form a cluster of three or more, else 1.
    pub stream_replicas: usize,
    /// Two collectors of one scope (same cluster and durable consumer name): the one
    /// holding the scope's lease serves, the other folds the same stream as a warm
    /// standby and serves once the lease is free — this long after its holder's last
    /// renewal (default 10 s). 0: no lease; the collector serves alone (then nothing
    /// keeps a second of the same scope from serving too).
    pub lease_ttl_secs: u64,
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
            stream_max_bytes: kvscope_wire::subject::DEFAULT_STREAM_MAX_BYTES,
            stream_replicas: 0,
            lease_ttl_secs: 10,
            analyzer: AnalyzerConfig::default(),
            otlp: kvscope_otlp::OtlpConfig::default(),
            nats: Default::default(),
        }
    }
}

impl CollectorConfig {
    /// Override fields from `KVSCOPE_COLLECTOR_*` variables read through `var`.
    pub fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> Result<(), EnvError> {
        let env = Env::new(var);
        let key = |k: &str| format!("KVSCOPE_COLLECTOR_{k}");
        if let Some(v) = env.trimmed(&key("NATS_URL")) {
            self.nats_url = v;
        }
        if let Some(v) = env.trimmed(&key("CLUSTER")) {
            self.cluster = v;
        }
        if let Some(v) = env.trimmed(&key("DURABLE_NAME")) {
            self.durable_name = v;
        }
        if let Some(v) = env.parse(&key("LISTEN"))? {
            self.listen = v;
        }
        if let Some(v) = env.trimmed(&key("RECORD")) {
            self.record = (!v.is_empty()).then(|| PathBuf::from(v));
        }
        if let Some(v) = env.trimmed(&key("REPORT_DIR")) {
            self.report_dir = (!v.is_empty()).then(|| PathBuf::from(v));
        }
        if let Some(v) = env.parse(&key("STREAM_MAX_AGE_SECS"))? {
            self.stream_max_age_secs = v;
        }
        if let Some(v) = env.parse(&key("STREAM_MAX_BYTES"))? {
            self.stream_max_bytes = v;
        }
        if let Some(v) = env.parse(&key("STREAM_REPLICAS"))? {
            self.stream_replicas = v;
        }
        if let Some(v) = env.parse(&key("LEASE_TTL_SECS"))? {
            self.lease_ttl_secs = v;
        }
        let a = &mut self.analyzer;
        if let Some(v) = env.parse(&key("WINDOW_SECS"))? {
            a.window_secs = v;
        }
        if let Some(v) = env.parse(&key("WARMUP_SECS"))? {
            a.warmup_secs = v;
        }
        if let Some(v) = env.parse(&key("MIN_SPILL_BLOCKS"))? {
            a.min_spill_blocks = v;
        }
        if let Some(v) = env.parse(&key("MIN_WINDOWS"))? {
            a.min_windows = v;
        }
        if let Some(v) = env.parse(&key("KEEP_WINDOWS"))? {
            a.keep_windows = v;
        }
        if let Some(v) = env.parse(&key("KEEP_VERDICTS"))? {
            a.keep_verdicts = v;
        }
        if let Some(v) = env.parse(&key("PROMPT_MEMORY_SECS"))? {
            a.prompt_memory_secs = v;
        }
        if let Some(v) = env.list(&key("MODELS"))? {
            a.models = v;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

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
    fn every_variable_overrides_its_field_and_a_bad_one_is_named() {
        let vars: std::collections::HashMap<&str, &str> = [
            ("KVSCOPE_COLLECTOR_NATS_URL", "tls://bus:4222"),
            ("KVSCOPE_COLLECTOR_CLUSTER", "fleet"),
            ("KVSCOPE_COLLECTOR_DURABLE_NAME", "c-2"),
            ("KVSCOPE_COLLECTOR_LISTEN", "0.0.0.0:9000"),
            ("KVSCOPE_COLLECTOR_RECORD", "/data/r.jsonl"),
            ("KVSCOPE_COLLECTOR_REPORT_DIR", "/data/reports"),
            ("KVSCOPE_COLLECTOR_STREAM_MAX_AGE_SECS", "60"),
            ("KVSCOPE_COLLECTOR_STREAM_MAX_BYTES", "1048576"),
            ("KVSCOPE_COLLECTOR_WINDOW_SECS", "5"),
            ("KVSCOPE_COLLECTOR_WARMUP_SECS", "2.5"),
            ("KVSCOPE_COLLECTOR_MIN_SPILL_BLOCKS", "3"),
            ("KVSCOPE_COLLECTOR_MIN_WINDOWS", "4"),
            ("KVSCOPE_COLLECTOR_KEEP_WINDOWS", "10"),
            ("KVSCOPE_COLLECTOR_KEEP_VERDICTS", "20"),
            ("KVSCOPE_COLLECTOR_PROMPT_MEMORY_SECS", "30"),
            ("KVSCOPE_COLLECTOR_MODELS", "a, b"),
        ]
        .into();
        let mut c = CollectorConfig::default();
        c.apply_env(|k| vars.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(
            (
                c.nats_url.as_str(),
                c.cluster.as_str(),
                c.durable_name.as_str()
            ),
            ("tls://bus:4222", "fleet", "c-2")
        );
        assert_eq!(c.listen.to_string(), "0.0.0.0:9000");
        assert_eq!(c.record.as_deref(), Some(Path::new("/data/r.jsonl")));
        assert_eq!(c.report_dir.as_deref(), Some(Path::new("/data/reports")));
        assert_eq!((c.stream_max_age_secs, c.stream_max_bytes), (60, 1 << 20));
        let a = &c.analyzer;
        assert_eq!(
            (a.window_secs, a.warmup_secs, a.min_spill_blocks),
            (5.0, 2.5, 3)
        );
        assert_eq!(
            (a.min_windows, a.keep_windows, a.keep_verdicts),
            (4, 10, 20)
        );
        assert_eq!(a.prompt_memory_secs, 30.0);
        assert_eq!(a.models, vec!["a", "b"]);
        let e = c
            .apply_env(|k| (k == "KVSCOPE_COLLECTOR_LISTEN").then(|| "nine".to_string()))
            .unwrap_err();
        assert_eq!(e.key, "KVSCOPE_COLLECTOR_LISTEN");
    }

    #[test]
    fn the_documented_example_parses() {
        let example = kvscope_kit::config::documented_toml_example(include_str!("config.rs"))
            .expect("the module docs hold a TOML example");
        let c: CollectorConfig = toml::from_str(&example).unwrap();
        assert_eq!(
            c.report_dir.as_deref(),
            Some(Path::new("/var/lib/kvscope/reports"))
        );
    }

    #[test]
    fn unknown_keys_are_rejected() {
        assert!(toml::from_str::<CollectorConfig>("clustr = \"x\"").is_err());
    }
}
