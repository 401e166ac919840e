//! Ships the buffered records to NATS JetStream.
//!
//! Creates (or updates) the cluster's stream — file storage, every subject of the
//! cluster, the configured retention — then publishes each record as JSON to its
//! subject and waits for JetStream's acknowledgement before removing it from the
//! buffer. Records stamped together (a burst released by the reorder window) go as one
//! message when they share a scope (`kvscope_wire::bundle`): NATS costs per message.
//! Messages are sent in windows of up to [`WINDOW`] with the acks awaited in order;
//! each carries a `Nats-Msg-Id` unique to this agent run, so re-sending a window after
//! a failure cannot store a record twice (within the stream's duplicate window).
//! A record larger than the server's `max_payload` (one long prompt's batch or
//! decision) goes in consecutive parts that the collector joins (`kvscope_wire::parts`);
//! one that JetStream itself refuses is set aside and counted, so it never holds back
//! the records behind it.
//! While NATS is away the client reconnects in the background and the records wait in
//! the bounded buffer of [`RecordSink`]. The agent authenticates as its `[nats]` settings
//! say and publishes only under `kvscope.<cluster>.<agent_id>.`, which is what a server's
//! permissions give it; a refusal by the server is counted in `bus_refusals`.

use crate::counters::AgentStats;
use crate::internal_events::{
    BusRefused, InternalEvent, PublishFailed, RecordPublished, RecordSetAside, RecordSplit,
    StreamKeptAsIs, StreamReady,
};
use crate::sink::RecordSink;
use async_nats::jetstream::{self, context::PublishErrorKind, message::PublishMessage};
use kvscope_kit::Health;
use kvscope_wire::nats_security::{refusal, refused_connection};
use kvscope_wire::parts;
use kvscope_wire::subject::{stream_config, stream_replicas};
use kvscope_wire::{NatsSecurity, Subjects};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The readiness check the publisher keeps.
pub(crate) const BUS_CHECK: &str = "bus";

/// Messages in flight at once.
pub const WINDOW: usize = 128;
const ACK_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

pub struct PublisherConfig {
    pub nats_url: String,
    /// Credentials and TLS (see `kvscope_wire::nats_security`).
    pub security: NatsSecurity,
    /// Where the server's replies to this agent go (`Subjects::inbox_prefix`).
    pub inbox_prefix: String,
    pub subjects: Subjects,
    pub stream_max_age: Duration,
    /// The stream's byte limit (0: none); see `kvscope_wire::subject::stream_config`.
    pub stream_max_bytes: u64,
    /// Servers keeping the stream (0: 3 on a cluster of three or more, else 1).
    pub stream_replicas: usize,
    /// Prefix of the de-duplication ids: unique per agent run.
    pub run_id: String,
    /// Its `bus` readiness check: connected, stream set up, publishing.
    pub health: Arc<Health>,
}

