//! What a run does, decided up front from a [`RunConfig`] (pure and deterministic for a
//! seed): the steps the coordinator then carries out against real agents.
//!
//! Layout: workers `decode-0 … decode-{n-1}` on a ring; each ordered ring pair
//! (loader ← peer) exchanges metadata once, by one of three paths in turn: direct
//! (`getLocalMD` on the peer → `loadRemoteMD` on the loader), socket fetch (the loader's
//! `fetchRemoteMD` from the peer's listener) or socket send (the peer's `sendLocalMD` to
//! the loader's listener). A pool's first half holds source blocks (never written), its
//! second half landing blocks: a READ pulls a peer's source blocks into the initiator's
//! landing blocks (the D→D migration: the target pulls, then notifies the source), a
//! WRITE pushes the initiator's source blocks into the peer's landing blocks.

use serde::{Deserialize, Serialize};

use crate::status::Injection;
use crate::truth::{Op, Phase};

/// What a `run` does. Every field has a default (the `mixed` scenario).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Decode workers (agents) on the ring, at least 2.
    pub workers: u32,
    /// KV blocks per worker pool (half source, half landing).
    pub blocks: u32,
    /// Bytes per KV block.
    pub block_size: u32,
    /// READ migrations (the target pulls the source's blocks, with a notification).
    pub reads: u32,
    /// Of the READs and WRITEs, how many are made from prepared descriptor lists
    /// (`prepXferDlist` + `makeXferReq`, vLLM's path) instead of `createXferReq`: every
    /// third migration until this many.
    pub prepped: u32,
    /// WRITE migrations (the source pushes; every other one with a notification).
    pub writes: u32,
    /// Fewest blocks per transfer.
    pub min_blocks: u32,
    /// Most blocks per transfer.
    pub max_blocks: u32,
    /// `loadRemoteMD` of a mangled blob (fails with NIXL_ERR_MISMATCH).
    pub corrupt_metadata: u32,
    /// `fetchRemoteMD` from a port nobody listens on (returns success; nothing arrives).
    pub dead_listener: u32,
    /// `makeConnection` to an agent never loaded (NIXL_ERR_NOT_FOUND).
    pub unknown_connect: u32,
    /// Transfers naming an agent never loaded (fail at `createXferReq`).
    pub unknown_remote: u32,
    /// `invalidateRemoteMD` then a transfer to it (fails at `createXferReq`).
    pub invalidated_remote: u32,
    /// `createXferReq`, `invalidateRemoteMD`, `postXferReq` (fails at post, NOT_FOUND).
    pub invalidated_before_post: u32,
    /// Post returning IN_PROG, `invalidateRemoteMD`, `getXferStatus` (fails at
    /// completion, NOT_FOUND).
    pub invalidated_in_flight: u32,
    /// Transfers to an agent destroyed after its metadata was loaded (fail at post,
    /// NIXL_ERR_REMOTE_DISCONNECT). Adds the agent `decode-doomed`.
    pub remote_gone: u32,
    /// `createXferReq` with one remote descriptor fewer than local ones (INVALID_PARAM).
    pub mismatched_descriptors: u32,
    /// `makeXferReq` with one remote index fewer than local ones (INVALID_PARAM before
    /// the request is built).
    pub prepped_mismatched_indices: u32,
    /// `makeXferReq` with a remote index past its list's end (INVALID_PARAM after the
    /// request is built).
    pub prepped_index_past_end: u32,
    /// `genNotif` messages.
    pub gen_notifs: u32,
    /// Seed for block choices and the READ/WRITE interleaving.
    pub seed: u64,
    /// How long to wait for socket-delivered metadata (ms).
    pub md_wait_ms: u64,
    /// How long to wait for metadata from a dead listener (ms).
    pub dead_listener_wait_ms: u64,
    /// How long a transfer may stay IN_PROG before the lab gives up (ms).
    pub transfer_timeout_ms: u64,
    /// How long to wait for expected notifications (ms).
    pub notif_wait_ms: u64,
    /// Posts to try for an in-flight invalidation until one returns IN_PROG.
    pub in_flight_attempts: u32,
    /// NIXL listener thread poll delay (µs; NIXL's own default is 100 000).
    pub listener_delay_us: u64,
    /// NIXL progress thread pause between UCX progress rounds (µs; nixl-sys's default 0
    /// makes every agent's progress thread spin, which a 2-core machine feels).
    pub progress_delay_us: u64,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            workers: 4,
            blocks: 64,
            block_size: 4096,
            reads: 50,
            prepped: 12,
            writes: 20,
            min_blocks: 4,
            max_blocks: 16,
            corrupt_metadata: 2,
            dead_listener: 1,
            unknown_connect: 1,
            unknown_remote: 2,
            invalidated_remote: 2,
            invalidated_before_post: 1,
            invalidated_in_flight: 1,
            remote_gone: 1,
            mismatched_descriptors: 1,
            prepped_mismatched_indices: 1,
            prepped_index_past_end: 1,
            gen_notifs: 2,
            seed: 1,
            md_wait_ms: 2000,
            dead_listener_wait_ms: 300,
            transfer_timeout_ms: 5000,
            notif_wait_ms: 2000,
            in_flight_attempts: 50,
            listener_delay_us: 1000,
            progress_delay_us: 100,
        }
    }
}

