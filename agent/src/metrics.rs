//! Prometheus `/metrics` of the agent's counters: a minimal HTTP/1.1 responder (one
//! GET per connection), so the agent needs no web framework for two dozen numbers.

use crate::counters::AgentStats;
use crate::nixl::NixlTracer;
use crate::sink::{RecordSink, SourceClockReading};
use kvscope_kit::prom::{labels, Exposition, Format, Kind};
use kvscope_wire::nixl::{write_latency_histogram, MergedLatency, NixlReport};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::net::TcpListener;

/// The agent's own counters and its buffer.
pub fn write(out: &mut Exposition, agent: &str, stats: &AgentStats, buffered: usize) {
    let agent_labels = labels(&[("agent", agent)]);
    for (name, help, value) in stats.named() {
        out.single_counter(&format!("kvscope_agent_{name}"), help, &agent_labels, value);
    }
    out.single_gauge(
        "kvscope_agent_buffered_records",
        "Records waiting in the agent's local buffer (reorder window, or NATS away).",
        &agent_labels,
        buffered,
    );
}

fn histogram(out: &mut Exposition, name: &str, labels: &str, l: &MergedLatency) {
    write_latency_histogram(out, name, labels, &l.buckets, l.count, l.sum_ns);
}

/// Counts, bytes and latency summed over the traced processes that share a label set.
#[derive(Default)]
struct Summed {
    n: u64,
    bytes: u64,
    bytes_unknown: u64,
    bytes_partial: u64,
    latency: MergedLatency,
}

