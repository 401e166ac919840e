//! Recordings: one [`Envelope`] per line of JSON, in the order the records were applied.
//! `kvscope-collector report --replay FILE` folds a recording into the same figures the
//! live collector computed.

use crate::record::Envelope;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    #[error("cannot open recording {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read recording {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write recording {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Appends envelopes to a recording file.
pub struct RecordingWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl RecordingWriter {
    /// Open `path` for appending, creating it if needed.
    pub fn append(path: &Path) -> Result<Self, RecordingError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| RecordingError::Open {
                path: path.into(),
                source,
            })?;
        Ok(Self {
            path: path.into(),
            out: BufWriter::new(file),
        })
    }

    pub fn write(&mut self, env: &Envelope) -> Result<(), RecordingError> {
        let mut line = env.to_json();
        line.push(b'\n');
        self.out
            .write_all(&line)
            .map_err(|source| RecordingError::Write {
                path: self.path.clone(),
                source,
            })
    }

    pub fn flush(&mut self) -> Result<(), RecordingError> {
        self.out.flush().map_err(|source| RecordingError::Write {
            path: self.path.clone(),
            source,
        })
    }
}

/// What reading a recording found.
#[derive(Debug, Default)]
pub struct Recording {
    pub envelopes: Vec<Envelope>,
    /// Lines that were not valid records, with their line numbers (1-based). A recording
    /// cut off mid-line by a crash ends in one of these.
    pub bad_lines: Vec<(usize, String)>,
}

/// Read a whole recording. Bad lines are collected, never fatal.
pub fn read_recording(path: &Path) -> Result<Recording, RecordingError> {
    let file = File::open(path).map_err(|source| RecordingError::Open {
        path: path.into(),
        source,
    })?;
    let mut rec = Recording::default();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| RecordingError::Read {
            path: path.into(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        match Envelope::from_json(line.as_bytes()) {
            Ok(e) => rec.envelopes.push(e),
            Err(e) => rec.bad_lines.push((i + 1, e.to_string())),
        }
    }
    Ok(rec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{AgentHeartbeat, Record};

    #[test]
    fn a_recording_reads_back_and_reports_a_torn_last_line() {
        let dir = std::env::temp_dir().join(format!("kvscope-rec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.jsonl");
        let _ = std::fs::remove_file(&path);
        let env = Envelope {
            agent: "a".into(),
            observed_ns: 1,
            record: Record::Heartbeat(AgentHeartbeat::default()),
        };
        let mut w = RecordingWriter::append(&path).unwrap();
        w.write(&env).unwrap();
        w.write(&env).unwrap();
        w.flush().unwrap();
        drop(w);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"agent\":")
            .unwrap();
        let rec = read_recording(&path).unwrap();
        assert_eq!(rec.envelopes, vec![env.clone(), env]);
        assert_eq!(rec.bad_lines.len(), 1);
        assert_eq!(rec.bad_lines[0].0, 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
