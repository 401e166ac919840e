//! KV cache tiers: where an engine holds a block, from the `medium` its KV events carry.

use serde::{Deserialize, Serialize};

/// Where a worker holds a block. The router scores the device tier first, then extends a
/// worker's match through its host tier, then its disk tier (Dynamo's `host_pinned` and
/// `disk` overlaps); an engine onloads a lower tier's blocks instead of recomputing them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// The accelerator's own KV cache (the tier every router scores).
    Device,
    /// Host memory (pinned CPU memory, vLLM's and Dynamo's G2).
    Host,
    /// Disk and remote storage (NVMe, a file system, an object store, a shared pool):
    /// one tier, as Dynamo's router counts its `disk_blocks`.
    Disk,
}

/// Every medium spelling an engine is known to send, and its tier.
const SPELLINGS: [(&str, Tier); 20] = [
    ("GPU", Tier::Device),
    ("DEVICE", Tier::Device),
    ("CUDA", Tier::Device),
    ("HBM", Tier::Device),
    ("CPU", Tier::Host),
    ("CPU_PINNED", Tier::Host),
    ("CPU_TIER1", Tier::Host),
    ("HOST", Tier::Host),
    ("HOST_PINNED", Tier::Host),
    ("CPU_TIER2", Tier::Disk),
    ("DISK", Tier::Disk),
    ("NVME", Tier::Disk),
    ("SSD", Tier::Disk),
    ("STORAGE", Tier::Disk),
    ("FS", Tier::Disk),
    ("OBJ", Tier::Disk),
    ("EXTERNAL", Tier::Disk),
    ("NETWORK", Tier::Disk),
    ("REMOTE", Tier::Disk),
    ("SHARED", Tier::Disk),
];

impl Tier {
    /// The lower tiers, in the order a match is extended through them.
    pub const LOWER: [Tier; 2] = [Tier::Host, Tier::Disk];

    /// The tier a KV event's `medium` names, as the engines spell it: vLLM (`GPU`,
    /// `CPU`, and `STORAGE`, or `FS`/`OBJ` in 0.26), SGLang (`GPU`, `CPU_PINNED`, `DISK`,
    /// `EXTERNAL`) and Dynamo's own publishers and router (`DEVICE`, `CPU_TIER1`,
    /// `CPU_TIER2`, `NVME`, `NETWORK`, `REMOTE`, `SHARED`). No medium is the device tier
    /// (publishers older than tiering). `None` for a medium no engine is known to send:
    /// its events are counted and left out, never guessed into a tier.
    pub fn of_medium(medium: Option<&str>) -> Option<Tier> {
        let Some(m) = medium else {
            return Some(Tier::Device);
        };
        // Compared in place, case aside (every event of most engines names its medium:
        // no allocation per event), the device's spellings first.
        SPELLINGS
            .iter()
            .find(|(spelling, _)| spelling.eq_ignore_ascii_case(m))
            .map(|(_, tier)| *tier)
    }
}

/// A match's extension through the lower tiers, in blocks: `host_blocks` from the end of
/// the device overlap, then `disk_blocks` from the end of those (Dynamo's
/// `host_pinned_extension_blocks` and `disk_extension_blocks`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LowerTierBlocks {
    pub host_blocks: u32,
    pub disk_blocks: u32,
}

impl LowerTierBlocks {
    pub fn is_empty(&self) -> bool {
        self.host_blocks == 0 && self.disk_blocks == 0
    }

    pub fn total(&self) -> u32 {
        self.host_blocks.saturating_add(self.disk_blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_engine_spelling_names_its_tier_and_an_unknown_one_none() {
        for (m, t) in [
            (None, Some(Tier::Device)),
            (Some("GPU"), Some(Tier::Device)),
            (Some("cpu"), Some(Tier::Host)),
            (Some("CPU_PINNED"), Some(Tier::Host)),
            (Some("STORAGE"), Some(Tier::Disk)),
            (Some("OBJ"), Some(Tier::Disk)),
            (Some("EXTERNAL"), Some(Tier::Disk)),
            (Some("TAPE"), None),
            (Some(""), None),
        ] {
            assert_eq!(Tier::of_medium(m), t, "{m:?}");
        }
    }
}
