//! A receiver that is down or refuses: the process keeps running, and every failed
//! export and every span it held is counted. Real sockets on 127.0.0.1.

use kvscope_otlp::proto::trace::v1::Span;
use kvscope_otlp::{ExportStats, OtlpConfig, OtlpExport, Protocol, ServiceIdentity};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A port nothing listens on: bound, then released.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn identity() -> ServiceIdentity {
    ServiceIdentity {
        name: "kvscope-test",
        version: "0",
        instance_id: "t".into(),
        attributes: vec![],
    }
}

async fn failures_are_counted(cfg: OtlpConfig) {
    let stats = Arc::new(ExportStats::default());
    let export = OtlpExport::start(
        &cfg,
        identity(),
        Arc::new(|| "# TYPE x counter\nx_total 1\n".to_string()),
        stats.clone(),
    )
    .expect("export starts although nothing listens")
    .expect("an endpoint is set");
    let spans = export.spans();
    for _ in 0..5 {
        spans.record(Span {
            trace_id: vec![1; 16],
            span_id: vec![1; 8],
            name: "s".into(),
            ..Default::default()
        });
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while stats.metric_export_failures.load(Ordering::Relaxed) < 2
        || stats.spans_failed.load(Ordering::Relaxed) < 5
    {
        assert!(Instant::now() < deadline, "failures not counted: {}", {
            let mut out = kvscope_kit::prom::Exposition::default();
            stats.write_prometheus(&mut out, "t", "");
            out.finish()
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stats.metric_exports.load(Ordering::Relaxed), 0);
    assert_eq!(stats.spans_exported.load(Ordering::Relaxed), 0);
    assert_eq!(stats.span_export_failures.load(Ordering::Relaxed), 1);
    export.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn grpc_receiver_down() {
    failures_are_counted(OtlpConfig {
        endpoint: Some(format!("http://127.0.0.1:{}", closed_port())),
        export_interval_secs: 0.1,
        timeout_secs: 2.0,
        ..OtlpConfig::default()
    })
    .await;
}

#[tokio::test]
async fn http_receiver_down() {
    failures_are_counted(OtlpConfig {
        endpoint: Some(format!("http://127.0.0.1:{}", closed_port())),
        protocol: Protocol::HttpProtobuf,
        export_interval_secs: 0.1,
        timeout_secs: 2.0,
        ..OtlpConfig::default()
    })
    .await;
}

#[tokio::test]
async fn an_http_error_status_is_a_failure() {
    // A server that answers every request with 503.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            let Ok((mut c, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let _ = c.read(&mut buf).await;
                let _ = c
                    .write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
            });
        }
    });
    failures_are_counted(OtlpConfig {
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        protocol: Protocol::HttpProtobuf,
        export_interval_secs: 0.1,
        ..OtlpConfig::default()
    })
    .await;
    server.abort();
}

#[test]
fn bad_settings_fail_at_start_with_a_clear_error() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let start = |cfg: OtlpConfig| {
        OtlpExport::start(&cfg, identity(), Arc::new(String::new), Arc::default())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let e = start(OtlpConfig {
        endpoint: Some("127.0.0.1:4318".into()),
        protocol: Protocol::HttpProtobuf,
        ..OtlpConfig::default()
    });
    assert!(e.contains("http://"), "{e}");
    let mut cfg = OtlpConfig {
        endpoint: Some("http://127.0.0.1:4317".into()),
        ..OtlpConfig::default()
    };
    cfg.headers.insert("bad header".into(), "x".into());
    let e = start(cfg);
    assert!(e.contains("bad header"), "{e}");
    // TLS with a CA file that is not there says which.
    for protocol in [Protocol::Grpc, Protocol::HttpProtobuf] {
        let e = start(OtlpConfig {
            endpoint: Some("https://collector:4317".into()),
            protocol,
            certificate: Some("/nonexistent/otlp-ca.crt".into()),
            ..OtlpConfig::default()
        });
        assert!(e.contains("/nonexistent/otlp-ca.crt"), "{protocol:?}: {e}");
    }
    assert!(
        OtlpExport::start(
            &OtlpConfig::default(),
            identity(),
            Arc::new(String::new),
            Arc::default()
        )
        .unwrap()
        .is_none(),
        "no endpoint: no export"
    );
}
