//! The running actuator: each tick reads the collector, evaluates the policy, applies the
//! mode through the backends, issues directives in LIVE, and audits what changed.

use crate::act::audit::{self, AuditEntry, AuditError, AuditEvent, AuditLog};
use crate::act::backend::{BackendError, ModeBackend};
use crate::act::directive::{
    self, DirectiveLedger, DirectiveOutcome, DirectiveTotals, TokenBucket,
};
use crate::act::mode::{Mode, OperatorHold, Override};
use crate::act::sink::{DirectiveSink, SinkError};
use crate::config::ActuatorConfig;
use crate::daemon::metrics::{ActuatorCounters, REASON_BACKEND_FAILED, REASON_OPERATOR};
use crate::decide::input::CollectorView;
use crate::decide::policy::{Evaluation, Observation, PolicyEngine};
use kvscope_wire::cost::NixlFigures;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch, Semaphore};
use tracing::{error, info, warn};

/// Audit entries read back at start, at most.
const RESTORE_BYTES: u64 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Audit(#[from] AuditError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("cannot build the collector client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("cannot listen on {addr} (in use? pick another with --listen): {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// The last mode pushed to the backends.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Applied {
    pub mode: Option<Mode>,
    /// Every backend took it.
    pub ok: bool,
    pub at_ns: u64,
    pub done: Vec<String>,
    pub errors: Vec<String>,
}

/// What `GET /api/status` shows.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub mode: Mode,
    pub hold: Option<OperatorHold>,
    pub applied: Applied,
    pub backends: Vec<String>,
    pub directives: Option<DirectiveTotals>,
    pub audit_log: String,
    pub last_evaluation: Option<Evaluation>,
}

struct Directives {
    sink: Arc<DirectiveSink>,
    bucket: TokenBucket,
    in_flight: Arc<Semaphore>,
    max_age_ns: u64,
}

pub struct Actuator {
    cfg: ActuatorConfig,
    engine: PolicyEngine,
    backends: Vec<ModeBackend>,
    audit: AuditLog,
    directives: Option<Directives>,
    ledger: DirectiveLedger,
    applied: Applied,
    last: Option<Evaluation>,
    live_tx: watch::Sender<bool>,
    outcomes_tx: mpsc::UnboundedSender<(String, DirectiveOutcome)>,
    outcomes_rx: mpsc::UnboundedReceiver<(String, DirectiveOutcome)>,
    restored_flips: usize,
    counters: ActuatorCounters,
}

impl Actuator {
    /// Build from a validated config; reads back the audit log's last hour.
    pub fn new(cfg: ActuatorConfig, now_ns: u64) -> Result<Self, RuntimeError> {
        let backends = cfg
            .mode_backends
            .iter()
            .cloned()
            .map(ModeBackend::new)
            .collect::<Result<Vec<_>, _>>()?;
        let directives = if cfg.directives.enabled {
            Some(Directives {
                sink: Arc::new(DirectiveSink::new(&cfg.directives)?),
                bucket: TokenBucket::new(cfg.directives.rate_per_s, cfg.directives.burst),
                in_flight: Arc::new(Semaphore::new(cfg.directives.max_in_flight)),
                max_age_ns: (cfg.directives.max_age_secs * 1e9) as u64,
            })
        } else {
            None
        };
        let previous = audit::tail(&cfg.audit_log, usize::MAX, RESTORE_BYTES)?;
        let restored = audit::restore(&previous, now_ns);
        let mut engine = PolicyEngine::new(cfg.policy.clone(), cfg.worker_agents.clone());
        engine.restore(&restored);
        let audit = AuditLog::open(&cfg.audit_log)?;
        let (live_tx, _) = watch::channel(false);
        let (outcomes_tx, outcomes_rx) = mpsc::unbounded_channel();
        Ok(Self {
            cfg,
            engine,
            backends,
            audit,
            directives,
            ledger: DirectiveLedger::new(100_000),
            applied: Applied::default(),
            last: None,
            live_tx,
            outcomes_tx,
            outcomes_rx,
            restored_flips: restored.flips_ns.len(),
            counters: ActuatorCounters::default(),
        })
    }

    pub fn engine(&self) -> &PolicyEngine {
        &self.engine
    }
    pub fn mode(&self) -> Mode {
        self.engine.mode()
    }
    pub fn last_evaluation(&self) -> Option<&Evaluation> {
        self.last.as_ref()
    }
    /// What `/metrics` counts.
    pub fn counters(&self) -> &ActuatorCounters {
        &self.counters
    }
    pub fn ledger(&self) -> &DirectiveLedger {
        &self.ledger
    }
    pub fn audit_path(&self) -> &std::path::Path {
        self.audit.path()
    }
    /// Whether directives may go out now: LIVE decided and applied.
    pub fn live(&self) -> bool {
        *self.live_tx.borrow()
    }

