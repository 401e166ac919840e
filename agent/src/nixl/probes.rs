//! Loading the NIXL BPF object for one `libnixl.so` and attaching its probes.
//!
//! One BPF object per library file: the struct offsets are per build, and they are
//! read-only globals fixed at load time. Uprobes are tied to the file's inode, so with
//! [`AttachScope::AllProcesses`] the probes fire in every process that maps this file,
//! including ones started later or restarted. Dropping [`LoadedProbes`] detaches them.

use aya::maps::{HashMap, IterableMap, MapData, MapError, PerCpuArray, RingBuf};
use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope};
use aya::programs::{ProgramError, UProbe};
use aya::{Ebpf, EbpfLoader};
use std::num::NonZeroU32;
use std::path::Path;

use super::library::{NixlLibrary, ProbeSide};
use super::offsets::{NixlOffsets, SitesAttached};
use super::tally::{
    decode_xfer_key, InflightEntry, KernelTally, TallyKey, INFLIGHT_SIZE, TALLY_KEY_SIZE,
    TALLY_SIZE, XFER_KEY_SIZE,
};

/// The compiled BPF object (built by `build.rs` from `ebpf/nixl/`).
static NIXL_BPF: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/nixl.bpf.o"));

/// Which processes the probes fire in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachScope {
    /// Every process mapping the library file, now or later.
    AllProcesses,
    /// One process only.
    Process(NonZeroU32),
}

/// How the probes count transfers where the build's offsets are known: in a kernel
/// table of `tally_series` series, sending the records only of every failure, every
/// transfer carrying a notification, every one slower than `slow_ns` (0: none for that
/// alone), and one in `sample_every` of the rest (1: all).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferCounting {
    pub tally_series: u32,
    pub sample_every: u64,
    pub slow_ns: u64,
}

impl Default for TransferCounting {
    fn default() -> Self {
        Self {
            tally_series: 512,
            sample_every: 1,
            slow_ns: 0,
        }
    }
}

/// Why probes could not be loaded or attached; each names what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(
        "this kernel has no uprobe support (/sys/bus/event_source/devices/uprobe is missing): \
         NIXL tracing needs a kernel built with CONFIG_UPROBE_EVENTS"
    )]
    NoUprobes,
    #[error(
        "loading the NIXL BPF programs was refused ({error}): {diagnosis}; the agent needs \
         root, or CAP_SYS_ADMIN (CAP_BPF + CAP_PERFMON on kernels that open uprobes to \
         CAP_PERFMON; + CAP_SYS_RESOURCE before 5.11)"
    )]
    Permission { error: String, diagnosis: String },
    #[error("loading the NIXL BPF programs failed: {0}")]
    Load(String),
    #[error("attaching {program} to {symbol} in {path} failed: {error}")]
    Attach {
        program: &'static str,
        symbol: &'static str,
        path: String,
        error: String,
    },
}

fn is_permission(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if matches!(io.raw_os_error(), Some(1) | Some(13)) {
                return true;
            }
        }
        let text = err.to_string();
        if text.contains("Operation not permitted") || text.contains("Permission denied") {
            return true;
        }
        cur = err.source();
    }
    false
}

/// A refusal to load, with the capabilities this process lacks named.
fn refused(e: &dyn std::error::Error) -> ProbeError {
    ProbeError::Permission {
        error: full_error(e),
        diagnosis: crate::capabilities::diagnose_load(),
    }
}

/// A refusal to attach (open the uprobe perf event), with what this process lacks.
fn refused_attach(e: &dyn std::error::Error) -> ProbeError {
    ProbeError::Permission {
        error: full_error(e),
        diagnosis: crate::capabilities::diagnose_attach(),
    }
}

fn full_error(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        s.push_str(": ");
        s.push_str(&err.to_string());
        cur = err.source();
    }
    s
}

/// The probes attached to one library, with their ring buffer and loss counter.
pub struct LoadedProbes {
    pub library: NixlLibrary,
    pub offsets: Option<NixlOffsets>,
    pub scope: AttachScope,
    /// Number of attached uprobes and uretprobes.
    pub attached: usize,
    // Keeps the programs and their links alive; dropping detaches.
    ebpf: Ebpf,
}

