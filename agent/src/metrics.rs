//! Prometheus `/metrics` of the agent's counters: a minimal HTTP/1.1 responder (one
//! GET per connection), so the agent needs no web framework for two dozen numbers.

use crate::counters::AgentStats;
use crate::nixl::NixlTracer;
use crate::record_sink::RecordSink;
use kvscope_wire::nixl::{write_latency_histogram, LatencySummary, NixlReport};
use kvscope_wire::prom::{labels, Exposition, Format, Kind};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The exposition text.
pub fn render(agent: &str, stats: &AgentStats, buffered: usize) -> String {
    let agent_labels = labels(&[("agent", agent)]);
    let mut out = Exposition::new(Format::Text);
    for (name, help, value) in stats.named() {
        out.single_counter(&format!("kvscope_agent_{name}"), help, &agent_labels, value);
    }
    out.single_gauge(
        "kvscope_agent_buffered_records",
        "Records waiting in the agent's local buffer (reorder window, or NATS away).",
        &agent_labels,
        buffered,
    );
    out.finish()
}

fn histogram(out: &mut Exposition, name: &str, labels: &str, l: &LatencySummary) {
    write_latency_histogram(out, name, labels, &l.buckets, l.count, l.sum_ns);
}

/// The NIXL figures of the eBPF probes: transfers, bytes and post → done latency per
/// peer, op, stage and status; calls (handshakes, notifications, registrations) per
/// peer, method and status; probe health. Label values are bounded by the fleet: NIXL
/// agent names, ops, stages, methods and `nixl_status_t` names (the pid is the traced
/// process's, forgotten when it exits).
pub fn render_nixl(agent: &str, r: &NixlReport) -> String {
    let mut out = Exposition::new(Format::Text);
    let xfer_labels = |t: &kvscope_wire::nixl::NixlTransferStats| {
        labels(&[
            ("agent", agent),
            ("pid", &t.pid.to_string()),
            ("local_agent", &t.local_agent),
            ("remote_agent", &t.remote_agent),
            ("op", &t.op),
            ("stage", t.stage.as_str()),
            ("status", &t.status),
        ])
    };
    let name = "kvscope_agent_nixl_transfers";
    out.family(
        name,
        Kind::Counter,
        "NIXL transfers by peer, op, stage reached and status.",
    );
    for t in &r.transfers {
        out.counter(name, &xfer_labels(t), t.transfers);
    }
    let name = "kvscope_agent_nixl_transfer_bytes";
    out.family(name, Kind::Counter, "Bytes of NIXL transfers.");
    for t in &r.transfers {
        out.counter(name, &xfer_labels(t), t.bytes);
    }
    let name = "kvscope_agent_nixl_transfer_latency_seconds";
    out.family(
        name,
        Kind::Histogram,
        "NIXL transfer post to terminal status.",
    );
    for t in r.transfers.iter().filter(|t| t.latency.count > 0) {
        histogram(&mut out, name, &xfer_labels(t), &t.latency);
    }
    let call_labels = |c: &kvscope_wire::nixl::NixlCallStats| {
        labels(&[
            ("agent", agent),
            ("pid", &c.pid.to_string()),
            ("local_agent", &c.local_agent),
            ("remote_agent", &c.remote_agent),
            ("call", &c.call),
            ("status", &c.status),
        ])
    };
    let name = "kvscope_agent_nixl_calls";
    out.family(
        name,
        Kind::Counter,
        "NIXL metadata (handshake), notification and memory registration calls by peer, method and status.",
    );
    for c in &r.calls {
        out.counter(name, &call_labels(c), c.calls);
    }
    let name = "kvscope_agent_nixl_call_bytes";
    out.family(name, Kind::Counter, "Bytes registered or deregistered.");
    for c in r.calls.iter().filter(|c| c.bytes > 0) {
        out.counter(name, &call_labels(c), c.bytes);
    }
    let name = "kvscope_agent_nixl_call_latency_seconds";
    out.family(name, Kind::Histogram, "NIXL call latency.");
    for c in r.calls.iter().filter(|c| c.latency.count > 0) {
        histogram(&mut out, name, &call_labels(c), &c.latency);
    }
    let agent_labels = labels(&[("agent", agent)]);
    out.single_counter(
        "kvscope_agent_nixl_events_lost",
        "Probe records lost to a full ring buffer.",
        &agent_labels,
        r.events_lost,
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
            ("probes", &l.probes_attached.to_string()),
        ]);
        out.gauge(name, &l_labels, u8::from(l.degraded.is_none()));
    }
    out.finish()
}

pub async fn serve(
    listener: TcpListener,
    agent: String,
    stats: Arc<AgentStats>,
    sink: Arc<RecordSink>,
    nixl: Option<Arc<NixlTracer>>,
) {
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            continue;
        };
        let mut body = render(&agent, &stats, sink.buffered());
        if let Some(t) = &nixl {
            body.push_str(&render_nixl(&agent, &t.report()));
        }
        tokio::spawn(async move {
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                match tokio::time::timeout(std::time::Duration::from_secs(5), conn.read(&mut buf))
                    .await
                {
                    Ok(Ok(n)) if n > 0 => head.extend_from_slice(&buf[..n]),
                    _ => return,
                }
            }
            let ok = head.starts_with(b"GET /metrics ") || head.starts_with(b"GET / ");
            let (status, body) = if ok {
                ("200 OK", body)
            } else {
                ("404 Not Found", "not found\n".to_string())
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                Format::Text.content_type(),
                body.len()
            );
            let _ = conn.write_all(resp.as_bytes()).await;
            let _ = conn.shutdown().await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_counter() {
        let s = AgentStats::default();
        crate::counters::add(&s.kv_batches, 4);
        let text = render("n\"1", &s, 2);
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
