//! The policy engine: from one read of the collector, decide OFF / DRY / LIVE. Pure — the
//! clock comes in with the observation, nothing here does I/O — so every rule is tested
//! with generated windows.
//!
//! Going LIVE needs all of:
//! - the newest `min_windows` post-warm-up windows, contiguous, each *qualifying*: no
//!   data faults, true-delta volume ≥ `min_true_delta_tok_per_s`, at least
//!   `min_candidate_spills` spills whose true delta clears `min_tokens`, a share ≥
//!   `min_beneficial_share` of those with a positive predicted net benefit (see
//!   [`kvscope_wire::cost`]), and the fork's dispatch failures within budget;
//! - the NIXL path proven: ≥ `min_handshakes` handshakes observed between the mapped
//!   agents (every agent without a mapping) and a success ratio ≥
//!   `min_handshake_success_ratio` (over the recent ones when there are enough, else
//!   cumulative);
//! - no safety trigger (below), `cooldown_secs` since the last flip, room for two more
//!   flips under `max_flips_per_hour` (the entry and its later exit), and no operator hold.
//!
//! LIVE drops to DRY at once, whatever the cooldown and the cap, on any safety trigger:
//! input missing (collector unreachable, no records yet), stale data (watermark older
//! than `max_data_age_secs`), an agent lost (silent for `max_agent_silence_secs`, or no
//! agent at all), the fork's silent failure (a window since LIVE with ≥
//! `silent_failure_min_spill_lines` `KVMIGRATE_SPILL` lines and zero "producer handshake
//! obtained"; a window counts when most of it lies after LIVE began plus
//! `apply_grace_secs`), dispatch failures over budget (the fork's, in the newest window, or the
//! actuator's own directives), or recent NIXL handshakes failing (ratio below
//! `min_handshake_success_ratio` over ≥ `min_handshakes`). It leaves LIVE for economic
//! reasons (hysteresis) only after `exit_windows` consecutive windows miss the entry
//! thresholds scaled by `hysteresis`, and not within `cooldown_secs` of entering. After
//! LIVE ends, windows measured mostly before that do not count toward entering again.

use crate::act::mode::{Mode, OperatorHold, Override};
use crate::decide::input::CollectorView;
use kvscope_kit::clock::fmt_utc;
use kvscope_wire::api::window::{spill_delta_bucket_floor, WindowSummary, SPILL_DELTA_BUCKETS};
use kvscope_wire::cost::WorkerAgent;
use kvscope_wire::cost::{self, FigureSource, HandshakeCounts, NixlFigures};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, VecDeque};
use std::fmt;

const NS: u64 = 1_000_000_000;
const HOUR_NS: u64 = 3600 * NS;

mod config;
mod evaluation;

pub use config::PolicyConfig;
pub use evaluation::*;

/// What the engine remembers between evaluations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyState {
    pub mode: Mode,
    pub hold: Option<OperatorHold>,
    pub live_since_ns: Option<u64>,
    /// The last automatic flip (or failed attempt to apply one).
    pub last_flip_ns: Option<u64>,
    /// Automatic flips within the last hour.
    pub flips_ns: VecDeque<u64>,
    /// The last time LIVE ended (automatically, or a LIVE that could not be applied):
    /// windows mostly before it do not count toward going LIVE again.
    pub last_exit_ns: Option<u64>,
    pub input: Option<InputHealth>,
    /// (time, cumulative handshakes) samples for the recent handshake ratio.
    pub handshake_samples: VecDeque<(u64, HandshakeCounts)>,
    /// Cumulative handshakes when LIVE began (for the silent failure without log lines).
    #[serde(default)]
    pub handshakes_at_live: Option<HandshakeCounts>,
}

impl Default for PolicyState {
    fn default() -> Self {
        Self {
            mode: Mode::Dry,
            hold: None,
            live_since_ns: None,
            last_flip_ns: None,
            flips_ns: VecDeque::new(),
            last_exit_ns: None,
            input: None,
            handshake_samples: VecDeque::new(),
            handshakes_at_live: None,
        }
    }
}

/// What an earlier run left in the audit log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Restored {
    pub flips_ns: Vec<u64>,
    pub hold: Option<OperatorHold>,
}

#[derive(Debug, Clone)]
pub struct PolicyEngine {
    cfg: PolicyConfig,
    mapping: Vec<WorkerAgent>,
    state: PolicyState,
}

