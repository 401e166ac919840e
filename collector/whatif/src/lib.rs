//! What-if: a recording's routed requests replayed over per-worker caches kvscope
//! simulates, to predict what a change of the fleet would do to its figures before
//! anyone makes it. This first question is capacity: the hit rate and uncached prefill
//! with each worker's KV cache `reserve` smaller (the share NixlConnector's buffers
//! would take if migration were turned on).
//!
//! The routing decisions are held fixed: each request goes where it went in the
//! recording. With smaller caches a KV-aware router would see smaller overlaps and may
//! choose otherwise; the prediction does not follow that.
//!
//! The simulated cache is a least-recently-used cache of prompt blocks. A real engine's
//! cache also holds what it decodes, partial blocks and the blocks of requests still
//! running, so it holds fewer prompt blocks than its size: the what-if first finds the
//! simulated size that reproduces the recorded run's own hit rate (the calibration,
//! measured on the same recording), then scales that size by `1 − reserve`.
//!
//! Each worker's cache size is what Dynamo's discovery says of it
//! (`runtime_config.total_kv_blocks`, in the recording's worker records), unless given.
//!
//! With nothing changed (reserve 0 and no simulation) the figures are the recorded
//! run's own, per request: the same fold the collector runs ([`WhatIf::recorded`]).

pub mod cache;
pub mod disagg;
pub mod fixtures;
pub mod migration;
pub mod question;
pub mod recording;
pub mod replay;
pub mod router;

pub use kvscope_fold::analyzer::RoutedRequest;

use kvscope_fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_wire::nixl::{NixlAgentRow, NixlPair};
use kvscope_wire::recording::RecordingError;
use kvscope_wire::{Record, RequestEnd, WorkerKey, WorkerState};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;

/// Prompt tokens and how many of them were cached, over a set of requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheTotals {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// prompt − cached: the tokens prefilled.
    pub uncached_prefill_tokens: u64,
}

/// The tokens of an `isl`-token prompt that `cached_blocks` blocks hold.
pub(crate) fn cached_tokens(isl: u64, cached_blocks: u64, block_size: u32) -> u64 {
    (cached_blocks * block_size as u64).min(isl)
}

impl CacheTotals {
    fn add(&mut self, isl: u64, cached_blocks: u64, block_size: u32) {
        let cached = cached_tokens(isl, cached_blocks, block_size);
        self.requests += 1;
        self.prompt_tokens += isl;
        self.cached_tokens += cached;
        self.uncached_prefill_tokens += isl - cached;
    }

    /// cached / prompt tokens.
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// Why a what-if cannot be answered.
#[derive(Debug, thiserror::Error)]
pub enum WhatIfError {
    #[error(transparent)]
    Recording(#[from] RecordingError),
    #[error(
        "worker {0} has no KV cache size: its discovery record gives no total_kv_blocks \
         (give --gpu-blocks)"
    )]
    UnknownCapacity(u64),
    #[error("reserve {0} is not a share of the cache in [0, 1)")]
    Reserve(f64),
    #[error("no routed request the collector could judge")]
    NoRequests,
    #[error("a cache of {0} blocks per worker is not a size to simulate (1 to {MAX_BLOCKS})")]
    Size(u64),
    #[error("at most {MAX_RESERVES} reserves at once, not {0}")]
    TooManyReserves(usize),
    #[error("1 to {max} token gates at once, not {0}", max = migration::MAX_GATES)]
    Gates(usize),
    #[error(
        "a migration is priced with KV bytes per token and a prefill rate above 0, and a \
         bandwidth, handshake and dispatch overhead that are finite and not negative"
    )]
    Pricing,
}

/// The largest cache size simulated, in blocks per worker (2^32 blocks of 16 tokens are
/// 68 billion tokens: no engine holds that).
pub(crate) const MAX_BLOCKS: u64 = 1 << 32;
/// Reserves predicted in one what-if at most.
pub(crate) const MAX_RESERVES: usize = 32;