/// The NIXL figures of the eBPF probes: transfers, bytes and post → done latency per
/// peer, op, stage and status; calls (handshakes, notifications, registrations) per
/// peer, method and status; probe health. Label values are bounded by the fleet: NIXL
/// agent names, ops, stages, methods and `nixl_status_t` names. Processes are summed
/// (no `pid` label): a restarted worker keeps its series instead of adding new ones.
pub(crate) fn write_nixl(out: &mut Exposition, agent: &str, r: &NixlReport) {
    let mut transfers: BTreeMap<(&str, &str, &str, &str, &str), Summed> = BTreeMap::new();
    for t in &r.transfers {
        let key = (
            t.local_agent.as_str(),
            t.remote_agent.as_str(),
            t.op.as_str(),
            t.stage.as_str(),
            t.status.as_str(),
        );
        let e = transfers.entry(key).or_default();
        e.n += t.transfers;
        e.bytes += t.bytes;
        e.bytes_unknown += t.bytes_unknown;
        e.latency.add(&t.latency);
    }
    let xfer_labels = |(local, remote, op, stage, status): &(&str, &str, &str, &str, &str)| {
        labels(&[
            ("agent", agent),
            ("local_agent", local),
            ("remote_agent", remote),
            ("op", op),
            ("stage", stage),
            ("status", status),
        ])
    };
    let name = "kvscope_agent_nixl_transfers";
    out.family(
        name,
        Kind::Counter,
        "NIXL transfers by peer, op, stage reached and status.",
    );
    for (k, t) in &transfers {
        out.counter(name, &xfer_labels(k), t.n);
    }
    let name = "kvscope_agent_nixl_transfer_bytes";
    out.family(name, Kind::Counter, "Bytes of NIXL transfers.");
    for (k, t) in &transfers {
        out.counter(name, &xfer_labels(k), t.bytes);
    }
    let name = "kvscope_agent_nixl_transfers_bytes_unknown";
    out.family(
        name,
        Kind::Counter,
        "NIXL transfers whose bytes were not read (not in the bytes): the build's requests hold no byte count for them (NIXL before 1.4 with the agent's telemetry off) or its offsets are unknown.",
    );
    for (k, t) in transfers.iter().filter(|(_, t)| t.bytes_unknown > 0) {
        out.counter(name, &xfer_labels(k), t.bytes_unknown);
    }
    let name = "kvscope_agent_nixl_transfer_latency_seconds";
    out.family(
        name,
        Kind::Histogram,
        "NIXL transfer post to terminal status.",
    );
    for (k, t) in transfers.iter().filter(|(_, t)| t.latency.count > 0) {
        histogram(out, name, &xfer_labels(k), &t.latency);
    }
    let mut calls: BTreeMap<(&str, &str, &str, &str), Summed> = BTreeMap::new();
    for c in &r.calls {
        let key = (
            c.local_agent.as_str(),
            c.remote_agent.as_str(),
            c.call.as_str(),
            c.status.as_str(),
        );
        let e = calls.entry(key).or_default();
        e.n += c.calls;
        e.bytes += c.bytes;
        e.bytes_partial += c.bytes_partial;
        e.latency.add(&c.latency);
    }
    let call_labels = |(local, remote, call, status): &(&str, &str, &str, &str)| {
        labels(&[
            ("agent", agent),
            ("local_agent", local),
            ("remote_agent", remote),
            ("call", call),
            ("status", status),
        ])
    };
    let name = "kvscope_agent_nixl_calls";
    out.family(
        name,
        Kind::Counter,
        "NIXL metadata (handshake), notification and memory registration calls by peer, method and status.",
    );
    for (k, c) in &calls {
        out.counter(name, &call_labels(k), c.n);
    }
    let name = "kvscope_agent_nixl_call_bytes";
    out.family(name, Kind::Counter, "Bytes registered or deregistered.");
    for (k, c) in calls.iter().filter(|(_, c)| c.bytes > 0) {
        out.counter(name, &call_labels(k), c.bytes);
    }
    let name = "kvscope_agent_nixl_call_bytes_partial";
    out.family(
        name,
        Kind::Counter,
        "Registrations of more descriptors than the probes sum (65,536): their bytes are of the first ones.",
    );
    for (k, c) in calls.iter().filter(|(_, c)| c.bytes_partial > 0) {
        out.counter(name, &call_labels(k), c.bytes_partial);
    }
    let name = "kvscope_agent_nixl_call_latency_seconds";
    out.family(name, Kind::Histogram, "NIXL call latency.");
    for (k, c) in calls.iter().filter(|(_, c)| c.latency.count > 0) {
        histogram(out, name, &call_labels(k), &c.latency);
    }
    // In flight per peer, over the processes: how many, and how long the oldest has been.
    let mut in_flight: BTreeMap<(&str, &str), (u64, u64)> = BTreeMap::new();
    for f in &r.in_flight {
        let e = in_flight
            .entry((f.local_agent.as_str(), f.remote_agent.as_str()))
            .or_default();
        e.0 += f.transfers;
        e.1 = e.1.max(f.oldest_age_ns);
    }
    let peer_labels = |(local, remote): &(&str, &str)| {
        labels(&[
            ("agent", agent),
            ("local_agent", local),
            ("remote_agent", remote),
        ])
    };
    let name = "kvscope_agent_nixl_transfers_in_flight";
    out.family(
        name,
        Kind::Gauge,
        "NIXL transfers posted and in progress (their terminal status not yet seen), by peer.",
    );
    for (k, (n, _)) in &in_flight {
        out.gauge(name, &peer_labels(k), n);
    }
    let name = "kvscope_agent_nixl_oldest_in_flight_seconds";
    out.family(
        name,
        Kind::Gauge,
        "How long the oldest NIXL transfer in flight to a peer has been in progress.",
    );
    for (k, (_, age)) in &in_flight {
        out.gauge(name, &peer_labels(k), *age as f64 / 1e9);
    }
    let agent_labels = labels(&[("agent", agent)]);
    out.single_counter(
        "kvscope_agent_nixl_events_lost",
        "Probe records lost: to a full ring buffer, or a post whose per-thread slot another thread's post took.",
        &agent_labels,
        r.events_lost,
    );
    out.single_counter(
        "kvscope_agent_nixl_events_read",
        "Probe records read: calls, failed creations, and the transfers whose records were kept (failures, notifications, slow ones, one in sample_every).",
        &agent_labels,
        r.events_read,
    );
    out.single_counter(
        "kvscope_agent_nixl_events_malformed",
        "Probe records not decoded or attributed.",
        &agent_labels,
        r.events_malformed,
    );
    let name = "kvscope_agent_nixl_library_info";
    out.family(
        name,
        Kind::Gauge,
        "Traced libnixl.so files: 1 = fully traced, 0 = degraded (see the agent log).",
    );
    for l in &r.libraries {
        let l_labels = labels(&[
            ("agent", agent),
            ("path", &l.path),
            ("build_id", &l.build_id),
            ("offsets_known", &l.offsets_known.to_string()),
            ("completion_sites", &l.completion_sites.to_string()),
            ("post_site", &l.post_site.to_string()),
            ("creation_sites", &l.creation_sites.to_string()),
            ("probes", &l.probes_attached.to_string()),
        ]);
        out.gauge(name, &l_labels, u8::from(l.degraded.is_none()));
    }
}

