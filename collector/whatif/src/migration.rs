//! Migration on, net of its costs: each spill whose true delta reaches a token gate moves
//! that delta to the chosen worker over NIXL (its prefill skips those tokens), priced by
//! the same cost model the actuator prices its directives with
//! ([`kvscope_wire::cost::predict`]: handshake + bytes / the pair's measured bandwidth +
//! a dispatch overhead, against recomputing at the prefill rate). Against it, the KV
//! capacity the connector's buffers reserve: each worker's cache `reserve` smaller, so
//! fewer hits. The answer, per reserve and gate: prefill tokens and seconds saved net of
//! both, the break-even reserve, the best gate, and the actuator thresholds to set.
//!
//! Two replays. With nothing changed but migration, the spills are the recorded
//! verdicts' (exact: the mirror at each decision). With a reserve, every worker's cache
//! is simulated (least recently used, calibrated on the recording as the capacity
//! what-if is) and a spill is a request whose chosen worker holds less of its prompt
//! than another worker of its model does, by at least the collector's
//! `min_spill_blocks`. A migrated delta is then resident on the chosen worker as if it
//! had prefilled it, so the cache evolves as without migration: only the request's own
//! prefill shrinks. Routing is held fixed, and a migration is charged a handshake as the
//! fork's producer handshake does, at the mean latency of the pair's successful handshakes.

use super::{CacheTotals, RoutedRequest, WhatIf, WhatIfError};
use kvscope_wire::cost::{
    predict, CostParams, FigureSource, HandshakeCharge, NixlFigures, PathFigures, Prediction,
};
use kvscope_wire::WorkerKey;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The default token gates swept (the actuator's default `min_tokens` is 16384).
pub(crate) const DEFAULT_GATES: [u64; 6] = [16, 256, 1024, 4096, 16384, 65536];
/// Gates predicted in one what-if at most.
pub(crate) const MAX_GATES: usize = 16;

/// What prices a migration, and where each figure came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pricing {
    pub kv_bytes_per_token: u64,
    /// `given` (a flag or the model's config) or `default` (an 8B model in fp16: set it).
    pub kv_bytes_from: String,
    pub prefill_tok_per_s: f64,
    /// `given` or `default` (the actuator's default, 10000).
    pub prefill_from: String,
    pub dispatch_overhead_s: f64,
    /// Bandwidth and handshake latency to charge every path, instead of what the
    /// probes measured.
    pub bandwidth_bytes_per_s: Option<f64>,
    pub handshake_s: Option<f64>,
}

impl Pricing {
    fn params(&self) -> CostParams {
        CostParams {
            kv_bytes_per_token: self.kv_bytes_per_token,
            prefill_tok_per_s: self.prefill_tok_per_s,
            dispatch_overhead_s: self.dispatch_overhead_s,
            handshake_quantile: 0.5,
        }
    }
}

/// One spill the what-if would migrate or decline, priced.
#[derive(Debug, Clone, Serialize)]
pub struct PricedSpill {
    pub request_id: String,
    pub source: WorkerKey,
    pub target: WorkerKey,
    pub tokens: u64,
    /// `None`: no bandwidth or handshake figure for the path.
    pub prediction: Option<Prediction>,
    pub bandwidth_from: FigureSource,
    pub handshake_from: FigureSource,
}

impl PricedSpill {
    /// Migrated: priced, and faster than recomputing (as the actuator issues it).
    pub fn migrates(&self) -> bool {
        self.prediction
            .as_ref()
            .is_some_and(|p| p.net_benefit_s > 0.0)
    }
}

