//! Conditional disaggregation: below which uncached prompt size a request's prefill
//! should stay on its decode worker, and what Dynamo's `--router-conditional-disagg`
//! should be set to.
//!
//! The inputs are measured time-to-first-token samples of both paths: requests whose
//! prefill ran on their decode worker (local) and requests whose prefill ran on a prefill
//! worker and whose KV was handed to the decode worker (remote). Each path's time to
//! first token is fitted as `fixed + per_token × uncached tokens` (least squares): the
//! remote path's fixed part is the handoff (queueing at the prefill pool, the KV transfer's
//! start, the decode worker's pickup), its per-token part the prefill pool's rate plus
//! the KV bytes over the transfer's bandwidth; the local path's per-token part is the
//! decode workers' prefill rate while they decode. The paths cross at the break-even
//! uncached size: below it local is faster.
//!
//! The requests the shares and the predicted mean TTFT are taken over are the
//! recording's (uncached = prompt − the chosen worker's cached prefix, which is Dynamo's
//! `eff_isl` when the decode worker's cache is seen), or else the samples themselves.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One request's measured time to first token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftSample {
    pub prompt_tokens: u64,
    /// Prompt tokens the request had to prefill (prompt − cached prefix).
    pub uncached_tokens: u64,
    pub ttft_ms: f64,
    /// Its prefill ran on a prefill worker, not on its decode worker.
    pub remote: bool,
}

/// Why the samples cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DisaggError {
    #[error("reading TTFT samples {0}: {1}")]
    Read(PathBuf, String),
    #[error("TTFT samples {path}, line {line}: {why}")]
    Malformed {
        path: PathBuf,
        line: usize,
        why: String,
    },
    #[error(
        "the TTFT samples hold {local} local and {remote} remote requests with a time to \
         first token over {sizes_local} and {sizes_remote} distinct uncached sizes: each \
         path needs two sizes or more to fit"
    )]
    TooFew {
        local: usize,
        remote: usize,
        sizes_local: usize,
        sizes_remote: usize,
    },
}

/// Reads samples from JSON lines (one object per request) or from a `kvscope-lab`
/// workload summary (an object whose `requests` are such objects; errors name the
/// request's place in it as its line). Each object gives `prompt_tokens` and `ttft_ms`;
/// `remote` (bool), or else `prefill_worker_id` (remote where it differs from the
/// `decode_worker_id` or `worker_id` given); `cached_tokens` or `usage_cached_tokens` (default 0). Failed requests
/// (`ok: false`) and those without `ttft_ms` are left out and counted.
pub(crate) fn read_samples(path: &Path) -> Result<(Vec<TtftSample>, u64), DisaggError> {
    let text =
        std::fs::read_to_string(path).map_err(|e| DisaggError::Read(path.into(), e.to_string()))?;
    let rows: Vec<(usize, serde_json::Value)> =
        match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(serde_json::Value::Object(o)) if o.contains_key("requests") => {
                match o.get("requests") {
                    Some(serde_json::Value::Array(a)) => a
                        .iter()
                        .cloned()
                        .enumerate()
                        .map(|(i, v)| (i + 1, v))
                        .collect(),
                    _ => {
                        return Err(DisaggError::Malformed {
                            path: path.into(),
                            line: 1,
                            why: "`requests` is not an array".into(),
                        })
                    }
                }
            }
            _ => {
                let mut rows = Vec::new();
                for (i, line) in text.lines().enumerate() {
                    if line.trim().is_empty() {
                        continue;
                    }
                    let v = serde_json::from_str(line).map_err(|e| DisaggError::Malformed {
                        path: path.into(),
                        line: i + 1,
                        why: e.to_string(),
                    })?;
                    rows.push((i + 1, v));
                }
                rows
            }
        };
    let mut samples = Vec::new();
    let mut left_out = 0;
    for (line, v) in rows {
        let bad = |why: &str| DisaggError::Malformed {
            path: path.into(),
            line,
            why: why.into(),
        };
        if v.get("ok").and_then(serde_json::Value::as_bool) == Some(false) {
            left_out += 1;
            continue;
        }
        let Some(ttft_ms) = v.get("ttft_ms").and_then(serde_json::Value::as_f64) else {
            left_out += 1;
            continue;
        };
        // A day bounds any real time to first token, and keeps the fit's sums finite.
        if !(0.0..=86_400_000.0).contains(&ttft_ms) {
            return Err(bad(
                "ttft_ms is not a number of milliseconds from 0 to a day",
            ));
        }
        let prompt = v
            .get("prompt_tokens")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| bad("no prompt_tokens (a whole number)"))?;
        let cached = v
            .get("cached_tokens")
            .and_then(serde_json::Value::as_u64)
            .or_else(|| {
                v.get("usage_cached_tokens")
                    .and_then(serde_json::Value::as_u64)
            })
            .unwrap_or(0);
        let remote = match v.get("remote") {
            Some(r) => r
                .as_bool()
                .ok_or_else(|| bad("remote is not true or false"))?,
            None => v.get("prefill_worker_id").is_some_and(|p| !p.is_null()),
        };
        samples.push(TtftSample {
            prompt_tokens: prompt,
            uncached_tokens: prompt.saturating_sub(cached),
            ttft_ms,
            remote,
        });
    }
    Ok((samples, left_out))
}

