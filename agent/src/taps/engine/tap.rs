//! A tap on one engine's ZMQ KV event publisher, over the agent's own ZMTP client
//! ([`crate::taps::engine::zmtp`]: a peer cannot make it allocate more than [`Limits`] allow).
//!
//! Subscribes to every topic, decodes each message with [`crate::kv_events`], classifies
//! its sequence number with [`SequenceTracker`], marks it with the endpoint's configured
//! worker, and hands the batch to the [`RecordSink`]. The connection is retried for
//! ever with backoff, so an engine started later or restarted is picked up (its restart
//! shows as a sequence reset); a peer that breaks the protocol or a limit is dropped,
//! counted, and reconnected to like any other.

use crate::config::KvEndpoint;
use crate::counters::AgentStats;
use crate::fleet::{FleetView, PublisherOwner};
use crate::internal_events::{
    InternalEvent, KvBadFrame, KvBatchReceived, KvBatchReplayed, KvDecodeError,
    KvEngineTimeIgnored, KvEventRefused, KvFieldsLeftOut, KvMalformedEvent, KvMediaBlocks,
    KvMediumLeftOut, KvPeerViolation, KvReplayCut, KvReplayDone, KvReplayFailed, KvSaltInherited,
    KvSequenceGap, KvSequenceReset, KvTapConnected, KvTapDisconnected, KvTapPanicked,
    KvUnknownEvent,
};
use crate::kv_events::{decode_payload, split_frames, EventProblem};
use crate::sink::{RecordSink, SourceId};
use crate::taps::engine::sequence::SequenceTracker;
use crate::taps::engine::zmtp::{Connection, Limits, SocketType, ZmtpError};
use kvscope_wire::hashing::MediaPlaceholders;
use kvscope_wire::kv_admission::Admission;
use kvscope_wire::{KvEventBatch, Record, SequenceStatus, WorkerKey};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Turns raw multipart messages from one publisher into records (no I/O; the socket
/// loop in [`run`] feeds it).
pub(crate) struct KvTap {
    endpoint: KvEndpoint,
    /// The worker the batches belong to (configured, or found through discovery).
    worker_id: u64,
    sequence: PublisherSequence,
    /// Which of the engine's events the mirror takes, and their chains' salts.
    admission: Admission,
    /// What the worker's model holds for images and videos in its prompts, or why that
    /// is not known: how blocks holding multimodal objects are hashed.
    placeholders: Result<MediaPlaceholders, String>,
    stats: Arc<AgentStats>,
}

/// One publisher's sequence numbers, classified and their problems emitted.
#[derive(Debug, Default)]
pub(crate) struct PublisherSequence {
    tracker: SequenceTracker,
    last: Option<u64>,
    /// Batches whose number was taken but whose events could not be read (an
    /// undecodable payload): the next batch delivered carries them as a gap, so the
    /// collector knows the worker's mirror is missing them.
    undelivered: u64,
    /// A digest of the last batch's payload (the batch numbered `last`). Asked again of
    /// the replay socket, the same payload says the numbering went on in the same
    /// engine; another says an engine restarted and numbered past the old one's last.
    last_digest: Option<u64>,
    /// The connection was made anew since the last batch: the next one is checked
    /// against `last_digest` even when its number follows on (an engine that
    /// restarted may have numbered just that far before the tap was back).
    check_continuity: bool,
}

impl PublisherSequence {
    /// The batch just observed could not be delivered (its payload undecodable).
    pub(crate) fn undelivered(&mut self) {
        self.undelivered = self.undelivered.saturating_add(1);
    }

    /// The status a delivered batch goes out with: `status`, or a gap over the batches
    /// left undelivered since the last one delivered. (After a first batch or a
    /// restart, the collector starts the worker's mirror anew anyway.)
    pub(crate) fn delivered(&mut self, status: SequenceStatus) -> SequenceStatus {
        let lost = std::mem::take(&mut self.undelivered);
        match status {
            _ if lost == 0 => status,
            SequenceStatus::InOrder | SequenceStatus::Replayed => {
                SequenceStatus::Gap { missed: lost }
            }
            SequenceStatus::Gap { missed } => SequenceStatus::Gap {
                missed: missed.saturating_add(lost),
            },
            SequenceStatus::First | SequenceStatus::Reset => status,
        }
    }

    pub(crate) fn observe(
        &mut self,
        publisher: &str,
        seq: u64,
        stats: &AgentStats,
    ) -> SequenceStatus {
        let sequence = self.tracker.observe(publisher, seq);
        match sequence {
            SequenceStatus::Gap { missed } => KvSequenceGap {
                publisher,
                expected: seq - missed,
                got: seq,
                missed,
            }
            .emit(stats),
            SequenceStatus::Reset => KvSequenceReset {
                publisher,
                previous: self.last.unwrap_or_default(),
                got: seq,
            }
            .emit(stats),
            SequenceStatus::First | SequenceStatus::InOrder | SequenceStatus::Replayed => {}
        }
        self.last = Some(seq);
        sequence
    }

    /// What `seq` would be classified as, without taking it.
    pub(crate) fn peek(&self, publisher: &str, seq: u64) -> SequenceStatus {
        self.tracker.peek(publisher, seq)
    }

    /// `seq` arrived through the replay socket: the numbering continues from it.
    pub(crate) fn replayed(&mut self, publisher: &str, seq: u64) {
        self.tracker.set(publisher, seq);
        self.last = Some(seq);
    }

    /// The last batch's payload was taken (delivered or not).
    fn taken(&mut self, payload: &[u8]) {
        self.last_digest = Some(xxhash_rust::xxh3::xxh3_64(payload));
        self.check_continuity = false;
    }
}

/// What a replay must fetch before the batch the tap is about to take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplayNeed {
    /// The first number asked for.
    pub from: u64,
    /// How the first batch recovered is marked: `None` where it continues one engine's
    /// numbering (`Replayed`, or `Gap` where the buffer no longer reaches back); the
    /// start of a publisher (`First`) or of an engine that restarted (`Reset`).
    anew: Option<SequenceStatus>,
    /// The last batch taken, asked again to tell the same engine from a restarted one:
    /// its number and payload digest.
    check: Option<(u64, u64)>,
}

