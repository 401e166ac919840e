//! The report's what-if section, where the report carries one ([`WhatIfAnswer`]): the hit
//! rate each KV reserve leaves, and migration's net prefill saving at each reserve and
//! token gate, against what the reserve alone costs; then the break-even reserve and the
//! recommended actuator thresholds. Every number is a field of the answer.

use super::plots::polyline;
use super::svg::{self, compact, escape, px, ticks_to, Frame};
use super::tables::{row, table_open};
use super::Spread;
use crate::whatif::disagg::DisaggWhatIf;
use crate::whatif::migration::{BreakEven, MigrationWhatIf};
use crate::whatif::question::WhatIfAnswer;
use crate::whatif::router::RouterWhatIf;
use crate::whatif::CapacityWhatIf;
use std::fmt::Write as _;

/// Plot ids (stable, as the other plots').
pub(super) const PLOT_WHATIF_RESERVE: &str = "plot-whatif-reserve";
pub(super) const PLOT_WHATIF_MIGRATION: &str = "plot-whatif-migration";
/// Gate lines get these classes in turn (`.line.gate-N`, `.point.gate-N`).
const GATE_CLASSES: usize = 6;

pub(super) fn section(out: &mut String, w: &WhatIfAnswer) {
    let c = &w.capacity;
    let _ = write!(
        out,
        "<h2 id=\"whatif\">What-if: a KV reserve, and migration net of its costs</h2>\
         <p class=\"caption\">The recorded requests replayed over simulated caches, routing \
         held fixed: {} requests, {} blocks per worker ({}), recorded hit rate {}",
        c.recorded.requests,
        c.blocks_per_worker
            .map_or("various".to_string(), |b| b.to_string()),
        escape(&c.capacity_from),
        pct(c.recorded_hit_rate),
    );
    match c.calibration_failure.as_deref().filter(|_| !c.calibrated) {
        None => {
            let _ = write!(
                out,
                "; the simulation reproduces it at {:.2} simulated blocks per block ({} of {} \
                 requests get exactly their recorded overlap).</p>",
                c.calibration, c.requests_matched_exactly, c.recorded.requests
            );
            reserve_plot(out, c);
            capacity_table(out, c);
        }
        Some(why) => {
            let _ = write!(
                out,
                ".</p><p class=\"caption\" id=\"whatif-not-calibrated\"><b>Not predicted</b>: the \
                 simulation could not be calibrated on this recording: {}. No reserve, \
                 migration at a reserve or router setting is predicted from it.</p>",
                escape(why)
            );
        }
    }
    migration(out, &w.migration);
    if let Some(d) = &w.disagg {
        disagg(out, d);
    }
    if let Some(r) = &w.router {
        router(out, r);
    }
    if let Some(why) = &w.router_unavailable {
        let _ = write!(
            out,
            "<h3 id=\"whatif-router\">Router settings</h3><p class=\"caption\">Not predicted: {}.</p>",
            escape(why)
        );
    }
}

