//! What one evaluation reads and what it concludes: the observation, the input's health,
//! the safety triggers, the transition and why a flip was held back, and the figures
//! behind it.

use super::*;

/// The actuator's own directive outcomes over the last window length.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectiveStats {
    pub sent: u64,
    pub accepted: u64,
    pub rejected: u64,
    pub failed: u64,
}

/// One read of the world, as of `now_ns` (UNIX ns on the actuator's clock).
#[derive(Debug, Clone, Copy)]
pub struct Observation<'a> {
    pub now_ns: u64,
    /// The collector's responses, or why there are none.
    pub input: Result<&'a CollectorView, &'a str>,
    pub directives: DirectiveStats,
}

/// How usable the input was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputHealth {
    Fresh,
    /// The collector answered, but its data is older than `max_data_age_secs`.
    Stale,
    /// No answer, or nothing measured yet.
    Missing,
    /// Fresh, but an agent is lost.
    AgentLost,
}

/// A reason to drop to DRY at once (and not to go LIVE).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "trigger", rename_all = "snake_case")]
pub enum SafetyTrigger {
    InputMissing {
        error: String,
    },
    Stale {
        watermark_age_s: f64,
        max_age_s: f64,
    },
    NoAgents,
    AgentLost {
        agent: String,
        /// None: never heard from.
        silent_s: Option<f64>,
    },
    SilentFailure {
        window_start_ns: u64,
        spill_lines: u64,
    },
    /// The same failure seen without the fork's log lines: the receiver accepted the
    /// actuator's own directives, yet the agents' eBPF probes saw no NIXL handshake
    /// obtained between the mapped agents since LIVE began.
    DirectivesWithoutHandshakes {
        accepted: u64,
        live_for_s: f64,
    },
    DispatchFailures {
        window_start_ns: u64,
        failures: u64,
        attempts: u64,
        budget: u64,
    },
    DirectiveFailures {
        failed: u64,
        sent: u64,
        budget: u64,
    },
    HandshakeFailures {
        ok: u64,
        failed: u64,
        min_ratio: f64,
    },
}

impl SafetyTrigger {
    /// Every kind, as [`Self::kind`] names them (a bounded label set for `/metrics`).
    pub(crate) const KINDS: [&'static str; 9] = [
        "input_missing",
        "stale",
        "no_agents",
        "agent_lost",
        "silent_failure",
        "directives_without_handshakes",
        "dispatch_failures",
        "directive_failures",
        "handshake_failures",
    ];

    /// The trigger's kind, without its figures.
    pub fn kind(&self) -> &'static str {
        match self {
            SafetyTrigger::InputMissing { .. } => "input_missing",
            SafetyTrigger::Stale { .. } => "stale",
            SafetyTrigger::NoAgents => "no_agents",
            SafetyTrigger::AgentLost { .. } => "agent_lost",
            SafetyTrigger::SilentFailure { .. } => "silent_failure",
            SafetyTrigger::DirectivesWithoutHandshakes { .. } => "directives_without_handshakes",
            SafetyTrigger::DispatchFailures { .. } => "dispatch_failures",
            SafetyTrigger::DirectiveFailures { .. } => "directive_failures",
            SafetyTrigger::HandshakeFailures { .. } => "handshake_failures",
        }
    }
}

impl fmt::Display for SafetyTrigger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SafetyTrigger::InputMissing { error } => write!(f, "input missing: {error}"),
            SafetyTrigger::Stale {
                watermark_age_s,
                max_age_s,
            } => write!(
                f,
                "stale data: the collector's latest record is {watermark_age_s:.1} s old (max {max_age_s} s)"
            ),
            SafetyTrigger::NoAgents => write!(f, "no agent has reported to the collector"),
            SafetyTrigger::AgentLost {
                agent,
                silent_s: Some(s),
            } => write!(f, "agent {agent} lost: silent for {s:.1} s"),
            SafetyTrigger::AgentLost {
                agent,
                silent_s: None,
            } => write!(f, "agent {agent} lost: never heard from"),
            SafetyTrigger::SilentFailure {
                window_start_ns,
                spill_lines,
            } => write!(
                f,
                "silent NIXL failure: {spill_lines} KVMIGRATE_SPILL lines and zero \"producer handshake obtained\" in the window from {}",
                fmt_utc(*window_start_ns)
            ),
            SafetyTrigger::DirectivesWithoutHandshakes {
                accepted,
                live_for_s,
            } => write!(
                f,
                "silent NIXL failure: {accepted} migration directives accepted in the last window, yet zero NIXL handshakes obtained between the mapped agents in {live_for_s:.0} s of LIVE"
            ),
            SafetyTrigger::DispatchFailures {
                window_start_ns,
                failures,
                attempts,
                budget,
            } => write!(
                f,
                "{failures} migration dispatch failures for {attempts} spill lines in the window from {} (budget {budget})",
                fmt_utc(*window_start_ns)
            ),
            SafetyTrigger::DirectiveFailures {
                failed,
                sent,
                budget,
            } => write!(
                f,
                "{failed} of {sent} migration directives failed or were rejected in the last window (budget {budget})"
            ),
            SafetyTrigger::HandshakeFailures {
                ok,
                failed,
                min_ratio,
            } => write!(
                f,
                "recent NIXL handshakes failing: {ok} ok, {failed} failed (success ratio {:.2} < {min_ratio})",
                *ok as f64 / (*ok + *failed).max(1) as f64
            ),
        }
    }
}

