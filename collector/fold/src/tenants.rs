//! A request's tenant: the cache salt its chain's first block was stored under.
//!
//! The router hashes a request's salt into its blocks, so the request names its tenant
//! only through them; an engine names the salt on the store of a chain's first block
//! (SGLang's `cache_salt`, or the salt Dynamo tags for vLLM, which the agent carries).
//! The fold keeps the salt of each salted chain root it saw stored, bounded, the roots
//! used lately kept first: an unsalted fleet keeps nothing.

use kvscope_wire::SequenceHash;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Salted chain roots kept (about 64 bytes each with the salt shared).
const MAX_ROOTS: usize = 1 << 17;

#[derive(Debug)]
struct Root {
    salt: Arc<str>,
    /// The tick of its latest use: the order's entries of older ticks are stale.
    last: u64,
}

/// The salts of salted chain roots.
#[derive(Debug, Default)]
pub struct TenantRoots {
    roots: HashMap<SequenceHash, Root>,
    /// Roots by last use, oldest first (an entry is live while its tick is the root's).
    order: VecDeque<(SequenceHash, u64)>,
    /// One copy of each salt.
    salts: HashMap<Arc<str>, ()>,
    tick: u64,
}

impl TenantRoots {
    /// A worker stored chain root `root` under `salt`.
    pub fn stored(&mut self, root: SequenceHash, salt: &str) {
        let salt = match self.salts.get_key_value(salt) {
            Some((s, _)) => s.clone(),
            None => {
                let s: Arc<str> = salt.into();
                self.salts.insert(s.clone(), ());
                s
            }
        };
        self.tick += 1;
        let tick = self.tick;
        self.roots.insert(root, Root { salt, last: tick });
        self.order.push_back((root, tick));
        self.bound();
    }

    /// The salt request chain root `root` was stored under, if any worker stored it
    /// salted (a use: kept the longer).
    pub fn tenant_of(&mut self, root: SequenceHash) -> Option<Arc<str>> {
        self.tick += 1;
        let tick = self.tick;
        let r = self.roots.get_mut(&root)?;
        r.last = tick;
        let salt = r.salt.clone();
        self.order.push_back((root, tick));
        self.bound();
        Some(salt)
    }

    fn bound(&mut self) {
        while self.roots.len() > MAX_ROOTS || self.order.len() > 2 * MAX_ROOTS {
            let Some((root, tick)) = self.order.pop_front() else {
                break;
            };
            if self.roots.get(&root).is_some_and(|r| r.last == tick) {
                self.roots.remove(&root);
            }
        }
        // Salts no root names any more (checked rarely: a salt is a few bytes).
        if self.salts.len() > 2 * self.roots.len() + 1024 {
            let live: std::collections::HashSet<&str> =
                self.roots.values().map(|r| &*r.salt).collect();
            self.salts.retain(|s, _| live.contains(&**s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_root_used_lately_outlives_older_ones_and_the_bound_holds() {
        let mut t = TenantRoots::default();
        t.stored(1, "tenant-a");
        assert_eq!(t.tenant_of(1).as_deref(), Some("tenant-a"));
        assert_eq!(t.tenant_of(2), None);
        for r in 2..(MAX_ROOTS as u64 + 10) {
            t.stored(r, "tenant-b");
            if r % 1000 == 0 {
                // Root 1 is in use all along.
                assert!(t.tenant_of(1).is_some(), "{r}");
            }
        }
        assert_eq!(t.roots.len(), MAX_ROOTS);
        assert_eq!(t.tenant_of(1).as_deref(), Some("tenant-a"));
        assert_eq!(t.tenant_of(2), None, "the oldest unused root went first");
        assert_eq!(t.salts.len(), 2, "one copy of each salt");
    }
}
