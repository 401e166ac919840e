//! Taps on Dynamo's event plane: the KV events every worker's publisher sends the router,
//! with the worker's identity inside, found through discovery. One agent anywhere sees
//! the whole fleet this way, no per-node process and no worker id typed by hand.
//!
//! A ZMQ channel is one publisher's PUB: one tap each (over [`crate::taps::engine::zmtp`], bounded like
//! the engine taps), subscribed to `kv-events`. A NATS channel is a subject the
//! publishers of an endpoint share: one subscription per subject, its messages told
//! apart by the envelope's publisher id. Either way each publisher is its own source in
//! the [`RecordSink`] (its messages come in its own order) and its envelope sequence
//! numbers are classified like an engine's (gaps, restarts). Messages are decoded by
//! [`kvscope_wire::dynamo_events`]; the block size, which the plane does not carry, is
//! the worker's model card's.

use crate::counters::AgentStats;
use crate::fleet::FleetView;
use crate::internal_events::{
    InternalEvent, KvBadFrame, KvBatchReceived, KvBatchReplayed, KvDecodeError, KvPeerViolation,
    KvReplayDone, KvReplayFailed, KvTapConnected, KvTapDisconnected,
};
use crate::sink::{RecordSink, SourceId};
use crate::taps::engine::tap::{emit_problems, PublisherSequence};
use crate::taps::engine::zmtp::{Connection, Limits, SocketType};
use futures::StreamExt as _;
use kvscope_discovery::{Channel, Fleet, FleetChange, KV_EVENTS_TOPIC};
use kvscope_wire::dynamo_events::{
    decode_envelope, decode_router_events, split_zmq_frames, PlaneEvent,
};
use kvscope_wire::{KvEventBatch, KvOrigin, Record, SequenceStatus, WorkerKey};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What every plane tap shares.
#[derive(Clone)]
pub struct PlaneContext {
    pub sink: Arc<RecordSink>,
    pub stats: Arc<AgentStats>,
    pub view: FleetView,
    pub limits: Limits,
    /// The longest a record waits for a quiet publisher (ns).
    pub window_ns: u64,
    /// Dynamo's NATS server, for NATS channels, and how to authenticate to it.
    pub nats: (String, kvscope_wire::NatsSecurity),
    pub stop: watch::Receiver<bool>,
}

/// The running plane taps, one per ZMQ publisher and one per NATS subject.
pub struct PlaneTaps {
    ctx: PlaneContext,
    zmq: HashMap<u64, (String, JoinHandle<()>)>,
    nats: HashMap<String, JoinHandle<()>>,
}

impl PlaneTaps {
    pub fn new(ctx: PlaneContext) -> Self {
        Self {
            ctx,
            zmq: HashMap::new(),
            nats: HashMap::new(),
        }
    }

    /// Start or stop taps for one change of the fleet.
    pub async fn apply(&mut self, change: &FleetChange) {
        match change {
            FleetChange::Publisher(p) => match &p.channel {
                Some(Channel::Zmq { endpoint }) => {
                    if self
                        .zmq
                        .get(&p.publisher_id)
                        .is_some_and(|(e, _)| e == endpoint)
                    {
                        return;
                    }
                    if let Some((_, old)) = self.zmq.remove(&p.publisher_id) {
                        old.abort();
                    }
                    let task = tokio::spawn(zmq_publisher(
                        self.ctx.clone(),
                        endpoint.clone(),
                        p.publisher_id,
                    ));
                    self.zmq.insert(p.publisher_id, (endpoint.clone(), task));
                }
                Some(ch @ Channel::Nats { .. }) => {
                    let Some(subject) = ch.nats_subject(KV_EVENTS_TOPIC) else {
                        return;
                    };
                    if !self.nats.contains_key(&subject) {
                        let task = tokio::spawn(nats_subject(self.ctx.clone(), subject.clone()));
                        self.nats.insert(subject, task);
                    }
                }
                None => {}
            },
            FleetChange::PublisherGone(p) => {
                if let Some((_, task)) = self.zmq.remove(&p.publisher_id) {
                    task.abort();
                }
            }
            FleetChange::Worker(_) | FleetChange::WorkerGone(_) => {}
        }
    }

    pub async fn stop(self) {
        for (_, t) in self.zmq.into_values() {
            t.abort();
            let _ = t.await;
        }
        for t in self.nats.into_values() {
            t.abort();
            let _ = t.await;
        }
    }
}

