//! The what-if's capacity prediction checked against real runs: the lab (Dynamo 1.6.1's
//! KV router, three mocker workers) runs one seeded workload twice, with C = 256 and
//! with C·(1 − r) = 218 blocks per worker (r ≈ 0.15); `kvscope whatif` on the first
//! run's recording predicts the second's hit rate and uncached prefill tokens, which
//! must lie within 10% of what the second run measured.
//!
//! The workload is bounded by turns (48 conversations × 8 turns), not by time, so both
//! runs send the same requests with the same prompt lengths whatever each run's speed
//! (a time-bounded run with smaller caches sends fewer, shorter conversations, which
//! the prediction, holding the workload fixed, does not follow). The router is
//! deterministic (temperature 0); the prediction holds its decisions fixed.

use kvscope_collector::fold::analyzer::AnalyzerConfig;
use kvscope_collector::whatif::{CacheTotals, WhatIf};
use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::LabConfig;
use std::path::PathBuf;

const WINDOW_SECS: f64 = 4.0;
const FULL: u32 = 256;
const SMALLER: u32 = 218;

async fn run_lab(blocks: u32) -> (PathBuf, usize) {
    let lab = LabConfig {
        workers: 3,
        num_gpu_blocks: blocks,
        frontend_args: vec!["--router-temperature".into(), "0".into()],
        ..LabConfig::default()
    };
    let run = kvscope_e2e::fleet(FleetRunConfig::new(lab, WINDOW_SECS))
        .await
        .expect("lab, agent and collector start");
    let summary = workload::run(WorkloadConfig {
        frontend: run.lab().frontend_url().to_string(),
        sessions: 48,
        families: 3,
        max_turns: 8,
        concurrency: 32,
        rate: Some(20.0),
        duration_secs: 600.0,
        ..WorkloadConfig::default()
    })
    .await
    .expect("the workload runs");
    assert_eq!(summary.failed, 0, "every workload request succeeds");
    let recording = run.finish().await.expect("the run ends cleanly");
    (recording, summary.ok)
}

fn analyzer() -> AnalyzerConfig {
    AnalyzerConfig {
        window_secs: WINDOW_SECS,
        warmup_secs: WINDOW_SECS,
        ..AnalyzerConfig::default()
    }
}

fn within(predicted: f64, measured: f64, what: &str) -> f64 {
    let err = predicted / measured - 1.0;
    eprintln!(
        "{what}: predicted {predicted:.4}, measured {measured:.4}, error {:+.1}%",
        100.0 * err
    );
    assert!(err.abs() <= 0.10, "{what}: {:+.1}% off", 100.0 * err);
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_smaller_cache_is_predicted_from_a_run_with_the_full_one() {
    let (full_rec, full_ok) = run_lab(FULL).await;
    let (small_rec, small_ok) = run_lab(SMALLER).await;
    assert_eq!(full_ok, small_ok, "both runs sent the same requests");

    let full = WhatIf::from_recording(&full_rec, analyzer()).unwrap();
    let small = WhatIf::from_recording(&small_rec, analyzer()).unwrap();
    let measured: CacheTotals = small.recorded();
    assert_eq!(
        full.recorded().prompt_tokens,
        measured.prompt_tokens,
        "the same prompts, token for token in length"
    );
    let reserve = 1.0 - SMALLER as f64 / FULL as f64;
    // The sizes as Dynamo's discovery gave them: nothing typed.
    let c = full.capacity(None, &[0.0, reserve]).unwrap();
    assert_eq!(c.capacity_from, "discovery");
    assert_eq!(c.blocks_per_worker, Some(FULL as u64));
    assert_eq!(c.rows[1].blocks_per_worker, Some(SMALLER as u64));
    eprintln!("{}", c.to_markdown());
    let predicted = c.rows[1].totals;
    assert!(
        predicted.cached_tokens < c.recorded.cached_tokens,
        "a smaller cache is predicted to cost hits"
    );
    within(
        predicted.hit_rate(),
        measured.hit_rate(),
        "hit rate at 218 blocks",
    );
    within(
        predicted.uncached_prefill_tokens as f64,
        measured.uncached_prefill_tokens as f64,
        "uncached prefill tokens at 218 blocks",
    );
}
