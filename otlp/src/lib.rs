//! OTLP export of the kvscope agent's and collector's metrics and spans.
//!
//! Metrics are converted from the process's own `/metrics` text at each export
//! ([`exposition`]), so OTLP and Prometheus carry the same figures. Spans are queued
//! through a [`SpanSink`] (rate-capped, bounded, every drop counted) and sent in batches.
//!
//! Spans are sent by `opentelemetry-otlp`'s span exporter (its transports, retries,
//! gzip), given the spans kvscope builds ([`traces`]); kvscope keeps counting every
//! drop, retry and rejection it can see. Metrics are built here with
//! `opentelemetry-proto` and sent with tonic / reqwest: the SDK (0.33) takes metric data
//! only through its instruments, whose data types have no public constructors, and no
//! instrument accepts pre-aggregated histogram buckets — but the collector's NIXL
//! latency histograms are buckets merged from the agents' reports. Both signals share
//! one config, one TLS setup and one set of health counters.

pub mod config;
pub mod export;
pub mod exposition;
pub mod traces;

pub use config::{Compression, OtlpConfig, Protocol, Signal};
pub use export::{ExportError, ExportStats};
pub use opentelemetry_proto::tonic as proto;

use export::{add, SignalExporter};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::{ResourceMetrics, ScopeMetrics};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::Span;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tracing::{info, warn};

/// The `--help` paragraph of the agent and the collector.
pub const HELP: &str = "OTLP export (off by default): set `endpoint` in the config file's [otlp] \
section, or OTEL_EXPORTER_OTLP_ENDPOINT (e.g. http://127.0.0.1:4317 for gRPC, or \
http://127.0.0.1:4318 with OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf). Also read: \
OTEL_EXPORTER_OTLP_{,METRICS_,TRACES_}{ENDPOINT,HEADERS,PROTOCOL,TIMEOUT}, \
OTEL_METRIC_EXPORT_INTERVAL (ms), OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, \
OTEL_{METRICS,TRACES}_EXPORTER=none, OTEL_SDK_DISABLED. Metrics carry the figures of \
/metrics; spans: see docs/observability.md, \"OTLP export\".";

/// Spans sent per export request.
const SPAN_BATCH: usize = 512;
/// Longest a span waits in the queue when the batch is not full.
const SPAN_FLUSH_INTERVAL: Duration = Duration::from_secs(1);
/// While exports keep failing, one warning per this period (the counters have the rest).
const FAILURE_LOG_PERIOD: Duration = Duration::from_secs(60);

/// A string attribute.
pub fn attr_str(k: &str, v: impl Into<String>) -> KeyValue {
    KeyValue {
        key: k.to_string(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(v.into())),
        }),
        ..Default::default()
    }
}

/// An integer attribute (values above `i64::MAX` saturate).
pub fn attr_int(k: &str, v: impl TryInto<i64>) -> KeyValue {
    KeyValue {
        key: k.to_string(),
        value: Some(AnyValue {
            value: Some(any_value::Value::IntValue(v.try_into().unwrap_or(i64::MAX))),
        }),
        ..Default::default()
    }
}

/// A boolean attribute.
pub fn attr_bool(k: &str, v: bool) -> KeyValue {
    KeyValue {
        key: k.to_string(),
        value: Some(AnyValue {
            value: Some(any_value::Value::BoolValue(v)),
        }),
        ..Default::default()
    }
}

/// What identifies the exporting process (OTel semantic conventions).
#[derive(Debug, Clone)]
pub struct ServiceIdentity {
    /// Default `service.name` (`kvscope-agent` / `kvscope-collector`).
    pub name: &'static str,
    /// `service.version`.
    pub version: &'static str,
    /// `service.instance.id`: unique per process in the fleet.
    pub instance_id: String,
    /// Extra attributes (e.g. `kvscope.cluster`).
    pub attributes: Vec<(String, String)>,
}

fn resource(cfg: &OtlpConfig, id: &ServiceIdentity) -> Resource {
    let mut attrs: Vec<(String, String)> = vec![
        (
            "service.name".into(),
            cfg.service_name.clone().unwrap_or_else(|| id.name.into()),
        ),
        ("service.version".into(), id.version.into()),
        ("service.instance.id".into(), id.instance_id.clone()),
        (
            "host.name".into(),
            kvscope_kit::host_name().unwrap_or_else(|| "unknown".into()),
        ),
        ("telemetry.sdk.name".into(), "kvscope".into()),
        ("telemetry.sdk.language".into(), "rust".into()),
    ];
    attrs.extend(id.attributes.iter().cloned());
    // Configured attributes win, except service.name, which OTEL_SERVICE_NAME sets.
    for (k, v) in &cfg.resource_attributes {
        if k == "service.name" && cfg.service_name.is_some() {
            continue;
        }
        attrs.retain(|(x, _)| x != k);
        attrs.push((k.clone(), v.clone()));
    }
    Resource {
        attributes: attrs.iter().map(|(k, v)| attr_str(k, v.clone())).collect(),
        ..Default::default()
    }
}

