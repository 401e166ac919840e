//! A `libnixl.so` on disk: its build-id and the file offsets of the `nixlAgent` methods
//! the probes attach to, resolved from the ELF dynamic symbol table (never hard-coded
//! addresses). C++ overloads are told apart by their mangled signatures.

use object::{Object, ObjectSection, ObjectSymbol, ObjectSymbolTable};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::derive::{self, Derivation, Isa, MethodCode};
use super::event::NixlCall;
use super::offsets::{EndRegisters, NixlOffsets, SitesAttached};

/// Where a probe fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeSide {
    Entry,
    Return,
    /// At one instruction inside the method where a transfer ends, a post returns or a
    /// creation fails, derived from the build ([`SiteGroup`]).
    Site(SiteName),
    /// At one instruction the derivation found ([`Derivation`]).
    Derived,
}

/// The groups of completion sites, each attached in place of its own status-call
/// probes, or not at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SiteGroup {
    /// Where `createXferReq` and `makeXferReq` fail: derived from each build's
    /// instructions ([`derive::CreationSites`]).
    Creations,
    /// Where `postXferReq`'s status is final on every return: derived from each build's
    /// instructions ([`derive::PostSite`]).
    Post,
    /// Where `getXferStatus` sees a transfer end and `releaseXferReq` one in flight:
    /// derived from each build's instructions ([`derive::EndSites`]).
    Ends,
}

/// The completion sites, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SiteName {
    /// Each of `createXferReq`'s failure paths (one probe each).
    CreateFailed,
    /// Each of `makeXferReq`'s.
    MakeFailed,
    PostReturned,
    StatusSucceeded,
    StatusFailed,
    StatusStale,
    ReleasedInFlight,
}

impl SiteName {
    fn group(self) -> SiteGroup {
        match self {
            Self::StatusSucceeded
            | Self::StatusFailed
            | Self::StatusStale
            | Self::ReleasedInFlight => SiteGroup::Ends,
            Self::PostReturned => SiteGroup::Post,
            Self::CreateFailed | Self::MakeFailed => SiteGroup::Creations,
        }
    }

    /// The derived instructions (virtual addresses) of this name, each with its probe's
    /// cookie where the site gives its own, and the method they are in; or why its
    /// group's were not derived.
    fn derived(self, derivation: &Derivation) -> Result<(Vec<Placed>, &'static str), String> {
        let ends = || derivation.end_sites.as_ref().map_err(Clone::clone);
        let plain = |v: &[u64]| v.iter().map(|a| (*a, None)).collect::<Vec<_>>();
        let failures = |sites: &Result<derive::CreationSites, String>, make: bool| {
            sites.as_ref().map_err(Clone::clone).map(|s| {
                let at = s.failed.iter().map(|f| (f.at, Some(f.cookie(make))));
                (at.collect(), s.symbol)
            })
        };
        Ok(match self {
            Self::StatusSucceeded => (plain(&ends()?.succeeded), derive::STATUS),
            Self::StatusFailed => (plain(&ends()?.failed), derive::STATUS),
            Self::StatusStale => (plain(&ends()?.stale), derive::STATUS),
            Self::ReleasedInFlight => (plain(&ends()?.released_in_flight), derive::RELEASE),
            Self::PostReturned => (
                plain(&[derivation.post_site.as_ref().map_err(Clone::clone)?.at]),
                derive::POST,
            ),
            Self::CreateFailed => failures(&derivation.create_sites, false)?,
            Self::MakeFailed => failures(&derivation.make_sites, true)?,
        })
    }
}

/// A derived site: its address, and its probe's cookie where it gives its own.
type Placed = (u64, Option<u64>);

