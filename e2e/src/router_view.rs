//! The router-view audit counted the way a person would check it: from the router's own
//! log, with a plain scan, and the radix tree's overlaps (the oracle), never through the
//! agent's parser or the collector's fold; the causes from a plain scan of the records.

use kvscope_wire::api::summary::RouterViewAudit;
use kvscope_wire::api::verdict::SpillVerdict;
use kvscope_wire::hashing::{chain_hash, sequence_hashes};
use kvscope_wire::{Envelope, KvEvent, Record, WorkerKey};
use std::collections::{BTreeMap, HashMap, HashSet};

// What counts as "lately" is the audit's definition, shared; how it is counted is not.
use kvscope_collector::fold::recent_changes::STALE_HORIZON_NS;

/// The audit of `verdicts` from the router's log text: per request, the first line that
/// states the router's view (Dynamo 1.6's `route request completed`, whose last
/// `request_id` is the route's; 1.4/1.5's DEBUG `[ROUTING] Best:`, whose first is the
/// event's), its `worker_id` and `overlap_blocks` set beside the truth (the oracle's
/// per-worker overlaps of each decision in `records`) where the request was judged on
/// that worker. The causes of each miss from `records` too (see [`Changes`]). For each
/// spill, what the router credited the verdict's best worker with, from its score lines
/// (1.4/1.5's DEBUG `Formula for worker_id=W … with N … blocks … request_id="…"`, the
/// first per request and worker), beside what the best held. Also how many lines stated
/// a view.
pub fn count(
    log: &str,
    verdicts: &[SpillVerdict],
    records: &[Envelope],
) -> (RouterViewAudit, usize) {
    let truth = crate::oracle::dynamo_overlaps(records);
    let changes = Changes::scan(records);
    let chosen: HashMap<&str, WorkerKey> = verdicts
        .iter()
        .map(|v| (v.request_id.as_str(), v.chosen))
        .collect();
    let best_of: HashMap<&str, WorkerKey> = verdicts
        .iter()
        .map(|v| (v.request_id.as_str(), v.best))
        .collect();
    let scores = scores(log);
    // A disaggregated request's first decision (its prefill worker's) is the judged one.
    let mut first = HashMap::new();
    for (id, o) in &truth {
        first.entry(id.as_str()).or_insert(o);
    }
    let truth: HashMap<&str, &BTreeMap<WorkerKey, u32>> = first;
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
            match changes.why(&id, worker, held, false) {
                Some(Why::RemovedLately(lag_ns)) => {
                    n.over_removed_lately += 1;
                    n.note_lag(lag_ns);
                }
                Some(Why::StoredAfter) => n.over_stored_after += 1,
                _ => {}
            }
        } else {
            n.under += 1;
            n.under_blocks += u64::from(held - believed);
            if let Some(Why::StoredLately(lag_ns)) = changes.why(&id, worker, believed, true) {
                n.under_stored_lately += 1;
                n.note_lag(lag_ns);
            }
        }
        if best > held {
            n.spills += 1;
            n.spills_unseen += u64::from(believed >= best);
            let best_worker = best_of[id.as_str()];
            if let Some(credit) = scores.get(&(id.clone(), best_worker)) {
                n.spills_best_scored += 1;
                let best_held = overlaps.get(&best_worker).copied().unwrap_or(0);
                if *credit < f64::from(best_held) {
                    let whole = credit.floor() as u32;
                    n.spills_best_stale += 1;
                    n.spills_best_stale_blocks += u64::from(best_held - whole);
                    if let Some(Why::StoredLately(_)) = changes.why(&id, best_worker, whole, true) {
                        n.spills_best_stale_stored_lately += 1;
                    }
                }
            }
        }
    }
    (n, lines)
}

/// The router's score lines: per (request, worker), the first credit it logged. Also
/// Dynamo 1.6's disaggregated prefill router's line for a choice made past the worker it
/// believed best: both workers' credits.
fn scores(log: &str) -> HashMap<(String, WorkerKey), f64> {
    let mut out = HashMap::new();
    for raw in log.lines() {
        let line = kvscope_lab::router_log::strip_ansi(raw);
        // (worker id, dp rank, credit) of each worker the line credits
        let (rest, credited) =
            if let Some(at) = line.find("Router selected a worker with lower KV cache overlap") {
                let rest = &line[at..];
                let side = |w, d, c| (field(rest, w), field(rest, d), field(rest, c));
                let credited = vec![
                    side(
                        "selected_worker_id",
                        "selected_dp_rank",
                        "selected_overlap_blocks",
                    ),
                    side(
                        "highest_overlap_worker_id",
                        "highest_overlap_dp_rank",
                        "highest_overlap_blocks",
                    ),
                ];
                (rest, credited)
            } else if let Some(at) = line.find("Formula for worker_id=") {
                let rest = &line[at + "Formula for ".len()..];
                let credit = rest
                    .split(" with ")
                    .nth(1)
                    .and_then(|r| r.split_whitespace().next())
                    .map(str::to_string);
                let credited = vec![(field(rest, "worker_id"), field(rest, "dp_rank"), credit)];
                (rest, credited)
            } else {
                continue;
            };
        let Some(id) = field(rest, "request_id") else {
            continue;
        };
        for (worker_id, dp_rank, credit) in credited {
            let (Some(worker_id), Some(credit)) = (
                worker_id.and_then(|v| v.parse::<u64>().ok()),
                credit.and_then(|v| v.parse::<f64>().ok()),
            ) else {
                continue;
            };
            let dp_rank = dp_rank.and_then(|v| v.parse().ok()).unwrap_or(0);
            out.entry((id.clone(), WorkerKey { worker_id, dp_rank }))
                .or_insert(credit);
        }
    }
    out
}