impl RunConfig {
    /// The named preset: `mixed` (the defaults) or `clean` (no injected failures).
    pub fn scenario(name: &str) -> Option<Self> {
        match name {
            "mixed" => Some(Self::default()),
            "clean" => Some(Self {
                corrupt_metadata: 0,
                dead_listener: 0,
                unknown_connect: 0,
                unknown_remote: 0,
                invalidated_remote: 0,
                invalidated_before_post: 0,
                invalidated_in_flight: 0,
                remote_gone: 0,
                mismatched_descriptors: 0,
                prepped_mismatched_indices: 0,
                prepped_index_past_end: 0,
                ..Self::default()
            }),
            _ => None,
        }
    }

    /// Whether the agent `decode-doomed` exists.
    pub fn has_doomed(&self) -> bool {
        self.remote_gone > 0
    }
}

/// Why a config cannot be planned.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    /// Fewer than two workers.
    #[error("need at least 2 workers, got {0}")]
    TooFewWorkers(u32),
    /// Block counts that do not fit.
    #[error("transfers of {min}..={max} blocks need 1 <= min <= max and a pool of at least 2×max blocks (pool: {blocks})")]
    Blocks {
        /// min_blocks
        min: u32,
        /// max_blocks
        max: u32,
        /// blocks
        blocks: u32,
    },
    /// A zero block size.
    #[error("block size must be positive")]
    BlockSize,
}

/// How metadata travels from a peer to a loader.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MdPath {
    /// `getLocalMD` on the peer → `loadRemoteMD` on the loader.
    Direct,
    /// The loader's `fetchRemoteMD` from the peer's listener.
    Fetch,
    /// The peer's `sendLocalMD` to the loader's listener.
    Send,
}

impl MdPath {
    /// Whether nixl-sys tracks the remote afterwards (so `invalidate_remote_md` reaches
    /// NIXL): true for direct loads and fetches.
    pub fn tracked_by_nixl_sys(self) -> bool {
        !matches!(self, MdPath::Send)
    }
}

/// How a metadata blob is mangled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Corruption {
    /// The first 16 bytes XOR 0x5a (the serializer's header tag breaks).
    FlipHeader,
    /// The second half cut off.
    Truncate,
    /// All bytes zero.
    Zeroed,
}

impl Corruption {
    /// Applies the corruption.
    pub fn apply(self, blob: &[u8]) -> Vec<u8> {
        match self {
            Corruption::FlipHeader => blob
                .iter()
                .enumerate()
                .map(|(i, b)| if i < 16 { b ^ 0x5a } else { *b })
                .collect(),
            Corruption::Truncate => blob[..blob.len() / 2].to_vec(),
            Corruption::Zeroed => vec![0; blob.len()],
        }
    }
}

/// The far end of a transfer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Remote {
    /// A worker, by index.
    Worker(usize),
    /// A name no agent has.
    Ghost(String),
}

