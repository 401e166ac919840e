//! The kvscope lab: a real Dynamo KV router (the `dynamo.frontend` with
//! `--router-mode kv`; 1.6.1 unless [`LabConfig::dynamo`] names another release) with N `dynamo.mocker` workers and a `nats-server -js`, all on
//! 127.0.0.1, plus a bounded multi-turn chat workload that makes the router spill.
//!
//! - [`setup`]: creates the Python venv of a Dynamo release (idempotent); [`release`]:
//!   where each release's venv lives and what starting it takes, read off its wheel.
//! - [`Lab`]: starts and stops the processes; [`Manifest`] describes a running lab
//!   (also written as `lab.json` in the run directory).
//! - [`discovery`]: reads Dynamo's file discovery store (`DYN_FILE_KV`) to learn worker ids.
//! - [`workload`]: the chat workload and its summary.
//! - [`router_log`]: just enough parsing of the router's log to check a run.

pub mod bus_security;
pub mod daemons;
pub mod etcd;
mod lab;
pub mod loopback;
pub mod nats;
pub mod paths;
pub mod ports;
pub mod process;
pub mod prometheus;
pub mod release;
pub mod router_log;
pub mod setup;
pub mod workload;

pub use lab::{
    skew_clock, Lab, LabConfig, LabDiscovery, LabError, LabEventPlane, Manifest, ProcessInfo,
    WorkerInfo, FRONTEND_SERVICE_NAME,
};
