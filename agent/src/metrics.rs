//! Prometheus `/metrics` of the agent's counters: a minimal HTTP/1.1 responder (one
//! GET per connection), so the agent needs no web framework for two dozen numbers.

use crate::counters::AgentStats;
use crate::record_sink::RecordSink;
use std::fmt::Write as _;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The exposition text.
pub fn render(agent: &str, stats: &AgentStats, buffered: usize) -> String {
    let agent = agent.replace('\\', "\\\\").replace('"', "\\\"");
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

pub async fn serve(
    listener: TcpListener,
    agent: String,
    stats: Arc<AgentStats>,
    sink: Arc<RecordSink>,
) {
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            continue;
        };
        let body = render(&agent, &stats, sink.buffered());
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