/// Everything `/metrics` shows, rendered at each call in the format asked for: the one
/// source of both `/metrics` (text format) and the OTLP metrics export.
pub(crate) type Render = Arc<dyn Fn(Format) -> String + Send + Sync>;

/// What the agent's [`Render`] reads: its counters, the NIXL probes' figures, the OTLP
/// export's and the metrics listener's health, and its readiness checks.
pub struct Sources {
    pub agent: String,
    pub stats: Arc<AgentStats>,
    pub sink: Arc<RecordSink>,
    pub nixl: Option<Arc<NixlTracer>>,
    pub otlp: Arc<kvscope_otlp::ExportStats>,
    pub http: Arc<kvscope_kit::http::ServerStats>,
    pub health: Arc<kvscope_kit::Health>,
}

/// The agent's [`Render`]: one text for `/metrics` and the OTLP export alike, so a series
/// on one is on the other.
pub fn exposition(sources: Sources) -> Render {
    let Sources {
        agent,
        stats,
        sink,
        nixl,
        otlp,
        http,
        health,
    } = sources;
    Arc::new(move |format| {
        let mut out = Exposition::new(format);
        write(&mut out, &agent, &stats, sink.buffered());
        if let Some(wait) = sink.publisher_wait_ns() {
            out.single_gauge(
                "kvscope_agent_kv_publisher_wait_seconds",
                "How long records wait for a quiet KV event publisher: twice the largest \
                 recent delivery lag of KV batches plus 2 ms, at most kv_reorder_window_ms.",
                &labels(&[("agent", &agent)]),
                wait as f64 / 1e9,
            );
        }
        write_source_clocks(&mut out, &agent, &sink.source_clocks());
        if let Some(t) = &nixl {
            write_nixl(&mut out, &agent, &t.report());
        }
        otlp.write_prometheus(&mut out, "kvscope_agent", &labels(&[("agent", &agent)]));
        http.write_prometheus(&mut out, "kvscope_agent");
        health.write_prometheus(&mut out, "kvscope_agent");
        out.finish()
    })
}

/// Each source's clock against the agent's (see `sink`'s docs on clocks).
fn write_source_clocks(out: &mut Exposition, agent: &str, clocks: &[SourceClockReading]) {
    if clocks.is_empty() {
        return;
    }
    let label = |c: &SourceClockReading| labels(&[("agent", agent), ("source", &c.name)]);
    let name = "kvscope_agent_source_clock_ahead_seconds";
    out.family(
        name,
        Kind::Gauge,
        "How far a source's clock reads ahead of the agent's, as estimated from its time \
         stamps: what its stamps are moved back by (0: not ahead).",
    );
    for c in clocks {
        out.gauge(name, &label(c), c.ahead_ns as f64 / 1e9);
    }
    let name = "kvscope_agent_source_lag_floor_seconds";
    out.family(
        name,
        Kind::Gauge,
        "The smallest delay with which a source's records of the last 2-4 s reached the \
         agent: at most how far behind the agent's its clock can be.",
    );
    for c in clocks {
        if let Some(f) = c.lag_floor_ns {
            out.gauge(name, &label(c), f as f64 / 1e9);
        }
    }
}

