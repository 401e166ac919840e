//! kvscope actuator: flips the router's KV migration between OFF, DRY and LIVE from the
//! collector's measured windows, and issues migration directives in LIVE.
//!
//! - [`policy`]: the pure policy engine (states, thresholds, safety triggers, hysteresis,
//!   cooldown, flip cap) over a [`input::CollectorView`].
//! - [`cost`]: the per-spill cost model from measured NIXL figures.
//! - [`directive`]: migration directives (selection, idempotency keys, rate limit,
//!   ledger); [`sink`] sends them.
//! - [`backend`]: where the mode is switched (HTTP, command, file).
//! - [`audit`]: the append-only JSON-lines audit log.
//! - [`runtime`]: the loop that ties them; [`api`]: its HTTP API; [`cli`]: the command
//!   line.

pub mod api;
pub mod audit;
pub mod backend;
pub mod cli;
pub mod config;
pub mod cost;
pub mod directive;
pub mod input;
pub mod metrics;
pub mod mode;
pub mod plan;
pub mod policy;
pub mod runtime;
pub mod sink;
