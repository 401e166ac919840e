//! The report's plots as inline SVG: spill rate per window with its spread, spills by
//! tokens per spill (true delta beside the upper bound), and migratable vs uncached
//! prefill volume per window. Each returns whether it drew data; an empty plot says why.

use super::pct;
use super::svg::{self, compact, escape, px, ticks_to, time_ticks, Frame};
use super::OpportunityReport;
use kvscope_wire::api::window::WindowSummary;
use std::fmt::Write as _;

/// Plot ids. Keep them stable: the browser test and anyone scraping the page use them.
pub(super) const PLOT_SPILL_RATE: &str = "plot-spill-rate";
pub(super) const PLOT_SPILL_TOKENS: &str = "plot-spill-tokens";
pub(super) const PLOT_VOLUME: &str = "plot-volume";

/// Window times on the plots' x axis: seconds since the first window opened.
pub(super) struct Timeline {
    t0: u64,
    span: f64,
}

impl Timeline {
    pub(super) fn of(ws: &[WindowSummary]) -> Self {
        let t0 = ws.first().map_or(0, |w| w.start_ns);
        let end = ws.iter().map(|w| w.end_ns).max().unwrap_or(t0);
        Self {
            t0,
            span: end.saturating_sub(t0) as f64 / 1e9,
        }
    }

    pub(super) fn at(&self, ns: u64) -> f64 {
        ns.saturating_sub(self.t0) as f64 / 1e9
    }

    fn mid(&self, w: &WindowSummary) -> f64 {
        (self.at(w.start_ns) + self.at(w.end_ns)) / 2.0
    }

    fn frame(&self, y_ticks: &[f64]) -> Frame {
        Frame::new(
            (0.0, self.span),
            (0.0, y_ticks.last().copied().unwrap_or(1.0)),
        )
    }

    /// Grey bands behind the warm-up windows.
    fn shade_warmup(&self, out: &mut String, f: &Frame, ws: &[WindowSummary]) {
        for w in ws.iter().filter(|w| w.warmup) {
            let (x0, x1) = (f.x(self.at(w.start_ns)), f.x(self.at(w.end_ns)));
            let _ = write!(
                out,
                "<rect class=\"warmup-shade\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\"/>",
                px(x0),
                px(f.top()),
                px(x1 - x0),
                px(f.bottom() - f.top())
            );
        }
    }

    fn label(&self, i: usize, w: &WindowSummary) -> String {
        format!(
            "window {i} at {:.0} s{}",
            self.at(w.start_ns),
            if w.warmup { " (warm-up)" } else { "" }
        )
    }
}

pub(super) fn polyline(out: &mut String, class: &str, points: &[(f64, f64)]) {
    if points.len() < 2 {
        return;
    }
    let _ = write!(out, "<polyline class=\"line {class}\" points=\"");
    for (i, (x, y)) in points.iter().enumerate() {
        let _ = write!(out, "{}{},{}", if i > 0 { " " } else { "" }, px(*x), px(*y));
    }
    out.push_str("\"/>");
}

