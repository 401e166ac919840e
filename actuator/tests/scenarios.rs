//! Scenario tests of the policy engine, driven by generated collector windows: each
//! evaluation happens just after a window closes, as the running actuator would see it.

mod support;

use kvscope_actuator::act::mode::{Mode, OperatorHold, Override};
use kvscope_actuator::decide::policy::{
    DirectiveStats, Evaluation, InputHealth, Observation, PolicyConfig, PolicyEngine,
    SafetyTrigger, Transition,
};
use kvscope_wire::cost::WorkerAgent;
use kvscope_wire::nixl::{NixlAgentOwner, NixlAgentRow};
use support::*;

fn mapping() -> Vec<WorkerAgent> {
    vec!["1=nixl-1".parse().unwrap(), "2=nixl-2".parse().unwrap()]
}

fn engine(cfg: PolicyConfig) -> PolicyEngine {
    PolicyEngine::new(cfg, mapping())
}

fn eval(e: &mut PolicyEngine, f: &Fleet) -> Evaluation {
    eval_at(e, f, f.now())
}

fn eval_at(e: &mut PolicyEngine, f: &Fleet, now: u64) -> Evaluation {
    let v = f.view_at(now);
    e.evaluate(&Observation {
        now_ns: now,
        input: Ok(&v),
        directives: DirectiveStats::default(),
    })
}

/// Two warm-up windows, then `n` good ones, evaluating after each.
fn warm_fleet(e: &mut PolicyEngine, n: usize) -> (Fleet, Vec<Evaluation>) {
    let mut f = Fleet::new();
    f.push_n(2, Spec::warmup());
    let mut evals = vec![eval(e, &f)];
    for _ in 0..n {
        f.push(Spec::good());
        evals.push(eval(e, &f));
    }
    (f, evals)
}

fn live_fleet(cfg: PolicyConfig) -> (PolicyEngine, Fleet) {
    let mut e = engine(cfg);
    let (f, evals) = warm_fleet(&mut e, 6);
    assert_eq!(evals.last().unwrap().to, Mode::Live, "{:#?}", evals.last());
    (e, f)
}

#[test]
fn not_enough_windows_stays_dry() {
    let mut e = engine(PolicyConfig::default());
    let (_, evals) = warm_fleet(&mut e, 5);
    for ev in &evals {
        assert_eq!(ev.to, Mode::Dry, "{:#?}", ev.reasons);
        assert_eq!(ev.transition, Transition::Stay);
    }
    let last = evals.last().unwrap();
    assert!(
        last.reasons
            .iter()
            .any(|r| r
                .contains("only 5 complete post-warm-up windows (2 warm-up skipped); 6 needed")),
        "{:#?}",
        last.reasons
    );
    assert_eq!(last.figures.as_ref().unwrap().entry_streak, 5);
}

#[test]
fn thresholds_met_for_six_windows_with_healthy_handshakes_go_live() {
    let mut e = engine(PolicyConfig::default());
    let (_, evals) = warm_fleet(&mut e, 6);
    let live: Vec<_> = evals.iter().filter(|ev| ev.to == Mode::Live).collect();
    assert_eq!(live.len(), 1, "LIVE exactly at the sixth window");
    let ev = evals.last().unwrap();
    assert_eq!(
        (ev.from, ev.to, ev.transition),
        (Mode::Dry, Mode::Live, Transition::EnterLive)
    );
    let f = ev.figures.as_ref().unwrap();
    assert_eq!(f.entry_streak, 6);
    assert!(f.nixl.proven && f.nixl.mapped);
    assert!(
        f.nixl.fleet_wide_pairs.is_empty(),
        "the mapped pair's figures"
    );
    let w = &f.windows[0];
    assert_eq!((w.candidates, w.beneficial), (20, 20));
    assert!(
        ev.reasons[0].starts_with("6 consecutive windows qualify: true delta 43691–43691 tok/s"),
        "{:#?}",
        ev.reasons
    );
    assert!(
        ev.reasons[0].contains("NIXL handshakes 10 ok / 0 failed"),
        "{}",
        ev.reasons[0]
    );
}

