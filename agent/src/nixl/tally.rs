//! The kernel's tallies of transfers (`xfer_tallies` in `ebpf/nixl/common.h`) and their
//! latency buckets, which the agent's own tallies share: one histogram layout wherever
//! a NIXL latency is counted, so a kernel tally and a tally made from records add up
//! bucket by bucket.
//!
//! Mirrors `struct tally_key`, `struct xfer_tally` and `struct inflight_entry` of
//! `ebpf/nixl/nixl_event.h` (a unit test reads the header), read with aya as plain
//! old data.

use super::event::{u32_at, u64_at, NAME_LEN};
use kvscope_wire::nixl::LATENCY_BOUNDS_NS;

/// Buckets per power of two above [`LAT_SUB`] (as `LAT_SUB_BITS`).
pub(crate) const LAT_SUB_BITS: u32 = 6;
const LAT_SUB: u64 = 1 << LAT_SUB_BITS;
/// Latencies from 2^(this + 1) ns count in the last bucket.
const LAT_TOP_OCTAVE: u32 = 40;
/// The fine buckets.
pub(crate) const LAT_FINE: usize = ((LAT_TOP_OCTAVE - LAT_SUB_BITS + 2) << LAT_SUB_BITS) as usize;
/// [`LATENCY_BOUNDS_NS`]'s buckets and the one above them.
pub(crate) const LAT_FIXED: usize = LATENCY_BOUNDS_NS.len() + 1;

/// The fine bucket of `ns` (as `lat_fine` in the probes).
pub(crate) fn fine_index(ns: u64) -> usize {
    if ns < LAT_SUB {
        return ns as usize;
    }
    let ns = ns.min((1u64 << (LAT_TOP_OCTAVE + 1)) - 1);
    let m = 63 - ns.leading_zeros();
    (((m - LAT_SUB_BITS + 1) << LAT_SUB_BITS) as usize)
        + ((ns >> (m - LAT_SUB_BITS)) & (LAT_SUB - 1)) as usize
}

/// The lowest value of fine bucket `i` and its width.
fn fine_bucket(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < LAT_SUB {
        return (i, 1);
    }
    let octave = i >> LAT_SUB_BITS;
    let sub = i & (LAT_SUB - 1);
    ((LAT_SUB + sub) << (octave - 1), 1 << (octave - 1))
}

/// The [`LATENCY_BOUNDS_NS`] bucket of `ns`: the first bound it does not exceed.
pub(crate) fn fixed_index(ns: u64) -> usize {
    LATENCY_BOUNDS_NS.partition_point(|&b| b < ns)
}

/// Latencies counted in the probes' buckets: exact at [`LATENCY_BOUNDS_NS`], within
/// 0.8% (a bucket's middle) anywhere else.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct LatencyHistogram {
    count: u64,
    fixed: Vec<u64>,
    /// Up to the highest bucket used.
    fine: Vec<u64>,
}

impl LatencyHistogram {
    pub fn record(&mut self, ns: u64) {
        self.count += 1;
        if self.fixed.is_empty() {
            self.fixed = vec![0; LAT_FIXED];
        }
        self.fixed[fixed_index(ns)] += 1;
        let i = fine_index(ns);
        if self.fine.len() <= i {
            self.fine.resize(i + 1, 0);
        }
        self.fine[i] += 1;
    }

    /// Add `other`'s counts to these.
    pub fn add(&mut self, other: &LatencyHistogram) {
        self.add_buckets(&other.fixed, &other.fine);
    }

    fn add_buckets(&mut self, fixed: &[u64], fine: &[u64]) {
        if fixed.iter().all(|&n| n == 0) {
            return;
        }
        if self.fixed.is_empty() {
            self.fixed = vec![0; LAT_FIXED];
        }
        for (a, b) in self.fixed.iter_mut().zip(fixed) {
            *a = a.saturating_add(*b);
        }
        self.count = self.count.saturating_add(fixed.iter().sum::<u64>());
        let used = fine.iter().rposition(|&n| n > 0).map_or(0, |i| i + 1);
        if self.fine.len() < used {
            self.fine.resize(used, 0);
        }
        for (a, b) in self.fine.iter_mut().zip(&fine[..used]) {
            *a = a.saturating_add(*b);
        }
    }

