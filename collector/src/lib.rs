//! kvscope collector: the fleet view.
//!
//! Records from the agents come in ([`ingest`]: over NATS JetStream, or from a
//! recording) and are folded ([`fold`]) by the [`fold::analyzer::FleetAnalyzer`] into a
//! mirror of every worker's cache ([`fold::fleet_index::FleetIndex`]), a spill verdict per
//! routed request ([`fold::verdict`]) and measurement windows ([`fold::window`]); the
//! state is served ([`serve`]: the HTTP API, `/metrics`, OTLP spans) and written up as
//! the opportunity report ([`report`]). [`supervise`] runs the long-lived tasks; [`lease`]
//! decides which of a scope's collectors serves (the other stands by).
//! [`whatif`] replays a recording over simulated caches to predict a change.

pub mod cli;
pub mod config;
pub use kvscope_fold as fold;
pub mod ingest;
pub mod internal_events;
pub mod lease;
pub mod report;
pub mod serve;
pub mod state;
pub mod supervise;
pub use kvscope_whatif as whatif;