#[test]
fn handshakes_not_observed_or_failing_keep_it_dry() {
    for (pairs, expect) in [
        (
            vec![],
            "0 handshakes observed between the mapped NIXL agents, 3 needed",
        ),
        (
            vec![nixl_pair("nixl-2", "nixl-1", 20e9, 5, 5)],
            "handshake success ratio 0.50 (5 ok / 5 failed between the mapped NIXL agents) < 0.95",
        ),
    ] {
        let mut e = engine(PolicyConfig::default());
        let mut f = Fleet::new();
        f.nixl = pairs;
        f.push_n(2, Spec::warmup()).push_n(8, Spec::good());
        let ev = eval(&mut e, &f);
        assert_eq!(ev.to, Mode::Dry);
        assert!(
            ev.reasons.iter().any(|r| r.contains(expect)),
            "{:#?}",
            ev.reasons
        );
    }
}

#[test]
fn spills_with_zero_handshakes_drop_to_dry_within_one_window() {
    let (mut e, mut f) = live_fleet(PolicyConfig::default());
    // The dry-run windows before LIVE had spill lines and no handshakes: not a failure.
    f.push(Spec::live_ok());
    let ev = eval(&mut e, &f);
    assert_eq!(
        (ev.to, ev.transition),
        (Mode::Live, Transition::Stay),
        "{:#?}",
        ev.reasons
    );
    // One window of spills with zero handshakes obtained.
    f.push(Spec::silent_failure());
    let ev = eval(&mut e, &f);
    assert_eq!((ev.from, ev.to), (Mode::Live, Mode::Dry));
    assert_eq!(ev.transition, Transition::SafetyDrop);
    assert!(
        matches!(
            ev.safety[..],
            [SafetyTrigger::SilentFailure {
                spill_lines: 50,
                ..
            }]
        ),
        "{:#?}",
        ev.safety
    );
    assert!(
        ev.reasons[0].starts_with("silent NIXL failure: 50 KVMIGRATE_SPILL lines"),
        "{}",
        ev.reasons[0]
    );
}

#[test]
fn the_first_window_after_going_live_is_checked_too() {
    let (mut e, mut f) = live_fleet(PolicyConfig::default());
    f.push(Spec::silent_failure());
    assert_eq!(eval(&mut e, &f).to, Mode::Dry);
    // With a grace for a rolling restart, the same window is not held against LIVE.
    let (mut e, mut f) = live_fleet(PolicyConfig {
        apply_grace_secs: 30.0,
        ..PolicyConfig::default()
    });
    f.push(Spec::silent_failure());
    assert_eq!(eval(&mut e, &f).to, Mode::Live);
    f.push(Spec::silent_failure()).push(Spec::silent_failure());
    assert_eq!(eval(&mut e, &f).to, Mode::Dry, "after the grace it is");
}

#[test]
fn stale_data_drops_to_dry_and_blocks_live() {
    let (mut e, f) = live_fleet(PolicyConfig::default());
    // No new record for two minutes.
    let later = f.now() + 120 * S;
    let ev = eval_at(&mut e, &f, later);
    assert_eq!(
        (ev.to, ev.transition, ev.input),
        (Mode::Dry, Transition::SafetyDrop, InputHealth::Stale)
    );
    assert!(ev.input_changed);
    assert!(
        ev.reasons[0]
            .starts_with("stale data: the collector's latest record is 120.5 s old (max 60 s)"),
        "{:#?}",
        ev.reasons
    );
    // Still stale a second later: DRY, and no new input change to audit.
    let ev = eval_at(&mut e, &f, later + S);
    assert_eq!(ev.to, Mode::Dry);
    assert!(!ev.input_changed);

    // In DRY, stale data blocks entry whatever the windows say.
    let mut e = engine(PolicyConfig {
        cooldown_secs: 0.0,
        ..PolicyConfig::default()
    });
    let mut f = Fleet::new();
    f.push_n(2, Spec::warmup()).push_n(8, Spec::good());
    let ev = eval_at(&mut e, &f, f.now() + 61 * S);
    assert_eq!(ev.to, Mode::Dry);
    assert!(matches!(ev.safety[0], SafetyTrigger::Stale { .. }));
}

