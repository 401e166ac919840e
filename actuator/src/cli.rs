//! The actuator's command line, shared by `kvscope-actuator` and `kvscope actuator` (the
//! binary edge: errors become `anyhow` here).

use crate::act::audit;
use crate::act::mode::Mode;
use crate::config::ActuatorConfig;
use crate::daemon::serve;
use crate::decide::input::{CollectorClient, CollectorSnapshot};
use crate::decide::plan;
use crate::decide::policy::{Observation, PolicyEngine};
use anyhow::Context as _;
use clap::{Parser, Subcommand};
use kvscope_kit::clock::now_ns;
use std::path::PathBuf;
use std::time::Duration;

pub const LONG_ABOUT: &str = "\
Flips the router's KV migration between OFF, DRY and LIVE (the fork's DYN_KV_MIGRATION \
= 0 / dry / 1) from the kvscope collector's measured windows, and in LIVE issues \
migration directives.

POLICY. The actuator starts in DRY and goes LIVE only when all of these hold:
  * the newest min_windows (6) complete post-warm-up windows, contiguous, each qualify:
    no data faults; true-delta migratable volume >= min_true_delta_tok_per_s; at least
    min_candidate_spills spills with a true delta >= min_tokens (like
    DYN_KV_MIGRATION_MIN_TOKENS); and a share >= min_beneficial_share of those with a
    positive predicted net benefit. The cost model per spill: handshake latency (p90) +
    tokens x kv_bytes_per_token / the NIXL bandwidth measured between the two workers'
    NIXL agents + dispatch overhead, against recomputing the delta at prefill_tok_per_s
    (raised to the target's measured rate when higher). Without a worker->NIXL agent
    mapping ([[worker_agents]]) fleet-wide NIXL figures are used, and every evaluation
    says so;
  * the NIXL path is proven: >= min_handshakes handshakes observed by the agents' eBPF
    probes, with a success ratio >= min_handshake_success_ratio;
  * no safety trigger (below), cooldown_secs since the last flip, room for two more
    flips under max_flips_per_hour, and no operator hold.
LIVE drops to DRY at once (cooldown and cap never block it) when: the collector is
unreachable or has no data; its data is stale (latest record older than
max_data_age_secs); an agent is lost (silent max_agent_silence_secs); spills fire while
'producer handshake obtained' stays at zero over a window since LIVE (the fork's silent
failure); migration dispatch failures (the fork's, or the actuator's own directives)
exceed max(dispatch_failure_allowance, dispatch_failure_ratio x attempts) in a window;
or recent NIXL handshakes fail beyond the ratio. It leaves LIVE for economic reasons
only after exit_windows windows below hysteresis x the entry thresholds, and not within
cooldown_secs of entering. Missing or stale input always means DRY, never LIVE. OFF is
only ever set by an operator.

PLAN. `plan` evaluates once against the live collector (or a saved read: --input) and
prints what it would do and why, with the figures. It acts on nothing.

AUDIT. Every evaluation that changes something (mode, directives issued or completed,
input health, a backend failing or recovering, an operator override, start, stop) is
appended as one JSON line to audit_log, with the figures behind it.

BACKENDS. [[mode_backends]]: kind = \"http\" (PUT the mode as JSON), \"command\" (an argv
template run without a shell, e.g. [\"kubectl\", \"set\", \"env\", \"deploy/frontend\",
\"DYN_KV_MIGRATION={mode}\"]) or \"file\" (written atomically). {mode} becomes 0/dry/1,
{state} off/dry/live. A LIVE that some backend cannot apply is rolled back to DRY.
[directives]: in LIVE only, one idempotent directive (source, target, blocks, request
id, Idempotency-Key) per spill that passes the gate, POSTed, rate-limited, retries
bounded, outcomes tracked and audited.

SAFETY. The API (127.0.0.1:9466 by default) needs a bearer token for every write and
for reading the audit; `run` refuses to start without one when the API, a mode backend
or directives are enabled. Configuration: a TOML file (--config), KVSCOPE_ACTUATOR_*
variables, then flags; see `print-config` and actuator/README.md.";

/// Flips KV migration OFF / DRY / LIVE from the collector's measurements, with an audit
/// trail; issues migration directives in LIVE.
#[derive(Parser, Debug)]
#[command(name = "kvscope-actuator", version, long_about = LONG_ABOUT)]
pub struct Cli {
    /// TOML config file (every field optional). KVSCOPE_ACTUATOR_* variables and flags
    /// override it.
    #[arg(long, global = true, env = "KVSCOPE_ACTUATOR_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub log: kvscope_kit::LogArgs,
    /// The collector's base URL, or a scope's collectors' separated by commas (the ready
    /// one is read) [default: http://127.0.0.1:9465].
    #[arg(long, global = true)]
    pub collector_url: Option<String>,
    /// The append-only audit log [default: kvscope-actuator-audit.jsonl].
    #[arg(long, global = true, value_name = "FILE")]
    pub audit_log: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Evaluate every interval, switch the mode through the backends, issue directives
    /// in LIVE, serve the API, until SIGINT/SIGTERM.
    Run {
        /// API listen address [default: 127.0.0.1:9466].
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// File holding the API bearer token.
        #[arg(long, value_name = "FILE")]
        token_file: Option<PathBuf>,
        /// Do not serve the API.
        #[arg(long)]
        no_api: bool,
        /// Seconds between evaluations [default: 5].
        #[arg(long)]
        interval_secs: Option<f64>,
    },
    /// One evaluation: print what the actuator would do and why, with the figures.
    /// Acts on nothing.
    Plan {
        /// Evaluate a saved read (from `plan --save`) instead of the live collector, as
        /// of the time it was taken.
        #[arg(long, value_name = "FILE")]
        input: Option<PathBuf>,
        /// Also save the collector's responses to this file (an error when the collector
        /// cannot be read; without --save an unreadable collector is planned as missing
        /// input).
        #[arg(long, value_name = "FILE")]
        save: Option<PathBuf>,
        /// The mode the router is in now [default: the audit log's last, else dry].
        /// With live, every window shown is checked for the silent failure.
        #[arg(long, value_name = "off|dry|live")]
        current: Option<Mode>,
        /// Print the evaluation as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the audit log's last entries (JSON lines).
    Audit {
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// Print the effective configuration as TOML (defaults, file, environment, flags),
    /// secrets (OTLP headers, tokens) shown as <redacted>.
    PrintConfig,
}

impl Cli {
    /// Defaults < file < environment < flags.
    pub fn config(&self) -> anyhow::Result<ActuatorConfig> {
        let mut cfg = ActuatorConfig::load(self.config.as_deref())?;
        if let Some(v) = &self.collector_url {
            cfg.collector_url = v.clone();
        }
        if let Some(v) = &self.audit_log {
            cfg.audit_log = v.clone();
        }
        if let Command::Run {
            listen,
            token_file,
            no_api,
            interval_secs,
        } = &self.command
        {
            if let Some(v) = listen {
                cfg.api.listen = *v;
            }
            if let Some(v) = token_file {
                cfg.api.token_file = Some(v.clone());
            }
            if *no_api {
                cfg.api.enabled = false;
            }
            if let Some(v) = interval_secs {
                cfg.interval_secs = *v;
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let cfg = cli.config()?;
    match cli.command {
        Command::Run { .. } => {
            let token = cfg.required_api_token()?;
            serve::serve(cfg, token).await?;
            Ok(())
        }
        Command::Plan {
            input,
            save,
            current,
            json,
        } => {
            let (snapshot, source) = match &input {
                Some(path) => (
                    Ok(CollectorSnapshot::read(path)?),
                    format!("saved read {}", path.display()),
                ),
                None => {
                    let client = CollectorClient::new(
                        &cfg.collector_url,
                        Duration::from_secs_f64(cfg.collector_timeout_secs),
                        cfg.window_limit,
                        cfg.verdict_limit,
                    )?;
                    let captured_ns = now_ns();
                    let read = client
                        .fetch()
                        .await
                        .map(|view| CollectorSnapshot { captured_ns, view })
                        .map_err(|e| (captured_ns, e.to_string()));
                    (read, format!("collector {}", cfg.collector_url))
                }
            };
            if let Some(path) = &save {
                let snapshot = snapshot
                    .as_ref()
                    .map_err(|(_, e)| anyhow::anyhow!("nothing to save: {e}"))?;
                std::fs::write(path, serde_json::to_vec_pretty(snapshot)?)
                    .with_context(|| format!("cannot write {}", path.display()))?;
            }
            let at_ns = match &snapshot {
                Ok(s) => s.captured_ns,
                Err((t, _)) => *t,
            };
            let previous = audit::tail(&cfg.audit_log, usize::MAX, 16 << 20)?;
            let mut engine = PolicyEngine::new(cfg.policy.clone(), cfg.worker_agents.clone());
            engine.restore(&audit::restore(&previous, at_ns));
            let current = current
                .or_else(|| audit::last_mode(&previous))
                .unwrap_or(Mode::Dry);
            if engine.state().hold.is_none() {
                engine.assume_mode(current, None);
            }
            let eval = engine.evaluate(&Observation {
                now_ns: at_ns,
                input: snapshot
                    .as_ref()
                    .map(|s| &s.view)
                    .map_err(|(_, e)| e.as_str()),
                directives: Default::default(),
            });
            if json {
                println!("{}", serde_json::to_string_pretty(&eval)?);
            } else {
                print!("{}", plan::render(&eval, &cfg.policy, &source));
            }
            Ok(())
        }
        Command::Audit { limit } => {
            for e in audit::tail(&cfg.audit_log, limit, 64 << 20)? {
                println!("{}", serde_json::to_string(&e)?);
            }
            Ok(())
        }
        Command::PrintConfig => {
            print!("{}", kvscope_kit::config::to_redacted_toml(&cfg)?);
            Ok(())
        }
    }
}