/// What one replay answer gave.
#[derive(Debug, Default)]
pub(crate) struct ReplayRound {
    pub records: Vec<Record>,
    /// Everything missing before the next batch is now delivered.
    pub complete: bool,
    /// What to ask for next: the rest after a cut answer or a hole in it (the replay
    /// made progress), or everything from 0 when the engine turned out to have restarted.
    pub again: Option<ReplayNeed>,
}

/// Emit each event a decoder skipped.
pub(crate) fn emit_problems(publisher: &str, problems: &[EventProblem], stats: &AgentStats) {
    for p in problems {
        match p {
            EventProblem::Unknown { event_type, .. } => KvUnknownEvent {
                publisher,
                event_type,
            }
            .emit(stats),
            EventProblem::Malformed {
                event_type, reason, ..
            } => KvMalformedEvent {
                publisher,
                event_type,
                reason,
            }
            .emit(stats),
        }
    }
}

impl KvTap {
    pub fn new(endpoint: KvEndpoint, worker_id: u64, stats: Arc<AgentStats>) -> Self {
        Self {
            endpoint,
            worker_id,
            sequence: PublisherSequence::default(),
            admission: Admission::default(),
            placeholders: Err(
                "the publisher's worker was given, not found through discovery".into(),
            ),
            stats,
        }
    }

    /// A tap for the publisher of a worker found through discovery, with what its
    /// model's config says of its placeholders.
    pub fn of_owner(endpoint: KvEndpoint, owner: PublisherOwner, stats: Arc<AgentStats>) -> Self {
        Self {
            placeholders: owner.placeholders,
            ..Self::new(endpoint, owner.worker_id, stats)
        }
    }

    /// What a replay must fetch before the message numbered `seq` is taken: a gap, a
    /// publisher seen past its start, an engine restart seen past its new start, or —
    /// after a gap or a reconnection — whether the engine is still the one whose
    /// batches the tap took (the last of them asked again); `None` when nothing is.
    pub(crate) fn missing_before(&self, seq: u64) -> Option<ReplayNeed> {
        let status = self.sequence.peek(&self.endpoint.endpoint, seq);
        let check_last = || {
            let last = self.sequence.last.zip(self.sequence.last_digest);
            last.map(|(last, digest)| ReplayNeed {
                from: last,
                anew: None,
                check: Some((last, digest)),
            })
        };
        match status {
            SequenceStatus::Gap { .. } => check_last(),
            SequenceStatus::InOrder if self.sequence.check_continuity => check_last(),
            SequenceStatus::First | SequenceStatus::Reset if seq > 0 => Some(ReplayNeed {
                from: 0,
                anew: Some(status),
                check: None,
            }),
            _ => None,
        }
    }

    /// The connection to the publisher was made anew: the next batch is checked for
    /// an engine that restarted meanwhile.
    pub fn reconnected(&mut self) {
        self.sequence.check_continuity = self.sequence.last_digest.is_some();
    }

