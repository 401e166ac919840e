//! An OTLP receiver for tests: the gRPC MetricsService and TraceService of
//! `opentelemetry-proto` (tonic), and the OTLP/HTTP protobuf endpoints (`/v1/metrics`,
//! `/v1/traces`, axum + prost), on 127.0.0.1 with ephemeral ports. It keeps every
//! request it receives.

use axum::body::Bytes;
use axum::routing::post;
use kvscope_otlp::proto::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use kvscope_otlp::proto::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use kvscope_otlp::proto::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use kvscope_otlp::proto::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use kvscope_otlp::proto::common::v1::{any_value, KeyValue};
use kvscope_otlp::proto::metrics::v1::Metric;
use kvscope_otlp::proto::trace::v1::Span;
use prost::Message as _;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// How a request arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    Grpc,
    Http,
}

/// A request the receiver turns away instead of taking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// gRPC UNAVAILABLE, HTTP 503: retryable.
    Unavailable,
    /// HTTP 429 with `Retry-After` (gRPC: UNAVAILABLE): retryable after it.
    TooManyRequests { retry_after_secs: u64 },
    /// gRPC INVALID_ARGUMENT, HTTP 400: not retryable.
    BadRequest,
}

#[derive(Default)]
pub struct Inbox {
    pub metrics: Mutex<Vec<(Via, ExportMetricsServiceRequest)>>,
    pub traces: Mutex<Vec<(Via, ExportTraceServiceRequest)>>,
    /// Refusals for the next requests, one each, in order; `refuse_all` once empty.
    pub refusals: Mutex<std::collections::VecDeque<Refusal>>,
    pub refuse_all: Mutex<Option<Refusal>>,
    /// Every request, taken or refused.
    pub attempts: std::sync::atomic::AtomicU64,
    /// Requests taken that came gzip-compressed (`grpc-encoding` / `Content-Encoding`).
    pub gzipped: std::sync::atomic::AtomicU64,
}

fn count_gzip(inbox: &Inbox, gzipped: bool) {
    if gzipped {
        inbox
            .gzipped
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// An HTTP body, gunzipped when its headers say so.
fn http_body(headers: &axum::http::HeaderMap, body: Bytes) -> (Vec<u8>, bool) {
    let gz = headers
        .get("content-encoding")
        .is_some_and(|v| v.as_bytes() == b"gzip");
    if !gz {
        return (body.to_vec(), false);
    }
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(body.as_ref()), &mut out)
        .expect("a gzip body");
    (out, true)
}

impl Inbox {
    /// Count the request; the refusal it gets, if any.
    fn refusal(&self) -> Option<Refusal> {
        self.attempts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.refusals
            .lock()
            .unwrap()
            .pop_front()
            .or(*self.refuse_all.lock().unwrap())
    }
}

fn grpc_status(r: Refusal) -> tonic::Status {
    match r {
        Refusal::Unavailable | Refusal::TooManyRequests { .. } => {
            tonic::Status::unavailable("refused by the test")
        }
        Refusal::BadRequest => tonic::Status::invalid_argument("refused by the test"),
    }
}

fn http_refusal(r: Refusal) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    match r {
        Refusal::Unavailable => axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response(),
        Refusal::TooManyRequests { retry_after_secs } => (
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", retry_after_secs.to_string())],
        )
            .into_response(),
        Refusal::BadRequest => axum::http::StatusCode::BAD_REQUEST.into_response(),
    }
}

#[derive(Clone)]
struct Grpc(Arc<Inbox>);

