//! Reading records from NATS JetStream.
//!
//! The collector's state is a fold over the stream, so on every start it first rebuilds
//! the fold by reading the stream from its first retained record up to the last one that
//! existed at start (an ordered consumer), then follows new records with its durable pull
//! consumer, acknowledging each once applied and skipping any it already applied. Records
//! delivered to a crashed collector but never acknowledged are thus applied exactly once
//! and in stream order, and a restarted collector ends with the same figures as one that
//! never stopped.

use crate::internal_events::*;
use crate::state::{lock, Shared};
use anyhow::Context as _;
use async_nats::jetstream::{self, consumer, stream};
use async_nats::HeaderMap;
use futures::StreamExt as _;
use kvscope_wire::parts::{self, PartsOutcome};
use kvscope_wire::subject::{stream_config, stream_replicas};
use kvscope_wire::{Envelope, Subjects};
use std::sync::Arc;
use std::time::Duration;
use tracing::info;

/// How far ahead of this host's clock a record may be stamped (agents' clocks disagree
/// by this much at most).
pub const FUTURE_TOLERANCE_NS: u64 = 60_000_000_000;

#[derive(Debug, Clone)]
pub struct BusConfig {
    pub nats_url: String,
    /// Credentials and TLS (see `kvscope_wire::nats_security`).
    pub security: kvscope_wire::NatsSecurity,
    pub subjects: Subjects,
    pub durable_name: String,
    pub stream_max_age: Duration,
    /// The stream's byte limit (0: none), when this collector creates it.
    pub stream_max_bytes: u64,
    /// Servers keeping the stream, when this collector creates it (0: as the servers
    /// say, `kvscope_wire::subject::stream_replicas`).
    pub stream_replicas: usize,
    /// Consume only these subjects (a collector limited to one model:
    /// `Subjects::of_model`); `None`: the whole stream.
    pub filter: Option<String>,
    /// True once this collector holds its scope's lease (`crate::lease`): until then it
    /// follows the stream as a standby, without its durable consumer. `None`: no lease.
    pub leader: Option<tokio::sync::watch::Receiver<bool>>,
}

impl Shared {
    /// Join one bus message with the parts before it (see `kvscope_wire::parts`) and
    /// apply its records once it is whole. Returns the records it completed (a bundle
    /// holds several; a part before the last, none), applied or counted as refused.
    fn apply_message(
        &self,
        subject: &str,
        headers: Option<&HeaderMap>,
        payload: &[u8],
        seq: u64,
        stored_ns: Option<u64>,
    ) -> u64 {
        if self.skips_model_copy(subject) {
            lock(&self.bus).applied_seq = seq;
            return 0;
        }
        let header = |name: &str| headers.and_then(|h| h.get(name)).map(|v| v.as_str());
        let outcome = lock(&self.parts).accept(
            header(async_nats::header::NATS_MESSAGE_ID.as_ref()),
            header(parts::PART_HEADER),
            payload,
        );
        self.apply_outcome(subject, outcome, payload, seq, stored_ns)
    }

    fn apply_outcome(
        &self,
        subject: &str,
        outcome: PartsOutcome,
        payload: &[u8],
        seq: u64,
        stored_ns: Option<u64>,
    ) -> u64 {
        match outcome {
            PartsOutcome::Whole => self.apply_payload(subject, payload, seq, stored_ns),
            PartsOutcome::Complete(record) => self.apply_payload(subject, &record, seq, stored_ns),
            PartsOutcome::Pending => {
                lock(&self.bus).applied_seq = seq;
                0
            }
            PartsOutcome::Incomplete {
                reason,
                lost_parts,
                then,
            } => {
                RecordIncomplete {
                    seq,
                    reason,
                    lost_parts,
                }
                .emit(self);
                self.apply_outcome(subject, *then, payload, seq, stored_ns)
            }
        }
    }

    /// Whether `subject` is a model's copy of a heartbeat or NIXL report that this
    /// collector of the whole fleet skips (counted).
    fn skips_model_copy(&self, subject: &str) -> bool {
        // The string check first: most records are no copy, and need no lock here.
        if !self.subjects.is_model_copy(subject) {
            return false;
        }
        let mut bus = lock(&self.bus);
        if bus.filter.is_some() {
            return false;
        }
        bus.model_copies_skipped += 1;
        true
    }

