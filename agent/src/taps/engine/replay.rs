//! The replay socket of an engine's KV event publisher: what a tap asks for the batches
//! it missed (a sequence gap, or the start of a publisher it saw late).
//!
//! vLLM's `ZmqEventPublisher` (and Dynamo's mocker, `--zmq-replay-ports`) keeps its last
//! batches (10,000 by default) behind a ROUTER socket. A DEALER sends `[b"", start_seq
//! (u64 BE)]`; the publisher answers with one message per buffered batch numbered from
//! `start_seq` on, `[b"", (topic,) seq (u64 BE), payload]` — the live socket's frames
//! after an empty delimiter (older vLLM and SGLang omit the topic) — and ends with the
//! marker `seq = u64::MAX`, empty payload. A start older than the buffer gets the whole
//! buffer, so the caller checks what it got; a start past the newest gets the marker
//! alone. Everything goes through [`crate::taps::engine::zmtp`], within the tap's limits, and the
//! whole answer within a deadline, a batch count and a byte budget: an answer past
//! either — or one that stops without its end marker, which a ROUTER past its
//! high-water mark drops — is cut there, and what came before it is used (the tap asks
//! again for the rest), never thrown away whole.

use crate::taps::engine::zmtp::{Connection, Limits, SocketType, ZmtpError};
use std::time::Duration;

/// Batches one answer may hold: vLLM's default buffer, and some.
pub(crate) const MAX_REPLAYED: usize = 16_384;
/// Payload bytes one answer may hold (the batches are decoded once the answer is in):
/// vLLM's default buffer of 10,000 batches of a few KB each fits many times over, and
/// an answer of huge batches cannot make the agent hold gigabytes.
pub(crate) const MAX_REPLAY_BYTES: usize = 64 << 20;
/// How long one replay may take, connection included.
pub(crate) const REPLAY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an answer may pause before it is taken as ended (its end marker lost).
pub(crate) const REPLAY_IDLE: Duration = Duration::from_secs(1);
const END_MARKER: u64 = u64::MAX;

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Zmtp(#[from] ZmtpError),
    #[error("no complete answer within {0:?}")]
    Timeout(Duration),
    #[error("a replayed message of {0} frames (expected at least 2)")]
    Shape(usize),
    #[error("a replayed sequence frame of {0} bytes (expected 8)")]
    SeqLength(usize),
}

/// An answer: the batches it held, and whether it was cut at the batch count or the
/// byte budget (the batches after the last one kept were not read).
#[derive(Debug, Default)]
pub struct Answer {
    pub batches: Vec<Replayed>,
    pub cut: bool,
}

/// One replayed batch: its number and payload.
pub type Replayed = (u64, bytes::Bytes);

/// Ask `endpoint` for every batch from `from_seq` on.
pub async fn fetch(endpoint: &str, from_seq: u64, limits: Limits) -> Result<Answer, ReplayError> {
    let deadline = tokio::time::Instant::now() + REPLAY_TIMEOUT;
    let mut conn = tokio::time::timeout_at(
        deadline,
        Connection::connect(endpoint, SocketType::Dealer, limits, REPLAY_TIMEOUT),
    )
    .await
    .map_err(|_| ReplayError::Timeout(REPLAY_TIMEOUT))??;
    tokio::time::timeout_at(deadline, conn.send(&[b"", &from_seq.to_be_bytes()]))
        .await
        .map_err(|_| ReplayError::Timeout(REPLAY_TIMEOUT))??;
    let mut out = Answer::default();
    let mut bytes = 0usize;
    loop {
        // A ROUTER past its high-water mark drops what it cannot queue, the end marker
        // included (vLLM before 0.33 keeps libzmq's 1,000): an answer that stops is
        // taken as far as it came, and the rest asked for again.
        let wait = deadline.min(tokio::time::Instant::now() + REPLAY_IDLE);
        let frames = match tokio::time::timeout_at(wait, conn.recv()).await {
            Ok(frames) => frames?,
            Err(_) if !out.batches.is_empty() => {
                out.cut = true;
                return Ok(out);
            }
            Err(_) => return Err(ReplayError::Timeout(REPLAY_TIMEOUT)),
        };
        let (seq, payload) = split(&frames)?;
        if seq == END_MARKER {
            return Ok(out);
        }
        bytes = bytes.saturating_add(payload.len());
        if out.batches.len() >= MAX_REPLAYED || bytes > MAX_REPLAY_BYTES {
            // Cut here: the connection is dropped with the rest of the answer unread.
            out.cut = true;
            return Ok(out);
        }
        out.batches.push((seq, payload));
    }
}

/// The last two frames of a replayed message: its number and payload.
pub fn split(frames: &[bytes::Bytes]) -> Result<Replayed, ReplayError> {
    let [.., seq, payload] = frames else {
        return Err(ReplayError::Shape(frames.len()));
    };
    let seq: [u8; 8] = seq[..]
        .try_into()
        .map_err(|_| ReplayError::SeqLength(seq.len()))?;
    Ok((u64::from_be_bytes(seq), payload.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn replayed_messages_with_or_without_a_topic() {
        let b = |x: &[u8]| Bytes::copy_from_slice(x);
        let with_topic = [b(b""), b(b""), b(&5u64.to_be_bytes()), b(b"p")];
        assert_eq!(split(&with_topic).unwrap(), (5, b(b"p")));
        let without = [b(b""), b(&6u64.to_be_bytes()), b(b"q")];
        assert_eq!(split(&without).unwrap(), (6, b(b"q")));
        let end = [b(b""), b(b""), b(&u64::MAX.to_be_bytes()), b(b"")];
        assert_eq!(split(&end).unwrap().0, END_MARKER);
        assert!(matches!(split(&[b(b"")]), Err(ReplayError::Shape(1))));
        assert!(matches!(
            split(&[b(b""), b(b"x"), b(b"p")]),
            Err(ReplayError::SeqLength(1))
        ));
    }
}
