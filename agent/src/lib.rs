//! The kvscope agent: taps engines' ZMQ KV event publishers and the router's log on one
//! node and ships normalized records ([`kvscope_wire::Envelope`]) to NATS JetStream.
//!
//! The data path: [`taps`] read the engines' KV events ([`taps::engine`], over
//! [`taps::engine::zmtp`], a ZMTP client bounded against its peer), Dynamo's event plane
//! ([`taps::plane`]) and the router's log ([`taps::router`]: files, follower, parser,
//! join); [`sink`] stamps, orders and buffers the records and [`sink::publisher`] ships
//! them to JetStream; [`nixl`] traces NIXL with eBPF; [`fleet`] follows Dynamo's
//! discovery store and tells which worker a local process works for. Pure parts (bytes
//! or lines in, records out) are unit-tested beside the code: [`kv_events`] (vLLM wire
//! format), [`taps::engine::sequence`] (gaps and resets), [`taps::router::parse`]
//! (Dynamo's and the fork's log lines), [`taps::router::join`] (request-id join in log
//! time). The daemon is [`agent`] with [`metrics`]; what can go wrong is listed in
//! [`internal_events`], each bumping its counter in [`counters`].

// Every decoder of outside bytes is safe Rust: the fuzz targets run without a
// sanitizer (scripts/fuzz), and this keeps that true.
#![forbid(unsafe_code)]

pub mod agent;
pub mod capabilities;
pub mod cli;
pub mod config;
pub mod counters;
pub mod fleet;
pub mod internal_events;
/// The vLLM KV event decoder, shared with the NIXL lab's publisher (in `kvscope-wire`).
pub use kvscope_wire::vllm_events as kv_events;
pub mod metrics;
pub mod nixl;
pub mod sink;
pub mod taps;
pub mod watchdog;