/// Blocks per dp rank by worker id, as discovery last described each worker (a size of
/// 0 says nothing: unknown).
fn discovered_blocks(a: &FleetAnalyzer) -> HashMap<u64, u64> {
    a.fleet()
        .values()
        .filter_map(|w| Some((w.worker_id, w.total_kv_blocks.filter(|&b| b > 0)?)))
        .collect()
}

/// `blocks` scaled by `permille` thousandths, rounded (in u128: no overflow).
fn scaled(blocks: u64, permille: u64) -> u64 {
    ((blocks as u128 * permille as u128 + 500) / 1000).min(u64::MAX as u128) as u64
}

/// Each worker's blocks left after setting `reserve` of them aside, `⌊blocks × (1 − reserve)⌋`.
fn left_after(sizes: &HashMap<WorkerKey, u64>, reserve: f64) -> HashMap<WorkerKey, u64> {
    sizes
        .iter()
        .map(|(w, b)| (*w, (*b as f64 * (1.0 - reserve)).floor() as u64))
        .collect()
}

/// The one size every worker has, if they all have one.
fn uniform(sizes: &HashMap<WorkerKey, u64>) -> Option<u64> {
    let mut v = sizes.values();
    let first = *v.next()?;
    v.all(|&b| b == first).then_some(first)
}

/// The sizes simulated over the sizes, as rounded to whole blocks.
fn calibration(sizes: &HashMap<WorkerKey, u64>, permille: u64) -> f64 {
    sizes.values().map(|&b| scaled(b, permille)).sum::<u64>() as f64
        / sizes.values().sum::<u64>().max(1) as f64
}

/// The prediction at one reserve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CapacityRow {
    /// The share of each worker's cache set aside.
    pub reserve: f64,
    /// Blocks per worker left to the cache, `⌊blocks × (1 − reserve)⌋`, when every
    /// worker has the same size.
    pub blocks_per_worker: Option<u64>,
    /// The same over every worker the requests went to.
    pub fleet_blocks: u64,
    #[serde(flatten)]
    pub totals: CacheTotals,
    pub hit_rate: f64,
}

/// What a recording says, and what it predicts at each reserve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CapacityWhatIf {
    /// Each worker's cache in blocks in the recorded run, when all have one size.
    pub blocks_per_worker: Option<u64>,
    /// Where the sizes come from: `discovery` (Dynamo's `total_kv_blocks`) or `given`.
    pub capacity_from: String,
    /// The recorded run's own figures.
    pub recorded: CacheTotals,
    pub recorded_hit_rate: f64,
    /// Simulated blocks per real block: the size at which the simulation reproduces
    /// the recorded hit rate, over each worker's size.
    pub calibration: f64,
    /// False when no plausible size reproduces the recorded hit rate
    /// ([`CalibrationFailure`], said in `calibration_failure`): the rows are then
    /// left empty, since a simulation that cannot reproduce the recorded run predicts
    /// nothing about a changed one.
    pub calibrated: bool,
    /// Why the simulation could not be calibrated, when it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration_failure: Option<String>,
    /// Requests whose simulated overlap at the calibrated size equals the recorded one.
    pub requests_matched_exactly: u64,
    /// Records that could not be read and were skipped (see the log).
    pub undecodable_records: u64,
    pub rows: Vec<CapacityRow>,
}

