//! The ids every kvscope process derives for the same request, without shared state: a
//! trace id per request (so the agent's, the collector's and the actuator's spans about it
//! land in one trace) and span ids per event about it. The collector's verdicts carry
//! them as exemplars; the OTLP exporter puts them on spans.

/// Seed of the id hashes ("kvscope").
const ID_SEED: u64 = 0x006b_7673_636f_7065;

/// A deterministic trace id for `key` (e.g. a request id): every span about the same
/// request, from any kvscope process, lands in the same trace.
pub fn trace_id(key: &str) -> Vec<u8> {
    let id = xxhash_rust::xxh3::xxh3_128_with_seed(key.as_bytes(), ID_SEED);
    // An all-zero trace id is invalid in OTLP.
    id.max(1).to_be_bytes().to_vec()
}

/// [`trace_id`] as lowercase hex: how Prometheus exemplars and Grafana name a trace.
pub fn trace_id_hex(key: &str) -> String {
    trace_id(key).iter().map(|b| format!("{b:02x}")).collect()
}

/// A deterministic span id for `key` (e.g. `verdict/<request id>`), so a span about
/// the same request can link to it without shared state.
pub fn span_id(key: &str) -> Vec<u8> {
    let id = xxhash_rust::xxh3::xxh3_64_with_seed(key.as_bytes(), ID_SEED);
    id.max(1).to_be_bytes().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_deterministic_and_distinct() {
        assert_eq!(trace_id("req-1"), trace_id("req-1"));
        assert_ne!(trace_id("req-1"), trace_id("req-2"));
        assert_eq!(trace_id("x").len(), 16);
        assert_eq!(span_id("x").len(), 8);
        assert_ne!(span_id("verdict/a"), span_id("migration/a"));
        assert_eq!(trace_id_hex("x").len(), 32);
    }
}
