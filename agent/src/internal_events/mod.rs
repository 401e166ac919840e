//! Everything the agent says about itself, one struct per thing (the kit's
//! [`InternalEvent`]): `emit()` logs with structured fields and bumps the matching
//! [`AgentCounters`](kvscope_wire::AgentCounters) field, so a counter never drifts from
//! its log line. Noisy warnings are rate-limited; the counters never are.

mod kv;
mod log;
mod publish;

pub use kv::*;
pub use log::*;
pub use publish::*;

/// The agent's events implement `InternalEvent<AgentStats>` (`crate::counters::AgentStats`).
pub use kvscope_kit::internal_events::{InternalEvent, LogLimiter};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counters::AgentStats;

    #[test]
    fn each_event_bumps_its_counter() {
        let s = AgentStats::default();
        KvBatchReceived {
            publisher: "p",
            events: 3,
        }
        .emit(&s);
        KvBadFrame {
            publisher: "p",
            error: &crate::kv_events::FrameError::FrameCount(2),
        }
        .emit(&s);
        KvDecodeError {
            publisher: "p",
            error: &crate::kv_events::PayloadError::TrailingBytes(1),
        }
        .emit(&s);
        KvUnknownEvent {
            publisher: "p",
            event_type: "X",
        }
        .emit(&s);
        KvMalformedEvent {
            publisher: "p",
            event_type: "BlockStored",
            reason: "r",
        }
        .emit(&s);
        KvSequenceGap {
            publisher: "p",
            expected: 3,
            got: 6,
            missed: 3,
        }
        .emit(&s);
        KvSequenceReset {
            publisher: "p",
            previous: 9,
            got: 0,
        }
        .emit(&s);
        LogLineRead.emit(&s);
        RecordingWriteFailed { error: "disk full" }.emit(&s);
        DiscoveryEntrySkipped {
            path: "v1/instances/x",
            reason: "not a regular file",
        }
        .emit(&s);
        ModelNameShortened {
            worker_id: 1,
            chars: 8000,
        }
        .emit(&s);
        KvReplayCut {
            publisher: "p",
            kept: 3,
        }
        .emit(&s);
        RequestIdShortened.emit(&s);
        KvEngineTimeIgnored {
            publisher: "p",
            engine_ts: 1e300,
        }
        .emit(&s);
        LogLineMalformed {
            kind: "selected_worker",
            reason: "no worker_id",
        }
        .emit(&s);
        DecisionJoined { request_id: "r" }.emit(&s);
        DecisionUnjoined {
            request_id: "r",
            half: "routing_input_only",
        }
        .emit(&s);
        MigrationLineParsed {
            kind: kvscope_wire::MigrationLogKind::Spill,
        }
        .emit(&s);
        RecordPublished { records: 3 }.emit(&s);
        PublishDropped {
            capacity: 1,
            max_bytes: 10,
            bytes: 11,
            subject: "s",
        }
        .emit(&s);
        KvPeerViolation {
            publisher: "p",
            error: "frame of 1099511627776 bytes refused",
        }
        .emit(&s);
        KvTapPanicked {
            publisher: "p",
            error: "bug",
        }
        .emit(&s);
        LogLineTooLong {
            source: "f",
            bytes: 1 << 30,
        }
        .emit(&s);
        RecordSplit {
            bytes: 2 << 20,
            parts: 3,
            subject: "s",
        }
        .emit(&s);
        RecordSetAside {
            error: "e",
            bytes: 1,
            records: 2,
            subject: "s",
        }
        .emit(&s);
        PublishFailed {
            error: "e",
            buffered: 1,
        }
        .emit(&s);
        RecordLate {
            behind_ms: 1.0,
            subject: "s",
        }
        .emit(&s);
        KvMediumLeftOut {
            publisher: "p",
            events: 2,
        }
        .emit(&s);
        KvMediumLeftOut {
            publisher: "p",
            events: 0,
        }
        .emit(&s);
        let c = s.snapshot();
        assert_eq!(
            c,
            kvscope_wire::AgentCounters {
                kv_batches: 1,
                kv_events: 3,
                kv_bad_frames: 1,
                kv_decode_errors: 1,
                kv_unknown_events: 1,
                kv_malformed_events: 1,
                kv_events_medium_left_out: 2,
                kv_fields_left_out_lora_id: 0,
                kv_fields_left_out_extra_keys: 0,
                kv_fields_left_out_kv_cache_spec_sliding_window: 0,
                kv_fields_left_out_session_id: 0,
                kv_fields_left_out_lookahead_token_ids: 0,
                kv_fields_left_out_other: 0,
                kv_events_refused_other_owner: 0,
                kv_events_refused_not_local: 0,
                kv_events_refused_other_cache_group: 0,
                kv_events_refused_unknown_cache_kind: 0,
                kv_events_refused_unlearned_cache_group: 0,
                kv_events_refused_ambiguous_salt: 0,
                kv_media_blocks: 0,
                kv_media_blocks_without_placeholders: 0,
                kv_salts_inherited: 0,
                kv_sequence_gaps: 1,
                kv_missed_batches: 3,
                kv_sequence_resets: 1,
                kv_peer_violations: 1,
                kv_tap_panics: 1,
                kv_batches_replayed: 0,
                kv_gaps_recovered: 0,
                kv_replay_failures: 0,
                kv_replay_cuts: 1,
                kv_engine_times_ignored: 1,
                discovery_changes: 0,
                discovery_errors: 0,
                discovery_entries_skipped: 1,
                model_names_shortened: 1,
                log_lines: 1,
                log_malformed_lines: 1,
                log_lines_too_long: 1,
                log_truncations: 0,
                request_ids_shortened: 1,
                log_lines_future: 0,
                decisions_joined: 1,
                decisions_unjoined: 1,
                decisions_traced: 0,
                router_tenants_unread: 0,
                router_candidates_unjoined: 0,
                migration_lines: 1,
                published: 3,
                messages_published: 1,
                publish_dropped: 1,
                records_split: 1,
                records_set_aside: 2,
                publish_errors: 1,
                recording_write_failures: 1,
                bus_refusals: 0,
                records_late: 1,
                records_clock_corrected: 0,
                decisions_clock_behind: 0,
            }
        );
    }
}
