//! The actuator's configuration: one documented struct, loaded from a TOML file, then
//! environment overrides (`KVSCOPE_ACTUATOR_*`), then command-line flags (see
//! [`crate::cli`]). Every field has a default, so an empty file is a valid config (one
//! that only watches: no backend, no directives).
//!
//! ```toml
//! collector_url = "http://127.0.0.1:9465"
//! interval_secs = 5.0
//! audit_log = "kvscope-actuator-audit.jsonl"
//! dry_on_exit = true
//!
//! [policy]
//! min_windows = 6
//! min_true_delta_tok_per_s = 1000.0
//! min_beneficial_share = 0.5
//! min_tokens = 16384              # like DYN_KV_MIGRATION_MIN_TOKENS
//! kv_bytes_per_token = 131072     # e.g. 8B model, fp16, 32 layers x 8 KV heads x 128
//! prefill_tok_per_s = 10000.0
//! min_handshakes = 3
//! min_handshake_success_ratio = 0.95
//! max_data_age_secs = 60.0
//! max_agent_silence_secs = 30.0
//! cooldown_secs = 300.0
//! max_flips_per_hour = 6
//!
//! [[worker_agents]]               # Dynamo worker id -> NIXL agent name
//! worker_id = 7587886582197386541
//! nixl_agent = "decode-0"
//!
//! [api]
//! listen = "127.0.0.1:9466"
//! token_file = "/run/secrets/kvscope-actuator-token"
//!
//! [[mode_backends]]
//! kind = "command"
//! argv = ["kubectl", "set", "env", "deploy/frontend", "DYN_KV_MIGRATION={mode}"]
//! timeout_secs = 60.0
//!
//! [[mode_backends]]
//! kind = "file"
//! path = "/etc/dynamo/migration.env"
//! content = "DYN_KV_MIGRATION={mode}\n"
//!
//! [directives]
//! enabled = true
//! url = "http://127.0.0.1:9700/migrations"
//! rate_per_s = 5.0
//! burst = 10
//! ```
//!
//! Environment: `KVSCOPE_ACTUATOR_COLLECTOR_URL`, `_INTERVAL_SECS`, `_AUDIT_LOG`,
//! `_API_LISTEN`, `_API_TOKEN` (the token itself; never put it in the file),
//! `_API_TOKEN_FILE`, `_API` (`0` disables the API), `_MIN_WINDOWS`, `_MIN_TOKENS`,
//! `_KV_BYTES_PER_TOKEN`, `_PREFILL_TOK_PER_S`, `_WORKER_AGENTS`
//! (`WORKER_ID[/DP]=AGENT,…`), `_EXPECTED_AGENTS` (comma-separated), `_DIRECTIVE_URL`
//! (also enables directives), and `_MODE_HTTP` (URL), `_MODE_FILE` (path),
//! `_MODE_COMMAND` (argv split on whitespace): when any of the three is set they replace
//! the file's `mode_backends`.

use crate::act::backend::ModeBackendConfig;
use crate::decide::policy::PolicyConfig;
use kvscope_kit::config::{Env, EnvError};
use kvscope_wire::cost::WorkerAgent;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Shortest API token accepted.
pub(crate) const MIN_TOKEN_LEN: usize = 16;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActuatorConfig {
    /// The collector's base URL (default `http://127.0.0.1:9465`), or a scope's
    /// collectors' separated by commas (a leader and its standby): the ready one is read.
    /// Env: `KVSCOPE_ACTUATOR_COLLECTOR_URL`.
    pub collector_url: String,
    /// Seconds between evaluations (default 5). Env: `KVSCOPE_ACTUATOR_INTERVAL_SECS`.
    pub interval_secs: f64,
    /// Timeout of each request to the collector, in seconds (default 5). A collector that
    /// does not answer is missing input: DRY.
    pub collector_timeout_secs: f64,
    /// Closed windows fetched per evaluation (default 64; at least `min_windows` plus the
    /// warm-up ones are needed).
    pub window_limit: usize,
    /// Spill verdicts fetched per evaluation, for the migration directives (default 1000).
    pub verdict_limit: usize,
    /// The append-only JSON-lines audit log (default `kvscope-actuator-audit.jsonl`).
    /// Also read back at start: the flips of the last hour (for the cap and cooldown)
    /// and an operator's hold survive a restart. Env: `KVSCOPE_ACTUATOR_AUDIT_LOG`.
    pub audit_log: PathBuf,
    /// Put the router in DRY when the actuator stops (default true): nobody watches a
    /// LIVE router for silent failures once the actuator is gone.
    pub dry_on_exit: bool,
    /// When to go LIVE and when to fall back to DRY.
    pub policy: PolicyConfig,
    /// Dynamo worker → NIXL agent name, so the cost model and the handshake checks use
    /// the figures of the pair a migration would use (default none: fleet-wide NIXL
    /// figures, said so in every evaluation). Env: `KVSCOPE_ACTUATOR_WORKER_AGENTS`.
    pub worker_agents: Vec<WorkerAgent>,
    /// The actuator's own HTTP API: status, audit tail, operator override.
    pub api: ApiConfig,
    /// Where the mode is switched (default none: the actuator only decides and audits).
    pub mode_backends: Vec<ModeBackendConfig>,
    /// Migration directives sent in LIVE (default off).
    pub directives: DirectiveConfig,
}

