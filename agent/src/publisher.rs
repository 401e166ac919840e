//! Ships the buffered records to NATS JetStream.
//!
//! Creates (or updates) the cluster's stream — file storage, every subject of the
//! cluster, the configured retention — then publishes each record as JSON to its
//! subject and waits for JetStream's acknowledgement before removing it from the
//! buffer. Records are sent in windows of up to [`WINDOW`] with the acks awaited in
//! order; each carries a `Nats-Msg-Id` unique to this agent run, so re-sending a window
//! after a failure cannot store a record twice (within the stream's duplicate window).
//! While NATS is away the client reconnects in the background and the records wait in
//! the bounded buffer of [`RecordSink`].

use crate::counters::AgentStats;
use crate::internal_events::{InternalEvent, PublishFailed, RecordPublished, StreamReady};
use crate::record_sink::RecordSink;
use async_nats::jetstream::{self, message::PublishMessage};
use kvscope_wire::subject::stream_config;
use kvscope_wire::Subjects;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Records in flight at once.
pub const WINDOW: usize = 128;
const ACK_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

pub struct PublisherConfig {
    pub nats_url: String,
    pub subjects: Subjects,
    pub stream_max_age: Duration,
    /// Prefix of the de-duplication ids: unique per agent run.
    pub run_id: String,
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
    let client = loop {
        match async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(5))
            .connect(cfg.nats_url.as_str())
            .await
        {
            Ok(c) => break c,
            Err(e) => {
                // Only a bad URL fails here (connection itself is retried in the background).
                PublishFailed {
                    error: &e.to_string(),
                    buffered: sink.buffered(),
                }
                .emit(&stats);
                tokio::select! {
                    _ = tokio::time::sleep(MAX_BACKOFF) => {}
                    _ = give_up.changed() => return,
                }
            }
        }
    };
    let js = jetstream::new(client);
    let mut stream_ready = false;
    let mut backoff = Duration::from_millis(100);
    loop {
        let stopping = *stop.borrow();
        if *give_up.borrow() || (stopping && sink.buffered() == 0) {
            return;
        }
        if !stream_ready {
            match js
                .create_or_update_stream(stream_config(&cfg.subjects, cfg.stream_max_age))
                .await
            {
                Ok(_) => {
                    StreamReady {
                        stream: &cfg.subjects.stream_name(),
                    }
                    .emit(&stats);
                    stream_ready = true;
                }
                Err(e) => {
                    fail(&stats, &sink, &e.to_string(), &mut backoff, &mut give_up).await;
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
        let mut acks = Vec::with_capacity(window.len());
        let mut error = None;
        for out in &window {
            let msg = PublishMessage::build()
                .payload(out.envelope.to_json().into())
                .message_id(format!("{}-{}", cfg.run_id, out.local_seq));
            match js.send_publish(out.subject.clone(), msg).await {
                Ok(ack) => acks.push(ack),
                Err(e) => {
                    error = Some(e.to_string());
                    break;
                }
            }
        }
        let mut acked = 0;
        for ack in acks {
            match tokio::time::timeout(ACK_TIMEOUT, ack).await {
                Ok(Ok(_)) => acked += 1,
                Ok(Err(e)) => {
                    error.get_or_insert(e.to_string());
                    break;
                }
                Err(_) => {
                    error.get_or_insert("no JetStream acknowledgement in time".into());
                    break;
                }
            }
        }
        sink.ack(acked);
        for _ in 0..acked {
            RecordPublished.emit(&stats);
        }
        if let Some(e) = error {
            // "no responders" means the stream is gone (or JetStream is off): set it up again.
            stream_ready = false;
            fail(&stats, &sink, &e, &mut backoff, &mut give_up).await;
        } else {
            backoff = Duration::from_millis(100);
        }
    }
}

async fn fail(
    stats: &AgentStats,
    sink: &RecordSink,
    error: &str,
    backoff: &mut Duration,
    give_up: &mut watch::Receiver<bool>,
) {
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
