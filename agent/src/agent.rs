//! The running agent: its taps, the heartbeat, the publisher and `/metrics`, wired
//! around one [`RecordSink`].

use crate::config::AgentConfig;
use crate::counters::AgentStats;
use crate::nixl::NixlTracer;
use crate::sink::publisher::{self, PublisherConfig};
use crate::sink::RecordSink;
use crate::taps::engine::tap;
use crate::taps::plane::tap::{PlaneContext, PlaneTaps};
use crate::taps::router::follower::LogSource;
use anyhow::Context as _;
use kvscope_kit::clock::now_ns;
use kvscope_wire::{AgentHeartbeat, Record, Subjects};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::info;

/// A started agent. Dropping it without [`RunningAgent::shutdown`] aborts its tasks.
pub struct RunningAgent {
    stats: Arc<AgentStats>,
    sink: Arc<RecordSink>,
    stop: watch::Sender<bool>,
    give_up: watch::Sender<bool>,
    log_stop: Arc<AtomicBool>,
    inputs: Vec<JoinHandle<()>>,
    publisher: JoinHandle<()>,
    heartbeat: JoinHandle<()>,
    metrics_addr: Option<std::net::SocketAddr>,
    metrics: Option<JoinHandle<()>>,
    nixl: Option<Arc<NixlTracer>>,
    nixl_reporter: Option<JoinHandle<()>>,
    otlp: Option<kvscope_otlp::OtlpExport>,
    agent_id: String,
    grace: Duration,
}

impl RunningAgent {
    pub fn stats(&self) -> &Arc<AgentStats> {
        &self.stats
    }

    /// Records waiting for NATS.
    pub fn buffered(&self) -> usize {
        self.sink.buffered()
    }

    /// The NIXL tracer, when enabled.
    pub fn nixl(&self) -> Option<&Arc<NixlTracer>> {
        self.nixl.as_ref()
    }

    /// Where `/metrics` is served, when configured.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics_addr
    }

    /// Stop the taps, send a last heartbeat, give the publisher the grace period to
    /// empty the buffer, flush the recording.
    pub async fn shutdown(mut self) {
        self.log_stop.store(true, Ordering::Relaxed);
        for h in self.inputs.drain(..) {
            h.abort();
            let _ = h.await;
        }
        self.heartbeat.abort();
        if let Some(r) = self.nixl_reporter.take() {
            r.abort();
        }
        // The last reports go in before the publisher is told to stop, so they are
        // among the records it drains; nothing stays held in the reorder window.
        if let Some(t) = &self.nixl {
            self.sink.submit(Record::Nixl(t.report()));
        }
        heartbeat(&self.sink, &self.stats);
        self.sink.release_all();
        let _ = self.stop.send(true);
        let publisher = &mut self.publisher;
        if tokio::time::timeout(self.grace, &mut *publisher)
            .await
            .is_err()
        {
            let _ = self.give_up.send(true);
            let _ = tokio::time::timeout(Duration::from_secs(1), &mut *publisher).await;
            publisher.abort();
        }
        self.sink.flush_recording();
        if let Some(o) = self.otlp.take() {
            o.shutdown(self.grace).await;
        }
        if let Some(m) = self.metrics.take() {
            m.abort();
        }
        info!(agent = %self.agent_id, buffered = self.sink.buffered(), "Agent stopped.");
    }

    /// Run until `signal` completes, then shut down.
    pub async fn run_until(self, signal: impl std::future::Future<Output = ()>) {
        signal.await;
        self.shutdown().await;
    }
}

impl Drop for RunningAgent {
    fn drop(&mut self) {
        self.log_stop.store(true, Ordering::Relaxed);
        for h in &self.inputs {
            h.abort();
        }
        self.publisher.abort();
        self.heartbeat.abort();
        if let Some(m) = &self.metrics {
            m.abort();
        }
        if let Some(r) = &self.nixl_reporter {
            r.abort();
        }
    }
}

fn heartbeat(sink: &RecordSink, stats: &AgentStats) {
    sink.submit(Record::Heartbeat(AgentHeartbeat {
        counters: stats.snapshot(),
        buffered: sink.buffered() as u64,
    }));
    sink.flush_recording();
}

