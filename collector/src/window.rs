//! Measurement windows: fixed-length slices of record time with the spill figures of the
//! requests decided in them.

use crate::fleet_index::FleetIndex;
use crate::verdict::SpillVerdict;
use hdrhistogram::Histogram;
use kvscope_wire::WorkerKey;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Token counts up to 2^40 at 3 significant digits.
pub(crate) fn token_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 1 << 40, 3).expect("static histogram bounds are valid")
}

/// Distribution summary of a token count.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenDistribution {
    pub count: u64,
    pub p50: u64,
    pub p90: u64,
    pub max: u64,
    pub mean: f64,
}

impl TokenDistribution {
    pub fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        Self {
            count: h.len(),
            p50: h.value_at_quantile(0.5),
            p90: h.value_at_quantile(0.9),
            max: h.max(),
            mean: h.mean(),
        }
    }
}

/// One worker's share of a window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerWindow {
    /// Requests routed to this worker.
    pub requests: u64,
    /// Spills routed *to* this worker (it recomputed KV another worker held).
    pub spills_in: u64,
    /// Spills routed *away* from this worker (it held the KV).
    pub spills_out: u64,
    pub uncached_prefill_tokens: u64,
    pub true_delta_tokens_in: u64,
    /// Blocks cached on the worker when the window closed.
    pub cached_blocks: u64,
}

/// One model's share of a window (or, in the totals, of everything since start): the
/// decisions for requests to that model, judged among the workers serving it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelFigures {
    pub requests: u64,
    pub spills: u64,
    pub isl_tokens: u64,
    pub uncached_prefill_tokens: u64,
    pub true_delta_tokens: u64,
    pub upper_bound_tokens: u64,
}

impl ModelFigures {
    /// Count one verdict (token sums saturate: they come from the wire).
    pub fn add(&mut self, v: &SpillVerdict) {
        self.requests += 1;
        self.isl_tokens = self.isl_tokens.saturating_add(v.isl_tokens);
        self.uncached_prefill_tokens = self
            .uncached_prefill_tokens
            .saturating_add(v.uncached_prefill_tokens);
        if v.spill {
            self.spills += 1;
            self.true_delta_tokens = self.true_delta_tokens.saturating_add(v.true_delta_tokens);
            self.upper_bound_tokens = self.upper_bound_tokens.saturating_add(v.upper_bound_tokens);
        }
    }
}

/// Event-only figures: prefill segments seen in `BlockStored` chains.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EventOnlyWindow {
    pub segments: u64,
    /// Segments whose recomputed blocks another worker held (by ≥ min blocks).
    pub spills: u64,
    pub delta_tokens: u64,
}

/// The fork's migration log lines seen in a window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MigrationLogWindow {
    pub spill_lines: u64,
    pub spill_migratable_tokens: u64,
    pub handshakes_obtained: u64,
    pub dispatch_failures: u64,
    pub decoding_on_target: u64,
}

/// Buckets of [`SpillPairWindow::delta_buckets`]: bucket 0 holds true deltas below 16
/// tokens; bucket `i ≥ 1` those from [`spill_delta_bucket_floor`]`(i)` up to the next
/// floor, four buckets per doubling from 16 tokens (so every power of two from 16 is a
/// floor); the last bucket is open-ended (≥ 16 · 2^20 tokens).
pub const SPILL_DELTA_BUCKETS: usize = 82;

/// The smallest true delta, in tokens, of spill-delta bucket `i` (`i < SPILL_DELTA_BUCKETS`).
pub fn spill_delta_bucket_floor(i: usize) -> u64 {
    if i == 0 {
        0
    } else {
        (16.0 * 2f64.powf((i - 1) as f64 / 4.0)).round() as u64
    }
}

/// The spill-delta bucket holding `tokens`.
pub fn spill_delta_bucket(tokens: u64) -> usize {
    (1..SPILL_DELTA_BUCKETS)
        .rev()
        .find(|&i| spill_delta_bucket_floor(i) <= tokens)
        .unwrap_or(0)
}

/// Spills of one worker pair in a window: `source` is the best worker (it held the KV),
/// `target` the chosen one. Lets a cost model with per-pair figures (NIXL bandwidth and
/// handshake latency between the two) count the spills worth migrating per window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpillPairWindow {
    pub source: WorkerKey,
    pub target: WorkerKey,
    pub spills: u64,
    pub true_delta_tokens: u64,
    /// `delta_buckets[i]` = spills whose true delta falls in bucket `i` (see
    /// [`SPILL_DELTA_BUCKETS`]); trailing empty buckets are left out.
    pub delta_buckets: Vec<u64>,
}