impl PolicyEngine {
    /// Starts in DRY (OFF when `hold` is OFF).
    pub fn new(cfg: PolicyConfig, mapping: Vec<WorkerAgent>) -> Self {
        Self {
            cfg,
            mapping,
            state: PolicyState::default(),
        }
    }

    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }
    /// The configured mapping, completed with what the node agents told (see
    /// [`kvscope_wire::cost::mapping`]).
    pub fn mapping_for(&self, view: &CollectorView) -> Vec<WorkerAgent> {
        kvscope_wire::cost::mapping(&self.mapping, &view.nixl_agents)
    }
    pub fn state(&self) -> &PolicyState {
        &self.state
    }
    pub fn mode(&self) -> Mode {
        self.state.mode
    }

    /// Take over the flips and the operator's hold a previous run recorded.
    pub fn restore(&mut self, r: &Restored) {
        self.state.flips_ns = r.flips_ns.iter().copied().collect();
        self.state.last_flip_ns = r.flips_ns.iter().copied().max();
        // Whatever the last flip was, windows before it do not vouch for LIVE.
        self.state.last_exit_ns = self.state.last_flip_ns;
        self.state.hold = r.hold;
        if let Some(h) = r.hold {
            self.state.mode = h.mode();
        }
    }

    /// Take `mode` as what the router is in now, as `plan --current` does. OFF can only
    /// have been an operator's doing, so it comes with an OFF hold.
    pub fn assume_mode(&mut self, mode: Mode, since_ns: Option<u64>) {
        self.state.mode = mode;
        self.state.live_since_ns = (mode == Mode::Live).then(|| since_ns.unwrap_or(0));
        if mode == Mode::Off {
            self.state.hold = Some(OperatorHold::Off);
        }
    }

    /// An operator's override. Returns (from, to).
    pub fn operator(&mut self, ov: Override) -> (Mode, Mode) {
        let from = self.state.mode;
        let to = match ov {
            Override::Off => Mode::Off,
            Override::Dry => Mode::Dry,
            Override::Auto if self.state.hold.is_some() => Mode::Dry,
            Override::Auto => from,
        };
        self.state.hold = ov.hold();
        self.state.mode = to;
        if to != Mode::Live {
            self.state.live_since_ns = None;
        }
        (from, to)
    }

    /// The backends could not apply `attempted`. A failed LIVE leaves the engine in DRY
    /// with the attempt counted as a flip (so the cooldown and the cap hold back
    /// retries); a failed DRY or OFF keeps the engine there (it is retried by the caller).
    pub(crate) fn apply_failed(&mut self, attempted: Mode, now_ns: u64) {
        if attempted == Mode::Live && self.state.mode == Mode::Live {
            self.state.mode = Mode::Dry;
            self.state.live_since_ns = None;
            self.state.flips_ns.push_back(now_ns);
            self.state.last_flip_ns = Some(now_ns);
            self.state.last_exit_ns = Some(now_ns);
        }
    }

    /// Leave LIVE for DRY without counting a flip (the actuator is stopping).
    pub(crate) fn leave_live(&mut self) {
        if self.state.mode == Mode::Live {
            self.state.mode = Mode::Dry;
            self.state.live_since_ns = None;
        }
    }

    /// Evaluate once and move the mode.
    pub fn evaluate(&mut self, obs: &Observation<'_>) -> Evaluation {
        let now = obs.now_ns;
        while self
            .state
            .flips_ns
            .front()
            .is_some_and(|t| now.saturating_sub(*t) >= HOUR_NS)
        {
            self.state.flips_ns.pop_front();
        }
        let from = self.state.mode;
        let assessed = self.assess(obs);
        let input_changed = self.state.input != Some(assessed.input);
        self.state.input = Some(assessed.input);
        let cooldown_ns = secs_ns(self.cfg.cooldown_secs);
        let cooldown_remaining_ns = self
            .state
            .last_flip_ns
            .map_or(0, |t| (t + cooldown_ns).saturating_sub(now));
        let flips = self.state.flips_ns.len();
        let mut reasons = Vec::new();
        let mut held_back = Vec::new();
        let (to, transition) = match (self.state.hold, from) {
            (Some(h), _) => {
                reasons.push(format!("{} held by the operator", h.mode()));
                reasons.extend(
                    assessed
                        .safety
                        .iter()
                        .map(|s| format!("(would be DRY: {s})")),
                );
                (h.mode(), Transition::Stay)
            }
            (None, Mode::Live) => {
                if !assessed.safety.is_empty() {
                    reasons.extend(assessed.safety.iter().map(ToString::to_string));
                    (Mode::Dry, Transition::SafetyDrop)
                } else if let Some(f) = assessed
                    .figures
                    .as_ref()
                    .filter(|f| f.exit_streak >= self.cfg.exit_windows)
                {
                    let newest = &f.windows[0];
                    let dwell_left = self
                        .state
                        .live_since_ns
                        .map_or(0, |t| (t + cooldown_ns).saturating_sub(now));
                    let why = format!(
                        "{} consecutive windows below {:.0}% of the entry thresholds (newest: {})",
                        f.exit_streak,
                        self.cfg.hysteresis * 100.0,
                        newest.misses.join("; ")
                    );
                    if dwell_left == 0 {
                        reasons.push(why);
                        (Mode::Dry, Transition::EconomicExit)
                    } else {
                        held_back.push(FlipHold::Cooldown);
                        reasons.push(format!(
                            "stays LIVE within its cooldown ({:.0} s left) although {why}",
                            dwell_left as f64 / 1e9
                        ));
                        (Mode::Live, Transition::Stay)
                    }
                } else {
                    reasons.push(self.live_summary(&assessed));
                    (Mode::Live, Transition::Stay)
                }
            }
            (None, _) => {
                let mut blockers: Vec<String> =
                    assessed.safety.iter().map(ToString::to_string).collect();
                if let Some(f) = &assessed.figures {
                    if f.entry_streak < self.cfg.min_windows {
                        blockers.push(self.streak_blocker(f));
                    }
                    if !f.nixl.proven {
                        blockers.push(self.nixl_blocker(&f.nixl));
                    }
                }
                let earned = blockers.is_empty();
                if cooldown_remaining_ns > 0 {
                    if earned {
                        held_back.push(FlipHold::Cooldown);
                    }
                    blockers.push(format!(
                        "cooldown: {:.0} s left since the last flip",
                        cooldown_remaining_ns as f64 / 1e9
                    ));
                }
                if flips + 2 > self.cfg.max_flips_per_hour {
                    if earned {
                        held_back.push(FlipHold::FlipCap);
                    }
                    blockers.push(format!(
                        "flip cap: {flips} automatic flips in the last hour, at most {} allowed and going LIVE needs room for two",
                        self.cfg.max_flips_per_hour
                    ));
                }
                if blockers.is_empty() {
                    reasons.push(self.live_summary(&assessed));
                    (Mode::Live, Transition::EnterLive)
                } else {
                    reasons.extend(blockers);
                    (Mode::Dry, Transition::Stay)
                }
            }
        };
        if let Some(f) = &assessed.figures {
            if !f.nixl.fleet_wide_pairs.is_empty() {
                reasons.push(if f.nixl.mapped {
                    format!(
                        "fleet-wide NIXL figures for spills between workers not mapped to NIXL agents (or whose pair has no figures): {}",
                        f.nixl.fleet_wide_pairs.join(", ")
                    )
                } else {
                    "no worker→NIXL agent mapping (none in [[worker_agents]], none told by the node agents): fleet-wide NIXL figures used"
                        .to_string()
                });
            }
        }
        if to != from && self.state.hold.is_none() {
            self.state.flips_ns.push_back(now);
            self.state.last_flip_ns = Some(now);
            if from == Mode::Live {
                self.state.last_exit_ns = Some(now);
            }
        }
        self.state.live_since_ns = match (to, from) {
            (Mode::Live, Mode::Live) => self.state.live_since_ns,
            (Mode::Live, _) => Some(now),
            _ => None,
        };
        self.state.handshakes_at_live = match (to, from) {
            (Mode::Live, Mode::Live) => self.state.handshakes_at_live,
            (Mode::Live, _) => assessed.figures.as_ref().map(|f| f.nixl.handshakes),
            _ => None,
        };
        self.state.mode = to;
        Evaluation {
            at_ns: now,
            from,
            to,
            transition,
            hold: self.state.hold,
            input: assessed.input,
            input_changed,
            safety: assessed.safety,
            reasons,
            cooldown_remaining_s: self
                .state
                .last_flip_ns
                .map_or(0, |t| (t + cooldown_ns).saturating_sub(now))
                as f64
                / 1e9,
            flips_last_hour: self.state.flips_ns.len(),
            held_back,
            figures: assessed.figures,
        }
    }

    fn live_summary(&self, a: &Assessed) -> String {
        let Some(f) = &a.figures else {
            return String::new();
        };
        let n = f.entry_streak.max(1).min(f.windows.len());
        if n == 0 {
            return "no window to show".into();
        }
        let ws = &f.windows[..n];
        let (vmin, vmax) = spread(ws.iter().map(|w| w.true_delta_tok_per_s));
        let (smin, smax) = spread(ws.iter().filter_map(|w| w.beneficial_share));
        let h = &f.nixl;
        format!(
            "{n} consecutive windows qualify: true delta {vmin:.0}–{vmax:.0} tok/s (min {}), beneficial share {:.0}–{:.0}% (min {:.0}%); NIXL handshakes {} ok / {} failed{}",
            self.cfg.min_true_delta_tok_per_s,
            smin * 100.0,
            smax * 100.0,
            self.cfg.min_beneficial_share * 100.0,
            h.handshakes.ok,
            h.handshakes.failed,
            h.recent
                .map(|r| format!(" ({} ok / {} failed recently)", r.ok, r.failed))
                .unwrap_or_default()
        )
    }

    fn streak_blocker(&self, f: &Figures) -> String {
        let have = f.windows.len();
        if have < self.cfg.min_windows && f.entry_streak == have {
            return format!(
                "only {have} complete post-warm-up windows ({} warm-up skipped); {} needed",
                f.warmup_windows_skipped, self.cfg.min_windows
            );
        }
        let first_bad = &f.windows[f.entry_streak];
        format!(
            "{} of {} windows qualify; the window from {} misses: {}",
            f.entry_streak,
            self.cfg.min_windows,
            fmt_utc(first_bad.start_ns),
            if first_bad.misses.is_empty() {
                "it is not contiguous with the newer one".to_string()
            } else {
                first_bad.misses.join("; ")
            }
        )
    }

    fn nixl_blocker(&self, n: &NixlCheck) -> String {
        let scope = if n.mapped {
            "between the mapped NIXL agents"
        } else {
            "fleet-wide"
        };
        if n.handshakes.total() < self.cfg.min_handshakes {
            format!(
                "NIXL producer path not proven: {} handshakes observed {scope}, {} needed (is the agent tracing NIXL?)",
                n.handshakes.total(),
                self.cfg.min_handshakes
            )
        } else {
            let r = n
                .recent
                .filter(|r| r.total() >= self.cfg.min_handshakes)
                .unwrap_or(n.handshakes);
            format!(
                "NIXL producer path not proven: handshake success ratio {:.2} ({} ok / {} failed {scope}) < {}",
                r.success_ratio().unwrap_or(0.0),
                r.ok,
                r.failed,
                self.cfg.min_handshake_success_ratio
            )
        }
    }

    fn assess(&mut self, obs: &Observation<'_>) -> Assessed {
        let now = obs.now_ns;
        let view = match obs.input {
            Ok(v) => v,
            Err(e) => {
                return Assessed {
                    input: InputHealth::Missing,
                    safety: vec![SafetyTrigger::InputMissing {
                        error: e.to_string(),
                    }],
                    figures: None,
                }
            }
        };
        let cfg = &self.cfg;
        let mut safety = Vec::new();
        let mut input = InputHealth::Fresh;
        let watermark_ns = view.summary.watermark_ns;
        let watermark_age_s = now.saturating_sub(watermark_ns) as f64 / 1e9;
        if watermark_ns == 0 {
            input = InputHealth::Missing;
            safety.push(SafetyTrigger::InputMissing {
                error: "the collector has not seen any record".into(),
            });
        } else if watermark_age_s > cfg.max_data_age_secs {
            input = InputHealth::Stale;
            safety.push(SafetyTrigger::Stale {
                watermark_age_s,
                max_age_s: cfg.max_data_age_secs,
            });
        }
        let expected: Vec<String> = if cfg.expected_agents.is_empty() {
            view.summary.agents.keys().cloned().collect()
        } else {
            cfg.expected_agents.clone()
        };
        if expected.is_empty() {
            safety.push(SafetyTrigger::NoAgents);
            if input == InputHealth::Fresh {
                input = InputHealth::AgentLost;
            }
        }
        let mut agents = Vec::new();
        for name in expected {
            let silent_s = view
                .summary
                .agents
                .get(&name)
                .map(|a| now.saturating_sub(a.last_seen_ns) as f64 / 1e9);
            if silent_s.is_none_or(|s| s > cfg.max_agent_silence_secs) {
                safety.push(SafetyTrigger::AgentLost {
                    agent: name.clone(),
                    silent_s,
                });
                if input == InputHealth::Fresh {
                    input = InputHealth::AgentLost;
                }
            }
            agents.push((name, silent_s));
        }

        // Windows: the newest closed ones, warm-up ones set aside.
        let mapping = self.mapping_for(view);
        let nixl = NixlFigures::new(&view.nixl, &mapping, cfg.handshake_quantile);
        let post: Vec<&WindowSummary> = view.windows.iter().filter(|w| !w.warmup).collect();
        if post.is_empty() && watermark_ns != 0 {
            if input == InputHealth::Fresh {
                input = InputHealth::Missing;
            }
            safety.push(SafetyTrigger::InputMissing {
                error: "the collector has no complete post-warm-up window".into(),
            });
        }
        let warmup_windows_skipped = view.windows.len() - post.len();
        let keep = cfg.min_windows.max(cfg.exit_windows);
        let mut fleet_wide_pairs = BTreeSet::new();
        let mut windows: Vec<WindowFigures> = post
            .iter()
            .take(keep)
            .map(|w| self.assess_window(w, &nixl, &mut fleet_wide_pairs))
            .collect();
        if let Some(exit) = self.state.last_exit_ns {
            for w in windows
                .iter_mut()
                .filter(|w| midpoint(w.start_ns, w.end_ns) < exit)
            {
                w.misses.push(format!(
                    "measured before LIVE last ended ({})",
                    fmt_utc(exit)
                ));
                w.meets_entry = false;
            }
        }
        let contiguous = |i: usize| i == 0 || post[i].end_ns == post[i - 1].start_ns;
        let entry_streak = (0..windows.len())
            .take_while(|&i| contiguous(i) && windows[i].meets_entry)
            .count();
        let exit_streak = (0..windows.len())
            .take_while(|&i| contiguous(i) && !windows[i].meets_hysteresis)
            .count();

        // The fork's silent failure, in windows that began after LIVE did.
        if let (Mode::Live, Some(since)) = (self.state.mode, self.state.live_since_ns) {
            let since = since.saturating_add(secs_ns(cfg.apply_grace_secs));
            if let Some(w) = view.windows.iter().find(|w| {
                midpoint(w.start_ns, w.end_ns) >= since
                    && w.migration_log.spill_lines >= cfg.silent_failure_min_spill_lines.max(1)
                    && w.migration_log.handshakes_obtained == 0
            }) {
                safety.push(SafetyTrigger::SilentFailure {
                    window_start_ns: w.start_ns,
                    spill_lines: w.migration_log.spill_lines,
                });
            }
        }
        if let Some(w) = view.windows.first() {
            let m = &w.migration_log;
            let budget = cfg.dispatch_budget(m.spill_lines);
            if m.dispatch_failures > budget {
                safety.push(SafetyTrigger::DispatchFailures {
                    window_start_ns: w.start_ns,
                    failures: m.dispatch_failures,
                    attempts: m.spill_lines,
                    budget,
                });
            }
        }
        let d = obs.directives;
        let budget = cfg.dispatch_budget(d.sent);
        if d.failed + d.rejected > budget {
            safety.push(SafetyTrigger::DirectiveFailures {
                failed: d.failed + d.rejected,
                sent: d.sent,
                budget,
            });
        }

        // NIXL handshakes: cumulative, and recent (since a sample about a window ago).
        let handshakes = nixl.handshakes();
        let span_ns = view
            .windows
            .first()
            .map_or(15 * NS, |w| w.end_ns.saturating_sub(w.start_ns).max(1));
        let samples = &mut self.state.handshake_samples;
        while samples.len() > 1 && now.saturating_sub(samples[1].0) >= span_ns {
            samples.pop_front();
        }
        let recent = samples
            .front()
            .filter(|(t, _)| *t < now)
            .map(|(t, c)| (now - t, handshakes.since(c)));
        samples.push_back((now, handshakes));
        if let Some((_, r)) = recent {
            if r.total() >= cfg.min_handshakes
                && r.success_ratio().unwrap_or(0.0) < cfg.min_handshake_success_ratio
            {
                safety.push(SafetyTrigger::HandshakeFailures {
                    ok: r.ok,
                    failed: r.failed,
                    min_ratio: cfg.min_handshake_success_ratio,
                });
            }
        }
        // The silent failure without the fork's lines: directives accepted, no handshake
        // obtained since LIVE began. Checked once LIVE is older than a window plus the
        // apply grace, so the agents' reports (every second or so) have caught up.
        if let (Mode::Live, Some(since), Some(at_live)) = (
            self.state.mode,
            self.state.live_since_ns,
            self.state.handshakes_at_live,
        ) {
            let live_for = now.saturating_sub(since);
            if live_for >= span_ns + secs_ns(cfg.apply_grace_secs)
                && d.accepted >= cfg.silent_failure_min_spill_lines.max(1)
                && handshakes.since(&at_live).ok == 0
            {
                safety.push(SafetyTrigger::DirectivesWithoutHandshakes {
                    accepted: d.accepted,
                    live_for_s: live_for as f64 / 1e9,
                });
            }
        }
        let judged = recent
            .map(|(_, r)| r)
            .filter(|r| r.total() >= cfg.min_handshakes)
            .unwrap_or(handshakes);
        let proven = handshakes.total() >= cfg.min_handshakes.max(1)
            && judged.success_ratio().unwrap_or(0.0) >= cfg.min_handshake_success_ratio;

        Assessed {
            input,
            safety,
            figures: Some(Figures {
                watermark_ns,
                watermark_age_s,
                agents,
                windows,
                warmup_windows_skipped,
                entry_streak,
                exit_streak,
                nixl: NixlCheck {
                    mapped: nixl.mapped(),
                    handshakes,
                    recent: recent.map(|(_, r)| r),
                    recent_span_s: recent.map(|(s, _)| s as f64 / 1e9),
                    proven,
                    fleet_bandwidth_bytes_per_s: nixl.fleet_bandwidth(),
                    fleet_handshake_s: nixl.fleet_handshake_s(),
                    fleet_wide_pairs: fleet_wide_pairs.into_iter().collect(),
                },
                directives: d,
            }),
        }
    }

    fn assess_window(
        &self,
        w: &WindowSummary,
        nixl: &NixlFigures<'_>,
        fleet_wide: &mut BTreeSet<String>,
    ) -> WindowFigures {
        let cfg = &self.cfg;
        let params = cfg.cost_params();
        let (mut candidates, mut beneficial, mut uncertain, mut unscorable) = (0, 0, 0, 0);
        for pair in &w.spill_pairs {
            let path = nixl.path(&pair.source, &pair.target);
            if path.bandwidth_from == FigureSource::FleetWide
                || path.handshake_from == FigureSource::FleetWide
            {
                fleet_wide.insert(format!("{}→{}", pair.source, pair.target));
            }
            let prefill = cfg.prefill_rate(w, &pair.target);
            for (i, &n) in pair.delta_buckets.iter().enumerate() {
                if n == 0 {
                    continue;
                }
                let lo = spill_delta_bucket_floor(i);
                let hi = (i + 1 < SPILL_DELTA_BUCKETS).then(|| spill_delta_bucket_floor(i + 1) - 1);
                if hi.is_some_and(|hi| hi < cfg.min_tokens) {
                    continue;
                }
                candidates += n;
                if lo < cfg.min_tokens {
                    uncertain += n;
                    continue;
                }
                // Net benefit grows with the delta (or never turns positive), so a
                // bucket pays off whole iff its smallest delta does.
                match cost::predict(&params, lo, &path, prefill) {
                    None => unscorable += n,
                    Some(p) if p.net_benefit_s > 0.0 => beneficial += n,
                    Some(_) => {
                        let top_pays = hi
                            .and_then(|hi| cost::predict(&params, hi, &path, prefill))
                            .is_some_and(|p| p.net_benefit_s > 0.0);
                        if top_pays {
                            uncertain += n;
                        }
                    }
                }
            }
        }
        let share = (candidates > 0).then(|| beneficial as f64 / candidates as f64);
        let m = &w.migration_log;
        let misses_at = |scale: f64| {
            let mut misses = Vec::new();
            if w.data_faults > 0 {
                misses.push(format!("{} data faults", w.data_faults));
            }
            let min_vol = cfg.min_true_delta_tok_per_s * scale;
            if w.true_delta_tok_per_s < min_vol {
                misses.push(format!(
                    "true delta {:.0} tok/s < {min_vol:.0}",
                    w.true_delta_tok_per_s
                ));
            }
            if candidates < cfg.min_candidate_spills.max(1) {
                misses.push(format!(
                    "{candidates} spills with ≥ {} tokens, {} needed",
                    cfg.min_tokens,
                    cfg.min_candidate_spills.max(1)
                ));
            } else {
                let min_share = cfg.min_beneficial_share * scale;
                let s = share.unwrap_or(0.0);
                if s < min_share {
                    let mut why = format!(
                        "beneficial share {:.0}% ({beneficial} of {candidates}) < {:.0}%",
                        s * 100.0,
                        min_share * 100.0
                    );
                    if unscorable > 0 {
                        why.push_str(&format!(
                            ", {unscorable} without NIXL bandwidth/handshake figures"
                        ));
                    }
                    if uncertain > 0 {
                        why.push_str(&format!(", {uncertain} near the break-even"));
                    }
                    misses.push(why);
                }
            }
            if w.spills > 0 && w.spill_pairs.is_empty() {
                misses.push("the collector reports no spill pairs (too old?)".into());
            }
            let budget = cfg.dispatch_budget(m.spill_lines);
            if m.dispatch_failures > budget {
                misses.push(format!(
                    "{} dispatch failures > budget {budget}",
                    m.dispatch_failures
                ));
            }
            misses
        };
        let misses = misses_at(1.0);
        let meets_hysteresis = misses_at(cfg.hysteresis).is_empty();
        WindowFigures {
            start_ns: w.start_ns,
            end_ns: w.end_ns,
            spills: w.spills,
            true_delta_tok_per_s: w.true_delta_tok_per_s,
            candidates,
            beneficial,
            uncertain,
            unscorable,
            beneficial_share: share,
            spill_lines: m.spill_lines,
            handshakes_obtained: m.handshakes_obtained,
            dispatch_failures: m.dispatch_failures,
            data_faults: w.data_faults,
            meets_entry: misses.is_empty(),
            meets_hysteresis,
            misses,
        }
    }
}

