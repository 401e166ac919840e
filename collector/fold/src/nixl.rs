//! NIXL figures across the fleet, per (local agent → remote agent) pair: transfers, bytes,
//! bandwidth and latency, handshakes by outcome — summed over every agent's latest
//! cumulative report, shown next to the spill figures.

use kvscope_wire::api::summary::AgentStatus;
use kvscope_wire::nixl::{NixlAgentRow, XferStage};
use std::collections::BTreeMap;

use kvscope_wire::nixl::NixlPair;

/// The owners of NIXL agents every node agent's latest report tells, by node.
pub fn owners(agents: &BTreeMap<String, AgentStatus>) -> Vec<NixlAgentRow> {
    agents
        .iter()
        .filter_map(|(node, a)| Some((node, a.nixl.as_ref()?)))
        .flat_map(|(node, r)| {
            r.owners.iter().map(|o| NixlAgentRow {
                node: node.clone(),
                owner: o.clone(),
            })
        })
        .collect()
}

/// The pairs of every agent's latest NIXL report.
pub fn pairs(agents: &BTreeMap<String, AgentStatus>) -> Vec<NixlPair> {
    let mut by_pair: BTreeMap<(String, String), NixlPair> = BTreeMap::new();
    // The bandwidth's bytes and time: of the series whose every transfer's bytes were
    // read (a transfer of unknown bytes would count its time and none of its bytes).
    let mut measured: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    let pair = |l: &str, r: &str| -> (String, String) { (l.to_string(), r.to_string()) };
    for report in agents.values().filter_map(|a| a.nixl.as_ref()) {
        for t in &report.transfers {
            let k = pair(&t.local_agent, &t.remote_agent);
            let p = by_pair.entry(k).or_default();
            if t.stage == XferStage::Complete && t.status == "SUCCESS" {
                // Counts come from agents' reports: saturate on a crafted one.
                let ok = p.transfers_ok.entry(t.op.clone()).or_default();
                *ok = ok.saturating_add(t.transfers);
                p.bytes_ok = p.bytes_ok.saturating_add(t.bytes);
                p.ok_bytes_unknown = p.ok_bytes_unknown.saturating_add(t.bytes_unknown);
                p.latency.add(&t.latency);
                if t.bytes_unknown == 0 {
                    let m = measured
                        .entry(pair(&t.local_agent, &t.remote_agent))
                        .or_default();
                    m.0 = m.0.saturating_add(t.bytes);
                    m.1 = m.1.saturating_add(t.latency.sum_ns);
                }
            } else {
                p.transfers_failed = p.transfers_failed.saturating_add(t.transfers);
            }
        }
        for f in &report.in_flight {
            let p = by_pair
                .entry(pair(&f.local_agent, &f.remote_agent))
                .or_default();
            p.in_flight = p.in_flight.saturating_add(f.transfers);
            let age = f.oldest_age_ns as f64 / 1e9;
            p.oldest_in_flight_seconds =
                Some(p.oldest_in_flight_seconds.map_or(age, |a| a.max(age)));
        }
        for c in report
            .calls
            .iter()
            .filter(|c| c.call == "invalidateRemoteMD")
        {
            let p = by_pair
                .entry(pair(&c.local_agent, &c.remote_agent))
                .or_default();
            p.metadata_invalidations = p.metadata_invalidations.saturating_add(c.calls);
        }
        for c in report.calls.iter().filter(|c| is_handshake(&c.call)) {
            let k = pair(&c.local_agent, &c.remote_agent);
            let p = by_pair.entry(k).or_default();
            if c.status == "SUCCESS" {
                p.handshakes_ok = p.handshakes_ok.saturating_add(c.calls);
                p.handshake_ok_latency.add(&c.latency);
            } else {
                p.handshakes_failed = p.handshakes_failed.saturating_add(c.calls);
            }
            p.handshake_latency.add(&c.latency);
        }
    }
    by_pair
        .into_iter()
        .map(|((local, remote), mut p)| {
            let (bytes, ns) = measured
                .get(&(local.clone(), remote.clone()))
                .copied()
                .unwrap_or_default();
            p.local_agent = local;
            p.remote_agent = remote;
            p.bandwidth_bytes_per_second =
                (ns > 0 && bytes > 0).then(|| bytes as f64 / (ns as f64 / 1e9));
            p
        })
        .collect()
}

