//! The dry-run opportunity report: the fork's table (spill rate, migratable tokens,
//! migratable volume vs uncached prefill) with the true delta beside the upper bound,
//! the spread across windows, and how far the two ways of measuring agree.

mod html;
mod plots;
mod svg;
mod tables;
mod whatif;

use crate::fold::analyzer::FleetAnalyzer;
pub use crate::fold::window::Spread;
use crate::fold::window::{token_distribution, token_histogram};
use crate::whatif::question::WhatIfAnswer;
use hdrhistogram::Histogram;
use kvscope_wire::api::summary::{AgentStatus, CollectorCounters, RouterViewAudit};
use kvscope_wire::api::window::{
    MigrationLogWindow, ModelFigures, TokenDistribution, WindowSummary, WorkerWindow,
};
use kvscope_wire::WorkerKey;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ReportStatus {
    Ready,
    /// Fewer measured windows than the minimum: the figures are shown but not to be
    /// trusted yet.
    NotEnoughWindows {
        have: usize,
        need: usize,
    },
}

/// Decision-joined (router log) vs event-only (KV events alone) figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Agreement {
    pub decision_spills: u64,
    pub event_only_spills: u64,
    pub decision_true_delta_tokens: u64,
    pub event_only_delta_tokens: u64,
    /// event-only delta / decision-joined delta (None when the latter is zero).
    pub delta_ratio: Option<f64>,
}

/// Spills whose per-spill token count falls in `[from_tokens, to_tokens)`, the true
/// delta and the upper bound counted side by side.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SpillTokenBin {
    pub from_tokens: u64,
    /// Exclusive: twice `from_tokens`.
    pub to_tokens: u64,
    pub true_delta_spills: u64,
    pub upper_bound_spills: u64,
}

/// What the router's-view table shows, under its heading.
const ROUTER_VIEW_CAPTION: &str = "The overlap the router credited each chosen worker with \
     (its log), against what the worker's engine held at the decision; why, from the first \
     block it got wrong: removed or stored on that worker within 5 s before the decision (a \
     change the router had not applied), or stored only after it (the router saw it first). \
     Where the router logs a score per worker (Dynamo 1.4/1.5 at DEBUG), each spill's best \
     worker too: credited with less than it held, the router's view of the worker it passed \
     over was stale (the first uncredited block stored within 5 s before: a store not yet \
     applied); credited with at least that, it chose by load.";

