//! Taps on Dynamo's event plane (zmq or NATS), and Dynamo's own recovery endpoint for
//! the batches a tap missed.

pub mod recovery;
pub mod tap;
