//! One way to write the Prometheus text format, for every kvscope `/metrics` (agent,
//! collector, actuator): a family's `# HELP` and `# TYPE` lines, then its samples.
//!
//! Two formats: the classic text format 0.0.4 (a counter's `# TYPE`/`# HELP` name its
//! `_total` sample) and OpenMetrics 1.0 (the family is named without `_total`, the text
//! ends with `# EOF`); [`Format::negotiate`] picks one from a scraper's `Accept`.
//! Histograms are cumulative buckets at fixed bounds then `+Inf`, `_sum` and `_count`;
//! label values are escaped. Names and label sets stay bounded by the caller (no
//! request ids).

use std::fmt::{Display, Write as _};

/// The exposition format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Format {
    /// `text/plain; version=0.0.4`: what `curl` and `promtool check metrics` read.
    #[default]
    Text,
    /// `application/openmetrics-text; version=1.0.0`: what Prometheus asks for first.
    OpenMetrics,
}

impl Format {
    /// OpenMetrics when the `Accept` header offers it, else the text format.
    pub fn negotiate(accept: Option<&str>) -> Self {
        if accept.is_some_and(|a| a.contains("application/openmetrics-text")) {
            Format::OpenMetrics
        } else {
            Format::Text
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// A metric family's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A label value escaped for the Prometheus text formats.
pub(crate) fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `k="v",…` with every value escaped.
pub fn labels(pairs: &[(&str, &str)]) -> String {
    let mut s = String::new();
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{k}=\"{}\"", escape_label(v));
    }
    s
}

/// `name{labels}`, or `name` alone when there are no labels.
fn series(name: &str, labels: &str) -> String {
    if labels.is_empty() {
        name.to_string()
    } else {
        format!("{name}{{{labels}}}")
    }
}

/// Exposition text under construction.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
    format: Format,
}

impl Exposition {
    pub fn new(format: Format) -> Self {
        Self {
            out: String::new(),
            format,
        }
    }