/// One uprobe or uretprobe: which BPF program, on which method, with which cookie.
#[derive(Clone, Copy, Debug)]
pub struct ProbeSpec {
    /// The BPF program (C function name in `ebpf/nixl/`).
    pub program: &'static str,
    pub side: ProbeSide,
    /// Prefix of the mangled symbol; exactly one address must match.
    pub symbol_prefix: &'static str,
    /// The uprobe cookie: which method the shared call programs (and the transfer
    /// creation ones) are on. None where the program does not read it.
    pub call: Option<NixlCall>,
    /// Without it the transfer or handshake counts would be wrong: attaching fails.
    pub required: bool,
    /// One of the status-call probes: attached only where this group of the build's
    /// completion sites is not (they see the same events without firing on every poll,
    /// release or successful creation).
    pub replaced_by: Option<SiteGroup>,
    /// Attached only where the build does not export this method (the one an older
    /// build's method was replaced by, and which then forwards to it).
    pub unless_exported: Option<&'static str>,
}

const fn probe(
    program: &'static str,
    side: ProbeSide,
    symbol_prefix: &'static str,
    call: Option<NixlCall>,
    required: bool,
) -> ProbeSpec {
    ProbeSpec {
        program,
        side,
        symbol_prefix,
        call,
        required,
        replaced_by: None,
        unless_exported: None,
    }
}

/// A probe attached only where `newer` is not exported.
const fn unless_exported(mut spec: ProbeSpec, newer: &'static str) -> ProbeSpec {
    spec.unless_exported = Some(newer);
    spec
}

/// A probe not attached where the build's sites of `group` are (see
/// [`ProbeSpec::replaced_by`]).
const fn without_sites(group: SiteGroup, mut spec: ProbeSpec) -> ProbeSpec {
    spec.replaced_by = Some(group);
    spec
}

/// A completion-site probe.
const fn site(program: &'static str, name: SiteName, call: Option<NixlCall>) -> ProbeSpec {
    probe(program, ProbeSide::Site(name), "", call, true)
}

use ProbeSide::{Entry, Return};

/// `makeXferReq`'s overloads: the span one (1.5 on), the std::vector one taking its op
/// by reference (every build; before 1.5 the only one).
use derive::{MAKE_BY_REFERENCE, MAKE_SPAN};

/// The completion-site probes, attached instead of the status-call ones where the
/// build's sites are known (their methods are those of the sites).
pub(crate) const SITE_PROBES: &[ProbeSpec] = &[
    // Their cookies are each failure's own (`CreationFailure::cookie`).
    site("xfer_creation_failed", SiteName::CreateFailed, None),
    site("xfer_creation_failed", SiteName::MakeFailed, None),
    site(
        "post_xfer_returned",
        SiteName::PostReturned,
        Some(NixlCall::PostXferReq),
    ),
    site("xfer_status_changed", SiteName::StatusSucceeded, None),
    site("xfer_status_changed", SiteName::StatusFailed, None),
    site("xfer_status_stale", SiteName::StatusStale, None),
    site("xfer_released_in_flight", SiteName::ReleasedInFlight, None),
];

/// At the first instruction of `getXferTelemetry`'s refusal of an agent without
/// telemetry, where the derivation found it (`derive::RefusedSite`); runs only on
/// that path.
pub(crate) const TELEMETRY_REFUSED: ProbeSpec = probe(
    "xfer_telemetry_refused",
    ProbeSide::Derived,
    derive::TELEMETRY,
    Some(NixlCall::GetXferTelemetry),
    false,
);

