//! `kvscope-bench freshness` end to end at a low rate, against the real agent, NATS
//! JetStream and collector: it runs, every decision gets its verdict, each verdict
//! counts the event it depends on and not its own prefill, and the collector applied
//! exactly what the generator published. Benchmarks are not tests: no timing is
//! asserted here.

use serde_json::Value;
use std::process::Command;

#[test]
fn freshness_runs_end_to_end_at_a_low_rate() {
    let bench = kvscope_lab::paths::built_binary("kvscope-bench");
    let kvscope = kvscope_e2e::kvscope();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("freshness.json");
    let out = Command::new(&bench)
        .arg("freshness")
        .args(["--blocks-per-sec", "3000", "--duration-secs", "3"])
        .args(["--warmup-secs", "1", "--workers", "3"])
        .args(["--capacity-blocks", "256", "--conversations", "16"])
        .args([
            "--turns",
            "4",
            "--prompt-blocks",
            "8",
            "--answer-blocks",
            "4",
        ])
        .arg("--kvscope")
        .arg(&kvscope)
        .arg("--json")
        .arg(&json)
        .arg("--out")
        .arg(dir.path().join("run"))
        .output()
        .unwrap();
    let logs = || {
        let run = dir.path().join("run");
        let read = |f: &str| std::fs::read_to_string(run.join(f)).unwrap_or_default();
        format!(
            "stdout:\n{}\nstderr:\n{}\nagent.log:\n{}\ncollector.log:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            read("agent.log"),
            read("collector.log")
        )
    };
    assert!(out.status.success(), "the bench failed\n{}", logs());
    let r: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r:#}"));
    assert!(n("measured_decisions") > 10, "{r:#}");
    assert_eq!(n("verdicts_missing"), 0, "{r:#}");
    assert_eq!(n("verdicts_missed_event"), 0, "{r:#}");
    assert_eq!(n("verdicts_saw_own_prefill"), 0, "{r:#}");
    let c = &r["collector"];
    assert_eq!(c["stored_blocks"], r["published_stored_total"], "{r:#}");
    assert_eq!(c["removed_blocks"], r["published_removed_total"], "{r:#}");
    assert!(
        n("published_removed_total") > 0,
        "the caches were never full: {r:#}"
    );
    assert_eq!(c["decisions"], r["decisions_total"], "{r:#}");
    for k in [
        "sequence_gaps",
        "unknown_parent_events",
        "unknown_removed_blocks",
    ] {
        assert_eq!(c[k], 0, "{k}: {r:#}");
    }
}
