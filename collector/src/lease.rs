//! Which of a scope's collectors serves: a lease held in a NATS key-value bucket.
//!
//! Two collectors of one scope (the fleet, or one model: one durable consumer name) fold
//! the same stream. The one whose entry is in the bucket's key for that scope serves
//! (`/readyz`, the API, the figures on `/metrics`, the spans); the other follows the
//! stream as a warm standby and serves nothing but its role. The entry expires one
//! `ttl` after its last renewal (the bucket's `max_age`), so when the holder dies its
//! standby takes the key within about `ttl` and serves a fold that never stopped; a
//! collector rebuilding a full stream from its first record would take far longer.
//!
//! Never two serving: the holder renews every fifth of `ttl` and, when it has not
//! managed to for [`FENCE`] of it, stops serving and stands by (leaving the durable
//! consumer), well before the server lets its entry expire and another take the key; a
//! renewal refused because the entry changed stops it at once. A bus that loses its
//! quorum for a while thus leaves the scope without a serving collector for that while
//! (nothing can be read then anyway), and the holder takes its own entry back after. The election is
//! NATS' own compare-and-set (create = only if absent, update = only at the revision
//! read), so two collectors never both win a key.
//!
//! A collector takes the key only once it has rebuilt its fold from the stream (it
//! could not serve before); restarted in place (same host and listen address: its
//! identity) it then takes its own entry back at once if it has not expired, instead of
//! waiting for it to. A standby that took over meanwhile keeps it.

use crate::ingest::bus::{connect, until_ok, BusConfig};
use crate::state::{lock, Shared};
use async_nats::jetstream::{self, kv};
use kvscope_wire::api::summary::CollectorRole;
use kvscope_wire::subject::stream_replicas;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

/// How much of the lease's lifetime may pass since the last renewal was sent before
/// the holder gives up serving: the server counts the lifetime from when it stored the
/// renewal, after it was sent, so the holder has stopped before another can take it.
const FENCE: f64 = 0.6;

#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub bucket: String,
    /// The scope: the collectors' durable consumer name, as a key.
    pub key: String,
    /// This collector's name in the entry.
    pub identity: String,
    /// The entry's lifetime after each renewal, when this collector makes the bucket
    /// (an existing bucket's own is used).
    pub ttl: Duration,
    /// Servers keeping the bucket, when this collector makes it (0: as many as keep the
    /// stream by default, `kvscope_wire::subject::stream_replicas`).
    pub replicas: usize,
}

/// Hold the lease, or stand by until it can be taken, for ever: `leader` turns true when
/// this collector takes it and false when it loses it (then it stands by again).
pub async fn hold(
    cfg: LeaseConfig,
    bus: BusConfig,
    shared: Arc<Shared>,
    leader: watch::Sender<bool>,
) -> anyhow::Result<()> {
    {
        let mut bus = lock(&shared.bus);
        bus.lease.role = CollectorRole::Standby;
        bus.lease.identity = cfg.identity.clone();
    }
    let client = until_ok(
        || connect(&bus, shared.clone()),
        |e, _| failed(&shared, &format!("cannot connect to NATS: {e}")),
    )
    .await;
    let replicas = stream_replicas(cfg.replicas, &client.server_info(), None);
    let js = jetstream::new(client);
    let cfg = LeaseConfig { replicas, ..cfg };
    let (mut store, ttl) = open_bucket(&cfg, &js, &shared).await;
    lock(&shared.bus).lease.ttl_secs = ttl.as_secs();
    let look_every = (ttl / 5).clamp(Duration::from_millis(200), Duration::from_secs(2));
    let value = bytes::Bytes::from(cfg.identity.clone());
    loop {
        let revision = stand_by(&js, &mut store, &cfg, &value, &shared, ttl, look_every).await;
        {
            let mut bus = lock(&shared.bus);
            bus.lease.role = CollectorRole::Leader;
            bus.lease.acquired += 1;
            bus.lease.error = None;
            if bus
                .lease
                .holder
                .as_deref()
                .is_some_and(|h| h != cfg.identity)
            {
                bus.lease.holder_changes += 1;
            }
            bus.lease.holder = Some(cfg.identity.clone());
        }
        info!(key = %cfg.key, ttl_secs = ttl.as_secs(), "Took the lease: this collector serves its scope.");
        leader.send_replace(true);
        let why = serve(&store, &cfg, &value, &shared, revision, ttl, look_every).await;
        // Stop serving first, then say so: the bus reader leaves the durable consumer
        // to whoever takes the lease, and goes on as a standby.
        lock(&shared.bus).lease.role = CollectorRole::Standby;
        leader.send_replace(false);
        lock(&shared.bus).lease.lost += 1;
        warn!(key = %cfg.key, why = %why, "Lost the lease: this collector stands by.");
    }
}

