//! Follows the router's log like `tail -F`, or reads stdin.
//!
//! The file is polled: new complete lines are sent as they appear; a file replaced at
//! the same path (rotation: the inode changes) is drained and the new one read from its
//! start, unless it is the very file it replaced (a link pointed away and back: it goes
//! on where it was); a file that shrinks (truncation) is read again from its start; a
//! missing file is waited for. Only a regular file is followed: a character device
//! (`/dev/zero` never ends), a FIFO (its open and reads block) or a directory is refused
//! as unavailable, and waited out like a missing file. One round reads at most
//! [`MAX_ROUND_BYTES`] before it looks whether the path still names the same file.
//! Whatever cannot be read is told to [`SourceStates`] (readiness). A line is only sent once its newline is written (a partial last line
//! is held back), except at the end of a rotated file or of stdin. A line longer than
//! the limit is dropped as soon as it passes it, skipped to its end and counted: a
//! file without newlines cannot make the agent hold it whole.
//! Runs on its own thread (blocking file I/O), feeding a channel.

use crate::counters::AgentStats;
use crate::internal_events::{
    InternalEvent, LogFileReopened, LogFileTruncated, LogFileUnavailable, LogLineTooLong,
};
use crate::watchdog::SourceStates;
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

/// The bytes of lines sent to the tap and not yet taken by it. The channel between the
/// follower's thread and its tap counts lines (10,000), and 10,000 lines of a megabyte
/// would be ten gigabytes: the follower waits while the tap has [`LINE_BUDGET_BYTES`]
/// to take (a single line always goes, however long).
#[derive(Debug)]
pub struct LineBudget {
    used: std::sync::Mutex<usize>,
    freed: std::sync::Condvar,
    max: usize,
}

/// The bytes of lines that may wait for the tap.
pub(crate) const LINE_BUDGET_BYTES: usize = 8 << 20;

