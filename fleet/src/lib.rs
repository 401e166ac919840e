//! The embedded lab fleet with kvscope attached. [`fleet_run::FleetRun`] brings up the lab
//! (Dynamo's KV router, mocker workers, NATS) with kvscope's agent and collector as child
//! processes; `kvscope-demo` (the README's first command) and the end-to-end tests both
//! drive it. The `kvscope` binary does not link this crate.

pub mod fleet_run;