/// Every probe, entry and return.
pub(crate) const PROBES: &[ProbeSpec] = &[
    probe(
        "agent_ctor_enter",
        Entry,
        "_ZN9nixlAgentC1E",
        Some(NixlCall::AgentCtor),
        false,
    ),
    probe(
        "agent_ctor_exit",
        Return,
        "_ZN9nixlAgentC1E",
        Some(NixlCall::AgentCtor),
        false,
    ),
    // With sites, a successful create is not probed at all: its post reads the request.
    without_sites(
        SiteGroup::Creations,
        probe(
            "create_xfer_enter",
            Entry,
            "_ZNK9nixlAgent13createXferReqE",
            Some(NixlCall::CreateXferReq),
            true,
        ),
    ),
    without_sites(
        SiteGroup::Creations,
        probe(
            "create_xfer_exit",
            Return,
            "_ZNK9nixlAgent13createXferReqE",
            Some(NixlCall::CreateXferReq),
            true,
        ),
    ),
    // The span overload; the std::vector one forwards to it. With sites, as a create.
    without_sites(
        SiteGroup::Creations,
        probe(
            "make_xfer_enter",
            Entry,
            MAKE_SPAN,
            Some(NixlCall::MakeXferReq),
            false,
        ),
    ),
    without_sites(
        SiteGroup::Creations,
        probe(
            "make_xfer_exit",
            Return,
            MAKE_SPAN,
            Some(NixlCall::MakeXferReq),
            false,
        ),
    ),
    // Before 1.5: the std::vector overload, op by reference, is the implementation (in
    // 1.5 it forwards to the span one, probed above).
    unless_exported(
        without_sites(
            SiteGroup::Creations,
            probe(
                "make_xfer_ref_enter",
                Entry,
                MAKE_BY_REFERENCE,
                Some(NixlCall::MakeXferReq),
                false,
            ),
        ),
        MAKE_SPAN,
    ),
    unless_exported(
        without_sites(
            SiteGroup::Creations,
            probe(
                "make_xfer_exit",
                Return,
                MAKE_BY_REFERENCE,
                Some(NixlCall::MakeXferReq),
                false,
            ),
        ),
        MAKE_SPAN,
    ),
    probe(
        "post_xfer_enter",
        Entry,
        "_ZNK9nixlAgent11postXferReqE",
        Some(NixlCall::PostXferReq),
        true,
    ),
    without_sites(
        SiteGroup::Post,
        probe(
            "post_xfer_exit",
            Return,
            "_ZNK9nixlAgent11postXferReqE",
            Some(NixlCall::PostXferReq),
            true,
        ),
    ),
    without_sites(
        SiteGroup::Ends,
        probe(
            "xfer_status_enter",
            Entry,
            "_ZNK9nixlAgent13getXferStatusE",
            None,
            true,
        ),
    ),
    without_sites(
        SiteGroup::Ends,
        probe(
            "xfer_status_exit",
            Return,
            "_ZNK9nixlAgent13getXferStatusE",
            None,
            true,
        ),
    ),
    without_sites(
        SiteGroup::Ends,
        probe(
            "release_xfer_enter",
            Entry,
            "_ZNK9nixlAgent14releaseXferReqE",
            None,
            true,
        ),
    ),
    probe(
        "call_enter",
        Entry,
        "_ZN9nixlAgent12loadRemoteMDE",
        Some(NixlCall::LoadRemoteMd),
        true,
    ),
    probe(
        "call_exit",
        Return,
        "_ZN9nixlAgent12loadRemoteMDE",
        Some(NixlCall::LoadRemoteMd),
        true,
    ),
    probe(
        "call_enter",
        Entry,
        "_ZN13nixlAgentData12loadRemoteMDE",
        Some(NixlCall::LoadRemoteMdAsync),
        false,
    ),
    probe(
        "call_exit",
        Return,
        "_ZN13nixlAgentData12loadRemoteMDE",
        Some(NixlCall::LoadRemoteMdAsync),
        false,
    ),
    probe(
        "call_enter",
        Entry,
        "_ZN9nixlAgent13fetchRemoteMDE",
        Some(NixlCall::FetchRemoteMd),
        false,
    ),
    probe(
        "call_exit",
        Return,
        "_ZN9nixlAgent13fetchRemoteMDE",
        Some(NixlCall::FetchRemoteMd),
        false,
    ),
    probe(
        "call_enter",
        Entry,
        "_ZNK9nixlAgent11sendLocalMDE",
        Some(NixlCall::SendLocalMd),
        false,
    ),
    probe(
        "call_exit",
        Return,
        "_ZNK9nixlAgent11sendLocalMDE",
        Some(NixlCall::SendLocalMd),
        false,
    ),
    probe(
        "call_enter",
        Entry,
        "_ZN9nixlAgent14makeConnectionE",
        Some(NixlCall::MakeConnection),
        false,
    ),
    probe(
        "call_exit",
        Return,
        "_ZN9nixlAgent14makeConnectionE",
        Some(NixlCall::MakeConnection),
        false,
    ),
    probe(
        "call_enter",
        Entry,
        "_ZNK9nixlAgent13checkRemoteMDE",
        Some(NixlCall::CheckRemoteMd),
        false,
    ),
    probe(
        "call_exit",
        Return,
        "_ZNK9nixlAgent13checkRemoteMDE",
        Some(NixlCall::CheckRemoteMd),
        false,
    ),
    probe(
        "call_enter",
        Entry,
        "_ZN9nixlAgent18invalidateRemoteMDE",
        Some(NixlCall::InvalidateRemoteMd),
        false,
    ),
    probe(
        "call_exit",
        Return,
        "_ZN9nixlAgent18invalidateRemoteMDE",
        Some(NixlCall::InvalidateRemoteMd),
        false,
    ),
    probe(
        "call_enter",
        Entry,
        "_ZNK9nixlAgent8genNotifE",
        Some(NixlCall::GenNotif),
        false,
    ),
    probe(
        "call_exit",
        Return,
        "_ZNK9nixlAgent8genNotifE",
        Some(NixlCall::GenNotif),
        false,
    ),
    probe(
        "call_enter",
        Entry,
        "_ZN9nixlAgent9getNotifsE",
        Some(NixlCall::GetNotifs),
        false,
    ),
    probe(
        "call_exit",
        Return,
        "_ZN9nixlAgent9getNotifsE",
        Some(NixlCall::GetNotifs),
        false,
    ),
    probe(
        "call_enter",
        Entry,
        "_ZN9nixlAgent11registerMemE",
        Some(NixlCall::RegisterMem),
        false,
    ),
    probe(
        "call_exit",
        Return,
        "_ZN9nixlAgent11registerMemE",
        Some(NixlCall::RegisterMem),
        false,
    ),
    probe(
        "call_enter",
        Entry,
        "_ZN9nixlAgent13deregisterMemE",
        Some(NixlCall::DeregisterMem),
        false,
    ),
    probe(
        "call_exit",
        Return,
        "_ZN9nixlAgent13deregisterMemE",
        Some(NixlCall::DeregisterMem),
        false,
    ),
];

