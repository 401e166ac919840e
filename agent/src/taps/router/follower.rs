//! Follows the router's log like `tail -F`, or reads stdin.
//!
//! The file is polled: new complete lines are sent as they appear; a file replaced at
//! the same path (rotation: the inode changes) is drained and the new one read from its
//! start; a file that shrinks (truncation) is read again from its start; a missing file
//! is waited for. A line is only sent once its newline is written (a partial last line
//! is held back), except at the end of a rotated file or of stdin. A line longer than
//! the limit is dropped as soon as it passes it, skipped to its end and counted: a
//! file without newlines cannot make the agent hold it whole.
//! Runs on its own thread (blocking file I/O), feeding a channel.

use crate::counters::AgentStats;
use crate::internal_events::{
    InternalEvent, LogFileReopened, LogFileTruncated, LogFileUnavailable, LogLineTooLong,
};
use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

#[derive(Debug, Clone)]
pub enum LogSource {
    File {
        path: PathBuf,
        /// Read the file present at start from its beginning (else from its end).
        from_start: bool,
        poll: Duration,
    },
    Stdin,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogItem {
    Line(String),
    /// The input ended (stdin closed); a followed file never ends.
    End,
}

/// Start following on a new thread. It stops when `stop` is set (checked every poll)
/// or the receiver is dropped. Lines longer than `max_line` bytes are skipped (never
/// held whole) and counted.
pub fn spawn(
    source: LogSource,
    max_line: usize,
    tx: mpsc::Sender<LogItem>,
    stats: Arc<AgentStats>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("router-log".into())
        .spawn(move || match source {
            LogSource::Stdin => read_to_end(std::io::stdin().lock(), max_line, &tx, &stats),
            LogSource::File {
                path,
                from_start,
                poll,
            } => follow(&path, from_start, poll, max_line, &tx, &stats, &stop),
        })
}

fn send_line(tx: &mpsc::Sender<LogItem>, bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(bytes);
    let line = text.trim_end_matches(['\n', '\r']);
    tx.blocking_send(LogItem::Line(line.to_string())).is_ok()
}

/// Lines cut from a byte stream, holding at most `max` bytes of one: a longer line is
/// dropped as soon as it passes the limit and skipped to its newline.
struct Lines {
    max: usize,
    partial: Vec<u8>,
    /// Bytes of the too-long line being skipped.
    skipping: Option<u64>,
}

enum Got {
    /// A complete line (with its newline).
    Line(Vec<u8>),
    /// A line longer than the limit ended; its length.
    TooLong(u64),
    /// Nothing more to read for now.
    Nothing,
}

impl Lines {
    fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            partial: Vec::new(),
            skipping: None,
        }
    }

    /// Read on to the next line end, or until `r` has nothing more; also returns the
    /// bytes consumed.
    fn next(&mut self, r: &mut impl BufRead) -> std::io::Result<(Got, u64)> {
        let mut consumed = 0u64;
        loop {
            let buf = r.fill_buf()?;
            if buf.is_empty() {
                return Ok((Got::Nothing, consumed));
            }
            let (n, found) = match buf.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buf.len(), false),
            };
            match &mut self.skipping {
                Some(skipped) => *skipped += n as u64,
                None if self.partial.len() + n > self.max => {
                    self.skipping = Some((self.partial.len() + n) as u64);
                    self.partial = Vec::new();
                }
                None => self.partial.extend_from_slice(&buf[..n]),
            }
            r.consume(n);
            consumed += n as u64;
            if found {
                let got = match self.skipping.take() {
                    Some(len) => Got::TooLong(len),
                    None => Got::Line(std::mem::take(&mut self.partial)),
                };
                return Ok((got, consumed));
            }
        }
    }

    /// The input ended: what is left of an unterminated last line.
    fn finish(&mut self) -> Got {
        match self.skipping.take() {
            Some(len) => Got::TooLong(len),
            None if !self.partial.is_empty() => Got::Line(std::mem::take(&mut self.partial)),
            None => Got::Nothing,
        }
    }

    /// Forget a partial line (the file was cut under it).
    fn reset(&mut self) {
        self.partial.clear();
        self.skipping = None;
    }
}