/// A publisher's source in the sink, retired when its tap ends (aborted included), so a
/// publisher that is gone never holds records back.
struct SourceGuard {
    sink: Arc<RecordSink>,
    id: SourceId,
}

impl Drop for SourceGuard {
    fn drop(&mut self) {
        self.sink.retire_source(self.id);
    }
}

/// Turns event-plane envelopes into KV batch records (no I/O).
pub(crate) struct PlaneDecoder {
    sequences: HashMap<u64, PublisherSequence>,
    /// Per publisher, the newest event id a recovery answer covered: live events up to
    /// it were in the answer, and are dropped.
    recovered_through: HashMap<u64, u64>,
    stats: Arc<AgentStats>,
}

/// One envelope, decoded: its events (with their ids) not yet made records.
#[derive(Debug, Clone)]
pub(crate) struct DecodedEnvelope {
    pub publisher_id: u64,
    /// `<channel>#<publisher hex>`: the batches' `publisher`.
    pub publisher: String,
    /// The engine's time, UNIX ns, when plausible.
    pub at: Option<u64>,
    pub seq: u64,
    pub sequence: SequenceStatus,
    pub engine_ts: f64,
    /// The worker discovery registers the publisher for.
    pub registered: Option<WorkerKey>,
    pub events: Vec<PlaneEvent>,
}

impl DecodedEnvelope {
    /// Batches before this one are missing: a publisher seen first past its start, or
    /// a gap.
    pub(crate) fn missed_some(&self) -> bool {
        matches!(self.sequence, SequenceStatus::Gap { .. })
            || (self.sequence == SequenceStatus::First && self.seq > 0)
    }
}

impl PlaneDecoder {
    pub fn new(stats: Arc<AgentStats>) -> Self {
        Self {
            sequences: HashMap::new(),
            recovered_through: HashMap::new(),
            stats,
        }
    }

    /// One envelope from `channel` → (publisher id, engine time in UNIX ns, records);
    /// every problem is emitted. (The taps go through [`Self::decode`] and
    /// [`Self::recover`].)
    #[cfg(test)]
    fn envelope(
        &mut self,
        channel: &str,
        bytes: &[u8],
        fleet: &Fleet,
    ) -> Option<(u64, Option<u64>, Vec<Record>)> {
        let d = self.decode(channel, bytes, fleet)?;
        Some((d.publisher_id, d.at, self.records(d)))
    }

    /// The envelope's events, each with its worker's block size; events a recovery
    /// answer already held are left out.
    pub fn decode(
        &mut self,
        channel: &str,
        bytes: &[u8],
        fleet: &Fleet,
    ) -> Option<DecodedEnvelope> {
        let env = match decode_envelope(bytes) {
            Ok(e) => e,
            Err(error) => {
                KvDecodeError {
                    publisher: channel,
                    error: &error,
                }
                .emit(&self.stats);
                return None;
            }
        };
        let publisher = format!("{channel}#{:x}", env.publisher_id);
        if env.topic != KV_EVENTS_TOPIC {
            let error = format!("topic {:?} is not {KV_EVENTS_TOPIC}", env.topic);
            KvBadFrame {
                publisher: &publisher,
                error: &error,
            }
            .emit(&self.stats);
            return None;
        }
        let numbering = self.sequences.entry(env.publisher_id).or_default();
        let sequence = numbering.observe(&publisher, env.sequence, &self.stats);
        // The plane carries no block size: each event gets its worker's, below.
        let decoded = match decode_router_events(&env.payload, 0) {
            Ok(d) => d,
            Err(error) => {
                KvDecodeError {
                    publisher: &publisher,
                    error: &error,
                }
                .emit(&self.stats);
                // Its events are lost here: the next envelope tells it as a gap (and
                // asks the worker's recovery for them).
                numbering.undelivered();
                return None;
            }
        };
        let sequence = numbering.delivered(sequence);
        emit_problems(&publisher, &decoded.problems, &self.stats);
        if sequence == SequenceStatus::Reset {
            // A restarted publisher numbers its events anew.
            self.recovered_through.remove(&env.publisher_id);
        }
        let through = self.recovered_through.get(&env.publisher_id).copied();
        let events = decoded
            .events
            .into_iter()
            .filter(|e| through.is_none_or(|t| e.event_id > t))
            .map(|mut e| {
                with_block_size(&mut e, fleet);
                e
            })
            .collect();
        Some(DecodedEnvelope {
            publisher_id: env.publisher_id,
            publisher,
            at: (env.published_at_ms > 1_000_000_000_000)
                .then(|| env.published_at_ms.saturating_mul(1_000_000)),
            seq: env.sequence,
            sequence,
            engine_ts: env.published_at_ms as f64 / 1e3,
            registered: fleet.kv_publishers.get(&env.publisher_id).map(|p| p.worker),
            events,
        })
    }

