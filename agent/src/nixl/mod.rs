//! NIXL tracing with eBPF: uprobes on `libnixl.so`'s `nixlAgent` methods (programs in
//! `ebpf/nixl/`, compiled by `build.rs`, loaded with aya), folded into per-peer transfer,
//! byte, latency and handshake figures.
//!
//! - [`event`]: the ring buffer record, decoded without `unsafe`;
//! - [`derive`]: struct offsets read from a build's own instructions;
//! - [`offsets`]: what the probes read, and completion sites per libnixl build-id;
//! - [`library`]: ELF build-id and symbol resolution, the probe table;
//! - [`discovery`]: libraries mapped by running processes;
//! - [`probes`]: loading and attaching for one library;
//! - [`tally`]: the kernel's exact tallies of transfers and the latency buckets every
//!   NIXL figure shares;
//! - [`aggregate`]: the pure fold from events to a [`kvscope_wire::nixl::NixlReport`];
//! - [`owners`]: which Dynamo worker each local NIXL agent belongs to, from the processes;
//! - [`spans`]: OTLP spans of transfers and handshakes (rate-capped);
//! - [`tracer`]: the running whole.

pub mod aggregate;
pub mod derive;
pub mod discovery;
pub mod event;
pub mod library;
pub mod offsets;
pub mod probes;
pub mod spans;
pub mod tally;
pub mod tracer;

pub use tracer::{NixlTraceConfig, NixlTracer};
