//! Logging: human-readable text (the default) or one JSON object per line, what a log
//! pipeline on Kubernetes ingests without a parser. Always to stderr, filtered by
//! `RUST_LOG` (default `info`).

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `2026-12-01T16:00:00.000000Z  INFO target: message key=value`.
    #[default]
    Text,
    /// `{"timestamp":"…","level":"INFO","fields":{"message":"…",…},"target":"…"}`.
    Json,
}

/// The `--log-format` flag, shared by every binary.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LogArgs {
    /// Log lines as text or as JSON objects, one per line (for a log pipeline).
    #[arg(
        long,
        global = true,
        env = "KVSCOPE_LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Text
    )]
    pub log_format: LogFormat,
}

/// Install the process's logger. Call once, first thing after parsing the flags.
pub fn init(format: LogFormat) {
    init_at(format, "info")
}

/// [`init`] with another filter than `info` where `RUST_LOG` sets none (the demo
/// prints its own progress and logs warnings only).
pub fn init_at(format: LogFormat, default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