/// One step of a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Metadata from `peer` into `loader` by `path`.
    Exchange {
        /// Who loads.
        loader: usize,
        /// Whose metadata.
        peer: usize,
        /// How.
        path: MdPath,
    },
    /// `makeConnection` from → to.
    Connect {
        /// Who connects.
        from: usize,
        /// To whom.
        to: usize,
    },
    /// `loadRemoteMD` of `peer`'s blob, mangled.
    CorruptLoad {
        /// Who loads.
        loader: usize,
        /// Whose blob.
        peer: usize,
        /// How it is mangled.
        corruption: Corruption,
    },
    /// `fetchRemoteMD` of `ghost` from a port nobody listens on (the `k`-th dead port).
    DeadFetch {
        /// Who fetches.
        loader: usize,
        /// The name asked for.
        ghost: String,
        /// Which dead port.
        k: usize,
    },
    /// `makeConnection` to an agent never loaded.
    UnknownConnect {
        /// Who connects.
        from: usize,
        /// The name.
        ghost: String,
    },
    /// Destroy a worker's agent (the remote-gone injection's victim).
    Retire {
        /// Which.
        worker: usize,
    },
    /// A transfer attempt.
    Transfer {
        /// Initiating worker.
        initiator: usize,
        /// The far end.
        remote: Remote,
        /// READ or WRITE.
        op: Op,
        /// Initiator's blocks.
        local_blocks: Vec<u32>,
        /// Remote blocks.
        remote_blocks: Vec<u32>,
        /// Notification message.
        notif: Option<String>,
        /// Injected failure.
        inject: Option<Injection>,
        /// Made from prepared lists (`makeXferReq`) instead of `createXferReq`.
        prepped: bool,
    },
    /// Reload `peer`'s metadata into `loader` directly after an injection invalidated it.
    Restore {
        /// Who reloads.
        loader: usize,
        /// Whose metadata.
        peer: usize,
    },
    /// `genNotif`.
    GenNotif {
        /// Sender.
        from: usize,
        /// Receiver.
        to: usize,
        /// Message.
        msg: String,
    },
    /// Every live worker collects the notifications sent to it.
    CollectNotifs,
    /// Every live worker shuts down.
    Shutdown,
}

impl Step {
    /// The phase the step's records belong to (transfers: migrate or inject).
    pub fn phase(&self) -> Phase {
        match self {
            Step::Exchange { .. } | Step::Connect { .. } => Phase::Handshake,
            Step::Transfer { inject: None, .. } | Step::GenNotif { .. } | Step::CollectNotifs => {
                Phase::Migrate
            }
            Step::Restore { .. } => Phase::Restore,
            Step::Shutdown => Phase::Teardown,
            _ => Phase::Inject,
        }
    }
}

/// The planned run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Agent names by worker index (`decode-doomed` last when present).
    pub names: Vec<String>,
    /// Fill byte by worker index.
    pub fills: Vec<u8>,
    /// Index of `decode-doomed`.
    pub doomed: Option<usize>,
    /// Dead listener ports needed.
    pub dead_ports: usize,
    /// Metadata paths by ordered pair (loader, peer).
    pub exchanges: Vec<(usize, usize, MdPath)>,
    /// The steps, in order.
    pub steps: Vec<Step>,
}

/// A small deterministic PRNG (xorshift64*).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded (0 is mapped to a fixed non-zero state).
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Next value.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next_u64() % u64::from(hi - lo + 1)) as u32
    }

    /// `n` distinct values from `start..start+len`, in random order.
    pub fn distinct(&mut self, n: u32, start: u32, len: u32) -> Vec<u32> {
        let mut all: Vec<u32> = (start..start + len).collect();
        for i in 0..n as usize {
            let j = i + (self.next_u64() % (all.len() - i) as u64) as usize;
            all.swap(i, j);
        }
        all.truncate(n as usize);
        all
    }
}

