//! The agent alone: its KV taps against real publishers (vLLM's, SGLang's, the mocker's), its
//! NIXL probes on the wheels' libraries, its pipeline to a real NATS.

mod support;

mod engine_publishers;
mod hostile_publishers;
mod nixl_derive;
mod nixl_tracing;
mod nixl_wheel_api;
mod pipeline;
mod zmq_interop;
