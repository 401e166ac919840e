//! Builders for tests of the what-if and of the report that shows it (compiled always,
//! as the fold's fixtures are; used by no product code).

use crate::WhatIf;
use kvscope_fold::analyzer::RoutedRequest;
use kvscope_wire::WorkerKey;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

/// A request of `chain` (16-token blocks) that worker `worker` was recorded serving with
/// `recorded` blocks cached, the best any worker had.
pub fn req(worker: u64, chain: &[u64], recorded: u32) -> RoutedRequest {
    RoutedRequest {
        request_id: format!("r{}", chain[0]),
        decided_ns: 0,
        model: None,
        worker: WorkerKey {
            worker_id: worker,
            dp_rank: 0,
        },
        chain: chain.to_vec(),
        isl_tokens: chain.len() as u64 * 16,
        block_size: 16,
        recorded_overlap_blocks: recorded,
        recorded_best: WorkerKey {
            worker_id: worker,
            dp_rank: 0,
        },
        recorded_best_overlap_blocks: recorded,
        decoded_tail: None,
        selection: Default::default(),
        router_overlap_blocks: None,
        end: None,
    }
}

impl WhatIf {
    /// A what-if of no requests, no workers, nothing measured.
    pub fn empty() -> Self {
        WhatIf {
            requests: Vec::new(),
            discovered_blocks: HashMap::new(),
            previous: Vec::new(),
            lifetimes: None,
            prefill_workers: HashSet::new(),
            idle_workers: Vec::new(),
            undecodable_records: 0,
            min_spill_blocks: 1,
            nixl_pairs: Vec::new(),
            nixl_agents: Vec::new(),
            calibrations: Mutex::default(),
        }
    }
}

/// Worker 1 of 100 blocks recorded its repeated 2-block prompt as a hit every time: a
/// simulated cache of 2 blocks reproduces that, 0.02 of the real size, which no
/// engine's cache is, so the simulation says so and predicts nothing.
pub fn calibration_far_below_the_real_size() -> WhatIf {
    let requests: Vec<_> = (0..4)
        .map(|i| req(1, &[1, 2], if i == 0 { 0 } else { 2 }))
        .collect();
    WhatIf {
        requests,
        discovered_blocks: HashMap::from([(1, 100)]),
        ..WhatIf::empty()
    }
}