/// A closed window's figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WindowSummary {
    pub start_ns: u64,
    pub end_ns: u64,
    /// Inside the warm-up after the first record: shown, never measured.
    pub warmup: bool,
    pub requests: u64,
    pub spills: u64,
    /// spills / requests; None for a window without requests.
    pub spill_rate: Option<f64>,
    pub isl_tokens: u64,
    pub uncached_prefill_tokens: u64,
    /// Σ true delta over spills.
    pub true_delta_tokens: u64,
    /// Σ upper bound (best overlap) over spills.
    pub upper_bound_tokens: u64,
    /// Σ of the true delta that lies in decode-generated blocks, over spills.
    #[serde(default)]
    pub generated_delta_tokens: u64,
    pub true_delta: TokenDistribution,
    pub upper_bound: TokenDistribution,
    pub true_delta_tok_per_s: f64,
    pub upper_bound_tok_per_s: f64,
    pub uncached_prefill_tok_per_s: f64,
    /// Workers that were routed at least one request.
    pub active_workers: u64,
    /// true_delta_tok_per_s / active_workers.
    pub true_delta_tok_per_s_per_worker: f64,
    pub uncached_prefill_tok_per_s_per_worker: f64,
    pub event_only: EventOnlyWindow,
    pub migration_log: MigrationLogWindow,
    /// Spills by (source, target) worker pair, sorted by pair.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spill_pairs: Vec<SpillPairWindow>,
    /// Sequence gaps, resets and events the mirror could not apply in this window: a
    /// window with any of these measured on a mirror that may be wrong.
    pub data_faults: u64,
    #[serde(with = "kvscope_wire::worker_map")]
    pub workers: BTreeMap<WorkerKey, WorkerWindow>,
    /// Per model, when discovery named the workers' models.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub models: BTreeMap<String, ModelFigures>,
}

/// A window still collecting.
#[derive(Debug)]
pub struct OpenWindow {
    pub summary: WindowSummary,
    pub true_delta: Histogram<u64>,
    pub upper_bound: Histogram<u64>,
}

impl OpenWindow {
    pub fn new(start_ns: u64, end_ns: u64, warmup: bool) -> Self {
        Self {
            summary: WindowSummary {
                start_ns,
                end_ns,
                warmup,
                ..Default::default()
            },
            true_delta: token_histogram(),
            upper_bound: token_histogram(),
        }
    }

    pub fn add_verdict(&mut self, v: &SpillVerdict) {
        let s = &mut self.summary;
        if let Some(m) = &v.model {
            s.models.entry(m.clone()).or_default().add(v);
        }
        s.requests += 1;
        // Token counts come from the wire (a decision's `isl_tokens`, its block size):
        // saturate so a crafted record cannot overflow a window's sums.
        s.isl_tokens = s.isl_tokens.saturating_add(v.isl_tokens);
        s.uncached_prefill_tokens = s
            .uncached_prefill_tokens
            .saturating_add(v.uncached_prefill_tokens);
        let chosen = s.workers.entry(v.chosen).or_default();
        chosen.requests += 1;
        chosen.uncached_prefill_tokens = chosen
            .uncached_prefill_tokens
            .saturating_add(v.uncached_prefill_tokens);
        if v.spill {
            chosen.spills_in += 1;
            chosen.true_delta_tokens_in = chosen
                .true_delta_tokens_in
                .saturating_add(v.true_delta_tokens);
            s.workers.entry(v.best).or_default().spills_out += 1;
            s.spills += 1;
            s.true_delta_tokens = s.true_delta_tokens.saturating_add(v.true_delta_tokens);
            s.upper_bound_tokens = s.upper_bound_tokens.saturating_add(v.upper_bound_tokens);
            s.generated_delta_tokens = s
                .generated_delta_tokens
                .saturating_add(v.generated_delta_tokens);
            let pair = match s
                .spill_pairs
                .binary_search_by_key(&(v.best, v.chosen), |p| (p.source, p.target))
            {
                Ok(i) => &mut s.spill_pairs[i],
                Err(i) => {
                    s.spill_pairs.insert(
                        i,
                        SpillPairWindow {
                            source: v.best,
                            target: v.chosen,
                            spills: 0,
                            true_delta_tokens: 0,
                            delta_buckets: Vec::new(),
                        },
                    );
                    &mut s.spill_pairs[i]
                }
            };
            pair.spills += 1;
            pair.true_delta_tokens = pair.true_delta_tokens.saturating_add(v.true_delta_tokens);
            let b = spill_delta_bucket(v.true_delta_tokens);
            if pair.delta_buckets.len() <= b {
                pair.delta_buckets.resize(b + 1, 0);
            }
            pair.delta_buckets[b] += 1;
            // Values are ≥ one block, far inside the bounds; a failed record would only
            // mean a corrupt histogram, which we'd rather skip than stop on.
            let _ = self.true_delta.record(v.true_delta_tokens.max(1));
            let _ = self.upper_bound.record(v.upper_bound_tokens.max(1));
        }
    }

