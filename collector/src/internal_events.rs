//! Everything the collector says about its input, one struct per thing (the kit's
//! [`InternalEvent`]): `emit()` logs with structured fields and bumps the matching
//! counter — the fold's [`CollectorCounters`](kvscope_wire::api::summary::CollectorCounters)
//! for records refused, the bus reader's
//! [`BusStatus`](kvscope_wire::api::summary::BusStatus) for what went wrong on the way —
//! so a counter never drifts from its log line. Warnings that can repeat fast are
//! rate-limited; the counters never are.

use crate::state::{lock, Shared};
pub use kvscope_kit::internal_events::{InternalEvent, LogLimiter};
use std::fmt::Display;
use std::time::Duration;
use tracing::{error, info, warn};

/// A record sent in parts that never came whole: dropped, never guessed at.
pub(crate) struct RecordIncomplete<'a> {
    pub seq: u64,
    pub reason: &'a str,
    pub lost_parts: u64,
}

static INCOMPLETE: LogLimiter = LogLimiter::new();

impl InternalEvent<Shared> for RecordIncomplete<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.analyzer).counters_mut().incomplete_records += 1;
        if let Some(suppressed) = INCOMPLETE.check() {
            warn!(
                seq = self.seq,
                reason = self.reason,
                lost_parts = self.lost_parts,
                suppressed,
                "A record sent in parts never came whole; dropped and counted."
            );
        }
    }
}

/// A record whose agent is not the one its subject names (forged, or misrouted).
pub(crate) struct RecordForeign<'a> {
    pub seq: u64,
    pub subject: &'a str,
    pub agent: &'a str,
}

static FOREIGN: LogLimiter = LogLimiter::new();

impl InternalEvent<Shared> for RecordForeign<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.analyzer).counters_mut().foreign_records += 1;
        if let Some(suppressed) = FOREIGN.check() {
            warn!(
                seq = self.seq,
                subject = self.subject,
                agent = self.agent,
                suppressed,
                "A record whose agent is not the one its subject names (or a bundled record outside its bundle's agent and model); not applied, counted."
            );
        }
    }
}

/// A record dated far ahead of this host's clock: quarantined.
pub(crate) struct RecordFromFuture<'a> {
    pub seq: u64,
    pub agent: &'a str,
    pub observed_ns: u64,
}

static FUTURE: LogLimiter = LogLimiter::new();

impl InternalEvent<Shared> for RecordFromFuture<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.analyzer).counters_mut().future_records += 1;
        if let Some(suppressed) = FUTURE.check() {
            warn!(
                seq = self.seq,
                agent = self.agent,
                observed_ns = self.observed_ns,
                suppressed,
                "A record dated far in the future; not applied, counted."
            );
        }
    }
}

/// A record dated after the stream stored it: its agent's clock is ahead, and the
/// record was moved back by the offset estimated (`ingest::clocks`).
pub struct RecordClockCorrected<'a> {
    pub agent: &'a str,
    pub ahead_ns: u64,
}

static CLOCK_AHEAD: LogLimiter = LogLimiter::new();

impl InternalEvent<Shared> for RecordClockCorrected<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.analyzer).counters_mut().records_clock_corrected += 1;
        if self.ahead_ns >= crate::ingest::clocks::REPORTED_AHEAD_NS {
            if let Some(suppressed) = CLOCK_AHEAD.check() {
                warn!(
                    agent = self.agent,
                    ahead_s = self.ahead_ns as f64 / 1e9,
                    suppressed,
                    "An agent's clock reads ahead of the stream's; its records' times are moved back by that much (kvscope_collector_agent_clock_ahead_seconds)."
                );
            }
        }
    }
}

/// Bus bytes that are not a record.
pub(crate) struct RecordUndecodable<'a> {
    pub seq: u64,
    pub error: &'a dyn Display,
}

static UNDECODABLE: LogLimiter = LogLimiter::new();

impl InternalEvent<Shared> for RecordUndecodable<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.analyzer).counters_mut().undecodable_records += 1;
        if let Some(suppressed) = UNDECODABLE.check() {
            warn!(seq = self.seq, error = %self.error, suppressed, "Undecodable record on the bus; skipped and counted.");
        }
    }
}

/// A stream record gone (expired or deleted) before this collector applied it.
pub(crate) struct RecordMissing<'a> {
    pub seq: u64,
    pub error: &'a dyn Display,
}

