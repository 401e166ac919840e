//! The append-only audit log: one JSON line per evaluation that changed something (the
//! mode, a directive issued or completed, the input's health, a backend failing or
//! recovering, an operator's override, a start or stop), with the figures behind it.
//!
//! Each entry is one `write` on a file opened for appending, then synced. Read back at
//! start for the flips of the last hour and an operator's hold.

use crate::act::directive::{DirectiveOutcome, MigrationDirective, Skipped};
use crate::act::mode::{Mode, OperatorHold, Override};
use crate::decide::policy::{Evaluation, Restored};
use kvscope_kit::clock::fmt_utc;
use serde::{Deserialize, Serialize};
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};

/// What happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum AuditEvent {
    /// The actuator started and asserted its starting mode.
    Started {
        version: String,
        restored_flips: usize,
        backends: Vec<String>,
    },
    /// The policy moved the mode (the evaluation holds the reasons and figures).
    ModeChanged { evaluation: Box<Evaluation> },
    /// The input's health changed (fresh / stale / missing / agent lost) without a mode
    /// change.
    InputChanged { evaluation: Box<Evaluation> },
    /// An operator used the API (or the command line).
    Operator {
        #[serde(rename = "override")]
        ov: Override,
        from: Mode,
        to: Mode,
        note: String,
    },
    /// Applying a mode failed on at least one backend.
    BackendFailed {
        attempted: Mode,
        errors: Vec<String>,
    },
    /// A mode was applied on every backend after a failure.
    BackendRecovered {
        attempted: Mode,
        applied: Vec<String>,
    },
    /// Directives issued in LIVE: sent, or dropped over the rate limit (keys), with the
    /// spills of the same evaluation that got none.
    DirectivesIssued {
        directives: Vec<MigrationDirective>,
        rate_limited: Vec<String>,
        skipped: Skipped,
    },
    /// Outcomes of directives.
    DirectiveOutcomes {
        outcomes: Vec<(String, DirectiveOutcome)>,
    },
    /// The actuator stopped (the entry's mode is what it left).
    Stopped { note: String },
}

/// One line of the audit log. The event's fields sit beside these (flattened), so no
/// event has a field named like one of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    pub at_ns: u64,
    /// `at_ns` in UTC, for people.
    pub at: String,
    /// The mode after the event.
    pub mode: Mode,
    pub hold: Option<OperatorHold>,
    #[serde(flatten)]
    pub event: AuditEvent,
}