#[test]
fn a_missing_collector_or_a_lost_agent_means_dry() {
    let (mut e, f) = live_fleet(PolicyConfig::default());
    let ev = e.evaluate(&Observation {
        now_ns: f.now(),
        input: Err("connection refused"),
        directives: DirectiveStats::default(),
    });
    assert_eq!((ev.to, ev.input), (Mode::Dry, InputHealth::Missing));
    assert_eq!(ev.reasons, ["input missing: connection refused"]);

    let (mut e, mut f) = live_fleet(PolicyConfig::default());
    f.silent_since = vec![("node-b".into(), f.now() - 45 * S)];
    let ev = eval(&mut e, &f);
    assert_eq!((ev.to, ev.input), (Mode::Dry, InputHealth::AgentLost));
    assert!(
        ev.reasons[0].starts_with("agent node-b lost: silent for 45.0 s"),
        "{:#?}",
        ev.reasons
    );

    // A collector that lost its windows (only warm-up ones): missing input.
    let (mut e, mut f) = live_fleet(PolicyConfig::default());
    f.windows.iter_mut().for_each(|w| w.warmup = true);
    let ev = eval(&mut e, &f);
    assert_eq!((ev.to, ev.input), (Mode::Dry, InputHealth::Missing));
    assert_eq!(
        ev.reasons[0],
        "input missing: the collector has no complete post-warm-up window"
    );

    // An expected agent the collector never heard from: never LIVE.
    let mut e = engine(PolicyConfig {
        expected_agents: vec!["node-a".into(), "node-c".into()],
        ..PolicyConfig::default()
    });
    let (_, evals) = warm_fleet(&mut e, 10);
    assert!(evals.iter().all(|ev| ev.to == Mode::Dry));
    let last = evals.last().unwrap();
    assert_eq!(last.reasons[0], "agent node-c lost: never heard from");
}

#[test]
fn dispatch_failures_over_budget_drop_to_dry() {
    let (mut e, mut f) = live_fleet(PolicyConfig::default());
    f.push(Spec {
        dispatch_failures: 2,
        ..Spec::live_ok()
    });
    assert_eq!(eval(&mut e, &f).to, Mode::Live, "within the allowance of 2");
    f.push(Spec {
        dispatch_failures: 3,
        ..Spec::live_ok()
    });
    let ev = eval(&mut e, &f);
    assert_eq!(ev.to, Mode::Dry);
    assert!(
        matches!(
            ev.safety[..],
            [SafetyTrigger::DispatchFailures {
                failures: 3,
                attempts: 20,
                budget: 2,
                ..
            }]
        ),
        "{:#?}",
        ev.safety
    );

    // The actuator's own directives count too.
    let (mut e, mut f) = live_fleet(PolicyConfig::default());
    f.push(Spec::live_ok());
    let v = f.view();
    let ev = e.evaluate(&Observation {
        now_ns: f.now(),
        input: Ok(&v),
        directives: DirectiveStats {
            sent: 40,
            accepted: 36,
            rejected: 1,
            failed: 3,
        },
    });
    assert_eq!(ev.to, Mode::Dry);
    assert!(
        ev.reasons[0].contains("4 of 40 migration directives failed or were rejected"),
        "{:#?}",
        ev.reasons
    );
}