fn router(out: &mut String, r: &RouterWhatIf) {
    let _ = write!(
        out,
        "<h3 id=\"whatif-router\">Router settings</h3><p class=\"caption\">The recorded \
         requests routed again by Dynamo 1.6.1's own load tracker and worker selector over \
         the simulated caches ({:.2} simulated blocks per block), {} runs per setting (mean, \
         min–max); arrivals and durations held as recorded ({} requests timed by Dynamo's \
         request trace, {} given the median life); {} conversations followed by their \
         prompts as affinity's sessions.</p>",
        r.calibration, r.runs, r.requests_timed, r.requests_untimed, r.sessions
    );
    if let Some(v) = &r.load_view {
        let _ = write!(
            out,
            "<p class=\"caption\">The model's load view against the router's own: over {} \
             recorded decisions, the chosen worker's cost from the model's load is within \
             {:.2} blocks of the cost the router logged at the median, {:.2} at p90 ({} \
             within one block); {} of the decisions took the cheapest worker by those \
             costs.</p>",
            v.decisions,
            v.median_abs_error_blocks,
            v.p90_abs_error_blocks,
            pct(v.within_one_block),
            pct(v.chose_cheapest),
        );
    }
    table_open(
        out,
        "whatif-router-table",
        r.rows.len() + 2,
        &[
            "router",
            "spill rate",
            "Σ true delta tokens",
            "hit rate",
            "uncached prefill tokens",
            "turns kept on their worker",
            "by affinity",
        ],
    );
    let f = &r.recorded;
    row(
        out,
        &[
            "recorded run (measured)".to_string(),
            pct(f.spill_rate),
            f.true_delta_tokens.to_string(),
            pct(f.hit_rate),
            f.uncached_prefill_tokens.to_string(),
            pct(f.stay_share),
            pct(r.recorded_pinned_share),
        ],
    );
    let spread_pct = |s: &Spread| format!("{} ({}–{})", pct(s.mean), pct(s.min), pct(s.max));
    let spread_n = |s: &Spread| format!("{:.0} ({:.0}–{:.0})", s.mean, s.min, s.max);
    for k in std::iter::once(&r.model_at_recorded).chain(&r.rows) {
        row(
            out,
            &[
                if k.change.is_empty() {
                    "model, as recorded".to_string()
                } else {
                    format!("model, {}", k.change)
                },
                spread_pct(&k.spill_rate),
                spread_n(&k.true_delta_tokens),
                spread_pct(&k.hit_rate),
                spread_n(&k.uncached_prefill_tokens),
                spread_pct(&k.stay_share),
                pct(k.pinned_share),
            ],
        );
    }
    out.push_str("</tbody></table>\n");
    if let Some(m) = &r.model_misses {
        let _ = write!(
            out,
            "<p class=\"caption\" id=\"whatif-router-not-predicted\">{}</p>",
            bold(&r.not_predicted(m))
        );
    }
}

/// Markdown's `**…**` spans as HTML, the rest escaped.
fn bold(md: &str) -> String {
    md.split("**")
        .enumerate()
        .map(|(i, part)| {
            if i % 2 == 1 {
                format!("<b>{}</b>", escape(part))
            } else {
                escape(part)
            }
        })
        .collect()
}

fn disagg(out: &mut String, d: &DisaggWhatIf) {
    let verdict = d.crossing.sentence();
    let _ = write!(
        out,
        "<h3 id=\"whatif-disagg\">Conditional disaggregation</h3><p class=\"caption\">Time \
         to first token fitted per path from {} ({} left out): {verdict}. On {} ({}), {} stay \
         local at the recommended threshold of {} tokens: <code>{}</code>.</p>",
        escape(&d.samples_from),
        d.samples_left_out,
        escape(&d.requests_from),
        d.requests,
        pct(d.local_share),
        d.recommended_threshold_tokens,
        escape(&d.recommended_setting),
    );
    table_open(
        out,
        "whatif-disagg-fit",
        2,
        &[
            "path",
            "fixed ms",
            "ms per 1k uncached tokens",
            "samples",
            "rms residual ms",
        ],
    );
    for (name, l) in [
        ("local prefill", &d.costs.local),
        ("remote prefill", &d.costs.remote),
    ] {
        row(
            out,
            &[
                name.to_string(),
                format!("{:.1}", l.fixed_ms),
                format!("{:.1}", l.ms_per_ktok),
                l.samples.to_string(),
                format!("{:.1}", l.rms_residual_ms),
            ],
        );
    }
    out.push_str("</tbody></table>\n");
    table_open(
        out,
        "whatif-disagg-table",
        d.rows.len(),
        &[
            "threshold (uncached tokens)",
            "local share",
            "local share (isl_bounding)",
            "predicted mean TTFT ms",
        ],
    );
    for r in &d.rows {
        row(
            out,
            &[
                r.threshold_tokens.to_string(),
                pct(r.local_share),
                pct(r.local_share_isl_bounding),
                format!("{:.1}", r.predicted_mean_ttft_ms),
            ],
        );
    }
    out.push_str("</tbody></table>\n");
    for n in &d.notes {
        let _ = write!(out, "<p class=\"caption\">Note: {}.</p>", escape(n));
    }
}