/// One path's fitted time to first token: `fixed_ms + ms_per_ktok × uncached / 1000`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TtftLine {
    pub fixed_ms: f64,
    pub ms_per_ktok: f64,
    pub samples: u64,
    /// The uncached sizes the fit saw: outside them it is extrapolated.
    pub min_uncached_tokens: u64,
    pub max_uncached_tokens: u64,
    /// Root-mean-square residual of the fit, ms.
    pub rms_residual_ms: f64,
}

impl TtftLine {
    pub fn at(&self, uncached_tokens: u64) -> f64 {
        self.fixed_ms + self.ms_per_ktok * uncached_tokens as f64 / 1e3
    }

    fn fit(samples: &[(u64, f64)]) -> Option<Self> {
        let n = samples.len() as f64;
        let sizes: std::collections::BTreeSet<u64> = samples.iter().map(|s| s.0).collect();
        if sizes.len() < 2 {
            return None;
        }
        let mx = samples.iter().map(|s| s.0 as f64).sum::<f64>() / n;
        let my = samples.iter().map(|s| s.1).sum::<f64>() / n;
        let sxx: f64 = samples.iter().map(|s| (s.0 as f64 - mx).powi(2)).sum();
        let sxy: f64 = samples.iter().map(|s| (s.0 as f64 - mx) * (s.1 - my)).sum();
        let slope = sxy / sxx;
        let fixed = my - slope * mx;
        if !(slope.is_finite() && fixed.is_finite()) {
            return None;
        }
        let rms = (samples
            .iter()
            .map(|s| (s.1 - fixed - slope * s.0 as f64).powi(2))
            .sum::<f64>()
            / n)
            .sqrt();
        Some(Self {
            fixed_ms: fixed,
            ms_per_ktok: slope * 1e3,
            samples: samples.len() as u64,
            min_uncached_tokens: *sizes.first()?,
            max_uncached_tokens: *sizes.last()?,
            rms_residual_ms: rms,
        })
    }
}

/// The fitted paths.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DisaggCosts {
    pub local: TtftLine,
    pub remote: TtftLine,
}

impl DisaggCosts {
    pub fn fit(samples: &[TtftSample]) -> Result<Self, DisaggError> {
        let side = |remote: bool| -> Vec<(u64, f64)> {
            samples
                .iter()
                .filter(|s| s.remote == remote)
                .map(|s| (s.uncached_tokens, s.ttft_ms))
                .collect()
        };
        let (l, r) = (side(false), side(true));
        let distinct = |v: &[(u64, f64)]| {
            v.iter()
                .map(|s| s.0)
                .collect::<std::collections::BTreeSet<_>>()
                .len()
        };
        match (TtftLine::fit(&l), TtftLine::fit(&r)) {
            (Some(local), Some(remote)) => Ok(Self { local, remote }),
            _ => Err(DisaggError::TooFew {
                local: l.len(),
                remote: r.len(),
                sizes_local: distinct(&l),
                sizes_remote: distinct(&r),
            }),
        }
    }