    /// The envelope as batches: one per worker and rank it holds events of (one
    /// publisher is one worker and rank; should an envelope hold several, each gets its
    /// own batch, same sequence number).
    pub fn records(&self, d: DecodedEnvelope) -> Vec<Record> {
        let mut by_worker: BTreeMap<WorkerKey, Vec<kvscope_wire::KvEvent>> = BTreeMap::new();
        for e in d.events {
            by_worker.entry(e.worker).or_default().push(e.event);
        }
        if by_worker.is_empty() {
            if let Some(w) = d.registered {
                by_worker.insert(w, Vec::new());
            }
        }
        by_worker
            .into_iter()
            .map(|(worker, events)| {
                KvBatchReceived {
                    publisher: &d.publisher,
                    events: events.len(),
                }
                .emit(&self.stats);
                Record::KvEvents(KvEventBatch {
                    worker,
                    publisher: d.publisher.clone(),
                    origin: KvOrigin::EventPlane,
                    seq: d.seq,
                    sequence: d.sequence,
                    engine_ts: d.engine_ts,
                    events,
                })
            })
            .collect()
    }

    /// The publisher's worker's whole cache through Dynamo's recovery endpoint (see
    /// [`crate::taps::plane::recovery`]), as a `Replayed` batch that clears the worker first,
    /// numbered `seq`; live events the answer already held are dropped from then on.
    /// `None` without a recovery target, or when the query fails (counted).
    async fn dump(
        &mut self,
        publisher_id: u64,
        label: &str,
        seq: u64,
        engine_ts: f64,
        fleet: &Fleet,
    ) -> Option<Record> {
        let publisher = fleet.kv_publishers.get(&publisher_id)?;
        let tcp = publisher.recovery.as_ref()?.tcp.as_deref()?;
        let worker = publisher.worker;
        let block_size = fleet
            .workers
            .get(&worker.worker_id)
            .and_then(|w| w.block_size)
            .unwrap_or(0);
        let r = match crate::taps::plane::recovery::query(
            tcp,
            worker,
            None,
            block_size,
            RECOVERY_TIMEOUT,
        )
        .await
        {
            Ok(r) => r,
            Err(error) => {
                KvReplayFailed {
                    publisher: label,
                    replay: tcp,
                    error: &error,
                }
                .emit(&self.stats);
                return None;
            }
        };
        let mut events: Vec<kvscope_wire::KvEvent> = Vec::with_capacity(r.events.len() + 1);
        if r.dump {
            events.push(kvscope_wire::KvEvent::AllBlocksCleared);
        }
        events.extend(
            r.events
                .into_iter()
                .filter(|e| e.worker == worker)
                .map(|mut e| {
                    with_block_size(&mut e, fleet);
                    e.event
                }),
        );
        self.recovered_through.insert(publisher_id, r.last_event_id);
        KvBatchReplayed {
            publisher: label,
            seq,
        }
        .emit(&self.stats);
        Some(Record::KvEvents(KvEventBatch {
            worker,
            publisher: label.to_string(),
            origin: KvOrigin::EventPlane,
            seq,
            sequence: SequenceStatus::Replayed,
            engine_ts,
            events,
        }))
    }

    /// On subscribing, before the first envelope: the worker's cache as it is now
    /// (numbered 0) when it holds anything — kvscope started after the engines — so
    /// the mirror starts whole rather than empty, idle workers included.
    pub async fn start_from_dump(
        &mut self,
        channel: &str,
        publisher_id: u64,
        fleet: &Fleet,
    ) -> Option<Record> {
        let label = format!("{channel}#{publisher_id:x}");
        let now = kvscope_kit::clock::now_ns() as f64 / 1e9;
        let r = self.dump(publisher_id, &label, 0, now, fleet).await?;
        // An empty cache (the usual start, before any request) needs no dump: the
        // stream starts as it would have anyway.
        let cached = matches!(&r, Record::KvEvents(b) if b.events.iter().any(|e| !matches!(e, kvscope_wire::KvEvent::AllBlocksCleared)));
        if !cached {
            self.recovered_through.remove(&publisher_id);
            return None;
        }
        KvReplayDone {
            publisher: &label,
            from: 0,
            next: 0,
            batches: 1,
            complete: true,
        }
        .emit(&self.stats);
        Some(r)
    }

