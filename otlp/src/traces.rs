//! Spans go out through `opentelemetry-otlp`'s span exporter and its transports: tonic
//! over gRPC, and over OTLP/HTTP the exporter's request through an [`HttpClient`] of
//! kvscope's (plain, or TLS over `kvscope_kit::https`). The exporter does the OTLP
//! specification's retries (its retryable gRPC codes and HTTP 429/502/503/504, a
//! connection that failed; exponential backoff with jitter; HTTP `Retry-After` and gRPC
//! `RetryInfo` honoured) and gzip; kvscope gives each attempt its headers and what is
//! left of the export timeout, so an export and its retries end within it. kvscope
//! hands it the spans it built ([`to_span_data`]) and keeps counting what the SDK would
//! only log: every attempt passes a gRPC interceptor or the HTTP client, so retries are
//! counted; over HTTP the client reads the receiver's partial success from the answer.
//! Over gRPC the exporter reads the answer itself and only logs a partial success: spans
//! rejected that way are in the log (`TonicTracesClient.PartialSuccess`), not counted.
//!
//! Metrics cannot take this road: the SDK's metric data (`ResourceMetrics` and below)
//! has no public constructors, so only its own instruments can fill it, and no
//! instrument accepts the collector's pre-aggregated NIXL histogram buckets. They are
//! sent by [`crate::export::SignalExporter`], with the same retry rules.

use crate::config::{Compression, Protocol, SignalTarget};
use crate::export::{add, ExportError};
use opentelemetry::trace::{
    Event, Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{Array, KeyValue, StringValue, Value};
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{span, status, Span};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};
use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Retries until the export timeout says stop (the exporter checks it before each).
const RETRY_POLICY_MAX_RETRIES: usize = usize::MAX;

/// The span exporter of one process, and what it counted.
pub(crate) struct TraceExporter {
    inner: opentelemetry_otlp::SpanExporter,
    url: String,
    /// The export timeout: every attempt of an export, and the waits between, in it.
    timeout: Duration,
    attempts: Arc<Attempts>,
}

/// What every attempt of an export shares with the exporter: counted as each goes out,
/// sent within what is left of the export's timeout, with kvscope's headers (the SDK
/// reads the OTLP header variables again itself and would let a general one win over a
/// signal's; these are set last, as `config` merged them).
#[derive(Default)]
struct Attempts {
    /// Requests sent (first tries and retries).
    sent: AtomicU64,
    /// Spans the receiver rejected in a partial success (OTLP/HTTP).
    rejected: AtomicU64,
    /// When the export under way must end.
    deadline: Mutex<Option<Instant>>,
    /// Why the last attempt got no answer (the SDK keeps only "network error").
    last_error: Mutex<Option<String>>,
}

impl Attempts {
    /// Count an attempt; the time it may take.
    fn start(&self) -> Duration {
        self.sent.fetch_add(1, Ordering::Relaxed);
        let deadline = *self.deadline.lock().unwrap_or_else(|e| e.into_inner());
        deadline.map_or(Duration::from_secs(10), |d| {
            d.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        })
    }
}

