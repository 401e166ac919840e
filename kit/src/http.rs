//! Every daemon's HTTP listener: what a port open to a node's network must bound.
//!
//! A client that opens connections and sends nothing, sends its headers a byte at a
//! time, or sends a body slowly must not hold a connection (or its memory) for long,
//! and many of them must not use up the process's file descriptors: an idle or slow
//! connection is closed after [`ServerLimits::header_timeout`] waiting for a request's
//! headers (also between keep-alive requests), a request that takes longer than
//! [`ServerLimits::request_timeout`] to be read and answered gets 408 and its
//! connection is closed, headers are bounded in size, and at most
//! [`ServerLimits::max_connections`] connections are served at once (more are closed
//! as soon as they are accepted, counted). What each endpoint reads of a body is its own
//! limit (a writing endpoint checks its token before it reads one).

use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The bounds of one listener.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServerLimits {
    /// How long a connection may wait for a request's whole headers (the first, and
    /// each next one on a kept-alive connection).
    pub header_timeout: Duration,
    /// How long a request may take, its body read and its answer made.
    pub request_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
    /// The most a request's headers may take.
    pub max_header_bytes: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
            max_connections: 256,
            max_header_bytes: 16 * 1024,
        }
    }
}

/// What a listener refused, for `/metrics`.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections closed at once: as many were served already.
    pub connections_refused: AtomicU64,
    /// Requests that took longer than the request timeout (answered 408, closed).
    pub requests_timed_out: AtomicU64,
}

impl ServerStats {
    /// Its counters as `<prefix>_http_connections_refused_total` and
    /// `<prefix>_http_requests_timed_out_total`.
    pub fn write_prometheus(&self, out: &mut crate::prom::Exposition, prefix: &str) {
        out.single_counter(
            &format!("{prefix}_http_connections_refused"),
            "HTTP connections closed at once: the listener served as many as it may already.",
            "",
            self.connections_refused.load(Ordering::Relaxed),
        );
        out.single_counter(
            &format!("{prefix}_http_requests_timed_out"),
            "HTTP requests not read and answered within the request timeout (408, closed).",
            "",
            self.requests_timed_out.load(Ordering::Relaxed),
        );
    }
}

/// Serve `service` (an axum `Router`, or any tower service of `Request<Incoming>`) on
/// `listener` within the [`ServerLimits`], until the task is dropped.
pub async fn serve<S, B>(listener: TcpListener, service: S, stats: Arc<ServerStats>)
where
    S: tower_service::Service<Request<Incoming>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let limits = ServerLimits::default();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192))
        .keep_alive(true);
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(a) => a,
            // Out of descriptors or the like: wait a moment rather than spin.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            stats.connections_refused.fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        let (service, stats, http) = (service.clone(), stats.clone(), http.clone());
        let timeout = limits.request_timeout;
        tokio::spawn(async move {
            let handle = hyper::service::service_fn(move |req: Request<Incoming>| {
                answer(service.clone(), req, timeout, stats.clone())
            });
            let _ = http.serve_connection(TokioIo::new(stream), handle).await;
            drop(slot);
        });
    }
}

/// One request through `service`, within `timeout`.
async fn answer<S, B>(
    mut service: S,
    req: Request<Incoming>,
    timeout: Duration,
    stats: Arc<ServerStats>,
) -> Result<Response<UnsyncBoxBody<Bytes, BoxError>>, BoxError>
where
    S: tower_service::Service<Request<Incoming>, Response = Response<B>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    match tokio::time::timeout(timeout, service.call(req)).await {
        Ok(Ok(resp)) => Ok(resp.map(|b| b.map_err(|e| -> BoxError { e.into() }).boxed_unsync())),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => {
            stats.requests_timed_out.fetch_add(1, Ordering::Relaxed);
            Ok(timed_out())
        }
    }
}

fn timed_out() -> Response<UnsyncBoxBody<Bytes, BoxError>> {
    let mut r = Response::new(
        Full::new(Bytes::from_static(b"request timed out\n"))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *r.status_mut() = StatusCode::REQUEST_TIMEOUT;
    r.headers_mut().insert(
        hyper::header::CONNECTION,
        hyper::header::HeaderValue::from_static("close"),
    );
    r
}