    /// Apply the records of one whole message: itself, or each of a bundle's
    /// (`kvscope_wire::bundle`), each as if it had come alone on its own subject.
    fn apply_payload(
        &self,
        subject: &str,
        payload: &[u8],
        seq: u64,
        stored_ns: Option<u64>,
    ) -> u64 {
        let bundle = kvscope_wire::bundle::is_bundle(payload);
        let scope = self.subjects.scope_of(subject);
        let mut records = 0;
        for entry in kvscope_wire::bundle::entries(subject, payload) {
            match entry {
                Ok(e) if !bundle => self.apply_record(e.subject, e.json, seq, e.index, stored_ns),
                // Not an envelope at all (a payload that is no JSON reads as a bundle of
                // garbage lines): undecodable, not a record of another agent.
                Ok(e) if e.json.first() != Some(&b'{') => RecordUndecodable {
                    seq,
                    error: &"a bundle line whose record is not a JSON object",
                }
                .emit(self),
                // A bundle's subject is what the server's permissions bound to its agent:
                // its records' subjects must lie in its scope.
                Ok(e) if scope.is_none() || self.subjects.scope_of(e.subject) != scope => {
                    RecordForeign {
                        seq,
                        subject: e.subject,
                        agent: self.subjects.agent_of(subject).unwrap_or_default(),
                    }
                    .emit(self);
                }
                Ok(e) if self.skips_model_copy(e.subject) => continue,
                Ok(e) => self.apply_record(e.subject, e.json, seq, e.index, stored_ns),
                Err(e) => RecordUndecodable { seq, error: &e }.emit(self),
            }
            records += 1;
        }
        lock(&self.bus).applied_seq = seq;
        records
    }

    /// Decode and apply one record (the `index`th of the message `seq`, stored by the
    /// stream at `stored_ns`); undecodable ones, and ones whose agent is not the one
    /// their subject names, are counted and skipped. A record dated after its storing is
    /// moved back by its agent's clock offset (`super::clocks`).
    fn apply_record(
        &self,
        subject: &str,
        json: &[u8],
        seq: u64,
        index: usize,
        stored_ns: Option<u64>,
    ) {
        match Envelope::from_json(json) {
            Ok(env) if !self.subjects.subject_matches_agent(subject, &env.agent) => {
                // The server's permissions bind a subject to one agent's credentials; a
                // record naming another agent is forged (or misrouted): never applied.
                RecordForeign {
                    seq,
                    subject,
                    agent: &env.agent,
                }
                .emit(self);
            }
            Ok(env)
                if env.observed_ns
                    > kvscope_kit::clock::now_ns().saturating_add(FUTURE_TOLERANCE_NS) =>
            {
                // A record dated far ahead of this host's clock would move every window
                // and the watermark to its date: quarantined, counted.
                RecordFromFuture {
                    seq,
                    agent: &env.agent,
                    observed_ns: env.observed_ns,
                }
                .emit(self);
            }
            Ok(mut env) => {
                if let Some(stored) = stored_ns {
                    let c = lock(&self.clocks).correct(&env.agent, env.observed_ns, stored);
                    if c.ahead_ns > 0 {
                        RecordClockCorrected {
                            agent: &env.agent,
                            ahead_ns: c.ahead_ns,
                        }
                        .emit(self);
                    }
                    env.observed_ns = c.observed_ns;
                }
                let (rebuilding, serving) = {
                    let bus = lock(&self.bus);
                    (bus.rebuilding, bus.lease.role.serves())
                };
                let verdict = {
                    let mut analyzer = lock(&self.analyzer);
                    let verdict = analyzer.apply(&env);
                    if verdict.is_some() {
                        // Readers see the verdict once this lock is released.
                        analyzer.stamp_latest_verdict(kvscope_kit::clock::now_ns(), !rebuilding);
                    }
                    verdict
                };
                if let Some(sink) = self.applied.get() {
                    // A standby's spans would be the leader's again.
                    if !rebuilding && serving {
                        sink.applied(&env, verdict.as_ref(), seq, index);
                    }
                }
                let mut recorder = lock(&self.recorder);
                if let Some(Err(e)) = recorder.as_mut().map(|r| r.write(&env)) {
                    *recorder = None;
                    RecordingFailed { error: &e }.emit(self);
                }
            }
            Err(e) => {
                RecordUndecodable { seq, error: &e }.emit(self);
            }
        }
    }

    pub fn flush_recording(&self) {
        if let Some(rec) = lock(&self.recorder).as_mut() {
            if let Err(e) = rec.flush() {
                RecordingFlushFailed { error: &e }.emit(self);
            }
        }
    }
}

