//! kvscope in one command. [`fleet_run::FleetRun`] brings up the embedded lab fleet
//! (Dynamo's KV router, mocker workers, NATS) with kvscope's agent and collector as
//! child processes; `kvscope demo` and the end-to-end tests both drive it.

pub mod fleet_run;
