//! Migration directives: in LIVE, one per spill that passes the gate (true delta ≥
//! `min_tokens` and a positive predicted net benefit), idempotent (the key is derived
//! from the verdict), rate-limited, with outcomes tracked. Selection, keys, the rate
//! limiter and the ledger are pure; sending is in [`crate::act::sink`].

use crate::decide::policy::{DirectiveStats, PolicyConfig};
use kvscope_wire::api::verdict::SpillVerdict;
use kvscope_wire::api::window::WindowSummary;
use kvscope_wire::cost::{self, NixlFigures};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};

pub use kvscope_wire::directive::{BlockRange, MigrationDirective};

/// The idempotency key of the directive for `v`: xxh3 over the request, the decision
/// time, the pair and the block range.
pub fn idempotency_key(v: &SpillVerdict) -> String {
    let text = format!(
        "{}\u{1f}{}\u{1f}{}\u{1f}{}\u{1f}{}\u{1f}{}",
        v.request_id,
        v.decided_ns,
        v.best,
        v.chosen,
        v.chosen_overlap_blocks,
        v.best_overlap_blocks
    );
    format!("kvm-{:016x}", xxhash_rust::xxh3::xxh3_64(text.as_bytes()))
}

/// Why a spill got no directive.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    pub below_min_tokens: u64,
    pub no_benefit: u64,
    /// No NIXL bandwidth or handshake figure to price it with.
    pub unscorable: u64,
    /// Decided longer ago than `directives.max_age_secs`.
    pub too_old: u64,
    /// Issued already (same idempotency key).
    pub duplicate: u64,
}

/// Pick the directives for the verdicts decided after `after_ns` (newest-first input),
/// oldest first. `latest` (the newest closed window) gives the measured prefill rate.
#[allow(clippy::too_many_arguments)]
pub fn select(
    policy: &PolicyConfig,
    nixl: &NixlFigures<'_>,
    latest: Option<&WindowSummary>,
    verdicts: &[SpillVerdict],
    after_ns: u64,
    now_ns: u64,
    max_age_ns: u64,
    ledger: &DirectiveLedger,
) -> (Vec<MigrationDirective>, Skipped) {
    let params = policy.cost_params();
    let mut skipped = Skipped::default();
    let mut out = Vec::new();
    for v in verdicts.iter().rev() {
        if !v.spill || v.decided_ns <= after_ns {
            continue;
        }
        if v.true_delta_tokens < policy.min_tokens {
            skipped.below_min_tokens += 1;
            continue;
        }
        if now_ns.saturating_sub(v.decided_ns) > max_age_ns {
            skipped.too_old += 1;
            continue;
        }
        let key = idempotency_key(v);
        if ledger.contains(&key) {
            skipped.duplicate += 1;
            continue;
        }
        let path = nixl.path(&v.best, &v.chosen);
        let prefill = latest.map_or(policy.prefill_tok_per_s, |w| {
            policy.prefill_rate(w, &v.chosen)
        });
        let Some(predicted) = cost::predict(&params, v.true_delta_tokens, &path, prefill) else {
            skipped.unscorable += 1;
            continue;
        };
        if predicted.net_benefit_s <= 0.0 {
            skipped.no_benefit += 1;
            continue;
        }
        out.push(MigrationDirective {
            idempotency_key: key,
            request_id: v.request_id.clone(),
            session_id: None,
            source: v.best,
            target: v.chosen,
            source_nixl_agent: nixl.agent_of(&v.best).map(str::to_string),
            target_nixl_agent: nixl.agent_of(&v.chosen).map(str::to_string),
            blocks: BlockRange {
                first: v.chosen_overlap_blocks,
                count: v.best_overlap_blocks - v.chosen_overlap_blocks,
                block_size: v.block_size,
            },
            block_hashes: v.delta_block_hashes.clone(),
            parent_block_hash: v.delta_parent_hash,
            tokens: v.true_delta_tokens,
            decided_ns: v.decided_ns,
            issued_ns: now_ns,
            predicted,
        });
    }
    (out, skipped)
}