/// Until the key is free (or still this collector's from before a restart): the
/// revision it was taken at.
async fn stand_by(
    js: &jetstream::Context,
    store: &mut kv::Store,
    cfg: &LeaseConfig,
    value: &bytes::Bytes,
    shared: &Shared,
    ttl: Duration,
    look_every: Duration,
) -> u64 {
    // The last revision of another collector's entry seen, and when it was first seen
    // (at most a look after it was written). Expired, the entry is gone a lifetime after
    // it was written; gone sooner (the bus's storage wiped, the entry deleted by hand),
    // its holder may still serve until its fence. So the key is taken only a lifetime
    // after its last revision was first seen: after an expiry that adds at most a look,
    // and after anything else its holder has stopped by then.
    let mut held_seen: Option<(u64, Instant)> = None;
    loop {
        // Rebuilding, this collector could not serve yet: it leaves the key alone, even
        // its own from before a restart, to a standby that can.
        if !shared.caught_up.load(std::sync::atomic::Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let may_take = held_seen.is_none_or(|(_, first)| first.elapsed() >= ttl);
        match take(store, cfg, value, may_take).await {
            Ok(Taken::Now(rev)) => return rev,
            Ok(Taken::NotYet) => {}
            Ok(Taken::HeldBy(holder, revision)) => {
                if held_seen.is_none_or(|(r, _)| r != revision) {
                    held_seen = Some((revision, Instant::now()));
                }
                let mut bus = lock(&shared.bus);
                bus.lease.error = None;
                if bus.lease.holder.as_deref() != Some(holder.as_str()) {
                    if bus.lease.holder.is_some() {
                        bus.lease.holder_changes += 1;
                    }
                    info!(holder = %holder, "Standing by: another collector of this scope serves.");
                    bus.lease.holder = Some(holder);
                }
            }
            Err(e) => {
                failed(shared, &e);
                // The bucket itself may be gone (the bus's storage wiped): made again.
                *store = open_bucket(cfg, js, shared).await.0;
            }
        }
        tokio::time::sleep(look_every).await;
    }
}

/// Renew the lease until it cannot be: why it was lost.
async fn serve(
    store: &kv::Store,
    cfg: &LeaseConfig,
    value: &bytes::Bytes,
    shared: &Shared,
    mut revision: u64,
    ttl: Duration,
    look_every: Duration,
) -> String {
    let fence = ttl.mul_f64(FENCE);
    let mut renewed = Instant::now();
    loop {
        tokio::time::sleep(look_every).await;
        let sent = Instant::now();
        // A renewal that hangs (the bus without quorum) must not keep this collector
        // serving past its fence.
        let left = fence.saturating_sub(renewed.elapsed());
        match tokio::time::timeout(left, store.update(&cfg.key, value.clone(), revision)).await {
            Ok(Ok(rev)) => {
                revision = rev;
                renewed = sent;
                lock(&shared.bus).lease.error = None;
            }
            Ok(Err(e)) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                let holder = store
                    .get(&cfg.key)
                    .await
                    .ok()
                    .flatten()
                    .map(|v| String::from_utf8_lossy(&v).into_owned());
                return format!(
                    "the entry changed under it ({} holds it now)",
                    holder.as_deref().unwrap_or("nobody")
                );
            }
            Ok(Err(e)) => failed(shared, &e.to_string()),
            Err(_) => failed(shared, "a renewal took too long"),
        }
        if renewed.elapsed() >= fence {
            return format!(
                "not renewed for {:.1} s of its {} s (another collector may take it after that)",
                renewed.elapsed().as_secs_f64(),
                ttl.as_secs()
            );
        }
    }
}

/// Let the lease go at once (a clean shutdown), so the standby need not wait for it to
/// expire. Only this collector's own entry is let go.
pub async fn release(cfg: &LeaseConfig, bus: &BusConfig, shared: Arc<Shared>) {
    let Ok(client) = connect(bus, shared).await else {
        return;
    };
    let js = jetstream::new(client);
    let Ok(store) = js.get_key_value(&cfg.bucket).await else {
        return;
    };
    if let Ok(Some(entry)) = store.entry(&cfg.key).await {
        if entry.operation == kv::Operation::Put && entry.value == cfg.identity.as_bytes() {
            // Marked let go rather than deleted: a standby takes a let-go entry at once,
            // and an entry that vanishes only a lifetime after it last changed.
            let _ = store
                .update(
                    &cfg.key,
                    bytes::Bytes::from_static(RELEASED),
                    entry.revision,
                )
                .await;
            info!(key = %cfg.key, "Let the lease go.");
        }
    }
}

/// The entry's value once its holder let it go (no collector's identity: those are
/// `host/address`).
const RELEASED: &[u8] = b"released";