impl AuditEntry {
    pub fn new(at_ns: u64, mode: Mode, hold: Option<OperatorHold>, event: AuditEvent) -> Self {
        Self {
            at_ns,
            at: fmt_utc(at_ns),
            mode,
            hold,
            event,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("cannot open the audit log {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write the audit log {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read the audit log {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
}

#[derive(Debug)]
pub(crate) struct AuditLog {
    path: PathBuf,
    file: std::fs::File,
}

impl AuditLog {
    /// Open (create) `path` for appending.
    pub fn open(path: &Path) -> Result<Self, AuditError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| AuditError::Open {
                path: path.into(),
                source,
            })?;
        Ok(Self {
            path: path.into(),
            file,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append one entry as one line.
    pub fn append(&mut self, entry: &AuditEntry) -> Result<(), AuditError> {
        // Serializing these plain types cannot fail.
        let mut line = serde_json::to_vec(entry).unwrap_or_default();
        line.push(b'\n');
        let err = |source| AuditError::Write {
            path: self.path.clone(),
            source,
        };
        self.file.write_all(&line).map_err(err)?;
        self.file.sync_data().map_err(|source| AuditError::Write {
            path: self.path.clone(),
            source,
        })
    }
}

/// The last `limit` entries of the log at `path` (oldest first), reading at most the
/// last `max_bytes` of it. Lines that do not parse are skipped. A missing file is empty.
pub fn tail(path: &Path, limit: usize, max_bytes: u64) -> Result<Vec<AuditEntry>, AuditError> {
    let err = |source| AuditError::Read {
        path: path.into(),
        source,
    };
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(err(e)),
    };
    let len = f.metadata().map_err(err)?.len();
    let start = len.saturating_sub(max_bytes);
    f.seek(SeekFrom::Start(start)).map_err(err)?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).map_err(err)?;
    let text = String::from_utf8_lossy(&buf);
    let mut lines: Vec<&str> = text.lines().collect();
    if start > 0 && !lines.is_empty() {
        lines.remove(0); // probably cut in the middle
    }
    let mut out: Vec<AuditEntry> = lines
        .iter()
        .rev()
        .filter_map(|l| serde_json::from_str(l).ok())
        .take(limit)
        .collect();
    out.reverse();
    Ok(out)
}

/// What a new run takes over from the log: automatic flips within the hour before
/// `now_ns`, and the operator's hold if the last operator action set one.
pub fn restore(entries: &[AuditEntry], now_ns: u64) -> Restored {
    const HOUR: u64 = 3_600_000_000_000;
    let mut r = Restored::default();
    for e in entries {
        match &e.event {
            AuditEvent::ModeChanged { evaluation }
                if evaluation.hold.is_none() && now_ns.saturating_sub(e.at_ns) < HOUR =>
            {
                r.flips_ns.push(e.at_ns);
            }
            // A LIVE that could not be applied was rolled back: a flip too.
            AuditEvent::BackendFailed {
                attempted: Mode::Live,
                ..
            } if now_ns.saturating_sub(e.at_ns) < HOUR => r.flips_ns.push(e.at_ns),
            AuditEvent::Operator { ov, .. } => r.hold = ov.hold(),
            _ => {}
        }
    }
    r
}

/// The mode the log says the router was last put in.
pub(crate) fn last_mode(entries: &[AuditEntry]) -> Option<Mode> {
    entries.last().map(|e| e.mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(at: u64, ov: Override) -> AuditEntry {
        AuditEntry::new(
            at,
            ov.hold().map_or(Mode::Dry, |h| h.mode()),
            ov.hold(),
            AuditEvent::Operator {
                ov,
                from: Mode::Dry,
                to: Mode::Off,
                note: "t".into(),
            },
        )
    }

    #[test]
    fn entries_append_as_lines_and_the_tail_reads_them_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.jsonl");
        {
            let mut log = AuditLog::open(&p).unwrap();
            for i in 0..5 {
                log.append(&op(i, Override::Dry)).unwrap();
            }
        }
        let mut log = AuditLog::open(&p).unwrap();
        log.append(&op(5, Override::Off)).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(text.lines().count(), 6, "reopening appends");
        let t = tail(&p, 3, 1 << 20).unwrap();
        assert_eq!(t.iter().map(|e| e.at_ns).collect::<Vec<_>>(), [3, 4, 5]);
        let first = text.lines().next().unwrap();
        let v: serde_json::Value = serde_json::from_str(first).unwrap();
        assert_eq!(v["event"], "operator");
        assert_eq!(v["override"], "dry");
        // A byte budget that cuts into the file drops the partial first line.
        let small = tail(&p, 100, (text.len() / 2) as u64).unwrap();
        assert!(!small.is_empty() && small.len() < 6);
        assert_eq!(small.last().unwrap().at_ns, 5);
        assert!(tail(&dir.path().join("none"), 5, 100).unwrap().is_empty());
        assert_eq!(restore(&t, 10).hold, Some(OperatorHold::Off));
        assert_eq!(last_mode(&t), Some(Mode::Off));
    }

    #[test]
    fn every_event_reads_back() {
        let events = [
            AuditEvent::Started {
                version: "1".into(),
                restored_flips: 2,
                backends: vec!["file m.env".into()],
            },
            AuditEvent::BackendFailed {
                attempted: Mode::Live,
                errors: vec!["x".into()],
            },
            AuditEvent::BackendRecovered {
                attempted: Mode::Dry,
                applied: vec!["y".into()],
            },
            AuditEvent::DirectivesIssued {
                directives: vec![],
                rate_limited: vec!["kvm-1".into()],
                skipped: Skipped::default(),
            },
            AuditEvent::DirectiveOutcomes {
                outcomes: vec![("kvm-1".into(), DirectiveOutcome::RateLimited)],
            },
            AuditEvent::Stopped { note: "n".into() },
            op(1, Override::Auto).event,
        ];
        for event in events {
            let e = AuditEntry::new(7, Mode::Dry, None, event);
            let line = serde_json::to_string(&e).unwrap();
            let back: AuditEntry =
                serde_json::from_str(&line).unwrap_or_else(|err| panic!("{line}: {err}"));
            assert_eq!(back, e);
        }
    }
}
