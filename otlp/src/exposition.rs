//! OTLP metrics from the Prometheus text a process serves on `/metrics`.
//!
//! The agent and the collector render `/metrics` from their state at scrape time; the
//! OTLP metrics are converted from that same text, so both carry the same figures by
//! construction and a renamed or added Prometheus metric needs no change here.
//! Counters become cumulative monotonic sums, gauges gauges, and histograms (including
//! the NIXL latency buckets the collector merges from the agents' reports, which no SDK
//! instrument can take) explicit-bucket histograms with the same bounds.

use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::{
    metric, number_data_point, AggregationTemporality, Gauge, Histogram, HistogramDataPoint,
    Metric, NumberDataPoint, Sum,
};
use std::collections::BTreeMap;

/// The metrics of one exposition and what could not be converted.
#[derive(Debug, Default, PartialEq)]
pub struct Converted {
    pub metrics: Vec<Metric>,
    /// Sample lines that did not parse, or whose family's type is not supported
    /// (summaries): counted, logged by the caller, never silently lost.
    pub skipped_samples: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
    Unsupported,
}

#[derive(Debug)]
struct Family {
    kind: Kind,
    help: String,
}

/// Label pairs in exposition order.
type Labels = Vec<(String, String)>;
/// One parsed sample line: name, labels, value.
type Sample = (String, Labels, f64);

fn parse_labels(s: &str) -> Option<(Vec<(String, String)>, &str)> {
    // s starts after '{'; returns the labels and the rest after '}'.
    let mut labels = Vec::new();
    let mut rest = s;
    loop {
        rest = rest.trim_start_matches([' ', ',']);
        if let Some(r) = rest.strip_prefix('}') {
            return Some((labels, r));
        }
        let eq = rest.find('=')?;
        let name = rest[..eq].trim().to_string();
        rest = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        labels.push((name, value));
        rest = &rest[end + 1..];
    }
}

fn parse_sample(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' ']).unwrap_or(line.len());
    let name = line[..name_end].to_string();
    let (labels, rest) = if line[name_end..].starts_with('{') {
        parse_labels(&line[name_end + 1..])?
    } else {
        (Vec::new(), &line[name_end..])
    };
    // The value, then an optional timestamp.
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((name, labels, value))
}

fn attribute(k: &str, v: &str) -> KeyValue {
    KeyValue {
        key: k.to_string(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(v.to_string())),
        }),
        ..Default::default()
    }
}

fn attributes(labels: &[(String, String)]) -> Vec<KeyValue> {
    labels.iter().map(|(k, v)| attribute(k, v)).collect()
}

/// The UCUM unit a Prometheus name's suffix states.
fn unit_of(family: &str) -> &'static str {
    if family.ends_with("_seconds") {
        "s"
    } else if family.ends_with("_bytes") {
        "By"
    } else {
        ""
    }
}

fn number(v: f64) -> number_data_point::Value {
    // Counts stay integers on the wire; anything fractional is a double.
    if v.fract() == 0.0 && v.abs() < 9.0e15 {
        number_data_point::Value::AsInt(v as i64)
    } else {
        number_data_point::Value::AsDouble(v)
    }
}

#[derive(Default)]
struct HistogramParts {
    /// (upper bound, cumulative count)
    buckets: Vec<(f64, f64)>,
    count: Option<f64>,
    sum: Option<f64>,
}

/// The start time of each cumulative series across exports. A series that went down
/// since the last export was reset (a relayed agent restarted, its counters with it):
/// its start time moves to just after that export, as OTLP wants for cumulative
/// data, so a receiver does not read the drop as negative.
#[derive(Debug, Default)]
pub(crate) struct CumulativeStarts {
    last: std::collections::HashMap<String, (f64, u64, u64)>,
}

impl CumulativeStarts {
    fn key(name: &str, attributes: &[KeyValue]) -> String {
        let mut k = name.to_string();
        for a in attributes {
            k.push('\u{1f}');
            k.push_str(&a.key);
            k.push('=');
            if let Some(any_value::Value::StringValue(v)) =
                a.value.as_ref().and_then(|v| v.value.as_ref())
            {
                k.push_str(v);
            }
        }
        k
    }

