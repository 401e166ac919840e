//! Where records come in: the live stream (NATS JetStream, rebuilt from on every start),
//! applied in stream order to the fold in the collector's state (`crate::state`).
//! Recordings are folded by the what-if's `recording`.

pub mod bus;
pub mod clocks;