    /// `d` is the first envelope after a dump, or missed some: the batches that stand
    /// in for what came before it (`Replayed`, numbered just before it) come first,
    /// and `d` follows in order without the events they already held. After a dump
    /// that is an empty marker; after a gap, or a late first envelope with no dump
    /// yet, a fresh dump. Without a recovery target, or when the query fails, nothing
    /// (counted), and `d` stays as it is.
    pub async fn recover(&mut self, d: &mut DecodedEnvelope, fleet: &Fleet) -> Option<Record> {
        let seq = d.seq.saturating_sub(1);
        let dumped = d.sequence == SequenceStatus::First
            && self.recovered_through.contains_key(&d.publisher_id);
        if dumped && d.seq == 0 {
            // A publisher that started anew since the dump: nothing came before.
            return None;
        }
        let record = if dumped {
            Record::KvEvents(KvEventBatch {
                worker: d.registered.or(d.events.first().map(|e| e.worker))?,
                publisher: d.publisher.clone(),
                origin: KvOrigin::EventPlane,
                seq,
                sequence: SequenceStatus::Replayed,
                engine_ts: d.engine_ts,
                events: Vec::new(),
            })
        } else {
            if !d.missed_some() {
                return None;
            }
            let r = self
                .dump(d.publisher_id, &d.publisher, seq, d.engine_ts, fleet)
                .await?;
            let from = match d.sequence {
                SequenceStatus::Gap { missed } => d.seq.saturating_sub(missed),
                _ => 0,
            };
            KvReplayDone {
                publisher: &d.publisher,
                from,
                next: d.seq,
                batches: 1,
                complete: true,
            }
            .emit(&self.stats);
            r
        };
        let through = self
            .recovered_through
            .get(&d.publisher_id)
            .copied()
            .unwrap_or(0);
        d.events.retain(|e| e.event_id > through);
        d.sequence = SequenceStatus::InOrder;
        Some(record)
    }
}

/// As Dynamo's own request-plane client (`DYN_TCP_REQUEST_TIMEOUT`); the tap reads nothing
/// meanwhile, its messages wait in the socket.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(5);

fn with_block_size(e: &mut PlaneEvent, fleet: &Fleet) {
    if let kvscope_wire::KvEvent::BlockStored { block_size, .. } = &mut e.event {
        *block_size = fleet
            .workers
            .get(&e.worker.worker_id)
            .and_then(|w| w.block_size)
            .unwrap_or(0);
    }
}