/// A recording's routed requests, in the order the collector judged them.
#[derive(Debug)]
pub struct WhatIf {
    requests: Vec<RoutedRequest>,
    /// Each request's previous turn, where its chain shows one
    /// ([`replay::previous_turns`]).
    previous: Vec<Option<usize>>,
    /// Each request's life, where Dynamo's request trace timed any.
    lifetimes: Option<replay::Lifetimes>,
    /// The prefill workers of a disaggregated fleet, as discovery described them.
    prefill_workers: HashSet<u64>,
    /// The workers discovery listed up at the end, each dp rank: candidates whether or
    /// not a request went to them.
    idle_workers: Vec<FleetWorker>,
    /// Blocks per dp rank, by worker id, as discovery last described each worker.
    discovered_blocks: HashMap<u64, u64>,
    /// Records that could not be read (recording lines, bus messages): counted, skipped.
    undecodable_records: u64,
    /// The collector's least overlap difference that makes a spill.
    min_spill_blocks: u32,
    /// What the agents' NIXL probes measured, per pair, and which worker each agent
    /// works for: what a migration is priced with.
    nixl_pairs: Vec<NixlPair>,
    nixl_agents: Vec<NixlAgentRow>,
    /// Calibrations found, by the sizes they were found for: each is some 30 replays,
    /// and every question asks for the same one.
    calibrations: Mutex<Vec<(Sizes, Calibration)>>,
}

/// A worker rank as discovery listed it.
#[derive(Debug, Clone)]
struct FleetWorker {
    key: WorkerKey,
    model: Option<String>,
}

/// Every worker's size, sorted: what a calibration was found for.
type Sizes = Vec<(WorkerKey, u64)>;
/// The scale in thousandths, and whether it reproduces the recorded hits at a
/// plausible size.
type Calibration = (u64, Result<(), CalibrationFailure>);

/// The fewest and most simulated blocks per real block a calibration may land on. The
/// simulated cache holds prompt blocks only, while an engine's also holds what it
/// decodes and partial blocks, so the simulated size is somewhat below the real one
/// (0.84–0.93 on the lab's runs, BENCHMARKS.md); far outside, the simulation's caches
/// do not behave as the fleet's engines did (a simulation that held every queued
/// request's prompt from its decision reproduced a loaded lab's hits at 0.004), and its
/// predictions would be numbers without meaning.
pub const PLAUSIBLE_CALIBRATION: std::ops::RangeInclusive<f64> = 0.25..=2.0;

/// Why no simulated size reproduces the recorded run.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum CalibrationFailure {
    #[error(
        "even caches that never evict reach fewer hits than recorded: the requests start on \
         warm caches (the live collector keeps only its latest requests, whose prefixes \
         older ones may have stored)"
    )]
    WarmStart,
    #[error(
        "the simulation reproduces the recorded hit rate only at {0:.2} simulated blocks per \
         block, outside the plausible {lo}–{hi}: its caches do not behave as this fleet's \
         engines did", lo = PLAUSIBLE_CALIBRATION.start(), hi = PLAUSIBLE_CALIBRATION.end()
    )]
    Implausible(f64),
}

impl WhatIf {
    /// Replay the recording at `path` through the collector's fold and keep each judged
    /// request.
    pub fn from_recording(path: &Path, cfg: AnalyzerConfig) -> Result<Self, WhatIfError> {
        Ok(Self::replay_recording(path, cfg)?.1)
    }

    /// One replay of the recording at `path`: the collector's fold at its end (what the
    /// opportunity report is made from) and the what-if of every request judged.
    pub fn replay_recording(
        path: &Path,
        cfg: AnalyzerConfig,
    ) -> Result<(FleetAnalyzer, Self), WhatIfError> {
        // Every judged request, not only the latest the analyzer keeps, each with its
        // end (which comes after it).
        let mut requests: Vec<RoutedRequest> = Vec::new();
        let mut ends: HashMap<String, RequestEnd> = HashMap::new();
        let a = crate::recording::replay_with(path, cfg, |a, env, judged| {
            if judged {
                requests.extend(a.routed_requests().next_back().cloned());
            }
            if let Record::RequestEnd(e) = &env.record {
                ends.insert(e.request_id.clone(), e.clone());
            }
        })?;
        for r in &mut requests {
            if let Some(e) = ends.remove(&r.request_id) {
                r.end = Some(e);
            }
        }
        let w = Self::with_requests(&a, requests);
        Ok((a, w))
    }

