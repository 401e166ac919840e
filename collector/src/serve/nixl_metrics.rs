//! The NIXL pairs' families of the collector's `/metrics` (the pairs themselves are
//! folded in `fold::nixl`).

use kvscope_kit::prom::{labels, Exposition, Kind};
use kvscope_wire::nixl::{MergedLatency, NixlAgentRow, NixlPair};

fn histogram(out: &mut Exposition, name: &str, labels: &str, l: &MergedLatency) {
    kvscope_wire::nixl::write_latency_histogram(out, name, labels, &l.buckets, l.count, l.sum_ns);
}

/// The pairs' families, appended to the collector's `/metrics`. Every pair has its ok
/// and failed series, zero or not, so a rate over them always has data.
/// One series per NIXL agent whose worker a node agent told: joins the pair figures
/// (`local_agent`, `remote_agent`) to Dynamo workers in a query.
pub(crate) fn render_owners(out: &mut Exposition, rows: &[NixlAgentRow]) {
    let name = "kvscope_nixl_agent_worker_info";
    out.family(
        name,
        Kind::Gauge,
        "The Dynamo worker a NIXL agent belongs to, as the node agent told it from the processes (1 per agent).",
    );
    for r in rows {
        let Some(worker) = r.owner.worker_id else {
            continue;
        };
        let (worker, rank) = (
            worker.to_string(),
            r.owner.dp_rank.map(|d| d.to_string()).unwrap_or_default(),
        );
        out.gauge(
            name,
            &labels(&[
                ("node", &r.node),
                ("agent", &r.owner.agent),
                ("worker_id", &worker),
                ("dp_rank", &rank),
            ]),
            1,
        );
    }
}

pub fn render(out: &mut Exposition, pairs: &[NixlPair]) {
    let pair_labels = |p: &NixlPair, extra: &[(&str, &str)]| {
        let mut l = vec![
            ("local_agent", p.local_agent.as_str()),
            ("remote_agent", p.remote_agent.as_str()),
        ];
        l.extend_from_slice(extra);
        labels(&l)
    };
    let name = "kvscope_nixl_pair_transfers";
    out.family(
        name,
        Kind::Counter,
        "NIXL transfers between two agents, fleet-wide, by op and outcome (failed: at create, post or completion, or released in flight).",
    );
    for p in pairs {
        for (op, n) in &p.transfers_ok {
            out.counter(name, &pair_labels(p, &[("op", op), ("outcome", "ok")]), *n);
        }
        out.counter(
            name,
            &pair_labels(p, &[("op", "any"), ("outcome", "failed")]),
            p.transfers_failed,
        );
    }
    let name = "kvscope_nixl_pair_transfer_bytes";
    out.family(
        name,
        Kind::Counter,
        "Bytes of successful NIXL transfers between two agents.",
    );
    for p in pairs {
        out.counter(name, &pair_labels(p, &[]), p.bytes_ok);
    }
    let name = "kvscope_nixl_pair_transfers_bytes_unknown";
    out.family(
        name,
        Kind::Counter,
        "Successful NIXL transfers whose bytes the probes could not read (NIXL before 1.4 with the agent's telemetry off, or a build whose offsets are unknown): not in the bytes, nor the bandwidth.",
    );
    for p in pairs {
        out.counter(name, &pair_labels(p, &[]), p.ok_bytes_unknown);
    }
    let name = "kvscope_nixl_pair_transfer_latency_seconds";
    out.family(
        name,
        Kind::Histogram,
        "Post to done of successful NIXL transfers.",
    );
    for p in pairs.iter().filter(|p| p.latency.count > 0) {
        histogram(out, name, &pair_labels(p, &[]), &p.latency);
    }
    let name = "kvscope_nixl_pair_handshakes";
    out.family(
        name,
        Kind::Counter,
        "NIXL metadata exchanges (handshakes) by outcome. An empty remote_agent: the probes could not name the peer (unparsable metadata, or sent to an address).",
    );
    for p in pairs {
        out.counter(name, &pair_labels(p, &[("outcome", "ok")]), p.handshakes_ok);
        out.counter(
            name,
            &pair_labels(p, &[("outcome", "failed")]),
            p.handshakes_failed,
        );
    }
    let name = "kvscope_nixl_pair_handshake_latency_seconds";
    out.family(name, Kind::Histogram, "NIXL handshake call latency.");
    for p in pairs.iter().filter(|p| p.handshake_latency.count > 0) {
        histogram(out, name, &pair_labels(p, &[]), &p.handshake_latency);
    }
    let name = "kvscope_nixl_pair_transfers_in_flight";
    out.family(
        name,
        Kind::Gauge,
        "NIXL transfers posted and in progress between two agents, as of the agents' latest reports.",
    );
    for p in pairs {
        out.gauge(name, &pair_labels(p, &[]), p.in_flight);
    }
    let name = "kvscope_nixl_pair_oldest_in_flight_seconds";
    out.family(
        name,
        Kind::Gauge,
        "How long the oldest NIXL transfer in flight between two agents had been in progress (0: none in flight).",
    );
    for p in pairs {
        out.gauge(
            name,
            &pair_labels(p, &[]),
            p.oldest_in_flight_seconds.unwrap_or(0.0),
        );
    }
    let name = "kvscope_nixl_pair_metadata_invalidations";
    out.family(
        name,
        Kind::Counter,
        "invalidateRemoteMD calls on a remote agent's metadata (its process restarted or gone: stale peer state).",
    );
    for p in pairs {
        out.counter(name, &pair_labels(p, &[]), p.metadata_invalidations);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::nixl::LATENCY_BOUNDS_NS;

    #[test]
    fn every_pair_family_is_rendered_with_its_labels() {
        let mut latency = MergedLatency {
            count: 3,
            sum_ns: 6_000_000,
            max_ns: 3_000_000,
            ..MergedLatency::default()
        };
        latency.buckets = vec![0; LATENCY_BOUNDS_NS.len()];
        let p = NixlPair {
            local_agent: "d0".into(),
            remote_agent: "d1".into(),
            transfers_ok: [("READ".to_string(), 3)].into(),
            handshakes_failed: 4,
            latency,
            in_flight: 3,
            oldest_in_flight_seconds: Some(45.0),
            metadata_invalidations: 2,
            ..NixlPair::default()
        };
        let mut out = Exposition::new(kvscope_kit::prom::Format::Text);
        render(&mut out, std::slice::from_ref(&p));
        let text = out.finish();
        let pair = "local_agent=\"d0\",remote_agent=\"d1\"";
        for line in [
            format!("kvscope_nixl_pair_transfers_total{{{pair},op=\"READ\",outcome=\"ok\"}} 3\n"),
            format!("kvscope_nixl_pair_handshakes_total{{{pair},outcome=\"failed\"}} 4\n"),
            format!("kvscope_nixl_pair_transfer_latency_seconds_count{{{pair}}} 3\n"),
            format!("kvscope_nixl_pair_transfers_in_flight{{{pair}}} 3\n"),
            format!("kvscope_nixl_pair_oldest_in_flight_seconds{{{pair}}} 45\n"),
            format!("kvscope_nixl_pair_metadata_invalidations_total{{{pair}}} 2\n"),
        ] {
            assert!(text.contains(&line), "{line} not in\n{text}");
        }
    }
}