/// Publish until `stop` turns true, then keep draining until the buffer is empty or
/// `drain` says to give up (`drain` turns true after the shutdown grace period).
pub async fn run(
    cfg: PublisherConfig,
    sink: Arc<RecordSink>,
    stats: Arc<AgentStats>,
    mut stop: watch::Receiver<bool>,
    mut give_up: watch::Receiver<bool>,
) {
    let mut backoff = Duration::from_millis(100);
    let client = loop {
        match connect(&cfg, &stats).await {
            Ok(c) => break c,
            Err(e) => {
                // Not reachable, or refused (counted apart): retried, with backoff, and with
                // the credentials read again (a rotated secret is picked up).
                let e = format!("cannot connect to {}: {e}", cfg.nats_url);
                fail(&cfg.health, &stats, &sink, &e, &mut backoff, &mut give_up).await;
                if *give_up.borrow() {
                    return;
                }
            }
        }
    };
    let js = jetstream::new(client.clone());
    let mut stream_ready = false;
    backoff = Duration::from_millis(100);
    loop {
        let stopping = *stop.borrow();
        if *give_up.borrow() || (stopping && sink.buffered() == 0) {
            return;
        }
        if !stream_ready {
            // The stream as it is: its copies are never taken away. A stream that cannot
            // be read (its servers electing a leader, or short of a quorum) is not
            // touched until it can be.
            let existing = match js.get_stream(cfg.subjects.stream_name()).await {
                Ok(s) => Some(s.cached_info().config.num_replicas),
                Err(e) if stream_not_found(&e) => None,
                Err(e) => {
                    fail(
                        &cfg.health,
                        &stats,
                        &sink,
                        &format!("cannot read the stream: {e}"),
                        &mut backoff,
                        &mut give_up,
                    )
                    .await;
                    continue;
                }
            };
            let replicas = stream_replicas(cfg.stream_replicas, &client.server_info(), existing);
            match js
                .create_or_update_stream(stream_config(
                    &cfg.subjects,
                    cfg.stream_max_age,
                    cfg.stream_max_bytes,
                    replicas,
                ))
                .await
            {
                Ok(_) => {
                    StreamReady {
                        stream: &cfg.subjects.stream_name(),
                    }
                    .emit(&stats);
                    stream_ready = true;
                    cfg.health.ok(BUS_CHECK);
                }
                // The server refused this agent's limits (a store too small for
                // `stream_max_bytes`, say), but the stream is there: publish to it as it
                // is rather than not at all.
                Err(e) if js.get_stream(cfg.subjects.stream_name()).await.is_ok() => {
                    StreamKeptAsIs {
                        stream: &cfg.subjects.stream_name(),
                        error: &e.to_string(),
                    }
                    .emit(&stats);
                    stream_ready = true;
                    cfg.health.ok(BUS_CHECK);
                }
                Err(e) => {
                    fail(
                        &cfg.health,
                        &stats,
                        &sink,
                        &format!(
                            "cannot create or update the stream (stream_max_bytes = {}, \
                             stream_max_age_secs = {}; the server's JetStream store must \
                             hold that much): {e}",
                            cfg.stream_max_bytes,
                            cfg.stream_max_age.as_secs()
                        ),
                        &mut backoff,
                        &mut give_up,
                    )
                    .await;
                    continue;
                }
            }
        }
        if sink.buffered() == 0 {
            tokio::select! {
                _ = sink.ready() => {}
                _ = stop.changed() => {}
                _ = give_up.changed() => {}
            }
            continue;
        }
        let window = sink.peek(WINDOW);
        let part_bytes = part_bytes(client.max_payload(), &cfg.run_id);
        let (done, error) = publish_window(&js, &cfg.run_id, &window, part_bytes, &stats).await;
        sink.ack(done);
        if let Some(e) = error {
            // "no responders" means the stream is gone (or JetStream is off): set it up again.
            stream_ready = false;
            fail(&cfg.health, &stats, &sink, &e, &mut backoff, &mut give_up).await;
        } else {
            backoff = Duration::from_millis(100);
            cfg.health.ok(BUS_CHECK);
        }
    }
}

/// Whether the server answered that the stream does not exist (not merely that it could
/// not be read).
fn stream_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::GetStreamErrorKind::JetStream(j)
            if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}

/// Connect once. The server refusing the credentials, there or later on the live
/// connection (a permissions violation too), is counted as a refusal.
async fn connect(
    cfg: &PublisherConfig,
    stats: &Arc<AgentStats>,
) -> Result<async_nats::Client, String> {
    let events = stats.clone();
    let health = cfg.health.clone();
    let options = cfg
        .security
        .connect_options(Some(&cfg.inbox_prefix))
        .await
        .map_err(|e| e.to_string())?
        .event_callback(move |event| {
            let stats = events.clone();
            let health = health.clone();
            async move {
                if let Some(e) = refusal(&event) {
                    BusRefused { error: &e }.emit(&stats);
                }
                match event {
                    async_nats::Event::Disconnected => {
                        health.fail(BUS_CHECK, "disconnected from NATS; reconnecting")
                    }
                    async_nats::Event::Connected => health.ok(BUS_CHECK),
                    _ => {}
                }
            }
        })
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(5));
    let servers = kvscope_wire::nats_security::server_urls(&cfg.nats_url);
    if servers.is_empty() {
        return Err("no NATS server URL given".into());
    }
    options.connect(servers.as_slice()).await.map_err(|e| {
        if refused_connection(&e) {
            BusRefused {
                error: &e.to_string(),
            }
            .emit(stats);
        }
        e.to_string()
    })
}

