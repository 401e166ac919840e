//! Sending OTLP metric requests: gRPC (tonic) or HTTP/protobuf (reqwest, or TLS over
//! `kvscope_kit::https`), with the configured headers and timeout; the transports the
//! span exporter ([`crate::traces`]) is given too; and the export health counters.
//!
//! A failed request is retried, as the OTLP specification says, when its outcome is
//! retryable — gRPC `UNAVAILABLE`, `CANCELLED`, `DEADLINE_EXCEEDED`, `ABORTED`,
//! `OUT_OF_RANGE`, `DATA_LOSS`; HTTP 429, 502, 503, 504; a connection that failed —
//! with exponential backoff and jitter (100 ms doubling to 5 s, each wait 0.5–1.5× that),
//! honouring an HTTP `Retry-After` of seconds, for as long as the export timeout
//! allows: the whole export, its retries included, takes at most the timeout. Anything
//! else (400, `INVALID_ARGUMENT`, …) is not retried. With `compression = "gzip"`, gRPC
//! messages are sent gzip-compressed and HTTP bodies with `Content-Encoding: gzip`.

use crate::config::{Compression, Protocol, SignalTarget};
use kvscope_kit::prom::{Exposition, Kind};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    metrics_service_client::MetricsServiceClient, ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tonic::transport::Channel;

/// Why an export failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("bad OTLP endpoint {url:?}: {reason}")]
    Endpoint { url: String, reason: String },
    #[error("OTLP header {0:?} is not a valid header name or value")]
    Header(String),
    #[error("OTLP export to {url} failed: {reason}")]
    Send { url: String, reason: String },
}

/// Export health, shown on the process's `/metrics` (and so exported too).
#[derive(Debug, Default)]
pub struct ExportStats {
    pub metric_exports: AtomicU64,
    pub metric_export_failures: AtomicU64,
    pub metric_points_rejected: AtomicU64,
    /// Samples of `/metrics` that could not be converted (see `exposition`).
    pub metric_samples_skipped: AtomicU64,
    /// Export requests sent again after a retryable failure.
    pub metric_export_retries: AtomicU64,
    pub span_exports: AtomicU64,
    pub span_export_failures: AtomicU64,
    pub span_export_retries: AtomicU64,
    pub spans_exported: AtomicU64,
    /// Spans in batches the receiver did not take (failed exports).
    pub spans_failed: AtomicU64,
    /// Spans the receiver reported as rejected (partial success).
    pub spans_rejected: AtomicU64,
    /// Spans over the `max_spans_per_second` cap.
    pub spans_dropped_rate: AtomicU64,
    /// Spans that found the export queue full (receiver slow or down).
    pub spans_dropped_queue: AtomicU64,
}

pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

impl ExportStats {
    /// Write these counters, named `<prefix>_otlp_…`, with `labels` (already escaped
    /// `k="v"` pairs, may be empty) on every sample, into the process's `/metrics`.
    pub fn write_prometheus(&self, out: &mut Exposition, prefix: &str, labels: &str) {
        let with = |extra: &str| match (labels.is_empty(), extra.is_empty()) {
            (_, true) => labels.to_string(),
            (true, false) => extra.to_string(),
            (false, false) => format!("{labels},{extra}"),
        };
        // (family, help, [(extra labels, counter)])
        type Family<'a> = (&'a str, &'a str, &'a [(&'a str, &'a AtomicU64)]);
        let families: [Family; 7] = [
            (
                "exports",
                "OTLP export requests that succeeded, by signal.",
                &[
                    ("signal=\"metrics\"", &self.metric_exports),
                    ("signal=\"traces\"", &self.span_exports),
                ],
            ),
            (
                "export_failures",
                "OTLP export requests that failed, by signal (see the log).",
                &[
                    ("signal=\"metrics\"", &self.metric_export_failures),
                    ("signal=\"traces\"", &self.span_export_failures),
                ],
            ),
            (
                "export_retries",
                "OTLP export requests sent again after a retryable failure (the receiver unavailable, 429/502/503/504), by signal.",
                &[
                    ("signal=\"metrics\"", &self.metric_export_retries),
                    ("signal=\"traces\"", &self.span_export_retries),
                ],
            ),
            (
                "rejected",
                "Data points or spans the OTLP receiver rejected, by signal.",
                &[
                    ("signal=\"metrics\"", &self.metric_points_rejected),
                    ("signal=\"traces\"", &self.spans_rejected),
                ],
            ),
            (
                "metric_samples_skipped",
                "Samples of /metrics that could not be converted to OTLP.",
                &[("", &self.metric_samples_skipped)],
            ),
            (
                "spans_exported",
                "Spans the OTLP receiver took.",
                &[("", &self.spans_exported)],
            ),
            (
                "spans_dropped",
                "Spans not exported, by reason: export_failed, rate_cap (max_spans_per_second), queue_full (receiver slow or down).",
                &[
                    ("reason=\"export_failed\"", &self.spans_failed),
                    ("reason=\"rate_cap\"", &self.spans_dropped_rate),
                    ("reason=\"queue_full\"", &self.spans_dropped_queue),
                ],
            ),
        ];
        for (name, help, rows) in families {
            let full = format!("{prefix}_otlp_{name}");
            out.family(&full, Kind::Counter, help);
            for (extra, v) in rows {
                out.counter(&full, &with(extra), get(v));
            }
        }
    }
}