    /// Batches the replay socket sent for what `need` asked before batch `next`: the
    /// run of them that follows on without a hole becomes records, the first marked as
    /// `need` says (or with what is still missing before it). The answer's copy of the
    /// last batch taken, where `need` asked for it, decides whether the engine is the
    /// same: if not, nothing is delivered and everything from 0 is asked for instead.
    pub fn replayed(
        &mut self,
        need: ReplayNeed,
        next: u64,
        mut batches: Vec<crate::taps::engine::replay::Replayed>,
    ) -> ReplayRound {
        let publisher = self.endpoint.endpoint.clone();
        let mut from = need.from;
        if let Some((last, digest)) = need.check {
            match batches.iter().find(|(s, _)| *s == last) {
                Some((_, p)) if xxhash_rust::xxh3::xxh3_64(p) != digest => {
                    return ReplayRound {
                        again: Some(ReplayNeed {
                            from: 0,
                            anew: Some(SequenceStatus::Reset),
                            check: None,
                        }),
                        ..ReplayRound::default()
                    };
                }
                // The same engine (or a buffer that no longer reaches back to tell):
                // what follows the batch already taken is what is missing.
                _ => from = last + 1,
            }
        }
        batches.retain(|(s, _)| (from..next).contains(s));
        batches.sort_by_key(|(s, _)| *s);
        batches.dedup_by_key(|(s, _)| *s);
        if need.anew == Some(SequenceStatus::Reset) {
            if let Some(&(first, _)) = batches.first() {
                KvSequenceReset {
                    publisher: &publisher,
                    previous: self.sequence.last.unwrap_or_default(),
                    got: first,
                }
                .emit(&self.stats);
            }
        }
        let mut records = Vec::new();
        let mut expected = None;
        for (seq, payload) in batches {
            if expected.is_some_and(|e| e != seq) {
                break;
            }
            let status = match (expected, need.anew) {
                (Some(_), _) => SequenceStatus::Replayed,
                (None, Some(anew)) => anew,
                (None, None) if seq == from => SequenceStatus::Replayed,
                // The buffer did not reach back far enough: the part before is lost.
                (None, None) => SequenceStatus::Gap { missed: seq - from },
            };
            self.sequence.replayed(&publisher, seq);
            expected = Some(seq + 1);
            KvBatchReplayed {
                publisher: &publisher,
                seq,
            }
            .emit(&self.stats);
            if let Some(r) = self.deliver(seq, status, &payload) {
                records.push(r);
            }
        }
        // Complete: every missing batch came, and each was read (one that could not be
        // is carried as a gap by the next, or still pending after the last).
        let complete = from == next
            || (expected == Some(next)
                && self.sequence.undelivered == 0
                && !records.is_empty()
                && records.iter().all(|r| {
                    matches!(r, Record::KvEvents(b) if !matches!(b.sequence, SequenceStatus::Gap { .. }))
                }));
        // A cut answer, or one with a hole (a ROUTER past its high-water mark drops
        // messages): what came was taken, the rest is asked for again.
        let again = match expected {
            Some(e) if e < next => Some(ReplayNeed {
                from: e,
                anew: None,
                check: None,
            }),
            _ => None,
        };
        ReplayRound {
            records,
            complete,
            again,
        }
    }

    /// One ZMQ message → at most one batch record; every problem is emitted.
    pub fn message<B: AsRef<[u8]>>(&mut self, frames: &[B]) -> Option<Record> {
        let publisher = self.endpoint.endpoint.as_str();
        let (seq, payload) = match split_frames(frames) {
            Ok(x) => x,
            Err(error) => {
                KvBadFrame {
                    publisher,
                    error: &error,
                }
                .emit(&self.stats);
                return None;
            }
        };
        // The number is valid even when the payload is not: track it first, so one bad
        // payload does not look like a gap at the next batch.
        let sequence = self.sequence.observe(publisher, seq, &self.stats);
        self.deliver(seq, sequence, payload)
    }

    /// [`Self::batch`], its status carrying the batches before it left undelivered.
    fn deliver(&mut self, seq: u64, sequence: SequenceStatus, payload: &[u8]) -> Option<Record> {
        self.sequence.taken(payload);
        match self.batch(seq, sequence, payload) {
            Some(Record::KvEvents(mut b)) => {
                b.sequence = self.sequence.delivered(b.sequence);
                Some(Record::KvEvents(b))
            }
            Some(other) => Some(other),
            None => {
                self.sequence.undelivered();
                None
            }
        }
    }

    /// A batch's record from its number, status and payload; every problem is emitted.
    fn batch(&mut self, seq: u64, sequence: SequenceStatus, payload: &[u8]) -> Option<Record> {
        let publisher = self.endpoint.endpoint.as_str();
        let decoded = match decode_payload(payload) {
            Ok(d) => d,
            Err(error) => {
                KvDecodeError {
                    publisher,
                    error: &error,
                }
                .emit(&self.stats);
                return None;
            }
        };
        emit_problems(publisher, &decoded.problems, &self.stats);
        KvMediumLeftOut {
            publisher,
            events: decoded.medium_left_out,
        }
        .emit(&self.stats);
        KvFieldsLeftOut {
            publisher,
            fields: &decoded.fields_left_out,
        }
        .emit(&self.stats);
        // NaN or infinity would not survive JSON (null), and would lose the batch at the
        // collector: such a stamp is dropped, and counted with every stamp that is no
        // time where the batch is ordered (`engine_time_ns`).
        let engine_ts = if decoded.engine_ts.is_finite() {
            decoded.engine_ts
        } else {
            0.0
        };
        KvBatchReceived {
            publisher,
            events: decoded.events.len(),
        }
        .emit(&self.stats);
        let dp_rank = self.endpoint.dp_rank.or(decoded.dp_rank).unwrap_or(0);
        // A restarted engine's groups and chains are new.
        if sequence == SequenceStatus::Reset {
            self.admission.clear();
        }
        let mut events = Vec::with_capacity(decoded.events.len());
        for (mut event, meta) in decoded.events.into_iter().zip(&decoded.meta) {
            match self.admission.admit(dp_rank, &mut event, meta) {
                Ok(admitted) => {
                    if admitted.salt_inherited {
                        KvSaltInherited.emit(&self.stats);
                    }
                    // The tokens leave the node as their blocks' hashes (a block's hash in
                    // the bytes of two of its tokens: half the bytes on the bus in all),
                    // and the collector's hashing is done here, spread over the nodes.
                    let placeholders = self.placeholders.as_ref().copied().unwrap_or_default();
                    let blocks = event.hash_tokens_with_media(&meta.media, placeholders);
                    if blocks > 0 {
                        KvMediaBlocks {
                            publisher,
                            blocks,
                            placeholders: self
                                .placeholders
                                .as_ref()
                                .map(|_| ())
                                .map_err(String::as_str),
                        }
                        .emit(&self.stats);
                    }
                    events.push(event);
                }
                Err(why) => KvEventRefused { publisher, why }.emit(&self.stats),
            }
        }
        Some(Record::KvEvents(KvEventBatch {
            worker: WorkerKey {
                worker_id: self.worker_id,
                dp_rank,
            },
            publisher: publisher.to_string(),
            origin: Default::default(),
            seq,
            sequence,
            engine_ts,
            events,
        }))
    }
}

