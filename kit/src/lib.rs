//! What kvscope's daemons (agent, collector, actuator) share that is not a contract
//! between them (contracts live in `kvscope-wire`): how they log, and how they answer
//! `/healthz` and `/readyz`.

pub mod health;
pub mod logging;

pub use health::Health;
pub use logging::{LogArgs, LogFormat};
