//! Where records come from: an engine's ZMQ KV event publisher ([`engine`]), Dynamo's
//! event plane ([`plane`]) and the router's log ([`router`]). Each tap hands what it
//! reads to the sink ([`crate::sink::RecordSink`]).

pub mod engine;
pub mod plane;
pub mod router;
