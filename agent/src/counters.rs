//! The agent's live counters: one atomic per field of [`AgentCounters`], bumped only by
//! the typed events in [`crate::internal_events`], read as a snapshot for heartbeats and
//! `/metrics`.

use kvscope_wire::AgentCounters;
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! agent_stats {
    ($($field:ident: $help:literal),* $(,)?) => {
        /// Live counterpart of [`AgentCounters`] (same fields, same meaning).
        #[derive(Debug, Default)]
        pub struct AgentStats {
            $(#[doc = $help] pub $field: AtomicU64,)*
        }

        impl AgentStats {
            /// The counters as they are now. Listing every field (no `..Default`) makes a
            /// field added to the wire type a compile error here until the agent counts it.
            pub fn snapshot(&self) -> AgentCounters {
                AgentCounters {
                    $($field: self.$field.load(Ordering::Relaxed),)*
                }
            }

            /// `(name, help, value)` of every counter, for the Prometheus exposition.
            pub fn named(&self) -> Vec<(&'static str, &'static str, u64)> {
                vec![$((stringify!($field), $help, self.$field.load(Ordering::Relaxed)),)*]
            }
        }
    };
}

agent_stats!(
    kv_batches: "KV event batches received from the engines' publishers.",
    kv_events: "KV events in the batches received.",
    kv_bad_frames: "ZMQ messages that were not [topic, seq, payload] multiparts.",
    kv_decode_errors: "KV payloads that were not valid msgpack or not the vLLM batch shape.",
    kv_unknown_events: "KV events of a type the agent does not know (skipped).",
    kv_malformed_events: "KV events of a known type with fields missing or of the wrong type.",
    kv_events_medium_left_out: "KV events in the layout of Dynamo's mocker before 1.5 (medium left out, its group_idx in medium's slot): read with medium absent.",
    kv_fields_left_out_lora_id: "KV events with vLLM's lora_id set (deprecated for lora_name, which the agent carries): read, not carried.",
    kv_fields_left_out_extra_keys: "KV events with vLLM's extra_keys set: read for the cache salt Dynamo tags and the multimodal objects its frontend marked (hashed into their blocks); its other keys (vLLM's own multimodal hashes, LoRA names, prompt embeddings) not carried.",
    kv_fields_left_out_kv_cache_spec_sliding_window: "KV events with vLLM's kv_cache_spec_sliding_window set: read, not carried (a group's kind decides whether its events are taken).",
    kv_fields_left_out_session_id: "KV events with vLLM's session_id set (0.33 on): read, not carried.",
    kv_fields_left_out_lookahead_token_ids: "KV events with vLLM's lookahead_token_ids set (0.33 on): read, not carried.",
    kv_fields_left_out_other: "KV events with a field the agent does not know set (a newer engine's): read past, not carried.",
    kv_events_refused_other_owner: "KV events refused: their blocks are managed by another cache service (vLLM's ownership kvcr) or an owner no engine names.",
    kv_events_refused_not_local: "KV events refused: their blocks are not held by the publisher (vLLM's locality REMOTE, or one no engine names).",
    kv_events_refused_other_cache_group: "KV events refused: a KV cache group that keeps no prefixes (a hybrid model's sliding-window or Mamba group), as the event or its group's stores named its kind.",
    kv_events_refused_unknown_cache_kind: "KV events refused: a KV cache group kind no engine is known to send.",
    kv_events_refused_unlearned_cache_group: "KV events refused: a KV cache group other than the first whose kind no store has named yet.",
    kv_events_refused_ambiguous_salt: "KV stores refused: they continue a chain whose parent block was stored under two cache salts.",
    kv_media_blocks: "KV blocks stored holding multimodal objects (images, videos), hashed with them as Dynamo's publisher hashes them.",
    kv_media_blocks_without_placeholders: "Of those, blocks hashed without the model's image and video placeholder token ids (its config.json unread): they may not match the router's.",
    kv_salts_inherited: "KV stores that named no cache salt and took their parent block's (a salted chain continued; vLLM names the salt in a chain's first block only).",
    kv_sequence_gaps: "Gaps in a publisher's batch sequence numbers (batches lost before the agent).",
    kv_missed_batches: "KV batches lost in sequence gaps.",
    kv_sequence_resets: "Publisher sequence restarts (engine restarts).",
    kv_peer_violations: "Connections to a KV publisher dropped because the peer broke the ZMTP protocol or a size limit.",
    kv_tap_panics: "KV event taps that panicked and were restarted.",
    kv_batches_replayed: "KV batches recovered through a publisher's replay socket.",
    kv_gaps_recovered: "Gaps and late starts whose every missed batch the replay socket sent again.",
    kv_replay_failures: "Replay requests that failed (the missed batches stay missing).",
    kv_replay_cuts: "Replay answers cut at 16,384 batches or 64 MiB, or ended without their end marker (a ROUTER past its high-water mark): the batches before the cut used, the rest asked for again.",
    kv_engine_times_ignored: "KV batches whose engine timestamp is no time (not finite, before 2001 or after 2286): ordered by their arrival instead.",
    discovery_changes: "Workers and KV publishers that appeared, changed or went away in Dynamo's discovery store.",
    discovery_errors: "Failed reads of Dynamo's discovery store (retried).",
    discovery_entries_skipped: "Discovery store entries left unread (not a regular file, or over 4 MiB), counted at every read.",
    model_names_shortened: "Discovered workers whose model name is longer than a subject token holds (64 characters): their subjects carry a shortened token.",
    log_lines: "Router log lines read.",
    log_malformed_lines: "Router decision lines that could not be parsed.",
    log_lines_too_long: "Router log lines longer than max_line_bytes, skipped.",
    log_lines_future: "Router log lines dated more than 60 s ahead of this host's clock: their time was not taken.",
    log_truncations: "Times the router log was cut under the follower (copytruncate) and read again from its start.",
    request_ids_shortened: "Request ids longer than 256 bytes in the router log, kept as their first bytes and a hash.",
    decisions_joined: "Routing decisions joined (routing input with its selected worker).",
    decisions_unjoined: "Routing inputs or selections never joined within the join timeout.",
    decisions_traced: "Routing decisions read from Dynamo's request trace (DYN_REQUEST_TRACE).",
    router_tenants_unread: "Requests whose arrival line lacked the tenant_field the agent was told to read, or whose value tenant_pattern did not match: their tenant is their cache salt's.",
    router_candidates_unjoined: "What the router credited workers it scored (Dynamo 1.4/1.5's DEBUG `Formula for worker_id=…`, a line per worker; 1.6's disaggregated `Router selected a worker with lower KV cache overlap`, two workers a line) set beside no view of their request: its view never came while they were remembered (the `[ROUTING] Best` line's target not at DEBUG on 1.4), came before them, or named a worker they did not score.",
    migration_lines: "KVMIGRATE log lines read.",
    published: "Records published to NATS.",
    messages_published: "NATS messages those records went in (records released together share one).",
    publish_dropped: "Records dropped because the local buffer was full (records or bytes) while NATS was away.",
    records_split: "Records larger than one NATS message, sent in parts.",
    records_set_aside: "Records JetStream refused (not the connection): set aside so the others go on.",
    publish_errors: "Failed publish attempts to NATS (retried).",
    recording_write_failures: "Failed writes or flushes of the local recording (--record): those records are missing from it (they still went to NATS).",
    bus_refusals: "Times NATS refused this agent: its credentials, or a subject its permissions do not allow.",
    records_late: "Records later than the reorder window (sent at once).",
    records_clock_corrected: "Records from a source whose clock reads ahead of this host's, stamped back by its estimated offset.",
    decisions_clock_behind: "Decisions from a router log whose lines all reached the agent at least 50 ms late (its clock may be behind): flagged.",
);

/// Add `n` to a counter.
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_reads_every_counter() {
        let s = AgentStats::default();
        add(&s.kv_batches, 2);
        add(&s.publish_dropped, 5);
        let c = s.snapshot();
        assert_eq!(c.kv_batches, 2);
        assert_eq!(c.publish_dropped, 5);
        assert_eq!(s.named().len(), 59);
    }
}
