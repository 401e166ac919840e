//! The actuator as a daemon: its API server, the tick loop that reads the collector and
//! evaluates, readiness from the collector's reachability, and a clean stop on SIGTERM.

use super::runtime::{Actuator, RuntimeError};
use crate::config::ActuatorConfig;
use crate::decide::input::CollectorClient;
use kvscope_kit::clock::now_ns;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;
use tracing::{info, warn};

/// The readiness check of the collector reads.
const COLLECTOR_CHECK: &str = "collector";

/// Run until SIGINT/SIGTERM: evaluate every `interval_secs`, serve the API.
pub async fn serve(cfg: ActuatorConfig, api_token: Option<String>) -> Result<(), RuntimeError> {
    let client = CollectorClient::new(
        &cfg.collector_url,
        Duration::from_secs_f64(cfg.collector_timeout_secs),
        cfg.window_limit,
        cfg.verdict_limit,
    )?;
    let interval = Duration::from_secs_f64(cfg.interval_secs);
    let api = cfg.api.clone();
    let actuator = Arc::new(Mutex::new(Actuator::new(cfg, now_ns())?));
    actuator.lock().await.start(now_ns()).await;
    // Ready once it reads the collector: before that it can only hold DRY.
    let health = Arc::new(kvscope_kit::Health::new());
    health.fail(COLLECTOR_CHECK, "first read of the collector pending");
    let server = if api.enabled {
        let listener = tokio::net::TcpListener::bind(api.listen)
            .await
            .map_err(|source| RuntimeError::Listen {
                addr: api.listen,
                source,
            })?;
        if !api.listen.ip().is_loopback() {
            warn!(listen = %api.listen, "The actuator API listens beyond loopback.");
        }
        let token = api_token.unwrap_or_default();
        let stats = Arc::new(kvscope_kit::http::ServerStats::default());
        let app =
            crate::daemon::api::router(actuator.clone(), health.clone(), token, stats.clone());
        info!(listen = %listener.local_addr().map_err(|source| RuntimeError::Listen { addr: api.listen, source })?, "Serving the actuator API.");
        Some(tokio::spawn(async move {
            kvscope_kit::http::serve(listener, app, stats).await;
            std::io::Result::Ok(())
        }))
    } else {
        None
    };
    let mut last_error: Option<String> = None;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = ticker.tick() => {
                // A collector that has not caught up (rebuilding from the stream after a
                // restart) serves figures that are not the fleet's now: read as no input,
                // so the policy holds nothing LIVE on them and no directive is sent.
                let view = match client.ready().await {
                    Ok(()) => client.fetch().await,
                    Err(e) => Err(e),
                }
                .map_err(|e| e.to_string());
                // Logged when it starts, changes or ends; the audit has the rest.
                match (&view, &last_error) {
                    (Err(e), Some(last)) if e == last => {}
                    (Err(e), _) => warn!(error = %e, "Cannot read the collector."),
                    (Ok(_), Some(_)) => info!("The collector answers again."),
                    (Ok(_), None) => {}
                }
                last_error = view.as_ref().err().cloned();
                match &last_error {
                    Some(e) => health.fail(COLLECTOR_CHECK, format!("cannot read the collector: {e}")),
                    None => health.ok(COLLECTOR_CHECK),
                }
                let mut a = actuator.lock().await;
                a.tick(view, now_ns()).await;
            }
            _ = &mut shutdown => {
                info!("Shutting down.");
                break;
            }
        }
    }
    let mut a = actuator.lock().await;
    a.settle(Duration::from_secs(5), now_ns()).await;
    a.stop(now_ns()).await;
    if let Some(s) = server {
        s.abort();
    }
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return ctrl_c.await.unwrap_or(()),
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}
