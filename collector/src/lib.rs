//! kvscope collector: the fleet view.
//!
//! Records from the agents (over NATS JetStream, or from a recording) are folded by the
//! [`analyzer::FleetAnalyzer`] into a mirror of every worker's cache
//! ([`fleet_index::FleetIndex`]), a [`verdict::SpillVerdict`] per routed request, and
//! measurement windows ([`window`]), from which [`report`] writes the opportunity report.

pub mod analyzer;
pub mod bus;
pub mod cli;
pub mod config;
pub mod fleet_index;
pub mod metrics;
pub mod nixl;
pub mod replay;
pub mod report;
pub mod server;
pub mod spans;
pub mod supervise;
pub mod verdict;
pub mod window;
