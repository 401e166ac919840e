//! Acting on a decision: the mode and the operator's holds ([`mode`]), the backends that
//! switch the router's migration ([`backend`]), migration directives and their ledger
//! ([`directive`]) sent to a data plane ([`sink`]), and the audit log of every change
//! ([`audit`]).

pub mod audit;
pub mod backend;
pub mod directive;
pub mod mode;
pub mod sink;