/// What one gate does at one reserve.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GateOutcome {
    pub gate_tokens: u64,
    /// Spills whose true delta reaches the gate.
    pub spills_over_gate: u64,
    pub migrations: u64,
    /// Priced but slower than recomputing: not migrated (the actuator declines them).
    pub not_beneficial: u64,
    /// No NIXL figures for their path: not migrated.
    pub unpriced: u64,
    /// Migrations priced with fleet-wide figures (their pair was not measured).
    pub priced_fleet_wide: u64,
    pub migrated_tokens: u64,
    pub bytes: u64,
    /// Σ handshake + transfer of the migrations.
    pub nixl_s: f64,
    pub dispatch_s: f64,
    /// Σ migrated tokens / prefill rate: the prefill the migrations skip.
    pub recompute_s_saved: f64,
    /// With the reserve and these migrations.
    pub uncached_prefill_tokens: u64,
    /// Uncached prefill tokens with neither (reserve 0, no migration) minus these.
    pub net_prefill_tokens_saved: i64,
    /// net prefill tokens saved / prefill rate − (NIXL + dispatch seconds).
    pub net_s_saved: f64,
    /// Per second of the recording.
    pub net_prefill_tok_per_s: f64,
}

/// One reserve: what it costs alone, and what each gate then saves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReserveRow {
    pub reserve: f64,
    pub blocks_per_worker: Option<u64>,
    /// Without migration.
    pub hit_rate: f64,
    pub uncached_prefill_tokens: u64,
    /// Extra uncached prefill tokens the reserve alone costs, per second of the recording.
    pub reserve_cost_tok_per_s: f64,
    pub gates: Vec<GateOutcome>,
    /// The gate with the most net seconds saved (`None`: no gate migrates anything).
    pub best_gate: Option<u64>,
    pub best_net_s_saved: f64,
}

/// Where migration stops paying for its reserve.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BreakEven {
    /// Net zero at this reserve (linear between the swept reserves either side).
    At { reserve: f64 },
    /// Still saving at the largest reserve swept.
    Beyond { reserve: f64 },
    /// No gain even with no reserve.
    Never,
}

/// The actuator's thresholds the what-if recommends, at the connector's reserve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recommendation {
    pub reserve: f64,
    /// `[policy] min_tokens`.
    pub min_tokens: u64,
    /// `[policy] min_true_delta_tok_per_s`: the gated true delta per second at which
    /// migration's net saving pays for what the reserve costs.
    pub min_true_delta_tok_per_s: f64,
    /// What the recording's traffic would save net, prefill tokens/s.
    pub net_prefill_tok_per_s: f64,
    pub net_s_saved: f64,
}

/// The migration what-if of a recording.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrationWhatIf {
    pub pricing: Pricing,
    /// NIXL pairs measured in the recording, and workers mapped to NIXL agents.
    pub nixl_pairs: usize,
    pub mapped_workers: usize,
    pub fleet_bandwidth_bytes_per_s: Option<f64>,
    pub fleet_handshake_s: Option<f64>,
    pub duration_s: f64,
    pub recorded: CacheTotals,
    /// The recorded verdicts' spills migrated at each gate, nothing else changed.
    pub recorded_gates: Vec<GateOutcome>,
    pub calibration: f64,
    /// False when the simulation could not be calibrated (`calibration_failure` says
    /// why): no reserve is then predicted, `rows` is empty.
    pub calibrated: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration_failure: Option<String>,
    pub rows: Vec<ReserveRow>,
    /// At each row's best gate.
    pub break_even: BreakEven,
    /// The connector's reserve (`--connector-reserve`), if swept.
    pub recommendation: Option<Recommendation>,
    pub undecodable_records: u64,
}

/// The migration what-if's inputs.
#[derive(Debug, Clone)]
pub struct MigrationQuestion {
    pub pricing: Pricing,
    pub gates: Vec<u64>,
    pub reserves: Vec<f64>,
    /// The share NixlConnector's buffers would take: the recommendation's reserve.
    pub connector_reserve: f64,
    /// Each worker's cache in blocks instead of discovery's.
    pub gpu_blocks: Option<u64>,
}

impl GateOutcome {
    /// Count a spill over the gate.
    fn add(&mut self, s: &PricedSpill) {
        let g = self;
        g.spills_over_gate += 1;
        match &s.prediction {
            None => g.unpriced += 1,
            Some(p) if p.net_benefit_s <= 0.0 => g.not_beneficial += 1,
            Some(p) => {
                g.migrations += 1;
                if s.bandwidth_from == FigureSource::FleetWide
                    || s.handshake_from == FigureSource::FleetWide
                {
                    g.priced_fleet_wide += 1;
                }
                g.migrated_tokens += p.tokens;
                g.bytes += p.bytes;
                g.nixl_s += p.handshake_s + p.transfer_s;
                g.dispatch_s += p.dispatch_overhead_s;
                g.recompute_s_saved += p.recompute_s;
            }
        }
    }

