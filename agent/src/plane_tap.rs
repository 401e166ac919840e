//! Taps on Dynamo's event plane: the KV events every worker's publisher sends the router,
//! with the worker's identity inside, found through discovery. One agent anywhere sees
//! the whole fleet this way, no per-node process and no worker id typed by hand.
//!
//! A ZMQ channel is one publisher's PUB: one tap each (over [`crate::zmtp`], bounded like
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
    InternalEvent, KvBadFrame, KvBatchReceived, KvDecodeError, KvPeerViolation, KvTapConnected,
    KvTapDisconnected,
};
use crate::record_sink::{RecordSink, SourceId};
use crate::zmq_tap::{emit_problems, PublisherSequence};
use crate::zmtp::{Connection, Limits, SocketType};
use futures::StreamExt as _;
use kvscope_discovery::{Channel, Fleet, FleetChange, KV_EVENTS_TOPIC};
use kvscope_wire::dynamo_events::{decode_envelope, decode_router_events, split_zmq_frames};
use kvscope_wire::{KvEventBatch, KvOrigin, Record, WorkerKey};
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
pub struct PlaneDecoder {
    sequences: HashMap<u64, PublisherSequence>,
    stats: Arc<AgentStats>,
}

impl PlaneDecoder {
    pub fn new(stats: Arc<AgentStats>) -> Self {
        Self {
            sequences: HashMap::new(),
            stats,
        }
    }

    /// One envelope from `channel` → (publisher id, engine time in UNIX ns, records);
    /// every problem is emitted.
    pub fn envelope(
        &mut self,
        channel: &str,
        bytes: &[u8],
        fleet: &Fleet,
    ) -> Option<(u64, Option<u64>, Vec<Record>)> {
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
        let sequence = self.sequences.entry(env.publisher_id).or_default().observe(
            &publisher,
            env.sequence,
            &self.stats,
        );
        let registered = fleet.kv_publishers.get(&env.publisher_id);
        let block_size = |worker_id: u64| {
            fleet
                .workers
                .get(&worker_id)
                .and_then(|w| w.block_size)
                .unwrap_or(0)
        };
        // The plane carries no block size: each event gets its worker's, below.
        let decoded = match decode_router_events(&env.payload, 0) {
            Ok(d) => d,
            Err(error) => {
                KvDecodeError {
                    publisher: &publisher,
                    error: &error,
                }
                .emit(&self.stats);
                return None;
            }
        };
        emit_problems(&publisher, &decoded.problems, &self.stats);
        // One publisher is one worker and rank; should an envelope hold several, each
        // gets its own batch (same sequence number).
        let mut by_worker: BTreeMap<WorkerKey, Vec<kvscope_wire::KvEvent>> = BTreeMap::new();
        for e in decoded.events {
            let mut event = e.event;
            if let kvscope_wire::KvEvent::BlockStored { block_size: bs, .. } = &mut event {
                *bs = block_size(e.worker.worker_id);
            }
            by_worker.entry(e.worker).or_default().push(event);
        }
        if by_worker.is_empty() {
            if let Some(p) = registered {
                by_worker.insert(p.worker, Vec::new());
            }
        }
        let engine_ts = env.published_at_ms as f64 / 1e3;
        let records = by_worker
            .into_iter()
            .map(|(worker, events)| {
                KvBatchReceived {
                    publisher: &publisher,
                    events: events.len(),
                }
                .emit(&self.stats);
                Record::KvEvents(KvEventBatch {
                    worker,
                    publisher: publisher.clone(),
                    origin: KvOrigin::EventPlane,
                    seq: env.sequence,
                    sequence,
                    engine_ts,
                    events,
                })
            })
            .collect();
        let at = (env.published_at_ms > 1_000_000_000_000)
            .then(|| env.published_at_ms.saturating_mul(1_000_000));
        Some((env.publisher_id, at, records))
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
                    if let Some((_, at, records)) = decoder.envelope(&endpoint, bytes, &fleet) {
                        for r in records {
                            ctx.sink.submit_event(source.id, r, at);
                        }
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
            let Some((publisher, at, records)) = decoder.envelope(&label, &msg.payload, &fleet)
            else {
                continue;
            };
            let source = sources.entry(publisher).or_insert_with(|| SourceGuard {
                sink: ctx.sink.clone(),
                id: ctx
                    .sink
                    .add_publisher(&format!("{label}/{publisher}"), ctx.window_ns),
            });
            for r in records {
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
        let c = stats.snapshot();
        assert_eq!(
            (c.kv_batches, c.kv_sequence_gaps, c.kv_decode_errors),
            (2, 1, 1)
        );
    }
}
