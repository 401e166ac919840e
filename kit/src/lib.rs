//! What kvscope's daemons (agent, collector, actuator) share that is not a contract
//! between them (contracts live in `kvscope-wire`, which builds on this crate): how they
//! log, how they answer `/healthz` and `/readyz`, how they read environment overrides and
//! print their effective config, how they write `/metrics` (the Prometheus and
//! OpenMetrics text formats), and how they speak HTTPS (Dynamo's stores, an OTLP
//! receiver).

pub mod config;
pub mod health;
pub mod https;
pub mod logging;
pub mod prom;

pub use health::Health;
pub use logging::{LogArgs, LogFormat};