impl Plan {
    /// Plans a run.
    pub fn build(c: &RunConfig) -> Result<Plan, PlanError> {
        if c.workers < 2 {
            return Err(PlanError::TooFewWorkers(c.workers));
        }
        if c.block_size == 0 {
            return Err(PlanError::BlockSize);
        }
        if c.min_blocks == 0 || c.min_blocks > c.max_blocks || c.blocks < 2 * c.max_blocks {
            return Err(PlanError::Blocks {
                min: c.min_blocks,
                max: c.max_blocks,
                blocks: c.blocks,
            });
        }
        let n = c.workers as usize;
        let mut names: Vec<String> = (0..n).map(|i| format!("decode-{i}")).collect();
        let mut fills: Vec<u8> = (0..n).map(|i| 0x10u8.wrapping_add(i as u8)).collect();
        let doomed = c.has_doomed().then(|| {
            names.push("decode-doomed".into());
            fills.push(0xdd);
            n
        });
        let half = c.blocks / 2;
        let mut rng = Rng::new(c.seed);
        let mut steps = Vec::new();

        // Metadata on the ring, both directions, paths in turn.
        let mut pairs: Vec<(usize, usize)> = Vec::new();
        for i in 0..n {
            let j = (i + 1) % n;
            for p in [(j, i), (i, j)] {
                if !pairs.contains(&p) {
                    pairs.push(p);
                }
            }
        }
        let paths = [MdPath::Direct, MdPath::Fetch, MdPath::Send];
        let mut exchanges: Vec<(usize, usize, MdPath)> = pairs
            .iter()
            .enumerate()
            .map(|(k, &(loader, peer))| (loader, peer, paths[k % paths.len()]))
            .collect();
        if let Some(d) = doomed {
            exchanges.push((0, d, MdPath::Direct));
        }
        for &(loader, peer, path) in &exchanges {
            steps.push(Step::Exchange { loader, peer, path });
        }
        for &(loader, peer, _) in &exchanges {
            steps.push(Step::Connect {
                from: loader,
                to: peer,
            });
        }

        // Handshakes that go wrong.
        let corruptions = [
            Corruption::FlipHeader,
            Corruption::Truncate,
            Corruption::Zeroed,
        ];
        for k in 0..c.corrupt_metadata as usize {
            steps.push(Step::CorruptLoad {
                loader: (k + 1) % n,
                peer: k % n,
                corruption: corruptions[k % corruptions.len()],
            });
        }
        for k in 0..c.dead_listener as usize {
            steps.push(Step::DeadFetch {
                loader: k % n,
                ghost: format!("ghost-listener-{k}"),
                k,
            });
        }
        for k in 0..c.unknown_connect as usize {
            steps.push(Step::UnknownConnect {
                from: k % n,
                ghost: format!("ghost-connect-{k}"),
            });
        }
        // The doomed agent goes now, so its peers' UCX endpoints notice long before the
        // remote-gone transfers at the end.
        if let Some(d) = doomed {
            steps.push(Step::Retire { worker: d });
        }

        // Migrations: READs and WRITEs interleaved over the ring pairs.
        let ring: Vec<(usize, usize)> = pairs.clone();
        let mut ops: Vec<Op> = std::iter::repeat_n(Op::Read, c.reads as usize)
            .chain(std::iter::repeat_n(Op::Write, c.writes as usize))
            .collect();
        for i in (1..ops.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            ops.swap(i, j);
        }
        let (mut reads, mut writes, mut prepped) = (0usize, 0usize, 0usize);
        for (k, op) in ops.into_iter().enumerate() {
            let through_make = k % 3 == 2 && prepped < c.prepped as usize;
            prepped += usize::from(through_make);
            let (initiator, peer) = ring[(rng.next_u64() % ring.len() as u64) as usize];
            let nb = rng.range(c.min_blocks, c.max_blocks);
            let (local_blocks, remote_blocks, notif) = match op {
                Op::Read => {
                    reads += 1;
                    (
                        rng.distinct(nb, half, half),
                        rng.distinct(nb, 0, half),
                        // vLLM's NixlConnector format: `<request id>:<readers>`.
                        Some(format!("mig-{reads}:1")),
                    )
                }
                Op::Write => {
                    writes += 1;
                    let notif = (writes % 2 == 1).then(|| format!("push-{writes}"));
                    (
                        rng.distinct(nb, 0, half),
                        rng.distinct(nb, half, half),
                        notif,
                    )
                }
            };
            steps.push(Step::Transfer {
                initiator,
                remote: Remote::Worker(peer),
                op,
                local_blocks,
                remote_blocks,
                notif,
                inject: None,
                prepped: through_make,
            });
        }
        for k in 0..c.gen_notifs as usize {
            let (from, to) = ring[k % ring.len()];
            steps.push(Step::GenNotif {
                from,
                to,
                msg: format!("hello-{k}"),
            });
        }

        // Transfers that go wrong.
        let read_shape = |rng: &mut Rng| {
            let nb = rng.range(c.min_blocks, c.max_blocks);
            (rng.distinct(nb, half, half), rng.distinct(nb, 0, half))
        };
        for k in 0..c.unknown_remote as usize {
            let (local_blocks, remote_blocks) = read_shape(&mut rng);
            steps.push(Step::Transfer {
                initiator: k % n,
                remote: Remote::Ghost(format!("ghost-agent-{k}")),
                op: Op::Read,
                local_blocks,
                remote_blocks,
                notif: None,
                inject: Some(Injection::UnknownRemote),
                prepped: false,
            });
        }
        // Creations refused for their arguments, before and after the request is built.
        let refused = [
            (
                c.mismatched_descriptors,
                Injection::MismatchedDescriptors,
                false,
            ),
            (
                c.prepped_mismatched_indices,
                Injection::PreppedMismatchedIndices,
                true,
            ),
            (
                c.prepped_index_past_end,
                Injection::PreppedIndexPastEnd,
                true,
            ),
        ];
        for (count, inject, prepped) in refused {
            for k in 0..count as usize {
                let (initiator, peer) = ring[k % ring.len()];
                let (local_blocks, remote_blocks) = read_shape(&mut rng);
                steps.push(Step::Transfer {
                    initiator,
                    remote: Remote::Worker(peer),
                    op: Op::Read,
                    local_blocks,
                    remote_blocks,
                    notif: None,
                    inject: Some(inject),
                    prepped,
                });
            }
        }
        // Invalidations need a pair nixl-sys tracks (direct or fetched metadata).
        let tracked: Vec<(usize, usize)> = exchanges
            .iter()
            .filter(|(l, p, path)| {
                path.tracked_by_nixl_sys() && Some(*p) != doomed && Some(*l) != doomed
            })
            .map(|&(l, p, _)| (l, p))
            .collect();
        let invalidations = [
            (c.invalidated_remote, Injection::InvalidatedRemote),
            (c.invalidated_before_post, Injection::InvalidatedBeforePost),
            (c.invalidated_in_flight, Injection::InvalidatedInFlight),
        ];
        let mut t = 0usize;
        for (count, inject) in invalidations {
            for _ in 0..count {
                let (initiator, peer) = tracked[t % tracked.len()];
                t += 1;
                // In-flight needs a post that returns IN_PROG: the most blocks and a
                // notification (sent only once the flush completes) make that likelier.
                let in_flight = inject == Injection::InvalidatedInFlight;
                let (local_blocks, remote_blocks) = if in_flight {
                    (
                        rng.distinct(c.max_blocks, half, half),
                        rng.distinct(c.max_blocks, 0, half),
                    )
                } else {
                    read_shape(&mut rng)
                };
                let notif = in_flight.then(|| format!("inflight-{t}"));
                steps.push(Step::Transfer {
                    initiator,
                    remote: Remote::Worker(peer),
                    op: Op::Read,
                    local_blocks,
                    remote_blocks,
                    notif,
                    inject: Some(inject),
                    prepped: false,
                });
                steps.push(Step::Restore {
                    loader: initiator,
                    peer,
                });
            }
        }
        if let Some(d) = doomed {
            for _ in 0..c.remote_gone {
                let (local_blocks, remote_blocks) = read_shape(&mut rng);
                steps.push(Step::Transfer {
                    initiator: 0,
                    remote: Remote::Worker(d),
                    op: Op::Read,
                    local_blocks,
                    remote_blocks,
                    notif: None,
                    inject: Some(Injection::RemoteGone),
                    prepped: false,
                });
            }
        }

        steps.push(Step::CollectNotifs);
        steps.push(Step::Shutdown);
        Ok(Plan {
            names,
            fills,
            doomed,
            dead_ports: c.dead_listener as usize,
            exchanges,
            steps,
        })
    }