/// The BPF object loaded (its maps created) with `offsets` in its globals.
fn load_object(
    offsets: Option<&NixlOffsets>,
    sites: SitesAttached,
    counting: TransferCounting,
) -> Result<Ebpf, ProbeError> {
    if !Path::new("/sys/bus/event_source/devices/uprobe").exists() {
        return Err(ProbeError::NoUprobes);
    }
    let globals = NixlOffsets::globals(offsets, sites);
    let mut loader = EbpfLoader::new();
    for (name, value) in &globals {
        loader.override_global(name, value, true);
    }
    let every = counting.sample_every.max(1);
    loader.override_global("sample_every", &every, true);
    loader.override_global("slow_ns", &counting.slow_ns, true);
    loader.map_max_entries("xfer_tallies", counting.tally_series.max(1));
    loader.load(NIXL_BPF).map_err(|e| {
        if is_permission(&e) {
            refused(&e)
        } else {
            ProbeError::Load(full_error(&e))
        }
    })
}

/// Load the BPF object and one program, then drop them: at start, so an agent that may
/// not load probes says so (naming what it lacks) before any library is found, rather
/// than at each library later.
pub(crate) fn check_can_load() -> Result<(), ProbeError> {
    let mut ebpf = load_object(None, SitesAttached::default(), TransferCounting::default())?;
    if let Some((_, program)) = ebpf.programs_mut().next() {
        let program: &mut UProbe = program
            .try_into()
            .map_err(|e: ProgramError| ProbeError::Load(full_error(&e)))?;
        program.load().map_err(|e| {
            if is_permission(&e) {
                refused(&e)
            } else {
                ProbeError::Load(full_error(&e))
            }
        })?;
        // And open one uprobe perf event, as attaching to a library will: on this
        // process's own file, at offset 0 (its ELF header, never executed, so the
        // probe never fires), dropped at once.
        let exe = std::fs::read_link("/proc/self/exe")
            .map_err(|e| ProbeError::Load(format!("cannot read /proc/self/exe: {e}")))?;
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(0),
            cookie: None,
        };
        let link = program
            .attach(point, &exe, UProbeScope::AllProcesses)
            .map_err(|e| {
                if is_permission(&e) {
                    refused_attach(&e)
                } else {
                    ProbeError::Load(format!(
                        "a test uprobe on {} failed: {}",
                        exe.display(),
                        full_error(&e)
                    ))
                }
            })?;
        let _ = program.detach(link);
    }
    Ok(())
}

