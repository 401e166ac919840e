//! Which of an engine's KV events the mirror takes, and under which cache salt — the
//! way Dynamo's publisher admits them before its router's indexer sees them, so the
//! mirror holds the blocks the router could match and no others.
//!
//! An engine's event carries more than its blocks (vLLM since 0.23, SGLang):
//!
//! - **KV cache groups.** A hybrid model (sliding-window layers beside full attention,
//!   Mamba layers) has several KV cache groups, and the engine publishes every group's
//!   stores and removals under the same block hashes, with a `group_idx`. Only the
//!   full-attention group's blocks make a prefix reusable: a sliding-window group drops
//!   blocks that fall out of its window while the full-attention group still holds
//!   them. A store names its group's kind (`kv_cache_spec_kind`); removals name only the
//!   group, whose kind is learned from the stores. Events of another kind, of an unknown
//!   kind or of a non-zero group not yet learned are refused (group 0 unlearned is the
//!   one group of a model that is not hybrid).
//! - **Locality and ownership.** Events about blocks held elsewhere (`REMOTE`) or owned
//!   by another cache service (`ownership` other than the engine's own) are refused.
//! - **The cache salt of a chain.** An engine hashes a request's salt into its first
//!   block only (vLLM lists it in the first block's `extra_keys`), so a store that
//!   continues a chain names no salt: it inherits its parent's, as Dynamo's publisher
//!   passes it on; a parent block seen under two salts cannot say which, and a store
//!   continuing it is refused.
//!
//! Lower-tier stores on disk or remote storage carry none of this and pass as they come.
//! Pure logic: the agent keeps one [`Admission`] per engine publisher.

use crate::{KvEvent, Tier};
use std::collections::HashMap;
use std::sync::Arc;

/// The kind of KV cache a group holds (vLLM's `kv_cache_spec_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSpecKind {
    FullAttention,
    MlaAttention,
    SinkFullAttention,
    SlidingWindow,
    SlidingWindowMla,
    Mamba,
    ChunkedLocalAttention,
    EncoderOnlyAttention,
    CrossAttention,
    /// A kind no engine is known to send.
    Unknown,
}

impl CacheSpecKind {
    /// The kind as vLLM spells it.
    pub fn from_wire(kind: &str) -> Self {
        match kind {
            "full_attention" => Self::FullAttention,
            "mla_attention" => Self::MlaAttention,
            "sink_full_attention" => Self::SinkFullAttention,
            "sliding_window" => Self::SlidingWindow,
            "sliding_window_mla" => Self::SlidingWindowMla,
            "mamba" => Self::Mamba,
            "chunked_local_attention" => Self::ChunkedLocalAttention,
            "encoder_only_attention" => Self::EncoderOnlyAttention,
            "cross_attention" => Self::CrossAttention,
            _ => Self::Unknown,
        }
    }

    /// Whether a group of this kind keeps every block of a prefix while it is cached
    /// (what a prefix match needs).
    pub fn keeps_prefixes(self) -> bool {
        matches!(
            self,
            Self::FullAttention | Self::MlaAttention | Self::SinkFullAttention
        )
    }
}

/// Where the blocks of an event are, relative to its publisher (vLLM's `locality`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Locality {
    Local,
    Remote,
    /// A value no engine is known to send.
    Unknown,
}

impl Locality {
    pub fn from_wire(locality: &str) -> Self {
        match locality {
            "LOCAL" => Self::Local,
            "REMOTE" => Self::Remote,
            _ => Self::Unknown,
        }
    }
}

/// Who manages an event's blocks (vLLM's `ownership`): the engine itself when unset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Ownership {
    #[default]
    Engine,
    /// A KV cache service beside the engine (`kvcr`).
    CacheService,
    /// A value no engine is known to send.
    Unknown,
}

impl Ownership {
    pub fn from_wire(ownership: &str) -> Self {
        match ownership {
            "kvcr" => Self::CacheService,
            _ => Self::Unknown,
        }
    }
}

/// What an engine's event says beside its blocks, as decoded
/// (`vllm_events::DecodedPayload::meta`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventMeta {
    pub group_idx: Option<u32>,
    pub spec_kind: Option<CacheSpecKind>,
    pub locality: Option<Locality>,
    pub ownership: Ownership,
    /// A store's multimodal objects, per block that holds any (its index in the store,
    /// ascending), in prompt order (vLLM's `extra_keys`: the routing hashes Dynamo's
    /// frontend marked, see `vllm_events::media_object`). Part of the blocks' identity
    /// ([`crate::hashing::local_block_hash_with_media`]).
    pub media: Vec<(usize, Vec<u64>)>,
}