impl LineBudget {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            used: std::sync::Mutex::new(0),
            freed: std::sync::Condvar::new(),
            max,
        })
    }

    /// Wait until `n` more bytes fit (or nothing waits), unless `gone` says the tap
    /// is gone; whether they were taken.
    fn take(&self, n: usize, gone: impl Fn() -> bool) -> bool {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        while *used > 0 && used.saturating_add(n) > self.max {
            if gone() {
                return false;
            }
            used = self
                .freed
                .wait_timeout(used, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *used += n;
        true
    }

    /// The tap took a line of `n` bytes.
    pub fn give(&self, n: usize) {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        *used = used.saturating_sub(n);
        self.freed.notify_all();
    }
}

/// The most one round reads before looking whether the path still names the file
/// (a log written faster than it is read must not keep the follower from seeing it
/// replaced).
pub(crate) const MAX_ROUND_BYTES: u64 = 8 << 20;

/// Start following on a new thread. It stops when `stop` is set (checked every poll)
/// or the receiver is dropped. Lines longer than `max_line` bytes are skipped (never
/// held whole) and counted; a file that cannot be read is told to `states`; the lines
/// waiting for the tap are held to `budget` (the tap gives each back as it takes it).
pub fn spawn(
    source: LogSource,
    max_line: usize,
    tx: mpsc::Sender<LogItem>,
    budget: Arc<LineBudget>,
    stats: Arc<AgentStats>,
    states: Arc<SourceStates>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let tx = Lines2Tap { tx, budget };
    std::thread::Builder::new()
        .name("router-log".into())
        .spawn(move || match source {
            LogSource::Stdin => read_to_end(std::io::stdin().lock(), max_line, &tx, &stats),
            LogSource::File {
                path,
                from_start,
                poll,
            } => {
                let shown = path.display().to_string();
                follow(
                    &path, from_start, poll, max_line, &tx, &stats, &states, &stop,
                );
                // No longer followed: nothing to wait for.
                states.available(&shown);
            }
        })
}

/// Where the lines go: the channel to the tap, and the bytes it may hold.
struct Lines2Tap {
    tx: mpsc::Sender<LogItem>,
    budget: Arc<LineBudget>,
}

impl Lines2Tap {
    fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    fn blocking_send(&self, item: LogItem) -> Result<(), ()> {
        if let LogItem::Line(l) = &item {
            if !self.budget.take(l.len(), || self.tx.is_closed()) {
                return Err(());
            }
        }
        self.tx.blocking_send(item).map_err(|_| ())
    }
}

fn send_line(tx: &Lines2Tap, bytes: &[u8]) -> bool {
    let text = decode_line(bytes);
    let line = text.trim_end_matches(['\n', '\r']);
    tx.blocking_send(LogItem::Line(line.to_string())).is_ok()
}

/// A line's text: as it is when it is UTF-8 (the router, in Rust, writes nothing else),
/// else each byte that is not written as `\xNN`. Replacing them with U+FFFD, as a lossy
/// decoding does, would make two request ids that differ only there one id, and join
/// one request's routing input with another's selection.
fn decode_line(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    use std::fmt::Write as _;
    if let Ok(text) = std::str::from_utf8(bytes) {
        return text.into();
    }
    let mut out = String::with_capacity(bytes.len() + 16);
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out.into()
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
fn deliver(got: Got, tx: &Lines2Tap, stats: &AgentStats, source: &str) -> bool {
    match got {
        Got::Line(bytes) => send_line(tx, &bytes),
        Got::TooLong(bytes) => {
            LogLineTooLong { source, bytes }.emit(stats);
            true
        }
        Got::Nothing => true,
    }
}

fn read_to_end(mut r: impl BufRead, max_line: usize, tx: &Lines2Tap, stats: &AgentStats) {
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

#[allow(clippy::too_many_arguments)]
fn follow(
    path: &std::path::Path,
    from_start: bool,
    poll: Duration,
    max_line: usize,
    tx: &Lines2Tap,
    stats: &AgentStats,
    states: &SourceStates,
    stop: &AtomicBool,
) {
    let shown = path.display().to_string();
    let mut open: Option<Open> = None;
    // The file last followed before the path named another: if the path names it again
    // (a link pointed away and back), it goes on where it was, not from its start.
    let mut left: Option<Open> = None;
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
                Ok(o) => {
                    states.available(&shown);
                    open = Some(match left.take() {
                        Some(l) if (l.dev, l.ino) == (o.dev, o.ino) => l,
                        _ => o,
                    });
                    // The held file is checked for a cut before it is read on.
                    woke = true;
                }
                Err(e) => {
                    let error = e.to_string();
                    LogFileUnavailable {
                        path: &shown,
                        error: &error,
                    }
                    .emit(stats);
                    states.unavailable(&shown, &error);
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
        // Read every complete line there is, up to a round's worth.
        let mut progressed = false;
        let mut round = 0u64;
        loop {
            match lines.next(&mut cur.reader) {
                Ok((got, n)) => {
                    cur.pos += n;
                    round += n;
                    progressed |= n > 0;
                    if matches!(got, Got::Nothing) {
                        break;
                    }
                    if !deliver(got, tx, stats, &shown) {
                        return;
                    }
                    if round >= MAX_ROUND_BYTES {
                        break;
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
        let full_round = round >= MAX_ROUND_BYTES;
        if progressed && !full_round {
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
                left = open.take();
                continue;
            }
            Ok(m) if cur.cut(m.len()) => {
                if !restart(cur, &mut lines, stats, &shown, m.len()) {
                    open = None;
                }
                continue;
            }
            // More to read after a full round: on at once.
            _ if full_round => {}
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
    // A regular file only (a device never ends, a FIFO blocks), opened without blocking.
    let (mut file, m) = kvscope_kit::files::open_regular(path)?;
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

    #[test]
    fn bytes_that_are_not_utf8_stay_apart() {
        assert_eq!(decode_line(b"plain \xe2\x9c\x93"), "plain \u{2713}");
        let a = decode_line(b"request_id=ab\xff");
        let b = decode_line(b"request_id=ab\xfe");
        assert_eq!(a, "request_id=ab\\xff");
        assert_ne!(a, b);
        assert_eq!(decode_line(b"\xe2\x9c"), "\\xe2\\x9c");
    }

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
            LineBudget::new(usize::MAX),
            Arc::new(AgentStats::default()),
            SourceStates::new(),
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
            LineBudget::new(usize::MAX),
            stats.clone(),
            SourceStates::new(),
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
    fn a_link_pointed_at_a_device_for_a_moment_is_waited_out_and_the_log_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("frontend.log");
        let link = dir.path().join("router.log");
        append(&real, "before\n");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let (tx, mut rx) = mpsc::channel(1000);
        let stop = Arc::new(AtomicBool::new(false));
        let states = SourceStates::new();
        let stats = Arc::new(AgentStats::default());
        let h = spawn(
            LogSource::File {
                path: link.clone(),
                from_start: true,
                poll: Duration::from_millis(10),
            },
            1 << 20,
            tx,
            LineBudget::new(usize::MAX),
            stats.clone(),
            states.clone(),
            stop.clone(),
        )
        .unwrap();
        assert_eq!(next(&mut rx), "before");
        // Re-pointed at /dev/zero (endless, no newline), then at a FIFO (its open would
        // block), then back.
        let repoint = |to: &std::path::Path| {
            let tmp = dir.path().join("link.tmp");
            std::os::unix::fs::symlink(to, &tmp).unwrap();
            std::fs::rename(&tmp, &link).unwrap();
        };
        repoint(std::path::Path::new("/dev/zero"));
        let shown = link.display().to_string();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while states.stuck(u64::MAX, Duration::ZERO).is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "never said unavailable"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            states.stuck(u64::MAX, Duration::ZERO),
            vec![(
                shown.clone(),
                "not a regular file (a character device)".into()
            )]
        );
        let fifo = dir.path().join("fifo");
        if std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success())
        {
            repoint(&fifo);
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(
                states.stuck(u64::MAX, Duration::ZERO)[0].1,
                "not a regular file (a FIFO)"
            );
        }
        append(&real, "written meanwhile\n");
        repoint(&real);
        // The same file again: on from where it was, nothing read twice.
        assert_eq!(next(&mut rx), "written meanwhile");
        append(&real, "after\n");
        assert_eq!(next(&mut rx), "after");
        assert!(
            states.stuck(u64::MAX, Duration::ZERO).is_empty(),
            "read again"
        );
        assert_eq!(
            stats.snapshot().log_lines_too_long,
            0,
            "no byte of the device read"
        );
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap();
        assert!(rx.try_recv().is_err(), "nothing else delivered");
    }

    #[test]
    fn one_round_reads_a_bounded_amount_before_looking_at_the_path() {
        // A file larger than a round is read whole, in rounds.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.log");
        let line = format!("{}\n", "x".repeat(1023));
        let lines = (MAX_ROUND_BYTES as usize / line.len()) * 3 / 2;
        std::fs::write(&path, line.repeat(lines)).unwrap();
        let (tx, mut rx) = mpsc::channel(lines + 10);
        let stop = Arc::new(AtomicBool::new(false));
        let h = spawn(
            LogSource::File {
                path,
                from_start: true,
                poll: Duration::from_millis(10),
            },
            4096,
            tx,
            LineBudget::new(usize::MAX),
            Arc::new(AgentStats::default()),
            SourceStates::new(),
            stop.clone(),
        )
        .unwrap();
        for _ in 0..lines {
            assert_eq!(next(&mut rx).len(), 1023);
        }
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
    fn lines_wait_while_the_tap_has_its_budget_to_take() {
        let b = LineBudget::new(10);
        assert!(b.take(8, || false));
        assert!(!b.take(30, || true), "over the budget: waits (here: gone)");
        b.give(8);
        assert!(b.take(30, || false), "a line alone always goes");
        let b2 = b.clone();
        let waiter = std::thread::spawn(move || b2.take(5, || false));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished(), "waits for the tap");
        b.give(30);
        assert!(waiter.join().unwrap());
    }

    #[test]
    fn a_reader_ends_with_end() {
        let (tx, mut rx) = mpsc::channel(10);
        let tx = Lines2Tap {
            tx,
            budget: LineBudget::new(usize::MAX),
        };
        let stats = AgentStats::default();
        read_to_end(&b"x\ny"[..], 64, &tx, &stats);
        assert_eq!(rx.try_recv().unwrap(), LogItem::Line("x".into()));
        assert_eq!(rx.try_recv().unwrap(), LogItem::Line("y".into()));
        assert_eq!(rx.try_recv().unwrap(), LogItem::End);
    }

    #[test]
    fn a_line_past_the_limit_is_skipped_and_counted_never_held() {
        let (tx, mut rx) = mpsc::channel(10);
        let tx = Lines2Tap {
            tx,
            budget: LineBudget::new(usize::MAX),
        };
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
