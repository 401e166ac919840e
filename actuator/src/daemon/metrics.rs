//! The actuator's Prometheus `/metrics`: the mode it decided and the mode the backends
//! took, evaluations by input health, flips by from/to and reason, flips held back by
//! the cooldown or the cap, safety triggers, directives by outcome, backend failures,
//! and how fresh its input is. Every label set is bounded (modes, reasons and outcomes
//! are enums) and every series exists from the first scrape, zero or not.

use crate::act::mode::Mode;
use crate::daemon::runtime::Actuator;
use crate::decide::policy::{FlipHold, InputHealth, SafetyTrigger, Transition};
use kvscope_kit::prom::{labels, Exposition, Format, Kind};
use std::collections::BTreeMap;

/// Flip reasons besides the safety triggers' kinds.
pub(crate) const REASON_ENTRY: &str = "thresholds_met";
pub(crate) const REASON_ECONOMIC_EXIT: &str = "below_hysteresis";
pub(crate) const REASON_BACKEND_FAILED: &str = "backend_failed";
pub(crate) const REASON_OPERATOR: &str = "operator";

const MODES: [Mode; 3] = [Mode::Off, Mode::Dry, Mode::Live];
const INPUTS: [InputHealth; 4] = [
    InputHealth::Fresh,
    InputHealth::Stale,
    InputHealth::Missing,
    InputHealth::AgentLost,
];

fn input_str(h: InputHealth) -> &'static str {
    match h {
        InputHealth::Fresh => "fresh",
        InputHealth::Stale => "stale",
        InputHealth::Missing => "missing",
        InputHealth::AgentLost => "agent_lost",
    }
}

/// What the actuator counted since it started.
#[derive(Debug, Clone)]
pub struct ActuatorCounters {
    pub evaluations: BTreeMap<&'static str, u64>,
    /// (from, to, reason) → flips.
    pub flips: BTreeMap<(Mode, Mode, &'static str), u64>,
    pub held_back: BTreeMap<&'static str, u64>,
    /// Evaluations in which each safety trigger fired.
    pub safety: BTreeMap<&'static str, u64>,
    /// Pushes of a mode that some backend refused.
    pub mode_apply_failures: u64,
    /// Audit entries that could not be written (each one lost from the log).
    pub audit_write_failures: u64,
    /// Evaluations without a collector read.
    pub input_errors: u64,
    pub last_good_input_ns: u64,
    pub last_evaluation_ns: u64,
}

impl Default for ActuatorCounters {
    fn default() -> Self {
        let mut flips = BTreeMap::new();
        flips.insert((Mode::Dry, Mode::Live, REASON_ENTRY), 0);
        for reason in SafetyTrigger::KINDS
            .into_iter()
            .chain([REASON_ECONOMIC_EXIT, REASON_BACKEND_FAILED])
        {
            flips.insert((Mode::Live, Mode::Dry, reason), 0);
        }
        Self {
            evaluations: INPUTS.iter().map(|h| (input_str(*h), 0)).collect(),
            flips,
            held_back: FlipHold::ALL.iter().map(|h| (h.as_str(), 0)).collect(),
            safety: SafetyTrigger::KINDS.iter().map(|k| (*k, 0)).collect(),
            mode_apply_failures: 0,
            audit_write_failures: 0,
            input_errors: 0,
            last_good_input_ns: 0,
            last_evaluation_ns: 0,
        }
    }
}

impl ActuatorCounters {
    /// Count one evaluation (`input_ok`: the collector answered).
    pub fn evaluated(&mut self, e: &crate::decide::policy::Evaluation, input_ok: bool) {
        *self.evaluations.entry(input_str(e.input)).or_default() += 1;
        self.last_evaluation_ns = e.at_ns;
        if input_ok {
            self.last_good_input_ns = e.at_ns;
        } else {
            self.input_errors += 1;
        }
        for s in &e.safety {
            *self.safety.entry(s.kind()).or_default() += 1;
        }
        for h in &e.held_back {
            *self.held_back.entry(h.as_str()).or_default() += 1;
        }
        if e.changed() {
            let reason = match e.transition {
                Transition::EnterLive => REASON_ENTRY,
                Transition::EconomicExit => REASON_ECONOMIC_EXIT,
                Transition::SafetyDrop => e.safety.first().map_or("safety", SafetyTrigger::kind),
                // A change without a policy transition: an operator's hold.
                Transition::Stay => REASON_OPERATOR,
            };
            self.flip(e.from, e.to, reason);
        }
    }

