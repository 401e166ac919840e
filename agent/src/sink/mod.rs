//! Where every record the taps produce goes: held briefly to restore the order in which
//! things happened, stamped into an [`Envelope`] (agent id and event time, never
//! decreasing, so the stream's order and its times agree), appended to the optional
//! recording, and queued in the bounded buffer the publisher drains to NATS. When the
//! buffer is full the new record is dropped and counted; the recording still gets it, so
//! a local recording holds everything the agent observed.
//!
//! Why the hold: the taps see things late by different amounts. A routing decision
//! reaches the agent through the router's log file (written, then noticed by a poll),
//! while the KV events of the very prefill it caused arrive over ZMQ at once. Measured on
//! the lab, 312 of 432 decisions reached the agent 38 ms (p50; max 86 ms) *after* the
//! chosen worker had stored the request's own new blocks, which made the collector judge
//! them against a cache that already held their prefix. So each record carries the time
//! its source gives it (the log line's timestamp, the engine's batch timestamp) and waits
//! up to the reorder window; records leave in event-time order. One arriving later than
//! the window is released at once, stamped no earlier than its predecessor, and counted.
//!
//! The window is only the bound for a source that has gone quiet. Each tap is a
//! [`SourceId`] whose records arrive in its own event-time order (one engine publisher,
//! the router log), so once every source has delivered something from time t or later,
//! nothing earlier than t can still come, and records up to t leave at once: under load
//! a record waits until the slowest source has moved past it (a log poll, the next KV
//! batch), not for the whole window. A source that stays silent holds records for its
//! own window: how late its records can reach the agent. The router log's is long (its
//! lines come tens of ms after the events); an engine publisher's batches arrive within
//! a millisecond unless the agent falls behind, so its window may be far shorter (the
//! trade-off: a batch later than that is counted as late, and a decision may already
//! have been judged without it). Records from no source (heartbeats, NIXL reports) take
//! their place in the order but hold nothing back.
//!
//! A quiet publisher need not cost its whole window, though: what the window guards
//! against is a batch reaching the agent late, and how late batches reach it is measured
//! on every batch. So a publisher (added with [`RecordSink::add_publisher`]) is waited
//! for twice the largest delivery lag any publisher showed in the last 5–10 s, plus
//! 2 ms, and never longer than its window. When the agent falls behind (a loaded host),
//! the lags it measures grow and so does the wait; a batch later than even that is
//! counted as late, as with a fixed window. Before any batch has been measured, the
//! window applies.
//!
//! Sources' clocks. A record's time is its source's clock, and the router's host and the
//! engines' need not agree with this one. A source can never deliver a record before it
//! happened, so a time stamp ahead of the agent's clock proves the source's clock is
//! ahead by at least that much; clamping each such stamp to its arrival (what the sink
//! did) leaves it late by its delivery delay, which for a polled log is enough to put a
//! decision after the KV events of its own prefill. So each source's offset is estimated
//! from the amounts its stamps were ahead over the last 2–4 s (the second largest, so one
//! stray line does not move a whole source; samples more than 60 s ahead are not
//! taken), and every stamp from it is moved back by that much (counted,
//! `records_clock_corrected`). A clock *behind* cannot be told apart from slow delivery,
//! so it is only shown: the smallest delay with which the source's records reached the
//! agent over the same seconds (its lag floor). When a router log's floor is 50 ms or
//! more (and within its reorder window: later than that is lateness, counted as such),
//! its decisions may be stamped early and judged before events they depend on; they
//! carry the floor (`clock_behind_ms`), and the collector flags them. Both figures
//! are on `/metrics` per source.

pub mod publisher;

use crate::counters::AgentStats;
use crate::internal_events::{
    InternalEvent, PublishDropped, RecordClockCorrected, RecordLate, RecordingWriteFailed,
};
use kvscope_kit::clock::{now_ns, ClockAhead, TwoPeriods};
use kvscope_wire::bundle::{BundleWriter, MAX_BUNDLE_BYTES, MAX_BUNDLE_RECORDS};
use kvscope_wire::recording::RecordingWriter;
use kvscope_wire::{Envelope, Record, Subjects};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;

/// A message ready to publish: one record's envelope JSON, serialized once when it was
/// stamped, or a bundle of consecutive records of one scope (`kvscope_wire::bundle`).
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// Position in this agent run's output, for JetStream's de-duplication id.
    pub local_seq: u64,
    pub subject: String,
    pub payload: bytes::Bytes,
    /// Records in it.
    pub records: usize,
    /// Their envelopes' JSON bytes (what the buffer's byte limit counts).
    pub record_bytes: usize,
}

/// The message being filled: records stamped one after another join it while they share
/// its scope, until the publisher takes it ([`RecordSink::peek`]) or it is full. What it
/// holds never changes once taken, so a re-sent message keeps its de-duplication id's
/// meaning.
struct OpenMessage {
    local_seq: u64,
    /// `kvscope.<cluster>.<agent>[.m.<model>]` (`Subjects::scope_of`).
    scope: String,
    first_subject: String,
    first: bytes::Bytes,
    /// Written once a second record joins.
    bundle: Option<BundleWriter>,
    records: usize,
    record_bytes: usize,
}

impl OpenMessage {
    /// Whether a record of `subject` and `json` fits: a bundle never grows past
    /// `kvscope_wire::bundle`'s limits, so a record too large for one goes alone (in
    /// parts, if it must), as it always did.
    fn takes(&self, subject: &str, json: &[u8]) -> bool {
        let bytes = match &self.bundle {
            Some(b) => b.bytes(),
            None => BundleWriter::line_bytes(&self.first_subject, &self.first),
        };
        self.records < MAX_BUNDLE_RECORDS
            && bytes + BundleWriter::line_bytes(subject, json) <= MAX_BUNDLE_BYTES
    }

