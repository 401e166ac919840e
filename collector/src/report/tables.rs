//! The report's tables: per-worker figures, the figure list, decision-joined vs
//! event-only, the router's view, the migration log, every window, and data quality.
//! Text is escaped.

use super::pct;
use super::plots::Timeline;
use super::svg::escape;
use super::OpportunityReport;
use std::fmt::Write as _;

const TABLE_WORKERS: &str = "workers";

pub(super) fn table_open(out: &mut String, id: &str, rows: usize, head: &[&str]) {
    let _ = write!(out, "<table id=\"{id}\" data-rows=\"{rows}\"><thead><tr>");
    for h in head {
        let _ = write!(out, "<th>{}</th>", escape(h));
    }
    out.push_str("</tr></thead><tbody>");
}

pub(super) fn row(out: &mut String, cells: &[String]) {
    out.push_str("<tr>");
    for c in cells {
        let _ = write!(out, "<td>{}</td>", escape(c));
    }
    out.push_str("</tr>");
}

pub(super) fn figures(out: &mut String, r: &OpportunityReport) {
    out.push_str("<h2 id=\"figures\">Figures</h2>");
    let rows = r.figure_rows();
    table_open(out, "figures-table", rows.len(), &["figure", "value"]);
    for (name, value, _) in rows {
        row(out, &[name.to_string(), value]);
    }
    out.push_str("</tbody></table>\n");
}
pub(super) fn workers(out: &mut String, r: &OpportunityReport) {
    let _ = write!(
        out,
        "<h2 id=\"workers-heading\">Workers</h2><p class=\"caption\">Summed over the measured \
         windows; cached blocks as the last measured window closed. The shading shows each \
         worker's share of the largest true delta received.</p>"
    );
    table_open(
        out,
        TABLE_WORKERS,
        r.workers.len(),
        &[
            "worker",
            "requests",
            "spills in",
            "spills out",
            "uncached prefill tokens",
            "true delta tokens in",
            "cached blocks",
        ],
    );
    if r.workers.is_empty() {
        let _ = write!(
            out,
            "<tr><td class=\"empty\" colspan=\"7\">No workers in a measured window yet.</td></tr>"
        );
    }
    let most = r
        .workers
        .values()
        .map(|w| w.true_delta_tokens_in)
        .max()
        .unwrap_or(0);
    for (k, w) in &r.workers {
        let share = if most > 0 {
            w.true_delta_tokens_in as f64 / most as f64 * 100.0
        } else {
            0.0
        };
        let _ = write!(
            out,
            "<tr data-worker=\"{k}\"><td>{k}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td><span class=\"cellbar\" style=\"width:{share:.1}%\"></span>{}</td><td>{}</td></tr>",
            w.requests,
            w.spills_in,
            w.spills_out,
            w.uncached_prefill_tokens,
            w.true_delta_tokens_in,
            w.cached_blocks,
            k = escape(&k.to_string())
        );
    }
    out.push_str("</tbody></table>\n");
}

pub(super) fn agreement(out: &mut String, r: &OpportunityReport) {
    let a = &r.agreement;
    let _ = write!(
        out,
        "<h2 id=\"agreement\">Decision-joined vs event-only</h2><p class=\"caption\">Event-only \
         / decision-joined delta: {}.</p>",
        a.delta_ratio.map_or("n/a".into(), |x| format!("{x:.3}"))
    );
    table_open(
        out,
        "agreement-table",
        2,
        &["", "decision-joined", "event-only"],
    );
    row(
        out,
        &[
            "spills".into(),
            a.decision_spills.to_string(),
            a.event_only_spills.to_string(),
        ],
    );
    row(
        out,
        &[
            "delta tokens".into(),
            a.decision_true_delta_tokens.to_string(),
            a.event_only_delta_tokens.to_string(),
        ],
    );
    out.push_str("</tbody></table>\n");
    if let Some((head, cells)) = r.router_view_row() {
        let _ = write!(
            out,
            "<h2 id=\"router-view\">The router's view</h2><p class=\"caption\">{}</p>",
            escape(super::ROUTER_VIEW_CAPTION)
        );
        table_open(out, "router-view-table", 1, &head);
        row(out, &cells);
        out.push_str("</tbody></table>\n");
    }
    let m = &r.migration_log;
    if m.spill_lines + m.handshakes_obtained + m.dispatch_failures + m.decoding_on_target > 0 {
        out.push_str("<h2 id=\"migration-log\">Migration log (KVMIGRATE lines)</h2>");
        table_open(
            out,
            "migration-log-table",
            1,
            &[
                "spill lines",
                "migratable tokens logged",
                "handshakes obtained",
                "dispatch failures",
                "decoding on target",
            ],
        );
        row(
            out,
            &[
                m.spill_lines.to_string(),
                m.spill_migratable_tokens.to_string(),
                m.handshakes_obtained.to_string(),
                m.dispatch_failures.to_string(),
                m.decoding_on_target.to_string(),
            ],
        );
        out.push_str("</tbody></table>\n");
    }
}

pub(super) fn windows_table(out: &mut String, r: &OpportunityReport) {
    let _ = write!(
        out,
        "<h2 id=\"windows\">Windows</h2><details><summary>{} windows ({} warm-up)</summary>",
        r.windows.len(),
        r.windows_warmup
    );
    table_open(
        out,
        "windows-table",
        r.windows.len(),
        &[
            "start (s)",
            "requests",
            "spill rate",
            "true delta tok/s",
            "upper bound tok/s",
            "uncached tok/s",
            "event-only delta tok",
            "data faults",
        ],
    );
    let t = Timeline::of(&r.windows);
    for w in &r.windows {
        let _ = write!(
            out,
            "<tr{}><td>{:.0}{}</td><td>{}</td><td>{}</td><td>{:.0}</td><td>{:.0}</td><td>{:.0}</td>\
             <td>{}</td><td>{}</td></tr>",
            if w.warmup { " class=\"warmup\"" } else { "" },
            t.at(w.start_ns),
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
    out.push_str("</tbody></table></details>\n");
}

pub(super) fn data_quality(out: &mut String, r: &OpportunityReport) {
    out.push_str("<h2 id=\"data-quality\">Data quality</h2>");
    let rows = r.data_quality_rows();
    table_open(out, "data-quality-table", rows.len(), &["counter", "value"]);
    for (name, v) in rows {
        row(out, &[name, v]);
    }
    out.push_str("</tbody></table>\n");
}