    pub fn flip(&mut self, from: Mode, to: Mode, reason: &'static str) {
        if from != to {
            *self.flips.entry((from, to, reason)).or_default() += 1;
        }
    }
}

fn one_hot(out: &mut Exposition, name: &str, help: &str, current: Option<Mode>) {
    out.family(name, Kind::Gauge, help);
    for m in MODES {
        out.gauge(
            name,
            &labels(&[("mode", m.as_str())]),
            u8::from(current == Some(m)),
        );
    }
}

/// The exposition text (0.0.4) of `a` now.
/// `api_refusals`: API requests refused for a missing or wrong token.
pub fn render(
    a: &Actuator,
    api_refusals: u64,
    http: &kvscope_kit::http::ServerStats,
    health: &kvscope_kit::Health,
) -> String {
    let mut out = Exposition::new(Format::Text);
    out.single_counter(
        "kvscope_actuator_api_refusals",
        "API requests refused for a missing or wrong token (each answered after a 1 s delay, one at a time).",
        "",
        api_refusals,
    );
    http.write_prometheus(&mut out, "kvscope_actuator");
    health.write_prometheus(&mut out, "kvscope_actuator");
    let c = a.counters();
    let status = a.status();
    one_hot(
        &mut out,
        "kvscope_actuator_mode",
        "The mode the actuator decided (1 for the current one): off, dry or live.",
        Some(status.mode),
    );
    one_hot(
        &mut out,
        "kvscope_actuator_applied_mode",
        "The mode last pushed to the backends (1 for it; all 0 before the first push).",
        status.applied.mode,
    );
    out.single_gauge(
        "kvscope_actuator_mode_applied_ok",
        "1 when every backend took the last mode pushed.",
        "",
        u8::from(status.applied.ok),
    );
    out.single_counter(
        "kvscope_actuator_mode_apply_failures",
        "Pushes of a mode that some backend refused (retried every evaluation).",
        "",
        c.mode_apply_failures,
    );
    out.single_counter(
        "kvscope_actuator_audit_write_failures",
        "Audit entries that could not be written to the audit log: each one is missing from it.",
        "",
        c.audit_write_failures,
    );
    out.single_gauge(
        "kvscope_actuator_operator_hold",
        "1 while an operator holds the mode (OFF or DRY).",
        "",
        u8::from(status.hold.is_some()),
    );
    let name = "kvscope_actuator_evaluations";
    out.family(
        name,
        Kind::Counter,
        "Policy evaluations by input health (fresh, stale, missing, agent_lost).",
    );
    for (input, n) in &c.evaluations {
        out.counter(name, &labels(&[("input", input)]), *n);
    }
    let name = "kvscope_actuator_flips";
    out.family(
        name,
        Kind::Counter,
        "Mode changes by from, to and reason (thresholds_met, a safety trigger's kind, below_hysteresis, backend_failed, operator).",
    );
    for ((from, to, reason), n) in &c.flips {
        out.counter(
            name,
            &labels(&[
                ("from", from.as_str()),
                ("to", to.as_str()),
                ("reason", reason),
            ]),
            *n,
        );
    }
    let name = "kvscope_actuator_flips_held_back";
    out.family(
        name,
        Kind::Counter,
        "Evaluations whose figures called for a flip that only the cooldown or the flip cap held back.",
    );
    for (reason, n) in &c.held_back {
        out.counter(name, &labels(&[("reason", reason)]), *n);
    }
    let name = "kvscope_actuator_safety_triggers";
    out.family(
        name,
        Kind::Counter,
        "Evaluations in which a safety trigger fired, by trigger.",
    );
    for (trigger, n) in &c.safety {
        out.counter(name, &labels(&[("trigger", trigger)]), *n);
    }
    let d = a.ledger().totals();
    let name = "kvscope_actuator_directives";
    out.family(
        name,
        Kind::Counter,
        "Migration directives by outcome (accepted, duplicate, rejected, failed, abandoned, rate_limited).",
    );
    for (outcome, n) in [
        ("accepted", d.accepted),
        ("duplicate", d.duplicate),
        ("rejected", d.rejected),
        ("failed", d.failed),
        ("abandoned", d.abandoned),
        ("rate_limited", d.rate_limited),
    ] {
        out.counter(name, &labels(&[("outcome", outcome)]), n);
    }
    out.single_counter(
        "kvscope_actuator_directives_issued",
        "Migration directives issued (sent or rate-limited).",
        "",
        d.issued,
    );
    out.single_gauge(
        "kvscope_actuator_directives_in_flight",
        "Migration directives sent and not answered yet.",
        "",
        d.in_flight,
    );
    out.single_counter(
        "kvscope_actuator_input_errors",
        "Evaluations without a collector read (unreachable, or an error answer).",
        "",
        c.input_errors,
    );
    out.single_gauge(
        "kvscope_actuator_last_evaluation_timestamp_seconds",
        "Time of the last evaluation (UNIX seconds; 0 before the first).",
        "",
        c.last_evaluation_ns as f64 / 1e9,
    );
    out.single_gauge(
        "kvscope_actuator_last_good_input_timestamp_seconds",
        "Time of the last evaluation with a collector read (UNIX seconds; 0 before the first).",
        "",
        c.last_good_input_ns as f64 / 1e9,
    );
    let last = a.last_evaluation();
    let figures = last.and_then(|e| e.figures.as_ref());
    out.single_gauge(
        "kvscope_actuator_input_data_age_seconds",
        "Age of the collector's latest record at the last evaluation (NaN without figures).",
        "",
        figures.map_or(f64::NAN, |f| f.watermark_age_s),
    );
    out.single_gauge(
        "kvscope_actuator_entry_streak_windows",
        "Consecutive measured windows that qualify for LIVE (LIVE needs policy.min_windows).",
        "",
        figures.map_or(0, |f| f.entry_streak),
    );
    out.single_gauge(
        "kvscope_actuator_nixl_proven",
        "1 when the NIXL producer path is proven (handshakes observed and succeeding).",
        "",
        u8::from(figures.is_some_and(|f| f.nixl.proven)),
    );
    out.single_gauge(
        "kvscope_actuator_cooldown_remaining_seconds",
        "Seconds left in the cooldown since the last flip.",
        "",
        last.map_or(0.0, |e| e.cooldown_remaining_s),
    );
    out.single_gauge(
        "kvscope_actuator_flips_last_hour",
        "Automatic flips within the last hour (capped by policy.max_flips_per_hour).",
        "",
        last.map_or(0, |e| e.flips_last_hour),
    );
    out.finish()
}
