//! Generated collector reads for the actuator's tests: windows on a 15 s grid, two
//! agents, one NIXL pair, all adjustable.

#![allow(dead_code)]

use kvscope_actuator::decide::input::CollectorView;
use kvscope_wire::api::summary::AgentStatus;
use kvscope_wire::api::summary::CollectorSummary;
use kvscope_wire::api::window::{
    spill_delta_bucket, MigrationLogWindow, SpillPairWindow, WindowSummary, WorkerWindow,
};
use kvscope_wire::nixl::{MergedLatency, NixlPair};
use kvscope_wire::WorkerKey;

pub const S: u64 = 1_000_000_000;
pub const WINDOW: u64 = 15 * S;
pub const T0: u64 = 1_780_000_000 * S;

pub fn worker(id: u64) -> WorkerKey {
    WorkerKey {
        worker_id: id,
        dp_rank: 0,
    }
}

/// One window's inputs.
#[derive(Clone, Debug)]
pub struct Spec {
    pub warmup: bool,
    /// Spills from worker 1 (holding the KV) to worker 2, each with this true delta.
    pub spills: u64,
    pub delta_tokens: u64,
    /// The fork's KVMIGRATE lines.
    pub spill_lines: u64,
    pub handshakes_obtained: u64,
    pub dispatch_failures: u64,
    pub data_faults: u64,
}

impl Spec {
    /// Clears every default threshold: 20 spills × 32768 tokens in 15 s ≈ 43.7k tok/s.
    pub fn good() -> Self {
        Self {
            warmup: false,
            spills: 20,
            delta_tokens: 32_768,
            spill_lines: 20,
            handshakes_obtained: 0,
            dispatch_failures: 0,
            data_faults: 0,
        }
    }
    pub fn warmup() -> Self {
        Self {
            warmup: true,
            ..Self::good()
        }
    }
    pub fn quiet() -> Self {
        Self {
            spills: 0,
            spill_lines: 0,
            ..Self::good()
        }
    }
    /// LIVE and healthy: every spill line has its handshake.
    pub fn live_ok() -> Self {
        Self {
            handshakes_obtained: 20,
            ..Self::good()
        }
    }
    /// The fork's silent failure: spill lines, no handshake obtained.
    pub fn silent_failure() -> Self {
        Self {
            handshakes_obtained: 0,
            spill_lines: 50,
            ..Self::good()
        }
    }
    pub fn with_volume_fraction(self, f: f64) -> Self {
        // Fewer spills of the same size: the volume scales, the share stays.
        Self {
            spills: ((self.spills as f64) * f).round() as u64,
            ..self
        }
    }
}

/// A NIXL pair: `bandwidth` bytes/s over 100 transfers, handshakes of 2 ms.
pub fn nixl_pair(local: &str, remote: &str, bandwidth: f64, ok: u64, failed: u64) -> NixlPair {
    let lat = vec![10_000_000u64; 100]; // 100 transfers of 10 ms
    let bytes = (bandwidth * 1.0) as u64; // 1 s in total
    NixlPair {
        local_agent: local.into(),
        remote_agent: remote.into(),
        transfers_ok: [("READ".to_string(), 100u64)].into_iter().collect(),
        bytes_ok: bytes,
        latency: MergedLatency::exact(&lat),
        bandwidth_bytes_per_second: Some(bytes as f64),
        handshakes_ok: ok,
        handshakes_failed: failed,
        handshake_latency: MergedLatency::exact(&vec![2_000_000; (ok + failed) as usize]),
        ..NixlPair::default()
    }
}

/// A fleet as the collector would show it.
#[derive(Clone, Debug)]
pub struct Fleet {
    /// Oldest first.
    pub windows: Vec<WindowSummary>,
    pub nixl: Vec<NixlPair>,
    pub agents: Vec<String>,
    /// Agents whose last word stopped at this time.
    pub silent_since: Vec<(String, u64)>,
    /// Record time ahead of the newest window's end.
    pub watermark_lead_ns: u64,
}

impl Fleet {
    /// Two agents, a healthy NIXL pair (20 GB/s, 10 handshakes ok), no windows.
    pub fn new() -> Self {
        Self {
            windows: Vec::new(),
            nixl: vec![nixl_pair("nixl-2", "nixl-1", 20e9, 10, 0)],
            agents: vec!["node-a".into(), "node-b".into()],
            silent_since: Vec::new(),
            watermark_lead_ns: S / 2,
        }
    }

    pub fn next_start(&self) -> u64 {
        self.windows.last().map_or(T0, |w| w.end_ns)
    }

    pub fn push(&mut self, spec: Spec) -> &mut Self {
        let start = self.next_start();
        let end = start + WINDOW;
        let secs = WINDOW as f64 / 1e9;
        let delta = spec.spills * spec.delta_tokens;
        let mut w = WindowSummary {
            start_ns: start,
            end_ns: end,
            warmup: spec.warmup,
            requests: spec.spills * 2,
            spills: spec.spills,
            true_delta_tokens: delta,
            upper_bound_tokens: delta,
            true_delta_tok_per_s: delta as f64 / secs,
            upper_bound_tok_per_s: delta as f64 / secs,
            data_faults: spec.data_faults,
            migration_log: MigrationLogWindow {
                spill_lines: spec.spill_lines,
                spill_migratable_tokens: spec.spill_lines * spec.delta_tokens,
                handshakes_obtained: spec.handshakes_obtained,
                dispatch_failures: spec.dispatch_failures,
                decoding_on_target: spec.handshakes_obtained,
            },
            ..Default::default()
        };
        if spec.spills > 0 {
            let b = spill_delta_bucket(spec.delta_tokens);
            let mut buckets = vec![0; b + 1];
            buckets[b] = spec.spills;
            w.spill_pairs = vec![SpillPairWindow {
                source: worker(1),
                target: worker(2),
                spills: spec.spills,
                true_delta_tokens: delta,
                delta_buckets: buckets,
            }];
            w.workers.insert(
                worker(2),
                WorkerWindow {
                    requests: spec.spills * 2,
                    spills_in: spec.spills,
                    uncached_prefill_tokens: delta,
                    true_delta_tokens_in: delta,
                    ..Default::default()
                },
            );
        }
        self.windows.push(w);
        self
    }

    pub fn push_n(&mut self, n: usize, spec: Spec) -> &mut Self {
        for _ in 0..n {
            self.push(spec.clone());
        }
        self
    }

    /// When the collector's newest window has just closed (what `now` is in a test).
    pub fn now(&self) -> u64 {
        self.next_start() + S
    }

    pub fn view(&self) -> CollectorView {
        self.view_at(self.now())
    }

    /// The collector's read with agents last heard just before `now`.
    pub fn view_at(&self, now: u64) -> CollectorView {
        let watermark = self.next_start() + self.watermark_lead_ns;
        let mut summary = CollectorSummary {
            watermark_ns: watermark,
            windows_closed: self.windows.len(),
            ..Default::default()
        };
        for a in &self.agents {
            let last = self
                .silent_since
                .iter()
                .find(|(n, _)| n == a)
                .map_or(watermark.min(now), |(_, t)| *t);
            summary.agents.insert(
                a.clone(),
                AgentStatus {
                    last_seen_ns: last,
                    ..Default::default()
                },
            );
        }
        CollectorView {
            summary,
            windows: self.windows.iter().rev().cloned().collect(),
            verdicts: Vec::new(),
            nixl: self.nixl.clone(),
            nixl_agents: Vec::new(),
        }
    }
}
