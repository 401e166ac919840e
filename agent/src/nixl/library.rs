//! A `libnixl.so` on disk: its build-id and the file offsets of the `nixlAgent` methods
//! the probes attach to, resolved from the ELF dynamic symbol table (never hard-coded
//! addresses). C++ overloads are told apart by their mangled signatures.

use object::{Object, ObjectSection, ObjectSymbol};
use std::path::{Path, PathBuf};

use super::event::NixlCall;

/// Where a probe fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeSide {
    Entry,
    Return,
}

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
    }
}

use ProbeSide::{Entry, Return};

/// Every probe, entry and return.
pub const PROBES: &[ProbeSpec] = &[
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
    probe(
        "create_xfer_enter",
        Entry,
        "_ZNK9nixlAgent13createXferReqE",
        Some(NixlCall::CreateXferReq),
        true,
    ),
    probe(
        "create_xfer_exit",
        Return,
        "_ZNK9nixlAgent13createXferReqE",
        Some(NixlCall::CreateXferReq),
        true,
    ),
    // The span overload; the std::vector one forwards to it.
    probe(
        "make_xfer_enter",
        Entry,
        "_ZNK9nixlAgent11makeXferReqE14nixl_xfer_op_t",
        Some(NixlCall::MakeXferReq),
        false,
    ),
    probe(
        "make_xfer_exit",
        Return,
        "_ZNK9nixlAgent11makeXferReqE14nixl_xfer_op_t",
        Some(NixlCall::MakeXferReq),
        false,
    ),
    probe(
        "post_xfer_enter",
        Entry,
        "_ZNK9nixlAgent11postXferReqE",
        Some(NixlCall::PostXferReq),
        true,
    ),
    probe(
        "post_xfer_exit",
        Return,
        "_ZNK9nixlAgent11postXferReqE",
        Some(NixlCall::PostXferReq),
        true,
    ),
    probe(
        "xfer_status_enter",
        Entry,
        "_ZNK9nixlAgent13getXferStatusE",
        None,
        true,
    ),
    probe(
        "xfer_status_exit",
        Return,
        "_ZNK9nixlAgent13getXferStatusE",
        None,
        true,
    ),
    probe(
        "release_xfer_enter",
        Entry,
        "_ZNK9nixlAgent14releaseXferReqE",
        None,
        true,
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
}

impl NixlLibrary {
    /// Read `path` and resolve every probe.
    pub fn inspect(path: &Path) -> Result<Self, LibraryError> {
        let data = std::fs::read(path).map_err(|source| LibraryError::Read {
            path: path.to_owned(),
            source,
        })?;
        let file = object::File::parse(&*data).map_err(|source| LibraryError::Parse {
            path: path.to_owned(),
            source,
        })?;
        let build_id = match file.build_id() {
            Ok(Some(id)) => id.iter().map(|b| format!("{b:02x}")).collect(),
            _ => String::new(),
        };
        let symbols: Vec<(String, u64)> = file
            .dynamic_symbols()
            .filter(|s| s.is_definition())
            .filter_map(|s| {
                let name = s.name().ok()?;
                let section = file.section_by_index(s.section_index()?).ok()?;
                let (sec_offset, _) = section.file_range()?;
                let addr = s.address().checked_sub(section.address())?;
                Some((name.to_string(), addr + sec_offset))
            })
            .collect();
        let mut probes = Vec::new();
        let mut missing = Vec::new();
        for spec in PROBES {
            let mut offsets: Vec<u64> = symbols
                .iter()
                .filter(|(n, _)| n.starts_with(spec.symbol_prefix))
                .map(|(_, o)| *o)
                .collect();
            offsets.sort_unstable();
            offsets.dedup(); // C1/C2 constructor aliases share an address
            match offsets.as_slice() {
                [offset] => probes.push(ResolvedProbe {
                    spec: *spec,
                    file_offset: *offset,
                }),
                [] if spec.required => {
                    return Err(LibraryError::MissingSymbol {
                        path: path.to_owned(),
                        prefix: spec.symbol_prefix,
                    })
                }
                [] => {
                    if !missing.contains(&spec.symbol_prefix) {
                        missing.push(spec.symbol_prefix);
                    }
                }
                many => {
                    return Err(LibraryError::AmbiguousSymbol {
                        path: path.to_owned(),
                        prefix: spec.symbol_prefix,
                        count: many.len(),
                    })
                }
            }
        }
        Ok(Self {
            path: path.to_owned(),
            build_id,
            probes,
            missing,
        })
    }
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
        for p in PROBES {
            let decl = match p.side {
                ProbeSide::Entry => format!("BPF_KPROBE({},", p.program),
                ProbeSide::Return => format!("BPF_KRETPROBE({})", p.program),
            };
            assert!(src.contains(&decl), "{} not in ebpf/nixl", p.program);
        }
    }

    #[test]
    fn a_file_that_is_not_elf_is_refused_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("libnixl.so");
        std::fs::write(&p, b"not an elf").unwrap();
        let err = NixlLibrary::inspect(&p).unwrap_err().to_string();
        assert!(
            err.contains("libnixl.so") && err.contains("not an ELF"),
            "{err}"
        );
        let err = NixlLibrary::inspect(&dir.path().join("nope.so"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot read"), "{err}");
    }
}