/// The mean and longest lag of the router-view misses told "not yet applied", in ms.
fn lately_lag_cell(v: &RouterViewAudit) -> String {
    let ms = |us: u64| us as f64 / 1e3;
    match v.over_removed_lately + v.under_stored_lately {
        0 => "–".into(),
        n => format!(
            "{} / {}",
            ms(v.lately_lag_us_sum / n),
            ms(v.lately_lag_us_max)
        ),
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpportunityReport {
    pub status: ReportStatus,
    pub window_secs: f64,
    pub windows_measured: usize,
    pub windows_warmup: usize,
    /// Measured windows in which the mirror saw gaps, resets or unappliable events.
    pub windows_with_data_faults: usize,
    pub requests: u64,
    pub spills: u64,
    /// spills / requests over all measured windows.
    pub spill_rate: Option<f64>,
    pub spill_rate_per_window: Spread,
    /// Per-spill migratable tokens as the fork logged them (best overlap).
    pub upper_bound_tokens: TokenDistribution,
    /// Per-spill true delta (best − chosen overlap).
    pub true_delta_tokens: TokenDistribution,
    /// Both per-spill distributions binned by powers of two, from the lowest to the
    /// highest bin holding a spill (empty bins between included).
    #[serde(default)]
    pub spill_token_bins: Vec<SpillTokenBin>,
    pub upper_bound_tok_per_s: Spread,
    pub true_delta_tok_per_s: Spread,
    pub uncached_prefill_tok_per_s: Spread,
    pub true_delta_tok_per_s_per_worker: Spread,
    pub uncached_prefill_tok_per_s_per_worker: Spread,
    /// Σ true delta / Σ upper bound: how much of the fork's figure is real.
    pub true_share_of_upper_bound: Option<f64>,
    /// Output-block blindness: the share of the true delta that lies in blocks the
    /// holding worker generated while decoding.
    pub generated_share_of_true_delta: Option<f64>,
    /// Tiers: the share of the true delta the chosen worker held in its own lower tiers
    /// (host memory, disk) and onloaded; the rest was recomputed.
    #[serde(default)]
    pub onload_share_of_true_delta: Option<f64>,
    pub agreement: Agreement,
    pub migration_log: MigrationLogWindow,
    #[serde(with = "kvscope_wire::worker_map")]
    pub workers: BTreeMap<WorkerKey, WorkerWindow>,
    /// Per model over the measured windows, when discovery named the models.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub models: BTreeMap<String, ModelFigures>,
    /// Per tenant (a request's named tenant, else its cache salt), over every decision judged (warm-up
    /// included): the tenants with the most spills, the rest, and the unsalted.
    #[serde(default, skip_serializing_if = "TenantRows::is_empty")]
    pub tenants: TenantRows,
    pub collector: CollectorCounters,
    /// The router's view of its choices beside the engines' truth, over every decision
    /// judged (warm-up included: the router's view is no load figure).
    #[serde(default)]
    pub router_view: RouterViewAudit,
    pub agents: BTreeMap<String, AgentStatus>,
    /// Every closed window, warm-up included (flagged).
    pub windows: Vec<WindowSummary>,
    /// The what-if of the same requests (`kvscope whatif`'s answer), where the report
    /// was made from a whole recording (`kvscope collector report`, `kvscope-demo`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub whatif: Option<WhatIfAnswer>,
    /// Why the what-if could not be answered on these requests (no cache size known, no
    /// request judged), where one was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub whatif_unavailable: Option<String>,
}

impl OpportunityReport {
    pub fn from_analyzer(a: &FleetAnalyzer) -> Self {
        let cfg = a.config();
        let measured: Vec<_> = a.closed_windows().filter(|w| !w.summary.warmup).collect();
        let mut true_delta = token_histogram();
        let mut upper = token_histogram();
        let mut agreement = Agreement::default();
        let mut migration_log = MigrationLogWindow::default();
        let mut workers: BTreeMap<WorkerKey, WorkerWindow> = BTreeMap::new();
        let mut models: BTreeMap<String, ModelFigures> = BTreeMap::new();
        let (mut requests, mut spills, mut td_sum, mut ub_sum) = (0, 0, 0u64, 0u64);
        let mut generated_sum = 0u64;
        let mut onload_sum = 0u64;
        for w in &measured {
            let s = &w.summary;
            w.true_delta.add_to(&mut true_delta);
            w.upper_bound.add_to(&mut upper);
            requests += s.requests;
            spills += s.spills;
            // Token sums carry wire-supplied counts (each window saturates them): adding
            // windows saturates too, so a crafted record cannot overflow the report.
            td_sum = td_sum.saturating_add(s.true_delta_tokens);
            ub_sum = ub_sum.saturating_add(s.upper_bound_tokens);
            generated_sum = generated_sum.saturating_add(s.generated_delta_tokens);
            onload_sum = onload_sum.saturating_add(s.onload_delta_tokens);
            agreement.decision_spills += s.spills;
            agreement.decision_true_delta_tokens = agreement
                .decision_true_delta_tokens
                .saturating_add(s.true_delta_tokens);
            agreement.event_only_spills += s.event_only.spills;
            agreement.event_only_delta_tokens = agreement
                .event_only_delta_tokens
                .saturating_add(s.event_only.delta_tokens);
            let m = &mut migration_log;
            m.spill_lines += s.migration_log.spill_lines;
            m.spill_migratable_tokens = m
                .spill_migratable_tokens
                .saturating_add(s.migration_log.spill_migratable_tokens);
            m.handshakes_obtained += s.migration_log.handshakes_obtained;
            m.dispatch_failures += s.migration_log.dispatch_failures;
            m.decoding_on_target += s.migration_log.decoding_on_target;
            for (name, m) in &s.models {
                models.entry(name.clone()).or_default().merge(m);
            }
            for (k, ww) in &s.workers {
                let t = workers.entry(*k).or_default();
                t.requests += ww.requests;
                t.spills_in += ww.spills_in;
                t.spills_out += ww.spills_out;
                t.uncached_prefill_tokens = t
                    .uncached_prefill_tokens
                    .saturating_add(ww.uncached_prefill_tokens);
                t.true_delta_tokens_in = t
                    .true_delta_tokens_in
                    .saturating_add(ww.true_delta_tokens_in);
                t.cached_blocks = ww.cached_blocks;
            }
        }
        agreement.delta_ratio = (agreement.decision_true_delta_tokens > 0).then(|| {
            agreement.event_only_delta_tokens as f64 / agreement.decision_true_delta_tokens as f64
        });
        let spread = |f: fn(&WindowSummary) -> Option<f64>| {
            Spread::of(measured.iter().filter_map(|w| f(&w.summary)))
        };
        let status = if measured.len() >= cfg.min_windows {
            ReportStatus::Ready
        } else {
            ReportStatus::NotEnoughWindows {
                have: measured.len(),
                need: cfg.min_windows,
            }
        };
        Self {
            status,
            window_secs: cfg.window_secs,
            windows_measured: measured.len(),
            windows_warmup: a.closed_windows().filter(|w| w.summary.warmup).count(),
            windows_with_data_faults: measured
                .iter()
                .filter(|w| w.summary.data_faults > 0)
                .count(),
            requests,
            spills,
            spill_rate: (requests > 0).then(|| spills as f64 / requests as f64),
            spill_rate_per_window: spread(|s| s.spill_rate),
            upper_bound_tokens: token_distribution(&upper),
            true_delta_tokens: token_distribution(&true_delta),
            spill_token_bins: power_of_two_bins(&true_delta, &upper),
            upper_bound_tok_per_s: spread(|s| Some(s.upper_bound_tok_per_s)),
            true_delta_tok_per_s: spread(|s| Some(s.true_delta_tok_per_s)),
            uncached_prefill_tok_per_s: spread(|s| Some(s.uncached_prefill_tok_per_s)),
            true_delta_tok_per_s_per_worker: spread(|s| {
                (s.active_workers > 0).then_some(s.true_delta_tok_per_s_per_worker)
            }),
            uncached_prefill_tok_per_s_per_worker: spread(|s| {
                (s.active_workers > 0).then_some(s.uncached_prefill_tok_per_s_per_worker)
            }),
            true_share_of_upper_bound: (ub_sum > 0).then(|| td_sum as f64 / ub_sum as f64),
            generated_share_of_true_delta: (td_sum > 0)
                .then(|| generated_sum as f64 / td_sum as f64),
            onload_share_of_true_delta: (td_sum > 0).then(|| onload_sum as f64 / td_sum as f64),
            agreement,
            migration_log,
            workers,
            models,
            tenants: TenantRows::of(&a.totals().tenants),
            collector: a.counters().clone(),
            router_view: a.router_view().clone(),
            agents: a.agents().clone(),
            windows: a.closed_windows().map(|w| w.summary.clone()).collect(),
            whatif: None,
            whatif_unavailable: None,
        }
    }

    /// With the what-if of the same requests, or why it could not be answered.
    pub fn with_whatif(mut self, answer: Result<WhatIfAnswer, String>) -> Self {
        match answer {
            Ok(a) => self.whatif = Some(a),
            Err(why) => self.whatif_unavailable = Some(why),
        }
        self
    }

    /// The router's view as one table row, head and cells, when any decision was compared.
    pub(crate) fn router_view_row(&self) -> Option<([&'static str; 11], [String; 11])> {
        let v = &self.router_view;
        (v.compared > 0).then(|| {
            (
                [
                    "decisions compared",
                    "exact",
                    "over (blocks)",
                    "over: removal not yet applied / store seen first",
                    "under (blocks)",
                    "under: store not yet applied",
                    "not yet applied: the change came (mean / max ms before)",
                    "spills",
                    "spills the router could not see",
                    "spills with the best worker's score",
                    "of those, the best's view stale (blocks): store not yet applied",
                ],
                [
                    v.compared.to_string(),
                    v.exact.to_string(),
                    format!("{} ({})", v.over, v.over_blocks),
                    format!("{} / {}", v.over_removed_lately, v.over_stored_after),
                    format!("{} ({})", v.under, v.under_blocks),
                    v.under_stored_lately.to_string(),
                    lately_lag_cell(v),
                    v.spills.to_string(),
                    v.spills_unseen.to_string(),
                    v.spills_best_scored.to_string(),
                    format!(
                        "{} ({}): {}",
                        v.spills_best_stale,
                        v.spills_best_stale_blocks,
                        v.spills_best_stale_stored_lately
                    ),
                ],
            )
        })
    }

    /// The report as one self-contained HTML page with its plots (see [`html`]).
    pub fn to_html(&self) -> String {
        html::render(self)
    }

    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// The report as Markdown, for a terminal or a ticket.
    pub fn to_markdown(&self) -> String {
        let mut md = String::new();
        let _ = writeln!(md, "# kvscope dry-run opportunity report\n");
        match &self.status {
            ReportStatus::Ready => {
                let _ = writeln!(
                    md,
                    "{} measured windows of {} s ({} warm-up windows discarded).\n",
                    self.windows_measured, self.window_secs, self.windows_warmup
                );
            }
            ReportStatus::NotEnoughWindows { have, need } => {
                let _ = writeln!(md, "**Not enough windows yet: {have} measured, {need} needed.** Figures below are provisional.\n");
            }
        }
        let _ = writeln!(md, "| figure | value |\n|---|---|");
        for (name, value, key) in self.figure_rows() {
            let name = if key {
                format!("**{name}**")
            } else {
                name.to_string()
            };
            let _ = writeln!(md, "| {name} | {value} |");
        }
        if !self.spill_token_bins.is_empty() {
            let _ = writeln!(md, "\n## Spills by token count\n\n| tokens per spill | true delta spills | upper bound spills |\n|---|---|---|");
            for b in &self.spill_token_bins {
                let _ = writeln!(
                    md,
                    "| {}–{} | {} | {} |",
                    b.from_tokens,
                    b.to_tokens - 1,
                    b.true_delta_spills,
                    b.upper_bound_spills
                );
            }
        }
        let a = &self.agreement;
        let _ = writeln!(md, "\n## Decision-joined vs event-only\n\n| | decision-joined | event-only |\n|---|---|---|");
        let _ = writeln!(
            md,
            "| spills | {} | {} |",
            a.decision_spills, a.event_only_spills
        );
        let _ = writeln!(
            md,
            "| delta tokens | {} | {} |",
            a.decision_true_delta_tokens, a.event_only_delta_tokens
        );
        let _ = writeln!(
            md,
            "\nEvent-only / decision-joined delta: {}.",
            a.delta_ratio.map_or("n/a".into(), |r| format!("{r:.3}"))
        );
        let m = &self.migration_log;
        if m.spill_lines + m.handshakes_obtained + m.dispatch_failures + m.decoding_on_target > 0 {
            let _ = writeln!(md, "\n## Migration log (KVMIGRATE lines)\n\n| spill lines | migratable tokens logged | handshakes obtained | dispatch failures | decoding on target |\n|---|---|---|---|---|");
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} |",
                m.spill_lines,
                m.spill_migratable_tokens,
                m.handshakes_obtained,
                m.dispatch_failures,
                m.decoding_on_target
            );
        }
        if let Some((head, cells)) = self.router_view_row() {
            let _ = writeln!(
                md,
                "\n## The router's view\n\n{ROUTER_VIEW_CAPTION}\n\n| {} |\n|{}",
                head.join(" | "),
                "---|".repeat(head.len())
            );
            let _ = writeln!(md, "| {} |", cells.join(" | "));
        }
        const FIGURES_HEAD: &str = "| requests | spills | spill rate | true delta tokens | upper bound tokens | uncached prefill tokens |\n|---|---|---|---|---|---|---|";
        let figures_row = |md: &mut String, name: &str, m: &ModelFigures| {
            let rate = (m.requests > 0).then(|| m.spills as f64 / m.requests as f64);
            // A name is the fleet's text (a model, a salt): a `|` would split the cell.
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} |",
                name.replace('|', "\\|"),
                m.requests,
                m.spills,
                pct(rate),
                m.true_delta_tokens,
                m.upper_bound_tokens,
                m.uncached_prefill_tokens
            );
        };
        if !self.models.is_empty() {
            let _ = writeln!(md, "\n## Models\n\nEach request judged among the workers serving its model.\n\n| model {FIGURES_HEAD}");
            for (name, m) in &self.models {
                figures_row(&mut md, name, m);
            }
        }
        if !self.tenants.is_empty() {
            let _ = writeln!(md, "\n## Tenants\n\nA request's tenant is what a field of the request named, where the agent was told which field, else the cache salt its first block was stored under; every decision judged since the collector started (warm-up included). The rows sum to the fleet's.\n\n| tenant {FIGURES_HEAD}");
            let t = &self.tenants;
            for r in &t.top {
                figures_row(&mut md, &r.tenant, &r.figures);
            }
            if t.others.requests > 0 {
                figures_row(&mut md, "(other tenants)", &t.others);
            }
            figures_row(&mut md, "(none)", &t.unsalted);
        }
        let _ = writeln!(md, "\n## Workers\n\n| worker | requests | spills in | spills out | uncached prefill tokens | true delta tokens in | cached blocks |\n|---|---|---|---|---|---|---|");
        for (k, w) in &self.workers {
            let _ = writeln!(
                md,
                "| {k} | {} | {} | {} | {} | {} | {} |",
                w.requests,
                w.spills_in,
                w.spills_out,
                w.uncached_prefill_tokens,
                w.true_delta_tokens_in,
                w.cached_blocks
            );
        }
        let _ = writeln!(md, "\n## Windows\n\n| start (s) | requests | spill rate | true delta tok/s | upper bound tok/s | uncached tok/s | event-only delta tok | data faults |\n|---|---|---|---|---|---|---|---|");
        let t0 = self.windows.first().map_or(0, |w| w.start_ns);
        for w in &self.windows {
            let _ = writeln!(
                md,
                "| {:.0}{} | {} | {} | {:.0} | {:.0} | {:.0} | {} | {} |",
                (w.start_ns - t0) as f64 / 1e9,
                if w.warmup { " (warm-up)" } else { "" },
                w.requests,
                pct(w.spill_rate),
                w.true_delta_tok_per_s,
                w.upper_bound_tok_per_s,
                w.uncached_prefill_tok_per_s,
                w.event_only.delta_tokens,
                w.data_faults
            );
        }
        let _ = writeln!(md, "\n## Data quality\n\n| counter | value |\n|---|---|");
        for (name, v) in self.data_quality_rows() {
            let _ = writeln!(md, "| {name} | {v} |");
        }
        if let Some(why) = &self.whatif_unavailable {
            let _ = writeln!(md, "\n## What-if\n\nNot answered on these requests: {why}.");
        }
        if let Some(w) = &self.whatif {
            // The what-if's own Markdown, its headings one level down.
            for part in w.markdown_parts() {
                md.push('\n');
                for line in part.lines() {
                    if line.starts_with('#') {
                        md.push('#');
                    }
                    md.push_str(line);
                    md.push('\n');
                }
            }
        }
        md
    }

    /// The report's figures, as (figure, value, key) rows; the key figures are the ones
    /// this tool exists to measure (the true delta), set off in the Markdown. The
    /// Markdown and HTML reports show these rows.
    pub(crate) fn figure_rows(&self) -> Vec<(&'static str, String, bool)> {
        let s = &self.spill_rate_per_window;
        let d =
            |t: &TokenDistribution| format!("{} / {} / {} / {:.0}", t.p50, t.p90, t.max, t.mean);
        vec![
            ("routed requests", self.requests.to_string(), false),
            ("spills", self.spills.to_string(), false),
            (
                "spill rate",
                format!(
                    "{} (per window: mean {}, min {}, max {}, sd {})",
                    pct(self.spill_rate),
                    pct(Some(s.mean)),
                    pct(Some(s.min)),
                    pct(Some(s.max)),
                    pct(Some(s.stddev))
                ),
                false,
            ),
            (
                "migratable tokens per spill, upper bound (p50 / p90 / max / mean)",
                d(&self.upper_bound_tokens),
                false,
            ),
            (
                "true delta tokens per spill (p50 / p90 / max / mean)",
                d(&self.true_delta_tokens),
                true,
            ),
            (
                "migratable volume, upper bound (tok/s)",
                spread(&self.upper_bound_tok_per_s),
                false,
            ),
            (
                "migratable volume, true delta (tok/s)",
                spread(&self.true_delta_tok_per_s),
                true,
            ),
            (
                "uncached prefill (tok/s)",
                spread(&self.uncached_prefill_tok_per_s),
                false,
            ),
            (
                "true delta per active worker (tok/s)",
                spread(&self.true_delta_tok_per_s_per_worker),
                false,
            ),
            (
                "uncached prefill per active worker (tok/s)",
                spread(&self.uncached_prefill_tok_per_s_per_worker),
                false,
            ),
            (
                "true delta / upper bound",
                pct(self.true_share_of_upper_bound),
                false,
            ),
            (
                "true delta in decode-generated (output) blocks",
                self.generated_share_said(),
                false,
            ),
            (
                "true delta onloaded from the chosen worker's lower tiers",
                self.onload_share_said(),
                false,
            ),
            (
                "measured windows with data faults",
                self.windows_with_data_faults.to_string(),
                false,
            ),
        ]
    }

    /// The share of the true delta the chosen workers onloaded from their lower tiers,
    /// and, when it is 0, whether any engine published a lower tier at all.
    fn onload_share_said(&self) -> String {
        let share = pct(self.onload_share_of_true_delta);
        if self.onload_share_of_true_delta != Some(0.0) || self.collector.lower_tier_events > 0 {
            return share;
        }
        format!("{share} (no engine published a host or disk tier: device only)")
    }

    /// The share of the true delta in decode-generated blocks, and why it is 0 when it
    /// is: a 0 alone reads as "no blindness" where the run may never have let a reply
    /// come back.
    fn generated_share_said(&self) -> String {
        let share = pct(self.generated_share_of_true_delta);
        if self.generated_share_of_true_delta != Some(0.0) {
            return share;
        }
        match self.collector.prompts_reaching_generated_blocks {
            0 => format!(
                "{share} (no prompt found a reply still cached on the worker that decoded it: \
                 replies were not sent back in the next turn, or were evicted before it)"
            ),
            n => format!(
                "{share} ({n} prompts found their previous reply cached where it was decoded; \
                 none of them spilled)"
            ),
        }
    }

    /// The data-quality counters, as (what, value) rows: the collector's, then each
    /// agent's from its last heartbeat. The Markdown and HTML reports show these rows.
    fn data_quality_rows(&self) -> Vec<(String, String)> {
        let c = &self.collector;
        let collector = [
            ("records", c.records),
            ("undecodable records", c.undecodable_records),
            (
                "records dated far ahead of the collector's clock (not applied)",
                c.future_records,
            ),
            (
                "records moved back by their agent's clock offset",
                c.records_clock_corrected,
            ),
            (
                "records whose agent is not their subject's (not applied)",
                c.foreign_records,
            ),
            (
                "records sent in parts that never came whole",
                c.incomplete_records,
            ),
            ("workers retired (left discovery)", c.workers_retired),
            (
                "KV batches of retired workers (not applied)",
                c.batches_for_retired_workers,
            ),
            ("sequence gaps", c.sequence_gaps),
            ("batches recovered through replay", c.replayed_batches),
            (
                "verdicts judged on an incomplete mirror",
                c.verdicts_on_incomplete_mirror,
            ),
            ("missed batches", c.missed_batches),
            ("sequence resets (engine restarts)", c.sequence_resets),
            (
                "batches lost or reordered after the agent",
                c.batch_order_faults,
            ),
            (
                "stores and removals on host/disk tiers (lower-tier mirror)",
                c.lower_tier_events,
            ),
            (
                "lower-tier blocks not placed or not held",
                c.lower_tier_unknown_blocks,
            ),
            ("events of an unknown medium (left out)", c.unknown_medium_events),
            (
                "stores with unknown parent (dropped)",
                c.unknown_parent_events,
            ),
            ("removals of unknown blocks", c.unknown_removed_blocks),
            ("stores with token count mismatch", c.token_count_mismatches),
            (
                "malformed decisions (token counts impossible; not judged)",
                c.malformed_decisions,
            ),
            (
                "decisions for a request already judged (not judged again)",
                c.duplicate_decisions,
            ),
            (
                "decode decisions of disaggregated requests (their prefill decision is judged)",
                c.decode_legs,
            ),
            (
                "verdicts most likely judged after their own prefill (clock skew)",
                c.verdicts_after_own_prefill,
            ),
            (
                "verdicts possibly judged early (router log late by 50 ms or more: its clock may be behind)",
                c.verdicts_clock_behind,
            ),
            (
                "verdicts judged before a KV event they depend on (it reached the agent too late)",
                c.verdicts_judged_before_event,
            ),
            (
                "decisions for workers with no KV events",
                c.decisions_for_unseen_workers,
            ),
            (
                "verdicts judged among every worker (no model named for the chosen worker: neither discovery nor the router's line)",
                c.verdicts_model_unknown,
            ),
            (
                "verdicts where a worker of unknown model held more of the prompt (left out as a candidate)",
                c.verdicts_left_out_unknown_model,
            ),
            (
                "decisions naming another model than discovery's for their worker",
                c.decisions_model_mismatch,
            ),
            (
                "decisions whose whole prompt was cached on the chosen worker",
                c.decisions_fully_cached,
            ),
            ("late records", c.late_records),
        ];
        let mut rows: Vec<(String, String)> = collector
            .into_iter()
            .map(|(name, v)| (name.to_string(), v.to_string()))
            .collect();
        for (agent, st) in &self.agents {
            let k = &st.heartbeat.counters;
            rows.push((
                format!(
                    "agent {agent}: bad frames / decode errors / unknown events / malformed events"
                ),
                format!(
                    "{} / {} / {} / {}",
                    k.kv_bad_frames, k.kv_decode_errors, k.kv_unknown_events, k.kv_malformed_events
                ),
            ));
            rows.push((
                format!(
                    "agent {agent}: malformed log lines / unjoined decisions / dropped records"
                ),
                format!(
                    "{} / {} / {}",
                    k.log_malformed_lines, k.decisions_unjoined, k.publish_dropped
                ),
            ));
            rows.push((
                format!(
                    "agent {agent}: publishers dropped for breaking limits / log lines too long / records refused by JetStream"
                ),
                format!(
                    "{} / {} / {}",
                    k.kv_peer_violations, k.log_lines_too_long, k.records_set_aside
                ),
            ));
        }
        rows
    }
}

