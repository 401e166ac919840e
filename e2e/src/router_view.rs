//! The router-view audit counted the way a person would check it: from the router's own
//! log, with a plain scan, and the radix tree's overlaps (the oracle), never through the
//! agent's parser or the collector's fold.

use kvscope_wire::api::summary::RouterViewAudit;
use kvscope_wire::api::verdict::SpillVerdict;
use kvscope_wire::WorkerKey;
use std::collections::{BTreeMap, HashMap, HashSet};

/// The audit of `verdicts` from the router's log text: per request, the first line that
/// states the router's view (Dynamo 1.6's `route request completed`, whose last
/// `request_id` is the route's; 1.4/1.5's DEBUG `[ROUTING] Best:`, whose first is the
/// event's), its `worker_id` and `overlap_blocks` set beside `truth` (the oracle's
/// per-worker overlaps of each decision) where the request was judged on that worker.
/// Also how many lines stated a view.
pub fn count(
    log: &str,
    verdicts: &[SpillVerdict],
    truth: &[(String, BTreeMap<WorkerKey, u32>)],
) -> (RouterViewAudit, usize) {
    let chosen: HashMap<&str, WorkerKey> = verdicts
        .iter()
        .map(|v| (v.request_id.as_str(), v.chosen))
        .collect();
    let truth: HashMap<&str, &BTreeMap<WorkerKey, u32>> =
        truth.iter().map(|(id, o)| (id.as_str(), o)).collect();
    let mut n = RouterViewAudit::default();
    let (mut lines, mut seen) = (0, HashSet::new());
    for raw in log.lines() {
        let line = kvscope_lab::router_log::strip_ansi(raw);
        let last_id = if line.contains("route request completed") {
            true
        } else if line.contains("[ROUTING] Best:") {
            false
        } else {
            continue;
        };
        let values = |key: &str| -> Vec<String> {
            line.split(&format!(" {key}="))
                .skip(1)
                .filter_map(|rest| rest.split_whitespace().next())
                .map(|v| v.trim_matches('"').to_string())
                .collect()
        };
        let ids = values("request_id");
        let id = if last_id { ids.last() } else { ids.first() };
        let (Some(id), Some(worker_id), Some(believed)) = (
            id.cloned(),
            values("worker_id")
                .first()
                .and_then(|v| v.parse::<u64>().ok()),
            values("overlap_blocks")
                .first()
                .and_then(|v| v.parse::<u32>().ok()),
        ) else {
            continue;
        };
        lines += 1;
        if !seen.insert(id.clone()) {
            continue;
        }
        let dp_rank = values("dp_rank")
            .first()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let worker = WorkerKey { worker_id, dp_rank };
        if chosen.get(id.as_str()) != Some(&worker) {
            continue;
        }
        let Some(overlaps) = truth.get(id.as_str()) else {
            continue;
        };
        let held = overlaps.get(&worker).copied().unwrap_or(0);
        let best = overlaps.values().copied().max().unwrap_or(0);
        n.compared += 1;
        if believed == held {
            n.exact += 1;
        } else if believed > held {
            n.over += 1;
            n.over_blocks += u64::from(believed - held);
        } else {
            n.under += 1;
            n.under_blocks += u64::from(held - believed);
        }
        if best > held {
            n.spills += 1;
            n.spills_unseen += u64::from(believed >= best);
        }
    }
    (n, lines)
}
