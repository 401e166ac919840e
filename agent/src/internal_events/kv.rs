//! Events of the KV event taps.

use super::{InternalEvent, LogLimiter};
use crate::counters::{add, AgentStats};
use crate::kv_events::PayloadError;
use tracing::{debug, error, info, warn};

/// A batch decoded (its good events are shipped).
pub struct KvBatchReceived<'a> {
    pub publisher: &'a str,
    pub events: usize,
}

impl InternalEvent<AgentStats> for KvBatchReceived<'_> {
    fn emit(self, stats: &AgentStats) {
        debug!(publisher = %self.publisher, events = self.events, "KV event batch received.");
        add(&stats.kv_batches, 1);
        add(&stats.kv_events, self.events as u64);
    }
}

/// A ZMQ message that was not the multipart its format has (vLLM's `[topic, seq,
/// payload]`, Dynamo's four frames).
pub struct KvBadFrame<'a> {
    pub publisher: &'a str,
    pub error: &'a dyn std::fmt::Display,
}

static BAD_FRAME: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvBadFrame<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = BAD_FRAME.check() {
            warn!(publisher = %self.publisher, error = %self.error, suppressed, "Bad KV event frame; message skipped.");
        }
        add(&stats.kv_bad_frames, 1);
    }
}

/// A payload that was not msgpack or not the batch shape.
pub struct KvDecodeError<'a> {
    pub publisher: &'a str,
    pub error: &'a PayloadError,
}

static DECODE_ERROR: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvDecodeError<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = DECODE_ERROR.check() {
            warn!(publisher = %self.publisher, error = %self.error, suppressed, "Undecodable KV event payload; batch skipped.");
        }
        add(&stats.kv_decode_errors, 1);
    }
}

/// An event of a type the agent does not know.
pub struct KvUnknownEvent<'a> {
    pub publisher: &'a str,
    pub event_type: &'a str,
}

static UNKNOWN_EVENT: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvUnknownEvent<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = UNKNOWN_EVENT.check() {
            warn!(publisher = %self.publisher, event_type = %self.event_type, suppressed, "Unknown KV event type; event skipped.");
        }
        add(&stats.kv_unknown_events, 1);
    }
}

/// Events a publisher wrote in the layout of Dynamo's mocker before 1.5 (medium left
/// out, its group_idx in medium's slot), read that way.
pub struct KvMediumLeftOut<'a> {
    pub publisher: &'a str,
    pub events: u32,
}

static MEDIUM_LEFT_OUT: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvMediumLeftOut<'_> {
    fn emit(self, stats: &AgentStats) {
        if self.events == 0 {
            return;
        }
        if let Some(suppressed) = MEDIUM_LEFT_OUT.check() {
            info!(publisher = %self.publisher, events = self.events, suppressed, "KV events with their medium left out and group_idx in its slot (Dynamo's mocker before 1.5): read with no medium.");
        }
        add(&stats.kv_events_medium_left_out, u64::from(self.events));
    }
}

/// Fields of vLLM's events a batch set that the agent read past without carrying.
pub struct KvFieldsLeftOut<'a> {
    pub publisher: &'a str,
    pub fields: &'a kvscope_wire::vllm_events::FieldsLeftOut,
}

static FIELDS_LEFT_OUT: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvFieldsLeftOut<'_> {
    fn emit(self, stats: &AgentStats) {
        let f = self.fields;
        if *f == Default::default() {
            return;
        }
        if let Some(suppressed) = FIELDS_LEFT_OUT.check() {
            let set: Vec<&str> = f
                .counts()
                .iter()
                .filter(|(_, n)| *n > 0)
                .map(|(name, _)| *name)
                .collect();
            debug!(publisher = %self.publisher, fields = ?set, suppressed, "KV events set fields the agent does not carry (counted per field).");
        }
        add(&stats.kv_fields_left_out_lora_id, u64::from(f.lora_id));
        add(
            &stats.kv_fields_left_out_extra_keys,
            u64::from(f.extra_keys),
        );
        add(
            &stats.kv_fields_left_out_kv_cache_spec_sliding_window,
            u64::from(f.kv_cache_spec_sliding_window),
        );
        add(
            &stats.kv_fields_left_out_session_id,
            u64::from(f.session_id),
        );
        add(
            &stats.kv_fields_left_out_lookahead_token_ids,
            u64::from(f.lookahead_token_ids),
        );
        add(&stats.kv_fields_left_out_other, u64::from(f.other));
    }
}