    fn push(&mut self, subject: &str, payload: &bytes::Bytes) {
        let bundle = self.bundle.get_or_insert_with(|| {
            let mut b = BundleWriter::default();
            b.push(&self.first_subject, &self.first);
            b
        });
        bundle.push(subject, payload);
        self.records += 1;
        self.record_bytes += payload.len();
    }

    fn finish(self) -> Outgoing {
        let (subject, payload) = match self.bundle {
            Some(b) => (
                Subjects::bundle_subject(&self.scope),
                bytes::Bytes::from(b.finish()),
            ),
            None => (self.first_subject, self.first),
        };
        Outgoing {
            local_seq: self.local_seq,
            subject,
            payload,
            records: self.records,
            record_bytes: self.record_bytes,
        }
    }
}

/// A record waiting in the reorder window, ordered by event time, then arrival.
struct Held {
    event_ns: u64,
    arrival: u64,
    record: Record,
}

impl PartialEq for Held {
    fn eq(&self, other: &Self) -> bool {
        (self.event_ns, self.arrival) == (other.event_ns, other.arrival)
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Held {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.event_ns, self.arrival).cmp(&(other.event_ns, other.arrival))
    }
}

/// One input whose records reach the sink in event-time order (an engine's KV event
/// publisher, the router log): see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceId(usize);

/// How far one source has got.
#[derive(Debug, Clone)]
struct Progress {
    /// For `/metrics`: `router_log`, a publisher's endpoint, ...
    name: String,
    /// Gone ([`RecordSink::retire_source`]): no longer shown.
    retired: bool,
    clock: ClockAhead,
    /// The latest event time it has delivered (0: nothing yet).
    last_ns: u64,
    /// How late its records may reach the sink: records wait at most this long for it.
    window_ns: u64,
    /// An engine's KV event publisher: waited for as long as publishers' measured
    /// delivery lag says, within the window.
    publisher: bool,
    /// Its records may come out of their time order (within the window): every record
    /// waits the whole window for it, whatever it delivered last.
    held: bool,
}

impl Progress {
    /// This source's stamp `t`, seen at `now`, corrected by its clock's estimated offset
    /// (counted when moved).
    fn take_stamp(&mut self, t: u64, now: u64, stats: &AgentStats) -> u64 {
        let (t, corrected) = self.clock.observe(t, now);
        if corrected {
            RecordClockCorrected {
                source: &self.name,
                ahead_ns: self.clock.ahead_ns(),
            }
            .emit(stats);
        }
        t
    }

    /// How long records wait for this source while it is quiet.
    fn wait_ns(&self, lag: &DeliveryLag) -> u64 {
        match (self.publisher, lag.bound_ns()) {
            (true, Some(bound)) => bound.min(self.window_ns),
            _ => self.window_ns,
        }
    }

    /// Whether nothing from this source can still come before `t` at `now`.
    fn passed(&self, t: u64, now: u64, lag: &DeliveryLag) -> bool {
        (!self.held && self.last_ns >= t) || t.saturating_add(self.wait_ns(lag)) <= now
    }
}

/// The largest delay, from a KV batch's engine time stamp to its arrival here, over the
/// last one or two periods.
#[derive(Debug, Default)]
struct DeliveryLag(TwoPeriods<Option<u64>>);

impl DeliveryLag {
    const PERIOD_NS: u64 = 5_000_000_000;
    const MARGIN_NS: u64 = 2_000_000;

    fn observe(&mut self, lag_ns: u64, now: u64) {
        let max = self.0.current_at(now, Self::PERIOD_NS);
        *max = Some(max.map_or(lag_ns, |m| m.max(lag_ns)));
    }

    /// How long a quiet publisher is waited for: twice the largest recent lag plus a
    /// margin; `None` before any batch was measured.
    fn bound_ns(&self) -> Option<u64> {
        let max = match (*self.0.current(), *self.0.previous()) {
            (Some(a), Some(b)) => a.max(b),
            (a, b) => a.or(b)?,
        };
        Some(max.saturating_mul(2).saturating_add(Self::MARGIN_NS))
    }
}

/// A router log whose lag floor is at least this may be behind (see the module docs).
const BEHIND_FLAG_NS: u64 = 50_000_000;

/// One source's clock as `/metrics` shows it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SourceClockReading {
    pub name: String,
    /// How far its clock reads ahead of the agent's (ns): what its stamps are moved back.
    pub ahead_ns: u64,
    /// The smallest delay its recent records reached the agent with (ns).
    pub lag_floor_ns: Option<u64>,
}

struct Inner {
    held: BinaryHeap<Reverse<Held>>,
    sources: Vec<Progress>,
    lag: DeliveryLag,
    arrivals: u64,
    buffer: VecDeque<Outgoing>,
    /// The message after the last in `buffer`, still taking records.
    open: Option<OpenMessage>,
    /// Records in `buffer` and `open`.
    buffered_records: usize,
    /// Their envelopes' JSON bytes.
    buffered_bytes: usize,
    last_ns: u64,
    next_seq: u64,
    recording: Option<RecordingWriter>,
    /// Each worker's model, from the worker records passing through: the subjects of
    /// its KV events and decisions (`kvscope_wire::subject`).
    worker_models: BTreeMap<u64, String>,
}

pub struct RecordSink {
    agent: String,
    subjects: Subjects,
    capacity: usize,
    max_bytes: usize,
    stats: Arc<AgentStats>,
    inner: Mutex<Inner>,
    ready: Notify,
    /// A record became the first to leave (the release timer re-arms).
    head_changed: Notify,
}