/// The largest part of a record that fits one message beside its headers (the
/// de-duplication id and the part index count against the server's `max_payload`).
fn part_bytes(max_payload: usize, run_id: &str) -> usize {
    let headers = 256 + run_id.len();
    max_payload.saturating_sub(headers).max(1024)
}

/// Publish `window`, a record per message or, past `part_bytes`, in parts (see
/// `kvscope_wire::parts`), and wait for the acknowledgements in order. Returns how many
/// records from the front are done — acknowledged whole, or refused by JetStream itself
/// and set aside — and the error that stopped the rest, if any (they are retried).
async fn publish_window(
    js: &jetstream::Context,
    run_id: &str,
    window: &[crate::sink::Outgoing],
    part_bytes: usize,
    stats: &AgentStats,
) -> (usize, Option<String>) {
    let mut sent: Vec<Vec<jetstream::context::PublishAckFuture>> = Vec::new();
    let mut error = None;
    'records: for out in window {
        let parts: Vec<&[u8]> = parts::split(&out.payload, part_bytes).collect();
        let mut acks = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            let mut msg = PublishMessage::build().payload(out.payload.slice_ref(part));
            if parts.len() == 1 {
                msg = msg.message_id(parts::message_id(run_id, out.local_seq, None));
            } else {
                msg = msg
                    .message_id(parts::message_id(run_id, out.local_seq, Some(i as u32)))
                    .header(parts::PART_HEADER, format!("{i}/{}", parts.len()).as_str());
            }
            match js.send_publish(out.subject.clone(), msg).await {
                Ok(ack) => acks.push(ack),
                Err(e) => {
                    error = Some(e.to_string());
                    break 'records;
                }
            }
        }
        sent.push(acks);
    }
    let mut done = 0;
    for (out, acks) in window.iter().zip(sent) {
        let parts = acks.len();
        let mut refused = None;
        for ack in acks {
            match tokio::time::timeout(ACK_TIMEOUT, ack).await {
                Ok(Ok(_)) => {}
                // JetStream answered, and refused this message: the record's own fault,
                // so it must not hold back the ones behind it.
                Ok(Err(e)) if e.kind() == PublishErrorKind::Other => {
                    refused.get_or_insert(e.to_string());
                }
                Ok(Err(e)) => return (done, Some(e.to_string())),
                Err(_) => return (done, Some("no JetStream acknowledgement in time".into())),
            }
        }
        match refused {
            Some(e) => RecordSetAside {
                error: &e,
                bytes: out.payload.len(),
                records: out.records,
                subject: &out.subject,
            }
            .emit(stats),
            None => {
                if parts > 1 {
                    RecordSplit {
                        bytes: out.payload.len(),
                        parts,
                        subject: &out.subject,
                    }
                    .emit(stats);
                }
                RecordPublished {
                    records: out.records,
                }
                .emit(stats);
            }
        }
        done += 1;
    }
    (done, error)
}

async fn fail(
    health: &Health,
    stats: &AgentStats,
    sink: &RecordSink,
    error: &str,
    backoff: &mut Duration,
    give_up: &mut watch::Receiver<bool>,
) {
    health.fail(BUS_CHECK, error);
    PublishFailed {
        error,
        buffered: sink.buffered(),
    }
    .emit(stats);
    tokio::select! {
        _ = tokio::time::sleep(*backoff) => {}
        _ = give_up.changed() => {}
    }
    *backoff = (*backoff * 2).min(MAX_BACKOFF);
}
