//! The opportunity report as one self-contained HTML page: inline CSS, inline SVG plots
//! ([`super::plots`]) and tables ([`super::tables`]); no scripts, fonts, images or any
//! other fetched asset (a Content Security Policy of `default-src 'none'` has the browser
//! enforce that). Every number on the page is a
//! field of [`OpportunityReport`]; nothing is computed a second time.
//!
//! Each plot is an `<svg class="plot">` with a stable id and `data-marks`, the number of
//! marks (`class="mark …"`: points, bars) drawn from data; an empty plot says why and
//! carries `data-empty="true"`.

use super::plots::{spill_rate_plot, spill_tokens_plot, volume_plot};
use super::svg::escape;
use super::tables::{agreement, data_quality, figures, windows_table, workers};
use super::{pct, spread, OpportunityReport, ReportStatus};
use kvscope_wire::api::window::TokenDistribution;
use std::fmt::Write as _;

const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; img-src data:";

const CSS: &str = "
:root{color-scheme:light;--fg:#1f2937;--muted:#6b7280;--line:#e5e7eb;--td:#c2410c;--ub:#64748b;--un:#2563eb;--sr:#7c3aed;--bad:#dc2626}
*{box-sizing:border-box}
body{margin:0 auto;max-width:1060px;padding:24px 28px 48px;font:14px/1.5 system-ui,-apple-system,'Segoe UI',Roboto,'Liberation Sans','DejaVu Sans',sans-serif;color:var(--fg);background:#fff}
h1{font-size:24px;margin:0 0 4px}
h2{font-size:18px;margin:28px 0 4px;padding-top:14px;border-top:1px solid var(--line)}
.status{padding:8px 12px;border-radius:6px;margin:12px 0}
.status.ready{background:#ecfdf5;border:1px solid #a7f3d0}
.status.provisional{background:#fffbeb;border:1px solid #fcd34d}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(180px,1fr));gap:12px;margin:16px 0}
.card{border:1px solid var(--line);border-radius:8px;padding:10px 14px}
.card .label{color:var(--muted);font-size:12px}
.card .value{font-size:22px;font-weight:600;font-variant-numeric:tabular-nums}
.card .sub{color:var(--muted);font-size:12px}
table{border-collapse:collapse;width:100%;margin:8px 0;font-variant-numeric:tabular-nums}
th,td{padding:4px 8px;border-bottom:1px solid var(--line);text-align:right;position:relative}
th:first-child,td:first-child{text-align:left}
th{font-weight:600;color:#374151;background:#f9fafb}
tr.warmup td{color:var(--muted)}
#figures-table td,#figures-table th{text-align:left}
#figures-table td:first-child{width:48%}
td.empty{text-align:left;color:var(--muted);font-style:italic}
.cellbar{position:absolute;left:0;top:4px;bottom:4px;background:var(--td);opacity:.16}
.caption{color:var(--muted);margin:0 0 6px}
details summary{cursor:pointer;color:#374151}
svg.plot{width:100%;height:auto;display:block;margin:6px 0}
.grid{stroke:var(--line)}
.baseline,.tickmark{stroke:#9ca3af}
.tick{font-size:11px;fill:var(--muted)}
.axis-title{font-size:12px;fill:#374151}
.warmup-shade{fill:#f3f4f6}
.plot-empty{color:var(--muted);font-style:italic;border:1px dashed var(--line);border-radius:4px;padding:10px 12px;margin:6px 0;overflow-wrap:anywhere}
.spread-band{fill:var(--sr);fill-opacity:.13}
.spread-mean{stroke:var(--sr);stroke-width:1.5;stroke-dasharray:6 4}
.spread-range{stroke:var(--sr);stroke-opacity:.55;stroke-dasharray:2 3}
.line{fill:none;stroke-width:2}
.line.spill{stroke:var(--sr);stroke-opacity:.35;stroke-width:1.5}
.line.true-delta{stroke:var(--td)}
.line.upper-bound{stroke:var(--ub);stroke-dasharray:6 4}
.line.uncached{stroke:var(--un)}
.point.spill{fill:var(--sr)}
.point.true-delta{fill:var(--td)}
.point.upper-bound{fill:var(--ub)}
.point.uncached{fill:var(--un)}
.point.warmup{fill:#fff;stroke:#9ca3af;stroke-width:1.5}
.point.fault{stroke:var(--bad);stroke-width:2.5}
.bar.true-delta{fill:var(--td)}
.bar.upper-bound{fill:var(--ub);fill-opacity:.55}
.legend{list-style:none;padding:0;margin:4px 0 0;display:flex;flex-wrap:wrap;gap:6px 22px;color:#374151;font-size:13px}
.key{display:inline-block;width:16px;height:10px;margin-right:6px;vertical-align:middle;border-radius:2px}
.key.spill{background:var(--sr)}
.key.band{background:var(--sr);opacity:.25}
.key.warmup{background:#f3f4f6;border:1px solid #d1d5db}
.key.fault{background:#fff;border:2px solid var(--bad);border-radius:50%;width:10px}
.key.true-delta{background:var(--td)}
.key.upper-bound{background:var(--ub);opacity:.75}
.key.uncached{background:var(--un)}
h3{font-size:15px;margin:20px 0 4px}
.line.gate-0{stroke:#0f766e}.point.gate-0,.key.gate-0{fill:#0f766e;background:#0f766e}
.line.gate-1{stroke:#c2410c}.point.gate-1,.key.gate-1{fill:#c2410c;background:#c2410c}
.line.gate-2{stroke:#7c3aed}.point.gate-2,.key.gate-2{fill:#7c3aed;background:#7c3aed}
.line.gate-3{stroke:#2563eb}.point.gate-3,.key.gate-3{fill:#2563eb;background:#2563eb}
.line.gate-4{stroke:#ca8a04}.point.gate-4,.key.gate-4{fill:#ca8a04;background:#ca8a04}
.line.gate-5{stroke:#db2777}.point.gate-5,.key.gate-5{fill:#db2777;background:#db2777}
footer{margin-top:36px;color:var(--muted);font-size:12px}
";
pub(super) fn render(r: &OpportunityReport) -> String {
    let mut out = String::with_capacity(48 * 1024 + r.windows.len() * 1200);
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>kvscope opportunity report</title><link rel=\"icon\" href=\"data:,\">\
         <style>{CSS}</style></head><body>\n"
    );
    header(&mut out, r);
    cards(&mut out, r);

    spill_rate_section(&mut out, r);
    spill_tokens_section(&mut out, r);
    volume_section(&mut out, r);
    workers(&mut out, r);
    figures(&mut out, r);
    agreement(&mut out, r);
    windows_table(&mut out, r);
    data_quality(&mut out, r);
    if let Some(w) = &r.whatif {
        super::whatif::section(&mut out, w);
    }
    if let Some(why) = &r.whatif_unavailable {
        let _ = write!(
            out,
            "<h2 id=\"whatif\">What-if</h2><p class=\"caption\">Not answered on these \
             requests: {}.</p>",
            escape(why)
        );
    }
    let _ = writeln!(
        out,
        "<footer>Written by kvscope-collector {}. This page is self-contained: it loads no \
         scripts, styles, fonts or images from anywhere.</footer></body></html>",
        escape(env!("CARGO_PKG_VERSION"))
    );
    out
}

fn spill_rate_section(out: &mut String, r: &OpportunityReport) {
    out.push_str(
        "<h2 id=\"spill-rate\">Spill rate per window</h2><p class=\"caption\">Spills / routed \
         requests in each window. The band is the mean ± one standard deviation over the \
         measured windows, the dotted lines their min and max.</p>",
    );
    if !spill_rate_plot(out, r) {
        return;
    }
    let sr = &r.spill_rate_per_window;
    let _ = writeln!(
        out,
        "<ul class=\"legend\"><li><span class=\"key spill\"></span>window spill rate</li>\
         <li><span class=\"key band\"></span>mean {} ± sd {} (min {}, max {}, {} windows)</li>\
         <li><span class=\"key warmup\"></span>warm-up, not measured</li>\
         <li><span class=\"key fault\"></span>window with data faults</li></ul>",
        pct(Some(sr.mean)),
        pct(Some(sr.stddev)),
        pct(Some(sr.min)),
        pct(Some(sr.max)),
        sr.windows
    );
}

fn spill_tokens_section(out: &mut String, r: &OpportunityReport) {
    out.push_str(
        "<h2 id=\"spill-tokens\">True delta vs upper bound per spill</h2><p class=\"caption\">\
         Spills by tokens per spill, in bins from n to 2n, over the measured windows: the true \
         delta (best − chosen overlap) beside the upper bound the fork logs (best overlap).</p>",
    );
    if !spill_tokens_plot(out, r) {
        return;
    }
    let _ = writeln!(
        out,
        "<ul class=\"legend\"><li><span class=\"key true-delta\"></span>true delta: {}</li>\
         <li><span class=\"key upper-bound\"></span>upper bound: {}</li></ul>",
        distribution(&r.true_delta_tokens),
        distribution(&r.upper_bound_tokens)
    );
}

fn volume_section(out: &mut String, r: &OpportunityReport) {
    out.push_str(
        "<h2 id=\"volume\">Migratable vs uncached prefill volume</h2><p class=\"caption\">\
         Tokens per second in each window: the migratable volume (true delta, and the upper \
         bound beside it) against the prefill the chosen workers computed.</p>",
    );
    if !volume_plot(out, r) {
        return;
    }
    let _ = writeln!(
        out,
        "<ul class=\"legend\"><li><span class=\"key true-delta\"></span>true delta: {} \
         tok/s</li><li><span class=\"key upper-bound\"></span>upper bound: {} tok/s</li>\
         <li><span class=\"key uncached\"></span>uncached prefill: {} tok/s</li></ul>",
        spread(&r.true_delta_tok_per_s),
        spread(&r.upper_bound_tok_per_s),
        spread(&r.uncached_prefill_tok_per_s)
    );
}

fn distribution(t: &TokenDistribution) -> String {
    format!(
        "p50 {} / p90 {} / max {} / mean {:.0} tokens ({} spills)",
        t.p50, t.p90, t.max, t.mean, t.count
    )
}

fn header(out: &mut String, r: &OpportunityReport) {
    out.push_str("<header><h1>kvscope dry-run opportunity report</h1>");
    match &r.status {
        ReportStatus::Ready => {
            let _ = write!(
                out,
                "<p id=\"status\" class=\"status ready\" data-state=\"ready\">{} measured \
                 windows of {} s ({} warm-up windows discarded).</p>",
                r.windows_measured, r.window_secs, r.windows_warmup
            );
        }
        ReportStatus::NotEnoughWindows { have, need } => {
            let _ = write!(
                out,
                "<p id=\"status\" class=\"status provisional\" data-state=\"not_enough_windows\">\
                 <strong>Not enough windows yet: {have} measured, {need} needed.</strong> \
                 Figures below are provisional.{}</p>",
                if r.windows.is_empty() {
                    " No window has closed yet."
                } else {
                    ""
                }
            );
        }
    }
    out.push_str("</header>\n");
}

fn cards(out: &mut String, r: &OpportunityReport) {
    let card = |out: &mut String, label: &str, value: String, sub: String| {
        let _ = write!(
            out,
            "<div class=\"card\"><div class=\"label\">{}</div><div class=\"value\">{}</div>\
             <div class=\"sub\">{}</div></div>",
            escape(label),
            escape(&value),
            escape(&sub)
        );
    };
    out.push_str("<div class=\"cards\">");
    card(
        out,
        "spill rate",
        pct(r.spill_rate),
        format!("{} spills / {} requests", r.spills, r.requests),
    );
    card(
        out,
        "migratable, true delta",
        format!("{:.0} tok/s", r.true_delta_tok_per_s.mean),
        format!(
            "sd {:.0} over {} windows",
            r.true_delta_tok_per_s.stddev, r.true_delta_tok_per_s.windows
        ),
    );
    card(
        out,
        "migratable, upper bound",
        format!("{:.0} tok/s", r.upper_bound_tok_per_s.mean),
        format!(
            "sd {:.0} over {} windows",
            r.upper_bound_tok_per_s.stddev, r.upper_bound_tok_per_s.windows
        ),
    );
    card(
        out,
        "uncached prefill",
        format!("{:.0} tok/s", r.uncached_prefill_tok_per_s.mean),
        format!(
            "sd {:.0} over {} windows",
            r.uncached_prefill_tok_per_s.stddev, r.uncached_prefill_tok_per_s.windows
        ),
    );
    card(
        out,
        "true delta / upper bound",
        pct(r.true_share_of_upper_bound),
        "how much of the fork's figure is real".into(),
    );
    out.push_str("</div>\n");
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
    use crate::report::plots::{PLOT_SPILL_RATE, PLOT_SPILL_TOKENS, PLOT_VOLUME};
    use crate::report::{SpillTokenBin, Spread};
    use kvscope_wire::api::summary::AgentStatus;
    use kvscope_wire::api::window::{WindowSummary, WorkerWindow};
    use kvscope_wire::WorkerKey;

    const S: u64 = 1_000_000_000;

    fn empty_report() -> OpportunityReport {
        OpportunityReport::from_analyzer(&FleetAnalyzer::new(AnalyzerConfig::default()))
    }

    #[test]
    fn a_what_if_not_answered_says_why() {
        let plain = empty_report();
        assert!(!plain.to_html().contains("id=\"whatif\""));
        let r = empty_report().with_whatif(Err("no routed request <judged>".into()));
        let html = r.to_html();
        assert!(html.contains("id=\"whatif\""));
        assert!(html.contains("no routed request &lt;judged&gt;"));
        assert!(r
            .to_markdown()
            .contains("Not answered on these requests: no routed request <judged>."));
        let back: OpportunityReport = serde_json::from_str(&r.to_json_pretty()).unwrap();
        assert_eq!(back, r);
    }

    /// Two warm-up windows and four measured ones, one without requests and one with
    /// data faults; three bins; two workers.
    fn report() -> OpportunityReport {
        let mut r = empty_report();
        for i in 0..6u64 {
            let requests = if i == 3 { 0 } else { 10 };
            let spills = i % 3;
            r.windows.push(WindowSummary {
                start_ns: 100 * S + i * 15 * S,
                end_ns: 100 * S + (i + 1) * 15 * S,
                warmup: i < 2,
                requests,
                spills,
                spill_rate: (requests > 0).then(|| spills as f64 / requests as f64),
                true_delta_tok_per_s: 10.0 * i as f64,
                upper_bound_tok_per_s: 25.0 * i as f64,
                uncached_prefill_tok_per_s: 1000.0 + i as f64,
                data_faults: u64::from(i == 4),
                ..Default::default()
            });
        }
        r.spill_rate_per_window = Spread::of([0.0, 0.1, 0.2]);
        r.spill_token_bins = vec![
            SpillTokenBin {
                from_tokens: 16,
                to_tokens: 32,
                true_delta_spills: 3,
                upper_bound_spills: 0,
            },
            SpillTokenBin {
                from_tokens: 32,
                to_tokens: 64,
                true_delta_spills: 0,
                upper_bound_spills: 0,
            },
            SpillTokenBin {
                from_tokens: 64,
                to_tokens: 128,
                true_delta_spills: 1,
                upper_bound_spills: 4,
            },
        ];
        for id in [7, 9] {
            r.workers.insert(
                WorkerKey {
                    worker_id: id,
                    dp_rank: 0,
                },
                WorkerWindow {
                    requests: id,
                    true_delta_tokens_in: 16 * id,
                    ..Default::default()
                },
            );
        }
        r
    }

    /// The `<svg>` element with `id`, whole.
    fn plot<'a>(html: &'a str, id: &str) -> &'a str {
        if let Some(start) = html.find(&format!("<p id=\"{id}\" class=\"plot-empty\"")) {
            let end = start + html[start..].find("</p>").expect("p closed") + "</p>".len();
            return &html[start..end];
        }
        let start = html
            .find(&format!("<svg id=\"{id}\""))
            .unwrap_or_else(|| panic!("no plot {id}"));
        let end = start + html[start..].find("</svg>").expect("svg closed") + "</svg>".len();
        &html[start..end]
    }

    fn attr<'a>(element: &'a str, name: &str) -> &'a str {
        let key = format!(" {name}=\"");
        let at = element.find(&key).unwrap_or_else(|| panic!("no {name}")) + key.len();
        &element[at..at + element[at..].find('"').unwrap()]
    }

    fn marks(svg: &str) -> usize {
        svg.matches("class=\"mark ").count()
    }

    #[test]
    fn every_plot_counts_the_marks_it_draws() {
        let html = report().to_html();
        let rate = plot(&html, PLOT_SPILL_RATE);
        assert_eq!(
            attr(rate, "data-marks"),
            "5",
            "the window without requests has no point"
        );
        assert_eq!(marks(rate), 5);
        assert_eq!(rate.matches("class=\"mark point spill warmup").count(), 2);
        assert_eq!(rate.matches(" fault\"").count(), 1);
        assert_eq!(rate.matches("class=\"spread-band\"").count(), 1);
        assert!(rate.contains("data-window=\"2\" data-value=\"0.2\""));

        let tokens = plot(&html, PLOT_SPILL_TOKENS);
        assert_eq!(
            attr(tokens, "data-marks"),
            "3",
            "bars only where a bin holds spills"
        );
        assert_eq!(marks(tokens), 3);
        assert_eq!(attr(tokens, "data-bins"), "3");
        assert!(tokens.contains("data-from-tokens=\"64\" data-value=\"4\""));

        let volume = plot(&html, PLOT_VOLUME);
        assert_eq!(attr(volume, "data-marks"), "18");
        assert_eq!(marks(volume), 18);
        assert_eq!(volume.matches("<polyline").count(), 3);
        assert!(volume.contains("data-window=\"5\" data-value=\"125\""));

        assert!(html.contains("<table id=\"workers\" data-rows=\"2\">"));
        assert!(html.contains("<tr data-worker=\"9/0\"><td>9/0</td><td>9</td>"));
        assert!(html.contains("style=\"width:100.0%\""));
        assert!(html.contains("<table id=\"windows-table\" data-rows=\"6\">"));
        assert!(!html.contains("data-empty"));
    }

    #[test]
    fn an_empty_report_says_so_in_every_plot() {
        let html = empty_report().to_html();
        for (id, says) in [
            (PLOT_SPILL_RATE, "No windows closed yet."),
            (PLOT_SPILL_TOKENS, "No spills measured yet."),
            (PLOT_VOLUME, "No windows closed yet."),
        ] {
            let p = plot(&html, id);
            assert_eq!(attr(p, "data-marks"), "0");
            assert_eq!(attr(p, "data-empty"), "true");
            assert!(p.contains(says), "{id}");
            assert_eq!(marks(p), 0);
        }
        assert!(
            !html.contains("class=\"legend\""),
            "no legend for an empty plot"
        );
        assert!(html.contains("data-state=\"not_enough_windows\""));
        assert!(html.contains("No window has closed yet."));
        assert!(html.contains("No workers in a measured window yet."));
        assert!(html.contains("<table id=\"workers\" data-rows=\"0\">"));
        assert!(html.trim_end().ends_with("</html>"));
    }

    #[test]
    fn windows_without_requests_leave_the_spill_rate_plot_empty() {
        let mut r = empty_report();
        r.windows.push(WindowSummary {
            start_ns: S,
            end_ns: 2 * S,
            ..Default::default()
        });
        let html = r.to_html();
        assert!(plot(&html, PLOT_SPILL_RATE).contains("No routed requests in any window yet."));
        assert_eq!(attr(plot(&html, PLOT_VOLUME), "data-marks"), "3");
    }

    #[test]
    fn text_from_records_is_escaped() {
        let mut r = report();
        let agent = "<script>alert('x')</script>&\"";
        r.agents.insert(agent.into(), AgentStatus::default());
        let html = r.to_html();
        assert!(!html.contains("<script"));
        assert!(html.contains("agent &lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;&quot;:"));
    }

    #[test]
    fn the_page_fetches_nothing() {
        let mut r = report();
        r.agents.insert("node-a".into(), AgentStatus::default());
        for html in [r.to_html(), empty_report().to_html()] {
            for needle in [
                "http://",
                "https://",
                "//",
                "@import",
                "url(",
                "<script",
                "<img",
                "<link rel=\"stylesheet\"",
            ] {
                assert!(!html.contains(needle), "the page holds {needle:?}");
            }
            assert!(html.contains("content=\"default-src 'none';"));
        }
    }

    #[test]
    fn figures_are_printed_as_the_report_has_them() {
        let mut r = report();
        r.requests = 1234;
        r.spill_rate = Some(0.1234);
        r.true_delta_tok_per_s = Spread::of([100.0, 300.0]);
        let html = r.to_html();
        assert!(html.contains("<td>routed requests</td><td>1234</td>"));
        assert!(html.contains("<div class=\"value\">12.34%</div>"));
        assert!(html.contains("<td>200 (min 100, max 300, sd 100)</td>"));
    }
}
