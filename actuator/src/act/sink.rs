//! Sending migration directives: `POST` to the configured endpoint with an
//! `Idempotency-Key` header, bounded retries with the same key, never once the actuator
//! has left LIVE.

use crate::act::directive::{DirectiveOutcome, MigrationDirective};
use crate::config::DirectiveConfig;
use std::time::Duration;
use tokio::sync::watch;

pub use kvscope_wire::directive::IDEMPOTENCY_HEADER;

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("directives need directives.url")]
    NoUrl,
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("cannot read directives.token_file {path}: {source}")]
    Token {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

#[derive(Debug, Clone)]
pub struct DirectiveSink {
    http: reqwest::Client,
    url: String,
    token: Option<String>,
    max_retries: u32,
    backoff: Duration,
}

impl DirectiveSink {
    pub fn new(cfg: &DirectiveConfig) -> Result<Self, SinkError> {
        let url = cfg.url.clone().ok_or(SinkError::NoUrl)?;
        let token = match &cfg.token_file {
            Some(p) => Some(crate::config::read_token(p).map_err(|e| match e {
                crate::config::ConfigError::TokenFile { path, source } => {
                    SinkError::Token { path, source }
                }
                other => SinkError::Token {
                    path: p.clone(),
                    source: std::io::Error::other(other.to_string()),
                },
            })?),
            None => None,
        };
        Ok(Self {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs_f64(cfg.timeout_secs))
                .build()?,
            url,
            token,
            max_retries: cfg.max_retries,
            backoff: Duration::from_millis(cfg.retry_backoff_ms),
        })
    }

    /// Send `d`, retrying transport errors, 5xx and 429 up to `max_retries` times.
    /// Before every attempt `live` must still be true, else the directive is abandoned.
    pub async fn send(
        &self,
        d: &MigrationDirective,
        live: &watch::Receiver<bool>,
    ) -> DirectiveOutcome {
        let mut last_error = String::new();
        for attempt in 1..=self.max_retries + 1 {
            if attempt > 1 {
                tokio::time::sleep(self.backoff * (attempt - 1)).await;
            }
            if !*live.borrow() {
                return DirectiveOutcome::Abandoned;
            }
            let mut req = self
                .http
                .post(&self.url)
                .header(IDEMPOTENCY_HEADER, &d.idempotency_key)
                .json(d);
            if let Some(t) = &self.token {
                req = req.bearer_auth(t);
            }
            match req.send().await {
                Ok(resp) => {
                    let status = resp.status();
                    if status.is_success() {
                        return DirectiveOutcome::Accepted {
                            status: status.as_u16(),
                            attempts: attempt,
                        };
                    }
                    if status == reqwest::StatusCode::CONFLICT {
                        return DirectiveOutcome::Duplicate { attempts: attempt };
                    }
                    let body = resp.text().await.unwrap_or_default();
                    let body: String = body.chars().take(300).collect();
                    if status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS
                    {
                        last_error = format!("{status}: {body}");
                        continue;
                    }
                    return DirectiveOutcome::Rejected {
                        status: status.as_u16(),
                        attempts: attempt,
                        body,
                    };
                }
                Err(e) => last_error = e.to_string(),
            }
        }
        DirectiveOutcome::Failed {
            attempts: self.max_retries + 1,
            error: last_error,
        }
    }
}
