//! Several records in one bus message.
//!
//! JetStream's cost is per message (a publish, its acknowledgement, a delivery, the
//! consumer's acknowledgement): at 100k KV blocks/s an agent sends ~1,700 records a
//! second, and NATS spent more CPU on them than the agent and the collector together.
//! The agent's records leave in bursts (every log poll releases the records that waited
//! for it), so it sends the records of a burst that share a subject's scope — the agent
//! and, when known, the model (`kvscope.<cluster>.<agent>[.m.<model>]`) — as one
//! message, on the scope's [`BUNDLE_KIND`] subject. Its payload is one line per record:
//!
//! ```text
//! <the record's own subject> <its envelope's JSON>\n
//! ```
//!
//! A message whose payload starts with `{` is one envelope on its own subject, as every
//! message was before bundles (and as a burst of one record still goes). So a consumer
//! reads each line as if it were a message of its own: the subject's checks (the agent
//! it names, a model's copies) apply to the line's subject, and a line's subject must lie
//! in the bundle's scope (a server's permissions bind the bundle's subject only).
//!
//! A bundle larger than the server's `max_payload` goes in parts like any record
//! (`crate::parts`): bundles are cut at [`MAX_BUNDLE_BYTES`], so that is rare.

use thiserror::Error;

/// The last token of a bundle's subject (after its scope).
pub(crate) const BUNDLE_KIND: &str = "records";
/// A bundle's payload never grows past this (a record that would take it past goes in
/// the next message; one larger by itself goes alone).
pub const MAX_BUNDLE_BYTES: usize = 256 * 1024;
/// ... nor holds more records than this.
pub const MAX_BUNDLE_RECORDS: usize = 256;

/// A line of a bundle that is not `<subject> <JSON>`.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BundleError {
    #[error("bundle line {line}: no subject before the record (expected `<subject> <json>`)")]
    NoSubject { line: usize },
    #[error("bundle line {line}: the subject is not UTF-8")]
    SubjectNotUtf8 { line: usize },
}

/// One record of a message: the subject it travels under and its envelope's JSON.
#[derive(Debug, PartialEq, Eq)]
pub struct Entry<'a> {
    pub subject: &'a str,
    pub json: &'a [u8],
    /// Its place in the message (0 for a message of one record).
    pub index: usize,
}

/// Whether a message's payload is a bundle (not one envelope).
pub fn is_bundle(payload: &[u8]) -> bool {
    payload.first().is_some_and(|&b| b != b'{')
}

/// The records of the message `payload` received on `subject`: itself, or each line of
/// a bundle (an empty line is skipped; a line without a subject is an error, and the
/// lines after it are still read).
pub fn entries<'a>(
    subject: &'a str,
    payload: &'a [u8],
) -> impl Iterator<Item = Result<Entry<'a>, BundleError>> + 'a {
    let (single, lines) = if is_bundle(payload) {
        (None, Some(payload.split(|&b| b == b'\n')))
    } else {
        (
            Some(Ok(Entry {
                subject,
                json: payload,
                index: 0,
            })),
            None,
        )
    };
    single.into_iter().chain(
        lines
            .into_iter()
            .flatten()
            .enumerate()
            .filter(|(_, line)| !line.is_empty())
            .map(|(index, line)| {
                let space = line
                    .iter()
                    .position(|&b| b == b' ')
                    .ok_or(BundleError::NoSubject { line: index + 1 })?;
                let subject = std::str::from_utf8(&line[..space])
                    .map_err(|_| BundleError::SubjectNotUtf8 { line: index + 1 })?;
                if subject.is_empty() {
                    return Err(BundleError::NoSubject { line: index + 1 });
                }
                Ok(Entry {
                    subject,
                    json: &line[space + 1..],
                    index,
                })
            }),
    )
}

/// A bundle being written: [`Self::push`] each record, then [`Self::finish`].
#[derive(Debug, Default)]
pub struct BundleWriter {
    payload: Vec<u8>,
}

impl BundleWriter {
    /// Add a record (its subject and its envelope's JSON, which holds no newline:
    /// `serde_json` escapes them in strings).
    pub fn push(&mut self, subject: &str, json: &[u8]) {
        self.payload.reserve(Self::line_bytes(subject, json));
        self.payload.extend_from_slice(subject.as_bytes());
        self.payload.push(b' ');
        self.payload.extend_from_slice(json);
        self.payload.push(b'\n');
    }

    /// What [`Self::push`] adds for a record.
    pub fn line_bytes(subject: &str, json: &[u8]) -> usize {
        subject.len() + json.len() + 2
    }

    pub fn bytes(&self) -> usize {
        self.payload.len()
    }

    pub fn finish(self) -> Vec<u8> {
        self.payload
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AgentHeartbeat, Envelope, Record};

    fn env(n: u64) -> Envelope {
        Envelope {
            agent: "node-1".into(),
            observed_ns: n,
            record: Record::Heartbeat(AgentHeartbeat::default()),
        }
    }

    #[test]
    fn a_single_envelope_is_one_entry_on_its_own_subject() {
        let json = env(1).to_json();
        let all: Vec<_> = entries("kvscope.c.node-1.heartbeat", &json).collect();
        assert_eq!(
            all,
            vec![Ok(Entry {
                subject: "kvscope.c.node-1.heartbeat",
                json: &json,
                index: 0
            })]
        );
    }

    #[test]
    fn a_bundle_gives_back_each_record_with_its_subject() {
        let mut w = BundleWriter::default();
        let (a, b) = (env(1), env(2));
        w.push("kvscope.c.node-1.heartbeat", &a.to_json());
        w.push("kvscope.c.node-1.kv.7", &b.to_json());
        let payload = w.finish();
        assert!(is_bundle(&payload));
        assert_eq!(entries("kvscope.c.node-1.records", &payload).count(), 2);
        let got: Vec<(String, Envelope, usize)> = entries("kvscope.c.node-1.records", &payload)
            .map(|e| {
                let e = e.unwrap();
                (
                    e.subject.to_string(),
                    Envelope::from_json(e.json).unwrap(),
                    e.index,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("kvscope.c.node-1.heartbeat".into(), a, 0),
                ("kvscope.c.node-1.kv.7".into(), b, 1)
            ]
        );
    }

    #[test]
    fn a_bad_line_is_an_error_and_the_next_lines_are_still_read() {
        let json = env(3).to_json();
        let mut payload = b"kvscope.c.n.heartbeat\n\xff\xfe x\n".to_vec();
        payload.extend_from_slice(b"kvscope.c.n.heartbeat ");
        payload.extend_from_slice(&json);
        payload.extend_from_slice(b"\n\n");
        let got: Vec<_> = entries("kvscope.c.n.records", &payload).collect();
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[0], Err(BundleError::NoSubject { line: 1 }));
        assert_eq!(got[1], Err(BundleError::SubjectNotUtf8 { line: 2 }));
        assert_eq!(
            Envelope::from_json(got[2].as_ref().unwrap().json).unwrap(),
            env(3)
        );
    }

    #[test]
    fn a_record_s_json_never_holds_a_newline() {
        let mut e = env(4);
        e.agent = "a\nb".into();
        let json = e.to_json();
        assert!(!json.contains(&b'\n'));
        let mut w = BundleWriter::default();
        w.push("kvscope.c.n.heartbeat", &json);
        w.push("kvscope.c.n.heartbeat", &json);
        let payload = w.finish();
        let n = entries("s", &payload)
            .map(|e| Envelope::from_json(e.unwrap().json).unwrap())
            .filter(|got| *got == e)
            .count();
        assert_eq!(n, 2);
    }
}