static MISSING: LogLimiter = LogLimiter::new();

impl InternalEvent<Shared> for RecordMissing<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.bus).missing_records += 1;
        if let Some(suppressed) = MISSING.check() {
            warn!(seq = self.seq, error = %self.error, suppressed, "A stream record is gone before it was applied; counted as missing.");
        }
    }
}

/// Stream records `from..to` were discarded by the stream's limits (age, size) before
/// this collector read them: counted as missing, all at once.
pub(crate) struct RecordsDiscarded {
    pub from: u64,
    pub to: u64,
}

impl InternalEvent<Shared> for RecordsDiscarded {
    fn emit(self, s: &Shared) {
        lock(&s.bus).missing_records += self.to - self.from;
        warn!(
            from_seq = self.from,
            to_seq = self.to - 1,
            "Stream records were discarded by the stream's age or size limit before this \
             collector applied them; counted as missing (it fell behind by more than the \
             stream keeps: raise stream_max_bytes, or give the collector more CPU)."
        );
    }
}

/// The stream's replicas elected another leader (its server went, or handed over).
pub(crate) struct StreamLeaderMoved<'a> {
    pub from: &'a str,
    pub to: &'a str,
}

impl InternalEvent<Shared> for StreamLeaderMoved<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.bus).stream_leader_changes += 1;
        info!(
            from = self.from,
            to = self.to,
            "The stream's leader moved to another server of the NATS cluster."
        );
    }
}

/// The stream was found made anew under its name (a server whose storage was wiped):
/// the consumer is made anew and the new stream followed from its first record.
pub(crate) struct StreamReset {
    pub applied_seq: u64,
    pub first_seq: u64,
}

impl InternalEvent<Shared> for StreamReset {
    fn emit(self, s: &Shared) {
        lock(&s.bus).stream_resets += 1;
        warn!(
            applied_seq = self.applied_seq,
            new_first_seq = self.first_seq,
            "The stream was made anew (its server's storage was wiped?): following the new \
             one from its first record with a consumer made anew. Records the old stream \
             held that this collector had not applied are gone."
        );
    }
}

/// A write to the recording failed: the recording stops (and readiness says so).
pub(crate) struct RecordingFailed<'a> {
    pub error: &'a dyn Display,
}

impl InternalEvent<Shared> for RecordingFailed<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.bus).recording_failed = true;
        error!(error = %self.error, "Cannot write the recording; recording stops.");
    }
}

/// Flushing the recording failed (it keeps trying at the next flush).
pub(crate) struct RecordingFlushFailed<'a> {
    pub error: &'a dyn Display,
}

static FLUSH: LogLimiter = LogLimiter::new();

impl InternalEvent<Shared> for RecordingFlushFailed<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.bus).recording_flush_failures += 1;
        if let Some(suppressed) = FLUSH.check() {
            warn!(error = %self.error, suppressed, "Cannot flush the recording.");
        }
    }
}

/// The NATS server refused this collector something (its credentials or permissions).
pub(crate) struct NatsRefused<'a> {
    pub error: &'a dyn Display,
}

static REFUSED: LogLimiter = LogLimiter::new();

impl InternalEvent<Shared> for NatsRefused<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.bus).nats_refusals += 1;
        if let Some(suppressed) = REFUSED.check() {
            warn!(error = %self.error, suppressed, "NATS refused this collector (check its [nats] credentials and the server's permissions).");
        }
    }
}

/// Connecting to NATS failed; the collector waits for it and tries again.
pub(crate) struct NatsUnreachable<'a> {
    pub url: &'a str,
    pub error: &'a dyn Display,
    pub retry_in: Duration,
}

impl InternalEvent<Shared> for NatsUnreachable<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.bus).connect_failures += 1;
        // Once per attempt: the backoff already spaces them (at most every 5 s).
        warn!(nats = self.url, error = %self.error, retry_in_ms = self.retry_in.as_millis() as u64, "Cannot connect to NATS yet; waiting for it (is nats-server -js running there, and does it accept this collector's [nats] credentials?).");
    }
}

/// The stream could not be created or opened yet; it is tried again.
pub(crate) struct StreamUnavailable<'a> {
    pub stream: &'a str,
    pub error: &'a dyn Display,
    pub retry_in: Duration,
}

