//! Deciding: the collector's read ([`input`]), the policy engine that turns it into
//! OFF / DRY / LIVE ([`policy`]), with the cost model of one migration from
//! [`kvscope_wire::cost`], and how an evaluation reads to a person ([`plan`]). Pure but
//! for `input`'s HTTP client.

pub mod input;
pub mod plan;
pub mod policy;