/// `/metrics` (and `/`), `/healthz` and `/readyz`, through the daemons' one bounded
/// listener (`kvscope_kit::http`: idle and slow connections closed, a connection cap);
/// what it refuses is on `/metrics` too.
pub async fn serve(
    listener: TcpListener,
    render: Render,
    health: Arc<kvscope_kit::Health>,
    stats: Arc<kvscope_kit::http::ServerStats>,
) {
    let service = Endpoints { render, health };
    kvscope_kit::http::serve(listener, service, stats).await;
}

/// The agent's three read-only endpoints as a service.
#[derive(Clone)]
struct Endpoints {
    render: Render,
    health: Arc<kvscope_kit::Health>,
}

impl tower_service::Service<hyper::Request<hyper::body::Incoming>> for Endpoints {
    type Response = hyper::Response<http_body_util::Full<hyper::body::Bytes>>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        let text = "text/plain; charset=utf-8";
        let (status, body, content_type) = if req.method() != hyper::Method::GET {
            (405, "GET only\n".to_string(), text)
        } else {
            match req.uri().path() {
                "/metrics" | "/" => (
                    200,
                    (self.render)(Format::Text),
                    Format::Text.content_type(),
                ),
                "/healthz" => {
                    let (s, b) = self.health.liveness();
                    (s, b, text)
                }
                "/readyz" => {
                    let (s, b) = self.health.readiness();
                    (s, b, text)
                }
                _ => (404, "not found\n".to_string(), text),
            }
        };
        let mut resp = hyper::Response::new(http_body_util::Full::new(body.into()));
        *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
        resp.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static(content_type),
        );
        std::future::ready(Ok(resp))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::nixl::{LatencySummary, NixlTransferStats, XferStage};

    #[test]
    fn nixl_processes_are_summed_without_a_pid_label() {
        let lat = |n: u64| LatencySummary {
            count: n,
            sum_ns: n * 1_000,
            max_ns: 1_000,
            buckets: vec![n; kvscope_wire::nixl::LATENCY_BOUNDS_NS.len()],
            ..LatencySummary::default()
        };
        let xfer = |pid: u32, n: u64| NixlTransferStats {
            pid,
            local_agent: "d0".into(),
            remote_agent: "d1".into(),
            op: "READ".into(),
            stage: XferStage::Complete,
            status: "SUCCESS".into(),
            transfers: n,
            bytes: 10 * n,
            bytes_unknown: 0,
            descriptors: n,
            latency: lat(n),
        };
        let r = NixlReport {
            transfers: vec![xfer(11, 2), xfer(12, 3)],
            ..NixlReport::default()
        };
        let mut out = Exposition::new(Format::Text);
        write_nixl(&mut out, "node", &r);
        let text = out.finish();
        let l = "agent=\"node\",local_agent=\"d0\",remote_agent=\"d1\",op=\"READ\",stage=\"complete\",status=\"SUCCESS\"";
        assert!(
            text.contains(&format!("kvscope_agent_nixl_transfers_total{{{l}}} 5\n")),
            "{text}"
        );
        assert!(text.contains(&format!(
            "kvscope_agent_nixl_transfer_bytes_total{{{l}}} 50\n"
        )));
        assert!(text.contains(&format!(
            "kvscope_agent_nixl_transfer_latency_seconds_count{{{l}}} 5\n"
        )));
        assert!(!text.contains("pid="));
    }

    #[test]
    fn renders_every_counter() {
        let s = AgentStats::default();
        crate::counters::add(&s.kv_batches, 4);
        let mut out = Exposition::new(Format::Text);
        write(&mut out, "n\"1", &s, 2);
        let text = out.finish();
        assert!(text.contains("kvscope_agent_kv_batches_total{agent=\"n\\\"1\"} 4\n"));
        assert!(text.contains("kvscope_agent_buffered_records{agent=\"n\\\"1\"} 2\n"));
        assert_eq!(text.matches("_total{").count(), s.named().len());
        assert_eq!(
            text.matches("# HELP ").count(),
            s.named().len() + 1,
            "every family has its HELP line"
        );
    }
}
