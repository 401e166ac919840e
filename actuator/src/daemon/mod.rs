//! The actuator as a running process: the tick's state machine ([`runtime`]), the
//! daemon loop and its server ([`serve`]), the HTTP API ([`api`]) and `/metrics`
//! ([`metrics`]).

pub mod api;
pub mod metrics;
pub mod runtime;
pub mod serve;
