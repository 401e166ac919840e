//! Per-publisher sequence tracking (pure). vLLM numbers each publisher's batches from 0
//! and starts again from 0 when the engine restarts, so a number that goes backwards
//! (or repeats) means a new engine with an empty cache.

use kvscope_wire::SequenceStatus;
use std::collections::HashMap;

#[derive(Debug, Default)]
pub struct SequenceTracker {
    last: HashMap<String, u64>,
}

impl SequenceTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Classify `seq` from `publisher` against the previous number seen from it.
    pub fn observe(&mut self, publisher: &str, seq: u64) -> SequenceStatus {
        let status = self.peek(publisher, seq);
        self.last.insert(publisher.to_string(), seq);
        status
    }

    /// [`Self::observe`] without taking the number.
    pub fn peek(&self, publisher: &str, seq: u64) -> SequenceStatus {
        match self.last.get(publisher) {
            None => SequenceStatus::First,
            Some(&last) if last.checked_add(1) == Some(seq) => SequenceStatus::InOrder,
            Some(&last) if seq > last => SequenceStatus::Gap {
                missed: seq - last - 1,
            },
            Some(_) => SequenceStatus::Reset,
        }
    }

    /// Take `seq` as the last number seen (a batch recovered out of band).
    pub fn set(&mut self, publisher: &str, seq: u64) {
        self.last.insert(publisher.to_string(), seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SequenceStatus::*;

    #[test]
    fn in_order_gaps_and_resets_per_publisher() {
        let mut t = SequenceTracker::new();
        let a = "tcp://127.0.0.1:1";
        let b = "tcp://127.0.0.1:2";
        assert_eq!(t.observe(a, 5), First);
        assert_eq!(t.observe(a, 6), InOrder);
        assert_eq!(t.observe(b, 0), First);
        assert_eq!(t.observe(a, 10), Gap { missed: 3 });
        assert_eq!(t.observe(a, 11), InOrder);
        assert_eq!(t.observe(b, 1), InOrder);
        // Engine restart: numbering starts again.
        assert_eq!(t.observe(a, 0), Reset);
        assert_eq!(t.observe(a, 1), InOrder);
        // A restart after a single batch repeats the number.
        assert_eq!(t.observe(b, 0), Reset);
        // A restart seen late (first batches of the new engine missed) is a gap from 0.
        assert_eq!(t.observe(b, 3), Gap { missed: 2 });
    }

    #[test]
    fn the_largest_numbers_do_not_overflow() {
        let mut t = SequenceTracker::new();
        assert_eq!(t.observe("p", u64::MAX - 1), First);
        assert_eq!(t.observe("p", u64::MAX), InOrder);
        assert_eq!(t.observe("p", 0), Reset);
        assert_eq!(
            t.observe("p", u64::MAX),
            Gap {
                missed: u64::MAX - 1
            }
        );
    }
}