/// Why a library cannot be traced.
#[derive(Debug, thiserror::Error)]
pub enum LibraryError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not an ELF shared library: {source}")]
    Parse {
        path: PathBuf,
        source: object::Error,
    },
    #[error("{path} is built for {architecture}: the offsets are derived from x86-64 and aarch64 builds only")]
    Architecture { path: PathBuf, architecture: String },
    #[error(
        "{path} is an {} build: this agent's probes read x86-64 registers \
         (`kvscope agent nixl-inspect` derives its offsets offline)",
        isa.name()
    )]
    ForeignIsa { path: PathBuf, isa: Isa },
    #[error("{path} has no dynamic symbol {prefix}…: not a libnixl.so this agent can trace")]
    MissingSymbol { path: PathBuf, prefix: &'static str },
    #[error("{path}: {count} different symbols start with {prefix}: the probe table needs a longer prefix")]
    AmbiguousSymbol {
        path: PathBuf,
        prefix: &'static str,
        count: usize,
    },
}

/// A probe resolved to a file offset in one library.
#[derive(Clone, Copy, Debug)]
pub struct ResolvedProbe {
    pub spec: ProbeSpec,
    pub file_offset: u64,
    /// The uprobe cookie: the spec's method, or what a site gives its program.
    pub cookie: Option<u64>,
}

/// What the agent learned about one `libnixl.so` file.
#[derive(Clone, Debug)]
pub struct NixlLibrary {
    pub path: PathBuf,
    /// GNU build-id, lowercase hex; empty when the library has none.
    pub build_id: String,
    pub probes: Vec<ResolvedProbe>,
    /// Optional methods this build does not export (their probes are skipped).
    pub missing: Vec<&'static str>,
    /// Transfers end at the build's completion sites, derived from its
    /// `getXferStatus` and `releaseXferReq` (no probe on a status poll or a release).
    pub sites: bool,
    /// Posts are seen returning at the site derived from `postXferReq` (else by its
    /// return probe).
    pub post_at_site: bool,
    /// Creations' failures are seen at the sites derived from `createXferReq` and
    /// `makeXferReq` (else at the methods' entries and returns).
    pub creations_at_sites: bool,
    /// The struct offsets the probes read, derived from the library's own
    /// instructions (None: a field could not be; [`Self::derivation`] says why).
    pub offsets: Option<NixlOffsets>,
    /// What was derived, field by field, and from which instructions.
    pub derivation: Derivation,
}