async fn zmq_publisher(ctx: PlaneContext, endpoint: String, publisher_id: u64) {
    let source = SourceGuard {
        sink: ctx.sink.clone(),
        id: ctx.sink.add_publisher(&endpoint, ctx.window_ns),
    };
    let mut decoder = PlaneDecoder::new(ctx.stats.clone());
    let mut stop = ctx.stop.clone();
    let label = format!("{endpoint}#{publisher_id:x}");
    let mut backoff = MIN_BACKOFF;
    let mut dumped = false;
    while !*stop.borrow() {
        let connected = tokio::select! {
            r = Connection::connect(&endpoint, SocketType::Sub, ctx.limits, CONNECT_TIMEOUT) => r,
            _ = stop.changed() => return,
        };
        let subscribed = match connected {
            Ok(mut c) => c.subscribe(KV_EVENTS_TOPIC.as_bytes()).await.map(|()| c),
            Err(e) => Err(e),
        };
        match subscribed {
            Ok(mut conn) => {
                KvTapConnected { publisher: &label }.emit(&ctx.stats);
                backoff = MIN_BACKOFF;
                // Subscribed: what the worker cached before now, once.
                if !dumped {
                    let fleet = ctx.view.borrow().clone();
                    if let Some(r) = decoder
                        .start_from_dump(&endpoint, publisher_id, &fleet)
                        .await
                    {
                        ctx.sink.submit_event(source.id, r, None);
                    }
                    dumped = true;
                }
                loop {
                    let msg = tokio::select! {
                        m = conn.recv() => m,
                        _ = stop.changed() => return,
                    };
                    let frames = match msg {
                        Ok(f) => f,
                        Err(e) => {
                            if e.is_peer_violation() {
                                KvPeerViolation {
                                    publisher: &label,
                                    error: &e.to_string(),
                                }
                                .emit(&ctx.stats);
                            }
                            KvTapDisconnected {
                                publisher: &label,
                                error: &e.to_string(),
                                retry_in_ms: backoff.as_millis() as u64,
                            }
                            .emit(&ctx.stats);
                            break;
                        }
                    };
                    let bytes = match split_zmq_frames(&frames) {
                        Ok(b) => b,
                        Err(error) => {
                            KvBadFrame {
                                publisher: &label,
                                error: &error,
                            }
                            .emit(&ctx.stats);
                            continue;
                        }
                    };
                    let fleet = ctx.view.borrow().clone();
                    let Some(mut d) = decoder.decode(&endpoint, bytes, &fleet) else {
                        continue;
                    };
                    if let Some(r) = decoder.recover(&mut d, &fleet).await {
                        ctx.sink.submit_event(source.id, r, d.at);
                    }
                    let at = d.at;
                    for r in decoder.records(d) {
                        ctx.sink.submit_event(source.id, r, at);
                    }
                }
            }
            Err(e) => KvTapDisconnected {
                publisher: &label,
                error: &e.to_string(),
                retry_in_ms: backoff.as_millis() as u64,
            }
            .emit(&ctx.stats),
        }
        let wait = backoff;
        backoff = (backoff * 2).min(MAX_BACKOFF);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return,
        }
    }
}