#[tonic::async_trait]
impl MetricsService for Grpc {
    async fn export(
        &self,
        r: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        if let Some(r) = self.0.refusal() {
            return Err(grpc_status(r));
        }
        count_gzip(
            &self.0,
            r.metadata()
                .get("grpc-encoding")
                .is_some_and(|v| v == "gzip"),
        );
        self.0
            .metrics
            .lock()
            .unwrap()
            .push((Via::Grpc, r.into_inner()));
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl TraceService for Grpc {
    async fn export(
        &self,
        r: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        if let Some(r) = self.0.refusal() {
            return Err(grpc_status(r));
        }
        count_gzip(
            &self.0,
            r.metadata()
                .get("grpc-encoding")
                .is_some_and(|v| v == "gzip"),
        );
        self.0
            .traces
            .lock()
            .unwrap()
            .push((Via::Grpc, r.into_inner()));
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

pub struct Receiver {
    pub inbox: Arc<Inbox>,
    /// gRPC endpoint, e.g. `http://127.0.0.1:PORT`.
    pub grpc_url: String,
    /// OTLP/HTTP base, e.g. `http://127.0.0.1:PORT` (`/v1/…` appended by the exporter).
    pub http_url: String,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn protobuf(body: Vec<u8>) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    ([("content-type", "application/x-protobuf")], body).into_response()
}

/// Server TLS for a receiver: its certificate and key (PEM files), and, for mutual TLS,
/// the CA its clients' certificates must chain to.
pub struct ServerTls {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    pub client_ca: Option<std::path::PathBuf>,
}

/// axum's listener over TLS: each accepted connection goes through the handshake
/// (a failed one is dropped and the next awaited).
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else {
                continue;
            };
            if let Ok(tls) = self.acceptor.accept(tcp).await {
                return (tls, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

fn rustls_server(tls: &ServerTls) -> rustls::ServerConfig {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&tls.cert)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(&tls.key).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match &tls.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca).unwrap() {
                roots.add(c.unwrap()).unwrap();
            }
            builder.with_client_cert_verifier(
                rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .unwrap(),
            )
        }
    };
    let mut cfg = builder.with_single_cert(chain, key).unwrap();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    cfg
}

impl Receiver {
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// A receiver on `https://` (both its gRPC and HTTP endpoints) with `tls`.
    pub async fn start_tls(tls: ServerTls) -> Self {
        Self::start_with(Some(tls)).await
    }

    async fn start_with(tls: Option<ServerTls>) -> Self {
        let inbox = Arc::new(Inbox::default());
        let incoming = tonic::transport::server::TcpIncoming::bind("127.0.0.1:0".parse().unwrap())
            .expect("bind the gRPC receiver");
        let scheme = if tls.is_some() { "https" } else { "http" };
        let grpc_url = format!("{scheme}://{}", incoming.local_addr().unwrap());
        let svc = Grpc(inbox.clone());
        let mut server = tonic::transport::Server::builder();
        if let Some(t) = &tls {
            let mut cfg = tonic::transport::ServerTlsConfig::new().identity(
                tonic::transport::Identity::from_pem(
                    std::fs::read(&t.cert).unwrap(),
                    std::fs::read(&t.key).unwrap(),
                ),
            );
            if let Some(ca) = &t.client_ca {
                cfg = cfg.client_ca_root(tonic::transport::Certificate::from_pem(
                    std::fs::read(ca).unwrap(),
                ));
            }
            server = server.tls_config(cfg).unwrap();
        }
        let grpc = tokio::spawn(async move {
            server
                .add_service(
                    MetricsServiceServer::new(svc.clone())
                        .accept_compressed(tonic::codec::CompressionEncoding::Gzip),
                )
                .add_service(
                    TraceServiceServer::new(svc)
                        .accept_compressed(tonic::codec::CompressionEncoding::Gzip),
                )
                .serve_with_incoming(incoming)
                .await
                .expect("the gRPC receiver runs");
        });
        let (m, t) = (inbox.clone(), inbox.clone());
        let app = axum::Router::new()
            .route(
                "/v1/metrics",
                post(move |headers: axum::http::HeaderMap, body: Bytes| {
                    let m = m.clone();
                    async move {
                        if let Some(r) = m.refusal() {
                            return http_refusal(r);
                        }
                        let (body, gz) = http_body(&headers, body);
                        count_gzip(&m, gz);
                        let req = ExportMetricsServiceRequest::decode(body.as_slice())
                            .expect("a protobuf ExportMetricsServiceRequest");
                        m.metrics.lock().unwrap().push((Via::Http, req));
                        protobuf(ExportMetricsServiceResponse::default().encode_to_vec())
                    }
                }),
            )
            .route(
                "/v1/traces",
                post(move |headers: axum::http::HeaderMap, body: Bytes| {
                    let t = t.clone();
                    async move {
                        if let Some(r) = t.refusal() {
                            return http_refusal(r);
                        }
                        let (body, gz) = http_body(&headers, body);
                        count_gzip(&t, gz);
                        let req = ExportTraceServiceRequest::decode(body.as_slice())
                            .expect("a protobuf ExportTraceServiceRequest");
                        t.traces.lock().unwrap().push((Via::Http, req));
                        protobuf(ExportTraceServiceResponse::default().encode_to_vec())
                    }
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http_url = format!("{scheme}://{}", listener.local_addr().unwrap());
        let http = match &tls {
            None => tokio::spawn(async move {
                axum::serve(listener, app)
                    .await
                    .expect("the HTTP receiver runs");
            }),
            Some(t) => {
                let listener = TlsListener {
                    tcp: listener,
                    acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(rustls_server(t))),
                };
                tokio::spawn(async move {
                    axum::serve(listener, app)
                        .await
                        .expect("the HTTPS receiver runs");
                })
            }
        };
        Self {
            inbox,
            grpc_url,
            http_url,
            tasks: vec![grpc, http],
        }
    }

    /// Every metrics export from `service` (by `service.name`): (via, resource
    /// attributes, time of its data, metrics).
    pub fn metric_exports(&self, service: &str) -> Vec<MetricExport> {
        self.inbox
            .metrics
            .lock()
            .unwrap()
            .iter()
            .flat_map(|(via, r)| r.resource_metrics.iter().map(move |rm| (*via, rm)))
            .map(|(via, rm)| {
                let resource = string_attrs(&rm.resource.as_ref().unwrap().attributes);
                let metrics: Vec<Metric> = rm
                    .scope_metrics
                    .iter()
                    .flat_map(|s| s.metrics.clone())
                    .collect();
                MetricExport {
                    via,
                    time_ns: metrics.iter().filter_map(point_time).max().unwrap_or(0),
                    resource,
                    metrics,
                }
            })
            .filter(|e| e.resource.get("service.name").map(String::as_str) == Some(service))
            .collect()
    }

    /// Every span from `service`, with its resource attributes and how it came.
    pub fn spans(&self, service: &str) -> Vec<(Via, BTreeMap<String, String>, Span)> {
        self.inbox
            .traces
            .lock()
            .unwrap()
            .iter()
            .flat_map(|(via, r)| r.resource_spans.iter().map(move |rs| (*via, rs)))
            .filter_map(|(via, rs)| {
                let res = string_attrs(&rs.resource.as_ref()?.attributes);
                (res.get("service.name").map(String::as_str) == Some(service)).then(|| {
                    rs.scope_spans
                        .iter()
                        .flat_map(|s| s.spans.clone())
                        .map(|s| (via, res.clone(), s))
                        .collect::<Vec<_>>()
                })
            })
            .flatten()
            .collect()
    }
}

pub struct MetricExport {
    pub via: Via,
    pub time_ns: u64,
    pub resource: BTreeMap<String, String>,
    pub metrics: Vec<Metric>,
}

fn point_time(m: &Metric) -> Option<u64> {
    use kvscope_otlp::proto::metrics::v1::metric::Data;
    match m.data.as_ref()? {
        Data::Sum(s) => s.data_points.first().map(|p| p.time_unix_nano),
        Data::Gauge(g) => g.data_points.first().map(|p| p.time_unix_nano),
        Data::Histogram(h) => h.data_points.first().map(|p| p.time_unix_nano),
        _ => None,
    }
}

/// Attributes as text (ints and bools printed).
pub fn string_attrs(kv: &[KeyValue]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|a| {
            let v = match a.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(any_value::Value::StringValue(s)) => s.clone(),
                Some(any_value::Value::IntValue(i)) => i.to_string(),
                Some(any_value::Value::BoolValue(b)) => b.to_string(),
                Some(any_value::Value::DoubleValue(d)) => d.to_string(),
                other => format!("{other:?}"),
            };
            (a.key.clone(), v)
        })
        .collect()
}