    /// Where the paths cross.
    pub fn crossing(&self) -> Crossing {
        let (l, r) = (&self.local, &self.remote);
        let slope_gain = l.ms_per_ktok - r.ms_per_ktok; // ms per 1000 tokens remote saves
        let fixed_cost = r.fixed_ms - l.fixed_ms; // ms remote costs up front
        let at = || (fixed_cost / slope_gain * 1e3).ceil().max(0.0) as u64;
        match (fixed_cost <= 0.0, slope_gain >= 0.0) {
            (true, true) => Crossing::RemoteAlways,
            (false, true) if slope_gain > 0.0 => Crossing::RemoteFrom(at()),
            (false, _) => Crossing::Never,
            (true, false) => Crossing::RemoteBelow(at()),
        }
    }

    /// The uncached size where remote prefill starts to be faster: `Some(0)` when it
    /// always is, `None` when no size on is (see [`Self::crossing`]).
    pub(crate) fn break_even_tokens(&self) -> Option<u64> {
        match self.crossing() {
            Crossing::RemoteAlways => Some(0),
            Crossing::RemoteFrom(n) => Some(n),
            Crossing::Never | Crossing::RemoteBelow(_) => None,
        }
    }

    /// Mean time to first token over `uncached` sizes when prefills of fewer than
    /// `threshold` tokens stay local.
    pub(crate) fn mean_ttft_ms(&self, uncached: &[u64], threshold: u64) -> f64 {
        if uncached.is_empty() {
            return 0.0;
        }
        uncached
            .iter()
            .map(|&u| {
                if u < threshold {
                    self.local.at(u)
                } else {
                    self.remote.at(u)
                }
            })
            .sum::<f64>()
            / uncached.len() as f64
    }
}

/// How the fitted paths compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Crossing {
    /// Remote prefill is as fast or faster at every size.
    RemoteAlways,
    /// Remote prefill is faster from this many uncached tokens on.
    RemoteFrom(u64),
    /// Local prefill is as fast or faster at every size.
    Never,
    /// Remote prefill is faster only below this size (a cheaper start but a slower rate):
    /// a threshold that keeps short prefills local cannot follow that, so the better of
    /// all-remote and all-local is recommended.
    RemoteBelow(u64),
}

/// One threshold's predicted effect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DisaggRow {
    pub threshold_tokens: u64,
    /// Share of the requests whose prefill stays local (uncached < threshold).
    pub local_share: f64,
    /// The share Dynamo's `isl_bounding` keeps local at this threshold with
    /// `eff_isl_ratio_threshold` 1.0: it also needs something cached on the decode worker.
    pub local_share_isl_bounding: f64,
    /// With each request on the path the threshold gives it (the ideal switch).
    pub predicted_mean_ttft_ms: f64,
}

/// The answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DisaggWhatIf {
    pub costs: DisaggCosts,
    /// Where the samples came from, and how many were left out (failed, no TTFT).
    pub samples_from: String,
    pub samples_left_out: u64,
    pub crossing: Crossing,
    /// The threshold recommended: the break-even, or above every request's size when
    /// remote never pays off.
    pub recommended_threshold_tokens: u64,
    /// `--router-conditional-disagg-config`'s value for it (JSON).
    pub recommended_config: String,
    /// The frontend flags that set it, as a shell takes them.
    pub recommended_setting: String,
    /// What the requests below are: the recording's or the samples'.
    pub requests_from: String,
    pub requests: u64,
    /// Share of the requests below the recommended threshold.
    pub local_share: f64,
    /// … of which Dynamo's `isl_bounding` keeps local (see [`DisaggRow`]).
    pub local_share_isl_bounding: f64,
    pub rows: Vec<DisaggRow>,
    pub notes: Vec<String>,
}

/// Thresholds tabulated unless others are asked for.
pub(crate) const DEFAULT_THRESHOLDS: [u64; 7] = [256, 512, 1024, 2048, 4096, 8192, 16384];

