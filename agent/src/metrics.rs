//! Prometheus `/metrics` of the agent's counters: a minimal HTTP/1.1 responder (one
//! GET per connection), so the agent needs no web framework for two dozen numbers.

use crate::counters::AgentStats;
use crate::nixl::NixlTracer;
use crate::record_sink::RecordSink;
use kvscope_wire::nixl::{
    escape_label as escape, write_latency_histogram, LatencySummary, NixlReport,
};
use std::fmt::Write as _;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The exposition text.
pub fn render(agent: &str, stats: &AgentStats, buffered: usize) -> String {
    let agent = escape(agent);
    let mut out = String::new();
    for (name, value) in stats.named() {
        let _ = writeln!(out, "# TYPE kvscope_agent_{name} counter");
        let _ = writeln!(
            out,
            "kvscope_agent_{name}_total{{agent=\"{agent}\"}} {value}"
        );
    }
    let _ = writeln!(out, "# TYPE kvscope_agent_buffered gauge");
    let _ = writeln!(
        out,
        "kvscope_agent_buffered{{agent=\"{agent}\"}} {buffered}"
    );
    out
}

fn histogram(out: &mut String, name: &str, labels: &str, l: &LatencySummary) {
    write_latency_histogram(out, name, labels, &l.buckets, l.count, l.sum_ns);
}