/// Start every part of the agent described by `cfg`.
pub async fn start(cfg: AgentConfig) -> anyhow::Result<RunningAgent> {
    cfg.validate()?;
    let stats = Arc::new(AgentStats::default());
    let subjects = Subjects::new(&cfg.cluster);
    let sink = Arc::new(
        RecordSink::new(
            &cfg.agent_id,
            subjects.clone(),
            cfg.buffer_capacity,
            cfg.buffer_max_bytes,
            cfg.record.as_deref(),
            stats.clone(),
        )
        .context("cannot open the recording")?,
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    let (give_up_tx, give_up_rx) = watch::channel(false);
    let log_stop = Arc::new(AtomicBool::new(false));
    let mut inputs = Vec::new();

    // Dynamo's discovery store, when configured: the fleet's workers, and the event
    // plane's channels.
    let discovery = cfg
        .discovery
        .backend()
        .map_err(|e| anyhow::anyhow!("discovery: {e}"))?;
    // Readiness (`/readyz` beside `/metrics`): the bus, the discovery store if any, and
    // the watchdog's checks (sources readable, records leaving, discovery fresh).
    let health = Arc::new(kvscope_kit::Health::new());
    let sources = crate::watchdog::SourceStates::new();
    let (view_tx, view) = watch::channel(Arc::new(kvscope_discovery::Fleet::default()));
    let fleet_view = discovery.is_some().then(|| view.clone());
    let discovery_freshness = discovery
        .is_some()
        .then(|| crate::watchdog::DiscoveryFreshness::new(cfg.discovery.poll_interval()));
    if let (Some(backend), Some(freshness)) = (discovery, &discovery_freshness) {
        let planes = cfg.taps_event_plane().then(|| {
            PlaneTaps::new(PlaneContext {
                sink: sink.clone(),
                stats: stats.clone(),
                view: view.clone(),
                limits: cfg.kv_limits(),
                window_ns: cfg.kv_reorder_window_ms() * 1_000_000,
                nats: cfg.event_plane_nats(),
                stop: stop_rx.clone(),
            })
        });
        info!(backend = %backend, event_plane = planes.is_some(), "Following Dynamo's discovery store.");
        health.fail(crate::fleet::DISCOVERY_CHECK, "first read pending");
        inputs.push(tokio::spawn(crate::fleet::run(
            crate::fleet::Store {
                backend,
                poll: cfg.discovery.poll_interval(),
                freshness: freshness.clone(),
            },
            view_tx,
            sink.clone(),
            stats.clone(),
            health.clone(),
            planes,
            stop_rx.clone(),
        )));
    }

    for ep in &cfg.kv_endpoints {
        info!(publisher = %ep.endpoint, worker_id = ?ep.worker_id, dp_rank = ?ep.dp_rank, "Tapping KV events.");
        inputs.push(tokio::spawn(tap::run(
            ep.clone(),
            fleet_view.clone(),
            cfg.kv_limits(),
            sink.clone(),
            sink.add_publisher(&ep.endpoint, cfg.kv_reorder_window_ms() * 1_000_000),
            stats.clone(),
            stop_rx.clone(),
        )));
    }

    if let Some(log) = &cfg.router_log {
        let settings = crate::taps::router::files::FollowSettings {
            from_start: cfg.from_start,
            poll: Duration::from_millis(cfg.log_poll_interval_ms.max(1)),
            max_line_bytes: cfg.max_line_bytes,
            join_timeout_ns: (cfg.join_timeout_secs * 1e9) as u64,
            decisions: cfg.decisions,
            tenant_field: cfg.tenant_field()?,
            reorder_window_ns: cfg.reorder_window_ms * 1_000_000,
            request_trace_window_ns: cfg.request_trace_window_ms * 1_000_000,
            rescan: Duration::from_secs(2),
            states: sources.clone(),
        };
        if crate::taps::router::files::is_pattern(log) {
            info!(pattern = %log, "Following the router logs a pattern matches.");
            inputs.push(tokio::spawn(crate::taps::router::files::run(
                log.clone(),
                settings,
                sink.clone(),
                stats.clone(),
            )));
        } else {
            let source = if log == "-" {
                LogSource::Stdin
            } else {
                LogSource::File {
                    path: log.into(),
                    from_start: cfg.from_start,
                    poll: settings.poll,
                }
            };
            info!(source = ?source, "Following the router log.");
            let (tap, _) = crate::taps::router::files::follow_one(
                source,
                "router_log",
                &settings,
                &sink,
                &stats,
                log_stop.clone(),
            )
            .context("cannot start the router log follower")?;
            inputs.push(tap);
        }
    }

    let (nixl, nixl_reporter) = if cfg.nixl.enabled {
        let tracer = Arc::new(
            NixlTracer::start(&cfg.nixl)
                .await
                .context("cannot trace NIXL")?,
        );
        info!(
            libraries = tracer.attached_libraries(),
            discover = cfg.nixl.discover,
            "Tracing NIXL."
        );
        let period = Duration::from_secs_f64(cfg.nixl.report_interval_secs);
        let (t, sink) = (tracer.clone(), sink.clone());
        // With a discovery store, each report tells which worker each local NIXL agent
        // belongs to (the actuator's mapping without a table).
        let fleet = fleet_view.clone();
        let reporter = tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            let owners = Arc::new(std::sync::Mutex::new(
                crate::fleet::owners::Owners::default(),
            ));
            loop {
                tick.tick().await;
                let mut report = t.report();
                if let Some(view) = &fleet {
                    let (fleet, agents, owners) =
                        (view.borrow().clone(), t.local_agents(), owners.clone());
                    // Reading /proc is blocking file I/O.
                    report.owners = tokio::task::spawn_blocking(move || {
                        owners.lock().unwrap_or_else(|e| e.into_inner()).update(
                            &fleet,
                            &agents,
                            std::path::Path::new("/proc"),
                        )
                    })
                    .await
                    .unwrap_or_default();
                }
                sink.submit(Record::Nixl(report));
            }
        });
        (Some(tracer), Some(reporter))
    } else {
        (None, None)
    };

    inputs.push(tokio::spawn(crate::watchdog::run(
        crate::watchdog::Watched {
            health: health.clone(),
            sources: sources.clone(),
            sink: sink.clone(),
            stats: stats.clone(),
            discovery: discovery_freshness.clone(),
        },
        stop_rx.clone(),
    )));
    health.fail(
        publisher::BUS_CHECK,
        format!("not yet connected to {}", cfg.nats_url),
    );
    let publisher = tokio::spawn(publisher::run(
        PublisherConfig {
            nats_url: cfg.nats_url.clone(),
            security: cfg.nats.clone(),
            inbox_prefix: subjects.inbox_prefix(&cfg.agent_id),
            subjects: subjects.clone(),
            stream_max_age: Duration::from_secs(cfg.stream_max_age_secs),
            stream_max_bytes: cfg.stream_max_bytes,
            stream_replicas: cfg.stream_replicas,
            run_id: format!("{}-{}", cfg.agent_id, now_ns()),
            health: health.clone(),
        },
        sink.clone(),
        stats.clone(),
        stop_rx.clone(),
        give_up_rx,
    ));

    let heartbeat_task = {
        let sink = sink.clone();
        let stats = stats.clone();
        let period = Duration::from_secs_f64(cfg.heartbeat_interval_secs);
        // Records the taps' progress has not released leave when the first held one's
        // reorder window ends: the timer is set to that moment, and re-set when a new
        // record goes first.
        let idle = Duration::from_millis(cfg.reorder_window_ms.max(1));
        tokio::spawn(async move {
            let mut beat = tokio::time::interval(period);
            beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            beat.tick().await;
            loop {
                let wait = sink.next_due_ns().map_or(idle, |due| {
                    Duration::from_nanos(due.saturating_sub(now_ns()))
                });
                tokio::select! {
                    _ = beat.tick() => heartbeat(&sink, &stats),
                    _ = tokio::time::sleep(wait) => sink.release_due(),
                    _ = sink.head_changed() => {}
                }
            }
        })
    };

    let otlp_stats = Arc::new(kvscope_otlp::ExportStats::default());
    let http_stats = Arc::new(kvscope_kit::http::ServerStats::default());
    let exposition = crate::metrics::exposition(crate::metrics::Sources {
        agent: cfg.agent_id.clone(),
        stats: stats.clone(),
        sink: sink.clone(),
        nixl: nixl.clone(),
        otlp: otlp_stats.clone(),
        http: http_stats.clone(),
        health: health.clone(),
    });
    let otlp = kvscope_otlp::OtlpExport::start(
        &cfg.otlp,
        kvscope_otlp::ServiceIdentity {
            name: "kvscope-agent",
            version: env!("CARGO_PKG_VERSION"),
            instance_id: cfg.agent_id.clone(),
            attributes: vec![
                ("kvscope.agent.id".into(), cfg.agent_id.clone()),
                ("kvscope.cluster".into(), subjects.cluster().to_string()),
            ],
        },
        {
            let render = exposition.clone();
            Arc::new(move || render(kvscope_kit::prom::Format::OpenMetrics))
        },
        otlp_stats,
    )
    .context("cannot start OTLP export")?;
    if let (Some(o), Some(t)) = (&otlp, &nixl) {
        t.set_spans(crate::nixl::spans::NixlSpans {
            sink: o.spans(),
            agent_id: cfg.agent_id.clone(),
            sample_every: cfg.nixl.sample_every,
        });
    }

    let (metrics_addr, metrics) = match &cfg.metrics_listen {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr} for /metrics"))?;
            let local = listener.local_addr()?;
            info!(addr = %local, "Serving /metrics.");
            (
                Some(local),
                Some(tokio::spawn(crate::metrics::serve(
                    listener, exposition, health, http_stats,
                ))),
            )
        }
        None => (None, None),
    };

    info!(agent = %cfg.agent_id, cluster = %subjects.cluster(), nats = %cfg.nats_url, nats_security = %cfg.nats.describe(), "Agent started.");
    Ok(RunningAgent {
        stats,
        sink,
        stop: stop_tx,
        give_up: give_up_tx,
        log_stop,
        inputs,
        publisher,
        heartbeat: heartbeat_task,
        metrics_addr,
        metrics,
        nixl,
        nixl_reporter,
        otlp,
        agent_id: cfg.agent_id.clone(),
        grace: Duration::from_secs_f64(cfg.shutdown_grace_secs),
    })
}
