//! The policy's thresholds: when to go LIVE and when to fall back to DRY (the
//! actuator's `[policy]` table).

use kvscope_wire::api::window::WindowSummary;
use kvscope_wire::cost::CostParams;
use kvscope_wire::WorkerKey;
use serde::{Deserialize, Serialize};

/// When to go LIVE and when to fall back to DRY. Every field has a default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Consecutive complete post-warm-up windows that must all qualify before LIVE
    /// (default 6). Env: `KVSCOPE_ACTUATOR_MIN_WINDOWS`.
    pub min_windows: usize,
    /// True-delta migratable volume a window needs, tokens/s (default 1000).
    pub min_true_delta_tok_per_s: f64,
    /// Share of the gated spills (true delta ≥ `min_tokens`) whose predicted net benefit
    /// is positive, per window (default 0.5). A lower bound: spills whose delta bucket
    /// straddles the break-even count as not beneficial.
    pub min_beneficial_share: f64,
    /// Gated spills a window needs (default 1).
    pub min_candidate_spills: u64,
    /// Smallest true delta worth migrating, tokens, like the fork's
    /// `DYN_KV_MIGRATION_MIN_TOKENS` (default 16384). Env: `KVSCOPE_ACTUATOR_MIN_TOKENS`.
    pub min_tokens: u64,
    /// KV cache bytes per token of the served model (default 131072: an 8B model in
    /// fp16, 32 layers × 8 KV heads × 128 dims × K and V). Set it for your model.
    /// Env: `KVSCOPE_ACTUATOR_KV_BYTES_PER_TOKEN`.
    pub kv_bytes_per_token: u64,
    /// Prefill rate of one worker, tokens/s (default 10000). Set it for your model and
    /// hardware. Env: `KVSCOPE_ACTUATOR_PREFILL_TOK_PER_S`.
    pub prefill_tok_per_s: f64,
    /// Raise the prefill rate to what a target worker was measured computing in the
    /// window (its uncached prefill tokens / window seconds) when that is higher: a
    /// proven lower bound of its speed (default true). Only ever makes recomputing look
    /// cheaper, never migrating.
    pub use_measured_prefill: bool,
    /// Fixed cost of dispatching one migration, milliseconds (default 5).
    pub dispatch_overhead_ms: f64,
    /// Quantile of the measured handshake latency charged to each migration (default 0.9).
    pub handshake_quantile: f64,
    /// NIXL handshakes that must have been observed to call the path proven, and the
    /// fewest recent ones whose failure ratio can drop LIVE (default 3).
    pub min_handshakes: u64,
    /// Handshake success ratio the NIXL path needs (default 0.95).
    pub min_handshake_success_ratio: f64,
    /// `KVMIGRATE_SPILL` lines in a window since LIVE that, with zero "producer handshake
    /// obtained", mean the fork's silent failure (default 3).
    pub silent_failure_min_spill_lines: u64,
    /// Seconds the backends need to make a mode effective (a rolling restart): windows
    /// mostly within this time after going LIVE are not checked for the silent failure
    /// (default 0).
    pub apply_grace_secs: f64,
    /// Dispatch failures tolerated per window as a share of attempts (default 0.05) …
    pub dispatch_failure_ratio: f64,
    /// … but never fewer than this many (default 2).
    pub dispatch_failure_allowance: u64,
    /// The collector's watermark (latest record time) older than this, in seconds, is
    /// stale data (default 60).
    pub max_data_age_secs: f64,
    /// An agent silent this long, in seconds, is lost (default 30).
    pub max_agent_silence_secs: f64,
    /// Agents that must be alive (default empty: every agent the collector has heard
    /// from). Env: `KVSCOPE_ACTUATOR_EXPECTED_AGENTS`.
    pub expected_agents: Vec<String>,
    /// LIVE holds while windows reach this fraction of the entry thresholds (default 0.8).
    pub hysteresis: f64,
    /// Consecutive windows below the hysteresis thresholds that end LIVE (default 2).
    pub exit_windows: usize,
    /// Seconds after a flip before going LIVE again, and the least time LIVE lasts
    /// unless a safety trigger fires (default 300).
    pub cooldown_secs: f64,
    /// Automatic flips in any rolling hour, at most (default 6, at least 2). Going LIVE
    /// needs room for itself and its exit; drops to DRY are never blocked.
    pub max_flips_per_hour: usize,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            min_windows: 6,
            min_true_delta_tok_per_s: 1000.0,
            min_beneficial_share: 0.5,
            min_candidate_spills: 1,
            min_tokens: 16384,
            kv_bytes_per_token: 131_072,
            prefill_tok_per_s: 10_000.0,
            use_measured_prefill: true,
            dispatch_overhead_ms: 5.0,
            handshake_quantile: 0.9,
            min_handshakes: 3,
            min_handshake_success_ratio: 0.95,
            silent_failure_min_spill_lines: 3,
            apply_grace_secs: 0.0,
            dispatch_failure_ratio: 0.05,
            dispatch_failure_allowance: 2,
            max_data_age_secs: 60.0,
            max_agent_silence_secs: 30.0,
            expected_agents: Vec::new(),
            hysteresis: 0.8,
            exit_windows: 2,
            cooldown_secs: 300.0,
            max_flips_per_hour: 6,
        }
    }
}