/// `body` gzip-compressed.
fn gzip(body: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    // Writing to a Vec cannot fail.
    let _ = e.write_all(body);
    e.finish().unwrap_or_default()
}

/// The first wait before a retry; each next one doubles, up to [`MAX_BACKOFF`].
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_millis(100);
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// A failed attempt, and whether it may be retried (after at least the hint, if any).
struct Failed {
    error: ExportError,
    retry: Option<Option<Duration>>,
}

/// The OTLP specification's retryable gRPC codes (`RESOURCE_EXHAUSTED` only with a
/// `RetryInfo`, which tonic does not surface: not retried).
fn grpc_retryable(code: tonic::Code) -> bool {
    use tonic::Code::*;
    matches!(
        code,
        Cancelled | DeadlineExceeded | Aborted | OutOfRange | Unavailable | DataLoss
    )
}

/// The OTLP specification's retryable HTTP statuses.
fn http_retryable(status: u16) -> bool {
    matches!(status, 429 | 502 | 503 | 504)
}

/// `Retry-After` as seconds (an HTTP date is left to the backoff).
fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let v = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?;
    v.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// The wait before retry number `n` (0-based): doubling from [`FIRST_BACKOFF`], capped,
/// times a jitter in [0.5, 1.5).
fn backoff(n: u32) -> Duration {
    let base = FIRST_BACKOFF
        .saturating_mul(1u32 << n.min(16))
        .min(MAX_BACKOFF);
    base.mul_f64(0.5 + fastrand::f64())
}

fn bad_endpoint(target: &SignalTarget, reason: String) -> ExportError {
    ExportError::Endpoint {
        url: target.url.clone(),
        reason,
    }
}

fn read_file(target: &SignalTarget, path: &std::path::Path) -> Result<Vec<u8>, ExportError> {
    std::fs::read(path)
        .map_err(|e| bad_endpoint(target, format!("cannot read {}: {e}", path.display())))
}

/// The gRPC channel to `target` (TLS as configured), connected lazily.
pub(crate) fn grpc_channel(target: &SignalTarget) -> Result<Channel, ExportError> {
    let mut ep = tonic::transport::Endpoint::from_shared(target.url.clone())
        .map_err(|e| bad_endpoint(target, e.to_string()))?
        .timeout(target.timeout)
        .connect_timeout(target.timeout);
    if let Some(tls) = &target.tls {
        let mut cfg = tonic::transport::ClientTlsConfig::new().ca_certificate(
            tonic::transport::Certificate::from_pem(read_file(target, &tls.ca)?),
        );
        if let Some((cert, key)) = &tls.client {
            cfg = cfg.identity(tonic::transport::Identity::from_pem(
                read_file(target, cert)?,
                read_file(target, key)?,
            ));
        }
        ep = ep
            .tls_config(cfg)
            .map_err(|e| bad_endpoint(target, e.to_string()))?;
    }
    Ok(ep.connect_lazy())
}

/// The configured headers as gRPC metadata.
pub(crate) fn grpc_metadata(target: &SignalTarget) -> Result<MetadataMap, ExportError> {
    let mut metadata = MetadataMap::new();
    for (k, v) in &target.headers {
        let key = MetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes())
            .map_err(|_| ExportError::Header(k.clone()))?;
        let val =
            MetadataValue::try_from(v.as_str()).map_err(|_| ExportError::Header(k.clone()))?;
        metadata.insert(key, val);
    }
    Ok(metadata)
}

