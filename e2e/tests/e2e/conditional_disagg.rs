//! Conditional disaggregation's break-even checked against real runs. Two labs on
//! Dynamo 1.6.1: a disaggregated one (a decode mocker and a prefill mocker eight times
//! faster at prefill, as a prefill pool beside busy decode engines is; every prefill
//! runs remotely and hands its KV over) and an aggregated one (the same decode mocker
//! alone: every prefill runs locally). Each serves two seeded workloads of single-turn
//! requests with prompts of 256–6000 tokens, streamed, one at a time:
//!
//! - seed 1 calibrates: `kvscope whatif --ttft-samples` fits both paths' time to first
//!   token from its timings and recommends a threshold;
//! - seed 2 checks: each of its requests ran on both paths, so the mean time to first
//!   token with any threshold (prefills below it local, the rest remote) is measured,
//!   request by request, without the fitted model.
//!
//! Asserts: the recommended threshold is the measured best of the thresholds tried, or
//! next to it, and its measured mean is within 5% of the best any threshold gives; the
//! fit predicts every threshold's measured mean within 15%; the frontend takes the
//! recommended setting, and keeps as many prefills local under it as kvscope predicted
//! Dynamo's `isl_bounding` would (none: see below).
//!
//! Why not the frontend's own switch: Dynamo 1.6.1's `isl_bounding` keeps a prefill
//! local only while eff_isl / prompt < eff_isl_ratio_threshold ≤ 1.0, and its mocker
//! decode workers publish no KV events, so eff_isl is the whole prompt and every prefill
//! goes remote whatever the threshold (the lab's `disaggregated` test shows the
//! decisions). Needs the lab (`scripts/setup`).

use kvscope_lab::workload::{self, RequestRecord, WorkloadConfig, WorkloadSummary};
use kvscope_lab::{Lab, LabConfig};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;

const THRESHOLDS: [u64; 5] = [512, 1024, 2048, 4096, 8192];

fn workload(frontend: &str, seed: u64) -> WorkloadConfig {
    WorkloadConfig {
        frontend: frontend.to_string(),
        seed,
        families: 24,
        sessions: 24,
        max_turns: 1,
        system_words: 256,
        system_words_max: Some(6000),
        concurrency: 1,
        rate: None,
        stream: true,
        duration_secs: 600.0,
        ..WorkloadConfig::default()
    }
}

/// Runs both seeds on one lab; returns their summaries.
async fn serve(lab: LabConfig) -> [WorkloadSummary; 2] {
    let lab = Lab::start(lab).await.expect("the lab starts");
    let url = lab.frontend_url().to_string();
    let mut out = Vec::new();
    for seed in [1, 2] {
        let s = workload::run(workload(&url, seed))
            .await
            .expect("the workload runs");
        assert_eq!(s.failed, 0, "every request succeeds");
        assert!(
            s.requests.iter().all(|r| r.ttft_ms.is_some()),
            "each streamed reply is timed"
        );
        out.push(s);
    }
    tokio::task::spawn_blocking(move || lab.stop())
        .await
        .unwrap();
    out.try_into().unwrap()
}