impl PolicyConfig {
    pub fn validate(&self) -> Result<(), String> {
        let ratio = |name: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(format!("policy.{name} must be within 0..=1 (is {v})"))
            }
        };
        let non_negative = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!("policy.{name} must be >= 0 (is {v})"))
            }
        };
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("policy.{name} must be > 0 (is {v})"))
            }
        };
        if self.min_windows == 0 || self.exit_windows == 0 {
            return Err("policy.min_windows and policy.exit_windows must be >= 1".into());
        }
        if self.max_flips_per_hour < 2 {
            return Err(
                "policy.max_flips_per_hour must be >= 2 (going LIVE needs room for its exit)"
                    .into(),
            );
        }
        if self.kv_bytes_per_token == 0 {
            return Err("policy.kv_bytes_per_token must be > 0".into());
        }
        ratio("min_beneficial_share", self.min_beneficial_share)?;
        ratio(
            "min_handshake_success_ratio",
            self.min_handshake_success_ratio,
        )?;
        ratio("dispatch_failure_ratio", self.dispatch_failure_ratio)?;
        ratio("handshake_quantile", self.handshake_quantile)?;
        ratio("hysteresis", self.hysteresis)?;
        non_negative("min_true_delta_tok_per_s", self.min_true_delta_tok_per_s)?;
        non_negative("dispatch_overhead_ms", self.dispatch_overhead_ms)?;
        non_negative("cooldown_secs", self.cooldown_secs)?;
        non_negative("apply_grace_secs", self.apply_grace_secs)?;
        positive("prefill_tok_per_s", self.prefill_tok_per_s)?;
        positive("max_data_age_secs", self.max_data_age_secs)?;
        positive("max_agent_silence_secs", self.max_agent_silence_secs)?;
        Ok(())
    }

    pub(crate) fn cost_params(&self) -> CostParams {
        CostParams {
            kv_bytes_per_token: self.kv_bytes_per_token,
            prefill_tok_per_s: self.prefill_tok_per_s,
            dispatch_overhead_s: self.dispatch_overhead_ms / 1000.0,
            handshake_quantile: self.handshake_quantile,
        }
    }

    /// Dispatch failures tolerated out of `attempts`.
    pub(crate) fn dispatch_budget(&self, attempts: u64) -> u64 {
        self.dispatch_failure_allowance
            .max((self.dispatch_failure_ratio * attempts as f64).ceil() as u64)
    }

    /// The prefill rate charged for recomputing on `target` in window `w`.
    pub(crate) fn prefill_rate(&self, w: &WindowSummary, target: &WorkerKey) -> f64 {
        let secs = (w.end_ns.saturating_sub(w.start_ns)) as f64 / 1e9;
        let measured = match (self.use_measured_prefill, w.workers.get(target)) {
            (true, Some(t)) if secs > 0.0 => t.uncached_prefill_tokens as f64 / secs,
            _ => 0.0,
        };
        self.prefill_tok_per_s.max(measured)
    }
}