    fn with_requests(a: &FleetAnalyzer, requests: Vec<RoutedRequest>) -> Self {
        let up = a.fleet().values().filter(|w| w.state == WorkerState::Up);
        Self {
            previous: replay::previous_turns(&requests),
            lifetimes: Self::compute_lifetimes(&requests),
            prefill_workers: a
                .fleet()
                .values()
                .filter(|w| w.worker_type.as_deref() == Some("prefill"))
                .map(|w| w.worker_id)
                .collect(),
            idle_workers: up
                .filter(|w| w.total_kv_blocks.is_some_and(|b| b > 0))
                .flat_map(|w| {
                    let ranks = if w.dp_ranks.is_empty() {
                        vec![0]
                    } else {
                        w.dp_ranks.clone()
                    };
                    ranks.into_iter().map(|dp_rank| FleetWorker {
                        key: WorkerKey {
                            worker_id: w.worker_id,
                            dp_rank,
                        },
                        model: w.model.clone(),
                    })
                })
                .collect(),
            requests,
            discovered_blocks: discovered_blocks(a),
            undecodable_records: a.counters().undecodable_records,
            min_spill_blocks: a.config().min_spill_blocks,
            nixl_pairs: kvscope_fold::nixl::pairs(a.agents()),
            nixl_agents: a.owners_ever_told(),
            calibrations: Mutex::default(),
        }
    }

    /// The requests the live collector keeps (the latest; see
    /// [`FleetAnalyzer::routed_requests`]) and the sizes its discovery records give.
    pub fn from_analyzer(a: &FleetAnalyzer) -> Self {
        Self::with_requests(a, a.routed_requests().cloned().collect())
    }

    pub fn requests(&self) -> &[RoutedRequest] {
        &self.requests
    }

    /// Each request's time to first token from its request-trace end, as a sample of
    /// its prefill's path (remote where a prefill worker other than its decode worker
    /// prefilled it; uncached: its prompt less what the engine reported cached, else
    /// less its recorded overlap); and how many ends gave no first token (left out).
    pub fn ttft_samples(&self) -> (Vec<disagg::TtftSample>, u64) {
        let mut left_out = 0;
        let samples = self
            .requests
            .iter()
            .filter_map(|r| {
                let e = r.end.as_ref()?;
                let Some(ttft_ms) = e.ttft_ms else {
                    left_out += 1;
                    return None;
                };
                let cached = e.cached_tokens.unwrap_or_else(|| {
                    cached_tokens(r.isl_tokens, r.recorded_overlap_blocks.into(), r.block_size)
                });
                Some(disagg::TtftSample {
                    prompt_tokens: e.input_tokens,
                    uncached_tokens: e.input_tokens.saturating_sub(cached),
                    ttft_ms,
                    remote: e.prefill_worker.is_some(),
                })
            })
            .collect();
        (samples, left_out)
    }

    /// The recorded run's figures (nothing changed).
    pub fn recorded(&self) -> CacheTotals {
        let mut t = CacheTotals::default();
        for r in &self.requests {
            t.add(r.isl_tokens, r.recorded_overlap_blocks as u64, r.block_size);
        }
        t
    }

    /// Every request replayed over caches of `blocks(worker)` each: the totals, and
    /// the simulated overlap of each request.
    pub(crate) fn simulate(&self, blocks: impl Fn(&WorkerKey) -> u64) -> (CacheTotals, Vec<u32>) {
        let mut overlaps = Vec::with_capacity(self.requests.len());
        let t = self.replay(blocks, false, |_, hit, _| overlaps.push(hit as u32));
        (t, overlaps)
    }

    /// Every request replayed in order over caches of `blocks(worker)` each, prefilled on
    /// its chosen worker: `each` is told the request, the prefix its chosen worker held,
    /// and, when `others`, the worker of its model holding more of it than any other
    /// and more than the chosen one (the best, for a spill), with how much.
    fn replay(
        &self,
        blocks: impl Fn(&WorkerKey) -> u64,
        others: bool,
        mut each: impl FnMut(&RoutedRequest, usize, Option<(WorkerKey, usize)>),
    ) -> CacheTotals {
        self.replay_routed(blocks, others, None, |r, _, hit, best| each(r, hit, best))
    }

