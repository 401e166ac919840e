//! Measurement windows as the collector serves them (`/api/windows`, the summary's open
//! window, the report): fixed-length slices of record time with the spill figures of the
//! requests decided in them.

use crate::api::verdict::SpillVerdict;
use crate::WorkerKey;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Distribution summary of a token count.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenDistribution {
    pub count: u64,
    pub p50: u64,
    pub p90: u64,
    pub max: u64,
    pub mean: f64,
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
    /// Add another's figures (sums saturate).
    pub fn merge(&mut self, o: &ModelFigures) {
        self.requests += o.requests;
        self.spills += o.spills;
        self.isl_tokens = self.isl_tokens.saturating_add(o.isl_tokens);
        self.uncached_prefill_tokens = self
            .uncached_prefill_tokens
            .saturating_add(o.uncached_prefill_tokens);
        self.true_delta_tokens = self.true_delta_tokens.saturating_add(o.true_delta_tokens);
        self.upper_bound_tokens = self.upper_bound_tokens.saturating_add(o.upper_bound_tokens);
    }

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

/// Spills and true delta per tenant (`/api/tenants`): a request's tenant is the cache
/// salt its first block was stored under (an engine's `cache_salt`, or the salt Dynamo
/// tags for vLLM), known once any worker stored that block with its salt — always for a
/// spill (the best worker holds the first block). The three parts sum to the fleet's
/// figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TenantFigures {
    /// Per salt, the first [`TenantFigures::MAX_TENANTS`] salts seen.
    pub tenants: BTreeMap<String, ModelFigures>,
    /// Requests with no salt known: an unsalted fleet's every request, a tenant's
    /// request before any worker stored its first block (cold, so never a spill).
    pub unsalted: ModelFigures,
    /// Requests of tenants past the bound.
    pub other_tenants: ModelFigures,
    /// The tenants the metrics name apart (the first [`TenantFigures::METRIC_TENANTS`]
    /// with a spill; never changed after, so every series stays a counter).
    pub metric_tenants: Vec<String>,
}

impl TenantFigures {
    /// The most tenants kept apart (the rest are `other_tenants`).
    pub const MAX_TENANTS: usize = 10_000;
    /// The most tenants the metrics name apart (the rest are one `other` series).
    pub const METRIC_TENANTS: usize = 10;

    /// Count one verdict under its tenant.
    pub fn add(&mut self, v: &SpillVerdict) {
        if let Some(t) = v.tenant.as_deref().filter(|_| v.spill) {
            if self.metric_tenants.len() < Self::METRIC_TENANTS
                && !self.metric_tenants.iter().any(|m| m == t)
            {
                self.metric_tenants.push(t.to_string());
            }
        }
        let figures = match v.tenant.as_deref() {
            None => &mut self.unsalted,
            Some(t) => {
                if !self.tenants.contains_key(t) && self.tenants.len() >= Self::MAX_TENANTS {
                    &mut self.other_tenants
                } else {
                    self.tenants.entry(t.to_string()).or_default()
                }
            }
        };
        figures.add(v);
    }

    /// The figures of every salted tenant but those `named` (the ones past the bound
    /// included): the `other` row of a table or metric that names those apart.
    pub fn all_but<S: AsRef<str>>(&self, named: &[S]) -> ModelFigures {
        let mut sum = self.other_tenants.clone();
        for (t, f) in &self.tenants {
            if !named.iter().any(|n| n.as_ref() == t) {
                sum.merge(f);
            }
        }
        sum
    }

    /// The `n` tenants with the most spills (then the most requests, then by name).
    pub fn top(&self, n: usize) -> Vec<(&str, &ModelFigures)> {
        let mut all: Vec<(&str, &ModelFigures)> =
            self.tenants.iter().map(|(t, f)| (t.as_str(), f)).collect();
        all.sort_by(|a, b| {
            (b.1.spills, b.1.requests)
                .cmp(&(a.1.spills, a.1.requests))
                .then(a.0.cmp(b.0))
        });
        all.truncate(n);
        all
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
    /// Σ of the true delta the chosen worker held in its lower tiers (host, disk), over
    /// spills: onloaded rather than recomputed.
    #[serde(default)]
    pub onload_delta_tokens: u64,
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
    #[serde(with = "crate::worker_map")]
    pub workers: BTreeMap<WorkerKey, WorkerWindow>,
    /// Per model, when discovery named the workers' models.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub models: BTreeMap<String, ModelFigures>,
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
}
