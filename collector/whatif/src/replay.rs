//! The recorded requests replayed in time over each worker's simulated cache: every
//! question of the what-if runs its requests through [`WhatIf::replay_routed`].
//!
//! A request's prefix is matched when it is routed, against what each worker had
//! stored by then (what the router and kvscope's mirror see), but its prompt's blocks
//! are stored only at its prefill — its first token — and held from then until it ends,
//! as an engine does: a request waiting in a loaded engine's queue has no blocks yet
//! (its store events come at its prefill), and a running request's blocks are never
//! evicted. Storing at the decision instead made every queued request's prompt a hit
//! for the next one and held more blocks than the engine had: on a loaded lab (256
//! blocks per worker, time to first token 1.4 s at the median) the simulated caches
//! hit more than the recorded run at a size of one block, and the capacity question's
//! calibration fell to nothing. Its reply is stored on the worker it went to as it
//! ends. A request's life comes from its request-trace end (Dynamo's request trace),
//! and without one the median request's (or, with no request timed, none: its blocks
//! are stored and freed at its decision). A request goes where the recording sent it,
//! or where a [`Router`] says.

use super::cache::SimulatedCache;
use super::{RoutedRequest, WhatIf};
use kvscope_wire::{SequenceHash, WorkerKey};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

/// A request's life, in the recording's time (ns).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Lifetime {
    pub first_token_ns: u64,
    pub end_ns: u64,
    pub output_tokens: u64,
    /// Its judged decision is its prefill leg (a prefill worker of a disaggregated
    /// fleet): that worker holds it until its first token only, and decodes nothing.
    pub prefill_leg: bool,
}

/// Every request's life, and how many were timed by their own request-trace end.
#[derive(Debug, Clone)]
pub(crate) struct Lifetimes {
    pub of: Vec<Lifetime>,
    pub timed: u64,
}

/// Output tokens counted per request at most (a trace claiming more is bounded here).
const MAX_OUTPUT_TOKENS: u64 = 1 << 20;

/// A router the replay asks where each request goes, and tells each request's life.
pub(crate) trait Router {
    /// Where request `i` goes, each candidate worker holding `hits` of its prefix now.
    fn route(&mut self, i: usize, r: &RoutedRequest, hits: &[(WorkerKey, usize)]) -> WorkerKey;
    /// Whether the router counts each request's output blocks as they grow.
    fn tracks_output_blocks(&self) -> bool;
    fn first_token(&mut self, i: usize, at_ns: u64);
    fn output_block(&mut self, i: usize);
    /// The router's own bound on a request's life passed (Dynamo expires a request
    /// after 300 s): its load goes, its session stays held until it ends.
    fn expired(&mut self, i: usize, at_ns: u64);
    fn ended(&mut self, i: usize, at_ns: u64);
}

/// How long Dynamo's router books a request at most.
const ROUTER_EXPIRY_NS: u64 = 300_000_000_000;

/// What falls due after a decision, in this order at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    /// Its prefill: its prompt's blocks are stored and held on its worker.
    Prefill,
    FirstToken,
    OutputBlock,
    /// The previous turn's reply is stored on its worker.
    Reply,
    Expired,
    End,
}

/// The workers a request could have gone to: its model's, of its pool (a disaggregated
/// fleet's prefill workers, or the others).
pub(crate) type Pool<'a> = (Option<&'a str>, bool);