/// Tap `endpoint` until `stop` turns true; its batches are `source` in the sink (one
/// publisher's batches come in its own order: engine time, one socket). A panic inside
/// the tap (a bug, never the peer's input alone) ends only this tap's connection: it is
/// counted and the tap starts again, its sequence numbering forgotten.
pub async fn run(
    endpoint: KvEndpoint,
    fleet: Option<FleetView>,
    limits: Limits,
    sink: Arc<RecordSink>,
    source: SourceId,
    stats: Arc<AgentStats>,
    mut stop: watch::Receiver<bool>,
) {
    while !*stop.borrow() {
        let tap = tokio::spawn(tap_until_stopped(
            endpoint.clone(),
            fleet.clone(),
            limits,
            sink.clone(),
            source,
            stats.clone(),
            stop.clone(),
        ));
        let abort = tap.abort_handle();
        let _abort_on_drop = AbortOnDrop(abort);
        match tap.await {
            Ok(()) => return,
            Err(e) if e.is_panic() => {
                KvTapPanicked {
                    publisher: &endpoint.endpoint,
                    error: &panic_message(e.into_panic()),
                }
                .emit(&stats);
                tokio::select! {
                    _ = tokio::time::sleep(MAX_BACKOFF) => {}
                    _ = stop.changed() => return,
                }
            }
            Err(_) => return,
        }
    }
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

async fn tap_until_stopped(
    endpoint: KvEndpoint,
    mut fleet: Option<FleetView>,
    limits: Limits,
    sink: Arc<RecordSink>,
    source: SourceId,
    stats: Arc<AgentStats>,
    mut stop: watch::Receiver<bool>,
) {
    let publisher = endpoint.endpoint.as_str();
    let mut tap: Option<KvTap> = endpoint
        .worker_id
        .map(|id| KvTap::new(endpoint.clone(), id, stats.clone()));
    let mut backoff = MIN_BACKOFF;
    while !*stop.borrow() {
        // Without a configured worker id, every connection starts by finding out whose
        // publisher this is (after an engine restart it is a new worker).
        if endpoint.worker_id.is_none() {
            let Some(view) = fleet.as_mut() else {
                return;
            };
            let Some(owner) =
                crate::fleet::wait_for_worker(view, publisher, &stats, &mut stop).await
            else {
                return;
            };
            if tap.as_ref().is_none_or(|t| t.worker_id != owner.worker_id) {
                tap = Some(KvTap::of_owner(endpoint.clone(), owner, stats.clone()));
            }
        }
        let Some(tap) = tap.as_mut() else {
            return;
        };
        let connected = tokio::select! {
            r = Connection::connect(publisher, SocketType::Sub, limits, CONNECT_TIMEOUT) => r,
            _ = stop.changed() => return,
        };
        let subscribed = match connected {
            Ok(mut c) => c.subscribe(b"").await.map(|()| c),
            Err(e) => Err(e),
        };
        let mut conn = match subscribed {
            Ok(c) => c,
            Err(e) => {
                disconnected(&stats, publisher, &e, backoff);
                if !sleep_or_stop(&mut stop, &mut backoff).await {
                    return;
                }
                continue;
            }
        };
        KvTapConnected { publisher }.emit(&stats);
        tap.reconnected();
        backoff = MIN_BACKOFF;
        loop {
            let msg = tokio::select! {
                m = conn.recv() => m,
                _ = stop.changed() => return,
            };
            match msg {
                Ok(frames) => {
                    if let (Some(replay), Ok((seq, _))) =
                        (&endpoint.replay_endpoint, split_frames(&frames))
                    {
                        if let Some(need) = tap.missing_before(seq) {
                            recover(tap, replay, need, seq, limits, &sink, source, &stats).await;
                        }
                    }
                    if let Some(record) = tap.message(&frames) {
                        let at = engine_time_ns(&record, &stats);
                        sink.submit_event(source, record, at);
                    }
                }
                Err(e) => {
                    disconnected(&stats, publisher, &e, backoff);
                    break;
                }
            }
        }
        if !sleep_or_stop(&mut stop, &mut backoff).await {
            return;
        }
    }
}

/// Fill what is missing before batch `next` from the publisher's replay socket; what
/// cannot be recovered stays a gap (or a late start) in the numbering, counted. An
/// answer cut at the agent's limits, or with a hole, is followed by another for the
/// rest, as long as each brings something.
#[allow(clippy::too_many_arguments)]
async fn recover(
    tap: &mut KvTap,
    replay: &str,
    mut need: ReplayNeed,
    next: u64,
    limits: Limits,
    sink: &RecordSink,
    source: SourceId,
    stats: &AgentStats,
) {
    let publisher = tap.endpoint.endpoint.clone();
    let from = need.from;
    // A reconnection's check of the engine, with nothing missing: no recovery to count
    // when it finds the same engine.
    let only_checked = need.check.is_some_and(|(last, _)| last + 1 == next);
    let mut delivered = 0;
    let mut complete = false;
    for _ in 0..MAX_REPLAY_ROUNDS {
        let answer = match crate::taps::engine::replay::fetch(replay, need.from, limits).await {
            Ok(answer) => answer,
            Err(e) => {
                KvReplayFailed {
                    publisher: &publisher,
                    replay,
                    error: &e.to_string(),
                }
                .emit(stats);
                break;
            }
        };
        if answer.cut {
            KvReplayCut {
                publisher: &publisher,
                kept: answer.batches.len(),
            }
            .emit(stats);
        }
        let round = tap.replayed(need, next, answer.batches);
        delivered += round.records.len();
        for r in round.records {
            let at = engine_time_ns(&r, stats);
            sink.submit_event(source, r, at);
        }
        complete = round.complete;
        match round.again {
            Some(again) if !complete => need = again,
            _ => break,
        }
    }
    if only_checked && complete && delivered == 0 {
        return;
    }
    KvReplayDone {
        publisher: &publisher,
        from,
        next,
        batches: delivered,
        complete,
    }
    .emit(stats);
}

/// Replay answers one recovery may take: with the agent's limit per answer, over a
/// million batches, far past any publisher's buffer.
const MAX_REPLAY_ROUNDS: usize = 64;

fn disconnected(stats: &AgentStats, publisher: &str, error: &ZmtpError, backoff: Duration) {
    if error.is_peer_violation() {
        KvPeerViolation {
            publisher,
            error: &error.to_string(),
        }
        .emit(stats);
    }
    KvTapDisconnected {
        publisher,
        error: &error.to_string(),
        retry_in_ms: backoff.as_millis() as u64,
    }
    .emit(stats);
}

/// Wait out the backoff (doubling it); false when told to stop meanwhile.
async fn sleep_or_stop(stop: &mut watch::Receiver<bool>, backoff: &mut Duration) -> bool {
    let wait = *backoff;
    *backoff = (*backoff * 2).min(MAX_BACKOFF);
    tokio::select! {
        _ = tokio::time::sleep(wait) => true,
        _ = stop.changed() => false,
    }
}

/// The range of engine timestamps taken as times (UNIX seconds): from 2001 to 2286. A
/// publisher stamping 0, a negative number or 1e300 has no clock kvscope can order by.
const ENGINE_TIME_SECS: std::ops::Range<f64> = 1e9..1e10;

/// The engine's own timestamp of a batch (UNIX seconds as f64), when it is a time; a
/// batch stamped with something else is counted, and ordered by its arrival instead.
fn engine_time_ns(record: &Record, stats: &AgentStats) -> Option<u64> {
    match record {
        Record::KvEvents(b) if ENGINE_TIME_SECS.contains(&b.engine_ts) => {
            Some((b.engine_ts * 1e9) as u64)
        }
        Record::KvEvents(b) => {
            KvEngineTimeIgnored {
                publisher: &b.publisher,
                engine_ts: b.engine_ts,
            }
            .emit(stats);
            None
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::KvEvent;
    use rmpv::Value;

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn batch(events: Vec<Value>, dp: Option<Value>) -> Value {
        let mut a = vec![Value::F64(1.5), Value::Array(events)];
        a.extend(dp);
        Value::Array(a)
    }

    fn tap(dp: Option<u32>) -> (KvTap, Arc<AgentStats>) {
        let stats = Arc::new(AgentStats::default());
        let ep = KvEndpoint {
            endpoint: "tcp://127.0.0.1:1".into(),
            replay_endpoint: None,
            worker_id: Some(9),
            dp_rank: dp,
        };
        (KvTap::new(ep, 9, stats.clone()), stats)
    }

    fn msg(seq: u64, payload: Vec<u8>) -> Vec<Vec<u8>> {
        vec![vec![], seq.to_be_bytes().to_vec(), payload]
    }

    fn cleared() -> Value {
        Value::Array(vec![Value::from("AllBlocksCleared")])
    }

    #[test]
    fn a_stamp_that_is_no_time_is_counted_and_the_batch_ordered_by_arrival() {
        let (mut t, stats) = tap(None);
        let Some(Record::KvEvents(mut b)) =
            t.message(&msg(0, encode(&batch(vec![cleared()], None))))
        else {
            panic!("a batch");
        };
        for (ts, want) in [
            (1.5, None),
            (f64::NAN, None),
            (-1.7e9, None),
            (1e300, None),
            (1.7e9, Some(1_700_000_000_000_000_000)),
        ] {
            b.engine_ts = ts;
            assert_eq!(
                engine_time_ns(&Record::KvEvents(b.clone()), &stats),
                want,
                "{ts}"
            );
        }
        assert_eq!(stats.snapshot().kv_engine_times_ignored, 4);
    }

    fn statuses(records: &[Record]) -> Vec<(u64, SequenceStatus)> {
        records
            .iter()
            .map(|r| match r {
                Record::KvEvents(b) => (b.seq, b.sequence),
                _ => panic!(),
            })
            .collect()
    }

    fn answer(batches: Vec<(u64, Vec<u8>)>) -> Vec<crate::taps::engine::replay::Replayed> {
        batches.into_iter().map(|(s, p)| (s, p.into())).collect()
    }

    /// A batch with a payload of its own (one event naming `n`).
    fn nth(n: u64) -> Vec<u8> {
        let removed = Value::Array(vec![
            Value::from("BlockRemoved"),
            Value::Array(vec![Value::from(n)]),
            Value::Nil,
        ]);
        encode(&batch(vec![removed], None))
    }

    #[test]
    fn an_undecodable_replayed_batch_is_a_gap_and_the_replay_incomplete() {
        let (mut t, _) = tap(None);
        let ok = || encode(&batch(vec![cleared()], None));
        assert!(t.message(&msg(0, ok())).is_some());
        let need = t.missing_before(4).unwrap();
        assert_eq!(need.from, 0, "the last batch taken, asked again");
        let round = t.replayed(
            need,
            4,
            answer(vec![(0, ok()), (1, ok()), (2, vec![0xc1]), (3, ok())]),
        );
        assert_eq!(
            statuses(&round.records),
            vec![
                (1, SequenceStatus::Replayed),
                (3, SequenceStatus::Gap { missed: 1 })
            ]
        );
        assert!(!round.complete);
        assert!(round.again.is_none());
        let Some(Record::KvEvents(b)) = t.message(&msg(4, ok())) else {
            panic!()
        };
        assert_eq!(b.sequence, SequenceStatus::InOrder);
    }

    #[test]
    fn a_restart_seen_through_the_replay_socket_is_a_reset() {
        let (mut t, stats) = tap(None);
        for s in 0..6 {
            assert!(t.message(&msg(s, nth(s))).is_some());
        }
        // The new engine's first batches were missed: its number 2 went backwards.
        let need = t.missing_before(2).unwrap();
        let round = t.replayed(need, 2, answer(vec![(0, nth(100)), (1, nth(101))]));
        assert_eq!(
            statuses(&round.records),
            vec![(0, SequenceStatus::Reset), (1, SequenceStatus::Replayed)]
        );
        assert!(round.complete);
        let Some(Record::KvEvents(b)) = t.message(&msg(2, nth(102))) else {
            panic!()
        };
        assert_eq!(b.sequence, SequenceStatus::InOrder);
        assert_eq!(stats.snapshot().kv_sequence_resets, 1);
    }

    #[test]
    fn a_restart_numbered_past_the_old_engine_is_told_by_its_payload() {
        let (mut t, stats) = tap(None);
        for s in 0..3 {
            assert!(t.message(&msg(s, nth(s))).is_some());
        }
        // The new engine's 0..=5 were missed; 6 looks like a gap after 2.
        let new_engine: Vec<(u64, Vec<u8>)> = (0..6).map(|s| (s, nth(100 + s))).collect();
        let need = t.missing_before(6).unwrap();
        assert_eq!(need.from, 2);
        let round = t.replayed(need, 6, answer(new_engine[2..].to_vec()));
        assert!(round.records.is_empty() && !round.complete);
        let again = round.again.expect("everything from 0 asked for");
        assert_eq!(again.from, 0);
        let round = t.replayed(again, 6, answer(new_engine.clone()));
        let mut want = vec![(0, SequenceStatus::Reset)];
        want.extend((1..6).map(|s| (s, SequenceStatus::Replayed)));
        assert_eq!(statuses(&round.records), want);
        assert!(round.complete);
        assert_eq!(stats.snapshot().kv_sequence_resets, 1);
        assert_eq!(stats.snapshot().kv_sequence_gaps, 0);
        // The same engine's gap: its copy of the last batch is the one taken.
        for s in 6..8 {
            assert!(t.message(&msg(s, nth(100 + s))).is_some());
        }
        let need = t.missing_before(10).unwrap();
        let same: Vec<(u64, Vec<u8>)> = (7..10).map(|s| (s, nth(100 + s))).collect();
        let round = t.replayed(need, 10, answer(same));
        assert_eq!(
            statuses(&round.records),
            vec![(8, SequenceStatus::Replayed), (9, SequenceStatus::Replayed)]
        );
        assert!(round.complete);
    }

    #[test]
    fn a_reconnection_checks_the_engine_even_when_the_numbers_follow_on() {
        let (mut t, _) = tap(None);
        for s in 0..3 {
            assert!(t.message(&msg(s, nth(s))).is_some());
        }
        assert!(t.missing_before(3).is_none());
        t.reconnected();
        let need = t.missing_before(3).expect("the engine checked");
        // The same engine: nothing to deliver, nothing missing.
        let round = t.replayed(need, 3, answer(vec![(2, nth(2))]));
        assert!(round.records.is_empty() && round.complete && round.again.is_none());
        // A restarted one that numbered just as far: everything from 0, anew.
        let round = t.replayed(need, 3, answer(vec![(2, nth(202))]));
        assert_eq!(round.again.map(|a| a.from), Some(0));
    }

    #[test]
    fn a_cut_or_holed_answer_asks_again_for_the_rest() {
        let (mut t, _) = tap(None);
        assert!(t.message(&msg(0, nth(0))).is_some());
        let need = t.missing_before(10).unwrap();
        // The answer stops after 4 (cut, or a hole where a ROUTER dropped 5).
        let round = t.replayed(need, 10, answer((0..5).map(|s| (s, nth(s))).collect()));
        assert_eq!(round.records.len(), 4);
        assert!(!round.complete);
        let again = round.again.unwrap();
        assert_eq!(again.from, 5);
        let round = t.replayed(again, 10, answer((5..10).map(|s| (s, nth(s))).collect()));
        assert_eq!(round.records.len(), 5);
        assert!(round.complete && round.again.is_none());
        assert!(statuses(&round.records)
            .iter()
            .all(|(_, st)| *st == SequenceStatus::Replayed));
    }

    #[test]
    fn batches_carry_worker_sequence_and_counts() {
        let (mut t, stats) = tap(None);
        let r = t
            .message(&msg(
                3,
                encode(&batch(vec![cleared()], Some(Value::from(2)))),
            ))
            .unwrap();
        let Record::KvEvents(b) = r else { panic!() };
        assert_eq!(
            b.worker,
            WorkerKey {
                worker_id: 9,
                dp_rank: 2
            }
        );
        assert_eq!((b.seq, b.sequence), (3, SequenceStatus::First));
        // A bad payload still advances the numbering, and the batch after it tells the
        // collector one batch's events were lost.
        assert!(t.message(&msg(4, vec![0xc1])).is_none());
        let Some(Record::KvEvents(b)) = t.message(&msg(
            5,
            encode(&batch(vec![cleared(), Value::from(1)], None)),
        )) else {
            panic!()
        };
        assert_eq!(b.sequence, SequenceStatus::Gap { missed: 1 });
        assert_eq!(b.events.len(), 1);
        let Some(Record::KvEvents(b)) = t.message(&msg(9, encode(&batch(vec![], None)))) else {
            panic!()
        };
        assert_eq!(b.sequence, SequenceStatus::Gap { missed: 3 });
        let Some(Record::KvEvents(b)) = t.message(&msg(
            0,
            encode(&batch(vec![Value::Array(vec![Value::from("Nope")])], None)),
        )) else {
            panic!()
        };
        assert_eq!(b.sequence, SequenceStatus::Reset);
        assert!(t.message(&[b"only one frame".to_vec()]).is_none());
        let c = stats.snapshot();
        assert_eq!(
            (
                c.kv_batches,
                c.kv_events,
                c.kv_decode_errors,
                c.kv_malformed_events,
                c.kv_unknown_events
            ),
            (4, 2, 1, 1, 1)
        );
        assert_eq!(
            (
                c.kv_sequence_gaps,
                c.kv_missed_batches,
                c.kv_sequence_resets,
                c.kv_bad_frames
            ),
            (1, 3, 1, 1)
        );
    }

    fn event(fields: Vec<(&str, Value)>) -> Value {
        Value::Map(
            fields
                .into_iter()
                .map(|(k, v)| (Value::from(k), v))
                .collect(),
        )
    }

    fn stored(hash: u64, parent: Option<u64>, more: Vec<(&str, Value)>) -> Value {
        let mut f = vec![
            ("type", Value::from("BlockStored")),
            ("block_hashes", Value::Array(vec![Value::from(hash)])),
            ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
            (
                "token_ids",
                Value::Array((0..4u32).map(Value::from).collect()),
            ),
            ("block_size", Value::from(4u32)),
        ];
        f.extend(more);
        event(f)
    }

    fn events_of(r: Option<Record>) -> Vec<KvEvent> {
        let Some(Record::KvEvents(b)) = r else {
            panic!("a batch")
        };
        b.events
    }

    #[test]
    fn a_hybrid_models_other_groups_and_a_salted_chain_reach_the_mirror_as_dynamo_takes_them() {
        let (mut t, stats) = tap(None);
        let group = |g: u32, kind: Option<&str>| {
            let mut f = vec![("group_idx", Value::from(g))];
            f.extend(kind.map(|k| ("kv_cache_spec_kind", Value::from(k))));
            f
        };
        let removed = |hash: u64, g: u32| {
            event(vec![
                ("type", Value::from("BlockRemoved")),
                ("block_hashes", Value::Array(vec![Value::from(hash)])),
                ("group_idx", Value::from(g)),
            ])
        };
        // Both groups store block 1; the sliding window drops it while the full
        // attention group keeps it: the mirror keeps it too.
        let got = events_of(t.message(&msg(
            0,
            encode(&batch(
                vec![
                    stored(1, None, group(0, Some("full_attention"))),
                    stored(1, None, group(1, Some("sliding_window"))),
                    removed(1, 1),
                    removed(1, 2),
                ],
                None,
            )),
        )));
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            matches!(&got[0], KvEvent::BlockStored { block_hashes, .. } if block_hashes == &[1])
        );
        let c = stats.snapshot();
        assert_eq!(
            (
                c.kv_events_refused_other_cache_group,
                c.kv_events_refused_unlearned_cache_group
            ),
            (2, 1)
        );
        // A chain salted at its first block (Dynamo's tag in vLLM's extra_keys): its
        // continuation hashes as a store salted outright does.
        let tagged = vec![(
            "extra_keys",
            Value::Array(vec![Value::Array(vec![Value::from("dynamo-cache-salt:t")])]),
        )];
        let got = events_of(t.message(&msg(
            1,
            encode(&batch(
                vec![stored(5, None, tagged), stored(6, Some(5), vec![])],
                None,
            )),
        )));
        let mut want = KvEvent::BlockStored {
            block_hashes: vec![6],
            parent_block_hash: Some(5),
            token_ids: (0..4).collect(),
            block_size: 4,
            local_hashes: None,
            lora_name: None,
            medium: None,
            cache_salt: Some("t".into()),
        };
        want.hash_tokens();
        assert_eq!(got[1], want);
        assert_eq!(stats.snapshot().kv_salts_inherited, 1);
        // A restarted engine: its groups are learned anew.
        let got = events_of(t.message(&msg(0, encode(&batch(vec![removed(1, 1)], None)))));
        assert!(got.is_empty());
        assert_eq!(stats.snapshot().kv_events_refused_unlearned_cache_group, 2);
    }

    /// A store whose block holds an image (the routing hash Dynamo's frontend marked, in
    /// vLLM's `extra_keys`) leaves hashed with it: with the model's placeholder known, its
    /// image run written over as Dynamo's publisher writes it; without, the objects
    /// appended, and counted.
    #[test]
    fn blocks_holding_images_are_hashed_with_them() {
        use kvscope_wire::hashing::{local_block_hash_with_media, seed_for};
        let object = 0x0123_4567_89ab_cdefu64;
        let image = Value::Array(vec![Value::Array(vec![Value::from(format!(
            "{object:016x}{}",
            "0".repeat(48)
        ))])]);
        let store = || {
            event(vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(1u64)])),
                ("parent_block_hash", Value::Nil),
                (
                    "token_ids",
                    Value::Array([7u32, 99, 99, 8].map(Value::from).to_vec()),
                ),
                ("block_size", Value::from(4u32)),
                ("extra_keys", image.clone()),
            ])
        };
        let local = |r: Option<Record>| match &events_of(r)[..] {
            [KvEvent::BlockStored {
                local_hashes: Some(l),
                ..
            }] => l.clone(),
            other => panic!("{other:?}"),
        };
        let seed = seed_for(None, None);
        let with = |image: Option<u32>| {
            let p = MediaPlaceholders { image, video: None };
            vec![local_block_hash_with_media(
                &[7, 99, 99, 8],
                seed,
                &[object],
                p,
            )]
        };
        let (t, stats) = tap(None);
        let mut known = KvTap {
            placeholders: Ok(MediaPlaceholders {
                image: Some(99),
                video: None,
            }),
            ..t
        };
        let got = local(known.message(&msg(0, encode(&batch(vec![store()], None)))));
        assert_eq!(got, with(Some(99)));
        assert_ne!(got, with(None));
        let c = stats.snapshot();
        assert_eq!(
            (c.kv_media_blocks, c.kv_media_blocks_without_placeholders),
            (1, 0)
        );
        let (mut unknown, stats) = tap(None);
        let got = local(unknown.message(&msg(0, encode(&batch(vec![store()], None)))));
        assert_eq!(got, with(None));
        let c = stats.snapshot();
        assert_eq!(
            (c.kv_media_blocks, c.kv_media_blocks_without_placeholders),
            (1, 1)
        );
    }

    #[test]
    fn the_1_4_mockers_removals_are_kept_and_counted() {
        // Dynamo's mocker before 1.5: medium left out, group_idx 0 in its slot.
        let (mut t, stats) = tap(None);
        let removed = Value::Array(vec![
            Value::from("BlockRemoved"),
            Value::Array(vec![Value::from(7u64)]),
            Value::from(0u64),
        ]);
        let Some(Record::KvEvents(b)) =
            t.message(&msg(0, encode(&batch(vec![removed], Some(Value::from(0))))))
        else {
            panic!()
        };
        assert_eq!(
            b.events,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![7],
                medium: None
            }]
        );
        let c = stats.snapshot();
        assert_eq!((c.kv_events_medium_left_out, c.kv_malformed_events), (1, 0));
    }

    #[test]
    fn a_configured_dp_rank_wins() {
        let (mut t, _) = tap(Some(1));
        let Some(Record::KvEvents(b)) =
            t.message(&msg(0, encode(&batch(vec![], Some(Value::from(4))))))
        else {
            panic!()
        };
        assert_eq!(b.worker.dp_rank, 1);
    }
}