impl NixlLibrary {
    /// Read `path` and resolve every probe: with the completion sites derived from the
    /// build when `completion_sites` (each group where it was derived).
    pub fn inspect(path: &Path, completion_sites: bool) -> Result<Self, LibraryError> {
        let data = std::fs::read(path).map_err(|source| LibraryError::Read {
            path: path.to_owned(),
            source,
        })?;
        let file = object::File::parse(&*data).map_err(|source| LibraryError::Parse {
            path: path.to_owned(),
            source,
        })?;
        let isa = match file.architecture() {
            object::Architecture::X86_64 => Isa::X86_64,
            object::Architecture::Aarch64 => Isa::Aarch64,
            other => {
                return Err(LibraryError::Architecture {
                    path: path.to_owned(),
                    architecture: format!("{other:?}"),
                })
            }
        };
        let build_id = match file.build_id() {
            Ok(Some(id)) => id.iter().map(|b| format!("{b:02x}")).collect(),
            _ => String::new(),
        };
        // (name, file offset, size, address)
        let symbols: Vec<(String, u64, u64, u64)> = file
            .dynamic_symbols()
            .filter(|s| s.is_definition())
            .filter_map(|s| {
                let name = s.name().ok()?;
                let section = file.section_by_index(s.section_index()?).ok()?;
                let (sec_offset, _) = section.file_range()?;
                let addr = s.address().checked_sub(section.address())?;
                Some((name.to_string(), addr + sec_offset, s.size(), s.address()))
            })
            .collect();
        // The method starting with `prefix`: Ok(None) when not exported.
        let method = |prefix: &'static str| -> Result<Option<u64>, LibraryError> {
            let mut offsets: Vec<u64> = symbols
                .iter()
                .filter(|(n, ..)| n.starts_with(prefix))
                .map(|(_, o, ..)| *o)
                .collect();
            offsets.sort_unstable();
            offsets.dedup(); // C1/C2 constructor aliases share an address
            match offsets.as_slice() {
                [offset] => Ok(Some(*offset)),
                [] => Ok(None),
                many => Err(LibraryError::AmbiguousSymbol {
                    path: path.to_owned(),
                    prefix,
                    count: many.len(),
                }),
            }
        };
        // A derived method's code: the one symbol of that prefix, its bytes in the file.
        let code = |prefix: &'static str| -> Option<MethodCode<'_>> {
            let at = method(prefix).ok()??;
            let (_, _, size, address) = symbols.iter().find(|s| s.1 == at)?;
            let at = usize::try_from(at).ok()?;
            let bytes = data.get(at..at.checked_add(usize::try_from(*size).ok()?)?)?;
            Some(MethodCode {
                address: *address,
                bytes,
            })
        };
        // The file offset of a virtual address, and the section's bytes from there.
        let in_file = |address: u64| -> Option<(u64, &[u8])> {
            file.sections().find_map(|section| {
                let into = address.checked_sub(section.address())?;
                let (offset, size) = section.file_range()?;
                (into < size).then_some(())?;
                let at = offset.checked_add(into)?;
                let end = offset.checked_add(size)?;
                let bytes = data.get(usize::try_from(at).ok()?..usize::try_from(end).ok()?)?;
                Some((at, bytes))
            })
        };
        // A jump target's code (at most 4 KiB of it).
        let code_at = |address: u64| -> Option<MethodCode<'_>> {
            let (_, bytes) = in_file(address)?;
            Some(MethodCode {
                address,
                bytes: &bytes[..bytes.len().min(4096)],
            })
        };
        // What a direct call goes to: the dynamic symbol its PLT stub's GOT slot is
        // relocated to (the only names a stripped library keeps).
        let got: BTreeMap<u64, String> = file
            .dynamic_relocations()
            .into_iter()
            .flatten()
            .filter_map(|(slot, r)| {
                let object::RelocationTarget::Symbol(index) = r.target() else {
                    return None;
                };
                let table = file.dynamic_symbol_table()?;
                let name = table.symbol_by_index(index).ok()?.name().ok()?;
                Some((slot, name.to_string()))
            })
            .collect();
        let callee = |address: u64| -> Option<String> {
            let slot = derive::plt_slot(code_at(address)?)?;
            got.get(&slot).cloned()
        };
        let derivation = derived_once(&build_id, || derive::derive(isa, &code, &code_at, &callee));
        let derived = derivation.offsets().ok();
        let offsets = derived;
        // Transfers' ends, posts' returns and creations' failures, where the methods' own
        // instructions placed them (the request is read there, so the offsets are needed
        // too).
        let derived_probes = |group| {
            derived_probes(group, &derivation, &in_file)
                .filter(|_| completion_sites && derived.is_some())
        };
        let end_probes = derived_probes(SiteGroup::Ends);
        let post_probes = derived_probes(SiteGroup::Post);
        let creation_probes = derived_probes(SiteGroup::Creations);
        let sites = end_probes.is_some();
        let post_at_site = post_probes.is_some();
        let creations_at_sites = creation_probes.is_some();
        let attached = |group: Option<SiteGroup>| match group {
            Some(SiteGroup::Creations) => creations_at_sites,
            Some(SiteGroup::Post) => post_at_site,
            Some(SiteGroup::Ends) => sites,
            None => false,
        };
        let mut probes = Vec::new();
        let mut missing = Vec::new();
        for spec in PROBES.iter().filter(|p| !attached(p.replaced_by)) {
            if let Some(newer) = spec.unless_exported {
                if method(newer)?.is_some() {
                    continue;
                }
            }
            match method(spec.symbol_prefix)? {
                Some(offset) => probes.push(ResolvedProbe {
                    spec: *spec,
                    file_offset: offset,
                    cookie: spec.call.map(|c| c as u64),
                }),
                None if spec.required => {
                    return Err(LibraryError::MissingSymbol {
                        path: path.to_owned(),
                        prefix: spec.symbol_prefix,
                    })
                }
                None => {
                    if !missing.contains(&spec.symbol_prefix) {
                        missing.push(spec.symbol_prefix);
                    }
                }
            }
        }
        // A method replaced by its older form, probed instead, is not missing.
        missing.retain(|m| !probes.iter().any(|p| p.spec.unless_exported == Some(*m)));
        probes.extend(creation_probes.unwrap_or_default());
        probes.extend(end_probes.unwrap_or_default());
        probes.extend(post_probes.unwrap_or_default());
        // getXferTelemetry's refusals, where the derivation found their path.
        if let Some(file_offset) = derivation
            .telemetry_refused
            .as_ref()
            .ok()
            .and_then(|site| in_file(site.address))
            .map(|(at, _)| at)
        {
            probes.push(ResolvedProbe {
                spec: TELEMETRY_REFUSED,
                file_offset,
                cookie: None,
            });
        }
        Ok(Self {
            path: path.to_owned(),
            build_id,
            probes,
            missing,
            sites,
            post_at_site,
            creations_at_sites,
            offsets,
            derivation,
        })
    }
}