/// Each request's previous turn: the longest earlier request of its model whose whole
/// chain begins its own (a sequence hash names its whole prefix, so one lookup per
/// block finds it). A chat turn's prompt is the previous prompt, its reply and a new
/// message, so this follows a conversation without the session's name, which no router
/// log gives. A chain several requests had (first turns that differ only past their last
/// full block) names no one turn, and a turn already followed is not followed again (a
/// regenerated reply, a shared prompt): those start conversations of their own.
pub(crate) fn previous_turns(requests: &[RoutedRequest]) -> Vec<Option<usize>> {
    let mut models: HashMap<Option<&str>, u32> = HashMap::new();
    // (model, a chain's last hash) → the request that had that chain, or none if several.
    let mut by_last: HashMap<(u32, SequenceHash), Option<usize>> = HashMap::new();
    let mut followed = vec![false; requests.len()];
    let mut previous = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        let n = models.len() as u32;
        let model = *models.entry(r.model.as_deref()).or_insert(n);
        // A strictly shorter chain: a repeated prompt is no next turn.
        let longest = r.chain[..r.chain.len().saturating_sub(1)]
            .iter()
            .rev()
            .find_map(|h| by_last.get(&(model, *h)).copied());
        let prev = longest.flatten().filter(|&p| !followed[p]);
        if let Some(p) = prev {
            followed[p] = true;
        }
        previous.push(prev);
        if let Some(&last) = r.chain.last() {
            by_last
                .entry((model, last))
                .and_modify(|had| *had = None)
                .or_insert(Some(i));
        }
    }
    previous
}

impl WhatIf {
    /// Each request's life from its request-trace end, counted from when the frontend
    /// received it (the trace's own clock), never before its decision; a request
    /// without one lives as long as the median one. `None` when no request was timed.
    pub(crate) fn compute_lifetimes(requests: &[RoutedRequest]) -> Option<Lifetimes> {
        let timed = |r: &RoutedRequest| -> Option<(u64, u64, u64, bool)> {
            let e = r.end.as_ref()?;
            let ns = |ms: f64| (ms * 1e6).round().clamp(0.0, 1e15) as u64;
            let total = ns(e.total_ms?);
            let first = e.ttft_ms.map_or(total, ns).min(total);
            let anchor = if e.received_ns > 0 {
                e.received_ns
            } else {
                r.decided_ns
            };
            // After the decision: it came after the arrival the trace counts from.
            let since_decision = |d: u64| anchor.saturating_add(d).saturating_sub(r.decided_ns);
            Some((
                since_decision(first),
                since_decision(total),
                e.output_tokens.min(MAX_OUTPUT_TOKENS),
                e.prefill_worker == Some(r.worker),
            ))
        };
        let known: Vec<Option<(u64, u64, u64, bool)>> = requests.iter().map(timed).collect();
        let mut durations: Vec<(u64, u64, u64)> = known
            .iter()
            .flatten()
            .map(|&(first, total, out, _)| (total, first, out))
            .collect();
        if durations.is_empty() {
            return None;
        }
        let n = durations.len() as u64;
        durations.sort_unstable();
        let (m_total, m_first, m_out) = durations[durations.len() / 2];
        let of = requests
            .iter()
            .zip(known)
            .map(|(r, k)| {
                let (first, total, output_tokens, prefill_leg) =
                    k.unwrap_or((m_first, m_total, m_out, false));
                let first_token_ns = r.decided_ns.saturating_add(first);
                Lifetime {
                    first_token_ns,
                    // A prefill worker holds the request until its first token only.
                    end_ns: if prefill_leg {
                        first_token_ns
                    } else {
                        r.decided_ns.saturating_add(total).max(first_token_ns)
                    },
                    output_tokens: if prefill_leg { 0 } else { output_tokens },
                    prefill_leg,
                }
            })
            .collect();
        Some(Lifetimes { of, timed: n })
    }

