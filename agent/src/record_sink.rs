//! Where every record the taps produce goes: stamped into an [`Envelope`] (agent id and
//! observation time, never decreasing, so the stream's order and its times agree),
//! appended to the optional recording, and queued in the bounded buffer the publisher
//! drains to NATS. When the buffer is full the new record is dropped and counted; the
//! recording still gets it, so a local recording holds everything the agent observed.

use crate::counters::AgentStats;
use crate::internal_events::{InternalEvent, PublishDropped, RecordingWriteFailed};
use kvscope_wire::recording::RecordingWriter;
use kvscope_wire::{Envelope, Record, Subjects};
use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::Notify;

/// A record ready to publish.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// Position in this agent run's output, for JetStream's de-duplication id.
    pub local_seq: u64,
    pub subject: String,
    pub envelope: Envelope,
}

struct Inner {
    buffer: VecDeque<Outgoing>,
    last_ns: u64,
    next_seq: u64,
    recording: Option<RecordingWriter>,
}

pub struct RecordSink {
    agent: String,
    subjects: Subjects,
    capacity: usize,
    stats: Arc<AgentStats>,
    inner: Mutex<Inner>,
    ready: Notify,
}

pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl RecordSink {
    pub fn new(
        agent: &str,
        subjects: Subjects,
        capacity: usize,
        recording: Option<&Path>,
        stats: Arc<AgentStats>,
    ) -> anyhow::Result<Self> {
        let recording = recording.map(RecordingWriter::append).transpose()?;
        Ok(Self {
            agent: agent.to_string(),
            subjects,
            capacity: capacity.max(1),
            stats,
            inner: Mutex::new(Inner {
                buffer: VecDeque::new(),
                last_ns: 0,
                next_seq: 0,
                recording,
            }),
            ready: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stamp, record and queue one record (or drop it when the buffer is full).
    pub fn submit(&self, record: Record) {
        self.submit_at(record, now_ns());
    }

    /// [`Self::submit`] with an explicit clock reading (tests).
    pub fn submit_at(&self, record: Record, now_ns: u64) {
        let subject = self.subjects.for_record(&self.agent, &record);
        let mut inner = self.lock();
        inner.last_ns = inner.last_ns.max(now_ns);
        let envelope = Envelope {
            agent: self.agent.clone(),
            observed_ns: inner.last_ns,
            record,
        };
        if let Some(w) = inner.recording.as_mut() {
            if let Err(e) = w.write(&envelope) {
                RecordingWriteFailed {
                    error: &e.to_string(),
                }
                .emit(&self.stats);
            }
        }
        if inner.buffer.len() >= self.capacity {
            drop(inner);
            PublishDropped {
                capacity: self.capacity,
                subject: &subject,
            }
            .emit(&self.stats);
            return;
        }
        let local_seq = inner.next_seq;
        inner.next_seq += 1;
        inner.buffer.push_back(Outgoing {
            local_seq,
            subject,
            envelope,
        });
        drop(inner);
        self.ready.notify_one();
    }

    /// Up to `n` records from the front of the buffer (they stay until [`Self::ack`]).
    pub fn peek(&self, n: usize) -> Vec<Outgoing> {
        self.lock().buffer.iter().take(n).cloned().collect()
    }

    /// Remove the first `n` records: JetStream acknowledged them.
    pub fn ack(&self, n: usize) {
        let mut inner = self.lock();
        let n = n.min(inner.buffer.len());
        inner.buffer.drain(..n);
    }

    pub fn buffered(&self) -> usize {
        self.lock().buffer.len()
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

    #[test]
    fn stamps_never_go_back_and_a_full_buffer_drops_new_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rec.jsonl");
        let stats = Arc::new(AgentStats::default());
        let sink =
            RecordSink::new("node 1", Subjects::new("c"), 2, Some(&path), stats.clone()).unwrap();
        sink.submit_at(hb(), 10);
        sink.submit_at(hb(), 5);
        sink.submit_at(hb(), 20);
        assert_eq!(stats.snapshot().publish_dropped, 1);
        let out = sink.peek(10);
        assert_eq!(
            out.iter()
                .map(|o| o.envelope.observed_ns)
                .collect::<Vec<_>>(),
            vec![10, 10]
        );
        assert_eq!(
            out.iter().map(|o| o.local_seq).collect::<Vec<_>>(),
            vec![0, 1]
        );
        assert_eq!(out[0].subject, "kvscope.c.agent.node_1");
        sink.ack(1);
        assert_eq!(sink.buffered(), 1);
        sink.submit_at(hb(), 30);
        assert_eq!(
            sink.peek(10)
                .iter()
                .map(|o| o.local_seq)
                .collect::<Vec<_>>(),
            vec![1, 2]
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
}