/// The configured headers as HTTP headers.
pub(crate) fn configured_http_headers(
    target: &SignalTarget,
) -> Result<reqwest::header::HeaderMap, ExportError> {
    let mut headers = reqwest::header::HeaderMap::new();
    for (k, v) in &target.headers {
        let key = reqwest::header::HeaderName::from_bytes(k.as_bytes())
            .map_err(|_| ExportError::Header(k.clone()))?;
        let val = reqwest::header::HeaderValue::from_str(v)
            .map_err(|_| ExportError::Header(k.clone()))?;
        headers.insert(key, val);
    }
    Ok(headers)
}

/// An HTTP answer, whichever transport brought it.
pub(crate) struct HttpAnswer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: bytes::Bytes,
}

/// OTLP/HTTP: reqwest, or TLS (rustls with the `ring` provider per connection).
pub(crate) enum HttpTransport {
    Plain(reqwest::Client),
    Tls(kvscope_kit::https::TlsClient),
}

impl HttpTransport {
    pub fn new(target: &SignalTarget) -> Result<Self, ExportError> {
        reqwest::Url::parse(&target.url).map_err(|e| bad_endpoint(target, e.to_string()))?;
        Ok(match &target.tls {
            Some(tls) => {
                let client = tls.client.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
                Self::Tls(
                    kvscope_kit::https::TlsClient::new(&tls.ca, client)
                        .map_err(|e| bad_endpoint(target, e))?,
                )
            }
            None => Self::Plain(
                reqwest::Client::builder()
                    .timeout(target.timeout)
                    .build()
                    .map_err(|e| bad_endpoint(target, e.to_string()))?,
            ),
        })
    }

    /// POST `body` to `url`; an error means no answer (not sent, or none came).
    pub(crate) async fn post(
        &self,
        url: &str,
        headers: &reqwest::header::HeaderMap,
        body: bytes::Bytes,
        left: Duration,
    ) -> Result<HttpAnswer, Box<dyn std::error::Error + Send + Sync>> {
        match self {
            Self::Plain(client) => {
                let resp = client
                    .post(url)
                    .headers(headers.clone())
                    .timeout(left)
                    .body(body)
                    .send()
                    .await?;
                let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
                Ok(HttpAnswer {
                    status,
                    headers,
                    body: resp.bytes().await?,
                })
            }
            Self::Tls(client) => {
                let headers: Vec<(&str, &str)> = headers
                    .iter()
                    .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)))
                    .collect();
                let answer = client
                    .request("POST", url, &headers, Some(body.to_vec()), left)
                    .await?;
                Ok(HttpAnswer {
                    status: answer.status,
                    headers: answer.headers,
                    body: answer.body.into(),
                })
            }
        }
    }
}

enum Transport {
    Grpc(Channel),
    Http(HttpTransport),
}

/// One signal's connection to its receiver (metrics; spans go through
/// [`crate::traces::TraceExporter`]).
pub(crate) struct SignalExporter {
    target: SignalTarget,
    transport: Transport,
    metadata: MetadataMap,
    http_headers: reqwest::header::HeaderMap,
}

impl SignalExporter {
    /// Check the target and prepare its connection (gRPC connects lazily, so a receiver
    /// that is down does not stop the process; each export then fails and is counted).
    pub fn new(target: SignalTarget) -> Result<Self, ExportError> {
        // Every OTLP/HTTP request's headers: the body's type and encoding, then the
        // configured ones.
        let mut http_headers = reqwest::header::HeaderMap::new();
        http_headers.insert(
            reqwest::header::CONTENT_TYPE,
            reqwest::header::HeaderValue::from_static("application/x-protobuf"),
        );
        if target.compression == Compression::Gzip {
            http_headers.insert(
                reqwest::header::CONTENT_ENCODING,
                reqwest::header::HeaderValue::from_static("gzip"),
            );
        }
        let (transport, metadata) = match target.protocol {
            Protocol::Grpc => (
                Transport::Grpc(grpc_channel(&target)?),
                grpc_metadata(&target)?,
            ),
            Protocol::HttpProtobuf => {
                http_headers.extend(configured_http_headers(&target)?);
                (
                    Transport::Http(HttpTransport::new(&target)?),
                    MetadataMap::new(),
                )
            }
        };
        Ok(Self {
            target,
            transport,
            metadata,
            http_headers,
        })
    }

    fn send_error(&self, reason: impl std::fmt::Display) -> ExportError {
        ExportError::Send {
            url: self.target.url.clone(),
            reason: reason.to_string(),
        }
    }

