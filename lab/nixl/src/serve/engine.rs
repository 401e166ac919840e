//! The engine side of a serving worker: its engine's KV events followed into the book
//! (so a directive's blocks can be found), and the blocks migrated to it published as
//! vLLM-format KV events of its own (or handed to its sidecar's publisher).

use super::fleet::FleetHandle;
use super::AppState;
use kvscope_wire::vllm_events::{decode_payload, split_frames};
use kvscope_wire::KvEvent;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};
use zeromq::{Socket, SocketRecv, SocketSend};

/// Hand batches to a sidecar's own publisher, in order.
pub(super) async fn forward_to_sidecar(
    fleet: FleetHandle,
    worker: usize,
    mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let events = tokio::select! {
            e = rx.recv() => match e { Some(e) => e, None => return },
            _ = stop.wait_for(|s| *s) => return,
        };
        if let Err(e) = fleet.publish(worker, events).await {
            warn!(worker, error = %e, "Publishing KV events through the sidecar failed.");
        }
    }
}

/// Publish batches as vLLM does: `[topic "", seq, payload]`, seq from 0.
pub(super) async fn publish_loop(
    mut socket: zeromq::PubSocket,
    mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut seq = 0u64;
    loop {
        let events = tokio::select! {
            e = rx.recv() => match e { Some(e) => e, None => return },
            _ = stop.wait_for(|s| *s) => return,
        };
        match crate::sidecar::kv_message(seq, &events) {
            Some(m) => {
                if let Err(e) = socket.send(m).await {
                    warn!(error = %e, "Publishing KV events failed.");
                }
            }
            None => warn!("Building a KV event message failed."),
        }
        seq += 1;
    }
}

/// Follow the engine's KV events into the worker's book (reconnecting with back-off).
pub(super) async fn follow_engine(shared: AppState, i: usize, mut stop: watch::Receiver<bool>) {
    let w = &shared.workers[i];
    let Some(endpoint) = w.cfg.engine.clone() else {
        return;
    };
    let mut backoff = Duration::from_millis(100);
    while !*stop.borrow() {
        let mut socket = zeromq::SubSocket::new();
        let connected =
            match tokio::time::timeout(Duration::from_secs(2), socket.connect(&endpoint)).await {
                Ok(Ok(())) => socket.subscribe("").await.map_err(|e| e.to_string()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("connect timed out".into()),
            };
        if let Err(error) = connected {
            warn!(worker = %w.cfg.name, engine = %endpoint, %error, "Cannot follow the engine's KV events; retrying.");
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
            continue;
        }
        info!(worker = %w.cfg.name, engine = %endpoint, "Following the engine's KV events.");
        loop {
            let msg = tokio::select! {
                m = socket.recv() => m,
                _ = stop.wait_for(|s| *s) => return,
            };
            let Ok(msg) = msg else { break };
            let frames = msg.into_vec();
            let decoded = split_frames(&frames)
                .map_err(|e| e.to_string())
                .and_then(|(_, payload)| decode_payload(payload).map_err(|e| e.to_string()));
            match decoded {
                Ok(p) => {
                    if !p.problems.is_empty() {
                        w.skipped
                            .fetch_add(p.problems.len() as u64, Ordering::Relaxed);
                        warn!(worker = %w.cfg.name, skipped = p.problems.len(), problems = ?p.problems, "Engine KV events skipped (counted).");
                    }
                    let mut book = w.book.lock().unwrap_or_else(|e| e.into_inner());
                    for ev in &p.events {
                        book.apply(ev);
                    }
                }
                Err(error) => {
                    w.undecodable.fetch_add(1, Ordering::Relaxed);
                    warn!(worker = %w.cfg.name, %error, "Undecodable KV event message from the engine (counted).");
                }
            }
        }
    }
}
