//! Timing, memory and the replay loop shared by every contender.

use crate::contenders::Contender;
use crate::trace::{Op, Trace};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::time::{Duration, Instant};

/// The system allocator, counting live heap bytes when switched on. Off (the default)
/// it costs one relaxed load per call, so timing runs keep it off and a separate run
/// counts.
pub struct CountingAlloc;

static COUNTING: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicIsize = AtomicIsize::new(0);

// The workspace's only unsafe code: a global allocator is an unsafe trait, and this one
// only forwards to the system allocator.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if COUNTING.load(Ordering::Relaxed) {
            LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        }
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Start counting, first thing in `main`: frees of anything allocated before would
/// push the count down.
pub fn start_counting() {
    COUNTING.store(true, Ordering::SeqCst);
}

/// Live heap bytes counted since [`start_counting`].
pub fn live_heap() -> isize {
    LIVE.load(Ordering::SeqCst)
}

/// This process's resident set, in bytes (Linux `/proc/self/statm`).
pub fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// What one replay of the stream measured.
#[derive(Debug, Default)]
pub struct Replay {
    /// Time inside `apply` (events) and `query`, summed.
    pub apply: Duration,
    pub query: Duration,
    /// Latency of each query, in nanoseconds, in stream order.
    pub latencies_ns: Vec<u64>,
    /// Digest of each query's answer, in stream order.
    pub digests: Vec<u64>,
    /// Workers with a non-zero overlap, summed over the queries.
    pub holders: u64,
}

impl Replay {
    pub fn total(&self) -> Duration {
        self.apply + self.query
    }
}

/// Most events prepared and applied at once.
const MAX_BATCH: usize = 1024;

/// Feed the whole stream to `c`: each run of events between two queries is prepared
/// (untimed), applied (timed), then the query is prepared (untimed) and answered
/// (timed); the answer is digested (untimed) and dropped.
pub fn replay<C: Contender>(c: &mut C, trace: &Trace) -> Replay {
    let mut out = Replay {
        latencies_ns: Vec::with_capacity(trace.stats.queries as usize),
        digests: Vec::with_capacity(trace.stats.queries as usize),
        ..Replay::default()
    };
    let ops = &trace.ops;
    let mut i = 0;
    while i < ops.len() {
        let mut j = i;
        while j < ops.len() && !matches!(ops[j], Op::Query { .. }) {
            j += 1;
        }
        // Long runs of events (a fill without queries) go in chunks, so that no
        // contender holds a converted copy of millions of events at once.
        let mut k = i;
        while k < j {
            let end = j.min(k + MAX_BATCH);
            let batch = c.prepare(trace, k..end);
            let t = Instant::now();
            c.apply(trace, batch);
            out.apply += t.elapsed();
            k = end;
        }
        if let Some(Op::Query { locals }) = ops.get(j) {
            let q = c.prepare_query(trace, *locals);
            let t = Instant::now();
            let answer = c.query(trace, q);
            let dt = t.elapsed();
            out.query += dt;
            out.latencies_ns.push(dt.as_nanos() as u64);
            out.digests.push(C::digest(&answer));
            out.holders += C::holders(&answer) as u64;
        }
        i = j + 1;
    }
    out
}

/// The `q`-quantile (0..=1) of unsorted samples.
pub fn quantile(samples: &[u64], q: f64) -> u64 {
    if samples.is_empty() {
        return 0;
    }
    let mut v = samples.to_vec();
    v.sort_unstable();
    let idx = ((v.len() - 1) as f64 * q).round() as usize;
    v[idx]
}