/// The power-of-two bin of `v` (≥ 1): bin k holds `[2^k, 2^(k+1))`.
/// A share as a percentage with two decimals, `n/a` when there is none.
fn pct(x: Option<f64>) -> String {
    x.map_or("n/a".to_string(), |v| format!("{:.2}%", v * 100.0))
}

/// A spread across windows: the mean, then min, max and standard deviation.
fn spread(s: &Spread) -> String {
    format!(
        "{:.0} (min {:.0}, max {:.0}, sd {:.0})",
        s.mean, s.min, s.max, s.stddev
    )
}

fn bin_of(v: u64) -> u32 {
    63 - v.max(1).leading_zeros()
}

/// Both histograms binned by powers of two. HDR histograms' equivalence ranges never
/// straddle a power of two, so every recorded value lands in its exact bin.
fn power_of_two_bins(true_delta: &Histogram<u64>, upper: &Histogram<u64>) -> Vec<SpillTokenBin> {
    let mut counts: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    let bin = |h: &Histogram<u64>, v: u64| bin_of(h.lowest_equivalent(v));
    for v in true_delta.iter_recorded() {
        counts
            .entry(bin(true_delta, v.value_iterated_to()))
            .or_default()
            .0 += v.count_at_value();
    }
    for v in upper.iter_recorded() {
        counts
            .entry(bin(upper, v.value_iterated_to()))
            .or_default()
            .1 += v.count_at_value();
    }
    let (Some(&lo), Some(&hi)) = (counts.keys().next(), counts.keys().next_back()) else {
        return Vec::new();
    };
    (lo..=hi)
        .map(|k| {
            let (td, ub) = counts.get(&k).copied().unwrap_or_default();
            SpillTokenBin {
                from_tokens: 1 << k,
                to_tokens: 1 << (k + 1),
                true_delta_spills: td,
                upper_bound_spills: ub,
            }
        })
        .collect()
}