    pub fn status(&self) -> Status {
        Status {
            mode: self.engine.mode(),
            hold: self.engine.state().hold,
            applied: self.applied.clone(),
            backends: self.backends.iter().map(ModeBackend::describe).collect(),
            directives: self.directives.as_ref().map(|_| self.ledger.totals()),
            audit_log: self.audit.path().display().to_string(),
            last_evaluation: self.last.clone(),
        }
    }

    fn write(&mut self, at_ns: u64, event: AuditEvent) {
        let entry = AuditEntry::new(at_ns, self.engine.mode(), self.engine.state().hold, event);
        if let Err(e) = self.audit.append(&entry) {
            // The entry is lost from the log: counted, so an alert can say so.
            self.counters.audit_write_failures += 1;
            error!(error = %e, "Cannot write the audit log; this entry is lost (counted).");
        }
    }

    /// Assert the starting mode (DRY, or the operator's restored hold) on every backend.
    pub async fn start(&mut self, now_ns: u64) {
        let mode = self.engine.mode();
        self.write(
            now_ns,
            AuditEvent::Started {
                version: env!("CARGO_PKG_VERSION").to_string(),
                restored_flips: self.restored_flips,
                backends: self.backends.iter().map(ModeBackend::describe).collect(),
            },
        );
        let reason = match self.engine.state().hold {
            Some(h) => format!("actuator started: {} held by the operator", h.mode()),
            None => "actuator started: the mode starts at DRY".to_string(),
        };
        self.apply(mode, &reason, now_ns).await;
        self.set_live();
    }

    /// Push `mode` to every backend. Audits a failure (once per mode) and a recovery.
    async fn apply(&mut self, mode: Mode, reason: &str, now_ns: u64) -> bool {
        let mut done = Vec::new();
        let mut errors = Vec::new();
        for b in &self.backends {
            match b.apply(mode, reason, now_ns).await {
                Ok(d) => done.push(d),
                Err(e) => errors.push(e.to_string()),
            }
        }
        let ok = errors.is_empty();
        if !ok {
            self.counters.mode_apply_failures += 1;
        }
        let before = std::mem::take(&mut self.applied);
        if !ok && (before.ok || before.mode != Some(mode)) {
            // Logged and audited once per failing mode; retried quietly every evaluation.
            warn!(%mode, errors = ?errors, "Mode backend failed; retrying every evaluation.");
            self.write(
                now_ns,
                AuditEvent::BackendFailed {
                    attempted: mode,
                    errors: errors.clone(),
                },
            );
        } else if ok && !before.ok && before.mode.is_some() {
            self.write(
                now_ns,
                AuditEvent::BackendRecovered {
                    attempted: mode,
                    applied: done.clone(),
                },
            );
        }
        if ok && !self.backends.is_empty() && before.mode != Some(mode) {
            info!(%mode, "Mode applied.");
        }
        self.applied = Applied {
            mode: Some(mode),
            ok,
            at_ns: now_ns,
            done,
            errors,
        };
        ok
    }

    fn set_live(&mut self) {
        let live = self.engine.mode() == Mode::Live
            && self.applied.ok
            && self.applied.mode == Some(Mode::Live);
        self.live_tx.send_replace(live);
    }

    /// One evaluation on `view` (or the error that stood for it), as of `now_ns`.
    pub async fn tick(&mut self, view: Result<CollectorView, String>, now_ns: u64) -> &Evaluation {
        self.drain_outcomes(now_ns);
        let span_ns = view
            .as_ref()
            .ok()
            .and_then(|v| v.windows.first())
            .map_or((self.cfg.interval_secs * 1e9) as u64, |w| {
                w.end_ns.saturating_sub(w.start_ns)
            });
        let stats = self.ledger.stats(now_ns, span_ns);
        let eval = self.engine.evaluate(&Observation {
            now_ns,
            input: view.as_ref().map_err(String::as_str),
            directives: stats,
        });
        self.counters.evaluated(&eval, view.is_ok());
        if eval.changed() {
            info!(from = %eval.from, to = %eval.to, reasons = ?eval.reasons, "Mode changed.");
            if eval.to == Mode::Live {
                self.ledger.cursor_ns = self.ledger.cursor_ns.max(now_ns);
            }
        }
        // The mode changed, or the last push failed: push (again).
        let target = self.engine.mode();
        let need = self.applied.mode != Some(target) || !self.applied.ok;
        if eval.changed() {
            self.write(
                now_ns,
                AuditEvent::ModeChanged {
                    evaluation: Box::new(eval.clone()),
                },
            );
        } else if eval.input_changed {
            self.write(
                now_ns,
                AuditEvent::InputChanged {
                    evaluation: Box::new(eval.clone()),
                },
            );
        }
        if need {
            let reason = eval.reasons.join("; ");
            self.live_tx.send_replace(false);
            if !self.apply(target, &reason, now_ns).await && target == Mode::Live {
                // Never LIVE on some backends and not others: back to DRY everywhere.
                self.engine.apply_failed(Mode::Live, now_ns);
                self.counters
                    .flip(Mode::Live, self.engine.mode(), REASON_BACKEND_FAILED);
                self.apply(
                    Mode::Dry,
                    "rolling back: a backend could not apply LIVE",
                    now_ns,
                )
                .await;
            }
        }
        self.set_live();
        if self.live() {
            if let Ok(v) = &view {
                self.dispatch(v, now_ns);
            }
        }
        self.last = Some(eval);
        self.last.as_ref().expect("just set")
    }