fn pct(v: f64) -> String {
    super::pct(Some(v))
}

/// The reserve axis: 0 to the largest reserve swept, in percent.
fn reserve_ticks(max: f64) -> Vec<(f64, String)> {
    ticks_to(max * 100.0, 5.0, 5)
        .into_iter()
        .map(|v| (v / 100.0, format!("{}%", compact(v))))
        .collect()
}

fn reserve_plot(out: &mut String, c: &CapacityWhatIf) {
    let label = "Hit rate at each KV reserve (simulated)";
    if c.rows.is_empty() {
        svg::empty(out, PLOT_WHATIF_RESERVE, label, "No reserve was swept.");
        return;
    }
    let xt = reserve_ticks(c.rows.iter().map(|r| r.reserve).fold(0.0, f64::max));
    let top = c.rows.iter().map(|r| r.hit_rate).fold(0.0, f64::max);
    let yt = ticks_to(top * 100.0, 5.0, 5);
    let f = Frame::new(
        (0.0, xt.last().map_or(1.0, |t| t.0)),
        (0.0, yt.last().copied().unwrap_or(100.0) / 100.0),
    );
    svg::open(out, PLOT_WHATIF_RESERVE, label, c.rows.len(), "");
    let y: Vec<(f64, String)> = yt
        .iter()
        .map(|v| (v / 100.0, format!("{}%", compact(*v))))
        .collect();
    f.axes(out, &xt, &y, "KV reserve", "hit rate");
    let xy: Vec<(f64, f64)> = c
        .rows
        .iter()
        .map(|r| (f.x(r.reserve), f.y(r.hit_rate)))
        .collect();
    polyline(out, "uncached", &xy);
    for (r, (x, y)) in c.rows.iter().zip(&xy) {
        let _ = write!(
            out,
            "<circle class=\"mark point uncached\" cx=\"{}\" cy=\"{}\" r=\"3\" data-reserve=\"{}\" data-value=\"{}\">\
             <title>reserve {}: hit rate {}, {} uncached prefill tokens</title></circle>",
            px(*x),
            px(*y),
            r.reserve,
            r.hit_rate,
            pct(r.reserve),
            pct(r.hit_rate),
            r.totals.uncached_prefill_tokens
        );
    }
    out.push_str("</svg>\n");
}

fn capacity_table(out: &mut String, c: &CapacityWhatIf) {
    table_open(
        out,
        "whatif-capacity-table",
        c.rows.len(),
        &[
            "reserve",
            "blocks per worker",
            "hit rate",
            "uncached prefill tokens",
        ],
    );
    for r in &c.rows {
        row(
            out,
            &[
                pct(r.reserve),
                r.blocks_per_worker
                    .map_or(format!("{} in all", r.fleet_blocks), |b| b.to_string()),
                pct(r.hit_rate),
                r.totals.uncached_prefill_tokens.to_string(),
            ],
        );
    }
    out.push_str("</tbody></table>\n");
}

/// No migration could be priced: the recording has no NIXL figures and none was given.
fn unpriced(m: &MigrationWhatIf) -> bool {
    m.recorded_gates.iter().any(|g| g.unpriced > 0)
        && m.recorded_gates.iter().all(|g| g.migrations == 0)
}