/// What became of a directive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum DirectiveOutcome {
    /// 2xx: the receiver took it.
    Accepted { status: u16, attempts: u32 },
    /// 409: the receiver already had it (idempotent repeat): counted as accepted.
    Duplicate { attempts: u32 },
    /// Another 4xx: the receiver refused it; not retried.
    Rejected {
        status: u16,
        attempts: u32,
        body: String,
    },
    /// Transport errors, 5xx or 429 until the retries ran out.
    Failed { attempts: u32, error: String },
    /// Not sent: the actuator left LIVE before it went out.
    Abandoned,
    /// Not sent: over the rate limit or the in-flight cap.
    RateLimited,
}

impl DirectiveOutcome {
    pub fn name(&self) -> &'static str {
        match self {
            DirectiveOutcome::Accepted { .. } => "accepted",
            DirectiveOutcome::Duplicate { .. } => "duplicate",
            DirectiveOutcome::Rejected { .. } => "rejected",
            DirectiveOutcome::Failed { .. } => "failed",
            DirectiveOutcome::Abandoned => "abandoned",
            DirectiveOutcome::RateLimited => "rate_limited",
        }
    }
}

/// Totals of every outcome since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectiveTotals {
    pub issued: u64,
    pub accepted: u64,
    pub duplicate: u64,
    pub rejected: u64,
    pub failed: u64,
    pub abandoned: u64,
    pub rate_limited: u64,
    pub in_flight: u64,
}

/// Every directive issued (by key, bounded) and recent outcomes, for idempotency, the
/// failure budget and the status.
#[derive(Debug, Clone)]
pub struct DirectiveLedger {
    keys: HashMap<String, Option<DirectiveOutcome>>,
    order: VecDeque<String>,
    capacity: usize,
    /// (time, outcome) of recent completions, for [`Self::stats`].
    recent: VecDeque<(u64, DirectiveOutcome)>,
    totals: DirectiveTotals,
    /// Decision time of the newest verdict considered.
    pub cursor_ns: u64,
}

impl DirectiveLedger {
    pub fn new(capacity: usize) -> Self {
        Self {
            keys: HashMap::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
            recent: VecDeque::new(),
            totals: DirectiveTotals::default(),
            cursor_ns: 0,
        }
    }

    pub fn contains(&self, key: &str) -> bool {
        self.keys.contains_key(key)
    }

    /// Remember a directive as issued (in flight). False if the key was known.
    pub fn issue(&mut self, key: &str) -> bool {
        if self.keys.contains_key(key) {
            return false;
        }
        self.keys.insert(key.to_string(), None);
        self.order.push_back(key.to_string());
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.keys.remove(&old);
            }
        }
        self.totals.issued += 1;
        self.totals.in_flight += 1;
        true
    }

    /// Record what became of an issued directive.
    pub fn complete(&mut self, key: &str, outcome: DirectiveOutcome, now_ns: u64) {
        if let Some(slot) = self.keys.get_mut(key) {
            if slot.is_none() {
                self.totals.in_flight = self.totals.in_flight.saturating_sub(1);
            }
            *slot = Some(outcome.clone());
        }
        let t = &mut self.totals;
        match &outcome {
            DirectiveOutcome::Accepted { .. } => t.accepted += 1,
            DirectiveOutcome::Duplicate { .. } => t.duplicate += 1,
            DirectiveOutcome::Rejected { .. } => t.rejected += 1,
            DirectiveOutcome::Failed { .. } => t.failed += 1,
            DirectiveOutcome::Abandoned => t.abandoned += 1,
            DirectiveOutcome::RateLimited => t.rate_limited += 1,
        }
        self.recent.push_back((now_ns, outcome));
        while self.recent.len() > 100_000 {
            self.recent.pop_front();
        }
    }

    pub fn outcome(&self, key: &str) -> Option<&DirectiveOutcome> {
        self.keys.get(key).and_then(Option::as_ref)
    }

    pub fn totals(&self) -> DirectiveTotals {
        self.totals
    }

    /// Outcomes completed within `span_ns` before `now_ns` (sent = every attempted one).
    pub fn stats(&mut self, now_ns: u64, span_ns: u64) -> DirectiveStats {
        while self
            .recent
            .front()
            .is_some_and(|(t, _)| now_ns.saturating_sub(*t) > span_ns.max(1) * 4)
        {
            self.recent.pop_front();
        }
        let mut s = DirectiveStats::default();
        for (_, o) in self
            .recent
            .iter()
            .filter(|(t, _)| now_ns.saturating_sub(*t) <= span_ns)
        {
            match o {
                DirectiveOutcome::Accepted { .. } | DirectiveOutcome::Duplicate { .. } => {
                    s.sent += 1;
                    s.accepted += 1;
                }
                DirectiveOutcome::Rejected { .. } => {
                    s.sent += 1;
                    s.rejected += 1;
                }
                DirectiveOutcome::Failed { .. } => {
                    s.sent += 1;
                    s.failed += 1;
                }
                DirectiveOutcome::Abandoned | DirectiveOutcome::RateLimited => {}
            }
        }
        s
    }
}