impl Default for ActuatorConfig {
    fn default() -> Self {
        Self {
            collector_url: "http://127.0.0.1:9465".into(),
            interval_secs: 5.0,
            collector_timeout_secs: 5.0,
            window_limit: 64,
            verdict_limit: 1000,
            audit_log: PathBuf::from("kvscope-actuator-audit.jsonl"),
            dry_on_exit: true,
            policy: PolicyConfig::default(),
            worker_agents: Vec::new(),
            api: ApiConfig::default(),
            mode_backends: Vec::new(),
            directives: DirectiveConfig::default(),
        }
    }
}

/// The actuator's HTTP API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    /// Serve the API (default true). Env: `KVSCOPE_ACTUATOR_API` (`0`/`false` disables).
    pub enabled: bool,
    /// Listen address (default `127.0.0.1:9466`: loopback only; anything else is the
    /// operator's explicit choice). Env: `KVSCOPE_ACTUATOR_API_LISTEN`.
    pub listen: SocketAddr,
    /// File holding the bearer token that every write (and every read of the audit)
    /// needs (default none). Env: `KVSCOPE_ACTUATOR_API_TOKEN_FILE`, or the token itself
    /// in `KVSCOPE_ACTUATOR_API_TOKEN`. The token is never read from this config file.
    pub token_file: Option<PathBuf>,
    /// The token given in the environment (never serialized, never read from the file).
    #[serde(skip)]
    pub token_from_env: Option<String>,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: SocketAddr::from(([127, 0, 0, 1], 9466)),
            token_file: None,
            token_from_env: None,
        }
    }
}

/// Migration directives: in LIVE only, one per spill that passes the gate, POSTed to an
/// HTTP endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DirectiveConfig {
    /// Send directives (default false). Env: set by `KVSCOPE_ACTUATOR_DIRECTIVE_URL`.
    pub enabled: bool,
    /// Where directives are POSTed (JSON body, `Idempotency-Key` header).
    pub url: Option<String>,
    /// File holding a bearer token the endpoint wants (default none).
    pub token_file: Option<PathBuf>,
    /// Directives per second at most, on average (default 5).
    pub rate_per_s: f64,
    /// Directives allowed in a burst (default 10). Beyond the rate a directive is
    /// dropped (counted as rate-limited), not queued: a late migration is useless.
    pub burst: u32,
    /// Directives in flight at most (default 4).
    pub max_in_flight: usize,
    /// Retries after a transport error, a 5xx or a 429, with the same idempotency key
    /// (default 2).
    pub max_retries: u32,
    /// Pause before retry n is n times this, in milliseconds (default 200).
    pub retry_backoff_ms: u64,
    /// Timeout of each attempt, in seconds (default 2).
    pub timeout_secs: f64,
    /// Spills decided longer ago than this are not migrated, in seconds (default 10).
    pub max_age_secs: f64,
}