/// An event the mirror does not take (`kvscope_wire::kv_admission`).
pub struct KvEventRefused<'a> {
    pub publisher: &'a str,
    pub why: kvscope_wire::kv_admission::Refusal,
}

static EVENT_REFUSED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvEventRefused<'_> {
    fn emit(self, stats: &AgentStats) {
        use kvscope_wire::kv_admission::Refusal;
        if let Some(suppressed) = EVENT_REFUSED.check() {
            debug!(publisher = %self.publisher, why = ?self.why, suppressed, "KV event not taken into the mirror (as Dynamo's publisher does not hand it to its router).");
        }
        let counter = match self.why {
            Refusal::OtherOwner => &stats.kv_events_refused_other_owner,
            Refusal::NotLocal => &stats.kv_events_refused_not_local,
            Refusal::OtherCacheGroup => &stats.kv_events_refused_other_cache_group,
            Refusal::UnknownCacheKind => &stats.kv_events_refused_unknown_cache_kind,
            Refusal::UnlearnedCacheGroup => &stats.kv_events_refused_unlearned_cache_group,
            Refusal::AmbiguousSalt => &stats.kv_events_refused_ambiguous_salt,
        };
        add(counter, 1);
    }
}

/// Blocks of a store that hold multimodal objects, hashed with them; `placeholders`
/// says whether the model's placeholder ids were known (else why not).
pub struct KvMediaBlocks<'a> {
    pub publisher: &'a str,
    pub blocks: usize,
    pub placeholders: Result<(), &'a str>,
}

static MEDIA_WITHOUT_PLACEHOLDERS: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvMediaBlocks<'_> {
    fn emit(self, stats: &AgentStats) {
        add(&stats.kv_media_blocks, self.blocks as u64);
        if let Err(why) = self.placeholders {
            add(
                &stats.kv_media_blocks_without_placeholders,
                self.blocks as u64,
            );
            if let Some(suppressed) = MEDIA_WITHOUT_PLACEHOLDERS.check() {
                warn!(
                    publisher = %self.publisher,
                    blocks = self.blocks,
                    reason = why,
                    suppressed,
                    "KV blocks holding images or videos hashed without the model's placeholder token ids \
                     (see the reason): they match the router's blocks only where Dynamo's \
                     publisher did not rewrite their placeholder runs."
                );
            }
        }
    }
}

/// A store that took its parent's cache salt.
pub struct KvSaltInherited;

impl InternalEvent<AgentStats> for KvSaltInherited {
    fn emit(self, stats: &AgentStats) {
        add(&stats.kv_salts_inherited, 1);
    }
}

/// An event with missing or wrongly typed fields.
pub struct KvMalformedEvent<'a> {
    pub publisher: &'a str,
    pub event_type: &'a str,
    pub reason: &'a str,
}

static MALFORMED_EVENT: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvMalformedEvent<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = MALFORMED_EVENT.check() {
            warn!(publisher = %self.publisher, event_type = %self.event_type, reason = %self.reason, suppressed, "Malformed KV event; event skipped.");
        }
        add(&stats.kv_malformed_events, 1);
    }
}

/// Batches skipped in a publisher's numbering.
pub struct KvSequenceGap<'a> {
    pub publisher: &'a str,
    pub expected: u64,
    pub got: u64,
    pub missed: u64,
}

impl InternalEvent<AgentStats> for KvSequenceGap<'_> {
    fn emit(self, stats: &AgentStats) {
        warn!(publisher = %self.publisher, expected = self.expected, got = self.got, missed = self.missed, "KV event sequence gap.");
        add(&stats.kv_sequence_gaps, 1);
        add(&stats.kv_missed_batches, self.missed);
    }
}

/// A publisher's numbering went backwards: the engine restarted.
pub struct KvSequenceReset<'a> {
    pub publisher: &'a str,
    pub previous: u64,
    pub got: u64,
}

