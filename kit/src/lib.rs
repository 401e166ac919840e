//! What kvscope's daemons (agent, collector, actuator) share that is not a contract
//! between them (contracts live in `kvscope-wire`): how they log, how they answer
//! `/healthz` and `/readyz`, how they print their effective config, and how they speak
//! HTTPS (Dynamo's stores, an OTLP receiver).

pub mod config;
pub mod health;
pub mod https;
pub mod logging;

pub use health::Health;
pub use logging::{LogArgs, LogFormat};