    /// Start a family: its `# HELP` and `# TYPE` lines. `name` has no `_total` (added
    /// to a counter's declaration in the text format, where metadata names the sample).
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) -> &mut Self {
        debug_assert!(
            !name.ends_with("_total"),
            "{name}: counters are declared without _total"
        );
        let declared = if kind == Kind::Counter && self.format == Format::Text {
            format!("{name}_total")
        } else {
            name.to_string()
        };
        // Writing into a String cannot fail.
        let _ = writeln!(self.out, "# HELP {declared} {}", help.replace('\n', " "));
        let _ = writeln!(self.out, "# TYPE {declared} {}", kind.as_str());
        self
    }

    /// One counter sample: `{name}_total{labels} value`. `labels` is already escaped
    /// (see [`labels`]).
    pub fn counter(&mut self, name: &str, labels: &str, value: u64) -> &mut Self {
        let _ = writeln!(
            self.out,
            "{} {value}",
            series(&format!("{name}_total"), labels)
        );
        self
    }

    /// One gauge sample.
    pub fn gauge(&mut self, name: &str, labels: &str, value: impl Display) -> &mut Self {
        let _ = writeln!(self.out, "{} {value}", series(name, labels));
        self
    }

    /// A family with a single counter sample.
    pub fn single_counter(&mut self, name: &str, help: &str, labels: &str, value: u64) {
        self.family(name, Kind::Counter, help)
            .counter(name, labels, value);
    }

    /// A family with a single gauge sample.
    pub fn single_gauge(&mut self, name: &str, help: &str, labels: &str, value: impl Display) {
        self.family(name, Kind::Gauge, help)
            .gauge(name, labels, value);
    }

    /// One histogram series: cumulative `buckets[i]` = observations ≤ `bounds[i]` (in
    /// the family's unit), then `+Inf` = `count`, `_sum` and `_count`. A bucket list
    /// shorter than the bounds repeats its last value (nothing above it was observed).
    pub fn histogram(
        &mut self,
        name: &str,
        labels: &str,
        bounds: impl IntoIterator<Item = f64>,
        buckets: &[u64],
        count: u64,
        sum: f64,
    ) -> &mut Self {
        self.histogram_with_exemplars(name, labels, bounds, buckets, count, sum, &[])
    }

    /// [`Self::histogram`] with an exemplar on some buckets (`exemplars[i]` on bucket
    /// `i`, the last on `+Inf`): `(labels of the exemplar, already escaped; value; time
    /// in seconds)`. Exemplars are OpenMetrics only: the text format gets none.
    #[allow(clippy::too_many_arguments)]
    pub fn histogram_with_exemplars(
        &mut self,
        name: &str,
        labels: &str,
        bounds: impl IntoIterator<Item = f64>,
        buckets: &[u64],
        count: u64,
        sum: f64,
        exemplars: &[Option<(String, f64, f64)>],
    ) -> &mut Self {
        let sep = if labels.is_empty() { "" } else { "," };
        let om = self.format == Format::OpenMetrics;
        let exemplar = |i: usize| match exemplars.get(i) {
            Some(Some((l, v, ts))) if om => {
                format!(" # {{{l}}} {v} {ts}")
            }
            _ => String::new(),
        };
        let mut last = 0;
        let mut n_bounds = 0;
        for (i, le) in bounds.into_iter().enumerate() {
            let n = buckets
                .get(i)
                .copied()
                .unwrap_or(if buckets.is_empty() { 0 } else { last });
            last = n;
            n_bounds = i + 1;
            let _ = writeln!(
                self.out,
                "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {n}{}",
                exemplar(i)
            );
        }
        let _ = writeln!(
            self.out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}{}",
            exemplar(n_bounds)
        );
        let _ = writeln!(self.out, "{} {sum}", series(&format!("{name}_sum"), labels));
        let _ = writeln!(
            self.out,
            "{} {count}",
            series(&format!("{name}_count"), labels)
        );
        self
    }

    /// The text, with OpenMetrics' closing `# EOF`.
    pub fn finish(mut self) -> String {
        if self.format == Format::OpenMetrics {
            self.out.push_str("# EOF\n");
        }
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exemplars_go_on_their_buckets_in_openmetrics_only() {
        let ex = vec![
            None,
            Some(("trace_id=\"ab\"".to_string(), 20.0, 1.5)),
            Some(("trace_id=\"cd\"".to_string(), 99.0, 2.0)),
        ];
        let mut om = Exposition::new(Format::OpenMetrics);
        om.family("t", Kind::Histogram, "T.")
            .histogram_with_exemplars("t", "", [16.0, 32.0], &[1, 2], 3, 135.0, &ex);
        let text = om.finish();
        assert!(text.contains("t_bucket{le=\"16\"} 1\n"), "{text}");
        assert!(
            text.contains("t_bucket{le=\"32\"} 2 # {trace_id=\"ab\"} 20 1.5\n"),
            "{text}"
        );
        assert!(
            text.contains("t_bucket{le=\"+Inf\"} 3 # {trace_id=\"cd\"} 99 2\n"),
            "{text}"
        );
        assert!(
            text.contains("t_sum 135\n") && text.contains("t_count 3\n"),
            "{text}"
        );
        let mut plain = Exposition::new(Format::Text);
        plain.histogram_with_exemplars("t", "", [16.0, 32.0], &[1, 2], 3, 135.0, &ex);
        assert!(
            !plain.finish().contains("trace_id"),
            "no exemplars in the text format"
        );
    }

    #[test]
    fn writes_families_and_escapes() {
        let mut e = Exposition::new(Format::Text);
        e.single_counter("x_requests", "Requests.", &labels(&[("a", "q\"\\\n")]), 3);
        e.family("x_latency_seconds", Kind::Histogram, "Latency.")
            .histogram("x_latency_seconds", "", [0.5, 1.0, 2.0], &[1, 2], 4, 3.5);
        let t = e.finish();
        assert_eq!(
            t,
            "# HELP x_requests_total Requests.\n# TYPE x_requests_total counter\n\
             x_requests_total{a=\"q\\\"\\\\\\n\"} 3\n\
             # HELP x_latency_seconds Latency.\n# TYPE x_latency_seconds histogram\n\
             x_latency_seconds_bucket{le=\"0.5\"} 1\n\
             x_latency_seconds_bucket{le=\"1\"} 2\n\
             x_latency_seconds_bucket{le=\"2\"} 2\n\
             x_latency_seconds_bucket{le=\"+Inf\"} 4\n\
             x_latency_seconds_sum 3.5\n\
             x_latency_seconds_count 4\n"
        );
        let mut e = Exposition::new(Format::OpenMetrics);
        e.single_counter("x_requests", "Requests.", "", 3);
        assert_eq!(
            e.finish(),
            "# HELP x_requests Requests.\n# TYPE x_requests counter\nx_requests_total 3\n# EOF\n"
        );
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
            )),
            Format::OpenMetrics
        );
        assert_eq!(Format::negotiate(Some("*/*")), Format::Text);
        assert_eq!(Format::negotiate(None), Format::Text);
    }
}