    /// The pool request `r` was routed in.
    pub(crate) fn pool_of<'a>(&self, r: &'a RoutedRequest) -> Pool<'a> {
        (
            r.model.as_deref(),
            self.prefill_workers.contains(&r.worker.worker_id),
        )
    }

    /// Each pool's workers, in one order (ties go to the first, as the collector's
    /// verdict breaks them by worker key): those its requests went to, and those
    /// discovery listed up at the recording's end that none went to.
    pub(crate) fn workers_by_pool(&self) -> BTreeMap<Pool<'_>, Vec<WorkerKey>> {
        let mut of: BTreeMap<Pool<'_>, Vec<WorkerKey>> = BTreeMap::new();
        for r in &self.requests {
            of.entry(self.pool_of(r)).or_default().push(r.worker);
        }
        for w in &self.idle_workers {
            let pool = (
                w.model.as_deref(),
                self.prefill_workers.contains(&w.key.worker_id),
            );
            if let Some(ws) = of.get_mut(&pool) {
                ws.push(w.key);
            }
        }
        for ws in of.values_mut() {
            ws.sort_unstable();
            ws.dedup();
        }
        of
    }

    /// Every request replayed in order over caches of `blocks(worker)` each, each sent
    /// where `router` says (else where it went in the recording), holding its blocks for
    /// its life; `each` is told the request, where it went, the prefix that worker held,
    /// and, when `others` (or routed), the worker of its pool holding more of it than any
    /// other and more than that one (the best, for a spill), with how much.
    pub(crate) fn replay_routed(
        &self,
        blocks: impl Fn(&WorkerKey) -> u64,
        others: bool,
        mut router: Option<&mut dyn Router>,
        mut each: impl FnMut(&RoutedRequest, WorkerKey, usize, Option<(WorkerKey, usize)>),
    ) -> super::CacheTotals {
        fn cache<'c>(
            caches: &'c mut HashMap<WorkerKey, SimulatedCache>,
            w: WorkerKey,
            blocks: &impl Fn(&WorkerKey) -> u64,
        ) -> &'c mut SimulatedCache {
            caches
                .entry(w)
                .or_insert_with_key(|w| SimulatedCache::new(blocks(w) as usize))
        }
        let mut caches: HashMap<WorkerKey, SimulatedCache> = HashMap::new();
        let candidates = others || router.is_some();
        let of_pool = if candidates {
            self.workers_by_pool()
        } else {
            BTreeMap::new()
        };
        let lives = self.lifetimes.as_ref();
        let replies = self.replies();
        let mut went: Vec<WorkerKey> = Vec::with_capacity(self.requests.len());
        let mut hits: Vec<(WorkerKey, usize)> = Vec::new();
        let mut due: BinaryHeap<Reverse<(u64, Due, u64, usize)>> = BinaryHeap::new();
        let mut order = 0u64;
        let mut push = |due: &mut BinaryHeap<_>, at: u64, what: Due, i: usize| {
            order += 1;
            due.push(Reverse((at, what, order, i)));
        };
        let mut stored = vec![false; self.requests.len()];
        let mut t = super::CacheTotals::default();
        for (i, r) in self.requests.iter().enumerate() {
            while let Some(&Reverse((at, what, _, p))) = due.peek() {
                if at > r.decided_ns {
                    break;
                }
                due.pop();
                match what {
                    Due::Prefill => {
                        cache(&mut caches, went[p], &blocks).acquire(&self.requests[p].chain);
                    }
                    Due::FirstToken => {
                        if let Some(router) = router.as_mut() {
                            router.first_token(p, at);
                        }
                    }
                    Due::OutputBlock => {
                        if let Some(router) = router.as_mut() {
                            router.output_block(p);
                        }
                    }
                    Due::Reply => self.store_reply(p, &replies, &mut stored, |reply| {
                        cache(&mut caches, went[p], &blocks).store(reply)
                    }),
                    Due::Expired => {
                        if let Some(router) = router.as_mut() {
                            router.expired(p, at);
                        }
                    }
                    Due::End => {
                        cache(&mut caches, went[p], &blocks).release(&self.requests[p].chain);
                        if let Some(router) = router.as_mut() {
                            router.ended(p, at);
                        }
                    }
                }
            }
            // The previous turn's reply, if its end has not come by the recording's
            // clock: its next turn carries it, so it was there.
            if let Some(p) = self.previous.get(i).copied().flatten() {
                self.store_reply(p, &replies, &mut stored, |reply| {
                    cache(&mut caches, went[p], &blocks).store(reply)
                });
            }
            hits.clear();
            if candidates {
                hits.extend(
                    of_pool
                        .get(&self.pool_of(r))
                        .into_iter()
                        .flatten()
                        .map(|w| (*w, caches.get(w).map_or(0, |c| c.prefix_hit(&r.chain)))),
                );
            }
            let worker = match router.as_mut() {
                Some(router) => router.route(i, r, &hits),
                None => r.worker,
            };
            let hit = hits
                .iter()
                .find(|(w, _)| *w == worker)
                .map(|(_, h)| *h)
                .unwrap_or_else(|| caches.get(&worker).map_or(0, |c| c.prefix_hit(&r.chain)));
            let best = hits.iter().filter(|(w, h)| *w != worker && *h > hit).fold(
                None,
                |b: Option<(WorkerKey, usize)>, &(w, h)| match b {
                    Some((_, bh)) if bh >= h => b,
                    _ => Some((w, h)),
                },
            );
            each(r, worker, hit, best);
            went.push(worker);
            match lives.map(|l| l.of[i]) {
                Some(life) if life.end_ns > r.decided_ns => {
                    push(&mut due, life.first_token_ns, Due::Prefill, i);
                    if router.is_some() {
                        push(&mut due, life.first_token_ns, Due::FirstToken, i);
                        if router.as_ref().is_some_and(|r| r.tracks_output_blocks()) {
                            for at in output_block_times(r, &life) {
                                push(&mut due, at, Due::OutputBlock, i);
                            }
                        }
                        let expiry = r.decided_ns.saturating_add(ROUTER_EXPIRY_NS);
                        if life.end_ns > expiry {
                            push(&mut due, expiry, Due::Expired, i);
                        }
                    }
                    push(&mut due, life.end_ns, Due::End, i);
                }
                _ => {
                    cache(&mut caches, worker, &blocks).prefill(&r.chain);
                    if let Some(router) = router.as_mut() {
                        router.first_token(i, r.decided_ns);
                        router.ended(i, r.decided_ns);
                    }
                }
            }
            if let Some((_, at)) = replies[i] {
                push(&mut due, at, Due::Reply, i);
            }
            t.add(r.isl_tokens, hit as u64, r.block_size);
        }
        t
    }

    /// Store request `p`'s reply (once) with `store`.
    fn store_reply(
        &self,
        p: usize,
        replies: &[Option<(usize, u64)>],
        stored: &mut [bool],
        store: impl FnOnce(&[SequenceHash]),
    ) {
        let Some((next, _)) = replies[p] else {
            return;
        };
        if std::mem::replace(&mut stored[p], true) {
            return;
        }
        if let Some((_, reply)) = self.previous_reply(next) {
            store(reply);
        }
    }

    /// Request `i`'s previous turn, and `i`'s chain up to the end of that turn's reply,
    /// when the recording shows the reply's blocks stored by a decode (they start where
    /// the previous turn's prompt ended).
    pub(crate) fn previous_reply(&self, i: usize) -> Option<(usize, &[SequenceHash])> {
        let p = self.previous.get(i).copied().flatten()?;
        let r = &self.requests[i];
        let (start, end) = r.decoded_tail?;
        (start as usize == self.requests[p].chain.len()).then_some(())?;
        Some((p, r.chain.get(..end as usize)?))
    }

    /// For each request whose reply a later turn shows stored by a decode: that turn, and
    /// when the request ended (else when that turn came).
    fn replies(&self) -> Vec<Option<(usize, u64)>> {
        let mut replies = vec![None; self.requests.len()];
        for i in 0..self.requests.len() {
            let Some((p, _)) = self.previous_reply(i) else {
                continue;
            };
            let ended = self.lifetimes.as_ref().map(|l| l.of[p].end_ns);
            replies[p] = Some((i, ended.unwrap_or(self.requests[i].decided_ns)));
        }
        replies
    }
}