    /// Move the start times of the series in `metrics` that were reset, remembering
    /// every series' value, start and time for the next export.
    pub fn apply(&mut self, metrics: &mut [Metric]) {
        for m in metrics.iter_mut() {
            match &mut m.data {
                Some(metric::Data::Sum(s)) if s.is_monotonic => {
                    for p in &mut s.data_points {
                        let v = match p.value {
                            Some(number_data_point::Value::AsInt(i)) => i as f64,
                            Some(number_data_point::Value::AsDouble(d)) => d,
                            None => continue,
                        };
                        let key = Self::key(&m.name, &p.attributes);
                        p.start_time_unix_nano =
                            self.next(key, v, p.start_time_unix_nano, p.time_unix_nano);
                    }
                }
                Some(metric::Data::Histogram(h)) => {
                    for p in &mut h.data_points {
                        let key = Self::key(&m.name, &p.attributes);
                        p.start_time_unix_nano = self.next(
                            key,
                            p.count as f64,
                            p.start_time_unix_nano,
                            p.time_unix_nano,
                        );
                    }
                }
                _ => {}
            }
        }
    }

    /// The start time of a series at value `v` now, given its default start.
    fn next(&mut self, key: String, v: f64, default_start: u64, now: u64) -> u64 {
        let start = match self.last.get(&key) {
            Some(&(last_v, start, _)) if v >= last_v => start,
            Some(&(_, _, last_t)) => last_t.saturating_add(1),
            None => default_start,
        };
        self.last.insert(key, (v, start, now));
        start
    }
}

/// Convert `text` (Prometheus 0.0.4 or OpenMetrics 1.0 exposition) into OTLP metrics.
/// `start_ns` is when the cumulative figures started counting (the process start);
/// `now_ns` the time of the figures.
pub fn convert(text: &str, start_ns: u64, now_ns: u64) -> Converted {
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut samples: Vec<Sample> = Vec::new();
    let mut skipped = 0u64;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix('#') {
            let mut parts = rest.trim_start().splitn(3, ' ');
            let (what, name, arg) = (parts.next(), parts.next(), parts.next().unwrap_or(""));
            let Some(name) = name else { continue };
            let fam = families.entry(name.to_string()).or_insert_with(|| {
                order.push(name.to_string());
                Family {
                    kind: Kind::Gauge,
                    help: String::new(),
                }
            });
            match what {
                Some("TYPE") => {
                    fam.kind = match arg.trim() {
                        "counter" => Kind::Counter,
                        "histogram" => Kind::Histogram,
                        "gauge" | "untyped" | "unknown" | "info" | "stateset" => Kind::Gauge,
                        _ => Kind::Unsupported,
                    }
                }
                Some("HELP") => fam.help = arg.to_string(),
                _ => {}
            }
            continue;
        }
        match parse_sample(line) {
            Some(s) => samples.push(s),
            None => skipped += 1,
        }
    }

    // Which family a sample belongs to: its own name, or its name less a suffix the
    // family's type gives its samples.
    let family_of = |name: &str| -> Option<(&str, &'static str)> {
        if let Some((n, _)) = families.get_key_value(name) {
            return Some((n.as_str(), ""));
        }
        for suffix in ["_total", "_bucket", "_count", "_sum", "_created", "_info"] {
            if let Some(base) = name.strip_suffix(suffix) {
                if let Some((n, _)) = families.get_key_value(base) {
                    return Some((n.as_str(), suffix));
                }
            }
        }
        None
    };

    let mut points: BTreeMap<String, Vec<(Labels, f64)>> = BTreeMap::new();
    let mut hists: BTreeMap<String, BTreeMap<Labels, HistogramParts>> = BTreeMap::new();
    let mut untyped: Vec<String> = Vec::new();
    for (name, mut labels, value) in samples {
        let Some((fam, suffix)) = family_of(&name) else {
            // A sample without TYPE line: an untyped gauge of its own name.
            if !untyped.contains(&name) {
                untyped.push(name.clone());
            }
            points.entry(name).or_default().push((labels, value));
            continue;
        };
        let fam = fam.to_string();
        let kind = families[&fam].kind;
        match (kind, suffix) {
            (Kind::Counter, "_created") => {}
            (Kind::Counter | Kind::Gauge, _) => {
                points.entry(fam).or_default().push((labels, value))
            }
            (Kind::Histogram, "_bucket") => {
                let Some(i) = labels.iter().position(|(k, _)| k == "le") else {
                    skipped += 1;
                    continue;
                };
                let le = labels.remove(i).1;
                let bound = match le.as_str() {
                    "+Inf" => f64::INFINITY,
                    v => match v.parse() {
                        Ok(b) => b,
                        Err(_) => {
                            skipped += 1;
                            continue;
                        }
                    },
                };
                hists
                    .entry(fam)
                    .or_default()
                    .entry(labels)
                    .or_default()
                    .buckets
                    .push((bound, value));
            }
            (Kind::Histogram, "_count") => {
                hists
                    .entry(fam)
                    .or_default()
                    .entry(labels)
                    .or_default()
                    .count = Some(value)
            }
            (Kind::Histogram, "_sum") => {
                hists.entry(fam).or_default().entry(labels).or_default().sum = Some(value)
            }
            (Kind::Histogram, "_created") => {}
            _ => skipped += 1,
        }
    }

    let number_point = |labels: &[(String, String)], v: f64, start: u64| NumberDataPoint {
        attributes: attributes(labels),
        start_time_unix_nano: start,
        time_unix_nano: now_ns,
        value: Some(number(v)),
        ..Default::default()
    };
    let mut metrics = Vec::new();
    let names = order
        .iter()
        .map(String::as_str)
        .chain(untyped.iter().map(String::as_str));
    for name in names {
        let (kind, help) = families
            .get(name)
            .map_or((Kind::Gauge, ""), |f| (f.kind, f.help.as_str()));
        let data = match kind {
            Kind::Counter => {
                let Some(rows) = points.get(name) else {
                    continue;
                };
                metric::Data::Sum(Sum {
                    data_points: rows
                        .iter()
                        .map(|(l, v)| number_point(l, *v, start_ns))
                        .collect(),
                    aggregation_temporality: AggregationTemporality::Cumulative as i32,
                    is_monotonic: true,
                })
            }
            Kind::Gauge => {
                let Some(rows) = points.get(name) else {
                    continue;
                };
                metric::Data::Gauge(Gauge {
                    data_points: rows.iter().map(|(l, v)| number_point(l, *v, 0)).collect(),
                })
            }
            Kind::Histogram => {
                let Some(series) = hists.get(name) else {
                    continue;
                };
                let mut data_points = Vec::new();
                for (labels, parts) in series {
                    match histogram_point(labels, parts, start_ns, now_ns) {
                        Some(p) => data_points.push(p),
                        None => skipped += 1,
                    }
                }
                metric::Data::Histogram(Histogram {
                    data_points,
                    aggregation_temporality: AggregationTemporality::Cumulative as i32,
                })
            }
            Kind::Unsupported => continue,
        };
        // The text format declares a counter by its `_total` sample, OpenMetrics by the
        // family: either way the OTLP sum is named without it, as OTel's Prometheus
        // receiver does.
        let name = match kind {
            Kind::Counter => name.strip_suffix("_total").unwrap_or(name),
            _ => name,
        };
        metrics.push(Metric {
            name: name.to_string(),
            description: help.to_string(),
            unit: unit_of(name).to_string(),
            data: Some(data),
            ..Default::default()
        });
    }
    Converted {
        metrics,
        skipped_samples: skipped,
    }
}

