//! Plot primitives for the HTML report: a frame that maps data to an SVG viewBox, axes
//! with grid lines and tick labels, tick choice and text escaping. Pure string building.

use std::fmt::Write as _;

/// Every plot's viewBox; the page scales it to its column width.
pub(super) const WIDTH: f64 = 900.0;
pub(super) const HEIGHT: f64 = 300.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 14.0;
const BOTTOM: f64 = 44.0;

/// Escape text for HTML/SVG element content and double- or single-quoted attributes.
pub(super) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A coordinate in the viewBox, to a tenth of a pixel.
pub(super) fn px(v: f64) -> String {
    format!("{v:.1}")
}

/// A number for a tick label or a legend: 950, 1.2k, 35k, 1.5M; small values keep two
/// decimals at most.
pub(super) fn compact(v: f64) -> String {
    let a = v.abs();
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    if a >= 1e9 {
        format!("{}G", trim(format!("{:.1}", v / 1e9)))
    } else if a >= 1e6 {
        format!("{}M", trim(format!("{:.1}", v / 1e6)))
    } else if a >= 1e4 {
        format!("{}k", trim(format!("{:.0}", v / 1e3)))
    } else if a >= 1e3 {
        format!("{}k", trim(format!("{:.1}", v / 1e3)))
    } else {
        trim(format!("{v:.2}"))
    }
}