impl InternalEvent<AgentStats> for KvSequenceReset<'_> {
    fn emit(self, stats: &AgentStats) {
        warn!(publisher = %self.publisher, previous = self.previous, got = self.got, "KV event sequence reset (engine restarted).");
        add(&stats.kv_sequence_resets, 1);
    }
}

/// A tap (re)connected to its publisher. No counter: the sequence status tells.
pub struct KvTapConnected<'a> {
    pub publisher: &'a str,
}

impl InternalEvent<AgentStats> for KvTapConnected<'_> {
    fn emit(self, _stats: &AgentStats) {
        info!(publisher = %self.publisher, "KV event tap connected.");
    }
}

/// A tap lost its publisher or could not reach it; it retries with backoff. One limit
/// for every tap: thousands of publishers gone at once (a node lost) log a line a
/// second with the count of the others, not one line per publisher per retry.
pub struct KvTapDisconnected<'a> {
    pub publisher: &'a str,
    pub error: &'a str,
    pub retry_in_ms: u64,
}

static DISCONNECTED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvTapDisconnected<'_> {
    fn emit(self, _stats: &AgentStats) {
        if let Some(suppressed) = DISCONNECTED.check() {
            warn!(publisher = %self.publisher, error = %self.error, retry_in_ms = self.retry_in_ms, suppressed, "KV event tap disconnected; reconnecting (suppressed: other taps' disconnections in the last second).");
        }
    }
}

/// A publisher broke the ZMTP protocol or one of the tap's limits (a frame or message
/// larger than allowed, too many frames, a bad handshake): the connection was dropped
/// before anything of what it claimed was held.
pub struct KvPeerViolation<'a> {
    pub publisher: &'a str,
    pub error: &'a str,
}

static PEER_VIOLATION: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvPeerViolation<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = PEER_VIOLATION.check() {
            warn!(publisher = %self.publisher, error = %self.error, suppressed, "KV publisher broke the protocol or a limit; connection dropped.");
        }
        add(&stats.kv_peer_violations, 1);
    }
}

/// A tap panicked (a bug): only its own connection ended, and it starts again.
pub struct KvTapPanicked<'a> {
    pub publisher: &'a str,
    pub error: &'a str,
}

impl InternalEvent<AgentStats> for KvTapPanicked<'_> {
    fn emit(self, stats: &AgentStats) {
        error!(publisher = %self.publisher, error = %self.error, "KV event tap panicked; restarting it.");
        add(&stats.kv_tap_panics, 1);
    }
}

/// An engine tap given no worker id cannot tell its worker yet (discovery has not
/// listed it, or the endpoint's process serves none or several): it waits.
pub struct KvWorkerUnresolved<'a> {
    pub publisher: &'a str,
    pub reason: &'a str,
}

impl InternalEvent<AgentStats> for KvWorkerUnresolved<'_> {
    fn emit(self, _stats: &AgentStats) {
        info!(publisher = %self.publisher, reason = %self.reason, "Waiting to learn which worker this KV publisher belongs to.");
    }
}

/// A read of Dynamo's discovery store that changed something.
pub struct DiscoveryRead<'a> {
    pub backend: &'a str,
    pub workers: usize,
    pub publishers: usize,
    pub changes: usize,
}

impl InternalEvent<AgentStats> for DiscoveryRead<'_> {
    fn emit(self, stats: &AgentStats) {
        info!(backend = %self.backend, workers = self.workers, kv_publishers = self.publishers, changes = self.changes, "Fleet changed in discovery.");
        add(&stats.discovery_changes, self.changes as u64);
    }
}

/// Dynamo's discovery store could not be read; what was known is kept (nothing is
/// retired on a failed read), and it is read again at the next poll.
pub struct DiscoveryFailed<'a> {
    pub backend: &'a str,
    pub error: &'a str,
}

static DISCOVERY_FAILED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for DiscoveryFailed<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = DISCOVERY_FAILED.check() {
            warn!(backend = %self.backend, error = %self.error, suppressed, "Cannot read Dynamo's discovery store; keeping the last read.");
        }
        add(&stats.discovery_errors, 1);
    }
}

