//! Records larger than one bus message, sent in parts and joined again.
//!
//! NATS refuses a message over the server's `max_payload` (1 MiB by default), and one
//! long prompt makes a record larger than that: a 1M-token prefill's `BlockStored` is
//! ~1.4 MB of JSON (its block and local hashes, packed), a decision ~0.7 MB per million
//! tokens. An agent therefore sends such a record's JSON in consecutive parts, each a
//! message of its own on the record's subject, with two headers: `Nats-Msg-Id` is
//! `<run>-<local seq>:<index>` (unique, so a re-sent part is de-duplicated like a whole
//! record) and [`PART_HEADER`] is `<index>/<count>`. The collector's [`Reassembler`]
//! concatenates them and applies the record once its last part is in: the record is
//! judged exactly as if it had come whole, whatever its kind.
//!
//! One agent run publishes in order and never starts a record before the previous one
//! is acknowledged whole, so a record's parts are consecutive among that run's
//! messages. A part out of that order, a count or a size past the limits, or a run
//! moving on to another record before finishing one, each leave an incomplete record:
//! dropped and counted ([`PartsOutcome::Incomplete`]), never guessed at.

use std::collections::HashMap;

/// The header naming a message's place in its record: `<index>/<count>`, 0-based.
pub const PART_HEADER: &str = "Kvscope-Part";

/// The de-duplication id of a record (`part: None`) or of one of its parts.
pub fn message_id(run: &str, local_seq: u64, part: Option<u32>) -> String {
    match part {
        None => format!("{run}-{local_seq}"),
        Some(i) => format!("{run}-{local_seq}:{i}"),
    }
}

/// `payload` in pieces of at most `max` bytes (at least one piece, at least one byte
/// each).
pub fn split(payload: &[u8], max: usize) -> impl Iterator<Item = &[u8]> {
    let max = max.max(1);
    let n = payload.len().div_ceil(max).max(1);
    (0..n).map(move |i| &payload[(i * max).min(payload.len())..((i + 1) * max).min(payload.len())])
}

/// What a [`Reassembler`] will hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartsLimits {
    /// The largest record, all parts together.
    pub max_record_bytes: usize,
    /// Records being joined at once (one per agent run in flight).
    pub max_open_records: usize,
}

impl Default for PartsLimits {
    fn default() -> Self {
        Self {
            max_record_bytes: 256 * 1024 * 1024,
            max_open_records: 256,
        }
    }
}

/// What became of one message.
#[derive(Debug, PartialEq, Eq)]
pub enum PartsOutcome {
    /// Not a part: the message is a record by itself.
    Whole,
    /// A part; its record is not complete yet.
    Pending,
    /// The last part: the record's whole JSON.
    Complete(Vec<u8>),
    /// Parts that will never make a record (why, and how many messages were lost with
    /// them), besides what this message itself became.
    Incomplete {
        reason: &'static str,
        lost_parts: u64,
        then: Box<PartsOutcome>,
    },
}

#[derive(Debug)]
struct Open {
    record: u64,
    count: u32,
    next: u32,
    bytes: Vec<u8>,
    /// When it was opened, to evict the oldest at the limit.
    opened: u64,
}

/// Joins parts back into records (see the module docs).
#[derive(Debug, Default)]
pub struct Reassembler {
    limits: PartsLimits,
    /// The record being joined, per agent run.
    open: HashMap<String, Open>,
    messages: u64,
}

impl Reassembler {
    pub fn new(limits: PartsLimits) -> Self {
        Self {
            limits,
            ..Default::default()
        }
    }

    /// Bytes held in records not yet complete.
    pub fn held_bytes(&self) -> usize {
        self.open.values().map(|o| o.bytes.len()).sum()
    }