impl std::fmt::Debug for TraceExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceExporter")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl TraceExporter {
    /// The exporter for `target`, its spans under `resource` (gRPC connects lazily, so
    /// a receiver that is down does not stop the process).
    pub fn new(target: &SignalTarget, resource: &Resource) -> Result<Self, ExportError> {
        let bad = |reason: String| ExportError::Endpoint {
            url: target.url.clone(),
            reason,
        };
        let attempts = Arc::new(Attempts::default());
        let retry = opentelemetry_otlp::RetryPolicy::default()
            .with_max_retries(RETRY_POLICY_MAX_RETRIES)
            .with_initial_delay(crate::export::FIRST_BACKOFF)
            .with_max_delay(crate::export::MAX_BACKOFF)
            .with_max_jitter(crate::export::FIRST_BACKOFF);
        let gzip = target.compression == Compression::Gzip;
        let mut inner = match target.protocol {
            Protocol::Grpc => {
                let counted = attempts.clone();
                let metadata = crate::export::grpc_metadata(target)?;
                let mut b = opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_channel(crate::export::grpc_channel(target)?)
                    .with_timeout(target.timeout)
                    .with_retry_policy(retry)
                    .with_interceptor(move |mut req: tonic::Request<()>| {
                        req.set_timeout(counted.start());
                        for kv in metadata.iter() {
                            if let tonic::metadata::KeyAndValueRef::Ascii(k, v) = kv {
                                req.metadata_mut().insert(k.clone(), v.clone());
                            }
                        }
                        Ok(req)
                    });
                if gzip {
                    b = b.with_compression(opentelemetry_otlp::Compression::Gzip);
                }
                b.build().map_err(|e| bad(e.to_string()))?
            }
            Protocol::HttpProtobuf => {
                let client = CountingClient {
                    transport: crate::export::HttpTransport::new(target)?,
                    headers: crate::export::configured_http_headers(target)?,
                    attempts: attempts.clone(),
                };
                let mut b = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_http_client(client)
                    .with_endpoint(target.url.clone())
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_timeout(target.timeout)
                    .with_retry_policy(retry);
                if gzip {
                    b = b.with_compression(opentelemetry_otlp::Compression::Gzip);
                }
                b.build().map_err(|e| bad(e.to_string()))?
            }
        };
        inner.set_resource(&sdk_resource(resource));
        Ok(Self {
            inner,
            url: target.url.clone(),
            timeout: target.timeout,
            attempts,
        })
    }

    /// Export `spans` within the export timeout (its retries included), counting the
    /// requests sent again in `retries`; returns the number the receiver rejected (as
    /// far as it is known, see the module docs).
    pub async fn export(&self, spans: Vec<Span>, retries: &AtomicU64) -> Result<u64, ExportError> {
        let a = &self.attempts;
        let before = a.sent.load(Ordering::Relaxed);
        a.rejected.store(0, Ordering::Relaxed);
        *a.last_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *a.deadline.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + self.timeout);
        let result = self
            .inner
            .export(spans.into_iter().map(to_span_data).collect())
            .await;
        let sent = a.sent.load(Ordering::Relaxed).saturating_sub(before);
        add(retries, sent.saturating_sub(1));
        result.map_err(|e| ExportError::Send {
            url: self.url.clone(),
            reason: match a
                .last_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                Some(why) => format!("{e}: {why}"),
                None => e.to_string(),
            },
        })?;
        Ok(a.rejected.load(Ordering::Relaxed))
    }
}

/// The exporter's OTLP/HTTP requests, sent by kvscope's transport: each counted, each
/// answer's partial success read.
struct CountingClient {
    transport: crate::export::HttpTransport,
    /// The configured headers, set over the exporter's.
    headers: reqwest::header::HeaderMap,
    attempts: Arc<Attempts>,
}

impl std::fmt::Debug for CountingClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CountingClient")
    }
}

#[async_trait::async_trait]
impl HttpClient for CountingClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let left = self.attempts.start();
        let (parts, body) = request.into_parts();
        let mut headers = parts.headers;
        for (k, v) in &self.headers {
            headers.insert(k.clone(), v.clone());
        }
        let answer = match self
            .transport
            .post(&parts.uri.to_string(), &headers, body, left)
            .await
        {
            Ok(a) => a,
            Err(e) => {
                *self
                    .attempts
                    .last_error
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                return Err(e);
            }
        };
        if (200..300).contains(&answer.status) {
            use prost::Message as _;
            // An empty or unreadable body is a full success as far as anyone can know.
            if let Ok(r) = ExportTraceServiceResponse::decode(answer.body.as_ref()) {
                let n = r
                    .partial_success
                    .map_or(0, |p| p.rejected_spans.max(0) as u64);
                self.attempts.rejected.fetch_add(n, Ordering::Relaxed);
            }
        }
        let mut resp = Response::builder().status(answer.status);
        if let Some(h) = resp.headers_mut() {
            *h = answer.headers;
        }
        Ok(resp.body(answer.body)?)
    }
}