    /// Close with the uncached prefill without migration at this reserve, and the
    /// baseline's (reserve 0, no migration).
    fn finish(
        mut self,
        gate: u64,
        uncached: u64,
        baseline: u64,
        pricing: &Pricing,
        secs: f64,
    ) -> GateOutcome {
        let g = &mut self;
        g.gate_tokens = gate;
        g.uncached_prefill_tokens = uncached.saturating_sub(g.migrated_tokens);
        g.net_prefill_tokens_saved = baseline as i64 - g.uncached_prefill_tokens as i64;
        g.net_s_saved = g.net_prefill_tokens_saved as f64 / pricing.prefill_tok_per_s
            - (g.nixl_s + g.dispatch_s);
        g.net_prefill_tok_per_s = per_s(g.net_prefill_tokens_saved as f64, secs);
        self
    }
}

fn per_s(v: f64, secs: f64) -> f64 {
    if secs > 0.0 {
        v / secs
    } else {
        0.0
    }
}

impl WhatIf {
    /// The NIXL figures of the recording, through the mapping its agents told.
    fn priced(
        &self,
        pricing: &Pricing,
        figures: &NixlFigures<'_>,
        r: &RoutedRequest,
        source: WorkerKey,
        gap_blocks: u32,
    ) -> PricedSpill {
        let mut path = figures.path(&source, &r.worker);
        if let Some(b) = pricing.bandwidth_bytes_per_s {
            path.bandwidth_bytes_per_s = Some(b);
            path.bandwidth_from = FigureSource::Given;
        }
        if let Some(h) = pricing.handshake_s {
            path.handshake_s = Some(h);
            path.handshake_from = FigureSource::Given;
        }
        let tokens = u64::from(gap_blocks) * u64::from(r.block_size);
        let PathFigures {
            bandwidth_from,
            handshake_from,
            ..
        } = path;
        PricedSpill {
            request_id: r.request_id.clone(),
            source,
            target: r.worker,
            tokens,
            prediction: predict(&pricing.params(), tokens, &path, pricing.prefill_tok_per_s),
            bandwidth_from,
            handshake_from,
        }
    }

    /// The recorded verdicts' spills whose true delta reaches `gate` tokens, priced: what
    /// migration would have moved on this run, nothing else changed.
    pub fn recorded_spills(&self, pricing: &Pricing, gate: u64) -> Vec<PricedSpill> {
        let mapping = kvscope_wire::cost::mapping(&[], &self.nixl_agents);
        let figures = NixlFigures::charging(&self.nixl_pairs, &mapping, HandshakeCharge::Mean);
        self.recorded_spills_priced(pricing, &figures, gate)
    }

    fn recorded_spills_priced(
        &self,
        pricing: &Pricing,
        figures: &NixlFigures<'_>,
        gate: u64,
    ) -> Vec<PricedSpill> {
        self.requests
            .iter()
            .filter_map(|r| {
                let gap = r.recorded_spill_blocks(self.min_spill_blocks)?;
                let tokens = u64::from(gap) * u64::from(r.block_size);
                (tokens >= gate).then(|| self.priced(pricing, figures, r, r.recorded_best, gap))
            })
            .collect()
    }

    fn duration_s(&self) -> f64 {
        let first = self
            .requests
            .iter()
            .map(|r| r.decided_ns)
            .min()
            .unwrap_or(0);
        let last = self
            .requests
            .iter()
            .map(|r| r.decided_ns)
            .max()
            .unwrap_or(0);
        last.saturating_sub(first) as f64 / 1e9
    }

