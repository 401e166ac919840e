//! The collector's state, shared by the ingest that folds records into it and the
//! listeners that serve it: the fold (under a lock), the bus's status, the recording, and
//! what is told of each record applied. Ingest writes it, serve reads it; neither calls
//! the other.

use crate::fold::analyzer::FleetAnalyzer;
use crate::ingest::clocks::AgentClocks;
use kvscope_wire::api::summary::BusStatus;
use kvscope_wire::api::verdict::SpillVerdict;
use kvscope_wire::parts::{PartsLimits, Reassembler};
use kvscope_wire::recording::RecordingWriter;
use kvscope_wire::{Envelope, Subjects};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};

/// Told of every record the collector applies live, in stream order, with its verdict
/// when it was a routing decision: `seq` is its stream sequence, `index` its place in a
/// bundle. Implemented by the OTLP span export (`serve::spans`).
pub trait AppliedSink: Send + Sync {
    fn applied(&self, env: &Envelope, verdict: Option<&SpillVerdict>, seq: u64, index: usize);
}

pub struct Shared {
    /// The cluster's subjects: which agent each record's subject names.
    pub(crate) subjects: Subjects,
    pub analyzer: Mutex<FleetAnalyzer>,
    /// Records arriving in parts, joined before they are applied.
    pub(crate) parts: Mutex<Reassembler>,
    pub bus: Mutex<BusStatus>,
    pub recorder: Mutex<Option<RecordingWriter>>,
    /// OTLP export health, shown on `/metrics`.
    pub otlp: Arc<kvscope_otlp::ExportStats>,
    /// What is told of every record applied live (not while the fold is rebuilt), once
    /// it has started: the OTLP export's verdict and migration spans.
    pub applied: OnceLock<Box<dyn AppliedSink>>,
    /// What the HTTP listener refused (connections over its cap, requests too slow),
    /// shown on `/metrics`.
    pub http: Arc<kvscope_kit::http::ServerStats>,
    /// Each agent's clock against the stream's (`crate::ingest::clocks`).
    pub clocks: Mutex<AgentClocks>,
    /// The fold has been rebuilt from the stream: only then may this collector take its
    /// scope's lease (`crate::lease`), so that a collector restarted in place does not
    /// take it back from a standby that serves while it rebuilds.
    pub caught_up: AtomicBool,
}

impl Shared {
    pub fn new(
        analyzer: FleetAnalyzer,
        recorder: Option<RecordingWriter>,
        subjects: Subjects,
    ) -> Arc<Self> {
        Arc::new(Self {
            subjects,
            analyzer: Mutex::new(analyzer),
            parts: Mutex::new(Reassembler::new(PartsLimits::default())),
            bus: Mutex::new(BusStatus::default()),
            recorder: Mutex::new(recorder),
            otlp: Arc::default(),
            applied: OnceLock::new(),
            http: Arc::default(),
            clocks: Mutex::default(),
            caught_up: AtomicBool::new(false),
        })
    }
}

/// Lock a mutex, recovering the data if a panicking thread poisoned it: the analyzer's
/// state stays usable, and a panic elsewhere must not stop the collector.
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