    /// Run `attempt` (given the time left) until it succeeds, fails for good, or the
    /// export timeout leaves no room for the next wait; counts the retries.
    async fn with_retries<R, F, Fut>(
        &self,
        retries: &AtomicU64,
        mut attempt: F,
    ) -> Result<R, ExportError>
    where
        F: FnMut(Duration) -> Fut,
        Fut: std::future::Future<Output = Result<R, Failed>>,
    {
        let deadline = Instant::now() + self.target.timeout;
        let mut n = 0;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match attempt(left.max(Duration::from_millis(1))).await {
                Ok(r) => return Ok(r),
                Err(Failed { error, retry: None }) => return Err(error),
                Err(Failed {
                    error,
                    retry: Some(hint),
                }) => {
                    let wait = hint.unwrap_or_else(|| backoff(n));
                    if Instant::now() + wait >= deadline {
                        return Err(error);
                    }
                    tokio::time::sleep(wait).await;
                    add(retries, 1);
                    n += 1;
                }
            }
        }
    }

    async fn post<Resp: prost::Message + Default>(
        &self,
        http: &HttpTransport,
        body: bytes::Bytes,
        left: Duration,
    ) -> Result<Resp, Failed> {
        let answer = http
            .post(&self.target.url, &self.http_headers, body, left)
            .await
            .map_err(|e| Failed {
                // Not sent, or no answer: the receiver is away, try again.
                error: self.send_error(e),
                retry: Some(None),
            })?;
        if !(200..300).contains(&answer.status) {
            return Err(Failed {
                error: self.send_error(format!("HTTP {}", answer.status)),
                retry: http_retryable(answer.status).then(|| retry_after(&answer.headers)),
            });
        }
        // An empty body is a full success.
        Resp::decode(answer.body).map_err(|e| Failed {
            error: self.send_error(format!("bad response: {e}")),
            retry: None,
        })
    }

    /// The HTTP body of `msg` (empty for gRPC, which encodes its own), compressed as
    /// configured.
    fn http_body(&self, msg: &impl prost::Message) -> bytes::Bytes {
        if matches!(self.transport, Transport::Grpc(_)) {
            return bytes::Bytes::new();
        }
        let raw = msg.encode_to_vec();
        bytes::Bytes::from(match self.target.compression {
            Compression::None => raw,
            Compression::Gzip => gzip(&raw),
        })
    }

    fn request<T>(&self, msg: T, left: Duration) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        *r.metadata_mut() = self.metadata.clone();
        r.set_timeout(left);
        r
    }

    fn grpc_failed(&self, s: tonic::Status) -> Failed {
        Failed {
            retry: grpc_retryable(s.code()).then_some(None),
            error: self.send_error(format!("{}: {}", s.code(), s.message())),
        }
    }

    /// Send `req` to the receiver, retrying as the module docs say (each retry counted
    /// in `retries`): over gRPC through `grpc` (given the channel, the compression to
    /// send with and the request), else POSTed.
    async fn send<Req, Resp, F, Fut>(
        &self,
        req: Req,
        retries: &AtomicU64,
        grpc: F,
    ) -> Result<Resp, ExportError>
    where
        Req: prost::Message + Clone,
        Resp: prost::Message + Default,
        F: Fn(Channel, Option<tonic::codec::CompressionEncoding>, tonic::Request<Req>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let body = self.http_body(&req);
        let gzip = (self.target.compression == Compression::Gzip)
            .then_some(tonic::codec::CompressionEncoding::Gzip);
        self.with_retries(retries, |left| {
            let (req, body, grpc) = (req.clone(), body.clone(), &grpc);
            async move {
                match &self.transport {
                    Transport::Grpc(ch) => grpc(ch.clone(), gzip, self.request(req, left))
                        .await
                        .map(|r| r.into_inner())
                        .map_err(|s| self.grpc_failed(s)),
                    Transport::Http(h) => self.post(h, body, left).await,
                }
            }
        })
        .await
    }

    /// Export metrics; returns the number of data points the receiver rejected.
    pub async fn export_metrics(
        &self,
        req: ExportMetricsServiceRequest,
        retries: &AtomicU64,
    ) -> Result<u64, ExportError> {
        let resp: ExportMetricsServiceResponse = self
            .send(req, retries, |ch, gzip, r| async move {
                let mut c = MetricsServiceClient::new(ch);
                if let Some(e) = gzip {
                    c = c.send_compressed(e);
                }
                c.export(r).await
            })
            .await?;
        Ok(resp
            .partial_success
            .map_or(0, |p| p.rejected_data_points.max(0) as u64))
    }
}
