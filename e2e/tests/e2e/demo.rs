//! The README's main command as a newcomer runs it: `kvscope-demo` (what `scripts/demo`
//! runs) with its defaults (the production-shaped workload: long-tailed prompts past 128k tokens on Dynamo
//! 1.6.1's KV router with three mocker workers, the agent and the collector), the real
//! binary, nothing passed but where to write.
//!
//! Asserts what the newcomer reads:
//! - the progress fits on one screen before the report, and no line says ERROR;
//! - spills spread over at least two orders of magnitude of tokens, with prompts past
//!   128k tokens; the true delta in decode-generated blocks measured (the replies come
//!   back);
//! - the cross-check against Dynamo's own router counters within what a router whose
//!   view lags the engines by −10 to +50 ms would count (equal to the token when it
//!   does not), and every request's overlaps equal to Dynamo's radix tree fed the same
//!   events;
//! - the capacity what-if calibrated at a plausible size, its hit rate falling
//!   smoothly with the reserve (no cliff);
//! - the router what-if's model at the demo's own settings within twice the tolerance
//!   the model was validated to in hit and spill rate (`REPRODUCTION_TOLERANCE`; one real
//!   run is one draw), and within a factor of 2 in uncached prefill (the demo's runs
//!   spread that far),
//!   its other settings predicted when within the tolerance and none when not (the
//!   report then says why), and its load view the router's own.

use kvscope_e2e::oracle;

use kvscope_collector::fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_collector::whatif::router::REPRODUCTION_TOLERANCE;
use kvscope_collector::whatif::PLAUSIBLE_CALIBRATION;
use kvscope_wire::recording::read_recording;
use serde_json::Value;
use std::process::Command;

/// Lines a terminal shows at once.
const ONE_SCREEN: usize = 24;