    /// One bus message, with its `Nats-Msg-Id` and [`PART_HEADER`] values if present.
    pub fn accept(
        &mut self,
        message_id: Option<&str>,
        part: Option<&str>,
        payload: &[u8],
    ) -> PartsOutcome {
        self.messages += 1;
        // Which run sent it, and which of its records this is.
        let id = message_id.and_then(|m| {
            let (run, rest) = m.rsplit_once('-')?;
            let seq = rest.split(':').next()?.parse::<u64>().ok()?;
            Some((run, seq))
        });
        let Some(part) = part else {
            // A whole record: a run that had one open moved on without finishing it.
            return match id.and_then(|(run, _)| self.open.remove(run)) {
                Some(o) => incomplete("the sender moved on", o, 0, PartsOutcome::Whole),
                None => PartsOutcome::Whole,
            };
        };
        let parsed = part.split_once('/').and_then(|(i, n)| {
            let (i, n) = (i.trim().parse::<u32>().ok()?, n.trim().parse::<u32>().ok()?);
            (i < n).then_some((i, n))
        });
        let (Some((run, record)), Some((index, count))) = (id, parsed) else {
            return PartsOutcome::Incomplete {
                reason: "a part without a valid id or index",
                lost_parts: 1,
                then: Box::new(PartsOutcome::Pending),
            };
        };
        let mut lost: Option<(&'static str, Open)> = None;
        if let Some(o) = self.open.get(run) {
            let continues = o.record == record && o.count == count && o.next == index;
            let restarts = o.record == record && index == 0;
            if !continues {
                let o = self.open.remove(run).expect("present");
                if !restarts {
                    lost = Some(("a part out of order", o));
                }
                // A record re-sent from its first part (after the de-duplication
                // window) starts over: nothing of it is lost.
            }
        }
        let outcome = self.step(run, record, index, count, payload);
        match lost {
            Some((reason, o)) => incomplete(reason, o, 0, outcome),
            None => outcome,
        }
    }

    fn step(
        &mut self,
        run: &str,
        record: u64,
        index: u32,
        count: u32,
        payload: &[u8],
    ) -> PartsOutcome {
        if !self.open.contains_key(run) {
            if index != 0 {
                return PartsOutcome::Incomplete {
                    reason: "a part whose record's first part was never seen",
                    lost_parts: 1,
                    then: Box::new(PartsOutcome::Pending),
                };
            }
            let mut evicted = None;
            if self.open.len() >= self.limits.max_open_records.max(1) {
                let oldest = self
                    .open
                    .iter()
                    .min_by_key(|(_, o)| o.opened)
                    .map(|(k, _)| k.clone());
                evicted = oldest.and_then(|k| self.open.remove(&k));
            }
            self.open.insert(
                run.to_string(),
                Open {
                    record,
                    count,
                    next: 0,
                    bytes: Vec::new(),
                    opened: self.messages,
                },
            );
            if let Some(o) = evicted {
                let then = self.step(run, record, index, count, payload);
                return incomplete("too many records open at once", o, 0, then);
            }
        }
        let o = self.open.get_mut(run).expect("inserted above");
        if o.bytes.len() + payload.len() > self.limits.max_record_bytes {
            let o = self.open.remove(run).expect("present");
            // This part goes with them.
            return incomplete(
                "the record is larger than allowed",
                o,
                1,
                PartsOutcome::Pending,
            );
        }
        o.bytes.extend_from_slice(payload);
        o.next += 1;
        if o.next == o.count {
            let o = self.open.remove(run).expect("present");
            PartsOutcome::Complete(o.bytes)
        } else {
            PartsOutcome::Pending
        }
    }
}

/// `o` will never complete: its parts are lost (and `extra` more messages with them).
fn incomplete(reason: &'static str, o: Open, extra: u64, then: PartsOutcome) -> PartsOutcome {
    PartsOutcome::Incomplete {
        reason,
        lost_parts: u64::from(o.next) + extra,
        then: Box::new(then),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(run: &str, seq: u64, payload: &[u8], max: usize) -> Vec<(String, String, Vec<u8>)> {
        let pieces: Vec<&[u8]> = split(payload, max).collect();
        let n = pieces.len();
        pieces
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                (
                    message_id(run, seq, Some(i as u32)),
                    format!("{i}/{n}"),
                    p.to_vec(),
                )
            })
            .collect()
    }

    #[test]
    fn split_covers_the_payload_in_pieces_of_at_most_max() {
        let p: Vec<u8> = (0..=255).collect();
        for max in [1, 7, 100, 256, 1000] {
            let pieces: Vec<&[u8]> = split(&p, max).collect();
            assert!(pieces.iter().all(|x| x.len() <= max && !x.is_empty()));
            assert_eq!(pieces.concat(), p);
        }
        assert_eq!(split(b"", 10).count(), 1, "an empty payload is one piece");
    }