/// Returns whether it drew data (false: an empty plot saying why).
pub(super) fn spill_rate_plot(out: &mut String, r: &OpportunityReport) -> bool {
    let label = "Spill rate per window";
    let points: Vec<(usize, &WindowSummary, f64)> = r
        .windows
        .iter()
        .enumerate()
        .filter_map(|(i, w)| w.spill_rate.map(|s| (i, w, s)))
        .collect();
    if r.windows.is_empty() {
        svg::empty(out, PLOT_SPILL_RATE, label, "No windows closed yet.");
        return false;
    }
    if points.is_empty() {
        svg::empty(
            out,
            PLOT_SPILL_RATE,
            label,
            "No routed requests in any window yet.",
        );
        return false;
    }
    let t = Timeline::of(&r.windows);
    let sr = &r.spill_rate_per_window;
    let top = points
        .iter()
        .map(|p| p.2)
        .chain([sr.max, sr.mean + sr.stddev])
        .fold(0.0, f64::max)
        .min(1.0);
    let yt = ticks_to(top, 0.05, 5);
    let f = t.frame(&yt);
    let extra = format!(
        " data-windows=\"{}\" data-measured-windows=\"{}\"",
        r.windows.len(),
        sr.windows
    );
    svg::open(out, PLOT_SPILL_RATE, label, points.len(), &extra);
    t.shade_warmup(out, &f, &r.windows);
    let y_labels: Vec<(f64, String)> = yt
        .iter()
        .map(|v| (*v, format!("{}%", compact(v * 100.0))))
        .collect();
    f.axes(
        out,
        &time_ticks(t.span),
        &y_labels,
        "seconds since the first window",
        "spill rate",
    );
    let measured: Vec<&WindowSummary> = r.windows.iter().filter(|w| !w.warmup).collect();
    if let (true, Some(first), Some(last)) = (sr.windows > 0, measured.first(), measured.last()) {
        let (x0, x1) = (f.x(t.at(first.start_ns)), f.x(t.at(last.end_ns)));
        let (hi, lo) = (
            f.y((sr.mean + sr.stddev).min(yt[yt.len() - 1])),
            f.y((sr.mean - sr.stddev).max(0.0)),
        );
        let _ = write!(
            out,
            "<rect class=\"spread-band\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\"><title>mean \
             {} ± sd {} over {} measured windows</title></rect>",
            px(x0),
            px(hi),
            px(x1 - x0),
            px(lo - hi),
            pct(Some(sr.mean)),
            pct(Some(sr.stddev)),
            sr.windows
        );
        for (class, v) in [
            ("spread-range", sr.min),
            ("spread-range", sr.max),
            ("spread-mean", sr.mean),
        ] {
            let y = px(f.y(v));
            let _ = write!(
                out,
                "<line class=\"{class}\" x1=\"{}\" x2=\"{}\" y1=\"{y}\" y2=\"{y}\"/>",
                px(x0),
                px(x1)
            );
        }
    }
    let xy: Vec<(f64, f64)> = points
        .iter()
        .map(|(_, w, s)| (f.x(t.mid(w)), f.y(*s)))
        .collect();
    polyline(out, "spill", &xy);
    for ((i, w, s), (x, y)) in points.iter().zip(&xy) {
        let _ = write!(
            out,
            "<circle class=\"mark point spill {}{}\" cx=\"{}\" cy=\"{}\" r=\"4\" data-window=\"{i}\" \
             data-value=\"{s}\"><title>{}: spill rate {} ({} spills / {} requests{})</title></circle>",
            if w.warmup { "warmup" } else { "measured" },
            if w.data_faults > 0 { " fault" } else { "" },
            px(*x),
            px(*y),
            escape(&t.label(*i, w)),
            pct(Some(*s)),
            w.spills,
            w.requests,
            if w.data_faults > 0 {
                format!(", {} data faults", w.data_faults)
            } else {
                String::new()
            }
        );
    }
    out.push_str("</svg>\n");
    true
}