#[test]
fn the_demo_a_newcomer_runs() {
    let lab_dir = kvscope_lab::paths::default_lab_dir();
    kvscope_e2e::lab_venv(&lab_dir);
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new(kvscope_e2e::kvscope_demo())
        .arg("--out")
        .arg(out_dir.path())
        // The lab's processes inherit nothing that would change what a newcomer sees.
        .env_remove("RUST_LOG")
        .output()
        .expect("kvscope demo runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "kvscope demo failed:\n{stderr}");
    let progress: Vec<&str> = stderr.lines().collect();
    eprintln!("{}", progress.join("\n"));
    assert!(
        progress.len() <= ONE_SCREEN,
        "{} lines of progress before the report",
        progress.len()
    );
    assert!(
        !stderr.contains("ERROR") && !stdout.contains("ERROR"),
        "a line says ERROR though nothing failed:\n{stderr}"
    );

    let read = |name: &str| -> Value {
        serde_json::from_slice(&std::fs::read(out_dir.path().join(name)).unwrap()).unwrap()
    };
    let report = read("report.json");
    let workload = read("workload.json");
    assert_eq!(workload["failed"], 0, "every request succeeds");

    // Production-shaped: prompts past 128k tokens, spills over two orders of magnitude.
    let longest = workload["requests"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["prompt_tokens"].as_u64())
        .max()
        .unwrap();
    assert!(longest > 131_072, "the longest prompt: {longest} tokens");
    let bins: Vec<(u64, u64)> = report["spill_token_bins"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["true_delta_spills"].as_u64() > Some(0))
        .map(|b| {
            (
                b["from_tokens"].as_u64().unwrap(),
                b["to_tokens"].as_u64().unwrap(),
            )
        })
        .collect();
    let (lowest, highest) = (bins.first().unwrap().0, bins.last().unwrap().1);
    assert!(
        highest >= 100 * lowest,
        "spills span {lowest}–{highest} tokens: {bins:?}"
    );
    let generated = report["generated_share_of_true_delta"].as_f64().unwrap();
    assert!(generated > 0.0, "replies come back: {generated}");

    // The cross-check the demo prints: Dynamo's own counters of the cached prefix its
    // router passed over against kvscope's true delta. They have been equal to the token
    // on this lab, but the router applies the engines' events a little after they
    // happen (while it is busy routing), so it may decide before seeing a block kvscope
    // orders before the decision: its figure must lie within what kvscope measures for
    // a router whose view is off the log time by −10 to +50 ms, decision by decision
    // (as `lab_e2e.rs` checks; once 32 tokens apart here, on a machine under load).
    let router_view = workload["router_spilled_cached_tokens"].as_f64().unwrap() as u64;
    let kvscope_view: u64 = report["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["true_delta_tokens"].as_u64().unwrap())
        .sum();
    assert!(kvscope_view > 10_000, "{kvscope_view}");
    let rec = read_recording(&out_dir.path().join("collector-recording.jsonl")).unwrap();
    let by_lag: Vec<Vec<u64>> = [0i64, -10, 10, 25, 50]
        .iter()
        .map(|ms| {
            oracle::true_delta_with_router_lag(
                &rec.envelopes,
                ms * 1_000_000,
                AnalyzerConfig::default(),
            )
        })
        .collect();
    let decisions = by_lag[0].len();
    let low: u64 = (0..decisions)
        .map(|i| by_lag.iter().map(|d| d[i]).min().unwrap())
        .sum();
    let high: u64 = (0..decisions)
        .map(|i| by_lag.iter().map(|d| d[i]).max().unwrap())
        .sum();
    eprintln!(
        "cross-check: Dynamo {router_view}, kvscope {kvscope_view} tokens \
         (band [{low}, {high}] for a router lagging −10 to +50 ms)"
    );
    // A block's worth of slack per side for a decision made between two log lines.
    let slack = 16;
    assert!(
        low.saturating_sub(slack) <= router_view && router_view <= high + slack,
        "Dynamo's own best − selected {router_view} tokens outside kvscope's band [{low}, {high}]"
    );
    assert!(
        (low..=high).contains(&kvscope_view),
        "{kvscope_view} in [{low}, {high}]"
    );
    assert!(stdout.contains("Cross-check"), "{stdout}");
    // Every request's overlaps equal Dynamo's own radix tree's.
    let mut a = FleetAnalyzer::new(AnalyzerConfig::default());
    let verdicts: Vec<_> = rec.envelopes.iter().filter_map(|e| a.apply(e)).collect();
    assert_eq!(verdicts.len() as u64, workload["ok"].as_u64().unwrap());
    oracle::assert_overlaps_equal(&verdicts, &rec.envelopes);

    // The capacity what-if: calibrated at a plausible size, no cliff.
    let capacity = &report["whatif"]["capacity"];
    assert_eq!(capacity["calibrated"], true, "{capacity:#}");
    let calibration = capacity["calibration"].as_f64().unwrap();
    assert!(
        PLAUSIBLE_CALIBRATION.contains(&calibration),
        "{calibration}"
    );
    let hits: Vec<(f64, f64)> = capacity["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["reserve"].as_f64().unwrap(),
                r["hit_rate"].as_f64().unwrap(),
            )
        })
        .collect();
    assert!(hits.len() >= 5, "{hits:?}");
    let recorded = capacity["recorded_hit_rate"].as_f64().unwrap();
    assert!(
        (hits[0].1 - recorded).abs() <= 0.02,
        "no reserve reproduces the run: {hits:?} against {recorded}"
    );
    for w in hits.windows(2) {
        let ((r0, h0), (r1, h1)) = (w[0], w[1]);
        assert!(h1 <= h0 + 1e-9, "more room, fewer hits: {hits:?}");
        // A cache's hits fall with its size, never off a cliff: at most 3 points of hit
        // rate per point of reserve.
        assert!(
            h0 - h1 <= 3.0 * (r1 - r0),
            "a cliff from {r0} to {r1}: {hits:?}"
        );
    }

    // The router what-if: the model at the demo's settings reproduces the demo's run, or
    // says it does not and predicts nothing. Either way it is in the demo's regime: the
    // bug this guards against missed by 5x. Hit and spill rate hold to twice the
    // tolerance; uncached prefill to a factor of 2, since the demo's own runs spread that
    // far: a handful of 100k-token documents decide it, and six runs of this very test
    // measured the model from -39.7% to +32.1% of its run (docs/benchmarks-log.md, "The demo run
    // to run"), where a miss past the tolerance is one run's draw and the product must
    // then say so rather than print rows.
    let router = &report["whatif"]["router"];
    let model = &router["model_at_recorded"];
    let measured = &router["recorded"];
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap();
    let hit_err = f(&model["hit_rate"], "mean") / f(measured, "hit_rate") - 1.0;
    let uncached_err =
        f(&model["uncached_prefill_tokens"], "mean") / f(measured, "uncached_prefill_tokens") - 1.0;
    let spill_err = f(&model["spill_rate"], "mean") - f(measured, "spill_rate");
    eprintln!(
        "model at the recorded settings: hit rate {hit_err:+.3}, uncached prefill \
         {uncached_err:+.3}, spill rate {spill_err:+.3} (misses: {})",
        router["model_misses"]
    );
    let rows = router["rows"].as_array().unwrap();
    let markdown = std::fs::read_to_string(out_dir.path().join("report.md")).unwrap();
    match router["model_misses"].as_str() {
        None => assert!(!rows.is_empty(), "reproduced, yet no setting predicted"),
        Some(misses) => {
            assert!(
                rows.is_empty(),
                "a model that misses its run predicted {rows:?}"
            );
            assert!(
                markdown.contains("No other setting predicted") && markdown.contains(misses),
                "the report does not say why nothing is predicted"
            );
        }
    }
    let t = REPRODUCTION_TOLERANCE;
    let in_runs = |k: &str, v: f64| f(&model[k], "min") <= v && v <= f(&model[k], "max");
    assert!(
        hit_err.abs() <= 2.0 * t.hit_rate_rel || in_runs("hit_rate", f(measured, "hit_rate")),
        "hit rate {hit_err:+.3}"
    );
    assert!(
        (-0.5..=1.0).contains(&uncached_err),
        "uncached prefill {uncached_err:+.3}: more than a factor of 2 from the run"
    );
    assert!(
        spill_err.abs() <= 2.0 * t.spill_rate_points
            || in_runs("spill_rate", f(measured, "spill_rate")),
        "spill rate {spill_err:+.3}"
    );
    let view = &router["load_view"];
    assert!(
        view["within_one_block"].as_f64().unwrap() >= 0.95,
        "{view:#}"
    );
}
