//! kvscope actuator: flips the router's KV migration between OFF, DRY and LIVE from the
//! collector's measured windows, and issues migration directives in LIVE.
//!
//! - [`decide`]: the collector's read ([`decide::input`]), the pure policy engine
//!   ([`decide::policy`]: states, thresholds, safety triggers, hysteresis, cooldown, flip
//!   cap), the per-spill cost model from measured NIXL figures ([`kvscope_wire::cost`]).
//! - [`act`]: where the mode is switched ([`act::backend`]: HTTP, command, file),
//!   migration directives ([`act::directive`]: selection, idempotency keys, rate limit,
//!   ledger; [`act::sink`] sends them), the append-only audit log ([`act::audit`]).
//! - [`daemon`]: the tick that ties them ([`daemon::runtime`]), the loop and its server
//!   ([`daemon::serve`]), the HTTP API and `/metrics`; [`cli`]: the command line.

pub mod act;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod decide;