async fn nats_subject(ctx: PlaneContext, subject: String) {
    let mut stop = ctx.stop.clone();
    let label = format!("nats:{subject}");
    let client = loop {
        let (url, security) = &ctx.nats;
        let connect = async {
            security
                .connect_options(None)
                .await
                .map_err(|e| e.to_string())?
                .retry_on_initial_connect()
                .max_reconnects(None)
                .connection_timeout(CONNECT_TIMEOUT)
                .connect(url.as_str())
                .await
                .map_err(|e| e.to_string())
        };
        match tokio::select! { c = connect => c, _ = stop.changed() => return } {
            Ok(c) => break c,
            Err(e) => {
                KvTapDisconnected {
                    publisher: &label,
                    error: &e.to_string(),
                    retry_in_ms: MAX_BACKOFF.as_millis() as u64,
                }
                .emit(&ctx.stats);
                tokio::select! {
                    _ = tokio::time::sleep(MAX_BACKOFF) => {}
                    _ = stop.changed() => return,
                }
            }
        }
    };
    let mut sources: HashMap<u64, SourceGuard> = HashMap::new();
    let mut decoder = PlaneDecoder::new(ctx.stats.clone());
    loop {
        let mut sub = match client.subscribe(subject.clone()).await {
            Ok(s) => s,
            Err(e) => {
                KvTapDisconnected {
                    publisher: &label,
                    error: &e.to_string(),
                    retry_in_ms: MAX_BACKOFF.as_millis() as u64,
                }
                .emit(&ctx.stats);
                tokio::select! {
                    _ = tokio::time::sleep(MAX_BACKOFF) => continue,
                    _ = stop.changed() => return,
                }
            }
        };
        KvTapConnected { publisher: &label }.emit(&ctx.stats);
        loop {
            let msg = tokio::select! {
                m = sub.next() => m,
                _ = stop.changed() => return,
            };
            let Some(msg) = msg else { break };
            if msg.payload.len() as u64 > ctx.limits.max_message_bytes {
                KvPeerViolation {
                    publisher: &label,
                    error: &format!(
                        "message of {} bytes over the limit of {}",
                        msg.payload.len(),
                        ctx.limits.max_message_bytes
                    ),
                }
                .emit(&ctx.stats);
                continue;
            }
            let fleet = ctx.view.borrow().clone();
            let Some(mut d) = decoder.decode(&label, &msg.payload, &fleet) else {
                continue;
            };
            let publisher = d.publisher_id;
            let source = sources.entry(publisher).or_insert_with(|| SourceGuard {
                sink: ctx.sink.clone(),
                id: ctx
                    .sink
                    .add_publisher(&format!("{label}/{publisher}"), ctx.window_ns),
            });
            if let Some(r) = decoder.recover(&mut d, &fleet).await {
                ctx.sink.submit_event(source.id, r, d.at);
            }
            let at = d.at;
            for r in decoder.records(d) {
                ctx.sink.submit_event(source.id, r, at);
            }
            // Publishers that left the fleet stop holding records back.
            sources.retain(|id, _| fleet.kv_publishers.contains_key(id) || *id == publisher);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_discovery::{KvPublisher, Worker};
    use kvscope_wire::dynamo_events::{encode, PlaneEvent};
    use kvscope_wire::{KvEvent, SequenceStatus};

    fn fleet() -> Fleet {
        let mut f = Fleet::default();
        f.workers.insert(
            9,
            Worker {
                instance_id: 9,
                namespace: "dynamo".into(),
                component: "backend".into(),
                endpoint: "generate".into(),
                request_plane: None,
                model: Some("m".into()),
                block_size: Some(16),
                total_kv_blocks: Some(100),
                dp_ranks: vec![0],
                worker_type: None,
                model_config: None,
            },
        );
        f.kv_publishers.insert(
            77,
            KvPublisher {
                publisher_id: 77,
                worker: WorkerKey {
                    worker_id: 9,
                    dp_rank: 0,
                },
                channel: None,
                recovery: None,
            },
        );
        f
    }

    #[test]
    fn envelopes_become_event_plane_batches_with_the_cards_block_size() {
        let stats = Arc::new(AgentStats::default());
        let mut d = PlaneDecoder::new(stats.clone());
        let w = WorkerKey {
            worker_id: 9,
            dp_rank: 0,
        };
        let stored = KvEvent::BlockStored {
            block_hashes: vec![1, 2],
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 16,
            local_hashes: Some(vec![11, 12]),
            lora_name: None,
            medium: None,
            cache_salt: None,
        };
        let msg = |seq| {
            encode(
                77,
                seq,
                1_796_000_000_123,
                &[PlaneEvent {
                    worker: w,
                    event_id: seq + 1,
                    event: stored.clone(),
                }],
            )
        };
        let (publisher, at, records) = d.envelope("tcp://x", &msg(0), &fleet()).unwrap();
        assert_eq!(publisher, 77);
        assert_eq!(at, Some(1_796_000_000_123_000_000));
        let [Record::KvEvents(b)] = &records[..] else {
            panic!("{records:?}")
        };
        assert_eq!(
            (b.worker, b.origin, b.seq, b.sequence),
            (w, KvOrigin::EventPlane, 0, SequenceStatus::First)
        );
        assert_eq!(b.events, vec![stored.clone()]);
        assert_eq!(b.publisher, "tcp://x#4d");
        let (_, _, r) = d.envelope("tcp://x", &msg(3), &fleet()).unwrap();
        let Record::KvEvents(b) = &r[0] else { panic!() };
        assert_eq!(b.sequence, SequenceStatus::Gap { missed: 2 });
        assert!(d.envelope("tcp://x", b"\x93garbage", &fleet()).is_none());
        // An envelope whose payload cannot be read: its number is taken, and the next
        // envelope carries it as a gap (so the collector knows the mirror lacks it).
        let unreadable = {
            use rmpv::Value;
            let env = Value::Map(vec![
                ("publisher_id".into(), 77.into()),
                ("sequence".into(), 4.into()),
                ("published_at".into(), 1_796_000_000_200u64.into()),
                ("topic".into(), "kv-events".into()),
                ("payload".into(), Value::Binary(vec![0xc1])),
            ]);
            let mut out = Vec::new();
            rmpv::encode::write_value(&mut out, &env).unwrap();
            out
        };
        assert!(d.envelope("tcp://x", &unreadable, &fleet()).is_none());
        let (_, _, r) = d.envelope("tcp://x", &msg(5), &fleet()).unwrap();
        let Record::KvEvents(b) = &r[0] else { panic!() };
        assert_eq!(b.sequence, SequenceStatus::Gap { missed: 1 });
        let c = stats.snapshot();
        assert_eq!(
            (c.kv_batches, c.kv_sequence_gaps, c.kv_decode_errors),
            (3, 1, 2)
        );
    }
}