    fn drain_outcomes(&mut self, now_ns: u64) {
        let mut outcomes = Vec::new();
        while let Ok((key, outcome)) = self.outcomes_rx.try_recv() {
            self.ledger.complete(&key, outcome.clone(), now_ns);
            outcomes.push((key, outcome));
        }
        if !outcomes.is_empty() {
            self.write(now_ns, AuditEvent::DirectiveOutcomes { outcomes });
        }
    }

    /// Wait until no directive is in flight (or `timeout` passes), then record outcomes.
    pub async fn settle(&mut self, timeout: Duration, now_ns: u64) {
        if let Some(d) = &self.directives {
            let n = self.cfg.directives.max_in_flight as u32;
            let _ = tokio::time::timeout(timeout, d.in_flight.acquire_many(n)).await;
        }
        self.drain_outcomes(now_ns);
    }

    fn dispatch(&mut self, view: &CollectorView, now_ns: u64) {
        let Some(d) = &mut self.directives else {
            return;
        };
        let policy = self.engine.config();
        let mapping = self.engine.mapping_for(view);
        let nixl = NixlFigures::new(&view.nixl, &mapping, policy.handshake_quantile);
        let (list, skipped) = directive::select(
            policy,
            &nixl,
            view.windows.first(),
            &view.verdicts,
            self.ledger.cursor_ns,
            now_ns,
            d.max_age_ns,
            &self.ledger,
        );
        let mut sent = Vec::new();
        let mut limited = Vec::new();
        for dir in list {
            if !self.ledger.issue(&dir.idempotency_key) {
                continue;
            }
            let permit = if d.bucket.try_take(now_ns as f64 / 1e9) {
                d.in_flight.clone().try_acquire_owned().ok()
            } else {
                None
            };
            let Some(permit) = permit else {
                limited.push(dir.idempotency_key.clone());
                continue;
            };
            let sink = d.sink.clone();
            let live = self.live_tx.subscribe();
            let tx = self.outcomes_tx.clone();
            let key = dir.idempotency_key.clone();
            let send = dir.clone();
            tokio::spawn(async move {
                let outcome = sink.send(&send, &live).await;
                let _ = tx.send((key, outcome));
                drop(permit);
            });
            sent.push(dir);
        }
        for key in &limited {
            self.ledger
                .complete(key, DirectiveOutcome::RateLimited, now_ns);
        }
        if !sent.is_empty() || !limited.is_empty() {
            info!(
                directives = sent.len(),
                rate_limited = limited.len(),
                "Migration directives issued."
            );
            self.write(
                now_ns,
                AuditEvent::DirectivesIssued {
                    directives: sent,
                    rate_limited: limited,
                    skipped,
                },
            );
        }
    }

    /// An operator's override: hold OFF, hold DRY, or back to the policy (from DRY).
    pub async fn operator(&mut self, ov: Override, note: &str, now_ns: u64) -> (Mode, Mode) {
        let (from, to) = self.engine.operator(ov);
        self.counters.flip(from, to, REASON_OPERATOR);
        self.live_tx.send_replace(false);
        self.write(
            now_ns,
            AuditEvent::Operator {
                ov,
                from,
                to,
                note: note.to_string(),
            },
        );
        if self.applied.mode != Some(to) || !self.applied.ok {
            self.apply(to, &format!("operator override {ov:?}: {note}"), now_ns)
                .await;
        }
        self.set_live();
        (from, to)
    }

    /// Stopping: DRY if configured (and the mode was LIVE), audited.
    pub async fn stop(&mut self, now_ns: u64) {
        self.live_tx.send_replace(false);
        let note = if self.cfg.dry_on_exit && self.engine.mode() == Mode::Live {
            self.engine.leave_live();
            let ok = self
                .apply(Mode::Dry, "actuator stopping (dry_on_exit)", now_ns)
                .await;
            format!("dry_on_exit: DRY applied: {ok}")
        } else {
            "mode left as it was".to_string()
        };
        self.write(now_ns, AuditEvent::Stopped { note });
    }
}
