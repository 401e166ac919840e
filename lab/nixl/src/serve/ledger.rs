//! The directive ledger: what became of every idempotency key (a repeat is answered with
//! its first outcome; a failed one may be retried), the directive counts, and the latest
//! outcomes for `/v1/status`.

use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

/// Outcomes kept for `/v1/status`.
const KEEP_OUTCOMES: usize = 1000;

/// The answer to one directive.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MigrationOutcome {
    pub idempotency_key: String,
    pub request_id: String,
    /// migrated | handshake_failed | transfer_failed | data_mismatch | rejected | lab
    pub outcome: String,
    pub source_agent: Option<String>,
    pub target_agent: Option<String>,
    pub blocks: usize,
    pub bytes: u64,
    /// The sequence hashes now published as stored on the target.
    #[serde(default)]
    pub block_hashes: Vec<u64>,
    pub handshakes: u64,
    pub handshakes_failed: u64,
    pub transfers: u64,
    /// The data plane's own clock: Σ wall time inside the `loadRemoteMD` calls (the
    /// handshake the migration paid), and Σ post → done of its completed READs, ns.
    #[serde(default)]
    pub load_ns: u64,
    #[serde(default)]
    pub post_to_done_ns: u64,
    pub detail: Option<String>,
    pub at_ns: u64,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct DirectiveCounts {
    pub received: u64,
    pub migrated: u64,
    pub duplicate: u64,
    pub rejected: u64,
    pub failed: u64,
    pub unauthorized: u64,
}

enum KeyState {
    InFlight,
    /// The outcome, and whether it is final (a failed one may be retried).
    Done(Box<MigrationOutcome>, bool),
}

/// What a directive's key allows.
pub(super) enum Admission {
    /// First seen, or failed before in a way worth retrying: go ahead (now in flight).
    Admitted,
    /// Another request with this key is being performed.
    InFlight,
    /// Done for good: answer with this outcome.
    Done(Box<MigrationOutcome>),
}

#[derive(Default)]
pub(super) struct Ledger {
    keys: Mutex<HashMap<String, KeyState>>,
    counts: Mutex<DirectiveCounts>,
    outcomes: Mutex<VecDeque<MigrationOutcome>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Ledger {
    pub(super) fn bump(&self, f: impl FnOnce(&mut DirectiveCounts)) {
        f(&mut lock(&self.counts));
    }

    /// Idempotency: a key seen before is answered with what became of it, unless it
    /// failed in a way worth retrying; otherwise it is in flight from now.
    pub(super) fn admit(&self, key: &str) -> Admission {
        let mut keys = lock(&self.keys);
        match keys.get(key) {
            Some(KeyState::InFlight) => Admission::InFlight,
            Some(KeyState::Done(o, true)) => Admission::Done(o.clone()),
            _ => {
                keys.insert(key.to_string(), KeyState::InFlight);
                Admission::Admitted
            }
        }
    }

    /// Keep the outcome under its key (`final_` ones answer repeats with 409; failed ones
    /// may be retried) and in the status list.
    pub(super) fn remember(&self, o: &MigrationOutcome, final_: bool) {
        lock(&self.keys).insert(
            o.idempotency_key.clone(),
            KeyState::Done(Box::new(o.clone()), final_),
        );
        let mut list = lock(&self.outcomes);
        list.push_back(o.clone());
        while list.len() > KEEP_OUTCOMES {
            list.pop_front();
        }
    }

    pub(super) fn counts(&self) -> DirectiveCounts {
        *lock(&self.counts)
    }

    pub(super) fn outcomes(&self) -> Vec<MigrationOutcome> {
        lock(&self.outcomes).iter().cloned().collect()
    }
}