/// Why an event was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its blocks are managed by another cache service, or by an owner no engine names.
    OtherOwner,
    /// Its blocks are not held by the publisher (`REMOTE`, or a locality no engine
    /// names).
    NotLocal,
    /// A KV cache group that does not keep prefixes (sliding window, Mamba, …), as the
    /// event names it or as its group was learned.
    OtherCacheGroup,
    /// A group kind no engine is known to send.
    UnknownCacheKind,
    /// A group other than the first whose kind no store has named yet.
    UnlearnedCacheGroup,
    /// It continues a chain whose parent block was stored under two cache salts.
    AmbiguousSalt,
}

/// What admission did to an admitted event.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Admitted {
    /// A store that named no cache salt took its parent's.
    pub salt_inherited: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum SaltState {
    Salted(Arc<str>),
    Ambiguous,
}

/// One publisher's admission state: its groups' kinds, and the salt each salted block
/// it holds was stored under (only salted blocks are kept, as long as the engine holds
/// them: an engine that salts nothing costs nothing).
#[derive(Debug, Default)]
pub struct Admission {
    groups: HashMap<(u32, u32), CacheSpecKind>,
    salts: HashMap<(u32, u64), SaltState>,
}

impl Admission {
    /// Admit `event` of data-parallel rank `dp_rank`, or say why not. A store that
    /// continues a salted chain gets its parent's `cache_salt`.
    pub fn admit(
        &mut self,
        dp_rank: u32,
        event: &mut KvEvent,
        meta: &EventMeta,
    ) -> Result<Admitted, Refusal> {
        if meta.ownership != Ownership::Engine {
            return Err(Refusal::OtherOwner);
        }
        let medium = match event {
            KvEvent::BlockStored { medium, .. } | KvEvent::BlockRemoved { medium, .. } => {
                medium.as_deref()
            }
            // A clear is of the whole engine: no locality, no group.
            KvEvent::AllBlocksCleared => return self.pass_salt(dp_rank, event),
        };
        if matches!(meta.locality, Some(Locality::Remote | Locality::Unknown)) {
            return Err(Refusal::NotLocal);
        }
        // Disk and remote-storage stores carry no groups and no salts; a medium no
        // engine names is the collector's to count.
        if !matches!(Tier::of_medium(medium), Some(Tier::Device | Tier::Host)) {
            return Ok(Admitted::default());
        }
        if let (KvEvent::BlockStored { .. }, Some(group), Some(kind)) =
            (&event, meta.group_idx, meta.spec_kind)
        {
            self.groups.insert((dp_rank, group), kind);
        }
        self.check_group(dp_rank, meta)?;
        self.pass_salt(dp_rank, event)
    }

    /// Forget everything of the publisher (its engine restarted).
    pub fn clear(&mut self) {
        self.groups.clear();
        self.salts.clear();
    }

    fn check_group(&self, dp_rank: u32, meta: &EventMeta) -> Result<(), Refusal> {
        let kind = match (meta.spec_kind, meta.group_idx) {
            (Some(kind), _) => kind,
            (None, None) => return Ok(()),
            (None, Some(group)) => match self.groups.get(&(dp_rank, group)) {
                Some(kind) => *kind,
                None if group == 0 => return Ok(()),
                None => return Err(Refusal::UnlearnedCacheGroup),
            },
        };
        match kind {
            k if k.keeps_prefixes() => Ok(()),
            CacheSpecKind::Unknown => Err(Refusal::UnknownCacheKind),
            _ => Err(Refusal::OtherCacheGroup),
        }
    }