/// The first value of `key` in a line's fields `rest` (quotes trimmed).
fn field(rest: &str, key: &str) -> Option<String> {
    format!(" {rest}")
        .split(&format!(" {key}="))
        .nth(1)?
        .split_whitespace()
        .next()
        .map(|v| v.trim_matches('"').to_string())
}

#[derive(Debug, PartialEq, Eq)]
enum Why {
    /// How long before the decision.
    StoredLately(u64),
    RemovedLately(u64),
    StoredAfter,
}

/// A block's changes on one worker: (record index, record time, stored or removed).
type BlockChanges = HashMap<(WorkerKey, u64), Vec<(usize, u64, bool)>>;

/// Every block change of the run, in record order, by worker and sequence hash (a
/// store's hashes chained from its parent's, as the engine named it), with each
/// request's first decision and first view: a miss is explained by the changes
/// recorded before the later of the two, as the collector compares them then.
struct Changes {
    /// Per (worker, sequence hash).
    of_block: BlockChanges,
    /// Per request: its chain, its decision's record time, and the index of the later
    /// of its decision and its view.
    requests: HashMap<String, (Vec<u64>, u64, usize)>,
}

impl Changes {
    fn scan(records: &[Envelope]) -> Self {
        let mut of_block = BlockChanges::new();
        let mut seq_of: HashMap<(WorkerKey, u64), u64> = HashMap::new();
        let mut requests: HashMap<String, (Vec<u64>, u64, usize)> = HashMap::new();
        let mut viewed: HashMap<&str, usize> = HashMap::new();
        for (i, e) in records.iter().enumerate() {
            match &e.record {
                Record::KvEvents(b) => {
                    for ev in &b.events {
                        match ev {
                            KvEvent::BlockStored {
                                block_hashes,
                                parent_block_hash,
                                ..
                            } => {
                                let locals = ev.stored_local_hashes().unwrap_or_default();
                                let mut parent = parent_block_hash
                                    .and_then(|p| seq_of.get(&(b.worker, p)).copied());
                                for (engine, local) in block_hashes.iter().zip(locals.iter()) {
                                    let seq = chain_hash(parent, *local);
                                    seq_of.insert((b.worker, *engine), seq);
                                    of_block.entry((b.worker, seq)).or_default().push((
                                        i,
                                        e.observed_ns,
                                        true,
                                    ));
                                    parent = Some(seq);
                                }
                            }
                            KvEvent::BlockRemoved { block_hashes, .. } => {
                                for engine in block_hashes {
                                    if let Some(seq) = seq_of.get(&(b.worker, *engine)) {
                                        of_block.entry((b.worker, *seq)).or_default().push((
                                            i,
                                            e.observed_ns,
                                            false,
                                        ));
                                    }
                                }
                            }
                            KvEvent::AllBlocksCleared => {}
                        }
                    }
                }
                Record::Decision(d) if !requests.contains_key(&d.request_id) => {
                    let chain = d
                        .sequence_hashes
                        .clone()
                        .unwrap_or_else(|| sequence_hashes(&d.local_hashes));
                    requests.insert(d.request_id.clone(), (chain, e.observed_ns, i));
                }
                Record::RouterView(v) => {
                    viewed.entry(v.request_id.as_str()).or_insert(i);
                }
                _ => {}
            }
        }
        for (id, (_, _, at)) in requests.iter_mut() {
            *at = (*at).max(viewed.get(id.as_str()).copied().unwrap_or(0));
        }
        Self { of_block, requests }
    }

    /// Why request `id`'s view of `worker` went wrong at chain position `pos` (the first
    /// block it got wrong): under or over.
    fn why(&self, id: &str, worker: WorkerKey, pos: u32, under: bool) -> Option<Why> {
        let (chain, decided_ns, compared_at) = self.requests.get(id)?;
        let block = chain.get(pos as usize)?;
        let seen: Vec<&(usize, u64, bool)> = self
            .of_block
            .get(&(worker, *block))?
            .iter()
            .filter(|(i, _, _)| i < compared_at)
            .collect();
        let lately = |t: u64| t <= *decided_ns && decided_ns - t <= STALE_HORIZON_NS;
        let last_store = seen
            .iter()
            .filter(|(_, t, stored)| *stored && t <= decided_ns)
            .map(|(_, t, _)| *t)
            .max();
        if under {
            return last_store
                .filter(|t| lately(*t))
                .map(|t| Why::StoredLately(decided_ns - t));
        }
        if let Some(s) = last_store {
            // The latest removal since that store.
            let removed = seen
                .iter()
                .filter(|(_, t, stored)| !*stored && *t >= s && lately(*t))
                .map(|(_, t, _)| *t)
                .max();
            if let Some(t) = removed {
                return Some(Why::RemovedLately(decided_ns - t));
            }
        }
        seen.iter()
            .any(|(_, t, stored)| *stored && t > decided_ns)
            .then_some(Why::StoredAfter)
    }
}