    pub fn len(&self) -> u64 {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The latency below which `q` of the counted ones fall: the middle of the bucket
    /// holding that rank (the highest bucket used where a kernel tally read while a
    /// transfer was being added shows fewer in these buckets than in its count).
    pub fn value_at_quantile(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        let mut last = None;
        for (i, n) in self.fine.iter().enumerate() {
            if *n == 0 {
                continue;
            }
            last = Some(i);
            seen += n;
            if seen >= rank {
                break;
            }
        }
        last.map_or(0, |i| {
            let (low, width) = fine_bucket(i);
            low + width / 2
        })
    }

    /// The lowest latency of the highest bucket used (0: none).
    pub fn floor_of_highest(&self) -> u64 {
        self.fine
            .iter()
            .rposition(|&n| n > 0)
            .map_or(0, |i| fine_bucket(i).0)
    }

    /// `buckets[i]` = latencies ≤ `LATENCY_BOUNDS_NS[i]` (cumulative).
    pub fn cumulative_bounds(&self) -> Vec<u64> {
        let mut total = 0;
        (0..LATENCY_BOUNDS_NS.len())
            .map(|i| {
                total += self.fixed.get(i).copied().unwrap_or(0);
                total
            })
            .collect()
    }
}

/// `struct tally_key`, as the map's key bytes.
pub(crate) const TALLY_KEY_SIZE: usize = 24 + NAME_LEN;
/// `struct xfer_tally`, as the map's value bytes.
pub(crate) const TALLY_SIZE: usize = 8 * (6 + LAT_FIXED + LAT_FINE);
/// `struct inflight_entry`.
pub(crate) const INFLIGHT_SIZE: usize = 40 + NAME_LEN;
/// `struct xfer_key`.
pub(crate) const XFER_KEY_SIZE: usize = 16;

/// `struct tally_key`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TallyKey {
    pub pid: u32,
    pub status: i32,
    pub agent: u64,
    pub op: i32,
    pub stage: u32,
    pub remote: String,
}

impl TallyKey {
    pub fn decode(b: &[u8; TALLY_KEY_SIZE]) -> Self {
        Self {
            pid: u32_at(b, 0),
            status: u32_at(b, 4) as i32,
            agent: u64_at(b, 8),
            op: u32_at(b, 16) as i32,
            stage: u32_at(b, 20),
            remote: name_of(&b[24..]),
        }
    }
}

/// `struct xfer_tally`.
#[derive(Clone, Debug)]
pub(crate) struct KernelTally {
    pub count: u64,
    pub bytes: u64,
    pub descs: u64,
    pub bytes_unknown: u64,
    pub sum_ns: u64,
    pub max_ns: u64,
    pub latency: LatencyHistogram,
}

impl KernelTally {
    pub fn decode(b: &[u8; TALLY_SIZE]) -> Self {
        let words = |from: usize, n: usize| -> Vec<u64> {
            (0..n).map(|i| u64_at(b, 8 * (from + i))).collect()
        };
        let mut latency = LatencyHistogram::default();
        latency.add_buckets(&words(6, LAT_FIXED), &words(6 + LAT_FIXED, LAT_FINE));
        Self {
            count: u64_at(b, 0),
            bytes: u64_at(b, 8),
            descs: u64_at(b, 16),
            bytes_unknown: u64_at(b, 24),
            sum_ns: u64_at(b, 32),
            max_ns: u64_at(b, 40),
            latency,
        }
    }
}

/// `struct inflight_entry`: a transfer in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct InflightEntry {
    pub ts_ns: u64,
    pub agent: u64,
    /// "" where the build's offsets are unknown.
    pub remote: String,
}

impl InflightEntry {
    pub fn decode(b: &[u8; INFLIGHT_SIZE]) -> Self {
        Self {
            ts_ns: u64_at(b, 0),
            agent: u64_at(b, 8),
            remote: name_of(&b[40..]),
        }
    }
}

/// `struct xfer_key`: (pid, request).
pub(crate) fn decode_xfer_key(b: &[u8; XFER_KEY_SIZE]) -> (u32, u64) {
    (u32_at(b, 0), u64_at(b, 8))
}