/// Send what `got` is; false when the receiver is gone.
fn deliver(got: Got, tx: &mpsc::Sender<LogItem>, stats: &AgentStats, source: &str) -> bool {
    match got {
        Got::Line(bytes) => send_line(tx, &bytes),
        Got::TooLong(bytes) => {
            LogLineTooLong { source, bytes }.emit(stats);
            true
        }
        Got::Nothing => true,
    }
}

fn read_to_end(
    mut r: impl BufRead,
    max_line: usize,
    tx: &mpsc::Sender<LogItem>,
    stats: &AgentStats,
) {
    let mut lines = Lines::new(max_line);
    loop {
        match lines.next(&mut r) {
            Ok((Got::Nothing, _)) | Err(_) => break,
            Ok((got, _)) => {
                if !deliver(got, tx, stats, "stdin") {
                    return;
                }
            }
        }
    }
    if !deliver(lines.finish(), tx, stats, "stdin") {
        return;
    }
    let _ = tx.blocking_send(LogItem::End);
}

struct Open {
    reader: BufReader<File>,
    dev: u64,
    ino: u64,
    pos: u64,
    /// The file's first bytes as last read (up to [`FINGERPRINT`]): a file truncated
    /// and written again past our position (`copytruncate` between two polls) keeps its
    /// inode and may have grown past it, but not its first bytes.
    head: Vec<u8>,
}

const FINGERPRINT: usize = 1024;

impl Open {
    /// The file's first bytes now (up to [`FINGERPRINT`]).
    fn read_head(&self) -> std::io::Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; FINGERPRINT];
        let n = self.reader.get_ref().read_at(&mut buf, 0)?;
        buf.truncate(n);
        Ok(buf)
    }

    /// Whether the file was cut under us: shorter than our position, or its first
    /// bytes are no longer those we read. Keeps the fingerprint up to date.
    fn cut(&mut self, len: u64) -> bool {
        if len < self.pos {
            return true;
        }
        let Ok(now) = self.read_head() else {
            return false;
        };
        let known = self.head.len().min(now.len());
        if now[..known] != self.head[..known] || (now.len() < self.head.len()) {
            return true;
        }
        // Only bytes we have read count: the fingerprint grows with the file up to
        // our position.
        let upto = (self.pos as usize).min(now.len());
        if upto > self.head.len() {
            self.head = now[..upto].to_vec();
        }
        false
    }
}

fn follow(
    path: &std::path::Path,
    from_start: bool,
    poll: Duration,
    max_line: usize,
    tx: &mpsc::Sender<LogItem>,
    stats: &AgentStats,
    stop: &AtomicBool,
) {
    let shown = path.display().to_string();
    let mut open: Option<Open> = None;
    let mut first_attempt = true;
    let mut lines = Lines::new(max_line);
    // After a poll's sleep the file is checked for a cut before anything new is read:
    // read first, and the start of a rewritten file would be taken for the old one's
    // continuation.
    let mut woke = false;
    while !stop.load(Ordering::Relaxed) && !tx.is_closed() {
        let Some(cur) = open.as_mut() else {
            let seek_end = first_attempt && !from_start;
            first_attempt = false;
            match open_at(path, seek_end) {
                Ok(o) => open = Some(o),
                Err(e) => {
                    LogFileUnavailable {
                        path: &shown,
                        error: &e.to_string(),
                    }
                    .emit(stats);
                    std::thread::sleep(poll);
                }
            }
            continue;
        };
        if std::mem::take(&mut woke) {
            if let Ok(len) = cur.reader.get_ref().metadata().map(|m| m.len()) {
                if cur.cut(len) {
                    restart(cur, &mut lines, stats, &shown, len);
                    continue;
                }
            }
        }
        // Read every complete line there is.
        let mut progressed = false;
        loop {
            match lines.next(&mut cur.reader) {
                Ok((got, n)) => {
                    cur.pos += n;
                    progressed |= n > 0;
                    if matches!(got, Got::Nothing) {
                        break;
                    }
                    if !deliver(got, tx, stats, &shown) {
                        return;
                    }
                }
                Err(e) => {
                    LogFileUnavailable {
                        path: &shown,
                        error: &e.to_string(),
                    }
                    .emit(stats);
                    break;
                }
            }
        }
        if progressed {
            continue;
        }
        // At the end: has the file been replaced or cut?
        match std::fs::metadata(path) {
            Ok(m) if m.dev() != cur.dev || m.ino() != cur.ino => {
                // Rotation: the old file is fully read; its unterminated tail is a line.
                if !deliver(lines.finish(), tx, stats, &shown) {
                    return;
                }
                LogFileReopened {
                    path: &shown,
                    reason: "rotated",
                }
                .emit(stats);
                open = None;
                continue;
            }
            Ok(m) if cur.cut(m.len()) => {
                if !restart(cur, &mut lines, stats, &shown, m.len()) {
                    open = None;
                }
                continue;
            }
            // Unchanged, or gone for now (removed before its replacement appears).
            _ => {
                std::thread::sleep(poll);
                woke = true;
            }
        }
    }
}