    fn pass_salt(&mut self, dp_rank: u32, event: &mut KvEvent) -> Result<Admitted, Refusal> {
        let mut admitted = Admitted::default();
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                cache_salt,
                ..
            } => {
                if cache_salt.as_deref() == Some("") {
                    *cache_salt = None;
                }
                let parent = parent_block_hash.and_then(|p| self.salts.get(&(dp_rank, p)));
                let salt: Option<Arc<str>> = match (cache_salt.as_deref(), parent) {
                    (Some(own), _) => Some(own.into()),
                    (None, Some(SaltState::Salted(s))) => {
                        *cache_salt = Some(s.to_string());
                        admitted.salt_inherited = true;
                        Some(s.clone())
                    }
                    (None, Some(SaltState::Ambiguous)) => return Err(Refusal::AmbiguousSalt),
                    // A chain whose start the publisher did not see salted (or that is
                    // not salted): unsalted, as Dynamo reads it.
                    (None, None) => None,
                };
                match salt {
                    Some(salt) => {
                        for &h in block_hashes.iter() {
                            let state = self
                                .salts
                                .entry((dp_rank, h))
                                .or_insert_with(|| SaltState::Salted(salt.clone()));
                            if !matches!(state, SaltState::Salted(s) if *s == salt) {
                                *state = SaltState::Ambiguous;
                            }
                        }
                    }
                    // An unsalted store of a hash known salted makes the hash ambiguous.
                    None => {
                        for &h in block_hashes.iter() {
                            if let Some(state) = self.salts.get_mut(&(dp_rank, h)) {
                                *state = SaltState::Ambiguous;
                            }
                        }
                    }
                }
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for &h in block_hashes.iter() {
                    // Ambiguity stays: the hash may be stored again under either salt.
                    if let Some(SaltState::Salted(_)) = self.salts.get(&(dp_rank, h)) {
                        self.salts.remove(&(dp_rank, h));
                    }
                }
            }
            KvEvent::AllBlocksCleared => self.salts.retain(|(rank, _), _| *rank != dp_rank),
        }
        Ok(admitted)
    }

    #[cfg(test)]
    fn salted_blocks(&self) -> usize {
        self.salts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, salt: Option<&str>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: vec![],
            block_size: 16,
            local_hashes: None,
            lora_name: None,
            medium: None,
            cache_salt: salt.map(str::to_string),
        }
    }

    fn removed(hashes: &[u64]) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium: None,
        }
    }

    fn group(g: u32, kind: Option<&str>) -> EventMeta {
        EventMeta {
            group_idx: Some(g),
            spec_kind: kind.map(CacheSpecKind::from_wire),
            ..EventMeta::default()
        }
    }

    #[test]
    fn a_sliding_window_groups_events_are_refused_as_learned_from_its_stores() {
        let mut a = Admission::default();
        let mut e = stored(&[1, 2], None, None);
        assert!(a
            .admit(0, &mut e, &group(0, Some("full_attention")))
            .is_ok());
        let mut e = stored(&[1, 2], None, None);
        assert_eq!(
            a.admit(0, &mut e, &group(1, Some("sliding_window"))),
            Err(Refusal::OtherCacheGroup)
        );
        // The window's removal names only its group: learned above.
        assert_eq!(
            a.admit(0, &mut removed(&[1]), &group(1, None)),
            Err(Refusal::OtherCacheGroup)
        );
        assert!(a.admit(0, &mut removed(&[1]), &group(0, None)).is_ok());
        // Learned per data-parallel rank.
        assert_eq!(
            a.admit(1, &mut removed(&[1]), &group(1, None)),
            Err(Refusal::UnlearnedCacheGroup)
        );
        assert!(a.admit(1, &mut removed(&[1]), &group(0, None)).is_ok());
        assert_eq!(
            a.admit(0, &mut removed(&[1]), &group(2, Some("new_kind"))),
            Err(Refusal::UnknownCacheKind)
        );
    }

    #[test]
    fn a_chains_salt_passes_to_its_continuations_and_ambiguity_refuses_them() {
        let mut a = Admission::default();
        let none = EventMeta::default();
        let mut first = stored(&[1, 2], None, Some("tenant-a"));
        assert_eq!(a.admit(0, &mut first, &none), Ok(Admitted::default()));
        let mut next = stored(&[3], Some(2), None);
        assert_eq!(
            a.admit(0, &mut next, &none),
            Ok(Admitted {
                salt_inherited: true
            })
        );
        let KvEvent::BlockStored { cache_salt, .. } = &next else {
            unreachable!()
        };
        assert_eq!(cache_salt.as_deref(), Some("tenant-a"));
        // Block 3 stored again under another salt: its continuation cannot say which.
        assert!(a
            .admit(0, &mut stored(&[3], Some(2), Some("tenant-b")), &none)
            .is_ok());
        assert_eq!(
            a.admit(0, &mut stored(&[4], Some(3), None), &none),
            Err(Refusal::AmbiguousSalt)
        );
        // Removal forgets a salted block, never an ambiguous one.
        a.admit(0, &mut removed(&[1, 3]), &none).unwrap();
        assert_eq!(a.salted_blocks(), 2);
        a.admit(0, &mut KvEvent::AllBlocksCleared, &none).unwrap();
        assert_eq!(a.salted_blocks(), 0);
        // An unknown parent: unsalted, nothing kept.
        let mut orphan = stored(&[9], Some(8), None);
        assert!(a.admit(0, &mut orphan, &none).is_ok());
        assert_eq!(a.salted_blocks(), 0);
    }

    #[test]
    fn remote_and_foreign_events_are_refused_and_disk_stores_pass_as_they_come() {
        let mut a = Admission::default();
        let remote = EventMeta {
            locality: Some(Locality::Remote),
            ..EventMeta::default()
        };
        assert_eq!(
            a.admit(0, &mut stored(&[1], None, None), &remote),
            Err(Refusal::NotLocal)
        );
        let kvcr = EventMeta {
            ownership: Ownership::CacheService,
            ..EventMeta::default()
        };
        assert_eq!(
            a.admit(0, &mut stored(&[1], None, None), &kvcr),
            Err(Refusal::OtherOwner)
        );
        let mut disk = stored(&[1], None, None);
        if let KvEvent::BlockStored { medium, .. } = &mut disk {
            *medium = Some("STORAGE".into());
        }
        assert!(a
            .admit(0, &mut disk, &group(3, Some("sliding_window")))
            .is_ok());
    }
}