/// A NUL-terminated name as the probes wrote it.
pub(crate) fn name_of(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = include_str!("../../../ebpf/nixl/nixl_event.h");

    fn define(name: &str) -> String {
        let line = HEADER
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("{name} in the header"));
        line[format!("#define {name} ").len()..]
            .split("/*")
            .next()
            .unwrap()
            .trim()
            .to_string()
    }

    /// The fields of `struct name` in the header: (name, bytes).
    fn c_fields(name: &str) -> Vec<(String, usize)> {
        let body = HEADER
            .split(&format!("struct {name} {{"))
            .nth(1)
            .and_then(|s| s.split("};").next())
            .unwrap_or_else(|| panic!("struct {name} in the header"));
        body.lines()
            .filter_map(|l| l.split("/*").next().unwrap().trim().strip_suffix(';'))
            .map(|decl| {
                let mut parts = decl.split_whitespace();
                let ty = parts.next().unwrap();
                let field = parts.next().unwrap();
                let (field, n) = match field.split_once('[') {
                    Some((f, len)) => {
                        let len = len.trim_end_matches(']');
                        let n = match len {
                            "NIXL_NAME_LEN" => NAME_LEN,
                            "LAT_FIXED" => LAT_FIXED,
                            "LAT_FINE" => LAT_FINE,
                            other => panic!("array of {other}"),
                        };
                        (f.to_string(), n)
                    }
                    None => (field.to_string(), 1),
                };
                let size = match ty {
                    "__u32" | "__s32" => 4,
                    "__u64" => 8,
                    "char" => 1,
                    other => panic!("type {other}"),
                };
                (field, size * n)
            })
            .collect()
    }

    #[test]
    fn the_buckets_and_structs_match_the_c_header() {
        assert_eq!(define("LAT_SUB_BITS"), LAT_SUB_BITS.to_string());
        assert_eq!(define("LAT_TOP_OCTAVE"), LAT_TOP_OCTAVE.to_string());
        assert_eq!(define("LAT_BOUNDS"), LATENCY_BOUNDS_NS.len().to_string());
        let bounds: Vec<u64> = HEADER
            .split("#define LAT_BOUNDS_NS")
            .nth(1)
            .and_then(|s| s.split('{').nth(1))
            .and_then(|s| s.split('}').next())
            .unwrap()
            .split(',')
            .map(|v| {
                v.replace(['\\', '\n', '\t'], "")
                    .trim()
                    .trim_end_matches("ull")
                    .parse()
                    .unwrap()
            })
            .collect();
        assert_eq!(bounds, LATENCY_BOUNDS_NS);
        for (name, size, fields) in [
            ("tally_key", TALLY_KEY_SIZE, 6),
            ("xfer_tally", TALLY_SIZE, 8),
            ("inflight_entry", INFLIGHT_SIZE, 8),
            ("xfer_key", XFER_KEY_SIZE, 3),
        ] {
            let c = c_fields(name);
            assert_eq!(c.len(), fields, "{name}: {c:?}");
            // Naturally aligned, no holes: the sum of the fields is the size.
            assert_eq!(c.iter().map(|(_, n)| n).sum::<usize>(), size, "{name}");
            // Where the decoders read the names.
            if let Some(at) = c.iter().position(|(f, _)| f == "remote") {
                let offset: usize = c[..at].iter().map(|(_, n)| n).sum();
                assert_eq!(offset + NAME_LEN, size, "{name}: the name comes last");
            }
        }
    }

    #[test]
    fn buckets_are_contiguous_and_narrow() {
        let mut last = 0;
        for (n, ns) in (0..5000u64)
            .chain((12..41).flat_map(|b| {
                let base = 1u64 << b;
                [base - 1, base, base + 1, base + base / 3]
            }))
            .enumerate()
        {
            let i = fine_index(ns);
            assert!(i < LAT_FINE, "{ns}");
            let (low, width) = fine_bucket(i);
            assert!(
                low <= ns && ns < low + width,
                "{ns} in bucket {i} = {low}+{width}"
            );
            // The middle is within 0.8% of any value of the bucket.
            let mid = low + width / 2;
            assert!(
                mid.abs_diff(ns) as f64 <= 0.008 * ns as f64 + 1.0,
                "{ns}: {mid}"
            );
            if n < 5000 {
                assert!(i == last || i == last + 1, "{ns}: {last} → {i}");
                last = i;
            }
        }
        assert_eq!(fine_index(u64::MAX), LAT_FINE - 1);
        assert_eq!(fixed_index(1_000), 0);
        assert_eq!(fixed_index(1_001), 1);
        assert_eq!(fixed_index(u64::MAX), LAT_FIXED - 1);
    }

    #[test]
    fn quantiles_and_bounds_from_the_buckets() {
        let mut h = LatencyHistogram::default();
        for ns in 1..=1000u64 {
            h.record(ns * 1000);
        }
        assert_eq!(h.len(), 1000);
        for (q, want) in [(0.5, 500_000.0), (0.9, 900_000.0), (0.99, 990_000.0)] {
            let got = h.value_at_quantile(q) as f64;
            assert!((got - want).abs() / want < 0.008, "p{q}: {got}");
        }
        let b = h.cumulative_bounds();
        assert_eq!(b[0], 1); // ≤ 1 µs
        assert_eq!(b[1], 2); // ≤ 2.5 µs
        assert_eq!(b[9], 1000); // ≤ 1 ms
        let mut twice = h.clone();
        twice.add(&h);
        assert_eq!(twice.len(), 2000);
        assert_eq!(twice.value_at_quantile(0.5), h.value_at_quantile(0.5));
        assert_eq!(h.floor_of_highest(), fine_bucket(fine_index(1_000_000)).0);
    }

    /// A kernel tally read while a transfer was being added may show it in the `/metrics`
    /// buckets and not yet in the fine ones: its high quantiles are the highest bucket
    /// used, not 0.
    #[test]
    fn a_tally_read_mid_update_keeps_its_quantiles() {
        let mut fixed = vec![0; LAT_FIXED];
        let mut fine = vec![0; LAT_FINE];
        fixed[fixed_index(3_000)] = 2;
        fine[fine_index(3_000)] = 1;
        let mut h = LatencyHistogram::default();
        h.add_buckets(&fixed, &fine);
        assert_eq!(h.len(), 2);
        let p99 = h.value_at_quantile(0.99);
        assert!(p99.abs_diff(3_000) < 30, "{p99}");
    }
}
