//! A tap on one engine's ZMQ KV event publisher (vLLM's format): the tap itself over
//! the agent's own ZMTP client, the publisher's replay socket for gaps and late starts,
//! and per-publisher sequence tracking.

pub mod replay;
pub mod sequence;
pub mod tap;
pub mod zmtp;