/// Returns whether it drew data (false: an empty plot saying why).
pub(super) fn spill_tokens_plot(out: &mut String, r: &OpportunityReport) -> bool {
    let label = "Spills by tokens per spill: true delta vs upper bound";
    let bins = &r.spill_token_bins;
    if bins.is_empty() {
        svg::empty(out, PLOT_SPILL_TOKENS, label, "No spills measured yet.");
        return false;
    }
    let n = bins.len();
    let most = bins
        .iter()
        .map(|b| b.true_delta_spills.max(b.upper_bound_spills))
        .max()
        .unwrap_or(0);
    let yt = ticks_to(most as f64, 5.0, 5);
    let f = Frame::new((0.0, n as f64), (0.0, yt[yt.len() - 1]));
    let marks = bins
        .iter()
        .map(|b| usize::from(b.true_delta_spills > 0) + usize::from(b.upper_bound_spills > 0))
        .sum();
    svg::open(
        out,
        PLOT_SPILL_TOKENS,
        label,
        marks,
        &format!(" data-bins=\"{n}\""),
    );
    let every = n.div_ceil(12);
    let x_ticks: Vec<(f64, String)> = (0..=n)
        .filter(|i| i % every == 0)
        .map(|i| {
            let edge = bins.get(i).map_or(bins[n - 1].to_tokens, |b| b.from_tokens);
            (i as f64, edge.to_string())
        })
        .collect();
    let y_ticks: Vec<(f64, String)> = yt.iter().map(|v| (*v, compact(*v))).collect();
    f.axes(
        out,
        &x_ticks,
        &y_ticks,
        "tokens per spill (bin from n to 2n)",
        "spills",
    );
    for (i, b) in bins.iter().enumerate() {
        for (class, what, count, offset) in [
            ("true-delta", "true delta", b.true_delta_spills, 0.12),
            ("upper-bound", "upper bound", b.upper_bound_spills, 0.52),
        ] {
            if count == 0 {
                continue;
            }
            let (x0, x1) = (f.x(i as f64 + offset), f.x(i as f64 + offset + 0.36));
            let (y0, y1) = (f.y(count as f64), f.y(0.0));
            let _ = write!(
                out,
                "<rect class=\"mark bar {class}\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" \
                 data-from-tokens=\"{}\" data-value=\"{count}\"><title>{what} {}–{} tokens: \
                 {count} spills</title></rect>",
                px(x0),
                px(y0),
                px(x1 - x0),
                px(y1 - y0),
                b.from_tokens,
                b.from_tokens,
                b.to_tokens - 1
            );
        }
    }
    out.push_str("</svg>\n");
    true
}

type WindowFigure = fn(&WindowSummary) -> f64;

/// Returns whether it drew data (false: an empty plot saying why).
pub(super) fn volume_plot(out: &mut String, r: &OpportunityReport) -> bool {
    let label = "Migratable vs uncached prefill tokens per second per window";
    if r.windows.is_empty() {
        svg::empty(out, PLOT_VOLUME, label, "No windows closed yet.");
        return false;
    }
    let series: [(&str, &str, WindowFigure); 3] = [
        ("uncached", "uncached prefill", |w| {
            w.uncached_prefill_tok_per_s
        }),
        ("upper-bound", "upper bound", |w| w.upper_bound_tok_per_s),
        ("true-delta", "true delta", |w| w.true_delta_tok_per_s),
    ];
    let t = Timeline::of(&r.windows);
    let top = r
        .windows
        .iter()
        .flat_map(|w| series.iter().map(move |s| (s.2)(w)))
        .fold(0.0, f64::max);
    let yt = ticks_to(top, 1.0, 5);
    let f = t.frame(&yt);
    svg::open(
        out,
        PLOT_VOLUME,
        label,
        series.len() * r.windows.len(),
        &format!(
            " data-windows=\"{}\" data-series=\"{}\"",
            r.windows.len(),
            series.len()
        ),
    );
    t.shade_warmup(out, &f, &r.windows);
    let y_ticks: Vec<(f64, String)> = yt.iter().map(|v| (*v, compact(*v))).collect();
    f.axes(
        out,
        &time_ticks(t.span),
        &y_ticks,
        "seconds since the first window",
        "tokens / s",
    );
    for (class, what, figure) in series {
        let xy: Vec<(f64, f64)> = r
            .windows
            .iter()
            .map(|w| (f.x(t.mid(w)), f.y(figure(w))))
            .collect();
        polyline(out, class, &xy);
        for (i, (w, (x, y))) in r.windows.iter().zip(&xy).enumerate() {
            let _ = write!(
                out,
                "<circle class=\"mark point {class}\" cx=\"{}\" cy=\"{}\" r=\"3\" data-window=\"{i}\" \
                 data-value=\"{}\"><title>{}: {what} {:.0} tok/s</title></circle>",
                px(*x),
                px(*y),
                figure(w),
                escape(&t.label(i, w)),
                figure(w)
            );
        }
    }
    out.push_str("</svg>\n");
    true
}