    /// Migration at each gate and reserve of `q`.
    pub fn migration(&self, q: &MigrationQuestion) -> Result<MigrationWhatIf, WhatIfError> {
        if q.gates.is_empty() || q.gates.len() > MAX_GATES {
            return Err(WhatIfError::Gates(q.gates.len()));
        }
        let p = &q.pricing;
        if !(p.prefill_tok_per_s.is_finite() && p.prefill_tok_per_s > 0.0)
            || p.kv_bytes_per_token == 0
            || !(p.dispatch_overhead_s.is_finite() && p.dispatch_overhead_s >= 0.0)
            || p.bandwidth_bytes_per_s
                .is_some_and(|b| !(b.is_finite() && b > 0.0))
            || p.handshake_s.is_some_and(|h| !(h.is_finite() && h >= 0.0))
        {
            return Err(WhatIfError::Pricing);
        }
        // Reserve 0 first: the baseline every row is measured against.
        let mut reserves = q.reserves.clone();
        reserves.push(0.0);
        self.check(&reserves)?;
        reserves.sort_by(f64::total_cmp);
        reserves.dedup();
        let sizes = self.sizes(q.gpu_blocks)?;
        let (permille, calibrated) = self.calibrated_permille(&sizes);
        // An uncalibrated simulation predicts no reserve (see the capacity question).
        if calibrated.is_err() {
            reserves.clear();
        }
        let secs = self.duration_s();
        let mapping = kvscope_wire::cost::mapping(&[], &self.nixl_agents);
        let figures = NixlFigures::charging(&self.nixl_pairs, &mapping, HandshakeCharge::Mean);
        let recorded = self.recorded();
        // Priced once, over the smallest gate; each gate counts those it lets through.
        let smallest = q.gates.iter().copied().min().unwrap_or(0);
        let spills = self.recorded_spills_priced(p, &figures, smallest);
        let recorded_gates = q
            .gates
            .iter()
            .map(|&gate| {
                let mut g = GateOutcome::default();
                for s in spills.iter().filter(|s| s.tokens >= gate) {
                    g.add(s);
                }
                let uncached = recorded.uncached_prefill_tokens;
                g.finish(gate, uncached, uncached, p, secs)
            })
            .collect();
        let mut rows: Vec<ReserveRow> = Vec::new();
        let mut baseline = None;
        for &reserve in &reserves {
            let left = super::left_after(&sizes, reserve);
            let simulated: HashMap<WorkerKey, u64> = left
                .iter()
                .map(|(w, b)| (*w, super::scaled(*b, permille)))
                .collect();
            let mut tallies = vec![GateOutcome::default(); q.gates.len()];
            let totals = self.replay(
                |w| simulated.get(w).copied().unwrap_or(0),
                true,
                |r, chosen_hit, best| {
                    let Some((source, best_hit)) = best else {
                        return;
                    };
                    let gap = (best_hit - chosen_hit) as u32;
                    if gap < self.min_spill_blocks.max(1) {
                        return;
                    }
                    let s = self.priced(p, &figures, r, source, gap);
                    for (t, &gate) in tallies.iter_mut().zip(&q.gates) {
                        if s.tokens >= gate {
                            t.add(&s);
                        }
                    }
                },
            );
            let base = *baseline.get_or_insert(totals.uncached_prefill_tokens);
            let gates: Vec<GateOutcome> = tallies
                .into_iter()
                .zip(&q.gates)
                .map(|(t, &gate)| t.finish(gate, totals.uncached_prefill_tokens, base, p, secs))
                .collect();
            let best = gates
                .iter()
                .filter(|g| g.migrations > 0)
                .max_by(|a, b| a.net_s_saved.total_cmp(&b.net_s_saved));
            rows.push(ReserveRow {
                reserve,
                blocks_per_worker: super::uniform(&left),
                hit_rate: totals.hit_rate(),
                uncached_prefill_tokens: totals.uncached_prefill_tokens,
                reserve_cost_tok_per_s: per_s(
                    totals.uncached_prefill_tokens as f64 - base as f64,
                    secs,
                ),
                best_gate: best.map(|g| g.gate_tokens),
                best_net_s_saved: best.map_or(0.0, |g| g.net_s_saved),
                gates,
            });
        }
        let recommendation = rows
            .iter()
            .find(|r| r.reserve == q.connector_reserve)
            .and_then(recommend);
        Ok(MigrationWhatIf {
            pricing: p.clone(),
            nixl_pairs: self.nixl_pairs.len(),
            mapped_workers: mapping.len(),
            fleet_bandwidth_bytes_per_s: figures.fleet_bandwidth(),
            fleet_handshake_s: figures.fleet_handshake_s(),
            duration_s: secs,
            recorded,
            recorded_gates,
            calibration: super::calibration(&sizes, permille),
            calibrated: calibrated.is_ok(),
            calibration_failure: calibrated.err().map(|e| e.to_string()),
            break_even: break_even(&rows),
            rows,
            recommendation,
            undecodable_records: self.undecodable_records,
        })
    }
}

