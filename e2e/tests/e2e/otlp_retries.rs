//! The OTLP exporter against a receiver that turns requests away, over gRPC and HTTP:
//! a receiver that is unavailable a few times, then takes the batch, loses no span; an
//! HTTP 429 is retried after its `Retry-After`; a non-retryable refusal (400,
//! INVALID_ARGUMENT) is tried once, and the batch is counted lost. And a receiver on
//! https:// with mutual TLS (a test CA) gets every span over gRPC and HTTP; without the
//! client certificate, none.

use kvscope_e2e::otlp_receiver;

use kvscope_otlp::proto::trace::v1::Span;
use kvscope_otlp::{ExportStats, OtlpConfig, OtlpExport, Protocol, ServiceIdentity};
use otlp_receiver::{Receiver, Refusal, ServerTls};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SPANS: usize = 25;

fn spans(run: u8) -> Vec<Span> {
    (0..SPANS)
        .map(|i| Span {
            trace_id: vec![run; 16],
            span_id: (i as u64 + 1).to_be_bytes().to_vec(),
            name: format!("test.span.{i}"),
            start_time_unix_nano: 1,
            end_time_unix_nano: 2,
            ..Default::default()
        })
        .collect()
}

/// Export `SPANS` spans through a fresh exporter to `rx` over `protocol`; waits until
/// the exporter has either delivered or given them up. Returns its counters.
async fn export_through(rx: &Receiver, protocol: Protocol, run: u8) -> Arc<ExportStats> {
    export_with(rx, protocol, run, OtlpConfig::default()).await
}

