//! The agent's live counters: one atomic per field of [`AgentCounters`], bumped only by
//! the typed events in [`crate::internal_events`], read as a snapshot for heartbeats and
//! `/metrics`.

use kvscope_wire::AgentCounters;
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! agent_stats {
    ($($(#[$doc:meta])* $field:ident),* $(,)?) => {
        /// Live counterpart of [`AgentCounters`] (same fields, same meaning).
        #[derive(Debug, Default)]
        pub struct AgentStats {
            $($(#[$doc])* pub $field: AtomicU64,)*
        }

        impl AgentStats {
            /// The counters as they are now. Listing every field (no `..Default`) makes a
            /// field added to the wire type a compile error here until the agent counts it.
            pub fn snapshot(&self) -> AgentCounters {
                AgentCounters {
                    $($field: self.$field.load(Ordering::Relaxed),)*
                }
            }

            /// `(name, value)` of every counter, for the Prometheus exposition.
            pub fn named(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($field), self.$field.load(Ordering::Relaxed)),)*]
            }
        }
    };
}

agent_stats!(
    kv_batches,
    kv_events,
    kv_bad_frames,
    kv_decode_errors,
    kv_unknown_events,
    kv_malformed_events,
    kv_sequence_gaps,
    kv_missed_batches,
    kv_sequence_resets,
    log_lines,
    log_malformed_lines,
    decisions_joined,
    decisions_unjoined,
    migration_lines,
    published,
    publish_dropped,
    publish_errors,
    records_late,
);

/// Add `n` to a counter.
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_reads_every_counter() {
        let s = AgentStats::default();
        add(&s.kv_batches, 2);
        add(&s.publish_dropped, 5);
        let c = s.snapshot();
        assert_eq!(c.kv_batches, 2);
        assert_eq!(c.publish_dropped, 5);
        assert_eq!(s.named().len(), 18);
    }
}
