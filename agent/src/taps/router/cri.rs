//! Kubernetes container log files (the CRI format the kubelet writes under
//! `/var/log/pods/<namespace>_<pod>_<uid>/<container>/N.log`), unwrapped back into the
//! lines the container printed (pure).
//!
//! Each file line is `<RFC 3339 time> <stdout|stderr> <tag> <text>`, the tag `F` for a
//! full line or `P` for a partial one continued by the next line of the same stream (the
//! runtime splits long lines, 16 KiB in containerd). Partials are joined per stream, up
//! to a limit past which the line is dropped and counted, never held whole; what is left
//! of a partial when the input ends (the container stopped mid-line) is a line. A line
//! not in this form is passed through unchanged, so the same reader takes plain and
//! JSON-lines files.

use crate::taps::router::parse::parse_rfc3339_ns;

/// What one input line gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CriOutput {
    /// A whole line of the container's output (or a non-CRI line as it was), with the
    /// CRI time stamp when there was one (UNIX ns).
    Line { text: String, ts_ns: Option<u64> },
    /// A partial line; more is to come.
    Pending,
    /// A joined line grew past the limit: dropped (its total length).
    TooLong(u64),
}

#[derive(Debug, Default)]
struct Partial {
    text: String,
    ts_ns: Option<u64>,
    /// Bytes of a line past the limit being skipped.
    skipped: Option<u64>,
}

/// Joins the partial lines of a CRI log, stdout and stderr apart.
#[derive(Debug)]
pub struct CriJoiner {
    max: usize,
    streams: [Partial; 2],
}

impl CriJoiner {
    pub fn new(max_line_bytes: usize) -> Self {
        Self {
            max: max_line_bytes.max(1),
            streams: Default::default(),
        }
    }

    pub fn push(&mut self, raw: &str) -> CriOutput {
        let Some((ts_ns, stream, full, text)) = split(raw) else {
            return CriOutput::Line {
                text: raw.to_string(),
                ts_ns: None,
            };
        };
        let p = &mut self.streams[stream];
        if p.text.is_empty() && p.skipped.is_none() {
            p.ts_ns = ts_ns;
        }
        match &mut p.skipped {
            Some(n) => *n += text.len() as u64,
            None if p.text.len() + text.len() > self.max => {
                p.skipped = Some((p.text.len() + text.len()) as u64);
                p.text = String::new();
            }
            None => p.text.push_str(text),
        }
        if !full {
            return CriOutput::Pending;
        }
        let done = std::mem::take(p);
        match done.skipped {
            Some(n) => CriOutput::TooLong(n),
            None => CriOutput::Line {
                text: done.text,
                ts_ns: done.ts_ns,
            },
        }
    }
}

impl CriJoiner {
    /// The input ended: the partial lines left, as lines (or too long).
    pub fn finish(&mut self) -> Vec<CriOutput> {
        self.streams
            .iter_mut()
            .map(std::mem::take)
            .filter(|p| !p.text.is_empty() || p.skipped.is_some())
            .map(|p| match p.skipped {
                Some(n) => CriOutput::TooLong(n),
                None => CriOutput::Line {
                    text: p.text,
                    ts_ns: p.ts_ns,
                },
            })
            .collect()
    }
}

/// `(time, stream index, full?, text)` of a CRI line.
fn split(raw: &str) -> Option<(Option<u64>, usize, bool, &str)> {
    let (ts, rest) = raw.split_once(' ')?;
    let ts_ns = parse_rfc3339_ns(ts)?;
    let (stream, rest) = rest.split_once(' ')?;
    let stream = match stream {
        "stdout" => 0,
        "stderr" => 1,
        _ => return None,
    };
    // The tag may grow `:`-separated parts; the first says full or partial.
    let (tag, text) = match rest.split_once(' ') {
        Some((tag, text)) => (tag, text),
        None => (rest, ""),
    };
    let full = match tag.split(':').next() {
        Some("F") => true,
        Some("P") => false,
        _ => return None,
    };
    Some((Some(ts_ns), stream, full, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(text: &str, ts_ns: u64) -> CriOutput {
        CriOutput::Line {
            text: text.into(),
            ts_ns: Some(ts_ns),
        }
    }

    const T0: u64 = 1_796_118_746_707_000_000;

    #[test]
    fn partials_are_joined_per_stream_and_other_lines_pass_through() {
        let mut j = CriJoiner::new(1000);
        assert_eq!(
            j.push("2026-12-01T09:52:26.707000000Z stderr P {\"a\":"),
            CriOutput::Pending
        );
        // stdout interleaves without disturbing the stderr partial.
        assert_eq!(
            j.push("2026-12-01T09:52:26.708000000Z stdout F hello"),
            line("hello", T0 + 1_000_000)
        );
        assert_eq!(
            j.push("2026-12-01T09:52:26.709000000Z stderr P 1,"),
            CriOutput::Pending
        );
        assert_eq!(
            j.push("2026-12-01T09:52:26.710000000Z stderr F \"b\":2}"),
            line("{\"a\":1,\"b\":2}", T0),
            "the line's time is its first part's"
        );
        assert_eq!(
            j.push("2026-12-01T09:52:26Z stdout F"),
            line("", T0 - 707_000_000),
            "an empty line"
        );
        for plain in [
            "2026-12-01T09:52:26.707Z  INFO dynamo: Selected worker x=1",
            "not a cri line",
            "2026-12-01T09:52:26.707Z stdout X text",
        ] {
            assert_eq!(
                j.push(plain),
                CriOutput::Line {
                    text: plain.into(),
                    ts_ns: None
                }
            );
        }
    }

    #[test]
    fn a_joined_line_past_the_limit_is_dropped_and_measured() {
        let mut j = CriJoiner::new(10);
        assert_eq!(
            j.push("2026-12-01T09:52:26Z stdout P 123456"),
            CriOutput::Pending
        );
        assert_eq!(
            j.push("2026-12-01T09:52:26Z stdout P 789012"),
            CriOutput::Pending
        );
        assert_eq!(
            j.push("2026-12-01T09:52:26Z stdout F 345"),
            CriOutput::TooLong(15)
        );
        assert_eq!(
            j.push("2026-12-01T09:52:26Z stdout F ok"),
            line("ok", T0 - 707_000_000)
        );
        assert_eq!(
            j.push("2026-12-01T09:52:26Z stderr P tail"),
            CriOutput::Pending
        );
        assert_eq!(j.finish(), vec![line("tail", T0 - 707_000_000)]);
        assert!(j.finish().is_empty());
    }
}