/// The gate that saves the most at `row`, and the migratable volume that pays for the
/// reserve: each migrated token saves `net / recompute` of a token's prefill, so the
/// reserve's cost / that share.
fn recommend(row: &ReserveRow) -> Option<Recommendation> {
    let gate = row.best_gate?;
    let g = row.gates.iter().find(|g| g.gate_tokens == gate)?;
    let migration_net_s = g.recompute_s_saved - g.nixl_s - g.dispatch_s;
    if g.recompute_s_saved <= 0.0 || migration_net_s <= 0.0 || g.net_s_saved <= 0.0 {
        return None;
    }
    let share = migration_net_s / g.recompute_s_saved;
    Some(Recommendation {
        reserve: row.reserve,
        min_tokens: gate,
        min_true_delta_tok_per_s: row.reserve_cost_tok_per_s.max(0.0) / share,
        net_prefill_tok_per_s: g.net_prefill_tok_per_s,
        net_s_saved: g.net_s_saved,
    })
}

/// Where the best gate's net saving crosses zero over the swept reserves (ascending).
/// What the Markdown says when no migration could be priced.
const UNPRICED: &str = "**Migrations cannot be priced**: the recording has no NIXL bandwidth \
    or handshake figures (run the agent with its NIXL probes, or give --nixl-bandwidth-gbps \
    and --handshake-ms).\n";

fn break_even(rows: &[ReserveRow]) -> BreakEven {
    let Some(first) = rows.first() else {
        return BreakEven::Never;
    };
    if first.best_net_s_saved <= 0.0 {
        return BreakEven::Never;
    }
    for w in rows.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        if b.best_net_s_saved <= 0.0 {
            let f = a.best_net_s_saved / (a.best_net_s_saved - b.best_net_s_saved);
            return BreakEven::At {
                reserve: a.reserve + f * (b.reserve - a.reserve),
            };
        }
    }
    BreakEven::Beyond {
        reserve: rows.last().map_or(0.0, |r| r.reserve),
    }
}

