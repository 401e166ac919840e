//! Measurement windows: fixed-length slices of record time with the spill figures of the
//! requests decided in them.

use crate::fleet_index::FleetIndex;
use hdrhistogram::Histogram;
use kvscope_wire::api::verdict::SpillVerdict;
use kvscope_wire::api::window::{
    spill_delta_bucket, SpillPairWindow, TokenDistribution, WindowSummary,
};
use serde::{Deserialize, Serialize};

/// Mean and spread of one figure across the measured windows.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
    pub stddev: f64,
    /// Windows the figure was defined in.
    pub windows: usize,
}

impl Spread {
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let v: Vec<f64> = values.into_iter().collect();
        if v.is_empty() {
            return Self::default();
        }
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        Self {
            mean,
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            stddev: var.sqrt(),
            windows: v.len(),
        }
    }
}

/// Token counts up to 2^40 at 3 significant digits.
pub fn token_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 1 << 40, 3).expect("static histogram bounds are valid")
}

/// Distribution summary of a histogram of token counts.
pub fn token_distribution(h: &Histogram<u64>) -> TokenDistribution {
    if h.is_empty() {
        return TokenDistribution::default();
    }
    TokenDistribution {
        count: h.len(),
        p50: h.value_at_quantile(0.5),
        p90: h.value_at_quantile(0.9),
        max: h.max(),
        mean: h.mean(),
    }
}

/// A window still collecting.
#[derive(Debug)]
pub(crate) struct OpenWindow {
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

    pub(crate) fn add_verdict(&mut self, v: &SpillVerdict) {
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
            s.onload_delta_tokens = s.onload_delta_tokens.saturating_add(v.onload_delta_tokens);
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
        s.true_delta = token_distribution(&self.true_delta);
        s.upper_bound = token_distribution(&self.upper_bound);
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
            true_delta: RecordedTokens::of(&self.true_delta),
            upper_bound: RecordedTokens::of(&self.upper_bound),
        }
    }
}

/// A closed window's histogram kept as the values it recorded (one entry per bucket
/// used, the bucket's highest value and its count). A whole histogram's counts take
/// 254 KB whatever was recorded, and a day of windows is kept (`keep_windows`, 5,760):
/// 2.9 GB a day in two histograms per window, where most windows record a few spills.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordedTokens(Box<[(u64, u64)]>);

impl RecordedTokens {
    pub fn of(h: &Histogram<u64>) -> Self {
        Self(
            h.iter_recorded()
                .map(|v| (v.value_iterated_to(), v.count_at_value()))
                .collect(),
        )
    }

    /// Add these values to `h`, a histogram of [`token_histogram`]'s bounds: each lands
    /// in the bucket it came from.
    pub fn add_to(&self, h: &mut Histogram<u64>) {
        for &(value, count) in self.0.iter() {
            // Within the bounds they were recorded in.
            let _ = h.record_n(value, count);
        }
    }
}

/// A closed window, with its histograms kept so reports can merge them.
#[derive(Debug, Clone)]
pub struct ClosedWindow {
    pub summary: WindowSummary,
    pub true_delta: RecordedTokens,
    pub upper_bound: RecordedTokens,
}

#[cfg(test)]
mod tests {
    use super::*;

    use kvscope_wire::WorkerKey;
    use std::collections::BTreeMap;

    #[test]
    fn a_closed_window_s_values_merge_as_its_histogram_did() {
        let mut h = token_histogram();
        for v in [
            1,
            16,
            17,
            1_000,
            1_001,
            4_096,
            65_537,
            131_072,
            1 << 30,
            1 << 40,
        ] {
            h.record_n(v, v % 7 + 1).unwrap();
        }
        let kept = RecordedTokens::of(&h);
        assert!(kept.0.len() <= 10);
        let (mut direct, mut merged) = (token_histogram(), token_histogram());
        direct.add(&h).unwrap();
        direct.add(&h).unwrap();
        kept.add_to(&mut merged);
        kept.add_to(&mut merged);
        assert_eq!(merged, direct);
        for q in [0.0, 0.5, 0.9, 0.99, 1.0] {
            assert_eq!(merged.value_at_quantile(q), direct.value_at_quantile(q));
        }
        assert_eq!(
            RecordedTokens::of(&token_histogram()),
            RecordedTokens::default()
        );
    }

    #[test]
    fn spills_are_kept_per_worker_pair_with_their_deltas_bucketed() {
        let w = |id| WorkerKey {
            worker_id: id,
            dp_rank: 0,
        };
        let verdict = |best, chosen, delta: u64, spill| SpillVerdict {
            tenant: None,
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
            router_overlap_blocks: None,
            chosen_lower_tiers: Default::default(),
            best_lower_tiers: Default::default(),
            onload_delta_tokens: 0,
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
