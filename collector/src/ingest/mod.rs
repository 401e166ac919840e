//! Where records come in: the live stream (NATS JetStream, rebuilt from on every start)
//! and recordings, both applied in stream order to the same fold.

pub mod bus;
pub mod clocks;
pub mod replay;