enum Taken {
    Now(u64),
    /// By another collector, at this revision.
    HeldBy(String, u64),
    /// Free, but not to be taken yet (`may_take` false).
    NotYet,
}

/// Take the key if it is free (and `may_take`), or still this collector's own
/// (restarted in place).
async fn take(
    store: &kv::Store,
    cfg: &LeaseConfig,
    value: &bytes::Bytes,
    may_take: bool,
) -> Result<Taken, String> {
    match store.entry(&cfg.key).await.map_err(|e| e.to_string())? {
        Some(e) if e.operation == kv::Operation::Put && e.value == *value => store
            .update(&cfg.key, value.clone(), e.revision)
            .await
            .map(Taken::Now)
            .map_err(|e| e.to_string()),
        // Let go by a holder that stopped cleanly: free now. Of two standbys taking
        // it, the update at the revision read lets one win.
        Some(e) if e.operation == kv::Operation::Put && e.value == RELEASED => {
            match store.update(&cfg.key, value.clone(), e.revision).await {
                Ok(rev) => Ok(Taken::Now(rev)),
                Err(_) => Ok(Taken::NotYet),
            }
        }
        Some(e) if e.operation == kv::Operation::Put => Ok(Taken::HeldBy(
            String::from_utf8_lossy(&e.value).into_owned(),
            e.revision,
        )),
        // Absent, expired, or let go.
        _ if !may_take => Ok(Taken::NotYet),
        _ => match store.create(&cfg.key, value.clone()).await {
            Ok(rev) => Ok(Taken::Now(rev)),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                // Another took it between the look and the create.
                let entry = store.entry(&cfg.key).await.ok().flatten();
                Ok(Taken::HeldBy(
                    entry
                        .as_ref()
                        .map(|e| String::from_utf8_lossy(&e.value).into_owned())
                        .unwrap_or_else(|| "another collector".into()),
                    entry.map_or(0, |e| e.revision),
                ))
            }
            Err(e) => Err(e.to_string()),
        },
    }
}

/// The bucket, opened or made (retried until it can be: without it no collector of the
/// scope may serve), and the lifetime of its entries.
async fn open_bucket(
    cfg: &LeaseConfig,
    js: &jetstream::Context,
    shared: &Shared,
) -> (kv::Store, Duration) {
    let mut backoff = Duration::from_millis(200);
    loop {
        let opened = match js.get_key_value(&cfg.bucket).await {
            Ok(store) => Ok(store),
            // The bucket's stream made as a key-value bucket's is (what
            // `create_key_value` makes, without its account lookup, which needs a
            // permission more and fails to parse some servers' answers).
            Err(_) => match js.get_or_create_stream(bucket_stream(cfg)).await {
                Ok(_) => js
                    .get_key_value(&cfg.bucket)
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            },
        };
        match opened {
            Ok(store) => {
                let ttl = match store.status().await {
                    Ok(s) if !s.max_age().is_zero() => s.max_age(),
                    _ => cfg.ttl,
                };
                if ttl != cfg.ttl {
                    warn!(
                        bucket = %cfg.bucket,
                        ttl_secs = ttl.as_secs(),
                        configured_secs = cfg.ttl.as_secs(),
                        "The lease bucket exists with another lifetime: it is used as it is."
                    );
                }
                return (store, ttl);
            }
            Err(e) => {
                failed(
                    shared,
                    &format!("cannot open or make the lease bucket {}: {e}", cfg.bucket),
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// The stream behind the lease bucket: one entry per key, each gone `ttl` after its
/// last write; writes compare-and-set by the client (`create`, `update`).
fn bucket_stream(cfg: &LeaseConfig) -> jetstream::stream::Config {
    jetstream::stream::Config {
        name: format!("KV_{}", cfg.bucket),
        description: Some("kvscope: which collector of each scope serves".into()),
        subjects: vec![format!("$KV.{}.>", cfg.bucket)],
        max_messages_per_subject: 1,
        // A few keys of ~100 bytes: a bound the server can reserve on a store the
        // stream has filled.
        max_bytes: 1 << 20,
        max_age: cfg.ttl,
        // Under two minutes of lifetime, the server wants its duplicate window no longer.
        duplicate_window: cfg.ttl.min(Duration::from_secs(120)),
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        num_replicas: cfg.replicas.max(1),
        discard: jetstream::stream::DiscardPolicy::New,
        ..Default::default()
    }
}

fn failed(shared: &Shared, error: &str) {
    let mut bus = lock(&shared.bus);
    bus.lease.failures += 1;
    if bus.lease.error.as_deref() != Some(error) {
        warn!(
            error,
            "The collector's lease cannot be looked at or renewed."
        );
    }
    bus.lease.error = Some(error.to_string());
}