/// When each of `r`'s output blocks begins, as the router counts them: a block each
/// time prompt + output so far spans one more (Dynamo's `OutputBlockTracker`), its
/// tokens spread evenly from the first to the end.
fn output_block_times(r: &RoutedRequest, life: &Lifetime) -> impl Iterator<Item = u64> {
    let bs = u64::from(r.block_size.max(1));
    let out = life.output_tokens;
    let start_blocks = r.isl_tokens.div_ceil(bs);
    let blocks = r.isl_tokens.saturating_add(out).div_ceil(bs) - start_blocks;
    let itl = life.end_ns.saturating_sub(life.first_token_ns) / out.saturating_sub(1).max(1);
    let first = life.first_token_ns;
    let isl = r.isl_tokens;
    (0..blocks).map(move |k| {
        // The output token that opens block `start_blocks + k + 1`.
        let token = (start_blocks + k) * bs + 1 - isl;
        first.saturating_add(itl.saturating_mul(token - 1))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: &str, chain: &[u64]) -> RoutedRequest {
        let w = WorkerKey {
            worker_id: 1,
            dp_rank: 0,
        };
        RoutedRequest {
            request_id: id.into(),
            decided_ns: 0,
            model: None,
            worker: w,
            chain: chain.to_vec(),
            isl_tokens: chain.len() as u64 * 16,
            block_size: 16,
            recorded_overlap_blocks: 0,
            recorded_best: w,
            recorded_best_overlap_blocks: 0,
            decoded_tail: None,
            selection: Default::default(),
            router_overlap_blocks: None,
            end: None,
        }
    }

    #[test]
    fn a_conversation_is_followed_by_its_prompts() {
        let turns = [
            req("a1", &[1, 2, 3]),
            req("b1", &[1, 2, 7]),
            req("a2", &[1, 2, 3, 4, 5]),
            req("a3", &[1, 2, 3, 4, 5, 6]),
            req("b2", &[1, 2, 7, 8]),
            // The same prompt again: no next turn of a1.
            req("a1-again", &[1, 2, 3]),
        ];
        assert_eq!(
            previous_turns(&turns),
            vec![None, None, Some(0), Some(2), Some(1), None]
        );
    }

    #[test]
    fn a_shared_or_repeated_chain_names_no_previous_turn() {
        let turns = [
            // Two first turns whose full blocks are the system prompt alone.
            req("a1", &[1, 2]),
            req("b1", &[1, 2]),
            req("a2", &[1, 2, 3]),
            // One request of the system prompt alone, then two conversations on it: the
            // first follows it, the second starts its own.
            req("s", &[9, 8]),
            req("c", &[9, 8, 7]),
            req("d", &[9, 8, 6]),
        ];
        assert_eq!(
            previous_turns(&turns),
            vec![None, None, None, None, Some(3), None]
        );
    }

    #[test]
    fn output_blocks_open_as_the_router_counts_them() {
        // 20 prompt tokens (2 blocks begun) and 40 output tokens: the totals reach 3
        // blocks at output token 13 and 4 at token 29 (of 16-token blocks); token k
        // comes at 1 ms + (k − 1) × 1 ms.
        let mut r = req("r", &[1]);
        r.isl_tokens = 20;
        let life = Lifetime {
            first_token_ns: 1_000_000,
            end_ns: 40_000_000,
            output_tokens: 40,
            prefill_leg: false,
        };
        let at: Vec<u64> = output_block_times(&r, &life).collect();
        assert_eq!(at, vec![13_000_000, 29_000_000]);
        let none = Lifetime {
            output_tokens: 0,
            ..life
        };
        assert_eq!(output_block_times(&r, &none).count(), 0);
    }
}
