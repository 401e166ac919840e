//! The router's decisions from its log: files found by pattern, followed like
//! `tail -F` (CRI container logs too), parsed line by line, and each request's routing
//! input joined with the worker it was sent to.

pub mod cri;
pub mod files;
pub mod follower;
pub mod join;
pub mod parse;
pub mod tap;
