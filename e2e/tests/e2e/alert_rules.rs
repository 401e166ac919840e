//! The alert rules in `dashboards/prometheus/` through Debian's promtool: they parse
//! (`check rules`), their fixtures pass (`test rules`: each alert fires on the series
//! that should fire it and stays silent on look-alikes), every alert has both a firing
//! and a silent case, and the example scrape config that loads them is valid. promtool
//! missing fails this test saying how to install it.

use kvscope_lab::prometheus::promtool;
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dashboards/prometheus")
}

#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let d = dir();
    let out =
        promtool(&d, &["check", "rules", "kvscope-alerts.yml"]).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(out.contains("SUCCESS"), "{out}");
    promtool(&d, &["test", "rules", "kvscope-alerts.test.yml"]).unwrap_or_else(|e| panic!("{e:#}"));
    promtool(&d, &["check", "config", "prometheus.example.yml"])
        .unwrap_or_else(|e| panic!("{e:#}"));
}

#[test]
fn every_alert_has_a_firing_and_a_silent_fixture() {
    let rules = std::fs::read_to_string(dir().join("kvscope-alerts.yml")).unwrap();
    let tests = std::fs::read_to_string(dir().join("kvscope-alerts.test.yml")).unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(
        alerts.len() >= 6,
        "the rule file names its alerts: {alerts:?}"
    );
    // Each `alertname:` line is followed by its `exp_alerts:` line.
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    let cases: Vec<(&str, bool)> = lines
        .windows(2)
        .filter_map(|w| {
            let name = w[0].strip_prefix("alertname: ")?;
            let silent = w[1] == "exp_alerts: []";
            Some((name, silent))
        })
        .collect();
    let mut missing = Vec::new();
    for a in &alerts {
        for (silent, what) in [(false, "firing"), (true, "silent")] {
            if !cases.contains(&(*a, silent)) {
                missing.push(format!("{a}: no {what} case"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "kvscope-alerts.test.yml lacks:\n{}",
        missing.join("\n")
    );
    let severities = rules.matches("severity: ").count();
    assert_eq!(severities, alerts.len(), "every alert has a severity label");
    for key in ["summary: ", "description: "] {
        assert_eq!(
            rules.matches(key).count(),
            alerts.len(),
            "every alert has a {key}"
        );
    }
}