struct Assessed {
    input: InputHealth,
    safety: Vec<SafetyTrigger>,
    figures: Option<Figures>,
}

fn spread(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    })
}

/// A window belongs to a period when most of it lies after the period's start.
fn midpoint(start_ns: u64, end_ns: u64) -> u64 {
    start_ns + end_ns.saturating_sub(start_ns) / 2
}

fn secs_ns(s: f64) -> u64 {
    (s.max(0.0) * 1e9) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::WorkerKey;

    #[test]
    fn utc_formatting() {
        assert_eq!(fmt_utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            fmt_utc(1_700_000_000_123_000_000),
            "2023-11-14T22:13:20.123Z"
        );
        assert_eq!(fmt_utc(951_782_400 * NS), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn dispatch_budget_is_a_ratio_with_a_floor() {
        let c = PolicyConfig::default();
        assert_eq!(c.dispatch_budget(0), 2);
        assert_eq!(c.dispatch_budget(100), 5);
        assert_eq!(c.dispatch_budget(101), 6);
    }

    #[test]
    fn invalid_policies_are_refused() {
        let ok = PolicyConfig::default();
        ok.validate().unwrap();
        for bad in [
            PolicyConfig {
                max_flips_per_hour: 1,
                ..ok.clone()
            },
            PolicyConfig {
                min_windows: 0,
                ..ok.clone()
            },
            PolicyConfig {
                min_beneficial_share: 1.5,
                ..ok.clone()
            },
            PolicyConfig {
                prefill_tok_per_s: 0.0,
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_measured_prefill_rate_only_raises_the_configured_one() {
        let c = PolicyConfig::default();
        let t = WorkerKey {
            worker_id: 1,
            dp_rank: 0,
        };
        let mut w = WindowSummary {
            start_ns: 0,
            end_ns: 10 * NS,
            ..Default::default()
        };
        assert_eq!(c.prefill_rate(&w, &t), 10_000.0);
        w.workers.entry(t).or_default().uncached_prefill_tokens = 500_000;
        assert_eq!(c.prefill_rate(&w, &t), 50_000.0);
        w.workers.entry(t).or_default().uncached_prefill_tokens = 5_000;
        assert_eq!(c.prefill_rate(&w, &t), 10_000.0);
    }
}