fn migration(out: &mut String, m: &MigrationWhatIf) {
    let p = &m.pricing;
    let _ = write!(
        out,
        "<h3 id=\"whatif-migration\">Migration on, net of its costs</h3><p class=\"caption\">\
         Each spill whose true delta reaches a gate moves it over NIXL: one handshake, its \
         bytes at the pair's measured bandwidth, a dispatch overhead, against recomputing it. \
         {} KV bytes per token ({}); prefill {:.0} tokens/s per worker ({}); {} NIXL pairs \
         measured, {} workers mapped to their agents{}.</p>",
        p.kv_bytes_per_token,
        escape(&p.kv_bytes_from),
        p.prefill_tok_per_s,
        escape(&p.prefill_from),
        m.nixl_pairs,
        m.mapped_workers,
        match (p.bandwidth_bytes_per_s, p.handshake_s) {
            (None, None) => String::new(),
            (b, h) => format!(
                "; given instead of what was measured:{}{}",
                b.map_or(String::new(), |b| format!(" bandwidth {:.2} GB/s", b / 1e9)),
                h.map_or(String::new(), |h| format!(" handshake {:.1} ms", h * 1e3))
            ),
        }
    );
    if !m.calibrated {
        // The capacity part above says why; the recorded spills' gates need no
        // simulation, but the report's migration part is about reserves.
        return;
    }
    migration_plot(out, m);
    table_open(
        out,
        "whatif-migration-table",
        m.rows.len(),
        &[
            "reserve",
            "hit rate without migration",
            "reserve costs (tok/s)",
            "best gate (tokens)",
            "migrations",
            "net prefill tok/s",
        ],
    );
    for r in &m.rows {
        let g = r
            .best_gate
            .and_then(|b| r.gates.iter().find(|g| g.gate_tokens == b));
        row(
            out,
            &[
                pct(r.reserve),
                pct(r.hit_rate),
                format!("{:.1}", r.reserve_cost_tok_per_s),
                r.best_gate.map_or("—".into(), |g| g.to_string()),
                g.map_or(0, |g| g.migrations).to_string(),
                g.map_or("—".into(), |g| format!("{:.1}", g.net_prefill_tok_per_s)),
            ],
        );
    }
    out.push_str("</tbody></table>\n");
    if unpriced(m) {
        return;
    }
    let verdict = match m.break_even {
        BreakEven::At { reserve } => format!(
            "Break-even reserve: {} — above it migration saves less than the reserve costs.",
            pct(reserve)
        ),
        BreakEven::Beyond { reserve } => format!(
            "Break-even reserve: above {} — migration still saves more than the largest \
             reserve swept costs.",
            pct(reserve)
        ),
        BreakEven::Never => "Migration does not pay on this traffic, even with no reserve.".into(),
    };
    let _ = write!(
        out,
        "<p id=\"whatif-break-even\"><b>{}</b>",
        escape(&verdict)
    );
    if let Some(r) = &m.recommendation {
        let _ = write!(
            out,
            " Recommended actuator thresholds at a {} reserve: <code>min_tokens = {}</code>, \
             <code>min_true_delta_tok_per_s = {:.0}</code>; this traffic would save {:.1} \
             prefill tokens/s net.",
            pct(r.reserve),
            r.min_tokens,
            r.min_true_delta_tok_per_s,
            r.net_prefill_tok_per_s
        );
    }
    out.push_str("</p>\n");
}