/// [`export_through`] with `base`'s other settings (TLS, timeout).
async fn export_with(
    rx: &Receiver,
    protocol: Protocol,
    run: u8,
    base: OtlpConfig,
) -> Arc<ExportStats> {
    let endpoint = match protocol {
        Protocol::Grpc => rx.grpc_url.clone(),
        Protocol::HttpProtobuf => rx.http_url.clone(),
    };
    let cfg = OtlpConfig {
        endpoint: Some(endpoint),
        protocol,
        timeout_secs: if base.timeout_secs == OtlpConfig::default().timeout_secs {
            8.0
        } else {
            base.timeout_secs
        },
        // Spans only: a metrics export would take refusals meant for the spans.
        metrics: kvscope_otlp::config::SignalConfig {
            enabled: false,
            ..Default::default()
        },
        ..base
    };
    let stats = Arc::new(ExportStats::default());
    let export = OtlpExport::start(
        &cfg,
        ServiceIdentity {
            name: "kvscope-retry-test",
            version: "0",
            instance_id: format!("run-{run}"),
            attributes: Vec::new(),
        },
        Arc::new(String::new),
        stats.clone(),
    )
    .unwrap()
    .expect("export on");
    let sink = export.spans();
    for s in spans(run) {
        sink.record(s);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while stats.spans_exported.load(Ordering::Relaxed) + stats.spans_failed.load(Ordering::Relaxed)
        < SPANS as u64
    {
        assert!(
            Instant::now() < deadline,
            "the spans were neither sent nor given up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(export);
    stats
}

fn received(rx: &Receiver, run: u8) -> usize {
    rx.inbox
        .traces
        .lock()
        .unwrap()
        .iter()
        .flat_map(|(_, r)| &r.resource_spans)
        .flat_map(|r| &r.scope_spans)
        .flat_map(|s| &s.spans)
        .filter(|s| s.trace_id == vec![run; 16])
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_refusals_are_retried_and_others_are_not() {
    let mut run = 0u8;
    for protocol in [Protocol::Grpc, Protocol::HttpProtobuf] {
        // Unavailable three times, then it takes the batch: nothing lost, 3 retries.
        let rx = Receiver::start().await;
        rx.inbox
            .refusals
            .lock()
            .unwrap()
            .extend([Refusal::Unavailable; 3]);
        run += 1;
        let stats = export_through(&rx, protocol, run).await;
        assert_eq!(
            received(&rx, run),
            SPANS,
            "{protocol:?}: every span arrived"
        );
        assert_eq!(
            stats.spans_failed.load(Ordering::Relaxed),
            0,
            "{protocol:?}"
        );
        assert_eq!(
            stats.span_export_retries.load(Ordering::Relaxed),
            3,
            "{protocol:?}"
        );
        assert_eq!(rx.inbox.attempts.load(Ordering::Relaxed), 4, "{protocol:?}");

        // Refused for good: tried once, counted lost, never retried.
        let rx = Receiver::start().await;
        *rx.inbox.refuse_all.lock().unwrap() = Some(Refusal::BadRequest);
        run += 1;
        let stats = export_through(&rx, protocol, run).await;
        assert_eq!(received(&rx, run), 0);
        assert_eq!(
            stats.spans_failed.load(Ordering::Relaxed),
            SPANS as u64,
            "{protocol:?}"
        );
        assert_eq!(
            stats.span_export_retries.load(Ordering::Relaxed),
            0,
            "{protocol:?}"
        );
        assert_eq!(rx.inbox.attempts.load(Ordering::Relaxed), 1, "{protocol:?}");
    }

    // HTTP 429 with Retry-After: 1 — the retry waits for it.
    let rx = Receiver::start().await;
    rx.inbox
        .refusals
        .lock()
        .unwrap()
        .push_back(Refusal::TooManyRequests {
            retry_after_secs: 1,
        });
    run += 1;
    let started = Instant::now();
    let stats = export_through(&rx, Protocol::HttpProtobuf, run).await;
    assert_eq!(received(&rx, run), SPANS);
    assert_eq!(stats.span_export_retries.load(Ordering::Relaxed), 1);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "the retry came before Retry-After"
    );

    // Unavailable for longer than the export timeout allows: given up, counted lost.
    let rx = Receiver::start().await;
    *rx.inbox.refuse_all.lock().unwrap() = Some(Refusal::Unavailable);
    run += 1;
    let stats = export_through(&rx, Protocol::HttpProtobuf, run).await;
    assert_eq!(stats.spans_failed.load(Ordering::Relaxed), SPANS as u64);
    assert!(stats.span_export_retries.load(Ordering::Relaxed) >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_on_https_with_mutual_tls_gets_every_span() {
    let dir = tempfile::tempdir().unwrap();
    let ca = kvscope_lab::bus_security::LoopbackCa::create(dir.path()).unwrap();
    let (cert, key) = ca.client(dir.path(), "kvscope-agent").unwrap();
    let rx = Receiver::start_tls(ServerTls {
        cert: ca.server_cert.clone(),
        key: ca.server_key.clone(),
        client_ca: Some(ca.ca_file.clone()),
    })
    .await;
    assert!(rx.grpc_url.starts_with("https://") && rx.http_url.starts_with("https://"));
    let tls = || OtlpConfig {
        certificate: Some(ca.ca_file.clone()),
        client_certificate: Some(cert.clone()),
        client_key: Some(key.clone()),
        ..OtlpConfig::default()
    };
    for (run, protocol) in [(101, Protocol::Grpc), (102, Protocol::HttpProtobuf)] {
        let stats = export_with(&rx, protocol, run, tls()).await;
        assert_eq!(received(&rx, run), SPANS, "{protocol:?} over TLS");
        assert_eq!(
            stats.spans_failed.load(Ordering::Relaxed),
            0,
            "{protocol:?}"
        );
    }
    // Without the client certificate the receiver refuses the handshake: nothing taken.
    for (run, protocol) in [(103, Protocol::Grpc), (104, Protocol::HttpProtobuf)] {
        let no_identity = OtlpConfig {
            client_certificate: None,
            client_key: None,
            timeout_secs: 1.0,
            ..tls()
        };
        let stats = export_with(&rx, protocol, run, no_identity).await;
        assert_eq!(received(&rx, run), 0, "{protocol:?}");
        assert_eq!(
            stats.spans_failed.load(Ordering::Relaxed),
            SPANS as u64,
            "{protocol:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_compressed_exports_arrive_whole() {
    let rx = Receiver::start().await;
    let gzip = || OtlpConfig {
        compression: kvscope_otlp::Compression::Gzip,
        ..OtlpConfig::default()
    };
    for (run, protocol) in [(201, Protocol::Grpc), (202, Protocol::HttpProtobuf)] {
        let before = rx.inbox.gzipped.load(Ordering::Relaxed);
        let stats = export_with(&rx, protocol, run, gzip()).await;
        assert_eq!(received(&rx, run), SPANS, "{protocol:?}");
        assert_eq!(stats.spans_failed.load(Ordering::Relaxed), 0);
        assert!(
            rx.inbox.gzipped.load(Ordering::Relaxed) > before,
            "{protocol:?}: the export came compressed"
        );
    }
    // Uncompressed by default.
    let before = rx.inbox.gzipped.load(Ordering::Relaxed);
    export_through(&rx, Protocol::HttpProtobuf, 203).await;
    assert_eq!(received(&rx, 203), SPANS);
    assert_eq!(rx.inbox.gzipped.load(Ordering::Relaxed), before);
}