/// The question: fitted costs, the requests to judge them on (each one's uncached and
/// prompt tokens; the samples' own where none is given), thresholds to tabulate.
pub fn answer(
    samples: &[TtftSample],
    samples_from: String,
    samples_left_out: u64,
    requests: Option<(&[(u64, u64)], String)>,
    thresholds: &[u64],
) -> Result<DisaggWhatIf, DisaggError> {
    let costs = DisaggCosts::fit(samples)?;
    let own: Vec<(u64, u64)>;
    let (judged, requests_from) = match requests {
        Some((r, from)) if !r.is_empty() => (r, from),
        _ => {
            own = samples
                .iter()
                .map(|s| (s.uncached_tokens, s.prompt_tokens))
                .collect();
            (own.as_slice(), "the TTFT samples".to_string())
        }
    };
    let uncached: Vec<u64> = judged.iter().map(|r| r.0).collect();
    let uncached = uncached.as_slice();
    let crossing = costs.crossing();
    let break_even = costs.break_even_tokens();
    let all_local = uncached
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .saturating_add(1);
    let recommended = match crossing {
        Crossing::RemoteAlways => 0,
        Crossing::RemoteFrom(n) => n,
        Crossing::Never => all_local,
        Crossing::RemoteBelow(_) => {
            if costs.mean_ttft_ms(uncached, 0) < costs.mean_ttft_ms(uncached, all_local) {
                0
            } else {
                all_local
            }
        }
    };
    let n = judged.len().max(1) as f64;
    let share = |t: u64| judged.iter().filter(|r| r.0 < t).count() as f64 / n;
    let share_isl = |t: u64| judged.iter().filter(|r| r.0 < t && r.0 < r.1).count() as f64 / n;
    let mut ts: Vec<u64> = if thresholds.is_empty() {
        DEFAULT_THRESHOLDS.to_vec()
    } else {
        thresholds.to_vec()
    };
    ts.push(recommended);
    ts.sort_unstable();
    ts.dedup();
    let rows = ts
        .iter()
        .map(|&t| DisaggRow {
            threshold_tokens: t,
            local_share: share(t),
            local_share_isl_bounding: share_isl(t),
            predicted_mean_ttft_ms: costs.mean_ttft_ms(uncached, t),
        })
        .collect();
    let mut notes = Vec::new();
    let (lo, hi) = (
        costs
            .local
            .min_uncached_tokens
            .max(costs.remote.min_uncached_tokens),
        costs
            .local
            .max_uncached_tokens
            .min(costs.remote.max_uncached_tokens),
    );
    if lo > hi {
        notes.push(format!(
            "the two paths were measured at sizes that do not overlap (local {}–{}, remote \
             {}–{}): the comparison is extrapolated; measure both at the same sizes",
            costs.local.min_uncached_tokens,
            costs.local.max_uncached_tokens,
            costs.remote.min_uncached_tokens,
            costs.remote.max_uncached_tokens
        ));
    } else if let Some(b) = break_even.filter(|b| *b > 0 && (*b < lo || *b > hi)) {
        notes.push(format!(
            "the break-even ({b} tokens) lies outside the sizes both paths were measured at \
             ({lo}–{hi}): it is extrapolated; measure requests of that size"
        ));
    }
    if let Crossing::RemoteBelow(b) = crossing {
        notes.push(format!(
            "remote prefill is faster only below {b} uncached tokens (it starts sooner but \
             prefills slower); a threshold keeps short prefills local, so the better of \
             all-remote and all-local is recommended"
        ));
    }
    notes.push(
        "Dynamo's isl_bounding policy keeps a prefill local only while eff_isl / prompt is \
         below eff_isl_ratio_threshold (strictly, at most 1.0): a request with nothing \
         cached on its decode worker is always sent to a prefill worker"
            .into(),
    );
    let config = serde_json::json!({
        "policy": "isl_bounding",
        "eff_isl_threshold": recommended,
        "eff_isl_ratio_threshold": 1.0,
    })
    .to_string();
    Ok(DisaggWhatIf {
        costs,
        samples_from,
        samples_left_out,
        crossing,
        recommended_threshold_tokens: recommended,
        recommended_config: config.clone(),
        recommended_setting: format!(
            "--router-conditional-disagg --router-conditional-disagg-config '{config}'"
        ),
        requests_from,
        requests: uncached.len() as u64,
        local_share: share(recommended),
        local_share_isl_bounding: share_isl(recommended),
        rows,
        notes,
    })
}

