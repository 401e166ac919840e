//! Everything a daemon says about itself, one struct per thing (Vector's
//! `internal_events`): `emit()` logs with structured fields and bumps the matching
//! counter, so a counter never drifts from its log line. Each daemon keeps its events
//! and counters in its own `internal_events` module; noisy warnings are rate-limited
//! with a [`LogLimiter`], the counters never are.

use std::sync::atomic::{AtomicU64, Ordering};

/// A thing that happened inside a daemon, counted in `Counters`.
pub trait InternalEvent<Counters: ?Sized> {
    /// Log it (at most once a second where it can repeat fast) and count it.
    fn emit(self, counters: &Counters);
}

/// At most one log line per second per call site; returns how many were suppressed
/// since the last one logged, or `None` when this one should be suppressed too.
pub struct LogLimiter {
    last_sec: AtomicU64,
    suppressed: AtomicU64,
}

impl LogLimiter {
    pub const fn new() -> Self {
        Self {
            last_sec: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    pub fn check(&self) -> Option<u64> {
        let now = crate::clock::now_ns() / crate::clock::NS_PER_SEC;
        let last = self.last_sec.load(Ordering::Relaxed);
        if now != last
            && self
                .last_sec
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

impl Default for LogLimiter {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limiter_lets_one_through_per_second() {
        let l = LogLimiter::new();
        assert_eq!(l.check(), Some(0));
        assert_eq!(l.check(), None);
        assert_eq!(l.check(), None);
    }
}