#[test]
fn accepted_directives_without_any_handshake_drop_to_dry_without_fork_lines() {
    // A router without the fork's KVMIGRATE lines (Dynamo 1.6.1): the actuator's own
    // accepted directives stand in for the spill lines.
    let no_lines = Spec {
        spill_lines: 0,
        ..Spec::good()
    };
    let eval_with = |e: &mut PolicyEngine, f: &Fleet, accepted: u64| {
        let v = f.view();
        e.evaluate(&Observation {
            now_ns: f.now(),
            input: Ok(&v),
            directives: DirectiveStats {
                sent: accepted,
                accepted,
                ..DirectiveStats::default()
            },
        })
    };
    // Healthy: every window brings new handshakes between the mapped agents.
    let (mut e, mut f) = live_fleet(PolicyConfig::default());
    for ok in [14, 18] {
        f.push(no_lines.clone());
        f.nixl = vec![nixl_pair("nixl-2", "nixl-1", 20e9, ok, 0)];
        let ev = eval_with(&mut e, &f, 5);
        assert_eq!(ev.to, Mode::Live, "{:#?}", ev.reasons);
    }
    // Silent: directives accepted, the probes see no handshake since LIVE began.
    let (mut e, mut f) = live_fleet(PolicyConfig::default());
    f.push(no_lines.clone());
    let ev = eval_with(&mut e, &f, 5);
    assert_eq!(
        (ev.from, ev.to),
        (Mode::Live, Mode::Dry),
        "{:#?}",
        ev.reasons
    );
    assert_eq!(ev.transition, Transition::SafetyDrop);
    assert!(
        matches!(
            ev.safety[..],
            [SafetyTrigger::DirectivesWithoutHandshakes { accepted: 5, .. }]
        ),
        "{:#?}",
        ev.safety
    );
    assert!(
        ev.reasons[0].starts_with("silent NIXL failure: 5 migration directives accepted"),
        "{}",
        ev.reasons[0]
    );
    // Too few directives to judge: stays LIVE.
    let (mut e, mut f) = live_fleet(PolicyConfig::default());
    f.push(no_lines);
    assert_eq!(eval_with(&mut e, &f, 2).to, Mode::Live);
}

#[test]
fn recent_nixl_handshake_failures_drop_to_dry() {
    let (mut e, mut f) = live_fleet(PolicyConfig::default());
    f.push(Spec::live_ok());
    f.nixl = vec![nixl_pair("nixl-2", "nixl-1", 20e9, 12, 0)];
    assert_eq!(eval(&mut e, &f).to, Mode::Live);
    // Injected failures: 1 more ok, 9 failed since the last evaluation.
    f.push(Spec::live_ok());
    f.nixl = vec![nixl_pair("nixl-2", "nixl-1", 20e9, 13, 9)];
    let ev = eval(&mut e, &f);
    assert_eq!(ev.to, Mode::Dry);
    assert!(
        matches!(
            ev.safety[..],
            [SafetyTrigger::HandshakeFailures {
                ok: 1,
                failed: 9,
                ..
            }]
        ),
        "{:#?}",
        ev.safety
    );
    assert_eq!(ev.figures.unwrap().nixl.recent_span_s, Some(15.0));
}

#[test]
fn hysteresis_and_cooldown_govern_the_economic_exit() {
    let (mut e2, mut f2) = live_fleet(PolicyConfig {
        min_true_delta_tok_per_s: 40_000.0,
        ..PolicyConfig::default()
    });
    // 85 % of the threshold: within the 0.8 hysteresis, LIVE holds.
    for _ in 0..3 {
        f2.push(Spec::live_ok().with_volume_fraction(0.8));
        let ev = eval(&mut e2, &f2);
        assert_eq!(ev.to, Mode::Live);
        let fig = ev.figures.unwrap();
        assert!(!fig.windows[0].meets_entry && fig.windows[0].meets_hysteresis);
        assert_eq!(fig.exit_streak, 0);
    }
    // Below 80 %: two windows end LIVE — but not within the cooldown of entering.
    f2.push(Spec::live_ok().with_volume_fraction(0.5));
    assert_eq!(eval(&mut e2, &f2).to, Mode::Live);
    f2.push(Spec::live_ok().with_volume_fraction(0.5));
    let ev = eval(&mut e2, &f2);
    assert_eq!(ev.to, Mode::Live);
    assert!(
        ev.reasons[0].starts_with("stays LIVE within its cooldown"),
        "{:#?}",
        ev.reasons
    );
    // 300 s after entering, the exit goes through.
    while f2.now() < f2.windows[7].end_ns + 300 * S {
        f2.push(Spec::live_ok().with_volume_fraction(0.5));
    }
    let ev = eval(&mut e2, &f2);
    assert_eq!(
        (ev.to, ev.transition),
        (Mode::Dry, Transition::EconomicExit),
        "{:#?}",
        ev.reasons
    );
    assert!(ev.reasons[0].contains("consecutive windows below 80% of the entry thresholds"));

    // One quiet window while LIVE is no reason to leave.
    let (mut e, mut f) = live_fleet(PolicyConfig::default());
    f.push(Spec::quiet());
    assert_eq!(eval(&mut e, &f).to, Mode::Live);
}