impl Crossing {
    /// The answer in words.
    pub fn sentence(&self) -> String {
        match self {
            Crossing::RemoteAlways => "Remote prefill is faster at every size".into(),
            Crossing::RemoteFrom(n) => {
                format!("Remote prefill pays off from {n} uncached tokens on")
            }
            Crossing::Never => {
                "Remote prefill never pays off: local is as fast or faster at every size".into()
            }
            Crossing::RemoteBelow(n) => format!(
                "Remote prefill is faster only below {n} uncached tokens (it starts sooner but \
                 prefills slower)"
            ),
        }
    }
}

impl DisaggWhatIf {
    pub fn to_markdown(&self) -> String {
        let c = &self.costs;
        let mut s = String::from("## What-if: conditional disaggregation\n\n");
        s.push_str(&format!(
            "Time to first token fitted from {} ({} left out):\n\n\
             | path | fixed ms | ms per 1k uncached tokens | samples | sizes | rms residual ms |\n\
             |---|---:|---:|---:|---|---:|\n",
            self.samples_from, self.samples_left_out
        ));
        for (name, l) in [("local prefill", &c.local), ("remote prefill", &c.remote)] {
            s.push_str(&format!(
                "| {name} | {:.1} | {:.1} | {} | {}–{} | {:.1} |\n",
                l.fixed_ms,
                l.ms_per_ktok,
                l.samples,
                l.min_uncached_tokens,
                l.max_uncached_tokens,
                l.rms_residual_ms
            ));
        }
        s.push_str(&format!("\n{}.\n", self.crossing.sentence()));
        s.push_str(&format!(
            "\nOn {} ({}): {:.1}% of requests stay local at the recommended threshold of {} \
             tokens ({:.1}% under Dynamo's isl_bounding, which also needs a cached prefix).\n\n\
             | threshold (tokens) | local share | under isl_bounding | predicted mean TTFT ms |\n\
             |---:|---:|---:|---:|\n",
            self.requests_from,
            self.requests,
            100.0 * self.local_share,
            self.recommended_threshold_tokens,
            100.0 * self.local_share_isl_bounding
        ));
        for r in &self.rows {
            s.push_str(&format!(
                "| {} | {:.1}% | {:.1}% | {:.1} |\n",
                r.threshold_tokens,
                100.0 * r.local_share,
                100.0 * r.local_share_isl_bounding,
                r.predicted_mean_ttft_ms
            ));
        }
        s.push_str(&format!("\nRecommended: `{}`\n", self.recommended_setting));
        for n in &self.notes {
            s.push_str(&format!("\nNote: {n}.\n"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(fixed: f64, per_ktok: f64, remote: bool) -> Vec<TtftSample> {
        [500u64, 1000, 2000, 4000]
            .iter()
            .map(|&u| TtftSample {
                prompt_tokens: u,
                uncached_tokens: u,
                ttft_ms: fixed + per_ktok * u as f64 / 1e3,
                remote,
            })
            .collect()
    }

    #[test]
    fn fits_both_paths_and_finds_where_they_cross() {
        // local 10 ms + 100 ms/ktok, remote 60 ms + 50 ms/ktok: equal at 1000 tokens.
        let mut s = line(10.0, 100.0, false);
        s.extend(line(60.0, 50.0, true));
        let c = DisaggCosts::fit(&s).unwrap();
        assert!((c.local.fixed_ms - 10.0).abs() < 1e-9);
        assert!((c.remote.ms_per_ktok - 50.0).abs() < 1e-9);
        assert_eq!(c.break_even_tokens(), Some(1000));
        let a = answer(&s, "test".into(), 0, None, &[500, 2000]).unwrap();
        assert_eq!(a.recommended_threshold_tokens, 1000);
        // Of the samples' sizes (500, 1000, 2000, 4000, each twice), 500 stays local.
        assert_eq!(a.local_share, 0.25);
        let best = a
            .rows
            .iter()
            .min_by(|x, y| {
                x.predicted_mean_ttft_ms
                    .total_cmp(&y.predicted_mean_ttft_ms)
            })
            .unwrap();
        assert_eq!(best.threshold_tokens, 1000);
    }

    #[test]
    fn never_and_always() {
        let mut s = line(10.0, 50.0, false);
        s.extend(line(60.0, 60.0, true));
        let judged = [(100, 100), (9000, 12000)];
        let a = answer(&s, "t".into(), 0, Some((&judged, "r".into())), &[]).unwrap();
        assert_eq!(a.crossing, Crossing::Never);
        assert_eq!(a.recommended_threshold_tokens, 9001);
        assert_eq!(a.local_share, 1.0);
        // Dynamo keeps local only what has a cached prefix: the second request.
        assert_eq!(a.local_share_isl_bounding, 0.5);
        let mut s = line(60.0, 100.0, false);
        s.extend(line(10.0, 50.0, true));
        assert_eq!(DisaggCosts::fit(&s).unwrap().break_even_tokens(), Some(0));
        // Remote starts sooner but prefills slower: faster only below 1000 tokens, so
        // all-remote wins on short requests and all-local on long ones.
        let mut s = line(60.0, 50.0, false);
        s.extend(line(10.0, 100.0, true));
        assert_eq!(
            DisaggCosts::fit(&s).unwrap().crossing(),
            Crossing::RemoteBelow(1000)
        );
        let short = [(200, 200), (300, 300)];
        let a = answer(&s, "t".into(), 0, Some((&short, "r".into())), &[]).unwrap();
        assert_eq!(a.recommended_threshold_tokens, 0);
        let long = [(4000, 4000), (300, 300)];
        let a = answer(&s, "t".into(), 0, Some((&long, "r".into())), &[]).unwrap();
        assert_eq!(a.recommended_threshold_tokens, 4001);
    }

    #[test]
    fn one_size_per_path_is_too_few() {
        let s = vec![
            TtftSample {
                prompt_tokens: 10,
                uncached_tokens: 10,
                ttft_ms: 1.0,
                remote: false,
            },
            TtftSample {
                prompt_tokens: 10,
                uncached_tokens: 10,
                ttft_ms: 2.0,
                remote: false,
            },
            TtftSample {
                prompt_tokens: 10,
                uncached_tokens: 10,
                ttft_ms: 3.0,
                remote: true,
            },
            TtftSample {
                prompt_tokens: 20,
                uncached_tokens: 20,
                ttft_ms: 3.0,
                remote: true,
            },
        ];
        assert!(matches!(
            DisaggCosts::fit(&s),
            Err(DisaggError::TooFew {
                local: 2,
                sizes_local: 1,
                ..
            })
        ));
    }

    #[test]
    fn reads_lines_and_workload_summaries() {
        let dir = std::env::temp_dir().join(format!("kvscope-ttft-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lines = dir.join("s.jsonl");
        std::fs::write(
            &lines,
            "{\"prompt_tokens\":100,\"cached_tokens\":40,\"ttft_ms\":5,\"remote\":true}\n\
             {\"prompt_tokens\":100,\"ok\":false}\n\n\
             {\"prompt_tokens\":30,\"ttft_ms\":2.5}\n",
        )
        .unwrap();
        let (s, left) = read_samples(&lines).unwrap();
        assert_eq!(left, 1);
        assert_eq!(
            s,
            vec![
                TtftSample {
                    prompt_tokens: 100,
                    uncached_tokens: 60,
                    ttft_ms: 5.0,
                    remote: true
                },
                TtftSample {
                    prompt_tokens: 30,
                    uncached_tokens: 30,
                    ttft_ms: 2.5,
                    remote: false
                },
            ]
        );
        let summary = dir.join("w.json");
        std::fs::write(
            &summary,
            r#"{"sent":2,"requests":[{"prompt_tokens":7,"ttft_ms":1.0,"prefill_worker_id":3,"ok":true},
               {"prompt_tokens":9,"usage_cached_tokens":null,"ttft_ms":2.0,"ok":true}]}"#,
        )
        .unwrap();
        let (s, _) = read_samples(&summary).unwrap();
        assert_eq!(
            (s[0].remote, s[1].remote, s[1].uncached_tokens),
            (true, false, 9)
        );
        std::fs::write(&lines, "{\"prompt_tokens\":\"x\",\"ttft_ms\":1}\n").unwrap();
        let e = read_samples(&lines).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("prompt_tokens"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
