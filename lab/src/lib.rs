//! The kvscope lab: a real Dynamo 1.6.1 KV router (the `dynamo.frontend` with
//! `--router-mode kv`) with N `dynamo.mocker` workers and a `nats-server -js`, all on
//! 127.0.0.1, plus a bounded multi-turn chat workload that makes the router spill.
//!
//! - [`setup`]: creates the Python venv with Dynamo (idempotent).
//! - [`Lab`]: starts and stops the processes; [`Manifest`] describes a running lab
//!   (also written as `lab.json` in the run directory).
//! - [`discovery`]: reads Dynamo's file discovery store (`DYN_FILE_KV`) to learn worker ids.
//! - [`workload`]: the chat workload and its summary.
//! - [`router_log`]: just enough parsing of the router's log to check a run.

pub mod bus_security;
pub mod daemons;
pub mod etcd;
mod lab;
pub mod nats;
pub mod paths;
pub mod ports;
pub mod process;
pub mod prometheus;
pub mod router_log;
pub mod setup;
pub mod workload;

pub use lab::{
    skew_clock, Lab, LabConfig, LabDiscovery, LabError, LabEventPlane, Manifest, ProcessInfo,
    WorkerInfo, FRONTEND_SERVICE_NAME,
};