    /// Close the window: derive rates and percentiles.
    pub fn close(mut self, index: &FleetIndex) -> ClosedWindow {
        let s = &mut self.summary;
        for w in index.workers() {
            s.workers.entry(w).or_default().cached_blocks = index.cached_blocks(&w) as u64;
        }
        let secs = (s.end_ns - s.start_ns) as f64 / 1e9;
        s.spill_rate = (s.requests > 0).then(|| s.spills as f64 / s.requests as f64);
        s.true_delta = TokenDistribution::of(&self.true_delta);
        s.upper_bound = TokenDistribution::of(&self.upper_bound);
        s.true_delta_tok_per_s = s.true_delta_tokens as f64 / secs;
        s.upper_bound_tok_per_s = s.upper_bound_tokens as f64 / secs;
        s.uncached_prefill_tok_per_s = s.uncached_prefill_tokens as f64 / secs;
        s.active_workers = s.workers.values().filter(|w| w.requests > 0).count() as u64;
        if s.active_workers > 0 {
            s.true_delta_tok_per_s_per_worker = s.true_delta_tok_per_s / s.active_workers as f64;
            s.uncached_prefill_tok_per_s_per_worker =
                s.uncached_prefill_tok_per_s / s.active_workers as f64;
        }
        ClosedWindow {
            summary: self.summary,
            true_delta: self.true_delta,
            upper_bound: self.upper_bound,
        }
    }
}

/// A closed window, with its histograms kept so reports can merge them.
#[derive(Debug, Clone)]
pub struct ClosedWindow {
    pub summary: WindowSummary,
    pub true_delta: Histogram<u64>,
    pub upper_bound: Histogram<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spill_delta_buckets_are_increasing_and_powers_of_two_are_floors() {
        for i in 1..SPILL_DELTA_BUCKETS {
            assert!(spill_delta_bucket_floor(i) > spill_delta_bucket_floor(i - 1));
            assert_eq!(spill_delta_bucket(spill_delta_bucket_floor(i)), i);
            assert_eq!(spill_delta_bucket(spill_delta_bucket_floor(i) - 1), i - 1);
        }
        assert_eq!(spill_delta_bucket_floor(41), 16384);
        assert_eq!(spill_delta_bucket(0), 0);
        assert_eq!(spill_delta_bucket(15), 0);
        assert_eq!(spill_delta_bucket(u64::MAX), SPILL_DELTA_BUCKETS - 1);
    }

    #[test]
    fn spills_are_kept_per_worker_pair_with_their_deltas_bucketed() {
        let w = |id| WorkerKey {
            worker_id: id,
            dp_rank: 0,
        };
        let verdict = |best, chosen, delta: u64, spill| SpillVerdict {
            model: None,
            incomplete_mirror: false,
            after_own_prefill: false,
            clock_behind_ms: None,
            trace: None,
            judged_before_event: false,
            request_id: "r".into(),
            decided_ns: 1,
            chosen: w(chosen),
            chosen_overlap_blocks: 0,
            best: w(best),
            best_overlap_blocks: (delta / 16) as u32,
            block_size: 16,
            isl_tokens: delta,
            spill,
            upper_bound_tokens: delta,
            true_delta_tokens: delta,
            generated_delta_tokens: 0,
            uncached_prefill_tokens: delta,
            overlaps: BTreeMap::new(),
            available_ns: None,
            delta_block_hashes: Vec::new(),
            delta_parent_hash: None,
            nixl: None,
        };
        let mut open = OpenWindow::new(0, 1_000_000_000, false);
        open.add_verdict(&verdict(2, 1, 16384, true));
        open.add_verdict(&verdict(1, 3, 32, true));
        open.add_verdict(&verdict(2, 1, 16400, true));
        open.add_verdict(&verdict(2, 1, 64, false));
        let s = open.close(&FleetIndex::new()).summary;
        assert_eq!(s.spill_pairs.len(), 2);
        assert_eq!(
            (s.spill_pairs[0].source, s.spill_pairs[0].target),
            (w(1), w(3))
        );
        let p = &s.spill_pairs[1];
        assert_eq!((p.source, p.target, p.spills), (w(2), w(1), 2));
        assert_eq!(p.true_delta_tokens, 32784);
        assert_eq!(p.delta_buckets.len(), 42);
        assert_eq!(p.delta_buckets[41], 2);
        assert_eq!(p.delta_buckets.iter().sum::<u64>(), 2);
    }
}