    /// Each worker's size in blocks: `given`, else discovery's.
    fn sizes(&self, given: Option<u64>) -> Result<HashMap<WorkerKey, u64>, WhatIfError> {
        if let Some(b) = given.filter(|b| !(1..=MAX_BLOCKS).contains(b)) {
            return Err(WhatIfError::Size(b));
        }
        let mut sizes = HashMap::new();
        for r in &self.requests {
            let b = match given {
                Some(b) => b,
                None => *self
                    .discovered_blocks
                    .get(&r.worker.worker_id)
                    .ok_or(WhatIfError::UnknownCapacity(r.worker.worker_id))?,
            };
            sizes.insert(r.worker, b.min(MAX_BLOCKS));
        }
        // Workers no request went to have discovery's size (they are candidates only
        // where it gives one).
        for w in &self.idle_workers {
            let b = given.or_else(|| self.discovered_blocks.get(&w.key.worker_id).copied());
            if let Some(b) = b {
                sizes.entry(w.key).or_insert(b.min(MAX_BLOCKS));
            }
        }
        Ok(sizes)
    }

    /// The scale of every worker's size whose simulated hit rate is the recorded run's
    /// (the hits only grow with the size, so a bisection finds it), in thousandths, and
    /// whether a plausible scale reaches it.
    fn calibrated_permille(&self, sizes: &HashMap<WorkerKey, u64>) -> Calibration {
        let mut key: Sizes = sizes.iter().map(|(w, b)| (*w, *b)).collect();
        key.sort();
        let found = |c: &[(Sizes, Calibration)]| c.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
        let memo = || self.calibrations.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = found(&memo()) {
            return v;
        }
        let v = self.calibrate(sizes);
        memo().push((key, v));
        v
    }