impl RecordSink {
    /// Records wait for the sources added with [`Self::add_source`]; the buffer holds
    /// at most `capacity` records and `max_bytes` of their JSON.
    pub fn new(
        agent: &str,
        subjects: Subjects,
        capacity: usize,
        max_bytes: usize,
        recording: Option<&Path>,
        stats: Arc<AgentStats>,
    ) -> anyhow::Result<Self> {
        let recording = recording.map(RecordingWriter::append).transpose()?;
        Ok(Self {
            agent: agent.to_string(),
            subjects,
            capacity: capacity.max(1),
            max_bytes: max_bytes.max(1),
            stats,
            inner: Mutex::new(Inner {
                held: BinaryHeap::new(),
                sources: Vec::new(),
                lag: DeliveryLag::default(),
                arrivals: 0,
                buffer: VecDeque::new(),
                open: None,
                buffered_records: 0,
                buffered_bytes: 0,
                last_ns: 0,
                next_seq: 0,
                recording,
                worker_models: BTreeMap::new(),
            }),
            ready: Notify::new(),
            head_changed: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new input whose records will arrive in their event-time order, at most
    /// `window_ns` after they happened (0: records never wait for it).
    pub(crate) fn add_source(&self, name: &str, window_ns: u64) -> SourceId {
        self.add(name, window_ns, false)
    }

    /// An engine's KV event publisher: like [`Self::add_source`], but while it is quiet
    /// records wait for it only as long as publishers' measured delivery lag says (see
    /// the module docs), at most `window_ns`.
    pub(crate) fn add_publisher(&self, name: &str, window_ns: u64) -> SourceId {
        self.add(name, window_ns, true)
    }

    fn add(&self, name: &str, window_ns: u64, publisher: bool) -> SourceId {
        let mut inner = self.lock();
        inner.sources.push(Progress {
            name: name.to_string(),
            retired: false,
            clock: ClockAhead::default(),
            last_ns: 0,
            window_ns,
            publisher,
            held: false,
        });
        SourceId(inner.sources.len() - 1)
    }

    /// From now on `source`'s records may come out of order by up to `window_ns`: every
    /// record waits that long for it.
    pub(crate) fn hold_source(&self, source: SourceId, window_ns: u64) {
        let mut inner = self.lock();
        if let Some(p) = inner.sources.get_mut(source.0) {
            p.held = true;
            p.window_ns = p.window_ns.max(window_ns);
        }
    }

    /// `source` will deliver nothing more (its publisher is gone): records stop waiting
    /// for it.
    pub(crate) fn retire_source(&self, source: SourceId) {
        let mut inner = self.lock();
        if let Some(p) = inner.sources.get_mut(source.0) {
            p.last_ns = u64::MAX;
            p.held = false;
            p.retired = true;
        }
        let released = self.release_locked(&mut inner, now_ns(), false);
        drop(inner);
        if released {
            self.ready.notify_one();
        }
    }

    /// How long records now wait for a quiet KV publisher (ns): the window until a batch
    /// has been measured.
    pub(crate) fn publisher_wait_ns(&self) -> Option<u64> {
        let inner = self.lock();
        inner
            .sources
            .iter()
            .find(|p| p.publisher)
            .map(|p| p.wait_ns(&inner.lag))
    }

    /// Every live source's clock against the agent's (see the module docs).
    pub(crate) fn source_clocks(&self) -> Vec<SourceClockReading> {
        let inner = self.lock();
        inner
            .sources
            .iter()
            .filter(|p| !p.retired && p.clock.samples() > 0)
            .map(|p| SourceClockReading {
                name: p.name.clone(),
                ahead_ns: p.clock.ahead_ns(),
                lag_floor_ns: p.clock.floor_ns(),
            })
            .collect()
    }

    /// `source`'s lag floor, when it is at least 50 ms over at least three records, no
    /// longer than its window, and its records keep their time order: its clock may be
    /// behind the agent's by up to that much (see the module docs). Records later than
    /// the window (a log read from its start, an agent far behind) are late, not skewed,
    /// and counted as such.
    pub(crate) fn clock_behind_ns(&self, source: SourceId) -> Option<u64> {
        let inner = self.lock();
        let p = inner.sources.get(source.0)?;
        let c = &p.clock;
        if p.held || c.samples() < 3 {
            return None;
        }
        c.floor_ns()
            .filter(|f| (BEHIND_FLAG_NS..=p.window_ns).contains(f))
    }

    /// A record whose source gives no time of its own (heartbeats): it happened now.
    pub(crate) fn submit(&self, record: Record) {
        self.submit_at(None, record, None, now_ns());
    }

    /// A record from `source` that happened at `event_ns` (UNIX ns, the source's clock),
    /// if known.
    pub(crate) fn submit_event(&self, source: SourceId, record: Record, event_ns: Option<u64>) {
        self.submit_at(Some(source), record, event_ns, now_ns());
    }

    /// `source` has got as far as `event_ns` without a record (a log line that is not a
    /// decision): records up to then need not wait for it.
    pub(crate) fn advance(&self, source: SourceId, event_ns: u64) {
        self.advance_at(source, event_ns, now_ns());
    }

    /// [`Self::advance`] with an explicit clock reading (tests).
    pub(crate) fn advance_at(&self, source: SourceId, event_ns: u64, now: u64) {
        let mut inner = self.lock();
        if let Some(p) = inner.sources.get_mut(source.0) {
            let t = p.take_stamp(event_ns, now, &self.stats);
            p.last_ns = p.last_ns.max(t);
        }
        let released = self.release_locked(&mut inner, now, false);
        drop(inner);
        if released {
            self.ready.notify_one();
        }
    }

    /// [`Self::submit_event`] with an explicit clock reading (tests). An event time is
    /// corrected by its source's estimated clock offset, and one still in the future
    /// counts as now.
    pub(crate) fn submit_at(
        &self,
        source: Option<SourceId>,
        record: Record,
        event_ns: Option<u64>,
        now_ns: u64,
    ) {
        let mut inner = self.lock();
        let mut event_ns = event_ns.unwrap_or(now_ns);
        if let Some(p) = source.and_then(|s| inner.sources.get_mut(s.0)) {
            event_ns = p.take_stamp(event_ns, now_ns, &self.stats);
            p.last_ns = p.last_ns.max(event_ns);
            if p.publisher {
                inner.lag.observe(now_ns - event_ns, now_ns);
            }
        }
        let event_ns = event_ns.min(now_ns);
        let arrival = inner.arrivals;
        inner.arrivals += 1;
        let first = inner
            .held
            .peek()
            .is_none_or(|Reverse(h)| event_ns < h.event_ns);
        inner.held.push(Reverse(Held {
            event_ns,
            arrival,
            record,
        }));
        let released = self.release_locked(&mut inner, now_ns, false);
        let still_held = !inner.held.is_empty();
        drop(inner);
        if released {
            self.ready.notify_one();
        }
        if first && still_held {
            self.head_changed.notify_one();
        }
    }

    /// When the first held record stops waiting for the sources that have not passed it
    /// (UNIX ns), if any is held.
    pub(crate) fn next_due_ns(&self) -> Option<u64> {
        let inner = self.lock();
        let Reverse(h) = inner.held.peek()?;
        let t = h.event_ns;
        Some(
            inner
                .sources
                .iter()
                .filter(|p| p.held || p.last_ns < t)
                .map(|p| t.saturating_add(p.wait_ns(&inner.lag)))
                .max()
                .unwrap_or(t),
        )
    }

    /// Wait until a new record is the first to leave (its window may end sooner).
    pub async fn head_changed(&self) {
        self.head_changed.notified().await;
    }

    /// Release the records whose reorder window has passed (call it periodically).
    pub(crate) fn release_due(&self) {
        self.release_at(now_ns());
    }

    /// [`Self::release_due`] with an explicit clock reading (tests).
    pub(crate) fn release_at(&self, now_ns: u64) {
        let mut inner = self.lock();
        if self.release_locked(&mut inner, now_ns, false) {
            drop(inner);
            self.ready.notify_one();
        }
    }

    /// Release everything still held (shutdown).
    pub(crate) fn release_all(&self) {
        let mut inner = self.lock();
        if self.release_locked(&mut inner, u64::MAX, true) {
            drop(inner);
            self.ready.notify_one();
        }
    }

    fn release_locked(&self, inner: &mut Inner, now_ns: u64, all: bool) -> bool {
        let mut released = false;
        while let Some(Reverse(top)) = inner.held.peek() {
            // Released once no source can still bring anything earlier.
            let lag = &inner.lag;
            if !all
                && !inner
                    .sources
                    .iter()
                    .all(|p| p.passed(top.event_ns, now_ns, lag))
            {
                break;
            }
            let Some(Reverse(held)) = inner.held.pop() else {
                break;
            };
            released |= self.stamp_locked(inner, held);
        }
        released
    }

    /// The subjects `record` goes to: its own, under its worker's model when that is
    /// known, and for a heartbeat or NIXL report one copy per model known, so that a
    /// collector limited to a model has everything it needs under one filter.
    fn subjects_of(&self, inner: &mut Inner, record: &Record) -> Vec<String> {
        if let Record::Worker(w) = record {
            if let Some(m) = &w.model {
                inner.worker_models.insert(w.worker_id, m.clone());
            }
        }
        let model = match record {
            Record::KvEvents(b) => inner.worker_models.get(&b.worker.worker_id),
            Record::Decision(d) => inner.worker_models.get(&d.worker.worker_id),
            Record::RequestEnd(e) => inner.worker_models.get(&e.worker.worker_id),
            Record::RouterView(v) => inner.worker_models.get(&v.worker.worker_id),
            Record::Worker(w) => w.model.as_ref(),
            _ => None,
        };
        let mut out = vec![match model {
            Some(m) => self.subjects.for_record_in_model(&self.agent, record, m),
            None => self.subjects.for_record(&self.agent, record),
        }];
        if matches!(record, Record::Heartbeat(_) | Record::Nixl(_)) {
            let models: BTreeSet<&String> = inner.worker_models.values().collect();
            out.extend(
                models
                    .into_iter()
                    .map(|m| self.subjects.for_record_in_model(&self.agent, record, m)),
            );
        }
        out
    }

    /// Stamp, record and queue one released record (or drop it when the buffer is
    /// full), once per subject. Returns whether it was queued.
    fn stamp_locked(&self, inner: &mut Inner, held: Held) -> bool {
        let subjects = self.subjects_of(inner, &held.record);
        let subject = subjects[0].clone();
        if held.event_ns < inner.last_ns {
            RecordLate {
                behind_ms: (inner.last_ns - held.event_ns) as f64 / 1e6,
                subject: &subject,
            }
            .emit(&self.stats);
        }
        inner.last_ns = inner.last_ns.max(held.event_ns);
        let envelope = Envelope {
            agent: self.agent.clone(),
            observed_ns: inner.last_ns,
            record: held.record,
        };
        if let Some(w) = inner.recording.as_mut() {
            if let Err(e) = w.write(&envelope) {
                RecordingWriteFailed {
                    error: &e.to_string(),
                }
                .emit(&self.stats);
            }
        }
        let payload = bytes::Bytes::from(envelope.to_json());
        let mut queued = false;
        for subject in subjects {
            if inner.buffered_records >= self.capacity
                || inner.buffered_bytes + payload.len() > self.max_bytes
            {
                PublishDropped {
                    capacity: self.capacity,
                    max_bytes: self.max_bytes,
                    bytes: payload.len(),
                    subject: &subject,
                }
                .emit(&self.stats);
                continue;
            }
            inner.buffered_records += 1;
            inner.buffered_bytes += payload.len();
            self.queue_locked(inner, subject, &payload);
            queued = true;
        }
        queued
    }

    /// Add a record to the open message when it shares its scope and there is room, or
    /// start the next message with it.
    fn queue_locked(&self, inner: &mut Inner, subject: String, payload: &bytes::Bytes) {
        // The agent's own subjects always have a scope; one without would only bundle
        // with others alike, under the subject itself.
        let scope = self.subjects.scope_of(&subject).unwrap_or(&subject);
        if let Some(open) = inner.open.as_mut() {
            if open.scope == scope && open.takes(&subject, payload) {
                open.push(&subject, payload);
                return;
            }
        }
        let scope = scope.to_string();
        Self::seal_locked(inner);
        let local_seq = inner.next_seq;
        inner.next_seq += 1;
        inner.open = Some(OpenMessage {
            local_seq,
            scope,
            first_subject: subject,
            first: payload.clone(),
            bundle: None,
            records: 1,
            record_bytes: payload.len(),
        });
    }

    /// The open message takes no more records: it joins the buffer.
    fn seal_locked(inner: &mut Inner) {
        if let Some(open) = inner.open.take() {
            inner.buffer.push_back(open.finish());
        }
    }

    /// Up to `n` messages from the front of the buffer (they stay until [`Self::ack`]);
    /// the open one is closed first, so what is taken never changes.
    pub fn peek(&self, n: usize) -> Vec<Outgoing> {
        let mut inner = self.lock();
        Self::seal_locked(&mut inner);
        inner.buffer.iter().take(n).cloned().collect()
    }

    /// Remove the first `n` messages: JetStream acknowledged them (or they were set
    /// aside).
    pub fn ack(&self, n: usize) {
        let mut inner = self.lock();
        let n = n.min(inner.buffer.len());
        let (records, bytes) = inner
            .buffer
            .drain(..n)
            .fold((0, 0), |(r, b), o| (r + o.records, b + o.record_bytes));
        inner.buffered_records -= records;
        inner.buffered_bytes -= bytes;
    }

    /// Records waiting to be published.
    pub fn buffered(&self) -> usize {
        self.lock().buffered_records
    }

    /// Bytes of JSON waiting in the buffer.
    pub fn buffered_bytes(&self) -> usize {
        self.lock().buffered_bytes
    }

    /// Wait until a record may be waiting.
    pub async fn ready(&self) {
        if self.buffered() > 0 {
            return;
        }
        self.ready.notified().await;
    }

    pub fn flush_recording(&self) {
        if let Some(w) = self.lock().recording.as_mut() {
            if let Err(e) = w.flush() {
                RecordingWriteFailed {
                    error: &e.to_string(),
                }
                .emit(&self.stats);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::AgentHeartbeat;

    fn hb() -> Record {
        Record::Heartbeat(AgentHeartbeat::default())
    }

    /// The stamps of every record waiting, in order, whatever messages they are in.
    fn stamps_of(sink: &RecordSink) -> Vec<u64> {
        sink.peek(usize::MAX)
            .iter()
            .flat_map(|o| {
                kvscope_wire::bundle::entries(&o.subject, &o.payload)
                    .map(|e| Envelope::from_json(e.unwrap().json).unwrap().observed_ns)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn stamps_never_go_back_and_a_full_buffer_drops_new_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rec.jsonl");
        let stats = Arc::new(AgentStats::default());
        let sink = RecordSink::new(
            "node 1",
            Subjects::new("c"),
            2,
            usize::MAX,
            Some(&path),
            stats.clone(),
        )
        .unwrap();
        sink.submit_at(None, hb(), None, 10);
        sink.submit_at(None, hb(), None, 5);
        sink.submit_at(None, hb(), None, 20);
        assert_eq!(stats.snapshot().publish_dropped, 1);
        assert_eq!(stamps_of(&sink), vec![10, 10]);
        // Stamped one after the other, the two share a message.
        let out = sink.peek(10);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].local_seq, out[0].records), (0, 2));
        assert_eq!(out[0].subject, "kvscope.c.node_1.records");
        sink.ack(1);
        assert_eq!(sink.buffered(), 0);
        sink.submit_at(None, hb(), None, 30);
        let out = sink.peek(10);
        assert_eq!(
            out.iter()
                .map(|o| (o.local_seq, o.records, o.subject.as_str()))
                .collect::<Vec<_>>(),
            vec![(1, 1, "kvscope.c.node_1.heartbeat")],
            "a message of one record goes on its own subject, as it is"
        );
        assert_eq!(
            Envelope::from_json(&out[0].payload).unwrap().observed_ns,
            30
        );
        sink.flush_recording();
        // The recording has everything observed, the dropped record included.
        let rec = kvscope_wire::recording::read_recording(&path).unwrap();
        assert_eq!(
            rec.envelopes
                .iter()
                .map(|e| e.observed_ns)
                .collect::<Vec<_>>(),
            vec![10, 10, 20, 30]
        );
    }

    #[test]
    fn a_recording_that_cannot_be_written_is_counted_and_the_records_still_go_out() {
        let stats = Arc::new(AgentStats::default());
        let full = Path::new("/dev/full");
        let sink = RecordSink::new(
            "n",
            Subjects::new("c"),
            100,
            usize::MAX,
            Some(full),
            stats.clone(),
        )
        .unwrap();
        for t in 0..3 {
            sink.submit_at(None, hb(), None, t);
        }
        sink.flush_recording();
        assert!(stats.snapshot().recording_write_failures >= 1);
        assert_eq!(stamps_of(&sink), vec![0, 1, 2]);
    }

    #[test]
    fn a_bundle_stays_within_its_limits_and_a_large_record_goes_alone() {
        let stats = Arc::new(AgentStats::default());
        let sink =
            RecordSink::new("n", Subjects::new("c"), usize::MAX, usize::MAX, None, stats).unwrap();
        let n = MAX_BUNDLE_RECORDS + 3;
        // Records small enough that the count bounds the bundle before its bytes do (a
        // heartbeat grows with every counter).
        let small = || {
            Record::RouterView(kvscope_wire::RouterView {
                request_id: "r".into(),
                worker: kvscope_wire::WorkerKey {
                    worker_id: 1,
                    dp_rank: 0,
                },
                overlap_blocks: 0,
                phase: None,
                candidates: Vec::new(),
            })
        };
        for t in 0..n as u64 {
            sink.submit_at(None, small(), None, t);
        }
        let out = sink.peek(10);
        assert_eq!(
            out.iter().map(|o| o.records).collect::<Vec<_>>(),
            vec![MAX_BUNDLE_RECORDS, 3]
        );
        assert!(out.iter().all(|o| o.payload.len() <= MAX_BUNDLE_BYTES));
        assert_eq!(stamps_of(&sink), (0..n as u64).collect::<Vec<_>>());
        sink.ack(2);
        // Migration lines of a third of a bundle each: a fourth would take one past its
        // limit, and one over the limit by itself goes alone.
        let big = |bytes: usize| {
            Record::Migration(kvscope_wire::MigrationLogLine {
                kind: kvscope_wire::MigrationLogKind::HandshakeObtained,
                request_id: Some("x".repeat(bytes)),
                source: None,
                target: None,
                tokens: None,
                migratable_tokens: None,
                fields: Default::default(),
                trace: None,
            })
        };
        sink.submit_at(None, hb(), None, 1000);
        for _ in 0..3 {
            sink.submit_at(None, big(MAX_BUNDLE_BYTES / 3), None, 1001);
        }
        sink.submit_at(None, big(MAX_BUNDLE_BYTES), None, 1002);
        sink.submit_at(None, hb(), None, 1003);
        let out = sink.peek(10);
        assert_eq!(
            out.iter().map(|o| o.records).collect::<Vec<_>>(),
            vec![3, 1, 1, 1]
        );
        assert!(out[..2].iter().all(|o| o.payload.len() <= MAX_BUNDLE_BYTES));
        assert!(!kvscope_wire::bundle::is_bundle(&out[2].payload));
        assert!(out[2].payload.len() > MAX_BUNDLE_BYTES);
    }

    #[test]
    fn a_message_taken_by_the_publisher_never_changes_and_scopes_never_mix() {
        let stats = Arc::new(AgentStats::default());
        let sink = RecordSink::new("n", Subjects::new("c"), 100, usize::MAX, None, stats).unwrap();
        let worker = |id: u64, model: &str| {
            Record::Worker(kvscope_wire::WorkerRecord {
                worker_id: id,
                state: kvscope_wire::WorkerState::Up,
                model: Some(model.into()),
                block_size: None,
                total_kv_blocks: None,
                dp_ranks: vec![],
                worker_type: None,
            })
        };
        sink.submit_at(None, hb(), None, 1);
        let taken = sink.peek(10);
        assert_eq!(taken.len(), 1);
        // A record stamped after the publisher took the message starts the next one.
        sink.submit_at(None, hb(), None, 2);
        sink.submit_at(None, hb(), None, 3);
        let again = sink.peek(10);
        assert_eq!(again[0].payload, taken[0].payload);
        assert_eq!(
            again.iter().map(|o| o.records).collect::<Vec<_>>(),
            vec![1, 2]
        );
        sink.ack(2);
        // A worker of model alpha: its record goes under alpha's subjects, and so does
        // the heartbeat's copy for alpha, after the plain heartbeat.
        sink.submit_at(None, worker(7, "alpha"), None, 4);
        sink.submit_at(None, hb(), None, 5);
        let out = sink.peek(10);
        assert_eq!(
            out.iter()
                .map(|o| (o.subject.as_str(), o.records))
                .collect::<Vec<_>>(),
            vec![
                ("kvscope.c.n.m.alpha.fleet", 1),
                ("kvscope.c.n.heartbeat", 1),
                ("kvscope.c.n.m.alpha.heartbeat", 1),
            ]
        );
        assert_eq!(sink.buffered(), 3);
        assert_eq!(stamps_of(&sink), vec![4, 5, 5]);
    }

    #[test]
    fn records_leave_in_event_time_order_once_every_source_has_passed_them() {
        let (sink, stats) = sink();
        let (kv, log) = (sink.add_source("kv", 50), sink.add_source("log", 50));
        let times = stamps_of;
        // The KV batch (event time 120) of a prefill reaches the agent before the
        // decision that caused it (event time 100): the log has said nothing yet.
        sink.submit_at(Some(kv), hb(), Some(120), 125);
        assert_eq!(sink.next_due_ns(), Some(170));
        sink.release_at(160);
        assert_eq!(
            sink.buffered(),
            0,
            "the log may still bring something earlier"
        );
        sink.submit_at(
            Some(log),
            Record::Heartbeat(AgentHeartbeat {
                buffered: 7,
                ..Default::default()
            }),
            Some(100),
            140,
        );
        assert_eq!(times(&sink), vec![100], "both sources are past 100");
        // A log line without a record moves the log past 120: the batch leaves, long
        // before its window would end.
        sink.advance_at(log, 130, 141);
        assert_eq!(times(&sink), vec![100, 120]);
        // One later than its source's own order: released at once, stamped after its
        // predecessor, counted.
        sink.submit_at(Some(log), hb(), Some(110), 400);
        assert_eq!(times(&sink), vec![100, 120, 120]);
        assert_eq!(stats.snapshot().records_late, 1);
        // A source that stays silent holds later records for the whole window.
        sink.submit_at(Some(kv), hb(), Some(390), 400);
        sink.release_at(439);
        assert_eq!(sink.buffered(), 3);
        sink.release_at(440);
        assert_eq!(sink.buffered(), 4);
        // Records from no source wait like the others; shutdown releases everything.
        sink.submit_at(None, hb(), None, 450);
        assert_eq!(sink.buffered(), 4);
        sink.release_all();
        assert_eq!(times(&sink).last(), Some(&450));
    }

    const T0: u64 = 1_800_000_000_000_000_000;

    /// A sink holding 100 records, unbounded in bytes, without a recording.
    fn sink() -> (RecordSink, Arc<AgentStats>) {
        let stats = Arc::new(AgentStats::default());
        let sink = RecordSink::new(
            "a",
            Subjects::new("c"),
            100,
            usize::MAX,
            None,
            stats.clone(),
        )
        .unwrap();
        (sink, stats)
    }

    #[test]
    fn a_source_clock_ahead_is_corrected_and_one_stray_line_does_not_move_it() {
        let (sink, stats) = sink();
        let log = sink.add_source("router_log", 250 * MS);
        // The router's clock reads 100 ms ahead; its lines reach the agent 1 to 20 ms
        // after they are written (a polled file).
        let ahead = 100 * MS;
        let delays = [7, 1, 15, 3, 20, 9, 2, 12];
        let mut stamps = Vec::new();
        for (i, d) in delays.iter().enumerate() {
            let written = T0 + i as u64 * 300 * MS;
            let now = written + d * MS;
            sink.submit_at(Some(log), hb(), Some(written + ahead), now);
            stamps.push((written, now));
        }
        // One stray line dated 30 s ahead.
        let written = T0 + 9 * 300 * MS;
        sink.submit_at(
            Some(log),
            hb(),
            Some(written + 30_000 * MS),
            written + 5 * MS,
        );
        sink.release_all();
        let got = stamps_of(&sink);
        // The first line is only clamped (one sample proves little). From the second on,
        // the offset is taken as the second largest amount a stamp was ahead, so each is
        // stamped the second smallest delay so far after it was written: never before
        // it, never after it arrived (where clamping put it).
        assert_eq!(got[0], stamps[0].1);
        for (i, (g, (written, now))) in got[1..8].iter().zip(&stamps[1..]).enumerate() {
            let mut seen = delays[..=i + 1].to_vec();
            seen.sort_unstable();
            assert_eq!(*g, (written + seen[1] * MS).min(*now), "line {}", i + 1);
            assert!(g <= now);
        }
        assert_eq!(
            sink.source_clocks()[0].ahead_ns,
            99 * MS,
            "the stray line is not the estimate"
        );
        assert_eq!(stats.snapshot().records_clock_corrected, 8);
    }

    #[test]
    fn a_source_whose_every_record_arrives_late_is_flagged_when_within_its_window() {
        let (sink, stats) = sink();
        let (behind, old, fine) = (
            sink.add_source("behind", 250 * MS),
            sink.add_source("read_from_start", 250 * MS),
            sink.add_source("in_step", 250 * MS),
        );
        for i in 0..5u64 {
            let now = T0 + i * 200 * MS;
            // 100 ms behind, delivered within 0-20 ms.
            sink.submit_at(
                Some(behind),
                hb(),
                Some(now - 100 * MS - (i % 3) * 7 * MS),
                now,
            );
            // Hours old: late, not skewed.
            sink.submit_at(Some(old), hb(), Some(now - 3_600_000 * MS), now);
            sink.submit_at(Some(fine), hb(), Some(now - (i % 3) * 7 * MS), now);
        }
        assert_eq!(sink.clock_behind_ns(behind), Some(100 * MS));
        assert_eq!(sink.clock_behind_ns(old), None);
        assert_eq!(sink.clock_behind_ns(fine), None);
        let floors: Vec<_> = sink
            .source_clocks()
            .iter()
            .map(|c| c.lag_floor_ns)
            .collect();
        assert_eq!(floors, vec![Some(100 * MS), Some(3_600_000 * MS), Some(0)]);
        assert_eq!(stats.snapshot().records_clock_corrected, 0);
    }

    #[test]
    fn without_sources_nothing_waits() {
        let stats = Arc::new(AgentStats::default());
        let sink = RecordSink::new("a", Subjects::new("c"), 100, usize::MAX, None, stats).unwrap();
        sink.submit_at(None, hb(), None, 10);
        assert_eq!(sink.buffered(), 1);
    }

    #[test]
    fn each_source_is_waited_for_no_longer_than_its_own_window() {
        let (sink, stats) = sink();
        let (log, kv) = (sink.add_source("log", 250), sink.add_source("kv", 10));
        // A decision (log time 100) waits for the silent publisher only 10.
        sink.submit_at(Some(log), hb(), Some(100), 101);
        assert_eq!(sink.next_due_ns(), Some(110));
        sink.release_at(109);
        assert_eq!(sink.buffered(), 0);
        sink.release_at(110);
        assert_eq!(sink.buffered(), 1);
        // A KV batch (time 120) waits for the log up to 250.
        sink.submit_at(Some(kv), hb(), Some(120), 121);
        assert_eq!(sink.next_due_ns(), Some(370));
        sink.release_at(369);
        assert_eq!(sink.buffered(), 1);
        sink.release_at(370);
        assert_eq!(sink.buffered(), 2);
        // Busy sources: each record leaves as soon as the other source has moved past it.
        sink.submit_at(Some(kv), hb(), Some(380), 400);
        sink.submit_at(Some(log), hb(), Some(395), 400);
        assert_eq!(
            sink.buffered(),
            3,
            "380 leaves; 395 waits for the publisher"
        );
        sink.submit_at(Some(kv), hb(), Some(390), 401);
        assert_eq!(sink.buffered(), 4);
        sink.submit_at(Some(kv), hb(), Some(396), 402);
        assert_eq!(sink.buffered(), 5, "395 leaves; 396 waits for the log");
        assert_eq!(stats.snapshot().records_late, 0);
        // A batch older than what already left: at once, stamped after it, counted.
        sink.submit_at(Some(kv), hb(), Some(300), 403);
        assert_eq!(sink.buffered(), 6);
        assert_eq!(stamps_of(&sink).last(), Some(&395));
        assert_eq!(stats.snapshot().records_late, 1);
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn a_quiet_publisher_is_waited_for_twice_the_measured_lag_within_its_window() {
        let (sink, stats) = sink();
        let log = sink.add_source("log", 250 * MS);
        let (busy, quiet) = (
            sink.add_publisher("busy", 250 * MS),
            sink.add_publisher("quiet", 250 * MS),
        );
        // Nothing measured yet: the window.
        assert_eq!(sink.publisher_wait_ns(), Some(250 * MS));
        // A batch stamped 3 ms before it arrives: quiet publishers now cost 2 × 3 + 2 ms.
        sink.submit_at(Some(busy), hb(), Some(997 * MS), 1000 * MS);
        assert_eq!(sink.publisher_wait_ns(), Some(8 * MS));
        // A decision at 1000 ms: the log has passed the batch at 997 ms, which now waits
        // only for the quiet publisher, 8 ms; the decision waits for both publishers.
        sink.submit_at(Some(log), hb(), Some(1000 * MS), 1001 * MS);
        assert_eq!(sink.buffered(), 0);
        assert_eq!(sink.next_due_ns(), Some(1005 * MS));
        sink.release_at(1005 * MS - 1);
        assert_eq!(sink.buffered(), 0);
        sink.release_at(1005 * MS);
        assert_eq!(sink.buffered(), 1, "the batch at 997 ms left");
        assert_eq!(sink.next_due_ns(), Some(1008 * MS));
        sink.release_at(1008 * MS);
        assert_eq!(sink.buffered(), 2, "the decision left");
        // A slow batch raises the wait, never past the window.
        sink.submit_at(Some(quiet), hb(), Some(1010 * MS), 1040 * MS);
        assert_eq!(sink.publisher_wait_ns(), Some(62 * MS));
        sink.submit_at(Some(busy), hb(), Some(1050 * MS), 1250 * MS);
        assert_eq!(sink.publisher_wait_ns(), Some(250 * MS));
        // The log source keeps its own window whatever the lag.
        sink.submit_at(Some(busy), hb(), Some(1300 * MS), 1301 * MS);
        sink.submit_at(Some(quiet), hb(), Some(1300 * MS), 1301 * MS);
        sink.submit_at(Some(busy), hb(), Some(1310 * MS), 1311 * MS);
        assert_eq!(
            sink.next_due_ns(),
            Some(1550 * MS),
            "1300 ms waits for the log"
        );
        assert_eq!(stats.snapshot().records_late, 0);
    }

    #[test]
    fn a_held_source_makes_every_record_wait_its_window_and_takes_older_ones_in_order() {
        let (sink, stats) = sink();
        let (log, kv) = (sink.add_source("log", 50), sink.add_source("kv", 10));
        sink.hold_source(log, 1000);
        // The log moved far ahead, yet a KV batch at 100 still waits the log's window.
        sink.advance_at(log, 5000, 101);
        sink.submit_at(Some(kv), hb(), Some(100), 102);
        sink.release_at(1099);
        assert_eq!(sink.buffered(), 0);
        // A decision from the request trace for a request that arrived at 90, written at
        // its end: it goes before the batch.
        sink.submit_at(Some(log), hb(), Some(90), 600);
        sink.release_at(1100);
        assert_eq!(stamps_of(&sink), vec![90, 100]);
        assert_eq!(stats.snapshot().records_late, 0);
    }

    #[test]
    fn measured_lag_is_forgotten_after_an_idle_period() {
        let mut lag = DeliveryLag::default();
        assert_eq!(lag.bound_ns(), None);
        lag.observe(40 * MS, 1_000 * MS);
        assert_eq!(lag.bound_ns(), Some(82 * MS));
        // The next period keeps the previous one's maximum …
        lag.observe(MS, 6_500 * MS);
        assert_eq!(lag.bound_ns(), Some(82 * MS));
        // … and the one after drops it.
        lag.observe(MS, 12_000 * MS);
        assert_eq!(lag.bound_ns(), Some(4 * MS));
        // After 10 s without batches, nothing is carried over.
        lag.observe(5 * MS, 30_000 * MS);
        assert_eq!(lag.bound_ns(), Some(12 * MS));
    }
}