impl Default for DirectiveConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            url: None,
            token_file: None,
            rate_per_s: 5.0,
            burst: 10,
            max_in_flight: 4,
            max_retries: 2,
            retry_backoff_ms: 200,
            timeout_secs: 2.0,
            max_age_secs: 10.0,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    File(#[from] kvscope_kit::config::ConfigFileError),
    #[error("invalid config: {0}")]
    Toml(#[from] toml::de::Error),
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error("cannot read token file {path}: {source}")]
    TokenFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "no API token configured, and {what}: every write needs a bearer token. Put one \
         (at least {MIN_TOKEN_LEN} characters) in a file named by api.token_file / \
         --token-file / KVSCOPE_ACTUATOR_API_TOKEN_FILE, or in KVSCOPE_ACTUATOR_API_TOKEN"
    )]
    MissingToken { what: String },
    #[error("the API token is shorter than {MIN_TOKEN_LEN} characters")]
    ShortToken,
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl ActuatorConfig {
    /// Defaults, then the file (if any), then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let mut cfg: Self = kvscope_kit::config::load_file(file)?;
        cfg.apply_env(|k| std::env::var(k).ok())?;
        Ok(cfg)
    }

    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Ok(toml::from_str(text)?)
    }

    /// Apply `KVSCOPE_ACTUATOR_*` overrides read through `var`.
    pub fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let env = Env::new(var);
        if let Some(v) = env.get("KVSCOPE_ACTUATOR_COLLECTOR_URL") {
            self.collector_url = v;
        }
        if let Some(v) = env.parse("KVSCOPE_ACTUATOR_INTERVAL_SECS")? {
            self.interval_secs = v;
        }
        if let Some(v) = env.get("KVSCOPE_ACTUATOR_AUDIT_LOG") {
            self.audit_log = v.into();
        }
        if let Some(v) = env.flag("KVSCOPE_ACTUATOR_API") {
            self.api.enabled = v;
        }
        if let Some(v) = env.parse("KVSCOPE_ACTUATOR_API_LISTEN")? {
            self.api.listen = v;
        }
        if let Some(v) = env.get("KVSCOPE_ACTUATOR_API_TOKEN_FILE") {
            self.api.token_file = Some(v.into());
        }
        if let Some(v) = env.trimmed("KVSCOPE_ACTUATOR_API_TOKEN") {
            self.api.token_from_env = Some(v).filter(|t| !t.is_empty());
        }
        if let Some(v) = env.parse("KVSCOPE_ACTUATOR_MIN_WINDOWS")? {
            self.policy.min_windows = v;
        }
        if let Some(v) = env.parse("KVSCOPE_ACTUATOR_MIN_TOKENS")? {
            self.policy.min_tokens = v;
        }
        if let Some(v) = env.parse("KVSCOPE_ACTUATOR_KV_BYTES_PER_TOKEN")? {
            self.policy.kv_bytes_per_token = v;
        }
        if let Some(v) = env.parse("KVSCOPE_ACTUATOR_PREFILL_TOK_PER_S")? {
            self.policy.prefill_tok_per_s = v;
        }
        if let Some(v) = env.list("KVSCOPE_ACTUATOR_WORKER_AGENTS")? {
            self.worker_agents = v;
        }
        if let Some(v) = env.list("KVSCOPE_ACTUATOR_EXPECTED_AGENTS")? {
            self.policy.expected_agents = v;
        }
        if let Some(v) = env.get("KVSCOPE_ACTUATOR_DIRECTIVE_URL") {
            self.directives.url = Some(v);
            self.directives.enabled = true;
        }
        let mut env_backends = Vec::new();
        if let Some(v) = env.get("KVSCOPE_ACTUATOR_MODE_HTTP") {
            env_backends.push(ModeBackendConfig::Http {
                url: v.trim().to_string(),
                token_file: None,
                timeout_secs: 10.0,
            });
        }
        if let Some(v) = env.get("KVSCOPE_ACTUATOR_MODE_COMMAND") {
            env_backends.push(ModeBackendConfig::Command {
                argv: v.split_whitespace().map(str::to_string).collect(),
                timeout_secs: 60.0,
            });
        }
        if let Some(v) = env.get("KVSCOPE_ACTUATOR_MODE_FILE") {
            env_backends.push(ModeBackendConfig::File {
                path: v.trim().into(),
                content: crate::act::backend::DEFAULT_FILE_CONTENT.into(),
            });
        }
        if !env_backends.is_empty() {
            self.mode_backends = env_backends;
        }
        Ok(())
    }

    /// Whether the actuator can write anywhere: switch a mode or send a directive.
    pub fn writes(&self) -> bool {
        !self.mode_backends.is_empty() || self.directives.enabled
    }

    /// The API token: from the environment, else from `api.token_file`.
    pub(crate) fn api_token(&self) -> Result<Option<String>, ConfigError> {
        if let Some(t) = &self.api.token_from_env {
            return Ok(Some(t.clone()));
        }
        match &self.api.token_file {
            Some(path) => read_token(path).map(Some),
            None => Ok(None),
        }
    }

    /// The API token, required when the API is served or the actuator writes anywhere.
    pub(crate) fn required_api_token(&self) -> Result<Option<String>, ConfigError> {
        let token = self.api_token()?;
        if let Some(t) = &token {
            if t.chars().count() < MIN_TOKEN_LEN {
                return Err(ConfigError::ShortToken);
            }
            return Ok(token);
        }
        let mut what = Vec::new();
        if self.api.enabled {
            what.push(format!("the API is enabled (on {})", self.api.listen));
        }
        if !self.mode_backends.is_empty() {
            what.push(format!(
                "{} mode backend(s) configured",
                self.mode_backends.len()
            ));
        }
        if self.directives.enabled {
            what.push("migration directives are enabled".to_string());
        }
        if what.is_empty() {
            Ok(None)
        } else {
            Err(ConfigError::MissingToken {
                what: what.join(" and "),
            })
        }
    }

    /// Reject values the actuator cannot run with.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let positive = |name: &str, v: f64| -> Result<(), ConfigError> {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(ConfigError::Invalid(format!("{name} must be > 0 (is {v})")))
            }
        };
        positive("interval_secs", self.interval_secs)?;
        positive("collector_timeout_secs", self.collector_timeout_secs)?;
        let urls = crate::decide::input::collector_urls(&self.collector_url);
        if urls.is_empty() {
            return bad("collector_url names no URL".into());
        }
        for u in urls {
            if !(u.starts_with("http://") || u.starts_with("https://")) {
                return bad(format!("collector_url {u:?} is not an http:// URL"));
            }
        }
        self.policy.validate().map_err(ConfigError::Invalid)?;
        if self.window_limit < self.policy.min_windows.max(self.policy.exit_windows) {
            return bad(format!(
                "window_limit ({}) is below policy.min_windows ({})",
                self.window_limit, self.policy.min_windows
            ));
        }
        for b in &self.mode_backends {
            b.validate().map_err(ConfigError::Invalid)?;
        }
        let d = &self.directives;
        if d.enabled {
            match &d.url {
                Some(u) if u.starts_with("http://") || u.starts_with("https://") => {}
                Some(u) => return bad(format!("directives.url {u:?} is not an http:// URL")),
                None => return bad("directives.enabled needs directives.url".into()),
            }
            positive("directives.rate_per_s", d.rate_per_s)?;
            positive("directives.timeout_secs", d.timeout_secs)?;
            positive("directives.max_age_secs", d.max_age_secs)?;
            if d.burst == 0 || d.max_in_flight == 0 {
                return bad("directives.burst and directives.max_in_flight must be > 0".into());
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for w in &self.worker_agents {
            if !seen.insert((w.worker_id, w.dp_rank)) {
                return bad(format!("worker_agents names worker {} twice", w.worker_id));
            }
        }
        Ok(())
    }
}