/// Connect once, as the `[nats]` settings say; replies come to this collector's own
/// inbox. A refusal by the live server (a permissions violation) is logged; losing the
/// connection and getting it back show in [`BusStatus::connected`].
pub(crate) async fn connect(
    cfg: &BusConfig,
    shared: Arc<Shared>,
) -> anyhow::Result<async_nats::Client> {
    let options = cfg
        .security
        .connect_options(Some(&cfg.subjects.inbox_prefix(&cfg.durable_name)))
        .await?
        .event_callback(move |event| {
            let shared = shared.clone();
            async move {
                if let Some(e) = kvscope_wire::nats_security::refusal(&event) {
                    NatsRefused { error: &e }.emit(&shared);
                }
                match event {
                    async_nats::Event::Disconnected => lock(&shared.bus).connected = false,
                    async_nats::Event::Connected => lock(&shared.bus).connected = true,
                    _ => {}
                }
            }
        })
        .max_reconnects(None);
    let servers = kvscope_wire::nats_security::server_urls(&cfg.nats_url);
    anyhow::ensure!(!servers.is_empty(), "no NATS server URL given");
    Ok(options.connect(servers.as_slice()).await?)
}

/// `attempt` until it succeeds, waiting 200 ms between tries at first and twice as long
/// after each failure, up to 5 s; each failure goes to `failed` with the wait after it.
pub(crate) async fn until_ok<T, E, Fut>(
    mut attempt: impl FnMut() -> Fut,
    mut failed: impl FnMut(&E, Duration),
) -> T
where
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut backoff = Duration::from_millis(200);
    loop {
        match attempt().await {
            Ok(t) => return t,
            Err(e) => {
                failed(&e, backoff);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Rebuild from the stream, then follow it for ever (until the task is dropped).
pub async fn run(cfg: BusConfig, shared: Arc<Shared>) -> anyhow::Result<()> {
    lock(&shared.bus).filter = cfg.filter.clone();
    // NATS may come up after the collector (a pod started first): wait for it rather
    // than exit. The agents create the same stream (either may start first): one racing
    // this collector's create, or a server still recovering its store, fails it for a
    // moment; a collector that exited there would need a restart nothing gives it.
    let client = until_ok(
        || connect(&cfg, shared.clone()),
        |error, retry_in| {
            NatsUnreachable {
                url: &cfg.nats_url,
                error,
                retry_in,
            }
            .emit(&shared)
        },
    )
    .await;
    let js = jetstream::new(client);
    let stream_name = cfg.subjects.stream_name();
    let mut stream = until_ok(
        || {
            js.get_or_create_stream(stream_config(
                &cfg.subjects,
                cfg.stream_max_age,
                cfg.stream_max_bytes,
                // Made only where there is none: nothing to keep.
                stream_replicas(cfg.stream_replicas, &js.client().server_info(), None),
            ))
        },
        |error, retry_in| {
            StreamUnavailable {
                stream: &stream_name,
                error,
                retry_in,
            }
            .emit(&shared)
        },
    )
    .await;
    lock(&shared.bus).connected = true;
    let info = stream
        .info()
        .await
        .context("cannot read the stream's state")?;
    // Its leader from the start: a move before the first look is a move too.
    note_stream(info, &shared);
    let state = &info.state;
    let (first, last) = (state.first_sequence, state.last_sequence);
    lock(&shared.bus).stream_first_seq = first;
    if first > 1 {
        // Normal on a fleet that has run longer than the stream keeps records: the
        // figures (and the mirror) begin at its first retained record.
        info!(
            first_seq = first,
            "The stream's records before this one were discarded by its age and size limits."
        );
    }
    // Every record gone (expired) leaves `first` past `last`: nothing to rebuild.
    if last > 0 && first <= last {
        rebuild(&stream, first..=last, cfg.filter.as_deref(), &shared).await?;
    }
    let mut created = stream
        .info()
        .await
        .context("cannot read the stream's state")?
        .created
        .unix_timestamp_nanos();
    lock(&shared.bus).applied_at_ns = kvscope_kit::clock::now_ns();
    shared
        .caught_up
        .store(true, std::sync::atomic::Ordering::Release);
    // One durable consumer per stream: a stream made anew under the name (a server
    // whose storage was wiped) gets a consumer of its own, followed from its first
    // record.
    loop {
        // Only while this collector holds its scope's lease: a standby leaves the
        // durable consumer to the collector that serves.
        if let Some(leader) = cfg.leader.clone() {
            stand_by(&stream, cfg.filter.as_deref(), &shared, leader).await?;
        }
        // Made again after a standby took over, maybe while the bus elects a leader:
        // retried, as at start.
        let (durable, messages) = until_ok(
            || async {
                let durable = stream
                    .get_or_create_consumer(
                        &cfg.durable_name,
                        consumer::pull::Config {
                            durable_name: Some(cfg.durable_name.clone()),
                            ack_policy: consumer::AckPolicy::Explicit,
                            ack_wait: Duration::from_secs(30),
                            max_ack_pending: 100_000,
                            filter_subject: cfg
                                .filter
                                .clone()
                                .unwrap_or_else(|| cfg.subjects.all()),
                            ..Default::default()
                        },
                    )
                    .await
                    .context("cannot create the durable consumer")?;
                let messages = durable
                    .messages()
                    .await
                    .context("cannot pull from the durable consumer")?;
                anyhow::Ok((durable, messages))
            },
            |e: &anyhow::Error, _| {
                PullFailed {
                    error: &format!("{e:#}"),
                }
                .emit(&shared)
            },
        )
        .await;
        info!(stream = %cfg.subjects.stream_name(), durable = %cfg.durable_name, filter = ?cfg.filter, "Following the stream.");
        let Some(anew) = follow(&cfg, &js, &stream, durable, messages, created, &shared).await?
        else {
            // Lost the lease: stand by again, from the last record applied.
            continue;
        };
        let (new_stream, new_created) = anew;
        let first = new_stream.cached_info().state.first_sequence.max(1);
        // Read before the event locks the status itself.
        let applied_seq = lock(&shared.bus).applied_seq;
        StreamReset {
            applied_seq,
            first_seq: first,
        }
        .emit(&shared);
        {
            let mut bus = lock(&shared.bus);
            bus.applied_seq = first - 1;
            bus.stream_first_seq = first;
            // The old consumer's trouble is not the new one's.
            bus.consumer_error = None;
            bus.consumer_pending = 0;
        }
        stream = new_stream;
        created = new_created;
    }
}

/// How long the reader waits for a message before it looks at the stream and its
/// consumer (still the same stream? how many messages wait?).
const LOOK_EVERY: Duration = Duration::from_secs(5);

/// Follow `messages` until the stream turns out made anew (its creation time changed,
/// or its last record is before the one last applied): the new stream and when it was
/// made; or until this collector loses its lease (`None`). Errors only when the stream
/// cannot be opened at all.
async fn follow(
    cfg: &BusConfig,
    js: &jetstream::Context,
    stream: &stream::Stream,
    mut durable: consumer::Consumer<consumer::pull::Config>,
    mut messages: consumer::pull::Stream,
    created: i128,
    shared: &Shared,
) -> anyhow::Result<Option<(stream::Stream, i128)>> {
    // Deliveries of a filtered consumer skip the other subjects' stream sequences: its
    // own consumer sequence tells a lost delivery there.
    let mut last_delivery = 0u64;
    let mut looked = tokio::time::Instant::now();
    let mut leader = cfg.leader.clone();
    loop {
        // A busy stream is looked at as often as a quiet one (its leader may move).
        if looked.elapsed() >= LOOK_EVERY {
            looked = tokio::time::Instant::now();
            if let Some(anew) = look(cfg, js, &mut durable, created, shared).await? {
                return Ok(Some(anew));
            }
        }
        let next = tokio::select! {
            next = tokio::time::timeout(LOOK_EVERY, messages.next()) => next,
            () = lease_lost(leader.as_mut()) => return Ok(None),
        };
        let msg = match next {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => {
                PullFailed { error: &e }.emit(shared);
                if let Some(anew) = look(cfg, js, &mut durable, created, shared).await? {
                    return Ok(Some(anew));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            Ok(None) => anyhow::bail!("the durable consumer's message stream ended"),
            // Quiet: still the same stream?
            Err(_) => {
                looked = tokio::time::Instant::now();
                if let Some(anew) = look(cfg, js, &mut durable, created, shared).await? {
                    return Ok(Some(anew));
                }
                continue;
            }
        };
        let (seq, pending, delivery, stored_ns) = match msg.info() {
            Ok(i) => (
                i.stream_sequence,
                i.pending,
                i.consumer_sequence,
                unix_ns(i.published),
            ),
            Err(e) => {
                MessageWithoutMetadata { error: &e }.emit(shared);
                continue;
            }
        };
        let applied = lock(&shared.bus).applied_seq;
        let lost = match &cfg.filter {
            // The stream holds only this cluster's subjects, so its sequence numbers are
            // contiguous: a jump means records delivered before a reconnect are pending
            // redelivery.
            None => seq > applied + 1 && applied > 0,
            Some(_) => delivery > last_delivery + 1 && last_delivery > 0,
        };
        last_delivery = last_delivery.max(delivery);
        if lost && seq > applied + 1 {
            // Fetch them now, so every record is applied once and in order.
            fill_gap(stream, applied + 1, seq, cfg.filter.as_deref(), shared).await;
        }
        if seq > lock(&shared.bus).applied_seq {
            shared.apply_message(
                &msg.subject,
                msg.headers.as_ref(),
                &msg.payload,
                seq,
                Some(stored_ns),
            );
        }
        {
            let mut bus = lock(&shared.bus);
            bus.pending = pending;
            bus.consumer_pending = pending;
            bus.consumer_error = None;
            bus.applied_at_ns = kvscope_kit::clock::now_ns();
        }
        if let Err(e) = msg.ack().await {
            AckFailed { seq, error: &e }.emit(shared);
        }
    }
}

/// The stream's servers as `info` has them. On a cluster, the server leading the
/// stream: its moving is no fault (the stream's replicas elect another when one goes),
/// but shown and counted, whatever this collector's role.
fn note_stream(info: &stream::Info, shared: &Shared) {
    if let Some(leader) = info.cluster.as_ref().and_then(|c| c.leader.clone()) {
        let previous = lock(&shared.bus).stream_leader.replace(leader.clone());
        if let Some(previous) = previous.filter(|p| *p != leader) {
            StreamLeaderMoved {
                from: &previous,
                to: &leader,
            }
            .emit(shared);
        }
    }
    lock(&shared.bus).stream_replicas = info.config.num_replicas;
}

/// Resolves once `leader` says the lease is lost; never without a lease.
async fn lease_lost(leader: Option<&mut tokio::sync::watch::Receiver<bool>>) {
    match leader {
        Some(l) => {
            if l.wait_for(|held| !held).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

/// Look at the stream and this collector's consumer: how many messages wait for it,
/// and whether the stream was made anew since `created` (then the new stream, opened or
/// made as the agents make it).
async fn look(
    cfg: &BusConfig,
    js: &jetstream::Context,
    durable: &mut consumer::Consumer<consumer::pull::Config>,
    created: i128,
    shared: &Shared,
) -> anyhow::Result<Option<(stream::Stream, i128)>> {
    match durable.info().await {
        Ok(info) => {
            let mut bus = lock(&shared.bus);
            bus.consumer_pending = info.num_pending;
            bus.consumer_error = None;
        }
        Err(e) => lock(&shared.bus).consumer_error = Some(e.to_string()),
    }
    let Ok(mut stream) = js
        .get_or_create_stream(stream_config(
            &cfg.subjects,
            cfg.stream_max_age,
            cfg.stream_max_bytes,
            // Made only where there is none: nothing to keep.
            stream_replicas(cfg.stream_replicas, &js.client().server_info(), None),
        ))
        .await
    else {
        // NATS away: the client reconnects; look again later.
        return Ok(None);
    };
    let Ok(info) = stream.info().await else {
        return Ok(None);
    };
    note_stream(info, shared);
    let applied = lock(&shared.bus).applied_seq;
    let created_now = info.created.unix_timestamp_nanos();
    let made_anew = created_now != created || info.state.last_sequence < applied;
    Ok(made_anew.then_some((stream, created_now)))
}

/// Apply stream records `from..to` by direct lookup (those `filter` takes, when given);
/// ones that no longer exist are counted as missing.
async fn fill_gap(
    stream: &stream::Stream,
    from: u64,
    to: u64,
    filter: Option<&str>,
    shared: &Shared,
) {
    // Those before the stream's first record were discarded by its limits: counted at
    // once, not asked for one by one (a collector that fell further behind than the
    // stream holds would otherwise look up each of millions).
    let first = match stream.get_info().await {
        Ok(info) => info.state.first_sequence.clamp(from, to),
        Err(_) => from,
    };
    if first > from {
        RecordsDiscarded { from, to: first }.emit(shared);
        lock(&shared.bus).applied_seq = first - 1;
    }
    for s in first..to {
        match stream.get_raw_message(s).await {
            Ok(m) if filter.is_some_and(|f| !subject_matches(f, &m.subject)) => {
                lock(&shared.bus).applied_seq = s;
            }
            Ok(m) => {
                shared.apply_message(
                    &m.subject,
                    Some(&m.headers),
                    &m.payload,
                    s,
                    Some(unix_ns(m.time)),
                );
            }
            Err(e) => {
                RecordMissing { seq: s, error: &e }.emit(shared);
                lock(&shared.bus).applied_seq = s;
            }
        }
    }
}

/// A stream time stamp as UNIX nanoseconds (0 before 1970).
fn unix_ns(t: async_nats::datetime::DateTime) -> u64 {
    u64::try_from(t.unix_timestamp_nanos()).unwrap_or(0)
}

/// Whether the NATS subject pattern `filter` (`*` one token, `>` the rest) takes
/// `subject`.
pub(crate) fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut s = subject.split('.');
    for f in filter.split('.') {
        match (f, s.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (f, Some(t)) if f == t => {}
            _ => return false,
        }
    }
    s.next().is_none()
}

/// Follow the stream without the durable consumer (another collector of the scope
/// holds it) until `leader` turns true: the fold stays as current as the serving
/// collector's, so this one serves the moment it takes the lease. Records are applied
/// as the durable consumer would (in order, each once); the durable then goes on from
/// the last one applied.
async fn stand_by(
    stream: &stream::Stream,
    filter: Option<&str>,
    shared: &Shared,
    mut leader: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    if *leader.borrow() {
        return Ok(());
    }
    info!("Standing by: following the stream until this collector takes the lease.");
    let taken = async {
        while leader.wait_for(|held| *held).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        () = taken => {
            info!(applied_seq = lock(&shared.bus).applied_seq, "Took over: following the stream with the durable consumer.");
            Ok(())
        }
        r = follow_standing_by(stream, filter, shared) => r,
    }
}

/// Apply the stream's records from the one after the last applied, for ever.
async fn follow_standing_by(
    stream: &stream::Stream,
    filter: Option<&str>,
    shared: &Shared,
) -> anyhow::Result<()> {
    loop {
        let from = lock(&shared.bus).applied_seq + 1;
        let ordered = stream
            .create_consumer(consumer::pull::OrderedConfig {
                deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: from,
                },
                filter_subject: filter.map(str::to_string).unwrap_or_default(),
                ..Default::default()
            })
            .await;
        let mut messages = match ordered {
            Ok(c) => match c.messages().await {
                Ok(m) => Some(m),
                Err(e) => {
                    PullFailed { error: &e }.emit(shared);
                    None
                }
            },
            Err(e) => {
                PullFailed { error: &e }.emit(shared);
                None
            }
        };
        let mut looked = tokio::time::Instant::now();
        loop {
            if looked.elapsed() >= LOOK_EVERY {
                looked = tokio::time::Instant::now();
                if let Ok(info) = stream.get_info().await {
                    note_stream(&info, shared);
                }
            }
            let msg = match messages.as_mut() {
                Some(m) => match tokio::time::timeout(LOOK_EVERY, m.next()).await {
                    Ok(m) => m,
                    Err(_) => continue,
                },
                None => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    None
                }
            };
            match msg {
                Some(Ok(msg)) => {
                    let Ok(info) = msg.info() else { continue };
                    let (seq, pending, stored) =
                        (info.stream_sequence, info.pending, unix_ns(info.published));
                    let applied = lock(&shared.bus).applied_seq;
                    if seq > applied + 1 && filter.is_none() {
                        RecordsDiscarded {
                            from: applied + 1,
                            to: seq,
                        }
                        .emit(shared);
                    }
                    if seq > applied {
                        shared.apply_message(
                            &msg.subject,
                            msg.headers.as_ref(),
                            &msg.payload,
                            seq,
                            Some(stored),
                        );
                    }
                    let mut bus = lock(&shared.bus);
                    bus.pending = pending;
                    bus.applied_at_ns = kvscope_kit::clock::now_ns();
                }
                Some(Err(e)) => {
                    PullFailed { error: &e }.emit(shared);
                    break;
                }
                // No consumer (made again after a pause), or its messages ended.
                None => break,
            }
        }
    }
}

/// Apply the stream's records `seqs` (those `filter` takes, when given), in order.
async fn rebuild(
    stream: &stream::Stream,
    seqs: std::ops::RangeInclusive<u64>,
    filter: Option<&str>,
    shared: &Shared,
) -> anyhow::Result<()> {
    let (mut next, last) = (*seqs.start(), *seqs.end());
    lock(&shared.bus).rebuilding = true;
    info!(
        last_seq = last,
        filter = ?filter,
        "Rebuilding the fleet state from the stream."
    );
    let ordered = stream
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::All,
            filter_subject: filter.map(str::to_string).unwrap_or_default(),
            ..Default::default()
        })
        .await
        .context("cannot create the ordered consumer for the rebuild")?;
    if filter.is_some() {
        // Nothing of the filter's in the stream: nothing to wait for.
        let mut probe = ordered.clone();
        if probe.info().await.map(|i| i.num_pending).unwrap_or(0) == 0 {
            let mut bus = lock(&shared.bus);
            bus.rebuilding = false;
            bus.applied_seq = last;
            return Ok(());
        }
    }
    let mut messages = ordered
        .messages()
        .await
        .context("cannot read the stream for the rebuild")?;
    let (mut n, mut records) = (0u64, 0u64);
    while let Some(msg) = messages.next().await {
        let msg = msg.context("reading the stream during the rebuild")?;
        let (seq, pending, stored_ns) = msg
            .info()
            .map(|i| (i.stream_sequence, i.pending, Some(unix_ns(i.published))))
            .unwrap_or((0, 0, None));
        if filter.is_none() && seq > next {
            if n == 0 {
                // Discarded before the rebuild read anything: the figures begin later,
                // with no hole in them.
                lock(&shared.bus).stream_first_seq = seq;
            } else {
                // The stream's sequence numbers are contiguous: the ones skipped were
                // discarded by its limits while the rebuild read towards them.
                RecordsDiscarded {
                    from: next,
                    to: seq.min(last + 1),
                }
                .emit(shared);
            }
        }
        if seq > last {
            // Past the stream's end at start (everything up to it discarded meanwhile):
            // the durable consumer goes on from here.
            lock(&shared.bus).applied_seq = last;
            break;
        }
        next = next.max(seq + 1);
        records += shared.apply_message(
            &msg.subject,
            msg.headers.as_ref(),
            &msg.payload,
            seq,
            stored_ns,
        );
        n += 1;
        if n.is_multiple_of(100_000) {
            info!(applied = n, of = last, "Rebuilding.");
        }
        // Filtered, the last record of the stream may not be the filter's: the
        // consumer's pending count says when the filter's records up to now are in.
        if seq >= last || (filter.is_some() && pending == 0) {
            break;
        }
    }
    let mut bus = lock(&shared.bus);
    bus.rebuilding = false;
    bus.rebuilt_records = records;
    info!(messages = n, records, "Rebuilt the fleet state.");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fold::analyzer::FleetAnalyzer;

    #[test]
    fn subject_patterns_match_as_nats_does() {
        let f = "kvscope.lab.*.m.alpha.>";
        assert!(subject_matches(f, "kvscope.lab.node-1.m.alpha.kv.7"));
        assert!(subject_matches(f, "kvscope.lab.node-1.m.alpha.heartbeat"));
        assert!(
            !subject_matches(f, "kvscope.lab.node-1.m.alpha"),
            "> needs a token"
        );
        assert!(!subject_matches(f, "kvscope.lab.node-1.m.beta.kv.7"));
        assert!(!subject_matches(f, "kvscope.lab.node-1.heartbeat"));
        assert!(subject_matches("a.*.c", "a.b.c"));
        assert!(!subject_matches("a.*.c", "a.b.c.d"));
        assert!(!subject_matches("a.*", "a"));
    }

    /// A collector of the whole fleet of cluster `lab`.
    fn lab_collector() -> (Subjects, Arc<Shared>) {
        let subjects = Subjects::new("lab");
        let shared = Shared::new(
            FleetAnalyzer::new(Default::default()),
            None,
            subjects.clone(),
        );
        (subjects, shared)
    }

    fn heartbeat_of(agent: &str) -> kvscope_wire::Envelope {
        kvscope_wire::Envelope {
            agent: agent.into(),
            observed_ns: 1,
            record: kvscope_wire::Record::Heartbeat(kvscope_wire::AgentHeartbeat::default()),
        }
    }

    #[test]
    fn a_bundle_s_records_are_applied_each_as_if_it_came_alone() {
        use kvscope_wire::bundle::BundleWriter;
        let (subjects, shared) = lab_collector();
        let env = heartbeat_of;
        let plain = subjects.for_record("node-1", &env("node-1").record);
        let copy = subjects.for_record_in_model("node-1", &env("node-1").record, "alpha");
        let other = subjects.for_record("node-2", &env("node-2").record);
        let mut w = BundleWriter::default();
        w.push(&plain, &env("node-1").to_json());
        w.push(&plain, &env("node-1").to_json());
        // Another agent's record smuggled into node-1's bundle, and one naming node-2 on
        // node-1's subject: neither applied.
        w.push(&other, &env("node-2").to_json());
        w.push(&plain, &env("node-2").to_json());
        w.push(&plain, b"{not json");
        let mut payload = w.finish();
        payload.extend_from_slice(b"no-subject-here\n");
        let bundle = Subjects::bundle_subject(subjects.scope_of(&plain).unwrap());
        // Five records and a line without one, each counted once.
        assert_eq!(shared.apply_message(&bundle, None, &payload, 5, None), 6);
        let counters = lock(&shared.analyzer).counters().clone();
        assert_eq!(counters.records, 2);
        assert_eq!(counters.foreign_records, 2);
        assert_eq!(counters.undecodable_records, 2);
        assert_eq!(lock(&shared.bus).applied_seq, 5);
        // A model's bundle: the whole-fleet collector skips the heartbeat's copy in it.
        let mut w = BundleWriter::default();
        w.push(&copy, &env("node-1").to_json());
        w.push(&copy, &env("node-1").to_json());
        let model_bundle = Subjects::bundle_subject(subjects.scope_of(&copy).unwrap());
        assert_eq!(
            shared.apply_message(&model_bundle, None, &w.finish(), 6, None),
            0
        );
        assert_eq!(lock(&shared.bus).model_copies_skipped, 2);
        assert_eq!(lock(&shared.analyzer).counters().records, 2);
        // A plain record in a model's bundle is outside its scope.
        let mut w = BundleWriter::default();
        w.push(&plain, &env("node-1").to_json());
        w.push(&plain, &env("node-1").to_json());
        shared.apply_message(&model_bundle, None, &w.finish(), 7, None);
        assert_eq!(lock(&shared.analyzer).counters().foreign_records, 4);
    }

    #[test]
    fn a_bundle_sent_in_parts_is_joined_then_read_line_by_line() {
        use kvscope_wire::bundle::BundleWriter;
        let (subjects, shared) = lab_collector();
        let env = heartbeat_of("node-1");
        let plain = subjects.for_record("node-1", &env.record);
        let mut w = BundleWriter::default();
        for _ in 0..3 {
            w.push(&plain, &env.to_json());
        }
        let payload = w.finish();
        let bundle = Subjects::bundle_subject(subjects.scope_of(&plain).unwrap());
        let pieces: Vec<&[u8]> = parts::split(&payload, payload.len() / 3 + 1).collect();
        assert_eq!(pieces.len(), 3);
        for (i, piece) in pieces.iter().enumerate() {
            let mut headers = HeaderMap::new();
            headers.insert(
                async_nats::header::NATS_MESSAGE_ID,
                parts::message_id("run", 0, Some(i as u32)).as_str(),
            );
            headers.insert(parts::PART_HEADER, format!("{i}/3").as_str());
            shared.apply_message(&bundle, Some(&headers), piece, 10 + i as u64, None);
            let applied = lock(&shared.analyzer).counters().records;
            assert_eq!(applied, if i == 2 { 3 } else { 0 }, "after part {i}");
        }
        assert_eq!(lock(&shared.bus).applied_seq, 12);
    }

    #[test]
    fn a_payload_that_is_no_json_is_undecodable_not_foreign() {
        let (subjects, shared) = lab_collector();
        let subject = subjects.for_record("node-1", &heartbeat_of("node-1").record);
        let scope = subjects.scope_of(&subject);
        let bundle = Subjects::bundle_subject(scope.unwrap());
        shared.apply_message(&bundle, None, b"\x00\x01 garbage\nnot json at all", 1, None);
        let c = lock(&shared.analyzer).counters().clone();
        assert_eq!((c.undecodable_records, c.foreign_records), (2, 0));
    }

    #[test]
    fn a_whole_fleet_collector_skips_the_model_copies() {
        let (subjects, shared) = lab_collector();
        let env = heartbeat_of("node-1");
        let json = env.to_json();
        let plain = subjects.for_record("node-1", &env.record);
        let copy = subjects.for_record_in_model("node-1", &env.record, "alpha");
        shared.apply_message(&plain, None, &json, 1, None);
        shared.apply_message(&copy, None, &json, 2, None);
        let bus = lock(&shared.bus).clone();
        assert_eq!((bus.applied_seq, bus.model_copies_skipped), (2, 1));
        assert_eq!(lock(&shared.analyzer).counters().records, 1);
        // Limited to the model, the copy is what it has: applied.
        let limited = Shared::new(FleetAnalyzer::new(Default::default()), None, subjects);
        lock(&limited.bus).filter = Some("kvscope.lab.*.m.alpha.>".into());
        limited.apply_message(&copy, None, &json, 2, None);
        assert_eq!(lock(&limited.analyzer).counters().records, 1);
        assert_eq!(lock(&limited.bus).model_copies_skipped, 0);
    }
}