/// What the evaluation did to the mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Transition {
    Stay,
    EnterLive,
    /// A safety trigger fired.
    SafetyDrop,
    /// The windows fell below the hysteresis thresholds.
    EconomicExit,
}

/// What held back a flip the figures called for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlipHold {
    /// Within `cooldown_secs` of the last flip (or of entering LIVE, for an exit).
    Cooldown,
    /// `max_flips_per_hour` leaves no room.
    FlipCap,
}

impl FlipHold {
    pub const ALL: [FlipHold; 2] = [FlipHold::Cooldown, FlipHold::FlipCap];

    pub fn as_str(self) -> &'static str {
        match self {
            FlipHold::Cooldown => "cooldown",
            FlipHold::FlipCap => "flip_cap",
        }
    }
}

/// One window as the policy sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WindowFigures {
    pub start_ns: u64,
    pub end_ns: u64,
    pub spills: u64,
    pub true_delta_tok_per_s: f64,
    /// Spills whose true delta clears `min_tokens`.
    pub candidates: u64,
    /// Candidates predicted to pay off (certainly: their whole delta bucket does).
    pub beneficial: u64,
    /// Candidates whose bucket straddles the break-even or the token gate: not counted
    /// as beneficial.
    pub uncertain: u64,
    /// Candidates without NIXL bandwidth or handshake figures: not beneficial.
    pub unscorable: u64,
    pub beneficial_share: Option<f64>,
    pub spill_lines: u64,
    pub handshakes_obtained: u64,
    pub dispatch_failures: u64,
    pub data_faults: u64,
    pub meets_entry: bool,
    pub meets_hysteresis: bool,
    /// What the window misses of the entry thresholds.
    pub misses: Vec<String>,
}

/// The NIXL figures behind the decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NixlCheck {
    /// Whether workers are mapped to NIXL agents (else fleet-wide figures).
    pub mapped: bool,
    pub handshakes: HandshakeCounts,
    /// Handshakes since the sample about one window ago (None on the first evaluation).
    pub recent: Option<HandshakeCounts>,
    pub recent_span_s: Option<f64>,
    pub proven: bool,
    pub fleet_bandwidth_bytes_per_s: Option<f64>,
    pub fleet_handshake_s: Option<f64>,
    /// Spill pairs (source→target) priced with fleet-wide figures.
    pub fleet_wide_pairs: Vec<String>,
}

/// Everything an evaluation looked at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    pub watermark_ns: u64,
    pub watermark_age_s: f64,
    /// Age of each expected agent's last word, seconds (None: never heard from).
    pub agents: Vec<(String, Option<f64>)>,
    /// The newest post-warm-up windows, newest first.
    pub windows: Vec<WindowFigures>,
    pub warmup_windows_skipped: usize,
    /// Consecutive qualifying windows, from the newest.
    pub entry_streak: usize,
    /// Consecutive windows below the hysteresis thresholds, from the newest.
    pub exit_streak: usize,
    pub nixl: NixlCheck,
    pub directives: DirectiveStats,
}

/// The outcome of one evaluation, with the reasons and figures behind it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    pub at_ns: u64,
    pub from: Mode,
    pub to: Mode,
    pub transition: Transition,
    pub hold: Option<OperatorHold>,
    pub input: InputHealth,
    /// The input health differs from the previous evaluation's.
    pub input_changed: bool,
    pub safety: Vec<SafetyTrigger>,
    pub reasons: Vec<String>,
    pub cooldown_remaining_s: f64,
    pub flips_last_hour: usize,
    /// A flip the figures called for, held back only by these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held_back: Vec<FlipHold>,
    pub figures: Option<Figures>,
}

impl Evaluation {
    pub fn changed(&self) -> bool {
        self.from != self.to
    }
}