/// A token bucket on a caller-given clock (seconds).
#[derive(Debug, Clone)]
pub(crate) struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Option<f64>,
}

impl TokenBucket {
    pub fn new(rate_per_s: f64, burst: u32) -> Self {
        Self {
            rate: rate_per_s,
            burst: f64::from(burst.max(1)),
            tokens: f64::from(burst.max(1)),
            last: None,
        }
    }

    /// Take one token at time `now_s`, if there is one.
    pub(crate) fn try_take(&mut self, now_s: f64) -> bool {
        if let Some(last) = self.last {
            self.tokens = (self.tokens + (now_s - last).max(0.0) * self.rate).min(self.burst);
        }
        self.last = Some(now_s);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::nixl::{MergedLatency, NixlPair};
    use kvscope_wire::WorkerKey;
    use std::collections::BTreeMap;

    const S: u64 = 1_000_000_000;

    fn w(id: u64) -> WorkerKey {
        WorkerKey {
            worker_id: id,
            dp_rank: 0,
        }
    }

    fn verdict(id: &str, t: u64, chosen_blocks: u32, best_blocks: u32) -> SpillVerdict {
        SpillVerdict {
            tenant: None,
            model: None,
            incomplete_mirror: false,
            after_own_prefill: false,
            clock_behind_ms: None,
            trace: None,
            judged_before_event: false,
            request_id: id.into(),
            decided_ns: t,
            chosen: w(2),
            chosen_overlap_blocks: chosen_blocks,
            best: w(1),
            best_overlap_blocks: best_blocks,
            block_size: 16,
            isl_tokens: u64::from(best_blocks) * 16 + 100,
            spill: best_blocks > chosen_blocks,
            upper_bound_tokens: u64::from(best_blocks) * 16,
            true_delta_tokens: u64::from(best_blocks - chosen_blocks) * 16,
            generated_delta_tokens: 0,
            uncached_prefill_tokens: 100,
            overlaps: BTreeMap::new(),
            available_ns: None,
            delta_block_hashes: Vec::new(),
            delta_parent_hash: None,
            nixl: None,
            router_overlap_blocks: None,
            chosen_lower_tiers: Default::default(),
            best_lower_tiers: Default::default(),
            onload_delta_tokens: 0,
        }
    }

    fn nixl_pairs() -> Vec<NixlPair> {
        vec![NixlPair {
            local_agent: "b".into(),
            remote_agent: "a".into(),
            bytes_ok: 1 << 30,
            latency: MergedLatency {
                count: 1,
                sum_ns: S / 4,
                max_ns: S / 4,
                buckets: vec![],
            },
            bandwidth_bytes_per_second: Some(4.0 * (1u64 << 30) as f64),
            handshakes_ok: 5,
            handshake_latency: MergedLatency {
                count: 5,
                sum_ns: 5_000_000,
                max_ns: 1_000_000,
                buckets: vec![0; 22],
            },
            ..NixlPair::default()
        }]
    }

    #[test]
    fn keys_are_stable_per_spill_and_differ_between_spills() {
        let a = verdict("r1", 10, 2, 2000);
        assert_eq!(idempotency_key(&a), idempotency_key(&a.clone()));
        assert_ne!(
            idempotency_key(&a),
            idempotency_key(&verdict("r1", 11, 2, 2000))
        );
        assert_ne!(
            idempotency_key(&a),
            idempotency_key(&verdict("r2", 10, 2, 2000))
        );
        assert!(idempotency_key(&a).starts_with("kvm-"));
    }

    #[test]
    fn only_fresh_new_beneficial_spills_above_the_gate_get_directives() {
        let policy = PolicyConfig::default();
        let pairs = nixl_pairs();
        let mapping = vec!["1=a".parse().unwrap(), "2=b".parse().unwrap()];
        let nixl = NixlFigures::new(&pairs, &mapping, 0.9);
        let now = 100 * S;
        let mut ledger = DirectiveLedger::new(10);
        let verdicts = vec![
            SpillVerdict {
                tenant: None,
                delta_block_hashes: vec![11, 12],
                delta_parent_hash: Some(10),
                ..verdict("new-big", now - S, 10, 2010) // 32000 tokens: yes
            },
            verdict("small", now - S, 10, 20), // 160 tokens: below the gate
            verdict("old", now - 60 * S, 0, 2000), // too old
            verdict("seen-cursor", 5 * S, 0, 2000), // before the cursor
        ];
        ledger.cursor_ns = 10 * S;
        let (d, skipped) = select(
            &policy,
            &nixl,
            None,
            &verdicts,
            ledger.cursor_ns,
            now,
            10 * S,
            &ledger,
        );
        assert_eq!(d.len(), 1, "{skipped:?}");
        let d0 = &d[0];
        assert_eq!(d0.request_id, "new-big");
        assert_eq!((d0.source, d0.target), (w(1), w(2)));
        assert_eq!(
            d0.blocks,
            BlockRange {
                first: 10,
                count: 2000,
                block_size: 16
            }
        );
        assert_eq!(d0.source_nixl_agent.as_deref(), Some("a"));
        assert_eq!(
            (d0.block_hashes.as_slice(), d0.parent_block_hash),
            (&[11, 12][..], Some(10)),
            "the verdict's delta hashes travel with the directive"
        );
        assert!(d0.predicted.net_benefit_s > 0.0);
        assert_eq!((skipped.below_min_tokens, skipped.too_old), (1, 1));
        // Issued once, never again.
        assert!(ledger.issue(&d0.idempotency_key));
        assert!(!ledger.issue(&d0.idempotency_key));
        let (again, skipped) = select(
            &policy,
            &nixl,
            None,
            &verdicts,
            ledger.cursor_ns,
            now,
            10 * S,
            &ledger,
        );
        assert!(again.is_empty());
        assert_eq!(skipped.duplicate, 1);
        // Without NIXL figures nothing can be priced: no directive.
        let none = NixlFigures::new(&[], &[], 0.9);
        let (d, skipped) = select(
            &policy,
            &none,
            None,
            &verdicts,
            ledger.cursor_ns,
            now,
            10 * S,
            &DirectiveLedger::new(1),
        );
        assert!(d.is_empty());
        assert_eq!(skipped.unscorable, 1);
    }

    #[test]
    fn the_ledger_counts_outcomes_in_the_recent_span() {
        let mut l = DirectiveLedger::new(2);
        for k in ["a", "b", "c"] {
            assert!(l.issue(k));
        }
        assert!(!l.contains("a"), "bounded: the oldest key is forgotten");
        l.complete(
            "b",
            DirectiveOutcome::Accepted {
                status: 202,
                attempts: 1,
            },
            10 * S,
        );
        l.complete(
            "c",
            DirectiveOutcome::Failed {
                attempts: 3,
                error: "x".into(),
            },
            20 * S,
        );
        l.complete("d", DirectiveOutcome::RateLimited, 20 * S);
        assert_eq!(
            l.stats(21 * S, 5 * S),
            DirectiveStats {
                sent: 1,
                accepted: 0,
                rejected: 0,
                failed: 1
            }
        );
        assert_eq!(l.stats(21 * S, 15 * S).sent, 2);
        let t = l.totals();
        assert_eq!(
            (t.issued, t.accepted, t.failed, t.rate_limited),
            (3, 1, 1, 1)
        );
        assert_eq!(t.in_flight, 1);
        assert_eq!(l.outcome("b").map(DirectiveOutcome::name), Some("accepted"));
    }

    #[test]
    fn the_bucket_allows_a_burst_then_the_rate() {
        let mut b = TokenBucket::new(2.0, 3);
        assert_eq!((0..5).filter(|_| b.try_take(0.0)).count(), 3);
        assert!(!b.try_take(0.1));
        assert!(b.try_take(0.6), "one token after half a second at 2/s");
        assert!(!b.try_take(0.6));
        assert_eq!(
            (0..10).filter(|_| b.try_take(100.0)).count(),
            3,
            "capped at the burst"
        );
    }
}