#[test]
fn after_a_drop_live_needs_the_cooldown_and_fresh_windows() {
    let (mut e, mut f) = live_fleet(PolicyConfig::default());
    f.push(Spec::silent_failure());
    let drop = eval(&mut e, &f);
    assert_eq!(drop.to, Mode::Dry);
    // Six good windows (90 s) later: the windows qualify, the cooldown (300 s) does not.
    f.push_n(6, Spec::good());
    let ev = eval(&mut e, &f);
    assert_eq!(ev.to, Mode::Dry);
    assert!(
        ev.reasons
            .iter()
            .any(|r| r.starts_with("cooldown: 210 s left")),
        "{:#?}",
        ev.reasons
    );
    assert!(!ev.reasons.iter().any(|r| r.contains("windows qualify")));
    f.push_n(14, Spec::good());
    assert_eq!(eval(&mut e, &f).to, Mode::Live);

    // Without a cooldown, the windows measured before the drop still do not count.
    let (mut e, mut f) = live_fleet(PolicyConfig {
        cooldown_secs: 0.0,
        ..PolicyConfig::default()
    });
    f.push(Spec::silent_failure());
    assert_eq!(eval(&mut e, &f).to, Mode::Dry);
    f.push(Spec::good());
    let ev = eval(&mut e, &f);
    assert_eq!(ev.to, Mode::Dry);
    assert!(
        ev.reasons
            .iter()
            .any(|r| r.contains("1 of 6 windows qualify")
                && r.contains("measured before LIVE last ended")),
        "{:#?}",
        ev.reasons
    );
    f.push_n(4, Spec::good());
    assert_eq!(eval(&mut e, &f).to, Mode::Dry);
    f.push(Spec::good());
    assert_eq!(eval(&mut e, &f).to, Mode::Live);
}

#[test]
fn flapping_inputs_flip_no_more_than_the_cap() {
    // Odd, so that an entry without room for its exit would show.
    let cap = 5;
    let mut e = engine(PolicyConfig {
        cooldown_secs: 0.0,
        max_flips_per_hour: cap,
        ..PolicyConfig::default()
    });
    let mut f = Fleet::new();
    f.push_n(2, Spec::warmup());
    let mut flips = Vec::new();
    // Three hours of windows: the path fails every time it goes LIVE, and now and then
    // an agent goes quiet for a window.
    for i in 0..720 {
        let live = e.mode() == Mode::Live;
        f.push(if live {
            Spec::silent_failure()
        } else {
            Spec::good()
        });
        f.silent_since = if i % 11 == 5 {
            vec![("node-a".into(), f.now() - 40 * S)]
        } else {
            vec![]
        };
        let ev = eval(&mut e, &f);
        if ev.changed() {
            flips.push(ev.at_ns);
        }
        assert!(ev.flips_last_hour <= cap, "{ev:#?}");
    }
    for (i, t) in flips.iter().enumerate() {
        let in_hour = flips[i..].iter().take_while(|u| **u < t + 3600 * S).count();
        assert!(
            in_hour <= cap,
            "{in_hour} flips in the hour from flip {i}: {flips:?}"
        );
    }
    // The inputs did flap: the cap, not the inputs, bounded the flips (two LIVE
    // periods; a third entry would leave no room for its exit).
    let first_hour = flips.iter().filter(|t| **t < flips[0] + 3600 * S).count();
    assert_eq!(first_hour, cap - 1, "{flips:?}");
    assert!(flips.len() >= 2 * cap, "flips resume each hour: {flips:?}");
}