/// A report's tenants: the [`TenantRows::TOP`] with the most spills, one row each, the
/// rest in one, and the requests with no salt known. Their sum is the fleet's.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TenantRows {
    pub top: Vec<TenantRow>,
    /// Every salted tenant past the top, in one.
    pub others: ModelFigures,
    pub unsalted: ModelFigures,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TenantRow {
    pub tenant: String,
    #[serde(flatten)]
    pub figures: ModelFigures,
}

impl TenantRows {
    /// Tenants a report names apart.
    pub const TOP: usize = 20;

    pub fn of(t: &kvscope_wire::api::window::TenantFigures) -> Self {
        let top: Vec<TenantRow> = t
            .top(Self::TOP)
            .into_iter()
            .map(|(tenant, f)| TenantRow {
                tenant: tenant.to_string(),
                figures: f.clone(),
            })
            .collect();
        let named: Vec<&str> = top.iter().map(|r| r.tenant.as_str()).collect();
        let others = t.all_but(&named);
        Self {
            top,
            others,
            unsalted: t.unsalted.clone(),
        }
    }

    /// No salted tenant: the section is left out.
    pub fn is_empty(&self) -> bool {
        self.top.is_empty() && self.others.requests == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_markdown_lists_the_spill_token_bins() {
        let mut r = OpportunityReport::from_analyzer(&FleetAnalyzer::new(Default::default()));
        assert!(!r.to_markdown().contains("Spills by token count"));
        r.spill_token_bins = vec![SpillTokenBin {
            from_tokens: 16,
            to_tokens: 32,
            true_delta_spills: 3,
            upper_bound_spills: 0,
        }];
        assert!(r.to_markdown().contains("## Spills by token count"));
        assert!(r.to_markdown().contains("| 16–31 | 3 | 0 |"));
    }

    #[test]
    fn the_routers_view_shows_once_a_decision_was_compared() {
        let mut r = OpportunityReport::from_analyzer(&FleetAnalyzer::new(Default::default()));
        assert!(!r.to_markdown().contains("The router's view"));
        assert!(!r.to_html().contains("router-view-table"));
        r.router_view = RouterViewAudit {
            compared: 9,
            exact: 6,
            over: 2,
            over_blocks: 30,
            over_removed_lately: 1,
            over_stored_after: 0,
            under: 1,
            under_blocks: 4,
            under_stored_lately: 1,
            spills: 3,
            spills_unseen: 2,
            spills_best_scored: 3,
            spills_best_stale: 1,
            spills_best_stale_blocks: 5,
            spills_best_stale_stored_lately: 1,
            lately_lag_us_sum: 3_000,
            lately_lag_us_max: 2_500,
        };
        assert!(r
            .to_markdown()
            .contains("| 9 | 6 | 2 (30) | 1 / 0 | 1 (4) | 1 | 1.5 / 2.5 | 3 | 2 | 3 | 1 (5): 1 |"));
        let html = r.to_html();
        assert!(html.contains("router-view-table"));
        assert!(html.contains("<td>2 (30)</td>"), "{html}");
    }

    #[test]
    fn tenants_show_the_top_by_spills_the_rest_and_the_unsalted_summing_to_the_fleet() {
        use kvscope_wire::api::window::TenantFigures;
        let mut r = OpportunityReport::from_analyzer(&FleetAnalyzer::new(Default::default()));
        assert!(!r.to_markdown().contains("## Tenants"));
        let mut t = TenantFigures::default();
        let fig = |requests, spills| ModelFigures {
            requests,
            spills,
            true_delta_tokens: spills * 16,
            ..ModelFigures::default()
        };
        for i in 0..(TenantRows::TOP as u64 + 5) {
            t.tenants.insert(format!("t{i:02}"), fig(10, i));
        }
        t.tenants.insert("a|b".into(), fig(1, 100));
        t.unsalted = fig(7, 0);
        r.tenants = TenantRows::of(&t);
        assert_eq!(r.tenants.top.len(), TenantRows::TOP);
        assert_eq!(r.tenants.top[0].tenant, "a|b");
        let sum: u64 = r
            .tenants
            .top
            .iter()
            .map(|x| x.figures.requests)
            .sum::<u64>()
            + r.tenants.others.requests
            + r.tenants.unsalted.requests;
        assert_eq!(sum, 10 * (TenantRows::TOP as u64 + 5) + 1 + 7);
        // "a|b" takes the first row: the six with the fewest spills (t00..t05) are the rest.
        assert_eq!(
            (r.tenants.others.requests, r.tenants.others.spills),
            (60, 15)
        );
        let md = r.to_markdown();
        assert!(md.contains("| a\\|b | 1 | 100 |"), "{md}");
        assert!(md.contains("| (other tenants) | 60 | 15 |"));
        assert!(md.contains("| (none) | 7 | 0 |"));
    }

    #[test]
    fn spill_tokens_are_binned_by_powers_of_two() {
        let mut td = token_histogram();
        let mut ub = token_histogram();
        for v in [16, 31, 32, 4096, 4097, 1 << 20] {
            td.record(v).unwrap();
        }
        ub.record(64).unwrap();
        let bins = power_of_two_bins(&td, &ub);
        assert_eq!(bins.first().unwrap().from_tokens, 16);
        assert_eq!(bins.last().unwrap().to_tokens, 1 << 21);
        assert_eq!(bins.len(), 21 - 4, "contiguous, empty bins kept");
        let at = |from: u64| bins.iter().find(|b| b.from_tokens == from).unwrap();
        assert_eq!(at(16).true_delta_spills, 2);
        assert_eq!(at(32).true_delta_spills, 1);
        assert_eq!(at(4096).true_delta_spills, 2);
        assert_eq!(at(1 << 20).true_delta_spills, 1);
        assert_eq!(at(64).upper_bound_spills, 1);
        let total: u64 = bins.iter().map(|b| b.true_delta_spills).sum();
        assert_eq!(total, td.len());
        assert!(power_of_two_bins(&token_histogram(), &token_histogram()).is_empty());
    }

    #[test]
    fn spread_of_values() {
        let s = Spread::of([1.0, 3.0]);
        assert_eq!(
            (s.mean, s.min, s.max, s.stddev, s.windows),
            (2.0, 1.0, 3.0, 1.0, 2)
        );
        assert_eq!(Spread::of([]), Spread::default());
    }

    #[test]
    fn markdown_and_html_show_the_same_figures() {
        let mut r = OpportunityReport::from_analyzer(&FleetAnalyzer::new(Default::default()));
        r.spills = 7;
        r.true_delta_tok_per_s = Spread::of([100.0, 300.0]);
        r.windows_with_data_faults = 2;
        let (md, html) = (r.to_markdown(), r.to_html());
        for (name, value, key) in r.figure_rows() {
            let md_row = match key {
                true => format!("| **{name}** | {value} |"),
                false => format!("| {name} | {value} |"),
            };
            assert!(md.contains(&md_row), "Markdown lacks {md_row:?}");
            let html_row = format!(
                "<tr><td>{}</td><td>{}</td></tr>",
                svg::escape(name),
                svg::escape(&value)
            );
            assert!(html.contains(&html_row), "HTML lacks {html_row:?}");
        }
        assert!(md.contains("| measured windows with data faults | 2 |"));
    }

    #[test]
    fn a_what_if_that_could_not_calibrate_is_said_once_and_drawn_nowhere() {
        let w = crate::whatif::fixtures::calibration_far_below_the_real_size();
        let answer = crate::whatif::question::WhatIfInputs::default()
            .answer(&w)
            .unwrap();
        let report = OpportunityReport::from_analyzer(&FleetAnalyzer::new(Default::default()))
            .with_whatif(Ok(answer));
        let html = report.to_html();
        assert!(html.contains("id=\"whatif-not-calibrated\""), "{html}");
        for absent in [
            "plot-whatif-reserve",
            "whatif-capacity-table",
            "plot-whatif-migration",
            "whatif-migration-table",
        ] {
            assert!(
                !html.contains(absent),
                "{absent} drawn without a calibration"
            );
        }
        let md = report.to_markdown();
        assert!(md.contains("**Not predicted**"), "{md}");
        assert!(md.contains("**No reserve predicted**"), "{md}");
        assert!(!md.contains("| 10% |"), "{md}");
    }
}
