//! The collector's HTTP API, typed: what `/api/summary`, `/api/windows` and
//! `/api/verdicts` serve (`/api/nixl` and `/api/nixl/agents` serve
//! [`crate::nixl::NixlPair`] and [`crate::nixl::NixlAgentRow`] rows). The collector serves
//! these types and the actuator reads them, so neither needs the other's crate and the
//! two cannot disagree about a field.

pub mod summary;
pub mod verdict;
pub mod window;
