//! Output blocks for real: on the lab (Dynamo 1.6.1's KV router, 3 mockers, router
//! temperature 0.5 so it spills), the workload plans every reply from its seed, the
//! mockers answer with those tokens (`--response-replay-trace-path`), and each reply
//! comes back as the same tokens in the session's next turn — as a real chat client
//! sends the model's answer back. The blocks a worker stored while decoding a reply are
//! then a prefix of the next prompt, and when the router sends that turn elsewhere they
//! are part of its true delta.
//!
//! Asserts: every reply was the planned one; spills' true delta holds decode-generated
//! blocks (`generated_delta_tokens` > 0); and per spill, that figure equals an
//! independent count from the workload's own record: of the delta's block positions
//! (chosen overlap .. best overlap), those holding a reply's tokens that the best worker
//! decoded (it answered that turn, by the response's `nvext.worker_id`). A turn of P
//! prompt tokens and N reply tokens leaves blocks ⌊P/16⌋ .. ⌊(P+N−1)/16⌋ stored by
//! decode (the last token's KV is never computed).
//!
//! The frontend runs with `--router-track-output-blocks` (lab_e2e runs without), and the
//! router's view of each choice is audited as lab_e2e audits it: the collector's figures
//! equal a count from the router's log and the radix tree's overlaps. Needs the lab
//! (`scripts/setup`).

use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::workload::{self, RequestRecord, WorkloadConfig};
use kvscope_lab::LabConfig;
use kvscope_wire::api::summary::{RouterViewAudit, TierViewAudit};
use serde_json::Value;
use std::collections::BTreeMap;