fn value(v: Option<AnyValue>) -> Value {
    match v.and_then(|v| v.value) {
        Some(any_value::Value::StringValue(s)) => Value::String(s.into()),
        Some(any_value::Value::BoolValue(b)) => Value::Bool(b),
        Some(any_value::Value::IntValue(i)) => Value::I64(i),
        Some(any_value::Value::DoubleValue(d)) => Value::F64(d),
        Some(any_value::Value::ArrayValue(a)) => {
            let items: Vec<Option<any_value::Value>> =
                a.values.into_iter().map(|v| v.value).collect();
            let strings = || {
                items
                    .iter()
                    .map(|v| match v {
                        Some(any_value::Value::StringValue(s)) => {
                            Some(StringValue::from(s.clone()))
                        }
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()
            };
            let ints = || {
                items
                    .iter()
                    .map(|v| match v {
                        Some(any_value::Value::IntValue(i)) => Some(*i),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()
            };
            if let Some(s) = strings() {
                Value::Array(Array::String(s))
            } else if let Some(i) = ints() {
                Value::Array(Array::I64(i))
            } else {
                Value::String(format!("{items:?}").into())
            }
        }
        // kvscope's spans carry none of these; kept readable rather than lost.
        Some(other) => Value::String(format!("{other:?}").into()),
        None => Value::String("".into()),
    }
}

fn attributes(kvs: Vec<opentelemetry_proto::tonic::common::v1::KeyValue>) -> Vec<KeyValue> {
    kvs.into_iter()
        .map(|kv| KeyValue::new(kv.key, value(kv.value)))
        .collect()
}

fn time(ns: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(ns)
}

fn trace_id(b: &[u8]) -> TraceId {
    b.try_into().map_or(TraceId::INVALID, TraceId::from_bytes)
}

fn span_id(b: &[u8]) -> SpanId {
    b.try_into().map_or(SpanId::INVALID, SpanId::from_bytes)
}

/// A span's flags word holds the W3C trace flags (bits 0–7), then whether its parent
/// is in another process: bit 8 says bit 9 is set, bit 9 says it is.
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;
/// The flags of a span whose parent is another process's (the router's span).
pub const PARENT_IS_REMOTE: u32 = HAS_IS_REMOTE | IS_REMOTE;

/// A span context; `exported` for a span kvscope sends (sampled, whatever its word
/// says), not for a span it links to (its flags as given).
fn context(trace: &[u8], span: &[u8], state: &str, flags: u32, exported: bool) -> SpanContext {
    let trace_flags = TraceFlags::new(flags as u8);
    SpanContext::new(
        trace_id(trace),
        span_id(span),
        if exported {
            trace_flags.with_sampled(true)
        } else {
            trace_flags
        },
        flags & HAS_IS_REMOTE != 0 && flags & IS_REMOTE != 0,
        state.parse().unwrap_or_else(|_| TraceState::default()),
    )
}

/// A span kvscope built, as the SDK's exporter takes it (what it then sends is the
/// same span: ids, times, attributes, events, links, status).
pub(crate) fn to_span_data(s: Span) -> SpanData {
    let kind = match span::SpanKind::try_from(s.kind) {
        Ok(span::SpanKind::Server) => SpanKind::Server,
        Ok(span::SpanKind::Client) => SpanKind::Client,
        Ok(span::SpanKind::Producer) => SpanKind::Producer,
        Ok(span::SpanKind::Consumer) => SpanKind::Consumer,
        _ => SpanKind::Internal,
    };
    let status = match s.status {
        Some(st) if st.code == status::StatusCode::Error as i32 => Status::Error {
            description: Cow::Owned(st.message),
        },
        Some(st) if st.code == status::StatusCode::Ok as i32 => Status::Ok,
        _ => Status::Unset,
    };
    SpanData {
        span_context: context(&s.trace_id, &s.span_id, &s.trace_state, s.flags, true),
        parent_span_id: span_id(&s.parent_span_id),
        parent_span_is_remote: s.flags & HAS_IS_REMOTE != 0 && s.flags & IS_REMOTE != 0,
        span_kind: kind,
        name: Cow::Owned(s.name),
        start_time: time(s.start_time_unix_nano),
        end_time: time(s.end_time_unix_nano),
        attributes: attributes(s.attributes),
        dropped_attributes_count: s.dropped_attributes_count,
        events: {
            let mut e = SpanEvents::default();
            e.events = s
                .events
                .into_iter()
                .map(|ev| {
                    Event::new(
                        ev.name,
                        time(ev.time_unix_nano),
                        attributes(ev.attributes),
                        ev.dropped_attributes_count,
                    )
                })
                .collect();
            e.dropped_count = s.dropped_events_count;
            e
        },
        links: {
            let mut l = SpanLinks::default();
            l.links = s
                .links
                .into_iter()
                .map(|ln| {
                    Link::new(
                        context(&ln.trace_id, &ln.span_id, &ln.trace_state, ln.flags, false),
                        attributes(ln.attributes),
                        ln.dropped_attributes_count,
                    )
                })
                .collect();
            l.dropped_count = s.dropped_links_count;
            l
        },
        status,
        instrumentation_scope: opentelemetry::InstrumentationScope::builder("kvscope")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build(),
    }
}

fn sdk_resource(r: &Resource) -> opentelemetry_sdk::Resource {
    opentelemetry_sdk::Resource::builder_empty()
        .with_attributes(attributes(r.attributes.clone()))
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{attr_bool, attr_int, attr_str};
    use opentelemetry_proto::tonic::common::v1::ArrayValue;
    use opentelemetry_proto::tonic::trace::v1::Status as ProtoStatus;

    fn any(v: any_value::Value) -> Option<AnyValue> {
        Some(AnyValue { value: Some(v) })
    }

    /// What the SDK's exporter sends for a span is the span kvscope built: converted to
    /// the SDK's form and back by the SDK's own encoder, every field is as it was
    /// (the SDK always writes a status and the sampled bit, which kvscope's spans mean).
    #[test]
    fn a_span_reaches_the_wire_as_kvscope_built_it() {
        let built = Span {
            trace_id: (1..=16).collect(),
            span_id: (1..=8).collect(),
            parent_span_id: vec![9; 8],
            flags: PARENT_IS_REMOTE,
            name: "nixl.transfer".into(),
            kind: span::SpanKind::Client as i32,
            start_time_unix_nano: 1_764_000_000_123_456_789,
            end_time_unix_nano: 1_764_000_000_223_456_789,
            attributes: vec![
                attr_str("kvscope.request_id", "req-1"),
                attr_int("nixl.bytes", 1_048_576),
                attr_bool("kvscope.spill", true),
                opentelemetry_proto::tonic::common::v1::KeyValue {
                    key: "kvscope.ratio".into(),
                    value: any(any_value::Value::DoubleValue(0.25)),
                    ..Default::default()
                },
                opentelemetry_proto::tonic::common::v1::KeyValue {
                    key: "kvscope.workers".into(),
                    value: any(any_value::Value::ArrayValue(ArrayValue {
                        values: vec![
                            AnyValue {
                                value: Some(any_value::Value::StringValue("a".into())),
                            },
                            AnyValue {
                                value: Some(any_value::Value::StringValue("b".into())),
                            },
                        ],
                    })),
                    ..Default::default()
                },
            ],
            events: vec![span::Event {
                time_unix_nano: 1_764_000_000_200_000_000,
                name: "posted".into(),
                attributes: vec![attr_int("nixl.descs", 4)],
                dropped_attributes_count: 0,
            }],
            links: vec![span::Link {
                trace_id: vec![7; 16],
                span_id: vec![8; 8],
                attributes: vec![attr_str("kvscope.link", "spill_verdict")],
                // Not sampled, not remote: sent as it is.
                flags: 0x100,
                ..Default::default()
            }],
            status: Some(ProtoStatus {
                message: "NIXL_ERR_REMOTE_DISCONNECT".into(),
                code: status::StatusCode::Error as i32,
            }),
            ..Default::default()
        };
        let sent = Span::from(to_span_data(built.clone()));
        let expected = Span {
            flags: built.flags | 0x01,
            ..built.clone()
        };
        assert_eq!(sent, expected);

        // No parent, no status: a root span, unset status, its parent not remote.
        let root = Span {
            parent_span_id: vec![],
            flags: 0,
            status: None,
            links: vec![],
            events: vec![],
            ..built
        };
        let sent = Span::from(to_span_data(root.clone()));
        assert_eq!(sent.parent_span_id, Vec::<u8>::new());
        assert_eq!(sent.flags, HAS_IS_REMOTE | 0x01);
        assert_eq!(sent.status, Some(ProtoStatus::default()));
        assert_eq!(sent.attributes, root.attributes);
    }
}