fn migration_plot(out: &mut String, m: &MigrationWhatIf) {
    let label = "Net prefill tokens per second saved, by KV reserve and token gate";
    if m.rows.is_empty() {
        svg::empty(out, PLOT_WHATIF_MIGRATION, label, "No reserve was swept.");
        return;
    }
    if unpriced(m) {
        svg::empty(
            out,
            PLOT_WHATIF_MIGRATION,
            label,
            "Migrations cannot be priced: the recording has no NIXL figures (run the agent's \
             NIXL probes, or give --nixl-bandwidth-gbps and --handshake-ms). The table below \
             shows what each reserve alone would cost.",
        );
        return;
    }
    let gates: Vec<u64> = m.rows[0].gates.iter().map(|g| g.gate_tokens).collect();
    let values = m.rows.iter().flat_map(|r| {
        r.gates
            .iter()
            .map(|g| g.net_prefill_tok_per_s)
            .chain([-r.reserve_cost_tok_per_s])
    });
    let (lo, hi) = values.fold((0.0f64, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    // Ticks either side of zero on one step.
    let reach = ticks_to(lo.abs().max(hi), 1.0, 4);
    let step = reach.get(1).copied().unwrap_or(1.0);
    let top = if hi > 0.0 {
        (hi / step).ceil() * step
    } else {
        0.0
    };
    let bottom = if lo < 0.0 {
        (lo / step).floor() * step
    } else {
        0.0
    };
    let mut yt = Vec::new();
    let mut v = bottom;
    while v <= top + step / 2.0 {
        yt.push((v, compact(v)));
        v += step;
    }
    let xt = reserve_ticks(m.rows.iter().map(|r| r.reserve).fold(0.0, f64::max));
    let f = Frame::new((0.0, xt.last().map_or(1.0, |t| t.0)), (bottom, top));
    svg::open(
        out,
        PLOT_WHATIF_MIGRATION,
        label,
        m.rows.len() * (gates.len() + 1),
        &format!(" data-gates=\"{}\"", gates.len()),
    );
    f.axes(out, &xt, &yt, "KV reserve", "net prefill tokens / s");
    let zero = px(f.y(0.0));
    let _ = write!(
        out,
        "<line class=\"baseline\" x1=\"{}\" x2=\"{}\" y1=\"{zero}\" y2=\"{zero}\"/>",
        px(f.left()),
        px(f.right())
    );
    for (i, gate) in gates.iter().enumerate() {
        let class = format!("gate-{}", i % GATE_CLASSES);
        let xy: Vec<(f64, f64, f64)> = m
            .rows
            .iter()
            .filter_map(|r| {
                let g = r.gates.iter().find(|g| g.gate_tokens == *gate)?;
                Some((r.reserve, g.net_prefill_tok_per_s, g.migrations as f64))
            })
            .collect();
        let line: Vec<(f64, f64)> = xy.iter().map(|(x, y, _)| (f.x(*x), f.y(*y))).collect();
        polyline(out, &class, &line);
        for ((reserve, net, n), (x, y)) in xy.iter().zip(&line) {
            let _ = write!(
                out,
                "<circle class=\"mark point {class}\" cx=\"{}\" cy=\"{}\" r=\"3\" data-gate=\"{gate}\" \
                 data-reserve=\"{reserve}\" data-value=\"{net}\"><title>gate {gate} tokens at reserve {}: {net:.1} tok/s net, \
                 {n} migrations</title></circle>",
                px(*x),
                px(*y),
                pct(*reserve)
            );
        }
    }
    // The reserve alone last, on top of the gates that migrate nothing.
    let reserve: Vec<(f64, f64)> = m
        .rows
        .iter()
        .map(|r| (f.x(r.reserve), f.y(-r.reserve_cost_tok_per_s)))
        .collect();
    polyline(out, "upper-bound", &reserve);
    for (r, (x, y)) in m.rows.iter().zip(&reserve) {
        let _ = write!(
            out,
            "<circle class=\"mark point upper-bound\" cx=\"{}\" cy=\"{}\" r=\"3\" \
             data-reserve=\"{}\" data-value=\"{}\"><title>reserve {} alone: −{:.1} tok/s</title></circle>",
            px(*x),
            px(*y),
            r.reserve,
            -r.reserve_cost_tok_per_s,
            pct(r.reserve),
            r.reserve_cost_tok_per_s
        );
    }
    out.push_str("</svg>\n<ul class=\"legend\"><li><span class=\"key upper-bound\"></span>the reserve alone</li>");
    for (i, gate) in gates.iter().enumerate() {
        let _ = write!(
            out,
            "<li><span class=\"key gate-{}\"></span>gate {gate} tokens</li>",
            i % GATE_CLASSES
        );
    }
    out.push_str("</ul>\n");
}