#[test]
fn the_cap_never_blocks_a_drop() {
    let (mut e, mut f) = live_fleet(PolicyConfig {
        max_flips_per_hour: 2,
        ..PolicyConfig::default()
    });
    assert_eq!(e.state().flips_ns.len(), 1);
    f.push(Spec::silent_failure());
    let ev = eval(&mut e, &f);
    assert_eq!(ev.to, Mode::Dry);
    assert_eq!(ev.flips_last_hour, 2);
    f.push_n(30, Spec::good());
    let ev = eval(&mut e, &f);
    assert_eq!(ev.to, Mode::Dry);
    assert!(
        ev.reasons
            .iter()
            .any(|r| r.starts_with("flip cap: 2 automatic flips in the last hour")),
        "{:#?}",
        ev.reasons
    );
}

#[test]
fn an_operator_hold_beats_the_policy_and_off_is_only_set_by_an_operator() {
    let (mut e, mut f) = live_fleet(PolicyConfig {
        cooldown_secs: 0.0,
        ..PolicyConfig::default()
    });
    assert_eq!(e.operator(Override::Off), (Mode::Live, Mode::Off));
    f.push_n(3, Spec::live_ok());
    let ev = eval(&mut e, &f);
    assert_eq!((ev.to, ev.hold), (Mode::Off, Some(OperatorHold::Off)));
    assert_eq!(ev.reasons[0], "OFF held by the operator");
    // Safety figures are still reported while held.
    f.push(Spec::silent_failure());
    assert_eq!(eval_at(&mut e, &f, f.now() + 100 * S).to, Mode::Off);
    // Released: the policy starts from DRY and goes LIVE on its own windows.
    assert_eq!(e.operator(Override::Auto), (Mode::Off, Mode::Dry));
    f.push_n(8, Spec::good());
    let ev = eval(&mut e, &f);
    assert_eq!(ev.to, Mode::Live, "{:#?}", ev.reasons);
    // Holding DRY.
    e.operator(Override::Dry);
    f.push_n(6, Spec::live_ok());
    assert_eq!(eval(&mut e, &f).to, Mode::Dry);
    // A router found OFF (plan --current off) stays OFF: leaving it is the operator's.
    let mut e = engine(PolicyConfig::default());
    e.assume_mode(Mode::Off, None);
    let (_, evals) = warm_fleet(&mut e, 8);
    assert!(evals.iter().all(|ev| ev.to == Mode::Off));
}

