//! Human-readable rendering of an evaluation (what `plan` prints).

use crate::act::mode::Mode;
use crate::decide::policy::{Evaluation, InputHealth, PolicyConfig, Transition};
use kvscope_kit::clock::fmt_utc;
use std::fmt::Write as _;

fn verdict_line(e: &Evaluation) -> String {
    match (e.transition, e.hold) {
        (_, Some(h)) => format!("{} → stays {} (held by the operator)", e.from, h.mode()),
        (Transition::EnterLive, _) => format!("{} → would go LIVE", e.from),
        (Transition::SafetyDrop, _) => format!("{} → would drop to DRY at once", e.from),
        (Transition::EconomicExit, _) => format!("{} → would leave LIVE for DRY", e.from),
        (Transition::Stay, _) if e.to == Mode::Live => "LIVE → would stay LIVE".into(),
        (Transition::Stay, _) => format!("{} → would stay {}", e.from, e.to),
    }
}

fn input_words(i: InputHealth) -> &'static str {
    match i {
        InputHealth::Fresh => "fresh",
        InputHealth::Stale => "stale",
        InputHealth::Missing => "missing",
        InputHealth::AgentLost => "fresh, but an agent is lost",
    }
}

fn bytes_per_s(v: f64) -> String {
    if v >= 1e9 {
        format!("{:.2} GB/s", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.1} MB/s", v / 1e6)
    } else {
        format!("{v:.0} B/s")
    }
}

/// The plan as text: the verdict, the reasons, and the figures behind them.
pub fn render(e: &Evaluation, policy: &PolicyConfig, source: &str) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "kvscope actuator plan, as of {} ({source})",
        fmt_utc(e.at_ns)
    );
    let _ = writeln!(o, "\n{}\n", verdict_line(e));
    let _ = writeln!(o, "Why:");
    for r in &e.reasons {
        let _ = writeln!(o, "  - {r}");
    }
    let Some(f) = &e.figures else {
        let _ = writeln!(o, "\nNo figures: the input is {}.", input_words(e.input));
        let _ = writeln!(o, "\nNothing was changed (plan acts on nothing).");
        return o;
    };
    let _ = writeln!(
        o,
        "\nInput: {}; the collector's latest record is {:.1} s old (max {} s).",
        input_words(e.input),
        f.watermark_age_s,
        policy.max_data_age_secs
    );
    if !f.agents.is_empty() {
        let agents: Vec<String> = f
            .agents
            .iter()
            .map(|(a, s)| match s {
                Some(s) => format!("{a} {s:.1} s ago"),
                None => format!("{a} never"),
            })
            .collect();
        let _ = writeln!(
            o,
            "Agents last heard: {} (lost after {} s).",
            agents.join(", "),
            policy.max_agent_silence_secs
        );
    }
    let _ = writeln!(
        o,
        "\nWindows, newest first ({} warm-up skipped; LIVE needs {} in a row marked ✓):",
        f.warmup_windows_skipped, policy.min_windows
    );
    let _ = writeln!(
        o,
        "  {:<24} {:>6} {:>12} {:>6} {:>10} {:>6}  {:>17}  misses",
        "start (UTC)", "spills", "Δ tok/s", "gated", "beneficial", "share", "KVMIGRATE s/h/f"
    );
    for w in &f.windows {
        let _ = writeln!(
            o,
            "{} {:<24} {:>6} {:>12.0} {:>6} {:>10} {:>6}  {:>17}  {}",
            if w.meets_entry { "✓" } else { " " },
            fmt_utc(w.start_ns),
            w.spills,
            w.true_delta_tok_per_s,
            w.candidates,
            w.beneficial,
            w.beneficial_share
                .map_or("-".into(), |s| format!("{:.0}%", s * 100.0)),
            format!(
                "{}/{}/{}",
                w.spill_lines, w.handshakes_obtained, w.dispatch_failures
            ),
            w.misses.join("; ")
        );
    }
    let n = &f.nixl;
    let _ = writeln!(
        o,
        "\nNIXL ({}): handshakes {} ok / {} failed{}; path {}.",
        if n.mapped {
            "mapped agents"
        } else {
            "fleet-wide: no worker→agent mapping"
        },
        n.handshakes.ok,
        n.handshakes.failed,
        match (n.recent, n.recent_span_s) {
            (Some(r), Some(s)) =>
                format!(", {} ok / {} failed in the last {s:.0} s", r.ok, r.failed),
            _ => ", no earlier sample (cumulative figures)".into(),
        },
        if n.proven { "proven" } else { "not proven" }
    );
    let _ = writeln!(
        o,
        "Fleet-wide bandwidth {}, handshake p{:.0} {}.",
        n.fleet_bandwidth_bytes_per_s
            .map_or("not measured".into(), bytes_per_s),
        policy.handshake_quantile * 100.0,
        n.fleet_handshake_s
            .map_or("not measured".into(), |s| format!("{:.1} ms", s * 1e3))
    );
    let _ = writeln!(
        o,
        "Cost model: {} B/token KV, prefill {} tok/s{}, dispatch overhead {} ms, gate {} tokens.",
        policy.kv_bytes_per_token,
        policy.prefill_tok_per_s,
        if policy.use_measured_prefill {
            " (raised to the target's measured rate when higher)"
        } else {
            ""
        },
        policy.dispatch_overhead_ms,
        policy.min_tokens
    );
    let _ = writeln!(
        o,
        "Automatic flips in the last hour{}: {} (cap {}); cooldown left{}: {:.0} s.",
        if e.changed() {
            ", counting this one"
        } else {
            ""
        },
        e.flips_last_hour,
        policy.max_flips_per_hour,
        if e.changed() { " after it" } else { "" },
        e.cooldown_remaining_s
    );
    let _ = writeln!(o, "\nNothing was changed (plan acts on nothing).");
    o
}
