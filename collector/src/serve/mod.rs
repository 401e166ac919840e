//! What the collector serves from the fold's state: the HTTP API and `/metrics`, and the
//! OTLP spans of its verdicts.

pub mod api;
pub mod metrics;
pub mod nixl_metrics;
pub mod spans;