fn scope() -> InstrumentationScope {
    InstrumentationScope {
        name: "kvscope".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        ..Default::default()
    }
}

/// Logs export failures without flooding: the first failure, the recovery, and one
/// reminder per [`FAILURE_LOG_PERIOD`] while it keeps failing.
struct FailureLog {
    signal: Signal,
    failing_since: Option<Instant>,
    last_log: Option<Instant>,
}

impl FailureLog {
    fn new(signal: Signal) -> Self {
        Self {
            signal,
            failing_since: None,
            last_log: None,
        }
    }

    fn failed(&mut self, e: &ExportError) {
        let now = Instant::now();
        self.failing_since.get_or_insert(now);
        if self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= FAILURE_LOG_PERIOD)
        {
            self.last_log = Some(now);
            warn!(signal = self.signal.as_str(), error = %e, "OTLP export failed; counted in kvscope_*_otlp_export_failures_total, will retry at the next export.");
        }
    }

    fn ok(&mut self) {
        if self.failing_since.take().is_some() {
            self.last_log = None;
            info!(signal = self.signal.as_str(), "OTLP export works again.");
        }
    }
}

struct SpanQueue {
    spans: VecDeque<Span>,
    /// Rate cap: tokens left in the current second.
    window_start: Instant,
    window_used: u32,
}

/// Where spans go. Cheap to clone; a sink of a process without trace export takes
/// nothing and costs nothing ([`SpanSink::enabled`] is false).
#[derive(Clone)]
pub struct SpanSink {
    inner: Option<Arc<SpanSinkInner>>,
}