impl NixlLibrary {
    /// What the BPF programs' globals must say of the sites attached.
    pub fn sites_attached(&self) -> SitesAttached {
        SitesAttached {
            creations: match (&self.derivation.create_sites, &self.derivation.make_sites) {
                (Ok(c), Ok(m)) if self.creations_at_sites => Some((c.args, m.args)),
                _ => None,
            },
            post_status: self
                .derivation
                .post_site
                .as_ref()
                .ok()
                .filter(|_| self.post_at_site)
                .map(|p| p.status),
            ends: self
                .derivation
                .end_sites
                .as_ref()
                .ok()
                .filter(|_| self.sites)
                .map(|s| EndRegisters {
                    request: s.request,
                    stale_status: s.stale_status,
                    release_request: s.release_request,
                }),
        }
    }
}

/// A build's derivation, made once per build-id in this process (every process
/// mapping the same library asks again); a library without a build-id is derived
/// each time.
const MAX_CACHED_BUILDS: usize = 64;

fn derived_once(build_id: &str, derive: impl FnOnce() -> Derivation) -> Derivation {
    static DERIVED: std::sync::Mutex<BTreeMap<String, Derivation>> =
        std::sync::Mutex::new(BTreeMap::new());
    if build_id.is_empty() {
        return derive();
    }
    let mut cache = DERIVED.lock().unwrap_or_else(|p| p.into_inner());
    if cache.len() >= MAX_CACHED_BUILDS {
        cache.clear();
    }
    cache
        .entry(build_id.to_string())
        .or_insert_with(derive)
        .clone()
}