/// The NIXL figures of the eBPF probes: transfers, bytes and post → done latency per
/// peer, op, stage and status; calls (handshakes, notifications, registrations) per
/// peer, method and status; probe health.
pub fn render_nixl(agent: &str, r: &NixlReport) -> String {
    let agent = escape(agent);
    let mut out = String::new();
    let xfer_labels = |t: &kvscope_wire::nixl::NixlTransferStats| {
        format!(
            "agent=\"{agent}\",pid=\"{}\",local_agent=\"{}\",remote_agent=\"{}\",op=\"{}\",stage=\"{}\",status=\"{}\"",
            t.pid,
            escape(&t.local_agent),
            escape(&t.remote_agent),
            t.op,
            t.stage.as_str(),
            t.status
        )
    };
    let _ = writeln!(
        out,
        "# HELP kvscope_agent_nixl_transfers NIXL transfers by peer, op, stage reached and status."
    );
    let _ = writeln!(out, "# TYPE kvscope_agent_nixl_transfers counter");
    for t in &r.transfers {
        let _ = writeln!(
            out,
            "kvscope_agent_nixl_transfers_total{{{}}} {}",
            xfer_labels(t),
            t.transfers
        );
    }
    let _ = writeln!(
        out,
        "# HELP kvscope_agent_nixl_transfer_bytes Bytes of NIXL transfers."
    );
    let _ = writeln!(out, "# TYPE kvscope_agent_nixl_transfer_bytes counter");
    for t in &r.transfers {
        let _ = writeln!(
            out,
            "kvscope_agent_nixl_transfer_bytes_total{{{}}} {}",
            xfer_labels(t),
            t.bytes
        );
    }
    let _ = writeln!(
        out,
        "# HELP kvscope_agent_nixl_transfer_latency_seconds NIXL transfer post to terminal status."
    );
    let _ = writeln!(
        out,
        "# TYPE kvscope_agent_nixl_transfer_latency_seconds histogram"
    );
    for t in r.transfers.iter().filter(|t| t.latency.count > 0) {
        histogram(
            &mut out,
            "kvscope_agent_nixl_transfer_latency_seconds",
            &xfer_labels(t),
            &t.latency,
        );
    }
    let call_labels = |c: &kvscope_wire::nixl::NixlCallStats| {
        format!(
            "agent=\"{agent}\",pid=\"{}\",local_agent=\"{}\",remote_agent=\"{}\",call=\"{}\",status=\"{}\"",
            c.pid,
            escape(&c.local_agent),
            escape(&c.remote_agent),
            c.call,
            c.status
        )
    };
    let _ = writeln!(out, "# HELP kvscope_agent_nixl_calls NIXL metadata (handshake), notification and memory registration calls by peer, method and status.");
    let _ = writeln!(out, "# TYPE kvscope_agent_nixl_calls counter");
    for c in &r.calls {
        let _ = writeln!(
            out,
            "kvscope_agent_nixl_calls_total{{{}}} {}",
            call_labels(c),
            c.calls
        );
    }
    let _ = writeln!(
        out,
        "# HELP kvscope_agent_nixl_call_bytes Bytes registered or deregistered."
    );
    let _ = writeln!(out, "# TYPE kvscope_agent_nixl_call_bytes counter");
    for c in r.calls.iter().filter(|c| c.bytes > 0) {
        let _ = writeln!(
            out,
            "kvscope_agent_nixl_call_bytes_total{{{}}} {}",
            call_labels(c),
            c.bytes
        );
    }
    let _ = writeln!(
        out,
        "# HELP kvscope_agent_nixl_call_latency_seconds NIXL call latency."
    );
    let _ = writeln!(
        out,
        "# TYPE kvscope_agent_nixl_call_latency_seconds histogram"
    );
    for c in r.calls.iter().filter(|c| c.latency.count > 0) {
        histogram(
            &mut out,
            "kvscope_agent_nixl_call_latency_seconds",
            &call_labels(c),
            &c.latency,
        );
    }
    let _ = writeln!(
        out,
        "# HELP kvscope_agent_nixl_events_lost Probe records lost to a full ring buffer."
    );
    let _ = writeln!(out, "# TYPE kvscope_agent_nixl_events_lost counter");
    let _ = writeln!(
        out,
        "kvscope_agent_nixl_events_lost_total{{agent=\"{agent}\"}} {}",
        r.events_lost
    );
    let _ = writeln!(
        out,
        "# HELP kvscope_agent_nixl_events_malformed Probe records not decoded or attributed."
    );
    let _ = writeln!(out, "# TYPE kvscope_agent_nixl_events_malformed counter");
    let _ = writeln!(
        out,
        "kvscope_agent_nixl_events_malformed_total{{agent=\"{agent}\"}} {}",
        r.events_malformed
    );
    let _ = writeln!(out, "# HELP kvscope_agent_nixl_library_info Traced libnixl.so files: 1 = fully traced, 0 = degraded (see the agent log).");
    let _ = writeln!(out, "# TYPE kvscope_agent_nixl_library_info gauge");
    for l in &r.libraries {
        let _ = writeln!(
            out,
            "kvscope_agent_nixl_library_info{{agent=\"{agent}\",path=\"{}\",build_id=\"{}\",offsets_known=\"{}\",probes=\"{}\"}} {}",
            escape(&l.path),
            l.build_id,
            l.offsets_known,
            l.probes_attached,
            u8::from(l.degraded.is_none())
        );
    }
    out
}

/// Everything `/metrics` shows, rendered at each call: the one source of both
/// `/metrics` and the OTLP metrics export.
pub fn exposition(
    agent: String,
    stats: Arc<AgentStats>,
    sink: Arc<RecordSink>,
    nixl: Option<Arc<NixlTracer>>,
    otlp: Arc<kvscope_otlp::ExportStats>,
) -> kvscope_otlp::MetricsSource {
    Arc::new(move || {
        let mut body = render(&agent, &stats, sink.buffered());
        if let Some(t) = &nixl {
            body.push_str(&render_nixl(&agent, &t.report()));
        }
        body.push_str(
            &otlp.render_prometheus("kvscope_agent", &format!("agent=\"{}\"", escape(&agent))),
        );
        body
    })
}

pub async fn serve(listener: TcpListener, source: kvscope_otlp::MetricsSource) {
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            continue;
        };
        let body = source();
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
                "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
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
        assert!(text.contains("kvscope_agent_buffered{agent=\"n\\\"1\"} 2\n"));
        assert_eq!(text.matches("_total{").count(), s.named().len());
    }
}