    fn calibrate(&self, sizes: &HashMap<WorkerKey, u64>) -> Calibration {
        let want = self.recorded().cached_tokens;
        if want == 0 {
            // Nothing was a hit: every size reproduces that, and the real one is as
            // good a guess as any.
            return (1000, Ok(()));
        }
        let at = |permille: u64| {
            self.simulate(|w| scaled(sizes.get(w).copied().unwrap_or(0), permille))
                .0
                .cached_tokens
        };
        // A size that holds every block ever asked for never evicts: the top.
        let most: u64 = self.requests.iter().map(|r| r.chain.len() as u64).sum();
        let smallest = sizes
            .values()
            .copied()
            .filter(|&b| b > 0)
            .min()
            .unwrap_or(1);
        let top = (most.saturating_mul(1000))
            .div_ceil(smallest)
            .max(1000)
            .saturating_add(1);
        if at(top) < want {
            return (top, Err(CalibrationFailure::WarmStart));
        }
        let (mut lo, mut hi) = (0u64, top);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if at(mid) >= want {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let c = calibration(sizes, lo);
        if PLAUSIBLE_CALIBRATION.contains(&c) {
            (lo, Ok(()))
        } else {
            (lo, Err(CalibrationFailure::Implausible(c)))
        }
    }

    /// Reserves to predict, and requests to predict them on.
    fn check(&self, reserves: &[f64]) -> Result<(), WhatIfError> {
        if reserves.len() > MAX_RESERVES {
            return Err(WhatIfError::TooManyReserves(reserves.len()));
        }
        if let Some(&r) = reserves
            .iter()
            .find(|r| !(r.is_finite() && (0.0..1.0).contains(*r)))
        {
            return Err(WhatIfError::Reserve(r));
        }
        if self.requests.is_empty() {
            return Err(WhatIfError::NoRequests);
        }
        Ok(())
    }

    /// The prediction at each of `reserves`, each worker's size `given` or discovery's.
    pub fn capacity(
        &self,
        given: Option<u64>,
        reserves: &[f64],
    ) -> Result<CapacityWhatIf, WhatIfError> {
        self.check(reserves)?;
        let sizes = self.sizes(given)?;
        let recorded = self.recorded();
        let (permille, calibrated) = self.calibrated_permille(&sizes);
        let reserves: &[f64] = if calibrated.is_ok() { reserves } else { &[] };
        let scale = |m: &HashMap<WorkerKey, u64>| {
            m.iter()
                .map(|(w, b)| (*w, scaled(*b, permille)))
                .collect::<HashMap<_, _>>()
        };
        let at = |m: &HashMap<WorkerKey, u64>| {
            let m = scale(m);
            self.simulate(move |w| m.get(w).copied().unwrap_or(0))
        };
        let (_, overlaps) = at(&sizes);
        let requests_matched_exactly = self
            .requests
            .iter()
            .zip(&overlaps)
            .filter(|(r, &o)| r.recorded_overlap_blocks == o)
            .count() as u64;
        let rows = reserves
            .iter()
            .map(|&reserve| {
                let left = left_after(&sizes, reserve);
                let (totals, _) = at(&left);
                CapacityRow {
                    reserve,
                    blocks_per_worker: uniform(&left),
                    fleet_blocks: left.values().sum(),
                    hit_rate: totals.hit_rate(),
                    totals,
                }
            })
            .collect();
        Ok(CapacityWhatIf {
            blocks_per_worker: uniform(&sizes),
            capacity_from: if given.is_some() {
                "given"
            } else {
                "discovery"
            }
            .to_string(),
            recorded_hit_rate: recorded.hit_rate(),
            recorded,
            calibration: calibration(&sizes, permille),
            calibrated: calibrated.is_ok(),
            calibration_failure: calibrated.err().map(|e| e.to_string()),
            requests_matched_exactly,
            undecodable_records: self.undecodable_records,
            rows,
        })
    }
}

impl CapacityWhatIf {
    pub fn to_markdown(&self) -> String {
        let mut s = format!(
            "# What if each worker's KV cache were smaller\n\n\
             Recorded: {} requests, {} blocks per worker ({}), hit rate {:.1}%, {} uncached prefill tokens.\n",
            self.recorded.requests,
            self.blocks_per_worker
                .map_or("various".to_string(), |b| b.to_string()),
            self.capacity_from,
            100.0 * self.recorded_hit_rate,
            self.recorded.uncached_prefill_tokens,
        );
        if self.undecodable_records > 0 {
            s.push_str(&format!(
                "**{} records could not be read** and were skipped (see the log).\n",
                self.undecodable_records
            ));
        }
        if let Some(why) = self
            .calibration_failure
            .as_deref()
            .filter(|_| !self.calibrated)
        {
            s.push_str(&format!(
                "**Not predicted**: the simulation could not be calibrated on this recording: \
                 {why}.\n"
            ));
            return s;
        }
        s.push_str(&format!(
            "Calibration: the simulation reproduces that hit rate at {:.2} simulated blocks per block; \
             at that size {} of {} requests get exactly their recorded overlap.\n\
             Routing decisions held fixed (each request goes where it went).\n\n\
             | reserve | blocks per worker | hit rate | uncached prefill tokens | vs recorded |\n\
             |---:|---:|---:|---:|---:|\n",
            self.calibration,
            self.requests_matched_exactly,
            self.recorded.requests,
        ));
        for r in &self.rows {
            let vs = if self.recorded.uncached_prefill_tokens == 0 {
                "—".to_string()
            } else {
                format!(
                    "{:+.1}%",
                    100.0
                        * (r.totals.uncached_prefill_tokens as f64
                            / self.recorded.uncached_prefill_tokens as f64
                            - 1.0)
                )
            };
            s.push_str(&format!(
                "| {:.0}% | {} | {:.1}% | {} | {} |\n",
                100.0 * r.reserve,
                r.blocks_per_worker
                    .map_or(format!("{} in all", r.fleet_blocks), |b| b.to_string()),
                100.0 * r.hit_rate,
                r.totals.uncached_prefill_tokens,
                vs
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{calibration_far_below_the_real_size, req};

    #[test]
    fn nothing_changed_is_the_recorded_run_and_less_room_costs_hits() {
        // Two families alternating on one worker: with room for both their prefixes
        // every repeat hits; with room for one, none does.
        let requests: Vec<_> = (0..6)
            .map(|i| {
                let fam = (i % 2) * 100;
                let recorded = if i < 2 { 0 } else { 4 };
                req(1, &[fam + 1, fam + 2, fam + 3, fam + 4], recorded)
            })
            .collect();
        let w = WhatIf {
            requests,
            discovered_blocks: HashMap::from([(1, 8)]),
            undecodable_records: 0,
            ..WhatIf::empty()
        };
        let rec = w.recorded();
        assert_eq!(rec.requests, 6);
        assert_eq!(rec.cached_tokens, 4 * 4 * 16);
        let (t8, o8) = w.simulate(|_| 8);
        assert_eq!(t8, rec, "room for both: the recorded run exactly");
        assert_eq!(o8, vec![0, 0, 4, 4, 4, 4]);
        let (t4, _) = w.simulate(|_| 4);
        assert_eq!(
            t4.cached_tokens, 0,
            "room for one family: the other evicts it"
        );
        let c = w.capacity(None, &[0.0, 0.5]).unwrap();
        assert_eq!(c.capacity_from, "discovery");
        assert_eq!(c.blocks_per_worker, Some(8));
        assert_eq!(c.calibration, 1.0);
        assert_eq!(c.requests_matched_exactly, 6);
        assert_eq!(c.rows[0].totals, rec);
        assert_eq!(c.rows[1].blocks_per_worker, Some(4));
        assert_eq!(c.rows[1].totals.uncached_prefill_tokens, rec.prompt_tokens);
        assert!(c.to_markdown().contains("| 50% | 4 | 0.0% |"));
        // A given size wins over discovery's; the calibration then says the recorded
        // hits needed twice what was given.
        let given = w.capacity(Some(4), &[0.0]).unwrap();
        assert_eq!(
            (
                given.capacity_from.as_str(),
                given.blocks_per_worker,
                given.calibration
            ),
            ("given", Some(4), 2.0)
        );
        let unknown = WhatIf {
            requests: w.requests.clone(),
            discovered_blocks: HashMap::new(),
            undecodable_records: 0,
            ..WhatIf::empty()
        };
        assert!(matches!(
            unknown.capacity(None, &[0.0]),
            Err(WhatIfError::UnknownCapacity(1))
        ));
        assert!(matches!(
            w.capacity(Some(0), &[0.0]),
            Err(WhatIfError::Size(0))
        ));
        assert!(matches!(
            w.capacity(Some(u64::MAX), &[0.0]),
            Err(WhatIfError::Size(_))
        ));
        assert!(matches!(
            w.capacity(None, &[1.0]),
            Err(WhatIfError::Reserve(_))
        ));
        assert!(matches!(
            w.capacity(None, &[0.1; 33]),
            Err(WhatIfError::TooManyReserves(33))
        ));
        assert!(c.calibrated);
    }

    #[test]
    fn the_request_ends_answer_conditional_disaggregation_where_they_hold_both_paths() {
        // Local prefills cost 10 ms + 1 ms per 100 tokens, remote ones 30 ms flat.
        let mut requests = Vec::new();
        for (i, (tokens, remote)) in [(400, false), (800, false), (1600, false), (3200, false)]
            .into_iter()
            .chain([(400, true), (3200, true)])
            .enumerate()
        {
            let mut r = req(1, &[i as u64 + 1], 0);
            r.request_id = format!("r{i}");
            r.isl_tokens = tokens;
            r.end = Some(RequestEnd {
                request_id: r.request_id.clone(),
                worker: r.worker,
                prefill_worker: remote.then_some(WorkerKey {
                    worker_id: 9,
                    dp_rank: 0,
                }),
                received_ns: 0,
                ttft_ms: Some(if remote {
                    30.0
                } else {
                    10.0 + tokens as f64 / 100.0
                }),
                total_ms: Some(100.0),
                input_tokens: tokens,
                output_tokens: 8,
                cached_tokens: Some(0),
            });
            requests.push(r);
        }
        let both = WhatIf {
            requests: requests.clone(),
            ..WhatIf::empty()
        };
        let d = question::WhatIfInputs::default()
            .disagg(Some(&both))
            .unwrap()
            .expect("both paths measured: answered");
        assert_eq!(d.crossing, disagg::Crossing::RemoteFrom(2000));
        // One path only (every prefill local): nothing to fit the other with.
        requests.retain(|r| r.end.as_ref().is_some_and(|e| e.prefill_worker.is_none()));
        let local = WhatIf {
            requests,
            ..WhatIf::empty()
        };
        assert!(question::WhatIfInputs::default()
            .disagg(Some(&local))
            .unwrap()
            .is_none());
    }

    #[test]
    fn requests_that_start_on_warm_caches_say_so() {
        // Recorded as hits from the first request on: no simulated cache can know them.
        let w = WhatIf {
            requests: vec![req(1, &[1, 2], 2), req(1, &[3, 4], 2)],
            discovered_blocks: HashMap::from([(1, 8)]),
            undecodable_records: 3,
            ..WhatIf::empty()
        };
        let c = w.capacity(None, &[0.0, 0.5]).unwrap();
        assert!(!c.calibrated);
        assert!(
            c.rows.is_empty(),
            "an uncalibrated simulation predicts nothing"
        );
        let md = c.to_markdown();
        assert!(md.contains("**Not predicted**"), "{md}");
        assert!(md.contains("warm caches"), "{md}");
        assert!(!md.contains("| reserve |"), "no table: {md}");
        assert!(md.contains("**3 records could not be read**"), "{md}");
    }

    #[test]
    fn a_calibration_far_below_the_real_size_is_a_stated_failure() {
        let w = calibration_far_below_the_real_size();
        let c = w.capacity(None, &[0.0, 0.1]).unwrap();
        assert!(!c.calibrated);
        assert!(c.rows.is_empty());
        assert!((c.calibration - 0.02).abs() < 1e-9, "{}", c.calibration);
        // Nor does the migration question, which prices the same simulation.
        let answer = question::WhatIfInputs::default().answer(&w).unwrap();
        assert!(answer.migration.rows.is_empty());
        let why = c.calibration_failure.as_deref().unwrap();
        assert!(why.contains("0.02 simulated blocks per block"), "{why}");
        // At a plausible real size the same requests are predicted.
        let ok = WhatIf {
            discovered_blocks: HashMap::from([(1, 2)]),
            ..w
        };
        let c = ok.capacity(None, &[0.0, 0.5]).unwrap();
        assert!(c.calibrated && c.calibration_failure.is_none());
        assert_eq!(c.rows.len(), 2);
        assert_eq!(c.rows[0].totals.cached_tokens, 3 * 32);
        assert_eq!(
            c.rows[1].totals.cached_tokens,
            3 * 16,
            "one block holds the prompt's first block only"
        );
    }

    #[test]
    fn a_cache_of_no_blocks_still_holds_what_its_running_requests_hold() {
        // The hits only grow with the size, from 0 blocks on: the bisection's premise.
        let mut c = cache::SimulatedCache::new(0);
        assert_eq!(c.acquire(&[1, 2]), 0);
        assert_eq!(c.prefix_hit(&[1, 2]), 2, "held while it runs");
        c.release(&[1, 2]);
        assert_eq!(c.prefix_hit(&[1, 2]), 0, "gone once freed");
    }
}