/// Read a token file: its first line, trimmed.
pub fn read_token(path: &Path) -> Result<String, ConfigError> {
    kvscope_kit::auth::read_token(path).map_err(|source| ConfigError::TokenFile {
        path: path.into(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_kit::config::documented_toml_example;
    use kvscope_wire::WorkerKey;

    #[test]
    fn an_empty_file_gives_the_defaults() {
        let c = ActuatorConfig::from_toml("").unwrap();
        assert_eq!(c, ActuatorConfig::default());
        assert_eq!(c.policy.min_windows, 6);
        assert_eq!(c.policy.min_tokens, 16384);
        assert_eq!(c.api.listen.to_string(), "127.0.0.1:9466");
        assert!(!c.writes());
        c.validate().unwrap();
    }

    #[test]
    fn the_documented_example_parses() {
        let example = documented_toml_example(include_str!("config.rs")).unwrap();
        let c = ActuatorConfig::from_toml(&example).unwrap();
        c.validate().unwrap();
        assert_eq!(c.mode_backends.len(), 2);
        assert_eq!(c.worker_agents[0].nixl_agent, "decode-0");
        assert!(c.directives.enabled);
        assert!(c.writes());
    }

    #[test]
    fn unknown_fields_and_tokens_in_the_file_are_refused() {
        assert!(ActuatorConfig::from_toml("colector_url = \"x\"").is_err());
        assert!(ActuatorConfig::from_toml("[api]\ntoken = \"secret-in-a-file!\"").is_err());
        assert!(ActuatorConfig::from_toml("[policy]\nmin_window = 3").is_err());
    }

    #[test]
    fn a_scopes_collectors_are_given_by_commas_each_an_http_url() {
        let ok = ActuatorConfig::from_toml("collector_url = \"http://c-0:9465/, http://c-1:9465\"")
            .unwrap();
        ok.validate().unwrap();
        assert_eq!(
            crate::decide::input::collector_urls(&ok.collector_url),
            ["http://c-0:9465", "http://c-1:9465"]
        );
        for bad in ["http://c-0:9465,c-1:9465", " , "] {
            let c = ActuatorConfig {
                collector_url: bad.into(),
                ..ActuatorConfig::default()
            };
            assert!(c.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn env_overrides_the_file() {
        let mut c = ActuatorConfig::from_toml(
            "collector_url = \"http://file:1\"\n[[mode_backends]]\nkind = \"file\"\npath = \"x\"",
        )
        .unwrap();
        c.apply_env(|k| match k {
            "KVSCOPE_ACTUATOR_COLLECTOR_URL" => Some("http://env:2".into()),
            "KVSCOPE_ACTUATOR_MIN_WINDOWS" => Some("8".into()),
            "KVSCOPE_ACTUATOR_WORKER_AGENTS" => Some("1=a, 2/1=b".into()),
            "KVSCOPE_ACTUATOR_MODE_COMMAND" => {
                Some("kubectl set env deploy/x DYN_KV_MIGRATION={mode}".into())
            }
            "KVSCOPE_ACTUATOR_API_TOKEN" => Some(" 0123456789abcdef ".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(c.collector_url, "http://env:2");
        assert_eq!(c.policy.min_windows, 8);
        assert_eq!(c.worker_agents[1].dp_rank, Some(1));
        assert_eq!(
            c.mode_backends,
            vec![ModeBackendConfig::Command {
                argv: [
                    "kubectl",
                    "set",
                    "env",
                    "deploy/x",
                    "DYN_KV_MIGRATION={mode}"
                ]
                .map(String::from)
                .to_vec(),
                timeout_secs: 60.0
            }],
            "env backends replace the file's"
        );
        assert_eq!(c.api_token().unwrap().as_deref(), Some("0123456789abcdef"));
        assert!(c
            .clone()
            .apply_env(|k| (k == "KVSCOPE_ACTUATOR_MIN_TOKENS").then(|| "many".into()))
            .is_err());
    }

    #[test]
    fn writing_or_serving_without_a_token_is_refused_with_a_clear_error() {
        let mut c = ActuatorConfig::default();
        let e = c.required_api_token().unwrap_err().to_string();
        assert!(e.contains("the API is enabled"), "{e}");
        assert!(e.contains("KVSCOPE_ACTUATOR_API_TOKEN"), "{e}");
        c.api.enabled = false;
        assert_eq!(
            c.required_api_token().unwrap(),
            None,
            "watch-only needs none"
        );
        c.directives.enabled = true;
        let e = c.required_api_token().unwrap_err().to_string();
        assert!(e.contains("directives"), "{e}");
        c.api.token_from_env = Some("short".into());
        assert!(matches!(
            c.required_api_token(),
            Err(ConfigError::ShortToken)
        ));
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("token");
        std::fs::write(&f, "a-long-enough-token\n").unwrap();
        c.api.token_from_env = None;
        c.api.token_file = Some(f);
        assert_eq!(
            c.required_api_token().unwrap().as_deref(),
            Some("a-long-enough-token")
        );
    }

    #[test]
    fn worker_agent_specs() {
        let w: WorkerAgent = "42=decode-0".parse().unwrap();
        assert_eq!((w.worker_id, w.dp_rank), (42, None));
        assert!(w.matches(&WorkerKey {
            worker_id: 42,
            dp_rank: 3
        }));
        let w: WorkerAgent = "42/1=d".parse().unwrap();
        assert!(!w.matches(&WorkerKey {
            worker_id: 42,
            dp_rank: 0
        }));
        for bad in ["42", "x=a", "42=", "42/y=a", "/1=a", "42/1/2=a"] {
            let e = bad.parse::<WorkerAgent>().unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
        // The shared parser's message (which part, which form) reaches the user.
        let e = "42/y=a".parse::<WorkerAgent>().unwrap_err();
        assert!(
            e.contains("bad dp rank \"y\"") && e.contains("WORKER_ID[/DP]=AGENT"),
            "{e}"
        );
    }
}
