//! What kvscope's parts share that is not a contract between them (contracts live in
//! `kvscope-wire`, which builds on this crate): the clock, how they read environment
//! overrides and print their effective config, how they write `/metrics` (the
//! Prometheus and OpenMetrics text formats), how they answer `/healthz` and `/readyz`,
//! how writing endpoints check their bearer token, how files from outside are opened
//! (regular files only, never blocking);
//! and, with the `daemon` feature, how they log and how they speak HTTPS (Dynamo's
//! stores, an OTLP receiver).

pub mod auth;
pub mod clock;
pub mod config;
pub mod files;
pub mod health;
#[cfg(feature = "daemon")]
pub mod http;
#[cfg(feature = "daemon")]
pub mod https;
pub mod internal_events;
#[cfg(feature = "daemon")]
pub mod logging;
pub mod prom;

pub use health::Health;
#[cfg(feature = "daemon")]
pub use logging::{LogArgs, LogFormat};

/// The host name (`/proc/sys/kernel/hostname`, else `$HOSTNAME`), if either names one;
/// a pod's is its pod name.
pub fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}