    #[test]
    fn interleaved_runs_are_joined_each_in_its_order() {
        let a: Vec<u8> = (0..100u8).collect();
        let b: Vec<u8> = (100..=255u8).collect();
        let (pa, pb) = (parts("node-1-5", 3, &a, 30), parts("node-2-9", 0, &b, 40));
        let mut r = Reassembler::default();
        let mut done = Vec::new();
        for i in 0..pa.len().max(pb.len()) {
            for p in [pa.get(i), pb.get(i)].into_iter().flatten() {
                match r.accept(Some(&p.0), Some(&p.1), &p.2) {
                    PartsOutcome::Complete(bytes) => done.push(bytes),
                    PartsOutcome::Pending => {}
                    other => panic!("{other:?}"),
                }
            }
            // Other records of other runs pass through meanwhile.
            assert_eq!(
                r.accept(Some("node-3-1-7"), None, b"{}"),
                PartsOutcome::Whole
            );
        }
        assert_eq!(done, vec![a, b]);
        assert_eq!(r.held_bytes(), 0);
    }

    #[test]
    fn a_record_left_unfinished_is_counted_never_guessed() {
        let p = parts("n-1", 4, &[1u8; 100], 30);
        let mut r = Reassembler::default();
        assert_eq!(
            r.accept(Some(&p[0].0), Some(&p[0].1), &p[0].2),
            PartsOutcome::Pending
        );
        assert_eq!(
            r.accept(Some(&p[1].0), Some(&p[1].1), &p[1].2),
            PartsOutcome::Pending
        );
        // The run's next record arrives whole: the first is lost, with its two parts.
        assert_eq!(
            r.accept(Some("n-1-5"), None, b"{}"),
            PartsOutcome::Incomplete {
                reason: "the sender moved on",
                lost_parts: 2,
                then: Box::new(PartsOutcome::Whole)
            }
        );
        // A part without its first part.
        assert!(matches!(
            r.accept(Some(&p[2].0), Some(&p[2].1), &p[2].2),
            PartsOutcome::Incomplete { lost_parts: 1, .. }
        ));
        // A part skipped: the record is dropped when the next one is not it.
        assert_eq!(
            r.accept(Some(&p[0].0), Some(&p[0].1), &p[0].2),
            PartsOutcome::Pending
        );
        assert!(matches!(
            r.accept(Some(&p[2].0), Some(&p[2].1), &p[2].2),
            PartsOutcome::Incomplete {
                reason: "a part out of order",
                lost_parts: 1,
                ..
            }
        ));
        // Garbage headers.
        for (id, part) in [("n-1-4:0", "x"), ("n-1-4:0", "3/3"), ("nodash", "0/2")] {
            assert!(matches!(
                r.accept(Some(id), Some(part), b"x"),
                PartsOutcome::Incomplete { .. }
            ));
        }
    }

    #[test]
    fn a_record_resent_from_its_start_starts_over() {
        let payload: Vec<u8> = (0..90u8).collect();
        let p = parts("n-1", 4, &payload, 30);
        let mut r = Reassembler::default();
        r.accept(Some(&p[0].0), Some(&p[0].1), &p[0].2);
        r.accept(Some(&p[1].0), Some(&p[1].1), &p[1].2);
        let mut last = PartsOutcome::Pending;
        for q in &p {
            last = r.accept(Some(&q.0), Some(&q.1), &q.2);
        }
        assert_eq!(last, PartsOutcome::Complete(payload));
    }

    #[test]
    fn limits_bound_what_is_held() {
        let mut r = Reassembler::new(PartsLimits {
            max_record_bytes: 50,
            max_open_records: 2,
        });
        let big = parts("n-1", 0, &[0u8; 100], 30);
        r.accept(Some(&big[0].0), Some(&big[0].1), &big[0].2);
        assert!(matches!(
            r.accept(Some(&big[1].0), Some(&big[1].1), &big[1].2),
            PartsOutcome::Incomplete {
                reason: "the record is larger than allowed",
                lost_parts: 2,
                ..
            }
        ));
        assert_eq!(r.held_bytes(), 0);
        // A third run opening a record evicts the oldest open one.
        for run in ["a-1", "b-1"] {
            let p = parts(run, 0, &[0u8; 20], 10);
            assert_eq!(
                r.accept(Some(&p[0].0), Some(&p[0].1), &p[0].2),
                PartsOutcome::Pending
            );
        }
        let p = parts("c-1", 0, &[0u8; 20], 10);
        assert_eq!(
            r.accept(Some(&p[0].0), Some(&p[0].1), &p[0].2),
            PartsOutcome::Incomplete {
                reason: "too many records open at once",
                lost_parts: 1,
                then: Box::new(PartsOutcome::Pending)
            }
        );
    }
}