const WINDOW_SECS: f64 = 4.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_generated_blocks_show_in_the_true_delta_as_the_workload_counts_them() {
    let wl = WorkloadConfig {
        sessions: 24,
        families: 3,
        max_turns: 6,
        concurrency: 16,
        rate: Some(20.0),
        // 40 reply tokens: at least one whole decode block per turn.
        max_tokens: 40,
        duration_secs: 600.0,
        fixed_answers: true,
        ..WorkloadConfig::default()
    };
    let traces = tempfile::tempdir().unwrap();
    let trace = traces.path().join("answers.jsonl");
    std::fs::write(&trace, workload::answer_trace(&wl)).unwrap();
    let lab = LabConfig {
        workers: 3,
        frontend_args: vec![
            "--router-temperature".into(),
            "0.5".into(),
            "--router-track-output-blocks".into(),
        ],
        // Room for every conversation: no block is evicted and prefilled again, so a
        // decode-generated block stays one.
        num_gpu_blocks: 4096,
        mocker_args: vec![
            "--response-replay-trace-path".into(),
            trace.display().to_string(),
        ],
        ..LabConfig::default()
    };
    let run = kvscope_e2e::fleet(FleetRunConfig::new(lab, WINDOW_SECS))
        .await
        .expect("lab, agent and collector start");
    let summary = workload::run(WorkloadConfig {
        frontend: run.lab().frontend_url().to_string(),
        ..wl.clone()
    })
    .await
    .expect("the workload runs");
    assert_eq!(summary.failed, 0, "every workload request succeeds");
    for r in &summary.requests {
        assert_eq!(
            (r.answer_as_planned, r.usage_completion_tokens),
            (Some(true), Some(u64::from(wl.max_tokens))),
            "{}: the planned reply",
            r.x_request_id
        );
        assert!(r.worker_id.is_some(), "{}: nvext.worker_id", r.x_request_id);
    }
    run.wait_drained(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(60),
    )
    .await
    .expect("the collector catches up");
    let verdicts: Vec<Value> =
        kvscope_e2e::get_json(&format!("{}/api/verdicts?limit=100000", run.api())).await;
    let live: Value = kvscope_e2e::get_json(&format!("{}/api/summary", run.api())).await;
    let router_log = run.lab().router_log().to_path_buf();
    let recording = run.finish().await.expect("the run ends cleanly");

    // The router's view with output blocks tracked, counted from its log.
    let replayed = kvscope_fleet::fleet_run::replay(&recording, WINDOW_SECS, &[]).unwrap();
    let judged = &replayed.verdicts;
    let (want, _) = kvscope_e2e::router_view::count(
        &std::fs::read_to_string(&router_log).unwrap(),
        judged,
        &replayed.envelopes,
    );
    let audit: RouterViewAudit = serde_json::from_value(live["router_view"].clone()).unwrap();
    eprintln!("router view, output blocks tracked: {audit:?}");
    assert_eq!(audit, want);
    assert_eq!(
        want.compared as usize,
        judged.len(),
        "every decision has its view"
    );
    // The router's view of the lower tiers: 1.6.1 states `host_pinned_blocks` and
    // `disk_blocks` on every `Selected worker` line; the mockers publish no lower tier,
    // so the engines hold none past the device overlap either.
    let log = std::fs::read_to_string(&router_log).unwrap();
    let stated = log
        .lines()
        .filter(|l| l.contains("Selected worker") && l.contains("host_pinned_blocks="))
        .count();
    let tiers: TierViewAudit = serde_json::from_value(live["router_tier_view"].clone()).unwrap();
    eprintln!("router's lower-tier view: {tiers:?}, {stated} lines state it");
    assert_eq!(
        tiers.compared as usize,
        judged.len(),
        "every decision's line states it"
    );
    assert!(stated >= judged.len());
    assert_eq!(tiers.exact, tiers.compared);

    let by_router_id: BTreeMap<&str, &RequestRecord> = summary
        .requests
        .iter()
        .filter_map(|r| Some((r.router_request_id.as_deref()?, r)))
        .collect();
    let mut earlier: BTreeMap<usize, Vec<&RequestRecord>> = BTreeMap::new();
    for r in &summary.requests {
        earlier.entry(r.session).or_default().push(r);
    }
    let (mut spills, mut measured, mut counted) = (0u64, 0u64, 0u64);
    for v in verdicts.iter().filter(|v| v["spill"] == true) {
        let Some(r) = by_router_id.get(v["request_id"].as_str().unwrap()) else {
            continue;
        };
        let bs = v["block_size"].as_u64().unwrap();
        let (chosen, best) = (
            v["chosen_overlap_blocks"].as_u64().unwrap(),
            v["best_overlap_blocks"].as_u64().unwrap(),
        );
        let best_worker = v["best"]["worker_id"].as_u64().unwrap();
        // The workload's count: the delta's positions inside a reply the best worker
        // decoded, over the session's earlier turns.
        let generated: u64 = earlier[&r.session]
            .iter()
            .filter(|e| e.turn < r.turn && e.worker_id == Some(best_worker))
            .map(|e| {
                let (p, n) = (e.prompt_tokens as u64, u64::from(wl.max_tokens));
                let (from, to) = (p / bs, (p + n - 1) / bs);
                to.min(best).saturating_sub(from.max(chosen))
            })
            .sum::<u64>()
            * bs;
        let got = v["generated_delta_tokens"].as_u64().unwrap();
        assert_eq!(
            got, generated,
            "{}: decode-generated delta tokens, measured vs the workload's count ({v})",
            r.x_request_id
        );
        spills += 1;
        measured += got;
        counted += generated;
    }
    let delta: u64 = verdicts
        .iter()
        .filter(|v| v["spill"] == true)
        .map(|v| v["true_delta_tokens"].as_u64().unwrap())
        .sum();
    eprintln!(
        "{spills} spills: {measured} of {delta} true-delta tokens in decode-generated blocks \
         (the workload counts {counted})"
    );
    assert!(spills > 0, "the router spilled");
    assert!(
        measured > 0,
        "decode-generated blocks show in the true delta"
    );
}
