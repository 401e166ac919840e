//! The kvscope agent: taps engines' ZMQ KV event publishers and the router's log on one
//! node and ships normalized records ([`kvscope_wire::Envelope`]) to NATS JetStream.
//!
//! Pure parts (bytes or lines in, records out; unit-tested beside the code):
//! [`kv_events`] (vLLM wire format), [`sequence`] (gaps and resets), [`router_log`]
//! (Dynamo's and the fork's log lines), [`decision_join`] (request-id join in log time).
//! I/O edges: [`zmq_tap`] (over [`zmtp`], a ZMTP client bounded against its peer), [`log_follower`], [`router_logs`] (patterns) and [`router_tap`], [`record_sink`] (stamp,
//! record, bounded buffer), [`publisher`] (JetStream), [`metrics`]. What can go wrong is
//! listed in [`internal_events`], each bumping its counter in [`counters`].

pub mod agent;
pub mod capabilities;
pub mod cli;
pub mod config;
pub mod counters;
pub mod cri;
pub mod decision_join;
pub mod fleet;
pub mod internal_events;
/// The vLLM KV event decoder, shared with the NIXL lab's publisher (in `kvscope-wire`).
pub use kvscope_wire::vllm_events as kv_events;
pub mod log_follower;
pub mod metrics;
pub mod nixl;
pub mod owners;
pub mod plane_recovery;
pub mod plane_tap;
pub mod publisher;
pub mod record_sink;
pub mod replay;
pub mod router_log;
pub mod router_logs;
pub mod router_tap;
pub mod sequence;
pub mod zmq_tap;
pub mod zmtp;