struct SpanSinkInner {
    queue: Mutex<SpanQueue>,
    max_per_second: u32,
    max_queued: usize,
    wake: Notify,
    stats: Arc<ExportStats>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SpanSink {
    /// A sink that takes nothing.
    pub fn disabled() -> Self {
        Self { inner: None }
    }

    /// Whether spans are exported: build spans only when this is true.
    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Whether one more span would be taken now. Callers producing spans at high rates
    /// ask first so dropped spans cost no allocation.
    pub fn admit(&self) -> bool {
        let Some(inner) = &self.inner else {
            return false;
        };
        let mut q = lock(&inner.queue);
        let now = Instant::now();
        if now.duration_since(q.window_start) >= Duration::from_secs(1) {
            q.window_start = now;
            q.window_used = 0;
        }
        if q.window_used >= inner.max_per_second {
            add(&inner.stats.spans_dropped_rate, 1);
            return false;
        }
        if q.spans.len() >= inner.max_queued {
            add(&inner.stats.spans_dropped_queue, 1);
            return false;
        }
        q.window_used += 1;
        true
    }

    /// Queue a span that [`SpanSink::admit`] let in.
    pub fn push_admitted(&self, span: Span) {
        let Some(inner) = &self.inner else { return };
        let len = {
            let mut q = lock(&inner.queue);
            q.spans.push_back(span);
            q.spans.len()
        };
        if len >= SPAN_BATCH {
            inner.wake.notify_one();
        }
    }

    /// Queue `span` if the rate cap and the queue allow; else count it dropped.
    pub fn record(&self, span: Span) {
        if self.admit() {
            self.push_admitted(span);
        }
    }
}

/// Renders the process's `/metrics` text at each export.
pub(crate) type MetricsSource = Arc<dyn Fn() -> String + Send + Sync>;

/// A running OTLP export.
pub struct OtlpExport {
    stats: Arc<ExportStats>,
    spans: SpanSink,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl OtlpExport {
    /// Start exporting what `cfg` enables: metrics from `metrics` every
    /// `export_interval_secs`, spans from the returned [`SpanSink`]. `None` when no
    /// signal has an endpoint (export off, the default). `stats` is the counters the
    /// process also shows on its `/metrics`.
    pub fn start(
        cfg: &OtlpConfig,
        id: ServiceIdentity,
        metrics: MetricsSource,
        stats: Arc<ExportStats>,
    ) -> Result<Option<Self>, StartError> {
        cfg.validate()?;
        let metrics_target = cfg.target(Signal::Metrics);
        let traces_target = cfg.target(Signal::Traces);
        if metrics_target.is_none() && traces_target.is_none() {
            return Ok(None);
        }
        let resource = resource(cfg, &id);
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        if let Some(t) = metrics_target {
            info!(url = %t.url, protocol = ?t.protocol, interval_secs = cfg.export_interval_secs, "Exporting metrics over OTLP.");
            let exporter = SignalExporter::new(t)?;
            tasks.push(tokio::spawn(metrics_loop(
                exporter,
                resource.clone(),
                metrics,
                Duration::from_secs_f64(cfg.export_interval_secs),
                stats.clone(),
                stop_rx.clone(),
            )));
        }
        let spans = match traces_target {
            Some(t) => {
                info!(url = %t.url, protocol = ?t.protocol, max_spans_per_second = cfg.max_spans_per_second, "Exporting spans over OTLP.");
                let exporter = traces::TraceExporter::new(&t, &resource)?;
                let inner = Arc::new(SpanSinkInner {
                    queue: Mutex::new(SpanQueue {
                        spans: VecDeque::new(),
                        window_start: Instant::now(),
                        window_used: 0,
                    }),
                    max_per_second: cfg.max_spans_per_second,
                    max_queued: cfg.max_queued_spans,
                    wake: Notify::new(),
                    stats: stats.clone(),
                });
                tasks.push(tokio::spawn(spans_loop(exporter, inner.clone(), stop_rx)));
                SpanSink { inner: Some(inner) }
            }
            None => SpanSink::disabled(),
        };
        Ok(Some(Self {
            stats,
            spans,
            stop,
            tasks,
        }))
    }

    pub fn spans(&self) -> SpanSink {
        self.spans.clone()
    }

    pub fn stats(&self) -> &Arc<ExportStats> {
        &self.stats
    }

    /// Resolves when one of the export's tasks ends before [`Self::shutdown`]: they only
    /// end early by panicking, and a process that keeps running without them exports
    /// nothing more while its own `/metrics` looks healthy, so the caller should treat
    /// this as fatal. Never resolves while all of them run.
    pub async fn ended(&mut self) -> Result<(), tokio::task::JoinError> {
        use std::future::Future as _;
        let (i, r) = std::future::poll_fn(|cx| {
            for (i, t) in self.tasks.iter_mut().enumerate() {
                if let std::task::Poll::Ready(r) = std::pin::Pin::new(t).poll(cx) {
                    return std::task::Poll::Ready((i, r));
                }
            }
            std::task::Poll::Pending
        })
        .await;
        // A finished JoinHandle must not be polled again, which shutdown would do.
        self.tasks.swap_remove(i);
        r
    }

    /// Export the last metrics and every queued span, waiting at most `grace`.
    pub async fn shutdown(mut self, grace: Duration) {
        let _ = self.stop.send(true);
        let tasks = std::mem::take(&mut self.tasks);
        let all = futures_join(tasks);
        if tokio::time::timeout(grace, all).await.is_err() {
            warn!("OTLP export did not finish within the shutdown grace period.");
        }
    }
}

async fn futures_join(tasks: Vec<JoinHandle<()>>) {
    for t in tasks {
        let _ = t.await;
    }
}

impl Drop for OtlpExport {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Why export could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Export(#[from] ExportError),
}

async fn metrics_loop(
    exporter: SignalExporter,
    resource: Resource,
    source: MetricsSource,
    period: Duration,
    stats: Arc<ExportStats>,
    mut stop: watch::Receiver<bool>,
) {
    let start_ns = kvscope_kit::clock::now_ns();
    let mut log = FailureLog::new(Signal::Metrics);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut starts = exposition::CumulativeStarts::default();
    loop {
        let last = tokio::select! {
            _ = tick.tick() => false,
            _ = stop.changed() => true,
        };
        let text = source();
        let mut converted = exposition::convert(&text, start_ns, kvscope_kit::clock::now_ns());
        starts.apply(&mut converted.metrics);
        if converted.skipped_samples > 0 {
            add(&stats.metric_samples_skipped, converted.skipped_samples);
        }
        let req = ExportMetricsServiceRequest {
            resource_metrics: vec![ResourceMetrics {
                resource: Some(resource.clone()),
                scope_metrics: vec![ScopeMetrics {
                    scope: Some(scope()),
                    metrics: converted.metrics,
                    ..Default::default()
                }],
                ..Default::default()
            }],
        };
        match exporter
            .export_metrics(req, &stats.metric_export_retries)
            .await
        {
            Ok(rejected) => {
                add(&stats.metric_exports, 1);
                add(&stats.metric_points_rejected, rejected);
                log.ok();
            }
            Err(e) => {
                add(&stats.metric_export_failures, 1);
                log.failed(&e);
            }
        }
        if last {
            return;
        }
    }
}

async fn spans_loop(
    exporter: traces::TraceExporter,
    sink: Arc<SpanSinkInner>,
    mut stop: watch::Receiver<bool>,
) {
    let stats = sink.stats.clone();
    let mut log = FailureLog::new(Signal::Traces);
    let mut last = false;
    loop {
        if !last {
            tokio::select! {
                _ = tokio::time::sleep(SPAN_FLUSH_INTERVAL) => {}
                _ = sink.wake.notified() => {}
                _ = stop.changed() => last = true,
            }
        }
        loop {
            let batch: Vec<Span> = {
                let mut q = lock(&sink.queue);
                let n = q.spans.len().min(SPAN_BATCH);
                q.spans.drain(..n).collect()
            };
            if batch.is_empty() {
                break;
            }
            let n = batch.len() as u64;
            match exporter.export(batch, &stats.span_export_retries).await {
                Ok(rejected) => {
                    add(&stats.span_exports, 1);
                    add(&stats.spans_exported, n.saturating_sub(rejected));
                    add(&stats.spans_rejected, rejected);
                    log.ok();
                }
                Err(e) => {
                    add(&stats.span_export_failures, 1);
                    add(&stats.spans_failed, n);
                    log.failed(&e);
                    break;
                }
            }
            if (n as usize) < SPAN_BATCH {
                break;
            }
        }
        if last {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_kit::prom::{Exposition, Format};

    #[test]
    fn resource_follows_the_semantic_conventions() {
        let mut cfg = OtlpConfig::default();
        cfg.resource_attributes
            .insert("deployment.environment.name".into(), "lab".into());
        let r = resource(
            &cfg,
            &ServiceIdentity {
                name: "kvscope-agent",
                version: "1.2.3",
                instance_id: "node-1".into(),
                attributes: vec![],
            },
        );
        let get = |k: &str| {
            r.attributes
                .iter()
                .find(|a| a.key == k)
                .and_then(|a| a.value.clone())
                .and_then(|v| v.value)
        };
        let s = |v: &str| Some(any_value::Value::StringValue(v.into()));
        assert_eq!(get("service.name"), s("kvscope-agent"));
        assert_eq!(get("service.version"), s("1.2.3"));
        assert_eq!(get("service.instance.id"), s("node-1"));
        assert_eq!(get("deployment.environment.name"), s("lab"));
        assert!(get("host.name").is_some());
    }

    fn sink(max_per_second: u32, max_queued: usize, stats: &Arc<ExportStats>) -> SpanSink {
        SpanSink {
            inner: Some(Arc::new(SpanSinkInner {
                queue: Mutex::new(SpanQueue {
                    spans: VecDeque::new(),
                    window_start: Instant::now(),
                    window_used: 0,
                }),
                max_per_second,
                max_queued,
                wake: Notify::new(),
                stats: stats.clone(),
            })),
        }
    }

    #[test]
    fn the_rate_cap_and_the_queue_bound_count_what_they_drop() {
        let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        let stats = Arc::new(ExportStats::default());
        let capped = sink(5, 100, &stats);
        for _ in 0..12 {
            capped.record(Span::default());
        }
        assert_eq!(get(&stats.spans_dropped_rate), 7);
        assert_eq!(get(&stats.spans_dropped_queue), 0);
        let bounded = sink(100, 3, &stats);
        for _ in 0..10 {
            bounded.record(Span::default());
        }
        assert_eq!(get(&stats.spans_dropped_queue), 7);
        assert_eq!(lock(&bounded.inner.as_ref().unwrap().queue).spans.len(), 3);
        assert!(!SpanSink::disabled().admit());
    }

    #[test]
    fn export_stats_render_as_prometheus_counters() {
        let s = ExportStats::default();
        add(&s.spans_dropped_rate, 4);
        let mut names = Vec::new();
        for format in [Format::Text, Format::OpenMetrics] {
            let mut out = Exposition::new(format);
            s.write_prometheus(&mut out, "kvscope_agent", "agent=\"n\"");
            let text = out.finish();
            assert!(
                text.contains(
                    "kvscope_agent_otlp_spans_dropped_total{agent=\"n\",reason=\"rate_cap\"} 4\n"
                ),
                "{text}"
            );
            let c = exposition::convert(&text, 0, 1);
            assert_eq!(c.skipped_samples, 0);
            assert!(c
                .metrics
                .iter()
                .any(|m| m.name == "kvscope_agent_otlp_spans_dropped"));
            names.push(c.metrics.iter().map(|m| m.name.clone()).collect::<Vec<_>>());
        }
        assert_eq!(names[0], names[1], "both formats give the same OTLP names");
    }
}
