//! Events of the JetStream publisher and the recording.

use super::{InternalEvent, LogLimiter};
use crate::counters::{add, AgentStats};
use tracing::{debug, error, info, trace, warn};

/// A message of `records` records acknowledged by JetStream.
pub(crate) struct RecordPublished {
    pub records: usize,
}

impl InternalEvent<AgentStats> for RecordPublished {
    fn emit(self, stats: &AgentStats) {
        trace!(records = self.records, "Message published.");
        add(&stats.published, self.records as u64);
        add(&stats.messages_published, 1);
    }
}

/// A record dropped because the local buffer was full (in records or in bytes) while
/// NATS was away.
pub(crate) struct PublishDropped<'a> {
    pub capacity: usize,
    pub max_bytes: usize,
    /// The record's size.
    pub bytes: usize,
    pub subject: &'a str,
}

static DROPPED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for PublishDropped<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = DROPPED.check() {
            warn!(capacity = self.capacity, max_bytes = self.max_bytes, bytes = self.bytes, subject = %self.subject, suppressed, "Local buffer full; record dropped.");
        }
        add(&stats.publish_dropped, 1);
    }
}

/// A record larger than one bus message was sent in parts (the collector joins them).
pub(crate) struct RecordSplit<'a> {
    pub bytes: usize,
    pub parts: usize,
    pub subject: &'a str,
}

impl InternalEvent<AgentStats> for RecordSplit<'_> {
    fn emit(self, stats: &AgentStats) {
        debug!(bytes = self.bytes, parts = self.parts, subject = %self.subject, "Record sent in parts.");
        add(&stats.records_split, 1);
    }
}

/// JetStream refused a message itself (not the connection): its records are set aside,
/// counted, and the records behind them go on. The agent's recording still has them.
pub(crate) struct RecordSetAside<'a> {
    pub error: &'a str,
    pub bytes: usize,
    pub records: usize,
    pub subject: &'a str,
}

static SET_ASIDE: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for RecordSetAside<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = SET_ASIDE.check() {
            error!(error = %self.error, bytes = self.bytes, records = self.records, subject = %self.subject, suppressed, "JetStream refused a message; its records are set aside, the others go on.");
        }
        add(&stats.records_set_aside, self.records as u64);
    }
}

/// A record arrived later than the reorder window allows: sent at once, out of its
/// event-time order (the collector sees it stamped with its predecessor's time).
pub(crate) struct RecordLate<'a> {
    pub behind_ms: f64,
    pub subject: &'a str,
}

static LATE: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for RecordLate<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = LATE.check() {
            warn!(behind_ms = self.behind_ms, subject = %self.subject, suppressed, "Record arrived after the reorder window; sent out of order. Raise reorder_window_ms if this repeats.");
        }
        add(&stats.records_late, 1);
    }
}

/// A record's time stamp moved back by its source's estimated clock offset (the
/// source's clock reads ahead of this host's).
pub struct RecordClockCorrected<'a> {
    pub source: &'a str,
    pub ahead_ns: u64,
}

static CORRECTED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for RecordClockCorrected<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = CORRECTED.check() {
            info!(source = %self.source, ahead_ms = self.ahead_ns as f64 / 1e6, suppressed, "Source clock reads ahead of this host's; its time stamps are moved back by that much.");
        }
        add(&stats.records_clock_corrected, 1);
    }
}

/// A decision whose router log lines all reached the agent late: the router's clock may
/// be behind, so it is flagged.
pub(crate) struct DecisionClockBehind {
    pub floor_ns: u64,
}

static BEHIND: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for DecisionClockBehind {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = BEHIND.check() {
            warn!(lag_floor_ms = self.floor_ns as f64 / 1e6, suppressed, "Every router log line reached the agent late for seconds: the router's clock may be behind this host's (or its log is delivered late). Its decisions are flagged as possibly judged early.");
        }
        add(&stats.decisions_clock_behind, 1);
    }
}

/// A publish (or the stream set-up) failed; the record stays buffered and is retried.
pub(crate) struct PublishFailed<'a> {
    pub error: &'a str,
    pub buffered: usize,
}

static FAILED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for PublishFailed<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = FAILED.check() {
            warn!(error = %self.error, buffered = self.buffered, suppressed, "Publishing to JetStream failed; retrying.");
        }
        add(&stats.publish_errors, 1);
    }
}

/// The NATS server refused this agent: its credentials, or a subject its permissions
/// do not allow. Counted in `bus_refusals`; the connection is retried.
pub(crate) struct BusRefused<'a> {
    pub error: &'a str,
}

static REFUSED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for BusRefused<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = REFUSED.check() {
            warn!(error = %self.error, suppressed, "NATS refused this agent (check its [nats] credentials and the server's permissions for kvscope.<cluster>.<agent_id>.>); retrying.");
        }
        add(&stats.bus_refusals, 1);
    }
}

/// The stream exists with the agent's configuration. No counter.
pub(crate) struct StreamReady<'a> {
    pub stream: &'a str,
}

impl InternalEvent<AgentStats> for StreamReady<'_> {
    fn emit(self, _stats: &AgentStats) {
        info!(stream = %self.stream, "JetStream stream ready.");
    }
}

/// The server refused to create or update the stream with this agent's limits, but the
/// stream exists: the agent publishes to it as it is.
pub(crate) struct StreamKeptAsIs<'a> {
    pub stream: &'a str,
    pub error: &'a str,
}

impl InternalEvent<AgentStats> for StreamKeptAsIs<'_> {
    fn emit(self, _stats: &AgentStats) {
        warn!(
            stream = %self.stream,
            error = %self.error,
            "The server refused this agent's stream limits (stream_max_age_secs, \
             stream_max_bytes); publishing to the stream as it is."
        );
    }
}

/// Writing the local recording failed: counted; the record still goes to NATS.
pub(crate) struct RecordingWriteFailed<'a> {
    pub error: &'a str,
}

static RECORDING: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for RecordingWriteFailed<'_> {
    fn emit(self, stats: &AgentStats) {
        add(&stats.recording_write_failures, 1);
        if let Some(suppressed) = RECORDING.check() {
            warn!(error = %self.error, suppressed, "Cannot write the recording.");
        }
    }
}
