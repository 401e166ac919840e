//! The fold: records applied in stream order to a mirror of every worker's cache, every
//! routing decision judged against it, windows cut on record time. Pure — no clocks, no
//! I/O — so a live run and a replay of the same records give the same figures.

pub mod analyzer;
pub mod fixtures;
pub mod fleet_index;
pub mod lower_tiers;
pub mod nixl;
pub mod recent_changes;
pub mod tenants;
pub mod verdict;
pub mod window;