impl LoadedProbes {
    /// Load the BPF object with `library`'s offsets and attach every probe it resolved.
    pub fn attach(
        library: NixlLibrary,
        scope: AttachScope,
        counting: TransferCounting,
    ) -> Result<Self, ProbeError> {
        let offsets = library.offsets;
        let mut ebpf = load_object(offsets.as_ref(), library.sites_attached(), counting)?;
        let path = library.path.display().to_string();
        let aya_scope = match scope {
            AttachScope::AllProcesses => UProbeScope::AllProcesses,
            AttachScope::Process(pid) => UProbeScope::OneProcess(pid),
        };
        let mut attached = 0;
        for probe in &library.probes {
            let spec = probe.spec;
            let attach_err = |error: String| ProbeError::Attach {
                program: spec.program,
                symbol: spec.symbol_prefix,
                path: path.clone(),
                error,
            };
            let program: &mut UProbe = ebpf
                .program_mut(spec.program)
                .ok_or_else(|| attach_err("no such program in the BPF object".into()))?
                .try_into()
                .map_err(|e: ProgramError| attach_err(full_error(&e)))?;
            if program.fd().is_err() {
                program.load().map_err(|e| {
                    if is_permission(&e) {
                        refused(&e)
                    } else {
                        attach_err(full_error(&e))
                    }
                })?;
            }
            debug_assert_eq!(
                matches!(program.kind(), aya::programs::ProbeKind::Return),
                spec.side == ProbeSide::Return
            );
            let point = UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(probe.file_offset),
                cookie: probe.cookie,
            };
            program
                .attach(point, &library.path, aya_scope)
                .map_err(|e| {
                    if is_permission(&e) {
                        refused_attach(&e)
                    } else {
                        attach_err(full_error(&e))
                    }
                })?;
            attached += 1;
        }
        Ok(Self {
            library,
            offsets,
            scope,
            attached,
            ebpf,
        })
    }

    /// Take the ring buffer the probes write to (once).
    pub(crate) fn take_ring(&mut self) -> Option<RingBuf<MapData>> {
        RingBuf::try_from(self.ebpf.take_map("events")?).ok()
    }

    /// Records the probes could not write: the ring buffer was full, or a post's
    /// per-thread slot was taken by another thread's post before it returned.
    pub fn lost(&self) -> u64 {
        self.ebpf
            .map("lost")
            .and_then(|m| PerCpuArray::<_, u64>::try_from(m).ok())
            .and_then(|a| a.get(&0, 0).ok())
            .map(|v| v.iter().sum())
            .unwrap_or(0)
    }

    /// The kernel's tallies of transfers (none where the build's offsets are unknown:
    /// then every transfer's record is sent and counted by the agent); an error where
    /// the table could not be read whole (the caller must not take a part for all).
    pub(crate) fn tallies(&self) -> Result<Vec<(TallyKey, KernelTally)>, MapError> {
        let map = self
            .ebpf
            .map("xfer_tallies")
            .ok_or_else(|| MapError::InvalidName {
                name: "xfer_tallies".into(),
            })?;
        let map = HashMap::<_, [u8; TALLY_KEY_SIZE], [u8; TALLY_SIZE]>::try_from(map)?;
        // Entries are only added while this reads (deleted by this process alone), so
        // the walk sees each once.
        map.iter()
            .map(|r| r.map(|(k, v)| (TallyKey::decode(&k), KernelTally::decode(&v))))
            .collect()
    }

    /// The transfers in flight: (pid, request, entry). The probes delete entries as
    /// transfers end, and a walk whose last key went starts over from the first: each
    /// request is taken once, and the walk stops after twice the table's size (as the
    /// kernel says it is).
    pub(crate) fn in_flight(&self) -> Vec<(u32, u64, InflightEntry)> {
        let Some(map) = self.ebpf.map("inflight") else {
            return Vec::new();
        };
        let Ok(map) = HashMap::<_, [u8; XFER_KEY_SIZE], [u8; INFLIGHT_SIZE]>::try_from(map) else {
            return Vec::new();
        };
        let Ok(info) = map.map().info() else {
            return Vec::new();
        };
        let walk = 2 * info.max_entries() as usize;
        let mut seen = std::collections::HashMap::new();
        for (k, v) in map.iter().take(walk).filter_map(Result::ok) {
            seen.entry(decode_xfer_key(&k))
                .or_insert_with(|| InflightEntry::decode(&v));
        }
        seen.into_iter()
            .map(|((pid, req), e)| (pid, req, e))
            .collect()
    }

    /// Delete what the probes keep of processes that exited: their tallies (the agent
    /// keeps their figures) and transfers they left in flight.
    pub(crate) fn forget_processes(&mut self, pids: &[u32]) {
        self.delete_keys::<TALLY_KEY_SIZE, TALLY_SIZE>("xfer_tallies", |k| {
            pids.contains(&TallyKey::decode(k).pid)
        });
        self.delete_keys::<XFER_KEY_SIZE, INFLIGHT_SIZE>("inflight", |k| {
            pids.contains(&decode_xfer_key(k).0)
        });
    }

    /// Delete the entries of hash map `name` whose key `gone` picks.
    fn delete_keys<const K: usize, const V: usize>(
        &mut self,
        name: &str,
        gone: impl Fn(&[u8; K]) -> bool,
    ) {
        let Some(map) = self.ebpf.map_mut(name) else {
            return;
        };
        let Ok(mut map) = HashMap::<_, [u8; K], [u8; V]>::try_from(map) else {
            return;
        };
        let keys: Vec<[u8; K]> = map
            .keys()
            .filter_map(Result::ok)
            .filter(|k| gone(k))
            .collect();
        for k in keys {
            let _ = map.remove(&k);
        }
    }
}
