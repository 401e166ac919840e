//! Each agent's clock against the stream's. A record's time is its agent's clock, and one
//! host's clock ahead of the others' (inside the minute a record may lie ahead before it
//! is quarantined) would otherwise carry the watermark with it: every other agent's
//! records late, windows closed before their records came. The stream stamps each
//! message when it stores it, and a record cannot be stored before it was observed, so
//! a record dated after its message was stored proves its agent's clock ahead by at least
//! that much. Each agent's offset is learned from its own records as the agent learns its
//! sources' ([`ClockAhead`]), its records are moved back by it and never left after their
//! storing, and the offsets are on `/metrics` by agent, so the skewed host is named.

use kvscope_kit::clock::ClockAhead;
use std::collections::HashMap;

/// At most this many agents' clocks are kept: agent names come from the bus, and a
/// flood of names must not grow the collector. Past it, a new agent's records are only
/// clamped to their storing (never ahead of it), not corrected by an offset.
pub(crate) const MAX_AGENTS: usize = 4096;

/// An agent's offset at least this large is reported in the log (it is always on
/// `/metrics`).
pub(crate) const REPORTED_AHEAD_NS: u64 = kvscope_kit::clock::NS_PER_SEC;

#[derive(Debug, Default)]
pub struct AgentClocks {
    by_agent: HashMap<String, Tracked>,
}

#[derive(Debug, Default)]
struct Tracked {
    clock: ClockAhead,
    last_stored_ns: u64,
}

/// An agent's record time after the correction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Corrected {
    pub observed_ns: u64,
    /// The agent's estimated offset when it was moved back by one (0: not moved).
    pub ahead_ns: u64,
}

impl AgentClocks {
    /// `agent`'s record observed at `observed_ns`, stored by the stream at `stored_ns`.
    pub(crate) fn correct(&mut self, agent: &str, observed_ns: u64, stored_ns: u64) -> Corrected {
        if !self.by_agent.contains_key(agent) {
            if self.by_agent.len() >= MAX_AGENTS {
                self.forget_quiet(stored_ns);
            }
            if self.by_agent.len() < MAX_AGENTS {
                self.by_agent.insert(agent.to_string(), Tracked::default());
            }
        }
        let Some(tracked) = self.by_agent.get_mut(agent) else {
            return Corrected {
                observed_ns: observed_ns.min(stored_ns),
                ahead_ns: 0,
            };
        };
        tracked.last_stored_ns = tracked.last_stored_ns.max(stored_ns);
        let (observed_ns, moved) = tracked.clock.observe(observed_ns, stored_ns);
        Corrected {
            observed_ns,
            ahead_ns: if moved { tracked.clock.ahead_ns() } else { 0 },
        }
    }

    /// Drop the agents nothing was stored from for two periods (their offsets are 0
    /// by then anyway).
    fn forget_quiet(&mut self, now_ns: u64) {
        let quiet = 2 * ClockAhead::PERIOD_NS;
        self.by_agent
            .retain(|_, t| now_ns.saturating_sub(t.last_stored_ns) < quiet);
    }

    /// Every agent's estimated offset, by name (0 for the ones not ahead), for the
    /// agents heard from over the last periods.
    pub fn offsets(&self) -> Vec<(&str, u64)> {
        let mut all: Vec<(&str, u64)> = self
            .by_agent
            .iter()
            .filter(|(_, t)| t.clock.samples() > 0)
            .map(|(a, t)| (a.as_str(), t.clock.ahead_ns()))
            .collect();
        all.sort_unstable();
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = kvscope_kit::clock::NS_PER_SEC;

    #[test]
    fn a_skewed_agent_is_moved_back_and_named_a_healthy_one_is_untouched() {
        let mut clocks = AgentClocks::default();
        let t0 = 1_800_000_000 * S;
        for i in 0..20 {
            let stored = t0 + i * 100_000_000;
            // A healthy agent: observed 5 ms before storing.
            let ok = clocks.correct("healthy", stored - 5_000_000, stored);
            assert_eq!(
                ok,
                Corrected {
                    observed_ns: stored - 5_000_000,
                    ahead_ns: 0
                }
            );
            // One 55 s ahead, its records stored 5 ms after they were observed.
            let skewed = clocks.correct("skewed", stored + 55 * S - 5_000_000, stored);
            assert!(skewed.observed_ns <= stored, "never after its storing");
            if i > 0 {
                // Its offset as far as it can be known: the skew less the delay (a
                // delay can never be told from a clock).
                assert_eq!(skewed.observed_ns, stored, "{i}");
                assert_eq!(skewed.ahead_ns, 55 * S - 5_000_000);
            }
        }
        assert_eq!(
            clocks.offsets(),
            vec![("healthy", 0), ("skewed", 55 * S - 5_000_000)]
        );
    }

    #[test]
    fn the_agents_kept_are_bounded() {
        let mut clocks = AgentClocks::default();
        let t0 = 1_800_000_000 * S;
        for i in 0..MAX_AGENTS as u64 + 10 {
            let c = clocks.correct(&format!("a{i}"), t0 + 10 * S, t0);
            assert_eq!(c.observed_ns, t0, "clamped to its storing, tracked or not");
        }
        assert_eq!(clocks.by_agent.len(), MAX_AGENTS);
        // Once the first ones have gone quiet, new agents take their places.
        clocks.correct("late", t0 + 5 * S, t0 + 5 * S);
        assert_eq!(clocks.by_agent.len(), 1);
    }
}