/// Metadata-exchange calls (the `call` names the agent reports).
pub fn is_handshake(call: &str) -> bool {
    kvscope_wire::nixl::HANDSHAKE_CALLS.contains(&call)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_wire::nixl::{
        LatencySummary, NixlCallStats, NixlReport, NixlTransferStats, LATENCY_BOUNDS_NS,
    };

    fn xfer(
        local: &str,
        remote: &str,
        status: &str,
        n: u64,
        bytes: u64,
        l: &[u64],
    ) -> NixlTransferStats {
        NixlTransferStats {
            pid: 1,
            local_agent: local.into(),
            remote_agent: remote.into(),
            op: "READ".into(),
            stage: if status == "SUCCESS" {
                XferStage::Complete
            } else {
                XferStage::Post
            },
            status: status.into(),
            transfers: n,
            bytes,
            bytes_unknown: 0,
            descriptors: 0,
            latency: LatencySummary::exact(l),
        }
    }

    #[test]
    fn pairs_sum_agents_and_split_outcomes() {
        let mut agents = BTreeMap::new();
        for (agent, ok_lat) in [
            ("node-a", vec![1_000_000u64, 3_000_000]),
            ("node-b", vec![2_000_000]),
        ] {
            agents.insert(
                agent.to_string(),
                AgentStatus {
                    nixl: Some(NixlReport {
                        transfers: vec![
                            xfer("d0", "d1", "SUCCESS", ok_lat.len() as u64, 1 << 20, &ok_lat),
                            xfer("d0", "d1", "ERR_BACKEND", 1, 0, &[]),
                        ],
                        calls: vec![NixlCallStats {
                            pid: 1,
                            local_agent: "d0".into(),
                            remote_agent: "d1".into(),
                            call: "loadRemoteMD".into(),
                            status: "ERR_MISMATCH".into(),
                            calls: 2,
                            bytes: 0,
                            bytes_partial: 0,
                            latency: LatencySummary::exact(&[10_000, 20_000]),
                        }],
                        ..NixlReport::default()
                    }),
                    ..AgentStatus::default()
                },
            );
        }
        let p = pairs(&agents);
        assert_eq!(p.len(), 1);
        let p = &p[0];
        assert_eq!(p.transfers_ok["READ"], 3);
        assert_eq!(p.transfers_failed, 2);
        assert_eq!(p.bytes_ok, 2 << 20);
        assert_eq!(
            (p.latency.count, p.latency.sum_ns, p.latency.max_ns),
            (3, 6_000_000, 3_000_000)
        );
        let bw = p.bandwidth_bytes_per_second.unwrap();
        assert!((bw - (2u64 << 20) as f64 / 0.006).abs() < 1.0, "{bw}");
        assert_eq!(p.latency.quantile_ns(0.5), Some(2_500_000));
        assert_eq!(
            p.latency.quantile_ns(1.0),
            Some(3_000_000),
            "capped at the exact max"
        );
        assert_eq!((p.handshakes_ok, p.handshakes_failed), (0, 4));
    }

    #[test]
    fn crafted_report_counts_saturate_instead_of_overflowing() {
        let mut agents = BTreeMap::new();
        for agent in ["node-a", "node-b"] {
            let mut ok = xfer("d0", "d1", "SUCCESS", u64::MAX - 1, u64::MAX - 1, &[1_000]);
            ok.latency.buckets = vec![u64::MAX - 1; LATENCY_BOUNDS_NS.len()];
            agents.insert(
                agent.to_string(),
                AgentStatus {
                    nixl: Some(NixlReport {
                        transfers: vec![ok, xfer("d0", "d1", "ERR_BACKEND", u64::MAX, 0, &[])],
                        calls: vec![NixlCallStats {
                            pid: 1,
                            local_agent: "d0".into(),
                            remote_agent: "d1".into(),
                            call: "loadRemoteMD".into(),
                            status: "SUCCESS".into(),
                            calls: u64::MAX,
                            bytes: 0,
                            bytes_partial: 0,
                            latency: LatencySummary::exact(&[]),
                        }],
                        ..NixlReport::default()
                    }),
                    ..AgentStatus::default()
                },
            );
        }
        let p = &pairs(&agents)[0];
        assert_eq!(p.transfers_ok["READ"], u64::MAX);
        assert_eq!(p.bytes_ok, u64::MAX);
        assert_eq!(p.transfers_failed, u64::MAX);
        assert_eq!(p.handshakes_ok, u64::MAX);
        assert_eq!(p.latency.buckets[0], u64::MAX);
    }

    #[test]
    fn in_flight_transfers_and_invalidations_show_per_pair() {
        use kvscope_wire::nixl::NixlInFlight;
        let mut agents = BTreeMap::new();
        for (agent, pid, n, age_ns) in [
            ("node-a", 1, 2, 3_000_000_000u64),
            ("node-b", 2, 1, 45_000_000_000),
        ] {
            agents.insert(
                agent.to_string(),
                AgentStatus {
                    nixl: Some(NixlReport {
                        in_flight: vec![NixlInFlight {
                            pid,
                            local_agent: "d0".into(),
                            remote_agent: "d1".into(),
                            transfers: n,
                            oldest_age_ns: age_ns,
                        }],
                        calls: vec![NixlCallStats {
                            pid,
                            local_agent: "d0".into(),
                            remote_agent: "d1".into(),
                            call: "invalidateRemoteMD".into(),
                            status: "SUCCESS".into(),
                            calls: 1,
                            bytes: 0,
                            bytes_partial: 0,
                            latency: LatencySummary::exact(&[]),
                        }],
                        ..NixlReport::default()
                    }),
                    ..AgentStatus::default()
                },
            );
        }
        let p = &pairs(&agents)[0];
        assert_eq!((p.in_flight, p.metadata_invalidations), (3, 2));
        assert_eq!(p.oldest_in_flight_seconds, Some(45.0));
    }
}