/// An entry of the discovery store left unread: not a regular file, or over the size
/// an entry may have. The rest of the store is read.
pub struct DiscoveryEntrySkipped<'a> {
    pub path: &'a str,
    pub reason: &'a str,
}

static ENTRY_SKIPPED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for DiscoveryEntrySkipped<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = ENTRY_SKIPPED.check() {
            warn!(path = %self.path, reason = %self.reason, suppressed, "Discovery entry skipped.");
        }
        add(&stats.discovery_entries_skipped, 1);
    }
}

/// A discovered model name longer than a subject token holds: its records travel under
/// a shortened token (its first characters and its hash), the same at every agent and
/// collector.
pub struct ModelNameShortened {
    pub worker_id: u64,
    pub chars: usize,
}

static NAME_SHORTENED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for ModelNameShortened {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = NAME_SHORTENED.check() {
            warn!(
                worker_id = self.worker_id,
                chars = self.chars,
                suppressed,
                "A model name too long for a subject token: its subjects carry a shortened token."
            );
        }
        add(&stats.model_names_shortened, 1);
    }
}

/// A batch recovered through its publisher's replay socket.
pub struct KvBatchReplayed<'a> {
    pub publisher: &'a str,
    pub seq: u64,
}

impl InternalEvent<AgentStats> for KvBatchReplayed<'_> {
    fn emit(self, stats: &AgentStats) {
        debug!(publisher = %self.publisher, seq = self.seq, "KV batch replayed.");
        add(&stats.kv_batches_replayed, 1);
    }
}

/// A replay for what was missing before batch `next` ended.
pub struct KvReplayDone<'a> {
    pub publisher: &'a str,
    pub from: u64,
    pub next: u64,
    pub batches: usize,
    /// Everything missing was recovered.
    pub complete: bool,
}

impl InternalEvent<AgentStats> for KvReplayDone<'_> {
    fn emit(self, stats: &AgentStats) {
        if self.complete {
            info!(publisher = %self.publisher, from = self.from, next = self.next, batches = self.batches, "Missed KV batches recovered from the replay socket.");
            add(&stats.kv_gaps_recovered, 1);
        } else {
            warn!(publisher = %self.publisher, from = self.from, next = self.next, batches = self.batches, "The replay socket no longer holds every missed KV batch; the worker's mirror stays incomplete.");
        }
    }
}

/// A replay answer cut at its batch count or byte budget, or ended without its end
/// marker: the batches before the cut are used, those after it asked for again.
pub struct KvReplayCut<'a> {
    pub publisher: &'a str,
    pub kept: usize,
}

static REPLAY_CUT: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvReplayCut<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = REPLAY_CUT.check() {
            warn!(publisher = %self.publisher, kept = self.kept, suppressed, "A KV event replay answer was larger than the agent takes at once, or stopped short: cut after the batches kept; the rest are asked for again.");
        }
        add(&stats.kv_replay_cuts, 1);
    }
}

/// A KV batch whose engine timestamp is no time (not finite, before 2001 or after
/// 2286): ordered by its arrival instead, counted.
pub struct KvEngineTimeIgnored<'a> {
    pub publisher: &'a str,
    pub engine_ts: f64,
}

static ENGINE_TIME: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvEngineTimeIgnored<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = ENGINE_TIME.check() {
            warn!(publisher = %self.publisher, engine_ts = self.engine_ts, suppressed, "A KV batch's engine timestamp is no time; ordered by its arrival.");
        }
        add(&stats.kv_engine_times_ignored, 1);
    }
}

/// The replay socket could not be asked (down, refused, broke a limit).
pub struct KvReplayFailed<'a> {
    pub publisher: &'a str,
    pub replay: &'a str,
    pub error: &'a str,
}

static REPLAY_FAILED: LogLimiter = LogLimiter::new();

impl InternalEvent<AgentStats> for KvReplayFailed<'_> {
    fn emit(self, stats: &AgentStats) {
        if let Some(suppressed) = REPLAY_FAILED.check() {
            warn!(publisher = %self.publisher, replay = %self.replay, error = %self.error, suppressed, "KV event replay failed; the missed batches stay missing.");
        }
        add(&stats.kv_replay_failures, 1);
    }
}