impl MigrationWhatIf {
    pub fn to_markdown(&self) -> String {
        let p = &self.pricing;
        let mut s = String::from("# What if KV migration were on, net of its costs\n\n");
        s.push_str(&format!(
            "Priced with {} KV bytes per token ({}), prefill at {:.0} tokens/s per worker ({}), \
             a dispatch overhead of {:.1} ms; NIXL: {} pairs measured, {} workers mapped to \
             their agents, fleet bandwidth {}, mean handshake {}{}.\n\
             Recorded: {} requests over {:.0} s, {} uncached prefill tokens. Routing held \
             fixed; a migration is charged one handshake and its bytes at the pair's \
             measured bandwidth (fleet-wide where the pair was not measured).\n\n",
            p.kv_bytes_per_token,
            p.kv_bytes_from,
            p.prefill_tok_per_s,
            p.prefill_from,
            p.dispatch_overhead_s * 1e3,
            self.nixl_pairs,
            self.mapped_workers,
            self.fleet_bandwidth_bytes_per_s
                .map_or("not measured".into(), |b| format!("{:.2} GB/s", b / 1e9)),
            self.fleet_handshake_s
                .map_or("not measured".into(), |h| format!("{:.1} ms", h * 1e3)),
            match (p.bandwidth_bytes_per_s, p.handshake_s) {
                (None, None) => String::new(),
                (b, h) => format!(
                    " (given instead:{}{})",
                    b.map_or(String::new(), |b| format!(" bandwidth {:.2} GB/s", b / 1e9)),
                    h.map_or(String::new(), |h| format!(" handshake {:.1} ms", h * 1e3))
                ),
            },
            self.recorded.requests,
            self.duration_s,
            self.recorded.uncached_prefill_tokens,
        ));
        if self.undecodable_records > 0 {
            s.push_str(&format!(
                "**{} records could not be read** and were skipped (see the log).\n\n",
                self.undecodable_records
            ));
        }
        if let Some(why) = self
            .calibration_failure
            .as_deref()
            .filter(|_| !self.calibrated)
        {
            s.push_str(&format!(
                "**No reserve predicted**: the simulation could not be calibrated on this \
                 recording: {why}.\n\n"
            ));
        }
        s.push_str(
            "## The recorded spills migrated, nothing else changed\n\n\
             | gate (tokens) | spills over it | migrated | not beneficial | unpriced | tokens | bytes | NIXL s | net prefill tokens saved | net s saved |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for g in &self.recorded_gates {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {:.3} | {} | {:.2} |\n",
                g.gate_tokens,
                g.spills_over_gate,
                g.migrations,
                g.not_beneficial,
                g.unpriced,
                g.migrated_tokens,
                g.bytes,
                g.nixl_s,
                g.net_prefill_tokens_saved,
                g.net_s_saved
            ));
        }
        let unpriced = self.recorded_gates.iter().any(|g| g.unpriced > 0)
            && self.recorded_gates.iter().all(|g| g.migrations == 0);
        if !self.calibrated {
            if unpriced {
                s.push_str(UNPRICED);
            }
            return s;
        }
        s.push_str(
            "\n## With the connector's reserve (simulated caches), at each reserve's best gate\n\n\
             | reserve | blocks per worker | hit rate without migration | reserve costs (tok/s) | best gate | migrations | NIXL s | net prefill tok/s | net s saved |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in &self.rows {
            let g = r
                .best_gate
                .and_then(|b| r.gates.iter().find(|g| g.gate_tokens == b));
            s.push_str(&format!(
                "| {:.0}% | {} | {:.1}% | {:.1} | {} | {} | {} | {} | {:.2} |\n",
                100.0 * r.reserve,
                r.blocks_per_worker
                    .map_or("various".into(), |b| b.to_string()),
                100.0 * r.hit_rate,
                r.reserve_cost_tok_per_s,
                r.best_gate.map_or("—".into(), |g| g.to_string()),
                g.map_or(0, |g| g.migrations),
                g.map_or("—".into(), |g| format!("{:.3}", g.nixl_s)),
                g.map_or("—".into(), |g| format!("{:.1}", g.net_prefill_tok_per_s)),
                r.best_net_s_saved
            ));
        }
        s.push('\n');
        if unpriced {
            s.push_str(UNPRICED);
            return s;
        }
        s.push_str(&match self.break_even {
            BreakEven::At { reserve } => format!(
                "**Break-even reserve: {:.1}%** — above it migration saves less than the \
                 reserve costs.\n",
                100.0 * reserve
            ),
            BreakEven::Beyond { reserve } => format!(
                "**Break-even reserve: above {:.0}%** — migration still saves more than the \
                 largest reserve swept costs.\n",
                100.0 * reserve
            ),
            BreakEven::Never => {
                "**Migration does not pay** on this traffic, even with no reserve.\n".into()
            }
        });
        match &self.recommendation {
            Some(r) => s.push_str(&format!(
                "**Recommended actuator thresholds** at a {:.0}% reserve: `min_tokens = {}`, \
                 `min_true_delta_tok_per_s = {:.0}` (the gated volume at which migration pays \
                 for the reserve); this traffic would save {:.1} prefill tokens/s net.\n",
                100.0 * r.reserve,
                r.min_tokens,
                r.min_true_delta_tok_per_s,
                r.net_prefill_tok_per_s
            )),
            None => s.push_str(
                "**No thresholds recommended**: at the connector's reserve no gate saves \
                 anything net (keep migration off).\n",
            ),
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: u64) -> WorkerKey {
        WorkerKey {
            worker_id: id,
            dp_rank: 0,
        }
    }

    /// A request of `chain` routed to `worker`, judged with `chosen` blocks there and the
    /// best worker `best` holding `best_blocks`.
    fn req(
        i: u64,
        worker: u64,
        chain: &[u64],
        chosen: u32,
        best: u64,
        best_blocks: u32,
    ) -> RoutedRequest {
        RoutedRequest {
            request_id: format!("r{i}"),
            decided_ns: i * 1_000_000_000,
            model: Some("m".into()),
            worker: w(worker),
            chain: chain.to_vec(),
            isl_tokens: chain.len() as u64 * 16,
            block_size: 16,
            recorded_overlap_blocks: chosen,
            recorded_best: w(best),
            recorded_best_overlap_blocks: best_blocks,
            decoded_tail: None,
            selection: Default::default(),
            router_overlap_blocks: None,
            end: None,
        }
    }

    fn pricing() -> Pricing {
        Pricing {
            kv_bytes_per_token: 1000,
            kv_bytes_from: "given".into(),
            prefill_tok_per_s: 1000.0,
            prefill_from: "given".into(),
            dispatch_overhead_s: 0.0,
            bandwidth_bytes_per_s: Some(1e9),
            handshake_s: Some(0.001),
        }
    }

    /// Worker 1 prefills a family's 4 blocks; the next request of the family goes to
    /// worker 2 (a spill of 4 blocks, 64 tokens), then worker 2 holds it too.
    fn fleet(cache_blocks: u64) -> WhatIf {
        let chain = [1, 2, 3, 4];
        WhatIf {
            requests: vec![
                req(0, 1, &chain, 0, 1, 0),
                req(1, 2, &chain, 0, 1, 4),
                req(2, 2, &chain, 4, 2, 4),
            ],
            discovered_blocks: HashMap::from([(1, cache_blocks), (2, cache_blocks)]),
            ..WhatIf::empty()
        }
    }

    fn question(gates: Vec<u64>, reserves: Vec<f64>) -> MigrationQuestion {
        MigrationQuestion {
            pricing: pricing(),
            gates,
            reserves,
            connector_reserve: 0.0,
            gpu_blocks: None,
        }
    }

    #[test]
    fn a_spill_over_the_gate_migrates_its_delta_priced_as_the_actuator_prices_it() {
        let f = fleet(8);
        let spills = f.recorded_spills(&pricing(), 16);
        assert_eq!(spills.len(), 1);
        let s = &spills[0];
        assert_eq!((s.source, s.target, s.tokens), (w(1), w(2), 64));
        let p = s.prediction.as_ref().unwrap();
        // 64 tokens × 1000 B = 64 kB at 1 GB/s = 64 µs, + 1 ms handshake; vs 64 ms.
        assert_eq!(p.bytes, 64_000);
        assert!((p.migrate_s - 0.001064).abs() < 1e-9, "{p:?}");
        assert!(s.migrates());
        assert!(
            f.recorded_spills(&pricing(), 65).is_empty(),
            "under the gate"
        );

        let m = f.migration(&question(vec![16, 128], vec![0.5])).unwrap();
        let g = &m.recorded_gates[0];
        assert_eq!((g.migrations, g.migrated_tokens, g.bytes), (1, 64, 64_000));
        assert_eq!(g.net_prefill_tokens_saved, 64);
        assert!((g.net_s_saved - (0.064 - 0.001064)).abs() < 1e-9, "{g:?}");
        assert_eq!(m.recorded_gates[1].spills_over_gate, 0);
        // The simulation finds the same spill with room for everything.
        assert_eq!(m.rows[0].reserve, 0.0, "reserve 0 added as the baseline");
        let sim = &m.rows[0].gates[0];
        assert_eq!((sim.migrations, sim.migrated_tokens), (1, 64));
        assert_eq!(m.rows[0].best_gate, Some(16));
        // The recorded hits need only half of each cache (calibration 0.5): half of that
        // keeps 2 of the family's blocks on each worker, so the spill moves 2 blocks and
        // the repeat misses 2: the reserve costs what migration saves, net of NIXL time.
        assert!(m.calibrated);
        assert_eq!(m.calibration, 0.5);
        assert_eq!(m.rows[1].blocks_per_worker, Some(4));
        assert_eq!(m.rows[1].gates[0].migrated_tokens, 32);
        assert_eq!(m.rows[1].gates[0].net_prefill_tokens_saved, 0);
        match m.break_even {
            BreakEven::At { reserve } => assert!(reserve > 0.45 && reserve < 0.5, "{reserve}"),
            other => panic!("{other:?}"),
        }
        let r = m.recommendation.as_ref().unwrap();
        assert_eq!((r.reserve, r.min_tokens), (0.0, 16));
        assert_eq!(r.min_true_delta_tok_per_s, 0.0, "no reserve costs nothing");
        let md = m.to_markdown();
        assert!(md.contains("| 16 | 1 | 1 | 0 | 0 | 64 | 64000 |"), "{md}");
        assert!(md.contains("Break-even reserve: 49.2%"), "{md}");
    }

    #[test]
    fn a_migration_slower_than_recompute_or_unpriced_is_not_made() {
        let f = fleet(8);
        let slow = Pricing {
            handshake_s: Some(1.0),
            ..pricing()
        };
        let s = &f.recorded_spills(&slow, 16)[0];
        assert!(!s.migrates());
        let q = MigrationQuestion {
            pricing: slow,
            ..question(vec![16], vec![])
        };
        let m = f.migration(&q).unwrap();
        assert_eq!(m.recorded_gates[0].not_beneficial, 1);
        assert_eq!(m.rows[0].best_gate, None);
        assert_eq!(m.break_even, BreakEven::Never);
        assert!(m.recommendation.is_none());
        assert!(m.to_markdown().contains("Migration does not pay"));
        // No NIXL figures measured and none given: unpriced.
        let unmeasured = Pricing {
            bandwidth_bytes_per_s: None,
            handshake_s: None,
            ..pricing()
        };
        let s = &f.recorded_spills(&unmeasured, 16)[0];
        assert!(s.prediction.is_none());
        assert_eq!(s.bandwidth_from, FigureSource::Missing);
    }

    #[test]
    fn a_reserve_that_evicts_the_source_costs_hits_and_the_spill() {
        // Worker 1 holds family A (4 blocks), then family B evicts it when its cache is
        // 4 blocks (half of 8).
        // Worker 1's recorded hits on both families need all 8 blocks (calibration 1).
        let a = [1, 2, 3, 4];
        let b = [11, 12, 13, 14];
        let f = WhatIf {
            requests: vec![
                req(0, 1, &a, 0, 1, 0),
                req(1, 1, &b, 0, 1, 0),
                req(2, 2, &a, 0, 1, 4),
                req(3, 1, &b, 4, 1, 4),
                req(4, 1, &a, 4, 1, 4),
            ],
            discovered_blocks: HashMap::from([(1, 8), (2, 8)]),
            ..WhatIf::empty()
        };
        let m = f.migration(&question(vec![16], vec![0.5])).unwrap();
        let (full, half) = (&m.rows[0], &m.rows[1]);
        assert_eq!(m.calibration, 1.0);
        assert_eq!(full.gates[0].migrations, 1);
        // Half: the first spill finds nothing on worker 1 (B evicted A), but A's last
        // request, back on worker 1, now spills from worker 2, which holds it.
        assert_eq!(half.gates[0].migrations, 1);
        assert_eq!(half.gates[0].migrated_tokens, 64);
        assert!(half.uncached_prefill_tokens > full.uncached_prefill_tokens);
        assert!(half.reserve_cost_tok_per_s > 0.0);
        assert!(half.gates[0].net_s_saved < 0.0);
        match m.break_even {
            BreakEven::At { reserve } => assert!(reserve > 0.0 && reserve < 0.5, "{reserve}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_inputs_are_refused() {
        let f = fleet(8);
        assert!(matches!(
            f.migration(&question(vec![], vec![])),
            Err(WhatIfError::Gates(0))
        ));
        let q = MigrationQuestion {
            pricing: Pricing {
                prefill_tok_per_s: 0.0,
                ..pricing()
            },
            ..question(vec![16], vec![])
        };
        assert!(matches!(f.migration(&q), Err(WhatIfError::Pricing)));
        assert!(matches!(
            f.migration(&question(vec![16], vec![1.5])),
            Err(WhatIfError::Reserve(_))
        ));
    }
}