fn by_id(s: &WorkloadSummary) -> BTreeMap<&str, &RequestRecord> {
    s.requests
        .iter()
        .map(|r| (r.x_request_id.as_str(), r))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recommended_threshold_is_the_measured_best() {
    let base = LabConfig {
        workers: 1,
        speedup_ratio: 1.0,
        num_gpu_blocks: 4096,
        nats: false,
        ..LabConfig::default()
    };
    kvscope_e2e::lab_venv(&base.lab_dir);
    let [remote_cal, remote_check] = serve(LabConfig {
        prefill_workers: 1,
        prefill_speedup_ratio: Some(8.0),
        ..base.clone()
    })
    .await;
    let [local_cal, local_check] = serve(base.clone()).await;
    for (s, remote) in [
        (&remote_cal, true),
        (&local_cal, false),
        (&remote_check, true),
    ] {
        assert!(
            s.requests
                .iter()
                .all(|r| r.prefill_worker_id.is_some() == remote),
            "every request's prefill ran {}",
            if remote { "remotely" } else { "locally" }
        );
    }

    let dir = std::env::temp_dir().join(format!("kvscope-disagg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, s: &WorkloadSummary| -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, serde_json::to_vec(s).unwrap()).unwrap();
        p
    };
    let (r, l) = (
        write("remote.json", &remote_cal),
        write("local.json", &local_cal),
    );
    let out = kvscope_e2e::succeeded(
        std::process::Command::new(kvscope_e2e::kvscope())
            .args(["whatif", "--format", "json", "--ttft-samples"])
            .arg(&r)
            .arg("--ttft-samples")
            .arg(&l)
            .arg("--disagg-threshold")
            .arg(THRESHOLDS.map(|t| t.to_string()).join(",")),
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let answer: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    eprintln!("fitted: {}", answer["costs"]);
    let recommended = answer["recommended_threshold_tokens"].as_u64().unwrap();

    // Measured on seed 2: each request's time to first token on the path a threshold
    // gives it, from the run where it took that path.
    let (remote, local) = (by_id(&remote_check), by_id(&local_check));
    assert_eq!(remote.len(), local.len());
    let measured = |t: u64| -> f64 {
        let ttfts: Vec<f64> = local
            .iter()
            .map(|(id, l)| {
                let r = remote[id];
                assert_eq!(
                    l.prompt_tokens, r.prompt_tokens,
                    "{id}: one request on both paths"
                );
                if (l.prompt_tokens as u64) < t {
                    l.ttft_ms
                } else {
                    r.ttft_ms
                }
                .unwrap()
            })
            .collect();
        ttfts.iter().sum::<f64>() / ttfts.len() as f64
    };
    // Predicted for the same requests: kvscope's fitted lines (from seed 1) on seed 2's
    // sizes. (Its own rows judge the samples' requests, seed 1's.)
    let line = |path: &str, u: f64| {
        let c = &answer["costs"][path];
        c["fixed_ms"].as_f64().unwrap() + c["ms_per_ktok"].as_f64().unwrap() * u / 1e3
    };
    let predicted = |t: u64| -> f64 {
        local
            .values()
            .map(|l| {
                let u = l.prompt_tokens as f64;
                line(
                    if (l.prompt_tokens as u64) < t {
                        "local"
                    } else {
                        "remote"
                    },
                    u,
                )
            })
            .sum::<f64>()
            / local.len() as f64
    };
    eprintln!("threshold | measured mean TTFT ms (seed 2) | predicted (from seed 1) | error");
    let mut best = (f64::INFINITY, 0usize);
    for (i, t) in THRESHOLDS.iter().enumerate() {
        let (m, p) = (measured(*t), predicted(*t));
        eprintln!("{t} | {m:.1} | {p:.1} | {:+.1}%", 100.0 * (p / m - 1.0));
        assert!(
            (p / m - 1.0).abs() <= 0.15,
            "threshold {t}: predicted {p:.1} ms, measured {m:.1} ms"
        );
        if m < best.0 {
            best = (m, i);
        }
    }
    // The threshold tried nearest the recommended one, on a log scale.
    let nearest = (0..THRESHOLDS.len())
        .min_by(|&a, &b| {
            let d = |i: usize| ((THRESHOLDS[i] as f64).ln() - (recommended as f64).ln()).abs();
            d(a).total_cmp(&d(b))
        })
        .unwrap();
    eprintln!(
        "recommended {recommended} tokens (nearest tried: {}); measured best {} ({:.1} ms); \
         {:.0}% of requests local",
        THRESHOLDS[nearest],
        THRESHOLDS[best.1],
        best.0,
        100.0 * answer["local_share"].as_f64().unwrap()
    );
    assert!(
        nearest.abs_diff(best.1) <= 1,
        "recommended {recommended} tokens; the measured best of {THRESHOLDS:?} is {}",
        THRESHOLDS[best.1]
    );
    assert!(
        answer["crossing"]["remote_from"].as_u64().is_some(),
        "remote prefill pays off somewhere on this lab: {answer}"
    );
    // The best any threshold could do, measured: every request size tried as one.
    let mut sizes: Vec<u64> = local.values().map(|l| l.prompt_tokens as u64).collect();
    sizes.push(u64::MAX);
    let (m, t) = sizes
        .iter()
        .map(|&t| (measured(t), t))
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap();
    eprintln!(
        "measured best of any threshold: {m:.1} ms below {t} tokens; at the recommended: {:.1} ms",
        measured(recommended)
    );
    assert!(
        measured(recommended) <= 1.05 * m,
        "the recommended threshold's measured mean is within 5% of the best any threshold gives"
    );

    // The frontend takes the recommended setting as it stands.
    let config = answer["recommended_config"].as_str().unwrap().to_string();
    let lab = Lab::start(LabConfig {
        prefill_workers: 1,
        prefill_speedup_ratio: Some(8.0),
        frontend_args: vec![
            "--router-conditional-disagg".into(),
            "--router-conditional-disagg-config".into(),
            config.clone(),
        ],
        ..base
    })
    .await
    .unwrap_or_else(|e| panic!("the frontend takes {config}: {e}"));
    let s = workload::run(workload(lab.frontend_url(), 2))
        .await
        .expect("the workload runs");
    tokio::task::spawn_blocking(move || lab.stop())
        .await
        .unwrap();
    assert_eq!(s.failed, 0, "every request succeeds under {config}");
    let kept = s
        .requests
        .iter()
        .filter(|r| r.prefill_worker_id.is_none())
        .count();
    // kvscope predicted what isl_bounding keeps local (only prefixes cached on the decode
    // worker count) on the samples' requests; none of seed 2's had one cached either.
    let predicted_kept = answer["local_share_isl_bounding"].as_f64().unwrap();
    assert_eq!(
        kept as f64 / s.requests.len() as f64,
        predicted_kept,
        "the share the frontend kept local is the one predicted under isl_bounding"
    );
    eprintln!(
        "under {config}: {kept} of {} prefills stayed local (Dynamo 1.6.1's mocker decode \
         workers publish no KV events, so isl_bounding sees nothing cached and sends all remote)",
        s.requests.len()
    );
}