    /// Transfer steps of an op, with and without injection.
    pub fn transfers(&self, op: Op, injected: bool) -> usize {
        self.steps
            .iter()
            .filter(|s| matches!(s, Step::Transfer { op: o, inject, .. } if *o == op && inject.is_some() == injected))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_plan_has_what_was_asked() {
        let c = RunConfig::default();
        let p = Plan::build(&c).unwrap();
        assert_eq!(p.transfers(Op::Read, false), 50);
        assert_eq!(p.transfers(Op::Write, false), 20);
        let injected = |inj: Injection| {
            p.steps
                .iter()
                .filter(|s| matches!(s, Step::Transfer { inject: Some(i), .. } if *i == inj))
                .count()
        };
        assert_eq!(injected(Injection::UnknownRemote), 2);
        assert_eq!(injected(Injection::InvalidatedRemote), 2);
        assert_eq!(injected(Injection::InvalidatedBeforePost), 1);
        assert_eq!(injected(Injection::InvalidatedInFlight), 1);
        assert_eq!(injected(Injection::RemoteGone), 1);
        assert_eq!(injected(Injection::MismatchedDescriptors), 1);
        assert_eq!(injected(Injection::PreppedMismatchedIndices), 1);
        assert_eq!(injected(Injection::PreppedIndexPastEnd), 1);
        let prepped = p
            .steps
            .iter()
            .filter(|s| {
                matches!(
                    s,
                    Step::Transfer {
                        prepped: true,
                        inject: None,
                        ..
                    }
                )
            })
            .count();
        assert_eq!(prepped, 12);
        let corrupt = p
            .steps
            .iter()
            .filter(|s| matches!(s, Step::CorruptLoad { .. }))
            .count();
        assert_eq!(corrupt, 2);
        assert_eq!(p.names.last().map(String::as_str), Some("decode-doomed"));
        // 4 workers on a ring: 8 ordered pairs + the doomed one, all three paths used
        assert_eq!(p.exchanges.len(), 9);
        for path in [MdPath::Direct, MdPath::Fetch, MdPath::Send] {
            assert!(p.exchanges.iter().any(|e| e.2 == path), "{path:?}");
        }
    }

    #[test]
    fn blocks_stay_in_their_halves_and_sizes_in_range() {
        let c = RunConfig::default();
        let half = c.blocks / 2;
        for s in Plan::build(&c).unwrap().steps {
            if let Step::Transfer {
                op,
                local_blocks,
                remote_blocks,
                ..
            } = s
            {
                assert_eq!(local_blocks.len(), remote_blocks.len());
                assert!((c.min_blocks..=c.max_blocks).contains(&(local_blocks.len() as u32)));
                let (landing, source) = match op {
                    Op::Read => (&local_blocks, &remote_blocks),
                    Op::Write => (&remote_blocks, &local_blocks),
                };
                assert!(landing.iter().all(|b| (half..c.blocks).contains(b)));
                assert!(source.iter().all(|b| *b < half));
                let mut d = landing.clone();
                d.sort();
                d.dedup();
                assert_eq!(d.len(), landing.len(), "distinct blocks");
            }
        }
    }

    #[test]
    fn transfers_only_use_pairs_with_metadata() {
        let p = Plan::build(&RunConfig::default()).unwrap();
        for s in &p.steps {
            if let Step::Transfer {
                initiator,
                remote: Remote::Worker(peer),
                inject,
                ..
            } = s
            {
                let known = p
                    .exchanges
                    .iter()
                    .any(|(l, q, _)| l == initiator && q == peer);
                assert!(known, "{initiator} → {peer} ({inject:?})");
                if matches!(
                    inject,
                    Some(
                        Injection::InvalidatedRemote
                            | Injection::InvalidatedBeforePost
                            | Injection::InvalidatedInFlight
                    )
                ) {
                    let path = p
                        .exchanges
                        .iter()
                        .find(|(l, q, _)| l == initiator && q == peer)
                        .unwrap()
                        .2;
                    assert!(path.tracked_by_nixl_sys());
                }
            }
        }
    }

    #[test]
    fn same_seed_same_plan_and_clean_has_no_injections() {
        let c = RunConfig::default();
        assert_eq!(Plan::build(&c).unwrap(), Plan::build(&c).unwrap());
        let other = Plan::build(&RunConfig { seed: 2, ..c }).unwrap();
        assert_ne!(
            other.steps,
            Plan::build(&RunConfig::default()).unwrap().steps
        );
        let clean = Plan::build(&RunConfig::scenario("clean").unwrap()).unwrap();
        assert!(clean
            .steps
            .iter()
            .all(|s| !matches!(s.phase(), Phase::Inject)));
        assert_eq!(clean.doomed, None);
    }

    #[test]
    fn bad_configs_are_refused() {
        let c = RunConfig::default();
        assert_eq!(
            Plan::build(&RunConfig {
                workers: 1,
                ..c.clone()
            }),
            Err(PlanError::TooFewWorkers(1))
        );
        assert!(Plan::build(&RunConfig {
            blocks: 20,
            ..c.clone()
        })
        .is_err());
        assert!(Plan::build(&RunConfig { min_blocks: 0, ..c }).is_err());
    }

    #[test]
    fn corruptions_change_the_blob() {
        let blob: Vec<u8> = (0..64).collect();
        for c in [
            Corruption::FlipHeader,
            Corruption::Truncate,
            Corruption::Zeroed,
        ] {
            assert_ne!(c.apply(&blob), blob, "{c:?}");
        }
        assert_eq!(Corruption::Truncate.apply(&blob).len(), 32);
    }
}