/// Cumulative `le` buckets → OTLP's per-bucket counts over explicit bounds.
fn histogram_point(
    labels: &[(String, String)],
    parts: &HistogramParts,
    start_ns: u64,
    now_ns: u64,
) -> Option<HistogramDataPoint> {
    let mut buckets = parts.buckets.clone();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let count = parts
        .count
        .or_else(|| buckets.last().filter(|b| b.0.is_infinite()).map(|b| b.1))?;
    let mut bounds = Vec::new();
    let mut counts = Vec::new();
    let mut below = 0.0;
    for (le, cumulative) in &buckets {
        if le.is_infinite() {
            break;
        }
        bounds.push(*le);
        counts.push((cumulative - below).max(0.0) as u64);
        below = *cumulative;
    }
    counts.push((count - below).max(0.0) as u64);
    Some(HistogramDataPoint {
        attributes: attributes(labels),
        start_time_unix_nano: start_ns,
        time_unix_nano: now_ns,
        count: count as u64,
        sum: parts.sum,
        bucket_counts: counts,
        explicit_bounds: bounds,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_that_went_down_gets_a_new_start_time() {
        let text = |n: u64, hist: u64| {
            format!(
                "# TYPE c counter\nc_total{{agent=\"a\"}} {n}\nc_total{{agent=\"b\"}} 5\n# TYPE h histogram\nh_bucket{{le=\"1\"}} {hist}\nh_bucket{{le=\"+Inf\"}} {hist}\nh_sum {hist}\nh_count {hist}\n"
            )
        };
        let start = |c: &Converted, name: &str, i: usize| match find(c, name) {
            metric::Data::Sum(s) => s.data_points[i].start_time_unix_nano,
            metric::Data::Histogram(h) => h.data_points[i].start_time_unix_nano,
            _ => panic!("{name}"),
        };
        let mut starts = CumulativeStarts::default();
        let mut c = convert(&text(10, 4), 100, 1_000);
        starts.apply(&mut c.metrics);
        assert_eq!(
            (start(&c, "c", 0), start(&c, "c", 1), start(&c, "h", 0)),
            (100, 100, 100)
        );
        let mut c = convert(&text(12, 6), 100, 2_000);
        starts.apply(&mut c.metrics);
        assert_eq!(start(&c, "c", 0), 100, "still counting up");
        // Agent a restarted (12 -> 3) and so did the histogram's source: new starts just
        // after the previous export; b is untouched.
        let mut c = convert(&text(3, 1), 100, 3_000);
        starts.apply(&mut c.metrics);
        assert_eq!(
            (start(&c, "c", 0), start(&c, "c", 1), start(&c, "h", 0)),
            (2_001, 100, 2_001)
        );
        let mut c = convert(&text(4, 2), 100, 4_000);
        starts.apply(&mut c.metrics);
        assert_eq!(start(&c, "c", 0), 2_001, "the new start stays");
    }

    const TEXT: &str = r#"# HELP kvscope_spills Routing decisions judged spills.
# TYPE kvscope_spills counter
kvscope_spills_total 7
# HELP kvscope_worker_cached_blocks Blocks cached per worker.
# TYPE kvscope_worker_cached_blocks gauge
kvscope_worker_cached_blocks{worker_id="1",dp_rank="0"} 12
kvscope_worker_cached_blocks{worker_id="2",dp_rank="0"} 3.5
# TYPE lat_seconds histogram
lat_seconds_bucket{pair="a\"b",le="0.001"} 2
lat_seconds_bucket{pair="a\"b",le="0.01"} 5
lat_seconds_bucket{pair="a\"b",le="+Inf"} 6
lat_seconds_sum{pair="a\"b"} 0.042
lat_seconds_count{pair="a\"b"} 6
this is not a sample
# EOF
"#;

    fn find<'a>(c: &'a Converted, name: &str) -> &'a metric::Data {
        c.metrics
            .iter()
            .find(|m| m.name == name)
            .and_then(|m| m.data.as_ref())
            .unwrap_or_else(|| panic!("{name} missing"))
    }

    #[test]
    fn counters_gauges_and_histograms() {
        let c = convert(TEXT, 10, 20);
        assert_eq!(c.metrics.len(), 3);
        assert_eq!(c.skipped_samples, 1);
        let metric::Data::Sum(s) = find(&c, "kvscope_spills") else {
            panic!("a counter is a sum")
        };
        assert!(s.is_monotonic);
        assert_eq!(
            s.aggregation_temporality,
            AggregationTemporality::Cumulative as i32
        );
        assert_eq!(
            s.data_points[0].value,
            Some(number_data_point::Value::AsInt(7))
        );
        assert_eq!(s.data_points[0].start_time_unix_nano, 10);
        let metric::Data::Gauge(g) = find(&c, "kvscope_worker_cached_blocks") else {
            panic!("gauge")
        };
        assert_eq!(g.data_points.len(), 2);
        assert_eq!(
            g.data_points[1].value,
            Some(number_data_point::Value::AsDouble(3.5))
        );
        assert_eq!(g.data_points[0].attributes[0].key, "worker_id");
        let metric::Data::Histogram(h) = find(&c, "lat_seconds") else {
            panic!("histogram")
        };
        let p = &h.data_points[0];
        assert_eq!(p.explicit_bounds, vec![0.001, 0.01]);
        assert_eq!(p.bucket_counts, vec![2, 3, 1]);
        assert_eq!((p.count, p.sum), (6, Some(0.042)));
        assert_eq!(p.attributes.len(), 1, "le is not an attribute");
        assert_eq!(
            p.attributes[0].value,
            Some(AnyValue {
                value: Some(any_value::Value::StringValue("a\"b".into()))
            })
        );
        let unit = c.metrics.iter().find(|m| m.name == "lat_seconds").unwrap();
        assert_eq!(unit.unit, "s");
    }

    #[test]
    fn prometheus_0_0_4_counters_and_untyped_samples() {
        let c = convert(
            "# TYPE a_x counter\na_x_total{agent=\"n\"} 4\nloose 1 1700000000\n",
            0,
            1,
        );
        assert_eq!(c.skipped_samples, 0);
        assert!(matches!(find(&c, "a_x"), metric::Data::Sum(_)));
        assert!(matches!(find(&c, "loose"), metric::Data::Gauge(_)));
    }

    #[test]
    fn summaries_are_counted_not_dropped_silently() {
        let c = convert(
            "# TYPE s summary\ns{quantile=\"0.5\"} 1\ns_sum 1\ns_count 1\n",
            0,
            1,
        );
        assert!(c.metrics.is_empty());
        assert_eq!(c.skipped_samples, 3);
    }
}