impl InternalEvent<Shared> for StreamUnavailable<'_> {
    fn emit(self, s: &Shared) {
        // Counted with the failed connects: either way the bus is not reached yet.
        lock(&s.bus).connect_failures += 1;
        warn!(stream = self.stream, error = %self.error, retry_in_ms = self.retry_in.as_millis() as u64, "Cannot create or open the JetStream stream yet; trying again (is JetStream enabled, nats-server -js, and does its store hold stream_max_bytes?).");
    }
}

/// A pull from the durable consumer failed; it is retried.
pub(crate) struct PullFailed<'a> {
    pub error: &'a dyn Display,
}

static PULL: LogLimiter = LogLimiter::new();

impl InternalEvent<Shared> for PullFailed<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.bus).pull_failures += 1;
        if let Some(suppressed) = PULL.check() {
            warn!(error = %self.error, suppressed, "Pull from JetStream failed; retrying.");
        }
    }
}

/// A delivered message without JetStream metadata: skipped (its record, if any, is
/// fetched by sequence when the next delivery shows the gap).
pub(crate) struct MessageWithoutMetadata<'a> {
    pub error: &'a dyn Display,
}

static NO_METADATA: LogLimiter = LogLimiter::new();

impl InternalEvent<Shared> for MessageWithoutMetadata<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.bus).messages_without_metadata += 1;
        if let Some(suppressed) = NO_METADATA.check() {
            warn!(error = %self.error, suppressed, "JetStream message without metadata; skipped and counted.");
        }
    }
}

/// An ack failed: the record may be delivered again, and is skipped then.
pub(crate) struct AckFailed<'a> {
    pub seq: u64,
    pub error: &'a dyn Display,
}

static ACK: LogLimiter = LogLimiter::new();

impl InternalEvent<Shared> for AckFailed<'_> {
    fn emit(self, s: &Shared) {
        lock(&s.bus).ack_failures += 1;
        if let Some(suppressed) = ACK.check() {
            warn!(seq = self.seq, error = %self.error, suppressed, "Ack failed; the record may be delivered again and will be skipped then.");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fold::analyzer::FleetAnalyzer;
    use kvscope_wire::Subjects;

    #[test]
    fn each_event_bumps_its_counter() {
        let s = Shared::new(
            FleetAnalyzer::new(Default::default()),
            None,
            Subjects::new("t"),
        );
        let e = "boom";
        RecordIncomplete {
            seq: 1,
            reason: "r",
            lost_parts: 2,
        }
        .emit(&s);
        RecordForeign {
            seq: 2,
            subject: "x",
            agent: "a",
        }
        .emit(&s);
        RecordFromFuture {
            seq: 3,
            agent: "a",
            observed_ns: u64::MAX,
        }
        .emit(&s);
        RecordUndecodable { seq: 4, error: &e }.emit(&s);
        RecordMissing { seq: 5, error: &e }.emit(&s);
        RecordsDiscarded { from: 10, to: 13 }.emit(&s);
        RecordingFailed { error: &e }.emit(&s);
        RecordingFlushFailed { error: &e }.emit(&s);
        NatsRefused { error: &e }.emit(&s);
        NatsUnreachable {
            url: "nats://127.0.0.1:1",
            error: &e,
            retry_in: Duration::from_millis(200),
        }
        .emit(&s);
        StreamUnavailable {
            stream: "KVSCOPE_x",
            error: &e,
            retry_in: Duration::from_millis(200),
        }
        .emit(&s);
        PullFailed { error: &e }.emit(&s);
        MessageWithoutMetadata { error: &e }.emit(&s);
        AckFailed { seq: 6, error: &e }.emit(&s);
        let c = lock(&s.analyzer).counters().clone();
        assert_eq!(
            (
                c.incomplete_records,
                c.foreign_records,
                c.future_records,
                c.undecodable_records
            ),
            (1, 1, 1, 1)
        );
        let b = lock(&s.bus).clone();
        assert_eq!(
            (
                b.missing_records,
                b.recording_failed,
                b.recording_flush_failures,
                b.nats_refusals,
                b.connect_failures,
                b.pull_failures,
                b.messages_without_metadata,
                b.ack_failures
            ),
            (4, true, 1, 1, 2, 1, 1, 1)
        );
    }
}