/// A step of 1, 2 or 5 × 10^k that cuts `span` into about `target` pieces.
fn nice_step(span: f64, target: usize) -> f64 {
    if !(span.is_finite() && span > 0.0) {
        return 1.0;
    }
    let raw = span / target.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let m = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

/// Ticks from 0 through the first tick at or above `max` (at least `floor`): the axis
/// then ends on a labelled tick.
pub(super) fn ticks_to(max: f64, floor: f64, target: usize) -> Vec<f64> {
    let top = if max.is_finite() {
        max.max(floor)
    } else {
        floor
    };
    let step = nice_step(top, target);
    let n = (top / step - 1e-9).ceil().max(1.0) as usize;
    (0..=n).map(|i| i as f64 * step).collect()
}

/// Ticks for a time axis of `span` seconds: at most 8, on round seconds, minutes or
/// hours, labelled in that unit.
pub(super) fn time_ticks(span: f64) -> Vec<(f64, String)> {
    const STEPS: [f64; 18] = [
        1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 7200.0,
        10800.0, 21600.0, 43200.0, 86400.0,
    ];
    let span = if span.is_finite() { span.max(0.0) } else { 0.0 };
    let step = STEPS
        .iter()
        .copied()
        .find(|s| span / s <= 8.0)
        .unwrap_or_else(|| (span / 8.0 / 86400.0).ceil() * 86400.0);
    let (unit, name) = if step >= 3600.0 {
        (3600.0, "h")
    } else if step >= 60.0 {
        (60.0, "min")
    } else {
        (1.0, "s")
    };
    let n = (span / step + 1e-9).floor() as usize;
    (0..=n)
        .map(|i| {
            let v = i as f64 * step;
            (v, format!("{} {name}", compact(v / unit)))
        })
        .collect()
}

/// Maps data coordinates onto the plot area of the viewBox.
pub(super) struct Frame {
    x: (f64, f64),
    y: (f64, f64),
}

impl Frame {
    pub(super) fn new(x: (f64, f64), y: (f64, f64)) -> Self {
        let fix = |(lo, hi): (f64, f64)| if hi > lo { (lo, hi) } else { (lo, lo + 1.0) };
        Self {
            x: fix(x),
            y: fix(y),
        }
    }

    pub(super) fn x(&self, v: f64) -> f64 {
        LEFT + (v - self.x.0) / (self.x.1 - self.x.0) * (WIDTH - LEFT - RIGHT)
    }

    pub(super) fn y(&self, v: f64) -> f64 {
        HEIGHT - BOTTOM - (v - self.y.0) / (self.y.1 - self.y.0) * (HEIGHT - TOP - BOTTOM)
    }

    pub(super) fn left(&self) -> f64 {
        LEFT
    }

    pub(super) fn right(&self) -> f64 {
        WIDTH - RIGHT
    }

    pub(super) fn top(&self) -> f64 {
        TOP
    }

    pub(super) fn bottom(&self) -> f64 {
        HEIGHT - BOTTOM
    }

    /// Horizontal grid lines with y tick labels, x tick labels, and both axis titles.
    pub(super) fn axes(
        &self,
        out: &mut String,
        x_ticks: &[(f64, String)],
        y_ticks: &[(f64, String)],
        x_title: &str,
        y_title: &str,
    ) {
        let _ = write!(out, r#"<g class="axes">"#);
        for (v, label) in y_ticks {
            let y = px(self.y(*v));
            let _ = write!(
                out,
                r#"<line class="grid" x1="{}" x2="{}" y1="{y}" y2="{y}"/><text class="tick" x="{}" y="{y}" dy="0.32em" text-anchor="end">{}</text>"#,
                px(self.left()),
                px(self.right()),
                px(self.left() - 6.0),
                escape(label)
            );
        }
        let _ = write!(
            out,
            r#"<line class="baseline" x1="{}" x2="{}" y1="{b}" y2="{b}"/>"#,
            px(self.left()),
            px(self.right()),
            b = px(self.bottom())
        );
        for (v, label) in x_ticks {
            let x = px(self.x(*v));
            let _ = write!(
                out,
                r#"<line class="tickmark" x1="{x}" x2="{x}" y1="{}" y2="{}"/><text class="tick" x="{x}" y="{}" text-anchor="middle">{}</text>"#,
                px(self.bottom()),
                px(self.bottom() + 4.0),
                px(self.bottom() + 16.0),
                escape(label)
            );
        }
        let _ = write!(
            out,
            r#"<text class="axis-title" x="{}" y="{}" text-anchor="middle">{}</text><text class="axis-title" transform="translate(14 {}) rotate(-90)" text-anchor="middle">{}</text></g>"#,
            px((self.left() + self.right()) / 2.0),
            px(HEIGHT - 6.0),
            escape(x_title),
            px((self.top() + self.bottom()) / 2.0),
            escape(y_title)
        );
    }
}

/// Opens a plot's `<svg>`: a stable id and class, and `data-marks` counting the marks
/// (points, bars) drawn from data, so a test can tell a plot of real data from an empty
/// frame.
pub(super) fn open(out: &mut String, id: &str, label: &str, marks: usize, extra: &str) {
    let _ = write!(
        out,
        r#"<svg id="{id}" class="plot" data-marks="{marks}"{extra} viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{}">"#,
        escape(label)
    );
}

/// A plot with nothing to draw: no frame, only the sentence saying why, as a paragraph
/// that wraps to the page (an empty frame reads as a broken chart, and a sentence set
/// in SVG runs past its edge). It keeps the plot's id, `data-marks="0"` and
/// `data-empty="true"`, so a reader of the page finds it where the plot would be.
pub(super) fn empty(out: &mut String, id: &str, label: &str, message: &str) {
    let _ = write!(
        out,
        r#"<p id="{id}" class="plot-empty" data-marks="0" data-empty="true" role="note" aria-label="{}">{}</p>"#,
        escape(label),
        escape(message)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_covers_markup_and_quotes() {
        assert_eq!(
            escape(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn ticks_end_on_a_round_number_above_the_max() {
        let labels = |t: Vec<f64>| t.into_iter().map(compact).collect::<Vec<_>>().join(" ");
        assert_eq!(labels(ticks_to(0.37, 0.0, 5)), "0 0.1 0.2 0.3 0.4");
        assert_eq!(labels(ticks_to(0.0, 1.0, 5)), "0 0.2 0.4 0.6 0.8 1");
        assert_eq!(labels(ticks_to(1000.0, 0.0, 5)), "0 200 400 600 800 1k");
        assert_eq!(labels(ticks_to(12_345.0, 0.0, 5)), "0 5k 10k 15k");
        assert_eq!(labels(ticks_to(f64::NAN, 1.0, 4)), "0 0.5 1");
    }

    #[test]
    fn compact_numbers() {
        assert_eq!(compact(0.0), "0");
        assert_eq!(compact(2.5), "2.5");
        assert_eq!(compact(950.0), "950");
        assert_eq!(compact(1200.0), "1.2k");
        assert_eq!(compact(35_000.0), "35k");
        assert_eq!(compact(1_500_000.0), "1.5M");
        let labels = |t: Vec<(f64, String)>| t.into_iter().map(|t| t.1).collect::<Vec<_>>();
        assert_eq!(labels(time_ticks(9.5)), ["0 s", "2 s", "4 s", "6 s", "8 s"]);
        assert_eq!(labels(time_ticks(300.0))[..3], ["0 min", "1 min", "2 min"]);
        assert_eq!(labels(time_ticks(86400.0))[1], "3 h");
        assert_eq!(labels(time_ticks(0.0)), ["0 s"]);
    }

    #[test]
    fn frame_maps_data_into_the_plot_area() {
        let f = Frame::new((0.0, 10.0), (0.0, 1.0));
        assert_eq!(f.x(0.0), f.left());
        assert_eq!(f.x(10.0), f.right());
        assert_eq!(f.y(0.0), f.bottom());
        assert_eq!(f.y(1.0), f.top());
        let degenerate = Frame::new((5.0, 5.0), (0.0, 0.0));
        assert!(degenerate.x(5.0).is_finite() && degenerate.y(0.0).is_finite());
    }
}