/// The file was cut under us: read it again from its start (false: it cannot be, and
/// must be opened again).
fn restart(cur: &mut Open, lines: &mut Lines, stats: &AgentStats, shown: &str, len: u64) -> bool {
    LogFileReopened {
        path: shown,
        reason: "truncated",
    }
    .emit(stats);
    LogFileTruncated {
        path: shown,
        position: cur.pos,
        size_now: len,
    }
    .emit(stats);
    cur.head.clear();
    lines.reset();
    if cur.reader.seek(SeekFrom::Start(0)).is_ok() {
        cur.pos = 0;
        true
    } else {
        false
    }
}

fn open_at(path: &std::path::Path, seek_end: bool) -> std::io::Result<Open> {
    let mut file = File::open(path)?;
    let m = file.metadata()?;
    let pos = if seek_end {
        file.seek(SeekFrom::End(0))?
    } else {
        0
    };
    let mut open = Open {
        reader: BufReader::new(file),
        dev: m.dev(),
        ino: m.ino(),
        pos,
        head: Vec::new(),
    };
    // What we skip when starting at the end counts as read.
    open.head = open.read_head()?;
    open.head.truncate((pos as usize).min(FINGERPRINT));
    Ok(open)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn start(
        path: PathBuf,
        from_start: bool,
    ) -> (
        mpsc::Receiver<LogItem>,
        Arc<AtomicBool>,
        std::thread::JoinHandle<()>,
    ) {
        let (tx, rx) = mpsc::channel(1000);
        let stop = Arc::new(AtomicBool::new(false));
        let h = spawn(
            LogSource::File {
                path,
                from_start,
                poll: Duration::from_millis(10),
            },
            64,
            tx,
            Arc::new(AgentStats::default()),
            stop.clone(),
        )
        .unwrap();
        (rx, stop, h)
    }

    fn next(rx: &mut mpsc::Receiver<LogItem>) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match rx.try_recv() {
                Ok(LogItem::Line(l)) => return l,
                Ok(LogItem::End) => panic!("end"),
                Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(e) => panic!("no line: {e}"),
            }
        }
    }

    fn append(path: &std::path::Path, s: &str) {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        f.write_all(s.as_bytes()).unwrap();
    }

    #[test]
    fn follows_appends_partial_lines_rotation_and_truncation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("router.log");
        append(&path, "old line, skipped\n");
        let (mut rx, stop, h) = start(path.clone(), false);
        std::thread::sleep(Duration::from_millis(100));
        append(&path, "one\ntw");
        assert_eq!(next(&mut rx), "one");
        std::thread::sleep(Duration::from_millis(50));
        assert!(rx.try_recv().is_err(), "a partial line is held back");
        append(&path, "o\r\n");
        assert_eq!(next(&mut rx), "two");
        // Rotation: rename away, start a new file.
        append(&path, "last of old, no newline");
        std::thread::sleep(Duration::from_millis(50));
        std::fs::rename(&path, dir.path().join("router.log.1")).unwrap();
        append(&path, "first of new\n");
        assert_eq!(next(&mut rx), "last of old, no newline");
        assert_eq!(next(&mut rx), "first of new");
        // Truncation (copytruncate): cut to zero, then write.
        std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::thread::sleep(Duration::from_millis(50));
        append(&path, "after truncation\n");
        assert_eq!(next(&mut rx), "after truncation");
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap();
    }

    #[test]
    fn a_file_cut_and_written_past_our_position_between_polls_is_read_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("router.log");
        let (tx, mut rx) = mpsc::channel(1000);
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(AgentStats::default());
        // A slow poll, so the cut and the rewrite both land between two looks.
        let h = spawn(
            LogSource::File {
                path: path.clone(),
                from_start: true,
                poll: Duration::from_millis(300),
            },
            1 << 20,
            tx,
            stats.clone(),
            stop.clone(),
        )
        .unwrap();
        append(&path, "2026-12-01T00:00:00Z first line of the old file\n");
        assert_eq!(
            next(&mut rx),
            "2026-12-01T00:00:00Z first line of the old file"
        );
        std::thread::sleep(Duration::from_millis(50));
        // copytruncate: cut to zero, and before the next poll more than was read is
        // written again.
        std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let rewritten: Vec<String> = (0..40)
            .map(|i| format!("2026-12-01T00:00:01Z new line {i}"))
            .collect();
        append(&path, &(rewritten.join("\n") + "\n"));
        for want in &rewritten {
            assert_eq!(&next(&mut rx), want, "nothing of the new file is skipped");
        }
        assert_eq!(stats.snapshot().log_truncations, 1);
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap();
    }

    #[test]
    fn from_start_and_a_file_that_appears_later() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.log");
        append(&path, "a\nb\n");
        let (mut rx, stop, h) = start(path.clone(), true);
        assert_eq!(next(&mut rx), "a");
        assert_eq!(next(&mut rx), "b");
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap();

        let late = dir.path().join("late.log");
        let (mut rx, stop, h) = start(late.clone(), false);
        std::thread::sleep(Duration::from_millis(50));
        append(
            &late,
            "written after start\n\u{1b}[2mbytes\u{1b}[0m \u{fffd}\n",
        );
        assert_eq!(next(&mut rx), "written after start");
        assert_eq!(next(&mut rx), "\u{1b}[2mbytes\u{1b}[0m \u{fffd}");
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap();
    }

    #[test]
    fn a_reader_ends_with_end() {
        let (tx, mut rx) = mpsc::channel(10);
        let stats = AgentStats::default();
        read_to_end(&b"x\ny"[..], 64, &tx, &stats);
        assert_eq!(rx.try_recv().unwrap(), LogItem::Line("x".into()));
        assert_eq!(rx.try_recv().unwrap(), LogItem::Line("y".into()));
        assert_eq!(rx.try_recv().unwrap(), LogItem::End);
    }

    #[test]
    fn a_line_past_the_limit_is_skipped_and_counted_never_held() {
        let (tx, mut rx) = mpsc::channel(10);
        let stats = AgentStats::default();
        let long = "y".repeat(10_000);
        let input = format!("short\n{long}\nafter\n{long}");
        // Read through a small buffer, as a file arrives in pieces.
        let r = std::io::BufReader::with_capacity(7, input.as_bytes());
        read_to_end(r, 100, &tx, &stats);
        assert_eq!(rx.try_recv().unwrap(), LogItem::Line("short".into()));
        assert_eq!(rx.try_recv().unwrap(), LogItem::Line("after".into()));
        assert_eq!(rx.try_recv().unwrap(), LogItem::End);
        assert_eq!(stats.snapshot().log_lines_too_long, 2);
        let mut lines = Lines::new(100);
        let mut r = std::io::BufReader::with_capacity(7, input.as_bytes());
        let mut held = 0;
        while let Ok((got, n)) = lines.next(&mut r) {
            held = held.max(lines.partial.capacity());
            if n == 0 && matches!(got, Got::Nothing) {
                break;
            }
        }
        assert!(held <= 200, "held {held} bytes of a 10,000-byte line");
    }
}