#[test]
fn the_pair_figures_decide_the_benefit_and_fleet_wide_use_is_said() {
    // The mapped pair is slow (50 MB/s): 32k tokens × 128 KiB take 86 s to move but
    // 3.3 s to recompute. Fleet-wide figures (a fast unrelated pair) would say LIVE.
    let mut f = Fleet::new();
    f.nixl = vec![
        nixl_pair("nixl-2", "nixl-1", 50e6, 10, 0),
        nixl_pair("other-a", "other-b", 400e9, 10, 0),
    ];
    f.push_n(2, Spec::warmup()).push_n(6, Spec::good());
    let mut mapped = engine(PolicyConfig::default());
    let ev = eval(&mut mapped, &f);
    assert_eq!(ev.to, Mode::Dry);
    let w = &ev.figures.as_ref().unwrap().windows[0];
    assert_eq!((w.candidates, w.beneficial), (20, 0));
    assert!(
        w.misses
            .iter()
            .any(|m| m.starts_with("beneficial share 0% (0 of 20) < 50%")),
        "{:?}",
        w.misses
    );

    let mut unmapped = PolicyEngine::new(PolicyConfig::default(), vec![]);
    let ev = eval(&mut unmapped, &f);
    assert_eq!(ev.to, Mode::Live, "{:#?}", ev.reasons);
    assert!(
        ev.reasons.iter().any(|r| r
            == "no worker→NIXL agent mapping (none in [[worker_agents]], none told by the node agents): fleet-wide NIXL figures used"),
        "{:#?}",
        ev.reasons
    );

    // The same mapping told by the node agents instead of configured: the same answer
    // as configured. A name two nodes tell for different workers is not used.
    let told = |agent: &str, worker_id: u64, node: &str| NixlAgentRow {
        node: node.into(),
        owner: NixlAgentOwner {
            agent: agent.into(),
            pid: 42,
            worker_id: Some(worker_id),
            dp_rank: None,
            how: "parent process 41".into(),
        },
    };
    let mut told_engine = PolicyEngine::new(PolicyConfig::default(), vec![]);
    let mut v = f.view_at(f.now());
    v.nixl_agents = vec![told("nixl-1", 1, "a"), told("nixl-2", 2, "b")];
    assert_eq!(told_engine.mapping_for(&v), mapping());
    let ev = told_engine.evaluate(&Observation {
        now_ns: f.now(),
        input: Ok(&v),
        directives: DirectiveStats::default(),
    });
    assert_eq!(ev.to, Mode::Dry, "{:#?}", ev.reasons);
    v.nixl_agents.push(told("nixl-2", 3, "c"));
    assert_eq!(told_engine.mapping_for(&v), mapping()[..1].to_vec());
    // The configured table wins for the workers it names.
    let configured = PolicyEngine::new(PolicyConfig::default(), vec!["2=nixl-9".parse().unwrap()]);
    v.nixl_agents = vec![told("nixl-1", 1, "a"), told("nixl-2", 2, "b")];
    let m = configured.mapping_for(&v);
    assert_eq!(
        m,
        vec!["2=nixl-9".parse().unwrap(), "1=nixl-1".parse().unwrap()]
    );

    // Spills below the token gate are not candidates at all.
    let mut f = Fleet::new();
    f.push_n(2, Spec::warmup()).push_n(
        6,
        Spec {
            delta_tokens: 8192,
            spills: 200,
            ..Spec::good()
        },
    );
    let ev = eval(&mut engine(PolicyConfig::default()), &f);
    assert_eq!(ev.to, Mode::Dry);
    assert!(ev.figures.unwrap().windows[0].misses[0].starts_with("0 spills with ≥ 16384 tokens"));
}

#[test]
fn windows_with_data_faults_or_gaps_break_the_streak() {
    let mut e = engine(PolicyConfig::default());
    let mut f = Fleet::new();
    f.push_n(2, Spec::warmup()).push_n(5, Spec::good());
    f.push(Spec {
        data_faults: 1,
        ..Spec::good()
    });
    f.push_n(5, Spec::good());
    let ev = eval(&mut e, &f);
    assert_eq!(ev.to, Mode::Dry);
    assert!(
        ev.reasons
            .iter()
            .any(|r| r.contains("5 of 6 windows qualify") && r.contains("1 data faults")),
        "{:#?}",
        ev.reasons
    );
    f.push(Spec::good());
    assert_eq!(eval(&mut e, &f).to, Mode::Live);

    // A hole in the windows (the collector restarted) breaks it too.
    let mut e = engine(PolicyConfig::default());
    let mut f = Fleet::new();
    f.push_n(2, Spec::warmup()).push_n(3, Spec::good());
    let mut later = f.clone();
    later.windows.clear();
    let gap_start = f.next_start() + 10 * WINDOW;
    later.push(Spec::good());
    let shift = gap_start - later.windows[0].start_ns;
    later.windows[0].start_ns += shift;
    later.windows[0].end_ns += shift;
    later.push_n(2, Spec::good());
    f.windows.extend(later.windows);
    let ev = eval(&mut e, &f);
    assert_eq!(ev.figures.as_ref().unwrap().entry_streak, 3);
    assert_eq!(ev.to, Mode::Dry);
}
