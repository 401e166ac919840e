//! Readiness that tells the truth: the agent is ready only while it does its job.
//!
//! Connected to the bus is not enough. A source can be unreadable (a router log that is
//! not a regular file, or missing), the records can stop leaving while the sources
//! produce (a server that drops every publish), and discovery can stop refreshing (a
//! read that never returns): each answers `/readyz` 503 with its reason here, and
//! recovers by itself when the cause goes.
//!
//! Sources report their state in [`SourceStates`]; [`run`] looks every second and sets
//! the checks.

use crate::counters::AgentStats;
use crate::sink::RecordSink;
use kvscope_kit::clock::now_ns;
use kvscope_kit::Health;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// A followed router log cannot be read (its reason: missing, not a regular file, …).
pub(crate) const ROUTER_LOG_CHECK: &str = "router_log";
/// Records wait in the buffer and none has left for [`PUBLISH_STALL`].
pub(crate) const PUBLISHING_CHECK: &str = "publishing";
/// Discovery has not been read for [`DiscoveryFreshness::stale_after`].
pub(crate) const DISCOVERY_FRESH_CHECK: &str = "discovery_fresh";

/// How long a source may be unreadable before the agent is not ready: a rotation or a
/// re-pointed link is a moment, not an outage.
pub(crate) const UNAVAILABLE_GRACE: Duration = Duration::from_secs(5);
/// How long records may wait with none published before the agent is not ready.
pub(crate) const PUBLISH_STALL: Duration = Duration::from_secs(30);

/// The sources that cannot be read now, by name, with why and since when.
#[derive(Debug, Default)]
pub struct SourceStates {
    unavailable: Mutex<BTreeMap<String, (String, u64)>>,
}

impl SourceStates {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (String, u64)>> {
        self.unavailable.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `source` cannot be read, for `reason` (since its first such report).
    pub fn unavailable(&self, source: &str, reason: &str) {
        let mut m = self.map();
        match m.get_mut(source) {
            Some((r, _)) => {
                if r != reason {
                    *r = reason.to_string();
                }
            }
            None => {
                m.insert(source.to_string(), (reason.to_string(), now_ns()));
            }
        }
    }

    /// `source` is read again, or no longer followed.
    pub fn available(&self, source: &str) {
        self.map().remove(source);
    }

    /// The sources unreadable for at least `grace` at `now`, with their reasons.
    pub fn stuck(&self, now: u64, grace: Duration) -> Vec<(String, String)> {
        let grace = grace.as_nanos() as u64;
        self.map()
            .iter()
            .filter(|(_, (_, since))| now.saturating_sub(*since) >= grace)
            .map(|(s, (r, _))| (s.clone(), r.clone()))
            .collect()
    }
}

/// When discovery was last read whole, and how stale it may get.
#[derive(Debug)]
pub struct DiscoveryFreshness {
    pub last_read_ns: AtomicU64,
    pub stale_after: Duration,
}

impl DiscoveryFreshness {
    /// A store polled every `poll`: stale after five polls, and never sooner than 15 s.
    pub fn new(poll: Duration) -> Arc<Self> {
        Arc::new(Self {
            last_read_ns: AtomicU64::new(now_ns()),
            stale_after: (poll * 5).max(Duration::from_secs(15)),
        })
    }

    pub(crate) fn read_now(&self) {
        self.last_read_ns.store(now_ns(), Ordering::Relaxed);
    }
}

/// Where publishing stood at the last look: records published, and since when none
/// has left while some wait.
#[derive(Debug, Default)]
struct Publishing {
    published: u64,
    stalled_since: Option<u64>,
}

/// What the watchdog looks at.
pub struct Watched {
    pub health: Arc<Health>,
    pub sources: Arc<SourceStates>,
    pub sink: Arc<RecordSink>,
    pub stats: Arc<AgentStats>,
    pub discovery: Option<Arc<DiscoveryFreshness>>,
}

/// Look every second until `stop`.
pub async fn run(w: Watched, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut publishing = Publishing::default();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        look(&w, &mut publishing, now_ns());
    }
}

fn look(w: &Watched, publishing: &mut Publishing, now: u64) {
    let stuck = w.sources.stuck(now, UNAVAILABLE_GRACE);
    if stuck.is_empty() {
        w.health.ok(ROUTER_LOG_CHECK);
    } else {
        let said: Vec<String> = stuck.iter().map(|(s, r)| format!("{s}: {r}")).collect();
        w.health.fail(ROUTER_LOG_CHECK, said.join("; "));
    }

    let published = w.stats.published.load(Ordering::Relaxed);
    let waiting = w.sink.buffered();
    if published != publishing.published || waiting == 0 {
        publishing.published = published;
        publishing.stalled_since = None;
        w.health.ok(PUBLISHING_CHECK);
    } else {
        let since = *publishing.stalled_since.get_or_insert(now);
        let stalled = Duration::from_nanos(now.saturating_sub(since));
        if stalled >= PUBLISH_STALL {
            w.health.fail(
                PUBLISHING_CHECK,
                format!(
                    "{waiting} records waiting and none published for {} s (see the log: the \
                     server may be refusing or dropping the connection)",
                    stalled.as_secs()
                ),
            );
        }
    }

    if let Some(d) = &w.discovery {
        let age = Duration::from_nanos(now.saturating_sub(d.last_read_ns.load(Ordering::Relaxed)));
        if age >= d.stale_after {
            w.health.fail(
                DISCOVERY_FRESH_CHECK,
                format!(
                    "the discovery store was last read whole {} s ago (a read is stuck)",
                    age.as_secs()
                ),
            );
        } else {
            w.health.ok(DISCOVERY_FRESH_CHECK);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_unreadable_past_the_grace_fails_until_read_again() {
        let s = SourceStates::new();
        s.unavailable("router.log", "not a regular file (a character device)");
        let since = s.map()["router.log"].1;
        assert!(
            s.stuck(since, UNAVAILABLE_GRACE).is_empty(),
            "a moment is no outage"
        );
        let later = since + UNAVAILABLE_GRACE.as_nanos() as u64;
        assert_eq!(
            s.stuck(later, UNAVAILABLE_GRACE),
            vec![(
                "router.log".to_string(),
                "not a regular file (a character device)".to_string()
            )]
        );
        // Another reason keeps the first report's time.
        s.unavailable("router.log", "missing");
        assert_eq!(s.stuck(later, UNAVAILABLE_GRACE)[0].1, "missing");
        s.available("router.log");
        assert!(s.stuck(later, UNAVAILABLE_GRACE).is_empty());
    }
}