/// A derived group's probes at its sites, or None when the group was not derived or
/// a site is outside the file.
fn derived_probes<'a>(
    group: SiteGroup,
    derivation: &Derivation,
    in_file: &dyn Fn(u64) -> Option<(u64, &'a [u8])>,
) -> Option<Vec<ResolvedProbe>> {
    let mut probes = Vec::new();
    for spec in SITE_PROBES {
        let ProbeSide::Site(name) = spec.side else {
            continue;
        };
        if name.group() != group {
            continue;
        }
        let (at, method) = name.derived(derivation).ok()?;
        for (address, cookie) in at {
            let (file_offset, _) = in_file(address)?;
            let mut spec = *spec;
            spec.symbol_prefix = method;
            probes.push(ResolvedProbe {
                spec,
                file_offset,
                cookie: cookie.or(spec.call.map(|c| c as u64)),
            });
        }
    }
    Some(probes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_named_in_the_table_exist_in_the_bpf_source() {
        let src = [
            include_str!("../../../ebpf/nixl/agent.bpf.c"),
            include_str!("../../../ebpf/nixl/xfer.bpf.c"),
            include_str!("../../../ebpf/nixl/calls.bpf.c"),
        ]
        .concat();
        for p in PROBES.iter().chain(SITE_PROBES).chain([&TELEMETRY_REFUSED]) {
            let decl = match p.side {
                ProbeSide::Entry | ProbeSide::Derived => format!("BPF_KPROBE({},", p.program),
                ProbeSide::Site(_) => format!("BPF_KPROBE({})", p.program),
                ProbeSide::Return => format!("BPF_KRETPROBE({})", p.program),
            };
            assert!(src.contains(&decl), "{} not in ebpf/nixl", p.program);
        }
    }

    /// With the sites a successful `createXferReq` or `makeXferReq` fires no probe:
    /// their entry and return probes are ones the creation sites replace (the sites are
    /// on failure paths only: `nixl_derive.rs` checks them against each build's).
    #[test]
    fn with_sites_a_successful_creation_is_not_probed() {
        for method in [derive::CREATE, MAKE_SPAN, MAKE_BY_REFERENCE] {
            let probes: Vec<_> = PROBES
                .iter()
                .filter(|p| p.symbol_prefix == method)
                .collect();
            assert!(!probes.is_empty(), "{method}");
            assert!(
                probes
                    .iter()
                    .all(|p| p.replaced_by == Some(SiteGroup::Creations)),
                "{method}"
            );
        }
        assert!(SITE_PROBES
            .iter()
            .any(|p| matches!(p.side, ProbeSide::Site(n) if n.group() == SiteGroup::Creations)));
    }

    #[test]
    fn a_file_that_is_not_elf_is_refused_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("libnixl.so");
        std::fs::write(&p, b"not an elf").unwrap();
        let err = NixlLibrary::inspect(&p, true).unwrap_err().to_string();
        assert!(
            err.contains("libnixl.so") && err.contains("not an ELF"),
            "{err}"
        );
        let err = NixlLibrary::inspect(&dir.path().join("nope.so"), true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot read"), "{err}");
    }
}
