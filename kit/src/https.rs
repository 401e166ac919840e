//! HTTPS for what needs it (the Kubernetes API server, etcd with TLS, an OTLP/HTTP
//! receiver): one request per connection over rustls, HTTP/1.1, trusting only the CA given and, for
//! mutual TLS, presenting a client certificate. The `ring` provider is set on each
//! configuration rather than installed process-wide, so nothing else in a process that
//! links this crate needs a TLS provider installed (the workspace's `reqwest` is built
//! without TLS and stays that way).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// A TLS client configuration: whom to trust, and who we are.
#[derive(Clone, Debug)]
pub struct TlsClient {
    config: Arc<rustls::ClientConfig>,
}

/// An answer: its status, its headers and its whole body.
pub struct Answer {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Vec<u8>,
}

impl TlsClient {
    /// Trust the certificates in the PEM file `ca`; with `identity` (certificate chain,
    /// key; PEM files), present it when the server asks (mutual TLS).
    pub fn new(ca: &Path, identity: Option<(&Path, &Path)>) -> Result<Self, String> {
        let pem = std::fs::read(ca).map_err(|e| format!("reading the CA {}: {e}", ca.display()))?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| format!("the CA file {}: {e}", ca.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("the CA file {}: {e}", ca.display()))?;
        }
        if roots.is_empty() {
            return Err(format!("no certificate in the CA file {}", ca.display()));
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                    .and_then(|certs| certs.collect())
                    .map_err(|e| format!("the client certificate {}: {e}", cert.display()))?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("the client key {}: {e}", key.display()))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| format!("the client certificate {}: {e}", cert.display()))?
            }
        };
        Ok(Self {
            config: Arc::new(config),
        })
    }

    /// `method` `url` (https only) with `headers` and, when given, a body; the whole
    /// answer, within `timeout`.
    pub async fn request(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<Answer, String> {
        let uri: hyper::Uri = url.parse().map_err(|e| format!("bad URL {url}: {e}"))?;
        if uri.scheme_str() != Some("https") {
            return Err(format!("{url}: not an https:// URL"));
        }
        let host = uri
            .host()
            .unwrap_or_default()
            .trim_matches(['[', ']'])
            .to_string();
        let port = uri.port_u16().unwrap_or(443);
        let name = ServerName::try_from(host.clone()).map_err(|e| format!("{host}: {e}"))?;
        let exchange = async {
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
                .await
                .map_err(|e| format!("connecting: {e}"))?;
            let stream = tokio_rustls::TlsConnector::from(self.config.clone())
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS: {e}"))?;
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .map_err(|e| format!("HTTP: {e}"))?;
            let conn = tokio::spawn(conn);
            let mut req = hyper::Request::builder()
                .method(method)
                .uri(uri.path_and_query().map_or("/", |p| p.as_str()))
                .header(hyper::header::HOST, format!("{host}:{port}"));
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let req = req
                .body(http_body_util::Full::new(hyper::body::Bytes::from(
                    body.unwrap_or_default(),
                )))
                .map_err(|e| format!("request: {e}"))?;
            let res = sender
                .send_request(req)
                .await
                .map_err(|e| format!("HTTP: {e}"))?;
            let status = res.status().as_u16();
            let headers = res.headers().clone();
            let body = http_body_util::BodyExt::collect(res.into_body())
                .await
                .map_err(|e| format!("reading the answer: {e}"))?
                .to_bytes()
                .to_vec();
            conn.abort();
            Ok(Answer {
                status,
                headers,
                body,
            })
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| format!("no answer in {timeout:?}"))?
    }
}
